"""Hugging Face checkpoint handling without transformers: kdjax round trips, layouts, bad input."""
import dataclasses
import json
import os
import re
import tracemalloc

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from kdjax.models import hf
from kdjax.models.llama import ModelConfig, Transformer

SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=64)


def make_cfg(**overrides) -> ModelConfig:
  base = dict(vocab_size=70, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
              d_ff=24, rope_theta=500000.0, rope_scaling=SCALING, norm_eps=1e-5,
              tie_embeddings=False, qk_norm=False)
  base.update(overrides)
  return ModelConfig(**base)


def params(model) -> dict:
  return {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def write(tmp_path, cfg, **export_kwargs) -> str:
  out = str(tmp_path / "ckpt")
  hf.export(Transformer(cfg, rngs=nnx.Rngs(0)), cfg, out, **export_kwargs)
  return out


@pytest.mark.parametrize("cfg", [
    make_cfg(),
    make_cfg(tie_embeddings=True, rope_scaling=None, d_ff=16),  # square MLP weights
    make_cfg(qk_norm=True, tie_embeddings=True, rope_scaling=None, head_dim=12),
], ids=["llama3_untied", "llama_tied", "qwen3"])
def test_export_load_round_trip(tmp_path, cfg):
  model = Transformer(cfg, rngs=nnx.Rngs(1))
  hf.export(model, cfg, str(tmp_path))
  loaded, loaded_cfg = hf.load(str(tmp_path))
  assert loaded_cfg == cfg
  original = params(model)
  for key, value in params(loaded).items():
    np.testing.assert_array_equal(value, original[key])


def test_bfloat16_and_sharded_export(tmp_path, monkeypatch):
  cfg = make_cfg(qk_norm=True, rope_scaling=None)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  monkeypatch.setattr(hf, "_SHARD_BYTES", 4000)
  hf.export(model, cfg, str(tmp_path), dtype="bfloat16")
  index = json.load(open(tmp_path / "model.safetensors.index.json"))
  assert len(set(index["weight_map"].values())) > 2
  assert json.load(open(tmp_path / "config.json"))["torch_dtype"] == "bfloat16"
  loaded, loaded_cfg = hf.load(str(tmp_path), dtype="bfloat16")
  assert loaded_cfg.param_dtype == "bfloat16" and loaded.embed_VxD.dtype == jax.numpy.bfloat16
  np.testing.assert_array_equal(np.asarray(loaded.embed_VxD[...]),
                                np.asarray(model.embed_VxD[...].astype(jax.numpy.bfloat16)))


def write_word_tokenizer(path, words: int, special: list[str]):
  """A real tokenizer.json: `words` words (ids 0..words-1), then the special tokens."""
  import tokenizers
  vocab = {f"w{i}": i for i in range(words)}
  hf_tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
  hf_tok.add_special_tokens(special)
  hf_tok.save(os.path.join(path, "tokenizer.json"))


def test_config_layouts_and_real_vocab(tmp_path):
  path = write(tmp_path, make_cfg())
  config = json.load(open(os.path.join(path, "config.json")))
  assert hf.config_from_hf(path).rope_scaling == SCALING  # rope_theta + rope_scaling (< 5)
  # transformers >= 5 layout: rope_parameters holding theta and the scaling.
  config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 1234.0,
                               **config.pop("rope_scaling")}
  del config["rope_theta"]
  json.dump(config, open(os.path.join(path, "config.json"), "w"))
  cfg = hf.config_from_hf(path)
  assert cfg.rope_theta == 1234.0 and cfg.rope_scaling == SCALING
  # tokenizer.json defining 60 of the 70 rows: the rest is padding, cut from lm_head.
  write_word_tokenizer(path, words=58, special=["<a>", "<b>"])
  model, cfg = hf.load(path)
  assert cfg.real_vocab_size == 60 and model.lm_head_DxV().shape == (16, 60)
  assert hf.config_from_hf(path, tokenizer_vocab=60).real_vocab_size == 60
  with pytest.raises(hf.CheckpointError, match="use the checkpoint's own tokenizer"):
    hf.config_from_hf(path, tokenizer_vocab=61)
  os.remove(os.path.join(path, "tokenizer.json"))
  assert hf.config_from_hf(path).real_vocab_size is None
  # How the model runs (ModelConfig.RUNTIME) comes from the run's config group, not config.json
  runtime = dict(remat="none", attention_impl="einsum", mlp_impl="xla")
  cfg = hf.config_from_hf(path, dtype="bfloat16", **runtime)
  assert {name: getattr(cfg, name) for name in runtime} == runtime
  with pytest.raises(hf.CheckpointError, match="mlp_impl 'pallas' needs d_model % 64"):
    hf.config_from_hf(path, dtype="bfloat16", mlp_impl="pallas")  # d_ff 24
  with pytest.raises(TypeError, match="not among the fields"):
    hf.config_from_hf(path, rope_theta=1.0)
  assert hf.config_from_hf(path, tokenizer_vocab=65).real_vocab_size == 65
  with pytest.raises(hf.CheckpointError, match="more than the checkpoint's 70"):
    hf.config_from_hf(path, tokenizer_vocab=71)
  write_word_tokenizer(path, words=74, special=["<a>", "<b>"])  # 76 tokens, 70 rows
  with pytest.raises(hf.CheckpointError, match="do not belong together"):
    hf.load(path)


