"""cuDNN packed attention against the einsum reference, forward and backward, also with gpt-oss's
sinks and sliding windows (GPU only).

Run on a GPU with `JAX_PLATFORMS=cuda python -m pytest tests/test_attention_gpu.py`; skipped on
CPU. The reference runs each document alone in float32, so a 32K row needs no [T, T] scores.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdjax.models import attention, documents

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu",
                                reason="cuDNN attention runs on a GPU only")

E = 128


def packed_rows(rng, b, t, docs):
  """`docs` documents of unequal length per row, then up to 5% padding."""
  seg = np.zeros((b, t), np.int32)
  for row in seg:
    end = t - rng.integers(0, t // 20 + 1)
    cuts = np.sort(rng.choice(np.arange(1, end), size=docs - 1, replace=False))
    bounds = [0, *cuts, end]
    for d in range(docs):
      row[bounds[d]:bounds[d + 1]] = d + 1
  return seg


def reference(q, k, v, seg, cotangent):
  """Output and (dq, dk, dv) in float32, one document at a time (each padded to the longest, so
  one program serves them all)."""
  out, grads = np.zeros(q.shape, np.float32), [np.zeros(x.shape, np.float32) for x in (q, k, v)]
  spans = [(b, *np.nonzero(seg[b] == d)[0][[0, -1]]) for b in range(seg.shape[0])
           for d in range(1, seg[b].max() + 1)]
  longest = max(e - s + 1 for _, s, e in spans)

  @jax.jit
  def one(q_, k_, v_, seg_, cot_):
    o, vjp = jax.vjp(lambda *x: attention.attention_einsum(*x, seg_), q_, k_, v_)
    return o, vjp(cot_)

  for b, s, e in spans:
    n = e + 1 - s
    part = lambda x: jnp.asarray(np.pad(x[b:b + 1, s:e + 1], [(0, 0), (0, longest - n)] +
                                        [(0, 0)] * (x.ndim - 2)), jnp.float32)
    seg_ = jnp.asarray((np.arange(longest) < n)[None].astype(np.int32))
    o, dx = one(part(q), part(k), part(v), seg_, part(cotangent))
    out[b, s:e + 1] = np.asarray(o[0, :n])
    for g, d in zip(grads, dx):
      g[b, s:e + 1] = np.asarray(d[0, :n])
  return out, grads


# Llama-3.2-3B's 24 query / 8 key-value heads; fewer at 32K, where the reference's scores for
# one long document take (heads x length^2 x 4) bytes.
# per_call: documents per cuDNN call (None: attention.documents_per_call's choice).
@pytest.mark.parametrize("b,t,docs,h,g,per_call", [
    (2, 1000, 1, 24, 8, None), (2, 2048, 5, 24, 8, None), (2, 2048, 5, 24, 8, 2),
    (3, 1000, 3, 24, 8, 3), (1, 32768, 6, 4, 1, None), (1, 32768, 7, 4, 1, 2)])
def test_cudnn_packed_matches_einsum(b, t, docs, h, g, per_call, rng):
  seg = packed_rows(rng, b, t, docs)
  if b == 3:
    seg[2] = 0  # a row of padding only
  q, k, v, cot = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
                  for shape in ((b, t, h, E), (b, t, g, E), (b, t, g, E), (b, t, h, E)))
  bound = documents.documents_bound(seg)
  fn = jax.jit(lambda q_, k_, v_: attention.attention_cudnn(q_, k_, v_, jnp.asarray(seg), bound,
                                                             per_call))
  out, vjp = jax.vjp(fn, q, k, v)
  grads = vjp(cot)
  ref_out, ref_grads = reference(*(np.asarray(x, np.float32) for x in (q, k, v)), seg,
                                 np.asarray(cot, np.float32))
  pad = seg == 0
  assert (np.asarray(out)[pad] == 0).all()
  for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads)):
    got = np.asarray(got, np.float32)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    print(name, err)
    assert err < 1e-2, (name, err)  # bf16 operands


def test_cudnn_statistics_layout(rng):
  """What the kept backward and the sinks assume of a packed call (and the CPU stand-in in
  tests/fixtures/cudnn_on_cpu.py copies): with document_spans' spans, document j of row b has its
  log-normalisers at [b * M + j, :, position - start]; rows of 2, 3 and 4 documents under a bound
  of 4, so rows 0 and 1 end in empty spans (cuDNN drops spans of -1 and shifts the rest left)."""
  b, t, h, e = 3, 256, 2, 64
  seg = np.zeros((b, t), np.int32)
  for row, lengths in zip(seg, ([100, 60], [50, 50, 70], [40, 40, 40, 40])):
    row[:sum(lengths)] = np.repeat(np.arange(1, len(lengths) + 1), lengths)
  q, k, v = (jnp.asarray(rng.standard_normal((b, t, h, e)), jnp.bfloat16) for _ in range(3))
  bound = documents.documents_bound(seg)
  starts, lengths = attention.document_spans(jnp.asarray(seg), bound)
  _, stats = jax.jit(lambda *x: attention._cudnn(*x, e ** -0.5, 0, True, starts, lengths))(q, k, v)
  stats = np.asarray(stats)
  qf, kf = np.asarray(q, np.float32), np.asarray(k, np.float32)
  for row in range(b):
    for j in range(seg[row].max()):
      (inside,) = np.nonzero(seg[row] == j + 1)
      n = len(inside)
      s = np.einsum("the,she->hts", qf[row, inside], kf[row, inside]) * e ** -0.5
      s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
      np.testing.assert_allclose(stats[row * bound + j, :, :n],
                                 jax.scipy.special.logsumexp(s, axis=-1), rtol=1e-2, atol=2e-2)


# gpt-oss's 64 query / 8 key-value heads of 64 dims, its 128-key window; per_call as above.
# Rows of 3 documents under a bound of 4: each row's fourth span is empty (document_spans).
@pytest.mark.parametrize("b,t,docs,window,sinks,per_call", [
    (1, 4096, 3, 128, True, None), (1, 4096, 3, 0, True, 2), (1, 4096, 1, 128, True, None),
    (1, 4096, 4, 128, False, None), (2, 2048, 3, 128, True, None), (2, 2048, 3, 0, True, 2)])
def test_cudnn_sinks_and_window_match_einsum(b, t, docs, window, sinks, per_call, rng):
  h, g, e = 64, 8, 64
  seg = packed_rows(rng, b, t, docs)
  q, k, v, cot = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
                  for shape in ((b, t, h, e), (b, t, g, e), (b, t, g, e), (b, t, h, e)))
  sinks_H = jnp.asarray(2 * rng.standard_normal(h), jnp.float32) if sinks else None
  bound = documents.documents_bound(seg)

  def run(fn, *args):
    out, vjp = jax.vjp(jax.jit(fn), *args)
    return (out, *vjp(cot.astype(out.dtype)))

  got = run(lambda q_, k_, v_, s_: attention.attention_cudnn(
      q_, k_, v_, jnp.asarray(seg), bound, per_call, s_, window), q, k, v, sinks_H)
  f32 = lambda x: None if x is None else x.astype(jnp.float32)
  want = run(lambda q_, k_, v_, s_: attention.attention_einsum(
      q_, k_, v_, jnp.asarray(seg), s_, window), f32(q), f32(k), f32(v), sinks_H)
  for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
    if b is None:
      continue
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    err = np.linalg.norm(a - b) / np.linalg.norm(b)
    print(name, err)
    assert err < 1e-2, (name, err)  # bf16 operands


@pytest.mark.parametrize("policy", ["none", "attention", "dots_attention", "names", "full"])
def test_kept_attention_backward_under_remat(policy, rng, monkeypatch):
  """The policies that keep the merged attention output and log-normalisers hand them to cuDNN's
  backward (no second forward): a bf16 model's loss and gradients match the einsum attention's
  under remat "none", 5 documents (a bound of 8: empty spans) in 4 cuDNN calls a layer."""
  from flax import nnx

  from kdjax.models import llama
  monkeypatch.setattr(attention, "WORKSPACE_POSITIONS", 1)  # 2 documents a call
  t = 2048
  seg = jnp.asarray(packed_rows(rng, 2, t, 5))
  tokens = jnp.asarray(rng.integers(0, 512, (2, t)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (2, t))
  bound = documents.documents_bound(np.asarray(seg))

  def grads(p, impl="cudnn"):
    cfg = llama.ModelConfig(vocab_size=512, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2,
                            head_dim=E, d_ff=512, dtype="bfloat16", remat=p, attention_impl=impl)
    model = llama.Transformer(cfg, rngs=nnx.Rngs(0))
    def loss(m):
      hidden = m(tokens, positions, seg, bound).astype(jnp.float32)
      return jnp.sum(jnp.sin(hidden)), hidden
    return nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model)

  # The hidden states, not the loss: a sum of 10^6 sines of bf16 values cancels down to a few
  # thousand, which the two attentions' roundings alone move by tens.
  ((_, hidden), got), ((_, want_hidden), want) = grads(policy), grads("none", "einsum")
  assert np.linalg.norm(hidden - want_hidden) <= 2e-2 * np.linalg.norm(want_hidden)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.linalg.norm(a - b) <= 2e-2 * np.linalg.norm(b) + 1e-6
