"""One writer per rank: a lock file that a second writer of the same rank finds held, and refuses.

`with hold(path, what):` takes an exclusive flock on `path`, writes who holds it (pid, host, start
time) into it, and removes it on exit. The kernel drops a flock when its process dies, SIGKILL
included, so a lock file left by a dead writer is stale by construction: the next writer takes it,
with no guessing from pids or clocks. flock works across hosts on NFSv4 and on Lustre mounted with
`-o flock`; where the filesystem has no locks at all the writer goes on with a warning.
"""
import contextlib
import datetime
import errno
import fcntl
import json
import logging
import os
import socket

from kdjax.cache.errors import CacheError


def _holder(fd):
  try:
    info = json.loads(os.pread(fd, 4096, 0))
    return f"pid {info['pid']} on {info['host']} since {info['started']}"
  except (ValueError, KeyError, TypeError):  # being written by its new holder
    return "another process"


@contextlib.contextmanager
def hold(path, what):
  """Holds the lock at `path` for the block; raises CacheError if a live process holds it."""
  while True:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = _holder(fd)
      os.close(fd)
      raise CacheError(
          f"{path} is held by {holder}: another {what} is running on this store, and two would do "
          f"the same work twice. Let it finish, or stop it and run this command again (a writer "
          f"that dies releases the lock by itself; the file left behind is taken over).") from None
    except OSError as e:
      if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
        raise
      logging.warning("%s: this filesystem has no file locks (%s); make sure only one %s runs",
                      path, e, what)
      break
    # The previous holder removes the file before unlocking it: if it did so after our open, we
    # hold the lock of a file nobody else sees; open the new one instead.
    try:
      if os.stat(path).st_ino == os.fstat(fd).st_ino:
        break
    except FileNotFoundError:
      pass
    os.close(fd)
  started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
  os.ftruncate(fd, 0)
  os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                            "started": started}).encode(), 0)
  try:
    yield
  finally:
    with contextlib.suppress(FileNotFoundError):
      os.unlink(path)
    os.close(fd)


def remove_if_stale(path):
  """Removes the lock file at `path` if no live process holds it (one left by a writer that was
  killed after its last region was recorded: nothing would take it over). A held lock stays."""
  try:
    fd = os.open(path, os.O_RDWR)
  except OSError:  # none, or a read-only store: nothing to do
    return
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with contextlib.suppress(FileNotFoundError):
      if os.stat(path).st_ino == os.fstat(fd).st_ino:  # the same file, not a new holder's
        os.unlink(path)
  except OSError:  # held by a live writer, or no locks on this filesystem: leave it
    pass
  finally:
    os.close(fd)
