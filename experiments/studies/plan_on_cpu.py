"""XLA's memory plan of the student's training step for one H200, made on a machine without a GPU.

    KDJAX_EXTRAS=gpu bash launch/setup.sh     # JAX's CUDA plugin: XLA's GPU compiler, no GPU used
    .venv/bin/python -m experiments.studies.plan_on_cpu --config configs/128k.py --docs 16 \
        --policies full,attention,names

For each remat policy, the micro-batch program (`train.grad_step`, the program remat "auto"
plans with: training/remat_auto.py) compiled for the H200 through JAX's deviceless ahead-of-time
path (`jax.experimental.topologies` with the H200's target config: XLA's own GPU compiler, cuDNN's
attention and the Pallas loss head included), and what auto would decide: the resident arrays
(train state, gradient sum, micro-batch) plus XLA's temporaries, against MARGIN of the budget
(the H200's allocation limit at the config's mesh.memory_fraction, or opt.memory_gib). The
optimizer's program (`apply_step`) is planned once. Nothing runs, so there is no step time,
and cuDNN's attention calls get no workspace (cuDNN sizes it on the device: u8[0] here): a plan's
temporaries are below the H200's own by up to that workspace and a few GiB (0.05-0.1 GiB at 8K
one row, 2.6 at 8K two rows, 3.9 at 32K, 8.9 at 128K on 2026-12-05; the script prints the H200's
plan beside its own wherever experiments/results/e2e.jsonl has one at the same shapes). Lines go
to experiments/results/plans.jsonl.

With --kernels N, also the kernels of each policy's program as XLA compiled it, by kind (GEMMs,
XLA's elementwise and reduction fusions, cuDNN's calls, the Pallas loss head), with the bytes
their operands and results hold, per micro-batch, and the N largest elementwise fusions: the
bytes a kernel must move, not its time. Of this program only: without a GPU to autotune on, XLA
makes every GEMM a Triton GEMM fusion that absorbs casts and elementwise neighbours, where the
GPU's own program calls cuBLAS and leaves them to fusions (at 8K, one row: 64.6 GB of fusions
here against 162.7 GB on an H100; BENCHMARKS.md, "the step's fusions run near the HBM's
peak", 2026-12-05). For the GPU's, dump its
program (XLA_FLAGS="--xla_dump_to=D --xla_dump_hlo_as_text") and read it with
experiments/bench/profile_fusions.py or step_floor.py --gpu-hlo.

Model weights are never made (shapes only); the micro-batch is one synthetic row set of the
config's shape (experiments/bench/synthetic_rows.py), written to --dir.
"""
import argparse
import functools
import json
import os
import sys
import tempfile
import time

# Before JAX loads: its CUDA plugin registers XLA's GPU compiler without looking for a GPU, and
# the only backend is the CPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"

import jax
import numpy as np
from flax import nnx
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments.bench.e2e_bench import commit, load_config, today
from experiments.bench.hlo_kernels import exact_fusion_bytes, kernels
from experiments.bench.synthetic_rows import docs_arg, synthetic_cache
from kdjax import build
from kdjax.loss import LossSettings
from kdjax.models import documents, fp8, llama, remat
from kdjax.training import remat_auto, train

RESULTS = os.path.join(ROOT, "experiments", "results", "plans.jsonl")
GIB = 2**30
# The H200 as XLA describes it (XLA's target-config specs, h200.txtpb, the fields JAX 0.11.2's XLA
# reads; the CUDA runtime the GPU image's, 13.0: without it XLA makes no cuBLASLt FP8 GEMM) and
# the allocation limit JAX reports on it at a memory fraction f: f x H200_USABLE (127.9 GiB at
# 0.92, BENCHMARKS.md).
H200_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 151397597184 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 }
runtime_version { major: 13 minor: 0 }
device_description_str: "NVIDIA H200 141GB HBM3e"
"""
H200_USABLE = 127.9 / 0.92 * GIB
H200_SMS = 132
HBM_TBPS = 4.8  # the H200's HBM3e peak: GB / HBM_TBPS = ms


def as_gpu_program():
  """kdjax traced as on the GPU: its GPU paths chosen (cuDNN attention, the Pallas loss head and
  their kernel sizes), and JAX's cuDNN checks answered as on a Hopper GPU with cuDNN 9.10. Only
  tracing and compiling follow; nothing runs."""
  from jax._src.cudnn import fused_attention_stablehlo as cudnn_sdpa

  from kdjax.kernels import mosaic
  jax.default_backend = lambda: "gpu"
  cudnn_sdpa.check_compute_capability = lambda capability: True
  cudnn_sdpa.is_cuda_compute_capability_equal = lambda capability: False
  mosaic.num_sms = lambda: H200_SMS


def h200_sharding() -> NamedSharding:
  try:
    topology = topologies.get_topology_desc(platform="cuda", target_config=H200_TARGET,
                                            topology="1x1x1")
  except NotImplementedError:  # no CUDA plugin: no GPU compiler
    sys.exit("plan_on_cpu.py: XLA's GPU compiler comes with JAX's CUDA plugin, not installed "
             "here: KDJAX_EXTRAS=gpu bash launch/setup.sh")
  return NamedSharding(topologies.make_mesh(topology, (1,), ("d",)), PartitionSpec())


def on_h200(tree, sharding):
  """tree's arrays as shapes placed on the deviceless H200."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding),
                      tree)


