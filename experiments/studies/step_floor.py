"""The fastest a student step can be on one GPU, from measured kernel rates: a floor.

    python -m experiments.studies.step_floor [--config configs/128k.py --docs 16 \
        --run 128k-full-profile] [--gemm-tflops 790 --hbm-tbps 4.8] [--target-tokens-per-s 18000]
    python -m experiments.studies.step_floor --config configs/8k.py --docs 4 --run 8k \
        --target-tokens-per-s 30840
    python -m experiments.studies.step_floor --config configs/32k.py --docs 8 --run 32k \
        --target-tokens-per-s 26000
    python -m experiments.studies.step_floor --config configs/8k.py --docs 4 --run 8k \
        --target-tokens-per-s 30840 \
        --gpu-hlo experiments/results/plans/h100_8k_2rows_none_grad_step_hlo.txt.gz

The step as measured last (experiments/results/e2e.jsonl's latest line named --run: its remat
policy, rows per micro-batch, memory). Its floor counts only the work that must run, each part at
the best rate measured for it on the GPU or the GPU's peak, and nothing else (no gaps, no loss
head softmax, no gradient sums, no kernel above its best rate: all of them only add):
  * matmuls: the blocks' projections forward and backward (6 N_blocks FLOPs per token; 2 more
    per parameter the policy's backward runs through again, llama.rerun_matmul_params_per_layer:
    all but the MLP's down under "full" and "attention", the attention's output projection under
    "names"), the lm_head forward and backward (6 d V), at
    --gemm-tflops (790: what this H200's bf16 GEMMs reach, the issue's figure; the 128K
    profile's own ran at ~776);
  * attention: each layer's forward (twice where the policy reruns it: "full", "dots") and its
    backward, at the best cuDNN time measured for the same rows alone
    (experiments/results/attention.jsonl, lines of `attention_bench.py --seq-len T --rows B
    --docs D`, any --docs-per-call or --bound);
  * elementwise: the bytes the block's norms, RoPE, SwiGLU product and residual adds must read
    and write, each read and written once (ELEMENTWISE), forward twice under any remat policy,
    at --hbm-tbps (4.8: the H200's HBM3e peak);
    With --gpu-hlo (the micro-batch program as a GPU compiled it: XLA_FLAGS="--xla_dump_to=D
    --xla_dump_hlo_as_text", D's *grad_step*after_optimizations.txt), also the floor with the
    elementwise work as XLA's fusions do it there: the bytes they move (those counted exactly,
    a lower bound) at the same peak. (plan_on_cpu.py's programs will not do: without a GPU to
    autotune on, XLA takes Triton GEMMs that absorb elementwise work the GPU's cuBLAS GEMMs
    leave to fusions.);
  * optimizer: AdamW's update, 28 bytes a parameter (float32 parameter and moments read and
    written, the bf16 gradient read and bf16 copy written), at the same peak.
With remat "full" (the only policy whose kept values fit at 128K, kdjax/models/remat.py), also
the best mix the GPU memory the measured run left free could hold: layers kept whole (remat
"none", at least remat.saved_bytes_per_token("none") per token each; a mix of policies over the
layers is not built) and the other layers' attention outputs kept (output and log-normaliser,
one per layer: remat "attention").
"""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments.bench import e2e_bench
from kdjax import build
from kdjax.models import llama, remat

RESULTS = os.path.join(ROOT, "experiments", "results")
# The H200's memory as JAX counts it: its bytes_limit was 127.9 GiB at a memory fraction of 0.92
# (BENCHMARKS.md, "Rematerialisation", 2026-12-03).
GPU_GIB = 127.9 / 0.92


def lines(path):
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def best_attention(lines_, seq_len, rows, docs):
  """(forward s, forward + backward s) per layer and micro-batch of `rows` rows: the fastest
  packed line of these rows, else of more rows scaled down to `rows` (a larger call runs no
  slower per row: still a floor)."""
  found = [r for r in lines_ if r.get("name") == "packed" and r.get("seq_len") == seq_len
           and r.get("rows", 0) >= rows and r.get("docs") == docs and "fwd_bwd_ms" in r]
  if not found:
    sys.exit(f"no attention_bench line for --seq-len {seq_len} --rows {rows} (or more) --docs "
             f"{docs} in experiments/results/attention.jsonl: run it on the GPU first")
  exact = [r for r in found if r["rows"] == rows]
  best = min(exact or found, key=lambda r: r["fwd_bwd_ms"] / r["rows"])
  return (best["fwd_ms"] * rows / best["rows"] / 1e3, best["fwd_bwd_ms"] * rows / best["rows"]
          / 1e3)


RERUN_ATTENTION = ("full", "dots")  # policies that rerun the attention's forward


