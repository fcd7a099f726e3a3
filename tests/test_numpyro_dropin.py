# SPDX-License-Identifier: Apache-2.0
"""DPSVI as a drop-in for NumPyro code as NumPyro users write it (issue 39).

JAX keys at every entry point (converted by :func:`d3p.random.as_key`, the
noise still ChaCha20's), NumPyro's constructor (``loss=``), SVI's methods and
run result, ``N`` read from the records plate, errors that name the real
cause, and with σ = 0 and C = inf the parameters of ``numpyro.infer.SVI`` on
the same data and key.

What "the same key" gives: DPSVI converts a JAX key into a ChaCha20 key and
draws everything (initialisation, Monte Carlo, noise) from that, so its random
draws are not SVI's for the same key (and each record has its own guide draw).
The comparisons with SVI are exact (float tolerance) for guides without
randomness (AutoDelta, deterministic initial values), with every ELBO and
optimizer form; the stochastic autoguides are compared at convergence.
"""

import inspect
import re
import math

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer import SVI, Trace_ELBO, TraceMeanField_ELBO
from numpyro.infer.autoguide import AutoDelta, AutoDiagonalNormal, AutoNormal
from numpyro.infer.initialization import init_to_value

import d3p.random
from d3p import minibatch
from d3p.random import chacha
from d3p.svi import DPSVI

N = 12
XS = jnp.linspace(-1.0, 2.0, N)
INIT = init_to_value(values={"mu": 0.3, "sigma": 1.5})


def model(xs):
    """A NumPyro model as NumPyro users write it (the records plate declares N; no N argument)."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    sigma = numpyro.sample("sigma", dist.LogNormal(0.0, 1.0))
    with numpyro.plate("data", N, subsample_size=xs.shape[0]):
        numpyro.sample("x", dist.Normal(mu, sigma), obs=xs)


def _noiseless(guide, loss=None, optim=None, **kwargs):
    return DPSVI(model, guide, optim or numpyro.optim.Adam(0.05), loss=loss or Trace_ELBO(),
                 clipping_threshold=math.inf, dp_scale=0.0, **kwargs)


KEY_KINDS = {
    "d3p": lambda: d3p.random.PRNGKey(7),
    "jax_raw": lambda: jax.random.PRNGKey(7),
    "jax_typed": lambda: jax.random.key(7),
}


# ----------------------------------------------------------------------- keys

def test_jax_keys_convert_by_the_documented_chacha20_block():
    # as_key: ChaCha20 (RFC 8439) keyed by the JAX key's words zero-padded to 256 bits, block 0 under
    # nonce (4, n, 0), its first 8 words; checked against OpenSSL's ChaCha20 (cryptography)
    ciphers = pytest.importorskip("cryptography.hazmat.primitives.ciphers")
    from cryptography.hazmat.primitives.ciphers.algorithms import ChaCha20

    for key in (jax.random.PRNGKey(7), jax.random.PRNGKey(2**31 + 5)):
        words = np.asarray(key, np.uint32)
        chacha_key = np.zeros(8, "<u4")
        chacha_key[:2] = words
        # cryptography's 16-byte nonce: the block counter (0), then the RFC's three nonce words
        nonce = np.array([0, 4, 2, 0], "<u4").tobytes()
        stream = ciphers.Cipher(ChaCha20(chacha_key.tobytes(), nonce), mode=None).encryptor().update(bytes(32))
        want = np.frombuffer(stream, "<u4")
        np.testing.assert_array_equal(np.asarray(d3p.random.as_key(key)), want)


def test_typed_and_raw_jax_keys_give_the_same_key_under_jit_too():
    typed, raw = jax.random.key(3), jax.random.PRNGKey(3)
    a = d3p.random.as_key(typed)
    np.testing.assert_array_equal(a, d3p.random.as_key(raw))
    np.testing.assert_array_equal(a, jax.jit(d3p.random.as_key)(typed))
    np.testing.assert_array_equal(a, jax.jit(d3p.random.as_key)(raw))
    assert a.shape == (8,) and a.dtype == jnp.uint32
    assert not np.array_equal(a, d3p.random.as_key(jax.random.key(4)))
    d3p_key = d3p.random.PRNGKey(3)
    assert d3p.random.as_key(d3p_key) is d3p_key or np.array_equal(d3p.random.as_key(d3p_key), d3p_key)


def test_conversion_lowers_for_cuda_without_callbacks():
    text = jax.jit(d3p.random.as_key).trace(jax.random.key(0)).lower(lowering_platforms=("cuda",)).as_text()
    assert "callback" not in text


@pytest.mark.parametrize("bad, what", [
    (jnp.zeros(3, jnp.uint32), "shape (3,) and dtype uint32"),
    (jnp.zeros(8, jnp.int32), "shape (8,) and dtype int32"),
    (jnp.zeros(2, jnp.int32), "shape (2,) and dtype int32"),
    (jnp.zeros((2, 8), jnp.uint32), "shape (2, 8)"),
    (7, "type int"),
])
def test_other_keys_are_refused_naming_the_argument(bad, what):
    with pytest.raises(TypeError, match=rf"Expected rng_key to be a d3p.random key .*JAX key.*got .*{re.escape(what)}"):
        d3p.random.as_key(bad)
    svi = _noiseless(AutoDelta(model, init_loc_fn=INIT))
    with pytest.raises(TypeError, match=r"Expected rng_key to be a d3p.random key"):
        svi.init(bad, XS)
    state = _noiseless(AutoDelta(model, init_loc_fn=INIT)).init(d3p.random.PRNGKey(0), XS)
    with pytest.raises(TypeError, match=r"Expected svi_state.rng_key to be a d3p.random key"):
        svi.update(state._replace(rng_key=bad), XS)


def test_a_batch_of_typed_keys_is_refused():
    with pytest.raises(TypeError, match=r"Expected rng_key to be a single JAX key, got a key array of shape \(2,\)"):
        d3p.random.as_key(jax.random.split(jax.random.key(0)))


@pytest.fixture(scope="module")
def noisy_svi():
    """A DPSVI with noise (σ = 1, C = 1), shared by the key tests (one compilation)."""
    return DPSVI(model, AutoDelta(model, init_loc_fn=INIT), numpyro.optim.Adam(0.05), Trace_ELBO(),
                 clipping_threshold=1.0, dp_scale=1.0)


@pytest.fixture(scope="module")
def noisy_steps(noisy_svi):
    """``noisy_svi``'s update and evaluate, jitted once for the module."""
    return jax.jit(noisy_svi.update), jax.jit(noisy_svi.evaluate)


