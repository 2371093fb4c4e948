"""Runs a config's stages in order; each stage skips work whose output already exists and is
complete.

Outputs under the workdir:
  config.json                 the resolved config of the latest run
  stages.jsonl                one line per finished stage: wall time, peak device memory
  data/{train,eval}.zarr      tokenised, packed sequences (k = 0 stores); data/tokenizer.json
  teacher/                    (stage pretrain) the teacher's checkpoints and metrics.jsonl: trained
                              from scratch, or teacher.hf_path corrected on the train split
  cache/{train,eval}.zarr     the teacher's top-k per position (or cache.path)
  student/, baseline/         checkpoints and metrics.jsonl of the distilled / hard-label student
  eval.json                   held-out metrics of every model evaluated (a teacher.hf_path too)
  curves.png                  training CE, KL and top-1 agreement of the students
  export/                     (stage export) the student as a Hugging Face checkpoint directory
"""
import functools
import json
import logging
import os
import time

import jax
import ml_collections

from kdjax import build, cache, checks, config, data, evaluate, parallel, peers, teacher, tokenizer
from kdjax.cache import identity
from kdjax.errors import UserError
from kdjax.models import documents
from kdjax.training import checkpoints, train
from kdjax.workdir import Paths


def stage_data(c, paths: Paths):
  data.build(c.data, paths.tokenizer_or_none(), tokenizer_path=paths.trained_tokenizer,
             train_path=paths.data("train"), eval_path=paths.data("eval"))


def _fit(models: build.Models, name, group, opt, open_store, *, hard_labels, loss, mesh_cfg,
         targets=None):
  """Trains the model of `group` on open_store(model_cfg); a finished run is restored instead."""
  shapes = models.shapes(group)
  store = open_store(shapes)  # refuses a mismatch, finished or not
  done = models.finished(name, group, opt.steps)
  if done is not None:
    logging.info("%s: finished (step %d), restored", name, opt.steps)
    return done, done.cfg
  workdir = models.paths.run(name)
  mesh = parallel.make_mesh(mesh_cfg)
  model, cfg = models.start(group, mesh, resuming=checkpoints.has_checkpoint(workdir))
  model = train.fit(name=name, model=model, model_cfg=cfg, store=store, workdir=workdir,
                    opt=opt, loss_cfg=loss, hard_labels=hard_labels, seed=models.seed,
                    targets=targets, mesh=mesh)
  return model, cfg


def _open_data(path: str, seq_len: int):
  return lambda cfg: cache.open(path, seq_len=seq_len)


def stage_pretrain(c, paths: Paths):
  return _fit(build.Models.from_config(c, paths), "teacher", c.teacher, c.pretrain,
              _open_data(paths.data("train"), c.data.seq_len), hard_labels=True, loss=c.loss,
              mesh_cfg=c.mesh)


