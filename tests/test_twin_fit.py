"""Tests of d3p.twin.fit: the fit is DP-VI with the reported sigma, nothing else reads
the private values, generation keeps the schema, save/load, reports.

One real DP-VI fit (module fixture, small data, few steps) is shared; tests of the
wiring replace DPSVI.run by a stub that ignores the data.
"""

import json
import math
import os
import types
import warnings

import jax.numpy as jnp
import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import pandas as pd
import pytest

import d3p.random
import d3p._private_step
import d3p.svi
import d3p.twin as twin
from d3p import accounting, dputil, minibatch
from d3p.twin import ColumnSpec, Schema, SchemaInferenceWarning, TwinInputError

from _stub_run import stub_result


def small_frame(n=150, seed=0):
    rng = np.random.default_rng(seed)
    age = rng.normal(50, 10, n)
    age[rng.uniform(size=n) < 0.15] = np.nan
    region = rng.choice(["N", "S", "E"], n).astype(object)
    region[rng.uniform(size=n) < 0.1] = None
    smoker = rng.uniform(size=n) < 0.3
    return pd.DataFrame({
        "age": age,
        "visits": rng.poisson(2, n),
        "smoker": smoker,
        "region": pd.Series(region, dtype="str"),
        "grade": pd.Categorical(np.where(smoker, "hi", "lo"), categories=["lo", "hi"]),
    })


def explicit_schema():
    return Schema((
        ColumnSpec("age", "real", "float64", True, lower=0.0, upper=100.0, distribution="normal"),
        ColumnSpec("visits", "count", "int64", False, lower=0, upper=20, distribution="poisson"),
        ColumnSpec("smoker", "boolean", "bool", False, distribution="bernoulli"),
        ColumnSpec("region", "categorical", "str", True, levels=("N", "S", "E", "W"), distribution="categorical"),
        ColumnSpec("grade", "categorical", "category", False, levels=("lo", "hi"), distribution="categorical"),
    ))


EPS = 2.0
STEPS = 30


@pytest.fixture(scope="module")
def fitted():
    """One real fit, with spies on the noise and on DPSVI.run."""
    df = small_frame()
    noise_calls, run_calls, sigma_calls, threshold_calls = [], [], [], []
    real_noise = d3p._private_step.add_gaussian_noise
    real_run = d3p.svi.DPSVI.run
    real_sigma = d3p._private_step.sigma_value
    real_threshold = d3p._private_step.threshold_value

    def concrete(x):
        return None if isinstance(x, jax.core.Tracer) else float(x)

    def noise_spy(grad_sum, noise_key, dp_scale, clipping_threshold, rng_suite=d3p.random):
        # σ and C are arguments of run's compiled steps (traced: their values are what
        # sigma_spy and threshold_spy see)
        noise_calls.append((concrete(dp_scale), concrete(clipping_threshold), rng_suite))
        return real_noise(grad_sum, noise_key, dp_scale, clipping_threshold, rng_suite)

    def sigma_spy(sigma, params):
        sigma_calls.append(float(sigma))
        return real_sigma(sigma, params)

    def threshold_spy(C, params):
        threshold_calls.append(float(C))
        return real_threshold(C, params)

    def run_spy(self, rng_key, num_steps, *args, **kwargs):
        run_calls.append(types.SimpleNamespace(svi=self, num_steps=num_steps, args=args, kwargs=kwargs))
        return real_run(self, rng_key, num_steps, *args, **kwargs)

    mp = pytest.MonkeyPatch()
    mp.setattr(d3p._private_step, "add_gaussian_noise", noise_spy)
    mp.setattr(d3p._private_step, "sigma_value", sigma_spy)
    mp.setattr(d3p._private_step, "threshold_value", threshold_spy)
    mp.setattr(d3p.svi.DPSVI, "run", run_spy)
    try:
        with pytest.warns(SchemaInferenceWarning):
            tw = twin.fit(df, EPS, rng_key=d3p.random.PRNGKey(1), num_components=2, num_steps=STEPS,
                          q=0.2, progress_bar=False, schema_inference="data")
    finally:
        mp.undo()
    return types.SimpleNamespace(df=df, twin=tw, noise_calls=noise_calls, run_calls=run_calls,
                                 sigma_calls=sigma_calls, threshold_calls=threshold_calls)


