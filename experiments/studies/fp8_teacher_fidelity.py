"""The teacher pass in FP8 against bf16, on the real SmolLM2-135M teacher and its held-out text.

    python -m kdjax.smollm2 --out runs/smollm2
    python -m experiments.studies.fp8_teacher_fidelity --root runs/smollm2 --out runs/fp8_teacher

With `teacher.fp8_matmuls` (kdjax/models/fp8.py) the teacher's projections run on FP8 tensor
cores, each operand quantised with one power-of-two scale per tensor from its own largest
magnitude (the real weights', the activations' of each call); the lm_head, the log-softmax and
the top-k stay as in the bf16 pass (float32 logits). This writes the held-out text's data store
(DIR/corpus/eval.jsonl, rows of 2048; --max-bytes caps it) and a top-100 cache of it with each
teacher (float32 layout), then compares the two caches per position, over the first --rows rows' targets:

  overlap        |bf16's top-100 ids & FP8's| / 100
  top10_delta    mean |log p_bf16 - log p_fp8| over bf16's 10 most likely ids, where FP8's
                 top 100 holds the id (the share where it does not: top10_missing)
  kl             KL(bf16 || fp8) between the two cached distributions as a `tail` student reads
                 them: the top 100, the rest of the mass spread evenly over the other ids

and each pass's rate (positions/s, the write included). One JSON line to --results.

With --logits, no caches: the teacher's full float32 logits on the first --rows rows under each
variant of LOGIT_VARIANTS (bf16 alone; FP8 in every projection with per-tensor scales, as
kdjax/models/fp8.py quantises; the same with one scale per row of x and per column of w; FP8 in
one group of projections only) against the float32 teacher: full-vocabulary KL, mean |delta
log p| over float32's 10 most likely ids, top-1 agreement. One JSON line per variant. A student
distilled from each cache is the recipe study's 12.6M-token arm (experiments/studies/
recipe_study.py) with cache.path set to each. Needs a GPU with FP8 tensor cores (an H100 or
H200): elsewhere XLA emulates the FP8 products, slowly.
"""
import argparse
import contextlib
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench import e2e_bench
from kdjax import cache, teacher, tokenizer
from kdjax.data import stage
from kdjax.models import fp8, hf

K, TOP = 100, 10
# --logits: (name, compute dtype, FP8 scales per "tensor" or "row" (x's rows, w's columns), the
# projections in FP8 by their einsum spec in kdjax/models/llama.py, None: all).
PROJECTIONS = {"qkv": "btd,dhe->bthe", "o": "bthe,hed->btd", "gate_up": "btd,df->btf",
               "down": "btf,fd->btd"}
LOGIT_VARIANTS = [("bf16", "bfloat16", None, ()), ("fp8", "bfloat16", "tensor", None),
                  ("fp8_rowwise", "bfloat16", "row", None)] + [
    (f"fp8_{name}_only", "bfloat16", "tensor", (spec,)) for name, spec in PROJECTIONS.items()]


def tail_kl(ids_p, logp, ids_q, logq, vocab: int) -> np.ndarray:
  """[N] KL(p || q) of two cached top-k distributions [N, K] (ids, log-probs), each read as its
  top k plus the rest of its mass spread evenly over the vocab - k other ids."""
  n, k = ids_p.shape
  p, q = np.exp(logp.astype(np.float64)), np.exp(logq.astype(np.float64))
  rest_p = np.clip(1.0 - p.sum(-1), 1e-30, None) / (vocab - k)  # [N] each other id's mass
  rest_q = np.clip(1.0 - q.sum(-1), 1e-30, None) / (vocab - k)
  same_NxKxK = ids_p[:, :, None] == ids_q[:, None, :]
  in_q = same_NxKxK.any(-1)  # p's id among q's top k
  q_at_p = np.where(in_q, (same_NxKxK * q[:, None, :]).sum(-1), rest_q[:, None])
  kl = (p * (np.log(p) - np.log(q_at_p))).sum(-1)
  # q's top ids outside p's: p gives them rest_p each.
  q_only = ~same_NxKxK.any(1)
  kl += (q_only * rest_p[:, None] * (np.log(rest_p)[:, None] - np.log(q))).sum(-1)
  # The ids in neither top k: rest_p against rest_q.
  neither = vocab - 2 * k + (~q_only).sum(-1)
  return kl + neither * rest_p * (np.log(rest_p) - np.log(rest_q))


