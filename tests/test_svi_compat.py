"""Drop-in compatibility of :class:`d3p.svi.DPSVI` with NumPyro's SVI.

What a NumPyro user swaps in must keep working: the ELBOs, optimizers
(NumPyro, ``jax.example_libraries`` and optax), autoguides, ``numpyro.param``
sites in model and guide, several observed sites under one plate, and
``Predictive`` on the fitted parameters. Also: the step is a pure function of
its state (``jit``, ``lax.scan``, determinism), ``run`` really draws a fresh
batch per step with the sampler its ε is computed for, the method signatures
cover SVI's, and the d3p paper's Listing 3 runs.

Input validation and the refusal of unsupported models/optimizers are in
``test_svi_inputs.py``; the privacy math (clipping, noise, scaling, masks) is
tested elsewhere.

All updates run under ``jax.jit``: one compilation per model/optimizer
combination is the dominant cost of this file.
"""

import functools
import inspect
import math
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from jax import lax
from jax.example_libraries import optimizers as jax_optimizers
from numpyro.distributions import constraints
from numpyro.infer import SVI, Predictive, Trace_ELBO, TraceMeanField_ELBO
from numpyro.infer.autoguide import (
    AutoDelta,
    AutoDiagonalNormal,
    AutoLowRankMultivariateNormal,
    AutoNormal,
)

import d3p.random
from d3p import accounting
from d3p.dputil import approximate_sigma
from d3p.minibatch import FixedSizeSampler, PoissonSampler, subsample_batchify_data
from d3p.svi import (
    DPSVI,
    DPSVIRunResult,
    DPSVIState,
    clip_gradient,
    full_norm,
    get_observations_scale,
    normalize_gradient,
)

# ---------------------------------------------------------------------------
# models and data

N = 100
TRUE_MU = 3.0


