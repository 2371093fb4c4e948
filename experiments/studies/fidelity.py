"""How close the student gets to its teacher, by objective and k, against online full-vocabulary KL.

    python -m experiments.studies.fidelity [--seeds 0,1,2] [--ks 1,8,32,100] [--out runs/fidelity]
        [--results experiments/results/fidelity.jsonl] [--variant smoke|large]

On the demo (configs/demo.py; `--variant smoke` for its tiny CPU-test shapes, `--variant large`
for configs/demo.py:large's 27M-parameter teacher, made for a GPU): the demo's data and
teacher (pre-trained here on hard labels) are made once in OUT/demo, then one cache per k
(OUT/cache_k{k}: the same teacher's top-k), and the demo student is distilled (bf16 matmuls, the
demo's steps and learning rate) under each cached objective ("sparse", "tail", "renorm") for
every k, and under "online" (the teacher in the step, full-vocabulary KL), once per seed (model
init and data order): the same data, steps and seeds everywhere. Then, for the cached objective
with the lowest mean full KL at the largest k: temperature 2, a hard-label CE mix (ce_weight
0.5), and the hidden-state term (hidden_weight 1, kdjax/loss/hidden.py) against the teacher's
cached final hidden states, whole (hidden_dim = its width) and through a fixed random projection
to a quarter of it, at that k.

Each run is measured on the held-out split with the teacher run online
(kdjax.evaluate.evaluate_online): `full_kl` KL(teacher || student) over the whole vocabulary,
`top1` agreement, `ce` on the true tokens, `ece` (expected calibration error, 15 bins), and
`bytes_per_position`, what its cache's top-k arrays take on disk per position (0 for online),
and `hidden_bytes_per_position` its hidden states (`teacher_ce`: the teacher's own CE). One
JSON line per run is appended to --results; a run whose line is already there (same objective,
k, seed, temperature, ce_weight, hidden_weight, hidden_dim and teacher) is not run again, so a
stopped study resumes where it stopped. `--table` prints a teacher's results as BENCHMARKS.md
shows them (and redraws the plot). The plot beside it (.png, _VARIANT.png): full KL and CE
against k, one line per objective (mean, seed range as error bars), online as a band.

On one GPU the tiny students leave it mostly idle: `--prepare-only` once, then N processes with
`--shard I/N` share the runs (experiments/README.md has the command).
"""
import argparse
import json
import os
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments.bench import e2e_bench
from experiments.studies import demo_ab
from kdjax import build, cache, evaluate, pipeline
from kdjax.loss import objectives
from kdjax.workdir import Paths

RESULTS = os.path.join(ROOT, "experiments", "results", "fidelity.jsonl")
METRICS = ("full_kl", "top1", "ce", "ece")
KEY = ("objective", "k", "seed", "temperature", "ce_weight", "hidden_weight", "hidden_dim",
       "teacher")
HIDDEN_WEIGHT = 1.0


def cache_for(prep, out: str, k: int, hidden_dim: int = 0) -> str:
  """The demo teacher's top-k cache at OUT/cache_k{k} (kept when complete); with hidden_dim > 0
  also its hidden states at that width, at OUT/cache_k{k}_hidden{hidden_dim}."""
  c = prep.copy_and_resolve_references()
  c.stages = ("cache",)
  name = f"cache_k{k}" + (f"_hidden{hidden_dim}" if hidden_dim else "")
  c.cache.update(path=os.path.join(out, name), k=k, hidden_states=hidden_dim > 0,
                 hidden_dim=hidden_dim)
  pipeline.run(c)
  return c.cache.path


def teacher_checkpoint(prep, teacher, out: str) -> str:
  """The demo teacher as a Hugging Face checkpoint (OUT/teacher_hf, kept when present): how an
  online run in its own workdir names its teacher (teacher.hf_path)."""
  from kdjax.models import hf
  path = os.path.join(out, "teacher_hf")
  if not os.path.exists(os.path.join(path, "config.json")):
    hf.export(teacher, teacher.cfg, path, tokenizer_dir=os.path.join(prep.workdir, "data"))
  return path


def bytes_per_position(cache_dir: str, arrays=("topk_ids", "topk_logprobs")) -> float:
  """Bytes on disk of the train cache's `arrays`, per position."""
  path = os.path.join(cache_dir, "train.zarr")
  total = sum(os.path.getsize(os.path.join(root, name))
              for array in arrays
              for root, _, names in os.walk(os.path.join(path, array)) for name in names)
  store = cache.open(path)
  return total / (store.num_seqs * store.seq_len)


