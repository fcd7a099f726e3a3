"""The dtype of list and pandas inputs never comes from a record's value.

Lists, tuples and pandas objects passed as data to :class:`d3p.svi.DPSVI`
carry no dtype that d3p can take as declared: NumPy infers one from the
values (``object`` for ``2**64`` or ``None``, ``<U30`` for a 30-character
text), and so does pandas (``object``, or ``float64`` for an integer column
with a missing value). The rule (docs/privacy.md, "Input data and their
dtypes"): every column of a list, tuple or pandas object becomes JAX's
default float dtype, element by element; an element that is not a real
number becomes NaN, a record that is then left out of the step like any
record whose gradient is not finite. Arrays keep their own (declared) dtype.

Neighbour tests (``tests/_neighbours.py``): ``DPSVI.run`` and
``DPSVI.update`` (with ``evaluate``) on data sets that differ in one record,
that record holding ``2**64``, a 30-character text or ``None``, given as
lists and as a pandas DataFrame and Series: the same path (no exception, no
warning), identical public values (the converted dtypes and shapes, the
initial parameters), and the released gradient within its sensitivity.
Unit tests pin the element rule and the messages about list and pandas data,
which must never quote or describe a record.
"""

import contextlib
import decimal
import fractions
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer import Trace_ELBO
from numpyro.infer.autoguide import AutoDiagonalNormal

import d3p.random
from _neighbours import Release, compare, observe
from d3p._records import _records
from d3p.svi import DPSVI

#: Whole-program runs of about a minute in all: CI's slow step.
pytestmark = pytest.mark.slow

pd = pytest.importorskip("pandas")

#: Records, the changed record, C; the plate's N is the number of records.
N, CHANGED, C = 20, 3, 1.0
KEY = d3p.random.PRNGKey(11)
EPS32 = float(np.finfo(np.float32).eps)

#: The issue's three values: each chose the dtype (and so the path) before.
VALUES = {"2**64": 2**64, "text30": "t" * 30, "None": None}


def default_float():
    return jnp.result_type(float)


# ------------------------------------------------------------------ models


def columns_model(x1, x2, ys, N):
    """Logistic regression on two feature columns (lists or Series)."""
    w = numpyro.sample("w", dist.Normal(0.0, 2.0).expand([2]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 2.0))
    with numpyro.plate("data", N, subsample_size=x1.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=w[0] * x1 + w[1] * x2 + b), obs=ys)


def table_model(xs, ys, N):
    """Logistic regression on a table of two features (a DataFrame)."""
    w = numpyro.sample("w", dist.Normal(0.0, 2.0).expand([2]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 2.0))
    with numpyro.plate("data", N, subsample_size=xs.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=xs @ w + b), obs=ys)


def base_columns():
    """The records as plain Python values: a float feature, a 0/1 integer
    feature and a 0/1 integer response."""
    rng = np.random.default_rng(5)
    x1 = [float(v) for v in rng.normal(0.0, 1.0, N)]
    x2 = [int(v) for v in rng.integers(0, 2, N)]
    ys = [int(v) for v in rng.integers(0, 2, N)]
    return x1, x2, ys


def list_data(changed=None, where="ys"):
    """``(args, model)``: the columns as lists, record CHANGED of ``where`` set
    to ``changed`` (a key of VALUES) if given."""
    x1, x2, ys = base_columns()
    columns = {"x1": x1, "x2": x2, "ys": ys}
    if changed is not None:
        columns[where][CHANGED] = VALUES[changed]
    return (columns["x1"], columns["x2"], columns["ys"]), columns_model


def pandas_data(changed=None, where="ys"):
    """``(args, model)``: a DataFrame of the features and a Series of the
    response, built from Python values as a user's frame is (pandas infers
    the dtypes), record CHANGED of column ``where`` set to ``changed``."""
    x1, x2, ys = base_columns()
    columns = {"x1": x1, "x2": x2, "ys": ys}
    if changed is not None:
        columns[where][CHANGED] = VALUES[changed]
    frame = pd.DataFrame({"x1": columns["x1"], "x2": columns["x2"]})
    return (frame, pd.Series(columns["ys"], name="y")), table_model


