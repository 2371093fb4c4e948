"""The README's run end to end at the paper's scale: every stage of `python -m kdjax.main`.

    python -m experiments.bench.pipeline_bench --config configs/8k.py     # on the H200, one call
    python -m experiments.bench.pipeline_bench --config configs/32k.py
    python -m experiments.bench.pipeline_bench --config configs/8k.py:smoke --small   # CPU check

Writes, under --work:
  teacher/   a Hugging Face checkpoint with RANDOM weights of the config's teacher shapes
             (Llama-3.1-8B: 16 GB of bf16 in <= 4 GiB shards), through kdjax.models.hf.export
  teacher/   its tokenizer: a word-level tokenizer of exactly Llama-3's 128256 entries (128000
             words + 256 special tokens) and a Llama-3-style chat template; the real one cannot be
             downloaded here
  chat.jsonl conversations of random words (system, user, assistant turns)
then runs the README's commands, one stage per process (so each stage's peak memory is its own):
data, cache, train (--steps optimizer steps), eval, export, through launch/gpu.sh on a GPU. Each
stage's wall time and peak device memory come from the run's own <workdir>/stages.jsonl; tokens/s
from the rows each stage processed. Results: experiments/results/pipeline.jsonl.

The teacher's weight files are deleted once stage cache has run (later stages read only its
config.json and tokenizer): the H200 machine's 64 GB disk cannot hold the 16 GB teacher beside the
3B student's 38.5 GB checkpoint (float32 parameters and AdamW moments) and its 12.8 GB export.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments.bench import e2e_bench

RESULTS = os.path.join(ROOT, "experiments", "results", "pipeline.jsonl")
WORDS = 128000
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
           "<|eot_id|>", "<|pad|>"]
TEMPLATE = (  # Llama-3's layout: header, blank line, content, <|eot_id|>
    "{{ bos_token }}{% for m in messages %}<|start_header_id|> {{ m['role'] }} "
    "<|end_header_id|> {{ m['content'] }} <|eot_id|> {% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|> assistant <|end_header_id|> {% endif %}")


def write_tokenizer(directory: str, words: int, total: int):
  """A word-level tokenizer of `total` entries: w0 .. w{words-1}, then special tokens."""
  import tokenizers
  from tokenizers import models, pre_tokenizers
  specials = SPECIAL + [f"<|reserved_{i}|>" for i in range(total - words - len(SPECIAL))]
  vocab = {f"w{i}": i for i in range(words)}
  vocab.update({s: words + i for i, s in enumerate(specials)})
  tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<|reserved_0|>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.add_special_tokens([tokenizers.AddedToken(s, special=True) for s in specials])
  os.makedirs(directory, exist_ok=True)
  tok.save(os.path.join(directory, "tokenizer.json"))
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump({"bos_token": SPECIAL[0], "eos_token": "<|eot_id|>", "pad_token": "<|pad|>",
               "chat_template": TEMPLATE}, f)


def write_chat(path: str, rng, tokens: int, words: int):
  """Conversations of random words until about `tokens` tokens are written."""
  written = 0
  with open(path, "w") as f:
    while written < tokens:
      turns = [("system", 20), ("user", rng.integers(50, 400)), ("assistant", rng.integers(100, 1500))]
      messages = [{"role": role, "content": " ".join(f"w{w}" for w in rng.integers(0, words, n))}
                  for role, n in turns]
      written += sum(n for _, n in turns) + 12
      f.write(json.dumps({"messages": messages}) + "\n")


def write_teacher(c, directory: str, tokenizer_dir: str):
  """Random weights of the config's teacher shapes, exported as a Hugging Face checkpoint."""
  from flax import nnx

  from kdjax import build
  from kdjax.models import hf, llama
  cfg = build.model_config(c.teacher, 0 if c.teacher.vocab_size else 128256)
  model = llama.Transformer(cfg, rngs=nnx.Rngs(0))
  hf.export(model, cfg, directory, tokenizer_dir=tokenizer_dir)


