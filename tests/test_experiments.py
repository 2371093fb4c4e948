"""Every script in experiments/ (bench/, studies/, archive/) starts as experiments/README.md runs
it, `python -m experiments.FOLDER.NAME` from the repository root: `--help` exits 0, so its imports
resolve (a renamed kdjax module or a moved sibling fails here). The cheap ones also run on a CPU;
e2e_bench.py and paper_table.py runs are in test_e2e_bench.py, cache_floor.py's and
cache_context.py's in test_cache_floor.py. kdjax's scripts for the side venv (torch) compile.
"""
import glob
import gzip
import json
import os
import py_compile
import shlex
import subprocess
import sys
import types

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# FOLDER/NAME of every script
SCRIPTS = sorted(os.path.splitext(os.path.relpath(path, os.path.join(ROOT, "experiments")))[0]
                 for path in glob.glob(os.path.join(ROOT, "experiments", "*", "*.py"))
                 if os.path.basename(path) != "__init__.py")
# Scripts without --help, and why; their work sits under `if __name__ == "__main__"`, so an
# import runs none of it.
IMPORT_ONLY = {
    "studies/demo_ab": "the demo studies' shared module: no entry point",
    "bench/e2e_sweep": "e2e_bench.py's named configurations: no entry point",
    "bench/synthetic_rows": "the benchmarks' synthetic rows and cache: no entry point",
    "bench/loss_bench_report": "loss_bench.py's table and plot: no entry point",
    "bench/hlo_kernels": "plan_on_cpu.py's and profile_fusions.py's HLO kernels: no entry point",
    "bench/gpu_watch": "e2e_bench.py's nvidia-smi sampling: no entry point",
    "bench/mgpu_probe": "positional M K V, no flags: --help would run the full-size probe",
    "studies/recipe_report": "recipe_study.py's table and plot: no entry point",
    "studies/recipe_schedule": "recipe_study.py's arms and their order: no entry point",
}
WITH_HELP = [name for name in SCRIPTS if name not in IMPORT_ONLY]
# Runs each script as `python -m experiments.FOLDER.NAME --help` would (__name__ "__main__"; an
# IMPORT_ONLY one imported), in one interpreter rather than one each: {name: [exit status,
# stdout]}. Each starts with no experiment module loaded.
EVERY_SCRIPT = """
import contextlib, io, json, os, runpy, sys, traceback
results = {}
for name, main in json.loads(sys.argv[1]).items():
  module = "experiments." + name.replace("/", ".")
  for key in [key for key, m in sys.modules.items()
              if os.sep + "experiments" + os.sep in (getattr(m, "__file__", None) or "")]:
    del sys.modules[key]
  sys.argv, out, status = [module, "--help"], io.StringIO(), 0
  with contextlib.redirect_stdout(out):
    try:
      runpy.run_module(module, run_name="__main__" if main else module, alter_sys=main)
    except SystemExit as e:
      status = e.code or 0
    except BaseException:
      status, out = 1, io.StringIO(traceback.format_exc())
  results[name] = [status, out.getvalue()]
print(json.dumps(results))
"""


def run(args, timeout=120):
  """python ARGS from the repository root on the CPU; the finished process."""
  return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                        timeout=timeout, env={**os.environ, "JAX_PLATFORMS": "cpu"})


@pytest.fixture(scope="module")
def every_script():
  names = {name: name not in IMPORT_ONLY for name in SCRIPTS}
  proc = run(["-c", EVERY_SCRIPT, json.dumps(names)], timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.splitlines()[-1])


def test_every_exception_names_a_script():
  assert set(IMPORT_ONLY) <= set(SCRIPTS)


# One xdist worker runs the tests of every_script (a subprocess importing every script), not each.
@pytest.mark.xdist_group("every_script")
@pytest.mark.parametrize("name", WITH_HELP)
def test_help(name, every_script):
  status, out = every_script[name]
  assert status == 0, out[-3000:]
  assert out.startswith("usage:"), out[:500]


@pytest.mark.xdist_group("every_script")
@pytest.mark.parametrize("name", sorted(IMPORT_ONLY))
def test_imports(name, every_script):
  status, out = every_script[name]
  assert status == 0, out[-3000:]


