"""Runs a config's stages in order; each stage skips work whose output already exists and is complete.

Outputs under the workdir:
  config.json                 the resolved config of the latest run
  stages.jsonl                one line per finished stage: wall time, peak device memory
  data/{train,eval}.zarr      tokenised, packed sequences (k = 0 stores); data/tokenizer.json
  teacher/                    (stage pretrain) the teacher's checkpoints and metrics.jsonl
  cache/{train,eval}.zarr     the teacher's top-k per position (or cache.path)
  student/, baseline/         checkpoints and metrics.jsonl of the distilled / hard-label student
  eval.json                   held-out metrics of every model evaluated (a teacher.hf_path too)
  curves.png                  training CE, KL and top-1 agreement of the students
  export/                     (stage export) the student as a Hugging Face checkpoint directory
"""
import dataclasses
import functools
import json
import logging
import os
import time

import jax
import ml_collections
from flax import nnx

from kdjax import (cache, checkpoints, checks, config, data, evaluate, parallel, peers, plots,
                   teacher, tokenizer, train)
from kdjax.errors import UserError
from kdjax.models import llama, prune


@dataclasses.dataclass(frozen=True)
class Paths:
  """Where a run's files are; the one place that decides which tokenizer the run uses."""
  workdir: str
  cache_dir: str
  tokenizer: str  # data.tokenizer, else the one stage data trained (trained_tokenizer)

  @classmethod
  def from_config(cls, c) -> "Paths":
    return cls(c.workdir, c.cache.path or os.path.join(c.workdir, "cache"),
               c.data.tokenizer or os.path.join(c.workdir, "data", "tokenizer.json"))

  def data(self, split: str) -> str:
    return os.path.join(self.workdir, "data", f"{split}.zarr")

  def cache(self, split: str) -> str:
    return os.path.join(self.cache_dir, f"{split}.zarr")

  @property
  def trained_tokenizer(self) -> str:
    return os.path.join(self.workdir, "data", "tokenizer.json")

  @property
  def tokenizer_dir(self) -> str:
    """The folder holding the run's tokenizer.json (and tokenizer_config.json, if any)."""
    return self.tokenizer if os.path.isdir(self.tokenizer) else os.path.dirname(self.tokenizer)

  def run(self, name: str) -> str:
    return os.path.join(self.workdir, name)


def load_tokenizer(c, paths: Paths):
  return tokenizer.load(paths.tokenizer)


def model_config(group: ml_collections.ConfigDict, vocab_size: int) -> llama.ModelConfig:
  """The model shapes of a config group; vocab_size 0 takes the tokenizer's size."""
  return llama.ModelConfig.from_config(group, vocab_size=group.vocab_size or vocab_size)


def new_model(group, vocab_size: int, seed: int,
              mesh=None) -> tuple[nnx.Module, llama.ModelConfig]:
  """A model from its Hugging Face checkpoint (group.hf_path) or freshly initialised. mesh: of
  several devices, a checkpoint's tensors go straight to their shards (parallel.place_param)."""
  if group.hf_path:
    from kdjax.models import hf  # imported lazily: only runs with checkpoints need safetensors
    start = time.perf_counter()
    place = functools.partial(parallel.place_param, mesh) if parallel.several(mesh) else None
    model, cfg = hf.load(group.hf_path, dtype=group.dtype, param_dtype=group.param_dtype,
                         remat=group.remat, place=place)
    logging.info("loaded %s in %.1f s", group.hf_path, time.perf_counter() - start)
    return model, cfg
  cfg = model_config(group, vocab_size)
  return llama.Transformer(cfg, rngs=nnx.Rngs(seed)), cfg


def model_config_of(group, vocab_size: int) -> llama.ModelConfig:
  """The shapes of a group's model without building it: its checkpoint's config.json, or the
  group's fields (vocab_size 0: the tokenizer's)."""
  if group.hf_path:
    from kdjax.models import hf
    return hf.config_from_hf(group.hf_path, dtype=group.dtype, param_dtype=group.param_dtype,
                             remat=group.remat)
  return model_config(group, vocab_size)


def shapes_of(c, group, vocab_size: int) -> llama.ModelConfig:
  """model_config_of, except that a student pruned from its teacher (init.from_teacher) has the
  teacher's shapes with the student's pruned dims: one answer for training, eval and export."""
  if group is c.student and c.init.from_teacher:
    return prune.group_config(model_config_of(c.teacher, vocab_size), group, c.init.layers)
  return model_config_of(group, vocab_size)


def start_model(c, paths: Paths, group, vocab_size: int, mesh=None, resuming: bool = False):
  """new_model, except that a student pruned from its teacher is pruned here; when resuming, a
  random model of its shapes, as the checkpoint replaces its values."""
  if not (group is c.student and c.init.from_teacher):
    return new_model(group, vocab_size, c.seed, mesh)
  cfg = shapes_of(c, group, vocab_size)
  if resuming:
    return llama.Transformer(cfg, rngs=nnx.Rngs(c.seed)), cfg
  return pruned_student(c, paths, cfg, mesh), cfg


