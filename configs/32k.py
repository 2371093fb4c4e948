"""configs/8k.py's run at 32K context: the same teacher, student and data, 4x the tokens per row.

    python -m kdjax.main --config=configs/32k.py --config.teacher.hf_path=PATH \
        --config.data.tokenizer=PATH --config.data.source=data.jsonl

Needs and prints what configs/8k.py does (one H200). remat auto plans "dots_attention" here: 32.9 s
per 32 x 32K step, 31.8k tokens/s, 101.6 GiB on the H200 with FP8, the default (bf16 42.0 s;
random weights, BENCHMARKS.md). CPU variant: --config=configs/32k.py:smoke
"""
from kdjax import recipes


def get_config(variant: str = ""):
  return recipes.long_context(32768, "runs/32k", variant)
