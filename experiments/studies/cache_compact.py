"""Bytes per position and loss/gradient accuracy of top-k encodings, on a float32 teacher cache.

    python -m experiments.studies.cache_compact --cache runs/demo/cache/train.zarr --rows 256
    python -m experiments.studies.cache_compact --synthetic-vocab 201088 --rows 16 --seq-len 512 \
        --loss-positions 1024

Reads `--rows` rows of a float32 cache (real teacher outputs, e.g. the demo's, or SmolLM2's from
experiments/studies/cache_real_teacher.py), or without --cache makes rows of a synthetic teacher
(`synthetic`: Zipf ids drifting between consecutive positions, realistic log-prob profiles),
re-encodes the top-k arrays in each candidate encoding (the compact and packed layouts among
them), writes them as sharded zarr v3 arrays exactly as a store does (one shard per region, zstd
through blosc, crc32c) and reports, per encoding:
  - bytes per position on disk of topk_ids + topk_logprobs,
  - relative error of the loss and of its gradients (student hidden states and lm_head) against
    the float32 rows, for each objective of kdjax.loss.topk_kl_loss, for two students: a
    random one (hidden ~ N(0, 1), lm_head ~ N(0, 1/D)) and one whose logits are the teacher's
    plus noise (see `student`), on the first rows holding --loss-positions positions (the same
    rows for every encoding).
Errors are |L - L32| / |L32| and ||g - g32|| / ||g32|| (Frobenius). Then every kdjax layout as a
store writes it (the dictionary layout's per-row id order included), and the compact store
recoded to the dictionary layout (`python -m kdjax.cache recode`): bytes per position of all
arrays, and the errors of what the store reads back on several blocks of rows.
`--join N` makes rows of N cache rows (a dictionary's order is per row, so row length matters).
Prints markdown tables; writes nothing outside --out.
"""
import argparse
import functools
import os
import shutil
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts

from kdjax import cache
from kdjax.cache import layout, recode
from kdjax.loss import topk_kl

OBJECTIVES = ("sparse", "tail", "renorm")
STORE_BLOCKS = 8


def candidates(vocab_size):
  """name -> (ids dtype, log-prob dtype, log-prob scale or None, blosc shuffle(s) of ids, log-probs,
  packed offset p0 (0: compact's gaps)).

  Unless named, ids are bit-shuffled and log-probs byte-shuffled, as in the compact layout.
  """
  ids = "uint16" if vocab_size <= 2**16 else "int32"
  wide = "uint16" if vocab_size <= 2**16 else "uint32"
  both = ("bitshuffle", "shuffle")
  out = {"float32 (reference)": ("int32", "float32", None, "shuffle", 0),
         "float16 log-probs": (ids, "float16", None, both, 0),
         "uint16 gaps 2^-10, byte shuffle for ids too": (ids, "uint16", 2.0**-10, "shuffle", 0)}
  for bits in (8, 10, 11, 12):
    name = f"uint16 gaps 2^-{bits}" + (" (compact)" if bits == 11 else "")
    out[name] = (ids, "uint16", 2.0**-bits, both, 0)
  for bits in (11, 12):
    for offset in (5, 7, 9):
      out[f"packed levels 2^-{bits}, p0 2^-{offset}"] = (wide, "uint16", 2.0**-bits, both,
                                                          2.0**-offset)
  out["packed levels 2^-12, p0 2^-9, byte shuffle for ids (packed)"] = (
      wide, "uint16", layout.PACKED_SCALE, "shuffle", layout.PACKED_OFFSET)
  return out


def encode(ids, logprobs, ids_dtype, lp_dtype, scale, offset=0.0):
  if scale is not None:
    return layout.encode_topk(ids, logprobs, {"topk_ids": ids_dtype, "topk_logprobs": lp_dtype},
                              scale, offset)
  return ids.astype(ids_dtype), logprobs.astype(lp_dtype)


def decode(ids, stored, lp_dtype, scale, offset=0.0):
  if scale is not None:
    return layout.decode_topk(ids, stored, {"topk_logprobs": lp_dtype}, scale, offset=offset)
  return ids.astype(np.int32), stored.astype(np.float32)


def disk_bytes(path, arr, region_rows, shuffle):
  spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": path},
          "metadata": layout.zarr_metadata(arr.shape, arr.dtype.name, region_rows, shuffle=shuffle)}
  ts.open(spec, create=True, delete_existing=True).result().write(arr).result()
  return sum(os.path.getsize(os.path.join(root, name))
             for root, _, names in os.walk(path) for name in names if name != "zarr.json")


