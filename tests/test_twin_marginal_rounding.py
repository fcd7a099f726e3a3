"""The marginal twin's releases hold their sensitivity in floating point, whatever N:
exact integer counts and float64 noise in :func:`d3p.twin.marginal._measure`, a
bounded rounding of the selection scores in :func:`d3p.twin.marginal._scores`.

The neighbouring tables here have totals far beyond 2**24 (where float32 cannot
hold every count) and counts chosen where the float32 spacing is largest; the
release function is run on both with the same noise key."""

import math
from fractions import Fraction

import jax
import numpy as np
import pytest

import d3p.random
from d3p.twin import marginal as M
from d3p.twin.estimation import Measurement, estimate

N = 600_000_000  # > 2**29
# counts the other records can choose: just above powers of two, where a float32 step is 4 to 32
ADVERSARIAL = [2**25 + 1, 2**27 + 3, 2**28 - 1, 3 * 2**24 + 1, 5, 0, 2**26 + 7]
SHARES = [0.37, 0.011, 0.0023]


def big_tables():
    """Three tables over the same N records (each sums to N): one-way tables of 8 and
    5 cells and a 3 x 4 table, with adversarial counts."""
    a = np.array(ADVERSARIAL + [N - sum(ADVERSARIAL)], np.int64)
    b = np.array([2**27 + 1, 2**26 + 3, 2**24 + 1, 1, 0], np.int64)
    b[-1] = N - b.sum()
    c = np.array([[2**25 + 1, 2**24 + 1, 3, 2**26 - 1], [2**27 + 5, 0, 1, 2**25 + 3],
                  [2**23 + 1, 7, 2**24 + 3, 0]], np.int64)
    c[2, 3] = N - c.sum()
    tables = [a, b, c]
    assert all(t.sum() == N and t.min() >= 0 for t in tables)
    return tables


def neighbours(tables, cells, change):
    """The tables with one record, in ``cells[i]`` of table ``i``, added (+1) or removed (-1)."""
    out = [t.copy() for t in tables]
    for t, cell in zip(out, cells):
        t[cell] += change
    return out


CELLS = [(0, 0, (0, 0)), (2, 1, (1, 0)), (1, 2, (2, 2)), (7, 4, (2, 3)), (4, 3, (0, 2)), (5, 4, (1, 1))]


@pytest.mark.parametrize("sensitivity", [1.0, math.sqrt(2)])
def test_one_record_moves_a_released_cell_by_exactly_one(sensitivity):
    """Add/remove one record: with the same key, every released cell moves by exactly
    the change of its count (one in the record's cells, zero elsewhere), for N > 2**29
    and counts just above powers of two."""
    tables = big_tables()
    for seed in range(8):
        key = d3p.random.PRNGKey(seed)
        y0, stds = M._measure(key, tables, SHARES, sensitivity, 64)
        assert stds == pytest.approx([sensitivity / math.sqrt(2 * s) for s in SHARES], rel=1e-15)
        for cells in CELLS:
            for change in (+1, -1):
                other = neighbours(tables, cells, change)
                y1, _ = M._measure(key, other, SHARES, sensitivity, 64)
                for a, b, t, u in zip(y0, y1, tables, other):
                    assert a.dtype == np.float64 and np.array_equal(b - a, (u - t).astype(np.float64))


def _float32_release(tables, shares, sensitivity, z):
    """A release with float32 arithmetic: ``float32(w t) + float32(σ C z)``, divided by
    ``w`` (the weighted form with w = sqrt(share)); used to show that the check above
    has power."""
    w = np.sqrt(np.asarray(shares))
    clip = sensitivity * float(np.sqrt(np.sum(w * w)))
    std = clip / math.sqrt(2.0 * float(np.sum(shares)))
    out, start = [], 0
    for wi, t in zip(w, tables):
        noise = np.float32(std) * z[start:start + t.size].astype(np.float32).reshape(t.shape)
        out.append(((wi * t).astype(np.float32) + noise).astype(np.float64) / wi)
        start += t.size
    return out


def test_the_check_catches_a_release_in_float32():
    """The same neighbours and noise through a float32 release: some cell moves by 0 or by
    a whole float32 step (in sensitivity units, up to 32 / w), which the check refuses."""
    tables = big_tables()
    z = d3p.random.normal_float64(d3p.random.PRNGKey(0), (64,))
    y0 = _float32_release(tables, SHARES, 1.0, z)
    worst = 0.0
    for cells in CELLS:
        y1 = _float32_release(neighbours(tables, cells, +1), SHARES, 1.0, z)
        worst = max(worst, *(float(np.max(np.abs(b - a))) for a, b in zip(y0, y1)))
    assert worst > 2.0  # a record moved a cell by more than twice its sensitivity