def compare(bf16, fp8_store, rows: int, vocab: int) -> dict:
  """The measures of the module's doc over the loss-mask positions of the first `rows` rows."""
  sums, count = {"overlap": 0.0, "top10_delta": 0.0, "top10_found": 0.0, "kl": 0.0}, 0
  for row in range(rows):
    a, b = bf16.read(np.arange(row, row + 1)), fp8_store.read(np.arange(row, row + 1))
    mask = a["loss_mask"][0]
    ids_a, lp_a = a["topk_ids"][0][mask], a["topk_logprobs"][0][mask].astype(np.float64)
    ids_b, lp_b = b["topk_ids"][0][mask], b["topk_logprobs"][0][mask].astype(np.float64)
    same = ids_a[:, :, None] == ids_b[:, None, :]
    sums["overlap"] += same.any(-1).sum() / ids_a.shape[1]
    top = same[:, :TOP]  # bf16's top ids, sorted most likely first
    found = top.any(-1)
    lp_b_at = (top * lp_b[:, None, :]).sum(-1)
    sums["top10_delta"] += np.abs(lp_a[:, :TOP] - lp_b_at)[found].sum()
    sums["top10_found"] += found.sum()
    sums["kl"] += tail_kl(ids_a, lp_a, ids_b, lp_b, vocab).sum()
    count += int(mask.sum())
  return {"positions": count, "overlap": sums["overlap"] / count,
          "top10_delta": sums["top10_delta"] / max(sums["top10_found"], 1),
          "top10_missing": 1.0 - sums["top10_found"] / (count * TOP), "kl": sums["kl"] / count}


