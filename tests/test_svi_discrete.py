"""DPSVI with noise="discrete": the step, its checks and its accounting."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import d3p.random
from d3p import accounting
from d3p._private_step import noisy_gradient

from _normal_mean import normal_mean_svi


def make_svi(noise="discrete", **kwargs):
    kwargs = dict(dict(clipping_threshold=2.0, dp_scale=1.0, N=200), **kwargs)
    return normal_mean_svi(noise=noise, **kwargs)


XS = jnp.linspace(0.0, 2.0, 200)


def released_gradient(svi, state, xs, mask, expected_batch_size=None):
    """The step's noisy gradient, compiled as one program (called eagerly, the
    step would compile each of its operations on its own)."""
    step = jax.jit(lambda state, xs, mask: noisy_gradient(svi, state, (xs,), {}, mask, expected_batch_size,
                                                          False)[1])
    return step(state, xs, mask)


def test_update_releases_grid_multiples():
    # own_sample: the sum's grid shows in every parameter's step ("aligned", what "auto" is for
    # this guide, releases the sum over the draw, and the scale's step is it times the draw's eps)
    svi = make_svi(formulation="own_sample")
    state = svi.init(d3p.random.PRNGKey(0), XS[:20])
    params = svi.get_params(state)
    plan = svi.discrete_plan(params)
    assert plan.num_params == 2 and plan.dp_scale == 1.0 and plan.clipping_threshold == 2.0
    grad = released_gradient(svi, state, XS[:20], None)
    # the same key with every record masked out: the same noise and the same prior
    # and guide terms (added once per step after the noise, see DPSVI's formulation)
    nothing = released_gradient(svi, state, XS[:20], jnp.zeros(20, bool))
    # the noisy sums are grid * integers, scaled by the public factor N / B
    factor = 200 / 20
    for g, g0 in zip(jax.tree.leaves(grad), jax.tree.leaves(nothing)):
        steps = (np.asarray(g, np.float64) - np.asarray(g0, np.float64)) / factor / plan.grid
        np.testing.assert_allclose(steps, np.round(steps), atol=1e-3)
    # with d3p 0.2's formulation the released gradient itself is such a multiple
    old = make_svi(formulation="per_record")
    old_state = old.init(d3p.random.PRNGKey(0), XS[:20])
    grad = released_gradient(old, old_state, XS[:20], None)
    for g in jax.tree.leaves(grad):
        steps = np.asarray(g, np.float64) / factor / plan.grid
        np.testing.assert_allclose(steps, np.round(steps), atol=1e-3)


def test_run_learns_and_reports_the_discrete_epsilon():
    svi = make_svi(dp_scale=0.8)
    result = svi.run(d3p.random.PRNGKey(1), 300, XS, batch_size=20, progress_bar=False)
    assert abs(float(result.params["auto_loc"][0]) - 1.0) < 0.3
    expected = accounting.compute_epsilon(0.8, 0.1, 300, 1 / 200 ** 2,
                                          sampler="poisson", noise="discrete")
    assert result.epsilon == pytest.approx(expected, rel=1e-9)
    gaussian = accounting.compute_epsilon(0.8, 0.1, 300, 1 / 200 ** 2, sampler="poisson")
    assert result.epsilon >= gaussian


def test_same_key_same_parameters():
    a = make_svi().run(d3p.random.PRNGKey(2), 20, XS, batch_size=20, progress_bar=False)
    b = make_svi().run(d3p.random.PRNGKey(2), 20, XS, batch_size=20, progress_bar=False)
    np.testing.assert_array_equal(np.asarray(a.params["auto_loc"]), np.asarray(b.params["auto_loc"]))


def test_get_epsilon_follows_the_noise():
    svi = make_svi()
    eps = svi.get_epsilon(1e-5, 0.1, num_iter=100, sampler="poisson")
    assert eps == pytest.approx(accounting.compute_epsilon(1.0, 0.1, 100, 1e-5, sampler="poisson",
                                                           noise="discrete"))


@pytest.mark.parametrize("kwargs, match", [
    (dict(noise="laplace"), "noise"),
    (dict(gradient_strategy="ghost"), "gradient_strategy"),
    (dict(gradient_strategy="vmap"), "gradient_strategy"),
    (dict(gradient_strategy="chunked"), "gradient_strategy"),
    (dict(dp_scale=0.0), "dp_scale"),
])
def test_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_svi(**kwargs)


def test_padded_batch_and_empty_batch_are_pure_noise():
    svi = make_svi()
    state = svi.init(d3p.random.PRNGKey(0), XS[:20])
    grad_masked = released_gradient(svi, state, XS[:20], jnp.zeros(20, bool), 20)
    grad_other = released_gradient(svi, state, XS[20:40] + 100.0, jnp.zeros(20, bool), 20)
    for a, b in zip(jax.tree.leaves(grad_masked), jax.tree.leaves(grad_other)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert np.all(np.isfinite(np.asarray(a)))
