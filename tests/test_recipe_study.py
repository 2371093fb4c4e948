"""The recipe study's schedule (experiments/studies/recipe_schedule.py): which arms run, in which
order, and when it is done (no GPU: results are made up); and the arms' configs (recipe_study)."""
import json
import os

from experiments.studies import recipe_schedule as rs, recipe_study as study


def done(root, which):
  os.makedirs(rs.prep_dir(root, which), exist_ok=True)
  with open(os.path.join(rs.prep_dir(root, which), "prep_done.json"), "w") as f:
    json.dump({}, f)


def finish(lines, arms, ce):
  for a in arms:
    lines[rs.arm_name(a)] = dict(a, arm=rs.arm_name(a), ce=ce(a))


def run_all(lines, root, ce):
  """Runs the schedule to its end; the arms in the order they became runnable."""
  order = []
  for _ in range(20):
    todo, later = rs.schedule(lines, root)
    if not todo:
      assert not later
      return order
    order += [rs.arm_name(a) for a in todo]
    finish(lines, todo, ce)
  raise AssertionError("the schedule never ends")


def screen_ce(a):
  """Hard labels best; among distilled recipes the larger CE weight; lr 3e-3 beats 1e-3."""
  base = 3.0 if a["lr"] == 3e-3 else 3.4
  return base + (0.0 if a["objective"] == "hard" else 0.1 - 0.1 * a["ce_weight"])


def test_finals_of_hard_labels_and_the_leader_come_first(tmp_path):
  lines = {}
  todo, later = rs.schedule(lines, str(tmp_path))
  assert later and all(a["phase"] == "screen" and a["seed"] == 0 for a in todo)
  finish(lines, todo, screen_ce)
  todo, _ = rs.schedule(lines, str(tmp_path))
  names = [rs.arm_name(a) for a in todo]
  assert names[:4] == ["hard_lr0.003_50.1M_seed0", "hard_lr0.003_50.1M_seed1",
                       "tail_ce0.5_lr0.003_50.1M_seed0", "tail_ce0.5_lr0.003_50.1M_seed1"]
  assert names[4:6] == ["hard_lr0.003_12.6M_seed1", "tail_ce0.5_lr0.003_12.6M_seed1"]


def test_a_better_corrected_teacher_gets_finals_and_every_phase_ends(tmp_path):
  root = str(tmp_path)
  for which in ("sampled_ids", "corrected", "corrected_long", "corrected_longest"):
    done(root, which)
  for better, expect in ((0.2, True), (-0.2, False)):
    lines = {}
    def ce(a, better=better):  # the longer corrections help online a little more
      online = a["objective"] == "online"
      gain = {"corrected": better, "corrected_long": better + 0.1 * online,
              "corrected_longest": better + 0.12 * online}
      return screen_ce(a) - gain.get(a["teacher"], 0.0)
    order = run_all(lines, root, ce)
    corrected_finals = [n for n in order if n.startswith("corrected_") and "50.1M" in n]
    assert bool(corrected_finals) == expect, order
    # The mix after the corrected finalist: both seeds of each of MIX; the most CE wins here.
    mix = [n for n in order if n.startswith(("corrected_online", "corrected_tail_ce1_",
                                             "corrected_tail_ce2_")) and "_200M_" not in n]
    assert len(mix) == (2 * len(rs.MIX) + 2 * len(rs.MIX_FINALS) + 2 if expect else 0), mix
    assert ("corrected_online_ce0.5_lr0.003_50.1M_seed1" in order) == expect
    assert ("corrected_tail_ce2_lr0.003_50.1M_seed1" in order) == expect
    # The longer correction: MIX_FINALS and the corrected finalist screened on it; finals for
    # those whose mean beats the corrected finalist's (here online, as the test's CEs say).
    longer = sorted(n for n in order if n.startswith("corrected_long_"))
    want = [f"corrected_long_{r}_lr0.003_{t}_seed{s}" for r, t in (
        ("online_ce0.5", "12.6M"), ("online_ce0.5", "50.1M"), ("tail_ce0.5", "12.6M"))
        for s in (0, 1)]
    assert longer == (sorted(want) if expect else []), longer
    # The 9x correction: the 3x one's finalists (here online) screened on it, then finals.
    longest = sorted(n for n in order if n.startswith("corrected_longest_"))
    want = [f"corrected_longest_online_ce0.5_lr0.003_{t}_seed{s}" for t in ("12.6M", "50.1M")
            for s in (0, 1)]
    assert longest == (sorted(want) if expect else []), longest
    # The long runs, once every final ran: hard labels and the best final's recipe at 200M.
    best = "corrected_tail_ce2" if expect else "tail_ce0.5"  # CE weight 2: the lowest CE here
    long_runs = [n for n in order if "_200M_" in n]
    assert long_runs == ["hard_lr0.003_200M_seed0", f"{best}_lr0.003_200M_seed0"], long_runs
    assert order.index(long_runs[0]) > max(i for i, n in enumerate(order) if "_50.1M_" in n)
    if expect:  # a cached final left to run holds them back, unless no cache can be read
      for n in long_runs + ["corrected_tail_ce0.5_lr0.003_50.1M_seed1"]:
        del lines[n]
      names = [rs.arm_name(a) for a in rs.schedule(lines, root)[0]]
      assert names == ["corrected_tail_ce0.5_lr0.003_50.1M_seed1"], names
      names = [rs.arm_name(a) for a in rs.schedule(lines, root, caches=False)[0]]
      assert names == long_runs[:1], names  # the best final reads a cache: hard labels alone
    # The control: each objective at each lr on seed 0, then seed 1 at its best.
    control = [n for n in order if n.startswith("sampled_ids_")]
    assert len(control) == 3 * len(rs.LRS) + 3
    assert "online_lr0.003_12.6M_seed0" in order and "hard_lr0.01_12.6M_seed0" in order
    # The wide student (both seeds of hard labels and the leader) and the online divergences.
    assert {"64M_hard_lr0.003_12.6M_seed1", "64M_tail_ce0.5_lr0.003_12.6M_seed1"} <= set(order)
    for name in ("reverse", "skew_forward", "skew_reverse", "T2"):
      assert f"online_ce0.5_{name}_lr0.003_12.6M_seed0" in order
    assert order.index("64M_hard_lr0.003_12.6M_seed0") < order.index("hard_lr0.01_12.6M_seed0")
    assert order.index("tail_ce0.5_lr0.01_12.6M_seed0") < order.index("tail_lr0.003_12.6M_seed1")


