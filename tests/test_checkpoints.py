"""Checkpoints (training/checkpoints.py): a finished run's parameters alone, checkpoints of older
model configs."""
import glob
import json

import numpy as np
import pytest

from kdjax.training import checkpoints
from tests.fixtures.train_run import fit, make_cache, opt_group, params_of, tiny_model_cfg


def test_restore_finished_reads_the_parameters_only(tmp_path, rng):
  store = make_cache(tmp_path / "c.zarr", rng)
  trained = params_of(fit(tmp_path, store, opt=opt_group(steps=4)))
  workdir = str(tmp_path / "run")
  assert checkpoints.restore_finished(workdir, tiny_model_cfg(), steps=5) is None  # not finished
  assert checkpoints.restore_finished(str(tmp_path / "none"), tiny_model_cfg(), steps=4) is None
  restored = checkpoints.restore_finished(workdir, tiny_model_cfg(), steps=4)
  for a, b in zip(trained, params_of(restored)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(ValueError, match="different model"):
    checkpoints.restore_finished(workdir, tiny_model_cfg(d_model=48), steps=4)


def test_checkpoint_from_before_a_model_field_existed_restores(tmp_path, rng):
  """A checkpoint whose model JSON lacks a field added to ModelConfig since (here qk_norm) holds
  that field's default: it restores; a changed value is still refused."""
  store = make_cache(tmp_path / "c.zarr", rng)
  fit(tmp_path, store, opt=opt_group(steps=2))
  [path] = [p for p in glob.glob(str(tmp_path / "run" / "ckpt" / "2" / "model" / "*"))
            if '"d_model"' in open(p).read()]
  with open(path) as f:
    meta = json.load(f)
  del meta["qk_norm"]
  with open(path, "w") as f:
    json.dump(meta, f)
  assert checkpoints.restore_finished(str(tmp_path / "run"), tiny_model_cfg(), steps=2)
  with pytest.raises(ValueError, match="different model.*qk_norm"):
    checkpoints.restore_finished(str(tmp_path / "run"), tiny_model_cfg(qk_norm=True), steps=2)
