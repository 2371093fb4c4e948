"""Which recipe makes a distilled student better than hard labels? SmolLM2-135M-Instruct into the
pruned 35M student (configs/smollm2.py), every arm with the same tuning budget.

    python -m kdjax.smollm2 --out runs/smollm2                  # teacher checkpoint + corpora
    python -m experiments.studies.recipe_study --root runs/smollm2 --processes 4   # resumable
    python -m experiments.studies.recipe_study --table          # table and plot from the results

Phases, scheduled by what is finished (arms run side by side in N processes, in this order of
priority among those runnable):
  screen  12.6M tokens: hard labels, `tail` KL at k = 100 alone and mixed with hard-label CE
          (loss.ce_weight 0.1, 0.3, 0.5), each at lr 1e-3 and 3e-3, seed 0; then seed 1 of
          each objective at the lr that was best for it on seed 0. After the finals: hard labels
          and the finalist recipe at EDGE_LRS (is the best lr inside the grid?), `online` (the
          full-vocabulary KL, no top-k) at hard labels' lr, and each objective at lr 3e-4.
  final   50M tokens, seeds 0 and 1, each at its best lr: hard labels and the distilled recipe
          that led the seed-0 screen, as soon as those are known (seed 1 of the screen checks
          the lead); and the corrected teacher's better recipe too if its mean screen CE over
          seeds 0 and 1 beats the leader's.
  control the teacher's own samples as data (experiments/studies/sample_teacher.py writes token
          ids, never re-tokenised; the prompts' 8 real tokens are not targets): the teacher's
          distribution is the data's, so a student's held-out CE minus the teacher's is its KL
          to the teacher, and distillation should win. Hard labels, `tail` and `online` at each
          of LRS (seed 0), then seed 1 at each one's best; 4M tokens, 16 rows a step.
  correct the teacher corrected first (stage pretrain from its checkpoint on the train split,
          configs/smollm2.py's pretrain group, one setting chosen before the study), its cache
          written; `tail`
          and `tail` + 0.5 CE trained on it at 12.6M at the screen's lr for that recipe, seed 0,
          then seed 1 of the better; the student is pruned from the original teacher, as in
          every other arm.
  wide    the wider student (WIDE: depth-pruned only, d 576, ~64M): hard labels and the leading
          recipe at their lrs, 12.6M, seed 0 then seed 1.
  online  the leading recipe's CE weight and lr with the teacher in the step (no top-k) and
          each divergence of ONLINE: forward, reverse, DistiLLM's skew forward and skew reverse
          KL (loss.skew 0.1), and forward at temperature 2 (exact without a cache); 12.6M,
          seed 0.
  mix     once the corrected teacher's recipe is a finalist, on the corrected teacher at the
          leader's lr: each of MIX, the CE weight past the grid's edge (1.0, 2.0: the more CE
          the better in the screen, so is 0.5 inside?), at 12.6M, seeds 0 and 1; the one of
          these and the corrected finalist with the lower two-seed mean gets finals too, if it
          is not that finalist. And MIX_FINALS, `online` + 0.5 CE with the corrected teacher
          beside the step, straight to the finals (screened on the original teacher: forward
          + 0.5 CE led the online arms and beat `tail` + 0.5 CE).
  longer  the teacher corrected LONGER times as long (120 steps, 15.7M tokens; the same lr and
          data, warmup a tenth; teacher `corrected_long`): MIX_FINALS and the corrected
          finalist on it at 12.6M, seeds 0 and 1, at the corrected finalist's lr; finals for
          each whose two-seed mean beats the corrected finalist's. Does a teacher closer to
          the data widen the margin?
The order among runnable arms: the screen, the finals, the control, seed 1 of hard labels and the
leader, the corrected teacher, its finals, the mix and its finals, the longer correction's screen
and finals, the wide student, the online divergences, the edge lrs, lr 3e-4, then seed 1 of the
other screen recipes.
Every arm shares the data store and the learning-rate schedule's shape (warmup a tenth of the
steps at most 40, cosine to 10%), 64 rows x 2048 tokens a step. Each finished arm is measured
on the held-out split (whole works and packages never trained on; --eval-rows rows) against the
original teacher run online: CE on the true tokens, next-token accuracy, full-vocabulary KL
(teacher || student), top-1 agreement, ECE; and next-line completion (kdjax/completion.py:
exact match of the greedy continuation on held-out lines); the teacher's CE on the same tokens
and the CE split by whether the true token is in the teacher's top 100 (what a top-k cache
teaches of it). One JSON line per arm in --results.
"""
import argparse
import json
import logging
import os
import subprocess
import sys
import time

