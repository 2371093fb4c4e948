"""experiments/studies/cache_floor.py and cache_context.py as committed, through their command
lines: their measures on inputs whose answers are known by hand (`--check`; BENCHMARKS.md's floors
of a top-k cache and its per-context id lists rest on them), and every table on a tiny synthetic
teacher."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADINGS = {"cache_floor": ("### Log-prob quantisers", "### Ids", "### Floors", "positions/s"),
            "cache_context": ("### Ids against per-context lists",
                              "| teacher | input token | 256 |", "positions/s")}


def run(study, *args):
  """python -m experiments.studies.STUDY ARGS from the repository root on the CPU."""
  return subprocess.run([sys.executable, "-m", f"experiments.studies.{study}", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=120,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})


@pytest.mark.parametrize("study", sorted(HEADINGS))
def test_measures_on_known_answers(study, seed):
  proc = run(study, "--check", "--seed", str(seed))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.startswith("check passed"), proc.stdout


@pytest.mark.parametrize("study", sorted(HEADINGS))
def test_tables_of_a_tiny_synthetic_teacher(study, tmp_path):
  extra = ("--loss-positions", "32") if study == "cache_floor" else ()
  proc = run(study, "--synthetic-vocab", "2000", "--rows", "4", "--seq-len", "16", *extra,
             "--out", str(tmp_path))
  assert proc.returncode == 0, proc.stderr[-3000:]
  for heading in HEADINGS[study]:
    assert heading in proc.stdout, proc.stdout
