"""Chunked fused loss in plain XLA: a scan over position chunks, gradients computed in forward.

Per chunk of C positions: logits z = h_c W ([C, V] float32), then ONE pass over z (`exp_pass`)
that returns the row sums of exp(z / tau - shift) and writes E = exp(z / tau - shift) rounded to
the matmul dtype, for a per-row shift fixed before the pass. The dense part of dL/dz is then
a * softmax(z / tau) = (a / sum) * E: a per-row scale r, which the gradient matmuls absorb for
free, dh_c = r * (E W^T) and dW += (r * h_c)^T E, so no second pass over z is needed to
normalise. The K (+1) exact entries at the top-k ids and label are scattered into E divided by
r. Three [C, D] x [D, V]-sized matmuls per chunk, the work floor; a custom_vjp hands the
precomputed gradients to the backward pass, which only scales them by the incoming cotangent.
Without differentiation only the forward projection and the sums run.

The shift is the largest student logit among the chunk's top-k ids and label, known before the
pass (it is gathered from z). An exp_pass must shift a row by its own maximum instead when the
row's maximum exceeds the given shift by more than SHIFT_LIMIT (in units of z / tau), which
keeps E <= e^SHIFT_LIMIT and the sums within [1, V e^SHIFT_LIMIT]. CE at tau != 1 needs two
softmaxes in dL/dz: there the pass only sums and a second pass (`dense_grad`) writes dL/dz.

Chunks never pad the big arrays: chunk i starts at min(i * C, N - C), so the last chunk overlaps
the previous one and its already-counted rows get weight 0 (and keep their dh); default_chunk
picks C to keep that overlap small. The same driver serves impls "pallas" (kernels.fused) and
"pallas_exact" (kernels.pallas_exact), which swap in their own `project`.

Why no jax.checkpoint option: rematerialising instead (a checkpointed scan that recomputes each
chunk's logits in the backward pass) would cost a fourth matmul per chunk and save nothing, since
the forward's residuals here are dh and dW, which the step needs anyway (BENCHMARKS.md, loss
head section, compares impl "paper", which recomputes in the backward pass the paper's way).

Shape letters: N positions, C chunk, D model width, V vocabulary, K cached entries, J entries
scattered per row (K, or K + 1 with the label).
"""
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from kdjax.kernels import objectives

# Per chunk the working set is the [C, V] float32 logits plus E in the matmul dtype, 6 * C * V
# bytes. It gets at least MIN_WORKING_SET_BYTES, or a fifth of the memory the loss cannot avoid
# (hidden, lm_head and their gradients) when that is more: longer sequences get larger chunks,
# which cost proportionally less dW read-modify-write traffic (dW += h_c^T dz per chunk).
MIN_WORKING_SET_BYTES = 768 * 2**20
WORKING_SET_SHARE = 0.2
MAX_CHUNK = 8192
# A chunk's fixed cost in rows' worth of matmul time: the read-modify-write of dW (2 |dW| bytes
# per chunk) against 6 D V flops per row, ~130 rows on an H200 for a bf16 dW (BENCHMARKS.md).
CHUNK_COST_ROWS = 128

# See the module docstring: the most a row's maximum may exceed its shift, in units of z / tau.
SHIFT_LIMIT = 16.0

# A dense coefficient smaller than this fraction of the row's largest exact entry is raised to
# it (same sign), so 1 / r stays finite; the dense part then errs by < 1e-6 of the row's scale.
COEF_FLOOR = 1e-6


