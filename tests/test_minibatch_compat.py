"""Tests of d3p.minibatch's d3p 0.2 interface: masks of full batches, ``q=`` for
split batches, oversized Poisson batches (truncate or suppress), the
max_batch_size quantile (d3p 0.2's value), and PRNG suites checked at the call."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import d3p.random
import d3p.random.chacha
from d3p import _validate, minibatch
from d3p.minibatch import (
    FixedSizeSampler,
    PoissonSampler,
    WithReplacementSampler,
    feistel_permutation,
    poisson_batchify_data,
    q_to_batch_size,
    split_batchify_data,
    subsample_batchify_data,
)

from _sampler_draws import draw_all


def debug_key(seed=0):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return d3p.random.debug.PRNGKey(seed)


DATA = (np.arange(50.0), np.arange(100.0).reshape(50, 2))


# ----------------------------------------------------------------------------
# return_mask and q= for fixed-size and split batches


@pytest.mark.parametrize("make", [
    lambda **kw: subsample_batchify_data(DATA, 7, **kw),
    lambda **kw: subsample_batchify_data(DATA, q=0.14, **kw),
    lambda **kw: subsample_batchify_data(DATA, 7, with_replacement=True, **kw),
    lambda **kw: split_batchify_data(DATA, 7, **kw),
    lambda **kw: split_batchify_data(DATA, q=0.14, **kw),
])
def test_return_mask_gives_the_same_batch_and_a_full_mask(make):
    init, get_batch = make()
    init_m, get_batch_m = make(return_mask=True)
    num_batches, state = init(d3p.random.PRNGKey(4))
    assert num_batches == init_m(d3p.random.PRNGKey(4))[0] == 50 // 7
    for i in (0, 3):
        batch = get_batch(i, state)
        batch_m, mask = get_batch_m(i, state)
        jitted_m, jitted_mask = jax.jit(get_batch_m)(jnp.int32(i), state)
        assert mask.dtype == jnp.bool_ and mask.shape == (7,) and bool(mask.all())
        np.testing.assert_array_equal(mask, jitted_mask)
        for a, b, c in zip(batch, batch_m, jitted_m):
            np.testing.assert_array_equal(a, b)
            np.testing.assert_array_equal(a, c)


def test_return_mask_default_keeps_the_plain_batch():
    # the settings of test_return_mask_gives_the_same_batch_and_a_full_mask: its programs serve here
    init, get_batch = subsample_batchify_data(DATA[0], 7)
    assert get_batch(0, init(d3p.random.PRNGKey(0))[1]).shape == (7,)
    init, get_batch = split_batchify_data(DATA[0], 7)
    assert get_batch(0, init(d3p.random.PRNGKey(0))[1]).shape == (7,)


@pytest.mark.parametrize("q,n", [(0.1, 103), (0.29, 100), (0.5, 7), (1e-6, 20)])
def test_split_batchify_accepts_q(q, n):
    x = np.arange(float(n))
    expected = q_to_batch_size(q, n)
    init, get_batch = split_batchify_data((x,), q=q)
    num_batches, state = init(d3p.random.PRNGKey(0))
    assert num_batches == n // expected
    # the shape without compiling a program per case; the values for one case
    assert jax.eval_shape(get_batch, 0, state)[0].shape == (expected,)
    if q == 0.29:
        by_size = split_batchify_data((x,), expected)[1]
        np.testing.assert_array_equal(get_batch(1, state)[0], by_size(1, state)[0])


@pytest.mark.parametrize("call", [
    lambda: split_batchify_data(np.zeros(10), 2, q=0.2),
    lambda: split_batchify_data(np.zeros(10)),
])
def test_split_batchify_needs_exactly_one_of_batch_size_and_q(call):
    with pytest.raises(ValueError, match="exactly one of batch_size and q"):
        call()


@pytest.mark.parametrize("call,error,match", [
    (lambda: subsample_batchify_data(np.zeros(10), 2, return_mask="yes"), TypeError, r"return_mask='yes'"),
    (lambda: split_batchify_data(np.zeros(10), 2, return_mask=1), TypeError, r"return_mask=1"),
    (lambda: subsample_batchify_data(np.zeros(10), 2, with_replacement="no"), TypeError,
     r"with_replacement='no'"),
    # a suite where with_replacement stands must not turn on sampling with replacement
    (lambda: subsample_batchify_data(np.zeros(10), 2, None, d3p.random), TypeError, r"with_replacement=<module"),
    (lambda: split_batchify_data(np.zeros(10), q=0.0), ValueError, r"q=0.0"),
])
def test_bad_flags_raise_naming_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


# ----------------------------------------------------------------------------
# oversized Poisson batches


N, Q, M = 20, 0.5, 10  # P(K > 10) = 0.41, P(K = 10) = 0.18, P(K = 0) ~ 1e-6
DRAWS = 20000


QUANTILE_SAMPLER = PoissonSampler(200, 0.05, 0.8, "suppress")


@pytest.fixture(scope="module")
def draws():
    """Every sample this module checks, drawn once per module."""
    return draw_all({
        "truncate": (PoissonSampler(N, Q, M), DRAWS, 11),
        "suppress": (PoissonSampler(N, Q, M, handle_oversized_batch="suppress"), DRAWS, 11),
        "no_overflow_suppress": (PoissonSampler(12, 0.3, 12, "suppress"), 300, 2),
        "no_overflow_truncate": (PoissonSampler(12, 0.3, 12), 300, 2),
        "quantile": (QUANTILE_SAMPLER, 4000, 7),
    })


@pytest.fixture(scope="module")
def truncated_and_suppressed(draws):
    return draws["truncate"], draws["suppress"], PoissonSampler(N, Q, M, handle_oversized_batch="suppress")


def _rate_matches(count, p, num=DRAWS):
    """The empirical rate is within 4.5 standard errors of p (which rejects a
    rate off by more than ~0.016 here: P(K >= 10) = 0.59 or P(K > 11) = 0.25)."""
    return abs(count / num - p) <= 4.5 * np.sqrt(p * (1 - p) / num)


def test_truncate_is_the_default_and_unchanged(truncated_and_suppressed):
    (indices, mask), _, _ = truncated_and_suppressed
    explicit = PoissonSampler(N, Q, M, "truncate")
    assert explicit == PoissonSampler(N, Q, M) and explicit.handle_oversized_batch == "truncate"
    # min(K, M) real records, a prefix; full batches (K >= M) at rate P(K >= M)
    full = mask.all(axis=1)
    assert _rate_matches(full.sum(), stats.binom.sf(M - 1, N, Q))
    assert not (~mask).all(axis=1).any()  # no empty batch (P(K = 0) ~ 1e-6)


def test_suppress_empties_exactly_the_oversized_batches(truncated_and_suppressed):
    (t_indices, t_mask), (s_indices, s_mask), suppress = truncated_and_suppressed
    # the same random bits: the same indices, and the same mask unless the batch is oversized
    np.testing.assert_array_equal(s_indices, t_indices)
    empty = ~s_mask.any(axis=1)
    np.testing.assert_array_equal(s_mask[~empty], t_mask[~empty])
    # an emptied batch had K >= M in the truncating run; K = M is kept (full) by both
    assert t_mask[empty].all()
    p = suppress.overflow_probability
    assert p == pytest.approx(stats.binom.sf(M, N, Q))
    assert _rate_matches(empty.sum(), p)
    kept_full = s_mask.all(axis=1).sum()
    assert _rate_matches(kept_full, stats.binom.pmf(M, N, Q))


def test_suppress_without_overflow_is_poisson_sampling(draws):
    """max_batch_size = N: nothing to suppress, the output equals truncation's."""
    a, b = draws["no_overflow_suppress"], draws["no_overflow_truncate"]
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


