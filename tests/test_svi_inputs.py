"""Input validation of :class:`d3p.svi.DPSVI`: what it refuses, and how it says so.

- models DP-VI cannot make private (no subsampling plate over the records,
  mutable state, no observed site) are refused at ``init`` with a ValueError
  that says why;
- optimizers that use the (non-private) loss value are refused;
- bad arguments raise ValueError/TypeError naming the argument;
- the caller's data is never modified;
- every data argument is per-record: lists, tuples of numbers and pandas
  objects are columns (rows = records), scalars are refused naming the
  argument and pointing to the constructor.

The public normalisation (the model's scale) is in ``test_svi_scale.py``.
Compatibility with NumPyro's SVI is in ``test_svi_compat.py``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from jax.example_libraries import optimizers as jax_optimizers
from numpyro.infer import Trace_ELBO
from numpyro.infer.autoguide import AutoDelta, AutoNormal
from numpyro.primitives import mutable

import d3p.random
from d3p import _private_step
from d3p.svi import DPSVI

N = 50


def normal_model(xs, N):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("data", N, subsample_size=xs.shape[0]):
        numpyro.sample("x", dist.Normal(mu, 1.0), obs=xs)


def two_column_model(xs, ys, N):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("data", N, subsample_size=xs.shape[0]):
        numpyro.sample("x", dist.Normal(mu, 1.0), obs=xs)
        numpyro.sample("y", dist.Normal(mu, 1.0), obs=ys)


def _svi(model=normal_model, guide=None, optim=None, **kwargs):
    settings = dict(clipping_threshold=1.0, dp_scale=1.0, N=N)
    settings.update(kwargs)
    return DPSVI(model, guide or AutoDelta(model), optim or numpyro.optim.Adam(0.1), Trace_ELBO(), **settings)


def _xs(n=N, seed=0):
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


@pytest.fixture(scope="module")
def svi():
    return _svi()


@pytest.fixture(scope="module")
def state(svi):
    return svi.init(d3p.random.PRNGKey(0), _xs()[:5])


# ---------------------------------------------------------------------------
# 2. models DP-VI cannot make private: refused at init, saying why


def no_plate_model(xs, N):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    numpyro.sample("x", dist.Normal(mu, 1.0).expand(xs.shape).to_event(1), obs=xs)


def unsubsampled_plate_model(xs, N):
    # a plate over the batch only: its likelihood is not scaled to the N records
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("data", xs.shape[0]):
        numpyro.sample("x", dist.Normal(mu, 1.0), obs=xs)


def mutable_model(xs, N):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    count = mutable("count", {"n": jnp.zeros(())})
    count["n"] = count["n"] + xs.shape[0]
    with numpyro.plate("data", N, subsample_size=xs.shape[0]):
        numpyro.sample("x", dist.Normal(mu, 1.0), obs=xs)


def no_observation_model(xs, N):
    numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("data", N, subsample_size=xs.shape[0]):
        numpyro.sample("z", dist.Normal(0.0, 1.0))


@pytest.mark.parametrize(
    "model, pattern",
    [
        # why: the likelihood must be scaled N / batch size, the plate is how DPSVI knows N
        (no_plate_model, r"(?s)\['x'\].*not under a subsampling plate.*subsample_size"),
        (unsubsampled_plate_model, r"(?s)\['x'\].*not under a subsampling plate.*subsample_size"),
        # why: mutable state is updated from the un-noised data
        (mutable_model, r"(?s)mutable.*'count'.*un-noised data"),
        # why: the data must enter through observed sites
        (no_observation_model, r"(?s)no observed sample sites.*plate over the records"),
    ],
)
def test_unsupported_model_refused_at_init(model, pattern):
    svi = _svi(model, guide=AutoNormal(model))
    with pytest.raises(ValueError, match=pattern):
        svi.init(d3p.random.PRNGKey(0), _xs()[:5])


def test_factor_under_plate_is_accepted():
    """numpyro.factor under the plate is an observed site: a valid way to add the likelihood."""

    def factor_model(xs, N):
        mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
        with numpyro.plate("data", N, subsample_size=xs.shape[0]):
            numpyro.factor("loglik", -0.5 * (xs - mu) ** 2)

    state = _svi(factor_model).init(d3p.random.PRNGKey(0), _xs()[:5])
    assert state.mutable_state is None


# ---------------------------------------------------------------------------
# 3. optimizers that use the (non-private) loss value


@pytest.mark.parametrize(
    "make_optim",
    [
        pytest.param(lambda: numpyro.optim.Minimize(), id="numpyro.Minimize"),
        pytest.param(
            lambda: numpyro.optim._NumPyroOptim(jax_optimizers.adam, 0.1, update_with_value=True),
            id="update_with_value",
        ),
    ],
)
def test_optimizer_using_the_loss_value_refused(make_optim):
    with pytest.raises(ValueError, match=r"(?s)optim=.*loss.*not private"):
        svi = _svi(optim=make_optim())
        # refusing it at init would also do; it must never get to a step
        svi.init(d3p.random.PRNGKey(0), _xs()[:5])


@pytest.mark.parametrize("wrap", [lambda t: t, numpyro.optim.optax_to_numpyro], ids=["optax", "optax_to_numpyro"])
def test_optax_is_given_a_constant_for_the_loss_value(wrap):
    # optax transformations, raw or through numpyro's wrapper (as NumPyro users pass them), are accepted
    # and given the public constant 0 as the loss value: one that reads it (reduce_on_plateau) never adapts
    svi = _svi(optim=wrap(optax.contrib.reduce_on_plateau()))
    svi.init(d3p.random.PRNGKey(0), _xs()[:5])
    assert _private_step.optim_value(svi.optim) is not None and float(_private_step.optim_value(svi.optim)) == 0.0


# ---------------------------------------------------------------------------
# 7. bad arguments: ValueError / TypeError naming the argument


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(clipping_threshold=0.0), r"clipping_threshold.*0\.0"),
        (dict(clipping_threshold=-1.0), r"clipping_threshold.*-1\.0"),
        (dict(clipping_threshold=float("nan")), r"clipping_threshold.*nan"),
        (dict(clipping_threshold=float("inf"), dp_scale=1.0), r"clipping_threshold.*inf"),
        (dict(dp_scale=-0.5), r"dp_scale.*-0\.5"),
        (dict(dp_scale=float("nan")), r"dp_scale.*nan"),
        (dict(dp_scale=float("inf")), r"dp_scale.*inf"),
    ],
)
def test_bad_privacy_settings(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        _svi(**kwargs)


def test_infinite_threshold_only_without_noise():
    svi = _svi(clipping_threshold=float("inf"), dp_scale=0.0)
    assert svi.clipping_threshold == float("inf") and svi.dp_scale == 0.0
    with pytest.raises(TypeError, match="clipping_threshold"):
        _svi(clipping_threshold="1.0")


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(num_steps=0), r"num_steps.*0"),
        (dict(num_steps=-3), r"num_steps.*-3"),
        (dict(num_steps=2.5), r"num_steps.*2\.5"),
        (dict(num_steps="10"), r"num_steps.*'10'"),
        (dict(batch_size=N + 1), rf"batch_size.*{N + 1}"),
        (dict(batch_size=0), r"batch_size.*0"),
        (dict(batch_size=-1), r"batch_size.*-1"),
        (dict(batch_size=None, q=0.0), r"q.*0\.0"),
        (dict(batch_size=None, q=-0.1), r"q.*-0\.1"),
        (dict(batch_size=None, q=1.5), r"q.*1\.5"),
        (dict(batch_size=None, q=float("nan")), r"q.*nan"),
        (dict(batch_size=None, sampling="poisson", q=0.0), r"q.*0\.0"),
        (dict(batch_size=None, sampling="poisson", q=1.5), r"q.*1\.5"),
        (dict(batch_size=5, q=0.1), r"batch_size.*q"),  # both
        (dict(batch_size=5, q=0.1, sampling="poisson"), r"batch_size.*q"),  # both
        (dict(sampling="fixed", relation="add_remove"), r"relation='substitute'"),
        (dict(relation="swap"), r"relation.*'swap'"),
        (dict(sampling="fixed_size"), r"sampling.*'fixed_size'"),
        (dict(sampling="Poisson"), r"sampling.*'Poisson'"),
        (dict(batch_size=None, sampling="poisson", q=0.1, max_batch_size=0), r"max_batch_size.*0"),
        (dict(max_batch_size=10, sampling="fixed"), r"max_batch_size"),  # only for Poisson sampling
        (dict(target_delta=0.0), r"delta.*0\.0"),
        (dict(target_delta=1.5), r"delta.*1\.5"),
        (dict(accountant="moments"), r"accountant.*'moments'"),
    ],
)
def test_bad_run_arguments(svi, kwargs, pattern):
    settings = dict(num_steps=2, batch_size=5, progress_bar=False)
    settings.update(kwargs)
    if settings["batch_size"] is None:
        del settings["batch_size"]
    num_steps = settings.pop("num_steps")
    with pytest.raises(ValueError, match=pattern):
        svi.run(d3p.random.PRNGKey(0), num_steps, _xs(), **settings)


def test_mismatched_data_lengths_in_run():
    svi = _svi(two_column_model)
    with pytest.raises(ValueError, match=r"(?s)args\[1\].*leading dimension 49.*args\[0\].*50"):
        svi.run(d3p.random.PRNGKey(0), 2, _xs(), _xs()[:-1], batch_size=5, progress_bar=False)


def test_mismatched_data_lengths_in_update():
    svi = _svi(two_column_model)
    state = svi.init(d3p.random.PRNGKey(0), _xs()[:5], _xs()[:5])
    with pytest.raises(ValueError, match=r"(?s)args\[1\].*leading dimension 4.*args\[0\].*5"):
        svi.update(state, _xs()[:5], _xs()[:4])
    with pytest.raises(ValueError, match=r"(?s)'ys'.*leading dimension 4"):
        svi.update(state, _xs()[:5], ys=_xs()[:4])


def test_mismatched_data_lengths_in_init():
    svi = _svi(two_column_model)
    with pytest.raises(ValueError, match=r"args\[1\]"):
        svi.init(d3p.random.PRNGKey(0), _xs()[:5], _xs()[:4])


@pytest.mark.parametrize(
    "mask",
    [
        np.ones(4, bool),  # too short
        np.ones(6, bool),  # too long
        np.ones((5, 1), bool),  # not one-dimensional
        np.ones(5, np.int32),  # 1/0 instead of True/False
        np.ones(5, np.float32),
    ],
    ids=["short", "long", "2d", "int", "float"],
)
def test_bad_mask(svi, state, mask):
    with pytest.raises(ValueError, match=r"(?s)mask.*boolean.*\(5,\)"):
        svi.update(state, _xs()[:5], mask=mask)


@pytest.mark.parametrize("value", [0.0, -5.0, float("nan")])
def test_bad_expected_batch_size(svi, state, value):
    with pytest.raises(ValueError, match="expected_batch_size"):
        svi.update(state, _xs()[:5], expected_batch_size=value)


@pytest.mark.parametrize(
    "key",
    [0, np.zeros(8, np.int32), np.zeros(2, np.int32)],
    ids=["int", "int32[8]", "int32[2]"],
)
def test_other_objects_instead_of_a_key(svi, state, key):
    # JAX keys (jax.random.key, jax.random.PRNGKey) are accepted: tests/test_numpyro_dropin.py
    with pytest.raises(TypeError, match=r"d3p\.random"):
        svi.init(key, _xs()[:5])
    with pytest.raises(TypeError, match=r"d3p\.random"):
        svi.run(key, 2, _xs(), batch_size=5, progress_bar=False)
    with pytest.raises(TypeError, match=r"d3p\.random"):
        svi.update(state._replace(rng_key=key), _xs()[:5])


def test_state_must_be_a_dpsvi_state(svi, state):
    with pytest.raises(TypeError, match=r"svi_state.*DPSVIState"):
        svi.update(tuple(state), _xs()[:5])


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(), r"num_epochs.*num_iter"),  # neither
        (dict(num_epochs=1, num_iter=10), r"num_epochs.*num_iter"),  # both
        (dict(num_iter=0), r"num_iter.*0"),
        (dict(num_iter=2.5), r"num_iter.*2\.5"),
        (dict(num_epochs=0), r"num_epochs.*0"),
        (dict(num_epochs=1, q=0.0), r"q.*0\.0"),
        (dict(num_iter=10, q=1.5), r"q.*1\.5"),
        (dict(num_iter=10, relation="swap"), r"relation.*'swap'"),
    ],
)
@pytest.mark.parametrize("method", ["get_epsilon", "get_delta"])
def test_bad_accounting_arguments(svi, method, kwargs, pattern):
    settings = dict(q=0.1)
    settings.update(kwargs)
    first = 1e-5 if method == "get_epsilon" else 1.0
    with pytest.raises(ValueError, match=pattern):
        getattr(svi, method)(first, **settings)


def test_accounting_target_checked(svi):
    with pytest.raises(ValueError, match=r"delta.*0\.0"):
        svi.get_epsilon(0.0, 0.1, num_iter=10)
    with pytest.raises(ValueError, match=r"epsilon.*-1\.0"):
        svi.get_delta(-1.0, 0.1, num_iter=10)


def test_get_epsilon_accepts_epochs_or_iterations(svi):
    by_epochs = svi.get_epsilon(1e-5, 0.1, num_epochs=2)
    by_iter = svi.get_epsilon(1e-5, 0.1, num_iter=20)
    assert np.isfinite(by_iter) and by_iter > 0
    assert by_epochs == pytest.approx(by_iter)
    assert svi.get_delta(by_iter, 0.1, num_iter=20) == pytest.approx(1e-5, rel=0.05)


# ---------------------------------------------------------------------------
# 8. the caller's data is never modified


def test_input_data_not_modified_by_init_update_evaluate():
    svi = _svi(two_column_model, clipping_threshold=0.5, dp_scale=2.0)
    xs = _xs(seed=1)
    ys = np.random.default_rng(2).standard_normal(N)  # float64: converted, never written back
    mask = np.array([True, False, True, True, False])
    originals = [a.copy() for a in (xs, ys, mask)]
    flags = [a.flags.writeable for a in (xs, ys, mask)]

    state = svi.init(d3p.random.PRNGKey(0), xs[:5], ys[:5])
    batch_x, batch_y = xs[:5], ys[:5]  # views into the caller's arrays
    state, _ = jax.jit(svi.update)(state, batch_x, batch_y, mask=mask)
    svi.evaluate(state, batch_x, batch_y)
    # run() with numpy data: checked after every fit in test_svi_compat.py (_fit)

    for array, original, flag in zip((xs, ys, mask), originals, flags):
        np.testing.assert_array_equal(array, original)
        assert array.dtype == original.dtype and array.flags.writeable == flag


# ---------------------------------------------------------------------------
# 9. every data argument is per-record: lists, tuples and pandas objects are
#    columns (rows = records), scalars are refused naming the argument


def response_model(xs, ys, N):
    # the model converts its response itself, as models written for lists do
    ys = jnp.asarray(ys)
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("data", N, subsample_size=xs.shape[0]):
        numpyro.sample("x", dist.Normal(mu, 1.0), obs=xs)
        numpyro.sample("y", dist.Normal(mu, 1.0), obs=ys)


# the data tests below use the fast debug suite: the suite only draws the noise
# and the batches, which these tests do not examine
debug_suite = pytest.mark.filterwarnings("ignore::d3p.random.debug.DebugRNGWarning")


def _fast_svi(model, **kwargs):
    return _svi(model, rng_suite=d3p.random.debug, **kwargs)


def _one_step_run(svi, xs, ys, batch_size):
    result = svi.run(d3p.random.debug.PRNGKey(3), 1, xs, ys, batch_size=batch_size, sampling="fixed",
                     progress_bar=False)
    return np.concatenate([np.ravel(np.asarray(v, np.float64)) for v in jax.tree.leaves(result.params)])


@debug_suite
def test_list_response_in_run_is_per_record():
    """sigma = 0, C = 1: a response given as a Python list is one value per
    record. Changing one record's response changes a one-step run only if that
    record is in the step's batch: at most B of the n records can, and the run
    equals the run on the same column as an array. (Were the list shared by all
    records, every record's loss would see the whole column and every change
    would move the step by up to 2 B C.)"""
    n, B = 4, 1
    svi = _fast_svi(response_model, optim=numpyro.optim.SGD(1.0), dp_scale=0.0, N=n)
    xs = _xs(n, seed=3)
    ys = [float(v) for v in _xs(n, seed=4)]
    base = _one_step_run(svi, xs, ys, B)
    np.testing.assert_array_equal(base, _one_step_run(svi, xs, np.asarray(ys, np.float32), B))
    moved = []
    for j in range(n):
        changed = list(ys)
        changed[j] = 1e3
        moved.append(not np.array_equal(_one_step_run(svi, xs, changed, B), base))
    assert 1 <= sum(moved) <= B, moved


@debug_suite
@pytest.mark.parametrize("kind", ["list", "tuple", "data frame"])
@pytest.mark.slow
def test_lists_and_tuples_are_columns(kind):
    """update, evaluate and init treat a list or tuple of numbers (a column)
    and a one-column DataFrame as the float arrays of their values, rows as
    records; the caller's list or frame is untouched."""
    xs, ys = _xs(5, seed=5), _xs(5, seed=6)
    if kind == "list":
        ys_in = [float(v) for v in ys]
    elif kind == "tuple":
        ys_in = tuple(float(v) for v in ys)
    else:  # a (5, 1) table, passed to a model that flattens it
        ys_in = pytest.importorskip("pandas").DataFrame({"y": [float(v) for v in ys]})
    original = ys_in.copy() if kind == "data frame" else list(ys_in)
    model = two_column_model if kind != "data frame" else _flattening_model
    svi = _fast_svi(model, dp_scale=2.0)
    as_array = np.asarray(ys_in, np.float32)
    key = d3p.random.debug.PRNGKey(0)
    state = svi.init(key, xs, ys_in)
    ref_state = svi.init(key, xs, as_array)
    assert _same(state, ref_state)
    assert _same(svi.update(state, xs, ys_in), svi.update(state, xs, as_array))
    assert _same(svi.evaluate(state, xs, ys=ys_in), svi.evaluate(state, xs, ys=as_array))
    assert ys_in.equals(original) if kind == "data frame" else list(ys_in) == original


