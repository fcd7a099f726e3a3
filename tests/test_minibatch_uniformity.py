"""Statistical tests: the samplers draw exactly the distribution the accountant assumes.

Every test compares counts from many batches (keys ``fold_in(PRNGKey(seed), i)``,
vmapped) with the exact distribution by a chi-square test at level 1e-4 (fixed
seeds, so the outcome is deterministic). The power tests show that the same
statistic rejects samplers with the kind of bias this module must not have:
a 2-round and an 8-round Feistel network, and a subset distribution skewed
by about ±14 % (frequencies 1524..1974 around 1667).

The whole module runs in the slow step (CI's third; a long statistical run).
Compiling a sampler costs far more than drawing 100,000 batches from it, so
every sampler is compiled once per module and its batches serve all the tests
that check them. The ``draws`` fixture holds a single-pass case (N=10, B=3,
through ``get_batch``), a loop case (N=17, B=16), the 2-round Feistel network
of the power test and a Poisson sampler; ``slow_draws`` the other cases (the
other (N, B) of the same two code paths, B = N, N much larger than B, the
8-round Feistel network, more Poisson samplers), and repeats seeds.
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

from _two_steps import marked_slow, outcome_of_step

pytestmark = pytest.mark.slow

ALPHA = 1e-4
NUM_DRAWS = 100_000


def draw_all(samples, num, num_seeds=None):
    """Batches of several samplers, each from one compiled, vmapped program.

    ``samples`` maps a name to ``(sample, seed)`` with ``sample(key) -> (indices, mask)``;
    batch ``i`` of a sampler uses the key ``fold_in(PRNGKey(seed), i)``, ``i < num``
    (with seed None, ``sample(i)`` is called instead). With ``num_seeds``, seeds
    ``seed .. seed + num_seeds - 1`` are drawn, stacked on a leading axis (in the same
    program). Returns a dict of numpy ``(indices, mask)``. (One program per sampler:
    XLA compiles several samplers in one program more slowly than one by one.)
    """
    result = {}
    for name, (sample, seed) in samples.items():
        width = 1 if num_seeds is None else num_seeds
        roots = jnp.stack([d3p.random.PRNGKey((seed or 0) + s) for s in range(width)])

        def one(root, i, sample=sample, seed=seed):
            return sample(i) if seed is None else sample(d3p.random.fold_in(root, i))

        batched = jax.vmap(jax.vmap(one, in_axes=(None, 0)), in_axes=(0, None))
        indices, mask = jax.jit(batched)(roots, jnp.arange(num, dtype=jnp.uint32))
        indices, mask = np.asarray(indices), np.asarray(mask)
        result[name] = (indices[0], mask[0]) if num_seeds is None else (indices, mask)
    return result


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


def ordered_chi2_pvalue(indices, num_records, length):
    """Chi-square p-value of the first ``length`` positions against the uniform
    distribution over all ordered sequences of ``length`` distinct indices."""
    prefix = indices[:, :length].astype(np.int64)
    assert all(len(set(row)) == length for row in prefix.tolist())
    codes = (prefix * num_records ** np.arange(length)).sum(axis=1)
    all_codes = np.array(sorted(
        sum(v * num_records**j for j, v in enumerate(p))
        for p in itertools.permutations(range(num_records), length)
    ))
    cells = np.searchsorted(all_codes, codes)
    assert np.array_equal(all_codes[cells], codes)
    return stats.chisquare(np.bincount(cells, minlength=len(all_codes))).pvalue


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


def feistel_subsets(num_records, batch_size, num_rounds):
    def sample(key):
        idx = feistel_permutation(key, jnp.arange(batch_size), num_records, num_rounds=num_rounds)
        return idx, jnp.ones(batch_size, bool)

    return sample


def get_batch_of_index(num_records, batch_size, seed):
    """``i -> (batch i, mask)`` of subsample_batchify_data on ``arange(N)`` (the batch
    is its indices), which draws with the key ``fold_in(PRNGKey(seed), i)``."""
    init, get_batch = subsample_batchify_data(np.arange(num_records), batch_size=batch_size)
    _, state = init(d3p.random.PRNGKey(seed))
    return lambda i: (get_batch(i, state), jnp.ones(batch_size, bool))


POISSON_CASES = {"poisson_10": (10, 0.3), "poisson_1000": (1000, 0.003), "poisson_50": (50, 0.1),
                 "poisson_100": (100, 0.2)}
# drawn in the slow step only
SLOW = {"fixed_5_5", "fixed_1000_10", "feistel_5_2_8", "poisson_1000", "poisson_50", "poisson_100"}


@pytest.fixture(scope="module")
def draws():
    return draw_all({
        "get_batch_10_3": (get_batch_of_index(10, 3, seed=12), None),
        "fixed_17_16": (FixedSizeSampler(17, 16).sample, 1716),
        "feistel_10_3_2": (feistel_subsets(10, 3, 2), 13),
        "poisson_10": (PoissonSampler(10, 0.3).sample, 21),
    }, NUM_DRAWS)


@pytest.fixture(scope="module")
def slow_draws():
    samples = {
        "fixed_5_5": (FixedSizeSampler(5, 5).sample, 505),
        "fixed_1000_10": (FixedSizeSampler(1000, 10).sample, 11),
        "feistel_5_2_8": (feistel_subsets(5, 2, 8), 13),
    }
    for name in sorted(n for n in SLOW if n.startswith("poisson")):
        samples[name] = (PoissonSampler(*POISSON_CASES[name]).sample, 22)
    samples.update({case: (FixedSizeSampler(*case).sample, case[0] * 100 + case[1]) for case in SLOW_SUBSET_CASES})
    return draw_all(samples, NUM_DRAWS)


@pytest.fixture
def sample(request):
    """The draws of the test's ``name`` parameter, from the program of its step."""
    return outcome_of_step(request, "name", SLOW, "draws", "slow_draws")


