"""ADADP (Koskela & Honkela, AISTATS 2020): the step pairs computed by hand on a
deterministic quadratic, the adaptation of η to the gradient noise the paper
describes, argument validation, and use with DPSVI."""

import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import lax
from jax.example_libraries import optimizers as jax_optimizers
from numpyro.infer import Trace_ELBO
from numpyro.infer.autoguide import AutoDiagonalNormal

import d3p.random
from d3p.optimizers import ADADP, ADADPState, adadp
from d3p.svi import DPSVI

# f(x) = 0.5 * sum(C * x**2): gradient C * x
C = np.array([1.0, 3.0])
X0 = np.array([1.0, -2.0])
LR = 0.1


def grad(x):
    return C * np.asarray(x, np.float64)


def reference_pair(x0, lr, tol, stability_check, alpha_min=0.9, alpha_max=1.1):
    """One pair of ADADP steps on the quadratic, written out in float64."""
    g0 = grad(x0)
    x_full = x0 - lr * g0
    x_half = x0 - lr / 2 * g0
    g1 = grad(x_half)
    x2 = x_half - lr / 2 * g1
    err = math.sqrt(sum(((f - s) / max(1.0, abs(f))) ** 2 for f, s in zip(x_full, x2)))
    factor = min(max(math.sqrt(tol / err), alpha_min), alpha_max)
    x_end = x0 if (stability_check and err > tol) else x2
    return x_half, x2, err, lr * factor, x_end


def run_pair(opt, x0):
    state = opt.init(jnp.asarray(x0, jnp.float32))
    state = opt.update(jnp.asarray(grad(opt.get_params(state)), jnp.float32), state)
    half = np.asarray(opt.get_params(state))
    state = opt.update(jnp.asarray(grad(opt.get_params(state)), jnp.float32), state)
    return half, state


def test_first_pair_by_hand():
    # x_full = [0.9, -1.4], x_half = [0.95, -1.7], x2 = [0.9025, -1.445]
    half, x2, err, new_lr, x_end = reference_pair(X0, LR, tol=1.0, stability_check=True)
    np.testing.assert_allclose(half, [0.95, -1.7])
    np.testing.assert_allclose(x2, [0.9025, -1.445])
    assert err == pytest.approx(math.hypot(0.0025, 0.045 / 1.4))  # divided by max(1, |x_full|)
    assert new_lr == pytest.approx(LR * 1.1)  # sqrt(1 / 0.032) = 5.6, capped at alpha_max

    got_half, state = run_pair(ADADP(LR), X0)
    np.testing.assert_allclose(got_half, half, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(state[1].x), x2, rtol=1e-6)
    assert float(state[1].lr) == pytest.approx(new_lr, rel=1e-6)
    assert int(state[0]) == 2


def test_eta_capped_below_and_pair_rejected():
    tol = 1e-4  # sqrt(tol / err) = 0.056, capped at alpha_min; err > tol
    _, x2, err, new_lr, x_end = reference_pair(X0, LR, tol=tol, stability_check=True)
    assert err > tol and new_lr == pytest.approx(LR * 0.9)
    np.testing.assert_array_equal(x_end, X0)
    _, state = run_pair(ADADP(LR, tol=tol), X0)
    np.testing.assert_array_equal(np.asarray(state[1].x), np.asarray(X0, np.float32))  # back to x_prev
    assert float(state[1].lr) == pytest.approx(LR * 0.9, rel=1e-6)

    # the same pair is kept without the stability check; η shrinks all the same
    _, state = run_pair(ADADP(LR, tol=tol, stability_check=False), X0)
    np.testing.assert_allclose(np.asarray(state[1].x), x2, rtol=1e-6)
    assert float(state[1].lr) == pytest.approx(LR * 0.9, rel=1e-6)


@pytest.mark.parametrize("ratio", [1.05**2, 0.95**2])
def test_eta_factor_between_the_caps(ratio):
    err = reference_pair(X0, LR, tol=1.0, stability_check=True)[2]
    tol = ratio * err  # factor sqrt(tol / err) = 1.05 or 0.95: not capped
    _, x2, _, new_lr, x_end = reference_pair(X0, LR, tol=tol, stability_check=True)
    assert new_lr == pytest.approx(LR * math.sqrt(ratio))
    _, state = run_pair(ADADP(LR, tol=tol), X0)
    assert float(state[1].lr) == pytest.approx(new_lr, rel=1e-5)
    # err > tol (ratio < 1) rejects the pair, err <= tol keeps it
    np.testing.assert_allclose(np.asarray(state[1].x), X0 if ratio < 1 else x2, rtol=1e-6)


def test_pytree_params_share_one_error():
    """The error norm runs over all leaves together, not per leaf."""
    opt = ADADP(LR, tol=1.0)
    params = {"a": jnp.array([1.0]), "b": jnp.array([-2.0])}
    state = opt.init(params)
    for _ in range(2):
        p = opt.get_params(state)
        g = {"a": 1.0 * p["a"], "b": 3.0 * p["b"]}
        state = opt.update(g, state)
    x2 = reference_pair(X0, LR, tol=1.0, stability_check=True)[1]
    np.testing.assert_allclose(np.concatenate([state[1].x["a"], state[1].x["b"]]), x2, rtol=1e-6)
    assert float(state[1].lr) == pytest.approx(LR * 1.1, rel=1e-6)


