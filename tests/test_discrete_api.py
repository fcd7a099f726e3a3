"""noise="discrete" through the public accounting API, calibration and the command line."""

import subprocess
import sys

import pytest

from d3p import accounting, dputil
from d3p._accounting import _discrete


@pytest.mark.parametrize("sampler, relation", [("poisson", None), ("poisson", "substitute"), ("fixed_size", None)])
def test_compute_epsilon_and_delta_use_the_discrete_bound(sampler, relation):
    acc = accounting.accounting_for(sampler, relation, noise="discrete")
    eps = accounting.compute_epsilon(1.2, 0.02, 500, 1e-5, sampler=sampler, relation=relation, noise="discrete")
    phases = [accounting.Phase(1.2, 0.02, 500)]
    assert eps == _discrete.epsilon((acc.sampler, acc.relation), phases, 1e-5)
    # never below the continuous mechanism's (a looser, proven bound)
    assert eps >= accounting.compute_epsilon(1.2, 0.02, 500, 1e-5, sampler=sampler, relation=relation)
    delta = accounting.compute_delta(1.2, 0.02, 500, eps, sampler=sampler, relation=relation, noise="discrete")
    assert delta <= 1e-5 * (1 + 1e-6)
    tracker = accounting.EpsilonTracker(1.2, 0.02, 1e-5, sampler=sampler, relation=relation, num_steps=500,
                                        noise="discrete")
    assert tracker.total_epsilon == eps and tracker.epsilon(250) <= eps
    assert "noise='discrete'" in repr(tracker)
    assert accounting.compose_epsilon([(1.2, 0.02, 500)], 1e-5, sampler=sampler, relation=relation,
                                      noise="discrete") == eps


def test_trivial_phases():
    assert accounting.compute_epsilon(1.0, 0.1, 0, 1e-5, noise="discrete") == 0.0
    assert accounting.compute_epsilon(float("inf"), 0.1, 10, 1e-5, noise="discrete") == 0.0
    assert accounting.compute_epsilon(0.0, 0.1, 10, 1e-5, noise="discrete") == float("inf")
    assert accounting.compute_delta(0.0, 0.1, 10, 1.0, noise="discrete") == pytest.approx(1 - 0.9 ** 10)


@pytest.mark.parametrize("fn, sampler", [(dputil.approximate_sigma, "fixed_size"),
                                         (dputil.approximate_sigma_remove_relation, "poisson")])
def test_calibration_meets_the_target_tightly(fn, sampler):
    sigma, eps, evals = fn(1.0, 1e-5, 0.01, 1000, noise="discrete")
    assert eps <= 1.0 and evals > 0
    assert eps == accounting.compute_epsilon(sigma, 0.01, 1000, 1e-5, sampler=sampler, noise="discrete")
    # the smallest such sigma, to the tolerance
    assert accounting.compute_epsilon(sigma / 1.003, 0.01, 1000, 1e-5, sampler=sampler, noise="discrete") > 1.0
    gaussian, _, _ = fn(1.0, 1e-5, 0.01, 1000)
    assert sigma > gaussian


def test_bad_noise_names_the_argument():
    with pytest.raises(ValueError, match="noise"):
        accounting.compute_epsilon(1.0, 0.1, 10, 1e-5, noise="laplace")
    with pytest.raises(ValueError, match="noise"):
        dputil.calibrate_sigma(1.0, 1e-5, 0.1, 10, noise=None)


def test_command_line():
    out = subprocess.run(
        [sys.executable, "-m", "d3p", "epsilon", "--sigma", "1", "--delta", "1e-5", "--q", "0.01",
         "--steps", "1000", "--noise", "discrete"], capture_output=True, text=True, check=True).stdout
    expected = accounting.compute_epsilon(1.0, 0.01, 1000, 1e-5, noise="discrete")
    assert f"epsilon={expected:.6g}" in out and "discrete" in out
