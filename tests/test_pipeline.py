"""End to end through `python -m kdjax.main` on the :smoke configs: every stage, its outputs, its
skipping of complete work, and the boundary checks between a cache and the config reading it."""
import json
import os
import subprocess
import sys

import pytest

# whole runs in subprocesses: not in the fast subset; one xdist worker runs the module, so its
# module fixtures' runs are made once, not once a worker
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_pipeline")]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main_command(config: str, workdir, *overrides, compile_cache=((), {})):
  """The command and environment of a run; compile_cache: the fixture main_compile_cache."""
  cache_args, cache_env = compile_cache
  return ([sys.executable, "-m", "kdjax.main", f"--config={ROOT}/configs/{config}",
           f"--config.workdir={workdir}", *cache_args, *overrides],
          {**os.environ, **cache_env, "JAX_PLATFORMS": "cpu"})


def run_main(config: str, workdir, *overrides, check=True, compile_cache=((), {})):
  cmd, env = main_command(config, workdir, *overrides, compile_cache=compile_cache)
  out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
  if check and out.returncode != 0:
    raise AssertionError(f"kdjax.main failed:\n{out.stderr[-4000:]}")
  return out


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory, main_compile_cache):
  workdir = tmp_path_factory.mktemp("demo")
  out = run_main("demo.py:smoke", workdir, compile_cache=main_compile_cache)
  return workdir, out


def test_demo_smoke_runs_every_stage_and_reports(demo_run):
  workdir, out = demo_run
  for path in ("config.json", "eval.json", "curves.png", "data/tokenizer.json", "data/train.zarr",
               "cache/train.zarr", "cache/eval.zarr", "teacher/metrics.jsonl",
               "student/metrics.jsonl", "baseline/metrics.jsonl", "export/config.json",
               "export/model.safetensors", "export/tokenizer.json"):
    assert os.path.exists(workdir / path), path
  results = json.load(open(workdir / "eval.json"))
  assert set(results) == {"student_init", "teacher", "student", "baseline"}
  # The cache was written by this teacher: its KL to its own cache is zero and top-1 agrees.
  assert abs(results["teacher"]["kl"]) < 1e-3
  assert results["teacher"]["top1_agreement"] > 0.999
  assert "KL to teacher" in out.stderr and "distillation cut" in out.stderr
  attrs = json.load(open(workdir / "cache/train.zarr/zarr.json"))["attributes"]
  assert len(attrs["teacher_hash"]) == 64 and attrs["k"] == 16 and attrs["tokenizer_hash"]
  steps = [json.loads(line)["step"] for line in open(workdir / "student/metrics.jsonl")]
  assert steps == [2, 4, 6]


def test_rerun_skips_complete_stages(demo_run):
  workdir, _ = demo_run
  before = open(workdir / "student/metrics.jsonl").read()
  out = run_main("demo.py:smoke", workdir)
  assert "complete; skipping" in out.stderr
  assert open(workdir / "student/metrics.jsonl").read() == before


def test_cache_with_fewer_entries_than_k_is_refused(demo_run):
  workdir, _ = demo_run  # its cache holds k = 16 (a smaller k reads its first entries)
  out = run_main("demo.py:smoke", workdir, "--config.stages=('train',)", "--config.cache.k=32",
                 "--config.workdir=" + str(workdir), check=False)
  assert out.returncode == 1 and "Traceback" not in out.stderr  # a user error: one line
  last = out.stderr.splitlines()[-1]
  assert last.startswith(f"kdjax: {workdir}/cache/train.zarr")
  assert "k=32 is asked for: set cache.k to at most 16" in last


def test_online_objective_evaluates_without_a_cache(tmp_path, main_compile_cache):
  """objective "online" writes no cache: eval runs the teacher beside each model instead, and
  reports the full-vocabulary KL."""
  workdir = tmp_path / "online"
  out = run_main("demo.py:smoke", workdir, "--config.loss.objective=online",
                 "--config.stages=('data', 'pretrain', 'train', 'eval')",
                 compile_cache=main_compile_cache)
  assert not os.path.exists(workdir / "cache")
  results = json.load(open(workdir / "eval.json"))
  assert set(results) == {"student_init", "teacher", "student"}
  assert abs(results["teacher"]["full_kl"]) < 1e-5 and results["teacher"]["top1_agreement"] == 1
  assert results["student"]["full_kl"] < results["student_init"]["full_kl"]
  assert "full KL" in out.stderr and "distillation cut" in out.stderr


