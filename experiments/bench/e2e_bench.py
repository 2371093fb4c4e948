"""The training step and the teacher's cache writing, end to end, at the paper's shapes.

    python -m experiments.bench.e2e_bench sweep 8k 32k 128k teacher-8k teacher-32k  # the H200 run
    python -m experiments.bench.e2e_bench sweep --list                              # every name
    python -m experiments.bench.e2e_bench plot                                      # results -> PNG
    python -m experiments.bench.e2e_bench student --config configs/8k.py --accum 2 --docs 4 \
        --set opt.accum_dtype=bfloat16                                              # one, by hand

`sweep` runs each named configuration (e2e_sweep.py) in a process of its own (peak memory cannot
be reset) and appends one JSON line per configuration to experiments/results/e2e.jsonl (--out to
change).

student: the config's student (configs/8k.py, configs/32k.py: Llama-3.2-3B shapes, float32
parameters and AdamW, bf16 compute, the fused loss, K = 100) with RANDOM weights, trained on a
synthetic cache (the config's layout) written to local disk first: random tokens packed into `docs` documents
of unequal length per row (`--docs stdlib`: rows as real text packs, this Python's standard
library files as the documents: synthetic_rows.py), random top-k entries. Steps run through
`train.Trainer` (its loader's `next_batch`, then `step`), as `train.fit` runs them (fit adds
checkpoints and reports). The first step compiles; the median of the rest is reported.

Every line's `clocks`: nvidia-smi's median SM clock and power over the timed steps (the
teacher: its write), and the share of samples held by the power cap ({} without nvidia-smi).

teacher: a RANDOM-weight Llama-3.1-8B-shaped teacher (bf16; the config's teacher: gpt-oss's with
configs/gpt_oss.py, its MXFP4 experts random packed codes) writes its top-100 cache (the
config's layout) of synthetic packed rows through `teacher.write_cache` (tokens/s with the zarr write), and the
jitted teacher step alone (`teacher.topk_batch` over the first ALONE_BATCHES batches, once each
after a compile: device only, their documents' mean context; before 2026-12-04 one batch five
times, whose documents need not be the run's mean; its model FLOP/s,
forward: a third of the convention below; XLA's memory plan of the step, printed before it
runs).

FLOP convention (model FLOPs, no recomputation): per token 6 N (N = matmul parameters, lm_head
included) plus attention 12 L H E c, where c is the mean number of keys a query sees (causal,
within its document: sum over documents of len^2 / 2, over T). MFU divides by
reporting.peak_flops() (989 TFLOP/s, H200 dense bf16).
"""
import argparse
import datetime
import functools
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import time

import jax
import numpy as np
from flax import nnx

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments.bench import e2e_sweep, gpu_watch
from experiments.bench.synthetic_rows import docs_arg, packed_segments, synthetic_cache
from kdjax import build, cache, config, parallel, teacher
from kdjax.models import documents, fp8, llama
from kdjax.training import reporting, train

RESULTS = os.path.join(ROOT, "experiments", "results", "e2e.jsonl")
ALONE_BATCHES = 8  # the teacher step alone: batches timed


WATCH = gpu_watch.GpuWatch()


def peak_gib() -> float:
  """The largest peak of this process's devices (JAX's statistics; where it keeps none,
  nvidia-smi's largest reading since the start, else nan: CPU)."""
  stats = [d.memory_stats() or {} for d in jax.local_devices()]
  if all("peak_bytes_in_use" in s for s in stats):
    return max(s["peak_bytes_in_use"] for s in stats) / 2**30
  return WATCH.gib()


def pool_line() -> str:
  """JAX's device pool now (GiB): in use, largest free piece, the limit; "" where it keeps none."""
  m = jax.local_devices()[0].memory_stats() or {}
  if "bytes_in_use" not in m:
    return ""
  g = lambda k: f"{m.get(k, float('nan')) / 2**30:.2f}"
  return (f"pool: in use {g('bytes_in_use')} GiB, reserved {g('pool_bytes')}, largest free block "
          f"{g('largest_free_block_bytes')}, limit {g('bytes_limit')}")


def mesh_of(c):
  """The config's mesh when it has several devices, else None (one device, no placement)."""
  mesh = parallel.make_mesh(c.mesh)
  return mesh if parallel.several(mesh) else None


