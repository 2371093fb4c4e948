"""The chunked fused loss: a scan over position chunks, gradients computed in forward.

Per chunk of C positions a `project` (projection.py) computes the logits z = h_c W and ONE exp
pass over them, which returns the row sums of exp(z / tau - shift) and writes
E = exp(z / tau - shift) rounded to the matmul dtype. The dense part of dL/dz is then
a * softmax(z / tau) = (a / sum) * E: a per-row scale r, which the gradient matmuls absorb for
free, dh_c = r * (E W^T) and dW += (r * h_c)^T E, so no second pass over z is needed to
normalise. The K (+1) exact entries at the top-k ids and label are scattered into E divided by
r. Three [C, D] x [D, V]-sized matmuls per chunk, the work floor; a custom_vjp hands the
precomputed gradients to the backward pass, which only scales them by the incoming cotangent.
Without differentiation only the forward projection and the sums run. CE at tau != 1 needs two
softmaxes in dL/dz: there the pass only sums and a second pass (`dense_grad`) writes dL/dz.

Chunks never pad the big arrays: chunk i starts at min(i * C, N - C), so the last chunk overlaps
the previous one and its already-counted rows get weight 0 (and keep their dh); default_chunk
picks C to keep that overlap small. The driver takes a `project` and a `dense_grad`: impl "xla"
is it with the passes' XLA references (`xla_loss`), impl "pallas_exact" with their Pallas
kernels (`exact_loss`), impl "pallas" (fused.py) with the logits matmul and exp fused into one
kernel.

Why no jax.checkpoint option: rematerialising instead (a checkpointed scan that recomputes each
chunk's logits in the backward pass) would cost a fourth matmul per chunk and save nothing, since
the forward's residuals here are dh and dW, which the step needs anyway (BENCHMARKS.md, loss
head section, compares impl "paper", which recomputes in the backward pass the paper's way).

Shape letters: N positions, C chunk, D model width, V vocabulary, K cached entries, J entries
scattered per row (K, or K + 1 with the label).
"""
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from kdjax.kernels import logit_passes
from kdjax.loss import objectives, projection

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

# A dense coefficient smaller than this fraction of the row's largest exact entry is raised to
# it (same sign), so 1 / r stays finite; the dense part then errs by < 1e-6 of the row's scale.
COEF_FLOOR = 1e-6


def default_chunk(num_rows: int, dim: int, vocab: int, dtype, spec=None, entry_bytes: int = 6,
                  share: float = WORKING_SET_SHARE, max_chunk: int | None = None,
                  multiple: int = 1) -> int:
  """Chunk size C (a multiple of `multiple`) for a working set of entry_bytes per [C, V]
  element: all N rows if they fit the budget, else the multiple of 128 (matmul tiles) and of
  `multiple` within it, and at most N, that costs least in ceil(N / C) * (C + CHUNK_COST_ROWS):
  rows computed (the last chunk overlaps the one before) plus each chunk's fixed cost; `multiple`
  when N is smaller. spec: unused here (impls may size by it). max_chunk: MAX_CHUNK (read at the
  call, so a benchmark may set it) unless given."""
  del spec
  max_chunk = MAX_CHUNK if max_chunk is None else max_chunk
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


def writes_dense(spec: objectives.LossSpec) -> bool:
  """Whether dL/dz's dense part is one softmax, so the exp pass can write it (see module doc)."""
  return not (spec.two_softmax and spec.ce_weight != 0.0)


def chunk_start(i, num_rows, chunk):
  start = jnp.minimum(i * chunk, num_rows - chunk)
  fresh_C = start + jnp.arange(chunk) >= i * chunk
  return start, fresh_C


class RowSums(NamedTuple):
  """A chunk's sums of exp((z - shift) / tau) as row_scale needs them."""
  own_C: jax.Array      # this shard's, against its own shift
  divisor_C: jax.Array  # E's divisor towards softmax(z / tau): all shards' sum, own shift


