"""Test settings shared by every test: CPU and strict rank promotion.

float64 references are computed in numpy, so jax stays in its default 32-bit mode here, as in runs.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
