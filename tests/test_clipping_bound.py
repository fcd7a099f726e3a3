"""The norm used for clipping bounds what is actually added, in floating point.

For every strategy and every record, the value that the strategy adds to the
clipped sum for that record (the sum with only that record real, all others
masked) must have L2 norm at most ``C``, computed exactly (float64) from the
float32 values returned; removing one record from a batch must move the sum
by at most ``C`` up to the rounding of the sum over the other records. The
records are adversarial: rows whose outer products cancel (where a Gram-form
ghost norm of rounded values can be far below the truth), magnitudes near
the overflow threshold and below the smallest normal number, mixed signs and
non-finite values. Also: the cancelling-rows construction end to end through
:class:`d3p.svi.DPSVI`, and the precision of every product on the clipping
path (XLA's default on GPUs is TF32, whose rounding would break the bound).
"""

import functools
import os

import conftest
import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax.extend import core as jex_core
from numpyro.infer import Trace_ELBO

import d3p.random
from d3p import gradients
from d3p.gradients import clip_gradient, clipped_grad_sum, total_norm
from d3p.svi import DPSVI

#: whether XLA:CPU compiles with its earlier emitters here (the default test step: tests/conftest.py)
_LEGACY_EMITTERS = conftest.LEGACY_EMITTERS_FLAG in os.environ.get("XLA_FLAGS", "").split()

# name -> (strategy, chunk_size)
STRATEGIES = {
    "vmap": ("vmap", None),
    "chunked": ("chunked", 3),
    "scan": ("scan", None),
    "ghost": ("ghost", None),
    "ghost_chunked": ("ghost", 3),
    "auto": ("auto", None),
}
HIGHEST = jax.lax.Precision.HIGHEST
# the margin of float32 sums documented in d3p.gradients: records are clipped
# to C (1 - ETA) (tests/test_sum_sensitivity.py checks the constant)
ETA = 2.0**-7


def _flat(tree):
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


# ---------------------------------------------------------------------------
# a loss whose per-record gradient is set directly by the record:
# ∂W = Σ_r x_r ⊗ d_r (a ghost leaf when R² <= n_in n_out), ∂b = e, ∂c = s
# ---------------------------------------------------------------------------


def bilinear_loss(params, record):
    x, d, e, s = record
    return jnp.sum((x @ params["W"]) * d) + jnp.sum(params["b"] * e) + params["c"] * s


def mlp_loss(params, record):
    x, y = record
    h = jnp.tanh(x @ params["W0"] + params["b0"])
    return jnp.sum((h @ params["W1"] + params["b1"] - y) ** 2)


