"""The result of DPSVI.run: unpacks as NumPyro's SVIRunResult ``(params, state,
losses)`` and carries the privacy spent as declared fields."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import d3p.random
from d3p import accounting
from d3p.svi import DPSVIRunResult, DPSVIState

from _normal_mean import normal_mean_svi

N, T = 40, 6
PRIVACY_FIELDS = ["epsilon", "delta", "relation", "sampler", "sigma", "q", "num_steps", "start_step",
                  "averaged_steps", "total_epsilon"]


@pytest.fixture(scope="module")
def run():
    svi = normal_mean_svi(clipping_threshold=1.0, dp_scale=2.0, N=N)
    result = svi.run(d3p.random.PRNGKey(0), T, jnp.linspace(0.0, 1.0, N), batch_size=8, sampling="fixed",
                     target_delta=1e-4, progress_bar=False)
    return svi, result


def test_unpacks_as_svi_run_result(run):
    svi, result = run
    params, state, losses = result
    assert isinstance(state, DPSVIState) and losses.shape == (T,)
    assert params is result.params and state is result.state and losses is result.losses
    assert result[0] is params and result[1] is state and result[2] is losses and result[-1] is losses
    assert result[:2] == (params, state)
    assert len(result) == 3 and tuple(result) == (params, state, losses)
    assert jax.tree.structure(params) == jax.tree.structure(svi.get_params(state))
    with pytest.raises(IndexError):
        result[3]


def test_privacy_figures_are_declared_fields(run):
    svi, result = run
    names = [f.name for f in dataclasses.fields(DPSVIRunResult)]
    assert names == ["params", "state", "losses"] + PRIVACY_FIELDS
    assert not hasattr(result, "__dict__") or set(vars(result)) == set(names)  # nothing set on the side
    assert (result.sampler, result.relation, result.sigma, result.num_steps) == ("fixed_size", "substitute", 2.0, T)
    assert result.q == pytest.approx(8 / N) and result.delta == 1e-4
    expected = accounting.compute_epsilon(2.0, 8 / N, T, 1e-4, relation="substitute")
    assert result.epsilon == pytest.approx(expected, rel=1e-9)
    assert isinstance(result.epsilon, float) and result.epsilon > 0


def test_construction():
    # three positional values, as SVIRunResult; the privacy figures are keyword-only
    bare = DPSVIRunResult({"a": 1.0}, None, jnp.zeros(2))
    assert all(getattr(bare, name) is None for name in PRIVACY_FIELDS)
    full = DPSVIRunResult({"a": 1.0}, None, jnp.zeros(2), epsilon=1.0, delta=1e-5, relation="add_remove",
                          sampler="poisson", sigma=1.5, q=0.1, num_steps=2)
    assert (full.epsilon, full.sampler, full.num_steps) == (1.0, "poisson", 2)
    with pytest.raises(TypeError):
        DPSVIRunResult({"a": 1.0}, None, jnp.zeros(2), 1.0)
    with pytest.raises(TypeError):
        DPSVIRunResult({"a": 1.0}, None, jnp.zeros(2), privacy=1.0)


def test_is_a_pytree_of_the_three(run):
    _, result = run
    assert len(jax.tree.leaves(result)) == len(jax.tree.leaves(tuple(result)))
    for a, b in zip(jax.tree.leaves(result), jax.tree.leaves(tuple(result))):
        assert a is b
    doubled = jax.tree.map(lambda x: x * 2 if jnp.issubdtype(jnp.result_type(x), jnp.floating) else x, result)
    assert isinstance(doubled, DPSVIRunResult)
    np.testing.assert_allclose(doubled.losses, 2 * np.asarray(result.losses), rtol=1e-6)
    assert all(getattr(doubled, name) == getattr(result, name) for name in PRIVACY_FIELDS)
    fetched = jax.device_get(result)
    assert isinstance(fetched, DPSVIRunResult) and fetched.epsilon == result.epsilon


@pytest.mark.parametrize("sampling", ["poisson", "fixed"])
@pytest.mark.slow
def test_a_second_run_reuses_the_compiled_steps(sampling):
    svi = normal_mean_svi(clipping_threshold=1.0, dp_scale=2.0, N=N)
    xs = jnp.linspace(0.0, 1.0, N)

    def run(key, data, progress_bar=False):
        return svi.run(d3p.random.PRNGKey(key), T, data, batch_size=8, sampling=sampling,
                       target_delta=1e-4, progress_bar=progress_bar)

    first = run(0, xs)
    (entry,) = svi._run_cache._chunks.values()
    compiled = entry[1]._cache_size()
    # another key and other values of the same shapes: no new compilation ...
    second = run(1, xs[::-1] * 2.0)
    again = run(0, xs)
    assert list(svi._run_cache._chunks.values()) == [entry]
    assert entry[1]._cache_size() == compiled
    # ... and the keys and data are arguments, not constants of the compiled program
    assert not np.array_equal(np.asarray(second.losses), np.asarray(first.losses))
    np.testing.assert_array_equal(np.asarray(again.losses), np.asarray(first.losses))
    for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(first.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # with the bar: the same steps in chunks, the same result
    barred = run(0, xs, progress_bar=True)
    np.testing.assert_array_equal(np.asarray(barred.losses), np.asarray(first.losses))
