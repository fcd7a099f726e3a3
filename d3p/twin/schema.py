"""Table schemas for synthetic data twins: column kinds, levels, bounds, encoding.

A :class:`Schema` says, for every column of a table, what the twin's model may
assume about it: its kind (categorical, boolean, real or count), the
categories of a categorical column, the bounds of a numeric column, whether
it may be missing, and which distribution models it. It is a plain,
JSON-serialisable description; :meth:`Schema.encode` turns a DataFrame into
the float matrix the models see and :meth:`Schema.decode` turns model output
back into a DataFrame with the schema's columns and dtypes (the dtypes are
part of the schema, never read from the data's values).

**Privacy.** Everything in a schema shapes the synthetic data and is released
with the twin (it is stored in the saved model). Levels, bounds and the fact
that a column has missing values are facts about the data: if they are read
from the private data they are *not* covered by the (ε, δ) guarantee of the
fit. A rare category, for instance, reveals that some record has it, and a
minimum or maximum is one record's value. :func:`infer_schema` therefore reads
them from the data only where the caller did not supply them, records which
ones it read (``ColumnSpec.inferred``) and warns with
:class:`SchemaInferenceWarning`. To avoid the leak, supply them from public
knowledge (code books, plausible ranges) or obtain them privately.

Encoding (one float per column and record, ``NaN`` for a missing value):

* ``categorical``: the index of the value in ``levels``;
* ``boolean``: 0 or 1;
* ``real``, and ``count`` modelled as ``normal``/``lognormal``: the value is
  clipped to ``[lower, upper]``, ``u = (x - lower) / (upper - lower)`` in
  [0, 1]; for ``normal`` the code is ``2 u - 1``, for ``lognormal`` it is
  ``log(u + c)`` (``c`` = :data:`LOG_OFFSET`) mapped affinely onto [-1, 1].
  ``upper == lower`` gives 0. Decoding inverts this (clipping to [-1, 1]
  first) and rounds counts to integers;
* ``count`` modelled as ``poisson``: ``round(x) - lower`` after clipping to
  the bounds.

A complete schema maps every record on its own, by public rules that read the
schema and that one record only (:meth:`ColumnSpec.encode`; docs/twin.md,
"Records that do not fit the schema"): a value outside the bounds goes to the
nearest bound, a value the column cannot hold to its declared ``other`` level
or to missing, a missing value in a non-nullable column to the column's
fallback. No record can make encoding fail, warn or print; only the schema
itself (malformed, or columns that do not match the table's) is an error.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import pandas as pd

from d3p import _validate

__all__ = [
    "KINDS",
    "DISTRIBUTIONS",
    "LOG_OFFSET",
    "DEFAULT_MAX_LEVELS",
    "ColumnSpec",
    "Schema",
    "infer_schema",
    "SchemaInferenceWarning",
    "TwinInputError",
]

#: Column kinds.
KINDS = ("categorical", "boolean", "real", "count")
#: Distributions allowed for each kind (the first is the default).
DISTRIBUTIONS = {
    "categorical": ("categorical",),
    "boolean": ("bernoulli",),
    "real": ("normal", "lognormal", "hurdle"),
    "count": ("negbinomial", "poisson", "hurdle", "normal", "lognormal"),
}
#: Offset ``c`` of the log transform of ``lognormal`` columns: ``log(u + c)``
#: for ``u`` in [0, 1], so values at the lower bound stay finite.
LOG_OFFSET = 0.01
#: Default largest number of levels :func:`infer_schema` accepts for a
#: categorical column read from the data.
DEFAULT_MAX_LEVELS = 50
#: Counts with a wider range than this are modelled as ``lognormal`` (rounded)
#: by default instead of ``negbinomial``.
POISSON_MAX_RANGE = 100
#: A numeric column with at most this many distinct values is categorical
#: (ordered, its values as levels) when its kind is read from the data; one
#: whose values are 0 and 1 is boolean.
NUMERIC_MAX_LEVELS = 20
#: A real or count column with at least this share of its values at its
#: minimum gets ``distribution="hurdle"`` when that is read from the data.
HURDLE_MIN_SHARE = 0.1
#: Distributions whose code is the count above ``lower`` (not a scaled value).
INTEGER_CODE_DISTRIBUTIONS = ("poisson", "negbinomial")
#: The most decimals a real column is rounded to (``ColumnSpec.decimals``); a
#: column whose values need more (results of a computation) is read as having
#: this many.
MAX_DECIMALS = 15


class TwinInputError(ValueError):
    """Bad input data or schema for a twin (a ``ValueError`` with a message for users)."""


class SchemaInferenceWarning(UserWarning):
    """Schema information (levels, bounds, missingness, ...) was read from the
    private data without differential privacy; it is released with the twin and
    is not covered by its (ε, δ) guarantee."""


def check_type(name: str, value, kind: type, what: str):
    """``value`` if it is an instance of ``kind``, else
    :class:`d3p._validate.InvalidArgumentType` in the message format of
    :mod:`d3p._validate` (``what`` describes ``kind``, e.g. "a pandas DataFrame")."""
    if not isinstance(value, kind):
        raise _validate.InvalidArgumentType(f"Expected {name} to be {what}, got {name} of type {type(value).__name__}.")
    return value


def check_frame(name: str, value) -> pd.DataFrame:
    """``value`` if it is a pandas DataFrame (see :func:`check_type`)."""
    return check_type(name, value, pd.DataFrame, "a pandas DataFrame")


def _column_check(column: str, check, field_name: str, value):
    """A :mod:`d3p._validate` check of a field of a column description; its
    failures become :class:`TwinInputError` that names the column."""
    try:
        return check(field_name, value)
    except ValueError as err:
        raise TwinInputError(f"Column {column!r}: {err}") from None


def _jsonable(value):
    """A JSON-compatible Python scalar for a level or bound."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    if isinstance(value, float):
        return value
    raise TwinInputError(
        f"Expected levels to be strings, numbers or booleans, got {value!r} of type "
        f"{type(value).__name__}."
    )