def run_stage(cmd: list[str], log_path: str) -> float:
  start = time.perf_counter()
  with open(log_path, "w") as log:
    proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                          env={**os.environ, "PYTHON": sys.executable})  # launch/gpu.sh runs it
  if proc.returncode:
    tail = open(log_path).read()[-3000:]
    raise RuntimeError(f"{' '.join(cmd[-3:])} failed (exit {proc.returncode}):\n{tail}")
  return time.perf_counter() - start


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", default="configs/8k.py")
  parser.add_argument("--work", default="/tmp/kdjax_pipeline")
  parser.add_argument("--rows", type=int, default=80, help="packed rows of chat data to write")
  parser.add_argument("--steps", type=int, default=2, help="optimizer steps of stage train")
  parser.add_argument("--small", action="store_true",
                      help="CPU check: the config's shapes and a 2048-entry tokenizer")
  parser.add_argument("--out", default=RESULTS)
  args = parser.parse_args()

  c = e2e_bench.load_config(args.config, [])
  words, total = (1800, 2048) if args.small else (WORDS, 128256)
  shutil.rmtree(args.work, ignore_errors=True)
  teacher_dir, workdir = os.path.join(args.work, "teacher"), os.path.join(args.work, "run")
  t0 = time.perf_counter()
  write_tokenizer(teacher_dir, words, total)
  if args.small:
    c.teacher.vocab_size = total
  write_teacher(c, teacher_dir, teacher_dir)
  write_chat(os.path.join(args.work, "chat.jsonl"), np.random.default_rng(0),
             int(args.rows * c.data.seq_len * 1.1), words)
  setup_s = time.perf_counter() - t0
  print(f"random teacher checkpoint, tokenizer and data written in {setup_s:.0f} s", flush=True)

  import jax
  on_gpu = jax.default_backend() == "gpu"
  launcher = ["bash", "launch/gpu.sh"] if on_gpu else [sys.executable, "-m", "kdjax.main"]
  base = [f"--config={args.config}", f"--config.workdir={workdir}",
          f"--config.teacher.hf_path={teacher_dir}", f"--config.data.tokenizer={teacher_dir}",
          f"--config.data.source={os.path.join(args.work, 'chat.jsonl')}",
          "--config.data.loss_mask=assistant", "--config.data.eval_every=8",
          f"--config.opt.steps={args.steps}", "--config.opt.warmup_steps=1",
          f"--config.eval.max_seqs={max(1, args.rows // 8)}"]
  if args.small:
    base += ["--config.teacher.dtype=float32", "--config.teacher.param_dtype=float32"]
  stages = {}
  for stage in ("data", "cache", "train", "eval", "export"):
    cmd = launcher + base + [f"--config.stages=('{stage}',)"]
    wall = run_stage(cmd, os.path.join(args.work, f"{stage}.log"))
    lines = [json.loads(l) for l in open(os.path.join(workdir, "stages.jsonl"))]
    stages[stage] = {"process_s": wall, **{k: lines[-1][k] for k in ("seconds", "peak_gib")}}
    print(f"{stage}: {stages[stage]}", flush=True)
    if stage == "cache":
      for name in os.listdir(teacher_dir):
        if name.endswith(".safetensors"):
          os.remove(os.path.join(teacher_dir, name))

  from kdjax import cache
  train_rows = cache.open(os.path.join(workdir, "data", "train.zarr")).num_seqs
  eval_rows = cache.open(os.path.join(workdir, "data", "eval.zarr")).num_seqs
  seq_len = c.data.seq_len
  stages["cache"]["tokens_per_s"] = (train_rows + eval_rows) * seq_len / stages["cache"]["seconds"]
  metrics = [json.loads(l) for l in open(os.path.join(workdir, "student", "metrics.jsonl"))]
  stages["train"]["tokens_per_s_last_step"] = metrics[-1]["tokens_per_s"]
  stages["train"]["data_wait_frac_last_step"] = metrics[-1]["data_wait_frac"]
  stages["eval"]["tokens_per_s"] = min(eval_rows, max(1, args.rows // 8)) * seq_len / \
      stages["eval"]["seconds"]
  result = {"config": args.config, "seq_len": seq_len, "train_rows": train_rows,
            "eval_rows": eval_rows, "steps": args.steps, "setup_s": setup_s, "stages": stages,
            "eval": json.load(open(os.path.join(workdir, "eval.json"))),
            "commit": e2e_bench.commit(), "date": e2e_bench.today(),
            "device": str(jax.devices()[0].device_kind), "weights": "random"}
  print(json.dumps(result), flush=True)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "a") as f:
    f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
  main()