def normal_model(xs, N):
    """x_i ~ Normal(mu, 1), mu ~ Normal(0, 10)."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("data", N, subsample_size=xs.shape[0]):
        numpyro.sample("x", dist.Normal(mu, 1.0), obs=xs)


TRUE_MU2 = np.array([3.0, -2.0], np.float32)


def normal2_model(xs, N, num_new=None):
    """Two-dimensional x_i ~ Normal(mu, I) (two latent coordinates, for low-rank guides);
    ``xs=None`` samples ``num_new`` new records."""
    mu = numpyro.sample("mu", dist.Normal(jnp.zeros(2), 10.0).to_event(1))
    with numpyro.plate("data", N, subsample_size=num_new if xs is None else xs.shape[0]):
        numpyro.sample("x", dist.Normal(mu, 1.0).to_event(1), obs=xs)


def param_model(xs, N):
    """A ``numpyro.param`` in the model: the observation scale (point estimate)."""
    log_sigma = numpyro.param("log_sigma", jnp.zeros(()))
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("data", N, subsample_size=xs.shape[0]):
        numpyro.sample("x", dist.Normal(mu, jnp.exp(log_sigma)), obs=xs)


def param_guide(xs, N):
    """Hand-written guide with an unconstrained and a positive ``numpyro.param``."""
    loc = numpyro.param("mu_loc", jnp.zeros(()))
    scale = numpyro.param("mu_scale", jnp.ones(()), constraint=constraints.positive)
    numpyro.sample("mu", dist.Normal(loc, scale))


def two_column_model(xs, ys, N):
    """Two observed sites per record under one plate: x_i ~ N(a, 1), y_i ~ N(b, 1)."""
    a = numpyro.sample("a", dist.Normal(0.0, 10.0))
    b = numpyro.sample("b", dist.Normal(0.0, 10.0))
    with numpyro.plate("data", N, subsample_size=xs.shape[0]):
        numpyro.sample("x", dist.Normal(a, 1.0), obs=xs)
        numpyro.sample("y", dist.Normal(b, 1.0), obs=ys)


def _data(seed=0, n=N, sd=1.0):
    return (TRUE_MU + sd * np.random.default_rng(seed).standard_normal(n)).astype(np.float32)


def _data2(seed=0, n=N):
    return (TRUE_MU2 + np.random.default_rng(seed).standard_normal((n, 2))).astype(np.float32)


def _all_finite(tree) -> bool:
    return all(bool(np.all(np.isfinite(np.asarray(x)))) for x in jax.tree.leaves(tree))


def _assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def _trees_equal(a, b) -> bool:
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def _fit(svi, *data, num_steps=200, batch_size=10, seed=0):
    """A short noisy run; checks what every fit must satisfy and returns the result."""
    copies = [np.copy(x) for x in data]
    result = svi.run(d3p.random.PRNGKey(seed), num_steps, *data, batch_size=batch_size, progress_bar=False)
    for x, copy in zip(data, copies):  # the caller's numpy arrays are never modified
        np.testing.assert_array_equal(x, copy)
    assert isinstance(result, DPSVIRunResult)
    assert _all_finite(result.params), result.params
    losses = np.asarray(result.losses)
    assert losses.shape == (num_steps,)
    assert np.all(np.isfinite(losses))
    # the (non-private) training loss goes down
    assert losses[-30:].mean() < losses[:10].mean(), (losses[:10].mean(), losses[-30:].mean())
    return result


# small noise: the fits must land near the posterior mean (posterior std 0.1 here)
SMALL_NOISE = dict(clipping_threshold=5.0, dp_scale=0.3)


SLOW = pytest.mark.slow


def _decay(step_size):
    """A step size decaying 10-fold over 200 steps (a schedule, as numpyro optimizers accept):
    large steps first, then small ones that settle near the optimum despite the noise."""
    return jax_optimizers.exponential_decay(step_size, 200, 0.1)

# ---------------------------------------------------------------------------
# 1. ELBOs, optimizers, autoguides, params, several observed sites, Predictive


def _fit_normal2(guide, elbo):
    """``(xs, params)``: DPSVI with ``guide`` and ``elbo`` fitted to ``_data2()``;
    checks that the parameters have the names and shapes numpyro's SVI gives
    them and that the guide's median of ``mu`` is near the data's mean."""
    svi = DPSVI(normal2_model, guide, numpyro.optim.Adam(_decay(0.2)), elbo, **SMALL_NOISE, N=N)
    xs = _data2()
    params = _fit(svi, xs).params
    plain = SVI(normal2_model, guide, numpyro.optim.Adam(0.05), Trace_ELBO(), N=N)
    plain_params = plain.get_params(plain.init(jax.random.PRNGKey(0), xs[:10]))
    assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, plain_params)
    np.testing.assert_allclose(guide.median(params)["mu"], xs.mean(0), atol=0.3)
    return xs, params


# slow: TraceMeanField_ELBO (one more compilation; the same DPSVI code path as Trace_ELBO)
@pytest.mark.parametrize("elbo", [Trace_ELBO, pytest.param(TraceMeanField_ELBO, marks=SLOW)])
@pytest.mark.float32
@pytest.mark.slow
def test_elbos_autonormal_and_predictive(elbo):
    guide = AutoNormal(normal2_model)
    xs, params = _fit_normal2(guide, elbo())

    # the fitted params work with Predictive exactly as after numpyro SVI: posterior predictive
    predictive = Predictive(normal2_model, guide=guide, params=params, num_samples=500)
    new = predictive(jax.random.PRNGKey(1), None, N=N, num_new=7)
    assert new["x"].shape == (500, 7, 2) and _all_finite(new)
    np.testing.assert_allclose(new["x"].mean((0, 1)), xs.mean(0), atol=0.3)
    np.testing.assert_allclose(new["x"].std((0, 1)), 1.0, atol=0.15)  # posterior sd ~0.1 on top of 1
    # and samples of the latent from the guide alone: Predictive(guide, params=...)
    posterior = Predictive(guide, params=params, num_samples=500)(jax.random.PRNGKey(2), xs, N=N)
    assert posterior["mu"].shape == (500, 2) and _all_finite(posterior)
    np.testing.assert_allclose(posterior["mu"].mean(0), xs.mean(0), atol=0.3)


# one compilation each: the default run fits AutoDelta here, AutoNormal in
# test_elbos_autonormal_and_predictive and AutoDiagonalNormal in test_optimizers
@pytest.mark.parametrize("guide_class", [pytest.param(AutoDiagonalNormal, marks=SLOW),
                                         pytest.param(AutoLowRankMultivariateNormal, marks=SLOW), AutoDelta])
@pytest.mark.float32
@pytest.mark.slow
def test_autoguides(guide_class):
    # AutoNormal: in test_elbos_autonormal_and_predictive
    _fit_normal2(guide_class(normal2_model), Trace_ELBO())


@pytest.mark.parametrize(
    "make_optim",
    [
        pytest.param(lambda: numpyro.optim.SGD(_decay(2e-3)), id="numpyro.SGD"),
        # slow: one compilation each, and nothing new for DPSVI beyond SGD's and Adam's code path
        pytest.param(lambda: numpyro.optim.Momentum(_decay(5e-4), 0.9), id="numpyro.Momentum", marks=SLOW),
        pytest.param(lambda: numpyro.optim.RMSProp(_decay(0.05)), id="numpyro.RMSProp", marks=SLOW),
        pytest.param(lambda: numpyro.optim.ClippedAdam(_decay(0.2)), id="numpyro.ClippedAdam", marks=SLOW),
        pytest.param(lambda: jax_optimizers.adam(_decay(0.2)), id="jax.example_libraries.adam", marks=SLOW),
        # optax transformations, passed directly as to numpyro's SVI
        pytest.param(lambda: optax.adam(optax.exponential_decay(0.2, 200, 0.1)), id="optax.adam"),
        pytest.param(
            lambda: optax.chain(
                optax.clip_by_global_norm(1e3), optax.sgd(optax.exponential_decay(2e-3, 200, 0.1))
            ),
            id="optax.chain",
            marks=SLOW,
        ),
    ],
)
@pytest.mark.slow
def test_optimizers(make_optim):
    guide = AutoDiagonalNormal(normal_model)
    svi = DPSVI(normal_model, guide, make_optim(), Trace_ELBO(), **SMALL_NOISE, N=N)
    xs = _data()
    result = _fit(svi, xs)
    assert abs(float(guide.median(result.params)["mu"]) - xs.mean()) < 0.3


@pytest.mark.slow
def test_params_in_model_and_guide():
    xs = _data(sd=2.0)
    svi = DPSVI(param_model, param_guide, numpyro.optim.Adam(_decay(0.2)), Trace_ELBO(),
                clipping_threshold=10.0, dp_scale=0.3, N=N)
    result = _fit(svi, xs, num_steps=400)
    params = result.params
    assert set(params) == {"log_sigma", "mu_loc", "mu_scale"}
    assert abs(float(params["mu_loc"]) - xs.mean()) < 0.3
    assert abs(float(params["log_sigma"]) - np.log(xs.std())) < 0.2
    # the constrained guide parameter comes back constrained (as from SVI.get_params)
    assert float(params["mu_scale"]) > 0


@pytest.mark.slow
def test_several_observed_sites_under_one_plate():
    xs = _data(seed=1)
    ys = (-2.0 + np.random.default_rng(2).standard_normal(N)).astype(np.float32)
    guide = AutoNormal(two_column_model)
    svi = DPSVI(two_column_model, guide, numpyro.optim.Adam(_decay(0.2)), Trace_ELBO(), **SMALL_NOISE, N=N)
    result = _fit(svi, xs, ys)
    median = guide.median(result.params)
    assert abs(float(median["a"]) - xs.mean()) < 0.3
    assert abs(float(median["b"]) - ys.mean()) < 0.3


# ---------------------------------------------------------------------------
# 4. purity: jit, determinism, keys, lax.scan


@pytest.fixture(scope="module")
def delta():
    """A noisy and a noiseless DPSVI with AutoDelta (its ELBO has no Monte Carlo noise, so the
    privacy noise is the only randomness), an initial state and jitted updates; shared by the
    tests below so that each compiles once."""

    def make(dp_scale):
        # SGD: the step is proportional to the noisy gradient (Adam's first step is not)
        return DPSVI(normal_model, AutoDelta(normal_model), numpyro.optim.SGD(1e-3), Trace_ELBO(),
                     clipping_threshold=2.0, dp_scale=dp_scale, N=N)

    noisy, noiseless = make(1.0), make(0.0)
    batch = _data()[:8]
    state = noisy.init(d3p.random.PRNGKey(0), batch)
    assert _trees_equal(state, noiseless.init(d3p.random.PRNGKey(0), batch))  # init is deterministic
    return SimpleNamespace(noisy=noisy, noiseless=noiseless, batch=batch, state=state,
                           update=jax.jit(noisy.update), update0=jax.jit(noiseless.update))


@pytest.mark.slow
def test_jit_update_equals_update(delta):
    eager_state, eager_loss = delta.noisy.update(delta.state, delta.batch)
    jit_state, jit_loss = delta.update(delta.state, delta.batch)
    assert isinstance(jit_state, DPSVIState)
    _assert_trees_close(eager_state, jit_state)
    np.testing.assert_allclose(eager_loss, jit_loss, rtol=1e-5)
    assert not _trees_equal(delta.noisy.get_params(delta.state), delta.noisy.get_params(jit_state))


def test_same_state_same_result_and_keys_change_noise(delta):
    state, batch, get_params = delta.state, delta.batch, delta.noisy.get_params
    other_key = state._replace(rng_key=d3p.random.PRNGKey(1))
    a, b = delta.update(state, batch), delta.update(state, batch)
    assert _trees_equal(a, b)  # same state in, same state and loss out
    c = delta.update(other_key, batch)
    # a different key gives different noise
    assert not _trees_equal(get_params(a[0]), get_params(c[0]))
    # the key advances: the next step draws new noise, not the same noise again
    assert not np.array_equal(a[0].rng_key, state.rng_key)
    next_step = delta.update(a[0], batch)[0]
    same_noise_again = delta.update(a[0]._replace(rng_key=state.rng_key), batch)[0]
    assert not _trees_equal(get_params(next_step), get_params(same_noise_again))
    # without noise the key does not matter: the differences above are the noise
    assert _trees_equal(get_params(delta.update0(state, batch)[0]),
                        get_params(delta.update0(other_key, batch)[0]))


def test_update_in_lax_scan(delta):
    svi, batch = delta.noisy, delta.batch

    @jax.jit
    def scanned(state):
        return lax.scan(lambda s, _: svi.update(s, batch), state, None, length=5)

    final, losses = scanned(delta.state)
    loop_state, loop_losses = delta.state, []
    for _ in range(5):
        loop_state, loss = delta.update(loop_state, batch)
        loop_losses.append(loss)
    _assert_trees_close(final, loop_state)
    np.testing.assert_allclose(losses, np.stack(loop_losses), rtol=1e-5)
    assert losses.shape == (5,)


@pytest.mark.slow
def test_evaluate_matches_elbo(delta):
    value = delta.noisy.evaluate(delta.state, delta.batch)
    params = delta.noisy.get_params(delta.state)
    # AutoDelta: the ELBO does not depend on the key
    expected = Trace_ELBO().loss(jax.random.PRNGKey(0), params, normal_model, AutoDelta(normal_model),
                                 delta.batch, N=N)
    assert np.isfinite(value)
    np.testing.assert_allclose(value, expected, rtol=1e-5)


# ---------------------------------------------------------------------------
# 5. run: subsampling, samplers, accounting, result, continuation

N_SMALL, B_SMALL, Q_SMALL = 30, 5, 1 / 6
MAX_STEPS = 40  # batches are re-derived for up to this many steps (one compilation per sampler)


def _sampler(sampling):
    if sampling == "fixed":
        return FixedSizeSampler(N_SMALL, B_SMALL)
    return PoissonSampler(N_SMALL, Q_SMALL)


def _run_kwargs(sampling):
    return dict(batch_size=B_SMALL, sampling="fixed") if sampling == "fixed" else dict(q=Q_SMALL, sampling="poisson")


@functools.partial(jax.jit, static_argnums=0)
def _draw_batches(sampler, batch_key):
    steps = jnp.arange(MAX_STEPS, dtype=jnp.uint32)
    return jax.vmap(lambda i: sampler.sample(d3p.random.fold_in(batch_key, i)))(steps)


def _run_batches(rng_key, num_steps, sampling):
    """The batches run() draws: ``init_key, batch_key = split(rng_key, 2)`` (as in
    d3p/svi.py), batch i from ``sampler.sample(fold_in(batch_key, i))``."""
    assert num_steps <= MAX_STEPS
    init_key, batch_key = d3p.random.split(rng_key, 2)
    indices, masks = _draw_batches(_sampler(sampling), batch_key)
    return init_key, [(indices[i], masks[i]) for i in range(num_steps)]


def _reproduce_run(svi, rng_key, num_steps, xs, sampling, stable=False):
    """Re-derive run()'s batches from its documented key use and apply update to them."""
    sampler = _sampler(sampling)
    init_key, batches = _run_batches(rng_key, num_steps, sampling)
    state = svi.init(init_key, jnp.asarray(xs)[batches[0][0]])
    step_key = d3p.random.fold_in(init_key, 1)   # step i's own draws: fold_in(step_key, i)
    update = jax.jit(svi.stable_update if stable else svi.update)
    losses = []
    for i, (indices, mask) in enumerate(batches):
        state = state._replace(rng_key=d3p.random.fold_in(step_key, i))
        state, loss = update(state, jnp.asarray(xs)[indices], mask=mask,
                             expected_batch_size=sampler.expected_batch_size)
        losses.append(loss)
    return state, np.stack(losses), batches


