"""Tests of d3p.twin: schema inference, JSON round trip, encoding, bad input, metrics, model.

All fast (no DP-VI fit); the fits are in tests/test_twin_fit.py.
"""

import json
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd
import pytest
from scipy import stats

import d3p.twin as twin
from d3p.twin import ColumnSpec, Schema, SchemaInferenceWarning, TwinInputError, infer_schema
from d3p.twin.model import MixtureModel, MixtureOfProducts


def mixed_frame(n=200, seed=0):
    """A small table with every kind of column and missing values."""
    rng = np.random.default_rng(seed)
    age = rng.normal(50, 10, n)
    age[rng.uniform(size=n) < 0.1] = np.nan
    region = rng.choice(["N", "S", "E"], n, p=[0.5, 0.3, 0.2]).astype(object)
    region[rng.uniform(size=n) < 0.1] = None
    return pd.DataFrame({
        "age": age,
        "visits": rng.poisson(3, n),
        "smoker": rng.uniform(size=n) < 0.3,
        "region": pd.Series(region, dtype="str"),
        "grade": pd.Categorical(rng.choice(["lo", "mid", "hi"], n), categories=["lo", "mid", "hi"], ordered=True),
        "income": rng.lognormal(3, 1, n),
        "spend": np.where(rng.uniform(size=n) < 0.4, 0.0, rng.gamma(2.0, 10.0, n)),
        "calls": rng.negative_binomial(2, 0.1, n),
    })


def quiet_infer(df, schema=None, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SchemaInferenceWarning)
        return infer_schema(df, schema, **kw)


# ------------------------------------------------------------------ schema


def test_infer_schema_kinds_and_fields():
    df = mixed_frame()
    with pytest.warns(SchemaInferenceWarning) as rec:
        s = infer_schema(df)
    assert s.names == list(df.columns)
    kinds = {c.name: c.kind for c in s.columns}
    assert kinds == {"age": "real", "visits": "categorical", "smoker": "boolean", "region": "categorical",
                     "grade": "categorical", "income": "real", "spend": "real", "calls": "count"}
    assert s["age"].nullable and s["region"].nullable and not s["visits"].nullable
    assert s["region"].levels == ("E", "N", "S")
    assert s["grade"].levels == ("lo", "mid", "hi") and s["grade"].ordered
    # few distinct integers: ordered levels; many: a count; a point mass at the minimum: a hurdle
    assert s["visits"].levels == tuple(sorted(set(df.visits))) and s["visits"].ordered
    assert s["calls"].distribution == "negbinomial" and s["spend"].distribution == "hurdle"
    assert s["income"].distribution == "lognormal"  # skewed, non-negative
    assert s["age"].lower == pytest.approx(np.nanmin(df.age)) and s["age"].upper == pytest.approx(np.nanmax(df.age))
    # the warning names what was read
    msg = str(rec[0].message)
    for word in ("'age'", "bounds", "levels", "missing values", "WITHOUT differential privacy"):
        assert word in msg
    assert set(s.inferred_fields()["age"]) >= {"lower", "upper", "nullable"}


def test_explicit_schema_reads_nothing_and_does_not_warn():
    df = mixed_frame()
    full = quiet_infer(df)
    explicit = Schema(tuple(ColumnSpec.from_dict({k: v for k, v in c.to_dict().items() if k != "inferred"})
                            for c in full.columns))
    with warnings.catch_warnings():
        warnings.simplefilter("error", SchemaInferenceWarning)
        s = infer_schema(df, explicit)
    assert s.inferred_fields() == {}
    assert s == explicit


def test_partial_schema_infers_only_missing_fields():
    df = mixed_frame()
    partial = {"columns": [{"name": "age", "kind": "real", "lower": 0, "upper": 120, "nullable": True,
                            "distribution": "normal"},
                           {"name": "region", "kind": "categorical", "levels": ["N", "S", "E", "W"]}]}
    with pytest.warns(SchemaInferenceWarning):
        s = infer_schema(df, partial)
    assert "age" not in s.inferred_fields()
    assert s["age"].lower == 0 and s["age"].upper == 120
    assert s["region"].levels == ("N", "S", "E", "W")
    assert s.inferred_fields()["region"] == ("nullable",)


