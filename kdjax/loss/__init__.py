"""The distillation loss: the fused top-k KL on the lm_head (its per-position terms also serve
evaluation), the full-vocabulary KL and the hidden-state term.

Shape letters: B batch, T positions, N flattened positions, C chunk of positions, D model width,
V vocabulary, K cached top-k entries.

Modules: topk_kl (public API, definitions, the impls' table), objectives (per-position math and the
types every impl shares), projection (a chunk's logits and exp pass, the contract every chunked
impl fills), chunked (the scan over position chunks every chunked impl runs; impls "xla" and
"pallas_exact": the driver with kdjax.kernels.logit_passes' references or kernels), fused (impl
"pallas": the driver with the logits matmul and exp fused, the Mosaic GPU kernel
kdjax.kernels.mgpu), reference (impl "reference": dense jnp), paper (impl "paper": the paper's
algorithm, a benchmark baseline); full_kl: the full-vocabulary KL with the teacher's logits at hand
(the online reference); hidden: the hidden-state matching term against the teacher's cached final
hidden states; settings: `LossSettings`, the static loss arguments of a jitted step.
"""
from kdjax.loss.settings import LossSettings
from kdjax.loss.topk_kl import IMPLS, has_position_terms, topk_kl_loss

__all__ = ["IMPLS", "LossSettings", "has_position_terms", "topk_kl_loss"]
