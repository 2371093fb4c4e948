"""A student initialised from its teacher by pruning: fewer layers (ShortGPT's block importance)
and narrower widths (Minitron's activation importances), measured on calibration rows.

Shape letters as in kdjax/models/llama.py, plus L for the teacher's layers.

    cfg = student_config(teacher.cfg, n_layers=..., d_model=..., ...)  # the student's shapes
    importance = measure(teacher, rows, batch_size)  # one pass of the teacher over the rows
    kept = choose(importance, cfg, layers=())         # which layers, kv groups, neurons, channels
    student = prune(teacher, cfg, kept)               # the teacher's values at those indices

Heads go by whole key/value groups (each with its R query heads), so the student keeps the
teacher's grouping; head_dim and the vocabulary are the teacher's. Every kept index list is
sorted, so a student as large as its teacher is the teacher, exactly.
"""
import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
from flax import nnx

from kdjax import parallel
from kdjax.errors import UserError
from kdjax.models import documents, llama, rope

PRUNED = ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff")  # the dims a student chooses
NUMERICS = ("dtype", "param_dtype", *llama.RUNTIME)  # and its own numerics


def student_config(teacher_cfg: llama.ModelConfig, **values) -> llama.ModelConfig:
  """The teacher's config with the student's PRUNED dims and NUMERICS; raises UserError naming
  the field (as `student.<name>`) that cannot be pruned to."""
  unknown = set(values) - set(PRUNED + NUMERICS)
  if unknown:
    raise ValueError(f"a pruned student sets only {PRUNED + NUMERICS}, got {sorted(unknown)}.")
  if teacher_cfg.n_experts:
    raise UserError("pruning a mixture-of-experts teacher is not supported: init.from_teacher "
                    "needs a dense teacher (n_experts = 0).")
  if teacher_cfg.sliding_window:
    raise UserError("pruning a teacher with a sliding window is not supported: its windowed "
                    "layers go by layer parity, which dropping layers would change.")
  for name in PRUNED:
    if name in values and not 0 < values[name] <= getattr(teacher_cfg, name):
      raise UserError(f"student.{name} ({values[name]}) must be in [1, the teacher's "
                      f"{getattr(teacher_cfg, name)}] to prune the teacher to it.")
  cfg = dataclasses.replace(teacher_cfg, **values)
  ratio = teacher_cfg.n_heads // teacher_cfg.n_kv_heads
  if cfg.n_heads != ratio * cfg.n_kv_heads:
    raise UserError(f"student.n_heads ({cfg.n_heads}) must be {ratio} x student.n_kv_heads "
                    f"({cfg.n_kv_heads}): whole key/value groups of the teacher are kept, each "
                    f"with its {ratio} query heads.")
  try:
    return cfg.validate("student.")
  except ValueError as e:  # a field the student sets that the model refuses
    raise UserError(str(e)) from None


def group_config(teacher_cfg: llama.ModelConfig, group, layers=()) -> llama.ModelConfig:
  """student_config with the PRUNED and NUMERICS fields of a config group (c.student); the
  chosen layers (c.init.layers, () = measured) are checked against it."""
  cfg = student_config(teacher_cfg, **{name: group[name] for name in PRUNED + NUMERICS})
  if layers:
    check_layers(layers, teacher_cfg.n_layers, cfg.n_layers)
  return cfg


def check_layers(layers, teacher_layers: int, n_layers: int) -> None:
  """Chosen layers: n_layers distinct teacher layer indices, in increasing order."""
  layers = tuple(layers)
  if len(layers) != n_layers:
    raise UserError(f"init.layers lists {len(layers)} layers but student.n_layers is "
                    f"{n_layers}: list that many (or none, to keep the most important).")
  if any(not 0 <= i < teacher_layers for i in layers):
    raise UserError(f"init.layers {layers} must be indices of the teacher's {teacher_layers} "
                    "layers (0-based).")
  if list(layers) != sorted(set(layers)):
    raise UserError(f"init.layers {layers} must be distinct and in increasing order.")