def _flattening_model(xs, ys, N):
    two_column_model(xs, jnp.reshape(ys, (-1,)), N)


def _same(a, b):
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        np.allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def regression_model(xs, ys, N):
    w = numpyro.sample("w", dist.Normal(0.0, 10.0).expand([xs.shape[1]]).to_event(1))
    with numpyro.plate("data", N, subsample_size=xs.shape[0]):
        numpyro.sample("y", dist.Normal(xs @ w, 1.0), obs=ys)


@debug_suite
@pytest.mark.slow
def test_pandas_data_are_per_record():
    """A DataFrame (rows = records) and a Series give the same steps as their
    arrays, in update, evaluate and run; the frame is not modified."""
    pd = pytest.importorskip("pandas")
    rng = np.random.default_rng(7)
    frame = pd.DataFrame({"a": rng.normal(size=N), "b": rng.integers(0, 3, size=N)})
    series = pd.Series(rng.normal(size=N), name="y")
    frame_copy, series_copy = frame.copy(), series.copy()
    xs, ys = frame.to_numpy(np.float32), series.to_numpy(np.float32)
    svi = _fast_svi(regression_model, dp_scale=2.0)
    key = d3p.random.debug.PRNGKey(0)
    state = svi.init(key, frame[:5], series[:5])
    assert _same(state, svi.init(key, xs[:5], ys[:5]))
    assert _same(svi.update(state, frame[:5], ys=series[:5]), svi.update(state, xs[:5], ys=ys[:5]))
    assert _same(svi.evaluate(state, frame[:5], series[:5]), svi.evaluate(state, xs[:5], ys[:5]))
    kwargs = dict(batch_size=5, sampling="fixed", progress_bar=False)
    got = svi.run(key, 3, frame, series, **kwargs)
    ref = svi.run(key, 3, xs, ys, **kwargs)
    assert _same(got.params, ref.params)
    pd.testing.assert_frame_equal(frame, frame_copy)
    pd.testing.assert_series_equal(series, series_copy)


