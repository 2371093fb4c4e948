"""Document sources: streaming generators of `Document`s, never a whole dataset in memory.

`documents(source, ...)` reads "stdlib" (the Python standard library's own .py files, the demo
corpus present on every machine) or .jsonl / .parquet files whose records hold plain text, chat
turns or token ids. Chat turns are rendered with the tokenizer's chat template
(kdjax/data/chat.py). A record with an `input_ids` field (IDS_FIELD: a list of ints) is
pre-tokenised: its ids are packed exactly as given, no bos/eos added, and an optional `loss_mask`
field (TARGETS_FIELD: one 0/1 per id) says which ids are training targets (default: all).
"""
import collections
import dataclasses
import glob
import json
import os
import sysconfig
from collections.abc import Iterator

import numpy as np
import pyarrow.parquet as pq
import tqdm

from kdjax import choices
from kdjax.data import chat
from kdjax.errors import UserError

# Directories of the standard library that are not library code (tests, the IDLE app, installed
# third-party packages) or are mostly data (codec tables, pydoc's help text).
_STDLIB_SKIP = frozenset({"test", "tests", "idle_test", "idlelib", "site-packages", "dist-packages",
                          "__pycache__", "turtledemo", "ensurepip", "lib2to3", "encodings",
                          "pydoc_data"})
_PARQUET_BATCH = 256
LOSS_MASKS = choices.LOSS_MASKS  # which tokens are targets: all, or assistant turns only
IDS_FIELD, TARGETS_FIELD = "input_ids", "loss_mask"  # a pre-tokenised record's fields
TOKEN_BYTES = 4  # what one id of a pre-tokenised record counts toward max_bytes


class DataError(UserError):
  """A source cannot be read as asked; the message names the file and document."""


@dataclasses.dataclass(frozen=True)
class Document:
  """One document.

  `spans` are the [start, end) character ranges whose tokens are training targets; None means
  the whole text (loss_mask="all"). `templated` documents come from a chat template, which
  writes its own special tokens, so packing adds no bos/eos to them. A pre-tokenised document
  has no text: `ids` [n] int32 and `targets` [n] bool, packed as they are.
  """
  text: str
  spans: tuple[tuple[int, int], ...] | None = None
  templated: bool = False
  ids: np.ndarray | None = None
  targets: np.ndarray | None = None

  @property
  def size(self) -> int:
    """What the document counts toward max_bytes: its UTF-8 bytes, TOKEN_BYTES an id."""
    return TOKEN_BYTES * len(self.ids) if self.ids is not None else len(self.text.encode("utf-8"))

  @property
  def empty(self) -> bool:
    return len(self.ids) == 0 if self.ids is not None else not self.text.strip()


def documents(source: str, *, text_field: str = "text", messages_field: str = "messages",
              chat_template: str | None = None, bos_token: str | None = None,
              eos_token: str | None = None, loss_mask: str = "all", max_bytes: int = 0,
              counts: collections.Counter | None = None) -> Iterator[Document]:
  """Yields the documents of `source` in a fixed order.

  Args:
    source: "stdlib", or .jsonl / .parquet paths (comma separated; globs allowed, sorted).
    text_field: record field holding plain text.
    messages_field: record field holding chat turns [{role, content}, ...]; a record that has it
      is rendered with `chat_template`, otherwise `text_field` is read.
    chat_template: jinja2 template of a HF tokenizer_config.json; needed for chat records.
    bos_token, eos_token: the template's `bos_token` / `eos_token` variables.
    loss_mask: "all", or "assistant": only the assistant turns of chat records are targets
      (plain-text records then count whole).
    max_bytes: stop after the document that reaches this many UTF-8 bytes; 0 = no cap.
    counts: optional Counter, updated with "docs", "bytes", "empty" (skipped empty documents)
      and "undecodable" (stdlib files that are not UTF-8).
  """
  if loss_mask not in LOSS_MASKS:
    raise DataError(f"loss_mask must be one of {LOSS_MASKS}, got {loss_mask!r}")
  counts = collections.Counter() if counts is None else counts
  if source == "stdlib":
    stream = _stdlib_texts(counts)
  else:
    renderer = chat.Renderer(chat_template, bos_token=bos_token, eos_token=eos_token,
                             assistant_only=loss_mask == "assistant") if chat_template else None
    stream = _record_documents(source_paths(source), text_field, messages_field, renderer, counts)
  with tqdm.tqdm(desc=f"reading {source}", unit="B", unit_scale=True,
                 total=max_bytes or None, disable=None) as bar:
    for doc in stream:
      if isinstance(doc, str):
        doc = Document(doc)
      if doc.empty:
        counts["empty"] += 1
        continue
      size = doc.size
      counts["docs"] += 1
      counts["bytes"] += size
      bar.update(size)
      yield doc
      if max_bytes and counts["bytes"] >= max_bytes:
        return