def sharded_model(make, mesh):
  """make()'s module with every parameter created in its shards (parallel.shardings_of): no
  device ever holds a whole teacher larger than it."""
  graphdef, abstract = nnx.split(nnx.eval_shape(make))
  state = jax.jit(lambda: nnx.split(make())[1],
                  out_shardings=parallel.shardings_of(mesh, abstract))()
  return nnx.merge(graphdef, state)


def run_student(args) -> dict:
  c = load_config(args.config, args.set)
  seq_len = args.seq_len or c.data.seq_len
  accum = args.accum or c.opt.accum_steps
  rows = c.opt.batch_size * accum
  rng = np.random.default_rng(0)
  # vocab_size 0 in a group is the tokenizer's: the teacher's in these configs
  model_cfg = build.model_config(c.student, c.teacher.vocab_size or 128256)
  directory = os.path.join(args.dir, f"student_{seq_len}_{rows}_{args.docs}")
  shutil.rmtree(directory, ignore_errors=True)
  t0 = time.perf_counter()
  store = synthetic_cache(directory, rng, rows=rows, seq_len=seq_len, docs=args.docs,
                          vocab=model_cfg.vocab_size, k=c.cache.k, layout=c.cache.layout)
  print(f"synthetic cache: {rows} rows x {seq_len} in {time.perf_counter() - t0:.1f} s", flush=True)

  c.opt.accum_steps = accum
  t0 = time.perf_counter()
  # The loop of train.fit without its checkpoints and reports: the same setup (state, mesh
  # placement, remat "auto", loader) and the same step.
  trainer = train.Trainer(model=llama.Transformer(model_cfg, rngs=nnx.Rngs(0)),
                          model_cfg=model_cfg, store=store, opt=c.opt, loss_cfg=c.loss,
                          hard_labels=False, seed=0, mesh=mesh_of(c))
  model_cfg = trainer.model_cfg
  setup_s = time.perf_counter() - t0  # state, placement, remat auto's planning and compiles
  print(f"remat {model_cfg.remat} (set up in {setup_s:.1f} s)", flush=True)
  plan = {}
  if trainer.mesh is None and (args.memory or not args.steps):
    plan = print_memory_analysis(trainer)
  if args.memory:
    print(pool_line(), flush=True)
  if not args.steps:  # the plan only
    trainer.close()
    return {"kind": "plan", "seq_len": seq_len, "accum_steps": accum, "docs_per_row": args.docs,
            "optimizer_state": f"{c.opt.state_dtype}/{c.opt.state_memory}", "plan_gib": plan}
  times, waits, context, spans = [], [], [], []

  def one_step():
    t0, wall0 = time.perf_counter(), time.time()
    batch = trainer.next_batch()
    t1 = time.perf_counter()
    context.append(documents.mean_context(batch["segment_ids"]))
    metrics = trainer.step(batch)
    jax.block_until_ready((trainer.state, metrics))
    times.append(time.perf_counter() - t0)
    spans.append((wall0, time.time()))
    waits.append(t1 - t0)
    return metrics

  for step in range(args.steps):
    metrics = one_step()
    print(f"step {step}: {times[-1]:.2f} s (batch wait {waits[-1]:.3f} s) "
          f"loss {float(metrics['loss']):.3f} peak {peak_gib():.1f} GiB", flush=True)
    if args.memory:
      print(pool_line(), flush=True)
  profile = {}
  if args.profile:  # one more step, traced (not among the timed ones)
    from experiments.bench import profile_summary
    shutil.rmtree(args.profile, ignore_errors=True)
    with jax.profiler.trace(args.profile, create_perfetto_trace=True):
      one_step()
    times.pop(), waits.pop(), context.pop(), spans.pop()
    profile = profile_summary.summarize(args.profile)
    profile_summary.print_summary(profile)
  trainer.close()
  step_s = float(np.median(times[1:]))
  tokens = rows * seq_len
  per_token = llama.flops_per_token(model_cfg, float(np.mean(context)))
  tflops = per_token * tokens / step_s / 1e12
  return {"kind": "student", "seq_len": seq_len, "accum_steps": accum,
          "batch_size": c.opt.batch_size, "docs_per_row": args.docs, "packed": args.docs != 1,
          "devices": 1 if trainer.mesh is None else trainer.mesh.size,
          "step_s": step_s, "tokens_per_s": tokens / step_s, "model_tflops": tflops,
          "mfu": tflops * 1e12 / reporting.peak_flops() if reporting.peak_flops() else None,
          "peak_gib": peak_gib(),
          "optimizer_state": f"{c.opt.state_dtype}/{c.opt.state_memory}",
          "accum_dtype": c.opt.accum_dtype,
          "batch_wait_frac": float(np.sum(waits[1:]) / np.sum(times[1:])),
          "setup_s": setup_s, "first_step_s": times[0], "remat": model_cfg.remat,
          "remat_config": c.student.remat, "fp8_matmuls": model_cfg.fp8_matmuls,
          "clocks": WATCH.clocks(spans[1][0], spans[-1][1]) if len(spans) > 1 else {},
          **({"plan_gib": plan} if plan else {}), **({"profile": profile} if profile else {})}


