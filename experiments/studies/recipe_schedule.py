"""The recipe study's schedule (experiments/studies/recipe_study.py): its arms, their names,
and which run next given the lines measured so far. No JAX: the study's workers and its
tests read it.

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
          CORRECTED_STEPS of configs/smollm2.py's pretrain group, one setting chosen before
          the study), its cache written; `tail` and `tail` + 0.5 CE trained on it at 12.6M at
          the screen's lr for that recipe, seed 0, then seed 1 of the better; the student is
          pruned from the original teacher, as in every other arm.
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
  longer  the teacher corrected 3x as long (120 steps, 15.7M tokens; the same lr and data,
          warmup a tenth; teacher `corrected_long`): MIX_FINALS and the corrected finalist on
          it at 12.6M, seeds 0 and 1, at the corrected finalist's lr; finals for each whose
          two-seed mean beats the corrected finalist's. Then 9x as long (360 steps, 47M tokens,
          about one pass over the train split; `corrected_longest`): each recipe that earned
          finals on the 3x teacher, screened the same way; finals where its two-seed mean beats
          its own on the 3x teacher. Does a teacher closer to the data widen the margin?
  long    once no final is left to run or to be decided (without caches: none that needs no
          cache): hard labels and the distilled recipe with the lowest two-seed mean final CE,
          each at its lr, LONG times the finals' tokens (200M: ~3.8 passes over the prep's 52M
          positions, the same for both), seed 0. With the screen's and the finals' arms, the
          gap at 12.6M, 50M and 200M tokens, each run on its own schedule: do the two part or
          cross?
The order among runnable arms: the screen, the finals, the control, seed 1 of hard labels and the
leader, the corrected teacher, its finals, the mix and its finals, the longer corrections' screens
and finals (3x, then 9x), the long runs, the wide student, the online divergences, the edge lrs, lr 3e-4, then
seed 1 of the other screen recipes.
"""
import os

import numpy as np

LRS = (1e-3, 3e-3)  # the screen's lrs the finalists are chosen from
EDGE_LRS = (1e-2,)  # screened for hard labels and the finalist recipe, after the finals
LAST_LRS = (3e-4,)  # screened too, last of all (seed 0), and reported beside them
OBJECTIVES = (("hard", 0.0), ("tail", 0.0), ("tail", 0.1), ("tail", 0.3), ("tail", 0.5))
CONTROL_OBJECTIVES = (("hard", 0.0), ("tail", 0.0), ("online", 0.0))
CORRECTED = (("tail", 0.0), ("tail", 0.5))  # trained on the corrected teacher's cache
MIX = (("tail", 1.0), ("tail", 2.0))  # screened on the corrected teacher, after its finals
MIX_FINALS = (("online", 0.5),)  # on the corrected teacher, to the finals unscreened
# The corrected teachers: CORRECTED_STEPS (and its warmup) times this.
CORRECTIONS = {"corrected": 1, "corrected_long": 3, "corrected_longest": 9}
# The corrected teacher's steps (warmup a tenth; lr and batch configs/smollm2.py's pretrain group):
# the study's own, so that its results keep their meaning whatever the config defaults to (120
# since the longer correction won). The smoke variant keeps the config's steps.
CORRECTED_STEPS = 40
LONG = 4  # the long runs: the finals' tokens times this
SCREEN, FINAL, CONTROL = 12_582_912, 50_069_504, 4_000_000  # training tokens
ONLINE = (("forward", 1.0), ("reverse", 1.0), ("skew_forward", 1.0), ("skew_reverse", 1.0),
          ("forward", 2.0))  # (loss.divergence, loss.temperature) of the online arms


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


def best_final(lines: dict) -> tuple | None:
  """(the distilled recipe with the lowest two-seed mean final CE, its lr); None before one
  recipe's two seeds ran."""
  finals = {}
  for a in lines.values():
    r = recipe(a)
    if a["phase"] == "final" and a["data"] == "real" and r is not None and r[0] != "hard":
      finals.setdefault((r, a["lr"]), []).append(a["ce"])
  means = {k: np.mean(v) for k, v in finals.items() if len(v) == 2}
  return min(means, key=means.get) if means else None


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


