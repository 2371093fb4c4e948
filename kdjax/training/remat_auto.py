"""remat "auto": the fastest rematerialisation policy whose training step fits the memory budget.

The budget (opt.memory_gib; 0: what JAX may allocate on the device, its bytes_limit) is compared
with XLA's own plan of the micro-batch program: the train state and gradient sum (resident
between steps, measured from the arrays) plus the program's temporaries and its batch. On the
H200 that sum is the measured peak within a fraction of a GiB (BENCHMARKS.md,
"Rematerialisation"). Policies are tried fastest first (kdjax/models/remat.py AUTO_ORDER), each
costing one compilation of the micro-batch program (a minute or more at 128K), until one fits
within MARGIN of the budget; a policy whose kept values alone (remat.saved_bytes_per_token, a
lower bound) would exceed it is skipped without one. None fitting is a user error that names the
budget. The margin comes from a measured failure: at 32K a plan at 92% of the budget ran out of
memory, one block of its temporaries finding no room in one piece (BENCHMARKS.md).

Within the margin is not enough on its own: XLA allocates a program's temporaries as one block,
and JAX's GPU pool (BFC) never joins free memory of two of its regions, so a plan far inside the
budget can still find no piece that large (32K with AdamW's moments in host memory: 106.9 GiB
planned of 127.9, its 88.9 GiB block refused; BENCHMARKS.md, "the steps after the attention's
backward changes, profiled per step", 2026-12-05). So on a GPU a
plan that fits is also tried: its block of temporaries is allocated once and freed (it stays in
the pool for the step to reuse); a refusal moves on to the next policy.
"""
import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kdjax.errors import UserError
from kdjax.models import llama, remat

GIB = 2**30
MARGIN = 0.9  # a plan fits when it needs at most this share of the budget


def with_policy(graphdef, model_cfg: llama.ModelConfig, policy: str):
  """graphdef of the same model with cfg.remat = policy (the policy is static metadata)."""
  cfg = dataclasses.replace(model_cfg, remat=policy)
  new, _ = nnx.split(nnx.eval_shape(lambda: llama.Transformer(cfg, rngs=nnx.Rngs(0))))
  return new, cfg


def bytes_per_device(tree) -> int:
  """Bytes of the arrays of tree on the most loaded local device (sharded arrays: their shard;
  arrays in host memory, opt.state_memory "host", not counted)."""
  per = {}
  for x in jax.tree.leaves(tree):
    if isinstance(x, jax.Array) and getattr(x.sharding, "memory_kind", None) == "pinned_host":
      continue
    if isinstance(x, jax.Array):
      for shard in x.addressable_shards:
        per[shard.device] = per.get(shard.device, 0) + shard.data.nbytes
    else:
      per[None] = per.get(None, 0) + np.asarray(x).nbytes
  return max(per.values(), default=0)


def budget_bytes(memory_gib: float) -> float | None:
  """opt.memory_gib in bytes; 0: the device's allocation limit (None where it has none: CPU)."""
  if memory_gib:
    return memory_gib * GIB
  device = jax.local_devices()[0]
  limit = (device.memory_stats() or {}).get("bytes_limit")
  if limit is None and device.platform != "cpu":
    raise UserError("remat 'auto' plans against the GPU's allocation limit, which JAX does not "
                    "report with mesh.allocator='platform': set opt.memory_gib (GiB it may plan "
                    "for) or student.remat to a policy (configs/256k.py: 'full').")
  return limit


def one_piece(nbytes: int) -> bool:
  """Whether each local GPU's pool gives nbytes in one piece now (allocated, then freed: the
  piece stays in JAX's pool). Devices without a pool (CPU) are not tried: True."""
  for device in jax.local_devices():
    if device.platform == "cpu":
      continue
    try:
      jax.block_until_ready(jnp.zeros((-(-nbytes // 4096), 4096), jnp.int8, device=device))
    except jax.errors.JaxRuntimeError as e:
      if "RESOURCE_EXHAUSTED" not in str(e):
        raise
      return False
  return True


def tokens_per_device(tokens_BxT) -> int:
  """Tokens of the micro-batch on its most loaded device."""
  if isinstance(tokens_BxT, jax.Array):
    return max(shard.data.size for shard in tokens_BxT.addressable_shards)
  return int(np.size(tokens_BxT))


def choose(graphdef, model_cfg: llama.ModelConfig, resident, tokens: int, lower,
           memory_gib: float):
  """(graphdef, cfg) with the fastest policy of AUTO_ORDER that fits (cfg.remat is "auto":
  training.train.resolve_remat calls this only then). resident: the arrays on the device while a
  micro-batch runs (train state, gradient sum, the micro-batch); tokens: the micro-batch's
  tokens per device; lower(graphdef) -> that program lowered with graphdef."""
  budget = budget_bytes(memory_gib)
  fixed = bytes_per_device(resident)
  tried = []
  for policy in remat.AUTO_ORDER:
    new, cfg = with_policy(graphdef, model_cfg, policy)
    if budget is None:  # no device limit to plan against (CPU): the fastest
      return new, cfg
    kept = remat.saved_bytes_per_token(cfg, policy) * tokens * cfg.n_layers
    if fixed + kept > MARGIN * budget:  # certain not to fit: no compilation
      tried.append(f"{policy} >{(fixed + kept) / GIB:.3g}")
      continue
    plan = lower(new).compile().memory_analysis()
    need = fixed + plan.temp_size_in_bytes
    fits = need <= MARGIN * budget
    if fits and not one_piece(plan.temp_size_in_bytes):
      tried.append(f"{policy} {need / GIB:.3g} (no {plan.temp_size_in_bytes / GIB:.3g} GiB piece)")
      continue
    tried.append(f"{policy} {need / GIB:.3g}")
    if fits:
      logging.info("remat auto: %s (%.1f GiB planned of %.1f; tried %s)", policy, need / GIB,
                   budget / GIB, ", ".join(tried))
      return new, cfg
  raise UserError(f"no remat policy fits the training step in {MARGIN:.0%} of {budget / GIB:.3g} "
                   f"GiB (planned "
                  f"GiB: {', '.join(tried)}); lower opt.batch_size or data.seq_len, or set "
                  "opt.state_memory='host'.")
