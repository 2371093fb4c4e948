"""kdjax.models.fp8: the quantization against numpy, the product and both gradients against the
same quantized operands multiplied in float64."""
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kdjax.models import fp8


def _quantized64(a, fp8_dtype):
  """a's fp8 values times their power-of-two scale, in float64, computed in numpy."""
  a = np.asarray(a, np.float64)
  fmax = float(ml_dtypes.finfo(fp8_dtype).max)
  amax = np.abs(a).max()
  scale = 2.0 ** np.ceil(np.log2(amax / fmax)) if amax > 0 else 1.0
  return np.clip(a / scale, -fmax, fmax).astype(fp8_dtype).astype(np.float64) * scale


@pytest.mark.parametrize("fp8_dtype", [fp8.E4M3, fp8.E5M2])
@pytest.mark.parametrize("magnitude", [1e-6, 1.0, 3e4])
def test_quantize_matches_numpy(rng, fp8_dtype, magnitude):
  x = jnp.asarray(rng.normal(size=(33, 17)) * magnitude, jnp.float32)
  q, scale = fp8.quantize(x, fp8_dtype)
  assert q.dtype == fp8_dtype and scale.dtype == jnp.float32
  got = np.asarray(q, np.float64) * float(scale)
  np.testing.assert_array_equal(got, _quantized64(x, fp8_dtype))
  fmax = float(jnp.finfo(fp8_dtype).max)
  assert fmax / 2 <= np.abs(np.asarray(q, np.float64)).max() <= fmax  # the range is used


def test_quantize_zero_is_zero():
  q, scale = fp8.quantize(jnp.zeros((4, 4), jnp.bfloat16), fp8.E4M3)
  assert float(scale) == 1.0 and not np.asarray(q, np.float32).any()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m,k,n", [(37, 96, 53), (128, 64, 256), (1, 8, 3)])
def test_dot_and_gradients_match_float64(rng, dtype, m, k, n):
  x = jnp.asarray(rng.normal(size=(m, k)), dtype)
  w = jnp.asarray(rng.normal(size=(k, n)) * k ** -0.5, dtype)
  g = jnp.asarray(rng.normal(size=(m, n)), dtype)
  y, vjp = jax.vjp(jax.jit(fp8.dot), x, w)
  dx, dw = vjp(g)
  assert y.dtype == dx.dtype == dw.dtype == dtype
  qx, qw, qg = _quantized64(x, fp8.E4M3), _quantized64(w, fp8.E4M3), _quantized64(g, fp8.E5M2)
  tol = dict(rtol=1e-2, atol=1e-2) if dtype == jnp.bfloat16 else dict(rtol=1e-5, atol=1e-5)
  for got, want in ((y, qx @ qw), (dx, qg @ qw.T), (dw, qx.T @ qg)):
    scale = np.abs(want).max()
    np.testing.assert_allclose(np.asarray(got, np.float64) / scale, want / scale, **tol)


def test_dot_stays_near_the_exact_product(rng):
  """fp8's own error: a few percent of the largest output, e4m3's 3 mantissa bits."""
  x = jnp.asarray(rng.normal(size=(256, 512)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(512, 256)) * 512 ** -0.5, jnp.float32)
  exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  err = np.abs(np.asarray(fp8.dot(x, w)) - exact).max() / np.abs(exact).max()
  assert 1e-3 < err < 0.06


def test_dot_reference_is_the_forward(rng):
  x = jnp.asarray(rng.normal(size=(20, 24)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(24, 12)), jnp.float32)
  np.testing.assert_array_equal(fp8.dot(x, w), fp8.dot_reference(x, w))


def test_dot_refuses_mixed_dtypes():
  with pytest.raises(TypeError, match="one dtype"):
    fp8.dot(jnp.ones((2, 3), jnp.bfloat16), jnp.ones((3, 4), jnp.float32))


@pytest.mark.parametrize("use_fp8", [False, True])
@pytest.mark.parametrize("spec,x_shape,w_shape", [
    ("btd,dhe->bthe", (2, 5, 12), (12, 3, 4)), ("bthe,hed->btd", (2, 5, 3, 4), (3, 4, 12)),
    ("btd,df->btf", (1, 7, 12), (12, 20))])
