"""Top-k ids coded against context a reader has for free: per-context candidate lists (issue 29).

    python -m experiments.studies.cache_context --cache /tmp/ctx/real/cache.zarr --allow-partial \
        --rows 176
    python -m experiments.studies.cache_context --synthetic-vocab 201088 --rows 32 --seq-len 512

cache_floor.py coded each position's ids on their own. Every cache row also stores its tokens, so a
reader knows a position's input token (and its neighbours) before it decodes the ids. Here each id
is stored as its index in a candidate list of the position's context (rank order kept, so the loss
still reads each id's own probability) or, if it is not in the list, as L + its place in a global
frequency order (an escape). Decode: one gather from a table [contexts, L] and one from the global
order, no sequential step.

Lists are learnt on the second half of the rows and measured on the first (as cache_floor.py's
remaps), from the teacher's ids (what a writer learns from the first regions it writes) or from
the data's bigrams, context -> next token (known before the teacher runs). Contexts: the input
token; the (previous, input) pair or the (input, next) pair, backing off to the input token where
the pair was seen fewer than --pair-min times; the next token (the realised one, stored too);
only the most frequent input tokens (the rest use the global order). A list holds its context's
most frequent ids (ties: the global order), then the global order's first ids not among them.

Sizes: B/pos of the codes written as a store writes them (cache_floor.stored_bytes: zarr v3, blosc
zstd 5, byte or bit shuffle); the order-0 entropy of the codes given the rank; the share of ids
found in their list; the table's bytes (its ids in the cache's id dtype, 256 contexts a chunk,
byte shuffle, zstd 5) spread over 1e9 positions and over the measured positions. Totals add the
best levels of cache_floor.py (packed's levels at s 2^-12, p0 2^-7, as rank-order gaps).

A synthetic teacher's `tokens` are its own top-1 ids (cache_compact.synthetic), which would leak
the first id; here its input token is the previous position's top-1, as text generated greedily
from it would be, and the next-token contexts are left out.

`--check [--seed N]` runs the measures on inputs whose answers are known by hand
(tests/test_cache_context.py runs it) and exits, 1 if one is wrong.

Letters: S rows, T positions, K top-k entries, N positions, M targets per position, C contexts, L
list length, V vocabulary.
"""
import os
import shutil
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from experiments.studies import cache_floor
from kdjax.cache import layout

CONTEXT_CHUNK = 256  # contexts per chunk of the stored table


def context_keys(tokens_SxT, kind, vocab):
  """Each position's context key [S, T] (int64): "token" its input token, "next" the next token,
  "pair" (previous, input), "token+next" (input, next); vocab stands for a neighbour past the row."""
  t = tokens_SxT.astype(np.int64)
  pad = np.full((t.shape[0], 1), vocab, np.int64)
  previous, following = np.concatenate([pad, t[:, :-1]], 1), np.concatenate([t[:, 1:], pad], 1)
  return {"token": t, "next": following, "pair": previous * (vocab + 1) + t,
          "token+next": t * (vocab + 1) + following}[kind]


def candidate_lists(keys_N, targets_NxM, place, length, *, min_count=1, max_contexts=0):
  """(context keys [C] ascending, lists [C, L]): for each context seen at least min_count times
  (only the max_contexts most frequent, if > 0), the targets that came with it most often, ties
  broken by the global order (place: id -> its place in it), then that order's first ids not
  among them. No id twice in a list."""
  vocab = len(place)
  key_values, key_counts = np.unique(keys_N, return_counts=True)
  keep = np.flatnonzero(key_counts >= min_count)
  if max_contexts:
    keep = keep[np.argsort(-key_counts[keep], kind="stable")[:max_contexts]]
  kept = np.sort(key_values[keep])
  row = np.minimum(np.searchsorted(kept, keys_N), max(len(kept) - 1, 0))
  seen = kept[row] == keys_N if len(kept) else np.zeros(len(keys_N), bool)
  pairs, counts = np.unique((row[seen, None] * vocab + targets_NxM[seen]).ravel(),
                            return_counts=True)
  pair_row, pair_id = pairs // vocab, pairs % vocab
  by = np.lexsort((place[pair_id], -counts, pair_row))
  pair_row, pair_id = pair_row[by], pair_id[by]
  start = np.searchsorted(pair_row, pair_row, side="left")
  slot = np.arange(len(pair_row)) - start
  lists = np.full((len(kept), length), -1, np.int64)
  top = slot < length
  lists[pair_row[top], slot[top]] = pair_id[top]
  # The fill: at most n <= L of the global order's first 2L ids are in a list of n, so at least
  # L - n of them are not.
  order = np.argsort(place)[:2 * length]
  filled = (lists >= 0).sum(1)
  for first in range(0, len(kept), 4096):  # in chunks: [chunk, 2L] int64 each
    block = lists[first:first + 4096]  # a view: written in place
    row_C1 = np.arange(len(block))[:, None]
    present = np.sort(np.where(block >= 0, row_C1 * vocab + block, -1), None)
    wanted = row_C1 * vocab + order[None]
    at = np.minimum(np.searchsorted(present, wanted), present.size - 1)
    fresh = present[at] != wanted
    to = filled[first:first + 4096, None] + np.cumsum(fresh, 1) - 1
    r, j = np.nonzero(fresh & (to < length))
    block[r, to[r, j]] = order[j]
  return kept, lists


