"""The one exception of sequence stores."""


class CacheError(Exception):
  """A store is missing, incomplete, corrupt, or does not match what the caller expects.

  The message says what to do about it.
  """