def device_bytes(tree) -> int:
  return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def plan_of(lowered) -> tuple[dict, str]:
  """(XLA's memory plan in GiB, the optimised HLO) of a lowered program, compiled for the H200."""
  compiled = lowered.compile()
  m = compiled.memory_analysis()
  return ({key: getattr(m, f"{key}_size_in_bytes") / GIB
           for key in ("argument", "output", "alias", "temp")}, compiled.as_text())


def print_kernels(hlo: str, top: int) -> dict:
  """The kernels' bytes by kind (GB per micro-batch) and the `top` non-GEMM fusions, printed;
  returns {kind: [GB, kernels]}, with "fusions_exact": the fusions whose count is exact (a lower
  bound on the fusions' bytes, hlo_kernels.exact_fusion_bytes)."""
  found = kernels(hlo)
  by_kind = {}
  for k in found:
    gb, n = by_kind.get(k.kind, (0.0, 0))
    by_kind[k.kind] = (gb + k.bytes * k.launches / 1e9, n + k.launches)
  for kind, (gb, n) in sorted(by_kind.items(), key=lambda item: -item[1][0]):
    print(f"    {kind:32s} {gb:8.2f} GB in {n:5d} kernels: {gb / HBM_TBPS:6.2f} ms at the HBM's "
          "peak")
  fusions = sorted((k for k in found if k.kind in ("kLoop", "kInput")),
                   key=lambda k: -k.bytes * k.launches)
  for k in fusions[:top]:
    print(f"      {k.bytes * k.launches / 1e9:7.3f} GB {k.kind} {k.computation}")
  exact = exact_fusion_bytes(hlo, found) / 1e9
  print(f"    fusions counted exactly (a lower bound): {exact:.2f} GB, {exact / HBM_TBPS:.2f} ms "
        "at the HBM's peak")
  return {**{kind: [round(gb, 3), n] for kind, (gb, n) in by_kind.items()},
          "fusions_exact": [round(exact, 3), 0]}


