"""Attention alone, forward and backward, on the student's heads: where does its time go?

    XLA_PYTHON_CLIENT_PREALLOCATE=false python -m experiments.bench.attention_bench \
        [--seq-len 8192 --rows 2 --docs 4] [--bound M] [--docs-per-call N] \
        [--ways packed,row_causal] \
        [--results experiments/results/attention.jsonl]

One process, one shape (Llama-3.2-3B's heads: H 24, G 8, E 128, bf16), several ways of computing
the same causal attention, each timed forward alone and forward + backward (median of 5 after
2 warm-ups, block_until_ready):
  * packed: kdjax's path (kdjax.models.attention, cuDNN's ragged layout, documents as spans) on
    rows of `docs` documents of Dirichlet lengths, as experiments/bench/e2e_bench.py packs them;
  * packed_equal: the same path on rows of `docs` documents of equal length;
  * batched_equal: those equal documents as rows of their own ([rows * docs, T / docs], plain
    causal cuDNN): the same FLOPs without the ragged layout;
  * row_causal: one causal cuDNN call over each whole row (no document mask: more FLOPs);
  * mgpu_fwd_equal: JAX's Mosaic GPU flash attention (attention_mgpu, forward only: its backward
    has no causal mask in JAX 0.11.2; float16, which its kernels take) on the equal documents
    as rows.
TFLOP/s count the causal, in-document FLOPs each layout needs (4 E H per query-key pair forward,
2.5x that backward); row_causal's count is the whole row's.
"""
import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments.bench import e2e_bench
from experiments.bench.synthetic_rows import packed_segments
from kdjax.models import attention as attn, documents

H, G, E = 24, 8, 128
WARMUP, REPEATS = 2, 5


def timed(fn, *args) -> float:
  for _ in range(WARMUP):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(REPEATS):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def pairs(segment_ids_BxT: np.ndarray) -> float:
  """Causal query-key pairs inside documents."""
  return documents.mean_context(segment_ids_BxT) * segment_ids_BxT.size


def fwd_bwd(f):
  """(forward, forward + backward) of f(q, k, v) -> out, as jitted functions of (q, k, v, dout)."""
  fwd = jax.jit(lambda q, k, v, d: f(q, k, v))

  def loss(q, k, v, d):
    return jnp.sum(f(q, k, v).astype(jnp.float32) * d)
  both = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  return fwd, both


def measure(name, f, shape_bt, n_pairs, rng):
  b, t = shape_bt
  keys = jax.random.split(jax.random.key(rng), 4)
  q = jax.random.normal(keys[0], (b, t, H, E), jnp.bfloat16)
  k = jax.random.normal(keys[1], (b, t, G, E), jnp.bfloat16)
  v = jax.random.normal(keys[2], (b, t, G, E), jnp.bfloat16)
  d = jax.random.normal(keys[3], (b, t, H, E), jnp.float32)
  fwd, both = fwd_bwd(f)
  flops_fwd = 4.0 * E * H * n_pairs
  row = {"name": name, "rows": b, "seq_len": t}
  try:
    s_fwd = timed(fwd, q, k, v, d)
    row.update(fwd_ms=1e3 * s_fwd, fwd_tflops=flops_fwd / s_fwd / 1e12)
  except Exception as e:  # a way that does not apply here is reported, not fatal
    row["fwd_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return row
  try:
    s_both = timed(both, q, k, v, d)
    row.update(fwd_bwd_ms=1e3 * s_both, fwd_bwd_tflops=3.5 * flops_fwd / s_both / 1e12,
               bwd_ms=1e3 * (s_both - s_fwd))
  except Exception as e:
    row["bwd_error"] = f"{type(e).__name__}: {str(e)[:300]}"
  return row


def mgpu_causal(q, k, v):
  """attention_mgpu in float16 (its kernels take no bf16 in JAX 0.11.2: the 2026-12-04 run
  failed on a bf16 -> f16 copy), back to q's dtype."""
  from jax.experimental.pallas.ops.gpu import attention_mgpu as mgpu
  config = mgpu.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=True)
  f16 = lambda x: x.astype(jnp.float16)
  return mgpu.attention(f16(q), f16(k), f16(v), config).astype(q.dtype)


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--seq-len", type=int, default=8192)
  p.add_argument("--rows", type=int, default=2)
  p.add_argument("--docs", type=int, default=4)
  p.add_argument("--bound", type=int, default=0,
                 help="the packed ways' documents bound (0: the batch's own, as a per-batch "
                      "bound; a run takes its whole cache's, e.g. 64 where one row holds 33)")
  p.add_argument("--docs-per-call", type=int, default=0,
                 help="the packed ways' documents per cuDNN call (0: kdjax's "
                      "attention.documents_per_call, sized to cuDNN's workspace)")
  p.add_argument("--ways", default="",
                 help="comma-separated names of the ways to time (default: all)")
  p.add_argument("--results", default="")
  args = p.parse_args()
  b, t, m = args.rows, args.seq_len, args.docs
  if t % m or (t // m) % 128:
    sys.exit(f"--seq-len {t} / --docs {m} must be a multiple of 128 (equal documents)")
  rng = np.random.default_rng(0)
  seg_dirichlet, _ = packed_segments(rng, b, t, m)
  seg_equal = np.repeat(np.arange(1, m + 1, dtype=np.int32), t // m)[None].repeat(b, 0)
  one_doc = np.ones((b * m, t // m), np.int32)
  whole = np.ones((b, t), np.int32)
  bound = args.bound or documents.documents_bound(seg_dirichlet)
  if bound < m:
    sys.exit(f"--bound {bound} is below --docs {m}: documents past it would be dropped")

  def packed(segment_ids):
    s = jnp.asarray(segment_ids)
    return lambda q, k, v: attn.attention_cudnn(q, k, v, s, bound,
                                                docs_per_call=args.docs_per_call or None)

  def plain(segment_ids):
    s = jnp.asarray(segment_ids)
    return lambda q, k, v: attn.attention(q, k, v, s, impl="cudnn", max_documents=1)

  ways = [
      ("packed", packed(seg_dirichlet), (b, t), pairs(seg_dirichlet)),
      ("packed_equal", packed(seg_equal), (b, t), pairs(seg_equal)),
      ("batched_equal", plain(one_doc), (b * m, t // m), pairs(one_doc)),
      ("row_causal", plain(whole), (b, t), pairs(whole)),
      ("mgpu_fwd_equal", mgpu_causal, (b * m, t // m), pairs(one_doc)),
  ]
  commit = e2e_bench.commit()
  device = str(jax.devices()[0].device_kind)
  for i, (name, f, shape, n) in enumerate(ways):
    if args.ways and name not in args.ways.split(","):
      continue
    row = measure(name, f, shape, n, i)
    row.update(docs=m, bound=bound, heads=[H, G, E], commit=commit, device=device,
               docs_per_call=args.docs_per_call or attn.documents_per_call(b, t, bound),
               date=e2e_bench.today(), mean_context=n / (b * t))
    e2e_bench.record(row, args.results)


if __name__ == "__main__":
  main()
