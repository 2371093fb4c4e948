"""Hugging Face checkpoint directories in and out: Llama 3.x and Qwen3 (dense).

    model, cfg = hf.load(path, dtype="bfloat16")     # config.json + *.safetensors (+ index)
    hf.export(model, cfg, out_dir, tokenizer_dir=path)  # transformers.AutoModelForCausalLM loads it

Loading reads one tensor at a time from memory-mapped safetensors files and places it on the
device before reading the next, so host memory never holds a second copy of the model.
Hugging Face stores linear weights as [out, in]; kdjax keeps [in, ...out] (see llama.py).
Shape letters as in kdjax/models/llama.py.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file
from tqdm import tqdm

from kdjax import tokenizer
from kdjax.models.llama import ModelConfig, Transformer

SUPPORTED = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# Dtypes a checkpoint may store; quantised formats (int8, fp8, ...) are refused by name.
_FLOAT_TYPES = ("F32", "BF16", "F16")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json",
                   "merges.txt", "added_tokens.json", "generation_config.json")
_SHARD_BYTES = 4 << 30
# Fields export() takes from the source checkpoint's config.json: they describe the tokenizer
# and serving limits, which ModelConfig does not hold.
_SOURCE_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings")
_DEFAULT_MAX_POSITIONS = 8192


class CheckpointError(ValueError):
  """A checkpoint directory kdjax cannot use; the message says why and what to do."""


def _read_json(path: str) -> dict:
  try:
    with open(path) as f:
      return json.load(f)
  except FileNotFoundError:
    raise CheckpointError(f"{path} not found: a Hugging Face checkpoint directory needs "
                          "config.json next to its *.safetensors files.") from None


def _check_dir(path: str) -> None:
  # Without this, a file path fails deep inside as "Not a directory: .../config.json".
  if os.path.isfile(path):
    raise CheckpointError(f"{path} is a file; hf_path must be the checkpoint directory (the one "
                          f"holding config.json and *.safetensors), here "
                          f"{os.path.dirname(os.path.abspath(path))}.")
  if not os.path.exists(path):
    raise CheckpointError(f"{path} does not exist; hf_path must be a Hugging Face checkpoint "
                          "directory holding config.json and *.safetensors.")


def real_vocab_size(path: str) -> int | None:
  """Tokens the checkpoint's tokenizer.json defines (largest id + 1), or None without one."""
  if not os.path.exists(os.path.join(path, "tokenizer.json")):
    return None
  return tokenizer.load(path).vocab_size


def _rope(hf: dict) -> tuple[float, dict | None]:
  # transformers >= 5 writes rope_parameters (theta inside); older configs rope_theta/rope_scaling.
  params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
  kind = params.get("rope_type", params.get("type", "default"))
  if kind == "default":
    return float(theta), None
  if kind != "llama3":
    raise CheckpointError(f"rope type {kind!r} is not supported; kdjax supports default RoPE and "
                          "llama3 scaling.")
  return float(theta), {k: params[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                               "original_max_position_embeddings")}


def config_from_hf(path: str, *, dtype: str = "float32", param_dtype: str | None = None,
                   remat: bool = True, tokenizer_vocab: int | None = None) -> ModelConfig:
  """ModelConfig from a checkpoint's config.json (+ tokenizer.json for the real vocabulary).

  tokenizer_vocab: the run's tokenizer size, when known; it must match the checkpoint's
  tokenizer.json if there is one, and sets real_vocab_size where there is none.
  """
  _check_dir(path)
  hf = _read_json(os.path.join(path, "config.json"))
  model_type = hf.get("model_type")
  if model_type not in SUPPORTED:
    arch = hf.get("architectures") or ["?"]
    raise CheckpointError(
        f"{path}: architecture {arch[0]} (model_type {model_type!r}) is not supported; kdjax loads "
        + ", ".join(f"{a} (model_type {t!r})" for t, a in SUPPORTED.items()) + ".")
  unsupported = {k: hf[k] for k in ("attention_bias", "mlp_bias", "use_sliding_window")
                 if hf.get(k)}
  if hf.get("hidden_act", "silu") != "silu":
    unsupported["hidden_act"] = hf["hidden_act"]
  if unsupported:
    raise CheckpointError(f"{path}: config.json sets {unsupported}; kdjax's Llama/Qwen3 has no "
                          "attention/MLP biases, no sliding window and uses SiLU.")
  n_heads = hf["num_attention_heads"]
  theta, scaling = _rope(hf)
  vocab = hf["vocab_size"]
  real = real_vocab_size(path)
  if real is not None and real > vocab:
    raise CheckpointError(f"{path}: tokenizer.json has {real} tokens but the embedding table only "
                          f"{vocab} rows; tokenizer and weights do not belong together.")
  if tokenizer_vocab is not None:
    if real is not None and real != tokenizer_vocab:
      raise CheckpointError(f"{path}: its tokenizer.json has {real} tokens, the run's tokenizer "
                            f"{tokenizer_vocab}; use the checkpoint's own tokenizer.")
    if tokenizer_vocab > vocab:
      raise CheckpointError(f"{path}: the run's tokenizer has {tokenizer_vocab} tokens, more "
                            f"than the checkpoint's {vocab} embedding rows.")
    real = tokenizer_vocab
  cfg = ModelConfig(
      vocab_size=vocab, d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
      n_heads=n_heads, n_kv_heads=hf.get("num_key_value_heads") or n_heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
      d_ff=hf["intermediate_size"], rope_theta=theta, rope_scaling=scaling,
      norm_eps=hf["rms_norm_eps"], tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      qk_norm=model_type == "qwen3", dtype=dtype, param_dtype=param_dtype or dtype,
      real_vocab_size=None if real in (None, vocab) else real, remat=remat)
  return cfg.validate()