def test_schema_json_round_trip(tmp_path):
    s = quiet_infer(mixed_frame())
    text = s.to_json()
    json.loads(text)  # plain JSON
    assert Schema.from_json(text) == s
    path = tmp_path / "schema.json"
    s.save(path)
    assert Schema.load(path) == s
    assert Schema.from_dict(s.to_dict()).to_dict() == s.to_dict()


def test_encode_decode_round_trip():
    df = mixed_frame()
    s = quiet_infer(df)
    codes = s.encode(df)
    assert codes.dtype == np.float32 and codes.shape == df.shape
    assert np.all(np.isnan(codes) == df.isna().to_numpy())
    back = s.decode(codes)
    assert list(back.columns) == list(df.columns)
    assert dict(back.dtypes.astype(str)) == dict(df.dtypes.astype(str))
    for c in ("visits", "smoker", "region", "grade"):
        pd.testing.assert_series_equal(back[c], df[c], check_names=True)
    assert list(back.grade.cat.categories) == ["lo", "mid", "hi"] and back.grade.cat.ordered
    np.testing.assert_allclose(back.age, df.age, rtol=1e-5)
    np.testing.assert_allclose(back.income, df.income, rtol=1e-4, atol=1e-4)


def test_codes_in_documented_ranges():
    df = mixed_frame()
    s = quiet_infer(df)
    codes = s.encode(df)
    for j, c in enumerate(s.columns):
        v = codes[:, j][~np.isnan(codes[:, j])]
        if c.kind == "categorical":
            assert set(np.unique(v)) <= set(range(c.num_levels))
        elif c.kind == "boolean":
            assert set(np.unique(v)) <= {0.0, 1.0}
        elif c.distribution in ("poisson", "negbinomial"):
            assert v.min() >= 0 and v.max() <= c.upper - c.lower
        else:
            assert v.min() >= -1 - 1e-6 and v.max() <= 1 + 1e-6


def test_user_bounds_clip_values():
    df = pd.DataFrame({"x": [-5.0, 0.0, 5.0, 50.0]})
    s = Schema((ColumnSpec("x", "real", "float64", False, lower=0.0, upper=10.0, distribution="normal"),))
    back = s.decode(s.encode(df))
    np.testing.assert_allclose(back.x, [0.0, 0.0, 5.0, 10.0], atol=1e-5)


def test_boolean_with_missing_and_object_dtype():
    df = pd.DataFrame({"b": pd.Series([True, None, False, True], dtype=object)})
    s = quiet_infer(df)
    # the dtype comes from the kind, not from pandas' object column
    assert s["b"].kind == "boolean" and s["b"].nullable and s["b"].dtype == "bool"
    back = s.decode(s.encode(df))
    assert str(back.b.dtype) == "boolean"
    assert back.b.tolist()[0] is True and pd.isna(back.b.tolist()[1])


# --------------------------------------------------------------- bad input


@pytest.mark.parametrize("frame, words", [
    (pd.DataFrame({"a": [1.0, 2.0], "b": [np.nan, np.nan]}), ["'b'", "entirely missing"]),
    (pd.DataFrame({"id": [f"user{i}" for i in range(3000)]}), ["'id'", "3000 distinct", "max_levels"]),
    (pd.DataFrame({"x": pd.Series(["1.5", "2", "abc", "4", "5"], dtype="str")}), ["'x'", "non-numeric", "abc"]),
    (pd.DataFrame({"a": []}), ["no rows"]),
    (pd.DataFrame(), ["no columns"]),
    (pd.DataFrame({"t": pd.to_datetime(["2020-01-01", "2021-01-01"])}), ["'t'", "datetime"]),
])
def test_bad_input_clear_errors(frame, words):
    with pytest.raises(TwinInputError) as e:
        quiet_infer(frame)
    for w in words:
        assert w in str(e.value)
    assert isinstance(e.value, ValueError)


