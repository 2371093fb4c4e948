"""The SwiGLU MLP's two input matmuls with the gating in their epilogue: a Mosaic GPU kernel
(Hopper).

    swiglu(y [N, D], w_gate [D, F], w_up [D, F]) -> h [N, F] = silu(y @ w_gate) * (y @ w_up)

in y's dtype (bf16 or f16), from two float32 accumulators. XLA runs this as two GEMMs, each
writing its [N, F] product, and a fusion that reads both back and writes h. In the 8B teacher's
step at 32K that fusion alone took 2.7% of the step (BENCHMARKS.md, the teacher's profile), and
the two products cost 4 bytes of traffic per entry of h on top. Here each CTA computes one
[2 * BM, BN] tile of both products in one pass over y's rows and writes only h: neither product
reaches memory, and y's tiles are read once for both.

Structure as logits_exp's (kdjax/kernels/mgpu.py): a persistent kernel (one CTA per SM looping
over output tiles in a snake order that reuses the weights' column band from L2), a memory
warpgroup streaming [2 * BM, BK] tiles of y and [BK, BN] tiles of both weights through shared
memory with TMA, two compute warpgroups each owning BM rows with two wgmma accumulators (gate and
up), an epilogue storing h through two shared-memory slots with TMA. BM is 64, so the two
accumulators take the registers of logits_exp's one [128, BN] tile; every wgmma is still
64 x 128, and the CTA's [128, 2 * BN] of weight columns per [128, BK] of y is the same reuse as a
[256, BN] GEMM tile. Rows are padded to the CTA's; needs D % BK == 0 and F % BN == 0 (`fits`).
Off GPU it runs in Mosaic GPU's interpreter, so CPU tests cover the same code.

Under a mesh of several devices XLA's partitioner runs the kernel on each device's rows
(`partitioned`). Gradients (custom_vjp) are the reference's, recomputing both
products: the kernel serves forward passes (the teacher's cache stage); a differentiated model
gains nothing from it.

Reference: `swiglu_reference` (XLA). Shape letters: N rows (positions), D model width (the
contraction), F the MLP's hidden width; BM, BN, BK the matmul's tile sizes (rows per warpgroup,
columns, contraction).
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import custom_partitioning, pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import NamedSharding, PartitionSpec as P

from kdjax.kernels import mgpu, mosaic


@dataclasses.dataclass(frozen=True)
class Tiles:
  bm: int = 64    # rows per compute warpgroup (the CTA tile has 2 * bm rows)
  bn: int = 128   # columns of h per tile, and of each accumulator
  bk: int = 64
  stages: int = 3  # 48 KiB of operand tiles a stage (bf16), h's slots 32 KiB
  epi: int = 64   # rows and columns per epilogue store of h
  group: int = 16  # row tiles visited per column band (the weights' band is reused from L2)


GPU_TILES = Tiles()
INTERPRET_TILES = Tiles(stages=2, group=2)
DTYPES = (jnp.bfloat16, jnp.float16)  # wgmma's 16-bit inputs


def tiles() -> Tiles:
  return GPU_TILES if mosaic.on_gpu() else INTERPRET_TILES


def fits(dim: int, width: int, t: Tiles | None = None) -> bool:
  """Whether swiglu takes a model width D and hidden width F (rows are padded)."""
  t = t or tiles()
  return dim % t.bk == 0 and width % t.bn == 0


def swiglu_reference(y_NxD, w_gate_DxF, w_up_DxF):
  """silu(y @ w_gate) * (y @ w_up) from float32 products, rounded once to y's dtype."""
  gate_NxF = jnp.dot(y_NxD, w_gate_DxF, preferred_element_type=jnp.float32)
  up_NxF = jnp.dot(y_NxD, w_up_DxF, preferred_element_type=jnp.float32)
  return (jax.nn.silu(gate_NxF) * up_NxF).astype(y_NxD.dtype)


