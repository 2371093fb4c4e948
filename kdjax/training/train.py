"""Training a model against a sequence store: one jitted step, AdamW, orbax checkpoints, exact
resume.

Distillation reads a teacher cache (top-k ids and log-probs per position), or, with objective
"online" (the reference the cached objectives approximate), a plain data store whose micro-batches
get the teacher's outputs from a producer of targets run beside the step (`train_step`'s
`targets`); either way the step reads its targets from the batch (the loss: training.distillation).
Hard-label training (the demo's teacher pre-training and the hard-label baseline) reads a plain
data store and uses the same loss with a one-hot "teacher": K = 1, id = next token, log-prob 0,
for which the sparse KL is exactly the cross-entropy. One code path for all.

With loss.hidden_weight > 0 the cache also holds the teacher's final hidden states, and their
normalised squared distance to the student's is added to the loss; when the widths differ, a
learned projection [D, H] is trained beside the model (state["hidden_proj"], never exported).

Shapes: A micro-batches per optimizer step, B sequences, T positions, K top-k, D width, V vocab,
H width of the cached hidden states.
"""
import collections
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from kdjax import cache, parallel
from kdjax.cache import events
from kdjax.data.packing import next_token_labels
from kdjax.loss import LossSettings
from kdjax.models import documents, fp8, llama
from kdjax.training import distillation, remat_auto, reporting, resume

TRAINED = ("params", "hidden_proj")  # the state's entries the optimizer updates (when present)


def make_optimizer(g) -> tuple[optax.GradientTransformation, optax.Schedule]:
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=g.lr, warmup_steps=g.warmup_steps, decay_steps=g.steps,
      end_value=g.lr * g.min_lr_ratio)
  decay_matrices = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # not norms
  adamw = optax.adamw(schedule, b1=g.b1, b2=g.b2, weight_decay=g.weight_decay, mask=decay_matrices)
  tx = optax.chain(optax.clip_by_global_norm(g.grad_clip), _stored_as(adamw, g.state_dtype))
  return tx, schedule


