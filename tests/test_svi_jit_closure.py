"""A step jitted as a closure over both the state and the data (everything a
compile-time constant) releases the same clipped sum as the step called
eagerly or with the state and data as arguments, on every strategy and
mechanism: never an all-zero sum."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax.flatten_util import ravel_pytree
from numpyro.infer import Trace_ELBO

import d3p.random
from d3p.svi import DPSVI

from _normal_mean import normal_mean_svi

N = 500


def model(xs, ys, N):
    W = numpyro.param("W", jnp.full((xs.shape[1], 4), 0.1))
    v = numpyro.param("v", jnp.full(4, 0.1))
    with numpyro.plate("batch", N, subsample_size=xs.shape[0]):
        numpyro.sample("ys", dist.Bernoulli(logits=jnp.tanh(xs @ W) @ v), obs=ys)


def guide(xs, ys, N):
    pass


#: The default step: ghost norms (the default strategy); the slow step adds
#: a loop over chunks with the discrete mechanism, per-record gradients at
#: once and the other loops with the Gaussian one.
CASES = [pytest.param("vmap", "gaussian", marks=pytest.mark.slow), ("ghost", "gaussian"),
         pytest.param("scan", "discrete", marks=pytest.mark.slow),
         pytest.param("chunked", "gaussian", marks=pytest.mark.slow),
         pytest.param("scan", "gaussian", marks=pytest.mark.slow)]


@pytest.mark.parametrize("strategy,noise", CASES)
def test_a_step_closed_over_state_and_data_releases_the_same_sum(strategy, noise):
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(12, 5)).astype(np.float32)
    ys = (rng.random(12) < 0.5).astype(np.float32)
    mask = np.arange(12) < 10
    sigma = 1e-6 if noise == "discrete" else 0.0
    svi = DPSVI(model, guide, numpyro.optim.SGD(1.0), Trace_ELBO(), clipping_threshold=0.5, dp_scale=sigma,
                N=N, gradient_strategy=strategy, chunk_size=5, noise=noise)
    state = svi.init(d3p.random.PRNGKey(1), xs, ys)
    start = ravel_pytree(svi.get_params(state))[0]

    def moved(s):
        return np.asarray(ravel_pytree(svi.get_params(s))[0] - start)

    eager = moved(svi.update(state, xs, ys, mask=mask)[0])
    closed = moved(jax.jit(lambda: svi.update(state, xs, ys, mask=mask))()[0])
    closed_device = moved(jax.jit(lambda: svi.update(state, jnp.asarray(xs), jnp.asarray(ys),
                                                     mask=jnp.asarray(mask)))()[0])
    passed = moved(jax.jit(lambda s, x, y, m: svi.update(s, x, y, mask=m))(state, xs, ys, mask)[0])
    assert np.linalg.norm(eager) > 1.0   # 10 records, each of norm up to C, times N / B
    for other in (closed, closed_device, passed):
        np.testing.assert_allclose(other, eager, rtol=1e-4, atol=1e-4)


def _sgd_normal_mean(sigma):
    """The normal-mean DPSVI with SGD (Adam's first step moves by the step
    size whatever the gradient's scale: SGD shows the noise's)."""
    svi = normal_mean_svi(clipping_threshold=1.0, dp_scale=sigma, N=40)
    svi.optim = numpyro.optim.SGD(0.1)
    return svi


def test_get_epsilon_warns_where_dp_scale_changed_after_a_jitted_update_was_traced():
    # jax.jit(svi.update) keeps the σ it was traced with (a constant, as any
    # Python value jit reads); get_epsilon reads dp_scale as it is now
    xs = np.linspace(0.0, 1.0, 10).astype(np.float32)
    svi = _sgd_normal_mean(1.0)
    state = svi.init(d3p.random.PRNGKey(0), xs)
    step = jax.jit(svi.update)
    step(state, xs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        svi.get_epsilon(1e-5, 0.25, num_iter=10)   # the σ the steps have: silent
    svi.dp_scale = 4.0
    with pytest.warns(UserWarning, match=r"traced with dp_scale=1\.0"):
        svi.get_epsilon(1e-5, 0.25, num_iter=10)
    with pytest.warns(UserWarning, match=r"traced with dp_scale=1\.0"):
        svi.get_delta(1.0, 0.25, num_iter=10)
    # the trap is real: the jitted step still adds the noise of σ = 1
    stale, _ = step(state, xs)
    reference = _sgd_normal_mean(1.0)
    at_one, _ = jax.jit(reference.update)(reference.init(d3p.random.PRNGKey(0), xs), xs)
    fresh, _ = jax.jit(svi.update)(state, xs)   # traced again: σ = 4
    leaves = [jax.tree.leaves(s.optim_state) for s in (stale, at_one, fresh)]
    assert all(np.array_equal(a, b) for a, b in zip(leaves[0], leaves[1]))
    assert not all(np.allclose(a, b) for a, b in zip(leaves[0], leaves[2]))
    with warnings.catch_warnings():   # a step now traced at σ = 4: silent
        warnings.simplefilter("error")
        svi.get_epsilon(1e-5, 0.25, num_iter=10)
