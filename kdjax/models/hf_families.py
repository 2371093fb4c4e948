"""The Hugging Face families kdjax reads and writes: config.json fields and tensor layouts.

    Llama 3.x (llama), Qwen3 (qwen3), Qwen3-MoE (qwen3_moe), gpt-oss (gpt_oss)

`model_fields(hf)` turns a config.json into ModelConfig fields (refusing what kdjax does not
implement), `hf_config(cfg)` goes back, and `tensor_groups(cfg)` lists every parameter as a
`Group`: HF tensors and the kdjax parameters they become, with the conversions both ways (a
transpose for nn.Linear's [out, in]; Qwen3-MoE's per-expert tensors stacked; gpt-oss's
interleaved gate/up columns split). kdjax/models/hf.py does the file handling.
Shape letters as in kdjax/models/llama.py and moe.py.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

import jax.numpy as jnp
import numpy as np

from kdjax.errors import UserError
from kdjax.models import moe, rope
from kdjax.models.llama import RUNTIME, ModelConfig

SUPPORTED = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
             "qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": "GptOssForCausalLM"}
_DEFAULT_MAX_POSITIONS = 8192
# gpt-oss's quantization_config: what stays unquantised, as its released checkpoints say.
_MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


class FamilyError(UserError):
  """A config.json kdjax cannot map onto its model; hf.py reports it with the path."""


@dataclasses.dataclass(frozen=True)
class Group:
  """HF tensors (name, shape) <-> kdjax parameters (path, shape), converted together.

  to_kdjax maps the HF arrays (device arrays, in order) to the kdjax ones, from_kdjax back.
  packed: uint8 MXFP4 blocks or scales, stored and kept as they are (never cast).
  """
  hf: tuple[tuple[str, tuple], ...]
  kd: tuple[tuple[tuple, tuple], ...]
  to_kdjax: Callable[[list], list]
  from_kdjax: Callable[[list], list]
  packed: bool = False


def _same(name: str, path: tuple, shape: tuple, hf_shape: tuple | None = None,
          packed: bool = False) -> Group:
  """One tensor, reshaped if hf_shape differs (a bias [H * E] is kdjax's [H, E])."""
  hf_shape = hf_shape or shape
  return Group(((name, hf_shape),), ((path, shape),), lambda ws: [ws[0].reshape(shape)],
               lambda ws: [ws[0].reshape(hf_shape)], packed)


def _linear(name: str, hf_shape: tuple, path: tuple, shape: tuple) -> Group:
  """nn.Linear's [out, in] as kdjax's [in, ...out] (or [in..., out])."""
  return Group(((name, hf_shape),), ((path, shape),), lambda ws: [ws[0].T.reshape(shape)],
               lambda ws: [ws[0].reshape(hf_shape[1], hf_shape[0]).T])


def _stack(ws: list):
  """Stacks host arrays on the host (hf.load with `place`), device arrays on the device."""
  return (np if isinstance(ws[0], np.ndarray) else jnp).stack(ws)


def _stacked(names: list[str], hf_shape: tuple, path: tuple, shape: tuple) -> Group:
  """Qwen3-MoE: one nn.Linear per expert, kdjax's [X, in, out] holds them all."""
  return Group(tuple((n, hf_shape) for n in names), ((path, shape),),
               lambda ws: [_stack([w.T for w in ws])],
               lambda ws: [w.T for w in ws[0]])


def _interleaved(name: str, hf_shape: tuple, paths: tuple, shape: tuple) -> Group:
  """gpt-oss's gate_up: gate and up alternate along the last axis; kdjax keeps two arrays."""
  return Group(((name, hf_shape),), tuple((p, shape) for p in paths),
               lambda ws: [ws[0][..., 0::2], ws[0][..., 1::2]],
               lambda ws: [jnp.stack(ws, axis=-1).reshape(hf_shape)])


def _yarn(params: dict) -> dict:
  if params.get("mscale") or params.get("mscale_all_dim"):
    raise FamilyError("yarn rope with mscale / mscale_all_dim is not supported.")
  if params.get("factor") is None or params.get("original_max_position_embeddings") is None:
    raise FamilyError("yarn rope needs factor and original_max_position_embeddings.")
  return {"rope_type": "yarn", "factor": params["factor"],
          "beta_fast": params.get("beta_fast") or 32.0, "beta_slow": params.get("beta_slow") or 1.0,
          "original_max_position_embeddings": params["original_max_position_embeddings"],
          "truncate": params.get("truncate", True),
          "attention_factor": params.get("attention_factor")}


def _rope(hf: dict) -> tuple[float, dict | None]:
  # transformers >= 5 writes rope_parameters (theta inside); older configs rope_theta/rope_scaling.
  params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
  kind = params.get("rope_type", params.get("type", "default"))
  if kind == "default":
    return float(theta), None
  if kind == "yarn":
    return float(theta), _yarn(params)
  if kind != "llama3":
    raise FamilyError(f"rope type {kind!r} is not supported; kdjax supports default RoPE, llama3 "
                      "and yarn scaling.")
  return float(theta), {k: params[k] for k in rope.SCALING_KEYS["llama3"]}


def _refuse(unsupported: dict, family: str) -> None:
  unsupported = {k: v for k, v in unsupported.items() if v}
  if unsupported:
    raise FamilyError(f"config.json sets {unsupported}, which kdjax's {family} does not have.")


def model_fields(hf: dict) -> dict:
  """ModelConfig fields (shapes and architecture, not dtypes) of a supported config.json."""
  model_type = hf.get("model_type")
  if model_type not in SUPPORTED:
    arch = (hf.get("architectures") or ["?"])[0]
    raise FamilyError(f"architecture {arch} (model_type {model_type!r}) is not supported; kdjax "
                      "loads " + ", ".join(f"{a} (model_type {t!r})" for t, a in SUPPORTED.items())
                      + ".")
  n_heads = hf["num_attention_heads"]
  theta, scaling = _rope(hf)
  fields = dict(
      vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
      n_heads=n_heads, n_kv_heads=hf.get("num_key_value_heads") or n_heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads, d_ff=hf["intermediate_size"],
      rope_theta=theta, rope_scaling=scaling, norm_eps=hf["rms_norm_eps"],
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      qk_norm=model_type in ("qwen3", "qwen3_moe"))
  quant = (hf.get("quantization_config") or {}).get("quant_method")
  if quant not in (None, "mxfp4") or quant and model_type != "gpt_oss":
    raise FamilyError(f"quantization {quant!r} is not supported; kdjax reads MXFP4 gpt-oss "
                      "experts and float weights (dequantise first).")
  if hf.get("hidden_act", "silu") != "silu":
    raise FamilyError(f"hidden_act {hf['hidden_act']!r} is not supported; kdjax uses SiLU.")
  if model_type == "gpt_oss":
    layer_types = hf.get("layer_types") or []
    alternating = [("sliding_attention", "full_attention")[i % 2] for i in range(len(layer_types))]
    if layer_types != alternating:
      raise FamilyError(f"layer_types {layer_types} are not gpt-oss's alternation (sliding "
                        "window on even layers, full attention on odd ones), the only one kdjax "
                        "implements.")
    _refuse({"attention_bias": not hf.get("attention_bias", True)}, "gpt-oss (it has biases)")
    return dict(fields, n_experts=hf["num_local_experts"],
                experts_per_token=hf["num_experts_per_tok"], route_renormalize=True,
                expert_bias=True, swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
                swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)), attention_bias=True,
                attention_sinks=True, sliding_window=hf.get("sliding_window") or 0,
                expert_weights="mxfp4" if quant else "float")
  _refuse({k: hf.get(k) for k in ("attention_bias", "mlp_bias", "use_sliding_window")},
          "Llama/Qwen3 (no attention/MLP biases, no sliding window)")
  if model_type != "qwen3_moe":
    return fields
  _refuse({"decoder_sparse_step": hf.get("decoder_sparse_step", 1) != 1,
           "mlp_only_layers": hf.get("mlp_only_layers")}, "Qwen3-MoE (experts in every layer)")
  return dict(fields, n_experts=hf.get("num_experts") or hf["num_local_experts"],
              experts_per_token=hf["num_experts_per_tok"], d_ff=hf["moe_intermediate_size"],
              route_renormalize=bool(hf.get("norm_topk_prob", False)))


