"""The hidden-state matching term: the student's final hidden states against the teacher's cached
ones, through a learned projection when their widths differ.

  hidden_nmse = sum_{mask} |h W - g|^2 / sum_{mask} |g|^2        (0 if nothing is masked in)

h [D] the student's hidden state after its final norm (what its lm_head reads), W [D, H] the
projection (None: D = H, none), g [H] the teacher's cached state (bf16; whole, or through the
cache's fixed random projection, kdjax.teacher). A mean squared error normalised by the teacher's
mean squared state: the fraction of the teacher's hidden energy the student misses (1 for h W = 0),
so one loss.hidden_weight means the same for any teacher, norm scale or cached width (a random
projection to H of D columns scales each column's values by sqrt(D / H), and a plain MSE with it).
The projection matmul runs in h's dtype with float32 accumulation, the rest in float32. A dense
[N, H] pass: no [N, V] block, so no chunking (at T = 8K, H = 4096: 128 MiB of float32).

Shape letters: N flattened positions, D student width, H cached width.
"""
import jax.numpy as jnp


def hidden_nmse(hidden, target, mask, projection_DxH=None):
  """The normalised squared error of the masked positions (module docstring).

  Args:
    hidden: [..., D] student hidden states.
    target: [..., H] teacher hidden states from the cache.
    mask: [...] bool, positions that count.
    projection_DxH: [D, H] learned projection, or None when D = H.
  Returns:
    float32 scalar, differentiable in hidden and projection_DxH (0 if nothing is masked in).
  """
  width = hidden.shape[-1] if projection_DxH is None else projection_DxH.shape[-1]
  if projection_DxH is not None and projection_DxH.shape[0] != hidden.shape[-1]:
    raise ValueError(f"projection {projection_DxH.shape} does not take hidden [..., D] "
                     f"{hidden.shape}")
  if target.shape != hidden.shape[:-1] + (width,):
    raise ValueError(f"cached hidden states {target.shape} must be [..., H] with H = {width} and "
                     f"the student's batch shape {hidden.shape[:-1]}: the cache's hidden width "
                     f"(cache.hidden_dim) and the student's projection disagree")
  if mask.shape != hidden.shape[:-1]:
    raise ValueError(f"mask {mask.shape} must have the batch shape {hidden.shape[:-1]}")
  dim = hidden.shape[-1]
  hidden_NxD = hidden.reshape(-1, dim)
  if projection_DxH is None:
    pred_NxH = hidden_NxD.astype(jnp.float32)
  else:
    pred_NxH = jnp.dot(hidden_NxD, projection_DxH.astype(hidden_NxD.dtype),
                       preferred_element_type=jnp.float32)
  target_NxH = target.reshape(-1, width).astype(jnp.float32)
  mask_N = mask.reshape(-1).astype(jnp.float32)
  err = jnp.sum(mask_N * jnp.sum(jnp.square(pred_NxH - target_NxH), axis=-1))
  energy = jnp.sum(mask_N * jnp.sum(jnp.square(target_NxH), axis=-1))
  return jnp.where(energy > 0, err / jnp.where(energy > 0, energy, 1.0), 0.0)
