"""Rotary position embedding: plain, llama3-scaled (Llama 3.x) or YaRN-scaled (gpt-oss).

Shape letters: B batch, T positions, H heads (query or key/value), E head dim.

A model's `rope_scaling` is None or a FrozenDict made by `scaling`: llama3's keys (and no
rope_type key, as configs written before YaRN was supported hold them), or YaRN's keys with
rope_type "yarn" and its attention_factor filled in.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax.core import FrozenDict

SCALING_KEYS = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "beta_fast", "beta_slow", "original_max_position_embeddings", "truncate"),
}


def scaling(spec) -> FrozenDict | None:
  """A config's rope_scaling (dict, or empty for none) checked and frozen (hashable)."""
  if not spec:  # an empty config group means no scaling
    return None
  spec = dict(spec)
  kind = spec.pop("rope_type", spec.pop("type", "llama3"))
  if kind not in SCALING_KEYS:
    raise ValueError(f"rope_scaling type {kind!r} is not supported; only "
                     f"{tuple(SCALING_KEYS)} are.")
  keys = SCALING_KEYS[kind]
  missing = [k for k in keys if k not in spec]
  if missing:
    raise ValueError(f"rope_scaling lacks {missing}; {kind} scaling needs {keys}.")
  values = {k: float(spec[k]) for k in keys}
  if kind == "yarn":
    values["truncate"] = bool(spec["truncate"])
    # YaRN's default: queries and keys scaled by 0.1 ln(factor) + 1 each.
    factor = values["factor"]
    values["attention_factor"] = float(spec.get("attention_factor") or
                                       (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0))
    values["rope_type"] = "yarn"
  return FrozenDict(values)


def is_yarn(spec) -> bool:
  return spec is not None and spec.get("rope_type") == "yarn"


def attention_factor(cfg) -> float:
  """The factor on cos and sin (so on queries and keys): YaRN's attention_factor, else 1."""
  return cfg.rope_scaling["attention_factor"] if is_yarn(cfg.rope_scaling) else 1.0


def _llama3(inv_freq: np.ndarray, s) -> np.ndarray:
  old_len = s["original_max_position_embeddings"]
  low_wavelen = old_len / s["low_freq_factor"]
  high_wavelen = old_len / s["high_freq_factor"]
  wavelen = 2 * math.pi / inv_freq
  # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
  scaled = np.where(wavelen > low_wavelen, inv_freq / s["factor"], inv_freq)
  smooth = (old_len / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] -
                                                           s["low_freq_factor"])
  smoothed = (1 - smooth) * scaled / s["factor"] + smooth * scaled
  medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return np.where(medium, smoothed, scaled)


def _yarn(inv_freq: np.ndarray, theta: float, s) -> np.ndarray:
  """Dimensions turning fewer than beta_slow times over the original context are interpolated
  (divided by factor), those turning more than beta_fast times kept, a linear ramp between."""
  e = 2 * len(inv_freq)
  old_len = s["original_max_position_embeddings"]

  def dim_of(rotations):  # the dimension whose wavelength fits `rotations` times in old_len
    return e * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

  low, high = dim_of(s["beta_fast"]), dim_of(s["beta_slow"])
  if s["truncate"]:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, e - 1)
  if low == high:
    high += 0.001  # as Hugging Face: no zero-width ramp
  ramp = np.clip((np.arange(e // 2, dtype=np.float64) - low) / (high - low), 0, 1)
  return inv_freq / s["factor"] * ramp + inv_freq * (1 - ramp)


def inv_freq(cfg) -> np.ndarray:
  """Inverse frequencies [E/2] in float32 (computed in float64, rounded once), scaled as
  cfg.rope_scaling says."""
  e = cfg.head_dim
  freq = 1.0 / (cfg.rope_theta ** (np.arange(0, e, 2, dtype=np.float64) / e))
  if is_yarn(cfg.rope_scaling):
    freq = _yarn(freq, cfg.rope_theta, cfg.rope_scaling)
  elif cfg.rope_scaling is not None:
    freq = _llama3(freq, cfg.rope_scaling)
  return freq.astype(np.float32)


def apply(x_BxTxHxE: jax.Array, positions_BxT: jax.Array, inv_freq_E2: np.ndarray,
          scale: float = 1.0) -> jax.Array:
  """Rotate-half RoPE (Hugging Face layout: pairs are (i, i + E/2)), computed in float32; scale
  multiplies cos and sin (attention_factor)."""
  inv_freq_11E2 = jnp.asarray(inv_freq_E2)[None, None]
  angles_BxTxE2 = positions_BxT.astype(jnp.float32)[..., None] * inv_freq_11E2
  cos_BxTx1xE2 = (jnp.cos(angles_BxTxE2) * scale)[:, :, None, :]
  sin_BxTx1xE2 = (jnp.sin(angles_BxTxE2) * scale)[:, :, None, :]
  x = x_BxTxHxE.astype(jnp.float32)
  x1, x2 = jnp.split(x, 2, axis=-1)
  out = jnp.concatenate([x1 * cos_BxTx1xE2 - x2 * sin_BxTx1xE2,
                         x2 * cos_BxTx1xE2 + x1 * sin_BxTx1xE2], axis=-1)
  return out.astype(x_BxTxHxE.dtype)