@functools.partial(jax.jit, static_argnames="objective")  # compiled once per objective
def loss_and_grads(hidden, lm_head, ids, logprobs, mask, objective):
  fn = lambda h, w: topk_kl.topk_kl_loss(h, w, ids, logprobs, mask, objective=objective,
                                         impl="xla")
  return jax.value_and_grad(fn, argnums=(0, 1))(hidden, lm_head)


def errors_against(reference, hidden, lm_head, ids, logprobs, mask):
  """[loss, grad hidden, grad lm_head] relative errors of these top-k rows against `reference`
  ({objective: loss_and_grads of the float32 rows}), each the max over OBJECTIVES."""
  errors = np.zeros(3)
  for obj in OBJECTIVES:
    loss, (g_hidden, g_head) = loss_and_grads(hidden, lm_head, jnp.asarray(ids),
                                              jnp.asarray(logprobs), mask, obj)
    loss32, (g_hidden32, g_head32) = reference[obj]
    errors = np.maximum(errors, [abs(float(loss) - float(loss32)) / abs(float(loss32)),
                                 rel(g_hidden, g_hidden32), rel(g_head, g_head32)])
  return errors


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def student(kind, ids, logprobs, vocab, dim, noise=0.5, seed=0):
  """(hidden, lm_head, description) of a student at the start or near the end of distillation."""
  rng = np.random.default_rng(seed)
  if kind == "random":
    hidden = rng.normal(size=ids.shape[:-1] + (dim,))
    lm_head = rng.normal(size=(dim, vocab)) / np.sqrt(dim)
    return (jnp.asarray(hidden, jnp.float32), jnp.asarray(lm_head, jnp.float32),
            f"random init, D={dim} (start of training)")
  # "near": logits = the teacher's log-probs on its top-k, its mean tail log-prob elsewhere, plus
  # N(0, noise) -- a student close to the teacher, whose gradients are small, so encoding errors
  # weigh relatively more. D = V and lm_head = I, so the hidden states are the logits.
  tail = np.log(np.maximum(1 - np.exp(logprobs).sum(-1, keepdims=True), 1e-6) / (vocab - ids.shape[-1]))
  logits = np.broadcast_to(tail, ids.shape[:-1] + (vocab,)).copy()
  np.put_along_axis(logits, ids, logprobs, axis=-1)
  logits += rng.normal(0, noise, logits.shape)
  return (jnp.asarray(logits, jnp.float32), jnp.eye(vocab, dtype=jnp.float32),
          f"near the teacher: its log-probs + N(0, {noise}) noise as logits (late in training)")


def synthetic(rows, seq_len, k, vocab, *, zipf=1.05, overlap=0.4, seed=0):
  """Rows of a synthetic teacher (ids, log-probs, mask, tokens...), and the vocabulary.

  Assumed, for want of a large real teacher: ids drawn from a Zipf(`zipf`) law over the
  vocabulary (id = frequency rank, as BPE merges roughly are); consecutive positions share top-k
  ids by a Markov drift: each entry is, with probability `overlap`, the id the previous position
  held near the same rank (rank + N(0, 8)), else a fresh draw (duplicates redrawn). Log-probs:
  ranks r = 1..400 with logits -a log r + N(0, 0.5), a ~ U(1.2, 2.8) per position (a confident
  or a flat teacher), the other V - 400 tokens sharing the tail at 2 nats below rank 400;
  normalised over all V, the top k kept. This gives a mean top-1 probability ~0.52, log p at
  rank 100 ~ -10, top-100 mass ~0.89 and ~42 of 100 ids shared with the previous position.
  """
  rng = np.random.default_rng(seed)
  cdf = np.cumsum(np.arange(1, vocab + 1, dtype=np.float64) ** -zipf)
  draw = lambda shape: np.minimum(np.searchsorted(cdf, rng.random(shape) * cdf[-1]), vocab - 1)
  ids = np.zeros((rows, seq_len, k), np.int32)
  previous = draw((rows, k))
  for t in range(seq_len):  # the drift is sequential in t; vectorised over rows and ranks
    near = np.clip(np.arange(k) + np.rint(rng.normal(0, 8, (rows, k))).astype(int), 0, k - 1)
    keep = rng.random((rows, k)) < overlap
    candidates = np.concatenate([np.where(keep, np.take_along_axis(previous, near, 1),
                                          draw((rows, k))), draw((rows, 2 * k))], 1)
    order = np.argsort(candidates, 1, kind="stable")
    repeats = np.diff(np.take_along_axis(candidates, order, 1), axis=1, prepend=-1) == 0
    first = np.empty_like(repeats)
    np.put_along_axis(first, order, ~repeats, 1)
    chosen = np.argsort(np.where(first, np.arange(3 * k), 3 * k), 1, kind="stable")[:, :k]
    previous = ids[:, t] = np.take_along_axis(candidates, chosen, 1)
  ranks = 400
  slope = rng.uniform(1.2, 2.8, (rows, seq_len, 1))
  logits = -slope * np.log(np.arange(1, ranks + 1)) + rng.normal(0, 0.5, (rows, seq_len, ranks))
  logits = -np.sort(-logits, -1)
  tail = logits[..., -1:] - 2 + np.log(vocab - ranks)
  logprobs = logits - np.logaddexp(np.log(np.exp(logits).sum(-1, keepdims=True)), tail)
  segment_ids = np.ones((rows, seq_len), np.int32)
  return {"topk_ids": ids, "topk_logprobs": logprobs[..., :k].astype(np.float32),
          "loss_mask": segment_ids > 0, "segment_ids": segment_ids,
          "tokens": ids[..., 0].copy(),
          "positions": np.tile(np.arange(seq_len, dtype=np.int32), (rows, 1))}, vocab


