"""The marginal twin: noisy marginal tables, chosen privately, and a graphical model fitted to them.

Select, measure, generate (the approach of MST and AIM: McKenna, Miklau &
Sheldon 2021, "Winning the NIST contest"; McKenna, Mullins, Sheldon & Miklau
2022, "AIM: an adaptive and iterative mechanism for differentially private
synthetic data"), in d3p's own code:

1. every column is cut into cells (:class:`d3p.twin.cells.CellSpace`, a
   per-record map from the public schema);
2. all one-way marginal tables are measured at once with the Gaussian
   mechanism; in every column, the cells whose noisy count is below
   :data:`RARE_CELL_STDS` noise standard deviations are merged into one
   cell of the larger tables measured later (:func:`rare_cell_merging`, the
   domain compression of MST; post-processing of this release), so that
   their noise is not spread over cells that hold almost no records;
3. for a fixed number of rounds: the exponential mechanism picks the two-way
   table (of all pairs of columns, each also at a coarser resolution) or the
   three-way table (of small triples) on which
   the current model errs most, corrected for the expected noise of measuring
   it (AIM's score), and it is measured with the Gaussian mechanism; the
   table is shrunk, cell by cell, towards what the model already says where
   the noise dominates its counts (:func:`shrink_towards`) and the model is
   re-fitted to all measurements so far; with a declared target, every
   :data:`TARGET_EVERY`-th round chooses among the tables that hold a target
   column only; on a wide table (more than :data:`MAX_ROUNDS` + 1 columns,
   where the rounds could not reach every column) the ``D - 1`` rounds build a
   spanning tree instead, as MST does: each chooses among the tables that join
   two parts of the graph of the measured tables, with MST's score (the
   model's error without the noise correction; for two columns in different
   parts the model's table is the product of their one-way marginals, so
   the model is re-fitted only when the tree is complete); on a wide table
   with a declared target, the first :func:`wide_target_rounds` rounds are
   the target's, at a budget of their own and scored on the target's
   conditional (:func:`plan_marginals`, :func:`_scores`);
4. the graphical model (:mod:`d3p.twin.graphical`) whose marginals best
   explain every measurement (:func:`d3p.twin.estimation.estimate`, the
   Private-PGM estimator) is the twin; records are drawn from it.

Only steps 2 and 3 read the private data, through :func:`_counts`: the
counts are exact integers, the Gaussian noise is a float64 draw of
:func:`d3p.random.normal_float64` added in float64 (:func:`_measure`; with or
without ``jax_enable_x64``, so that a record moves a released cell by
exactly its count's change, whatever N), the choices come from
:func:`d3p.selection.exponential_mechanism` on float64 scores whose rounding
is bounded and added to their sensitivity (:func:`_scores`), both with keys of
``d3p.random``, and every release is spent from one
:class:`d3p.accounting.ZCDPBudget`. The schedule (how much ρ goes where, how
many rounds) depends only on public settings: ε, δ, the schema's cells and
the number of columns.
"""

from __future__ import annotations

import functools
import math
from itertools import combinations
from typing import List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

import d3p.random
from d3p import _validate, accounting
from d3p.gradients import noise_std
from d3p.selection import exponential_mechanism
from d3p.twin.cells import CellSpace
from d3p.twin.estimation import Measurement, estimate, project
from d3p.twin.graphical import GraphicalModel, _root_of, calibrate, marginal, sample
from d3p.twin.junction import maximal_cliques, tree_size
from d3p.twin.schema import Schema

__all__ = ["MarginalModel", "MarginalPlan", "plan_marginals", "fit_marginals", "one_way_shares", "default_num_rounds",
           "rare_cell_merging", "target_round", "tree_round", "DEFAULT_MAX_MODEL_CELLS", "RARE_CELL_STDS",
           "TARGET_EVERY", "MAX_ROUNDS", "one_way_noise_share", "noise_warning", "NOISY_SHARE", "shrink_towards",
           "wide_target_rounds", "WIDE_TARGET_SHARE", "WIDE_TARGET_SELECTION_SHARE"]

#: Largest total number of cells of the junction tree's cliques: a candidate
#: table that would make the model larger is not considered.
DEFAULT_MAX_MODEL_CELLS = 200_000
#: Share of ρ for the one-way tables: half, since every larger table is fitted
#: around them (on the benchmark's tables, 0.5 against 0.35 lowered TV1 on all
#: of them and TV2 where the one-way noise is large; see benchmarks/README.md).
ONE_WAY_SHARE = 0.5
#: Share of the ρ of each round spent on the selection.
SELECTION_SHARE = 0.1
#: On a wide table with a declared target, the share of ρ of the target rounds (the first
#: :func:`wide_target_rounds` rounds), and the selection's share of each of them.
WIDE_TARGET_SHARE = 0.3
WIDE_TARGET_SELECTION_SHARE = 0.5


def wide_target_rounds(num_columns: int) -> int:
    """Target rounds of a wide table with a declared target: ``ceil(sqrt(D))`` (public)."""
    return min(num_columns - 1, math.ceil(math.sqrt(num_columns)))
