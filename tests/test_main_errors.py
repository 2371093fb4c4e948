"""The command line: a user error is one message and exit 1 (its traceback only with --debug or
KDJAX_DEBUG=1), Ctrl-C exits 130, and a bug keeps its traceback."""
import os
import subprocess
import sys

import pytest

from kdjax import config, errors
from kdjax.cache.errors import CacheError
from kdjax.data import packing
from kdjax.data.chat import ChatTemplateError
from kdjax.data.sources import DataError
from kdjax.models.hf import CheckpointError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = f"--config={ROOT}/configs/demo.py"
# main.main with pipeline.run replaced by `body`, to reach the handling of what a run raises.
PATCHED = """
from absl import app
from kdjax import main, pipeline
def run(c):
  {body}
pipeline.run = run
app.run(main.main, flags_parser=main.parse_flags)
"""


def run(*args, body=None, debug_env=False):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  env.pop("KDJAX_DEBUG", None)
  if debug_env:
    env["KDJAX_DEBUG"] = "1"
  entry = ["-m", "kdjax.main"] if body is None else ["-c", PATCHED.format(body=body)]
  return subprocess.run([sys.executable, *entry, DEMO, *args], capture_output=True, text=True,
                        cwd=ROOT, env=env)


def test_user_error_is_one_message_without_traceback(tmp_path):
  out = run(f"--config.workdir={tmp_path}/w", f"--config.data.source={tmp_path}/none.jsonl")
  assert out.returncode == 1
  assert out.stderr.strip().splitlines()[-1] == (
      f"kdjax: {tmp_path}/none.jsonl: no such file (data.source takes 'stdlib' or .jsonl/.parquet)")
  assert "Traceback" not in out.stderr
  assert not os.path.exists(tmp_path / "w")


@pytest.mark.parametrize("switch", ["flag", "env"])
def test_debug_switch_shows_the_traceback(tmp_path, switch):
  args = [f"--config.data.source={tmp_path}/none.jsonl"] + (["--debug"] if switch == "flag" else [])
  out = run(f"--config.workdir={tmp_path}/w", *args, debug_env=switch == "env")
  assert out.returncode == 1
  assert "Traceback" in out.stderr and "DataError: " in out.stderr


def test_unknown_config_field_is_one_line():
  out = run("--config.opt.learning_rate=1e-3")
  assert out.returncode == 1
  assert out.stderr.strip() == (
      "kdjax: --config.opt.learning_rate: opt has no field 'learning_rate'; nearest: opt.lr")


def test_interrupt_exits_130_quietly():
  out = run(body="raise KeyboardInterrupt")
  assert out.returncode == 130
  assert "Traceback" not in out.stderr


def test_bug_keeps_its_traceback():
  """A ValueError that kdjax itself raises for a broken internal contract is a bug, not bad input:
  its traceback shows where."""
  out = run(body="from kdjax.data import packing; packing.Packer(1, bos_id=None, eos_id=None)")
  assert out.returncode == 1
  assert "Traceback" in out.stderr and "ValueError: seq_len must be >= 2, got 1" in out.stderr
  assert "packing.py" in out.stderr


def raised(fn):
  try:
    fn()
  except Exception as e:
    return e
  raise AssertionError("no exception")


def test_user_errors_are_user_error_classes_alone():
  bad = config.base()
  bad.opt.steps = 0
  assert type(raised(lambda: config.validate(bad))) is errors.UserError
  for e in (CacheError("no store"), DataError("x"), ChatTemplateError("x"), CheckpointError("x"),
            FloatingPointError("non-finite loss at step 3")):
    assert errors.is_user_error(e), type(e)
  assert not errors.is_user_error(raised(lambda: int("x")))
  assert not errors.is_user_error(raised(lambda: {}["key"]))
  # raised by kdjax's own code, but for a broken internal contract: a bug
  assert not errors.is_user_error(raised(lambda: packing.Packer(1, bos_id=None, eos_id=None)))
  assert errors.message(CacheError("no store at x")) == "kdjax: no store at x"