def test_non_numeric_data_refused():
    """An array of text or objects (a dtype the user declared) is refused,
    naming the kind of dtype, never NumPy's item size (the longest text's
    length). Lists and pandas columns are converted by a rule that reads no
    value (tests/test_input_dtypes.py)."""
    pd = pytest.importorskip("pandas")
    svi = _svi(regression_model)
    frame = pd.DataFrame({"a": np.arange(5.0), "city": ["x", "y", "z", "x", "y"]})
    with pytest.raises(TypeError, match=r"'ys'.*text \(a NumPy str dtype\)") as refused:
        svi.init(d3p.random.PRNGKey(0), np.ones((5, 2)), ys=np.array(["a", "b", "c", "d", "e"]))
    assert "<U" not in str(refused.value)
    with pytest.raises(TypeError, match=r"args\[0\].*Python objects \(dtype object\)"):
        svi.init(d3p.random.PRNGKey(0), frame.to_numpy(), _xs(5))


SCALARS = [
    pytest.param(3.0, id="float"),
    pytest.param(2, id="int"),
    pytest.param(np.float32(1.5), id="numpy scalar"),
    pytest.param(jnp.asarray(1.0), id="0-d jax array"),
    pytest.param(np.asarray(1.0), id="0-d numpy array"),
]


