"""The teacher's top-k of one chunk of logits, alone: where does the time go after the lm_head?

    XLA_PYTHON_CLIENT_PREALLOCATE=false python -m experiments.bench.topk_bench \
        [--rows 4096 --width 4096 --vocab 128256 201088] [--results experiments/results/topk.jsonl]

One chunk as kdjax.teacher.topk_logprobs computes it: float32 logits [N, V] from bf16 hidden
states [N, D] and an lm_head [D, V] (random, scaled to a real teacher's spread of logits), then
the top k = 100 log-softmax values and ids. Each way is timed with the matmul (median of 5 after
2 warm-ups, block_until_ready) and the matmul alone is subtracted:
  * lax: jax.lax.top_k over V and jax.nn.logsumexp;
  * lse+blocks(64): logsumexp and exact_top_k with one level of 64-column blocks (kdjax's path
    until 2026-12-04);
  * kdjax(W...): kdjax.teacher.top_k_logprobs with those block widths (the normaliser from the
    first level's blocks: their maxima and sums of exp(x - maximum));
  (f61b174 also timed the normaliser as the first level's largest maximum plus a second read,
  "shift(W...)", and the one-read block sums as "block_sums": the lines of that commit in
  experiments/results/topk.jsonl).
Every way is checked against lax's values and ids before it is timed.
"""
import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments.bench import e2e_bench
from experiments.bench.attention_bench import timed
from kdjax import teacher

K = 100


def lax_way(z_NxV):
  values_NxK, ids_NxK = jax.lax.top_k(z_NxV, K)
  return values_NxK - jax.nn.logsumexp(z_NxV, axis=-1)[:, None], ids_NxK


def old_way(z_NxV):
  values_NxK, ids_NxK = teacher.exact_top_k(z_NxV, K, (64,))
  return values_NxK - jax.nn.logsumexp(z_NxV, axis=-1)[:, None], ids_NxK


def ways():
  out = [("lax", lax_way), ("lse+blocks(64)", old_way)]
  for blocks in [(64, 8, 2), (128, 16, 2), (128, 8, 2), (256, 16, 2)]:
    name = "kdjax(" + ",".join(map(str, blocks)) + ")"
    out.append((name, lambda z, b=blocks: teacher.top_k_logprobs(z, K, b)))
  return out


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--rows", type=int, default=4096, help="positions per chunk (N)")
  p.add_argument("--width", type=int, default=4096, help="the teacher's D")
  p.add_argument("--vocab", type=int, nargs="+", default=[128256, 201088])
  p.add_argument("--results", default="")
  args = p.parse_args()
  commit, device = e2e_bench.commit(), str(jax.devices()[0].device_kind)
  rng = np.random.default_rng(0)
  hidden_NxD = jnp.asarray(rng.standard_normal((args.rows, args.width)), jnp.bfloat16)
  for vocab in args.vocab:
    # logits of std ~4, as a trained teacher's span
    lm_head_DxV = jnp.asarray(rng.standard_normal((args.width, vocab)) * 4 / args.width ** 0.5,
                              jnp.bfloat16)
    logits = lambda h, w: jnp.einsum("nd,dv->nv", h, w, preferred_element_type=jnp.float32)
    matmul_s = timed(jax.jit(logits), hidden_NxD, lm_head_DxV)
    want = None
    for name, way in ways():
      f = jax.jit(lambda h, w, way=way: way(logits(h, w)))
      values, ids = f(hidden_NxD, lm_head_DxV)
      if want is None:
        want = (np.asarray(values), np.asarray(ids))
      same_ids = float(np.mean(np.asarray(ids) == want[1]))
      err = float(np.max(np.abs(np.asarray(values) - want[0])))
      seconds = timed(f, hidden_NxD, lm_head_DxV)
      row = dict(way=name, rows=args.rows, width=args.width, vocab=vocab, k=K,
                 chunk_ms=seconds * 1e3, matmul_ms=matmul_s * 1e3,
                 topk_ms=(seconds - matmul_s) * 1e3, same_ids=same_ids, max_value_err=err,
                 commit=commit, device=device, date=e2e_bench.today())
      e2e_bench.record(row, args.results)


if __name__ == "__main__":
  main()