def test_suppress_in_poisson_batchify_and_jit(draws):
    x = np.arange(float(N))
    init, get_batch = poisson_batchify_data((x,), Q, M, "suppress")
    sampler = get_batch.sampler
    assert sampler.handle_oversized_batch == "suppress" and sampler.max_batch_size == M
    _, state = init(d3p.random.PRNGKey(11))
    # batch i is the sampler's batch of fold_in(key, i): row i of the fixture's draws
    s_indices, s_mask = draws["suppress"]
    outcomes = set()
    jitted = jax.jit(get_batch)
    for i in range(40):
        (batch,), mask = jitted(jnp.int32(i), state)
        np.testing.assert_array_equal(mask, s_mask[i])
        np.testing.assert_array_equal(batch, x[s_indices[i]])
        outcomes.add(int(mask.sum()))
    assert 0 in outcomes and len(outcomes) > 2  # suppressed and ordinary batches


def test_handle_oversized_batch_is_a_hashable_static_setting(draws):
    truncate, suppress = PoissonSampler(N, Q, M), PoissonSampler(N, Q, M, "Suppress ")
    assert suppress == PoissonSampler(N, Q, M, "suppress") and suppress != truncate
    assert hash(suppress) == hash(PoissonSampler(N, Q, M, "suppress"))
    f = jax.jit(lambda sampler, key: sampler.sample(key)[1].sum(), static_argnums=0)
    # batch i of the fixture's draws has the key fold_in(PRNGKey(11), i); the first
    # oversized batch is one where the two settings give different counts
    oversized = int(np.argmax(~draws["suppress"][1].any(axis=1)))
    assert draws["truncate"][1][oversized].all() and not draws["suppress"][1][oversized].any()
    for i in (0, oversized):
        key = d3p.random.fold_in(d3p.random.PRNGKey(11), i)
        counts = {s: int(f(s, key)) for s in (truncate, suppress)}
        assert counts[truncate] == int(draws["truncate"][1][i].sum())
        assert counts[suppress] == int(draws["suppress"][1][i].sum())


