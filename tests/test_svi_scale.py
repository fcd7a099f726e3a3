"""The normalisation of a DPSVI step comes from public constants only.

- the likelihood scale of one record (the plate's N, times constants) is
  found from shapes, never read from a record: a scale that may depend on a
  record's data, the parameters or the random key is refused;
- a public constant scale (``numpyro.handlers.scale(0.5)`` around the plate)
  works, with its public normalisation;
- the released noise has std ``dp_scale * C * scale / B`` per coordinate,
  also for a batch of zero rows (pure noise, never nan, never an error).

The optimizer is SGD with step size 1, so the change of the parameters is
exactly minus the gradient DPSVI releases.
"""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
import scipy.stats
from numpyro.handlers import scale as scale_handler
from numpyro.infer import Trace_ELBO
from numpyro.infer.autoguide import AutoDelta

import d3p.random
from d3p.svi import DPSVI

N = 1000


def plain_model(xs, ws, N):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0).expand([2]).to_event(1))
    with numpyro.plate("data", N, subsample_size=xs.shape[0]):
        numpyro.sample("x", dist.Normal(mu, 1.0).to_event(1), obs=xs)


def half_model(xs, ws, N):
    """A public constant scale around the plate: the likelihood counts half."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0).expand([2]).to_event(1))
    with scale_handler(scale=0.5), numpyro.plate("data", N, subsample_size=xs.shape[0]):
        numpyro.sample("x", dist.Normal(mu, 1.0).to_event(1), obs=xs)


def batch_weight_model(xs, ws, N):
    """The likelihood scaled by the sum of the batch's weights (read from the data)."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0).expand([2]).to_event(1))
    with scale_handler(scale=jnp.sum(ws)), numpyro.plate("data", N, subsample_size=xs.shape[0]):
        numpyro.sample("x", dist.Normal(mu, 1.0).to_event(1), obs=xs)


def record_weight_model(xs, ws, N):
    """Weights per record through handlers.scale inside the plate."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0).expand([2]).to_event(1))
    with numpyro.plate("data", N, subsample_size=xs.shape[0]), scale_handler(scale=ws):
        numpyro.sample("x", dist.Normal(mu, 1.0).to_event(1), obs=xs)


def param_scale_model(xs, ws, N):
    """A scale that is a (learned) parameter: not a constant either."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0).expand([2]).to_event(1))
    s = numpyro.param("s", 1.0, constraint=dist.constraints.positive)
    with scale_handler(scale=s), numpyro.plate("data", N, subsample_size=xs.shape[0]):
        numpyro.sample("x", dist.Normal(mu, 1.0).to_event(1), obs=xs)


def random_scale_model(xs, ws, N):
    """A scale drawn at random (from the model's key)."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0).expand([2]).to_event(1))
    s = numpyro.sample("s", dist.Gamma(2.0, 2.0))
    with scale_handler(scale=s), numpyro.plate("data", N, subsample_size=xs.shape[0]):
        numpyro.sample("x", dist.Normal(mu, 1.0).to_event(1), obs=xs)


def two_plate_model(xs, ws, N):
    """Two observed sites under plates of different sizes: no single record scale."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0).expand([2]).to_event(1))
    with numpyro.plate("data", N, subsample_size=xs.shape[0]):
        numpyro.sample("x", dist.Normal(mu, 1.0).to_event(1), obs=xs)
    with numpyro.plate("other", 2 * N, subsample_size=xs.shape[0]):
        numpyro.sample("w", dist.Normal(0.0, 1.0), obs=ws)


def _data(B=8, seed=0, weight0=1.0):
    rng = np.random.default_rng(seed)
    xs = rng.normal(size=(B, 2)).astype(np.float32)
    ws = np.ones(B, np.float32)
    ws[0] = weight0
    return jnp.asarray(xs), jnp.asarray(ws)


def _svi(model, C=1.0, sigma=1.0, guide=None, **kwargs):
    guide = guide or AutoDelta(model)
    return DPSVI(model, guide, numpyro.optim.SGD(1.0), Trace_ELBO(), C, sigma, N=N, **kwargs)


