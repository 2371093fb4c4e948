#!/usr/bin/env bash
# Creates .venv with a Python >= 3.12 found on this machine and installs kdjax into it.
# Re-running is cheap: the install is skipped while pyproject.toml is unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  local c
  for c in python3.13 python3.12 python3; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      command -v "$c"; return
    fi
  done
  # pyenv keeps versions outside PATH unless selected; look there directly.
  local root="${PYENV_ROOT:-$HOME/.pyenv}"
  for c in "$root"/versions/3.1[2-9]*/bin/python3; do
    [ -x "$c" ] && { echo "$c"; return; }
  done
  echo "kdjax needs Python >= 3.12 (JAX 0.11). Install one (e.g. 'pyenv install 3.12') and re-run." >&2
  exit 1
}

if [ ! -x .venv/bin/python ]; then
  "$(find_python)" -m venv .venv
fi
# KDJAX_EXTRAS=gpu adds JAX's CUDA 13 plugin (for launch/gpu.sh); the tests always come along.
extras="test${KDJAX_EXTRAS:+,$KDJAX_EXTRAS}"
stamp=.venv/.kdjax-installed
want=$( (cat pyproject.toml; echo "$extras") | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  # uv (Astral's installer) resolves and installs the same requirements in parallel: 17 s here
  # against pip's 80 s from a fresh clone (2 cores, 2026-12-07). pip where uv cannot come.
  if .venv/bin/python -m pip install -q uv >/dev/null 2>&1 &&
     .venv/bin/python -m uv pip install -q --python .venv/bin/python -e ".[$extras]"; then
    :
  else
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e ".[$extras]"
  fi
  echo "$want" > "$stamp"
fi
