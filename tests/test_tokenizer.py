"""Tokenizer: local BPE training, loading files and HF dirs, hash stability and mismatches."""
import dataclasses
import itertools
import json
import os

import pytest
import tokenizers

from kdjax import tokenizer
from kdjax.data import sources
from kdjax.errors import UserError


@pytest.fixture(scope="module")
def corpus():
  return [d.text for d in itertools.islice(sources.documents("stdlib", max_bytes=300_000), 1000)]


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
  path = str(tmp_path_factory.mktemp("tok") / "tokenizer.json")
  return tokenizer.train_bpe(iter(corpus), 512, path), path


def test_train_bpe_roundtrip_and_specials(trained, corpus):
  tok, path = trained
  assert os.path.exists(path)
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
  assert tokenizer.real_vocab_size(tok) == tok.vocab_size == 512
  text = max(corpus, key=len)[:5000]
  ids = tok.encode(text)
  assert tok.decode(ids) == text
  assert len(ids) < 0.7 * len(text.encode())  # 253 merges learned from code compress code
  odd = "déjà vu ✓ 🐍 \t\r\n\x00"
  assert tok.decode(tok.encode(odd)) == odd  # byte-level: every string round-trips
  assert tok.encode("<|eos|>") == [tok.eos_id]


def test_hash_stable_across_save_load_and_retraining(trained, corpus, tmp_path):
  tok, path = trained
  h = tokenizer.tokenizer_hash(tok)
  assert len(h) == 64
  assert tokenizer.tokenizer_hash(tokenizer.load(path)) == h
  assert tokenizer.tokenizer_hash(tok.hf) == h
  again = tokenizer.train_bpe(iter(corpus), 512, str(tmp_path / "again.json"))
  assert tokenizer.tokenizer_hash(again) == h
  # Padding/truncation settings do not change ids, so not the hash either.
  hf = tokenizers.Tokenizer.from_file(path)
  hf.enable_truncation(16)
  assert tokenizer.tokenizer_hash(hf) == h


def test_hash_detects_mismatches(trained, corpus, tmp_path):
  tok, path = trained
  h = tokenizer.tokenizer_hash(tok)
  smaller = tokenizer.train_bpe(iter(corpus), 400, str(tmp_path / "small.json"))
  other_data = tokenizer.train_bpe(iter(corpus[::-1][:5]), 512, str(tmp_path / "other.json"))
  added = tokenizers.Tokenizer.from_file(path)
  added.add_special_tokens(["<|extra|>"])
  with open(path) as f:
    spec = json.load(f)
  spec["normalizer"] = {"type": "NFKC"}
  normalized = tokenizers.Tokenizer.from_str(json.dumps(spec))
  hashes = {tokenizer.tokenizer_hash(t) for t in (smaller, other_data, added, normalized)}
  assert h not in hashes and len(hashes) == 4


def test_load_hf_checkpoint_dir(trained, tmp_path):
  tok, _ = trained
  hf = tokenizers.Tokenizer.from_str(tok.hf.to_str())
  hf.add_special_tokens(["<|begin_of_text|>", "<|eot_id|>"])
  hf.save(str(tmp_path / "tokenizer.json"))
  config = {"bos_token": {"content": "<|begin_of_text|>", "special": True},
            "eos_token": "<|eot_id|>", "pad_token": None,
            "chat_template": [{"name": "default", "template": "{{ messages }}"},
                              {"name": "tool_use", "template": "x"}]}
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  loaded = tokenizer.load(str(tmp_path))
  assert loaded.bos_token == "<|begin_of_text|>" and loaded.bos_id == 512
  assert loaded.eos_id == 513 and loaded.pad_id is None
  assert loaded.chat_template == "{{ messages }}"
  assert tokenizer.real_vocab_size(loaded) == 514


