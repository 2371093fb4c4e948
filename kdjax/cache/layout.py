"""What each array of a sequence store holds on disk, and how top-k values are encoded.

Every array is a zarr v3 array sharded along rows: one shard file per region of `region_rows` rows
(the unit of crash safety, see store.py), one inner chunk per row so a random row read decodes only
that row. Inner chunks and shard indexes carry a crc32c codec, so a flipped byte fails to decode.
Only standard zarr v3 codecs are used (sharding_indexed, bytes, blosc, crc32c): plain tensorstore
and zarr-python read every array.

Layouts of the top-k arrays (S rows, T positions, K entries, H hidden width):
  float32: topk_ids int32, topk_logprobs float32 -- the reference, 8 bytes per entry before zstd.
  compact: topk_ids uint16 when the vocabulary fits, else int32; topk_logprobs uint16 "gaps":
           -logprob = cumsum(gaps, axis=-1) * logprob_scale. Entries are sorted by descending
           probability, so the first gap is the quantised top-1 and the rest are small non-negative
           steps that zstd packs into about a byte. Quantising absolute values (then differencing
           the integers) keeps the error of every entry at most scale / 2: no drift along K.
  packed:  topk_ids uint16 when the vocabulary fits, else uint32 (exact for any vocabulary);
           topk_logprobs uint16 gaps of a companded level: with the step s = logprob_scale and the
           offset p0 = prob_offset (store attributes; 2**-12 and 2**-9),
             n = round(-(log(p + p0) - log(1 + p0)) / s),  n_0 = gap_0, n_i = n_{i-1} + gap_i,
             p = max((1 + p0) * exp(-n * s) - p0, p0 * s / 4).
           Above p0 an entry keeps a relative precision of about s / 2 (finer than compact's for
           p > p0 at s = 2**-12); below p0 its absolute error is at most about p0 * s / 2. An
           entry's share of the loss and its gradients scales with p, so the many tiny entries of
           a top-100 need no more than that, and their gaps shrink to a few levels (zstd: a few
           bits each). p = 1 is level 0; p = 0 is the last level, read as p0 * s / 4.
  dictionary: packed's log-probs; topk_ids hold codes into each row's own id order, `topk_order`
           [S, M] (M = the attribute order_size, ids' dtype): the row's M most frequent top-k ids
           by descending count (ties: smaller id first), padded with the smallest ids the row
           lacks. An id's code is its place in the row's table = order, then every id not in it
           ascending, so any id has one (exact for any vocabulary); decode: ids = table[codes],
             mask = zeros(V, bool); mask[order] = True
             table = concatenate([order, flatnonzero(~mask)])
           A real teacher's top-k ids crowd on far fewer tokens than the vocabulary and than their
           raw ids suggest, so the small codes zstd stores in fewer bytes (SmolLM2's 8K rows: 147 B
           per position of ids and order against 173 for packed's ids, BENCHMARKS.md).
The teacher's final hidden states (optional, `hidden_dim` H > 0, either layout): `hidden` [S, T, H]
uint16 holding bfloat16 bit patterns (zarr v3 has no bfloat16: `read` views them as
ml_dtypes.bfloat16; plain readers: `np.asarray(x).view(ml_dtypes.bfloat16)`), 2 * H bytes per
position before zstd.
"""
import functools

import ml_dtypes
import numpy as np

from kdjax import choices

FORMAT_VERSION = 1
LAYOUTS = choices.LAYOUTS
TOKEN_ARRAYS = {"tokens": "int32", "segment_ids": "int32", "positions": "int32",
                "loss_mask": "bool"}
