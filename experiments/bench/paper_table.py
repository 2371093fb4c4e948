"""The paper's four distillation methods at 8K, side by side on one GPU (its end-to-end table).

    python -m experiments.bench.paper_table                  # all four, one process each
    python -m experiments.bench.paper_table --methods ours   # one

The paper's setting: 8K context, a ~3.2B Llama student (configs/8k.py: float32 parameters and
AdamW, bf16 compute), global batch 32 x 8K as 32 micro-batches of one row, an 8B-class teacher.
RANDOM weights of those shapes; synthetic packed rows (4 documents each) and a synthetic compact
top-100 cache, as experiments/bench/e2e_bench.py writes them. The methods differ only in the loss:

  online     the teacher (Llama-3.1-8B shapes, bf16) runs in the step; full-vocabulary KL between
             its logits and the student's, both materialised [T, V]
  dense      offline: the teacher's [T, V] grid rebuilt from the cache's top-k (zero elsewhere),
             the student's [T, V] logits materialised, KL over the grid
  chunked    offline, forward-chunked: the same sparse KL over positions in chunks of 1024, each
             chunk's logits recomputed in the backward pass (jax.checkpoint), gradients by autodiff
  ours       offline, kdjax's fused chunked loss (kdjax.loss.topk_kl_loss, impl "auto"), as
             `train.grad_step` runs it

Each runs in a process of its own (peak memory cannot be reset). One iteration = 32 micro-steps
(gradients added into one bf16 sum, `opt.accum_dtype` of configs/8k.py) + one AdamW update; both
are timed apart (medians after the compiling call) and summed. TFLOP/s counts model FLOPs as
e2e_bench.py does (6 N + attention within documents, per student token), plus for `online` the
teacher's forward (2 N_t + its attention). Results: experiments/results/paper_table.jsonl.
"""
import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments.bench import e2e_bench, synthetic_rows
from kdjax import build
from kdjax.loss import LossSettings
from kdjax.models import documents, llama
from kdjax.training import train

METHODS = ("online", "dense", "chunked", "ours")
RESULTS = os.path.join(ROOT, "experiments", "results", "paper_table.jsonl")
PAPER = {"online": (102.8, 25.9, 237), "dense": (78.3, 18.5, 331), "chunked": (61.8, 18.4, 335),
         "ours": (58.3, 20.2, 304)}  # the paper's (GB, s / iteration, TFLOP/s); "ours" = its fused
CHUNK = 1024


def masked_mean(kl_BxT, mask_BxT):
  mask = mask_BxT.astype(jnp.float32)
  return jnp.sum(kl_BxT * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def dense_kl(hidden_BxTxD, lm_head_DxV, ids_BxTxK, logp_BxTxK, mask_BxT):
  logq_BxTxV = jax.nn.log_softmax(jnp.einsum("btd,dv->btv", hidden_BxTxD, lm_head_DxV,
                                             preferred_element_type=jnp.float32), axis=-1)
  b, t, _ = ids_BxTxK.shape
  rows_Bx1x1, cols_1xTx1 = jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None]
  p_BxTxV = jnp.zeros_like(logq_BxTxV).at[rows_Bx1x1, cols_1xTx1, ids_BxTxK].set(
      jnp.exp(logp_BxTxK))
  logp_BxTxV = jnp.log(jnp.where(p_BxTxV > 0, p_BxTxV, 1.0))
  return masked_mean(jnp.sum(p_BxTxV * (logp_BxTxV - logq_BxTxV), axis=-1), mask_BxT)


def chunked_kl(hidden_BxTxD, lm_head_DxV, ids_BxTxK, logp_BxTxK, mask_BxT):
  b, t, d = hidden_BxTxD.shape
  chunk = CHUNK if t % CHUNK == 0 else t
  n = t // chunk

  @jax.checkpoint
  def one(args):
    h_CxD, ids_CxK, logp_CxK = args
    z_CxV = jnp.dot(h_CxD, lm_head_DxV, preferred_element_type=jnp.float32)
    logq_CxK = jnp.take_along_axis(z_CxV, ids_CxK, axis=-1) - jax.nn.logsumexp(z_CxV, -1)[:, None]
    return jnp.sum(jnp.exp(logp_CxK) * (logp_CxK - logq_CxK), axis=-1)

  chunks = lambda x: x.reshape((b * n, chunk) + x.shape[2:])
  kl_NxC = jax.lax.map(one, (chunks(hidden_BxTxD), chunks(ids_BxTxK), chunks(logp_BxTxK)))
  return masked_mean(kl_NxC.reshape(b, t), mask_BxT)


