"""Attention (kdjax.models.attention) against a float64 loop reference: document masks, sinks,
sliding windows, the cuDNN path's document spans and calls, query blocks, and the helpers that
size them."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdjax.models import attention, documents
from tests.fixtures.cudnn_on_cpu import cudnn_calls_for_cuda, cudnn_lowers_on_cpu, cudnn_on_cpu  # noqa: F401 (fixtures)


def attention_reference(q, k, v, seg, sinks=None, window=0):
  """float64 loops over (b, t, h); a sink adds exp(sink) to the softmax's denominator."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  seg = np.asarray(seg)
  b_, t_, h_, e_ = q.shape
  r = h_ // k.shape[2]
  out = np.zeros_like(q)
  for b in range(b_):
    for t in range(t_):
      if seg[b, t] == 0:
        continue
      keys = [s for s in range(t + 1) if seg[b, s] == seg[b, t] and (not window or t - s < window)]
      for h in range(h_):
        scores = np.array([q[b, t, h] @ k[b, s, h // r] for s in keys]) / np.sqrt(e_)
        p = np.exp(scores)
        p /= p.sum() + (0.0 if sinks is None else np.exp(float(sinks[h])))
        out[b, t, h] = sum(pi * v[b, s, h // r] for pi, s in zip(p, keys))
  return out


def test_attention_matches_reference():
  rng = np.random.default_rng(1)
  q = rng.standard_normal((2, 7, 4, 8)).astype(np.float32)
  k = rng.standard_normal((2, 7, 2, 8)).astype(np.float32)
  v = rng.standard_normal((2, 7, 2, 8)).astype(np.float32)
  seg = np.array([[1, 1, 1, 2, 2, 0, 0], [1, 2, 2, 2, 3, 3, 3]], np.int32)
  out = attention.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(seg))
  np.testing.assert_allclose(np.asarray(out), attention_reference(q, k, v, seg),
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [0, 3])
def test_attention_sinks_and_window_match_reference(rng, window):
  q, k, v = (rng.standard_normal((2, 9, h, 8)).astype(np.float32) for h in (4, 2, 2))
  sinks = (2 * rng.standard_normal(4)).astype(np.float32)
  seg = np.array([[1, 1, 1, 1, 1, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1]], np.int32)
  out = attention.attention(*(jnp.asarray(a) for a in (q, k, v, seg)), sinks_H=jnp.asarray(sinks),
                            window=window)
  np.testing.assert_allclose(np.asarray(out), attention_reference(q, k, v, seg, sinks, window),
                             rtol=1e-5, atol=1e-5)
  if window:
    plain = attention.attention(*(jnp.asarray(a) for a in (q, k, v, seg)), window=window)
    np.testing.assert_allclose(np.asarray(plain), attention_reference(q, k, v, seg, None, window),
                               rtol=1e-5, atol=1e-5)


def packed_rows(rng, b, t, max_docs):
  """Rows as the packer writes them: documents 1..n of random lengths, then padding."""
  seg = np.zeros((b, t), np.int32)
  for row in seg:
    n = rng.integers(1, max_docs + 1)
    end = rng.integers(n, t + 1)  # padding from `end` on
    bounds = [0, *np.sort(rng.choice(np.arange(1, end), size=n - 1, replace=False)), end]
    for doc in range(n):
      row[bounds[doc]:bounds[doc + 1]] = doc + 1
  return seg


@pytest.mark.parametrize("seed", range(4))
def test_document_spans_give_the_document_mask(seed):
  """The cuDNN path hands each document over as (start, length): the mask those spans imply
  (causal within a span) is the document mask, with padding and unequal documents."""
  rng = np.random.default_rng(seed)
  print("seed", seed)
  seg = packed_rows(rng, 3, 37, 6)
  seg[0] = 0  # a row of padding only
  bound = documents.documents_bound(seg)
  assert bound >= seg.max() and bound & (bound - 1) == 0 and bound < 2 * max(seg.max(), 1)
  starts, lengths = attention.document_spans(jnp.asarray(seg), bound)
  assert starts.shape == (3, bound + 1) and lengths.shape == (3, bound)
  for b in range(3):  # present documents first, then empty spans where they end (never -1)
    n = seg[b].max()
    assert (np.asarray(lengths[b, :n]) > 0).all() and (np.asarray(lengths[b, n:]) == 0).all()
    assert (np.asarray(starts[b, n:bound]) == np.sum(seg[b] > 0)).all()
    assert np.asarray(starts[b, bound]) == -1
  np.testing.assert_array_equal(np.asarray(attention.spans_mask(starts, lengths, 37)),
                                np.asarray(attention.document_mask(jnp.asarray(seg))))


@pytest.mark.parametrize("per_call,window,sinks", [(2, 0, False), (3, 0, False), (8, 0, False),
                                                   (3, 4, True), (8, 0, True)])
def test_documents_in_several_cudnn_calls(cudnn_on_cpu, per_call, window, sinks):
  """The cuDNN path's split of a row's documents over calls (its workspace bound), with a
  sliding window and sinks (from each call's log-normalisers): output and gradients equal the
  einsum reference's, though each call leaves garbage outside its spans, and the backward
  passes read the merged output and log-normalisers, each call's share in its own layout."""
  rng = np.random.default_rng(per_call)
  seg = packed_rows(rng, 3, 41, 7)
  seg[0] = 0  # a row of padding only
  seg[1, :] = np.minimum(np.arange(41) // 5 + 1, 7)  # seven documents, no padding
  bound = documents.documents_bound(seg)
  q, k, v, cot = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
                  for shape in ((3, 41, 4, 8), (3, 41, 2, 8), (3, 41, 2, 8), (3, 41, 4, 8)))
  sinks_H = jnp.asarray(rng.standard_normal(4), jnp.float32) if sinks else None
  seg = jnp.asarray(seg)
  outs = [jax.vjp(lambda *x: fn(*x, seg), q, k, v) for fn in (
      lambda *x: attention.attention_einsum(*x, sinks_H, window),
      lambda *x: attention.attention_cudnn(*x, bound, per_call, sinks_H, window))]
  (want, want_vjp), (got, got_vjp) = outs
  for a, b in zip((got, *got_vjp(cot)), (want, *want_vjp(cot))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sinks", [False, True])
def test_one_document_rows_through_cudnn(cudnn_on_cpu, sinks):
  """Rows of one document take cuDNN's whole-row causal call, its [B, H, T] log-normalisers
  (sinks from them; the backward pass reads them), padding after the document: output and
  gradients equal the einsum reference's. The padding's queries are large: the whole-row
  backward reads their rows too, so their log-normalisers must be their own (with 0 in their
  place, exp(score) overflows and inf * 0 reaches the real keys' gradients as NaN)."""
  rng = np.random.default_rng(0)
  seg = jnp.asarray((np.arange(19)[None] < np.array([[19], [15]])).astype(np.int32))
  q, k, v, cot = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
                  for shape in ((2, 19, 4, 8), (2, 19, 2, 8), (2, 19, 2, 8), (2, 19, 4, 8)))
  q = q.at[1, 15:].multiply(1000.0)
  sinks_H = jnp.asarray(rng.standard_normal(4), jnp.float32) if sinks else None
  (got, got_vjp), (want, want_vjp) = (jax.vjp(fn, q, k, v) for fn in (
      lambda *x: attention.attention_cudnn(*x, seg, 1, None, sinks_H, 5),
      lambda *x: attention.attention_einsum(*x, seg, sinks_H, 5)))
  for a, b in zip((got, *got_vjp(cot)), (want, *want_vjp(cot))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("max_documents,per_call,calls", [(1, None, 1), (3, 2, 2)])
@pytest.mark.parametrize("sinks", [False, True])
def test_the_real_cudnn_calls_lower_for_cuda(cudnn_lowers_on_cpu, max_documents, per_call, calls,
                                             sinks):
  """JAX's real cuDNN calls, and the backward primitive kdjax binds itself, trace and lower for
  CUDA on CPU: one backward per forward call (none with sinks: their backward is the einsum
  reference's). A change in the private primitive's signature when the JAX pin moves fails here
  first."""
  seg = np.zeros((2, 64), np.int32)
  seg[0, :10], seg[0, 10:30], seg[0, 30:50], seg[1] = 1, 2, 3, 1
  seg = jnp.asarray(seg if max_documents > 1 else seg > 0, jnp.int32)
  q = jnp.zeros((2, 64, 4, 64), jnp.bfloat16)
  k = jnp.zeros((2, 64, 2, 64), jnp.bfloat16)
  sinks_H = jnp.zeros(4, jnp.float32) if sinks else None
  loss = lambda q, k, v: jnp.sum(attention.attention_cudnn(
      q, k, v, seg, max_documents, per_call, sinks_H).astype(jnp.float32))
  got = cudnn_calls_for_cuda(jax.value_and_grad(loss, argnums=(0, 1, 2)), q, k, k)
  assert got == (calls, 0 if sinks else calls)


@pytest.mark.parametrize("window,sinks,bands", [(0, False, 8), (0, True, 3), (3, True, 8),
                                                (9, False, 8)])
def test_einsum_attention_in_query_blocks(seed, window, sinks, bands, monkeypatch):
  """Rows longer than query_block go through in blocks (a window block reads only its keys; full
  layers in causal bands, the 5 blocks one per band or in 3 bands): output and gradients equal
  the single-block computation, T not a multiple of the block."""
  monkeypatch.setattr(attention, "CAUSAL_BANDS", bands)
  rng = np.random.default_rng(seed)
  seg = jnp.asarray(packed_rows(rng, 2, 23, 3))
  q, k, v, cot = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
                  for shape in ((2, 23, 4, 8), (2, 23, 2, 8), (2, 23, 2, 8), (2, 23, 4, 8)))
  sinks_H = jnp.asarray(rng.standard_normal(4), jnp.float32) if sinks else None
  outs = [jax.vjp(lambda *x: attention.attention_einsum(*x, seg, sinks_H, window, query_block=b),
                  q, k, v) for b in (64, 5)]
  (want, want_vjp), (got, got_vjp) = outs
  for a, b in zip((got, *got_vjp(cot)), (want, *want_vjp(cot))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_documents_per_call():
  assert attention.documents_per_call(1, 131072, 16) == 2
  assert attention.documents_per_call(1, 32768, 64) == 8
  assert attention.documents_per_call(4, 8192, 4) == 4
  assert attention.documents_per_call(1, 1 << 20, 4) == 2


def test_documents_bound():
  assert [documents.documents_bound(np.array([[m]])) for m in (0, 1, 2, 3, 4, 5, 9)] == \
      [1, 1, 2, 4, 4, 8, 16]


def test_cudnn_attention_needs_a_documents_bound():
  q = jnp.zeros((1, 4, 2, 8), jnp.bfloat16)
  with pytest.raises(ValueError, match="max_documents"):
    attention.attention(q, q, q, jnp.ones((1, 4), jnp.int32), impl="cudnn")


def test_mean_context():
  # one row: documents of 3 and 2 tokens, then one padding position
  seg = np.array([[1, 1, 1, 2, 2, 0]])
  assert documents.mean_context(seg) == (6 + 3) / 6
  assert documents.mean_context(np.ones((2, 4), np.int32)) == 10 / 4