@pytest.mark.slow
def test_fit_is_dpsvi_with_reported_sigma(fitted):
    tw, p = fitted.twin, fitted.twin.privacy
    N = len(fitted.df)
    assert p["relation"] == "add_remove" and p["sampling"] == "poisson" and p["private"]
    assert p["num_steps"] == STEPS and p["q"] == 0.2
    # sigma is the calibration for exactly this (eps, delta, q, T) and relation
    delta_run = 1.0 / N**2 - p["delta_poisson_overflow"]
    sigma = dputil.approximate_sigma_remove_relation(EPS, delta_run, 0.2, STEPS)[0]
    assert p["sigma"] == sigma > 0
    assert p["delta"] <= 1.0 / N**2 * (1 + 1e-12)
    assert 0.9 * EPS < p["epsilon"] <= EPS
    assert p["epsilon"] == pytest.approx(
        accounting.compute_epsilon(sigma, 0.2, STEPS, delta_run, relation="add_remove"), rel=1e-9)
    # the noise was drawn with that sigma and C, from the secure suite
    assert fitted.noise_calls, "add_gaussian_noise was never called"
    for dp_scale, C, suite in fitted.noise_calls:
        assert dp_scale in (None, p["sigma"]) and C in (None, p["clipping_threshold"]) and suite is d3p.random
    if any(dp_scale is None for dp_scale, _, _ in fitted.noise_calls):   # traced: the compiled steps' argument
        assert fitted.sigma_calls and all(s == p["sigma"] for s in fitted.sigma_calls)
    if any(C is None for _, C, _ in fitted.noise_calls):
        assert fitted.threshold_calls and all(C == p["clipping_threshold"] for C in fitted.threshold_calls)
    # one DPSVI.run on the encoded data with the matching sampler, from a public init state
    (call,) = fitted.run_calls
    assert call.svi.dp_scale == p["sigma"] and call.svi.clipping_threshold == p["clipping_threshold"]
    assert call.num_steps == STEPS
    assert call.kwargs["sampling"] == "poisson" and call.kwargs["q"] == 0.2
    assert call.kwargs["init_state"] is not None
    (data,) = call.args
    np.testing.assert_array_equal(np.asarray(data), tw.schema.encode(fitted.df))
    assert tw.losses.shape == (STEPS,)


@pytest.mark.slow
def test_generate_keeps_schema(fitted):
    df, tw = fitted.df, fitted.twin
    syn = tw.generate(400, 0)
    assert list(syn.columns) == list(df.columns) and len(syn) == 400
    assert dict(syn.dtypes.astype(str)) == dict(df.dtypes.astype(str))
    assert list(syn.grade.cat.categories) == ["lo", "hi"]
    assert set(syn.region.dropna()) <= {"N", "S", "E"}
    assert syn.visits.min() >= df.visits.min() and syn.visits.max() <= df.visits.max()
    assert syn.age.dropna().between(np.nanmin(df.age), np.nanmax(df.age)).all()
    # missing values where (and only where) the input has them
    for c in df.columns:
        if df[c].isna().any():
            assert syn[c].isna().any(), c
        else:
            assert not syn[c].isna().any(), c
    # same key, same table; other key, other table
    pd.testing.assert_frame_equal(syn, tw.generate(400, 0))
    assert not syn.equals(tw.generate(400, 1))
    # jax and d3p keys work too
    tw.generate(5, d3p.random.PRNGKey(3))


