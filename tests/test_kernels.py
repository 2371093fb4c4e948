"""kdjax.kernels against a float64 numpy computation of every objective, values and gradients.

Fresh random inputs every test (no fixed seeds). Errors: |loss - ref| / max(|ref|, 1) and
||grad - ref|| / ||ref|| (relative L2 norm).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdjax import kernels
from kdjax.kernels import chunked, fused, objectives, pallas_exact

# Tolerances, once per input dtype; never loosen. bf16 gradients carry the bf16 rounding of dL/dz
# before the gradient matmuls, of the outputs, and of dW accumulated chunk by chunk.
TOL = {jnp.float32: dict(loss=1e-5, grad=1e-4), jnp.bfloat16: dict(loss=1e-4, grad=1e-2)}

IMPLS = ["reference", "xla", "paper", "pallas"]
CHUNKED = ["xla", "paper", "pallas"]

# (batch dims, D, V, K, temperature, ce_weight, chunk, dtype): N never a multiple of the chunk.
CASES = {
    "k100_bf16": ((2, 19), 24, 333, 100, 1.0, 0.3, 16, jnp.bfloat16),
    "k7_tau_ce_f32": ((3, 5, 2), 8, 130, 7, 0.7, 0.5, 7, jnp.float32),
    "k5_tau_bf16": ((23,), 16, 257, 5, 2.5, 0.0, 8, jnp.bfloat16),
}


def _rng():
  return np.random.default_rng()


def make_inputs(batch, dim, vocab, k, dtype, *, with_labels=True, masked_frac=0.3):
  """Student hidden/lm_head and a teacher cache from a random full-vocabulary teacher."""
  rng = _rng()
  hidden = jnp.asarray(rng.normal(size=batch + (dim,)), dtype)
  lm_head = jnp.asarray(rng.normal(size=(dim, vocab)) * 2.0 / np.sqrt(dim), dtype)
  teacher = rng.normal(size=batch + (vocab,)) * 3.0
  logp = teacher - np.log(np.sum(np.exp(teacher), axis=-1, keepdims=True))
  ids = np.argsort(-logp, axis=-1)[..., :k]
  ids = np.take_along_axis(ids, rng.permuted(np.broadcast_to(np.arange(k), ids.shape), axis=-1),
                           axis=-1)  # cache order is irrelevant
  inputs = dict(hidden=hidden, lm_head=lm_head,
                topk_ids=jnp.asarray(ids, jnp.int32),
                topk_logprobs=jnp.asarray(np.take_along_axis(logp, ids, axis=-1), jnp.float32),
                mask=jnp.asarray(rng.random(batch) >= masked_frac))
  if with_labels:
    inputs["labels"] = jnp.asarray(rng.integers(0, vocab, size=batch), jnp.int32)
  return inputs


def _f64(x):
  return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _lse(x, axis=-1):
  m = np.max(x, axis=axis, keepdims=True)
  return (m + np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True)))[..., 0]


def bf16(x):
  return np.asarray(jnp.asarray(np.asarray(x, np.float32), jnp.bfloat16), np.float64)


def read_back(z, tau):
  """The logits impl "pallas" reads back on its fused path (kdjax.kernels.fused.fused_project):
  tau * (shift + log E) with E = exp(z / tau - shift) rounded to bf16, shift 0 unless the row's
  maximum leaves [SAFE_LOW, SAFE_HIGH]; exact where E is below the smallest normal float."""
  top = np.max(z / tau, axis=-1, keepdims=True)
  shift = np.where((top < fused.SAFE_LOW) | (top > fused.SAFE_HIGH), top, 0.0)
  e = bf16(np.exp(z / tau - shift))
  tiny = np.finfo(np.float32).tiny
  return np.where(e < tiny, z, tau * (shift + np.log(np.maximum(e, tiny))))


def numpy_loss(inputs, objective, temperature, ce_weight, readback=False):
  """float64 loss, mean KL, mean CE and gradients (analytic dL/dz, then the two matmuls).
  readback: the top-k and label logits as impl "pallas" reads them back on its fused path."""
  dim, vocab = inputs["lm_head"].shape
  h = _f64(inputs["hidden"]).reshape(-1, dim)
  w = _f64(inputs["lm_head"])
  ids = np.asarray(inputs["topk_ids"]).reshape(h.shape[0], -1)
  logp = _f64(inputs["topk_logprobs"]).reshape(ids.shape)
  mask = np.asarray(inputs["mask"]).reshape(-1)
  n, k = ids.shape
  rows = np.arange(n)[:, None]
  tau = temperature
  z = h @ w
  s = z / tau
  logq = s - _lse(s)[:, None]
  q = np.exp(logq)
  picked = read_back(z, tau) if readback else z  # where the top-k and label logits come from
  logq_k = np.take_along_axis(picked / tau, ids, axis=-1) - _lse(s)[:, None]
  q_k = np.exp(logq_k)
  if tau != 1.0:  # p_tau ~ p^(1/tau) within the top-k, top-k mass kept
    logp = _lse(logp)[:, None] + logp / tau - _lse(logp / tau)[:, None]
  p = np.exp(logp)
  mass = p.sum(-1)
  ds = np.zeros_like(z)
  if objective in ("sparse", "tail"):
    kl = np.sum(p * (logp - logq_k), axis=-1)
    ds += mass[:, None] * q
    np.add.at(ds, (np.broadcast_to(rows, ids.shape), ids), -p)
  if objective == "tail":
    tail_p = np.maximum(1.0 - mass, 0.0)
    tail_q = 1.0 - q_k.sum(-1)
    assert np.all(tail_q > objectives.TAIL_FLOOR)
    kl += np.where(tail_p > 0, tail_p * np.log(np.where(tail_p > 0, tail_p, 1.0) / tail_q), 0.0)
    r = tail_p / tail_q  # d/ds of -(1-M) log(1-Q) = r dQ/ds, dQ/ds = q 1_S - Q q
    ds -= (r * q_k.sum(-1))[:, None] * q
    np.add.at(ds, (np.broadcast_to(rows, ids.shape), ids), r[:, None] * q_k)
  if objective == "renorm":
    pn = p / mass[:, None]
    qn = q_k / q_k.sum(-1, keepdims=True)
    kl = np.sum(pn * (np.log(pn) - np.log(qn)), axis=-1)
    np.add.at(ds, (np.broadcast_to(rows, ids.shape), ids), qn - pn)
  kl = tau * tau * kl
  dz = tau * ds
  if "labels" in inputs:
    labels = np.asarray(inputs["labels"]).reshape(-1)
    lse1 = _lse(z)
    ce = lse1 - picked[np.arange(n), labels]
    dz += ce_weight * np.exp(z - lse1[:, None])
    dz[np.arange(n), labels] -= ce_weight
  else:
    ce = np.zeros(n)
  count = max(mask.sum(), 1)
  loss = np.sum(np.where(mask, kl + ce_weight * ce, 0.0)) / count
  dz = dz * (mask / count)[:, None]
  dh = (dz @ w.T).reshape(inputs["hidden"].shape)
  teacher_top = np.take_along_axis(ids, np.argmax(logp, axis=-1)[:, None], -1)[:, 0]
  top_gap = np.max(z, axis=-1) - z[np.arange(n), teacher_top]
  positions = dict(kl=kl, ce=ce, entropy=-np.sum(q * logq, axis=-1), top1=top_gap == 0,
                   top_gap=top_gap)
  return dict(loss=loss, kl=np.sum(np.where(mask, kl, 0)) / count,
              ce=np.sum(np.where(mask, ce, 0)) / count, dh=dh, dw=h.T @ dz, positions=positions)


def run_loss(inputs, cotangent, **kw):
  """One jit: (loss, aux) and the gradients of cotangent * loss in hidden and lm_head."""
  rest = {k: v for k, v in inputs.items() if k not in ("hidden", "lm_head")}

  def f(hidden, lm_head):
    loss, aux = kernels.topk_kl_loss(hidden, lm_head, rest["topk_ids"], rest["topk_logprobs"],
                                     rest["mask"], labels=rest.get("labels"), return_aux=True,
                                     **kw)
    return cotangent * loss, (loss, aux)

  grads, (value, aux) = jax.jit(jax.grad(f, argnums=(0, 1), has_aux=True))(
      inputs["hidden"], inputs["lm_head"])
  return value, aux, grads


def assert_close(name, got, want, tol):
  got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
  assert np.all(np.isfinite(got)), f"{name}: non-finite values"
  if got.ndim == 0:
    err = abs(got - want) / max(abs(want), 1.0)
  else:
    err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
  assert err <= tol, f"{name}: error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("impl,objective,case", [
    (impl, objective, case) for impl in IMPLS for objective in objectives.OBJECTIVES
    for case in CASES if case != "k5_tau_bf16" or objective == "tail"])
def test_matches_float64(impl, objective, case):
  batch, dim, vocab, k, tau, ce_weight, chunk, dtype = CASES[case]
  inputs = make_inputs(batch, dim, vocab, k, dtype)
  cotangent = float(_rng().uniform(0.5, 2.0))
  want = numpy_loss(inputs, objective, tau, ce_weight)
  value, aux, (dh, dw) = run_loss(inputs, cotangent, objective=objective, temperature=tau,
                                  ce_weight=ce_weight, impl=impl, chunk_size=chunk)
  tol = TOL[dtype]
  assert value.dtype == jnp.float32 and value.shape == ()
  assert dh.dtype == dtype and dh.shape == inputs["hidden"].shape
  assert dw.dtype == dtype and dw.shape == inputs["lm_head"].shape
  assert_close("loss", value, want["loss"], tol["loss"])
  assert_close("kl", aux["kl"], want["kl"], tol["loss"])
  assert_close("ce", aux["ce"], want["ce"], tol["loss"])
  assert_close("dhidden", dh, cotangent * want["dh"], tol["grad"])
  assert_close("dlm_head", dw, cotangent * want["dw"], tol["grad"])


@pytest.mark.parametrize("impl", CHUNKED)
def test_without_labels_and_default_chunk(impl):
  inputs = make_inputs((45,), 16, 257, 3, jnp.float32, with_labels=False)
  want = numpy_loss(inputs, "sparse", 2.5, 0.0)
  value, aux, (dh, dw) = run_loss(inputs, 1.0, temperature=2.5, impl=impl)
  assert_close("loss", value, want["loss"], TOL[jnp.float32]["loss"])
  assert float(aux["ce"]) == 0.0
  # The primal alone (no differentiation) takes another code path in the chunked impls.
  alone = jax.jit(lambda h, w: kernels.topk_kl_loss(
      h, w, inputs["topk_ids"], inputs["topk_logprobs"], inputs["mask"], temperature=2.5,
      impl=impl))(inputs["hidden"], inputs["lm_head"])
  assert_close("loss alone", alone, want["loss"], TOL[jnp.float32]["loss"])
  assert_close("dhidden", dh, want["dh"], TOL[jnp.float32]["grad"])
  assert_close("dlm_head", dw, want["dw"], TOL[jnp.float32]["grad"])


def test_pallas_several_vocabulary_tiles(monkeypatch):
  monkeypatch.setattr(pallas_exact, "BLOCK", 128)  # V = 333: two full tiles and a partial one
  inputs = make_inputs((2, 11), 16, 333, 6, jnp.float32)
  want = numpy_loss(inputs, "tail", 0.7, 0.5)
  value, _, (dh, dw) = run_loss(inputs, 1.0, objective="tail", temperature=0.7, ce_weight=0.5,
                                impl="pallas", chunk_size=8)
  assert_close("loss", value, want["loss"], TOL[jnp.float32]["loss"])
  assert_close("dhidden", dh, want["dh"], TOL[jnp.float32]["grad"])
  assert_close("dlm_head", dw, want["dw"], TOL[jnp.float32]["grad"])


@pytest.mark.parametrize("objective", ["sparse", "tail"])
def test_pallas_row_maximum_far_above_topk(monkeypatch, objective):
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
  assert_close("loss", value, want["loss"], TOL[jnp.float32]["loss"])
  assert_close("dhidden", dh, want["dh"], TOL[jnp.float32]["grad"])
  assert_close("dlm_head", dw, want["dw"], TOL[jnp.float32]["grad"])
  monkeypatch.setattr(chunked, "SHIFT_LIMIT", float("inf"))  # the test does exercise that branch
  value, _, _ = run_loss(inputs, 1.0, objective=objective, ce_weight=0.5, impl="pallas",
                         chunk_size=8)
  assert not np.isfinite(float(value))


@pytest.mark.parametrize("impl,dtype,dim,vocab", [
    ("reference", jnp.float32, 16, 300), ("xla", jnp.float32, 16, 300),
    ("pallas_exact", jnp.float32, 16, 300), ("pallas", jnp.bfloat16, 64, 384)])
def test_per_position_outputs(impl, dtype, dim, vocab):
  """kl, ce, entropy and top-1 agreement per position, from the loss's own pass."""
  inputs = make_inputs((2, 150), dim, vocab, 100, dtype)
  # A teacher that mostly agrees with the student, so both top-1 outcomes occur.
  teacher = _f64(inputs["hidden"]) @ _f64(inputs["lm_head"]) + _rng().normal(size=(2, 150, vocab))
  logp = teacher - _lse(teacher)[..., None]
  ids = np.argsort(-logp, axis=-1)[..., :100]
  inputs.update(topk_ids=jnp.asarray(ids, jnp.int32),
                topk_logprobs=jnp.asarray(np.take_along_axis(logp, ids, -1), jnp.float32))
  want = numpy_loss(inputs, "tail", 1.0, 0.3)["positions"]
  _, aux, _ = run_loss(inputs, 1.0, objective="tail", ce_weight=0.3, impl=impl, chunk_size=256,
                       per_position=True)
  got = aux["positions"]
  assert set(got) == {"kl", "ce", "entropy", "top1"}
  assert all(x.shape == (2, 150) for x in got.values()) and got["top1"].dtype == bool
  tol = TOL[dtype]["loss"]
  # On the fused path kl and ce take logits read back from bf16 E (loss.py): per position within
  # that rounding's bound of the exact values (tau * 2^-8 per logit; the kl's tail term up to the
  # same again). A simulated read-back would not do here: the kernel's float32 logits can round
  # an entry of E the other way (a mean over positions, test_fused, is tight against it).
  bound = dict(kl=2 * 2.0 ** -8, ce=2.0 ** -8 * (1 + 2.0 ** -8)) if impl == "pallas" else {}
  for name in ("kl", "ce", "entropy"):
    diff = np.abs(_f64(got[name]).reshape(-1) - want[name])
    if name in bound:
      assert diff.max() <= bound[name] + tol, (name, diff.max())
    else:
      err = diff / np.maximum(np.abs(want[name]), 1.0)
      assert err.max() <= tol, (name, err.max())
  # On the fused path the read-back logit is within tau * 2^-8 either way and agreement is
  # counted within that of the maximum: near-ties up to twice it may count.
  slack = 2 * 2.0 ** -8 if impl == "pallas" else 1e-5
  top1 = np.asarray(got["top1"]).reshape(-1)
  assert np.all((top1 == want["top1"]) | (want["top_gap"] <= slack)), want["top_gap"][
      top1 != want["top1"]]
  assert 0 < top1.sum() < top1.size  # both outcomes occur


