"""Distil an 8B-class teacher into a ~3B student at 8K context on one H200.

    python -m kdjax.main --config=configs/8k.py --config.teacher.hf_path=PATH \
        --config.data.tokenizer=PATH --config.data.source=data.jsonl

Needs: one H200 (141 GB), a Llama-3.1-8B-class Hugging Face checkpoint on disk and a jsonl/parquet
dataset. Writes the teacher's top-100 cache once (dictionary layout), then trains with the fused
loss, the student's projections in FP8 (--config.student.fp8_matmuls=False: bf16 throughout): 7.26 s
per 32 x 8K step in 88.6 GiB on an H200 (bf16 9.42 s; random weights, BENCHMARKS.md).
Logs one line per optimizer step (docs/running.md, "What training prints").
On a GPU of 48 GB: --config.student.remat=dots_attention --config.opt.state_memory=host
--config.opt.batch_size=1 --config.opt.accum_steps=32 (AdamW's moments in host memory: 8.74 s
per step in 45.0 GiB on an H200; bf16 11.0 s).
CPU variant for tests: --config=configs/8k.py:smoke
"""
from kdjax import recipes


def get_config(variant: str = ""):
  return recipes.long_context(8192, "runs/8k", variant)
