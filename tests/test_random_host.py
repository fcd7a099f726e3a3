"""d3p.random.normal_float64: float64 normals on the host from the suite's words,
the same with or without jax_enable_x64, with the law and the tails it states."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

import d3p.random
from d3p.random.host import _normal_of_words

N = 200_000


@pytest.fixture(scope="module")
def normals():
    return d3p.random.normal_float64(d3p.random.PRNGKey(20241127), (N,))


def test_float64_the_same_with_and_without_x64():
    key = d3p.random.PRNGKey(7)
    with jax.enable_x64(False):
        off = d3p.random.normal_float64(key, (3, 5))
    with jax.enable_x64(True):
        on = d3p.random.normal_float64(key, (3, 5))
    assert off.dtype == np.float64 and off.shape == (3, 5) and isinstance(off, np.ndarray)
    assert np.array_equal(off, on)
    assert np.array_equal(off, d3p.random.normal_float64(key, (3, 5)))  # deterministic
    assert not np.array_equal(off, d3p.random.normal_float64(d3p.random.PRNGKey(8), (3, 5)))
    assert d3p.random.normal_float64(key, (0, 4)).shape == (0, 4)
    assert d3p.random.normal_float64(key, 4).shape == (4,)


def test_is_the_suites_float64_normal():
    """The same words and transform as d3p.random.normal in float64 under x64 (two
    ndtri implementations: equal up to their last bits)."""
    key = d3p.random.PRNGKey(11)
    host = d3p.random.normal_float64(key, (50_000,))
    with jax.enable_x64(True):
        ref = np.asarray(d3p.random.normal(key, (50_000,), jnp.float64))
    assert ref.dtype == np.float64
    np.testing.assert_allclose(host, ref, rtol=1e-13, atol=1e-300)


def test_law_is_standard_normal_and_other_scales_are_rejected(normals):
    """KS accepts N(0, 1) and rejects 2/3 and 3/2 of its scale; mean and variance within
    five standard errors."""
    assert scipy.stats.kstest(normals, "norm").pvalue > 1e-3
    for wrong in (2 / 3, 3 / 2):
        assert scipy.stats.kstest(normals / wrong, "norm").pvalue < 1e-6
    assert abs(normals.mean()) < 5 / np.sqrt(N)
    assert abs(normals.var() - 1) < 5 * np.sqrt(2 / N)
    assert abs(np.mean(normals > 0) - 0.5) < 5 * 0.5 / np.sqrt(N)  # the sign bit


def _magnitude(k):
    """The magnitude at lattice index ``k`` of the tail probability (``p = (k + 0.5) / 2**63``)."""
    k = np.asarray(k, np.uint64)
    hi = ((k >> np.uint64(32)) << np.uint64(1)).astype(np.uint32)  # sign bit 0
    lo = (k & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    return _normal_of_words(hi, lo)


def _index(m):
    """The lattice index whose magnitude is about ``m``."""
    return np.uint64(int(2 * scipy.stats.norm.sf(m) * 2.0**63))


def test_magnitudes_are_monotone_and_reach_the_stated_tails():
    top = _magnitude([0, 2**63 - 1])
    assert 9.15 < top[0] < 9.16 and top[1] == 0.0
    rng = np.random.default_rng(0)
    for k in [np.sort(rng.integers(0, 2**63 - 1, 200_000, dtype=np.uint64)),
              _index(8.1) - np.uint64(1000) + np.arange(2000, dtype=np.uint64),
              np.uint64(2**63 - 2000) + np.arange(2000, dtype=np.uint64),
              np.arange(2000, dtype=np.uint64)]:
        assert np.all(np.diff(_magnitude(k)) <= 0)
    words = np.arange(8, dtype=np.uint32)
    assert np.array_equal(_normal_of_words(words | 1, words), -_normal_of_words(words & ~np.uint32(1), words))


@pytest.mark.parametrize("m, gap, tail", [(8.1, 2.0**-13 / 4, 5.5e-16), (7.4, 2.0**-21 / 4, 1.4e-13)])
def test_attainable_magnitudes_are_dense_where_the_docstring_says(m, gap, tail):
    """Consecutive attainable magnitudes are closer than ``gap`` up to ``m`` (the gaps grow
    with the magnitude), and ``P(|Z| >= m)`` is below ``tail``: the figures that
    d3p.twin.marginal._measure's guarantee quotes."""
    k = _index(m)
    a, b = _magnitude([k, k + np.uint64(1)])
    assert m - 1e-3 < a < m + 1e-3 and 0 < a - b < gap
    assert 2 * scipy.stats.norm.sf(m) < tail


def test_arguments_are_checked():
    key = d3p.random.PRNGKey(0)
    with pytest.raises(ValueError, match="key=None"):
        d3p.random.normal_float64(None, (3,))
    with pytest.raises(ValueError, match=r"shape\[0\]"):
        d3p.random.normal_float64(key, (-1,))
    with pytest.raises(TypeError, match="shape"):
        d3p.random.normal_float64(key, "3")
    with pytest.raises(TypeError, match="rng_suite"):
        d3p.random.normal_float64(key, (3,), rng_suite="d3p.random")


def test_debug_suite():
    with pytest.warns(d3p.random.debug.DebugRNGWarning):
        key = d3p.random.debug.PRNGKey(0)
    z = d3p.random.normal_float64(key, (1000,), rng_suite=d3p.random.debug)
    assert z.dtype == np.float64 and 0.8 < z.std() < 1.2
