"""Batches of rows from a store: deterministic shuffled order, any number of epochs, prefetched.

Epoch e visits the rows in the order of a permutation drawn from (seed, e), in batches of
batch_size; the last incomplete batch of an epoch is dropped so every batch has one shape (one
compiled train step), and the next epoch's permutation brings those rows back. The loader's whole
state is (epoch, step): saved with a checkpoint, it makes a resumed run see the same batches.

Reading runs ahead in background threads: `prefetch` batches are in flight, read by `workers`
threads (tensorstore and numpy release the GIL while decompressing and decoding); batches are
handed out in order whatever thread finishes first.
"""
import atexit
import collections
import concurrent.futures
import os
import weakref

import numpy as np

from kdjax.cache.errors import CacheError

# Reader threads are stopped before interpreter shutdown: a thread killed inside a tensorstore
# read aborts the process.
_RUNNING = weakref.WeakSet()
atexit.register(lambda: [loader.close() for loader in list(_RUNNING)])


class Loader:
  """Iterator of numpy batch dicts (store.read of batch_size rows). Holds no jax."""

  def __init__(self, store, batch_size, seed, shuffle=True, prefetch=4, workers=None, hidden=True):
    if store.num_seqs < batch_size:
      raise CacheError(f"{store.path} holds {store.num_seqs} rows, fewer than batch_size="
                       f"{batch_size}: lower the batch size or build a bigger store.")
    self.store = store
    self.batch_size = batch_size
    self.seed = seed
    self.shuffle = shuffle
    self.batches_per_epoch = store.num_seqs // batch_size
    self._prefetch = prefetch
    self.workers = workers or min(4, os.cpu_count() or 1)
    self.hidden = hidden  # read the teacher's hidden states (store.read), if the store has them
    self._epoch, self._step = 0, 0  # of the next batch handed out
    self._pool = None
    self._pending = collections.deque()  # futures of the batches after (epoch, step), in order
    self._orders = {}

  def order(self, epoch):
    """The rows of epoch `epoch` in visiting order."""
    if epoch not in self._orders:
      self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
      if self.shuffle:
        self._orders[epoch] = np.random.default_rng([self.seed, epoch]).permutation(
            self.store.num_seqs)
      else:
        self._orders[epoch] = np.arange(self.store.num_seqs)
    return self._orders[epoch]

  def _position(self, ahead):
    flat = self._epoch * self.batches_per_epoch + self._step + ahead
    return divmod(flat, self.batches_per_epoch)

  def _fill(self):
    if self._pool is None:
      self._pool = concurrent.futures.ThreadPoolExecutor(self.workers,
                                                         thread_name_prefix="cache-loader")
      _RUNNING.add(self)
    while len(self._pending) < self._prefetch:
      epoch, step = self._position(len(self._pending))
      rows = self.order(epoch)[step * self.batch_size:(step + 1) * self.batch_size]
      self._pending.append(self._pool.submit(self.store.read, rows, self.hidden))

  def close(self):
    """Stops the reader threads; iteration may continue later (they restart)."""
    for future in self._pending:
      future.cancel()
    self._pending.clear()
    if self._pool is not None:
      self._pool.shutdown(wait=True)
      self._pool = None

  def __iter__(self):
    return self

  def __next__(self):
    self._fill()
    try:
      batch = self._pending[0].result()
    except BaseException:
      self.close()  # a retry reads this batch again
      raise
    self._pending.popleft()
    self._epoch, self._step = self._position(1)
    self._fill()
    return batch

  def state(self):
    """Where the next batch comes from; pass to restore() to continue from here."""
    return {"seed": self.seed, "epoch": self._epoch, "step": self._step,
            "batch_size": self.batch_size, "shuffle": self.shuffle,
            "num_seqs": self.store.num_seqs}

  def restore(self, state):
    mine = self.state()
    for key in ("seed", "batch_size", "shuffle", "num_seqs"):
      if state[key] != mine[key]:
        raise CacheError(f"loader state has {key}={state[key]!r} but this loader has "
                         f"{mine[key]!r}: resume with the configuration of the saved run.")
    self.close()
    self._epoch, self._step = int(state["epoch"]), int(state["step"])
