"""Every config loads and validates; bad values and unknown fields fail with clear messages."""
import glob
import os
import re
import subprocess
import sys

import pytest
from absl import flags
from ml_collections import config_flags

from kdjax import config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.py")))


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


def test_smollm2_online_variant_runs_no_cache():
  c = load(os.path.join(ROOT, "configs/smollm2.py:online"))
  config.validate(c)
  assert c.loss.objective == "online" and "cache" not in c.stages and "pretrain" in c.stages


def test_config_imports_no_training_code():
  """Reading a config loads the schema and the choice lists, not the trainer (optax comes with
  flax, which the model's fields need)."""
  code = ("import sys; from kdjax import config, recipes; "
          "print(sorted(m for m in sys.modules if m in ('kdjax.training.train', "
          "'kdjax.training.checkpoints', "
          "'kdjax.pipeline', 'kdjax.teacher', 'orbax.checkpoint', 'tensorboardX')))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"}, check=True)
  assert out.stdout.strip() == "[]"


def test_config_imports_no_jax():
  """The choice lists come from kdjax.choices: importing the schema loads no JAX, flax, optax or
  TensorStore (the model's fields are read where a group is built)."""
  code = ("import sys, kdjax.config; "
          "print([m for m in ('jax', 'flax', 'optax', 'tensorstore') if m in sys.modules])")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"}, check=True)
  assert out.stdout.strip() == "[]"


def test_unknown_field_is_rejected():
  with pytest.raises(Exception, match="nonexistent"):
    load(os.path.join(ROOT, "configs/demo.py"), "--config.loss.nonexistent=1")


def test_unknown_variant_is_rejected():
  with pytest.raises(Exception, match="variant"):
    load(os.path.join(ROOT, "configs/demo.py:huge"))


@pytest.mark.parametrize("field,value,message", [
    ("loss.objective", "kl2", "loss.objective must be one of"),
    ("loss.temperature", 0.0, "loss.temperature must be > 0, got 0.0"),
    ("loss.impl", "cuda", "loss.impl must be one of"),
    ("loss.divergence", "js", "loss.divergence must be one of"),
    ("loss.divergence", "reverse", "loss.divergence 'reverse' needs the teacher's whole"),
    ("loss.skew", 1.0, "loss.skew must be in (0, 1), got 1.0"),
    ("cache.k", 0, "cache.k must be > 0, got 0"),
    ("cache.layout", "fp8", "cache.layout must be one of"),
    ("cache.chunk_size", 0, "cache.chunk_size must be > 0"),
    ("cache.world", 0, "cache.world must be > 0"),
    ("cache.rank", 1, "cache.rank must be in [0, cache.world = 1), got 1"),
    ("cache.region_rows", -1, "cache.region_rows must be >= 0"),
    ("opt.lr", -1.0, "opt.lr must be > 0, got -1.0"),
    ("opt.steps", 0, "opt.steps must be >= 1, got 0"),
    ("pretrain.steps", 0, "pretrain.steps must be >= 1, got 0"),
    ("opt.warmup_steps", 10_000, "opt.warmup_steps must be in [0, opt.steps = 200), got 10000"),
    ("opt.ckpt_every", 0, "opt.ckpt_every must be >= 1"),
    ("opt.weight_decay", -0.1, "opt.weight_decay must be >= 0"),
    ("eval.max_seqs", -1, "eval.max_seqs must be >= 0"),
    ("student.param_dtype", "fp16", "student.param_dtype must be one of"),
    ("student.n_kv_heads", 3, "student.n_heads (4) must be a multiple of student.n_kv_heads (3)"),
    ("data.loss_mask", "user", "data.loss_mask must be one of ('all', 'assistant')"),
    ("mesh.allocator", "pool", "mesh.allocator must be '', 'platform', 'bfc' or 'cuda_async'"),
])
def test_out_of_range_values_name_the_field(field, value, message):
  """The message names the field that was set (not one checked against it) and the valid range."""
  c = config.base()
  group, name = field.split(".")
  c[group][name] = value
  with pytest.raises(ValueError, match=re.escape(f"config: {message}")):
    config.validate(c)


@pytest.mark.parametrize("override,message", [
    ("--config.opt.learning_rate=1e-3", "opt has no field 'learning_rate'; nearest: opt.lr"),
    ("--config.loss.temp=2", "loss has no field 'temp'; nearest: loss.temperature"),
    ("--config.optt.lr=1", "the config has no field 'optt'; nearest: opt"),
    ("--config.opt.lr.x=1", "opt.lr is a value, not a group"),
    ("--noconfig.student.remat_x", "student has no field 'remat_x'; nearest: student.remat"),
])
def test_unknown_override_names_the_field_and_nearest(override, message):
  argv = ["kdjax", "--config=demo.py", "--config.opt.lr=1e-3", override]
  assert message in config.unknown_override(config.base(), argv)
  assert config.unknown_override(config.base(), argv[:3]) is None


def test_stages_must_be_known_and_ordered():
  c = config.base()
  c.stages = ("train", "data")
  with pytest.raises(ValueError, match="order"):
    config.validate(c)
  c.stages = ("data", "distil")
  with pytest.raises(ValueError, match="unknown stages"):
    config.validate(c)


def test_remat_auto_with_the_platform_allocator_needs_a_memory_budget():
  """JAX reports no allocation limit under mesh.allocator 'platform': auto has nothing to plan
  against, refused before any stage runs; a budget (or a policy) makes it valid."""
  c = config.base()
  c.student.remat = "auto"
  c.mesh.allocator = "platform"
  with pytest.raises(ValueError, match=re.escape("config: student.remat 'auto' plans against")):
    config.validate(c)
  c.opt.memory_gib = 120.0
  config.validate(c)
