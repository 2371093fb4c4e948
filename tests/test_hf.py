"""Parity with Hugging Face transformers (Llama 3.x, Qwen3, Qwen3-MoE, gpt-oss): load, logits on
packed rows, export, round trip, student init.

transformers and CPU torch live in a side venv (.venv-hf, Python 3.11: PyPI's torch for 3.12 is a
multi-GB CUDA build; conftest's side_python). The first run creates it (about a minute) and later
runs reuse it; the tests call kdjax/smollm2/hf_reference.py in it to build tiny random checkpoints
(torch seeded per checkpoint) and to compute float64 reference logits. They skip only when no
Python 3.11 or no torch==2.13.0 file exists.
"""
import json
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from kdjax.models import hf
from kdjax.models.llama import ModelConfig, Transformer
from kdjax.models.rope import inv_freq as rope_inv_freq

# one xdist worker runs the module: its module fixtures' side-venv calls are made once, not
# once a worker
pytestmark = pytest.mark.xdist_group("test_hf")
PARITY = ("llama3_untied", "llama_tied", "qwen3", "qwen3_moe", "qwen3_moe_norm", "gpt_oss")


@pytest.fixture(scope="module")
def checkpoints(side_python, tmp_path_factory, hf_archs, packed_inputs, run_side):
  """Tiny random HF checkpoints and their float64 reference logits, in one side call."""
  work = tmp_path_factory.mktemp("hf")
  inputs = packed_inputs(vocab=256)
  np.savez(work / "inputs.npz", **inputs)
  jobs = {"make": [dict(spec, dir=str(work / name), seed=i)
                   for i, (name, spec) in enumerate(hf_archs.items())],
          "logits": [dict(dir=str(work / name), inputs=str(work / "inputs.npz"),
                          out=str(work / f"{name}.npy")) for name in hf_archs]}
  run_side(side_python, jobs, work)
  return work, inputs, {name: np.load(work / f"{name}.npy") for name in hf_archs}


@pytest.fixture(scope="module")
def exported(side_python, checkpoints, kdjax_logits, run_side):
  """kdjax exports (round trip of each architecture, a trained student), reloaded by HF."""
  work, inputs, _ = checkpoints
  models = {}
  for name in PARITY:
    model, cfg = hf.load(str(work / name))
    out = work / f"{name}_export"
    hf.export(model, cfg, str(out), tokenizer_dir=str(work / name))
    models[f"{name}_export"] = model
  student, cfg = hf.load(str(work / "qwen3_student"), dtype="bfloat16", param_dtype="float32")
  student = train_a_little(student, inputs, kdjax_logits)
  student_f32, _ = hf.load(str(work / "qwen3_student"))  # same layout, float32 compute
  nnx.update(student_f32, nnx.state(student, nnx.Param))
  hf.export(student, cfg, str(work / "student_export"), tokenizer_dir=str(work / "qwen3_student"))
  models["student_export"] = student_f32
  jobs = {"logits": [dict(dir=str(work / name), inputs=str(work / "inputs.npz"),
                          out=str(work / f"{name}.npy")) for name in models]}
  run_side(side_python, jobs, work)
  return models, {name: np.load(work / f"{name}.npy") for name in models}


def train_a_little(model, inputs, kdjax_logits, steps=3):
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
def test_logits_match_transformers(checkpoints, name, hf_archs, assert_parity):
  work, inputs, refs = checkpoints
  model, cfg = hf.load(str(work / name))
  spec = hf_archs[name]
  assert cfg.qk_norm == (spec["model_type"] in ("qwen3", "qwen3_moe"))
  assert cfg.tie_embeddings == spec["config"]["tie_word_embeddings"]
  assert cfg.n_experts == spec["config"].get("num_experts", spec["config"].get("num_local_experts",
                                                                                0))
  assert_parity(model, inputs, refs[name])


def test_padded_vocab_and_shards(checkpoints):
  work, _, _ = checkpoints
  assert (work / "qwen3" / "model.safetensors.index.json").exists()
  model, cfg = hf.load(str(work / "qwen3"))
  assert (cfg.vocab_size, cfg.real_vocab_size) == (300, 280)
  assert model.embed_VxD.shape == (300, cfg.d_model)
  assert model.lm_head_DxV().shape == (cfg.d_model, 280)


@pytest.mark.parametrize("name", PARITY)
def test_round_trip_through_transformers(checkpoints, exported, name, assert_logits_close,
                                         hf_archs):
  work, inputs, refs = checkpoints
  _, exported_refs = exported
  # transformers loaded kdjax's export and reproduces the original checkpoint's logits.
  ref, back = refs[name], exported_refs[f"{name}_export"]
  real = inputs["segment_ids"] != 0
  assert_logits_close(back[real], ref[real])
  has_tokenizer = hf_archs[name]["tokenizer_vocab"] is not None
  assert (work / f"{name}_export" / "tokenizer.json").exists() == has_tokenizer


def test_trained_student_exports(checkpoints, exported, assert_parity):
  _, inputs, refs = checkpoints
  models, exported_refs = exported
  assert not np.allclose(exported_refs["student_export"], refs["qwen3_student"])
  assert_parity(models["student_export"], inputs, exported_refs["student_export"])


def test_bfloat16_teacher_close(checkpoints, kdjax_logits):
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


def test_llama3_rope_export_reads_cleanly(side_python, tmp_path, hf_archs):
  cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16,
                    d_ff=48, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=True,
                    qk_norm=False, rope_scaling=hf_archs["llama3_untied"]["config"]["rope_scaling"])
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
