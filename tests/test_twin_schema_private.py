"""Private schema inference (the twin's default path): the mechanism's sensitivity, noise, threshold and
accounting against independent references, neighbours that differ in an extreme value or a unique level,
and what the fit and the command line release and refuse."""

import math
import warnings

import numpy as np
import pandas as pd
import pytest
from scipy.optimize import minimize_scalar
from scipy.stats import norm

import d3p.random
import d3p.twin as twin
from d3p.ledger import PrivacyLedger
from d3p.twin import _schema_private as sp
from d3p.twin.schema import ColumnSpec, Schema, SchemaInferenceWarning

N = 300


def _table(seed=0, n=N):
    rng = np.random.default_rng(seed)
    return pd.DataFrame({"region": rng.choice(["A", "B"], n, p=[0.6, 0.4]),
                         "wage": rng.integers(1000, 5000, n).astype(float),
                         "score": rng.integers(1, 4, n)})


def _with_outlier(data):
    """``data`` and one more record: a wage ten times the largest, a region no one else has."""
    extra = pd.DataFrame({"region": ["Zeta"], "wage": [10.0 * data["wage"].max()], "score": [2]})
    return pd.concat([data, extra], ignore_index=True)


# ------------------------------------------------------------------ sensitivity


@pytest.mark.parametrize("value", ["Zeta", 1e7, -3.5, 0, 15, 16, None, True, "7", float("inf"), 2**1100, [1, 2],
                                   complex(1, 2), "nan", " 3 "])
def test_one_record_moves_one_cell_of_each_column(value):
    """Add/remove: every value falls in exactly one cell (grid or text), so one record changes one count
    by one (L2 sensitivity 1 per column); a value counted twice would show here."""
    col = pd.Series(["A", "B", 3.0, 2000.5, None], dtype=object)
    grid0, text0 = sp._column_counts(col)
    grid1, text1 = sp._column_counts(pd.concat([col, pd.Series([value], dtype=object)], ignore_index=True))
    moved = int(np.abs(grid1 - grid0).sum()) + sum(abs(text1.get(t, 0) - text0.get(t, 0))
                                                   for t in set(text0) | set(text1))
    assert moved == 1


def test_the_grid_is_public_and_fixed():
    """Every column's grid has the same cells whatever the data: only texts are data-dependent keys."""
    g1, _ = sp._column_counts(pd.Series([1.0, 2.0]))
    g2, _ = sp._column_counts(pd.Series(["x"] * 5 + [1e300]))
    assert g1.shape == g2.shape == (sp.GRID_SIZE,)
    assert sp.GRID_SIZE == 1 + (2 * sp.EXACT_LIMIT + 1) + 4 * (sp.MAX_EXPONENT - sp.MIN_EXPONENT + 1)


# ------------------------------------------------------------------ the plan, against closed forms


def _zcdp_epsilon(rho, delta):
    """ε of ρ-zCDP at δ (Canonne, Kamath & Steinke 2020, Prop. 12), minimised over the order."""
    f = lambda a: a * rho + (math.log(1 / delta) + (a - 1) * math.log(1 - 1 / a) - math.log(a)) / (a - 1)
    return minimize_scalar(f, bounds=(1.0001, 1e6), method="bounded").fun


@pytest.mark.parametrize("relation,factor", [("add_remove", 1.0), ("substitute", 2.0)])
def test_plan_noise_is_the_gaussian_mechanism_of_its_rho(relation, factor):
    c, eps, delta = 5, 1.0, 1e-6
    plan = sp.plan_schema(c, 1000, eps, delta, relation=relation, share=0.1)
    # L2 sensitivity of c histograms: sqrt(c) (add/remove), sqrt(2c) (substitute: one cell down, one up)
    sensitivity = math.sqrt(c * factor)
    assert plan.rho == pytest.approx(sensitivity**2 / (2 * plan.noise_std**2), rel=1e-12)
    # the share: a tenth of the twin's rho, whose zCDP conversion at delta - delta_thr is epsilon
    total = plan.rho / 0.1
    assert _zcdp_epsilon(total, delta - plan.delta_threshold) == pytest.approx(eps, rel=2e-3)
    assert plan.delta_threshold == pytest.approx(0.1 * delta)
    # the one step of q = 1 that the mixture's accountant composes is this Gaussian mechanism (μ = sqrt(2ρ)):
    # the analytic Gaussian mechanism's ε (Balle & Wang 2018) at μ
    from scipy.optimize import brentq

    from d3p.accounting import compose_epsilon

    mu = math.sqrt(2 * plan.rho)
    exact = brentq(lambda e: norm.cdf(-e / mu + mu / 2) - math.exp(e) * norm.cdf(-e / mu - mu / 2) - 1e-6, 0, 50)
    assert compose_epsilon([(plan.phase_sigma(), 1.0, 1)], 1e-6, relation=relation) == pytest.approx(exact, rel=1e-6)


