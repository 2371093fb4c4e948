"""Training (training/train.py): the loss falls, the step's metrics and updates, memory levers,
accumulation, objective "online" through its targets, remat "auto"."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdjax import cache, config
from kdjax.data.packing import next_token_labels
from kdjax.errors import UserError
from kdjax.loss import LossSettings
from kdjax.models import llama, remat
from kdjax.plots import read_metrics
from kdjax.teacher import OnlineTargets
from kdjax.training import remat_auto, train
from tests.fixtures.train_run import (
  K,
  S,
  T,
  V,
  compiled,
  fit,
  make_cache,
  opt_group,
  params_of,
  tiny_model_cfg,
)


def test_distillation_loss_falls_and_logs(tmp_path, rng):
  store = make_cache(tmp_path / "c.zarr", rng)
  fit(tmp_path, store, opt=opt_group(steps=30, ckpt_every=30, lr=3e-2))
  rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
  assert [r["step"] for r in rows] == list(range(1, 31))
  assert rows[-1]["kl"] < 0.5 * rows[0]["kl"]
  assert all(np.isfinite(r["loss"]) and r["tokens_per_s"] > 0 for r in rows)
  assert all(0 <= r["top1"] <= 1 and 0 < r["entropy"] <= np.log(V) for r in rows), rows
  assert rows[-1]["top1"] > rows[0]["top1"] + 0.3  # the teacher's top-1 is learnable here
  assert rows[-1]["entropy"] < rows[0]["entropy"]


def test_hard_label_loss_is_cross_entropy(tmp_path, rng, caplog):
  """The hard-label loss is the CE, and is named so: no kl in the log line or metrics.jsonl
  (its one-hot "teacher" makes the step's kl the CE itself)."""
  store = make_cache(tmp_path / "c.zarr", rng)
  batch = {k: v[0] for k, v in train.to_step_batch(store.read(np.arange(2)), 1, True).items()}
  loss = LossSettings.from_config(config.base().loss, hard_labels=True)
  graphdef, params = nnx.split(llama.Transformer(tiny_model_cfg(), rngs=nnx.Rngs(0)))
  _, metrics = train.loss_fn({"params": params}, graphdef, batch, loss, 1)
  np.testing.assert_allclose(metrics["kl"], metrics["ce"], rtol=1e-5)
  with caplog.at_level("INFO"):
    fit(tmp_path, store, opt=opt_group(steps=2), hard_labels=True)
  rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
  for r in rows:
    np.testing.assert_allclose(r["loss"], r["ce"], rtol=1e-5)
    assert "kl" not in r and "top1" in r
  lines = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("run step")]
  assert len(lines) == 2 and all(" ce " in line and " kl " not in line for line in lines), lines


def test_to_step_batch_shapes_and_one_hot_teacher():
  rows = {"tokens": np.arange(4 * T, dtype=np.int32).reshape(4, T),
          "positions": np.zeros((4, T), np.int32), "segment_ids": np.ones((4, T), np.int32),
          "loss_mask": np.ones((4, T), bool)}
  batch = train.to_step_batch(rows, accum_steps=2, hard_labels=True)
  assert batch["tokens"].shape == (2, 2, T)
  assert batch["topk_ids"].shape == (2, 2, T, 1)
  np.testing.assert_array_equal(batch["topk_ids"][..., 0], batch["labels"])
  np.testing.assert_array_equal(batch["labels"][0, 0, :-1], rows["tokens"][0, 1:])
  g = config.base().loss
  g.update(objective="tail", temperature=2.0, ce_weight=0.5, hidden_weight=1.0, chunk_size=24)
  own = LossSettings.from_config(g, hard_labels=False)
  assert (own.objective, own.temperature, own.ce_weight, own.hidden_weight) == (
      "tail", 2.0, 0.5, 1.0)
  # hard labels: the one-hot teacher's sparse KL at tau 1 is the cross-entropy, nothing mixed in
  hard = LossSettings.from_config(g, hard_labels=True)
  assert (hard.objective, hard.temperature, hard.ce_weight, hard.hidden_weight) == (
      "sparse", 1.0, 0.0, 0.0)
  for field in ("impl", "chunk_size", "dw_dtype", "position_metrics"):  # the run's numerics
    assert getattr(hard, field) == getattr(own, field) == g[field], field