def _kernel(y_gmem, wg_gmem, wu_gmem, h_gmem, *, t: Tiles):
  m, k = y_gmem.shape
  cta_m = 2 * t.bm
  m_tiles, n_tiles, k_steps = m // cta_m, h_gmem.shape[1] // t.bn, k // t.bk
  dtype = y_gmem.dtype

  def spec(shape, index):
    return plgpu.BlockSpec(shape, index, transforms=mosaic.smem_transforms(t.bk, dtype.itemsize),
                           memory_space=plgpu.SMEM)

  def pipeline(body, context):
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(k_steps,), memory_registers=40,
        in_specs=[spec((cta_m, t.bk), lambda ki: (0, ki)),
                  spec((t.bk, t.bn), lambda ki: (ki, 0)),
                  spec((t.bk, t.bn), lambda ki: (ki, 0))],
        wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=t.stages, compute_context=context)

  noop = lambda *_, **__: None

  @functools.partial(
      pl.run_scoped,
      allocs=pipeline(noop, noop).get_allocations(y_gmem, wg_gmem, wu_gmem),
      # Per compute warpgroup two slots each: one is filled while the other's copy runs.
      h_smem=plgpu.SMEM((2, 2, t.epi, t.epi), dtype,
                        transforms=mosaic.smem_transforms(t.epi, dtype.itemsize)),
      collective_axes="wg")
  def _scope(allocs, h_smem):
    wg = lax.axis_index("wg")

    @mosaic.over_tiles(m_tiles, n_tiles, t.group)
    def _tile(mi, ni):
      row0 = mi * cta_m + wg * t.bm

      def context(run):
        @functools.partial(pl.run_scoped, gate=plgpu.ACC((t.bm, t.bn), jnp.float32),
                           up=plgpu.ACC((t.bm, t.bn), jnp.float32))
        def _accs(gate, up):
          run((gate, up))
          g = gate[...]
          # silu(g) = g * sigmoid(g) = g / (1 + 2^(-g log2 e)): one ex2 per entry. A very
          # negative g overflows the power to inf and gives -0, the limit.
          h = (g / (1.0 + jnp.exp2(g * -mgpu.LOG2_E)) * up[...]).astype(dtype)
          mosaic.store_tile(h, h_smem.at[wg], h_gmem, row0, ni * t.bn, t.epi)

      def mma(_, y_smem, wg_smem, wu_smem, accs):
        gate, up = accs
        rows = y_smem.at[pl.ds(wg * t.bm, t.bm)]
        plgpu.wgmma(gate, rows, wg_smem)
        plgpu.wgmma(up, rows, wu_smem)
        plgpu.wgmma_wait(0)
        return accs

      pipeline(mma, context)(
          y_gmem.at[pl.ds(mi * cta_m, cta_m), :],
          wg_gmem.at[:, pl.ds(ni * t.bn, t.bn)],
          wu_gmem.at[:, pl.ds(ni * t.bn, t.bn)],
          allocations=allocs)

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _swiglu_kernel(y_NxD, w_gate_DxF, w_up_DxF, t: Tiles):
  (rows, dim), width = y_NxD.shape, w_gate_DxF.shape[1]
  dtypes = {y_NxD.dtype, w_gate_DxF.dtype, w_up_DxF.dtype}
  if (not fits(dim, width, t) or w_up_DxF.shape != w_gate_DxF.shape or len(dtypes) > 1
      or y_NxD.dtype not in DTYPES):
    raise ValueError(f"swiglu needs D % {t.bk} == 0, F % {t.bn} == 0 and one 16-bit dtype; got y "
                     f"{y_NxD.shape} {y_NxD.dtype}, w_gate {w_gate_DxF.shape} {w_gate_DxF.dtype}, "
                     f"w_up {w_up_DxF.shape} {w_up_DxF.dtype}")
  pad = -rows % (2 * t.bm)  # zero rows give zero h, sliced off
  y_NxD = jnp.pad(y_NxD, ((0, pad), (0, 0)))
  call = plgpu.kernel(
      functools.partial(_kernel, t=t),
      out_type=jax.ShapeDtypeStruct((rows + pad, width), y_NxD.dtype),
      grid=(mosaic.num_sms(),), grid_names=("sm",), num_threads=3,
      kernel_name="mosaic_swiglu",  # its name in profiles
      thread_name="wg", interpret=mosaic.interpret_params(),
      compiler_params=plgpu.CompilerParams(
          approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
  return call(y_NxD, w_gate_DxF, w_up_DxF)[:rows]


def partitioned(per_shard):
  """per_shard(y [N, D], w_gate [D, F], w_up [D, F]) -> [N, F] as one op XLA's partitioner
  splits by rows: each device runs it on its rows of y with whole weights (gathered where they
  are sharded, as XLA gathers a fully sharded weight for its matmul) and holds those rows of h.
  Without this XLA cannot partition the kernel's custom call and would gather every operand onto
  every device. The columns are never split: the teacher's mesh is one fsdp group, and splitting
  both by one axis is not possible."""

  @custom_partitioning.custom_partitioning
  def op(y_NxD, w_gate_DxF, w_up_DxF):
    return per_shard(y_NxD, w_gate_DxF, w_up_DxF)

  def rows(mesh, arg_shapes):
    spec_y = tuple(arg_shapes[0].sharding.spec) + (None,)
    return NamedSharding(mesh, P(spec_y[0], None))

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    whole = NamedSharding(mesh, P(None, None))
    return mesh, per_shard, rows(mesh, arg_shapes), (rows(mesh, arg_shapes), whole, whole)

  op.def_partition(partition, infer_sharding_from_operands=lambda mesh, a, _: rows(mesh, a),
                   sharding_rule="n d, d f, d f -> n f", need_replication_factors=("d", "f"))
  return op


@functools.cache
def _op(t: Tiles):
  kernel = functools.partial(_swiglu_kernel, t=t)
  # Mosaic GPU's interpreter (off GPU) runs host callbacks, whose effects custom_partitioning
  # cannot carry; it runs on one device there anyway.
  return partitioned(kernel) if mosaic.on_gpu() else kernel


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _swiglu(y_NxD, w_gate_DxF, w_up_DxF, t):
  return _op(t)(y_NxD, w_gate_DxF, w_up_DxF)


def _swiglu_fwd(y_NxD, w_gate_DxF, w_up_DxF, t):
  return _op(t)(y_NxD, w_gate_DxF, w_up_DxF), (y_NxD, w_gate_DxF, w_up_DxF)


def _swiglu_bwd(t, residuals, d_h_NxF):
  del t
  return jax.vjp(swiglu_reference, *residuals)[1](d_h_NxF)


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def swiglu(y_NxD, w_gate_DxF, w_up_DxF, t: Tiles | None = None):
  """See the module doc: h [N, F] in y's dtype. Raises ValueError for shapes or dtypes it cannot
  take (D % BK, F % BN, one 16-bit dtype)."""
  return _swiglu(y_NxD, w_gate_DxF, w_up_DxF, t or tiles())
