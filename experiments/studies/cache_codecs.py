"""The zstd level and shuffle of each top-k array of a layout: bytes per position against the time
the writer's compression takes.

    python -m experiments.studies.cache_codecs --cache /tmp/ctx/real/cache.zarr --rows 256 --join 8
    python -m experiments.studies.cache_codecs --synthetic-vocab 128256 --rows 16 --seq-len 2048

The teacher's rows as in cache_compact.py (a float32 cache, optionally in joined rows, or its
synthetic teacher). Each array is encoded once as `--layout` stores it (layout.encode_topk, and
dictionary_encode for the dictionary), then written as a store writes an array (row-sharded zarr
v3, blosc zstd, crc32c; regions of cache_compact's size) under each choice of shuffle and blosc
clevel (zstd level 2 clevel - 1), by tensorstore on one thread (data_copy_concurrency 1) so the
time is the CPU time a writer spends. Prints one markdown row per choice: B/pos on disk (shard
indexes included) and the best of three writes in ns per position on that thread.
"""
import argparse
import os
import shutil
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from experiments.studies import cache_compact, cache_floor
from kdjax.cache import layout

# (shuffle, clevel) choices tried for each array: the stores' settings before and after, and
# their neighbours.
CHOICES = {"topk_logprobs": [("shuffle", c) for c in (5, 4, 3, 2, 1)] + [("bitshuffle", 5),
                                                                         ("bitshuffle", 2)],
           "topk_ids": [("bitshuffle", c) for c in (5, 4, 3, 2, 1)] + [("shuffle", 5),
                                                                        ("shuffle", 4)]}


def write_once(arr, path, region_rows, shuffle, clevel, repeats=3):
  """(bytes on disk, best seconds of `repeats` writes) of arr as a store's array, one thread."""
  array = cache_floor.store_array(arr, path, region_rows, shuffle, clevel, threads=1)
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    array.write(arr).result()
    best = min(best, time.perf_counter() - start)
  return cache_floor.array_bytes(path), best


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  cache_compact.add_teacher_arguments(parser)
  parser.add_argument("--layout", default="dictionary", choices=("compact", "packed", "dictionary"))
  parser.add_argument("--out", default="", help="scratch directory (default: a temporary one)")
  args = parser.parse_args()

  rows, vocab, source = cache_compact.teacher_rows(args)
  ids, logprobs = rows["topk_ids"], rows["topk_logprobs"]
  num_rows, seq_len, k = ids.shape
  positions = num_rows * seq_len
  region_rows = max(1, min(num_rows, 2**18 // seq_len))
  dtypes = layout.array_dtypes(k, vocab, args.layout)
  stored = dict(zip(layout.TOPK_ARRAYS, layout.encode_topk(
      ids, logprobs, dtypes, *layout.codec_params(args.layout).values())))
  if args.layout == "dictionary":
    stored["topk_ids"], order = layout.dictionary_encode(
        stored["topk_ids"], vocab, layout.order_size(seq_len, vocab))
  print(f"teacher: {source}; {num_rows} rows x {seq_len} positions, k={k}; {args.layout} "
        f"arrays, regions of {region_rows} rows")
  now = {name: layout.array_metadata(name, stored[name].shape, dtypes[name], region_rows,
                                     args.layout)["codecs"][0]["configuration"]["codecs"][1]
         ["configuration"] for name in stored}
  print("\n| array | dtype | shuffle | blosc clevel | B/pos | ns/pos, one thread |")
  print("|---|---|---|---|---|---|")
  out = args.out or tempfile.mkdtemp(prefix="cache_codecs_")
  try:
    for name, arr in stored.items():
      for shuffle, clevel in CHOICES[name]:
        size, seconds = write_once(arr, os.path.join(out, name), region_rows, shuffle, clevel)
        mark = " (the layout's)" if (shuffle, clevel) == (now[name]["shuffle"],
                                                          now[name]["clevel"]) else ""
        print(f"| {name}{mark} | {arr.dtype.name} | {shuffle} | {clevel} | "
              f"{size / positions:.2f} | {seconds / positions * 1e9:.0f} |", flush=True)
    if args.layout == "dictionary":
      size, _ = write_once(order, os.path.join(out, "order"), region_rows, None, 5, repeats=1)
      print(f"\n{layout.ORDER_ARRAY} [{order.shape[0]}, {order.shape[1]}]: "
            f"{size / positions:.2f} B/pos")
  finally:
    if not args.out:
      shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
  main()
