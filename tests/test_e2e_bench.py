"""experiments/bench/e2e_bench.py runs as committed: its student and teacher modes on a CPU-sized
config."""
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # whole runs in subprocesses: not in the fast subset


def run(tmp_path, *args, config="configs/8k.py:smoke", devices=1, docs="3"):
  out = tmp_path / "e2e.jsonl"
  env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin",
         "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
  subprocess.run([sys.executable, "-m", "experiments.bench.e2e_bench", *args, "--config",
                  config, "--seq-len", "128", "--docs", docs, "--json", str(out),
                  "--dir", str(tmp_path / "work")], check=True, env=env)
  return json.loads(out.read_text().splitlines()[-1])


def test_student_and_teacher_modes(tmp_path):
  """The student on rows packed as real text packs (stdlib files: padding, a varying number of
  documents), the teacher on rows of 3 documents."""
  student = run(tmp_path, "student", "--accum", "2", "--steps", "2", "--memory", "--preallocate",
                docs="stdlib")
  assert student["kind"] == "student" and student["accum_steps"] == 2 and student["packed"]
  assert student["preallocate"] == "true"
  assert student["tokens_per_s"] > 0 and student["step_s"] > 0
  assert student["clocks"] == {}  # no nvidia-smi here
  teacher = run(tmp_path, "teacher", "--rows", "2")
  assert teacher["kind"] == "teacher" and teacher["tokens_per_s"] > 0 and teacher["clocks"] == {}


def test_two_device_modes(tmp_path):
  """The two-GPU configurations' modes on 2 CPU devices: the student data-parallel, the
  teacher built in its shards over both."""
  student = run(tmp_path, "student", "--accum", "2", "--steps", "2", "--set", "mesh.data=2",
                "--set", "opt.batch_size=2", devices=2)
  assert student["devices"] == 2 and student["tokens_per_s"] > 0
  teacher = run(tmp_path, "teacher", "--rows", "4", "--set", "mesh.fsdp=2", "--set",
                "cache.batch_size=2", "--set", "opt.batch_size=2", devices=2)
  assert teacher["devices"] == 2 and teacher["tokens_per_s"] > 0


def test_gpt_oss_modes(tmp_path):
  """configs/gpt_oss.py's shapes in miniature: the MoE student's step, and a teacher with
  sinks, a sliding window and random MXFP4 experts writing its cache."""
  student = run(tmp_path, "student", "--accum", "1", "--steps", "2",
                config="configs/gpt_oss.py:smoke")
  assert student["tokens_per_s"] > 0 and student["model_tflops"] > 0
  teacher = run(tmp_path, "teacher", "--rows", "2", "--set", "teacher.expert_weights=mxfp4",
                config="configs/gpt_oss.py:smoke")
  assert teacher["kind"] == "teacher" and teacher["tokens_per_s"] > 0
  assert teacher["model_tflops"] > 0 and teacher["plan_gib"]["argument"] > 0


def test_paper_table_runs_all_four_methods(tmp_path):
  """experiments/bench/paper_table.py as committed, on a CPU-sized config: the three offline
  methods optimise the same sparse KL, so they agree on the loss."""
  out = tmp_path / "table.jsonl"
  subprocess.run([sys.executable, "-m", "experiments.bench.paper_table",
                  "--config", "configs/8k.py:smoke", "--micro-steps", "1", "--out", str(out),
                  "--dir", str(tmp_path / "work")],
                 check=True, env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
  rows = {r["method"]: r for r in map(json.loads, out.read_text().splitlines())}
  assert set(rows) == {"online", "dense", "chunked", "ours"}
  assert all(r["iteration_s"] > 0 for r in rows.values())
  losses = [rows[m]["loss"] for m in ("dense", "chunked", "ours")]
  assert max(losses) - min(losses) < 1e-3 * abs(losses[0])

