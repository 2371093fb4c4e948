"""The config schema: every field with its units, and the checks run before any stage starts.

`configs/*.py` start from `base()` and override values; nothing else in kdjax has defaults.
"""
import ml_collections

STAGES = ("data", "pretrain", "cache", "train", "baseline", "eval", "export")
OBJECTIVES = ("sparse", "tail", "renorm")
IMPLS = ("auto", "reference", "xla", "pallas", "pallas_exact", "paper")
LAYOUTS = ("float32", "compact")
DTYPES = ("float32", "bfloat16")


def model_group(**overrides) -> ml_collections.ConfigDict:
  g = ml_collections.ConfigDict()
  g.hf_path = ""  # Hugging Face checkpoint dir; when set, shapes below come from its config.json
  g.vocab_size = 0  # embedding rows (0 = the tokenizer's vocabulary size)
  g.d_model = 256  # residual width
  g.n_layers = 4  # transformer blocks
  g.n_heads = 4  # query heads
  g.n_kv_heads = 2  # key/value heads (grouped-query attention)
  g.head_dim = 64  # per-head width
  g.d_ff = 768  # SwiGLU hidden width
  g.rope_theta = 10000.0  # RoPE base
  g.rope_scaling = ml_collections.ConfigDict()  # llama3 rope scaling; empty = none
  g.norm_eps = 1e-5  # RMSNorm epsilon
  g.tie_embeddings = False  # lm_head = embedding.T
  g.qk_norm = False  # RMSNorm on queries and keys (Qwen3)
  g.dtype = "float32"  # activation / matmul dtype
  g.param_dtype = "float32"  # parameter storage dtype
  g.remat = True  # recompute each block in backward (activation memory ~ one block)
  g.attention_impl = "auto"  # "auto" (cuDNN flash attention on GPU in bf16, else einsum), "einsum", "cudnn"
  g.update(overrides)
  return g


def opt_group(**overrides) -> ml_collections.ConfigDict:
  g = ml_collections.ConfigDict()
  g.lr = 3e-3  # peak learning rate
  g.min_lr_ratio = 0.1  # cosine floor as a fraction of lr
  g.warmup_steps = 20  # linear warmup, optimizer steps
  g.weight_decay = 0.1  # AdamW decoupled decay (matrices only)
  g.b1 = 0.9  # Adam beta1
  g.b2 = 0.95  # Adam beta2
  g.grad_clip = 1.0  # global-norm clipping threshold
  g.steps = 200  # optimizer steps
  g.batch_size = 16  # sequences per micro-batch
  g.accum_steps = 1  # micro-batches per optimizer step (global batch = batch_size * accum_steps)
  # Memory levers (BENCHMARKS.md measures each): the dtype of the gradient sum over micro-batches
  # (bfloat16 saves 2 bytes/param, rounding each micro-batch's gradient once), the dtype AdamW
  # keeps its moments in (bfloat16 stores 4 bytes/param less, but the update's float32 copies
  # still set the peak as built; keep b2 <= 0.99 with it), and where the moments live between
  # updates ("host": pinned host memory, copied in for each update).
  g.accum_dtype = "float32"
  g.state_dtype = "float32"
  g.state_memory = "device"
  g.log_every = 10  # steps between console / metrics.jsonl lines
  g.ckpt_every = 100  # steps between orbax checkpoints (one is also written on exit)
  g.update(overrides)
  return g


def base() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.workdir = "runs/demo"  # every output of the run lives here
  c.seed = 0  # model init, data order
  c.stages = ("data", "cache", "train", "eval")  # run in order; each skips complete work

  c.data = ml_collections.ConfigDict()
  c.data.source = "stdlib"  # "stdlib" (Python's own sources) or a .jsonl / .parquet path
  c.data.text_field = "text"  # jsonl/parquet field holding plain text
  c.data.messages_field = "messages"  # field holding chat turns (used when present)
  c.data.loss_mask = "all"  # "all" tokens or "assistant" turns only (chat data)
  c.data.max_bytes = 4_000_000  # soft cap on text read, bytes (0 = none)
  c.data.seq_len = 256  # tokens per packed sequence
  c.data.eval_every = 20  # documents 0, n, 2n, ... are held out for evaluation
  c.data.tokenizer = ""  # tokenizer.json or HF dir; "" = train a BPE on the source
  c.data.vocab_size = 2048  # BPE size when training a tokenizer

  c.teacher = model_group()
  c.pretrain = opt_group()  # only when the teacher is trained here (stage "pretrain")

  c.student = model_group(d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=384)

  c.cache = ml_collections.ConfigDict()
  c.cache.path = ""  # cache directory; "" = <workdir>/cache
  c.cache.k = 100  # teacher top-k entries kept per position
  c.cache.layout = "float32"  # "float32" or "compact" (quantised log-probs, small ids)
  c.cache.batch_size = 8  # sequences per teacher forward pass
  c.cache.chunk_size = 128  # positions per teacher lm_head chunk (bounds [B, C, V] logits)
  c.cache.rank = 0  # this writer's index: several processes/hosts write disjoint regions
  c.cache.world = 1  # number of writers (rank r writes regions r, r + world, ...)

  c.loss = ml_collections.ConfigDict()
  c.loss.objective = "sparse"  # "sparse" (paper), "tail" (+ one bucket for 1 - top-k mass), "renorm"
  c.loss.temperature = 1.0  # softening; see kdjax.kernels for the exact definition
  c.loss.ce_weight = 0.0  # weight of hard-label cross-entropy mixed into the distillation loss
  # "auto" (pallas on GPU, xla on CPU), "xla", "pallas", "pallas_exact", "paper", "reference"
  c.loss.impl = "auto"
  c.loss.chunk_size = 0  # positions per loss chunk (bounds the [C, V] working set); 0: automatic
  c.loss.dw_dtype = "float32"  # lm_head gradient accumulated across chunks in: "float32", "bfloat16"
  # Log the student's top-1 agreement and entropy per step, from the loss's own pass (one more
  # row reduction in its kernel; not with impl "paper", whose algorithm has none).
  c.loss.position_metrics = True

  c.opt = opt_group()  # student training (stages "train" and "baseline")

  c.eval = ml_collections.ConfigDict()
  c.eval.batch_size = 8  # sequences per evaluation step
  c.eval.max_seqs = 0  # cap on held-out sequences (0 = all)
  return c