def test_explicit_schema_maps_values_outside_it():
    """A complete schema maps a value it cannot hold, record by record (the rules
    of ColumnSpec.encode); only a table whose columns are not the schema's is an error."""
    s = Schema((ColumnSpec("c", "categorical", "object", False, levels=("a", "b"), distribution="categorical"),))
    np.testing.assert_array_equal(s.encode(pd.DataFrame({"c": ["a", "zzz", "b"]}))[:, 0], [0, 0, 1])  # first level
    s = Schema((ColumnSpec("n", "count", "float64", False, lower=0, upper=9, distribution="poisson"),))
    np.testing.assert_array_equal(s.encode(pd.DataFrame({"n": [1.0, 2.5, 3.5, np.nan, np.inf]}))[:, 0],
                                  [1, 2, 4, 0, 9])  # halves to even; missing: lower
    s = Schema((ColumnSpec("r", "real", "object", False, lower=0, upper=9, distribution="normal"),))
    np.testing.assert_array_equal(s.encode(pd.DataFrame({"r": ["9", "x", "-inf"]}))[:, 0], [1, -1, -1])
    with pytest.raises(TwinInputError, match="do not match the schema"):
        s.encode(pd.DataFrame({"other": [1.0]}))


@pytest.mark.parametrize("d, match", [
    ({"name": "a", "kind": "integer"}, "kind"),
    ({"name": "a", "kind": "real", "lower": 3, "upper": 1}, "lower <= upper"),
    ({"name": "a", "kind": "real", "distribution": "poisson"}, "distribution"),
    ({"name": "a", "levels": ["x", "x"]}, "duplicate"),
    ({"name": "a", "colour": "red"}, "Unknown field"),
    ({"kind": "real"}, "name"),
])
def test_column_spec_validation(d, match):
    with pytest.raises(TwinInputError, match=match):
        ColumnSpec.from_dict(d)


def test_schema_json_errors(tmp_path):
    with pytest.raises(TwinInputError, match="not valid JSON"):
        Schema.from_json("{nope")
    with pytest.raises(TwinInputError, match="columns"):
        Schema.from_json('{"cols": []}')
    with pytest.raises(TwinInputError, match="not found"):
        Schema.load(tmp_path / "missing.json")
    with pytest.raises(TwinInputError, match="not in the data"):
        quiet_infer(pd.DataFrame({"a": [1.0]}), {"columns": [{"name": "b"}]})


# ------------------------------------------------------------------- model


def _small_dist(seed=0):
    df = mixed_frame(seed=seed)
    s = quiet_infer(df, {"columns": [{"name": "visits", "kind": "count", "distribution": "poisson"}]})
    model = MixtureModel(s, 3)
    L = model.layout
    rng = np.random.default_rng(seed)
    K = 3
    dirichlet = lambda shape: jnp.asarray(rng.dirichlet(np.ones(shape[-1]), size=shape[:-1]), jnp.float32)  # noqa: E731
    params = {
        "weights": dirichlet((K,)),
        "categorical": [dirichlet((K, n + int(nl))) for _, n, nl in L.categorical],
        "bernoulli": jnp.asarray(rng.uniform(0.1, 0.9, (K, len(L.bernoulli))), jnp.float32),
        "loc": jnp.asarray(rng.uniform(-0.5, 0.5, (K, len(L.normal))), jnp.float32),
        "scale": jnp.asarray(rng.uniform(0.1, 0.5, (K, len(L.normal))), jnp.float32),
        "rate": jnp.asarray(rng.uniform(0.5, 4, (K, len(L.poisson))), jnp.float32),
        "missing": jnp.asarray(rng.uniform(0.05, 0.3, (K, len(L.missing))), jnp.float32),
        "hurdle": jnp.asarray(rng.uniform(0.1, 0.7, (K, len(L.hurdle))), jnp.float32),
        "nb_mean": jnp.asarray(rng.uniform(2, 30, (K, len(L.negbin))), jnp.float32),
        "nb_concentration": jnp.asarray(rng.uniform(0.5, 5, (K, len(L.negbin))), jnp.float32),
    }
    assert L.poisson and L.hurdle and L.negbin
    return df, s, model, MixtureOfProducts(L, params), params