def longer_rung(lines: dict, todo: list, teacher: str, lr: float, bars: dict, screen: int,
                final_tokens: int, caches: bool) -> tuple[bool, bool]:
  """Appends to todo each recipe of bars ({(objective, ce weight): the two-seed mean screen CE to
  beat}) screened on `teacher` at lr, seeds 0 and 1, and its finals where its own mean beats
  its bar. (later: a screen is left to run; open: one that can run in this launch)."""
  later = open_ = False
  for (o, ce), bar in bars.items():
    todo += [arm(o, ce, lr, s, screen, "longer", teacher=teacher) for s in (0, 1)]
    got = seed_ces(lines, (o, ce, teacher), lr)
    later |= len(got) < 2
    open_ |= len(got) < 2 and (caches or o != "tail")
    if len(got) == 2 and np.mean(got) < bar:
      todo += [arm(o, ce, lr, s, final_tokens, "final", teacher=teacher) for s in (0, 1)]
  return later, open_


def schedule(lines: dict, root: str, scale: float = 1.0, control: bool = True,
             correct: bool = True, longer: bool = True, longest: bool = True,
             long: bool = True, caches: bool = True) -> tuple[list[dict], bool]:
  """(arms runnable now, in priority order; whether more will become runnable later). scale:
  every token count times this (a smoke test's); control, correct, longer (the 3x correction),
  longest (the 9x one), long: run those phases; caches False: no arm that reads a cache
  (`tail`) is runnable."""
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
  # open: whether this launch may still schedule finals (decisions that wait on `tail` arms
  # count only where caches can be read)
  open_ = hard_lr is None or (lead is None and caches)
  decided, chosen = corrected_finalist(lines)
  open_ |= caches and not decided
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
      open_ |= caches and not decided
      if mixed is not None:
        (o2, ce2, _), lr2 = mixed
        todo += [arm(o2, ce2, lr2, s, final_tokens, "final", teacher="corrected")
                 for s in (0, 1)]
  if longer and prep_done(root, "corrected_long"):
    later |= not decided
    if chosen is not None:  # each beside the corrected finalist's two-seed screen mean
      bar = np.mean(seed_ces(lines, *chosen))
      bars = {r: bar for r in MIX_FINALS + (chosen[0][:2],)}
      rung = longer_rung(lines, todo, "corrected_long", chosen[1], bars, screen, final_tokens,
                         caches)
      later, open_ = later or rung[0], open_ or rung[1]
  elif longer:
    later = open_ = True
  if longest and prep_done(root, "corrected_longest"):
    later |= not decided
    if chosen is not None:  # the 3x teacher's finalists, each beside its own 3x screen mean
      lr, bars = chosen[1], {}
      for r in MIX_FINALS + (chosen[0][:2],):
        got = seed_ces(lines, r + ("corrected_long",), lr)
        finalist = any(a["phase"] == "final" and recipe(a) == r + ("corrected_long",)
                       for a in lines.values())
        if len(got) == 2 and finalist:
          bars[r] = np.mean(got)
        open_ |= len(got) < 2 and (caches or r[0] != "tail")  # not decided yet
      rung = longer_rung(lines, todo, "corrected_longest", lr, bars, screen, final_tokens,
                         caches)
      later, open_ = later or rung[0], open_ or rung[1]
  elif longest:
    later = open_ = True
  if long:
    open_ |= any(a["phase"] == "final" and arm_name(a) not in lines
                 and (caches or a["objective"] != "tail") for a in todo)
    best = best_final(lines)
    later |= open_ or best is None
    if not open_ and best is not None:
      (o, ce, teacher), lr = best
      tokens = final_tokens * LONG
      todo += [arm("hard", 0.0, hard_lr, 0, tokens, "long"),
               arm(o, ce, lr, 0, tokens, "long", teacher=teacher)]
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
  todo = [a for a in todo if caches or a["objective"] != "tail"]
  return [a for a in todo if arm_name(a) not in lines], later


def prep_dir(root: str, which: str) -> str:
  return os.path.join(root, "study", {"original": "prep", "sampled_ids": "prep_sampled_ids",
                                      "corrected": "prep_corrected",
                                      "corrected_long": "prep_corrected_long",
                                      "corrected_longest": "prep_corrected_longest"}[which])


def prep_done(root: str, which: str) -> bool:
  return os.path.exists(os.path.join(prep_dir(root, which), "prep_done.json"))
