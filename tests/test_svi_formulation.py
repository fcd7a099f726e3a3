"""DPSVI's ``formulation``: which ELBO terms are clipped per record, and the
Monte Carlo draw shared by the batch.

Without privacy (C = inf, σ = 0) every formulation estimates the full-data
ELBO gradient without bias; ``"shared_sample"`` is exactly NumPyro's
minibatch gradient for the same guide sample. The sensitivity of the
released sum under the split formulations is checked in
``tests/test_neighbours.py`` (hand-built neighbours, adversarial records) and
``tests/test_clipping_bound.py``; here: the estimator, the split of the sites
and the argument's validation. Each DPSVI's step is compiled once.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer import RenyiELBO, Trace_ELBO, TraceMeanField_ELBO
from numpyro.infer.autoguide import AutoDelta

import d3p.random
from d3p import _elbo_terms, _private_step
from d3p._paper_models import (
    hierarchical_logistic_regression_guide,
    hierarchical_logistic_regression_model,
    logistic_regression_guide,
    logistic_regression_model,
    make_vae,
)
from d3p.svi import DPSVI

import _step_keys

N = 40


def data(B=N, d=3, seed=0):
    rng = np.random.default_rng(seed)
    xs = rng.normal(size=(B, d)).astype(np.float32)
    ys = (rng.uniform(size=B) < 0.5).astype(np.float32)
    return jnp.asarray(xs), jnp.asarray(ys)


def flat(tree):
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


def gradient(svi, state, *args, **kwargs):
    """The gradient the optimizer received in one jitted step (SGD, lr = 1)."""
    before = svi.optim.get_params(state.optim_state)
    new_state, loss = jax.jit(svi.update)(state, *args, **kwargs)
    after = svi.optim.get_params(new_state.optim_state)
    return jax.tree.map(lambda b, a: b - a, before, after), loss


def moved(svi, state, params):
    """``state`` with the unconstrained parameters ``params`` (off the initial point)."""
    return state._replace(optim_state=svi.optim.init(params))


def shared_key(state, B, sites=()):
    """The key of the draw shared by a batch of ``B`` records in the step from
    ``state`` (d3p._private_step._step_keys: the JAX key after the records'
    of the state's key, tests/_step_keys.py), with the keys of its ``sites``
    (those outside the records' plate: the keys after it) as the step holds
    them (a :class:`d3p._elbo_terms.SharedKey`)."""
    key = jnp.asarray(_step_keys.shared_key(state.rng_key, B))
    if not sites:
        return key
    return _elbo_terms.SharedKey(key, {name: jnp.asarray(k) for name, k in
                                       _step_keys.site_keys(state.rng_key, B, sites).items()})


def numpyro_gradient(model, guide, key, plates, params, *args, **kwargs):
    """NumPyro's Trace_ELBO gradient on the whole batch, every sample site
    keyed as DPSVI keys it for ``key`` (the same guide sample; a
    :class:`d3p._elbo_terms.SharedKey` gives the sites outside ``plates``
    their keys)."""
    m = _elbo_terms.SiteKeys(model, plates, key, key)
    g = _elbo_terms.SiteKeys(guide, plates, key, key)
    base = _elbo_terms.base_key(key)
    return jax.jit(jax.grad(lambda p: Trace_ELBO().loss(base, p, m, g, *args, **kwargs)))(params)


@pytest.mark.slow
def test_shared_sample_is_numpyros_full_data_elbo_gradient():
    """σ = 0, C = inf, the whole data set as the batch: the released gradient is
    the gradient of NumPyro's Trace_ELBO on the whole data with the same guide
    sample (one draw for the batch), to float rounding: the split (clipped
    likelihood, prior and entropy once, after the noise) keeps the weights of
    the full-data ELBO; the loss is NumPyro's too."""
    xs, ys = data()
    svi = DPSVI(logistic_regression_model, logistic_regression_guide, numpyro.optim.SGD(1.0), Trace_ELBO(),
                float("inf"), 0.0, formulation="shared_sample", N=N)
    state = svi.init(d3p.random.PRNGKey(1), xs, ys)
    params = {"w_loc": jnp.array([0.3, -0.2, 0.1]), "w_scale_log": jnp.array([-1.0, -0.5, 0.0])}
    state = moved(svi, state, params)
    got, loss = gradient(svi, state, xs, ys)
    assert svi.formulation_choice == "shared_sample"
    key = shared_key(state, len(xs), ["w"])
    expected = numpyro_gradient(logistic_regression_model, logistic_regression_guide, key, {"batch"}, params,
                                xs, ys, N=N)
    np.testing.assert_allclose(flat(got), flat(expected), rtol=2e-5, atol=2e-5)
    m = _elbo_terms.SiteKeys(logistic_regression_model, {"batch"}, key, key)
    g = _elbo_terms.SiteKeys(logistic_regression_guide, {"batch"}, key, key)
    np.testing.assert_allclose(float(loss), float(Trace_ELBO().loss(key.key, params, m, g, xs, ys, N=N)), rtol=1e-5)


def _data_of(key):
    return np.asarray(jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key)


class _PlainSuite:
    """The ChaCha20 suite with the plain interface only (no ``split_with_jax_key(s)``)."""

    def __getattr__(self, name):
        if name.startswith("split_with_jax_key"):
            raise AttributeError(name)
        return getattr(d3p.random, name)


@pytest.mark.filterwarnings("ignore::d3p.random.debug.DebugRNGWarning")
@pytest.mark.parametrize("suite", ["chacha20", "debug", "plain"])
@pytest.mark.parametrize("B", [0, 1, 7, 9])
def test_a_steps_monte_carlo_keys_are_b_plus_one_keys_of_its_state_key(B, suite):
    """A step's records' keys and the shared draw's key are ``B + 1`` JAX keys
    of the state's key, the shared one last (never a record's): with ChaCha20,
    the words of the keystream under nonce (3, 0, 0) (tests/_step_keys.py; 9
    records' keys take two blocks), and the shared draw's sites the next
    keys, in the order of their names; with the debugging suite and with a
    suite of the plain interface, ``jax.random.split`` of the JAX key derived
    from the state's key (JAX's generator called directly), the sites' keys
    left to ``fold_in`` of the shared key."""
    rng_suite = {"chacha20": d3p.random, "debug": d3p.random.debug, "plain": _PlainSuite()}[suite]
    svi = DPSVI(logistic_regression_model, logistic_regression_guide, numpyro.optim.SGD(1.0), Trace_ELBO(),
                1.0, 1.0, rng_suite=rng_suite)
    key = rng_suite.PRNGKey(3)
    next_key, noise_key, count_key, (keys, key_impl, shared, sites) = _private_step._step_keys(
        svi, key, B, ("tau", "w"))
    if suite == "chacha20":
        expected = _step_keys.jax_key_words(key, B + 3)
        assert list(sites) == ["tau", "w"]
        np.testing.assert_array_equal(_data_of(sites["tau"]), expected[B + 1])
        np.testing.assert_array_equal(_data_of(sites["w"]), expected[B + 2])
        np.testing.assert_array_equal(_data_of(sites["w"]), _step_keys.site_keys(key, B, ["w", "tau"])["w"])
    else:
        assert sites is None
    if suite == "debug":
        expected = np.asarray(jax.random.split(jax.random.split(key, 3)[2], B + 1))
    elif suite == "plain":
        expected = np.asarray(jax.random.split(d3p.random.convert_to_jax_rng_key(d3p.random.split(key, 3)[2]), B + 1))
    np.testing.assert_array_equal(np.asarray(keys), expected[:B])
    np.testing.assert_array_equal(_data_of(shared), expected[B])
    assert keys.shape == (B, 2) and count_key is None
    assert not any(np.array_equal(_data_of(shared), k) for k in np.asarray(keys))
    # the records' and the shared draw's keys do not depend on the number of sites
    _, _, _, (keys0, _, shared0, _) = _private_step._step_keys(svi, key, B)
    np.testing.assert_array_equal(np.asarray(keys0), np.asarray(keys))
    np.testing.assert_array_equal(_data_of(shared0), _data_of(shared))
    # the step's own keys are split's, as before
    np.testing.assert_array_equal(np.asarray(next_key), np.asarray(rng_suite.split(key, 2)[0]))
    np.testing.assert_array_equal(np.asarray(noise_key), np.asarray(rng_suite.split(key, 2)[1]))


@pytest.mark.parametrize("formulation", ["per_record", "own_sample"])
def test_with_chacha20_a_step_evaluates_no_threefry_for_its_monte_carlo_keys(formulation, monkeypatch):
    """The records' and the shared draw's keys are words of the ChaCha20 call
    that gives the step's own keys: the step evaluates Threefry (d3p's
    loop-free one, counted where it is traced: the implementation's functions
    run where the step is lowered) only for the model's and the guide's
    draws, fewer than with a suite of the plain interface, whose step splits
    a JAX key into ``B + 1``."""
    from d3p.random import _threefry

    calls = []
    real = _threefry.threefry2x32
    monkeypatch.setattr(_threefry, "threefry2x32", lambda *a: calls.append(1) or real(*a))
    xs, ys = data(B=8)

    def evaluations(rng_suite):
        svi = DPSVI(logistic_regression_model, logistic_regression_guide, numpyro.optim.SGD(1.0), Trace_ELBO(),
                    1.0, 1.0, rng_suite=rng_suite, formulation=formulation, N=N)
        state = svi.init(d3p.random.PRNGKey(4), xs, ys)
        calls.clear()
        jax.jit(svi.update).trace(state, xs, ys).lower()
        return len(calls)

    chacha = evaluations(d3p.random)
    assert chacha >= 1   # the guide's draws
    assert evaluations(_PlainSuite()) > chacha


def test_the_shared_sites_keys_are_derived_once_and_are_fold_ins_of_the_shared_key():
    """Sites outside the records' plates get ``fold_in(shared_key, site)``,
    computed once per step for all of them; sites inside get
    ``fold_in(record_key, site)``, also where the record key is the shared key
    (the global loss on its placeholder record)."""
    shared = jax.random.split(d3p.random.convert_to_jax_rng_key(d3p.random.PRNGKey(5)), 3)[2]
    record = jax.random.PRNGKey(11)
    keys = _elbo_terms.shared_site_keys(shared, {"w", "tau"})
    one = _elbo_terms.shared_site_keys(shared, {"w"})
    np.testing.assert_array_equal(_data_of(one.sites["w"]), _data_of(keys.sites["w"]))

    def model():
        numpyro.sample("w", dist.Normal(0.0, 1.0))
        numpyro.sample("tau", dist.Normal(0.0, 1.0))
        with numpyro.plate("batch", 1):
            numpyro.sample("z", dist.Normal(0.0, 1.0))

    def site_key(name):
        return _data_of(jax.random.fold_in(shared, _elbo_terms._site_number(name)))

    for record_key, z_base in [(record, record), (keys, shared)]:
        tr = numpyro.handlers.trace(_elbo_terms.SiteKeys(model, {"batch"}, record_key, keys)).get_trace()
        for name in ("w", "tau"):
            np.testing.assert_array_equal(_data_of(tr[name]["kwargs"]["rng_key"]), site_key(name))
            assert tr[name]["kwargs"]["rng_key"] is keys.sites[name]   # the step's, not derived again
        np.testing.assert_array_equal(_data_of(tr["z"]["kwargs"]["rng_key"]),
                                      _data_of(jax.random.fold_in(z_base, _elbo_terms._site_number("z"))))


def _two_latents_model(xs, N):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0))
    tau = numpyro.sample("tau", dist.Normal(0.0, 1.0))
    with numpyro.plate("batch", N, subsample_size=xs.shape[0]):
        numpyro.sample("x", dist.Normal(w, jnp.exp(tau)), obs=xs)