@pytest.mark.parametrize("name", ["hf_reference", "convert"])
def test_side_venv_scripts_compile(name, tmp_path):
  py_compile.compile(os.path.join(ROOT, "kdjax", "smollm2", f"{name}.py"),
                     cfile=str(tmp_path / f"{name}.pyc"), doraise=True)


def test_cache_read_bench_tiny(tmp_path):
  proc = run(["-m", "experiments.bench.cache_read_bench", "--dir", str(tmp_path), "--rows", "8",
              "--seq-len", "64", "--k", "4", "--vocab", "100", "--batch-size", "2",
              "--batches", "2"])
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "tokens/s" in proc.stdout, proc.stdout
  proc = run(["-m", "experiments.bench.cache_read_bench", "--dir", str(tmp_path), "--seq-len", "64",
              "--k", "4", "--vocab", "70000", "--batch-size", "2", "--write-rounds", "2",
              "--compare-writes", "compact,dictionary"])
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = proc.stdout.splitlines()
  assert len(lines) == 2 and "(1.00x compact)" in lines[0] and "dictionary" in lines[1], lines


def test_cache_codecs_tiny():
  proc = run(["-m", "experiments.studies.cache_codecs", "--synthetic-vocab", "500", "--rows", "2",
              "--seq-len", "32"])
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [line for line in proc.stdout.splitlines() if line.startswith("| topk_")]
  assert len(rows) == 14 and sum("(the layout's)" in line for line in rows) == 2, proc.stdout
  assert "topk_order [2, 500]" in proc.stdout, proc.stdout


def test_step_floor_from_the_committed_results():
  """experiments/studies/step_floor.py on the results committed for configs/128k.py: the floor
  of remat full and of the layers that fit kept whole, each against the target; at 8K, with the
  fusions' bytes of a GPU's compiled program."""
  proc = run(["-m", "experiments.studies.step_floor"])
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "floor, remat full, as measured:" in proc.stdout and "layers kept whole" in proc.stdout
  # and at 8K with the elementwise work as the H100 compiled it (the committed program)
  proc = run(["-m", "experiments.studies.step_floor", "--config", "configs/8k.py", "--docs", "4",
              "--run", "8k-none", "--gpu-hlo",
              "experiments/results/plans/h100_8k_1row_none_grad_step_hlo.txt.gz"])
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "elementwise as XLA's fusions on the GPU (129.1 GB" in proc.stdout, proc.stdout


HLO = """HloModule m

%fused_add (p0: f32[4,8], p1: f32[4,8]) -> f32[4,8] {
  %p0 = f32[4,8]{1,0} parameter(0)
  ROOT %a = f32[4,8]{1,0} add(%p0, %p0)
}

%body (arg: (s32[], bf16[16])) -> (s32[], bf16[16]) {
  %arg = (s32[], bf16[16]) parameter(0)
  %x = bf16[16]{0} get-tuple-element(%arg), index=1
  %y = bf16[16]{0} fusion(%x), kind=kLoop, calls=%fused_neg
  ROOT %t = (s32[], bf16[16]) tuple(%i, %y)
}

ENTRY %main (a: f32[4,8], w: bf16[8,2]) -> f32[4,8] {
  %a = f32[4,8]{1,0} parameter(0)
  %w = bf16[8,2]{1,0} parameter(1)
  %f = f32[4,8]{1,0} fusion(%a, %a), kind=kLoop, calls=%fused_add
  %g = bf16[4,2]{1,0} fusion(%f, %w), kind=kCustom, calls=%gemm_fusion, backend_config={"kind":"__triton_gemm"}
  %c = (bf16[4,2]{1,0}, u8[0]{0}) custom-call(%g), custom_call_target="__cudnn$fmhaSoftmax"
  %n = f32[4,2]{1,0} fusion(%c#0), kind=kLoop, calls=%fused_convert
  %l = (s32[], bf16[16]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %r = f32[4,8]{1,0} copy(%f)
}
"""


