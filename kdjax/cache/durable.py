"""Files that survive a crash or a power loss whole: atomic JSON writes, fsync of files and folders.

A file's data is durable once the file is fsynced; its name is durable once the folder holding it
is fsynced (a new file in a new folder needs both folders). Readers of the JSON written here see the
whole file or none of it.
"""
import builtins
import concurrent.futures
import contextlib
import errno
import json
import os

from kdjax.cache.errors import CacheError

_POOL = concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="fsync")


def fsync_path(path):
  """fsync of a file or a folder (folders: makes the names in it durable)."""
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def tree(path, root):
  """[path, its folder, ..., root]: what to fsync so that a new file in new folders is durable."""
  out = [path]
  while not os.path.samefile(out[-1], root) and os.path.dirname(out[-1]) != out[-1]:
    out.append(os.path.dirname(out[-1]))
  return out


def fsync_all(paths):
  """fsync of every path, concurrently: many small files sync in about the time of one."""
  for future in [_POOL.submit(fsync_path, path) for path in dict.fromkeys(paths)]:
    future.result()


def write_json(path, obj, *, exclusive=False):
  """Writes JSON so that readers see the whole file or nothing; durable on return.

  exclusive: fail with FileExistsError if `path` exists.
  """
  write_text(path, json.dumps(obj, indent=1, sort_keys=True), exclusive=exclusive)


def write_text(path, text: str, *, exclusive=False):
  """Writes `text` (UTF-8) so that readers see the whole file or nothing; durable on return."""
  tmp = f"{path}.tmp{os.getpid()}"
  with builtins.open(tmp, "w", encoding="utf-8") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  try:
    if exclusive:
      os.link(tmp, path)  # atomic create-if-absent, even across hosts on a shared filesystem
    else:
      os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)
  fsync_path(os.path.dirname(path) or ".")  # the rename itself


def read_json(path, fix):
  """The JSON object in `path`; a file that does not parse is a CacheError naming it, and `fix`."""
  try:
    with builtins.open(path, "rb") as f:
      obj = json.loads(f.read())
  except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
    raise CacheError(f"{path} is not valid JSON ({e}): it was truncated or edited. {fix}") from e
  if not isinstance(obj, dict):
    raise CacheError(f"{path} holds {type(obj).__name__}, not a JSON object. {fix}")
  return obj


@contextlib.contextmanager
def disk_full_is_a_cache_error(path):
  """Within: a full disk (or quota) is a CacheError that says to free space and re-run."""
  try:
    yield
  except (OSError, ValueError) as e:  # tensorstore raises ValueError("RESOURCE_EXHAUSTED: ...")
    if getattr(e, "errno", None) not in (errno.ENOSPC, errno.EDQUOT) and (
        "RESOURCE_EXHAUSTED" not in str(e)):
      raise
    raise CacheError(f"{path}: no space left on the device (or over quota): {e}. Free space (or "
                     f"point the store at a bigger disk) and re-run the same command: it resumes "
                     f"with the regions not yet recorded; no recorded region was lost.") from e
