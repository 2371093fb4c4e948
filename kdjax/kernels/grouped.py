"""Grouped matmuls of a mixture of experts: Mosaic GPU kernels (Hopper) over a tile-aligned layout.

    layout(group_sizes_X, rows, bm) -> Groups          where each expert's rows go
    grouped_matmul(lhs_PxK, rhs_XxKxN | rhs_XxNxK, groups, transpose_rhs) -> out_PxN
    grouped_matmul_reference(...)                       the same in XLA (jax.lax.ragged_dot)

The assignments (token, expert) sorted by expert are laid out in P padded rows where each
expert's group starts at a multiple of BM rows: row tile i (BM rows) belongs to one expert,
`tile_expert_M[i]`, or to none (-1: tiles past the last group). Padding rows are zero on input
and their outputs are zero, so no kernel ever masks rows, and every value in the layout is
finite. P is static (the worst case: every group wastes up to BM - 1 rows), the tiles in use are
counted at run time.

Kernels (a persistent loop over output tiles on every SM; operands streamed through shared
memory by TMA, wgmma with a float32 accumulator, the tile stored by TMA):
  _gmm   out[rows of tile i] = lhs[rows of tile i] @ rhs[tile_expert[i]] (or its transpose):
         the experts' forward, and the gradient with respect to lhs. A tile of no expert runs no
         step and stores zeros.
  _tgmm  out[x] = lhs[rows of x]^T @ rhs[rows of x]: the gradient with respect to the experts'
         weights, the contraction running over expert x's row tiles only (a run-time count).

`grouped_matmul` is differentiable (custom_vjp: the gradients are these two kernels). It runs
the kernels on a GPU for bf16/f16 operands whose widths tile (`applies`), and its reference
(jax.lax.ragged_dot on the same layout) otherwise: on CPU, for float32, and for shapes the kernels
do not tile. Why kernels: XLA's ragged_dot on the H200 ran far below the matmul peak at gpt-oss's
expert counts (experiments/bench/moe_matmul_bench.py; BENCHMARKS.md, MoE: its figures).
Off GPU the kernels run in Mosaic GPU's interpreter, so CPU tests cover the same code.

Shape letters (ARCHITECTURE.md's legend, with its meanings in this module and models/moe.py): X
experts, Y assignments, P the assignments' rows padded to whole row tiles, M row tiles (P / BM);
the matmuls are [P, K] x [K, N]: K their contraction, N their output columns.
"""
import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kdjax.kernels import mosaic


@dataclasses.dataclass(frozen=True)
class Tiles:
  bm: int = 128      # rows per row tile (the layout's alignment), and _tgmm's output rows
  bk: int = 64       # contraction per pipeline step
  stages: int = 4    # operand tiles in flight
  group: int = 8     # row tiles visited per column band (the expert's band reused from L2)


GPU_TILES = Tiles()
# Off GPU (Mosaic GPU's interpreter, for tests) smaller tiles keep padding and time down.
INTERPRET_TILES = Tiles(bm=64, bk=64, stages=2, group=2)
COLUMN_TILES = (256, 192, 128, 64)  # the widest that divides N (gpt-oss: 2880 = 15 x 192)
ROW_TILES = (128, 64)  # _tgmm's output rows: the widest that divides K
ALIGN = 64  # K and N must be multiples of it
KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)


class Groups(NamedTuple):
  """Where each expert's rows lie in the padded layout (all int32)."""
  tile_expert_M: jax.Array  # expert of each row tile, -1 for tiles of no expert
  tile_start_X: jax.Array   # first row tile of each expert
  tiles_X: jax.Array        # row tiles of each expert (0 for an expert with no rows)
  row_Y: jax.Array          # padded row of each sorted assignment
  bm: int                   # rows per tile (static)


def tiles() -> Tiles:
  return GPU_TILES if mosaic.on_gpu() else INTERPRET_TILES


def padded_rows(rows: int, experts: int, bm: int) -> int:
  """Rows of the layout for `rows` assignments over `experts` groups: the worst case."""
  return pl.cdiv(rows + experts * (bm - 1), bm) * bm


def layout(group_sizes_X: jax.Array, rows: int, bm: int) -> Groups:
  """The padded layout of `rows` assignments sorted by expert, group x of group_sizes_X[x] rows."""
  group_sizes_X = group_sizes_X.astype(jnp.int32)
  experts = group_sizes_X.shape[0]
  tiles_X = (group_sizes_X + bm - 1) // bm
  tile_end_X = jnp.cumsum(tiles_X)
  tile_start_X = tile_end_X - tiles_X
  m = padded_rows(rows, experts, bm) // bm
  tile_M = jnp.arange(m, dtype=jnp.int32)
  expert_M = jnp.searchsorted(tile_end_X, tile_M, side="right").astype(jnp.int32)
  tile_expert_M = jnp.where(tile_M < tile_end_X[-1], expert_M, -1)
  group_start_X = jnp.cumsum(group_sizes_X) - group_sizes_X
  sorted_expert_Y = jnp.repeat(jnp.arange(experts, dtype=jnp.int32), group_sizes_X,
                               total_repeat_length=rows)
  rank_Y = jnp.arange(rows, dtype=jnp.int32) - group_start_X[sorted_expert_Y]
  row_Y = tile_start_X[sorted_expert_Y] * bm + rank_Y
  return Groups(tile_expert_M, tile_start_X, tiles_X, row_Y, bm)