def _two_latents_guide(xs, N):
    for name in ("w", "tau"):
        numpyro.sample(name, dist.Normal(numpyro.param(f"{name}_loc", 0.0), 1.0))


@pytest.mark.filterwarnings("ignore::d3p.random.debug.DebugRNGWarning")
@pytest.mark.parametrize("suite", ["chacha20", "debug"])
def test_a_steps_shared_sites_draw_with_the_keys_of_its_one_key_call(suite, monkeypatch):
    """In a compiled step, the guide's and the model's draws outside the
    records' plate read the keys of the step's key call: with ChaCha20 the
    keystream's words after the shared draw's key, in the order of the
    sites' names (tests/_step_keys.py); with the debugging suite
    ``fold_in(shared_key, site)``, its values as before."""
    seen = []
    real = _elbo_terms.SiteKeys.process_message

    def spy(self, msg):
        real(self, msg)
        if msg["name"] in ("w", "tau") and msg["kwargs"].get("rng_key") is not None:
            key = msg["kwargs"]["rng_key"]
            data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
            jax.debug.callback(lambda k, name=msg["name"]: seen.append((name, np.asarray(k))), data)

    monkeypatch.setattr(_elbo_terms.SiteKeys, "process_message", spy)
    rng_suite = {"chacha20": d3p.random, "debug": d3p.random.debug}[suite]
    B = 5
    xs = jnp.linspace(-1.0, 1.0, B)
    svi = DPSVI(_two_latents_model, _two_latents_guide, numpyro.optim.SGD(0.1), Trace_ELBO(), 1.0, 1.0,
                rng_suite=rng_suite, formulation="own_sample", N=50)
    state = svi.init(rng_suite.PRNGKey(6), xs)
    jax.block_until_ready(svi.update(state, xs))
    assert {name for name, _ in seen} == {"w", "tau"}
    if suite == "chacha20":
        expected = _step_keys.site_keys(state.rng_key, B, ["w", "tau"])
        shared = _step_keys.shared_key(state.rng_key, B)
    else:
        shared = jax.random.split(jax.random.split(state.rng_key, 3)[2], B + 1)[B]
        expected = {name: _data_of(jax.random.fold_in(shared, _elbo_terms._site_number(name)))
                    for name in ("w", "tau")}
    for name, key in seen:
        np.testing.assert_array_equal(key, expected[name])
    # power: the two ways give other keys
    if suite == "chacha20":
        assert not np.array_equal(expected["w"], _data_of(jax.random.fold_in(shared, _elbo_terms._site_number("w"))))
    else:
        following = np.asarray(jax.random.split(jax.random.split(state.rng_key, 3)[2], B + 3))[B + 1:]
        assert not any(np.array_equal(expected["w"], k) for k in following)


