"""Training a model against a sequence store: one jitted step, AdamW, orbax checkpoints, exact resume.

Distillation reads a teacher cache (top-k ids and log-probs per position), or, with objective
"online" (the reference the cached objectives approximate), a plain data store whose micro-batches
get the teacher's outputs from a producer of targets run beside the step (`train_step`'s
`targets`); either way the step reads its targets from the batch (the loss: kdjax.distillation).
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
import dataclasses
import functools
import json
import logging
import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh

from kdjax import cache, distillation, parallel, peers, remat_auto, tensorboard
from kdjax.cache import durable, failpoints
from kdjax.checkpoints import Checkpoints
from kdjax.data.packing import next_token_labels
from kdjax.models import attention, llama

# Dense bf16 peak FLOP/s by device kind, for the MFU in the log (opt.peak_tflops overrides).
PEAK_FLOPS = {"NVIDIA H200": 989e12, "NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H100": 989e12,
              "NVIDIA A100-SXM4-80GB": 312e12, "NVIDIA A100-SXM4-40GB": 312e12}

TRAINED = ("params", "hidden_proj")  # the state's entries the optimizer updates (when present)
# Of several processes, a log line names the one whose batches others waited for when it spent
# more than this share of the time waiting for them.
SLOW_WAIT = 0.2


def peak_flops(override_tflops: float = 0.0) -> float | None:
  """The device's dense bf16 peak FLOP/s: the override if set, else PEAK_FLOPS, else None."""
  if override_tflops:
    return override_tflops * 1e12
  return PEAK_FLOPS.get(jax.devices()[0].device_kind)


