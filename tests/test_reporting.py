"""Reporting (kdjax/training/reporting.py): a non-finite loss names its step; the log line and
metrics.jsonl of a logged step."""
import jax
import numpy as np
import pytest
from flax import nnx

from kdjax import config
from kdjax.models import llama
from kdjax.plots import read_metrics
from kdjax.training import reporting, train
from tests.fixtures.train_run import T, make_cache, opt_group, tiny_model_cfg


def test_non_finite_loss_names_the_step(tmp_path, rng):
  store = make_cache(tmp_path / "c.zarr", rng)
  cfg = tiny_model_cfg()
  model = llama.Transformer(cfg, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  state = jax.tree.map(lambda x: x * np.nan, state)
  with pytest.raises(FloatingPointError, match="step 1"):
    train.fit(name="nan", model=nnx.merge(graphdef, state), model_cfg=cfg, store=store,
              workdir=str(tmp_path / "nan"), opt=opt_group(steps=2), loss_cfg=config.base().loss,
              hard_labels=False, seed=0)


def test_a_logged_step_is_one_line_in_each_report(tmp_path, caplog):
  """One console line and one metrics.jsonl line (with the rates and the data wait), TensorBoard
  events; on hard labels kl (the cross-entropy itself) is left out. A non-finite metric raises,
  naming the step and the checkpoint a rerun resumes from, and writes nothing."""
  reporter = reporting.Reporter(name="run", workdir=str(tmp_path), opt=opt_group(steps=10),
                                model_cfg=tiny_model_cfg(), schedule=lambda step: 1e-3,
                                tokens_per_step=4 * T, hard_labels=True, start=0)
  reporter.waited(0.0)
  reporter.ran(np.ones((2, 2, T), np.int32))
  metrics = {"loss": 1.5, "kl": 1.5, "ce": 1.5, "top1": 0.25, "entropy": 2.0}
  with pytest.raises(FloatingPointError, match="step 3.*resumes from step 2"):
    reporter.report(3, {**metrics, "loss": np.nan}, saved=2)
  with caplog.at_level("INFO"):
    reporter.report(4, metrics, saved=2)
  reporter.close()
  [line] = read_metrics(tmp_path / "metrics.jsonl")
  assert line["step"] == 4 and "kl" not in line and line["lr"] == 1e-3, line
  assert line["tokens_per_s"] > 0 and 0 <= line["data_wait_frac"] <= 1, line
  [message] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("run step")]
  assert message.startswith(
      "run step 4/10 loss 1.5000 ce 1.5000 top1 0.250 ent 2.000 lr 1.00e-03"), message
  assert list(tmp_path.glob("tensorboard/events.out.tfevents.*"))
