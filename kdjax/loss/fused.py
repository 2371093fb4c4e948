"""impl="pallas": the chunked fused loss with the logits matmul and exp fused into one kernel.

Per chunk of C positions (the driver is kdjax.loss.chunked.chunked_loss, gradients computed in
the forward pass) three [C, D] x [D, V] matmuls run, the work floor: the logits, then dh and dW
from dL/dz = r * E (+ K exact entries), r a per-row scale the two gradient matmuls (cuBLAS)
absorb. Here the first is kdjax.kernels.mgpu.logits_exp, a Mosaic GPU (Hopper) matmul that writes
E = exp(z / tau) in bf16 and per-tile row sums straight from its float32 accumulator: the [C, V]
float32 logits never exist, the working set is E alone (2 bytes per [C, V] element, against 6
on the two-kernel path of impl "pallas_exact"), so chunks are 3x larger in the same memory
(fewer dW read-modify-writes), and no pass over the logits is left.

The price: the top-k and label logits are read back from E (fused_project), with up to 2^-8
relative error in each q_k (bf16's rounding) where the two-kernel path is exact to float32; the
softmax normalisers come from the kernel's float32 sums and are exact, entries far below their
row's maximum are recomputed exactly. Measured not to change what a student learns
(BENCHMARKS.md); impl "pallas_exact" keeps the exact path.

Applies to bf16 matmuls with V % 128 == 0 and D % 64 == 0 and one softmax in dL/dz (not CE at
tau != 1); other chunks take the two-kernel path. Off GPU the kernel runs in Mosaic GPU's
interpreter, so CPU tests cover the same code.

Speed and memory against peers: BENCHMARKS.md, loss head section.

Shape letters: N positions, C chunk of positions, D model width, V vocabulary, K cached
entries, P column tiles of the vocabulary, J gathered entries per row (K + 1), Q entries per
step.
"""
import jax
import jax.numpy as jnp

from kdjax.kernels import logit_passes, mgpu
from kdjax.loss import chunked, objectives, projection

# The fused path (see fused_project) shifts a chunk's rows by 0 and repeats the chunk with each
# row shifted by its maximum when some row's max z / tau lies outside [SAFE_LOW, SAFE_HIGH]: then
# exp never overflows (sums <= V e^64), and entries down to ~60 below the maximum stay normal
# floats (bf16 and float32 share the exponent range), i.e. every q >= e^-60 keeps full precision.
SAFE_LOW, SAFE_HIGH = -24.0, 64.0
# The fused path's working set per [C, V] element is E alone (2 bytes; else z and E, 6 bytes),
# and its chunk temporaries beyond E take ~0.3 of E: so a sixth of the unavoidable memory
# (chunked.default_chunk) holds the chunk (BENCHMARKS.md, loss head section: the measured peaks).
FUSED_ENTRY_BYTES = 2
FUSED_SHARE = 1 / 6
FUSED_MAX_CHUNKS = 3  # the fused path's largest chunk, in chunked.MAX_CHUNK
# Entries per step of exact_logits_where.
EXACT_BATCH = 1024


def applies(spec: objectives.LossSpec, dtype, dim: int, vocab: int) -> bool:
  """Whether a chunk goes through the fused kernel: bf16 matmuls, one softmax (not CE at
  tau != 1), and shapes the kernel tiles (vocab % 128, width % 64)."""
  return (jnp.dtype(dtype) == jnp.bfloat16 and not spec.two_softmax
          and mgpu.fits(row_multiple(), dim, vocab))


def row_multiple() -> int:
  return 2 * mgpu.tiles().bm


def default_chunk(num_rows: int, dim: int, vocab: int, dtype, spec=None) -> int:
  """chunked.default_chunk for the working set of the path the chunk takes; on the fused path a
  multiple of row_multiple() (topk_kl_loss rounds other chunk sizes down to one)."""
  if spec is not None and applies(spec, dtype, dim, vocab):
    mult = row_multiple()
    return chunked.default_chunk(num_rows, dim, vocab, dtype,
                             entry_bytes=FUSED_ENTRY_BYTES, share=FUSED_SHARE,
                             max_chunk=FUSED_MAX_CHUNKS * chunked.MAX_CHUNK, multiple=mult)
  return chunked.default_chunk(num_rows, dim, vocab, dtype)