def backoff_table(levels, targets_NxM, place, length):
  """(lists [C, L], rows [N'] into them): levels [(train keys [N], measured keys [N'], min_count,
  max_contexts)], finest first; a measured position takes the first level that kept its key,
  else the last row, the global order's first L ids."""
  tables, rows, offset = [], None, 0
  for keys_train, keys, min_count, max_contexts in levels:
    kept, lists = candidate_lists(keys_train, targets_NxM, place, length, min_count=min_count,
                                  max_contexts=max_contexts)
    at = np.minimum(np.searchsorted(kept, keys), max(len(kept) - 1, 0))
    found = kept[at] == keys if len(kept) else np.zeros(len(keys), bool)
    rows = np.full(len(keys), -1) if rows is None else rows
    rows = np.where((rows < 0) & found, offset + at, rows)
    tables.append(lists)
    offset += len(kept)
  tables.append(np.argsort(place)[None, :length])
  return np.concatenate(tables), np.where(rows < 0, offset, rows)


def encode_ids(ids_NxK, rows_N, lists_CxL, place):
  """codes [N, K]: each id's index in its position's list, else L + its place in the global order."""
  vocab, length = len(place), lists_CxL.shape[1]
  keys = (np.arange(len(lists_CxL))[:, None] * vocab + lists_CxL).ravel()
  by = np.argsort(keys)
  wanted = rows_N[:, None] * vocab + ids_NxK
  at = np.minimum(np.searchsorted(keys, wanted, sorter=by), keys.size - 1)
  inside = keys[by[at]] == wanted
  return np.where(inside, by[at] % length, length + place[ids_NxK])


def flat_table(lists_CxL, order):
  """The decode's one table (int32): the lists row after row, then the global order."""
  return np.concatenate([lists_CxL.ravel(), order]).astype(np.int32)


def decode_ids(codes_NxK, rows_N, flat, length, vocab):
  """ids [N, K] of codes_NxK: one gather from flat_table's output (list row r's entry j at r L + j;
  the escape L + g, global place g, at C L + g)."""
  escape = np.int32(len(flat) - vocab - length)
  return flat[np.where(codes_NxK < length, (rows_N * length).astype(np.int32)[:, None] + codes_NxK,
                       codes_NxK + escape)]


def entropy_given_rank(codes_NxK):
  """Order-0 entropy of the codes given the rank, B/pos."""
  return sum(cache_floor.entropy_bits(codes_NxK[:, r]) for r in range(codes_NxK.shape[1])) / 8


