"""Tests of d3p.minibatch: API, validation, determinism, Poisson masks, Feistel.

The statistical uniformity tests are in test_minibatch_uniformity.py.
"""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import d3p.random
from d3p import minibatch
from d3p.minibatch import (
    ADD_REMOVE,
    SUBSTITUTE,
    BatchifyState,
    FixedSizeSampler,
    PoissonSampler,
    WithReplacementSampler,
    batch_size_to_q,
    feistel_permutation,
    poisson_batchify_data,
    poisson_max_batch_size,
    poisson_overflow_delta,
    poisson_overflow_probability,
    q_to_batch_size,
    split_batchify_data,
    subsample_batchify_data,
    take_batch,
)

from _sampler_draws import draw_all


# B = N > 1 (the loop collecting every index) is PoissonSampler(17, 1.0) below,
# and FixedSizeSampler(17, 16) in test_minibatch_uniformity.py
FIXED_CASES = {"fixed_1_1": (1, 1), "fixed_1000_128": (1000, 128), "fixed_1e8_64": (10**8, 64)}
DETERMINISM_CASES = {
    "fixed_1000_128": FixedSizeSampler(1000, 128),
    "poisson_100": PoissonSampler(100, 0.5, max_batch_size=55),
    "replace_20_5": WithReplacementSampler(20, 5),
}


@pytest.fixture(scope="module")
def draws():
    """Every sample this module checks statistically, drawn once per module."""
    samplers = {name: (FixedSizeSampler(*case), 200, 0) for name, case in FIXED_CASES.items()}
    samplers.update({
        # q=0.5, at most 55 of N=100: P(K > 55) = 0.14, truncated; K ~ 35..55 otherwise
        "poisson_100": (DETERMINISM_CASES["poisson_100"], 40000, 5),
        "replace_20_5": (DETERMINISM_CASES["replace_20_5"], 20000, 1),
        "poisson_truncate": (PoissonSampler(100, 0.5, max_batch_size=5), 40000, 4),
        "poisson_empty": (PoissonSampler(100, 1e-4), 2000, 3),
        "poisson_all": (PoissonSampler(17, 1.0), 50, 0),
    })
    return draw_all(samplers)


# ----------------------------------------------------------------------------
# samplers: basic properties


@pytest.mark.parametrize("name", list(FIXED_CASES))
def test_fixed_size_distinct_in_range(draws, name):
    """Also (N, B) = (10, 3) and (17, 16) in test_minibatch_uniformity.py (more in its
    slow step), whose subset and sequence codes require distinct indices in range."""
    num_records, batch_size = FIXED_CASES[name]
    indices, mask = draws[name]
    assert indices.shape == mask.shape == (200, batch_size)
    assert indices.dtype == np.int32 and mask.dtype == bool
    assert mask.all()
    assert indices.min() >= 0 and indices.max() < num_records
    assert all(len(set(row)) == batch_size for row in indices.tolist())


@pytest.mark.parametrize("name", list(DETERMINISM_CASES))
def test_sample_deterministic_and_different_keys(draws, name):
    """The eager call, and batch i of the compiled vmapped program, are the same
    function of the key; another key gives another batch."""
    sampler = DETERMINISM_CASES[name]
    indices, mask = draws[name]
    seed = {"fixed_1000_128": 0, "poisson_100": 5, "replace_20_5": 1}[name]
    key = d3p.random.fold_in(d3p.random.PRNGKey(seed), 0)
    a = sampler.sample(key)
    np.testing.assert_array_equal(a[0], indices[0])
    np.testing.assert_array_equal(a[1], mask[0])
    b = sampler.sample(key)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    c = sampler.sample(d3p.random.fold_in(d3p.random.PRNGKey(seed), 1))
    np.testing.assert_array_equal(c[0], indices[1])
    assert not np.array_equal(a[0], c[0])


