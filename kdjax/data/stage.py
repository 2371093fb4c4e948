"""The data stage: documents -> tokens -> packed rows -> two k=0 sequence stores (train, eval).

Documents 0, n, 2n, ... (n = eval_every) are held out, so the split depends only on the source's
order and the eval split is never empty; with `eval_source` every document of the source is
trained on and the eval store holds that source's documents instead. The number of rows is only
known once the source has been streamed, so rows are spooled to raw files beside the output and
copied into the stores one region at a time: memory stays bounded whatever the corpus size.
"""
import collections
import logging
import os
import shutil
from collections.abc import Iterator

import numpy as np
import tqdm

from kdjax import cache, tokenizer
from kdjax.data import packing, sources

# 2: plain-text documents separated by Tokenizer.document_bos/eos (were the configured bos/eos);
# assistant spans end at the end-of-turn token (they held the whitespace after it).
FORMAT = "kdjax.data/2"
_ENCODE_BATCH = 64  # documents per encode_batch call (Rust threads tokenise a batch in parallel)
_ARRAYS = {"tokens": np.int32, "segment_ids": np.int32, "positions": np.int32,
           "loss_mask": np.bool_}


def build(c, tok: tokenizer.Tokenizer | None, *, tokenizer_path: str, train_path: str,
          eval_path: str) -> None:
  """Runs the data stage from the `c.data` config group.

  `tok` is the run's tokenizer (workdir.Paths decides which); when None, trains a BPE of
  `c.vocab_size` on the training documents and writes it to `tokenizer_path` (kept for later
  runs). Then writes the stores unless they are complete.
  """
  if tok is None:
    texts = (_text(d) for i, d in enumerate(sources.documents(
        c.source, text_field=c.text_field, messages_field=c.messages_field,
        max_bytes=c.max_bytes)) if c.eval_source or not _held_out(i, c.eval_every))
    logging.info("training a %d-token BPE on %s", c.vocab_size, c.source)
    tok = tokenizer.train_bpe(texts, c.vocab_size, tokenizer_path)
  elif not c.tokenizer and tokenizer.real_vocab_size(tok) > c.vocab_size:
    raise sources.DataError(
        f"{tokenizer_path} has {tokenizer.real_vocab_size(tok)} tokens but data.vocab_size is "
        f"{c.vocab_size}: delete the workdir's data/ to retokenise")
  build_stores(c.source, tok, c.seq_len, train_path, eval_path, eval_every=c.eval_every,
               eval_source=c.eval_source, max_bytes=c.max_bytes, text_field=c.text_field,
               messages_field=c.messages_field, loss_mask=c.loss_mask)