def pruned_student(c, paths: Paths, cfg: llama.ModelConfig, mesh=None) -> nnx.Module:
  """The teacher pruned to cfg, importances measured on the train data's first rows."""
  model = load_teacher(c, paths, mesh)
  store = cache.open(paths.data("train"))
  rows = store.read(slice(0, min(c.init.calibration_rows, store.num_seqs)), hidden=False)
  student, kept = prune.from_teacher(model, cfg, rows, layers=c.init.layers,
                                     batch_size=c.cache.batch_size)
  t = model.cfg
  logging.info("student pruned from its teacher (%d rows): layers %s of %d, d_model %d/%d, "
               "heads %d/%d (kv %d/%d), d_ff %d/%d; %.2fM of %.2fM parameters",
               len(rows["tokens"]), list(kept.layers), t.n_layers, cfg.d_model, t.d_model,
               cfg.n_heads, t.n_heads, cfg.n_kv_heads, t.n_kv_heads, cfg.d_ff, t.d_ff,
               llama.count_params(student) / 1e6, llama.count_params(model) / 1e6)
  return student


def finished_model(c, paths: Paths, name: str, group, opt):
  """The model run `name` trained, parameters only, if it finished; else None."""
  cfg = shapes_of(c, group, load_tokenizer(c, paths).vocab_size)
  return checkpoints.restore_finished(paths.run(name), cfg, opt.steps)


def stage_data(c, paths: Paths):
  data.build(c.data, tokenizer_path=paths.trained_tokenizer, train_path=paths.data("train"),
             eval_path=paths.data("eval"))


def _fit(c, paths, name, group, opt, open_store, hard_labels, teacher=None):
  """Trains the model of `group` on open_store(model_cfg); a finished run is restored instead."""
  vocab = load_tokenizer(c, paths).vocab_size
  shapes = shapes_of(c, group, vocab)
  store = open_store(shapes)  # refuses a mismatch, finished or not
  done = checkpoints.restore_finished(paths.run(name), shapes, opt.steps)
  if done is not None:
    logging.info("%s: finished (step %d), restored", name, opt.steps)
    return done, done.cfg
  mesh = parallel.make_mesh(c.mesh)
  model, cfg = start_model(c, paths, group, vocab, mesh,
                           resuming=checkpoints.has_checkpoint(paths.run(name)))
  model = train.fit(name=name, model=model, model_cfg=cfg, store=store,
                    workdir=paths.run(name), opt=opt, loss_cfg=c.loss, hard_labels=hard_labels,
                    seed=c.seed, teacher=teacher, mesh=mesh)
  return model, cfg


def _open_data(c, paths: Paths, split: str):
  return lambda cfg: cache.open(paths.data(split), seq_len=c.data.seq_len)


def stage_pretrain(c, paths: Paths):
  return _fit(c, paths, "teacher", c.teacher, c.pretrain, _open_data(c, paths, "train"), True)


def load_teacher(c, paths: Paths, mesh=None):
  if c.teacher.hf_path:
    return new_model(c.teacher, 0, c.seed, mesh)[0]
  model = finished_model(c, paths, "teacher", c.teacher, c.pretrain)
  if model is None:
    raise UserError(
        f"no finished teacher in {paths.run('teacher')}: set teacher.hf_path to a Hugging Face "
        "checkpoint directory, or add stage 'pretrain' before 'cache'.")
  return model


def teacher_mesh(c):
  """A mesh of several devices shards the teacher over this process's devices, or with
  cache.teacher_devices "all" over every process's (then process 0 alone writes); else None."""
  several = c.mesh.data * c.mesh.fsdp * c.mesh.tensor > 1
  return parallel.teacher_mesh(c.cache.teacher_devices) if several else None


