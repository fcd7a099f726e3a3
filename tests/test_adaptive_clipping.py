# SPDX-License-Identifier: Apache-2.0
"""Adaptive clipping (d3p.svi.AdaptiveClipping): the count release's
sensitivity on hand-built neighbouring batches, the noise of the count and of
the gradient at the state's C, the accounting at σ_eff against dp-accounting
called directly, calibration, the update rule, the scan carry and checkpoints."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from dp_accounting import NeighboringRelation, dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant
from numpyro.infer import Trace_ELBO
from scipy import stats

import d3p.random
from d3p import _adaptive
from d3p.gradients import clipped_grad_sum
from d3p.ledger import PrivacyLedger
from d3p.svi import DPSVI, AdaptiveClipping, DPSVIState, load_checkpoint, save_checkpoint

D = 4   # features per record


def model(xs, N):
    """``w`` a param of the model, no latent: at ``w = 0`` record i's loss,
    divided by its observation scale, has gradient ``-x_i`` (norm ``‖x_i‖``)."""
    w = numpyro.param("w", jnp.zeros(xs.shape[1]))
    with numpyro.plate("data", N, subsample_size=xs.shape[0]):
        numpyro.sample("x", dist.Normal(w, 1.0).to_event(1), obs=xs)


def guide(xs, N):
    pass


def _svi(optim=None, *, dp_scale=0.0, C=1.0, N=8, **settings):
    return DPSVI(model, guide, optim or numpyro.optim.SGD(0.0), Trace_ELBO(), clipping_threshold=C,
                 dp_scale=dp_scale, N=N, rng_suite=d3p.random.debug,
                 adaptive_clipping=AdaptiveClipping(**settings))


def _rows(norms):
    """Records whose gradient norm (at ``w = 0``) is each of ``norms``; a NaN
    norm gives a record holding NaN."""
    xs = np.zeros((len(norms), D), np.float32)
    xs[:, 0] = norms
    return jnp.asarray(xs)


# ------------------------------------------------------------ the count's sensitivity

C_COUNT = 1.0
ADVERSARIAL = [0.5, 1.5, 0.0, np.nan, np.inf, -np.inf, 1e30, -1e30]


@jax.jit
def _count_of(xs, mask):
    result = clipped_grad_sum(lambda w, x: jnp.dot(x, w), jnp.zeros(D), xs, mask, C_COUNT)
    return _adaptive.centred_count(result.norms, mask, C_COUNT)


def _count(values, mask):
    """The pre-noise count of the step on records with gradient rows
    ``values`` in every coordinate (the loss ``x · w`` has gradient ``x``,
    norm ``2 |value|``), through the real clipped sum's norms."""
    xs = np.asarray(values, np.float32).reshape(len(values), 1) * np.ones((1, D), np.float32)
    return float(_count_of(jnp.asarray(xs), jnp.asarray(mask)))


def test_count_is_the_centred_count_of_the_real_records():
    values = [0.1, 0.2, 0.9, 3.0, np.nan, 0.1]       # norms 2 x value; the last slot padded
    mask = [True, True, True, True, True, False]
    # below C: 0.2, 0.4 (0.9 x 2 = 1.8 and 6 are above, NaN counts as above): 2 - 5/2
    assert _count(values, mask) == -0.5


@pytest.mark.parametrize("relation", ["add_remove", "substitute"])
def test_count_sensitivity_on_neighbouring_batches(relation):
    """Every slot of a batch replaced by every adversarial record (substitute),
    or masked out, added into a padded slot, or deleted with its row
    (add/remove): the pre-noise count moves by at most 1/2 (1 substituted),
    and the bound is attained. A count of b_i without centring (sensitivity
    1), or one that counted padded slots or NaN rows as real, fails."""
    base = [0.1, 0.3, 0.45, 2.0, np.nan, 1e30, 0.0, 0.0]    # norms 2x; the last two slots padded
    mask = [True] * 6 + [False] * 2
    reference = _count(base, mask)
    changes = []
    for i in range(len(base)):
        for v in ADVERSARIAL:
            values = list(base)
            values[i] = v
            if relation == "substitute":
                if mask[i]:
                    changes.append(_count(values, mask) - reference)
            elif not mask[i]:          # add a record into a padded slot
                changes.append(_count(values, [*mask[:i], True, *mask[i + 1:]]) - reference)
        if relation == "add_remove" and mask[i]:
            changes.append(_count(base, [*mask[:i], False, *mask[i + 1:]]) - reference)     # masked out
            changes.append(_count(base[:i] + base[i + 1:], mask[:i] + mask[i + 1:]) - reference)   # deleted
    bound = 0.5 if relation == "add_remove" else 1.0
    assert max(abs(c) for c in changes) == bound, changes