def array_data(changed=None, where="x1"):
    """``(args, model)``: the columns as float64 NumPy arrays (declared), record
    CHANGED of ``where`` set to ``changed`` (a float; beyond float32's range
    it becomes inf when JAX canonicalises the array)."""
    columns = dict(zip(("x1", "x2", "ys"), (np.array(c, np.float64) for c in base_columns())))
    if changed is not None:
        columns[where][CHANGED] = changed
    return (columns["x1"], columns["x2"], columns["ys"]), columns_model


DATA = {"list": list_data, "pandas": pandas_data, "float64 array": array_data}


def converted(args):
    """The public facts of the converted data: each leaf's dtype and shape."""
    leaves, _, size = _records(args, {})
    return {"size": size, "leaves": [(str(x.dtype), tuple(x.shape)) for x in leaves]}


def make_svi(model, optim_step, dp_scale):
    """A fresh DPSVI for each run: each traces (and logs) the same way."""
    return DPSVI(model, AutoDiagonalNormal(model), numpyro.optim.SGD(optim_step), Trace_ELBO(),
                 clipping_threshold=C, dp_scale=dp_scale, N=N)


# ------------------------------------------------------------- DPSVI.run


def run_release(args, model):
    """Two full-batch steps with σ = 1 and step size 0: the parameters stay
    the initial ones, which must not depend on a record."""
    svi = make_svi(model, 0.0, 1.0)
    result = svi.run(KEY, 2, *args, batch_size=N, sampling="fixed", progress_bar=False, target_delta=1e-3)
    return Release(
        public={"converted": converted(args), "params": result.params,
                "optim_state": result.state.optim_state, "rng_key": result.state.rng_key,
                "privacy": {k: getattr(result, k) for k in ("epsilon", "delta", "sigma", "q", "num_steps")}},
        # run's losses are computed from the un-noised data: NOT private
        # (DPSVI "Formal guarantees", DPSVI.run ":return:")
        not_private={"losses": result.losses})


# ---------------------------------------------------------- DPSVI.update


def update_release(args, model):
    """One step with σ = 0 and SGD(1): the change of the parameters is the
    released gradient (the noisy sum times N / B = 1), within 2 C of the
    neighbour's. (``evaluate`` is NOT private, its path included: NumPyro's
    argument checks see its concrete values; it converts as ``update`` does,
    through ``_records``, whose result is compared here.)"""
    svi = make_svi(model, 1.0, 0.0)
    placeholder = [np.zeros(np.shape(a), np.float32) for a in args]
    state = svi.init(KEY, *placeholder)
    old = svi.get_params(state)
    new_state, loss = svi.update(state, *args)
    new = svi.get_params(new_state)
    as64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    step = jax.tree.map(lambda a, b: as64(a) - as64(b), old, new)
    size = math.sqrt(sum(float(np.sum((np.abs(as64(a)) + np.abs(as64(b))) ** 2))
                         for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(new))))
    return Release(
        public={"converted": converted(args), "rng_key": new_state.rng_key},
        noisy={"step": step},
        # update's loss is computed from the un-noised data: NOT private
        # (DPSVI.update ":return:")
        not_private={"loss": loss},
        sensitivity=2 * C, tolerance=4 * EPS32 * size)


ENTRY_POINTS = {"run": (run_release, ["losses"]), "update": (update_release, ["loss"])}

_observed = {}


def check(entry, form, value, where):
    release, not_private = ENTRY_POINTS[entry]
    key = (entry, form)
    if key not in _observed:   # D, the same for every changed record
        _observed[key] = observe(lambda: release(*DATA[form]()))
    d = _observed[key]
    d2 = observe(lambda: release(*DATA[form](value, where)))
    compare(d, d2, not_private=not_private, what=f"{entry} {form} {where}={value}")
    # lists and frames of any values are valid data: nothing raised or warned
    # (an error identical on D and D' could still quote another record)
    for o in (d, d2):
        assert o.error is None and not o.warnings, (o.error, o.warnings)


@pytest.mark.parametrize("value", sorted(VALUES))
@pytest.mark.parametrize("form", ["list", "pandas"])
@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_neighbouring_response(entry, form, value):
    check(entry, form, value, "ys")