#: A column with more value cells than this is also offered merged into this many groups.
COARSE_CELLS = 5
#: Triples of columns are candidates when there are at most this many triples (the
#: candidates are scored in every round) ...
MAX_TRIPLES = 500
#: ... and a triple's table has at most this many cells.
MAX_TRIPLE_CELLS = 512
#: A cell whose noisy one-way count is below this many noise standard deviations is
#: rare: the rare cells of a column are merged into one in the larger tables.
RARE_CELL_STDS = 3.0
#: Whether each round's noisy table is shrunk towards the current model's table before it is
#: fitted (:func:`shrink_towards`, James and Stein's positive-part estimator).
SHRINK = 1
#: Mirror-descent steps of the estimator after each round (warm-started) and at the end.
ROUND_ITERATIONS = 100
FINAL_ITERATIONS = 1000
#: The std the estimator assumes for a table measured without noise (ε = inf).
EXACT_STD = 1.0
#: With a declared target, rounds 0, k, 2k, ... choose among the candidates that hold a
#: target column (a third of the rounds; on digits, a 10-class target among 65 columns, the
#: TSTR AUC rose from 0.68 to 0.84 with it, see benchmarks/README.md). A wide table planned
#: with its target has target rounds of its own instead (:func:`wide_target_rounds`).
TARGET_EVERY = 3

Clique = Tuple[int, ...]


class MarginalPlan(NamedTuple):
    """The public schedule of a marginal twin's releases (no private value)."""

    rho: float            # total zCDP budget (from epsilon, delta)
    rho_one_way: float    # all one-way tables together
    num_rounds: int
    rho_select: float     # per round: the exponential mechanism
    rho_measure: float    # per round: the Gaussian measurement
    relation: str
    l2_sensitivity: float  # of one count table
    l1_sensitivity: float  # of one count table (the scores' sensitivity)
    num_tree_rounds: int = 0  # the first rounds build a spanning tree (see :func:`tree_round`)
    num_target_rounds: int = 0  # wide table with a target: the first rounds, at their own ρ
    rho_target_select: float = 0.0
    rho_target_measure: float = 0.0

    def round_plan(self, t: int) -> "MarginalPlan":
        """The plan as round ``t`` spends it: a target round of a wide table (the first
        ``num_target_rounds``) at ``rho_target_select`` and ``rho_target_measure``."""
        if t < self.num_target_rounds:
            return self._replace(rho_select=self.rho_target_select, rho_measure=self.rho_target_measure)
        return self


#: The most rounds of :func:`default_num_rounds` on a table of at most ``MAX_ROUNDS + 1``
#: columns; a wider table gets the ``D - 1`` rounds of a spanning tree.
MAX_ROUNDS = 30


def _wide(num_columns: int) -> bool:
    """Whether a table is too wide for :data:`MAX_ROUNDS` rounds to reach every column:
    its rounds build a spanning tree (public)."""
    return num_columns - 1 > MAX_ROUNDS


def default_num_rounds(num_columns: int) -> int:
    """Rounds of selection and measurement for ``D`` columns: ``2 (D - 1)``, twice
    the edges of a spanning tree, between 1 and :data:`MAX_ROUNDS`; ``D - 1`` (a
    spanning tree, :func:`tree_round`) when that is more than :data:`MAX_ROUNDS`."""
    if _wide(num_columns):
        return num_columns - 1
    return min(MAX_ROUNDS, max(1, 2 * (num_columns - 1)))


def plan_marginals(epsilon: float, delta: float, num_columns: int, *, relation: str = accounting.ADD_REMOVE,
                   num_rounds: Optional[int] = None, rho: Optional[float] = None,
                   num_targets: int = 0) -> MarginalPlan:
    """The schedule for a target (ε, δ): ρ from :func:`d3p.accounting.zcdp_rho`, then
    :data:`ONE_WAY_SHARE` of it for the one-way tables and the rest in equal
    rounds, each with :data:`SELECTION_SHARE` for the selection.

    :param float epsilon: target ε > 0 (``inf``: no noise, the best candidates).
    :param float delta: δ in (0, 1).
    :param int num_columns: D ≥ 1.
    :param str relation: ``"add_remove"`` (default) or ``"substitute"``.
    :param int num_rounds: default :func:`default_num_rounds`; 0 with one column.
    :param float rho: the total ρ, where part of the budget is spent elsewhere (a private schema);
        default ``zcdp_rho(epsilon, delta)``.
    :param int num_targets: how many columns the declared target has (public; default 0). On a
        wide table with a target, the first :func:`wide_target_rounds` rounds are target rounds
        with :data:`WIDE_TARGET_SHARE` of ρ (:data:`WIDE_TARGET_SELECTION_SHARE` of it on their
        selections): an exponential mechanism on the target's tables with a tenth of a round's
        ρ chooses among ~D tables almost at random, so the tables that carry the target's
        signal are chosen, and measured, with a budget of their own.

    With more than :data:`MAX_ROUNDS` + 1 columns, the first ``min(num_rounds, D - 1)``
    rounds are tree rounds (``num_tree_rounds``, :func:`tree_round`): 30 tables of
    two columns hold at most 60 columns, so that some columns would be in no measured
    table (a model of them independent of every other column), and on
    scikit-learn's digits (65 columns, the 10-class target among them) the tables of
    the target were never chosen (see benchmarks/README.md).
    """
    epsilon = _validate.positive("epsilon", epsilon, finite=False)
    delta = _validate.open_unit("delta", delta)
    num_columns = _validate.integer("num_columns", num_columns, minimum=1)
    num_targets = _validate.integer("num_targets", num_targets, minimum=0)
    relation = accounting.Relation(relation)
    if num_rounds is None:
        num_rounds = default_num_rounds(num_columns)
    num_rounds = 0 if num_columns < 2 else _validate.integer("num_rounds", num_rounds, minimum=0)
    rho = accounting.zcdp_rho(epsilon, delta) if rho is None else _validate.positive("rho", rho, finite=False)
    wide = _wide(num_columns)
    one_way = rho if num_rounds == 0 else ONE_WAY_SHARE * rho
    targeted = min(num_rounds - 1, wide_target_rounds(num_columns)) if wide and num_targets and num_rounds > 1 else 0
    target_share = WIDE_TARGET_SHARE if targeted else 0.0
    per_target = target_share * rho / targeted if targeted else 0.0
    per_round = (1.0 - ONE_WAY_SHARE - target_share) * rho / (num_rounds - targeted) if num_rounds else 0.0
    tree_rounds = min(num_rounds, num_columns - 1) if wide else 0
    return MarginalPlan(rho, one_way, num_rounds, SELECTION_SHARE * per_round,
                        (1 - SELECTION_SHARE) * per_round, str(relation),
                        accounting.count_sensitivity(relation, "l2"), accounting.count_sensitivity(relation, "l1"),
                        tree_rounds, targeted, WIDE_TARGET_SELECTION_SHARE * per_target,
                        (1 - WIDE_TARGET_SELECTION_SHARE) * per_target)


