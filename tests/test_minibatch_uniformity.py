"""Statistical tests: the samplers draw exactly the distribution the accountant assumes.

Every test compares counts from many batches (keys ``fold_in(PRNGKey(seed), i)``,
vmapped) with the exact distribution by a chi-square test at level 1e-4 (fixed
seeds, so the outcome is deterministic). The power tests show that the same
statistic rejects samplers with the kind of bias this module must not have:
a 2-round and an 8-round Feistel network, and a subset distribution skewed
by about ±14 % (frequencies 1524..1974 around 1667).
"""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import d3p.random
from d3p.minibatch import (
    FixedSizeSampler,
    PoissonSampler,
    feistel_permutation,
    subsample_batchify_data,
)

ALPHA = 1e-4
NUM_DRAWS = 100_000
NUM_DRAWS_POISSON = 50_000


def draw_many(sample, num, seed):
    """``sample(key) -> (indices, mask)`` for keys ``fold_in(PRNGKey(seed), i)``, i < num."""
    key = d3p.random.PRNGKey(seed)
    f = jax.jit(jax.vmap(lambda i: sample(d3p.random.fold_in(key, i))))
    indices, mask = f(jnp.arange(num, dtype=jnp.uint32))
    return np.asarray(indices), np.asarray(mask)


def subset_codes(indices):
    """Bit-mask code of the (unordered) subset of every row."""
    return (np.int64(1) << indices.astype(np.int64)).sum(axis=1)


def subset_chi2_pvalue(indices, num_records, batch_size):
    """Chi-square p-value of the subset counts against the uniform distribution over all subsets."""
    codes = subset_codes(indices)
    all_codes = [sum(1 << i for i in c) for c in itertools.combinations(range(num_records), batch_size)]
    lookup = {c: k for k, c in enumerate(all_codes)}
    counts = np.zeros(len(all_codes))
    cells = np.array([lookup[c] for c in codes.tolist()])
    np.add.at(counts, cells, 1)
    if len(all_codes) == 1:
        return 1.0
    return stats.chisquare(counts).pvalue


def chi2_pvalue_merged(observed, expected_prob, min_expected=5.0):
    """Chi-square goodness of fit, merging cells (in order) until each expects >= min_expected."""
    n = observed.sum()
    obs_m, exp_m, o, e = [], [], 0.0, 0.0
    for ob, p in zip(observed, expected_prob):
        o += ob
        e += p * n
        if e >= min_expected:
            obs_m.append(o)
            exp_m.append(e)
            o = e = 0.0
    if e > 0 or o > 0:
        obs_m[-1] += o
        exp_m[-1] += e
    exp_m = np.array(exp_m) * n / np.sum(exp_m)
    return stats.chisquare(np.array(obs_m), exp_m).pvalue


# ----------------------------------------------------------------------------
# fixed size: uniform over subsets


SUBSET_CASES = [
    (5, 2), (5, 4), (5, 5),
    (10, 3), (10, 9),
    (16, 2), (16, 15),
    (17, 3), (17, 16),
]


@pytest.mark.parametrize("num_records,batch_size", SUBSET_CASES)
def test_fixed_size_uniform_over_subsets(num_records, batch_size):
    sampler = FixedSizeSampler(num_records, batch_size)
    indices, _ = draw_many(sampler.sample, NUM_DRAWS, seed=num_records * 100 + batch_size)
    assert subset_chi2_pvalue(indices, num_records, batch_size) > ALPHA


@pytest.mark.parametrize("num_records,batch_size", [(5, 3), (4, 4)])
def test_fixed_size_uniform_over_ordered_sequences(num_records, batch_size):
    """Positions within a batch are uniform too (Poisson batches use the first K)."""
    sampler = FixedSizeSampler(num_records, batch_size)
    indices, _ = draw_many(sampler.sample, NUM_DRAWS, seed=7)
    codes = (indices * num_records ** np.arange(batch_size)).sum(axis=1)
    all_codes = [
        sum(v * num_records**j for j, v in enumerate(p))
        for p in itertools.permutations(range(num_records), batch_size)
    ]
    counts = np.array([np.sum(codes == c) for c in all_codes])
    assert counts.sum() == NUM_DRAWS
    assert stats.chisquare(counts).pvalue > ALPHA


def test_fixed_size_per_index_frequencies():
    sampler = FixedSizeSampler(1000, 10)
    indices, _ = draw_many(sampler.sample, NUM_DRAWS, seed=11)
    counts = np.bincount(indices.ravel(), minlength=1000)
    assert counts.sum() == 10 * NUM_DRAWS
    assert stats.chisquare(counts).pvalue > ALPHA
    # the lowest and highest indices are drawn as often as the others (expected 1000)
    for j in (0, 1, 998, 999):
        assert abs(counts[j] - 1000) < 5 * math.sqrt(1000)


