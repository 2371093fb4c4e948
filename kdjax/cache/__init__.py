"""Sequence stores: tokenised data (k = 0) and teacher top-k caches (k > 0), one on-disk format.

    store = cache.create(path, num_seqs=..., seq_len=..., k=..., vocab_size=..., attrs={...})
    with store.writer_lock(rank):  # a second writer of this rank is refused
      for start, stop in store.missing(rank, world):
        store.write(start, {"tokens": ..., "segment_ids": ..., ...})
    store = cache.open(path, vocab_size=V, k=K, seq_len=T)
    for batch in cache.Loader(store, batch_size=8, seed=0): ...

Shape letters: S rows (sequences), T positions, K top-k entries. See ARCHITECTURE.md.
`python -m kdjax.cache info|verify PATH` inspects a store; `recode PATH NEW_PATH --layout L`
writes it again in another layout. Crash safety: store.py; create() and
open(): opening.py; attributes and their checksum: attributes.py; the points where tests inject
faults: events.py.
"""
from kdjax.cache.errors import CacheError
from kdjax.cache.loader import Loader
from kdjax.cache.opening import create, open
from kdjax.cache.store import Store

__all__ = ["CacheError", "Loader", "Store", "create", "open"]
