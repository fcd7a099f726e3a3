"""Statistical tests of the d3p.random samplers, with power.

Every test uses fixed keys, so it is deterministic. Each goodness-of-fit
procedure is run twice: on the suite's output, where it must accept, and on a
deliberately wrong distribution of the same size, where the same procedure
must reject; a test that cannot reject is no evidence.
"""

import jax
import numpy as np
import pytest
import scipy.stats

import d3p.random
from d3p.random import chacha

ALPHA = 1e-3
# sample sizes chosen so that the keystreams have few distinct shapes (eager
# JAX compiles each operation once per shape): 200k words and 4M words
N_UNIFORM = 200_000
N_LARGE = 2_000_000  # normals or integers: 4M words


def _ks_accepts(samples, cdf) -> bool:
    return scipy.stats.kstest(np.asarray(samples, dtype=np.float64), cdf).pvalue > ALPHA


def _chi2_accepts(counts, probs) -> bool:
    counts = np.asarray(counts, dtype=np.float64)
    expected = counts.sum() * np.asarray(probs, dtype=np.float64)
    return scipy.stats.chisquare(counts, expected).pvalue > ALPHA


@pytest.fixture(scope="module")
def normals():
    return np.asarray(d3p.random.normal(d3p.random.PRNGKey(20240601), (N_LARGE,)), dtype=np.float64)


@pytest.fixture(scope="module")
def uniforms():
    return np.asarray(d3p.random.uniform(d3p.random.PRNGKey(20240602), (N_UNIFORM,)), dtype=np.float64)


@pytest.fixture(scope="module")
def sevens():
    """randint on the non-power-of-two span 7."""
    out = d3p.random.randint(d3p.random.PRNGKey(77), (N_LARGE,), 0, 7)
    return np.asarray(out).astype(np.int64)


# ---------------------------------------------------------------------------
# uniform


def test_uniform_ks_accepts_u01_and_rejects_a_power_distortion(uniforms):
    assert _ks_accepts(uniforms, scipy.stats.uniform.cdf)
    assert not _ks_accepts(uniforms**1.02, scipy.stats.uniform.cdf)
    assert not _ks_accepts(0.005 + 0.995 * uniforms, scipy.stats.uniform.cdf)


def test_uniform_with_bounds_ks_accepts_and_rejects():
    u = np.asarray(d3p.random.uniform(d3p.random.PRNGKey(5), (N_UNIFORM,), minval=-2.0, maxval=3.0), np.float64)
    target = scipy.stats.uniform(loc=-2.0, scale=5.0).cdf
    assert _ks_accepts(u, target)
    assert not _ks_accepts(u * 1.01, target)


def test_successive_uniforms_are_uncorrelated(uniforms):
    n = len(uniforms) - 1
    lag1 = np.corrcoef(uniforms[:-1], uniforms[1:])[0, 1]
    lag16 = np.corrcoef(uniforms[:-16], uniforms[16:])[0, 1]
    assert abs(lag1) < 4 / np.sqrt(n) and abs(lag16) < 4 / np.sqrt(n)
    # the check has power: a sequence with a little memory fails it
    sticky = uniforms[1:] + 0.02 * uniforms[:-1]
    assert abs(np.corrcoef(uniforms[:-1], sticky)[0, 1]) > 4 / np.sqrt(n)


def test_split_children_streams_are_uncorrelated():
    parent = d3p.random.PRNGKey(6)
    streams = [d3p.random.uniform(k, (N_UNIFORM,)) for k in d3p.random.split(parent, 2)]
    streams += [d3p.random.uniform(d3p.random.fold_in(parent, 0), (N_UNIFORM,))]
    streams += [d3p.random.uniform(parent, (N_UNIFORM,))]
    corr = np.corrcoef(np.asarray(streams, np.float64))
    assert np.all(np.abs(corr[np.triu_indices(4, 1)]) < 4 / np.sqrt(N_UNIFORM))