def _flat(tree):
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


def _released_gradient(svi, state, *args, **kwargs):
    before = svi.optim.get_params(state.optim_state)
    new_state, loss = jax.jit(lambda s, *a, **k: svi.update(s, *a, **k))(state, *args, **kwargs)
    after = svi.optim.get_params(new_state.optim_state)
    return _flat(jax.tree.map(lambda b, a: b - a, before, after)), loss


# ---------------------------------------------------------------------------
# a scale that may depend on the record, the parameters or the key is refused


@pytest.mark.parametrize(
    "model",
    [batch_weight_model, record_weight_model, param_scale_model, random_scale_model],
    ids=["sum_of_batch_weights", "weight_per_record", "parameter", "random"],
)
def test_record_dependent_scale_refused(model):
    """Why: the normalisation is released without noise, so a scale read from
    a record reveals it (with the sum of weights, record 0's weight of 1000
    instead of 1 would multiply the released noise by 1000)."""
    svi = _svi(model)
    xs, ws = _data(weight0=1000.0)
    pattern = r"(?s)\['x'\].*depends on the record's data.*public constant.*per record.*reveal"
    with pytest.raises(ValueError, match=pattern):
        svi.init(d3p.random.PRNGKey(0), xs, ws)
    with pytest.raises(ValueError, match=pattern):
        svi.run(d3p.random.PRNGKey(0), 2, *_data(B=40), batch_size=4, sampling="fixed",
                progress_bar=False)


def test_sites_with_different_scales_refused():
    svi = _svi(two_plate_model)
    with pytest.raises(ValueError, match=r"(?s)\['x', 'w'\].*different or non-scalar scales"):
        svi.init(d3p.random.PRNGKey(0), *_data())


def test_record_weights_allowed_without_unscaling():
    """clip_unscaled_observations=False divides by nothing and normalises by
    1 / B: a weight per record only changes that record's own (clipped) term."""
    B = 6
    xs, ws = _data(B=B, weight0=3.0)
    svi = _svi(record_weight_model, C=float("inf"), sigma=0.0, clip_unscaled_observations=False)
    state = svi.init(d3p.random.PRNGKey(1), xs, ws)
    got, _ = _released_gradient(svi, state, xs, ws)
    params = svi.get_params(state)
    record_grad = jax.jit(jax.grad(lambda p, x, w: Trace_ELBO().loss(
        jax.random.PRNGKey(0), p, record_weight_model, svi.guide, x, w, N=N)))
    expected = sum(_flat(record_grad(params, xs[i:i + 1], ws[i:i + 1])) for i in range(B)) / B
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# a public constant scale works, with its public normalisation


@pytest.mark.parametrize("model", [plain_model, half_model], ids=["plate", "scale(0.5)"])
def test_public_scale_gives_the_minibatch_elbo_gradient(model):
    """sigma = 0, C = inf, deterministic guide: dividing each record's loss by
    the public scale and multiplying the sum by scale / B gives exactly the
    gradient of NumPyro's minibatch ELBO (which carries the 0.5)."""
    xs, ws = _data(B=10, seed=1)
    svi = _svi(model, C=float("inf"), sigma=0.0)
    state = svi.init(d3p.random.PRNGKey(2), xs, ws)
    got, _ = _released_gradient(svi, state, xs, ws)
    params = svi.get_params(state)
    expected = jax.grad(lambda p: Trace_ELBO().loss(jax.random.PRNGKey(0), p, model, svi.guide, xs, ws, N=N))(params)
    np.testing.assert_allclose(got, _flat(expected), rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------------------
# the released noise: std dp_scale * C * scale / B, also for zero rows


def _noise_samples(svi, state, xs, ws, steps, **kwargs):
    """The released gradients of ``steps`` consecutive steps on a batch with
    no real record: pure noise."""

    def step(s, _):
        before = svi.optim.get_params(s.optim_state)
        s, loss = svi.update(s, xs, ws, **kwargs)
        after = svi.optim.get_params(s.optim_state)
        return s, (_ravel(before) - _ravel(after), loss)

    _, (grads, losses) = jax.jit(lambda s: jax.lax.scan(step, s, None, length=steps))(state)
    return np.asarray(grads, np.float64).ravel(), np.asarray(losses)


def _ravel(tree):
    return jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(tree)])


