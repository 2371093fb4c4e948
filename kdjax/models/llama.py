"""Decoder-only transformer in Flax NNX: Llama 3.x, Qwen3, Qwen3-MoE and gpt-oss.

Shape letters: B batch, T query positions, S key positions (same tokens as T), D model width,
V vocabulary, H query heads, G key/value heads, R query heads per key/value head (H = G * R),
E head dim, F feed-forward width (per expert in MoE layers), X experts.

One block for every family: pre-norm attention (optional q/k norm, q/k/v/o biases, attention
sinks, sliding window) and a SwiGLU MLP, dense or a mixture of experts (kdjax/models/moe.py).
Parameter layouts follow Hugging Face's math (rotate-half RoPE, RMSNorm in float32, SwiGLU), so
checkpoints convert by transposes and reshapes only (see kdjax/models/hf.py).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kdjax import choices
from kdjax.kernels import mosaic, swiglu as swiglu_lib
from kdjax.models import attention as attention_lib, fp8, moe, remat as remat_lib, rope

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
assert tuple(DTYPES) == choices.DTYPES, "kdjax.choices.DTYPES"
MLP_IMPLS = choices.MLP_IMPLS
# Fields that say how a model runs, not what it is: a checkpoint resumes under other values, a
# config group sets them for a Hugging Face checkpoint's model too, and a pruned student keeps
# its own.
RUNTIME = ("remat", "attention_impl", "mlp_impl", "fp8_matmuls")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shapes and numerics of one model. Hashable: it is static metadata of the NNX module.

  The owner of the model's fields: a config's teacher and student groups are these fields (with
  these defaults, kdjax.config.model_group) plus `hf_path`, read back by `from_config`.
  """
  vocab_size: int = 0         # embedding rows, may include padding rows (config: 0 = tokenizer's)
  d_model: int = 256          # D, residual width
  n_layers: int = 4           # transformer blocks
  n_heads: int = 4            # H, query heads
  n_kv_heads: int = 2         # G, key/value heads (grouped-query attention)
  head_dim: int = 64          # E, per-head width
  d_ff: int = 768             # F, SwiGLU hidden width
  rope_theta: float = 10000.0  # RoPE base
  rope_scaling: Any = None    # None, or a llama3 or yarn dict (kdjax/models/rope.py)
  norm_eps: float = 1e-5      # RMSNorm epsilon
  tie_embeddings: bool = False  # lm_head = embedding.T
  qk_norm: bool = False       # Qwen3: RMSNorm over E on queries and keys before RoPE
  dtype: str = "float32"      # activation / matmul dtype
  param_dtype: str = "float32"  # parameter storage dtype
  # What each block keeps for its backward pass (kdjax/models/remat.py): "full" (recompute the
  # block: least memory), "names", "dots", "offload", "none" (keep all: fastest), "auto".
  remat: str = "full"
  attention_impl: str = "auto"  # "auto" (cuDNN on GPU in bf16, else einsum), "einsum", "cudnn"
  # The dense MLP's gate and up matmuls: "xla" (two GEMMs and a fusion), "pallas" (one Mosaic
  # GPU kernel with the gating in its epilogue, kdjax/kernels/swiglu.py: bf16 only, d_model %
  # 64 and d_ff % 128; for forward passes such as the teacher's, its backward recomputes both),
  # or "auto" ("pallas" where it applies on a GPU, else "xla"; the teachers' default).
  mlp_impl: str = "xla"
  # The block's projections (q, k, v, o and the dense MLP's gate, up, down) on FP8 tensor cores
  # (kdjax/models/fp8.py: e4m3 operands, e5m2 gradients, one power-of-two scale per tensor);
  # embeddings, the loss head, the attention and experts stay in dtype. Off: dtype throughout.
  fp8_matmuls: bool = False
  # Mixtures of experts (Qwen3-MoE, gpt-oss): every layer's MLP is n_experts SwiGLU experts of
  # width d_ff, experts_per_token of them per token (kdjax/models/moe.py). 0: dense MLP.
  n_experts: int = 0          # X, experts per layer (0 = dense)
  experts_per_token: int = 0  # routed experts per token (top-k of the router)
  route_renormalize: bool = True  # selected experts' weights sum to 1 (softmax over their logits)
  expert_bias: bool = False   # router and experts have biases (gpt-oss)
  swiglu_limit: float = 0.0   # > 0: gpt-oss's clamped SwiGLU in the experts (see moe.py)
  swiglu_alpha: float = 1.702  # its sigmoid gain
  expert_weights: str = "float"  # "float" or "mxfp4" (packed e2m1 + e8m0 scales, uint8)
  attention_bias: bool = False  # q/k/v/o projections have biases (gpt-oss)
  attention_sinks: bool = False  # a learned per-head logit in the softmax denominator (gpt-oss)
  sliding_window: int = 0     # > 0: even layers (0, 2, ...) see only the last this many keys
  # Ids >= real_vocab_size are padding rows of the embedding table (e.g. Qwen's 151936 rows for
  # 151669 tokens); lm_head_DxV() drops them so they never enter a softmax. None: all rows real.
  # Set by kdjax.models.hf from the checkpoint's tokenizer, not read from configs.
  real_vocab_size: int | None = None

  def __post_init__(self):
    # FrozenDict (or None) keeps the config hashable: jit caches on the module's static metadata.
    object.__setattr__(self, "rope_scaling", rope.scaling(self.rope_scaling))
    object.__setattr__(self, "remat", remat_lib.normalize(self.remat))

  @classmethod
  def config_fields(cls) -> list[dataclasses.Field]:
    """The fields a config group sets (all but real_vocab_size, which comes from tokenizers)."""
    return [f for f in dataclasses.fields(cls) if f.name != "real_vocab_size"]

  def mlp_kernel(self) -> bool:
    """Whether the dense MLP runs swiglu's kernel: "pallas", or "auto" where it applies (a GPU,
    bf16, dense, widths its tiles take)."""
    if self.mlp_impl != "auto":
      return self.mlp_impl == "pallas"
    return mosaic.on_gpu() and self._mlp_kernel_refusal() is None

  def _mlp_kernel_refusal(self) -> str | None:
    """Why swiglu's kernel cannot run this model's MLP, or None."""
    if self.fp8_matmuls:
      return "computes in bf16; this model has fp8_matmuls on"
    if self.dtype != "bfloat16" or self.n_experts:
      return (f"runs a dense MLP in bfloat16; this model has dtype {self.dtype!r} and "
              f"{self.n_experts} experts")
    t = swiglu_lib.GPU_TILES
    if not swiglu_lib.fits(self.d_model, self.d_ff, t):
      return (f"needs d_model % {t.bk} == 0 and d_ff % {t.bn} == 0, got {self.d_model} and "
              f"{self.d_ff}")
    return None

  @classmethod
  def runtime_of(cls, group) -> dict:
    """A config group's RUNTIME fields: how its model runs, a Hugging Face checkpoint's too."""
    return {name: group[name] for name in RUNTIME}

  @classmethod
  def from_config(cls, group, vocab_size: int | None = None, where: str = "") -> "ModelConfig":
    """Reads the fields of ModelConfig from an ml_collections group (extras such as hf_path
    ignored); vocab_size replaces the group's. Errors name fields as `where` + name."""
    values = {f.name: group[f.name] for f in cls.config_fields()}
    if hasattr(values["rope_scaling"], "to_dict"):
      values["rope_scaling"] = values["rope_scaling"].to_dict()
    if vocab_size is not None:
      values["vocab_size"] = vocab_size
    return cls(**values).validate(where)

  def validate(self, where: str = "") -> "ModelConfig":
    """Raises ValueError naming the field (prefixed by `where`, e.g. "student.")."""
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff"):
      value = getattr(self, name)
      if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{where}{name} must be a positive integer, got {value!r}.")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"{where}n_heads ({self.n_heads}) must be a multiple of {where}n_kv_heads "
                       f"({self.n_kv_heads}) for grouped-query attention.")
    if self.head_dim % 2:
      raise ValueError(f"{where}head_dim must be even for RoPE, got {self.head_dim}.")
    if not self.rope_theta > 0 or not self.norm_eps > 0:
      raise ValueError(f"{where}rope_theta and {where}norm_eps must be positive, got "
                       f"{self.rope_theta}, {self.norm_eps}.")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in DTYPES:
        raise ValueError(f"{where}{name} must be one of {tuple(DTYPES)}, "
                         f"got {getattr(self, name)!r}.")
    if self.remat not in remat_lib.CHOICES:
      raise ValueError(f"{where}remat must be one of {remat_lib.CHOICES}, got {self.remat!r}.")
    if self.attention_impl not in attention_lib.IMPLS:
      raise ValueError(f"{where}attention_impl must be one of {attention_lib.IMPLS}, got "
                       f"{self.attention_impl!r}.")
    if self.mlp_impl not in MLP_IMPLS:
      raise ValueError(f"{where}mlp_impl must be one of {MLP_IMPLS}, got {self.mlp_impl!r}.")
    if self.mlp_impl == "pallas" and (why := self._mlp_kernel_refusal()):
      raise ValueError(f"{where}mlp_impl 'pallas' {why}: use 'xla'.")
    moe.validate(self, where)
    if self.sliding_window < 0:
      raise ValueError(f"{where}sliding_window must be >= 0 (0: none), got {self.sliding_window}.")
    if self.real_vocab_size is not None and not 0 < self.real_vocab_size <= self.vocab_size:
      raise ValueError(f"real_vocab_size ({self.real_vocab_size}) must be in "
                       f"[1, vocab_size={self.vocab_size}].")
    return self

  @property
  def output_vocab_size(self) -> int:
    """Columns of lm_head_DxV(): the real vocabulary, without padding rows."""
    return self.vocab_size if self.real_vocab_size is None else self.real_vocab_size


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  # float32 statistics and scale, as in Hugging Face's Llama/Qwen3, then back to compute dtype.
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  weight = weight.astype(jnp.float32).reshape((1,) * (x.ndim - 1) + weight.shape)
  return (x32 * weight).astype(x.dtype)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _init_arrays(key: jax.Array, specs: tuple, dtype: str) -> dict[str, jax.Array]:
  """One compiled call per distinct spec (eager per-array init compiles once per shape)."""
  keys = jax.random.split(key, len(specs))
  return {name: (jnp.ones(shape, DTYPES[dtype]) if std is None else
                 (std * jax.random.normal(k, shape, jnp.float32)).astype(DTYPES[dtype]))
          for k, (name, shape, std) in zip(keys, specs)}