def test_sampler_attributes():
    s = FixedSizeSampler(1000, 10)
    assert (s.relation, s.q, s.expected_batch_size, s.max_batch_size) == (SUBSTITUTE, 0.01, 10, 10)
    p = PoissonSampler(1000, 0.01)
    assert (p.relation, p.q, p.expected_batch_size) == (ADD_REMOVE, 0.01, 10.0)
    assert p.max_batch_size == poisson_max_batch_size(1000, 0.01)
    assert p.overflow_probability <= minibatch.DEFAULT_OVERFLOW_PROBABILITY
    w = WithReplacementSampler(1000, 10)
    assert w.relation is None and w.max_batch_size == 10
    assert SUBSTITUTE == "substitute" and ADD_REMOVE == "add_remove"
    # hashable: usable as static jit arguments
    assert hash(s) == hash(FixedSizeSampler(1000, 10)) and s == FixedSizeSampler(1000, 10)


def test_debug_suite_works():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        key = d3p.random.debug.PRNGKey(0)
    for sampler in (FixedSizeSampler(50, 7), PoissonSampler(50, 0.2), WithReplacementSampler(50, 7)):
        indices, mask = jax.jit(lambda k: sampler.sample(k, d3p.random.debug))(key)
        assert indices.shape == mask.shape == (sampler.max_batch_size,)
        assert indices.min() >= 0 and indices.max() < 50


def test_with_replacement_uniform_per_index(draws):
    indices, _ = draws["replace_20_5"]
    counts = np.bincount(indices.ravel(), minlength=20)
    assert stats.chisquare(counts).pvalue > 1e-4


# ----------------------------------------------------------------------------
# batchify wrappers


def test_subsample_batchify_tuple_in_tuple_out_and_jit():
    x = np.arange(10.0)
    y = np.arange(20.0).reshape(10, 2)
    x0, y0 = x.copy(), y.copy()
    init, get_batch = subsample_batchify_data((x, y), batch_size=3)
    num_batches, state = init(d3p.random.PRNGKey(0))
    assert num_batches == 3 and isinstance(state, BatchifyState)
    bx, by = get_batch(1, state)
    jx, jy = jax.jit(get_batch)(jnp.int32(1), state)
    np.testing.assert_array_equal(bx, jx)
    np.testing.assert_array_equal(by, jy)
    np.testing.assert_array_equal(by[:, 0], 2 * bx)  # rows stay aligned
    assert get_batch.sampler == FixedSizeSampler(10, 3) and init.sampler is get_batch.sampler
    # batch i uses fold_in(key, i)
    indices, _ = get_batch.sampler.sample(d3p.random.fold_in(state.rng_key, 1))
    np.testing.assert_array_equal(bx, x[np.asarray(indices)])
    np.testing.assert_array_equal(x, x0)
    np.testing.assert_array_equal(y, y0)


def test_subsample_batchify_single_array_and_list():
    init, get_batch = subsample_batchify_data(np.arange(10.0), q=0.3)
    _, state = init(d3p.random.PRNGKey(0))
    batch = get_batch(0, state)
    assert isinstance(batch, jax.Array) and batch.shape == (3,)
    init, get_batch = subsample_batchify_data([np.arange(10.0)], batch_size=3)
    batch = get_batch(0, init(d3p.random.PRNGKey(0))[1])
    assert isinstance(batch, tuple) and batch[0].shape == (3,)


def test_subsample_batchify_with_replacement():
    init, get_batch = subsample_batchify_data((np.arange(20.0),), batch_size=5, with_replacement=True)
    assert get_batch.sampler == WithReplacementSampler(20, 5)
    (batch,) = get_batch(0, init(d3p.random.PRNGKey(0))[1])
    assert batch.shape == (5,)


def test_poisson_batchify():
    x = np.arange(100.0)
    init, get_batch = poisson_batchify_data((x,), q=0.5, max_batch_size=55)
    num_batches, state = init(d3p.random.PRNGKey(0))
    assert num_batches == 2 and get_batch.sampler == PoissonSampler(100, 0.5, 55)
    (batch,), mask = jax.jit(get_batch)(jnp.int32(2), state)
    m = get_batch.sampler.max_batch_size
    assert batch.shape == mask.shape == (m,)
    indices, mask2 = get_batch.sampler.sample(d3p.random.fold_in(state.rng_key, 2))
    np.testing.assert_array_equal(mask, mask2)
    np.testing.assert_array_equal(batch, x[np.asarray(indices)])