# ------------------------------------------------------------------ private steps


def _counts(cells: np.ndarray, sizes: Sequence[int], clique: Clique) -> np.ndarray:
    """The contingency table of ``clique``: every record adds one to one cell (private;
    exact int64)."""
    shape = [sizes[v] for v in clique]
    flat = np.ravel_multi_index(tuple(cells[:, v] for v in clique), shape)
    return np.bincount(flat, minlength=math.prod(shape)).reshape(shape).astype(np.int64)


def one_way_shares(sizes: Sequence[int], rho: float) -> List[float]:
    """ρ of each column's one-way table: ∝ cells^(2/3), which minimises the sum
    of the tables' expected L1 noise (cells × std) for the total ``rho``."""
    w = np.asarray(sizes, np.float64) ** (2.0 / 3.0)
    return [rho * float(x) for x in w / w.sum()]


def _noise_multiplier(rho: float) -> float:
    """σ with ρ = 1 / (2σ²) for noise σΔ on a release of sensitivity Δ (0 for ρ = inf)."""
    return 0.0 if math.isinf(rho) else math.sqrt(1.0 / (2.0 * rho))


#: The released counts lie on a grid of spacing ``2**-k`` ≤ 1/2 at most ``2**-GRID_BITS``
#: times the noise std (see :func:`_noisy_counts`).
GRID_BITS = 12
#: Counts, and so N, must stay below this to be exact in float64.
MAX_EXACT_COUNT = 2 ** 53


def _release_grid(std: float) -> float:
    """The grid of a release with noise ``std`` (public): the largest power of two
    ``≤ min(1/2, std · 2**-GRID_BITS)``, so that the integers are on it."""
    return 2.0 ** min(-1, math.floor(math.log2(std)) - GRID_BITS)


def _exact_counts(name: str, table) -> np.ndarray:
    """``table`` as exact int64 counts. Count tables and their coarsenings hold
    integers below ``N < 2**53`` (checked on the public N); anything else is the
    caller's error, refused without quoting a value."""
    t = np.asarray(table)
    integral = np.issubdtype(t.dtype, np.integer) or (
        np.issubdtype(t.dtype, np.floating) and np.all(np.abs(t) < MAX_EXACT_COUNT) and np.all(t == np.rint(t)))
    if not integral or np.any(np.abs(t) >= MAX_EXACT_COUNT):
        raise TypeError(f"Expected {name} to hold integer counts below 2**53, got dtype {t.dtype}.")
    return t.astype(np.int64)


def _noisy_counts(counts: np.ndarray, std: float, z: np.ndarray) -> np.ndarray:
    """``counts + std z`` rounded to :func:`_release_grid`, in float64.

    With ``n = fl(std z)`` and ``r = g rint(n / g)`` (exact: ``g`` is a power of
    two), the result ``fl(counts + r)`` is ``fl(round_g(counts + n))``: the
    integers are on the grid (``1/g`` even, so ``rint`` and the shift commute),
    and a float64 sum is the correctly rounded exact sum. So the release is a
    function of the exact sum of the integer count and the noise, and the
    noise's lattice of float64 values below the grid (what exposes the count
    in the low bits of a floating-point Gaussian mechanism: Mironov 2012) is
    not in it.
    """
    grid = _release_grid(std)
    r = np.rint((std * np.asarray(z, np.float64)) / grid) * grid
    return counts.astype(np.float64) + r


