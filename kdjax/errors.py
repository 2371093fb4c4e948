"""User errors: the exceptions kdjax raises on purpose for bad input, and how they are shown.

A user error's message names what to change, so `python -m kdjax.main` prints that message alone
(its traceback with --debug or KDJAX_DEBUG=1). Any other exception is a bug and keeps its traceback.
"""
import os
import traceback

import kdjax
from kdjax.cache.errors import CacheError
from kdjax.data.chat import ChatTemplateError
from kdjax.data.sources import DataError

# kdjax's own classes, raised only for bad input. models.hf.CheckpointError is a ValueError raised
# by kdjax, so the rule below covers it without importing safetensors on every run.
USER_ERRORS = (CacheError, DataError, ChatTemplateError)
# Raised by kdjax's checks (config.validate, checks.check_inputs, train.fit's non-finite check)
# but by libraries too, where they can mean a bug: user errors only when a kdjax line raised them.
CHECK_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, FloatingPointError)
_PACKAGE = os.path.dirname(os.path.abspath(kdjax.__file__)) + os.sep


def is_user_error(e: BaseException) -> bool:
  """Whether `e` reports bad input (print its message) rather than a bug (show its traceback)."""
  if isinstance(e, USER_ERRORS):
    return True
  if not isinstance(e, CHECK_ERRORS) or e.__traceback__ is None:
    return False
  raised_in = traceback.extract_tb(e.__traceback__)[-1].filename
  return os.path.abspath(raised_in).startswith(_PACKAGE)


def message(e: BaseException | str) -> str:
  """What the command line prints for a user error: its message, no traceback."""
  return f"kdjax: {e}"


def debug() -> bool:
  """Whether KDJAX_DEBUG asks for tracebacks of user errors too."""
  return os.environ.get("KDJAX_DEBUG", "") not in ("", "0")