def stage_cache(c, paths: Paths):
  mesh = teacher_mesh(c)
  model = load_teacher(c, paths, mesh)
  # The hash identifies the weights; the name is for people (a workdir may move, so no path).
  attrs = {"teacher": c.teacher.hf_path or "trained by stage pretrain (<workdir>/teacher)",
           "teacher_hash": teacher.weights_hash(
               c.teacher.hf_path or os.path.join(paths.run("teacher"), "ckpt")),
           "tokenizer_hash": tokenizer.tokenizer_hash(load_tokenizer(c, paths)),
           "source": c.data.source}
  # Hidden states only where a loss reads them: the train split.
  hidden_dim = (c.cache.hidden_dim or model.cfg.d_model) if c.cache.hidden_states else 0
  # Of several processes each writes its own regions, unless they all run one teacher.
  rank, world = ((c.cache.rank, c.cache.world) if parallel.spans_processes(mesh)
                 else parallel.cache_rank(c.cache.rank, c.cache.world))
  # SIGTERM stops every process between two regions (kdjax.peers.Stop), to resume from them.
  with peers.Stop("cache", lockstep=parallel.spans_processes(mesh)) as stop:
    for split in ("train", "eval"):
      split_hidden = hidden_dim if split == "train" else 0
      if _holds_top_k(paths.cache(split), c.cache.k, attrs["teacher_hash"], split_hidden):
        continue
      teacher.write_cache(model, cache.open(paths.data(split)), paths.cache(split), k=c.cache.k,
                          batch_size=c.cache.batch_size, chunk_size=c.cache.chunk_size,
                          vocab_size=model.lm_head_DxV().shape[1], attrs=attrs,
                          layout=c.cache.layout, rank=rank, world=world,
                          region_rows=c.cache.region_rows or None, hidden_dim=split_hidden,
                          mesh=mesh, writers=c.cache.writers, before_region=stop.before_region)
      stop.barrier(f"cache {split}")  # every region written before anyone reads the split


def _holds_top_k(path: str, k: int, teacher_hash: str, hidden_dim: int) -> bool:
  """Whether a complete cache at `path` from this teacher holds more than k entries per position
  (it serves k, cache.open reads its first k): no need to write one of k."""
  try:
    store = cache.open(path, k=k)
  except cache.CacheError:
    return False  # none, incomplete or otherwise unfit: write_cache resumes it or says why
  if store.k > k and store.attrs.get("teacher_hash") == teacher_hash and (
      store.hidden_dim == hidden_dim or not hidden_dim):
    logging.info("cache: %s holds this teacher's top %d; read as its top %d", path, store.k, k)
    return True
  return False


def student_tokenizer_hash(c, paths: Paths) -> str:
  """A student from a checkpoint brings its own tokenizer; it must be the cache's."""
  own = c.student.hf_path and os.path.exists(os.path.join(c.student.hf_path, "tokenizer.json"))
  return tokenizer.tokenizer_hash(tokenizer.load(c.student.hf_path) if own
                                  else load_tokenizer(c, paths))


def open_cache(c, paths: Paths, split: str):
  """Opens a cache for a student of config `cfg`, refusing any mismatch with what it expects."""
  tok_hash = student_tokenizer_hash(c, paths)
  return lambda cfg: cache.open(paths.cache(split), vocab_size=cfg.output_vocab_size,
                                k=c.cache.k, seq_len=c.data.seq_len, tokenizer_hash=tok_hash,
                                hidden=split == "train" and c.loss.hidden_weight > 0)


def stage_train(c, paths: Paths):
  if c.loss.objective == "online":  # the teacher in the step, on the tokenised data
    return _fit(c, paths, "student", c.student, c.opt, _open_data(c, paths, "train"), False,
                teacher=load_teacher(c, paths))
  return _fit(c, paths, "student", c.student, c.opt, open_cache(c, paths, "train"), False)


def stage_baseline(c, paths: Paths):
  return _fit(c, paths, "baseline", c.student, c.opt, _open_data(c, paths, "train"), True)


def stage_eval(c, paths: Paths):
  eval_store = cache.open(paths.cache("eval"))
  vocab = load_tokenizer(c, paths).vocab_size
  results = {}

  def measure(name, model):  # one model in memory at a time: the teacher may be large
    results[name] = evaluate.evaluate(model, eval_store, batch_size=c.eval.batch_size,
                                      max_seqs=c.eval.max_seqs,
                                      chunk_size=c.loss.chunk_size or None, desc=f"eval {name}")

  measure("student_init", start_model(c, paths, c.student, vocab)[0])
  weights = [os.path.join(c.teacher.hf_path, name) for name in
             ("model.safetensors", "model.safetensors.index.json")]
  if c.teacher.hf_path and not any(map(os.path.exists, weights)):
    # A teacher's weights may be deleted once its cache is written (disk); the report goes on.
    logging.warning("eval: %s holds no weights any more; the report has no teacher row",
                    c.teacher.hf_path)
  elif c.teacher.hf_path:
    # Its own held-out CE is the reference the students are measured against; its KL to the
    # top-k it cached is ~0 (up to cache.layout's quantisation) and its top-1 agreement ~1.
    measure("teacher", load_teacher(c, paths, teacher_mesh(c)))
  # Every finished model of the workdir, whichever stages this run lists.
  runs = [("student", c.student, c.opt), ("baseline", c.student, c.opt)]
  if not c.teacher.hf_path:
    runs.insert(0, ("teacher", c.teacher, c.pretrain))
  for name, group, opt in runs:
    model = finished_model(c, paths, name, group, opt)
    if model is not None:
      measure(name, model)
    elif os.path.isdir(paths.run(name)):
      logging.warning("eval: %s has not finished its %d steps; not evaluated", name, opt.steps)
    del model
  if jax.process_index() != 0:  # several processes: each measured the same; process 0 writes
    return results
  with open(os.path.join(c.workdir, "eval.json"), "w") as f:
    json.dump(results, f, indent=2)
  runs = {name: os.path.join(paths.run(name), "metrics.jsonl")
          for name in ("student", "baseline") if name in results}
  plots.training_curves(
      [("train CE on the true next tokens (nats)", "ce", runs),
       ("student's distillation loss (nats)", "kl", {"student": runs.get("student", "")}),
       ("top-1 agreement with the teacher", "top1",
        {"student": runs.get("student", "")})],
      os.path.join(c.workdir, "curves.png"))
  print_report(results)
  return results