@pytest.mark.slow
def test_save_load_round_trip(fitted, tmp_path):
    tw = fitted.twin
    path = tw.save(tmp_path / "twin")
    assert sorted(os.listdir(path)) == ["params.npz", "twin.json"]
    with pytest.raises(FileExistsError):
        tw.save(tmp_path / "twin")
    loaded = twin.load(path)
    for key in (0, 7):
        pd.testing.assert_frame_equal(tw.generate(300, key), loaded.generate(300, key))
    assert loaded.schema == tw.schema and loaded.privacy == tw.privacy
    assert loaded.losses is None  # not private, never saved
    desc = json.loads((tmp_path / "twin" / "twin.json").read_text())
    assert desc["privacy"]["sigma"] == tw.privacy["sigma"]
    assert desc["privacy"]["not_covered"]["age"]  # what was read from the data is recorded
    assert "losses" not in json.dumps(desc)
    with np.load(tmp_path / "twin" / "params.npz") as z:
        assert set(z.files) == set(tw.params)
        n_values = sum(z[k].size for k in z.files)
    assert n_values < fitted.df.size  # parameters only, no copy of the records


@pytest.mark.slow
def test_report_files(fitted, tmp_path):
    df, tw = fitted.df, fitted.twin
    syn = tw.generate(len(df), 0)
    report = twin.write_report(df, syn, tmp_path / "report", twin=tw, target="smoker")
    files = sorted(os.listdir(tmp_path / "report"))
    pngs = [f for f in files if f.endswith(".png")]
    assert len(pngs) == len(df.columns) + 1 and "correlation_difference.png" in pngs
    for f in pngs:
        with open(tmp_path / "report" / f, "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    text = (tmp_path / "report" / "report.json").read_text()
    parsed = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert parsed == report
    m = parsed["metrics"]
    assert set(m["marginal_tv"]) == set(df.columns)
    assert all(0 <= v <= 1 for v in m["marginal_tv"].values())
    assert 0 <= m["correlation_mean_abs_difference"] <= 2
    assert m["baseline"]["mean_marginal_tv"] > 0
    assert {"train_on_synthetic", "train_on_real", "majority"} <= set(m["classification"])
    assert parsed["privacy"]["sigma"] == tw.privacy["sigma"]
    assert "REAL data" in parsed["note"]
    assert sorted(parsed["files"]) == files
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".")]  # no temporary leftovers


# ------------------------------------------------- wiring, with a stub run


@pytest.fixture
def stub_run(monkeypatch):
    """Replace DPSVI.run by a stub that ignores the data and returns the initial parameters."""
    calls = []

    def fake_run(self, rng_key, num_steps, *args, q=None, batch_size=None, sampling="fixed",
                 target_delta=None, accountant="fourier", init_state=None, **kwargs):
        res = stub_result(self, init_state, jnp.zeros(num_steps), args[0].shape[0], num_steps, q=q,
                          batch_size=batch_size, sampling=sampling, target_delta=target_delta)
        calls.append(types.SimpleNamespace(svi=self, args=args, sampling=sampling, q=q,
                                           batch_size=batch_size, init_state=init_state))
        return res

    monkeypatch.setattr(d3p.svi.DPSVI, "run", fake_run)
    return calls


def test_only_dpsvi_reads_the_private_values(stub_run, tmp_path):
    """With an explicit schema, two different data sets of the same size give identical
    twins when DPSVI.run ignores its data: no other path reads the private values."""
    schema = explicit_schema()
    a, b = small_frame(seed=1), small_frame(seed=2)
    assert not a.equals(b)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SchemaInferenceWarning)  # nothing read from the data
        ta = twin.fit(a, 1.0, rng_key=d3p.random.PRNGKey(5), schema=schema, num_steps=10, progress_bar=False)
        tb = twin.fit(b, 1.0, rng_key=d3p.random.PRNGKey(5), schema=schema, num_steps=10, progress_bar=False)
    assert ta.privacy["not_covered"] == {}
    for t, frame, call in ((ta, a, stub_run[0]), (tb, b, stub_run[1])):
        np.testing.assert_array_equal(np.asarray(call.args[0]), schema.encode(frame))
    da, db = ta.description(), tb.description()
    da["fit"].pop("seconds"), db["fit"].pop("seconds")
    assert da == db
    for k in ta.params:
        np.testing.assert_array_equal(ta.params[k], tb.params[k])
    pd.testing.assert_frame_equal(ta.generate(50, 0), tb.generate(50, 0))