@dataclasses.dataclass(frozen=True)
class LossSettings:
  """The static loss arguments of the jitted step."""
  objective: str
  temperature: float
  ce_weight: float
  impl: str
  chunk_size: int
  dw_dtype: str
  position_metrics: bool = True
  hidden_weight: float = 0.0

  @classmethod
  def from_config(cls, g, hard_labels: bool) -> "LossSettings":
    if hard_labels:  # one-hot teacher: sparse KL == cross-entropy; see the module docstring
      return cls("sparse", 1.0, 0.0, g.impl, g.chunk_size, g.dw_dtype, g.position_metrics)
    return cls(g.objective, g.temperature, g.ce_weight, g.impl, g.chunk_size, g.dw_dtype,
               g.position_metrics, g.hidden_weight)


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
  """The micro-batch's loss and metrics (kdjax.distillation, on the targets the batch holds).
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
  opt = tx.init(train_params)
  if opt_cfg.state_memory == "host":
    opt = jax.device_put(opt, jax.sharding.SingleDeviceSharding(jax.devices()[0],
                                                                memory_kind="pinned_host"))
  grads_sum = jax.tree.map(lambda p: jnp.zeros(p.shape, opt_cfg.accum_dtype), train_params)
  return {**train_params, "opt": opt, "step": jnp.zeros((), jnp.int32)}, grads_sum


def train_step(state, grads_sum, batch_AxB: dict, *, graphdef, tx, loss: LossSettings,
               state_memory: str, max_documents: int, mesh: Mesh | None = None,
               targets=in_batch):
  """One optimizer step over A micro-batches: A grad_steps, then apply_step. targets(micro_BxT,
  max_documents) -> the micro-batch with the loss's targets, run just before its grad_step:
  `in_batch` (a cache's, hard labels'), or the teacher's outputs computed beside the step
  (objective "online": kdjax.teacher.OnlineTargets). mesh: see loss_fn.

  Returns (state, metrics, grads_sum) with every array still in flight (nothing waits).
  """
  metrics_A = []
  for a in range(next(iter(batch_AxB.values())).shape[0]):
    micro_BxT = targets({k: v[a] for k, v in batch_AxB.items()}, max_documents)
    grads_sum, metrics = grad_step(trained(state), grads_sum, micro_BxT, graphdef=graphdef,
                                   loss=loss, max_documents=max_documents, mesh=mesh)
    metrics_A.append(metrics)
  return apply_step(state, grads_sum, metrics_A, tx=tx, state_memory=state_memory)


def _log_line(name, step, steps, m, lr, tok_s, mfu, mem_gib, eta_s, slowest=None):
  extra = f" top1 {m['top1']:.3f} ent {m['entropy']:.3f}" if "top1" in m else ""
  extra += f" lr {lr:.2e} tok/s {tok_s:.0f}"
  extra += f" mfu {mfu:.1%}" if mfu is not None else ""
  extra += f" mem {mem_gib:.1f}GiB" if mem_gib is not None else ""
  extra += f" eta {_duration(eta_s)}" if eta_s is not None else ""
  if slowest is not None:  # (process, its share of the time waiting for its batches)
    extra += f" slowest: process {slowest[0]} waited {slowest[1]:.0%} for data"
  kl = f" kl {m['kl']:.4f}" if "kl" in m else ""  # none on hard labels
  logging.info("%s step %d/%d loss %.4f%s ce %.4f%s", name, step, steps, m["loss"], kl, m["ce"],
               extra)


def _duration(seconds: float) -> str:
  minutes, secs = divmod(int(round(seconds)), 60)
  hours, minutes = divmod(minutes, 60)
  return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def _peak_memory_gib():
  stats = jax.local_devices()[0].memory_stats() or {}
  return stats["peak_bytes_in_use"] / 2**30 if "peak_bytes_in_use" in stats else None


@jax.jit
def _all_finite(tree) -> jax.Array:
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def _keep_metrics_until(path: str, step: int):
  """Drops the lines of steps after `step` (run again after a resume) and a torn last line."""
  if not os.path.exists(path):
    return
  kept = []
  with open(path) as f:
    for line in f:
      try:
        if json.loads(line)["step"] <= step:
          kept.append(line if line.endswith("\n") else line + "\n")
      except (ValueError, KeyError):  # a line cut by a kill
        continue
  durable.write_text(path, "".join(kept))


def _restore(ckpt: Checkpoints, step: int, state: dict, tx) -> tuple[dict, dict]:
  """Checkpoint `step` in the structure of `state`. One written before the optimizer updated
  `trained`'s dict (its moments keyed like the model's parameters alone) is read in that layout
  and its moments rekeyed, so a run started with an older kdjax resumes."""
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  try:
    return ckpt.restore(step, abstract)
  except Exception as error:  # orbax names the first difference of the trees
    if set(trained(state)) != {"params"}:
      raise
    try:
      old, loader_state = ckpt.restore(step, {**abstract, "opt": jax.eval_shape(
          tx.init, abstract["params"])})
    except Exception:
      raise error from None
  opt = jax.tree.unflatten(jax.tree.structure(abstract["opt"]), jax.tree.leaves(old["opt"]))
  return {**old, "opt": opt}, loader_state


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
                  targets=in_batch, mesh=None):
  """remat "auto" made a policy (kdjax/remat_auto.py), planned on the store's first micro-batch
  with its targets (see train_step)."""
  if model_cfg.remat != "auto":
    return graphdef, model_cfg
  micro = {k: v[0] for k, v in to_step_batch(
      store.read(np.arange(min(opt.batch_size, store.num_seqs))), 1, hard_labels).items()}
  max_documents = attention.documents_bound(micro["segment_ids"])
  if mesh is not None:
    micro = parallel.place_batch(mesh, micro)
  micro = targets(micro, max_documents)
  lower = lambda g: grad_step.lower(trained(state), grads_sum, micro, graphdef=g, loss=loss,
                                    max_documents=max_documents, mesh=mesh)
  return remat_auto.choose(graphdef, model_cfg, (state, grads_sum, micro), lower, opt.memory_gib)


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
  holds exactly one line per logged step up to it (a resume drops the lines of later steps).
  """
  os.makedirs(workdir, exist_ok=True)
  tx, schedule = make_optimizer(opt)
  loss = LossSettings.from_config(loss_cfg, hard_labels)
  graphdef, params = nnx.split(model)
  state, grads_sum = init_state(params, tx, opt, _hidden_projection(loss, model_cfg, store, seed))
  if parallel.several(mesh):
    if opt.state_memory == "host" or loss.objective == "online":
      raise ValueError("several devices (mesh) take opt.state_memory='device' and an offline "
                       f"objective; got {opt.state_memory!r}, {loss.objective!r}.")
    state, grads_sum = parallel.place_state(mesh, (state, grads_sum))
  else:
    mesh = None
  if (loss.objective == "online") != (targets is not None):
    raise ValueError(f"objective {loss.objective!r}, targets {'given' if targets else 'none'}: "
                     "objective 'online', and only it, takes targets computed beside the step "
                     "(kdjax.teacher.OnlineTargets)")
  targets = targets or in_batch
  graphdef, model_cfg = resolve_remat(graphdef, model_cfg, state, grads_sum, store, opt, loss,
                                      hard_labels, targets, mesh)
  loader = cache.Loader(store, opt.batch_size * opt.accum_steps, seed=seed, shuffle=True,
                        prefetch=opt.loader_prefetch, workers=opt.loader_workers or None,
                        hidden=loss.hidden_weight > 0)
  ckpt = Checkpoints(os.path.join(workdir, "ckpt"), model_cfg, keep=opt.keep_checkpoints)
  start = ckpt.latest_step() or 0
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  lead = jax.process_index() == 0  # of several processes, one writes the logs and metrics
  if lead:
    _keep_metrics_until(metrics_path, start)
  if start:
    state, loader_state = _restore(ckpt, start, state, tx)
    loader.restore(loader_state)
    logging.info("%s: resumed from step %d", name, start)
  if start >= opt.steps:
    ckpt.close()
    return nnx.merge(graphdef, state["params"])

  tokens_per_step = opt.batch_size * opt.accum_steps * store.seq_len
  peak = peak_flops(opt.peak_tflops)
  step_fn = functools.partial(train_step, graphdef=graphdef, tx=tx, loss=loss, targets=targets,
                              state_memory=opt.state_memory, mesh=mesh)
  max_documents = 1  # only grows (documents_bound), so the step compiles at most log2(T) times
  events = tensorboard.EventWriter(os.path.join(workdir, "tensorboard")) if lead else None
  last_saved = start
  # Since the last report: host time waiting for batches, model FLOPs of the steps run.
  clock = {"time": time.perf_counter(), "step": start, "wait": 0.0, "flops": 0.0, "first": None}

  def report(step, metrics):
    """Checks and logs one step's metrics (blocks until that step is done)."""
    # On hard labels the one-hot "teacher" makes kl the cross-entropy itself (module
    # docstring): logged once, as ce.
    m = {k: float(v) for k, v in metrics.items() if not (hard_labels and k == "kl")}
    now = time.perf_counter()
    if not all(np.isfinite(list(m.values()))):
      raise FloatingPointError(
          f"{name}: non-finite metrics at step {step}: {m}; no checkpoint was written after step "
          f"{last_saved}. Lower opt.lr or check the cache with 'python -m kdjax.cache verify "
          f"PATH', then run the same command again: it resumes from step {last_saved}.")
    elapsed, done = now - clock["time"], step - clock["step"]
    tok_s = tokens_per_step * done / elapsed
    mfu = clock["flops"] / elapsed / peak if peak else None
    if clock["first"] is None:  # the ETA leaves out the first (compiling) step
      clock["first"] = (now, step)
    first_t, first_step = clock["first"]
    eta = (now - first_t) / (step - first_step) * (opt.steps - step) if step > first_step else None
    mem, lr = _peak_memory_gib(), float(schedule(step - 1))
    # Each process's share of the time it waited for its own batches: of several, the one that
    # waited most is the one the others waited for (a slow disk, a stalled loader).
    waits = parallel.per_process(clock["wait"] / elapsed)
    clock.update(time=now, step=step, wait=0.0, flops=0.0)
    if not lead:
      return
    slowest = int(np.argmax(waits))
    _log_line(name, step, opt.steps, m, lr, tok_s, mfu, mem, eta,
              (slowest, waits[slowest]) if len(waits) > 1 and waits[slowest] > SLOW_WAIT else None)
    line = {"step": step, **m, "lr": lr, "tokens_per_s": tok_s, "mfu": mfu, "peak_mem_gib": mem,
            "data_wait_frac": max(waits), "time": time.time()}
    if len(waits) > 1:
      line.update(data_wait_process=slowest, data_wait_fracs=waits)
    with open(metrics_path, "a") as f:
      f.write(json.dumps(line) + "\n")
    events.scalars(step, {k: v for k, v in line.items() if k not in ("step", "time")})

  def save(step):
    nonlocal last_saved
    if not bool(_all_finite(state["params"])):
      raise FloatingPointError(
          f"{name}: the parameters after step {step} are not finite; no checkpoint was written "
          f"after step {last_saved}. Lower opt.lr, then run the same command again: it resumes "
          f"from step {last_saved}.")
    ckpt.save(step, state, loader_state)
    last_saved = step

  # SIGTERM (a pre-empted job) saves a checkpoint like Ctrl-C does, so no finished step is lost.
  # Of several processes, all must save the same step: the one signalled proposes a step that
  # none has passed (each is at most `in_flight` steps ahead of the slowest, which the step's
  # collectives wait for), and every process stops after it (kdjax.peers).
  stop = {"asked": False, "at": None}

  def on_sigterm(*_):
    if not peers.several():
      raise KeyboardInterrupt
    stop["asked"] = True
  previous_handler = signal.signal(signal.SIGTERM, on_sigterm)
  loader_state = loader.state()  # always the position matching `state`
  in_flight, dispatched = parallel.in_flight(mesh), collections.deque()
  try:
    for step in range(start + 1, opt.steps + 1):
      if peers.several():
        if stop["asked"] and stop["at"] is None:
          peers.propose_stop(name, step + in_flight + 2)
        stop["at"] = stop["at"] or peers.agreed_stop(name)
        if stop["at"] is not None and step > stop["at"]:
          raise KeyboardInterrupt
      t0 = time.perf_counter()
      failpoints.hit("step")  # tests: a process killed, stopped or stalled in training
      batch = to_step_batch(next(loader), opt.accum_steps, hard_labels)
      clock["wait"] += time.perf_counter() - t0
      max_documents = max(max_documents, attention.documents_bound(batch["segment_ids"]))
      clock["flops"] += tokens_per_step * llama.flops_per_token(
          model_cfg, attention.mean_context(batch["segment_ids"]))
      if mesh is not None:
        batch = parallel.place_batch(mesh, batch)
      state, metrics, grads_sum = step_fn(state, grads_sum, batch, max_documents=max_documents)
      loader_state = loader.state()
      dispatched.append(metrics)  # at most in_flight steps unread (parallel.in_flight)
      while len(dispatched) >= in_flight:
        jax.block_until_ready(dispatched.popleft())
      # A logged step is read as soon as it is dispatched, so its time is its own (a step's
      # micro-batches go in as host arrays, whose copies wait for the device anyway: reading one
      # step later reported two steps as one, measured on the H200). A logged step is checked
      # finite before it is saved; save checks the parameters of every step it saves.
      if step % opt.log_every == 0 or step == opt.steps:
        report(step, metrics)
      if step % opt.ckpt_every == 0 or step == opt.steps:
        save(step)
  except (KeyboardInterrupt, cache.CacheError) as e:
    # Interrupted, or a damaged row was read: every finished step is saved before leaving.
    done = int(state["step"])
    if done > last_saved:
      save(done)
    logging.info("%s: %s; saved step %d", name,
                 "interrupted" if isinstance(e, KeyboardInterrupt) else "stopped", done)
    raise
  finally:
    signal.signal(signal.SIGTERM, previous_handler)
    loader.close()
    ckpt.close()
    if events is not None:
      events.close()
  return nnx.merge(graphdef, state["params"])
