"""kdjax.kernels.grouped: the padded layout, the grouped-matmul kernels (Mosaic GPU's interpreter
here) and their XLA reference against float64 group-by-group matmuls, values and both gradients;
the MoE layer through the kernels against the same layer through the reference."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdjax.kernels import grouped
from kdjax.models import moe
from kdjax.models.llama import ModelConfig

T = grouped.INTERPRET_TILES


def make_inputs(rng, sizes, k, n, dtype, transpose_rhs=False):
  """(lhs_PxK, rhs, groups, x_YxK float64, w_XxKxN float64, d_out_YxN float64)."""
  sizes = np.asarray(sizes, np.int32)
  rows, experts = int(sizes.sum()), len(sizes)
  groups = grouped.layout(jnp.asarray(sizes), rows, T.bm)
  x = rng.standard_normal((rows, k))
  w = rng.standard_normal((experts, k, n)) * k ** -0.5
  d_out = rng.standard_normal((rows, n))
  p = grouped.padded_rows(rows, experts, T.bm)
  lhs = jnp.zeros((p, k), dtype).at[groups.row_Y].set(jnp.asarray(x, dtype))
  rhs = jnp.asarray(w.transpose(0, 2, 1) if transpose_rhs else w, dtype)
  # The float64 side sees the rounded inputs.
  x, w = (np.asarray(jnp.asarray(a, dtype), np.float64) for a in (x, w))
  return lhs, rhs, groups, x, w, d_out


def float64_reference(sizes, x, w, d_out):
  """(out_YxN, d_x_YxK, d_w_XxKxN) group by group."""
  ends = np.cumsum(sizes)
  out, d_x, d_w = np.zeros((len(x), w.shape[2])), np.zeros_like(x), np.zeros_like(w)
  for e, (start, end) in enumerate(zip(ends - sizes, ends)):
    out[start:end] = x[start:end] @ w[e]
    d_x[start:end] = d_out[start:end] @ w[e].T
    d_w[e] = x[start:end].T @ d_out[start:end]
  return out, d_x, d_w


def test_layout(rng):
  sizes = np.array([70, 0, 64, 1, 0, 129], np.int32)
  groups = grouped.layout(jnp.asarray(sizes), int(sizes.sum()), T.bm)
  tiles = -(-sizes // T.bm)
  np.testing.assert_array_equal(groups.tiles_X, tiles)
  np.testing.assert_array_equal(groups.tile_start_X, np.cumsum(tiles) - tiles)
  m = grouped.padded_rows(int(sizes.sum()), len(sizes), T.bm) // T.bm
  expected = np.full(m, -1)
  expected[:tiles.sum()] = np.repeat(np.arange(len(sizes)), tiles)
  np.testing.assert_array_equal(groups.tile_expert_M, expected)
  row = np.asarray(groups.row_Y)
  assert len(set(row)) == len(row)  # disjoint
  for e, (start, end) in enumerate(zip(np.cumsum(sizes) - sizes, np.cumsum(sizes))):
    np.testing.assert_array_equal(row[start:end], groups.tile_start_X[e] * T.bm + np.arange(
        end - start))  # each group from the start of its first tile, in order


@pytest.mark.parametrize("dtype,transpose_rhs", [(jnp.bfloat16, False), (jnp.bfloat16, True),
                                                 (jnp.float16, False)],
                         ids=["bf16-KxN", "bf16-NxK", "f16-KxN"])
def test_kernels_match_float64(transpose_rhs, dtype, rng):
  # Groups: partial tiles, an empty one, an exact multiple of the tile, one row; N = 192 takes
  # 192-column tiles, K = 128 two contraction steps.
  sizes = [70, 0, 64, 1, 41]
  lhs, rhs, groups, x, w, d_out = make_inputs(rng, sizes, 128, 192, dtype, transpose_rhs)
  matmul = functools.partial(grouped.grouped_matmul, groups=groups, transpose_rhs=transpose_rhs,
                             force=True, t=T)
  assert grouped.applies(lhs, rhs, groups.bm, T)
  out, vjp = jax.vjp(matmul, lhs, rhs)
  d_out_p = jnp.zeros(out.shape, dtype).at[groups.row_Y].set(jnp.asarray(d_out, dtype))
  d_lhs, d_rhs = vjp(d_out_p)
  d_out = np.asarray(jnp.asarray(d_out, dtype), np.float64)
  want_out, want_dx, want_dw = float64_reference(np.asarray(sizes), x, w, d_out)
  if transpose_rhs:
    want_dw = want_dw.transpose(0, 2, 1)
  assert out.dtype == d_lhs.dtype == d_rhs.dtype == dtype
  row = np.asarray(groups.row_Y)
  padding = np.setdiff1d(np.arange(out.shape[0]), row)
  for got, want in ((np.asarray(out, np.float64)[row], want_out),
                    (np.asarray(d_lhs, np.float64)[row], want_dx),
                    (np.asarray(d_rhs, np.float64), want_dw)):
    # float32 accumulation, one rounding to the 16-bit dtype at the end
    np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=2 ** -7 * np.abs(want).max())
  assert not np.asarray(out, np.float64)[padding].any()  # padding and tiles of no expert: zeros
  assert not np.asarray(d_lhs, np.float64)[padding].any()


def test_reference_path_matches_float64(rng):
  # float32 never takes the kernels: the reference (ragged_dot), gradients by autodiff.
  sizes = [5, 0, 17]
  lhs, rhs, groups, x, w, d_out = make_inputs(rng, sizes, 24, 40, jnp.float32)
  assert not grouped.applies(lhs, rhs, groups.bm, T)
  out, vjp = jax.vjp(functools.partial(grouped.grouped_matmul, groups=groups, force=True), lhs,
                     rhs)
  d_lhs, d_rhs = vjp(jnp.zeros(out.shape).at[groups.row_Y].set(jnp.asarray(d_out, jnp.float32)))
  want_out, want_dx, want_dw = float64_reference(np.asarray(sizes), x, w, d_out)
  row = np.asarray(groups.row_Y)
  for got, want in ((np.asarray(out)[row], want_out), (np.asarray(d_lhs)[row], want_dx),
                    (np.asarray(d_rhs), want_dw)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_applies_needs_widths_the_tiles_divide():
  groups = grouped.layout(jnp.asarray([3, 4]), 7, T.bm)
  lhs = jnp.zeros((grouped.padded_rows(7, 2, T.bm), 128), jnp.bfloat16)
  assert grouped.applies(lhs, jnp.zeros((2, 128, 192), jnp.bfloat16), groups.bm, T)
  assert not grouped.applies(lhs, jnp.zeros((2, 128, 100), jnp.bfloat16), groups.bm, T)
  assert not grouped.applies(lhs[:, :96], jnp.zeros((2, 96, 128), jnp.bfloat16), groups.bm, T)
  assert not grouped.applies(lhs, jnp.zeros((2, 128, 192), jnp.float32), groups.bm, T)


MOE = ModelConfig(vocab_size=97, d_model=64, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=32,
                  d_ff=64, n_experts=4, experts_per_token=2, route_renormalize=True,
                  expert_bias=True, swiglu_limit=0.5, dtype="bfloat16")


@pytest.mark.parametrize("weights", ["float", "mxfp4"])
def test_moe_through_kernels_matches_reference(weights, rng, monkeypatch):
  cfg = dataclasses.replace(MOE, expert_weights=weights)
  layer = moe.MoE(cfg, 1.0, rngs=nnx.Rngs(0))
  for _, var in nnx.to_flat_state(nnx.state(layer, nnx.Param)):
    var.set_value(jnp.asarray(0.3 * rng.standard_normal(var.shape), var.dtype))
  y = jnp.asarray(rng.standard_normal((1, 29, cfg.d_model)), jnp.bfloat16)

  def run(force):
    monkeypatch.setattr(grouped, "grouped_matmul", functools.partial(ORIGINAL, force=force, t=T))
    loss = lambda m, y: jnp.sum(m(y).astype(jnp.float32) ** 2)
    # gradients: the float parameters (router, biases; experts unless packed) and the input
    return nnx.jit(lambda m, y: m(y))(layer, y), nnx.grad(loss, argnums=(0, 1))(layer, y)

  calls = []
  monkeypatch.setattr(grouped, "gmm", lambda *a, **k: calls.append(1) or GMM(*a, **k))
  got, got_grad = run(True)
  assert calls  # the kernels ran
  want, want_grad = run(False)
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  np.testing.assert_allclose(got, want, rtol=2 ** -6, atol=2 ** -6 * np.abs(want).max())
  for g, w in zip(jax.tree.leaves(got_grad), jax.tree.leaves(want_grad)):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    np.testing.assert_allclose(g, w, rtol=2 ** -5, atol=2 ** -5 * np.abs(w).max())


ORIGINAL, GMM = grouped.grouped_matmul, grouped.gmm
