"""Do kdjax's training steps on the real teacher agree with a plain torch reference?

    .venv/bin/python -m experiments.studies.step_agreement --root runs/smollm2 --steps 8

Needs `python -m kdjax.smollm2 --out ROOT` and the side venv (kdjax.smollm2.side_venv); CPU, 2 cores:
~13 min, ~6 min again (data and caches kept in ROOT/step_agreement_STEPS). On a slice of ROOT's
corpus (configs/smollm2.py:smoke, stages data and cache) the pruned student is trained in float32
by kdjax's Trainer and, in the side venv, by transformers' LlamaForCausalLM from the same weights
(kdjax's HF export) on the same batches, each document run alone, with plain torch losses and
torch.optim.AdamW; for hard labels, "online" (full-vocabulary KL) and "tail" (k = 100, the
cache). Compared: loss, gradient norm, lr per step; held-out CE and parameters after. Checked:
the rows teacher and student see, the cache against transformers' teacher, masked targets, the
document separator, the tied head. One JSON line per check in
experiments/results/step_agreement.jsonl. Shapes: L positions of a document, K top-k, V vocab.
"""
import argparse
import datetime
import json
import os
import subprocess
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(REPO, "experiments", "results", "step_agreement.jsonl")
OBJECTIVES = ("hard", "online", "tail")
MAX_DOC_CHARS = 4000  # the train slice's documents: short, so rows pack several or split them
EVAL_ROWS = 8  # held-out rows both sides score after training
CHECK_ROWS = 8  # train rows whose cached top-k is compared with transformers' teacher
TOLERANCE = 1e-3  # relative, on the loss at every step


def documents(segment_ids_T):
  """[(start, end)] of each run of one nonzero segment id (a document or a piece of one)."""
  edges = np.flatnonzero(np.diff(segment_ids_T)) + 1
  return [(int(s), int(e)) for s, e in zip(np.r_[0, edges], np.r_[edges, len(segment_ids_T)])
          if segment_ids_T[s] != 0]