def test_hlo_kernels_counts_kernel_bytes():
  """hlo_kernels.kernels on a hand-written module: an elementwise fusion's operands and result
  (3 x 128 B), a GEMM fusion (128 + 32 + 16 B), a custom call (16 B in, 16 out), a fusion
  reading the first element of the call's tuple ("%c#0": 16 B in, 32 out), a copy, and a loop
  body's fusion (64 B) launched once per trip (3); fused_ops names a fusion's operations;
  exact_fusion_bytes leaves out the loop's."""
  from experiments.bench import hlo_kernels
  found = hlo_kernels.kernels(HLO)
  assert [tuple(k) for k in found] == [
      ("kLoop", 384, "fused_add", 1, "f"), ("gemm", 176, "gemm_fusion", 1, "g"),
      ("__cudnn$fmhaSoftmax", 32, "__cudnn$fmhaSoftmax", 1, "c"),
      ("kLoop", 48, "fused_convert", 1, "n"), ("kLoop", 64, "fused_neg", 3, "y"),
      ("copy", 256, "r", 1, "r")]
  assert hlo_kernels.fused_ops(HLO, "fused_add") == "add"
  assert hlo_kernels.exact_fusion_bytes(HLO, found) == 384 + 48  # not the loop body's


def test_profile_fusions_joins_a_trace_with_its_hlo(tmp_path):
  """profile_fusions.py on a hand-made trace of HLO's module: the fusion "f" (384 B a call)
  twice in 1 ns in all is 768 GB/s, 16% of the H200's HBM; a kernel of another program is left
  out."""
  gpu = {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}}
  event = lambda op, module, dur: {"ph": "X", "pid": 7, "name": op, "ts": 0, "dur": dur,
                                   "args": {"hlo_op": op, "hlo_module": module}}
  trace = {"traceEvents": [gpu, event("f", "jit_grad_step", 5e-4),
                           event("f", "jit_grad_step", 5e-4), event("g", "jit_grad_step", 2.0),
                           event("f", "jit_apply_step", 9.0)]}
  with gzip.open(tmp_path / "perfetto_trace.json.gz", "wt") as f:
    json.dump(trace, f)
  (tmp_path / "hlo.txt").write_text(HLO)
  proc = run(["-m", "experiments.bench.profile_fusions", str(tmp_path), str(tmp_path / "hlo.txt")])
  assert proc.returncode == 0, proc.stderr[-3000:]
  line = next(line for line in proc.stdout.splitlines() if line.endswith("f: add"))
  assert line.split()[2:6] == ["2", "0.0", "768", "16%"], line
  assert "2 kernels, 3 launches" in proc.stdout, proc.stdout


def test_every_sweep_entry_parses_and_its_config_validates(monkeypatch):
  """Each named configuration of e2e_bench.py sweep (e2e_sweep.SWEEP): its arguments parse and
  its config with its overrides passes config.validate, so a GPU call never fails on a typo."""
  monkeypatch.chdir(ROOT)
  from experiments.bench import e2e_bench, e2e_sweep
  parser = e2e_bench.build_parser()
  for name, line in e2e_sweep.SWEEP.items():
    args = parser.parse_args(shlex.split(line))
    assert args.mode in ("student", "teacher"), name
    e2e_bench.load_config(args.config, args.set)


def test_smollm2_study_fp8_arms(monkeypatch, tmp_path):
  """smollm2_study.py --fp8: bf16 and FP8 arms of each seed, alike but for student.fp8_matmuls,
  each in a workdir of its own."""
  from experiments.studies import smollm2_study
  prep = smollm2_study.prep_config(str(tmp_path), "smoke")
  arms = smollm2_study.arms(400_000, fp8_ab=True)
  configs = [smollm2_study.arm_config(prep, str(tmp_path), a) for a in arms]
  assert [(a["seed"], a["fp8"]) for a in arms] == [(0, False), (0, True), (1, False), (1, True)]
  assert [c.student.fp8_matmuls for c in configs] == [a["fp8"] for a in arms]
  assert len({c.workdir for c in configs}) == 4
  for bf16, fp8 in zip(configs[::2], configs[1::2]):
    assert fp8.workdir == bf16.workdir.replace("_k100_", "_k100_fp8_")
    fp8.student.fp8_matmuls, fp8.workdir = False, bf16.workdir
    assert fp8.to_dict() == bf16.to_dict()
  assert not any(a.get("fp8") for a in smollm2_study.arms(400_000))


