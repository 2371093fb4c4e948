"""Event files from `kdjax.training.tensorboard`, read back with TensorBoard's own readers (a
test extra)."""
import os

import numpy as np
import pytest

from kdjax.training.tensorboard import EventWriter

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
event_file_loader = pytest.importorskip("tensorboard.backend.event_processing.event_file_loader")

STEPS = {1: {"loss": 2.5, "kl": 0.125}, 2: {"loss": 2.25, "kl": 0.1}, 3: {"loss": 2.0, "kl": 0.3}}


def raw_events(path: str) -> list:
  """Every Event proto of one file, in order (the loader checks each record's CRCs)."""
  return list(event_file_loader.LegacyEventFileLoader(path).Load())


def test_events_and_fields(tmp_path):
  with EventWriter(str(tmp_path)) as writer:
    for step, values in STEPS.items():
      writer.scalars(step, values, wall_time=1000.0 + step)
    writer.scalars(2**40, {"nan": float("nan"), "skipped": None, "text": "x",
                           "np": np.float32(0.5), "zero_d": np.array(3)})
  assert os.listdir(tmp_path) == [os.path.basename(writer.path)]
  events = raw_events(writer.path)
  assert len(events) == 1 + len(STEPS) + 1
  assert events[0].file_version == "brain.Event:2"
  for event, (step, values) in zip(events[1:], STEPS.items()):
    assert (event.wall_time, event.step) == (1000.0 + step, step)
    assert {v.tag: v.simple_value for v in event.summary.value} == {
        tag: np.float32(x) for tag, x in values.items()}
  last = events[-1]
  assert last.step == 2**40
  got = {v.tag: v.simple_value for v in last.summary.value}
  assert list(got) == ["nan", "np", "zero_d"]  # None and the string are skipped
  assert np.isnan(got["nan"]) and got["np"] == 0.5 and got["zero_d"] == 3.0


def test_each_writer_opens_a_new_file(tmp_path):
  with EventWriter(str(tmp_path)) as first, EventWriter(str(tmp_path)) as second:
    pass
  names = sorted(os.listdir(tmp_path))
  assert names == [os.path.basename(p) for p in (first.path, second.path)]  # in opening order


def test_tensorboard_reads_resumed_run(tmp_path):
  with EventWriter(str(tmp_path)) as writer:
    for step in (1, 2):
      writer.scalars(step, STEPS[step])
  with EventWriter(str(tmp_path)) as writer:  # the resumed run, in a second file
    writer.scalars(3, STEPS[3])
    writer.scalars(4, {"loss": float("inf"), "lr": 1e-3})
  accumulator = event_accumulator.EventAccumulator(str(tmp_path))
  accumulator.Reload()
  assert sorted(accumulator.Tags()["scalars"]) == ["kl", "loss", "lr"]
  loss = accumulator.Scalars("loss")
  assert [e.step for e in loss] == [1, 2, 3, 4]
  assert [e.value for e in loss[:3]] == [np.float32(STEPS[s]["loss"]) for s in (1, 2, 3)]
  assert loss[3].value == float("inf")
  assert [e.value for e in accumulator.Scalars("kl")] == [
      np.float32(STEPS[s]["kl"]) for s in (1, 2, 3)]
  assert [(e.step, e.value) for e in accumulator.Scalars("lr")] == [(4, np.float32(1e-3))]


def test_tensorboard_reads_file_while_open(tmp_path):
  """Every step is flushed: TensorBoard sees it while training still holds the file open."""
  writer = EventWriter(str(tmp_path))
  writer.scalars(7, {"loss": 1.5}, wall_time=123.0)
  events = raw_events(writer.path)
  writer.close()
  assert events[0].file_version == "brain.Event:2"
  assert (events[1].step, events[1].wall_time) == (7, 123.0)
  assert [(v.tag, v.simple_value) for v in events[1].summary.value] == [("loss", 1.5)]
