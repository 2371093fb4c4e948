"""Value checks of rows written to or read from a store; an error names the store row of the first
bad value.

Written rows are checked before anything is written; read rows after decoding, so a value that
went wrong on disk (or a wrong decoding parameter) fails loudly instead of reaching a loss.
"""
import numpy as np

from kdjax.cache.errors import CacheError


def describe_rows(rows):
  """Short text of a slice or a sequence of rows, for messages."""
  if isinstance(rows, slice):
    return f"{rows.start}..{rows.stop}"
  rows = np.asarray(rows)
  return f"{rows[:8].tolist()}{'...' if rows.size > 8 else ''}"


def _first(bad_SxT, rows_S):
  """'row R, position P(, entry E)' of the first True of bad_SxT(xK); rows_S: their store rows."""
  index = np.argwhere(bad_SxT)[0].tolist()
  names = ("position", "entry")
  return ", ".join([f"row {rows_S[index[0]]}"] + [f"{n} {i}" for n, i in zip(names, index[1:])])


def check_ids(ids, rows, vocab_size, where,
              fix="Check the tokenizer and vocab_size; nothing was written."):
  """ids [S, T(, K)] of store rows `rows` [S] lie in [0, vocab_size)."""
  if not ids.size or ((np.dtype(ids.dtype).kind == "u" or ids.min() >= 0)
                      and ids.max() < vocab_size):
    return  # one or two passes where the mask below takes four
  bad = (ids < 0) | (ids >= vocab_size)
  if bad.any():
    raise CacheError(f"{where}: ids must lie in [0, {vocab_size}), found {ids.min()}..{ids.max()} "
                     f"({bad.sum()} outside, first at {_first(bad, rows)}). {fix}")


def check_order(order_SxM, rows, vocab_size, where, fix):
  """Each row's id order (dictionary layout) holds distinct ids in [0, vocab_size)."""
  check_ids(order_SxM, rows, vocab_size, where, fix)
  sorted_SxM = np.sort(order_SxM, axis=-1)
  repeated = np.zeros(order_SxM.shape, bool)
  repeated[:, 1:] = sorted_SxM[:, 1:] == sorted_SxM[:, :-1]
  if repeated.any():
    raise CacheError(f"{where}: a row's id order (topk_order) repeats an id (first: row "
                     f"{rows[np.argwhere(repeated)[0][0]]}). {fix}")


def check_logprobs(logprobs, rows, where, fix):
  """logprobs [S, T, K] of store rows `rows` [S] are finite and <= 0."""
  bad = ~np.isfinite(logprobs)
  if bad.any():
    raise CacheError(f"{where}: {bad.sum()} NaN/Inf teacher log-probs (first at "
                     f"{_first(bad, rows)}). {fix}")
  if logprobs.size and logprobs.max() > 0:
    raise CacheError(f"{where}: log-probs must be <= 0, found {logprobs.max()} (first at "
                     f"{_first(logprobs > 0, rows)}). {fix}")


def check_hidden(hidden, rows, where, fix):
  """hidden [S, T, H] of store rows `rows` [S] are finite."""
  bad = ~np.isfinite(hidden)
  if bad.any():
    raise CacheError(f"{where}: {bad.sum()} NaN/Inf teacher hidden states (first at "
                     f"{_first(bad.any(axis=-1), rows)}). {fix}")