def test_neighbouring_float64_arrays_in_update():
    """An array keeps its declared dtype, canonicalised (float32 unless x64):
    a record beyond float32's range becomes inf silently (NumPy's cast would
    warn "overflow encountered in cast" for that record alone)."""
    check("update", "float64 array", 1e300, "x1")


@pytest.mark.parametrize("value", sorted(VALUES))
@pytest.mark.parametrize("form", ["list", "pandas"])
def test_neighbouring_feature_in_update(form, value):
    """The changed record in an integer feature column (pandas infers
    ``int64`` for it in D, ``float64`` or ``object`` in D')."""
    check("update", form, value, "x2")


# ------------------------------------------------------- the element rule


def _one_column(values):
    (leaf,), _, size = _records((list(values),), {})
    assert size == len(values) and leaf.shape == (len(values),) and leaf.dtype == default_float()
    return leaf


@contextlib.contextmanager
def _no_warnings():
    """Asserts that the block warns nothing."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    assert not caught, [str(w.message) for w in caught]


ELEMENTS = [  # (record, float64 value it becomes before the cast to the default float)
    (True, 1.0), (False, 0.0), (np.bool_(True), 1.0), (3, 3.0), (-2**64, -2.0**64), (2**64, 2.0**64),
    (10**400, math.inf), (-10**400, -math.inf), (0.25, 0.25), (1e300, 1e300), (np.float16(0.5), 0.5),
    (np.int64(-7), -7.0), (np.uint64(2**64 - 1), 2.0**64), (decimal.Decimal("1.5"), 1.5),
    (decimal.Decimal("sNaN"), math.nan), (fractions.Fraction(1, 4), 0.25), (np.asarray(2.0), 2.0),
    (math.nan, math.nan), (math.inf, math.inf),
    (None, math.nan), ("t" * 30, math.nan), ("1.5", math.nan), (b"1", math.nan), (1 + 2j, math.nan),
    ([1.0], math.nan), ((1.0, 2.0), math.nan), ({"a": 1.0}, math.nan), (object(), math.nan),
    (np.datetime64("2020-01-01"), math.nan), (np.timedelta64(3, "D"), math.nan), (np.str_("x"), math.nan),
]


@pytest.mark.parametrize("record, expected", ELEMENTS, ids=[repr(r)[:20] for r, _ in ELEMENTS])
def test_the_element_rule(record, expected):
    """Each record of a list becomes the default float by itself: real numbers
    the nearest float (beyond the range: inf of its sign), anything else NaN;
    the dtype, the shape and the other records never change, no warning."""
    with _no_warnings():
        column = _one_column([0.5, record, -1.0])
    with np.errstate(over="ignore"):
        want = np.array([0.5, expected, -1.0], np.float64).astype(default_float())
    np.testing.assert_array_equal(column, want)


PANDAS_COLUMNS = {  # a column of a user's frame: how pandas typed it depends on the values
    "int64": lambda: pd.Series([1, 2, 3, 4]),
    "uint64": lambda: pd.Series([1, 2, 3, 2**64 - 1], dtype=np.uint64),
    "float64 with NaN": lambda: pd.Series([1, 2, None, 4]),
    "object (2**64)": lambda: pd.Series([1, 2, 2**64, 4]),
    "object (text)": lambda: pd.Series([1, 2, "t" * 30, 4]),
    "bool": lambda: pd.Series([True, False, True, True]),
    "object (bool and None)": lambda: pd.Series([True, False, None, True]),
    "Int64 with NA": lambda: pd.Series([1, 2, None, 4], dtype="Int64"),
    "boolean with NA": lambda: pd.Series([True, None, False, True], dtype="boolean"),
    "string": lambda: pd.Series(["a", "b", None, "c"], dtype="string"),
    "category": lambda: pd.Series([1, 2, 1, 2]).astype("category"),
    "datetime64": lambda: pd.Series(pd.to_datetime(["2020-01-01"] * 4)),
    "float32 1e300": lambda: pd.Series([1.0, 2.0, 1e300, 4.0]),
}


@pytest.mark.parametrize("name", sorted(PANDAS_COLUMNS))
def test_pandas_columns_become_the_default_float(name):
    """Every pandas column, Series, DataFrame column or Index, whatever dtype
    pandas inferred for it, becomes the default float by the element rule:
    the same dtype and shape for all; the user's object is not modified."""
    series = PANDAS_COLUMNS[name]()
    frame = pd.DataFrame({"a": series, "b": np.arange(4.0)})
    copies = series.copy(), frame.copy()
    with _no_warnings():
        leaves, _, size = _records((series, frame), {"i": pd.Index(series)})
    assert size == 4
    assert [(x.dtype, x.shape) for x in leaves] == [(default_float(), (4,)), (default_float(), (4, 2)),
                                                    (default_float(), (4,))]
    want = _one_column(list(series.astype(object)))  # the element rule, record by record
    for got in (leaves[0], leaves[1][:, 0], leaves[2]):
        np.testing.assert_array_equal(got, want)
    pd.testing.assert_series_equal(series, copies[0])
    pd.testing.assert_frame_equal(frame, copies[1])