import jax
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments.studies import smollm2_study as base
from kdjax import build, cache, completion, evaluate, pipeline
from kdjax.workdir import Paths

RESULTS = os.path.join(REPO, "experiments", "results", "recipe.jsonl")
LRS = (1e-3, 3e-3)  # the screen's lrs the finalists are chosen from
EDGE_LRS = (1e-2,)  # screened for hard labels and the finalist recipe, after the finals
LAST_LRS = (3e-4,)  # screened too, last of all (seed 0), and reported beside them
OBJECTIVES = (("hard", 0.0), ("tail", 0.0), ("tail", 0.1), ("tail", 0.3), ("tail", 0.5))
CONTROL_OBJECTIVES = (("hard", 0.0), ("tail", 0.0), ("online", 0.0))
CORRECTED = (("tail", 0.0), ("tail", 0.5))  # trained on the corrected teacher's cache
MIX = (("tail", 1.0), ("tail", 2.0))  # screened on the corrected teacher, after its finals
MIX_FINALS = (("online", 0.5),)  # on the corrected teacher, to the finals unscreened
LONGER = 3  # the longer correction: the config's correction steps (and warmup) times this
SCREEN, FINAL, CONTROL = 12_582_912, 50_069_504, 4_000_000  # training tokens
CONTROL_ROWS = 16  # rows a step on the sampled text (4M tokens: 123 steps)
# The wider student: the teacher's width, heads and MLP, 10 of its 30 layers (64M parameters).
WIDE = dict(d_model=576, n_layers=10, n_heads=9, n_kv_heads=3, d_ff=1536)
ONLINE = (("forward", 1.0), ("reverse", 1.0), ("skew_forward", 1.0), ("skew_reverse", 1.0),
          ("forward", 2.0))  # (loss.divergence, loss.temperature) of the online arms
COMPLETION_PROMPTS = 1024  # next-line questions, from the first PROMPT_ROWS held-out rows
PROMPT_ROWS = 256
SAMPLED = "corpus_sampled_ids"  # the teacher's samples as token ids (sample_teacher.py)


def arm(objective: str, ce: float, lr: float, seed: int, tokens: int, phase: str,
        teacher: str = "original", data: str = "real", student: str = "35M",
        divergence: str = "forward", temperature: float = 1.0) -> dict:
  return dict(phase=phase, objective=objective, ce_weight=ce, lr=lr, seed=seed, tokens=tokens,
              teacher=teacher, data=data, init="pruned", k=100 if objective == "tail" else 0,
              hidden=0.0, student=student, divergence=divergence, temperature=temperature)


PLAIN = dict(student="35M", divergence="forward", temperature=1.0)  # lines before these fields


def extras(a: dict) -> dict:
  """An arm's student, divergence and temperature (PLAIN's values where its line has none)."""
  return {k: a.get(k, v) for k, v in PLAIN.items()}


def arm_name(a: dict) -> str:
  v = extras(a)
  recipe = a["objective"] + (f"_ce{a['ce_weight']:g}" if a["ce_weight"] else "")
  recipe += "" if v["divergence"] == "forward" else f"_{v['divergence']}"
  recipe += "" if v["temperature"] == 1.0 else f"_T{v['temperature']:g}"
  where = "" if a["data"] == "real" else f"{a['data']}_"
  teacher = "" if a["teacher"] == "original" else f"{a['teacher']}_"
  student = "" if v["student"] == "35M" else f"{v['student']}_"
  return (f"{where}{student}{teacher}{recipe}_lr{a['lr']:g}_{a['tokens'] / 1e6:.3g}M_"
          f"seed{a['seed']}")


def recipe(a: dict) -> tuple:
  """(objective, ce weight, teacher); None for the wide student's and the online divergences'
  arms, which no lr search or leader reads."""
  if extras(a) != PLAIN:
    return None
  return (a["objective"], a["ce_weight"], a["teacher"])


