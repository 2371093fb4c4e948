"""The dense MLP's gate and up matmuls and their gating, alone on one GPU: XLA (mlp_impl "xla":
two GEMMs writing bf16 products, silu(gate) * up fused after) against kdjax.kernels.swiglu
(mlp_impl "pallas": one Mosaic GPU kernel, the gating in its epilogue), at teachers' and
students' shapes, with tile variants of the kernel.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python -m experiments.bench.swiglu_bench \
        [--rows 32768] [--shapes llama-8b llama-3b qwen3-8b smollm2] [--results FILE]

Inputs: random bf16 rows y [N, D] and weights [D, F] (scaled as initialised). Each way is
checked against the float32 reference (kdjax.kernels.swiglu.swiglu_reference) and timed
(median of attention_bench's repeats after its warm-ups, block_until_ready); TFLOP/s counts the
two matmuls, 4 N D F. One line per (shape, way) with the GPU's clocks over its timing
(gpu_watch: the H200 is power-capped under GEMMs).
"""
import argparse
import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments.bench import e2e_bench, gpu_watch
from experiments.bench.attention_bench import timed
from kdjax.kernels import swiglu as swiglu_lib

SHAPES = {  # name: (D, F)
    "llama-8b": (4096, 14336),   # the 8B teacher (configs/8k.py, 32k.py)
    "llama-3b": (3072, 8192),    # their student
    "qwen3-8b": (4096, 12288),
    "smollm2": (576, 1536),      # SmolLM2-135M, the real teacher (configs/smollm2.py)
}


def xla_way(y_NxD, w_gate_DxF, w_up_DxF):
  """mlp_impl "xla", as kdjax/models/llama.py's Block computes it."""
  gate_NxF = jnp.einsum("nd,df->nf", y_NxD, w_gate_DxF)
  up_NxF = jnp.einsum("nd,df->nf", y_NxD, w_up_DxF)
  return jax.nn.silu(gate_NxF) * up_NxF


def ways():
  base = swiglu_lib.GPU_TILES
  out = [("xla", xla_way), ("kernel", swiglu_lib.swiglu)]
  for name, tiles in [("kernel stages 4", dataclasses.replace(base, stages=4)),
                      ("kernel group 8", dataclasses.replace(base, group=8)),
                      ("kernel group 4", dataclasses.replace(base, group=4)),
                      ("kernel stages 2", dataclasses.replace(base, stages=2)),
                      # 256-row CTAs: 64-column wgmmas, the weights' tiles shared by more rows
                      ("kernel bm 128 bn 64", dataclasses.replace(base, bm=128, bn=64))]:
    out.append((name, lambda y, a, b, t=tiles: swiglu_lib.swiglu(y, a, b, t=t)))
  return out


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--rows", type=int, default=32768, help="positions (N)")
  p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
  p.add_argument("--results", default="", help="jsonl file to append the lines to")
  args = p.parse_args()
  commit, device = e2e_bench.commit(), str(jax.devices()[0].device_kind)
  watch = gpu_watch.GpuWatch()
  watch.start()
  rng = np.random.default_rng(0)
  for shape in args.shapes:
    d, f = SHAPES[shape]
    y = jnp.asarray(rng.standard_normal((args.rows, d)), jnp.bfloat16)
    w_gate, w_up = (jnp.asarray(rng.standard_normal((d, f)) * d ** -0.5, jnp.bfloat16)
                    for _ in range(2))
    want = np.asarray(jax.jit(swiglu_lib.swiglu_reference)(y, w_gate, w_up), np.float32)
    xla_ms = None
    for name, way in ways():
      row = dict(way=name, shape=shape, rows=args.rows, width=d, hidden=f, commit=commit,
                 device=device, date=e2e_bench.today())
      try:
        fn = jax.jit(way)
        got = np.asarray(fn(y, w_gate, w_up), np.float32)
        row["max_rel_err"] = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
        t0 = time.time()
        ms = timed(fn, y, w_gate, w_up) * 1e3
        row.update(ms=ms, tflops=4 * args.rows * d * f / ms / 1e9,
                   clocks=watch.clocks(t0, time.time()))
        xla_ms = ms if name == "xla" else xla_ms
        if xla_ms:
          row["vs_xla"] = ms / xla_ms
      except Exception as e:  # noqa: BLE001 - a variant that does not compile is a result
        row["error"] = repr(e)[:300]
      e2e_bench.record(row, args.results)


if __name__ == "__main__":
  main()
