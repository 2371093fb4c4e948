"""Building and restoring models: the one owner of how a run's models come to be.

A model is initialised from its config group (`model_config`, `new_model`), loaded from a Hugging
Face checkpoint (`group.hf_path`), pruned from its teacher (a student with init.from_teacher), or
restored from a finished run's checkpoint. `Models`, made from the config once per stage, ties
these to one run: which group is the student, whether it is pruned, where the teacher comes from.

This module sits above `models/` rather than in it: restoring reads `checkpoints` (which imports
models/), pruning reads the tokenised data's store, and a mesh places a checkpoint's tensors
(`parallel`). `models/` stays the networks and their file formats alone. Import level 5, beside
`train`; pipeline and experiments import it, nothing below does.
"""
import dataclasses
import functools
import logging
import time

import ml_collections
from flax import nnx

from kdjax import cache, parallel
from kdjax.errors import UserError
from kdjax.models import llama, prune
from kdjax.training import checkpoints
from kdjax.workdir import Paths


def model_config(group: ml_collections.ConfigDict, vocab_size: int) -> llama.ModelConfig:
  """The model shapes of a config group; vocab_size 0 takes the tokenizer's size."""
  return llama.ModelConfig.from_config(group, vocab_size=group.vocab_size or vocab_size)


def model_config_of(group, vocab_size: int) -> llama.ModelConfig:
  """The shapes of a group's model without building it: its checkpoint's config.json, or the
  group's fields (vocab_size 0: the tokenizer's)."""
  if not group.hf_path:
    return model_config(group, vocab_size)
  from kdjax.models import hf  # imported lazily: only runs with checkpoints need safetensors
  return hf.config_from_hf(group.hf_path, dtype=group.dtype, param_dtype=group.param_dtype,
                           **llama.ModelConfig.runtime_of(group))


def new_model(group, vocab_size: int, seed: int,
              mesh=None) -> tuple[nnx.Module, llama.ModelConfig]:
  """A model from its Hugging Face checkpoint (group.hf_path) or freshly initialised. mesh: of
  several devices, a checkpoint's tensors go straight to their shards (parallel.place_param)."""
  if not group.hf_path:
    cfg = model_config(group, vocab_size)
    return llama.Transformer(cfg, rngs=nnx.Rngs(seed)), cfg
  from kdjax.models import hf
  start = time.perf_counter()
  place = functools.partial(parallel.place_param, mesh) if parallel.several(mesh) else None
  model, cfg = hf.load(group.hf_path, dtype=group.dtype, param_dtype=group.param_dtype,
                       place=place, **llama.ModelConfig.runtime_of(group))
  logging.info("loaded %s in %.1f s", group.hf_path, time.perf_counter() - start)
  return model, cfg


