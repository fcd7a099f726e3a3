# SPDX-License-Identifier: Apache-2.0
"""Tests for d3p.dputil: noise calibration.

Properties checked:
* round trip: ε(σ) ≤ ε* and ≥ ε*(1 − 0.005) for the returned σ;
* against dp-accounting's PLD accountant: the PLD ε of the returned σ is at
  most ε* (within the PLD tolerance 1e-3·ε + 1e-3, see test_accounting.py),
  and σ is within 0.5% of the smallest σ meeting the target (the PLD ε of
  σ/1.005 exceeds ε*);
* known values, edge cases, validation.
"""

import math

import pytest

from d3p.accounting import ADD_REMOVE, SUBSTITUTE, compute_epsilon
from d3p.dputil import approximate_sigma, approximate_sigma_remove_relation

CALIBRATORS = [
    (approximate_sigma, SUBSTITUTE),
    (approximate_sigma_remove_relation, ADD_REMOVE),
]
IDS = ["substitute", "add_remove"]


def pld_tol(eps):
    return 1e-3 * eps + 1e-3


def _slow(*case):
    """A parameter set marked slow."""
    return pytest.param(*case, marks=pytest.mark.slow)


# (target ε, δ, q, T, tight): the tight cases also check ε from below
ROUND_TRIP_CASES = [
    (1.0, 1e-5, 0.01, 2000, True), (0.5, 1e-5, 0.001, 10000, True), (8.0, 1e-5, 0.1, 1000, True),
    (0.1, 1e-6, 0.01, 1000, True), (50.0, 1e-5, 0.01, 100, True), (1.0, 1e-5, 0.3, 1, True),
    # slow: 10^5 steps take seconds per calibration
    _slow(2.0, 1e-5, 0.001, 100000, True),
    _slow(0.01, 1e-5, 0.01, 1000, False), _slow(100.0, 1e-5, 0.05, 1000, False),
    _slow(1.0, 1e-8, 0.0001, 1000000, False), _slow(4.0, 1e-5, 0.5, 20, False),
    _slow(0.3, 1e-10, 1e-6, 1, False), _slow(1.0, 1e-5, 1e-4, 10 ** 7, False),
]


@pytest.mark.parametrize("fn, relation", CALIBRATORS, ids=IDS)
@pytest.mark.parametrize("target, delta, q, steps, tight", ROUND_TRIP_CASES)
def test_round_trip(fn, relation, target, delta, q, steps, tight):
    # ε never above the target; on the fast cases also at most 0.5% below it
    # and the accounting module agrees with the calibrator's ε
    sigma, eps, n = fn(target, delta, q, steps)
    assert sigma > 0 and eps <= target
    if tight:
        assert n >= 1
        assert eps >= target * (1 - 5e-3) - 1e-12
        assert compute_epsilon(sigma, q, steps, delta, relation=relation) <= target * (1 + 2e-3)


PLD_CASES = [
    (1.0, 1e-5, 0.01, 2000), (4.0, 1e-6, 0.05, 500),
    _slow(0.5, 1e-5, 0.001, 10000), _slow(8.0, 1e-5, 0.1, 1000), _slow(1.0, 1e-6, 0.005, 20000),
    _slow(2.0, 1e-5, 0.2, 50), _slow(20.0, 1e-5, 0.02, 300),
]


@pytest.mark.parametrize("fn, relation", CALIBRATORS, ids=IDS)
@pytest.mark.parametrize("target, delta, q, steps", PLD_CASES)
def test_against_pld(fn, relation, target, delta, q, steps):
    sigma, eps, _ = fn(target, delta, q, steps)
    ref = compute_epsilon(sigma, q, steps, delta, relation=relation, accountant="pld")
    # never optimistic beyond the PLD's own tolerance
    assert ref <= target + pld_tol(target)
    # σ within 0.5% of the smallest σ meeting the target
    ref_smaller = compute_epsilon(sigma / 1.005, q, steps, delta, relation=relation, accountant="pld")
    assert ref_smaller > target


@pytest.mark.slow
@pytest.mark.parametrize("fn, relation", CALIBRATORS, ids=IDS)
def test_against_pld_calibration(fn, relation):
    # σ calibrated by the PLD accountant is never above ours by more than 0.5%
    # and ours is never below it by more than the tolerance
    ours, _, _ = fn(1.0, 1e-5, 0.01, 2000)
    ref, _, _ = fn(1.0, 1e-5, 0.01, 2000, accountant="pld")
    assert ref * (1 - 2e-3) <= ours <= ref * 1.005


def test_jax_privacy_known_value():
    # σ=3, q=0.1, T=512, δ=1e-6 has ε≈3.77; calibrating to ε=1 gives σ≈9.66
    sigma, eps, _ = approximate_sigma_remove_relation(1.0, 1e-6, 0.1, 512)
    assert sigma == pytest.approx(9.66, abs=0.02)
    assert eps <= 1.0


@pytest.mark.parametrize("fn, relation", CALIBRATORS, ids=IDS)
def test_typical_setting_is_tight_and_cheap(fn, relation):
    # within 0.1% below the target with a bounded number of FFT compositions
    sigma, eps, n = fn(1.0, 1e-5, 0.01, 2000)
    assert 0.999 * 1.0 <= eps <= 1.0
    assert n <= 40


# --------------------------------------------------------------------------
# edge cases
# --------------------------------------------------------------------------


@pytest.mark.parametrize("fn, sensitivity", [(approximate_sigma, 2.0), (approximate_sigma_remove_relation, 1.0)],
                         ids=IDS)