@dataclasses.dataclass(frozen=True)
class Importance:
  """Per-unit scores of the teacher; higher is more important."""
  block_L: np.ndarray  # 1 - cos(block input, block output) (ShortGPT), mean over positions
  groups_LxG: np.ndarray  # summed over a group's query heads: mean L2 norm of the head's output
  neurons_LxF: np.ndarray  # mean |silu(y W_gate) * (y W_up)|
  channels_D: np.ndarray  # mean |RMSNorm output|, summed over every norm (2 a layer + final)


@dataclasses.dataclass(frozen=True)
class Kept:
  """Teacher indices the student keeps, each list sorted; per kept layer for groups, neurons."""
  layers: tuple
  groups_LxG: np.ndarray  # [student L, student G]
  neurons_LxF: np.ndarray  # [student L, student F]
  channels_D: np.ndarray  # [student D]


@functools.partial(nnx.jit, static_argnames="max_documents")
def _block_stats(block, x_BxTxD, positions_BxT, segment_ids_BxT, inv_freq, max_documents):
  """The block's output and its importance sums over the valid positions, float32."""
  taps = {}
  out_BxTxD = block(x_BxTxD, positions_BxT, segment_ids_BxT, inv_freq, max_documents, taps)
  cfg = block.cfg
  valid_BxT = segment_ids_BxT != 0
  weight_BxT = valid_BxT.astype(jnp.float32)
  x_BxTxD, y_BxTxD = x_BxTxD.astype(jnp.float32), out_BxTxD.astype(jnp.float32)
  norms_BxT = jnp.linalg.norm(x_BxTxD, axis=-1) * jnp.linalg.norm(y_BxTxD, axis=-1)
  # Padding positions may hold anything; keep their 0/0 out of the sums.
  cos_BxT = jnp.where(valid_BxT, jnp.sum(x_BxTxD * y_BxTxD, axis=-1)
                      / jnp.where(valid_BxT, jnp.maximum(norms_BxT, 1e-30), 1.0), 1.0)
  heads_BxTxH = jnp.linalg.norm(taps["a_BxTxHxE"].astype(jnp.float32), axis=-1)
  heads_H = jnp.einsum("bth,bt->h", heads_BxTxH, weight_BxT)
  abs_sum = lambda name: jnp.einsum("btd,bt->d", jnp.abs(taps[name].astype(jnp.float32)),
                                    weight_BxT)
  return out_BxTxD, {
      "block": jnp.sum((1.0 - cos_BxT) * weight_BxT),
      "groups_G": heads_H.reshape(cfg.n_kv_heads, -1).sum(axis=1),  # heads h = g R + r
      "neurons_F": abs_sum("h_BxTxF"),
      "channels_D": abs_sum("y_attn_BxTxD") + abs_sum("y_mlp_BxTxD")}


@nnx.jit
def _embed(model, tokens_BxT):
  return jnp.take(model.embed_VxD[...], tokens_BxT, axis=0).astype(llama.DTYPES[model.cfg.dtype])


@nnx.jit
def _final_channels(model, x_BxTxD, segment_ids_BxT):
  y_BxTxD = llama.rms_norm(x_BxTxD, model.final_norm_D[...], model.cfg.norm_eps)
  return jnp.einsum("btd,bt->d", jnp.abs(y_BxTxD.astype(jnp.float32)),
                    (segment_ids_BxT != 0).astype(jnp.float32))


