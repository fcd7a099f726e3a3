"""Every per-record gradient strategy computes the same clipped sum.

The reference is ``strategy="vmap"`` (all per-record gradients at once, each
clipped by :func:`d3p.gradients.clip_gradient`; hand-checked in
``test_gradients.py``). Each other strategy must agree with it to 1e-5
relative on the paper's three benchmark models (small versions), on models
whose parameters are used in several places, with masks, non-finite records
and empty batches, and must leave the noise and the privacy bound unchanged.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer import Trace_ELBO

import d3p.random
from d3p import _clipping, _ghost, _strategies, gradients
from d3p._paper_models import (
    hierarchical_logistic_regression_guide,
    hierarchical_logistic_regression_model,
    logistic_regression_guide,
    logistic_regression_model,
    make_vae,
)
from d3p.gradients import STRATEGIES, choose_strategy, clipped_grad_sum
from d3p.svi import DPSVI

from _backend import cpu_default

RTOL = 1e-5
# the margin of float32 sums documented in d3p.gradients: records are clipped to C (1 - ETA)
ETA = 2.0**-7
# strategy name -> (strategy, chunk_size) as passed to clipped_grad_sum
VARIANTS = {
    "auto": ("auto", None),
    "chunked3": ("chunked", 3),
    "scan": ("scan", None),
    "ghost": ("ghost", None),
    "ghost_chunked3": ("ghost", 3),
}


def _flat(tree):
    leaves = [np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)]
    return np.concatenate(leaves) if leaves else np.zeros(0)


def assert_same_sum(got, ref, rtol=RTOL, atol_rel=RTOL):
    """Equal to ``rtol`` per entry, with an absolute floor relative to the sum's scale."""
    a, b = _flat(got.grad_sum), _flat(ref.grad_sum)
    assert np.all(np.isfinite(a))
    scale = max(np.max(np.abs(b)), 1e-30)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol_rel * scale)
    np.testing.assert_allclose(np.asarray(got.norms), np.asarray(ref.norms), rtol=10 * rtol, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got.losses), np.asarray(ref.losses), rtol=rtol, atol=1e-6)


@functools.partial(jax.jit, static_argnames=("loss_fn", "variants", "forward_mode"))
def _all_jit(loss_fn, params, records, mask, C, variants, forward_mode=False):
    out = {}
    for name in ("vmap",) + variants:
        strategy, chunk = VARIANTS.get(name, (name, None))
        out[name] = clipped_grad_sum(
            loss_fn, params, records, mask, C, strategy=strategy, chunk_size=chunk, forward_mode=forward_mode
        )
    return out


def all_strategies(loss_fn, params, records, mask, C, variants=tuple(VARIANTS)):
    """Clipped sums of the reference and every variant, in one jit (shared
    between tests: same loss, shapes and variants compile once)."""
    B = jax.tree.leaves(records)[0].shape[0]
    mask = jnp.ones((B,), bool) if mask is None else mask
    return _all_jit(loss_fn, params, records, mask, jnp.float32(C), tuple(variants))


def check_all(loss_fn, params, records, mask, C, variants=tuple(VARIANTS)):
    out = all_strategies(loss_fn, params, records, mask, C, variants)
    for name in variants:
        try:
            assert_same_sum(out[name], out["vmap"])
        except AssertionError as err:
            raise AssertionError(f"strategy {name} differs from vmap: {err}") from None
    return out


def ghost_leaves(loss_fn, params, records):
    plan, _, _ = _ghost.trace_plan(loss_fn, params, records)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    return {paths[i] for i in plan.ghost_leaves}


# ---------------------------------------------------------------------------
# plain JAX models with parameters used in several ways
# ---------------------------------------------------------------------------


def _mlp_params(rng, sizes, scale=1.0):
    params = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        params[f"W{i}"] = jnp.asarray(rng.normal(size=(a, b)) * scale / np.sqrt(a), jnp.float32)
        params[f"b{i}"] = jnp.asarray(rng.normal(size=(b,)) * 0.1, jnp.float32)
    return params


def mlp_loss(params, record):
    x, y = record
    h = x
    n = len([k for k in params if k.startswith("W")])
    for i in range(n):
        h = h @ params[f"W{i}"] + params[f"b{i}"]
        if i < n - 1:
            h = jax.nn.relu(h)
    return jnp.sum((h - y) ** 2)


