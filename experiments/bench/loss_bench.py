"""Loss-head benchmark: time and peak memory of loss + both gradients, one process per config.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python -m experiments.bench.loss_bench sweep --out DIR \
        --configs A:32768:pallas,A:32768:liger,...   # or --set quick / --set long
    python -m experiments.bench.loss_bench check           # pallas/xla/paper vs f32 reference
    python -m experiments.bench.loss_bench dwcheck A:32768,A:1048576   # bf16 vs f32 dW accumulation
    python -m experiments.bench.loss_bench plot DIR/results.jsonl

A config is SHAPE:TOKENS:IMPL[:CHUNK]; IMPL may carry options after "+" (XLA_FLAGS in OPTIONS):
"f32dw" accumulates dlm_head in float32 (dw_dtype); "notriton": every matmul by cuBLAS;
"noat": that and no gemm autotuning (cuBLAS's heuristic choice, no autotuning buffers);
"atcache": autotuning results cached on disk (a second process with it compiles without them);
"pos": per-position outputs too (return_aux, per_position: what the training step logs).

Shapes: A = D 4096, V 131072; B = D 2880, V 201088. bf16 inputs, K = 100, sparse objective,
about 10% of positions masked out. impl "liger" is Liger-Kernel's fused linear cross-entropy on
hard labels (PyTorch), "floor" the three [T, D] x [D, V] matmuls (bf16 in, f32 accumulation)
timed at min(T, 32768) tokens and scaled linearly. Median of 5 timed runs after 2 warm-ups;
peak = the process's peak device memory (inputs and gradients included; for JAX it also holds
XLA's one-time gemm-autotuning buffers from compilation), prog = XLA's memory analysis of the
compiled step (arguments + outputs + peak temporaries), what a step needs once compiled.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from experiments.bench import loss_bench_report

SHAPES = {"A": (4096, 131072), "B": (2880, 201088), "S": (64, 1003)}  # S: CPU smoke test
K = 100
WARMUP, REPEATS = 2, 5
FLOOR_MAX_T = 32768

OPTIONS = {
    "f32dw": "",
    "notriton": "--xla_gpu_enable_triton_gemm=false",
    "noat": "--xla_gpu_enable_triton_gemm=false --xla_gpu_autotune_level=0",
    "atcache": "--xla_gpu_per_fusion_autotune_cache_dir=/tmp/kdjax_bench_autotune",
    "pos": "",
}

QUICK = [f"{s}:{t}:{i}" for s, t, i in [
    ("A", 32768, "floor"), ("A", 32768, "liger"), ("A", 32768, "pallas"), ("A", 32768, "xla"),
    ("A", 32768, "paper"), ("B", 32768, "floor"), ("B", 32768, "liger"), ("B", 32768, "pallas"),
    ("B", 32768, "xla"), ("B", 32768, "paper"), ("A", 32768, "pallas:2048"),
    ("A", 32768, "pallas:512"), ("A", 8192, "floor"), ("A", 8192, "liger"),
    ("A", 8192, "pallas"), ("A", 8192, "xla"), ("A", 8192, "reference"), ("A", 8192, "paper"),
    ("A", 65536, "liger"), ("A", 65536, "pallas"), ("A", 65536, "xla"),
    ("A", 32768, "reference")]]
LONG = [f"{s}:{t}:{i}" for s, t, i in [
    ("A", 262144, "pallas"), ("A", 262144, "liger"), ("A", 262144, "xla"),
    ("A", 262144, "paper"), ("B", 262144, "pallas"), ("B", 262144, "liger"),
    ("A", 1048576, "pallas"), ("B", 1048576, "pallas"), ("A", 1048576, "liger"),
    ("B", 8192, "pallas"), ("B", 8192, "liger"), ("B", 65536, "pallas"), ("B", 65536, "liger"),
    ("A", 1048576, "xla")]]


def _median_time(fn, sync):
  for _ in range(WARMUP):
    sync(fn())
  times = []
  for _ in range(REPEATS):
    t0 = time.perf_counter()
    sync(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times), times


def jax_inputs(shape, tokens):
  import jax
  import jax.numpy as jnp
  dim, vocab = SHAPES[shape]
  kh, kw, kr, ks, kl, km, kb = jax.random.split(jax.random.key(int(time.time())), 7)
  hidden = jax.random.normal(kh, (tokens, dim), jnp.bfloat16)
  lm_head = (jax.random.normal(kw, (dim, vocab), jnp.bfloat16) * (2.0 / dim ** 0.5)).astype(
      jnp.bfloat16)
  # Distinct ids per row: r + k * s mod V with k * s < V.
  base = jax.random.randint(kr, (tokens, 1), 0, vocab)
  stride = jax.random.randint(ks, (tokens, 1), 1, vocab // K)
  ids = (base + jnp.arange(K)[None, :] * stride) % vocab
  logp = -0.3 - 0.25 * jnp.cumsum(jax.random.exponential(kl, (tokens, K)), axis=-1)
  mask = jax.random.uniform(km, (tokens,)) > 0.1
  labels = jax.random.randint(kb, (tokens,), 0, vocab)
  return hidden, lm_head, ids.astype(jnp.int32), logp, mask, labels


def loss_step(impl, chunk, dw_dtype=None, per_position=False):
  """jit(value_and_grad) of the loss in hidden and lm_head; arguments (h, w, ids, logp, mask).
  per_position: the loss also returns its per-position terms (an aux output)."""
  import jax

  from kdjax.loss import topk_kl
  return jax.jit(jax.value_and_grad(
      lambda h, w, ids, logp, mask: topk_kl.topk_kl_loss(
          h, w, ids, logp, mask, impl=impl, chunk_size=chunk, dw_dtype=dw_dtype,
          return_aux=per_position, per_position=per_position),
      argnums=(0, 1), has_aux=per_position))


def parse_spec(spec, chunk=None):
  """SHAPE:TOKENS:IMPL[+OPTION...][:CHUNK] -> (shape, tokens, impl, options, chunk); the
  options' XLA flags go into XLA_FLAGS (before jax is imported)."""
  shape, tokens, impl, *rest = spec.split(":")
  impl, *options = impl.split("+")
  unknown = set(options) - set(OPTIONS)
  if unknown:
    raise SystemExit(f"unknown options {unknown} in {spec}")
  flags = [os.environ.get("XLA_FLAGS", "")] + [OPTIONS[o] for o in options]
  os.environ["XLA_FLAGS"] = " ".join(f for f in flags if f)
  return shape, int(tokens), impl, options, int(rest[0]) if rest else chunk


