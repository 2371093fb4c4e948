"""Probe: experiments/mgpu_logits.py's kernel over vocabulary windows against XLA's dot (H200).

    PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false python experiments/mgpu_probe.py [M K V]
"""
import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from experiments import mgpu_logits as mgpu


def timeit(f, *args, n=10):
  for _ in range(2):
    jax.block_until_ready(f(*args))
  ts = []
  for _ in range(n):
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    ts.append(time.perf_counter() - t)
  return statistics.median(ts) * 1e3


def sweep(h, w, windows, tiles, with_z):
  """All windows into one E in place; returns E and a scalar touching every other output."""
  e_ref, outs = None, []
  for cols in windows:
    out = mgpu.project(h, w, cols, 1.0, None, e_ref, tiles, with_z)
    if e_ref is None:
      e_ref = jax.new_ref(out[0])
    outs.append(jnp.sum(out[-2]) + (jnp.sum(out[-3][:, :8]) if with_z else 0.0))
  return e_ref[...], sum(outs)


def main():
  m, k, n = (int(x) for x in (sys.argv[1:4] if len(sys.argv) > 3 else (2304, 4096, 131072)))
  h = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
  w = (jax.random.normal(jax.random.key(1), (k, n), jnp.float32) * 0.02).astype(jnp.bfloat16)
  base = timeit(jax.jit(lambda h, w: jnp.dot(h, w, preferred_element_type=jnp.float32)), h, w)
  print(json.dumps(dict(impl="xla dot f32", ms=base)), flush=True)
  T = mgpu.Tiles
  for name, tiles, nwin, with_z in [
      ("8 windows, z, z_epi 32", T(), 8, True),
      ("8 windows, z, z_epi 64, 2 stages", T(stages=2, z_epi=64), 8, True),
      ("8 windows, no z", T(), 8, False), ("1 window, no z", T(), 1, False),
      ("1 window, z", T(), 1, True), ("4 windows, z", T(), 4, True)]:
    step = n // nwin
    windows = [range(i * step, (i + 1) * step) for i in range(nwin)]
    try:
      step_fn = functools.partial(sweep, windows=windows, tiles=tiles, with_z=with_z)
      t = timeit(jax.jit(step_fn), h, w)
      print(json.dumps(dict(impl=name, ms=t, ratio=t / base)), flush=True)
    except Exception as e:
      print(json.dumps(dict(impl=name, error=repr(e)[:300])), flush=True)


if __name__ == "__main__":
  main()
