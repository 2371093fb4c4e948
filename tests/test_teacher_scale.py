"""Writers in separate processes: killed at random points, or several at once, give the same bytes.

Run as a script, this file is the child process: it writes the cache of a data store with the test
teacher, optionally killing itself (SIGKILL, no cleanup) after a delay or at the n-th region record.
The teacher is a two-matrix stand-in following the model contract: a process starts in seconds, and
the cache logic under test does not depend on the model (test_teacher.py checks the real one).
"""
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdjax import cache
from test_teacher import D, V, make_data, store_files, write

ROWS, REGION_ROWS = 36, 2


class TinyTeacher(nnx.Module):

  def __init__(self):
    rng = np.random.default_rng(0)
    self.embed_VxD = nnx.Param(jnp.asarray(rng.normal(size=(V, D)), jnp.float32))
    self.mix_DxD = nnx.Param(jnp.asarray(rng.normal(size=(D, D)) / 4, jnp.float32))

  def __call__(self, tokens_BxT, positions_BxT, segment_ids_BxT, max_documents=None):
    del max_documents  # no attention
    x_BxTxD = self.embed_VxD[...][tokens_BxT] + 0.1 * positions_BxT[..., None]
    return 3.0 * jnp.tanh(x_BxTxD @ self.mix_DxD[...]) * (segment_ids_BxT > 0)[..., None]

  def lm_head_DxV(self):
    return self.embed_VxD[...].T


def child(data_path, cache_path, rank, world, kill):
  model = TinyTeacher()
  data = cache.open(data_path)
  # Compile before any timer starts, so a timed kill lands while regions are being written.
  write(model, data, cache_path + ".warmup", region_rows=ROWS)
  if kill.startswith("after:"):
    threading.Timer(float(kill[6:]), os.kill, (os.getpid(), signal.SIGKILL)).start()
  elif kill.startswith("record:"):
    real, n = cache.Store._record_region, int(kill[7:])
    calls = []

    def record_then_maybe_die(self, region):
      calls.append(region)
      if len(calls) == n:  # the region's shards are on disk, its record is not
        os.kill(os.getpid(), signal.SIGKILL)
      real(self, region)

    cache.Store._record_region = record_then_maybe_die
  start = time.perf_counter()
  write(model, data, cache_path, rank=rank, world=world)
  print(f"wrote in {time.perf_counter() - start:.3f} s", flush=True)


def spawn(tmp_path, rank=0, world=1, kill="none"):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.path.dirname(__file__)}
  return subprocess.Popen(
      [sys.executable, __file__, str(tmp_path / "data"), str(tmp_path / "cache"), str(rank),
       str(world), kill], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """The data store and an uninterrupted single-writer cache, with its write time."""
  path = tmp_path_factory.mktemp("reference")
  make_data(path / "data", num_seqs=ROWS, region_rows=REGION_ROWS)
  model = TinyTeacher()
  data = cache.open(path / "data")
  write(model, data, path / "warmup")
  start = time.perf_counter()
  write(model, data, path / "cache")
  return path, time.perf_counter() - start, store_files(path / "cache")


def is_complete(path):
  """False for a cache that a killed writer left incomplete (the error it must give)."""
  try:
    cache.open(path)
  except cache.CacheError as error:
    assert "incomplete" in str(error), error
    return False
  return True


def copy_data(reference_path, tmp_path):
  os.symlink(reference_path / "data", tmp_path / "data")


@pytest.mark.parametrize("seed", range(4))
def test_kill_at_a_random_point_then_resume_gives_identical_bytes(reference, tmp_path, seed):
  ref_path, seconds, expected = reference
  copy_data(ref_path, tmp_path)
  rng = np.random.default_rng(seed)
  # Even seeds: a timer at a uniformly random moment of the writing; odd seeds: between a
  # region's shards and its record.
  delay = rng.uniform(0.05, 0.9) * seconds
  for _ in range(8):
    kill = (f"after:{delay:.4f}" if seed % 2 == 0
            else f"record:{rng.integers(1, ROWS // REGION_ROWS)}")
    proc = spawn(tmp_path, kill=kill)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, (kill, out, err)
    if not is_complete(tmp_path / "cache"):
      break
    # The child wrote faster than the reference did (the machine's load varies): the timer fired
    # after the last record. Start afresh, timed by what the child took.
    assert seed % 2 == 0, (kill, out, err)
    for name in ("cache", "cache.warmup"):
      shutil.rmtree(tmp_path / name)
    took = re.search(r"wrote in ([0-9.]+) s", out)
    delay = rng.uniform(0.05, 0.9) * float(took.group(1)) if took else delay / 2
  else:
    pytest.fail(f"the writer finished before every timer; last {kill}")
  write(TinyTeacher(), cache.open(tmp_path / "data"), str(tmp_path / "cache"))
  assert store_files(tmp_path / "cache") == expected, kill


def test_three_processes_write_what_one_writes(reference, tmp_path):
  ref_path, _, expected = reference
  copy_data(ref_path, tmp_path)
  procs = [spawn(tmp_path, rank, 3) for rank in range(3)]
  for proc in procs:
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
  assert store_files(tmp_path / "cache") == expected
  cache.open(tmp_path / "cache")


if __name__ == "__main__":
  data_path, cache_path, rank, world, kill = sys.argv[1:]
  child(data_path, cache_path, int(rank), int(world), kill)
