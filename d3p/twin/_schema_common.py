"""The vocabulary of twin schemas: column kinds, distributions, constants, errors and checks.

Imported by the schema's data types (``d3p.twin._schema_types``), its
encoding (``d3p.twin._schema_encoding``) and its inference from data
(``d3p.twin._schema_inference``); the public names are imported from
:mod:`d3p.twin.schema`.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from d3p import _validate

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


def _level_key(v):
    """Hashable key identifying a level (1 and 1.0 and True are different levels)."""
    return (type(v).__name__ if not isinstance(v, (int, float)) or isinstance(v, bool) else "num", v)
