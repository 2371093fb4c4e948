"""Does kdjax make a better student from a real pretrained teacher? SmolLM2-135M-Instruct into a
35M student (configs/smollm2.py), every objective against hard labels and online distillation.

    python -m kdjax.smollm2 --out runs/smollm2     # teacher checkpoint + corpora, once
    python -m experiments.studies.smollm2_study --root runs/smollm2 [--processes 3]  # resumable
    python -m experiments.studies.smollm2_study --root runs/smollm2 --perplexity  # transformers'
    python -m experiments.studies.smollm2_study --table   # the table and plot from the results
    python -m experiments.studies.smollm2_study --root runs/smollm2 --fp8  # FP8 A/B (below)

Arms, each in its own workdir under ROOT/study/ on one shared data store and one cache (the
teacher's top-100 and its final hidden states through a fixed projection to 144 columns; arms
at smaller k read its first k entries), the same seed, data order and learning-rate schedule:
  main (--tokens, 50M): hard labels (stage baseline), online (the teacher in every step, KL over
    the full vocabulary), offline `tail` at k = 100; each from scratch and pruned from the
    teacher (init.from_teacher).
  objectives (--tokens / 4, pruned): hard labels, `tail` at k = 8, 32, 100, `sparse` at 100, and
    `tail` 100 + the hidden-state term (loss.hidden_weight 1); then seed 1 of hard and tail 100.
Each finished arm is measured on the held-out split (whole works and packages never trained on)
against the teacher run online (kdjax.evaluate.evaluate_online): CE on the true tokens, full-
vocabulary KL(teacher || student), top-1 agreement, ECE; and its exported Hugging Face checkpoint
by transformers (`--perplexity`: the perplexity of its first rows' documents, run one at a time).
--fp8 runs instead the A/B of the block's projections in FP8 (student.fp8_matmuls,
kdjax/models/fp8.py): pruned, tail k = 100, --tokens / 4, bf16 against FP8, seeds 0 and 1, both
arms at the same commit in the same setting (XLA's Triton GEMMs off for the whole process, as
FP8 runs have them: fp8.prepare_compiler), into experiments/results/smollm2_fp8.jsonl.
One JSON line per arm in --results; an arm already there is skipped, and training resumes from
its checkpoints, so the command can be stopped (SIGTERM saves) and run again.
"""
import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from configs import smollm2
from experiments.bench import e2e_bench
from kdjax import build, cache, evaluate, pipeline
from kdjax.models import fp8
from kdjax.workdir import Paths

RESULTS = os.path.join(REPO, "experiments", "results", "smollm2.jsonl")
FP8_RESULTS = os.path.join(REPO, "experiments", "results", "smollm2_fp8.jsonl")
HF_REFERENCE = os.path.join(REPO, "kdjax", "smollm2", "hf_reference.py")
HIDDEN_DIM = 144  # the cached hidden states: the teacher's 576 columns projected to a quarter
METRICS = ("ce", "full_kl", "top1", "ece")
PERPLEXITY_ROWS = 32  # held-out rows whose documents transformers scores per exported student


def arms(tokens: int, fp8_ab: bool = False) -> list[dict]:
  """Every arm, in the order they run: the main comparison first (fp8_ab: the FP8 A/B's)."""
  if fp8_ab:
    return [dict(init="pruned", objective="tail", k=100, tokens=tokens // 4, seed=seed,
                 hidden=0.0, fp8=on) for seed in (0, 1) for on in (False, True)]
  main = [dict(init=init, objective=o, k=100 if o == "tail" else 0, tokens=tokens)
          for init in ("pruned", "scratch") for o in ("hard", "tail", "online")]
  small = tokens // 4
  pruned = [dict(init="pruned", objective=o, k=k, tokens=small)
            for o, k in (("hard", 0), ("tail", 100), ("tail", 8), ("tail", 32), ("sparse", 100))]
  pruned.append(dict(init="pruned", objective="tail", k=100, tokens=small, hidden=1.0))
  seeds = [dict(init="pruned", objective=o, k=k, tokens=small, seed=1)
           for o, k in (("hard", 0), ("tail", 100))]
  return [{"seed": 0, "hidden": 0.0, **a} for a in main + pruned + seeds]