def _hf_names(cfg: ModelConfig) -> Iterator[tuple[str, tuple, str, tuple]]:
  """(HF tensor name, HF shape, kdjax param path, kdjax shape) for every parameter."""
  d, h, g, e, f, v = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff,
                      cfg.vocab_size)
  yield "model.embed_tokens.weight", (v, d), ("embed_VxD",), (v, d)
  for i in range(cfg.n_layers):
    p, k = f"model.layers.{i}.", ("layers", i)
    yield p + "input_layernorm.weight", (d,), k + ("attn_norm_D",), (d,)
    yield p + "self_attn.q_proj.weight", (h * e, d), k + ("wq_DxHxE",), (d, h, e)
    yield p + "self_attn.k_proj.weight", (g * e, d), k + ("wk_DxGxE",), (d, g, e)
    yield p + "self_attn.v_proj.weight", (g * e, d), k + ("wv_DxGxE",), (d, g, e)
    yield p + "self_attn.o_proj.weight", (d, h * e), k + ("wo_HxExD",), (h, e, d)
    if cfg.qk_norm:
      yield p + "self_attn.q_norm.weight", (e,), k + ("q_norm_E",), (e,)
      yield p + "self_attn.k_norm.weight", (e,), k + ("k_norm_E",), (e,)
    yield p + "post_attention_layernorm.weight", (d,), k + ("mlp_norm_D",), (d,)
    yield p + "mlp.gate_proj.weight", (f, d), k + ("w_gate_DxF",), (d, f)
    yield p + "mlp.up_proj.weight", (f, d), k + ("w_up_DxF",), (d, f)
    yield p + "mlp.down_proj.weight", (d, f), k + ("w_down_FxD",), (f, d)
  yield "model.norm.weight", (d,), ("final_norm_D",), (d,)
  if not cfg.tie_embeddings:
    yield "lm_head.weight", (v, d), ("unembed_DxV",), (d, v)


def _is_linear(name: str) -> bool:
  # nn.Linear weights are [out, in]; the embedding table and norm scales keep their layout.
  return name.endswith("proj.weight") or name == "lm_head.weight"


def _to_kdjax(name: str, w: jax.Array, shape: tuple) -> jax.Array:
  return w.T.reshape(shape) if _is_linear(name) else w


def _from_kdjax(name: str, w: jax.Array, hf_shape: tuple) -> jax.Array:
  return w.reshape(hf_shape[1], hf_shape[0]).T if _is_linear(name) else w


def _weight_files(path: str) -> dict[str, str]:
  """Tensor name -> safetensors file, checking the index against the files on disk."""
  index_path = os.path.join(path, "model.safetensors.index.json")
  if os.path.exists(index_path):
    weight_map = _read_json(index_path).get("weight_map")
    if not weight_map:
      raise CheckpointError(f"{index_path} has no weight_map.")
    missing = sorted({f for f in weight_map.values() if not os.path.exists(os.path.join(path, f))})
    if missing:
      raise CheckpointError(f"{path}: shards {missing} named in model.safetensors.index.json are "
                            "missing; copy the complete checkpoint.")
    return weight_map
  single = os.path.join(path, "model.safetensors")
  if not os.path.exists(single):
    present = sorted(os.listdir(path)) if os.path.isdir(path) else "no such directory"
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json "
                          f"(found: {present}). kdjax reads safetensors only; convert *.bin "
                          "checkpoints with transformers' save_pretrained.")
  with safe_open(single, "np") as f:
    return {name: "model.safetensors" for name in f.keys()}


