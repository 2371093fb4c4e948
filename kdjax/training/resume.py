"""A training run's checkpoint bookkeeping: resuming from the latest checkpoint, saving only
finite parameters, and stopping on SIGTERM after a step that every process saves.

A checkpoint holds the train state and the loader position (training/checkpoints.py), so a resumed
run sees the same batches; metrics.jsonl then holds exactly one line per logged step up to the
checkpoint (resuming drops the lines of later steps and a torn last line).
"""
import json
import logging
import os
import signal

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from kdjax import peers
from kdjax.cache import durable
from kdjax.training.checkpoints import Checkpoints
from kdjax.workdir import checkpoint_dir, metrics_file


class Run:
  """The checkpoints of the run in `workdir` (ckpt/): where it starts, and saving its steps.
  Opening it drops metrics.jsonl's lines after the latest checkpoint (process 0)."""

  def __init__(self, name: str, workdir: str, model_cfg, keep: int):
    self.name = name
    self.ckpt = Checkpoints(checkpoint_dir(workdir), model_cfg, keep=keep)
    self.start = self.saved = self.ckpt.latest_step() or 0
    if jax.process_index() == 0:  # of several processes, one writes the logs and metrics
      keep_metrics_until(metrics_file(workdir), self.start)

  def restore(self, state: dict, tx, loader) -> dict:
    """The state of the latest checkpoint in the structure of `state`, the loader at its
    position; `state` as it is when there is none."""
    if not self.start:
      return state
    state, loader_state = restore(self.ckpt, self.start, state, tx)
    loader.restore(loader_state)
    logging.info("%s: resumed from step %d", self.name, self.start)
    return state

  def save(self, step: int, state: dict, loader_state: dict):
    """Checkpoint `step`, after checking its parameters finite."""
    if not bool(_all_finite(state["params"])):
      raise FloatingPointError(
          f"{self.name}: the parameters after step {step} are not finite; no checkpoint was "
          f"written after step {self.saved}. Lower opt.lr, then run the same command again: it "
          f"resumes from step {self.saved}.")
    self.ckpt.save(step, state, loader_state)
    self.saved = step

  def save_on_exit(self, error: BaseException, state: dict, loader_state: dict):
    """Interrupted, or a damaged row was read: every finished step is saved before leaving."""
    done = int(state["step"])
    if done > self.saved:
      self.save(done, state, loader_state)
    logging.info("%s: %s; saved step %d", self.name,
                 "interrupted" if isinstance(error, KeyboardInterrupt) else "stopped", done)

  def close(self):
    self.ckpt.close()


class StopOnSigterm:
  """SIGTERM (a pre-empted job) stops training like Ctrl-C does, so no finished step is lost.
  Of several processes, all must save the same step: the one signalled proposes a step that none
  has passed (each is at most `in_flight` steps ahead of the slowest, which the step's
  collectives wait for), and every process stops after it (kdjax.peers). A context manager:
  the handler is installed inside it."""

  def __init__(self, name: str, in_flight: int):
    self.name, self.in_flight = name, in_flight
    self.asked, self.at = False, None

  def __enter__(self):
    self.previous = signal.signal(signal.SIGTERM, self._on_sigterm)
    return self

  def __exit__(self, *_):
    signal.signal(signal.SIGTERM, self.previous)

  def _on_sigterm(self, *_):
    if not peers.several():
      raise KeyboardInterrupt
    self.asked = True

  def check(self, step: int):
    """Before step `step`: raises KeyboardInterrupt when the processes agreed to stop before it."""
    if not peers.several():
      return
    if self.asked and self.at is None:
      peers.propose_stop(self.name, step + self.in_flight + 2)
    self.at = self.at or peers.agreed_stop(self.name)
    if self.at is not None and step > self.at:
      raise KeyboardInterrupt


@jax.jit
def _all_finite(tree) -> jax.Array:
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def keep_metrics_until(path: str, step: int):
  """Drops the lines of steps after `step` (run again after a resume) and a torn last line."""
  if not os.path.exists(path):
    return
  kept = []
  with open(path) as f:
    for line in f:
      try:
        if json.loads(line)["step"] <= step:
          kept.append(line if line.endswith("\n") else line + "\n")
      except (ValueError, KeyError):  # a line cut by a kill
        continue
  durable.write_text(path, "".join(kept))


def restore(ckpt: Checkpoints, step: int, state: dict, tx) -> tuple[dict, dict]:
  """Checkpoint `step` in the structure of `state`. One written before the optimizer updated
  train.trained's dict (its moments keyed like the model's parameters alone) is read in that
  layout and its moments rekeyed, so a run started with an older kdjax resumes."""
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  try:
    return ckpt.restore(step, abstract)
  except Exception as error:  # orbax names the first difference of the trees
    if "hidden_proj" in state:  # the older layout had the model's parameters alone
      raise
    try:
      old, loader_state = ckpt.restore(step, {**abstract, "opt": jax.eval_shape(
          tx.init, abstract["params"])})
    except Exception:
      raise error from None
  opt = jax.tree.unflatten(jax.tree.structure(abstract["opt"]), jax.tree.leaves(old["opt"]))
  return {**old, "opt": opt}, loader_state
