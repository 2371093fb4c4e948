"""Reading throughput of a teacher cache from local disk, through cache.Loader (shuffled, prefetched).

    python -m experiments.bench.cache_read_bench --dir /tmp/read_bench --rows 96 --seq-len 8192 \
        --k 100

Builds (once; reused when present) a cache of synthetic teacher outputs with the given shape and
layout, then times `--batches` shuffled batches of `--batch-size` rows through cache.Loader, after
one warm-up batch, and the same number of reads without the prefetch thread. Prints tokens/s
(positions of teacher data decoded, checked and handed over as numpy arrays per second), and bytes
per position on disk. The page cache is not dropped: a second run reads from memory; compare with
`--cold`, which evicts the store's files first (posix_fadvise DONTNEED, no root needed).

    python -m experiments.bench.cache_read_bench --compare-writes compact,packed,dictionary --vocab 128256

times only the writer: the same float32 rows (a teacher's output) written into a store of each
layout, the layouts interleaved round after round.
"""
import argparse
import os
import shutil
import time

import numpy as np

from kdjax import cache
from kdjax.cache import layout, store as store_lib


def synthetic_rows(rng, n, seq_len, k, vocab):
  """n rows as a teacher hands them over: Zipf-distributed ids, descending float32 log-probs
  with a realistic spread."""
  ids = (rng.zipf(1.2, (n, seq_len, k)) - 1) % vocab
  logprobs = -np.cumsum(rng.exponential(0.12, (n, seq_len, k)), -1) - rng.exponential(1, (n, seq_len, 1))
  segment_ids = np.ones((n, seq_len), np.int32)
  return {"tokens": rng.integers(0, vocab, (n, seq_len), dtype=np.int32),
          "segment_ids": segment_ids,
          "positions": np.tile(np.arange(seq_len, dtype=np.int32), (n, 1)),
          "loss_mask": segment_ids > 0, "topk_ids": ids.astype(np.int32),
          "topk_logprobs": logprobs.astype(np.float32)}


def build(path, rows, seq_len, k, vocab, layout):
  """A store of synthetic_rows (built once; reused when present)."""
  store = cache.create(path, num_seqs=rows, seq_len=seq_len, k=k, vocab_size=vocab,
                       attrs={"source": "synthetic", "teacher": "synthetic"}, layout=layout)
  rng = np.random.default_rng(0)
  for start, stop in store.missing():
    store.write(start, synthetic_rows(rng, stop - start, seq_len, k, vocab))
  return cache.open(path)


def compare_writes(directory, layouts, rounds, rows, seq_len, k, vocab):
  """{layout: [positions/s of each round]}: store.write of the same float32 rows into a store of
  each layout, the layouts interleaved round after round (so a busy moment of the machine falls
  on all of them), one region of `rows` rows, after one warm-up write each."""
  batch = synthetic_rows(np.random.default_rng(1), rows, seq_len, k, vocab)
  stores = {}
  for name in layouts:
    path = os.path.join(directory, f"write_{name}")
    shutil.rmtree(path, ignore_errors=True)
    stores[name] = cache.create(path, num_seqs=rows, seq_len=seq_len, k=k, vocab_size=vocab,
                                attrs={}, layout=name, region_rows=rows)
    stores[name].write(0, batch)
  rates = {name: [] for name in layouts}
  for _ in range(rounds):
    for name, store in stores.items():
      start = time.perf_counter()
      store.write(0, batch)
      rates[name].append(rows * seq_len / (time.perf_counter() - start))
  for name in layouts:
    shutil.rmtree(os.path.join(directory, f"write_{name}"))
  return rates


def evict(path):
  for root, _, names in os.walk(path):
    for name in names:
      fd = os.open(os.path.join(root, name), os.O_RDONLY)
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
      os.close(fd)


