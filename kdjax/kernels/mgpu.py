"""The logits matmul with the softmax numerator in its epilogue: a Mosaic GPU kernel (Hopper).

    logits_exp(h [C, D], w [D, V], scale, shift [C] | None, e [C, V] ref | None)
        -> e [C, V] (if not given), sums [P, C], maxima [P, C] (P = V / BN tiles)

computes x = scale * (h @ w) - shift in a float32 accumulator, tile by tile, and writes from the
registers: e = exp(x) rounded once to h's dtype (a new array, or into the given jax.Ref in
place), and per BN-column tile the row sums of exp(x) and the row maxima of x, both float32. The
[C, V] float32 logits never exist. shift None means 0; a caller whose rows could overflow exp
(|x| beyond a few tens) repeats them with a shift, into the same e.

Structure: a persistent kernel (one CTA per SM looping over output tiles in a snake order that
reuses w's column band from L2), a memory warpgroup streaming [2 * BM, BK] and [BK, BN] operand
tiles through shared memory with TMA, two compute warpgroups each owning BM rows of the
[2 * BM, BN] tile with wgmma (float32 accumulator), an epilogue storing e through two
shared-memory slots with TMA. Needs C % (2 * BM) == 0, V % BN == 0, D % BK == 0 (`fits`).
Off GPU it runs in Mosaic GPU's interpreter, so CPU tests cover the same code.

Its speed against XLA's dot: experiments/bench/mgpu_probe.py, BENCHMARKS.md.

Reference: `logits_exp_reference` (XLA). Shape letters: C rows (a chunk of positions), D model
width (the contraction), V vocabulary, P column tiles, W columns per tile; BM, BN, BK are the
matmul's tile sizes (rows, columns, contraction).
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kdjax.kernels import mosaic


@dataclasses.dataclass(frozen=True)
class Tiles:
  bm: int = 128   # rows per compute warpgroup (the CTA tile has 2 * bm rows)
  bn: int = 128   # columns per tile (the statistics' granularity)
  bk: int = 64
  stages: int = 3
  epi: int = 64   # rows and columns per epilogue store of e
  group: int = 8  # row tiles visited per column band (w's band is reused from L2)


LOG2_E = 1.4426950408889634

GPU_TILES = Tiles()
# Off GPU (Mosaic GPU's interpreter, for tests) smaller tiles keep padding and time down.
INTERPRET_TILES = Tiles(bm=64, bn=128, bk=64, stages=2, epi=64, group=2)


def tiles() -> Tiles:
  return GPU_TILES if mosaic.on_gpu() else INTERPRET_TILES


def fits(rows: int, dim: int, vocab: int, t: Tiles | None = None) -> bool:
  """Whether logits_exp takes these shapes (rows: the multiple of 2 * bm a caller pads to)."""
  t = t or tiles()
  return rows % (2 * t.bm) == 0 and vocab % t.bn == 0 and dim % t.bk == 0


def logits_exp_reference(h_CxD, w_DxV, scale, shift_C=None, bn=GPU_TILES.bn, with_xex=False):
  """logits_exp in XLA: (e, sums [T, M], maxima [T, M][, sums of exp(x) x]) from float32 logits."""
  x_CxV = jnp.dot(h_CxD, w_DxV, preferred_element_type=jnp.float32) * scale
  if shift_C is not None:
    x_CxV = x_CxV - shift_C[:, None]
  tiles_CxPxW = x_CxV.reshape(x_CxV.shape[0], -1, bn)
  out = (jnp.exp(x_CxV).astype(h_CxD.dtype), jnp.sum(jnp.exp(tiles_CxPxW), -1).T,
         jnp.max(tiles_CxPxW, -1).T)
  return out + ((jnp.sum(jnp.exp(tiles_CxPxW) * tiles_CxPxW, -1).T,) if with_xex else ())


def _kernel(*refs, t: Tiles, scale: float, shifted: bool, with_xex: bool):
  h_gmem, w_gmem, *refs = refs
  shift_gmem = refs.pop(0) if shifted else None
  e_gmem, sum_gmem, max_gmem, *xex_gmem = refs  # e: the last input (updated in place) or output
  m, k = h_gmem.shape
  cta_m = 2 * t.bm
  m_tiles, n_tiles, k_steps = m // cta_m, w_gmem.shape[1] // t.bn, k // t.bk
  dtype = h_gmem.dtype

  in_transforms = mosaic.smem_transforms(t.bk, dtype.itemsize)

  def pipeline(body, context):
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(k_steps,), memory_registers=40,
        in_specs=[
            plgpu.BlockSpec((cta_m, t.bk), lambda ki: (0, ki), transforms=in_transforms,
                            memory_space=plgpu.SMEM),
            plgpu.BlockSpec((t.bk, t.bn), lambda ki: (ki, 0), transforms=in_transforms,
                            memory_space=plgpu.SMEM),
        ],
        wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=t.stages, compute_context=context)

  noop = lambda *_, **__: None

  @functools.partial(
      pl.run_scoped,
      allocs=pipeline(noop, noop).get_allocations(h_gmem, w_gmem),
      # Per compute warpgroup two slots each: one is filled while the other's copy runs.
      e_smem=plgpu.SMEM((2, 2, t.epi, t.epi), dtype,
                        transforms=mosaic.smem_transforms(t.epi, dtype.itemsize)),
      stat_smem=plgpu.SMEM((2, 3 if with_xex else 2, t.bm), jnp.float32),
      collective_axes="wg")
  def _scope(allocs, e_smem, stat_smem):
    wg = lax.axis_index("wg")

    @mosaic.over_tiles(m_tiles, n_tiles, t.group)
    def _tile(mi, ni):
      row0 = mi * cta_m + wg * t.bm
      rows = pl.ds(row0, t.bm)

      def context(run):
        @functools.partial(pl.run_scoped, acc=plgpu.ACC((t.bm, t.bn), jnp.float32))
        def _acc(acc):
          run(acc)
          x2 = acc[...] * (scale * LOG2_E)  # exp(x) = exp2(x * log2(e)): one ex2 per entry
          if shifted:  # only on the rare repeat of a chunk: a plain load will do
            shift = plgpu.load(shift_gmem.at[rows], optimized=False) * LOG2_E
            x2 = x2 - lax.broadcast_in_dim(shift, (t.bm, t.bn), [0])
          ex = jnp.exp2(x2)
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          stat_smem[wg, 0] = jnp.sum(ex, axis=1)
          stat_smem[wg, 1] = jnp.max(x2, axis=1) * (1 / LOG2_E)
          if with_xex:  # for the entropy: sum of exp(x) * x
            stat_smem[wg, 2] = jnp.sum(ex * x2, axis=1) * (1 / LOG2_E)
          mosaic.store_tile(ex.astype(dtype), e_smem.at[wg], e_gmem, row0, ni * t.bn, t.epi)
          plgpu.copy_smem_to_gmem(stat_smem.at[wg, 0], sum_gmem.at[ni, rows])
          plgpu.copy_smem_to_gmem(stat_smem.at[wg, 1], max_gmem.at[ni, rows])
          if with_xex:
            plgpu.copy_smem_to_gmem(stat_smem.at[wg, 2], xex_gmem[0].at[ni, rows])

      def mma(_, h_smem, w_smem, acc):
        plgpu.wgmma(acc, h_smem.at[pl.ds(wg * t.bm, t.bm)], w_smem)
        plgpu.wgmma_wait(0)
        return acc

      pipeline(mma, context)(
          h_gmem.at[pl.ds(mi * cta_m, cta_m), :],
          w_gmem.at[:, pl.ds(ni * t.bn, t.bn)],
          allocations=allocs)

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def logits_exp(h_CxD, w_DxV, scale: float, shift_C=None, e_ref=None, t: Tiles | None = None,
               with_xex: bool = False):
  """See the module doc. e_ref: None (a new e is returned first) or a jax.Ref written in place.
  with_xex: also the per-tile row sums of exp(x) * x [T, M] (for the softmax's entropy), last."""
  t = t or tiles()
  (m, k), vocab = h_CxD.shape, w_DxV.shape[1]
  if not fits(m, k, vocab, t) or h_CxD.dtype != w_DxV.dtype:
    raise ValueError(f"logits_exp needs rows % {2 * t.bm} == 0, vocabulary % {t.bn} == 0, width "
                     f"% {t.bk} == 0 and one dtype; got h {h_CxD.shape} {h_CxD.dtype}, w "
                     f"{w_DxV.shape} {w_DxV.dtype}")
  stats = jax.ShapeDtypeStruct((vocab // t.bn, m), jnp.float32)
  out_type = (stats, stats) + ((stats,) if with_xex else ())
  if e_ref is None:
    out_type = (jax.ShapeDtypeStruct((m, vocab), h_CxD.dtype),) + out_type
  kernel = functools.partial(_kernel, t=t, scale=float(scale), shifted=shift_C is not None,
                             with_xex=with_xex)
  call = plgpu.kernel(
      kernel, out_type=out_type, grid=(mosaic.num_sms(),), grid_names=("sm",), num_threads=3,
      kernel_name="mosaic_loss_head",  # its name in profiles
      thread_name="wg", interpret=mosaic.interpret_params(),
      compiler_params=plgpu.CompilerParams(
          approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
  args = (h_CxD, w_DxV) + (() if shift_C is None else (shift_C.astype(jnp.float32),))
  return call(*args, *(() if e_ref is None else (e_ref,)))
