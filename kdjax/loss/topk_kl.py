"""Public loss API: top-k KL distillation loss on the lm_head, with input checks and dispatch.

Definitions, per position with cached top-k set S (ids), cached teacher log-probs logp (full
vocabulary softmax at temperature 1, gathered at S, not renormalised), student logits
z = hidden . lm_head over the FULL vocabulary (float32 accumulation):

  Temperature tau (applied exactly once, to both sides):
    student   log q_v = z_v / tau - logsumexp_V(z / tau)
    teacher   log p_v = log M + logp_v / tau - logsumexp_S(logp / tau),   M = sum_S exp(logp)
              i.e. the cached top-k re-tempered as p ~ p^(1/tau) WITHIN the top-k, keeping the
              top-k mass M (the tail outside S is unknown, so its share is left unchanged).
              At tau = 1 this is exactly exp(logp).
    The KL term is multiplied by tau^2 (gradient scale independent of tau, as is customary).
  Objectives (p, q as above; Q = sum_S q):
    "sparse"  sum_S p (log p - log q)             the paper's; can be negative (floor M log M)
    "tail"    sparse + (1 - M) log((1 - M) / (1 - Q)): exact KL of the distributions coarsened
              to S plus one tail bucket, never negative. 1 - M is clamped at 0 (quantised caches
              may sum above 1) and 0 log 0 = 0; 1 - Q is clamped at objectives.TAIL_FLOOR.
    "renorm"  sum_S p' (log p' - log q'),  p' = p / M, q' = q / Q  (both renormalised over S)
  Cross-entropy: CE = -log softmax(z)[label], always at tau = 1.

  loss = sum_{mask} (KL term + ce_weight * CE) / max(#mask, 1)   (0 if nothing is masked in)

Precision: logits and everything after them are float32; the gradient matmuls take dL/dz rounded
once to the promoted dtype of hidden and lm_head (pass both in bf16 for speed), and the chunked
impls accumulate dlm_head across chunks in `dw_dtype`: lm_head's dtype by default (one rounding
per chunk, as peers do), or float32 (rounded once at the end, 4 * D * V more bytes). One
exception, impl "pallas" on bf16 (fused.py): its softmax normalisers are float32, but the
student's logits at the top-k ids and label are read back from bf16 exp(z / tau), so each q_k
carries up to 2^-8 relative error (the loss per position up to ~2^-8 * tau^2 nats); measured not
to change what a student learns (BENCHMARKS.md). impl "pallas_exact" is exact there.
Memory (chunked impls): hidden, lm_head, their gradients, plus one chunk's working set: its
[C, V] float32 logits and their gradient (bf16), or on impl "pallas" the gradient alone; C is
sized to the memory by default (chunked.default_chunk, fused.default_chunk).

Shape letters: N flattened positions, D model width, V vocabulary, K cached entries.
"""
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from kdjax import choices
from kdjax.loss import chunked, fused, objectives, paper, reference


class Chunked(NamedTuple):
  """A chunked impl: its loss (chunked.build_fused_loss's contract) and what it offers."""
  loss: Callable
  default_chunk: Callable  # (num_rows, dim, vocab, dtype, spec) -> positions per chunk
  position_terms: bool     # can return per-position terms (per_position=True)
  vocab_sharded: bool      # takes a vocabulary-sharded lm_head (vocab_axis)


CHUNKED = {
    "xla": Chunked(chunked.xla_loss, chunked.default_chunk, True, True),
    "pallas": Chunked(fused.topk_kl_loss, fused.default_chunk, True, True),
    "pallas_exact": Chunked(chunked.exact_loss, chunked.default_chunk, True, True),
    # The paper's algorithm, a benchmark baseline: no per-position outputs, a whole lm_head.
    "paper": Chunked(paper.topk_kl_loss, paper.default_chunk, False, False),
}
# "reference" is dense (reference.py); "auto" is "pallas" on a GPU, else "xla".
IMPLS = choices.LOSS_IMPLS
assert set(IMPLS) == {"auto", "reference", *CHUNKED}, "kdjax.choices.LOSS_IMPLS"


