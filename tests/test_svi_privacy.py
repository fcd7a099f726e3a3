"""What one DPSVI step computes, checked end to end through update().

The optimizer in most tests is SGD with step size 1, so the change of the
parameters is exactly minus the gradient DPSVI hands to the optimizer. Each
DPSVI's step is compiled once (:func:`jitted_update`); tests with the same
settings share one DPSVI (:func:`shared`), and give the same shapes and
keywords where the claim allows, so that the compiled step is reused.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
import scipy.stats
from numpyro.infer import SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoDelta

import d3p.random
from d3p import _private_step
from d3p._paper_models import logistic_regression_guide as guide
from d3p._paper_models import logistic_regression_model as model
from d3p.svi import DPSVI

import _step_keys

N = 1000


def data(B=16, d=3, seed=0):
    rng = np.random.default_rng(seed)
    xs = rng.normal(size=(B, d)).astype(np.float32)
    ys = (rng.uniform(size=B) < 0.5).astype(np.float32)
    return jnp.asarray(xs), jnp.asarray(ys)


@functools.lru_cache(maxsize=None)
def jitted_update(svi):
    """``svi.update`` compiled, once per DPSVI (and per shapes and keywords)."""
    return jax.jit(svi.update)


def sgd_step_gradient(svi, state, *args, **kwargs):
    """The gradient the optimizer received in one DPSVI step (SGD, lr=1)."""
    before = svi.optim.get_params(state.optim_state)
    new_state, loss = jitted_update(svi)(state, *args, **kwargs)
    after = svi.optim.get_params(new_state.optim_state)
    return jax.tree.map(lambda b, a: b - a, before, after), loss


def flat(tree):
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


def make(C, sigma, m=model, g=guide, **kw):
    return DPSVI(m, g, numpyro.optim.SGD(1.0), Trace_ELBO(), C, sigma, N=N, **kw)


@functools.lru_cache(maxsize=None)
def shared(C, sigma):
    """One DPSVI of the logistic regression per ``(C, sigma)`` for the module:
    its compiled step serves every test with these settings (the state, hence
    the key and the initial parameters, is an argument)."""
    return make(C, sigma)


def _clean(svi):
    """The noiseless DPSVI of the same model, guide and C (shared, like ``svi``)."""
    if svi.model is model and svi.guide is guide:
        clean = shared(svi.clipping_threshold, 0.0)
    else:
        clean = make(svi.clipping_threshold, 0.0, m=svi.model, g=svi.guide)
    clean.constrain_fn = svi.constrain_fn
    return clean


def test_no_privacy_trajectory_equals_numpyro_svi():
    """C = inf, sigma = 0, full batch, deterministic guide: the same parameter
    trajectory as numpyro's SVI (Adam), to float tolerance."""
    xs, ys = data(B=N, d=4)
    g = AutoDelta(model)
    dp = DPSVI(model, g, numpyro.optim.Adam(0.05), Trace_ELBO(), float("inf"), 0.0, N=N)
    ref = SVI(model, g, numpyro.optim.Adam(0.05), Trace_ELBO(), N=N)
    dp_state = dp.init(d3p.random.PRNGKey(0), xs, ys)
    ref_state = ref.init(jax.random.PRNGKey(0), xs, ys)
    # same starting point
    ref_state = ref_state._replace(optim_state=dp_state.optim_state)
    dp_up, ref_up = jax.jit(dp.update), jax.jit(ref.update)
    for _ in range(30):
        dp_state, dp_loss = dp_up(dp_state, xs, ys)
        ref_state, ref_loss = ref_up(ref_state, xs, ys)
        np.testing.assert_allclose(dp_loss, ref_loss, rtol=1e-4)
    np.testing.assert_allclose(
        flat(dp.get_params(dp_state)), flat(ref.get_params(ref_state)), rtol=1e-4, atol=1e-5
    )
    assert np.abs(flat(dp.get_params(dp_state))).max() > 0.1  # it actually moved


def _record_keys(svi, state, B):
    """The per-record Monte Carlo keys DPSVI.update uses (d3p._private_step._step_keys:
    the first ``B`` JAX keys of the state's key, from the block function, tests/_step_keys.py)."""
    return jnp.asarray(_step_keys.record_keys(state.rng_key, B))