def test_profile_summary_per_step_scales_the_micro_batches(tmp_path):
  """--per-step 2 16: a traced step of 2 micro-batches scaled to 16 (x8) for the micro-batch
  program's kernels, the optimizer's once; arithmetic sums matmul, attention and loss head. The
  SwiGLU kernel is a matmul, the loss head's Mosaic kernel not."""
  gpu = {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}}
  event = lambda name, module, dur: {"ph": "X", "pid": 7, "name": name, "ts": 0, "dur": dur,
                                     "args": {"hlo_module": module}}
  trace = {"traceEvents": [gpu, event("nvjet_sm90_tst", "jit_grad_step", 0.75e6),
                           event("mosaic_swiglu", "jit_grad_step", 0.25e6),  # a matmul
                           event("cudnn_sdpa_bprop", "jit_grad_step", 0.5e6),
                           event("mosaic_loss_head", "jit_grad_step", 0.25e6),
                           event("loop_add_fusion", "jit_grad_step", 0.125e6),
                           event("loop_add_fusion", "jit_apply_step", 0.5e6)]}
  path = tmp_path / "trace.json.gz"
  with gzip.open(path, "wt") as f:
    json.dump(trace, f)
  proc = run(["-m", "experiments.bench.profile_summary", str(path), "--per-step", "2", "16"])
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = {line.split()[0]: float(line.split()[-2]) for line in proc.stdout.splitlines()}
  assert got == {"matmul": 8.0, "experts": 0.0, "attention": 4.0, "loss": 2.0, "optimizer": 0.5,
                 "copies": 0.0, "other": 1.0, "arithmetic": 14.0, "kernels": 15.5}, got


def test_step_floor_counts_by_hand():
  """floor() on a one-layer model of width 2 (28 matmul parameters a layer, lm_head 2, 32 in
  all), one token at 1 FLOP/s and 1 B/s: matmuls fwd 2 + bwd 4 FLOPs a parameter, 2 more for
  each the policy reruns (full, attention: 24, all but the MLP's down; names: 4, the attention's
  output projection); elementwise 34 + 34 elements of 2 bytes, the forward's again under remat;
  AdamW 28 bytes a parameter."""
  from experiments.studies import step_floor
  cfg = types.SimpleNamespace(d_model=2, n_heads=1, head_dim=2, n_kv_heads=1, d_ff=2,
                              n_layers=1, output_vocab_size=1, n_experts=0,
                              experts_per_token=1)
  assert step_floor.elementwise_elements(cfg) == (34, 34)
  f = lambda *a, **k: step_floor.floor(cfg, *a[:2], 1, 1.0, 1.0, 10.0, 100.0, **k)
  opt = 28 * 32
  assert f("full", 3) == dict(matmuls=228, attention=330.0, elementwise=204, optimizer=opt)
  assert f("full", 3, whole_layers=1) == dict(matmuls=180, attention=300.0, elementwise=136,
                                              optimizer=opt)
  assert f("full", 3, keep_attention=True) == dict(matmuls=228, attention=300.0,
                                                   elementwise=204, optimizer=opt)
  assert f("dots", 1) == dict(matmuls=180, attention=110.0, elementwise=204, optimizer=opt)
  assert f("dots_attention", 1)["attention"] == f("names", 1)["attention"] == 100.0
  assert f("names", 1)["matmuls"] == 188
  assert f("attention", 3) == f("full", 3, keep_attention=True)
  assert f("none", 1) == dict(matmuls=180, attention=100.0, elementwise=136, optimizer=opt)


def test_documents_per_row_windows():
  """Each document in the smallest window of the ladder that holds it; the rest in the row."""
  from experiments.studies import documents_per_row
  t = 1024
  row = np.zeros(t, np.int32)
  row[:100], row[100:200], row[200:300] = 1, 2, 3  # in the first 256-window, 2 in its second half
  row[300:700] = 4  # 400 tokens from 300: no 256- or 512-window; the offset 512-window at 256
  row[700:1000] = 5  # in the second 512-window
  other = np.zeros(t, np.int32)
  other[500:800] = 1  # crosses 512 and 768: no window of <= T / 2 holds it, the whole row does
  plan = documents_per_row.windows_plan(np.stack([row, other]))
  assert plan == {(256, 0): 2, (256, 128): 1, (512, 0): 1, (512, 256): 1, (1024, 0): 1}, plan


