"""Where a profiled step's GPU time goes: the top kernels, and shares by kind of work.

    python -m experiments.bench.profile_summary TRACE_DIR [--top 25]
    python -m experiments.bench.profile_summary TRACE --per-step TRACED STEP

--per-step: the traced step ran TRACED micro-batches (e2e_bench.py --accum), a real step runs
STEP: each kind's seconds in a real step (the micro-batch program's kernels scaled by
STEP / TRACED, the optimizer's once), and the kernels doing the model's arithmetic (matmul,
experts, attention, loss head) summed: a step can be no faster than they are unless they are.

TRACE_DIR is what `jax.profiler.trace(TRACE_DIR, create_perfetto_trace=True)` wrote (e2e_bench.py
student --profile DIR does so around one step). Reads its perfetto_trace.json.gz and sums the
kernels on the GPU's streams:

  matmul      cuBLAS / cuBLASLt / CUTLASS / Triton GEMM kernels of XLA's dots
  experts     the grouped matmuls of mixture-of-experts layers (kdjax/kernels/grouped.py)
  attention   cuDNN's flash attention (forward and backward)
  loss head   the Pallas kernels of the fused loss (kdjax/kernels)
  optimizer   every kernel of the apply_step program (AdamW, the gradient mean and zeroing)
  copies      memcpy / memset (host <-> device transfers, offloaded activations)
  other       XLA's fusions: norms, RoPE, SiLU, residual adds, casts, the gradient sum
  idle        the step's span on the GPU when no kernel runs

A kernel's kind comes from its name and its XLA program (hlo_module), so "matmul" includes the
loss head's dots that XLA, not Pallas, runs.
"""
import argparse
import collections
import glob
import gzip
import json
import os
import re

KINDS = ("matmul", "experts", "attention", "loss head", "optimizer", "copies", "other", "idle")
MATMUL = re.compile(r"gemm|nvjet|cutlass|xmma|cublas|sm90_|sm80_|wgmma|triton_gemm|matmul", re.I)
ATTENTION = re.compile(r"cudnn|fmha|flash|sdpa|attn", re.I)
COPY = re.compile(r"memcpy|memset|copy_", re.I)


def trace_file(directory: str) -> str:
  if os.path.isfile(directory):
    return directory
  found = sorted(glob.glob(os.path.join(directory, "**", "perfetto_trace.json.gz"),
                           recursive=True))
  if not found:
    raise SystemExit(f"no perfetto_trace.json.gz under {directory}: profile with "
                     "jax.profiler.trace(dir, create_perfetto_trace=True)")
  return found[-1]


def kind_of(name: str, module: str) -> str:
  if "apply_step" in module:
    return "optimizer"
  if COPY.search(name):
    return "copies"
  if ATTENTION.search(name):
    return "attention"
  if MATMUL.search(name):
    return "matmul"
  if "gmm_kernel" in name:  # kdjax/kernels/grouped.py: the experts' grouped matmuls (MoE)
    return "experts"
  if "mosaic_swiglu" in name:  # kdjax/kernels/swiglu.py: the MLP's gate and up matmuls
    return "matmul"
  if "pallas" in name.lower() or "mosaic" in name.lower() or name.startswith(("_kernel", "exp_",
                                                                              "dense_")):
    return "loss head"
  return "other"


def gpu_events(path: str):
  """(name, module, start_us, dur_us, args) of every complete event on a GPU stream."""
  with gzip.open(path, "rt") as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  gpu_pids = {e["pid"] for e in events
              if e.get("ph") == "M" and e.get("name") == "process_name"
              and re.search(r"/device:GPU:\d+$", str(e.get("args", {}).get("name", "")))}
  for e in events:
    if e.get("ph") == "X" and e.get("pid") in gpu_pids and e.get("dur"):
      args = e.get("args", {})
      yield (e["name"], str(args.get("hlo_module", args.get("module", ""))),
             float(e["ts"]), float(e["dur"]), args)


def summarize(directory: str, top: int = 25) -> dict:
  events = list(gpu_events(trace_file(directory)))
  if not events:
    print(f"no GPU kernels in the trace under {directory}")
    return {}
  arg_names = sorted(events[0][4])
  events = [e[:4] for e in events]
  by_kind = collections.Counter()
  by_kernel = collections.Counter()
  calls = collections.Counter()
  for name, module, _, dur in events:
    by_kind[kind_of(name, module)] += dur
    key = (name[:90], module[:40])
    by_kernel[key] += dur
    calls[key] += 1
  # busy = the union of kernel intervals (streams overlap); idle = span - busy
  spans = sorted((start, start + dur) for _, _, start, dur in events)
  busy, end = 0.0, -1.0
  for s, e in spans:
    if e > end:
      busy += e - max(s, end)
      end = e
  span = spans[-1][1] - spans[0][0] if spans else 0.0
  kernel_sum = sum(by_kind.values())
  by_kind["idle"] = max(span - busy, 0.0)
  shares = {k: by_kind[k] / (kernel_sum + by_kind["idle"]) for k in KINDS}
  return {"span_s": span / 1e6, "busy_s": busy / 1e6, "kernel_s": kernel_sum / 1e6,
          "kernels": len(events), "shares": shares, "event_args": arg_names,
          "top": [{"kernel": n, "module": m, "s": t / 1e6, "calls": calls[(n, m)],
                   "share": t / kernel_sum}
                  for (n, m), t in by_kernel.most_common(top)]}


ARITHMETIC = ("matmul", "experts", "attention", "loss head")


def per_step(path: str, traced: int, step: int) -> dict:
  """Seconds of each kind in a step of `step` micro-batches, from a traced step of `traced`: the
  micro-batch program's kernels scaled, the optimizer's (apply_step) once; idle left out."""
  seconds = collections.Counter()
  for name, module, _, dur, _ in gpu_events(trace_file(path)):
    kind = kind_of(name, module)
    seconds[kind] += dur / 1e6 * (1 if kind == "optimizer" else step / traced)
  out = {k: seconds[k] for k in KINDS if k != "idle"}
  out["arithmetic"] = sum(seconds[k] for k in ARITHMETIC)
  out["kernels"] = sum(out[k] for k in KINDS if k != "idle")
  return out


def print_summary(s: dict) -> None:
  if not s:
    return
  print(f"GPU span {s['span_s']:.2f} s, busy {s['busy_s']:.2f} s, kernels {s['kernels']} "
        f"({s['kernel_s']:.2f} s summed over streams)")
  print("  " + ", ".join(f"{k} {v:.1%}" for k, v in s["shares"].items()))
  for row in s["top"]:
    print(f"  {row['share']:6.1%} {row['s']:7.3f} s {row['calls']:6d}x  {row['kernel']}  "
          f"[{row['module']}]")


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("trace_dir")
  p.add_argument("--top", type=int, default=25)
  p.add_argument("--per-step", nargs=2, type=int, metavar=("TRACED", "STEP"))
  args = p.parse_args()
  if args.per_step:
    for kind, s in per_step(args.trace_dir, *args.per_step).items():
      print(f"  {kind:<11} {s:7.3f} s")
    return
  print_summary(summarize(args.trace_dir, args.top))


if __name__ == "__main__":
  main()
