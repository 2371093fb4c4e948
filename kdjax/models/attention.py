"""Causal, document-masked grouped-query attention over packed rows.

Shape letters: B batch, T query positions, S key positions (the same tokens as T), H query heads,
G key/value heads, R query heads per key/value head (H = G * R), E head dim, M documents per row
(a static bound).

A packed row holds documents (segments 1, 2, ... in order, each one contiguous) followed by
padding (segment 0). Query t sees key s iff s <= t and both lie in the same document; padding
queries return zeros.

Two implementations of that one function:
  * `attention_einsum`, the reference: a dense [T, S] score matrix and mask, any device.
  * `attention_cudnn`: cuDNN flash attention in its packed (ragged) layout on GPU. Each document
    is handed over as an offset and a length, so no [T, S] array exists in the forward or the
    backward pass and the blocks that straddle two documents are never computed: memory is
    linear in T (plus cuDNN's softmax statistics, [B * M, H, T] float32).
"""
import math

import jax
import jax.numpy as jnp
import numpy as np

IMPLS = ("auto", "einsum", "cudnn")


def documents_bound(segment_ids_BxT: np.ndarray) -> int:
  """M for a host batch: the next power of two >= its largest segment id (at least 1).

  Rounding up bounds the number of distinct compiled programs to log2(T) while keeping M (and
  cuDNN's statistics, linear in M) within 2x of what the batch needs.
  """
  most = int(np.max(segment_ids_BxT, initial=1))
  return 1 << max(most - 1, 0).bit_length()


def document_spans(segment_ids_BxT: jax.Array, max_documents: int):
  """(starts_BxM1, lengths_BxM) int32 of documents 1..M of each row; -1 where a row has fewer.

  The layout of cuDNN's packed attention: starts has one extra column of -1. Segment ids above M
  are dropped, so M must bound them (see documents_bound).
  """
  b, t = segment_ids_BxT.shape
  rows_Bx1 = jnp.arange(b)[:, None]
  idx_BxT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  lengths_BxM1 = jnp.zeros((b, max_documents + 1), jnp.int32).at[rows_Bx1, segment_ids_BxT].add(
      1, mode="drop")
  starts_BxM1 = jnp.full((b, max_documents + 1), t, jnp.int32).at[rows_Bx1, segment_ids_BxT].min(
      idx_BxT, mode="drop")
  present_BxM = lengths_BxM1[:, 1:] > 0  # column 0 counts padding
  starts_BxM = jnp.where(present_BxM, starts_BxM1[:, 1:], -1)
  lengths_BxM = jnp.where(present_BxM, lengths_BxM1[:, 1:], -1)
  starts_BxM1 = jnp.concatenate([starts_BxM, jnp.full((b, 1), -1, jnp.int32)], axis=1)
  return starts_BxM1, lengths_BxM


def spans_mask(starts_BxM1: jax.Array, lengths_BxM: jax.Array, t: int) -> jax.Array:
  """[B, T, S] bool from spans, as cuDNN reads them: t sees s iff both in one span and s <= t.

  Only for tests: it checks document_spans against document_mask on CPU.
  """
  idx_11T = jnp.arange(t)[None, None]
  start_BxMx1 = starts_BxM1[:, :-1, None]
  inside_BxMxT = (idx_11T >= start_BxMx1) & (idx_11T < start_BxMx1 + lengths_BxM[:, :, None])
  same_BxTxS = jnp.einsum("bmt,bms->bts", inside_BxMxT.astype(jnp.int32),
                          inside_BxMxT.astype(jnp.int32)) > 0
  idx_T = jnp.arange(t)
  return same_BxTxS & (idx_T[:, None] >= idx_T[None, :])[None]


def document_mask(segment_ids_BxT: jax.Array) -> jax.Array:
  """[B, T, S] bool: query t sees key s iff s <= t and both are in the same nonzero segment."""
  idx_T = jnp.arange(segment_ids_BxT.shape[1])
  causal_TxS = idx_T[:, None] >= idx_T[None, :]
  seg_q_BxTx1 = segment_ids_BxT[:, :, None]
  seg_k_Bx1xS = segment_ids_BxT[:, None, :]
  return causal_TxS[None] & (seg_q_BxTx1 == seg_k_Bx1xS) & (seg_q_BxTx1 != 0)