def online_kl(hidden_BxTxD, lm_head_DxV, teacher_hidden_BxTxD, teacher_head_DxV, mask_BxT):
  logq = jax.nn.log_softmax(jnp.einsum("btd,dv->btv", hidden_BxTxD, lm_head_DxV,
                                       preferred_element_type=jnp.float32), axis=-1)
  logp = jax.nn.log_softmax(jnp.einsum("btd,dv->btv", teacher_hidden_BxTxD, teacher_head_DxV,
                                       preferred_element_type=jnp.float32), axis=-1)
  return masked_mean(jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1), mask_BxT)


@functools.partial(jax.jit, static_argnames=("graphdef", "teacher_graphdef", "method",
                                             "max_documents"), donate_argnames="grads_sum")
def baseline_grad_step(trained_params, grads_sum, batch, teacher_params, *, graphdef,
                       teacher_graphdef, method, max_documents):
  """grad_step of the three baselines: the student's gradients (of train.trained's dict) added
  into the donated sum."""
  inputs = (batch["tokens"], batch["positions"], batch["segment_ids"], max_documents)
  if method == "online":
    teacher = nnx.merge(teacher_graphdef, teacher_params)
    teacher_hidden = jax.lax.stop_gradient(teacher(*inputs))
    teacher_head = jax.lax.stop_gradient(teacher.lm_head_DxV())

  def loss(trained_params):
    model = nnx.merge(graphdef, trained_params["params"])
    hidden = model(*inputs)
    head = model.lm_head_DxV().astype(hidden.dtype)
    if method == "online":
      return online_kl(hidden, head, teacher_hidden, teacher_head, batch["loss_mask"])
    fn = dense_kl if method == "dense" else chunked_kl
    return fn(hidden, head, batch["topk_ids"], batch["topk_logprobs"], batch["loss_mask"])

  value, grads = jax.value_and_grad(loss)(trained_params)
  grads_sum = jax.tree.map(lambda s, g: (s.astype(jnp.float32) + g).astype(s.dtype),
                           grads_sum, grads)
  return grads_sum, {"loss": value}


