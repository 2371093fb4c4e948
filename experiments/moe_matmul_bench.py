"""The experts' grouped matmul as kdjax runs it (`jax.lax.ragged_dot`), against one dense matmul of
the same routed FLOPs, at gpt-oss's expert shapes.

    python experiments/moe_matmul_bench.py                      # 20b and 120b shapes, 8K tokens
    python experiments/moe_matmul_bench.py --tokens 256 --small # a check on CPU in seconds

For each shape: N tokens routed to U of X experts (Y = N U assignments, random routing, so groups
of unequal size), [Y, D] x [X, D, F] -> [Y, F] in bf16 with float32 accumulation. Reported: the
median time of the grouped matmul and of a dense [Y, D] x [D, F] matmul (the FLOPs it must do),
their TFLOP/s, and the FLOPs XLA's cost analysis counts for the grouped one: a compiler that
expands ragged_dot into zero-padded dense matmuls counts (and does) X times the routed FLOPs.
One JSON line per shape to --out (default experiments/results/moe_matmul.jsonl).

Shape letters: N tokens, U experts per token, X experts, Y = N U assignments, D width, F expert
width.
"""
import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_bench  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "moe_matmul.jsonl")
# name -> (X experts, U per token, D, F): gpt-oss's gate/up projection (F = 2 x 2880 interleaved)
SHAPES = {"gpt-oss-20b": (32, 4, 2880, 5760), "gpt-oss-120b": (128, 4, 2880, 5760)}
SMALL = {"small": (8, 2, 128, 256)}


def median_seconds(fn, *args, repeats=5) -> float:
  jax.block_until_ready(fn(*args))  # compiles
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def bench(name, experts, per_token, dim, width, tokens, seed=0) -> dict:
  rng = np.random.default_rng(seed)
  assignments = tokens * per_token
  # Random routing: each token's U distinct experts; group sizes as the MoE layer makes them.
  experts_NxU = np.argsort(rng.random((tokens, experts)), axis=-1)[:, :per_token]
  group_sizes_X = np.bincount(experts_NxU.reshape(-1), minlength=experts).astype(np.int32)
  key = jax.random.key(seed)
  lhs_YxD = jax.random.normal(key, (assignments, dim), jnp.bfloat16)
  rhs_XxDxF = jax.random.normal(key, (experts, dim, width), jnp.bfloat16) * dim ** -0.5
  rhs_DxF = rhs_XxDxF[0]
  grouped = jax.jit(lambda a, b, g: jax.lax.ragged_dot(a, b, g,
                                                       preferred_element_type=jnp.float32))
  dense = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
  group_sizes_X = jnp.asarray(group_sizes_X)
  cost = grouped.lower(lhs_YxD, rhs_XxDxF, group_sizes_X).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  routed = 2.0 * assignments * dim * width
  grouped_s = median_seconds(grouped, lhs_YxD, rhs_XxDxF, group_sizes_X)
  dense_s = median_seconds(dense, lhs_YxD, rhs_DxF)
  return {"name": name, "experts": experts, "per_token": per_token, "d": dim, "f": width,
          "tokens": tokens, "routed_gflop": routed / 1e9,
          "xla_counted_gflop": float(cost.get("flops", 0.0)) / 1e9,
          "grouped_ms": grouped_s * 1e3, "dense_ms": dense_s * 1e3,
          "grouped_tflops": routed / grouped_s / 1e12, "dense_tflops": routed / dense_s / 1e12,
          "grouped_over_dense": grouped_s / dense_s, "device": jax.devices()[0].device_kind,
          "commit": e2e_bench.commit(), "date": e2e_bench.today()}


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--tokens", type=int, default=8192)
  parser.add_argument("--small", action="store_true", help="one small shape (CPU check)")
  parser.add_argument("--out", default=RESULTS)
  args = parser.parse_args()
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  for name, shape in (SMALL if args.small else SHAPES).items():
    line = bench(name, *shape, args.tokens)
    print(json.dumps(line), flush=True)
    with open(args.out, "a") as f:
      f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
  main()