def test_take_batch():
    data = (np.arange(5), np.arange(10).reshape(5, 2))
    a, b = take_batch(data, jnp.array([4, 0]))
    np.testing.assert_array_equal(a, [4, 0])
    np.testing.assert_array_equal(b, [[8, 9], [0, 1]])
    np.testing.assert_array_equal(take_batch(np.arange(5), jnp.array([1])), [1])


# ----------------------------------------------------------------------------
# Poisson specifics


@pytest.mark.parametrize("name", ["poisson_100", "poisson_truncate", "poisson_empty", "poisson_all"])
def test_poisson_mask_is_prefix_and_indices_distinct(draws, name):
    indices, mask = draws[name]
    count = mask.sum(axis=1)
    np.testing.assert_array_equal(mask, np.arange(mask.shape[1])[None, :] < count[:, None])
    assert all(len(set(row)) == len(row) for row in indices.tolist())
    assert indices.min() >= 0 and indices.max() < (17 if name == "poisson_all" else 100)


def test_poisson_empty_batches_give_no_nan(draws):
    sampler = PoissonSampler(100, 1e-4)
    indices, mask = draws["poisson_empty"]
    empty = ~mask.any(axis=1)
    assert empty.sum() > 1900  # P(K = 0) = 0.99
    data = jnp.linspace(-1.0, 1.0, 100)
    batch = jnp.take(data, indices, axis=0)
    total = jnp.sum(jnp.where(mask, batch, 0.0), axis=1) / sampler.expected_batch_size
    assert np.isfinite(np.asarray(total)).all()
    assert np.all(np.asarray(total)[empty] == 0.0)


def test_poisson_q_one_takes_everything(draws):
    indices, mask = draws["poisson_all"]
    assert mask.all() and all(sorted(row) == list(range(17)) for row in indices.tolist())


def test_poisson_truncation_is_uniform_and_frequency_matches(draws):
    """q=0.5, max 5 of N=100: overflow almost surely; the 5 kept records are uniform."""
    sampler = PoissonSampler(100, 0.5, max_batch_size=5)
    assert sampler.overflow_probability > 0.999
    indices, mask = draws["poisson_truncate"]
    assert mask.all()
    counts = np.bincount(indices.ravel(), minlength=100)
    assert counts[:50].min() > 0
    assert stats.chisquare(counts).pvalue > 1e-4


def test_poisson_overflow_probability_matches_sampler(draws):
    sampler = PoissonSampler(100, 0.5, max_batch_size=55)
    p = sampler.overflow_probability
    assert p == pytest.approx(stats.binom.sf(55, 100, 0.5))
    _, mask = draws["poisson_100"]
    full = mask.all(axis=1).sum()  # K >= 55
    expected = stats.binom.sf(54, 100, 0.5)
    assert stats.binomtest(int(full), 40000, expected).pvalue > 1e-4


@pytest.mark.parametrize("num_records,q", [(1000, 0.1), (10**6, 1e-4), (137, 0.9), (50, 0.02)])
def test_binomial_table_matches_pmf(num_records, q):
    m = poisson_max_batch_size(num_records, q)
    hi, lo, finite = minibatch._binomial_thresholds(num_records, q, m)
    t = [(int(h) << 32 | int(l)) if f else 2**64 for h, l, f in zip(hi, lo, finite)]
    implied = np.diff(np.array([0] + t, dtype=object)).astype(float) / 2.0**64
    pmf = stats.binom.pmf(np.arange(m + 1), num_records, q)
    np.testing.assert_allclose(implied, pmf, rtol=1e-10, atol=2e-19)


@pytest.mark.parametrize("num_records,q,p", [(1000, 0.01, 1e-18), (100, 0.5, 1e-12), (10**8, 1.28e-6, 1e-18), (7, 0.3, 0.01)])
def test_poisson_max_batch_size_is_smallest(num_records, q, p):
    m = poisson_max_batch_size(num_records, q, p)
    assert poisson_overflow_probability(num_records, q, m) <= p
    if m > 1:
        assert poisson_overflow_probability(num_records, q, m - 1) > p


def test_poisson_overflow_delta():
    p = poisson_overflow_probability(1001, 0.01, 30)
    d = poisson_overflow_delta(1000, 0.01, 30, num_steps=1000, epsilon=1.0)
    assert d == pytest.approx((1 + math.e) * 1000 * p)
    assert poisson_overflow_probability(10, 0.5, 10) == 0.0


