"""Loss kernels: the fused top-k KL distillation loss on the lm_head and evaluation statistics.

Shape letters: B batch, T positions, N flattened positions, C chunk of positions, D model width,
V vocabulary, K cached top-k entries.

Modules: loss (public API, definitions), objectives (per-position math shared by the chunked
impls), reference (dense jnp), xla (scan over chunks), fused (impl "pallas": the logits matmul
with exp fused, kernel in mgpu), pallas (impl "pallas_exact": Triton passes over the float32
logits), paper (the paper's fused algorithm, as a baseline).
"""
from kdjax.kernels.loss import IMPLS, position_stats, topk_kl_loss

__all__ = ["IMPLS", "position_stats", "topk_kl_loss"]