def stage_export(c, paths: Paths):
  """Writes the distilled student as a Hugging Face checkpoint directory: <workdir>/export."""
  from kdjax.models import hf
  model = finished_model(c, paths, "student", c.student, c.opt)
  if model is None:
    raise UserError(
        f"no finished student in {paths.run('student')} (opt.steps = {c.opt.steps}): run stage "
        "'train' before 'export'.")
  cfg = model.cfg
  own = c.student.hf_path and os.path.exists(os.path.join(c.student.hf_path, "tokenizer.json"))
  tokenizer_dir = c.student.hf_path if own else paths.tokenizer_dir
  if jax.process_index() != 0:  # several processes: process 0 writes
    return
  hf.export(model, cfg, paths.run("export"), tokenizer_dir=tokenizer_dir)
  logging.info("exported the student to %s (transformers.AutoModelForCausalLM loads it)",
               paths.run("export"))


def print_report(results: dict):
  lines = ["", f"{'held-out':<28}{'KL to teacher':>15}{'top-1 agree':>13}{'CE (nats)':>11}"]
  labels = {"teacher": "teacher", "student_init": "student before training",
            "student": "student, distilled", "baseline": "student, hard labels only"}
  for name, r in results.items():
    lines.append(f"{labels[name]:<28}{r['kl']:>15.4f}{r['top1_agreement']:>13.3f}{r['ce']:>11.4f}")
  if "student" in results and results["student"]["positions"] == 0:
    lines.append("the held-out rows hold no target positions (see data.loss_mask): nothing was "
                 "measured; hold out more data (data.eval_every) or raise eval.max_seqs")
  elif "student" in results:
    before, after = results["student_init"]["kl"], results["student"]["kl"]
    ratio = f"{before / after:.1f}x " if after > 0 else ""
    lines.append(f"distillation cut the student's KL to the teacher {ratio}"
                 f"({before:.3f} -> {after:.3f})")
  if "baseline" in results and "student" in results:
    d = results["baseline"]["ce"] - results["student"]["ce"]
    lines.append(f"held-out CE: distilled {results['student']['ce']:.4f} vs hard labels "
                 f"{results['baseline']['ce']:.4f} ({'distillation better' if d > 0 else 'hard labels better'} by {abs(d):.4f})")
  logging.info("\n".join(lines))


STAGES = {name: globals()[f"stage_{name}"] for name in config.STAGES}  # config owns the names


def run(c: ml_collections.ConfigDict):
  config.validate(c)
  lead = jax.process_index() == 0
  paths = Paths.from_config(c)
  checks.check_inputs(c, paths.tokenizer)  # the run's tokenizer, as Paths decided
  os.makedirs(c.workdir, exist_ok=True)
  if lead:
    with open(os.path.join(c.workdir, "config.json"), "w") as f:
      f.write(c.to_json_best_effort(indent=2))
  for name in c.stages:
    logging.info("stage %s", name)
    start = time.perf_counter()
    if lead or name != "data":  # the data stage: process 0 writes, the others wait
      STAGES[name](c, paths)
    parallel.barrier(f"stage {name}")
    if lead:
      record_stage(c.workdir, name, time.perf_counter() - start)


def record_stage(workdir: str, name: str, seconds: float):
  """Logs a finished stage's wall time and the process's peak device memory so far, and appends
  both to <workdir>/stages.jsonl."""
  stats = jax.local_devices()[0].memory_stats() or {}
  peak = stats["peak_bytes_in_use"] / 2**30 if "peak_bytes_in_use" in stats else None
  logging.info("stage %s done in %.1f s%s", name, seconds,
               f", peak device memory {peak:.1f} GiB" if peak is not None else "")
  with open(os.path.join(workdir, "stages.jsonl"), "a") as f:
    f.write(json.dumps({"stage": name, "seconds": seconds, "peak_gib": peak,
                        "time": time.time()}) + "\n")