def identity(args, *, objective, k, seed, temperature=1.0, ce_weight=0.0, hidden_dim=0) -> dict:
  """What names a run in its JSON line (KEY): the study's arms as the fields they set."""
  return {"objective": objective, "k": k if objective != "online" else None, "seed": seed,
          "temperature": temperature, "ce_weight": ce_weight,
          "hidden_weight": HIDDEN_WEIGHT if hidden_dim else 0.0, "hidden_dim": hidden_dim,
          "teacher": teacher_name(args)}


def distil(prep, args, teacher, caches, eval_store, *, objective, k, seed, temperature=1.0,
           ce_weight=0.0, hidden_dim=0) -> dict:
  """One student distilled and measured online on eval_store; its JSON line. hidden_dim > 0:
  with the hidden-state term (HIDDEN_WEIGHT) against caches[k, hidden_dim]."""
  line = identity(args, objective=objective, k=k, seed=seed, temperature=temperature,
                  ce_weight=ce_weight, hidden_dim=hidden_dim)
  name = (f"{objective}_k{k}_t{temperature:g}_ce{ce_weight:g}"
          + (f"_hidden{hidden_dim}" if hidden_dim else "") + f"_seed{seed}")
  configs = []

  def edit(c):
    configs.append(c)
    c.loss.update(objective=objective, temperature=temperature, ce_weight=ce_weight,
                  hidden_weight=line["hidden_weight"])
    if objective == "online":
      c.teacher.hf_path = teacher_checkpoint(prep, teacher, args.out)
    else:
      c.cache.update(path=caches[k, hidden_dim], k=k, hidden_states=hidden_dim > 0,
                     hidden_dim=hidden_dim)

  cached = demo_ab.distil(prep, args.out, name, seed, edit)
  c = configs[0]
  models = build.Models.from_config(c, Paths.from_config(c))
  student = models.finished("student", c.student, c.opt.steps)
  online = evaluate.evaluate_online(student, teacher, eval_store,
                                    batch_size=prep.eval.batch_size, max_seqs=prep.eval.max_seqs)
  return {**line, **{m: online[m if m != "top1" else "top1_agreement"] for m in METRICS},
          "cached_kl": cached["kl"], "positions": online["positions"],
          "teacher_ce": args.teacher_ce,
          "bytes_per_position": (bytes_per_position(c.cache.path) if objective != "online"
                                 else 0.0),
          "hidden_bytes_per_position": (bytes_per_position(c.cache.path, ("hidden",))
                                        if hidden_dim else 0.0),
          "commit": e2e_bench.commit(), "date": e2e_bench.today()}


def teacher_name(args) -> str:
  variant = f" {args.variant}" if args.variant else ""
  where = f"configs/demo.py:{args.variant}" if args.variant else "configs/demo.py"
  return f"demo{variant} ({where}, pre-trained here on hard labels)"


def run_key(line: dict) -> tuple:
  return tuple(line.get(k, 0.0 if k == "hidden_weight" else 0) for k in KEY)


def plot(lines: list[dict], png: str):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
  plain = [r for r in lines if r["temperature"] == 1.0 and r["ce_weight"] == 0.0
           and not r.get("hidden_weight")]
  for ax, metric, label in ((axes[0], "full_kl", "held-out full-vocabulary KL (nats)"),
                            (axes[1], "ce", "held-out CE on the true tokens (nats)")):
    online = [r[metric] for r in plain if r["objective"] == "online"]
    if online:
      ax.axhspan(min(online), max(online), color="0.85", label="online (seed range)")
    for objective in objectives.OBJECTIVES:
      ks = sorted({r["k"] for r in plain if r["objective"] == objective})
      vals = [[r[metric] for r in plain if r["objective"] == objective and r["k"] == k]
              for k in ks]
      if ks:
        mean = [np.mean(v) for v in vals]
        err = [[m - min(v) for m, v in zip(mean, vals)], [max(v) - m for m, v in zip(mean, vals)]]
        ax.errorbar(ks, mean, yerr=err, marker="o", capsize=3, label=objective)
    ax.set(xscale="log", xlabel="k (cached entries per position)", ylabel=label)
    ax.legend()
  fig.suptitle(f"student distilled from {lines[0]['teacher']}; 3 seeds per point", fontsize=10)
  fig.tight_layout()
  fig.savefig(png, dpi=100)