def load(path: str, *, dtype: str = "float32", param_dtype: str | None = None,
         remat: bool = True, tokenizer_vocab: int | None = None) -> tuple[Transformer, ModelConfig]:
  """Loads a Hugging Face Llama 3.x / Qwen3 checkpoint directory into a Transformer.

  Args:
    path: directory with config.json and model.safetensors (or shards + index); tokenizer.json,
      when present, sets cfg.real_vocab_size (padding rows of the embedding are excluded from
      lm_head_DxV()).
    dtype: compute dtype, "float32" or "bfloat16".
    param_dtype: parameter dtype; defaults to dtype. Stored tensors are cast to it.
    remat: recompute each block in the backward pass (ModelConfig.remat).
    tokenizer_vocab: the run's tokenizer size, if known: checked against the checkpoint's
      tokenizer.json, and used as real_vocab_size when the directory has none.
  Returns:
    (model, cfg). Raises CheckpointError for a path that is a file or missing, unsupported
    architectures, missing or inconsistent shards, missing/unexpected tensors, wrong shapes, or
    non-float (quantised) tensors.
  """
  cfg = config_from_hf(path, dtype=dtype, param_dtype=param_dtype, remat=remat,
                       tokenizer_vocab=tokenizer_vocab)
  weight_map = _weight_files(path)
  wanted = list(_hf_names(cfg))
  missing = [name for name, *_ in wanted if name not in weight_map]
  if missing:
    raise CheckpointError(f"{path}: {len(missing)} tensors missing from the checkpoint, e.g. "
                          f"{missing[:3]}; config.json and the weights disagree.")
  # A tied checkpoint may still store lm_head.weight (a copy of the embedding); ignore it.
  known = {name for name, *_ in wanted} | {"lm_head.weight"}
  unexpected = sorted(n for n in weight_map if n not in known and "rotary_emb" not in n)
  if unexpected:
    arch = SUPPORTED["qwen3" if cfg.qk_norm else "llama"]
    raise CheckpointError(f"{path}: tensors a {arch} does not have, e.g. {unexpected[:3]}; is "
                          "this a variant with biases or extra modules?")
  # Build the module without allocating its random initial weights, then fill it.
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  by_file: dict[str, list] = {}
  for entry in wanted:
    by_file.setdefault(weight_map[entry[0]], []).append(entry)
  target = jnp.dtype(cfg.param_dtype)
  # A bar for sharded checkpoints only, as transformers does: those are the ones that take minutes.
  with tqdm(total=len(wanted), desc=f"loading {os.path.basename(os.path.normpath(path))}",
            unit="tensor", leave=False, disable=len(by_file) == 1) as bar:
    for file, entries in sorted(by_file.items()):
      with safe_open(os.path.join(path, file), "np") as f:
        names = set(f.keys())
        for name, hf_shape, kd_path, kd_shape in entries:
          if name not in names:
            raise CheckpointError(f"{path}: the index puts {name} in {file}, which lacks it; "
                                  "the shards and index are inconsistent.")
          sl = f.get_slice(name)
          if sl.get_dtype() not in _FLOAT_TYPES:
            raise CheckpointError(f"{path}: {name} is stored as {sl.get_dtype()}; kdjax loads "
                                  f"{_FLOAT_TYPES} checkpoints only (dequantise first).")
          if tuple(sl.get_shape()) != hf_shape:
            raise CheckpointError(f"{path}: {name} has shape {tuple(sl.get_shape())}, "
                                  f"config.json implies {hf_shape}.")
          # One tensor on the host at a time; layout change and cast happen on the device.
          w = _to_kdjax(name, jnp.asarray(f.get_tensor(name)).astype(target), kd_shape)
          var = model
          for key in kd_path:
            var = var[key] if isinstance(key, int) else getattr(var, key)
          var.set_value(w)
          bar.update()
  return model, cfg