TOPK_ARRAYS = ("topk_ids", "topk_logprobs")
HIDDEN_ARRAY = "hidden"
ORDER_ARRAY = "topk_order"  # dictionary: each row's id order [S, M]
# 2**-11 nats: an entry's probability is off by at most 0.025% relative, and loss and gradients
# by ~1e-4 (5e-4 for a student close to the teacher) of a float32 cache, for ~13 bytes per position
# more than 2**-10 (experiments/studies/cache_compact.py). 65535 steps cover 32 nats; entries below
# -32 (p < 1.3e-14) are clipped there.
LOGPROB_SCALE = 2.0**-11
MAX_GAP = np.iinfo(np.uint16).max
# Packed: 2**-12 above p0 halves compact's error on the entries that carry the loss; p0 = 2**-9
# puts every entry below ~0.2% on an absolute grid of p0 * s = 4.8e-7. Measured against float32
# on SmolLM2's cache and Zipf teachers of V = 128256 and 201088
# (experiments/studies/cache_compact.py): loss and gradient errors below compact's on all three,
# 23-30 bytes per position fewer. p0 = 2**-7 saves 15 more, but its loss error is compact's (tiny
# entries weigh log p in the loss).
PACKED_SCALE = 2.0**-12
PACKED_OFFSET = 2.0**-9
# Dictionary: a row's order holds about as many ids as it has positions, within these bounds.
# On SmolLM2's rows of 8192 positions (~15K distinct top-100 ids a row) 4096..16384 entries
# store within 1 B per position of each other; the order itself costs ~2 B an entry, so a short
# row takes a short one.
MIN_ORDER, MAX_ORDER = 1024, 16384


def array_dtypes(k, vocab_size, layout, hidden_dim=0):
  """{name: stored numpy dtype name} for a store with these parameters."""
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
  dtypes = dict(TOKEN_ARRAYS)
  if k > 0:
    if layout == "float32":
      dtypes.update(topk_ids="int32", topk_logprobs="float32")
    else:
      wide = "int32" if layout == "compact" else "uint32"
      dtypes.update(topk_ids="uint16" if vocab_size <= 2**16 else wide, topk_logprobs="uint16")
    if layout == "dictionary":
      dtypes[ORDER_ARRAY] = dtypes["topk_ids"]
  if hidden_dim > 0:
    dtypes[HIDDEN_ARRAY] = "uint16"  # bfloat16 bit patterns
  return dtypes


def array_metadata(name, shape, dtype, region_rows, layout="float32"):
  """zarr v3 metadata of one array of a store."""
  # Top-k ids of a real teacher are concentrated on frequent tokens, so their high bits are
  # mostly zero: bit shuffle measured ~5% smaller than byte shuffle on the demo's V = 2048
  # (experiments/studies/cache_compact.py). Packed keeps byte shuffle: 1-4% smaller on SmolLM2's
  # V = 49152 and on Zipf ids at V = 128256. The dictionary's codes take bit shuffle: on
  # SmolLM2's 8K rows 2% smaller and zstd 1.8x faster than byte shuffle; on Zipf ids of 128256
  # (a far more spread teacher: 75K distinct ids a row against 15K) 4% larger, 2.6x faster.
  bits = name == "topk_ids" and layout in ("float32", "compact", "dictionary")
  # The dictionary's arrays take lower zstd levels than the other layouts' (blosc clevel c is
  # zstd level 2c - 1): on SmolLM2's 8K rows its log-prob gaps at clevel 2 store 1.9 B per
  # position more than at 5 for a quarter of zstd's time, its codes at 4 0.3 B more for 0.75 of
  # it, so its writer outpaces compact's (experiments/bench/cache_read_bench.py --compare-writes).
  clevel = {"topk_logprobs": 2, "topk_ids": 4}.get(name, 5) if layout == "dictionary" else 5
  return zarr_metadata(shape, dtype, region_rows, shuffle="bitshuffle" if bits else None,
                       clevel=clevel)


def zarr_metadata(shape, dtype, region_rows, *, shuffle=None, clevel=5):
  """zarr v3 metadata: one shard per region of rows, one inner chunk per row.

  shuffle: blosc's "shuffle" (bytes), "bitshuffle" or "noshuffle"; default bytes for multi-byte
  types.
  """
  itemsize = np.dtype(dtype).itemsize
  inner = [{"name": "bytes", "configuration": {"endian": "little"} if itemsize > 1 else {}}]
  # Byte shuffle groups the high bytes of small integers together before zstd.
  shuffle = shuffle or ("shuffle" if itemsize > 1 else "noshuffle")
  inner.append({"name": "blosc", "configuration": {
      "cname": "zstd", "clevel": clevel, "shuffle": shuffle, "typesize": itemsize, "blocksize": 0}})
  inner.append({"name": "crc32c"})
  index_codecs = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
  return {
      "shape": list(shape),
      "data_type": dtype,
      "chunk_grid": {"name": "regular",
                     "configuration": {"chunk_shape": [region_rows, *shape[1:]]}},
      "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
      "codecs": [{"name": "sharding_indexed", "configuration": {
          "chunk_shape": [1, *shape[1:]], "codecs": inner, "index_codecs": index_codecs,
          "index_location": "end"}}],
      "fill_value": False if dtype == "bool" else 0,
  }


