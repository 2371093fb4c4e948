"""Bad inputs are refused before the first stage, with an error naming the file and the field to
change, and nothing in the workdir is touched."""
import json
import os

import pytest

from kdjax import checks, config, tokenizer
from kdjax.errors import UserError
from kdjax.models import hf
from kdjax.workdir import Paths

WORDS = [" ".join(f"w{i * j % 97}" for j in range(40)) for i in range(60)]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  """Two tokenizers (of 300 and 320 tokens) and config-only checkpoints using them."""
  root = tmp_path_factory.mktemp("world")
  for name, size in (("tok", 300), ("other_tok", 320)):
    tokenizer.train_bpe(WORDS, size, str(root / name))
  for name, tok, vocab in (("teacher", "tok", 300), ("student", "tok", 300),
                           ("student_other", "other_tok", 320)):
    os.makedirs(root / name)
    (root / name / "tokenizer.json").write_text((root / tok / "tokenizer.json").read_text())
    (root / name / "config.json").write_text(json.dumps(dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=vocab, hidden_size=32,
        intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True)))
  (root / "train.jsonl").write_text("".join(json.dumps({"text": w}) + "\n" for w in WORDS))
  return root


def run_config(world, tmp_path, **fields):
  c = config.base()
  c.workdir = str(tmp_path / "run")
  c.data.source = str(world / "train.jsonl")
  c.data.tokenizer = str(world / "tok")
  c.teacher.hf_path = str(world / "teacher")
  c.stages = ("data", "cache", "train", "eval")
  for key, value in fields.items():
    group, _, field = key.rpartition(".")
    (c[group] if group else c)[field] = value
  return c


def refused(c, error, *words):
  with pytest.raises(error) as info:
    checks.check_inputs(c, Paths.from_config(c))
  for word in words:
    assert word in str(info.value), (word, str(info.value))
  assert not os.path.exists(c.workdir)  # nothing written
  return str(info.value)


def test_a_good_run_passes(world, tmp_path):
  for c in (run_config(world, tmp_path),
            run_config(world, tmp_path, **{"student.hf_path": str(world / "student")})):
    checks.check_inputs(c, Paths.from_config(c))


def test_workdir_or_cache_path_is_a_file(world, tmp_path):
  (tmp_path / "file").write_text("x")
  refused(run_config(world, tmp_path, **{"cache.path": str(tmp_path / "file")}),
          UserError, "cache.path", "is a file")
  c = run_config(world, tmp_path, workdir=str(tmp_path / "file"))
  with pytest.raises(UserError, match="workdir"):
    checks.check_inputs(c, Paths.from_config(c))


def test_missing_data_file(world, tmp_path):
  refused(run_config(world, tmp_path, **{"data.source": str(tmp_path / "nope.jsonl")}), Exception,
          "nope.jsonl")


def test_tokenizer_path_is_not_a_tokenizer(world, tmp_path):
  refused(run_config(world, tmp_path, **{"data.tokenizer": str(world / "train.jsonl")}),
          ValueError, "train.jsonl", "not a tokenizer")


def test_teacher_path_is_a_file_or_missing(world, tmp_path):
  refused(run_config(world, tmp_path, **{"teacher.hf_path": str(world / "teacher" /
                                                                "config.json")}),
          hf.CheckpointError, "is a file", "checkpoint directory")
  refused(run_config(world, tmp_path, **{"teacher.hf_path": str(tmp_path / "nowhere")}),
          hf.CheckpointError, "nowhere", "does not exist")


def test_teacher_checkpoint_without_its_tokenizer(world, tmp_path):
  refused(run_config(world, tmp_path, **{"data.tokenizer": ""}), ValueError,
          "data.tokenizer", str(world / "teacher"))


def test_student_vocabulary_other_than_the_teachers(world, tmp_path):
  refused(run_config(world, tmp_path, **{"student.vocab_size": 128256}), ValueError,
          "student.vocab_size", "128256", "300", "--config.student.vocab_size=0")


def test_student_checkpoint_with_another_tokenizer(world, tmp_path):
  refused(run_config(world, tmp_path, **{"student.hf_path": str(world / "student_other")}),
          Exception, "student_other", "tokenizer")


def test_no_tokenizer_and_no_data_stage(world, tmp_path):
  refused(run_config(world, tmp_path, **{"data.tokenizer": "", "teacher.hf_path": "",
                                         "stages": ("train",)}),
          UserError, "no tokenizer", "'data'")


def test_chat_data_with_a_tokenizer_without_template(world, tmp_path, smollm2_tokenizer):
  chat = tmp_path / "chat.jsonl"
  chat.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"},
                                           {"role": "assistant", "content": "Hello"}]}) + "\n")
  refused(run_config(world, tmp_path, **{"data.source": str(chat)}), ValueError,
          str(chat), "chat records", f"the tokenizer {world / 'tok'} has no chat template",
          "--config.data.tokenizer")
  refused(run_config(world, tmp_path, **{"data.source": str(chat), "data.tokenizer": "",
                                         "teacher.hf_path": ""}),
          ValueError, str(chat), "would train a tokenizer, which has no chat template")
  # The template of chat_template.jinja (transformers 5) counts; plain text needs none.
  with_template = run_config(world, tmp_path, **{
      "data.source": str(chat), "data.tokenizer": smollm2_tokenizer(tmp_path / "smollm2"),
      "teacher.hf_path": "", "stages": ("data",)})
  checks.check_inputs(with_template, Paths.from_config(with_template))
  good = run_config(world, tmp_path)
  checks.check_inputs(good, Paths.from_config(good))


def test_missing_eval_source(world, tmp_path):
  message = refused(run_config(world, tmp_path, **{"data.eval_source": str(tmp_path / "no.jsonl")}),
                    Exception, "no.jsonl", "data.eval_source")
  assert "\n" not in message
  c = run_config(world, tmp_path, **{"data.eval_source": str(world / "train.jsonl")})
  checks.check_inputs(c, Paths.from_config(c))