class Gathered(NamedTuple):
  """Per position: the student logits at the top-k ids and label, and the log-normalisers."""
  zk_CxK: jax.Array
  zl_C: jax.Array
  lse_s_C: jax.Array  # logsumexp(z / tau)
  lse_z_C: jax.Array  # logsumexp(z)


class ChunkTerms(NamedTuple):
  """One chunk's projection reduced to what its loss and gradient need (chunk_terms)."""
  logits_CxV: jax.Array | None
  e_CxV: jax.Array | None
  sums: RowSums | None  # None where no E is scaled (two softmaxes, impl "paper")
  gathered: Gathered
  terms: dict           # objectives.row_terms, + "entropy" and "top1" with stats


def chunk_terms(hidden_CxD, lm_head_DxV, ids_CxK, logp_CxK, labels_C, spec, project, dtype,
                stats=False, axis=None) -> ChunkTerms:
  """One chunk's projection (a `project` as from projection.logits_project) and its loss terms.

  dtype: the matmul dtype if E is wanted (gradients with a one-softmax dense part), else None.
  axis: None, or the shard_map axis lm_head's vocabulary is split over (ids and labels then
  projection.local_ids; the statistics combined over it, projection.combine_shards).
  With stats the terms also hold the per-position "entropy" and "top1" (see position_terms).
  """
  proj = project(hidden_CxD, lm_head_DxV, ids_CxK, labels_C, spec, dtype, stats)
  own_sum_C = divisor_C = proj.sums[0]
  if axis is not None:
    own_shift_C = proj.shift_C
    proj = projection.combine_shards(axis, ids_CxK, labels_C, proj, spec)
    divisor_C = proj.sums[0] * jnp.exp((proj.shift_C - own_shift_C) / spec.temperature)
  lse_s_C, lse_z_C = projection.normalisers(proj.sums, proj.shift_C, spec)
  terms = objectives.row_terms(proj.zk_CxK, proj.zl_C, lse_s_C, lse_z_C, logp_CxK, spec)
  if stats:
    terms.update(position_terms(proj.sums[0], proj.stats, proj.zk_CxK, logp_CxK))
  return ChunkTerms(proj.logits_CxV, proj.e_CxV, RowSums(own_sum_C, divisor_C),
                    Gathered(proj.zk_CxK, proj.zl_C, lse_s_C, lse_z_C), terms)


def position_terms(sum_C, stats: projection.Stats, zk_CxK, logp_CxK):
  """Per-position statistics from what the projection already computed (no extra pass):
  entropy of the student softmax at temperature tau, log S - sum(exp(x) x) / S for
  S = sum(exp(x)), x = (z - shift) / tau; top1: whether the student's largest logit is the
  teacher's most probable cached id, counted when zk is within the project's read-back error
  (slack, either way) of the maximum: a true agreement always counts, and a near-tie up to
  2 * slack short of it may."""
  top_C, xex_C, slack = stats
  teacher_top_C = jnp.argmax(logp_CxK, axis=-1)
  z_top_C = jnp.take_along_axis(zk_CxK, teacher_top_C[:, None], axis=-1)[:, 0]
  return dict(entropy=jnp.log(sum_C) - xex_C / sum_C, top1=z_top_C + slack >= top_C)


def row_scale(coef_C, sums: RowSums, vals_CxJ):
  """r = coef / divisor (see module doc), kept away from 0 by
  COEF_FLOOR: |r| * own sum, what E's rows add up to, at least COEF_FLOOR times the row's
  largest exact entry; 0 on rows whose coefficient and exact entries are all 0 (masked rows).
  (Of a vocabulary shard far below the others' maxima r would underflow: floored, its E adds
  at most that much.)"""
  floor_C = COEF_FLOOR * jnp.max(jnp.abs(vals_CxJ), axis=-1) / sums.own_C
  r_C = coef_C / sums.divisor_C
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


