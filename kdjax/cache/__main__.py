"""Inspect a store: `python -m kdjax.cache info|verify [--fix] [--quick] PATH`, or write it again
in another layout: `python -m kdjax.cache recode PATH NEW_PATH --layout dictionary`.

info    shape, attributes, completeness, bytes on disk and per position.
verify  checks the store's attributes (their checksum), then every finished region: manifest
        records, file checksums, and (unless --quick) that every row decodes and passes the value
        checks. Exit status 0 when the store is complete and intact, 1 when regions are damaged,
        undecodable or not written yet, 2 when the store cannot be opened (no store, edited or
        unparsable attributes: nothing is checked or changed then).
        --fix deletes the records and shards of damaged regions only (their own files fail their
        own checksums), so re-running the stage that wrote the store rewrites exactly those.
recode  writes the rows of a finished store at NEW_PATH in --layout (recode.py); the same command
        resumes an interrupted recode. Train on it with cache.path=NEW_PATH and cache.layout set
        to the new layout (the cache stage checks that its store matches the config).
"""
import argparse
import json
import os
import sys

from kdjax import cache
from kdjax.cache import integrity, layout, recode


def _size(n):
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if n < 1024 or unit == "TiB":
      return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
    n /= 1024


def array_bytes(store):
  """{array: bytes on disk} over the finished regions' shards."""
  out = dict.fromkeys(store.dtypes, 0)
  for region in store.complete_regions():
    for name in store.dtypes:
      path = store.shard_path(name, region)
      out[name] += os.path.getsize(path) if os.path.exists(path) else 0
  return out


def info(store):
  done = store.complete_regions()
  rows = sum(stop - start for start, stop in map(store.region_bounds, done))
  positions = max(rows * store.seq_len, 1)
  print(f"{store.path}")
  print(f"  {store.num_seqs} rows x {store.seq_len} positions, k={store.k}, "
        f"vocab {store.vocab_size}, layout {store.layout}, format v{store.attrs['format_version']}")
  print(f"  {len(done)} of {store.num_regions} regions of {store.region_rows} rows complete "
        f"({rows} rows, {100 * rows / store.num_seqs:.1f}%)")
  sizes = array_bytes(store)
  for name, dtype in store.dtypes.items():
    print(f"  {name:14s} {dtype:8s} {str(list(store.shape(name))):22s} {_size(sizes[name]):>10s} "
          f"{sizes[name] / positions:8.2f} B/position")
  topk = sum(sizes.get(name, 0) for name in (*layout.TOPK_ARRAYS, layout.ORDER_ARRAY))
  print(f"  {'total':14s} {'':8s} {'':22s} {_size(sum(sizes.values())):>10s} "
        f"{sum(sizes.values()) / positions:8.2f} B/position (top-k arrays: "
        f"{topk / positions:.2f})")
  attrs = {key: value for key, value in store.attrs.items() if key != "dtypes"}
  print("  attributes: " + json.dumps(attrs, indent=2, sort_keys=True).replace("\n", "\n  "))


def verify(store, *, quick, fix):
  done = store.complete_regions()
  problems = integrity.verify(store, decode=not quick)
  missing = store.missing_regions()
  for problem in problems:
    print(f"{'DAMAGED' if problem.damaged else 'INCONSISTENT'} {problem}")
  bad = sorted({p.region for p in problems if p.damaged})
  odd = sorted({p.region for p in problems if not p.damaged})
  print(f"{store.path}: {len(done) - len(bad) - len(odd)} of {len(done)} finished regions verified"
        f"{' (records and checksums only)' if quick else ''}; {len(bad)} damaged; "
        f"{len(odd)} inconsistent; {len(missing)} of {store.num_regions} not written yet")
  if bad and fix:
    integrity.invalidate(store, bad)
    print(f"marked {len(bad)} damaged regions for rewriting: re-run the stage that wrote "
          f"{store.path}; it rewrites exactly the regions its store.missing() lists")
  elif bad:
    print(f"to repair: python -m kdjax.cache verify --fix {store.path}, then re-run the stage that "
          f"wrote it")
  if odd:
    print(f"{len(odd)} inconsistent regions hold files exactly as written that the metadata does "
          f"not describe (they fail to decode or the value checks): the arrays' metadata "
          f"({store.path}/*/zarr.json) or the writer is wrong, not the data. --fix leaves them: "
          f"restore the metadata, or delete {store.path} and rebuild it.")
  if missing:
    print(f"INCOMPLETE: {integrity.describe_regions(store, missing)} not written yet. Re-run the "
          f"stage that writes {store.path} (the same command resumes where it stopped).")
  return not (problems or missing)


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m kdjax.cache", description=__doc__.split("\n")[0])
  parser.add_argument("command", choices=("info", "verify", "recode"))
  parser.add_argument("path")
  parser.add_argument("new_path", nargs="?", help="recode: where the new store is written")
  parser.add_argument("--quick", action="store_true", help="verify: skip decoding every row")
  parser.add_argument("--fix", action="store_true",
                      help="verify: mark damaged regions for rewriting")
  parser.add_argument("--layout", choices=layout.LAYOUTS, default="dictionary",
                      help="recode: the new store's layout")
  args = parser.parse_args(argv)
  if args.command == "recode":
    if not args.new_path:
      parser.error("recode needs PATH and NEW_PATH")
    try:
      store = recode.recode(args.path, args.new_path, args.layout)
    except cache.CacheError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    info(store)
    return 0
  try:
    store = cache.open(args.path, allow_partial=True)
  except cache.CacheError as e:
    print(f"error: {e}", file=sys.stderr)
    if args.fix:
      print("verify --fix changed nothing.", file=sys.stderr)
    return 2
  if args.command == "info":
    info(store)
    return 0
  return 0 if verify(store, quick=args.quick, fix=args.fix) else 1


if __name__ == "__main__":
  sys.exit(main())