@dataclass(frozen=True)
class ColumnSpec:
    """What the twin may assume about one column.

    Fields left ``None`` are unknown; :func:`infer_schema` fills them in from
    the data (and warns). A schema used for fitting must be complete.

    :param str name: the column name.
    :param str kind: ``"categorical"``, ``"boolean"``, ``"real"`` or ``"count"``.
    :param str dtype: the pandas dtype of the column in synthetic data (e.g.
        ``"float64"``, ``"int64"``, ``"str"``, ``"category"``, ``"bool"``);
        for a nullable column a NumPy integer or ``bool`` dtype becomes
        pandas' nullable ``Int64``/``boolean`` (see :attr:`output_dtype`).
        Default (:func:`infer_schema`): derived from the other fields, never
        from the data's values (the rules are listed there).
    :param bool nullable: whether the column may be missing. Missing values are
        modelled explicitly: an extra level for categoricals, a Bernoulli
        missingness indicator per mixture component otherwise.
    :param tuple levels: the categories of a categorical column, in order.
    :param bool ordered: whether those categories are ordered (restored for
        ``category`` dtype).
    :param float lower: lower bound of a numeric column.
    :param float upper: upper bound of a numeric column.
    :param str distribution: the model of the column, one of
        :data:`DISTRIBUTIONS` for its kind.
    :param tuple inferred: names of the fields that were read from the data
        (set by :func:`infer_schema`).
    :param other: for a categorical column, one of its ``levels`` that
        receives every value that is not among the levels (and, if the column
        is not nullable, a missing value); see :meth:`encode`. Optional.
    :param int decimals: for a real column, the number of decimals that
        synthetic values are rounded to (:meth:`decode`), 0 to
        :data:`MAX_DECIMALS`; None (default): not rounded. Optional;
        :func:`infer_schema` reads it from the data where it infers the column.
    """

    name: str
    kind: Optional[str] = None
    dtype: Optional[str] = None
    nullable: Optional[bool] = None
    levels: Optional[Tuple[Any, ...]] = None
    ordered: bool = False
    lower: Optional[float] = None
    upper: Optional[float] = None
    distribution: Optional[str] = None
    inferred: Tuple[str, ...] = ()
    other: Any = None
    decimals: Optional[int] = None

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise TwinInputError(f"Expected a column name to be a string, got name={self.name!r}.")
        if self.kind is not None and self.kind not in KINDS:
            raise TwinInputError(
                f"Expected kind in {KINDS} for column {self.name!r}, got kind={self.kind!r}."
            )
        if self.levels is not None:
            levels = tuple(_jsonable(v) for v in self.levels)
            if len(set(map(_level_key, levels))) != len(levels):
                raise TwinInputError(f"Column {self.name!r} has duplicate levels: {list(levels)!r}.")
            object.__setattr__(self, "levels", levels)
        for b in ("lower", "upper"):
            if getattr(self, b) is not None:
                object.__setattr__(self, b, _column_check(self.name, _validate.number, b, getattr(self, b)))
        if self.lower is not None and self.upper is not None and self.lower > self.upper:
            raise TwinInputError(
                f"Expected lower <= upper for column {self.name!r}, got lower={self.lower}, "
                f"upper={self.upper}."
            )
        if self.lower is not None and self.upper is not None and not math.isfinite(self.upper - self.lower):
            raise TwinInputError(
                f"Expected a finite range upper - lower for column {self.name!r}, got lower={self.lower}, "
                f"upper={self.upper}."
            )
        self._check_other()
        self._check_decimals()
        if self.kind is not None and self.distribution is not None:
            if self.distribution not in DISTRIBUTIONS[self.kind]:
                raise TwinInputError(
                    f"Expected distribution in {DISTRIBUTIONS[self.kind]} for the {self.kind} column "
                    f"{self.name!r}, got distribution={self.distribution!r}."
                )
        if self.kind == "count" and self.lower is not None:
            for b in ("lower", "upper"):
                v = getattr(self, b)
                if v is not None and v != round(v):
                    raise TwinInputError(
                        f"Expected integer bounds for the count column {self.name!r}, got {b}={v}."
                    )
        object.__setattr__(self, "inferred", tuple(self.inferred))
        if self.nullable is not None:
            object.__setattr__(self, "nullable", bool(self.nullable))
        object.__setattr__(self, "ordered", bool(self.ordered))

    def _check_other(self) -> None:
        """``other`` is a level of a categorical column (a check of the schema alone)."""
        if self.other is None:
            return
        object.__setattr__(self, "other", _jsonable(self.other))
        if self.kind is not None and self.kind != "categorical":
            raise TwinInputError(
                f"Expected other only for a categorical column, got other={self.other!r} for the "
                f"{self.kind} column {self.name!r}."
            )
        if self.levels is not None and _level_key(self.other) not in set(map(_level_key, self.levels)):
            raise TwinInputError(
                f"Expected other to be one of the levels of column {self.name!r}, got other={self.other!r}."
            )

    def _check_decimals(self) -> None:
        """``decimals`` is an integer in [0, MAX_DECIMALS] of a real column (a check of the schema alone)."""
        if self.decimals is None:
            return
        object.__setattr__(self, "decimals", _column_check(
            self.name, lambda n, v: _validate.integer(n, v, minimum=0, maximum=MAX_DECIMALS), "decimals",
            self.decimals))
        if self.kind is not None and self.kind != "real":
            raise TwinInputError(
                f"Expected decimals only for a real column, got decimals={self.decimals} for the {self.kind} "
                f"column {self.name!r}."
            )

    # -------------------------------------------------------------- status

    def missing_fields(self) -> List[str]:
        """The fields still needed before this column can be modelled."""
        need = []
        if self.kind is None:
            return ["kind", "nullable"]
        if self.nullable is None:
            need.append("nullable")
        if self.kind == "categorical" and self.levels is None:
            need.append("levels")
        if self.kind in ("real", "count"):
            if self.lower is None:
                need.append("lower")
            if self.upper is None:
                need.append("upper")
        if self.distribution is None:
            need.append("distribution")
        if self.dtype is None:
            need.append("dtype")
        return need

    @property
    def is_complete(self) -> bool:
        """Whether every field needed for modelling is known."""
        return not self.missing_fields()

    @property
    def output_dtype(self) -> Optional[str]:
        """The dtype of this column in decoded (synthetic) data: a function of
        the spec alone.

        ``dtype``, except that for a nullable column a NumPy integer or
        ``bool`` dtype (which cannot hold a missing value) becomes pandas'
        nullable ``Int64`` (``UInt8``, ...) or ``boolean``, whether or not a
        given table has a missing value. None if ``dtype`` is unknown.
        """
        if self.dtype is None or not self.nullable:
            return self.dtype
        try:
            target = pd.api.types.pandas_dtype(self.dtype)
        except TypeError:
            return self.dtype
        if isinstance(target, np.dtype) and target.kind in "iu":
            return ("UInt" if target.kind == "u" else "Int") + str(8 * target.itemsize)
        if isinstance(target, np.dtype) and target.kind == "b":
            return "boolean"
        return self.dtype

    @property
    def num_levels(self) -> int:
        """Number of levels of a categorical column (without the missing level)."""
        return len(self.levels) if self.levels is not None else 0

    # ---------------------------------------------------------------- JSON

    def to_dict(self) -> dict:
        """A JSON-serialisable dict; ``None`` fields are left out."""
        out = {"name": self.name}
        for f in dataclasses.fields(self):
            if f.name == "name":
                continue
            v = getattr(self, f.name)
            if v is None or (f.name == "ordered" and not v) or (f.name == "inferred" and not v):
                continue
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    @classmethod
    def from_dict(cls, d: Mapping) -> "ColumnSpec":
        """Inverse of :meth:`to_dict`; unknown keys are an error."""
        if not isinstance(d, Mapping):
            raise TwinInputError(f"Expected a column description to be a JSON object, got {d!r}.")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise TwinInputError(
                f"Unknown field(s) {unknown} in the description of column {d.get('name')!r}; "
                f"expected some of {sorted(known)}."
            )
        if "name" not in d:
            raise TwinInputError(f"Expected a 'name' in every column description, got {dict(d)!r}.")
        kw = dict(d)
        for k in ("levels", "inferred"):
            if kw.get(k) is not None:
                if not isinstance(kw[k], (list, tuple)):
                    raise TwinInputError(
                        f"Expected {k} of column {d['name']!r} to be a list, got {kw[k]!r}."
                    )
                kw[k] = tuple(kw[k])
        for k in ("nullable", "ordered"):
            if kw.get(k) is not None:
                _column_check(d["name"], _validate.boolean, k, kw[k])
        return cls(**kw)

    # ------------------------------------------------------------ encoding

    def scale(self, x: np.ndarray) -> np.ndarray:
        """Numeric values (already clipped) to codes in [-1, 1]: ``2 u - 1`` with
        ``u = (x - lower) / (upper - lower)``, or for ``lognormal`` and ``hurdle``
        ``log(u + c)`` mapped affinely onto [-1, 1] (``c`` = :data:`LOG_OFFSET`)."""
        lo, hi = self.lower, self.upper
        if hi == lo:
            return np.zeros_like(x)
        u = (x - lo) / (hi - lo)
        if self.distribution in ("lognormal", "hurdle"):
            c = LOG_OFFSET
            t = np.log(u + c)
            return 2.0 * (t - math.log(c)) / (math.log1p(c) - math.log(c)) - 1.0
        return 2.0 * u - 1.0

    def scale_inverse(self, z: np.ndarray) -> np.ndarray:
        """Codes (clipped to [-1, 1]) back to numeric values in ``[lower, upper]``
        (the inverse of :meth:`scale`)."""
        lo, hi = self.lower, self.upper
        z = np.clip(z, -1.0, 1.0)
        if hi == lo:
            return np.full_like(z, lo)
        if self.distribution in ("lognormal", "hurdle"):
            c = LOG_OFFSET
            t = (z + 1.0) / 2.0 * (math.log1p(c) - math.log(c)) + math.log(c)
            u = np.where(z <= -1.0, 0.0, np.exp(t) - c)  # the lower bound exactly
        else:
            u = (z + 1.0) / 2.0
        return np.clip(lo + np.clip(u, 0.0, 1.0) * (hi - lo), lo, hi)

    def encode(self, series: pd.Series) -> np.ndarray:
        """One column of data to float64 codes, ``NaN`` for missing values: a
        map of each record on its own, by public rules that read the spec and
        that record only.

        A value is first read as the column's kind: a categorical value is
        matched to a level (equal value, equal text, or equal number: ``2``,
        ``2.0`` and ``"2"`` match the level ``2``); a boolean is ``True``/``False``,
        1/0 or the text true/false/t/f/yes/no/1/0 (any case); a number is a
        real number or text that Python's ``float`` parses. Then:

        * a number outside ``[lower, upper]``, ``±inf`` included, becomes the
          nearest bound; a count is then rounded to the nearest integer
          (halves to even);
        * a categorical value that matches no level becomes the level
          ``other`` if the spec declares one, else missing;
        * a boolean that is none of the above, or a numeric value that is not
          a number (text, ``NaN``, a complex number), becomes missing;
        * a missing value (``None``, ``NaN``, ``pd.NA``, and the cases above)
          in a column that is not nullable becomes the column's fallback:
          ``other`` if declared, else the first level; ``False``; ``lower``.

        :param pandas.Series series: the column.
        :return: ``float64`` array of shape ``(len(series),)``.
        :raises TwinInputError: if the spec is incomplete (never because of
            the values).

        **Formal guarantees.**

        * Per record: entry ``i`` of the result depends only on the spec and
          on ``series.iloc[i]``. No value raises, warns or prints; no count
          or value of the data enters a message.
        * Every entry is ``NaN`` (only for a nullable column) or a valid code:
          a level index, 0/1, an integer in ``[0, upper - lower]`` or a
          number in [-1, 1] (see the module docstring).
        """
        if not self.is_complete:
            raise TwinInputError(
                f"Column {self.name!r} is not fully described (missing {self.missing_fields()})."
            )
        # the rules below never warn; the filter makes sure that no library
        # warning about a value (an overflow, a cast) can reach the user either
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            missing = np.asarray(series.isna(), dtype=bool)
            if self.kind == "categorical":
                codes = _level_codes(self, series, missing)
            elif self.kind == "boolean":
                codes = _boolean_codes(series, missing)
            else:
                codes = self._number_codes(_real_numbers(series, missing))
            if not self.nullable:
                codes = np.where(np.isnan(codes), self.fallback_code, codes)
        return codes

    @property
    def fallback_code(self) -> float:
        """The code that a missing value of a non-nullable column gets in
        :meth:`encode`: the level ``other`` if declared, else the first level
        (index 0); ``False``; ``lower``. A function of the spec alone."""
        if self.kind == "categorical":
            return float(_LevelIndex(self.levels).find(self.other)) if self.other is not None else 0.0
        if self.kind in ("real", "count"):
            return float(self._number_codes(np.array([self.lower]))[0])
        return 0.0

    def _number_codes(self, x: np.ndarray) -> np.ndarray:
        """Codes of numbers (``NaN`` = missing stays): clipped to the bounds
        (``±inf`` to the nearest one), counts rounded, then scaled."""
        x = np.clip(x, self.lower, self.upper)
        if self.kind == "count":
            x = np.clip(np.round(x), self.lower, self.upper)
        out = np.full(x.shape, np.nan)
        ok = ~np.isnan(x)
        if self.kind == "count" and self.distribution in INTEGER_CODE_DISTRIBUTIONS:
            out[ok] = x[ok] - self.lower
        else:
            out[ok] = np.clip(self.scale(x[ok]), -1.0, 1.0)
        return out

    def decode(self, codes: np.ndarray) -> pd.Series:
        """Codes (``NaN`` for missing) back to a column of dtype :attr:`output_dtype`.

        The dtype is a function of the spec alone, never of the codes (for
        instance of whether they hold a missing value); values of a numeric
        column are rounded when that dtype is an integer dtype.

        :param numpy.ndarray codes: float array of codes, as from a model.
        :return: :class:`pandas.Series` named ``name``.
        :raises TwinInputError: if the spec's values (levels, bounds) cannot
            be represented in its dtype.
        """
        codes = np.asarray(codes, dtype=np.float64)
        missing = np.isnan(codes)
        if not self.nullable:
            # a model may put a missing value where none is allowed: use a valid default
            codes = np.where(missing, 0.0, codes)
            missing = np.zeros_like(missing)
        safe = np.where(missing, 0.0, codes)
        if self.kind == "categorical":
            idx = np.clip(np.round(safe), 0, self.num_levels - 1).astype(np.int64)
            levels = np.empty(self.num_levels, dtype=object)
            levels[:] = list(self.levels)
            values = levels[idx] if self.num_levels else np.full(len(idx), None, dtype=object)
            values = values.astype(object)
            values[missing] = None
            if self.dtype == "category":
                return pd.Series(
                    pd.Categorical(values, categories=list(self.levels), ordered=self.ordered),
                    name=self.name,
                )
            series = pd.Series(values, name=self.name, dtype=object)
            return _as_dtype(series, self, missing, list(self.levels))
        if self.kind == "boolean":
            values = np.empty(len(safe), dtype=object)
            values[:] = (safe >= 0.5).tolist()
            values[missing] = None
            return _as_dtype(pd.Series(values, name=self.name, dtype=object), self, missing, [False, True])
        if self.kind == "count" and self.distribution in INTEGER_CODE_DISTRIBUTIONS:
            x = np.clip(np.round(safe) + self.lower, self.lower, self.upper)
        else:
            x = self.scale_inverse(safe)
            if self.kind == "count":
                x = np.clip(np.round(x), self.lower, self.upper)
            elif self.decimals is not None:
                x = np.clip(np.round(x, self.decimals), self.lower, self.upper)
        probe = [self.lower, self.upper]
        if _is_integer_dtype(self.output_dtype):
            x, probe = np.round(x), [float(np.round(b)) for b in probe]
        x = np.where(missing, np.nan, x)
        return _as_dtype(pd.Series(x, name=self.name), self, missing, probe)


