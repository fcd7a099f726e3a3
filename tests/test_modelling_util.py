import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

from numpyro.handlers import seed, trace

from d3p.modelling import (
    get_samples_from_trace,
    make_observed_model,
    map_args_obs_to_shape,
    sample_multi_posterior_predictive,
    sample_multi_prior_predictive,
    sample_posterior_predictive,
    sample_prior_predictive,
)
from d3p.util import (
    unvectorize,
    unvectorize_1d,
    unvectorize_2d,
    unvectorize_3d,
    unvectorize_shape,
    unvectorize_shape_1d,
    unvectorize_shape_2d,
    unvectorize_shape_3d,
)


def model(N, xs=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", N):
        numpyro.sample("xs", dist.Normal(mu, 0.01), obs=xs)


def guide(N, xs=None):
    numpyro.sample("mu", dist.Normal(numpyro.param("loc", 0.0), 1e-3))


def test_prior_predictive_shapes_and_substitutes():
    s = sample_prior_predictive(jax.random.PRNGKey(0), model, (5,))
    assert s["xs"].shape == (5,) and s["mu"].shape == ()
    s = sample_prior_predictive(jax.random.PRNGKey(0), model, (5,), substitutes={"mu": 7.0})
    np.testing.assert_allclose(s["xs"], 7.0, atol=0.1)
    m = sample_multi_prior_predictive(jax.random.PRNGKey(1), 200, model, (3,))
    assert m["xs"].shape == (200, 3)
    assert 0.8 < float(jnp.std(m["mu"])) < 1.2  # really from the prior


def test_posterior_predictive_uses_guide_latents():
    params = {"loc": jnp.array(-4.0)}
    s = sample_posterior_predictive(jax.random.PRNGKey(0), model, (4,), guide, (4,), params)
    np.testing.assert_allclose(s["mu"], -4.0, atol=0.01)
    np.testing.assert_allclose(s["xs"], -4.0, atol=0.1)
    m = sample_multi_posterior_predictive(jax.random.PRNGKey(2), 10, model, (4,), guide, (4,), params)
    assert m["xs"].shape == (10, 4)
    assert len(np.unique(np.asarray(m["xs"][:, 0]))) == 10  # independent samples
    with pytest.raises(ValueError, match="n"):
        sample_multi_posterior_predictive(jax.random.PRNGKey(2), 0, model, (4,), guide, (4,), params)


# d3p 0.2's meaning: leading 1s added up to d dimensions; d or more dimensions unchanged
UNVECTORIZE_CASES = [
    ((4, 5, 3), 2, (4, 5, 3)), ((3,), 2, (1, 3)), ((2, 3), 1, (2, 3)), ((), 1, (1,)), ((), 2, (1, 1)),
    ((2, 3, 4, 5), 3, (2, 3, 4, 5)), ((4, 5), 3, (1, 4, 5)), ((7, 2), 2, (7, 2)), ((0, 3), 2, (0, 3)),
]


@pytest.mark.parametrize("shape, d, expected", UNVECTORIZE_CASES)
def test_unvectorize_shape_returns_shapes(shape, d, expected):
    x = np.zeros(shape, np.float32)
    fn = {1: unvectorize_shape_1d, 2: unvectorize_shape_2d, 3: unvectorize_shape_3d}[d]
    for a in (x, jnp.asarray(x)):
        assert fn(a) == expected and unvectorize_shape(a, d) == expected
        assert type(fn(a)) is tuple and all(type(s) is int for s in fn(a))


def test_unvectorize_shape_unpacks_and_traces():
    N, D = unvectorize_shape_2d(jnp.zeros(3))
    assert (N, D) == (1, 3)
    assert unvectorize_shape_2d(jnp.zeros(3)) == (1, 3)
    assert unvectorize_shape_1d(2.0) == (1,)
    # shapes are static: usable under jit
    out = jax.jit(lambda x: jnp.zeros(unvectorize_shape_3d(x)))(jnp.ones((2, 3, 4, 5)))
    assert out.shape == (2, 3, 4, 5)
    with pytest.raises(ValueError, match="d"):
        unvectorize_shape(jnp.zeros(3), 0)
    with pytest.raises(ValueError, match="d"):
        unvectorize_shape(jnp.zeros(3), True)


@pytest.mark.parametrize("shape, d, expected", UNVECTORIZE_CASES)
def test_unvectorize_reshapes(shape, d, expected):
    x = np.arange(int(np.prod(shape))).reshape(shape).astype(np.float32)
    before = x.copy()
    fn = {1: unvectorize_1d, 2: unvectorize_2d, 3: unvectorize_3d}[d]
    out = fn(x)
    assert out.shape == expected == unvectorize_shape(x, d)
    np.testing.assert_array_equal(unvectorize(x, d), out)
    np.testing.assert_array_equal(np.ravel(out), np.ravel(before))
    np.testing.assert_array_equal(x, before)
    with pytest.raises(ValueError, match="d"):
        unvectorize(x, 0)


# ------------------------------------------------------------ traces, intermediates


def mixture_model(N, xs=None):
    """A site with intermediates (TransformedDistribution: the base draw)."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    numpyro.param("p", 1.0)
    numpyro.deterministic("twice_mu", 2 * mu)
    with numpyro.plate("data", N):
        numpyro.sample("xs", dist.LogNormal(mu, 0.5), obs=xs)


def test_get_samples_from_trace():
    tr = trace(seed(mixture_model, jax.random.PRNGKey(0))).get_trace(3)
    samples = get_samples_from_trace(tr)
    assert set(samples) == {"mu", "xs"}  # no param, deterministic or plate sites
    assert samples["xs"] is tr["xs"]["value"]
    with_inter = get_samples_from_trace(tr, with_intermediates=True)
    assert set(with_inter) == {"mu", "xs"}
    value, inter = with_inter["xs"]
    assert value is tr["xs"]["value"] and inter is tr["xs"]["intermediates"]
    # LogNormal's intermediate is the Normal draw: log of the value
    np.testing.assert_allclose(jnp.log(value), inter[0][0], rtol=1e-5)
    # observed sites are included too
    tr = trace(seed(mixture_model, jax.random.PRNGKey(0))).get_trace(3, jnp.ones(3))
    np.testing.assert_array_equal(get_samples_from_trace(tr)["xs"], np.ones(3))
    with pytest.raises(TypeError, match="trace"):
        get_samples_from_trace([1, 2])


def test_prior_predictive_with_intermediates_gives_pairs():
    s = sample_prior_predictive(jax.random.PRNGKey(0), mixture_model, (4,), with_intermediates=True)
    assert set(s) == {"mu", "xs"}
    value, inter = s["xs"]
    assert value.shape == (4,)
    np.testing.assert_allclose(jnp.log(value), inter[0][0], rtol=1e-5)
    plain = sample_prior_predictive(jax.random.PRNGKey(0), mixture_model, (4,))
    np.testing.assert_array_equal(plain["xs"], value)  # the same draw
    m = sample_multi_prior_predictive(jax.random.PRNGKey(1), 6, mixture_model, (4,), with_intermediates=True)
    assert m["xs"][0].shape == (6, 4) and m["xs"][1][0][0].shape == (6, 4)


def aux_guide(N, xs=None):
    """A guide with a site the model does not have (an auxiliary variable)."""
    aux = numpyro.sample("aux", dist.Normal(numpyro.param("aux_loc", 10.0), 1e-3))
    numpyro.sample("mu", dist.Normal(aux - 10.0 + numpyro.param("loc", 0.0), 1e-3))


def test_posterior_predictive_includes_guide_only_sites():
    params = {"loc": jnp.array(2.0), "aux_loc": jnp.array(10.0)}
    s = sample_posterior_predictive(jax.random.PRNGKey(0), mixture_model, (5,), aux_guide, (5,), params)
    assert set(s) == {"mu", "xs", "aux"}
    np.testing.assert_allclose(s["aux"], 10.0, atol=0.01)
    np.testing.assert_allclose(s["mu"], 2.0, atol=0.01)
    assert s["xs"].shape == (5,)
    s = sample_posterior_predictive(
        jax.random.PRNGKey(0), mixture_model, (5,), aux_guide, (5,), params, with_intermediates=True
    )
    assert set(s) == {"mu", "xs", "aux"} and all(isinstance(v, tuple) and len(v) == 2 for v in s.values())
    m = sample_multi_posterior_predictive(
        jax.random.PRNGKey(1), 3, mixture_model, (5,), aux_guide, (5,), params
    )
    assert m["aux"].shape == (3,) and m["xs"].shape == (3, 5)


# ------------------------------------------------------------------ model adapters


def generative_model(mu_scale, x=None, N=3):
    mu = numpyro.sample("mu", dist.Normal(0.0, mu_scale))
    with numpyro.plate("data", N):
        numpyro.sample("x", dist.Normal(mu, 1.0), obs=x)
    return mu


def test_make_observed_model_maps_arguments():
    calls = []

    def mapping(obs, mu_scale, **kwargs):
        calls.append((obs, mu_scale, kwargs))
        return (mu_scale,), {"x": obs, "N": obs.shape[0]}

    observed = make_observed_model(generative_model, mapping)
    obs = jnp.arange(4.0)
    tr = trace(seed(observed, jax.random.PRNGKey(0))).get_trace(obs, 10.0, extra=1)
    assert calls[0][1] == 10.0 and calls[0][2] == {"extra": 1}
    assert tr["x"]["is_observed"] and tr["x"]["value"].shape == (4,)
    np.testing.assert_array_equal(tr["x"]["value"], obs)
    # the model's return value comes back
    assert seed(observed, jax.random.PRNGKey(0))(obs, 10.0).shape == ()
    # usable for inference: the observed model's log density
    from numpyro.infer.util import log_density

    lp, _ = log_density(observed, (obs, 10.0), {}, {"mu": 1.5})
    expected = dist.Normal(0.0, 10.0).log_prob(1.5) + dist.Normal(1.5, 1.0).log_prob(obs).sum()
    np.testing.assert_allclose(lp, expected, rtol=1e-6)


def test_make_observed_model_errors():
    with pytest.raises(TypeError, match="model"):
        make_observed_model(None, map_args_obs_to_shape)
    with pytest.raises(TypeError, match="obs_to_model_args_fn"):
        make_observed_model(generative_model, "x")
    bad = make_observed_model(generative_model, lambda obs: obs)
    with pytest.raises(TypeError, match="obs_to_model_args_fn"):
        bad(jnp.zeros(3))


def test_map_args_obs_to_shape():
    obs = jnp.zeros((4, 2))
    args, kwargs = map_args_obs_to_shape(obs, jnp.ones((1, 3)), jnp.arange(4), 2.0, jnp.array(1.0), None,
                                         w=np.ones((1,)), name="x", v=jnp.ones((4, 5)))
    assert args[0] is obs
    assert args[1].shape == (4, 3) and args[2].shape == (4,)
    np.testing.assert_array_equal(args[2], np.arange(4))  # length N: kept
    assert args[3] == 2.0 and args[4].shape == () and args[5] is None  # scalars, non-arrays unchanged
    assert kwargs["w"].shape == (4,) and kwargs["name"] == "x" and kwargs["v"].shape == (4, 5)
    with pytest.raises(ValueError, match=r"args\[0\]"):
        map_args_obs_to_shape(obs, jnp.ones(3))
    with pytest.raises(ValueError, match="w"):
        map_args_obs_to_shape(obs, w=jnp.ones((2, 2)))
    with pytest.raises(ValueError, match="obs"):
        map_args_obs_to_shape(1.0)


def test_observed_model_with_map_args_obs_to_shape():
    def model(x, loc):
        with numpyro.plate("data", x.shape[0]):
            numpyro.sample("x", dist.Normal(loc, 1.0), obs=x)

    observed = make_observed_model(model, map_args_obs_to_shape)
    tr = trace(seed(observed, jax.random.PRNGKey(0))).get_trace(jnp.zeros(5), jnp.array([2.0]))
    assert tr["x"]["fn"].loc.shape == (5,)  # the shared location broadcast to the records
    np.testing.assert_allclose(tr["x"]["fn"].log_prob(tr["x"]["value"]), dist.Normal(2.0, 1.0).log_prob(0.0))