def _bilinear_records(R=2, n_in=3, n_out=2):
    """(name, x, d, e, s) of adversarial records."""
    rng = np.random.default_rng(0)
    ones_in, ones_out = np.ones((R, n_in)), np.ones((R, n_out))
    out = []

    def add(name, x, d, e=None, s=0.0):
        e = np.zeros(n_out) if e is None else e
        f32 = lambda v: np.asarray(v, np.float32)  # noqa: E731
        out.append((name, f32(x), f32(d), f32(e), np.float32(s)))

    add("normal", rng.normal(size=(R, n_in)), rng.normal(size=(R, n_out)), rng.normal(size=n_out), 0.3)
    add("small", 1e-3 * rng.normal(size=(R, n_in)), rng.normal(size=(R, n_out)), 1e-4 * np.ones(n_out), 1e-4)
    if R > 1:
        # identical rows, outputs nearly opposite: ∂W nearly cancels
        d = 100.0 * ones_out
        d[1] = -100.0 + 1e-3
        add("cancel", 1e3 * ones_in, d, 1e-2 * np.ones(n_out))
        d = np.array([[100.0, 100.0], [-100.0, -100.0]])[:R, :n_out]
        add("exact cancel", 1e3 * ones_in, d)
        x = 1e3 * ones_in
        x[1] = -x[1]  # opposite rows, same output gradients
        add("cancel mixed signs", x, 100.0 * ones_out + np.arange(n_out) * 1e-3)
        x, d = np.zeros((R, n_in)), np.zeros((R, n_out))
        x[0], d[1] = 1e20, 1e20  # large rows that meet zeros
        add("misaligned", x, d, np.ones(n_out))
    add("huge", 1e19 * ones_in, 1e19 * ones_out * np.sign(rng.normal(size=(R, n_out))))
    add("huge times tiny", 1e30 * ones_in, 1e-28 * ones_out, 1e30 * np.ones(n_out))
    add("subnormal", 1e-40 * ones_in, 1e-40 * ones_out, 1e-41 * np.ones(n_out), 1e-42)
    add("subnormal times huge", 1e-40 * ones_in, 3e38 * ones_out)
    wide = lambda *shape: np.sign(rng.normal(size=shape)) * 10.0 ** rng.uniform(-30, 15, shape)  # noqa: E731
    add("wide range", wide(R, n_in), wide(R, n_out), wide(n_out))
    add("nan", np.full((R, n_in), np.nan), ones_out)
    add("inf", ones_in, np.full((R, n_out), np.inf))
    add("nan residual", ones_in, ones_out, np.array([np.nan] + [1.0] * (n_out - 1)))
    add("zero", np.zeros((R, n_in)), np.zeros((R, n_out)))
    names = [r[0] for r in out]
    records = tuple(jnp.asarray(np.stack([r[k] for r in out])) for k in range(1, 5))
    return names, records


def _bilinear_params(n_in=3, n_out=2):
    # float32 like the records, also under x64
    f32 = jnp.float32
    return {"W": jnp.zeros((n_in, n_out), f32), "b": jnp.zeros(n_out, f32), "c": jnp.zeros((), f32)}


def _mlp_case():
    rng = np.random.default_rng(1)
    params = {
        "W0": jnp.asarray(rng.normal(size=(4, 5)), jnp.float32),
        "b0": jnp.asarray(rng.normal(size=5) * 0.1, jnp.float32),
        "W1": jnp.asarray(rng.normal(size=(5, 2)), jnp.float32),
        "b1": jnp.zeros(2, jnp.float32),
    }
    x = rng.normal(size=(9, 4))
    y = rng.normal(size=(9, 2))
    x[1], y[1] = 1e18, -1e18  # huge inputs and targets
    x[2] = 1e-40  # subnormal inputs
    y[3] = 3e37  # near-overflow residuals
    x[4] = np.sign(rng.normal(size=4)) * 10.0 ** rng.uniform(-30, 30, 4)
    x[5, 0] = np.nan
    y[6, 1] = np.inf
    x[7] *= 1e-3
    return params, (jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32))


@functools.partial(jax.jit, static_argnames=("loss_fn", "strategy", "chunk_size"))
def _sum(loss_fn, params, records, mask, C, strategy, chunk_size):
    return clipped_grad_sum(loss_fn, params, records, mask, C, strategy=strategy, chunk_size=chunk_size)


def _contributions(loss_fn, params, records, C, name):
    """Per record: the sum with only that record real; the full sum; the sums
    with each record removed (masked out)."""
    strategy, chunk = STRATEGIES[name]
    B = jax.tree.leaves(records)[0].shape[0]
    eye = np.eye(B, dtype=bool)
    def run(m):
        return _flat(_sum(loss_fn, params, records, jnp.asarray(m), jnp.float32(C), strategy, chunk).grad_sum)

    alone = np.stack([run(eye[i]) for i in range(B)])
    full = run(np.ones(B, bool))
    removed = np.stack([run(~eye[i]) for i in range(B)])
    return alone, full, removed