def test_fused_loss_impl_in_the_train_step(rng):
  """impl "pallas" (on CPU its Mosaic GPU kernel runs in the interpreter) inside the training
  loss, bf16 compute with float32 parameters: same loss and parameter gradients as impl "xla"."""
  vocab, seq = 128, 64  # the fused kernel tiles: vocab % 128, d_model % 64, rows % 128
  cfg = tiny_model_cfg(vocab_size=vocab, d_model=64, dtype="bfloat16")
  graphdef, params = nnx.split(llama.Transformer(cfg, rngs=nnx.Rngs(0)))
  tokens = rng.integers(0, vocab, (2, seq)).astype(np.int32)
  logits = rng.normal(size=(2, seq, vocab)) * 3.0
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  ids = np.argsort(-logp, axis=-1)[..., :100].astype(np.int32)
  batch = {"tokens": tokens, "positions": np.broadcast_to(np.arange(seq, dtype=np.int32),
                                                            (2, seq)).copy(),
           "segment_ids": np.ones((2, seq), np.int32), "loss_mask": rng.random((2, seq)) < 0.9,
           "labels": next_token_labels(tokens), "topk_ids": ids,
           "topk_logprobs": np.take_along_axis(logp, ids, -1).astype(np.float32)}
  out = {}
  for impl in ("xla", "pallas"):
    settings = LossSettings("tail", 1.0, 0.2, impl, 0, "float32")
    out[impl] = jax.jit(jax.value_and_grad(train.loss_fn, has_aux=True),
                        static_argnums=(1, 3, 4))({"params": params}, graphdef, batch, settings, 1)
  (loss_x, _), grads_x = out["xla"]
  (loss_p, _), grads_p = out["pallas"]
  # bf16 activations and gradients; "pallas" also reads its top-k logits back from bf16 exp
  # (up to 2^-8 per position), averaged over ~115 positions here.
  assert abs(float(loss_p) - float(loss_x)) <= 1e-3 * abs(float(loss_x))
  flat_x, flat_p = (np.concatenate([np.ravel(g) for g in jax.tree.leaves(t)])
                    for t in (grads_x, grads_p))
  assert np.linalg.norm(flat_p - flat_x) <= 2e-2 * np.linalg.norm(flat_x)