def build_stores(source: str, tok: tokenizer.Tokenizer, seq_len: int, train_path: str,
                 eval_path: str, *, eval_every: int, eval_source: str = "", max_bytes: int = 0,
                 text_field: str = "text", messages_field: str = "messages",
                 loss_mask: str = "all") -> dict:
  """Tokenises and packs `source` into two k=0 stores; skips work if both are complete.

  Args:
    source: "stdlib" or .jsonl/.parquet paths (see `sources.documents`).
    tok: the tokenizer; its chat template renders chat records.
    seq_len: tokens per row.
    train_path, eval_path: output store directories.
    eval_every: documents 0, eval_every, 2 * eval_every, ... go to the eval store.
    eval_source: .jsonl/.parquet paths of held-out documents: when set, the eval store holds
      them (read whole) and every document of `source` goes to the train store.
    max_bytes: stop reading `source` after this many bytes of text; 0 = no cap.
    text_field, messages_field, loss_mask: see `sources.documents`.

  Returns:
    Counts: documents, bytes, skipped documents (empty; without any target token), tokens and
    rows per split.
  """
  tok_hash = tokenizer.tokenizer_hash(tok)
  identity = {"tokenizer_hash": tok_hash, "source": source, "data_format": FORMAT,
              "eval_every": eval_every, "eval_source": eval_source, "max_bytes": max_bytes,
              "loss_mask": loss_mask,
              "text_field": text_field, "messages_field": messages_field,
              # tokenizer_config.json, which decides them, is not in the tokenizer's hash
              "document_bos": tok.document_bos, "document_eos": tok.document_eos}
  if _complete(train_path, seq_len, identity) and _complete(eval_path, seq_len, identity):
    logging.info("data: %s and %s are complete; skipping", train_path, eval_path)
    return {}
  counts = collections.Counter()
  docs = lambda path, cap, counter: sources.documents(
      path, text_field=text_field, messages_field=messages_field,
      chat_template=tok.chat_template, bos_token=tok.bos_token, eos_token=tok.eos_token,
      loss_mask=loss_mask, max_bytes=cap, counts=counter)
  # (documents, split of the i-th one: 0 train, 1 eval)
  if eval_source:
    eval_counts = collections.Counter()  # its own: max_bytes caps data.source only
    streams = [(docs(source, max_bytes, counts), lambda i: 0),
               (docs(eval_source, 0, eval_counts), lambda i: 1)]
  else:
    streams = [(docs(source, max_bytes, counts), lambda i: int(_held_out(i, eval_every)))]
  packers = [packing.Packer(seq_len, bos_id=tok.document_bos_id, eos_id=tok.document_eos_id,
                            pad_id=tok.pad_id or 0) for _ in range(2)]
  spools = [_Spool(f"{path}.rows.tmp", seq_len) for path in (train_path, eval_path)]
  try:
    for stream, split_of in streams:
      for i, (doc, ids, targets) in enumerate(_tokenized(stream, tok)):
        if not targets.any():  # e.g. no assistant turn under loss_mask="assistant"
          counts["no_targets"] += 1
          continue
        split = split_of(i)
        counts[("train_tokens", "eval_tokens")[split]] += len(ids)
        spools[split].extend(packers[split].push(
            (ids, targets), add_specials=not (doc.templated or doc.ids is not None)))
    if eval_source:
      counts.update(eval_counts)
    for packer, spool in zip(packers, spools):
      spool.extend(packer.close())
    for split, spool in zip(("train", "eval"), spools):
      if spool.rows == 0:
        where = eval_source if eval_source and split == "eval" else source
        raise sources.DataError(
            f"{where}: the {split} split is empty ({counts['docs']} documents, "
            f"eval_every={eval_every}, eval_source={eval_source!r}); add data or change "
            "data.eval_every / data.eval_source / data.max_bytes")
      counts[f"{split}_rows"] = spool.rows
    attrs = {**identity, "documents": counts["docs"], "empty_documents": counts["empty"],
             "documents_without_targets": counts["no_targets"]}
    for split, path, spool in zip(("train", "eval"), (train_path, eval_path), spools):
      spool.copy_to(path, {**attrs, "split": split}, tokenizer.real_vocab_size(tok))
  finally:
    for spool in spools:
      spool.remove()
  logging.info("data: %d documents (skipped: %d empty, %d without targets), %d bytes -> "
               "train %d rows, eval %d rows", counts["docs"], counts["empty"],
               counts["no_targets"], counts["bytes"], counts["train_rows"], counts["eval_rows"])
  return dict(counts)


def _text(doc: sources.Document) -> str:
  if doc.ids is not None:
    raise sources.DataError("pre-tokenised records (input_ids) need the tokenizer that made them: "
                            "set data.tokenizer (or teacher.hf_path)")
  return doc.text


def _held_out(index: int, eval_every: int) -> bool:
  return index % eval_every == 0


