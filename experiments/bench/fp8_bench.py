"""A block's projections alone on one GPU, bf16 against FP8 (kdjax.models.fp8.dot, what
ModelConfig.fp8_matmuls runs): forward, and forward + backward (the gradients of x and w), at the
3B student's shapes.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python -m experiments.bench.fp8_bench \
        [--rows 16384] [--shapes qkv wo gate down] [--results FILE] [--hlo DIR]

Inputs: random bf16 rows x [M, K] (unit variance) and weights [K, N] (scaled as initialised).
Each line: the median ms (attention_bench's repeats after its warm-ups, block_until_ready),
TFLOP/s counting 2 M K N per product (one forward, three forward + backward: y, dx, dw; lines of
bc0e311 ran two, dx and dw, and count those: "gemms"), the error against
the float32 product, whether the compiled program called cuBLASLt's FP8 GEMM
("__cublas$lt$matmul$f8" in its HLO) and the GPU's clocks over the timing (gpu_watch).
"""
import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments.bench import e2e_bench, gpu_watch
from experiments.bench.attention_bench import timed
from kdjax.models import fp8

SHAPES = {  # name: (K, N), the 3B student's (configs/8k.py) projections
    "qkv": (3072, 5120),   # q, k and v side by side (24 + 8 + 8 heads of 128)
    "wo": (3072, 3072),
    "gate": (3072, 8192),  # gate or up
    "down": (8192, 3072),
}
WAYS = {"bf16": lambda x, w: x @ w, "fp8": fp8.dot}


def fwd_bwd(way):
  """(forward, forward + backward); the latter returns the loss too, so the forward product is
  computed (under jax.grad alone it is dead code: the gradients need g, not y)."""
  def loss(x, w, g):
    return jnp.sum(way(x, w).astype(jnp.float32) * g)
  return (jax.jit(lambda x, w, g: way(x, w)),
          jax.jit(jax.value_and_grad(loss, argnums=(0, 1))))


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--rows", type=int, default=16384, help="M: one micro-batch of configs/8k.py")
  p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
  p.add_argument("--results", default="", help="jsonl file to append the lines to")
  p.add_argument("--hlo", default="", help="folder to write each compiled program's HLO to")
  args = p.parse_args()
  commit, device = e2e_bench.commit(), str(jax.devices()[0].device_kind)
  watch = gpu_watch.GpuWatch()
  watch.start()
  rng = np.random.default_rng(0)
  for shape in args.shapes:
    k, n = SHAPES[shape]
    x = jnp.asarray(rng.standard_normal((args.rows, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)) * k ** -0.5, jnp.bfloat16)
    g = jnp.asarray(rng.standard_normal((args.rows, n)), jnp.bfloat16)
    want = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
    base = {}
    for name, way in WAYS.items():
      fwd, both = fwd_bwd(way)
      for part, fn, fn_args, flops in (("forward", fwd, (x, w, g), 2),
                                       ("forward+backward", both, (x, w, g), 6)):
        row = dict(way=name, part=part, shape=shape, rows=args.rows, k=k, n=n, gemms=flops // 2,
                   commit=commit, device=device, date=e2e_bench.today())
        try:
          hlo = fn.lower(*fn_args).compile().as_text()
          if args.hlo:
            os.makedirs(args.hlo, exist_ok=True)
            with open(os.path.join(args.hlo, f"{shape}_{name}_{part}.txt"), "w") as f:
              f.write(hlo)
          row["fp8_gemms"] = hlo.count("__cublas$lt$matmul$f8")
          if part == "forward":
            got = np.asarray(fn(*fn_args), np.float32)
            row["max_rel_err"] = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
          t0 = time.time()
          ms = timed(fn, *fn_args) * 1e3
          row.update(ms=ms, tflops=flops * args.rows * k * n / ms / 1e9,
                     clocks=watch.clocks(t0, time.time()))
          base.setdefault(part, ms)
          row["vs_bf16"] = ms / base[part]
        except Exception as e:  # noqa: BLE001 - a way that does not compile is a result
          row["error"] = repr(e)[:300]
        e2e_bench.record(row, args.results)


if __name__ == "__main__":
  main()
