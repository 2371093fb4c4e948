"""What the GPUs run at while a benchmark runs: nvidia-smi sampled every 0.2 s (memory in use,
SM clock, power, the clock event reasons), and a window's summary for a result line:
e2e_bench.py's `clocks`, and its peak where JAX keeps none. No nvidia-smi (CPU): no samples, an
empty summary."""
import contextlib
import datetime
import subprocess
import threading
import time

import numpy as np

POWER_CAP = 0x4  # nvidia-smi's clock event reason "SW power cap": the power limit holds the clock


def gpu_sample(line: str):
  """One nvidia-smi line of GpuWatch's query (its timestamp, memory MiB, SM MHz, power W, clock
  event reasons) as (unix time, mib, mhz, watts, reasons); None where a field is not a number
  ("[N/A]"). The time is nvidia-smi's own, so a buffered pipe does not shift it."""
  try:
    stamp, mib, mhz, watts, reasons = (field.strip() for field in line.split(","))
    when = datetime.datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp()
    return when, float(mib), float(mhz), float(watts), int(reasons, 16)
  except ValueError:
    return None


def clock_summary(samples, t0: float, t1: float) -> dict:
  """What the GPUs ran at between unix times t0 and t1: median SM clock and power over the
  samples (every GPU's), and the share of them held by the power cap; {} with none."""
  inside = [x for x in samples if t0 <= x[0] <= t1]
  if not inside:
    return {}
  return {"sm_mhz_median": float(np.median([x[2] for x in inside])),
          "power_w_median": float(np.median([x[3] for x in inside])),
          "power_capped_share": round(sum(bool(x[4] & POWER_CAP) for x in inside) / len(inside), 3),
          "samples": len(inside)}


class GpuWatch:
  """nvidia-smi every 0.2 s from start(): the most memory in use on any GPU (the peak where JAX
  keeps none, mesh.allocator "platform"; it counts the CUDA context too, ~0.5 GiB), and each
  sample's SM clock, power and clock event reasons, so a line says what clock its steps ran at
  (an H200 under a training step sits at its 700 W cap: BENCHMARKS.md, "the pool, the clocks
  and the 8B teacher", 2026-12-05)."""

  FIELDS = "timestamp,memory.used,clocks.sm,power.draw,{reasons}"

  def __init__(self):
    self.most_mib, self.proc, self.samples = 0.0, None, []

  def start(self):
    reasons = "clocks_event_reasons.active"  # clocks_throttle_reasons.active on older drivers
    try:
      if subprocess.run(["nvidia-smi", f"--query-gpu={reasons}", "--format=csv,noheader"],
                        capture_output=True).returncode:
        reasons = "clocks_throttle_reasons.active"
      self.proc = subprocess.Popen(
          ["nvidia-smi", f"--query-gpu={self.FIELDS.format(reasons=reasons)}",
           "--format=csv,noheader,nounits", "-lms", "200"],
          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    except OSError:  # no nvidia-smi: no reading
      return
    threading.Thread(target=self._read, daemon=True).start()

  def _read(self):
    for line in self.proc.stdout:
      with contextlib.suppress(ValueError, IndexError):  # the memory even if the rest fails
        self.most_mib = max(self.most_mib, float(line.split(",")[1]))
      sample = gpu_sample(line)
      if sample:
        self.samples.append(sample)

  def gib(self) -> float:
    return self.most_mib / 1024 if self.most_mib else float("nan")

  def clocks(self, t0: float, t1: float) -> dict:
    """clock_summary of the window, once a sample from after it has arrived (up to 1 s)."""
    deadline = time.time() + 1.0
    while self.proc and time.time() < deadline and not (self.samples and self.samples[-1][0] >= t1):
      time.sleep(0.05)
    return clock_summary(list(self.samples), t0, t1)
