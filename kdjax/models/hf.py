"""Hugging Face checkpoint directories in and out: Llama 3.x, Qwen3, Qwen3-MoE and gpt-oss.

    model, cfg = hf.load(path, dtype="bfloat16")     # config.json + *.safetensors (+ index)
    hf.export(model, cfg, out_dir, tokenizer_dir=path)  # transformers.AutoModelForCausalLM loads it

Loading reads one tensor at a time from memory-mapped safetensors files and places it on the
device before reading the next, so host memory never holds a second copy of the model. gpt-oss's
MXFP4 experts are kept packed (uint8, see kdjax/models/moe.py); every other tensor is cast to the
parameter dtype. Which tensors each family has and how they map onto kdjax's parameters:
kdjax/models/hf_families.py.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file
from tqdm import tqdm

from kdjax import tokenizer
from kdjax.errors import UserError
from kdjax.models import hf_families
from kdjax.models.llama import RUNTIME, ModelConfig, Transformer

SUPPORTED = hf_families.SUPPORTED
# Dtypes a checkpoint may store (MXFP4 blocks and scales: U8); other quantised formats (int8,
# fp8, ...) are refused by name.
_FLOAT_TYPES = ("F32", "BF16", "F16")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json",
                   "merges.txt", "added_tokens.json", "generation_config.json")
_SHARD_BYTES = 4 << 30
# Fields export() takes from the source checkpoint's config.json: they describe the tokenizer
# and serving limits, which ModelConfig does not hold.
_SOURCE_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings")


class CheckpointError(UserError):
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


def _config_and_kind(path: str, dtype: str, param_dtype: str | None, runtime: dict,
                     tokenizer_vocab: int | None) -> tuple[ModelConfig, str]:
  _check_dir(path)
  hf = _read_json(os.path.join(path, "config.json"))
  try:
    fields = hf_families.model_fields(hf)
  except hf_families.FamilyError as e:
    raise CheckpointError(f"{path}: {e}") from None
  vocab = fields["vocab_size"]
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
  unknown = set(runtime) - set(RUNTIME)
  if unknown:
    raise TypeError(f"{sorted(unknown)}: not among the fields a checkpoint's model runs under, "
                    f"{RUNTIME}")
  cfg = ModelConfig(**fields, dtype=dtype, param_dtype=param_dtype or dtype, **runtime,
                    real_vocab_size=None if real in (None, vocab) else real)
  try:
    return cfg.validate(), hf["model_type"]
  except ValueError as e:  # shapes kdjax's model cannot take
    raise CheckpointError(f"{path}: {e}") from None


def config_from_hf(path: str, *, dtype: str = "float32", param_dtype: str | None = None,
                   tokenizer_vocab: int | None = None, **runtime) -> ModelConfig:
  """ModelConfig from a checkpoint's config.json (+ tokenizer.json for the real vocabulary).

  tokenizer_vocab: the run's tokenizer size, when known; it must match the checkpoint's
  tokenizer.json if there is one, and sets real_vocab_size where there is none.
  """
  return _config_and_kind(path, dtype, param_dtype, runtime, tokenizer_vocab)[0]


def _param(model: nnx.Module, kd_path: tuple):
  var = model
  for key in kd_path:
    var = var[key] if isinstance(key, int) else getattr(var, key)
  return var


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
         tokenizer_vocab: int | None = None, place=None,
         **runtime) -> tuple[Transformer, ModelConfig]:
  """Loads a Hugging Face checkpoint directory (a family of SUPPORTED) into a Transformer.

  Args:
    path: directory with config.json and model.safetensors (or shards + index); tokenizer.json,
      when present, sets cfg.real_vocab_size (padding rows of the embedding are excluded from
      lm_head_DxV()).
    dtype: compute dtype, "float32" or "bfloat16".
    param_dtype: parameter dtype; defaults to dtype. Stored tensors are cast to it, except
      MXFP4 experts, which stay packed (uint8).
    tokenizer_vocab: the run's tokenizer size, if known: checked against the checkpoint's
      tokenizer.json, and used as real_vocab_size when the directory has none.
    place: None (each parameter on the default device), or place(path, host array) -> its
      device array (e.g. sharded over a mesh, parallel.place_param): each tensor then goes from
      the host straight to its shards, so no device ever holds more than its share.
    runtime: how the model runs (RUNTIME of ModelConfig: remat, attention_impl, mlp_impl);
      ModelConfig's defaults otherwise.
  Returns:
    (model, cfg). Raises CheckpointError for a path that is a file or missing, unsupported
    architectures, missing or inconsistent shards, missing/unexpected tensors, wrong shapes, or
    quantised tensors other than gpt-oss's MXFP4 experts.
  """
  cfg, kind = _config_and_kind(path, dtype, param_dtype, runtime, tokenizer_vocab)
  weight_map = _weight_files(path)
  groups = list(hf_families.tensor_groups(cfg, kind))
  wanted = [(name, shape, group.packed) for group in groups for name, shape in group.hf]
  missing = [name for name, *_ in wanted if name not in weight_map]
  if missing:
    raise CheckpointError(f"{path}: {len(missing)} tensors missing from the checkpoint, e.g. "
                          f"{missing[:3]}; config.json and the weights disagree.")
  # A tied checkpoint may still store lm_head.weight (a copy of the embedding); ignore it.
  known = {name for name, *_ in wanted} | {"lm_head.weight"}
  unexpected = sorted(n for n in weight_map if n not in known and "rotary_emb" not in n)
  if unexpected:
    raise CheckpointError(f"{path}: tensors a {SUPPORTED[kind]} does not have, e.g. "
                          f"{unexpected[:3]}; is this a variant with biases or extra modules?")
  # Build the module without allocating its random initial weights, then fill it.
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  target = jnp.dtype(cfg.param_dtype)
  files: dict[str, tuple] = {}  # file -> (open handle, its tensor names)

  def read(stack, name: str, hf_shape: tuple, packed: bool) -> jax.Array:
    file = weight_map[name]
    if file not in files:
      f = stack.enter_context(safe_open(os.path.join(path, file), "np"))
      files[file] = (f, set(f.keys()))
    f, names = files[file]
    if name not in names:
      raise CheckpointError(f"{path}: the index puts {name} in {file}, which lacks it; "
                            "the shards and index are inconsistent.")
    sl = f.get_slice(name)
    if sl.get_dtype() not in (("U8",) if packed else _FLOAT_TYPES):
      raise CheckpointError(f"{path}: {name} is stored as {sl.get_dtype()}; kdjax loads "
                            f"{'U8 (MXFP4)' if packed else _FLOAT_TYPES} tensors there "
                            "(dequantise other formats first).")
    if tuple(sl.get_shape()) != hf_shape:
      raise CheckpointError(f"{path}: {name} has shape {tuple(sl.get_shape())}, "
                            f"config.json implies {hf_shape}.")
    # One tensor on the host at a time; layout changes and the cast happen on the device, or
    # with `place` on the host, each device then receiving only its shard.
    w = f.get_tensor(name) if place else jnp.asarray(f.get_tensor(name))
    return w if packed else w.astype(target)

  # A bar for sharded checkpoints only, as transformers does: those are the ones that take minutes.
  with contextlib.ExitStack() as stack, tqdm(
      total=len(groups), desc=f"loading {os.path.basename(os.path.normpath(path))}",
      unit="tensor", leave=False, disable=len(set(weight_map.values())) == 1) as bar:
    for group in groups:
      values = group.to_kdjax([read(stack, name, shape, group.packed)
                               for name, shape in group.hf])
      for (kd_path, _), value in zip(group.kd, values):
        _param(model, kd_path).set_value(place(kd_path, value) if place else value)
      bar.update()
  return model, cfg


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
  kind = hf_families.model_type(cfg)
  config = hf_families.hf_config(cfg, torch_dtype=dtype, kind=kind)
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
  for group in hf_families.tensor_groups(cfg, kind):
    values = [_param(model, kd_path).get_value() for kd_path, _ in group.kd]
    if not group.packed:  # MXFP4 blocks and scales are written as they are
      values = [v.astype(jnp.dtype(dtype)) for v in values]
    for (name, _), w in zip(group.hf, group.from_kdjax(values)):
      w = np.asarray(w)
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