@pytest.mark.parametrize("sampling", ["poisson", "fixed"])
def test_sampler_and_accountant_match(stub_run, monkeypatch, sampling):
    dp_accounting = pytest.importorskip("dp_accounting")
    from dp_accounting.pld import pld_privacy_accountant

    seen = []
    real = dputil.calibrate_sigma
    monkeypatch.setattr(dputil, "calibrate_sigma", lambda *a, **k: (seen.append((a, k)), real(*a, **k))[1])
    df = small_frame()
    tw = twin.fit(df, 1.5, 1e-5, rng_key=7, schema=explicit_schema(), num_steps=20, q=0.1,
                  sampling=sampling, progress_bar=False)
    ((eps, delta, q, T), kw), = seen
    call = stub_run[0]
    sigma = call.svi.dp_scale
    if sampling == "poisson":
        assert (kw["sampler"], kw["relation"]) == ("poisson", "add_remove") and call.sampling == "poisson"
        assert tw.privacy["relation"] == "add_remove" and q == 0.1 == call.q
        event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
    else:
        B = minibatch.q_to_batch_size(0.1, len(df))
        assert (kw["sampler"], kw["relation"]) == ("fixed_size", "substitute") and call.sampling == "fixed"
        assert call.batch_size == B
        assert tw.privacy["relation"] == "substitute" and q == B / len(df)
        # fixed-size batches: the add/remove pair at σ/2 (dp-accounting, called directly)
        event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma / 2))
    ref = pld_privacy_accountant.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    ref.compose(event, T)
    assert ref.get_epsilon(delta) <= 1.5 * (1 + 1e-3)
    assert (eps, T) == (1.5, 20) and delta <= 1e-5
    assert sigma == tw.privacy["sigma"] > 0
    assert tw.privacy["epsilon"] <= 1.5


def test_epsilon_inf_is_sigma_zero_same_clipping(stub_run):
    tw = twin.fit(small_frame(), math.inf, rng_key=0, schema=explicit_schema(), num_steps=5,
                  clipping_threshold=3.0, progress_bar=False)
    assert stub_run[0].svi.dp_scale == 0.0 and stub_run[0].svi.clipping_threshold == 3.0
    assert tw.privacy["sigma"] == 0.0 and not tw.privacy["private"] and tw.privacy["epsilon"] == math.inf


@pytest.mark.parametrize("kwargs, match", [
    ({"epsilon": 0.0}, "epsilon"),
    ({"epsilon": -1.0}, "epsilon"),
    ({"epsilon": float("nan")}, "epsilon"),
    ({"rng_key": None}, "rng_key"),
    ({"delta": 1.5}, "delta"),
    ({"q": 0.0}, "q"),
    ({"num_steps": 0}, "num_steps"),
    ({"sampling": "replacement"}, "sampling"),
    ({"clipping_threshold": -1.0}, "clipping_threshold"),
    ({"q": 1.0, "sampling": "poisson"}, "small enough for Poisson"),
])
def test_fit_argument_errors(kwargs, match):
    args = {"epsilon": 1.0, "rng_key": 0, "schema": explicit_schema(), "num_steps": 5, "progress_bar": False}
    args.update(kwargs)
    df = args.pop("data", small_frame())
    with pytest.raises(ValueError, match=match):
        twin.fit(df, **args)


# ----------------------------------------------------- user-supplied model


def user_model(x=None, *, N, num_records=None):
    mu = numpyro.sample("mu", dist.Normal(jnp.zeros(2), 1.0).to_event(1))
    if x is None:
        with numpyro.plate("data", num_records):
            return numpyro.sample("x", dist.Normal(mu, 0.3).to_event(1))
    with numpyro.plate("data", N, subsample_size=x.shape[0]):
        return numpyro.sample("x", dist.Normal(mu, 0.3).to_event(1), obs=x)


def user_guide(x=None, *, N, num_records=None):
    loc = numpyro.param("mu_loc", jnp.zeros(2))
    numpyro.sample("mu", dist.Normal(loc, 0.1).to_event(1))