def _level_key(v):
    """Hashable key identifying a level (1 and 1.0 and True are different levels)."""
    return (type(v).__name__ if not isinstance(v, (int, float)) or isinstance(v, bool) else "num", v)


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


def _level_codes(spec: ColumnSpec, series: pd.Series, missing: np.ndarray) -> np.ndarray:
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


def _is_integer_dtype(dtype: Optional[str]) -> bool:
    if dtype is None:
        return False
    try:
        return pd.api.types.is_integer_dtype(pd.api.types.pandas_dtype(dtype))
    except TypeError:
        return False


def _as_dtype(series: pd.Series, spec: ColumnSpec, missing: np.ndarray, probe: list) -> pd.Series:
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


@dataclass(frozen=True)
class Schema:
    """The schema of a table: one :class:`ColumnSpec` per column, in order.

    JSON form (``Schema.to_json`` / ``Schema.from_json``, also the CLI's
    ``--schema`` file)::

        {"columns": [
          {"name": "age", "kind": "real", "lower": 18, "upper": 100, "nullable": false},
          {"name": "smoker", "kind": "boolean", "nullable": true},
          {"name": "region", "kind": "categorical", "levels": ["N", "S", "E", "W", "other"],
           "other": "other"},
          {"name": "visits", "kind": "count", "lower": 0, "upper": 50}
        ]}

    A column's fields that are left out are inferred from the data (with a
    :class:`SchemaInferenceWarning`); see :func:`infer_schema`. With every
    field given, the schema is public and :meth:`encode` maps each record on
    its own (see :meth:`ColumnSpec.encode`).

    :param columns: the column specs.
    """

    columns: Tuple[ColumnSpec, ...] = field(default_factory=tuple)

    def __post_init__(self):
        cols = tuple(self.columns)
        for c in cols:
            if not isinstance(c, ColumnSpec):
                raise TwinInputError(f"Expected ColumnSpec entries in Schema.columns, got {c!r}.")
        names = [c.name for c in cols]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise TwinInputError(f"Duplicate column name(s) in the schema: {dup}.")
        object.__setattr__(self, "columns", cols)

    @property
    def names(self) -> List[str]:
        """Column names in order."""
        return [c.name for c in self.columns]

    def __len__(self) -> int:
        return len(self.columns)

    def __getitem__(self, name: str) -> ColumnSpec:
        for c in self.columns:
            if c.name == name:
                return c
        raise KeyError(name)

    def __contains__(self, name) -> bool:
        return any(c.name == name for c in self.columns)

    @property
    def is_complete(self) -> bool:
        """Whether every column is fully described."""
        return all(c.is_complete for c in self.columns)

    def inferred_fields(self) -> Dict[str, Tuple[str, ...]]:
        """``{column: fields read from the data}`` for columns with any."""
        return {c.name: c.inferred for c in self.columns if c.inferred}

    # ---------------------------------------------------------------- JSON

    def to_dict(self) -> dict:
        """JSON-serialisable dict ``{"columns": [...]}``."""
        return {"columns": [c.to_dict() for c in self.columns]}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Schema":
        """Inverse of :meth:`to_dict`."""
        if not isinstance(d, Mapping) or not isinstance(d.get("columns"), list):
            raise TwinInputError('Expected a schema of the form {"columns": [{"name": ...}, ...]}.')
        extra = sorted(set(d) - {"columns"})
        if extra:
            raise TwinInputError(f"Unknown top-level field(s) {extra} in the schema; expected only 'columns'.")
        return cls(tuple(ColumnSpec.from_dict(c) for c in d["columns"]))

    def to_json(self, **kwargs) -> str:
        """The schema as a JSON string (``kwargs`` go to :func:`json.dumps`)."""
        kwargs.setdefault("indent", 2)
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_json(cls, text: str) -> "Schema":
        """Parse a schema from a JSON string."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise TwinInputError(f"The schema is not valid JSON: {e}.") from None
        return cls.from_dict(d)

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write the schema as JSON to ``path``."""
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json())
            f.write("\n")

    @classmethod
    def load(cls, path: Union[str, os.PathLike]) -> "Schema":
        """Read a schema from a JSON file."""
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            raise TwinInputError(f"Schema file {str(path)!r} not found.") from None
        return cls.from_json(text)

    # ------------------------------------------------------------ encoding

    def check_columns(self, data: pd.DataFrame) -> None:
        """Raise :class:`TwinInputError` unless ``data`` has exactly the schema's columns."""
        cols = [str(c) for c in data.columns]
        missing = [n for n in self.names if n not in cols]
        extra = [c for c in cols if c not in self]
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"missing from the data: {missing}")
            if extra:
                parts.append(f"not in the schema: {extra}")
            raise TwinInputError("The data's columns do not match the schema (" + "; ".join(parts) + ").")

    def encode(self, data: pd.DataFrame) -> np.ndarray:
        """Encode a DataFrame to a ``float32`` matrix ``(N, D)`` (``NaN`` = missing).

        Each record is mapped on its own by :meth:`ColumnSpec.encode`: values
        outside the schema go to a bound, to the level ``other``, to missing or
        to the column's fallback, by rules of the schema alone.

        :param pandas.DataFrame data: a table with the schema's columns.
        :return: the codes, columns in schema order (see the module docstring).
        :raises TwinInputError: if the schema is incomplete or the table's
            columns are not the schema's (public facts; the message names
            columns, never values or counts of records).

        **Formal guarantees.** Row ``i`` of the result depends only on the
        schema and on record ``i``; no value of a record raises, warns or
        prints (see :meth:`ColumnSpec.encode`).
        """
        if not self.is_complete:
            todo = {c.name: c.missing_fields() for c in self.columns if not c.is_complete}
            raise TwinInputError(f"The schema is incomplete: {todo}; use infer_schema to complete it.")
        self.check_columns(data)
        data = data.rename(columns=str)
        if len(self.columns) == 0:
            return np.zeros((len(data), 0), np.float32)
        codes = np.stack([c.encode(data[c.name]) for c in self.columns], axis=1)
        # a count's code x - lower may exceed float32's range only where the schema's
        # range does; clipping first keeps every code finite (and the cast silent)
        big = float(np.finfo(np.float32).max)
        return np.clip(codes, -big, big).astype(np.float32)

    def decode(self, codes: np.ndarray) -> pd.DataFrame:
        """Decode a code matrix ``(n, D)`` to a DataFrame with the schema's columns and dtypes."""
        codes = np.asarray(codes)
        if codes.ndim != 2 or codes.shape[1] != len(self.columns):
            raise ValueError(
                f"Expected codes of shape (n, {len(self.columns)}), got shape {codes.shape}."
            )
        return pd.DataFrame({c.name: c.decode(codes[:, j]) for j, c in enumerate(self.columns)})

    def placeholder_codes(self, num_records: int = 1) -> np.ndarray:
        """A public, data-independent code matrix of valid values (used to
        initialise models without touching the private data)."""
        # 0 is a valid code for every kind: the first level, False, the lowest
        # count, the middle of a numeric range
        return np.zeros((num_records, len(self.columns)), np.float32)

    def summary_lines(self) -> List[str]:
        """One human-readable line per column; bounds only where they were
        given (a bound read from the data is one record's value)."""
        lines = []
        for c in self.columns:
            s = f"{c.name}: {c.kind}"
            if c.kind == "categorical":
                s += f", {c.num_levels} levels"
                if c.other is not None:
                    s += f" (other: {c.other!r})"
            elif c.kind in ("real", "count"):
                read = {"lower", "upper"} & set(c.inferred)
                # a bound read from the data is one record's value: in the file, never printed
                s += (", bounds read from the data" if read else f" in [{c.lower:g}, {c.upper:g}]")
                s += f", {c.distribution}"
                if c.decimals is not None:
                    s += f", {c.decimals} decimals"
            if c.nullable:
                s += ", nullable"
            if c.inferred:
                s += f"  (read from data: {', '.join(c.inferred)})"
            lines.append(s)
        return lines

    def inferred_lines(self, fields: Optional[Mapping[str, Sequence[str]]] = None, *,
                       max_columns: int = 12, name_width: int = 24) -> List[str]:
        """A short summary of what was read from the data: one line per column
        (at most ``max_columns``, then a line with the number left out) with
        its name (cut at ``name_width`` characters), kind, number of levels and
        the fields read. It quotes no value of the data (no bound, no level).

        :param fields: ``{column: fields read}`` (default: :meth:`inferred_fields`).
        :param int max_columns: the most columns listed.
        :param int name_width: the most characters of a column name shown.
        """
        fields = self.inferred_fields() if fields is None else fields
        shown = [(name, read) for name, read in fields.items() if read]
        rows = []
        for name, read in shown[:max_columns]:
            c = self[name]
            label = name if len(name) <= name_width else name[:name_width - 1] + "…"
            detail = c.kind or "?"
            if c.kind == "categorical":
                detail += f", {c.num_levels} level{'s' if c.num_levels != 1 else ''}"
            read = ["bounds" if f in ("lower", "upper") else f for f in read]
            rows.append((label, detail, ", ".join(dict.fromkeys(read))))
        widths = [max((len(r[i]) for r in rows), default=0) for i in range(2)]
        lines = [f"{label:<{widths[0]}}  {detail:<{widths[1]}}  read: {read}" for label, detail, read in rows]
        if len(shown) > max_columns:
            left = len(shown) - max_columns
            lines.append(f"... and {left} more column{'s' if left != 1 else ''}")
        return lines


# ---------------------------------------------------------------- inference


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
            groups["levels"].append(f"{name!r} ({c.num_levels} levels)")
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