def test_loads_one_tensor_at_a_time(tmp_path):
  # Host allocations (numpy, traced) stay near one tensor, far below the whole model.
  cfg = make_cfg(vocab_size=4096, d_model=64, n_layers=4, d_ff=128, n_heads=4, head_dim=16)
  path = write(tmp_path, cfg)
  total = os.path.getsize(os.path.join(path, "model.safetensors"))
  largest = cfg.vocab_size * cfg.d_model * 4
  tracemalloc.start()
  hf.load(path)
  peak = tracemalloc.get_traced_memory()[1]
  tracemalloc.stop()
  assert total > 2.5 * largest and peak < 1.5 * largest


def edit_config(path, **changes):
  config = json.load(open(os.path.join(path, "config.json")))
  config.update(changes)
  json.dump(config, open(os.path.join(path, "config.json"), "w"))


@pytest.mark.parametrize("changes,message", [
    (dict(model_type="mistral", architectures=["MistralForCausalLM"]),
     "MistralForCausalLM .* not supported; kdjax loads LlamaForCausalLM .*Qwen3ForCausalLM"),
    (dict(model_type="qwen2"), "not supported"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(rope_scaling={"rope_type": "longrope", "factor": 4.0}), "'longrope' is not supported"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "yarn rope needs factor and orig"),
    (dict(num_key_value_heads=3), "multiple of n_kv_heads"),
])
def test_bad_configs(tmp_path, changes, message):
  path = write(tmp_path, make_cfg())
  edit_config(path, **changes)
  with pytest.raises(ValueError, match=message):
    hf.load(path)


def test_bad_weights(tmp_path, monkeypatch):
  cfg = make_cfg()
  path = write(tmp_path, cfg)
  file = os.path.join(path, "model.safetensors")
  tensors = load_file(file)

  def rewrite(**changed):
    save_file({**tensors, **changed}, file, metadata={"format": "pt"})

  rewrite(**{"model.layers.0.self_attn.q_proj.bias": np.zeros(32, np.float32)})
  with pytest.raises(hf.CheckpointError, match="q_proj.bias.*biases"):
    hf.load(path)
  rewrite(**{"model.norm.weight": np.zeros(16, np.int8)})
  with pytest.raises(hf.CheckpointError, match="model.norm.weight is stored as I8"):
    hf.load(path)
  rewrite(**{"model.norm.weight": np.zeros(15, np.float32)})
  with pytest.raises(hf.CheckpointError, match=r"has shape \(15,\), config.json implies \(16,\)"):
    hf.load(path)
  save_file({k: v for k, v in tensors.items() if k != "lm_head.weight"}, file)
  with pytest.raises(hf.CheckpointError, match="lm_head.weight"):
    hf.load(path)
  rewrite(**{"model.norm.weight": tensors["model.norm.weight"].astype(np.float16)})
  hf.load(path)  # float16 is cast, not refused
  os.rename(file, os.path.join(path, "pytorch_model.bin"))
  with pytest.raises(hf.CheckpointError, match="safetensors only"):
    hf.load(path)
  os.remove(os.path.join(path, "config.json"))
  with pytest.raises(hf.CheckpointError, match="config.json"):
    hf.load(path)


