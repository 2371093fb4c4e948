"""Full-vocabulary KL(teacher || student), chunked over positions: the online reference.

The cached objectives (kdjax.loss.topk_kl) see only the teacher's top K entries per position. This
is the quantity they approximate, computed with the teacher's logits at hand (the teacher in the
step, the paper's "online" method, or held-out evaluation against a teacher run online):

    full_kl = tau^2 * sum_V p_tau (log p_tau - log q_tau),   p = softmax(z_t), q = softmax(z_s)

per position, averaged over the masked ones. The student may instead be trained on another
divergence of the same two distributions (`divergence`; the metric "kl" stays the one above):

    reverse       KL(q || p)
    skew_forward  KL(p || a p + (1 - a) q)    DistiLLM's skew KL (Ko et al. 2024), a = skew
    skew_reverse  KL(q || a q + (1 - a) p)    its skew reverse KL

each times tau^2, at temperature tau; the student's gradient flows through q wherever it appears
(the mixtures included). Per chunk of C positions both [C, V] float32 logits
exist, and the chunk is recomputed in the backward pass (jax.checkpoint), so memory holds a few
[C, V] blocks (one chunk's) whatever the number of positions. Gradients flow to the student's
hidden states and lm_head only. With per_position, also per position: top1 (the student's argmax
is the teacher's), and with labels ce (-log q at tau 1 of the label), confidence (the student's
largest probability at tau 1) and correct (its argmax is the label), from which calibration follows.

Shape letters: N positions, C chunk, D model width (the student's and the teacher's, each its
own), V vocabulary.
"""
import jax
import jax.numpy as jnp

from kdjax import choices

# Positions per chunk unless given: both [C, V] float32 logits within this many bytes.
CHUNK_BYTES = 256 * 2**20
POSITION_TERMS = ("kl", "top1", "entropy", "ce", "confidence", "correct")
DIVERGENCES = choices.DIVERGENCES


