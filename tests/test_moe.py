"""Mixture-of-experts layers and models: the grouped-matmul MoE against a float64 loop over tokens
and experts; model invariants (causality, packing) with experts, sinks and windows."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdjax.models import llama, moe
from kdjax.models.llama import ModelConfig, Transformer

YARN = dict(rope_type="yarn", factor=8.0, beta_fast=32.0, beta_slow=1.0,
            original_max_position_embeddings=32, truncate=True)
QWEN3_MOE = ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                        head_dim=8, d_ff=16, qk_norm=True, n_experts=6, experts_per_token=2,
                        route_renormalize=False)
GPT_OSS = dataclasses.replace(
    QWEN3_MOE, qk_norm=False, experts_per_token=3, route_renormalize=True, expert_bias=True,
    swiglu_limit=0.5, attention_bias=True, attention_sinks=True, sliding_window=3,
    rope_scaling=YARN)
CONFIGS = {"qwen3_moe": QWEN3_MOE, "gpt_oss": GPT_OSS,
           "gpt_oss_mxfp4": dataclasses.replace(GPT_OSS, expert_weights="mxfp4", d_model=64,
                                                d_ff=32)}


def randomize(model, rng):
  """Every float parameter random (biases and sinks too: zeros would hide a dropped one)."""
  for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    if var.dtype != jnp.uint8:
      var.set_value(jnp.asarray(0.3 * rng.standard_normal(var.shape), var.dtype))


def moe_reference(layer: moe.MoE, y_NxD: np.ndarray) -> np.ndarray:
  """float64, token by token and expert by expert."""
  cfg = layer.cfg
  w = [np.asarray(a, np.float64) for a in layer.expert_weights(jnp.float32)]
  p = {name: np.asarray(getattr(layer, name)[...], np.float64)
       for name in moe.param_shapes(cfg) if "blocks" not in name and "scales" not in name}
  out = np.zeros_like(y_NxD, np.float64)
  for n, y in enumerate(np.asarray(y_NxD, np.float64)):
    logits = y @ p["router_DxX"] + (p["router_bias_X"] if cfg.expert_bias else 0)
    top = np.argsort(-logits)[:cfg.experts_per_token]
    probs = np.exp(logits - logits.max())
    weights = probs[top] / (probs[top].sum() if cfg.route_renormalize else probs.sum())
    for x, weight in zip(top, weights):
      gate, up = y @ w[0][x], y @ w[1][x]
      if cfg.expert_bias:
        gate, up = gate + p["b_gate_XxF"][x], up + p["b_up_XxF"][x]
      if cfg.swiglu_limit:
        gate, up = np.minimum(gate, cfg.swiglu_limit), np.clip(up, -cfg.swiglu_limit,
                                                               cfg.swiglu_limit)
        h = gate / (1 + np.exp(-cfg.swiglu_alpha * gate)) * (up + 1)
      else:
        h = gate / (1 + np.exp(-gate)) * up
      out[n] += weight * (h @ w[2][x] + (p["b_down_XxD"][x] if cfg.expert_bias else 0))
  return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_moe_matches_loop_reference(name, rng):
  cfg = CONFIGS[name]
  layer = moe.MoE(cfg, 1.0, rngs=nnx.Rngs(0))
  randomize(layer, rng)
  y_BxTxD = rng.standard_normal((2, 7, cfg.d_model)).astype(np.float32)
  got = nnx.jit(lambda m, y: m(y))(layer, jnp.asarray(y_BxTxD))
  expected = moe_reference(layer, y_BxTxD.reshape(14, cfg.d_model)).reshape(y_BxTxD.shape)
  np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)


def model_inputs(rng, cfg, t=12):
  tokens = jnp.asarray(rng.permutation(cfg.vocab_size)[:t][None], jnp.int32)  # distinct
  return tokens, jnp.arange(t, dtype=jnp.int32)[None], jnp.ones((1, t), jnp.int32)


def test_causality_through_gradients(rng):
  # Distinct tokens, so the gradient on embedding row tokens[s] belongs to position s only; the
  # window (3 keys on layer 0) still lets layer 1 reach every earlier position.
  cfg = GPT_OSS
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  randomize(model, rng)
  tokens, positions, segment_ids = model_inputs(rng, cfg)
  t = 6
  grads = nnx.jit(nnx.grad(lambda m: m(tokens, positions, segment_ids)[0, t].sum()))(model)
  row_norms_T = np.abs(np.asarray(grads.embed_VxD[...])[np.asarray(tokens[0])]).sum(-1)
  assert np.all(row_norms_T[: t + 1] > 0)
  np.testing.assert_array_equal(row_norms_T[t + 1:], 0.0)


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_packed_documents_equal_separate_runs(name, rng):
  model = Transformer(CONFIGS[name], rngs=nnx.Rngs(0))
  randomize(model, rng)
  forward = nnx.jit(lambda m, *a: m(*a))
  docs = [rng.integers(0, 97, n) for n in (5, 7)]
  hidden = forward(model, jnp.asarray(np.concatenate(docs)[None], jnp.int32),
                   jnp.asarray(np.r_[np.arange(5), np.arange(7)][None], jnp.int32),
                   jnp.asarray(np.r_[[1] * 5, [2] * 7][None], jnp.int32))
  for doc, sl in zip(docs, (slice(0, 5), slice(5, 12))):
    n = len(doc)
    alone = forward(model, jnp.asarray(doc[None], jnp.int32), jnp.arange(n, dtype=jnp.int32)[None],
                    jnp.ones((1, n), jnp.int32))
    np.testing.assert_allclose(np.asarray(hidden[0, sl]), np.asarray(alone[0]), rtol=1e-5,
                               atol=1e-5)


def test_flops_per_token_counts_routed_experts():
  cfg = QWEN3_MOE
  d, f = cfg.d_model, cfg.d_ff
  dense = dataclasses.replace(cfg, n_experts=0, experts_per_token=0, d_ff=f * 2)
  # Two routed experts of width f cost one dense MLP of width 2f, plus the router.
  assert llama.flops_per_token(cfg, 8) == llama.flops_per_token(dense, 8) + 6 * cfg.n_layers * (
      d * cfg.n_experts)


@pytest.mark.parametrize("changes,message", [
    (dict(experts_per_token=7), r"experts_per_token must be in \[1, n_experts=6\]"),
    (dict(experts_per_token=0), "experts_per_token"),
    (dict(n_experts=0, experts_per_token=0, expert_bias=True), "set n_experts > 0"),
    (dict(expert_weights="int4"), "expert_weights must be one of"),
    (dict(expert_weights="mxfp4"), "multiples of 32"),
    (dict(sliding_window=-1), "sliding_window must be >= 0"),
])
def test_validation(changes, message):
  with pytest.raises(ValueError, match=message):
    dataclasses.replace(QWEN3_MOE, **changes).validate()


def test_cudnn_attention_takes_sinks_and_windows():
  """cuDNN's path runs gpt-oss's sinks and sliding windows (models/attention.py), so asking for
  it explicitly is valid; its parity with the einsum reference is a GPU test."""
  cfg = dataclasses.replace(QWEN3_MOE, attention_sinks=True, sliding_window=4,
                            attention_impl="cudnn")
  assert cfg.validate() is cfg
