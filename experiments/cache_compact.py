"""Bytes per position and loss/gradient accuracy of top-k encodings, on a float32 teacher cache.

    python experiments/cache_compact.py --cache runs/demo/cache/train.zarr --rows 256

Reads `--rows` rows of a float32 cache (real teacher outputs, e.g. the demo's), re-encodes the
top-k arrays in each candidate encoding, writes them as sharded zarr v3 arrays exactly as a store
does (one shard per region, zstd through blosc, crc32c) and reports, per encoding:
  - bytes per position on disk of topk_ids + topk_logprobs,
  - relative error of the loss and of its gradients (student hidden states and lm_head) against
    the float32 cache, for each objective of kdjax.kernels.topk_kl_loss, for two students: a
    random one (hidden ~ N(0, 1), lm_head ~ N(0, 1/D)) and one whose logits are the teacher's
    plus noise (see `student`).
Errors are |L - L32| / |L32| and ||g - g32|| / ||g32|| (Frobenius). The target is <= 250 bytes per
position at k = 100 with every error <= 1e-3. Without --cache a synthetic Zipf-like teacher is
used (numbers then only show the mechanics). Prints a markdown table; writes nothing outside --out.
"""
import argparse
import os
import shutil
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts

from kdjax import cache, kernels
from kdjax.cache import layout

OBJECTIVES = ("sparse", "tail", "renorm")


def candidates(vocab_size):
  """name -> (ids dtype, log-prob dtype, log-prob scale or None, blosc shuffle(s) of ids, log-probs).

  Unless named, ids are bit-shuffled and log-probs byte-shuffled, as in the compact layout.
  """
  ids = "uint16" if vocab_size <= 2**16 else "int32"
  out = {"float32 (reference)": ("int32", "float32", None, "shuffle"),
         "float16 log-probs": (ids, "float16", None, ("bitshuffle", "shuffle")),
         "uint16 gaps 2^-10, byte shuffle for ids too": (ids, "uint16", 2.0**-10, "shuffle")}
  for bits in (8, 10, 11, 12):
    out[f"uint16 gaps 2^-{bits}"] = (ids, "uint16", 2.0**-bits, ("bitshuffle", "shuffle"))
  return out


def encode(ids, logprobs, ids_dtype, lp_dtype, scale):
  if scale is not None:
    return layout.encode_topk(ids, logprobs, {"topk_ids": ids_dtype, "topk_logprobs": lp_dtype},
                              scale)
  return ids.astype(ids_dtype), logprobs.astype(lp_dtype)


def decode(ids, stored, lp_dtype, scale):
  if scale is not None:
    return layout.decode_topk(ids, stored, {"topk_logprobs": lp_dtype}, scale)
  return ids.astype(np.int32), stored.astype(np.float32)


def disk_bytes(path, arr, region_rows, shuffle):
  spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": path},
          "metadata": layout.zarr_metadata(arr.shape, arr.dtype.name, region_rows, shuffle=shuffle)}
  ts.open(spec, create=True, delete_existing=True).result().write(arr).result()
  return sum(os.path.getsize(os.path.join(root, name))
             for root, _, names in os.walk(path) for name in names if name != "zarr.json")


def loss_and_grads(hidden, lm_head, ids, logprobs, mask, objective):
  fn = lambda h, w: kernels.topk_kl_loss(h, w, ids, logprobs, mask, objective=objective,
                                         impl="xla")
  return jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))(hidden, lm_head)


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


