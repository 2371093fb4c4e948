"""Shared by the studies on the demo (fidelity.py here, the A/B studies in experiments/archive/):
the demo's data, teacher and cache made once, then the student distilled per arm and seed (stages
train + eval) and the held-out results tabled."""
import argparse
import contextlib
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from configs import demo
from kdjax import pipeline


def parse_args(doc: str, out: str, add_arguments=lambda parser: None) -> argparse.Namespace:
  """--seeds (comma-separated) and --out (default out) for an A/B script whose help is doc, plus
  whatever add_arguments(parser) adds."""
  parser = argparse.ArgumentParser(description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--seeds", default="0,1")
  parser.add_argument("--out", default=out)
  add_arguments(parser)
  args = parser.parse_args()
  args.seeds = [int(x) for x in args.seeds.split(",")]
  return args


def prepare(out: str, variant: str = ""):
  """The demo's data, teacher and cache under OUT/demo (skipped when present); their config.
  variant "smoke": configs/demo.py:smoke's tiny shapes."""
  prep = demo.get_config(variant)
  prep.workdir = os.path.join(out, "demo")
  prep.stages = ("data", "pretrain", "cache")
  pipeline.run(prep)
  return prep


def distil(prep, out: str, name: str, seed: int, edit=lambda c: None,
           train_only=contextlib.nullcontext) -> dict:
  """The demo student distilled in OUT/NAME from prep's cache (bf16 matmuls, as on a GPU), the
  config changed by edit(c); returns its held-out evaluation. Stage train runs inside
  `with train_only():` (an arm's change to the loss), stage eval outside it: evaluation reads the
  loss's per-position terms, which every arm must measure alike."""
  c = prep.copy_and_resolve_references()
  c.workdir = os.path.join(out, name)
  c.cache.path = os.path.join(prep.workdir, "cache")
  c.data.tokenizer = os.path.join(prep.workdir, "data", "tokenizer.json")
  c.stages = ("train", "eval")
  c.seed = seed
  c.student.dtype = "bfloat16"
  edit(c)
  os.makedirs(c.workdir, exist_ok=True)
  link = os.path.join(c.workdir, "data")
  if not os.path.exists(link):
    os.symlink(os.path.abspath(os.path.join(prep.workdir, "data")), link)
  for stage, context in (("train", train_only), ("eval", contextlib.nullcontext)):
    c.stages = (stage,)
    with context():
      pipeline.run(c)
  with open(os.path.join(c.workdir, "eval.json")) as f:
    return json.load(f)["student"]


def report(results: dict, out: str):
  with open(os.path.join(out, "results.json"), "w") as f:
    json.dump(results, f, indent=2)
  print(f"{'run':20} {'KL to teacher':>14} {'top-1 agree':>12} {'held-out CE':>12}")
  for name, r in results.items():
    print(f"{name:20} {r['kl']:14.5f} {r['top1_agreement']:12.4f} {r['ce']:12.5f}")