# ---------------------------------------------------------------- the reference (side venv)
def torch_side(jobs_path: str):
  """transformers and plain torch, nothing from kdjax; writes job["out"]."""
  import torch
  import torch.nn.functional as F
  import transformers
  job = json.load(open(jobs_path))
  data, o = np.load(job["npz"]), job["opt"]
  load = lambda d: transformers.LlamaForCausalLM.from_pretrained(
      d, dtype=torch.float32, attn_implementation="eager").eval()
  teacher = load(job["teacher"])

  def lr_at(count):  # optax.warmup_cosine_decay_schedule, written out
    if count < o["warmup_steps"]:
      return o["lr"] * count / o["warmup_steps"]
    span = o["steps"] - o["warmup_steps"]
    cos = 0.5 * (1 + np.cos(np.pi * min(count - o["warmup_steps"], span) / span))
    return o["lr"] * ((1 - o["min_lr_ratio"]) * cos + o["min_lr_ratio"])

  def logits(model, ids_L):  # one document alone, positions from 0
    return model(input_ids=torch.tensor(ids_L)[None].long(),
                 position_ids=torch.arange(len(ids_L))[None]).logits[0].float()

  def batch_loss(student, b, objective):
    """Mean over every position whose next token is in its document; and their count."""
    total, count = 0.0, 0
    for r in range(len(b["tokens"])):
      for s, e in documents(b["segment_ids"][r]):
        ids_L = b["tokens"][r, s:e]
        logq_LxV = F.log_softmax(logits(student, ids_L)[:-1], -1)
        if objective == "hard":
          terms_L = F.cross_entropy(logq_LxV, torch.tensor(ids_L[1:]).long(), reduction="none")
        elif objective == "online":
          with torch.no_grad():
            logp_LxV = F.log_softmax(logits(teacher, ids_L)[:-1], -1)
          terms_L = (logp_LxV.exp() * (logp_LxV - logq_LxV)).sum(-1)
        else:  # tail: the top-k entries and one bucket for the rest of the vocabulary
          lp_LxK = torch.tensor(b["topk_logprobs"][r, s:e - 1])
          logq_LxK = logq_LxV.gather(1, torch.tensor(b["topk_ids"][r, s:e - 1]).long())
          tail_p_L = (1 - lp_LxK.exp().sum(-1)).clamp(min=0)
          tail_q_L = (1 - logq_LxK.exp().sum(-1)).clamp(min=1e-6)
          terms_L = ((lp_LxK.exp() * (lp_LxK - logq_LxK)).sum(-1)
                     + torch.xlogy(tail_p_L, tail_p_L) - tail_p_L * tail_q_L.log())
        total, count = total + terms_L.sum(), count + len(terms_L)
    return total / count, count

  out = {"versions": [torch.__version__, transformers.__version__]}
  for objective in job["objectives"]:
    student = load(job["init"])
    params = dict(student.named_parameters())  # the tied embedding listed once
    groups = [{"params": [p for p in params.values() if p.ndim >= 2],
               "weight_decay": o["weight_decay"]},
              {"params": [p for p in params.values() if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=0.0, betas=(o["b1"], o["b2"]), eps=1e-8)
    steps = []
    for i in range(o["steps"]):
      b = {k[len(objective) + 1:]: data[k][i] for k in data if k.startswith(objective + "/")}
      opt.zero_grad()
      loss, count = batch_loss(student, b, objective)
      loss.backward()
      norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params.values())))
      for p in params.values():  # clipped by the global norm, as optax clips
        p.grad.mul_(min(1.0, o["grad_clip"] / norm))
      for g in opt.param_groups:
        g["lr"] = lr_at(i)
      opt.step()
      steps.append({"loss": loss.item(), "grad_norm": norm, "lr": lr_at(i), "positions": count})
    with torch.no_grad():
      ce, n = batch_loss(student, {k[5:]: data[k] for k in data if k.startswith("eval/")}, "hard")
      kd = dict(load(job["exports"][objective]).named_parameters())  # kdjax's, trained
      rel = {k: float((p - kd[k]).norm() / kd[k].norm()) for k, p in params.items()}
    out[objective] = {"steps": steps, "eval_ce": float(ce), "eval_positions": n,
                      "param_rel_max": max(rel.values()), "param_worst": max(rel, key=rel.get)}
    out["tied"] = student.lm_head.weight is student.model.embed_tokens.weight
  out["cache"] = cache_alignment(data, lambda ids_L: logits(teacher, ids_L), torch)
  json.dump(out, open(job["out"], "w"))


def cache_alignment(data, teacher_logits, torch) -> dict:
  """The cached top-k at t against transformers' teacher on each document alone: a float32-layout
  cache (exact) and the run's own (dictionary layout: quantised log-probs)."""
  got = {k: [] for k in ("top1", "first", "f32", "f32_ref", "dict", "dict_ref")}
  for r in range(CHECK_ROWS):
    for s, e in documents(data["check/segment_ids"][r]):
      with torch.no_grad():
        logp_LxV = torch.log_softmax(teacher_logits(data["check/tokens"][r, s:e]).double(), -1)
      at = lambda name: logp_LxV.gather(1, torch.tensor(data[name][r, s:e]).long()).numpy()
      got["top1"].append(logp_LxV.argmax(-1).numpy())
      got["first"].append(data["check/topk_ids"][r, s:e, 0])
      got["f32"].append(data["check/topk_logprobs"][r, s:e])
      got["dict"].append(data["check/dict_logprobs"][r, s:e])
      got["f32_ref"].append(at("check/topk_ids"))
      got["dict_ref"].append(at("check/dict_ids"))
  g = {k: np.concatenate(v) for k, v in got.items()}
  big = g["dict_ref"] > np.log(2.0**-9)  # where the packed codec keeps a relative precision
  return {"positions": len(g["top1"]), "top1_agree": float(np.mean(g["top1"] == g["first"])),
          "top1_agree_if_shifted_by_one": float(np.mean(g["top1"][:-1] == g["first"][1:])),
          "f32_logprob_max_abs": float(np.abs(g["f32_ref"] - g["f32"]).max()),
          "dict_prob_max_abs": float(np.abs(np.exp(g["dict_ref"]) - np.exp(g["dict"])).max()),
          "dict_logprob_max_abs_where_p_over_2^-9": float(np.abs(g["dict_ref"] - g["dict"])[
              big].max())}