@pytest.mark.parametrize("adaptive", [False, True])
def test_evaluate_draws_with_the_steps_monte_carlo_key_never_from_a_noise_key(adaptive, monkeypatch):
    """``evaluate`` reads the key of the draw a step from the same state shares across the batch
    (d3p._private_step._step_keys), not one derived from a key its noise comes from."""
    xs, ys = data(B=8)
    svi = make(1.0, 1.0, adaptive_clipping=True if adaptive else None)
    state = svi.init(d3p.random.PRNGKey(3), xs, ys)
    seen = []
    real = svi.loss.loss

    def spy(key, *args, **kwargs):
        seen.append(np.asarray(jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key))
        return real(key, *args, **kwargs)

    monkeypatch.setattr(svi.loss, "loss", spy)
    svi.evaluate(state, xs, ys)
    np.testing.assert_array_equal(seen[0], _step_keys.shared_key(state.rng_key, 8))
    # power: the keys the step's noise and the next state come from, and their Monte Carlo keys, differ from it
    for k in d3p.random.split(state.rng_key, 3 if adaptive else 2):
        assert not np.array_equal(seen[0], np.asarray(d3p.random.convert_to_jax_rng_key(k)))
        assert not any(np.array_equal(seen[0], w) for w in _step_keys.jax_key_words(k, 9))


def test_plate_scaling_equals_full_data_elbo_gradient_for_same_guide_samples():
    """sigma = 0, C = inf, formulation="per_record" (d3p 0.2's): the DP gradient is
    N/B times the sum of per-record ELBO gradients, i.e. the minibatch ELBO gradient
    with each record's own guide sample: (1/B) sum_i grad of numpyro's ELBO on the
    one-record batch i with key i. (The default formulation: tests/test_svi_formulation.py.)"""
    B = 12
    xs, ys = data(B=B)
    svi = make(float("inf"), 0.0, formulation="per_record")
    state = svi.init(d3p.random.PRNGKey(1), xs, ys)
    got, _ = sgd_step_gradient(svi, state, xs, ys)
    params = svi.get_params(state)
    keys = _record_keys(svi, state, B)
    elbo = Trace_ELBO()
    # numpyro's gradient of one record's ELBO, compiled once for the B records
    one = jax.jit(jax.grad(lambda p, k, x, y: elbo.loss(k, p, model, guide, x, y, N=N)))
    expected = jax.tree.map(jnp.zeros_like, params)
    for i in range(B):
        g = one(params, keys[i], xs[i : i + 1], ys[i : i + 1])
        expected = jax.tree.map(lambda e, gi: e + gi / B, expected, g)
    np.testing.assert_allclose(flat(got), flat(expected), rtol=2e-4, atol=1e-4)


def test_plate_scaling_with_a_shared_guide_sample_is_numpyros_minibatch_gradient(monkeypatch):
    """formulation="per_record" with every record using the same guide sample: the
    DP gradient (sigma = 0, C = inf) is exactly numpyro's minibatch ELBO gradient on
    the batch (the prior's weight 1/N per record adds up to NumPyro's)."""
    B = 10
    xs, ys = data(B=B, seed=3)
    svi = make(float("inf"), 0.0, formulation="per_record")
    state = svi.init(d3p.random.PRNGKey(2), xs, ys)
    key = jax.random.PRNGKey(7)
    real = _private_step._monte_carlo_keys

    def same_keys(jax_keys, B, sites=None):   # every record's Monte Carlo key is `key` (raw data, as carried)
        keys, key_impl, shared, site_keys = real(jax_keys, B, sites)
        return jnp.broadcast_to(key, keys.shape), key_impl, shared, site_keys

    params = svi.get_params(state)
    monkeypatch.setattr(_private_step, "_monte_carlo_keys", same_keys)
    got, _ = sgd_step_gradient(svi, state, xs, ys)
    expected = jax.jit(jax.grad(lambda p: Trace_ELBO().loss(key, p, model, guide, xs, ys, N=N)))(params)
    np.testing.assert_allclose(flat(got), flat(expected), rtol=2e-4, atol=1e-4)
    # power: with the step's own keys (one per record) the gradient is another
    monkeypatch.setattr(_private_step, "_monte_carlo_keys", real)
    fresh = make(float("inf"), 0.0, formulation="per_record")   # a program of its own, traced with them
    own, _ = sgd_step_gradient(fresh, fresh.init(d3p.random.PRNGKey(2), xs, ys), xs, ys)
    assert not np.allclose(flat(own), flat(expected), rtol=2e-4, atol=1e-4)


