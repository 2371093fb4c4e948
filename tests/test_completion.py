"""Next-line completion (kdjax/completion.py): the questions picked, and greedy decoding against a
plain loop over the model."""
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kdjax import completion
from kdjax.models import llama

VOCAB = 40
BREAK = 7  # the one token id whose text holds a line break


def decode(ids):
  return "".join("\n" if i == BREAK else chr(ord("a") + i % 26) for i in ids)


def rows(rng, batch=3, length=512):
  tokens = rng.integers(8, VOCAB, (batch, length))
  tokens[rng.random((batch, length)) < 0.12] = BREAK
  segments = np.ones((batch, length), np.int32)
  segments[1, 300:] = 2  # a second document in row 1
  positions = np.concatenate([np.arange(300), np.arange(212)])[None].repeat(batch, 0)
  positions[[0, 2]] = np.arange(length)
  return {"tokens": tokens.astype(np.int32), "positions": positions.astype(np.int32),
          "segment_ids": segments}


def test_questions_end_lines_and_stay_in_their_document():
  rng = np.random.default_rng(0)
  r = rows(rng)
  breaks = np.array([decode([i]) == "\n" for i in range(VOCAB)])
  q = completion.pick_prompts(r, breaks, max_prompts=50)
  assert len(q["length"]) > 0
  for tokens, target, length in zip(q["tokens"], q["target"], q["length"]):
    assert tokens[completion.PROMPT - 1] == BREAK  # the prompt ends a line
    assert completion.MIN_TARGET <= length < completion.MAX_TARGET
    line = target[:length + 1]
    assert BREAK not in line[:length] and line[length] == BREAK
    assert np.all(target[length + 1:] == -1)
    np.testing.assert_array_equal(tokens[completion.PROMPT:completion.PROMPT + length + 1], line)
  # Row 1's second document starts at 300: no window crosses it, no window starts before 128.
  for tokens, positions in zip(q["tokens"], q["positions"]):
    assert positions[completion.PROMPT] >= completion.PROMPT
    assert np.all(np.diff(positions[:completion.PROMPT + 1]) == 1)


def greedy_reference(model, tokens, positions) -> list[int]:
  """The model's argmax token by token, a plain loop over the whole window (causal: what follows
  the last decoded token does not matter), no jit."""
  window = np.array(tokens)
  window[completion.PROMPT:] = 0
  for i in range(completion.MAX_TARGET):
    hidden = model(jnp.asarray(window[None]), jnp.asarray(positions[None]),
                   jnp.ones((1, len(window)), int))
    window[completion.PROMPT + i] = int(jnp.argmax(hidden[0, completion.PROMPT - 1 + i]
                                                   @ model.lm_head_DxV()))
  return list(window[completion.PROMPT:])


def test_greedy_exact_match_agrees_with_a_plain_loop():
  rng = np.random.default_rng(1)
  cfg = llama.ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1,
                          head_dim=16, d_ff=64, dtype="float32", param_dtype="float32")
  model = llama.Transformer(cfg, rngs=nnx.Rngs(0))
  breaks = np.array([decode([i]) == "\n" for i in range(VOCAB)])
  q = completion.pick_prompts(rows(rng), breaks, max_prompts=3)
  line = lambda ids: decode([i for i in ids if i >= 0]).split("\n")[0]
  answers = [greedy_reference(model, t, p) for t, p in zip(q["tokens"], q["positions"])]
  solved = sum(line(a) == line(t) for a, t in zip(answers, q["target"]))
  assert completion.exact_match(model, q, decode, batch_size=2) == solved / len(answers)
  # With the reference's own continuations as targets, every question is solved.
  q_self = {**q, "target": np.asarray(answers, np.int32)}
  assert completion.exact_match(model, q_self, decode, batch_size=2) == 1.0