def _measure(rng_key, tables: List[np.ndarray], shares: Sequence[float], sensitivity: float, length: int):
    """Tables with Gaussian noise, table ``i`` at ρ ``shares[i]``, in one release of
    ρ = Σ shares.

    Table ``i`` (exact integer counts) gets noise of std ``s_i = Δ / sqrt(2 shares[i])``
    (``Δ = sensitivity``): a Gaussian mechanism of ρ ``shares[i]``, composed over the
    tables. The noise is one draw of :func:`d3p.random.normal_float64` of
    ``max(length, cells)`` values (``length`` fixed in a fit; the rest is dropped),
    and the counts, the noise and the sum are float64 (:func:`_noisy_counts`),
    with or without ``jax_enable_x64``.

    :return: ``(noisy tables, their noise stds)``, float64.

    **Formal guarantees.** With ``Δ`` the L2 sensitivity of each table under the
    relation, the release is ρ-zCDP up to the discretisation of the noise (see
    :func:`d3p.random.normal_float64`): it is ``round_g(t_i + s_i Z)`` rounded to
    float64, post-processing of the exact Gaussian mechanism, for every count
    below 2**53. While a released value is below ``2**53 g`` (``g`` the grid), a
    record moves it by exactly its count's change. The noise's attainable values
    are finer than a quarter of the grid wherever ``|Z| < 8.1`` if ``s_i < 4096``
    (``|Z| < 7.4`` if ``s_i < 2**20``); beyond, with probability below ``5.5e-16``
    (``1.4e-13``) per released cell, the grid points that the noise can reach may
    differ between neighbours: add that, times the number of cells, to δ.
    """
    rho = float(sum(shares))
    counts = [_exact_counts(f"tables[{i}]", t) for i, t in enumerate(tables)]
    if math.isinf(rho):
        return [c.astype(np.float64) for c in counts], [0.0] * len(counts)
    if any(not share > 0 for share in shares):
        raise ValueError(f"Expected every share > 0, got shares={list(shares)!r}.")
    stds = [noise_std(_noise_multiplier(float(share)), sensitivity) for share in shares]
    total = sum(c.size for c in counts)
    z = d3p.random.normal_float64(rng_key, (max(length, total),))
    out, start = [], 0
    for c, std in zip(counts, stds):
        out.append(_noisy_counts(c, std, z[start:start + c.size].reshape(c.shape)))
        start += c.size
    return out, stds


def _noise_length(space: CellSpace, candidates) -> int:
    """One length for every release of a fit (public): a power of two >= 256."""
    longest = max([sum(space.sizes)] + [c.num_cells for c in candidates])
    return max(256, 1 << int(math.ceil(math.log2(longest))))


class _Candidate(NamedTuple):
    clique: Clique
    coarsening: Tuple[Optional[np.ndarray], ...]
    num_cells: int


def _candidate(clique: Clique, coarsening, sizes: Sequence[int]) -> _Candidate:
    """The candidate table of ``clique`` with ``coarsening`` (None per column: its cells as they are)."""
    return _Candidate(clique, coarsening, math.prod(m.shape[0] if m is not None else sizes[v]
                                                    for m, v in zip(coarsening, clique)))


def _candidates(space: CellSpace) -> List[_Candidate]:
    """Every pair of columns, the same pair with large columns merged to
    :data:`COARSE_CELLS` value cells, and, for at most :data:`MAX_TRIPLES` triples
    in all, every triple of at most :data:`MAX_TRIPLE_CELLS` cells (public: from
    the schema)."""
    out = []
    sizes = space.sizes
    triples = list(combinations(range(len(sizes)), 3))
    if len(triples) <= MAX_TRIPLES:
        out += [_Candidate(t, (None,) * 3, math.prod(sizes[v] for v in t)) for t in triples
                if math.prod(sizes[v] for v in t) <= MAX_TRIPLE_CELLS]
    for pair in combinations(range(len(sizes)), 2):
        out.append(_Candidate(pair, (None, None), sizes[pair[0]] * sizes[pair[1]]))
        coarse = tuple(space.coarsening(v, COARSE_CELLS) if space.columns[v].num_values > COARSE_CELLS else None
                       for v in pair)
        if any(m is not None for m in coarse):
            out.append(_candidate(pair, coarse, sizes))
    return out


def rare_cell_merging(noisy: np.ndarray, std: float, threshold: Optional[float] = None) -> Optional[np.ndarray]:
    """The merging of a column's rare cells, read from its noisy one-way table.

    A cell is rare if its noisy count is below ``threshold * std``. With at
    least two rare cells and at least one that is not, the result is a 0/1
    matrix ``(k, size)``: one row per cell that is not rare (in order), then
    one row for all the rare cells together; every cell is in exactly one
    row, so a record is still in one cell of a merged table. Otherwise None
    (nothing to merge). A function of the released table only
    (post-processing).

    :param numpy.ndarray noisy: the column's released one-way table.
    :param float std: its noise standard deviation.
    :param float threshold: default :data:`RARE_CELL_STDS`.
    """
    threshold = RARE_CELL_STDS if threshold is None else threshold
    noisy = np.asarray(noisy, np.float64).ravel()
    rare = noisy < threshold * float(std)
    if rare.sum() < 2 or rare.all():
        return None
    eye = np.eye(noisy.size)
    return np.concatenate([eye[~rare], rare[None].astype(np.float64)])


