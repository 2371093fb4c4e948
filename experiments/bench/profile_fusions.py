"""A profiled step's kernels beside the bytes each moves: which fusions run far below the HBM.

    python -m experiments.bench.profile_fusions TRACE [HLO] [--top 30] [--tbps 4.8]

TRACE: a perfetto_trace.json.gz, or the folder `e2e_bench.py student --profile DIR` wrote.
HLO: the traced program's optimised HLO text (.txt or .txt.gz: XLA_FLAGS="--xla_dump_to=D
--xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*grad_step.*", the largest
*after_optimizations.txt); without it, times alone.

Per kernel of the micro-batch program (each GPU event's hlo_op, or its name inside a command
buffer; summed over the step): calls,
time, and with the HLO its bytes per call (hlo_kernels.py: operands and results, an upper bound
for kernels reading part of an operand), the rate that makes (GB/s) and its share of the HBM's
peak (--tbps: 4.8 H200, 3.35 H100), and the fused operations. Then the time of XLA's fusions
by the rate band they run in: where time goes to slow kernels rather than to bytes.
"""
import argparse
import collections
import gzip
import re

from experiments.bench import hlo_kernels, profile_summary


def op_times(trace_path: str, module: str = "grad_step") -> dict:
  """{hlo_op: [calls, seconds]} of the GPU kernels of programs whose name holds `module`."""
  out = collections.defaultdict(lambda: [0, 0.0])
  for name, program, _, dur, args in profile_summary.gpu_events(trace_path):
    if module in program:  # in a command buffer (CUDA graph) hlo_op names the buffer
      op = args.get("hlo_op", "")
      key = kernel_key(name if not op or op.startswith("command_buffer") else op)
      out[key][0] += 1
      out[key][1] += dur / 1e6
  return dict(out)


def kernel_key(name: str) -> str:
  """A kernel's HLO instruction as its GPU kernel is named ("loop_add_fusion.29" runs as
  "loop_add_fusion_29")."""
  return re.sub(r"[.\-]", "_", name)


def read_text(path: str) -> str:
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt") as f:
    return f.read()


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("trace")
  p.add_argument("hlo", nargs="?", default="")
  p.add_argument("--top", type=int, default=30)
  p.add_argument("--tbps", type=float, default=4.8, help="the HBM's peak, TB/s")
  p.add_argument("--module", default="grad_step")
  args = p.parse_args()
  trace = profile_summary.trace_file(args.trace)  # a file, or the folder holding one
  times = op_times(trace, args.module)
  if not times:
    raise SystemExit(f"no GPU kernels of a program named *{args.module}* in {trace}")
  hlo = read_text(args.hlo) if args.hlo else ""
  by_op = {kernel_key(k.instruction): k for k in hlo_kernels.kernels(hlo)} if hlo else {}
  total = sum(t for _, t in times.values())
  print(f"{len(times)} kernels, {sum(n for n, _ in times.values())} launches, {total:.3f} s "
        f"in programs named *{args.module}*")
  print(f"{'s':>7} {'share':>6} {'calls':>6} {'MB/call':>8} {'GB/s':>6} {'HBM':>5}  kind      op")
  bands = collections.Counter()
  fusion_time = 0.0
  for op, (calls, secs) in sorted(times.items(), key=lambda kv: -kv[1][1])[:args.top]:
    k = by_op.get(op)
    kind = k.kind if k else "?"
    if k:
      rate = k.bytes * calls / secs / 1e9
      print(f"{secs:7.3f} {secs / total:6.1%} {calls:6d} {k.bytes / 1e6:8.1f} {rate:6.0f} "
            f"{rate / (args.tbps * 1e3):5.0%}  {kind:8s}  {op}: "
            f"{hlo_kernels.fused_ops(hlo, k.computation) if kind in ('kLoop', 'kInput') else ''}")
    else:
      print(f"{secs:7.3f} {secs / total:6.1%} {calls:6d} {'':>8} {'':>6} {'':>5}  {kind:8s}  {op}")
  for op, (calls, secs) in times.items():
    k = by_op.get(op)
    if k and k.kind in ("kLoop", "kInput"):
      fusion_time += secs
      share = k.bytes * calls / secs / 1e9 / (args.tbps * 1e3)
      bands[min(int(share * 4), 3)] += secs  # quarters of the HBM's peak
  if fusion_time:
    print(f"XLA's fusions: {fusion_time:.3f} s; by the share of the HBM's peak they reach "
          "(bytes an upper bound): " + ", ".join(
              f"{25 * b}-{25 * (b + 1)}%: {bands[b]:.3f} s" for b in range(4)))


if __name__ == "__main__":
  main()