@pytest.mark.parametrize("value,error", [("drop", ValueError), ("", ValueError), (None, TypeError),
                                         (1, TypeError)])
def test_bad_handle_oversized_batch_is_rejected(value, error):
    with pytest.raises(error, match=r"handle_oversized_batch.*'truncate'.*'suppress'|"
                                    r"handle_oversized_batch.*'suppress'.*'truncate'"):
        PoissonSampler(N, Q, M, handle_oversized_batch=value)
    with pytest.raises(error, match="handle_oversized_batch"):
        poisson_batchify_data(np.zeros(N), Q, M, value)


# ----------------------------------------------------------------------------
# max_batch_size as a quantile


@pytest.mark.parametrize("n,q,quantile", [
    (100, 0.1, 0.9), (1000, 0.01, 0.99), (50, 0.3, 0.5), (10**6, 1e-4, 0.999), (137, 0.9, 0.75),
    (30, 0.02, 0.5),  # P(K = 0) > 0.5: the quantile is 0, the size 1
    (10, 1.0, 0.3),  # q = 1: every batch has all N records, the size is N
    (12, 0.9, 0.5),  # the quantile is N - 1 = 11: the size N
])
def test_max_batch_size_quantile_is_one_more_than_the_binomial_quantile(n, q, quantile):
    """d3p 0.2's meaning of a float max_batch_size p: the smallest m with P(K < m) >= p."""
    expected = min(n, int(stats.binom.ppf(quantile, n, q)) + 1)
    sampler = PoissonSampler(n, q, quantile)
    assert sampler.max_batch_size == expected and isinstance(sampler.max_batch_size, int)
    assert sampler == PoissonSampler(n, q, expected)
    m = sampler.max_batch_size
    if m < n:  # the smallest m with P(K <= m - 1) >= quantile
        assert stats.binom.cdf(m - 1, n, q) >= quantile
        assert m == 1 or quantile > stats.binom.cdf(m - 2, n, q)
    assert sampler.overflow_probability <= 1 - quantile
    init, get_batch = poisson_batchify_data(np.zeros(n), q, max_batch_size=np.float64(quantile))
    assert get_batch.sampler.max_batch_size == expected
    # the batch's shape, traced without compiling a program per case
    (batch, mask) = jax.eval_shape(get_batch, 0, init(d3p.random.PRNGKey(0))[1])
    assert batch.shape == mask.shape == (expected,)