@pytest.mark.parametrize("formulation", ["own_sample", pytest.param("shared_sample", marks=pytest.mark.slow)])
def test_split_formulations_without_sampling_give_numpyros_minibatch_gradient(formulation):
    """A deterministic guide (AutoDelta): no Monte Carlo draw, so each split
    formulation's gradient (σ = 0, C = inf, B < N) is NumPyro's minibatch
    ELBO gradient: N/B times the sum of the records' likelihood gradients plus
    the prior's gradient once."""
    B = 12
    xs, ys = data(B=B, seed=2)
    guide = AutoDelta(logistic_regression_model)
    svi = DPSVI(logistic_regression_model, guide, numpyro.optim.SGD(1.0), Trace_ELBO(), float("inf"), 0.0,
                formulation=formulation, N=1000)
    state = svi.init(d3p.random.PRNGKey(3), xs, ys)
    params = {"w_auto_loc": jnp.array([0.5, -1.0, 2.0])}
    state = moved(svi, state, params)
    got, _ = gradient(svi, state, xs, ys)
    expected = jax.grad(lambda p: Trace_ELBO().loss(jax.random.PRNGKey(0), p, logistic_regression_model, guide,
                                                    xs, ys, N=1000))(params)
    np.testing.assert_allclose(flat(got), flat(expected), rtol=2e-5, atol=1e-4)