def run_jax(shape, tokens, impl, chunk, dw_dtype=None, per_position=False):
  import jax
  import jax.numpy as jnp
  dev = jax.devices()[0]
  if impl == "floor":
    dim, vocab = SHAPES[shape]
    t = min(tokens, FLOOR_MAX_T)
    hidden, lm_head, *_ = jax_inputs(shape, t)
    grad = jax.random.normal(jax.random.key(1), (t, vocab), jnp.bfloat16)
    mm = jax.jit(lambda h, w, g: (
        jnp.einsum("td,dv->tv", h, w, preferred_element_type=jnp.float32),
        jnp.einsum("tv,dv->td", g, w, preferred_element_type=jnp.float32).astype(h.dtype),
        jnp.einsum("td,tv->dv", h, g, preferred_element_type=jnp.float32).astype(w.dtype)))
    med, times = _median_time(lambda: mm(hidden, lm_head, grad), jax.block_until_ready)
    scale = tokens / t
    return dict(time_s=med * scale, times=[x * scale for x in times], floor_tokens=t)
  inputs = jax_inputs(shape, tokens)[:5]
  jax.block_until_ready(inputs)
  stats = dev.memory_stats() or {}
  before, gen_peak = stats.get("bytes_in_use"), stats.get("peak_bytes_in_use")
  step = loss_step(impl, chunk, dw_dtype, per_position)
  # XLA's own account of the program: arguments + outputs + peak temporaries. The process
  # peak below also holds one-time compile-time allocations (gemm autotuning buffers).
  ma = step.lower(*inputs).compile().memory_analysis()
  program = ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
  med, times = _median_time(lambda: step(*inputs), jax.block_until_ready)
  stats = dev.memory_stats() or {}
  return dict(time_s=med, times=times, peak_bytes=stats.get("peak_bytes_in_use"),
              program_bytes=program, temp_bytes=ma.temp_size_in_bytes, input_bytes=before,
              input_generation_peak=gen_peak)


