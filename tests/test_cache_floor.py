"""experiments/studies/cache_floor.py as committed, through its command line: its measures on
inputs whose answers are known by hand (`--check`; BENCHMARKS.md's floors of a top-k cache rest on
them), and every table on a tiny synthetic teacher."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args):
  """python experiments/studies/cache_floor.py ARGS from the repository root on the CPU."""
  return subprocess.run([sys.executable, "experiments/studies/cache_floor.py", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=120,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_measures_on_known_answers(seed):
  proc = run("--check", "--seed", str(seed))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.startswith("check passed"), proc.stdout


def test_tables_of_a_tiny_synthetic_teacher(tmp_path):
  proc = run("--synthetic-vocab", "2000", "--rows", "4", "--seq-len", "16", "--loss-positions",
             "32", "--out", str(tmp_path))
  assert proc.returncode == 0, proc.stderr[-3000:]
  for heading in ("### Log-prob quantisers", "### Ids", "### Floors", "positions/s"):
    assert heading in proc.stdout, proc.stdout
