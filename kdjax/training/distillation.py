"""The training loss of one micro-batch on the student's lm_head, by objective, and its metrics.

The targets come in the batch, whoever produced them: a cache's top-k ids and log-probs (the
offline objectives, kdjax.loss.topk_kl_loss), or with objective "online" the teacher's final
hidden states and lm_head computed beside the step (kdjax.teacher.OnlineTargets; the
full-vocabulary KL, kdjax.loss.full_kl). With hidden_weight > 0 the hidden-state term
(kdjax.loss.hidden) against the cache's hidden states is added.

Shapes: B sequences, T positions, D student width, V vocabulary, H width of the cached hidden
states.
"""
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from kdjax import parallel
from kdjax.loss import full_kl, hidden, topk_kl

# What each objective reads from the batch besides loss_mask and labels.
ONLINE_TARGETS = ("teacher_hidden", "teacher_head")
CACHE_TARGETS = ("topk_ids", "topk_logprobs")


def loss(hidden_BxTxD, lm_head_DxV, batch: dict, settings, hidden_proj=None,
         mesh: Mesh | None = None):
  """(value, metrics) of the micro-batch. settings: loss.LossSettings. hidden_proj: the learned
  [D, H] projection of the hidden-state term, or None. mesh: the run's device mesh, or None for
  one device (the KL then runs per device on its rows, parallel.sharded_loss)."""
  names = ONLINE_TARGETS if settings.objective == "online" else CACHE_TARGETS
  rows = {k: batch[k] for k in names + ("loss_mask", "labels")}
  value, metrics = parallel.sharded_loss(functools.partial(_kl, settings=settings), mesh,
                                         hidden_BxTxD, lm_head_DxV, rows)
  if settings.hidden_weight:
    nmse = hidden.hidden_nmse(hidden_BxTxD, batch["hidden"], batch["loss_mask"], hidden_proj)
    value = value + settings.hidden_weight * nmse
    metrics["hidden_nmse"] = jax.lax.stop_gradient(nmse)
  return value, metrics


def _masked_means(terms: dict, mask_BxT) -> dict:
  mask_BxT = mask_BxT.astype(jnp.float32)
  count = jnp.maximum(jnp.sum(mask_BxT), 1.0)
  return {k: jnp.sum(mask_BxT * v) / count for k, v in terms.items()}


def _kl(hidden_BxTxD, lm_head_DxV, batch, settings, vocab_axis=None):
  """The KL objective (plus CE mix) and its metrics. vocab_axis: see topk_kl.topk_kl_loss
  (parallel.sharded_loss passes it)."""
  if settings.objective == "online":
    value, terms = full_kl.full_kl_loss(
        hidden_BxTxD, lm_head_DxV, batch["teacher_hidden"], batch["teacher_head"],
        batch["loss_mask"],
        temperature=settings.temperature, labels=batch["labels"], ce_weight=settings.ce_weight,
        chunk_size=settings.chunk_size or None, per_position=True,
        divergence=settings.divergence, skew=settings.skew)
    return value, _masked_means({k: terms[k] for k in ("kl", "ce", "top1", "entropy")},
                                batch["loss_mask"])
  per_position = settings.position_metrics and topk_kl.has_position_terms(settings.impl)
  value, aux = topk_kl.topk_kl_loss(
      hidden_BxTxD, lm_head_DxV, batch["topk_ids"], batch["topk_logprobs"],
      batch["loss_mask"], objective=settings.objective, temperature=settings.temperature,
      labels=batch["labels"], ce_weight=settings.ce_weight, impl=settings.impl,
      chunk_size=settings.chunk_size or None, dw_dtype=settings.dw_dtype, return_aux=True,
      per_position=per_position, vocab_axis=vocab_axis)
  metrics = {"kl": aux["kl"], "ce": aux["ce"]}
  if per_position:  # masked means, like kl and ce; from the loss's own pass
    metrics.update(_masked_means({k: aux["positions"][k] for k in ("top1", "entropy")},
                                 batch["loss_mask"]))
  return value, metrics