def test_max_batch_size_quantile_keeps_d3p_02_value():
    """Issue 29 (item 4): d3p 0.2 gave 39 where the 0.9-quantile of K is 38."""
    assert stats.binom.ppf(0.9, 310, 0.1) == 38
    init, get_batch = poisson_batchify_data(np.zeros(310), 0.1, max_batch_size=0.9)
    assert get_batch.sampler.max_batch_size == 39
    assert jax.eval_shape(get_batch, 0, init(d3p.random.PRNGKey(0))[1])[1].shape == (39,)


def test_max_batch_size_quantile_matches_the_empirical_batch_sizes(draws):
    sampler = QUANTILE_SAMPLER
    _, mask = draws["quantile"]
    kept = mask.any(axis=1).sum()  # K <= m (and K > 0), P(K = 0) = 3.5e-5
    assert _rate_matches(kept, stats.binom.cdf(sampler.max_batch_size, 200, 0.05), 4000)
    assert stats.binom.cdf(sampler.max_batch_size - 1, 200, 0.05) >= 0.8


def test_max_batch_size_integer_keeps_meaning_a_size():
    assert PoissonSampler(100, 0.1, 1).max_batch_size == 1
    assert PoissonSampler(100, 0.1, np.int64(30)).max_batch_size == 30
    assert PoissonSampler(100, 0.1, 100).max_batch_size == 100


@pytest.mark.parametrize("value,error", [
    (0.0, ValueError), (1.0, ValueError), (1.5, ValueError), (-0.5, ValueError), (30.0, ValueError),
    (float("nan"), ValueError), (0, ValueError), (101, ValueError), (-3, ValueError),
    ("0.9", TypeError), (True, TypeError), ([0.5], TypeError),
])
def test_bad_max_batch_size_is_rejected(value, error):
    with pytest.raises(error, match=r"Expected max_batch_size to be an integer in \[1, 100\].*"
                                    r"got max_batch_size="):
        PoissonSampler(100, 0.1, value)


# ----------------------------------------------------------------------------
# PRNG suites are checked where they are passed


KEY = d3p.random.PRNGKey(0)


@pytest.mark.parametrize("call", [
    lambda s: subsample_batchify_data(DATA, 10, None, False, s),
    lambda s: subsample_batchify_data(DATA, 10, rng_suite=s),
    lambda s: subsample_batchify_data(DATA, 10, with_replacement=True, rng_suite=s),
    lambda s: split_batchify_data(DATA, 10, None, s),
    lambda s: split_batchify_data(DATA, 10, rng_suite=s),
    lambda s: poisson_batchify_data(DATA, 0.1, None, "truncate", s),
    lambda s: poisson_batchify_data(DATA, 0.1, rng_suite=s),
    lambda s: FixedSizeSampler(10, 3).sample(KEY, s),
    lambda s: FixedSizeSampler(10, 3).sample(KEY, rng_suite=s),
    lambda s: PoissonSampler(10, 0.3).sample(KEY, s),
    lambda s: WithReplacementSampler(10, 3).sample(KEY, rng_suite=s),
    lambda s: feistel_permutation(KEY, jnp.arange(3), 10, 8, s),
    lambda s: feistel_permutation(KEY, jnp.arange(3), 10, rng_suite=s),
])
@pytest.mark.parametrize("suite", ["strong", b"strong", 0, None, np, object()])
def test_a_non_suite_raises_at_the_call(call, suite):
    with pytest.raises(_validate.InvalidArgumentType, match=r"Expected rng_suite to be a PRNG suite"):
        call(suite)


