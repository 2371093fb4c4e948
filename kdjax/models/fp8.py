"""FP8 matmuls for training (ModelConfig.fp8_matmuls): a block's projections on Hopper's FP8
tensor cores, twice the rate of bf16's.

dot(x_MxK, w_KxN) quantizes both operands to float8_e4m3fn, each with one scale per tensor taken
from its own largest magnitude (current scaling: no state to carry between steps), multiplies,
and returns x's dtype. Its backward quantizes the incoming gradient to float8_e5m2 (more range,
less precision) the same way and computes both products from the forward's FP8 operands, which
are all it keeps: one byte a value where bf16 keeps two. The gradients are those of the
quantized product (the straight-through rule of FP8 training recipes).

Scales are powers of two, so a value's dequantization q * s is exact in any float dtype. Each
product is a dot of the FP8 arrays themselves, written in x's dtype, then scaled. Two other ways
lost time (BENCHMARKS.md, "FP8 projections"): dequantize -> dot (the pattern cuBLASLt's FP8
rewrite looks for) lost the FP8 GEMM to XLA's Triton GEMM rewriter, which runs first and took
the dequantized bf16 operands; a float32 result scaled, then rounded, made cuBLASLt write the
float32 product and XLA convert it in a pass of its own (an H100, 2026-12-06). dot_reference is
the same product with the FP8 operands converted to float32 first.

XLA's Triton GEMMs are off in a process that trains with FP8 (prepare_compiler): its autotuner
otherwise times many Triton tilings of every FP8 GEMM, and the 8K step's set-up took 328 s
against 117 s without them, on an H100, its step no slower (BENCHMARKS.md, "FP8 projections
measured", 2026-12-06).
"""
import logging
import math
import os

import jax
import jax.numpy as jnp

E4M3 = jnp.float8_e4m3fn  # activations and weights: 3 mantissa bits, max 448
E5M2 = jnp.float8_e5m2    # gradients: 2 mantissa bits, max 57344


TRITON_GEMM = "xla_gpu_enable_triton_gemm"


def prepare_compiler(enabled: bool) -> None:
  """With FP8 on, XLA's Triton GEMMs off for the process (XLA_FLAGS), unless XLA_FLAGS already
  sets them: every GEMM goes to cuBLAS(Lt), sparing the autotuner its Triton tilings of each FP8
  GEMM (see the module's doc; bf16 steps were no slower without them either, BENCHMARKS.md,
  "the 128K step's floor, documents per cuDNN call, XLA flags", 2026-12-05). XLA reads
  XLA_FLAGS when JAX first compiles: call before (kdjax.main does)."""
  flags = os.environ.get("XLA_FLAGS", "")
  if enabled and TRITON_GEMM not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --{TRITON_GEMM}=false".strip()


def _capability(device) -> tuple[int, int] | None:
  """A GPU's compute capability (major, minor); None for other devices or where it is not said."""
  found = getattr(device, "compute_capability", None) if device.platform == "gpu" else None
  return tuple(map(int, found.split("."))) if found else None


def warn_without_fp8_cores(enabled: bool, devices=None) -> None:
  """Logs a warning when FP8 is on and a GPU among devices (default jax.devices()) predates FP8
  tensor cores (compute capability 8.9: Ada, Hopper): there the products cannot run at FP8's
  rate (kdjax has not been run on such a GPU with FP8)."""
  old = sorted({f"{d.device_kind} ({d.compute_capability})" for d in devices or jax.devices()
                if (_capability(d) or (9, 0)) < (8, 9)}) if enabled else []
  if old:
    logging.warning("fp8_matmuls is on but %s has no FP8 tensor cores (compute capability "
                    "8.9 or later): expect no speed from it; set student.fp8_matmuls=False",
                    ", ".join(old))