# ------------------------------------------------------------ the noise of one step

def _ks(samples, scale):
    return stats.kstest(samples, stats.norm(0.0, scale).cdf).pvalue


@pytest.mark.float32
def test_step_noise_of_count_and_gradient():
    """One adaptive step on an all-padded batch, for 2000 keys: the parameters
    move by pure gradient noise of std ``dp_scale * C_t`` (the STATE's C_t =
    3, not the initial 1) and the released count carries noise of std
    ``count_noise``; each is accepted at its scale and rejected at 2/3 and
    3/2 of it (2000 draws of the count: the KS distance between N(0, 1) and
    N(0, 1.5²) is 0.097, so a wrong scale has p about 1e-16)."""
    sigma, count_noise, C_t, B = 0.7, 2.0, 3.0, 8
    svi = _svi(numpyro.optim.SGD(1.0), dp_scale=sigma, count_noise=count_noise)
    xs = _rows([1.0] * B)
    state = svi.init(d3p.random.debug.PRNGKey(0), xs)
    state = state._replace(clipping_threshold=jnp.asarray(C_t, jnp.float32))
    mask = jnp.zeros(B, bool)
    keys = jax.random.split(jax.random.PRNGKey(1), 2000)

    def step(key):
        new, _ = svi.update(state._replace(rng_key=key), xs, mask=mask, expected_batch_size=B)
        return svi.optim.get_params(new.optim_state)["w"], new.clipping_threshold

    w, C1 = jax.jit(jax.vmap(step))(keys)
    # N / B = 1: the parameters moved by minus the noise
    grad_noise = -np.asarray(w).ravel()
    # C_1 = C_t exp(-η (count / B + 1/2 - γ)), count = 0 + noise
    count = ((0.5 - np.log(np.asarray(C1, np.float64) / C_t) / 0.2) - 0.5) * B
    for samples, scale in [(grad_noise, sigma * C_t), (count, count_noise)]:
        assert _ks(samples, scale) > 1e-3
        assert _ks(samples, scale * 2 / 3) < 1e-6
        assert _ks(samples, scale * 3 / 2) < 1e-6


# ------------------------------------------------------------ the update rule

def test_update_rule_by_hand():
    """No noise: ``C_1 = C_0 exp(-η (b̃ - γ))`` with ``b̃ = count / B_e + 1/2``;
    a NaN record counts as above C, a padded slot not at all; the next step
    is clamped to ``max_threshold``."""
    svi = _svi(C=1.0, count_noise=0.0, learning_rate=0.3, target_quantile=0.6, max_threshold=1.1)
    xs = _rows([0.5, 0.25, 2.0, 3.0, np.nan, 0.1])
    mask = jnp.asarray([True] * 5 + [False])
    state = svi.init(d3p.random.debug.PRNGKey(0), xs)
    assert float(state.clipping_threshold) == 1.0
    step = jax.jit(lambda s: svi.update(s, xs, mask=mask, expected_batch_size=5.0)[0])
    state = step(state)
    fraction = (2 - 5 / 2) / 5 + 0.5
    assert float(state.clipping_threshold) == pytest.approx(math.exp(-0.3 * (fraction - 0.6)), rel=1e-6)
    assert float(step(state).clipping_threshold) == pytest.approx(1.1, rel=1e-7)   # 1.06² = 1.13 > 1.1