def measured_plans(seq_len: int, docs, rows: int) -> dict:
  """The latest H200 plan of grad_step per policy at these shapes, from e2e.jsonl."""
  found = {}
  path = os.path.join(ROOT, "experiments", "results", "e2e.jsonl")
  for line in open(path):
    r = json.loads(line)
    if (r.get("kind") == "student" and "grad_step" in r.get("plan_gib", {}) and r.get("remat")
        and r.get("seq_len") == seq_len and str(r.get("docs_per_row")) == str(docs)
        and r.get("batch_size") == rows):
      found[r["remat"]] = r["plan_gib"]["grad_step"]["temp"]
  return found


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", default=os.path.join(ROOT, "configs", "8k.py"))
  p.add_argument("--docs", type=docs_arg, default=4, help="documents per row, or 'stdlib'")
  p.add_argument("--policies", default=",".join(remat.AUTO_ORDER),
                 help="comma-separated remat policies (default: auto's order)")
  p.add_argument("--set", action="append", default=[], help="group.field=value")
  p.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "kdjax_plan"))
  p.add_argument("--out", default=RESULTS)
  p.add_argument("--kernels", type=int, default=-1, metavar="N",
                 help="also each program's kernels by kind with the bytes they read and write, "
                      "and its N largest elementwise fusions")
  args = p.parse_args()

  c = load_config(args.config, args.set)
  fp8.prepare_compiler(c.student.fp8_matmuls)  # as kdjax.main: before anything compiles
  as_gpu_program()
  sharding = h200_sharding()
  seq_len, rows = c.data.seq_len, c.opt.batch_size
  model_cfg = build.model_config(c.student, c.teacher.vocab_size or 128256)
  store = synthetic_cache(os.path.join(args.dir, f"plan_{seq_len}_{rows}_{args.docs}"),
                          np.random.default_rng(0), rows=rows, seq_len=seq_len, docs=args.docs,
                          vocab=model_cfg.vocab_size, k=c.cache.k, layout=c.cache.layout)
  max_documents = documents.store_documents_bound(store)
  micro = {k: v[0] for k, v in train.to_step_batch(store.read(np.arange(rows)), 1, False).items()}

  tx, _ = train.make_optimizer(c.opt)
  loss = LossSettings.from_config(c.loss, False)
  graphdef, params = nnx.split(nnx.eval_shape(lambda: llama.Transformer(model_cfg,
                                                                         rngs=nnx.Rngs(0))))
  state, grads_sum = jax.eval_shape(functools.partial(train.init_state, tx=tx, opt_cfg=c.opt),
                                    params)
  state, grads_sum, micro = on_h200((state, grads_sum, micro), sharding)
  # The deviceless H200 has no host memory (its shardings take no memory kind): with
  # opt.state_memory "host", AdamW's moments are left out of the resident bytes and apply_step,
  # which moves them, is not planned; grad_step never reads them.
  host_moments = c.opt.state_memory == "host"
  fixed = device_bytes(({k: v for k, v in state.items() if k != "opt" or not host_moments},
                        grads_sum, micro))
  fraction = c.mesh.memory_fraction
  budget = c.opt.memory_gib * GIB if c.opt.memory_gib else fraction * H200_USABLE
  measured = measured_plans(seq_len, args.docs, rows)
  print(f"H200 plan, {rows} x {seq_len} tokens per micro-batch, {args.docs} documents a row "
        f"(bound {max_documents}); resident {fixed / GIB:.2f} GiB; budget {budget / GIB:.1f} GiB "
        f"(fits at {remat_auto.MARGIN:.0%}: {remat_auto.MARGIN * budget / GIB:.1f})", flush=True)

  base = {"date": today(), "commit": commit(),
          "command": " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
          "device": "H200 (deviceless compile on CPU)",
          "xla_flags": os.environ.get("XLA_FLAGS", ""), "seq_len": seq_len, "batch_size": rows,
          "docs_per_row": args.docs, "max_documents": max_documents,
          "resident_gib": fixed / GIB, "budget_gib": budget / GIB}
  lines = []
  _, metrics = jax.eval_shape(functools.partial(
      train.grad_step, graphdef=graphdef, loss=loss, max_documents=max_documents),
      train.trained(state), grads_sum, micro)
  t0 = time.perf_counter()
  apply_plan = None
  if host_moments:
    print("apply_step: not planned (AdamW's moments in host memory)", flush=True)
  else:
    apply_plan, _ = plan_of(train.apply_step.lower(
        state, grads_sum, [metrics] * c.opt.accum_steps, tx=tx, state_memory=c.opt.state_memory))
    print(f"apply_step: temporaries {apply_plan['temp']:.2f} GiB "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
  for policy in args.policies.split(","):
    g, cfg = remat_auto.with_policy(graphdef, model_cfg, policy)
    kept = remat.saved_bytes_per_token(cfg, policy) * rows * seq_len * cfg.n_layers
    t0 = time.perf_counter()
    plan, hlo = plan_of(train.grad_step.lower(train.trained(state), grads_sum, micro,
                                              graphdef=g, loss=loss, max_documents=max_documents))
    compile_s = time.perf_counter() - t0  # lowering and XLA's compile, on this CPU
    need = fixed / GIB + plan["temp"]
    fits = need * GIB <= remat_auto.MARGIN * budget
    was = measured.get(policy)
    print(f"{policy:>15}: temporaries {plan['temp']:7.2f} GiB (kept values, lower bound "
          f"{kept / GIB:.2f}), needs {need:7.2f}: {'fits' if fits else 'does not fit'}"
          + (f"; the H200's own plan {was:.2f}" if was is not None else "")
          + f" ({compile_s:.0f} s)", flush=True)
    by_kind = print_kernels(hlo, args.kernels) if args.kernels >= 0 else None
    lines.append({**base, "remat": policy, "grad_step_gib": plan, "apply_step_gib": apply_plan,
                  "need_gib": need, "fits": fits, "h200_temp_gib": was, "compile_s": compile_s,
                  **({"grad_step_kernels_gb": by_kind} if by_kind else {})})
  if args.out:
    with open(args.out, "a") as f:
      for line in lines:
        f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
  main()