def test_lists_of_arrays_are_containers_and_lists_of_records_columns():
    """A list whose every element holds records (an array, a frame, a dict,
    such a list) is a container of arguments; any other list is one column,
    its elements the records, whatever they are."""
    xs = np.zeros((4, 2), np.float32)
    leaves, treedef, size = _records(([xs, {"a": np.ones(4)}],), {"ys": [1, None, "t", [2]]})
    assert size == 4 and len(leaves) == 3
    assert [x.shape for x in leaves] == [(4, 2), (4,), (4,)]
    np.testing.assert_array_equal(leaves[2], np.array([1.0, np.nan, np.nan, np.nan], default_float()))
    args, kwargs = jax.tree.unflatten(treedef, leaves)
    assert isinstance(args[0], list) and isinstance(args[0][1], dict)
    # a list of JAX scalars (e.g. traced under jit) is a container of scalars: refused as such
    with pytest.raises(ValueError, match=r"(?s)args\[0\]\[0\].*got a scalar \(ArrayImpl\)"):
        _records(([jnp.asarray(1.0), jnp.asarray(2.0)],), {})


def test_arrays_keep_their_dtype_and_convert_silently():
    """An array's dtype is its declaration: kept (canonicalised as JAX does),
    a value beyond the canonical dtype cast silently (inf), the array not modified."""
    big = np.array([1.0, 1e300, 3.0])
    original = big.copy()
    with _no_warnings():
        leaves, _, _ = _records((big, np.array([1, 2, 3], np.int16), np.array([True, False, True])), {})
    assert [x.dtype for x in leaves] == [default_float(), np.dtype(np.int16), np.dtype(bool)]
    if default_float() == np.float32:
        assert leaves[0][1] == np.inf
    np.testing.assert_array_equal(big, original)


def test_messages_about_list_and_pandas_data_quote_no_record():
    """The errors that remain for lists and frames are about their structure
    (lengths, scalars, types) and name the argument, never a value; an array
    of text is named by its kind, not by NumPy's item size (the longest text)."""
    secret = "s" * 30
    svi = make_svi(columns_model, 1.0, 0.0)
    state = svi.init(KEY, *[np.zeros(5, np.float32)] * 3)
    cases = [
        (ValueError, lambda: svi.update(state, [0.5] * 5, [1.0] * 5, [secret, 1.0, 2.0, 3.0])),  # 4 rows
        (ValueError, lambda: svi.update(state, [0.5] * 5, pd.Series([1.0] * 5), pd.DataFrame({"y": [secret]}))),
        (ValueError, lambda: svi.update(state, [0.5] * 5, [1.0] * 5, 12345.678)),
        (TypeError, lambda: svi.update(state, [0.5] * 5, [1.0] * 5, np.array([secret] * 5))),
        (TypeError, lambda: svi.update(state, [0.5] * 5, [1.0] * 5, np.array([secret] * 5, object))),
    ]
    for kind, call in cases:
        with pytest.raises(kind) as info:
            call()
        message = str(info.value)
        assert "args[2]" in message
        for value in (secret, "12345", "U30", "<U"):
            assert value not in message, message
