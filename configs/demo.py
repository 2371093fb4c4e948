"""The embedded demo: distillation on real text with nothing downloaded, on a laptop CPU.

    bash launch/demo.sh            # = set up, then: python -m kdjax.main --config=configs/demo.py

Needs: CPU only, ~2 GB RAM, a few minutes. Corpus: the Python standard library's own sources.
Stages: tokenise (a BPE trained here) -> pre-train a small teacher on hard labels -> cache its
top-100 -> distil a 4x smaller student -> train the same student on hard labels only -> evaluate.
Prints a report: the student's KL to the teacher and held-out cross-entropy before and after
distillation, next to the hard-label student. Outputs in runs/demo/; the student as a Hugging Face
checkpoint in runs/demo/export/.
Variants: configs/demo.py:smoke (tiny shapes, for tests), configs/demo.py:large (a 27M-parameter
teacher on 6 MB of the corpus, the same student; for a GPU: experiments/studies/fidelity.py).
"""
from kdjax import config


def get_config(variant: str = ""):
  c = config.base()
  c.workdir = "runs/demo"
  c.stages = ("data", "pretrain", "cache", "train", "baseline", "eval", "export")
  c.data.max_bytes = 2_000_000
  c.data.seq_len = 128
  c.data.vocab_size = 2048
  c.teacher.update(d_model=192, n_layers=4, n_heads=6, n_kv_heads=2, head_dim=32, d_ff=512)
  c.pretrain.update(lr=3e-3, steps=250, batch_size=16, warmup_steps=20, ckpt_every=100)
  c.student.update(d_model=96, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=24, d_ff=256)
  c.opt.update(lr=3e-3, steps=200, batch_size=16, warmup_steps=20, ckpt_every=100)
  c.cache.k = 100
  c.loss.chunk_size = 512
  if variant == "smoke":
    c.workdir = "runs/demo_smoke"
    c.data.max_bytes = 300_000
    c.data.seq_len = 64
    c.data.vocab_size = 512
    c.teacher.update(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128)
    c.student.update(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64)
    c.pretrain.update(steps=6, batch_size=4, warmup_steps=2, log_every=2, ckpt_every=3)
    c.opt.update(steps=6, batch_size=4, warmup_steps=2, log_every=2, ckpt_every=3)
    c.cache.k = 16
    c.loss.chunk_size = 64
  elif variant == "large":  # a teacher 11x the demo's (27M parameters), for one GPU (fidelity)
    c.workdir = "runs/demo_large"
    c.data.max_bytes = 6_000_000
    c.teacher.update(d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, head_dim=64, d_ff=1536,
                     dtype="bfloat16")
    c.pretrain.update(lr=1e-3, steps=1500, batch_size=32, warmup_steps=100, ckpt_every=500,
                      log_every=50)
    c.cache.batch_size = 64
  elif variant:
    raise ValueError(f"unknown variant {variant!r}; use configs/demo.py, configs/demo.py:smoke "
                     f"or configs/demo.py:large")
  return c
