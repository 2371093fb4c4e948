"""Loss kernels: the fused top-k KL distillation loss on the lm_head (its per-position terms also
serve evaluation).

Shape letters: B batch, T positions, N flattened positions, C chunk of positions, D model width,
V vocabulary, K cached top-k entries.

Modules, by `impl`: loss (public API, definitions, picks the impl), objectives (per-position math
shared by the chunked impls), chunked (the scan over position chunks every chunked impl runs, and
impl "xla"'s XLA passes), fused + mgpu (impl "pallas": the logits matmul with exp fused, a Mosaic
GPU kernel), pallas_exact (impl "pallas_exact": Triton passes over the float32 logits), reference
(impl "reference": dense jnp), paper (impl "paper": the paper's algorithm, a benchmark baseline);
full_kl: the full-vocabulary KL with the teacher's logits at hand (the online reference); hidden:
the hidden-state matching term against the teacher's cached final hidden states.
"""
from kdjax.kernels.loss import IMPLS, has_position_terms, topk_kl_loss

__all__ = ["IMPLS", "has_position_terms", "topk_kl_loss"]
