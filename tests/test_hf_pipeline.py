"""A user's run end to end: a Hugging Face teacher, jsonl data, an HF-initialised student, export.

The tiny random checkpoints come from transformers (side venv, conftest's side_python); the
exported student is loaded back by transformers, whose logits must match kdjax's trained student.
Mixture-of-experts teachers (Qwen3-MoE, gpt-oss) write a cache a student distils from.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from kdjax.models import hf

# whole runs in subprocesses: not in the fast subset; one xdist worker runs the module, so its
# module fixtures' runs are made once, not once a worker
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_hf_pipeline")]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_jsonl(path, rng, docs=60, tokens=280):
  with open(path, "w") as f:
    for _ in range(docs):
      words = rng.integers(1, tokens - 1, rng.integers(5, 40))
      f.write(json.dumps({"text": " ".join(f"w{w}" for w in words)}) + "\n")


def run_main(work, teacher: str, stages: str, *extra: str) -> None:
  """kdjax.main on the demo config, shrunk: teacher and qwen3_student checkpoints from `work`."""
  overrides = [
      f"--config.workdir={work}/run", f"--config.data.source={work}/train.jsonl",
      f"--config.data.tokenizer={work}/{teacher}", f"--config.teacher.hf_path={work}/{teacher}",
      f"--config.student.hf_path={work}/qwen3_student", "--config.data.seq_len=32",
      "--config.data.eval_every=4", "--config.cache.k=16", "--config.cache.chunk_size=16",
      "--config.loss.chunk_size=24", "--config.opt.steps=4", "--config.opt.batch_size=2",
      "--config.opt.warmup_steps=1", "--config.opt.log_every=1", "--config.opt.ckpt_every=2",
      f"--config.stages={stages}", *extra]
  for g in ("teacher", "student"):
    overrides += [f"--config.{g}.dtype=float32", f"--config.{g}.param_dtype=float32"]
  proc = subprocess.run([sys.executable, "-m", "kdjax.main", f"--config={ROOT}/configs/demo.py",
                         *overrides], capture_output=True, text=True, cwd=ROOT,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 0, proc.stderr[-4000:]


def make_checkpoints(side_python, run_side, hf_archs, work, rng, teacher: str) -> None:
  jobs = {"make": [dict(hf_archs[n], dir=str(work / n), seed=i)
                   for i, n in enumerate((teacher, "qwen3_student"))]}
  run_side(side_python, jobs, work)
  write_jsonl(work / "train.jsonl", rng)


@pytest.fixture(scope="module")
def user_run(side_python, tmp_path_factory, module_rng, hf_archs, run_side):
  work = tmp_path_factory.mktemp("user")
  make_checkpoints(side_python, run_side, hf_archs, work, module_rng, "qwen3")
  run_main(work, "qwen3", "('data', 'cache', 'train', 'eval', 'export')")
  return work


def test_exported_student_loads_in_transformers(side_python, user_run, packed_inputs, run_side,
                                                assert_parity):
  work = user_run
  export = work / "run" / "export"
  assert (export / "tokenizer.json").exists()
  inputs = packed_inputs(vocab=280)
  np.savez(work / "inputs.npz", **inputs)
  run_side(side_python, {"logits": [dict(dir=str(export), inputs=str(work / "inputs.npz"),
                                         out=str(work / "export.npy"))]}, work)
  model, cfg = hf.load(str(export))
  assert cfg.real_vocab_size == 280  # the padded rows stayed out of the student's softmax
  assert_parity(model, inputs, np.load(work / "export.npy"))


def test_student_moved_towards_teacher(user_run):
  results = json.load(open(user_run / "run" / "eval.json"))
  assert results["student"]["kl"] < results["student_init"]["kl"]


def test_eval_report_has_the_hf_teacher(user_run):
  """The Hugging Face teacher is evaluated on the held-out cache it wrote: its KL to its own
  top-k is ~0 and its top-1 agrees, and its CE is the reference row."""
  results = json.load(open(user_run / "run" / "eval.json"))
  assert list(results) == ["student_init", "teacher", "student"]
  teacher = results["teacher"]
  assert abs(teacher["kl"]) < 1e-3 and teacher["top1_agreement"] > 0.999
  assert teacher["positions"] == results["student"]["positions"] > 0
  assert 0 < teacher["ce"] < 2 * np.log(300)


def test_student_with_another_tokenizer_is_refused(user_run):
  work = user_run
  import shutil
  other = work / "student_other_tokenizer"
  shutil.copytree(work / "qwen3_student", other)
  spec = json.load(open(other / "tokenizer.json"))
  spec["model"]["vocab"]["w1"], spec["model"]["vocab"]["w2"] = 2, 1  # same size, other ids
  json.dump(spec, open(other / "tokenizer.json", "w"))
  proc = subprocess.run(
      [sys.executable, "-m", "kdjax.main", f"--config={ROOT}/configs/demo.py",
       f"--config.workdir={work}/run", f"--config.data.tokenizer={work}/qwen3",
       f"--config.student.hf_path={other}", f"--config.teacher.hf_path={work}/qwen3",
       "--config.data.seq_len=32", "--config.cache.k=16", "--config.stages=('train',)"],
      capture_output=True, text=True, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode != 0
  assert "tokenizer" in proc.stderr.splitlines()[-1]


@pytest.fixture(scope="module", params=["qwen3_moe_norm", "gpt_oss"])
def moe_teacher_run(request, side_python, tmp_path_factory, module_rng, hf_archs, run_side):
  """Stages data, cache, train and eval with a mixture-of-experts teacher from transformers."""
  work = tmp_path_factory.mktemp(request.param)
  make_checkpoints(side_python, run_side, hf_archs, work, module_rng, request.param)
  run_main(work, request.param, "('data', 'cache', 'train', 'eval')")
  return work


def test_student_distils_from_a_moe_teacher(moe_teacher_run):
  from kdjax import cache
  store = cache.open(moe_teacher_run / "run" / "cache" / "train.zarr")
  assert store.k == 16 and store.num_seqs > 0
  results = json.load(open(moe_teacher_run / "run" / "eval.json"))
  assert results["student"]["kl"] < results["student_init"]["kl"]


def test_a_checkpoint_teacher_corrected_on_the_data_writes_the_cache(
    side_python, tmp_path, module_rng, hf_archs, run_side):
  """Stage pretrain with teacher.hf_path fine-tunes that checkpoint on the train split (teacher
  correction); the cache, and eval's teacher row, are then the corrected teacher's."""
  from kdjax import teacher
  make_checkpoints(side_python, run_side, hf_archs, tmp_path, module_rng, "qwen3")
  run_main(tmp_path, "qwen3", "('data', 'pretrain', 'cache', 'train', 'eval')",
           "--config.pretrain.steps=3", "--config.pretrain.batch_size=2",
           "--config.pretrain.warmup_steps=1", "--config.pretrain.ckpt_every=3")
  run = tmp_path / "run"
  attrs = json.load(open(run / "cache" / "train.zarr" / "zarr.json"))["attributes"]
  assert attrs["teacher"].endswith("qwen3, corrected by stage pretrain (<workdir>/teacher)")
  assert attrs["teacher_hash"] == teacher.weights_hash(str(run / "teacher" / "ckpt"))
  assert attrs["teacher_hash"] != teacher.weights_hash(str(tmp_path / "qwen3"))
  results = json.load(open(run / "eval.json"))
  # The teacher measured is the one that wrote the cache: no KL to its own top-k.
  assert abs(results["teacher"]["kl"]) < 1e-3 and results["teacher"]["top1_agreement"] > 0.999