def _complete(path: str, seq_len: int, identity: dict) -> bool:
  """Whether `path` holds a finished store of this data; raises if it holds other data."""
  if not os.path.exists(path):
    return False
  try:
    store = cache.open(path, k=0, seq_len=seq_len, allow_partial=True)
  except cache.CacheError as e:
    raise sources.DataError(f"{e} (delete {path} to rebuild it)") from e
  differ = {k: (store.attrs.get(k), v) for k, v in identity.items() if store.attrs.get(k) != v}
  if differ:
    raise sources.DataError(f"{path} was built from other data (key: stored vs wanted): "
                            f"{differ}; delete it (and data/tokenizer.json if trained for it) to "
                            "rebuild, or change data.* back")
  return not store.missing()


def tokenize(docs, tok: tokenizer.Tokenizer) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  """Yields (ids [n] int32, targets [n] bool) per document, in order.

  A token is a target when its characters overlap one of the document's spans (all tokens when
  the document has no spans).
  """
  for _, ids, targets in _tokenized(docs, tok):
    yield ids, targets


def _tokenized(docs, tok) -> Iterator[tuple[sources.Document, np.ndarray, np.ndarray]]:
  batch = []
  for doc in docs:
    batch.append(doc)
    if len(batch) == _ENCODE_BATCH:
      yield from _encode(batch, tok)
      batch = []
  yield from _encode(batch, tok)


def _encode(batch, tok) -> Iterator[tuple[sources.Document, np.ndarray, np.ndarray]]:
  if not batch:
    return
  encodings = tok.hf.encode_batch([d.text for d in batch], add_special_tokens=False)
  vocab = tok.vocab_size if any(d.ids is not None for d in batch) else 0
  for doc, enc in zip(batch, encodings):
    if doc.ids is not None:  # pre-tokenised: as given
      if len(doc.ids) and doc.ids.max() >= vocab:
        raise sources.DataError(
            f"a pre-tokenised record holds id {doc.ids.max()} but the tokenizer has {vocab} "
            "ids; its ids must come from data.tokenizer's tokenizer")
      yield doc, doc.ids, doc.targets
      continue
    ids = np.asarray(enc.ids, np.int32)
    if doc.spans is None:
      yield doc, ids, np.ones(ids.shape, np.bool_)
      continue
    offsets_Nx2 = np.asarray(enc.offsets, np.int64).reshape(-1, 2)
    targets = np.zeros(ids.shape, np.bool_)
    for start, stop in doc.spans:
      targets |= (offsets_Nx2[:, 0] < stop) & (offsets_Nx2[:, 1] > start)
    yield doc, ids, targets


class _Spool:
  """Rows appended to one raw file per array; read back through np.memmap."""

  def __init__(self, directory: str, seq_len: int):
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    self.directory, self.seq_len, self.rows = directory, seq_len, 0
    self.files = {name: open(os.path.join(directory, name), "wb") for name in _ARRAYS}

  def extend(self, rows: list[dict[str, np.ndarray]]) -> None:
    for row in rows:
      for name, dtype in _ARRAYS.items():
        self.files[name].write(row[name].astype(dtype, copy=False).tobytes())
      self.rows += 1

  def copy_to(self, path: str, attrs: dict, vocab_size: int) -> None:
    for f in self.files.values():
      f.close()
    arrays = {name: np.memmap(os.path.join(self.directory, name), dtype=dtype, mode="r",
                              shape=(self.rows, self.seq_len)) for name, dtype in _ARRAYS.items()}
    store = cache.create(path, num_seqs=self.rows, seq_len=self.seq_len, k=0,
                         vocab_size=vocab_size, attrs=attrs)
    # Whole regions per write (the store's unit of crash safety); only those not yet written,
    # so an interrupted build resumes.
    with tqdm.tqdm(total=self.rows, desc=f"writing {path}", unit="row", disable=None) as bar:
      for lo, hi in store.missing():
        for start in range(lo, hi, store.region_rows):
          stop = min(hi, start + store.region_rows)
          store.write(start, {name: np.asarray(a[start:stop]) for name, a in arrays.items()})
          bar.update(stop - start)

  def remove(self) -> None:
    for f in self.files.values():
      f.close()
    shutil.rmtree(self.directory, ignore_errors=True)
