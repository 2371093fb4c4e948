"""configs/8k.py's run at 128K context: the same teacher, student and data, 16x the tokens per row.

    python -m kdjax.main --config=configs/128k.py --config.teacher.hf_path=PATH \
        --config.data.tokenizer=PATH --config.data.source=data.jsonl

Needs and prints what configs/8k.py does (one H200). remat auto takes "full" here (the only
policy that fits; its planning ~3 min); one 128K row per micro-batch, 9.0-9.3 s each on the H200
(BENCHMARKS.md, "Current numbers"). CPU variant: --config=configs/128k.py:smoke
"""
from kdjax import recipes


def get_config(variant: str = ""):
  return recipes.long_context(131072, "runs/128k", variant)
