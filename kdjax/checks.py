"""Checks a run's inputs before its first stage: every path, and that teacher, student and
tokenizer belong together. Each error names the file and the config field to change, so a
mistake costs seconds rather than a teacher pass."""
import os

from kdjax import tokenizer
from kdjax.data import sources
from kdjax.errors import UserError
from kdjax.models import prune
from kdjax.models.llama import ModelConfig
from kdjax.workdir import Paths


def check_inputs(c, paths: Paths) -> None:
  """Raises UserError (or the loaders' own, which name the file). paths: the run's, which decide
  its tokenizer."""
  stages = set(c.stages)
  for field, path in (("workdir", c.workdir), ("cache.path", c.cache.path)):
    if path and os.path.isfile(path):
      raise UserError(f"{field} = {path} is a file; set --config.{field} to a directory (it "
                      "is created if missing).")
  if "data" in stages and c.data.source != "stdlib":
    sources.source_paths(c.data.source)  # names a missing file or an empty glob
  if "data" in stages and c.data.eval_source:
    sources.source_paths(c.data.eval_source, "data.eval_source")

  tok = _run_tokenizer(paths, stages)
  if "data" in stages:
    _chat_template(c, tok, paths.tokenizer_path)
  if c.teacher.hf_path and paths.trains_tokenizer and "data" in stages:
    raise UserError(
        f"teacher.hf_path is set but data.tokenizer is empty, so stage 'data' would train a new "
        f"tokenizer the teacher cannot read: set --config.data.tokenizer={c.teacher.hf_path}.")
  vocab = tok.vocab_size if tok is not None else None
  output_vocab = {}
  for role in ("teacher", "student"):
    group = c[role]
    if role == "teacher" and not stages & {"pretrain", "cache"} and not group.hf_path:
      continue
    if role == "student" and c.init.from_teacher:
      continue  # pruned from the teacher: its vocabulary is the teacher's
    if group.hf_path:
      from kdjax.models import hf  # lazily, as pipeline does
      cfg = hf.config_from_hf(group.hf_path, dtype=group.dtype, param_dtype=group.param_dtype,
                              tokenizer_vocab=vocab, **ModelConfig.runtime_of(group))
      _same_tokenizer(role, group.hf_path, tok, paths.tokenizer_path)
      if role == "teacher" and c.init.from_teacher:
        prune.group_config(cfg, c.student, c.init.layers)  # names the field that cannot fit
      output_vocab[role] = cfg.output_vocab_size
    elif group.vocab_size or vocab:
      output_vocab[role] = group.vocab_size or vocab
  if len(output_vocab) == 2 and output_vocab["teacher"] != output_vocab["student"]:
    source = "its checkpoint" if c.student.hf_path else "student.vocab_size"
    raise UserError(
        f"the student predicts over {output_vocab['student']} tokens ({source}), the teacher over "
        f"{output_vocab['teacher']}: a student must share its teacher's vocabulary. "
        + ("Set --config.student.vocab_size=0 to take the tokenizer's size."
           if not c.student.hf_path else "Pick a student checkpoint with the teacher's tokenizer."))


def _run_tokenizer(paths: Paths, stages: set):
  """The tokenizer the run will use, or None when stage 'data' is about to train it."""
  tok = paths.tokenizer_or_none()  # names a missing or unreadable file
  if tok is None and "data" not in stages:
    raise UserError(
        f"no tokenizer: {paths.tokenizer_path} does not exist and stage 'data', which writes it, "
        "is not listed. Add 'data' to --config.stages, or set --config.data.tokenizer.")
  return tok


def _chat_template(c, tok, tokenizer_path: str) -> None:
  """Chat records render with the tokenizer's template: refuse them when it has none."""
  if tok is not None and tok.chat_template is not None:
    return
  path = sources.chat_file(c.data.source, c.data.messages_field)
  if path is None and c.data.eval_source:
    path = sources.chat_file(c.data.eval_source, c.data.messages_field, "data.eval_source")
  if path is None:
    return
  whose = (f"the tokenizer {tokenizer_path} has no chat template (no chat_template.jinja, "
           "chat_template.json or tokenizer_config.json 'chat_template')" if tok is not None
           else "stage 'data' would train a tokenizer, which has no chat template")
  raise UserError(
      f"{path} holds chat records ({c.data.messages_field!r}) but {whose}: set "
      "--config.data.tokenizer to a checkpoint directory whose tokenizer has one, or give "
      f"plain-text records ({c.data.text_field!r}).")


def _same_tokenizer(role: str, hf_path: str, tok, run_tokenizer_path: str) -> None:
  own_path = os.path.join(hf_path, "tokenizer.json")
  if tok is None or not os.path.exists(own_path):
    return
  if tokenizer.tokenizer_hash(tokenizer.load(hf_path)) != tokenizer.tokenizer_hash(tok):
    raise UserError(
        f"{own_path} ({role}.hf_path) is not the run's tokenizer ({run_tokenizer_path}): teacher, "
        f"student and cache must share one. Set --config.data.tokenizer={hf_path}, or pick a "
        f"{role} checkpoint with the run's tokenizer.")
