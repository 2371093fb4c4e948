"""Finding damaged regions of a store, and marking them for rewriting.

Three levels, cheapest first:
  records: every region record parses and matches its own crc32; every shard file it lists exists
           with the recorded size (catches deleted and truncated files; run by cache.open).
  files:   the crc32 of every shard file equals the recorded one (catches any flipped byte).
  decode:  every row decodes through tensorstore (crc32c of each chunk) and passes the value
           checks of store.read (NaN/Inf, ids in range).
A damaged region is reported by index and rows; `invalidate` deletes its record and shards, so the
writer's next run (which writes whatever store.missing() lists) rewrites exactly those regions.
"""
import dataclasses
import json
import os
import zlib

import numpy as np

from kdjax.cache.errors import CacheError


def file_crc32(path):
  crc = 0
  with open(path, "rb") as f:
    while block := f.read(1 << 24):
      crc = zlib.crc32(block, crc)
  return crc


@dataclasses.dataclass(frozen=True)
class Problem:
  region: int
  rows: tuple[int, int]
  what: str

  def __str__(self):
    return f"region {self.region} (rows {self.rows[0]}..{self.rows[1]}): {self.what}"


def load_record(store, region):
  """The region's record, or a string saying why it is unusable."""
  try:
    with open(store.region_record_path(region)) as f:
      record = json.load(f)
    body = {key: value for key, value in record.items() if key != "record_crc32"}
    if zlib.crc32(json.dumps(body, sort_keys=True).encode()) != record.get("record_crc32"):
      return "its manifest record fails its checksum"
    if (record["start"], record["stop"]) != store.region_bounds(region):
      return "its manifest record names other rows"
    return record
  except (OSError, ValueError, KeyError) as e:
    return f"its manifest record is unreadable ({e})"


def check_records(store, *, crc=False):
  """Problems of the complete regions' records and shard files; crc=True hashes every file."""
  problems = []
  for region in sorted(store.complete_regions()):
    record = load_record(store, region)
    rows = store.region_bounds(region)
    if isinstance(record, str):
      problems.append(Problem(region, rows, record))
      continue
    for name in store.dtypes:
      path = store.shard_path(name, region)
      want = record["files"].get(name)
      if want is None:
        problems.append(Problem(region, rows, f"{name}: not in its manifest record"))
      elif not os.path.exists(path):
        problems.append(Problem(region, rows, f"{name}: shard file {path} is missing"))
      elif os.path.getsize(path) != want["bytes"]:
        problems.append(Problem(region, rows, f"{name}: shard file {path} has "
                                f"{os.path.getsize(path)} bytes, {want['bytes']} were written"))
      elif crc and file_crc32(path) != want["crc32"]:
        problems.append(Problem(region, rows, f"{name}: shard file {path} fails its checksum"))
  return problems


def check_decode(store, regions):
  """Problems met decoding every row of `regions` (tensorstore chunk crc32c, value checks)."""
  problems = []
  for region in regions:
    start, stop = store.region_bounds(region)
    try:
      store.read(np.arange(start, stop))
    except CacheError as e:
      problems.append(Problem(region, (start, stop), str(e).split(". The store is corrupt")[0]))
  return problems


def verify(store, *, decode=True):
  """All problems of the complete regions, at every level."""
  problems = check_records(store, crc=True)
  if decode:
    bad = {p.region for p in problems}
    problems += check_decode(store, sorted(store.complete_regions() - bad))
  return sorted(problems, key=lambda p: p.region)


def invalidate(store, regions):
  """Deletes the records, then the shards, of `regions`: the writer's next run rewrites them."""
  for region in regions:
    if os.path.exists(store.region_record_path(region)):
      os.unlink(store.region_record_path(region))
    for name in store.dtypes:
      if os.path.exists(store.shard_path(name, region)):
        os.unlink(store.shard_path(name, region))