def _no_privacy_svi():
    # dp_scale=0 and C=inf: the step is the plain (unclipped, noiseless) per-record sum
    return DPSVI(normal_model, AutoNormal(normal_model), numpyro.optim.SGD(1e-3), Trace_ELBO(),
                 clipping_threshold=float("inf"), dp_scale=0.0, N=N_SMALL)


@pytest.mark.parametrize("sampling, stable", [("fixed", False), ("poisson", True)])
@pytest.mark.slow
def test_run_step_is_update_on_the_sampled_batch(sampling, stable):
    """dp_scale=0, C=inf: run's step i equals update on exactly the records that
    ``sampler.sample(fold_in(batch_key, i))`` picks (and stable_update when asked), and
    records outside those batches have no effect: run sees them changed arbitrarily, the
    reproduction never sees them."""
    svi = _no_privacy_svi()
    xs = _data(n=N_SMALL)
    key, T = d3p.random.PRNGKey(11), 3
    state, losses, batches = _reproduce_run(svi, key, T, xs, sampling, stable)
    used = set(np.concatenate([np.asarray(i)[np.asarray(m)] for i, m in batches]).tolist())
    outside = [j for j in range(N_SMALL) if j not in used]
    assert len(outside) >= 10
    changed = xs.copy()
    changed[outside] = 1e6  # every record outside the real batches (also in padded slots)
    original = changed.copy()
    result = svi.run(key, T, changed, progress_bar=False, stable_update=stable, **_run_kwargs(sampling))
    np.testing.assert_array_equal(changed, original)  # the caller's data is not modified
    _assert_trees_close(result.params, svi.get_params(state))
    np.testing.assert_allclose(result.losses, losses, rtol=1e-5)
    assert not any(np.array_equal(batches[0][0], b[0]) for b in batches[1:])  # fresh batch per step
    if sampling == "poisson":
        assert all(m.shape == (_sampler("poisson").max_batch_size,) for _, m in batches)