def _quantile_by_hand(rho):
    # the documented rule: 0.98 up to a noise ratio of 0.1, 0.9 from 0.25, linear in log(ratio) between
    return float(np.interp(np.log(rho), [np.log(0.1), np.log(0.25)], [0.98, 0.9]))


@pytest.mark.parametrize("sigma", [0.05, 0.2, 0.3, 0.5, 2.0])
def test_the_quantile_chosen_from_the_noise_by_hand(sigma):
    settings = AdaptiveClipping(target_quantile=None, learning_rate=None)
    P, B = 4, 5.0
    rho = sigma * math.sqrt(P) / B
    assert _adaptive.noise_ratio(sigma, P, B) == pytest.approx(rho, rel=1e-12)
    want = _quantile_by_hand(rho)
    assert _adaptive.target_quantile(settings, sigma, P, B) == pytest.approx(want, abs=1e-12)
    traced = jax.jit(lambda s: _adaptive.target_quantile(settings, s, P, B))(jnp.float32(sigma))
    assert float(traced) == pytest.approx(want, abs=1e-6)
    # a user's quantile is theirs, whatever the noise
    assert _adaptive.target_quantile(settings._replace(target_quantile=0.7), sigma, P, B) == 0.7


@pytest.mark.parametrize("sigma", [0.2, 0.5, 1.0])
def test_update_follows_the_quantile_chosen_from_the_noise(sigma):
    """``target_quantile=None``: one step moves C by ``exp(-η (b̃ - γ))`` with
    ``γ`` from ``ρ = σ sqrt(P) / B_e`` (P = 4 parameters, B_e = 5): 0.98,
    about 0.92 and 0.9 here."""
    svi = _svi(C=1.0, dp_scale=sigma, count_noise=0.0, learning_rate=0.3, target_quantile=None)
    xs = _rows([0.5, 0.25, 2.0, 3.0, 0.1])
    state = svi.init(d3p.random.debug.PRNGKey(0), xs)
    state = jax.jit(lambda s: svi.update(s, xs, expected_batch_size=5.0)[0])(state)
    fraction = (3 - 5 / 2) / 5 + 0.5
    gamma = _quantile_by_hand(sigma * 2 / 5.0)
    assert float(state.clipping_threshold) == pytest.approx(math.exp(-0.3 * (fraction - gamma)), rel=1e-6)


def _toy_run(svi, xs, num_steps):
    state = svi.init(d3p.random.debug.PRNGKey(0), xs)

    def body(state, _):
        state, loss = svi.update(state, xs)
        return state, state.clipping_threshold

    return state, jax.lax.scan(body, state, None, length=num_steps)


def test_threshold_moves_to_the_target_quantile_in_a_stable_scan_carry():
    """Fixed parameters, norms 1..10, no noise: C climbs from 0.5 by
    factors of at most e^(η/2) per step and settles in [5, 6), where exactly
    half the norms are at most C; the state keeps its structure and dtypes
    as a ``lax.scan`` carry."""
    svi = _svi(C=0.5, count_noise=0.0)
    xs = _rows(np.arange(1.0, 11.0))
    state, (final, path) = _toy_run(svi, xs, 60)
    assert jax.tree.structure(final) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(final), jax.tree.leaves(state)):
        assert a.shape == b.shape and a.dtype == b.dtype
    path = np.asarray(path)
    assert np.all(np.diff(path) >= 0) and np.all(np.diff(np.log(path)) <= 0.2 * 0.5 + 1e-6)
    assert 5.0 <= path[-1] < 6.0 and path[-20] == path[-1]


# ------------------------------------------------------------ accounting

