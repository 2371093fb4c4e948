"""Probe: kdjax.kernels.mgpu.logits_exp (the logits matmul writing exp in its epilogue) against
XLA's dot of the same shape, with a bf16 and a float32 output, on one GPU; tile variants.

    PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false \
        python -m experiments.bench.mgpu_probe [M K V]
"""
import dataclasses
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from kdjax.kernels import mgpu


def timeit(f, *args, n=10):
  for _ in range(2):
    jax.block_until_ready(f(*args))
  ts = []
  for _ in range(n):
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    ts.append(time.perf_counter() - t)
  return statistics.median(ts) * 1e3


def main():
  m, k, n = (int(x) for x in (sys.argv[1:4] if len(sys.argv) > 3 else (4096, 4096, 131072)))
  h = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
  w = (jax.random.normal(jax.random.key(1), (k, n), jnp.float32) * 0.02).astype(jnp.bfloat16)
  dots = {out: timeit(jax.jit(lambda h, w, out=out: jnp.dot(h, w, preferred_element_type=out)),
                      h, w) for out in (jnp.bfloat16, jnp.float32)}
  print(json.dumps(dict(shape=[m, k, n], xla_dot_bf16_ms=dots[jnp.bfloat16],
                        xla_dot_f32_ms=dots[jnp.float32])), flush=True)
  base = mgpu.GPU_TILES
  for name, tiles in [("default", base), ("stages 4", dataclasses.replace(base, stages=4)),
                      ("group 16", dataclasses.replace(base, group=16)),
                      ("stages 2", dataclasses.replace(base, stages=2))]:
    try:
      ms = timeit(jax.jit(lambda h, w, t=tiles: mgpu.logits_exp(h, w, 1.0, t=t)), h, w)
      print(json.dumps(dict(tiles=name, ms=ms, vs_dot_bf16=ms / dots[jnp.bfloat16],
                            vs_dot_f32=ms / dots[jnp.float32])), flush=True)
    except Exception as e:  # noqa: BLE001 - a variant that does not fit is a result
      print(json.dumps(dict(tiles=name, error=repr(e)[:300])), flush=True)


if __name__ == "__main__":
  main()
