"""How many documents do packed rows hold, and what does that cost cuDNN's packed attention?

    JAX_PLATFORMS=cpu python -m experiments.studies.documents_per_row --store DATA_STORE
    JAX_PLATFORMS=cpu python -m experiments.studies.documents_per_row --stdlib --seq-len 8192 32768

A run gives every step one documents bound M, its whole cache's (kdjax.models.attention.
store_documents_bound: the next power of two above the most documents any row holds), and cuDNN's
packed backward sizes each of the M documents as the whole row, so every micro-batch pays
ceil(M / documents_per_call) calls of B x m x T workspace however few documents it holds
(BENCHMARKS.md, "Attention with many short documents"). Printed per row length: documents per
row (median, 90th percentile, max), the whole-cache bound and its cuDNN calls per layer, the
calls a bound per micro-batch would take (mean), and the documents per window of a ladder of
windows (W = 256 .. T/2 at offsets 0 and W/2, each document in the smallest that holds it; the
whole row for the rest): their sum against M is the workspace such windows would need.

--stdlib: this Python's standard library .py files as documents, in file order, ~3.5 bytes a
token (an estimate: no tokenizer), packed as kdjax's data stage packs (synthetic_rows.stdlib_rows, the
rows `e2e_bench.py --docs stdlib` trains on, there in a random order).
"""
import argparse
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments.bench.synthetic_rows import stdlib_rows
from kdjax import cache
from kdjax.models import attention, documents


def windows_plan(segment_ids_NxT: np.ndarray) -> dict:
  """(W, offset) -> the most documents any one window of that level holds."""
  t = segment_ids_NxT.shape[1]
  levels = [w for w in (256 << i for i in range(20)) if w <= t // 2]
  plan = {}
  for row in segment_ids_NxT:
    counts = {}
    for doc in range(1, int(row.max(initial=0)) + 1):
      at = np.flatnonzero(row == doc)
      if not len(at):
        continue
      first, last = int(at[0]), int(at[-1])
      where = (t, 0, 0)
      for w in levels:
        if first // w == last // w:
          where = (w, 0, first // w)
          break
        h = w // 2
        if first >= h and last < t - h and (first - h) // w == (last - h) // w:
          where = (w, h, (first - h) // w)
          break
      counts[where] = counts.get(where, 0) + 1
    for (w, offset, _), n in counts.items():
      plan[(w, offset)] = max(plan.get((w, offset), 0), n)
  return dict(sorted(plan.items()))


def report(segment_ids_NxT: np.ndarray, batch_rows: int) -> None:
  n, t = segment_ids_NxT.shape
  docs_N = segment_ids_NxT.max(axis=1)
  bound = documents.documents_bound(segment_ids_NxT)
  per_call = attention.documents_per_call(batch_rows, t, bound)
  batch_calls = [-(-documents.documents_bound(segment_ids_NxT[i:i + batch_rows])
                   // attention.documents_per_call(batch_rows, t, bound))
                 for i in range(0, n, batch_rows)]
  plan = windows_plan(segment_ids_NxT)
  print(f"T {t}: {n} rows; documents per row median {np.median(docs_N):.0f}, 90th percentile "
        f"{np.percentile(docs_N, 90):.0f}, max {docs_N.max()}")
  print(f"  whole-cache bound {bound}: {-(-bound // per_call)} cuDNN calls of {per_call} "
        f"documents per layer ({batch_rows} rows a micro-batch); a bound per micro-batch: "
        f"{np.mean(batch_calls):.2f} calls on average")
  print(f"  windows: documents per window {plan}; sum {sum(plan.values())} against M {bound}")


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--store", help="a kdjax data store (train.zarr): its exact segment ids")
  p.add_argument("--stdlib", action="store_true", help="this Python's stdlib, lengths estimated")
  p.add_argument("--seq-len", type=int, nargs="+", default=[8192, 32768])
  p.add_argument("--batch-rows", type=int, default=0, help="rows a micro-batch (0: 2 at <= 8K)")
  args = p.parse_args()
  if bool(args.store) == args.stdlib:
    sys.exit("give one of --store PATH or --stdlib")
  if args.store:
    store = cache.open(args.store)
    lengths = [store.seq_len]
  else:
    lengths = args.seq_len
  for t in lengths:
    segment_ids = (store.read_array("segment_ids", slice(0, store.num_seqs)) if args.store
                   else stdlib_rows(t)[0])
    report(np.asarray(segment_ids), args.batch_rows or (2 if t <= 8192 else 1))


if __name__ == "__main__":
  main()
