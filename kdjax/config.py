"""The config schema: every field with its units, and the checks run before any stage starts.

`configs/*.py` start from `base()` and override values. The defaults live here, except the model
groups' fields, owned by kdjax.models.llama.ModelConfig (imported where a group is built or
checked); every list of choices comes from kdjax.choices, which the implementing modules read too,
so importing this module loads no JAX, flax, optax or TensorStore.
"""
import difflib
import re

import ml_collections

from kdjax.choices import (
  DIVERGENCES,
  DTYPES,
  LAYOUTS,
  LOSS_IMPLS as IMPLS,
  LOSS_MASKS,
  OBJECTIVES as CACHED_OBJECTIVES,
  TEACHER_DEVICES,
)
from kdjax.errors import UserError

# The choices are kdjax.choices' (imported above), except those of the training code:
# training.train takes each of these (tests/test_train.py runs them). The stages are owned here:
# kdjax.pipeline runs stage_<name> for each, in this order.
STAGES = ("data", "pretrain", "cache", "train", "baseline", "eval", "export")
# The cached objectives (kdjax.loss.objectives) and "online": the teacher in the step.
OBJECTIVES = CACHED_OBJECTIVES + ("online",)
STATE_MEMORIES = ("device", "host")  # where AdamW's moments live between updates
DOCUMENTS_BOUNDS = ("store", "micro_batch")  # whose documents bound a grad_step compiles for


def model_group(**overrides) -> ml_collections.ConfigDict:
  """A teacher or student group: hf_path, then every field of kdjax.models.llama.ModelConfig with
  its default (documented there); vocab_size 0 takes the tokenizer's size."""
  from kdjax.models import llama  # here, not above: importing this module loads no flax
  g = ml_collections.ConfigDict()
  g.hf_path = ""  # Hugging Face checkpoint dir; when set, the shapes come from its config.json
  for f in llama.ModelConfig.config_fields():
    g[f.name] = ml_collections.ConfigDict() if f.name == "rope_scaling" else f.default
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
  # The documents bound each micro-batch's attention runs with (kdjax.models.attention): "store",
  # the fullest row's of the whole cache (one compiled program per run), or "micro_batch", its
  # own (at most log2(T) + 1 programs, compiled as they first occur; cuDNN's packed backward
  # costs calls x documents x T, so rows of few documents pay less where some rows hold many:
  # experiments/studies/documents_per_row.py). On 8K rows as real code packs, "micro_batch"
  # measured 0.4% faster per step and 35 s more compiling (BENCHMARKS.md, "the teacher
  # writing the dictionary layout, the step re-measured, the documents bound", 2026-12-05).
  g.documents_bound = "store"
  # Device memory the step may plan for, GiB: the model group's remat "auto" picks the fastest
  # policy that fits it (kdjax/training/remat_auto.py). 0: what JAX may allocate on the device.
  g.memory_gib = 0.0
  g.log_every = 10  # steps between console / metrics.jsonl lines
  # Dense bf16 peak of the GPU in TFLOP/s, for the logged MFU (0: known GPUs from a table in
  # kdjax/training/train.py; on others MFU is not logged)
  g.peak_tflops = 0.0
  g.keep_checkpoints = 2  # latest checkpoints kept on disk (older ones deleted)
  g.ckpt_every = 100  # steps between orbax checkpoints (one is also written on exit)
  # The batch reader (kdjax.cache.Loader): threads reading and decoding batches (0: min(4, CPU
  # cores)), and batches read ahead of the step
  g.loader_workers = 0
  g.loader_prefetch = 4
  g.update(overrides)
  return g