@pytest.mark.parametrize("sampling", ["fixed", pytest.param("poisson", marks=pytest.mark.slow)])
@pytest.mark.slow
def test_run_subsamples_outlier_visible_only_in_its_batches(sampling):
    """A record with a huge value makes the loss huge exactly at the steps whose
    batch (re-derived from run's key use) contains it."""
    T, outlier = 40, 7
    xs = _data(n=N_SMALL)
    xs[outlier] = 1e3
    svi = DPSVI(normal_model, AutoNormal(normal_model), numpyro.optim.SGD(1e-3), Trace_ELBO(),
                clipping_threshold=1.0, dp_scale=0.0, N=N_SMALL)
    key = d3p.random.PRNGKey(2)
    result = svi.run(key, T, xs, progress_bar=False, **_run_kwargs(sampling))
    _, batches = _run_batches(key, T, sampling)
    contains = np.array([outlier in np.asarray(indices)[np.asarray(mask)] for indices, mask in batches])
    assert 0 < contains.sum() < T  # the outlier is in some batches, not all
    np.testing.assert_array_equal(np.asarray(result.losses) > 1e5, contains)


@pytest.mark.slow
def test_run_poisson_overflow_probability_adds_to_delta():
    """A padded size that overflows with non-negligible probability: run's δ is
    target + (1 + e^ε) T P(K > m), K ~ Binomial(N + 1, q) (computed here with scipy)."""
    from scipy.stats import binom

    svi = DPSVI(normal_model, AutoNormal(normal_model), numpyro.optim.Adam(0.05), Trace_ELBO(),
                clipping_threshold=2.0, dp_scale=3.0, N=N_SMALL)
    xs = _data(n=N_SMALL)
    T, m, target = 10, 14, 1e-6
    result = svi.run(d3p.random.PRNGKey(6), T, xs, q=Q_SMALL, sampling="poisson", max_batch_size=m,
                     target_delta=target, progress_bar=False)
    p = binom.sf(m, N_SMALL + 1, Q_SMALL)
    assert 1e-5 < p < 1e-4
    assert result.delta == pytest.approx(target + (1 + math.exp(result.epsilon)) * T * p, rel=1e-6)
    assert result.delta > 100 * target
    assert result.epsilon == pytest.approx(
        accounting.compute_epsilon(3.0, Q_SMALL, T, target, relation="add_remove"), rel=1e-9)


@pytest.mark.parametrize(
    "sampling, relation, compare_bar",
    [
        ("fixed", "substitute", True),
        ("poisson", "add_remove", False),
        pytest.param("poisson", "add_remove", True, marks=pytest.mark.slow),
    ],
)
@pytest.mark.slow
def test_run_result_progress_bar_epsilon_and_continuation(sampling, relation, compare_bar):
    svi = DPSVI(normal_model, AutoNormal(normal_model), numpyro.optim.Adam(0.05), Trace_ELBO(),
                clipping_threshold=2.0, dp_scale=1.0, N=N_SMALL)
    xs = _data(n=N_SMALL)
    key, T = d3p.random.PRNGKey(4), 23  # with the bar: 11 chunks of 2 steps and one of 1
    without = svi.run(key, T, xs, progress_bar=False, **_run_kwargs(sampling))
    results = [without]
    if compare_bar:  # the tqdm loop and the lax.scan give the same run
        with_bar = svi.run(key, T, xs, progress_bar=True, **_run_kwargs(sampling))
        _assert_trees_close(with_bar.params, without.params)
        np.testing.assert_allclose(with_bar.losses, without.losses, rtol=1e-5)
        results.append(with_bar)

    params, state, losses = without  # unpacks like numpyro's SVIRunResult
    assert isinstance(state, DPSVIState) and losses.shape == (T,)
    assert _trees_equal(params, svi.get_params(state))
    sampler = _sampler(sampling)
    for result in results:
        assert result.relation == relation
        assert result.q == pytest.approx(sampler.q)
        assert result.sigma == 1.0 and result.num_steps == T
        assert result.delta == pytest.approx(1 / N_SMALL**2)
        assert np.isfinite(result.epsilon) and result.epsilon > 0
        expected = accounting.compute_epsilon(1.0, sampler.q, T, 1 / N_SMALL**2, relation=relation)
        assert result.epsilon == pytest.approx(expected, rel=1e-9)
    # the other relation gives another ε: the relation really is the sampler's
    other = "add_remove" if relation == "substitute" else "substitute"
    assert accounting.compute_epsilon(1.0, sampler.q, T, 1 / N_SMALL**2, relation=other) != pytest.approx(
        without.epsilon, rel=1e-3
    )

    if not compare_bar:
        # continue from the final state: the optimizer's step count (numpyro: (i, state))
        # carries on, and the reported ε is that of the new steps only (as documented), not
        # that of all 2 T steps (T again: the compiled steps of the first run serve)
        more = svi.run(d3p.random.PRNGKey(5), T, xs, init_state=without.state, progress_bar=False,
                       **_run_kwargs(sampling))
        assert int(without.state.optim_state[0]) == T and int(more.state.optim_state[0]) == 2 * T
        assert _all_finite(more.params) and not _trees_equal(more.params, without.params)
        assert more.epsilon == pytest.approx(
            accounting.compute_epsilon(1.0, sampler.q, T, 1 / N_SMALL**2, relation=relation), rel=1e-9
        )
        assert more.epsilon < 0.9 * accounting.compute_epsilon(1.0, sampler.q, 2 * T, 1 / N_SMALL**2,
                                                               relation=relation)