def _stored_as(tx: optax.GradientTransformation, dtype: str) -> optax.GradientTransformation:
  """`tx` whose floating-point state is kept in `dtype` and updated in float32.

  bfloat16 halves AdamW's 8 bytes per parameter; each step rounds m and v once (relative 2^-8),
  so a moment whose step change is below that (b2 close to 1) stalls: keep b2 <= 0.99 with it.
  """
  if dtype == "float32":
    return tx
  cast = lambda tree, to: jax.tree.map(
      lambda x: x.astype(to) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

  def init(params):
    return cast(tx.init(params), dtype)

  def update(updates, state, params=None):
    updates, state = tx.update(updates, cast(state, jnp.float32), params)
    return updates, cast(state, dtype)

  return optax.GradientTransformation(init, update)


def trained(state: dict) -> dict:
  """What the optimizer updates: {"params": the model's, "hidden_proj": [D, H] if trained}."""
  return {name: state[name] for name in TRAINED if name in state}


def to_step_batch(rows: dict, accum_steps: int, hard_labels: bool) -> dict:
  """Host rows [A*B, ...] -> the step's arrays [A, B, ...]; adds labels (and a one-hot teacher).
  A cache's hidden states ([A*B, T, H]) come along when the rows hold them."""
  labels = next_token_labels(rows["tokens"])
  batch = {
      "tokens": rows["tokens"], "positions": rows["positions"],
      "segment_ids": rows["segment_ids"], "loss_mask": rows["loss_mask"], "labels": labels}
  if hard_labels:
    batch["topk_ids"] = labels[..., None]
    batch["topk_logprobs"] = np.zeros(labels.shape + (1,), np.float32)
  elif "topk_ids" in rows:  # a cache; a data store's rows (objective "online") have no top-k
    batch["topk_ids"] = rows["topk_ids"]
    batch["topk_logprobs"] = rows["topk_logprobs"]
    if "hidden" in rows:
      batch["hidden"] = rows["hidden"]
  return {k: v.reshape((accum_steps, -1) + v.shape[1:]) for k, v in batch.items()}


def in_batch(micro_BxT: dict, max_documents: int) -> dict:
  """The targets of a cache (or of hard labels): the micro-batch holds them already."""
  return micro_BxT


def loss_fn(trained_params, graphdef, batch, loss: LossSettings, max_documents: int,
            mesh: Mesh | None = None):
  """The micro-batch's loss and metrics (training.distillation, on the targets the batch holds).
  trained_params: see `trained`. mesh: the run's device mesh (kdjax/parallel.py), or None for
  one device."""
  model = nnx.merge(graphdef, trained_params["params"])
  inputs = (batch["tokens"], batch["positions"], batch["segment_ids"], max_documents)
  hidden_BxTxD = model(*inputs)
  # The loss matmuls run in the compute dtype (bf16 at scale) with f32 accumulation; an f32
  # lm_head would make all three run in f32. Its gradient flows back to the f32 parameters.
  lm_head_DxV = model.lm_head_DxV().astype(hidden_BxTxD.dtype)
  return distillation.loss(hidden_BxTxD, lm_head_DxV, batch, loss,
                           trained_params.get("hidden_proj"), mesh)


@functools.partial(jax.jit, static_argnames=("graphdef", "loss", "max_documents", "mesh"),
                   donate_argnames="grads_sum")
def grad_step(trained_params, grads_sum, batch_BxT, *, graphdef, loss: LossSettings,
              max_documents: int, mesh: Mesh | None = None):
  """One micro-batch: its gradients (of trained_params, see `trained`) added into the donated
  running sum, and its metrics.

  The sum is updated in place, so gradient accumulation holds one gradient buffer whatever the
  number of micro-batches (one program scanning them all grew with their number; BENCHMARKS.md).
  """
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  (value, metrics), grads = grad_fn(trained_params, graphdef, batch_BxT, loss, max_documents,
                                    mesh)
  # Each gradient is rounded once into the sum's dtype (opt.accum_dtype).
  grads_sum = jax.tree.map(lambda s, g: (s.astype(jnp.float32) + g).astype(s.dtype),
                           grads_sum, grads)
  return grads_sum, {"loss": value, **metrics}


@functools.partial(jax.jit, static_argnames=("tx", "state_memory"),
                   donate_argnames=("state", "grads_sum"))
def apply_step(state, grads_sum, metrics_A: list, *, tx, state_memory: str):
  """The optimizer step on the mean of A micro-batches' gradients (each micro-batch's loss is a
  mean over its valid positions). Returns the new state, the step's metrics and the gradient
  sum zeroed in place for the next step."""
  count = len(metrics_A)
  grads = jax.tree.map(lambda s: s.astype(jnp.float32) / count, grads_sum)
  opt = state["opt"]
  if state_memory == "host":  # AdamW's moments visit the device for this update only
    opt = jax.device_put(opt, jax.memory.Space.Device)
  updates, opt = tx.update(grads, opt, trained(state))
  if state_memory == "host":
    opt = jax.device_put(opt, jax.memory.Space.Host)
  new = optax.apply_updates(trained(state), updates)
  metrics = {k: jnp.mean(jnp.stack([m[k] for m in metrics_A])) for k in metrics_A[0]}
  metrics["grad_norm"] = optax.tree.norm(grads)
  zeros = jax.tree.map(jnp.zeros_like, grads_sum)
  return {**new, "opt": opt, "step": state["step"] + 1}, metrics, zeros


def init_state(params, tx, opt_cfg, hidden_proj=None):
  """Train state and the zeroed gradient sum (of `trained`), each where and in the dtype the
  config says. hidden_proj: the learned projection [D, H] of the hidden-state term, or None."""
  train_params = {"params": params}
  if hidden_proj is not None:
    train_params["hidden_proj"] = hidden_proj
  # Every array committed to its place from the start, as the steps' outputs are: with the
  # moments in host memory (committed there) an uncommitted rest compiled grad_step and
  # apply_step a second time at step 1 (~170 s at 256K on the H200).
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])  # this process's first
  if opt_cfg.state_memory == "host":
    # Made in this process's memory, never on the GPU: 8 bytes per parameter there for a moment
    # can leave JAX's pool holding regions that a step's one block of temporaries cannot use
    # (kdjax/training/remat_auto.py). make_optimizer's state starts at zero (tests/test_train.py).
    shapes = jax.eval_shape(tx.init, train_params)
    zeros = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)
    opt = jax.device_put(zeros, device.with_memory_kind("pinned_host"))
  else:
    opt = jax.device_put(tx.init(train_params), device)
  state = jax.device_put({**train_params, "step": jnp.zeros((), jnp.int32)}, device)
  grads_sum = jax.tree.map(lambda p: jnp.zeros(p.shape, opt_cfg.accum_dtype), train_params)
  return {**state, "opt": opt}, jax.device_put(grads_sum, device)