def elementwise_elements(cfg) -> tuple[int, int]:
  """(forward, backward) elements per token that one block's elementwise work reads and writes,
  each op fused with nothing but read and written once. Forward: RMSNorm x2 (read x, write y:
  2d each), RoPE (q and k in and out: 2 (q + kv)), residual adds x2 (3d each), SwiGLU product
  (gate and up in, h out: 3f). Backward: SwiGLU's (gate, up, dh in; dgate, dup out: 5f), RMSNorm
  x2 (x and dy in, dx out, added to the residual's gradient: 4d each), RoPE's (2 (q + kv))."""
  d, f = cfg.d_model, cfg.d_ff
  qk = (cfg.n_heads + cfg.n_kv_heads) * cfg.head_dim
  return 10 * d + 2 * qk + 3 * f, 8 * d + 2 * qk + 5 * f


def floor(cfg, policy, micro_batches, tokens, gemm_flops_per_s, hbm_bytes_per_s, fwd_s,
          fwd_bwd_s, whole_layers=0, keep_attention=False) -> dict:
  """{matmuls, attention, elementwise, optimizer: seconds} of a step of `tokens` tokens in
  `micro_batches` micro-batches under remat `policy`; whole_layers of its layers kept whole (no
  second forward), the others' attention outputs kept if keep_attention."""
  d, n = cfg.d_model, cfg.n_layers
  block = llama.matmul_params_per_layer(cfg)
  rerun = 0 if policy == "none" else n - whole_layers  # layers whose forward runs again
  # fwd 2, bwd 4 FLOPs a parameter; 2 more for each the policy's backward runs through again
  rerun_params = llama.rerun_matmul_params_per_layer(cfg, policy)
  attention_reruns = rerun if policy in RERUN_ATTENTION and not keep_attention else 0
  fwd_el, bwd_el = elementwise_elements(cfg)
  params = n * block + 2 * d * cfg.output_vocab_size  # and the embedding
  return {
      "matmuls": ((6 * n * block + 2 * rerun * rerun_params + 6 * d * cfg.output_vocab_size)
                  * tokens / gemm_flops_per_s),
      "attention": micro_batches * (n * fwd_bwd_s + attention_reruns * fwd_s),
      "elementwise": ((n * (fwd_el + bwd_el) + rerun * fwd_el) * 2 * tokens
                      / hbm_bytes_per_s),
      "optimizer": 28 * params / hbm_bytes_per_s}


def gpu_fusion_gb(path, rows, seq_len):
  """GB per micro-batch that XLA's elementwise and reduction fusions move in a GPU's compiled
  micro-batch program (its optimised HLO text, .txt or .txt.gz), counting only those whose bytes
  are exact (hlo_kernels.exact_fusion_bytes: a lower bound). The program must be of the measured
  run's micro-batch: its tokens s32[rows, seq_len]."""
  from experiments.bench import hlo_kernels, profile_fusions
  hlo = profile_fusions.read_text(path)
  if f"s32[{rows},{seq_len}]" not in hlo:
    sys.exit(f"{path} holds no s32[{rows},{seq_len}] array: not the program of the measured "
             f"run's micro-batch ({rows} x {seq_len} tokens)")
  return hlo_kernels.exact_fusion_bytes(hlo, hlo_kernels.kernels(hlo)) / 1e9


