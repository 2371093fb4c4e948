"""Which recipe makes a distilled student better than hard labels? SmolLM2-135M-Instruct into the
pruned 35M student (configs/smollm2.py), every arm with the same tuning budget.

    python -m kdjax.smollm2 --out runs/smollm2                  # teacher checkpoint + corpora
    python -m experiments.studies.recipe_study --root runs/smollm2 --processes 4   # resumable
    python -m experiments.studies.recipe_study --table          # table and plot from the results

Phases and their order: experiments/studies/recipe_schedule.py.
Every arm shares the data store and the learning-rate schedule's shape (warmup a tenth of the
steps at most 40, cosine to 10%), 64 rows x 2048 tokens a step. Each finished arm is measured
on the held-out split (whole works and packages never trained on; --eval-rows rows) against the
original teacher run online: CE on the true tokens, next-token accuracy, full-vocabulary KL
(teacher || student), top-1 agreement, ECE; and next-line completion (kdjax/completion.py:
exact match of the greedy continuation on held-out lines); the teacher's CE on the same tokens
and the CE split by whether the true token is in the teacher's top 100 (what a top-k cache
teaches of it). One JSON line per arm in --results, and one per prep with its teacher's own
figures (`prep`: which teacher, `pretrain_steps`: its correction's steps).
"""
import argparse
import json
import logging
import os
import subprocess
import sys
import time

import jax
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments.studies import recipe_schedule as plan, smollm2_study as base
from kdjax import build, cache, completion, evaluate, pipeline
from kdjax.workdir import Paths

RESULTS = os.path.join(REPO, "experiments", "results", "recipe.jsonl")
CONTROL_ROWS = 16  # rows a step on the sampled text (4M tokens: 123 steps)
# The wider student: the teacher's width, heads and MLP, 10 of its 30 layers (64M parameters).
WIDE = dict(d_model=576, n_layers=10, n_heads=9, n_kv_heads=3, d_ff=1536)
COMPLETION_PROMPTS = 1024  # next-line questions, from the first PROMPT_ROWS held-out rows
PROMPT_ROWS = 256
SAMPLED = "corpus_sampled_ids"  # the teacher's samples as token ids (sample_teacher.py)


