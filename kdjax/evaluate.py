"""Held-out evaluation against a teacher cache: KL to the teacher's top-k, top-1 agreement, CE.

Per valid position, with p = exp(cached log-probs) over the teacher's top-k and the student's
log q over the FULL vocabulary:
  kl              sum_topk p (log p - log q)     (the paper's sparse objective, >= M log M)
  top1_agreement  student argmax == teacher's top-1 id
  ce              -log q(true next token)
All are means over valid positions. They are the per-position terms of the training loss itself
(objective "sparse" at temperature 1, impl "xla": exact float32 logits, no gradients computed), so
evaluation and training measure the same quantities one way. Logits never exist beyond one chunk
of positions.
"""
import functools
import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from kdjax import plots
from kdjax.data.packing import next_token_labels, pad_rows
from kdjax.loss import full_kl, topk_kl
from kdjax.models import documents


@functools.partial(jax.jit, static_argnames=("graphdef", "chunk_size", "max_documents"))
def _batch_sums(params, batch, *, graphdef, chunk_size, max_documents):
  model = nnx.merge(graphdef, params)
  hidden_BxTxD = model(batch["tokens"], batch["positions"], batch["segment_ids"], max_documents)
  lm_head_DxV = model.lm_head_DxV().astype(hidden_BxTxD.dtype)  # as in training
  mask_BxT = batch["loss_mask"]
  _, aux = topk_kl.topk_kl_loss(
      hidden_BxTxD, lm_head_DxV, batch["topk_ids"], batch["topk_logprobs"], mask_BxT,
      objective="sparse", labels=batch["labels"], impl="xla", chunk_size=chunk_size,
      return_aux=True, per_position=True)
  terms = aux["positions"]
  total = lambda x: jnp.sum(jnp.where(mask_BxT, x, 0.0))
  return {"kl": total(terms["kl"]), "top1_agreement": total(terms["top1"].astype(jnp.float32)),
          "ce": total(terms["ce"]), "positions": jnp.sum(mask_BxT.astype(jnp.float32))}


def _read_batch(store, start: int, n: int, batch_size: int, names) -> dict:
  """Rows start.. of the first n as a batch of min(batch_size, n) rows (the last one padded with
  rows outside the loss: one compiled program for every batch) and their next-token labels."""
  rows = store.read(np.arange(start, min(start + batch_size, n)))
  batch = {k: pad_rows(rows[k], min(batch_size, n)) for k in names}
  batch["labels"] = next_token_labels(batch["tokens"])
  return batch


def committed(params):
  """The arrays of params committed where they already are (no copy). A restored checkpoint's are
  committed and a freshly built model's are not, and jit compiles its program once for each:
  committing both makes the student before and after training share one program."""
  return jax.tree.map(lambda x: jax.device_put(x, x.sharding), params)


def evaluate(model: nnx.Module, store, *, batch_size: int, max_seqs: int, chunk_size: int,
             desc: str = "eval") -> dict:
  """Means over the valid positions of the first `max_seqs` rows (0 = all) of a cache."""
  graphdef, params = nnx.split(model)
  params = committed(params)
  n = store.num_seqs if max_seqs == 0 else min(max_seqs, store.num_seqs)
  bound = documents.store_documents_bound(store, [(0, n)])  # one program for every batch
  sums = {}
  for start in tqdm(range(0, n, batch_size), desc=desc, unit="batch", leave=False):
    batch = _read_batch(store, start, n, batch_size, ("tokens", "positions", "segment_ids",
                                                      "loss_mask", "topk_ids", "topk_logprobs"))
    out = _batch_sums(params, batch, graphdef=graphdef, chunk_size=chunk_size,
                      max_documents=bound)
    for k, v in out.items():
      sums[k] = sums.get(k, 0.0) + float(v)
  count = max(sums["positions"], 1.0)
  return {"kl": sums["kl"] / count, "top1_agreement": sums["top1_agreement"] / count,
          "ce": sums["ce"] / count, "positions": int(sums["positions"])}


@functools.partial(jax.jit, static_argnames=("graphdef", "teacher_graphdef", "chunk_size",
                                             "max_documents"))
def _online_sums(params, teacher_params, batch, *, graphdef, teacher_graphdef, chunk_size,
                 max_documents, split_k):
  inputs = (batch["tokens"], batch["positions"], batch["segment_ids"], max_documents)
  student, teacher = nnx.merge(graphdef, params), nnx.merge(teacher_graphdef, teacher_params)
  hidden_BxTxD, teacher_hidden_BxTxD = student(*inputs), teacher(*inputs)
  mask_BxT = batch["loss_mask"]
  _, terms = full_kl.full_kl_loss(
      hidden_BxTxD, student.lm_head_DxV().astype(hidden_BxTxD.dtype), teacher_hidden_BxTxD,
      teacher.lm_head_DxV().astype(teacher_hidden_BxTxD.dtype), mask_BxT,
      labels=batch["labels"], chunk_size=chunk_size, per_position=True, teacher_label=True)
  total = lambda x: jnp.sum(jnp.where(mask_BxT, x.astype(jnp.float32), 0.0))
  outside_BxT = terms["teacher_rank"] >= split_k  # the true token is not in the teacher's top k
  return ({"full_kl": total(terms["kl"]), "top1_agreement": total(terms["top1"]),
           "ce": total(terms["ce"]), "accuracy": total(terms["correct"]),
           "positions": total(jnp.ones_like(terms["kl"])),
           "teacher_ce": total(terms["teacher_ce"]), "outside": total(outside_BxT),
           "ce_outside": total(jnp.where(outside_BxT, terms["ce"], 0.0)),
           "teacher_ce_outside": total(jnp.where(outside_BxT, terms["teacher_ce"], 0.0))},
          full_kl.calibration_sums(terms["confidence"], terms["correct"], mask_BxT))


