"""Dense reference: the loss written plainly over materialised [N, V] logits, autodiff gradients.

Only for tests and small shapes: it holds N * V float32 logits (and as much again for their
gradient). Every fast impl must agree with it. Shape letters as in kdjax.loss.
"""
import jax
import jax.numpy as jnp

from kdjax.loss import objectives


def topk_kl_loss(hidden_NxD, lm_head_DxV, ids_NxK, logp_NxK, mask_N, labels_N,
                 spec: objectives.LossSpec) -> objectives.LossTerms:
  """The loss with means over the masked positions and every position's terms."""
  tau = spec.temperature
  logits_NxV = jnp.einsum("nd,dv->nv", hidden_NxD, lm_head_DxV,
                          preferred_element_type=jnp.float32)
  logq_NxV = jax.nn.log_softmax(logits_NxV / tau, axis=-1)
  logq_NxK = jnp.take_along_axis(logq_NxV, ids_NxK, axis=-1)
  logp_NxK = jax.lax.stop_gradient(objectives.tempered_teacher(logp_NxK, tau))
  p_NxK = jnp.exp(logp_NxK)
  plogp_NxK = jnp.where(p_NxK > 0, p_NxK * logp_NxK, 0.0)
  mass_N = jnp.sum(p_NxK, axis=-1)
  if spec.objective == "sparse":
    kl_N = jnp.sum(plogp_NxK - jnp.where(p_NxK > 0, p_NxK * logq_NxK, 0.0), axis=-1)
  elif spec.objective == "tail":
    kl_N = jnp.sum(plogp_NxK - jnp.where(p_NxK > 0, p_NxK * logq_NxK, 0.0), axis=-1)
    tail_p_N = jnp.maximum(1.0 - mass_N, 0.0)
    tail_q_N = jnp.maximum(1.0 - jnp.sum(jnp.exp(logq_NxK), axis=-1), objectives.TAIL_FLOOR)
    safe_tail_p_N = jnp.where(tail_p_N > 0, tail_p_N, 1.0)
    kl_N = kl_N + jnp.where(tail_p_N > 0, tail_p_N * (jnp.log(safe_tail_p_N) - jnp.log(tail_q_N)),
                            0.0)
  elif spec.objective == "renorm":
    pn_NxK = p_NxK / jnp.where(mass_N > 0, mass_N, 1.0)[:, None]
    logpn_NxK = jnp.log(jnp.where(pn_NxK > 0, pn_NxK, 1.0))
    logqn_NxK = jax.nn.log_softmax(logq_NxK, axis=-1)
    kl_N = jnp.sum(jnp.where(pn_NxK > 0, pn_NxK * (logpn_NxK - logqn_NxK), 0.0), axis=-1)
  else:
    raise ValueError(f"unknown objective {spec.objective!r}")
  kl_N = tau * tau * kl_N
  if spec.has_labels:
    logq1_NxV = jax.nn.log_softmax(logits_NxV, axis=-1)
    ce_N = -jnp.take_along_axis(logq1_NxV, labels_N[:, None], axis=-1)[:, 0]
  else:
    ce_N = jnp.zeros_like(kl_N)
  count = jnp.maximum(jnp.sum(mask_N), 1).astype(jnp.float32)
  kl = jnp.sum(jnp.where(mask_N, kl_N, 0.0)) / count
  ce = jnp.sum(jnp.where(mask_N, ce_N, 0.0)) / count
  entropy_N = -jnp.sum(jnp.exp(logq_NxV) * logq_NxV, axis=-1)
  teacher_top_N = jnp.take_along_axis(ids_NxK, jnp.argmax(logp_NxK, axis=-1)[:, None], -1)[:, 0]
  top1_N = jnp.argmax(logits_NxV, axis=-1) == teacher_top_N
  positions = jax.lax.stop_gradient(objectives.Positions(kl_N, ce_N, entropy_N, top1_N))
  return objectives.LossTerms(kl + spec.ce_weight * ce, jax.lax.stop_gradient(kl),
                              jax.lax.stop_gradient(ce), positions)