@pytest.mark.parametrize("kind", sorted(KEY_KINDS))
def test_init_update_evaluate_take_every_kind_of_key(noisy_svi, noisy_steps, kind):
    key = KEY_KINDS[kind]()
    state = noisy_svi.init(key, XS)
    assert state.rng_key.shape == (8,) and state.rng_key.dtype == jnp.uint32
    # the state holds the converted key: the same as initialising with d3p.random.as_key(key)
    reference = noisy_svi.init(d3p.random.as_key(key), XS)
    jax.tree.map(np.testing.assert_array_equal, state, reference)
    update, evaluate = noisy_steps
    new_state, loss = update(state, XS)
    assert np.isfinite(loss) and np.isfinite(evaluate(new_state, XS))


def test_a_state_holding_a_jax_key_steps_with_chacha20_noise_of_the_converted_key(noisy_svi, noisy_steps):
    # update converts the state's key (also traced, under jit): the noise is ChaCha20's, keyed by as_key(key)
    update, evaluate = noisy_steps
    state = noisy_svi.init(d3p.random.PRNGKey(0), XS)
    key = jax.random.PRNGKey(11)
    got, loss = update(state._replace(rng_key=key), XS)
    want, want_loss = update(state._replace(rng_key=d3p.random.as_key(key)), XS)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    assert loss == want_loss
    assert evaluate(state._replace(rng_key=key), XS) == evaluate(state._replace(rng_key=d3p.random.as_key(key)), XS)