def two_dots_loss(params, record):
    """W in two products with the same layout (and a leaf used in a jitted helper)."""
    x, y = record
    h = jnp.tanh(x @ params["W"])
    g = jnp.tanh(h @ params["W"])  # W square: used twice, same layout
    return jnp.sum((_jitted_head(g, params["V"]) - y) ** 2)


@jax.jit
def _jitted_head(g, V):
    return jnp.einsum("i,ij->j", g, V)


def dot_and_elementwise_loss(params, record):
    """W in a product and elementwise (a penalty and a gate): not ghost."""
    x, y = record
    h = x @ params["W"]
    gate = jnp.sum(params["W"] ** 2) * 0.01
    return jnp.sum((h * (1 + gate) - y) ** 2) + jnp.sum(params["U"].T @ x)


def transposed_and_sides_loss(params, record):
    """A view (transpose + reshape) of a leaf in a product; a leaf used as lhs and rhs."""
    x, y = record
    Wt = params["Wt"].T  # stored (out, in)
    h = x @ Wt.reshape(Wt.shape)
    S = params["S"]  # square, used as lhs and as rhs: two layouts, not ghost
    z = S @ h + h @ S
    return jnp.sum((z - y) ** 2)


def rows_loss(params, record):
    """Each record is a matrix of rows (a short sequence): the Gram-matrix path,
    a custom_jvp activation and a product with batch dimensions."""
    x, y = record  # x: (T, d_in)
    h = jax.nn.gelu(x @ params["W"] + params["b"])  # (T, hidden)
    att = jnp.einsum("th,sh->ts", h, h)  # no parameter: fine
    pooled = jnp.mean(att @ h, axis=0)
    out = pooled @ params["V"]
    per_row = jnp.einsum("th,h->t", h, params["v"])  # v as rhs with free dims on x only
    return jnp.sum((out - y) ** 2) + 0.1 * jnp.sum(per_row**2)


def control_flow_loss(params, record):
    """A parameter inside lax.scan and a custom_jvp call: those leaves fall back."""
    x, y = record

    def step(h, _):
        return jnp.tanh(h @ params["R"]), None

    h, _ = jax.lax.scan(step, x @ params["W"], None, length=2)
    return jnp.sum((jax.nn.softplus(h) - y) ** 2)



def low_rank_loss(params, record):
    """A product of two parameters (U @ V) applied to the record: both are ghost
    leaves of the same product, whose output gradient serves both."""
    x, y = record
    return jnp.sum((x @ (params["U"] @ params["V"]) + params["c"] - y) ** 2)


#: The layer sizes of the MLP of _mlp_case and of PLAIN_CASES["mlp"] (two hidden layers).
MLP_SIZES = [5, 8, 6, 3]


def _records(rng, B, d_in, d_out, rows=None, scale=1.0):
    shape = (B, d_in) if rows is None else (B, rows, d_in)
    x = jnp.asarray(rng.normal(size=shape) * scale, jnp.float32)
    y = jnp.asarray(rng.normal(size=(B, d_out)), jnp.float32)
    return x, y


def _normal_params(**leaves):
    """``params(rng)``: float32 standard normal leaves, drawn in the order given;
    each leaf is ``name=shape`` or ``name=(shape, scale)``."""
    def make(rng):
        params = {}
        for name, spec in leaves.items():
            shape, scale = spec if isinstance(spec[0], tuple) else (spec, None)
            x = rng.normal(size=shape)
            params[name] = jnp.asarray(x if scale is None else x * scale, jnp.float32)
        return params
    return make


PLAIN_CASES = {
    # name: (loss, params(rng), records(rng), expected ghost leaves)
    "mlp": (
        mlp_loss,
        # the shapes of _mlp_case: the tests below reuse this compiled program
        lambda r: _mlp_params(r, MLP_SIZES, scale=2.0),
        lambda r: _records(r, 10, MLP_SIZES[0], MLP_SIZES[-1], scale=3.0),
        {"['W0']", "['W1']", "['W2']"},
    ),
    "two_dots": (two_dots_loss, _normal_params(W=(5, 5), V=(5, 2)),
                 lambda r: _records(r, 9, 5, 2), {"['W']", "['V']"}),
    "dot_and_elementwise": (dot_and_elementwise_loss, _normal_params(W=(4, 3), U=(4, 2)),
                            lambda r: _records(r, 10, 4, 3), {"['U']"}),
    "transposed_and_sides": (transposed_and_sides_loss, _normal_params(Wt=(4, 4), S=((4, 4), 0.5)),
                             lambda r: _records(r, 7, 4, 4), {"['Wt']"}),
    "rows": (rows_loss,
             _normal_params(W=((6, 7), 0.4), b=((7,), 0.1), V=((7, 2), 0.4), v=((7,), 0.4)),
             lambda r: _records(r, 6, 6, 2, rows=2), {"['W']", "['V']", "['v']"}),
    "control_flow": (control_flow_loss, _normal_params(W=(4, 3), R=((3, 3), 0.5)),
                     lambda r: _records(r, 8, 4, 3), {"['W']"}),
    "low_rank": (low_rank_loss, _normal_params(U=((4, 8), 0.5), V=((8, 4), 0.5), c=(4,)),
                 lambda r: _records(r, 8, 4, 4), {"['U']", "['V']"}),
}


