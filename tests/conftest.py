"""Test settings shared by every test: CPU, strict rank promotion, float64 available."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_enable_x64", True)  # float64 references; kdjax code never relies on it