def test_released_values_are_the_grid_rounding_of_the_exact_sum():
    """``_noisy_counts`` is ``round_g(t + n)`` of the exact sum of the integer count and
    the noise ``n = fl(std z)`` (ties to even), correctly rounded to float64, computed
    here with fractions; also at noise values exactly half-way between grid points."""
    std = 3.7
    g = M._release_grid(std)
    assert g == 2.0 ** (math.floor(math.log2(std)) - M.GRID_BITS) and M._release_grid(1e9) == 0.5
    counts = np.array([0, 1, 2, 2**25 + 1, 2**40 + 3, 2**52 - 1, 12345], np.int64)
    z = d3p.random.normal_float64(d3p.random.PRNGKey(3), (7,))
    halves = np.array([0.5, 1.5, 2.5, -0.5, -1.5, 7.5, 1e6 + 0.5]) * g / std
    halves = np.array([float(Fraction(h).limit_denominator()) for h in halves])
    for zz in (z, -z, halves, -halves):
        y = M._noisy_counts(counts, std, zz)
        for t, zi, yi in zip(counts, zz, y):
            exact = Fraction(int(t)) + Fraction(float(std * zi))
            assert yi == float(round(exact / Fraction(g)) * Fraction(g)), (t, zi)
    std = 1.0  # noise exactly half-way between grid points: ties to even, as the exact rounding
    g = M._release_grid(std)
    ties = np.array([0.5, 1.5, -0.5, -2.5]) * g
    y = M._noisy_counts(np.array([10, 11, 10, 2**40 + 1], np.int64), std, ties)
    assert np.array_equal(y - np.array([10, 11, 10, 2**40 + 1]), np.array([0.0, 2.0, 0.0, -2.0]) * g)


def test_release_is_the_same_with_and_without_x64():
    tables = big_tables()
    with jax.enable_x64(False):
        off, _ = M._measure(d3p.random.PRNGKey(4), tables, SHARES, 1.0, 64)
    with jax.enable_x64(True):
        on, _ = M._measure(d3p.random.PRNGKey(4), tables, SHARES, 1.0, 64)
    assert all(np.array_equal(a, b) for a, b in zip(off, on))


def test_fractional_tables_and_empty_shares_are_refused():
    with pytest.raises(TypeError, match=r"tables\[1\]"):
        M._measure(d3p.random.PRNGKey(0), [np.zeros(3), np.array([0.5, 1.0])], [0.1, 0.1], 1.0, 8)
    with pytest.raises(ValueError, match="shares"):
        M._measure(d3p.random.PRNGKey(0), [np.zeros(3), np.zeros(2)], [0.1, 0.0], 1.0, 8)


def test_selection_scores_move_by_at_most_the_sensitivity_and_margin_at_large_n(monkeypatch):
    """The scores of neighbouring count tables (one record moved between cells chosen
    where float32 steps are large, N > 2**29) differ by at most the L1 sensitivity plus
    the public rounding margin that _select adds to it, a margin that stays tiny."""
    sizes = (8, 5)
    two_way = np.zeros(sizes, np.int64)
    # one below a float32 tie that rounds up a whole step: c and c + 1 are 4, 8, 16 apart in float32
    two_way[:6, 0] = [2**25 + 5, 2**26 + 11, 2**27 + 23, 2**24 + 3, 2**25 + 1, 7]
    two_way[:3, 1] = [2**26 + 3, 5, 2**24 + 1]
    two_way[7, 4] = N - two_way.sum()
    assert two_way.sum() == N and two_way.min() >= 0
    measured = [Measurement((0,), two_way.sum(1).astype(np.float64) + 3.0, 5.0, (None,)),
                Measurement((1,), two_way.sum(0).astype(np.float64) - 2.0, 5.0, (None,))]
    model = estimate(sizes, measured, N, num_iterations=30)
    cands = [M._Candidate((0, 1), (None, None), 40)]

    def scores(table):
        monkeypatch.setattr(M, "_counts", lambda cells, s, clique: table)
        return M._scores(None, sizes, model, cands, 3.0, N)

    s0, margin = scores(two_way)
    assert 0 < margin < 1e-5
    for (i, j) in [(0, 0), (1, 0), (2, 0), (3, 0), (4, 0), (0, 1), (2, 1), (7, 4)]:
        for change in (+1, -1):
            moved = two_way.copy()
            moved[i, j] += change
            s1, margin1 = scores(moved)
            assert margin1 == margin  # public: from the model and N
            assert abs(s1[0] - s0[0]) <= 1.0 + margin


def test_the_margin_covers_rounding_that_exceeds_the_l1_sensitivity(monkeypatch):
    """A model that puts almost no mass on a cell holding 2**28 records: adding or removing
    a record there moves ``|f - t|`` across a power of two, where the float64 spacing
    changes, and the computed score by more than 1 (the construction has power), but
    never by more than 1 + margin."""
    from d3p.twin.graphical import GraphicalModel

    sizes = (8, 5)
    two_way = np.zeros(sizes, np.int64)
    two_way[:6, 0] = [2**28, 2**26 + 11, 2**27 + 23, 2**24 + 3, 2**25 + 1, 7]
    two_way[7, 4] = N - two_way.sum()
    cands = [M._Candidate((0, 1), (None, None), 40)]
    rng = np.random.default_rng(0)
    excess = []
    for _ in range(50):
        p = rng.uniform(0.5, 1.5, sizes)
        p[0, 0] = rng.uniform(1e-9, 1e-8)
        model = GraphicalModel(sizes, ((0, 1),), (np.log(p / p.sum()),))

        def scores(table):
            monkeypatch.setattr(M, "_counts", lambda cells, s, clique: table)
            return M._scores(None, sizes, model, cands, 3.0, N)

        (s0,), margin = scores(two_way)
        for change in (+1, -1):
            moved = two_way.copy()
            moved[0, 0] += change
            (s1,), _ = scores(moved)
            excess.append(abs(s1 - s0) - 1.0)
            assert abs(s1 - s0) <= 1.0 + margin
    assert max(excess) > 0 and margin < 1e-5