def test_global_terms_are_not_clipped():
    """Clipping applies to the records' likelihood terms only: with every
    record masked out (σ = 0) the step is exactly the gradient of the prior
    and guide terms (nonzero, the same whatever the records hold), and with
    a tiny C it differs from that by at most N/B times the B clipped records."""
    B, C = 8, 1e-3
    xs, ys = data(B=B, seed=4)
    svi = DPSVI(logistic_regression_model, logistic_regression_guide, numpyro.optim.SGD(1.0), Trace_ELBO(),
                C, 0.0, formulation="shared_sample", N=1000)
    state = svi.init(d3p.random.PRNGKey(5), xs, ys)
    state = moved(svi, state, {"w_loc": jnp.array([3.0, -2.0, 1.0]), "w_scale_log": jnp.array([1.0, 0.5, 0.0])})
    step = jax.jit(svi.update)

    def grad(x, y, mask):
        before = flat(svi.optim.get_params(state.optim_state))
        return before - flat(svi.optim.get_params(step(state, x, y, mask=mask)[0].optim_state))

    nothing = grad(xs, ys, jnp.zeros(B, bool))
    other = grad(xs * 1e30, -ys, jnp.zeros(B, bool))
    np.testing.assert_array_equal(nothing, other)
    assert np.linalg.norm(nothing) > 0.1   # the prior's pull, unclipped
    every = grad(xs, ys, jnp.ones(B, bool))
    assert np.linalg.norm(every - nothing) <= 1000 / B * B * C * (1 + 1e-4)


