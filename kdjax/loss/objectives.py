"""Per-position top-k KL objectives from a few logit statistics, shared by every chunked impl.

Once a chunk's logits z [C, V] are known, each objective needs only, per position: the
log-normaliser of the student (at temperature tau and at 1), the student logits at the K cached
ids and at the label. From those this module returns the loss terms and the coefficients of
dL/dz, which is always

    dL/dz = a * softmax(z / tau) + b * softmax(z) + (sparse entries at the top-k ids and label)

so a kernel needs one dense elementwise pass over [C, V] plus K + 1 scattered entries per row.
Also the types every impl shares: LossSpec (the loss's static description), LossTerms (what an
impl returns) and Positions (its per-position terms).

Shape letters: N positions (rows of a chunk), K cached entries, V vocabulary.
"""
import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kdjax import choices

OBJECTIVES = choices.OBJECTIVES

# 1 - Q (student mass outside the top-k) is computed as 1 - sum(q_topk) in float32, which is
# exact to ~K * 2**-24; below this floor it is clamped (and its gradient through Q dropped).
TAIL_FLOOR = 1e-6


@dataclasses.dataclass(frozen=True)
class LossSpec:
  """Static description of the loss: hashable, so it can be a jit / custom_vjp static arg."""
  objective: str
  temperature: float
  ce_weight: float
  has_labels: bool

  @property
  def two_softmax(self) -> bool:
    """Whether softmax(z) differs from softmax(z / tau) and is needed (CE at tau != 1)."""
    return self.has_labels and self.temperature != 1.0


class Positions(NamedTuple):
  """The per-position terms every impl but "paper" can hand out, each [N] (no gradient)."""
  kl: jax.Array       # the KL term (times tau^2)
  ce: jax.Array       # cross-entropy of the label at tau = 1
  entropy: jax.Array  # of the student softmax at tau, nats
  top1: jax.Array     # bool: the student's argmax is the teacher's most probable cached id


class LossTerms(NamedTuple):
  """What an impl returns over N flattened positions: loss = kl + ce_weight * ce, differentiable
  in hidden and lm_head, and the weighted means kl, ce (logged, their cotangents ignored)."""
  loss: jax.Array
  kl: jax.Array
  ce: jax.Array
  positions: Positions | None  # None unless per_position


def zero_positions(num_rows: int) -> Positions:
  """The per-position terms of num_rows positions, zeroed (top1 False)."""
  return Positions(*(jnp.zeros((num_rows,), bool if name == "top1" else jnp.float32)
                     for name in Positions._fields))


def tempered_teacher(logp_NxK: jax.Array, temperature: float) -> jax.Array:
  """log p_tau: the cached top-k sharpened/flattened by 1/tau over the top-k, mass M kept."""
  logp_NxK = logp_NxK.astype(jnp.float32)
  if temperature == 1.0:
    return logp_NxK
  log_mass_Nx1 = jax.nn.logsumexp(logp_NxK, axis=-1, keepdims=True)
  scaled_NxK = logp_NxK / temperature
  return log_mass_Nx1 + scaled_NxK - jax.nn.logsumexp(scaled_NxK, axis=-1, keepdims=True)


def _xlogx(x):
  return jnp.where(x > 0, x * jnp.log(jnp.where(x > 0, x, 1.0)), 0.0)


