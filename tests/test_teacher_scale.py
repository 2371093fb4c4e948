"""Writers in separate processes: killed at random points, several at once, two of one rank.

Run as a script, this file is the child process: it writes the cache of a data store with the test
teacher. Faults land at named points of the write path (tests/fixtures/failpoints.py, armed through
the child's KDJAX_CACHE_FAILPOINT): SIGKILL (no cleanup) at the n-th hit of a point, or a pause
until the parent says go. No timer or timeout decides an outcome, so every verdict is the same
under any machine load. The teacher is a two-matrix stand-in following the model contract: a
process starts in seconds, and the cache logic under test does not depend on the model
(test_teacher.py checks the real one).
"""
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from kdjax import cache
from tests.fixtures import failpoints

pytestmark = pytest.mark.slow  # whole runs in subprocesses: not in the fast subset

ROWS, REGION_ROWS = 36, 2
REGIONS = ROWS // REGION_ROWS  # each hit once per region: write() takes whole regions of 1 batch
# every point (experiments/studies/cache_faults.py injects them all)
POINTS = ("batch", "data", "after_data", "after_record")


def spawn(tmp_path, rank=0, world=1, failpoint=""):
  tests = os.path.dirname(os.path.abspath(__file__))  # conftest; the repository root: its imports
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "PYTHONPATH": os.pathsep.join([tests, os.path.dirname(tests)]), failpoints.ENV: failpoint}
  return subprocess.Popen(
      [sys.executable, __file__, str(tmp_path / "data"), str(tmp_path / "cache"), str(rank),
       str(world)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, make_data, write, store_files, tiny_teacher):
  """The data store and the files of an uninterrupted single-writer cache."""
  path = tmp_path_factory.mktemp("reference")
  make_data(path / "data", num_seqs=ROWS, region_rows=REGION_ROWS)
  write(tiny_teacher(), cache.open(path / "data"), path / "cache")
  return path, store_files(path / "cache")


def is_complete(path):
  """False for a cache that a killed writer left incomplete (the error it must give)."""
  try:
    cache.open(path)
  except cache.CacheError as error:
    assert "incomplete" in str(error), error
    return False
  return True


@pytest.mark.parametrize("point", POINTS)
def test_kill_at_a_random_point_then_resume_gives_identical_bytes(reference, tmp_path, point,
                                                                  store_files, write, tiny_teacher):
  ref_path, expected = reference
  os.symlink(ref_path / "data", tmp_path / "data")
  count = np.random.default_rng(POINTS.index(point)).integers(1, REGIONS + 1)
  proc = spawn(tmp_path, failpoint=f"{point}:{count}:kill")
  out, err = proc.communicate()
  assert proc.returncode == -signal.SIGKILL, (point, count, out, err)
  # Only a kill after the last region's record leaves a finished cache.
  assert is_complete(tmp_path / "cache") == (point == "after_record" and count == REGIONS)
  write(tiny_teacher(), cache.open(tmp_path / "data"), str(tmp_path / "cache"))
  assert store_files(tmp_path / "cache") == expected, (point, count)


def test_three_processes_write_what_one_writes(reference, tmp_path, store_files):
  ref_path, expected = reference
  os.symlink(ref_path / "data", tmp_path / "data")
  procs = [spawn(tmp_path, rank, 3) for rank in range(3)]
  for proc in procs:
    out, err = proc.communicate()
    assert proc.returncode == 0, err
  assert store_files(tmp_path / "cache") == expected
  cache.open(tmp_path / "cache")


def test_a_second_writer_of_a_running_rank_is_refused(reference, tmp_path, store_files):
  ref_path, expected = reference
  os.symlink(ref_path / "data", tmp_path / "data")
  first = spawn(tmp_path, failpoint="locked:1:pause")
  line = first.stdout.readline()  # the first writer holds the lock of rank 0 and waits
  assert line.strip() == "failpoint locked", (line, first.stderr.read() if not line else "")
  second = spawn(tmp_path)
  out, err = second.communicate()
  assert second.returncode == 1, err
  assert f"writer-rank0.lock is held by pid {first.pid}" in err
  out, err = first.communicate("go\n")
  assert first.returncode == 0, err
  assert store_files(tmp_path / "cache") == expected


if __name__ == "__main__":
  # The child process is no pytest session: it takes conftest's helpers as a module.
  from conftest import TinyTeacher, write
  data_path, cache_path, rank, world = sys.argv[1:]
  write(TinyTeacher(), cache.open(data_path), cache_path, rank=int(rank), world=int(world))
