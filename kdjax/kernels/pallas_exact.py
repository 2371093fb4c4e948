"""impl="pallas_exact": the chunked fused loss with Pallas (Triton) kernels for the passes over
the float32 logits; also the fallback of impl "pallas" (kdjax.kernels.fused) where its kernel does
not apply.

Per chunk of C positions (the driver is kdjax.kernels.chunked.chunked_loss, gradients computed in
the forward pass): the three [C, D] x [D, V] matmuls stay with XLA (cuBLAS); the passes over the
[C, V] float32 logits are these kernels:

  exp_pass    one read of z per row: the row sums of exp((z - shift) * scale) for the softmax
              normalisers, and E = exp((z / tau - shift / tau)) rounded once to the matmul
              dtype, for a shift given per row (the largest top-k / label logit). A row whose
              maximum lies more than chunked.SHIFT_LIMIT above its shift is swept again with its
              own maximum, inside the same program.
  dense_grad  only for CE at tau != 1 (two softmaxes in dL/dz): one read of z, one write of
              a * softmax(z / tau) + b * softmax(z), in float32 rounded once to the matmul dtype.

The top-k and label logits are gathered from z (exact to float32); the K (+1) exact entries of
dL/dz there are then scattered in place (XLA), so the working set is z (4 bytes) + E (2 bytes)
per [C, V] element and nothing [N, V] exists.

Backend: the Triton lowering (compiler_params=triton.CompilerParams). These are row-wise, memory
bound passes with a masked tail tile (V need not be a multiple of the tile: 201088 = 2^7 * 1571),
which Triton's masked vector loads express directly; Mosaic GPU is built around warpgroup tiles
and TMA copies, which buy nothing for a streaming pass (it does for the fused matmul). Both
kernels sit behind `exp_pass` / `dense_grad`, so the backend can change without touching the
driver. Off GPU they run in interpret mode, so CPU tests cover the same code.

Where its time goes, against the matmuls and peers: BENCHMARKS.md, loss head section.

Shape letters: C chunk of positions, V vocabulary.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kdjax.kernels import chunked

# Elements of a row per loop step, and warps per row program: 4096 f32 = 16 per thread with
# 8 warps, i.e. four 16-byte loads in flight per thread.
BLOCK = 4096
NUM_WARPS = 8

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


def _exp_kernel(z_ref, hint_ref, *refs, scales, block, write, stats):
  # refs: E row (if write), one sum per scale, the shift used, then (if stats) the row's maximum
  # and the sum of exp(x) * x for x = (z - shift) * scales[0] (for the entropy).
  e_ref = refs[0] if write else None
  refs = refs[int(write):]
  top_ref, xex_ref = refs[-2:] if stats else (None, None)
  refs = refs[:-2] if stats else refs
  sum_refs, shift_ref = refs[:-1], refs[-1]
  vocab = z_ref.shape[0]

  def sweep(shift):
    """One read of the row: max(z), sum exp((z - shift) * scale) [and of exp(x) * x]; writes E."""
    def body(i, carry):
      cols, valid = _cols(i, vocab, block)
      z = pltriton.load(z_ref.at[cols], mask=valid, other=-jnp.inf)
      es = [jnp.exp((z - shift) * scale) for scale in scales]
      if write:
        pltriton.store(e_ref.at[cols], es[0].astype(e_ref.dtype), mask=valid)
      out = (jnp.maximum(carry[0], z),) + tuple(s + e for s, e in zip(carry[1:], es))
      if stats:
        out += (carry[-1] + jnp.where(valid, es[0] * (z - shift) * scales[0], 0.0),)
      return out

    init = (jnp.full((block,), -jnp.inf, jnp.float32),) + tuple(
        jnp.zeros((block,), jnp.float32) for _ in scales + ((1.0,) if stats else ()))
    out = jax.lax.fori_loop(0, _tiles(vocab, block), body, init)
    return jnp.max(out[0]), [jnp.sum(s) for s in out[1:]]

  def finish(shift, sums):
    shift_ref[...] = shift
    if stats:
      xex_ref[...] = sums.pop()
    for ref, s in zip(sum_refs, sums):
      ref[...] = s

  hint = hint_ref[...]
  top, sums = sweep(hint)
  finish(hint, sums)
  if stats:
    top_ref[...] = top

  @pl.when((top - hint) * max(scales) > chunked.SHIFT_LIMIT)
  def _():  # rare: the row's maximum is far above every top-k logit; shift by the maximum
    finish(top, sweep(top)[1])


def exp_pass(logits_CxV, hint_C, scales, dtype, stats=False):
  """(E = exp((z - shift) * scales[0]) in dtype or None, sums per scale, shift, stats): see
  kdjax.kernels.chunked. One read of z per row, two for rows beyond chunked.SHIFT_LIMIT."""
  rows, vocab = logits_CxV.shape
  block = min(BLOCK, pl.next_power_of_2(vocab))
  scalar = jax.ShapeDtypeStruct((), jnp.float32)
  out_shape = ((jax.ShapeDtypeStruct((vocab,), dtype),) if dtype is not None else ()) + (
      (scalar,) * (len(scales) + 1 + 2 * stats))
  call = _row_call(functools.partial(_exp_kernel, scales=tuple(scales), block=block,
                                     write=dtype is not None, stats=stats),
                   out_shape, "topk_kl_exp_pass")
  out = jax.vmap(call)(logits_CxV.astype(jnp.float32), hint_C.astype(jnp.float32))
  e_CxV = out[0] if dtype is not None else None
  out = out[int(dtype is not None):]
  extra = tuple(out[-2:]) if stats else None
  out = out[:-2] if stats else out
  return e_CxV, tuple(out[:-1]), out[-1], extra


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


default_chunk = chunked.default_chunk
topk_kl_loss = chunked.build_fused_loss(chunked.logits_project(exp_pass), dense_grad)
