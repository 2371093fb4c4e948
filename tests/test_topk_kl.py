"""kdjax.loss.topk_kl_loss, every impl, against a float64 numpy computation of every objective,
values and gradients.

Fresh random inputs every test, from its seed (conftest: a failure names the session seed that
replays it). The reference (make_inputs, numpy_loss, run_loss, tolerances) lives in conftest, shared
with test_fused. Errors: |loss - ref| / max(|ref|, 1) and ||grad - ref|| / ||ref|| (relative L2).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdjax.kernels import logit_passes
from kdjax.loss import chunked, objectives, topk_kl

IMPLS = ["reference", "xla", "paper", "pallas"]
CHUNKED = ["xla", "paper", "pallas"]

# (batch dims, D, V, K, temperature, ce_weight, chunk, dtype): N never a multiple of the chunk.
CASES = {
    "k100_bf16": ((2, 19), 24, 333, 100, 1.0, 0.3, 16, jnp.bfloat16),
    "k7_tau_ce_f32": ((3, 5, 2), 8, 130, 7, 0.7, 0.5, 7, jnp.float32),
    "k5_tau_bf16": ((23,), 16, 257, 5, 2.5, 0.0, 8, jnp.bfloat16),
}


@pytest.mark.parametrize("impl,objective,case", [
    (impl, objective, case) for impl in IMPLS for objective in objectives.OBJECTIVES
    for case in CASES if case != "k5_tau_bf16" or objective == "tail"])
def test_matches_float64(impl, objective, case, rng, make_inputs, numpy_loss, run_loss,
                         assert_close, tol):
  batch, dim, vocab, k, tau, ce_weight, chunk, dtype = CASES[case]
  inputs = make_inputs(batch, dim, vocab, k, dtype)
  cotangent = float(rng.uniform(0.5, 2.0))
  want = numpy_loss(inputs, objective, tau, ce_weight)
  value, aux, (dh, dw) = run_loss(inputs, cotangent, objective=objective, temperature=tau,
                                  ce_weight=ce_weight, impl=impl, chunk_size=chunk)
  dtype_tol = tol[dtype]
  assert value.dtype == jnp.float32 and value.shape == ()
  assert dh.dtype == dtype and dh.shape == inputs["hidden"].shape
  assert dw.dtype == dtype and dw.shape == inputs["lm_head"].shape
  assert_close("loss", value, want["loss"], dtype_tol["loss"])
  assert_close("kl", aux["kl"], want["kl"], dtype_tol["loss"])
  assert_close("ce", aux["ce"], want["ce"], dtype_tol["loss"])
  assert_close("dhidden", dh, cotangent * want["dh"], dtype_tol["grad"])
  assert_close("dlm_head", dw, cotangent * want["dw"], dtype_tol["grad"])


@pytest.mark.parametrize("impl", CHUNKED)
def test_without_labels_and_default_chunk(impl, make_inputs, numpy_loss, run_loss, assert_close,
                                          tol):
  inputs = make_inputs((45,), 16, 257, 3, jnp.float32, with_labels=False)
  want = numpy_loss(inputs, "sparse", 2.5, 0.0)
  value, aux, (dh, dw) = run_loss(inputs, 1.0, temperature=2.5, impl=impl)
  assert_close("loss", value, want["loss"], tol[jnp.float32]["loss"])
  assert float(aux["ce"]) == 0.0
  # The primal alone (no differentiation) takes another code path in the chunked impls.
  alone = jax.jit(lambda h, w: topk_kl.topk_kl_loss(
      h, w, inputs["topk_ids"], inputs["topk_logprobs"], inputs["mask"], temperature=2.5,
      impl=impl))(inputs["hidden"], inputs["lm_head"])
  assert_close("loss alone", alone, want["loss"], tol[jnp.float32]["loss"])
  assert_close("dhidden", dh, want["dh"], tol[jnp.float32]["grad"])
  assert_close("dlm_head", dw, want["dw"], tol[jnp.float32]["grad"])


def test_pallas_several_vocabulary_tiles(monkeypatch, make_inputs, numpy_loss, run_loss,
                                         assert_close, tol):
  monkeypatch.setattr(logit_passes, "BLOCK", 128)  # V = 333: two full tiles and a partial one
  inputs = make_inputs((2, 11), 16, 333, 6, jnp.float32)
  want = numpy_loss(inputs, "tail", 0.7, 0.5)
  value, _, (dh, dw) = run_loss(inputs, 1.0, objective="tail", temperature=0.7, ce_weight=0.5,
                                impl="pallas", chunk_size=8)
  assert_close("loss", value, want["loss"], tol[jnp.float32]["loss"])
  assert_close("dhidden", dh, want["dh"], tol[jnp.float32]["grad"])
  assert_close("dlm_head", dw, want["dw"], tol[jnp.float32]["grad"])


@pytest.mark.parametrize("objective", ["sparse", "tail"])
def test_pallas_row_maximum_far_above_topk(monkeypatch, objective, make_inputs, numpy_loss,
                                           run_loss, assert_close, tol):
  """Rows whose largest logit is 90 above every top-k logit and label: pallas's exp_pass must
  shift them by their own maximum (exp(90) overflows float32), the others by the top-k hint."""
  inputs = make_inputs((37,), 16, 300, 5, jnp.float32)
  rows = np.arange(37) % 2 == 0
  hidden = np.asarray(inputs["hidden"]).copy()
  lm_head = np.asarray(inputs["lm_head"]).copy()
  ids, labels = np.asarray(inputs["topk_ids"]), np.asarray(inputs["labels"])
  spike = next(v for v in range(300) if not np.any(ids[rows] == v) and not np.any(labels == v))
  hidden[:, 0] = np.where(rows, 1.0, 0.0)
  lm_head[0, :] = 0.0
  lm_head[0, spike] = 90.0 + np.abs(hidden[:, 1:] @ lm_head[1:]).max()
  inputs = dict(inputs, hidden=jnp.asarray(hidden), lm_head=jnp.asarray(lm_head))
  want = numpy_loss(inputs, objective, 1.0, 0.5)
  value, _, (dh, dw) = run_loss(inputs, 1.0, objective=objective, ce_weight=0.5,
                                impl="pallas", chunk_size=8)
  assert_close("loss", value, want["loss"], tol[jnp.float32]["loss"])
  assert_close("dhidden", dh, want["dh"], tol[jnp.float32]["grad"])
  assert_close("dlm_head", dw, want["dw"], tol[jnp.float32]["grad"])
  # The test does exercise that branch:
  monkeypatch.setattr(logit_passes, "SHIFT_LIMIT", float("inf"))
  value, _, _ = run_loss(inputs, 1.0, objective=objective, ce_weight=0.5, impl="pallas",
                         chunk_size=8)
  assert not np.isfinite(float(value))


@pytest.mark.parametrize("impl,dtype,dim,vocab", [
    ("reference", jnp.float32, 16, 300), ("xla", jnp.float32, 16, 300),
    ("pallas_exact", jnp.float32, 16, 300), ("pallas", jnp.bfloat16, 64, 384)])
def test_per_position_outputs(impl, dtype, dim, vocab, rng, make_inputs, numpy_loss, run_loss,
                              tol, f64, lse):
  """kl, ce, entropy and top-1 agreement per position, from the loss's own pass."""
  inputs = make_inputs((2, 150), dim, vocab, 100, dtype)
  # A teacher that mostly agrees with the student, so both top-1 outcomes occur.
  teacher = f64(inputs["hidden"]) @ f64(inputs["lm_head"]) + rng.normal(size=(2, 150, vocab))
  logp = teacher - lse(teacher)[..., None]
  ids = np.argsort(-logp, axis=-1)[..., :100]
  inputs.update(topk_ids=jnp.asarray(ids, jnp.int32),
                topk_logprobs=jnp.asarray(np.take_along_axis(logp, ids, -1), jnp.float32))
  want = numpy_loss(inputs, "tail", 1.0, 0.3)["positions"]
  _, aux, _ = run_loss(inputs, 1.0, objective="tail", ce_weight=0.3, impl=impl, chunk_size=256,
                       per_position=True)
  got = aux["positions"]
  assert set(got) == {"kl", "ce", "entropy", "top1"}
  assert all(x.shape == (2, 150) for x in got.values()) and got["top1"].dtype == bool
  loss_tol = tol[dtype]["loss"]
  # On the fused path kl and ce take logits read back from bf16 E (loss.py): per position within
  # that rounding's bound of the exact values (tau * 2^-8 per logit; the kl's tail term up to the
  # same again). A simulated read-back would not do here: the kernel's float32 logits can round
  # an entry of E the other way (a mean over positions, test_fused, is tight against it).
  bound = dict(kl=2 * 2.0 ** -8, ce=2.0 ** -8 * (1 + 2.0 ** -8)) if impl == "pallas" else {}
  for name in ("kl", "ce", "entropy"):
    diff = np.abs(f64(got[name]).reshape(-1) - want[name])
    if name in bound:
      assert diff.max() <= bound[name] + loss_tol, (name, diff.max())
    else:
      err = diff / np.maximum(np.abs(want[name]), 1.0)
      assert err.max() <= loss_tol, (name, err.max())
  # On the fused path the read-back logit is within tau * 2^-8 either way and agreement is
  # counted within that of the maximum: near-ties up to twice it may count.
  slack = 2 * 2.0 ** -8 if impl == "pallas" else 1e-5
  top1 = np.asarray(got["top1"]).reshape(-1)
  assert np.all((top1 == want["top1"]) | (want["top_gap"] <= slack)), want["top_gap"][
      top1 != want["top1"]]
  assert 0 < top1.sum() < top1.size  # both outcomes occur


