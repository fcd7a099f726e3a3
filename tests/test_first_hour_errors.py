"""Mistakes of a first hour with DPSVI get a clear, early message that names
what to change, and none of those messages or warnings reads a data value.

- a record holding NaN or inf contributes zero to the clipped sum;
- ``run`` refuses a plate size ``N`` other than the number of rows;
- a model or guide that does not accept the static keywords (``N``) is named;
- data-dependent Python or NumPy code in a model or guide is named;
- a guide whose initial values are computed from the data is warned about;
- settings whose noise swamps every step, and ``delta >= 1/N``, are warned about.
"""

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

N = 40
B = 8

pytestmark = pytest.mark.filterwarnings("ignore::d3p.random.debug.DebugRNGWarning")


def model(xs, ys, N):
    w = numpyro.sample("w", dist.Normal(0.0, 4.0).expand([xs.shape[1]]).to_event(1))
    with numpyro.plate("batch", N, subsample_size=xs.shape[0]):
        numpyro.sample("ys", dist.Bernoulli(logits=xs @ w), obs=ys)


def guide(xs, ys, N):
    loc = numpyro.param("loc", jnp.zeros(xs.shape[1]))
    numpyro.sample("w", dist.Normal(loc, 0.1).to_event(1))


def _data(seed=0):
    rng = np.random.default_rng(seed)
    xs = rng.normal(size=(N, 2)).astype(np.float32)
    ys = (rng.random(N) < 0.5).astype(np.float32)
    return xs, ys


def _svi(model=model, guide=guide, dp_scale=1.0, clipping_threshold=1.0, lr=0.1, **static):
    static.setdefault("N", N)
    return DPSVI(model, guide, numpyro.optim.SGD(lr), Trace_ELBO(), clipping_threshold=clipping_threshold,
                 dp_scale=dp_scale, rng_suite=d3p.random.debug, gradient_strategy="vmap", **static)


def _key(seed=0):
    return d3p.random.debug.PRNGKey(seed)