def _user_frame(seed, n):
    """``n`` records of two uniform columns, a in [0, 10] and b in [-1, 1], and their schema."""
    rng = np.random.default_rng(seed)
    df = pd.DataFrame({"a": rng.uniform(0, 10, n), "b": rng.uniform(-1, 1, n)})
    schema = Schema((ColumnSpec("a", "real", "float64", False, lower=0, upper=10, distribution="normal"),
                     ColumnSpec("b", "real", "float64", False, lower=-1, upper=1, distribution="normal")))
    return df, schema


@pytest.mark.slow
def test_user_model_fit_save_load(tmp_path):
    df, schema = _user_frame(seed=0, n=120)
    tw = twin.fit(df, 1.0, rng_key=3, schema=schema, model=user_model, guide=user_guide, num_steps=20,
                  q=0.2, progress_bar=False)
    assert tw.model_spec == {"type": "custom", "name": "user_model"}
    syn = tw.generate(50, 0)
    assert list(syn.columns) == ["a", "b"] and syn.a.between(0, 10).all()
    tw.save(tmp_path / "t")
    with pytest.raises(TwinInputError, match="user-supplied model"):
        twin.load(tmp_path / "t")
    loaded = twin.load(tmp_path / "t", model=user_model, guide=user_guide)
    pd.testing.assert_frame_equal(loaded.generate(50, 0), syn)


@pytest.mark.slow
def test_user_model_default_autoguide(tmp_path):
    """A user model without a guide gets AutoDiagonalNormal; save/load reproduces its samples."""
    df, schema = _user_frame(seed=1, n=100)
    tw = twin.fit(df, 1.0, rng_key=4, schema=schema, model=user_model, num_steps=20, q=0.2, progress_bar=False)
    assert tw.guide_spec == {"type": "AutoDiagonalNormal"} and set(tw.params) == {"auto_loc", "auto_scale"}
    tw.save(tmp_path / "t")
    loaded = twin.load(tmp_path / "t", model=user_model)
    pd.testing.assert_frame_equal(loaded.generate(40, 1), tw.generate(40, 1))


# ------------------------------------------- guide preconditioning, schedule


@pytest.mark.slow
def test_guide_gains_scale_only_the_optimiser_coordinates():
    """The optimiser sees value / gain (so the gradient times the gain); the
    parameters, and what is saved and sampled from, are the values themselves."""
    import jax
    from numpyro import handlers
    from numpyro.infer.util import transform_fn

    from d3p.twin.model import MixtureGuide, MixtureModel

    schema = explicit_schema()
    model = MixtureModel(schema, 2)
    x0 = jnp.asarray(schema.placeholder_codes(1))
    for cg, dg in ((1.0, 1.0), (0.5, 4.0)):
        guide = MixtureGuide(model, continuous_gain=cg, discrete_gain=dg)
        with handlers.seed(rng_seed=0):
            tr = handlers.trace(guide).get_trace(x0, N=40)
        sites = {k: s for k, s in tr.items() if s["type"] == "param"}
        transforms = {k: dist.biject_to(s["kwargs"]["constraint"]) for k, s in sites.items()}
        values = {k: s["value"] for k, s in sites.items()}
        unconstrained = {k: transforms[k].inv(v) for k, v in values.items()}
        # the constrained values are the parameters (init: locations in (-1, 1),
        # normal scales at 0.5, discrete sites close to uniform, posterior scales 0.1)
        back = transform_fn(transforms, unconstrained)
        for k in values:
            np.testing.assert_allclose(back[k], values[k], rtol=1e-6, atol=1e-7)
        assert np.all(np.abs(values["loc_loc"]) < 1) and np.ptp(values["loc_loc"]) > 0  # symmetry broken
        np.testing.assert_allclose(values["scale_loc"], np.log(0.5), rtol=1e-6)
        assert np.all(np.abs(values["weights_loc"]) <= 0.1) and np.all(np.abs(values["probs_3_loc"]) <= 0.1)
        np.testing.assert_allclose(values["loc_scale"], 0.1, rtol=1e-6)
        for k, s in sites.items():
            gain = cg if k.split("_")[0] in ("loc", "scale", "log") else dg
            assert s["kwargs"]["constraint"].gain == gain, k
            natural = values[k] if k.endswith("_loc") else np.log(values[k])
            np.testing.assert_allclose(unconstrained[k], natural / gain, rtol=1e-5, atol=1e-6)

        # the gradient the optimiser sees: d f(value) / du = gain * f'(value) for a location,
        # gain * value * f'(value) for a posterior scale (value = exp(gain * u))
        grads = jax.grad(lambda u: sum(jnp.sum(jnp.sin(v)) for v in transform_fn(transforms, u).values()))(
            unconstrained)
        for k, g in grads.items():
            gain = sites[k]["kwargs"]["constraint"].gain
            v = values[k]
            expected = gain * jnp.cos(v) * (1.0 if k.endswith("_loc") else v)
            np.testing.assert_allclose(g, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["continuous_gain", "discrete_gain"])
