"""configs/8k.py's run at 256K context: the same teacher, student and data, 32x the tokens per row.

    python -m kdjax.main --config=configs/256k.py --config.teacher.hf_path=PATH \
        --config.data.tokenizer=PATH --config.data.source=data.jsonl

Needs and prints what configs/8k.py does (one H200). What makes a 256K row fit: remat "full",
AdamW's moments in host memory and JAX's allocator replaced by CUDA's own (mesh.allocator
"platform": the step's ~113 GiB block of temporaries found no room in JAX's pool);
mesh.memory_fraction 0.97 as in the run that measured it: 20.0 s per row (13.1k tokens/s) and
132.0 GiB on the H200, the first step 193 s with its compile (BENCHMARKS.md).
CPU variant: --config=configs/256k.py:smoke
"""
from kdjax import recipes


def get_config(variant: str = ""):
  c = recipes.long_context(262144, "runs/256k", variant)
  if variant == "smoke":
    return c
  c.student.remat = "full"
  c.opt.state_memory = "host"
  c.mesh.allocator = "platform"
  c.mesh.memory_fraction = 0.97
  c.student.fp8_matmuls = False  # the 132 GiB above were bf16's; FP8 not measured at 256K
  return c