def evaluate_online(model: nnx.Module, teacher: nnx.Module, store, *, batch_size: int,
                    max_seqs: int, chunk_size: int | None = None, desc: str = "eval",
                    split_k: int = 100) -> dict:
  """Against the teacher run here, over the valid positions of the first `max_seqs` rows (0 =
  all) of a store (tokenised data or a cache): the full-vocabulary KL(teacher || student), top-1
  agreement, the student's CE on the true tokens, its next-token accuracy on them and its
  expected calibration error (ECE); the teacher's CE on the same tokens; and the CE split by
  whether the true token is among the teacher's `split_k` most likely (what a top-k cache
  teaches): `outside_top_k` the share of positions where it is not, `ce_outside_top_k` /
  `ce_inside_top_k` the student's CE there and here, `teacher_ce_outside_top_k` the teacher's."""
  graphdef, params = nnx.split(model)
  teacher_graphdef, teacher_params = nnx.split(teacher)
  params, teacher_params = committed(params), committed(teacher_params)
  n = store.num_seqs if max_seqs == 0 else min(max_seqs, store.num_seqs)
  bound = documents.store_documents_bound(store, [(0, n)])  # one program for every batch
  sums, bins = {}, 0.0
  for start in tqdm(range(0, n, batch_size), desc=desc, unit="batch", leave=False):
    batch = _read_batch(store, start, n, batch_size,
                        ("tokens", "positions", "segment_ids", "loss_mask"))
    out, batch_bins = _online_sums(
        params, teacher_params, batch, graphdef=graphdef, teacher_graphdef=teacher_graphdef,
        chunk_size=chunk_size, max_documents=bound, split_k=split_k)
    for k, v in out.items():
      sums[k] = sums.get(k, 0.0) + float(v)
    bins = bins + np.asarray(batch_bins, np.float64)
  count = max(sums["positions"], 1.0)
  outside, inside = max(sums["outside"], 1.0), max(sums["positions"] - sums["outside"], 1.0)
  return {"full_kl": sums["full_kl"] / count, "top1_agreement": sums["top1_agreement"] / count,
          "ce": sums["ce"] / count, "accuracy": sums["accuracy"] / count,
          "ece": full_kl.expected_calibration_error(bins),
          "positions": int(sums["positions"]), "teacher_ce": sums["teacher_ce"] / count,
          "split_k": split_k, "outside_top_k": sums["outside"] / count,
          "ce_outside_top_k": sums["ce_outside"] / outside,
          "ce_inside_top_k": (sums["ce"] - sums["ce_outside"]) / inside,
          "teacher_ce_outside_top_k": sums["teacher_ce_outside"] / outside}


def write_report(results: dict, eval_file: str, curves_file: str, metrics_files: dict):
  """eval.json, the training curves of the students evaluated (metrics_files: run name ->
  metrics.jsonl) and the report's lines in the log."""
  with open(eval_file, "w") as f:
    json.dump(results, f, indent=2)
  runs = {name: path for name, path in metrics_files.items() if name in results}
  plots.training_curves(
      [("train CE on the true next tokens (nats)", "ce", runs),
       ("student's distillation loss (nats)", "kl", {"student": runs.get("student", "")}),
       ("top-1 agreement with the teacher", "top1",
        {"student": runs.get("student", "")})],
      curves_file)
  print_report(results)


def print_report(results: dict):
  # Against a cache the KL is over the teacher's top k (sparse); online, over the vocabulary.
  kl = "full_kl" if any("full_kl" in r for r in results.values()) else "kl"
  head = "full KL" if kl == "full_kl" else "KL to teacher"
  lines = ["", f"{'held-out':<28}{head:>15}{'top-1 agree':>13}{'CE (nats)':>11}"]
  labels = {"teacher": "teacher", "student_init": "student before training",
            "student": "student, distilled", "baseline": "student, hard labels only"}
  for name, r in results.items():
    lines.append(f"{labels[name]:<28}{r[kl]:>15.4f}{r['top1_agreement']:>13.3f}{r['ce']:>11.4f}")
  if "student" in results and results["student"]["positions"] == 0:
    lines.append("the held-out rows hold no target positions (see data.loss_mask): nothing was "
                 "measured; hold out more data (data.eval_every) or raise eval.max_seqs")
  elif "student" in results:
    before, after = results["student_init"][kl], results["student"][kl]
    ratio = f"{before / after:.1f}x " if after > 0 else ""
    lines.append(f"distillation cut the student's KL to the teacher {ratio}"
                 f"({before:.3f} -> {after:.3f})")
  if "baseline" in results and "student" in results:
    d = results["baseline"]["ce"] - results["student"]["ce"]
    lines.append(f"held-out CE: distilled {results['student']['ce']:.4f} vs hard labels "
                 f"{results['baseline']['ce']:.4f} "
                 f"({'distillation better' if d > 0 else 'hard labels better'} by {abs(d):.4f})")
  logging.info("\n".join(lines))