def chunk_dlogits(chunk: ChunkTerms, ids_CxK, labels_C, w_C, spec, dtype, dense_grad, offset=0):
  """(dL/dz / r in dtype, r [C]) for one chunk: dL/dz = r * the returned matrix, row by row.
  ids and labels: vocabulary ids; of a vocabulary shard, its columns start at `offset`."""
  terms, gathered = chunk.terms, chunk.gathered
  a_C, b_C = terms["a"] * w_C, terms["b"] * w_C
  ent_ids_CxJ, ent_vals_CxJ = objectives.sparse_entries(ids_CxK, labels_C, *gathered, terms, w_C,
                                                        spec)
  width = (chunk.logits_CxV if chunk.e_CxV is None else chunk.e_CxV).shape[1]
  ent_ids_CxJ = projection.local_ids(ent_ids_CxJ, offset, width)
  if chunk.e_CxV is None:  # two softmaxes: a second pass writes dL/dz itself
    dense_CxV = dense_grad(chunk.logits_CxV, gathered.lse_s_C, gathered.lse_z_C, a_C, b_C, spec,
                           dtype)
    scale_C = jnp.ones_like(a_C)
  else:
    dense_CxV, scale_C = chunk.e_CxV, row_scale(a_C + b_C, chunk.sums, ent_vals_CxJ)
  return scatter_entries(dense_CxV, scale_C, ent_ids_CxJ, ent_vals_CxJ), scale_C


def accumulate_dw(dw_DxV, hidden_CxD, dz_CxV):
  """dW += h^T dz in dW's dtype: XLA folds the add into the matmul (cuBLAS beta = 1, in place),
  which accumulates in float32 and rounds the sum once per chunk if dW is bf16."""
  return dw_DxV + jnp.einsum("cd,cv->dv", hidden_CxD, dz_CxV,
                             preferred_element_type=dw_DxV.dtype)


class Carry(NamedTuple):
  """The scan's carry over chunks, and chunked_loss's result."""
  kl: jax.Array                              # sum of w * the KL term so far
  ce: jax.Array                              # sum of w * CE so far
  positions: objectives.Positions | None     # [N] each; None unless per_position
  dh_NxD: jax.Array | None = None            # with_grads only
  dw_DxV: jax.Array | None = None            # with_grads only, in dw_dtype

  def loss_terms(self, spec) -> objectives.LossTerms:
    return objectives.LossTerms(self.kl + spec.ce_weight * self.ce, self.kl, self.ce,
                                self.positions)


def put_positions(positions, terms, start):
  """positions with a chunk's per-position terms written from row `start` (None stays None);
  overlapping rows of the last chunk get identical values again: a plain overwrite."""
  if positions is None:
    return None
  return objectives.Positions(*(
      jax.lax.dynamic_update_slice_in_dim(x_N, terms[name].astype(x_N.dtype), start, axis=0)
      for name, x_N in zip(objectives.Positions._fields, positions)))


