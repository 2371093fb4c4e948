"""A run's tokenizer is decided once (data.tokenizer, else the one stage data trains) and loaded
once per Paths; a student checkpoint with its own tokenizer.json brings it."""
import pytest

from kdjax import config, tokenizer
from kdjax.workdir import Paths

WORDS = [" ".join(f"w{i * j % 89}" for j in range(30)) for i in range(40)]


def bpe(path, size: int):
  return tokenizer.train_bpe(WORDS, size, str(path))


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
  """The run's (300 tokens) and a student checkpoint's own (310), as checkpoint directories."""
  root = tmp_path_factory.mktemp("tokenizers")
  bpe(root / "run", 300)
  bpe(root / "own", 310)
  return root


def paths_of(tmp_path, **fields):
  c = config.base()
  c.workdir = str(tmp_path / "run")
  for key, value in fields.items():
    group, _, field = key.rpartition(".")
    c[group][field] = value
  return Paths.from_config(c)


def test_trained_tokenizer_is_none_until_stage_data_writes_it(tokenizers, tmp_path):
  paths = paths_of(tmp_path)
  assert paths.trains_tokenizer and paths.tokenizer_path == paths.trained_tokenizer
  assert paths.tokenizer_or_none() is None
  bpe(paths.trained_tokenizer, 280)
  assert paths.tokenizer_or_none().vocab_size == 280


def test_given_tokenizer_is_loaded_once(tokenizers, tmp_path):
  paths = paths_of(tmp_path, **{"data.tokenizer": str(tokenizers / "run")})
  assert not paths.trains_tokenizer
  assert paths.tokenizer() is paths.tokenizer() is paths.tokenizer_or_none()
  assert paths.tokenizer_dir == str(tokenizers / "run")
  assert paths.student_tokenizer() is paths.tokenizer()  # a student without a checkpoint


def test_given_tokenizer_missing_names_the_file(tmp_path):
  paths = paths_of(tmp_path, **{"data.tokenizer": str(tmp_path / "nowhere.json")})
  with pytest.raises(Exception, match="nowhere.json"):
    paths.tokenizer_or_none()


def test_student_checkpoint_brings_its_own_tokenizer(tokenizers, tmp_path):
  paths = paths_of(tmp_path, **{"data.tokenizer": str(tokenizers / "run"),
                                "student.hf_path": str(tokenizers / "own")})
  assert paths.student_tokenizer_dir == str(tokenizers / "own")
  assert paths.student_tokenizer().vocab_size == 310
  assert paths.tokenizer().vocab_size == 300
  without = paths_of(tmp_path, **{"data.tokenizer": str(tokenizers / "run"),
                                  "student.hf_path": str(tmp_path)})
  assert without.student_tokenizer_dir == str(tokenizers / "run")
