"""Per-record data given as something other than an array: the fixed rule
that turns it into arrays without letting a record choose how.

NumPy and pandas pick a dtype from the values they hold: ``np.asarray`` gives
``object`` for a list holding ``2**64`` or ``None`` and ``<U30`` for one
holding a 30-character text; pandas gives ``object`` for a column holding a
text, ``float64`` for an integer column with a missing value. Converted that
way, one record would decide the dtype, hence whether the data are refused,
what an error says and how the model runs. So d3p converts by a rule that
reads no value (docs/privacy.md, "Input data and their dtypes"):

- NumPy and JAX arrays (and other objects with ``__array__`` and ``shape``
  that are not pandas objects) keep their own dtype, the one declared for
  them, canonicalised as JAX does (``float64`` to ``float32`` unless 64-bit
  mode is on); values that do not fit that dtype are cast record by record
  (NumPy's cast: a float beyond the range becomes ``inf``), without warning.
- A plain list or tuple holding records (see :func:`is_column`) is one
  column, one value per record; every pandas ``Series``, ``Index`` and
  column of a ``DataFrame`` is one column (a ``DataFrame`` gives a table,
  rows the records). Each column becomes JAX's default float dtype
  (``float32``, ``float64`` in 64-bit mode), element by element, whatever
  its values or its pandas dtype: a real number (``bool``, ``int`` of any
  size, ``float``, ``decimal.Decimal``, ``fractions.Fraction``, NumPy's real
  and boolean scalars and 0-d arrays) becomes the nearest float (beyond the
  range: ``inf`` of its sign); anything else (``None``, ``pd.NA``, text,
  bytes, dates, complex numbers, a nested list, ...) becomes NaN. Text is
  never parsed. A record holding NaN is left out of a DP-VI step like any
  record whose gradient is not finite.

Nothing here raises or warns because of a value; the caller's objects are
never modified (every conversion makes a new array).
"""

import decimal
import math
import numbers
import sys
import warnings

import jax
import numpy as np


def default_float() -> np.dtype:
    """JAX's default float dtype now: ``float32``, ``float64`` in 64-bit mode."""
    return np.dtype(jax.dtypes.canonicalize_dtype(np.float64))


def is_pandas(x) -> bool:
    """Whether ``x`` is a pandas object that holds data (a ``DataFrame``,
    ``Series``, ``Index`` or extension array); False if pandas is not loaded."""
    pd = sys.modules.get("pandas")
    if pd is None:
        return False
    return isinstance(x, (pd.DataFrame, pd.Series, pd.Index, pd.api.extensions.ExtensionArray))


def _is_namedtuple(x) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _is_data_argument(x) -> bool:
    """Whether ``x`` is a data argument on its own (the records it holds are
    checked as such): an array (NumPy or JAX, traced or not), a pandas
    object, another object with ``__array__`` and ``shape``, a dict, a
    namedtuple, or a container (see :func:`is_column`)."""
    if isinstance(x, (dict, jax.Array, np.ndarray)) or is_pandas(x) or _is_namedtuple(x):
        return True
    if isinstance(x, np.generic):
        return False
    if hasattr(x, "__array__") and hasattr(x, "shape"):
        return True
    return type(x) in (list, tuple) and len(x) > 0 and all(_is_data_argument(e) for e in x)


def is_column(x) -> bool:
    """Whether ``x`` is a column of records: a non-empty plain list or tuple
    (not a namedtuple) that is not a container of data arguments, i.e. not
    every element of it an array, a pandas object, a dict, a namedtuple or
    (nested) such a container (a container's arrays are checked, and 0-d
    ones refused, as arguments). The elements of a column are the records,
    whatever they hold: a record can make a column a container only if
    every other element of it is already a data argument."""
    return type(x) in (list, tuple) and len(x) > 0 and not _is_data_argument(x)


def _real(e) -> float:
    """One record's value as a Python float by the element rule (module docstring)."""
    if isinstance(e, np.ndarray):   # a JAX array is never read here (it may be traced)
        if e.ndim != 0 or not (np.issubdtype(e.dtype, np.number) or np.issubdtype(e.dtype, np.bool_)):
            return math.nan
        e = e[()]
    if not isinstance(e, (numbers.Real, decimal.Decimal, np.bool_)) or isinstance(e, np.timedelta64):
        return math.nan
    try:
        return float(e)
    except OverflowError:   # an int or a Fraction beyond float64
        try:
            return -math.inf if e < 0 else math.inf
        except Exception:  # noqa: BLE001 - a record's own comparison: no value decides the path
            return math.nan
    except Exception:  # noqa: BLE001 - e.g. a signalling NaN Decimal
        return math.nan


def _cast(values: np.ndarray, dtype) -> np.ndarray:
    """``values`` cast to ``dtype`` (a new array), silently: NumPy's overflow
    and invalid-value warnings would depend on a record."""
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return np.array(values, dtype=dtype, copy=True)


def _elements(values) -> np.ndarray:
    """A sequence of records as float64 by the element rule."""
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return np.fromiter((_real(e) for e in values), np.float64, count=len(values))


def _pandas_column(column, dtype) -> np.ndarray:
    """One pandas column (``Series``, ``Index`` or extension array) as a 1-d
    array of ``dtype``: numeric and boolean NumPy-backed columns cast through
    float64 (as their elements would be), all others element by element."""
    kind = column.dtype.kind if isinstance(column.dtype, np.dtype) else None
    if kind is not None and kind in "biuf":
        return _cast(_cast(column.to_numpy(), np.float64), dtype)
    return _cast(_elements(np.asarray(column, dtype=object).reshape(-1)), dtype)


def column_array(x) -> np.ndarray:
    """The column ``x`` (see :func:`is_column`) as a 1-d array of the default float dtype."""
    return _cast(_elements(x), default_float())


def pandas_array(x) -> np.ndarray:
    """The pandas object ``x`` as an array of the default float dtype: a
    ``DataFrame`` as ``(rows, columns)``, anything else as ``(rows,)``."""
    dtype = default_float()
    pd = sys.modules["pandas"]
    if isinstance(x, pd.DataFrame):
        columns = [_pandas_column(x.iloc[:, j], dtype) for j in range(x.shape[1])]
        return np.stack(columns, axis=1) if columns else np.zeros((x.shape[0], 0), dtype)
    if isinstance(x, (pd.Series, pd.Index)):
        return _pandas_column(x, dtype)
    return _pandas_column(pd.Series(x, copy=False), dtype)


def canonical_array(x: np.ndarray) -> np.ndarray:
    """A NumPy array of numbers or booleans in JAX's canonical dtype for its
    own (``x`` itself if it is already), cast silently; any other ``x`` as it is."""
    if x.dtype.kind not in "biufc":
        return x
    dtype = np.dtype(jax.dtypes.canonicalize_dtype(x.dtype))
    return x if dtype == x.dtype else _cast(x, dtype)


def as_records_array(x):
    """``x`` as an array by the module's rule if it is a column, a pandas
    object, a NumPy array or another array-like; else ``x`` (a JAX array, a
    scalar or another object, which the caller checks)."""
    if isinstance(x, jax.Array):
        return x
    if isinstance(x, np.ndarray):
        return canonical_array(x)
    if is_column(x):
        return column_array(x)
    if is_pandas(x):
        return pandas_array(x)
    if not isinstance(x, np.generic) and hasattr(x, "__array__") and hasattr(x, "shape"):
        return canonical_array(np.asarray(x))
    return x
