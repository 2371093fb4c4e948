"""impl "pallas" on its fused path (kdjax.loss.fused: the logits matmul with exp fused, the
Mosaic GPU kernel run by its interpreter here) against conftest's float64 computation (that of
test_topk_kl), with the top-k and label logits read back from bf16 E as the path does; chunk sizing.
"""
import jax
import jax.numpy as jnp
import pytest

from kdjax.kernels import mgpu
from kdjax.loss import chunked, fused, objectives, topk_kl


def _spy_fused(monkeypatch):
  """Records each call of the fused kernel (True when shifted, i.e. a repeated chunk)."""
  calls, kernel = [], mgpu.logits_exp
  monkeypatch.setattr(mgpu, "logits_exp", lambda h, w, scale, shift=None, *a, **kw: (
      calls.append(shift is not None), kernel(h, w, scale, shift, *a, **kw))[1])
  return calls


# The fused path: bf16, width % 64 == 0, vocabulary % 128 == 0, one softmax (no CE at tau != 1);
# N = 300 rows in 256-row chunks (the interpreter's kernel takes 128-row multiples).
@pytest.mark.parametrize("objective,tau,ce_weight", [
    (objective, 1.0, 0.3) for objective in objectives.OBJECTIVES] + [("tail", 2.0, 0.0)])
def test_pallas_fused_path_matches_float64(monkeypatch, objective, tau, ce_weight, rng, make_inputs,
                                           numpy_loss, run_loss, assert_close, tol):
  calls = _spy_fused(monkeypatch)
  inputs = make_inputs((2, 150), 64, 384, 100, jnp.bfloat16, with_labels=ce_weight > 0)
  cotangent = float(rng.uniform(0.5, 2.0))
  value, aux, (dh, dw) = run_loss(inputs, cotangent, objective=objective, temperature=tau,
                                  ce_weight=ce_weight, impl="pallas", chunk_size=256)
  assert calls == [False, True], calls  # traced once: the kernel, then the repeat's
  want = numpy_loss(inputs, objective, tau, ce_weight, readback=True)
  bf16_tol = tol[jnp.bfloat16]
  assert_close("loss", value, want["loss"], bf16_tol["loss"])
  assert_close("kl", aux["kl"], want["kl"], bf16_tol["loss"])
  assert_close("ce", aux["ce"], want["ce"], bf16_tol["loss"])
  assert_close("dhidden", dh, cotangent * want["dh"], bf16_tol["grad"])
  assert_close("dlm_head", dw, cotangent * want["dw"], bf16_tol["grad"])
  # Against the exact definition: each read-back log q is within bf16's 2^-8 relative rounding.
  exact = numpy_loss(inputs, objective, tau, ce_weight)
  assert abs(float(value) - exact["loss"]) <= (2 * tau ** 2 + ce_weight) * 2 ** -8


def test_pallas_fused_path_large_logits_and_few_rows(make_inputs, numpy_loss, run_loss,
                                                     assert_close, tol):
  """Logits of several hundred: every row is repeated with a shift, and the top-k entries far
  below the row maximum (E underflows) get exact logits. 50 rows: padded to one 128-row chunk."""
  for rows, scale in (((2, 150), 40.0), ((50,), 1.0)):
    inputs = make_inputs(rows, 64, 256, 100, jnp.bfloat16)
    inputs["hidden"] = (inputs["hidden"].astype(jnp.float32) * scale).astype(jnp.bfloat16)
    want = numpy_loss(inputs, "sparse", 1.0, 0.3, readback=True)
    value, _, (dh, dw) = run_loss(inputs, 1.0, objective="sparse", ce_weight=0.3, impl="pallas")
    assert_close("loss", value, want["loss"], tol[jnp.bfloat16]["loss"])
    assert_close("dhidden", dh, want["dh"], tol[jnp.bfloat16]["grad"])
    assert_close("dlm_head", dw, want["dw"], tol[jnp.bfloat16]["grad"])
    alone = jax.jit(lambda h, w: topk_kl.topk_kl_loss(
        h, w, inputs["topk_ids"], inputs["topk_logprobs"], inputs["mask"],
        labels=inputs["labels"], ce_weight=0.3, impl="pallas"))(inputs["hidden"],
                                                                 inputs["lm_head"])
    assert_close("loss alone", alone, want["loss"], tol[jnp.bfloat16]["loss"])


def test_pallas_fused_chunk_sizes(monkeypatch):
  """On the GPU (256-row multiples): chunks tile the rows, E fits a sixth of the memory the
  loss cannot avoid (or 768 MiB), and balanced chunks leave no rows recomputed at A/32K."""
  monkeypatch.setattr(fused, "row_multiple", lambda: 256)
  spec = objectives.LossSpec("sparse", 1.0, 0.0, False)
  for tokens, dim, vocab in ((32768, 4096, 131072), (262144, 4096, 131072), (4000, 2880, 201088)):
    chunk = fused.default_chunk(tokens, dim, vocab, jnp.bfloat16, spec)
    unavoidable = 4 * (tokens * dim + dim * vocab)
    assert chunk % 256 == 0 and chunk <= tokens
    assert 2 * chunk * vocab <= max(chunked.MIN_WORKING_SET_BYTES, unavoidable / 6)
  assert fused.default_chunk(32768, 4096, 131072, jnp.bfloat16, spec) == 2048
  two_softmax = objectives.LossSpec("sparse", 2.0, 0.0, True)
  assert fused.default_chunk(32768, 4096, 131072, jnp.bfloat16, two_softmax) == 1024
