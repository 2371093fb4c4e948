"""Orbax checkpoints of a training run: the train state, the loader position and the model shape.

`Checkpoints` saves and restores whole states for resuming (train.fit); `restore_finished` gives
a finished run's model from its parameters alone (eval, export, the cache stage's teacher).
"""
import dataclasses
import json
import os

import jax
import orbax.checkpoint as ocp
from flax import nnx

from kdjax.errors import UserError
from kdjax.models import llama
from kdjax.workdir import checkpoint_dir


class Checkpoints:
  """Orbax checkpoints of the train state, the loader position and the model shape."""

  def __init__(self, directory: str, model_cfg: llama.ModelConfig, keep: int = 2):
    self.model_meta = _meta(model_cfg)
    self.manager = ocp.CheckpointManager(os.path.abspath(directory),
                                         options=ocp.CheckpointManagerOptions(max_to_keep=keep,
                                                                              create=True))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, loader_state: dict):
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), loader=ocp.args.JsonSave(loader_state),
        model=ocp.args.JsonSave(self.model_meta)), force=True)
    self.manager.wait_until_finished()

  def restore(self, step: int, abstract_state):
    self._check_model(step)
    out = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), loader=ocp.args.JsonRestore()))
    return out["state"], out["loader"]

  def _check_model(self, step: int):
    meta = self.manager.restore(
        step, args=ocp.args.Composite(model=ocp.args.JsonRestore()))["model"]
    # A field added to ModelConfig after the checkpoint was written has its default there.
    meta = {**_meta(llama.ModelConfig()), **meta}
    # A checkpoint resumes under other values of how its model runs (llama.RUNTIME; remat "auto"
    # is resolved per run, and checkpoints before the policies hold true / false).
    ours = {k: v for k, v in self.model_meta.items() if k not in llama.RUNTIME}
    if {k: v for k, v in meta.items() if k not in llama.RUNTIME} != ours:
      diff = {k: (meta.get(k), v) for k, v in ours.items() if meta.get(k) != v}
      raise UserError(
          f"{self.manager.directory} holds a checkpoint of a different model (saved vs config: "
          f"{diff}). Use another workdir, or delete that checkpoint to start over.")

  def restore_params(self, step: int, abstract_params):
    """The parameters of checkpoint `step` alone: AdamW's moments are neither read nor allocated."""
    self._check_model(step)
    target = {"params": abstract_params}
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    path = os.path.join(str(self.manager.directory), str(step), "state")
    return ocp.PyTreeCheckpointer().restore(path, args=ocp.args.PyTreeRestore(
        target, restore_args=restore_args, partial_restore=True))["params"]

  def close(self):
    self.manager.close()


def _meta(model_cfg: llama.ModelConfig) -> dict:
  """The model's fields as the checkpoint's JSON holds them."""
  return json.loads(json.dumps(dataclasses.asdict(model_cfg), default=dict))


def saved_steps(workdir: str) -> list[int]:
  """The steps of a run's finished checkpoints in `workdir` (orbax names each by its step;
  unfinished writes carry a suffix)."""
  directory = checkpoint_dir(workdir)
  if not os.path.isdir(directory):
    return []
  return [int(name) for name in os.listdir(directory) if name.isdigit()]


def has_checkpoint(workdir: str) -> bool:
  """Whether a run in `workdir` has a checkpoint to resume from."""
  return bool(saved_steps(workdir))


def finished_step(workdir: str, steps: int) -> bool:
  """Whether a run in `workdir` has a checkpoint at step >= steps (restore_finished's test,
  without reading parameters)."""
  return max(saved_steps(workdir), default=-1) >= steps


def restore_finished(workdir: str, model_cfg: llama.ModelConfig, steps: int):
  """The model a run in `workdir` trained, if it finished (a checkpoint at step >= steps), else
  None. Reads the parameters only: restoring a 3B student this way reads 13 GB, not 38."""
  directory = checkpoint_dir(workdir)
  if not os.path.isdir(directory):
    return None
  ckpt = Checkpoints(directory, model_cfg)
  try:
    step = ckpt.latest_step()
    if step is None or step < steps:
      return None
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    graphdef, abstract = nnx.split(nnx.eval_shape(
        lambda: llama.Transformer(model_cfg, rngs=nnx.Rngs(0))))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                            abstract)
    return nnx.merge(graphdef, ckpt.restore_params(step, abstract))
  finally:
    ckpt.close()
