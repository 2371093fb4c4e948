"""The device mesh on GPUs (GPU only; `JAX_PLATFORMS=cuda python -m pytest tests/test_mesh_gpu.py`).

The fused loss (impl "pallas", Mosaic GPU) with the vocabulary split over this machine's GPUs
under shard_map against the whole vocabulary on one: on one GPU the split is 1 way, which still
runs the kernels under shard_map and the cross-shard combination (CPU tests cover impls "xla"
and "pallas_exact" split 4 ways: Mosaic GPU's interpreter cannot run on several CPU devices at
once). With two or more GPUs, every mesh shape's grad_step against one GPU's, without and
with FP8 projections. The SwiGLU kernel (kdjax/kernels/swiglu.py) on each GPU's rows, split by
XLA's partitioner, against the reference.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from kdjax.kernels import swiglu as swiglu_lib
from kdjax.loss import topk_kl

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="runs on GPUs only")


@pytest.mark.parametrize("far", [False, True])
def test_fused_loss_with_vocabulary_split_over_gpus(far):
  n = jax.local_device_count()
  mesh = Mesh(np.asarray(jax.local_devices()), ("tensor",))
  rng = np.random.default_rng(0)
  rows, dim, vocab, k = 1000, 256, n * 2048, 100
  w = rng.normal(size=(dim, vocab)) * 0.05
  if far:  # the first shard's logits far above the rest (the fused path's shift, the row floor)
    w[:, :vocab // max(n, 2)] *= 30.0
  h, w = jnp.asarray(rng.normal(size=(rows, dim)), jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
  ids = jnp.asarray(np.stack([rng.choice(vocab, k, replace=False) for _ in range(rows)]))
  logp = jnp.asarray(-np.sort(rng.exponential(2.0, (rows, k)), -1) - 0.5, jnp.float32)
  mask = jnp.asarray(rng.random(rows) > 0.2)
  labels = jnp.asarray(rng.integers(0, vocab, rows))

  def loss(h, w, axis=None):
    return topk_kl.topk_kl_loss(h, w, ids, logp, mask, objective="tail", labels=labels,
                                ce_weight=0.2, impl="pallas", chunk_size=256, return_aux=True,
                                per_position=True, vocab_axis=axis)

  grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(h, w)
  (want, want_aux), want_grads = grad(loss)
  (got, got_aux), got_grads = grad(jax.shard_map(
      lambda h, w: loss(h, w, "tensor"), mesh=mesh, in_specs=(P(), P(None, "tensor")),
      out_specs=(P(), P()), check_vma=False))
  rel = lambda a, b: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
                           / jnp.max(jnp.abs(b.astype(jnp.float32))))
  assert rel(got, want) < 1e-5
  for name in ("kl", "ce", "entropy"):
    assert rel(got_aux["positions"][name], want_aux["positions"][name]) < 1e-4, name
  assert rel(got_grads[0], want_grads[0]) < 1e-2 and rel(got_grads[1], want_grads[1]) < 1e-2


def test_grad_step_over_mesh_shapes_matches_one_gpu():
  n = jax.device_count()
  if n < 2:
    pytest.skip("needs two or more GPUs")
  from tests.fixtures.mesh_steps import CFG, grad_step_differences
  for fp8 in (False, True):  # FP8 projections: float32 results, so as close as without
    cfg = dataclasses.replace(CFG, fp8_matmuls=fp8)
    for shape, diffs in grad_step_differences([(n, 1, 1), (1, n, 1), (1, 1, n)], cfg).items():
      assert diffs["grads"] < 1e-4 and diffs["metrics"] < 1e-5, (fp8, shape, diffs)


def test_swiglu_kernel_partitioned_over_gpus():
  """A teacher's layout over the GPUs (parallel.teacher_mesh): rows over "fsdp", the weights along
  F too; the kernel runs on each GPU's rows (on one GPU the op is inlined)."""
  n = jax.local_device_count()
  mesh = Mesh(np.asarray(jax.local_devices()).reshape(1, n, 1), ("data", "fsdp", "tensor"))
  rng = np.random.default_rng(0)
  y = jnp.asarray(rng.normal(size=(1000, 512)), jnp.bfloat16)
  w_gate, w_up = (jnp.asarray(rng.normal(size=(512, 1024)) * 512 ** -0.5, jnp.bfloat16)
                  for _ in range(2))
  args = (jax.device_put(y, NamedSharding(mesh, P("fsdp", None))),
          *(jax.device_put(w, NamedSharding(mesh, P(None, "fsdp"))) for w in (w_gate, w_up)))
  got = jax.jit(swiglu_lib.swiglu)(*args)
  if n > 1:
    assert got.sharding.spec[0] == "fsdp", got.sharding
  want = swiglu_lib.swiglu_reference(y, w_gate, w_up).astype(jnp.float32)
  err = float(jnp.max(jnp.abs(jnp.asarray(got, jnp.float32) - want)) / jnp.max(jnp.abs(want)))
  assert err < 2 ** -7
