"""Named points of the cache's write path where tests and experiments inject faults.

Writers call `hit(name)` at each point; nothing happens unless the point is armed, so a fault
lands at an exact step of the work, never at a moment chosen by a timer. Points, in the order
of one region's write:
  locked        (teacher.write_cache) the writer lock of its rank is taken
  batch         (teacher.write_cache) a batch of teacher outputs is on the host; the previous
                region may be being written by the writer thread at that moment
  before_data   Store.write: checked, nothing written yet
  data          Store.write: where the arrays' write results are awaited (an armed action may
                raise what tensorstore raises there: disk full, ...)
  after_data    Store.write: shards written and fsynced, the regions not yet recorded
  after_record  Store.write: a region's record is durable
  step          (train.fit) a training step is about to read its batch (time spent there counts
                as waiting for data)

In-process: `arm(name, action, count)` runs `action()` at the count-th hit. A subprocess is armed
by its environment, KDJAX_CACHE_FAILPOINT="name:count:action[,...]" with action
  kill   SIGKILL of the process itself: no cleanup, no flush, like a crash
  pause  prints "failpoint NAME" on stdout and waits for a line on stdin
  raise  raises FailpointError
  term   SIGTERM to the process itself (what SLURM sends at a time limit)
  stall  sleeps STALL_S, at this hit and at every later one (a slow disk, a stalled loader)
"""
import os
import signal
import sys
import time

ENV = "KDJAX_CACHE_FAILPOINT"
STALL_S = 2.0
_armed = {}  # name -> [hits to go, action]


class FailpointError(RuntimeError):
  """Raised by a point armed with the action "raise"."""


def arm(name, action, count=1):
  _armed[name] = [count, action]


def disarm():
  _armed.clear()


def hit(name):
  entry = _armed.get(name)
  if entry is None:
    return
  entry[0] -= 1
  if entry[0] == 0:
    del _armed[name]
    entry[1]()


def _kill():
  os.kill(os.getpid(), signal.SIGKILL)


def _pause(name):
  print(f"failpoint {name}", flush=True)
  sys.stdin.readline()


def _stall(name):
  time.sleep(STALL_S)
  arm(name, lambda: _stall(name))


def _raise(name):
  raise FailpointError(f"failpoint {name}")


def arm_from_env(spec):
  """Arms the points of a KDJAX_CACHE_FAILPOINT value."""
  for item in filter(None, spec.split(",")):
    name, count, action = item.split(":")
    actions = {"kill": _kill, "pause": lambda n=name: _pause(n), "raise": lambda n=name: _raise(n),
               "term": lambda: os.kill(os.getpid(), signal.SIGTERM),
               "stall": lambda n=name: _stall(n)}
    arm(name, actions[action], int(count))


arm_from_env(os.environ.get(ENV, ""))