def _noise(svi, state, xs, ys, **kw):
    """Noisy minus noiseless gradient of the same step: the noise as the optimizer sees it."""
    noisy, _ = sgd_step_gradient(svi, state, xs, ys, **kw)
    clean, _ = sgd_step_gradient(_clean(svi), state, xs, ys, **kw)
    return flat(noisy) - flat(clean)


def big_model(xs, ys, N):
    with numpyro.plate("batch", N, subsample_size=xs.shape[0]):
        numpyro.sample("ys", dist.Normal(xs @ numpyro.param("w", jnp.zeros(xs.shape[1])), 1.0), obs=ys)


def big_guide(xs, ys, N):
    pass


@pytest.mark.parametrize("sigma, C, B", [(1.3, 0.5, 8), (0.7, 2.0, 16)])
def test_noise_std_is_dp_scale_times_C_times_N_over_B(sigma, C, B):
    """Zero gradient sum (all records masked out): the gradient is pure noise of std
    dp_scale * C * N / B per coordinate. A KS test accepts that scale and rejects 2/3
    and 3/2 of it."""
    d = 20000
    xs = jnp.ones((B, d)) * 3.0
    ys = jnp.ones((B,))
    svi = DPSVI(big_model, big_guide, numpyro.optim.SGD(1.0), Trace_ELBO(), C, sigma, N=N)
    state = svi.init(d3p.random.PRNGKey(11), xs, ys)
    g, loss = sgd_step_gradient(svi, state, xs, ys, mask=jnp.zeros(B, bool))
    g = flat(g)
    assert np.all(np.isfinite(g)) and float(loss) == 0.0
    std = sigma * C * N / B
    assert scipy.stats.kstest(g / std, "norm").pvalue > 0.01
    for wrong in (2 / 3, 3 / 2):
        assert scipy.stats.kstest(g / (std * wrong), "norm").pvalue < 1e-6


def test_noise_does_not_depend_on_data_or_mask():
    """For the same key, the noise (noisy minus noiseless gradient) is the same
    whatever the data and the number of real records."""
    B = 8
    xs, ys = data(B=B, seed=4)
    svi = shared(1.0, 1.0)
    state = svi.init(d3p.random.PRNGKey(3), xs, ys)
    n1 = _noise(svi, state, xs, ys, mask=jnp.ones(B, bool))   # every record real
    xs2, ys2 = data(B=B, seed=5)
    n2 = _noise(svi, state, xs2, ys2, mask=jnp.arange(B) < 3)
    np.testing.assert_allclose(n1, n2, rtol=1e-4, atol=1e-3)
    assert np.std(n1) > 1.0  # there is noise


