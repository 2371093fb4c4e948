"""configs/8k.py's run at 128K context: the same teacher, student and data, 16x the tokens per row.

    python -m kdjax.main --config=configs/128k.py --config.teacher.hf_path=PATH \
        --config.data.tokenizer=PATH --config.data.source=data.jsonl

Needs and prints what configs/8k.py does (one H200). remat auto plans "attention" here (the
attention's output kept once per layer; its planning takes a minute or two): 6.45 s per 128K
row, 20.3k tokens/s, 105.0 GiB on the H200 with FP8, the default (bf16 8.20 s); "full" in
bf16, which auto took before, 9.0-9.3 s in 88 GiB (BENCHMARKS.md, "Current numbers"):
--config.student.remat=full. CPU variant: --config=configs/128k.py:smoke
"""
from kdjax import recipes


def get_config(variant: str = ""):
  return recipes.long_context(131072, "runs/128k", variant)