def train_step(state, grads_sum, batch_AxB: dict, *, graphdef, tx, loss: LossSettings,
               state_memory: str, max_documents: int, mesh: Mesh | None = None,
               targets=in_batch):
  """One optimizer step over A micro-batches: A grad_steps, then apply_step. targets(micro_BxT,
  max_documents) -> the micro-batch with the loss's targets, run just before its grad_step:
  `in_batch` (a cache's, hard labels'), or the teacher's outputs computed beside the step
  (objective "online": kdjax.teacher.OnlineTargets). max_documents: one bound for every
  micro-batch, or a tuple of one per micro-batch (opt.documents_bound "micro_batch"). mesh: see
  loss_fn.

  Returns (state, metrics, grads_sum) with every array still in flight (nothing waits).
  """
  metrics_A = []
  for a in range(next(iter(batch_AxB.values())).shape[0]):
    bound = max_documents[a] if isinstance(max_documents, tuple) else max_documents
    micro_BxT = targets({k: v[a] for k, v in batch_AxB.items()}, bound)
    grads_sum, metrics = grad_step(trained(state), grads_sum, micro_BxT, graphdef=graphdef,
                                   loss=loss, max_documents=bound, mesh=mesh)
    metrics_A.append(metrics)
  return apply_step(state, grads_sum, metrics_A, tx=tx, state_memory=state_memory)


def _hidden_projection(loss: LossSettings, model_cfg: llama.ModelConfig, store, seed: int):
  """The learned projection [D, H] of the hidden-state term, initialised N(0, 1/D) (so it keeps
  a vector's squared norm on average), when the term is on and the widths differ; else None."""
  if not loss.hidden_weight:
    return None
  store.require_hidden()
  if store.hidden_dim == model_cfg.d_model:
    return None
  key = jax.random.key(seed + 1)  # not the model's initialisation stream
  return jax.random.normal(key, (model_cfg.d_model, store.hidden_dim), jnp.float32) / np.sqrt(
      model_cfg.d_model)


def resolve_remat(graphdef, model_cfg, state, grads_sum, store, opt, loss, hard_labels,
                  max_documents: int, targets=in_batch, mesh=None):
  """remat "auto" made a policy (training/remat_auto.py), planned on the store's first micro-batch
  with its targets (see train_step) and the run's bound on documents per row: the very program
  the first step runs, so its compile is the plan's (jit keeps the program `lower` compiled)."""
  if model_cfg.remat != "auto":
    return graphdef, model_cfg
  micro = {k: v[0] for k, v in to_step_batch(
      store.read(np.arange(min(opt.batch_size, store.num_seqs))), 1, hard_labels).items()}
  if mesh is not None:
    micro = parallel.place_batch(mesh, micro)
  micro = targets(micro, max_documents)
  lower = lambda g: grad_step.lower(trained(state), grads_sum, micro, graphdef=g, loss=loss,
                                    max_documents=max_documents, mesh=mesh)
  return remat_auto.choose(graphdef, model_cfg, (state, grads_sum, micro),
                           remat_auto.tokens_per_device(micro["tokens"]), lower, opt.memory_gib)