def shrink_towards(noisy: np.ndarray, prior: np.ndarray, std: float, axes: Tuple[int, ...] = ()) -> np.ndarray:
    """``noisy`` shrunk cell by cell towards ``prior`` where the noise dominates the counts.

    Cell ``c`` becomes ``prior_c + w_c (max(noisy_c, 0) − prior_c)`` with ``w_c = k e_c /
    (k e_c + std²)``: the empirical-Bayes mean when the table's departures from ``prior``
    have variance ``k e_c`` and the noise variance ``std²``, with ``e_c`` the number of
    records the prior expects in the cell (more room to depart where more records are
    expected) or, given the target's ``axes``, in the cell's row (the cells with the same
    values of the other columns: a target's conditional is as reliable as the count it is
    conditioned on, and a sparse target's cells are small in every row); ``k = max(0,
    (‖d‖² − n std²) / Σ e)`` is the method-of-moments estimate over the table's ``n`` cells.
    A cell (row) expected to hold few records against the noise (a rare level, a sparse
    table, a weak dependence) takes what the model fitted to the earlier measurements
    (``prior``, fixed before this table's noise was drawn) already says, so the fit does not
    turn a noisy sparse table into a deterministic rule (a conditional fitted to a count
    driven to zero by the noise); a cell far above the noise keeps its measured value.
    ``noisy`` itself for ``std = 0``. Post-processing of the release.
    """
    noisy = np.asarray(noisy, np.float64)
    std = _validate.non_negative("std", std)
    if np.shape(prior) != noisy.shape:
        raise ValueError(f"Expected prior of the shape of noisy {noisy.shape}, got {np.shape(prior)}.")
    if std == 0.0:
        return noisy
    prior = np.clip(np.asarray(prior, np.float64), 0.0, None)
    diff = np.clip(noisy, 0.0, None) - prior
    var = float(std) ** 2
    expected = np.broadcast_to(prior.sum(axis=axes, keepdims=True), prior.shape) if axes else prior
    k = max(0.0, (float(np.sum(diff * diff)) - diff.size * var) / max(float(np.sum(expected)), 1.0))
    spread = k * expected
    return prior + spread / (spread + var) * diff


def _merged_candidates(candidates: List[_Candidate], sizes: Sequence[int],
                       merging: Sequence[Optional[np.ndarray]]) -> List[_Candidate]:
    """``candidates`` with the rare cells of every column left at full resolution merged
    (a column already coarsened keeps its coarsening); post-processing."""
    return [_candidate(c.clique, tuple(m if m is not None else merging[v] for m, v in zip(c.coarsening, c.clique)),
                       sizes) for c in candidates]


def _parts(cal) -> Tuple[List[int], List[np.ndarray]]:
    """The tree of the junction forest that holds each column, and each column's marginal
    (columns in different trees are independent in the model: their marginal is the
    product of theirs)."""
    tree = cal.tree
    part = [_root_of(tree, next(i for i, c in enumerate(tree.cliques) if v in c)) for v in range(len(tree.sizes))]
    return part, [marginal(cal, (v,)) for v in range(len(tree.sizes))]


#: Unit roundoff of float64.
_U64 = 2.0 ** -53


def _scores(cells: np.ndarray, sizes: Sequence[int], model: GraphicalModel, candidates: List[_Candidate],
            std: float, num_records: int, tables: Optional[dict] = None,
            given: Sequence[int] = ()) -> Tuple[List[float], float]:
    """AIM's score of each candidate: how wrong the model's table is beyond the expected
    noise of measuring it, ``‖Q(N μ) − Q(counts)‖₁ − sqrt(2/π) σ n`` for a table of n
    cells measured with noise σ (private: reads the counts); with ``std=0``, MST's
    score, the error alone. In exact arithmetic a record changes a score by at most
    the L1 sensitivity of one count table (N is public).

    :return: ``(scores, margin)``: ``margin`` (public) bounds the rounding of the
        computed scores of two neighbours, ``|û − û'| ≤ Δ₁ + margin``: the counts are
        exact integers, each ``|f − t|`` and the ``math.fsum`` of them are correctly
        rounded, and so is the shift, so a computed score is within
        ``4u (F + T + c)`` of the exact one (``u = 2**-53``, ``F = Σ|f|`` the fitted
        table's mass, ``T ≤ N + 1`` the count's, ``c`` the public shift);
        ``margin = 16 u (max F + N + 1 + max c)``, with room for the rounding of ``F``.

    ``tables``: a dict that keeps the count tables of the cliques between the rounds of a
    fit (the same exact counts, read once).

    ``given`` (the target's columns): a candidate that holds some of them and other columns is
    scored on the model's *conditional* of the target given the others, ``f = n_rest ·
    μ(target | rest)`` with ``n_rest`` the table's own counts of the other columns (a uniform
    conditional where the model gives them no mass): the error of the target's dependence
    on them, without the noise of their one-way tables (which swamps a sparse target's
    dependence in the model's error). A record moves ``n_rest`` by one in one cell, so ``f``
    by a conditional distribution (L1 mass 1) and the score by at most twice the L1
    sensitivity; ``F ≤ N + 1`` in the margin (public).
    """
    tables = {} if tables is None else tables
    cal = calibrate(model)
    part, one_way = _parts(cal)
    scores, largest = [], 0.0
    for c in candidates:
        if len({part[v] for v in c.clique}) == len(c.clique):  # independent in the model
            mu = functools.reduce(np.multiply.outer, [one_way[v] for v in c.clique])
        else:
            mu = marginal(cal, c.clique)
        fitted = project(num_records * mu, c.coarsening)
        true = project(_cached_counts(tables, cells, sizes, c.clique), c.coarsening)
        shift = math.sqrt(2.0 / math.pi) * std * c.num_cells
        axes = tuple(i for i, v in enumerate(c.clique) if v in given)
        if axes and len(axes) < len(c.clique):
            fitted = _conditional_fit(fitted, true, axes)
            largest = max(largest, num_records + 1.0 + abs(shift))
        else:
            largest = max(largest, math.fsum(np.abs(fitted).ravel()) + abs(shift))
        scores.append(math.fsum(np.abs(fitted - true).ravel()) - shift)
    return scores, 16.0 * _U64 * (largest + num_records + 1.0)


