"""Experiment: the logits matmul with the softmax numerator in its epilogue, a Pallas Mosaic GPU
kernel for Hopper. Not used by kdjax.kernels; measured in experiments/mgpu_probe.py and
BENCHMARKS.md ("Tried and dropped: the logits matmul with exp in its epilogue").

    project(h [M, K], w [K, V], cols, scale, shift [M] | None, e [M, V] | None)
      -> e, z [M, W] float32 (with_z), sum [W/BN, M], max [W/BN, M]     for W = len(cols) columns

For the column window `cols` of w, computes x = scale * (h @ w) - shift in a float32 accumulator
and writes from the registers: e[:, cols] = exp(x) rounded once to h's dtype (into the given e,
a jax.Ref updated in place, or a new [M, V] array of which only the window is written); z, the
window's float32 logits (for exact top-k logits); per 128-column tile the row sums of exp(x)
and row maxima of x. shift None means 0 (a caller repeats rows where exp could overflow).

Structure: a persistent kernel (one CTA per SM looping over output tiles), a memory warpgroup
streaming [2*BM, BK] and [BK, BN] operand tiles through shared memory with TMA, two compute
warpgroups each owning BM rows of the [2*BM, BN] tile with wgmma (float32 accumulator), an
epilogue storing through two shared-memory slots with TMA. Needs M % (2*BM) == 0, W % BN == 0,
K % BK == 0. Off GPU it runs in Mosaic GPU's interpreter (tests/test_mgpu_experiment.py).

Measured (H200, 2304 x 4096 x 131072, against XLA's dot with float32 output, 3.69 ms): e only
1.02-1.03x, e and z 1.09x (one window) to 1.14x (eight windows). Writing z costs what the
separate pass over the logits it replaces costs, so the fused step was no faster (1.05-1.07x
Liger at A/32K against 1.01x), and without z the top-k logits would come from the bf16 e.

Reference: `project_reference` below (XLA).

Shape letters: M rows, K contraction (model width), V vocabulary, W window columns, T tiles.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


@dataclasses.dataclass(frozen=True)
class Tiles:
  bm: int = 128   # rows per compute warpgroup (the CTA tile has 2 * bm rows)
  bn: int = 128   # columns per tile (the statistics' granularity)
  bk: int = 64
  stages: int = 3
  epi: int = 64   # rows and columns per epilogue store of e
  z_epi: int = 32  # columns per epilogue store of z (float32)
  group: int = 8  # row tiles visited per column band (w's band is reused from L2)


TILES = Tiles()
# Off GPU (Mosaic GPU's interpreter, for tests) smaller tiles keep padding and time down.
INTERPRET_TILES = Tiles(bm=64, bn=128, bk=64, stages=2, epi=64, group=2)


def project_reference(h_MxK, w_KxV, cols, scale, shift_M=None, e_MxV=None, bn=TILES.bn):
  """project in XLA: the same outputs from float32 logits."""
  m, cols = h_MxK.shape[0], slice(cols.start, cols.stop)
  z_MxW = jnp.dot(h_MxK, w_KxV[:, cols], preferred_element_type=jnp.float32)
  x_MxW = z_MxW * scale - (0.0 if shift_M is None else shift_M[:, None])
  e_new = jnp.exp(x_MxW).astype(h_MxK.dtype)
  if e_MxV is None:
    e_MxV = jnp.zeros((m, w_KxV.shape[1]), h_MxK.dtype)
  e_MxV = e_MxV.at[:, cols].set(e_new)
  tiles = lambda a: a.reshape(m, -1, bn)
  return (e_MxV, z_MxW, jnp.sum(tiles(jnp.exp(x_MxW)), -1).T, jnp.max(tiles(x_MxW), -1).T)


def _interpret():
  if jax.default_backend() == "gpu":
    return None
  from jax._src.pallas.mosaic_gpu.interpret import params  # CPU: Mosaic GPU's interpreter
  return params.InterpretGPUParams()


def _num_sms():
  return jax.devices()[0].core_count if jax.default_backend() == "gpu" else 2


def _kernel(*refs, t: Tiles, scale: float, cols: range, shifted: bool, with_z: bool):
  h_gmem, w_gmem, *refs = refs
  shift_gmem = refs.pop(0) if shifted else None
  e_gmem, *refs = refs  # the last input (a ref updated in place) or the first output
  z_gmem = refs.pop(0) if with_z else None
  sum_gmem, max_gmem = refs
  m, k = h_gmem.shape
  cta_m = 2 * t.bm
  m_tiles, n_tiles, k_steps = m // cta_m, len(cols) // t.bn, k // t.bk
  dtype = h_gmem.dtype
  z_cols = t.z_epi

  def smem_transforms(width, item):
    swizzle = plgpu.find_swizzle(width * item * 8)
    return (plgpu.TilingTransform((8, swizzle // item)), plgpu.SwizzleTransform(swizzle))

  in_transforms = smem_transforms(t.bk, dtype.itemsize)

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
                        transforms=smem_transforms(t.epi, dtype.itemsize)),
      z_smem=plgpu.SMEM((2, 2, t.epi, z_cols), jnp.float32, transforms=smem_transforms(z_cols, 4)),
      stat_smem=plgpu.SMEM((2, 2, t.bm), jnp.float32),
      collective_axes="wg")
  def _scope(allocs, e_smem, z_smem, stat_smem):
    wg = lax.axis_index("wg")

    @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="sm")
    def _tile_loop(info):
      (tile,) = info.index
      mi, ni = plgpu.planar_snake(tile, (m_tiles, n_tiles), 0, t.group)
      row0 = mi * cta_m + wg * t.bm
      rows = pl.ds(row0, t.bm)

      def store(src, smem, width, gmem, col0):
        """src [bm, bn] in sub-tiles of [epi, width] through two shared-memory slots."""
        count = 0
        for i in range(t.bm // t.epi):
          for j in range(t.bn // width):
            slot = count % 2
            count += 1
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            smem[wg, slot] = src[i * t.epi:(i + 1) * t.epi, j * width:(j + 1) * width]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(
                smem.at[wg, slot],
                gmem.at[pl.ds(row0 + i * t.epi, t.epi), pl.ds(col0 + ni * t.bn + j * width, width)])

      def context(run):
        @functools.partial(pl.run_scoped, acc=plgpu.ACC((t.bm, t.bn), jnp.float32))
        def _acc(acc):
          run(acc)
          z = acc[...]
          x = z * scale
          if shifted:  # only on the rare repeat of a chunk: a plain load will do
            shift = plgpu.load(shift_gmem.at[rows], optimized=False)
            x = x - lax.broadcast_in_dim(shift, (t.bm, t.bn), [0])
          ex = jnp.exp(x)
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          stat_smem[wg, 0] = jnp.sum(ex, axis=1)
          stat_smem[wg, 1] = jnp.max(x, axis=1)
          store(ex.astype(dtype), e_smem, t.epi, e_gmem, cols.start)
          if with_z:
            store(z, z_smem, z_cols, z_gmem, 0)
          plgpu.copy_smem_to_gmem(stat_smem.at[wg, 0], sum_gmem.at[ni, rows])
          plgpu.copy_smem_to_gmem(stat_smem.at[wg, 1], max_gmem.at[ni, rows])

      def mma(_, h_smem, w_smem, acc):
        plgpu.wgmma(acc, h_smem.at[pl.ds(wg * t.bm, t.bm)], w_smem)
        plgpu.wgmma_wait(0)
        return acc

      pipeline(mma, context)(
          h_gmem.at[pl.ds(mi * cta_m, cta_m), :],
          w_gmem.at[:, pl.ds(cols.start + ni * t.bn, t.bn)],
          allocations=allocs)

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def check_shapes(m, k, cols, tiles=TILES):
  if m % (2 * tiles.bm) or len(cols) % tiles.bn or k % tiles.bk or cols.start % tiles.bn:
    raise ValueError(f"project needs rows % {2 * tiles.bm} == 0, window columns % {tiles.bn} == 0 "
                     f"and model width % {tiles.bk} == 0; got rows={m}, window={cols}, width={k}")


def project(h_MxK, w_KxV, cols: range, scale: float, shift_M=None, e_MxV=None,
            tiles: Tiles = TILES, with_z: bool = True):
  """See the module doc. e_MxV: None (a new array is returned first) or a jax.Ref written in
  place. with_z=False leaves out z (for the repeat with a shift, whose logits are known)."""
  (m, k), vocab = h_MxK.shape, w_KxV.shape[1]
  check_shapes(m, k, cols, tiles)
  stats = jax.ShapeDtypeStruct((len(cols) // tiles.bn, m), jnp.float32)
  out_type = (stats, stats)
  if with_z:
    out_type = (jax.ShapeDtypeStruct((m, len(cols)), jnp.float32),) + out_type
  if e_MxV is None:
    out_type = (jax.ShapeDtypeStruct((m, vocab), h_MxK.dtype),) + out_type
  kernel = functools.partial(_kernel, t=tiles, scale=float(scale), cols=cols,
                             shifted=shift_M is not None, with_z=with_z)
  call = plgpu.kernel(
      kernel, out_type=out_type, grid=(_num_sms(),), grid_names=("sm",), num_threads=3,
      thread_name="wg", interpret=_interpret(),
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
  args = (h_MxK, w_KxV) + (() if shift_M is None else (shift_M.astype(jnp.float32),))
  return call(*args, *(() if e_MxV is None else (e_MxV,)))