def _init_params(module: nnx.Module, rngs: nnx.Rngs, specs: tuple, dtype: str) -> None:
  """Sets module.<name> = Param for each (name, shape, std); std None means ones (norm scales),
  0.0 zeros (biases)."""
  for name, value in _init_arrays(rngs.params(), specs, dtype).items():
    setattr(module, name, nnx.Param(value))


class Block(nnx.Module):
  """Pre-norm layer: x + attn(norm(x)); x + mlp(norm(x)), the MLP a dense SwiGLU or experts."""

  def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
    d, h, g, e, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
    out_std = 1.0 / math.sqrt(2 * cfg.n_layers)  # residual branches sum over 2 * n_layers
    self.cfg = cfg
    # Static: keys a query sees in this layer (0: all of its document's earlier ones).
    self.window = cfg.sliding_window if layer % 2 == 0 else 0
    specs = (("attn_norm_D", (d,), None),
             ("wq_DxHxE", (d, h, e), d ** -0.5),
             ("wk_DxGxE", (d, g, e), d ** -0.5),
             ("wv_DxGxE", (d, g, e), d ** -0.5),
             ("wo_HxExD", (h, e, d), (h * e) ** -0.5 * out_std),
             ("mlp_norm_D", (d,), None))
    if not cfg.n_experts:
      specs += (("w_gate_DxF", (d, f), d ** -0.5),
                ("w_up_DxF", (d, f), d ** -0.5),
                ("w_down_FxD", (f, d), f ** -0.5 * out_std))
    if cfg.qk_norm:
      specs += (("q_norm_E", (e,), None), ("k_norm_E", (e,), None))
    if cfg.attention_bias:
      specs += (("bq_HxE", (h, e), 0.0), ("bk_GxE", (g, e), 0.0), ("bv_GxE", (g, e), 0.0),
                ("bo_D", (d,), 0.0))
    if cfg.attention_sinks:
      specs += (("sinks_H", (h,), 0.0),)
    _init_params(self, rngs, specs, cfg.param_dtype)
    if cfg.n_experts:
      self.moe = moe.MoE(cfg, out_std, rngs=rngs)

  def _matmul(self, spec: str, x, w: nnx.Param):
    """A projection, x times w in the compute dtype: through FP8 if cfg.fp8_matmuls."""
    return fp8.matmul(spec, x, w[...].astype(DTYPES[self.cfg.dtype]), self.cfg.fp8_matmuls)

  def _project(self, y_BxTxD, name: str, bias: str):
    dt = DTYPES[self.cfg.dtype]
    out = self._matmul("btd,dhe->bthe", y_BxTxD, getattr(self, name))
    return out + getattr(self, bias)[...].astype(dt)[None, None] if self.cfg.attention_bias else out

  def __call__(self, x_BxTxD, positions_BxT, segment_ids_BxT, inv_freq, max_documents,
               taps: dict | None = None):
    """taps: a dict that receives the inner activations pruning measures (models/prune.py):
    the normed inputs y_attn_BxTxD and y_mlp_BxTxD, the heads' outputs a_BxTxHxE (before wo)
    and the SwiGLU's h_BxTxF. Unread, they cost nothing under jit."""
    taps = {} if taps is None else taps
    cfg = self.cfg
    dt = DTYPES[cfg.dtype]
    y_BxTxD = taps["y_attn_BxTxD"] = rms_norm(x_BxTxD, self.attn_norm_D[...], cfg.norm_eps)
    q_BxTxHxE = self._project(y_BxTxD, "wq_DxHxE", "bq_HxE")
    k_BxTxGxE = self._project(y_BxTxD, "wk_DxGxE", "bk_GxE")
    v_BxTxGxE = self._project(y_BxTxD, "wv_DxGxE", "bv_GxE")
    if cfg.qk_norm:
      q_BxTxHxE = rms_norm(q_BxTxHxE, self.q_norm_E[...], cfg.norm_eps)
      k_BxTxGxE = rms_norm(k_BxTxGxE, self.k_norm_E[...], cfg.norm_eps)
    rope_scale = rope.attention_factor(cfg)
    q_BxTxHxE = remat_lib.name(rope.apply(q_BxTxHxE, positions_BxT, inv_freq, rope_scale), "query")
    k_BxTxGxE = remat_lib.name(rope.apply(k_BxTxGxE, positions_BxT, inv_freq, rope_scale), "key")
    v_BxTxGxE = remat_lib.name(v_BxTxGxE, "value")
    a_BxTxHxE = attention_lib.attention(
        q_BxTxHxE, k_BxTxGxE, v_BxTxGxE, segment_ids_BxT, cfg.attention_impl, max_documents,
        sinks_H=self.sinks_H[...] if cfg.attention_sinks else None, window=self.window)
    a_BxTxHxE = taps["a_BxTxHxE"] = remat_lib.name(a_BxTxHxE, "attention")
    o_BxTxD = self._matmul("bthe,hed->btd", a_BxTxHxE, self.wo_HxExD)
    if cfg.attention_bias:
      o_BxTxD = o_BxTxD + self.bo_D[...].astype(dt)[None, None]
    x_BxTxD = x_BxTxD + o_BxTxD

    y_BxTxD = taps["y_mlp_BxTxD"] = rms_norm(x_BxTxD, self.mlp_norm_D[...], cfg.norm_eps)
    if cfg.n_experts:
      return x_BxTxD + self.moe(y_BxTxD)
    if cfg.mlp_kernel():
      b, t, d = y_BxTxD.shape
      h_BxTxF = swiglu_lib.swiglu(y_BxTxD.reshape(b * t, d), self.w_gate_DxF[...].astype(dt),
                                  self.w_up_DxF[...].astype(dt)).reshape(b, t, -1)
    else:
      gate_BxTxF = remat_lib.name(self._matmul("btd,df->btf", y_BxTxD, self.w_gate_DxF),
                                  "mlp_gate")
      up_BxTxF = remat_lib.name(self._matmul("btd,df->btf", y_BxTxD, self.w_up_DxF), "mlp_up")
      h_BxTxF = jax.nn.silu(gate_BxTxF) * up_BxTxF
    taps["h_BxTxF"] = h_BxTxF
    return x_BxTxD + self._matmul("btf,fd->btd", h_BxTxF, self.w_down_FxD)