# ---------------------------------------------------------------------------- kdjax itself
def write_slice(root: str, work: str, chars: int):
  """A small slice of the real corpus: short train documents in order, one held-out document."""
  os.makedirs(f"{work}/slice", exist_ok=True)
  for split, limit, want in (("train", MAX_DOC_CHARS, chars), ("eval", 10_000, 1)):
    docs = []
    for line in open(f"{root}/corpus/{split}.jsonl"):
      docs += [line] if len(json.loads(line)["text"]) <= limit else []
      if sum(map(len, docs)) >= want:
        break
    with open(f"{work}/slice/{split}.jsonl", "w") as f:
      f.writelines(docs)


def make_config(root: str, work: str, steps: int):
  from configs import smollm2
  c = smollm2.get_config("smoke")  # float32 student and teacher, a 2-layer pruned student
  c.workdir, c.stages, c.opt.steps, c.data.max_bytes = work, ("data", "cache"), steps, 0
  c.teacher.hf_path = c.data.tokenizer = os.path.join(root, "hf")
  c.data.source, c.data.eval_source = f"{work}/slice/train.jsonl", f"{work}/slice/eval.jsonl"
  return c


def masked_targets_ignored(loss_fn, trained, graphdef, micro, settings, bound):
  """(|loss change|, max |gradient change|) when every target at a position outside loss_mask
  (labels, top-k, the teacher's hidden states) is replaced by garbage."""
  import jax
  rng, keep, bad = np.random.default_rng(0), np.asarray(micro["loss_mask"]), dict(micro)
  for k in ("labels", "topk_ids", "topk_logprobs", "teacher_hidden"):
    if k in micro:
      x = np.asarray(micro[k])
      junk = (rng.integers(0, 49152, x.shape) if x.dtype.kind == "i" else -20 * rng.random(
          x.shape) if k == "topk_logprobs" else 10 * rng.standard_normal(x.shape))
      bad[k] = np.where(keep.reshape(keep.shape + (1,) * (x.ndim - 2)), x, junk.astype(x.dtype))
  grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True), static_argnums=(1, 3, 4))
  (v0, _), g0 = grad(trained, graphdef, micro, settings, bound)
  (v1, _), g1 = grad(trained, graphdef, bad, settings, bound)
  return float(abs(v1 - v0)), max(jax.tree.leaves(jax.tree.map(
      lambda a, b: float(np.abs(a - b).max()), g0, g1)))