def test_mixture_log_prob_matches_brute_force():
    df, s, model, d, p = _small_dist()
    x = s.encode(df)[:20]
    layout = model.layout
    got = np.asarray(jax.jit(lambda p, x: MixtureOfProducts(layout, p).log_prob(x))(p, jnp.asarray(x)))
    L = model.layout
    want = []
    for row in x:
        comps = []
        for k in range(3):
            lp = math.log(p["weights"][k])
            for (j, n, nl), probs in zip(L.categorical, p["categorical"]):
                idx = n if np.isnan(row[j]) else int(row[j])
                lp += math.log(probs[k, idx])
            for i, j in enumerate(L.bernoulli):
                lp += stats.bernoulli.logpmf(row[j], p["bernoulli"][k, i])
            for i, j in enumerate(L.normal):  # Normal truncated to the code range [-1, 1]
                if np.isnan(row[j]):
                    continue
                loc, sc = float(p["loc"][k, i]), float(p["scale"][k, i])
                dens = stats.truncnorm.logpdf(row[j], (-1 - loc) / sc, (1 - loc) / sc, loc, sc)
                if i in L.hurdle:  # a point mass at the lower bound (code -1)
                    q = float(p["hurdle"][k, list(L.hurdle).index(i)])
                    dens = math.log(q) if row[j] == -1 else math.log1p(-q) + dens
                lp += dens
            for i, j in enumerate(L.poisson):
                lp += stats.poisson.logpmf(row[j], p["rate"][k, i])
            for i, j in enumerate(L.negbin):  # mean m, concentration r: scipy's nbinom(r, r / (r + m))
                m, r = float(p["nb_mean"][k, i]), float(p["nb_concentration"][k, i])
                lp += stats.nbinom.logpmf(row[j], r, r / (r + m))
            for i, j in enumerate(L.missing):
                q = float(p["missing"][k, i])
                lp += math.log(q) if np.isnan(row[j]) else math.log1p(-q)
            comps.append(lp)
        want.append(np.logaddexp.reduce(comps))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_mixture_gradients_finite_with_missing_values():
    df, s, model, d, p = _small_dist()
    x = jnp.asarray(s.encode(df))
    assert np.isnan(np.asarray(x)).any()
    layout = model.layout
    g = jax.jit(jax.grad(lambda p: MixtureOfProducts(layout, p).log_prob(x).sum()))(p)
    for leaf in jax.tree.leaves(g):
        assert np.all(np.isfinite(np.asarray(leaf)))


