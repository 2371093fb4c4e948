"""A run of two processes (jax.distributed on localhost, one CPU device each) when one of them
fails: killed (SIGKILL) during stage train or stage cache, process 0 (the coordinator) too, the
other prints kdjax's one line naming it and exits (kdjax.peers, EXIT_LOST) instead of hanging
or aborting, and the same command run again resumes to the unbroken run's result (exported
parameters, cache bytes, metrics); SIGTERM to one process stops both after the same training
step, saved, or between two cache regions; a process that stalls before its batches is named
in the log lines. Faults land at exact steps (failpoints), never at a moment chosen by a timer;
the timeouts are generous for a loaded 2-core machine."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from kdjax import cache, parallel, peers
from tests.fixtures.stores import store_files

# one xdist worker runs the module: its module fixtures' runs are made once, not once a worker
pytestmark = pytest.mark.xdist_group("test_failures")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRETRAIN_STEPS = 3
FAILURE_TIMEOUT_S = 30
ARGS = ["--config=configs/demo.py:smoke", "--config.mesh.data=2", "--config.data.max_bytes=60000",
        f"--config.pretrain.steps={PRETRAIN_STEPS}", "--config.opt.steps=8",
        "--config.opt.log_every=1", f"--config.mesh.failure_timeout_s={FAILURE_TIMEOUT_S}",
        # 440 train rows in 7 regions: process 0 writes regions 0, 2, 4, 6 and process 1 1, 3, 5
        "--config.cache.region_rows=64"]
STAGES = "--config.stages=('data', 'pretrain', 'cache', 'train', 'export')"
METRICS = ("step", "loss", "kl", "ce", "grad_norm", "top1", "entropy")


def free_port() -> int:
  import socket
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def run_two(workdir, compile_cache, failpoint: str = "", stages=STAGES, armed=1) -> list[dict]:
  """Both processes of one run; failpoint (KDJAX_CACHE_FAILPOINT) armed in process `armed`;
  compile_cache: the fixture main_compile_cache. Returns each process's exit code, stderr and
  the time it ended."""
  cache_args, cache_env = compile_cache
  env = {**os.environ, **cache_env, "JAX_PLATFORMS": "cpu", parallel.ENV_PROCESSES: "2",
         parallel.ENV_COORDINATOR: f"localhost:{free_port()}"}
  env.pop("KDJAX_CACHE_FAILPOINT", None)
  procs = [subprocess.Popen(
      [sys.executable, "-m", "tests.fixtures.failpoints", *ARGS, *cache_args,
       f"--config.workdir={workdir}",
       stages],
      cwd=ROOT, env={**env, parallel.ENV_PROCESS_ID: str(i),
                     **({"KDJAX_CACHE_FAILPOINT": failpoint} if i == armed and failpoint else {})},
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in range(2)]
  out = []
  for p in procs:
    _, stderr = p.communicate(timeout=900)
    out.append({"rc": p.returncode, "stderr": stderr, "ended": time.monotonic()})
  return out


def result(workdir) -> dict:
  """What a finished run leaves: the exported parameters' bytes, the cache's files, the
  student's metrics (without times and speeds)."""
  with open(os.path.join(workdir, "export", "model.safetensors"), "rb") as f:
    params = f.read()
  with open(os.path.join(workdir, "student", "metrics.jsonl")) as f:
    metrics = [{k: v for k, v in json.loads(line).items() if k in METRICS} for line in f]
  # every file but the attributes (their creation time differs; manifest/zarr.json holds a copy)
  cache = {split: store_files(os.path.join(workdir, "cache", f"{split}.zarr"))
           for split in ("train", "eval")}
  return {"params": params, "metrics": metrics,
          "cache": {split: {name: data for name, data in files.items()
                            if name != os.path.join("manifest", "zarr.json")}
                    for split, files in cache.items()}}


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory, main_compile_cache):
  workdir = tmp_path_factory.mktemp("unbroken")
  assert [p["rc"] for p in run_two(workdir, main_compile_cache)] == [0, 0]
  return {**result(workdir), "workdir": workdir}


def finished_stages(workdir, done_workdir, *parts):
  """Copies the finished stages' folders (`parts` of data, teacher, cache) of the unbroken run
  into workdir: the run made there skips those stages (as its resumption skips what it
  finished) and goes straight to the one a fault is injected in."""
  for part in parts:
    shutil.copytree(done_workdir / part, workdir / part)


def assert_resumes(workdir, unbroken, compile_cache):
  again = run_two(workdir, compile_cache)
  failed = [p for p in again if p["rc"]] or again
  assert [p["rc"] for p in again] == [0, 0], failed[0]["stderr"][-3000:]  # a failed one's log
  got = result(workdir)
  assert got["metrics"] == unbroken["metrics"]
  assert got["cache"] == unbroken["cache"]
  assert got["params"] == unbroken["params"]


@pytest.mark.slow  # a few minutes: two-process runs of the smoke demo, broken and resumed
@pytest.mark.parametrize("failpoint, armed, done", [
    ("step:2:kill", 1, ("data", "teacher", "cache")), ("batch:3:kill", 1, ("data", "teacher")),
    ("batch:3:kill", 0, ("data", "teacher"))], ids=["train", "cache", "coordinator"])
