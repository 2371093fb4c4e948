"""A dependency-free TensorBoard writer for scalar curves: `tensorboard --logdir=<workdir>/tb`.

An event file is a sequence of TFRecords, each holding one serialized `Event` protobuf. Only the
few fields scalars need are encoded here by hand, so training needs neither TensorFlow nor protobuf:
  Event   {double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5}
  Summary {repeated Value value = 1}
  Value   {string tag = 1; float simple_value = 2}
A TFRecord is: uint64 length, masked crc32c(length), data, masked crc32c(data), all little-endian.
"""
import numbers
import os
import socket
import struct
import time


def _crc32c_entry(crc: int) -> int:
  for _ in range(8):
    crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1  # Castagnoli polynomial, reflected
  return crc


_CRC32C_TABLE = [_crc32c_entry(byte) for byte in range(256)]


def crc32c(data: bytes) -> int:
  """CRC-32C of `data`; a table-driven loop is fast enough for records of a few hundred bytes."""
  crc = 0xFFFFFFFF
  for byte in data:
    crc = _CRC32C_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
  return crc ^ 0xFFFFFFFF


def tfrecord(data: bytes) -> bytes:
  """Frames `data` as one TFRecord; the CRCs let a reader stop cleanly at a half-written record."""
  def masked_crc(b: bytes) -> int:  # rotated and offset: a CRC over bytes holding CRCs looks wrong
    crc = crc32c(b)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
  length = struct.pack("<Q", len(data))
  return (length + struct.pack("<I", masked_crc(length))
          + data + struct.pack("<I", masked_crc(data)))


def _varint(n: int) -> bytes:
  n &= (1 << 64) - 1  # a negative int64 is encoded as its 64-bit two's complement
  out = bytearray()
  while n > 0x7F:
    out.append((n & 0x7F) | 0x80)
    n >>= 7
  out.append(n)
  return bytes(out)


def _bytes_field(field: int, data: bytes) -> bytes:
  return _varint(field << 3 | 2) + _varint(len(data)) + data  # wire type 2: length-delimited


def event(wall_time: float, step: int, field: bytes) -> bytes:
  """One serialized `Event`: wall_time (wire type 1, fixed 64-bit), step (varint), then `field`."""
  return (_varint(1 << 3 | 1) + struct.pack("<d", wall_time)
          + _varint(2 << 3 | 0) + _varint(step) + field)


def summary(values: dict[str, float]) -> bytes:
  """`Event.summary` holding one `Value` per tag; simple_value is wire type 5, fixed 32-bit."""
  return _bytes_field(5, b"".join(
      _bytes_field(1, _bytes_field(1, tag.encode()) + _varint(2 << 3 | 5) + struct.pack("<f", x))
      for tag, x in values.items()))


class EventWriter:
  """Appends scalar summaries to a new event file in `logdir`, flushed after every step.

  Each writer opens its own file, so a resumed run adds a file beside the old ones; TensorBoard
  merges all event files of a directory, reading them in name order.
  """

  def __init__(self, logdir: str):
    os.makedirs(logdir, exist_ok=True)
    seconds = int(time.time())
    while True:  # two writers in the same second and process: bump the name, keeping it ordered
      name = f"events.out.tfevents.{seconds}.{socket.gethostname()}.{os.getpid()}.kdjax"
      self.path = os.path.join(logdir, name)
      try:
        self._file = open(self.path, "xb")
        break
      except FileExistsError:
        seconds += 1
    self._file.write(tfrecord(event(time.time(), 0, _bytes_field(3, b"brain.Event:2"))))
    self.flush()

  def scalars(self, step: int, values: dict[str, float], wall_time: float | None = None):
    """Writes one Event at `step` with every numeric entry of `values`; NaN and inf are kept.

    Args:
      step: the training step, TensorBoard's x axis.
      values: tag -> number (Python or numpy scalar, 0-d array); None and non-numbers are skipped.
      wall_time: seconds since the epoch; now if None.
    """
    kept = {tag: float(v) for tag, v in values.items()
            if isinstance(v, numbers.Real) or getattr(v, "shape", None) == ()}  # 0-d arrays
    wall_time = time.time() if wall_time is None else wall_time
    self._file.write(tfrecord(event(wall_time, step, summary(kept))))
    self.flush()  # a killed run keeps every step written so far

  def flush(self):
    self._file.flush()

  def close(self):
    self._file.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc_info):
    self.close()