def hf_config(cfg: ModelConfig, *, torch_dtype: str) -> dict:
  """config.json contents for a ModelConfig (rope keys in the pre-5 layout, read by all).

  Fields HF types as int are written as ints: ModelConfig keeps rope_scaling values as floats,
  and transformers warns on every load about a float original_max_position_embeddings; shape
  fields may be numpy integers, which json cannot write.
  """
  model_type = "qwen3" if cfg.qk_norm else "llama"
  out = {
      "architectures": [SUPPORTED[model_type]], "model_type": model_type,
      "vocab_size": int(cfg.vocab_size), "hidden_size": int(cfg.d_model),
      "num_hidden_layers": int(cfg.n_layers), "num_attention_heads": int(cfg.n_heads),
      "num_key_value_heads": int(cfg.n_kv_heads), "head_dim": int(cfg.head_dim),
      "intermediate_size": int(cfg.d_ff), "rms_norm_eps": float(cfg.norm_eps),
      "hidden_act": "silu", "rope_theta": float(cfg.rope_theta),
      "tie_word_embeddings": bool(cfg.tie_embeddings), "attention_bias": False,
      "torch_dtype": torch_dtype, "max_position_embeddings": _DEFAULT_MAX_POSITIONS,
  }
  if cfg.rope_scaling is not None:
    scaling = dict(cfg.rope_scaling)
    original = scaling["original_max_position_embeddings"]
    if original != int(original):
      raise ValueError(f"rope_scaling.original_max_position_embeddings must be a whole number of "
                       f"positions, got {original}.")
    scaling["original_max_position_embeddings"] = int(original)
    out["rope_scaling"] = {"rope_type": "llama3", **scaling}
  if model_type == "llama":
    out["mlp_bias"] = False
  else:
    out["use_sliding_window"] = False
  return out


def export(model: Transformer, cfg: ModelConfig, out_dir: str, *, tokenizer_dir: str | None = None,
           dtype: str | None = None) -> None:
  """Writes a Hugging Face checkpoint directory that transformers loads.

  Args:
    model, cfg: the model to write (all embedding rows, padding rows included).
    out_dir: created if needed; config.json, model.safetensors (or shards of <= 4 GiB with
      model.safetensors.index.json).
    tokenizer_dir: directory whose tokenizer files (TOKENIZER_FILES) are copied alongside; if it
      holds a config.json (a checkpoint directory), its token ids and max_position_embeddings
      are kept (otherwise max_position_embeddings is 8192).
    dtype: "float32" or "bfloat16" for the stored tensors; defaults to cfg.param_dtype.
  """
  dtype = dtype or cfg.param_dtype
  config = hf_config(cfg, torch_dtype=dtype)
  if tokenizer_dir is not None and os.path.exists(os.path.join(tokenizer_dir, "config.json")):
    source = _read_json(os.path.join(tokenizer_dir, "config.json"))
    config.update({k: v for k, v in source.items() if k in _SOURCE_FIELDS})
  os.makedirs(out_dir, exist_ok=True)
  for file in os.listdir(out_dir):  # a stale index or shard would shadow the new weights
    if file == "config.json" or file.startswith("model") and file.endswith((".safetensors",
                                                                             ".json")):
      os.remove(os.path.join(out_dir, file))
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name, hf_shape, kd_path, _ in _hf_names(cfg):
    var = model
    for key in kd_path:
      var = var[key] if isinstance(key, int) else getattr(var, key)
    w = np.asarray(_from_kdjax(name, var.get_value().astype(jnp.dtype(dtype)), hf_shape))
    if size and size + w.nbytes > _SHARD_BYTES:
      shards.append({})
      size = 0
    shards[-1][name] = np.ascontiguousarray(w)
    size += w.nbytes
  if len(shards) == 1:
    files = ["model.safetensors"]
  else:
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
  for file, shard in zip(files, shards):
    save_file(shard, os.path.join(out_dir, file), metadata={"format": "pt"})
  if len(shards) > 1:
    index = {"metadata": {"total_size": sum(w.nbytes for s in shards for w in s.values())},
             "weight_map": {n: file for file, s in zip(files, shards) for n in s}}
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
      json.dump(index, f, indent=2)
  if tokenizer_dir is not None and os.path.abspath(tokenizer_dir) != os.path.abspath(out_dir):
    for file in TOKENIZER_FILES:
      if os.path.exists(os.path.join(tokenizer_dir, file)):
        shutil.copy(os.path.join(tokenizer_dir, file), os.path.join(out_dir, file))
  # config.json last: its presence marks a complete export.
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