def codec_params(layout):
  """{attribute: value} the top-k log-probs of `layout` are decoded with (stored in the store's
  attributes)."""
  packed = {"logprob_scale": PACKED_SCALE, "prob_offset": PACKED_OFFSET}
  return {"compact": {"logprob_scale": LOGPROB_SCALE}, "packed": packed,
          "dictionary": packed}.get(layout, {})


def order_size(seq_len, vocab_size):
  """M, the ids in each row's order of a new dictionary store."""
  return int(min(vocab_size, max(MIN_ORDER, min(seq_len, MAX_ORDER))))


def dictionary_encode(ids_SxTxK, vocab_size, size):
  """ids -> (codes_SxTxK, order_SxM) of the dictionary layout (module docstring), M = size."""
  codes = np.empty(ids_SxTxK.shape, ids_SxTxK.dtype)
  order_SxM = np.empty((ids_SxTxK.shape[0], size), ids_SxTxK.dtype)
  place_V = np.empty(vocab_size, ids_SxTxK.dtype)
  codes_V = np.arange(vocab_size, dtype=ids_SxTxK.dtype)
  shift = int(vocab_size).bit_length()
  for row, ids_TxK in enumerate(ids_SxTxK):
    counts_V = np.bincount(ids_TxK.ravel(), minlength=vocab_size)
    seen = np.flatnonzero(counts_V)
    # Descending count, ties by ascending id: one distinct key per id, so the top `size` are one
    # set whatever argpartition does, and only they are sorted.
    keys = (counts_V[seen].astype(np.int64) << shift) | (vocab_size - 1 - seen)
    if len(seen) > size:
      top = np.argpartition(-keys, size - 1)[:size]
      seen = seen[top[np.argsort(-keys[top])]]
    else:
      seen = seen[np.argsort(-keys)]
    unseen = np.flatnonzero(counts_V == 0)[:max(0, size - len(seen))]
    order_M = np.concatenate([seen, unseen])
    place_V[_table(order_M, vocab_size)] = codes_V
    np.take(place_V, ids_TxK, out=codes[row], mode="clip")  # ids checked < vocab_size
    order_SxM[row] = order_M
  return codes, order_SxM


def _table(order_M, vocab_size):
  """A row's code -> id table: its order, then every other id ascending."""
  mask_V = np.zeros(vocab_size, bool)
  mask_V[order_M] = True
  return np.concatenate([order_M, np.flatnonzero(~mask_V)])


def dictionary_decode(codes_SxTxK, order_SxM, vocab_size):
  """Codes and each row's order -> int32 ids. The codes must lie below vocab_size and the orders
  hold distinct ids below it (values.check_ids, values.check_order)."""
  ids = np.empty(codes_SxTxK.shape, np.int32)
  for row, (codes_TxK, order_M) in enumerate(zip(codes_SxTxK, order_SxM)):
    # mode "clip": numpy buffers `out` under "raise"; the codes were checked < vocab_size.
    np.take(_table(order_M, vocab_size).astype(np.int32), codes_TxK, out=ids[row], mode="clip")
  return ids