def best_lr(lines: dict, r: tuple, phase: str = "screen", data: str = "real") -> float | None:
  """The best lr (lowest held-out CE on seed 0) of recipe r (objective, ce weight, teacher) in a
  phase, once it ran at every one of LRS."""
  ces = {a["lr"]: a["ce"] for a in lines.values()
         if a["phase"] == phase and a["data"] == data and a["seed"] == 0 and recipe(a) == r
         and a["lr"] in LRS}
  return min(ces, key=ces.get) if len(ces) == len(LRS) else None


def seed_ces(lines: dict, r: tuple, lr: float, phase: str = "screen") -> list[float]:
  return [a["ce"] for a in lines.values() if a["phase"] in (phase, "correct", "mix", "longer")
          and a["data"] == "real" and recipe(a) == r and a["lr"] == lr]


def leader(lines: dict) -> tuple | None:
  """(the distilled recipe of OBJECTIVES with the lowest seed-0 screen CE at its best lr, that
  lr) once every seed-0 screen arm ran; None before."""
  best = {}
  for o, ce in OBJECTIVES:
    lr = best_lr(lines, (o, ce, "original"))
    if lr is None:
      return None
    if o != "hard":
      best[(o, ce, "original")] = (seed_ces(lines, (o, ce, "original"), lr)[0], lr)
  r = min(best, key=lambda r: best[r][0])
  return r, best[r][1]


def corrected_finalist(lines: dict) -> tuple[bool, tuple | None]:
  """(decided, (the corrected teacher's better recipe, its lr) or None): a finalist when its
  mean screen CE over seeds 0 and 1 is below the leader's; undecided before both ran both."""
  lead, corrected = leader(lines), corrected_lead(lines)
  if lead is None or corrected is None:
    return False, None
  lr = best_lr(lines, corrected[:2] + ("original",))
  ours, theirs = seed_ces(lines, corrected, lr), seed_ces(lines, lead[0], lead[1])
  if len(ours) < 2 or len(theirs) < 2:
    return False, None
  return True, ((corrected, lr) if np.mean(ours) < np.mean(theirs) else None)


def mix_finalist(lines: dict, chosen: tuple) -> tuple[bool, tuple | None]:
  """(decided, (the recipe of MIX to finish, its lr) or None): of MIX and the corrected finalist
  `chosen` ((recipe, lr)), the lowest two-seed mean screen CE, when it is one of MIX."""
  (_, lr), means = chosen, {chosen[0]: np.mean(seed_ces(lines, *chosen))}
  for o, ce in MIX:
    got = seed_ces(lines, (o, ce, "corrected"), lr)
    if len(got) < 2:
      return False, None
    means[(o, ce, "corrected")] = np.mean(got)
  best = min(means, key=means.get)
  return True, (None if best == chosen[0] else (best, lr))


def corrected_lead(lines: dict) -> tuple | None:
  """The corrected teacher's recipe (of CORRECTED) with the lower seed-0 CE, once both ran."""
  ces = {}
  for o, ce in CORRECTED:
    lr = best_lr(lines, (o, ce, "original"))
    got = [a["ce"] for a in lines.values() if a["phase"] == "correct" and a["seed"] == 0
           and recipe(a) == (o, ce, "corrected") and a["lr"] == lr]
    if not got:
      return None
    ces[(o, ce, "corrected")] = got[0]
  return min(ces, key=ces.get)