def base() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.workdir = "runs/demo"  # every output of the run lives here
  c.seed = 0  # model init, data order
  c.stages = ("data", "cache", "train", "eval")  # run in order; each skips complete work
  # Compiled XLA programs kept on disk (JAX's persistent compilation cache), so a rerun (a resumed
  # crash, a later stage, the next run of the same shapes) loads them instead of compiling again:
  # minutes at long context. "workdir": <workdir>/compile_cache; or a folder; "" off.
  c.compile_cache = "workdir"

  c.data = ml_collections.ConfigDict()
  c.data.source = "stdlib"  # "stdlib" (Python's own sources) or a .jsonl / .parquet path
  c.data.text_field = "text"  # jsonl/parquet field holding plain text
  c.data.messages_field = "messages"  # field holding chat turns (used when present)
  c.data.loss_mask = "all"  # "all" tokens or "assistant" turns only (chat data)
  c.data.max_bytes = 4_000_000  # soft cap on text read, bytes (0 = none)
  c.data.seq_len = 256  # tokens per packed sequence
  c.data.eval_every = 20  # documents 0, n, 2n, ... are held out for evaluation
  # held-out documents: .jsonl/.parquet path(s); "" = every data.eval_every-th document of
  # data.source (when set, every document of data.source is trained on)
  c.data.eval_source = ""
  c.data.tokenizer = ""  # tokenizer.json or HF dir; "" = train a BPE on the source
  c.data.vocab_size = 2048  # BPE size when training a tokenizer

  # The teacher only runs forward: its MLP in swiglu's kernel where that applies (8B teacher,
  # H200: +1.6% tokens/s at 8K, +1.8-3.0% at 32K; BENCHMARKS.md, "The SwiGLU kernel").
  c.teacher = model_group(mlp_impl="auto")
  # Stage "pretrain" trains the teacher on the train split: from scratch, or with teacher.hf_path
  # set, from that checkpoint ("teacher correction", as Minitron does: the teacher adapted to the
  # data before its cache is written; the cache, the pruned student and eval then use it).
  c.pretrain = opt_group()

  c.student = model_group(d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=384)

  # The student's starting point (kdjax/models/prune.py). With from_teacher, its n_layers,
  # d_model, n_heads, n_kv_heads and d_ff (and dtype, param_dtype and how it runs: remat,
  # attention_impl, mlp_impl) come from c.student, every other field (vocab, head_dim, RoPE,
  # norms, tying, biases) from the teacher.
  c.init = ml_collections.ConfigDict()
  c.init.from_teacher = False  # start the student from its teacher, pruned to the student's shapes
  c.init.layers = ()  # teacher layers kept, in order; () = the student.n_layers most important
  c.init.calibration_rows = 16  # rows of the train data the importances are measured on

  c.cache = ml_collections.ConfigDict()
  c.cache.path = ""  # cache directory; "" = <workdir>/cache
  c.cache.k = 100  # teacher top-k entries kept per position
  c.cache.layout = "float32"  # or "compact", "packed", "dictionary" (kdjax/cache/layout.py)
  c.cache.batch_size = 8  # sequences per teacher forward pass
  c.cache.chunk_size = 128  # positions per teacher lm_head chunk (bounds [B, C, V] logits)
  # Threads encoding, compressing and writing finished regions while the teacher computes the
  # next ones (0: min(8, CPU cores)); each holds one region (~256K positions) in host memory.
  c.cache.writers = 0
  c.cache.rank = 0  # this writer's index: several processes/hosts write disjoint regions
  c.cache.world = 1  # number of writers (rank r writes regions r, r + world, ...)
  # Rows per region, the unit of writing, of crash safety (a killed writer redoes at most the
  # regions in flight) and of the split between writers; 0 = the data store's (~256K positions)
  c.cache.region_rows = 0
  # With a mesh of several devices the teacher is sharded over "process": each process's own
  # devices (each process writes its own regions), or "all": every process's (a teacher larger
  # than one host; every process runs each batch, process 0 writes).
  c.cache.teacher_devices = "process"
  # Also cache the teacher's final hidden states (bf16, train split) for loss.hidden_weight:
  # 2 * hidden_dim bytes per position before compression; hidden_dim 0 = the teacher's width,
  # smaller = a fixed random projection to that width (kdjax/teacher.py)
  c.cache.hidden_states = False
  c.cache.hidden_dim = 0

  c.loss = ml_collections.ConfigDict()
  # "tail" (the paper's sparse KL + one bucket for the teacher's mass outside its top-k),
  # "sparse" (the paper's), "renorm" (top-k renormalised); "online": no cache, the teacher runs
  # in every step and the KL is over the full vocabulary (the reference the others approximate;
  # the teacher must fit beside the student). "tail" was closest to the teacher at every k
  # measured (docs/loss.md, "Which objective, k and options"; experiments/studies/fidelity.py).
  c.loss.objective = "tail"
  c.loss.temperature = 1.0  # softening; see kdjax.loss.topk_kl for the exact definition
  c.loss.ce_weight = 0.0  # weight of hard-label cross-entropy mixed into the distillation loss
  # With objective "online" only: what the student minimises between the teacher's distribution
  # p and its own q: "forward" KL(p || q), "reverse" KL(q || p), "skew_forward" (DistiLLM's skew
  # KL, KL(p || a p + (1 - a) q)) or "skew_reverse"; a = loss.skew (kdjax/loss/full_kl.py)
  c.loss.divergence = "forward"
  c.loss.skew = 0.1
  # Weight of the hidden-state term: squared error between the student's final hidden states
  # (through a learned projection when widths differ) and the teacher's cached ones, over the
  # teacher's squared norm (scale-free; kdjax/loss/hidden.py); needs cache.hidden_states
  c.loss.hidden_weight = 0.0
  # "auto" (pallas on GPU, xla on CPU), "xla", "pallas", "pallas_exact", "paper", "reference"
  c.loss.impl = "auto"
  c.loss.chunk_size = 0  # positions per loss chunk (bounds the [C, V] working set); 0: automatic
  # The lm_head gradient is accumulated across chunks in: "float32", "bfloat16".
  c.loss.dw_dtype = "float32"
  # Log the student's top-1 agreement and entropy per step, from the loss's own pass (one more
  # row reduction in its kernel; not with impl "paper", whose algorithm has none).
  c.loss.position_metrics = True

  c.opt = opt_group()  # student training (stages "train" and "baseline")

  c.eval = ml_collections.ConfigDict()
  c.eval.batch_size = 8  # sequences per evaluation step
  c.eval.max_seqs = 0  # cap on held-out sequences (0 = all)

  # Devices of training (kdjax/parallel.py): data x fsdp x tensor must be the device count.
  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = 1    # data-parallel groups (each a copy of the sharded state)
  c.mesh.fsdp = 1    # devices sharing one copy of parameters, gradients and AdamW state
  c.mesh.tensor = 1  # devices splitting vocabulary, heads and MLP width (same rows)
  # Several processes: a process silent this long (s) is lost (killed, crashed, its host down);
  # the others print which and exit (kdjax/peers.py), and rerunning the command resumes.
  c.mesh.failure_timeout_s = 60
  # Share of each GPU's memory JAX may allocate (XLA_PYTHON_CLIENT_MEM_FRACTION, which wins when
  # set). JAX's own default, 0.75, leaves a quarter of an H200 unused: at 0.92 remat "auto" takes
  # the faster "dots_attention" rather than "full" at 32K (BENCHMARKS.md, "The configs'
  # defaults" and "dots_attention").
  c.mesh.memory_fraction = 0.92
  # JAX's GPU allocator (XLA_PYTHON_CLIENT_ALLOCATOR, which wins when set): "" its default, a
  # pool (BFC) that must hold a program's temporaries in one free piece; "platform" allocates
  # each buffer from CUDA and frees it after use: no pool to fragment, so a step whose plan
  # needs nearly the whole GPU in one block can run (256K rows; BENCHMARKS.md), at the cost of
  # CUDA calls per buffer and no peak-memory statistics.
  c.mesh.allocator = ""
  return c