def test_a_text_of_one_record_is_released_with_at_most_the_threshold_delta():
    """P(count 1 + noise > threshold), over the columns and with the e^ε / (1 - cp) factor, ≤ δ_thr."""
    for c, n, eps, delta in [(1, 100, 1.0, 1e-4), (8, 20_000, 0.5, 1e-9), (30, 500, 8.0, 4e-6)]:
        plan = sp.plan_schema(c, n, eps, delta)
        p = norm.sf((plan.level_threshold - 1.0) / plan.noise_std)
        assert math.exp(eps) * c * p / (1 - c * p) <= plan.delta_threshold
        # not loose by orders of magnitude: a threshold 2 noise stds lower would pass it
        p_lower = norm.sf((plan.level_threshold - 1.0 - 2 * plan.noise_std) / plan.noise_std)
        assert math.exp(eps) * c * p_lower / (1 - c * p_lower) > plan.delta_threshold


def test_mixture_accounting_against_dp_accounting():
    """The mixture's plan (Poisson sampling, add/remove): σ calibrated so that the schema's Gaussian release
    (one step of q = 1) and the run composed meet ε, checked against dp-accounting's PLD accountant called
    directly. (The q = 1 step's sensitivity under substitution is checked in the plan's test above.)"""
    dp_accounting = pytest.importorskip("dp_accounting")
    from d3p.twin import _fit_plan

    n, eps, delta, q, steps = 2000, 1.0, 1e-6, 0.05, 400
    schema = sp.plan_schema(6, n, eps, delta)
    plan = _fit_plan.privacy_plan(n, eps, delta, q, steps, "poisson", "fourier", schema)
    assert plan.delta_run == pytest.approx(delta - plan.overflow - schema.delta_threshold)
    # the schema part: noise std s per cell, L2 sensitivity sqrt(c)
    schema_event = dp_accounting.GaussianDpEvent(schema.noise_std / math.sqrt(6))
    run_event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(plan.q, dp_accounting.GaussianDpEvent(plan.sigma)), steps)

    def reference(events):
        acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3)
        acc.compose(dp_accounting.ComposedDpEvent(events))
        return acc.get_epsilon(plan.delta_run)

    together = reference([schema_event, run_event])
    assert plan.epsilon_of() <= eps + 1e-9
    assert together == pytest.approx(eps, rel=0.02)
    # the composition is counted: the run alone, at the same σ, is clearly below ε
    assert reference([run_event]) < 0.97 * together


def test_marginal_accounting_adds_the_schema_rho():
    data = _table()
    tw = twin.fit(data, 1.0, 1e-5, rng_key=0, family="marginal", progress_bar=False)
    p = tw.privacy
    s = p["schema"]
    assert p["rho"] > s["rho"] > 0
    eps = _zcdp_epsilon(p["rho"], p["delta"] - s["delta_threshold"])
    assert p["epsilon"] == pytest.approx(eps, rel=2e-3)
    assert p["epsilon"] <= 1.0 + 1e-9


# ------------------------------------------------------------------ neighbours


def _releases(data, keys, plan):
    cols = [data[n] for n in data.columns]
    return [sp._noisy_release(cols, plan, d3p.random.PRNGKey(k)) for k in keys]