@pytest.fixture(scope="module")
def two_column():
    svi = _svi(two_column_model)
    return svi, svi.init(d3p.random.PRNGKey(0), _xs()[:5], _xs()[:5])


@pytest.mark.parametrize("value", SCALARS)
def test_scalar_data_refused_naming_the_argument(two_column, value):
    """A value shared by all records among the data (here the response, which
    the model would broadcast to every record): refused everywhere, the message
    naming it and the constructor as its place."""
    svi, state = two_column
    pattern = r"(?s)args\[1\].*DPSVI constructor"
    key = d3p.random.PRNGKey(0)
    cases = [
        lambda: svi.init(key, _xs()[:5], value),
        lambda: svi.update(state, _xs()[:5], value),
        lambda: svi.stable_update(state, _xs()[:5], value),
        lambda: svi.evaluate(state, _xs()[:5], value),
        lambda: svi.run(key, 2, _xs(), value, batch_size=5, sampling="fixed", progress_bar=False),
    ]
    for call in cases:
        with pytest.raises(ValueError, match=pattern):
            call()


def test_scalar_keyword_and_nested_data_refused(two_column):
    svi, state = two_column
    xs = _xs()[:5]
    with pytest.raises(ValueError, match=r"(?s)'ys'.*scalar.*DPSVI constructor"):
        svi.update(state, xs, ys=0.5)
    with pytest.raises(ValueError, match=r"(?s)'N'.*scalar.*DPSVI constructor"):
        no_n = DPSVI(two_column_model, AutoDelta(two_column_model), numpyro.optim.Adam(0.1),
                     Trace_ELBO(), clipping_threshold=1.0, dp_scale=1.0)
        no_n.init(d3p.random.PRNGKey(0), xs, xs, N=50)  # N belongs to the constructor
    with pytest.raises(ValueError, match=r"(?s)args\[0\].*scalar.*DPSVI constructor"):
        svi.update(state, 1.0, 2.0)  # two scalars: not one column of two records
    with pytest.raises(ValueError, match=r"(?s)args\[1\]\['w'\].*DPSVI constructor"):
        svi.update(state, xs, {"v": xs, "w": 0.5})
    with pytest.raises(TypeError, match=r"(?s)args\[1\].*str.*DPSVI constructor"):
        svi.update(state, xs, "group A")
    with pytest.raises(TypeError, match=r"(?s)'ys'.*object.*DPSVI constructor"):
        svi.evaluate(state, xs, ys=object())


