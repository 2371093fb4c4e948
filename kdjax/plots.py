"""Training curves as a PNG, read from metrics.jsonl files."""
import json
import os


def read_metrics(path: str) -> list[dict]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def training_curves(panels: list[tuple[str, str, dict[str, str]]], out_png: str) -> str:
  """panels: [(y label, metric, {run label: metrics.jsonl path})]; missing files and rows without
  the metric are left out."""
  # imported here, not at the top: matplotlib takes about 0.9 s to import, and of the stages only
  # eval draws
  import matplotlib

  matplotlib.use("Agg")  # files only; no display needed
  import matplotlib.pyplot as plt

  metrics = {path: read_metrics(path) for _, _, runs in panels for path in runs.values()
             if os.path.exists(path)}  # each file read once
  fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.5), squeeze=False)
  for ax, (ylabel, metric, runs) in zip(axes[0], panels):
    for label, path in runs.items():
      rows = [r for r in metrics.get(path, []) if metric in r]
      if rows:
        ax.plot([r["step"] for r in rows], [r[metric] for r in rows], label=label)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.lines:
      ax.legend()
  fig.tight_layout()
  fig.savefig(out_png, dpi=100)
  plt.close(fig)
  return out_png
