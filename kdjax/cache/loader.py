"""Batches of rows from a store: deterministic shuffled order, any number of epochs, prefetched.

Epoch e visits the rows in the order of a permutation drawn from (seed, e), in batches of
batch_size; the last incomplete batch of an epoch is dropped so every batch has one shape (one
compiled train step), and the next epoch's permutation brings those rows back. The loader's whole
state is (epoch, step): saved with a checkpoint, it makes a resumed run see the same batches.
"""
import atexit
import queue
import threading
import weakref

import numpy as np

from kdjax.cache.errors import CacheError


# Prefetch threads are stopped before interpreter shutdown: a daemon thread killed inside a
# tensorstore read aborts the process.
_RUNNING = weakref.WeakSet()
atexit.register(lambda: [loader.close() for loader in list(_RUNNING)])


class Loader:
  """Iterator of numpy batch dicts (store.read of batch_size rows). Holds no jax."""

  def __init__(self, store, batch_size, seed, shuffle=True, prefetch=4):
    if store.num_seqs < batch_size:
      raise CacheError(f"{store.path} holds {store.num_seqs} rows, fewer than batch_size="
                       f"{batch_size}: lower the batch size or build a bigger store.")
    self.store = store
    self.batch_size = batch_size
    self.seed = seed
    self.shuffle = shuffle
    self.batches_per_epoch = store.num_seqs // batch_size
    self._prefetch = prefetch
    self._epoch, self._step = 0, 0
    self._thread = None

  def order(self, epoch):
    """The rows of epoch `epoch` in visiting order."""
    if self.shuffle:
      return np.random.default_rng([self.seed, epoch]).permutation(self.store.num_seqs)
    return np.arange(self.store.num_seqs)

  def _work(self, epoch, step, out, stop):
    try:
      order_epoch, order = None, None
      while not stop.is_set():
        if order_epoch != epoch:
          order_epoch = epoch
          order = self.order(epoch)
        rows = order[step * self.batch_size:(step + 1) * self.batch_size]
        item = (epoch, step, self.store.read(rows))
        while not stop.is_set():
          try:
            out.put(item, timeout=0.1)
            break
          except queue.Full:
            pass
        step += 1
        if step == self.batches_per_epoch:
          epoch, step = epoch + 1, 0
    except Exception as e:  # handed to the consumer, which raises it
      out.put((epoch, step, e))

  def _start(self):
    self._queue = queue.Queue(self._prefetch)
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._work, daemon=True,
                                    args=(self._epoch, self._step, self._queue, self._stop))
    self._thread.start()
    _RUNNING.add(self)

  def close(self):
    if self._thread is not None:
      self._stop.set()
      self._thread.join()
      self._thread = None

  def __iter__(self):
    return self

  def __next__(self):
    if self._thread is None:
      self._start()
    epoch, step, batch = self._queue.get()
    if isinstance(batch, Exception):
      self.close()
      raise batch
    assert (epoch, step) == (self._epoch, self._step)
    self._step += 1
    if self._step == self.batches_per_epoch:
      self._epoch, self._step = self._epoch + 1, 0
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
