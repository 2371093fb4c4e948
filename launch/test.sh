#!/usr/bin/env bash
# Quickstart 2: set up, then run the test suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
export JAX_PLATFORMS=cpu
# --dist=loadgroup: the tests of one xdist_group (a module whose module fixtures run kdjax.main
# or the side venv) share a worker, so those fixtures run once, not once a worker
exec .venv/bin/python -m pytest -n 2 --dist=loadgroup -q "$@"