def run_liger(shape, tokens):
  import torch
  from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
  dim, vocab = SHAPES[shape]
  dev = torch.device("cuda")
  hidden = torch.randn(tokens, dim, dtype=torch.bfloat16, device=dev, requires_grad=True)
  weight = (torch.randn(vocab, dim, dtype=torch.bfloat16, device=dev) * (2.0 / dim ** 0.5))
  weight.requires_grad_(True)
  labels = torch.randint(0, vocab, (tokens,), device=dev)
  labels[torch.rand(tokens, device=dev) < 0.1] = -100
  loss_fn = LigerFusedLinearCrossEntropyLoss()

  def step():
    hidden.grad = None
    weight.grad = None
    loss = loss_fn(weight, hidden, labels)
    loss.backward()
    return loss

  med, times = _median_time(step, lambda _: torch.cuda.synchronize())
  return dict(time_s=med, times=times, peak_bytes=torch.cuda.max_memory_allocated())


def _apply_overrides():
  """KDJAX_BENCH_SET="kernels.logit_passes.BLOCK=2048,loss.chunked.MAX_CHUNK=4096": module
  constants (of kdjax's modules) for A/B runs."""
  import importlib
  for item in filter(None, os.environ.get("KDJAX_BENCH_SET", "").split(",")):
    name, value = item.split("=")
    module, attr = name.rsplit(".", 1)
    setattr(importlib.import_module(f"kdjax.{module}"), attr, int(value))


def memory(spec, out_dir):
  """Compile one config (no run): XLA's memory analysis and the optimised HLO to out_dir."""
  shape, tokens, impl, options, chunk = parse_spec(spec)
  _apply_overrides()
  step = loss_step(impl, chunk, "float32" if "f32dw" in options else None)
  compiled = step.lower(*jax_inputs(shape, tokens)[:5]).compile()
  ma = compiled.memory_analysis()
  print(f"MEMORY {spec} {os.environ.get('KDJAX_BENCH_SET', '')}: temp "
        f"{ma.temp_size_in_bytes / 2**30:.3f} GiB, args {ma.argument_size_in_bytes / 2**30:.3f}, "
        f"out {ma.output_size_in_bytes / 2**30:.3f}, alias {ma.alias_size_in_bytes / 2**30:.3f}",
        flush=True)
  tag = spec.replace(":", "_") + os.environ.get("KDJAX_BENCH_SET", "").replace("=", "").replace(
      ",", "_").replace(".", "")
  with open(os.path.join(out_dir, f"hlo_{tag}.txt"), "w") as f:
    f.write(compiled.as_text())


def one(spec, chunk):
  shape, tokens, impl, options, chunk = parse_spec(spec, chunk)
  _apply_overrides()
  try:
    if impl == "liger":
      res = run_liger(shape, tokens)
    else:
      res = run_jax(shape, tokens, impl, chunk, "float32" if "f32dw" in options else None,
                    "pos" in options)
  except Exception as e:  # noqa: BLE001 - an OOM is a result
    msg = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
    res = dict(error=msg, oom="RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e))
  res.update(shape=shape, tokens=tokens, impl="+".join([impl] + options), chunk=chunk,
             overrides=os.environ.get("KDJAX_BENCH_SET", ""))
  print("RESULT " + json.dumps(res), flush=True)


def sweep(configs, out_dir, deadline_s, chunk):
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, "results.jsonl")
  start = time.time()
  for spec in configs:
    left = deadline_s - (time.time() - start)
    if left < 30:
      print(f"deadline: skipping {spec}", flush=True)
      continue
    cmd = [sys.executable, "-m", __spec__.name, "one", spec] + (["--chunk", str(chunk)] if chunk else [])
    try:
      proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
      lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
      res = (json.loads(lines[-1][7:]) if lines
             else dict(error=proc.stderr[-300:], spec=spec))
    except subprocess.TimeoutExpired:
      res = dict(error="timeout", spec=spec)
    with open(path, "a") as f:
      f.write(json.dumps(res) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "times"}), flush=True)
  loss_bench_report.table(path)


