"""The side venv: transformers and CPU torch beside kdjax, for conversions and parity references.

    python = side_venv.ensure()      # <repo>/.venv-hf/bin/python, created on first use

It lives apart from kdjax's venv because PyPI's torch for Python 3.12 is a multi-GB CUDA build;
Python 3.11 has the CPU torch==2.13.0 these machines carry. The first call creates it (about a
minute) and later calls reuse it; a stamp file holding the package list says it is complete, and a
file lock serialises concurrent callers (pytest workers). Users: kdjax.smollm2 (the GGUF
converter) and the parity tests (tests/fixtures/hf_side.py).
"""
import fcntl
import glob
import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DIR = ROOT / ".venv-hf"
# gguf and accelerate: transformers' GGUF reader (kdjax.smollm2) needs both.
PACKAGES = ["torch==2.13.0", "transformers", "safetensors", "numpy", "gguf", "accelerate"]
STAMP = ".kdjax-side-venv"


class SideVenvError(RuntimeError):
  """The side venv cannot be made here. `missing` is True when a prerequisite is absent (no
  Python 3.11, or no CPU torch wheel for it), False when an install failed outright."""

  def __init__(self, message: str, missing: bool):
    super().__init__(message)
    self.missing = missing


def find_python311() -> str | None:
  found = shutil.which("python3.11")
  root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
  return found or next(iter(sorted(glob.glob(f"{root}/versions/3.11*/bin/python3.11"))), None)


def ensure(venv: Path = DEFAULT_DIR) -> str:
  """Python of the side venv at `venv`, created (or completed) on first use."""
  venv = Path(venv)
  venv.mkdir(parents=True, exist_ok=True)
  python = venv / "bin" / "python"
  stamp = venv / STAMP
  with open(venv / ".lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if stamp.exists() and stamp.read_text() == " ".join(PACKAGES) and python.exists():
      return str(python)
    base = find_python311()
    if base is None:
      raise SideVenvError("the side venv needs Python 3.11 (for the CPU torch==2.13.0 build); "
                          "none found on PATH or in ~/.pyenv/versions.", missing=True)
    print(f"creating the side venv {venv} ({' '.join(PACKAGES)}), about a minute", flush=True)
    subprocess.run([base, "-m", "venv", str(venv)], check=True)
    pip = subprocess.run([str(python), "-m", "pip", "install", "-q", *PACKAGES],
                         capture_output=True, text=True)
    if pip.returncode:
      if "No matching distribution found for torch" in pip.stderr:
        raise SideVenvError("the side venv needs the CPU torch==2.13.0 wheel for Python 3.11, "
                            "which pip cannot find here.", missing=True)
      raise SideVenvError(f"creating {venv} failed:\n{pip.stderr[-3000:]}", missing=False)
    stamp.write_text(" ".join(PACKAGES))
  return str(python)