def _require(ok: bool, msg: str):
  if not ok:
    raise ValueError(f"config: {msg}")


def _check_model(name: str, g):
  if g.hf_path:
    return  # shapes come from the checkpoint and are checked on load
  for f in ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff"):
    _require(g[f] > 0, f"{name}.{f} must be > 0 (got {g[f]})")
  _require(g.vocab_size >= 0, f"{name}.vocab_size must be >= 0 (0 = tokenizer size)")
  _require(g.n_heads % g.n_kv_heads == 0,
           f"{name}.n_heads ({g.n_heads}) must be a multiple of {name}.n_kv_heads ({g.n_kv_heads})")
  _require(g.dtype in DTYPES and g.param_dtype in DTYPES, f"{name} dtypes must be one of {DTYPES}")


def _check_opt(name: str, g):
  _require(g.lr > 0, f"{name}.lr must be > 0")
  _require(0 <= g.min_lr_ratio <= 1, f"{name}.min_lr_ratio must be in [0, 1]")
  _require(0 <= g.warmup_steps < max(g.steps, 1), f"{name}.warmup_steps must be in [0, steps)")
  _require(g.steps > 0 and g.batch_size > 0 and g.accum_steps > 0,
           f"{name}.steps, batch_size and accum_steps must be > 0")
  _require(g.log_every > 0 and g.ckpt_every > 0, f"{name}.log_every and ckpt_every must be > 0")
  _require(g.grad_clip > 0 and g.weight_decay >= 0, f"{name}.grad_clip must be > 0, weight_decay >= 0")
  for field in ("accum_dtype", "state_dtype"):
    _require(g[field] in DTYPES, f"{name}.{field} must be one of {DTYPES}, got {g[field]!r}")
  _require(g.state_memory in ("device", "host"),
           f"{name}.state_memory must be 'device' or 'host', got {g.state_memory!r}")


def validate(c: ml_collections.ConfigDict):
  """Raises ValueError naming the field and the allowed values."""
  unknown = [s for s in c.stages if s not in STAGES]
  _require(not unknown, f"unknown stages {unknown}; choose from {STAGES}")
  order = [STAGES.index(s) for s in c.stages]
  _require(order == sorted(order), f"stages must run in the order {STAGES}")
  _require(c.data.seq_len >= 8, "data.seq_len must be >= 8")
  _require(c.data.loss_mask in ("all", "assistant"), "data.loss_mask must be 'all' or 'assistant'")
  _require(c.data.eval_every >= 2, "data.eval_every must be >= 2")
  _require(c.cache.k > 0, "cache.k must be > 0")
  _require(c.cache.layout in LAYOUTS, f"cache.layout must be one of {LAYOUTS}")
  _require(c.cache.batch_size > 0 and c.cache.chunk_size > 0, "cache.batch_size, chunk_size > 0")
  _require(0 <= c.cache.rank < c.cache.world, "cache.rank must be in [0, cache.world)")
  _require(c.loss.objective in OBJECTIVES, f"loss.objective must be one of {OBJECTIVES}")
  _require(c.loss.impl in IMPLS, f"loss.impl must be one of {IMPLS}")
  _require(c.loss.temperature > 0, "loss.temperature must be > 0")
  _require(c.loss.ce_weight >= 0, "loss.ce_weight must be >= 0")
  _require(c.loss.chunk_size >= 0, "loss.chunk_size must be >= 0 (0: sized by the kernel)")
  _require(c.loss.dw_dtype in ("float32", "bfloat16"),
           "loss.dw_dtype must be 'float32' or 'bfloat16'")
  _require(c.eval.batch_size > 0 and c.eval.max_seqs >= 0, "eval.batch_size > 0, eval.max_seqs >= 0")
  _check_model("teacher", c.teacher)
  _check_model("student", c.student)
  _require("pretrain" not in c.stages or not c.teacher.hf_path,
           "stage 'pretrain' trains a teacher from scratch; drop it when teacher.hf_path is set")
  _check_opt("opt", c.opt)
  _check_opt("pretrain", c.pretrain)