# ----------------------------------------------------------------------------
# conversions


@pytest.mark.parametrize("q,n,expected", [(0.29, 100, 29), (0.07, 100, 7), (0.015, 100, 1), (1e-6, 100, 1), (1.0, 7, 7), (0.333, 10, 3)])
def test_q_to_batch_size(q, n, expected):
    assert q_to_batch_size(q, n) == expected


def test_batch_size_to_q():
    assert batch_size_to_q(3, 12) == 0.25


# ----------------------------------------------------------------------------
# validation


@pytest.mark.parametrize("call,match", [
    (lambda: FixedSizeSampler(100, 101), r"batch_size to be an integer in \[1, 100\], got batch_size=101"),
    (lambda: FixedSizeSampler(100, 0), r"batch_size=0"),
    (lambda: FixedSizeSampler(100, 2.5), r"batch_size=2.5"),
    (lambda: FixedSizeSampler(0, 1), r"num_records=0"),
    (lambda: PoissonSampler(100, 0.0), r"q to be a finite number in \(0, 1\], got q=0.0"),
    (lambda: PoissonSampler(100, 1.5), r"q=1.5"),
    (lambda: PoissonSampler(100, float("nan")), r"q=nan"),
    (lambda: PoissonSampler(100, 0.1, max_batch_size=101), r"max_batch_size=101"),
    (lambda: subsample_batchify_data((np.zeros(3), np.zeros(4)), batch_size=1), r"same number of records.*\[3, 4\]"),
    (lambda: subsample_batchify_data((), batch_size=1), r"empty dataset"),
    (lambda: subsample_batchify_data(np.zeros((0, 2)), batch_size=1), r"N=0"),
    (lambda: subsample_batchify_data(np.zeros(5), batch_size=6), r"batch_size=6"),
    (lambda: subsample_batchify_data(np.zeros(5), batch_size=2, q=0.1), r"exactly one of batch_size and q"),
    (lambda: subsample_batchify_data(np.zeros(5)), r"exactly one of batch_size and q"),
    (lambda: subsample_batchify_data(np.zeros(5), q=-0.1), r"q=-0.1"),
    (lambda: poisson_batchify_data(np.zeros(5), q=2.0), r"q=2.0"),
    (lambda: split_batchify_data(np.zeros(5), 0), r"batch_size=0"),
    (lambda: q_to_batch_size(0.0, 10), r"q=0.0"),
    (lambda: batch_size_to_q(11, 10), r"batch_size=11"),
    (lambda: poisson_max_batch_size(10, 0.5, overflow_probability=1.0), r"overflow_probability=1.0"),
])
def test_bad_input_raises_value_error_naming_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("call", [
    lambda: FixedSizeSampler(10.0, 1),
    lambda: FixedSizeSampler(True, 1),
    lambda: PoissonSampler(10, "0.1"),
    lambda: PoissonSampler(10, True),
])
def test_bad_types_raise_type_error(call):
    with pytest.raises(TypeError):
        call()


# ----------------------------------------------------------------------------
# Feistel permutation and split_batchify_data


# 1 (three of the four values of 2 bits walk), 5 and 1025 (odd numbers of bits)
# in the default step; 2 and 17 in the slow step
@pytest.mark.parametrize("n", [1, pytest.param(2, marks=pytest.mark.slow), 5,
                               pytest.param(17, marks=pytest.mark.slow), 1025])
def test_feistel_is_bijection(n):
    key = d3p.random.PRNGKey(n)
    out = np.asarray(jax.jit(lambda k: feistel_permutation(k, jnp.arange(n), n))(key))
    np.testing.assert_array_equal(np.sort(out), np.arange(n))


def test_split_batchify_epoch_is_disjoint_cover():
    x = np.arange(103.0)
    init, get_batch = split_batchify_data((x,), 10)
    num_batches, state = init(d3p.random.PRNGKey(0))
    assert num_batches == 10 and get_batch.sampler is None
    jitted = jax.jit(get_batch)
    seen = np.concatenate([np.asarray(jitted(i, state)[0]) for i in range(num_batches)])
    assert len(set(seen.tolist())) == 100
    _, other = init(d3p.random.PRNGKey(1))
    assert not np.array_equal(jitted(0, state)[0], jitted(0, other)[0])
