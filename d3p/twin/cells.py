"""Cells: every column of a schema cut into finitely many cells, for marginal tables.

The marginal twin (:mod:`d3p.twin.marginal`) sees each record as one cell
per column; its counts are contingency tables of these cells. A
:class:`CellSpace` maps the codes of :meth:`d3p.twin.Schema.encode` to cells
and cells back to codes; the mapping is a function of the schema alone
(public), applied record by record:

=========================  ====================================================
column                     cells
=========================  ====================================================
categorical                one per level
boolean                    False, True
count with a range of at   one per integer value ``lower, ..., upper``
most ``max_integer_cells``
other counts, reals        ``bins`` equal-width bins over ``[lower, upper]``
                           (:func:`bin_edges`; each holds its lower edge, the
                           last also ``upper``; values outside the bounds were
                           clipped by the encoding); with
                           ``distribution="hurdle"`` one more cell, first,
                           for the value ``lower`` exactly
nullable columns           one more cell, last, for a missing value
=========================  ====================================================

A value exactly on an edge is in the bin above it, as the encoding left it:
a real value's bin is found by comparing its code with the codes of the
edges (the encoding maps a value equal to an edge to exactly the edge's
code, where decoding the code back to a value and comparing that could
fall just below the edge), a count's by its value, an integer.

Decoding a bin draws a value uniformly from it (counts: an integer uniformly
among those in the bin), so synthetic values stay within the column's bounds
and a count stays an integer.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import List, NamedTuple, Tuple

import numpy as np

from d3p import _validate
from d3p.twin.schema import ColumnSpec, Schema, check_type

__all__ = ["CellSpace", "ColumnCells", "DEFAULT_BINS", "DEFAULT_MAX_INTEGER_CELLS", "bin_edges"]

#: Default number of equal-width bins of a real column (and of a count with a wide range).
DEFAULT_BINS = 20
#: Counts with at most this many possible values get one cell per value.
DEFAULT_MAX_INTEGER_CELLS = 32


def bin_edges(lower: float, upper: float, bins: int) -> np.ndarray:
    """The ``bins + 1`` edges of ``bins`` equal-width bins of ``[lower, upper]``:
    edge ``b`` is ``lower + (upper - lower) b / bins`` computed exactly from
    the bounds as written (the shortest decimals of their floats, as a JSON
    schema holds them) and rounded once to the nearest float. An edge that
    is a decimal is then that decimal's float, the value a user types: 0.15
    of ``[0, 1]`` and 0.12 of ``[0.1, 0.3]`` in 20 bins (steps in floating
    point give 0.15000000000000002 and 0.12000000000000001). The first edge
    is ``lower`` and the last ``upper``. Bin ``b`` holds the values
    ``edges[b] <= x < edges[b + 1]``, the last bin also ``upper``.

    :param float lower: the lowest value.
    :param float upper: the highest value (> ``lower``).
    :param int bins: the number of bins.
    """
    lo, hi = Fraction(repr(float(lower))), Fraction(repr(float(upper)))
    return np.array([float(lo + (hi - lo) * b / bins) for b in range(bins + 1)])


class ColumnCells(NamedTuple):
    """The cells of one column.

    ``kind`` is ``"levels"`` (one cell per level, boolean value or integer)
    or ``"bins"``; ``num_values`` counts those cells; ``hurdle`` adds a first
    cell for the value ``lower`` exactly; ``missing`` a last cell for a
    missing value.
    """

    kind: str
    num_values: int
    hurdle: bool
    missing: bool

    @property
    def size(self) -> int:
        """The number of cells."""
        return self.num_values + int(self.hurdle) + int(self.missing)


def _column_cells(spec: ColumnSpec, bins: int, max_integer_cells: int) -> ColumnCells:
    missing = bool(spec.nullable)
    if spec.kind == "categorical":
        return ColumnCells("levels", max(spec.num_levels, 1), False, missing)
    if spec.kind == "boolean":
        return ColumnCells("levels", 2, False, missing)
    if spec.kind == "count" and spec.upper - spec.lower + 1 <= max_integer_cells:
        return ColumnCells("levels", int(spec.upper - spec.lower) + 1, False, missing)
    hurdle = spec.distribution == "hurdle" and spec.upper > spec.lower
    if spec.upper == spec.lower:
        return ColumnCells("bins", 1, False, missing)
    return ColumnCells("bins", bins, hurdle, missing)


def _values(spec: ColumnSpec, codes: np.ndarray) -> np.ndarray:
    """The numeric values of a count or real column's codes (``NaN`` stays)."""
    if spec.kind == "count" and spec.distribution in ("poisson", "negbinomial"):
        return codes + spec.lower
    out = np.full(codes.shape, np.nan)
    ok = ~np.isnan(codes)
    out[ok] = spec.scale_inverse(codes[ok])
    return np.round(out) if spec.kind == "count" else out


