"""The recipe study's table and plot (experiments/studies/recipe_study.py --table)."""
import json
import os

import numpy as np

from experiments.studies import recipe_schedule as plan

METRICS = (("ce", "CE", 4), ("accuracy", "acc", 4), ("full_kl", "full KL", 4),
           ("top1_agreement", "top-1", 4), ("ece", "ECE", 4), ("exact_match", "next line", 3),
           ("gap", "CE - teacher's", 4), ("outside_top_k", "outside top-100", 4),
           ("ce_inside_top_k", "CE inside", 4), ("ce_outside_top_k", "CE outside", 3))
PHASES = ("screen", "final", "long", "correct", "mix", "longer", "wide", "online", "control")
OBJECTIVE_NAMES = {"hard": "hard labels", "tail": "tail KL", "online": "online full KL"}


def with_gap(r: dict) -> dict:
  """r with `gap`: its CE minus the teacher's on the same tokens (= its KL to the teacher where
  the data are the teacher's samples)."""
  return {**r, "gap": r["ce"] - r["teacher_ce"]} if "teacher_ce" in r else r


def recipe_label(r: dict) -> str:
  name = OBJECTIVE_NAMES[r["objective"]]
  if r.get("divergence", "forward") != "forward":
    name = f"online {r['divergence'].replace('_', ' ')} KL"
  if r.get("temperature", 1.0) != 1.0:
    name += f" T {r['temperature']:g}"
  if r["ce_weight"]:
    name += f" + {r['ce_weight']:g} CE"
  times = plan.CORRECTIONS.get(r["teacher"])
  name += ("" if times is None else " (corrected teacher)" if times == 1 else
           f" (teacher corrected {times}x longer)")
  return name + (" (64M student)" if r.get("student", "35M") == "64M" else "")


def table(lines: list[dict]) -> str:
  """One row per recipe, lr and token count: the mean over its seeds, each seed's CE."""
  groups = {}
  for r in map(with_gap, lines):
    key = (PHASES.index(r["phase"]), r["tokens"], recipe_label(r), r["lr"], r["data"])
    groups.setdefault(key, []).append(r)
  head = ["phase", "data", "recipe", "lr", "tokens", "seeds", "CE per seed"]
  head += [label for _, label, _ in METRICS]
  out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for (phase, tokens, label, lr, data), rs in sorted(groups.items()):
    rs = sorted(rs, key=lambda r: r["seed"])
    mean = lambda m: np.mean([r[m] for r in rs]) if all(m in r for r in rs) else float("nan")
    cells = [PHASES[phase], data, label, f"{lr:g}", f"{rs[0]['train_tokens'] / 1e6:.1f}M",
             ",".join(str(r["seed"]) for r in rs), " / ".join(f"{r['ce']:.4f}" for r in rs)]
    cells += [f"{mean(m):.{digits}f}" for m, _, digits in METRICS]
    out.append("| " + " | ".join(cells) + " |")
  return "\n".join(out)


# The prep folders whose teacher a report names (prep_sampled: the control's text before it was
# written as token ids).
PREPS = ("prep", "prep_corrected", "prep_corrected_long", "prep_corrected_longest",
         "prep_sampled", "prep_sampled_ids")


def teacher_evals(root: str) -> dict:
  """{prep folder: its teacher's own held-out figures (its prep_done.json's teacher_eval)} of the
  preps that finished under ROOT (the study's --root)."""
  out = {}
  for which in PREPS:
    path = os.path.join(root, "study", which, "prep_done.json")
    if os.path.exists(path):
      with open(path) as f:
        out[which] = json.load(f)["teacher_eval"]
  return out


def teachers(evals: dict) -> str:
  """The teachers' own held-out figures, a line each."""
  return "\n".join(
      f"teacher ({which}): " + "  ".join(f"{label} {own[m]:.{d}f}" for m, label, d in METRICS
                                        if m in own)
      for which, own in evals.items())