def model_type(cfg: ModelConfig) -> str:
  """The family a ModelConfig is (raises FamilyError for combinations no family has)."""
  if cfg.attention_sinks:
    kind = "gpt_oss"
  elif cfg.n_experts:
    kind = "qwen3_moe"
  else:
    kind = "qwen3" if cfg.qk_norm else "llama"
  family = model_fields(hf_config(cfg, torch_dtype=cfg.param_dtype, kind=kind))
  keep = ("dtype", "param_dtype", *RUNTIME, "real_vocab_size")
  rebuilt = ModelConfig(**family, **{name: getattr(cfg, name) for name in keep})
  if rebuilt != cfg:
    differ = [f.name for f in dataclasses.fields(cfg)
              if getattr(rebuilt, f.name) != getattr(cfg, f.name)]
    raise FamilyError(f"this model is no Hugging Face family kdjax writes: as {SUPPORTED[kind]} "
                      f"its {differ} would differ.")
  return kind


def hf_config(cfg: ModelConfig, *, torch_dtype: str, kind: str | None = None) -> dict:
  """config.json contents for a ModelConfig (rope keys in the pre-5 layout, read by all).

  Fields HF types as int are written as ints: ModelConfig keeps rope_scaling values as floats,
  and transformers warns on every load about a float original_max_position_embeddings; shape
  fields may be numpy integers, which json cannot write.
  """
  kind = kind or model_type(cfg)
  out = {
      "architectures": [SUPPORTED[kind]], "model_type": kind,
      "vocab_size": int(cfg.vocab_size), "hidden_size": int(cfg.d_model),
      "num_hidden_layers": int(cfg.n_layers), "num_attention_heads": int(cfg.n_heads),
      "num_key_value_heads": int(cfg.n_kv_heads), "head_dim": int(cfg.head_dim),
      "intermediate_size": int(cfg.d_ff), "rms_norm_eps": float(cfg.norm_eps),
      "hidden_act": "silu", "rope_theta": float(cfg.rope_theta),
      "tie_word_embeddings": bool(cfg.tie_embeddings), "attention_bias": cfg.attention_bias,
      "torch_dtype": torch_dtype, "max_position_embeddings": _DEFAULT_MAX_POSITIONS,
  }
  if cfg.rope_scaling is not None:
    scaling = dict(cfg.rope_scaling)
    original = scaling["original_max_position_embeddings"]
    if original != int(original):
      raise ValueError(f"rope_scaling.original_max_position_embeddings must be a whole number of "
                       f"positions, got {original}.")
    scaling["original_max_position_embeddings"] = int(original)
    out["rope_scaling"] = {"rope_type": scaling.pop("rope_type", "llama3"), **scaling}
    if rope.is_yarn(cfg.rope_scaling):  # the context YaRN extends to (transformers checks it)
      out["max_position_embeddings"] = int(original * cfg.rope_scaling["factor"])
  if kind == "llama":
    out["mlp_bias"] = False
  elif kind == "gpt_oss":
    out.update(num_local_experts=int(cfg.n_experts), num_experts_per_tok=int(cfg.experts_per_token),
               swiglu_limit=float(cfg.swiglu_limit), swiglu_alpha=float(cfg.swiglu_alpha),
               sliding_window=int(cfg.sliding_window),
               layer_types=[("sliding_attention", "full_attention")[i % 2]
                            for i in range(cfg.n_layers)])
    if cfg.expert_weights == "mxfp4":
      out["quantization_config"] = dict(_MXFP4_CONFIG)
  else:
    out["use_sliding_window"] = False
  if kind == "qwen3_moe":
    out.update(num_experts=int(cfg.n_experts), num_experts_per_tok=int(cfg.experts_per_token),
               moe_intermediate_size=int(cfg.d_ff), norm_topk_prob=bool(cfg.route_renormalize),
               decoder_sparse_step=1, mlp_only_layers=[])
  return out