def test_per_position_needs_aux_and_a_chunked_or_reference_impl(make_inputs):
  inputs = make_inputs((4,), 8, 130, 3, jnp.float32)
  args = (inputs["hidden"], inputs["lm_head"], inputs["topk_ids"], inputs["topk_logprobs"],
          inputs["mask"])
  for kw in (dict(per_position=True), dict(per_position=True, return_aux=True, impl="paper")):
    with pytest.raises(ValueError, match="per_position"):
      topk_kl.topk_kl_loss(*args, **kw)


@pytest.mark.parametrize("impl", CHUNKED)
def test_float32_dw_accumulation(impl, make_inputs, numpy_loss, run_loss, f64):
  """64 chunks of bf16 inputs: dW accumulated in float32 is rounded once, at the end (error
  ~2e-3 here); in bf16 once per chunk (~9e-3)."""
  inputs = make_inputs((256,), 16, 200, 5, jnp.bfloat16, masked_frac=0.0)
  want = numpy_loss(inputs, "tail", 1.0, 0.0)
  errors = {}
  for dw_dtype in (None, "float32"):
    _, _, (_, dw) = run_loss(inputs, 1.0, objective="tail", impl=impl, chunk_size=4,
                             dw_dtype=dw_dtype)
    assert dw.dtype == jnp.bfloat16
    errors[dw_dtype] = np.linalg.norm(f64(dw) - want["dw"]) / np.linalg.norm(want["dw"])
  assert errors["float32"] <= 4e-3 < errors[None], errors


