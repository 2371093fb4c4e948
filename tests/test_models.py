"""Model invariants: shapes, causality, document isolation, padding, jit, GQA, tying, bf16."""
import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from kdjax import config
from kdjax.models import attention, llama, remat, rope
from kdjax.models.llama import ModelConfig, Transformer

B, T = 2, 12


def make_cfg(**overrides) -> ModelConfig:
  base = dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
              d_ff=48, rope_theta=10000.0, rope_scaling=None, norm_eps=1e-6,
              tie_embeddings=False, qk_norm=False, dtype="float32", param_dtype="float32")
  base.update(overrides)
  return ModelConfig(**base)


@nnx.jit
def forward(model, tokens, positions, segment_ids):
  # Jitted: eager remat dispatches op by op and compiles each op separately.
  return model(tokens, positions, segment_ids)


def inputs(seed=0, vocab=97):
  rng = np.random.default_rng(seed)
  tokens = jnp.asarray(rng.integers(0, vocab, (B, T)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  segment_ids = jnp.ones((B, T), jnp.int32)
  return tokens, positions, segment_ids


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
  bound = attention.documents_bound(seg)
  assert bound >= seg.max() and bound & (bound - 1) == 0 and bound < 2 * max(seg.max(), 1)
  starts, lengths = attention.document_spans(jnp.asarray(seg), bound)
  assert starts.shape == (3, bound + 1) and lengths.shape == (3, bound)
  for b in range(3):  # present documents first, then -1
    n = seg[b].max()
    assert (np.asarray(lengths[b, :n]) > 0).all() and (np.asarray(lengths[b, n:]) == -1).all()
    assert (np.asarray(starts[b, n:]) == -1).all()
  np.testing.assert_array_equal(np.asarray(attention.spans_mask(starts, lengths, 37)),
                                np.asarray(attention.document_mask(jnp.asarray(seg))))


def spans_attention_leaving_garbage(q, k, v, scale, window, lse, starts=None, lengths=None):
  """A stand-in for one cuDNN call (attention._cudnn) on CPU: exact inside the given spans (or
  causal over whole rows), NaN outside them in the output and in every gradient, as cuDNN leaves
  memory there unwritten; with lse also the log-normalisers in cuDNN's layout ([B * M, H, T] by
  document at offsets within it, NaN beyond; [B, H, T] for whole rows)."""
  b, t = q.shape[:2]
  whole = starts is None
  if whole:
    starts = jnp.asarray([[0, -1]] * b, jnp.int32)
    lengths = jnp.full((b, 1), t, jnp.int32)
  mask_BxTxS = attention.spans_mask(starts, lengths, t)
  if window:
    idx = jnp.arange(t)
    mask_BxTxS = mask_BxTxS & (idx[:, None] - idx[None, :] < window)[None]
  inside_BxT = jnp.any(mask_BxTxS, axis=2)
  blot = lambda x: jnp.where(inside_BxT[:, :, None, None], x, jnp.nan)
  g = k.shape[2]

  def scores(q, k):
    s = jnp.einsum("btgre,bsge->bgrts", q.reshape(b, t, g, -1, q.shape[-1]), k) * scale
    return jnp.where(mask_BxTxS[:, None, None], s, -jnp.inf)

  @jax.custom_vjp
  def call(q, k, v):
    p = jnp.nan_to_num(jax.nn.softmax(scores(q, k), axis=-1))
    return jnp.einsum("bgrts,bsge->btgre", p, v).reshape(q.shape)

  def fwd(q, k, v):
    out, vjp = jax.vjp(call.fun, q, k, v)
    return blot(out), vjp

  call.defvjp(fwd, lambda vjp, dout: tuple(blot(d) for d in vjp(dout)))
  out = call(q, k, v)
  if not lse:
    return out
  lse_BxHxT = jax.lax.stop_gradient(jax.nn.logsumexp(scores(q, k), axis=-1)).reshape(b, -1, t)
  if whole:
    return out, lse_BxHxT
  m = lengths.shape[1]
  idx_MxT = starts[:, :m, None] + jnp.arange(t)[None, None]  # [B, M, T]: positions by offset
  valid = (jnp.arange(t)[None, None] < lengths[:, :, None]) & (starts[:, :m, None] >= 0)
  picked = jnp.take_along_axis(lse_BxHxT[:, None], jnp.clip(idx_MxT, 0, t - 1)[:, :, None],
                               axis=3)  # [B, M, H, T]
  return out, jnp.where(valid[:, :, None], picked, jnp.nan).reshape(b * m, -1, t)


@pytest.mark.parametrize("per_call,window,sinks", [(2, 0, False), (3, 0, False), (8, 0, False),
                                                   (3, 4, True), (8, 0, True)])
def test_documents_in_several_cudnn_calls(monkeypatch, per_call, window, sinks):
  """The cuDNN path's split of a row's documents over calls (its workspace bound), with a
  sliding window and sinks (from each call's log-normalisers): output and gradients equal the
  einsum reference's, though each call leaves garbage outside its spans."""
  monkeypatch.setattr(attention, "_cudnn", spans_attention_leaving_garbage)
  rng = np.random.default_rng(per_call)
  seg = packed_rows(rng, 3, 41, 7)
  seg[0] = 0  # a row of padding only
  seg[1, :] = np.minimum(np.arange(41) // 5 + 1, 7)  # seven documents, no padding
  bound = attention.documents_bound(seg)
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


def test_one_document_rows_through_cudnn_with_sinks(monkeypatch):
  """Rows of one document take cuDNN's whole-row causal call; sinks from its [B, H, T]
  log-normalisers."""
  monkeypatch.setattr(attention, "_cudnn", spans_attention_leaving_garbage)
  rng = np.random.default_rng(0)
  seg = np.ones((2, 19), np.int32)
  seg[1, 15:] = 0  # padding after the document
  q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
             for shape in ((2, 19, 4, 8), (2, 19, 2, 8), (2, 19, 2, 8)))
  sinks_H = jnp.asarray(rng.standard_normal(4), jnp.float32)
  got = attention.attention_cudnn(q, k, v, jnp.asarray(seg), 1, None, sinks_H, 5)
  want = attention.attention_einsum(q, k, v, jnp.asarray(seg), sinks_H, 5)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


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
  assert [attention.documents_bound(np.array([[m]])) for m in (0, 1, 2, 3, 4, 5, 9)] == \
      [1, 1, 2, 4, 4, 8, 16]


def test_cudnn_attention_needs_a_documents_bound():
  q = jnp.zeros((1, 4, 2, 8), jnp.bfloat16)
  with pytest.raises(ValueError, match="max_documents"):
    attention.attention(q, q, q, jnp.ones((1, 4), jnp.int32), impl="cudnn")


@pytest.mark.parametrize("tie", [False, True])
def test_shapes_and_tying(tie):
  cfg = make_cfg(tie_embeddings=tie)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  hidden = forward(model, *inputs())
  assert hidden.shape == (B, T, cfg.d_model) and hidden.dtype == jnp.float32
  head = model.lm_head_DxV()
  assert head.shape == (cfg.d_model, cfg.vocab_size)
  if tie:
    np.testing.assert_array_equal(np.asarray(head), np.asarray(model.embed_VxD[...]).T)
  untied = llama.count_params(Transformer(make_cfg(tie_embeddings=False), rngs=nnx.Rngs(0)))
  tied = llama.count_params(Transformer(make_cfg(tie_embeddings=True), rngs=nnx.Rngs(0)))
  assert untied - tied == cfg.vocab_size * cfg.d_model


def test_real_vocab_drops_padding_rows():
  cfg = make_cfg(tie_embeddings=True, real_vocab_size=90)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  assert model.lm_head_DxV().shape == (cfg.d_model, 90)
  with pytest.raises(ValueError, match="real_vocab_size"):
    make_cfg(real_vocab_size=98).validate()


def test_causality_through_gradients():
  # Distinct tokens, so the gradient on embedding row tokens[s] belongs to position s only.
  cfg = make_cfg(qk_norm=True)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  tokens = jnp.asarray(np.random.default_rng(0).permutation(cfg.vocab_size)[:T][None], jnp.int32)
  positions = jnp.arange(T, dtype=jnp.int32)[None]
  segment_ids = jnp.ones((1, T), jnp.int32)
  t = 5

  def out_at_t(m):
    return m(tokens, positions, segment_ids)[0, t].sum()

  grads = nnx.jit(nnx.grad(out_at_t))(model)
  g_VxD = np.asarray(grads.embed_VxD[...])
  row_norms_T = np.abs(g_VxD[np.asarray(tokens[0])]).sum(-1)
  assert np.all(row_norms_T[: t + 1] > 0)
  np.testing.assert_array_equal(row_norms_T[t + 1:], 0.0)


def test_packed_documents_equal_separate_runs():
  cfg = make_cfg(qk_norm=True)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(3)
  doc_a, doc_b = rng.integers(0, 97, 5), rng.integers(0, 97, 7)
  packed = jnp.asarray(np.concatenate([doc_a, doc_b])[None], jnp.int32)
  positions = jnp.asarray(np.concatenate([np.arange(5), np.arange(7)])[None], jnp.int32)
  segment_ids = jnp.asarray(np.array([1] * 5 + [2] * 7)[None], jnp.int32)
  hidden = np.asarray(forward(model, packed, positions, segment_ids))
  for doc, sl in ((doc_a, slice(0, 5)), (doc_b, slice(5, 12))):
    n = len(doc)
    alone = forward(model, jnp.asarray(doc[None], jnp.int32), jnp.arange(n, dtype=jnp.int32)[None],
                  jnp.ones((1, n), jnp.int32))
    np.testing.assert_allclose(hidden[0, sl], np.asarray(alone[0]), rtol=1e-5, atol=1e-5)


def test_padding_changes_nothing_and_stays_finite():
  model = Transformer(make_cfg(), rngs=nnx.Rngs(0))
  tokens, positions, segment_ids = inputs()
  hidden = forward(model, tokens, positions, segment_ids)
  pad = 4
  padded = forward(model, jnp.pad(tokens, ((0, 0), (0, pad)), constant_values=3),
                 jnp.pad(positions, ((0, 0), (0, pad))),
                 jnp.pad(segment_ids, ((0, 0), (0, pad))))
  np.testing.assert_allclose(np.asarray(padded[:, :T]), np.asarray(hidden), rtol=1e-5, atol=1e-5)
  assert np.all(np.isfinite(np.asarray(padded)))
  all_padding = jnp.zeros((1, 4), jnp.int32)
  grads = nnx.jit(nnx.grad(lambda m: m(all_padding, all_padding, all_padding).sum()))(model)
  assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("policy", [p for p in remat.CHOICES if p != "none"])  # auto unresolved
@pytest.mark.parametrize("family", ["dense", pytest.param("moe_sinks", marks=pytest.mark.slow)])
def test_every_remat_policy_gives_the_loss_and_gradients_of_none(policy, family):
  extra = dict(qk_norm=True) if family == "dense" else dict(
      n_experts=4, experts_per_token=2, attention_sinks=True, sliding_window=5,
      attention_bias=True, expert_bias=True)
  tokens, positions, _ = inputs(seed=3)
  segment_ids = jnp.asarray(np.repeat([[1] * 5 + [2] * 4 + [0] * 3], B, 0), jnp.int32)
  loss = lambda m: jnp.sum(jnp.sin(m(tokens, positions, segment_ids)))
  values, grads = {}, {}
  for p in ("none", policy):
    model = Transformer(make_cfg(remat=p, **extra), rngs=nnx.Rngs(0))
    values[p], grads[p] = nnx.jit(nnx.value_and_grad(loss))(model)
  np.testing.assert_allclose(float(values[policy]), float(values["none"]), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(grads[policy]), jax.tree.leaves(grads["none"])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_remat_reads_the_old_switch_and_refuses_unknown_policies():
  assert make_cfg(remat=True).remat == "full" and make_cfg(remat=False).remat == "none"
  with pytest.raises(ValueError, match="remat must be one of"):
    make_cfg(remat="some").validate()


def test_jit_equals_eager():
  model = Transformer(make_cfg(qk_norm=True), rngs=nnx.Rngs(0))
  args = inputs()
  jitted = nnx.jit(lambda m, *a: m(*a))(model, *args)
  np.testing.assert_allclose(np.asarray(jitted), np.asarray(model(*args)), rtol=1e-5, atol=1e-5)


def test_gqa_equals_mha_with_repeated_kv():
  gqa = Transformer(make_cfg(n_heads=4, n_kv_heads=2), rngs=nnx.Rngs(0))
  mha = Transformer(make_cfg(n_heads=4, n_kv_heads=4), rngs=nnx.Rngs(1))
  mha.embed_VxD[...] = gqa.embed_VxD[...]
  mha.unembed_DxV[...] = gqa.unembed_DxV[...]
  for src, dst in zip(gqa.layers, mha.layers):
    for name in ("attn_norm_D", "wq_DxHxE", "wo_HxExD", "mlp_norm_D", "w_gate_DxF", "w_up_DxF",
                 "w_down_FxD"):
      getattr(dst, name)[...] = getattr(src, name)[...]
    # Query head h uses key/value head h // R.
    dst.wk_DxGxE[...] = jnp.repeat(src.wk_DxGxE[...], 2, axis=1)
    dst.wv_DxGxE[...] = jnp.repeat(src.wv_DxGxE[...], 2, axis=1)
  args = inputs()
  np.testing.assert_allclose(np.asarray(forward(gqa, *args)), np.asarray(forward(mha, *args)),
                             rtol=1e-5, atol=1e-5)


def test_bfloat16_close_to_float32():
  cfg32 = make_cfg(qk_norm=True, tie_embeddings=True)
  m32 = Transformer(cfg32, rngs=nnx.Rngs(0))
  m16 = Transformer(dataclasses.replace(cfg32, dtype="bfloat16"), rngs=nnx.Rngs(0))
  args = inputs()
  h16 = forward(m16, *args)
  assert h16.dtype == jnp.bfloat16 and m16.lm_head_DxV().dtype == jnp.bfloat16
  h32 = np.asarray(forward(m32, *args))
  err = np.abs(np.asarray(h16, np.float32) - h32).max() / np.abs(h32).max()
  assert err < 5e-2
  all_bf16 = Transformer(dataclasses.replace(cfg32, dtype="bfloat16", param_dtype="bfloat16"),
                         rngs=nnx.Rngs(0))
  assert np.all(np.isfinite(np.asarray(forward(all_bf16, *args), np.float32)))


def test_llama3_rope_scaling():
  scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                 original_max_position_embeddings=64)
  plain = rope.inv_freq(make_cfg(head_dim=16))
  scaled = rope.inv_freq(make_cfg(head_dim=16, rope_scaling=scaling))
  wavelen = 2 * np.pi / plain
  np.testing.assert_allclose(scaled[wavelen < 16], plain[wavelen < 16])  # high frequencies kept
  np.testing.assert_allclose(scaled[wavelen > 64], plain[wavelen > 64] / 8, rtol=1e-6)
  assert np.all(scaled <= plain)
  model = Transformer(make_cfg(rope_scaling=scaling), rngs=nnx.Rngs(0))
  hash(model.cfg)  # static metadata must stay hashable
  with pytest.raises(ValueError, match="'longrope' is not supported"):
    make_cfg(rope_scaling=dict(rope_type="longrope", factor=2.0))
  with pytest.raises(ValueError, match="yarn scaling needs"):
    make_cfg(rope_scaling=dict(rope_type="yarn", factor=2.0))


def test_from_config_and_validation():
  group = config.model_group(
      vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48,
      rope_theta=5e5, norm_eps=1e-5, tie_embeddings=True, qk_norm=False, dtype="bfloat16",
      param_dtype="float32", remat="none", attention_impl="einsum")
  group.rope_scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                            original_max_position_embeddings=8192)
  cfg = ModelConfig.from_config(group)
  assert cfg.d_model == 32 and cfg.rope_scaling["factor"] == 8.0 and cfg.dtype == "bfloat16"
  assert cfg.remat == "none" and cfg.attention_impl == "einsum"
  group.rope_scaling = ml_collections.ConfigDict()  # empty group: no scaling
  assert ModelConfig.from_config(group).rope_scaling is None
  with pytest.raises(ValueError, match="multiple of n_kv_heads"):
    make_cfg(n_heads=4, n_kv_heads=3).validate()
  with pytest.raises(ValueError, match="d_model must be a positive integer"):
    make_cfg(d_model=0).validate()
  with pytest.raises(ValueError, match="dtype"):
    make_cfg(dtype="float16").validate()
  with pytest.raises(ValueError, match="attention_impl"):
    make_cfg(attention_impl="flash").validate()


def test_flops_per_token():
  cfg = make_cfg(tie_embeddings=False)
  n_matmul = llama.count_params(Transformer(cfg, rngs=nnx.Rngs(0)))
  n_matmul -= cfg.vocab_size * cfg.d_model  # embedding lookup
  n_matmul -= cfg.n_layers * 2 * cfg.d_model + cfg.d_model  # norms
  attn = 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * 64
  assert llama.flops_per_token(cfg, 64) == 6 * n_matmul + attn


def test_mean_context():
  # one row: documents of 3 and 2 tokens, then one padding position
  seg = np.array([[1, 1, 1, 2, 2, 0]])
  assert attention.mean_context(seg) == (6 + 3) / 6
  assert attention.mean_context(np.ones((2, 4), np.int32)) == 10 / 4
