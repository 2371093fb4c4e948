"""A run's TensorBoard curves: `tensorboard --logdir=<workdir>` (train.fit writes to
`<workdir>/tensorboard/`), through tensorboardX's event files.

tensorboardX's synchronous `EventsWriter` rather than its `SummaryWriter`, whose background thread
writes and flushes on its own schedule: here every step is on disk when `scalars` returns, so a
killed run keeps each step it logged. tensorboardX imports torch where it is installed (a second or
so at start), so the import waits until a run opens a writer.
"""
import glob
import itertools
import numbers
import os
import time

_WRITERS = itertools.count()  # names the files of one process apart, in the order they open


class EventWriter:
  """Appends scalar summaries to a new event file in `logdir`, flushed after every step.

  Each writer opens its own file, so a resumed run adds a file beside the old ones; TensorBoard
  merges all event files of a directory, reading them in name order (the second, then this
  process and the writer's number).
  """

  def __init__(self, logdir: str):
    from tensorboardX.event_file_writer import EventsWriter  # imported late: see the docstring
    os.makedirs(logdir, exist_ok=True)
    suffix = f".{os.getpid()}.{next(_WRITERS):04d}.kdjax"
    self._events = EventsWriter(os.path.join(logdir, "events"), suffix)
    (self.path,) = glob.glob(os.path.join(glob.escape(logdir), f"events.out.tfevents.*{suffix}"))
    self.flush()

  def scalars(self, step: int, values: dict[str, float], wall_time: float | None = None):
    """Writes one Event at `step` with every numeric entry of `values`; NaN and inf are kept.

    Args:
      step: the training step, TensorBoard's x axis.
      values: tag -> number (Python or numpy scalar, 0-d array); None and non-numbers are skipped.
      wall_time: seconds since the epoch; now if None.
    """
    from tensorboardX.proto import event_pb2, summary_pb2
    summary = summary_pb2.Summary(value=[
        summary_pb2.Summary.Value(tag=tag, simple_value=float(v)) for tag, v in values.items()
        if isinstance(v, numbers.Real) or getattr(v, "shape", None) == ()])  # 0-d arrays
    self._events.write_event(event_pb2.Event(
        wall_time=time.time() if wall_time is None else wall_time, step=step, summary=summary))
    self.flush()  # a killed run keeps every step written so far

  def flush(self):
    self._events.flush()

  def close(self):
    self._events.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc_info):
    self.close()
