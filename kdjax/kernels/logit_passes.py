"""Row passes over a chunk's float32 logits z [C, V]: Pallas (Triton) kernels, each beside its
plain jnp reference. The chunked loss (kdjax.loss.chunked) runs one or the other: impl "xla" the
references, impl "pallas_exact" (and impl "pallas" where its fused kernel does not apply) the
kernels; the matmuls around them stay with XLA (cuBLAS).

  exp_pass    one read of z per row: the row sums of exp((z - shift) * scale) for the softmax
              normalisers, and E = exp((z / tau - shift / tau)) rounded once to the matmul
              dtype, for a shift given per row (the largest top-k / label logit). A row whose
              maximum lies more than SHIFT_LIMIT above its shift is swept again with its own
              maximum, inside the same program.
  dense_grad  only for CE at tau != 1 (two softmaxes in dL/dz): one read of z, one write of
              a * softmax(z / tau) + b * softmax(z), in float32 rounded once to the matmul dtype.

References: `exp_pass_reference` (shifts every row by its exact maximum, reading z twice) and
`dense_grad_reference`, in XLA. With the kernels the working set is z (4 bytes) + E (2 bytes)
per [C, V] element, and nothing [N, V] exists.

Backend: the Triton lowering (compiler_params=triton.CompilerParams). These are row-wise, memory
bound passes with a masked tail tile (V need not be a multiple of the tile: 201088 = 2^7 * 1571),
which Triton's masked vector loads express directly; Mosaic GPU is built around warpgroup tiles
and TMA copies, which buy nothing for a streaming pass (it does for the fused matmul, mgpu.py).
Both kernels sit behind `exp_pass` / `dense_grad`, so the backend can change without touching
the driver. Off GPU they run in interpret mode, so CPU tests cover the same code.

Where their time goes, against the matmuls and peers: BENCHMARKS.md, loss head section.

Shape letters: C chunk of positions, V vocabulary.
"""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

# The most a row's maximum may exceed its shift, in units of z / tau: keeps E <= e^SHIFT_LIMIT
# and the sums within [1, V e^SHIFT_LIMIT] (kdjax.loss.chunked's module docstring).
SHIFT_LIMIT = 16.0

# Elements of a row per loop step, and warps per row program: 4096 f32 = 16 per thread with
# 8 warps, i.e. four 16-byte loads in flight per thread.
BLOCK = 4096
NUM_WARPS = 8


class ExpPass(NamedTuple):
  """What an exp pass returns."""
  e_CxV: jax.Array | None   # exp((z - shift) * scales[0]) in dtype; None when dtype is None
  sums: tuple               # per scale, [C]: sum_V exp((z - shift) * scale)
  shift_C: jax.Array
  top_C: jax.Array | None   # with stats: the row maximum of z
  xex_C: jax.Array | None   # with stats: sum_V exp(x) * x, x = (z - shift) * scales[0]


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

  @pl.when((top - hint) * max(scales) > SHIFT_LIMIT)
  def _():  # rare: the row's maximum is far above every top-k logit; shift by the maximum
    finish(top, sweep(top)[1])


def exp_pass(logits_CxV, hint_C, scales, dtype, stats=False) -> ExpPass:
  """E = exp((z - shift) * scales[0]) in dtype (None if dtype is None), the sums per scale, the
  shift (hint_C, or the row maximum beyond SHIFT_LIMIT) and with stats the row statistics. One
  read of z per row, two for rows beyond SHIFT_LIMIT."""
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
  top_C, xex_C = tuple(out[-2:]) if stats else (None, None)
  out = out[:-2] if stats else out
  return ExpPass(e_CxV, tuple(out[:-1]), out[-1], top_C, xex_C)


def exp_pass_reference(logits_CxV, hint_C, scales, dtype, stats=False) -> ExpPass:
  """exp_pass in plain XLA, shifting every row by its exact maximum (z is read twice)."""
  del hint_C
  shift_C = jnp.max(logits_CxV, axis=-1)
  x_CxV = logits_CxV - shift_C[:, None]
  sums = tuple(jnp.sum(jnp.exp(x_CxV * s), axis=-1) for s in scales)
  e_CxV = None if dtype is None else jnp.exp(x_CxV * scales[0]).astype(dtype)
  top_C = xex_C = None
  if stats:
    x0_CxV = x_CxV * scales[0]
    top_C, xex_C = shift_C, jnp.sum(jnp.exp(x0_CxV) * x0_CxV, axis=-1)
  return ExpPass(e_CxV, sums, shift_C, top_C, xex_C)


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


def dense_grad_reference(logits_CxV, lse_s_C, lse_z_C, a_C, b_C, spec, dtype):
  """dense_grad in plain XLA: computed in float32 and rounded once to dtype."""
  if not spec.two_softmax:
    a_C = a_C + b_C
  dz_CxV = a_C[:, None] * jnp.exp(logits_CxV / spec.temperature - lse_s_C[:, None])
  if spec.two_softmax and spec.ce_weight != 0.0:
    dz_CxV = dz_CxV + b_C[:, None] * jnp.exp(logits_CxV - lse_z_C[:, None])
  return dz_CxV.astype(dtype)