def wide_model(xs, ws, N):
    w = numpyro.param("w", jnp.zeros(xs.shape[1]))
    with scale_handler(scale=0.5), numpyro.plate("data", N, subsample_size=xs.shape[0]):
        numpyro.sample("x", dist.Normal(xs @ w, 1.0), obs=ws)


def wide_guide(xs, ws, N):
    pass


@pytest.mark.parametrize("batch", ["all_masked", "zero_rows"])
def test_noise_std_is_sigma_C_times_public_scale_over_B(batch):
    """200 steps of 50 coordinates: the released noise has std
    sigma * C * (0.5 N) / B, with B the batch size (all records masked out) or
    the given expected_batch_size (a batch of zero rows). A KS test accepts it
    and rejects half and twice of it (twice: the plate's N without the 0.5)."""
    sigma, C, B, d, steps = 1.3, 0.5, 8, 50, 200
    svi = DPSVI(wide_model, wide_guide, numpyro.optim.SGD(1.0), Trace_ELBO(), C, sigma, N=N)
    xs = jnp.ones((B, d))
    ws = jnp.ones(B)
    state = svi.init(d3p.random.PRNGKey(11), xs, ws)
    if batch == "all_masked":
        g, losses = _noise_samples(svi, state, xs, ws, steps, mask=jnp.zeros(B, bool))
    else:
        g, losses = _noise_samples(svi, state, xs[:0], ws[:0], steps, expected_batch_size=B)
    assert g.shape == (steps * d,) and np.all(np.isfinite(g))
    assert np.all(losses == 0.0)
    std = sigma * C * 0.5 * N / B
    assert scipy.stats.kstest(g / std, "norm").pvalue > 0.01
    for wrong in (0.5, 2.0):
        assert scipy.stats.kstest(g / (std * wrong), "norm").pvalue < 1e-6


@pytest.mark.parametrize("method", ["update", "stable_update"])
def test_zero_rows_give_the_same_noise_as_an_all_masked_batch(method):
    """For the same key, a batch of zero rows releases exactly the noise of a
    batch whose records are all masked out (same public normalisation)."""
    B = 4
    svi = _svi(half_model, C=0.7, sigma=2.0)
    xs, ws = _data(B=B, seed=3)
    state = svi.init(d3p.random.PRNGKey(4), xs, ws)
    update = jax.jit(getattr(svi, method))
    empty_state, empty_loss = update(state, xs[:0], ws[:0], expected_batch_size=B)
    masked_state, masked_loss = update(state, xs, ws, mask=jnp.zeros(B, bool))
    empty, masked = _flat(svi.get_params(empty_state)), _flat(svi.get_params(masked_state))
    # the loss of no record: the prior and guide terms, added once per step (formulation)
    assert np.all(np.isfinite(empty)) and float(empty_loss) == pytest.approx(float(masked_loss), rel=1e-6)
    np.testing.assert_allclose(empty, masked, rtol=1e-6, atol=1e-6)
    assert np.max(np.abs(empty - _flat(svi.get_params(state)))) > 1.0  # the noise is there
    np.testing.assert_array_equal(np.asarray(empty_state.rng_key), np.asarray(masked_state.rng_key))


def test_zero_rows_need_the_public_batch_size():
    """Without expected_batch_size a batch of zero rows has no public
    normalisation (its size is 0): refused, naming the argument."""
    svi = _svi(plain_model)
    xs, ws = _data(B=4)
    state = svi.init(d3p.random.PRNGKey(5), xs, ws)
    with pytest.raises(ValueError, match=r"expected_batch_size.*0 records"):
        svi.update(state, xs[:0], ws[:0])


def test_init_with_zero_rows_refused():
    svi = _svi(plain_model)
    xs, ws = _data(B=4)
    with pytest.raises(ValueError, match=r"init.*0 rows"):
        svi.init(d3p.random.PRNGKey(5), xs[:0], ws[:0])