def stage_cache(c, paths: Paths):
  # Several devices shard the teacher over this process's devices, or with cache.teacher_devices
  # "all" over every process's (then process 0 alone writes).
  mesh = parallel.run_teacher_mesh(c.mesh, c.cache.teacher_devices)
  models = build.Models.from_config(c, paths)
  model = models.teacher_model(mesh)
  who, weights = c.teacher.hf_path, c.teacher.hf_path
  if not c.teacher.hf_path or models.corrected_teacher():
    who = ((f"{c.teacher.hf_path}, corrected" if c.teacher.hf_path else "trained")
           + " by stage pretrain (<workdir>/teacher)")
    weights = paths.checkpoints("teacher")
  # The hash identifies the weights; the name is for people (a workdir may move, so no path).
  attrs = {"teacher": who, "teacher_hash": teacher.weights_hash(weights),
           "tokenizer_hash": tokenizer.tokenizer_hash(paths.tokenizer()),
           "source": c.data.source, **identity.revision_attrs(model.cfg)}
  # Hidden states only where a loss reads them: the train split.
  hidden_dim = (c.cache.hidden_dim or model.cfg.d_model) if c.cache.hidden_states else 0
  # Of several processes each writes its own regions, unless they all run one teacher.
  rank, world = ((c.cache.rank, c.cache.world) if parallel.spans_processes(mesh)
                 else parallel.cache_rank(c.cache.rank, c.cache.world))
  hidden = {"train": hidden_dim, "eval": 0}
  data = {split: cache.open(paths.data(split)) for split in hidden}
  splits = [split for split in hidden
            if not identity.holds_top_k(paths.cache(split), c.cache.k, c.cache.layout, attrs,
                                hidden[split], data[split])]
  # One bound on the documents per row for the splits to write: one compiled teacher step, not
  # one per split (a real teacher's compile takes seconds).
  max_documents = max((documents.store_documents_bound(data[split]) for split in splits),
                      default=1)
  # SIGTERM stops every process between two regions (kdjax.peers.Stop), to resume from them.
  with peers.Stop("cache", lockstep=parallel.spans_processes(mesh)) as stop:
    for split in splits:
      teacher.write_cache(model, data[split], paths.cache(split), k=c.cache.k,
                          batch_size=c.cache.batch_size, chunk_size=c.cache.chunk_size,
                          vocab_size=model.lm_head_DxV().shape[1], attrs=attrs,
                          layout=c.cache.layout, rank=rank, world=world,
                          region_rows=c.cache.region_rows or None, hidden_dim=hidden[split],
                          mesh=mesh, writers=c.cache.writers, before_region=stop.before_region,
                          max_documents=max_documents)
      stop.barrier(f"cache {split}")  # every region written before anyone reads the split


def stage_train(c, paths: Paths):
  models = build.Models.from_config(c, paths)
  targets = None
  if c.loss.objective == "online":  # the teacher beside the step, on the tokenised data
    open_store = _open_data(paths.data("train"), c.data.seq_len)
    targets = teacher.OnlineTargets(models.teacher_model())
  else:
    open_store = _open_cache(paths, c.cache.k, c.data.seq_len, c.loss.hidden_weight > 0)
  return _fit(models, "student", c.student, c.opt, open_store, hard_labels=False, loss=c.loss,
              mesh_cfg=c.mesh, targets=targets)


def _open_cache(paths: Paths, k: int, seq_len: int, hidden: bool):
  """Opens the train split's cache for a student's model config; refuses a cache of another
  vocabulary, k, length or tokenizer than the student expects."""
  tok_hash = tokenizer.tokenizer_hash(paths.student_tokenizer())
  return lambda cfg: cache.open(paths.cache("train"), vocab_size=cfg.output_vocab_size, k=k,
                                seq_len=seq_len, tokenizer_hash=tok_hash, hidden=hidden)


def stage_baseline(c, paths: Paths):
  return _fit(build.Models.from_config(c, paths), "baseline", c.student, c.opt,
              _open_data(paths.data("train"), c.data.seq_len), hard_labels=True, loss=c.loss,
              mesh_cfg=c.mesh)