def test_run_takes_jax_keys_typed_and_raw_alike(noisy_svi):
    runs = [noisy_svi.run(key, 3, XS, batch_size=4, progress_bar=False)
            for key in (jax.random.key(5), jax.random.PRNGKey(5), d3p.random.as_key(jax.random.PRNGKey(5)))]
    for other in runs[1:]:
        jax.tree.map(np.testing.assert_array_equal, runs[0].params, other.params)
        np.testing.assert_array_equal(runs[0].losses, other.losses)


@pytest.mark.parametrize("kind", sorted(KEY_KINDS))
def test_samplers_take_every_kind_of_key(kind):
    key = KEY_KINDS[kind]()
    converted = d3p.random.as_key(key)
    for batchify in (lambda: minibatch.subsample_batchify_data((XS,), batch_size=4),
                     lambda: minibatch.poisson_batchify_data((XS,), q=0.3, max_batch_size=8),
                     lambda: minibatch.split_batchify_data((XS,), batch_size=4)):
        init, get_batch = batchify()
        _, state = init(key)
        _, reference = init(converted)
        jax.tree.map(np.testing.assert_array_equal, get_batch(1, state), get_batch(1, reference))
    sampler = minibatch.FixedSizeSampler(N, 4) if hasattr(minibatch, "FixedSizeSampler") else None
    if sampler is not None:
        jax.tree.map(np.testing.assert_array_equal, sampler.sample(key), sampler.sample(converted))


def test_the_twin_takes_jax_keys():
    from d3p.twin import inference

    key = jax.random.key(9)
    np.testing.assert_array_equal(inference._as_d3p_key(key), d3p.random.as_key(key))
    np.testing.assert_array_equal(inference._as_d3p_key(jax.random.PRNGKey(9)), d3p.random.as_key(key))
    with pytest.raises(ValueError, match="Expected rng_key to be a d3p.random key"):
        inference._as_d3p_key(jnp.zeros(3, jnp.uint32))


def test_the_debug_suite_takes_jax_and_d3p_keys():
    from d3p.random import debug

    key = jax.random.key(1)
    assert debug.as_key(key) is key
    np.testing.assert_array_equal(debug.as_key(d3p.random.PRNGKey(1)),
                                  chacha.convert_to_jax_rng_key(d3p.random.PRNGKey(1)))


# ------------------------------------------------------------------ signature

def test_loss_is_accepted_under_numpyro_and_d3p_names():
    guide, optim, elbo = AutoDelta(model), numpyro.optim.Adam(0.1), Trace_ELBO()
    for svi in (DPSVI(model, guide, optim, elbo, 1.0, 1.0),
                DPSVI(model, guide, optim, loss=elbo, clipping_threshold=1.0, dp_scale=1.0),
                DPSVI(model, guide, optim, per_example_loss=elbo, clipping_threshold=1.0, dp_scale=1.0)):
        assert svi.loss is elbo and svi.per_example_loss is elbo
        assert svi.static_kwargs == {}
    with pytest.raises(TypeError, match="Expected the ELBO once, as loss .* or as per_example_loss"):
        DPSVI(model, guide, optim, elbo, per_example_loss=elbo, clipping_threshold=1.0, dp_scale=1.0)
    with pytest.raises(TypeError, match=r"Expected loss, the ELBO to minimise"):
        DPSVI(model, guide, optim, clipping_threshold=1.0, dp_scale=1.0)
    with pytest.raises(TypeError, match=r"Expected per_example_loss to be an ELBO with a loss method"):
        DPSVI(model, guide, optim, per_example_loss="Trace_ELBO", clipping_threshold=1.0, dp_scale=1.0)
    with pytest.raises(TypeError, match=r"Expected clipping_threshold, the clipping threshold C > 0"):
        DPSVI(model, guide, optim, loss=elbo, dp_scale=1.0)
    # neither C nor σ: NumPyro's signature as it is; run(epsilon=...) chooses both
    assert DPSVI(model, guide, optim, elbo).clipping_chosen


def _public_methods(cls):
    return [n for n, v in inspect.getmembers(cls, callable) if not n.startswith("_")]