@pytest.mark.parametrize("case", list(PLAIN_CASES))
def test_plain_models_all_strategies_agree(case):
    loss, make_params, make_records, expected_ghost = PLAIN_CASES[case]
    rng = np.random.default_rng(len(case))
    params, records = make_params(rng), make_records(rng)
    assert ghost_leaves(loss, params, records) == expected_ghost
    B = records[0].shape[0]
    mask = jnp.asarray(np.arange(B) % 4 != 1)  # some padded records
    # chunking and scanning do not depend on the structure: checked on the MLP
    variants = tuple(VARIANTS) if case == "mlp" else ("ghost",)
    # a threshold that clips some records and not others; the reference's norms
    # do not depend on C, an argument of the compiled program the checks reuse
    norms = np.asarray(all_strategies(loss, params, records, mask, 1.0, variants)["vmap"].norms)
    C = float(np.median(norms[np.asarray(mask)]))
    if gradients._ghost_rows(_ghost.trace_plan(loss, params, records)) == 1:
        check_all(loss, params, records, mask, C, variants)
        return
    # several rows per product: ghost clips by the norm of the rows' magnitudes,
    # never below the exact norm; where nothing is clipped, the same sum
    out = all_strategies(loss, params, records, mask, C, variants)
    assert np.all(np.asarray(out["ghost"].norms) >= np.asarray(out["vmap"].norms) * (1 - 1e-5))
    assert np.any(np.asarray(out["ghost"].norms) > np.asarray(out["vmap"].norms) * 1.01)
    big_C = 1e3 * float(np.max(norms))
    unclipped = all_strategies(loss, params, records, mask, big_C, variants)
    a, b = _flat(unclipped["ghost"].grad_sum), _flat(unclipped["vmap"].grad_sum)
    # vmap sums on the fixed-point grid (spacing at most 2^-27 C per record entry)
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=RTOL * np.max(np.abs(b)) + B * 2.0**-27 * big_C)


