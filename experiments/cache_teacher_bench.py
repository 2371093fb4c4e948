"""Teacher cache construction speed: the jitted top-k step alone, and write_cache end to end.

    python experiments/cache_teacher_bench.py --preset 1b --seq-len 8192 --batch-size 2

A randomly initialised Llama of the preset's shape (weights do not change the cost) runs over a
synthetic data store; prints tokens/s of the teacher step (forward + chunked top-k over the full
vocabulary) and of write_cache (the step, device-to-host copies, encoding, zstd, checksums, disk),
and the compiled step's peak device memory. Needs a GPU for the larger presets.
"""
import argparse
import os
import shutil
import time

import jax
import numpy as np
from flax import nnx

from kdjax import cache, teacher
from kdjax.models import llama

PRESETS = {  # shapes of public models; "tiny" runs anywhere
    "tiny": dict(vocab_size=32000, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64,
                 d_ff=512),
    "1b": dict(vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8,
               head_dim=64, d_ff=8192),  # Llama-3.2-1B
    "8b": dict(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
               head_dim=128, d_ff=14336),  # Llama-3.1-8B
}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
  parser.add_argument("--seq-len", type=int, default=8192)
  parser.add_argument("--rows", type=int, default=16, help="sequences written by write_cache")
  parser.add_argument("--batch-size", type=int, default=2, help="rows per teacher call")
  parser.add_argument("--chunk-size", type=int, default=2048, help="positions per lm_head chunk")
  parser.add_argument("--k", type=int, default=100)
  parser.add_argument("--layout", default="compact", choices=("compact", "float32"))
  parser.add_argument("--dir", default="/tmp/kdjax_teacher_bench")
  args = parser.parse_args()

  dtype = "bfloat16" if jax.devices()[0].platform == "gpu" else "float32"
  cfg = llama.ModelConfig(**PRESETS[args.preset], rope_theta=5e5, rope_scaling=None,
                          norm_eps=1e-5, tie_embeddings=False, qk_norm=False, dtype=dtype,
                          param_dtype=dtype)
  model = llama.Transformer(cfg, rngs=nnx.Rngs(0))
  vocab, seq_len = cfg.vocab_size, args.seq_len

  shutil.rmtree(args.dir, ignore_errors=True)
  data = cache.create(os.path.join(args.dir, "data"), num_seqs=args.rows, seq_len=seq_len, k=0,
                      vocab_size=vocab, attrs={"source": "synthetic"})
  rng = np.random.default_rng(0)
  # Documents of ~2K tokens packed per row, as real data is.
  segment_ids = (np.arange(seq_len) // 2048 + 1).astype(np.int32)
  data.write(0, {"tokens": rng.integers(0, vocab, (args.rows, seq_len), dtype=np.int32),
                 "segment_ids": np.tile(segment_ids, (args.rows, 1)),
                 "positions": np.tile(np.arange(seq_len, dtype=np.int32) % 2048, (args.rows, 1)),
                 "loss_mask": np.ones((args.rows, seq_len), bool)})
  data = cache.open(os.path.join(args.dir, "data"))

  graphdef, state = nnx.split(model)
  batch = data.read(np.arange(args.batch_size))
  inputs = [batch[name] for name in ("tokens", "positions", "segment_ids")]
  kw = dict(k=args.k, chunk_size=args.chunk_size, vocab_size=vocab)
  memory = teacher._teacher_step.lower(graphdef, state, *inputs, **kw).compile().memory_analysis()
  jax.block_until_ready(teacher._teacher_step(graphdef, state, *inputs, **kw))  # compiles
  reps = 5
  start = time.perf_counter()
  for _ in range(reps):
    out = teacher._teacher_step(graphdef, state, *inputs, **kw)
  jax.block_until_ready(out)
  step_s = (time.perf_counter() - start) / reps
  print(f"{args.preset} ({llama.count_params(model) / 1e9:.2f}B params, {dtype}), T={seq_len}, "
        f"B={args.batch_size}, chunk {args.chunk_size}, k={args.k}, on {jax.devices()[0]}")
  print(f"teacher step: {args.batch_size * seq_len / step_s:,.0f} tokens/s ({step_s * 1e3:.0f} ms)"
        + (f"; temp memory {memory.temp_size_in_bytes / 2**30:.1f} GiB" if memory else ""))

  start = time.perf_counter()
  store = teacher.write_cache(model, data, os.path.join(args.dir, "cache"), k=args.k,
                              batch_size=args.batch_size, chunk_size=args.chunk_size,
                              vocab_size=vocab, attrs={"teacher": args.preset},
                              layout=args.layout)
  seconds = time.perf_counter() - start
  print(f"write_cache ({args.layout}): {args.rows * seq_len / seconds:,.0f} tokens/s end to end "
        f"({args.rows} rows in {seconds:.1f} s, step compiled before)")
  assert not store.missing()


if __name__ == "__main__":
  main()