def read_rows(path, num_rows, allow_partial=False):
  """(rows, vocab, description) of the first num_rows rows of a cache (of its finished regions,
  with allow_partial)."""
  store = cache.open(path, allow_partial=allow_partial)
  done = np.arange(store.num_seqs)
  if allow_partial:
    done = np.array([row for r in sorted(store.complete_regions())
                     for row in range(*store.region_bounds(r))], np.int64)
  return (store.read(done[:num_rows]), store.vocab_size,
          f"{path} ({store.attrs.get('teacher', '?')})")


def id_codings(ids, vocab, out, region_rows):
  """Bytes per position of other codings of the ids (not layouts: ideas measured), and bounds."""
  rows, seq_len, k = ids.shape
  wide = "uint16" if vocab <= 2**16 else "uint32"
  size = lambda arr, shuffle: disk_bytes(os.path.join(out, "x"), arr, region_rows,
                                         shuffle) / (rows * seq_len)
  flat = ids.reshape(rows, -1).astype(np.int64)
  counts = np.bincount((np.arange(rows)[:, None] * vocab + flat).ravel(),
                       minlength=rows * vocab).reshape(rows, vocab)
  by_count = np.argsort(-counts, axis=1, kind="stable")  # a row's ids, most frequent first
  rank = np.empty_like(by_count)
  np.put_along_axis(rank, by_count, np.arange(vocab)[None].repeat(rows, 0), 1)
  index = np.take_along_axis(rank, flat, 1).reshape(ids.shape)
  kinds = (counts > 0).sum(1).max()
  dictionary = size(by_count[:, :kinds].astype(wide), "shuffle")
  gaps = lambda x: np.diff(np.sort(x, -1), axis=-1, prepend=0).astype(wide)
  share = np.bincount(flat.ravel(), minlength=vocab) / flat.size
  entropy = -np.sum(share[share > 0] * np.log2(share[share > 0])) * k / 8
  previous = np.sort(ids[:, :-1], -1)
  pos = np.arange(rows)[:, None, None] * seq_len + np.arange(seq_len - 1)[None, :, None]
  keys_prev = np.sort((pos * vocab + previous).ravel())
  keys = (pos * vocab + ids[:, 1:]).ravel()
  shared = keys_prev[np.minimum(np.searchsorted(keys_prev, keys), keys_prev.size - 1)] == keys
  print(f"\nids ({rows} x {seq_len} positions), bytes/position; "
        f"{shared.mean():.0%} of a position's ids are in the previous position's top-{k}\n")
  print("| coding of the ids | B/pos |\n|---|---|")
  for name, value in (
      ("by rank, bit shuffle", size(ids.astype(wide), "bitshuffle")),
      ("by rank, byte shuffle (packed)", size(ids.astype(wide), "shuffle")),
      ("by rank, order-0 entropy of the ids (ideal coder, no context)", entropy),
      ("by rank as indices into the row's ids by frequency, + that dictionary",
       size(index.astype(wide), "shuffle") + dictionary),
      ("the set alone (ascending gaps; the rank order lost)", size(gaps(ids), "shuffle")),
      ("the set alone as ascending frequency indices, + dictionary",
       size(gaps(index), "shuffle") + dictionary)):
    print(f"| {name} | {value:.1f} |")