@pytest.mark.slow
def test_mixture_sample_frequencies():
    """Samples follow the mixture: chi-square on a categorical column and the missing
    indicator (accepts the true marginal, rejects a perturbed one)."""
    df, s, model, d, p = _small_dist(1)
    n = 40000
    layout = model.layout
    x = np.asarray(jax.jit(lambda p, k: MixtureOfProducts(layout, p).sample(k, (n,)))(p, jax.random.PRNGKey(3)))
    assert x.shape == (n, len(s))
    w = np.asarray(p["weights"])
    (j, lev, nl), probs = model.layout.categorical[0], np.asarray(p["categorical"][0])
    expected = (w @ probs).astype(np.float64)  # marginal over levels (+ missing)
    expected /= expected.sum()
    idx = np.where(np.isnan(x[:, j]), lev, x[:, j]).astype(int)
    counts = np.bincount(idx, minlength=len(expected))
    assert stats.chisquare(counts, expected * n).pvalue > 1e-3
    wrong = expected.copy()
    wrong[0] *= 1.1
    wrong /= wrong.sum()
    assert stats.chisquare(counts, wrong * n).pvalue < 1e-6
    # the Poisson column: mean of the mixture (truncated at the range)
    jp = model.layout.poisson[0]
    R = model.layout.poisson_range[0]
    pm = sum(w[k] * (np.arange(R + 1) * np.r_[stats.poisson.pmf(np.arange(R), p["rate"][k, 0]),
                                              stats.poisson.sf(R - 1, p["rate"][k, 0])]).sum() for k in range(3))
    assert abs(x[:, jp].mean() - pm) < 5 * x[:, jp].std() / math.sqrt(n)
    # missingness of the first nullable numeric column
    jm = model.layout.missing[0]
    pmiss = float(w @ np.asarray(p["missing"])[:, 0])
    assert abs(np.isnan(x[:, jm]).mean() - pmiss) < 5 * math.sqrt(pmiss * (1 - pmiss) / n)
    # non-nullable columns never missing
    for jj, c in enumerate(s.columns):
        if not c.nullable:
            assert not np.isnan(x[:, jj]).any()


# ----------------------------------------------------------------- metrics


def test_tv_distance_extremes_and_hand_value():
    a = pd.DataFrame({"c": ["x", "x", "y", "y"], "v": [0.0, 0.0, 1.0, 1.0]})
    assert twin.marginal_tv_distances(a, a) == {"c": 0.0, "v": 0.0}
    b = pd.DataFrame({"c": ["z", "z", "z", "z"], "v": [0.0, 0.0, 0.0, 0.0]})
    tv = twin.marginal_tv_distances(a, b)
    assert tv["c"] == 1.0 and tv["v"] == pytest.approx(0.5)
    c = pd.DataFrame({"c": ["x", "x", "x", None], "v": [0.0, 1.0, np.nan, 1.0]})
    tv = twin.marginal_tv_distances(a, c, bins=2)
    # c: real {x: .5, y: .5}, syn {x: .75, missing: .25} -> 0.5 * (.25 + .5 + .25)
    assert tv["c"] == pytest.approx(0.5)
    # v: real {bin0: .5, bin1: .5}, syn {bin0: .25, bin1: .5, missing: .25}
    assert tv["v"] == pytest.approx(0.25)


def test_correlation_difference():
    rng = np.random.default_rng(0)
    x = rng.normal(size=2000)
    real = pd.DataFrame({"a": x, "b": x + 0.1 * rng.normal(size=2000)})
    assert twin.correlation_difference(real, real).mean_abs == pytest.approx(0.0, abs=1e-12)
    indep = pd.DataFrame({"a": rng.normal(size=2000), "b": rng.normal(size=2000)})
    cd = twin.correlation_difference(real, indep)
    assert cd.mean_abs == pytest.approx(np.corrcoef(real.a, real.b)[0, 1], abs=0.05)
    # categoricals are one-hot encoded
    cat = pd.DataFrame({"a": x, "g": np.where(x > 0, "p", "n")})
    cd = twin.correlation_difference(cat, cat)
    assert list(cd.real.columns) == ["a", "g=n", "g=p"] and cd.mean_abs == 0.0


def test_train_on_synthetic_accuracy():
    rng = np.random.default_rng(0)
    n = 400
    x = rng.normal(size=n)
    real = pd.DataFrame({"x": x, "noise": rng.normal(size=n), "y": np.where(x > 0, "pos", "neg")})
    res = twin.train_on_synthetic_accuracy(real, real, "y")
    assert res["train_on_synthetic"] > 0.95 and res["train_on_real"] > 0.95
    flipped = real.assign(y=np.where(x > 0, "neg", "pos"))
    res = twin.train_on_synthetic_accuracy(real, flipped, "y")
    assert res["train_on_synthetic"] < 0.1
    with pytest.raises(ValueError, match="target"):
        twin.train_on_synthetic_accuracy(real, real, "nope")
    with pytest.raises(ValueError, match="continuous"):
        twin.train_on_synthetic_accuracy(real, real, "x")


