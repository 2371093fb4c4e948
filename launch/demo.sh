#!/usr/bin/env bash
# Quickstart 1: set up, then run the embedded demo (CPU, a few minutes, nothing downloaded).
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
exec .venv/bin/python -m kdjax.main --config=configs/demo.py "$@"
