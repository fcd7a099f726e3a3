"""The data types of twin schemas: :class:`ColumnSpec` (one column) and :class:`Schema` (a table).

What a schema says about each column, its checks (of the schema alone), its
status (``missing_fields``, ``is_complete``, ``output_dtype``), its JSON
form and its summaries. Encoding a column or a table is delegated to
``d3p.twin._schema_encoding``; completing a schema from data is
``d3p.twin._schema_inference``. The public names are imported from
:mod:`d3p.twin.schema` (and :mod:`d3p.twin`), whose documentation states
the encoding and what a schema releases.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import pandas as pd

from d3p import _validate
from d3p.twin import _schema_encoding
from d3p.twin._schema_common import (
    DISTRIBUTIONS,
    KINDS,
    MAX_DECIMALS,
    TwinInputError,
    _column_check,
    _jsonable,
    _level_key,
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
        return _schema_encoding.scale(self, x)

    def scale_inverse(self, z: np.ndarray) -> np.ndarray:
        """Codes (clipped to [-1, 1]) back to numeric values in ``[lower, upper]``
        (the inverse of :meth:`scale`)."""
        return _schema_encoding.scale_inverse(self, z)

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
        return _schema_encoding.encode_column(self, series)

    @property
    def fallback_code(self) -> float:
        """The code that a missing value of a non-nullable column gets in
        :meth:`encode`: the level ``other`` if declared, else the first level
        (index 0); ``False``; ``lower``. A function of the spec alone."""
        return _schema_encoding.fallback_code(self)

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
        return _schema_encoding.decode_column(self, codes)


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
        return _schema_encoding.encode_table(self, data)

    def decode(self, codes: np.ndarray) -> pd.DataFrame:
        """Decode a code matrix ``(n, D)`` to a DataFrame with the schema's columns and dtypes."""
        return _schema_encoding.decode_table(self, codes)

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
                s += f", {_validate.plural(c.num_levels, 'level')}"
                if c.other is not None:
                    s += f" (other: {c.other!r})"
            elif c.kind in ("real", "count"):
                read = {"lower", "upper"} & set(c.inferred)
                # a bound read from the data is one record's value: in the file, never printed
                s += (", bounds read from the data" if read else f" in [{c.lower:g}, {c.upper:g}]")
                s += f", {c.distribution}"
                if c.decimals is not None:
                    s += f", {_validate.plural(c.decimals, 'decimal')}"
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
                detail += f", {_validate.plural(c.num_levels, 'level')}"
            read = ["bounds" if f in ("lower", "upper") else f for f in read]
            rows.append((label, detail, ", ".join(dict.fromkeys(read))))
        widths = [max((len(r[i]) for r in rows), default=0) for i in range(2)]
        lines = [f"{label:<{widths[0]}}  {detail:<{widths[1]}}  read: {read}" for label, detail, read in rows]
        if len(shown) > max_columns:
            left = len(shown) - max_columns
            lines.append(f"... and {_validate.plural(left, 'more column')}")
        return lines