class Trainer:
  """A run's optimizer, train state, jitted steps and loader, set up as `fit` runs them: `step`
  runs one optimizer step on a batch of `next_batch` (experiments/bench/e2e_bench.py times the
  same). Arguments: see `fit`."""

  def __init__(self, *, model: nnx.Module, model_cfg: llama.ModelConfig, store, opt, loss_cfg,
               hard_labels: bool, seed: int, targets=None, mesh: Mesh | None = None):
    self.opt, self.hard_labels = opt, hard_labels
    self.tx, self.schedule = make_optimizer(opt)
    self.loss = LossSettings.from_config(loss_cfg, hard_labels)
    if (self.loss.objective == "online") != (targets is not None):
      raise ValueError(f"objective {self.loss.objective!r}, targets "
                       f"{'given' if targets else 'none'}: objective 'online', and only it, takes "
                       "targets computed beside the step (kdjax.teacher.OnlineTargets)")
    self.targets = targets or in_batch
    graphdef, params = nnx.split(model)
    self.state, self.grads_sum = init_state(params, self.tx, opt, _hidden_projection(
        self.loss, model_cfg, store, seed))
    if parallel.several(mesh):
      if opt.state_memory == "host" or self.loss.objective == "online":
        raise ValueError("several devices (mesh) take opt.state_memory='device' and an offline "
                         f"objective; got {opt.state_memory!r}, {self.loss.objective!r}.")
      self.state, self.grads_sum = parallel.place_state(mesh, (self.state, self.grads_sum))
    else:
      mesh = None
    self.mesh = mesh
    # One bound on the documents per row for the whole store, as for the teacher's pass: the
    # step compiles once per run and once per resume (a bound grown batch by batch compiled it
    # again at each growth, and the first step missed remat auto's plan, made on the store's first
    # rows: 20 s at 8K, minutes at 128K, each time). A bound grown by batches reached the same
    # value after the store's densest row; that bound sets the cuDNN calls per layer
    # (kdjax.models.attention.documents_per_call).
    self.max_documents = documents.store_documents_bound(store)
    fp8.warn_without_fp8_cores(model_cfg.fp8_matmuls)
    self.graphdef, self.model_cfg = resolve_remat(graphdef, model_cfg, self.state, self.grads_sum,
                                                  store, opt, self.loss, hard_labels,
                                                  self.max_documents, self.targets, mesh)
    self.loader = cache.Loader(store, opt.batch_size * opt.accum_steps, seed=seed, shuffle=True,
                               prefetch=opt.loader_prefetch, workers=opt.loader_workers or None,
                               hidden=self.loss.hidden_weight > 0)
    self.loader_state = self.loader.state()  # always the position matching `state`
    self.tokens_per_step = opt.batch_size * opt.accum_steps * store.seq_len

  def restore(self, run: resume.Run):
    """Continues from `run`'s latest checkpoint, if it has one."""
    self.state = run.restore(self.state, self.tx, self.loader)
    self.loader_state = self.loader.state()

  def next_batch(self) -> dict:
    """The next step's host batch [A, B, ...] (waits for the loader)."""
    return to_step_batch(next(self.loader), self.opt.accum_steps, self.hard_labels)

  def step(self, batch_AxB: dict) -> dict:
    """One optimizer step on a batch of `next_batch`; returns its metrics, still in flight."""
    if self.opt.documents_bound == "micro_batch":  # each its own (host segment ids [A, B, T])
      bound = tuple(documents.documents_bound(s_BxT) for s_BxT in batch_AxB["segment_ids"])
    else:  # the store's holds its batches; a batch from elsewhere raises it (and compiles again)
      self.max_documents = max(self.max_documents,
                               documents.documents_bound(batch_AxB["segment_ids"]))
      bound = self.max_documents
    if self.mesh is not None:
      batch_AxB = parallel.place_batch(self.mesh, batch_AxB)
    self.state, metrics, self.grads_sum = train_step(
        self.state, self.grads_sum, batch_AxB, graphdef=self.graphdef, tx=self.tx,
        loss=self.loss, state_memory=self.opt.state_memory, max_documents=bound,
        mesh=self.mesh, targets=self.targets)
    self.loader_state = self.loader.state()
    return metrics

  def model(self) -> nnx.Module:
    return nnx.merge(self.graphdef, self.state["params"])

  def close(self):
    self.loader.close()


