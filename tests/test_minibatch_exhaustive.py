"""Exhaustive checks of the exact integer primitive behind the samplers (pytest -m slow)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from d3p.minibatch import _uniform_below


@pytest.mark.parametrize("n", [1, 3, 10, 1_000_003])
def test_uniform_below_small_domains_exhaustive_prefix(n):
    """On all words below 2**20, accepted outputs satisfy Lemire's invariants."""
    words = jnp.arange(2**20, dtype=jnp.uint32)
    values, accepted = jax.jit(_uniform_below, static_argnums=1)(words, n)
    values, accepted = np.asarray(values), np.asarray(accepted)
    w = np.arange(2**20, dtype=np.uint64)
    np.testing.assert_array_equal(values, (w * n) >> np.uint64(32))
    np.testing.assert_array_equal(accepted, ((w * n) & np.uint64(2**32 - 1)) >= (2**32) % n)


@pytest.mark.slow
@pytest.mark.parametrize("n", [3, 1_000_003, 2**31 - 1])
def test_uniform_below_exactly_uniform_over_all_words(n):
    """Over all 2**32 words every value in [0, n) is accepted exactly floor(2**32 / n) times."""
    chunk = 2**26

    @jax.jit
    def counts_of(start):
        words = start + jnp.arange(chunk, dtype=jnp.uint32)
        values, accepted = _uniform_below(words, n)
        if n <= 2**21:
            return jnp.zeros(n, jnp.int32).at[values].add(accepted.astype(jnp.int32))
        # too many values to count: check the total and the maximum instead
        return jnp.stack([jnp.sum(accepted.astype(jnp.int32)), jnp.max(jnp.where(accepted, values, -1))])

    total = None
    for k in range(2**32 // chunk):
        c = np.asarray(counts_of(jnp.uint32(k * chunk))).astype(np.int64)
        total = c if total is None else (total + c if n <= 2**21 else np.array([total[0] + c[0], max(total[1], c[1])]))
    if n <= 2**21:
        assert np.all(total == 2**32 // n)
    else:
        assert total[0] == n * (2**32 // n) and total[1] == n - 1