def test_per_position_needs_aux_and_a_chunked_or_reference_impl():
  inputs = make_inputs((4,), 8, 130, 3, jnp.float32)
  args = (inputs["hidden"], inputs["lm_head"], inputs["topk_ids"], inputs["topk_logprobs"],
          inputs["mask"])
  for kw in (dict(per_position=True), dict(per_position=True, return_aux=True, impl="paper")):
    with pytest.raises(ValueError, match="per_position"):
      kernels.topk_kl_loss(*args, **kw)


@pytest.mark.parametrize("impl", CHUNKED)
def test_float32_dw_accumulation(impl):
  """64 chunks of bf16 inputs: dW accumulated in float32 is rounded once, at the end (error
  ~2e-3 here); in bf16 once per chunk (~9e-3)."""
  inputs = make_inputs((256,), 16, 200, 5, jnp.bfloat16, masked_frac=0.0)
  want = numpy_loss(inputs, "tail", 1.0, 0.0)
  errors = {}
  for dw_dtype in (None, "float32"):
    _, _, (_, dw) = run_loss(inputs, 1.0, objective="tail", impl=impl, chunk_size=4,
                             dw_dtype=dw_dtype)
    assert dw.dtype == jnp.bfloat16
    errors[dw_dtype] = np.linalg.norm(_f64(dw) - want["dw"]) / np.linalg.norm(want["dw"])
  assert errors["float32"] <= 4e-3 < errors[None], errors


