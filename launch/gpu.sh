#!/usr/bin/env bash
# One GPU: what a long-context run needs set, then the main job with your arguments.
#   bash launch/gpu.sh --config=configs/8k.py --config.teacher.hf_path=PATH ...
# Set up first with `KDJAX_EXTRAS=gpu bash launch/setup.sh` (JAX with CUDA 13), or have JAX 0.11.2
# with CUDA already installed (PYTHON=python3 then picks that interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}

# Memory is taken as the run needs it, so peak figures are the run's own and a second process
# (an eval, a notebook) can share the GPU.
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}
# The share of the GPU JAX may take is the config's mesh.memory_fraction (0.92; an
# XLA_PYTHON_CLIENT_MEM_FRACTION in the environment wins).
# Compiled programs and cuBLAS autotuning results kept across runs: a resumed run compiles in
# seconds, and compiling allocates no autotuning copies of the matmul operands.
cache=${KDJAX_CACHE_DIR:-$HOME/.cache/kdjax}
mkdir -p "$cache/jax" "$cache/autotune"
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$cache/jax}
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_per_fusion_autotune_cache_dir=$cache/autotune"

"$python" -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")' || {
  echo "launch/gpu.sh: $python's JAX sees no GPU; install JAX with CUDA (KDJAX_EXTRAS=gpu bash launch/setup.sh)." >&2
  exit 1
}
exec "$python" -m kdjax.main "$@"
