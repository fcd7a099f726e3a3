import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

from d3p.modelling import (
    sample_multi_posterior_predictive,
    sample_multi_prior_predictive,
    sample_posterior_predictive,
    sample_prior_predictive,
)
from d3p.util import unvectorize_shape, unvectorize_shape_1d, unvectorize_shape_2d, unvectorize_shape_3d


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


@pytest.mark.parametrize(
    "shape, d, expected",
    [((4, 5, 3), 2, (20, 3)), ((3,), 2, (1, 3)), ((2, 3), 1, (6,)), ((), 1, (1,)),
     ((2, 3, 4, 5), 3, (6, 4, 5)), ((4, 5), 3, (1, 4, 5)), ((7, 2), 2, (7, 2))],
)
def test_unvectorize_shape(shape, d, expected):
    x = np.arange(int(np.prod(shape))).reshape(shape).astype(np.float32)
    before = x.copy()
    fn = {1: unvectorize_shape_1d, 2: unvectorize_shape_2d, 3: unvectorize_shape_3d}[d]
    out = fn(x)
    assert out.shape == expected
    np.testing.assert_array_equal(np.ravel(out), np.ravel(before))
    np.testing.assert_array_equal(x, before)
    with pytest.raises(ValueError, match="d"):
        unvectorize_shape(x, 0)
