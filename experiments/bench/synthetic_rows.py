"""The benchmarks' synthetic rows: packed segment ids (documents of Dirichlet lengths, or rows as
real text packs from this Python's standard library files) and a top-k cache (compact unless
asked) of random tokens and entries over them (experiments/bench/e2e_bench.py, attention_bench.py, paper_table.py;
experiments/studies/documents_per_row.py)."""
import glob
import os
import sysconfig

import numpy as np

from kdjax import cache
from kdjax.data import packing

STDLIB_BYTES_PER_TOKEN = 3.5


def docs_arg(value: str):
  return value if value == "stdlib" else int(value)


def stdlib_rows(seq_len: int, rng=None):
  """segment_ids, positions [N, T] of this Python's standard library .py files as documents
  (~STDLIB_BYTES_PER_TOKEN bytes a token: an estimate, no tokenizer), packed as the data stage
  packs (kdjax.data.packing, an eos after each; padding where a document does not fit), in
  file order or, with rng, in a random order: rows whose documents run as real text's do."""
  files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"),
                           recursive=True))
  if rng is not None:
    files = [files[i] for i in rng.permutation(len(files))]
  docs = (np.zeros(max(1, int(os.path.getsize(f) / STDLIB_BYTES_PER_TOKEN)), np.int32)
          for f in files)
  rows = list(packing.pack(docs, seq_len, bos_id=None, eos_id=1))
  return (np.stack([r["segment_ids"] for r in rows]), np.stack([r["positions"] for r in rows]))


def packed_segments(rng, rows: int, seq_len: int, docs):
  """segment_ids, positions [rows, T]: `docs` documents of unequal length per row, no padding;
  docs "stdlib": the rows of stdlib_rows from a random start (and order), padding included."""
  if docs == "stdlib":
    segment_ids, positions = stdlib_rows(seq_len, rng)
    at = (int(rng.integers(len(segment_ids))) + np.arange(rows)) % len(segment_ids)
    return segment_ids[at], positions[at]
  segment_ids = np.zeros((rows, seq_len), np.int32)
  positions = np.zeros((rows, seq_len), np.int32)
  for r in range(rows):
    lengths = np.maximum(1, np.round(rng.dirichlet(np.ones(docs)) * seq_len)).astype(int)
    lengths[-1] = seq_len - lengths[:-1].sum()
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    for d in range(docs):
      segment_ids[r, bounds[d]:bounds[d + 1]] = d + 1
      positions[r, bounds[d]:bounds[d + 1]] = np.arange(lengths[d])
  return segment_ids, positions


def synthetic_cache(path, rng, *, rows, seq_len, docs, vocab, k, layout="compact"):
  segment_ids, positions = packed_segments(rng, rows, seq_len, docs)
  store = cache.create(path, num_seqs=rows, seq_len=seq_len, k=k, vocab_size=vocab,
                       attrs={"source": "synthetic"}, layout=layout)
  for r in range(rows):  # row by row: a 128K x 100 row of float32 is 52 MB
    z = -np.sort(rng.exponential(2.0, size=(1, seq_len, k)), -1)  # descending
    # 90% of the teacher's mass in its top-k, as a real teacher's cache holds
    logp = (z - np.log(np.exp(z).sum(-1, keepdims=True)) + np.log(0.9)).astype(np.float32)
    store.write(r, {
        "tokens": rng.integers(0, vocab, (1, seq_len), dtype=np.int32),
        "segment_ids": segment_ids[r:r + 1], "positions": positions[r:r + 1],
        "loss_mask": segment_ids[r:r + 1] > 0,
        "topk_ids": rng.integers(0, vocab, (1, seq_len, k), dtype=np.int32),
        "topk_logprobs": np.ascontiguousarray(logp)})
  return cache.open(path)