def test_matmul_is_the_einsum(rng, use_fp8, spec, x_shape, w_shape):
  x = jnp.asarray(rng.normal(size=x_shape), jnp.bfloat16)
  w = jnp.asarray(rng.normal(size=w_shape), jnp.bfloat16)
  y = fp8.matmul(spec, x, w, use_fp8)
  if use_fp8:  # the einsum of the operands as FP8 holds them (exact in float32)
    x, w = ((q.astype(jnp.float32) * s) for q, s in (fp8.quantize(x, fp8.E4M3),
                                                      fp8.quantize(w, fp8.E4M3)))
  want = jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)
  assert y.shape == want.shape and y.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(y, np.float32), want,
                             atol=0.01 * float(jnp.abs(want).max()))


def test_matmul_refuses_other_contractions():
  with pytest.raises(ValueError, match="last axes"):
    fp8.matmul("dt,df->tf", jnp.ones((3, 2)), jnp.ones((3, 4)), True)


def test_fp8_models_keep_the_mlp_out_of_swiglus_kernel(monkeypatch):
  """The kernel computes in bf16: "auto" leaves an FP8 model's MLP to the projections, "pallas"
  is refused with what to do."""
  from kdjax.kernels import mosaic
  from kdjax.models import llama
  monkeypatch.setattr(mosaic, "on_gpu", lambda: True)
  shapes = dict(vocab_size=32, d_model=128, d_ff=256, dtype="bfloat16", fp8_matmuls=True)
  assert not llama.ModelConfig(mlp_impl="auto", **shapes).mlp_kernel()
  assert llama.ModelConfig(mlp_impl="auto", **{**shapes, "fp8_matmuls": False}).mlp_kernel()
  with pytest.raises(ValueError, match="fp8_matmuls on: use 'xla'"):
    llama.ModelConfig(mlp_impl="pallas", **shapes).validate("student.")


@pytest.mark.parametrize("enabled, before, after", [
    (True, None, "--xla_gpu_enable_triton_gemm=false"),
    (True, "--xla_dump_to=d", "--xla_dump_to=d --xla_gpu_enable_triton_gemm=false"),
    (True, "--xla_gpu_enable_triton_gemm=true", "--xla_gpu_enable_triton_gemm=true"),  # the user's
    (False, None, None),
    (False, "--xla_dump_to=d", "--xla_dump_to=d"),
])
def test_prepare_compiler_turns_triton_gemms_off_only_for_fp8(monkeypatch, enabled, before, after):
  if before is None:
    monkeypatch.delenv("XLA_FLAGS", raising=False)
  else:
    monkeypatch.setenv("XLA_FLAGS", before)
  fp8.prepare_compiler(enabled)
  assert os.environ.get("XLA_FLAGS") == after


class FakeDevice:
  def __init__(self, platform, kind="", capability=""):
    self.platform, self.device_kind, self.compute_capability = platform, kind, capability


@pytest.mark.parametrize("enabled, devices, warns", [
    (True, [FakeDevice("gpu", "NVIDIA A100", "8.0")], True),
    (True, [FakeDevice("gpu", "NVIDIA H200", "9.0")], False),
    (True, [FakeDevice("gpu", "NVIDIA L4", "8.9")], False),
    (True, [FakeDevice("cpu")], False),
    (False, [FakeDevice("gpu", "NVIDIA A100", "8.0")], False),
])
def test_fp8_warns_on_gpus_without_fp8_tensor_cores(caplog, enabled, devices, warns):
  fp8.warn_without_fp8_cores(enabled, devices)
  assert ("no FP8 tensor cores" in caplog.text) == warns
  assert ("NVIDIA A100 (8.0)" in caplog.text) == warns


def test_fp8_check_passes_devices_that_do_not_say(caplog):
  device = FakeDevice("gpu", "a GPU")
  del device.compute_capability
  fp8.warn_without_fp8_cores(True, [device])
  assert not caplog.text
