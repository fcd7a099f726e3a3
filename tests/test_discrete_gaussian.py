"""Tests of d3p.random.discrete_gaussian: its law, its parts, its interface.

Every statistical test uses a fixed key, so it is deterministic, and runs its
procedure twice: against the exact law, where it must accept, and against a
slightly wrong one (variance parameter 1.05 s, Laplace scale 1.05 t,
probability exp(-1.02 x)), where the same procedure, on the same samples, must
reject; a test that cannot reject is no evidence. The exact laws are computed
here, independently of the sampler, in float64.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from scipy.special import logsumexp

import d3p.random
from d3p.random import discrete

ALPHA = 1e-3
N = 200_000
N_SLOW = 1_000_000
_CHUNK = 2**22


# ---------------------------------------------------------------------------
# exact laws, in float64


def _log_weights(ys, log2_variance, factor=1.0):
    return -(ys.astype(np.float64) ** 2) / (2.0 * factor * 2.0**log2_variance)


def _bin_masses(edges, log2_variance, factor=1.0):
    """Mass of N_Z(0, factor * 2**k) in the integer bins [edges[i], edges[i+1]),
    normalised over |y| <= 40 sigma + 40, the bins covering that range."""
    logs = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        parts = [
            logsumexp(_log_weights(np.arange(a, min(a + _CHUNK, hi)), log2_variance, factor))
            for a in range(int(lo), int(hi), _CHUNK)
        ]
        logs.append(logsumexp(parts))
    logs = np.array(logs)
    return np.exp(logs - logsumexp(logs))


def _limit(log2_variance):
    return int(40 * 2.0 ** (log2_variance / 2) + 40)


def _pmf(log2_variance, factor=1.0):
    lim = _limit(log2_variance)
    ys = np.arange(-lim, lim + 1)
    logw = _log_weights(ys, log2_variance, factor)
    return ys, np.exp(logw - logsumexp(logw))


def _laplace_pmf(log2_t, factor=1.0):
    t = 2.0**log2_t
    lim = int(80 * t + 80)
    ys = np.arange(-lim, lim + 1)
    logw = -np.abs(ys) / (factor * t)
    return ys, np.exp(logw - logsumexp(logw))


def _laplace_bin_masses(edges, log2_t, factor=1.0):
    """Mass of P(y) proportional to exp(-|y| / (factor t)) in the integer bins
    [edges[i], edges[i+1]) (geometric sums), normalised over the bins."""
    t = factor * 2.0**log2_t

    def from_zero(a, b):  # sum of exp(-y/t) for integers 0 <= a <= y < b
        return (np.exp(-a / t) - np.exp(-b / t)) / -np.expm1(-1.0 / t)

    masses = []
    for a, b in zip(edges[:-1].astype(np.float64), edges[1:].astype(np.float64)):
        negative = from_zero(max(1.0 - b, 1.0), 1.0 - a) if a < 0 else 0.0  # y = -b+1 .. -a, y <= -1
        positive = from_zero(max(a, 0.0), b) if b > 0 else 0.0
        masses.append(negative + positive)
    masses = np.array(masses)
    return masses / masses.sum()


# ---------------------------------------------------------------------------
# goodness of fit


def _per_value_bins(ys, probs, n):
    """Bins of single values where ``n * p >= 20``; the rest (the tails) pooled."""
    keep = n * probs >= 20
    return ys[keep], np.concatenate([probs[keep], [probs[~keep].sum()]])


def _counts_per_value(samples, values):
    index = {int(v): i for i, v in enumerate(values)}
    counts = np.zeros(len(values) + 1)
    uniq, cnt = np.unique(samples, return_counts=True)
    for v, c in zip(uniq, cnt):
        counts[index.get(int(v), len(values))] += c
    return counts


def _chi2(counts, probs):
    """The chi-square statistic and its critical value at ALPHA."""
    expected = counts.sum() * probs
    stat = float(((counts - expected) ** 2 / expected).sum())
    return stat, scipy.stats.chi2.isf(ALPHA, len(counts) - 1)


def _sigma_edges(log2_variance, bins_per_sigma=5, width=5):
    """Integer bin edges of sigma/5 on [-5 sigma, 5 sigma], plus two outer bins."""
    sigma = 2.0 ** (log2_variance / 2)
    inner = np.unique(np.round(np.linspace(-width * sigma, width * sigma, 2 * width * bins_per_sigma + 1)))
    lim = _limit(log2_variance)
    return np.concatenate([[-lim], inner, [lim + 1]]).astype(np.int64)


def _binned_counts(samples, edges):
    return np.histogram(samples, bins=edges)[0].astype(np.float64)


def _fit_per_value(samples, log2_variance):
    """(statistic against the exact law, critical value, statistic against 1.05 s)."""
    ys, probs = _pmf(log2_variance)
    values, binned = _per_value_bins(ys, probs, len(samples))
    counts = _counts_per_value(samples, values)
    stat, critical = _chi2(counts, binned)
    _, wrong = _pmf(log2_variance, 1.05)
    inside = np.isin(ys, values)  # the same bins, with the wrong law's masses
    wrong_binned = np.concatenate([wrong[inside], [wrong[~inside].sum()]])
    return stat, critical, _chi2(counts, wrong_binned)[0]


def _fit_binned(samples, log2_variance):
    edges = _sigma_edges(log2_variance)
    counts = _binned_counts(samples, edges)
    stat, critical = _chi2(counts, _bin_masses(edges, log2_variance))
    return stat, critical, _chi2(counts, _bin_masses(edges, log2_variance, 1.05))[0]


_SAMPLES = {}


def _samples(log2_variance, n=N, seed=0):
    """Samples of the sampler under test (cached: several tests read them)."""
    if (log2_variance, n, seed) not in _SAMPLES:
        key = d3p.random.PRNGKey(1000 * log2_variance + seed + 7)
        _SAMPLES[log2_variance, n, seed] = np.asarray(d3p.random.discrete_gaussian(key, (n,), log2_variance))
    return _SAMPLES[log2_variance, n, seed]


# ---------------------------------------------------------------------------
# the law


# one compilation of the sampler per variance: the default run checks one small even and
# one odd variance per value and one above 2**29 binned (also read by the tail and symmetry
# tests); the slow run adds more variances with a million samples
@pytest.mark.parametrize("log2_variance", [0, 5])
def test_chi_square_per_value_accepts_the_exact_law_and_rejects_variance_1_05(log2_variance):
    stat, critical, wrong = _fit_per_value(_samples(log2_variance), log2_variance)
    assert stat < critical
    assert wrong > 2 * critical


@pytest.mark.parametrize("log2_variance", [30])
def test_chi_square_binned_accepts_the_exact_law_and_rejects_variance_1_05(log2_variance):
    stat, critical, wrong = _fit_binned(_samples(log2_variance), log2_variance)
    assert stat < critical
    assert wrong > 2 * critical


@pytest.mark.slow
@pytest.mark.parametrize("log2_variance", [0, 1, 2, 3, 8])
def test_chi_square_per_value_with_a_million_samples(log2_variance):
    stat, critical, wrong = _fit_per_value(_samples(log2_variance, N_SLOW), log2_variance)
    assert stat < critical
    assert wrong > 5 * critical


@pytest.mark.slow
@pytest.mark.parametrize("log2_variance", [13, 20, 24, 31, 32, 33, 39, 40])
def test_chi_square_binned_with_a_million_samples(log2_variance):
    stat, critical, wrong = _fit_binned(_samples(log2_variance, N_SLOW), log2_variance)
    assert stat < critical
    assert wrong > 5 * critical


def _tail_mass(log2_variance, multiple, factor=1.0):
    """Exact P(|y| > multiple * sigma)."""
    bound = int(np.floor(multiple * 2.0 ** (log2_variance / 2)))  # |y| > bound
    lim = _limit(log2_variance)
    edges = np.array([-lim, -bound, bound + 1, lim + 1])
    masses = _bin_masses(edges, log2_variance, factor)
    return masses[0] + masses[2], bound


@pytest.mark.parametrize("log2_variance", [5, 30])
@pytest.mark.parametrize("multiple", [2, 3])
def test_tail_mass_beyond_two_and_three_sigma_is_exact(log2_variance, multiple):
    samples = _samples(log2_variance)
    p, bound = _tail_mass(log2_variance, multiple)
    count = int((np.abs(samples) > bound).sum())
    assert scipy.stats.binomtest(count, len(samples), p).pvalue > ALPHA
    wrong, _ = _tail_mass(log2_variance, multiple, 1.05)
    assert scipy.stats.binomtest(count, len(samples), wrong).pvalue < ALPHA


@pytest.mark.parametrize("log2_variance", [0, 5, 30])
def test_symmetric_with_mean_zero(log2_variance):
    samples = _samples(log2_variance).astype(np.float64)
    n = len(samples)
    positive, negative = int((samples > 0).sum()), int((samples < 0).sum())
    assert scipy.stats.binomtest(positive, positive + negative, 0.5).pvalue > ALPHA
    z = samples.mean() / (samples.std() / np.sqrt(n))
    assert abs(z) < 4
    # power: a shift of a twentieth of sigma, or a sign bias of 1%, is detected
    shifted = samples + 0.05 * 2.0 ** (log2_variance / 2)
    assert abs(shifted.mean() / (shifted.std() / np.sqrt(n))) > 4
    biased = positive + (positive + negative) // 100
    assert scipy.stats.binomtest(biased, positive + negative, 0.5).pvalue < ALPHA


# ---------------------------------------------------------------------------
# the parts: Bernoulli(exp(-x)), the discrete Laplace, uniform digits


def _acceptance_case(log2_variance, distance):
    """A candidate y whose acceptance has x = distance**2 / 2**(k+1)."""
    m = 2 ** (log2_variance // 2)
    return m + distance, distance**2 / 2.0 ** (log2_variance + 1)


def _check_bernoulli_exp(log2_variance, distances, n, seed):
    cases = [_acceptance_case(log2_variance, d) for d in distances]
    # each candidate and its negation: the acceptance depends on |y| only
    ys = np.concatenate([np.full(n // 2, s * y, np.int32) for y, _ in cases for s in (1, -1)])
    accepted = np.asarray(discrete._acceptances(d3p.random.PRNGKey(seed), jnp.asarray(ys), log2_variance, d3p.random))
    for i, (_, x) in enumerate(cases):
        hits = int(accepted[i * n : (i + 1) * n].sum())
        if x == 0:
            assert hits == n
            continue
        assert scipy.stats.binomtest(hits, n, np.exp(-x)).pvalue > ALPHA, x
        assert scipy.stats.binomtest(hits, n, np.exp(-1.02 * x)).pvalue < ALPHA, x


@pytest.mark.parametrize(
    "log2_variance, distances",
    [
        (0, [0, 1, 2]),  # x = 0, 0.5 and 2 (m = 1)
        (24, [5000, 9000]),  # x = 0.745 (25 bits) and 2.41
        (39, [900_000, 2**20, 1_300_000]),  # x = 0.737 (40 bits: 8 beyond the first 32), 1 and 1.54
    ],
)
def test_bernoulli_exp_frequencies(log2_variance, distances):
    _check_bernoulli_exp(log2_variance, distances, N, seed=log2_variance)


@pytest.mark.slow
@pytest.mark.parametrize(
    "log2_variance, distances",
    [
        (0, [3]),  # x = 4.5
        (5, [7, 10]),  # x = 49/64 and 100/64
        (19, [1000, 1500]),  # x = 0.954 (20 bits, digit and bits in one word) and 2.15
        (30, [40_000]),  # x = 0.745 (31 bits)
        (40, [1_500_000, 2_000_000]),  # x = 1.023 (41 bits) and 1.82
    ],
)
def test_bernoulli_exp_frequencies_more(log2_variance, distances):
    _check_bernoulli_exp(log2_variance, distances, 4 * N, seed=100 + log2_variance)


def _fit_laplace(log2_variance, n, seed):
    scale = discrete._scale(log2_variance)
    samples = np.asarray(discrete._laplace_candidates(d3p.random.PRNGKey(seed), n, log2_variance, d3p.random))
    if scale.c <= 3:
        ys, probs = _laplace_pmf(scale.c)
        _, wrong = _laplace_pmf(scale.c, 1.05)
        values, binned = _per_value_bins(ys, probs, n)
        inside = np.isin(ys, values)
        wrong_binned = np.concatenate([wrong[inside], [wrong[~inside].sum()]])
        counts = _counts_per_value(samples, values)
    else:
        t, lim = 2**scale.c, 80 * 2**scale.c
        edges = np.concatenate([[-lim], np.linspace(-8 * t, 8 * t, 65), [lim + 1]]).astype(np.int64)
        counts = _binned_counts(samples, edges)
        binned = _laplace_bin_masses(edges, scale.c)
        wrong_binned = _laplace_bin_masses(edges, scale.c, 1.05)
    stat, critical = _chi2(counts, binned)
    return stat, critical, _chi2(counts, wrong_binned)[0]


@pytest.mark.parametrize("log2_variance", [0, 24])
def test_discrete_laplace_candidates(log2_variance):
    """t = 1 per value; t = 4096 binned."""
    stat, critical, wrong = _fit_laplace(log2_variance, N, seed=log2_variance)
    assert stat < critical
    assert wrong > 2 * critical


@pytest.mark.slow
@pytest.mark.parametrize("log2_variance", [5, 33, 40])
def test_discrete_laplace_candidates_more(log2_variance):
    """t = 8 per value; t = 2**17 and 2**20, where U takes its own word."""
    stat, critical, wrong = _fit_laplace(log2_variance, N_SLOW, seed=log2_variance)
    assert stat < critical
    assert wrong > 5 * critical


@pytest.mark.parametrize("first", [1, 3, 7])
def test_mixed_radix_digits_are_uniform_and_independent(first):
    """The digits of a million words: jointly uniform, and each marginal too,
    where a digit value 3% too likely is detected."""
    words = d3p.random.random_bits(d3p.random.PRNGKey(first), 32, (N_SLOW,))
    valid, taken, digits = discrete._mixed_radix(words, jnp.full((N_SLOW,), first, jnp.uint32), 5)
    radices = [first + i for i in range(5) if bool(np.asarray(taken[i])[0])]
    valid = np.asarray(valid)
    assert valid.mean() > 1 - 2**-20
    value = np.zeros(int(valid.sum()), np.int64)
    for r, d in zip(radices, digits):
        d = np.asarray(d)[valid].astype(np.int64)
        value = value * r + d
        if r > 1:
            counts = np.bincount(d, minlength=r).astype(np.float64)
            assert len(counts) == r
            stat, critical = _chi2(counts, np.full(r, 1.0 / r))
            assert stat < critical
            bump = np.full(r, 1.0)
            bump[0] = 1.03
            assert _chi2(counts, bump / bump.sum())[0] > critical
    size = int(np.prod(radices))
    stat, critical = _chi2(np.bincount(value, minlength=size).astype(np.float64), np.full(size, 1.0 / size))
    assert stat < critical


def test_mixed_radix_is_exact_integer_arithmetic():
    """Digits and acceptance against Python integers, for small and huge radices."""
    rng = np.random.default_rng(0)
    words = rng.integers(0, 2**32, 4000, dtype=np.uint64).astype(np.uint32)
    for first in [1, 2, 6, 4095, 4096, 65_535, 2**31 + 5, 2**32 - 1]:
        valid, taken, digits = discrete._mixed_radix(jnp.asarray(words), jnp.full(words.shape, first, jnp.uint32), 5)
        radices = [first + i for i in range(5) if bool(np.asarray(taken[i])[0])]
        product = int(np.prod(radices, dtype=object))
        assert product <= max(first, 2**12)
        for w, ok, *ds in zip(words.tolist(), np.asarray(valid), *[np.asarray(d) for d in digits[: len(radices)]]):
            full = w * product
            assert bool(ok) == (full % 2**32 >= 2**32 % product)
            value = full >> 32
            for r, d in zip(reversed(radices), reversed(ds)):
                assert int(d) == value % r
                value //= r


@pytest.mark.parametrize("radix", [1, 2, 3, 5, 7, 1000, 2047])
def test_short_digit_is_exactly_uniform(radix):
    """All 4096 values of the 12 bits it reads: every digit equally often."""
    words = jnp.arange(4096, dtype=jnp.uint32) | jnp.uint32(0xABCDE000)
    valid, digit = discrete._short_digit(words, jnp.full((4096,), radix, jnp.uint32))
    counts = np.bincount(np.asarray(digit)[np.asarray(valid)], minlength=radix)
    assert len(counts) == radix and np.all(counts == 4096 // radix)


def test_low_bits_of_x_decide_a_tie():
    """x with 40 bits (k = 39): bits equal to its first 32 defer to the next word."""
    scale = discrete._scale(39)
    x_hi, x_lo = jnp.uint32(0x9ABCDEF0), jnp.uint32(0x5A000000)  # 8 low bits: 0x5A
    k_loop = jnp.ones((1,), jnp.uint32)  # the bits of A_1

    def step(word, k):
        return discrete._fraction_event(jnp.asarray([word], jnp.uint32), k, x_hi, x_lo, jnp.asarray([False]), scale)

    ended, k_tie = step(0x9ABCDEF0, k_loop)
    assert not bool(ended[0]) and int(k_tie[0]) == discrete._TIE | 1
    ended, k_next = step(0x59FFFFFF, k_tie)  # low bits 0x59 < 0x5A: A_1's bits pass
    assert not bool(ended[0]) and int(k_next[0]) == 2
    ended, k_end = step(0x5A000000, k_tie)  # 0x5A: not below x, A_1 = 0, K = 1
    assert bool(ended[0]) and int(k_end[0]) == 1
    ended, k_end = step(0x9ABCDEF1, k_loop)  # above x_hi: no tie
    assert bool(ended[0]) and int(k_end[0]) == 1
    # without low bits (x_lo = 0) equal bits are not below x
    ended, _ = discrete._fraction_event(
        jnp.asarray([0x9ABCDEF0], jnp.uint32), k_loop, x_hi, jnp.uint32(0), jnp.asarray([False]), scale
    )
    assert bool(ended[0])


# ---------------------------------------------------------------------------
# the int32 range


def _lanes(phase, k_loop, count, u, y=0):
    def arr(v, dtype):
        return jnp.asarray([v], dtype)

    return discrete._Lanes(
        arr(phase, jnp.int32), arr(k_loop, jnp.uint32), arr(count, jnp.uint32), arr(u, jnp.uint32), arr(y, jnp.int32)
    )


@pytest.mark.parametrize("log2_variance", [0, 24, 40])
def test_largest_candidates_fit_and_one_more_success_is_rejected(log2_variance):
    scale = discrete._scale(log2_variance)
    v_max = 2 ** (31 - scale.c) - 1
    u_max = 2**scale.c - 1
    # V = v_max, then a failure: X = 2**31 - 1, both signs
    for sign in (0, 1):
        lanes = discrete._settle(_lanes(discrete._V, discrete._FAILED, v_max, u_max | sign << 31), scale)
        expected_phase = discrete._G if log2_variance >= 29 else discrete._NEW  # else too far to accept
        assert int(lanes.phase[0]) == expected_phase
        if expected_phase == discrete._G:
            assert int(lanes.y[0]) == (1 - 2 * sign) * (2**31 - 1)
    # one more success than v_max: a new candidate, not a wrapped X
    lanes = discrete._settle(_lanes(discrete._V, discrete._SUCCEEDED, v_max, u_max), scale)
    assert int(lanes.phase[0]) == discrete._NEW
    lanes = discrete._settle(_lanes(discrete._V, discrete._SUCCEEDED, v_max - 1, u_max), scale)
    assert int(lanes.phase[0]) == discrete._V and int(lanes.count[0]) == v_max


def test_an_exponent_floor_of_2_to_32_is_rejected():
    scale = discrete._scale(0)  # m = 1, x = (|y| - 1)**2 / 2
    # t = 1: X = V; floor((92682 - 1)**2 / 2) < 2**32 <= floor((92683 - 1)**2 / 2)
    for y, phase in [(92_682, discrete._G), (92_683, discrete._NEW)]:
        lanes = discrete._settle(_lanes(discrete._V, discrete._FAILED, y, 0), scale)
        assert int(lanes.phase[0]) == phase


# ---------------------------------------------------------------------------
# the interface


@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 3)])
def test_dtype_and_shape(shape):
    y = d3p.random.discrete_gaussian(d3p.random.PRNGKey(0), shape, 6)
    assert y.dtype == jnp.int32 and y.shape == shape


def test_deterministic_per_key_and_keys_differ():
    key = d3p.random.PRNGKey(11)
    a = d3p.random.discrete_gaussian(key, (2, 3), 6)
    assert np.array_equal(a, d3p.random.discrete_gaussian(key, (2, 3), 6))
    b = d3p.random.discrete_gaussian(d3p.random.PRNGKey(12), (2, 3), 6)
    assert not np.array_equal(a, b)


def test_jit_gives_the_same_values():
    key = d3p.random.PRNGKey(5)
    jitted = jax.jit(lambda k: d3p.random.discrete_gaussian(k, (2, 3), 6))
    assert np.array_equal(jitted(key), d3p.random.discrete_gaussian(key, (2, 3), 6))


def test_debug_suite():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", d3p.random.debug.DebugRNGWarning)
        key = d3p.random.debug.PRNGKey(0)
    y = d3p.random.discrete_gaussian(key, (2, 3), 6, rng_suite=d3p.random.debug)
    assert y.dtype == jnp.int32 and y.shape == (2, 3)
    assert np.array_equal(y, d3p.random.discrete_gaussian(key, (2, 3), 6, rng_suite=d3p.random.debug))


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        (dict(log2_variance=-1), ValueError, "log2_variance"),
        (dict(log2_variance=41), ValueError, "log2_variance"),
        (dict(log2_variance=2.5), TypeError, "log2_variance"),
        (dict(log2_variance=True), TypeError, "log2_variance"),
        (dict(shape=(3, -1)), ValueError, "shape[1]"),
        (dict(shape=(3.0,)), TypeError, "shape[0]"),
        (dict(shape=3), TypeError, "shape"),
        (dict(rng_suite="chacha"), TypeError, "rng_suite"),
        (dict(rng_suite=np), TypeError, "rng_suite"),
    ],
)
def test_bad_arguments_raise_naming_them(kwargs, error, name):
    args = dict(shape=(2,), log2_variance=4) | kwargs
    with pytest.raises(error, match=name.replace("[", r"\[").replace("]", r"\]")):
        d3p.random.discrete_gaussian(d3p.random.PRNGKey(0), **args)