def test_step_metrics_are_masked_means_of_the_dense_terms(rng):
  """top1 and entropy in the step's metrics: the masked means of the student's argmax agreeing
  with the teacher's top-1 id and of its softmax entropy, from dense float64 logits."""
  cfg = tiny_model_cfg()
  model = llama.Transformer(cfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  tokens = rng.integers(0, V, (3, T)).astype(np.int32)
  ids = np.stack([rng.permutation(V)[:K] for _ in range(3 * T)]).reshape(3, T, K).astype(np.int32)
  mask = rng.random((3, T)) < 0.7
  batch = {"tokens": tokens, "positions": np.broadcast_to(np.arange(T, dtype=np.int32),
                                                            (3, T)).copy(),
           "segment_ids": np.ones((3, T), np.int32), "loss_mask": mask,
           "labels": next_token_labels(tokens), "topk_ids": ids,
           "topk_logprobs": np.sort(rng.normal(size=(3, T, K)), -1)[..., ::-1] - 3.0}
  settings = LossSettings("sparse", 2.0, 0.0, "xla", 10, "float32")
  loss_fn = jax.jit(train.loss_fn, static_argnums=(1, 3, 4))
  _, metrics = loss_fn({"params": params}, graphdef, batch, settings, 1)
  hidden = np.asarray(model(tokens, batch["positions"], batch["segment_ids"]), np.float64)
  z = hidden @ np.asarray(model.lm_head_DxV(), np.float64) / 2.0
  logq = z - z.max(-1, keepdims=True)
  logq -= np.log(np.exp(logq).sum(-1, keepdims=True))
  entropy = -(np.exp(logq) * logq).sum(-1)
  top1 = z.argmax(-1) == ids[..., 0]
  np.testing.assert_allclose(float(metrics["entropy"]), entropy[mask].mean(), rtol=1e-4)
  np.testing.assert_allclose(float(metrics["top1"]), top1[mask].mean(), rtol=1e-6)
  for settings in (LossSettings("sparse", 2.0, 0.0, "xla", 10, "float32", False),
                   LossSettings("sparse", 2.0, 0.0, "paper", 10, "float32")):
    _, metrics = loss_fn({"params": params}, graphdef, batch, settings, 1)
    assert set(metrics) == {"kl", "ce"}  # switched off; the paper's algorithm has none


def one_update(opt_overrides, batch_AxB, seed=0):
  """Parameters and metrics after one optimizer step of a tiny model on batch_AxB."""
  opt = opt_group(**opt_overrides)
  tx, _ = train.make_optimizer(opt)
  graphdef, params = nnx.split(llama.Transformer(tiny_model_cfg(), rngs=nnx.Rngs(seed)))
  state, grads_sum = train.init_state(params, tx, opt)
  settings = LossSettings("tail", 1.0, 0.1, "xla", 10, "float32")
  state, metrics, grads_sum = train.train_step(
      state, grads_sum, batch_AxB, graphdef=graphdef, tx=tx, loss=settings,
      state_memory=opt.state_memory, max_documents=4)
  assert all(float(jnp.abs(g).max()) == 0 for g in jax.tree.leaves(grads_sum))  # zeroed
  return state, {k: float(v) for k, v in metrics.items()}


def step_rows(rng, rows):
  tokens = rng.integers(0, V, (rows, T)).astype(np.int32)
  seg = np.repeat(np.array([[1] * 7 + [2] * 6 + [0] * 3], np.int32), rows, 0)
  logits = rng.normal(size=(rows, T, V)) * 2.0
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  ids = np.argsort(-logp, axis=-1)[..., :K].astype(np.int32)
  return {"tokens": tokens, "segment_ids": seg, "positions": np.where(
              seg == 2, np.arange(T) - 7, np.where(seg == 1, np.arange(T), 0)).astype(np.int32),
          "loss_mask": (seg != 0) & (np.roll(seg, -1, 1) == seg), "topk_ids": ids,
          "topk_logprobs": np.take_along_axis(logp, ids, -1).astype(np.float32)}


def test_accumulation_matches_one_big_batch(rng):
  """4 rows as 1 x 4, 2 x 2 and 4 x 1 micro-batches (equal valid positions per row, so the mean
  of means is the mean): the same loss, gradient norm and updated parameters to float32."""
  rows = step_rows(rng, 4)
  results = [one_update({"batch_size": 4 // a, "accum_steps": a},
                        train.to_step_batch(rows, a, hard_labels=False)) for a in (1, 2, 4)]
  (state_1, metrics_1), others = results[0], results[1:]
  for state, metrics in others:
    for key in ("loss", "kl", "ce", "grad_norm"):
      np.testing.assert_allclose(metrics[key], metrics_1[key], rtol=2e-5)
    for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(state_1["params"])):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("lever", [{"accum_dtype": "bfloat16"}, {"state_dtype": "bfloat16"},
                                   {"state_memory": "host"}])
def test_memory_levers_keep_the_update(lever, rng):
  """Each memory lever gives the float32 update to bf16 rounding (host memory: exactly), and
  keeps its state where and in the dtype it says."""
  rows = step_rows(rng, 4)
  batch = train.to_step_batch(rows, 2, hard_labels=False)
  base_state, base_metrics = one_update({"batch_size": 2}, batch)
  state, metrics = one_update({"batch_size": 2, **lever}, batch)
  exact = "state_memory" in lever
  np.testing.assert_allclose(metrics["grad_norm"], base_metrics["grad_norm"],
                             rtol=0 if exact else 1e-2)
  moved = [np.abs(np.asarray(a) - np.asarray(b)).max() / max(np.abs(np.asarray(b)).max(), 1e-9)
           for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(base_state["params"]))]
  assert max(moved) <= (0 if exact else 1e-2), max(moved)
  opt_leaves = [x for x in jax.tree.leaves(state["opt"]) if x.ndim]
  if lever.get("state_dtype") == "bfloat16":
    assert all(x.dtype == jnp.bfloat16 for x in opt_leaves)
  if exact:
    assert all(x.sharding.memory_kind == "pinned_host" for x in opt_leaves)


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_host_moments_are_the_optimizers_initial_state(state_dtype):
  """init_state makes host-memory moments as zeros without the GPU: make_optimizer's state must
  start at zero, with tx.init's structure and dtypes, for that to hold."""
  _, params = nnx.split(llama.Transformer(tiny_model_cfg(), rngs=nnx.Rngs(0)))
  opt = opt_group(state_dtype=state_dtype, state_memory="host")
  tx, _ = train.make_optimizer(opt)
  expected = tx.init({"params": params})
  state, _ = train.init_state(params, tx, opt)
  assert jax.tree.structure(state["opt"]) == jax.tree.structure(expected)
  for got, want in zip(jax.tree.leaves(state["opt"]), jax.tree.leaves(expected)):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.sharding.memory_kind == "pinned_host"
    assert not np.any(np.asarray(want)) and not np.any(np.asarray(got))


