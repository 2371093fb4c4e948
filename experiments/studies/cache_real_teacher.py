"""A float32 top-k cache of a real pretrained teacher on real text, on CPU, for cache_compact.py.

    JAX_PLATFORMS=cpu python -m experiments.studies.cache_real_teacher \
        --hf ~/.cache/kdjax/smollm2/hf --out /tmp/real_cache --max-bytes 1000000

Tokenises the Python standard library (sources.documents("stdlib"), capped at --max-bytes of
text) with the checkpoint's tokenizer into rows of --seq-len, then writes the teacher's top-k
(float32 layout: the reference every encoding is measured against) through teacher.write_cache.
Prints the positions written and the rate. The checkpoint: `python -m kdjax.smollm2 --out DIR`
(SmolLM2-135M-Instruct, vocabulary 49152) makes DIR/hf.
"""
import argparse
import os
import time

from kdjax import cache, teacher, tokenizer
from kdjax.data import stage
from kdjax.models import hf


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--hf", required=True, help="Hugging Face checkpoint directory")
  parser.add_argument("--out", required=True, help="folder for the data stores and the cache")
  parser.add_argument("--max-bytes", type=int, default=1_000_000, help="bytes of text to read")
  parser.add_argument("--seq-len", type=int, default=1024, help="positions per row")
  parser.add_argument("--k", type=int, default=100, help="top-k entries per position")
  parser.add_argument("--batch-size", type=int, default=2, help="rows per teacher call")
  args = parser.parse_args()

  tok = tokenizer.load(args.hf)
  train, held_out = os.path.join(args.out, "data_train"), os.path.join(args.out, "data_eval")
  stage.build_stores("stdlib", tok, args.seq_len, train, held_out, eval_every=1_000_000,
                     max_bytes=args.max_bytes)
  model, _ = hf.load(args.hf, dtype="float32", remat="none",
                     tokenizer_vocab=tokenizer.real_vocab_size(tok))
  data = cache.open(train)
  start = time.perf_counter()
  store = teacher.write_cache(model, data, os.path.join(args.out, "cache.zarr"), k=args.k,
                              batch_size=args.batch_size, chunk_size=args.seq_len,
                              vocab_size=tokenizer.real_vocab_size(tok),
                              attrs={"teacher_hash": os.path.abspath(args.hf),
                                     "teacher": os.path.basename(os.path.dirname(
                                         os.path.abspath(args.hf)))}, layout="float32",
                              region_rows=8)  # small regions: finished rows are readable early
  seconds = time.perf_counter() - start
  positions = store.num_seqs * store.seq_len
  print(f"{store.path}: {store.num_seqs} rows x {store.seq_len} positions, k={store.k}, vocab "
        f"{store.vocab_size}; {positions / seconds:,.0f} positions/s")


if __name__ == "__main__":
  main()