def column_tile(n: int) -> int:
  return next(bn for bn in COLUMN_TILES if n % bn == 0)


def applies(lhs_PxK: jax.Array, rhs: jax.Array, bm: int, t: Tiles | None = None) -> bool:
  """Whether the kernels take these operands (forward and both gradients): one 16-bit dtype,
  K and N multiples of 64 (every tile divides them), the layout's BM the kernels'."""
  t = t or tiles()
  widths = rhs.shape[1:]  # K and N, in either order
  return (lhs_PxK.dtype == rhs.dtype and lhs_PxK.dtype in KERNEL_DTYPES and bm == t.bm
          and lhs_PxK.shape[1] in widths and all(w % ALIGN == 0 for w in widths)
          and ALIGN % t.bk == 0)


def _transforms(dtype):
  swizzle = 128
  return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
          plgpu.SwizzleTransform(swizzle))


def _store(acc_MxN, out_gmem_tile, dtype):
  """One [BM, BN] float32 accumulator tile to global memory through shared memory (TMA)."""
  @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM(acc_MxN.shape, dtype,
                                                      transforms=_transforms(dtype)))
  def _scope(o_smem):
    o_smem[...] = acc_MxN.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, out_gmem_tile)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _gmm_kernel(tile_expert_gmem, lhs_gmem, rhs_gmem, out_gmem, *, t: Tiles, bn: int,
                transpose_rhs: bool):
  p, k = lhs_gmem.shape
  m_tiles, n_tiles = p // t.bm, out_gmem.shape[1] // bn
  transforms = _transforms(lhs_gmem.dtype)

  @mosaic.over_tiles(m_tiles, n_tiles, t.group)
  def _tile(mi, ni):
    expert = tile_expert_gmem[mi]
    steps = jnp.where(expert >= 0, k // t.bk, 0)  # a tile of no expert: zeros

    def acc_scope(acc):
      plgpu.emit_pipeline(
          lambda _, lhs_smem, rhs_smem: plgpu.wgmma(
              acc, lhs_smem, rhs_smem.transpose((1, 0)) if transpose_rhs else rhs_smem),
          grid=(steps,),
          in_specs=[
              plgpu.BlockSpec((t.bm, t.bk), lambda s: (mi, s), transforms=transforms,
                              delay_release=1),
              plgpu.BlockSpec((bn, t.bk) if transpose_rhs else (t.bk, bn),
                              (lambda s: (ni, s)) if transpose_rhs else (lambda s: (s, ni)),
                              transforms=transforms, delay_release=1),
          ],
          max_concurrent_steps=t.stages,
      )(lhs_gmem, rhs_gmem.at[jnp.maximum(expert, 0)])
      return acc[...]

    acc = pl.run_scoped(acc_scope, plgpu.ACC((t.bm, bn), jnp.float32))
    _store(acc, out_gmem.at[pl.ds(mi * t.bm, t.bm), pl.ds(ni * bn, bn)], out_gmem.dtype)


def _tgmm_kernel(tile_start_gmem, tiles_gmem, lhs_gmem, rhs_gmem, out_gmem, *, t: Tiles,
                 bo: int, bn: int):
  experts, k, n = out_gmem.shape
  k_tiles, n_tiles = k // bo, n // bn
  steps_per_tile = t.bm // t.bk
  transforms = _transforms(lhs_gmem.dtype)

  @plgpu.nd_loop((experts, k_tiles * n_tiles), collective_axes="sm")
  def _tile_loop(info):
    x = info.index[0]
    ki, ni = plgpu.planar_snake(info.index[1], (k_tiles, n_tiles), 0, t.group)
    first = tile_start_gmem[x] * steps_per_tile  # in steps of BK rows

    def acc_scope(acc):
      plgpu.emit_pipeline(
          lambda _, lhs_smem, rhs_smem: plgpu.wgmma(acc, lhs_smem.transpose((1, 0)), rhs_smem),
          grid=(tiles_gmem[x] * steps_per_tile,),  # an expert with no rows: zeros
          in_specs=[
              plgpu.BlockSpec((t.bk, bo), lambda s: (first + s, ki), transforms=transforms,
                              delay_release=1),
              plgpu.BlockSpec((t.bk, bn), lambda s: (first + s, ni), transforms=transforms,
                              delay_release=1),
          ],
          max_concurrent_steps=t.stages,
      )(lhs_gmem, rhs_gmem)
      return acc[...]

    acc = pl.run_scoped(acc_scope, plgpu.ACC((bo, bn), jnp.float32))
    _store(acc, out_gmem.at[x, pl.ds(ki * bo, bo), pl.ds(ni * bn, bn)], out_gmem.dtype)


def _call(body, out_type, *args):
  return plgpu.kernel(
      body, out_type=out_type, grid=(mosaic.num_sms(),), grid_names=("sm",),
      kernel_name=body.func.__name__.lstrip("_"),  # gmm_kernel / tgmm_kernel in profiles
      interpret=mosaic.interpret_params(),
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup))(*args)