def _conditional_fit(fitted: np.ndarray, true: np.ndarray, axes: Tuple[int, ...]) -> np.ndarray:
    """``n_rest · μ(target | rest)``: the model's table ``fitted`` made a conditional over
    ``axes`` (uniform where it has no mass) and multiplied by the counts ``true`` summed over
    them (see :func:`_scores`)."""
    mass = fitted.sum(axis=axes, keepdims=True)
    k = math.prod(fitted.shape[a] for a in axes)
    cond = np.where(mass > 0, fitted / np.where(mass > 0, mass, 1.0), 1.0 / k)
    return true.sum(axis=axes, keepdims=True).astype(np.float64) * cond


def _select(rng_key, cells, sizes, model: GraphicalModel, candidates: List[_Candidate], plan: MarginalPlan,
            num_records: int, noise_corrected: bool = True, tables: Optional[dict] = None,
            given: Sequence[int] = ()) -> _Candidate:
    """AIM's choice: the exponential mechanism on :func:`_scores`, with the L1
    sensitivity of a count table plus the scores' rounding margin and ε₀ = sqrt(8 ρ_sel);
    without ``noise_corrected``, on MST's score; with ``given`` (target columns), on the
    conditional score and twice the L1 sensitivity."""
    std = _noise_multiplier(plan.rho_measure) * plan.l2_sensitivity if noise_corrected else 0.0
    scores, margin = _scores(cells, sizes, model, candidates, std, num_records, tables, given)
    eps = math.sqrt(8.0 * plan.rho_select) if math.isfinite(plan.rho_select) else math.inf
    sensitivity = (2.0 if given else 1.0) * plan.l1_sensitivity + margin
    return candidates[exponential_mechanism(rng_key, scores, sensitivity=sensitivity, epsilon=eps)]


def _usable(space: CellSpace, chosen: Sequence[Clique], candidates: List[_Candidate],
            max_cells: int) -> List[_Candidate]:
    """The candidates whose table keeps the model's junction tree within ``max_cells``
    cells (public: the schema and the chosen cliques). A pair inside a clique of the
    current tree changes nothing; a table whose columns lie in different parts (connected
    components) of the graph of the chosen tables adds one clique of its own cells to the
    current triangulation (an edge between parts closes no cycle: the graph stays chordal),
    without a new elimination (the greedy one of :func:`d3p.twin.junction.tree_size` can
    differ a little); the others are checked once per table."""
    current = [set(c) for c in maximal_cliques(space.sizes, list(chosen))]
    size = sum(math.prod(space.sizes[v] for v in m) for m in current)
    part = _components(len(space.sizes), chosen)
    fits = {}
    for c in candidates:
        if c.clique not in fits:
            if len({part[v] for v in c.clique}) == len(c.clique):
                alone = sum(space.sizes[v] for v in c.clique if {v} in current)  # absorbed
                fits[c.clique] = size - alone + math.prod(space.sizes[v] for v in c.clique) <= max_cells
                continue
            inside = any(set(c.clique) <= m for m in current)
            fits[c.clique] = inside or tree_size(space.sizes, list(chosen) + [c.clique]) <= max_cells
    return [c for c in candidates if fits[c.clique]]


def tree_round(t: int, plan: MarginalPlan) -> bool:
    """Whether round ``t`` is a tree round (public): it chooses among the tables that join
    two parts (connected components) of the graph whose edges are the tables measured
    so far, with MST's score (no noise correction, which would keep a many-level
    column's tables, each with many cells, out of the tree)."""
    return t < plan.num_tree_rounds


def _components(num_columns: int, chosen: Sequence[Clique]) -> List[int]:
    """The connected component of every column in the graph of the ``chosen`` tables (public)."""
    parent = list(range(num_columns))

    def root(v):
        while parent[v] != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    for clique in chosen:
        for v in clique[1:]:
            parent[root(v)] = root(clique[0])
    return [root(v) for v in range(num_columns)]


def target_round(t: int, target: Sequence[int], plan: Optional[MarginalPlan] = None) -> bool:
    """Whether round ``t`` chooses among the tables that hold a column of ``target`` (public):
    every :data:`TARGET_EVERY`-th round, or on a wide table planned with the target, the
    first ``plan.num_target_rounds``."""
    if plan is not None and plan.num_target_rounds:
        return bool(target) and t < plan.num_target_rounds
    return bool(target) and t % TARGET_EVERY == 0


def _target_columns(target: Sequence[int], num_columns: int) -> Tuple[int, ...]:
    """The target's column indices, sorted and checked (public)."""
    target = tuple(sorted({int(v) for v in target}))
    if any(not 0 <= v < num_columns for v in target):
        raise ValueError(f"Expected target column indices in [0, {num_columns}), got {list(target)}.")
    return target


def _cached_counts(cache: dict, cells: np.ndarray, sizes: Sequence[int], clique: Clique) -> np.ndarray:
    """:func:`_counts` of ``clique``, read once per fit and kept in ``cache`` (private)."""
    if clique not in cache:
        cache[clique] = _counts(cells, sizes, clique)
    return cache[clique]