def test_default_chunk_grows_with_memory():
  small = chunked.default_chunk(32768, 4096, 131072, jnp.bfloat16)
  large = chunked.default_chunk(262144, 4096, 131072, jnp.bfloat16)
  assert small % 128 == 0 and large % 128 == 0 and 6 * small * 131072 <= 2**30
  assert small < large <= chunked.MAX_CHUNK
  assert chunked.default_chunk(5, 16, 300, jnp.float32) == 5
  assert chunked.default_chunk(4096, 64, 8 * 2**20, jnp.bfloat16) == 128  # a huge vocabulary: one tile


@pytest.mark.parametrize("impl", IMPLS)
def test_all_masked_is_zero(impl):
  inputs = make_inputs((2, 9), 8, 130, 4, jnp.float32, masked_frac=1.1)
  value, aux, (dh, dw) = run_loss(inputs, 1.0, objective="tail", ce_weight=1.0,
                                  impl=impl, chunk_size=4)
  assert float(value) == 0.0 and float(aux["kl"]) == 0.0 and float(aux["ce"]) == 0.0
  assert not np.any(np.asarray(dh)) and not np.any(np.asarray(dw))


@pytest.mark.parametrize("impl", IMPLS)
def test_no_gradient_to_cache(impl):
  inputs = make_inputs((7,), 8, 130, 4, jnp.float32)
  g = jax.jit(jax.grad(lambda lp: kernels.topk_kl_loss(
      inputs["hidden"], inputs["lm_head"], inputs["topk_ids"], lp, inputs["mask"],
      objective="tail", impl=impl, chunk_size=4)))(inputs["topk_logprobs"])
  assert not np.any(np.asarray(g))


