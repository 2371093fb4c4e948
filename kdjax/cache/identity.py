"""A teacher cache's identity: what it records of the teacher, the code and the rows that wrote it,
and whether a cache on disk already holds what the cache stage would write.
"""
import logging

from kdjax.cache import opening
from kdjax.cache.errors import CacheError


def revision_attrs(model_cfg) -> dict:
  """What a cache of this teacher records of the code that wrote it, where older code wrote other
  values: a teacher with attention sinks (gpt-oss) read other documents' log-normalisers at more
  than one row per call before commit b87bcf6 (docs/checkpoints_and_data.md, BENCHMARKS.md
  2026-12-05), so its caches say they were written since. Part of the cache's identity: an older
  one is not reused (the cache stage refuses a cache of the same teacher that lacks a key ending
  in _written_since)."""
  return {"sinks_written_since": "b87bcf6"} if model_cfg.attention_sinks else {}


def data_attrs(data_store) -> dict:
  """What a cache records of the rows it was written on (its attribute "data"): the data store's
  attributes but their creation time."""
  return {key: value for key, value in data_store.attrs.items() if key != "created"}


def holds_top_k(path: str, k: int, layout: str, attrs: dict, hidden_dim: int,
                data_store) -> bool:
  """Whether a complete cache at `path` of this teacher (attrs: the cache stage's) on these rows
  holds at least k entries per position (more serve k: cache.open reads the first k), in any layout
  (one written earlier with another cache.layout, or by `python -m kdjax.cache recode`): no need
  to write one. Raises CacheError for a cache of this teacher that older code wrote wrong."""
  refuse_stale(path, attrs)
  try:
    store = opening.open(path, k=k)
  except CacheError:
    return False  # none, incomplete or otherwise unfit: write_cache resumes it or says why
  if not (store.attrs.get("teacher_hash") == attrs["teacher_hash"]
          and store.attrs.get("data") == data_attrs(data_store)
          and (store.hidden_dim == hidden_dim or not hidden_dim)):
    return False
  if store.k > k or store.layout != layout:
    logging.info("cache: %s holds this teacher's top %d of these rows in the %s layout; read as "
                 "its top %d", path, store.k, store.layout, k)
  return True


def refuse_stale(path: str, attrs: dict):
  """CacheError if `path` holds a cache, finished or not, of the teacher of `attrs` that lacks one
  of its revision attributes (revision_attrs): written by older code, wrong in places."""
  try:
    store = opening.open(path, allow_partial=True)
  except CacheError:
    return  # none or unreadable: write_cache says why
  if store.attrs.get("teacher_hash") != attrs["teacher_hash"]:
    return
  for key, value in attrs.items():
    if key.endswith("_written_since") and store.attrs.get(key) != value:
      raise CacheError(
          f"{path} holds this teacher's cache written before commit {value}: a teacher with "
          f"attention sinks (gpt-oss) then read other documents' statistics at more than one row "
          f"per teacher call (cache.batch_size > 1), so its top-k may be wrong. Delete {path} and "
          f"run the cache stage again.")
