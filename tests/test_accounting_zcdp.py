"""Zero-concentrated DP accounting (d3p.accounting: gaussian_rho, exponential_rho,
zcdp_epsilon/delta/rho, ZCDPBudget) against dp-accounting called directly."""

import math

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import privacy_loss_distribution as pld
from dp_accounting.rdp import rdp_privacy_accountant

from d3p import accounting


def _rdp_reference(events, delta):
    acc = rdp_privacy_accountant.RdpAccountant()
    for e in events:
        acc.compose(e)
    return acc.get_epsilon(delta)


@pytest.mark.parametrize("rho", [1e-4, 0.005, 0.024, 0.5, 4.0])
@pytest.mark.parametrize("delta", [1e-9, 1e-6, 1e-3])
def test_zcdp_epsilon_matches_dp_accounting_rdp(rho, delta):
    """The same conversion (RDP at αρ, Canonne-Kamath-Steinke), minimised over α:
    never above dp-accounting's value on its grid of orders, and within 5% of it."""
    ours = accounting.zcdp_epsilon(rho, delta)
    ref = _rdp_reference([dp_event.ZCDpEvent(rho)], delta)
    assert ours <= ref * (1 + 1e-9)
    assert ours >= 0.95 * ref


@pytest.mark.parametrize("noise_multiplier", [0.5, 2.0, 8.0])
def test_zcdp_of_the_gaussian_mechanism_is_not_optimistic(noise_multiplier):
    """The ε of gaussian_rho(Δ, s) is at least the exact ε of the Gaussian mechanism
    (dp-accounting's PLD, pessimistic discretisation: slightly above the exact value)."""
    delta = 1e-6
    rho = accounting.gaussian_rho(3.0, 3.0 * noise_multiplier)  # sensitivity 3, std 3σ
    exact = pld.from_gaussian_mechanism(noise_multiplier, value_discretization_interval=1e-4) \
        .get_epsilon_for_delta(delta)
    assert accounting.zcdp_epsilon(rho, delta) >= exact * (1 - 1e-3)


def test_composition_of_gaussian_mechanisms_equals_dp_accounting():
    """Several Gaussian releases with their own sensitivities and noise, spent from one
    budget, have the ε of dp-accounting's RDP accountant composing the same mechanisms."""
    releases = [(1.0, 25.0), (math.sqrt(9), 40.0), (1.0, 60.0), (math.sqrt(2), 10.0)]
    budget = accounting.ZCDPBudget(10.0)
    for sens, std in releases:
        budget.spend(accounting.gaussian_rho(sens, std), "release")
    ours = budget.epsilon(1e-6)
    ref = _rdp_reference([dp_event.GaussianDpEvent(std / sens) for sens, std in releases], 1e-6)
    assert ours == pytest.approx(ref, rel=0.05)
    assert ours <= ref * (1 + 1e-9)


def test_exponential_rho_composes_as_dp_accounting_zcdp_events():
    eps0 = [0.1, 0.3, 0.05]
    budget = accounting.ZCDPBudget(1.0)
    for e in eps0:
        budget.spend(accounting.exponential_rho(e), "selection")
    assert budget.spent == pytest.approx(sum(e * e / 8 for e in eps0))
    ref = _rdp_reference([dp_event.ZCDpEvent(e * e / 8) for e in eps0], 1e-6)
    assert budget.epsilon(1e-6) == pytest.approx(ref, rel=0.05)


@pytest.mark.parametrize("epsilon", [0.1, 1.0, 8.0])
def test_zcdp_rho_calibration_is_tight_and_never_above_the_target(epsilon):
    rho = accounting.zcdp_rho(epsilon, 1e-6)
    assert accounting.zcdp_epsilon(rho, 1e-6) <= epsilon
    assert accounting.zcdp_epsilon(rho * 1.001, 1e-6) > epsilon


def test_zcdp_delta_inverts_epsilon():
    eps = accounting.zcdp_epsilon(0.02, 1e-6)
    assert accounting.zcdp_delta(0.02, eps) == pytest.approx(1e-6, rel=1e-6)
    assert accounting.zcdp_delta(0.02, eps * 1.1) < 1e-6


def test_count_sensitivity_by_relation():
    assert accounting.count_sensitivity("add_remove") == 1.0
    assert accounting.count_sensitivity("add-remove", "l1") == 1.0
    assert accounting.count_sensitivity("substitute") == pytest.approx(math.sqrt(2))
    assert accounting.count_sensitivity("substitute", "l1") == 2.0


def test_budget_refuses_to_overspend_and_keeps_a_ledger():
    budget = accounting.ZCDPBudget(0.01)
    budget.spend(0.006, "a")
    with pytest.raises(ValueError, match="zCDP budget"):
        budget.spend(0.005, "b")
    assert budget.ledger == [("a", 0.006)]
    assert budget.remaining == pytest.approx(0.004)


def test_no_privacy_and_nothing_released():
    assert accounting.zcdp_epsilon(0.0, 1e-6) == 0.0
    assert math.isinf(accounting.zcdp_epsilon(math.inf, 1e-6))
    assert math.isinf(accounting.zcdp_rho(math.inf, 1e-6))
    assert math.isinf(accounting.gaussian_rho(1.0, 0.0))
    assert accounting.gaussian_rho(0.0, 1.0) == 0.0


@pytest.mark.parametrize("call, message", [
    (lambda: accounting.gaussian_rho(-1.0, 1.0), "sensitivity"),
    (lambda: accounting.zcdp_epsilon(0.1, 1.5), "delta"),
    (lambda: accounting.zcdp_rho(0.0, 1e-6), "epsilon"),
    (lambda: accounting.count_sensitivity("neither"), "relation"),
    (lambda: accounting.ZCDPBudget(-1.0), "rho"),
])
def test_argument_messages_name_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_conversion_grid_covers_large_and_small_rho():
    """ε grows with ρ and is continuous over many orders of magnitude."""
    rhos = np.geomspace(1e-6, 50, 40)
    eps = [accounting.zcdp_epsilon(r, 1e-6) for r in rhos]
    assert np.all(np.diff(eps) > 0)
