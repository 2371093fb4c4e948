"""What each transformer block keeps for its backward pass: the rematerialisation policies.

A block's backward pass needs its forward's activations. Keeping all of them is fastest and
takes the most memory; recomputing the block from its input takes the least and runs the forward
twice. Between the two, a policy keeps some (jax.checkpoint_policies):

  "none"     keep everything (no jax.checkpoint).
  "names"    keep the block's expensive values, tagged in llama.Block with checkpoint_name
             (SAVED: the attention's query/key/value after RoPE, its output and log-normalisers,
             the MLP's gate and up projections); recompute the cheap ones (norms, RoPE, SiLU,
             residual adds).
  "dots"     keep the output of every matmul without batch dimensions (the projections) and
             recompute the rest, attention included.
  "dots_attention"  as "dots", and keep the attention's output and log-normalisers, so the
             backward does not rerun the attention's forward.
  "attention"  keep the block's input and the attention's output and log-normalisers; recompute
             the rest (the projections, the MLP), not the attention: between "names" and "full"
             in memory (per token d + H E values against "names"'s d + 2 H E + 2 G E + 2 F), and
             the attention's forward is the costliest part of a block at long context (a third
             of a 128K step's FLOPs, BENCHMARKS.md).
  "offload"  as "names", but the kept values wait in pinned host memory, not on the GPU: the
             copies overlap the compute when the link keeps up.
  "full"     keep only the block's input; recompute the whole block (activation memory ~ one
             block's working set, the smallest).

The attention's output and log-normalisers are one array each per layer, whatever the number of
cuDNN calls a row takes (kdjax.models.attention merges them and its backward reads the merged
ones). Measured and dropped (BENCHMARKS.md, "Long rows"): the block's input offloaded to pinned
host memory (a checkpoint_name on it, jax's Offloadable), and each cuDNN call's own output kept
beside the input alone (by its forward primitive; at 128K, 8 calls a layer, each output a whole
row's): XLA planned both at twice "full"'s temporaries or more. "attention" keeps the merged
output instead, one a layer.

Every policy computes the same loss and gradients (tests/test_models.py); which one is fastest
and what each costs at the paper's shapes is measured in BENCHMARKS.md ("Rematerialisation").
"auto" is resolved before training by training.train.resolve_remat (training/remat_auto.py): the
fastest of AUTO_ORDER whose planned step fits the memory budget (opt.memory_gib). Left
unresolved (forward passes: eval, the cache; loops of their own) it runs as "full", which costs
nothing without a backward pass and the least memory with one.
"""
import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from kdjax import choices

POLICIES = choices.REMAT_POLICIES
CHOICES = choices.REMAT_CHOICES
# Fastest first, as measured on the H200 (BENCHMARKS.md, "Rematerialisation"); "auto" takes the
# first that fits. "offload" is left out: slower than "full" there, and larger.
AUTO_ORDER = ("none", "dots_attention", "dots", "names", "attention", "full")
SAVED = ("query", "key", "value", "attention", "attention_lse", "mlp_gate", "mlp_up")
ATTENTION = ("attention", "attention_lse")  # what the attention's backward reads besides q, k, v


def name(value_BxTx_: jax.Array, tag: str) -> jax.Array:
  """Tags a block's activation for the "names" and "offload" policies (one of SAVED)."""
  assert tag in SAVED, tag
  return checkpoint_name(value_BxTx_, tag)


def normalize(remat) -> str:
  """A policy name; True and False (the switch's old values) read as "full" and "none"."""
  if isinstance(remat, bool):
    return "full" if remat else "none"
  return remat


def wrap(fn, remat: str):
  """fn (a block's call: module first, then arrays) under the policy; "none" returns fn."""
  if remat == "none":
    return fn
  if remat == "auto":  # not resolved (a forward pass, or a loop of its own): the smallest
    remat = "full"
  policies = jax.checkpoint_policies
  policy = {
      "full": policies.nothing_saveable,
      "names": policies.save_only_these_names(*SAVED),
      "dots": policies.dots_with_no_batch_dims_saveable,
      "dots_attention": policies.save_from_both_policies(
          policies.dots_with_no_batch_dims_saveable, policies.save_only_these_names(*ATTENTION)),
      "attention": policies.save_only_these_names(*ATTENTION),
      "offload": policies.save_and_offload_only_these_names(
          names_which_can_be_saved=[], names_which_can_be_offloaded=list(SAVED),
          offload_src="device", offload_dst="pinned_host"),
  }[remat]
  return nnx.remat(fn, policy=policy)


def saved_bytes_per_token(cfg, policy: str) -> int:
  """A lower bound on the bytes one block keeps on the GPU per token for its backward pass under
  policy, one of AUTO_ORDER (cfg: llama.ModelConfig): the values the policy keeps, in the compute
  dtype, the attention's log-normalisers in float32 (the block's internal temporaries come on
  top). remat "auto" skips a policy without planning it when this bound times tokens and layers
  already exceeds the budget."""
  d, q, kv = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
  f = cfg.d_ff * max(cfg.experts_per_token, 1)
  lse = 4 * cfg.n_heads
  values = {"full": d,
            "attention": d + q,  # input, attention
            "names": d + q + 2 * kv + q + 2 * f,  # input, q, k, v, attention, gate, up
            # input and every projection's output but the MLP's down: its backward reads none of
            # it (XLA's H200 plans keep it not: dots_attention 218.6 GiB at 128K where counting it
            # gave 231.3, BENCHMARKS.md)
            "dots": d + q + 2 * kv + d + 2 * f,
            "dots_attention": d + q + 2 * kv + d + 2 * f + q,  # and the attention's output
            "none": d + q + 2 * kv + q + 3 * f}  # input, q, k, v, attention, gate, up, SiLU
  return values[policy] * jnp.dtype(cfg.dtype).itemsize + (0 if policy in ("full", "dots") else lse)
