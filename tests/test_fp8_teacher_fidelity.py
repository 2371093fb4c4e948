"""experiments/studies/fp8_teacher_fidelity.py's measures against dense float64 references."""
import numpy as np

from experiments.studies import fp8_teacher_fidelity as fid


def cached(rng, n, v, k):
  """n positions of a random distribution over v ids: (top-k ids, their log-probs, dense)."""
  logits = rng.normal(size=(n, v)) * 2
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  ids = np.argsort(-logp, -1)[:, :k]
  return ids, np.take_along_axis(logp, ids, -1), logp


def dense(ids, lp, v):
  """The distribution a `tail` student reads: the top k, the rest spread evenly."""
  k = ids.shape[1]
  rest = (1 - np.exp(lp).sum(-1)) / (v - k)
  out = np.repeat(rest[:, None], v, 1)
  np.put_along_axis(out, ids, np.exp(lp), -1)
  return out


def test_tail_kl_matches_the_dense_distributions(rng):
  v, k, n = 37, 7, 13
  a, b = cached(rng, n, v, k), cached(rng, n, v, k)
  ids_b = b[0].copy()
  for row in range(n):  # b's top k share 0..k of a's ids
    shared = rng.choice(a[0][row], rng.integers(0, k + 1), replace=False)
    others = rng.permutation(np.setdiff1d(np.arange(v), a[0][row]))[:k - len(shared)]
    ids_b[row] = rng.permutation(np.concatenate([shared, others]))
  p, q = dense(a[0], a[1], v), dense(ids_b, b[1], v)
  want = (p * (np.log(p) - np.log(q))).sum(-1)
  np.testing.assert_allclose(fid.tail_kl(a[0], a[1], ids_b, b[1], v), want, rtol=1e-9,
                             atol=1e-12)
  np.testing.assert_allclose(fid.tail_kl(a[0], a[1], a[0], a[1], v), 0, atol=1e-12)


class Store:
  def __init__(self, ids, lp, mask):
    self.rows = {"topk_ids": ids, "topk_logprobs": lp, "loss_mask": mask}

  def read(self, rows):
    return {k: v[rows] for k, v in self.rows.items()}


def test_compare_counts_masked_positions_only(rng):
  v, k, rows, t = 2000, fid.K, 2, 5
  a = cached(rng, rows * t, v, k)
  mask = rng.random((rows, t)) < 0.7
  mask[0, 0] = True
  shape = lambda x: x.reshape(rows, t, -1)  # noqa: E731
  same = fid.compare(Store(shape(a[0]), shape(a[1]), mask), Store(shape(a[0]), shape(a[1]), mask),
                     rows, v)
  assert same["positions"] == mask.sum() and same["overlap"] == 1.0
  assert same["top10_delta"] == 0.0 and same["top10_missing"] == 0.0 and abs(same["kl"]) < 1e-12
  # The other cache's log-probs shifted by 0.01 and its 10th id swapped for one outside.
  ids_b, lp_b = a[0].copy(), a[1] + 0.01
  ids_b[:, 9] = ids_b[:, -1]
  ids_b[:, -1] = np.setdiff1d(np.arange(v), a[0])[0]  # an id in no position's top k
  got = fid.compare(Store(shape(a[0]), shape(a[1]), mask), Store(shape(ids_b), shape(lp_b), mask),
                    rows, v)
  m = mask.reshape(-1)
  assert np.isclose(got["top10_missing"], 0.1) and np.isclose(got["overlap"], (k - 1) / k)
  np.testing.assert_allclose(got["top10_delta"], np.abs(
      a[1][m][:, :9] - lp_b[m][:, :9]).mean(), rtol=1e-9)


def test_rowwise_dot_and_the_variant_context(rng):
  """--logits' per-row / per-column FP8 product: exact against the dequantised operands in
  float64 (power-of-two scales, float32 accumulation of fp8 products), closer to x @ w than one
  scale per tensor when rows differ in scale; fp8_variant restores kdjax's fp8 on exit."""
  import jax.numpy as jnp

  from kdjax.models import fp8
  x = rng.normal(size=(9, 40)) * np.logspace(-6, 1, 9)[:, None]  # rows of very different scale
  w = rng.normal(size=(40, 11)) * np.logspace(-2, 0, 11)[None, :]
  w1 = rng.normal(size=(40, 11))
  got = np.asarray(fid._rowwise_dot(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32)),
                   np.float64)
  fmax = 448.0
  def deq(a, axis):
    amax = np.abs(a).max(axis=axis, keepdims=True)
    scale = 2.0 ** np.ceil(np.log2(amax / fmax))
    q = np.asarray(jnp.asarray(a / scale, jnp.float32).astype(fp8.E4M3).astype(jnp.float32))
    return q * scale
  want = deq(x, 1) @ deq(w, 0)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-9)
  # Small rows lose their digits under one scale (worst ratio over 300 seeds: 0.18).
  x32, w32 = jnp.asarray(x, jnp.float32), jnp.asarray(w1, jnp.float32)
  row, tensor = (np.asarray(f(x32, w32), np.float64) for f in (fid._rowwise_dot, fp8.dot_reference))
  exact = x @ w1
  relative = lambda y: np.mean(np.linalg.norm(y - exact, axis=1) / np.linalg.norm(exact, axis=1))
  assert relative(row) < 0.5 * relative(tensor)
  matmul, dot = fp8.matmul, fp8.dot
  with fid.fp8_variant("row", ("btd,df->btf",)):
    assert fp8.dot is fid._rowwise_dot and fp8.matmul is not matmul
  assert (fp8.matmul, fp8.dot) == (matmul, dot)