def test_poisson_normalisation_uses_expected_not_realised_batch_size():
    """With a mask, the scale is N / expected_batch_size whatever the realised count."""
    B = 10
    xs, ys = data(B=B, seed=6)
    mask = jnp.arange(B) < 4
    # the records 0..3 get the same Monte Carlo keys only if B matches, so the
    # scale is compared with sigma = 0 and a deterministic guide
    g = AutoDelta(model)
    svi_d = DPSVI(model, g, numpyro.optim.SGD(1.0), Trace_ELBO(), float("inf"), 0.0, N=N)
    st = svi_d.init(d3p.random.PRNGKey(4), xs, ys)
    a, _ = sgd_step_gradient(svi_d, st, xs, ys, mask=mask, expected_batch_size=5.0)
    b, _ = sgd_step_gradient(svi_d, st, xs[:4], ys[:4], expected_batch_size=5.0)
    c, _ = sgd_step_gradient(svi_d, st, xs[:4], ys[:4])  # default: B = 4
    # the prior's gradient, added once per step whatever the batch (formulation), is
    # that of a step on no record; the normalisation scales the records' sum only
    prior = flat(sgd_step_gradient(svi_d, st, xs, ys, mask=jnp.zeros(B, bool), expected_batch_size=5.0)[0])
    np.testing.assert_allclose(flat(a), flat(b), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose((flat(c) - prior) * 4 / 5, flat(a) - prior, rtol=1e-5, atol=1e-6)
    assert np.all(np.isfinite(flat(a))) and np.max(np.abs(flat(a))) > 0


@pytest.mark.parametrize("unscaled", [True, False])
def test_sensitivity_of_one_step_through_update(unscaled):
    """sigma = 0: removing, masking or substituting one record changes the
    optimizer's gradient by at most scale * C (resp. 2 scale * C), where scale is
    N/B (clip_unscaled_observations=True) or 1/B (False); an outlier attains it."""
    B, C = 8, 0.5
    scale = N / B if unscaled else 1.0 / B
    xs, ys = data(B=B, seed=7)
    xs = xs.at[2].set(xs[2] * 1e4)  # an outlier with a large gradient
    svi = DPSVI(big_model, big_guide, numpyro.optim.SGD(1.0), Trace_ELBO(), C, 0.0, N=N,
                clip_unscaled_observations=unscaled)
    state = svi.init(d3p.random.PRNGKey(5), xs, ys)
    every = jnp.ones(B, bool)   # one compiled step: every call has a mask
    base = flat(sgd_step_gradient(svi, state, xs, ys, mask=every)[0])
    masked = flat(sgd_step_gradient(svi, state, xs, ys, mask=jnp.arange(B) != 2)[0])
    d_mask = np.linalg.norm(base - masked)
    assert d_mask <= scale * C * (1 + 1e-4)
    assert d_mask >= scale * C * 0.99  # the outlier is clipped to exactly C
    sub = flat(sgd_step_gradient(svi, state, xs, ys.at[2].set(-1e6), mask=every)[0])
    assert np.linalg.norm(base - sub) <= 2 * scale * C * (1 + 1e-4)


def test_non_finite_records_and_empty_batch_never_give_nan():
    B = 8
    xs, ys = data(B=B, seed=8)
    svi = shared(1.0, 1.0)
    state = svi.init(d3p.random.PRNGKey(6), xs, ys)
    bad = xs.at[1].set(jnp.nan).at[5, 0].set(jnp.inf)
    g, _ = sgd_step_gradient(svi, state, bad, ys, mask=jnp.ones(B, bool))
    assert np.all(np.isfinite(flat(g)))
    # the non-finite records contribute exactly zero: same as masking them out
    keep = jnp.ones(B, bool).at[1].set(False).at[5].set(False)
    g_masked, _ = sgd_step_gradient(svi, state, xs, ys, mask=keep)
    np.testing.assert_allclose(flat(g), flat(g_masked), rtol=1e-5, atol=1e-4)
    # empty batch of garbage: pure noise, finite
    g_empty, loss = sgd_step_gradient(svi, state, bad * jnp.nan, ys, mask=jnp.zeros(B, bool))
    # (the loss of an empty batch is its prior and guide terms, added once per step)
    assert np.all(np.isfinite(flat(g_empty))) and np.isfinite(float(loss))
    assert np.abs(flat(g_empty)).max() > 0


def test_stable_update_decides_on_noisy_gradient_only():
    """A non-finite un-noised loss (a NaN record) does not make stable_update skip:
    the decision uses only the noisy gradient, which stays finite."""
    B = 8
    xs, ys = data(B=B, seed=9)
    svi = shared(1.0, 1.0)
    state = svi.init(d3p.random.PRNGKey(7), xs, ys)
    bad = xs.at[0].set(jnp.nan)
    every = jnp.ones(B, bool)   # the step compiled for the test above
    new_state, loss = jax.jit(svi.stable_update)(state, bad, ys, mask=every)
    assert np.isnan(float(loss)) or np.isfinite(float(loss))
    moved = flat(svi.get_params(new_state)) - flat(svi.get_params(state))
    assert np.abs(moved).max() > 0
    # the same step as update (which also ignores the NaN record)
    upd_state, _ = jitted_update(svi)(state, bad, ys, mask=every)
    np.testing.assert_allclose(flat(svi.get_params(new_state)), flat(svi.get_params(upd_state)))


def test_update_is_deterministic_and_jit_consistent():
    xs, ys = data(B=8, seed=10)
    svi = shared(1.0, 1.0)
    state = svi.init(d3p.random.PRNGKey(8), xs, ys)
    every = jnp.ones(8, bool)   # the compiled step of the tests above
    a, la = svi.update(state, xs, ys, mask=every)
    b, lb = jitted_update(svi)(state, xs, ys, mask=every)
    c, lc = svi.update(state, xs, ys, mask=every)
    np.testing.assert_allclose(flat(svi.get_params(a)), flat(svi.get_params(b)), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(flat(svi.get_params(a)), flat(svi.get_params(c)))
    np.testing.assert_array_equal(np.asarray(a.rng_key), np.asarray(b.rng_key))
    assert float(la) == pytest.approx(float(lb), rel=1e-5)
