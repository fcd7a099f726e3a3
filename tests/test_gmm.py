"""d3p.gmm.GaussianMixture: density against scipy, shapes, sampling moments and
component frequencies, argument validation, and use in a NumPyro model."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.distributions import constraints
from numpyro.infer import SVI, Trace_ELBO
from scipy import stats
from scipy.special import logsumexp

from d3p.gmm import GaussianMixture

PIS = np.array([0.2, 0.5, 0.3])


def _params(event_shape, seed=0):
    rng = np.random.default_rng(seed)
    locs = rng.normal(0.0, 3.0, (3,) + event_shape)
    scales = rng.uniform(0.5, 2.0, (3,) + event_shape)
    return locs, scales


def _scipy_log_prob(x, locs, scales, pis):
    """logsumexp_k (log pi_k + sum over event dims of the normal log-pdfs), one point x."""
    per_component = [
        np.log(pis[k]) + stats.norm(locs[k], scales[k]).logpdf(x).sum() for k in range(len(pis))
    ]
    return logsumexp(per_component)


@pytest.mark.parametrize("event_shape", [(), (1,), (2,), (2, 3)])
def test_log_prob_matches_scipy(event_shape):
    locs, scales = _params(event_shape)
    d = GaussianMixture(locs, scales, PIS)
    assert d.batch_shape == () and d.event_shape == event_shape
    xs = np.random.default_rng(1).normal(0.0, 4.0, (7,) + event_shape)
    # jitted (the distribution is a pytree argument): one compilation instead of one per
    # operation; eager log_prob: test_log_prob_of_far_points_is_finite and below
    got, one = jax.jit(lambda d, x: (d.log_prob(x), d.log_prob(x[0])))(d, jnp.asarray(xs))
    assert got.shape == (7,)
    expected = [_scipy_log_prob(x, locs, scales, PIS) for x in xs]
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)
    # one point alone: a scalar
    assert one.shape == ()
    np.testing.assert_allclose(float(one), expected[0], rtol=1e-5)


def test_log_prob_of_far_points_is_finite():
    d = GaussianMixture(jnp.array([0.0, 1.0]), jnp.array([0.1, 0.1]), jnp.array([0.5, 0.5]))
    lp = d.log_prob(jnp.array([100.0, -100.0]))
    assert np.all(np.isfinite(np.asarray(lp)))  # log-sum-exp, no underflow to -inf
    np.testing.assert_allclose(lp[0], stats.norm(1.0, 0.1).logpdf(100.0) + np.log(0.5), rtol=1e-5)


SHAPES = [(sample_shape, event_shape) for event_shape in [(), (2,), (2, 3)] for sample_shape in [(), (4,), (2, 5)]]


def test_sample_shapes():
    """Every (sample shape, event shape) pair, drawn in one jitted function (one
    compilation for all nine; eager draws: the moment and frequency tests below)."""
    dists = [GaussianMixture(*_params(event_shape), PIS) for _, event_shape in SHAPES]

    @jax.jit
    def draw(dists, key):
        out = []
        for d, (sample_shape, _) in zip(dists, SHAPES):
            x = d.sample(key, sample_shape)
            x2, [z] = d.sample_with_intermediates(key, sample_shape)
            out.append((x, x2, z, d.log_prob(x)))
        return out

    for d, (sample_shape, event_shape), (x, x2, z, log_prob) in zip(dists, SHAPES, draw(dists, jax.random.PRNGKey(0))):
        assert x.shape == sample_shape + event_shape
        assert d.shape(sample_shape) == x.shape
        np.testing.assert_array_equal(x, x2)  # same key: the same draw
        assert z.shape == sample_shape
        assert jnp.issubdtype(z.dtype, jnp.integer)
        assert log_prob.shape == sample_shape


def test_sample_moments():
    locs = np.array([[-3.0, 0.0], [1.0, 5.0], [4.0, -2.0]])
    scales = np.array([[0.5, 1.0], [1.0, 0.3], [2.0, 1.5]])
    d = GaussianMixture(locs, scales, PIS)
    mean = PIS @ locs
    var = PIS @ (scales**2 + locs**2) - mean**2
    np.testing.assert_allclose(d.mean, mean, rtol=1e-6)
    np.testing.assert_allclose(d.variance, var, rtol=1e-5)
    n = 200_000
    x = np.asarray(d.sample(jax.random.PRNGKey(42), (n,)), np.float64)
    # mean within 5 standard errors, variance within 3%
    np.testing.assert_array_less(np.abs(x.mean(0) - mean), 5 * np.sqrt(var / n))
    np.testing.assert_allclose(x.var(0), var, rtol=0.03)


def test_component_frequencies_and_conditional_draws():
    locs = np.array([[-10.0], [0.0], [10.0]])
    d = GaussianMixture(locs, np.full((3, 1), 0.5), PIS)
    n = 60_000
    x, [z] = d.sample_with_intermediates(jax.random.PRNGKey(7), (n,))
    counts = np.bincount(np.asarray(z), minlength=3)
    # chi-square goodness of fit of the assignments to pi
    assert stats.chisquare(counts, PIS * n).pvalue > 1e-3
    # each sample comes from its own component: well separated components
    np.testing.assert_array_less(np.abs(np.asarray(x)[:, 0] - locs[np.asarray(z), 0]), 4.0)


def test_validate_args():
    locs, scales = _params((2,))
    with pytest.raises(ValueError, match="scales"):
        GaussianMixture(locs, -scales, PIS, validate_args=True)
    with pytest.raises(ValueError, match="mixture_probabilities"):
        GaussianMixture(locs, scales, np.array([0.5, 0.4, 0.3]), validate_args=True)
    with pytest.raises(ValueError, match="locs"):
        GaussianMixture(np.array([0.0, np.nan, 1.0]), np.ones(3), PIS, validate_args=True)
    # invalid values pass without validation (e.g. traced under jit)
    GaussianMixture(locs, -scales, PIS, validate_args=False)


def test_shape_errors_name_the_argument():
    locs, scales = _params((2,))
    with pytest.raises(ValueError, match="mixture_probabilities"):
        GaussianMixture(locs, scales, np.array([0.5, 0.5]))
    with pytest.raises(ValueError, match="scales"):
        GaussianMixture(locs, scales[:, :1, None], PIS)  # extra dimension
    with pytest.raises(ValueError, match="scales"):
        GaussianMixture(locs, np.ones((2, 2)), PIS)  # wrong K
    with pytest.raises(ValueError, match="locs"):
        GaussianMixture(1.0, 1.0, np.array([1.0]))
    with pytest.raises(ValueError, match="value"):
        GaussianMixture(locs, scales, PIS).log_prob(jnp.zeros(3))


def test_spherical_scales_broadcast():
    locs, _ = _params((2,))
    d = GaussianMixture(locs, np.array([[1.0], [2.0], [0.5]]), PIS)
    full = GaussianMixture(locs, np.repeat([[1.0], [2.0], [0.5]], 2, axis=1), PIS)
    x = jnp.array([[0.3, -1.0], [2.0, 2.0]])
    np.testing.assert_allclose(d.log_prob(x), full.log_prob(x), rtol=1e-6)


def test_constraints_and_pytree():
    d = GaussianMixture(*_params((2,)), PIS)
    assert d.arg_constraints["mixture_probabilities"] is constraints.simplex
    assert d.arg_constraints["scales"] is constraints.positive
    assert d.arg_constraints["locs"] is constraints.real
    assert d.support.event_dim == 1 and not d.support.is_discrete
    assert GaussianMixture(*_params(()), PIS).support is constraints.real
    assert bool(jnp.all(d.support(jnp.zeros((4, 2)))))
    # a pytree: passes through jit and vmap like NumPyro's own distributions
    x = jnp.zeros((3, 2))
    np.testing.assert_allclose(jax.jit(lambda d: d.log_prob(x))(d), d.log_prob(x), rtol=1e-6)


def gmm_model(N, xs=None, k=2):
    pis = numpyro.sample("pis", dist.Dirichlet(jnp.ones(k)))
    locs = numpyro.sample("locs", dist.Normal(0.0, 5.0).expand([k, 1]).to_event(2))
    with numpyro.plate("data", N):
        numpyro.sample("x", GaussianMixture(locs, jnp.ones((k, 1)), pis), obs=xs)


def gmm_guide(N, xs=None, k=2):
    """Point estimates of the mixture weights and locations (a hand-written AutoDelta: no
    eager search for initial values, whose hundreds of small compilations cost seconds)."""
    pis = numpyro.param("pis_loc", jnp.full(k, 1.0 / k), constraint=constraints.simplex)
    locs = numpyro.param("locs_loc", jnp.linspace(-1.0, 1.0, k)[:, None])
    numpyro.sample("pis", dist.Delta(pis, event_dim=1))
    numpyro.sample("locs", dist.Delta(locs, event_dim=2))


@pytest.mark.slow
def test_in_a_numpyro_model():
    rng = np.random.default_rng(0)
    xs = np.concatenate([rng.normal(-3.0, 1.0, 300), rng.normal(3.0, 1.0, 300)])[:, None].astype(np.float32)
    svi = SVI(gmm_model, gmm_guide, numpyro.optim.Adam(0.05), Trace_ELBO())
    result = svi.run(jax.random.PRNGKey(0), 500, len(xs), jnp.asarray(xs), progress_bar=False)
    assert np.all(np.isfinite(np.asarray(result.losses)))
    locs = np.sort(np.asarray(result.params["locs_loc"])[:, 0])
    np.testing.assert_allclose(locs, [-3.0, 3.0], atol=0.5)
    np.testing.assert_allclose(result.params["pis_loc"], [0.5, 0.5], atol=0.1)
    # prior predictive: the site is sampled from the mixture, one row per record
    tr = numpyro.handlers.trace(numpyro.handlers.seed(gmm_model, 1)).get_trace(5)
    assert tr["x"]["value"].shape == (5, 1)
    assert tr["x"]["intermediates"][0].shape == (5,)  # the component of each record