def _shrunk(measurement: Measurement, std: float, model: GraphicalModel, num_records: int,
            given: Sequence[int] = ()) -> Measurement:
    """``measurement`` with its table shrunk towards what ``model`` (fitted before it) says
    (:func:`shrink_towards`, by rows of the ``given`` target's columns if it has others too;
    unchanged if :data:`SHRINK` is off): post-processing."""
    if not SHRINK:
        return measurement
    prior = project(num_records * marginal(calibrate(model), measurement.clique), measurement.coarsening)
    axes = tuple(i for i, v in enumerate(measurement.clique) if v in given)
    axes = axes if len(axes) < len(measurement.clique) else ()
    return measurement._replace(values=shrink_towards(measurement.values, prior, std, axes))


def _round_candidates(t: int, plan: MarginalPlan, space: CellSpace, chosen: Sequence[Clique],
                      candidates: List[_Candidate], max_model_cells: int, target: Sequence[int]) -> List[_Candidate]:
    """The candidates of round ``t`` (public): the usable ones; in a tree round, those that join
    two parts; in a target round, those that hold a target column (each restriction only if it
    leaves some)."""
    if tree_round(t, plan):
        part = _components(len(space.sizes), chosen)
        usable = _usable(space, chosen, [c for c in candidates if len({part[v] for v in c.clique}) > 1],
                         max_model_cells) or _usable(space, chosen, candidates, max_model_cells)
    else:
        usable = _usable(space, chosen, candidates, max_model_cells)
    if target_round(t, target, plan):
        usable = [c for c in usable if any(v in target for v in c.clique)] or usable
    return usable


def fit_marginals(cells: np.ndarray, space: CellSpace, plan: MarginalPlan, rng_key, *,
                  max_model_cells: int = DEFAULT_MAX_MODEL_CELLS, progress=None, target: Sequence[int] = ()):
    """Run the private rounds and fit the model (see the module docstring).

    :param numpy.ndarray cells: the private records as cells ``(N, D)`` (:meth:`CellSpace.cells`).
    :param CellSpace space: their cells (public).
    :param MarginalPlan plan: the schedule (public).
    :param rng_key: a ``d3p.random`` key for the noise and the choices.
    :param int max_model_cells: see :data:`DEFAULT_MAX_MODEL_CELLS`.
    :param progress: called with ``(round, num_rounds)`` after each round, or None.
    :param target: indices of the declared target's columns (public; default none): in
        the rounds of :func:`target_round` the candidates are the usable tables that
        hold one of them (all usable tables if none does); in a tree round, of those that
        join two parts.
    :return: ``(model, measurements, budget)``: the fitted :class:`GraphicalModel`, the
        released measurements and the :class:`d3p.accounting.ZCDPBudget` they were spent from.

    **Formal guarantees.** Under ``plan.relation`` (add/remove: a count table
    changes by one in one cell, L2 and L1 sensitivity 1; substitute: √2 and
    2), given the schema (which fixes the cells) and N, the measurements, the
    choices and hence the model are ``plan.rho``-zCDP: the one-way tables are
    one Gaussian mechanism of L2 sensitivity √D·Δ₂ (each record is in one
    cell of each of the D tables) with ρ₁ = ``plan.rho_one_way``; each round
    is an exponential mechanism on scores of sensitivity Δ₁ (a score is an
    L1 distance to a count table plus public terms; 2Δ₁ for the conditional
    score of a wide table's target rounds, calibrated so) with ε₀ = √(8 ρ_sel)
    (the round's own ρ: :meth:`MarginalPlan.round_plan`), and
    a Gaussian mechanism of sensitivity Δ₂ (merging cells, whether fixed by
    the schema or chosen by :func:`rare_cell_merging` from the released
    one-way tables, keeps one record in one cell) with ρ_meas; composition
    adds them (the budget checks the total). The counts are exact, the noise
    is added in float64 to a public grid and the scores' rounding is part of
    their sensitivity (:func:`_measure`, :func:`_scores`: up to the float64
    discretisation of the noise stated there). Everything else reads only
    these releases and public settings (the target's columns, which rounds
    are restricted to them, and the parts a tree round joins, read from the
    cliques already released, are public: the candidate set of a round is
    fixed before it reads the data; MST's score drops a public term only).
    """
    num_records, num_columns = cells.shape
    if num_records >= MAX_EXACT_COUNT:
        raise ValueError(f"Expected fewer than 2**53 records (exact float64 counts), got N={num_records}.")
    target = _target_columns(target, num_columns)
    sizes = space.sizes
    budget = accounting.ZCDPBudget(plan.rho)
    key_one_way, key_rounds = d3p.random.split(rng_key, 2)
    candidates = _candidates(space)
    length = _noise_length(space, candidates)
    tables, stds = _measure(key_one_way, [_counts(cells, sizes, (v,)) for v in range(num_columns)],
                            one_way_shares(sizes, plan.rho_one_way), plan.l2_sensitivity, length)
    budget.spend(plan.rho_one_way, "one-way marginals")
    measurements = [Measurement((v,), t, max(s, EXACT_STD), (None,)) for v, (t, s) in enumerate(zip(tables, stds))]
    candidates = _merged_candidates(candidates, sizes, [rare_cell_merging(t, s) for t, s in zip(tables, stds)])
    fitted_to = list(measurements)  # what the estimator reads: the rounds' tables shrunk
    model = estimate(sizes, fitted_to, num_records, num_iterations=200)
    chosen: List[Clique] = []
    counts: dict = {}  # the count tables of the candidates, read once
    for t in range(plan.num_rounds):
        k_select, k_measure = d3p.random.split(d3p.random.fold_in(key_rounds, t), 2)
        usable = _round_candidates(t, plan, space, chosen, candidates, max_model_cells, target)
        if not usable:
            break
        rp = plan.round_plan(t)
        targeted = t < plan.num_target_rounds
        pick = _select(k_select, cells, sizes, model, usable, rp, num_records, tables=counts,
                       noise_corrected=not tree_round(t, plan), given=target if targeted else ())
        budget.spend(rp.rho_select, f"selection {t}")
        table = project(_cached_counts(counts, cells, sizes, pick.clique), pick.coarsening)
        (noisy,), (std,) = _measure(k_measure, [table], [rp.rho_measure], plan.l2_sensitivity, length)
        budget.spend(rp.rho_measure, f"measurement {t}: columns {pick.clique}")
        measurements.append(Measurement(pick.clique, noisy, max(std, EXACT_STD), pick.coarsening))
        fitted_to.append(_shrunk(measurements[-1], std, model, num_records, target if targeted else ()))
        chosen.append(pick.clique)
        if not tree_round(t + 1, plan):  # a tree round reads only the one-way marginals (see _scores)
            model = estimate(sizes, fitted_to, num_records, init=model,
                             num_iterations=FINAL_ITERATIONS if tree_round(t, plan) else ROUND_ITERATIONS)
        if progress is not None:
            progress(t + 1, plan.num_rounds)
    model = estimate(sizes, fitted_to, num_records, init=model, num_iterations=FINAL_ITERATIONS)
    return model, measurements, budget


