"""Documents in packed rows, counted on the host: the bound on documents per row that the cuDNN
attention's programs are compiled for (kdjax/models/attention.py), and the mean context that
llama.flops_per_token counts.

A packed row holds documents (segment ids 1, 2, ... in order, each contiguous) followed by
padding (segment 0).
"""
import numpy as np
from tqdm import tqdm


def documents_bound(segment_ids_BxT: np.ndarray) -> int:
  """M for a host batch: the next power of two >= its largest segment id (at least 1).

  Rounding up bounds the number of distinct compiled programs to log2(T) while keeping M (and
  cuDNN's statistics, linear in M) within 2x of what the batch needs.
  """
  most = int(np.max(segment_ids_BxT, initial=1))
  return 1 << max(most - 1, 0).bit_length()


def store_documents_bound(store, todo=None, positions_per_read=1 << 24) -> int:
  """documents_bound over every row of a store's `todo` [(start, stop)] (default: all rows),
  read in pieces of `positions_per_read` positions (64 MB of int32 at most). One bound for a
  whole pass (the teacher's, a training run, an evaluation) compiles its program once; a bound
  per batch compiled it again for each distinct one (seconds for a real teacher, minutes for a
  128K training step). A larger bound than a batch needs costs cuDNN's per-document statistics,
  linear in it, and more cuDNN calls per layer once it exceeds documents_per_call.
  store: anything with seq_len, num_seqs and read_array(name, rows)."""
  most = 1
  rows_per_read = max(1, positions_per_read // store.seq_len)
  spans = [(0, store.num_seqs)] if todo is None else todo
  rows = sum(stop - start for start, stop in spans)
  # a progress bar where the reads take seconds (over 4 of them: 64M positions and more)
  with tqdm(total=rows * store.seq_len, unit="pos", unit_scale=True, desc="documents per row",
            disable=rows <= 4 * rows_per_read) as bar:
    for start, stop in spans:
      for lo in range(start, stop, rows_per_read):
        hi = min(stop, lo + rows_per_read)
        segment_ids = store.read_array("segment_ids", slice(lo, hi))
        most = max(most, int(np.max(segment_ids, initial=1)))
        bar.update((hi - lo) * store.seq_len)
  return documents_bound(np.array([most]))


def mean_context(segment_ids_BxT: np.ndarray) -> float:
  """Mean number of keys a query attends to (causal, within its document) over the batch's
  positions, padding included: the attention term of llama.flops_per_token."""
  total = 0.0
  for row in np.asarray(segment_ids_BxT).reshape(-1, np.shape(segment_ids_BxT)[-1]):
    lengths = np.bincount(row)[1:]
    total += float(np.sum(lengths * (lengths + 1) / 2))
  return total / max(np.size(segment_ids_BxT), 1)