class Transformer(nnx.Module):
  """Embedding, n_layers Blocks (rematerialised as cfg.remat says), final RMSNorm; lm_head
  apart."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    cfg.validate()
    self.cfg = cfg
    # std 0.02 as Hugging Face initialises Llama; with tied embeddings it also keeps the
    # initial logits O(1) since the final norm output has unit scale per feature.
    specs = (("embed_VxD", (cfg.vocab_size, cfg.d_model), 0.02),
             ("final_norm_D", (cfg.d_model,), None))
    if not cfg.tie_embeddings:
      specs += (("unembed_DxV", (cfg.d_model, cfg.vocab_size), cfg.d_model ** -0.5),)
    _init_params(self, rngs, specs, cfg.param_dtype)
    self.layers = nnx.List([Block(cfg, i, rngs=rngs) for i in range(cfg.n_layers)])

  def __call__(self, tokens_BxT, positions_BxT, segment_ids_BxT,
               max_documents: int | None = None) -> jax.Array:
    """Returns hidden_BxTxD after the final norm, in the compute dtype.

    max_documents: a static bound on the segment ids (documents.documents_bound of the host
    batch); needed by the cuDNN attention, ignored by the einsum reference.
    """
    cfg = self.cfg
    dt = DTYPES[cfg.dtype]
    inv_freq = rope.inv_freq(cfg)
    x_BxTxD = jnp.take(self.embed_VxD[...], tokens_BxT, axis=0).astype(dt)
    run_block = remat_lib.wrap(
        lambda block, x, pos, seg: block(x, pos, seg, inv_freq, max_documents), cfg.remat)
    for block in self.layers:
      x_BxTxD = run_block(block, x_BxTxD, positions_BxT, segment_ids_BxT)
    return rms_norm(x_BxTxD, self.final_norm_D[...], cfg.norm_eps)

  def lm_head_DxV(self) -> jax.Array:
    """Output projection [D, V] in the compute dtype (tied: embedding.T), real vocabulary only."""
    cfg = self.cfg
    w_DxV = self.embed_VxD[...].T if cfg.tie_embeddings else self.unembed_DxV[...]
    return w_DxV[:, :cfg.output_vocab_size].astype(DTYPES[cfg.dtype])


def count_params(model: nnx.Module) -> int:
  """Number of parameters (tied embeddings counted once)."""
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def matmul_params_per_layer(cfg: ModelConfig) -> int:
  """Matmul parameters a token goes through in one block: the attention's projections and the
  MLP's (of an MoE layer, the router and the experts_per_token experts)."""
  d, h, g, e, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
  mlp = 3 * d * f * cfg.experts_per_token + d * cfg.n_experts if cfg.n_experts else 3 * d * f
  return d * h * e * 2 + d * g * e * 2 + mlp