def prep_config(root: str, which: str, variant: str = "", caches: bool = True):
  """The data store and cache of the real text (original or corrected teacher) or of the sampled
  text; caches False: no cache (the data, and the corrected teacher)."""
  c = base.prep_config(root, variant)
  c.cache.update(hidden_states=False, hidden_dim=0)
  c.workdir = plan.prep_dir(root, which)
  if not variant:  # ~52M positions at seq_len 2048: enough for the finals' 50.1M tokens
    c.data.max_bytes = 175_000_000
  if which == "sampled_ids":
    c.data.source = os.path.join(root, SAMPLED, "train.jsonl")
    c.data.eval_source = os.path.join(root, SAMPLED, "eval.jsonl")
    c.data.max_bytes = 0
  elif which in plan.CORRECTIONS:  # the config's pretrain group for plan.CORRECTED_STEPS
    c.stages = ("pretrain", "cache")  # the original prep's data, linked
    steps, warmup = ((c.pretrain.steps, c.pretrain.warmup_steps) if variant else
                     (plan.CORRECTED_STEPS, plan.CORRECTED_STEPS // 10))
    times = plan.CORRECTIONS[which]
    c.pretrain.update(steps=steps * times, warmup_steps=warmup * times)
  if not caches:
    c.stages = tuple(s for s in c.stages if s != "cache")
  return c


def link(src: str, dst: str):
  if not os.path.exists(dst):
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    os.symlink(os.path.abspath(src), dst)


def completion_questions(root: str, variant: str) -> tuple[dict, object]:
  """(prompts, decode): the next-line completion questions of the real held-out text."""
  paths = Paths.from_config(prep_config(root, "original", variant))
  tok = paths.tokenizer()
  store = cache.open(paths.data("eval"))
  rows = store.read(np.arange(min(PROMPT_ROWS, store.num_seqs)))
  prompts = completion.pick_prompts(rows, completion.line_breaks(tok.decode, tok.vocab_size),
                                    COMPLETION_PROMPTS)
  return prompts, tok.decode


def run_prep(root: str, which: str, variant: str, eval_rows: int, caches: bool = True,
             results: str = ""):
  """The prep `which` (its data, corrected teacher, cache), then its teacher's own held-out
  figures: in its prep_done.json, and with results a line there too (no "init": not an arm)."""
  c = prep_config(root, which, variant, caches)
  if which in plan.CORRECTIONS:
    link(os.path.join(plan.prep_dir(root, "original"), "data"), os.path.join(c.workdir, "data"))
  start = time.perf_counter()
  pipeline.run(c)
  paths = Paths.from_config(c)
  teacher = build.Models.from_config(c, paths).teacher_model()
  own = evaluate.evaluate_online(teacher, teacher, cache.open(paths.data("eval")),
                                 batch_size=c.eval.batch_size, max_seqs=eval_rows)
  if which != "sampled_ids":  # the teacher's own answers to the real text's completion questions
    own["exact_match"] = completion.exact_match(teacher, *completion_questions(root, variant))
  seconds = time.perf_counter() - start
  if results:
    base.append(results, dict(
        own, prep=which, pretrain_steps=c.pretrain.steps if which in plan.CORRECTIONS else 0,
        seconds=seconds, commit=base.e2e_bench.commit(), device=jax.devices()[0].device_kind,
        date=base.e2e_bench.today()))
  with open(os.path.join(c.workdir, "prep_done.json"), "w") as f:
    json.dump({"seconds": seconds, "teacher_eval": own}, f)


def arm_config(root: str, a: dict, variant: str):
  """An arm's config: its own workdir, the prep's data (linked) and cache, the arm's recipe."""
  which = "sampled_ids" if a["data"] == "sampled_ids" else a["teacher"]
  c = prep_config(root, which, variant)
  c.workdir = os.path.join(root, "study", plan.arm_name(a))
  c.cache.path = os.path.join(plan.prep_dir(root, which), "cache")
  c.seed = a["seed"]
  c.init.from_teacher = True  # from the original teacher: its Hugging Face checkpoint
  if a["data"] == "sampled_ids":
    c.opt.batch_size = CONTROL_ROWS if variant != "smoke" else 2
  c.opt.steps = -(-a["tokens"] // (c.opt.batch_size * c.opt.accum_steps * c.data.seq_len))
  c.opt.warmup_steps = min(c.opt.warmup_steps, c.opt.steps // 10)
  c.opt.lr = a["lr"]
  c.stages = ("baseline",) if a["objective"] == "hard" else ("train",)
  v = plan.extras(a)
  c.loss.update(objective="tail" if a["objective"] == "hard" else a["objective"],
                ce_weight=a["ce_weight"], divergence=v["divergence"],
                temperature=v["temperature"])
  if v["student"] == "64M":
    c.student.update(**WIDE)
  c.cache.k = a["k"] or c.cache.k
  link(os.path.join(plan.prep_dir(root, "sampled_ids" if which == "sampled_ids" else "original"),
                    "data"), os.path.join(c.workdir, "data"))
  if which in plan.CORRECTIONS:  # online's teacher (the student: as shipped)
    link(os.path.join(plan.prep_dir(root, which), "teacher"), os.path.join(c.workdir, "teacher"))
  return c


def measure(c, a: dict, teacher, root: str, eval_rows: int, questions) -> dict:
  run = "baseline" if a["objective"] == "hard" else "student"
  models = build.Models.from_config(c, Paths.from_config(c))
  model = models.finished(run, c.student, c.opt.steps)
  which = "sampled_ids" if a["data"] == "sampled_ids" else "original"
  eval_store = cache.open(os.path.join(plan.prep_dir(root, which), "data", "eval.zarr"))
  line = evaluate.evaluate_online(model, teacher, eval_store, batch_size=c.eval.batch_size,
                                  max_seqs=eval_rows)
  if a["data"] == "real":
    line["exact_match"] = completion.exact_match(model, *questions)
  line.update(arm=plan.arm_name(a), **a, steps=c.opt.steps, run=run, workdir=c.workdir,
              train_tokens=c.opt.steps * c.opt.batch_size * c.data.seq_len,
              commit=base.e2e_bench.commit(), device=jax.devices()[0].device_kind,
              date=base.e2e_bench.today())
  return line


def claim(args, name: str) -> bool:
  """Whether this process takes job `name`: the first of this launch (args.claim) to create its
  claim file. An earlier launch's claims are void: its unfinished arms resume from checkpoints."""
  folder = os.path.join(args.root, "study", "claims", args.claim)
  os.makedirs(folder, exist_ok=True)
  try:
    os.close(os.open(os.path.join(folder, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    return True
  except FileExistsError:
    return False


def worker(args):
  """Takes the next arm (or prep) nobody of this launch has claimed, until none is left."""
  orig = prep_config(args.root, "original", args.variant)
  teacher = build.Models.from_config(orig, Paths.from_config(orig)).teacher_model()
  questions = completion_questions(args.root, args.variant)
  while True:
    # The sampled text's data and cache, once: a serial job, once the sampler finished.
    if (args.sample_tokens and os.path.exists(os.path.join(args.root, SAMPLED, "eval.jsonl"))
        and not plan.prep_done(args.root, "sampled_ids") and claim(args, "prep_sampled_ids")):
      run_prep(args.root, "sampled_ids", args.variant, args.eval_rows, results=args.results)
    todo, later = plan.schedule(base.read_results(args.results), args.root, args.scale,
                                control=bool(args.sample_tokens), correct=args.correct,
                                longer=args.longer, longest=args.longest, long=args.long,
                                caches=args.caches)
    a = next((a for a in todo if claim(args, plan.arm_name(a))), None)
    if a is None and not (later and args.caches):
      return
    if a is None:
      time.sleep(10)
      continue
    c = arm_config(args.root, a, args.variant)
    start = time.perf_counter()
    pipeline.run(c)
    line = measure(c, a, teacher, args.root, args.eval_rows, questions)
    line["seconds"] = time.perf_counter() - start
    base.append(args.results, line)
    print(f"{line['arm']}: CE {line['ce']:.4f}  KL {line['full_kl']:.4f}  "
          f"acc {line['accuracy']:.4f}", flush=True)


def prepare(args):
  """The original teacher's data, cache and own held-out figures, then the corrected teacher's;
  the sampled text started first, beside them."""
  sampled = os.path.join(args.root, SAMPLED)
  sampler = None
  if not os.path.exists(os.path.join(sampled, "eval.jsonl")) and args.sample_tokens:
    sampler = subprocess.Popen(
        [args.hf_python, os.path.join(REPO, "experiments", "studies", "sample_teacher.py"),
         "--hf", os.path.join(args.root, "hf"), "--prompts",
         os.path.join(args.root, "corpus", "train.jsonl"), "--out", sampled,
         "--train-tokens", str(int(args.sample_tokens * args.scale) or 1), "--eval-tokens",
         str(int(args.sample_tokens * args.scale) // 13 or 1), "--batch-size",
         str(args.sample_batch), "--new-tokens", str(args.sample_length)])
  # The original first; then, before the workers, each correction that runs: training the 135M
  # teacher needs more of the GPU than a worker's share (1/N of it; it ran out of memory at 1/5
  # of an H100).
  wanted = {"original": True, "corrected": args.correct, "corrected_long": args.longer,
            "corrected_longest": args.longest}
  for which in [w for w, on in wanted.items() if on and not plan.prep_done(args.root, w)]:
    run_prep(args.root, which, args.variant, args.eval_rows, args.caches, args.results)
  return sampler


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--root", default=base.smollm2.ROOT)
  parser.add_argument("--variant", default="", help="configs/smollm2.py variant (smoke: CPU)")
  parser.add_argument("--eval-rows", type=int, default=512, help="held-out rows measured")
  parser.add_argument("--sample-tokens", type=int, default=plan.CONTROL,
                      help="tokens of teacher-sampled training text (0: no control)")
  parser.add_argument("--sample-batch", type=int, default=1024)
  parser.add_argument("--sample-length", type=int, default=504, help="sampled tokens a document")
  parser.add_argument("--no-correct", dest="correct", action="store_false",
                      help="skip the corrected teacher's phase")
  parser.add_argument("--no-longer", dest="longer", action="store_false",
                      help="skip the 3x correction's phase")
  parser.add_argument("--no-longest", dest="longest", action="store_false",
                      help="skip the 9x correction's phase")
  parser.add_argument("--no-long", dest="long", action="store_false",
                      help="skip the long runs (hard labels and the best final at 200M tokens)")
  parser.add_argument("--no-caches", dest="caches", action="store_false",
                      help="write no cache (the data and the corrected teacher only) and run only "
                           "the arms that read none")
  parser.add_argument("--scale", type=float, default=1.0,
                      help="every token count times this (smoke tests: 1e-4)")
  parser.add_argument("--hf-python", default=sys.executable,
                      help="a Python with torch and transformers (for the sampled text)")
  parser.add_argument("--results", default=RESULTS)
  parser.add_argument("--processes", type=int, default=1)
  parser.add_argument("--claim", default="", help=argparse.SUPPRESS)
  parser.add_argument("--table", action="store_true", help="print the table, redraw the plot")
  args = parser.parse_args()
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(process)d %(message)s",
                      datefmt="%H:%M:%S")
  # Arms of one shape share compiled programs (seeds, and every arm's evaluation).
  jax.config.update("jax_compilation_cache_dir", os.path.join(args.root, "study", "jax_cache"))
  if args.variant == "smoke":  # CPU: one lr, two objectives, each phase's code run once
    global COMPLETION_PROMPTS
    plan.LRS, plan.EDGE_LRS, plan.LAST_LRS = plan.LRS[:1], (), ()
    plan.OBJECTIVES = (plan.OBJECTIVES[0], plan.OBJECTIVES[-1])
    COMPLETION_PROMPTS = 4
  if args.table:
    from experiments.studies import recipe_report
    recipe_report.report(list(base.read_results(args.results).values()), args.results,
                         args.root)
    return
  os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
  if args.claim:  # a worker of a launch
    worker(args)
    return
  sampler = prepare(args)
  rc = base.launch(args, module=__spec__.name)
  if sampler is not None:
    sampler.wait()
  sys.exit(rc)


if __name__ == "__main__":
  main()
