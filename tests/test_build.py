"""Building a run's models (kdjax/build.py): vocab_size 0 takes the run's tokenizer's, a student
pruned from its teacher has the teacher's vocabulary and its own dims and is cut from a checkpoint
teacher as shipped, and a teacher that no stage finished is refused with a message saying what to
run."""
import os

import pytest

from kdjax import build, config, tokenizer
from kdjax.errors import UserError
from kdjax.models import prune
from kdjax.workdir import Paths

WORDS = [" ".join(f"w{i * j % 83}" for j in range(30)) for i in range(40)]


@pytest.fixture(scope="module")
def trained_tokenizer(tmp_path_factory):
  path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
  tokenizer.train_bpe(WORDS, 280, str(path))
  return path


def models_of(tmp_path, trained_tokenizer, from_teacher=False) -> build.Models:
  c = config.base()
  c.workdir = str(tmp_path)
  os.makedirs(tmp_path / "data")
  (tmp_path / "data" / "tokenizer.json").write_text(trained_tokenizer.read_text())
  c.teacher.update(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
                   remat="none")
  c.student.update(d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=32,
                   remat="none")
  c.init.from_teacher = from_teacher
  return build.Models.from_config(c, Paths.from_config(c))


def test_vocab_size_zero_takes_the_tokenizers(tmp_path, trained_tokenizer):
  models = models_of(tmp_path, trained_tokenizer)
  assert models.shapes(models.teacher).vocab_size == 280
  model, cfg = models.start(models.student)
  assert cfg == models.shapes(models.student) == model.cfg
  assert (cfg.vocab_size, cfg.d_model) == (280, 16)


def test_pruned_student_has_the_teachers_vocabulary_and_its_own_dims(tmp_path, trained_tokenizer):
  models = models_of(tmp_path, trained_tokenizer, from_teacher=True)
  cfg = models.shapes(models.student)
  assert cfg == prune.group_config(build.model_config(models.teacher, 280), models.student)
  assert (cfg.vocab_size, cfg.d_model, cfg.n_layers) == (280, 16, 1)
  model, resumed = models.start(models.student, resuming=True)  # no teacher needed
  assert resumed == cfg == model.cfg


def test_no_finished_teacher_is_refused(tmp_path, trained_tokenizer):
  models = models_of(tmp_path, trained_tokenizer, from_teacher=True)
  assert models.finished("teacher", models.teacher, 1) is None
  for make in (models.teacher_model, lambda: models.start(models.student)):
    with pytest.raises(UserError, match="no finished teacher.*stage 'pretrain'"):
      make()


def test_shapes_are_computed_once_per_group(tmp_path, trained_tokenizer):
  models = models_of(tmp_path, trained_tokenizer, from_teacher=True)
  assert models.shapes(models.student) is models.shapes(models.student)
  assert models.shapes(models.teacher) is models.shapes(models.teacher)


def test_a_checkpoint_teacher_is_pruned_as_shipped_even_once_corrected(tmp_path, trained_tokenizer,
                                                                      monkeypatch):
  """With teacher.hf_path the student is cut from that checkpoint, not from the teacher stage
  pretrain corrected (which teaches it); without one, from the teacher stage pretrain trained."""
  models = models_of(tmp_path, trained_tokenizer, from_teacher=True)
  monkeypatch.setattr(build.Models, "teacher_model", lambda self, mesh=None: "trained")
  monkeypatch.setattr(build, "new_model", lambda group, *a, **k: (f"shipped {group.hf_path}", None))
  assert models.prune_source() == "trained"
  models.teacher.hf_path = "ckpt"
  assert models.prune_source() == "shipped ckpt"