def test_mismatched_list_and_frame_lengths_refused_naming_both():
    """A list, series or tuple of the wrong length is refused like an array of
    the wrong length, the message naming both arguments (taken as shared, it
    would be broadcast to every record instead)."""
    pd = pytest.importorskip("pandas")
    svi = _svi(response_model)
    with pytest.raises(ValueError, match=r"(?s)args\[1\].*leading dimension 49.*args\[0\].*50"):
        svi.run(d3p.random.PRNGKey(0), 2, _xs(), [float(v) for v in _xs()[:-1]], batch_size=5,
                sampling="fixed", progress_bar=False)
    state = svi.init(d3p.random.PRNGKey(0), _xs()[:5], _xs()[:5])
    with pytest.raises(ValueError, match=r"(?s)'ys'.*leading dimension 4.*args\[0\].*5"):
        svi.update(state, _xs()[:5], ys=pd.Series(_xs()[:4]))
    with pytest.raises(ValueError, match=r"(?s)args\[1\].*leading dimension 3.*args\[0\].*5"):
        svi.evaluate(state, _xs()[:5], (1.0, 2.0, 3.0))


@pytest.mark.slow
def test_scalar_mask_is_one_flag_for_the_batch(svi, state):
    """d3p 0.2 accepted ``mask=True``: every record real; ``False``: every record padded."""
    xs = _xs()[:5]
    for flag in (True, False):
        a, _ = svi.update(state, xs, mask=flag)
        b, _ = svi.update(state, xs, mask=np.full(5, flag))
        for u, v in zip(jax.tree.leaves(svi.get_params(a)), jax.tree.leaves(svi.get_params(b))):
            np.testing.assert_array_equal(u, v)
    with pytest.raises(ValueError, match="mask"):
        svi.update(state, xs, mask=1)