def default_chunk(num_rows: int, dim: int, vocab: int, dtype, spec=None, entry_bytes: int = 6,
                  share: float = WORKING_SET_SHARE, max_chunk: int = MAX_CHUNK,
                  multiple: int = 1) -> int:
  """Chunk size C (a multiple of `multiple`) for a working set of entry_bytes per [C, V]
  element: all N rows if they fit the budget, else the multiple of 128 (matmul tiles) and of
  `multiple` within it, and at most N, that costs least in ceil(N / C) * (C + CHUNK_COST_ROWS):
  rows computed (the last chunk overlaps the one before) plus each chunk's fixed cost; `multiple`
  when N is smaller. spec: unused here (kernels may size by it)."""
  del spec
  unavoidable = 2 * jnp.dtype(dtype).itemsize * (num_rows * dim + dim * vocab)
  budget = max(MIN_WORKING_SET_BYTES, share * unavoidable)
  step = max(multiple, 128)
  largest = max(min(int(budget // (entry_bytes * vocab)), max_chunk), step)
  if num_rows <= largest and num_rows % multiple == 0:
    return num_rows
  sizes = range(min(largest, num_rows) // step * step, 0, -step)
  if not sizes:
    return multiple
  return min(sizes, key=lambda c: -(-num_rows // c) * (c + CHUNK_COST_ROWS))


def softmax_scales(spec: objectives.LossSpec) -> tuple:
  """Multipliers of z whose softmax normalisers the loss needs: 1 / tau, and 1 for CE at tau != 1."""
  return (1.0 / spec.temperature, 1.0) if spec.two_softmax else (1.0 / spec.temperature,)


def writes_dense(spec: objectives.LossSpec) -> bool:
  """Whether dL/dz's dense part is one softmax, so exp_pass can write it (see module doc)."""
  return not (spec.two_softmax and spec.ce_weight != 0.0)


def xla_exp_pass(logits_CxV, hint_C, scales, dtype, stats=False):
  """exp_pass in plain XLA, shifting every row by its exact maximum (z is read twice).

  Returns (E [C, V] in dtype or None if dtype is None, sums per scale [C], shift [C], extra):
  sums[j] = sum_V exp((z - shift) * scales[j]), E = exp((z - shift) * scales[0]); extra None, or
  with stats (the row maximum of z, sum_V exp(x) * x for x = (z - shift) * scales[0]).
  """
  del hint_C
  shift_C = jnp.max(logits_CxV, axis=-1)
  x_CxV = logits_CxV - shift_C[:, None]
  sums = tuple(jnp.sum(jnp.exp(x_CxV * s), axis=-1) for s in scales)
  e_CxV = None if dtype is None else jnp.exp(x_CxV * scales[0]).astype(dtype)
  extra = None
  if stats:
    x0_CxV = x_CxV * scales[0]
    extra = (shift_C, jnp.sum(jnp.exp(x0_CxV) * x0_CxV, axis=-1))
  return e_CxV, sums, shift_C, extra


def normalisers(sums, shift_C, spec):
  """(logsumexp(z / tau), logsumexp(z)) from an exp_pass's sums and shift."""
  lse_s_C = shift_C / spec.temperature + jnp.log(sums[0])
  lse_z_C = shift_C + jnp.log(sums[1]) if spec.two_softmax else lse_s_C
  return lse_s_C, lse_z_C


def xla_dense_grad(logits_CxV, lse_s_C, lse_z_C, a_C, b_C, spec, dtype):
  """a * softmax(z / tau) + b * softmax(z), computed in float32 and rounded once to dtype."""
  if not spec.two_softmax:
    a_C = a_C + b_C
  dz_CxV = a_C[:, None] * jnp.exp(logits_CxV / spec.temperature - lse_s_C[:, None])
  if spec.two_softmax and spec.ce_weight != 0.0:
    dz_CxV = dz_CxV + b_C[:, None] * jnp.exp(logits_CxV - lse_z_C[:, None])
  return dz_CxV.astype(dtype)


def chunk_start(i, num_rows, chunk):
  start = jnp.minimum(i * chunk, num_rows - chunk)
  fresh_C = start + jnp.arange(chunk) >= i * chunk
  return start, fresh_C


def gather_rows(logits_CxV, ids_CxK, labels_C):
  """z at the ids and labels; an id of -1 (another shard's, see local_ids) reads column 0."""
  zk_CxK = jnp.take_along_axis(logits_CxV, jnp.maximum(ids_CxK, 0), axis=-1)
  zl_C = jnp.take_along_axis(logits_CxV, jnp.maximum(labels_C, 0)[:, None], axis=-1)[:, 0]
  return zk_CxK, zl_C


def local_ids(ids, offset, width: int):
  """Vocabulary ids as columns of the shard [offset, offset + width), -1 where outside it."""
  local = ids - offset
  return jnp.where((local >= 0) & (local < width), local, -1)


def combine_shards(axis, ids_CxK, labels_C, sums, shift_C, zk_CxK, zl_C, extra, spec):
  """A vocabulary-sharded chunk's statistics over the whole vocabulary (the paper's
  tensor-parallel loss): each shard's sums, taken against its own shift, rescaled to the largest
  shift of any shard and summed; the top-k and label logits from the shard that holds them (ids
  local, -1 elsewhere). Returns (sums, shift, zk, zl, extra) as a project over all shards would."""
  psum = lambda x: jax.lax.psum(x, axis)
  zk_CxK = psum(jnp.where(ids_CxK >= 0, zk_CxK, 0.0))
  zl_C = psum(jnp.where(labels_C >= 0, zl_C, 0.0))
  top_shift_C = jax.lax.pmax(shift_C, axis)
  gaps = [(shift_C - top_shift_C) * s for s in softmax_scales(spec)]  # <= 0
  out_sums = tuple(psum(s_C * jnp.exp(gap_C)) for s_C, gap_C in zip(sums, gaps))
  if extra is not None:  # sum exp(x) x against the new shift: e^g (sum exp(x) x + g sum exp(x))
    top_C, xex_C, slack = extra
    extra = (jax.lax.pmax(top_C, axis), psum(jnp.exp(gaps[0]) * (xex_C + gaps[0] * sums[0])),
             slack)
  return out_sums, top_shift_C, zk_CxK, zl_C, extra


def logits_project(exp_pass: Callable) -> Callable:
  """A chunk's projection with its float32 logits materialised: XLA's matmul, the top-k and
  label logits gathered from it (exact), then one exp_pass over it shifted by their maximum.

  project(h [C, D], W [D, V], ids [C, K], labels [C], spec, dtype, stats=False)
      -> (logits [C, V] or None, E or None, sums, shift [C], zk [C, K], zl [C], extra)
  with E = exp((z - shift) / tau) in dtype (None if dtype is None), sums per softmax_scales and
  extra = None or, with stats, (the row maximum of z, sum_V exp(x) * x for x = (z - shift) / tau,
  the most zk may lie below its exact value: 0 here), for per-position statistics.
  """

  def project(hidden_CxD, lm_head_DxV, ids_CxK, labels_C, spec, dtype, stats=False):
    logits_CxV = jnp.einsum("cd,dv->cv", hidden_CxD, lm_head_DxV,
                            preferred_element_type=jnp.float32)
    zk_CxK, zl_C = gather_rows(logits_CxV, ids_CxK, labels_C)
    hint_C = jnp.max(zk_CxK, axis=-1)
    if spec.has_labels:
      hint_C = jnp.maximum(hint_C, zl_C)
    e_CxV, sums, shift_C, extra = exp_pass(logits_CxV, hint_C, softmax_scales(spec), dtype,
                                           stats)
    extra = extra + (0.0,) if stats else None
    return logits_CxV, e_CxV, sums, shift_C, zk_CxK, zl_C, extra

  return project


def chunk_terms(hidden_CxD, lm_head_DxV, ids_CxK, logp_CxK, labels_C, spec, project, dtype,
                stats=False, axis=None):
  """One chunk's projection (a `project` as from logits_project) and its loss terms.

  dtype: the matmul dtype if E is wanted (gradients with a one-softmax dense part), else None.
  axis: None, or the shard_map axis lm_head's vocabulary is split over (ids and labels then
  local_ids; the statistics combined over it, combine_shards).
  Returns (logits or None, E or None, sums, gathered (zk, zl, lse_s, lse_z), terms); with stats
  terms also holds the per-position "entropy" and "top1" (see position_terms). sums: this
  shard's (sum_V exp((z - shift) / tau) against its own shift, and E's divisor towards
  softmax(z / tau), sum * exp((shift of all shards - own shift) / tau)).
  """
  logits_CxV, e_CxV, sums, shift_C, zk_CxK, zl_C, extra = project(
      hidden_CxD, lm_head_DxV, ids_CxK, labels_C, spec, dtype, stats)
  own_sum_C, divisor_C = sums[0], sums[0]
  if axis is not None:
    own_shift_C = shift_C
    sums, shift_C, zk_CxK, zl_C, extra = combine_shards(axis, ids_CxK, labels_C, sums, shift_C,
                                                        zk_CxK, zl_C, extra, spec)
    divisor_C = sums[0] * jnp.exp((shift_C - own_shift_C) / spec.temperature)
  lse_s_C, lse_z_C = normalisers(sums, shift_C, spec)
  terms = objectives.row_terms(zk_CxK, zl_C, lse_s_C, lse_z_C, logp_CxK, spec)
  if stats:
    terms.update(position_terms(sums[0], extra, zk_CxK, logp_CxK))
  return (logits_CxV, e_CxV, (own_sum_C, divisor_C), (zk_CxK, zl_C, lse_s_C, lse_z_C), terms)


def position_terms(sum_C, extra, zk_CxK, logp_CxK):
  """Per-position statistics from what the projection already computed (no extra pass):
  entropy of the student softmax at temperature tau, log S - sum(exp(x) x) / S for
  S = sum(exp(x)), x = (z - shift) / tau; top1: whether the student's largest logit is the
  teacher's most probable cached id, counted when zk is within the project's read-back error
  (slack, either way) of the maximum: a true agreement always counts, and a near-tie up to
  2 * slack short of it may."""
  top_C, xex_C, slack = extra
  teacher_top_C = jnp.argmax(logp_CxK, axis=-1)
  z_top_C = jnp.take_along_axis(zk_CxK, teacher_top_C[:, None], axis=-1)[:, 0]
  return dict(entropy=jnp.log(sum_C) - xex_C / sum_C, top1=z_top_C + slack >= top_C)


def row_scale(coef_C, sums, vals_CxJ):
  """r = coef / divisor (see module doc; sums as chunk_terms returns them), kept away from 0 by
  COEF_FLOOR: |r| * own sum, what E's rows add up to, at least COEF_FLOOR times the row's
  largest exact entry; 0 on rows whose coefficient and exact entries are all 0 (masked rows).
  (Of a vocabulary shard far below the others' maxima r would underflow: floored, its E adds
  at most that much.)"""
  own_sum_C, divisor_C = sums
  floor_C = COEF_FLOOR * jnp.max(jnp.abs(vals_CxJ), axis=-1) / own_sum_C
  r_C = coef_C / divisor_C
  return jnp.where(jnp.abs(r_C) < floor_C, jnp.where(coef_C < 0, -floor_C, floor_C), r_C)


def scatter_entries(dense_CxV, scale_C, ent_ids_CxJ, ent_vals_CxJ):
  """dL/dz / scale in dense's dtype: the dense part (already divided by scale) with the exact
  entries (objectives.sparse_entries) divided by scale and set over it; ids of -1 dropped."""
  safe_C = jnp.where(scale_C == 0, 1.0, scale_C)
  ent_vals_CxJ = jnp.where(scale_C[:, None] == 0, 0.0, ent_vals_CxJ / safe_C[:, None])
  rows_CxJ = jnp.broadcast_to(jnp.arange(dense_CxV.shape[0])[:, None], ent_ids_CxJ.shape)
  ent_ids_CxJ = jnp.where(ent_ids_CxJ < 0, dense_CxV.shape[1], ent_ids_CxJ)
  return dense_CxV.at[rows_CxJ, ent_ids_CxJ].set(ent_vals_CxJ.astype(dense_CxV.dtype),
                                                 mode="drop")


def chunk_dlogits(logits_CxV, e_CxV, sums, gathered, terms, ids_CxK, labels_C, w_C, spec, dtype,
                  dense_grad, offset=0):
  """(dL/dz / r in dtype, r [C]) for one chunk: dL/dz = r * the returned matrix, row by row.
  ids and labels: vocabulary ids; of a vocabulary shard, its columns start at `offset`."""
  a_C, b_C = terms["a"] * w_C, terms["b"] * w_C
  ent_ids_CxJ, ent_vals_CxJ = objectives.sparse_entries(ids_CxK, labels_C, *gathered, terms, w_C,
                                                        spec)
  width = (logits_CxV if e_CxV is None else e_CxV).shape[1]
  ent_ids_CxJ = local_ids(ent_ids_CxJ, offset, width)
  if e_CxV is None:  # two softmaxes: a second pass writes dL/dz itself
    _, _, lse_s_C, lse_z_C = gathered
    dense_CxV = dense_grad(logits_CxV, lse_s_C, lse_z_C, a_C, b_C, spec, dtype)
    scale_C = jnp.ones_like(a_C)
  else:
    dense_CxV, scale_C = e_CxV, row_scale(a_C + b_C, sums, ent_vals_CxJ)
  return scatter_entries(dense_CxV, scale_C, ent_ids_CxJ, ent_vals_CxJ), scale_C


def accumulate_dw(dw_DxV, hidden_CxD, dz_CxV):
  """dW += h^T dz in dW's dtype: XLA folds the add into the matmul (cuBLAS beta = 1, in place),
  which accumulates in float32 and rounds the sum once per chunk if dW is bf16."""
  return dw_DxV + jnp.einsum("cd,cv->dv", hidden_CxD, dz_CxV,
                             preferred_element_type=dw_DxV.dtype)


POSITION_TERMS = ("kl", "ce", "entropy", "top1")


def zero_positions(num_rows: int) -> tuple:
  """The per-position terms of num_rows positions, zeroed (top1 False), in POSITION_TERMS order."""
  return tuple(jnp.zeros((num_rows,), bool if name == "top1" else jnp.float32)
               for name in POSITION_TERMS)


def chunked_loss(hidden_NxD, lm_head_DxV, ids_NxK, logp_NxK, w_N, labels_N, spec, chunk,
                 dw_dtype, project, dense_grad, with_grads, per_position=False, axis=None):
  """Scan over chunks. Returns (kl_sum, ce_sum) weighted by w, the per-position terms (a tuple
  of [N] arrays in POSITION_TERMS order, empty unless per_position), plus (dh, dW) if
  with_grads; dW in dw_dtype.

  axis: None, or the shard_map axis whose i-th device holds lm_head's vocabulary columns
  [i * V, (i + 1) * V) (ids and labels are global): the kernels run on the shard and the
  statistics are combined across it per chunk (combine_shards); every shard returns the same
  loss terms, its share of dh (its columns' part: summed over the axis it is dh) and its dW."""
  num_rows, _ = hidden_NxD.shape
  vocab = lm_head_DxV.shape[1]
  offset = 0 if axis is None else jax.lax.axis_index(axis) * vocab
  dtype = jnp.promote_types(hidden_NxD.dtype, lm_head_DxV.dtype)
  take = lambda x, start: jax.lax.dynamic_slice_in_dim(x, start, chunk, axis=0)
  e_dtype = dtype if with_grads and writes_dense(spec) else None

  def body(carry, i):
    start, fresh_C = chunk_start(i, num_rows, chunk)
    h_CxD = take(hidden_NxD, start)
    ids_CxK, labels_C = take(ids_NxK, start), take(labels_N, start)
    w_C = jnp.where(fresh_C, take(w_N, start), 0.0)
    logits_CxV, e_CxV, sums, gathered, terms = chunk_terms(
        h_CxD, lm_head_DxV, local_ids(ids_CxK, offset, vocab), take(logp_NxK, start),
        local_ids(labels_C, offset, vocab), spec, project, e_dtype, per_position, axis)
    kl, ce = jnp.sum(w_C * terms["kl"]), jnp.sum(w_C * terms["ce"])
    # Overlapping rows of the last chunk get identical values again: a plain overwrite.
    positions = tuple(jax.lax.dynamic_update_slice_in_dim(x_N, terms[name].astype(x_N.dtype),
                                                          start, axis=0)
                      for name, x_N in zip(POSITION_TERMS, carry[2]))
    if not with_grads:
      return (carry[0] + kl, carry[1] + ce, positions), None
    kl_sum, ce_sum, _, dh_NxD, dw_DxV = carry
    dz_CxV, scale_C = chunk_dlogits(logits_CxV, e_CxV, sums, gathered, terms, ids_CxK, labels_C,
                                    w_C, spec, dtype, dense_grad, offset)
    dh_CxD = scale_C[:, None] * jnp.einsum("cv,dv->cd", dz_CxV, lm_head_DxV.astype(dtype),
                                           preferred_element_type=jnp.float32)
    dh_CxD = jnp.where(fresh_C[:, None], dh_CxD.astype(dh_NxD.dtype), take(dh_NxD, start))
    dh_NxD = jax.lax.dynamic_update_slice_in_dim(dh_NxD, dh_CxD, start, axis=0)
    scaled_h_CxD = (scale_C[:, None] * h_CxD.astype(jnp.float32)).astype(dtype)
    dw_DxV = accumulate_dw(dw_DxV, scaled_h_CxD, dz_CxV)
    return (kl_sum + kl, ce_sum + ce, positions, dh_NxD, dw_DxV), None

  zero = jnp.zeros((), jnp.float32)
  positions = zero_positions(num_rows) if per_position else ()
  carry = (zero, zero, positions)
  if with_grads:
    carry += (jnp.zeros_like(hidden_NxD), jnp.zeros(lm_head_DxV.shape, dw_dtype))
  carry, _ = jax.lax.scan(body, carry, jnp.arange(-(-num_rows // chunk)))
  return carry


def build_fused_loss(project: Callable, dense_grad: Callable):
  """custom_vjp loss (h, W, ids, logp, w, labels, spec, chunk, dw_dtype, per_position, axis)
  -> (loss, kl, ce, positions): positions as chunked_loss returns them (no gradient).

  dw_dtype: the dtype dW is accumulated in across chunks (None: lm_head's); returned in
  lm_head's dtype.

  axis: see chunked_loss; for shard_map(check_vma=False) with hidden replicated over it. There
  a replicated output's cotangent reaches each of the n devices as 1/n of it and a replicated
  input's cotangent is summed over them: so bwd sums the loss's cotangent over the axis and
  returns each device's share of dh, which shard_map's sum completes.
  """

  @functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
  def loss(hidden_NxD, lm_head_DxV, ids_NxK, logp_NxK, w_N, labels_N, spec, chunk, dw_dtype,
           per_position, axis):
    kl, ce, positions = chunked_loss(hidden_NxD, lm_head_DxV, ids_NxK, logp_NxK, w_N, labels_N,
                                     spec, chunk, dw_dtype, project, dense_grad,
                                     with_grads=False, per_position=per_position, axis=axis)
    return kl + spec.ce_weight * ce, kl, ce, positions

  def fwd(hidden_NxD, lm_head_DxV, ids_NxK, logp_NxK, w_N, labels_N, spec, chunk, dw_dtype,
          per_position, axis):
    kl, ce, positions, dh_NxD, dw_DxV = chunked_loss(
        hidden_NxD, lm_head_DxV, ids_NxK, logp_NxK, w_N, labels_N, spec, chunk,
        dw_dtype or lm_head_DxV.dtype, project, dense_grad, with_grads=True,
        per_position=per_position, axis=axis)
    # An empty array carries lm_head's dtype to bwd (residuals must be arrays).
    dtype_tag = jnp.zeros((0,), lm_head_DxV.dtype)
    return (kl + spec.ce_weight * ce, kl, ce, positions), (dh_NxD, dw_DxV, dtype_tag)

  def bwd(spec, chunk, dw_dtype, per_position, axis, residuals, cotangents):
    dh_NxD, dw_DxV, dtype_tag = residuals
    g = cotangents[0]  # kl, ce and the positions are logged values: their cotangents are ignored
    if axis is not None:
      g = jax.lax.psum(g, axis)
    scale = lambda x, dtype: (x.astype(jnp.float32) * g).astype(dtype)
    return scale(dh_NxD, dh_NxD.dtype), scale(dw_DxV, dtype_tag.dtype), None, None, None, None

  loss.defvjp(fwd, bwd)
  return loss


topk_kl_loss = build_fused_loss(logits_project(xla_exp_pass), xla_dense_grad)