# ---------------------------------------------------------------------------
# normal


def test_normal_ks_accepts_n01_and_rejects_scaled_or_shifted(normals):
    z = normals[:N_UNIFORM]
    assert _ks_accepts(z, scipy.stats.norm.cdf)
    assert not _ks_accepts(1.05 * z, scipy.stats.norm.cdf)
    assert not _ks_accepts(z + 0.02, scipy.stats.norm.cdf)
    # and on a disjoint part of the sample as well
    assert _ks_accepts(normals[N_UNIFORM : 2 * N_UNIFORM], scipy.stats.norm.cdf)


def _tail_count_matches(z, t) -> bool:
    """#{|z| > t} within 4.5 Poisson standard deviations of n P(|Z| > t)."""
    expected = len(z) * 2 * scipy.stats.norm.sf(t)
    return abs(np.count_nonzero(np.abs(z) > t) - expected) < 4.5 * np.sqrt(expected)


@pytest.mark.parametrize("t", [2.0, 3.0, 4.0])
def test_normal_tail_fractions(normals, t):
    assert _tail_count_matches(normals, t)
    # the same check rejects a distribution 5% too wide
    assert not _tail_count_matches(1.05 * normals, t)
    # each tail on its own
    expected = len(normals) * scipy.stats.norm.sf(t)
    for count in (np.count_nonzero(normals > t), np.count_nonzero(normals < -t)):
        assert abs(count - expected) < 4.5 * np.sqrt(expected)


def test_normal_sign_is_fair(normals):
    n = len(normals)
    assert abs(np.count_nonzero(normals > 0) - n / 2) < 4.5 * np.sqrt(n / 4)


def _normal_reference(words: np.ndarray) -> np.ndarray:
    """The documented mapping of two keystream words to a normal, in float64."""
    hi, lo = words[0::2].astype(np.float64), words[1::2].astype(np.float64)
    sign = np.where(words[0::2] & 1, -1.0, 1.0)
    p = (np.floor(hi / 2) + (lo + 0.5) * 2.0**-32) * 2.0**-31
    return sign * scipy.stats.norm.isf(p / 2)


def test_normal_is_the_documented_function_of_the_keystream():
    key = d3p.random.PRNGKey(8)
    z = np.asarray(d3p.random.normal(key, (2048,)), np.float64)
    words = np.asarray(d3p.random.random_bits(key, 32, (4096,)))
    np.testing.assert_allclose(z, _normal_reference(words), rtol=1e-5, atol=1e-6)


