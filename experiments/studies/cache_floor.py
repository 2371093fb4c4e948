"""How small can a top-k cache be? Entropy floors and measured codings of its ids and log-probs.

    python -m experiments.studies.cache_floor --cache /tmp/cb/real/cache.zarr --allow-partial \
        --rows 176
    python -m experiments.studies.cache_floor --synthetic-vocab 201088 --rows 32 --seq-len 512 \
        --loss-positions 1024

Rows as experiments/studies/cache_compact.py reads or makes them (a float32 cache, or its
synthetic Zipf teacher). Sizes are bytes per position (B/pos) of an array written as a store writes it
(row-sharded zarr v3, blosc zstd 5, crc32c; cache_compact.disk_bytes) or, where a table says
"entropy", the empirical entropy of the stated model: what an ideal coder of that model would
need, with no container. Three tables:

1. Log-prob quantisers: packed's levels n = round((log(1 + p0) - log(p + p0)) / s) for several
   (s, p0), plain or with error diffusion (each entry's rounding error in p carried into the next
   rank, so most of a position's mass is kept: not the carry that would lift an entry above the
   one before it): B/pos of their gaps in rank order, the entropy of those
   gaps given the rank, the entropy of the order that ties leave undetermined (log2(K!/prod m!),
   m the sizes of runs of equal levels: what ids stored as a set would still have to say about
   the ranks), and the loss and gradient errors against float32 (cache_compact's measure).
2. Codings of the ids, as stored (raw), remapped to a frequency order learnt on the other half of
   the rows, and remapped to the frequency order of the rows' tokens (what a writer could know
   before the teacher runs), measured on the first half: rank order (blosc clevel 1, 5, 9; byte,
   bit or no shuffle); 18-bit packing (V > 65536); the set alone (ascending gaps); the set against the
   previous position's set (a flag per previous entry + the new ids' gaps); the set with the
   levels in id order (ranks recovered by sorting); the head (p above a threshold) in rank order
   and the tail as a set.
3. Floors of codings that code each position on its own, given the row's id frequencies: the
   set's entropy (K H0 - log2 K!), the sorted levels', the ties' order; and the decode cost of
   sorting.

`--check [--seed N]` runs the measures on inputs whose answers are known by hand (the tables rest
on them; tests/test_cache_floor.py runs it) and exits, 1 if one is wrong.

Letters: S rows, T positions, K top-k entries, N positions of any shape.
"""
import argparse
import os
import shutil
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax.numpy as jnp
import numpy as np
import tensorstore as ts
from scipy.special import gammaln

from experiments.studies import cache_compact
from kdjax.cache import layout

QUANTISERS = ((11, 0, False), (12, 9, False), (12, 7, False), (12, 7, True), (12, 5, False),
              (12, 5, True), (12, 3, False), (12, 3, True))  # (-log2 s, -log2 p0 (0: compact), diffuse)


def entropy_bits(x):
  """Empirical order-0 entropy of the values of x, bits per value."""
  _, counts = np.unique(x, return_counts=True)
  share = counts / counts.sum()
  return float(-(share * np.log2(share)).sum())


def log2_factorial(n):
  return gammaln(np.asarray(n, np.float64) + 1) / np.log(2)


def levels(lp, s, p0, diffuse):
  """Packed's levels of float32 log-probs [..., K] (descending) and the p they decode to."""
  last = int(np.rint(np.log1p(1 / p0) / s))
  table = np.maximum((1 + p0) * np.exp(-np.arange(last + 1) * s) - p0, p0 * s / 4)
  level = lambda p: np.clip(np.rint((np.log1p(p0) - np.log(np.maximum(p, 0) + p0)) / s), 0,
                            last).astype(np.int64)
  p = np.exp(lp.astype(np.float64))
  if not diffuse:
    n = level(p)
    return n, table[n], last
  n = np.empty(p.shape, np.int64)
  carry, previous = np.zeros(p.shape[:-1]), np.zeros(p.shape[:-1], np.int64)
  for i in range(p.shape[-1]):  # sequential along the ranks; gaps stay >= 0, so a carry that
    # would lift an entry above the one before it stays in the carry
    target = p[..., i] + carry
    n[..., i] = previous = np.maximum(level(target), previous)
    carry = target - table[previous]
  return n, table[n], last