def test_save_as_dir_and_missing_path(trained, tmp_path):
  tok, _ = trained
  tokenizer.save(tok, str(tmp_path / "ckpt"))
  loaded = tokenizer.load(str(tmp_path / "ckpt"))
  assert (loaded.bos_token, loaded.eos_token, loaded.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
  assert tokenizer.tokenizer_hash(loaded) == tokenizer.tokenizer_hash(tok)
  with pytest.raises(UserError, match="tokenizer.json"):
    tokenizer.load(str(tmp_path / "nowhere"))


def test_load_names_what_is_wrong(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
  (tmp_path / "model.safetensors").write_bytes(bytes(range(256)))
  for name in ("config.json", "model.safetensors"):
    file = str(tmp_path / name)
    with pytest.raises(ValueError, match=f"{file} is not a tokenizer .*must be a directory "
                       "holding tokenizer.json, or a tokenizer.json file"):
      tokenizer.load(file)
  with pytest.raises(UserError, match=f"{tmp_path} has no tokenizer.json "
                     r"\(it holds \['config.json', 'model.safetensors'\]\)"):
    tokenizer.load(str(tmp_path))


def test_chat_template_beside_the_config(smollm2_tokenizer, smollm2_template, trained, tmp_path):
  """transformers 5 keeps the template in chat_template.jinja (tokenizer_config.json has none);
  the legacy chat_template.json is read too; save writes what load reads."""
  path = smollm2_tokenizer(tmp_path / "smollm2")
  tok = tokenizer.load(path)
  assert tok.chat_template == smollm2_template
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 2)
  tokenizer.save(tok, str(tmp_path / "saved"))
  assert sorted(os.listdir(tmp_path / "saved")) == ["chat_template.jinja", "tokenizer.json",
                                                    "tokenizer_config.json"]
  again = tokenizer.load(str(tmp_path / "saved"))
  assert again == dataclasses.replace(tok, hf=again.hf)
  os.remove(os.path.join(path, "chat_template.jinja"))
  assert tokenizer.load(path).chat_template is None
  (tmp_path / "smollm2" / "chat_template.json").write_text(
      json.dumps({"chat_template": smollm2_template}))
  assert tokenizer.load(path).chat_template == smollm2_template
  # A directory without tokenizer_config.json still has its template.
  bare = tmp_path / "bare"
  tokenizer.save(trained[0], str(bare / "tokenizer.json"))
  (bare / "chat_template.jinja").write_text("{{ messages }}")
  assert tokenizer.load(str(bare)).chat_template == "{{ messages }}"
  assert tokenizer.load(str(bare / "tokenizer.json")).chat_template is None


def test_document_separators(smollm2_tokenizer, trained, tmp_path):
  """An instruct tokenizer's bos/eos are chat markers: documents end with its end-of-text token,
  and get a bos only where the family expects one (Llama 3); the demo's BPE keeps its own."""
  smol = tokenizer.load(smollm2_tokenizer(tmp_path / "smollm2"))
  assert (smol.bos_token, smol.eos_token) == ("<|im_start|>", "<|im_end|>")
  assert (smol.document_bos, smol.document_eos, smol.document_eos_id) == (None, "<|endoftext|>", 0)
  demo = trained[0]
  assert (demo.document_bos_id, demo.document_eos_id) == (demo.bos_id, demo.eos_id) == (0, 1)
  hf = tokenizers.Tokenizer.from_str(demo.hf.to_str())
  hf.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"])
  llama3 = tokenizer.Tokenizer(hf, "<|begin_of_text|>", "<|eot_id|>", None)
  assert (llama3.document_bos, llama3.document_eos) == ("<|begin_of_text|>", "<|end_of_text|>")
  base = tokenizer.Tokenizer(hf, "<|begin_of_text|>", "<|end_of_text|>", None)
  assert base.document_eos == "<|end_of_text|>"
  # No end-of-text token among the special tokens: the configured eos; an ordinary token that
  # spells one does not count.
  plain = tokenizers.Tokenizer(tokenizers.models.BPE({"a": 0, "b": 1}, []))
  plain.add_tokens(["</s>"])
  plain.add_special_tokens(["<|end|>"])
  assert tokenizer.Tokenizer(plain, None, "<|end|>", None).document_eos == "<|end|>"