def synthetic(rows, seq_len, k, vocab, seed=0):
  rng = np.random.default_rng(seed)
  bias = -1.1 * np.log(np.arange(1, vocab + 1))  # Zipf-like unigram prior
  logits = rng.normal(0, 2.5, (rows, seq_len, vocab)) + bias
  logprobs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  ids = np.argsort(-logprobs, -1)[..., :k]
  return {"topk_ids": ids.astype(np.int32),
          "topk_logprobs": np.take_along_axis(logprobs, ids, -1).astype(np.float32),
          "loss_mask": np.ones((rows, seq_len), bool)}, vocab


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--cache", default="", help="float32 teacher cache; empty: synthetic teacher")
  parser.add_argument("--rows", type=int, default=256, help="rows of the cache to use")
  parser.add_argument("--dim", type=int, default=64, help="random student's width D")
  parser.add_argument("--students", default="random,near",
                      help="comma-separated: random (start of training), near (late; D = V)")
  parser.add_argument("--out", default="", help="scratch directory (default: a temporary one)")
  args = parser.parse_args()

  if args.cache:
    store = cache.open(args.cache)
    rows = store.read(np.arange(min(args.rows, store.num_seqs)))
    vocab = store.vocab_size
    source = f"{args.cache} ({store.attrs.get('teacher', '?')})"
  else:
    rows, vocab = synthetic(min(args.rows, 64), 128, 100, 32000)
    source = "synthetic Zipf-like teacher, V=32000"
  ids, logprobs = rows["topk_ids"], rows["topk_logprobs"]
  num_rows, seq_len, k = ids.shape
  positions = num_rows * seq_len
  region_rows = max(1, min(num_rows, 2**18 // seq_len))

  out = args.out or tempfile.mkdtemp(prefix="cache_compact_")
  print(f"teacher: {source}; {num_rows} rows x {seq_len} positions, k={k}, vocab {vocab}")
  mask = jnp.asarray(rows["loss_mask"])
  encoded = {}
  for name, (ids_dtype, lp_dtype, scale, shuffle) in candidates(vocab).items():
    stored_ids, stored_lp = encode(ids, logprobs, ids_dtype, lp_dtype, scale)
    ids_shuffle, lp_shuffle = shuffle if isinstance(shuffle, tuple) else (shuffle, shuffle)
    ids_bytes = disk_bytes(os.path.join(out, "ids"), stored_ids, region_rows, ids_shuffle)
    lp_bytes = disk_bytes(os.path.join(out, "lp"), stored_lp, region_rows, lp_shuffle)
    encoded[name] = (ids_bytes / positions, lp_bytes / positions,
                     decode(stored_ids, stored_lp, lp_dtype, scale))

  for kind in args.students.split(","):
    hidden, lm_head, about = student(kind, ids, logprobs, vocab, args.dim)
    reference = {obj: loss_and_grads(hidden, lm_head, jnp.asarray(ids), jnp.asarray(logprobs),
                                      mask, obj) for obj in OBJECTIVES}
    print(f"\nstudent: {about}; errors are the max over objectives {OBJECTIVES}\n")
    print("| encoding | ids B/pos | log-probs B/pos | top-k B/pos | rel. err loss | "
          "rel. err grad hidden | rel. err grad lm_head |")
    print("|---|---|---|---|---|---|---|")
    for name, (ids_bpp, lp_bpp, (dec_ids, dec_lp)) in encoded.items():
      errors = np.zeros(3)
      for obj in OBJECTIVES:
        loss, (g_hidden, g_head) = loss_and_grads(hidden, lm_head, jnp.asarray(dec_ids),
                                                  jnp.asarray(dec_lp), mask, obj)
        loss32, (g_hidden32, g_head32) = reference[obj]
        errors = np.maximum(errors, [abs(float(loss) - float(loss32)) / abs(float(loss32)),
                                     rel(g_hidden, g_hidden32), rel(g_head, g_head32)])
      print(f"| {name} | {ids_bpp:.1f} | {lp_bpp:.1f} | {ids_bpp + lp_bpp:.1f} | {errors[0]:.1e} | "
            f"{errors[1]:.1e} | {errors[2]:.1e} |", flush=True)

  # The stores themselves (all arrays, manifest included), as kdjax writes them.
  if "tokens" in rows:
    print()
    for layout_name in ("float32", "compact"):
      path = os.path.join(out, f"store_{layout_name}")
      shutil.rmtree(path, ignore_errors=True)
      store = cache.create(path, num_seqs=num_rows, seq_len=seq_len, k=k, vocab_size=vocab,
                           attrs={}, layout=layout_name, region_rows=region_rows)
      store.write(0, rows)
      total = sum(os.path.getsize(os.path.join(root, name))
                  for root, _, names in os.walk(path) for name in names)
      print(f"kdjax {layout_name} store of these rows: {total / positions:.1f} bytes/position "
            f"on disk, all arrays and metadata")
  if not args.out:
    shutil.rmtree(out)


if __name__ == "__main__":
  main()
