"""What the Mosaic GPU kernels (mgpu.py, grouped.py, swiglu.py) share: where they run (the GPU,
or Mosaic GPU's interpreter off it), their persistent grid's size, shared-memory layouts, and the
epilogue's store of a register tile through shared memory."""
import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


def on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def interpret_params():
  """None on a GPU (compiled); off it, Mosaic GPU's interpreter, so CPU tests run the same code."""
  return None if on_gpu() else plgpu.InterpretGPUParams()


def num_sms() -> int:
  """CTAs of a persistent kernel: one per SM (2 in the interpreter)."""
  return jax.devices()[0].core_count if on_gpu() else 2


def over_tiles(m_tiles: int, n_tiles: int, group: int):
  """Decorator: runs body(mi, ni) for every output tile of a persistent kernel, the CTAs ("sm")
  taking the tiles in turn, in a snake order that visits `group` row tiles per column band (the
  band's operands stay in L2)."""
  def wrap(body):
    @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="sm")
    def _tile_loop(info):
      body(*plgpu.planar_snake(info.index[0], (m_tiles, n_tiles), 0, group))
  return wrap


def smem_transforms(width: int, item: int):
  """Shared-memory tiling and swizzle for tiles `width` items of `item` bytes wide (TMA, wgmma)."""
  swizzle = plgpu.find_swizzle(width * item * 8)
  return (plgpu.TilingTransform((8, swizzle // item)), plgpu.SwizzleTransform(swizzle))


def store_tile(tile, slots_smem, out_gmem, row0, col0, epi: int):
  """A warpgroup's register tile [R, C] into out_gmem at (row0, col0), in [epi, epi] sub-tiles
  through its two shared-memory slots slots_smem [2, epi, epi]: one is filled while the other's
  copy runs."""
  count = 0
  for i in range(tile.shape[0] // epi):
    for j in range(tile.shape[1] // epi):
      slot = count % 2
      count += 1
      plgpu.wait_smem_to_gmem(1, wait_read_only=True)
      slots_smem[slot] = tile[i * epi:(i + 1) * epi, j * epi:(j + 1) * epi]
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(
          slots_smem.at[slot], out_gmem.at[pl.ds(row0 + i * epi, epi), pl.ds(col0 + j * epi, epi)])