def encode_topk(ids_SxTxK, logprobs_SxTxK, dtypes, scale=LOGPROB_SCALE, offset=0.0):
  """Caller's int ids / float32 log-probs -> what is stored.

  scale: the log-prob step of compact and packed; offset: packed's p0 (0: compact).
  """
  ids = ids_SxTxK.astype(dtypes["topk_ids"])
  if dtypes["topk_logprobs"] == "float32":
    return ids, logprobs_SxTxK.astype(np.float32)
  # Gaps are non-negative when entries run by descending probability: lax.top_k's output does
  # (checked, one pass); any other order is sorted first, stably, so ties keep the caller's order.
  if np.any(logprobs_SxTxK[..., 1:] > logprobs_SxTxK[..., :-1]):
    order = np.argsort(-logprobs_SxTxK, axis=-1, kind="stable")
    ids = np.take_along_axis(ids, order, axis=-1)
    logprobs_SxTxK = np.take_along_axis(logprobs_SxTxK, order, axis=-1)
  # Clipped before the cast (far tails cannot overflow); rounding is monotone, so sorted entries
  # give non-decreasing steps.
  if offset:  # packed: (log(1 + p0) - log(p + p0)) / s >= 0, decreasing in p
    # float32 (~2x faster than compact's float64 path here, which a logaddexp would make 3x
    # slower): its rounding moves a level by at most ~0.002 of a step, so |p' - p| stays within
    # (p + p0) * (exp(0.502 s) - 1).
    neg = np.exp(logprobs_SxTxK, dtype=np.float32)
    neg += np.float32(offset)
    np.log(neg, out=neg)
    np.subtract(np.float32(np.log1p(offset)), neg, out=neg)
    neg *= np.float32(1 / scale)
    steps = np.maximum(np.rint(neg, out=neg), 0).astype(np.int32)  # log-probs a hair above 0
  else:
    neg = logprobs_SxTxK.astype(np.float64)
    neg *= -1 / scale
    steps = np.minimum(np.rint(neg, out=neg), MAX_GAP).astype(np.int32)
  gaps = np.diff(steps, axis=-1, prepend=0)
  return ids, gaps.astype(np.uint16)


@functools.lru_cache(maxsize=4)
def packed_logprobs(scale, offset):
  """log p of every uint16 level, float32 [65536]: levels past N (the level of p = 0) read as N,
  so any stored value decodes with one unchecked gather."""
  last = int(np.rint(np.log1p(1 / offset) / scale))
  levels = np.minimum(np.arange(MAX_GAP + 1), last)
  p = (1 + offset) * np.exp(-levels * scale) - offset  # float64: no cancellation
  return np.log(np.maximum(p, offset * scale / 4)).astype(np.float32)


def decode_topk(ids_SxTxK, stored_SxTxK, dtypes, scale=LOGPROB_SCALE, k=None, offset=0.0):
  """Stored top-k arrays -> int32 ids, float32 log-probs; k: only the k most probable entries."""
  k = k or ids_SxTxK.shape[-1]
  if dtypes["topk_logprobs"] == "float32":
    if k < ids_SxTxK.shape[-1]:
      # The teacher writes entries by descending probability; a store written otherwise is
      # sorted first (stable), so the first k are its top k either way.
      if np.any(np.diff(stored_SxTxK, axis=-1) > 0):
        order = np.argsort(-stored_SxTxK, axis=-1, kind="stable")[..., :k]
        return (np.take_along_axis(ids_SxTxK, order, -1).astype(np.int32),
                np.take_along_axis(stored_SxTxK, order, -1))
      ids_SxTxK, stored_SxTxK = ids_SxTxK[..., :k], stored_SxTxK[..., :k]
    return ids_SxTxK.astype(np.int32), np.ascontiguousarray(stored_SxTxK)
  # Compact and packed entries are sorted by descending probability (encode_topk): the first k
  # are the top k.
  ids = ids_SxTxK[..., :k].astype(np.int32, copy=False)
  stored_SxTxK = stored_SxTxK[..., :k]
  # Encoding keeps every cumulative sum <= MAX_GAP, so uint16 accumulation cannot wrap (on
  # intact data; damaged chunks fail their crc32c first). uint16 is ~3x faster than int64 here.
  levels = np.cumsum(stored_SxTxK, axis=-1, dtype=np.uint16)
  if offset:  # packed: one gather from the table of its levels
    return ids, np.take(packed_logprobs(scale, offset), levels, mode="clip")  # 65536 entries
  logprobs = levels.astype(np.float32)
  logprobs *= np.float32(-scale)
  return ids, logprobs


def encode_hidden(hidden_SxTxH):
  """Hidden states (any float dtype) -> the uint16 bit patterns of their bfloat16 rounding."""
  return np.asarray(hidden_SxTxH).astype(ml_dtypes.bfloat16).view(np.uint16)


def decode_hidden(stored_SxTxH):
  """Stored bit patterns -> bfloat16 hidden states (a view, no copy)."""
  return stored_SxTxH.view(ml_dtypes.bfloat16)