def arm_name(a: dict) -> str:
  k = f"_k{a['k']}" if a["k"] else ""
  hidden = "_hidden" if a["hidden"] else ""
  in_fp8 = "_fp8" if a.get("fp8") else ""
  return (f"{a['init']}_{a['objective']}{k}{hidden}{in_fp8}_{a['tokens'] / 1e6:g}M_"
          f"seed{a['seed']}")


def prep_config(root: str, variant: str):
  """The shared data and cache: ROOT/study/prep (stages data, cache)."""
  c = smollm2.get_config(variant)
  for g, key in ((c.teacher, "hf_path"), (c.data, "tokenizer")):
    g[key] = os.path.join(root, "hf")
  c.data.source = os.path.join(root, "corpus", "train.jsonl")
  c.data.eval_source = os.path.join(root, "corpus", "eval.jsonl")
  c.workdir = os.path.join(root, "study", "prep")
  c.stages = ("data", "cache")
  c.cache.update(hidden_states=True, hidden_dim=HIDDEN_DIM)
  return c


def arm_config(prep, root: str, a: dict):
  """An arm's config: its own workdir, the shared data (linked) and cache."""
  c = prep.copy_and_resolve_references()
  c.workdir = os.path.join(root, "study", arm_name(a))
  c.cache.path = os.path.join(prep.workdir, "cache")
  c.seed = a["seed"]
  c.init.from_teacher = a["init"] == "pruned"
  c.student.fp8_matmuls = bool(a.get("fp8"))
  rows = c.opt.batch_size * c.opt.accum_steps * c.data.seq_len
  c.opt.steps = -(-a["tokens"] // rows)
  c.opt.warmup_steps = min(c.opt.warmup_steps, c.opt.steps // 10)
  if a["objective"] == "hard":
    c.stages = ("baseline",)
  else:
    c.stages = ("train",)
    c.loss.objective = a["objective"]
    c.loss.hidden_weight = a["hidden"]
    if a["k"]:
      c.cache.k = a["k"]
  os.makedirs(c.workdir, exist_ok=True)
  link = os.path.join(c.workdir, "data")
  if not os.path.exists(link):
    os.symlink(os.path.abspath(os.path.join(prep.workdir, "data")), link)
  return c


def run_arm(prep, root: str, a: dict, teacher, eval_store, args) -> dict:
  c = arm_config(prep, root, a)
  pipeline.run(c)
  run = "baseline" if a["objective"] == "hard" else "student"
  models = build.Models.from_config(c, Paths.from_config(c))
  model = models.finished(run, c.student, c.opt.steps)
  online = evaluate.evaluate_online(model, teacher, eval_store, batch_size=c.eval.batch_size,
                                    max_seqs=args.eval_rows)
  return {"arm": arm_name(a), **a, "steps": c.opt.steps,
          "train_tokens": c.opt.steps * c.opt.batch_size * c.opt.accum_steps * c.data.seq_len,
          "ce": online["ce"], "full_kl": online["full_kl"], "top1": online["top1_agreement"],
          "ece": online["ece"], "positions": online["positions"], "teacher_ce": args.teacher_ce,
          "workdir": c.workdir, "run": run, "commit": e2e_bench.commit(),
          "device": jax.devices()[0].device_kind,
          "date": e2e_bench.today()}


def claim(prep, a: dict, token: str) -> bool:
  """Whether this process takes arm `a`: the first of one launch (token) to create its claim
  file. Claims of an earlier launch are void: its unfinished arms resume from their checkpoints."""
  folder = os.path.join(os.path.dirname(prep.workdir), "claims", token)
  os.makedirs(folder, exist_ok=True)
  try:
    os.close(os.open(os.path.join(folder, arm_name(a)), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    return True
  except FileExistsError:
    return False


def launch(args, module: str | None = None) -> int:
  """--processes N: N processes of `script` share the arms (and the GPU: each takes memory as it
  needs, at most 1/N of it); SIGTERM to this one is passed on, so each saves its step."""
  argv, skip = [], False
  for a in sys.argv[1:]:  # every argument but --processes N / --processes=N
    if not skip and not a.startswith("--processes"):
      argv.append(a)
    skip = a == "--processes"
  env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
         "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{0.9 / args.processes:.2f}"}
  token = f"{os.getpid()}-{time.time():.0f}"
  # Sessions of their own: a signal to this process group (timeout, Ctrl-C) reaches them once,
  # through the handler below, never twice (a second one would interrupt their checkpoint).
  command = ["-m", module or __spec__.name]  # this module, or the study module of its arms
  children = [subprocess.Popen([sys.executable, *command, *argv, "--claim", token], env=env,
                               start_new_session=True)
              for _ in range(args.processes)]
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: [p.send_signal(signal.SIGTERM) for p in children])
  try:
    return max(p.wait() for p in children)
  finally:  # never leave one running (its own session would outlive a killed terminal)
    for p in children:
      if p.poll() is None:
        p.kill()


def read_results(path: str) -> dict:
  """{arm: line} of the measured arms (a line without "init", e.g. the prep's, is not an arm)."""
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return {line["arm"]: line for line in map(json.loads, f) if "init" in line}


def append(path: str, line: dict):
  with open(path, "a") as f:
    f.write(json.dumps(line) + "\n")


def perplexity(prep, root: str, teacher, args):
  """Each measured arm's student exported (Hugging Face format) and scored by transformers on the
  first PERPLEXITY_ROWS held-out rows, beside kdjax's own CE on the same rows (the export's
  check); adds `hf_ppl`, `hf_ce` and `kdjax_ce_rows` to the arm's line."""
  from kdjax.models import hf
  lines = read_results(args.results)
  todo = [line for line in lines.values() if "hf_ce" not in line]
  if not todo:
    return
  eval_store = cache.open(os.path.join(prep.workdir, "data", "eval.zarr"))
  rows = eval_store.read(np.arange(min(PERPLEXITY_ROWS, eval_store.num_seqs)))
  work = os.path.join(root, "study", "hf")
  os.makedirs(work, exist_ok=True)
  inputs = os.path.join(work, "rows.npz")
  np.savez(inputs, **{k: rows[k] for k in ("tokens", "positions", "segment_ids", "loss_mask")})
  jobs = []
  for line in todo:
    a = {k: line[k] for k in ("init", "objective", "k", "tokens", "seed", "hidden")}
    a["fp8"] = line.get("fp8", False)
    c = arm_config(prep, root, a)
    models = build.Models.from_config(c, Paths.from_config(c))
    model = models.finished(line["run"], c.student, c.opt.steps)
    out_dir = os.path.join(work, line["arm"])
    hf.export(model, model.cfg, out_dir, tokenizer_dir=models.paths.tokenizer_dir)
    ours = evaluate.evaluate_online(model, teacher, eval_store, batch_size=c.eval.batch_size,
                                    max_seqs=PERPLEXITY_ROWS)
    line["kdjax_ce_rows"] = ours["ce"]
    jobs.append({"dir": out_dir, "inputs": inputs, "out": os.path.join(work, line["arm"] + ".json")})
  with open(os.path.join(work, "jobs.json"), "w") as f:
    json.dump({"nll": jobs}, f)
  subprocess.run([args.hf_python, HF_REFERENCE, os.path.join(work, "jobs.json")], check=True)
  for line, job in zip(todo, jobs):
    with open(job["out"]) as f:
      nll = json.load(f)
    line.update(hf_ce=nll["mean_nll"], hf_ppl=float(np.exp(nll["mean_nll"])),
                hf_positions=nll["positions"])
  with open(args.results) as f:
    others = [line for line in map(json.loads, f) if "init" not in line]  # kept as they are
  with open(args.results + ".tmp", "w") as f:
    for line in [*lines.values(), *others]:
      f.write(json.dumps(line) + "\n")
  os.replace(args.results + ".tmp", args.results)


def table(lines: list[dict]) -> str:
  columns = ("init", "objective", "k", "train tokens", "seed", "CE", "full KL", "top-1", "ECE",
             f"transformers ppl, {PERPLEXITY_ROWS} rows (its CE; kdjax's)")
  out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  order = {"hard": 0, "online": 1, "tail": 2, "sparse": 3}
  lines = sorted(lines, key=lambda r: (-r["tokens"], r["init"], r["seed"], order[r["objective"]],
                                       -r["k"], r["hidden"]))
  for r in lines:
    objective = (r["objective"] + (" + hidden" if r["hidden"] else "")
                 + (", FP8" if r.get("fp8") else ""))
    ppl = (f"{r['hf_ppl']:.2f} ({r['hf_ce']:.4f}; {r['kdjax_ce_rows']:.4f})" if "hf_ppl" in r
           else "-")
    out.append(f"| {r['init']} | {objective} | {r['k'] or '-'} | {r['train_tokens'] / 1e6:.1f}M | "
               f"{r['seed']} | {r['ce']:.4f} | {r['full_kl']:.4f} | {r['top1']:.4f} | "
               f"{r['ece']:.4f} | {ppl} |")
  teacher = next((r["teacher_ce"] for r in lines), None)
  if teacher is not None:
    out.append(f"\nteacher's own held-out CE: {teacher:.4f} nats (perplexity "
               f"{np.exp(teacher):.2f})")
  return "\n".join(out)


def plot(lines: list[dict], png: str):
  """Training CE on the true tokens against training tokens: offline tail k = 100 vs online vs
  hard labels, per init (the main arms), with each arm's held-out CE at its end; for the FP8
  A/B, bf16 against FP8 in every seed."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fp8_ab = any(r.get("fp8") for r in lines)
  main = [r for r in lines
          if r["tokens"] == max(x["tokens"] for x in lines) and (fp8_ab or r["seed"] == 0)]
  inits = sorted({r["init"] for r in main})
  fig, axes = plt.subplots(1, len(inits), figsize=(6 * len(inits), 4.2), squeeze=False)
  colors = {"tail": "C0", "online": "C1", "hard": "C2"}
  labels = {"tail": "offline tail k=100", "online": "online (full KL)", "hard": "hard labels"}
  for ax, init in zip(axes[0], inits):
    for r in (r for r in main if r["init"] == init and r["objective"] in colors):
      metrics = os.path.join(r["workdir"], r["run"], "metrics.jsonl")
      if not os.path.exists(metrics):
        continue
      with open(metrics) as f:
        steps = [json.loads(x) for x in f]
      per_step = r["train_tokens"] / r["steps"]
      color, label, ls = colors[r["objective"]], labels[r["objective"]], "-"
      if fp8_ab:
        color, ls = ("C3" if r.get("fp8") else "C0"), ("-", ":")[r["seed"] % 2]
        label = f"{'FP8' if r.get('fp8') else 'bf16'}, seed {r['seed']}"
      ax.plot([s["step"] * per_step / 1e6 for s in steps], [s["ce"] for s in steps],
              color=color, ls=ls, label=label)
      ax.plot([r["train_tokens"] / 1e6], [r["ce"]], "o", color=color)
    ax.axhline(main[0]["teacher_ce"], color="0.5", ls="--", label="teacher (held-out)")
    ax.set(title=f"student {init}", xlabel="training tokens (M)",
           ylabel="CE on the true tokens (nats)")
    ax.set_ylim(top=min(ax.get_ylim()[1], 6.0))
    ax.legend()
  what = "bf16 vs FP8 projections" if fp8_ab else "training CE (lines), held-out CE (dots)"
  fig.suptitle(f"SmolLM2-135M-Instruct -> 35M student: {what}", fontsize=10)
  fig.tight_layout()
  fig.savefig(png, dpi=100)


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--root", default=smollm2.ROOT)
  parser.add_argument("--variant", default="", help="configs/smollm2.py variant (smoke: CPU)")
  parser.add_argument("--tokens", type=float, default=50e6, help="training tokens, main arms")
  parser.add_argument("--eval-rows", type=int, default=0, help="held-out rows measured (0: all)")
  parser.add_argument("--results", default=RESULTS)
  parser.add_argument("--processes", type=int, default=1,
                      help="N processes share the arms and the GPU (small students leave it idle)")
  parser.add_argument("--claim", default="", help=argparse.SUPPRESS)  # set by --processes
  parser.add_argument("--prepare-only", action="store_true",
                      help="data, cache and the teacher's own evaluation, then stop")
  parser.add_argument("--perplexity", action="store_true",
                      help="export every measured arm and score it with transformers")
  parser.add_argument("--hf-python", default=sys.executable,
                      help="a Python with torch and transformers (for --perplexity)")
  parser.add_argument("--table", action="store_true", help="print the table, redraw the plot")
  parser.add_argument("--fp8", action="store_true",
                      help="the FP8 A/B's arms instead (results: smollm2_fp8.jsonl)")
  args = parser.parse_args()
  if args.fp8:
    args.results = FP8_RESULTS if args.results == RESULTS else args.results
    fp8.prepare_compiler(True)  # before anything compiles: both arms alike
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(process)d %(message)s",
                      datefmt="%H:%M:%S")
  args.claim = args.claim or f"{os.getpid()}-{time.time():.0f}"
  png = os.path.splitext(args.results)[0] + ".png"
  if args.table:
    lines = list(read_results(args.results).values())
    print(table(lines))
    plot(lines, png)
    return
  prep = prep_config(args.root, args.variant)
  if args.processes > 1 and not args.perplexity:
    # This process stays off the GPU: a process of its own prepares, then N share the arms.
    rc = subprocess.run([sys.executable, "-m", __spec__.name, *sys.argv[1:], "--processes=1",
                         "--prepare-only"]).returncode
    sys.exit(rc or launch(args))
  pipeline.run(prep)
  paths = Paths.from_config(prep)
  teacher = build.Models.from_config(prep, paths).teacher_model()
  if args.perplexity:
    perplexity(prep, args.root, teacher, args)
    return
  eval_store = cache.open(paths.data("eval"))
  teacher_json = os.path.join(prep.workdir, "teacher_eval.json")
  if not os.path.exists(teacher_json):  # the teacher's own held-out CE: the students' floor
    own = evaluate.evaluate_online(teacher, teacher, eval_store, batch_size=prep.eval.batch_size,
                                   max_seqs=args.eval_rows)
    with open(teacher_json, "w") as f:
      json.dump(own, f)
  if args.prepare_only:
    return
  with open(teacher_json) as f:
    args.teacher_ce = json.load(f)["ce"]
  os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
  for a in arms(int(args.tokens), args.fp8):
    if arm_name(a) in read_results(args.results) or not claim(prep, a, args.claim):
      continue
    start = time.perf_counter()
    line = run_arm(prep, args.root, a, teacher, eval_store, args)
    line["seconds"] = time.perf_counter() - start  # this call's share (resumed arms: the rest)
    append(args.results, line)
    print(f"{line['arm']}: " + "  ".join(f"{m} {line[m]:.4f}" for m in METRICS), flush=True)


if __name__ == "__main__":
  main()
