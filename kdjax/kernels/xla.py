"""Chunked fused loss in plain XLA: a scan over position chunks, gradients computed in forward.

Per chunk of C positions: logits z = h_c W ([C, V] float32, the only [C, V] arrays alive are z
and its gradient dz in the matmul dtype), the row statistics, dz, then dh_c = dz W^T and
dW += h_c^T dz. That is three [C, D] x [D, V]-sized matmuls per chunk, the work floor; a
custom_vjp hands the precomputed gradients to the backward pass, which only scales them by the
incoming cotangent. Without differentiation only the forward projection runs.

Chunks never pad the big arrays: chunk i starts at min(i * C, N - C), so the last chunk overlaps
the previous one and its already-counted rows get weight 0 (and keep their dh). The same driver
serves impl="pallas", which swaps in kernels for the two elementwise passes over z.

Shape letters: N positions, C chunk, D model width, V vocabulary, K cached entries.
"""
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from kdjax.kernels import objectives

# Per chunk the working set is the [C, V] float32 logits plus their bf16 gradient, 6 * C * V
# bytes. It gets at least MIN_WORKING_SET_BYTES, or a fifth of the memory the loss cannot avoid
# (hidden, lm_head and their gradients) when that is more: longer sequences get larger chunks,
# which cost proportionally less dW read-modify-write traffic (dW += h_c^T dz per chunk).
MIN_WORKING_SET_BYTES = 768 * 2**20
WORKING_SET_SHARE = 0.2
MAX_CHUNK = 8192


