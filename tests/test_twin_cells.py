"""Bins of the marginal twin's cells (:mod:`d3p.twin.cells`) and of the report's
marginals: bin ``b`` of ``[lower, upper]`` holds ``edges[b] <= x < edges[b + 1]``,
the last bin also ``upper``, for a value read from its code as the twin reads it."""

import numpy as np
import pandas as pd
import pytest

from d3p.twin.cells import CellSpace, bin_edges
from d3p.twin.schema import ColumnSpec, Schema

BINS = 20


def space_of(spec):
    return CellSpace(Schema((spec,)), bins=BINS)


def as_typed(edges):
    """The edges as a user writes them (``0.15``, not ``0.15000000000000002``)."""
    return np.array([float(f"{e:.12g}") for e in edges])


def test_edges_are_the_decimals_a_user_writes():
    edges = bin_edges(0.0, 1.0, BINS)
    assert edges[3] == 0.15 and edges[7] == 0.35 and edges[0] == 0.0 and edges[-1] == 1.0
    assert np.array_equal(bin_edges(0.0, 200000.0, BINS), np.arange(21) * 10000.0)
    assert np.array_equal(bin_edges(-3.0, 7.0, BINS), -3.0 + 0.5 * np.arange(21))
    assert np.all(np.diff(bin_edges(0.1, 0.3, 7)) > 0)


@pytest.mark.parametrize("distribution", ["normal", "lognormal", "hurdle"])
@pytest.mark.parametrize("lower, upper", [(0.0, 200000.0), (0.0, 1.0), (-3.0, 7.0), (0.1, 0.3)])
@pytest.mark.parametrize("table", [True, False])   # Schema.encode's float32 codes, ColumnSpec.encode's float64
def test_a_real_value_on_an_edge_is_in_the_bin_above_it(distribution, lower, upper, table):
    spec = ColumnSpec("x", "real", "float64", False, lower=lower, upper=upper, distribution=distribution)
    space, hurdle = space_of(spec), int(distribution == "hurdle")
    edges = as_typed(bin_edges(lower, upper, BINS))
    width = (upper - lower) / BINS
    below = edges[1:-1] - 1e-5 * width   # just below every inner edge
    values = np.concatenate([edges, below])
    if table:
        codes = Schema((spec,)).encode(pd.DataFrame({"x": values}))
        assert codes.dtype == np.float32
    else:
        codes = spec.encode(pd.Series(values))[:, None]
    cells = space.cells(codes)[:, 0]
    on_edges, below_edges = cells[:len(edges)], cells[len(edges):]
    expected = np.minimum(np.arange(BINS + 1), BINS - 1) + hurdle   # the last bin also holds upper
    if hurdle:
        expected[0] = 0   # the value lower exactly: its own cell
    assert list(on_edges) == list(expected)
    assert list(below_edges) == list(np.arange(BINS - 1) + hurdle)


def test_an_income_column_of_round_values_keeps_each_value_in_its_bin():
    """Incomes in whole thousands, a fifth of them on an edge of the 10,000-wide bins:
    every value in the bin floor(value / 10,000) (the top one also holds 200,000)."""
    rng = np.random.default_rng(0)
    income = np.round(rng.lognormal(10.5, 0.6, 2000), -3).clip(0, 200000)
    income[:400] = rng.integers(0, 21, 400) * 10000.0
    spec = ColumnSpec("income", "real", "float64", False, lower=0.0, upper=200000.0, distribution="lognormal")
    codes = Schema((spec,)).encode(pd.DataFrame({"income": income}))
    cells = space_of(spec).cells(codes)[:, 0]
    assert np.array_equal(cells, np.minimum(income // 10000, BINS - 1).astype(int))


@pytest.mark.parametrize("distribution", ["normal", "negbinomial"])
def test_a_count_on_an_edge_is_in_the_bin_above_it(distribution):
    spec = ColumnSpec("k", "count", "int64", False, lower=0.0, upper=1000.0, distribution=distribution)
    space = space_of(spec)
    assert space.columns[0].kind == "bins"
    values = np.concatenate([np.arange(0, 1001, 50), np.arange(49, 1000, 50)])   # edges, and one below each
    codes = Schema((spec,)).encode(pd.DataFrame({"k": values}))
    cells = space.cells(codes)[:, 0]
    assert list(cells[:21]) == list(np.minimum(np.arange(21), BINS - 1))
    assert list(cells[21:]) == list(np.arange(BINS))


def test_the_report_bins_values_on_edges_as_the_twin_does():
    from d3p.twin.metrics import marginal_tv_distances

    spec = ColumnSpec("x", "real", "float64", False, lower=0.0, upper=1.0, distribution="normal")
    edges = as_typed(bin_edges(0.0, 1.0, BINS))
    real = pd.DataFrame({"x": edges[3:4].repeat(10)})           # 0.15, an edge
    same_bin = pd.DataFrame({"x": np.full(10, 0.17)})            # inside [0.15, 0.2)
    bin_below = pd.DataFrame({"x": np.full(10, 0.13)})           # inside [0.1, 0.15)
    schema = Schema((spec,))
    assert marginal_tv_distances(real, same_bin, schema=schema, bins=BINS)["x"] == 0.0
    assert marginal_tv_distances(real, bin_below, schema=schema, bins=BINS)["x"] == 1.0
