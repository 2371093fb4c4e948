"""The loss-head benchmark's results file as a table and a plot (`loss_bench.py table|plot FILE`)."""
import json


def table(path):
  rows = [json.loads(l) for l in open(path)]
  ok = {(r["shape"], r["tokens"], r["impl"]): r for r in rows if "time_s" in r and not r["chunk"]}
  print(f"{'shape':5} {'T':>8} {'impl':10} {'time ms':>9} {'peak GiB':>9} {'prog GiB':>9} "
        f"{'/liger':>7} {'/floor':>7}")
  for r in rows:
    if "shape" not in r:
      print("error", r)
      continue
    key = (r["shape"], r["tokens"])
    if "time_s" not in r:
      print(f"{r['shape']:5} {r['tokens']:>8} {r['impl']:10} {'OOM' if r.get('oom') else 'error'}"
            f" {r.get('error', '')[:80]}")
      continue
    liger, floor = ok.get(key + ("liger",)), ok.get(key + ("floor",))
    peak, prog = r.get("peak_bytes"), r.get("program_bytes")
    name = r["impl"] + (f":{r['chunk']}" if r["chunk"] else "")
    print(f"{r['shape']:5} {r['tokens']:>8} {name:10} {1e3 * r['time_s']:9.1f} "
          f"{peak / 2**30 if peak else float('nan'):9.2f} "
          f"{prog / 2**30 if prog else float('nan'):9.2f} "
          f"{r['time_s'] / liger['time_s'] if liger else float('nan'):7.2f} "
          f"{r['time_s'] / floor['time_s'] if floor else float('nan'):7.2f}")


def plot(path, png, shapes_dxv: dict):
  """Time and peak memory against tokens, one column per shape, one line per impl."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = [json.loads(l) for l in open(path)]
  rows = [r for r in rows if "time_s" in r and not r.get("chunk") and not r.get("overrides")
          and not r.get("exclude_from_plot") and "+" not in r["impl"]]
  rows = list({(r["shape"], r["tokens"], r["impl"]): r for r in rows}.values())  # last run wins
  shapes = [s for s in shapes_dxv if any(r["shape"] == s for r in rows)]
  impls = sorted({r["impl"] for r in rows})
  colors = {impl: f"C{i}" for i, impl in enumerate(impls)}
  fig, axes = plt.subplots(2, len(shapes), figsize=(5.5 * len(shapes), 8), squeeze=False)
  for col, shape in enumerate(shapes):
    for impl in impls:
      pts = sorted((r["tokens"], r["time_s"], r.get("program_bytes"), r.get("peak_bytes"))
                   for r in rows if r["shape"] == shape and r["impl"] == impl)
      if not pts:
        continue
      axes[0, col].plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=colors[impl],
                        label=impl)
      mem = [(p[0], (p[2] or p[3]) / 2**30, bool(p[2])) for p in pts if p[2] or p[3]]
      if mem:
        axes[1, col].plot([m[0] for m in mem], [m[1] for m in mem], "-", color=colors[impl],
                          label=impl)
        for t, gib, program in mem:  # filled: XLA program memory; hollow: process peak
          axes[1, col].plot([t], [gib], "o", color=colors[impl],
                            markerfacecolor=colors[impl] if program else "none")
    dim, vocab = shapes_dxv[shape]
    axes[0, col].set(title=f"shape {shape}: D {dim}, V {vocab} (H200, bf16, K 100)",
                     ylabel="loss + both gradients, median s", xscale="log", yscale="log")
    axes[1, col].set(xlabel="tokens",
                     ylabel="GiB (filled: XLA program, hollow: process peak)",
                     xscale="log", yscale="log")
    axes[0, col].legend()
    axes[1, col].legend()
  fig.tight_layout()
  fig.savefig(png, dpi=100)