def table(lines: list[dict]) -> str:
  """Markdown: one row per arm (objective, k, temperature, CE mix, hidden width) of one teacher,
  means over seeds with the (min-max) range."""
  arms = {}
  for r in lines:
    arm = (r["objective"], r["k"] or 0, r["temperature"], r["ce_weight"], r.get("hidden_dim", 0))
    arms.setdefault(arm, []).append(r)
  columns = ("objective", "k", "T", "ce_weight", "hidden", "seeds", "full KL", "top-1", "CE",
             "ECE", "bytes/pos")
  out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  for (objective, k, temperature, ce_weight, hidden_dim), runs in sorted(arms.items()):
    cells = []
    for m in METRICS:
      v = [r[m] for r in runs]
      cells.append(f"{np.mean(v):.4f}" + (f" ({min(v):.4f}-{max(v):.4f})" if len(v) > 1 else ""))
    size = runs[0]["bytes_per_position"] + runs[0].get("hidden_bytes_per_position", 0.0)
    seeds = ",".join(str(r["seed"]) for r in sorted(runs, key=lambda r: r["seed"]))
    out.append(f"| {objective} | {k or '-'} | {temperature:g} | {ce_weight:g} | "
               f"{hidden_dim or '-'} | {seeds} | " + " | ".join(cells) + f" | {size:.1f} |")
  return "\n".join(out)


def plot_path(args) -> str:
  return os.path.splitext(args.results)[0] + (f"_{args.variant}" if args.variant else "") + ".png"


def read_results(path: str) -> dict:
  """{run_key: line} of the results file so far."""
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return {run_key(line): line for line in map(json.loads, f)}


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--seeds", default="0,1,2")
  parser.add_argument("--ks", default="1,8,32,100")
  parser.add_argument("--out", default="runs/fidelity")
  parser.add_argument("--results", default=RESULTS)
  parser.add_argument("--variant", default="", choices=["", "smoke", "large"])
  parser.add_argument("--prepare-only", action="store_true",
                      help="make the data, teacher and caches, then stop (before --shard runs)")
  parser.add_argument("--table", action="store_true",
                      help="print the results file's table for --variant's teacher and redraw "
                           "its plot; run nothing")
  parser.add_argument("--shard", default="0/1",
                      help="I/N: run every N-th run from the I-th (N processes share one GPU); "
                           "each waits for the others' lines before the next phase")
  args = parser.parse_args()
  seeds, ks = [int(s) for s in args.seeds.split(",")], [int(k) for k in args.ks.split(",")]
  shard, shards = map(int, args.shard.split("/"))
  if args.table:
    lines = [r for r in read_results(args.results).values() if r["teacher"] == teacher_name(args)]
    print(table(lines))
    plot(lines, plot_path(args))
    return
  prep = demo_ab.prepare(args.out, args.variant)
  models = build.Models.from_config(prep, Paths.from_config(prep))
  teacher = models.finished("teacher", prep.teacher, prep.pretrain.steps)
  os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
  top = max(ks)
  hidden_dims = (prep.teacher.d_model, prep.teacher.d_model // 4)
  caches = {(k, 0): cache_for(prep, args.out, k) for k in ks}  # each loads the teacher once
  caches.update({(top, h): cache_for(prep, args.out, top, h) for h in hidden_dims})
  if args.prepare_only:
    return
  eval_store = cache.open(os.path.join(prep.workdir, "data", "eval.zarr"))
  # The teacher's own held-out CE, the floor of the students' (recorded in every line).
  args.teacher_ce = evaluate.evaluate_online(
      teacher, teacher, eval_store, batch_size=prep.eval.batch_size,
      max_seqs=prep.eval.max_seqs)["ce"]
  key_of = lambda spec: run_key(identity(args, **spec))

  def run_all(specs):
    """This shard's runs of `specs` not yet recorded; then every spec's line (waiting for the
    other shards' lines)."""
    done = read_results(args.results)
    for i, spec in enumerate(specs):
      if i % shards == shard and key_of(spec) not in done:
        line = distil(prep, args, teacher, caches, eval_store, **spec)
        with open(args.results, "a") as f:
          f.write(json.dumps(line) + "\n")
        print(" ".join(f"{key} {line[key]}" for key in KEY[:-1])
              + "".join(f"  {m} {line[m]:.4f}" for m in METRICS), flush=True)
    while missing := [s for s in specs if key_of(s) not in (done := read_results(args.results))]:
      print(f"shard {shard}/{shards}: waiting for {len(missing)} runs of other shards", flush=True)
      time.sleep(10)
    return [done[key_of(spec)] for spec in specs]

  lines = run_all([dict(objective=o, k=k, seed=seed) for o in objectives.OBJECTIVES
                   for k in ks for seed in seeds]
                  + [dict(objective="online", k=0, seed=seed) for seed in seeds])
  mean_kl = {o: np.mean([r["full_kl"] for r in lines if r["objective"] == o and r["k"] == top])
             for o in objectives.OBJECTIVES}
  best = min(mean_kl, key=mean_kl.get)
  lines += run_all([dict(objective=best, k=top, seed=seed, **arm) for seed in seeds
                    for arm in [dict(temperature=2.0), dict(ce_weight=0.5)]
                    + [dict(hidden_dim=h) for h in hidden_dims]])
  if shard == 0:
    plot(lines, plot_path(args))


if __name__ == "__main__":
  main()