def add_teacher_arguments(parser):
  """The teacher's rows: a float32 cache (--cache, --rows, --join, --allow-partial) or the
  synthetic teacher (--synthetic-vocab, --rows, --seq-len, --overlap); see teacher_rows."""
  parser.add_argument("--cache", default="", help="float32 teacher cache; empty: synthetic teacher")
  parser.add_argument("--rows", type=int, default=256, help="rows of the cache to use")
  parser.add_argument("--allow-partial", action="store_true",
                      help="read the finished regions of a cache still being written")
  parser.add_argument("--join", type=int, default=1,
                      help="join this many rows of --cache into one (longer rows, as a long "
                           "context run stores them)")
  parser.add_argument("--synthetic-vocab", type=int, default=32000,
                      help="synthetic teacher's vocabulary (without --cache)")
  parser.add_argument("--seq-len", type=int, default=128, help="synthetic rows' positions")
  parser.add_argument("--overlap", type=float, default=0.4,
                      help="synthetic: chance an entry keeps the previous position's id")


def teacher_rows(args):
  """(rows, vocab, description) of add_teacher_arguments' teacher."""
  if not args.cache:
    rows, vocab = synthetic(args.rows, args.seq_len, 100, args.synthetic_vocab,
                            overlap=args.overlap)
    return rows, vocab, (f"synthetic teacher (Zipf ids with a Markov drift, overlap "
                         f"{args.overlap}), V={vocab}")
  rows, vocab, source = read_rows(args.cache, args.rows, args.allow_partial)
  if args.join > 1:  # rows of join x T positions: a row's dictionary order sees them all
    n = len(rows["tokens"]) // args.join * args.join
    rows = {name: arr[:n].reshape((n // args.join, -1) + arr.shape[2:])
            for name, arr in rows.items()}
    source += f", rows joined {args.join} at a time"
  return rows, vocab, source


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  add_teacher_arguments(parser)
  parser.add_argument("--dim", type=int, default=64, help="random student's width D")
  parser.add_argument("--students", default="random,near",
                      help="comma-separated: random (start of training), near (late; D = V); "
                           "empty: bytes only")
  parser.add_argument("--out", default="", help="scratch directory (default: a temporary one)")
  parser.add_argument("--stores-only", action="store_true",
                      help="only the kdjax stores' table (no candidate encodings, no id codings)")
  parser.add_argument("--loss-positions", type=int, default=4096,
                      help="errors on the first rows holding this many positions (the near "
                           "student is [positions, V] float32)")
  args = parser.parse_args()

  rows, vocab, source = teacher_rows(args)
  ids, logprobs = rows["topk_ids"], rows["topk_logprobs"]
  num_rows, seq_len, k = ids.shape
  positions = num_rows * seq_len
  region_rows = max(1, min(num_rows, 2**18 // seq_len))

  out = args.out or tempfile.mkdtemp(prefix="cache_compact_")
  print(f"teacher: {source}; {num_rows} rows x {seq_len} positions, k={k}, vocab {vocab}")
  encoded = {}
  for name, (ids_dtype, lp_dtype, scale, shuffle, offset) in (
      {} if args.stores_only else candidates(vocab)).items():
    stored_ids, stored_lp = encode(ids, logprobs, ids_dtype, lp_dtype, scale, offset)
    ids_shuffle, lp_shuffle = shuffle if isinstance(shuffle, tuple) else (shuffle, shuffle)
    ids_bytes = disk_bytes(os.path.join(out, "ids"), stored_ids, region_rows, ids_shuffle)
    lp_bytes = disk_bytes(os.path.join(out, "lp"), stored_lp, region_rows, lp_shuffle)
    encoded[name] = (ids_bytes / positions, lp_bytes / positions,
                     decode(stored_ids, stored_lp, lp_dtype, scale, offset))

  # Errors on the first rows (every encoding on the same ones).
  few = max(1, min(num_rows, args.loss_positions // seq_len))
  ids, logprobs, mask = ids[:few], logprobs[:few], jnp.asarray(rows["loss_mask"][:few])
  print(f"errors on the first {few} rows ({few * seq_len} positions)")
  for kind in filter(None, args.students.split(",")):
    hidden, lm_head, about = student(kind, ids, logprobs, vocab, args.dim)
    reference = {obj: loss_and_grads(hidden, lm_head, jnp.asarray(ids), jnp.asarray(logprobs),
                                      mask, obj) for obj in OBJECTIVES}
    print(f"\nstudent: {about}; errors are the max over objectives {OBJECTIVES}\n")
    print("| encoding | ids B/pos | log-probs B/pos | top-k B/pos | rel. err loss | "
          "rel. err grad hidden | rel. err grad lm_head |")
    print("|---|---|---|---|---|---|---|")
    for name, (ids_bpp, lp_bpp, (dec_ids, dec_lp)) in encoded.items():
      errors = errors_against(reference, hidden, lm_head, dec_ids[:few], dec_lp[:few], mask)
      print(f"| {name} | {ids_bpp:.1f} | {lp_bpp:.1f} | {ids_bpp + lp_bpp:.1f} | {errors[0]:.1e} | "
            f"{errors[1]:.1e} | {errors[2]:.1e} |", flush=True)

  if not args.students:
    print("\n| encoding | ids B/pos | log-probs B/pos | top-k B/pos |\n|---|---|---|---|")
    for name, (ids_bpp, lp_bpp, _) in encoded.items():
      print(f"| {name} | {ids_bpp:.1f} | {lp_bpp:.1f} | {ids_bpp + lp_bpp:.1f} |")
  if not args.stores_only:
    id_codings(rows["topk_ids"], vocab, out, region_rows)

  # The stores themselves (all arrays, manifest included), as kdjax writes them, and the errors
  # of what they read back: on the rows of the tables above (block 0, the random student of seed
  # 0), and the RMS over up to STORE_BLOCKS disjoint blocks of as many rows (block b: student
  # seed b). A loss error of ~1e-6 is rounding errors summed over the block's positions, and
  # which of two layouts has the smaller one changes from block to block.
  if "tokens" in rows:
    blocks = [slice(b * few, (b + 1) * few) for b in range(min(STORE_BLOCKS, num_rows // few))]
    full = {name: rows[name] for name in ("topk_ids", "topk_logprobs", "loss_mask")}
    students, references = [], []
    for b, block in enumerate(blocks):
      block_ids, block_lp = full["topk_ids"][block], full["topk_logprobs"][block]
      hidden, lm_head, _ = student("random", block_ids, block_lp, vocab, args.dim, seed=b)
      students.append((hidden, lm_head))
      references.append({obj: loss_and_grads(hidden, lm_head, jnp.asarray(block_ids),
                                             jnp.asarray(block_lp),
                                             jnp.asarray(full["loss_mask"][block]), obj)
                         for obj in OBJECTIVES})
    print(f"\n| kdjax store | B/pos on disk (all arrays, metadata) | top-k arrays B/pos | "
          f"rel. err loss, block 0 | RMS over {len(blocks)} blocks | grad hidden, block 0 | "
          f"grad lm_head, block 0 | RMS over blocks |\n|---|---|---|---|---|---|---|---|")
    # Each layout written from the float32 rows, then the compact store recoded to the
    # dictionary layout (`python -m kdjax.cache recode`: its log-probs rounded twice).
    for layout_name in (*layout.LAYOUTS, "dictionary, recoded from compact"):
      path = os.path.join(out, f"store_{layout_name.split(',')[0]}"
                          f"{'' if layout_name in layout.LAYOUTS else '_recoded'}")
      shutil.rmtree(path, ignore_errors=True)
      if layout_name in layout.LAYOUTS:
        store = cache.create(path, num_seqs=num_rows, seq_len=seq_len, k=k, vocab_size=vocab,
                             attrs={}, layout=layout_name, region_rows=region_rows)
        store.write(0, {name: rows[name] for name in store.dtypes if name in rows})
      else:
        store = recode.recode(os.path.join(out, "store_compact"), path, "dictionary")
      sizes = {name: sum(os.path.getsize(os.path.join(root, f)) for root, _, names
                         in os.walk(os.path.join(path, name)) for f in names)
               for name in os.listdir(path)}
      topk = sum(sizes.get(name, 0) for name in (*layout.TOPK_ARRAYS, layout.ORDER_ARRAY))
      errors = np.zeros((len(blocks), 3))
      for block, (hidden, lm_head), reference, errs in zip(blocks, students, references, errors):
        back = store.read(block)
        assert np.array_equal(back["topk_ids"], full["topk_ids"][block]), layout_name
        errs[:] = errors_against(reference, hidden, lm_head, back["topk_ids"],
                                 back["topk_logprobs"], jnp.asarray(back["loss_mask"]))
      rms = np.sqrt(np.mean(errors ** 2, axis=0))
      print(f"| {layout_name} | {sum(sizes.values()) / positions:.1f} | "
            f"{topk / positions:.1f} | {errors[0, 0]:.1e} | {rms[0]:.1e} | {errors[0, 1]:.1e} | "
            f"{errors[0, 2]:.1e} | {rms[2]:.1e} |", flush=True)
  if not args.out:
    shutil.rmtree(out)


if __name__ == "__main__":
  main()