def test_consecutive_batches_independent():
    """Overlap of batches i and i+1 (via get_batch) follows the hypergeometric law."""
    num_records, batch_size = 20, 5
    init, get_batch = subsample_batchify_data(np.arange(num_records), batch_size=batch_size)
    _, state = init(d3p.random.PRNGKey(12))
    batches = np.asarray(jax.jit(jax.vmap(lambda i: get_batch(i, state)))(jnp.arange(NUM_DRAWS)))
    a, b = batches[0::2], batches[1::2]  # disjoint pairs (2j, 2j + 1)
    overlap = np.array([len(set(x) & set(y)) for x, y in zip(a.tolist(), b.tolist())])
    observed = np.bincount(overlap, minlength=batch_size + 1)
    expected = stats.hypergeom.pmf(np.arange(batch_size + 1), num_records, batch_size, batch_size)
    assert chi2_pvalue_merged(observed, expected) > ALPHA
    # and the joint law of (first index of batch i, first index of batch i+1) is uniform
    joint = np.bincount(a[:, 0] * num_records + b[:, 0], minlength=num_records**2)
    assert stats.chisquare(joint).pvalue > ALPHA


# ----------------------------------------------------------------------------
# power: the same statistics reject biased samplers


def feistel_subsets(num_records, batch_size, num_rounds):
    def sample(key):
        idx = feistel_permutation(key, jnp.arange(batch_size), num_records, num_rounds=num_rounds)
        return idx, jnp.ones(batch_size, bool)

    return sample


@pytest.mark.parametrize("num_records,batch_size,num_rounds", [(10, 3, 2), (5, 2, 8)])
def test_uniformity_test_rejects_feistel(num_records, batch_size, num_rounds):
    """A Feistel network with few rounds is measurably non-uniform; 8 rounds still is at N=5."""
    indices, _ = draw_many(feistel_subsets(num_records, batch_size, num_rounds), NUM_DRAWS, seed=13)
    assert subset_chi2_pvalue(indices, num_records, batch_size) < ALPHA


def test_uniformity_test_rejects_skewed_subset_distribution():
    """Subset frequencies spread by about ±14 % (1524..1974 around 1667 of 200,000) are rejected."""
    num_subsets = math.comb(10, 3)
    weights = np.linspace(1524, 1974, num_subsets)
    rng = np.random.default_rng(0)
    counts = rng.multinomial(NUM_DRAWS, weights / weights.sum())
    assert stats.chisquare(counts).pvalue < ALPHA
    # and the same pipeline accepts an exactly uniform multinomial
    uniform = rng.multinomial(NUM_DRAWS, np.full(num_subsets, 1 / num_subsets))
    assert stats.chisquare(uniform).pvalue > ALPHA


# ----------------------------------------------------------------------------
# Poisson


@pytest.mark.parametrize("num_records,q", [(50, 0.1), (1000, 0.003)])
def test_poisson_batch_size_is_binomial(num_records, q):
    sampler = PoissonSampler(num_records, q)
    _, mask = draw_many(sampler.sample, NUM_DRAWS_POISSON, seed=21)
    counts = mask.sum(axis=1)
    observed = np.bincount(counts, minlength=sampler.max_batch_size + 1)
    expected = stats.binom.pmf(np.arange(sampler.max_batch_size + 1), num_records, q)
    assert chi2_pvalue_merged(observed, expected) > ALPHA


def test_poisson_inclusion_frequency_of_every_index():
    """Each index, the lowest and the highest included, is in the batch with probability q."""
    num_records, q = 100, 0.2
    sampler = PoissonSampler(num_records, q)
    indices, mask = draw_many(sampler.sample, NUM_DRAWS_POISSON, seed=22)
    included = np.bincount(indices[mask], minlength=num_records)
    # inclusions of distinct records are independent: sum of squared z-scores ~ chi2(N)
    z = (included - NUM_DRAWS_POISSON * q) / math.sqrt(NUM_DRAWS_POISSON * q * (1 - q))
    assert stats.chi2.sf(np.sum(z**2), num_records) > ALPHA
    assert np.abs(z).max() < 5
    assert abs(z[0]) < 5 and abs(z[-1]) < 5


def test_poisson_pairwise_inclusions_independent():
    """P(i and j both included) = q^2, e.g. for the first and last index."""
    num_records, q = 10, 0.3
    sampler = PoissonSampler(num_records, q)
    indices, mask = draw_many(sampler.sample, NUM_DRAWS_POISSON, seed=23)
    member = np.zeros((NUM_DRAWS_POISSON, num_records), bool)
    rows = np.repeat(np.arange(NUM_DRAWS_POISSON), indices.shape[1])
    member[rows[mask.ravel()], indices.ravel()[mask.ravel()]] = True
    table = np.array(
        [[np.sum(~member[:, 0] & ~member[:, -1]), np.sum(~member[:, 0] & member[:, -1])],
         [np.sum(member[:, 0] & ~member[:, -1]), np.sum(member[:, 0] & member[:, -1])]]
    )
    expected = NUM_DRAWS_POISSON * np.outer([1 - q, q], [1 - q, q])
    assert stats.chisquare(table.ravel(), expected.ravel()).pvalue > ALPHA


# ----------------------------------------------------------------------------
# heavier variants (pytest -m slow)


@pytest.mark.slow
@pytest.mark.parametrize("num_records,batch_size", [(10, 3), (5, 2), (8, 4), (17, 2), (33, 2)])
def test_fixed_size_uniform_over_subsets_many_draws(num_records, batch_size):
    sampler = FixedSizeSampler(num_records, batch_size)
    pvalues = []
    for seed in range(10):
        indices, _ = draw_many(sampler.sample, NUM_DRAWS, seed=1000 + seed)
        pvalues.append(subset_chi2_pvalue(indices, num_records, batch_size))
    # ten independent p-values are uniform on (0, 1)
    assert stats.kstest(pvalues, "uniform").pvalue > ALPHA