def test_q_one_closed_form(fn, sensitivity):
    from scipy.stats import norm
    sigma, eps, _ = fn(1.0, 1e-5, 1.0, 100)
    assert eps <= 1.0
    assert eps == pytest.approx(1.0, rel=1e-9)
    mu = sensitivity * 10 / sigma
    d = norm.cdf(mu / 2 - eps / mu) - math.exp(eps) * norm.cdf(-mu / 2 - eps / mu)
    assert d == pytest.approx(1e-5, rel=1e-6)


def test_q_one_relations_differ_by_factor_two():
    s_sub, _, _ = approximate_sigma(2.0, 1e-5, 1.0, 10)
    s_rem, _, _ = approximate_sigma_remove_relation(2.0, 1e-5, 1.0, 10)
    assert s_sub == pytest.approx(2 * s_rem, rel=1e-9)


@pytest.mark.parametrize("fn, relation", CALIBRATORS, ids=IDS)
def test_single_step(fn, relation):
    sigma, eps, _ = fn(1.0, 1e-5, 0.1, 1)
    assert eps <= 1.0
    assert compute_epsilon(sigma, 0.1, 1, 1e-5, relation=relation) <= 1.0 * (1 + 2e-3)


@pytest.mark.parametrize("fn", [approximate_sigma, approximate_sigma_remove_relation], ids=IDS)
def test_no_noise_needed_when_record_rarely_used(fn):
    # the record is used with probability 1 - (1 - 1e-7)^10 < δ
    assert fn(1.0, 1e-5, 1e-7, 10) == (0.0, 0.0, 0)


@pytest.mark.parametrize("fn", [approximate_sigma, approximate_sigma_remove_relation], ids=IDS)
def test_time_budget_still_safe(fn):
    # a tiny budget: whatever is returned must meet the target
    sigma, eps, _ = fn(1.0, 1e-5, 0.001, 100000, max_time=0.01)
    assert sigma > 0 and eps <= 1.0


@pytest.mark.parametrize("fn", [approximate_sigma, approximate_sigma_remove_relation], ids=IDS)
def test_rdp_accountant_is_more_conservative(fn):
    s_f, _, _ = fn(1.0, 1e-5, 0.01, 1000)
    s_r, e_r, _ = fn(1.0, 1e-5, 0.01, 1000, accountant="rdp")
    assert e_r <= 1.0
    assert s_r >= s_f


@pytest.mark.parametrize("fn", [approximate_sigma, approximate_sigma_remove_relation], ids=IDS)
@pytest.mark.parametrize("args, match", [
    ((0.0, 1e-5, 0.01, 100), "target_eps=0.0"),
    ((-1.0, 1e-5, 0.01, 100), "target_eps=-1.0"),
    ((float("inf"), 1e-5, 0.01, 100), "target_eps=inf"),
    ((1.0, 0.0, 0.01, 100), "delta=0.0"),
    ((1.0, 1.5, 0.01, 100), "delta=1.5"),
    ((1.0, 1e-5, 1.5, 100), r"Expected q to be a finite number in \(0, 1\], got q=1.5\."),
    ((1.0, 1e-5, 0.0, 100), "q=0.0"),
    ((1.0, 1e-5, 0.01, 0), "num_iter=0"),
    ((1.0, 1e-5, 0.01, 10.5), "num_iter=10.5"),
])
def test_validation(fn, args, match):
    with pytest.raises(ValueError, match=match):
        fn(*args)


def test_validation_of_keywords():
    with pytest.raises(ValueError, match="tol=0.0"):
        approximate_sigma(1.0, 1e-5, 0.01, 100, tol=0.0)
    with pytest.raises(ValueError, match="max_time=-1"):
        approximate_sigma(1.0, 1e-5, 0.01, 100, max_time=-1)
    with pytest.raises(ValueError, match="accountant='x'"):
        approximate_sigma(1.0, 1e-5, 0.01, 100, accountant="x")
    with pytest.raises(TypeError):
        approximate_sigma(1.0, 1e-5, 0.01, 100, 1e-3, True, 20)  # beyond d3p 0.2's: keyword-only


def test_d3p_02_spellings():
    """d3p 0.2 programs (twinify among them) pass tol positionally, force_smaller and maxeval."""
    from d3p.dputil import approximate_sigma, approximate_sigma_remove_relation

    for fn in (approximate_sigma, approximate_sigma_remove_relation):
        sigma, eps, evals = fn(1.0, 1e-5, 0.01, 1000, 1e-3, True, maxeval=20)
        assert eps <= 1.0 and evals <= 20 + 64   # the RDP fallback may add evaluations
        assert fn(1.0, 1e-5, 0.01, 1000, 1e-3, False)[1] <= 1.0   # never above the target
        with pytest.raises(ValueError, match="maxeval"):
            fn(1.0, 1e-5, 0.01, 1000, maxeval=0)
        with pytest.raises(TypeError, match="force_smaller"):
            fn(1.0, 1e-5, 0.01, 1000, 1e-3, "yes")


def test_calibration_is_cached_per_process(monkeypatch):
    # a second run(epsilon=...) with the same plan calibrates nothing; any other input does
    from d3p import dputil
    from d3p._accounting import _engine

    calls = []
    real = _engine.epsilon
    monkeypatch.setattr(_engine, "epsilon", lambda *a, **k: calls.append(a) or real(*a, **k))
    first = approximate_sigma_remove_relation(1.3, 1e-6, 0.0123, 321)
    made = len(calls)
    assert made > 0
    assert approximate_sigma_remove_relation(1.3, 1e-6, 0.0123, 321) == first and len(calls) == made
    assert approximate_sigma_remove_relation(1.3, 1e-6, 0.0123, 322) != first and len(calls) > made
    dputil._calibrate_cached.cache_clear()
    assert approximate_sigma_remove_relation(1.3, 1e-6, 0.0123, 321)[:2] == first[:2]
