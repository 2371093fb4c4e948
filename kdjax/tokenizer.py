"""Tokenizers: train a byte-level BPE locally, load HF tokenizers, hash them.

A `Tokenizer` wraps a Hugging Face `tokenizers.Tokenizer` with what the data stage needs beside
it: the bos/eos/pad ids of `tokenizer_config.json`, the tokens that separate plain-text
documents (`document_bos` / `document_eos`: not always the configured bos/eos) and the chat
template (in that file, or, as transformers 5 writes it, in `chat_template.jinja` beside it).
Teacher and student must share one tokenizer; `tokenizer_hash` is what the stores record and check.
"""
import dataclasses
import hashlib
import json
import os
from collections.abc import Iterable

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from kdjax.cache import durable
from kdjax.errors import UserError

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
# Document separators. A plain-text document ends with the vocabulary's dedicated end-of-text
# token: the configured eos when it is one of these, else the first of these that the tokenizer
# holds as a special token (instruct tokenizers configure a chat marker as eos: <|im_end|>,
# <|eot_id|>); else the configured eos. Checked against special tokens only, so a merged BPE
# token spelling "</s>" never counts.
END_OF_TEXT = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", EOS)
# A document starts with the configured bos only when it is one of these: the begin-of-text
# tokens of families that put one before every document (Llama 3, Llama 2 / Mistral, Gemma, this
# project's BPE). A bos configured as anything else (SmolLM2-Instruct's <|im_start|>, a ChatML
# marker) is not added, and families without a bos (Qwen, GPT-2 style) get none.
BEGIN_OF_TEXT = ("<|begin_of_text|>", "<s>", "<bos>", BOS)
# Files beside tokenizer_config.json that hold a chat template: transformers 5's, the legacy one.
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


@dataclasses.dataclass(frozen=True)
class Tokenizer:
  """A HF tokenizer plus the special tokens and chat template of its config."""
  hf: tokenizers.Tokenizer
  bos_token: str | None
  eos_token: str | None
  pad_token: str | None
  chat_template: str | None = None

  @property
  def bos_id(self) -> int | None:
    return _token_id(self.hf, self.bos_token)

  @property
  def eos_id(self) -> int | None:
    return _token_id(self.hf, self.eos_token)

  @property
  def pad_id(self) -> int | None:
    return _token_id(self.hf, self.pad_token)

  @property
  def document_bos(self) -> str | None:
    """Prepended to each plain-text document by packing (see BEGIN_OF_TEXT), or None."""
    return self.bos_token if self.bos_token in BEGIN_OF_TEXT else None

  @property
  def document_eos(self) -> str | None:
    """Appended to each plain-text document by packing (see END_OF_TEXT), or None."""
    special = {t.content for t in self.hf.get_added_tokens_decoder().values() if t.special}
    if self.eos_token in END_OF_TEXT and self.eos_token in special:
      return self.eos_token
    return next((t for t in END_OF_TEXT if t in special), self.eos_token)

  @property
  def document_bos_id(self) -> int | None:
    return _token_id(self.hf, self.document_bos)

  @property
  def document_eos_id(self) -> int | None:
    return _token_id(self.hf, self.document_eos)

  @property
  def vocab_size(self) -> int:
    return real_vocab_size(self)

  def encode(self, text: str) -> list[int]:
    # Special tokens are never added here: documents get document_bos/eos in packing, chat
    # templates write their own.
    return self.hf.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Iterable[int]) -> str:
    return self.hf.decode(list(ids), skip_special_tokens=False)


def _token_id(hf: tokenizers.Tokenizer, token: str | None) -> int | None:
  if token is None:
    return None
  token_id = hf.token_to_id(token)
  if token_id is None:
    raise UserError(f"special token {token!r} is not in the tokenizer's vocabulary")
  return token_id


def train_bpe(texts: Iterable[str], vocab_size: int, path: str) -> Tokenizer:
  """Trains a byte-level BPE on `texts` and writes it to `path`.

  Args:
    texts: an iterable of documents, consumed once (a generator is fine).
    vocab_size: the total vocabulary, including the 256 byte tokens and the special tokens
      <|bos|>, <|eos|>, <|pad|> (ids 0, 1, 2).
    path: a `tokenizer.json` file, or a directory that receives `tokenizer.json` and a
      `tokenizer_config.json` naming the special tokens (a HF checkpoint layout).

  Returns:
    The trained tokenizer.
  """
  hf = tokenizers.Tokenizer(models.BPE())
  # GPT-2 style: bytes are the alphabet, so every string encodes without an unknown token.
  hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  hf.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size,
      special_tokens=[BOS, EOS, PAD],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False)
  hf.train_from_iterator(texts, trainer=trainer)
  tok = Tokenizer(hf, BOS, EOS, PAD)
  save(tok, path)
  return tok


def save(tok: Tokenizer, path: str) -> None:
  """Writes `tokenizer.json` (a file path: no config, no template), or a checkpoint-style
  directory, atomically: tokenizer.json, tokenizer_config.json and, when the tokenizer has one,
  chat_template.jinja (transformers 5's layout; `load` reads it back)."""
  if path.endswith(".json"):
    _write_atomic(path, tok.hf.to_str(pretty=True))
    return
  os.makedirs(path, exist_ok=True)
  _write_atomic(os.path.join(path, "tokenizer.json"), tok.hf.to_str(pretty=True))
  config = {"bos_token": tok.bos_token, "eos_token": tok.eos_token, "pad_token": tok.pad_token}
  _write_atomic(os.path.join(path, "tokenizer_config.json"), json.dumps(config, indent=2))
  if tok.chat_template is not None:
    _write_atomic(os.path.join(path, TEMPLATE_FILES[0]), tok.chat_template)


