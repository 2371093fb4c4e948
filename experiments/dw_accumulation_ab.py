"""Does accumulating dlm_head in bf16 across loss chunks change what the student learns?

On the demo (configs/demo.py: real text, a trained teacher's top-100 cache), the student is
distilled (bf16 matmuls) with the loss split into 12-position chunks, so each step's dlm_head is the sum of 171
chunk contributions, rounded to bf16 after every one of them (loss.dw_dtype "bfloat16") or
accumulated in float32 and rounded once (loss.dw_dtype "float32"); that is as many roundings as
a 256K-token step at shape A gets (BENCHMARKS.md, "dW accumulated in bf16 vs float32"). The seed
changes model init and data order; the spread between seeds is the yardstick.

    python experiments/dw_accumulation_ab.py [--seeds 0,1] [--out runs/dw_ab]

Makes the demo's data, teacher and cache first (OUT/demo, the demo's own stages; skipped when
present; a few minutes on a CPU). Writes OUT/results.json and prints a table of the held-out KL and CE.
"""
import argparse
import json
import os

from configs import demo
from kdjax import pipeline

CHUNK = 12


def config(base, workdir, dw_dtype, seed):
  c = demo.get_config()
  c.workdir = workdir
  c.cache.path = os.path.join(base, "cache")
  c.data.tokenizer = os.path.join(base, "data", "tokenizer.json")
  c.stages = ("train", "eval")
  c.loss.chunk_size = CHUNK
  c.loss.dw_dtype = dw_dtype
  c.seed = seed
  c.student.dtype = "bfloat16"  # bf16 matmuls as on a GPU: the loss sees a bf16 lm_head
  return c


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--seeds", default="0,1")
  parser.add_argument("--out", default="runs/dw_ab")
  args = parser.parse_args()
  prep = demo.get_config()
  prep.workdir = os.path.join(args.out, "demo")
  prep.stages = ("data", "pretrain", "cache")
  pipeline.run(prep)  # skips what already exists
  results = {}
  for seed in (int(s) for s in args.seeds.split(",")):
    for dw_dtype in ("float32", "bfloat16"):
      name = f"{dw_dtype}_seed{seed}"
      workdir = os.path.join(args.out, name)
      os.makedirs(workdir, exist_ok=True)
      data_link = os.path.join(workdir, "data")
      if not os.path.exists(data_link):
        os.symlink(os.path.abspath(os.path.join(prep.workdir, "data")), data_link)
      pipeline.run(config(prep.workdir, workdir, dw_dtype, seed))
      with open(os.path.join(workdir, "eval.json")) as f:
        results[name] = json.load(f)["student"]
      with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
  print(f"{'run':20} {'KL to teacher':>14} {'top-1 agree':>12} {'held-out CE':>12}")
  for name, r in results.items():
    print(f"{name:20} {r['kl']:14.5f} {r['top1_agreement']:12.4f} {r['ce']:12.5f}")


if __name__ == "__main__":
  main()
