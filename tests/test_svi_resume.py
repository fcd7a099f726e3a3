# SPDX-License-Identifier: Apache-2.0
"""DPSVI.run with a ledger, a checkpoint and an ε asked for: a resumed run
equals the uninterrupted one bit for bit, the ledger counts both parts, a
run that would pass the budget or reuse batch keys never starts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_accounting import NeighboringRelation, dp_event
from dp_accounting.pld import pld_privacy_accountant

import d3p.random
from d3p.ledger import BudgetExceededError, PrivacyLedger
from d3p.svi import Checkpoint, load_checkpoint, save_checkpoint

from _normal_mean import normal_mean_svi

N = 200
Q = 0.05
XS = jnp.linspace(0.0, 2.0, N)


def _svi(dp_scale=1.0):
    return normal_mean_svi(clipping_threshold=2.0, dp_scale=dp_scale, N=N)


def _pld_epsilon(sigma, q, steps, delta):
    acc = pld_privacy_accountant.PLDAccountant(NeighboringRelation.ADD_OR_REMOVE_ONE,
                                               value_discretization_interval=1e-4)
    acc.compose(dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)),
                                             steps))
    return acc.get_epsilon(delta)


# runs of 20 steps or fewer advance the progress bar one compiled step at a
# time: every run below reuses the one compiled step of its DPSVI
@pytest.fixture(scope="module")
def svi():
    return _svi()


@pytest.fixture(scope="module")
def uninterrupted(svi):
    return svi.run(d3p.random.PRNGKey(3), 20, XS, q=Q)


@pytest.mark.slow
def test_resumed_run_is_bit_identical_and_counted_once(svi, uninterrupted, tmp_path):
    key, delta = d3p.random.PRNGKey(3), 1e-5
    ledger = PrivacyLedger()
    first = svi.run(key, 8, XS, q=Q, ledger=ledger)
    path = tmp_path / "run.npz"
    save_checkpoint(path, first, ledger=ledger)
    checkpoint = load_checkpoint(path)
    assert isinstance(checkpoint, Checkpoint) and checkpoint.step == 8 and len(checkpoint.ledger) == 1
    # the checkpoint's step and ledger are the defaults of start_step and ledger
    second = svi.run(key, 12, XS, q=Q, init_state=checkpoint)
    assert second.start_step == 8
    for a, b in zip(jax.tree.leaves(uninterrupted.state), jax.tree.leaves(second.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    total = checkpoint.ledger.epsilon(delta)
    assert [r.first_step for r in checkpoint.ledger.releases] == [0, 8]
    reference = _pld_epsilon(1.0, Q, 20, delta)
    assert reference * (1 - 1e-3) <= total <= reference * 1.01
    # the same key from step 0 again would redraw the same batches: refused
    with pytest.raises(ValueError, match="start_step=20"):
        svi.run(key, 5, XS, q=Q, ledger=checkpoint.ledger, start_step=0)


def test_checkpoint_into_a_state(uninterrupted, tmp_path):
    path = tmp_path / "state.npz"
    save_checkpoint(path, uninterrupted.state, step=20)
    back = load_checkpoint(path, like=uninterrupted.state)
    assert back.ledger is None and back.step == 20
    for a, b in zip(jax.tree.leaves(uninterrupted.state), jax.tree.leaves(back.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="step"):
        save_checkpoint(path, uninterrupted.state)
    with pytest.raises(ValueError, match="structure"):
        back.into({"other": jnp.zeros(2)})


def test_budget_refuses_the_run_before_it_starts():
    ledger = PrivacyLedger(budget_epsilon=1.0, budget_delta=1e-5)
    svi = _svi()
    with pytest.raises(BudgetExceededError, match="budget of epsilon 1 at"):
        svi.run(d3p.random.PRNGKey(0), 20, XS, q=Q, ledger=ledger, delta=1e-5)
    assert len(ledger) == 0 and svi.strategy_choice is None   # no step was traced


@pytest.mark.slow
def test_ask_for_epsilon():
    svi = _svi(dp_scale=None)
    result = svi.run(d3p.random.PRNGKey(0), 20, XS, q=Q, epsilon=2.0, delta=1e-5)
    assert result.epsilon <= 2.0 and result.delta <= 1e-5
    # σ is the smallest that reaches ε = 2 for this sampler and number of steps (dp-accounting, directly)
    assert _pld_epsilon(result.sigma, Q, 20, 1e-5) <= 2.0 * (1 + 1e-3)
    assert _pld_epsilon(result.sigma * 0.99, Q, 20, 1e-5) > 2.0
    assert svi.dp_scale is None
    with pytest.raises(ValueError, match="dp_scale=1.0.*epsilon=2.0"):
        _svi().run(d3p.random.PRNGKey(0), 30, XS, q=Q, progress_bar=False, epsilon=2.0)
    with pytest.raises(ValueError, match="dp_scale=None"):
        svi.run(d3p.random.PRNGKey(0), 30, XS, q=Q, progress_bar=False)
    with pytest.raises(ValueError, match="one of delta and target_delta"):
        svi.run(d3p.random.PRNGKey(0), 30, XS, q=Q, epsilon=1.0, delta=1e-5, target_delta=1e-5)