def test_effective_sigma_is_the_rdp_of_both_releases_on_one_batch():
    """dp-accounting's RDP accountant, given the gradient (multiplier σ) and the
    count (sensitivity 1/2, noise σ_b: multiplier 2 σ_b) as two Gaussians on the
    same Poisson batch, agrees with one Gaussian at σ_eff."""
    sigma, count_noise, q, steps = 1.3, 1.1, 0.05, 300
    both = rdp_privacy_accountant.RdpAccountant()
    both.compose(dp_event.PoissonSampledDpEvent(q, dp_event.ComposedDpEvent(
        [dp_event.GaussianDpEvent(sigma), dp_event.GaussianDpEvent(2 * count_noise)])), steps)
    one = rdp_privacy_accountant.RdpAccountant()
    sigma_eff = (sigma**-2 + (2 * count_noise) ** -2) ** -0.5
    one.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma_eff)), steps)
    assert _adaptive.effective_sigma(sigma, count_noise) == pytest.approx(sigma_eff, rel=1e-12)
    assert both.get_epsilon(1e-5) == pytest.approx(one.get_epsilon(1e-5), rel=1e-9)
    assert _adaptive.gradient_sigma(sigma_eff, count_noise) == pytest.approx(sigma, rel=1e-9)
    assert _adaptive.effective_sigma(_adaptive.gradient_sigma(sigma_eff, count_noise), count_noise) >= sigma_eff


def _reference(sigma, q, steps, delta, sampler):
    """dp-accounting's PLD accountant with the dominating pair of ``sampler``
    (fixed size: the add/remove pair at σ/2, see the accounting guide)."""
    acc = pld_privacy_accountant.PLDAccountant(NeighboringRelation.ADD_OR_REMOVE_ONE,
                                               value_discretization_interval=1e-3)
    scale = sigma / 2 if sampler == "fixed_size" else sigma
    acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(scale)), steps)
    return acc.get_epsilon(delta)


N_RUN = 100
XS_RUN = _rows(np.linspace(0.1, 3.0, N_RUN))
SIGMA, COUNT_NOISE = 1.2, 1.5
SIGMA_EFF = (SIGMA**-2 + (2 * COUNT_NOISE) ** -2) ** -0.5   # computed here, not by d3p


@pytest.mark.parametrize("sampler", ["poisson", "fixed_size"])
def test_get_epsilon_is_accounted_at_sigma_eff(sampler):
    """get_epsilon against dp-accounting's PLD at σ_eff; accounting at the
    gradient's σ alone (a smaller ε) fails."""
    svi = _svi(dp_scale=SIGMA, N=N_RUN, count_noise=COUNT_NOISE)
    eps = svi.get_epsilon(1e-5, 0.1, num_iter=10, sampler=sampler)
    eps_ref = _reference(SIGMA_EFF, 0.1, 10, 1e-5, sampler)
    assert eps_ref * (1 - 1e-3) <= eps <= eps_ref * (1 + 1e-2)


@pytest.fixture(scope="module")
def run_svi():
    return _svi(numpyro.optim.Adam(0.05), dp_scale=SIGMA, C=1.0, N=N_RUN, count_noise=COUNT_NOISE)


@pytest.mark.slow    # test_calibration_round_trips checks a run and its ledger at σ_eff in the default step
@pytest.mark.parametrize("sampling, sampler", [("poisson", "poisson"), ("fixed", "fixed_size")])
def test_run_and_ledger_are_accounted_at_sigma_eff(run_svi, sampling, sampler):
    """ε of a run (its result and its ledger entry) against dp-accounting's
    PLD at σ_eff; a run accounted at the gradient's σ alone fails."""
    steps, delta = 10, 1e-5
    ledger = PrivacyLedger(relation="substitute" if sampler == "fixed_size" else "add_remove")
    result = run_svi.run(d3p.random.debug.PRNGKey(2), steps, XS_RUN, q=0.1, sampling=sampling,
                         target_delta=delta, ledger=ledger)
    assert result.sigma == pytest.approx(SIGMA_EFF, rel=1e-12)
    assert ledger.releases[0].sigma == result.sigma
    eps_ref = _reference(SIGMA_EFF, 0.1, steps, delta, sampler)
    assert eps_ref * (1 - 1e-3) <= result.epsilon <= eps_ref * (1 + 1e-2)
    assert float(result.state.clipping_threshold) != 1.0    # C moved and is carried in the state


P_FLAT = 2000


