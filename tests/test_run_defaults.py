"""What DPSVI.run chooses by itself and what it adds after the steps.

- Without ``batch_size`` or ``q`` the run takes the whole data at every step
  with the noise given (as NumPyro), nearly all of it asking for ε
  (:func:`d3p._run_plan.automatic_sampling`, :func:`d3p._run_plan.automatic_q`):
  deterministic functions of public facts, said on the terminal and accounted.
- ``average``: the result's parameters are the mean of the unconstrained
  parameters after each of the run's last steps (post-processing of
  releases the run made anyway: the state, the ε and the ledger are those of
  the run without averaging).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.optimize
import scipy.stats

import d3p.random
from d3p import _run_plan, accounting

from _normal_mean import normal_mean_svi

N, T = 40, 8
XS = jnp.linspace(0.0, 1.0, N)


@pytest.fixture(scope="module")
def svi():
    return normal_mean_svi(clipping_threshold=1.0, dp_scale=2.0, N=N)


@pytest.mark.parametrize("sampling, epsilon, given, expected", [
    (None, None, {}, "fixed"),                     # the noise given: the whole data, as NumPyro
    (None, 1.0, {}, "poisson"),                    # asking for ε: nearly all of it, add/remove
    (None, None, dict(relation="add_remove"), "poisson"),
    (None, None, dict(relation="substitute"), "fixed"),
    (None, None, dict(batch_size=8), "poisson"),
    (None, None, dict(q=0.5), "poisson"),
    (None, None, dict(max_batch_size=8), "poisson"),
    ("poisson", None, {}, "poisson"),
    ("fixed", 1.0, {}, "fixed"),
])
def test_automatic_sampling_is_a_function_of_public_facts(sampling, epsilon, given, expected):
    args = dict(batch_size=None, q=None, max_batch_size=None, relation=None) | given
    assert _run_plan.automatic_sampling(sampling, args["batch_size"], args["q"], args["max_batch_size"],
                                        epsilon, args["relation"]) == expected


def test_automatic_q_of_whole_data_batches_is_one_at_any_size():
    assert _run_plan.automatic_q(100_000, "fixed", 10, 1e-12, None) == 1.0
    assert _run_plan.automatic_q(100_000, "fixed", 10, 1e-12, 1.0) == 4096 / 100_000


@pytest.mark.parametrize("num_records, sampling, steps, delta, epsilon", [
    (40, "poisson", 8, 1e-4, None),          # ε not given: bounded as for ε = 1
    (455, "poisson", 2000, 1 / 455**2, 8.0),  # the README's data at ε = 8: 0.927
    (455, "poisson", 2000, 1 / 455**2, 1.0),
    (20_000, "poisson", 2000, 1 / 20_000**2, 1.0),  # capped at an expected 4,096 records
    (40, "fixed", 8, 1e-4, 1.0),             # fixed size: the whole data set
    (10_000, "fixed", 8, 1e-4, 1.0),
])
def test_automatic_q_is_a_function_of_public_facts(num_records, sampling, steps, delta, epsilon):
    q = _run_plan.automatic_q(num_records, sampling, steps, delta, epsilon)
    cap = min(1.0, 4096 / num_records)
    assert 0 < q <= cap
    if sampling == "fixed":
        assert q == cap
    elif q < cap:
        # the add/remove neighbour's overflow adds at most a thousandth of δ, computed here
        eps = 1.0 if epsilon is None else epsilon
        added = (1 + math.exp(eps)) * steps * q ** (num_records + 1)
        assert added == pytest.approx(1e-3 * delta, rel=1e-6)
        # and the library's own overflow term agrees
        from d3p import _sampling
        assert _sampling.overflow_delta(num_records, q, num_records, steps, eps) <= 1.001e-3 * delta
    assert _run_plan.automatic_q(num_records, sampling, steps, delta, epsilon) == q   # deterministic


def test_run_with_the_noise_given_and_no_batch_size_takes_the_whole_data(svi, capsys):
    """As numpyro.infer.SVI.run: all N records at every step (fixed-size batches of N, substitute)."""
    result = svi.run(d3p.random.PRNGKey(0), T, XS, target_delta=1e-4)
    err = capsys.readouterr().err
    assert "no batch_size or q given: fixed-size batches of size 40 (q = 1) from 40 records" in err
    assert (result.q, result.sampler, result.relation) == (1.0, "fixed_size", "substitute")
    # every record in every step: T Gaussian mechanisms of sensitivity 2C (substitute) and noise σC
    # compose to one of mu = 2 sqrt(T) / σ, whose δ(ε) has a closed form (Dong, Roth & Su 2019)
    mu = 2.0 * math.sqrt(T) / 2.0
    delta_of = lambda eps: (scipy.stats.norm.cdf(-eps / mu + mu / 2)   # noqa: E731
                            - math.exp(eps) * scipy.stats.norm.cdf(-eps / mu - mu / 2))
    exact = scipy.optimize.brentq(lambda eps: delta_of(eps) - 1e-4, 1e-6, 100.0)
    assert exact <= result.epsilon <= exact * 1.01
    # the same as asking for it explicitly, bit for bit
    explicit = svi.run(d3p.random.PRNGKey(0), T, XS, batch_size=N, sampling="fixed", target_delta=1e-4,
                       progress_bar=False)
    np.testing.assert_array_equal(result.params["auto_loc"], explicit.params["auto_loc"])


@pytest.mark.parametrize("kwargs", [dict(sampling="poisson"), dict(relation="add_remove")])
def test_run_without_a_batch_size_says_and_accounts_what_it_chose(svi, capsys, kwargs):
    result = svi.run(d3p.random.PRNGKey(0), T, XS, target_delta=1e-4, **kwargs)
    q = _run_plan.automatic_q(N, "poisson", T, 1e-4)
    err = capsys.readouterr().err
    assert f"(q = {q:.4g}) from {N} records" in err and "no batch_size or q given" in err
    assert result.q == pytest.approx(q)
    assert (result.sampler, result.relation) == ("poisson", "add_remove")
    expected = accounting.compute_epsilon(2.0, q, T, 1e-4, sampler="poisson")
    assert result.epsilon == pytest.approx(expected, rel=1e-9)
    # the same as asking for that q explicitly, bit for bit
    explicit = svi.run(d3p.random.PRNGKey(0), T, XS, q=q, target_delta=1e-4, progress_bar=False)
    np.testing.assert_array_equal(result.params["auto_loc"], explicit.params["auto_loc"])


def test_fixed_size_without_a_batch_size_takes_the_whole_data(svi):
    result = svi.run(d3p.random.PRNGKey(0), 2, XS, sampling="fixed", target_delta=1e-4, progress_bar=False)
    assert result.q == 1.0 and result.sampler == "fixed_size"


def test_batch_size_and_q_together_are_refused(svi):
    with pytest.raises(ValueError, match="at most one of batch_size and q"):
        svi.run(d3p.random.PRNGKey(0), 2, XS, batch_size=8, q=0.2, progress_bar=False)


def _unconstrained(svi, state):
    return svi.optim.get_params(state.optim_state)


@pytest.mark.slow
def test_average_is_the_mean_of_the_last_steps_parameters(svi):
    """average=0.5 over 8 steps: the mean of the parameters after steps 5..8,
    computed here from the same run continued one step at a time."""
    key = d3p.random.PRNGKey(1)
    run = lambda steps, **kw: svi.run(key, steps, XS, batch_size=8, target_delta=1e-4,  # noqa: E731
                                      progress_bar=False, **kw)
    averaged = run(T, average=0.5)
    plain = run(T)
    assert averaged.averaged_steps == 4 and plain.averaged_steps == 0
    # the state, the losses and the privacy are the run's without averaging
    for a, b in zip(jax.tree.leaves(averaged.state), jax.tree.leaves(plain.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert (averaged.epsilon, averaged.delta, averaged.sigma) == (plain.epsilon, plain.delta, plain.sigma)
    state, iterates = run(4).state, []
    for step in range(4, T):
        state = run(1, init_state=state, start_step=step).state
        iterates.append(_unconstrained(svi, state))
    mean = jax.tree.map(lambda *xs: np.mean(np.stack(xs), axis=0), *iterates)
    expected = svi.constrain_fn(mean)
    for name in expected:
        np.testing.assert_allclose(averaged.params[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert not np.allclose(averaged.params["auto_loc"], plain.params["auto_loc"])


def test_average_with_the_progress_bar_is_the_same(svi):
    key = d3p.random.PRNGKey(2)
    a = svi.run(key, T, XS, batch_size=8, target_delta=1e-4, progress_bar=True, average=0.3)
    b = svi.run(key, T, XS, batch_size=8, target_delta=1e-4, progress_bar=False, average=0.3)
    assert a.averaged_steps == b.averaged_steps == math.ceil(0.3 * T)
    np.testing.assert_array_equal(a.params["auto_loc"], b.params["auto_loc"])


@pytest.mark.parametrize("value", [1.0, -0.1, "half", True])
def test_average_is_validated(svi, value):
    with pytest.raises(ValueError, match="average"):
        svi.run(d3p.random.PRNGKey(0), 2, XS, batch_size=8, progress_bar=False, average=value)


# ------------------------------------------- C chosen when it is not given


@pytest.mark.slow
def test_without_a_clipping_threshold_c_is_chosen_by_adaptive_clipping_and_run_says_so(caplog):
    import logging

    from d3p.svi import AdaptiveClipping

    xs = np.linspace(-1.0, 3.0, N).astype(np.float32)
    chosen = normal_mean_svi(N=N)   # neither C nor σ: run(epsilon=...) chooses both
    assert chosen.clipping_chosen and chosen.clipping_threshold == 1.0
    assert chosen.adaptive_clipping == AdaptiveClipping(None, None, None, 1e-3, 1e3)   # γ and η from the noise
    explicit = normal_mean_svi(clipping_threshold=1.0, N=N,
                               adaptive_clipping=AdaptiveClipping(target_quantile=None, learning_rate=None))
    assert not explicit.clipping_chosen
    with caplog.at_level(logging.INFO, logger="d3p"):
        got = chosen.run(d3p.random.PRNGKey(4), 20, xs, batch_size=20, epsilon=2.0, delta=1e-5,
                         progress_bar=False)
    said = [r.getMessage() for r in caplog.records if "clipping_threshold" in r.getMessage()]
    assert len(said) == 1 and "from C = 1" in said[0] and "noise" in said[0]
    # σ sqrt(P) / B_e of the gradient's noise multiplier (σ_eff / sqrt(0.9): the count takes a tenth of the
    # step's precision), P = 2 (the normal mean's loc and scale)
    rho = got.sigma / math.sqrt(0.9) * math.sqrt(2) / 20
    gamma = float(np.interp(np.log(rho), [np.log(0.1), np.log(0.25)], [0.98, 0.9]))
    assert f"the {gamma:.3g} quantile" in said[0] and f"= {rho:.3g};" in said[0], said[0]
    # exactly the documented adaptive clipping, whose privacy is tested on its own (test_adaptive_clipping.py)
    want = explicit.run(d3p.random.PRNGKey(4), 20, xs, batch_size=20, epsilon=2.0, delta=1e-5,
                        progress_bar=False)
    assert (got.sigma, got.epsilon) == (want.sigma, want.epsilon) and got.epsilon <= 2.0
    for a, b in zip(jax.tree.leaves((got.params, got.state)), jax.tree.leaves((want.params, want.state))):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert float(got.state.clipping_threshold) != 1.0   # it moved
    # a user's adaptive clipping without C starts at the same first C
    own = normal_mean_svi(adaptive_clipping=AdaptiveClipping(target_quantile=0.5), N=N)
    assert own.clipping_chosen and own.adaptive_clipping.target_quantile == 0.5 and own.clipping_threshold == 1.0


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(dp_scale=1.0), TypeError, "got none with dp_scale given"),
    (dict(adaptive_clipping=False), TypeError, "adaptive_clipping=False"),
    (dict(noise="discrete"), ValueError, "noise='gaussian' with adaptive_clipping"),
])
def test_without_a_clipping_threshold_what_cannot_choose_c_is_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        normal_mean_svi(N=N, **kwargs)


# ------------------------------- the optimizer, its averaging and the number of steps chosen


def _said(caplog, text):
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


@pytest.mark.slow
def test_without_an_optimizer_adam_at_the_chosen_step_size_and_averaging(caplog):
    """``DPSVI(model, guide, loss=...)``: numpyro's Adam at the documented step
    size, held for the first half of a run's steps and decayed along a cosine
    to 2 % of itself at its last, and run averages the last quarter of its
    steps; the run with that schedule and averaging given, and said once."""
    import logging

    import numpyro
    from numpyro.infer import Trace_ELBO
    from numpyro.infer.autoguide import AutoDiagonalNormal

    from d3p.svi import DPSVI

    from _normal_mean import model

    chosen = DPSVI(model, AutoDiagonalNormal(model), loss=Trace_ELBO(), clipping_threshold=1.0, dp_scale=2.0, N=N)
    assert chosen.optim_chosen and _run_plan.CHOSEN_STEP_SIZE == 0.05 and _run_plan.CHOSEN_AVERAGE == 0.25
    assert (_run_plan.CHOSEN_HOLD, _run_plan.CHOSEN_FINAL) == (0.5, 0.02)

    def schedule(i):   # written out: 0.05 for steps 0..T/2, then 0.05 (0.02 + 0.98 (1 + cos(pi t)) / 2)
        t = jnp.clip((i - 0.5 * T) / (0.5 * T), 0.0, 1.0)
        return 0.05 * (0.02 + 0.98 * 0.5 * (1 + jnp.cos(jnp.pi * t)))

    explicit = DPSVI(model, AutoDiagonalNormal(model), numpyro.optim.Adam(schedule), Trace_ELBO(),
                     clipping_threshold=1.0, dp_scale=2.0, N=N)
    assert not explicit.optim_chosen
    key = d3p.random.PRNGKey(3)
    with caplog.at_level(logging.INFO, logger="d3p"):
        got = chosen.run(key, T, XS, batch_size=8, target_delta=1e-4, progress_bar=False)
    said = _said(caplog, "no optimizer given")
    assert len(said) == 1 and "step size 0.05 " in said[0] and "25%" in said[0] and "decayed" in said[0]
    assert got.averaged_steps == T // 4
    want = explicit.run(key, T, XS, batch_size=8, target_delta=1e-4, progress_bar=False, average=0.25)
    for a, b in zip(jax.tree.leaves((got.params, got.state)), jax.tree.leaves((want.params, want.state))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    # not the constant step: the decay changes the run
    constant = normal_mean_svi(clipping_threshold=1.0, dp_scale=2.0, N=N).run(   # Adam(0.05)
        key, T, XS, batch_size=8, target_delta=1e-4, progress_bar=False, average=0.25)
    assert not np.allclose(np.asarray(got.params["auto_loc"]), np.asarray(constant.params["auto_loc"]))
    # a user's optimizer: no averaging unless asked for (the step size is theirs), and nothing said
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="d3p"):
        own = explicit.run(key, T, XS, batch_size=8, target_delta=1e-4, progress_bar=False)
    assert own.averaged_steps == 0 and not _said(caplog, "no optimizer given")
    # the chosen averaging can be overridden
    assert chosen.run(key, T, XS, batch_size=8, target_delta=1e-4, progress_bar=False,
                      average=0.0).averaged_steps == 0


def test_the_chosen_step_size_decays_over_the_run_by_the_documented_schedule():
    """:meth:`ChosenStepSize.__call__` inside a run of ``T`` steps: the step
    size for ``i <= T/2``, then ``0.02 + 0.98 (1 + cos(pi t)) / 2`` times it,
    ``t = (i - T/2) / (T/2)``; constant outside a run (``update``)."""
    step_size = _run_plan.ChosenStepSize()
    step_size.fit({"a": jnp.zeros(2)})
    assert step_size(1234) == 0.05   # no run: constant
    step_size.run_steps = jnp.float32(2000)
    by_hand = {0: 0.05, 1000: 0.05, 1500: 0.05 * (0.02 + 0.98 * 0.5), 2000: 0.05 * 0.02, 5000: 0.05 * 0.02,
               1250: 0.05 * (0.02 + 0.98 * 0.5 * (1 + math.cos(math.pi / 4)))}
    for i, want in by_hand.items():
        assert float(step_size(jnp.int32(i))) == pytest.approx(want, rel=1e-6), i


def test_without_num_steps_run_takes_the_chosen_number_and_says_so(svi, caplog):
    import logging

    key = d3p.random.PRNGKey(5)
    with caplog.at_level(logging.INFO, logger="d3p"):
        got = svi.run(key, None, XS, batch_size=8, target_delta=1e-4, progress_bar=False)
    said = _said(caplog, "no num_steps given")
    assert _run_plan.CHOSEN_NUM_STEPS == 2000 and len(said) == 1 and "2,000 steps" in said[0]
    assert got.num_steps == 2000 and len(got.losses) == 2000
    want = svi.run(key, 2000, XS, batch_size=8, target_delta=1e-4, progress_bar=False)
    assert got.epsilon == want.epsilon
    np.testing.assert_array_equal(got.params["auto_loc"], want.params["auto_loc"])


@pytest.mark.parametrize("value", [0, 2.5, "100", True])
def test_num_steps_is_validated(svi, value):
    with pytest.raises((ValueError, TypeError), match="num_steps"):
        svi.run(d3p.random.PRNGKey(0), value, XS, batch_size=8, progress_bar=False)


def test_the_chosen_step_size_is_bounded_by_the_number_of_parameters():
    """``min(0.05, 0.4 / sqrt(P))``: 0.05 up to 64 parameters, then smaller (a
    network's 10,000: 0.004); only shapes are read; refused before it is known."""
    step_size = _run_plan.ChosenStepSize()
    with pytest.raises(RuntimeError, match="parameters' shapes"):
        step_size(0)
    assert step_size.fit({"a": jnp.zeros(31), "b": jnp.zeros(31)}) == 0.05 == step_size(7)
    assert step_size.fit({"w": jax.ShapeDtypeStruct((100, 100), jnp.float32)}) == pytest.approx(0.004)
    assert step_size.fit({"w": jnp.zeros((64, 2))}) == pytest.approx(0.4 / math.sqrt(128))


@pytest.mark.parametrize("rho, step_size, expected", [
    (0.0, 0.05, 2000), (0.3, 0.05, 2000),     # at most STEPS_NOISE_RATIO: the 2,000 steps
    (0.31, 0.05, 1870),                        # 2000 (0.3 / 0.31)^2 = 1873.0, down to a multiple of 10
    (0.45, 0.05, 880),                         # 888.9
    (0.6, 0.05, 500), (3.0, 0.05, 500),        # 500 and 20: never below 25 / 0.05 = 500 steps
    (3.0, 0.025, 1000),                        # 25 / 0.025
    (3.0, 0.006, 2000),                        # 25 / 0.006 = 4167: a network keeps its 2,000
])
def test_the_steps_chosen_from_the_noise_follow_the_documented_rule(rho, step_size, expected):
    assert (_run_plan.STEPS_NOISE_RATIO, _run_plan.STEPS_TRAVEL) == (0.3, 25.0)
    assert _run_plan.steps_for_the_noise(rho, step_size) == expected


@pytest.mark.slow
def test_asking_for_epsilon_with_nothing_else_takes_fewer_steps_where_the_noise_is_large(caplog):
    """``run(key, None, ..., epsilon=...)`` with d3p's optimizer: the noise
    ratio of σ calibrated for 2,000 steps decides the number of steps (public
    facts: σ, P, B_e); the run is then exactly the run of that many steps,
    accounted for them, and says why. With a number of steps or an optimizer
    given, nothing changes."""
    import logging

    import numpyro
    from numpyro.infer import Trace_ELBO
    from numpyro.infer.autoguide import AutoDiagonalNormal

    from d3p.dputil import approximate_sigma_remove_relation
    from d3p.svi import DPSVI

    from _normal_mean import model

    xs = np.linspace(-1.0, 3.0, N).astype(np.float32)
    chosen = DPSVI(model, AutoDiagonalNormal(model), loss=Trace_ELBO(), N=N)   # C, optimizer and steps chosen
    key = d3p.random.PRNGKey(6)
    with caplog.at_level(logging.INFO, logger="d3p"):
        got = chosen.run(key, None, xs, epsilon=1.0, progress_bar=False)
    said = _said(caplog, "no num_steps given")
    # σ for 2,000 steps at this q (about: δ less the overflow term), the gradient's share (the count takes a
    # tenth of the precision); P = 2 (the normal mean's loc and scale)
    q = _run_plan.automatic_q(N, "poisson", 2000, 1.0 / N**2, 1.0)
    sigma_2000 = approximate_sigma_remove_relation(1.0, 1.0 / N**2, q, 2000)[0]
    rho = sigma_2000 / math.sqrt(0.9) * math.sqrt(2) / (q * N)
    assert rho > 3   # so few records: 500 steps, the fewest at the step size 0.05
    assert len(said) == 1 and "500 steps, not 2,000" in said[0], said
    assert float(said[0].split(" times the largest")[0].split()[-1]) == pytest.approx(rho, rel=0.01)
    assert got.num_steps == 500 and len(got.losses) == 500 and got.epsilon <= 1.0
    want = chosen.run(key, 500, xs, epsilon=1.0, progress_bar=False)   # the same run, 500 steps given
    assert (got.sigma, got.epsilon, got.q) == (want.sigma, want.epsilon, want.q)
    for a, b in zip(jax.tree.leaves((got.params, got.state)), jax.tree.leaves((want.params, want.state))):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    # a user's optimizer: the 2,000 steps (its step size is not known)
    own = DPSVI(model, AutoDiagonalNormal(model), numpyro.optim.Adam(0.05), Trace_ELBO(), N=N)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="d3p"):
        assert own.run(key, None, xs, epsilon=1.0, progress_bar=False).num_steps == 2000
    assert "2,000 steps" in _said(caplog, "no num_steps given")[0]