def _rowwise_dot(x_MxK, w_KxN):
  """x @ w through FP8 with one power-of-two scale per row of x and per column of w (fp8.quantize
  along an axis; the scales factor out of the contraction)."""
  (qx, sx), (qw, sw) = fp8.quantize(x_MxK, fp8.E4M3, axis=1), fp8.quantize(w_KxN, fp8.E4M3, axis=0)
  y = jax.lax.dot_general(qx, qw, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
  return (y * sx * sw).astype(x_MxK.dtype)


@contextlib.contextmanager
def fp8_variant(scales: str | None, specs):
  """kdjax/models/fp8.py's matmul limited to the projections `specs` (None: all), with the
  scales asked for; restored on exit."""
  matmul, dot = fp8.matmul, fp8.dot
  fp8.matmul = lambda spec, x, w, use: matmul(spec, x, w, use and (specs is None or spec in specs))
  if scales == "row":
    fp8.dot = _rowwise_dot
  try:
    yield
  finally:
    fp8.matmul, fp8.dot = matmul, dot


def _logprobs(model, data, rows: int, batch_size: int, vocab: int) -> tuple[np.ndarray, ...]:
  """float32 log-probs [N, V] of the loss-mask positions of the first `rows` rows."""
  out = []
  for start in range(0, rows, batch_size):
    batch = data.read(np.arange(start, min(start + batch_size, rows)), hidden=False)
    hidden_BxTxD = model(*(jnp.asarray(batch[k]) for k in ("tokens", "positions", "segment_ids")))
    logits_BxTxV = jnp.einsum("btd,dv->btv", hidden_BxTxD, model.lm_head_DxV(),
                              preferred_element_type=jnp.float32)[..., :vocab]
    out.append(np.asarray(jax.nn.log_softmax(logits_BxTxV, -1))[batch["loss_mask"]])
  return np.concatenate(out)


def logit_study(args, tok, data) -> list[dict]:
  """--logits: each variant of LOGIT_VARIANTS against the float32 teacher."""
  vocab = tokenizer.real_vocab_size(tok)
  rows = data.num_seqs if args.rows == 0 else min(args.rows, data.num_seqs)
  load = lambda dtype, on: hf.load(os.path.join(args.root, "hf"), dtype=dtype,  # noqa: E731
                                   param_dtype="float32", tokenizer_vocab=vocab, fp8_matmuls=on)[0]
  ref = _logprobs(load("float32", False), data, rows, args.batch_size, vocab).astype(np.float64)
  top_NxT = np.argsort(-ref, -1)[:, :TOP]
  lines = []
  for name, dtype, scales, specs in LOGIT_VARIANTS:
    with fp8_variant(scales, specs):
      got = _logprobs(load(dtype, scales is not None), data, rows, args.batch_size, vocab)
    got = got.astype(np.float64)
    lines.append(dict(
        variant=name, positions=len(ref), rows=rows,
        full_kl=float((np.exp(ref) * (ref - got)).sum(-1).mean()),
        top10_delta=float(np.abs(np.take_along_axis(ref - got, top_NxT, -1)).mean()),
        top1_agreement=float((ref.argmax(-1) == got.argmax(-1)).mean())))
    print(json.dumps(lines[-1]), flush=True)
  return lines


def write(args, tok, data, which: str) -> tuple[object, float]:
  model, _ = hf.load(os.path.join(args.root, "hf"), dtype="bfloat16", param_dtype="float32",
                     tokenizer_vocab=tokenizer.real_vocab_size(tok),
                     fp8_matmuls=which == "fp8")
  start = time.perf_counter()
  store = teacher.write_cache(model, data, os.path.join(args.out, f"cache_{which}"), k=K,
                              batch_size=args.batch_size, chunk_size=args.chunk_size,
                              vocab_size=tokenizer.real_vocab_size(tok),
                              attrs={"teacher_hash": f"smollm2-{which}", "teacher": which},
                              layout="float32")
  return store, store.num_seqs * store.seq_len / (time.perf_counter() - start)


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--root", default="runs/smollm2", help="python -m kdjax.smollm2's --out")
  parser.add_argument("--out", default="runs/fp8_teacher")
  parser.add_argument("--rows", type=int, default=512, help="held-out rows compared (0: all)")
  parser.add_argument("--max-bytes", type=int, default=0,
                      help="held-out text read, bytes (0: all; a CPU trial: 20000)")
  parser.add_argument("--seq-len", type=int, default=2048)
  parser.add_argument("--batch-size", type=int, default=32)
  parser.add_argument("--chunk-size", type=int, default=512)
  parser.add_argument("--logits", action="store_true",
                      help="compare full logits against float32 by variant (no caches)")
  parser.add_argument("--results", default=os.path.join(
      os.path.dirname(__file__), "..", "results", "fp8_teacher.jsonl"))
  args = parser.parse_args()
  fp8.prepare_compiler(True)
  tok = tokenizer.load(os.path.join(args.root, "hf"))
  held_out = os.path.join(args.root, "corpus", "eval.jsonl")
  # Every held-out document (up to --max-bytes) in the first store; the second is the data
  # stage's own eval split, unused.
  paths = [os.path.join(args.out, name) for name in ("data", "data_unused")]
  stage.build_stores(held_out, tok, args.seq_len, *paths, eval_every=1, eval_source=held_out,
                     max_bytes=args.max_bytes)
  data = cache.open(paths[0])
  meta = dict(device=jax.devices()[0].device_kind, commit=e2e_bench.commit(),
              date=e2e_bench.today())
  if args.logits:
    with open(args.results, "a") as f:
      for line in logit_study(args, tok, data):
        f.write(json.dumps(dict(line, study="logits", **meta)) + "\n")
    return
  stores, rates = {}, {}
  for which in ("bf16", "fp8"):
    stores[which], rates[which] = write(args, tok, data, which)
  rows = data.num_seqs if args.rows == 0 else min(args.rows, data.num_seqs)
  line = compare(stores["bf16"], stores["fp8"], rows, tokenizer.real_vocab_size(tok))
  line.update(rows=rows, positions_per_s={w: round(r) for w, r in rates.items()},
              device=jax.devices()[0].device_kind, commit=e2e_bench.commit(),
              date=e2e_bench.today(), command="python -m experiments.studies.fp8_teacher_fidelity")
  print(json.dumps(line), flush=True)
  with open(args.results, "a") as f:
    f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
  main()