def test_every_public_method_of_svi_exists_with_its_parameters():
    for name in _public_methods(SVI):
        assert name in _public_methods(DPSVI), name
        svi_params = inspect.signature(getattr(SVI, name)).parameters
        dp_params = inspect.signature(getattr(DPSVI, name)).parameters
        for pname, p in svi_params.items():
            assert pname in dp_params, (name, pname)
            q = dp_params[pname]
            assert q.kind == p.kind or (p.kind == p.POSITIONAL_OR_KEYWORD and q.kind == q.POSITIONAL_OR_KEYWORD), \
                (name, pname)
            if p.default is not p.empty:
                assert q.default == p.default, (name, pname)
        positional = [n for n, p in svi_params.items() if p.kind == p.POSITIONAL_OR_KEYWORD]
        assert list(dp_params)[:len(positional)] == positional, name


def test_n_is_read_from_the_plate_and_checked_against_the_n_given():
    # NumPyro's model takes no N: DPSVI(..., N=N) is not passed to it, only checked
    svi = _noiseless(AutoDelta(model, init_loc_fn=INIT), N=N)
    assert svi.static_kwargs == {} and svi.declared_N == N
    state = svi.init(jax.random.key(0), XS)
    assert float(state.observation_scale) == N
    wrong = _noiseless(AutoDelta(model, init_loc_fn=INIT), N=N + 1)
    with pytest.raises(ValueError, match=rf"declare the data size given as DPSVI\(\.\.\., N={N + 1}\), got {{'data': {N}}}"):
        wrong.init(jax.random.key(0), XS)

    # d3p 0.2's models take N: it is passed on, as before
    def model_with_n(xs, N):
        mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
        with numpyro.plate("data", N, subsample_size=xs.shape[0]):
            numpyro.sample("x", dist.Normal(mu, 1.0), obs=xs)

    svi = DPSVI(model_with_n, AutoDelta(model_with_n), numpyro.optim.Adam(0.1), Trace_ELBO(), 1.0, 1.0, N=N)
    assert svi.static_kwargs == {"N": N} and svi.declared_N is None
    assert float(svi.init(jax.random.key(0), XS).observation_scale) == N


# --------------------------------------------------------------------- errors

def no_subsample_model(xs):
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    with numpyro.plate("data", xs.shape[0]):
        numpyro.sample("x", dist.Normal(mu, 1.0), obs=xs)


def leftover_subsample_model(xs):
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    with numpyro.plate("data", N, subsample_size=xs.shape[0]):
        batch = numpyro.subsample(xs, event_dim=0)
        numpyro.sample("x", dist.Normal(mu, 1.0), obs=batch)


def fixed_subsample_model(xs):
    # NumPyro's minibatch pattern: the model is given all the data and subsamples 4 itself
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    with numpyro.plate("data", xs.shape[0], subsample_size=4) as idx:
        numpyro.sample("x", dist.Normal(mu, 1.0), obs=xs[idx])


def constant_subsample_model(xs):
    # the records plate declares N, but subsamples a constant 4 instead of the batch it is given
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    with numpyro.plate("data", N, subsample_size=4):
        numpyro.sample("x", dist.Normal(mu, 1.0), obs=xs)


def shared_argument_model(xs, prior_scale):
    mu = numpyro.sample("mu", dist.Normal(0.0, prior_scale))
    with numpyro.plate("data", N, subsample_size=xs.shape[0]):
        numpyro.sample("x", dist.Normal(mu, 1.0), obs=xs)


def no_data_model():
    numpyro.sample("x", dist.Normal(0.0, 1.0), obs=0.5)