def _data_dependent_prior(xs, ys, N):
    w = numpyro.sample("w", dist.Normal(jnp.mean(xs), 1.0).expand([xs.shape[1]]).to_event(1))
    with numpyro.plate("batch", N, subsample_size=xs.shape[0]):
        numpyro.sample("ys", dist.Bernoulli(logits=xs @ w), obs=ys)


def _guide(xs, ys, N):
    loc = numpyro.param("loc", jnp.zeros(xs.shape[1]))
    numpyro.sample("w", dist.Normal(loc, 0.5).to_event(1))


def test_a_global_term_that_reads_the_record_is_never_taken_out_of_the_clipped_sum():
    """A prior outside the records plate that reads the data: an explicit split
    formulation is refused, naming the site; "auto" falls back to clipping each
    record's whole ELBO, with a warning (both from an abstract trace)."""
    xs, ys = data(B=4)
    explicit = DPSVI(_data_dependent_prior, _guide, numpyro.optim.SGD(1.0), Trace_ELBO(), 1.0, 0.0,
                     formulation="shared_sample", N=N)
    state = explicit.init(d3p.random.PRNGKey(0), xs, ys)
    with pytest.raises(ValueError, match=r"\['w'\].*formulation='per_record'"):
        jax.eval_shape(explicit.update, state, xs, ys)
    auto = DPSVI(_data_dependent_prior, _guide, numpyro.optim.SGD(1.0), Trace_ELBO(), 1.0, 0.0, N=N)
    state = auto.init(d3p.random.PRNGKey(0), xs, ys)
    with pytest.warns(UserWarning, match="formulation='per_record'"):
        jax.eval_shape(auto.update, state, xs, ys)
    assert auto.formulation_choice == "per_record"


def test_formulation_is_validated_and_auto_follows_the_elbo():
    args = (logistic_regression_model, logistic_regression_guide, numpyro.optim.SGD(1.0))
    with pytest.raises(ValueError, match="formulation"):
        DPSVI(*args, Trace_ELBO(), 1.0, 1.0, formulation="shared", N=N)
    with pytest.raises(ValueError, match="per_example_loss.*RenyiELBO.*formulation='per_record'"):
        DPSVI(*args, RenyiELBO(), 1.0, 1.0, formulation="own_sample", N=N)
    xs, ys = data(B=4)
    class OwnELBO(Trace_ELBO):   # a subclass may compute its terms otherwise: never split
        pass

    for loss, expected in [(OwnELBO(), "per_record"), (TraceMeanField_ELBO(), "aligned"),
                           (Trace_ELBO(), "aligned")]:
        svi = DPSVI(*args, loss, 1.0, 1.0, N=N)
        assert svi.formulation == "auto"
        jax.eval_shape(svi.update, svi.init(d3p.random.PRNGKey(0), xs, ys), xs, ys)
        assert svi.formulation_choice == expected


def _discrete_global(xs, ys, N):
    k = numpyro.sample("k", dist.Bernoulli(0.5))
    with numpyro.plate("batch", N, subsample_size=xs.shape[0]):
        numpyro.sample("ys", dist.Bernoulli(logits=xs.sum(-1) * k), obs=ys)


