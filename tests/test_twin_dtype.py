"""Tests of d3p.twin: the dtypes of synthetic data come from the schema, never from the data's values.

pandas stores an integer column with one missing value as ``float64`` and a
boolean one as ``object``; a dtype copied from the private table would reveal
that a record has a missing value, outside the twin's (ε, δ) guarantee.
"""

import warnings

import numpy as np
import pandas as pd
import pytest

import d3p.random
import d3p.twin as twin
from d3p.twin import ColumnSpec, Schema, TwinInputError, infer_schema


def neighbouring_tables(n=40, seed=0):
    """Two tables that differ only in one missing value per column (row 5)."""
    rng = np.random.default_rng(seed)
    a = pd.DataFrame({
        "k": rng.poisson(3, n),
        "k_typed": rng.poisson(3, n),
        "b": rng.uniform(size=n) < 0.5,
        "b_typed": rng.uniform(size=n) < 0.5,
        "c": rng.choice([1, 2, 3], n),
        "s": pd.Series(rng.choice(["x", "y"], n), dtype="str"),
        "r": rng.normal(size=n),
    })
    b = a.astype({"k": float, "k_typed": float, "b": object, "b_typed": object, "c": float})
    b.loc[5, :] = None
    assert list(a.dtypes) != list(b.dtypes)  # what pandas would leak
    return a, b


def public_schema():
    """Complete except for ``dtype`` in some columns (which must then not be read from the data)."""
    return {"columns": [
        {"name": "k", "kind": "count", "lower": 0, "upper": 10, "nullable": True, "distribution": "poisson"},
        {"name": "k_typed", "kind": "count", "dtype": "int64", "lower": 0, "upper": 10, "nullable": True,
         "distribution": "poisson"},
        {"name": "b", "kind": "boolean", "nullable": True, "distribution": "bernoulli"},
        {"name": "b_typed", "kind": "boolean", "dtype": "bool", "nullable": True, "distribution": "bernoulli"},
        {"name": "c", "kind": "categorical", "levels": [1, 2, 3], "nullable": True, "distribution": "categorical"},
        {"name": "s", "kind": "categorical", "levels": ["x", "y"], "nullable": True, "distribution": "categorical"},
        {"name": "r", "kind": "real", "lower": -4, "upper": 4, "nullable": True, "distribution": "normal"},
    ]}


EXPECTED = {"k": "Int64", "k_typed": "Int64", "b": "boolean", "b_typed": "boolean", "c": "Int64",
            "s": "str", "r": "float64"}


def strict_infer(data, schema):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing may be read from the data
        return infer_schema(data, schema)


def test_schema_from_public_fields_is_the_same_for_neighbouring_tables():
    a, b = neighbouring_tables()
    sa, sb = strict_infer(a, public_schema()), strict_infer(b, public_schema())
    assert sa == sb and sa.inferred_fields() == {}
    assert {c.name: c.output_dtype for c in sa.columns} == EXPECTED


@pytest.mark.slow   # two twin fits; infer_schema and decode, which set the dtypes, are tested above and below
def test_synthetic_dtypes_do_not_reveal_a_missing_value():
    """End to end: twins of two tables that differ in one missing value, with a
    public schema, produce synthetic tables with identical dtypes."""
    # one column keeps the compilation short; the other kinds go through the same
    # infer_schema and decode as in the tests above and below
    names = ["k"]
    schema = {"columns": [c for c in public_schema()["columns"] if c["name"] in names]}
    dtypes = []
    for data in neighbouring_tables():
        with warnings.catch_warnings():
            warnings.simplefilter("error", twin.SchemaInferenceWarning)
            tw = twin.fit(data[names], 1.0, rng_key=d3p.random.PRNGKey(0), schema=schema, num_steps=2,
                          q=0.5, num_components=1, progress_bar=False)
        dtypes.append(dict(tw.generate(30, 0).dtypes.astype(str)))
    assert dtypes[0] == dtypes[1] == {n: EXPECTED[n] for n in names}