def schedule(lines: dict, root: str, scale: float = 1.0, control: bool = True,
             correct: bool = True, longer: bool = True) -> tuple[list[dict], bool]:
  """(arms runnable now, in priority order; whether more will become runnable later). scale:
  every token count times this (a smoke test's); control, correct, longer: run those phases."""
  screen, final_tokens = int(SCREEN * scale), int(FINAL * scale)
  todo = [arm(o, ce, lr, 0, screen, "screen") for lr in LRS for o, ce in OBJECTIVES]
  later = False
  hard_lr = best_lr(lines, ("hard", 0.0, "original"))
  if hard_lr is None:
    later = True
  else:  # hard labels' finals need no other arm
    todo += [arm("hard", 0.0, hard_lr, s, final_tokens, "final") for s in (0, 1)]
  lead = leader(lines)
  later |= lead is None
  if lead is not None:  # and the seed-0 screen's leading distilled recipe beside them
    (o, ce, _), lr = lead
    todo += [arm(o, ce, lr, s, final_tokens, "final") for s in (0, 1)]
  if control and prep_done(root, "sampled_ids"):  # each objective at each lr, seed 1 at its best
    tokens = int(CONTROL * scale)
    todo += [arm(o, ce, lr, 0, tokens, "control", data="sampled_ids")
             for lr in LRS for o, ce in CONTROL_OBJECTIVES]
    for o, ce in CONTROL_OBJECTIVES:
      lr = best_lr(lines, (o, ce, "original"), "control", "sampled_ids")
      later |= lr is None
      if lr is not None:
        todo.append(arm(o, ce, lr, 1, tokens, "control", data="sampled_ids"))
  elif control:
    later = True
  # Seed 1 of each objective at its best lr, the seed-0 leaders first.
  lrs = {(o, ce): best_lr(lines, (o, ce, "original")) for o, ce in OBJECTIVES}
  later |= None in lrs.values()
  ready = [(o, ce) for (o, ce), lr in lrs.items() if lr is not None]
  first = [("hard", 0.0)] + ([lead[0][:2]] if lead is not None else [])
  ready.sort(key=lambda r: (r not in first, first.index(r) if r in first else 0,
                            seed_ces(lines, r + ("original",), lrs[r])[0]))
  seed1 = [arm(o, ce, lrs[(o, ce)], 1, screen, "screen") for o, ce in ready]
  todo += seed1[:len(first)]  # hard labels and the distilled leader
  if correct and prep_done(root, "corrected"):  # beside the screen's arms of the same recipes
    for o, ce in CORRECTED:
      if lrs.get((o, ce)) is not None:
        todo.append(arm(o, ce, lrs[(o, ce)], 0, screen, "correct", teacher="corrected"))
    corrected = corrected_lead(lines)
    later |= corrected is None
    if corrected is not None:
      todo.append(arm(corrected[0], corrected[1], lrs[corrected[:2]], 1, screen, "correct",
                      teacher="corrected"))
  elif correct:
    later = True
  decided, chosen = corrected_finalist(lines)
  if correct:
    later |= not decided
    if chosen is not None:
      (o, ce, teacher), lr = chosen
      todo += [arm(o, ce, lr, s, final_tokens, "final", teacher=teacher) for s in (0, 1)]
      todo += [arm(o2, ce2, lr, s, final_tokens, "final", teacher="corrected")
               for o2, ce2 in MIX_FINALS for s in (0, 1)]
      todo += [arm(o2, ce2, lr, s, screen, "mix", teacher="corrected") for o2, ce2 in MIX
               for s in (0, 1)]
      decided, mixed = mix_finalist(lines, chosen)
      later |= not decided
      if mixed is not None:
        (o2, ce2, _), lr2 = mixed
        todo += [arm(o2, ce2, lr2, s, final_tokens, "final", teacher="corrected")
                 for s in (0, 1)]
  if longer and prep_done(root, "corrected_long"):
    later |= not decided
    if chosen is not None:
      (o, ce, _), lr = chosen
      bar = np.mean(seed_ces(lines, *chosen))  # the corrected finalist's two-seed screen mean
      for o2, ce2 in MIX_FINALS + ((o, ce),):
        todo += [arm(o2, ce2, lr, s, screen, "longer", teacher="corrected_long") for s in (0, 1)]
        got = seed_ces(lines, (o2, ce2, "corrected_long"), lr)
        later |= len(got) < 2
        if len(got) == 2 and np.mean(got) < bar:
          todo += [arm(o2, ce2, lr, s, final_tokens, "final", teacher="corrected_long")
                   for s in (0, 1)]
  elif longer:
    later = True
  if lead is not None and hard_lr is not None:
    (o, ce, _), lr = lead
    wide = [arm("hard", 0.0, hard_lr, s, screen, "wide", student="64M") for s in (0, 1)]
    wide += [arm(o, ce, lr, s, screen, "wide", student="64M") for s in (0, 1)]
    todo += wide[::2]  # seed 0 of both
    todo += [arm("online", ce, lr, 0, screen, "online", divergence=d, temperature=t)
             for d, t in ONLINE]
    todo.append(arm("online", 0.0, hard_lr, 0, screen, "screen"))  # online alone, as screened
    # Is the best lr inside the grid? Hard labels and the leader above it.
    todo += [arm(o2, ce2, lr2, 0, screen, "screen") for lr2 in EDGE_LRS
             for o2, ce2 in (("hard", 0.0), (o, ce))]
    todo += wide[1::2]
  todo += [arm(o, ce, lr, 0, screen, "screen") for lr in LAST_LRS for o, ce in OBJECTIVES]
  todo += seed1[len(first):]
  return [a for a in todo if arm_name(a) not in lines], later


