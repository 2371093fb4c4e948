"""Does accumulating dlm_head in bf16 across loss chunks change what the student learns?

On the demo (configs/demo.py: real text, a trained teacher's top-100 cache), the student is
distilled (bf16 matmuls) with the loss split into 12-position chunks, so each step's dlm_head is
the sum of 171 chunk contributions, rounded to bf16 after every one of them (loss.dw_dtype
"bfloat16") or accumulated in float32 and rounded once (loss.dw_dtype "float32"); that is as
many roundings as a 256K-token step at shape A gets (BENCHMARKS.md, "dW accumulated in bf16 vs
float32"). The seed changes model init and data order; the spread between seeds is the yardstick.

    python -m experiments.archive.dw_accumulation_ab [--seeds 0,1] [--out runs/dw_ab]

Makes the demo's data, teacher and cache first (OUT/demo, the demo's own stages; skipped when
present; a few minutes on a CPU). Writes OUT/results.json and prints the held-out KL and CE.
"""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.studies import demo_ab

CHUNK = 12


def main():
  args = demo_ab.parse_args(__doc__, "runs/dw_ab")
  prep = demo_ab.prepare(args.out)
  results = {}
  for seed in args.seeds:
    for dw_dtype in ("float32", "bfloat16"):
      def edit(c, dw_dtype=dw_dtype):
        c.loss.chunk_size = CHUNK
        c.loss.dw_dtype = dw_dtype
      name = f"{dw_dtype}_seed{seed}"
      results[name] = demo_ab.distil(prep, args.out, name, seed, edit)
      demo_ab.report(results, args.out)


if __name__ == "__main__":
  main()
