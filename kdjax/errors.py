"""User errors: the exceptions kdjax raises on purpose for bad input, and how they are shown.

A user error's message names what to change, so `python -m kdjax.main` prints that message alone
(its traceback with --debug or KDJAX_DEBUG=1). Any other exception, a ValueError of an internal
contract check included, is a bug and keeps its traceback.
"""
import os


class UserError(ValueError):
  """Bad input (config, paths, data, checkpoints), raised where kdjax checks it; the message says
  what to change. A ValueError, so callers that catch those (ml_collections, tests) still do."""


def is_user_error(e: BaseException) -> bool:
  """Whether `e` reports bad input (print its message) rather than a bug (show its traceback)."""
  # Besides UserError and its subclasses (data.sources.DataError, data.chat.ChatTemplateError,
  # models.hf.CheckpointError): the sequence stores' own error, and train.fit's non-finite loss or
  # parameters (FloatingPointError, with the step and what to do; JAX raises it too, only under
  # jax_debug_nans, which a run does not set). CacheError is imported here: kdjax.cache loads
  # TensorStore, and kdjax.config (no JAX) imports this module.
  from kdjax.cache.errors import CacheError
  return isinstance(e, (UserError, CacheError, FloatingPointError))


def message(e: BaseException | str) -> str:
  """What the command line prints for a user error: its message, no traceback."""
  return f"kdjax: {e}"


def debug() -> bool:
  """Whether KDJAX_DEBUG asks for tracebacks of user errors too."""
  return os.environ.get("KDJAX_DEBUG", "") not in ("", "0")