def _quietly(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` and the warnings it gave (all of them, every time)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn(*args, **kwargs)
    return result, [str(w.message) for w in caught if w.category is UserWarning]


# ------------------------------------------------------------- non-finite records

def test_a_non_finite_record_contributes_zero():
    """A record holding NaN or inf (in xs or in ys) has a non-finite gradient,
    which is zeroed: the step equals the step with that record masked out, and
    stays finite."""
    xs, ys = _data()
    xs, ys = xs[:B], ys[:B]
    svi = _svi(dp_scale=0.0)
    state = svi.init(_key(), xs, ys)
    # one compiled step for all; the sum is normalised by the public batch size B
    update = jax.jit(lambda xs, ys, mask: svi.update(state, xs, ys, mask=mask, expected_batch_size=B)[0])

    def params_after(xs, ys, mask):
        return ravel_pytree(svi.get_params(update(xs, ys, mask)))[0]

    want = params_after(xs, ys, np.arange(B) != 3)
    assert not np.array_equal(want, ravel_pytree(svi.get_params(state))[0])   # the others moved it
    for column in ("xs", "ys"):
        for value in (np.nan, np.inf, -np.inf):
            bad_xs, bad_ys = xs.copy(), ys.copy()
            (bad_xs if column == "xs" else bad_ys)[3] = value
            got = params_after(bad_xs, bad_ys, np.ones(B, bool))
            assert np.all(np.isfinite(got)), (column, value)
            np.testing.assert_array_equal(got, want, err_msg=f"{column}={value}")


# ------------------------------------------------------------------- N and the rows

def test_run_refuses_a_plate_size_other_than_the_number_of_rows():
    xs, ys = _data()
    svi = _svi(N=1000)
    with pytest.raises(ValueError, match=r"got N=1000 \(DPSVI\(\.\.\., N=1000\)\) and 40 rows.*"
                                         r"Pass N=40 .*N is treated as public"):
        svi.run(_key(), 1, xs, ys, batch_size=B, progress_bar=False)
    state = svi.init(_key(), xs[:B], ys[:B])   # a batch: its size says nothing about N
    with pytest.raises(ValueError, match=r"plate 'batch'.*got N=1000"):
        svi.run(_key(), 1, xs, ys, batch_size=B, progress_bar=False, init_state=state)


# ------------------------------------------------------- static keywords, traced code

def no_n_model(xs, ys):
    model(xs, ys, N)


def no_n_guide(xs, ys):
    guide(xs, ys, N)


@pytest.mark.parametrize("role, kwargs", [("model", {"model": no_n_model}), ("guide", {"guide": no_n_guide})])
def test_a_model_or_guide_without_the_static_keyword_is_named(role, kwargs):
    xs, ys = _data()
    svi = _svi(**kwargs)
    name = kwargs[role].__name__
    pattern = (rf"the {role} {name}\(\) cannot take them: got an unexpected keyword argument 'N'.*"
               r"passed to the model AND the guide")
    for call in (lambda: svi.init(_key(), xs[:B], ys[:B]),
                 lambda: svi.run(_key(), 1, xs, ys, batch_size=B, progress_bar=False)):
        with pytest.raises(TypeError, match=pattern) as info:
            call()
        assert isinstance(info.value.__cause__, TypeError)
        assert "static keyword arguments of the DPSVI constructor (N=...)" in str(info.value)


def unique_model(xs, ys, N):
    numpyro.deterministic("levels", len(np.unique(ys)))
    model(xs, ys, N)


def branching_model(xs, ys, N):
    if xs.sum() > 0:
        numpyro.deterministic("positive", 1.0)
    model(xs, ys, N)


def float_model(xs, ys, N):
    numpyro.deterministic("first", float(xs[0, 0]))
    model(xs, ys, N)


def per_record_guide(xs, ys, N):
    """Fine on a batch (init), data-dependent on one record (each step)."""
    if xs.shape[0] == 1:
        numpyro.deterministic("first", float(xs[0, 0]))
    guide(xs, ys, N)


@pytest.mark.parametrize("bad_model, error", [
    (unique_model, jax.errors.TracerArrayConversionError),
    (branching_model, jax.errors.TracerBoolConversionError),
    (float_model, jax.errors.ConcretizationTypeError),
])
def test_data_dependent_python_code_in_the_model_is_named_at_init(bad_model, error):
    xs, ys = _data()
    with pytest.raises(TypeError, match=rf"The model {bad_model.__name__}\(\) uses the values of the data in "
                                        r"Python or NumPy code.*jax\.vmap and jax\.jit.*static keyword") as info:
        _svi(model=bad_model).init(_key(), xs[:B], ys[:B])
    assert isinstance(info.value.__cause__, error)


def test_data_dependent_python_code_in_the_guide_is_named_in_the_step():
    xs, ys = _data()
    svi = _svi(guide=per_record_guide)
    state = svi.init(_key(), xs[:B], ys[:B])
    for update in (svi.update, jax.jit(svi.update)):
        with pytest.raises(TypeError, match=r"The guide per_record_guide\(\) uses the values of the data") as info:
            update(state, xs[:B], ys[:B])
        assert isinstance(info.value.__cause__, jax.errors.ConcretizationTypeError)


def test_other_type_errors_pass_unchanged():
    def broken_guide(xs, ys, N):
        raise TypeError("my own mistake")

    xs, ys = _data()
    with pytest.raises(TypeError, match="^my own mistake$"):
        _svi(guide=broken_guide).init(_key(), xs[:B], ys[:B])


# ---------------------------------------------------------- guides that read the data

def mean_guide(xs, ys, N):
    loc = numpyro.param("loc", jnp.mean(xs, axis=0))
    scale = numpyro.param("scale", jnp.ones(xs.shape[1]))
    numpyro.sample("w", dist.Normal(loc, scale).to_event(1))


def test_a_guide_initialised_from_the_data_is_warned_about_from_shapes_only():
    xs, ys = _data()
    key = _key()
    _, messages = _quietly(_svi(guide=mean_guide).init, key, xs[:B], ys[:B])
    assert len(messages) == 1
    assert "param site(s) ['loc'] of the guide depends on the values of the data" in messages[0]
    assert "placeholders" in messages[0] and "init_params={'loc': ...}" in messages[0]
    # the same warning whatever the values: it reads shapes and dtypes only
    _, other = _quietly(_svi(guide=mean_guide).init, key, np.full((B, 2), np.nan, np.float32), ys[:B] * 0)
    assert other == messages
    # nothing to warn about with public initial values, or a guide that does not read the data
    for kwargs in ({"init_params": {"loc": jnp.zeros(2)}}, {"init_data": (xs[:2] * 0, ys[:2] * 0)}):
        assert _quietly(_svi(guide=mean_guide).init, key, xs[:B], ys[:B], **kwargs)[1] == []
    assert _quietly(_svi().init, key, xs[:B], ys[:B])[1] == []


# ------------------------------------------------------------------ all noise, delta

def test_run_warns_once_about_noise_that_swamps_every_step_and_about_delta():
    xs, ys = _data()
    svi = _svi(dp_scale=8.0)   # sigma >= B: noise std sigma*C/B >= C in the averaged gradient
    _, messages = _quietly(svi.run, _key(), 1, xs, ys, batch_size=B, progress_bar=False)   # delta = 1/N**2
    assert len(messages) == 1
    assert "dp_scale=8 is at least the (expected) batch size B=8" in messages[0]
    assert "sigma*C/B = 1 in every coordinate, at least C = 1" in messages[0]
    # once per DPSVI and batch size; the same compiled steps, so no further cost
    _, messages = _quietly(svi.run, _key(1), 1, xs, ys, batch_size=B, progress_bar=False, target_delta=1 / N)
    assert messages == ["target_delta=0.025 is at least 1/N = 0.025 for N=40 records: releasing one record "
                        "chosen at random, in full, satisfies (0, 1/N)-DP, so this delta promises nothing. "
                        "Choose delta much smaller than 1/N (the default is 1/N**2)."]


@pytest.mark.parametrize("dp_scale, warned", [(B, True), (B - 0.5, False)])
def test_update_warns_about_noise_that_swamps_every_step(dp_scale, warned):
    xs, ys = _data()
    svi = _svi(dp_scale=dp_scale)
    state = svi.init(_key(), xs[:B], ys[:B])
    _, messages = _quietly(jax.eval_shape, svi.update, state, xs[:B], ys[:B])   # traced, not compiled
    assert len(messages) == int(warned)
    if warned:
        assert messages[0].startswith(f"The noise multiplier dp_scale={B} is at least the (expected) batch size B={B}")
        assert "(when every record agrees)" in messages[0]