def test_ghost_sum_matches_hand_computed_clipped_outer_products():
    """One dense layer, no bias: ∂W = x δᵀ with δ = 2 (xW - y), by hand in float64."""
    rng = np.random.default_rng(0)
    W = rng.normal(size=(3, 2))
    xs, ys = rng.normal(size=(6, 3)) * [[1], [10], [0.1], [3], [1], [5]], rng.normal(size=(6, 2))
    C = 2.0
    expected = np.zeros_like(W)
    for x, y in zip(xs, ys):
        g = np.outer(x, 2 * (x @ W - y))
        expected += g * min(1.0, C * (1 - ETA) / np.linalg.norm(g))

    def loss(p, r):
        x, y = r
        return jnp.sum((x @ p["W"] - y) ** 2)

    got = jax.jit(lambda p, r: clipped_grad_sum(loss, p, r, None, C, strategy="ghost"))(
        {"W": jnp.asarray(W, jnp.float32)}, (jnp.asarray(xs, jnp.float32), jnp.asarray(ys, jnp.float32))
    )
    np.testing.assert_allclose(got.grad_sum["W"], expected, rtol=2e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# masks, non-finite records, empty batches, sensitivity
# ---------------------------------------------------------------------------


def _mlp_case(seed=0, B=10):
    """An MLP and ``B`` records; for ``B = 10`` the tests share one compiled
    program of all strategies (:func:`all_strategies`, with C and the mask as
    arguments)."""
    rng = np.random.default_rng(seed)
    return _mlp_params(rng, MLP_SIZES, scale=2.0), _records(rng, B, MLP_SIZES[0], MLP_SIZES[-1], scale=2.0)


def test_nan_and_inf_records_contribute_zero_in_every_strategy():
    params, (x, y) = _mlp_case()
    # reference: only the six clean records (a masked record counts as removed, tested below)
    clean = all_strategies(mlp_loss, params, (x, y), jnp.arange(10) < 6, 1.0)
    x_bad = np.asarray(x).copy()
    y_bad = np.asarray(y).copy()
    x_bad[6] = np.nan  # a record with nan data: loss and gradient nan
    x_bad[7, 2] = np.inf
    y_bad[8] = np.nan
    x_bad[9] = np.nan  # a padded record with garbage
    mask = jnp.asarray([True] * 9 + [False])
    out = all_strategies(mlp_loss, params, (jnp.asarray(x_bad), jnp.asarray(y_bad)), mask, 1.0)
    for name in ["vmap", *VARIANTS]:
        got = out[name]
        assert np.all(np.isfinite(_flat(got.grad_sum))), name
        np.testing.assert_allclose(_flat(got.grad_sum), _flat(clean["vmap"].grad_sum), rtol=RTOL, atol=1e-6)
        assert float(got.norms[9]) == 0.0 and float(got.losses[9]) == 0.0


def test_masked_record_equals_removed_record():
    """Every strategy's sum with record 3 masked out equals the sum over the
    nine other records (computed by the reference: each strategy's agreement
    with it on other shapes is checked above)."""
    params, (x, y) = _mlp_case(1)
    mask = np.ones(10, bool)
    mask[3] = False
    masked = all_strategies(mlp_loss, params, (x, y), jnp.asarray(mask), 1.0)
    removed = all_strategies(mlp_loss, params, (jnp.delete(x, 3, 0), jnp.delete(y, 3, 0)), None, 1.0, ())
    assert not np.allclose(_flat(masked["vmap"].grad_sum),
                           _flat(all_strategies(mlp_loss, params, (x, y), None, 1.0)["vmap"].grad_sum))
    for name in ["vmap", *VARIANTS]:
        np.testing.assert_allclose(_flat(masked[name].grad_sum), _flat(removed["vmap"].grad_sum), rtol=RTOL, atol=1e-6)


@pytest.mark.parametrize("B", [0, 10])
def test_empty_batch_is_an_exact_zero_in_every_strategy(B):
    params, (x, y) = _mlp_case(2, B=max(B, 1))
    x, y = jnp.full((B, 5), jnp.nan, jnp.float32), jnp.full((B, 3), jnp.nan, jnp.float32)
    mask = jnp.zeros((B,), bool)
    out = all_strategies(mlp_loss, params, (x, y), mask, 1.0)
    for name, got in out.items():
        assert np.all(_flat(got.grad_sum) == 0.0), name
        assert got.norms.shape == (B,) and got.losses.shape == (B,)


def test_sensitivity_bound_holds_and_is_attained():
    """Removing one record moves the sum by at most C, substituting by at most 2C,
    and the worst cases come close (a missing clip or a per-leaf clip would fail)."""
    params, (x, y) = _mlp_case(3, B=10)
    C = 0.5
    sums = lambda r, m: {k: _flat(v.grad_sum) for k, v in all_strategies(mlp_loss, params, r, m, C).items()}  # noqa: E731
    base = sums((x, y), None)
    worst_remove, worst_sub = {}, {}
    for i in range(10):
        mask = np.ones(10, bool)
        mask[i] = False
        removed = sums((x, y), jnp.asarray(mask))
        substituted = sums((x.at[i].set(-x[i] * 1e3), y), None)
        for name in base:
            d = np.linalg.norm(base[name] - removed[name])
            assert d <= C, name
            worst_remove[name] = max(worst_remove.get(name, 0.0), d)
            d = np.linalg.norm(base[name] - substituted[name])
            assert d <= 2 * C, name
            worst_sub[name] = max(worst_sub.get(name, 0.0), d)
    for name in base:
        assert worst_remove[name] >= C * (1 - ETA) * (1 - 1e-4), name
        assert worst_sub[name] >= 1.2 * C, name


def test_clipped_sum_norm_per_record_never_exceeds_C_with_huge_gradients():
    """Large finite gradients (1e15): the ghost norm is computed with scaling, no overflow."""
    params, (x, y) = _mlp_case(4, B=10)
    x = x * 1e15
    mask = np.zeros(10, bool)
    for i in range(10):
        mask[:] = False
        mask[i] = True
        out = all_strategies(mlp_loss, params, (x, y), jnp.asarray(mask), 1.0)
        for name, got in out.items():
            assert np.isfinite(float(got.norms[i])) and float(got.norms[i]) > 1e10, name
            assert np.linalg.norm(_flat(got.grad_sum)) <= 1.0 * (1 + 1e-5), name


# ---------------------------------------------------------------------------
# the paper's three models (small), through the per-record ELBO
# ---------------------------------------------------------------------------


VAE_MODEL, VAE_GUIDE = make_vae(num_pixels=8, hidden=12, latent=3)


def _paper_problem(name, B=10):
    rng = np.random.default_rng(7)
    if name == "vae":
        data = ((rng.random((B, 8)) < 0.3).astype(np.float32),)
        return VAE_MODEL, VAE_GUIDE, data, {"N": 1000}, {"dec_hidden_w", "dec_out_w", "enc_hidden_w", "enc_out_w"}
    if name == "logreg":
        xs = rng.normal(size=(B, 4)).astype(np.float32)
        ys = (rng.random(B) < 0.5).astype(np.float32)
        return logistic_regression_model, logistic_regression_guide, (xs, ys), {"N": 1000}, set()
    xs = rng.normal(size=(B, 3)).astype(np.float32)
    ys = (rng.random(B) < 0.5).astype(np.float32)
    ls = rng.integers(0, 3, B).astype(np.int32)
    gs = jnp.asarray(rng.normal(size=(3, 2)), jnp.float32)
    return (hierarchical_logistic_regression_model, hierarchical_logistic_regression_guide, (xs, ys, ls),
            {"N": 500, "gs": gs}, set())


def _elbo_record_loss(model, guide, shared):
    """The per-record loss as DPSVI forms it: the ELBO of a batch of one record,
    with its own key, divided by the observation scale N."""

    def loss(params, record):
        key, data = record
        batch = [x[None] for x in data]
        return Trace_ELBO().loss(key, params, model, guide, *batch, **shared) / shared["N"]

    return loss


def _init_params(model, guide, data, shared):
    svi = numpyro.infer.SVI(model, guide, numpyro.optim.SGD(0.1), Trace_ELBO(), **shared)
    # compiled: NumPyro's initialisation op by op costs more than its compilation
    init = jax.jit(lambda key, *batch: svi.get_params(svi.init(key, *batch)))
    return init(jax.random.PRNGKey(3), *[jnp.asarray(x) for x in data])


def _paper_case(name):
    """``(loss, params, records, mask, C)`` of a paper model, its ghost leaves and "auto" checked."""
    model, guide, data, shared, expected_ghost = _paper_problem(name)
    params = _init_params(model, guide, data, shared)
    loss = _elbo_record_loss(model, guide, shared)
    B = data[0].shape[0]
    records = (jax.random.split(jax.random.PRNGKey(11), B), [jnp.asarray(x) for x in data])
    assert {p[2:-2] for p in ghost_leaves(loss, params, records)} == expected_ghost
    mask = jnp.asarray(np.arange(B) != 4)
    # "auto" is "ghost" for the VAE and "vmap" otherwise: checked without compiling
    auto = choose_strategy(loss, params, records)
    assert auto.strategy == ("ghost" if expected_ghost else "vmap"), auto
    C = {"vae": 6.0, "logreg": 0.5, "hlogreg": 0.5}[name]
    return loss, params, records, mask, C


@pytest.mark.filterwarnings("ignore:Found vars in model but not guide")
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) for name in ("vae", "logreg", "hlogreg")])
def test_paper_models_all_strategies_agree(name):
    """The paper's models, in the slow step: the VAE (ghost products; the
    default step checks them on the plain models ``mlp``, ``two_dots``,
    ``rows`` and ``low_rank``) and the regressions (no ghost leaf: "ghost" takes exact
    per-record gradients, as in the plain models ``dot_and_elementwise`` and
    ``control_flow``)."""
    loss, params, records, mask, C = _paper_case(name)
    out = check_all(loss, params, records, mask, C=C, variants=("ghost",))
    norms = np.asarray(out["vmap"].norms)[np.asarray(mask)]
    assert np.max(norms) > C > np.min(norms)  # some records are clipped, some not


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Found vars in model but not guide")
def test_paper_vae_scan_agrees_slow():
    """One record at a time through the VAE's ELBO (the default step checks
    "scan" on the MLP; the VAE's "ghost" is checked above)."""
    loss, params, records, mask, C = _paper_case("vae")
    check_all(loss, params, records, mask, C=C, variants=("scan",))