def measure(teacher: llama.Transformer, rows: dict, batch_size: int) -> Importance:
  """Importances from one pass of the teacher over rows (numpy tokens, positions, segment_ids
  [rows, T]), batch_size rows at a time, averaged over their valid (non-padding) positions."""
  cfg = teacher.cfg
  student_config(cfg)  # refuses teachers it cannot prune
  inv_freq = rope.inv_freq(cfg)
  sums, count = {}, 0
  for start in range(0, len(rows["tokens"]), batch_size):
    tokens_BxT, positions_BxT, segment_ids_BxT = (
        rows[name][start:start + batch_size] for name in ("tokens", "positions", "segment_ids"))
    max_documents = documents.documents_bound(segment_ids_BxT)
    count += int(np.sum(segment_ids_BxT != 0))
    x_BxTxD = _embed(teacher, tokens_BxT)
    per_layer = []
    for block in teacher.layers:
      x_BxTxD, stats = _block_stats(block, x_BxTxD, positions_BxT, segment_ids_BxT, inv_freq,
                                    max_documents)
      per_layer.append(stats)
    batch = {name: np.stack([np.asarray(s[name]) for s in per_layer])
             for name in per_layer[0]}
    batch["channels_D"] = (batch["channels_D"].sum(axis=0)
                           + np.asarray(_final_channels(teacher, x_BxTxD, segment_ids_BxT)))
    sums = {name: sums.get(name, 0.0) + value for name, value in batch.items()}
  if not count:
    raise UserError("the calibration rows hold no tokens (all padding): nothing to measure.")
  return Importance(block_L=sums["block"] / count, groups_LxG=sums["groups_G"] / count,
                    neurons_LxF=sums["neurons_F"] / count, channels_D=sums["channels_D"] / count)


def _top(score: np.ndarray, n: int) -> np.ndarray:
  """Indices of the n highest scores (ties: the lower index), in increasing order."""
  return np.sort(np.argsort(-np.asarray(score), kind="stable")[:n])


def choose(importance: Importance, cfg: llama.ModelConfig, layers=()) -> Kept:
  """The units the student of config `cfg` keeps: `layers` (teacher indices, in order) or the
  cfg.n_layers most important blocks; in each, its most important kv groups and neurons."""
  teacher_layers = len(importance.block_L)
  layers = tuple(int(i) for i in layers) or tuple(_top(importance.block_L, cfg.n_layers).tolist())
  check_layers(layers, teacher_layers, cfg.n_layers)
  return Kept(layers=layers,
              groups_LxG=np.stack([_top(importance.groups_LxG[i], cfg.n_kv_heads)
                                   for i in layers]),
              neurons_LxF=np.stack([_top(importance.neurons_LxF[i], cfg.d_ff) for i in layers]),
              channels_D=_top(importance.channels_D, cfg.d_model))


def prune(teacher: llama.Transformer, cfg: llama.ModelConfig, kept: Kept) -> llama.Transformer:
  """The student of config `cfg` (student_config) holding the teacher's values at `kept`."""
  ratio = teacher.cfg.n_heads // teacher.cfg.n_kv_heads
  dtype = llama.DTYPES[cfg.param_dtype]

  def cut(name: str, x, layer: int | None):
    """Slices each dimension of parameter `name` named D, G, H or F (its shape letters)."""
    for axis, letter in enumerate(parallel.letters_of((name,), x.ndim) or ()):
      if letter == "D":
        x = jnp.take(x, kept.channels_D, axis=axis)
      elif letter == "G":
        x = jnp.take(x, kept.groups_LxG[layer], axis=axis)
      elif letter == "H":  # the query heads of the kept groups: head h = g R + r
        heads = (kept.groups_LxG[layer][:, None] * ratio + np.arange(ratio)).reshape(-1)
        x = jnp.take(x, heads, axis=axis)
      elif letter == "F":
        x = jnp.take(x, kept.neurons_LxF[layer], axis=axis)
    return x.astype(dtype)

  source = nnx.to_pure_dict(nnx.state(teacher, nnx.Param))
  values = {name: cut(name, x, None) for name, x in source.items() if name != "layers"}
  values["layers"] = {j: {name: cut(name, x, j) for name, x in source["layers"][i].items()}
                      for j, i in enumerate(kept.layers)}
  graphdef, state = nnx.split(nnx.eval_shape(lambda: llama.Transformer(cfg, rngs=nnx.Rngs(0))))
  nnx.replace_by_pure_dict(state, values)
  return nnx.merge(graphdef, state)


def from_teacher(teacher: llama.Transformer, cfg: llama.ModelConfig, rows: dict, *,
                 layers=(), batch_size: int = 8) -> tuple[llama.Transformer, Kept]:
  """measure, choose and prune in one call: the student of config `cfg` and what it kept."""
  kept = choose(measure(teacher, rows, batch_size), cfg, layers)
  return prune(teacher, cfg, kept), kept