@pytest.mark.parametrize("objective", ["tail", "renorm"])
def test_proper_divergences_are_nonnegative(objective):
  inputs = make_inputs((64,), 8, 150, 10, jnp.float32, masked_frac=0.0)
  for tau in (0.5, 1.0, 3.0):
    kl = jax.jit(lambda h, w: kernels.topk_kl_loss(
        h, w, inputs["topk_ids"], inputs["topk_logprobs"], inputs["mask"], objective=objective,
        temperature=tau, impl="reference"))(inputs["hidden"], inputs["lm_head"])
    assert float(kl) >= 0.0


def test_tempered_teacher_keeps_mass_and_sharpens():
  rng = _rng()
  logp = np.log(rng.dirichlet(np.ones(9), size=5)[:, :6])
  tau = float(rng.uniform(0.3, 3.0))
  got = np.asarray(objectives.tempered_teacher(jnp.asarray(logp, jnp.float32), tau), np.float64)
  np.testing.assert_allclose(np.exp(got).sum(-1), np.exp(logp).sum(-1), rtol=1e-5)
  np.testing.assert_allclose(got[:, 1:] - got[:, :1], (logp[:, 1:] - logp[:, :1]) / tau,
                             rtol=1e-4, atol=1e-4)
  same = objectives.tempered_teacher(jnp.asarray(logp, jnp.float32), 1.0)
  np.testing.assert_array_equal(np.asarray(same), np.asarray(logp, np.float32))