def _check_bound(names, alone, full, removed, C, rows=1):
    # the threshold the strategies received is float32(C) (see _contributions),
    # a little above C = 1e-3: under x64 the float64 sums can come that close to it
    C = float(np.float32(C))
    del rows   # the rounding of the sum over the others is inside the margin, whatever the rows
    for i, name in enumerate(names):
        norm = np.linalg.norm(alone[i])
        assert np.all(np.isfinite(alone[i])), name
        assert norm <= C * (1 - ETA), f"record {name!r} contributes {norm / C!r} C"
        # removal: C, including the rounding of the sum over the others
        moved = np.linalg.norm(full - removed[i])
        assert moved <= C, f"removing {name!r} moves the sum by {moved / C!r} C"


@pytest.mark.parametrize("R", [1, 2])
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_record_contributes_at_most_C_bilinear(name, R):
    names, records = _bilinear_records(R=R)
    params = _bilinear_params()
    if name.startswith("ghost") or name == "auto":
        choice = gradients.choose_strategy(bilinear_loss, params, records, strategy=STRATEGIES[name][0])
        assert choice.ghost_params == 6
    for C in [1e-3, 1.0, 1e4]:
        alone, full, removed = _contributions(bilinear_loss, params, records, C, name)
        _check_bound(names, alone, full, removed, C, rows=R)
        # non-finite records contribute exactly zero
        for i, n in enumerate(names):
            if n in ("nan", "inf", "nan residual"):
                assert np.all(alone[i] == 0.0), n


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_record_contributes_at_most_C_mlp(name):
    params, records = _mlp_case()
    names = [str(i) for i in range(records[0].shape[0])]
    for C in [1e-2, 3.0]:
        alone, full, removed = _contributions(mlp_loss, params, records, C, name)
        _check_bound(names, alone, full, removed, C)


@pytest.mark.parametrize("R", [1, 2])
@pytest.mark.parametrize("name", [n for n in STRATEGIES if n != "vmap"])
def test_well_conditioned_records_match_vmap(name, R):
    """The bounds cost nothing measurable where rows do not cancel: each
    record's contribution equals the plain per-record clipping (vmap) to 1e-5.
    With two rows per product, rows do not cancel when their entries have
    the same signs (ghost clips by the norm of the rows' magnitudes)."""
    names, records = _bilinear_records(R=R)
    if R > 1:
        records = tuple(jnp.abs(x) for x in records)
    params = _bilinear_params()
    C = 1.0
    ref, _, _ = _contributions(bilinear_loss, params, records, C, "vmap")
    got, _, _ = _contributions(bilinear_loss, params, records, C, name)
    for i, n in enumerate(names):
        if n in ("normal", "small", "huge", "huge times tiny", "zero", "nan", "inf"):
            np.testing.assert_allclose(got[i], ref[i], rtol=1e-5, atol=1e-6 * C, err_msg=n)
    # the plain clip factor is applied: a clipped record sits just below C (1 - ETA)
    i = names.index("normal")
    assert C * (1 - ETA) * (1 - 1e-5) <= np.linalg.norm(got[i]) <= C * (1 - ETA)


def test_ghost_clips_rows_with_mixed_signs_by_their_magnitudes():
    """Two rows whose entries differ in sign: ghost clips by the norm of
    ``Σ_r |a_r| |δ_r|ᵀ`` (which also bounds the rounding the rows cause in
    the summed products), above the exact norm that vmap clips by, never
    below it."""
    x = np.array([[[1.0, -2.0, 0.5], [1.0, 2.0, -0.5]]], np.float32)
    d = np.array([[[3.0, 1.0], [3.0, -1.0]]], np.float32)
    records = (jnp.asarray(x), jnp.asarray(d), jnp.zeros((1, 2), jnp.float32), jnp.zeros((1,), jnp.float32))
    params = _bilinear_params()
    out = {s: _sum(bilinear_loss, params, records, jnp.ones(1, bool), jnp.float32(1.0), s, None)
           for s in ("vmap", "ghost")}
    x64, d64 = x[0].astype(np.float64), d[0].astype(np.float64)
    exact, magnitudes = np.linalg.norm(x64.T @ d64), np.linalg.norm(np.abs(x64).T @ np.abs(d64))
    assert magnitudes > 1.2 * exact
    np.testing.assert_allclose(float(out["vmap"].norms[0]), exact, rtol=1e-5)
    np.testing.assert_allclose(float(out["ghost"].norms[0]), magnitudes, rtol=1e-4)
    ghost_norm = np.linalg.norm(_flat(out["ghost"].grad_sum))
    assert ghost_norm <= (1 - ETA) and ghost_norm == pytest.approx((1 - ETA) * exact / magnitudes, rel=1e-4)


