#!/usr/bin/env bash
# Quickstart 2: set up, then run the test suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
export JAX_PLATFORMS=cpu
exec .venv/bin/python -m pytest -n 2 -q "$@"