@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), True])
def test_guide_gain_errors(name, value):
    from d3p.twin.model import MixtureGuide, MixtureModel

    with pytest.raises(ValueError, match=name):
        MixtureGuide(MixtureModel(explicit_schema(), 2), **{name: value})


def test_cosine_decay_schedule():
    from d3p.twin.inference import cosine_decay

    s = cosine_decay(0.2, 100, 0.05)
    values = np.asarray([float(s(i)) for i in range(0, 151)])
    assert values[0] == pytest.approx(0.2) and values[50] == pytest.approx(0.2 * (0.05 + 0.95 * 0.5))
    np.testing.assert_allclose(values[100:], 0.2 * 0.05, rtol=1e-6)
    assert np.all(np.diff(values[:101]) < 0)
    for args, match in (((0.0, 10), "learning_rate"), ((0.1, 0), "num_steps"), ((0.1, 10, 1.5), "final_fraction")):
        with pytest.raises(ValueError, match=match):
            cosine_decay(*args)


@pytest.mark.slow
def test_fit_records_optimiser_and_gains(fitted, tmp_path):
    tw = fitted.twin
    assert tw.fit_info["optimizer"] == "adam, cosine decay to 5%"
    g = tw.guide_spec
    assert g["continuous_gain"] == tw.guide.continuous_gain and g["discrete_gain"] == tw.guide.discrete_gain
    loaded = twin.load(tw.save(tmp_path / "t"))
    assert (loaded.guide.continuous_gain, loaded.guide.discrete_gain) == (g["continuous_gain"], g["discrete_gain"])


def test_default_discrete_gain_from_the_schema():
    from d3p.twin.model import MixtureGuide, MixtureModel, default_discrete_gain

    def schema(n_real, levels=2):
        cols = [ColumnSpec(f"r{i}", "real", "float64", False, lower=0.0, upper=1.0, distribution="normal")
                for i in range(n_real)]
        cols.append(ColumnSpec("y", "categorical", "str", False, levels=tuple("abcdefgh"[:levels]),
                               distribution="categorical"))
        return Schema(tuple(cols))

    # sqrt(D_continuous / D_discrete), clipped to [1, 10]
    assert default_discrete_gain(MixtureModel(schema(30), 3)) == pytest.approx(6.0)  # sqrt(180 / (2 + 3))
    assert default_discrete_gain(MixtureModel(schema(1000), 3)) == 10.0
    assert default_discrete_gain(MixtureModel(schema(1, levels=8), 3)) == 1.0
    assert default_discrete_gain(MixtureModel(explicit_schema(), 2)) == 1.0
    model = MixtureModel(schema(30), 3)
    assert MixtureGuide(model).discrete_gain == pytest.approx(6.0)
    assert MixtureGuide(model, discrete_gain=2.5).discrete_gain == 2.5


# ------------------------------------- argument checks, one message format