@pytest.mark.parametrize("spec", [
    ColumnSpec("k", "count", "int64", True, lower=0, upper=5, distribution="poisson"),
    ColumnSpec("k", "count", "int32", True, lower=0, upper=5, distribution="normal"),
    ColumnSpec("k", "count", "uint8", True, lower=0, upper=5, distribution="lognormal"),
    ColumnSpec("r", "real", "int64", True, lower=0, upper=5, distribution="normal"),
    ColumnSpec("r", "real", "float64", True, lower=0, upper=5, distribution="normal"),
    ColumnSpec("b", "boolean", "bool", True, distribution="bernoulli"),
    ColumnSpec("b", "boolean", "object", True, distribution="bernoulli"),
    ColumnSpec("c", "categorical", "int64", True, levels=(1, 2), distribution="categorical"),
    ColumnSpec("c", "categorical", "str", True, levels=("u", "v"), distribution="categorical"),
    ColumnSpec("c", "categorical", "category", True, levels=("u", "v"), distribution="categorical"),
    ColumnSpec("c", "categorical", "float64", True, levels=(1.5, 2.0), distribution="categorical"),
])
def test_decoded_dtype_does_not_depend_on_the_codes(spec):
    """With and without a missing code, with codes at either end of the range."""
    outputs = [spec.decode(np.array(codes, float))
               for codes in ([0.0, 0.0], [0.0, np.nan], [0.3, 1.0], [np.nan, np.nan])]
    dtypes = {str(s.dtype) for s in outputs}
    assert len(dtypes) == 1, dtypes
    if spec.dtype != "category":
        assert dtypes == {str(pd.api.types.pandas_dtype(spec.output_dtype))}
    assert outputs[1].isna().tolist() == [False, True]


def test_output_dtype_widens_numpy_dtypes_of_nullable_columns_only():
    def spec(dtype, nullable):
        return ColumnSpec("k", "count", dtype, nullable, lower=0, upper=5, distribution="poisson")

    assert spec("int64", True).output_dtype == "Int64"
    assert spec("uint16", True).output_dtype == "UInt16"
    assert spec("int64", False).output_dtype == "int64"
    assert spec("float64", True).output_dtype == "float64"
    assert spec("Int64", False).output_dtype == "Int64"
    b = ColumnSpec("b", "boolean", "bool", True, distribution="bernoulli")
    assert b.output_dtype == "boolean"


def test_non_nullable_integer_column_keeps_its_numpy_dtype():
    spec = ColumnSpec("k", "count", "int64", False, lower=0, upper=5, distribution="poisson")
    # a missing code where none is allowed decodes to a valid value of the same dtype
    assert str(spec.decode(np.array([1.0, np.nan])).dtype) == "int64"


def test_a_dtype_that_cannot_hold_the_levels_fails_whatever_the_codes():
    """Whether the cast works is decided by the schema (all levels), not by the values drawn."""
    spec = ColumnSpec("c", "categorical", "int64", False, levels=("1", "x"), distribution="categorical")
    for codes in ([0.0, 0.0], [0.0, 1.0]):
        with pytest.raises(TwinInputError, match=r"'c'.*'int64'"):
            spec.decode(np.array(codes))


@pytest.mark.parametrize("frame, want", [
    (pd.DataFrame({"x": [1.0, 2.5]}), "float64"),
    (pd.DataFrame({"x": [1, 2]}), "int64"),
    (pd.DataFrame({"x": [1.0, None]}), "float64"),
    (pd.DataFrame({"x": pd.Series([True, None], dtype=object)}), "bool"),
    (pd.DataFrame({"x": pd.Series(["a", None], dtype=object)}), "str"),
    (pd.DataFrame({"x": pd.Categorical(["a", "b"])}), "category"),
])
def test_inferred_dtype_follows_kind_and_levels(frame, want):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", twin.SchemaInferenceWarning)
        assert infer_schema(frame)["x"].dtype == want


def test_default_dtype_of_categorical_comes_from_its_levels():
    s = Schema((ColumnSpec("c", "categorical", None, True, levels=(1, 2), distribution="categorical"),))
    # an int column with a missing value is float64 in pandas; the levels decide
    data = pd.DataFrame({"c": [1.0, None, 2.0]})
    assert strict_infer(data, s)["c"].dtype == "int64"
    mixed = Schema((ColumnSpec("c", "categorical", None, False, levels=(1, "a"), distribution="categorical"),))
    assert strict_infer(pd.DataFrame({"c": [1, 1]}), mixed)["c"].dtype == "object"