def kdjax_side(c, work: str):
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from kdjax import build, cache, evaluate, pipeline, teacher
  from kdjax.models import hf
  from kdjax.training import train
  from kdjax.workdir import Paths
  pipeline.run(c)  # stages data and cache
  paths = Paths.from_config(c)
  models = build.Models.from_config(c, paths)
  student, cfg = models.start(c.student)  # pruned from the teacher
  hf.export(student, cfg, f"{work}/hf_init", tokenizer_dir=c.teacher.hf_path)
  graphdef, params = nnx.split(student)
  params = jax.tree.map(np.array, params)  # host copies: each Trainer donates its own
  teacher_model = models.teacher_model()
  data = cache.open(paths.data("train"), seq_len=c.data.seq_len)
  stores = {"hard": data, "online": data, "tail": cache.open(
      paths.cache("train"), vocab_size=cfg.output_vocab_size, k=c.cache.k, seq_len=c.data.seq_len)}
  f32 = teacher.write_cache(teacher_model, data, f"{work}/cache_float32/train.zarr", k=c.cache.k,
                            batch_size=c.cache.batch_size, chunk_size=c.cache.chunk_size,
                            vocab_size=cfg.output_vocab_size, attrs={}, layout="float32")
  arrays, out = {}, {"objectives": {o: {} for o in OBJECTIVES}, "rows": data.num_seqs}
  for objective in OBJECTIVES:
    loss_cfg = c.loss.copy_and_resolve_references()
    loss_cfg.objective = "tail" if objective == "hard" else objective  # hard: unread
    trainer = train.Trainer(
        model=nnx.merge(graphdef, jax.tree.map(jnp.array, params)), model_cfg=cfg,
        store=stores[objective], opt=c.opt, loss_cfg=loss_cfg, hard_labels=objective == "hard",
        seed=c.seed,
        targets=teacher.OnlineTargets(teacher_model) if objective == "online" else None)
    steps, batches = [], []
    for i in range(c.opt.steps):
      batch = trainer.next_batch()
      if i == 0:
        micro = trainer.targets({k: v[0] for k, v in batch.items()}, trainer.max_documents)
        out["objectives"][objective]["masked_garbage"] = masked_targets_ignored(
            train.loss_fn, train.trained(trainer.state), trainer.graphdef, micro, trainer.loss,
            trainer.max_documents)
      m = jax.device_get(trainer.step(batch))
      steps.append({"loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),
                    "lr": float(trainer.schedule(i))})
      batches.append({k: v[0] for k, v in batch.items()})  # [A = 1, B, ...] -> [B, ...]
    trainer.close()
    arrays.update({f"{objective}/{k}": np.stack([b[k] for b in batches]) for k in batches[0]})
    final = trainer.model()
    hf.export(final, cfg, f"{work}/hf_{objective}", tokenizer_dir=c.teacher.hf_path)
    ev = evaluate.evaluate(final, cache.open(paths.cache("eval")), batch_size=c.eval.batch_size,
                           max_seqs=EVAL_ROWS, chunk_size=None)
    out["objectives"][objective].update(steps=steps, eval_ce=ev["ce"],
                                        eval_positions=ev["positions"])
  arrays.update({f"eval/{k}": v for k, v in cache.open(paths.data("eval")).read(
      slice(0, EVAL_ROWS)).items()})
  arrays.update({f"check/{k}": v for k, v in f32.read(slice(0, CHECK_ROWS)).items()})
  own = stores["tail"].read(slice(0, CHECK_ROWS))
  arrays.update({"check/dict_ids": own["topk_ids"], "check/dict_logprobs": own["topk_logprobs"]})
  out["inputs"] = input_checks(data, [stores["tail"], f32], arrays, paths.tokenizer())
  out["inputs"]["hf_config_eos_token_id"] = json.load(open(f"{c.teacher.hf_path}/config.json"))[
      "eos_token_id"]
  out["tied"] = {"student": cfg.tie_embeddings, "teacher": teacher_model.cfg.tie_embeddings,
                 "student_has_unembed": hasattr(final, "unembed_DxV")}
  return out, arrays


