"""A sequence store on disk: a zarr v3 group of row-sharded arrays plus a manifest of finished
regions.

Crash safety. Rows are grouped into regions of `region_rows` rows, one shard file per array per
region. A write (1) writes the region's shards through tensorstore, (2) fsyncs every shard file and
the folders holding them, (3) only then records the region in the manifest: a file
`manifest/rNNNNNNNN.json` written to a temporary name, fsynced, renamed, and the manifest folder
fsynced, holding the size and crc32 of every shard file. Guaranteed, on a filesystem that honours
fsync (local ext4/xfs; check your network filesystem's documentation):
  - a region recorded before a crash or a power loss is whole: its shards were durable before its
    record was written (and verify checks them against the record's crc32 anyway);
  - a region recorded when write() returns stays recorded;
  - a writer killed at any point leaves at worst shards without a record: the region counts as
    missing and is rewritten whole on resume, so a reader never accepts half a region.
Writers of disjoint regions share nothing but the directory; a second writer of the same rank is
refused by a lock (lock.py). Disk full is a CacheError that says to free space and re-run.

Writes that cover only part of a region record the rows they covered (`manifest/pSTART-STOP.json`,
written after their shards are durable too); the region record is written once those cover the
region. create() and open() (checking a store's attributes and completeness): opening.py.
"""
import concurrent.futures
import functools
import glob
import json
import os
import zlib

import numpy as np
import tensorstore as ts

from kdjax.cache import durable, events, integrity, layout as layout_lib, lock, values
from kdjax.cache.errors import CacheError

# Threads that check and encode the rows of a write, shared by every store and writer thread.
ENCODE_THREADS = max(1, min(8, os.cpu_count() or 1))


@functools.cache
def _encoder() -> concurrent.futures.ThreadPoolExecutor:
  return concurrent.futures.ThreadPoolExecutor(ENCODE_THREADS, thread_name_prefix="cache-encode")


