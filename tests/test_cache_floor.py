"""experiments/studies/cache_floor.py's measures on inputs whose answers are known by hand (BENCHMARKS.md's
floors of a top-k cache rest on them).

Letters: S rows, T positions, K top-k entries.
"""
import numpy as np
from experiments.studies import cache_floor


def test_tie_order_bits_counts_the_orders_of_equal_levels():
  # Runs of 3, 1 and 2 equal levels among 6 entries: 6! / (3! 1! 2!) = 60 orders.
  np.testing.assert_allclose(cache_floor.tie_order_bits(np.array([[0, 0, 0, 4, 7, 7]])),
                             [np.log2(60)])
  np.testing.assert_allclose(cache_floor.tie_order_bits(np.arange(5)[None]), [np.log2(120)])


def test_against_previous_flags_the_kept_ids_and_gaps_the_new_ones():
  ids_SxTxK = np.array([[[5, 1, 9], [9, 2, 5], [7, 8, 6]]])
  flags, gaps, shared = cache_floor.against_previous(ids_SxTxK)
  # Position 1 keeps 5 and 9 of the previous set [1, 5, 9] (bits 011, most significant first)
  # and adds 2; position 2 keeps nothing of [2, 5, 9].
  np.testing.assert_array_equal(flags[0, :, 0], [0, 0b01100000, 0])
  np.testing.assert_array_equal(gaps[0], [[1, 4, 4], [2, 0, 0], [6, 1, 1]])
  np.testing.assert_array_equal(shared[0], [0, 2, 0])


def test_head_tail_keeps_the_head_in_rank_order_and_the_tail_as_a_set():
  ids_SxTxK = np.array([[[40, 7, 30, 3, 12]]])
  n_SxTxK = np.array([[[0, 5, 9, 11, 11]]])
  stored_ids, stored_levels, heads = cache_floor.head_tail(ids_SxTxK, n_SxTxK, last=20,
                                                           threshold_level=9)
  np.testing.assert_array_equal(heads, [[2]])
  # Head: ids 40, 7 as they are, level gaps 0, 5. Tail: ids 3, 12, 30 ascending as gaps from 0,
  # their levels counted from the last (20 - 11, 20 - 11, 20 - 9).
  np.testing.assert_array_equal(stored_ids[0, 0], [40, 7, 3, 9, 18])
  np.testing.assert_array_equal(stored_levels[0, 0], [0, 5, 9, 9, 11])


def test_levels_decode_within_their_step_and_diffusion_keeps_most_of_the_mass(rng):
  s, p0 = 2.0**-12, 2.0**-5
  p_NxK = -np.sort(-rng.dirichlet(np.ones(400), size=256), axis=-1)[:, :100]
  mass_errors = []
  for diffuse in (False, True):
    n, decoded, last = cache_floor.levels(np.log(p_NxK).astype(np.float32), s, p0, diffuse)
    assert (np.diff(n, axis=-1) >= 0).all() and n.max() <= last
    if not diffuse:  # each entry within half a step (p + p0) s / 2, float32 log-probs aside
      assert (np.abs(decoded - p_NxK) <= (p_NxK + p0) * s * 0.51).all()
    mass_errors.append(np.abs(decoded.sum(-1) - p_NxK.sum(-1)).mean())
  # Diffusion leaves the carry it cannot spend without lifting an entry above the one before
  # (0.10-0.12 of the plain rounding's mass error on these inputs, 20 seeds).
  assert mass_errors[1] <= 0.25 * mass_errors[0]