def _require(ok: bool, msg: str):
  if not ok:
    raise UserError(f"config: {msg}")


def _check_model(name: str, g):
  if g.hf_path:
    return  # shapes come from the checkpoint and are checked on load
  from kdjax.models import llama
  _require(g.vocab_size >= 0,
           f"{name}.vocab_size must be >= 0 (0 = tokenizer size), got {g.vocab_size}")
  try:
    llama.ModelConfig.from_config(g, vocab_size=g.vocab_size or 1, where=f"{name}.")
  except ValueError as e:
    _require(False, str(e).rstrip("."))


def _check_opt(name: str, g):
  # steps first: the other step counts are checked against it.
  for f in ("steps", "batch_size", "accum_steps", "log_every", "ckpt_every", "keep_checkpoints",
            "loader_prefetch"):
    _require(g[f] >= 1, f"{name}.{f} must be >= 1, got {g[f]}")
  _require(g.loader_workers >= 0,
           f"{name}.loader_workers must be >= 0 (0: min(4, cores)), got {g.loader_workers}")
  _require(g.peak_tflops >= 0, f"{name}.peak_tflops must be >= 0 (0: from the GPU's name), got "
           f"{g.peak_tflops}")
  _require(g.memory_gib >= 0, f"{name}.memory_gib must be >= 0 (0: the device's), got "
           f"{g.memory_gib}")
  _require(g.lr > 0, f"{name}.lr must be > 0, got {g.lr}")
  _require(0 <= g.min_lr_ratio <= 1, f"{name}.min_lr_ratio must be in [0, 1], got {g.min_lr_ratio}")
  _require(0 <= g.warmup_steps < g.steps,
           f"{name}.warmup_steps must be in [0, {name}.steps = {g.steps}), got {g.warmup_steps}")
  _require(g.grad_clip > 0, f"{name}.grad_clip must be > 0, got {g.grad_clip}")
  _require(g.weight_decay >= 0, f"{name}.weight_decay must be >= 0, got {g.weight_decay}")
  for field in ("accum_dtype", "state_dtype"):
    _require(g[field] in DTYPES, f"{name}.{field} must be one of {DTYPES}, got {g[field]!r}")
  _require(g.state_memory in STATE_MEMORIES,
           f"{name}.state_memory must be one of {STATE_MEMORIES}, got {g.state_memory!r}")
  _require(g.documents_bound in DOCUMENTS_BOUNDS,
           f"{name}.documents_bound must be one of {DOCUMENTS_BOUNDS}, got {g.documents_bound!r}")


