"""Finding damaged regions of a store, and marking them for rewriting.

Three levels, cheapest first:
  records: every region record parses and matches its own crc32; every shard file it lists exists
           with the recorded size (catches deleted and truncated files; run by cache.open).
  files:   the crc32 of every shard file equals the recorded one (catches any flipped byte).
  decode:  every row decodes through tensorstore (crc32c of each chunk) and passes the value
           checks of store.read (NaN/Inf, ids in range).
A region is *damaged* when its own files fail their own checksums (a record that fails its crc32,
a shard missing, truncated or failing the crc32 recorded when it was written): rewriting the
region repairs it, and `invalidate` deletes its record and shards so the writer's next run (which
writes whatever store.missing() lists) rewrites exactly those regions. A region whose files are
byte for byte as written but fail to decode or fail the value checks is not damaged data: the
store's metadata (or its writer) is wrong, rewriting would not help, and nothing deletes it.
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
  damaged: bool = True  # its own files fail their own checksums: rewriting the region repairs it

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
    if not isinstance(record.get("files"), dict) or not {"start", "stop"} <= record.keys():
      return "its manifest record lacks start, stop or files"
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
    if (record["start"], record["stop"]) != rows:  # intact, so the attributes disagree with it
      problems.append(Problem(region, rows, f"its intact manifest record holds rows "
                              f"{record['start']}..{record['stop']}", damaged=False))
      continue
    for name in store.dtypes:
      path = store.shard_path(name, region)
      want = record["files"].get(name)
      if want is None:
        problems.append(Problem(region, rows, f"{name}: not in its intact manifest record",
                                damaged=False))
      elif not os.path.exists(path):
        problems.append(Problem(region, rows, f"{name}: shard file {path} is missing"))
      elif os.path.getsize(path) != want["bytes"]:
        problems.append(Problem(region, rows, f"{name}: shard file {path} has "
                                f"{os.path.getsize(path)} bytes, {want['bytes']} were written"))
      elif crc and file_crc32(path) != want["crc32"]:
        problems.append(Problem(region, rows, f"{name}: shard file {path} fails its checksum"))
  return problems


def check_decode(store, regions):
  """Problems met decoding every row of `regions` whose files passed their checksums.

  Those files are as written, so these problems are not damaged data (damaged=False).
  """
  problems = []
  for region in regions:
    start, stop = store.region_bounds(region)
    try:
      store.read(np.arange(start, stop))
    except CacheError as e:
      what = str(e).split(". The store is corrupt")[0]
      problems.append(Problem(region, (start, stop), f"its files are as written, yet: {what}",
                              damaged=False))
  return problems


def verify(store, *, decode=True):
  """All problems of the complete regions, at every level."""
  problems = check_records(store, crc=True)
  if decode:
    bad = {p.region for p in problems}
    problems += check_decode(store, sorted(store.complete_regions() - bad))
  return sorted(problems, key=lambda p: p.region)


def describe_regions(store, regions):
  """Sorted regions as runs, with their rows: "regions 0, 3-5 (rows 0..4, 12..24)"."""
  runs = []
  for region in regions:
    if runs and runs[-1][1] == region - 1:
      runs[-1][1] = region
    else:
      runs.append([region, region])
  shown = runs[:6]
  text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in shown)
  rows = ", ".join(f"{store.region_bounds(a)[0]}..{store.region_bounds(b)[1]}" for a, b in shown)
  more = f" and {len(runs) - len(shown)} more runs" if len(runs) > len(shown) else ""
  return f"region{'s' if len(regions) > 1 else ''} {text}{more} (rows {rows})"


def invalidate(store, regions):
  """Deletes the records, then the shards, of `regions`: the writer's next run rewrites them.

  Only for damaged regions (Problem.damaged): their files fail their own checksums.
  """
  for region in regions:
    if os.path.exists(store.region_record_path(region)):
      os.unlink(store.region_record_path(region))
    for name in store.dtypes:
      if os.path.exists(store.shard_path(name, region)):
        os.unlink(store.shard_path(name, region))