def check(shapes="AB", tokens=4000):
  """Max relative errors of the fused impls (bf16 inputs) vs the reference on f32 inputs."""
  import jax
  import jax.numpy as jnp

  from kdjax.loss import topk_kl
  first, last = shapes[0], shapes[-1]
  cases = [(first, "sparse", 1.0, 0.0), (first, "tail", 1.0, 0.0), (first, "renorm", 1.0, 0.0),
           (last, "sparse", 2.0, 0.5), (last, "tail", 1.0, 0.3)]
  worst = {}
  for shape, objective, tau, ce_weight in cases:
    hidden, lm_head, ids, logp, mask, labels = jax_inputs(shape, tokens)
    kw = dict(objective=objective, temperature=tau, labels=labels, ce_weight=ce_weight)

    def grads(impl, h, w):
      return jax.jit(jax.value_and_grad(lambda h, w: topk_kl.topk_kl_loss(
          h, w, ids, logp, mask, impl=impl, **kw), argnums=(0, 1)))(h, w)

    with jax.default_matmul_precision("highest"):
      ref_l, (ref_h, ref_w) = grads("reference", hidden.astype(jnp.float32),
                                    lm_head.astype(jnp.float32))
    for impl in ("pallas", "pallas_exact", "xla") + (
        ("paper", "reference") if objective == "sparse" else ()):
      try:
        val, (gh, gw) = grads(impl, hidden, lm_head)
      except Exception as e:  # noqa: BLE001 - report and go on to the next impl
        print(f"CHECK FAILED {impl} {shape} {objective}: {str(e)[:2000]}", flush=True)
        continue
      errs = dict(
          loss=float(jnp.abs(val - ref_l) / jnp.abs(ref_l)),
          dh_norm=float(jnp.linalg.norm(gh.astype(jnp.float32) - ref_h) / jnp.linalg.norm(ref_h)),
          dw_norm=float(jnp.linalg.norm(gw.astype(jnp.float32) - ref_w) / jnp.linalg.norm(ref_w)),
          dh_max=float(jnp.max(jnp.abs(gh.astype(jnp.float32) - ref_h)) / jnp.max(jnp.abs(ref_h))),
          dw_max=float(jnp.max(jnp.abs(gw.astype(jnp.float32) - ref_w)) / jnp.max(jnp.abs(ref_w))))
      print("CHECK " + json.dumps(dict(shape=shape, tokens=tokens, objective=objective, tau=tau,
                                       ce_weight=ce_weight, impl=impl, **errs)), flush=True)
      for k, v in errs.items():
        worst[(impl, k)] = max(worst.get((impl, k), 0.0), v)
  for impl in sorted({i for i, _ in worst}):
    print(f"max rel err {impl:9} " + " ".join(f"{k}={worst[(impl, k)]:.2e}" for k in
                                               ("loss", "dh_norm", "dw_norm", "dh_max", "dw_max")))