def _check_init(c):
  _require(c.init.calibration_rows >= 1,
           f"init.calibration_rows must be >= 1, got {c.init.calibration_rows}")
  if not c.init.from_teacher:
    _require(not c.init.layers, "init.layers chooses the teacher layers a pruned student keeps: "
             "set init.from_teacher=True, or init.layers=()")
    return
  _require(not c.student.hf_path, "init.from_teacher prunes the teacher into the student: "
           "set student.hf_path='' (or init.from_teacher=False to start from that checkpoint)")
  if c.teacher.hf_path:
    return  # the teacher's shapes are known once its config.json is read (checks.check_inputs)
  from kdjax.models import llama, prune
  try:
    prune.group_config(llama.ModelConfig.from_config(c.teacher, vocab_size=1), c.student,
                       c.init.layers)
  except ValueError as e:
    _require(False, str(e).rstrip("."))


def validate(c: ml_collections.ConfigDict):
  """Raises UserError naming the field set wrong, its value and the allowed values."""
  unknown = [s for s in c.stages if s not in STAGES]
  _require(not unknown, f"unknown stages {unknown}; choose from {STAGES}")
  order = [STAGES.index(s) for s in c.stages]
  _require(order == sorted(order), f"stages must run in the order {STAGES}")
  _require(c.data.seq_len >= 8, f"data.seq_len must be >= 8, got {c.data.seq_len}")
  _require(c.data.loss_mask in LOSS_MASKS,
           f"data.loss_mask must be one of {LOSS_MASKS}, got {c.data.loss_mask!r}")
  _require(c.data.eval_every >= 2, f"data.eval_every must be >= 2, got {c.data.eval_every}")
  _require(c.cache.k > 0, f"cache.k must be > 0, got {c.cache.k}")
  _require(c.cache.layout in LAYOUTS,
           f"cache.layout must be one of {LAYOUTS}, got {c.cache.layout!r}")
  for f in ("batch_size", "chunk_size", "world"):
    _require(c.cache[f] > 0, f"cache.{f} must be > 0, got {c.cache[f]}")
  _require(c.cache.region_rows >= 0,
           f"cache.region_rows must be >= 0 (0: the data store's), got {c.cache.region_rows}")
  _require(c.cache.writers >= 0,
           f"cache.writers must be >= 0 (0: min(8, cores)), got {c.cache.writers}")
  _require(0 <= c.cache.rank < c.cache.world,
           f"cache.rank must be in [0, cache.world = {c.cache.world}), got {c.cache.rank}")
  _require(c.cache.teacher_devices in TEACHER_DEVICES,
           f"cache.teacher_devices must be one of {TEACHER_DEVICES}, got "
           f"{c.cache.teacher_devices!r}")
  _require(c.loss.objective in OBJECTIVES,
           f"loss.objective must be one of {OBJECTIVES}, got {c.loss.objective!r}")
  _require(c.loss.impl in IMPLS, f"loss.impl must be one of {IMPLS}, got {c.loss.impl!r}")
  _require(c.loss.temperature > 0, f"loss.temperature must be > 0, got {c.loss.temperature}")
  _require(c.loss.ce_weight >= 0, f"loss.ce_weight must be >= 0, got {c.loss.ce_weight}")
  _require(c.loss.divergence in DIVERGENCES,
           f"loss.divergence must be one of {DIVERGENCES}, got {c.loss.divergence!r}")
  _require(c.loss.divergence == "forward" or c.loss.objective == "online",
           f"loss.divergence {c.loss.divergence!r} needs the teacher's whole distribution: use "
           f"loss.objective 'online', or loss.divergence 'forward' with a cache")
  _require(0.0 < c.loss.skew < 1.0, f"loss.skew must be in (0, 1), got {c.loss.skew}")
  _require(c.cache.hidden_dim >= 0,
           f"cache.hidden_dim must be >= 0 (0: the teacher's width), got {c.cache.hidden_dim}")
  _require(c.loss.hidden_weight >= 0,
           f"loss.hidden_weight must be >= 0, got {c.loss.hidden_weight}")
  _require(not c.loss.hidden_weight or (c.cache.hidden_states and c.loss.objective != "online"),
           f"loss.hidden_weight = {c.loss.hidden_weight} trains the student against the "
           f"teacher's cached hidden states: set cache.hidden_states=True (and a cached "
           f"objective, not 'online'), or loss.hidden_weight=0")
  _require(c.loss.chunk_size >= 0,
           f"loss.chunk_size must be >= 0 (0: sized by the kernel), got {c.loss.chunk_size}")
  _require(c.loss.dw_dtype in DTYPES,
           f"loss.dw_dtype must be one of {DTYPES}, got {c.loss.dw_dtype!r}")
  _require(c.eval.batch_size > 0, f"eval.batch_size must be > 0, got {c.eval.batch_size}")
  _require(c.eval.max_seqs >= 0, f"eval.max_seqs must be >= 0 (0 = all), got {c.eval.max_seqs}")
  _check_model("teacher", c.teacher)
  _check_model("student", c.student)
  _check_init(c)
  _check_opt("opt", c.opt)
  _check_opt("pretrain", c.pretrain)
  for f in ("data", "fsdp", "tensor"):
    _require(isinstance(c.mesh[f], int) and c.mesh[f] >= 1,
             f"mesh.{f} must be an integer >= 1, got {c.mesh[f]!r}")
  _require(0 < c.mesh.memory_fraction <= 1,
           f"mesh.memory_fraction must be in (0, 1], got {c.mesh.memory_fraction}")
  _require(c.mesh.allocator in ("", "platform", "bfc", "cuda_async"),
           f"mesh.allocator must be '', 'platform', 'bfc' or 'cuda_async' (JAX's "
           f"XLA_PYTHON_CLIENT_ALLOCATOR), got {c.mesh.allocator!r}")
  for model, opt in (("student", "opt"), ("teacher", "pretrain")):
    _require(not (c.mesh.allocator == "platform" and c[model].remat == "auto"
                  and not c[opt].memory_gib),
             f"{model}.remat 'auto' plans against the GPU's allocation limit, which JAX does not "
             f"report with mesh.allocator='platform': set {opt}.memory_gib or {model}.remat to "
             f"a policy")
  _require(c.mesh.failure_timeout_s > 0,
           f"mesh.failure_timeout_s must be > 0 seconds, got {c.mesh.failure_timeout_s}")
  _require(c.mesh.tensor == 1 or c.loss.impl not in ("reference", "paper"),
           f"mesh.tensor = {c.mesh.tensor} splits the lm_head's vocabulary, which loss.impl "
           f"{c.loss.impl!r} cannot take: use loss.impl 'auto' (or 'xla', 'pallas', "
           "'pallas_exact'), or mesh.tensor = 1")
  shards = c.mesh.data * c.mesh.fsdp
  for name in ("opt", "pretrain"):
    _require(c[name].batch_size % shards == 0,
             f"{name}.batch_size = {c[name].batch_size} rows per micro-batch cannot be split over "
             f"mesh.data x mesh.fsdp = {shards} devices: make it a multiple of {shards}")
  size = shards * c.mesh.tensor
  _require(size == 1 or (c.opt.state_memory == "device" and c.loss.objective != "online"),
           f"a mesh of {size} devices takes opt.state_memory='device' and an offline "
           f"objective, got {c.opt.state_memory!r} and {c.loss.objective!r}")