def _latent_model(xs, ys, N):
    """A dense weight (a ghost leaf) and a local latent (each record's ELBO
    takes its own guide sample): "auto" is "ghost"."""
    W = numpyro.param("W", jnp.full((xs.shape[1], 3), 0.1))
    with numpyro.plate("batch", N, subsample_size=xs.shape[0]):
        z = numpyro.sample("z", dist.Normal(0.0, 1.0))
        numpyro.sample("ys", dist.Normal(jnp.sum(jnp.tanh(xs @ W), -1) + z, 1.0), obs=ys)


def _latent_guide(xs, ys, N):
    V = numpyro.param("V", jnp.full((xs.shape[1],), 0.1))
    with numpyro.plate("batch", N, subsample_size=xs.shape[0]):
        numpyro.sample("z", dist.Normal(xs @ V, 0.5))


def _dpsvi_problem(name):
    if name == "vae":
        model, guide, data, shared, _ = _paper_problem("vae", B=6)
        return model, guide, [jnp.asarray(x) for x in data], shared
    rng = np.random.default_rng(12)
    data = [jnp.asarray(rng.normal(size=(6, 4)), jnp.float32), jnp.asarray(rng.normal(size=6), jnp.float32)]
    return _latent_model, _latent_guide, data, {"N": 1000}