def rerun_matmul_params_per_layer(cfg: ModelConfig, policy: str) -> int:
  """Of matmul_params_per_layer, those one block's backward pass runs through again under the
  remat policy: under "full" and "attention" all but the MLP's down projection, whose output the
  backward never reads; under "names" and "offload" the attention's output projection (the MLP's
  norm reads the residual it adds to); none under the others (counted in the gradient's program
  by tests/test_models.py)."""
  down = cfg.d_ff * cfg.d_model * (cfg.experts_per_token if cfg.n_experts else 1)
  out = cfg.n_heads * cfg.head_dim * cfg.d_model
  every = matmul_params_per_layer(cfg) - down
  return {"full": every, "attention": every, "names": out, "offload": out}.get(policy, 0)


def flops_per_token(cfg: ModelConfig, context: float) -> float:
  """Model training FLOPs per token (forward + backward): 6 N + 12 L H E c.

  N counts matmul parameters (the lm_head included, the embedding lookup not; of an MoE layer,
  the router and the experts_per_token experts a token runs through); c is the mean
  number of keys a query attends to (documents.mean_context: causal, within its document), so
  the attention term counts the score blocks a causal, document-masked kernel computes. Remat
  recomputation is not counted (model FLOPs). PaLM's MFU convention is c = T (the full matrix).
  """
  n = cfg.n_layers * matmul_params_per_layer(cfg) + cfg.d_model * cfg.output_vocab_size
  return 6.0 * n + 12.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * context