def disk_bytes(path):
  return sum(os.path.getsize(os.path.join(root, name))
             for root, _, names in os.walk(path) for name in names)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--dir", default="/tmp/kdjax_read_bench", help="where the cache is built")
  parser.add_argument("--rows", type=int, default=96, help="sequences in the cache")
  parser.add_argument("--seq-len", type=int, default=8192, help="positions per sequence")
  parser.add_argument("--k", type=int, default=100, help="top-k entries per position")
  parser.add_argument("--vocab", type=int, default=32000, help="vocabulary size")
  parser.add_argument("--layout", default="compact", choices=layout.LAYOUTS)
  parser.add_argument("--batch-size", type=int, default=8, help="rows per batch")
  parser.add_argument("--batches", type=int, default=24, help="batches timed")
  parser.add_argument("--workers", type=int, default=None, help="Loader threads (default: its own)")
  parser.add_argument("--cold", action="store_true", help="evict the files from the page cache first")
  parser.add_argument("--compare-writes", default="", metavar="L1,L2,...",
                      help="only time store.write of the same rows in each of these layouts, "
                           "interleaved (--write-rounds rounds of --batch-size rows), and stop")
  parser.add_argument("--write-rounds", type=int, default=12, help="rounds of --compare-writes")
  args = parser.parse_args()

  if args.compare_writes:
    layouts = args.compare_writes.split(",")
    rates = compare_writes(args.dir, layouts, args.write_rounds, args.batch_size, args.seq_len,
                           args.k, args.vocab)
    first = np.median(rates[layouts[0]])
    for name in layouts:
      print(f"store.write of {args.batch_size} x {args.seq_len}, V {args.vocab}, {name}: median "
            f"{np.median(rates[name]):,.0f} positions/s ({np.median(rates[name]) / first:.2f}x "
            f"{layouts[0]}); rounds: {', '.join(f'{r / 1e3:.0f}k' for r in rates[name])}")
    return

  path = os.path.join(args.dir, f"{args.layout}_{args.rows}x{args.seq_len}_k{args.k}_v{args.vocab}")
  start = time.perf_counter()
  store = build(path, args.rows, args.seq_len, args.k, args.vocab, args.layout)
  print(f"store {path}: {store.num_seqs} x {store.seq_len}, k={store.k}, {args.layout}, "
        f"{disk_bytes(path) / (store.num_seqs * store.seq_len):.1f} B/position on disk "
        f"(ready in {time.perf_counter() - start:.1f} s); {os.cpu_count()} CPUs")
  tokens = args.batches * args.batch_size * store.seq_len

  # The writer's encoding of one batch of teacher rows (sorted, as the teacher hands them over).
  rows = store.read(np.arange(min(args.batch_size, store.num_seqs)))
  ids, logprobs = rows["topk_ids"], rows["topk_logprobs"]
  codec = [store.attrs.get(key) for key in ("logprob_scale", "prob_offset") if key in store.attrs]
  start = time.perf_counter()
  for _ in range(3):
    layout.encode_topk(ids, logprobs, store.dtypes, *codec)
  seconds = (time.perf_counter() - start) / 3
  print(f"encode_topk ({args.layout}, one thread): {ids.shape[0] * ids.shape[1] / seconds:,.0f} "
        f"positions/s")
  start = time.perf_counter()
  for _ in range(3):  # what a writer thread does to its rows: checks, encode_topk, the ids' order
    store._encode(0, rows)
  seconds = (time.perf_counter() - start) / 3
  print(f"a write's checks and encoding ({args.layout}, one thread): "
        f"{ids.shape[0] * ids.shape[1] / seconds:,.0f} positions/s")
  # The whole write of those rows into a new store: encoding on the store's threads, zstd,
  # fsync and the region's record (the pace a teacher's writer threads keep up with).
  scratch = path + "_write"
  shutil.rmtree(scratch, ignore_errors=True)
  target = cache.create(scratch, num_seqs=len(ids), seq_len=store.seq_len, k=store.k,
                        vocab_size=store.vocab_size, attrs={}, layout=args.layout,
                        region_rows=len(ids))
  target.write(0, rows)
  start = time.perf_counter()
  for _ in range(3):
    target.write(0, rows)
  seconds = (time.perf_counter() - start) / 3
  shutil.rmtree(scratch)
  print(f"store.write of {len(ids)} rows ({store_lib.ENCODE_THREADS} encoding threads): "
        f"{ids.shape[0] * ids.shape[1] / seconds:,.0f} positions/s")

  if args.cold:
    evict(path)
  loader = cache.Loader(store, args.batch_size, seed=0, workers=args.workers)
  next(loader)
  start = time.perf_counter()
  for _ in range(args.batches):
    batch = next(loader)
  seconds = time.perf_counter() - start
  loader.close()
  assert batch["topk_logprobs"].shape == (args.batch_size, store.seq_len, store.k)
  print(f"Loader (shuffled, prefetch, {loader.workers} threads): {tokens / seconds:,.0f} tokens/s "
        f"({seconds / args.batches * 1e3:.1f} ms per batch of {args.batch_size} x {store.seq_len})")

  if args.cold:
    evict(path)
  order = np.random.default_rng(1).permutation(store.num_seqs)
  start = time.perf_counter()
  for i in range(args.batches):
    store.read(np.take(order, np.arange(i * args.batch_size, (i + 1) * args.batch_size), mode="wrap"))
  seconds = time.perf_counter() - start
  print(f"store.read, no prefetch:     {tokens / seconds:,.0f} tokens/s")


if __name__ == "__main__":
  main()
