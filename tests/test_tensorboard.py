"""Event files from `kdjax.tensorboard`: checksums, framing, and what TensorBoard itself reads back.

The framing and protobuf checks use a small reader written here from the format description, so
they run without the `tensorboard` package; the last tests read the files with TensorBoard's own
EventAccumulator and skip when it is not installed.
"""
import glob
import os
import struct

import numpy as np
import pytest

from kdjax.tensorboard import EventWriter, crc32c

STEPS = {1: {"loss": 2.5, "kl": 0.125}, 2: {"loss": 2.25, "kl": 0.1}, 3: {"loss": 2.0, "kl": 0.3}}


def _masked(crc: int) -> int:
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def read_records(path: str) -> list[bytes]:
  """Every record's data, asserting both masked CRCs and that no bytes trail the last record."""
  with open(path, "rb") as f:
    blob = f.read()
  records, at = [], 0
  while at < len(blob):
    length, length_crc = struct.unpack_from("<QI", blob, at)
    assert length_crc == _masked(crc32c(blob[at:at + 8])), f"bad length crc at byte {at}"
    data = blob[at + 12:at + 12 + length]
    (data_crc,) = struct.unpack_from("<I", blob, at + 12 + length)
    assert data_crc == _masked(crc32c(data)), f"bad data crc at byte {at}"
    records.append(data)
    at += 16 + length
  assert at == len(blob)
  return records


def _varint(blob: bytes, at: int) -> tuple[int, int]:
  n, shift = 0, 0
  while True:
    n |= (blob[at] & 0x7F) << shift
    shift += 7
    at += 1
    if not blob[at - 1] & 0x80:
      return n, at


def parse(blob: bytes) -> dict[int, list]:
  """A protobuf message as field number -> values: ints, raw bytes, or the 4/8 raw fixed bytes."""
  fields, at = {}, 0
  while at < len(blob):
    key, at = _varint(blob, at)
    wire = key & 7
    if wire == 0:
      value, at = _varint(blob, at)
    elif wire == 2:
      size, at = _varint(blob, at)
      value, at = blob[at:at + size], at + size
    else:
      size = {1: 8, 5: 4}[wire]
      value, at = blob[at:at + size], at + size
    fields.setdefault(key >> 3, []).append(value)
  return fields


def scalars_of(event: dict[int, list]) -> dict[str, float]:
  """Event.summary (field 5) as tag -> simple_value, from each Value's fields 1 and 2."""
  values = [parse(v) for v in parse(event[5][0])[1]]
  return {v[1][0].decode(): struct.unpack("<f", v[2][0])[0] for v in values}


def test_crc32c_known_vectors():
  assert crc32c(b"") == 0
  assert crc32c(b"123456789") == 0xE3069283
  assert crc32c(bytes(32)) == 0x8A9136AA
  assert crc32c(b"\xff" * 32) == 0x62A8AB43
  assert crc32c(bytes(range(32))) == 0x46DD794E


def test_records_and_fields(tmp_path):
  with EventWriter(str(tmp_path)) as writer:
    for step, values in STEPS.items():
      writer.scalars(step, values, wall_time=1000.0 + step)
    writer.scalars(2**40, {"nan": float("nan"), "skipped": None, "text": "x",
                           "np": np.float32(0.5), "zero_d": np.array(3)})
  (path,) = glob.glob(str(tmp_path / "events.out.tfevents.*.kdjax"))
  assert path == writer.path
  events = [parse(r) for r in read_records(path)]
  assert len(events) == 1 + len(STEPS) + 1
  assert events[0][3] == [b"brain.Event:2"]
  for event, (step, values) in zip(events[1:], STEPS.items()):
    assert struct.unpack("<d", event[1][0])[0] == 1000.0 + step
    assert event[2] == [step]
    assert scalars_of(event) == {tag: np.float32(x) for tag, x in values.items()}
  last = events[-1]
  assert last[2] == [2**40]
  got = scalars_of(last)
  assert list(got) == ["nan", "np", "zero_d"]  # None and the string are skipped
  assert np.isnan(got["nan"]) and got["np"] == 0.5 and got["zero_d"] == 3.0


def test_each_writer_opens_a_new_file(tmp_path):
  with EventWriter(str(tmp_path)) as first, EventWriter(str(tmp_path)) as second:
    pass
  names = sorted(os.listdir(tmp_path))
  assert len(names) == 2 and names == [os.path.basename(p) for p in (first.path, second.path)]


def test_tensorboard_reads_resumed_run(tmp_path):
  event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
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
  event_loader = pytest.importorskip("tensorboard.backend.event_processing.event_file_loader")
  writer = EventWriter(str(tmp_path))
  writer.scalars(7, {"loss": 1.5}, wall_time=123.0)
  events = list(event_loader.LegacyEventFileLoader(writer.path).Load())  # raw protos
  writer.close()
  assert events[0].file_version == "brain.Event:2"
  assert (events[1].step, events[1].wall_time) == (7, 123.0)
  assert [(v.tag, v.simple_value) for v in events[1].summary.value] == [("loss", 1.5)]
