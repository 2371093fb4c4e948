"""Named points of the cache's write path and the training loop, where tests inject faults.

Each point calls `reached(name)`; nothing happens unless a test has set `on_event` (the failpoints
of tests/fixtures/failpoints.py), so a fault lands at an exact step of the work, never at a moment
chosen by a timer. Points, in the order of one region's write:
  locked        (teacher.write_cache) the writer lock of its rank is taken
  batch         (teacher.write_cache) a batch of teacher outputs is on the host; the previous
                region may be being written by the writer thread at that moment
  before_data   Store.write: checked, nothing written yet
  data          Store.write: where the arrays' write results are awaited (a hook may raise
                what tensorstore raises there: disk full, ...)
  after_data    Store.write: shards written and fsynced, the regions not yet recorded
  after_record  Store.write: a region's record is durable
  step          (training.train.fit) a training step is about to read its batch (time spent
                there counts as waiting for data)
"""
from collections.abc import Callable

on_event: Callable[[str], None] | None = None  # set by tests: called with each point's name


def reached(name: str):
  if on_event is not None:
    on_event(name)
