"""A store's attributes (the group's zarr.json): what they hold, their checksum and their checks.

The attributes say how to decode the arrays (k, vocab_size, layout, logprob_scale, prob_offset,
order_size, hidden_dim, dtypes) and what
the data is (teacher_hash, tokenizer_hash, source): an edit to one of them would change every read
without a sound. So at creation `attributes_sha256` is added, a sha256 of all the others, and
manifest/zarr.json keeps a sealed copy of them (all but the creation time) under
"store_attributes", to name what was changed.
cache.create, cache.open and verify refuse attributes that fail their checksum or cannot describe
a store, before reading or changing anything. Stores written before the checksum existed (neither
the key nor the copy) open with a warning; their decoding parameters are still checked.
"""
import hashlib
import json
import logging

from kdjax.cache import layout as layout_lib
from kdjax.cache.errors import CacheError

CHECKSUM = "attributes_sha256"
COPY = "store_attributes"  # key of the copy in manifest/zarr.json
_UNCHECKED_KEYS = ("created", CHECKSUM)  # differ between runs of the same spec
_POSITIVE = ("num_seqs", "seq_len", "vocab_size", "region_rows")


def checksum(attrs):
  body = {key: value for key, value in attrs.items() if key != CHECKSUM}
  return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def seal(attrs):
  return {**attrs, CHECKSUM: checksum(attrs)}


def copy(attrs):
  """What manifest/zarr.json keeps of `attrs`: all but the creation time (so that stores of the
  same spec have identical manifests), sealed."""
  return seal({key: value for key, value in attrs.items() if key not in _UNCHECKED_KEYS})


def spec(num_seqs, seq_len, k, vocab_size, attrs, layout_name, region_rows, hidden_dim=0):
  """The attributes of a new store (not sealed); CacheError if the arguments cannot make one."""
  hidden_dim = int(hidden_dim)
  if hidden_dim < 0 or (hidden_dim and not k):
    raise CacheError(f"hidden_dim = {hidden_dim} must be >= 0, and 0 in a store without teacher "
                     f"outputs (k = 0)")
  if not 0 <= k <= vocab_size:
    raise CacheError(f"k = {k} must lie in 0..vocab_size ({vocab_size}): a position cannot have "
                     f"more top-k entries than the vocabulary has tokens.")
  out = {"format_version": layout_lib.FORMAT_VERSION, "num_seqs": int(num_seqs),
         "seq_len": int(seq_len), "k": int(k), "vocab_size": int(vocab_size),
         "layout": layout_name, "region_rows": int(region_rows),
         "dtypes": layout_lib.array_dtypes(k, vocab_size, layout_name, hidden_dim)}
  if hidden_dim:  # absent when 0: stores written before hidden states keep their attributes
    out["hidden_dim"] = hidden_dim
  if k > 0:
    out.update(layout_lib.codec_params(layout_name))
    if layout_name == "dictionary":
      out["order_size"] = layout_lib.order_size(seq_len, vocab_size)
  clash = {key: (attrs[key], out[key]) for key in set(out) & set(attrs) if attrs[key] != out[key]}
  if clash:
    raise CacheError(f"attrs contradict the arguments (key: attrs vs arguments): {clash}")
  return {**attrs, **out}


def identity(attrs):
  """What a store holds (teacher, tokenizer, data, ...): its attributes less those spec() derives
  from its shape and layout and those of its creation."""
  derived = spec(attrs["num_seqs"], attrs["seq_len"], attrs["k"], attrs["vocab_size"], {},
                 attrs["layout"], attrs["region_rows"], attrs.get("hidden_dim", 0))
  return {key: value for key, value in attrs.items()
          if key not in derived and key not in _UNCHECKED_KEYS}


def differences(a, b):
  """{key: (a's, b's)} of the keys that differ, but for those that differ between runs."""
  keys = sorted((set(a) | set(b)) - set(_UNCHECKED_KEYS))
  return {key: (a.get(key), b.get(key)) for key in keys if a.get(key) != b.get(key)}


def check(path, attrs, manifest_attrs):
  """Raises CacheError unless `attrs` (of the store at `path`) are sealed and can describe it.

  manifest_attrs: the attributes of manifest/zarr.json ({} if there is none).
  """
  written = manifest_attrs.get(COPY)
  kept = (f" (manifest/zarr.json keeps them as written, under \"{COPY}\")"
          if written is not None else "")
  undo = (f"Nothing was read or changed. Undo the edit{kept}, or delete {path} and re-run the "
          f"stage that writes it.")
  if CHECKSUM in attrs or written is not None:
    if attrs.get(CHECKSUM) != checksum(attrs):
      intact = isinstance(written, dict) and written.get(CHECKSUM) == checksum(written)
      diff = differences(attrs, written) if intact else {}
      changed = f" (key: now vs as written: {diff})" if diff else ""
      raise CacheError(f"{path}/zarr.json: the store's attributes fail their checksum: they were "
                       f"changed after the store was written{changed}; read by them, the data "
                       f"could silently decode to other values or pass for another teacher's. "
                       f"{undo}")
  else:
    logging.warning("%s was written before stores had an attribute checksum: an edit to its "
                    "attributes (vocab_size, logprob_scale, hashes) cannot be detected. Rebuild it "
                    "to add one.", path)
  if problems := decoding_problems(attrs):
    raise CacheError(f"{path}/zarr.json: the attributes cannot describe this store: "
                     f"{'; '.join(problems)}. {undo}")


def decoding_problems(attrs):
  """What makes `attrs` unusable for decoding (types, ranges, dtypes, the compact step)."""
  problems = [f"{key} = {attrs.get(key)!r} is not a positive integer" for key in _POSITIVE
              if type(attrs.get(key)) is not int or attrs[key] < 1]
  k, layout_name = attrs.get("k"), attrs.get("layout")
  if type(k) is not int or k < 0:
    problems.append(f"k = {k!r} is not a non-negative integer")
  if layout_name not in layout_lib.LAYOUTS:
    problems.append(f"layout = {layout_name!r} is not one of {layout_lib.LAYOUTS}")
  if problems:
    return problems
  if k > attrs["vocab_size"]:
    problems.append(f"k = {k} exceeds vocab_size = {attrs['vocab_size']}")
  hidden_dim = attrs.get("hidden_dim", 0)
  if type(hidden_dim) is not int or hidden_dim < 0:
    return problems + [f"hidden_dim = {hidden_dim!r} is not a non-negative integer"]
  dtypes = layout_lib.array_dtypes(k, attrs["vocab_size"], layout_name, hidden_dim)
  if attrs.get("dtypes") != dtypes:
    problems.append(f"dtypes = {attrs.get('dtypes')} but k, vocab_size, layout and hidden_dim "
                    f"make {dtypes}")
  # Compact and packed log-probs are integer levels of these parameters: any other value changes
  # every log-prob.
  for key, value in (layout_lib.codec_params(layout_name) if k > 0 else {}).items():
    if attrs.get(key) != value:
      problems.append(f"{key} = {attrs.get(key)!r}, but {layout_name} stores are written with "
                      f"{key} = {value!r}")
  size = attrs.get("order_size")
  if layout_name == "dictionary" and k > 0:
    if type(size) is not int or not 0 < size <= attrs["vocab_size"]:
      problems.append(f"order_size = {size!r} is not an integer in 1..vocab_size")
  elif size is not None:
    problems.append(f"order_size = {size!r} in a {layout_name} store without an id order")
  return problems
