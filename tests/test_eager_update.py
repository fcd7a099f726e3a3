"""``DPSVI.update`` and ``stable_update`` called eagerly (outside ``jax.jit``,
as NumPyro code often calls them) run as one compiled program, not
operation by operation (``benchmarks/eager_update.py``: 12 s for the first
call of a logistic regression's step and 0.8 s for each after, where the
compiled step takes 1.4 s and 0.2 ms).

- An eager call releases what the jitted method releases, bit for bit, and
  a second eager call on the same shapes traces nothing.
- The program is kept per version of the settings: after ``svi.dp_scale``,
  ``svi.clipping_threshold`` or ``svi.optim`` is set, an eager call
  releases what a DPSVI constructed with the new setting releases, never
  what the old program would (a stale σ would be a privacy failure: the
  accountant would count the new σ).
- The data are still converted and checked before anything runs (lists,
  the scalar mask of d3p 0.2; errors name the argument).
"""

import jax
import numpy as np
import numpyro.optim
import pytest

import d3p.random
from _backend import traced_programs
from _normal_mean import normal_mean_svi

B = 10
XS = np.linspace(-1.0, 2.0, B).astype(np.float32)


def _svi(**kwargs):
    settings = dict(clipping_threshold=1.0, dp_scale=1.0, N=40)
    settings.update(kwargs)
    return normal_mean_svi(**settings)


def _bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def _state(svi):
    return svi.init(d3p.random.PRNGKey(0), XS)


@pytest.mark.parametrize("method", ["update", "stable_update"])
def test_an_eager_call_is_the_jitted_method_and_compiles_once(method):
    svi = _svi()
    state = _state(svi)
    eager = getattr(svi, method)(state, XS)
    jitted = jax.jit(getattr(svi, method))
    assert _bits(eager) == _bits(jitted(state, XS))
    again, traced = traced_programs(lambda: getattr(svi, method)(eager[0], XS))
    assert traced == 0
    assert _bits(again) == _bits(jitted(eager[0], XS))
    assert _bits(again[0].rng_key) != _bits(eager[0].rng_key)   # the key advanced


@pytest.mark.parametrize("setting, value", [("dp_scale", 3.0), ("clipping_threshold", 0.25),
                                            pytest.param("optim", numpyro.optim.Adam(0.2), marks=pytest.mark.slow)])
def test_an_eager_call_after_a_setting_changed_uses_the_new_setting(setting, value):
    svi = _svi()
    state = _state(svi)
    before = svi.update(state, XS)   # compiles the program of the first settings
    setattr(svi, setting, value)
    after = svi.update(state, XS)
    fresh = _svi(**{setting: value}) if setting != "optim" else _svi()
    if setting == "optim":
        fresh.optim = value
    expected = jax.jit(fresh.update)(_state(fresh), XS)
    assert _bits(after) == _bits(expected)
    assert _bits(after[0].optim_state) != _bits(before[0].optim_state)


def test_an_eager_call_converts_and_checks_the_data_first():
    svi = _svi()
    state = _state(svi)
    as_list = svi.update(state, XS.tolist())
    assert _bits(as_list) == _bits(svi.update(state, XS))
    every = svi.update(state, XS, mask=True)   # d3p 0.2: one flag for the batch
    assert _bits(every) == _bits(svi.update(state, XS, mask=np.ones(B, bool)))
    with pytest.raises(ValueError, match="mask"):
        svi.update(state, XS, mask=np.ones(B + 1, bool))
    with pytest.raises(ValueError, match="expected_batch_size"):
        svi.update(state, XS, expected_batch_size=-1.0)


@pytest.mark.slow   # operation by operation: 14 s
def test_an_eager_call_with_an_array_batch_size_runs_the_step_as_written():
    svi = _svi()
    state = _state(svi)
    got = svi.update(state, XS, expected_batch_size=np.asarray(8.0, np.float32))
    want = jax.jit(lambda s, x: svi.update(s, x, expected_batch_size=8.0))(state, XS)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