def test_arm_config_sets_the_student_and_divergence(tmp_path):
  a = rs.arm("online", 0.5, 3e-3, 0, 1000, "online", divergence="skew_reverse", temperature=2.0)
  c = study.arm_config(str(tmp_path), a, "smoke")
  assert (c.loss.objective, c.loss.divergence, c.loss.temperature) == ("online", "skew_reverse",
                                                                        2.0)
  w = study.arm_config(str(tmp_path), rs.arm("hard", 0.0, 3e-3, 0, 1000, "wide", student="64M"),
                    "")
  assert (w.student.d_model, w.student.n_layers, w.stages) == (576, 10, ("baseline",))
  # An arm on the corrected teacher sees its checkpoint (online runs it beside the step).
  m = study.arm_config(str(tmp_path), rs.arm("online", 0.5, 3e-3, 0, 1000, "mix",
                                          teacher="corrected"), "smoke")
  assert os.path.realpath(os.path.join(m.workdir, "teacher")) == os.path.realpath(
      os.path.join(rs.prep_dir(str(tmp_path), "corrected"), "teacher"))
  # The corrections: the study's steps whatever the config's default; the longer ones' steps
  # and warmup times theirs in CORRECTIONS, each its own teacher.
  o = study.arm_config(str(tmp_path), rs.arm("tail", 0.5, 3e-3, 0, 1000, "correct",
                                          teacher="corrected"), "")
  assert (o.pretrain.steps, o.pretrain.warmup_steps) == (40, 4)
  n = study.arm_config(str(tmp_path), rs.arm("online", 0.5, 3e-3, 0, 1000, "final",
                                          teacher="corrected_long"), "")
  assert (n.pretrain.steps, n.pretrain.warmup_steps) == (120, 12)
  m = study.arm_config(str(tmp_path), rs.arm("online", 0.5, 3e-3, 0, 1000, "final",
                                          teacher="corrected_longest"), "")
  assert (m.pretrain.steps, m.pretrain.warmup_steps) == (360, 36)
  assert os.path.realpath(os.path.join(n.workdir, "teacher")) == os.path.realpath(
      os.path.join(rs.prep_dir(str(tmp_path), "corrected_long"), "teacher"))


def test_margin_plot_reads_each_teachers_own_ce(tmp_path):
  """recipe_margin.png: each distilled final against the same seed's hard-label final, at its
  teacher's own held-out CE (the prep's teacher_eval); no root, no plot."""
  from experiments.studies import recipe_report
  root = str(tmp_path)
  for which, ce in (("original", 1.9), ("corrected_long", 1.6)):
    os.makedirs(rs.prep_dir(root, which))
    with open(os.path.join(rs.prep_dir(root, which), "prep_done.json"), "w") as f:
      json.dump({"teacher_eval": {"ce": ce}}, f)
  evals = recipe_report.teacher_evals(root)
  assert evals == {"prep": {"ce": 1.9}, "prep_corrected_long": {"ce": 1.6}}
  finals = (("hard", 0.0, "original", 2.17), ("online", 0.5, "corrected_long", 2.13),
            ("tail", 0.5, "corrected", 2.14))  # the last one's teacher has no prep here: skipped
  lines = [dict(rs.arm(o, w, 3e-3, s, rs.FINAL, "final", teacher=t), ce=ce)
           for o, w, t, ce in finals for s in (0, 1)]
  png = tmp_path / "margin.png"
  recipe_report.plot_margin(lines, str(png), evals)
  assert png.exists()
  recipe_report.plot_margin(lines[:2], str(tmp_path / "none.png"), evals)  # hard labels alone
  assert not (tmp_path / "none.png").exists()