def default_chunk(num_rows: int, vocab: int) -> int:
  return max(1, min(num_rows, CHUNK_BYTES // (2 * 4 * vocab)))


def divergence_C(logp_CxV, logq_CxV, divergence: str, skew: float):
  """The per-position divergence (module docstring) of teacher log-probs logp and student
  log-probs logq, both at the same temperature, without its tau^2."""
  kl = lambda loga_CxV, logb_CxV: jnp.sum(jnp.exp(loga_CxV) * (loga_CxV - logb_CxV), axis=-1)
  mix = lambda loga_CxV, logb_CxV: jnp.logaddexp(jnp.log(skew) + loga_CxV,
                                                 jnp.log1p(-skew) + logb_CxV)
  if divergence == "forward":
    return kl(logp_CxV, logq_CxV)
  if divergence == "reverse":
    return kl(logq_CxV, logp_CxV)
  if divergence == "skew_forward":
    return kl(logp_CxV, mix(logp_CxV, logq_CxV))
  if divergence == "skew_reverse":
    return kl(logq_CxV, mix(logq_CxV, logp_CxV))
  raise ValueError(f"divergence must be one of {DIVERGENCES}, got {divergence!r}")


def _chunk_terms(h_CxD, w_DxV, th_CxD, tw_DxV, labels_C, temperature, teacher_label=False,
                 divergence="forward", skew=0.1):
  """Per-position terms of one chunk (th, tw: the teacher's, of its own width D); with
  teacher_label also the teacher's CE on the label and the label's rank among the teacher's
  logits (0: its top-1); with a divergence other than forward also that one ("divergence")."""
  z_CxV = jnp.einsum("cd,dv->cv", h_CxD, w_DxV, preferred_element_type=jnp.float32)
  zt_CxV = jax.lax.stop_gradient(
      jnp.einsum("cd,dv->cv", th_CxD, tw_DxV, preferred_element_type=jnp.float32))
  logq_CxV = jax.nn.log_softmax(z_CxV / temperature, axis=-1)
  logp_CxV = jax.nn.log_softmax(zt_CxV / temperature, axis=-1)
  kl_C = temperature * temperature * divergence_C(logp_CxV, logq_CxV, "forward", skew)
  argmax_C = jnp.argmax(z_CxV, axis=-1)
  logq1_CxV = jax.nn.log_softmax(z_CxV, axis=-1)
  at_label = lambda x_CxV: jnp.take_along_axis(x_CxV, labels_C[:, None], axis=-1)[:, 0]
  terms = dict(kl=kl_C, top1=argmax_C == jnp.argmax(zt_CxV, axis=-1),
               entropy=-jnp.sum(jnp.exp(logq_CxV) * logq_CxV, axis=-1),
               ce=-at_label(logq1_CxV), confidence=jnp.exp(jnp.max(logq1_CxV, axis=-1)),
               correct=argmax_C == labels_C)
  if divergence != "forward":
    terms["divergence"] = temperature * temperature * divergence_C(logp_CxV, logq_CxV,
                                                                   divergence, skew)
  if teacher_label:
    logp1_CxV = logp_CxV if temperature == 1.0 else jax.nn.log_softmax(zt_CxV, axis=-1)
    terms["teacher_ce"] = -at_label(logp1_CxV)
    terms["teacher_rank"] = jnp.sum(zt_CxV > at_label(zt_CxV)[:, None], axis=-1)
  return terms


def full_kl_loss(hidden, lm_head, teacher_hidden, teacher_head, mask, *, temperature=1.0,
                 labels=None, ce_weight=0.0, chunk_size=None, per_position=False,
                 teacher_label=False, divergence="forward", skew=0.1):
  """Mean over masked positions of the full-vocabulary KL (or the divergence named, see the
  module docstring; skew: its mixture weight a) + ce_weight * CE(labels); with
  per_position, (loss, {term: [...]}) (POSITION_TERMS; entropy: the student's, at tau; with
  teacher_label and labels also teacher_ce and teacher_rank, see _chunk_terms).

  hidden [..., D], lm_head [D, V] (the student's); teacher_hidden [..., D_t], teacher_head
  [D_t, V]; mask [...] bool (None: all); labels [...] int (None: ce and correct are 0).
  """
  if lm_head.shape[1] != teacher_head.shape[1]:
    raise ValueError(f"student and teacher vocabularies differ: lm_head {lm_head.shape}, "
                     f"teacher_head {teacher_head.shape}; a student must share its teacher's")
  batch = hidden.shape[:-1]
  if teacher_hidden.shape[:-1] != batch:
    raise ValueError(f"teacher_hidden {teacher_hidden.shape} and hidden {hidden.shape} must "
                     "cover the same positions")
  if not temperature > 0:
    raise ValueError(f"temperature must be > 0, got {temperature}")
  if ce_weight != 0.0 and labels is None:
    raise ValueError(f"ce_weight={ce_weight} needs labels")
  if divergence not in DIVERGENCES:
    raise ValueError(f"divergence must be one of {DIVERGENCES}, got {divergence!r}")
  if divergence.startswith("skew") and not 0.0 < skew < 1.0:
    raise ValueError(f"skew must be in (0, 1) for divergence {divergence!r}, got {skew}")
  num_rows, vocab = hidden.size // hidden.shape[-1], lm_head.shape[1]
  chunk = chunk_size or default_chunk(num_rows, vocab)
  padded = -(-num_rows // chunk) * chunk
  pad = lambda x: jnp.pad(x, [(0, padded - num_rows)] + [(0, 0)] * (x.ndim - 1))
  h_NxD = pad(hidden.reshape(num_rows, -1))
  th_NxD = pad(jax.lax.stop_gradient(teacher_hidden).reshape(num_rows, -1))
  labels_N = pad(jnp.zeros(num_rows, jnp.int32) if labels is None
                 else labels.reshape(num_rows).astype(jnp.int32))
  mask_N = pad(jnp.ones(num_rows, bool) if mask is None else mask.reshape(num_rows))
  teacher_head = jax.lax.stop_gradient(teacher_head)

  @jax.checkpoint
  def one(args):
    h_CxD, th_CxD, labels_C = args
    return _chunk_terms(h_CxD, lm_head, th_CxD, teacher_head, labels_C, temperature,
                        teacher_label and labels is not None, divergence, skew)

  chunks = lambda x: x.reshape((padded // chunk, chunk) + x.shape[1:])
  terms = jax.lax.map(one, (chunks(h_NxD), chunks(th_NxD), chunks(labels_N)))
  terms = {k: v.reshape(padded)[:num_rows] for k, v in terms.items()}
  mask_N = mask_N[:num_rows]
  count = jnp.maximum(jnp.sum(mask_N), 1).astype(jnp.float32)
  mean = lambda x: jnp.sum(jnp.where(mask_N, x, 0.0)) / count
  trained = terms.pop("divergence", terms["kl"])
  loss = mean(trained) + (ce_weight * mean(terms["ce"]) if ce_weight else 0.0)
  if not per_position:
    return loss
  if labels is None:
    terms["ce"], terms["correct"] = jnp.zeros_like(terms["ce"]), jnp.zeros_like(terms["correct"])
  return loss, {k: jax.lax.stop_gradient(v).reshape(batch) for k, v in terms.items()}


ECE_BINS = 15


def calibration_sums(confidence, correct, mask, bins: int = ECE_BINS) -> jax.Array:
  """[bins, 3]: per equal-width confidence bin, the masked positions' count, summed confidence
  and number correct; sums of batches add up (expected_calibration_error reads them)."""
  weight_N = mask.reshape(-1).astype(jnp.float32)
  conf_N = confidence.reshape(-1).astype(jnp.float32) * weight_N
  right_N = correct.reshape(-1).astype(jnp.float32) * weight_N
  bin_of_N = jnp.clip((conf_N * bins).astype(jnp.int32), 0, bins - 1)
  return jnp.stack([jax.ops.segment_sum(x, bin_of_N, bins) for x in (weight_N, conf_N, right_N)],
                   axis=1)


def expected_calibration_error(sums) -> float:
  """ECE: over the confidence bins, |accuracy - mean confidence| weighted by the bin's share."""
  sums = jnp.asarray(sums)
  return float(jnp.sum(jnp.abs(sums[:, 2] - sums[:, 1])) / jnp.maximum(jnp.sum(sums[:, 0]), 1.0))
