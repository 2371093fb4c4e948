"""The other processes of a run of several (jax.distributed): noticing one lost, agreeing on a stop.

A lost process (killed, crashed, its host down) leaves the others blocked in a collective or a
barrier, or failing in one (gloo: "Connection reset by peer"); jax.distributed's own heartbeat
then aborts them with thread dumps. Instead `watch` starts a thread in each process that writes a
beat to the coordination service's key-value store every few seconds and reads the others':
when one's beat has not moved for mesh.failure_timeout_s, the thread prints kdjax's one line,
naming the lost process and what to do, and ends this process (EXIT_LOST) wherever its main
thread is blocked. A process that can no longer reach the store has lost process 0 (it holds
the coordination service). `finish` marks a process done, so one that exits first is not lost;
one that ends with its own error (`finish(error=True)`) ends the others too, naming it, wherever
they wait for it.

Process 0 lost is noticed first by jax.distributed's own client, which aborts the process
(SIGABRT, after its fatal log line) as soon as the coordination service stops answering;
its error callback cannot be replaced from Python (jaxlib 0.11.2 cannot pass the error to a
Python callable: std::bad_cast). So `watch` also catches SIGABRT: when the coordinator's port
refuses connections it prints kdjax's line naming process 0 and exits EXIT_LOST; any other
abort goes on as before (thread dumps, exit 134).

A stop asked of one process (SIGTERM: a time limit, a pre-emption) must stop all at the same
step, or their checkpoints would differ: `propose_stop(name, step)` records the first proposal
in the store, which every process reads at each step (`agreed_stop`). Stages that work in
regions (the cache) stop between them instead (`Stop`).
"""
import ctypes
import faulthandler
import logging
import os
import signal
import socket
import sys
import threading
import time

EXIT_LOST = 75  # EX_TEMPFAIL: run the same command again
_watch = None


def _client():
  from jax._src import distributed
  return distributed.global_state.client


def message(lost: int, processes: int, me: int, waited_s: float) -> str:
  return (f"kdjax: process {lost} of {processes} stopped answering {waited_s:.0f} s ago (killed, "
          f"crashed or its host down; mesh.failure_timeout_s); process {me} stops too. Run the "
          f"same command again: it resumes from the last checkpoint and the finished cache "
          f"regions.")


class Watch:
  """The beat thread of this process (see the module docstring)."""

  def __init__(self, client, me: int, processes: int, timeout_s: float):
    self.client, self.me, self.processes, self.timeout_s = client, me, processes, timeout_s
    self.interval_s = min(5.0, timeout_s / 6)
    now = time.monotonic()
    self.seen = {p: (None, now) for p in range(processes) if p != me}  # last beat, when it moved
    self.reached = now  # when the store last answered
    self.beat = 0
    self.ending = False  # this process is ending with its own error: it stops no other
    self.stopped = threading.Event()
    self.thread = threading.Thread(target=self._run, name="kdjax-peers", daemon=True)
    self.thread.start()

  def _run(self):
    while not self.stopped.is_set():
      self.check()
      self.stopped.wait(self.interval_s)

  def stop(self):
    """Ends the beat thread and waits for it: at exit jax shuts its distributed client down
    (an atexit handler), and a beat still calling into the client then can crash the process
    (SIGSEGV)."""
    self.stopped.set()
    self.thread.join(timeout=self.timeout_s)

  def check(self):
    """One beat: write ours, read the others'; ends the process when one is lost."""
    now = time.monotonic()
    try:
      self.beat += 1
      self.client.key_value_set(f"kdjax/beat/{self.me}", str(self.beat), allow_overwrite=True)
      for p, (last, moved) in self.seen.items():
        done = _try_get(self.client, f"kdjax/done/{p}")
        if done == "error" and not self.ending:
          self.exit(f"kdjax: process {p} of {self.processes} ended with an error (its own output "
                    f"says which); process {self.me} stops too. Fix it, then run the same "
                    f"command again: it resumes.")
        if done is not None:
          self.seen[p] = (last, float("inf"))  # finished: never lost
          continue
        beat = _try_get(self.client, f"kdjax/beat/{p}")
        self.seen[p] = (beat, now) if beat != last else (last, moved)
      self.reached = now
    except Exception:  # the coordination service, in process 0, is gone
      if now - self.reached > self.timeout_s:
        self.fail(0, now - self.reached)
      return
    for p, (_, moved) in self.seen.items():
      if now - moved > self.timeout_s:
        self.fail(p, now - moved)

  def lost(self) -> int | None:
    now = time.monotonic()
    if now - self.reached > self.timeout_s:
      return 0
    return next((p for p, (_, moved) in self.seen.items() if now - moved > self.timeout_s), None)

  def fail(self, lost: int, waited_s: float):
    self.exit(message(lost, self.processes, self.me, waited_s))

  def exit(self, line: str):
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    os._exit(EXIT_LOST)  # no atexit: jax.distributed's shutdown barrier would wait, then abort


def _try_get(client, key: str) -> str | None:
  try:
    return client.key_value_try_get(key)
  except Exception as e:  # NOT_FOUND; anything else is the store gone
    if "NOT_FOUND" in str(e) or "not found" in str(e).lower():
      return None
    raise


def watch(timeout_s: float) -> None:
  """Starts this process's beat thread and its SIGABRT handler, in a run of several processes
  (else nothing)."""
  global _watch
  import jax
  client = _client()
  if client is None or jax.process_count() == 1 or _watch is not None:
    return
  _watch = Watch(client, jax.process_index(), jax.process_count(), timeout_s)
  # jax.distributed's pre-emption notifier takes SIGTERM and lets the process run on; outside the
  # stages that stop on it (training, the cache) it ends the process, as in a run of one.
  signal.signal(signal.SIGTERM, signal.SIG_DFL)
  libc = ctypes.CDLL(None)
  libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
  libc.signal(signal.SIGABRT, ctypes.cast(_ON_ABORT, ctypes.c_void_p))