def test_suites_are_accepted_also_as_objects():
    class Suite:
        def __getattr__(self, name):
            return getattr(d3p.random, name)

    indices, mask = FixedSizeSampler(10, 3).sample(KEY, Suite())
    np.testing.assert_array_equal(indices, FixedSizeSampler(10, 3).sample(KEY)[0])


def test_a_suite_passed_positionally_in_place_of_a_setting_is_taken_as_rng_suite():
    """The calls poisson_batchify_data(data, q, max_batch_size, rng_suite) and
    split_batchify_data(data, batch_size, rng_suite) are accepted."""
    key = debug_key(3)
    init, get_batch = poisson_batchify_data(DATA, 0.2, 15, d3p.random.debug)
    assert get_batch.sampler == PoissonSampler(50, 0.2, 15, "truncate")
    reference = poisson_batchify_data(DATA, 0.2, 15, rng_suite=d3p.random.debug)[1]
    state = init(key)[1]
    for a, b in zip(jax.tree_util.tree_leaves(get_batch(1, state)),
                    jax.tree_util.tree_leaves(reference(1, state))):
        np.testing.assert_array_equal(a, b)
    init, get_batch = split_batchify_data(DATA, 10, d3p.random.debug)
    reference = split_batchify_data(DATA, 10, rng_suite=d3p.random.debug)[1]
    np.testing.assert_array_equal(get_batch(2, state)[0], reference(2, state)[0])


@pytest.mark.parametrize("call", [
    lambda: poisson_batchify_data(DATA, 0.2, 15, d3p.random.debug, rng_suite=d3p.random.debug),
    lambda: split_batchify_data(DATA, 10, d3p.random.debug, rng_suite=d3p.random.debug),
])
def test_two_suites_are_refused(call):
    with pytest.raises(ValueError, match="one PRNG suite"):
        call()


# ----------------------------------------------------------------------------
# one copy of the 32x32 -> 64 bit multiply


def test_one_multiply_for_sampling_and_randint():
    assert minibatch.mulhi_u32 is d3p.random.chacha.mulhi_u32
    rng = np.random.default_rng(0)
    a = np.concatenate([rng.integers(0, 2**32, 5000, dtype=np.uint64), [0, 1, 2**32 - 1, 2**31]])
    b = np.concatenate([rng.integers(0, 2**32, 5000, dtype=np.uint64), [2**32 - 1, 2**32 - 1, 2**32 - 1, 2]])
    hi, lo = minibatch.mulhi_u32(jnp.asarray(a, jnp.uint32), jnp.asarray(b, jnp.uint32))
    product = [int(x) * int(y) for x, y in zip(a, b)]
    np.testing.assert_array_equal(np.asarray(hi, np.uint64), [p >> 32 for p in product])
    np.testing.assert_array_equal(np.asarray(lo, np.uint64), [p & 0xFFFFFFFF for p in product])


def test_fixed_size_and_with_replacement_share_their_settings_but_stay_distinct():
    fixed, replace = FixedSizeSampler(100, 10), WithReplacementSampler(100, 10)
    for s in (fixed, replace):
        assert (s.num_records, s.batch_size, s.q, s.expected_batch_size, s.max_batch_size) == (
            100, 10, 0.1, 10, 10)
    assert fixed != replace and fixed.relation == "substitute" and replace.relation is None
    assert fixed.name == "fixed_size" and not hasattr(replace, "name")
    assert repr(fixed) == "FixedSizeSampler(num_records=100, batch_size=10)"
    assert repr(replace) == "WithReplacementSampler(num_records=100, batch_size=10)"
    assert hash(fixed) == hash(FixedSizeSampler(np.int64(100), 10))
    with pytest.raises(AttributeError):
        fixed.batch_size = 3
