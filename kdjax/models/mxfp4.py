"""MXFP4 weights (OCP Microscaling: FP4 E2M1 elements, one E8M0 scale per 32), as gpt-oss stores
its experts.

A row of K values is Z = K / 32 blocks. A block is 16 bytes holding its 32 E2M1 codes, two per
byte (the low nibble is the even element, the high nibble the odd one), and one E8M0 scale byte s
meaning 2^(s - 127). E2M1 is a sign bit, two exponent bits (bias 1) and one mantissa bit: the
magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.

Shape letters: Z blocks of 32 values along a row; the leading axes are the matrix's others.
"""
import jax
import jax.numpy as jnp

BLOCK = 32  # values per scale
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize(blocks_Zx16: jax.Array, scales_Z: jax.Array, dtype) -> jax.Array:
  """[..., Z, 16] uint8 codes and [..., Z] uint8 exponents -> [..., Z * 32] values in dtype.

  Exact in bfloat16 and float32 (two significant bits times a power of two) while the exponent
  stays in the dtype's range; inside a jitted forward pass XLA fuses it into its consumer's input.
  """
  lut_16 = jnp.asarray(E2M1_VALUES, jnp.float32)
  low = lut_16[(blocks_Zx16 & 0xF).astype(jnp.int32)]
  high = lut_16[(blocks_Zx16 >> 4).astype(jnp.int32)]
  values_Zx32 = jnp.stack([low, high], axis=-1).reshape(*blocks_Zx16.shape[:-1], BLOCK)
  # 2^(s - 127) as the float32 with exponent field s (exact; exp2 is not on every backend);
  # s = 0 is the subnormal 2^-127.
  bits_Z = jnp.where(scales_Z > 0, scales_Z.astype(jnp.uint32) << 23, jnp.uint32(1 << 22))
  scale_Zx1 = jax.lax.bitcast_convert_type(bits_Z, jnp.float32)[..., None]
  out = (values_Zx32 * scale_Zx1).astype(dtype)
  return out.reshape(*blocks_Zx16.shape[:-2], blocks_Zx16.shape[-2] * BLOCK)