def has_position_terms(impl: str) -> bool:
  """Whether `impl` can return per-position terms (per_position=True)."""
  return impl not in CHUNKED or CHUNKED[impl].position_terms


def _chunked_impl(impl: str) -> Chunked:
  if impl == "auto":
    impl = "pallas" if jax.default_backend() == "gpu" else "xla"
  return CHUNKED[impl]


def _check(hidden, lm_head, topk_ids, topk_logprobs, mask, labels):
  if lm_head.ndim != 2:
    raise ValueError(f"lm_head must be [D, V], got shape {lm_head.shape}")
  if hidden.ndim < 1 or hidden.shape[-1] != lm_head.shape[0]:
    raise ValueError(f"hidden [..., D] {hidden.shape} does not match lm_head [D, V] "
                     f"{lm_head.shape}")
  batch = hidden.shape[:-1]
  if topk_ids.ndim != len(batch) + 1 or topk_ids.shape[:-1] != batch:
    raise ValueError(f"topk_ids must be [..., K] with batch dims {batch}, got {topk_ids.shape}")
  if topk_logprobs.shape != topk_ids.shape:
    raise ValueError(f"topk_logprobs {topk_logprobs.shape} must match topk_ids "
                     f"{topk_ids.shape}")
  if not jnp.issubdtype(topk_ids.dtype, jnp.integer):
    raise ValueError(f"topk_ids must be integers, got {topk_ids.dtype}")
  if mask is not None and mask.shape != batch:
    raise ValueError(f"mask must have the batch shape {batch}, got {mask.shape}")
  if labels is not None:
    if labels.shape != batch:
      raise ValueError(f"labels must have the batch shape {batch}, got {labels.shape}")
    if not jnp.issubdtype(labels.dtype, jnp.integer):
      raise ValueError(f"labels must be integers, got {labels.dtype}")


def _check_chunk(chunk_size):
  if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size <= 0):
    raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")