def stage_eval(c, paths: Paths):
  """Every model of the run on the held-out split: against the teacher's cache, or with objective
  "online" and no cache of the held-out split against the teacher run beside each model, as in
  training (a cache there, as a study's online arm may share, keeps every arm's measures alike)."""
  models = build.Models.from_config(c, paths)
  results = {}
  online = c.loss.objective == "online" and not os.path.isdir(paths.cache("eval"))
  the_teacher = None
  if online:
    eval_store = cache.open(paths.data("eval"))
    the_teacher = models.teacher_model()
  else:
    eval_store = cache.open(paths.cache("eval"))

  # One model in memory at a time: the teacher may be large.
  measure = functools.partial(_measure, results, eval_store, the_teacher,
                              eval_cfg=c.eval, chunk_size=c.loss.chunk_size or None)
  measure("student_init", models.start(c.student)[0])
  weights = [os.path.join(c.teacher.hf_path, name) for name in
             ("model.safetensors", "model.safetensors.index.json")]
  if c.teacher.hf_path and not any(map(os.path.exists, weights)):
    # A teacher's weights may be deleted once its cache is written (disk); the report goes on.
    logging.warning("eval: %s holds no weights any more; the report has no teacher row",
                    c.teacher.hf_path)
  elif c.teacher.hf_path:
    # Its own held-out CE is the reference the students are measured against; its KL to the
    # top-k it cached is ~0 (up to cache.layout's quantisation) and its top-1 agreement ~1.
    measure("teacher", the_teacher if online else
            models.teacher_model(parallel.run_teacher_mesh(c.mesh, c.cache.teacher_devices)))
  # Every finished model of the workdir, whichever stages this run lists.
  runs = [("student", c.student, c.opt), ("baseline", c.student, c.opt)]
  if not c.teacher.hf_path:
    runs.insert(0, ("teacher", c.teacher, c.pretrain))
  for name, group, opt in runs:
    model = models.finished(name, group, opt.steps)
    if model is not None:
      measure(name, model)
    elif os.path.isdir(paths.run(name)):
      logging.warning("eval: %s has not finished its %d steps; not evaluated", name, opt.steps)
    del model
  if jax.process_index() != 0:  # several processes: each measured the same; process 0 writes
    return results
  evaluate.write_report(results, paths.eval_file, paths.curves_file,
                        {name: paths.metrics(name) for name in ("student", "baseline")})
  return results


def _measure(results: dict, eval_store, the_teacher, name: str, model, *, eval_cfg,
             chunk_size: int | None):
  """results[name]: the model on the held-out split, against the teacher run beside it (online)
  or against the cache (the_teacher None)."""
  kw = dict(batch_size=eval_cfg.batch_size, max_seqs=eval_cfg.max_seqs, chunk_size=chunk_size,
            desc=f"eval {name}")
  if the_teacher is not None:
    results[name] = evaluate.evaluate_online(model, the_teacher, eval_store, **kw)
  else:
    results[name] = evaluate.evaluate(model, eval_store, **kw)


def stage_export(c, paths: Paths):
  """Writes the distilled student as a Hugging Face checkpoint directory: <workdir>/export."""
  from kdjax.models import hf
  model = build.Models.from_config(c, paths).finished("student", c.student, c.opt.steps)
  if model is None:
    raise UserError(
        f"no finished student in {paths.run('student')} (opt.steps = {c.opt.steps}): run stage "
        "'train' before 'export'.")
  if jax.process_index() != 0:  # several processes: process 0 writes
    return
  hf.export(model, model.cfg, paths.run("export"), tokenizer_dir=paths.student_tokenizer_dir)
  logging.info("exported the student to %s (transformers.AutoModelForCausalLM loads it)",
               paths.run("export"))


STAGES = {name: globals()[f"stage_{name}"] for name in config.STAGES}  # config owns the names


def run(c: ml_collections.ConfigDict):
  config.validate(c)
  lead = jax.process_index() == 0
  paths = Paths.from_config(c)
  checks.check_inputs(c, paths)  # the run's tokenizer, as Paths decided
  os.makedirs(c.workdir, exist_ok=True)
  if lead:
    with open(paths.config_file, "w") as f:
      f.write(c.to_json_best_effort(indent=2))
  for name in c.stages:
    logging.info("stage %s", name)
    start = time.perf_counter()
    if lead or name != "data":  # the data stage: process 0 writes, the others wait
      STAGES[name](c, paths)
    parallel.barrier(f"stage {name}")
    if lead:
      record_stage(paths, name, time.perf_counter() - start)


def record_stage(paths: Paths, name: str, seconds: float):
  """Logs a finished stage's wall time and the process's peak device memory so far, and appends
  both to <workdir>/stages.jsonl."""
  stats = jax.local_devices()[0].memory_stats() or {}
  peak = stats["peak_bytes_in_use"] / 2**30 if "peak_bytes_in_use" in stats else None
  logging.info("stage %s done in %.1f s%s", name, seconds,
               f", peak device memory {peak:.1f} GiB" if peak is not None else "")
  with open(paths.stages_file, "a") as f:
    f.write(json.dumps({"stage": name, "seconds": seconds, "peak_gib": peak,
                        "time": time.time()}) + "\n")
