"""A sequence store on disk: a zarr v3 group of row-sharded arrays plus a manifest of finished regions.

Crash safety. Rows are grouped into regions of `region_rows` rows, one shard file per array per
region. A write (1) writes the region's shards, (2) only then records the region in the manifest: a
file `manifest/rNNNNNNNN.json` written to a temporary name, fsynced and renamed, holding the size and
crc32 of every shard file. A killed writer leaves at worst shards without a record; such a region
counts as missing and is rewritten whole on resume, so a reader never accepts half a region.
Writers of disjoint regions share nothing but the directory (parallel ranks need no coordination).

Writes that cover only part of a region record the rows they covered (`manifest/pSTART-STOP.json`);
the region record is written once those cover the region.
"""
import builtins
import datetime
import glob
import json
import os
import zlib

import numpy as np
import tensorstore as ts

from kdjax.cache import integrity
from kdjax.cache import layout as layout_lib
from kdjax.cache.errors import CacheError


_UNCHECKED_KEYS = ("created",)  # differs between runs of the same spec


def _default_region_rows(num_seqs, seq_len):
  # About 256K positions per region: a few tens of MB per shard at k = 100, so a lost region
  # costs seconds of teacher time and the manifest stays small for billions of positions.
  return int(max(1, min(num_seqs, 2**18 // seq_len)))


def _write_json_atomic(path, obj, *, exclusive=False):
  """Writes JSON so that readers see the whole file or nothing. exclusive: fail if it exists."""
  tmp = f"{path}.tmp{os.getpid()}"
  with builtins.open(tmp, "w") as f:
    json.dump(obj, f, indent=1, sort_keys=True)
    f.flush()
    os.fsync(f.fileno())
  try:
    if exclusive:
      os.link(tmp, path)  # atomic create-if-absent, even across hosts on a shared filesystem
    else:
      os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)


def _read_json(path):
  with builtins.open(path) as f:
    return json.load(f)


class Store:
  """An opened store. Use create() or open(); arrays are read and written through this object."""

  def __init__(self, path, attrs, create=False):
    self.path = os.fspath(path)
    self.attrs = attrs
    self.num_seqs = attrs["num_seqs"]
    self.seq_len = attrs["seq_len"]
    self.k = attrs["k"]
    self.vocab_size = attrs["vocab_size"]
    self.layout = attrs["layout"]
    self.region_rows = attrs["region_rows"]
    self.dtypes = attrs["dtypes"]
    self._scale = attrs.get("logprob_scale", layout_lib.LOGPROB_SCALE)
    self.num_regions = -(-self.num_seqs // self.region_rows)
    futures = {name: ts.open(self._ts_spec(name, create), create=create, open=True)
               for name in self.dtypes}
    self._arrays = {name: future.result() for name, future in futures.items()}
    for name, arr in self._arrays.items():
      if tuple(arr.shape) != self.shape(name) or arr.dtype.name != self.dtypes[name]:
        raise CacheError(f"{self.path}/{name} is {arr.dtype.name} {tuple(arr.shape)} but the store's "
                         f"attributes say {self.dtypes[name]} {self.shape(name)}: the store is "
                         f"damaged; delete it and rebuild.")

  def shape(self, name):
    return (self.num_seqs, self.seq_len) + ((self.k,) if name in layout_lib.TOPK_ARRAYS else ())

  def _ts_spec(self, name, create):
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": os.path.join(self.path, name)}}
    # Existing arrays are opened with the metadata on disk, so stores stay readable (and
    # resumable) if the defaults of layout.py change.
    if create and not os.path.exists(os.path.join(self.path, name, "zarr.json")):
      spec["metadata"] = layout_lib.array_metadata(name, self.shape(name), self.dtypes[name],
                                                   self.region_rows)
    return spec

  def region_bounds(self, region):
    return region * self.region_rows, min((region + 1) * self.region_rows, self.num_seqs)

  def shard_path(self, name, region):
    zeros = ["0"] * (len(self.shape(name)) - 1)
    return os.path.join(self.path, name, "c", str(region), *zeros)

  def _manifest_dir(self):
    return os.path.join(self.path, "manifest")

  def region_record_path(self, region):
    return os.path.join(self._manifest_dir(), f"r{region:08d}.json")

  def _manifest_names(self):
    return [n for n in os.listdir(self._manifest_dir()) if n.endswith(".json") and n != "zarr.json"]

  def complete_regions(self):
    return {int(n[1:-5]) for n in self._manifest_names() if n.startswith("r")}

  def _partial_rows(self):
    ranges = []
    for n in self._manifest_names():
      if n.startswith("p"):
        start, stop = n[1:-5].split("-")
        ranges.append((int(start), int(stop)))
    return ranges

  def missing(self, rank=0, world=1):
    """[(start, stop)] row ranges not yet durably written, of the regions assigned to `rank`.

    Region r belongs to rank r % world, so ranks split the work with no coordination and a
    restarted rank finds exactly its unfinished regions.
    """
    done = self.complete_regions()
    partial = self._partial_rows()
    # (A region with no record whose rows are all covered cannot arise from write(); should one
    # exist, it is rewritten whole.)
    return [run for region in range(rank, self.num_regions, world) if region not in done
            for run in self._uncovered(region, partial) or [self.region_bounds(region)]]

  def _uncovered(self, region, partial):
    """Runs of the region's rows that no partial record covers."""
    start, stop = self.region_bounds(region)
    covered = np.zeros(stop - start, bool)
    for a, b in partial:
      covered[max(a, start) - start:max(min(b, stop) - start, 0)] = True
    edges = np.flatnonzero(np.diff(np.concatenate([[1], covered.view(np.int8), [1]])))
    return [(start + int(a), start + int(b)) for a, b in zip(edges[::2], edges[1::2])]

  def _record_rows(self, start, stop):
    _write_json_atomic(os.path.join(self._manifest_dir(), f"p{start:012d}-{stop:012d}.json"),
                       {"start": start, "stop": stop})

  def _check_batch(self, start, batch):
    expected = set(self.dtypes)
    if set(batch) != expected:
      raise CacheError(f"{self.path}: write needs exactly the arrays {sorted(expected)}, got "
                       f"{sorted(batch)}")
    n = len(batch["tokens"])
    if n == 0 or start < 0 or start + n > self.num_seqs:
      raise CacheError(f"{self.path}: rows {start}..{start + n} are outside 0..{self.num_seqs}")
    for name, arr in batch.items():
      if arr.shape != (n,) + self.shape(name)[1:]:
        raise CacheError(f"{self.path}: {name} has shape {arr.shape}, expected "
                         f"{(n,) + self.shape(name)[1:]}")
    _check_ids(batch["tokens"], self.vocab_size, f"{self.path}: tokens of rows {start}..{start + n}")
    if self.k > 0:
      _check_ids(batch["topk_ids"], self.vocab_size,
                 f"{self.path}: topk_ids of rows {start}..{start + n}")
      _check_logprobs(batch["topk_logprobs"], f"{self.path}: rows {start}..{start + n}",
                      "Fix the teacher run that produced them; nothing was written.")

  def write(self, start, batch):
    """Writes rows start..start+len(batch) and records every region they complete."""
    batch = {name: np.asarray(arr) for name, arr in batch.items()}
    self._check_batch(start, batch)
    stop = start + len(batch["tokens"])
    stored = dict(batch)
    if self.k > 0:
      stored["topk_ids"], stored["topk_logprobs"] = layout_lib.encode_topk(
          batch["topk_ids"], batch["topk_logprobs"], self.dtypes, self._scale)
    regions = range(start // self.region_rows, -(-stop // self.region_rows))
    done = self.complete_regions()
    for region in regions:
      if region in done:
        # Overwriting a finished region: it must read as unfinished until this write is durable;
        # its rows outside the write stay valid.
        lo, hi = self.region_bounds(region)
        for a, b in ((lo, min(start, hi)), (max(stop, lo), hi)):
          if a < b:
            self._record_rows(a, b)
        os.unlink(self.region_record_path(region))
    futures = [self._arrays[name][start:stop].write(arr.astype(self.dtypes[name]))
               for name, arr in stored.items()]
    for future in futures:
      future.result()
    for region in regions:
      if self._uncovered(region, self._partial_rows() + [(start, stop)]):
        lo, hi = self.region_bounds(region)
        self._record_rows(max(lo, start), min(hi, stop))
      else:
        self._record_region(region)

  def _record_region(self, region):
    start, stop = self.region_bounds(region)
    files = {}
    for name in self.dtypes:
      shard = self.shard_path(name, region)
      files[name] = {"bytes": os.path.getsize(shard), "crc32": integrity.file_crc32(shard)}
    record = {"region": region, "start": start, "stop": stop, "files": files}
    record["record_crc32"] = zlib.crc32(json.dumps(record, sort_keys=True).encode())
    _write_json_atomic(self.region_record_path(region), record)
    # Temporary records left by a writer killed before its rename: this writer owns the region.
    for stale in glob.glob(glob.escape(self.region_record_path(region)) + ".tmp*"):
      os.unlink(stale)
    for a, b in self._partial_rows():
      if start <= a and b <= stop:
        os.unlink(os.path.join(self._manifest_dir(), f"p{a:012d}-{b:012d}.json"))

  def read(self, rows):
    """Decoded rows: {name: array [len(rows), T(, K)]}; ids int32, log-probs float32.

    rows: a slice, or a sequence of row indices (any order, repeats allowed).
    """
    if not isinstance(rows, slice):
      rows = np.asarray(rows, np.int64)
      if rows.size and (rows.min() < 0 or rows.max() >= self.num_seqs):
        raise CacheError(f"{self.path}: rows must lie in 0..{self.num_seqs}")
    where = f"{self.path}: rows {_describe_rows(rows)}"
    fix = (f"The store is corrupt: run `python -m kdjax.cache verify --fix {self.path}`, then "
           f"re-run the stage that wrote it to rewrite the bad regions.")
    futures = {name: arr[rows].read() for name, arr in self._arrays.items()}
    try:
      out = {name: future.result() for name, future in futures.items()}
    except ValueError as e:  # tensorstore: checksum mismatch, truncated or unreadable shard
      raise CacheError(f"{where}: {e}. {fix}") from e
    out["tokens"] = out["tokens"].astype(np.int32)
    if self.k > 0:
      out["topk_ids"], out["topk_logprobs"] = layout_lib.decode_topk(
          out["topk_ids"], out["topk_logprobs"], self.dtypes, self._scale)
      _check_ids(out["topk_ids"], self.vocab_size, where, fix)
      _check_logprobs(out["topk_logprobs"], where, fix)
    return out


def _describe_rows(rows):
  if isinstance(rows, slice):
    return f"{rows.start}..{rows.stop}"
  rows = np.asarray(rows)
  return f"{rows[:8].tolist()}{'...' if rows.size > 8 else ''}"


def _check_ids(ids, vocab_size, where, fix="Check the tokenizer and vocab_size; nothing was written."):
  if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
    raise CacheError(f"{where}: ids must lie in [0, {vocab_size}), found {ids.min()}..{ids.max()}. "
                     f"{fix}")


def _check_logprobs(logprobs, where, fix):
  bad = ~np.isfinite(logprobs)
  if bad.any():
    row = np.argwhere(bad)[0]
    raise CacheError(f"{where}: {bad.sum()} NaN/Inf teacher log-probs (first at index "
                     f"{row.tolist()}). {fix}")
  if logprobs.size and logprobs.max() > 0:
    raise CacheError(f"{where}: log-probs must be <= 0, found {logprobs.max()}. {fix}")


def _spec(num_seqs, seq_len, k, vocab_size, attrs, layout_name, region_rows):
  spec = {"format_version": layout_lib.FORMAT_VERSION, "num_seqs": int(num_seqs),
          "seq_len": int(seq_len), "k": int(k), "vocab_size": int(vocab_size),
          "layout": layout_name, "region_rows": int(region_rows),
          "dtypes": layout_lib.array_dtypes(k, vocab_size, layout_name)}
  if k > 0 and layout_name == "compact":
    spec["logprob_scale"] = layout_lib.LOGPROB_SCALE
  clash = {key: (attrs[key], spec[key]) for key in set(spec) & set(attrs) if attrs[key] != spec[key]}
  if clash:
    raise CacheError(f"attrs contradict the arguments (key: attrs vs arguments): {clash}")
  return {**attrs, **spec}


def _differences(a, b):
  keys = sorted((set(a) | set(b)) - set(_UNCHECKED_KEYS))
  return {key: (a.get(key), b.get(key)) for key in keys if a.get(key) != b.get(key)}


def _write_group(path, attrs):
  os.makedirs(path, exist_ok=True)
  try:
    _write_json_atomic(os.path.join(path, "zarr.json"),
                       {"zarr_format": 3, "node_type": "group", "attributes": attrs}, exclusive=True)
  except FileExistsError:
    pass


def create(path, *, num_seqs, seq_len, k, vocab_size, attrs, layout="float32", region_rows=None):
  """Creates a store, or resumes an existing one with the same spec.

  Args:
    path: directory of the store.
    num_seqs, seq_len: rows and positions per row.
    k: top-k entries per position; 0 for tokenised data without teacher outputs.
    vocab_size: ids must lie in [0, vocab_size).
    attrs: JSON-serialisable identity of the contents (teacher hash, tokenizer hash, data
      source); resuming with different attrs is refused.
    layout: "float32" (reference) or "compact" (see layout.py).
    region_rows: rows per region (the unit of writing and crash safety); default ~256K positions.
  Raises:
    CacheError: the path holds a store with a different spec.
  """
  path = os.fspath(path)
  region_rows = region_rows or _default_region_rows(num_seqs, seq_len)
  spec = _spec(num_seqs, seq_len, k, vocab_size, dict(attrs), layout, region_rows)
  created = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
  _write_group(path, {**spec, "created": created})
  existing = _read_json(os.path.join(path, "zarr.json"))["attributes"]
  if diff := _differences(existing, spec):
    raise CacheError(f"{path} already holds a store with a different spec "
                     f"(key: stored vs requested): {diff}. Resume with the original parameters, "
                     f"or delete {path} to start over.")
  _write_group(os.path.join(path, "manifest"), {"description": "records of completed regions"})
  return Store(path, existing, create=True)


def open(path, *, vocab_size=None, k=None, seq_len=None, tokenizer_hash=None, allow_partial=False):
  """Opens a store for reading after checking it matches what the caller expects.

  Args:
    path: directory of the store.
    vocab_size, k, seq_len, tokenizer_hash: expected values; None skips the check.
    allow_partial: accept a store whose writer has not finished, and skip the check of the
      finished regions' files (to inspect or repair it).
  Raises:
    CacheError: no store, a mismatch, or missing regions; the message says what to do.
  """
  path = os.fspath(path)
  meta = os.path.join(path, "zarr.json")
  if not os.path.exists(meta):
    raise CacheError(f"no store at {path}: build it first (the data / teacher stage writes it).")
  attrs = _read_json(meta)["attributes"]
  if attrs.get("format_version") != layout_lib.FORMAT_VERSION:
    raise CacheError(f"{path} has format version {attrs.get('format_version')}, this code reads "
                     f"{layout_lib.FORMAT_VERSION}: rebuild the store.")
  expected = {"vocab_size": vocab_size, "k": k, "seq_len": seq_len, "tokenizer_hash": tokenizer_hash}
  for key, want in expected.items():
    if want is not None and attrs.get(key) != want:
      raise CacheError(f"{path} was built with {key}={attrs.get(key)!r} but {want!r} is expected: "
                       f"rebuild the store for this model/tokenizer, or point to the matching "
                       f"one.")
  store = Store(path, attrs)
  if not allow_partial:
    missing = store.num_regions - len(store.complete_regions())
    if missing:
      raise CacheError(f"{path} is incomplete: {missing} of {store.num_regions} regions are not "
                       f"written. Re-run the stage that writes it (the same command resumes "
                       f"where it stopped), or open with allow_partial=True to inspect it.")
    # Cheap (file sizes, no reading): a deleted or truncated shard would otherwise read as zeros.
    if problems := integrity.check_records(store):
      raise CacheError(f"{path} is damaged: {len(problems)} problems, first: {problems[0]}. Run "
                       f"`python -m kdjax.cache verify --fix {path}`, then re-run the stage that "
                       f"wrote it to rewrite the damaged regions.")
  return store
