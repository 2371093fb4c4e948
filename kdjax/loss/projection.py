"""A chunk's projection: its logits, one exp pass over them, and what the loss reads from it.

project(h_c, W, ids, labels, spec, dtype, stats) for a chunk of C positions computes the logits
z = h_c W ([C, V] float32), gathers z at the top-k ids and labels (exact), and runs ONE exp pass
over z (kdjax.kernels.logit_passes) that returns the row sums of exp(z / tau - shift) and, when
dtype is given, writes E = exp(z / tau - shift) rounded to it: a `Projection`. The chunked driver
(chunked.py) turns a Projection into the loss terms and dL/dz; impl "pallas" (fused.py) meets the
same contract with one kernel in which z never exists.

The shift is the largest student logit among the chunk's top-k ids and label, known before the
pass (it is gathered from z). An exp pass must shift a row by its own maximum instead when the
row's maximum exceeds the given shift by more than logit_passes.SHIFT_LIMIT (in units of
z / tau), which keeps E <= e^SHIFT_LIMIT and the sums within [1, V e^SHIFT_LIMIT].

Of a vocabulary-sharded lm_head each device projects its own columns (ids made local_ids) and
combine_shards turns the statistics into the whole vocabulary's.

Shape letters: C chunk of positions, D model width, V vocabulary, K cached entries.
"""
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from kdjax.loss import objectives


def softmax_scales(spec: objectives.LossSpec) -> tuple:
  """Multipliers of z whose softmax normalisers the loss needs: 1 / tau, and 1 for CE at
  tau != 1."""
  return (1.0 / spec.temperature, 1.0) if spec.two_softmax else (1.0 / spec.temperature,)


def normalisers(sums, shift_C, spec):
  """(logsumexp(z / tau), logsumexp(z)) from an exp pass's sums and shift."""
  lse_s_C = shift_C / spec.temperature + jnp.log(sums[0])
  lse_z_C = shift_C + jnp.log(sums[1]) if spec.two_softmax else lse_s_C
  return lse_s_C, lse_z_C


def gather_rows(logits_CxV, ids_CxK, labels_C):
  """z at the ids and labels; an id of -1 (another shard's, see local_ids) reads column 0."""
  zk_CxK = jnp.take_along_axis(logits_CxV, jnp.maximum(ids_CxK, 0), axis=-1)
  zl_C = jnp.take_along_axis(logits_CxV, jnp.maximum(labels_C, 0)[:, None], axis=-1)[:, 0]
  return zk_CxK, zl_C


def local_ids(ids, offset, width: int):
  """Vocabulary ids as columns of the shard [offset, offset + width), -1 where outside it."""
  local = ids - offset
  return jnp.where((local >= 0) & (local < width), local, -1)


class Stats(NamedTuple):
  """A projection's per-position statistics (with stats=True)."""
  top_C: jax.Array  # the row maximum of z
  xex_C: jax.Array  # sum_V exp(x) * x for x = (z - shift) / tau
  slack: float      # the most zk may lie from its exact value (0: exact)


class Projection(NamedTuple):
  """What a chunk's `project` returns."""
  logits_CxV: jax.Array | None  # float32 z, None where it is never materialised (fused.py)
  e_CxV: jax.Array | None       # E = exp((z - shift) / tau) in dtype, None if dtype is None
  sums: tuple                   # per softmax_scales, [C]: sum_V exp((z - shift) * scale)
  shift_C: jax.Array
  zk_CxK: jax.Array             # z at the top-k ids
  zl_C: jax.Array               # z at the labels
  stats: Stats | None


def combine_shards(axis, ids_CxK, labels_C, proj: Projection, spec) -> Projection:
  """A vocabulary-sharded chunk's statistics over the whole vocabulary (the paper's
  tensor-parallel loss): each shard's sums, taken against its own shift, rescaled to the largest
  shift of any shard and summed; the top-k and label logits from the shard that holds them (ids
  local, -1 elsewhere). Returns proj as a project over all shards would."""
  psum = lambda x: jax.lax.psum(x, axis)
  zk_CxK = psum(jnp.where(ids_CxK >= 0, proj.zk_CxK, 0.0))
  zl_C = psum(jnp.where(labels_C >= 0, proj.zl_C, 0.0))
  top_shift_C = jax.lax.pmax(proj.shift_C, axis)
  gaps = [(proj.shift_C - top_shift_C) * s for s in softmax_scales(spec)]  # <= 0
  sums = tuple(psum(s_C * jnp.exp(gap_C)) for s_C, gap_C in zip(proj.sums, gaps))
  stats = proj.stats
  if stats is not None:  # sum exp(x) x against the new shift: e^g (sum exp(x) x + g sum exp(x))
    stats = Stats(jax.lax.pmax(stats.top_C, axis),
                  psum(jnp.exp(gaps[0]) * (stats.xex_C + gaps[0] * proj.sums[0])), stats.slack)
  return proj._replace(sums=sums, shift_C=top_shift_C, zk_CxK=zk_CxK, zl_C=zl_C, stats=stats)


def logits_project(exp_pass: Callable) -> Callable:
  """A chunk's projection with its float32 logits materialised: XLA's matmul, the top-k and
  label logits gathered from it (exact), then one exp pass (logit_passes' contract) over it
  shifted by their maximum.

  project(h [C, D], W [D, V], ids [C, K], labels [C], spec, dtype, stats=False) -> Projection
  with E in dtype (None if dtype is None) and, with stats, the statistics for per-position terms.
  """

  def project(hidden_CxD, lm_head_DxV, ids_CxK, labels_C, spec, dtype, stats=False):
    logits_CxV = jnp.einsum("cd,dv->cv", hidden_CxD, lm_head_DxV,
                            preferred_element_type=jnp.float32)
    zk_CxK, zl_C = gather_rows(logits_CxV, ids_CxK, labels_C)
    hint_C = jnp.max(zk_CxK, axis=-1)
    if spec.has_labels:
      hint_C = jnp.maximum(hint_C, zl_C)
    out = exp_pass(logits_CxV, hint_C, softmax_scales(spec), dtype, stats)
    return Projection(logits_CxV, out.e_CxV, out.sums, out.shift_C, zk_CxK, zl_C,
                      Stats(out.top_C, out.xex_C, 0.0) if stats else None)

  return project
