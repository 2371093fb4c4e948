"""Causal, document-masked grouped-query attention over packed rows.

Shape letters: B batch, T query positions, S key positions (the same tokens as T), H query heads,
G key/value heads, R query heads per key/value head (H = G * R), E head dim, M documents per row
(a static bound, or those of one cuDNN call).

A packed row holds documents (segments 1, 2, ... in order, each one contiguous) followed by
padding (segment 0). Query t sees key s iff s <= t and both lie in the same document (and, in a
sliding-window layer of `window` keys, t - s < window); padding queries return zeros. gpt-oss's
attention sinks add one learned logit per head to each softmax's denominator (a key with no
value): a query may give little weight to every key.

Two implementations of that one function:
  * `attention_einsum`, the reference: a dense [T, S] score matrix and mask, any device, in
    blocks of queries for long rows (SCORE_BYTES of scores at a time; a sliding-window block
    reads only the keys in its window, a causal one those up to its band's last query).
  * `attention_cudnn`: cuDNN flash attention in its packed (ragged) layout on GPU. Each document
    is handed over as an offset and a length, so no [T, S] array exists in the forward or the
    backward pass and the blocks that straddle two documents are never computed. Memory is
    linear in T: documents go to cuDNN a few per call, as its workspace grows with documents x T.
    Sliding windows are cuDNN's own; sinks scale cuDNN's output by sigmoid(lse - sink) from its
    log-normaliser lse (exact: the sink is one more term of the denominator), their gradients
    the reference's, recomputed (cuDNN's backward takes no cotangent of lse). Without sinks the
    backward pass keeps one output and one log-normaliser per position, merged over the calls
    (tagged "attention" and "attention_lse" for the remat policies), and hands each call's
    backward its documents' share of them: a policy that keeps those two never reruns the
    attention's forward, however many calls a row takes.
"""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from kdjax import choices
from kdjax.models import remat

IMPLS = choices.ATTENTION_IMPLS


def document_spans(segment_ids_BxT: jax.Array, max_documents: int):
  """(starts_BxM1, lengths_BxM) int32 of documents 1..M of each row, the layout of cuDNN's
  packed attention: starts has one extra column of -1. Segment ids above M are dropped, so M
  must bound them (see documents_bound).

  A row with fewer than M documents gets empty spans (length 0) at the end of its documents, not
  JAX's -1 for "none": cuDNN drops the -1 spans and shifts the rest left, so a call's
  log-normalisers would sit at b * M + j only for rows before the first dropped span (the call's
  backward read other documents' log-normalisers, the sinks other documents' too). Empty spans
  keep every document at b * M + j, also in each batch shard of a partitioned call.
  """
  b, t = segment_ids_BxT.shape
  rows_Bx1 = jnp.arange(b)[:, None]
  idx_BxT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  lengths_BxM1 = jnp.zeros((b, max_documents + 1), jnp.int32).at[rows_Bx1, segment_ids_BxT].add(
      1, mode="drop")
  starts_BxM1 = jnp.full((b, max_documents + 1), t, jnp.int32).at[rows_Bx1, segment_ids_BxT].min(
      idx_BxT, mode="drop")
  present_BxM = lengths_BxM1[:, 1:] > 0  # column 0 counts padding
  ends_BxM = jnp.where(present_BxM, starts_BxM1[:, 1:] + lengths_BxM1[:, 1:], 0)
  starts_BxM = jnp.where(present_BxM, starts_BxM1[:, 1:], jnp.max(ends_BxM, axis=1, keepdims=True))
  lengths_BxM = lengths_BxM1[:, 1:]
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


def document_mask(segment_ids_BxT: jax.Array, window: int = 0) -> jax.Array:
  """[B, T, S] bool: query t sees key s iff s <= t and both are in the same nonzero segment
  (and t - s < window, if window > 0)."""
  idx_T = jnp.arange(segment_ids_BxT.shape[1])
  return _mask(segment_ids_BxT, segment_ids_BxT, idx_T, idx_T, window)