@pytest.mark.float32
@pytest.mark.parametrize("name", ["latent", pytest.param("vae", marks=pytest.mark.slow)])
def test_dpsvi_strategy_changes_neither_noise_nor_result(name):
    """Same key, different strategies: the same noisy update (the noise draw
    does not depend on the strategy), and the noise is really there. A small
    model with a local latent in the default step, the paper's VAE in the slow one."""
    model, guide, data, shared = _dpsvi_problem(name)
    results = {}
    mask = jnp.asarray([True] * 5 + [False])
    for strategy in ["vmap", "auto"]:
        svi = DPSVI(model, guide, numpyro.optim.SGD(1.0), Trace_ELBO(), clipping_threshold=0.5,
                    dp_scale=2.0, gradient_strategy=strategy, **shared)
        # compiled: NumPyro's initialisation op by op costs more than its compilation
        state = jax.jit(svi.init)(d3p.random.PRNGKey(0), *data)
        update = jax.jit(svi.update)
        results[strategy] = _flat(svi.get_params(update(state, *data, mask=mask)[0]))
        if strategy == "auto":
            assert svi.strategy_choice.strategy == "ghost"
            # another noise key, same data and parameters
            other = state._replace(rng_key=d3p.random.PRNGKey(1))
            results["other key"] = _flat(svi.get_params(update(other, *data, mask=mask)[0]))
    # equal up to the rounding of the clipped sum (times N / B), relative to the largest entry
    np.testing.assert_allclose(results["auto"], results["vmap"], rtol=1e-5,
                               atol=1e-6 * max(1.0, np.max(np.abs(results["vmap"]))))
    # the noise moves the parameters by far more than the tolerance
    assert np.max(np.abs(results["auto"] - results["other key"])) > 1e-2


# ---------------------------------------------------------------------------
# the automatic choice and argument validation
# ---------------------------------------------------------------------------


@pytest.mark.float32
def test_auto_choice_follows_structure_backend_and_budget(monkeypatch):
    params, (x, y) = _mlp_case(5, B=10)
    assert choose_strategy(mlp_loss, params, (x, y)).strategy == "ghost"

    def elementwise_loss(p, r):
        return jnp.sum((p["a"] * r[0][:5] - r[1][0]) ** 2)

    p2 = {"a": jnp.ones(5)}
    assert choose_strategy(elementwise_loss, p2, (x, y)) .strategy == "vmap"
    # budget of 2 per-record gradients (and their clipped copies)
    small = choose_strategy(elementwise_loss, p2, (x, y), memory_budget_bytes=2 * 5 * 4 * 2)
    assert small.strategy == "chunked" and small.chunk_size == 2
    ghost_small = choose_strategy(mlp_loss, params, (x, y), memory_budget_bytes=1)
    assert ghost_small.strategy == "ghost" and ghost_small.chunk_size == 1
    # outer-product gradients that are not ghost (W transformed before the product):
    # one record at a time on CPU above the threshold, vmap below it
    def tanh_weight_loss(p, r):
        return jnp.sum((r[0] @ jnp.tanh(p["W"]) - r[1]) ** 2)

    w = {"W": jnp.ones((5, 3))}
    assert choose_strategy(tanh_weight_loss, w, (x, y)).strategy == "vmap"
    monkeypatch.setattr(_strategies, "_CPU_OUTER_MAX_PARAMS", 4)
    choice = choose_strategy(tanh_weight_loss, w, (x, y))
    # the CPU's choice, and the other platforms' beside it (selected when lowered)
    assert (choice.strategy, choice.chunk_size) == ("chunked", 1)
    assert (choice.elsewhere.strategy, choice.elsewhere.chunk_size) == ("vmap", None)
    # parameters used elementwise only have no outer products: still vmap
    assert choose_strategy(elementwise_loss, p2, (x, y)).strategy == "vmap"
    assert choose_strategy(mlp_loss, params, (x, y), forward_mode=True).strategy != "ghost"