def names(*all_names):
    """Parameters ``name``, marked slow where they are drawn in the slow step."""
    return marked_slow(all_names, SLOW)


# the other (N, B) of both code paths: single pass (5, 2), (16, 2), (17, 3) and loop
# (5, 4), (10, 9), (16, 15) (N = 16: every 32-bit word is accepted)
SLOW_SUBSET_CASES = [(5, 2), (5, 4), (10, 9), (16, 2), (16, 15), (17, 3)]


# ----------------------------------------------------------------------------
# fixed size: uniform over subsets and ordered sequences


def test_fixed_size_uniform_over_subsets_single_pass_via_get_batch(draws):
    """N=10, B=3 (one block of candidates, no loop): subsets and ordered triples are uniform."""
    indices, _ = draws["get_batch_10_3"]
    assert subset_chi2_pvalue(indices, 10, 3) > ALPHA
    assert ordered_chi2_pvalue(indices, 10, 3) > ALPHA


def test_fixed_size_uniform_over_subsets_loop(draws):
    """N=17, B=16 (the loop, near coupon collecting): subsets, and every prefix
    of the sequence (the first K are a Poisson batch of size K) is uniform."""
    indices, _ = draws["fixed_17_16"]
    assert subset_chi2_pvalue(indices, 17, 16) > ALPHA
    assert ordered_chi2_pvalue(indices, 17, 2) > ALPHA
    assert ordered_chi2_pvalue(indices, 17, 3) > ALPHA


@pytest.mark.slow
def test_fixed_size_uniform_over_permutations(slow_draws):
    """B = N = 5: all 120 orders are equally likely."""
    indices, _ = slow_draws["fixed_5_5"]
    assert np.array_equal(np.sort(indices, axis=1), np.tile(np.arange(5), (NUM_DRAWS, 1)))
    assert ordered_chi2_pvalue(indices, 5, 5) > ALPHA


@pytest.mark.slow
def test_fixed_size_per_index_frequencies(slow_draws):
    indices, _ = slow_draws["fixed_1000_10"]
    counts = np.bincount(indices.ravel(), minlength=1000)
    assert counts.sum() == 10 * NUM_DRAWS
    assert stats.chisquare(counts).pvalue > ALPHA
    # the lowest and highest indices are drawn as often as the others (expected 1000)
    for j in (0, 1, 998, 999):
        assert abs(counts[j] - 1000) < 5 * math.sqrt(1000)


