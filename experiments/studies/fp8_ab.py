"""Does training the student's projections in FP8 (student.fp8_matmuls, kdjax/models/fp8.py)
change what it learns?

On the demo (configs/demo.py: real text, a trained teacher's top-100 cache), the student is
distilled with bf16 matmuls or with its block's projections (q, k, v, o, gate, up, down) in FP8:
e4m3 operands, e5m2 gradients, one power-of-two scale per tensor. The quantization is the same on
a CPU as on a GPU (only the products' accumulation order differs), so the held-out numbers say
what FP8's rounding costs. The seed changes model init and data order; the spread between seeds
is the yardstick. The demo's student is small (d_model 96): each dot sums fewer products, so its
rounding averages out less than a 3B student's would.

    python -m experiments.studies.fp8_ab [--seeds 0,1,2] [--out runs/fp8_ab] \
        [--results experiments/results/fp8_ab.jsonl] [--arms bf16,fp8] [--gradients e5m2]

--gradients e4m3: the FP8 arm's incoming gradients in e4m3 (more precision, less range) instead
of kdjax's e5m2, to see which of the formats' rounding the student pays for; set while the arm
trains (kdjax.models.fp8's E5M2, read when the step is traced), so run one setting per process:
the jitted step is kept per model, and an FP8 arm of another setting would reuse it.

Makes the demo's data, teacher and cache first (OUT/demo, skipped when present; a few minutes on
a CPU). Writes OUT/results.json, prints the held-out KL and CE per arm and seed, and appends one
line per arm and seed (with commit and date) to --results.
"""
import contextlib
import functools
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments.bench import e2e_bench
from experiments.studies import demo_ab
from kdjax.models import fp8

RESULTS = os.path.join(ROOT, "experiments", "results", "fp8_ab.jsonl")


def main():
  args = demo_ab.parse_args(__doc__, "runs/fp8_ab", add_arguments)
  prep = demo_ab.prepare(args.out)
  results = {}
  for seed in args.seeds:
    for arm in args.arms.split(","):
      def edit(c, arm=arm):
        c.student.fp8_matmuls = arm == "fp8"
      name = f"{arm}_seed{seed}" + (f"_{args.gradients}" if arm == "fp8" and
                                    args.gradients != "e5m2" else "")
      results[name] = demo_ab.distil(prep, args.out, name, seed, edit,
                                     functools.partial(gradients_in, args.gradients))
      demo_ab.report(results, args.out)
      e2e_bench.record({"study": "fp8_ab", "arm": arm, "seed": seed, "device": "cpu",
                        **({"gradients": args.gradients} if arm == "fp8" else {}),
                        **{k: results[name][k] for k in ("kl", "top1_agreement", "ce")},
                        "commit": e2e_bench.commit(), "date": e2e_bench.today()}, args.results)


def add_arguments(parser):
  parser.add_argument("--results", default=RESULTS,
                      help="jsonl file to append the lines to ('' for none)")
  parser.add_argument("--arms", default="bf16,fp8", help="comma-separated: bf16, fp8")
  parser.add_argument("--gradients", default="e5m2", choices=("e5m2", "e4m3"),
                      help="the FP8 arm's format of the incoming gradients")


@contextlib.contextmanager
def gradients_in(name: str):
  """The FP8 backward's incoming gradients in format `name` while the arm trains."""
  kept = fp8.E5M2
  fp8.E5M2 = {"e5m2": fp8.E5M2, "e4m3": fp8.E4M3}[name]
  try:
    yield
  finally:
    fp8.E5M2 = kept


if __name__ == "__main__":
  main()