def test_auto_choice_per_platform_is_selected_when_lowered(monkeypatch):
    # the CPU rule (one record at a time) must not leak into a program lowered
    # for a GPU: there the records are batched, with no loop; the sum is the same
    monkeypatch.setattr(_strategies, "_CPU_OUTER_MAX_PARAMS", 4)
    params, (x, y) = {"W": jnp.linspace(-1.0, 1.0, 15).reshape(5, 3)}, _mlp_case(5, B=10)[1]

    def tanh_weight_loss(p, r):
        return jnp.sum((r[0] @ jnp.tanh(p["W"]) - r[1][:3]) ** 2)

    def total(p, recs):
        return clipped_grad_sum(tanh_weight_loss, p, recs, None, 1.0).grad_sum

    lowered = {plat: jax.jit(total).trace(params, (x, y)).lower(lowering_platforms=(plat,)).as_text()
               for plat in ("cpu", "cuda")}
    assert lowered["cpu"].count("stablehlo.while") >= 1
    assert lowered["cuda"].count("stablehlo.while") == 0

    def sums(p, recs):
        return [total(p, recs)] + [clipped_grad_sum(tanh_weight_loss, p, recs, None, 1.0, strategy=s).grad_sum
                                   for s in ("scan", "vmap")]

    auto, one_at_a_time, batched = jax.jit(sums)(params, (x, y))
    np.testing.assert_allclose(_flat(auto), _flat(one_at_a_time), rtol=RTOL)
    np.testing.assert_allclose(_flat(batched), _flat(one_at_a_time), rtol=RTOL)


def test_auto_with_budget_gives_the_same_sum_and_works_under_vmap():
    """The audit vmaps clipped_grad_sum over runs; auto must trace there too."""
    params, (x, y) = _mlp_case(6, B=10)
    ref = all_strategies(mlp_loss, params, (x, y), None, 1.0)["vmap"]

    @jax.jit
    def run(scales):
        tight = clipped_grad_sum(mlp_loss, params, (x, y), None, 1.0, memory_budget_bytes=500)
        batched = jax.vmap(lambda s: clipped_grad_sum(mlp_loss, params, (x * s, y), None, 1.0).grad_sum)(scales)
        return tight, batched

    tight, batched = run(jnp.asarray([1.0, 2.0]))
    assert_same_sum(tight, ref)
    np.testing.assert_allclose(_flat(jax.tree.map(lambda g: g[0], batched)), _flat(ref.grad_sum), rtol=RTOL, atol=1e-6)