@dataclasses.dataclass(frozen=True)
class Models:
  """How one run builds, restores and loads its models (run names: paths.run)."""
  teacher: ml_collections.ConfigDict
  student: ml_collections.ConfigDict
  init: ml_collections.ConfigDict  # init.from_teacher: the student is its teacher pruned
  seed: int
  teacher_steps: int  # pretrain.steps: a trained teacher is finished at this step
  calibration_batch: int  # cache.batch_size: rows per teacher pass when measuring importances
  paths: Paths
  # shapes per group ("teacher", "student"): a checkpoint's config.json is read once per stage.
  _shapes: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

  @classmethod
  def from_config(cls, c, paths: Paths) -> "Models":
    return cls(c.teacher, c.student, c.init, c.seed, c.pretrain.steps, c.cache.batch_size, paths)

  def _pruned(self, group) -> bool:
    return group is self.student and self.init.from_teacher

  def shapes(self, group) -> llama.ModelConfig:
    """model_config_of, except that a student pruned from its teacher has the teacher's shapes
    with the student's pruned dims: one answer for training, eval and export, computed once."""
    name = "student" if group is self.student else "teacher" if group is self.teacher else None
    if name is None:  # another group: not this run's, so not kept
      return self._shapes_of(group)
    if name not in self._shapes:
      self._shapes[name] = self._shapes_of(group)
    return self._shapes[name]

  def _shapes_of(self, group) -> llama.ModelConfig:
    if not self._pruned(group):
      return model_config_of(group, self.paths.tokenizer().vocab_size)
    return prune.group_config(self.shapes(self.teacher), group, self.init.layers)

  def start(self, group, mesh=None, resuming: bool = False):
    """new_model, except that a student pruned from its teacher is pruned here; when resuming, a
    random model of its shapes, as the checkpoint replaces its values."""
    if not self._pruned(group):
      return new_model(group, self.paths.tokenizer().vocab_size, self.seed, mesh)
    cfg = self.shapes(group)
    if resuming:
      return llama.Transformer(cfg, rngs=nnx.Rngs(self.seed)), cfg
    return self.pruned_student(cfg, mesh), cfg

  def prune_source(self, mesh=None) -> nnx.Module:
    """The teacher a pruned student is cut from. A checkpoint teacher (teacher.hf_path) as
    shipped, also when stage pretrain corrected it: the correction changes what the student is
    taught, not where it starts (the order the recipe study measured, docs/real_teacher.md)."""
    if self.teacher.hf_path:
      return new_model(self.teacher, 0, self.seed, mesh)[0]
    return self.teacher_model(mesh)

  def pruned_student(self, cfg: llama.ModelConfig, mesh=None) -> nnx.Module:
    """The teacher (prune_source) pruned to cfg, importances measured on the train data's first
    rows."""
    model = self.prune_source(mesh)
    store = cache.open(self.paths.data("train"))
    rows = store.read(slice(0, min(self.init.calibration_rows, store.num_seqs)), hidden=False)
    student, kept = prune.from_teacher(model, cfg, rows, layers=self.init.layers,
                                       batch_size=self.calibration_batch)
    t = model.cfg
    logging.info("student pruned from its teacher%s (%d rows): layers %s of %d, d_model %d/%d, "
                 "heads %d/%d (kv %d/%d), d_ff %d/%d; %.2fM of %.2fM parameters",
                 f" as shipped ({self.teacher.hf_path})" if self.teacher.hf_path else "",
                 len(rows["tokens"]), list(kept.layers), t.n_layers, cfg.d_model, t.d_model,
                 cfg.n_heads, t.n_heads, cfg.n_kv_heads, t.n_kv_heads, cfg.d_ff, t.d_ff,
                 llama.count_params(student) / 1e6, llama.count_params(model) / 1e6)
    return student

  def finished(self, name: str, group, steps: int):
    """The model run `name` trained, parameters only, if it reached `steps`; else None."""
    shapes = self.shapes(group)
    return checkpoints.restore_finished(self.paths.run(name), shapes, steps)

  def corrected_teacher(self) -> bool:
    """Whether stage pretrain fine-tuned teacher.hf_path on this run's data (teacher correction):
    a finished run in <workdir>/teacher beside a checkpoint teacher."""
    return bool(self.teacher.hf_path) and checkpoints.finished_step(
        self.paths.run("teacher"), self.teacher_steps)

  def teacher_model(self, mesh=None) -> nnx.Module:
    """The teacher: its Hugging Face checkpoint, or the one stage pretrain finished (from scratch,
    or that checkpoint corrected on this run's data: corrected_teacher)."""
    if self.teacher.hf_path and not self.corrected_teacher():
      return new_model(self.teacher, 0, self.seed, mesh)[0]
    model = self.finished("teacher", self.teacher, self.teacher_steps)
    if model is not None and self.teacher.hf_path:
      logging.info("teacher: %s corrected by stage pretrain (%s)", self.teacher.hf_path,
                   self.paths.run("teacher"))
    if model is None:
      raise UserError(
          f"no finished teacher in {self.paths.run('teacher')}: set teacher.hf_path to a Hugging "
          "Face checkpoint directory, or add stage 'pretrain' before 'cache'.")
    return model