ERRORS = {
    "no_subsample_size": (no_subsample_model, (XS,),
                          r"The observed site\(s\) \['x'\] are not under a subsampling plate: the plate\(s\) \['data'\] "
                          r"over them declare no subsample_size"),
    "leftover_subsample": (leftover_subsample_model, (XS,),
                           r"The model calls numpyro.subsample.*remove the numpyro.subsample call"),
    "fixed_subsample_size": (fixed_subsample_model, (XS,),
                             r"The observed site\(s\) \['x'\] are not under a subsampling plate: the plate\(s\) "
                             r"\['data'\] over them declare as their size the length of the batch they are given "
                             r"\(1 on a batch of one record: \['data'\]\), not N"),
    "constant_subsample_size": (constant_subsample_model, (XS,),
                                r"Expected the records plate\(s\) \['data'\] to subsample the batch the model is "
                                r"given \(subsample_size=xs.shape\[0\]\), got subsample_size \{'data': 4\}"),
    "shared_scalar": (shared_argument_model, (XS, 10.0),
                      r"Expected args\[1\] to be an array with one row per record, got a scalar.*"
                      r"values shared by all records .* go to the DPSVI constructor"),
    "shared_array": (shared_argument_model, (XS, jnp.ones(3)),
                     r"Expected every data argument to hold one row per record, but args\[1\] has leading "
                     r"dimension 3.*go to the DPSVI constructor"),
    "no_data": (no_data_model, (),
                r"Expected at least one per-record data array.*a model without data arguments"),
}


@pytest.mark.filterwarnings("ignore:subsample_size does not match")   # NumPyro's, for fixed_subsample_model
@pytest.mark.parametrize("case", sorted(ERRORS))
@pytest.mark.parametrize("guide", ["AutoNormal", "hand_written"])
def test_errors_name_the_real_cause(case, guide):
    fn, args, message = ERRORS[case]

    def hand_written(*args, **kwargs):
        loc = numpyro.param("loc", 0.0)
        numpyro.sample("mu", dist.Normal(loc, 1.0))

    svi = DPSVI(fn, AutoNormal(fn) if guide == "AutoNormal" else hand_written, numpyro.optim.Adam(0.1),
                loss=Trace_ELBO(), clipping_threshold=1.0, dp_scale=1.0)
    for call in (lambda: svi.init(jax.random.key(0), *args),
                 lambda: svi.run(jax.random.key(0), 2, *args, batch_size=4, progress_bar=False)):
        with pytest.raises((ValueError, TypeError), match=message) as info:
            call()
        assert "could not be initialised" not in str(info.value)


@pytest.mark.filterwarnings("ignore:subsample_size does not match")
@pytest.mark.parametrize("case", ["fixed_subsample_size", "constant_subsample_size"])
def test_errors_name_the_real_cause_with_numpyro_subsampling_off_cpu(monkeypatch, case):
    # off the CPU NumPyro draws a plate's subsample with jax.random.choice, which raises on a plate that
    # subsamples more than its size (found on a GPU: NumPyro's "Cannot take a larger sample" instead of
    # d3p's message); that path taken here on the CPU
    import numpyro.primitives

    def choice_path(size, subsample_size, rng_key=None):
        return jax.random.choice(rng_key, size, (subsample_size,), replace=False)

    monkeypatch.setattr(numpyro.primitives, "_subsample_fn", choice_path)
    with pytest.raises(ValueError, match="Cannot take a larger sample"):   # the path is the one that raised
        numpyro.handlers.seed(fixed_subsample_model, 0)(XS[:1])
    fn, args, message = ERRORS[case]
    svi = DPSVI(fn, AutoNormal(fn), numpyro.optim.Adam(0.1), loss=Trace_ELBO(), clipping_threshold=1.0,
                dp_scale=1.0)
    for call in (lambda: svi.init(jax.random.key(0), *args),
                 lambda: svi.run(jax.random.key(0), 2, *args, batch_size=4, progress_bar=False)):
        with pytest.raises((ValueError, TypeError), match=message):
            call()


# ------------------------------------------------- the same parameters as SVI

def _optimizers():
    found = {"numpyro_adam": lambda: numpyro.optim.Adam(0.05)}
    try:
        import optax
    except ImportError:   # pragma: no cover - optax is installed with the tests' extras
        return found
    found["optax_to_numpyro"] = lambda: numpyro.optim.optax_to_numpyro(optax.adam(0.05))
    found["optax"] = lambda: optax.chain(optax.clip_by_global_norm(10.0), optax.sgd(0.01, momentum=0.9))
    return found


OPTIMIZERS = _optimizers()
LOSSES = {
    "Trace_ELBO": Trace_ELBO,
    "Trace_ELBO_3_particles": lambda: Trace_ELBO(num_particles=3),
    "TraceMeanField_ELBO": TraceMeanField_ELBO,
}


