"""impl="pallas": the chunked fused loss with Pallas GPU kernels for the passes over the logits.

Per chunk of C positions (the driver is kdjax.kernels.xla.chunked_loss, gradients computed in
the forward pass): the three [C, D] x [D, V] matmuls stay with XLA (cuBLAS reaches ~600-790
TFLOP/s on an H200 and a Pallas matmul would first have to match it); the passes over the
[C, V] float32 logits are these kernels:

  exp_pass    one read of z per row: the row sums of exp((z - shift) * scale) for the softmax
              normalisers, and E = exp((z / tau - shift / tau)) rounded once to the matmul
              dtype, for a shift given per row (the largest top-k / label logit). A row whose
              maximum lies more than xla.SHIFT_LIMIT above its shift is swept again with its
              own maximum, inside the same program.
  dense_grad  only for CE at tau != 1 (two softmaxes in dL/dz): one read of z, one write of
              a * softmax(z / tau) + b * softmax(z), in float32 rounded once to the matmul dtype.

The K (+1) exact entries at the top-k ids and label are then scattered in place (XLA), so the
working set is z (4 bytes) + E (2 bytes) per [C, V] element and nothing [N, V] exists.

Backend: the Triton lowering (compiler_params=triton.CompilerParams). These are row-wise, memory
bound passes with a masked tail tile (V need not be a multiple of the tile: 201088 = 2^7 * 1571),
which Triton's masked vector loads express directly; Mosaic GPU is built around warpgroup tiles
and TMA copies, which buy nothing for a streaming pass. Both kernels sit behind `exp_pass` /
`dense_grad`, so the backend can change without touching the driver. Off GPU they run in
interpret mode, so CPU tests cover the same code.

Measured on an H200 (BENCHMARKS.md, A = D 4096, V 131072, 32K tokens, chunk 1024): the three
matmuls take 156 ms of the step's 165 ms of kernels, exp_pass 6.9 ms; the read-modify-write of
dW per chunk makes the dW matmul ~10 ms slower than the other two.

Shape letters: C chunk of positions, V vocabulary.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kdjax.kernels import mgpu, objectives, xla

# Elements of a row per loop step, and warps per row program: 4096 f32 = 16 per thread with
# 8 warps, i.e. four 16-byte loads in flight per thread.
BLOCK = 4096
NUM_WARPS = 8

# The fused path (see fused_project) shifts a chunk's rows by 0 and repeats the chunk with each
# row shifted by its maximum when some row's max z / tau lies outside [SAFE_LOW, SAFE_HIGH]: then
# exp never overflows (sums <= V e^64), and entries down to ~60 below the maximum stay normal
# floats (bf16 and float32 share the exponent range), i.e. every q >= e^-60 keeps full precision.
SAFE_LOW, SAFE_HIGH = -24.0, 64.0
# The fused path's working set per [C, V] element is E alone (2 bytes; else z and E, 6 bytes),
# and its chunk temporaries beyond E take ~0.3 of E: so a sixth of the unavoidable memory
# (xla.default_chunk) keeps A/256K (D 4096, V 131072) under 7.5 GiB, with chunk 4096.
FUSED_ENTRY_BYTES = 2
FUSED_SHARE = 1 / 6
FUSED_MAX_CHUNK = 3 * xla.MAX_CHUNK
# Entries per step of exact_logits_where.
EXACT_BATCH = 1024


def fused(spec: objectives.LossSpec, dtype, dim: int, vocab: int) -> bool:
  """Whether a chunk goes through the fused kernel: bf16 matmuls, one softmax (not CE at
  tau != 1), and shapes the kernel tiles (vocab % 128, width % 64)."""
  return (jnp.dtype(dtype) == jnp.bfloat16 and not spec.two_softmax
          and mgpu.fits(row_multiple(), dim, vocab))


def row_multiple() -> int:
  return 2 * mgpu.tiles().bm


def default_chunk(num_rows: int, dim: int, vocab: int, dtype, spec=None) -> int:
  """xla.default_chunk for the working set of the path the chunk takes; a multiple of
  row_multiple() on the fused path (fused_chunk rounds it there anyway)."""
  if spec is not None and fused(spec, dtype, dim, vocab):
    mult = row_multiple()
    return xla.default_chunk(num_rows, dim, vocab, dtype,
                             entry_bytes=FUSED_ENTRY_BYTES, share=FUSED_SHARE,
                             max_chunk=FUSED_MAX_CHUNK, multiple=mult)
  return xla.default_chunk(num_rows, dim, vocab, dtype)

def _interpret() -> bool:
  return jax.default_backend() != "gpu"


def _row_call(kernel, out_shape, name):
  """pallas_call over one row (refs of shape [V] and ()); vmapped, the rows become the grid."""
  return pl.pallas_call(
      kernel, out_shape=out_shape, grid=(), interpret=_interpret(), name=name,
      compiler_params=pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=2))


def _tiles(vocab, block):
  return pl.cdiv(vocab, block)


def _cols(i, vocab, block):
  cols = i * block + jnp.arange(block)
  return cols, cols < vocab


def _exp_kernel(z_ref, hint_ref, *refs, scales, block, write):
  # refs: E row (if write), one sum per scale, the shift used.
  e_ref = refs[0] if write else None
  sum_refs, shift_ref = refs[int(write):-1], refs[-1]
  vocab = z_ref.shape[0]

  def sweep(shift):
    """One read of the row: max(z) and sum exp((z - shift) * scale); writes E."""
    def body(i, carry):
      cols, valid = _cols(i, vocab, block)
      z = pltriton.load(z_ref.at[cols], mask=valid, other=-jnp.inf)
      es = [jnp.exp((z - shift) * scale) for scale in scales]
      if write:
        pltriton.store(e_ref.at[cols], es[0].astype(e_ref.dtype), mask=valid)
      return (jnp.maximum(carry[0], z),) + tuple(s + e for s, e in zip(carry[1:], es))

    init = (jnp.full((block,), -jnp.inf, jnp.float32),) + tuple(
        jnp.zeros((block,), jnp.float32) for _ in scales)
    out = jax.lax.fori_loop(0, _tiles(vocab, block), body, init)
    return jnp.max(out[0]), [jnp.sum(s) for s in out[1:]]

  def finish(shift, sums):
    shift_ref[...] = shift
    for ref, s in zip(sum_refs, sums):
      ref[...] = s

  hint = hint_ref[...]
  top, sums = sweep(hint)
  finish(hint, sums)

  @pl.when((top - hint) * max(scales) > xla.SHIFT_LIMIT)
  def _():  # rare: the row's maximum is far above every top-k logit; shift by the maximum
    finish(top, sweep(top)[1])


def exp_pass(logits_CxV, hint_C, scales, dtype):
  """(E = exp((z - shift) * scales[0]) in dtype or None, sums per scale, shift): see
  kdjax.kernels.xla. One read of z per row, two for rows beyond xla.SHIFT_LIMIT."""
  rows, vocab = logits_CxV.shape
  block = min(BLOCK, pl.next_power_of_2(vocab))
  scalar = jax.ShapeDtypeStruct((), jnp.float32)
  out_shape = ((jax.ShapeDtypeStruct((vocab,), dtype),) if dtype is not None else ()) + (
      (scalar,) * len(scales)) + (scalar,)
  call = _row_call(functools.partial(_exp_kernel, scales=tuple(scales), block=block,
                                     write=dtype is not None), out_shape, "topk_kl_exp_pass")
  out = jax.vmap(call)(logits_CxV.astype(jnp.float32), hint_C.astype(jnp.float32))
  e_CxV = out[0] if dtype is not None else None
  return e_CxV, tuple(out[int(dtype is not None):-1]), out[-1]


def _dense_kernel(z_ref, *refs, scales, block):
  # refs: (coef, lse) per softmax term, then the output row.
  dz_ref = refs[-1]
  terms = [(refs[2 * j][...], refs[2 * j + 1][...]) for j in range(len(scales))]
  vocab = z_ref.shape[0]

  @pl.loop(0, _tiles(vocab, block))
  def _(i):
    cols, valid = _cols(i, vocab, block)
    z = pltriton.load(z_ref.at[cols], mask=valid, other=0.0)
    dz = jnp.zeros((block,), jnp.float32)
    for scale, (coef, lse) in zip(scales, terms):
      dz = dz + coef * jnp.exp(z * scale - lse)
    pltriton.store(dz_ref.at[cols], dz.astype(dz_ref.dtype), mask=valid)


def dense_grad(logits_CxV, lse_s_C, lse_z_C, a_C, b_C, spec, dtype):
  """a * softmax(z / tau) + b * softmax(z) in float32, rounded once to dtype."""
  rows, vocab = logits_CxV.shape
  block = min(BLOCK, pl.next_power_of_2(vocab))
  if spec.two_softmax and spec.ce_weight != 0.0:
    scales, args = (1.0 / spec.temperature, 1.0), (a_C, lse_s_C, b_C, lse_z_C)
  else:  # one softmax: at tau = 1 both terms share it, and without CE b is 0
    scales, args = (1.0 / spec.temperature,), (a_C + b_C, lse_s_C)
  call = _row_call(functools.partial(_dense_kernel, scales=scales, block=block),
                   jax.ShapeDtypeStruct((vocab,), dtype), "topk_kl_dense_grad")
  return jax.vmap(call)(logits_CxV, *(x.astype(jnp.float32) for x in args))


def fused_project(hidden_CxD, lm_head_DxV, ids_CxK, labels_C, spec, dtype):
  """xla.logits_project's contract from one kernel: the logits matmul writes E = exp(z / tau)
  in bf16 and per-tile row sums and maxima (mgpu.logits_exp); no [C, V] float32 array exists.

  Shift 0, unless a row's maximum leaves [SAFE_LOW, SAFE_HIGH] (in z / tau): then the chunk is
  computed again, each row shifted by its maximum, into the same E (a while loop run 0 or 1
  times). The top-k and label logits are read back from E, z = shift + tau * log(E): up to 2^-8
  relative error in each q_k (bf16's rounding) instead of float32's; the normalisers come from
  the kernel's float32 sums and are exact.
  """
  del dtype  # E is written either way: the logits are read back from it
  tau = spec.temperature
  e_CxV, sum_TxC, max_TxC = mgpu.logits_exp(hidden_CxD, lm_head_DxV, 1.0 / tau)
  top_C = jnp.max(max_TxC, axis=0)
  unsafe_C = (top_C < SAFE_LOW) | (top_C > SAFE_HIGH)
  shift_C = jnp.where(unsafe_C, top_C, 0.0)  # in units of z / tau
  e_ref = jax.new_ref(e_CxV)

  def repeat(carry):
    sum_TxC, _ = mgpu.logits_exp(hidden_CxD, lm_head_DxV, 1.0 / tau, shift_C, e_ref)
    return carry[0] + 1, jnp.sum(sum_TxC, axis=0)

  _, sum_C = jax.lax.while_loop(lambda carry: carry[0] < jnp.any(unsafe_C).astype(jnp.int32),
                                repeat, (jnp.int32(0), jnp.sum(sum_TxC, axis=0)))
  e_CxV = jax.freeze(e_ref)
  ids_CxJ = jnp.concatenate([ids_CxK, labels_C[:, None]], axis=-1)
  e_CxJ = jnp.take_along_axis(e_CxV, ids_CxJ, axis=-1).astype(jnp.float32)
  tiny = jnp.finfo(jnp.float32).tiny  # bf16's smallest normal too
  z_CxJ = tau * (shift_C[:, None] + jnp.log(jnp.maximum(e_CxJ, tiny)))
  z_CxJ = exact_logits_where(e_CxJ < tiny, z_CxJ, hidden_CxD, lm_head_DxV, ids_CxJ)
  return None, e_CxV, (sum_C,), tau * shift_C, z_CxJ[:, :-1], z_CxJ[:, -1]


def exact_logits_where(todo_CxJ, z_CxJ, hidden_CxD, lm_head_DxV, ids_CxJ):
  """z with the entries where todo holds replaced by exact dot products h_c . W[:, id], at most
  EXACT_BATCH per loop step; no step runs when nothing is to do. (Entries of E below the
  smallest normal float lie over 60 nats under their row's maximum, where the read-back from E
  would lose precision or floor; rare, but their losses must stay exact.)"""
  rows, width = todo_CxJ.shape

  def step(carry):
    z_CxJ, todo_CxJ = carry
    flat_F = jnp.nonzero(todo_CxJ.reshape(-1), size=EXACT_BATCH, fill_value=rows * width)[0]
    valid_F = flat_F < rows * width
    r_F, j_F = jnp.minimum(flat_F, rows * width - 1) // width, flat_F % width
    ids_F = ids_CxJ[r_F, j_F]
    z_F = jnp.einsum("fd,df->f", hidden_CxD[r_F], lm_head_DxV[:, ids_F],
                     preferred_element_type=jnp.float32)
    r_F = jnp.where(valid_F, r_F, rows)  # out of bounds: dropped
    z_CxJ = z_CxJ.at[r_F, j_F].set(z_F, mode="drop")
    return z_CxJ, todo_CxJ.at[r_F, j_F].set(False, mode="drop")

  return jax.lax.while_loop(lambda carry: jnp.any(carry[1]), step, (z_CxJ, todo_CxJ))[0]


exact_project = xla.logits_project(exp_pass)


def project(hidden_CxD, lm_head_DxV, ids_CxK, labels_C, spec, dtype):
  """fused_project where `fused` allows and the chunk tiles, else exact_project."""
  (rows, dim), vocab = hidden_CxD.shape, lm_head_DxV.shape[1]
  matmul_dtype = jnp.promote_types(hidden_CxD.dtype, lm_head_DxV.dtype)
  if fused(spec, matmul_dtype, dim, vocab) and rows % row_multiple() == 0:
    return fused_project(hidden_CxD, lm_head_DxV, ids_CxK, labels_C, spec, dtype)
  return exact_project(hidden_CxD, lm_head_DxV, ids_CxK, labels_C, spec, dtype)


_fused_loss = xla.build_fused_loss(project, dense_grad)
topk_kl_loss_exact = xla.build_fused_loss(exact_project, dense_grad)


def topk_kl_loss(hidden_NxD, lm_head_DxV, ids_NxK, logp_NxK, w_N, labels_N, spec, chunk,
                 dw_dtype):
  """The chunked loss (xla.build_fused_loss's contract) on the fused path where it applies: the
  chunk is rounded down to a multiple of row_multiple() and fewer rows are padded to one (padded
  rows weigh 0; the padding's own gradient drops them)."""
  (num_rows, dim), vocab = hidden_NxD.shape, lm_head_DxV.shape[1]
  dtype = jnp.promote_types(hidden_NxD.dtype, lm_head_DxV.dtype)
  if fused(spec, dtype, dim, vocab):
    mult = row_multiple()
    pad = max(0, mult - num_rows)
    if pad:
      padded = lambda x: jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
      hidden_NxD, ids_NxK, logp_NxK, w_N, labels_N = (
          padded(x) for x in (hidden_NxD, ids_NxK, logp_NxK, w_N, labels_N))
    chunk = max(mult, min(chunk, num_rows + pad) // mult * mult)
  return _fused_loss(hidden_NxD, lm_head_DxV, ids_NxK, logp_NxK, w_N, labels_N, spec, chunk,
                     dw_dtype)
