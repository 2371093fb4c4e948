"""MXFP4 experts: the decoder against the format's definition; a packed gpt-oss checkpoint gives
the logits of its dequantised float version, and transformers' own MXFP4 decoder and layout
agree."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdjax.models import hf, mxfp4
from kdjax.models.llama import ModelConfig, Transformer

# A gpt-oss: sinks, sliding window, biases, clamped SwiGLU, YaRN; MXFP4 experts.
CFG = ModelConfig(
    vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=32,
    rope_theta=150000.0, norm_eps=1e-5, rope_scaling=dict(
        rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
        original_max_position_embeddings=64, truncate=False),
    n_experts=8, experts_per_token=4, expert_bias=True, swiglu_limit=7.0, attention_bias=True,
    attention_sinks=True, sliding_window=4, expert_weights="mxfp4")


def e2m1_reference(code: int) -> float:
  """An E2M1 code's value from its bit fields: sign, 2 exponent bits (bias 1), 1 mantissa bit."""
  sign = -1.0 if code & 0b1000 else 1.0
  exponent, mantissa = (code >> 1) & 0b11, code & 1
  if exponent == 0:  # subnormal: 0 or 0.5
    return sign * mantissa * 0.5
  return sign * 2.0 ** (exponent - 1) * (1 + mantissa / 2)


def dequantize_reference(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """float64 [..., Z * 32]: element 2i of a block is byte i's low nibble, 2i + 1 its high one."""
  values = np.vectorize(e2m1_reference)(np.stack([blocks & 0xF, blocks >> 4], axis=-1))
  scale = 2.0 ** (scales.astype(np.float64) - 127)
  values = values.reshape(*blocks.shape[:-1], 32) * scale[..., None]
  return values.reshape(*blocks.shape[:-2], -1)


def test_dequantize_matches_definition(rng):
  blocks = rng.integers(0, 256, (3, 5, 2, 16), dtype=np.uint8)
  scales = rng.integers(127 - 20, 127 + 20, (3, 5, 2), dtype=np.uint8)
  expected = dequantize_reference(blocks, scales)
  for dtype in (jnp.float32, jnp.bfloat16):
    got = mxfp4.dequantize(jnp.asarray(blocks), jnp.asarray(scales), dtype)
    assert got.shape == (3, 5, 64) and got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got, np.float64), expected)  # exact in both


def dequantised_twin(packed: Transformer, cfg: ModelConfig) -> tuple[Transformer, ModelConfig]:
  """The same model with float experts holding the packed ones' values (numpy reference)."""
  float_cfg = dataclasses.replace(cfg, expert_weights="float")
  twin = nnx.eval_shape(lambda: Transformer(float_cfg, rngs=nnx.Rngs(0)))
  nnx.update(twin, nnx.state(packed, nnx.Param))  # all but the packed experts
  for layer_twin, layer in zip(twin.layers, packed.layers):
    m = layer.moe
    gate_up = dequantize_reference(np.asarray(m.gate_up_blocks_XxOxZx16[...]),
                                   np.asarray(m.gate_up_scales_XxOxZ[...]))  # [X, 2F, D]
    down = dequantize_reference(np.asarray(m.down_blocks_XxOxZx16[...]),
                                np.asarray(m.down_scales_XxOxZ[...]))  # [X, D, F]
    # Rows of gate_up alternate gate, up (gpt-oss's layout); kdjax's float experts are [X, D, F].
    layer_twin.moe.w_gate_XxDxF.set_value(jnp.asarray(gate_up[:, 0::2].transpose(0, 2, 1),
                                                      jnp.float32))
    layer_twin.moe.w_up_XxDxF.set_value(jnp.asarray(gate_up[:, 1::2].transpose(0, 2, 1),
                                                    jnp.float32))
    layer_twin.moe.w_down_XxFxD.set_value(jnp.asarray(down.transpose(0, 2, 1), jnp.float32))
  return twin, float_cfg


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """A packed gpt-oss checkpoint and its dequantised float twin (both bfloat16 elsewhere)."""
  work = tmp_path_factory.mktemp("mxfp4")
  packed = Transformer(CFG, rngs=nnx.Rngs(3))
  # Non-trivial biases and sinks: zeros would hide a dropped one.
  for path, var in nnx.to_flat_state(nnx.state(packed, nnx.Param)):
    if str(path[-1]).startswith(("b", "sinks", "router_bias")):
      var.set_value(0.3 * jnp.sin(jnp.arange(var.size, dtype=jnp.float32) * 1.7 + len(path))
                    .reshape(var.shape))
  hf.export(packed, CFG, str(work / "packed"), dtype="bfloat16")
  twin, twin_cfg = dequantised_twin(packed, CFG)
  hf.export(twin, twin_cfg, str(work / "float"), dtype="bfloat16")
  return work, packed


def test_packed_checkpoint_round_trip(checkpoints):
  work, packed = checkpoints
  model, cfg = hf.load(str(work / "packed"), dtype="bfloat16")
  assert cfg == dataclasses.replace(CFG, dtype="bfloat16", param_dtype="bfloat16")
  m, original = model.layers[1].moe, packed.layers[1].moe
  assert m.gate_up_blocks_XxOxZx16.dtype == jnp.uint8  # kept packed, never cast
  np.testing.assert_array_equal(np.asarray(m.down_scales_XxOxZ[...]),
                                np.asarray(original.down_scales_XxOxZ[...]))
  np.testing.assert_array_equal(np.asarray(m.gate_up_blocks_XxOxZx16[...]),
                                np.asarray(original.gate_up_blocks_XxOxZx16[...]))


def test_packed_logits_equal_dequantised(checkpoints, packed_inputs, kdjax_logits,
                                         assert_logits_close):
  work, _ = checkpoints
  inputs = [jnp.asarray(packed_inputs(vocab=256)[k]) for k in ("tokens", "positions",
                                                              "segment_ids")]
  got = np.asarray(kdjax_logits(hf.load(str(work / "packed"))[0], *inputs))
  expected = np.asarray(kdjax_logits(hf.load(str(work / "float"))[0], *inputs))
  real = np.asarray(inputs[2]) != 0
  assert_logits_close(got[real], expected[real])


def test_transformers_decodes_the_packed_checkpoint(checkpoints, side_python, packed_inputs,
                                                    run_side, assert_parity):
  # transformers dequantises the experts with its own decoder and layout, then runs the model.
  work, _ = checkpoints
  np.savez(work / "inputs.npz", **packed_inputs(vocab=256))
  run_side(side_python, {
      "dequantize": [dict(dir=str(work / "packed"), out_dir=str(work / "hf_dequantised"))],
      "logits": [dict(dir=str(work / "hf_dequantised"), inputs=str(work / "inputs.npz"),
                      out=str(work / "packed.npy"))]}, work)
  model, _ = hf.load(str(work / "float"))
  assert_parity(model, dict(np.load(work / "inputs.npz")), np.load(work / "packed.npy"))
