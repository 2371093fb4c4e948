"""Pallas kernels, each beside its plain jnp reference (tests assert kernel == reference).

  logit_passes  row passes over a chunk's float32 logits (Triton): exp_pass, dense_grad; their
                references exp_pass_reference, dense_grad_reference. Run by kdjax.loss.projection
                and kdjax.loss.chunked.
  mgpu          the logits matmul writing exp in its epilogue (Mosaic GPU, Hopper): logits_exp;
                reference logits_exp_reference. Run by kdjax.loss.fused.
  grouped       the grouped matmuls of a mixture of experts (Mosaic GPU): grouped_matmul;
                reference grouped_matmul_reference (jax.lax.ragged_dot). Run by models/moe.py.
  swiglu        the dense MLP's gate and up matmuls with the gating in their epilogue (Mosaic
                GPU): swiglu; reference swiglu_reference. Run by models/llama.py (mlp_impl).
  mosaic        what the Mosaic GPU kernels share: where they run, their grid, shared-memory
                layouts, the epilogue's tiled store.

Off GPU every kernel runs in its interpreter, so CPU tests cover the same code. Nothing here
imports the rest of kdjax.
"""