def input_checks(data, caches, arrays, tok) -> dict:
  """Teacher rows == student rows; recomputed here: positions restart per document, t is in the
  loss iff t + 1 is in t's document, label t = token t + 1; the separator packing wrote (a
  segment without it must be a piece cut at the row's end)."""
  rows = data.read(slice(0, data.num_seqs))
  names = ("tokens", "positions", "segment_ids", "loss_mask")
  same = all(np.array_equal(rows[k], c.read(slice(0, c.num_seqs))[k])
             for c in caches for k in names)
  across = all(np.array_equal(arrays[f"hard/{k}"], arrays[f"{o}/{k}"]) for o in OBJECTIVES
               for k in names + ("labels",))
  tok_, pos, seg, mask, lab = (arrays[f"hard/{k}"].reshape(-1, data.seq_len)
                               for k in names + ("labels",))
  ok, docs = {"positions": True, "loss_mask": True, "labels": True}, [documents(x) for x in seg]
  for r, spans in enumerate(docs):
    want = np.zeros(data.seq_len, bool)
    for s, e in spans:
      want[s:e - 1] = True
      ok["positions"] &= np.array_equal(pos[r, s:e], np.arange(e - s))
      ok["labels"] &= np.array_equal(lab[r, s:e - 1], tok_[r, s + 1:e])
    ok["loss_mask"] &= np.array_equal(mask[r], want)
  padding, last, eos = int(np.sum(seg == 0)), sum(map(len, docs)), tok.document_eos_id
  ends = [(int(ids[e - 1]) == eos, e == len(ids), int(np.sum(ids[s:e - 1] == eos)))
          for seg_T, ids in zip(rows["segment_ids"], rows["tokens"]) for s, e in documents(seg_T)]
  return {"cache_rows_equal_data_rows": same, "batches_equal_across_objectives": across,
          **{f"{k}_as_defined": bool(v) for k, v in ok.items()},
          "masked": {"padding": padding, "last_of_document": last,
                     "other": int(np.sum(~mask)) - padding - last},
          "documents_per_row": [min(map(len, docs)), max(map(len, docs))],
          "document_eos": [tok.document_eos, eos], "document_bos": tok.document_bos,
          "segments": len(ends), "segments_ending_in_eos": sum(x[0] for x in ends),
          "segments_cut_mid_row_without_eos": sum(not x[0] and not x[1] for x in ends),
          "eos_inside_segments": sum(x[2] for x in ends), "tokenizer_hash_same": all(
              c.attrs["tokenizer_hash"] == data.attrs["tokenizer_hash"] for c in caches)}