def unknown_override(c: ml_collections.ConfigDict, argv: list[str]) -> str | None:
  """One line for the first `--config.group.field=value` of argv that names no field of `c`, with
  the nearest valid names; None when every override names a field.

  ml_collections reports such an override as three chained tracebacks naming only the last part.
  """
  for arg in argv:
    match = re.match(r"--?(?:no)?config\.([^=]+)", arg)
    message = match and _unknown_field(c, match.group(1))
    if message:
      return f"{arg.split('=')[0]}: {message}"
  return None


def _unknown_field(c, path: str) -> str | None:
  group, names = c, path.split(".")
  for i, name in enumerate(names):
    where = ".".join(names[:i])
    if not isinstance(group, ml_collections.ConfigDict):
      return f"{where} is a value, not a group of fields"
    if name not in group:
      prefix = where + "." if where else ""
      nearest = ", ".join(prefix + n for n in _nearest(name, list(group)))
      return f"{where or 'the config'} has no field {name!r}; nearest: {nearest}"
    group = group[name]
  return None


def _nearest(name: str, names: list[str]) -> list[str]:
  """Up to three of `names` most like `name`; an abbreviation (learning_rate -> lr) counts first."""
  initials = "".join(part[:1] for part in name.split("_"))
  close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
  if initials in names and initials not in close:
    close = [initials] + close[:2]
  return close or difflib.get_close_matches(name, names, n=3, cutoff=0.0)