def test_cancelling_rows_are_not_underestimated():
    """One record, identical feature rows, output gradients that cancel: the exact
    ∂W has norm far above C; the ghost bound must not fall below it."""
    names, records = _bilinear_records(R=2)
    params = _bilinear_params()
    i = names.index("cancel")
    x, d = np.asarray(records[0][i], np.float64), np.asarray(records[1][i], np.float64)
    exact = np.linalg.norm(x.T @ d)
    mask = jnp.asarray(np.arange(len(names)) == i)
    out = _sum(bilinear_loss, params, records, mask, jnp.float32(1e-3), "ghost", None)
    assert float(out.norms[i]) >= exact
    assert np.linalg.norm(_flat(out.grad_sum)) <= 1e-3


# ---------------------------------------------------------------------------
# sums of squares, one record at a time
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "entries",
    [
        # many entries each below half an ulp of the running sum of squares
        lambda n: np.concatenate([[1.0], np.full(n - 1, np.sqrt(2.0**-25) * 0.999)]),
        lambda n: np.full(n, 1e30),
        lambda n: np.full(n, 1e-40),
        lambda n: np.concatenate([[3e38], np.full(n - 1, 1e-30)]),
        lambda n: np.random.default_rng(n).normal(size=n) * 10.0 ** np.random.default_rng(n).uniform(-40, 37, n),
    ],
)
def test_clip_gradient_bound_is_exact_in_float64(entries):
    for n in [3, 1000, 100_000]:
        g = np.asarray(entries(n), np.float32)
        grad = {"a": jnp.asarray(g[: n // 2]), "b": jnp.asarray(g[n // 2:])}
        exact = np.linalg.norm(g.astype(np.float64))
        norm = float(jax.jit(total_norm)(grad))
        assert norm >= exact * (1 - 1e-12) or exact < 1e-36
        assert norm <= exact * (1 + 1e-4) + 1e-36
        for C in [1e-30, 1e-3, 1.0, 1e30]:
            clipped, _ = jax.jit(clip_gradient)(grad, C)
            assert np.linalg.norm(_flat(clipped)) <= C


def test_clip_factor_never_rounds_above_C():
    """Scanning many norms just above C: the factor times the computed bound is
    below C in exact arithmetic, including the rounding of the product."""
    rng = np.random.default_rng(3)
    C = np.float32(0.7)
    bound = np.float32(C) * (1 + rng.uniform(0, 1e-5, 100_000)).astype(np.float32)
    bound = np.concatenate([bound, np.float32(C) * 10.0 ** rng.uniform(-3, 35, 10_000).astype(np.float32)])
    f = np.asarray(gradients._clip_factor(jnp.asarray(bound, jnp.float32), C), np.float64)
    # entries of one record scaled by f: each exact up to one rounding
    prod = (np.asarray(bound, np.float32) * np.asarray(f, np.float32)).astype(np.float64)
    assert np.all(prod * (1 + 2.0**-24) <= C)
    # and only just below it: the margin is a few units of roundoff
    above = bound > C
    assert np.all(f[above] > 0) and np.min(f[above] * bound[above] / C) > 1 - 1e-5
    assert np.all(f[bound * (1 + 1e-5) < C] == 1.0)


# ---------------------------------------------------------------------------
# an adversarial record whose ghost norm cancels, end to end through DPSVI
# ---------------------------------------------------------------------------


def ls_model(x, y, z, N):
    """Least squares with two feature rows per record: a dense weight (ghost
    leaf), a bias and a second coefficient (exact per-record gradients)."""
    W = numpyro.param("W", jnp.full((x.shape[-1], 1), 1.75e-6, jnp.float32))
    b = numpyro.param("b", jnp.zeros(1, jnp.float32))
    t = numpyro.param("t", jnp.zeros((), jnp.float32))
    with numpyro.plate("data", N, subsample_size=x.shape[0]):
        loc = x @ W + b + t * z[:, None, None]
        numpyro.sample("y", dist.Normal(loc, 1.0).to_event(2), obs=y)


def ls_guide(x, y, z, N):
    pass


def _ls_data(B=4, d=4):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(B, 2, d))
    y = rng.normal(size=(B, 2, 1))
    x[0] = 1e3  # two identical feature rows of magnitude 1e3
    y[0, 0], y[0, 1] = 100.0, -100.0  # targets ±100: the rows' gradients cancel
    z = rng.normal(size=B) * 0.01
    return [jnp.asarray(v, jnp.float32) for v in (x, y, z)]


@pytest.mark.parametrize("strategy", ["auto", "vmap"])
def test_dpsvi_released_step_moves_at_most_C_for_cancelling_rows(strategy):
    """dp_scale = 0 and SGD with step 1: the parameter change is the clipped sum
    (N = B, so the normalisation N/B is 1). Masking out the cancelling record
    must change it by at most C; by default (ghost norms for W) a Gram-form
    norm of the rounded rows let it through unclipped."""
    x, y, z = _ls_data()
    B = x.shape[0]
    C = 1.0
    svi = DPSVI(ls_model, ls_guide, numpyro.optim.SGD(1.0), Trace_ELBO(), clipping_threshold=C,
                dp_scale=0.0, gradient_strategy=strategy, N=B)
    state = svi.init(d3p.random.PRNGKey(0), x, y, z)
    before = _flat(svi.get_params(state))
    update = jax.jit(svi.update)
    steps = {}
    for label, mask in [("all", np.ones(B, bool)), ("without 0", np.arange(B) != 0)]:
        new_state, _ = update(state, x, y, z, mask=jnp.asarray(mask))
        steps[label] = before - _flat(svi.get_params(new_state))
    if strategy == "auto":
        assert svi.strategy_choice.strategy == "ghost"
    # the record's exact gradient is far larger than C, so it is clipped
    grad0 = jax.jit(jax.grad(lambda p: Trace_ELBO().loss(jax.random.PRNGKey(0), p, ls_model, ls_guide,
                                                          x[:1], y[:1], z[:1], N=1)))(svi.get_params(state))
    assert np.linalg.norm(_flat(grad0)) > 20 * C
    moved = np.linalg.norm(steps["all"] - steps["without 0"])
    assert moved <= C, f"one record moved the released step by {moved / C:.4g} C"


# ---------------------------------------------------------------------------
# products on the clipping path run at HIGHEST precision
# ---------------------------------------------------------------------------


def _dot_precisions(jaxpr):
    """Precision of every dot_general in a jaxpr, including nested ones."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(eqn.params.get("precision"))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(sub, jex_core.ClosedJaxpr):
                    found += _dot_precisions(sub.jaxpr)
                elif isinstance(sub, jex_core.Jaxpr):
                    found += _dot_precisions(sub)
    return found


def _is_highest(precision):
    if isinstance(precision, tuple):
        return all(p == HIGHEST for p in precision)
    return precision == HIGHEST


def rows_loss_highest(params, record):
    """Rows through two dense layers (ghost leaves with R > 1), a bias, all
    products of the loss itself at HIGHEST precision."""
    x, y = record  # x: (T, d_in)
    h = jnp.tanh(jnp.matmul(x, params["W"], precision=HIGHEST) + params["b"])
    out = jnp.matmul(h, params["V"], precision=HIGHEST)
    return jnp.sum((out - y) ** 2)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_product_on_the_clipping_path_is_highest_precision(name):
    """The loss's own products are HIGHEST here, so any other precision found in
    the traced step comes from the clipping path (Gram matrices, the clipped
    sum), which on a GPU at default precision would run in TF32."""
    rng = np.random.default_rng(2)
    params = {"W": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32), "b": jnp.zeros(4),
              "V": jnp.asarray(rng.normal(size=(4, 2)), jnp.float32)}
    records = tuple(jnp.asarray(rng.normal(size=(6, 2, k)), jnp.float32) for k in (3, 2))
    strategy, chunk = STRATEGIES[name]
    choices = []
    closed = jax.make_jaxpr(
        lambda p, r, m: clipped_grad_sum(rows_loss_highest, p, r, m, 1.0, strategy=strategy, chunk_size=chunk,
                                         on_choice=choices.append)
    )(params, records, jnp.ones(6, bool))
    precisions = _dot_precisions(closed.jaxpr)
    assert precisions  # the loss's products are there
    assert all(_is_highest(p) for p in precisions), precisions
    assert len(choices) == 1
    if name.startswith("ghost"):
        assert choices[0].ghost_params == 12 + 8
        # Gram matrices of both leaves (R = 2) and the clipped sums: our own products
        assert len(precisions) >= 6
    # the check has power: the same loss at default precision is flagged
    default = jax.make_jaxpr(lambda p, r: jax.vmap(jax.grad(
        lambda p, r: jnp.sum(r[0] @ p["W"])), in_axes=(None, 0))(p, r))(params, records)
    assert not all(_is_highest(p) for p in _dot_precisions(default.jaxpr))


def test_gram_bound_is_an_upper_bound_and_tight_without_cancellation():
    """Direct check of the ghost bound against float64: never below the exact
    norm of ``|A|ᵀ|D|`` of the float32 values (hence of ``AᵀD``); within
    1e-5 of it for a single row and 1e-4 for several; at most the triangle
    bound ``T``."""
    from d3p import _ghost

    rng = np.random.default_rng(4)
    cases = []
    for R, n_in, n_out in [(1, 7, 5), (3, 7, 5), (8, 16, 12)]:
        A = rng.normal(size=(20, R, n_in)) * 10.0 ** rng.uniform(-20, 20, (20, 1, 1))
        D = rng.normal(size=(20, R, n_out)) * 10.0 ** rng.uniform(-20, 15, (20, 1, 1))
        if R > 1:
            A[10:] = A[10:, :1]  # identical rows ...
            # ... whose output gradients nearly cancel
            D[10:, 1:] = -D[10:, :1] / (R - 1) * (1 + 1e-4 * rng.normal(size=(10, R - 1, 1)))
        cases.append((R, A.astype(np.float32), D.astype(np.float32)))
    gram_bound = jax.jit(_ghost.gram_bound)   # compiled: op by op costs more
    for R, A, D in cases:
        M, E = gram_bound(jnp.asarray(A), jnp.asarray(D))
        M = np.asarray(M, np.float64)
        A64, D64 = A.astype(np.float64), D.astype(np.float64)
        exact = np.linalg.norm(np.einsum("bri,bro->bio", A64, D64), axis=(1, 2))
        magnitudes = np.linalg.norm(np.einsum("bri,bro->bio", np.abs(A64), np.abs(D64)), axis=(1, 2))
        assert np.all(M >= magnitudes), (R, M / magnitudes)
        triangle = np.sum(np.linalg.norm(A64, axis=2) * np.linalg.norm(D64, axis=2), axis=1)
        assert np.all(M >= exact), (R, M / exact)
        assert np.all(M <= triangle * (1 + 1e-5) + 1e-30)
        # the absolute part: values flushed below the smallest normal number
        n_in, n_out = A.shape[2], D.shape[2]
        sum_d = np.sum(np.linalg.norm(D64, axis=2), axis=1)
        tiny = float(jnp.finfo(jnp.float32).tiny)
        assert np.all(np.asarray(E) <= 4 * tiny * (np.sqrt(n_in) * sum_d + R * np.sqrt(n_in * n_out) + 2))
        np.testing.assert_allclose(M, magnitudes, rtol=1e-5 if R == 1 else 1e-4)
        if R == 1:
            np.testing.assert_allclose(M, exact, rtol=1e-5)


def test_stacked_ghost_bounds_are_each_leafs_own_bit_for_bit():
    """The dense (one-row) leaves' bounds computed stacked (``_gram_bounds``)
    are those of each leaf alone (``gram_bound``), bit for bit, with leaves
    of other widths, a leaf of several rows in between (its own entry), a
    record with a non-finite entry (``inf`` bounds) and one of zeros; a
    float64 leaf makes an entry of its own. Power: the stacked leaves' own
    bounds differ from each other, so a row given to the wrong leaf fails.

    Bit for bit where XLA:CPU compiles with its default emitters (every CI
    step but the default one); under the earlier emitters of the default step
    (``tests/conftest.py``) XLA may sum a row in another order in the stacked
    program than alone, and the bounds, valid for any order, agree within
    2 units in the last place (seen: 1, a leaf of 30 inputs)."""
    from d3p import _ghost

    rng = np.random.default_rng(12)

    def rows(R, n_in, n_out, dtype=np.float32):
        A = rng.normal(size=(6, R, n_in)) * 10.0 ** rng.uniform(-30, 20, (6, 1, 1))
        D = rng.normal(size=(6, R, n_out)) * 10.0 ** rng.uniform(-30, 10, (6, 1, 1))
        A[2] = 0.0
        D[4, 0, 0] = np.inf
        return jnp.asarray(A.astype(dtype)), jnp.asarray(D.astype(dtype))

    with jax.enable_x64(True):
        leaves = [rows(1, 7, 5), rows(3, 4, 2), rows(1, 30, 2), rows(1, 2, 40), rows(1, 3, 3, np.float64)]
        ids = []

        def stacked(leaves):   # the leaves of each entry found while tracing
            bounds, _ = _ghost._gram_bounds(leaves)
            ids.extend(tuple(leaf_ids) for leaf_ids, _, _ in bounds)
            return [(M, E) for _, M, E in bounds]

        outs = jax.jit(stacked)(leaves)
        entries = dict(zip(ids, outs))
        alone = [jax.jit(_ghost.gram_bound)(A, D) for A, D in leaves]
    assert sorted(entries) == [(0, 2, 3), (1,), (4,)]
    for ids, (M, E) in entries.items():
        for i, leaf in enumerate(ids):
            got = (M[i], E[i]) if M.ndim == 2 else (M, E)
            for have, want in zip(got, alone[leaf]):
                if _LEGACY_EMITTERS:
                    np.testing.assert_array_max_ulp(np.asarray(have), np.asarray(want), maxulp=2)
                else:
                    assert np.asarray(have).tobytes() == np.asarray(want).tobytes(), leaf
    M, E = entries[(0, 2, 3)]
    assert np.all(np.isinf(np.asarray(M)[:, 4])) and np.all(np.isfinite(np.asarray(M)[:, :4]))
    for a, b in [(0, 2), (2, 3), (0, 3)]:
        assert not np.array_equal(np.asarray(alone[a][0]), np.asarray(alone[b][0]))
        assert not np.array_equal(np.asarray(alone[a][1]), np.asarray(alone[b][1]))


def test_a_constant_zero_gradient_keeps_the_records():
    """A ghost leaf whose output gradient XLA folds to a constant zero (its
    product multiplied by 0.0): the records keep finite bounds and the other
    leaf's clipped sum is released, as ``vmap`` releases it. Before, the
    power of two that scaled the zeros folded into ``nan`` in the squares
    (not at run time: only as constants), every bound was ``inf`` and every
    record was dropped."""
    def loss(params, record):
        return jnp.sum(params["b"] * record) + 0.0 * jnp.sum(record[None, :] @ params["W"])

    params = {"W": jnp.zeros((2, 1), jnp.float32), "b": jnp.zeros((2,), jnp.float32)}
    records = jnp.array([[0.3, 0.4], [0.1, -0.2], [5.0, 0.0]], jnp.float32)
    run = jax.jit(lambda r: clipped_grad_sum(loss, params, r, None, 1.0, strategy="ghost"))
    got = run(records)
    assert np.all(np.isfinite(np.asarray(got.norms)))
    np.testing.assert_allclose(np.asarray(got.norms), [0.5, np.sqrt(0.05), 5.0], rtol=1e-5)
    want = clipped_grad_sum(loss, params, records, None, 1.0, strategy="vmap").grad_sum
    np.testing.assert_allclose(np.asarray(got.grad_sum["b"]), np.asarray(want["b"]), rtol=1e-5)
    assert np.asarray(got.grad_sum["b"])[0] > 1.0   # not dropped
    # the primitive itself: the bound of constant zeros is finite, also compiled
    zero_bound = jax.jit(lambda: gradients._norm_bound(jnp.zeros((3, 1), jnp.float32)))()
    assert np.all(np.isfinite(np.asarray(zero_bound))) and np.all(np.asarray(zero_bound) < 1e-18)


def test_joined_norm_bounds_are_each_arrays_own():
    """``_norm_bounds`` (the scaling and allowances of several arrays' slices
    computed once, as the ghost strategy bounds its rows and residual leaves)
    gives each array's own ``_norm_bound``, compiled, on slices of mixed
    magnitudes (near overflow, below the smallest normal number, zeros,
    non-finite entries) and sizes (a long slice summed in two levels), and
    never less than the exact norm."""
    rng = np.random.default_rng(7)
    tiny = float(np.finfo(np.float32).tiny)
    xs = [
        (rng.normal(size=(5, 3, 7)) * 10.0 ** rng.uniform(-30, 30, (5, 3, 1))).astype(np.float32),
        np.concatenate([np.zeros((1, 1500)), np.full((1, 1500), 3e36), rng.normal(size=(2, 1500)) * tiny,
                        rng.normal(size=(1, 1500))]).astype(np.float32),
        np.array([[np.nan, 1.0], [np.inf, 0.0], [0.0, 0.0], [-2.0, 1e-40]], np.float32),
        np.zeros((0, 4), np.float32),
    ]
    joined = jax.jit(lambda xs: gradients._norm_bounds(xs))(xs)
    for x, got in zip(xs, joined):
        alone = jax.jit(gradients._norm_bound)(x)
        np.testing.assert_allclose(np.asarray(got), np.asarray(alone), rtol=2e-7)
        with np.errstate(over="ignore", invalid="ignore"):   # inf entries: an inf norm
            exact = np.linalg.norm(np.nan_to_num(x.astype(np.float64), nan=np.inf), axis=-1)
        assert np.all((np.asarray(got, np.float64) >= exact * (1 - 1e-12)) | (exact < 1e-36))
    assert np.isinf(np.asarray(joined[2])[:2]).all() and np.asarray(joined[2])[2] == 0.0


def test_two_level_sums_stay_two_reductions_after_compilation():
    """The error bound of a long sum of squares relies on two separate levels
    of about sqrt(n) terms; without the optimization barrier XLA merges them
    into one reduction of unknown order (error bound n u instead of 2 sqrt(n) u)."""
    n = 5000
    x = jnp.ones((4, n))
    total, depth = gradients._blocked_sum(x, 1)
    assert depth < 2 * np.sqrt(n) + 2 and float(total[0]) == n
    hlo = jax.jit(lambda x: gradients._blocked_sum(x * x, 1)[0]).lower(x).compile().as_text()
    reduces = [line for line in hlo.splitlines() if " reduce(" in line]
    assert len(reduces) == 2, reduces
