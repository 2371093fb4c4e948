"""A stand-in teacher: two fixed matrices following the model contract (hidden states from tokens
and positions, `lm_head_DxV()`), for the cache's tests and fault benchmark
(experiments/studies/cache_faults.py). A process builds it in milliseconds, and caches written by
separate processes agree, since its weights come from a fixed seed; the cache logic does not
depend on the model (tests/test_teacher.py tests the real one).

Shape letters (ARCHITECTURE.md): B batch, T positions, D width, V vocabulary.
"""
import jax.numpy as jnp
import numpy as np
from flax import nnx


class StandIn(nnx.Module):
  """hidden = 3 tanh((embed[tokens] + 0.1 position) mix), zero on padding; lm_head = embed^T."""

  def __init__(self, vocab: int = 64, dim: int = 16):
    rng = np.random.default_rng(0)
    self.embed_VxD = nnx.Param(jnp.asarray(rng.normal(size=(vocab, dim)), jnp.float32))
    self.mix_DxD = nnx.Param(jnp.asarray(rng.normal(size=(dim, dim)) / 4, jnp.float32))

  def __call__(self, tokens_BxT, positions_BxT, segment_ids_BxT, max_documents=None):
    del max_documents  # no attention
    x_BxTxD = self.embed_VxD[...][tokens_BxT] + 0.1 * positions_BxT[..., None]
    return 3.0 * jnp.tanh(x_BxTxD @ self.mix_DxD[...]) * (segment_ids_BxT > 0)[..., None]

  def lm_head_DxV(self):
    return self.embed_VxD[...].T