def test_one_process_killed(tmp_path, unbroken, main_compile_cache, failpoint, armed, done):
  """Process 1 killed at train's step 2 or at its third batch of the cache stage, or process 0
  (it holds the coordination service) at its third cache batch: the other names it and exits
  EXIT_LOST within 2 minutes; the same command resumes to the unbroken result. The stages
  before the one killed are the unbroken run's, finished (no pretraining steps: train's step 2
  is the run's second)."""
  finished_stages(tmp_path, unbroken["workdir"], *done)
  out = run_two(tmp_path, main_compile_cache, failpoint, armed=armed)
  killed, survivor = out[armed], out[1 - armed]
  assert killed["rc"] == -9
  assert survivor["rc"] == peers.EXIT_LOST, survivor["stderr"][-3000:]
  assert survivor["ended"] - killed["ended"] < 120
  last = survivor["stderr"].strip().splitlines()[-1]
  assert last.startswith(f"kdjax: process {armed} of 2 stopped answering"), last
  assert "same command" in last
  assert "Fatal Python" not in survivor["stderr"]  # no thread dumps
  if armed == 1:  # process 0 lost: jax.distributed's client logs its fatal error first (peers)
    assert "Check failure" not in survivor["stderr"]
  assert_resumes(tmp_path, unbroken, main_compile_cache)


@pytest.mark.slow
def test_sigterm_saves_the_same_step_everywhere(tmp_path, unbroken, main_compile_cache):
  """SIGTERM to process 1 at train's step 2: both stop after the same step (proposed by process
  1, read by both), save it (one checkpoint, written by both), exit 130, and the same command
  resumes to the unbroken result. Data, teacher and cache are the unbroken run's, finished."""
  finished_stages(tmp_path, unbroken["workdir"], "data", "teacher", "cache")
  out = run_two(tmp_path, main_compile_cache, "step:2:term")
  assert [p["rc"] for p in out] == [130, 130], out[0]["stderr"][-3000:]
  saved = [[line.rsplit(" ", 1)[1] for line in p["stderr"].splitlines()
            if "student: interrupted; saved step" in line] for p in out]
  assert saved[0] == saved[1] and len(saved[0]) == 1, saved
  steps = sorted(int(d) for d in os.listdir(tmp_path / "student" / "ckpt") if d.isdigit())
  assert steps[-1] == int(saved[0][0]) < 8, steps
  assert_resumes(tmp_path, unbroken, main_compile_cache)


@pytest.mark.slow
def test_an_error_in_one_process_ends_the_other(tmp_path, unbroken, main_compile_cache):
  """Process 1 fails on its own (an exception at its third cache batch): it exits 1 with its
  traceback, and process 0, wherever it waits for it, names it and exits EXIT_LOST. Data and
  teacher are the unbroken run's, finished."""
  finished_stages(tmp_path, unbroken["workdir"], "data", "teacher")
  out = run_two(tmp_path, main_compile_cache, "batch:3:raise",
                "--config.stages=('data', 'pretrain', 'cache')")
  assert [p["rc"] for p in out] == [peers.EXIT_LOST, 1], out[0]["stderr"][-3000:]
  assert "FailpointError" in out[1]["stderr"]
  last = out[0]["stderr"].strip().splitlines()[-1]
  assert last.startswith("kdjax: process 1 of 2 ended with an error"), last


@pytest.mark.slow
def test_a_stalled_process_is_named(tmp_path, unbroken, main_compile_cache):
  """Process 1 sleeps 2 s before each of its training batches: process 0's log lines name it.
  The data are the unbroken run's, finished."""
  finished_stages(tmp_path, unbroken["workdir"], "data")
  out = run_two(tmp_path, main_compile_cache, "step:1:stall",
                "--config.stages=('data', 'pretrain')")
  assert [p["rc"] for p in out] == [0, 0], out[0]["stderr"][-3000:]
  lines = [line for line in out[0]["stderr"].splitlines() if "teacher step" in line]
  assert lines and all("slowest: process 1 waited" in line for line in lines[1:]), lines
  metrics = [json.loads(line) for line in open(tmp_path / "teacher" / "metrics.jsonl")]
  assert all(m["data_wait_process"] == 1 for m in metrics[1:]), metrics


# two processes that beat as fast as they can, then finish and exit (jax shuts its distributed
# client down at exit): a beat thread still running into that shutdown crashed one in two
BEAT_THEN_EXIT = """
import time
from kdjax import parallel, peers
parallel.initialize_distributed(30)
peers.watch(30)
peers._watch.interval_s = 1e-4
time.sleep(0.3)
peers.finish()
"""


def test_finished_processes_exit_cleanly():
  """peers.finish ends the beat thread before jax's exit handlers: no process dies at exit."""
  for _ in range(3):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", parallel.ENV_PROCESSES: "2",
           parallel.ENV_COORDINATOR: f"localhost:{free_port()}"}
    procs = [subprocess.Popen([sys.executable, "-c", BEAT_THEN_EXIT], cwd=ROOT,
                              env={**env, parallel.ENV_PROCESS_ID: str(i)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    out = [(p.communicate(timeout=120)[1], p.returncode) for p in procs]
    assert [rc for _, rc in out] == [0, 0], [err[-2000:] for err, _ in out]


@pytest.mark.slow
def test_sigterm_in_the_cache_stops_every_process(tmp_path, unbroken, main_compile_cache):
  """SIGTERM to process 1 at its third cache batch: process 1 stops before its next region,
  process 0 before its next region or in the barrier after its last; both exit 130 with the
  cache unfinished, and the same command resumes to the unbroken result. Data and teacher are
  the unbroken run's, finished."""
  finished_stages(tmp_path, unbroken["workdir"], "data", "teacher")
  out = run_two(tmp_path, main_compile_cache, "batch:3:term")
  assert [p["rc"] for p in out] == [130, 130], out[0]["stderr"][-3000:] + out[1]["stderr"][-3000:]
  assert all("Traceback" not in p["stderr"] for p in out)
  store = cache.open(str(tmp_path / "cache" / "train.zarr"), allow_partial=True)
  assert store.missing(1, 2), "process 1 went on after SIGTERM"
  assert_resumes(tmp_path, unbroken, main_compile_cache)