def prep_dir(root: str, which: str) -> str:
  return os.path.join(root, "study", {"original": "prep", "sampled_ids": "prep_sampled_ids",
                                      "corrected": "prep_corrected",
                                      "corrected_long": "prep_corrected_long"}[which])


def prep_done(root: str, which: str) -> bool:
  return os.path.exists(os.path.join(prep_dir(root, which), "prep_done.json"))


def prep_config(root: str, which: str, variant: str = "", caches: bool = True):
  """The data store and cache of the real text (original or corrected teacher) or of the sampled
  text; caches False: no cache (the data, and the corrected teacher)."""
  c = base.prep_config(root, variant)
  c.cache.update(hidden_states=False, hidden_dim=0)
  c.workdir = prep_dir(root, which)
  if not variant:  # ~52M positions at seq_len 2048: enough for the finals' 50.1M tokens
    c.data.max_bytes = 175_000_000
  if which == "sampled_ids":
    c.data.source = os.path.join(root, SAMPLED, "train.jsonl")
    c.data.eval_source = os.path.join(root, SAMPLED, "eval.jsonl")
    c.data.max_bytes = 0
  elif which in ("corrected", "corrected_long"):  # the config's correction (its pretrain group)
    c.stages = ("pretrain", "cache")  # the original prep's data, linked
    if which == "corrected_long":
      c.pretrain.update(steps=c.pretrain.steps * LONGER,
                        warmup_steps=c.pretrain.warmup_steps * LONGER)
  if not caches:
    c.stages = tuple(s for s in c.stages if s != "cache")
  return c


def link(src: str, dst: str):
  if not os.path.exists(dst):
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    os.symlink(os.path.abspath(src), dst)


def completion_questions(root: str, variant: str) -> tuple[dict, object]:
  """(prompts, decode): the next-line completion questions of the real held-out text."""
  paths = Paths.from_config(prep_config(root, "original", variant))
  tok = paths.tokenizer()
  store = cache.open(paths.data("eval"))
  rows = store.read(np.arange(min(PROMPT_ROWS, store.num_seqs)))
  prompts = completion.pick_prompts(rows, completion.line_breaks(tok.decode, tok.vocab_size),
                                    COMPLETION_PROMPTS)
  return prompts, tok.decode


def run_prep(root: str, which: str, variant: str, eval_rows: int, caches: bool = True):
  c = prep_config(root, which, variant, caches)
  if which in ("corrected", "corrected_long"):
    link(os.path.join(prep_dir(root, "original"), "data"), os.path.join(c.workdir, "data"))
  start = time.perf_counter()
  pipeline.run(c)
  paths = Paths.from_config(c)
  teacher = build.Models.from_config(c, paths).teacher_model()
  own = evaluate.evaluate_online(teacher, teacher, cache.open(paths.data("eval")),
                                 batch_size=c.eval.batch_size, max_seqs=eval_rows)
  if which != "sampled_ids":  # the teacher's own answers to the real text's completion questions
    own["exact_match"] = completion.exact_match(teacher, *completion_questions(root, variant))
  with open(os.path.join(c.workdir, "prep_done.json"), "w") as f:
    json.dump({"seconds": time.perf_counter() - start, "teacher_eval": own}, f)