def _coordinator_answers() -> bool:
  from jax._src import distributed
  host, port = distributed.global_state.coordinator_address.rsplit(":", 1)
  try:
    socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    return True
  except OSError:
    return False


@ctypes.CFUNCTYPE(None, ctypes.c_int)
def _ON_ABORT(signum):
  """SIGABRT, in C: Python's own handlers run too late (abort() ends the process when its handler
  returns), so this runs on the aborting thread, in a C-level handler that takes the GIL."""
  if _watch is not None and _watch.ending:  # its own error is printed; the others stopped with it
    os._exit(1)
  if _watch is not None and not _coordinator_answers():
    _watch.fail(0, time.monotonic() - _watch.reached)
  faulthandler.dump_traceback(all_threads=True)  # as faulthandler's handler did; abort goes on


def fail_if_lost() -> None:
  """After an error in a run of several processes: waits (up to mesh.failure_timeout_s and a
  beat) for a lost process to show, and ends this one with the lost process's message; returns
  when none is lost (the error is this process's own)."""
  if _watch is None:
    return
  deadline = time.monotonic() + _watch.timeout_s + 2 * _watch.interval_s
  while time.monotonic() < deadline:
    lost = _watch.lost()
    if lost is not None:
      _watch.fail(lost, _watch.timeout_s)
    time.sleep(_watch.interval_s / 2)


def finish(error: bool = False) -> None:
  """This process is done: the others stop watching it, or with `error` (it ends with its own
  error) stop too, naming it. Its own beat thread ends here, before jax's exit handlers."""
  if _watch is not None:
    _watch.ending = error
    _watch.stop()
    try:
      _watch.client.key_value_set(f"kdjax/done/{_watch.me}", "error" if error else "1",
                                  allow_overwrite=True)
    except Exception:
      pass


def several() -> bool:
  return _watch is not None


def propose_stop(name: str, step: int) -> None:
  """Asks every process of the run to stop run `name` after `step` (the first proposal holds)."""
  try:
    _client().key_value_set(f"kdjax/stop/{name}", str(step), allow_overwrite=False)
  except Exception:  # another process proposed first
    pass


def agreed_stop(name: str) -> int | None:
  """The step after which every process stops run `name`, once one proposed it; else None."""
  value = _try_get(_client(), f"kdjax/stop/{name}")
  return None if value is None else int(value)


class Stop:
  """SIGTERM during a stage that works region by region (the cache): every process stops between
  two regions, or where it waits for the others (`barrier`), by raising KeyboardInterrupt (main
  exits 130); the stage resumes from its finished regions when the command is run again.

      with peers.Stop("cache", lockstep) as stop:
        ... stop.before_region() before each region ...
        stop.barrier("cache train")

  The signalled process proposes where (the key-value store, first proposal holds): processes
  that write their own regions stop each at its next one; in `lockstep` (every process runs each
  region: cache.teacher_devices "all") before the region after the proposer's next, which none
  has started (a region's collectives keep them within one region of each other). Of one
  process, SIGTERM stops it at once, as Ctrl-C does."""

  POLL_S = 0.5

  def __init__(self, name: str, lockstep: bool = False):
    self.name, self.lockstep = name, lockstep
    self.asked = self.proposed = False
    self.regions = 0  # begun so far; in lockstep the same count on every process

  def __enter__(self):
    self.previous = signal.signal(signal.SIGTERM, self._on_sigterm)
    return self

  def __exit__(self, kind, *_):
    signal.signal(signal.SIGTERM, self.previous)
    if self.asked and kind is None:  # after the stage's last barrier: nobody reads a stop now
      logging.warning("SIGTERM came as stage %s ended; the run goes on (send it again to stop "
                      "it)", self.name)

  def _on_sigterm(self, *_):
    if not several():
      raise KeyboardInterrupt
    self.asked = True

  def _stops_before(self, region: int) -> bool:
    """Whether the agreed stop (if any) falls before region `region` (1-based); proposes one
    first when this process was signalled."""
    if self.asked and not self.proposed:
      propose_stop(self.name, self.regions + 1 if self.lockstep else 0)
      self.proposed = True
    at = agreed_stop(self.name)
    return at is not None and region >= at

  def before_region(self) -> None:
    """Called before each region's work: raises KeyboardInterrupt where the stop falls."""
    self.regions += 1
    if several() and self._stops_before(self.regions):
      raise KeyboardInterrupt

  def barrier(self, name: str) -> None:
    """Waits until every process is here, or a stop is agreed: raises KeyboardInterrupt then.
    Pass or stop is recorded once in the store, so every process waiting does the same."""
    if not several():
      return
    client, key = _watch.client, f"kdjax/barrier/{name}/"
    client.key_value_set(f"{key}in/{_watch.me}", "1", allow_overwrite=True)
    while (outcome := _try_get(client, f"{key}outcome")) is None:
      absent = set(range(_watch.processes)) - {
          int(k.rsplit("/", 1)[1]) for k, _ in client.key_value_dir_get(f"{key}in/")}
      if self._stops_before(self.regions + 1):
        outcome = "stop"
      elif not absent:
        outcome = "pass"
      else:  # one lost, or ended with its own error, ends this process (Watch)
        time.sleep(self.POLL_S)
        continue
      try:
        client.key_value_set(f"{key}outcome", outcome, allow_overwrite=False)
      except Exception:  # another process recorded it first: theirs holds
        pass
    if outcome == "stop":
      raise KeyboardInterrupt