def test_default_chunk_grows_with_memory():
  small = chunked.default_chunk(32768, 4096, 131072, jnp.bfloat16)
  large = chunked.default_chunk(262144, 4096, 131072, jnp.bfloat16)
  assert small % 128 == 0 and large % 128 == 0 and 6 * small * 131072 <= 2**30
  assert small < large <= chunked.MAX_CHUNK
  assert chunked.default_chunk(5, 16, 300, jnp.float32) == 5
  # a huge vocabulary: one tile
  assert chunked.default_chunk(4096, 64, 8 * 2**20, jnp.bfloat16) == 128


def test_default_chunk_reads_max_chunk_when_called(monkeypatch):
  """The loss benchmark sets chunked.MAX_CHUNK (KDJAX_BENCH_SET) after import: it must count."""
  assert chunked.default_chunk(100_000, 3072, 1000, jnp.bfloat16) > 4096
  monkeypatch.setattr(chunked, "MAX_CHUNK", 4096)
  assert chunked.default_chunk(100_000, 3072, 1000, jnp.bfloat16) <= 4096


@pytest.mark.parametrize("impl", IMPLS)
def test_all_masked_is_zero(impl, make_inputs, run_loss):
  inputs = make_inputs((2, 9), 8, 130, 4, jnp.float32, masked_frac=1.1)
  value, aux, (dh, dw) = run_loss(inputs, 1.0, objective="tail", ce_weight=1.0,
                                  impl=impl, chunk_size=4)
  assert float(value) == 0.0 and float(aux["kl"]) == 0.0 and float(aux["ce"]) == 0.0
  assert not np.any(np.asarray(dh)) and not np.any(np.asarray(dw))