def topk_kl_loss(hidden, lm_head, topk_ids, topk_logprobs, mask, *, objective="sparse",
                 temperature=1.0, labels=None, ce_weight=0.0, impl="auto", chunk_size=None,
                 dw_dtype=None, return_aux=False, per_position=False, vocab_axis=None):
  """Top-k KL distillation loss (module docstring has the definitions).

  Args:
    hidden: [..., D] student hidden states after the final norm (bf16 or f32).
    lm_head: [D, V] output projection.
    topk_ids: [..., K] int teacher top-k ids (distinct within a position).
    topk_logprobs: [..., K] teacher log-softmax over the full vocabulary at those ids.
    mask: [...] bool, positions that count (None: all).
    objective: "sparse" | "tail" | "renorm".
    temperature: tau > 0, a Python number.
    labels: [...] int next-token ids for the cross-entropy term, or None.
    ce_weight: weight of the cross-entropy term (needs labels).
    impl: "auto" | "reference" | "xla" | "pallas" | "pallas_exact" | "paper".
    chunk_size: positions per chunk for the chunked impls (None: sized to the vocabulary).
    dw_dtype: dtype the chunked impls accumulate dlm_head in (None: lm_head's; "float32").
    return_aux: also return {"kl": mean KL term, "ce": mean CE} (no gradient through these).
    per_position: aux also holds "positions": per-position "kl" (the KL term), "ce", "entropy"
      (of the student softmax at tau, nats) and "top1" (bool: the student's argmax is the
      teacher's most probable cached id; on impl "pallas", whose top-k logits are read back
      within tau * 2^-8, a teacher top-1 up to 2 * tau * 2^-8 short of the student's maximum
      counts too, a true agreement always counts), shaped like mask, from the loss's own pass
      (not for impl "paper"). Needs return_aux.
    vocab_axis: None, or (inside shard_map) the mesh axis the vocabulary is split over: lm_head
      is then this device's columns [i * V, (i + 1) * V) of the whole [D, V * n] head, i its
      index along the axis; topk_ids and labels stay ids of the whole vocabulary. Every device
      gets the loss over the whole vocabulary, the kernels running on its own columns (the
      chunked impls "xla", "pallas", "pallas_exact"), and its share of the gradients: its
      columns' part of hidden's (shard_map(check_vma=False) sums them, see
      chunked.build_fused_loss) and its own columns of lm_head's.
  Returns:
    float32 scalar loss, differentiable in hidden and lm_head; (loss, aux) with return_aux.
  """
  _check(hidden, lm_head, topk_ids, topk_logprobs, mask, labels)
  if objective not in objectives.OBJECTIVES:
    raise ValueError(f"unknown objective {objective!r}; expected one of {objectives.OBJECTIVES}")
  if impl not in IMPLS:
    raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")
  try:
    temperature = float(temperature)
    ce_weight = float(ce_weight)
  except TypeError as e:
    raise ValueError("temperature and ce_weight must be Python numbers (static)") from e
  if not temperature > 0:
    raise ValueError(f"temperature must be > 0, got {temperature}")
  if ce_weight != 0.0 and labels is None:
    raise ValueError(f"ce_weight={ce_weight} needs labels")
  _check_chunk(chunk_size)
  if per_position and (not return_aux or not has_position_terms(impl)):
    raise ValueError("per_position needs return_aux=True and an impl with per-position outputs: "
                     f"{[i for i in IMPLS if has_position_terms(i)]}")
  sharded = ["auto"] + [i for i, c in CHUNKED.items() if c.vocab_sharded]
  if vocab_axis is not None and impl not in sharded:
    raise ValueError(f"impl {impl!r} takes a whole lm_head; a vocabulary-sharded one "
                     f"(vocab_axis) needs one of {sharded}")
  if dw_dtype is not None:
    dw_dtype = jnp.dtype(dw_dtype)
    if not jnp.issubdtype(dw_dtype, jnp.floating):
      raise ValueError(f"dw_dtype must be a float dtype or None, got {dw_dtype}")

  dim, vocab = lm_head.shape
  hidden_NxD = hidden.reshape(-1, dim)
  num_rows = hidden_NxD.shape[0]
  ids_NxK = topk_ids.reshape(num_rows, topk_ids.shape[-1]).astype(jnp.int32)
  logp_NxK = topk_logprobs.reshape(num_rows, topk_ids.shape[-1]).astype(jnp.float32)
  mask_N = (jnp.ones((num_rows,), bool) if mask is None
            else mask.reshape(num_rows).astype(bool))
  spec = objectives.LossSpec(objective, temperature, ce_weight, labels is not None)
  labels_N = (jnp.zeros((num_rows,), jnp.int32) if labels is None
              else labels.reshape(num_rows).astype(jnp.int32))
  if num_rows == 0:
    zero = jnp.zeros((), jnp.float32)
    out = objectives.LossTerms(zero, zero, zero, objectives.zero_positions(0))
  elif impl == "reference":
    out = reference.topk_kl_loss(hidden_NxD, lm_head, ids_NxK, logp_NxK, mask_N, labels_N, spec)
  else:
    chosen = _chunked_impl(impl)
    dtype = jnp.promote_types(hidden.dtype, lm_head.dtype)
    chunk = min(chunk_size or chosen.default_chunk(num_rows, dim, vocab, dtype, spec), num_rows)
    w_N = mask_N.astype(jnp.float32) / jnp.maximum(jnp.sum(mask_N), 1).astype(jnp.float32)
    out = chosen.loss(hidden_NxD, lm_head, ids_NxK, logp_NxK, w_N, labels_N, spec, chunk,
                      dw_dtype, per_position, vocab_axis)
  if not return_aux:
    return out.loss
  aux = {"kl": jax.lax.stop_gradient(out.kl), "ce": jax.lax.stop_gradient(out.ce)}
  if per_position:
    aux["positions"] = {name: x_N.reshape(hidden.shape[:-1])
                        for name, x_N in out.positions._asdict().items()}
  return out.loss, aux