def context_table(ids, tokens, n, vocab, size, out, synthetic):
  """The table of codings; returns (ids [N, K], rows, lists, order) of the smallest coding whose
  context is the input token alone."""
  rows_all, seq_len, k = ids.shape
  half = max(1, rows_all // 2)
  train, measured = slice(half, None) if rows_all > 1 else slice(None), slice(None, half)
  place = cache_floor.frequency_order(ids[train], vocab)
  order = np.argsort(place)
  ids_NxK = ids[measured].reshape(-1, k)
  positions = len(ids_NxK)
  levels_bytes = size(np.diff(n[measured], axis=-1, prepend=0).astype(np.uint16), "shuffle")
  print(f"\n### Ids against per-context lists ({half} rows measured, {rows_all - half} rows to "
        f"learn the lists and the global order); levels s 2^-12, p0 2^-7 as rank-order gaps: "
        f"{levels_bytes:.1f} B/pos\n")
  print("| lists from | context | L | contexts | ids in list | entropy of codes given rank | "
        "B/pos byte shuffle | bit shuffle | table KB (zstd) | table B/pos over 1e9 / "
        "measured | ids (best) + levels |\n|---|---|---|---|---|---|---|---|---|---|---|")
  keys = {kind: context_keys(tokens, kind, vocab) for kind in ("token", "pair", "next",
                                                               "token+next")}
  has_next = np.ones(tokens.shape, bool)
  has_next[:, -1] = False
  following = np.concatenate([tokens[:, 1:], tokens[:, -1:]], 1)
  best = (np.inf, None)

  def row(source, kind, length, levels_spec, train_rows=train):
    nonlocal best
    if source.startswith("teacher"):
      targets = ids[train_rows].reshape(-1, k)
      pick = lambda key: key[train_rows].ravel()
    else:  # the data's bigrams: a context -> the token after it
      targets = following[train_rows][has_next[train_rows]][:, None]
      pick = lambda key: key[train_rows][has_next[train_rows]]
    if length:
      lists, rows = backoff_table(
          [(pick(keys[name]), keys[name][measured].ravel(), min_count, max_contexts)
           for name, min_count, max_contexts in levels_spec], targets, place, length)
      codes = encode_ids(ids_NxK, rows, lists, place)
      assert (decode_ids(codes, rows, flat_table(lists, order), length, vocab) == ids_NxK).all()
      chunks = -(-len(lists) // CONTEXT_CHUNK) * CONTEXT_CHUNK
      table = np.zeros((chunks, length), np.int64)
      table[:len(lists)] = lists
      table_dtype = np.uint16 if vocab <= 2**16 else np.uint32
      table_bytes = cache_floor.stored_bytes(
          table.reshape(-1, CONTEXT_CHUNK * length).astype(table_dtype), os.path.join(out, "t"),
          1, "shuffle")
    else:
      lists, rows, codes, table_bytes = None, None, place[ids_NxK], 0
    wide = np.uint16 if codes.max() < 2**16 else np.uint32
    stored = codes.reshape(half, seq_len, k).astype(wide)
    byte, bit = size(stored, "shuffle"), size(stored, "bitshuffle")
    total = min(byte, bit) + table_bytes / 1e9 + levels_bytes
    print(f"| {source} | {kind} | {length} | {len(lists) - 1 if length else 0} | "
          f"{(codes < length).mean():.0%} | {entropy_given_rank(codes):.1f} | {byte:.1f} | "
          f"{bit:.1f} | {table_bytes / 1e3:,.0f} | {table_bytes / 1e9:.3f} / "
          f"{table_bytes / positions:.1f} | {total:.1f} |", flush=True)
    input_token = [name for name, _, _ in levels_spec] == ["token"]  # decode_speed's row map
    if length and input_token and train_rows is train and min(byte, bit) < best[0]:
      best = (min(byte, bit), (ids_NxK, rows, lists, order))

  token = [("token", 1, 0)]
  row("global order only", "-", 0, [])
  for length in (64, 256, 1024):
    row("teacher", "input token", length, token)
  for length in (64, 256, 1024):
    row("data bigrams", "input token", length, token)
  for max_contexts in (1024, 4096):
    row("teacher", f"input token, the {max_contexts} most frequent", 256,
        [("token", 1, max_contexts)])
  for min_count in (2, 8):
    row("teacher", f"(previous, input) seen >= {min_count}, else input", 256,
        [("pair", min_count, 0)] + token)
  if not synthetic:
    row("teacher", "next token", 256, [("next", 1, 0)])
    for min_count in (2, 8):
      row("teacher", f"(input, next) seen >= {min_count}, else input", 256,
          [("token+next", min_count, 0)] + token)
  if rows_all >= 4:  # the lists from fewer rows: how fast a writer's table improves
    row("teacher, half the rows", "input token", 256, token,
        slice(half, half + (rows_all - half) // 2))
  for length in (256, 1024):  # lists learnt on the measured rows themselves: no coding (they
    # memorise the rows), an optimistic bound on what any writer's lists could do here
    row("teacher, the measured rows (a bound)", "input token", length, token, measured)
  return best[1]


def decode_speed(ids_NxK, rows_N, lists_CxL, order, n_NxK, tokens_N):
  """Positions/s, one thread: the ids' decode (a row per position from its input token through a
  V-entry map, then one gather per id), and with the levels' cumsum + gather."""
  vocab, length = len(order), lists_CxL.shape[1]
  codes = encode_ids(ids_NxK, rows_N, lists_CxL, np.argsort(order)).astype(
      np.uint16 if vocab + length <= 2**16 else np.uint32)
  flat = flat_table(lists_CxL, order)
  row_of_token = np.full(vocab, len(lists_CxL) - 1, np.int32)
  row_of_token[tokens_N] = rows_N  # the input token's row (its context is that token)
  assert (row_of_token[tokens_N] == rows_N).all()
  gaps = np.diff(n_NxK, axis=-1, prepend=0).astype(np.uint16)
  logprobs = layout.packed_logprobs(*cache_floor.QUANTISER)
  ids = lambda: decode_ids(codes, row_of_token[tokens_N], flat, length, vocab)
  assert (ids() == ids_NxK).all()
  rates = []
  for fn in (ids, lambda: (ids(), np.take(logprobs, np.cumsum(gaps, -1, dtype=np.uint16)))):
    start = time.perf_counter()
    for _ in range(5):
      fn()
    rates.append(5 * len(codes) / (time.perf_counter() - start))
  print(f"\nthe best coding's decode, one thread, {len(codes)} positions: ids {rates[0] / 1e6:.2f}M "
        f"positions/s; ids + levels {rates[1] / 1e6:.2f}M positions/s (zstd aside)")


def check(seed):
  """The measures on inputs whose answers are known by hand; random ones drawn from seed."""
  np.testing.assert_array_equal(context_keys(np.array([[3, 4, 5]]), "pair", 10),
                                [[10 * 11 + 3, 3 * 11 + 4, 4 * 11 + 5]])
  np.testing.assert_array_equal(context_keys(np.array([[3, 4, 5]]), "next", 10), [[4, 5, 10]])
  place = np.array([0, 1, 2, 3, 4, 5, 6, 7])  # the global order is the ids' own
  # Context 5 saw 1 three times, 2 twice, 3 once; context 7 saw 4 and 1 once each (tie: 1 first,
  # the global order); context 9 was seen once, below min_count 2.
  keys = np.array([5, 5, 5, 7, 9])
  targets = np.array([[1, 2], [1, 3], [1, 2], [4, 1], [6, 7]])
  kept, lists = candidate_lists(keys, targets, place, 4, min_count=2)
  np.testing.assert_array_equal(kept, [5])
  kept, lists = candidate_lists(keys, targets, place, 4)
  np.testing.assert_array_equal(kept, [5, 7, 9])
  np.testing.assert_array_equal(lists, [[1, 2, 3, 0], [1, 4, 0, 2], [6, 7, 0, 1]])
  lists, rows = backoff_table([(keys, np.array([7, 8, 5]), 1, 1)], targets, place, 3)
  # Only context 5 kept (the most frequent); 7 and 8 take the global row.
  np.testing.assert_array_equal(lists, [[1, 2, 3], [0, 1, 2]])
  np.testing.assert_array_equal(rows, [1, 1, 0])
  codes = encode_ids(np.array([[2, 0, 5], [5, 1, 2]]), np.array([0, 1]), lists, place)
  np.testing.assert_array_equal(codes, [[1, 3 + 0, 3 + 5], [3 + 5, 1, 2]])
  rng = np.random.default_rng(seed)
  vocab, length = 300, 16
  ids = np.stack([rng.choice(vocab, 20, replace=False) for _ in range(500)])
  place = rng.permutation(vocab)
  ctx = rng.integers(0, 40, 500)
  lists, rows = backoff_table([(ctx[:250], ctx[250:], 1, 0)], ids[:250], place, length)
  assert all(len(set(row)) == length for row in lists)
  codes = encode_ids(ids[250:], rows, lists, place)
  np.testing.assert_array_equal(decode_ids(codes.astype(np.uint16), rows,
                                          flat_table(lists, np.argsort(place)), length, vocab),
                                ids[250:])
  print(f"check passed (seed {seed}): context keys, candidate lists, backoff, codes and decode")


def main():
  args = cache_floor.parser_of_rows(__doc__).parse_args()
  if args.check:
    return check(args.seed)

  rows, vocab = cache_floor.rows_of(args)
  tokens = rows["tokens"].astype(np.int64)
  if not args.cache:  # see the docstring
    tokens = np.roll(rows["topk_ids"][..., 0].astype(np.int64), 1, axis=1)
  ids = rows["topk_ids"].astype(np.int64)
  out = args.out or tempfile.mkdtemp(prefix="cache_context_")
  size = cache_floor.store_sizer(out, max(1, min(ids.shape[0], 2**18 // ids.shape[1])))
  n, _, _ = cache_floor.levels(rows["topk_logprobs"], *cache_floor.QUANTISER, diffuse=False)
  best = context_table(ids, tokens, n, vocab, size, out, synthetic=not args.cache)
  half = max(1, ids.shape[0] // 2)
  decode_speed(*best, n[:half].reshape(-1, ids.shape[2]), tokens[:half].ravel())
  if not args.out:
    shutil.rmtree(out)


if __name__ == "__main__":
  main()
