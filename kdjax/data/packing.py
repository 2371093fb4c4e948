"""Greedy packing of tokenised documents into fixed-length rows.

Each document becomes [bos] + tokens + [eos] (bos/eos skipped when None or already there;
`Packer.push(doc, add_specials=False)` adds neither, for chat-template output). The data stage
passes the tokenizer's document separators, `Tokenizer.document_bos_id` / `document_eos_id`
(kdjax/tokenizer.py decides them: an end-of-text token, a bos only for families that expect
one), not its configured bos/eos, which in instruct tokenizers are chat markers.
Documents are placed in order:

  * one that fits in the current row's free space goes there;
  * one that fits in a row (<= T tokens) closes the current row (padding its rest) and opens the
    next;
  * a longer one is SPLIT: its first piece fills the current row's free space, the next pieces
    fill whole rows, and the last piece opens a row that later documents share. Nothing is
    dropped: the pieces concatenated give the document back.

Every piece is its own segment and its positions restart at 0. Attention never crosses segments,
so a piece is seen without the text before it, exactly like a document starting at position 0;
continuing positions would instead show the model large positions with no context, a mix that
never happens at inference.

Row arrays (T = seq_len):
  tokens [T] int32, padding = pad_id;
  segment_ids [T] int32, 1-based piece index within the row, 0 = padding;
  positions [T] int32, position within the piece;
  loss_mask [T] bool: t counts iff t+1 is in the same segment and token t+1 is a target
  (loss_mask="assistant" makes only assistant tokens targets; eos is a target iff the
  document's last token is).
"""
from collections.abc import Iterable, Iterator

import numpy as np


def pack(token_docs: Iterable, seq_len: int, *, bos_id: int | None, eos_id: int | None,
         pad_id: int = 0) -> Iterator[dict[str, np.ndarray]]:
  """Packs documents into rows; yields one dict of [seq_len] numpy arrays per row.

  Args:
    token_docs: iterable of token id sequences, or of (ids, targets) pairs where targets[i]
      (bool) says whether token i is a prediction target. Empty documents are skipped.
    seq_len: T, tokens per row.
    bos_id, eos_id: added around each document unless None or already present.
    pad_id: token id written at padding positions (segment 0, never a target).
  """
  packer = Packer(seq_len, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id)
  for doc in token_docs:
    yield from packer.push(doc)
  yield from packer.close()


class Packer:
  """`pack` one document at a time, for callers that feed several packers from one stream."""

  def __init__(self, seq_len: int, *, bos_id: int | None, eos_id: int | None, pad_id: int = 0):
    if seq_len < 2:
      raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    self.bos_id, self.eos_id = bos_id, eos_id
    self.row = _Row(seq_len, pad_id)

  def push(self, doc, *, add_specials: bool = True) -> list[dict[str, np.ndarray]]:
    """Adds one document; returns the rows it completed (often none).

    add_specials=False leaves the document as it is (chat templates write their own).
    """
    if add_specials:
      ids, targets = _with_specials(doc, self.bos_id, self.eos_id)
    else:
      ids, targets = _with_specials(doc, None, None)
    row, n, done = self.row, len(ids), []
    if n > row.free and n <= row.seq_len:
      done.append(row.flush())
    start = 0
    while start < n:
      if row.free == 0:
        done.append(row.flush())
      stop = min(n, start + row.free)
      row.add(ids[start:stop], targets[start:stop])
      start = stop
    return done

  def close(self) -> list[dict[str, np.ndarray]]:
    """Returns the last, partly filled row, if any."""
    return [self.row.flush()] if self.row.used else []


def _with_specials(doc, bos_id, eos_id) -> tuple[np.ndarray, np.ndarray]:
  if isinstance(doc, tuple):
    ids, targets = doc
    ids = np.asarray(ids, np.int32)
    targets = np.asarray(targets, np.bool_)
    if targets.shape != ids.shape:
      raise ValueError(f"targets shape {targets.shape} != ids shape {ids.shape}")
  else:
    ids = np.asarray(doc, np.int32)
    targets = np.ones(ids.shape, np.bool_)
  if ids.ndim != 1:
    raise ValueError(f"a document must be a 1-D sequence of ids, got shape {ids.shape}")
  if ids.size == 0:
    return ids, targets
  if bos_id is not None and ids[0] != bos_id:
    # Nothing predicts the first token of a segment, so bos's target flag never matters.
    ids, targets = np.concatenate([[bos_id], ids]), np.concatenate([[False], targets])
  if eos_id is not None and ids[-1] != eos_id:
    ids, targets = np.concatenate([ids, [eos_id]]), np.concatenate([targets, targets[-1:]])
  return ids.astype(np.int32), targets


class _Row:
  """The row being filled: a list of (ids, targets) pieces."""

  def __init__(self, seq_len: int, pad_id: int):
    self.seq_len, self.pad_id = seq_len, pad_id
    self.pieces = []
    self.used = 0

  @property
  def free(self) -> int:
    return self.seq_len - self.used

  def add(self, ids: np.ndarray, targets: np.ndarray) -> None:
    self.pieces.append((ids, targets))
    self.used += len(ids)

  def flush(self) -> dict[str, np.ndarray]:
    T = self.seq_len
    tokens_T = np.full(T, self.pad_id, np.int32)
    segment_ids_T = np.zeros(T, np.int32)
    positions_T = np.zeros(T, np.int32)
    targets_T = np.zeros(T, np.bool_)
    start = 0
    for segment, (ids, targets) in enumerate(self.pieces, 1):
      stop = start + len(ids)
      tokens_T[start:stop] = ids
      segment_ids_T[start:stop] = segment
      positions_T[start:stop] = np.arange(len(ids), dtype=np.int32)
      targets_T[start:stop] = targets
      start = stop
    loss_mask_T = np.zeros(T, np.bool_)
    loss_mask_T[:-1] = ((segment_ids_T[:-1] != 0) & (segment_ids_T[1:] == segment_ids_T[:-1])
                        & targets_T[1:])
    self.pieces, self.used = [], 0
    return {"tokens": tokens_T, "segment_ids": segment_ids_T, "positions": positions_T,
            "loss_mask": loss_mask_T}


def pad_rows(x_NxAny: np.ndarray, rows: int) -> np.ndarray:
  """x with zero rows appended up to `rows`: padding rows (segment 0, nothing in the loss), so a
  pass's last, shorter batch runs the program its other batches compiled."""
  return np.pad(x_NxAny, [(0, rows - len(x_NxAny))] + [(0, 0)] * (x_NxAny.ndim - 1))


def next_token_labels(tokens_BxT: np.ndarray) -> np.ndarray:
  """labels[t] = tokens[t + 1]; the last position gets 0 and is masked by loss_mask."""
  labels_BxT = np.zeros_like(tokens_BxT)
  labels_BxT[..., :-1] = tokens_BxT[..., 1:]
  return labels_BxT