def test_zero_error_grows_eta_and_triple_matches_class():
    triple = adadp(step_size=0.5)
    assert isinstance(triple, jax_optimizers.Optimizer)  # accepted wherever such triples are
    init, update, get_params = triple
    state = init(jnp.zeros(3))
    for i in range(6):  # zero gradient: x never moves, err = 0, η *= alpha_max per pair
        state = update(i, jnp.zeros(3), state)
    assert isinstance(state, ADADPState)
    assert float(state.lr) == pytest.approx(0.5 * 1.1**3, rel=1e-6)
    np.testing.assert_array_equal(get_params(state), np.zeros(3))


def test_schedule_gives_initial_step_size_and_defaults():
    state = ADADP(lambda i: 0.25 + 0 * i).init(jnp.zeros(2))
    assert float(state[1].lr) == pytest.approx(0.25)
    assert float(ADADP().init(jnp.zeros(2))[1].lr) == pytest.approx(1e-3)
    params = inspect.signature(adadp).parameters
    assert [(n, p.default) for n, p in params.items()] == [
        ("step_size", 1e-3), ("tol", 1.0), ("stability_check", True), ("alpha_min", 0.9), ("alpha_max", 1.1),
    ]


def _eta_trajectory(sigma, num_pairs, tol=0.01, dim=10, lr=0.01, seed=0):
    """η after each pair when every gradient is the quadratic's (C=1) plus N(0, sigma^2) noise."""
    opt = ADADP(lr, tol=tol)
    noise = sigma * jax.random.normal(jax.random.PRNGKey(seed), (2 * num_pairs, dim))

    def step(state, g_noise):
        state = opt.update(opt.get_params(state) + g_noise, state)
        return state, state[1].lr

    _, lrs = lax.scan(step, opt.init(jnp.full(dim, 0.1)), noise)
    return np.asarray(lrs[1::2])


def test_eta_shrinks_with_large_noise_and_grows_with_small():
    noisy = _eta_trajectory(sigma=100.0, num_pairs=20)
    assert noisy[-1] < 0.01 * 0.9**15  # err >> tol: alpha_min nearly every pair
    quiet = _eta_trajectory(sigma=0.0, num_pairs=20)
    assert quiet[-1] == pytest.approx(0.01 * 1.1**20, rel=1e-4)  # err << tol: alpha_max every pair


def test_eta_settles_inversely_proportional_to_noise():
    """The paper's aim: η settles where the pair error is about tol. The error of
    a pair is about (η/2)·σ·sqrt(2d), so the settled η is proportional to 1/σ."""
    tol, dim = 0.01, 10
    settled = {}
    for sigma in (1.0, 4.0):
        lrs = _eta_trajectory(sigma=sigma, num_pairs=400, tol=tol, dim=dim)
        settled[sigma] = float(np.exp(np.mean(np.log(lrs[100:]))))
        predicted = 2 * tol / (sigma * math.sqrt(2 * dim))
        assert 0.5 * predicted < settled[sigma] < 2 * predicted, (sigma, settled[sigma], predicted)
    assert 3.0 < settled[1.0] / settled[4.0] < 5.3


def test_update_is_deterministic_and_jittable():
    opt = ADADP(0.1, tol=0.01)
    state = opt.init({"w": jnp.arange(3.0)})
    g = {"w": jnp.array([0.3, -1.0, 2.0])}
    jitted = jax.jit(opt.update)
    s1 = jitted(g, jitted(g, state))
    s2 = opt.update(g, opt.update(g, state))
    for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(step_size=0.0), ValueError, "step_size"),
        (dict(step_size="big"), TypeError, "step_size"),
        (dict(step_size=math.inf), ValueError, "step_size"),
        (dict(tol=-1.0), ValueError, "tol"),
        (dict(tol=math.nan), ValueError, "tol"),
        (dict(stability_check=1), TypeError, "stability_check"),
        (dict(alpha_min=0.0), ValueError, "alpha_min"),
        (dict(alpha_min=1.2), ValueError, "alpha_min"),
        (dict(alpha_max=0.8), ValueError, "alpha_max"),
        (dict(alpha_max=math.inf), ValueError, "alpha_max"),
    ],
)
def test_validation_names_the_argument(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        ADADP(**kwargs)
    with pytest.raises(exc, match=match):
        adadp(**kwargs)


def normal_model(xs, N):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("data", N, subsample_size=xs.shape[0]):
        numpyro.sample("x", dist.Normal(mu, 1.0), obs=xs)


@pytest.mark.float32
@pytest.mark.slow
def test_dpsvi_with_adadp():
    xs = (3.0 + np.random.default_rng(0).standard_normal(100)).astype(np.float32)
    guide = AutoDiagonalNormal(normal_model)
    svi = DPSVI(normal_model, guide, ADADP(0.01, tol=0.1), Trace_ELBO(),
                clipping_threshold=5.0, dp_scale=0.3, N=100)
    # run: each of its steps is one private step of the optimizer, and the fit reaches the
    # data's mean from its initial point in (-2, 2) (one compilation; update is run's step,
    # see test_svi_compat.py)
    result = svi.run(d3p.random.PRNGKey(1), 400, xs, batch_size=10, progress_bar=False)
    assert int(result.state.optim_state[0]) == 400
    assert np.all(np.isfinite(np.asarray(result.losses)))
    assert all(np.all(np.isfinite(np.asarray(v))) for v in jax.tree.leaves(result.params))
    assert abs(float(result.params["auto_loc"][0]) - float(xs.mean())) < 1.0
