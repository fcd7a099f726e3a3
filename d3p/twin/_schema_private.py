"""Private schema inference: the fields a schema leaves out, read from the data with differential privacy.

One release per fit (:func:`infer_schema_private`): for every column that the
given schema leaves incomplete, one histogram in which each record falls in
exactly one cell, released with Gaussian noise:

* a cell for a missing value;
* a public grid for numbers: one cell for each integer from
  ``-EXACT_LIMIT`` to ``EXACT_LIMIT``, and beyond (or for non-integers) one
  cell per sign, power of two ``[2**k, 2**(k+1))`` (``k`` from
  :data:`MIN_EXPONENT` to :data:`MAX_EXPONENT`, the ends open) and
  integrality; every cell of the grid is released, empty or not;
* one cell for each distinct text (a value that is not a number): a cell is
  released only if its noisy count clears :attr:`SchemaPlan.level_threshold`,
  set so that a text held by one record is released with probability at most
  the plan's threshold δ (the stability-based histogram: Korolova et al. 2009;
  Wilkins et al. 2024, "Exact privacy analysis of the Gaussian sparse
  histogram mechanism").

Everything else is post-processing of the noisy counts, by public rules
(:func:`_column_spec`): kinds, levels, bounds, nullability and distribution.

Accounting (the plan, public): the histograms of the ``c`` columns together
have L2 sensitivity ``sqrt(c)`` under add/remove (``sqrt(2c)`` under
substitution), so with noise std ``s`` per cell the grid and the texts that
two neighbours share are a Gaussian mechanism of ``μ = Δ / s``, which is
``ρ = μ² / 2``-zCDP; the plan takes ``ρ`` as ``share`` of the twin's
``zcdp_rho(ε, δ - δ_thr)``. A text that only one neighbour holds (at most
one per column and direction) is released with probability at most ``p``
per column; the release is then ``(ε', δ' + δ_thr)``-DP for every
``(ε', δ')`` of the Gaussian part composed with the rest of the fit, with
``δ_thr = e^ε c p / (1 - c p)`` (the union over the columns; the factor
``e^ε / (1 - c p)`` covers the direction in which the larger neighbour's
release is conditioned on not releasing the text). The discretisation of the
noise (:func:`d3p.random.normal_float64`) adds its per-cell tail to ``δ_thr``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import pandas as pd
from scipy.special import ndtri

import d3p.random
import d3p.twin.marginal
from d3p import _validate, accounting
from d3p._zcdp_budget import count_sensitivity, zcdp_rho
from d3p.twin._schema_common import DEFAULT_MAX_LEVELS, HURDLE_MIN_SHARE, MAX_DECIMALS, POISSON_MAX_RANGE

__all__ = ["SCHEMA_SHARE", "SchemaPlan", "PrivateSchema", "plan_schema", "infer_schema_private", "schema_key"]

#: Share of the twin's ρ spent on the schema when fields are read privately (the default path).
SCHEMA_SHARE = 0.1
#: Share of the twin's δ spent on releasing text levels (the threshold of the sparse histogram).
LEVEL_DELTA_SHARE = 0.1
#: Integers from ``-EXACT_LIMIT`` to ``EXACT_LIMIT`` have a cell each (codes, scales, small counts).
EXACT_LIMIT = 15
#: Powers of two of the numeric grid: ``[2**k, 2**(k+1))`` for k in [MIN_EXPONENT, MAX_EXPONENT]; the
#: ends are open (smaller magnitudes, and larger ones up to inf, fall in the end cells), so bounds lie
#: within ±2**53, where every integer is exact in float64 and int64.
MIN_EXPONENT, MAX_EXPONENT = -30, 52
#: Expected number of empty cells or groups of the public grid that clear their threshold, per column.
FALSE_CELLS = 0.01
#: The bounds reach one group further where its noisy sum exceeds this many of its noise stds
#: (a bound too tight clips records; one too wide only coarsens the column).
EXTEND_Z = 2.0
#: A numeric column is categorical (``boolean`` if 0 and 1) where its cleared exact integers hold all
#: but at most this share of its present values (or what the noise of their sum hides).
EXACT_OUTSIDE_SHARE = 0.05
#: The level added to a categorical column read privately, for the values that are not among its levels.
OTHER_LEVEL = "other"
#: ``True``/``False`` as text (any case, blanks ignored): a column of these is boolean.
_BOOLEAN_WORDS = {"true": True, "false": False, "t": True, "f": False, "yes": True, "no": False}
#: Fold-in tag of the schema's key (independent of every key of the fit).
_SCHEMA_KEY_TAG = 0x5C4E


_NUM_EXACT = 2 * EXACT_LIMIT + 1
_NUM_EXPONENTS = MAX_EXPONENT - MIN_EXPONENT + 1
#: Cell 0 is "missing", then the exact integers, then (sign, exponent, integrality).
GRID_SIZE = 1 + _NUM_EXACT + 2 * _NUM_EXPONENTS * 2


class SchemaPlan(NamedTuple):
    """The public plan of a private schema release (no private value)."""

    num_columns: int        # columns whose histogram is released
    epsilon: float          # the twin's target ε
    delta: float            # the twin's target δ
    share: float            # of the twin's ρ
    rho: float              # zCDP of the Gaussian part
    relation: str
    noise_std: float        # per cell
    delta_threshold: float  # δ_thr: texts held by one neighbour only, and the noise's discretisation
    level_threshold: float  # a text's noisy count must exceed this to be released
    grid_z: float           # a public cell or group of m cells clears above grid_z * noise_std * sqrt(m)

    @property
    def mu(self) -> float:
        """μ of the Gaussian part (GDP): ``sqrt(2 ρ)``."""
        return math.sqrt(2.0 * self.rho)

    def phase_sigma(self) -> float:
        """The noise multiplier of one step with q = 1 that :func:`d3p.accounting.compose_epsilon`
        accounts as this release's Gaussian part under its relation (sensitivity 1 under add/remove,
        2 under substitution)."""
        return (2.0 if self.relation == accounting.SUBSTITUTE else 1.0) / self.mu


class PrivateSchema(NamedTuple):
    """A schema completed by :func:`infer_schema_private`, with the plan it was released under."""

    schema: Any             # d3p.twin.Schema
    plan: SchemaPlan
    columns: Tuple[str, ...]  # the columns whose fields were read privately
    key: Optional[str] = None  # d3p.ledger.key_fingerprint of the release's key (a fit refuses to reuse it)

    def record(self) -> dict:
        """What ``TwinResult.privacy["schema"]`` says of the release."""
        p = self.plan
        return {"mechanism": "Gaussian sparse histogram per column (public numeric grid, thresholded texts)",
                "share": p.share, "rho": p.rho, "delta_threshold": p.delta_threshold,
                "noise_std": p.noise_std, "level_threshold": p.level_threshold, "columns": list(self.columns)}


def schema_key(rng_key):
    """The key of the schema release, derived from a fit's ``d3p.random`` key (independent of the fit's)."""
    return d3p.random.fold_in(rng_key, _SCHEMA_KEY_TAG)


def _discretisation_tail(noise_std: float) -> float:
    """Per released cell: the probability that the noise's attainable values near it differ between
    neighbours (:func:`d3p.twin.marginal._measure`)."""
    if noise_std < 4096:
        return 5.5e-16
    if noise_std < 2.0 ** 20:
        return 1.4e-13
    raise ValueError(f"Expected a schema share large enough for noise below 2**20 per cell, got a noise std "
                     f"of {noise_std:.3g}; raise schema_share.")


def plan_schema(num_columns: int, num_records: int, epsilon: float, delta: float, *,
                relation: str = accounting.ADD_REMOVE, share: float = SCHEMA_SHARE) -> SchemaPlan:
    """The plan of a private schema release of ``num_columns`` columns (public settings only).

    :param int num_columns: columns read privately (c ≥ 1).
    :param int num_records: N (public; bounds the number of texts a column can hold).
    :param float epsilon: the twin's target ε (finite).
    :param float delta: the twin's target δ.
    :param str relation: ``"add_remove"`` or ``"substitute"``.
    :param float share: the share of the twin's ρ, in (0, 1).
    """
    c = _validate.integer("num_columns", num_columns, minimum=1)
    n = _validate.integer("num_records", num_records, minimum=1)
    epsilon = _validate.positive("epsilon", epsilon)
    delta = _validate.open_unit("delta", delta)
    share = _validate.number("schema_share", share, low=0.0, high=1.0, low_open=True, high_open=True)
    relation = str(accounting.Relation(relation))
    delta_thr = LEVEL_DELTA_SHARE * delta
    rho = share * zcdp_rho(epsilon, delta - delta_thr)
    sensitivity = count_sensitivity(relation, "l2") * math.sqrt(c)
    std = sensitivity / math.sqrt(2.0 * rho)
    tail = _discretisation_tail(std) * c * (GRID_SIZE + n)
    # P(a text of one record clears), per column: e^ε c p / (1 - c p) + tail <= δ_thr
    room = delta_thr - tail
    p = room / (c * (math.exp(epsilon) + room))
    grid = d3p.twin.marginal._release_grid(std)
    level_threshold = 1.0 + std * float(-ndtri(p)) + grid
    grid_z = float(-ndtri(FALSE_CELLS / (2.0 * GRID_SIZE)))
    return SchemaPlan(c, epsilon, delta, share, rho, relation, std, delta_thr, level_threshold, grid_z)


# ------------------------------------------------------------------ the release


def _classify(value) -> Tuple[int, Optional[str]]:
    """``(cell, text)`` of one distinct value: a grid cell (0 missing) and None, or -1 and its text."""
    if isinstance(value, (bool, np.bool_)):
        return _grid_cell(float(value)), None
    if isinstance(value, str):
        try:
            x = float(value)
        except ValueError:
            return -1, value
        return _grid_cell(x), None
    if isinstance(value, (int, float, np.integer, np.floating)):
        try:
            return _grid_cell(float(value)), None
        except OverflowError:   # an integer beyond float64's range
            return _grid_cell(math.inf if value > 0 else -math.inf), None
    try:
        if pd.isna(value):
            return 0, None
    except (TypeError, ValueError):
        pass
    return -1, str(value)


def _grid_cell(x: float) -> int:
    """The grid cell of a number (NaN: missing)."""
    if math.isnan(x):
        return 0
    integral = math.isfinite(x) and x == math.floor(x)
    if integral and abs(x) <= EXACT_LIMIT:
        return 1 + int(x) + EXACT_LIMIT
    if math.isinf(x):
        k = MAX_EXPONENT
    else:
        k = min(max(math.frexp(abs(x))[1] - 1, MIN_EXPONENT), MAX_EXPONENT)
    return _bucket_cell(0 if x < 0 else 1, k, integral)


def _bucket_cell(sign: int, k: int, integral: bool) -> int:
    return 1 + _NUM_EXACT + ((sign * _NUM_EXPONENTS + (k - MIN_EXPONENT)) * 2 + int(integral))


def _hashable(v) -> bool:
    try:
        hash(v)
    except TypeError:
        return False
    return True


def _column_counts(col: pd.Series) -> Tuple[np.ndarray, Dict[str, int]]:
    """Exact counts of one column: the grid (int64) and ``{text: count}``."""
    values = col.astype(object)
    try:
        codes, uniques = pd.factorize(values, use_na_sentinel=True)
    except TypeError:   # an unhashable value (a list in a cell) is read as its text
        codes, uniques = pd.factorize(values.map(lambda v: v if _hashable(v) else str(v)), use_na_sentinel=True)
    grid = np.zeros(GRID_SIZE, np.int64)
    per_unique = np.bincount(codes[codes >= 0], minlength=len(uniques))
    grid[0] += int(np.sum(codes < 0))
    texts: Dict[str, int] = {}
    for value, count in zip(uniques.tolist(), per_unique.tolist()):
        cell, text = _classify(value)
        if text is None:
            grid[cell] += count
        else:
            texts[text] = texts.get(text, 0) + count
    return grid, texts


def _noisy_release(columns: Sequence[pd.Series], plan: SchemaPlan, rng_key):
    """Per column: (noisy grid, {text: noisy count} of the texts that clear the level threshold)."""
    from d3p.twin.marginal import _noisy_counts

    counts = [_column_counts(col) for col in columns]
    total = sum(GRID_SIZE + len(t) for _, t in counts)
    z = d3p.random.normal_float64(rng_key, (total,))
    out, start = [], 0
    for grid, texts in counts:
        noisy_grid = _noisy_counts(grid, plan.noise_std, z[start:start + GRID_SIZE])
        start += GRID_SIZE
        names = list(texts)
        noisy = _noisy_counts(np.asarray([texts[t] for t in names], np.int64), plan.noise_std,
                              z[start:start + len(names)])
        start += len(names)
        out.append((noisy_grid, {t: float(v) for t, v in zip(names, noisy) if v > plan.level_threshold}))
    return out


# ------------------------------------------------------------------ post-processing


class _Group(NamedTuple):
    lower: float
    upper: float
    cells: Tuple[int, ...]
    open_end: int          # 0: [lower, upper] closed; 1: [lower, upper); -1: (lower, upper]


def _groups() -> List[_Group]:
    """The public groups of grid cells whose sums set the bounds: each exact integer, and per sign and
    power of two the cells of ``[2**k, 2**(k+1))`` (both integralities, and the exact integers in it)."""
    out = [_Group(float(v), float(v), (1 + v + EXACT_LIMIT,), 0) for v in range(-EXACT_LIMIT, EXACT_LIMIT + 1)]
    for sign in (0, 1):
        for k in range(MIN_EXPONENT, MAX_EXPONENT + 1):
            lo, hi = (0.0 if k == MIN_EXPONENT else 2.0 ** k), 2.0 ** (k + 1)
            exact = [v for v in range(1, EXACT_LIMIT + 1) if lo <= v < hi]
            cells = tuple(1 + (v if sign else -v) + EXACT_LIMIT for v in exact) + (
                _bucket_cell(sign, k, False), _bucket_cell(sign, k, True))
            out.append(_Group(lo, hi, cells, 1) if sign else _Group(-hi, -lo, cells, -1))
    return out


_GROUPS = _groups()


class _Numbers(NamedTuple):
    """What the noisy grid of a column says of its numbers."""

    cleared: List[Tuple[_Group, float]]   # groups whose noisy sum clears, with it
    exact: Dict[int, float]               # exact integers whose own cell clears
    mass: float                           # the noisy mass of the groups that clear (each cell once)
    integral: bool                        # no non-integer cell clears
    noise_std: float = 0.0                # of one cell
    exact_range: Optional[Tuple[int, int]] = None   # the exact integers that clear, extended at EXTEND_Z


def _group_of(v: float) -> int:
    """The index in ``_GROUPS`` of the group that holds the number ``v``: its exact cell, else its power of two."""
    if v == math.floor(v) and abs(v) <= EXACT_LIMIT:
        return int(v) + EXACT_LIMIT
    k = min(max(math.frexp(abs(v))[1] - 1, MIN_EXPONENT), MAX_EXPONENT)
    return 2 * EXACT_LIMIT + 1 + (0 if v < 0 else _NUM_EXPONENTS) + (k - MIN_EXPONENT)


def _extend(cleared, sums, integral: bool, noise_std: float, up: bool) -> None:
    """Add to ``cleared``, one at a time, the group just beyond its outer edge (the next integer's, or the
    next number's) while its noisy sum exceeds :data:`EXTEND_Z` noise stds (of the sum); at most 16, never
    across 0."""
    for _ in range(16):
        if up:
            outer = max((g for g, _ in cleared), key=lambda g: (g.upper, g.open_end != 1))
            edge = outer.upper
            v = edge if outer.open_end == 1 else (
                math.floor(edge) + 1 if integral else math.nextafter(edge, math.inf))
        else:
            outer = min((g for g, _ in cleared), key=lambda g: (g.lower, g.open_end == -1))
            edge = outer.lower
            v = edge if outer.open_end == -1 else (
                math.ceil(edge) - 1 if integral else math.nextafter(edge, -math.inf))
        if edge == 0 or not math.isfinite(v) or abs(v) >= 2.0 ** (MAX_EXPONENT + 1):
            return   # never across 0 (a sign is released only where its own groups clear), nor past the grid
        i = _group_of(v)
        g = _GROUPS[i]
        if any(g is h for h, _ in cleared) or not sums[i] > EXTEND_Z * noise_std * math.sqrt(len(g.cells)):
            return
        cleared.append((g, sums[i]))


def _numbers(grid: np.ndarray, plan: SchemaPlan) -> _Numbers:
    bar = plan.grid_z * plan.noise_std
    sums = [float(sum(grid[i] for i in g.cells)) for g in _GROUPS]
    cleared = [(g, s) for g, s in zip(_GROUPS, sums) if s > bar * math.sqrt(len(g.cells))]
    cells = {i for g, _ in cleared for i in g.cells}
    mass = float(sum(max(grid[i], 0.0) for i in cells))   # of the groups that clear (not the extensions)
    # integers unless the non-integer cells of the cleared groups hold a noticeable noisy mass
    fractional = [i for g, _ in cleared for i in g.cells[-2:-1] if g.open_end]
    integral = float(sum(grid[i] for i in fractional)) <= bar * math.sqrt(max(len(fractional), 1))
    if cleared:   # further at each end where the next group's sum is likely positive
        _extend(cleared, sums, integral, plan.noise_std, up=True)
        _extend(cleared, sums, integral, plan.noise_std, up=False)
    exact = {v: float(grid[1 + v + EXACT_LIMIT]) for v in range(-EXACT_LIMIT, EXACT_LIMIT + 1)
             if grid[1 + v + EXACT_LIMIT] > bar}
    exact_range = None
    if exact:   # further over the exact integers next to them while their counts are likely positive
        lo, hi = min(exact), max(exact)
        ext = EXTEND_Z * plan.noise_std
        while hi < EXACT_LIMIT and hi != 0 and grid[2 + hi + EXACT_LIMIT] > ext:
            hi += 1
        while lo > -EXACT_LIMIT and lo != 0 and grid[lo + EXACT_LIMIT] > ext:
            lo -= 1
        exact_range = (lo, hi)
    return _Numbers(cleared, exact, mass, integral, plan.noise_std, exact_range)


def _exact_rule(numbers: _Numbers, texts: Dict[str, float], present: float) -> bool:
    """Whether the exact integers that clear hold all but :data:`EXACT_OUTSIDE_SHARE` of the present
    numbers (or what the noise of their sum hides)."""
    exact = numbers.exact
    outside = present - sum(texts.values()) - sum(exact.values())
    noise = 3.0 * math.sqrt(len(exact) + 1.0) * numbers.noise_std
    return bool(exact) and outside <= max(EXACT_OUTSIDE_SHARE * present, noise)


def _kind(numbers: _Numbers, texts: Dict[str, float], present: float) -> str:
    """The kind, from the released counts (``present``: the noisy number of present values)."""
    if texts and sum(texts.values()) > numbers.mass:
        words = {t.strip().lower() for t in texts}
        return "boolean" if words <= set(_BOOLEAN_WORDS) and len(set(_BOOLEAN_WORDS[w] for w in words)) == 2 \
            else "categorical"
    if not numbers.cleared:
        return "categorical"
    exact = numbers.exact
    if _exact_rule(numbers, texts, present):
        if set(exact) <= {0, 1}:
            return "boolean"
        return "count"   # its bounds clip a value beyond the integers released to the nearest of them
    return "count" if numbers.integral else "real"


def _levels(numbers: _Numbers, texts: Dict[str, float], max_levels: int):
    """``(levels, ordered, other)`` of a categorical column read privately: the released texts (at most
    ``max_levels - 1``, the largest noisy counts, sorted) and :data:`OTHER_LEVEL`; else the integers from
    the smallest to the largest exact integer released (ordered; for a column declared categorical); else
    :data:`OTHER_LEVEL` alone."""
    if texts and sum(texts.values()) > numbers.mass:
        kept = sorted(texts, key=lambda t: -texts[t])[:max(max_levels - 1, 1)]
        levels = sorted(kept)
        if OTHER_LEVEL not in levels:
            levels.append(OTHER_LEVEL)
        return tuple(levels), False, OTHER_LEVEL
    if numbers.exact:
        return tuple(range(numbers.exact_range[0], numbers.exact_range[1] + 1)), True, None
    return (OTHER_LEVEL,), False, OTHER_LEVEL


def _bounds(numbers: _Numbers, kind: str) -> Tuple[float, float]:
    """The smallest and largest edges of the cleared groups (counts: the integers within)."""
    lo = min(numbers.cleared, key=lambda gs: gs[0].lower)[0]
    hi = max(numbers.cleared, key=lambda gs: gs[0].upper)[0]
    lower, upper = lo.lower, hi.upper
    if kind == "count":
        lower = math.floor(lower) + 1 if (lo.open_end == -1 and lower == math.floor(lower)) else math.ceil(lower)
        upper = math.ceil(upper) - 1 if (hi.open_end == 1 and upper == math.ceil(upper)) else math.floor(upper)
        upper = max(upper, lower)
    return float(lower), float(upper)


def _distribution(numbers: _Numbers, kind: str, lower: float, upper: float, present: float) -> str:
    """:func:`d3p.twin.schema.infer_schema`'s rules, on the released counts."""
    if upper == lower:
        return "negbinomial" if kind == "count" else "normal"
    at_lower = [s for g, s in numbers.cleared if g.open_end == 0 and g.lower == lower]
    if at_lower and at_lower[0] >= HURDLE_MIN_SHARE * present:
        return "hurdle"
    if kind == "count" and upper - lower <= POISSON_MAX_RANGE:
        return "negbinomial"
    if lower < 0:
        return "normal"
    ordered = sorted(numbers.cleared, key=lambda gs: gs[0].lower)
    half, total = 0.5 * sum(max(s, 0.0) for _, s in ordered), 0.0
    for g, s in ordered:   # the median, linear within its group
        s = max(s, 0.0)
        if total + s >= half and s > 0:
            median = max(g.lower, lower) + (half - total) / s * (min(g.upper, upper) - max(g.lower, lower))
            return "lognormal" if median - lower < 0.1 * (upper - lower) else "normal"
        total += s
    return "normal"


def _decimals(lower: float, upper: float) -> int:
    """Synthetic reals keep four significant digits of the range (a public rule of the bounds)."""
    if not upper > lower:
        return 0
    return int(min(MAX_DECIMALS, max(0, 3 - math.floor(math.log10(upper - lower)))))


def _column_spec(spec, grid: np.ndarray, texts: Dict[str, float], plan: SchemaPlan, num_records: int,
                 max_levels: int, category: bool):
    """``spec`` completed from its column's release; the fields it gives are kept."""
    from d3p.twin._schema_inference import _default_dtype
    from d3p.twin._schema_types import ColumnSpec

    numbers = _numbers(grid, plan)
    present = num_records - max(float(grid[0]), 0.0)
    kw = dataclasses.asdict(spec)
    kw["levels"], kw["inferred"] = spec.levels, tuple(spec.inferred)
    kind = kw["kind"] = spec.kind or _kind(numbers, texts, present)
    if spec.nullable is None:
        kw["nullable"] = bool(grid[0] > plan.grid_z * plan.noise_std)
    if kind == "categorical" and spec.levels is None:
        levels, ordered, other = _levels(numbers, texts, max_levels)
        if spec.other is not None and spec.other not in levels:
            levels = levels + (spec.other,)
        kw["levels"], kw["ordered"] = levels, ordered or spec.ordered
        kw["other"] = spec.other if spec.other is not None else other
    if kind in ("real", "count") and (spec.lower is None or spec.upper is None):
        if not numbers.cleared:   # nothing numeric was released: a public placeholder range [0, 0]
            numbers = _Numbers([(_GROUPS[EXACT_LIMIT], 0.0)], {}, 0.0, True)
        lower, upper = _bounds(numbers, kind)
        if kind == "count" and _exact_rule(numbers, texts, present):
            lower, upper = map(float, numbers.exact_range)
        kw["lower"] = lower if spec.lower is None else spec.lower
        kw["upper"] = upper if spec.upper is None else spec.upper
        if kind == "real" and spec.decimals is None:
            kw["decimals"] = _decimals(kw["lower"], kw["upper"])
    if kw["upper"] is not None and kw["lower"] is not None and kw["upper"] < kw["lower"]:
        kw["upper"] = kw["lower"]
    if spec.distribution is None:
        exact_count = kind == "count" and _exact_rule(numbers, texts, present)   # a scale or code: no hurdle
        kw["distribution"] = {"categorical": "categorical", "boolean": "bernoulli"}.get(kind) or (
            "negbinomial" if exact_count else _distribution(numbers, kind, kw["lower"], kw["upper"], present))
    if spec.dtype is None:
        kw["dtype"] = _default_dtype(kind, kw["levels"], category)
    return ColumnSpec(**kw)


def _sampler_relation(sampling: str) -> str:
    """The relation of a twin's ``sampling`` (``"poisson"``: add/remove; ``"fixed"``: substitute)."""
    sampling = _validate.choice("sampling", sampling, ("poisson", "fixed"))
    return str(accounting.accounting_for("poisson" if sampling == "poisson" else "fixed_size").relation)


def infer_schema_private(data: pd.DataFrame, epsilon: float, delta: Optional[float] = None, *, rng_key,
                         schema=None, sampling: str = "poisson", share: float = SCHEMA_SHARE,
                         max_levels: int = DEFAULT_MAX_LEVELS, ledger=None) -> PrivateSchema:
    """Complete a (possibly empty) schema from the data with differential privacy.

    The fields the given schema leaves out are read from one noisy release (see the module's text;
    its plan is :func:`plan_schema` for the columns left incomplete). The release spends ``share``
    of the ρ of a twin at (``epsilon``, ``delta``) and :data:`LEVEL_DELTA_SHARE` of its δ;
    :func:`d3p.twin.fit` accounts it with the model in one (ε, δ). Nothing raises, warns or prints
    because of a record's value: every column gets a complete description, however few records.

    Rules, on the noisy counts (a cell or group "clears" when its noisy count exceeds
    ``grid_z`` noise stds, times ``sqrt(cells)`` for a group; a text when it exceeds the level
    threshold):

    * kind: ``categorical`` if the released texts hold more than the cleared numbers (``boolean``
      if they are true/false words); a numeric column whose cleared exact integers hold at least
      all but :data:`EXACT_OUTSIDE_SHARE` of the present values is ``boolean`` (0 and 1), else a
      ``count`` bounded by them (a value beyond goes to the nearest); else ``count`` unless the
      non-integer cells of the cleared groups hold a noticeable mass (``real``);
    * ``nullable``: the missing cell clears;
    * ``levels``: the released texts (at most ``max_levels - 1``) and the catch-all
      :data:`OTHER_LEVEL` (the column's ``other``), or the integers between the smallest and the
      largest exact integer released;
    * ``lower``/``upper``: the outer edges of the cleared groups (powers of two, or exact
      integers): a value held by few records beyond them is not released, and is mapped to the
      nearest bound like any value outside a schema's bounds;
    * ``distribution``: as :func:`d3p.twin.schema.infer_schema`, with the noisy share at the
      lower bound and the noisy median; ``decimals`` (reals): four significant digits of the
      range; ``dtype``: from the kind and levels (:func:`d3p.twin.schema.infer_schema`'s rule).
    * a column in which nothing clears (values too spread or too few for the noise) is a
      categorical of the one level :data:`OTHER_LEVEL`; give it in the schema, or raise ``share``.

    :param pandas.DataFrame data: the private table (never modified).
    :param float epsilon: the twin's target ε (finite).
    :param float delta: the twin's target δ (default ``1 / N**2``).
    :param rng_key: a ``d3p.random`` key; the noise is as secret as it.
    :param schema: the fields known from public information (as :func:`d3p.twin.fit`).
    :param str sampling: the twin's ``sampling`` (sets the relation).
    :param float share: the share of the twin's ρ, in (0, 1) (default :data:`SCHEMA_SHARE`).
    :param int max_levels: the most levels of a categorical column read here.
    :param ledger: a :class:`d3p.ledger.PrivacyLedger`: the release is refused before the data are read
        if it would pass the ledger's budget (it is recorded by :func:`d3p.twin.fit`, with the model).
    :return: :class:`PrivateSchema` (the schema, its plan, the columns read); the plan is None
        where the given schema was complete (nothing read, nothing spent).
    """
    max_levels = _validate.integer("max_levels", max_levels, minimum=1)
    return _complete(data, epsilon, delta, rng_key, schema, _sampler_relation(sampling), share, max_levels, ledger)


def _complete(data, epsilon, delta, rng_key, schema, relation: str, share: float, max_levels: int,
              ledger) -> PrivateSchema:
    """:func:`infer_schema_private` for checked settings."""
    from d3p.twin._schema_inference import _as_schema, _with_column_names, _with_default_dtype
    from d3p.twin._schema_types import ColumnSpec, Schema

    data = _with_column_names(data)
    given = _as_schema(schema, list(data.columns))
    given = {c.name: c for c in given.columns} if given is not None else {}
    specs = [given.get(n, ColumnSpec(n)) for n in data.columns]
    todo = [i for i, s in enumerate(specs) if s.missing_fields() not in ([], ["dtype"])]
    if not todo:
        return PrivateSchema(Schema(tuple(_with_default_dtype(s, data[s.name]) for s in specs)), None, ())
    n = data.shape[0]
    plan = plan_schema(len(todo), n, epsilon, 1.0 / n**2 if delta is None else delta, relation=relation,
                       share=share)
    if ledger is not None:
        ledger.check(*schema_releases(plan))
    release = _noisy_release([data[specs[i].name] for i in todo], plan, rng_key)
    for i, (grid, texts) in zip(todo, release):
        specs[i] = _column_spec(specs[i], grid, texts, plan, n, max_levels,
                                isinstance(data[specs[i].name].dtype, pd.CategoricalDtype))
    out = Schema(tuple(_with_default_dtype(s, data[s.name]) for s in specs))
    from d3p.ledger import key_fingerprint

    return PrivateSchema(out, plan, tuple(specs[i].name for i in todo), key_fingerprint(rng_key))


def schema_releases(plan: Optional[SchemaPlan], sampler: Optional[str] = None) -> list:
    """The ledger's entries for a private schema release: its Gaussian part (one step with q = 1 of
    the run's ``sampler``, so that the accountant composes it with the run's steps; without a sampler, a
    ρ-zCDP release, as the marginal twin's) and its threshold's δ."""
    from d3p.ledger import EpsilonDeltaRelease, GaussianSteps, ZCDPRelease

    if plan is None:
        return []
    gaussian = (ZCDPRelease("twin schema (noisy histograms)", plan.rho, plan.relation) if sampler is None else
                GaussianSteps("twin schema (noisy histograms)", plan.phase_sigma(), 1.0, 1, sampler, plan.relation))
    return [gaussian, EpsilonDeltaRelease("twin schema (levels' threshold)", 0.0, plan.delta_threshold,
                                          plan.relation)]