def test_long_context_smoke_config_runs(tmp_path):
  run_main("32k.py:smoke", tmp_path / "w")
  results = json.load(open(tmp_path / "w" / "eval.json"))
  assert set(results) == {"student_init", "teacher", "student"}
  # the compiled programs stay for a rerun (config compile_cache: <workdir>/compile_cache)
  assert any((tmp_path / "w" / "compile_cache").iterdir())


def test_training_killed_by_sigkill_resumes_to_the_same_result(demo_run, tmp_path,
                                                               main_compile_cache):
  """kill -9 mid-training, run the same command again: identical metrics and evaluation."""
  import shutil
  import signal
  import time
  done, _ = demo_run
  args = ["--config.opt.steps=24", "--config.opt.ckpt_every=4", "--config.stages=('train', 'eval')"]
  runs = {}
  for name in ("straight", "killed"):
    workdir = tmp_path / name
    for part in ("data", "cache", "teacher"):  # done: only training and evaluation run
      shutil.copytree(done / part, workdir / part)
    runs[name] = workdir
  run_main("demo.py:smoke", runs["straight"], *args, compile_cache=main_compile_cache)

  cmd, env = main_command("demo.py:smoke", runs["killed"], *args, compile_cache=main_compile_cache)
  proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  ckpt = runs["killed"] / "student" / "ckpt"
  deadline = time.time() + 300
  while not (ckpt / "8").exists() and proc.poll() is None and time.time() < deadline:
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert not (ckpt / "24").exists(), "the run finished before it could be killed"
  run_main("demo.py:smoke", runs["killed"], *args, compile_cache=main_compile_cache)

  straight = json.load(open(runs["straight"] / "eval.json"))["student"]
  resumed = json.load(open(runs["killed"] / "eval.json"))["student"]
  assert straight == resumed
  last = lambda w: json.loads(open(w / "student/metrics.jsonl").read().splitlines()[-1])
  assert last(runs["straight"])["loss"] == last(runs["killed"])["loss"]


def test_notebook_runs_on_the_demo_cache(demo_run, monkeypatch):
  import nbformat
  from nbclient import NotebookClient
  workdir, _ = demo_run
  monkeypatch.setenv("KDJAX_CACHE", str(workdir / "cache" / "eval.zarr"))
  with open(os.path.join(ROOT, "notebooks", "explore_cache.ipynb")) as f:
    notebook = nbformat.read(f, as_version=4)
  NotebookClient(notebook, timeout=120, kernel_name="python3",
                 resources={"metadata": {"path": str(workdir)}}).execute()
  outputs = "".join(out.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                    for out in cell.outputs)
  assert "top-k mass" in outputs and "tensorstore and zarr-python disagree" not in outputs


def test_a_recoded_cache_is_used_as_it_is(demo_run, tmp_path):
  """`python -m kdjax.cache recode` of the demo's cache into the dictionary layout: the cache stage
  pointed at it, under the demo's own cache.layout, takes it as it is and writes nothing."""
  workdir, _ = demo_run
  for split in ("train", "eval"):
    subprocess.run([sys.executable, "-m", "kdjax.cache", "recode",
                    str(workdir / "cache" / f"{split}.zarr"), str(tmp_path / f"{split}.zarr")],
                   check=True, cwd=ROOT, capture_output=True,
                   env={**os.environ, "JAX_PLATFORMS": "cpu"})
  files = lambda: sorted((os.path.join(d, f), os.path.getmtime(os.path.join(d, f)))
                         for d, _, names in os.walk(tmp_path) for f in names)
  before = files()
  out = run_main("demo.py:smoke", workdir, "--config.stages=('cache',)",
                 f"--config.cache.path={tmp_path}")
  assert "of these rows in the dictionary layout" in out.stderr, out.stderr[-2000:]
  assert files() == before  # nothing written
