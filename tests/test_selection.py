"""The exponential mechanism (d3p.selection): its draws follow exp(ε u / (2Δu)), and
its Rényi divergences on neighbouring scores stay below α ε²/8 (the ρ that
d3p.accounting.exponential_rho claims)."""

import math

import numpy as np
import pytest
from scipy import stats
from scipy.special import logsumexp

import d3p.random
from d3p import accounting
from d3p.selection import exponential_mechanism, selection_probabilities

SCORES = np.array([0.0, 1.0, 2.0, 3.0, 4.0, 2.5])


def _draws(epsilon, n, seed=0):
    keys = d3p.random.split(d3p.random.PRNGKey(seed), n)
    return np.array([exponential_mechanism(k, SCORES, sensitivity=1.0, epsilon=epsilon) for k in keys])


def _chi2_pvalue(counts, probs):
    expected = probs * counts.sum()
    return stats.chisquare(counts, expected).pvalue


def test_draws_follow_the_mechanism_and_reject_other_scales():
    """A chi-square test accepts the probabilities at ε and rejects those at 2/3 ε and 3/2 ε."""
    eps = 1.2
    counts = np.bincount(_draws(eps, 3000), minlength=SCORES.size)
    assert _chi2_pvalue(counts, selection_probabilities(SCORES, 1.0, eps)) > 1e-3
    for wrong in (2 / 3 * eps, 1.5 * eps):
        assert _chi2_pvalue(counts, selection_probabilities(SCORES, 1.0, wrong)) < 1e-6


def test_probabilities_are_exp_of_half_epsilon_over_sensitivity():
    p = selection_probabilities([0.0, 2.0], sensitivity=2.0, epsilon=1.0)
    assert p[1] / p[0] == pytest.approx(math.exp(1.0 * 2.0 / (2 * 2.0)))


def _renyi(p, q, alpha):
    """D_α(P‖Q) of two distributions with positive probabilities, in log space."""
    return float(logsumexp(alpha * np.log(p) + (1 - alpha) * np.log(q)) / (alpha - 1))


def _neighbours(k, rng):
    """Scores u and u' with |u - u'| <= 1 everywhere: some candidates up, some down
    (the extreme cases of bounded range), and random ones."""
    base = rng.normal(0, 3, k)
    yield base, base + np.where(np.arange(k) < k // 2, 1.0, -1.0)
    yield base, base + np.where(np.arange(k) == 0, 1.0, -1.0)
    yield base, base + rng.uniform(-1, 1, k)


@pytest.mark.parametrize("epsilon", [0.05, 0.5, 2.0])
def test_renyi_divergence_is_within_the_claimed_rho(epsilon):
    """D_α(P‖Q) ≤ α ε²/8 for neighbouring scores (sensitivity 1) at every order tried;
    the same pairs exceed the bound for a mechanism with twice the ε (a bound that
    is not tight would let a factor-2 error through)."""
    rho = accounting.exponential_rho(epsilon)
    rng = np.random.default_rng(0)
    doubled_breaks = False
    for k in (2, 5, 40):
        for u, v in _neighbours(k, rng):
            for a, b in ((u, v), (v, u)):
                for alpha in (1.5, 2.0, 4.0, 16.0, 64.0):
                    p, q = selection_probabilities(a, 1.0, epsilon), selection_probabilities(b, 1.0, epsilon)
                    assert _renyi(p, q, alpha) <= alpha * rho * (1 + 1e-9) + 1e-15
                    p2, q2 = (selection_probabilities(a, 1.0, 2 * epsilon),
                              selection_probabilities(b, 1.0, 2 * epsilon))
                    doubled_breaks |= _renyi(p2, q2, alpha) > alpha * rho
    assert doubled_breaks


def test_infinite_epsilon_picks_the_best_and_keys_are_explicit():
    assert exponential_mechanism(d3p.random.PRNGKey(3), SCORES, sensitivity=1.0, epsilon=math.inf) == 4
    with pytest.raises(ValueError, match="rng_key"):
        exponential_mechanism(None, SCORES, sensitivity=1.0, epsilon=1.0)


@pytest.mark.parametrize("kwargs, message", [
    ({"sensitivity": 0.0, "epsilon": 1.0}, "sensitivity"),
    ({"sensitivity": 1.0, "epsilon": -1.0}, "epsilon"),
])
def test_argument_messages(kwargs, message):
    with pytest.raises(ValueError, match=message):
        exponential_mechanism(d3p.random.PRNGKey(0), SCORES, **kwargs)


def test_non_finite_scores_are_refused():
    with pytest.raises(ValueError, match="finite scores"):
        selection_probabilities([0.0, math.nan], 1.0, 1.0)