def gmm(lhs_PxK, rhs, tile_expert_M, transpose_rhs: bool, t: Tiles | None = None):
  """The _gmm kernel: out_PxN (lhs's dtype); rhs [X, K, N], or [X, N, K] with transpose_rhs."""
  t = t or tiles()
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  body = functools.partial(_gmm_kernel, t=t, bn=column_tile(n), transpose_rhs=transpose_rhs)
  out = jax.ShapeDtypeStruct((lhs_PxK.shape[0], n), lhs_PxK.dtype)
  return _call(body, out, tile_expert_M, lhs_PxK, rhs)


def tgmm(lhs_PxK, rhs_PxN, tile_start_X, tiles_X, t: Tiles | None = None):
  """The _tgmm kernel: out_XxKxN[x] = lhs[rows of x]^T @ rhs[rows of x] (lhs's dtype)."""
  t = t or tiles()
  (_, k), n = lhs_PxK.shape, rhs_PxN.shape[1]
  body = functools.partial(_tgmm_kernel, t=t, bo=next(b for b in ROW_TILES if k % b == 0),
                           bn=column_tile(n))
  out = jax.ShapeDtypeStruct((tile_start_X.shape[0], k, n), lhs_PxK.dtype)
  return _call(body, out, tile_start_X, tiles_X, lhs_PxK, rhs_PxN)


def grouped_matmul_reference(lhs_PxK, rhs, groups: Groups, transpose_rhs: bool = False):
  """out_PxN = each row tile's rows times its expert's matrix, in XLA: ragged_dot over the
  groups' padded extents (rows of no expert are zero), float32 accumulation, lhs's dtype out."""
  if transpose_rhs:
    rhs = rhs.transpose(0, 2, 1)
  rows = jnp.zeros(rhs.shape[0], jnp.int32).at[groups.tile_expert_M].add(
      groups.bm, mode="drop")  # tiles of no expert (-1) dropped
  return lax.ragged_dot(lhs_PxK, rhs, rows,
                        preferred_element_type=jnp.float32).astype(lhs_PxK.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _kernel_matmul(lhs_PxK, rhs, groups_arrays, transpose_rhs, t):
  return gmm(lhs_PxK, rhs, groups_arrays[0], transpose_rhs, t)


def _kernel_matmul_fwd(lhs_PxK, rhs, groups_arrays, transpose_rhs, t):
  return gmm(lhs_PxK, rhs, groups_arrays[0], transpose_rhs, t), (lhs_PxK, rhs, groups_arrays)


def _kernel_matmul_bwd(transpose_rhs, t, residuals, d_out_PxN):
  lhs_PxK, rhs, (tile_expert_M, tile_start_X, tiles_X) = residuals
  d_lhs = gmm(d_out_PxN, rhs, tile_expert_M, not transpose_rhs, t)
  if transpose_rhs:  # rhs [X, N, K]: d rhs[x] = d_out[rows of x]^T @ lhs[rows of x]
    d_rhs = tgmm(d_out_PxN, lhs_PxK, tile_start_X, tiles_X, t)
  else:
    d_rhs = tgmm(lhs_PxK, d_out_PxN, tile_start_X, tiles_X, t)
  return d_lhs, d_rhs, None


_kernel_matmul.defvjp(_kernel_matmul_fwd, _kernel_matmul_bwd)


def grouped_matmul(lhs_PxK, rhs, groups: Groups, transpose_rhs: bool = False, force: bool = False,
                   t: Tiles | None = None):
  """out_PxN: the row tiles of lhs times their experts' matrices (rhs [X, K, N], or [X, N, K]
  with transpose_rhs). The kernels where they apply on a GPU (force: off GPU too, in the
  interpreter, for tests), else the reference. Accumulation in float32, lhs's dtype out."""
  t = t or tiles()
  on = (mosaic.on_gpu() or force) and applies(lhs_PxK, rhs, groups.bm, t)
  if not on:
    return grouped_matmul_reference(lhs_PxK, rhs, groups, transpose_rhs)
  arrays = (groups.tile_expert_M, groups.tile_start_X, groups.tiles_X)
  return _kernel_matmul(lhs_PxK, rhs, arrays, transpose_rhs, t)