def _mask(seg_q_BxT, seg_k_BxS, idx_q_T, idx_k_S, window: int) -> jax.Array:
  """document_mask of queries at positions idx_q_T against keys at positions idx_k_S."""
  causal_TxS = idx_q_T[:, None] >= idx_k_S[None, :]
  if window:
    causal_TxS = causal_TxS & (idx_q_T[:, None] - idx_k_S[None, :] < window)
  seg_q_BxTx1 = seg_q_BxT[:, :, None]
  return causal_TxS[None] & (seg_q_BxTx1 == seg_k_BxS[:, None, :]) & (seg_q_BxTx1 != 0)


# The einsum path takes queries in blocks whose float32 scores [B, H, block, S] stay within
# SCORE_BYTES (forward and backward), not [B, H, T, S]: at gpt-oss's 64 heads, B = 1, 2048
# queries at S = 4K, 256 at S = 32K (its full layers: 17 GiB in one piece at 8K).
SCORE_BYTES = 2 << 30
# Causal full layers group their blocks into up to this many bands, each band's blocks against
# the keys up to the band's last query (static shapes): 8 bands compute 56% of the block x all
# keys scores (36 / 64).
CAUSAL_BANDS = 8


def attention_einsum(q_BxTxHxE: jax.Array, k_BxSxGxE: jax.Array, v_BxSxGxE: jax.Array,
                     segment_ids_BxT: jax.Array, sinks_H: jax.Array | None = None,
                     window: int = 0, query_block: int | None = None) -> jax.Array:
  """Reference: plain einsums with a float32 score matrix per head; sinks_H (logits) and window
  as in the module docstring. Rows longer than query_block (default: sized to SCORE_BYTES) go
  through in blocks of that many queries (each recomputed in the backward pass), against the
  keys up to their band's last query (CAUSAL_BANDS), or, in a sliding-window layer, against the
  block's own keys and the window - 1 before them."""
  b, t, h, e = q_BxTxHxE.shape
  if query_block is None:
    keys = min(t, window + 2048) if window else t
    query_block = max(16, min(2048, SCORE_BYTES // (4 * b * h * keys)))
  if t <= query_block:
    return _attend(q_BxTxHxE, k_BxSxGxE, v_BxSxGxE,
                   document_mask(segment_ids_BxT, window), sinks_H)
  c, n = query_block, -(-t // query_block)
  pad = n * c - t
  pad_q = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
  blocks = lambda x: pad_q(x).reshape((b, n, c) + x.shape[2:]).swapaxes(0, 1)
  # Keys padded in front by window - 1 (segment 0: nobody sees them), so block i's keys are the
  # padded rows i * C .. i * C + span.
  lead = window - 1 if window else 0
  pad_k = lambda x: jnp.pad(x, [(0, 0), (lead, pad if window else 0)] + [(0, 0)] * (x.ndim - 2))
  k_BxSxGxE, v_BxSxGxE, seg_k_BxS = (pad_k(x) for x in (k_BxSxGxE, v_BxSxGxE, segment_ids_BxT))

  def one_block(span, args):
    i, q_BxCxHxE, seg_q_BxC = args
    start = i * c if window else 0
    keys = [jax.lax.dynamic_slice_in_dim(x, start, span, axis=1)
            for x in (k_BxSxGxE, v_BxSxGxE, seg_k_BxS)]
    idx_q_C = i * c + jnp.arange(c)
    idx_k_S = start - lead + jnp.arange(span)
    mask_BxCxS = _mask(seg_q_BxC, keys[2], idx_q_C, idx_k_S, window)
    return _attend(q_BxCxHxE, keys[0], keys[1], mask_BxCxS, sinks_H)

  q_NxBxCxHxE, seg_NxBxC = blocks(q_BxTxHxE), blocks(segment_ids_BxT)
  if window:  # every block: its own keys and the window - 1 before them
    bands = [(0, n, c + lead)]
  else:  # causal: blocks in bands, each band against the keys up to its last query only
    edges = np.linspace(0, n, min(n, CAUSAL_BANDS) + 1).round().astype(int)
    bands = [(lo, hi, min(hi * c, t)) for lo, hi in zip(edges[:-1], edges[1:])]
  outs = [jax.lax.map(jax.checkpoint(functools.partial(one_block, span)),
                      (jnp.arange(lo, hi), q_NxBxCxHxE[lo:hi], seg_NxBxC[lo:hi]))
          for lo, hi, span in bands]
  out_NxBxCxHxE = jnp.concatenate(outs) if len(outs) > 1 else outs[0]
  return out_NxBxCxHxE.swapaxes(0, 1).reshape(b, n * c, h, e)[:, :t]


def _attend(q_BxTxHxE, k_BxSxGxE, v_BxSxGxE, mask_BxTxS, sinks_H):
  """Softmax attention of queries against keys under a [B, T, S] mask (einsums, float32
  scores)."""
  b, t, h, e = q_BxTxHxE.shape
  g = k_BxSxGxE.shape[2]
  q_BxTxGxRxE = q_BxTxHxE.reshape(b, t, g, h // g, e)
  scores_BxGxRxTxS = jnp.einsum("btgre,bsge->bgrts", q_BxTxGxRxE, k_BxSxGxE,
                                preferred_element_type=jnp.float32) / math.sqrt(e)
  mask_Bx1x1xTxS = mask_BxTxS[:, None, None]
  # A finite fill keeps fully masked (padding) rows NaN-free; they are zeroed below.
  scores_BxGxRxTxS = jnp.where(mask_Bx1x1xTxS, scores_BxGxRxTxS, jnp.finfo(jnp.float32).min)
  if sinks_H is None:
    probs_BxGxRxTxS = jax.nn.softmax(scores_BxGxRxTxS, axis=-1)
  else:
    # The sink is one more column of the softmax, dropped after it.
    sink_BxGxRxTx1 = jnp.broadcast_to(sinks_H.astype(jnp.float32).reshape(1, g, h // g, 1, 1),
                                      (b, g, h // g, t, 1))
    probs_BxGxRxTxS = jax.nn.softmax(
        jnp.concatenate([scores_BxGxRxTxS, sink_BxGxRxTx1], axis=-1), axis=-1)[..., :-1]
  probs_BxGxRxTxS = jnp.where(mask_Bx1x1xTxS, probs_BxGxRxTxS, 0.0)
  out_BxTxGxRxE = jnp.einsum("bgrts,bsge->btgre", probs_BxGxRxTxS.astype(v_BxSxGxE.dtype),
                             v_BxSxGxE, preferred_element_type=jnp.float32)
  return out_BxTxGxRxE.reshape(b, t, h, e).astype(q_BxTxHxE.dtype)


# cuDNN's packed backward takes a float32 workspace of about 2 x (B * m * T * H * E) x 4 bytes
# for m documents per call: it sizes every document of the bound m as if it were T long. With
# Llama-3.2-3B's heads at T = 128K and m = 16 that is 48 GiB per layer (XLA's buffer assignment
# on the H200 agreed; BENCHMARKS.md). Calls
# therefore take at most max(2, WORKSPACE_POSITIONS // (B * T)) documents each: B * m * T stays
# within 2^18 positions (~6 GiB at 24 x 128 heads) from T = 256K down, and at 8K one call takes
# 32 documents.
WORKSPACE_POSITIONS = 1 << 18


def documents_per_call(b: int, t: int, max_documents: int) -> int:
  return min(max_documents, max(2, WORKSPACE_POSITIONS // (b * t)))


def _cudnn(q_BxTxHxE, k_BxSxGxE, v_BxSxGxE, scale, window, lse, starts_BxM1=None,
           lengths_BxM=None):
  """One cuDNN call: causal over the whole row, or over M documents per row given as spans
  (then it reads and writes, forward and backward, only positions inside them; everything else
  is left as it was); a sliding window of `window` keys (0: none). lse: also the softmax's
  log-normaliser per query and head, [B, H, T] for a whole row, [B * M, H, T] for spans (document
  j of row b at [b * M + j, :, t - start]). Returns out or (out, lse)."""
  # jax.nn.dot_product_attention (JAX 0.11) takes sequence lengths but not the per-document
  # offsets of a packed row, nor returns the log-normaliser; the cuDNN wrapper underneath does.
  # JAX is pinned, so this private import is checked by the GPU test whenever the pin moves.
  from jax._src.cudnn import fused_attention_stablehlo as cudnn_sdpa
  kw = dict(scale=scale, sliding_window_length=window or None, return_residual=lse,
            mask_type=cudnn_sdpa.MaskType.CAUSAL)
  if starts_BxM1 is not None:
    kw.update(q_seqlen=lengths_BxM, kv_seqlen=lengths_BxM, q_offsets=starts_BxM1,
              kv_offsets=starts_BxM1, mask_type=cudnn_sdpa.MaskType.PADDING_CAUSAL)
  return cudnn_sdpa.dot_product_attention(q_BxTxHxE, k_BxSxGxE, v_BxSxGxE, **kw)


def _cudnn_bwd(q_BxTxHxE, k_BxSxGxE, v_BxSxGxE, out_BxTxHxE, stats, d_out_BxTxHxE, scale,
               window, starts_BxM1=None, lengths_BxM=None):
  """The backward pass of one _cudnn call from its output and its log-normalisers `stats` (in the
  layout _cudnn returned them), without rerunning its forward: (dq, dk, dv), left unwritten
  outside the call's spans, as cuDNN's own backward rule does (the same primitive, bound as
  jax._src.cudnn's _dot_product_attention_bwd_rule binds it; the GPU test checks it)."""
  from jax._src.cudnn import fused_attention_stablehlo as cudnn_sdpa
  none = jnp.zeros(0, q_BxTxHxE.dtype)
  if starts_BxM1 is None:
    spans, mask = (none,) * 4, cudnn_sdpa.MaskType.CAUSAL
  else:
    spans = (lengths_BxM, lengths_BxM, starts_BxM1, starts_BxM1)
    mask = cudnn_sdpa.MaskType.PADDING_CAUSAL
  grads = cudnn_sdpa._dot_product_attention_bwd_p_wrapper.bind(
      q_BxTxHxE, k_BxSxGxE, v_BxSxGxE, none, *spans, none, none, stats, out_BxTxHxE,
      d_out_BxTxHxE, scale=scale, seed=42, dropout_rate=0.0, variadic_args=(False, False),
      mask_type=mask, layout=cudnn_sdpa.AttentionLayout.BTNH.value,
      sliding_window_length=window or None)
  return tuple(grads[:3])


def _lse_at_positions(lse_BMxHxT, starts_BxM, doc_BxT):
  """A packed call's log-normalisers [B * M, H, T] (by document, at offsets within it) as
  [B, T, H] at each position of document doc_BxT (its index among the call's M; others: any)."""
  b, m = starts_BxM.shape
  t = doc_BxT.shape[1]
  lse_BxMxHxT = lse_BMxHxT.reshape(b, m, -1, t)
  doc_BxT = jnp.clip(doc_BxT, 0, m - 1)
  start_BxT = jnp.take_along_axis(starts_BxM, doc_BxT, axis=1)
  local_BxT = jnp.clip(jnp.arange(t)[None] - start_BxT, 0, t - 1)
  return lse_BxMxHxT[jnp.arange(b)[:, None], doc_BxT, :, local_BxT]


def _lse_in_call_layout(lse_BxTxH, starts_BxM):
  """Log-normalisers [B, T, H] by position as a packed call returns them, [B * M, H, T]: document
  j of row b at [b * M + j, :, u] for its position start + u (the inverse of _lse_at_positions;
  entries past a document's end, and absent documents, hold any value: cuDNN reads none)."""
  b, m = starts_BxM.shape
  t = lse_BxTxH.shape[1]
  idx_BxMxTx1 = jnp.clip(starts_BxM[:, :, None, None] + jnp.arange(t)[None, None, :, None], 0,
                         t - 1)
  lse_BxMxTxH = jnp.take_along_axis(lse_BxTxH[:, None], idx_BxMxTx1, axis=2)
  return lse_BxMxTxH.transpose(0, 1, 3, 2).reshape(b * m, -1, t)


def _calls(segment_ids_BxT: jax.Array, max_documents: int, docs_per_call: int | None):
  """The cuDNN calls over a batch of rows, each (mine_BxT: the positions of its documents,
  doc_BxT: a position's document among the call's, starts_BxM1, lengths_BxM: the call's spans);
  one call over whole rows (spans None) where max_documents is 1."""
  b, t = segment_ids_BxT.shape
  if max_documents == 1:
    # One document per row: plain causal attention; padding sits after it, so no real query
    # reaches a padding key.
    return [(segment_ids_BxT != 0, None, None, None)]
  m = docs_per_call or documents_per_call(b, t, max_documents)
  starts_BxM1, lengths_BxM = document_spans(segment_ids_BxT, max_documents)
  calls = []
  for i in range(-(-max_documents // m)):
    doc_BxT = segment_ids_BxT - 1 - i * m  # padding (segment 0): < 0, in no call
    starts_BxM = starts_BxM1[:, :-1][:, i * m:(i + 1) * m]
    calls.append(((doc_BxT >= 0) & (doc_BxT < m), doc_BxT,
                  jnp.concatenate([starts_BxM, jnp.full((b, 1), -1, jnp.int32)], axis=1),
                  lengths_BxM[:, i * m:(i + 1) * m]))
  return calls


def _cudnn_rows(q_BxTxHxE, k_BxSxGxE, v_BxSxGxE, segment_ids_BxT, max_documents: int,
                docs_per_call: int | None, window: int, lse: bool):
  """attention_cudnn's forward without sinks: (out [B, T, H, E], log-normalisers [B, T, H] or
  None), each position's from its call (out zeros at padding; lse zeros at padding of packed
  rows, the causal call's own at padding of whole rows)."""
  b, t, h, e = q_BxTxHxE.shape
  scale = 1.0 / math.sqrt(e)
  out_BxTxHxE = jnp.zeros_like(q_BxTxHxE)
  lse_BxTxH = jnp.zeros((b, t, h), jnp.float32) if lse else None
  for mine_BxT, doc_BxT, starts_BxM1, lengths_BxM in _calls(segment_ids_BxT, max_documents,
                                                           docs_per_call):
    out = _cudnn(q_BxTxHxE, k_BxSxGxE, v_BxSxGxE, scale, window, lse, starts_BxM1, lengths_BxM)
    out_BxTxHxE = jnp.where(mine_BxT[:, :, None, None], out[0] if lse else out, out_BxTxHxE)
    if lse and starts_BxM1 is None:
      # Whole rows: every position's own, padding's too. The backward call reads every row, and
      # a padding query's probabilities exp(score - lse) must stay <= 1: with 0 for its lse
      # they overflow, and inf * 0 reaches the real keys' gradients as NaN.
      lse_BxTxH = out[1].swapaxes(1, 2)
    elif lse:
      lse_i = _lse_at_positions(out[1], starts_BxM1[:, :-1], doc_BxT)
      lse_BxTxH = jnp.where(mine_BxT[:, :, None], lse_i, lse_BxTxH)
  return out_BxTxHxE.astype(q_BxTxHxE.dtype), lse_BxTxH


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _cudnn_kept(q_BxTxHxE, k_BxSxGxE, v_BxSxGxE, segment_ids_BxT, max_documents, docs_per_call,
                window):
  """attention_cudnn without sinks. Its backward pass reads the merged output and
  log-normalisers (named for the remat policies), never each call's own."""
  return _cudnn_rows(q_BxTxHxE, k_BxSxGxE, v_BxSxGxE, segment_ids_BxT, max_documents,
                     docs_per_call, window, lse=False)[0]


def _cudnn_kept_fwd(q_BxTxHxE, k_BxSxGxE, v_BxSxGxE, segment_ids_BxT, max_documents,
                    docs_per_call, window):
  out_BxTxHxE, lse_BxTxH = _cudnn_rows(q_BxTxHxE, k_BxSxGxE, v_BxSxGxE, segment_ids_BxT,
                                       max_documents, docs_per_call, window, lse=True)
  out_BxTxHxE = remat.name(out_BxTxHxE, "attention")
  lse_BxTxH = remat.name(lse_BxTxH, "attention_lse")
  return out_BxTxHxE, (q_BxTxHxE, k_BxSxGxE, v_BxSxGxE, segment_ids_BxT, out_BxTxHxE, lse_BxTxH)


def _cudnn_kept_bwd(max_documents, docs_per_call, window, residuals, d_out_BxTxHxE):
  q_BxTxHxE, k_BxSxGxE, v_BxSxGxE, segment_ids_BxT, out_BxTxHxE, lse_BxTxH = residuals
  scale = 1.0 / math.sqrt(q_BxTxHxE.shape[-1])
  grads = [jnp.zeros_like(x) for x in (q_BxTxHxE, k_BxSxGxE, v_BxSxGxE)]
  for mine_BxT, _, starts_BxM1, lengths_BxM in _calls(segment_ids_BxT, max_documents,
                                                     docs_per_call):
    if starts_BxM1 is None:  # whole rows: padding's output is a zero, its cotangent dropped
      stats = lse_BxTxH.swapaxes(1, 2)
      d_out_i = jnp.where(mine_BxT[:, :, None, None], d_out_BxTxHxE, 0).astype(d_out_BxTxHxE.dtype)
    else:  # a packed call reads the output and its cotangent only inside its spans
      stats, d_out_i = _lse_in_call_layout(lse_BxTxH, starts_BxM1[:, :-1]), d_out_BxTxHxE
    call = _cudnn_bwd(q_BxTxHxE, k_BxSxGxE, v_BxSxGxE, out_BxTxHxE, stats, d_out_i, scale,
                      window, starts_BxM1, lengths_BxM)
    # cuDNN leaves the gradients outside the call's documents unwritten: they are dropped.
    grads = [jnp.where(mine_BxT[:, :, None, None], g_i, g) for g_i, g in zip(call, grads)]
  return (*grads, None)


_cudnn_kept.defvjp(_cudnn_kept_fwd, _cudnn_kept_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _cudnn_sinks(q_BxTxHxE, k_BxSxGxE, v_BxSxGxE, segment_ids_BxT, sinks_H, max_documents,
                 docs_per_call, window):
  """Attention with sinks from cuDNN's: a sink adds exp(s_h) to the softmax's denominator, so
  out = cuDNN's out * sigmoid(lse - s_h), lse its log-normaliser. Gradients: the einsum
  reference's (cuDNN's backward takes no cotangent of lse), recomputed in the backward pass."""
  out_BxTxHxE, lse_BxTxH = _cudnn_rows(q_BxTxHxE, k_BxSxGxE, v_BxSxGxE, segment_ids_BxT,
                                       max_documents, docs_per_call, window, lse=True)
  keep_BxTxH = jax.nn.sigmoid(lse_BxTxH - sinks_H.astype(jnp.float32)[None, None])
  return (out_BxTxHxE.astype(jnp.float32) * keep_BxTxH[..., None]).astype(q_BxTxHxE.dtype)


def _cudnn_sinks_fwd(q_BxTxHxE, k_BxSxGxE, v_BxSxGxE, segment_ids_BxT, sinks_H, max_documents,
                     docs_per_call, window):
  out = _cudnn_sinks(q_BxTxHxE, k_BxSxGxE, v_BxSxGxE, segment_ids_BxT, sinks_H, max_documents,
                     docs_per_call, window)
  return out, (q_BxTxHxE, k_BxSxGxE, v_BxSxGxE, segment_ids_BxT, sinks_H)


def _cudnn_sinks_bwd(max_documents, docs_per_call, window, residuals, d_out):
  q_BxTxHxE, k_BxSxGxE, v_BxSxGxE, segment_ids_BxT, sinks_H = residuals
  _, vjp = jax.vjp(lambda q, k, v, sinks: attention_einsum(q, k, v, segment_ids_BxT, sinks,
                                                           window),
                   q_BxTxHxE, k_BxSxGxE, v_BxSxGxE, sinks_H)
  dq, dk, dv, dsinks = vjp(d_out)
  return dq, dk, dv, None, dsinks


_cudnn_sinks.defvjp(_cudnn_sinks_fwd, _cudnn_sinks_bwd)


def attention_cudnn(q_BxTxHxE: jax.Array, k_BxSxGxE: jax.Array, v_BxSxGxE: jax.Array,
                    segment_ids_BxT: jax.Array, max_documents: int,
                    docs_per_call: int | None = None, sinks_H: jax.Array | None = None,
                    window: int = 0) -> jax.Array:
  """cuDNN flash attention, documents passed as offsets and lengths (GPU, bf16/fp16).

  The M documents of a row go to cuDNN in calls of docs_per_call (default documents_per_call)
  each; a call's output and gradients count only at its own documents' positions. window: cuDNN's
  sliding window; sinks_H: from the call's log-normalisers (_cudnn_sinks).
  """
  if sinks_H is not None:
    return _cudnn_sinks(q_BxTxHxE, k_BxSxGxE, v_BxSxGxE, segment_ids_BxT, sinks_H,
                        max_documents, docs_per_call, window)
  return _cudnn_kept(q_BxTxHxE, k_BxSxGxE, v_BxSxGxE, segment_ids_BxT, max_documents,
                     docs_per_call, window)


def cudnn_applies(q_BxTxHxE: jax.Array) -> bool:
  # cuDNN's flash attention: half precision, head dim a multiple of 8 and at most 128.
  e = q_BxTxHxE.shape[-1]
  return (q_BxTxHxE.dtype in (jnp.bfloat16, jnp.float16) and e <= 128 and e % 8 == 0
          and jax.default_backend() == "gpu")


def attention(q_BxTxHxE: jax.Array, k_BxSxGxE: jax.Array, v_BxSxGxE: jax.Array,
              segment_ids_BxT: jax.Array, impl: str = "auto",
              max_documents: int | None = None, sinks_H: jax.Array | None = None,
              window: int = 0) -> jax.Array:
  """Causal, document-masked grouped-query attention (see the module docstring).

  impl: "einsum" (reference), "cudnn" (GPU) or "auto" (cudnn where it applies, else einsum).
  max_documents: M, a static bound on the segment ids of every row (documents_bound of the host
  batch); the cudnn path needs it, the reference ignores it.
  sinks_H: per-head sink logits (gpt-oss), or None. window: a static sliding window in keys
  (0: none).
  """
  if impl == "auto":
    impl = "cudnn" if cudnn_applies(q_BxTxHxE) else "einsum"
  if impl == "einsum":
    return attention_einsum(q_BxTxHxE, k_BxSxGxE, v_BxSxGxE, segment_ids_BxT, sinks_H, window)
  if max_documents is None:
    raise ValueError("cuDNN attention needs max_documents, a bound on the documents per row: "
                     "pass kdjax.models.documents.documents_bound(segment_ids) of the host batch.")
  return attention_cudnn(q_BxTxHxE, k_BxSxGxE, v_BxSxGxE, segment_ids_BxT, max_documents,
                         sinks_H=sinks_H, window=window)