def test_noise_scale_of_the_released_counts():
    """The released cells' noise has the plan's std: measured over 600 releases of one table; a scale
    10% off is rejected (the estimate's relative sd is about 1.2% from 600 x 3 cells)."""
    data = _table()
    plan = sp.plan_schema(3, N + 1, 1.0, 1e-6)
    exact = [sp._column_counts(data[n])[0] for n in data.columns]
    noise = []
    for rel in _releases(data, range(600), plan):
        for (grid, _), e in zip(rel, exact):
            noise.append(grid[[0, 5, 200]] - e[[0, 5, 200]])
    sd = float(np.std(np.concatenate(noise)))
    assert abs(sd / plan.noise_std - 1) < 0.05
    assert not abs(sd / (0.9 * plan.noise_std) - 1) < 0.05


def _schema_outcomes(data, seeds):
    out = []
    for k in seeds:
        s = twin.infer_schema_private(data, 1.0, 1e-6, rng_key=d3p.random.PRNGKey(k)).schema
        out.append((s["region"].levels, s["wage"].lower, s["wage"].upper, s["wage"].nullable))
    return out


@pytest.mark.slow   # 600 private schemas (its power check, 20 of them, stays in the default step)
def test_an_outlier_on_one_side_only_is_never_released():
    """D and D + one record (a wage 10x the maximum, a unique region): over 300 releases of each, the
    unique level and a bound at the outlier's power of two never appear (probability ≤ δ_thr per release,
    about 1e-7 here), and the outcomes' distributions are alike."""
    d = _table(1)
    d2 = _with_outlier(d)
    big = 10.0 * d["wage"].max()
    a, b = _schema_outcomes(d, range(300)), _schema_outcomes(d2, range(1000, 1300))
    assert not any("Zeta" in (levels or ()) for levels, *_ in b)
    assert not any((upper or 0.0) >= 2.0 ** math.floor(math.log2(big)) for _, _, upper, _ in b)
    # the bounds' distribution moves little: the Gaussian part is μ = sqrt(2ρ) ≈ 0.08-GDP, so the total
    # variation between the two sides is at most about 0.03 (plus sampling noise of about 0.08)
    for i in (1, 2):
        va = pd.Series([o[i] for o in a]).value_counts(normalize=True)
        vb = pd.Series([o[i] for o in b]).value_counts(normalize=True)
        tv = 0.5 * va.subtract(vb, fill_value=0).abs().sum()
        assert tv < 0.15


def test_the_outlier_check_has_power(monkeypatch):
    """Without the threshold (texts released at any noisy count), the same check finds the unique level."""
    monkeypatch.setattr(sp, "plan_schema", lambda *a, **k: _plan_without_thresholds(*a, **k))
    d2 = _with_outlier(_table(1))
    out = _schema_outcomes(d2, range(20))
    assert sum("Zeta" in (levels or ()) for levels, *_ in out) >= 5


def _plan_without_thresholds(*args, _real=sp.plan_schema, **kwargs):
    return _real(*args, **kwargs)._replace(level_threshold=-math.inf)


# ------------------------------------------------------------------ the fit and its record


def test_default_fit_reads_nothing_outside_epsilon():
    data = _table()
    before = data.copy()
    with warnings.catch_warnings():
        warnings.simplefilter("error", SchemaInferenceWarning)
        tw = twin.fit(data, 1.0, rng_key=0, family="marginal", progress_bar=False)
    pd.testing.assert_frame_equal(data, before)
    assert tw.privacy["not_covered"] == {}
    assert tw.privacy["schema"]["columns"] == ["region", "wage", "score"]
    assert tw.privacy["schema"]["share"] == sp.SCHEMA_SHARE
    assert all(not c.inferred for c in tw.schema.columns)


def test_data_inference_is_still_there_and_warned():
    with pytest.warns(SchemaInferenceWarning):
        tw = twin.fit(_table(), 1.0, rng_key=0, family="marginal", progress_bar=False, schema_inference="data")
    assert tw.privacy["not_covered"] and tw.privacy["schema"] is None