def quantize(x: jax.Array, fp8_dtype, axis: int | None = None) -> tuple[jax.Array, jax.Array]:
  """(q, scale): x ~ q * scale, q in fp8_dtype, scale a float32 power of two putting x's largest
  magnitude at or just under the format's largest finite value (1 for an all-zero x). axis: one
  scale per slice along it (kept as a size-1 axis), else one for the tensor (a scalar)."""
  amax = jnp.max(jnp.abs(x), axis=axis, keepdims=axis is not None).astype(jnp.float32)
  fmax = float(jnp.finfo(fp8_dtype).max)
  # ceil(log2(amax / fmax)) exactly: frexp's mantissa is in [0.5, 1), 0.5 at a power of two.
  mantissa, exponent = jnp.frexp(jnp.where(amax > 0, amax / fmax, 1.0))
  scale = jnp.ldexp(jnp.float32(1), jnp.where(mantissa == 0.5, exponent - 1, exponent))
  q = jnp.clip(x.astype(jnp.float32) / scale, -fmax, fmax).astype(fp8_dtype)
  return q, scale


def _product(a, a_scale, b, b_scale, dims, dtype):
  """(a * a_scale) . (b * b_scale) contracted over dims: the FP8 operands go into the dot as they
  are (XLA's GPU compiler makes it cuBLASLt's FP8 GEMM, or with Triton GEMMs on, a Triton one
  if its autotuner times that faster), its result written in dtype, then scaled: exact, the
  scales being powers of two, and an elementwise multiply XLA folds into the GEMM's alpha or
  fuses into the result's consumers."""
  y = jax.lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=dtype)
  return y * (a_scale * b_scale).astype(dtype)


@jax.custom_vjp
def dot(x_MxK: jax.Array, w_KxN: jax.Array) -> jax.Array:
  """x @ w through FP8 (see the module's doc); the result in x's dtype."""
  return _dot_fwd(x_MxK, w_KxN)[0]


def _dot_fwd(x_MxK, w_KxN):
  if x_MxK.dtype != w_KxN.dtype:
    raise TypeError(f"fp8.dot takes operands of one dtype, got {x_MxK.dtype} and {w_KxN.dtype}")
  qx, sx = quantize(x_MxK, E4M3)
  qw, sw = quantize(w_KxN, E4M3)
  y_MxN = _product(qx, sx, qw, sw, ((1,), (0,)), x_MxK.dtype)
  return y_MxN, (qx, sx, qw, sw)


def _dot_bwd(residuals, g_MxN):
  qx, sx, qw, sw = residuals
  qg, sg = quantize(g_MxN, E5M2)
  dx_MxK = _product(qg, sg, qw, sw, ((1,), (1,)), g_MxN.dtype)
  dw_KxN = _product(qx, sx, qg, sg, ((0,), (0,)), g_MxN.dtype)
  return dx_MxK, dw_KxN


dot.defvjp(_dot_fwd, _dot_bwd)


def dot_reference(x_MxK: jax.Array, w_KxN: jax.Array) -> jax.Array:
  """The same quantized operands, dequantized to float32 and multiplied (no custom rule:
  autodiff gives the reference gradients without the backward's quantization of g)."""
  qx, sx = quantize(x_MxK, E4M3)
  qw, sw = quantize(w_KxN, E4M3)
  return (qx.astype(jnp.float32) * sx) @ (qw.astype(jnp.float32) * sw)


def matmul(spec: str, x: jax.Array, w: jax.Array, use_fp8: bool) -> jax.Array:
  """jnp.einsum(spec, x, w) for a projection: x's last axes contracted with w's first ones
  (e.g. "btd,dhe->bthe", "bthe,hed->btd"). Through dot when use_fp8, else XLA's einsum in
  x's dtype."""
  if not use_fp8:
    return jnp.einsum(spec, x, w)
  x_axes, w_axes = spec.split("->")[0].split(",")
  n = len(set(x_axes) & set(w_axes))
  if x_axes[len(x_axes) - n:] != w_axes[:n]:
    raise ValueError(f"fp8.matmul contracts x's last axes with w's first ones, got {spec!r}")
  k = math.prod(w.shape[:n])
  y_MxN = dot(x.reshape(-1, k), w.reshape(k, -1))
  return y_MxN.reshape(x.shape[:x.ndim - n] + w.shape[n:])
