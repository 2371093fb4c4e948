"""A finished store written again in another layout (`python -m kdjax.cache recode SRC DST
--layout L`).

A cache written compact (or packed) shrinks to the dictionary layout without running the teacher
again (layout.py). The rows are read and decoded, then written as store.write writes any rows
(checked, encoded on its threads, durable region by region), so the copy is a store like any
other and an interrupted recode resumes where it stopped. Ids are exact in every layout; log-probs
already quantised are quantised again: float32 -> L stores exactly what writing L directly does,
but compact -> dictionary rounds twice. Measured on SmolLM2's cache in rows of 8192
(BENCHMARKS.md, "The dictionary layout"): 285.0 -> 228.8 B/pos, gradient error against float32
1.6e-4 (compact's 1.4e-4), loss error 1.1e-5 (RMS over 8 blocks; compact's 2.8e-6): recode from
float32 where a float32 cache is kept.
"""
from tqdm import tqdm

from kdjax.cache import attributes
from kdjax.cache.errors import CacheError
from kdjax.cache.opening import create, open as open_store


def recode(src_path, dst_path, layout):
  """Writes (or resumes) at dst_path the rows of the finished store at src_path in `layout`;
  returns the new store. CacheError if src is unfinished or damaged, or dst holds another
  store."""
  src = open_store(src_path)
  if src.k == 0:
    raise CacheError(f"{src_path} holds no teacher outputs (k = 0): a data store has no top-k "
                     f"layout to change.")
  dst = create(dst_path, num_seqs=src.num_seqs, seq_len=src.seq_len, k=src.k,
               vocab_size=src.vocab_size,
               attrs={**attributes.identity(src.attrs), "recoded_from": src.layout},
               layout=layout, region_rows=src.region_rows, hidden_dim=src.hidden_dim)
  todo = dst.missing()
  with dst.writer_lock(0), tqdm(total=sum(b - a for a, b in todo) * src.seq_len, unit="pos",
                                unit_scale=True, desc=f"recode -> {layout}") as bar:
    for start, stop in todo:
      dst.write(start, src.read(slice(start, stop)))
      bar.update((stop - start) * src.seq_len)
  return dst