def _discrete_global_guide(xs, ys, N):
    p = numpyro.param("p", 0.5, constraint=dist.constraints.unit_interval)
    numpyro.sample("k", dist.Bernoulli(p))


@pytest.mark.filterwarnings("ignore:Currently, SVI with Trace_ELBO loss does not support")
def test_auto_is_own_sample_where_a_global_latent_is_not_reparameterised():
    """"aligned" differentiates through the draw of the global latent
    variables: with a discrete one "auto" keeps each record's own sample."""
    xs, ys = data(B=4)
    svi = DPSVI(_discrete_global, _discrete_global_guide, numpyro.optim.SGD(1.0), Trace_ELBO(), 1.0, 1.0, N=N)
    jax.eval_shape(svi.update, svi.init(d3p.random.PRNGKey(0), xs, ys), xs, ys)
    assert svi.formulation_choice == "own_sample"


@functools.lru_cache(maxsize=None)
def _hlogreg(formulation, strategy="auto"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # "Found vars in model but not guide" (ws, as in the paper)
        rng = np.random.default_rng(6)
        gs = jnp.asarray(rng.normal(size=(3, 2)).astype(np.float32))
        return DPSVI(hierarchical_logistic_regression_model, hierarchical_logistic_regression_guide,
                     numpyro.optim.SGD(1.0), Trace_ELBO(), float("inf"), 0.0, formulation=formulation,
                     gradient_strategy=strategy, N=200, gs=gs)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Found vars in model but not guide")
def test_shared_sample_hierarchical_model_only_site_is_drawn_once():
    """The hierarchical regression's group weights ``ws`` are sampled by the
    model (no guide site), outside the records plate: one draw per step,
    shared by the records' likelihoods and the prior term, so the gradient
    is NumPyro's minibatch gradient for that draw."""
    B = 10
    rng = np.random.default_rng(7)
    xs = jnp.asarray(rng.normal(size=(B, 3)).astype(np.float32))
    ys = jnp.asarray((rng.uniform(size=B) < 0.5).astype(np.float32))
    ls = jnp.asarray(rng.integers(0, 3, B).astype(np.int32))
    svi = _hlogreg("shared_sample")
    state = svi.init(d3p.random.PRNGKey(8), xs, ys, ls)
    params = {"M_loc": jnp.full((3, 2), 0.3), "M_scale_log": jnp.full((3, 2), -0.5)}
    state = moved(svi, state, params)
    got, _ = gradient(svi, state, xs, ys, ls)
    expected = numpyro_gradient(hierarchical_logistic_regression_model, hierarchical_logistic_regression_guide,
                                shared_key(state, B, ["M", "ws"]), {"batch"}, params, xs, ys, ls, N=200,
                                gs=svi.static_kwargs["gs"])
    np.testing.assert_allclose(flat(got), flat(expected), rtol=2e-5, atol=2e-4)


@pytest.mark.slow
@pytest.mark.parametrize("formulation", ["shared_sample", "own_sample"])
def test_split_formulations_all_strategies_agree_on_a_vae(formulation):
    """A VAE (local latent variable inside the records plate, kept in the
    clipped per-record term): every gradient strategy gives the same clipped
    sum, ghost norms included, to float rounding."""
    model, guide = make_vae(12, 6, 2)
    xs = jnp.asarray((np.random.default_rng(9).random((8, 12)) < 0.3).astype(np.float32))
    got = {}
    for strategy in ("vmap", "chunked", "scan", "ghost"):
        svi = DPSVI(model, guide, numpyro.optim.SGD(1.0), Trace_ELBO(), 1.0, 0.0, formulation=formulation,
                    gradient_strategy=strategy, chunk_size=3, N=100)
        state = svi.init(d3p.random.PRNGKey(10), xs)
        got[strategy] = flat(gradient(svi, state, xs)[0])
        assert svi.strategy_choice.strategy == ("chunked" if strategy == "scan" else strategy)
    for strategy, g in got.items():
        np.testing.assert_allclose(g, got["vmap"], rtol=1e-4, atol=1e-4 * np.abs(got["vmap"]).max())