def _attention(cfg: ModelConfig, p: str, k: tuple) -> Iterator[Group]:
  d, h, g, e = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  yield _linear(p + "q_proj.weight", (h * e, d), k + ("wq_DxHxE",), (d, h, e))
  yield _linear(p + "k_proj.weight", (g * e, d), k + ("wk_DxGxE",), (d, g, e))
  yield _linear(p + "v_proj.weight", (g * e, d), k + ("wv_DxGxE",), (d, g, e))
  yield _linear(p + "o_proj.weight", (d, h * e), k + ("wo_HxExD",), (h, e, d))
  if cfg.attention_bias:
    yield _same(p + "q_proj.bias", k + ("bq_HxE",), (h, e), (h * e,))
    yield _same(p + "k_proj.bias", k + ("bk_GxE",), (g, e), (g * e,))
    yield _same(p + "v_proj.bias", k + ("bv_GxE",), (g, e), (g * e,))
    yield _same(p + "o_proj.bias", k + ("bo_D",), (d,))
  if cfg.attention_sinks:
    yield _same(p + "sinks", k + ("sinks_H",), (h,))
  if cfg.qk_norm:
    yield _same(p + "q_norm.weight", k + ("q_norm_E",), (e,))
    yield _same(p + "k_norm.weight", k + ("k_norm_E",), (e,))