def test_loss_closing_over_traced_values():
    """A loss that closes over a value traced by an outer jit still takes the ghost path."""
    params, (x, y) = _mlp_case(7, B=10)

    choices = []

    @jax.jit
    def run(scale):
        loss = lambda p, r: mlp_loss(p, r) * scale  # noqa: E731
        return [clipped_grad_sum(loss, params, (x, y), None, 1.0, strategy=s, on_choice=choices.append)
                for s in ("vmap", "ghost")]

    ref, got = run(jnp.float32(3.0))
    assert [c.strategy for c in choices] == ["vmap", "ghost"]
    assert_same_sum(got, ref)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"strategy": "magic"}, "strategy"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"chunk_size": 2.5}, "chunk_size"),
        ({"memory_budget_bytes": 0}, "memory_budget_bytes"),
        ({"strategy": "ghost", "forward_mode": True}, "forward_mode"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    params, (x, y) = _mlp_case(8, B=3)
    with pytest.raises(ValueError, match=match):
        clipped_grad_sum(mlp_loss, params, (x, y), None, 1.0, **kwargs)


def test_dpsvi_validates_strategy_arguments():
    model, guide, _, shared, _ = _paper_problem("logreg")
    opt = numpyro.optim.SGD(0.1)
    with pytest.raises(ValueError, match="gradient_strategy"):
        DPSVI(model, guide, opt, Trace_ELBO(), 1.0, 1.0, gradient_strategy="fast", **shared)
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        DPSVI(model, guide, opt, Trace_ELBO(), 1.0, 1.0, memory_budget_bytes=-1, **shared)
    svi = DPSVI(model, guide, opt, Trace_ELBO(), 1.0, 1.0, **shared)
    assert svi.gradient_strategy == "auto"
    assert set(STRATEGIES) == {"auto", "vmap", "chunked", "scan", "ghost"}


def test_forward_mode_is_supported_by_the_non_ghost_strategies():
    params, (x, y) = _mlp_case(9, B=10)
    ref = all_strategies(mlp_loss, params, (x, y), None, 1.0)["vmap"]
    mask = jnp.ones((10,), bool)
    out = _all_jit(mlp_loss, params, (x, y), mask, 1.0, ("auto", "scan", "chunked3"), forward_mode=True)
    for got in out.values():
        assert_same_sum(got, ref, rtol=1e-4, atol_rel=1e-5)



# ---------------------------------------------------------------------------
# one copy of each privacy primitive, shared by every strategy
# ---------------------------------------------------------------------------


def _spy(monkeypatch, module, name):
    """Count the calls of ``module.name`` (looked up at call time by its users)."""
    calls = []
    real = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


@pytest.mark.parametrize("name", ["vmap", "chunked3", "scan", "ghost", "ghost_chunked3"])
def test_every_strategy_uses_the_shared_norm_bound_and_clip_factor(monkeypatch, name):
    """A strategy with its own copy of the norm bound or the clip factor would
    not call the shared one (a drifted copy is a privacy bug)."""
    params, (x, y) = _mlp_case(10, B=6)
    norm_calls = _spy(monkeypatch, _clipping, "_norm_bound")
    factor_calls = _spy(monkeypatch, _clipping, "_clip_factor")
    choices = []
    strategy, chunk = VARIANTS.get(name, (name, None))
    jax.make_jaxpr(lambda p, r: clipped_grad_sum(mlp_loss, p, r, None, 1.0, strategy=strategy,
                                                 chunk_size=chunk, on_choice=choices.append))(params, (x, y))
    expected = {"vmap": "vmap", "chunked": "chunked", "scan": "chunked", "ghost": "ghost"}[strategy]
    assert len(choices) == 1 and choices[0].strategy == expected
    assert norm_calls and len(factor_calls) == 1


def test_clip_gradient_total_norm_and_noise_use_the_shared_primitives(monkeypatch):
    norm_calls = _spy(monkeypatch, _clipping, "_norm_bound")
    factor_calls = _spy(monkeypatch, _clipping, "_clip_factor")
    std_calls = _spy(monkeypatch, gradients, "noise_std")
    grad = {"w": jnp.array([3.0, 4.0]), "b": jnp.array([1.0])}
    # compiled (each function is traced once, as it is called once eagerly)
    clipped, norm = jax.jit(gradients.clip_gradient, static_argnums=1)(grad, 1.0)
    assert norm_calls and len(factor_calls) == 1
    # total_norm is the bound clip_gradient clips with
    assert float(jax.jit(gradients.total_norm)(grad)) == float(norm)
    jax.make_jaxpr(lambda g, k: gradients.add_gaussian_noise(g, k, 1.0, 1.0))(grad, d3p.random.PRNGKey(0))
    assert std_calls == ["noise_std"]


@cpu_default
def test_the_default_memory_budget_is_64_mib_on_cpu_and_1_gib_elsewhere(monkeypatch):
    # 4096 float32 gradient entries per record: the budget sets the chunks
    def elementwise_loss(p, r):
        return jnp.sum((p["a"] * r[0]) ** 2)

    p = {"a": jnp.ones(4096)}
    B = 4096   # 4096 * 4096 * 4 bytes = 64 MiB of per-record gradients, twice with their clipped copies
    x = jnp.ones((B, 4096), jnp.float32)
    assert jax.default_backend() == "cpu"
    assert _strategies.default_memory_budget() == 64 << 20 == gradients.DEFAULT_CPU_MEMORY_BUDGET_BYTES
    default = choose_strategy(elementwise_loss, p, (x,))
    assert default == choose_strategy(elementwise_loss, p, (x,), memory_budget_bytes=64 << 20)
    assert default != choose_strategy(elementwise_loss, p, (x,), memory_budget_bytes=1 << 30)
    assert default.strategy == "chunked" and default.chunk_size < B
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert _strategies.default_memory_budget() == 1 << 30 == gradients.DEFAULT_MEMORY_BUDGET_BYTES
