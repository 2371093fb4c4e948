"""Parity with Hugging Face transformers: load, logits, export, round trip, student init.

transformers and CPU torch live in a side venv (.venv-hf, Python 3.11: PyPI's torch for 3.12 is a
multi-GB CUDA build). The first run creates it (about a minute) and later runs reuse it; the
tests call experiments/hf_reference.py in it to build tiny random checkpoints and to compute
float64 reference logits. They skip only when no Python 3.11 or no torch==2.13.0 file exists.
"""
import fcntl
import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from kdjax.models import hf
from kdjax.models.llama import ModelConfig, Transformer, rope_inv_freq

ROOT = Path(__file__).resolve().parents[1]
SIDE_VENV = ROOT / ".venv-hf"
SIDE_SCRIPT = ROOT / "experiments" / "hf_reference.py"
SIDE_PACKAGES = ["torch==2.13.0", "transformers", "safetensors", "numpy"]
RTOL = 1e-4  # max |kdjax - reference| / max |reference|, float32 against float64

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, rms_norm_eps=1e-6, initializer_range=0.1,
              max_position_embeddings=256)
ARCHS = {
    "llama3_untied": dict(
        model_type="llama", tokenizer_vocab=None, max_shard_size=None, config=dict(
            COMMON, vocab_size=256, head_dim=16, tie_word_embeddings=False, rope_theta=500000.0,
        # original_max_position_embeddings 16 puts the test positions (up to ~60) in the
        # scaled regime, so every branch of llama3 scaling is exercised.
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=16))),
    "llama_tied": dict(model_type="llama", tokenizer_vocab=None, max_shard_size=None, config=dict(
        COMMON, vocab_size=256, head_dim=32, tie_word_embeddings=True, rope_theta=10000.0)),
    # Padded vocabulary (300 rows, 280 tokens) and sharded safetensors with an index.
    "qwen3": dict(model_type="qwen3", tokenizer_vocab=280, max_shard_size="40KB", config=dict(
        COMMON, vocab_size=300, head_dim=16, tie_word_embeddings=True, rope_theta=1000000.0)),
    # The student: a smaller Qwen3 sharing the tokenizer.
    "qwen3_student": dict(model_type="qwen3", tokenizer_vocab=280, max_shard_size=None, config=dict(
        COMMON, vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        head_dim=8, tie_word_embeddings=True, rope_theta=1000000.0)),
}
PARITY = ("llama3_untied", "llama_tied", "qwen3")


def _find_python311() -> str | None:
  found = shutil.which("python3.11")
  root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
  return found or next(iter(sorted(glob.glob(f"{root}/versions/3.11*/bin/python3.11"))), None)


