"""The loop-free Threefry-2x32 implementation gives JAX's values exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer import Trace_ELBO

import d3p.random
from d3p.random import _threefry
from d3p.svi import DPSVI

from _backend import cpu_default

RAW = jax.random.PRNGKey(20261122)


def _same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a, b)


def _data(key):
    return jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key


DRAWS = {
    "split": lambda k: _data(jax.random.split(k, 7)),
    "split_2d": lambda k: _data(jax.random.split(k, (2, 3))),
    "fold_in": lambda k: _data(jax.random.fold_in(k, 12345)),
    "fold_in_high": lambda k: _data(jax.random.fold_in(k, np.uint32(2**31 + 5))),
    "bits32": lambda k: jax.random.bits(k, (5, 3)),
    "bits16": lambda k: jax.random.bits(k, (9,), jnp.uint16),
    "bits8": lambda k: jax.random.bits(k, (11,), jnp.uint8),
    "uniform": lambda k: jax.random.uniform(k, (13,)),
    "normal": lambda k: jax.random.normal(k, (4, 5)),
    "randint": lambda k: jax.random.randint(k, (6,), 0, 1000),
    "gamma": lambda k: jax.random.gamma(k, 0.7, (5,)),
    "permutation": lambda k: jax.random.permutation(k, 17),
    "vmap_normal": lambda k: jax.vmap(lambda kk: jax.random.normal(kk, (3,)))(jax.random.split(k, 6)),
    "vmap_split_fold": lambda k: _data(
        jax.vmap(lambda kk, i: jax.random.fold_in(jax.random.split(kk)[1], i))(
            jax.random.split(k, 4), jnp.arange(4)
        )
    ),
}


@pytest.mark.parametrize("name", sorted(DRAWS))
def test_same_values_as_jax_random(name):
    draw = DRAWS[name]
    fast = _threefry.fast_key(RAW)
    assert jnp.issubdtype(fast.dtype, jax.dtypes.prng_key)
    _same(draw(fast), draw(RAW))
    _same(jax.jit(draw)(fast), draw(RAW))


def test_bits64_same_as_jax_random():
    with jax.enable_x64(True):
        fast = _threefry.fast_key(RAW)
        _same(jax.random.bits(fast, (7,), jnp.uint64), jax.random.bits(RAW, (7,), jnp.uint64))


@pytest.mark.parametrize("seed", [0, 1, 42, 2**31 - 1, -1, -12345])
def test_seed_same_as_jax_random(seed):
    _same(
        jax.random.key_data(jax.random.key(seed, impl=_threefry.IMPL)),
        jax.random.key_data(jax.random.key(seed)),
    )


def test_threefry2x32_known_answer():
    # Known-answer vectors of Threefry-2x32 with 20 rounds (Random123's kat_vectors)
    cases = [
        ((0x00000000, 0x00000000), (0x00000000, 0x00000000), (0x6B200159, 0x99BA4EFE)),
        ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
        ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
    ]
    for (k0, k1), (x0, x1), expected in cases:
        out = _threefry.threefry2x32(*(jnp.uint32(v) for v in (k0, k1, x0, x1)))
        assert tuple(int(o) for o in out) == expected


def test_fast_key_leaves_other_keys_alone():
    typed = jax.random.key(3)
    assert _threefry.fast_key(typed) is typed
    other = jnp.zeros(4, jnp.uint32)  # e.g. an rbg key's data
    assert _threefry.fast_key(other) is other
    with jax.threefry_partitionable(False):
        assert _threefry.fast_key(RAW) is RAW


def _model(xs, N):
    w = numpyro.sample("w", dist.Normal(0.0, 2.0).expand([3]).to_event(1))
    s = numpyro.sample("s", dist.Gamma(2.0, 2.0))
    with numpyro.plate("batch", N, subsample_size=xs.shape[0]):
        numpyro.sample("x", dist.Normal(xs[:, :3] @ w, s), obs=xs[:, 3])


def _guide(xs, N):
    loc = numpyro.param("loc", jnp.zeros(3))
    scale = numpyro.param("scale", jnp.ones(3), constraint=dist.constraints.positive)
    numpyro.sample("w", dist.Normal(loc, scale).to_event(1))
    a = numpyro.param("a", 2.0, constraint=dist.constraints.positive)
    numpyro.sample("s", dist.Gamma(a, 2.0))


@pytest.mark.parametrize("strategy", ["vmap", pytest.param("chunked", marks=pytest.mark.slow),
                                      pytest.param("ghost", marks=pytest.mark.slow)])
@pytest.mark.slow
def test_dpsvi_step_unchanged(monkeypatch, strategy):
    """A private step computes exactly what it computes with JAX's own
    Threefry lowering: same Monte Carlo draws, same parameters and loss."""
    xs = jax.random.normal(jax.random.PRNGKey(1), (10, 4))
    kwargs = dict(clipping_threshold=1.0, dp_scale=1.0, gradient_strategy=strategy, N=100)
    if strategy == "chunked":
        kwargs["chunk_size"] = 3  # with padding of the keys

    def step():
        svi = DPSVI(_model, _guide, numpyro.optim.Adam(0.1), Trace_ELBO(), **kwargs)
        state = svi.init(d3p.random.PRNGKey(5), xs)
        update = jax.jit(svi.update)  # compiled once, for both steps
        for _ in range(2):
            state, loss = update(state, xs)
        return svi.get_params(state), loss

    params, loss = step()
    monkeypatch.setattr(_threefry, "fast_key", lambda key: key)
    ref_params, ref_loss = step()
    for k in ref_params:
        np.testing.assert_allclose(params[k], ref_params[k], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)


class _TypedKeySuite:
    """The ChaCha20 suite, but handing NumPyro typed keys of JAX's ``rbg``
    (with the plain interface: a step converts one key and splits it)."""

    def __getattr__(self, name):
        if name.startswith("split_with_jax_key"):
            raise AttributeError(name)
        return getattr(d3p.random, name)

    @staticmethod
    def convert_to_jax_rng_key(key):
        data = d3p.random.random_bits(key, 32, (4,))
        return jax.random.wrap_key_data(data, impl="rbg")


# chunked (which pads the keys) in the default step; vmap, whose step with
# JAX's keys test_dpsvi_step_unchanged runs there, in the slow step
@pytest.mark.parametrize("strategy", [pytest.param("vmap", marks=pytest.mark.slow), "chunked"])
def test_dpsvi_with_typed_keys_from_the_suite(strategy):
    """A suite may hand out typed keys of any implementation: the records'
    keys keep it (also when chunks pad them), and the step runs."""
    xs = jax.random.normal(jax.random.PRNGKey(2), (7, 4))
    svi = DPSVI(
        _model, _guide, numpyro.optim.Adam(0.1), Trace_ELBO(), clipping_threshold=1.0,
        dp_scale=1.0, rng_suite=_TypedKeySuite(), gradient_strategy=strategy, chunk_size=3, N=50,
    )
    state = svi.init(d3p.random.PRNGKey(0), xs)
    state, loss = jax.jit(svi.update)(state, xs)
    assert np.isfinite(float(loss))
    assert all(np.all(np.isfinite(v)) for v in svi.get_params(state).values())


def test_same_values_as_jax_random_under_x64():
    with jax.enable_x64(True):
        raw = jax.random.PRNGKey(77)
        fast = _threefry.fast_key(raw)
        for draw in (DRAWS["split"], DRAWS["normal"], DRAWS["fold_in"], DRAWS["randint"]):
            _same(draw(fast), draw(raw))
        _same(
            jax.random.key_data(jax.random.key(np.int64(2**40 + 3), impl=_threefry.IMPL)),
            jax.random.key_data(jax.random.key(np.int64(2**40 + 3))),
        )


# ---------------------------------------------------------------------------
# computed once on CPU (d3p.random._common.in_two_halves)


@pytest.mark.parametrize("shape, axis, out_axis", [((7,), 0, 0), ((2,), 0, 0), ((5, 9), 1, 0), ((6, 3, 4), 0, 1)])
def test_in_two_halves_gives_the_values_of_the_function(shape, axis, out_axis):
    from d3p.random._common import in_two_halves

    x = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape) * 0.37 - 3.0

    def fn(v):   # maps each position along `axis` to the same position along `out_axis`: (sum, max) over the rest
        moved = jnp.moveaxis(v, axis, 0).reshape(v.shape[axis], -1)
        s, m = jnp.sin(moved).sum(1), moved.max(1)
        return jnp.moveaxis(jnp.stack([s, m], axis=1), 0, out_axis), jnp.moveaxis(jnp.stack([m], axis=1), 0, out_axis)

    for platform in ("cpu", "cuda"):
        text = jax.jit(lambda v: in_two_halves(fn, [v], axis=axis, out_axis=out_axis)).trace(x).lower(
            lowering_platforms=(platform,)).as_text()
        assert ("stablehlo.while" in text) == (platform == "cpu")   # the loop on CPU only
    got = jax.jit(lambda v: in_two_halves(fn, [v], axis=axis, out_axis=out_axis))(x)
    want = fn(x)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@cpu_default
def test_a_cpu_step_computes_its_monte_carlo_bits_once(monkeypatch):
    # the private step of the logistic regression, compiled for CPU: its
    # Threefry evaluations are computed once (in a loop of two halves); fused
    # freely, XLA copied each into the kernels that read it (866 xor against 499)
    import warnings

    from test_svi_platforms import _logreg

    def xor_count():
        dpsvi, batch = _logreg(np.random.default_rng(0))
        state = dpsvi.init(d3p.random.PRNGKey(0), *batch)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            text = jax.jit(lambda s, *b: dpsvi.update(s, *b)).lower(state, *batch).compile().as_text()
        return text.count(" xor(")

    once = xor_count()
    monkeypatch.setattr(_threefry, "in_two_halves", lambda fn, xs, **kwargs: fn(*xs))
    assert once < 0.7 * xor_count()