@pytest.mark.parametrize("kwargs, message", [
    ({"epsilon": 0.0}, "Expected epsilon to be a number > 0, got epsilon=0.0."),
    ({"delta": 1.0}, "Expected delta to be a finite number in (0, 1), got delta=1.0."),
    ({"q": 0.0}, "Expected q to be a finite number in (0, 1], got q=0.0."),
    ({"q": 1.5}, "Expected q to be a finite number in (0, 1], got q=1.5."),
    ({"num_steps": 0}, "Expected num_steps to be an integer >= 1, got num_steps=0."),
    ({"clipping_threshold": math.inf},
     "Expected clipping_threshold to be a finite number > 0, got clipping_threshold=inf."),
    ({"learning_rate": -0.1}, "Expected learning_rate to be a finite number > 0, got learning_rate=-0.1."),
    ({"sampling": "replacement"}, "Expected sampling to be one of 'poisson', 'fixed', got sampling='replacement'."),
    ({"max_levels": 0}, "Expected max_levels to be an integer >= 1, got max_levels=0."),
])
def test_fit_argument_messages_name_argument_and_range(kwargs, message):
    args = {"epsilon": 1.0, "rng_key": 0, "schema": explicit_schema(), "num_steps": 5, "progress_bar": False}
    args.update(kwargs)
    with pytest.raises(ValueError) as e:
        twin.fit(small_frame(), **args)
    assert str(e.value) == message


@pytest.mark.parametrize("kwargs", [{"num_steps": True}, {"q": "0.1"}, {"epsilon": None}, {"delta": True},
                                    {"num_components": 2.0}, {"data": small_frame().to_numpy()}])
def test_fit_rejects_wrong_kinds(kwargs):
    from d3p._validate import InvalidArgumentType

    args = {"epsilon": 1.0, "rng_key": 0, "schema": explicit_schema(), "num_steps": 5, "progress_bar": False}
    args.update(kwargs)
    df = args.pop("data", small_frame())
    with pytest.raises(InvalidArgumentType):
        twin.fit(df, **args)


def test_fit_accepts_q_one_with_fixed_size_batches(stub_run):
    """q is a sampling probability in (0, 1] everywhere: q = 1 (every record in every
    batch) is valid for fixed-size batches, accounted under substitute."""
    tw = twin.fit(small_frame(), 2.0, rng_key=0, schema=explicit_schema(), num_steps=5, q=1.0, sampling="fixed",
                  progress_bar=False)
    assert stub_run[0].batch_size == len(small_frame()) and tw.privacy["q"] == 1.0
    assert tw.privacy["relation"] == "substitute" and tw.privacy["sigma"] > 0


def test_privacy_record_relation_is_a_plain_string(stub_run, tmp_path):
    tw = twin.fit(small_frame(), 1.0, rng_key=0, schema=explicit_schema(), num_steps=5, progress_bar=False)
    assert type(tw.privacy["relation"]) is str and tw.privacy["relation"] == "add_remove"
    tw.save(tmp_path / "t")
    assert json.loads((tmp_path / "t" / "twin.json").read_text())["privacy"]["relation"] == "add_remove"


@pytest.mark.parametrize("learning_rate, num_steps, final_fraction", [(0.2, 100, 0.05), (0.05, 7, 0.0),
                                                                      (1.0, 1, 1.0), (0.3, 2000, 0.5)])
