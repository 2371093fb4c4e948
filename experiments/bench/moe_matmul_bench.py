"""The experts' grouped matmuls at gpt-oss's shapes: kdjax's kernels (kdjax/kernels/grouped.py)
against XLA's `jax.lax.ragged_dot` and one dense matmul of the same routed FLOPs.

    python -m experiments.bench.moe_matmul_bench                       # 20b, 120b shapes, 8K tokens
    python -m experiments.bench.moe_matmul_bench --tokens 256 --small  # a check on CPU (interpreter)

For each shape: N tokens routed to U of X experts (Y = N U assignments, random routing, so groups
of unequal size), [Y, D] x [X, D, F] -> [Y, F] in bf16 with float32 accumulation. Reported
(medians): XLA's ragged_dot; the kernel on kdjax's padded layout with [X, D, F] weights and with
[X, F, D] (read transposed: how MXFP4 experts are stored); the kernel's backward (both gradients,
2x the forward's FLOPs); a dense [Y, D] x [D, F] matmul (the FLOPs it must do); TFLOP/s of the
routed FLOPs for each, the FLOPs XLA counts for ragged_dot, and the kernel's largest error
against ragged_dot relative to the output's largest value. One JSON line per shape to --out
(default experiments/results/moe_matmul.jsonl).

Shape letters: N tokens, U experts per token, X experts, Y = N U assignments, P padded rows, D
width, F expert width.
"""
import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments.bench import e2e_bench
from kdjax.kernels import grouped

RESULTS = os.path.join(ROOT, "experiments", "results", "moe_matmul.jsonl")
# name -> (X experts, U per token, D, F): gate/up (F = 2 x 2880, interleaved) and down projections
SHAPES = {"gpt-oss-20b": (32, 4, 2880, 5760), "gpt-oss-20b-down": (32, 4, 2880, 2880),
          "gpt-oss-120b": (128, 4, 2880, 5760)}
SMALL = {"small": (8, 2, 128, 192)}


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
  group_sizes_X = jnp.asarray(np.bincount(experts_NxU.reshape(-1), minlength=experts), jnp.int32)
  key = jax.random.key(seed)
  lhs_YxD = jax.random.normal(key, (assignments, dim), jnp.bfloat16)
  rhs_XxDxF = jax.random.normal(key, (experts, dim, width), jnp.bfloat16) * dim ** -0.5
  rhs_XxFxD = rhs_XxDxF.transpose(0, 2, 1)
  rhs_DxF = rhs_XxDxF[0]
  groups = grouped.layout(group_sizes_X, assignments, grouped.tiles().bm)
  rows = grouped.padded_rows(assignments, experts, groups.bm)
  lhs_PxD = jnp.zeros((rows, dim), jnp.bfloat16).at[groups.row_Y].set(lhs_YxD)

  ragged = jax.jit(lambda a, b, g: jax.lax.ragged_dot(a, b, g,
                                                      preferred_element_type=jnp.float32))
  kernel = jax.jit(lambda a, b: grouped.grouped_matmul(a, b, groups))
  kernel_t = jax.jit(lambda a, b: grouped.grouped_matmul(a, b, groups, transpose_rhs=True))
  d_out_PxF = kernel(lhs_PxD, rhs_XxDxF)
  # grouped_matmul's backward: the input gradient (weights read transposed), the weights'
  backward = jax.jit(lambda a, b, d: (
      grouped.gmm(d, b, groups.tile_expert_M, transpose_rhs=True),
      grouped.tgmm(a, d, groups.tile_start_X, groups.tiles_X)))
  dense = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))

  cost = ragged.lower(lhs_YxD, rhs_XxDxF, group_sizes_X).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  want = ragged(lhs_YxD, rhs_XxDxF, group_sizes_X)
  got = kernel(lhs_PxD, rhs_XxDxF)[groups.row_Y].astype(jnp.float32)
  got_t = kernel_t(lhs_PxD, rhs_XxFxD)[groups.row_Y].astype(jnp.float32)
  scale = float(jnp.abs(want).max())
  routed = 2.0 * assignments * dim * width
  times = {"ragged_dot_ms": median_seconds(ragged, lhs_YxD, rhs_XxDxF, group_sizes_X),
           "kernel_ms": median_seconds(kernel, lhs_PxD, rhs_XxDxF),
           "kernel_transposed_ms": median_seconds(kernel_t, lhs_PxD, rhs_XxFxD),
           "kernel_backward_ms": median_seconds(backward, lhs_PxD, rhs_XxDxF, d_out_PxF),
           "dense_ms": median_seconds(dense, lhs_YxD, rhs_DxF)}
  tflops = {k.replace("_ms", "_tflops"): routed * (2 if "backward" in k else 1) / v / 1e12
            for k, v in times.items()}
  return {"name": name, "experts": experts, "per_token": per_token, "d": dim, "f": width,
          "tokens": tokens, "padded_rows": rows, "routed_gflop": routed / 1e9,
          "xla_counted_gflop": float(cost.get("flops", 0.0)) / 1e9,
          **{k: v * 1e3 for k, v in times.items()}, **tflops,
          "kernel_over_dense": times["kernel_ms"] / times["dense_ms"],
          "kernel_max_rel_error": float(jnp.abs(got - want).max()) / scale,
          "kernel_transposed_max_rel_error": float(jnp.abs(got_t - want).max()) / scale,
          "kernels": jax.default_backend() == "gpu" and grouped.applies(lhs_PxD, rhs_XxDxF,
                                                                        groups.bm),
          "device": jax.devices()[0].device_kind, "commit": e2e_bench.commit(),
          "date": e2e_bench.today()}


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
