"""The paper's fused chunked KL (arXiv 2608.03796, full_chunked.py), re-implemented in JAX.

A baseline for benchmarks, faithful to its algorithm: chunks of 4096 positions; forward
projects every chunk twice (pass 1: the log-normaliser; pass 2: the sparse terms) and saves
hidden, W and the per-position normalisers; backward projects each chunk a third time and runs
the two gradient matmuls: five [C, D] x [D, V] matmuls per chunk against the floor of three.
Objectives, temperature and CE use the same per-position math as every other impl. It has no
per-position terms and takes a whole lm_head (its entry in topk_kl's table says so).
"""
import functools

import jax
import jax.numpy as jnp

from kdjax.kernels import logit_passes
from kdjax.loss import chunked, objectives, projection

CHUNK = 4096


def default_chunk(num_rows: int, dim: int, vocab: int, dtype, spec=None) -> int:
  del dim, vocab, dtype, spec
  return min(CHUNK, num_rows)


def _logits(hidden_CxD, lm_head_DxV):
  return jnp.einsum("cd,dv->cv", hidden_CxD, lm_head_DxV, preferred_element_type=jnp.float32)


def _scan_chunks(body, carry, num_rows, chunk):
  return jax.lax.scan(body, carry, jnp.arange(-(-num_rows // chunk)))[0]


def _normalisers(hidden_NxD, lm_head_DxV, spec, chunk):
  """Pass 1: logsumexp(z / tau) and logsumexp(z) per position."""
  num_rows = hidden_NxD.shape[0]

  def body(lse, i):
    start = jnp.minimum(i * chunk, num_rows - chunk)
    h_CxD = jax.lax.dynamic_slice_in_dim(hidden_NxD, start, chunk)
    out = logit_passes.exp_pass_reference(_logits(h_CxD, lm_head_DxV), None,
                                          projection.softmax_scales(spec), None)
    lse_s_C, lse_z_C = projection.normalisers(out.sums, out.shift_C, spec)
    put = lambda x, y: jax.lax.dynamic_update_slice_in_dim(x, y, start, axis=0)
    return (put(lse[0], lse_s_C), put(lse[1], lse_z_C)), None

  zeros = jnp.zeros((num_rows,), jnp.float32)
  return _scan_chunks(body, (zeros, zeros), num_rows, chunk)


def _sums(hidden_NxD, lm_head_DxV, ids_NxK, logp_NxK, w_N, labels_N, lse, spec, chunk):
  """Pass 2: the weighted KL and CE sums from the sparse entries."""
  num_rows = hidden_NxD.shape[0]
  take = lambda x, start: jax.lax.dynamic_slice_in_dim(x, start, chunk, axis=0)

  def body(sums, i):
    start, fresh_C = chunked.chunk_start(i, num_rows, chunk)
    logits_CxV = _logits(take(hidden_NxD, start), lm_head_DxV)
    zk_CxK, zl_C = projection.gather_rows(logits_CxV, take(ids_NxK, start), take(labels_N, start))
    terms = objectives.row_terms(zk_CxK, zl_C, take(lse[0], start), take(lse[1], start),
                                 take(logp_NxK, start), spec)
    w_C = jnp.where(fresh_C, take(w_N, start), 0.0)
    return (sums[0] + jnp.sum(w_C * terms["kl"]), sums[1] + jnp.sum(w_C * terms["ce"])), None

  zero = jnp.zeros((), jnp.float32)
  return _scan_chunks(body, (zero, zero), num_rows, chunk)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def topk_kl_loss(hidden_NxD, lm_head_DxV, ids_NxK, logp_NxK, w_N, labels_N, spec, chunk,
                 dw_dtype, per_position, axis) -> objectives.LossTerms:
  """chunked.build_fused_loss's contract, with no per-position terms (positions None) and a
  whole lm_head (axis None)."""
  return _fwd(hidden_NxD, lm_head_DxV, ids_NxK, logp_NxK, w_N, labels_N, spec, chunk, dw_dtype,
              per_position, axis)[0]


def _fwd(hidden_NxD, lm_head_DxV, ids_NxK, logp_NxK, w_N, labels_N, spec, chunk, dw_dtype,
         per_position, axis):
  del per_position, axis  # off: topk_kl's table lists neither for impl "paper"
  lse = _normalisers(hidden_NxD, lm_head_DxV, spec, chunk)
  kl, ce = _sums(hidden_NxD, lm_head_DxV, ids_NxK, logp_NxK, w_N, labels_N, lse, spec, chunk)
  residuals = (hidden_NxD, lm_head_DxV, ids_NxK, logp_NxK, w_N, labels_N, lse)
  return objectives.LossTerms(kl + spec.ce_weight * ce, kl, ce, None), residuals


def _bwd(spec, chunk, dw_dtype, per_position, axis, residuals, cotangents):
  hidden_NxD, lm_head_DxV, ids_NxK, logp_NxK, w_N, labels_N, lse = residuals
  num_rows = hidden_NxD.shape[0]
  dtype = jnp.promote_types(hidden_NxD.dtype, lm_head_DxV.dtype)
  take = lambda x, start: jax.lax.dynamic_slice_in_dim(x, start, chunk, axis=0)
  g_w_N = w_N * cotangents.loss

  def body(carry, i):
    dh_NxD, dw_DxV = carry
    start, fresh_C = chunked.chunk_start(i, num_rows, chunk)
    h_CxD = take(hidden_NxD, start)
    ids_CxK, labels_C = take(ids_NxK, start), take(labels_N, start)
    logits_CxV = _logits(h_CxD, lm_head_DxV)
    lse_s_C, lse_z_C = take(lse[0], start), take(lse[1], start)
    zk_CxK, zl_C = projection.gather_rows(logits_CxV, ids_CxK, labels_C)
    terms = objectives.row_terms(zk_CxK, zl_C, lse_s_C, lse_z_C, take(logp_NxK, start), spec)
    w_C = jnp.where(fresh_C, take(g_w_N, start), 0.0)
    chunk_C = chunked.ChunkTerms(logits_CxV, None, None,
                                 chunked.Gathered(zk_CxK, zl_C, lse_s_C, lse_z_C), terms)
    dz_CxV, _ = chunked.chunk_dlogits(chunk_C, ids_CxK, labels_C, w_C, spec, dtype,
                                      logit_passes.dense_grad_reference)
    dh_CxD = jnp.einsum("cv,dv->cd", dz_CxV, lm_head_DxV.astype(dtype),
                        preferred_element_type=jnp.float32).astype(dh_NxD.dtype)
    dh_CxD = jnp.where(fresh_C[:, None], dh_CxD, take(dh_NxD, start))
    dh_NxD = jax.lax.dynamic_update_slice_in_dim(dh_NxD, dh_CxD, start, axis=0)
    dw_DxV = chunked.accumulate_dw(dw_DxV, h_CxD.astype(dtype), dz_CxV)
    return (dh_NxD, dw_DxV), None

  dh_NxD, dw_DxV = _scan_chunks(
      body, (jnp.zeros_like(hidden_NxD), jnp.zeros(lm_head_DxV.shape,
                                                   dw_dtype or lm_head_DxV.dtype)),
      num_rows, chunk)
  return dh_NxD, dw_DxV.astype(lm_head_DxV.dtype), None, None, None, None


topk_kl_loss.defvjp(_fwd, _bwd)