def mixes(cfg, free_gib, row_tokens):
  """[(label, whole layers, keep attention)]: the mixes of layers kept whole and attention
  outputs kept that fit in free_gib, per micro-batch of row_tokens tokens."""
  whole_gib = remat.saved_bytes_per_token(cfg, "none") * row_tokens / 2**30
  attention_gib = row_tokens * cfg.n_heads * (cfg.head_dim * 2 + 4) / 2**30  # bf16 out, f32 lse
  found = []
  for keep in (False, True):
    for whole in range(cfg.n_layers + 1):
      need = whole * whole_gib + (cfg.n_layers - whole) * attention_gib * keep
      if need <= free_gib:
        found.append((f"{whole} layers kept whole (>= {whole_gib:.2f} GiB each)"
                       + (f", the others' attention outputs kept ({attention_gib:.2f} GiB each)"
                          if keep else "") + f": {need:.1f} of {free_gib:.1f} GiB free",
                       whole, keep))
  return found


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default="configs/128k.py")
  p.add_argument("--docs", type=int, default=16, help="documents per row, as the sweep packs")
  p.add_argument("--run", default="128k-full-profile",
                 help="the name of the measured step's lines in e2e.jsonl (its latest is read)")
  p.add_argument("--gemm-tflops", type=float, default=790.0)
  p.add_argument("--hbm-tbps", type=float, default=4.8)
  p.add_argument("--target-tokens-per-s", type=float, default=18000.0)
  p.add_argument("--memory-fraction", type=float, default=0.0,
                 help="of the GPU a run may take (0: the measured run's)")
  p.add_argument("--gpu-hlo", default="",
                 help="the measured micro-batch's program as a GPU compiled it (HLO text, .gz)")
  p.add_argument("--results", default="",
                 help="append one JSON line per floor here (experiments/results/floors.jsonl)")
  args = p.parse_args()
  c = e2e_bench.load_config(os.path.join(ROOT, args.config), [])
  cfg = build.model_config(c.student, c.teacher.vocab_size or 128256)
  t = c.data.seq_len
  runs = [r for r in lines(os.path.join(RESULTS, "e2e.jsonl"))
          if r.get("name") == args.run and r.get("kind") == "student" and r.get("seq_len") == t
          and r.get("docs_per_row") == args.docs]
  if not runs:
    sys.exit(f"no e2e_bench line named {args.run!r} of {t}-token rows with --docs {args.docs} "
             "in experiments/results/e2e.jsonl: run it on the GPU first")
  run = runs[-1]
  rows, accum, policy = run["batch_size"], run["accum_steps"], run["remat"]
  tokens = rows * accum * t
  fwd_s, fwd_bwd_s = best_attention(lines(os.path.join(RESULTS, "attention.jsonl")), t, rows,
                                    args.docs)
  target_s = tokens / args.target_tokens_per_s
  print(f"{args.config}: {accum} micro-batches of {rows} x {t} tokens, {args.docs} documents a "
        f"row, remat {policy}; target {args.target_tokens_per_s:,.0f} tokens/s = "
        f"{target_s:.2f} s per step")
  print(f"measured ({run['commit']}, {run['date']}): {run['step_s']:.2f} s, "
        f"{run['tokens_per_s']:,.0f} tokens/s, peak {run['peak_gib']:.1f} GiB"
        + (f"; profile: matmul {run['profile']['shares']['matmul']:.1%}, attention "
           f"{run['profile']['shares']['attention']:.1%}" if "profile" in run else ""))
  print(f"attention alone, best: forward {1e3 * fwd_s:.2f} ms, forward + backward "
        f"{1e3 * fwd_bwd_s:.2f} ms per layer and micro-batch; matmuls at "
        f"{args.gemm_tflops:.0f} TFLOP/s, memory at {args.hbm_tbps:g} TB/s")
  rates = (args.gemm_tflops * 1e12, args.hbm_tbps * 1e12)
  cases = [(f"remat {policy}, as measured", 0, False)]
  if args.gpu_hlo:  # the elementwise work as XLA's fusions do it on the GPU
    fusion_gb = gpu_fusion_gb(args.gpu_hlo, rows, t)
    cases.append((f"remat {policy}, as measured, elementwise as XLA's fusions on the GPU "
                  f"({fusion_gb:.1f} GB a micro-batch, those counted exactly)", 0, False))
  if policy == "full":
    fraction = args.memory_fraction or run["mem_fraction"]
    free_gib = fraction * GPU_GIB - run["peak_gib"]
    found = mixes(cfg, free_gib, rows * t)
    best = lambda group: min(group, key=lambda m: sum(
        floor(cfg, policy, accum, tokens, *rates, fwd_s, fwd_bwd_s, m[1], m[2]).values()))
    cases.append(best([m for m in found if not m[2]]))
    every_layer = [m for m in found if m[2] and not m[1]]  # remat "attention" as it is
    if every_layer:
      cases.append(("remat attention, " + every_layer[0][0], 0, True))
      cases.append(best([m for m in found if m[2]]))
  for label, whole, keep in cases:
    parts = floor(cfg, policy, accum, tokens, *rates, fwd_s, fwd_bwd_s, whole, keep)
    if "XLA's fusions" in label:
      parts["elementwise"] = fusion_gb * 1e9 * accum / rates[1]
    total = sum(parts.values())
    if args.results:
      e2e_bench.record({
          "config": args.config, "docs": args.docs, "case": label, "remat": policy,
          "whole_layers": whole, "attention_kept": keep,
          **{f"{k}_s": v for k, v in parts.items()},
          "floor_s": total, "floor_tokens_per_s": tokens / total, "target_s": target_s,
          "measured_step_s": run["step_s"], "measured_commit": run["commit"],
          "gemm_tflops": args.gemm_tflops, "hbm_tbps": args.hbm_tbps,
          "attention_fwd_s": fwd_s, "attention_fwd_bwd_s": fwd_bwd_s,
          "commit": e2e_bench.commit(), "date": e2e_bench.today(),
          "device": "computed on a CPU from the H200's measured lines",
          "command": " ".join(["python -m experiments.studies.step_floor", *sys.argv[1:]])},
          args.results)
    print(f"  floor, {label}:")
    print("    " + " + ".join(f"{k} {v:.2f}" for k, v in parts.items())
          + f" = {total:.2f} s, {tokens / total:,.0f} tokens/s: "
          + (f"above the target by {total - target_s:.2f} s (not reachable)"
             if total > target_s else
             f"{target_s - total:.2f} s left for the rest (measured step - floor: "
             f"{run['step_s'] - total:.2f} s)"))


if __name__ == "__main__":
  main()