def dwcheck(specs):
  """dlm_head and dhidden of impl pallas with dW accumulated in bf16 (one rounding per chunk)
  against float32 accumulation (one rounding at the end), same inputs, default chunks."""
  import jax
  import jax.numpy as jnp

  from kdjax.loss import topk_kl
  for spec in specs.split(","):
    shape, tokens = spec.split(":")
    hidden, lm_head, ids, logp, mask, labels = jax_inputs(shape, int(tokens))
    grads = {}
    for dw_dtype in (None, "float32"):
      step = jax.jit(jax.grad(lambda h, w: topk_kl.topk_kl_loss(
          h, w, ids, logp, mask, objective="tail", impl="pallas", dw_dtype=dw_dtype),
          argnums=(0, 1)))
      grads[dw_dtype] = [g.astype(jnp.float32) for g in step(hidden, lm_head)]
      del step
    rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
    from kdjax.loss import fused, objectives
    chunk = fused.default_chunk(int(tokens), *SHAPES[shape], jnp.bfloat16,
                                 objectives.LossSpec("tail", 1.0, 0.0, False))
    print("DWCHECK " + json.dumps(dict(
        shape=shape, tokens=int(tokens), chunk=chunk, chunks=-(-int(tokens) // chunk),
        dw_rel_diff=rel(grads[None][1], grads["float32"][1]),
        dw_max_rel_diff=float(jnp.max(jnp.abs(grads[None][1] - grads["float32"][1])) /
                              jnp.max(jnp.abs(grads["float32"][1]))),
        dh_rel_diff=rel(grads[None][0], grads["float32"][0]))), flush=True)
    del grads


def profile(spec, out_dir, steps=3):
  """Device time per kernel name (ms per step) of one config, from a jax.profiler trace."""
  import glob

  import jax
  shape, tokens, impl, options, chunk = parse_spec(spec)
  inputs = jax_inputs(shape, tokens)[:5]
  step = loss_step(impl, chunk, "float32" if "f32dw" in options else None)
  jax.block_until_ready(step(*inputs))
  trace_dir = os.path.join(out_dir, "trace")
  with jax.profiler.trace(trace_dir):
    for _ in range(steps):
      jax.block_until_ready(step(*inputs))
  path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))[-1]
  totals, counts = {}, {}
  for plane in jax.profiler.ProfileData.from_file(path).planes:
    if not plane.name.startswith("/device:GPU"):
      continue
    print(f"PROFILE lines of {plane.name}: {[line.name for line in plane.lines]}")
    for line in plane.lines:
      if "stream" not in line.name.lower():
        continue
      for ev in line.events:
        totals[ev.name] = totals.get(ev.name, 0.0) + ev.duration_ns / 1e6 / steps
        counts[ev.name] = counts.get(ev.name, 0) + 1
  print(f"PROFILE {spec}: {sum(totals.values()):.1f} ms of kernels per step")
  for name, ms in sorted(totals.items(), key=lambda kv: -kv[1])[:15]:
    print(f"PROFILE {ms:9.2f} ms  x{counts[name] // steps:<5} {name[:110]}")


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("mode", choices=["sweep", "one", "check", "dwcheck", "plot", "table",
                                       "memory", "profile"])
  parser.add_argument("arg", nargs="?",
                      help="one: SHAPE:TOKENS:IMPL[:CHUNK]; check: shapes (AB); plot/table: file")
  parser.add_argument("--configs", default="", help="comma-separated SHAPE:TOKENS:IMPL list")
  parser.add_argument("--set", choices=["quick", "long"], help="predefined config list")
  parser.add_argument("--out", default="runs/loss_bench", help="sweep output directory")
  parser.add_argument("--deadline", type=float, default=520.0, help="sweep budget, seconds")
  parser.add_argument("--chunk", type=int, default=None, help="chunk size (default: impl's)")
  args = parser.parse_args()
  if args.mode == "one":
    one(args.arg, args.chunk)
  elif args.mode == "memory":
    memory(args.arg, args.out)
  elif args.mode == "profile":
    profile(args.arg, args.out)
  elif args.mode == "check":
    check(args.arg or "AB")
  elif args.mode == "dwcheck":
    dwcheck(args.arg)
  elif args.mode == "sweep":
    configs = [c for c in args.configs.split(",") if c]
    configs += {"quick": QUICK, "long": LONG, None: []}[args.set]
    sweep(configs, args.out, args.deadline, args.chunk)
  elif args.mode == "plot":
    loss_bench_report.plot(args.arg, os.path.splitext(args.arg)[0] + ".png", SHAPES)
  else:
    loss_bench_report.table(args.arg)


if __name__ == "__main__":
  main()