def source_paths(source: str, field: str = "data.source") -> list[str]:
  """The files named by `source`: comma-separated paths or globs, each glob sorted. field: the
  config field naming them, for the errors."""
  paths = []
  for part in (p.strip() for p in source.split(",") if p.strip()):
    matches = sorted(glob.glob(part)) if glob.has_magic(part) else [part]
    if not matches:
      raise DataError(f"{part} ({field}): no file matches")
    for path in matches:
      if not os.path.exists(path):
        takes = "'stdlib' or " if field == "data.source" else ""
        raise DataError(f"{path}: no such file ({field} takes {takes}.jsonl/.parquet)")
      if not path.endswith((".jsonl", ".parquet")):
        raise DataError(f"{path} ({field}): unknown format; use .jsonl or .parquet")
      paths.append(path)
  if not paths:
    raise DataError(f"{field} {source!r} names no file")
  return paths


def chat_file(source: str, messages_field: str, field: str = "data.source") -> str | None:
  """The first file of `source` whose first record is a chat record (a parquet file: that has
  the column), or None; for checks before the data stage, which reads every record."""
  if source == "stdlib":
    return None
  for path in source_paths(source, field):
    if path.endswith(".parquet"):
      if messages_field in pq.ParquetFile(path).schema_arrow.names:
        return path
      continue
    try:
      _, record = next(_jsonl_records(path), (None, None))
    except DataError:  # the data stage names it with its line
      continue
    if isinstance(record, dict) and record.get(messages_field) is not None:
      return path
  return None


def stdlib_files() -> list[str]:
  """The standard library's .py files, sorted by relative path so every machine agrees."""
  root = sysconfig.get_paths()["stdlib"]
  files = []
  for dirpath, dirnames, filenames in os.walk(root):
    # config-3.12-<platform> holds the build's python-config script.
    dirnames[:] = sorted(d for d in dirnames
                         if d not in _STDLIB_SKIP and not d.startswith("config-"))
    files.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
  return sorted(files, key=lambda f: os.path.relpath(f, root))


def _stdlib_texts(counts: collections.Counter) -> Iterator[str]:
  for path in stdlib_files():
    with open(path, "rb") as f:
      data = f.read()
    try:
      yield data.decode("utf-8")
    except UnicodeDecodeError:  # a few files declare latin-1; skipped, not guessed
      counts["undecodable"] += 1


def _record_documents(paths, text_field, messages_field, renderer, counts) -> Iterator[Document]:
  index = 0  # document index over all files, as error messages report it
  for path in paths:
    records = _jsonl_records(path) if path.endswith(".jsonl") else _parquet_records(
        path, text_field, messages_field)
    for where, record in records:
      yield _record_document(record, f"{path}: {where} (document {index})", text_field,
                             messages_field, renderer)
      index += 1


