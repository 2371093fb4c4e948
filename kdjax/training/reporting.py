"""A training run's reports: one console line per logged step, metrics.jsonl and TensorBoard events.

Each line gives the step's metrics, tokens/s, MFU (model FLOPs, llama.flops_per_token, over the
device's dense bf16 peak), peak device memory, the ETA and, of several processes, the one whose
batches the others waited for.
"""
import json
import logging
import time

import jax
import numpy as np

from kdjax import parallel
from kdjax.models import documents, llama
from kdjax.training import tensorboard
from kdjax.workdir import metrics_file, tensorboard_dir

# Dense bf16 peak FLOP/s by device kind, for the MFU in the log (opt.peak_tflops overrides).
PEAK_FLOPS = {"NVIDIA H200": 989e12, "NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H100": 989e12,
              "NVIDIA A100-SXM4-80GB": 312e12, "NVIDIA A100-SXM4-40GB": 312e12}

# Of several processes, a log line names the one whose batches others waited for when it spent
# more than this share of the time waiting for them.
SLOW_WAIT = 0.2


def peak_flops(override_tflops: float = 0.0) -> float | None:
  """The device's dense bf16 peak FLOP/s: the override if set, else PEAK_FLOPS, else None."""
  if override_tflops:
    return override_tflops * 1e12
  return PEAK_FLOPS.get(jax.devices()[0].device_kind)


class Reporter:
  """Checks and reports logged steps. Between two reports it adds up the host's time waiting for
  batches (`waited`) and the model FLOPs of the steps run (`ran`); of several processes each
  reports (the wait shares are gathered from all), process 0 alone writes."""

  def __init__(self, *, name: str, workdir: str, opt, model_cfg: llama.ModelConfig, schedule,
               tokens_per_step: int, hard_labels: bool, start: int):
    self.name, self.opt, self.model_cfg, self.schedule = name, opt, model_cfg, schedule
    self.tokens_per_step, self.hard_labels = tokens_per_step, hard_labels
    self.peak = peak_flops(opt.peak_tflops)
    self.lead = jax.process_index() == 0  # of several processes, one writes the logs and metrics
    self.metrics_path = metrics_file(workdir)
    self.events = (tensorboard.EventWriter(tensorboard_dir(workdir)) if self.lead
                   else None)
    self.time, self.step, self.wait, self.flops = time.perf_counter(), start, 0.0, 0.0
    self.first = None  # (time, step) of the first report: the ETA leaves out the compiling step

  def waited(self, seconds: float):
    self.wait += seconds

  def ran(self, segment_ids_AxBxT):
    self.flops += self.tokens_per_step * llama.flops_per_token(
        self.model_cfg, documents.mean_context(segment_ids_AxBxT))

  def report(self, step: int, metrics: dict, saved: int):
    """Checks and logs one step's metrics (blocks until that step is done). saved: the latest
    checkpoint's step, which a non-finite metric's error names."""
    # On hard labels the one-hot "teacher" makes kl the cross-entropy itself (kdjax.training.train's
    # docstring): logged once, as ce.
    m = {k: float(v) for k, v in metrics.items() if not (self.hard_labels and k == "kl")}
    now = time.perf_counter()
    if not all(np.isfinite(list(m.values()))):
      raise FloatingPointError(
          f"{self.name}: non-finite metrics at step {step}: {m}; no checkpoint was written after "
          f"step {saved}. Lower opt.lr or check the cache with 'python -m kdjax.cache verify "
          f"PATH', then run the same command again: it resumes from step {saved}.")
    elapsed, done = now - self.time, step - self.step
    tok_s = self.tokens_per_step * done / elapsed
    mfu = self.flops / elapsed / self.peak if self.peak else None
    if self.first is None:
      self.first = (now, step)
    first_t, first_step = self.first
    eta = ((now - first_t) / (step - first_step) * (self.opt.steps - step)
           if step > first_step else None)
    mem, lr = _peak_memory_gib(), float(self.schedule(step - 1))
    # Each process's share of the time it waited for its own batches: of several, the one that
    # waited most is the one the others waited for (a slow disk, a stalled loader).
    waits = parallel.per_process(self.wait / elapsed)
    self.time, self.step, self.wait, self.flops = now, step, 0.0, 0.0
    if not self.lead:
      return
    slowest = int(np.argmax(waits))
    _log_line(self.name, step, self.opt.steps, m, lr, tok_s, mfu, mem, eta,
              (slowest, waits[slowest]) if len(waits) > 1 and waits[slowest] > SLOW_WAIT else None)
    line = {"step": step, **m, "lr": lr, "tokens_per_s": tok_s, "mfu": mfu, "peak_mem_gib": mem,
            "data_wait_frac": max(waits), "time": time.time()}
    if len(waits) > 1:
      line.update(data_wait_process=slowest, data_wait_fracs=waits)
    with open(self.metrics_path, "a") as f:
      f.write(json.dumps(line) + "\n")
    self.events.scalars(step, {k: v for k, v in line.items() if k not in ("step", "time")})

  def close(self):
    if self.events is not None:
      self.events.close()


def _log_line(name, step, steps, m, lr, tok_s, mfu, mem_gib, eta_s, slowest=None):
  extra = f" top1 {m['top1']:.3f} ent {m['entropy']:.3f}" if "top1" in m else ""
  extra += f" lr {lr:.2e} tok/s {tok_s:.0f}"
  extra += f" mfu {mfu:.1%}" if mfu is not None else ""
  extra += f" mem {mem_gib:.1f}GiB" if mem_gib is not None else ""
  extra += f" eta {_duration(eta_s)}" if eta_s is not None else ""
  if slowest is not None:  # (process, its share of the time waiting for its batches)
    extra += f" slowest: process {slowest[0]} waited {slowest[1]:.0%} for data"
  kl = f" kl {m['kl']:.4f}" if "kl" in m else ""  # none on hard labels
  logging.info("%s step %d/%d loss %.4f%s ce %.4f%s", name, step, steps, m["loss"], kl, m["ce"],
               extra)


def _duration(seconds: float) -> str:
  minutes, secs = divmod(int(round(seconds)), 60)
  hours, minutes = divmod(minutes, 60)
  return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def _peak_memory_gib():
  stats = jax.local_devices()[0].memory_stats() or {}
  return stats["peak_bytes_in_use"] / 2**30 if "peak_bytes_in_use" in stats else None
