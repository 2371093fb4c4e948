"""The other processes of a run of several (jax.distributed): noticing one lost, agreeing on a stop.

A lost process (killed, crashed, its host down) leaves the others blocked in a collective or a
barrier, or failing in one (gloo: "Connection reset by peer"); jax.distributed's own heartbeat
then aborts them with thread dumps. Instead `watch` starts a thread in each process that writes a
beat to the coordination service's key-value store every few seconds and reads the others':
when one's beat has not moved for mesh.failure_timeout_s, the thread prints kdjax's one line,
naming the lost process and what to do, and ends this process (EXIT_LOST) wherever its main
thread is blocked. A process that can no longer reach the store has lost process 0 (it holds
the coordination service). `finish` marks a process done, so one that exits first is not lost.

A stop asked of one process (SIGTERM: a time limit, a pre-emption) must stop all at the same
step, or their checkpoints would differ: `propose_stop(name, step)` records the first proposal
in the store, which every process reads at each step (`agreed_stop`).
"""
import os
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
    threading.Thread(target=self._run, name="kdjax-peers", daemon=True).start()

  def _run(self):
    while True:
      self.check()
      time.sleep(self.interval_s)

  def check(self):
    """One beat: write ours, read the others'; ends the process when one is lost."""
    now = time.monotonic()
    try:
      self.beat += 1
      self.client.key_value_set(f"kdjax/beat/{self.me}", str(self.beat), allow_overwrite=True)
      for p, (last, moved) in self.seen.items():
        if _try_get(self.client, f"kdjax/done/{p}") is not None:
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
    sys.stderr.write(message(lost, self.processes, self.me, waited_s) + "\n")
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
  """Starts this process's beat thread, in a run of several processes (else nothing)."""
  global _watch
  import jax
  client = _client()
  if client is None or jax.process_count() == 1 or _watch is not None:
    return
  _watch = Watch(client, jax.process_index(), jax.process_count(), timeout_s)


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


def finish() -> None:
  """This process is done: the others stop watching it."""
  if _watch is not None:
    try:
      _watch.client.key_value_set(f"kdjax/done/{_watch.me}", "1", allow_overwrite=True)
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