class MarginalModel:
    """A fitted marginal twin: the schema, its cells and the graphical model.

    :param Schema schema: the complete schema.
    :param CellSpace space: its cells.
    :param GraphicalModel graph: the fitted model over the cells.
    """

    def __init__(self, schema: Schema, space: CellSpace, graph: GraphicalModel):
        self.schema = schema
        self.space = space
        self.graph = graph
        self._calibrated = None

    def description(self) -> dict:
        """JSON description (with the schema and the parameters, enough to rebuild it)."""
        return {"type": "marginal", "version": 1, "factors": [list(f) for f in self.graph.factors],
                **self.space.description()}

    def params(self) -> dict:
        """The potentials, one array per factor (``theta_<i>``)."""
        return {f"theta_{i}": np.asarray(p) for i, p in enumerate(self.graph.potentials)}

    @classmethod
    def from_description(cls, schema: Schema, description: dict, params: dict) -> "MarginalModel":
        """Inverse of :meth:`description` and :meth:`params`."""
        space = CellSpace(schema, description["bins"], description["max_integer_cells"])
        factors = tuple(tuple(int(v) for v in f) for f in description["factors"])
        potentials = tuple(np.asarray(params[f"theta_{i}"], np.float64) for i in range(len(factors)))
        return cls(schema, space, GraphicalModel(space.sizes, factors, potentials))

    def generate_codes(self, num_records: int, rng: np.random.Generator) -> np.ndarray:
        """Synthetic records as codes ``(n, D)`` of the schema (post-processing)."""
        if self._calibrated is None:
            self._calibrated = calibrate(self.graph)
        return self.space.codes(sample(self._calibrated, num_records, rng), rng)


#: :func:`one_way_noise_share` above which a marginal twin is mostly noise.
NOISY_SHARE = 0.5


def one_way_noise_share(sizes: Sequence[int], num_records: int, epsilon: float, delta: float, *,
                        relation: str = accounting.ADD_REMOVE) -> float:
    """The expected total absolute noise of a column's one-way table, as a
    share of N, averaged over the columns: ``sqrt(2/π) × cells × std / N``
    with each table's std from :func:`plan_marginals` and
    :func:`one_way_shares`. Near or above 1, the noisy tables carry little of
    the data: the twin is mostly noise. Public facts only (the schema's cell
    counts, N, ε, δ); 0 for ``epsilon=inf``.

    :param sizes: the number of cells of every column (``CellSpace.sizes``).
    :param int num_records: N.
    :param float epsilon: target ε.
    :param float delta: target δ.
    :param str relation: the neighbouring relation.
    """
    num_records = _validate.integer("num_records", num_records, minimum=1)
    plan = plan_marginals(epsilon, delta, len(sizes), relation=relation)
    if math.isinf(plan.rho):
        return 0.0
    noise = [cells * plan.l2_sensitivity * _noise_multiplier(rho) * math.sqrt(2.0 / math.pi)
             for cells, rho in zip(sizes, one_way_shares(sizes, plan.rho_one_way))]
    return float(np.mean(noise)) / num_records


def noise_warning(schema: Schema, num_records: int, epsilon: float, delta: float, *,
                  relation: str = accounting.ADD_REMOVE) -> Optional[str]:
    """A warning text when a marginal twin of ``num_records`` records would be
    mostly noise (:func:`one_way_noise_share` at least :data:`NOISY_SHARE`),
    else None. Public facts only: the schema's cells, N, ε, δ."""
    share = one_way_noise_share(CellSpace(schema).sizes, num_records, epsilon, delta, relation=relation)
    if share < NOISY_SHARE:
        return None
    return (f"with N = {_validate.plural(num_records, 'record')} at epsilon = {epsilon:g}, the noise on each "
            f"one-way table adds up to about {share:.0%} of N: the twin will be mostly noise. More records, a "
            "larger epsilon or columns with fewer levels or bins help.")