def run(method: str, args) -> dict:
  # The paper's objective, so that every method computes the same loss (configs default to tail).
  # The paper's 32 micro-batches of one row; one rematerialisation for every method's student
  # (--remat), so the methods differ in the loss alone.
  c = e2e_bench.load_config(args.config, ["loss.objective=sparse", f"student.remat={args.remat}",
                                          "opt.batch_size=1", "opt.accum_steps=32"])
  seq_len, accum = c.data.seq_len, c.opt.accum_steps
  student_cfg = build.model_config(c.student, 128256)
  rng = np.random.default_rng(0)
  directory = os.path.join(args.dir, "paper_table")
  shutil.rmtree(directory, ignore_errors=True)
  store = synthetic_rows.synthetic_cache(directory, rng, rows=4, seq_len=seq_len, docs=4,
                                    vocab=student_cfg.vocab_size, k=c.cache.k)
  batches = [train.to_step_batch(store.read(np.array([r])), 1, hard_labels=False)
             for r in range(4)]
  batches = [{k: v[0] for k, v in b.items()} for b in batches]
  bound = max(documents.documents_bound(b["segment_ids"]) for b in batches)

  tx, _ = train.make_optimizer(c.opt)
  loss = LossSettings.from_config(c.loss, hard_labels=False)
  graphdef, params = nnx.split(llama.Transformer(student_cfg, rngs=nnx.Rngs(0)))
  state, grads_sum = train.init_state(params, tx, c.opt)
  teacher_graphdef, teacher_params, teacher_flops = None, None, 0.0
  if method == "online":
    teacher_cfg = build.model_config(c.teacher, 128256)
    teacher_graphdef, teacher_params = nnx.split(llama.Transformer(teacher_cfg,
                                                                   rngs=nnx.Rngs(1)))
    teacher_flops = train_flops(teacher_cfg, batches) / 3.0  # forward only: a third

  def micro(b):
    nonlocal grads_sum
    if method == "ours":
      grads_sum, metrics = train.grad_step(train.trained(state), grads_sum, b, graphdef=graphdef,
                                           loss=loss, max_documents=bound)
    else:
      grads_sum, metrics = baseline_grad_step(
          train.trained(state), grads_sum, b, teacher_params, graphdef=graphdef,
          teacher_graphdef=teacher_graphdef, method=method, max_documents=bound)
    return metrics

  if args.plan:  # XLA's memory plan of one micro-step (GiB), no run
    if method == "ours":
      lowered = train.grad_step.lower(train.trained(state), grads_sum, batches[0],
                                      graphdef=graphdef, loss=loss, max_documents=bound)
    else:
      lowered = baseline_grad_step.lower(
          train.trained(state), grads_sum, batches[0], teacher_params, graphdef=graphdef,
          teacher_graphdef=teacher_graphdef, method=method, max_documents=bound)
    m = lowered.compile().memory_analysis()
    return {"method": method, "kind": "plan", "micro_step_temp_gib": m.temp_size_in_bytes / 2**30,
            "micro_step_argument_gib": m.argument_size_in_bytes / 2**30}
  micro_s, metrics_A = [], []
  for i in range(args.micro_steps + 1):  # the first compiles
    t0 = time.perf_counter()
    metrics_A.append(jax.block_until_ready(micro(batches[i % len(batches)])))
    micro_s.append(time.perf_counter() - t0)
    print(f"{method} micro-step {i}: {micro_s[-1]:.3f} s", flush=True)
  apply_s = []
  for _ in range(2):  # the first compiles
    t0 = time.perf_counter()
    state, metrics, grads_sum = train.apply_step(state, grads_sum, metrics_A[:accum], tx=tx,
                                                 state_memory=c.opt.state_memory)
    jax.block_until_ready((state, grads_sum))
    apply_s.append(time.perf_counter() - t0)
  iteration_s = accum * float(np.median(micro_s[1:])) + apply_s[-1]
  tokens = accum * seq_len
  flops = (train_flops(student_cfg, batches) + teacher_flops) * tokens
  return {"method": method, "seq_len": seq_len, "accum_steps": accum, "remat": args.remat,
          "micro_step_s": float(np.median(micro_s[1:])), "apply_s": apply_s[-1],
          "iteration_s": iteration_s, "tokens_per_s": tokens / iteration_s,
          "model_tflops": flops / iteration_s / 1e12, "peak_gib": e2e_bench.peak_gib(),
          "loss": float(metrics_A[-1]["loss"]), "paper_gb_s_tflops": PAPER[method]}


def train_flops(cfg, batches) -> float:
  """Model training FLOPs per token, e2e_bench's convention (attention within documents)."""
  context = np.mean([documents.mean_context(b["segment_ids"]) for b in batches])
  return llama.flops_per_token(cfg, float(context))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--methods", nargs="*", default=list(METHODS), choices=METHODS)
  parser.add_argument("--one", choices=METHODS, help=argparse.SUPPRESS)  # a child process
  parser.add_argument("--config", default="configs/8k.py", help="a smaller one for a smoke run")
  parser.add_argument("--micro-steps", type=int, default=4, help="timed micro-steps per method")
  parser.add_argument("--remat", default="none", help="student.remat of every method (none: what "
                      "configs/8k.py's auto takes at 8K; full: the runs before 2026-12-04)")
  parser.add_argument("--plan", action="store_true",
                      help="XLA's memory plan of each method's micro-step only (no run)")
  parser.add_argument("--out", default=RESULTS)
  parser.add_argument("--dir", default="/tmp/kdjax_paper_table")
  args = parser.parse_args()
  if args.one:
    result = run(args.one, args)
    result.update(commit=e2e_bench.commit(), date=e2e_bench.today(),
                  device=str(jax.devices()[0].device_kind))
    print(json.dumps(result), flush=True)
    with open(args.out, "a") as f:
      f.write(json.dumps(result) + "\n")
    return
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  for method in args.methods:
    cmd = [sys.executable, "-m", __spec__.name, "--one", method, "--out", args.out,
           "--dir", args.dir, "--micro-steps", str(args.micro_steps), "--config", args.config,
           "--remat", args.remat]
    cmd += ["--plan"] if args.plan else []
    if subprocess.run(cmd).returncode:
      with open(args.out, "a") as f:
        f.write(json.dumps({"method": method, "error": "failed (see its log)",
                            "commit": e2e_bench.commit(), "date": e2e_bench.today()}) + "\n")


if __name__ == "__main__":
  main()