def fit(*, name: str, model: nnx.Module, model_cfg: llama.ModelConfig, store, workdir: str,
        opt, loss_cfg, hard_labels: bool, seed: int, targets=None,
        mesh: Mesh | None = None) -> nnx.Module:
  """Trains `model` for opt.steps on `store`, resuming from workdir/ckpt; returns the trained model.
  targets: with objective "online" (store: a data store), kdjax.teacher.OnlineTargets, which
  computes the teacher's outputs for each micro-batch beside the step; else None (see
  train_step).
  mesh: several devices (kdjax/parallel.py: rows split over data x fsdp, state sharded over
  fsdp), or None for one.

  Returns at once when the final checkpoint exists (the stage is complete). A checkpoint is
  written only after its step's metrics and parameters are checked finite, and metrics.jsonl then
  holds exactly one line per logged step up to it (kdjax/training/resume.py).
  """
  os.makedirs(workdir, exist_ok=True)
  trainer = Trainer(model=model, model_cfg=model_cfg, store=store, opt=opt, loss_cfg=loss_cfg,
                    hard_labels=hard_labels, seed=seed, targets=targets, mesh=mesh)
  run = resume.Run(name, workdir, trainer.model_cfg, opt.keep_checkpoints)
  trainer.restore(run)
  if run.start >= opt.steps:
    run.close()
    trainer.close()
    return trainer.model()
  reporter = reporting.Reporter(name=name, workdir=workdir, opt=opt, model_cfg=trainer.model_cfg,
                                schedule=trainer.schedule, tokens_per_step=trainer.tokens_per_step,
                                hard_labels=hard_labels, start=run.start)
  in_flight, dispatched = parallel.in_flight(trainer.mesh), collections.deque()
  with resume.StopOnSigterm(name, in_flight) as stop:
    try:
      for step in range(run.start + 1, opt.steps + 1):
        stop.check(step)
        t0 = time.perf_counter()
        events.reached("step")  # tests: a process killed, stopped or stalled in training
        batch = trainer.next_batch()
        reporter.waited(time.perf_counter() - t0)
        reporter.ran(batch["segment_ids"])
        metrics = trainer.step(batch)
        dispatched.append(metrics)  # at most in_flight steps unread (parallel.in_flight)
        while len(dispatched) >= in_flight:
          jax.block_until_ready(dispatched.popleft())
        # A logged step is read as soon as it is dispatched, so its time is its own (a step's
        # micro-batches go in as host arrays, whose copies wait for the device anyway: reading
        # one step later reported two steps as one, measured on the H200). A logged step is
        # checked finite before it is saved; save checks the parameters of every step it saves.
        if step % opt.log_every == 0 or step == opt.steps:
          reporter.report(step, metrics, run.saved)
        if step % opt.ckpt_every == 0 or step == opt.steps:
          run.save(step, trainer.state, trainer.loader_state)
    except (KeyboardInterrupt, cache.CacheError) as error:
      run.save_on_exit(error, trainer.state, trainer.loader_state)
      raise
    finally:
      trainer.close()
      run.close()
      reporter.close()
  return trainer.model()