# ---------------------------------------------------------------------------------- report
def report(kd: dict, ref: dict) -> list[dict]:
  """{what, figures} per check; prints the table."""
  rel = lambda a, b: abs(a - b) / max(abs(b), 1e-12)
  print(f"{'':<7}{'step':>5}{'lr':>9}{'loss kdjax':>12}{'loss torch':>12}{'rel':>9}"
        f"{'|g| kdjax':>11}{'|g| torch':>11}{'rel':>9}")
  lines = []
  for o in OBJECTIVES:
    a, b = kd["objectives"][o], ref[o]
    pairs = list(zip(a["steps"], b["steps"]))
    for i, (x, y) in enumerate(pairs):
      print(f"{o:<7}{i + 1:>5}{x['lr']:>9.1e}{x['loss']:>12.6f}{y['loss']:>12.6f}"
            f"{rel(x['loss'], y['loss']):>9.1e}{x['grad_norm']:>11.5f}{y['grad_norm']:>11.5f}"
            f"{rel(x['grad_norm'], y['grad_norm']):>9.1e}")
    f = {f"{q}_{side}": [s[q] for s in steps] for q in ("loss", "grad_norm")
         for side, steps in (("kdjax", a["steps"]), ("torch", b["steps"]))}
    f.update({f"{q}_rel_max": max(rel(x[q], y[q]) for x, y in pairs)
              for q in ("loss", "grad_norm")})
    f.update(lr_abs_max=max(abs(x["lr"] - y["lr"]) for x, y in pairs),
             eval_ce_kdjax=a["eval_ce"], eval_ce_torch=b["eval_ce"],
             eval_ce_rel=rel(a["eval_ce"], b["eval_ce"]),
             eval_positions=[a["eval_positions"], b["eval_positions"]],
             param_rel_max=b["param_rel_max"], param_worst=b["param_worst"],
             masked_garbage_loss_grad=a["masked_garbage"],
             positions_per_step_torch=[s["positions"] for s in b["steps"]])
    f["agree"] = f["loss_rel_max"] < TOLERANCE and f["grad_norm_rel_max"] < TOLERANCE
    lines.append({"what": f"step agreement: {o}", "figures": f})
  print(f"\n{'':<7}{'rel loss':>10}{'rel |g|':>9}{'eval CE kdjax':>15}{'eval CE torch':>15}"
        f"{'rel params':>12}  masked targets garbled: |d loss|, max |d grad|")
  for o, line in zip(OBJECTIVES, lines):
    f = line["figures"]
    print(f"{o:<7}{f['loss_rel_max']:>10.1e}{f['grad_norm_rel_max']:>9.1e}"
          f"{f['eval_ce_kdjax']:>15.6f}{f['eval_ce_torch']:>15.6f}{f['param_rel_max']:>12.1e}"
          f"  {f['masked_garbage_loss_grad']}")
  for what, f in (("inputs, separator", kd["inputs"]), ("cache vs transformers' teacher",
                  ref["cache"]), ("tied lm_head", {**kd["tied"], "torch_student": ref["tied"]})):
    print(f"{what}: {json.dumps(f)}")
    lines.append({"what": what, "figures": f})
  return lines


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--root", default="runs/smollm2", help="where `python -m kdjax.smollm2` wrote")
  p.add_argument("--steps", type=int, default=8, help="optimizer steps per objective")
  p.add_argument("--results", default=RESULTS, help="JSON lines appended here ('' for none)")
  p.add_argument("--torch-side", default="", help=argparse.SUPPRESS)  # the side venv's part
  args = p.parse_args()
  if args.torch_side:
    return torch_side(args.torch_side)
  start, root = time.perf_counter(), os.path.abspath(args.root)
  from kdjax.smollm2 import side_venv
  work = f"{root}/step_agreement_{args.steps}"  # the slice's size follows the steps
  c = make_config(root, work, args.steps)
  write_slice(root, work, chars=5 * args.steps * c.opt.batch_size * c.data.seq_len)
  kd, arrays = kdjax_side(c, work)
  np.savez(f"{work}/arrays.npz", **arrays)
  opt = {k: c.opt[k] for k in ("lr", "warmup_steps", "steps", "min_lr_ratio", "b1", "b2",
                               "weight_decay", "grad_clip")}
  job = {"npz": f"{work}/arrays.npz", "teacher": c.teacher.hf_path, "init": f"{work}/hf_init",
         "objectives": OBJECTIVES, "out": f"{work}/torch.json", "opt": opt,
         "exports": {o: f"{work}/hf_{o}" for o in OBJECTIVES}}
  json.dump(job, open(f"{work}/jobs.json", "w"))
  subprocess.run([side_venv.ensure(), os.path.abspath(__file__), "--torch-side",
                  f"{work}/jobs.json"], check=True)
  ref = json.load(open(job["out"]))
  lines = report(kd, ref)
  seconds = round(time.perf_counter() - start)
  print(f"{seconds} s; every loss and gradient norm within {TOLERANCE:g} relative: "
        f"{all(line['figures']['agree'] for line in lines[:len(OBJECTIVES)])}")
  common = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                     capture_output=True, text=True).stdout.strip(),
            "device": "cpu", "settings": {
                "config": "configs/smollm2.py:smoke", "steps": args.steps, "train_rows": kd["rows"],
                "rows_x_len": [c.opt.batch_size, c.data.seq_len], "k": c.cache.k,
                "layout": c.cache.layout, "dtype": "float32", "opt": opt, "seconds": seconds,
                "torch_transformers": ref["versions"]}}
  if args.results:
    with open(args.results, "a") as f:
      f.writelines(json.dumps({"what": line["what"], **common, "figures": line["figures"]}) + "\n"
                   for line in lines)


if __name__ == "__main__":
  main()
