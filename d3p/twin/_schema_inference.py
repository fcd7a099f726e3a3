"""Completing a twin schema from the data: the kinds, levels, bounds and more that it leaves out.

:func:`infer_schema` reads from the private data, without differential
privacy, exactly the fields a given schema leaves out, records them in each
column's ``inferred`` and warns (:class:`SchemaInferenceWarning`,
:func:`inference_message`). The rules are listed in :func:`infer_schema`.
The public names are imported from :mod:`d3p.twin.schema`.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import pandas as pd

from d3p import _validate
from d3p.twin._schema_common import (
    DEFAULT_MAX_LEVELS,
    HURDLE_MIN_SHARE,
    MAX_DECIMALS,
    NUMERIC_MAX_LEVELS,
    POISSON_MAX_RANGE,
    SchemaInferenceWarning,
    TwinInputError,
    _jsonable,
    _level_key,
    check_frame,
)
from d3p.twin._schema_types import ColumnSpec, Schema


def _infer_kind(name: str, col: pd.Series) -> Tuple[str, bool]:
    """(kind, whether the values had to be inspected)."""
    dtype = col.dtype
    if isinstance(dtype, pd.CategoricalDtype):
        return "categorical", False
    if pd.api.types.is_bool_dtype(dtype):
        return "boolean", False
    if pd.api.types.is_integer_dtype(dtype) or pd.api.types.is_float_dtype(dtype):
        return _numeric_kind(name, col.dropna()), True
    if pd.api.types.is_datetime64_any_dtype(dtype) or pd.api.types.is_timedelta64_dtype(dtype):
        raise TwinInputError(
            f"Column {name!r} has dtype {dtype}, which twins do not support; convert it to numbers "
            "(e.g. days since a public date) or drop it."
        )
    if pd.api.types.is_complex_dtype(dtype):
        raise TwinInputError(f"Column {name!r} has complex dtype {dtype}, which twins do not support.")
    # object / string: look at the values
    values = col.dropna()
    py = values.tolist()
    if py and all(isinstance(v, (bool, np.bool_)) for v in py):
        return "boolean", True
    if py and all(isinstance(v, str) and v.strip().lower() in ("true", "false") for v in py):
        return "boolean", True
    parsed = pd.to_numeric(values, errors="coerce")
    ok = int(parsed.notna().sum())
    if ok == len(values) and ok > 0:
        return _numeric_kind(name, parsed), True
    if ok > 0 and ok >= 0.5 * len(values):
        bad = values[parsed.isna()]
        shown = sorted({str(v) for v in bad.tolist()})[:3]
        raise TwinInputError(
            f"Column {name!r} looks numeric ({ok} of {len(values)} values are numbers) but has "
            f"{len(bad)} non-numeric value(s), e.g. {shown}. Twins do not guess: fix or remove them, "
            "treat them as missing (CLI: --na-values), or declare the column categorical in the "
            "schema."
        )
    return "categorical", True


def _numeric_kind(name: str, values: pd.Series) -> str:
    """The kind of a numeric column from its (present) values: ``boolean`` if they
    are 0 and 1, ``categorical`` with at most :data:`NUMERIC_MAX_LEVELS` distinct
    values, ``count`` if they are all integers, else ``real``."""
    x = _numeric_values(name, values)
    distinct = np.unique(x)
    if distinct.size == 2 and distinct[0] == 0 and distinct[1] == 1:
        return "boolean"
    if distinct.size <= NUMERIC_MAX_LEVELS:
        return "categorical"
    if np.all(distinct == np.round(distinct)):
        return "count"
    return "real"


def _numeric_values(name: str, values: pd.Series) -> np.ndarray:
    if pd.api.types.is_bool_dtype(values.dtype):
        return values.to_numpy(dtype=np.float64)
    if pd.api.types.is_numeric_dtype(values.dtype):
        x = values.to_numpy(dtype=np.float64, na_value=np.nan)
    else:
        parsed = pd.to_numeric(values, errors="coerce")
        bad = parsed.isna().to_numpy()
        if bad.any():
            shown = sorted({str(v) for v in values[bad].tolist()})[:3]
            raise TwinInputError(
                f"Column {name!r} is numeric but has {int(bad.sum())} non-numeric value(s), e.g. "
                f"{shown}. Fix or remove them, treat them as missing (CLI: --na-values), or declare "
                "the column categorical in the schema."
            )
        x = parsed.to_numpy(dtype=np.float64)
    if not np.all(np.isfinite(x)):
        raise TwinInputError(f"Column {name!r} has infinite values; replace them or make them missing.")
    return x


def _infer_column(spec: ColumnSpec, col: pd.Series, max_levels: int) -> ColumnSpec:
    name = spec.name
    kw = dataclasses.asdict(spec)
    kw["levels"] = spec.levels
    inferred = list(spec.inferred)
    if spec.missing_fields() in ([], ["dtype"]):
        return _with_default_dtype(spec, col)
    all_missing = bool(col.isna().all())
    if all_missing:
        raise TwinInputError(
            f"Column {name!r} is entirely missing: nothing can be learnt about it. Drop the column, "
            "or describe it completely in the schema (kind, levels or bounds, nullable: true)."
        )
    kind = spec.kind
    if kind is None:
        kind, looked = _infer_kind(name, col)
        kw["kind"] = kind
        if looked:
            inferred.append("kind")
    if spec.nullable is None:
        kw["nullable"] = bool(col.isna().any())
        inferred.append("nullable")
    present = col.dropna()
    if kind == "categorical" and spec.levels is None:
        kw["levels"], ordered = _infer_levels(name, col, present, max_levels)
        if spec.other is not None and _level_key(spec.other) not in set(map(_level_key, kw["levels"])):
            kw["levels"] = kw["levels"] + (spec.other,)  # the declared catch-all level is always a level
        if ordered is not None:
            kw["ordered"] = ordered
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in kw["levels"]):
            kw["ordered"] = True  # numbers: their order is the levels' order
        inferred.append("levels")
    if kind in ("real", "count") and (spec.lower is None or spec.upper is None):
        x = _numeric_values(name, present)
        if spec.lower is None:
            kw["lower"] = float(np.min(x))
            inferred.append("lower")
        if spec.upper is None:
            kw["upper"] = float(np.max(x))
            inferred.append("upper")
        if kind == "count":
            kw["lower"] = float(math.floor(kw["lower"]))
            kw["upper"] = float(math.ceil(kw["upper"]))
    if spec.distribution is None:
        kw["distribution"], looked = _infer_distribution(name, kind, kw["lower"], kw["upper"], present)
        if looked:
            inferred.append("distribution")
    if kind == "real" and spec.decimals is None:
        kw["decimals"] = _infer_decimals(_numeric_values(name, present))
        inferred.append("decimals")
        for bound in ("lower", "upper"):  # a minimum or maximum read from the data, at that precision
            if getattr(spec, bound) is None:
                kw[bound] = float(np.round(kw[bound], kw["decimals"]))
    kw["inferred"] = tuple(dict.fromkeys(inferred))
    return _with_default_dtype(ColumnSpec(**kw), col)


def _infer_levels(name: str, col: pd.Series, present: pd.Series, max_levels: int):
    """``(levels, ordered)`` of a categorical column: a ``category`` dtype's categories
    and order, else the sorted distinct values (``ordered`` None)."""
    if isinstance(col.dtype, pd.CategoricalDtype):
        levels, ordered = [_jsonable(v) for v in col.cat.categories.tolist()], bool(col.cat.ordered)
    else:
        uniq = [_jsonable(v) for v in present.unique().tolist()]
        ordered = None
        try:
            levels = sorted(uniq)
        except TypeError:
            levels = sorted(uniq, key=str)
    if len(levels) > max_levels:
        raise TwinInputError(
            f"Column {name!r} has {len(levels)} distinct values, more than max_levels={max_levels}. "
            "A categorical with this many levels cannot be learnt usefully under differential "
            "privacy, and its list of levels would reveal rare values (identifiers, free text). "
            "Drop the column, group its values into fewer categories, or declare its levels in "
            "the schema."
        )
    return tuple(levels), ordered


def _infer_distribution(name: str, kind: str, lower, upper, present: pd.Series) -> Tuple[str, bool]:
    """``(distribution, whether the values were read)``: fixed for categorical and
    boolean columns; ``hurdle`` for a real or count column with at least
    :data:`HURDLE_MIN_SHARE` of its values at ``lower`` (a point mass there);
    otherwise ``negbinomial`` for counts with a small range, ``lognormal`` for a
    non-negative column whose median lies in the lowest tenth of its range,
    else ``normal``."""
    if kind == "categorical":
        return "categorical", False
    if kind == "boolean":
        return "bernoulli", False
    if upper == lower:
        return ("negbinomial" if kind == "count" else "normal"), False
    x = np.clip(_numeric_values(name, present), lower, upper)
    if np.mean(x == lower) >= HURDLE_MIN_SHARE:
        return "hurdle", True
    if kind == "count" and upper - lower <= POISSON_MAX_RANGE:
        return "negbinomial", True
    if not lower >= 0:
        return "normal", True
    return ("lognormal" if float(np.median(x)) - lower < 0.1 * (upper - lower) else "normal"), True


def _infer_decimals(x: np.ndarray) -> int:
    """The fewest decimals (at most :data:`MAX_DECIMALS`) that every value of
    ``x`` has, up to twice the float spacing at the value (``0.1 + 0.2`` has
    one decimal): the precision of the column as it was written."""
    if x.size == 0:
        return 0
    tolerance = 2.0 * np.spacing(np.abs(x))
    for decimals in range(MAX_DECIMALS):
        with np.errstate(all="ignore"):
            if np.all(np.abs(np.round(x, decimals) - x) <= tolerance):
                return decimals
    return MAX_DECIMALS


def _default_dtype(kind: str, levels: Optional[Tuple[Any, ...]], category: bool) -> str:
    """The dtype a column gets when its schema leaves it out.

    A function of the column's kind and levels, plus, for a categorical,
    whether the table declares it with pandas' ``category`` dtype (a choice of
    whoever built the table; pandas never derives it from the values). It
    never looks at the values: pandas turns an integer column with one
    missing value into ``float64`` and a boolean one into ``object``, so a
    dtype read from the data would reveal missing values. Nullable integer and
    boolean columns come out as ``Int64``/``boolean`` (see
    :attr:`ColumnSpec.output_dtype`).
    """
    if kind == "real":
        return "float64"
    if kind == "count":
        return "int64"
    if kind == "boolean":
        return "bool"
    if category:
        return "category"
    levels = tuple(levels or ())
    if levels and all(isinstance(v, bool) for v in levels):
        return "bool"
    if levels and all(isinstance(v, int) and not isinstance(v, bool) for v in levels):
        return "int64"
    if levels and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in levels):
        return "float64"
    if levels and all(isinstance(v, str) for v in levels):
        return "str"
    return "object"

def _with_default_dtype(spec: ColumnSpec, col: pd.Series) -> ColumnSpec:
    if spec.dtype is not None:
        return spec
    category = isinstance(col.dtype, pd.CategoricalDtype)
    dtype = _default_dtype(spec.kind, spec.levels, category)
    if "kind" in spec.inferred and spec.kind in ("boolean", "count") and _is_plain_number(col.dtype):
        # a kind read from numeric values: the column keeps its type (a 0/1 float
        # column stays float); it was read from the data, as the kind was
        dtype = "int64" if pd.api.types.is_integer_dtype(col.dtype) else "float64"
    return dataclasses.replace(spec, dtype=dtype)


def _is_plain_number(dtype) -> bool:
    """Whether ``dtype`` is a (non-boolean) integer or float dtype."""
    return ((pd.api.types.is_integer_dtype(dtype) or pd.api.types.is_float_dtype(dtype))
            and not pd.api.types.is_bool_dtype(dtype))


def infer_schema(
    data: pd.DataFrame,
    schema: Optional[Union[Schema, Mapping, Sequence[ColumnSpec]]] = None,
    *,
    max_levels: int = DEFAULT_MAX_LEVELS,
    warn: bool = True,
) -> Schema:
    """Complete a (possibly empty) schema from the data, warning about what was read.

    Rules, for fields the given schema leaves out:

    * kind from the dtype: ``category`` and text → categorical, ``bool`` →
      boolean, integer → count, float → real. Text columns whose values are
      all ``True``/``False`` are boolean, all numbers are real; a text column
      that is mostly numbers but has some text is an error (no guessing);
    * ``nullable``: whether the column has any missing value;
    * ``levels``: a ``category`` dtype's categories, else the sorted distinct
      values; more than ``max_levels`` is an error;
    * ``lower``/``upper``: the minimum and maximum (counts: integers);
    * ``distribution``: ``poisson`` for counts with a range of at most
      :data:`POISSON_MAX_RANGE`, else ``lognormal`` for non-negative columns
      whose median is in the lowest tenth of their range, else ``normal``;
    * ``dtype``: derived from the column's kind and levels, never from its
      values: ``float64`` (real), ``int64`` (count), ``bool`` (boolean); a
      categorical keeps pandas' ``category`` dtype if the table declares it,
      else its levels decide (``str``, ``int64``, ``float64``, ``bool`` or
      ``object``). A nullable column's integer or ``bool`` dtype comes out as
      ``Int64``/``boolean`` (:attr:`ColumnSpec.output_dtype`). Two tables
      that differ in a missing value thus get the same dtypes (pandas would
      give an integer column with a missing value ``float64``).

    Every field that is taken from the data is recorded in the
    column's ``inferred`` tuple, and listed in a :class:`SchemaInferenceWarning`
    (if ``warn``): it is **not** covered by the twin's (ε, δ) guarantee. A
    schema returned by an earlier call keeps its record and raises no new
    warning.

    :param pandas.DataFrame data: the private table.
    :param schema: a :class:`Schema` (or its dict form) with the fields known
        from public information; columns it does not mention are inferred
        completely. Columns it mentions must exist in ``data``.
    :param int max_levels: the largest number of levels accepted for a
        categorical column read from the data (default 50).
    :param bool warn: issue the warning.
    :return: a complete :class:`Schema` with the data's columns in order.
    :raises TwinInputError: on unusable data (no rows or columns, duplicate
        names, a column entirely missing, too many levels, text in a numeric
        column, unsupported dtypes).

    **Formal guarantees.** None: this function reads the private data without
    differential privacy. What it reads is exactly what the returned schema's
    ``inferred`` fields list, plus the number of rows and the columns' pandas
    dtypes (which set the kind of a column whose schema leaves it out, and
    keep a categorical's ``category`` dtype); nothing else about the data
    enters a twin except through DP-VI.
    """
    max_levels = _validate.integer("max_levels", max_levels, minimum=1)
    data = _with_column_names(data)
    schema = _as_schema(schema, list(data.columns))
    given = {c.name: c for c in schema.columns} if schema is not None else {}
    result = Schema(tuple(_infer_column(given.get(n, ColumnSpec(n)), data[n], max_levels) for n in data.columns))
    if warn:
        _warn_inferred(result, schema)
    return result


def _with_column_names(data: pd.DataFrame) -> pd.DataFrame:
    """``data`` with string column names, after checking it has rows, columns
    and no duplicate names."""
    check_frame("data", data)
    if data.shape[1] == 0:
        raise TwinInputError("The data have no columns.")
    if data.shape[0] == 0:
        raise TwinInputError("The data have no rows (records).")
    names = [c if isinstance(c, str) else str(c) for c in data.columns]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise TwinInputError(f"The data have duplicate column names: {dup}.")
    return data.set_axis(names, axis=1)


def _as_schema(schema, names) -> Optional[Schema]:
    """A given schema (a :class:`Schema`, its dict or column specs) as a :class:`Schema`
    whose columns are all among ``names``; None stays None."""
    if schema is None:
        return None
    if isinstance(schema, Mapping):
        schema = Schema.from_dict(schema)
    elif not isinstance(schema, Schema):
        schema = Schema(tuple(schema))
    unknown = [n for n in schema.names if n not in names]
    if unknown:
        raise TwinInputError(f"The schema describes column(s) {unknown} that are not in the data.")
    return schema


def _warn_inferred(result: Schema, given: Optional[Schema]) -> None:
    """Warn about the fields read from the data by this call (a schema inferred
    earlier keeps its record and raises no new warning)."""
    before = {c.name: set(c.inferred) for c in given.columns} if given is not None else {}
    new = {c.name: tuple(f for f in c.inferred if f not in before.get(c.name, ()))
           for c in result.columns}
    new = {k: v for k, v in new.items() if v}
    if new:
        warnings.warn(inference_message(result, new), SchemaInferenceWarning, stacklevel=3)


def inference_message(schema: Schema, fields: Optional[Mapping[str, Sequence[str]]] = None) -> str:
    """The text of the :class:`SchemaInferenceWarning` for ``schema``.

    :param Schema schema: the inferred schema.
    :param fields: ``{column: fields read}`` to report (default: ``schema.inferred_fields()``).
    """
    if fields is None:
        fields = schema.inferred_fields()
    groups = {"bounds": [], "levels": [], "nullable": [], "distribution": [], "kind": [], "decimals": []}
    for name, read in fields.items():
        c = schema[name]
        if "lower" in read or "upper" in read:
            lo = f"{c.lower:g}" if "lower" in read else "given"
            hi = f"{c.upper:g}" if "upper" in read else "given"
            groups["bounds"].append(f"{name!r} [{lo}, {hi}]")
        if "levels" in read:
            groups["levels"].append(f"{name!r} ({_validate.plural(c.num_levels, 'level')})")
        if "nullable" in read:
            groups["nullable"].append(f"{name!r}" + (" (has missing values)" if c.nullable else ""))
        if "distribution" in read:
            groups["distribution"].append(f"{name!r} ({c.distribution})")
        if "kind" in read:
            groups["kind"].append(f"{name!r} ({c.kind})")
        if "decimals" in read:
            groups["decimals"].append(f"{name!r} ({c.decimals})")
    labels = {
        "bounds": "bounds (minimum and maximum) of",
        "levels": "category levels of",
        "nullable": "whether values are missing in",
        "distribution": "distribution choice (from the median) of",
        "kind": "kind (from the values) of",
        "decimals": "decimals (the precision of the values) of",
    }
    parts = [f"{labels[k]} {', '.join(v)}" for k, v in groups.items() if v]
    return (
        "Schema information was read from the private data WITHOUT differential privacy; it is "
        "released with the twin, outside its (epsilon, delta) guarantee: "
        + "; ".join(parts)
        + ". Supply these from public knowledge in an explicit schema (d3p.twin.Schema, "
        "CLI --schema) to avoid the leak."
    )