class Store:
  """An opened store. Use create() or open() (opening.py); arrays are read and written through
  this object."""

  def __init__(self, path, attrs, create=False):
    self.path = os.fspath(path)
    self.attrs = attrs
    self.num_seqs = attrs["num_seqs"]
    self.seq_len = attrs["seq_len"]
    self.k = attrs["k"]
    self.read_k = self.k  # top-k entries read() returns: the first read_k (open(k=) sets it)
    self.vocab_size = attrs["vocab_size"]
    self.layout = attrs["layout"]
    self.region_rows = attrs["region_rows"]
    self.dtypes = attrs["dtypes"]
    # Compact and packed top-k only; checked by attributes.check.
    self._scale = attrs.get("logprob_scale")
    self._offset = attrs.get("prob_offset", 0.0)  # packed only
    self.hidden_dim = attrs.get("hidden_dim", 0)  # H of the teacher's hidden states; 0: none
    self.order_size = attrs.get("order_size", 0)  # dictionary only: M ids in each row's order
    self.num_regions = -(-self.num_seqs // self.region_rows)
    futures = {name: ts.open(self._ts_spec(name, create), create=create, open=True)
               for name in self.dtypes}
    self._arrays = {}
    for name, future in futures.items():
      try:
        self._arrays[name] = future.result()
      except ValueError as e:
        raise CacheError(f"{self.path}/{name}/zarr.json cannot be opened ({e}): the array's "
                         f"metadata was damaged or edited; restore it, or delete {self.path} and "
                         f"rebuild it.") from e
    if create:  # the arrays' metadata must be durable before any region is recorded
      durable.fsync_all(path for name in self.dtypes
                        for path in durable.tree(os.path.join(self.path, name, "zarr.json"),
                                                 self.path))
    for name, arr in self._arrays.items():
      if tuple(arr.shape) != self.shape(name) or arr.dtype.name != self.dtypes[name]:
        raise CacheError(f"{self.path}/{name} is {arr.dtype.name} {tuple(arr.shape)} but the "
                         f"store's attributes say {self.dtypes[name]} {self.shape(name)}: the "
                         f"store is damaged; delete it and rebuild.")

  def shape(self, name):
    if name == layout_lib.ORDER_ARRAY:
      return (self.num_seqs, self.order_size)
    last = {**dict.fromkeys(layout_lib.TOPK_ARRAYS, (self.k,)),
            layout_lib.HIDDEN_ARRAY: (self.hidden_dim,)}
    return (self.num_seqs, self.seq_len) + last.get(name, ())

  def _ts_spec(self, name, create):
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": os.path.join(self.path, name)}}
    # Existing arrays are opened with the metadata on disk, so stores stay readable (and
    # resumable) if the defaults of layout.py change.
    if create and not os.path.exists(os.path.join(self.path, name, "zarr.json")):
      spec["metadata"] = layout_lib.array_metadata(name, self.shape(name), self.dtypes[name],
                                                   self.region_rows, self.layout)
    return spec

  def require_hidden(self):
    """CacheError unless the store holds the teacher's hidden states."""
    if not self.hidden_dim:
      raise CacheError(f"{self.path} holds no teacher hidden states, which the hidden-state loss "
                       f"term (loss.hidden_weight > 0) needs: rebuild the cache with "
                       f"--config.cache.hidden_states=True (another cache.path), or set "
                       f"loss.hidden_weight=0.")

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

  def missing_regions(self):
    return sorted(set(range(self.num_regions)) - self.complete_regions())

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

  def writer_lock(self, rank):
    """Context manager held while this process writes the regions of `rank` (see lock.py)."""
    return lock.hold(self._lock_path(rank), f"writer of rank {rank}")

  def remove_stale_lock(self, rank):
    """The lock file of `rank` left by a dead writer is removed (lock.remove_if_stale)."""
    lock.remove_if_stale(self._lock_path(rank))

  def _lock_path(self, rank):
    return os.path.join(self.path, f"writer-rank{rank}.lock")

  def _uncovered(self, region, partial):
    """Runs of the region's rows that no partial record covers."""
    start, stop = self.region_bounds(region)
    covered = np.zeros(stop - start, bool)
    for a, b in partial:
      covered[max(a, start) - start:max(min(b, stop) - start, 0)] = True
    edges = np.flatnonzero(np.diff(np.concatenate([[1], covered.view(np.int8), [1]])))
    return [(start + int(a), start + int(b)) for a, b in zip(edges[::2], edges[1::2])]

  def _record_rows(self, start, stop):
    durable.write_json(os.path.join(self._manifest_dir(), f"p{start:012d}-{stop:012d}.json"),
                       {"start": start, "stop": stop})

  def _check_batch(self, start, batch):
    """The batch's arrays and shapes; their values are checked by _check_values."""
    expected = set(self.dtypes) - {layout_lib.ORDER_ARRAY}  # the encoding's own
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

  def _check_values(self, start, batch):
    n = len(batch["tokens"])
    rows = np.arange(start, start + n)
    where = f"{self.path}: rows {start}..{start + n}"
    values.check_ids(batch["tokens"], rows, self.vocab_size, f"{where}, tokens")
    if self.k > 0:
      values.check_ids(batch["topk_ids"], rows, self.vocab_size, f"{where}, topk_ids")
      values.check_logprobs(batch["topk_logprobs"], rows, where,
                            "Fix the teacher run that produced them; nothing was written.")
    if self.hidden_dim:
      values.check_hidden(batch["hidden"], rows, where,
                          "Fix the teacher run that produced them; nothing was written.")

  def _encode(self, start, batch):
    """Checks the values of rows start.. (CacheError: nothing written) and returns the arrays as
    stored."""
    self._check_values(start, batch)
    stored = dict(batch)
    if self.k > 0:
      stored["topk_ids"], stored["topk_logprobs"] = layout_lib.encode_topk(
          batch["topk_ids"], batch["topk_logprobs"], self.dtypes, self._scale, self._offset)
      if self.order_size:
        stored["topk_ids"], stored[layout_lib.ORDER_ARRAY] = layout_lib.dictionary_encode(
            stored["topk_ids"], self.vocab_size, self.order_size)
    if self.hidden_dim:
      stored["hidden"] = layout_lib.encode_hidden(batch["hidden"])
    return {name: arr.astype(self.dtypes[name], copy=False) for name, arr in stored.items()}

  def _encode_in_pieces(self, start, batch):
    """_encode over pieces of rows on the encoding threads (numpy releases the GIL), so a
    region's encoding takes several cores, as tensorstore's compression does: a teacher's last
    region is then written in a fraction of the time one thread would take."""
    n = len(batch["tokens"])
    if n == 1:
      return self._encode(start, batch)
    # Each piece lands in its rows of one array per name: no concatenation, so a region of
    # hidden states takes no second copy.
    stored = {name: np.empty((n,) + self.shape(name)[1:], self.dtypes[name])
              for name in self.dtypes}

    def encode(a, b):
      for name, arr in self._encode(start + a, {name: x[a:b] for name, x in batch.items()}).items():
        stored[name][a:b] = arr

    edges = np.linspace(0, n, min(n, ENCODE_THREADS) + 1).astype(int)
    list(_encoder().map(encode, edges[:-1], edges[1:]))  # raises the first piece's error
    return stored

  def write(self, start, batch):
    """Writes rows start..start+len(batch) and records every region they complete.

    The regions' shards are durable before any record is written (module docstring). Raises
    CacheError on bad values (nothing written) and on a full disk (nothing recorded).
    """
    batch = {name: np.asarray(arr) for name, arr in batch.items()}
    self._check_batch(start, batch)
    stop = start + len(batch["tokens"])
    stored = self._encode_in_pieces(start, batch)
    regions = range(start // self.region_rows, -(-stop // self.region_rows))
    events.reached("before_data")
    with durable.disk_full_is_a_cache_error(self.path):
      self._unrecord(start, stop, regions)
      futures = [self._arrays[name][start:stop].write(arr) for name, arr in stored.items()]
      for future in futures:
        future.result()
      events.reached("data")
      durable.fsync_all(path for region in regions for name in self.dtypes
                        for path in durable.tree(self.shard_path(name, region),
                                                 os.path.join(self.path, name)))
      events.reached("after_data")
      for region in regions:
        if self._uncovered(region, self._partial_rows() + [(start, stop)]):
          lo, hi = self.region_bounds(region)
          self._record_rows(max(lo, start), min(hi, stop))
        else:
          self._record_region(region)
          events.reached("after_record")

  def _unrecord(self, start, stop, regions):
    """Finished regions being overwritten read as unfinished until this write is durable."""
    done = self.complete_regions()
    for region in regions:
      if region in done:
        # Its rows outside the write stay valid.
        lo, hi = self.region_bounds(region)
        for a, b in ((lo, min(start, hi)), (max(stop, lo), hi)):
          if a < b:
            self._record_rows(a, b)
        os.unlink(self.region_record_path(region))
        durable.fsync_path(self._manifest_dir())

  def _record_region(self, region):
    start, stop = self.region_bounds(region)
    files = {}
    for name in self.dtypes:
      shard = self.shard_path(name, region)
      files[name] = {"bytes": os.path.getsize(shard), "crc32": integrity.file_crc32(shard)}
    record = {"region": region, "start": start, "stop": stop, "files": files}
    record["record_crc32"] = zlib.crc32(json.dumps(record, sort_keys=True).encode())
    durable.write_json(self.region_record_path(region), record)
    # Temporary records left by a writer killed before its rename: this writer owns the region.
    for stale in glob.glob(glob.escape(self.region_record_path(region)) + ".tmp*"):
      os.unlink(stale)
    for a, b in self._partial_rows():
      if start <= a and b <= stop:
        os.unlink(os.path.join(self._manifest_dir(), f"p{a:012d}-{b:012d}.json"))

  def read_array(self, name, rows: slice):
    """One array's rows as stored, without decoding or value checks (e.g. a data store's
    segment ids, to plan a pass over it); CacheError if the store is unreadable there."""
    try:
      return self._arrays[name][rows].read().result()
    except ValueError as e:  # tensorstore: checksum mismatch, truncated or unreadable shard
      raise CacheError(f"{self.path}: {name} rows {values.describe_rows(rows)}: {e}. Run "
                       f"`python -m kdjax.cache verify --fix {self.path}`.") from e

  def read(self, rows, hidden=True):
    """Decoded rows: {name: array [len(rows), T(, K or H)]}; ids int32, log-probs float32, hidden
    states bfloat16 (ml_dtypes).

    rows: a slice, or a sequence of row indices (any order, repeats allowed).
    hidden: also read the teacher's hidden states, if the store has them.
    """
    if not isinstance(rows, slice):
      rows = np.asarray(rows, np.int64)
      if rows.size and (rows.min() < 0 or rows.max() >= self.num_seqs):
        raise CacheError(f"{self.path}: rows must lie in 0..{self.num_seqs}")
    where = f"{self.path}: rows {values.describe_rows(rows)}"
    fix = (f"The store is corrupt: run `python -m kdjax.cache verify --fix {self.path}`, then "
           f"re-run the stage that wrote it to rewrite the bad regions.")
    futures = {name: arr[rows].read() for name, arr in self._arrays.items()
               if hidden or name != layout_lib.HIDDEN_ARRAY}
    try:
      out = {name: future.result() for name, future in futures.items()}
    except ValueError as e:  # tensorstore: checksum mismatch, truncated or unreadable shard
      raise CacheError(f"{where}: {e}. {fix}") from e
    out["tokens"] = out["tokens"].astype(np.int32)
    if isinstance(rows, slice):
      rows = np.arange(*rows.indices(self.num_seqs))
    if self.k > 0:
      # Stored ids and a dictionary's codes may lie past the vocabulary; ids decoded from
      # checked codes and a checked order cannot. Quantised log-probs decode to finite values
      # <= 0 whatever is stored, so only float32 ones are checked.
      if self.order_size:
        codes = out["topk_ids"][..., :self.read_k]
        order = out.pop(layout_lib.ORDER_ARRAY)
        values.check_ids(codes, rows, self.vocab_size, where, fix)
        values.check_order(order, rows, self.vocab_size, where, fix)
        out["topk_ids"] = layout_lib.dictionary_decode(codes, order, self.vocab_size)
      out["topk_ids"], out["topk_logprobs"] = layout_lib.decode_topk(
          out["topk_ids"], out["topk_logprobs"], self.dtypes, self._scale, self.read_k,
          self._offset)
      if not self.order_size:
        values.check_ids(out["topk_ids"], rows, self.vocab_size, where, fix)
      if self.dtypes["topk_logprobs"] == "float32":
        values.check_logprobs(out["topk_logprobs"], rows, where, fix)
    if "hidden" in out:
      out["hidden"] = layout_lib.decode_hidden(out["hidden"])
      values.check_hidden(out["hidden"], rows, where, fix)
    return out
