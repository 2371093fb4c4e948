"""kdjax.kernels.mgpu.logits_exp (a Mosaic GPU kernel, run by its interpreter here) against its
XLA reference: a new e, then a shifted repeat written into it in place."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdjax.kernels import mgpu

TILES = mgpu.INTERPRET_TILES  # 128-row CTA tiles


def test_logits_exp_matches_reference(rng):
  h = jnp.asarray(rng.normal(size=(256, 128)), jnp.bfloat16)
  w = jnp.asarray(rng.normal(size=(128, 384)) * 0.2, jnp.bfloat16)
  shift = jnp.asarray(rng.normal(size=(256,)), jnp.float32)

  @jax.jit
  def kernel(h, w, shift):
    e, s1, m1 = mgpu.logits_exp(h, w, 0.7, t=TILES)
    e_ref = jax.new_ref(e)
    s2, m2 = mgpu.logits_exp(h, w, 0.7, shift, e_ref, t=TILES)
    return e, jax.freeze(e_ref), s1, m1, s2, m2

  @jax.jit
  def reference(h, w, shift):
    e1, s1, m1 = mgpu.logits_exp_reference(h, w, 0.7, bn=TILES.bn)
    e2, s2, m2 = mgpu.logits_exp_reference(h, w, 0.7, shift, bn=TILES.bn)
    return e1, e2, s1, m1, s2, m2

  for i, (got, want) in enumerate(zip(kernel(h, w, shift), reference(h, w, shift))):
    got, want = (np.asarray(x, np.float32) for x in (got, want))
    assert got.shape == want.shape
    # e: rounded to bf16 from float32 values that may differ in the last bits, so one bf16 ulp
    rtol = 2 ** -7 if i < 2 else 2e-5
    np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-6 * np.abs(want).max())


def test_logits_exp_refuses_shapes_it_cannot_tile():
  h = jnp.zeros((100, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="rows % 128"):
    mgpu.logits_exp(h, jnp.zeros((64, 256), jnp.bfloat16), 1.0, t=TILES)
