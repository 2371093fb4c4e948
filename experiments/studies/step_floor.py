"""The fastest a student step can be on one GPU, from measured kernel rates: a floor.

    python experiments/studies/step_floor.py [--config configs/128k.py --docs 16 \
        --run 128k-full-profile] [--gemm-tflops 790] [--target-tokens-per-s 18000]
    python experiments/studies/step_floor.py --config configs/8k.py --docs 4 --run 8k \
        --target-tokens-per-s 30840
    python experiments/studies/step_floor.py --config configs/32k.py --docs 8 --run 32k \
        --target-tokens-per-s 26000

The step as measured last (experiments/results/e2e.jsonl's latest line named --run: its remat
policy, rows per micro-batch, memory). Its floor counts only the work that must run,
each part at the best rate measured for it on the GPU, and nothing else (no norms, RoPE,
SwiGLU, residuals, loss head softmax, optimizer, or gaps: all of them only add):
  * the matmuls: blocks' projections forward and backward (6 N_blocks FLOPs per token; 8 where
    the policy recomputes them, "full"), the lm_head forward and backward (6 d V), at
    --gemm-tflops (790: what this H200's bf16 GEMMs reach, the issue's figure; the 128K
    profile's own ran at ~776);
  * the attention: each layer's forward (twice where the policy reruns it: "full", "dots",
    "names") and its backward, at the best cuDNN time measured for the same rows alone
    (experiments/results/attention.jsonl, lines of `attention_bench.py --seq-len T --rows B
    --docs D`, any --docs-per-call or --bound).
With remat "full" (the only policy whose kept values fit at 128K, kdjax/models/remat.py), also
the floor with as many layers as fit kept whole (remat "none": no second forward) in the GPU
memory the measured run left free, each costing at least remat.saved_bytes_per_token("none")
per token.
If even that floor is slower than the target, no rematerialisation mix reaches it on this GPU
with these kernels; the script says how much faster than cuDNN's the attention would have to run.
"""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "experiments", "bench"))
from e2e_bench import load_config  # noqa: E402
from kdjax import build  # noqa: E402
from kdjax.models import remat  # noqa: E402

RESULTS = os.path.join(ROOT, "experiments", "results")
GPU_GIB = 139.8  # what the H200 reports as its memory (jax's bytes_limit at fraction 1)


def lines(path):
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def best_attention(lines_, seq_len, rows, docs):
  """(forward s, forward + backward s) per layer and micro-batch of `rows` rows: the fastest
  packed line of these rows."""
  found = [r for r in lines_ if r.get("name") == "packed" and r.get("seq_len") == seq_len
           and r.get("rows") == rows and r.get("docs") == docs and "fwd_bwd_ms" in r]
  if not found:
    sys.exit(f"no attention_bench line for --seq-len {seq_len} --rows {rows} --docs {docs} in "
             "experiments/results/attention.jsonl: run it on the GPU first")
  best = min(found, key=lambda r: r["fwd_bwd_ms"])
  return best["fwd_ms"] / 1e3, best["fwd_bwd_ms"] / 1e3


RERUN_MATMULS = ("full",)  # policies that recompute the projections in the backward pass
RERUN_ATTENTION = ("full", "dots", "names")  # ... and the attention's forward


def floor(cfg, policy, micro_batches, tokens, gemm_flops_per_s, fwd_s, fwd_bwd_s,
          whole_layers=0):
  """(matmul s, attention s) of a step of `tokens` tokens in `micro_batches` micro-batches
  under remat `policy`, whole_layers of its layers kept whole (no second forward)."""
  d, q, kv, f, n = (cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim,
                    cfg.d_ff, cfg.n_layers)
  block = d * q * 2 + d * kv * 2 + 3 * d * f  # one layer's matmul parameters
  rerun = n - whole_layers  # layers whose forward runs again
  passes = 6 * n + (2 * rerun if policy in RERUN_MATMULS else 0)  # fwd 2, bwd 4 per layer
  gemm_s = (passes * block + 6 * d * cfg.output_vocab_size) * tokens / gemm_flops_per_s
  attention_s = micro_batches * (n * fwd_bwd_s
                                 + (rerun * fwd_s if policy in RERUN_ATTENTION else 0))
  return gemm_s, attention_s


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default="configs/128k.py")
  p.add_argument("--docs", type=int, default=16, help="documents per row, as the sweep packs")
  p.add_argument("--run", default="128k-full-profile",
                 help="the name of the measured step's lines in e2e.jsonl (its latest is read)")
  p.add_argument("--gemm-tflops", type=float, default=790.0)
  p.add_argument("--target-tokens-per-s", type=float, default=18000.0)
  p.add_argument("--memory-fraction", type=float, default=0.0,
                 help="of the GPU a run may take (0: the measured run's)")
  args = p.parse_args()
  c = load_config(os.path.join(ROOT, args.config), [])
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
        f"{args.gemm_tflops:.0f} TFLOP/s")
  cases = [(f"remat {policy}", 0)]
  if policy == "full":
    fraction = args.memory_fraction or run["mem_fraction"]
    free_gib = fraction * GPU_GIB - run["peak_gib"]
    layer_gib = remat.saved_bytes_per_token(cfg, "none") * rows * t / 2**30
    whole = max(0, min(cfg.n_layers, int(free_gib // layer_gib)))
    cases.append((f"{whole} layers kept whole in {free_gib:.1f} GiB free at {fraction:.2f} "
                  f"(>= {layer_gib:.2f} GiB each)", whole))
  for label, k in cases:
    gemm_s, attention_s = floor(cfg, policy, accum, tokens, args.gemm_tflops * 1e12, fwd_s,
                                fwd_bwd_s, k)
    total = gemm_s + attention_s
    verdict = "above the target: not reachable" if total > target_s else "below the target"
    print(f"  floor, {label}: matmuls {gemm_s:.2f} s + attention {attention_s:.2f} s = "
          f"{total:.2f} s, {tokens / total:,.0f} tokens/s ({verdict})")
    if total > target_s:
      print(f"    to reach the target with every other kernel free, the attention would take "
            f"<= {target_s - gemm_s:.2f} s: {attention_s / (target_s - gemm_s):.2f}x cuDNN's "
            "best rate")
    else:
      print(f"    left for everything else (norms, RoPE, SwiGLU, residuals, loss head, "
            f"optimizer, the attention above its best): {target_s - total:.2f} s; measured "
            f"{run['step_s'] - total:.2f} s")


if __name__ == "__main__":
  main()
