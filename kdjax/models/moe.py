"""Mixture-of-experts MLP (Qwen3-MoE, gpt-oss): a router sends each token to U of X experts.

Shape letters as in llama.py, and: X experts, U experts per token (the router's top-k), N tokens
(positions flattened over the batch), Y = N * U token-expert assignments (in token order, or
sorted by expert: `order_Y`), P their rows padded to whole row tiles of the grouped matmuls, M
those row tiles; for packed (MXFP4) experts, O rows of a stored matrix and Z blocks of 32 values
along its contraction.

The experts run as grouped matmuls (kdjax/kernels/grouped.py: Mosaic GPU kernels on a GPU,
`jax.lax.ragged_dot` elsewhere) over the assignments sorted by expert, each expert's rows one
contiguous group starting a row tile: no loop over experts, no [N, X] dispatch mask, and the FLOPs
are those of the routed experts (plus partly filled row tiles).

Routing: router logits [N, X] (+ bias), the U largest; weights softmax over those U logits
(`route_renormalize`: gpt-oss, Qwen3-MoE with norm_topk_prob) or the full softmax's values there.
Experts: silu(gate) * up (Qwen3-MoE), or gpt-oss's clamped variant (`swiglu_limit` > 0): gate
clamped above at the limit, up to [-limit, limit], gate * sigmoid(swiglu_alpha * gate) * (up + 1).

Expert weights are float ([X, D, F] gate and up, [X, F, D] down) or MXFP4 as gpt-oss stores them
(`expert_weights="mxfp4"`): uint8 blocks and scales (kdjax/models/mxfp4.py), gate and up rows
interleaved in one [X, 2F, ...] matrix, each matrix [X, out, in]. Packed weights stay packed in
the model and are dequantised one layer at a time inside its forward pass, so a model never holds
float experts for more than the layer it runs; the kernels read the dequantised [X, out, in]
matrices transposed, so they are not copied again (gate and up: one matmul, columns interleaved).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from kdjax import choices
from kdjax.kernels import grouped
from kdjax.models import mxfp4

EXPERT_WEIGHTS = choices.EXPERT_WEIGHTS


class Packed(nnx.Variable):
  """Packed (uint8) expert weights: state of the model, but not a trainable nnx.Param, so
  gradients, optimizers and parameter counts leave them out."""


def validate(cfg, where: str = "") -> None:
  """Raises ValueError for inconsistent MoE fields of a ModelConfig."""
  if cfg.expert_weights not in EXPERT_WEIGHTS:
    raise ValueError(f"{where}expert_weights must be one of {EXPERT_WEIGHTS}, got "
                     f"{cfg.expert_weights!r}.")
  if cfg.n_experts < 0 or cfg.swiglu_limit < 0:
    raise ValueError(f"{where}n_experts and {where}swiglu_limit must be >= 0, got "
                     f"{cfg.n_experts}, {cfg.swiglu_limit}.")
  if not cfg.n_experts:
    if cfg.expert_weights != "float" or cfg.expert_bias or cfg.swiglu_limit:
      raise ValueError(f"{where}expert_weights, {where}expert_bias and {where}swiglu_limit "
                       f"apply to experts: set {where}n_experts > 0.")
    return
  if not 1 <= cfg.experts_per_token <= cfg.n_experts:
    raise ValueError(f"{where}experts_per_token must be in [1, n_experts={cfg.n_experts}], got "
                     f"{cfg.experts_per_token}.")
  if cfg.expert_weights == "mxfp4" and (cfg.d_model % mxfp4.BLOCK or cfg.d_ff % mxfp4.BLOCK):
    raise ValueError(f"{where}d_model ({cfg.d_model}) and {where}d_ff ({cfg.d_ff}) must be "
                     f"multiples of {mxfp4.BLOCK} for MXFP4 experts.")


def param_shapes(cfg) -> dict[str, tuple]:
  """Name -> shape of an MoE layer's parameters (uint8 for the packed ones)."""
  d, f, x = cfg.d_model, cfg.d_ff, cfg.n_experts
  shapes = {"router_DxX": (d, x)}
  if cfg.expert_weights == "mxfp4":
    b = mxfp4.BLOCK
    shapes.update(gate_up_blocks_XxOxZx16=(x, 2 * f, d // b, b // 2),
                  gate_up_scales_XxOxZ=(x, 2 * f, d // b),
                  down_blocks_XxOxZx16=(x, d, f // b, b // 2),
                  down_scales_XxOxZ=(x, d, f // b))
  else:
    shapes.update(w_gate_XxDxF=(x, d, f), w_up_XxDxF=(x, d, f), w_down_XxFxD=(x, f, d))
  if cfg.expert_bias:
    shapes.update(router_bias_X=(x,), b_gate_XxF=(x, f), b_up_XxF=(x, f), b_down_XxD=(x, d))
  return shapes


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _init(key: jax.Array, cfg, dtype, out_std: float) -> dict[str, jax.Array]:
  shapes = param_shapes(cfg)
  keys = dict(zip(shapes, jax.random.split(key, len(shapes))))
  out = {}
  for name, shape in shapes.items():
    if name.endswith("blocks_XxOxZx16"):  # random codes
      out[name] = jax.random.bits(keys[name], shape, jnp.uint8)
    elif name.endswith("scales_XxOxZ"):  # 2^-4: E2M1 codes' rms is ~3, so weights ~0.2
      out[name] = jnp.full(shape, 127 - 4, jnp.uint8)
    elif name.startswith(("b_", "router_bias")):
      out[name] = jnp.zeros(shape, dtype)
    else:
      std = shape[-2] ** -0.5 * (out_std if name.startswith("w_down") else 1.0)
      out[name] = (std * jax.random.normal(keys[name], shape, jnp.float32)).astype(dtype)
  return out


def route(logits_NxX: jax.Array, k: int, renormalize: bool):
  """(weights_NxU float32, experts_NxU int32): the k largest logits' experts and their weights."""
  logits_NxX = logits_NxX.astype(jnp.float32)
  top_NxU, experts_NxU = jax.lax.top_k(logits_NxX, k)
  if renormalize:
    return jax.nn.softmax(top_NxU, axis=-1), experts_NxU
  return jnp.exp(top_NxU - jax.nn.logsumexp(logits_NxX, axis=-1, keepdims=True)), experts_NxU


def swiglu(gate: jax.Array, up: jax.Array, limit: float, alpha: float) -> jax.Array:
  if not limit:
    return jax.nn.silu(gate) * up
  gate = jnp.minimum(gate, limit)
  up = jnp.clip(up, -limit, limit)
  return gate * jax.nn.sigmoid(alpha * gate) * (up + 1)


class MoE(nnx.Module):
  """Router + experts of one layer: y_BxTxD -> sum over the routed experts of weight * expert(y)."""

  def __init__(self, cfg, out_std: float, *, rngs: nnx.Rngs):
    self.cfg = cfg
    for name, value in _init(rngs.params(), cfg, cfg.param_dtype, out_std).items():
      setattr(self, name, Packed(value) if value.dtype == jnp.uint8 else nnx.Param(value))

  def expert_weights(self, dtype):
    """(w_gate_XxDxF, w_up_XxDxF, w_down_XxFxD) in dtype, dequantised if packed."""
    if self.cfg.expert_weights == "float":
      return tuple(w[...].astype(dtype) for w in (self.w_gate_XxDxF, self.w_up_XxDxF,
                                                   self.w_down_XxFxD))
    x, f2, _, _ = self.gate_up_blocks_XxOxZx16.shape
    gate_up_XxOxD = mxfp4.dequantize(self.gate_up_blocks_XxOxZx16[...],
                                     self.gate_up_scales_XxOxZ[...], dtype)
    gate_up_XxFx2xD = gate_up_XxOxD.reshape(x, f2 // 2, 2, -1)  # rows: gate, up, gate, up, ...
    down_XxDxF = mxfp4.dequantize(self.down_blocks_XxOxZx16[...], self.down_scales_XxOxZ[...],
                                  dtype)
    return (gate_up_XxFx2xD[:, :, 0].transpose(0, 2, 1),
            gate_up_XxFx2xD[:, :, 1].transpose(0, 2, 1), down_XxDxF.transpose(0, 2, 1))

  def __call__(self, y_BxTxD: jax.Array) -> jax.Array:
    cfg = self.cfg
    dt = y_BxTxD.dtype
    b, t_len, d = y_BxTxD.shape
    y_NxD = y_BxTxD.reshape(b * t_len, d)
    logits_NxX = jnp.einsum("nd,dx->nx", y_NxD, self.router_DxX[...].astype(dt),
                            preferred_element_type=jnp.float32)
    if cfg.expert_bias:
      logits_NxX = logits_NxX + self.router_bias_X[...].astype(jnp.float32)[None]
    weights_NxU, experts_NxU = route(logits_NxX, cfg.experts_per_token, cfg.route_renormalize)

    # Assignments sorted by expert, laid out so each expert's rows start a row tile of the
    # grouped matmuls (kdjax/kernels/grouped.py); padding rows are zero and discarded.
    t = grouped.tiles()
    expert_Y = experts_NxU.reshape(-1)  # assignment a = token a // U, its (a % U)-th expert
    assignments = expert_Y.shape[0]
    order_Y = jnp.argsort(expert_Y, stable=True)
    group_sizes_X = jnp.bincount(expert_Y, length=cfg.n_experts).astype(jnp.int32)
    groups = grouped.layout(group_sizes_X, assignments, t.bm)
    rows = grouped.padded_rows(assignments, cfg.n_experts, t.bm)
    # each assignment's row, in token order (groups.row_Y: in expert order)
    token_row_Y = jnp.zeros((assignments,), jnp.int32).at[order_Y].set(groups.row_Y)
    token_P = jnp.full((rows,), b * t_len, jnp.int32).at[token_row_Y].set(
        jnp.arange(assignments, dtype=jnp.int32) // cfg.experts_per_token)
    y_PxD = jnp.take(y_NxD, token_P, axis=0, mode="fill", fill_value=0)  # no token: zeros
    if cfg.expert_bias:  # each padded row's expert, for the biases
      expert_P = jnp.repeat(jnp.maximum(groups.tile_expert_M, 0), t.bm)
    matmul = functools.partial(grouped.grouped_matmul, groups=groups)

    if cfg.expert_weights == "mxfp4":  # stored [X, out, in]: the kernels read them transposed
      gate_up_XxOxD = mxfp4.dequantize(self.gate_up_blocks_XxOxZx16[...],
                                       self.gate_up_scales_XxOxZ[...], dt)
      gate_up_PxO = matmul(y_PxD, gate_up_XxOxD, transpose_rhs=True)
      gate_PxF, up_PxF = gate_up_PxO[:, 0::2], gate_up_PxO[:, 1::2]  # rows interleaved
    else:
      gate_PxF = matmul(y_PxD, self.w_gate_XxDxF[...].astype(dt))
      up_PxF = matmul(y_PxD, self.w_up_XxDxF[...].astype(dt))
    gate_PxF, up_PxF = gate_PxF.astype(jnp.float32), up_PxF.astype(jnp.float32)
    if cfg.expert_bias:
      gate_PxF = gate_PxF + self.b_gate_XxF[...].astype(jnp.float32)[expert_P]
      up_PxF = up_PxF + self.b_up_XxF[...].astype(jnp.float32)[expert_P]
    h_PxF = swiglu(gate_PxF, up_PxF, cfg.swiglu_limit, cfg.swiglu_alpha).astype(dt)
    if cfg.expert_weights == "mxfp4":
      down_XxDxF = mxfp4.dequantize(self.down_blocks_XxOxZx16[...], self.down_scales_XxOxZ[...],
                                    dt)
      out_PxD = matmul(h_PxF, down_XxDxF, transpose_rhs=True).astype(jnp.float32)
    else:
      out_PxD = matmul(h_PxF, self.w_down_XxFxD[...].astype(dt)).astype(jnp.float32)
    if cfg.expert_bias:
      out_PxD = out_PxD + self.b_down_XxD[...].astype(jnp.float32)[expert_P]

    # Back to token order, then the weighted sum over each token's U experts.
    out_NxUxD = out_PxD[token_row_Y].reshape(b * t_len, cfg.experts_per_token, d)
    out_NxD = jnp.einsum("nud,nu->nd", out_NxUxD, weights_NxU)
    return out_NxD.reshape(b, t_len, d).astype(dt)