def fused_project(hidden_CxD, lm_head_DxV, ids_CxK, labels_C, spec, dtype,
                  stats=False) -> projection.Projection:
  """projection.logits_project's contract from one kernel: the logits matmul writes
  E = exp(z / tau) in bf16 and per-tile row sums and maxima (mgpu.logits_exp); no [C, V] float32
  array exists.

  Shift 0, unless a row's maximum leaves [SAFE_LOW, SAFE_HIGH] (in z / tau): then the chunk is
  computed again, each row shifted by its maximum, into the same E (a while loop run 0 or 1
  times). The top-k and label logits are read back from E, z = shift + tau * log(E): up to 2^-8
  relative error in each q_k (bf16's rounding) instead of float32's; the normalisers come from
  the kernel's float32 sums and are exact.
  """
  del dtype  # E is written either way: the logits are read back from it
  tau = spec.temperature
  e_CxV, sum_PxC, max_PxC, *xex = mgpu.logits_exp(hidden_CxD, lm_head_DxV, 1.0 / tau,
                                                   with_xex=stats)
  top_C = jnp.max(max_PxC, axis=0)
  unsafe_C = (top_C < SAFE_LOW) | (top_C > SAFE_HIGH)
  shift_C = jnp.where(unsafe_C, top_C, 0.0)  # in units of z / tau
  e_ref = jax.new_ref(e_CxV)
  row_sums = lambda tiles_PxC: tuple(jnp.sum(x_PxC, axis=0) for x_PxC in tiles_PxC)

  def repeat(carry):
    sum_PxC, _, *xex = mgpu.logits_exp(hidden_CxD, lm_head_DxV, 1.0 / tau, shift_C, e_ref,
                                       with_xex=stats)
    return carry[0] + 1, row_sums([sum_PxC] + xex)

  _, (sum_C, *xex_C) = jax.lax.while_loop(
      lambda carry: carry[0] < jnp.any(unsafe_C).astype(jnp.int32), repeat,
      (jnp.int32(0), row_sums([sum_PxC] + xex)))
  e_CxV = jax.freeze(e_ref)
  ids_CxJ = jnp.concatenate([ids_CxK, labels_C[:, None]], axis=-1)
  in_shard_CxJ = ids_CxJ >= 0  # -1: another vocabulary shard's id (projection.local_ids)
  ids_CxJ = jnp.maximum(ids_CxJ, 0)
  e_CxJ = jnp.take_along_axis(e_CxV, ids_CxJ, axis=-1).astype(jnp.float32)
  tiny = jnp.finfo(jnp.float32).tiny  # bf16's smallest normal too
  z_CxJ = tau * (shift_C[:, None] + jnp.log(jnp.maximum(e_CxJ, tiny)))
  z_CxJ = exact_logits_where((e_CxJ < tiny) & in_shard_CxJ, z_CxJ, hidden_CxD, lm_head_DxV,
                             ids_CxJ)
  # Per-position statistics: a read-back logit lies within tau * 2^-8 of its exact value.
  row_stats = projection.Stats(tau * top_C, xex_C[0], tau * 2.0 ** -8) if stats else None
  return projection.Projection(None, e_CxV, (sum_C,), tau * shift_C, z_CxJ[:, :-1],
                               z_CxJ[:, -1], row_stats)


def exact_logits_where(todo_CxJ, z_CxJ, hidden_CxD, lm_head_DxV, ids_CxJ):
  """z with the entries where todo holds replaced by exact dot products h_c . W[:, id], at most
  EXACT_BATCH per loop step; no step runs when nothing is to do. (Entries of E below the
  smallest normal float lie over 60 nats under their row's maximum, where the read-back from E
  would lose precision or floor; rare, but their losses must stay exact.)"""
  rows, width = todo_CxJ.shape

  def step(carry):
    z_CxJ, todo_CxJ = carry
    flat_Q = jnp.nonzero(todo_CxJ.reshape(-1), size=EXACT_BATCH, fill_value=rows * width)[0]
    valid_Q = flat_Q < rows * width
    r_Q, j_Q = jnp.minimum(flat_Q, rows * width - 1) // width, flat_Q % width
    ids_Q = ids_CxJ[r_Q, j_Q]
    z_Q = jnp.einsum("qd,dq->q", hidden_CxD[r_Q], lm_head_DxV[:, ids_Q],
                     preferred_element_type=jnp.float32)
    r_Q = jnp.where(valid_Q, r_Q, rows)  # out of bounds: dropped
    z_CxJ = z_CxJ.at[r_Q, j_Q].set(z_Q, mode="drop")
    return z_CxJ, todo_CxJ.at[r_Q, j_Q].set(False, mode="drop")

  return jax.lax.while_loop(lambda carry: jnp.any(carry[1]), step, (z_CxJ, todo_CxJ))[0]


def project(hidden_CxD, lm_head_DxV, ids_CxK, labels_C, spec, dtype, stats=False):
  """fused_project where it `applies` and the chunk tiles, else impl "pallas_exact"'s."""
  (rows, dim), vocab = hidden_CxD.shape, lm_head_DxV.shape[1]
  matmul_dtype = jnp.promote_types(hidden_CxD.dtype, lm_head_DxV.dtype)
  if applies(spec, matmul_dtype, dim, vocab) and rows % row_multiple() == 0:
    return fused_project(hidden_CxD, lm_head_DxV, ids_CxK, labels_C, spec, dtype, stats)
  return chunked.exact_project(hidden_CxD, lm_head_DxV, ids_CxK, labels_C, spec, dtype, stats)


_loss = chunked.build_fused_loss(project, logit_passes.dense_grad)


def topk_kl_loss(hidden_NxD, lm_head_DxV, ids_NxK, logp_NxK, w_N, labels_N, spec, chunk,
                 dw_dtype, per_position=False, axis=None) -> objectives.LossTerms:
  """The chunked loss (chunked.build_fused_loss's contract) on the fused path where it applies: the
  chunk is rounded down to a multiple of row_multiple() and fewer rows are padded to one (padded
  rows weigh 0; the padding's own gradient drops them)."""
  (num_rows, dim), vocab = hidden_NxD.shape, lm_head_DxV.shape[1]
  dtype = jnp.promote_types(hidden_NxD.dtype, lm_head_DxV.dtype)
  if applies(spec, dtype, dim, vocab):
    mult = row_multiple()
    pad = max(0, mult - num_rows)
    if pad:
      padded = lambda x: jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
      hidden_NxD, ids_NxK, logp_NxK, w_N, labels_N = (
          padded(x) for x in (hidden_NxD, ids_NxK, logp_NxK, w_N, labels_N))
    chunk = max(mult, min(chunk, num_rows + pad) // mult * mult)
  out = _loss(hidden_NxD, lm_head_DxV, ids_NxK, logp_NxK, w_N, labels_N, spec, chunk, dw_dtype,
              per_position, axis)
  return out._replace(positions=jax.tree.map(lambda x_N: x_N[:num_rows], out.positions))
