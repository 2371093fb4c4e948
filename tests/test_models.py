"""Model invariants: shapes, causality, document isolation, padding, remat, jit, GQA, tying, bf16,
RoPE scaling, config validation and FLOPs (attention itself: test_attention.py)."""
import collections
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
from tests.fixtures.cudnn_on_cpu import cudnn_calls_for_cuda, cudnn_lowers_on_cpu, cudnn_on_cpu  # noqa: F401 (fixtures)

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


NO_REMAT = {}  # family: (loss, gradients) with remat "none"


@pytest.mark.parametrize("policy", [p for p in remat.CHOICES if p != "none"])  # auto unresolved
@pytest.mark.parametrize("family", ["dense", "cudnn", "fp8",
                                    pytest.param("moe_sinks", marks=pytest.mark.slow)])
def test_every_remat_policy_gives_the_loss_and_gradients_of_none(policy, family, request):
  """Also through the cuDNN path (its calls replaced by CPU stand-ins, 3 documents in 2 calls a
  layer), whose backward reads the output and log-normalisers the policies keep, and with the
  projections in FP8 (their backward reads the forward's quantized operands)."""
  extra = dict(qk_norm=True) if family == "dense" else dict(fp8_matmuls=True) if (
      family == "fp8") else dict(
      n_experts=4, experts_per_token=2, attention_sinks=True, sliding_window=5,
      attention_bias=True, expert_bias=True) if family == "moe_sinks" else dict(
      attention_impl="cudnn")
  if family == "cudnn":
    request.getfixturevalue("cudnn_on_cpu")
    request.getfixturevalue("monkeypatch").setattr(attention, "WORKSPACE_POSITIONS", 1)
  tokens, positions, _ = inputs(seed=3)
  segment_ids = jnp.asarray(np.repeat([[1] * 5 + [2] * 2 + [3] * 2 + [0] * 3], B, 0), jnp.int32)
  loss = lambda m: jnp.sum(jnp.sin(m(tokens, positions, segment_ids, 4)))

  def value_and_grad(p):
    model = Transformer(make_cfg(remat=p, **extra), rngs=nnx.Rngs(0))
    return nnx.jit(nnx.value_and_grad(loss))(model)

  if family not in NO_REMAT:  # one compilation of "none" per family and process
    NO_REMAT[family] = value_and_grad("none")
  (value, grads), (want_value, want_grads) = value_and_grad(policy), NO_REMAT[family]
  np.testing.assert_allclose(float(value), float(want_value), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("policy,calls", [("none", 1), ("full", 2), ("dots", 2), ("names", 1),
                                          ("dots_attention", 1), ("attention", 1),
                                          ("offload", 1)])
def test_which_policies_rerun_the_attentions_forward(policy, calls, cudnn_lowers_on_cpu):
  """The policies that keep the attention's output and log-normalisers never run its forward
  again in the backward pass: the gradient's program, with JAX's real cuDNN calls lowered for
  CUDA, holds `calls` cuDNN forwards per layer and one backward."""
  tokens, positions, _ = inputs(seed=3)
  segment_ids = jnp.asarray(np.repeat([[1] * 5 + [2] * 4 + [0] * 3], B, 0), jnp.int32)
  model = Transformer(make_cfg(remat=policy, attention_impl="cudnn", dtype="bfloat16"),
                      rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  loss = lambda s: jnp.sum(jnp.sin(
      nnx.merge(graphdef, s)(tokens, positions, segment_ids, 2).astype(jnp.float32)))
  n = model.cfg.n_layers
  assert cudnn_calls_for_cuda(jax.grad(loss), state) == (calls * n, n)


def projections_in(jaxpr, weight_shapes, found=None) -> collections.Counter:
  """(input shape, weight shape) of every dot_general of jaxpr (sub-jaxprs included) whose right
  operand has a weight's shape: the projections it runs, forward and backward."""
  found = collections.Counter() if found is None else found
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general" and tuple(eqn.invars[1].aval.shape) in weight_shapes:
      found[tuple(eqn.invars[0].aval.shape), tuple(eqn.invars[1].aval.shape)] += 1
    for value in eqn.params.values():
      for sub in value if isinstance(value, (list, tuple)) else [value]:
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          projections_in(sub, weight_shapes, found)
  return found


@pytest.mark.parametrize("policy", remat.POLICIES)
def test_rerun_matmul_params_are_those_of_the_gradients_program(policy, cudnn_on_cpu):
  """llama.rerun_matmul_params_per_layer (the step floor's count) is what the gradient's program
  runs again: the weights of the projections it holds beyond remat "none"'s, per layer."""
  tokens, positions, _ = inputs(seed=3)
  segment_ids = jnp.asarray(np.repeat([[1] * 5 + [2] * 4 + [0] * 3], B, 0), jnp.int32)

  def projections(remat_policy):
    model = Transformer(make_cfg(remat=remat_policy, attention_impl="cudnn", d_ff=48),
                        rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    loss = lambda s: jnp.sum(nnx.merge(graphdef, s)(tokens, positions, segment_ids, 2))
    weights = {tuple(x.shape) for x in jax.tree.leaves(state) if x.ndim >= 2}
    return model.cfg, projections_in(jax.make_jaxpr(jax.grad(loss))(state).jaxpr, weights)

  cfg, got = projections(policy)
  extra = got - projections("none")[1]
  rerun = sum(int(np.prod(weight)) * count for (_, weight), count in extra.items())
  assert rerun == llama.rerun_matmul_params_per_layer(cfg, policy) * cfg.n_layers, extra


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
