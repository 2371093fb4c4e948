"""The builders configs/*.py share: an 8B-class teacher distilled into a ~3B student at long
context (configs/8k.py, 32k.py, 128k.py, 256k.py, and the start of configs/gpt_oss.py).

Here rather than in configs/ so that a config file loaded by path (ml_collections loads
`--config=configs/8k.py` as a file, not as a module of a package) imports it like any module.
"""
from kdjax import config
from kdjax.errors import UserError


def llama_8b_teacher(c):
  # Llama-3.1-8B-Instruct shapes; with teacher.hf_path set they are read from its config.json.
  c.teacher.update(hf_path="checkpoints/Llama-3.1-8B-Instruct", vocab_size=128256, d_model=4096,
                   n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, d_ff=14336,
                   rope_theta=500000.0, dtype="bfloat16", param_dtype="bfloat16")
  c.teacher.rope_scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_position_embeddings=8192)


def llama_3b_student(c):
  # Llama-3.2-3B shapes, trained from scratch unless student.hf_path names a checkpoint; its
  # vocabulary is the tokenizer's (Llama-3's: 128256), so another teacher's tokenizer just works.
  c.student.update(vocab_size=0, d_model=3072, n_layers=28, n_heads=24, n_kv_heads=8,
                   head_dim=128, d_ff=8192, rope_theta=500000.0, tie_embeddings=True,
                   dtype="bfloat16", param_dtype="float32")
  # The fastest rematerialisation that fits the GPU (training/remat_auto.py); student.remat="full"
  # is the smallest setting (its time and memory: BENCHMARKS.md, "Current numbers").
  c.student.remat = "auto"
  # The block's projections on FP8 tensor cores: the 8K and 32K steps took 0.805x and 0.774x
  # bf16's time on an H100, and SmolLM2-135M's distilled student was no worse in either seed
  # (BENCHMARKS.md, "FP8 by default"). student.fp8_matmuls=False: bf16 throughout.
  c.student.fp8_matmuls = True


def long_context(seq_len: int, workdir: str, variant: str):
  c = config.base()
  c.workdir = workdir
  c.stages = ("data", "cache", "train", "eval")
  c.data.source = "data/train.jsonl"
  c.data.tokenizer = "checkpoints/Llama-3.1-8B-Instruct"
  c.data.max_bytes = 0
  c.data.seq_len = seq_len
  llama_8b_teacher(c)
  llama_3b_student(c)
  c.cache.k = 100
  # Ids coded per row by their frequency, packed's log-probs: on SmolLM2's 8K rows 229 B/pos
  # against compact's 285, half its gradient error, written 1.6x faster (BENCHMARKS.md, "The
  # dictionary layout").
  c.cache.layout = "dictionary"
  c.cache.batch_size = 1
  c.cache.chunk_size = 4096
  c.loss.chunk_size = 0  # sized by the loss kernel to the memory it has
  # 32 rows per optimizer step; at 8K two per micro-batch (fewer, larger matmuls, half the
  # gradient sums: faster, within the memory; BENCHMARKS.md, "The configs' defaults").
  rows = 2 if seq_len <= 8192 else 1
  c.opt.update(lr=1e-4, steps=2000, batch_size=rows, accum_steps=32 // rows, warmup_steps=100,
               log_every=1, ckpt_every=50)
  # The gradient sum over 32 micro-batches in bf16: 2 bytes a parameter less for the 3B student,
  # which keeps 8K within its memory target with float32 AdamW (BENCHMARKS.md, e2e: the
  # measured peaks); float32 is the exact one.
  c.opt.accum_dtype = "bfloat16"
  c.eval.batch_size = 1
  c.eval.max_seqs = 64
  if variant == "smoke":
    # Same stages on CPU in seconds: stdlib text, a BPE trained here, a teacher pre-trained here.
    c.workdir = workdir + "_smoke"
    c.stages = ("data", "pretrain", "cache", "train", "eval")
    c.data.update(source="stdlib", tokenizer="", max_bytes=200_000, seq_len=96, vocab_size=384)
    for g in (c.teacher, c.student):
      g.update(hf_path="", vocab_size=0, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
               head_dim=16, d_ff=64, dtype="float32", param_dtype="float32")
    c.student.fp8_matmuls = False  # a CPU has no FP8 tensor cores
    c.pretrain.update(steps=4, batch_size=2, warmup_steps=1, log_every=2, ckpt_every=2)
    c.opt.update(steps=4, batch_size=1, accum_steps=2, warmup_steps=1, log_every=2, ckpt_every=2)
    c.cache.update(k=8, chunk_size=32)
    c.loss.chunk_size = 40  # not a divisor of seq_len: exercises the padded last chunk
    c.eval.max_seqs = 4
  elif variant:
    raise UserError(f"unknown variant {variant!r}; the only variant is ':smoke'")
  return c