def test_stable_update_keeps_params_on_nonfinite_step():
    svi = DPSVI(normal_model, AutoNormal(normal_model), numpyro.optim.SGD(float("nan")), Trace_ELBO(),
                clipping_threshold=2.0, dp_scale=1.0, N=N)
    batch = _data()[:8]
    state = svi.init(d3p.random.PRNGKey(0), batch)
    stable_state, loss = jax.jit(svi.stable_update)(state, batch)
    assert _trees_equal(svi.get_params(stable_state), svi.get_params(state))
    assert np.isnan(loss)
    assert not np.array_equal(stable_state.rng_key, state.rng_key)
    # power: the optimizer step itself does go non-finite
    ones = jax.tree.map(jnp.ones_like, svi.get_params(state))
    assert not _all_finite(svi.optim.get_params(svi.optim.update(ones, state.optim_state)))


# ---------------------------------------------------------------------------
# 6. signature parity with numpyro.infer.SVI (fails when numpyro adds a parameter)


def _named_params(fn):
    return {
        name: p
        for name, p in inspect.signature(fn).parameters.items()
        if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }


def _kinds(fn):
    return {p.kind for p in inspect.signature(fn).parameters.values()}


@pytest.mark.parametrize("method", ["run", "update", "init", "stable_update", "evaluate"])
@pytest.mark.slow
def test_method_accepts_every_svi_parameter(method):
    svi_method, dp_method = getattr(SVI, method), getattr(DPSVI, method)
    svi_params, dp_params = _named_params(svi_method), _named_params(dp_method)
    for name, p in svi_params.items():
        assert name in dp_params, f"DPSVI.{method} lacks SVI's parameter {name!r}"
        q = dp_params[name]
        assert q.kind != q.POSITIONAL_ONLY
        if p.default is not p.empty:
            assert q.default == p.default, f"DPSVI.{method}({name}=...) default differs from SVI's"
    # SVI's positional parameters come first, in the same order
    svi_positional = [n for n, p in svi_params.items() if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert list(dp_params)[: len(svi_positional)] == svi_positional
    # *args (the batch) and **kwargs (model/guide keyword data) as in SVI
    for kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
        if kind in _kinds(svi_method):
            assert kind in _kinds(dp_method)


def test_constructor_accepts_svi_arguments():
    svi_params = list(_named_params(SVI.__init__))
    assert svi_params == ["model", "guide", "optim", "loss"]  # numpyro's; update this test if it changes
    dp_params = list(_named_params(DPSVI.__init__))
    # d3p 0.2 contract: (model, guide, optim, per_example_loss, clipping_threshold, dp_scale, rng_suite,
    # clip_unscaled_observations, **static_kwargs), the fourth under SVI's name `loss`; d3p 0.2's keyword
    # per_example_loss= stays accepted (keyword-only)
    assert dp_params[:8] == ["model", "guide", "optim", "loss", "clipping_threshold",
                             "dp_scale", "rng_suite", "clip_unscaled_observations"]
    per_example_loss = inspect.signature(DPSVI.__init__).parameters["per_example_loss"]
    assert per_example_loss.kind == per_example_loss.KEYWORD_ONLY
    assert inspect.Parameter.VAR_KEYWORD in _kinds(DPSVI.__init__)
    assert inspect.signature(DPSVI.__init__).parameters["rng_suite"].default is d3p.random

    optim, loss = numpyro.optim.Adam(0.1), Trace_ELBO()
    guide = AutoNormal(normal_model)
    svi = DPSVI(normal_model, guide, optim, loss, 2.0, 1.0, N=N)  # all positional as in SVI
    assert svi.model is normal_model and svi.guide is guide and svi.optim is optim
    assert svi.loss is loss and svi.per_example_loss is loss
    assert svi.static_kwargs == {"N": N}
    assert svi.clipping_threshold == 2.0 and svi.dp_scale == 1.0


# ---------------------------------------------------------------------------
# 9. the d3p paper's Listings 2 and 3


def paper_model(xs, ys, N):
    """Listing 2 (model), with ``batch_size`` taken from the batch."""
    batch_size, d = jnp.shape(xs)
    # the prior for w
    w = numpyro.sample("w", dist.Normal(0, 4), sample_shape=(d,))
    # distribution of label y for each record x
    with numpyro.plate("batch", N, batch_size):
        theta = jax.nn.sigmoid(xs.dot(w))
        numpyro.sample("ys", dist.Bernoulli(theta), obs=ys)


def paper_guide(xs, ys, N):
    """Listing 2 (guide)."""
    d = jnp.shape(xs)[1]
    # variational parameters
    w_loc = numpyro.param("w_loc", jnp.zeros((d,)))
    w_scale = jnp.exp(numpyro.param("w_scale_log", jnp.zeros((d,))))
    # variational distribution for w
    numpyro.sample("w", dist.Normal(w_loc, w_scale))


def paper_infer(data, labels, batch_size, num_iter, epsilon, delta, rng_key):
    """Listing 3, verbatim except where marked (the paper imports Adam, Trace_ELBO, DPSVI,
    approximate_sigma and subsample_batchify_data by name)."""
    # set up minibatch sampling
    batchifier_init, get_batch = subsample_batchify_data((data, labels), batch_size)
    _, batchifier_state = batchifier_init(rng_key)

    # set up DP-VI algorithm
    q = batch_size / len(data)
    dp_scale, _, _ = approximate_sigma(epsilon, delta, q, num_iter)
    loss = Trace_ELBO()
    optimiser = numpyro.optim.Adam(1e-3)
    # CHANGED: the paper's `DPSVI(model, guide, optimiser, loss, dp_scale, len(data))` omits the
    # clipping threshold, which comes before dp_scale in DPSVI's (and d3p 0.2's) signature; as
    # printed it would use dp_scale as C and len(data) as the noise multiplier. Keyword form:
    dpsvi = DPSVI(paper_model, paper_guide, optimiser, loss, clipping_threshold=2.0, dp_scale=dp_scale,
                  N=len(data))
    # CHANGED: jit, so that the loop takes milliseconds per step instead of a second
    get_batch, update = jax.jit(get_batch), jax.jit(dpsvi.update)
    svi_state = dpsvi.init(rng_key, *get_batch(0, batchifier_state))

    # run inference
    for i in range(num_iter):
        data_batch, label_batch = get_batch(i, batchifier_state)
        svi_state, loss = update(svi_state, data_batch, label_batch)
    return dpsvi.get_params(svi_state)


@pytest.mark.slow
def test_paper_listing_runs():
    from sklearn.datasets import load_breast_cancer

    X, y = load_breast_cancer(return_X_y=True)
    perm = np.random.default_rng(0).permutation(len(y))
    train, test = perm[:455], perm[455:]
    mean, std = X[train].mean(0), X[train].std(0)
    X = ((X - mean) / std).astype(np.float32)
    y = y.astype(np.float32)

    params = paper_infer(X[train], y[train], batch_size=32, num_iter=200, epsilon=2.0, delta=1e-5,
                         rng_key=d3p.random.PRNGKey(0))
    assert set(params) == {"w_loc", "w_scale_log"}
    assert _all_finite(params)
    predicted = (X[test] @ np.asarray(params["w_loc"])) > 0
    accuracy = np.mean(predicted == (y[test] > 0.5))
    chance = max(y[test].mean(), 1 - y[test].mean())
    # chance (the majority class) is 0.59 on this split; seeds 0-3 give 0.93-0.95
    assert chance < 0.65 and accuracy > 0.85, (accuracy, chance)


# ---------------------------------------------------------------------------
# 10. d3p 0.2's module-level helpers, perturbation_function, the state's observation scale


def _exact_norm(parts) -> float:
    return float(np.sqrt(sum(np.sum(np.asarray(p, np.float64) ** 2) for p in jax.tree.leaves(parts))))


def test_full_norm_of_parts_and_trees():
    parts = [jnp.array([3.0]), jnp.array([[4.0, 0.0]])]
    assert float(full_norm(parts)) == pytest.approx(5.0, rel=1e-6)
    assert float(full_norm(parts)) >= 5.0  # the clipping norm: an upper bound
    assert float(full_norm(tuple(parts))) == pytest.approx(5.0, rel=1e-6)
    assert float(full_norm({"a": parts[0], "b": {"c": parts[1]}})) == pytest.approx(5.0, rel=1e-6)
    assert float(full_norm(parts, ord=1)) == pytest.approx(7.0)
    assert float(full_norm(parts, ord=np.inf)) == pytest.approx(4.0)
    assert float(full_norm([np.array([3, 4])])) == pytest.approx(5.0, rel=1e-6)  # integer parts
    assert float(full_norm([])) == 0.0 and float(full_norm(None)) == 0.0 and float(full_norm([], ord=1)) == 0.0
    assert float(full_norm([jnp.array([1.0, jnp.nan])])) == np.inf  # not finite: no bound


def test_clip_gradient_compat():
    parts = [jnp.array([3.0, 0.0]), jnp.array([[4.0]])]
    clipped = clip_gradient(parts, 1.0)
    assert type(clipped) is list and [p.shape for p in clipped] == [(2,), (1, 1)]
    np.testing.assert_allclose(clipped[0], [0.6, 0.0], rtol=1e-5)
    np.testing.assert_allclose(clipped[1], [[0.8]], rtol=1e-5)
    assert _exact_norm(clipped) <= 1.0
    # below the threshold: unchanged; rescale_factor applied after clipping
    assert _trees_equal(clip_gradient(parts, 10.0), parts)
    np.testing.assert_allclose(clip_gradient(parts, 1.0, rescale_factor=3.0)[1], [[2.4]], rtol=1e-5)
    as_tuple = clip_gradient(tuple(parts), 2.0)
    assert type(as_tuple) is tuple and _exact_norm(as_tuple) <= 2.0 and _exact_norm(as_tuple) > 1.99
    tree = clip_gradient({"w": jnp.array([30.0, 40.0])}, 5.0)
    np.testing.assert_allclose(tree["w"], [3.0, 4.0], rtol=1e-5)
    assert clip_gradient([], 1.0) == []
    # a non-finite gradient contributes nothing
    assert _trees_equal(clip_gradient([jnp.array([jnp.nan, 1.0])], 1.0), [jnp.zeros(2)])
    # usable under jit, the threshold a traced value
    np.testing.assert_allclose(jax.jit(clip_gradient)(parts, 1.0)[1], [[0.8]], rtol=1e-5)


@pytest.mark.parametrize("c", [0.0, -1.0, float("-inf"), float("nan")])
def test_clip_gradient_compat_refuses_bad_threshold(c):
    with pytest.raises(ValueError, match=rf"Expected c to be a number > 0, got c={c}"):
        clip_gradient([jnp.ones(2)], c)


def test_clip_gradient_compat_infinite_threshold_is_no_clipping():
    """d3p 0.2 returned the gradient unchanged for c = inf (issue 29, item 4)."""
    parts = [jnp.array([3e30, -4.0]), jnp.array([[jnp.nan]])]

    def same(a, b):
        return jax.tree.structure(a) == jax.tree.structure(b) and all(
            np.array_equal(x, y, equal_nan=True) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

    assert same(clip_gradient(parts, float("inf")), parts)
    assert same(clip_gradient(parts, np.inf, rescale_factor=2.0), [2 * p for p in parts])
    # the same with a traced threshold (non-finite entries included)
    assert same(jax.jit(clip_gradient)(parts, np.inf), parts)
    assert type(clip_gradient(tuple(parts), np.inf)) is tuple


def test_get_epsilon_default_and_d3p_02_figure():
    """Issue 29, item 4 (docs/migration.md): d3p 0.2's get_epsilon composed the Poisson
    add/remove bound (the Fourier accountant's get_epsilon_R: 2.92 at sigma 0.822, q 0.01,
    1000 steps, delta 1e-5); with no sampler the call now assumes fixed-size batches under
    substitute, whose dominating pair gives about 25.4. sampler="poisson" (or
    relation="add_remove") gives 0.2's figure, valid for Poisson batches only."""
    svi = DPSVI(normal_model, AutoDelta(normal_model), numpyro.optim.SGD(1e-3), Trace_ELBO(),
                clipping_threshold=1.0, dp_scale=0.822, N=N)
    default = svi.get_epsilon(1e-5, 0.01, 10)   # d3p 0.2's positional call: num_epochs = 10
    assert default == pytest.approx(25.4, rel=0.01)
    assert default == svi.get_epsilon(1e-5, 0.01, num_iter=1000, sampler="fixed_size")
    for kwargs in (dict(sampler="poisson"), dict(relation="add_remove")):
        assert svi.get_epsilon(1e-5, 0.01, 10, **kwargs) == pytest.approx(2.92, rel=0.01)


def test_dpsvi_refuses_infinite_clipping_threshold_with_noise():
    """An infinite threshold bounds nothing: a private DPSVI must refuse it."""
    with pytest.raises(ValueError, match="Expected a finite clipping_threshold"):
        DPSVI(normal_model, AutoDelta(normal_model), numpyro.optim.SGD(1e-3), Trace_ELBO(),
              clipping_threshold=float("inf"), dp_scale=1.0, N=N)


def test_normalize_gradient_compat():
    parts = (jnp.array([3.0, 0.0]), jnp.array([[4.0]]))
    normalized = normalize_gradient(parts)
    assert type(normalized) is list
    np.testing.assert_allclose(normalized[0], [0.6, 0.0], rtol=1e-5)
    np.testing.assert_allclose(normalized[1], [[0.8]], rtol=1e-5)
    assert _exact_norm(normalized) == pytest.approx(1.0, rel=1e-5)
    by_l1 = normalize_gradient(list(parts), ord=1)
    np.testing.assert_allclose(np.concatenate([np.ravel(p) for p in by_l1]), [3 / 7, 0.0, 4 / 7], rtol=1e-5)
    tree = normalize_gradient({"w": jnp.array([0.0, 2.0])})
    np.testing.assert_allclose(tree["w"], [0.0, 1.0], rtol=1e-5)


def _scaled_model(xs, N, weight=1.0):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.handlers.scale(scale=weight), numpyro.plate("data", N, subsample_size=xs.shape[0]):
        numpyro.sample("x", dist.Normal(mu, 1.0), obs=xs)


@pytest.mark.slow
def test_get_observations_scale():
    xs = jnp.zeros(10)
    assert get_observations_scale(normal_model, (xs,), {"N": 100}, {"mu": 0.3}) == 10.0
    assert get_observations_scale(_scaled_model, (xs, 100), {"weight": 0.5}, {}) == 5.0
    assert get_observations_scale(two_column_model, (xs, xs), {"N": 40}, {}) == 4.0

    def no_plate(xs):
        numpyro.sample("x", dist.Normal(0.0, 1.0), obs=xs)

    def no_observation(xs):
        numpyro.sample("z", dist.Normal(0.0, 1.0))

    assert get_observations_scale(no_plate, (xs,), {}, {}) is None
    assert get_observations_scale(no_observation, (xs,), {}, {}) is None

    def two_plates(xs, ys):
        with numpyro.plate("a", 100, subsample_size=xs.shape[0]):
            numpyro.sample("x", dist.Normal(0.0, 1.0), obs=xs)
        with numpyro.plate("b", 50, subsample_size=ys.shape[0]):
            numpyro.sample("y", dist.Normal(0.0, 1.0), obs=ys)

    with pytest.raises(ValueError, match=r"(?s)\['x', 'y'\].*different"):
        get_observations_scale(two_plates, (xs, xs), {}, {})
    assert get_observations_scale(two_plates, (xs, jnp.zeros(5)), {}, {}) == 10.0

    def half_scaled(xs):
        with numpyro.plate("a", 100, subsample_size=xs.shape[0]):
            numpyro.sample("x", dist.Normal(0.0, 1.0), obs=xs)
        numpyro.sample("y", dist.Normal(0.0, 1.0), obs=0.0)

    with pytest.raises(ValueError, match="different scales"):
        get_observations_scale(half_scaled, (xs,), {}, {})

    # params are substituted: the observed site's distribution uses them
    def param_scaled(xs):
        s = numpyro.param("s", 1.0)
        with numpyro.plate("a", 100, subsample_size=xs.shape[0]):
            numpyro.sample("x", dist.Normal(0.0, s), obs=xs)
        return s

    assert get_observations_scale(param_scaled, (xs,), {}, {"s": 2.0}) == 10.0


def _accepts_std(sample, std) -> bool:
    """Whether ``sample`` (10^5 values) has standard deviation ``std`` within 2%
    (the estimate's own standard error is 0.22%)."""
    return abs(float(np.std(sample)) / std - 1) < 0.02


@pytest.mark.filterwarnings("ignore:d3p.random.debug uses JAX's non-cryptographic PRNG")
@pytest.mark.parametrize("rng_suite", [d3p.random, d3p.random.debug], ids=["chacha", "debug"])
def test_perturbation_function_std(rng_suite):
    sigma, n = 2.5, 100_000
    base = [jnp.full((n,), 7.0), jnp.full((n // 4, 4), -1.0)]
    noisy = DPSVI.perturbation_function(rng_suite, rng_suite.PRNGKey(3), base, sigma)
    assert type(noisy) is list and [x.shape for x in noisy] == [x.shape for x in base]
    noise = [np.ravel(np.asarray(x) - np.asarray(b)) for x, b in zip(noisy, base)]
    for z in noise:
        assert _accepts_std(z, sigma)
        assert not _accepts_std(z, 1.05 * sigma) and not _accepts_std(z, 0.95 * sigma)
        assert abs(float(np.mean(z))) < 5 * sigma / np.sqrt(n)
    # the parts get independent noise (a key per part)
    assert abs(np.corrcoef(noise[0], noise[1])[0, 1]) < 0.02
    # deterministic in the key, different for another key
    again = DPSVI.perturbation_function(rng_suite, rng_suite.PRNGKey(3), base, sigma)
    assert _trees_equal(again, noisy)
    other = DPSVI.perturbation_function(rng_suite, rng_suite.PRNGKey(4), base, sigma)
    assert not np.array_equal(other[0], noisy[0])


def test_perturbation_function_structure_and_arguments():
    key = d3p.random.PRNGKey(0)
    values = (jnp.zeros(3), {"w": jnp.zeros((2, 2))})
    noisy = DPSVI.perturbation_function(d3p.random, key, values, 1.0)
    assert type(noisy) is tuple and noisy[1]["w"].shape == (2, 2) and _all_finite(noisy)
    assert _trees_equal(DPSVI.perturbation_function(d3p.random, key, values, 0.0), values)
    assert DPSVI.perturbation_function(d3p.random, key, [], 1.0) == []
    with pytest.raises(ValueError, match="perturbation_scale"):
        DPSVI.perturbation_function(d3p.random, key, values, -1.0)
    with pytest.raises(TypeError, match="rng_suite"):
        DPSVI.perturbation_function("d3p.random", key, values, 1.0)


def test_rng_suite_is_checked_at_construction():
    guide = AutoNormal(normal_model)
    optim = numpyro.optim.Adam(0.1)
    with pytest.raises(TypeError, match=r"Expected rng_suite to be a PRNG suite.*got rng_suite='d3p.random'"):
        DPSVI(normal_model, guide, optim, Trace_ELBO(), 2.0, 1.0, "d3p.random", N=N)
    with pytest.raises(TypeError, match="rng_suite"):
        DPSVI(normal_model, guide, optim, Trace_ELBO(), 2.0, 1.0, rng_suite=jax.random, N=N)
    assert DPSVI(normal_model, guide, optim, Trace_ELBO(), 2.0, 1.0, d3p.random.debug, N=N).rng_suite \
        is d3p.random.debug
    # a number in place of clip_unscaled_observations (e.g. the data size) is refused
    with pytest.raises(TypeError, match="clip_unscaled_observations"):
        DPSVI(normal_model, guide, optim, Trace_ELBO(), 2.0, 1.0, d3p.random, 100)


@pytest.fixture(scope="module")
def scaled():
    """A DPSVI on ``_scaled_model`` (N = 100, weight 0.5), its state after init on 10
    records, and a jitted update."""
    svi = DPSVI(_scaled_model, AutoDelta(_scaled_model), numpyro.optim.SGD(1e-3), Trace_ELBO(),
                clipping_threshold=2.0, dp_scale=1.0, N=100, weight=0.5)
    return SimpleNamespace(svi=svi, state=svi.init(d3p.random.PRNGKey(0), _data()[:10]),
                           update=jax.jit(svi.update))


@pytest.mark.slow
def test_state_observation_scale(scaled):
    """observation_scale holds one record's likelihood scale, as d3p 0.2's state did
    (issue 29, item 4): N times the model's constant scale factor, not N / B."""
    svi, state, update = scaled.svi, scaled.state, scaled.update
    assert state.observation_scale.shape == () and state.observation_scale.dtype == jnp.result_type(float)
    assert float(state.observation_scale) == pytest.approx(0.5 * 100)
    # numpyro's scale of a batch of ONE record is the same number
    expected = get_observations_scale(_scaled_model, (_data()[:1], 100), {"weight": 0.5}, {})
    assert float(state.observation_scale) == pytest.approx(expected)
    # it does not depend on the length of the batch last used (20 rows, half of them padding)
    mask = jnp.arange(20) < 10
    state20, _ = update(state, _data()[:20], mask=mask, expected_batch_size=10)
    assert float(state20.observation_scale) == pytest.approx(50.0)
    assert state20.observation_scale.dtype == jnp.result_type(float)
    # only shapes count, not values
    other, _ = update(state, _data(seed=1)[:20] * 100, mask=~mask, expected_batch_size=10)
    assert float(other.observation_scale) == float(state20.observation_scale)
    # a batch of zero rows has it too (found from the shape of one record)
    empty, _ = svi.update(state20, _data()[:0], expected_batch_size=10)
    assert float(empty.observation_scale) == pytest.approx(50.0)
    # a state built from three fields keeps None, so its structure stays the same
    bare = DPSVIState(state.optim_state, None, state.rng_key)
    assert bare.observation_scale is None
    assert update(bare, _data()[:10])[0].observation_scale is None


@pytest.mark.slow
def test_state_observation_scale_without_unscaling():
    svi = DPSVI(normal_model, AutoDelta(normal_model), numpyro.optim.SGD(1e-3), Trace_ELBO(),
                clipping_threshold=2.0, dp_scale=1.0, clip_unscaled_observations=False, N=N)
    # 8 rows, as in the delta fixture: the eager operations of its shapes are compiled already
    state = svi.init(d3p.random.PRNGKey(0), _data()[:8])
    assert float(state.observation_scale) == 1.0
    assert float(svi.update(state, _data()[:8])[0].observation_scale) == 1.0


@pytest.mark.slow
def test_init_then_update_in_loops(scaled):
    svi, state, batch = scaled.svi, scaled.state, _data()[:10]

    @jax.jit
    def loops(state):
        state = lax.fori_loop(0, 3, lambda i, s: svi.update(s, batch)[0], state)
        state = lax.fori_loop(0, 2, lambda i, s: svi.stable_update(s, batch)[0], state)
        return lax.while_loop(lambda c: c[1] < 2, lambda c: (svi.update(c[0], batch)[0], c[1] + 1),
                              (state, 0))[0]

    final = loops(state)
    assert jax.tree.structure(final) == jax.tree.structure(state)
    assert float(final.observation_scale) == pytest.approx(50.0) and _all_finite(final)