def _svi_steps(svi, key, steps):
    state = svi.init(key, XS)
    update = jax.jit(svi.update)
    losses = []
    for _ in range(steps):
        state, loss = update(state, XS)
        losses.append(loss)
    return svi.get_params(state), np.asarray(losses)


# every ELBO with NumPyro's Adam, every optimizer form with Trace_ELBO
EQUAL_CASES = [(loss, "numpyro_adam") for loss in sorted(LOSSES)] + [
    ("Trace_ELBO", optim) for optim in sorted(OPTIMIZERS) if optim != "numpyro_adam"]


@pytest.mark.parametrize("loss, optim", EQUAL_CASES)
def test_noiseless_updates_equal_svi_with_a_deterministic_guide(loss, optim):
    # AutoDelta from fixed initial values has no randomness: σ = 0, C = inf gives SVI's parameters
    key = jax.random.PRNGKey(0)
    guide = AutoDelta(model, init_loc_fn=INIT)
    want, want_losses = _svi_steps(SVI(model, guide, OPTIMIZERS[optim](), LOSSES[loss]()), key, 4)
    dp = _noiseless(AutoDelta(model, init_loc_fn=INIT), loss=LOSSES[loss](), optim=OPTIMIZERS[optim]())
    got, losses = _svi_steps(dp, key, 4)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-6), got, want)
    np.testing.assert_allclose(losses, want_losses, rtol=2e-6)


def test_noiseless_run_over_all_the_data_equals_svi_run():
    # every step on all N records (a fixed-size batch of N): SVI.run's steps, the same parameters
    key = jax.random.key(0)
    want = SVI(model, AutoDelta(model, init_loc_fn=INIT), numpyro.optim.Adam(0.05), Trace_ELBO()).run(
        key, 20, XS, progress_bar=False)
    got = _noiseless(AutoDelta(model, init_loc_fn=INIT)).run(key, 20, XS, batch_size=N, sampling="fixed",
                                                             progress_bar=False)
    assert (got.params.keys(), got.losses.shape) == (want.params.keys(), want.losses.shape)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got.params, want.params)
    np.testing.assert_allclose(got.losses, want.losses, rtol=1e-5)
    # SVIRunResult's fields beside d3p's privacy figures
    params, state, losses = got
    assert params is got.params and state is got.state and losses is got.losses
    assert got.sigma == 0.0


def test_noiseless_run_without_a_batch_size_equals_svi_run():
    key = jax.random.key(0)
    want = SVI(model, AutoDelta(model, init_loc_fn=INIT), numpyro.optim.Adam(0.05), Trace_ELBO()).run(
        key, 20, XS, progress_bar=False)
    got = _noiseless(AutoDelta(model, init_loc_fn=INIT)).run(key, 20, XS, progress_bar=False)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got.params, want.params)


@pytest.mark.slow
@pytest.mark.parametrize("autoguide", [AutoNormal, AutoDiagonalNormal])
def test_noiseless_stochastic_autoguides_converge_where_svi_does(autoguide):
    # Monte Carlo draws differ (each record its own draw, keys from the converted key), so the
    # comparison is at convergence: a decaying step size, the same optimum within its Monte Carlo spread
    import optax

    key = jax.random.key(0)
    schedule = optax.exponential_decay(0.05, 1500, 0.02)

    def fit(cls):
        guide = autoguide(model, init_loc_fn=INIT)
        svi = cls(model, guide, optax.adam(schedule), Trace_ELBO()) if cls is SVI else _noiseless(
            guide, optim=optax.adam(schedule))
        state = svi.init(key, XS)
        state = jax.lax.fori_loop(0, 1500, lambda i, s: svi.update(s, XS)[0], state)
        return guide.median(svi.get_params(state)), svi.get_params(state)

    (want_median, want), (got_median, got) = fit(SVI), fit(DPSVI)
    for site in ("mu", "sigma"):
        np.testing.assert_allclose(got_median[site], want_median[site], atol=0.05, rtol=0.05)
    scales = [k for k in want if k.endswith("scale")]
    for name in scales:
        np.testing.assert_allclose(got[name], want[name], rtol=0.15)
