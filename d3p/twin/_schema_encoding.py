"""How one column's values become codes and back: the encoding of twin schemas.

The rules of :meth:`ColumnSpec.encode` and :meth:`ColumnSpec.decode` (and of
:meth:`Schema.encode` and :meth:`Schema.decode` for a whole table), applied
to a column spec: a map of each record on its own by public rules that read
the spec and that record only (see :mod:`d3p.twin.schema`). The spec's data
types (``d3p.twin._schema_types``) call these functions; this module reads
nothing of them but their fields.
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Optional

import numpy as np
import pandas as pd

from d3p.twin._schema_common import INTEGER_CODE_DISTRIBUTIONS, LOG_OFFSET, TwinInputError, _level_key


def scale(spec, x: np.ndarray) -> np.ndarray:
    """:meth:`ColumnSpec.scale`: numeric values (already clipped) to codes in [-1, 1]."""
    lo, hi = spec.lower, spec.upper
    if hi == lo:
        return np.zeros_like(x)
    u = (x - lo) / (hi - lo)
    if spec.distribution in ("lognormal", "hurdle"):
        c = LOG_OFFSET
        t = np.log(u + c)
        return 2.0 * (t - math.log(c)) / (math.log1p(c) - math.log(c)) - 1.0
    return 2.0 * u - 1.0


def scale_inverse(spec, z: np.ndarray) -> np.ndarray:
    """:meth:`ColumnSpec.scale_inverse`: codes back to numeric values in ``[lower, upper]``."""
    lo, hi = spec.lower, spec.upper
    z = np.clip(z, -1.0, 1.0)
    if hi == lo:
        return np.full_like(z, lo)
    if spec.distribution in ("lognormal", "hurdle"):
        c = LOG_OFFSET
        t = (z + 1.0) / 2.0 * (math.log1p(c) - math.log(c)) + math.log(c)
        u = np.where(z <= -1.0, 0.0, np.exp(t) - c)  # the lower bound exactly
    else:
        u = (z + 1.0) / 2.0
    return np.clip(lo + np.clip(u, 0.0, 1.0) * (hi - lo), lo, hi)


def encode_column(spec, series: pd.Series) -> np.ndarray:
    """:meth:`ColumnSpec.encode`: one column of data to float64 codes, ``NaN`` for missing values."""
    if not spec.is_complete:
        raise TwinInputError(
            f"Column {spec.name!r} is not fully described (missing {spec.missing_fields()})."
        )
    # the rules below never warn; the filter makes sure that no library
    # warning about a value (an overflow, a cast) can reach the user either
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        missing = np.asarray(series.isna(), dtype=bool)
        if spec.kind == "categorical":
            codes = _level_codes(spec, series, missing)
        elif spec.kind == "boolean":
            codes = _boolean_codes(series, missing)
        else:
            codes = _number_codes(spec, _real_numbers(series, missing))
        if not spec.nullable:
            codes = np.where(np.isnan(codes), fallback_code(spec), codes)
    return codes


def fallback_code(spec) -> float:
    """:attr:`ColumnSpec.fallback_code`: the code of a missing value of a non-nullable column."""
    if spec.kind == "categorical":
        return float(_LevelIndex(spec.levels).find(spec.other)) if spec.other is not None else 0.0
    if spec.kind in ("real", "count"):
        return float(_number_codes(spec, np.array([spec.lower]))[0])
    return 0.0


def _number_codes(spec, x: np.ndarray) -> np.ndarray:
    """Codes of numbers (``NaN`` = missing stays): clipped to the bounds
    (``±inf`` to the nearest one), counts rounded, then scaled."""
    x = np.clip(x, spec.lower, spec.upper)
    if spec.kind == "count":
        x = np.clip(np.round(x), spec.lower, spec.upper)
    out = np.full(x.shape, np.nan)
    ok = ~np.isnan(x)
    if spec.kind == "count" and spec.distribution in INTEGER_CODE_DISTRIBUTIONS:
        out[ok] = x[ok] - spec.lower
    else:
        out[ok] = np.clip(scale(spec, x[ok]), -1.0, 1.0)
    return out


def decode_column(spec, codes: np.ndarray) -> pd.Series:
    """:meth:`ColumnSpec.decode`: codes (``NaN`` for missing) back to a column of dtype ``spec.output_dtype``."""
    codes = np.asarray(codes, dtype=np.float64)
    missing = np.isnan(codes)
    if not spec.nullable:
        # a model may put a missing value where none is allowed: use a valid default
        codes = np.where(missing, 0.0, codes)
        missing = np.zeros_like(missing)
    safe = np.where(missing, 0.0, codes)
    if spec.kind == "categorical":
        idx = np.clip(np.round(safe), 0, spec.num_levels - 1).astype(np.int64)
        levels = np.empty(spec.num_levels, dtype=object)
        levels[:] = list(spec.levels)
        values = levels[idx] if spec.num_levels else np.full(len(idx), None, dtype=object)
        values = values.astype(object)
        values[missing] = None
        if spec.dtype == "category":
            return pd.Series(
                pd.Categorical(values, categories=list(spec.levels), ordered=spec.ordered),
                name=spec.name,
            )
        series = pd.Series(values, name=spec.name, dtype=object)
        return _as_dtype(series, spec, missing, list(spec.levels))
    if spec.kind == "boolean":
        values = np.empty(len(safe), dtype=object)
        values[:] = (safe >= 0.5).tolist()
        values[missing] = None
        return _as_dtype(pd.Series(values, name=spec.name, dtype=object), spec, missing, [False, True])
    if spec.kind == "count" and spec.distribution in INTEGER_CODE_DISTRIBUTIONS:
        x = np.clip(np.round(safe) + spec.lower, spec.lower, spec.upper)
    else:
        x = scale_inverse(spec, safe)
        if spec.kind == "count":
            x = np.clip(np.round(x), spec.lower, spec.upper)
        elif spec.decimals is not None:
            x = np.clip(np.round(x, spec.decimals), spec.lower, spec.upper)
    probe = [spec.lower, spec.upper]
    if _is_integer_dtype(spec.output_dtype):
        x, probe = np.round(x), [float(np.round(b)) for b in probe]
    x = np.where(missing, np.nan, x)
    return _as_dtype(pd.Series(x, name=spec.name), spec, missing, probe)


def encode_table(schema, data: pd.DataFrame) -> np.ndarray:
    """:meth:`Schema.encode`: a DataFrame to a ``float32`` matrix ``(N, D)`` (``NaN`` = missing)."""
    if not schema.is_complete:
        todo = {c.name: c.missing_fields() for c in schema.columns if not c.is_complete}
        raise TwinInputError(f"The schema is incomplete: {todo}; use infer_schema to complete it.")
    schema.check_columns(data)
    data = data.rename(columns=str)
    if len(schema.columns) == 0:
        return np.zeros((len(data), 0), np.float32)
    codes = np.stack([c.encode(data[c.name]) for c in schema.columns], axis=1)
    # a count's code x - lower may exceed float32's range only where the schema's
    # range does; clipping first keeps every code finite (and the cast silent)
    big = float(np.finfo(np.float32).max)
    return np.clip(codes, -big, big).astype(np.float32)


def decode_table(schema, codes: np.ndarray) -> pd.DataFrame:
    """:meth:`Schema.decode`: a code matrix ``(n, D)`` to a DataFrame with the schema's columns and dtypes."""
    codes = np.asarray(codes)
    if codes.ndim != 2 or codes.shape[1] != len(schema.columns):
        raise ValueError(
            f"Expected codes of shape (n, {len(schema.columns)}), got shape {codes.shape}."
        )
    return pd.DataFrame({c.name: c.decode(codes[:, j]) for j, c in enumerate(schema.columns)})