def test_train_on_synthetic_needs_sklearn(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *a, **k):
        if name == "sklearn" or name.startswith("sklearn."):
            raise ImportError("no sklearn")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    df = pd.DataFrame({"x": [0.0, 1.0], "y": ["a", "b"]})
    with pytest.raises(ImportError, match="pip install scikit-learn"):
        twin.train_on_synthetic_accuracy(df, df, "y")


def test_uniform_baseline_has_schema_and_is_worse_than_real():
    df = mixed_frame(500)
    s = quiet_infer(df)
    base = twin.uniform_baseline(s, 500)
    assert dict(base.dtypes.astype(str)) == dict(df.dtypes.astype(str))
    m = twin.utility_metrics(df, base, schema=s)
    assert m["mean_marginal_tv"] == pytest.approx(m["baseline"]["mean_marginal_tv"], abs=0.08)
    other = mixed_frame(500, seed=1)  # a fresh sample of the same distribution
    m2 = twin.utility_metrics(df, other, schema=s)
    assert m2["mean_marginal_tv"] < 0.5 * m2["baseline"]["mean_marginal_tv"]
    json.dumps(m2, allow_nan=False)


@pytest.mark.parametrize("support", ["simplex", "unit_interval", "positive", "real"])
def test_numpy_transforms_match_numpyro(support):
    from numpyro.distributions import biject_to, constraints

    from d3p.twin.model import _np_constrain

    c = getattr(constraints, support)
    x = np.random.default_rng(0).normal(size=(6, 5)) * 3
    want = np.asarray(biject_to(c)(jnp.asarray(x, jnp.float32)))
    np.testing.assert_allclose(_np_constrain(x, c), want, rtol=2e-5, atol=1e-6)


@pytest.mark.slow
def test_numpy_sampler_matches_jax_sampler():
    """The NumPy generator (used by TwinResult.generate) and MixtureOfProducts.sample
    draw from the same distribution (two-sample tests on every column)."""
    from d3p.twin.model import mixture_sample_numpy

    df, s, model, d, p = _small_dist(2)
    n = 20000
    layout = model.layout
    xj = np.asarray(jax.jit(lambda p, k: MixtureOfProducts(layout, p).sample(k, (n,)))(p, jax.random.PRNGKey(0)))
    sites = {"weights": np.asarray(p["weights"])[None],
             "bernoulli": np.asarray(p["bernoulli"])[None], "loc": np.asarray(p["loc"])[None],
             "scale": np.asarray(p["scale"])[None], "missing": np.asarray(p["missing"])[None],
             "log_rate": np.log(np.asarray(p["rate"]) / model.poisson_scale)[None],
             "hurdle": np.asarray(p["hurdle"])[None],
             "nb_log_mean": np.log(np.asarray(p["nb_mean"]) / model.negbin_scale)[None],
             "nb_log_concentration": np.log(np.asarray(p["nb_concentration"]))[None]}
    for (j, _, _), probs in zip(layout.categorical, p["categorical"]):
        sites[f"probs_{j}"] = np.asarray(probs)[None]
    xn = mixture_sample_numpy(model, sites, n, np.random.default_rng(0))[0]
    for j, c in enumerate(s.columns):
        a, b = xj[:, j], xn[:, j]
        assert abs(np.isnan(a).mean() - np.isnan(b).mean()) < 0.02, c.name
        a, b = a[~np.isnan(a)], b[~np.isnan(b)]
        if c.distribution == "hurdle":  # the point mass, then the rest
            assert abs(np.mean(a == -1) - np.mean(b == -1)) < 0.02, c.name
            a, b = a[a > -1], b[b > -1]
        if c.kind in ("categorical", "boolean") or c.distribution in ("poisson", "negbinomial"):
            cells = np.union1d(a, b)
            table = np.array([[np.sum(a == v) for v in cells], [np.sum(b == v) for v in cells]])
            assert stats.chi2_contingency(table).pvalue > 1e-4, c.name
        else:
            assert stats.ks_2samp(a, b).pvalue > 1e-4, c.name