def attention_einsum(q_BxTxHxE: jax.Array, k_BxSxGxE: jax.Array, v_BxSxGxE: jax.Array,
                     segment_ids_BxT: jax.Array) -> jax.Array:
  """Reference: plain einsums with an O(T^2) float32 score matrix per head."""
  b, t, h, e = q_BxTxHxE.shape
  g = k_BxSxGxE.shape[2]
  q_BxTxGxRxE = q_BxTxHxE.reshape(b, t, g, h // g, e)
  scores_BxGxRxTxS = jnp.einsum("btgre,bsge->bgrts", q_BxTxGxRxE, k_BxSxGxE,
                                preferred_element_type=jnp.float32) / math.sqrt(e)
  mask_Bx1x1xTxS = document_mask(segment_ids_BxT)[:, None, None]
  # A finite fill keeps fully masked (padding) rows NaN-free; they are zeroed below.
  scores_BxGxRxTxS = jnp.where(mask_Bx1x1xTxS, scores_BxGxRxTxS, jnp.finfo(jnp.float32).min)
  probs_BxGxRxTxS = jax.nn.softmax(scores_BxGxRxTxS, axis=-1)
  probs_BxGxRxTxS = jnp.where(mask_Bx1x1xTxS, probs_BxGxRxTxS, 0.0)
  out_BxTxGxRxE = jnp.einsum("bgrts,bsge->btgre", probs_BxGxRxTxS.astype(v_BxSxGxE.dtype),
                             v_BxSxGxE, preferred_element_type=jnp.float32)
  return out_BxTxGxRxE.reshape(b, t, h, e).astype(q_BxTxHxE.dtype)


def attention_cudnn(q_BxTxHxE: jax.Array, k_BxSxGxE: jax.Array, v_BxSxGxE: jax.Array,
                    segment_ids_BxT: jax.Array, max_documents: int) -> jax.Array:
  """cuDNN flash attention, documents passed as offsets and lengths (GPU, bf16/fp16)."""
  # jax.nn.dot_product_attention (JAX 0.11) takes sequence lengths but not the per-document
  # offsets of a packed row; the cuDNN wrapper underneath does. JAX is pinned, so this private
  # import is checked by the GPU test whenever the pin moves.
  from jax._src.cudnn import fused_attention_stablehlo as cudnn_sdpa

  scale = 1.0 / math.sqrt(q_BxTxHxE.shape[-1])
  real_BxT = segment_ids_BxT != 0
  if max_documents > 1:
    # cuDNN never writes the outputs or the gradients of positions outside every document
    # (padding): selecting its inputs and output drops whatever is there, in both passes.
    q_BxTxHxE, k_BxSxGxE, v_BxSxGxE = (jnp.where(real_BxT[:, :, None, None], x, 0)
                                       for x in (q_BxTxHxE, k_BxSxGxE, v_BxSxGxE))
  if max_documents == 1:
    # One document per row: plain causal attention; padding sits after it, so no real query
    # reaches a padding key.
    out_BxTxHxE = cudnn_sdpa.dot_product_attention(
        q_BxTxHxE, k_BxSxGxE, v_BxSxGxE, scale=scale, mask_type=cudnn_sdpa.MaskType.CAUSAL)
  else:
    starts_BxM1, lengths_BxM = document_spans(segment_ids_BxT, max_documents)
    out_BxTxHxE = cudnn_sdpa.dot_product_attention(
        q_BxTxHxE, k_BxSxGxE, v_BxSxGxE, q_seqlen=lengths_BxM, kv_seqlen=lengths_BxM,
        q_offsets=starts_BxM1, kv_offsets=starts_BxM1, scale=scale,
        mask_type=cudnn_sdpa.MaskType.PADDING_CAUSAL)
  return jnp.where(real_BxT[:, :, None, None], out_BxTxHxE, 0).astype(q_BxTxHxE.dtype)


def cudnn_applies(q_BxTxHxE: jax.Array) -> bool:
  # cuDNN's flash attention: half precision, head dim a multiple of 8 and at most 128.
  e = q_BxTxHxE.shape[-1]
  return (q_BxTxHxE.dtype in (jnp.bfloat16, jnp.float16) and e <= 128 and e % 8 == 0
          and jax.default_backend() == "gpu")


def attention(q_BxTxHxE: jax.Array, k_BxSxGxE: jax.Array, v_BxSxGxE: jax.Array,
              segment_ids_BxT: jax.Array, impl: str = "auto",
              max_documents: int | None = None) -> jax.Array:
  """Causal, document-masked grouped-query attention (see the module docstring).

  impl: "einsum" (reference), "cudnn" (GPU) or "auto" (cudnn where it applies, else einsum).
  max_documents: M, a static bound on the segment ids of every row (documents_bound of the host
  batch); the cudnn path needs it, the reference ignores it.
  """
  if impl == "auto":
    impl = "cudnn" if cudnn_applies(q_BxTxHxE) else "einsum"
  if impl == "einsum":
    return attention_einsum(q_BxTxHxE, k_BxSxGxE, v_BxSxGxE, segment_ids_BxT)
  if max_documents is None:
    raise ValueError("cuDNN attention needs max_documents, a bound on the documents per row: "
                     "pass attention.documents_bound(segment_ids) of the host batch.")
  return attention_cudnn(q_BxTxHxE, k_BxSxGxE, v_BxSxGxE, segment_ids_BxT, max_documents)