@pytest.mark.parametrize("state_memory", ["device", "host"])
def test_second_step_compiles_nothing(state_memory, rng):
  """The state leaves init_state committed where the steps' outputs land: step 1 reuses step 0's
  programs (moments in host memory once compiled both programs again, ~170 s at 256K)."""
  opt = opt_group(batch_size=2, state_memory=state_memory)
  tx, _ = train.make_optimizer(opt)
  graphdef, params = nnx.split(llama.Transformer(tiny_model_cfg(), rngs=nnx.Rngs(0)))
  state, grads_sum = train.init_state(params, tx, opt)
  settings = LossSettings("tail", 1.0, 0.1, "xla", 10, "float32")
  batch = train.to_step_batch(step_rows(rng, 4), 2, hard_labels=False)
  sizes = []
  for _ in range(2):
    state, metrics, grads_sum = train.train_step(
        state, grads_sum, batch, graphdef=graphdef, tx=tx, loss=settings,
        state_memory=opt.state_memory, max_documents=4)
    jax.block_until_ready((state, metrics))
    sizes.append((train.grad_step._cache_size(), train.apply_step._cache_size()))
  assert sizes[1] == sizes[0], sizes


def test_a_run_compiles_its_step_once(tmp_path, rng):
  """remat "auto"'s plan of the chosen policy is the program the steps run: one compile of
  grad_step for the whole run, though the plan's first rows hold one document each and the
  loader's batches three (their bound was the plan's, then grew: two compiles)."""
  segment_ids = np.repeat(np.array([[1] * 6 + [2] * 5 + [3] * 5], np.int32), S, axis=0)
  segment_ids[:2] = 1
  store = make_cache(tmp_path / "c.zarr", rng, segment_ids=segment_ids)
  cfg = tiny_model_cfg(remat="auto", d_model=40)  # shapes no other test compiles
  with compiled() as names:
    model = fit(tmp_path, store, cfg=cfg, opt=opt_group(steps=3, memory_gib=1000.0))
  assert model.cfg.remat == remat.AUTO_ORDER[0]
  assert names.count("jit(grad_step)") == 1, names