def test_truncated_normal_sampler():
    """Numeric codes are drawn from the component's Normal truncated to [-1, 1]:
    a KS test accepts scipy's truncnorm and rejects the untruncated, clipped Normal."""
    from d3p.twin.model import _truncated_normal_icdf

    loc, scale = 0.7, 0.5
    u = np.random.default_rng(0).random(20000)
    x = _truncated_normal_icdf(u, loc, scale, np)
    assert x.min() >= -1 and x.max() <= 1
    a, b = (-1 - loc) / scale, (1 - loc) / scale
    assert stats.kstest(x, stats.truncnorm(a, b, loc, scale).cdf).pvalue > 1e-3
    clipped = lambda t: np.where(t >= 1, 1.0, stats.norm(loc, scale).cdf(t))  # noqa: E731
    assert stats.kstest(x, clipped).pvalue < 1e-6


# ------------------------------------- argument checks, one message format


@pytest.mark.parametrize("d, message", [
    ({"name": "a", "kind": "real", "lower": "x"}, "Column 'a': Expected lower to be a finite number, got lower='x'."),
    ({"name": "a", "kind": "real", "upper": math.inf}, "Column 'a': Expected upper to be a finite number, got upper=inf."),
    ({"name": "a", "kind": "real", "lower": True}, "Column 'a': Expected lower to be a finite number, got lower=True."),
    ({"name": "a", "nullable": 1}, "Column 'a': Expected nullable to be True or False, got nullable=1."),
    ({"name": "a", "ordered": "yes"}, "Column 'a': Expected ordered to be True or False, got ordered='yes'."),
])
def test_column_field_messages(d, message):
    with pytest.raises(TwinInputError) as e:
        ColumnSpec.from_dict(d)
    assert str(e.value) == message


def test_column_bounds_become_floats():
    c = ColumnSpec("a", "real", lower=np.int64(2), upper=np.float32(3.5))
    assert (c.lower, c.upper) == (2.0, 3.5) and type(c.lower) is float and type(c.upper) is float


def test_infer_schema_argument_messages():
    from d3p._validate import InvalidArgumentType

    df = mixed_frame(20)
    with pytest.raises(ValueError, match=r"^Expected max_levels to be an integer >= 1, got max_levels=0\.$"):
        infer_schema(df, max_levels=0)
    with pytest.raises(InvalidArgumentType, match="max_levels"):
        infer_schema(df, max_levels=True)
    with pytest.raises(InvalidArgumentType, match=r"^Expected data to be a pandas DataFrame, got data of type dict\.$"):
        infer_schema({"a": [1.0]})


def test_metrics_argument_messages():
    from d3p._validate import InvalidArgumentType

    df = mixed_frame(40)
    s = quiet_infer(df)
    with pytest.raises(ValueError, match=r"^Expected bins to be an integer >= 1, got bins=0\.$"):
        twin.marginal_tv_distances(df, df, bins=0)
    with pytest.raises(ValueError, match=r"^Expected num_records to be an integer >= 1, got num_records=0\.$"):
        twin.uniform_baseline(s, 0)
    with pytest.raises(InvalidArgumentType, match="num_records"):
        twin.uniform_baseline(s, True)
    with pytest.raises(InvalidArgumentType, match=r"^Expected synthetic to be a pandas DataFrame"):
        twin.correlation_difference(df, df.to_numpy())
    pytest.importorskip("sklearn")
    with pytest.raises(ValueError, match=r"^Expected cv to be an integer >= 2, got cv=1\.$"):
        twin.train_on_synthetic_accuracy(df, df, "region", cv=1)
    with pytest.raises(ValueError, match=r"^Expected classifier to be one of 'logistic', 'random_forest', "
                                         r"got classifier='svm'\.$"):
        twin.train_on_synthetic_accuracy(df, df, "region", classifier="svm")