@pytest.fixture(scope="session")
def side_python() -> str:
  """Python of the side venv, created on first use (a file lock serialises pytest workers)."""
  SIDE_VENV.mkdir(exist_ok=True)
  python = SIDE_VENV / "bin" / "python"
  stamp = SIDE_VENV / ".kdjax-side-venv"
  with open(SIDE_VENV / ".lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if stamp.exists() and stamp.read_text() == " ".join(SIDE_PACKAGES) and python.exists():
      return str(python)
    base = _find_python311()
    if base is None:
      pytest.skip("Hugging Face parity needs Python 3.11 (for the CPU torch==2.13.0 build); "
                  "none found on PATH or in ~/.pyenv/versions.")
    subprocess.run([base, "-m", "venv", str(SIDE_VENV)], check=True)
    pip = subprocess.run([str(python), "-m", "pip", "install", "-q", *SIDE_PACKAGES],
                         capture_output=True, text=True)
    if pip.returncode:
      if "No matching distribution found for torch" in pip.stderr:
        pytest.skip("Hugging Face parity needs the CPU torch==2.13.0 wheel for Python 3.11, "
                    "which pip cannot find here.")
      pytest.fail(f"creating {SIDE_VENV} failed:\n{pip.stderr[-3000:]}")
    stamp.write_text(" ".join(SIDE_PACKAGES))
  return str(python)


def run_side(python: str, jobs: dict, work: Path) -> None:
  jobs_path = work / f"jobs{len(list(work.glob('jobs*.json')))}.json"
  jobs_path.write_text(json.dumps(jobs))
  proc = subprocess.run([python, str(SIDE_SCRIPT), str(jobs_path)], capture_output=True,
                        text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
  assert proc.returncode == 0, f"hf_reference.py failed:\n{proc.stderr[-5000:]}"


def packed_inputs(vocab: int) -> dict[str, np.ndarray]:
  """Row 0: two documents packed, then padding. Row 1: one document starting at position 40."""
  rng = np.random.default_rng(0)
  t = 24
  tokens = rng.integers(0, vocab, (2, t)).astype(np.int32)
  positions = np.stack([np.r_[np.arange(10), np.arange(8), np.zeros(6)],
                        np.arange(40, 40 + t)]).astype(np.int32)
  segment_ids = np.stack([np.r_[np.ones(10), 2 * np.ones(8), np.zeros(6)],
                          np.ones(t)]).astype(np.int32)
  tokens[segment_ids == 0] = 0
  return dict(tokens=tokens, positions=positions, segment_ids=segment_ids)


@nnx.jit
def kdjax_logits(model, tokens, positions, segment_ids):
  hidden = model(tokens, positions, segment_ids)
  return jnp.einsum("btd,dv->btv", hidden.astype(jnp.float32),
                    model.lm_head_DxV().astype(jnp.float32))


def assert_parity(model, inputs, reference):
  got = np.asarray(kdjax_logits(model, *(jnp.asarray(inputs[k]) for k in
                                         ("tokens", "positions", "segment_ids"))))
  real = inputs["segment_ids"] != 0
  ref = reference[..., :got.shape[-1]][real]
  err = np.abs(got[real] - ref).max() / np.abs(ref).max()
  assert err <= RTOL, f"max relative error {err:.2e} > {RTOL}"


@pytest.fixture(scope="module")
def checkpoints(side_python, tmp_path_factory):
  """Tiny random HF checkpoints and their float64 reference logits, in one side call."""
  work = tmp_path_factory.mktemp("hf")
  inputs = packed_inputs(vocab=256)
  np.savez(work / "inputs.npz", **inputs)
  jobs = {"make": [dict(spec, dir=str(work / name), seed=i)
                   for i, (name, spec) in enumerate(ARCHS.items())],
          "logits": [dict(dir=str(work / name), inputs=str(work / "inputs.npz"),
                          out=str(work / f"{name}.npy")) for name in ARCHS]}
  run_side(side_python, jobs, work)
  return work, inputs, {name: np.load(work / f"{name}.npy") for name in ARCHS}


@pytest.fixture(scope="module")
def exported(side_python, checkpoints):
  """kdjax exports (round trip of each architecture, a trained student), reloaded by HF."""
  work, inputs, _ = checkpoints
  models = {}
  for name in PARITY:
    model, cfg = hf.load(str(work / name))
    out = work / f"{name}_export"
    hf.export(model, cfg, str(out), tokenizer_dir=str(work / name))
    models[f"{name}_export"] = model
  student, cfg = hf.load(str(work / "qwen3_student"), dtype="bfloat16", param_dtype="float32")
  student = train_a_little(student, inputs)
  student_f32, _ = hf.load(str(work / "qwen3_student"))  # same layout, float32 compute
  nnx.update(student_f32, nnx.state(student, nnx.Param))
  hf.export(student, cfg, str(work / "student_export"), tokenizer_dir=str(work / "qwen3_student"))
  models["student_export"] = student_f32
  jobs = {"logits": [dict(dir=str(work / name), inputs=str(work / "inputs.npz"),
                          out=str(work / f"{name}.npy")) for name in models]}
  run_side(side_python, jobs, work)
  return models, {name: np.load(work / f"{name}.npy") for name in models}


def train_a_little(model, inputs, steps=3):
  """A few Adam steps of next-token cross-entropy: the student is no longer its checkpoint."""
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  tokens, positions, segment_ids = (jnp.asarray(inputs[k]) for k in
                                    ("tokens", "positions", "segment_ids"))

  @nnx.jit
  def step(model, optimizer):
    def loss_fn(m):
      logits = kdjax_logits(m, tokens, positions, segment_ids)[:, :-1]
      logp = jax.nn.log_softmax(logits)
      ce = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
      return jnp.mean(ce)
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  losses = [float(step(model, optimizer)) for _ in range(steps)]
  assert losses[-1] < losses[0]
  return model


@pytest.mark.parametrize("name", PARITY)
def test_logits_match_transformers(checkpoints, name):
  work, inputs, refs = checkpoints
  model, cfg = hf.load(str(work / name))
  assert cfg.qk_norm == (ARCHS[name]["model_type"] == "qwen3")
  assert cfg.tie_embeddings == ARCHS[name]["config"]["tie_word_embeddings"]
  assert_parity(model, inputs, refs[name])


def test_padded_vocab_and_shards(checkpoints):
  work, _, _ = checkpoints
  assert (work / "qwen3" / "model.safetensors.index.json").exists()
  model, cfg = hf.load(str(work / "qwen3"))
  assert (cfg.vocab_size, cfg.real_vocab_size) == (300, 280)
  assert model.embed_VxD.shape == (300, cfg.d_model)
  assert model.lm_head_DxV().shape == (cfg.d_model, 280)


@pytest.mark.parametrize("name", PARITY)
def test_round_trip_through_transformers(checkpoints, exported, name):
  work, inputs, refs = checkpoints
  _, exported_refs = exported
  # transformers loaded kdjax's export and reproduces the original checkpoint's logits.
  ref, back = refs[name], exported_refs[f"{name}_export"]
  real = inputs["segment_ids"] != 0
  assert np.abs(back[real] - ref[real]).max() / np.abs(ref[real]).max() <= RTOL
  assert (work / f"{name}_export" / "tokenizer.json").exists() == (name == "qwen3")


def test_trained_student_exports(checkpoints, exported):
  _, inputs, refs = checkpoints
  models, exported_refs = exported
  assert not np.allclose(exported_refs["student_export"], refs["qwen3_student"])
  assert_parity(models["student_export"], inputs, exported_refs["student_export"])


def test_bfloat16_teacher_close(checkpoints):
  # bfloat16 weights and compute: a loose check that the fast teacher path is the same model.
  work, inputs, refs = checkpoints
  model, cfg = hf.load(str(work / "qwen3"), dtype="bfloat16")
  assert model.embed_VxD.dtype == jnp.bfloat16
  got = np.asarray(kdjax_logits(model, *(jnp.asarray(inputs[k]) for k in
                                         ("tokens", "positions", "segment_ids"))))
  real = inputs["segment_ids"] != 0
  ref = refs["qwen3"][..., :got.shape[-1]][real]
  assert np.abs(got[real] - ref).max() / np.abs(ref).max() < 3e-2


# Reads a config.json with transformers, every warning shown, and prints its llama3 rope
# frequencies.
SIDE_ROPE = """
import json, sys, warnings
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
warnings.simplefilter("always")
transformers.logging.set_verbosity_warning()
config = transformers.AutoConfig.from_pretrained(sys.argv[1])
print(json.dumps(ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")[0].tolist()))
"""


def test_llama3_rope_export_reads_cleanly(side_python, tmp_path):
  cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16,
                    d_ff=48, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=True,
                    qk_norm=False, rope_scaling=ARCHS["llama3_untied"]["config"]["rope_scaling"])
  hf.export(Transformer(cfg, rngs=nnx.Rngs(0)), cfg, str(tmp_path))
  scaling = json.load(open(tmp_path / "config.json"))["rope_scaling"]
  assert type(scaling["original_max_position_embeddings"]) is int
  proc = subprocess.run([side_python, "-c", SIDE_ROPE, str(tmp_path)], capture_output=True,
                        text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
  assert proc.returncode == 0, proc.stderr[-5000:]
  assert not proc.stderr, f"transformers warned on reading the export:\n{proc.stderr}"
  expected = rope_inv_freq(cfg)
  np.testing.assert_array_equal(rope_inv_freq(hf.load(str(tmp_path))[1]), expected)
  # transformers computes the frequencies in float32, kdjax in float64 rounded once: one ulp apart.
  np.testing.assert_array_max_ulp(np.array(json.loads(proc.stdout), np.float32), expected, 1)