def print_memory_analysis(trainer: train.Trainer) -> dict:
  """XLA's compiled memory plan of the two programs of a step (GiB), printed and returned."""
  loader, accum = trainer.loader, trainer.opt.accum_steps
  batch = train.to_step_batch(loader.store.read(np.arange(loader.batch_size)), accum, False)
  kw = dict(graphdef=trainer.graphdef, loss=trainer.loss, max_documents=trainer.max_documents)
  micro = trainer.targets({k: v[0] for k, v in batch.items()}, kw["max_documents"])
  trained = train.trained(trainer.state)
  _, metrics = jax.eval_shape(functools.partial(train.grad_step, **kw), trained,
                              trainer.grads_sum, micro)
  programs = {
      "grad_step": train.grad_step.lower(trained, trainer.grads_sum, micro, **kw),
      "apply_step": train.apply_step.lower(trainer.state, trainer.grads_sum, [metrics] * accum,
                                           tx=trainer.tx, state_memory=trainer.opt.state_memory)}
  plan = {}
  for name, lowered in programs.items():
    m = lowered.compile().memory_analysis()
    plan[name] = {key: round(getattr(m, f"{key}_size_in_bytes") / 2**30, 2)
                  for key in ("argument", "output", "alias", "temp")}
    print(f"memory {name}: arguments {plan[name]['argument']:.2f} GiB, outputs "
          f"{plan[name]['output']:.2f} (aliased {plan[name]['alias']:.2f}), "
          f"temporaries {plan[name]['temp']:.2f}", flush=True)
  return plan


