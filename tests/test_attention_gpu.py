"""cuDNN packed attention against the einsum reference, forward and backward (GPU only).

Run on a GPU with `JAX_PLATFORMS=cuda python -m pytest tests/test_attention_gpu.py`; skipped on
CPU. The reference runs each document alone in float32, so a 32K row needs no [T, T] scores.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdjax.models import attention

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu",
                                reason="cuDNN attention runs on a GPU only")

H, G, E = 24, 8, 128  # Llama-3.2-3B's heads


def packed_rows(rng, b, t, docs):
  """`docs` documents of unequal length per row, then up to 5% padding."""
  seg = np.zeros((b, t), np.int32)
  for row in seg:
    end = t - rng.integers(0, t // 20 + 1)
    cuts = np.sort(rng.choice(np.arange(1, end), size=docs - 1, replace=False))
    bounds = [0, *cuts, end]
    for d in range(docs):
      row[bounds[d]:bounds[d + 1]] = d + 1
  return seg


def reference(q, k, v, seg, cotangent):
  """Output and (dq, dk, dv) in float32, one document at a time."""
  out, grads = np.zeros(q.shape, np.float32), [np.zeros(x.shape, np.float32) for x in (q, k, v)]
  for b in range(seg.shape[0]):
    for d in range(1, seg[b].max() + 1):
      idx = np.nonzero(seg[b] == d)[0]
      s, e = idx[0], idx[-1] + 1
      part = lambda x: jnp.asarray(x[b:b + 1, s:e], jnp.float32)
      ones = jnp.ones((1, e - s), jnp.int32)
      o, vjp = jax.vjp(lambda q_, k_, v_: attention.attention_einsum(q_, k_, v_, ones),
                       part(q), part(k), part(v))
      out[b, s:e] = np.asarray(o[0])
      for g, dx in zip(grads, vjp(part(cotangent))):
        g[b, s:e] = np.asarray(dx[0])
  return out, grads


@pytest.mark.parametrize("b,t,docs", [(2, 1000, 1), (2, 2048, 5), (3, 1000, 3), (1, 32768, 4)])
def test_cudnn_packed_matches_einsum(b, t, docs):
  rng = np.random.default_rng()
  seed = int(rng.integers(1 << 30))
  print("seed", seed)
  rng = np.random.default_rng(seed)
  seg = packed_rows(rng, b, t, docs)
  q, k, v, cot = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
                  for shape in ((b, t, H, E), (b, t, G, E), (b, t, G, E), (b, t, H, E)))
  bound = attention.documents_bound(seg)
  fn = jax.jit(lambda q_, k_, v_: attention.attention(q_, k_, v_, jnp.asarray(seg), "cudnn",
                                                       bound))
  out, vjp = jax.vjp(fn, q, k, v)
  grads = vjp(cot)
  ref_out, ref_grads = reference(*(np.asarray(x, np.float32) for x in (q, k, v)), seg,
                                 np.asarray(cot, np.float32))
  pad = seg == 0
  assert (np.asarray(out)[pad] == 0).all()
  for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads)):
    got = np.asarray(got, np.float32)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    print(name, err)
    assert err < 1e-2, (name, err)  # bf16 operands
