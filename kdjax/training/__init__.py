"""The training runtime: the jitted step and its loop, resuming, checkpoints and reports.

  train.py         grad_step, apply_step, train_step, Trainer, fit
  distillation.py  a micro-batch's loss on its targets, by objective, and its metrics
  remat_auto.py    remat "auto": the fastest policy whose memory plan fits opt.memory_gib
  resume.py        Run (restore, save only finite parameters, save on exit), StopOnSigterm
  checkpoints.py   Checkpoints (orbax), restore_finished (parameters alone)
  reporting.py     Reporter: the console line, metrics.jsonl, TensorBoard, tokens/s, MFU, ETA
  tensorboard.py   a synchronous event writer
"""