def _write_atomic(path: str, text: str) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  durable.write_text(path, text)


def load(path: str) -> Tokenizer:
  """Loads a `tokenizer.json` file or a HF checkpoint directory.

  A directory must hold `tokenizer.json`; its `tokenizer_config.json`, when present, gives the
  bos/eos/pad tokens (else <|bos|>/<|eos|>/<|pad|> where the vocabulary has them, as for a bare
  file). Its chat template is read as transformers reads it: `chat_template.jinja` (transformers 5
  writes it and leaves tokenizer_config.json without one), else tokenizer_config.json's
  `chat_template`, else the legacy `chat_template.json`. A bare file has no template.
  """
  if os.path.isdir(path):
    file = os.path.join(path, "tokenizer.json")
    config_file = os.path.join(path, "tokenizer_config.json")
    if not os.path.exists(file):
      raise UserError(
          f"{path} has no tokenizer.json (it holds {sorted(os.listdir(path))}); for a checkpoint "
          "with only a slow tokenizer (tokenizer.model), transformers' "
          "AutoTokenizer.from_pretrained(dir).save_pretrained(dir) writes one")
  else:
    file, config_file = path, None
  if not os.path.exists(file):
    raise UserError(
        f"no tokenizer at {file}: give a tokenizer.json or a HF checkpoint directory holding one")
  try:
    hf = tokenizers.Tokenizer.from_file(file)
  except Exception as e:  # tokenizers raises a bare Exception that names no file
    raise UserError(
        f"{file} is not a tokenizer ({e}): a tokenizer path must be a directory holding "
        "tokenizer.json, or a tokenizer.json file, as written by Hugging Face tokenizers") from e
  if config_file is None:
    config, template = None, None
  else:
    config = None
    if os.path.exists(config_file):
      with open(config_file, encoding="utf-8") as f:
        config = json.load(f)
    template = _template(path, config or {})
  if config is not None:
    return Tokenizer(hf, _token_name(config.get("bos_token")), _token_name(config.get("eos_token")),
                     _token_name(config.get("pad_token")), template)
  vocab = hf.get_vocab(with_added_tokens=True)
  bos, eos, pad = (t if t in vocab else None for t in (BOS, EOS, PAD))
  return Tokenizer(hf, bos, eos, pad, template)


def _token_name(token) -> str | None:
  # tokenizer_config.json writes special tokens as strings or as AddedToken dicts.
  if isinstance(token, dict):
    return token["content"]
  return token


def _chat_template(config: dict) -> str | None:
  template = config.get("chat_template")
  if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
    named = {t["name"]: t["template"] for t in template}
    template = named.get("default")
  return template


def _template(directory: str, config: dict) -> str | None:
  """A checkpoint directory's chat template, from wherever transformers would read it, or None.
  config: its tokenizer_config.json ({} when it has none)."""
  jinja, legacy = (os.path.join(directory, name) for name in TEMPLATE_FILES)
  if os.path.exists(jinja):  # transformers: a template file overrides tokenizer_config.json's
    with open(jinja, encoding="utf-8") as f:
      return f.read()
  if _chat_template(config) is not None:
    return _chat_template(config)
  if os.path.exists(legacy):  # {"chat_template": "..."}, as processors wrote it
    with open(legacy, encoding="utf-8") as f:
      try:
        return _chat_template(json.load(f))
      except (ValueError, AttributeError, KeyError, TypeError) as e:
        raise UserError(f"{legacy} is not a chat template file ({e}): it must hold "
                        '{"chat_template": "<jinja2 template>"}') from e
  return None


def tokenizer_hash(tok: Tokenizer | tokenizers.Tokenizer) -> str:
  """sha256 of what decides ids: normalizer, pre-tokenizer, model (vocab, merges), added tokens.

  Runtime settings (padding, truncation), the post-processor and the decoder do not change the
  ids this project stores, so they are left out: a teacher and student checkpoint that differ
  only there share a hash.
  """
  hf = tok.hf if isinstance(tok, Tokenizer) else tok
  spec = json.loads(hf.to_str())
  model = dict(spec["model"])
  if "merges" in model:  # older files write merges as "a b" strings, newer ones as pairs
    model["merges"] = [m.split(" ", 1) if isinstance(m, str) else list(m) for m in model["merges"]]
  added = sorted((t["id"], t["content"], t["special"]) for t in spec.get("added_tokens", []))
  canonical = {"normalizer": spec.get("normalizer"), "pre_tokenizer": spec.get("pre_tokenizer"),
               "model": model, "added_tokens": added}
  text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
  return hashlib.sha256(text.encode("utf-8")).hexdigest()


def real_vocab_size(tok: Tokenizer | tokenizers.Tokenizer) -> int:
  """Largest token id + 1, added tokens included (models may pad their vocab beyond it)."""
  hf = tok.hf if isinstance(tok, Tokenizer) else tok
  return max(hf.get_vocab(with_added_tokens=True).values()) + 1