def test_normal_mapping_reaches_far_tails(monkeypatch):
    # crafted keystream words: hi carries the sign in bit 0 and the top 31 bits of
    # the tail probability p, lo the next 32 bits. Words for magnitudes t are
    # built from p = 2 * sf(t); a sampler inverting one 24-bit uniform could not
    # go beyond about 5.4
    targets = np.array([0.1, 1.0, 3.0, 5.5, 6.0, 7.0, 8.0, 9.0])
    words = []
    for t in targets:
        x = int(2 * scipy.stats.norm.sf(t) * 2.0**63)  # p * 2**63 as a 63-bit integer
        hi, lo = x >> 32, x & 0xFFFFFFFF
        words += [hi << 1, lo, (hi << 1) | 1, lo]  # +t and -t
    words += [0, 0, 1, 0]  # the smallest p: the largest magnitudes
    words = np.array(words, dtype=np.uint32)
    monkeypatch.setattr(chacha, "_keystream_words", lambda key, num_words: jax.numpy.asarray(words[:num_words]))
    z = np.asarray(d3p.random.normal(d3p.random.PRNGKey(0), (len(words) // 2,)), np.float64)
    np.testing.assert_allclose(z, _normal_reference(words), rtol=1e-5)
    # up to 8 the 63-bit resolution of p hits the targets; at 9, p is a few 2**-63
    np.testing.assert_allclose(z[:-4:2], targets[:-1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(z[1:-4:2], -targets[:-1], rtol=1e-5, atol=1e-6)
    assert z[-4] > 8.9 and z[-3] < -8.9
    assert z[-2] > 9.0 and z[-1] < -9.0 and np.isfinite(z[-2:]).all()


# ---------------------------------------------------------------------------
# randint


def _randint_counts(minval, maxval, n, seed, num_bins=None):
    span = maxval - minval
    out = np.asarray(d3p.random.randint(d3p.random.PRNGKey(seed), (n,), minval, maxval)).astype(np.int64)
    assert out.min() >= minval and out.max() < maxval
    return _binned(out - minval, span, num_bins)


def _binned(offsets, span, num_bins):
    """Counts and exact probabilities of equal bins of [0, span) (one bin per value when small)."""
    if num_bins is None:
        return np.bincount(offsets, minlength=span), np.full(span, 1.0 / span)
    edges = [span * b // num_bins for b in range(num_bins + 1)]
    probs = np.array([(edges[b + 1] - edges[b]) / span for b in range(num_bins)])
    bins = np.searchsorted(np.array(edges[1:-1], dtype=np.int64), offsets, side="right")
    return np.bincount(bins, minlength=num_bins), probs


@pytest.mark.parametrize(
    "minval, maxval, num_bins",
    [
        (0, 2, None),
        (0, 7, None),
        (-3, 7, None),
        (0, 1000, None),
        (-(2**30), 2**30 + 3, 100),  # span 2**31 + 3
        (-(3 * 2**29), 3 * 2**29, 96),  # span 3 * 2**30
        (-(2**31), 2**31 - 1, 64),  # span 2**32 - 1
    ],
)
def test_randint_chi_square_accepts_uniform(minval, maxval, num_bins):
    counts, probs = _randint_counts(minval, maxval, N_UNIFORM // 2, seed=maxval % 9973, num_bins=num_bins)
    assert _chi2_accepts(counts, probs)


def test_randint_chi_square_detects_a_value_two_percent_too_likely(sevens):
    n, span = len(sevens), 7
    counts, probs = np.bincount(sevens, minlength=span), np.full(span, 1 / span)
    assert _chi2_accepts(counts, probs)
    biased = np.full(span, (1 - 1.02 / span) / (span - 1))
    biased[3] = 1.02 / span
    alternative = np.random.default_rng(0).choice(span, size=n, p=biased)
    assert not _chi2_accepts(np.bincount(alternative, minlength=span), probs)


def test_randint_chi_square_detects_modulo_bias_on_a_large_span():
    # x mod span from 32 random bits over-weights the values below 2**32 - span
    # (here the first third, twice as likely): the binned test must see it,
    # and must not see anything in randint over the same span
    n, span, num_bins = N_UNIFORM // 2, 3 * 2**30, 96
    counts, probs = _randint_counts(-(3 * 2**29), 3 * 2**29, n, seed=78, num_bins=num_bins)
    assert _chi2_accepts(counts, probs)
    bits = np.asarray(d3p.random.random_bits(d3p.random.PRNGKey(78), 32, (N_UNIFORM,)))[:n].astype(np.int64)
    modulo_counts, _ = _binned(bits % span, span, num_bins)
    assert not _chi2_accepts(modulo_counts, probs)


def test_successive_randints_are_independent(sevens):
    out, span = sevens, 7
    pairs = out[0::2] * span + out[1::2]
    uniform_pairs = np.full(span * span, 1.0 / span**2)
    assert _chi2_accepts(np.bincount(pairs, minlength=span**2), uniform_pairs)
    # the same test sees 1% of second draws copying the first
    copy = np.random.default_rng(80).random(len(out) // 2) < 0.01
    sticky = np.where(copy, out[0::2], out[1::2])
    assert not _chi2_accepts(np.bincount(out[0::2] * span + sticky, minlength=span**2), uniform_pairs)