def test_cosine_decay_equals_closed_form(learning_rate, num_steps, final_fraction):
    import jax

    from d3p.twin.inference import cosine_decay

    def closed_form(i):
        t = min(i, num_steps) / num_steps
        return learning_rate * (final_fraction + (1 - final_fraction) * (1 + math.cos(math.pi * t)) / 2)

    schedule = cosine_decay(learning_rate, num_steps, final_fraction)
    steps = sorted({0, 1, num_steps // 3, num_steps // 2, num_steps - 1, num_steps, num_steps + 1, 5 * num_steps})
    for i in steps:
        assert float(schedule(i)) == pytest.approx(closed_form(i), rel=1e-6, abs=1e-9), i
        # as numpyro's optimizers call it: a traced int32 step counter
        assert float(jax.jit(schedule)(jnp.int32(i))) == pytest.approx(closed_form(i), rel=1e-6, abs=1e-9), i


def test_cosine_decay_without_optax_names_the_extra(monkeypatch):
    import sys

    from d3p.twin.inference import cosine_decay

    monkeypatch.setitem(sys.modules, "optax", None)  # makes `import optax` fail
    with pytest.raises(ImportError, match=r"pip install d3p\[twin\]"):
        cosine_decay(0.1, 10)


def test_cosine_decay_argument_messages():
    from d3p._validate import InvalidArgumentType
    from d3p.twin.inference import cosine_decay

    with pytest.raises(ValueError, match=r"^Expected final_fraction to be a finite number in \[0, 1\], "
                                         r"got final_fraction=1\.5\.$"):
        cosine_decay(0.1, 10, 1.5)
    with pytest.raises(InvalidArgumentType, match="num_steps"):
        cosine_decay(0.1, True)


@pytest.mark.parametrize("kwargs, message", [
    ({"num_records": 0}, "Expected num_records to be an integer >= 1, got num_records=0."),
    ({"num_records": 5, "num_param_draws": 0}, "Expected num_param_draws to be an integer >= 1, got num_param_draws=0."),
])
def test_generate_argument_messages(stub_run, kwargs, message):
    # a twin whose fit is the stub's (its parameters are the initial ones): generate checks
    # its arguments before it reads them
    tw = twin.fit(small_frame(), 1.0, rng_key=d3p.random.PRNGKey(5), schema=explicit_schema(), num_steps=10,
                  progress_bar=False)
    with pytest.raises(ValueError) as e:
        tw.generate(rng_key=0, **kwargs)
    assert str(e.value) == message


@pytest.mark.slow
def test_adaptive_clipping_is_accounted_with_its_counts():
    """``adaptive_clipping``: σ is calibrated as the effective noise multiplier of
    the gradient sums and the counts together, the gradient's own σ is larger,
    and dp-accounting at the effective σ computed here from the two (not by d3p)
    meets the target ε."""
    from dp_accounting import GaussianDpEvent, NeighboringRelation, PoissonSampledDpEvent
    from dp_accounting.pld import pld_privacy_accountant

    df = small_frame()
    tw = twin.fit(df, EPS, 1e-5, rng_key=d3p.random.PRNGKey(2), schema=explicit_schema(), num_components=2,
                  num_steps=STEPS, q=0.2, progress_bar=False,
                  adaptive_clipping=d3p.svi.AdaptiveClipping(target_quantile=0.9))
    info = tw.fit_info["adaptive_clipping"]
    # the default count noise: a tenth of each step's privacy, 1.5 times the gradient's noise multiplier
    assert info["target_quantile"] == 0.9 and info["count_noise"] == pytest.approx(1.5 * info["gradient_sigma"])
    assert info["final_clipping_threshold"] != tw.privacy["clipping_threshold"]   # C moved
    sigma, count_noise = info["gradient_sigma"], info["count_noise"]
    sigma_eff = (sigma**-2 + (2 * count_noise) ** -2) ** -0.5
    assert sigma > tw.privacy["sigma"] and sigma_eff >= tw.privacy["sigma"]
    ref = pld_privacy_accountant.PLDAccountant(NeighboringRelation.ADD_OR_REMOVE_ONE)
    ref.compose(PoissonSampledDpEvent(0.2, GaussianDpEvent(sigma_eff)), STEPS)
    assert ref.get_epsilon(1e-5) <= EPS * (1 + 1e-3)
    assert tw.privacy["epsilon"] <= EPS
    # the count's share of the budget is real: the gradient's σ alone would claim a smaller ε
    alone = pld_privacy_accountant.PLDAccountant(NeighboringRelation.ADD_OR_REMOVE_ONE)
    alone.compose(PoissonSampledDpEvent(0.2, GaussianDpEvent(sigma)), STEPS)
    assert alone.get_epsilon(1e-5) < 0.99 * ref.get_epsilon(1e-5)


def test_adaptive_clipping_is_refused_with_the_marginal_family():
    with pytest.raises(ValueError, match="adaptive_clipping with family='marginal'"):
        twin.fit(small_frame(), EPS, rng_key=0, schema=explicit_schema(), family="marginal",
                 adaptive_clipping=True, progress_bar=False)
