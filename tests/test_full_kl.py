"""The full-vocabulary KL (kdjax.loss.full_kl) against a float64 dense computation."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdjax.loss import full_kl

N, D, DT, V = 23, 12, 20, 157  # N not a multiple of the chunk; V odd; teacher wider


def log_softmax(z):
  z = z - z.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


def dense(h, w, th, tw, mask, labels, tau):
  """float64: loss, d loss / d h, d loss / d w, per-position terms."""
  z, zt = h @ w, th @ tw
  logq, logp = log_softmax(z / tau), log_softmax(zt / tau)
  p, q = np.exp(logp), np.exp(logq)
  kl = tau * tau * (p * (logp - logq)).sum(-1)
  count = max(mask.sum(), 1)
  # d kl / d z = tau (q - p) per position; the mean divides by the count.
  dz = np.where(mask[:, None], tau * (q - p), 0.0) / count
  logq1 = log_softmax(z)
  terms = dict(kl=kl, top1=z.argmax(-1) == zt.argmax(-1),
               ce=-np.take_along_axis(logq1, labels[:, None], -1)[:, 0],
               confidence=np.exp(logq1.max(-1)), correct=z.argmax(-1) == labels)
  return kl[mask].sum() / count, dz @ w.T, h.T @ dz, terms


@pytest.mark.parametrize("dtype,tau,chunk", [(jnp.float32, 1.0, 5), (jnp.float32, 2.0, None),
                                             (jnp.bfloat16, 1.0, 8)])
def test_matches_float64(rng, dtype, tau, chunk):
  h, w = rng.normal(size=(N, D)), rng.normal(size=(D, V)) / np.sqrt(D) * 2
  th, tw = rng.normal(size=(N, DT)), rng.normal(size=(DT, V)) / np.sqrt(DT) * 3
  mask, labels = rng.random(N) > 0.3, rng.integers(0, V, N)
  cast = lambda x: jnp.asarray(x, dtype)
  f64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  want, dh_want, dw_want, terms_want = dense(f64(cast(h)), f64(cast(w)), f64(cast(th)),
                                             f64(cast(tw)), mask, labels, tau)

  def loss(h, w):
    return full_kl.full_kl_loss(h, w, cast(th), cast(tw), jnp.asarray(mask), temperature=tau,
                                labels=jnp.asarray(labels), chunk_size=chunk)
  value, (dh, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(cast(h), cast(w))
  _, terms = full_kl.full_kl_loss(cast(h), cast(w), cast(th), cast(tw), jnp.asarray(mask),
                                  temperature=tau, labels=jnp.asarray(labels), chunk_size=chunk,
                                  per_position=True)
  tol = 1e-5 if dtype == jnp.float32 else 1e-2  # bf16: gradients leave in bf16
  np.testing.assert_allclose(float(value), want, rtol=1e-5, atol=1e-6)
  for got, ref in ((dh, dh_want), (dw, dw_want)):
    assert np.linalg.norm(f64(got) - ref) <= tol * np.linalg.norm(ref)
  for name in ("kl", "ce", "confidence"):
    np.testing.assert_allclose(np.asarray(terms[name]), terms_want[name], rtol=1e-4, atol=1e-5)
  for name in ("top1", "correct"):
    np.testing.assert_array_equal(np.asarray(terms[name]), terms_want[name])


def test_batch_dims_no_labels_and_checks(rng):
  h, w = jnp.asarray(rng.normal(size=(2, 5, D)), jnp.float32), jnp.ones((D, V)) / D
  th, tw = jnp.asarray(rng.normal(size=(2, 5, DT)), jnp.float32), jnp.ones((DT, V))
  value, terms = full_kl.full_kl_loss(h, w, th, tw, None, per_position=True)
  assert terms["kl"].shape == (2, 5) and float(jnp.max(terms["ce"])) == 0.0
  assert abs(float(value)) < 1e-5  # both uniform: KL 0
  with pytest.raises(ValueError, match="vocabularies differ"):
    full_kl.full_kl_loss(h, w, th, tw[:, :-1], None)
  with pytest.raises(ValueError, match="same positions"):
    full_kl.full_kl_loss(h, w, th[:1], tw, None)


def test_expected_calibration_error(rng):
  confidence, correct = rng.random(200), rng.random(200) < 0.6
  mask = rng.random(200) > 0.1
  bins = np.minimum((confidence * 15).astype(int), 14)
  want = sum(abs(correct[mask & (bins == b)].sum() - confidence[mask & (bins == b)].sum())
             for b in range(15)) / mask.sum()
  args = [jnp.asarray(x) for x in (confidence.astype(np.float32), correct, mask)]
  halves = [full_kl.calibration_sums(*(x[i:i + 100] for x in args)) for i in (0, 100)]
  np.testing.assert_allclose(full_kl.expected_calibration_error(halves[0] + halves[1]), want,
                             rtol=1e-5)


def divergence64(h, w, th, tw, mask, tau, divergence, skew):
  """float64: the mean over masked positions of the divergence (full_kl's docstring)."""
  logq, logp = log_softmax(h @ w / tau), log_softmax(th @ tw / tau)
  kl = lambda la, lb: (np.exp(la) * (la - lb)).sum(-1)  # noqa: E731
  mix = lambda la, lb: np.logaddexp(np.log(skew) + la, np.log1p(-skew) + lb)  # noqa: E731
  d = dict(forward=lambda: kl(logp, logq), reverse=lambda: kl(logq, logp),
           skew_forward=lambda: kl(logp, mix(logp, logq)),
           skew_reverse=lambda: kl(logq, mix(logq, logp)))[divergence]()
  return tau * tau * d[mask].sum() / max(mask.sum(), 1)


@pytest.mark.parametrize("divergence,tau,skew,chunk", [
    ("reverse", 1.0, 0.1, 5), ("skew_forward", 1.0, 0.1, None), ("skew_reverse", 2.0, 0.3, 8),
    ("forward", 2.0, 0.1, 7)])
def test_divergences_match_float64(rng, divergence, tau, skew, chunk):
  """Each divergence's value against float64, and its gradient along random directions against
  float64 central differences; the "kl" term stays the forward KL."""
  h, w = rng.normal(size=(N, D)), rng.normal(size=(D, V)) / np.sqrt(D) * 2
  th, tw = rng.normal(size=(N, DT)), rng.normal(size=(DT, V)) / np.sqrt(DT) * 3
  mask = rng.random(N) > 0.3
  f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
  h, w, th, tw = (np.asarray(f32(x), np.float64) for x in (h, w, th, tw))

  def loss(h, w):
    return full_kl.full_kl_loss(h, w, f32(th), f32(tw), jnp.asarray(mask), temperature=tau,
                                chunk_size=chunk, divergence=divergence, skew=skew)
  value, (dh, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(f32(h), f32(w))
  ref = lambda h, w: divergence64(h, w, th, tw, mask, tau, divergence, skew)  # noqa: E731
  np.testing.assert_allclose(float(value), ref(h, w), rtol=1e-5, atol=1e-6)
  for _ in range(3):
    uh, uw = rng.normal(size=h.shape), rng.normal(size=w.shape)
    eps = 1e-5
    want = (ref(h + eps * uh, w + eps * uw) - ref(h - eps * uh, w - eps * uw)) / (2 * eps)
    got = float(np.sum(np.asarray(dh, np.float64) * uh) + np.sum(np.asarray(dw, np.float64) * uw))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
  _, terms = full_kl.full_kl_loss(f32(h), f32(w), f32(th), f32(tw), jnp.asarray(mask),
                                  temperature=tau, divergence=divergence, skew=skew,
                                  per_position=True)
  kl_want = divergence64(h, w, th, tw, mask, tau, "forward", skew)
  np.testing.assert_allclose(float(jnp.sum(jnp.where(mask, terms["kl"], 0)) / mask.sum()),
                             kl_want, rtol=1e-5)
  assert "divergence" not in terms


def test_divergence_checks(rng):
  h, w = jnp.ones((3, D)), jnp.ones((D, V))
  th, tw = jnp.ones((3, DT)), jnp.ones((DT, V))
  with pytest.raises(ValueError, match="divergence must be one of"):
    full_kl.full_kl_loss(h, w, th, tw, None, divergence="js")
  with pytest.raises(ValueError, match="skew must be in"):
    full_kl.full_kl_loss(h, w, th, tw, None, divergence="skew_forward", skew=0.0)