def _codes(spec: ColumnSpec, values: np.ndarray) -> np.ndarray:
    """The codes of a count or real column's values (inverse of :func:`_values`)."""
    if spec.kind == "count" and spec.distribution in ("poisson", "negbinomial"):
        return values - spec.lower
    out = np.full(values.shape, np.nan)
    ok = ~np.isnan(values)
    out[ok] = spec.scale(values[ok])
    return out


class CellSpace:
    """The cells of every column of a complete schema (see the module docstring).

    :param Schema schema: a complete schema.
    :param int bins: number of equal-width bins of real columns (default 20).
    :param int max_integer_cells: counts with at most this many values get one
        cell per value (default 32).
    """

    def __init__(self, schema: Schema, bins: int = DEFAULT_BINS,
                 max_integer_cells: int = DEFAULT_MAX_INTEGER_CELLS):
        check_type("schema", schema, Schema, "a d3p.twin.Schema")
        if not schema.is_complete:
            raise ValueError("Expected a complete schema (see d3p.twin.infer_schema).")
        self.schema = schema
        self.bins = _validate.integer("bins", bins, minimum=1)
        self.max_integer_cells = _validate.integer("max_integer_cells", max_integer_cells, minimum=1)
        self.columns: Tuple[ColumnCells, ...] = tuple(
            _column_cells(c, self.bins, self.max_integer_cells) for c in schema.columns)

    @property
    def sizes(self) -> Tuple[int, ...]:
        """The number of cells of every column."""
        return tuple(c.size for c in self.columns)

    def description(self) -> dict:
        """The settings (JSON), enough to rebuild the cell space with the schema."""
        return {"bins": self.bins, "max_integer_cells": self.max_integer_cells}

    # ------------------------------------------------------------------ codes -> cells

    def cells(self, codes: np.ndarray) -> np.ndarray:
        """Cells ``int32 (N, D)`` of a code matrix from :meth:`Schema.encode` (a per-record map)."""
        codes = np.asarray(codes)
        # a real value's bin is read from its code at the codes' own precision (see _bin_of)
        precision = np.float32 if codes.dtype == np.float32 else np.float64
        codes = codes.astype(np.float64)
        out = np.empty(codes.shape, np.int32)
        for j, (spec, cells) in enumerate(zip(self.schema.columns, self.columns)):
            out[:, j] = self._column_to_cells(spec, cells, codes[:, j], precision)
        return out

    def _column_to_cells(self, spec: ColumnSpec, cells: ColumnCells, codes: np.ndarray,
                         precision=np.float64) -> np.ndarray:
        missing = np.isnan(codes)
        if cells.kind == "levels":
            if spec.kind == "count":
                idx = np.round(_values(spec, codes) - spec.lower)
            else:
                idx = np.round(codes)
            idx = np.clip(np.where(missing, 0, idx), 0, cells.num_values - 1)
        else:
            idx = self._bin_of(spec, cells, codes, precision)
        if cells.missing:
            idx = np.where(missing, cells.size - 1, idx)
        return idx.astype(np.int32)

    def _edges(self, spec: ColumnSpec, cells: ColumnCells) -> np.ndarray:
        return bin_edges(spec.lower, spec.upper, cells.num_values)

    def _bin_of(self, spec: ColumnSpec, cells: ColumnCells, codes: np.ndarray,
                precision=np.float64) -> np.ndarray:
        """Bin index (after the hurdle cell, if any) of the codes of values in
        ``[lower, upper]`` (a missing value: any index): the bin that holds the
        value, a value on an edge in the bin above it. ``precision``: the
        codes' dtype as encoded, at which a real value's code is compared with
        the edges' codes (a value equal to an edge has exactly the edge's code;
        one within the codes' precision below it, the same code)."""
        edges = self._edges(spec, cells)
        if spec.kind == "count":   # the value: an integer, exact after rounding
            x, points = _values(spec, codes), edges
        else:
            x, points = codes.astype(precision), _codes(spec, edges).astype(precision)
        x = np.where(np.isnan(x), points[0], x)
        idx = np.clip(np.searchsorted(points, x, side="right") - 1, 0, cells.num_values - 1)
        if cells.hurdle:
            idx = np.where(x <= points[0], 0, idx + 1)
        return idx

    # ------------------------------------------------------------------ cells -> codes

    def codes(self, cells: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Codes ``(n, D)`` (``NaN`` = missing) of cells; a bin becomes a uniform value in it.

        :param numpy.ndarray cells: integer cells ``(n, D)``.
        :param numpy.random.Generator rng: for the values within bins.
        """
        cells = np.asarray(cells)
        out = np.empty(cells.shape, np.float64)
        for j, (spec, col) in enumerate(zip(self.schema.columns, self.columns)):
            out[:, j] = self._column_to_codes(spec, col, cells[:, j], rng)
        return out

    def _column_to_codes(self, spec: ColumnSpec, col: ColumnCells, idx: np.ndarray,
                         rng: np.random.Generator) -> np.ndarray:
        missing = (idx == col.size - 1) if col.missing else np.zeros(idx.shape, bool)
        idx = np.where(missing, 0, idx)
        if col.kind == "levels":
            codes = idx.astype(np.float64)
            if spec.kind == "count":
                codes = _codes(spec, idx + spec.lower)
        else:
            codes = _codes(spec, self._value_in_bin(spec, col, idx, rng))
        return np.where(missing, np.nan, codes)

    def _value_in_bin(self, spec: ColumnSpec, col: ColumnCells, idx: np.ndarray,
                      rng: np.random.Generator) -> np.ndarray:
        at_lower = (idx == 0) if col.hurdle else np.zeros(idx.shape, bool)
        b = np.clip(idx - int(col.hurdle), 0, col.num_values - 1)
        edges = self._edges(spec, col)
        lo, hi = edges[b], edges[b + 1]
        if spec.kind == "count":
            first, last = _integer_range(spec, edges, col.hurdle)
            x = first[b] + np.floor(rng.random(idx.shape) * (last[b] - first[b] + 1))
            x = np.minimum(x, last[b])
        else:
            x = lo + rng.random(idx.shape) * (hi - lo)
        return np.clip(np.where(at_lower, spec.lower, x), spec.lower, spec.upper)

    # ------------------------------------------------------------------ coarsening

    def coarsening(self, column: int, num_cells: int) -> np.ndarray:
        """A 0/1 matrix ``(k, size)`` that merges neighbouring value cells of a
        column into ``k <= num_cells`` groups (hurdle and missing cells stay
        on their own): the linear map of a coarser measurement."""
        col = self.columns[column]
        groups = min(num_cells, col.num_values)
        owner = (np.arange(col.num_values) * groups) // col.num_values
        rows: List[np.ndarray] = []
        size = col.size
        offset = int(col.hurdle)
        if col.hurdle:
            rows.append(np.eye(size)[0])
        for g in range(groups):
            row = np.zeros(size)
            row[offset + np.flatnonzero(owner == g)] = 1.0
            rows.append(row)
        if col.missing:
            rows.append(np.eye(size)[size - 1])
        return np.stack(rows)


def _integer_range(spec: ColumnSpec, edges: np.ndarray, hurdle: bool):
    """For each bin of a count column, its smallest and largest integer value (the
    value ``x`` is in bin ``b`` when ``edges[b] <= x < edges[b + 1]``, the last bin
    closed; with a hurdle cell, ``lower`` itself is not in the first bin)."""
    first = np.ceil(edges[:-1])
    if hurdle:
        first[0] = max(first[0], spec.lower + 1)
    last = np.ceil(edges[1:]) - 1
    last[-1] = math.floor(spec.upper)
    last = np.maximum(last, first)
    return first, last
