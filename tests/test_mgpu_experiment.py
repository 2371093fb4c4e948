"""experiments/mgpu_logits.py (a Mosaic GPU kernel, run by its interpreter here) against its XLA
reference: two vocabulary windows written into one array in place, with and without a shift."""
import jax
import jax.numpy as jnp
import numpy as np

from experiments import mgpu_logits as mgpu

TILES = mgpu.INTERPRET_TILES  # 128-row CTA tiles


def test_windows_in_place_match_reference():
  rng = np.random.default_rng()
  h = jnp.asarray(rng.normal(size=(256, 64)), jnp.bfloat16)
  w = jnp.asarray(rng.normal(size=(64, 640)) * 0.2, jnp.bfloat16)
  shift = jnp.asarray(rng.normal(size=(256,)), jnp.float32)
  first, second = range(0, 256), range(256, 512)

  @jax.jit
  def kernel(h, w, shift):
    e, z1, s1, m1 = mgpu.project(h, w, first, 0.7, None, None, TILES)
    e_ref = jax.new_ref(e)
    z2, s2, m2 = mgpu.project(h, w, second, 0.7, shift, e_ref, TILES)
    s3, m3 = mgpu.project(h, w, first, 0.7, shift, e_ref, TILES, with_z=False)
    return e_ref[...][:, :512], z1, s1, m1, z2, s2, m2, s3, m3

  @jax.jit
  def reference(h, w, shift):
    e, z1, s1, m1 = mgpu.project_reference(h, w, first, 0.7, None, None, TILES.bn)
    e, z2, s2, m2 = mgpu.project_reference(h, w, second, 0.7, shift, e, TILES.bn)
    e, _, s3, m3 = mgpu.project_reference(h, w, first, 0.7, shift, e, TILES.bn)
    return e[:, :512], z1, s1, m1, z2, s2, m2, s3, m3

  for i, (got, want) in enumerate(zip(kernel(h, w, shift), reference(h, w, shift))):
    got, want = (np.asarray(x, np.float32) for x in (got, want))
    assert got.shape == want.shape
    # e: rounded to bf16 from float32 values that may differ in the last bit, so one bf16 ulp
    rtol = 2 ** -7 if i == 0 else 2e-5
    np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-6 * np.abs(want).max())
