"""Resuming (kdjax/training/resume.py through train.fit): a crash resumes to the same parameters, a
finished run is not trained again, NaN keeps the last finite checkpoint, metrics.jsonl stays exact
across interruptions."""
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdjax import cache
from kdjax.models import llama
from kdjax.plots import read_metrics
from kdjax.training import checkpoints, train
from tests.fixtures.train_run import fit, make_cache, opt_group, params_of, tiny_model_cfg


def crash_at_step_5(tmp_path, monkeypatch, store, name="crashed"):
  """A run killed in its step 5: its checkpoint of step 4 is on disk."""
  real_step, calls = train.train_step, []

  def crashing(state, grads_sum, batch, **kw):
    calls.append(1)
    if len(calls) == 5:
      raise RuntimeError("simulated crash")
    return real_step(state, grads_sum, batch, **kw)

  monkeypatch.setattr(train, "train_step", crashing)
  with pytest.raises(RuntimeError, match="simulated crash"):
    fit(tmp_path, store, name=name)
  monkeypatch.setattr(train, "train_step", real_step)
  assert checkpoints.Checkpoints(str(tmp_path / name / "ckpt"), tiny_model_cfg()).latest_step() == 4


def test_crash_resumes_to_identical_parameters(tmp_path, monkeypatch, rng):
  store = make_cache(tmp_path / "c.zarr", rng)
  straight = params_of(fit(tmp_path, store, name="straight"))
  crash_at_step_5(tmp_path, monkeypatch, store)
  resumed = params_of(fit(tmp_path, store, name="crashed"))
  for a, b in zip(straight, resumed):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_checkpoint_in_the_older_state_layout_resumes(tmp_path, monkeypatch, rng):
  """A checkpoint whose AdamW moments are keyed like the model's parameters alone (written before
  the optimizer updated train.trained's dict) resumes to the parameters of an unbroken run."""
  store = make_cache(tmp_path / "c.zarr", rng)
  straight = params_of(fit(tmp_path, store, name="straight"))
  crash_at_step_5(tmp_path, monkeypatch, store)
  directory = str(tmp_path / "crashed" / "ckpt")
  opt = opt_group()
  tx, _ = train.make_optimizer(opt)
  _, params = nnx.split(llama.Transformer(tiny_model_cfg(), rngs=nnx.Rngs(0)))
  state, _ = train.init_state(params, tx, opt)
  ckpt = checkpoints.Checkpoints(directory, tiny_model_cfg())
  state, loader_state = ckpt.restore(4, jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype), state))
  ckpt.close()
  older = {**state, "opt": jax.tree.unflatten(jax.tree.structure(tx.init(state["params"])),
                                              jax.tree.leaves(state["opt"]))}
  shutil.rmtree(directory)
  ckpt = checkpoints.Checkpoints(directory, tiny_model_cfg())
  ckpt.save(4, older, loader_state)
  ckpt.close()
  resumed = params_of(fit(tmp_path, store, name="crashed"))
  for a, b in zip(straight, resumed):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_finished_run_is_not_trained_again(tmp_path, rng):
  store = make_cache(tmp_path / "c.zarr", rng)
  first = params_of(fit(tmp_path, store))
  lines = len(read_metrics(tmp_path / "run" / "metrics.jsonl"))
  again = params_of(fit(tmp_path, store))
  assert len(read_metrics(tmp_path / "run" / "metrics.jsonl")) == lines
  for a, b in zip(first, again):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_checkpoint_of_another_model_shape_is_refused(tmp_path, rng):
  store = make_cache(tmp_path / "c.zarr", rng)
  fit(tmp_path, store, opt=opt_group(steps=2))
  with pytest.raises(ValueError, match="different model.*d_model"):
    fit(tmp_path, store, cfg=tiny_model_cfg(d_model=48), opt=opt_group(steps=4))
  # how the model runs is not what it is: another remat policy resumes the run
  model = fit(tmp_path, store, cfg=tiny_model_cfg(remat="none"), opt=opt_group(steps=4))
  assert model.cfg.remat == "none"


def test_nan_after_a_checkpoint_keeps_that_checkpoint_and_writes_none(tmp_path, monkeypatch, rng):
  """A step that turns the state non-finite is caught before its checkpoint: the latest
  checkpoint stays the last finite one, and the error names it."""
  store = make_cache(tmp_path / "c.zarr", rng)
  real_step = train.train_step
  calls = {"n": 0}

  def poisoned_at_3(state, grads_sum, batch, **kw):
    calls["n"] += 1
    state, metrics, grads_sum = real_step(state, grads_sum, batch, **kw)
    if calls["n"] == 3:
      state = {**state, "params": jax.tree.map(lambda x: x * jnp.nan, state["params"])}
    return state, metrics, grads_sum

  monkeypatch.setattr(train, "train_step", poisoned_at_3)
  with pytest.raises(FloatingPointError, match="resumes from step 2"):
    fit(tmp_path, store, opt=opt_group(steps=6, ckpt_every=2, log_every=1))
  assert checkpoints.Checkpoints(str(tmp_path / "run" / "ckpt"), tiny_model_cfg()).latest_step() == 2  # noqa: E501


def test_metrics_are_exact_across_interruptions(tmp_path, monkeypatch, rng):
  """One line per logged step after an interruption and a resume: no step lost, none twice, a
  torn last line (kill -9 mid-write) dropped."""
  store = make_cache(tmp_path / "c.zarr", rng)
  real_batch = train.to_step_batch
  calls = {"n": 0}

  def interrupted_at_4(*args, **kw):
    calls["n"] += 1
    if calls["n"] == 4:
      raise KeyboardInterrupt  # as SIGTERM does in fit
    return real_batch(*args, **kw)

  monkeypatch.setattr(train, "to_step_batch", interrupted_at_4)
  with pytest.raises(KeyboardInterrupt):
    fit(tmp_path, store, opt=opt_group(steps=6, ckpt_every=5, log_every=1))
  path = tmp_path / "run" / "metrics.jsonl"
  assert [m["step"] for m in read_metrics(path)] == [1, 2, 3]  # saved at step 3 on the way out
  with open(path, "a") as f:  # lines of steps the checkpoint does not hold, one torn
    f.write('{"step": 4, "loss": 1.0}\n{"step": 5, "lo')
  monkeypatch.setattr(train, "to_step_batch", real_batch)
  fit(tmp_path, store, opt=opt_group(steps=6, ckpt_every=5, log_every=1))
  steps = [m["step"] for m in read_metrics(path)]
  assert steps == [1, 2, 3, 4, 5, 6]
  assert all("data_wait_frac" in m for m in read_metrics(path))
  assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))


def test_a_damaged_row_stops_training_after_saving(tmp_path, monkeypatch, rng):
  """A row that fails its checks when read stops the run, and the finished steps are saved."""
  store = make_cache(tmp_path / "c.zarr", rng)
  real_next = cache.Loader.__next__
  calls = {"n": 0}

  def damaged_at_4(self):
    calls["n"] += 1
    if calls["n"] == 4:
      raise cache.CacheError("c.zarr row 9: topk_logprobs holds NaN")
    return real_next(self)

  monkeypatch.setattr(cache.Loader, "__next__", damaged_at_4)
  with pytest.raises(cache.CacheError, match="row 9"):
    fit(tmp_path, store, opt=opt_group(steps=6, ckpt_every=5, log_every=1))
  assert checkpoints.Checkpoints(str(tmp_path / "run" / "ckpt"), tiny_model_cfg()).latest_step() == 3  # noqa: E501
  assert [m["step"] for m in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3]