def test_a_complete_schema_spends_nothing_on_it():
    data = _table()
    schema = Schema((ColumnSpec("region", "categorical", nullable=False, levels=("A", "B"), distribution="categorical"),
                     ColumnSpec("wage", "real", nullable=False, lower=0, upper=10000, distribution="normal"),
                     ColumnSpec("score", "count", nullable=False, lower=0, upper=5, distribution="negbinomial")))
    tw = twin.fit(data, 1.0, rng_key=0, schema=schema, family="marginal", progress_bar=False)
    assert tw.privacy["schema"] is None and tw.privacy["not_covered"] == {}
    plan = twin.marginal.plan_marginals(1.0, 1.0 / N**2, 3)
    assert tw.privacy["rho"] == pytest.approx(plan.rho, rel=1e-9)


@pytest.mark.parametrize("kwargs", [{"schema_inference": "data"}, {"epsilon": math.inf},
                                    {"schema": {"columns": [{"name": "wage", "kind": "real", "inferred": ["kind"]}]}}])
def test_strict_refuses_before_reading(kwargs, monkeypatch):
    read = []
    monkeypatch.setattr(sp, "_noisy_release", lambda *a, **k: read.append(1))
    monkeypatch.setattr(twin.inference._fit_plan, "infer_schema", lambda *a, **k: read.append(1))
    args = {"epsilon": 1.0, **kwargs}
    with pytest.raises(ValueError, match="strict"):
        twin.fit(_table(), args.pop("epsilon"), rng_key=0, strict=True, progress_bar=False, **args)
    assert not read


def test_nothing_raises_or_warns_on_odd_columns():
    data = pd.DataFrame({"empty": [None] * 40, "one": ["x"] + [None] * 39, "mixed": ["a", 1, 2.5, None] * 10,
                         "flag": ["true", "False"] * 20, "huge": [1e300, -1e300] * 20})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = twin.infer_schema_private(data, 1.0, rng_key=d3p.random.PRNGKey(0)).schema
    assert [c.missing_fields() for c in s.columns] == [[]] * 5


def test_a_private_schema_is_for_its_fit_only():
    data = _table()
    ps = twin.infer_schema_private(data, 1.0, rng_key=d3p.random.PRNGKey(9))
    with pytest.raises(ValueError, match="planned for epsilon=1.0"):
        twin.fit(data, 2.0, rng_key=0, schema=ps, progress_bar=False)
    tw = twin.fit(data, 1.0, rng_key=0, schema=ps, family="marginal", progress_bar=False)
    assert tw.schema == ps.schema and tw.privacy["schema"]["rho"] == ps.plan.rho


@pytest.mark.slow
def test_the_ledger_holds_the_schema_and_the_model():
    ledger = PrivacyLedger()
    tw = twin.fit(_table(), 1.0, 1e-5, rng_key=0, family="mixture", num_steps=50, progress_bar=False,
                  ledger=ledger)
    whats = [r.what for r in ledger.releases]
    assert whats[:2] == ["twin schema (noisy histograms)", "twin schema (levels' threshold)"]
    assert ledger.epsilon(tw.privacy["delta"]) == pytest.approx(tw.privacy["epsilon"], rel=0.02)


def test_a_budget_too_small_is_refused_before_reading(monkeypatch):
    read = []
    monkeypatch.setattr(sp, "_noisy_release", lambda *a, **k: read.append(1))
    ledger = PrivacyLedger(budget_epsilon=1.0, budget_delta=1e-5)
    ledger.record_epsilon_delta("an earlier release", 0.999, 0.0, relation="add_remove")
    with pytest.raises(ValueError, match="budget"):
        twin.fit(_table(), 1.0, 1e-5, rng_key=0, progress_bar=False, ledger=ledger)
    assert not read and len(ledger) == 1