def _record_document(record, where, text_field, messages_field, renderer) -> Document:
  if not isinstance(record, dict):
    raise DataError(f"{where}: expected an object with a {text_field!r} field, got "
                    f"{type(record).__name__}")
  messages = record.get(messages_field)
  if messages is not None:
    if renderer is None:
      raise DataError(f"{where}: chat record ({messages_field!r}) but the tokenizer has no chat "
                      "template; use a tokenizer dir with one (chat_template.jinja, or "
                      "tokenizer_config.json's chat_template)")
    if not messages:
      return Document("")
    try:
      text, spans = renderer.render(messages)
    except chat.ChatTemplateError as e:
      raise DataError(f"{where}: {e}") from e
    return Document(text, spans, templated=True)
  if record.get(IDS_FIELD) is not None:
    return _ids_document(record, where)
  if text_field not in record:
    raise DataError(f"{where}: missing field {text_field!r} (and no {messages_field!r}); "
                    f"fields are {sorted(record)}; set data.text_field / data.messages_field")
  text = record[text_field]
  if text is None:
    return Document("")
  if not isinstance(text, str):
    raise DataError(f"{where}: field {text_field!r} is {type(text).__name__}, not a string")
  return Document(text)


def _ids_document(record: dict, where: str) -> Document:
  """A pre-tokenised record: its ids and which of them are targets, checked."""
  ids = record[IDS_FIELD]
  if not isinstance(ids, list) or not all(type(i) is int for i in ids):
    raise DataError(f"{where}: field {IDS_FIELD!r} must be a list of ints (token ids)")
  ids_N = np.asarray(ids, np.int64)
  if ids_N.size and not 0 <= ids_N.min() <= ids_N.max() < np.iinfo(np.int32).max:
    raise DataError(f"{where}: field {IDS_FIELD!r} holds ids from {ids_N.min()} to "
                    f"{ids_N.max()}; token ids are >= 0 and below the vocabulary's size")
  mask = record.get(TARGETS_FIELD)
  if mask is None:
    targets_N = np.ones(ids_N.shape, np.bool_)
  elif (not isinstance(mask, list) or len(mask) != len(ids)
        or not all(m in (0, 1) for m in mask)):
    raise DataError(f"{where}: field {TARGETS_FIELD!r} must be a list of 0/1, one per id of "
                    f"{IDS_FIELD!r} ({len(ids)})")
  else:
    targets_N = np.asarray(mask, np.bool_)
  return Document("", ids=ids_N.astype(np.int32), targets=targets_N)


def _jsonl_records(path) -> Iterator[tuple[str, object]]:
  # Read as bytes so that a decoding error can name its line and byte offset.
  offset = 0  # of the line's first byte in the file
  with open(path, "rb") as f:
    for lineno, raw in enumerate(f, 1):
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise DataError(f"{path}: line {lineno}: byte offset {offset + e.start} is not UTF-8 "
                        f"({e.reason}); .jsonl files must be UTF-8 encoded") from e
      offset += len(raw)
      if not line.strip():
        continue
      try:
        yield f"line {lineno}", json.loads(line)
      except json.JSONDecodeError as e:
        raise DataError(f"{path}: line {lineno}: invalid JSON: {e}") from e


def _parquet_records(path, text_field, messages_field) -> Iterator[tuple[str, object]]:
  file = pq.ParquetFile(path)
  names = file.schema_arrow.names
  columns = [c for c in (text_field, messages_field, IDS_FIELD, TARGETS_FIELD) if c in names]
  if not set(columns) - {TARGETS_FIELD}:
    raise DataError(f"{path}: no column {text_field!r}, {messages_field!r} or {IDS_FIELD!r}; "
                    f"columns are {names}; set data.text_field / data.messages_field")
  row = 0
  for batch in file.iter_batches(batch_size=_PARQUET_BATCH, columns=columns):
    for record in batch.to_pylist():
      yield f"row {row}", record
      row += 1