def run_teacher(args) -> dict:
  c = load_config(args.config, args.set)
  model_cfg = build.model_config(c.teacher, c.teacher.vocab_size or 128256)
  # as pipeline.stage_cache: a mesh of several devices shards the teacher over this process's
  mesh = parallel.teacher_mesh("process") if mesh_of(c) is not None else None
  make = lambda: llama.Transformer(model_cfg, rngs=nnx.Rngs(0))
  model = make() if mesh is None else sharded_model(make, mesh)
  vocab, seq_len, k = model_cfg.vocab_size, args.seq_len, c.cache.k
  rng = np.random.default_rng(0)
  directory = os.path.join(args.dir, f"teacher_{seq_len}")
  shutil.rmtree(directory, ignore_errors=True)
  data = cache.create(os.path.join(directory, "data"), num_seqs=args.rows, seq_len=seq_len, k=0,
                      vocab_size=vocab, attrs={"source": "synthetic"})
  segment_ids, positions = packed_segments(rng, args.rows, seq_len, args.docs)
  data.write(0, {"tokens": rng.integers(0, vocab, (args.rows, seq_len), dtype=np.int32),
                 "segment_ids": segment_ids, "positions": positions,
                 "loss_mask": segment_ids > 0})
  data = cache.open(os.path.join(directory, "data"))
  batch_size, chunk = c.cache.batch_size, c.cache.chunk_size

  graphdef, state = nnx.split(model)
  # The step alone over the first few batches (their documents differ: one batch's mean context,
  # and so its attention time, is not the run's)
  batches = max(1, min(ALONE_BATCHES, args.rows // batch_size))
  alone_rows = data.read(np.arange(batches * batch_size))
  bound = documents.store_documents_bound(data)  # write_cache's: one compiled step for both
  place = (lambda x: x) if mesh is None else functools.partial(parallel.place_rows, mesh)
  batch_inputs = [[place(alone_rows[name][i * batch_size:(i + 1) * batch_size])
                   for name in ("tokens", "positions", "segment_ids")] for i in range(batches)]
  inputs = batch_inputs[0]
  kw = dict(k=k, chunk_size=chunk, vocab_size=vocab, hidden=False, max_documents=bound)
  # XLA's plan first: printed even when the step then runs out of memory
  memory = teacher.topk_batch.lower(graphdef, state, None, *inputs, **kw).compile(
      ).memory_analysis()
  plan = {key: round(getattr(memory, f"{key}_size_in_bytes") / 2**30, 2)
          for key in ("argument", "output", "temp")}
  print(f"teacher step plan: weights and inputs {plan['argument']:.2f} GiB, temporaries "
        f"{plan['temp']:.2f} GiB", flush=True)
  jax.block_until_ready(teacher.topk_batch(graphdef, state, None, *inputs, **kw))  # compiles
  t0 = time.perf_counter()
  for each in batch_inputs:
    jax.block_until_ready(teacher.topk_batch(graphdef, state, None, *each, **kw))
  device_tok_s = batches * batch_size * seq_len / (time.perf_counter() - t0)
  alone_context = documents.mean_context(alone_rows["segment_ids"])
  print(f"teacher step alone ({batches} batches): {device_tok_s:,.0f} tokens/s", flush=True)
  profile = {}
  if args.profile:  # one more step alone, traced
    from experiments.bench import profile_summary
    shutil.rmtree(args.profile, ignore_errors=True)
    with jax.profiler.trace(args.profile, create_perfetto_trace=True):
      jax.block_until_ready(teacher.topk_batch(graphdef, state, None, *inputs, **kw))
    profile = profile_summary.summarize(args.profile)
    profile_summary.print_summary(profile)

  t0, wall0 = time.perf_counter(), time.time()
  teacher.write_cache(model, data, os.path.join(directory, "cache"), k=k, batch_size=batch_size,
                      chunk_size=chunk, vocab_size=vocab, attrs={"teacher": "random"},
                      layout=c.cache.layout, mesh=mesh)
  seconds = time.perf_counter() - t0
  clocks = WATCH.clocks(wall0, time.time())
  return {"kind": "teacher", "seq_len": seq_len, "batch_size": batch_size,
          "devices": 1 if mesh is None else mesh.size,
          "docs_per_row": args.docs, "packed": args.docs != 1, "rows": args.rows,
          "tokens_per_s": args.rows * seq_len / seconds, "device_tokens_per_s": device_tok_s,
          "plan_gib": plan,
          "model_tflops": device_tok_s * llama.flops_per_token(model_cfg, alone_context)
          / 3 / 1e12,  # the step alone's: forward only, a third of the training FLOPs
          "layout": c.cache.layout, "peak_gib": peak_gib(), "clocks": clocks,
          **({"profile": profile} if profile else {})}


def load_config(path, overrides):
  """configs/NAME.py[:variant] with group.field=value overrides."""
  path, _, variant = path.partition(":")
  spec = importlib.util.spec_from_file_location("bench_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config(variant)
  for item in overrides:
    key, value = item.split("=", 1)
    group, field = key.split(".")
    old = c[group][field]
    c[group][field] = type(old)(value) if not isinstance(old, bool) else value == "True"
  config.validate(c)
  return c


def commit() -> str:
  if os.environ.get("KDJAX_COMMIT"):  # a copy of the tree without its git history
    return os.environ["KDJAX_COMMIT"]
  try:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def sweep(args):
  if args.list:
    for name, line in e2e_sweep.SWEEP.items():
      print(f"{name:14s} {line}")
    return
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  for name in args.names:
    cmd = [sys.executable, "-m", __spec__.name, *e2e_sweep.SWEEP[name].split(),
           "--json", args.out, "--name", name, "--dir", args.dir]
    print(f"== {name}: {' '.join(cmd[3:])}", flush=True)
    result = subprocess.run(cmd)
    if result.returncode:
      with open(args.out, "a") as f:
        f.write(json.dumps({"name": name, "error": f"exit {result.returncode}",
                            "commit": commit(), "date": today()}) + "\n")


def plot(args):
  """Bars of tokens/s and peak GiB, one per configuration (its latest measured line)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  latest = {}
  for line in open(args.results):
    row = json.loads(line)
    # not the plan-only and stage lines, nor another GPU's (the H100's profiling runs)
    if "error" not in row and "tokens_per_s" in row and "H200" in row.get("device", "H200"):
      latest[row["name"]] = row
  names = list(latest)
  fig, axes = plt.subplots(1, 2, figsize=(12, max(4.5, 1.2 + 0.2 * len(names))))  # a row each
  for ax, key, label in ((axes[0], "tokens_per_s", "tokens/s"), (axes[1], "peak_gib", "peak GiB")):
    ax.barh(names, [latest[n][key] for n in names],
            color=["tab:orange" if latest[n]["kind"] == "teacher" else "tab:blue" for n in names])
    ax.set_xlabel(label)
    ax.invert_yaxis()
  axes[0].xaxis.set_major_formatter(lambda x, _: f"{x / 1000:g}k")
  axes[0].set_title("student step (blue) / teacher cache writing (orange), one H200")
  axes[1].axvline(48, color="gray", ls=":")
  axes[1].axvline(60, color="gray", ls=":")
  fig.tight_layout()
  out = os.path.splitext(args.results)[0] + ".png"
  fig.savefig(out, dpi=110)
  print(out)


def today() -> str:
  return datetime.date.today().isoformat()


def record(row: dict, path: str = "") -> None:
  """Prints a result line, and appends it to the results file `path` if one is given."""
  print(json.dumps(row), flush=True)
  if path:
    with open(path, "a") as f:
      f.write(json.dumps(row) + "\n")


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  sub = parser.add_subparsers(dest="mode", required=True)
  p = sub.add_parser("sweep")
  p.add_argument("names", nargs="*")
  p.add_argument("--list", action="store_true")
  p.add_argument("--out", default=RESULTS)
  p.add_argument("--dir", default="/tmp/kdjax_e2e")
  p = sub.add_parser("plot")
  p.add_argument("results", nargs="?", default=RESULTS)
  for mode in ("student", "teacher"):
    p = sub.add_parser(mode)
    p.add_argument("--config", default="configs/8k.py")
    p.add_argument("--seq-len", type=int, default=0, help="0: the config's")
    p.add_argument("--accum", type=int, default=0, help="0: the config's accum_steps")
    p.add_argument("--docs", type=docs_arg, default=4,
                   help="documents per row, or 'stdlib': rows of this Python's stdlib files")
    p.add_argument("--rows", type=int, default=16, help="teacher: rows written")
    p.add_argument("--steps", type=int, default=3,
                   help="student: steps, the first compiles; 0: XLA's memory plan only")
    p.add_argument("--set", action="append", default=[], help="group.field=value")
    p.add_argument("--json", default="", help="append the result here")
    p.add_argument("--memory", action="store_true", help="print XLA's memory plan first")
    p.add_argument("--mem-fraction", type=float, default=0.0,
                   help="XLA_PYTHON_CLIENT_MEM_FRACTION (0: the config's mesh.memory_fraction)")
    p.add_argument("--preallocate", action="store_true",
                   help="XLA_PYTHON_CLIENT_PREALLOCATE=true: JAX's pool taken whole at the start, "
                        "one region (peaks stay the arrays' own)")
    p.add_argument("--name", default="")
    p.add_argument("--dir", default="/tmp/kdjax_e2e")
    p.add_argument("--profile", default="",
                   help="student: trace one more step into this directory and summarise it "
                        "(experiments/bench/profile_summary.py)")
  return parser


def main():
  args = build_parser().parse_args()
  if args.mode in ("sweep", "plot"):
    return sweep(args) if args.mode == "sweep" else plot(args)
  logging.basicConfig(level=logging.INFO, format="%(message)s")  # kdjax's lines (remat auto)
  if args.mem_fraction:  # read when JAX first touches the GPU, below
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(args.mem_fraction)
  if args.preallocate:
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true"
  c = load_config(args.config, args.set)
  parallel.claim_memory(c.mesh.memory_fraction, c.mesh.allocator)  # as kdjax.main
  fp8.prepare_compiler(c.student.fp8_matmuls)  # as kdjax.main
  WATCH.start()  # the clocks of every GPU run; the peak where JAX keeps none (platform)
  result = run_student(args) if args.mode == "student" else run_teacher(args)
  result.update(name=args.name, config=getattr(args, "config", ""), overrides=args.set,
                mem_fraction=float(os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"]),
                allocator=os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", ""),
                preallocate=os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", ""),
                xla_flags=os.environ.get("XLA_FLAGS", ""),
                commit=commit(), date=today(), device=str(jax.devices()[0].device_kind))
  record(result, args.json)


if __name__ == "__main__":
  main()