def test_a_refused_model_after_a_private_schema_leaves_the_schema_on_record(tmp_path, capsys):
    """The command line: a budget that holds the schema's release but not the model's refuses the fit,
    and the ledger file keeps the schema's release (the data were read)."""
    from d3p.twin.cli import main

    _table().to_csv(tmp_path / "in.csv", index=False)
    ledger = tmp_path / "ledger.json"
    code = main([str(tmp_path / "in.csv"), str(tmp_path / "out.csv"), "--epsilon", "1", "--delta", "1e-5",
                 "--family", "marginal", "--no-progress", "--seed", "0", "--ledger", str(ledger),
                 "--budget-epsilon", "0.5", "--budget-delta", "1e-5"])
    err = capsys.readouterr().err
    assert code == 2 and "budget" in err and "its release is recorded in" in err
    assert [r.what for r in PrivacyLedger.load(str(ledger)).releases] == [
        "twin schema (noisy histograms)", "twin schema (levels' threshold)"]
    assert not (tmp_path / "out.csv").exists()


@pytest.mark.parametrize("bad", ["extra field", "missing fields", "unclosed quote", "text in numbers", "blank line",
                                 "NUL byte", "invalid UTF-8"])
def test_cli_default_path_reads_each_line_as_one_record(tmp_path, bad):
    """Without --schema (the schema read privately) the file is read line by line as text: a malformed
    line is one record, the read neither fails nor warns, and the neighbours' exact counts differ in at
    most one cell down and one up per column (the sensitivity the plan accounts under substitution)."""
    import argparse

    from test_twin_schema_privacy import BAD_LINES, _neighbour_files, observe

    from d3p.twin.cli import _read_csv

    a, b, _, D, _ = _neighbour_files(tmp_path, BAD_LINES[bad])
    frames = []
    for path in (a, b):
        args = argparse.Namespace(input=str(path), na_values=None, schema=None)
        data, error, warned = observe(lambda: _read_csv(args, None, all_text=True))
        assert error is None and warned == [], (error, warned)
        assert len(data) == len(D)
        assert all(isinstance(v, str) for c in data.columns for v in data[c].dropna().tolist())  # all text
        frames.append(data)
    for name in frames[0].columns:
        (ga, ta), (gb, tb) = (sp._column_counts(f[name]) for f in frames)
        moved = int(np.abs(ga - gb).sum()) + sum(abs(ta.get(t, 0) - tb.get(t, 0)) for t in set(ta) | set(tb))
        assert moved <= 2, name


def test_bounds_do_not_cross_zero_or_reach_past_the_records():
    """A non-negative column never gets a negative bound; an integer scale 1..5 whose levels all clear is a
    count in [1, 5] (a value beyond is clipped to the nearest), one integer wider at an end only where the
    next, empty, cell's noise passes two stds (2.3% per end); a column of 0/1 is boolean. 100 releases."""
    rng = np.random.default_rng(3)
    data = pd.DataFrame({"amount": np.where(rng.random(3000) < 0.3, 0.0, rng.lognormal(3, 1, 3000)).round(2),
                         "visits": rng.poisson(0.7, 3000), "scale": rng.integers(1, 6, 3000),
                         "flag": rng.integers(0, 2, 3000)})
    exact = []
    for k in range(100):
        s = twin.infer_schema_private(data, 1.0, rng_key=d3p.random.PRNGKey(k)).schema
        assert s["amount"].lower >= 0 and s["visits"].lower >= 0, k
        assert s["scale"].kind == "count" and s["scale"].lower in (0.0, 1.0) and s["scale"].upper in (5.0, 6.0), k
        exact.append((s["scale"].lower, s["scale"].upper) == (1.0, 5.0))
        assert s["flag"].kind == "boolean", k
    assert 85 <= sum(exact) < 100


def test_a_private_schema_released_with_the_fits_own_key_is_refused():
    """The fit's noise would repeat the schema's (the marginal twin draws from its key directly)."""
    data = _table()
    ps = twin.infer_schema_private(data, 1.0, rng_key=d3p.random.PRNGKey(0))
    with pytest.raises(ValueError, match="rng_key to differ"):
        twin.fit(data, 1.0, rng_key=d3p.random.PRNGKey(0), schema=ps, family="marginal", progress_bar=False)
    tw = twin.fit(data, 1.0, rng_key=d3p.random.PRNGKey(1), schema=ps, family="marginal", progress_bar=False)
    assert tw.schema == ps.schema
