"""Next-line completion: a downstream-style measure of a language model that needs no model hub.

From held-out rows (a data store or cache), prompts are the PROMPT tokens of one document that
end just after a line break; the target is the rest of the next line, which must hold at least
MIN_TARGET tokens, none of them a line break, before the token that ends it. The model continues
each prompt greedily (argmax, no sampling) for as many tokens as the target has; a prompt counts
as solved when the continuation's text up to its first line break equals the target line
exactly. Prompts are picked by a fixed rule (every row's candidates in order, one per STRIDE
tokens), so every model is asked the same questions.

Greedy decoding recomputes the whole window every token (no KV cache): the window is short
(PROMPT + MAX_TARGET) and the models small, so this stays simple and fast enough.

Shape letters: P prompts, L window length, D model width, V vocabulary.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

PROMPT = 128  # tokens of context before the line to complete
MIN_TARGET = 3  # a target line has at least this many tokens before its line break
MAX_TARGET = 24  # and at most this many (longer lines are not asked)
STRIDE = 256  # at most one prompt per this many tokens of a row


def pick_prompts(rows: dict, breaks_V: np.ndarray, max_prompts: int) -> dict:
  """Prompts and targets from host rows (tokens, positions, segment_ids [B, T]).

  breaks_V: bool per token id, whether its text holds a line break. Returns tokens_PxL,
  positions_PxL (the document's own positions), target_PxM (padded with -1) and length_P.
  """
  tokens_BxT, positions_BxT, segments_BxT = (rows[k] for k in ("tokens", "positions",
                                                              "segment_ids"))
  out = {"tokens": [], "positions": [], "target": [], "length": []}
  width = PROMPT + MAX_TARGET
  for b in range(tokens_BxT.shape[0]):
    tokens, positions, segments = tokens_BxT[b], positions_BxT[b], segments_BxT[b]
    is_break = breaks_V[tokens]
    t = PROMPT
    while t + MAX_TARGET < tokens.shape[0] and len(out["length"]) < max_prompts:
      ends_line = is_break[t - 1] and segments[t] > 0 and segments[t - PROMPT] == segments[t]
      rest = np.flatnonzero(is_break[t:t + MAX_TARGET + 1])
      length = int(rest[0]) if rest.size else 0  # tokens before the one that ends the line
      same_doc = segments[t + length] == segments[t]
      if ends_line and MIN_TARGET <= length <= MAX_TARGET - 1 and same_doc:
        window = slice(t - PROMPT, t - PROMPT + width)
        out["tokens"].append(tokens[window])
        out["positions"].append(positions[window])
        target = np.full(MAX_TARGET, -1, np.int32)
        target[:length + 1] = tokens[t:t + length + 1]  # the line and the token that ends it
        out["target"].append(target)
        out["length"].append(length)
        t += STRIDE
      else:
        t += 1
  return {k: np.asarray(v, np.int32) for k, v in out.items()}


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _greedy_step(params, tokens_PxL, positions_PxL, i, *, graphdef):
  """tokens_PxL with its column PROMPT + i set to the model's argmax after column PROMPT + i - 1.
  One jitted call per decoded token (a scan over them would need the model inside its body)."""
  model = nnx.merge(graphdef, params)
  hidden_PxLxD = model(tokens_PxL, positions_PxL, jnp.ones_like(tokens_PxL), 1)  # one document
  h_PxD = jax.lax.dynamic_index_in_dim(hidden_PxLxD, PROMPT - 1 + i, axis=1, keepdims=False)
  z_PxV = jnp.einsum("pd,dv->pv", h_PxD, model.lm_head_DxV().astype(h_PxD.dtype),
                     preferred_element_type=jnp.float32)
  next_P = jnp.argmax(z_PxV, axis=-1).astype(tokens_PxL.dtype)
  return jax.lax.dynamic_update_index_in_dim(tokens_PxL, next_P, PROMPT + i, axis=1)


def _line(ids, decode) -> str:
  """The text of ids up to its first line break."""
  return decode([int(i) for i in ids if i >= 0]).split("\n", 1)[0]


def exact_match(model: nnx.Module, prompts: dict, decode, batch_size: int = 256) -> float:
  """Share of prompts whose greedy continuation reproduces the target line exactly."""
  graphdef, params = nnx.split(model)
  n = len(prompts["length"])
  if n == 0:
    return float("nan")
  batch_size = min(batch_size, n)  # one compiled step for every batch, padded to this size
  solved = 0
  for start in range(0, n, batch_size):
    part = {k: v[start:start + batch_size] for k, v in prompts.items()}
    rows = len(part["length"])
    pad = lambda x: np.pad(x, [(0, batch_size - rows)] + [(0, 0)] * (x.ndim - 1))
    window = pad(part["tokens"]).copy()
    window[:, PROMPT:] = 0  # the target is not shown
    tokens_PxL, positions_PxL = jnp.asarray(window), jnp.asarray(pad(part["positions"]))
    for i in range(MAX_TARGET):
      tokens_PxL = _greedy_step(params, tokens_PxL, positions_PxL, i, graphdef=graphdef)
    out_PxS = np.asarray(tokens_PxL)[:rows, PROMPT:]
    for got, want in zip(out_PxS, part["target"]):
      solved += _line(got, decode) == _line(want, decode)
  return solved / max(n, 1)


def line_breaks(decode, vocab_size: int) -> np.ndarray:
  """bool [V]: whether each token id's text holds a line break."""
  return np.array(["\n" in decode([i]) for i in range(vocab_size)], bool)
