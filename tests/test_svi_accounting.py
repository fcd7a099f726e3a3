"""DPSVI.run reports the ε of the sampler it actually used.

References are dp-accounting's PLD accountant called directly with the
dominating pair of each sampler (see d3p.accounting.accounting_for)."""

import jax.numpy as jnp
import pytest

import d3p.random

from _normal_mean import normal_mean_svi

dp_accounting = pytest.importorskip("dp_accounting")
from dp_accounting.pld import pld_privacy_accountant  # noqa: E402


N = 200
XS = jnp.linspace(0.0, 2.0, N)


def reference_epsilon(sigma, q, steps, delta, pair_sigma_divisor, relation):
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma / pair_sigma_divisor))
    acc = pld_privacy_accountant.PLDAccountant(relation)
    acc.compose(event, steps)
    return acc.get_epsilon(delta)


@pytest.fixture(scope="module")
def svi():
    return normal_mean_svi(clipping_threshold=1.0, dp_scale=1.5, N=N)


NR = dp_accounting.NeighboringRelation


@pytest.mark.parametrize("kwargs, sampler, relation, divisor, nr", [
    ({"batch_size": 10}, "poisson", "add_remove", 1.0, NR.ADD_OR_REMOVE_ONE),            # the default
    ({"q": 0.05, "relation": "substitute"}, "poisson", "substitute", 1.0, NR.REPLACE_ONE),
    ({"batch_size": 10, "sampling": "fixed"}, "fixed_size", "substitute", 2.0, NR.ADD_OR_REMOVE_ONE),
])
@pytest.mark.slow
def test_run_reports_the_epsilon_of_its_sampler(svi, kwargs, sampler, relation, divisor, nr):
    res = svi.run(d3p.random.PRNGKey(0), 300, XS, progress_bar=False, target_delta=1e-5, **kwargs)
    assert (res.sampler, res.relation, res.q, res.num_steps, res.sigma) == (sampler, relation, 0.05, 300, 1.5)
    ref = reference_epsilon(1.5, 0.05, 300, 1e-5, divisor, nr)
    # the tracker reports ε at a grid point ≥ the step count: an upper bound, here exact
    assert ref * (1 - 1e-3) <= res.epsilon <= ref * (1 + 2e-3)
    if sampler == "fixed_size":
        assert res.delta == 1e-5
    else:
        assert 1e-5 <= res.delta <= 1e-5 * (1 + 1e-6)      # plus the padding-overflow term


def test_run_refuses_fixed_size_under_add_remove(svi):
    with pytest.raises(ValueError, match="relation='substitute' for sampler='fixed_size'"):
        svi.run(d3p.random.PRNGKey(0), 10, XS, batch_size=10, sampling="fixed", relation="add_remove",
                progress_bar=False)


def test_get_epsilon_defaults_to_the_most_conservative_accounting(svi):
    fixed = reference_epsilon(1.5, 0.05, 300, 1e-5, 2.0, NR.ADD_OR_REMOVE_ONE)
    assert svi.get_epsilon(1e-5, 0.05, num_iter=300) == pytest.approx(fixed, rel=1e-3)
    assert svi.get_epsilon(1e-5, 0.05, num_iter=300, relation="substitute") == pytest.approx(fixed, rel=1e-3)
    poisson = reference_epsilon(1.5, 0.05, 300, 1e-5, 1.0, NR.ADD_OR_REMOVE_ONE)
    assert svi.get_epsilon(1e-5, 0.05, num_iter=300, sampler="poisson") == pytest.approx(poisson, rel=1e-3)
    d = svi.get_delta(fixed, 0.05, num_iter=300)
    assert d == pytest.approx(1e-5, rel=1e-2) and d >= 1e-5 * (1 - 1e-3)


@pytest.mark.parametrize("sampler", [None, "poisson"])
def test_get_epsilon_and_get_delta_agree(svi, sampler):
    """get_delta inverts get_epsilon; num_epochs counts ceil(num_epochs / q) steps in both."""
    eps = svi.get_epsilon(1e-5, 0.05, num_iter=300, sampler=sampler)
    assert svi.get_epsilon(1e-5, 0.05, num_epochs=15, sampler=sampler) == eps
    assert svi.get_delta(eps, 0.05, num_epochs=15, sampler=sampler) == pytest.approx(1e-5, rel=1e-2)
    assert svi.get_epsilon(1e-5, 0.05, num_epochs=14.99, sampler=sampler) == eps  # 299.8 -> 300 steps


@pytest.mark.parametrize("method, first", [("get_epsilon", 1e-5), ("get_delta", 1.0)])
def test_get_epsilon_and_get_delta_check_arguments_alike(svi, method, first):
    with pytest.raises(ValueError, match=r"Expected num_iter to be an integer >= 1, got num_iter=0\."):
        getattr(svi, method)(first, 0.05, num_iter=0)
    with pytest.raises(ValueError, match=r"Expected q to be a finite number in \(0, 1\], got q=1\.5\."):
        getattr(svi, method)(first, 1.5, num_epochs=1)
    with pytest.raises(ValueError, match=r"Expected num_epochs to be a finite number > 0, got num_epochs=-1"):
        getattr(svi, method)(first, 0.05, num_epochs=-1)