def row_terms(zk_NxK, zl_N, lse_s_N, lse_z_N, logp_NxK, spec: LossSpec):
  """Loss terms and dL/dz coefficients per position (unweighted).

  zk_NxK: student logits at the cached ids; zl_N: at the label (ignored without labels);
  lse_s_N = logsumexp(z / tau), lse_z_N = logsumexp(z) over the full vocabulary.
  Returns dict: kl [N] (times tau^2), ce [N], a [N], b [N], ck [N, K], d [N]; see module doc.
  """
  tau = spec.temperature
  logq_NxK = zk_NxK / tau - lse_s_N[:, None]
  q_NxK = jnp.exp(logq_NxK)
  logp_NxK = tempered_teacher(logp_NxK, tau)
  p_NxK = jnp.exp(logp_NxK)
  mass_N = jnp.sum(p_NxK, axis=-1)
  # Cross term with p = 0 entries (e.g. -inf log-probs) contributes nothing, not 0 * -inf.
  cross_N = jnp.sum(jnp.where(p_NxK > 0, p_NxK * logq_NxK, 0.0), axis=-1)
  if spec.objective == "sparse":
    kl_N = jnp.sum(_xlogx(p_NxK), axis=-1) - cross_N
    a_N, ck_NxK = mass_N, -p_NxK
  elif spec.objective == "tail":
    tail_p_N = jnp.maximum(1.0 - mass_N, 0.0)  # quantised caches can sum slightly above 1
    tail_q_N = 1.0 - jnp.sum(q_NxK, axis=-1)
    clamped_N = tail_q_N <= TAIL_FLOOR
    log_tail_q_N = jnp.log(jnp.where(clamped_N, TAIL_FLOOR, tail_q_N))
    kl_N = (jnp.sum(_xlogx(p_NxK), axis=-1) - cross_N
            + _xlogx(tail_p_N) - tail_p_N * log_tail_q_N)
    r_N = jnp.where(clamped_N, 0.0, tail_p_N / jnp.where(clamped_N, 1.0, tail_q_N))
    a_N = mass_N - r_N * (1.0 - tail_q_N)
    ck_NxK = -p_NxK + r_N[:, None] * q_NxK
  elif spec.objective == "renorm":
    safe_mass_N = jnp.where(mass_N > 0, mass_N, 1.0)
    pn_NxK = p_NxK / safe_mass_N[:, None]
    logqn_NxK = logq_NxK - jax.nn.logsumexp(logq_NxK, axis=-1, keepdims=True)
    kl_N = (jnp.sum(_xlogx(pn_NxK), axis=-1)
            - jnp.sum(jnp.where(pn_NxK > 0, pn_NxK * logqn_NxK, 0.0), axis=-1))
    a_N = jnp.zeros_like(mass_N)
    ck_NxK = jnp.exp(logqn_NxK) - pn_NxK
  else:
    raise ValueError(f"unknown objective {spec.objective!r}; expected one of {OBJECTIVES}")
  # L_tau = tau^2 * KL(z / tau)  =>  dL/dz = tau * dKL/d(z / tau).
  kl_N = tau * tau * kl_N
  a_N, ck_NxK = tau * a_N, tau * ck_NxK
  if spec.has_labels:
    ce_N = lse_z_N - zl_N
    b_N = jnp.full_like(a_N, spec.ce_weight)
    d_N = -b_N
  else:
    ce_N = b_N = d_N = jnp.zeros_like(a_N)
  return dict(kl=kl_N, ce=ce_N, a=a_N, b=b_N, ck=ck_NxK, d=d_N)


def sparse_entries(ids_NxK, labels_N, zk_NxK, zl_N, lse_s_N, lse_z_N, terms, w_N, spec):
  """Exact float32 dL/dz values at the top-k ids (and label) to scatter-set over the dense part.

  Setting (not adding) full values keeps one rounding to the matmul dtype. If the label is one
  of the top-k ids both entries carry the same value, so the order of the writes is irrelevant.
  Top-k ids within a row are assumed distinct (they are, for a top-k). Returns (ids, values) of
  shape [N, K] or [N, K + 1] with labels.
  """
  tau = spec.temperature
  a_N, b_N = terms["a"] * w_N, terms["b"] * w_N

  def dense_at(z):
    out = a_N[..., None] * jnp.exp(z / tau - lse_s_N[..., None])
    if spec.has_labels and spec.ce_weight != 0.0:
      out = out + b_N[..., None] * jnp.exp(z - lse_z_N[..., None])
    return out

  vk_NxK = dense_at(zk_NxK) + terms["ck"] * w_N[:, None]
  if not spec.has_labels:
    return ids_NxK, vk_NxK
  d_N = terms["d"] * w_N
  hit_NxK = ids_NxK == labels_N[:, None]
  vk_NxK = vk_NxK + jnp.where(hit_NxK, d_N[:, None], 0.0)
  vl_N = (dense_at(zl_N[:, None])[:, 0] + d_N
          + jnp.sum(jnp.where(hit_NxK, terms["ck"] * w_N[:, None], 0.0), axis=-1))
  return (jnp.concatenate([ids_NxK, labels_N[:, None]], axis=1),
          jnp.concatenate([vk_NxK, vl_N[:, None]], axis=1))