def test_position_stats():
  inputs = make_inputs((2, 13), 16, 211, 6, jnp.float32)
  got = jax.jit(lambda h, w, i, l: kernels.position_stats(h, w, i, l, chunk_size=5))(
      inputs["hidden"], inputs["lm_head"], inputs["topk_ids"], inputs["labels"])
  z = _f64(inputs["hidden"]) @ _f64(inputs["lm_head"])
  np.testing.assert_allclose(got["lse"], _lse(z), rtol=1e-5)
  np.testing.assert_array_equal(got["argmax"], np.argmax(z, axis=-1))
  assert got["argmax"].dtype == jnp.int32
  np.testing.assert_allclose(got["label_logit"],
                             np.take_along_axis(z, np.asarray(inputs["labels"])[..., None],
                                                axis=-1)[..., 0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got["topk_logits"],
                             np.take_along_axis(z, np.asarray(inputs["topk_ids"]), axis=-1),
                             rtol=1e-5, atol=1e-5)
  no_labels = kernels.position_stats(inputs["hidden"], inputs["lm_head"], inputs["topk_ids"])
  assert "label_logit" not in no_labels


def test_input_validation():
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
      kernels.topk_kl_loss(*args, **kw)
  with pytest.raises(ValueError, match="lm_head"):
    kernels.topk_kl_loss(inputs["hidden"], inputs["lm_head"][:5], *args[2:])
  with pytest.raises(ValueError, match="topk_logprobs"):
    kernels.topk_kl_loss(*args[:3], inputs["topk_logprobs"][:, :2], inputs["mask"])
  with pytest.raises(ValueError, match="mask"):
    kernels.topk_kl_loss(*args[:4], inputs["mask"][:2])


def test_empty_batch():
  """No positions: loss 0 and empty per-position terms, not an error."""
  hidden, lm_head = jnp.zeros((0, 8)), jnp.zeros((8, 130))
  ids, logp = jnp.zeros((0, 3), jnp.int32), jnp.zeros((0, 3))
  loss, aux = kernels.topk_kl_loss(hidden, lm_head, ids, logp, None, return_aux=True,
                                   per_position=True)
  assert float(loss) == 0.0 and aux["positions"]["top1"].shape == (0,)
  assert kernels.position_stats(hidden, lm_head, ids)["topk_logits"].shape == (0, 3)