def chunked_loss(hidden_NxD, lm_head_DxV, ids_NxK, logp_NxK, w_N, labels_N, spec, chunk,
                 dw_dtype, project, dense_grad, with_grads, per_position=False,
                 axis=None) -> Carry:
  """Scan over chunks: the KL and CE sums weighted by w, the per-position terms if
  per_position, and dh and dW (in dw_dtype) if with_grads.

  axis: None, or the shard_map axis whose i-th device holds lm_head's vocabulary columns
  [i * V, (i + 1) * V) (ids and labels are global): the kernels run on the shard and the
  statistics are combined across it per chunk (projection.combine_shards); every shard returns
  the same loss terms, its share of dh (its columns' part: summed over the axis it is dh) and its
  dW."""
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
    chunk_C = chunk_terms(
        h_CxD, lm_head_DxV, projection.local_ids(ids_CxK, offset, vocab), take(logp_NxK, start),
        projection.local_ids(labels_C, offset, vocab), spec, project, e_dtype, per_position, axis)
    terms = chunk_C.terms
    carry = carry._replace(kl=carry.kl + jnp.sum(w_C * terms["kl"]),
                           ce=carry.ce + jnp.sum(w_C * terms["ce"]),
                           positions=put_positions(carry.positions, terms, start))
    if not with_grads:
      return carry, None
    dz_CxV, scale_C = chunk_dlogits(chunk_C, ids_CxK, labels_C, w_C, spec, dtype, dense_grad,
                                    offset)
    dh_CxD = scale_C[:, None] * jnp.einsum("cv,dv->cd", dz_CxV, lm_head_DxV.astype(dtype),
                                           preferred_element_type=jnp.float32)
    dh_NxD = carry.dh_NxD
    dh_CxD = jnp.where(fresh_C[:, None], dh_CxD.astype(dh_NxD.dtype), take(dh_NxD, start))
    dh_NxD = jax.lax.dynamic_update_slice_in_dim(dh_NxD, dh_CxD, start, axis=0)
    scaled_h_CxD = (scale_C[:, None] * h_CxD.astype(jnp.float32)).astype(dtype)
    dw_DxV = accumulate_dw(carry.dw_DxV, scaled_h_CxD, dz_CxV)
    return carry._replace(dh_NxD=dh_NxD, dw_DxV=dw_DxV), None

  zero = jnp.zeros((), jnp.float32)
  carry = Carry(zero, zero, objectives.zero_positions(num_rows) if per_position else None)
  if with_grads:
    carry = carry._replace(dh_NxD=jnp.zeros_like(hidden_NxD),
                           dw_DxV=jnp.zeros(lm_head_DxV.shape, dw_dtype))
  return jax.lax.scan(body, carry, jnp.arange(-(-num_rows // chunk)))[0]


def build_fused_loss(project: Callable, dense_grad: Callable):
  """custom_vjp loss (h, W, ids, logp, w, labels, spec, chunk, dw_dtype, per_position, axis)
  -> objectives.LossTerms (positions without gradient).

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
    out = chunked_loss(hidden_NxD, lm_head_DxV, ids_NxK, logp_NxK, w_N, labels_N, spec, chunk,
                       dw_dtype, project, dense_grad, with_grads=False,
                       per_position=per_position, axis=axis)
    return out.loss_terms(spec)

  def fwd(hidden_NxD, lm_head_DxV, ids_NxK, logp_NxK, w_N, labels_N, spec, chunk, dw_dtype,
          per_position, axis):
    out = chunked_loss(hidden_NxD, lm_head_DxV, ids_NxK, logp_NxK, w_N, labels_N, spec, chunk,
                       dw_dtype or lm_head_DxV.dtype, project, dense_grad, with_grads=True,
                       per_position=per_position, axis=axis)
    # An empty array carries lm_head's dtype to bwd (residuals must be arrays).
    dtype_tag = jnp.zeros((0,), lm_head_DxV.dtype)
    return out.loss_terms(spec), (out.dh_NxD, out.dw_DxV, dtype_tag)

  def bwd(spec, chunk, dw_dtype, per_position, axis, residuals, cotangents):
    dh_NxD, dw_DxV, dtype_tag = residuals
    g = cotangents.loss  # kl, ce and the positions are logged values: their cotangents are ignored
    if axis is not None:
      g = jax.lax.psum(g, axis)
    scale = lambda x, dtype: (x.astype(jnp.float32) * g).astype(dtype)
    return scale(dh_NxD, dh_NxD.dtype), scale(dw_DxV, dtype_tag.dtype), None, None, None, None

  loss.defvjp(fwd, bwd)
  return loss


# impl "xla": the driver with the passes' XLA references; impl "pallas_exact": with their Pallas
# (Triton) kernels (also impl "pallas"'s path where its fused kernel does not apply, fused.py).
xla_loss = build_fused_loss(projection.logits_project(logit_passes.exp_pass_reference),
                            logit_passes.dense_grad_reference)
exact_project = projection.logits_project(logit_passes.exp_pass)
exact_loss = build_fused_loss(exact_project, logit_passes.dense_grad)