def arm_config(root: str, a: dict, variant: str):
  """An arm's config: its own workdir, the prep's data (linked) and cache, the arm's recipe."""
  which = "sampled_ids" if a["data"] == "sampled_ids" else a["teacher"]
  c = prep_config(root, which, variant)
  c.workdir = os.path.join(root, "study", arm_name(a))
  c.cache.path = os.path.join(prep_dir(root, which), "cache")
  c.seed = a["seed"]
  c.init.from_teacher = True  # from the original teacher: its Hugging Face checkpoint
  if a["data"] == "sampled_ids":
    c.opt.batch_size = CONTROL_ROWS if variant != "smoke" else 2
  c.opt.steps = -(-a["tokens"] // (c.opt.batch_size * c.opt.accum_steps * c.data.seq_len))
  c.opt.warmup_steps = min(c.opt.warmup_steps, c.opt.steps // 10)
  c.opt.lr = a["lr"]
  c.stages = ("baseline",) if a["objective"] == "hard" else ("train",)
  v = extras(a)
  c.loss.update(objective="tail" if a["objective"] == "hard" else a["objective"],
                ce_weight=a["ce_weight"], divergence=v["divergence"],
                temperature=v["temperature"])
  if v["student"] == "64M":
    c.student.update(**WIDE)
  c.cache.k = a["k"] or c.cache.k
  link(os.path.join(prep_dir(root, "sampled_ids" if which == "sampled_ids" else "original"),
                    "data"), os.path.join(c.workdir, "data"))
  if which in ("corrected", "corrected_long"):  # online's teacher (the student: as shipped)
    link(os.path.join(prep_dir(root, which), "teacher"), os.path.join(c.workdir, "teacher"))
  return c


def measure(c, a: dict, teacher, root: str, eval_rows: int, questions) -> dict:
  run = "baseline" if a["objective"] == "hard" else "student"
  models = build.Models.from_config(c, Paths.from_config(c))
  model = models.finished(run, c.student, c.opt.steps)
  which = "sampled_ids" if a["data"] == "sampled_ids" else "original"
  eval_store = cache.open(os.path.join(prep_dir(root, which), "data", "eval.zarr"))
  line = evaluate.evaluate_online(model, teacher, eval_store, batch_size=c.eval.batch_size,
                                  max_seqs=eval_rows)
  if a["data"] == "real":
    line["exact_match"] = completion.exact_match(model, *questions)
  line.update(arm=arm_name(a), **a, steps=c.opt.steps, run=run, workdir=c.workdir,
              train_tokens=c.opt.steps * c.opt.batch_size * c.data.seq_len,
              commit=base.e2e_bench.commit(), device=jax.devices()[0].device_kind,
              date=base.e2e_bench.today())
  return line


def claim(args, name: str) -> bool:
  """Whether this process takes job `name`: the first of this launch (args.claim) to create its
  claim file. An earlier launch's claims are void: its unfinished arms resume from checkpoints."""
  folder = os.path.join(args.root, "study", "claims", args.claim)
  os.makedirs(folder, exist_ok=True)
  try:
    os.close(os.open(os.path.join(folder, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    return True
  except FileExistsError:
    return False


def worker(args):
  """Takes the next arm (or prep) nobody of this launch has claimed, until none is left."""
  orig = prep_config(args.root, "original", args.variant)
  teacher = build.Models.from_config(orig, Paths.from_config(orig)).teacher_model()
  questions = completion_questions(args.root, args.variant)
  while True:
    # The sampled text's data and cache, once: a serial job, once the sampler finished.
    if (args.sample_tokens and os.path.exists(os.path.join(args.root, SAMPLED, "eval.jsonl"))
        and not prep_done(args.root, "sampled_ids") and claim(args, "prep_sampled_ids")):
      run_prep(args.root, "sampled_ids", args.variant, args.eval_rows)
    todo, later = schedule(base.read_results(args.results), args.root, args.scale,
                           control=bool(args.sample_tokens), correct=args.correct,
                           longer=args.longer)
    todo = [a for a in todo if args.caches or a["objective"] != "tail"]
    a = next((a for a in todo if claim(args, arm_name(a))), None)
    if a is None and not (later and args.caches):
      return
    if a is None:
      time.sleep(10)
      continue
    c = arm_config(args.root, a, args.variant)
    start = time.perf_counter()
    pipeline.run(c)
    line = measure(c, a, teacher, args.root, args.eval_rows, questions)
    line["seconds"] = time.perf_counter() - start
    base.append(args.results, line)
    print(f"{line['arm']}: CE {line['ce']:.4f}  KL {line['full_kl']:.4f}  "
          f"acc {line['accuracy']:.4f}", flush=True)


def prepare(args):
  """The original teacher's data, cache and own held-out figures, then the corrected teacher's;
  the sampled text started first, beside them."""
  sampled = os.path.join(args.root, SAMPLED)
  sampler = None
  if not os.path.exists(os.path.join(sampled, "eval.jsonl")) and args.sample_tokens:
    sampler = subprocess.Popen(
        [args.hf_python, os.path.join(REPO, "experiments", "studies", "sample_teacher.py"),
         "--hf", os.path.join(args.root, "hf"), "--prompts",
         os.path.join(args.root, "corpus", "train.jsonl"), "--out", sampled,
         "--train-tokens", str(int(args.sample_tokens * args.scale) or 1), "--eval-tokens",
         str(int(args.sample_tokens * args.scale) // 13 or 1), "--batch-size",
         str(args.sample_batch), "--new-tokens", str(args.sample_length)])
  if not prep_done(args.root, "original"):
    run_prep(args.root, "original", args.variant, args.eval_rows, args.caches)
  # Here, before the workers: training the 135M teacher needs more of the GPU than a worker's
  # share (1/N of it; it ran out of memory at 1/5 of an H100).
  if args.correct and not prep_done(args.root, "corrected"):
    run_prep(args.root, "corrected", args.variant, args.eval_rows, args.caches)
  if args.longer and not prep_done(args.root, "corrected_long"):
    run_prep(args.root, "corrected_long", args.variant, args.eval_rows, args.caches)
  return sampler


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--root", default=base.smollm2.ROOT)
  parser.add_argument("--variant", default="", help="configs/smollm2.py variant (smoke: CPU)")
  parser.add_argument("--eval-rows", type=int, default=512, help="held-out rows measured")
  parser.add_argument("--sample-tokens", type=int, default=CONTROL,
                      help="tokens of teacher-sampled training text (0: no control)")
  parser.add_argument("--sample-batch", type=int, default=1024)
  parser.add_argument("--sample-length", type=int, default=504, help="sampled tokens a document")
  parser.add_argument("--no-correct", dest="correct", action="store_false",
                      help="skip the corrected teacher's phase")
  parser.add_argument("--no-longer", dest="longer", action="store_false",
                      help="skip the longer correction's phase")
  parser.add_argument("--no-caches", dest="caches", action="store_false",
                      help="write no cache (the data and the corrected teacher only) and run only "
                           "the arms that read none")
  parser.add_argument("--scale", type=float, default=1.0,
                      help="every token count times this (smoke tests: 1e-4)")
  parser.add_argument("--hf-python", default=sys.executable,
                      help="a Python with torch and transformers (for the sampled text)")
  parser.add_argument("--results", default=RESULTS)
  parser.add_argument("--processes", type=int, default=1)
  parser.add_argument("--claim", default="", help=argparse.SUPPRESS)
  parser.add_argument("--table", action="store_true", help="print the table, redraw the plot")
  args = parser.parse_args()
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(process)d %(message)s",
                      datefmt="%H:%M:%S")
  # Arms of one shape share compiled programs (seeds, and every arm's evaluation).
  jax.config.update("jax_compilation_cache_dir", os.path.join(args.root, "study", "jax_cache"))
  if args.variant == "smoke":  # CPU: one lr, two objectives, each phase's code run once
    global LRS, EDGE_LRS, LAST_LRS, OBJECTIVES, COMPLETION_PROMPTS
    LRS, EDGE_LRS, LAST_LRS, OBJECTIVES = LRS[:1], (), (), (OBJECTIVES[0], OBJECTIVES[-1])
    COMPLETION_PROMPTS = 4
  if args.table:
    from experiments.studies import recipe_report
    recipe_report.report(list(base.read_results(args.results).values()), args.results,
                         args.root)
    return
  os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
  if args.claim:  # a worker of a launch
    worker(args)
    return
  sampler = prepare(args)
  rc = base.launch(args, module=__spec__.name)
  if sampler is not None:
    sampler.wait()
  sys.exit(rc)


if __name__ == "__main__":
  main()
