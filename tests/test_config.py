"""Every config loads and validates; bad values and unknown fields fail with clear messages."""
import glob
import os
import subprocess
import sys

import pytest
from ml_collections import config_flags
from absl import flags

from kdjax import config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(p for p in glob.glob(os.path.join(ROOT, "configs", "*.py"))
                 if os.path.basename(p) not in ("long_context.py",))


def load(path_and_variant: str, *overrides: str):
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", flag_values=fv, lock_config=True)
  fv([sys.argv[0], f"--config={path_and_variant}", *overrides])
  return fv.config


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
@pytest.mark.parametrize("variant", ["", ":smoke"])
def test_every_config_loads_and_validates(path, variant):
  c = load(path + variant)
  config.validate(c)
  assert c.stages and c.workdir


def test_unknown_field_is_rejected():
  with pytest.raises(Exception, match="nonexistent"):
    load(os.path.join(ROOT, "configs/demo.py"), "--config.loss.nonexistent=1")


def test_unknown_variant_is_rejected():
  with pytest.raises(Exception, match="variant"):
    load(os.path.join(ROOT, "configs/demo.py:huge"))


@pytest.mark.parametrize("field,value,message", [
    ("loss.objective", "kl2", "loss.objective"),
    ("loss.temperature", 0.0, "temperature"),
    ("loss.impl", "cuda", "loss.impl"),
    ("cache.k", 0, "cache.k"),
    ("cache.layout", "fp8", "cache.layout"),
    ("opt.lr", -1.0, "opt.lr"),
    ("opt.warmup_steps", 10_000, "warmup"),
    ("student.n_kv_heads", 3, "n_kv_heads"),
    ("data.loss_mask", "user", "loss_mask"),
])
def test_out_of_range_values_name_the_field(field, value, message):
  c = config.base()
  group, name = field.split(".")
  c[group][name] = value
  with pytest.raises(ValueError, match=message):
    config.validate(c)


def test_stages_must_be_known_and_ordered():
  c = config.base()
  c.stages = ("train", "data")
  with pytest.raises(ValueError, match="order"):
    config.validate(c)
  c.stages = ("data", "distil")
  with pytest.raises(ValueError, match="unknown stages"):
    config.validate(c)


def test_main_reports_bad_value_before_any_work(tmp_path):
  out = subprocess.run(
      [sys.executable, "-m", "kdjax.main", f"--config={ROOT}/configs/demo.py",
       f"--config.workdir={tmp_path}/w", "--config.loss.temperature=-1"],
      capture_output=True, text=True, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert out.returncode != 0
  assert "temperature" in out.stderr
  assert not os.path.exists(tmp_path / "w" / "data")