def default_chunk(num_rows: int, dim: int, vocab: int, itemsize: int) -> int:
  """Chunk size C: a multiple of 128 (matmul tiles), at least 128, at most N."""
  unavoidable = 2 * itemsize * (num_rows * dim + dim * vocab)
  budget = max(MIN_WORKING_SET_BYTES, WORKING_SET_SHARE * unavoidable)
  chunk = int(budget // (6 * vocab)) // 128 * 128
  return max(1, min(max(chunk, 128), MAX_CHUNK, num_rows))


def xla_row_stats(logits_CxV, spec: objectives.LossSpec):
  """(logsumexp(z / tau), logsumexp(z)) per row, float32."""
  lse_s_C = jax.nn.logsumexp(logits_CxV / spec.temperature, axis=-1)
  lse_z_C = jax.nn.logsumexp(logits_CxV, axis=-1) if spec.two_softmax else lse_s_C
  return lse_s_C, lse_z_C


def xla_dense_grad(logits_CxV, lse_s_C, lse_z_C, a_C, b_C, spec, dtype):
  """a * softmax(z / tau) + b * softmax(z), computed in float32 and rounded once to dtype."""
  if not spec.two_softmax:
    a_C = a_C + b_C
  dz_CxV = a_C[:, None] * jnp.exp(logits_CxV / spec.temperature - lse_s_C[:, None])
  if spec.two_softmax and spec.ce_weight != 0.0:
    dz_CxV = dz_CxV + b_C[:, None] * jnp.exp(logits_CxV - lse_z_C[:, None])
  return dz_CxV.astype(dtype)


def _chunk_start(i, num_rows, chunk):
  start = jnp.minimum(i * chunk, num_rows - chunk)
  fresh_C = start + jnp.arange(chunk) >= i * chunk
  return start, fresh_C


def _gather_rows(logits_CxV, ids_CxK, labels_C):
  zk_CxK = jnp.take_along_axis(logits_CxV, ids_CxK, axis=-1)
  zl_C = jnp.take_along_axis(logits_CxV, labels_C[:, None], axis=-1)[:, 0]
  return zk_CxK, zl_C


def chunk_terms(hidden_CxD, lm_head_DxV, ids_CxK, logp_CxK, labels_C, spec, row_stats):
  """Logits of one chunk and everything the loss needs from them."""
  logits_CxV = jnp.einsum("cd,dv->cv", hidden_CxD, lm_head_DxV,
                          preferred_element_type=jnp.float32)
  lse_s_C, lse_z_C = row_stats(logits_CxV, spec)
  zk_CxK, zl_C = _gather_rows(logits_CxV, ids_CxK, labels_C)
  terms = objectives.row_terms(zk_CxK, zl_C, lse_s_C, lse_z_C, logp_CxK, spec)
  return logits_CxV, (zk_CxK, zl_C, lse_s_C, lse_z_C), terms


def chunk_dlogits(logits_CxV, gathered, terms, ids_CxK, labels_C, w_C, spec, dtype, dense_grad):
  """dL/dz of one chunk in dtype: dense pass plus K (+1) exact entries per row."""
  zk_CxK, zl_C, lse_s_C, lse_z_C = gathered
  dz_CxV = dense_grad(logits_CxV, lse_s_C, lse_z_C, terms["a"] * w_C, terms["b"] * w_C, spec,
                      dtype)
  ent_ids_CxE, ent_vals_CxE = objectives.sparse_entries(
      ids_CxK, labels_C, zk_CxK, zl_C, lse_s_C, lse_z_C, terms, w_C, spec)
  rows_CxE = jnp.broadcast_to(jnp.arange(ids_CxK.shape[0])[:, None], ent_ids_CxE.shape)
  return dz_CxV.at[rows_CxE, ent_ids_CxE].set(ent_vals_CxE.astype(dtype))


def accumulate_dw(dw_DxV, hidden_CxD, dz_CxV):
  """dW += h^T dz in lm_head's dtype: XLA folds the add into the matmul (cuBLAS beta = 1, in
  place), which accumulates in float32 and rounds the sum once per chunk."""
  return dw_DxV + jnp.einsum("cd,cv->dv", hidden_CxD, dz_CxV,
                             preferred_element_type=dw_DxV.dtype)


def chunked_loss(hidden_NxD, lm_head_DxV, ids_NxK, logp_NxK, w_N, labels_N, spec, chunk,
                 row_stats, dense_grad, with_grads):
  """Scan over chunks. Returns (kl_sum, ce_sum) weighted by w, plus (dh, dW) if with_grads."""
  num_rows, _ = hidden_NxD.shape
  dtype = jnp.promote_types(hidden_NxD.dtype, lm_head_DxV.dtype)
  take = lambda x, start: jax.lax.dynamic_slice_in_dim(x, start, chunk, axis=0)

  def body(carry, i):
    start, fresh_C = _chunk_start(i, num_rows, chunk)
    h_CxD = take(hidden_NxD, start)
    ids_CxK, labels_C = take(ids_NxK, start), take(labels_N, start)
    w_C = jnp.where(fresh_C, take(w_N, start), 0.0)
    logits_CxV, gathered, terms = chunk_terms(
        h_CxD, lm_head_DxV, ids_CxK, take(logp_NxK, start), labels_C, spec, row_stats)
    kl, ce = jnp.sum(w_C * terms["kl"]), jnp.sum(w_C * terms["ce"])
    if not with_grads:
      return (carry[0] + kl, carry[1] + ce), None
    kl_sum, ce_sum, dh_NxD, dw_DxV = carry
    dz_CxV = chunk_dlogits(logits_CxV, gathered, terms, ids_CxK, labels_C, w_C, spec,
                           dtype, dense_grad)
    dh_CxD = jnp.einsum("cv,dv->cd", dz_CxV, lm_head_DxV.astype(dtype),
                        preferred_element_type=jnp.float32).astype(dh_NxD.dtype)
    dh_CxD = jnp.where(fresh_C[:, None], dh_CxD, take(dh_NxD, start))
    dh_NxD = jax.lax.dynamic_update_slice_in_dim(dh_NxD, dh_CxD, start, axis=0)
    dw_DxV = accumulate_dw(dw_DxV, h_CxD.astype(dtype), dz_CxV)
    return (kl_sum + kl, ce_sum + ce, dh_NxD, dw_DxV), None

  zero = jnp.zeros((), jnp.float32)
  carry = (zero, zero)
  if with_grads:
    carry += (jnp.zeros_like(hidden_NxD), jnp.zeros_like(lm_head_DxV))
  carry, _ = jax.lax.scan(body, carry, jnp.arange(-(-num_rows // chunk)))
  return carry


def build_fused_loss(row_stats: Callable, dense_grad: Callable):
  """custom_vjp loss (h, W, ids, logp, w, labels, spec, chunk) -> (loss, kl, ce)."""

  @functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
  def loss(hidden_NxD, lm_head_DxV, ids_NxK, logp_NxK, w_N, labels_N, spec, chunk):
    kl, ce = chunked_loss(hidden_NxD, lm_head_DxV, ids_NxK, logp_NxK, w_N, labels_N, spec,
                          chunk, row_stats, dense_grad, with_grads=False)
    return kl + spec.ce_weight * ce, kl, ce

  def fwd(hidden_NxD, lm_head_DxV, ids_NxK, logp_NxK, w_N, labels_N, spec, chunk):
    kl, ce, dh_NxD, dw_DxV = chunked_loss(hidden_NxD, lm_head_DxV, ids_NxK, logp_NxK, w_N,
                                          labels_N, spec, chunk, row_stats, dense_grad,
                                          with_grads=True)
    return (kl + spec.ce_weight * ce, kl, ce), (dh_NxD, dw_DxV)

  def bwd(spec, chunk, residuals, cotangents):
    dh_NxD, dw_DxV = residuals
    g = cotangents[0]  # kl and ce are logged values: their cotangents are ignored
    scale = lambda x: (x.astype(jnp.float32) * g).astype(x.dtype)
    return scale(dh_NxD), scale(dw_DxV), None, None, None, None

  loss.defvjp(fwd, bwd)
  return loss


topk_kl_loss = build_fused_loss(xla_row_stats, xla_dense_grad)


def position_stats(hidden_NxD, lm_head_DxV, ids_NxK, labels_N, chunk):
  """Chunked, gradient-free per-position logit statistics (see kdjax.kernels.position_stats)."""
  num_rows, _ = hidden_NxD.shape
  take = lambda x, start: jax.lax.dynamic_slice_in_dim(x, start, chunk, axis=0)
  put = lambda x, y, start: jax.lax.dynamic_update_slice_in_dim(x, y, start, axis=0)

  def body(out, i):
    # Overlapping rows of the last chunk are recomputed to identical values: plain overwrite.
    start, _ = _chunk_start(i, num_rows, chunk)
    logits_CxV = jnp.einsum("cd,dv->cv", take(hidden_NxD, start), lm_head_DxV,
                            preferred_element_type=jnp.float32)
    zk_CxK, zl_C = _gather_rows(logits_CxV, take(ids_NxK, start), take(labels_N, start))
    new = dict(lse=jax.nn.logsumexp(logits_CxV, axis=-1),
               argmax=jnp.argmax(logits_CxV, axis=-1).astype(jnp.int32),
               label_logit=zl_C, topk_logits=zk_CxK)
    return {k: put(out[k], new[k], start) for k in out}, None

  out = dict(lse=jnp.zeros((num_rows,), jnp.float32),
             argmax=jnp.zeros((num_rows,), jnp.int32),
             label_logit=jnp.zeros((num_rows,), jnp.float32),
             topk_logits=jnp.zeros(ids_NxK.shape, jnp.float32))
  out, _ = jax.lax.scan(body, out, jnp.arange(-(-num_rows // chunk)))
  return jax.lax.stop_gradient(out)