def _gpt_oss_experts(cfg: ModelConfig, p: str, k: tuple) -> Iterator[Group]:
  d, f, x = cfg.d_model, cfg.d_ff, cfg.n_experts
  yield _linear(p + "router.weight", (x, d), k + ("router_DxX",), (d, x))
  yield _same(p + "router.bias", k + ("router_bias_X",), (x,))
  if cfg.expert_weights == "mxfp4":
    shapes = moe.param_shapes(cfg)
    for stored, name in (("gate_up_proj", "gate_up"), ("down_proj", "down")):
      for part, letters in (("blocks", "XxOxZx16"), ("scales", "XxOxZ")):
        param = f"{name}_{part}_{letters}"
        yield _same(f"{p}experts.{stored}_{part}", k + (param,), shapes[param], packed=True)
  else:
    yield _interleaved(p + "experts.gate_up_proj", (x, d, 2 * f), (k + ("w_gate_XxDxF",),
                                                                   k + ("w_up_XxDxF",)), (x, d, f))
    yield _same(p + "experts.down_proj", k + ("w_down_XxFxD",), (x, f, d))
  yield _interleaved(p + "experts.gate_up_proj_bias", (x, 2 * f), (k + ("b_gate_XxF",),
                                                                    k + ("b_up_XxF",)), (x, f))
  yield _same(p + "experts.down_proj_bias", k + ("b_down_XxD",), (x, d))


def _mlp(cfg: ModelConfig, kind: str, p: str, k: tuple) -> Iterator[Group]:
  d, f, x = cfg.d_model, cfg.d_ff, cfg.n_experts
  if not x:
    yield _linear(p + "gate_proj.weight", (f, d), k + ("w_gate_DxF",), (d, f))
    yield _linear(p + "up_proj.weight", (f, d), k + ("w_up_DxF",), (d, f))
    yield _linear(p + "down_proj.weight", (d, f), k + ("w_down_FxD",), (f, d))
    return
  k = k + ("moe",)
  if kind == "gpt_oss":
    yield from _gpt_oss_experts(cfg, p, k)
    return
  yield _linear(p + "gate.weight", (x, d), k + ("router_DxX",), (d, x))
  for proj, hf_shape, name, shape in (("gate_proj", (f, d), "w_gate_XxDxF", (x, d, f)),
                                      ("up_proj", (f, d), "w_up_XxDxF", (x, d, f)),
                                      ("down_proj", (d, f), "w_down_XxFxD", (x, f, d))):
    yield _stacked([f"{p}experts.{j}.{proj}.weight" for j in range(x)], hf_shape, k + (name,),
                   shape)


def tensor_groups(cfg: ModelConfig, kind: str) -> Iterator[Group]:
  """Every parameter of a ModelConfig's model, with its HF tensors in family `kind`'s names."""
  d, v = cfg.d_model, cfg.vocab_size
  yield _same("model.embed_tokens.weight", ("embed_VxD",), (v, d))
  for i in range(cfg.n_layers):
    p, k = f"model.layers.{i}.", ("layers", i)
    yield _same(p + "input_layernorm.weight", k + ("attn_norm_D",), (d,))
    yield from _attention(cfg, p + "self_attn.", k)
    yield _same(p + "post_attention_layernorm.weight", k + ("mlp_norm_D",), (d,))
    yield from _mlp(cfg, kind, p + "mlp.", k)
  yield _same("model.norm.weight", ("final_norm_D",), (d,))
  if not cfg.tie_embeddings:
    yield _linear("lm_head.weight", (v, d), ("unembed_DxV",), (d, v))