@pytest.mark.parametrize("impl", IMPLS)
def test_no_gradient_to_cache(impl, make_inputs):
  inputs = make_inputs((7,), 8, 130, 4, jnp.float32)
  g = jax.jit(jax.grad(lambda lp: topk_kl.topk_kl_loss(
      inputs["hidden"], inputs["lm_head"], inputs["topk_ids"], lp, inputs["mask"],
      objective="tail", impl=impl, chunk_size=4)))(inputs["topk_logprobs"])
  assert not np.any(np.asarray(g))


@pytest.mark.parametrize("objective", ["tail", "renorm"])
def test_proper_divergences_are_nonnegative(objective, make_inputs):
  inputs = make_inputs((64,), 8, 150, 10, jnp.float32, masked_frac=0.0)
  for tau in (0.5, 1.0, 3.0):
    kl = jax.jit(lambda h, w: topk_kl.topk_kl_loss(
        h, w, inputs["topk_ids"], inputs["topk_logprobs"], inputs["mask"], objective=objective,
        temperature=tau, impl="reference"))(inputs["hidden"], inputs["lm_head"])
    assert float(kl) >= 0.0


def test_tempered_teacher_keeps_mass_and_sharpens(rng):
  logp = np.log(rng.dirichlet(np.ones(9), size=5)[:, :6])
  tau = float(rng.uniform(0.3, 3.0))
  got = np.asarray(objectives.tempered_teacher(jnp.asarray(logp, jnp.float32), tau), np.float64)
  np.testing.assert_allclose(np.exp(got).sum(-1), np.exp(logp).sum(-1), rtol=1e-5)
  np.testing.assert_allclose(got[:, 1:] - got[:, :1], (logp[:, 1:] - logp[:, :1]) / tau,
                             rtol=1e-4, atol=1e-4)
  same = objectives.tempered_teacher(jnp.asarray(logp, jnp.float32), 1.0)
  np.testing.assert_array_equal(np.asarray(same), np.asarray(logp, np.float32))


def test_input_validation(make_inputs):
  inputs = make_inputs((4,), 8, 130, 3, jnp.float32)
  args = (inputs["hidden"], inputs["lm_head"], inputs["topk_ids"], inputs["topk_logprobs"],
          inputs["mask"])
  bad = [
      (dict(objective="jsd"), "objective"),
      (dict(impl="cuda"), "impl"),
      (dict(temperature=0.0), "temperature"),
      (dict(temperature=-1.0), "temperature"),
      (dict(ce_weight=0.5), "labels"),
      (dict(chunk_size=0), "chunk_size"),
      (dict(labels=inputs["labels"][:3]), "labels"),
  ]
  for kw, word in bad:
    with pytest.raises(ValueError, match=word):
      topk_kl.topk_kl_loss(*args, **kw)
  with pytest.raises(ValueError, match="lm_head"):
    topk_kl.topk_kl_loss(inputs["hidden"], inputs["lm_head"][:5], *args[2:])
  with pytest.raises(ValueError, match="topk_logprobs"):
    topk_kl.topk_kl_loss(*args[:3], inputs["topk_logprobs"][:, :2], inputs["mask"])
  with pytest.raises(ValueError, match="mask"):
    topk_kl.topk_kl_loss(*args[:4], inputs["mask"][:2])


def test_empty_batch():
  """No positions: loss 0 and empty per-position terms, not an error."""
  hidden, lm_head = jnp.zeros((0, 8)), jnp.zeros((8, 130))
  ids, logp = jnp.zeros((0, 3), jnp.int32), jnp.zeros((0, 3))
  loss, aux = topk_kl.topk_kl_loss(hidden, lm_head, ids, logp, None, return_aux=True,
                                   per_position=True)
  assert float(loss) == 0.0 and aux["positions"]["top1"].shape == (0,)