def test_model_argument_messages():
    from d3p._validate import InvalidArgumentType
    from d3p.twin.model import MixtureGuide

    s = quiet_infer(mixed_frame(40))
    with pytest.raises(ValueError, match=r"^Expected num_components to be an integer >= 1, got num_components=0\.$"):
        MixtureModel(s, 0)
    with pytest.raises(InvalidArgumentType, match="num_components"):
        MixtureModel(s, 2.0)
    with pytest.raises(InvalidArgumentType, match=r"^Expected schema to be a d3p.twin.Schema, got schema of type dict"):
        MixtureModel(s.to_dict(), 2)
    with pytest.raises(ValueError, match=r"^Expected init_scale to be a finite number > 0, got init_scale=0\.$"):
        MixtureGuide(MixtureModel(s, 2), init_scale=0)
    with pytest.raises(InvalidArgumentType, match=r"^Expected model to be a MixtureModel, got model of type"):
        MixtureGuide(lambda x: x)


def test_numpy_expit_is_clipped_and_quiet():
    """The NumPy logistic function never reaches 0 or 1 (as numpyro's float32
    transform) and raises no overflow warning for large inputs."""
    from d3p.twin.model import _np_expit

    f32 = np.finfo(np.float32)
    x = np.asarray([-1e4, -50.0, -1.0, 0.0, 1.0, 50.0, 1e4])
    with warnings.catch_warnings(), np.errstate(all="raise"):
        warnings.simplefilter("error")
        y = _np_expit(x)
    np.testing.assert_allclose(y[2:5], 1.0 / (1.0 + np.exp(-x[2:5])), rtol=1e-15)
    assert y[0] == f32.tiny and y[-1] == 1.0 - f32.eps and y[-2] == 1.0 - f32.eps
    assert np.all((y > 0) & (y < 1))


def test_numeric_columns_are_read_by_their_values_and_keep_their_type():
    """0/1 floats are boolean and come back as 0.0/1.0; few distinct numbers are ordered
    levels (float or int as in the table); many integers a count of the column's type."""
    rng = np.random.default_rng(0)
    n = 120
    df = pd.DataFrame({
        "flag": rng.choice([0.0, 1.0], n), "flag_int": rng.choice([0, 1], n),
        "scale": rng.choice([1.0, 2.0, 3.0, 4.5], n), "coded": rng.choice([3, 7, 9], n),
        "amount": rng.integers(0, 400, n).astype(float), "x": rng.normal(size=n)})
    s = quiet_infer(df)
    assert [s[c].kind for c in df.columns] == ["boolean", "boolean", "categorical", "categorical", "count", "real"]
    assert [s[c].dtype for c in df.columns] == ["float64", "int64", "float64", "int64", "float64", "float64"]
    assert s["scale"].ordered and s["scale"].levels == (1.0, 2.0, 3.0, 4.5)
    assert all("kind" in s[c].inferred for c in df.columns)
    back = s.decode(s.encode(df))
    assert list(back.dtypes.astype(str)) == ["float64", "int64", "float64", "int64", "float64", "float64"]
    assert set(back["flag"]) <= {0.0, 1.0} and set(back["coded"]) <= {3, 7, 9}
    pd.testing.assert_series_equal(back["scale"], df["scale"])


def test_a_point_mass_at_the_minimum_is_a_hurdle_decoded_exactly():
    x = np.r_[np.zeros(30), np.linspace(0.5, 80.0, 70)]
    s = quiet_infer(pd.DataFrame({"spend": x}))
    assert s["spend"].distribution == "hurdle" and "distribution" in s["spend"].inferred
    codes = s.encode(pd.DataFrame({"spend": x}))
    assert np.all(codes[:30, 0] == -1.0)
    assert np.all(s.decode(codes)["spend"].to_numpy()[:30] == 0.0)  # exactly the bound, not 1e-18