def flat_model(xs, N):
    """A likelihood that does not depend on ``w``: every record's gradient is
    exactly 0, so ``w`` moves by the noise alone."""
    w = numpyro.param("w", jnp.zeros(P_FLAT))
    with numpyro.plate("data", N, subsample_size=xs.shape[0]):
        numpyro.sample("x", dist.Normal(0.0 * jnp.sum(w), 1.0), obs=xs[:, 0])


@pytest.mark.float32
def test_calibration_round_trips():
    """run(epsilon=...) calibrates σ_eff: its ε by dp-accounting, computed
    here, is the target and 1% less noise would pass it, and the ledger holds
    it; the gradient's noise is the rest, ``σ = (σ_eff^-2 - (2 σ_b)^-2)^-1/2``
    (here 1.9 σ_eff): with C held at 1 by its bounds, ``w`` after T steps of
    SGD(1) is ``-sqrt(T) σ C / q`` times a standard normal in each of 2000
    coordinates, accepted at that scale and rejected at σ_eff's. A count
    noise too small for the target is refused, naming count_noise."""
    steps, delta, q, target, count_noise = 10, 1e-5, 0.1, 2.0, 0.7
    settings = AdaptiveClipping(count_noise=count_noise, min_threshold=1.0, max_threshold=1.0)
    svi = DPSVI(flat_model, guide, numpyro.optim.SGD(1.0), Trace_ELBO(), clipping_threshold=1.0, N=N_RUN,
                rng_suite=d3p.random.debug, adaptive_clipping=settings)
    ledger = PrivacyLedger()
    result = svi.run(d3p.random.debug.PRNGKey(0), steps, XS_RUN, q=q, epsilon=target, delta=delta,
                     ledger=ledger)
    assert result.epsilon <= target and ledger.releases[0].sigma == result.sigma
    assert _reference(result.sigma, q, steps, delta, "poisson") <= target * (1 + 1e-3)
    assert _reference(result.sigma * 0.99, q, steps, delta, "poisson") > target
    sigma_grad = (result.sigma**-2 - (2 * count_noise) ** -2) ** -0.5
    assert sigma_grad > 1.8 * result.sigma
    w = -np.asarray(result.params["w"]) / (math.sqrt(steps) / q)
    assert _ks(w, sigma_grad) > 1e-3
    assert _ks(w, result.sigma) < 1e-6
    small = DPSVI(flat_model, guide, numpyro.optim.SGD(1.0), Trace_ELBO(), clipping_threshold=1.0, N=N_RUN,
                  adaptive_clipping=AdaptiveClipping(count_noise=0.3))
    with pytest.raises(ValueError, match="count_noise"):
        small.run(d3p.random.PRNGKey(0), steps, XS_RUN, q=q, epsilon=target, delta=delta)


def test_checkpoint_keeps_the_threshold(tmp_path):
    svi = _svi(C=1.0, count_noise=0.0)
    xs = _rows([0.5, 2.0, 3.0])
    state = svi.init(d3p.random.debug.PRNGKey(0), xs)
    moved = jax.jit(lambda s: svi.update(s, xs)[0])(state)
    assert float(moved.clipping_threshold) != 1.0
    path = tmp_path / "state.npz"
    save_checkpoint(path, moved, step=1)
    loaded = load_checkpoint(path, like=state).state
    assert loaded.clipping_threshold.dtype == moved.clipping_threshold.dtype
    assert float(loaded.clipping_threshold) == float(moved.clipping_threshold)