def plot(lines: list[dict], png: str, root: str = ""):
  """Training CE over training tokens (lines) and held-out CE (dots), one panel each: the real
  text's final arms (before they ran, the screen's seed 0 at its best lr), the long runs (200M
  tokens), the 12.6M screen's hard labels, best distilled recipes and online arms (lr 3e-3, seed
  0), and the control on the teacher's own samples at lr 3e-3. Each arm's metrics.jsonl is read
  under ROOT/study/ (the study's --root) or, without a root, from the workdir its line names; an
  arm without one is a labelled dot."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  real = [r for r in lines if r["phase"] == "final"] or [
      r for r in lines if r["phase"] == "screen" and r["seed"] == 0 and r["lr"] == 3e-3]
  screen = [r for r in lines if r["seed"] == 0 and r["lr"] == 3e-3 and r["data"] == "real"
            and r["tokens"] < 20e6 and r.get("student", "35M") == "35M"
            and (r["objective"] in ("hard", "online") or r["ce_weight"] == 0.5)
            and r.get("divergence", "forward") == "forward" and r.get("temperature", 1.0) == 1]
  control = [r for r in lines if r["phase"] == "control" and r["data"] == "sampled_ids"
             and r["lr"] == 3e-3]
  long = [r for r in lines if r["phase"] == "long"]
  panels = [(rs, title, ylim) for rs, title, ylim in (
      (real, "real held-out text (Python sources, Shakespeare)", (1.5, 4.0)),
      (long, "the same, the long runs (~3.8 passes over the data)", (1.5, 4.0)),
      (screen, "the same, 12.6M tokens, seed 0", (2.5, 4.5)),
      (control, "the teacher's own samples (token ids), 4M tokens", (3.5, 6.5))) if rs]
  if not panels:
    return
  fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
  for ax, (shown, title, ylim) in zip(axes[0], panels):
    colors = {}
    for r in sorted(shown, key=lambda r: (recipe_label(r), r["seed"])):
      label = recipe_label(r)
      color = colors.setdefault(label, f"C{len(colors)}")
      workdir = os.path.join(root, "study", r["arm"]) if root else r["workdir"]
      metrics = os.path.join(workdir, r["run"], "metrics.jsonl")
      held_out = f"{label}, seed {r['seed']} (held out {r['ce']:.3f})"
      if os.path.exists(metrics):
        with open(metrics) as f:
          steps = [json.loads(x) for x in f]
        per_step = r["train_tokens"] / r["steps"]
        ax.plot([s["step"] * per_step / 1e6 for s in steps], [s["ce"] for s in steps],
                color=color, ls=("-", ":")[r["seed"] % 2], lw=1, label=held_out)
      ax.plot([r["train_tokens"] / 1e6], [r["ce"]], "o", color=color,
              label=None if os.path.exists(metrics) else held_out)
    ax.set(xlabel="training tokens (M)", title=f"{title}, lr {shown[0]['lr']:g}", ylim=ylim)
    ax.legend(fontsize=7)
  axes[0][0].set_ylabel("CE on the true tokens (nats)")
  fig.suptitle("SmolLM2-135M-Instruct -> pruned 35M student: training CE (lines), held-out CE "
               "(dots)", fontsize=10)
  fig.tight_layout()
  fig.savefig(png, dpi=100)


def plot_margin(lines: list[dict], png: str, evals: dict):
  """Each distilled final's margin over hard labels (the same seed's hard-label final CE minus
  its own) against its teacher's held-out CE (evals: teacher_evals): one dot a seed, one colour
  a recipe."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  own = {name: evals[folder]["ce"] for name in ("original",) + tuple(plan.CORRECTIONS)
         if (folder := os.path.basename(plan.prep_dir("", name))) in evals}
  hard = {r["seed"]: r["ce"] for r in lines if r["phase"] == "final" and r["objective"] == "hard"
          and r["data"] == "real" and r.get("student", "35M") == "35M"}
  finals = [r for r in lines if r["phase"] == "final" and r["objective"] != "hard"
            and r["teacher"] in own and r["seed"] in hard]
  if not finals:
    return
  fig, ax = plt.subplots(figsize=(6.5, 4.5))
  colors = {}
  for r in sorted(finals, key=lambda r: (r["objective"], r["teacher"], r["seed"])):
    label = recipe_label({**r, "teacher": "original"})  # the recipe; the teacher is the x axis
    new = label not in colors
    color = colors.setdefault(label, f"C{len(colors)}")
    ax.plot(own[r["teacher"]], hard[r["seed"]] - r["ce"], "o", color=color,
            label=label if new else None)
  ax.axhline(0.0, color="gray", lw=0.8)
  ax.axhline(0.05, color="gray", lw=0.8, ls="--", label="the 0.05 nats target")
  ax.set(xlabel="the teacher's own held-out CE (nats): as shipped, then corrected longer",
         ylabel="hard labels' CE minus the student's (nats)",
         title="pruned 35M student, 50M tokens, one dot a seed")
  ax.invert_xaxis()
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(png, dpi=100)


def report(lines: list[dict], results: str, root: str = ""):
  print(table(lines))
  if root:
    evals = teacher_evals(root)
    print(teachers(evals))
    plot_margin(lines, os.path.splitext(results)[0] + "_margin.png", evals)
  plot(lines, os.path.splitext(results)[0] + ".png", root)
