"""Does training the student's projections in FP8 (student.fp8_matmuls, kdjax/models/fp8.py)
change what it learns?

On the demo (configs/demo.py: real text, a trained teacher's top-100 cache), the student is
distilled with bf16 matmuls or with its block's projections (q, k, v, o, gate, up, down) in FP8:
e4m3 operands, e5m2 gradients, one power-of-two scale per tensor. The quantization is the same on
a CPU as on a GPU (only the products' accumulation order differs), so the held-out numbers say
what FP8's rounding costs. The seed changes model init and data order; the spread between seeds
is the yardstick. The demo's student is small (d_model 96): each dot sums fewer products, so its
rounding averages out less than a 3B student's would.

    python experiments/studies/fp8_ab.py [--seeds 0,1,2] [--out runs/fp8_ab]

Makes the demo's data, teacher and cache first (OUT/demo, skipped when present; a few minutes on
a CPU). Writes OUT/results.json and prints the held-out KL and CE per arm and seed.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import demo_ab  # noqa: E402


def main():
  args = demo_ab.parse_args(__doc__, "runs/fp8_ab")
  prep = demo_ab.prepare(args.out)
  results = {}
  for seed in args.seeds:
    for arm in ("bf16", "fp8"):
      def edit(c, arm=arm):
        c.student.fp8_matmuls = arm == "fp8"
      name = f"{arm}_seed{seed}"
      results[name] = demo_ab.distil(prep, args.out, name, seed, edit)
      demo_ab.report(results, args.out)


if __name__ == "__main__":
  main()
