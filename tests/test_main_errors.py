"""The command line: a user error is one message and exit 1 (its traceback only with --debug or
KDJAX_DEBUG=1), Ctrl-C exits 130, and a bug keeps its traceback.

One test runs `python -m kdjax.main` itself; the others call the same parsing and `main.main` in
this process, with `pipeline.run` replaced where they need a run to raise something: what the
interpreter prints follows from what escapes main (a SystemExit's message, or the exception)."""
import os
import subprocess
import sys

import pytest
from absl import flags

from kdjax import config, errors, main, pipeline
from kdjax.cache.errors import CacheError
from kdjax.data import packing
from kdjax.data.chat import ChatTemplateError
from kdjax.data.sources import DataError
from kdjax.models.hf import CheckpointError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = f"--config={ROOT}/configs/demo.py"


@pytest.fixture
def call_main(monkeypatch):
  """call_main(*args, raises=None): main's parsing and main.main in this process, as
  `python -m kdjax.main DEMO ARGS` runs them; with `raises`, the run raises it."""
  monkeypatch.delenv("KDJAX_DEBUG", raising=False)

  def call(*args, raises=None):
    if raises is not None:
      def run(c):
        raise raises
      monkeypatch.setattr(pipeline, "run", run)
    argv = ["kdjax", DEMO, *args]
    monkeypatch.setattr(sys, "argv", argv)  # ml_collections reads the overrides from sys.argv
    try:
      main.main(main.parse_flags(argv))
    finally:  # as a fresh process would find them: unparsed, no override flags defined
      flags.FLAGS.unparse_flags()
      for name in [name for name in flags.FLAGS if name.startswith("config.")]:
        delattr(flags.FLAGS, name)

  return call


def test_user_error_is_one_message_without_traceback(tmp_path):
  out = subprocess.run(
      [sys.executable, "-m", "kdjax.main", DEMO, f"--config.workdir={tmp_path}/w",
       f"--config.data.source={tmp_path}/none.jsonl"],
      capture_output=True, text=True, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert out.returncode == 1
  assert out.stderr.strip().splitlines()[-1] == (
      f"kdjax: {tmp_path}/none.jsonl: no such file (data.source takes 'stdlib' or .jsonl/.parquet)")
  assert "Traceback" not in out.stderr
  assert not os.path.exists(tmp_path / "w")


def test_bad_value_is_reported_before_any_work(call_main, tmp_path):
  with pytest.raises(SystemExit) as exit_:
    call_main(f"--config.workdir={tmp_path}/w", "--config.loss.temperature=-1")
  assert exit_.value.code == "kdjax: config: loss.temperature must be > 0, got -1.0"
  assert not os.path.exists(tmp_path / "w")


@pytest.mark.parametrize("switch", ["flag", "env"])
def test_debug_switch_shows_the_traceback(call_main, monkeypatch, tmp_path, switch):
  if switch == "env":
    monkeypatch.setenv("KDJAX_DEBUG", "1")
  args = ["--debug"] if switch == "flag" else []
  with pytest.raises(DataError, match="no such file"):  # escapes main: the interpreter prints it
    call_main(f"--config.workdir={tmp_path}/w", f"--config.data.source={tmp_path}/none.jsonl",
              *args)


def test_unknown_config_field_is_one_line(call_main):
  with pytest.raises(SystemExit) as exit_:
    call_main("--config.opt.learning_rate=1e-3")
  assert exit_.value.code == (
      "kdjax: --config.opt.learning_rate: opt has no field 'learning_rate'; nearest: opt.lr")


def test_interrupt_exits_130_quietly(call_main):
  with pytest.raises(SystemExit) as exit_:
    call_main(raises=KeyboardInterrupt())
  assert exit_.value.code == 130


def test_bug_keeps_its_traceback(call_main):
  """A ValueError that kdjax itself raises for a broken internal contract is a bug, not bad input:
  it escapes main, so the interpreter prints its traceback."""
  with pytest.raises(ValueError, match="seq_len must be >= 2, got 1") as info:
    call_main(raises=raised(lambda: packing.Packer(1, bos_id=None, eos_id=None)))
  assert type(info.value) is ValueError


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