@pytest.mark.slow  # about 50 s: five kdjax.main processes
def test_pipeline_bench_smoke(tmp_path):
  """The documented CPU check: every stage on the smoke config, a 2048-entry tokenizer."""
  out = tmp_path / "pipeline.jsonl"
  proc = run(["-m", "experiments.bench.pipeline_bench", "--config", "configs/8k.py:smoke",
              "--small", "--work", str(tmp_path / "work"), "--out", str(out)], timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(out.read_text().splitlines()[-1])
  assert list(result["stages"]) == ["data", "cache", "train", "eval", "export"]
  assert result["eval"]["student"]["positions"] > 0


@pytest.mark.slow  # a minute and more on 2 cores: the kernels' own checks are test_grouped's
def test_moe_matmul_bench_small(tmp_path):
  """The grouped-matmul benchmark on one small shape: a JSON line with every timing, the
  kernels' results (here the reference's: no GPU) equal to ragged_dot's."""
  out = tmp_path / "mm.jsonl"
  proc = run(["-m", "experiments.bench.moe_matmul_bench", "--small", "--tokens", "64",
              "--out", str(out)])
  assert proc.returncode == 0, proc.stderr[-3000:]
  line = json.loads(out.read_text())
  for name in ("ragged_dot", "kernel", "kernel_transposed", "kernel_backward", "dense"):
    assert line[f"{name}_ms"] > 0
  assert line["routed_gflop"] > 0 and line["kernels"] is False
  assert line["kernel_max_rel_error"] < 1e-2 and line["kernel_transposed_max_rel_error"] < 1e-2


@pytest.mark.slow  # about 100 s: eight tiny students
def test_fidelity_smoke(tmp_path):
  """The fidelity study end to end on the demo's smoke shapes, one k and one seed: every
  objective, online, and the best objective's temperature-2, CE-mix and hidden-state arms, as
  JSON lines."""
  out = tmp_path / "fidelity.jsonl"
  proc = run(["-m", "experiments.studies.fidelity", "--variant", "smoke", "--seeds", "0",
              "--ks", "4", "--out", str(tmp_path / "runs"), "--results", str(out)], timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = [json.loads(line) for line in out.read_text().splitlines()]
  assert [r["objective"] for r in lines[:4]] == ["sparse", "tail", "renorm", "online"]
  # the best objective's arms: temperature 2, CE mix, hidden states whole (64) and projected (16)
  assert {(r["temperature"], r["ce_weight"], r["hidden_dim"]) for r in lines[4:]} == {
      (2.0, 0.0, 0), (1.0, 0.5, 0), (1.0, 0.0, 64), (1.0, 0.0, 16)}
  for r in lines:
    assert {"objective", "k", "seed", "teacher", "full_kl", "top1", "ce", "ece",
            "bytes_per_position"} <= set(r) and r["full_kl"] > 0 and 0 <= r["ece"] <= 1
  assert lines[0]["bytes_per_position"] > 0 and lines[3]["bytes_per_position"] == 0
  assert lines[-1]["hidden_bytes_per_position"] > 0
  assert (tmp_path / "fidelity_smoke.png").exists()


def test_clock_samples_and_their_summary(monkeypatch):
  """nvidia-smi's lines as gpu_watch.GpuWatch reads them; a window's median clock and the
  share of its samples held by the power cap."""
  from experiments.bench import gpu_watch
  lines = ["2026/12/05 18:40:35.046, 81559, 1980, 127.67, 0x0000000000000000",
           "2026/12/05 18:40:36.047, 90000, 1530, 339.77, 0x0000000000000004",
           "2026/12/05 18:40:37.047, 90000, 1635, 693.25, 0x0000000000000004",
           "2026/12/05 18:40:38.047, 90000, 1500, 694.22, 0x0000000000000000",
           "2026/12/05 18:40:39.047, [N/A], 1500, 694.22, 0x0000000000000000"]
  samples = [gpu_watch.gpu_sample(line) for line in lines]
  assert samples[-1] is None and samples[0][1:] == (81559.0, 1980.0, 127.67, 0)
  t = [x[0] for x in samples[:4]]
  assert t == sorted(t) and abs(t[1] - t[0] - 1.001) < 1e-6
  summary = gpu_watch.clock_summary(samples[:4], t[1], t[3])
  assert summary == {"sm_mhz_median": 1530.0, "power_w_median": 693.25,
                     "power_capped_share": 0.667, "samples": 3}
  assert gpu_watch.clock_summary(samples[:4], t[3] + 1, t[3] + 2) == {}