def test_bad_shards(tmp_path, monkeypatch):
  monkeypatch.setattr(hf, "_SHARD_BYTES", 3000)
  path = write(tmp_path, make_cfg())
  index_file = os.path.join(path, "model.safetensors.index.json")
  index = json.load(open(index_file))
  files = sorted(set(index["weight_map"].values()))
  # An index pointing a tensor at the wrong shard.
  wrong = dict(index["weight_map"], **{"model.norm.weight": files[0]})
  json.dump({"weight_map": wrong}, open(index_file, "w"))
  with pytest.raises(hf.CheckpointError, match="model.norm.weight in .* inconsistent"):
    hf.load(path)
  json.dump(index, open(index_file, "w"))
  os.remove(os.path.join(path, files[1]))
  with pytest.raises(hf.CheckpointError, match=f"shards .*{files[1]}.* missing"):
    hf.load(path)


def test_export_over_previous_export_with_tokenizer(tmp_path, monkeypatch):
  src = tmp_path / "src"
  src.mkdir()
  for name in ("tokenizer_config.json", "unrelated.txt"):
    (src / name).write_text("{}")
  (src / "config.json").write_text(json.dumps({"eos_token_id": 7, "max_position_embeddings": 99,
                                               "hidden_size": 1}))
  cfg = dataclasses.replace(make_cfg(), dtype="bfloat16")
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  out = tmp_path / "out"
  monkeypatch.setattr(hf, "_SHARD_BYTES", 3000)
  hf.export(model, cfg, str(out))
  monkeypatch.setattr(hf, "_SHARD_BYTES", 1 << 30)
  hf.export(model, cfg, str(out), tokenizer_dir=str(src))  # the old shards and index go
  assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer_config.json"]
  config = json.load(open(out / "config.json"))
  assert (config["eos_token_id"], config["max_position_embeddings"]) == (7, 99)
  assert config["hidden_size"] == 16
  assert hf.load(str(out), dtype="bfloat16", param_dtype="float32")[1] == cfg


def test_path_is_a_file_or_missing(tmp_path):
  path = write(tmp_path, make_cfg())
  for name in ("config.json", "model.safetensors"):
    file = os.path.join(path, name)
    for read in (hf.load, hf.config_from_hf):
      with pytest.raises(hf.CheckpointError, match=f"{re.escape(file)} is a file; hf_path must be "
                         r"the checkpoint directory \(the one holding config.json"):
        read(file)
  missing = str(tmp_path / "nowhere")
  with pytest.raises(hf.CheckpointError, match=f"{re.escape(missing)} does not exist; hf_path "
                     "must be a Hugging Face checkpoint directory"):
    hf.load(missing)


def test_export_writes_integer_fields_as_ints(tmp_path):
  # ModelConfig holds rope_scaling values as floats; transformers wants this one as an int.
  cfg = make_cfg(vocab_size=np.int64(70))
  config = json.load(open(os.path.join(write(tmp_path, cfg), "config.json")))
  ints = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings")
  assert all(type(config[k]) is int for k in ints)
  assert type(config["rope_scaling"]["original_max_position_embeddings"]) is int
  assert hf.config_from_hf(os.path.join(tmp_path, "ckpt")) == cfg


def test_sharded_load_shows_progress(tmp_path, monkeypatch, capsys):
  path = write(tmp_path, make_cfg())
  hf.load(path)
  assert "loading ckpt" not in capsys.readouterr().err  # one file: no bar
  monkeypatch.setattr(hf, "_SHARD_BYTES", 3000)
  path = write(tmp_path, make_cfg())
  hf.load(path)
  assert "loading ckpt" in capsys.readouterr().err


@pytest.mark.parametrize("changes,differ", [
    (dict(sliding_window=4), "sliding_window"),  # a Llama has none
    (dict(n_experts=4, experts_per_token=2), "qk_norm"),  # Qwen3-MoE's experts come with it
])
def test_export_refuses_models_no_family_has(tmp_path, changes, differ):
  cfg = make_cfg(**changes)
  with pytest.raises(ValueError, match=f"no Hugging Face family kdjax writes.*{differ}"):
    hf.export(Transformer(cfg, rngs=nnx.Rngs(0)), cfg, str(tmp_path))