def test_consecutive_batches_independent(draws):
    """Overlap of batches i and i+1 (via get_batch) follows the hypergeometric law."""
    num_records, batch_size = 10, 3
    batches, _ = draws["get_batch_10_3"]
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


@pytest.mark.parametrize("name", names("feistel_10_3_2", "feistel_5_2_8"))
def test_uniformity_test_rejects_feistel(sample, name):
    """A Feistel network with few rounds is measurably non-uniform; 8 rounds still is at N=5."""
    num_records, batch_size, _ = (int(v) for v in name.split("_")[1:])
    indices, _ = sample
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


@pytest.mark.parametrize("name", names("poisson_10", "poisson_1000", "poisson_50"))
def test_poisson_batch_size_is_binomial(sample, name):
    num_records, q = POISSON_CASES[name]
    _, mask = sample
    counts = mask.sum(axis=1)
    observed = np.bincount(counts, minlength=mask.shape[1] + 1)
    expected = stats.binom.pmf(np.arange(mask.shape[1] + 1), num_records, q)
    assert chi2_pvalue_merged(observed, expected) > ALPHA


@pytest.mark.parametrize("name", names("poisson_10", "poisson_100", "poisson_1000"))
def test_poisson_inclusion_frequency_of_every_index(sample, name):
    """Each index, the lowest and the highest included, is in the batch with probability q."""
    num_records, q = POISSON_CASES[name]
    indices, mask = sample
    included = np.bincount(indices[mask], minlength=num_records)
    # inclusions of distinct records are independent: sum of squared z-scores ~ chi2(N)
    z = (included - NUM_DRAWS * q) / math.sqrt(NUM_DRAWS * q * (1 - q))
    assert stats.chi2.sf(np.sum(z**2), num_records) > ALPHA
    assert np.abs(z).max() < 5
    assert abs(z[0]) < 5 and abs(z[-1]) < 5


def test_poisson_pairwise_inclusions_independent(draws):
    """P(i and j both included) = q^2, e.g. for the first and last index."""
    num_records, q = POISSON_CASES["poisson_10"]
    indices, mask = draws["poisson_10"]
    member = np.zeros((NUM_DRAWS, num_records), bool)
    rows = np.repeat(np.arange(NUM_DRAWS), indices.shape[1])
    member[rows[mask.ravel()], indices.ravel()[mask.ravel()]] = True
    table = np.array(
        [[np.sum(~member[:, 0] & ~member[:, -1]), np.sum(~member[:, 0] & member[:, -1])],
         [np.sum(member[:, 0] & ~member[:, -1]), np.sum(member[:, 0] & member[:, -1])]]
    )
    expected = NUM_DRAWS * np.outer([1 - q, q], [1 - q, q])
    assert stats.chisquare(table.ravel(), expected.ravel()).pvalue > ALPHA


# ----------------------------------------------------------------------------
# the other cases, and repeated seeds (pytest -m slow)


@pytest.mark.slow
@pytest.mark.parametrize("num_records,batch_size", SLOW_SUBSET_CASES)
def test_fixed_size_uniform_over_subsets_and_ordered_sequences_more_cases(slow_draws, num_records, batch_size):
    indices, _ = slow_draws[(num_records, batch_size)]
    assert subset_chi2_pvalue(indices, num_records, batch_size) > ALPHA
    assert ordered_chi2_pvalue(indices, num_records, min(batch_size, 3)) > ALPHA


@pytest.mark.slow
def test_fixed_size_uniform_over_subsets_many_draws():
    """Ten seeds of 100,000 batches for each case: the ten p-values are uniform on (0, 1)."""
    cases = [(10, 3), (5, 2), (8, 4), (17, 2), (33, 2)]
    samples = {case: (FixedSizeSampler(*case).sample, 1000) for case in cases}
    out = draw_all(samples, NUM_DRAWS, num_seeds=10)
    for (num_records, batch_size), (indices, _) in out.items():
        pvalues = [subset_chi2_pvalue(rows, num_records, batch_size) for rows in indices]
        assert stats.kstest(pvalues, "uniform").pvalue > ALPHA, (num_records, batch_size)