def tie_order_bits(n_NxK):
  """log2(K! / prod m!) per position: the orders of runs of equal (sorted) levels."""
  k = n_NxK.shape[-1]
  new = np.concatenate([np.ones(n_NxK.shape[:-1] + (1,), bool),
                        n_NxK[..., 1:] != n_NxK[..., :-1]], -1)
  start = np.maximum.accumulate(np.where(new, np.arange(k), 0), axis=-1)
  within = np.arange(k) - start + 1  # m! = prod of the 1-based places within a run
  return log2_factorial(k) - np.log2(within).sum(-1)


def quantiser_table(ids, lp, mask, vocab, size, loss_positions):
  k = ids.shape[-1]
  few = max(1, min(ids.shape[0], loss_positions // ids.shape[1]))
  hidden, lm_head, _ = cache_compact.student("random", ids[:few], lp[:few], vocab, 64)
  mask = jnp.asarray(mask[:few])
  loss = lambda lp_, obj: cache_compact.loss_and_grads(hidden, lm_head, jnp.asarray(ids[:few]),
                                                       jnp.asarray(lp_[:few]), mask, obj)
  reference = {obj: loss(lp, obj) for obj in cache_compact.OBJECTIVES}
  print(f"\n### Log-prob quantisers (errors on the first {few} rows, random student D 64, max over "
        f"{cache_compact.OBJECTIVES})\n")
  print("| levels | B/pos (rank-order gaps) | entropy of gaps given rank | entropy of tie order | "
        "loss err | grad hidden err | grad lm_head err |\n|---|---|---|---|---|---|---|")
  out = {}
  for s_bits, p0_bits, diffuse in QUANTISERS:
    if p0_bits:
      n, p, _ = levels(lp, 2.0**-s_bits, 2.0**-p0_bits, diffuse)
      name = f"packed s 2^-{s_bits}, p0 2^-{p0_bits}" + (", error diffusion" if diffuse else "")
      decoded = np.log(p).astype(np.float32)
    else:  # compact: uniform steps of log p
      n = np.rint(-lp.astype(np.float64) * 2**s_bits).astype(np.int64)
      name, decoded = f"compact s 2^-{s_bits}", (-n * 2.0**-s_bits).astype(np.float32)
    gaps = np.diff(n, axis=-1, prepend=0)
    errors = np.zeros(3)
    for obj in cache_compact.OBJECTIVES:
      value, (g_hidden, g_head) = loss(decoded, obj)
      value32, (g_hidden32, g_head32) = reference[obj]
      errors = np.maximum(errors, [abs(float(value) - float(value32)) / abs(float(value32)),
                                   cache_compact.rel(g_hidden, g_hidden32),
                                   cache_compact.rel(g_head, g_head32)])
    gap_entropy = sum(entropy_bits(gaps[..., r]) for r in range(k)) / 8
    ties = tie_order_bits(n).mean() / 8
    out[(s_bits, p0_bits, diffuse)] = (n, gap_entropy, ties)
    print(f"| {name} | {size(gaps.astype(np.uint16), 'shuffle'):.1f} | {gap_entropy:.1f} | "
          f"{ties:.1f} | {errors[0]:.1e} | {errors[1]:.1e} | {errors[2]:.1e} |", flush=True)
  return out


def frequency_order(ids, vocab):
  """id -> its place in the ids' frequency order (most frequent 0)."""
  order = np.argsort(-np.bincount(ids.ravel(), minlength=vocab), kind="stable")
  place = np.empty(vocab, np.int64)
  place[order] = np.arange(vocab)
  return place


def set_gaps(ids):
  return np.diff(np.sort(ids, -1), axis=-1, prepend=0)


def against_previous(ids_SxTxK):
  """(flags uint8 [S, T, ceil(K/8)], new ids' ascending gaps [S, T, K] padded with zeros): each
  position's set coded against the previous position's (the first: all new)."""
  srt = np.sort(ids_SxTxK, -1)
  rows, steps, k = srt.shape
  previous = np.concatenate([np.full((rows, 1, k), -1, srt.dtype), srt[:, :-1]], 1)
  # Entry j of the previous set is kept iff it is in this set (both sorted: a searchsorted per row).
  flat = lambda x: (np.arange(rows * steps)[:, None] * (srt.max() + 2) + x.reshape(-1, k) + 1)
  here, before = flat(srt).ravel(), flat(previous).ravel()
  kept = np.isin(before, here).reshape(rows, steps, k)
  new = ~np.isin(here, before).reshape(rows, steps, k)
  fresh = np.where(new, srt, np.iinfo(np.int64).max)
  fresh = np.sort(fresh, -1)
  gaps = np.diff(np.where(fresh == np.iinfo(np.int64).max, 0, fresh), axis=-1, prepend=0)
  gaps = np.where(fresh == np.iinfo(np.int64).max, 0, gaps)
  return np.packbits(kept, axis=-1), gaps, kept.sum(-1)


def head_tail(ids, n, last, threshold_level):
  """Head (levels < threshold_level) in rank order with its ids; tail as ascending ids with
  levels counted from the last: (ids stored, levels stored, head sizes)."""
  rows, steps, k = ids.shape
  head = n < threshold_level
  order = np.argsort(np.where(head, np.arange(k) - k, ids), -1, kind="stable")
  ids_o, n_o, head_o = (np.take_along_axis(x, order, -1) for x in (ids, n, head))
  first = np.ones((rows, steps, 1), bool)
  before = np.concatenate([np.zeros((rows, steps, 1), ids.dtype), ids_o[..., :-1]], -1)
  before = np.where(np.concatenate([first, head_o[..., :-1]], -1), 0, before)
  n_before = np.concatenate([np.zeros((rows, steps, 1), n.dtype), n_o[..., :-1]], -1)
  return (np.where(head_o, ids_o, ids_o - before), np.where(head_o, n_o - n_before, last - n_o),
          head.sum(-1))


def id_table(ids, tokens, n, last, vocab, size, wide):
  half = max(1, ids.shape[0] // 2)
  place = frequency_order(ids[half:] if ids.shape[0] > 1 else ids, vocab)
  by_tokens = frequency_order(tokens, vocab)
  sample = ids[:half]
  print(f"\n### Ids ({half} rows; remapped: a frequency order learnt on the other "
        f"{ids.shape[0] - half} rows), levels {QUANTISER_NAME}\n")
  print("| coding | B/pos, ids as stored | remapped | remapped by the tokens' frequencies |\n"
        "|---|---|---|---|")

  def row(name, fn):
    print(f"| {name} | {fn(sample):.1f} | {fn(place[sample]):.1f} | {fn(by_tokens[sample]):.1f} |",
          flush=True)

  row("rank order, byte shuffle (packed)", lambda x: size(x.astype(wide), "shuffle"))
  row("rank order, no shuffle", lambda x: size(x.astype(wide), "noshuffle"))
  row("rank order, bit shuffle", lambda x: size(x.astype(wide), "bitshuffle"))
  for level in (1, 9):  # blosc's clevel; 5 (the stores') is zstd's level 9, 9 its maximum, 22
    row(f"rank order, byte shuffle, blosc clevel {level}",
        lambda x: size(x.astype(wide), "shuffle", level))
  if vocab > 2**16:
    bits = int(np.ceil(np.log2(vocab)))
    row(f"rank order, {bits}-bit packed", lambda x: size(np.packbits(
        ((x[..., None] >> np.arange(bits)) & 1).astype(np.uint8), axis=-1,
        bitorder="little").reshape(x.shape[:2] + (-1,)), "noshuffle"))
  row("the set alone: ascending gaps", lambda x: size(set_gaps(x).astype(wide), "shuffle"))
  row("the set alone: ascending gaps, blosc clevel 9",
      lambda x: size(set_gaps(x).astype(wide), "shuffle", 9))

  def previous(x):
    flags, gaps, _ = against_previous(x)
    return size(flags, "noshuffle") + size(gaps.astype(wide), "shuffle")
  row("the set against the previous position's: flags + new ids' gaps", previous)
  ns = n[:half]

  def with_levels(x):
    order = np.argsort(x, -1, kind="stable")
    lv = last - np.take_along_axis(ns, order, -1)
    return size(set_gaps(x).astype(wide), "shuffle") + size(lv.astype(np.uint16), "shuffle")
  row("the set + levels in id order (ranks by sorting), ids + levels", with_levels)
  rank_levels = size(np.diff(ns, axis=-1, prepend=0).astype(np.uint16), "shuffle")
  row("rank order (byte shuffle) + levels as rank-order gaps",
      lambda x: size(x.astype(wide), "shuffle") + rank_levels)
  s, p0 = QUANTISER
  for p_head in (1e-2, 1e-3, 1e-4):
    threshold = int(np.rint((np.log1p(p0) - np.log(p_head + p0)) / s))

    def split(x):
      stored_ids, stored_levels, heads = head_tail(x, ns, last, threshold)
      return (size(stored_ids.astype(wide), "shuffle") + size(stored_levels.astype(np.uint16),
              "shuffle") + size(heads.astype(np.uint8), "noshuffle"))
    row(f"head p > {p_head:g} in rank order, tail as a set; ids + levels + head sizes", split)


def floors(ids, quantised):
  k = ids.shape[-1]
  per_row = np.mean([entropy_bits(row) for row in ids]) * k / 8
  overall = entropy_bits(ids) * k / 8
  by_rank = np.mean([entropy_bits(ids[..., r]) for r in range(k)]) * k / 8
  set_floor = per_row - log2_factorial(k) / 8
  _, _, shared = against_previous(ids)
  h = lambda f: -(f * np.log2(f) + (1 - f) * np.log2(1 - f)) if 0 < f < 1 else 0.0
  f = shared[:, 1:].mean() / k
  new = k - shared[:, 1:]
  previous = (k * h(f) + (new * per_row * 8 / k - log2_factorial(new))).mean() / 8
  print(f"\n### Floors (entropy, B/pos; {ids.shape[0]} x {ids.shape[1]} positions)\n")
  print(f"- ids in rank order, order-0: {overall:.1f} over all rows, {by_rank:.1f} given the rank, "
        f"{per_row:.1f} given the row's own frequencies")
  print(f"- the set (K H0 - log2 K!, the row's frequencies): {set_floor:.1f}; against the previous "
        f"position's set ({f:.0%} of its ids shared): {previous:.1f}")
  print("\n| levels | sorted levels | tie order | set + sorted levels + tie order |\n|---|---|---|---|")
  for (s_bits, p0_bits, diffuse), (_, gap_entropy, ties) in quantised.items():
    if p0_bits and not diffuse:
      print(f"| s 2^-{s_bits}, p0 2^-{p0_bits} | {gap_entropy:.1f} | {ties:.1f} | "
            f"{set_floor + gap_entropy + ties:.1f} |")


def decode_speed(ids, n, last):
  """Positions/s, one thread: packed's decode (cumsum + gather) against a sort by level."""
  flat_ids, flat_n = ids.reshape(-1, ids.shape[-1]), n.reshape(-1, n.shape[-1])
  gaps = np.diff(flat_n, axis=-1, prepend=0).astype(np.uint16)
  table = layout.packed_logprobs(*QUANTISER)
  keys = (flat_n.astype(np.uint64) << np.uint64(32)) | flat_ids.astype(np.uint64)
  timings = {}
  for name, fn in (("cumsum + gather (packed)",
                    lambda: np.take(table, np.cumsum(gaps, -1, dtype=np.uint16))),
                   ("np.sort of (level, id) keys", lambda: np.sort(keys, -1)),
                   ("np.argsort of levels + gathers", lambda: np.take_along_axis(
                       flat_ids, np.argsort(flat_n, -1, kind="stable"), -1))):
    start = time.perf_counter()
    for _ in range(3):
      fn()
    timings[name] = 3 * len(flat_n) / (time.perf_counter() - start)
  print("\n" + "; ".join(f"{name}: {rate / 1e6:.2f}M positions/s" for name, rate in
                         timings.items()) + " (one thread)")


def store_array(arr, path, region_rows, shuffle, clevel=5, threads=None):
  """A new empty array at path shaped as arr [S, ...], as a store writes one (row-sharded zarr
  v3, blosc zstd at level clevel, crc32c); threads: tensorstore's encoding threads (default its
  own)."""
  meta = layout.zarr_metadata(arr.shape, arr.dtype.name, region_rows, shuffle=shuffle,
                              clevel=clevel)
  spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": path}, "metadata": meta}
  if threads:
    spec["context"] = {"data_copy_concurrency": {"limit": threads}}
  return ts.open(spec, create=True, delete_existing=True).result()


def array_bytes(path):
  """Bytes of the array at path on disk, metadata aside."""
  return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path)
             for name in names if name != "zarr.json")


def stored_bytes(arr, path, region_rows, shuffle, clevel=5):
  """Bytes of arr [S, ...] written at path as a store writes an array, metadata aside."""
  store_array(arr, path, region_rows, shuffle, clevel).write(arr).result()
  return array_bytes(path)


def store_sizer(out, region_rows):
  """size(arr, shuffle, clevel=5): B/pos of arr [S, T, ...] written as a store writes it."""
  return lambda arr, shuffle, clevel=5: stored_bytes(
      arr, os.path.join(out, "x"), region_rows, shuffle, clevel) / (arr.shape[0] * arr.shape[1])


QUANTISER = (2.0**-12, 2.0**-7)
QUANTISER_NAME = "s 2^-12, p0 2^-7"


def check(seed):
  """The measures on inputs whose answers are known by hand; random ones drawn from seed."""
  # Runs of 3, 1 and 2 equal levels among 6 entries: 6! / (3! 1! 2!) = 60 orders.
  np.testing.assert_allclose(tie_order_bits(np.array([[0, 0, 0, 4, 7, 7]])), [np.log2(60)])
  np.testing.assert_allclose(tie_order_bits(np.arange(5)[None]), [np.log2(120)])

  flags, gaps, shared = against_previous(np.array([[[5, 1, 9], [9, 2, 5], [7, 8, 6]]]))
  # Position 1 keeps 5 and 9 of the previous set [1, 5, 9] (bits 011, most significant first)
  # and adds 2; position 2 keeps nothing of [2, 5, 9].
  np.testing.assert_array_equal(flags[0, :, 0], [0, 0b01100000, 0])
  np.testing.assert_array_equal(gaps[0], [[1, 4, 4], [2, 0, 0], [6, 1, 1]])
  np.testing.assert_array_equal(shared[0], [0, 2, 0])

  stored_ids, stored_levels, heads = head_tail(np.array([[[40, 7, 30, 3, 12]]]),
                                               np.array([[[0, 5, 9, 11, 11]]]), last=20,
                                               threshold_level=9)
  # Head: ids 40, 7 as they are, level gaps 0, 5. Tail: ids 3, 12, 30 ascending as gaps from 0,
  # their levels counted from the last (20 - 11, 20 - 11, 20 - 9).
  np.testing.assert_array_equal(heads, [[2]])
  np.testing.assert_array_equal(stored_ids[0, 0], [40, 7, 3, 9, 18])
  np.testing.assert_array_equal(stored_levels[0, 0], [0, 5, 9, 9, 11])

  s, p0 = 2.0**-12, 2.0**-5
  rng = np.random.default_rng(seed)
  p_NxK = -np.sort(-rng.dirichlet(np.ones(400), size=256), axis=-1)[:, :100]
  mass_errors = []
  for diffuse in (False, True):
    n, decoded, last = levels(np.log(p_NxK).astype(np.float32), s, p0, diffuse)
    assert (np.diff(n, axis=-1) >= 0).all() and n.max() <= last
    if not diffuse:  # each entry within half a step (p + p0) s / 2, float32 log-probs aside
      assert (np.abs(decoded - p_NxK) <= (p_NxK + p0) * s * 0.51).all()
    mass_errors.append(np.abs(decoded.sum(-1) - p_NxK.sum(-1)).mean())
  # Diffusion leaves the carry it cannot spend without lifting an entry above the one before
  # (0.10-0.12 of the plain rounding's mass error on these inputs, 20 seeds).
  assert mass_errors[1] <= 0.25 * mass_errors[0], mass_errors
  print(f"check passed (seed {seed}): tie orders, sets against the previous position's, "
        "head and tail, levels")


def parser_of_rows(doc):
  """The command line of a study of a cache's rows: --cache or a synthetic teacher, --out,
  --check and its --seed."""
  parser = argparse.ArgumentParser(description=doc.split("\n")[0])
  parser.add_argument("--cache", default="", help="float32 teacher cache; empty: synthetic teacher")
  parser.add_argument("--rows", type=int, default=64, help="rows of the cache to use")
  parser.add_argument("--allow-partial", action="store_true",
                      help="read the finished regions of a cache still being written")
  parser.add_argument("--synthetic-vocab", type=int, default=32000,
                      help="synthetic teacher's vocabulary (without --cache)")
  parser.add_argument("--seq-len", type=int, default=128, help="synthetic rows' positions")
  parser.add_argument("--out", default="", help="scratch directory (default: a temporary one)")
  parser.add_argument("--check", action="store_true",
                      help="check the measures on inputs whose answers are known by hand, exit")
  parser.add_argument("--seed", type=int, default=0, help="--check's random inputs")
  return parser


def rows_of(args):
  """(rows, vocab) of the parsed command line; prints where they come from."""
  if args.cache:
    rows, vocab, source = cache_compact.read_rows(args.cache, args.rows, args.allow_partial)
  else:
    rows, vocab = cache_compact.synthetic(args.rows, args.seq_len, 100, args.synthetic_vocab)
    source = f"synthetic teacher (cache_compact.synthetic), V={vocab}"
  shape = rows["topk_ids"].shape
  print(f"teacher: {source}; {shape[0]} rows x {shape[1]} positions, k={shape[2]}")
  return rows, vocab


def main():
  parser = parser_of_rows(__doc__)
  parser.add_argument("--loss-positions", type=int, default=4096,
                      help="errors on the first rows holding this many positions")
  args = parser.parse_args()
  if args.check:
    return check(args.seed)

  rows, vocab = rows_of(args)
  ids, lp = rows["topk_ids"].astype(np.int64), rows["topk_logprobs"]
  out = args.out or tempfile.mkdtemp(prefix="cache_floor_")
  region_rows = max(1, min(ids.shape[0], 2**18 // ids.shape[1]))

  size = store_sizer(out, region_rows)
  wide = np.uint16 if vocab <= 2**16 else np.uint32
  quantised = quantiser_table(ids, lp, rows["loss_mask"], vocab, size, args.loss_positions)
  n, _, last = levels(lp, *QUANTISER, diffuse=False)
  id_table(ids, rows["tokens"].astype(np.int64), n, last, vocab, size, wide)
  floors(ids, quantised)
  decode_speed(ids, n, last)
  if not args.out:
    shutil.rmtree(out)


if __name__ == "__main__":
  main()
