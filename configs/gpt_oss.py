"""Distil a gpt-oss teacher into a gpt-oss-shaped mixture-of-experts student on one H200.

    python -m kdjax.main --config=configs/gpt_oss.py --config.teacher.hf_path=PATH \
        --config.data.tokenizer=PATH --config.data.source=data.jsonl

Needs: one H200, a gpt-oss-120b checkpoint (MXFP4 experts; they stay packed on the GPU and are
dequantised one layer at a time) and a jsonl/parquet dataset; configs/gpt_oss.py:20b takes
gpt-oss-20b. The teacher writes its top-100 (dictionary layout) once, 64K tokens per call; the
student has gpt-oss-20b's layer shapes (32 experts, top-4, V = 201,088) with STUDENT_LAYERS
layers, float32 parameters and AdamW, and trains at 32K with the fused loss. Its attention is
plain causal (no sinks, no sliding window); both models' attention runs on cuDNN, the teacher's
sinks and sliding
windows included (kdjax/models/attention.py).
With STUDENT_LAYERS = 8 the student's step needs more than the default share of the GPU (0.92):
this config lets JAX take 0.95 (mesh.memory_fraction; BENCHMARKS.md, MoE: its peak).
CPU variant for tests: --config=configs/gpt_oss.py:smoke
"""
from kdjax import recipes

# gpt-oss-20b has 24; 8 is as many as fit one H200 with float32 AdamW at 32K (BENCHMARKS.md, MoE:
# the measured peak, and what 9 would need).
STUDENT_LAYERS = 8
VOCAB = 201088  # o200k_harmony


def gpt_oss(g, n_layers: int, n_experts: int, packed: bool):
  """gpt-oss's shapes (its config.json's values; with hf_path set they are read from there)."""
  g.update(vocab_size=VOCAB, d_model=2880, n_layers=n_layers, n_heads=64, n_kv_heads=8,
           head_dim=64, d_ff=2880, rope_theta=150000.0, norm_eps=1e-5, tie_embeddings=False,
           n_experts=n_experts, experts_per_token=4, route_renormalize=True, expert_bias=True,
           swiglu_limit=7.0, swiglu_alpha=1.702, expert_weights="mxfp4" if packed else "float",
           attention_bias=True, attention_sinks=True, sliding_window=128)
  g.rope_scaling = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                        original_max_position_embeddings=4096, truncate=False)


def get_config(variant: str = ""):
  c = recipes.long_context(32768, "runs/gpt_oss", "smoke" if variant == "smoke" else "")
  if variant == "smoke":
    c.workdir = "runs/gpt_oss_smoke"
    for g, layers in ((c.teacher, 2), (c.student, 1)):
      g.update(n_experts=4, experts_per_token=2, route_renormalize=True, expert_bias=True,
               swiglu_limit=7.0, attention_bias=True, n_layers=layers)
    c.teacher.update(attention_sinks=True, sliding_window=8)
    return c
  if variant not in ("", "20b"):
    raise ValueError(f"unknown variant {variant!r}; use configs/gpt_oss.py (gpt-oss-120b), "
                     f"configs/gpt_oss.py:20b or configs/gpt_oss.py:smoke")
  big = variant != "20b"
  c.teacher.hf_path = "checkpoints/gpt-oss-120b" if big else "checkpoints/gpt-oss-20b"
  c.data.tokenizer = c.teacher.hf_path
  gpt_oss(c.teacher, n_layers=36 if big else 24, n_experts=128 if big else 32, packed=True)
  c.teacher.update(dtype="bfloat16", param_dtype="bfloat16")
  gpt_oss(c.student, n_layers=STUDENT_LAYERS, n_experts=32, packed=False)
  # vocab_size 0: the tokenizer's (the teacher's); plain causal attention, no sinks or window
  c.student.update(vocab_size=0, attention_sinks=False, sliding_window=0, dtype="bfloat16",
                   param_dtype="float32")
  c.student.fp8_matmuls = False  # its experts have no FP8 path; FP8 not measured on this student
  c.student.rope_scaling = {}  # trained at 32K from the start: plain RoPE
  c.cache.chunk_size = 2048  # [C, V] float32 logits of the teacher: 1.5 GiB at V = 201,088
  # 64K tokens per teacher call: each call dequantises every layer's experts once (at one 8K
  # row per call that was 58% of the 120b's step), so more tokens per call share it (8 rows of
  # 8K: 2.3x the tokens/s of one; BENCHMARKS.md, MoE).
  c.cache.batch_size = max(1, 65536 // c.data.seq_len)
  c.mesh.memory_fraction = 0.95  # the student's peak at 32K needs more than 0.92 (BENCHMARKS.md)
  return c