@pytest.mark.slow    # three runs; test_checkpoint_keeps_the_threshold saves and loads C in the default step
def test_resumed_run_continues_with_the_saved_threshold(run_svi, tmp_path):
    key = d3p.random.debug.PRNGKey(5)
    whole = run_svi.run(key, 6, XS_RUN, q=0.1)
    first = run_svi.run(key, 3, XS_RUN, q=0.1)
    path = tmp_path / "run.npz"
    save_checkpoint(path, first)
    loaded = load_checkpoint(path, like=first.state).state
    assert float(loaded.clipping_threshold) == float(first.state.clipping_threshold)
    second = run_svi.run(key, 3, XS_RUN, q=0.1, init_state=load_checkpoint(path))
    assert float(second.state.clipping_threshold) == float(whole.state.clipping_threshold)
    for a, b in zip(jax.tree.leaves(whole.state), jax.tree.leaves(second.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_refusals_name_the_arguments():
    make = dict(model=model, guide=guide, optim=numpyro.optim.SGD(0.1), per_example_loss=Trace_ELBO(), N=8)
    with pytest.raises(ValueError, match="noise='gaussian'"):
        DPSVI(**make, clipping_threshold=1.0, dp_scale=1.0, noise="discrete", gradient_strategy="scan",
              adaptive_clipping=True)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("records",))
    with pytest.raises(ValueError, match="mesh"):
        DPSVI(**make, clipping_threshold=1.0, dp_scale=1.0, mesh=mesh, adaptive_clipping=True)
    with pytest.raises(ValueError, match="clipping_threshold"):
        DPSVI(**make, clipping_threshold=math.inf, dp_scale=0.0, adaptive_clipping=True)
    with pytest.raises(ValueError, match="max_threshold"):
        DPSVI(**make, clipping_threshold=1.0, dp_scale=1.0, adaptive_clipping=AdaptiveClipping(max_threshold=0.5))
    with pytest.raises(ValueError, match="target_quantile"):
        DPSVI(**make, clipping_threshold=1.0, dp_scale=1.0, adaptive_clipping=AdaptiveClipping(target_quantile=1))
    svi = DPSVI(**make, clipping_threshold=1.0, dp_scale=1.0, adaptive_clipping=True)
    xs = _rows([1.0, 2.0])
    state = svi.init(d3p.random.PRNGKey(0), xs)
    with pytest.raises(ValueError, match="clipping_threshold"):
        jax.jit(lambda s: svi.update(s, xs))(DPSVIState(*state[:4]))
    big = DPSVI(**make, clipping_threshold=1.0, dp_scale=1.0,
                adaptive_clipping=AdaptiveClipping(count_noise=1.0, max_threshold=1e38))
    with pytest.raises(ValueError, match="threshold_bound"):
        jax.jit(lambda s: big.update(s, xs))(big.init(d3p.random.PRNGKey(0), xs))


def test_default_count_noise_is_a_tenth_of_the_budget():
    """Without ``count_noise`` the count takes a tenth of each step's privacy:
    ``(2 σ_b)^-2 = 0.1 σ_eff^-2``, whatever σ; so every σ_eff that fixed
    clipping accepts is accepted (no refusal at large σ or small batches), and
    the accounting at σ_eff matches dp-accounting's RDP of the two releases
    composed (computed here, not by d3p)."""
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant

    settings = AdaptiveClipping()
    for sigma_eff in (0.3, 1.0, 27.0, 400.0):
        sigma = settings.split(sigma_eff)
        count_noise = settings.count_std(sigma)
        assert sigma == pytest.approx(sigma_eff / math.sqrt(0.9), rel=1e-12)
        assert (2 * count_noise) ** -2 == pytest.approx(0.1 * sigma_eff**-2, rel=1e-9)
        assert _adaptive.effective_sigma(sigma, count_noise) >= sigma_eff
    sigma = settings.split(2.0)
    q, steps, delta = 0.05, 200, 1e-6

    def rdp_epsilon(event):
        acc = rdp_privacy_accountant.RdpAccountant()
        acc.compose(dp_event.PoissonSampledDpEvent(q, event), steps)
        return acc.get_epsilon(delta)

    both = rdp_epsilon(dp_event.ComposedDpEvent(
        [dp_event.GaussianDpEvent(sigma), dp_event.GaussianDpEvent(2 * settings.count_std(sigma))]))
    assert both == pytest.approx(rdp_epsilon(dp_event.GaussianDpEvent(2.0)), rel=1e-6)
    # the gradient alone would claim less: the count is accounted
    assert rdp_epsilon(dp_event.GaussianDpEvent(sigma)) < 0.97 * both


def test_default_count_noise_accepts_what_fixed_clipping_accepts():
    """run(epsilon=) with the default count noise calibrates the same σ_eff
    as fixed clipping does for σ alone, at a batch where the paper's default
    ``B / 20`` was refused (2 σ_b = 0.8 below σ_eff here)."""
    data = _rows(np.linspace(0, 1, N_RUN))
    kw = dict(batch_size=8, epsilon=0.3, delta=1e-5, progress_bar=False)
    key = d3p.random.debug.PRNGKey(0)
    adaptive = _svi(dp_scale=None, N=N_RUN).run(key, 20, data, **kw)
    fixed = DPSVI(model, guide, numpyro.optim.SGD(0.0), Trace_ELBO(), clipping_threshold=1.0, dp_scale=None,
                  N=N_RUN, rng_suite=d3p.random.debug).run(key, 20, data, **kw)
    assert adaptive.sigma == pytest.approx(fixed.sigma, rel=1e-9) and adaptive.sigma > 0.8
    assert adaptive.epsilon <= 0.3 and adaptive.epsilon == pytest.approx(fixed.epsilon, rel=1e-6)
    with pytest.raises(ValueError, match="count_noise"):
        _svi(dp_scale=None, N=N_RUN, count_noise=0.4).run(key, 20, data, **kw)


# ------------------------------------ the learning rate from the count's noise (learning_rate=None)


def test_learning_rate_from_the_noise_is_its_closed_form():
    settings = AdaptiveClipping(target_quantile=0.98, learning_rate=None)
    # s = σ_b / B_e = 0.5: η = 2 · 0.25 · 0.02 / 0.25 = 0.04; small noise: the cap 0.2; none: the cap
    assert _adaptive.learning_rate(settings, 50.0, 100.0) == pytest.approx(0.04, rel=1e-12)
    assert _adaptive.learning_rate(settings, 1.0, 100.0) == 0.2
    assert _adaptive.learning_rate(settings, 0.0, 100.0) == 0.2
    for count_noise in (50.0, 1.0, 0.0):   # the same where σ (so σ_b) is traced in run's steps
        traced = _adaptive.learning_rate(settings, jnp.float32(count_noise), 100.0)
        assert float(traced) == pytest.approx(_adaptive.learning_rate(settings, count_noise, 100.0), rel=1e-6)
    assert _adaptive.learning_rate(AdaptiveClipping(learning_rate=0.3), 50.0, 100.0) == 0.3   # given: kept
    assert _adaptive.chosen(None, None).learning_rate is None   # C chosen for the user gets the rule


def _log_excess(settings, s, steps=200_000, seed=0):
    """Mean ``log(C / max norm)`` over the last 90 % of a run of the update
    rule on records whose norms are uniform on (0, 1], the estimated fraction
    ``F(C) + s z`` (the count's noise ``s B_e``, B_e = 100)."""
    settings = settings._replace(min_threshold=1e-3, max_threshold=1e3)
    z = jax.random.normal(jax.random.PRNGKey(seed), (steps,))

    def step(C, z):
        C = _adaptive.next_threshold(C, jnp.minimum(C, 1.0) + s * z, settings, jnp.float32(s * 100.0), 100.0)
        return C, jnp.log(C)

    _, logs = jax.lax.scan(step, jnp.float32(1.0), z)
    return float(jnp.mean(logs[steps // 10:]))


def test_learning_rate_from_the_noise_keeps_c_near_its_quantile():
    """At the 0.98 quantile with a noisy count (s = 0.5), the paper's η = 0.2
    lets C wander far above every norm (at most about η s² / (2 (1 - γ)) =
    1.25 nats; 1.0 measured); the rule keeps it within DRIFT_SCALE = 0.25."""
    rule = _log_excess(AdaptiveClipping(0.98, None), 0.5)
    fixed = _log_excess(AdaptiveClipping(0.98, 0.2), 0.5)
    assert 0.05 < rule < 0.25 and fixed > 0.8, (rule, fixed)
    # with little noise the rule is the paper's rate, and C settles near the 0.98 quantile
    assert abs(_log_excess(AdaptiveClipping(0.98, None), 0.01, steps=20_000)) < 0.05