class _LevelIndex:
    """Finds the index of a value among a categorical column's levels: the
    first level equal to it (1, 1.0 and True are different levels), else
    with equal text (``str``), else equal as a number (``2``, ``2.0`` and
    ``"2"`` match the level 2.0); None if there is none."""

    def __init__(self, levels):
        self.exact, self.text, self.number = {}, {}, {}
        for i, lev in enumerate(levels or ()):
            self.exact.setdefault(_level_key(lev), i)
            self.text.setdefault(str(lev), i)
            number = _plain_number(lev)
            if number is not None:
                self.number.setdefault(number, i)

    def find(self, value) -> Optional[int]:
        value = value.item() if isinstance(value, np.generic) else value
        try:
            i = self.exact.get(_level_key(value))
        except TypeError:  # unhashable
            i = None
        if i is None:
            try:
                i = self.text.get(str(value))
            except Exception:  # a value whose text cannot be made: matches no level
                i = None
        if i is None:
            number = _plain_number(value)
            if number is None and isinstance(value, str):
                number = _plain_number(_parse_float(value))
            if number is not None:
                i = self.number.get(number)
        return i


def _plain_number(v) -> Optional[float]:
    """``v`` as a finite float if it is a real number (not a boolean), else None."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
        return None
    try:
        x = float(v)
    except (TypeError, ValueError, OverflowError):
        return None
    return x if math.isfinite(x) else None


def _each_value(series: pd.Series, missing: np.ndarray, code) -> np.ndarray:
    """``code(value)`` for every value that is not missing, ``NaN`` where missing.

    A column of pandas' ``category`` or string dtype holds each distinct value
    as one object (a category, a string): ``code`` runs once per distinct
    value, which gives the same result as once per record. Other columns
    (``object``) run it on every record: two values that compare equal may
    still differ (``2`` and ``2.0``, ``0.0`` and ``-0.0`` have different text),
    so no result is shared between records.
    """
    out = np.full(len(series), np.nan)
    dtype = series.dtype
    if isinstance(dtype, (pd.CategoricalDtype, pd.StringDtype)):
        if isinstance(dtype, pd.CategoricalDtype):
            index, distinct = series.cat.codes.to_numpy(), series.cat.categories.tolist()
        else:
            index, distinct = pd.factorize(series, use_na_sentinel=True)
            distinct = distinct.tolist()
        table = np.array([code(v) for v in distinct] + [np.nan], dtype=np.float64)
        out = table[np.where(index < 0, len(distinct), index)]
    else:
        for j, v in enumerate(series.tolist()):
            if not missing[j]:
                out[j] = code(v)
    out[missing] = np.nan
    return out


def _level_codes(spec, series: pd.Series, missing: np.ndarray) -> np.ndarray:
    """Level indices of a categorical column's values; ``other`` (or ``NaN``
    without it) for a value that matches no level; ``NaN`` where missing."""
    index = _LevelIndex(spec.levels)
    unmatched = float(index.find(spec.other)) if spec.other is not None else np.nan

    def code(v) -> float:
        i = index.find(v)
        return unmatched if i is None else float(i)

    return _each_value(series, missing, code)


_TRUE = {"true", "t", "yes", "1"}
_FALSE = {"false", "f", "no", "0"}


def _boolean_code(v) -> float:
    """0/1 for one boolean value, ``NaN`` for a value that is not a boolean."""
    if isinstance(v, (bool, np.bool_)):
        return float(bool(v))
    if isinstance(v, str):
        t = v.strip().lower()
        return 1.0 if t in _TRUE else 0.0 if t in _FALSE else np.nan
    x = _plain_number(v)
    return x if x in (0.0, 1.0) else np.nan


def _boolean_codes(series: pd.Series, missing: np.ndarray) -> np.ndarray:
    """0/1 for the values of a boolean column, ``NaN`` where missing or not a boolean."""
    dtype = series.dtype
    if pd.api.types.is_bool_dtype(dtype) or pd.api.types.is_integer_dtype(dtype) or \
            pd.api.types.is_float_dtype(dtype):
        x = np.array(series.to_numpy(dtype=np.float64, na_value=np.nan), dtype=np.float64)
        out = np.where((x == 0.0) | (x == 1.0), x, np.nan)  # as _boolean_code, value by value
        out[missing] = np.nan
        return out
    return _each_value(series, missing, _boolean_code)


def _parse_float(text: str) -> float:
    """``float(text)`` (surrounding blanks ignored), ``NaN`` where it is no number."""
    try:
        return float(text.strip())
    except ValueError:
        return math.nan


def _real_number(v) -> float:
    """One value as a float: real numbers (a boolean is 0/1) and text that
    ``float`` parses; ``±inf`` for an integer beyond the float range; ``NaN``
    for anything else."""
    if isinstance(v, str):
        return _parse_float(v)
    if isinstance(v, (bool, np.bool_)):
        return float(bool(v))
    if not isinstance(v, numbers.Real):
        return math.nan
    try:
        return float(v)
    except OverflowError:
        return math.inf if v > 0 else -math.inf
    except (TypeError, ValueError):
        return math.nan


def _real_numbers(series: pd.Series, missing: np.ndarray) -> np.ndarray:
    """The values of a numeric column as float64, ``NaN`` where missing or not a number."""
    dtype = series.dtype
    if (pd.api.types.is_bool_dtype(dtype) or pd.api.types.is_integer_dtype(dtype)
            or pd.api.types.is_float_dtype(dtype)):
        x = np.array(series.to_numpy(dtype=np.float64, na_value=np.nan), dtype=np.float64)
    else:
        x = np.array([_real_number(v) for v in series.tolist()], dtype=np.float64).reshape(len(series))
    x[missing] = np.nan
    return x


def _is_integer_dtype(dtype: Optional[str]) -> bool:
    if dtype is None:
        return False
    try:
        return pd.api.types.is_integer_dtype(pd.api.types.pandas_dtype(dtype))
    except TypeError:
        return False


def _as_dtype(series: pd.Series, spec, missing: np.ndarray, probe: list) -> pd.Series:
    """Cast decoded values to ``spec.output_dtype``.

    ``probe`` holds the values the spec allows (levels, or the bounds): it is
    cast first, so whether the cast works is decided by the spec, not by the
    values at hand. The result's dtype never depends on ``series``.
    """
    dtype = spec.output_dtype
    if dtype is None or dtype == "object":
        return series.astype(object).where(~missing, None)
    try:
        target = pd.api.types.pandas_dtype(dtype)
        pd.Series(probe, dtype=object).astype(target)
        return series.astype(target)
    except (TypeError, ValueError) as e:
        raise TwinInputError(
            f"Column {spec.name!r} cannot be represented in its schema dtype {spec.dtype!r} "
            f"({type(e).__name__}: {e}); declare a dtype that holds its values."
        ) from None