def test_documents_bound_per_micro_batch(tmp_path, rng, monkeypatch):
  """opt.documents_bound "micro_batch": each micro-batch's attention runs with its own bound (1
  for two rows of one document, 4 where a row holds three), where "store" gives every one the
  cache's 4; the same parameters (the bound sizes cuDNN's calls; on CPU the einsum attention
  ignores it)."""
  segment_ids = np.ones((S, T), np.int32)
  segment_ids[S // 2:] = [1] * 6 + [2] * 5 + [3] * 5
  store = make_cache(tmp_path / "c.zarr", rng, segment_ids=segment_ids)
  real = train.grad_step
  seen = []

  def spy(*args, **kwargs):
    seen[-1].add(kwargs["max_documents"])
    return real(*args, **kwargs)
  spy.lower = real.lower
  monkeypatch.setattr(train, "grad_step", spy)
  params = []
  for bound in ("store", "micro_batch"):
    seen.append(set())
    params.append(params_of(fit(tmp_path, store, name=bound,
                                opt=opt_group(documents_bound=bound))))
  assert seen == [{4}, {1, 4}], seen
  for a, b in zip(*params):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_online_objective_runs_the_teacher_beside_the_step(tmp_path, rng):
  """objective "online": a data store (no top-k), the teacher's full softmax in every step. The
  step's loss is the full-vocabulary KL of the two models on the batch, and training lowers it."""
  tokens = rng.integers(0, V, (S, T)).astype(np.int32)
  tokens[:, 1:] = (tokens[:, :1] + np.arange(1, T)) % V
  mask = np.ones((S, T), bool)
  mask[:, -1] = False
  store = cache.create(str(tmp_path / "d.zarr"), num_seqs=S, seq_len=T, k=0, vocab_size=V,
                       attrs={"source": "test"})
  store.write(0, {"tokens": tokens, "segment_ids": np.ones((S, T), np.int32),
                  "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (S, T)).copy(),
                  "loss_mask": mask})
  store = cache.open(str(tmp_path / "d.zarr"))
  teacher = llama.Transformer(tiny_model_cfg(d_model=48), rngs=nnx.Rngs(7))
  cfg = tiny_model_cfg()
  loss_cfg = config.base().loss
  loss_cfg.update(objective="online", chunk_size=10)

  batch = {k: jnp.asarray(v) for k, v in train.to_step_batch(
      store.read(np.arange(2)), 1, hard_labels=False).items()}
  batch = {k: v[0] for k, v in batch.items()}
  student = llama.Transformer(cfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(student)
  settings = LossSettings.from_config(loss_cfg, hard_labels=False)
  targets = OnlineTargets(teacher)
  _, metrics = train.grad_step({"params": params}, {"params": jax.tree.map(jnp.zeros_like, params)},
                              targets(batch, 1), graphdef=graphdef, loss=settings, max_documents=1)
  value = metrics.pop("loss")

  def logprobs(model):
    hidden = np.asarray(model(batch["tokens"], batch["positions"], batch["segment_ids"]),
                        np.float64)
    z = hidden @ np.asarray(model.lm_head_DxV(), np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))
  logq, logp = logprobs(student), logprobs(teacher)
  m = np.asarray(batch["loss_mask"])
  np.testing.assert_allclose(float(value), (np.exp(logp) * (logp - logq)).sum(-1)[m].mean(),
                             rtol=1e-4)
  assert set(metrics) == {"kl", "ce", "top1", "entropy"}

  with pytest.raises(ValueError, match="objective 'online', and only it"):
    train.fit(name="no_teacher", model=student, model_cfg=cfg, store=store,
              workdir=str(tmp_path / "no_teacher"), opt=opt_group(), loss_cfg=loss_cfg,
              hard_labels=False, seed=0)
  train.fit(name="run", model=llama.Transformer(cfg, rngs=nnx.Rngs(0)), model_cfg=cfg,
            store=store, workdir=str(tmp_path / "run"), opt=opt_group(steps=20, ckpt_every=20),
            loss_cfg=loss_cfg, hard_labels=False, seed=0, targets=targets)
  rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
  assert rows[-1]["kl"] < rows[0]["kl"]


def test_remat_auto_without_a_device_limit_on_a_gpu_asks_for_one(monkeypatch):
  """mesh.allocator 'platform': JAX reports no bytes_limit; auto must not plan as on a CPU."""
  class Gpu:
    platform = "gpu"
    memory_stats = staticmethod(lambda: {"bytes_in_use": 1})
  monkeypatch.setattr(jax, "local_devices", lambda: [Gpu()])
  with pytest.raises(UserError, match="set opt.memory_gib"):
    remat_auto.budget_bytes(0)
  assert remat_auto.budget_bytes(2) == 2 * remat_auto.GIB


def test_remat_auto_skips_a_plan_whose_temporaries_find_no_piece(monkeypatch, caplog):
  """A plan within the budget whose block of temporaries the pool cannot give in one piece is
  passed over for the next policy, and the choice names why."""
  cfg = tiny_model_cfg(remat="auto")
  order = remat.AUTO_ORDER
  temps = {p: (len(order) - i) * remat_auto.GIB for i, p in enumerate(order)}  # fastest largest

  class Plan:  # lower(graphdef) -> .compile().memory_analysis().temp_size_in_bytes
    def __init__(self, policy):
      self.temp_size_in_bytes = temps[policy]
    compile = memory_analysis = lambda self: self

  asked = []

  def one_piece(nbytes):
    asked.append(nbytes)
    return nbytes <= temps[order[2]]

  # the graphdef stands for its policy here: lower reads it back
  monkeypatch.setattr(remat_auto, "with_policy",
                      lambda g, c, policy: (policy, dataclasses.replace(c, remat=policy)))
  monkeypatch.setattr(remat_auto, "one_piece", one_piece)
  with caplog.at_level("INFO"):
    _, chosen = remat_auto.choose(None, cfg, {}, tokens=8, lower=Plan, memory_gib=1000.0)
  assert chosen.remat == order[2]
  assert asked == [temps[p] for p in order[:3]]
  assert f"{order[0]} {temps[order[0]] / remat_auto.GIB:.3g} (no {len(order):.3g} GiB piece)" in (
      caplog.text)


def test_one_piece_tries_each_gpu_and_only_out_of_memory_means_no(monkeypatch):
  """one_piece allocates the block on every local GPU (never on a CPU); RESOURCE_EXHAUSTED is a
  no, any other failure is a bug and propagates."""
  class Device:
    def __init__(self, platform):
      self.platform = platform
  tried, outcome = [], {}

  def zeros(shape, dtype, device):
    assert shape == (1, 4096) and dtype == jnp.int8  # rows of 4 KiB: no index past 2**31
    tried.append(device.platform)
    if outcome.get("error"):
      raise jax.errors.JaxRuntimeError(outcome["error"])
    return np.zeros(0)

  monkeypatch.setattr(remat_auto, "jnp", types.SimpleNamespace(zeros=zeros, int8=jnp.int8))
  monkeypatch.setattr(jax, "local_devices", lambda: [Device("cpu"), Device("gpu"), Device("gpu")])
  assert remat_auto.one_piece(123) and tried == ["gpu", "gpu"]
  outcome["error"] = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 123 bytes"
  assert not remat_auto.one_piece(123)
  outcome["error"] = "INTERNAL: something else"
  with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
    remat_auto.one_piece(123)


@pytest.mark.slow  # seven compilations and a fit
def test_remat_auto_takes_the_fastest_policy_that_fits(tmp_path, rng, monkeypatch):
  """remat "auto" plans each policy with XLA (fastest first) and takes the first within the
  budget's margin; fit trains with it; a budget nothing fits is one clear error; a policy whose
  kept values alone exceed the budget is refused without a compilation."""
  store = make_cache(tmp_path / "c.zarr", rng)
  cfg = tiny_model_cfg(remat="auto", n_layers=2)
  tx, _ = train.make_optimizer(opt_group())
  loss = LossSettings.from_config(config.base().loss, hard_labels=False)
  graphdef, params = nnx.split(llama.Transformer(cfg, rngs=nnx.Rngs(0)))
  state, grads_sum = train.init_state(params, tx, opt_group())

  def plan(memory_gib):
    return train.resolve_remat(graphdef, cfg, state, grads_sum, store,
                               opt_group(memory_gib=memory_gib), loss, False, 1)[1].remat

  def planned(memory_gib):  # policy -> "GiB" as the error of a budget nothing fits names them
    with pytest.raises(ValueError, match="no remat policy fits") as e:
      plan(memory_gib)
    items = str(e.value).split("GiB: ")[1].rstrip(");").split(")")[0].split(", ")
    return dict(item.split() for item in items)

  assert plan(1000.0) == "none"
  # Every policy's kept values exceed a budget of 1e-9 GiB: refused by the bound, not planned.
  assert all(gib.startswith(">") for gib in planned(1e-9).values())
  with monkeypatch.context() as m:  # the bound off: every policy compiled and planned
    m.setattr(remat, "saved_bytes_per_token", lambda *_: -2**60)
    needs = {p: float(gib) for p, gib in planned(1e-9).items()}
  assert set(needs) == set(remat.AUTO_ORDER) and needs["full"] < needs["none"]
  smaller = sorted(set(needs.values()))
  budget = (smaller[0] + smaller[1]) / 2 / remat_auto.MARGIN  # only the smallest plans fit
  expected = next(p for p in remat.AUTO_ORDER if needs[p] <= remat_auto.MARGIN * budget)
  assert plan(budget) == expected
  model = fit(tmp_path, store, cfg=cfg, opt=opt_group(steps=2, memory_gib=budget))
  assert model.cfg.remat == expected
