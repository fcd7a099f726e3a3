"""Clipping and the clipped sum: hand-checked values and sensitivity bounds."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import d3p.random
from d3p._validate import InvalidArgumentType
from d3p.gradients import (
    StrategyChoice,
    add_gaussian_noise,
    choose_strategy,
    clip_gradient,
    clipped_grad_sum,
    noise_std,
    total_norm,
)


def test_total_norm_spans_all_leaves():
    tree = {"a": jnp.array([3.0]), "b": jnp.array([[4.0]])}
    assert float(total_norm(tree)) == pytest.approx(5.0)


def test_total_norm_does_not_overflow_for_large_finite_values():
    tree = {"a": jnp.array([3e30, 4e30], jnp.float32)}
    assert float(total_norm(tree)) == pytest.approx(5e30, rel=1e-6)


@pytest.mark.parametrize(
    "grad, C, expected",
    [
        ({"a": [3.0, 4.0]}, 1.0, {"a": [0.6, 0.8]}),
        # one vector over all leaves: per-leaf clipping would give [1.0], [1.0]
        ({"a": [3.0], "b": [4.0]}, 1.0, {"a": [0.6], "b": [0.8]}),
        ({"a": [3.0], "b": [4.0]}, 2.5, {"a": [1.5], "b": [2.0]}),
        # norm below C: unchanged
        ({"a": [3.0], "b": [4.0]}, 10.0, {"a": [3.0], "b": [4.0]}),
        ({"a": [3.0], "b": [4.0]}, float("inf"), {"a": [3.0], "b": [4.0]}),
        ({"a": [0.0, 0.0]}, 1.0, {"a": [0.0, 0.0]}),
        # non-finite gradients contribute nothing
        ({"a": [np.nan, 1.0], "b": [1.0]}, 1.0, {"a": [0.0, 0.0], "b": [0.0]}),
        ({"a": [np.inf, 1.0], "b": [1.0]}, 1.0, {"a": [0.0, 0.0], "b": [0.0]}),
        ({"a": [-np.inf, 1.0], "b": [1.0]}, float("inf"), {"a": [0.0, 0.0], "b": [0.0]}),
    ],
)
def test_clip_gradient_hand_checked(grad, C, expected):
    """Equal to the hand-computed values up to the few units of roundoff by
    which a clipped gradient stays below C (never above)."""
    grad = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), grad)
    clipped, _ = clip_gradient(grad, C)
    for k in expected:
        np.testing.assert_allclose(clipped[k], expected[k], rtol=5e-6, atol=0)
        got, want = np.asarray(clipped[k], np.float64), np.asarray(expected[k], np.float64)
        assert np.all(np.abs(got) <= np.abs(want))


def test_clipped_norm_never_exceeds_threshold_at_any_scale():
    rng = np.random.default_rng(0)
    for C in [1e-3, 0.7, 1.0, 50.0]:
        for scale in [1e-6, 1e-2, 1.0, 1e3, 1e8, 1e30]:
            grad = {
                "w": jnp.asarray(rng.normal(size=(7, 3)) * scale, jnp.float32),
                "b": jnp.asarray(rng.normal(size=(3,)) * scale, jnp.float32),
            }
            clipped, norm = clip_gradient(grad, C)
            assert np.linalg.norm(_flat(clipped).astype(np.float64)) <= C
            if float(norm) * (1 + 2e-6) <= C:
                np.testing.assert_array_equal(clipped["w"], grad["w"])


def _loss(params, record):
    """Linear loss: gradient w.r.t. w is x, w.r.t. b is y (two leaves)."""
    x, y = record
    return jnp.dot(params["w"], x) + params["b"] * y


PARAMS = {"w": jnp.zeros(3), "b": jnp.zeros(())}


@functools.partial(jax.jit, static_argnames=("C", "strategy", "chunk_size"))
def _jit_sum(xs, ys, mask, C, strategy="vmap", chunk_size=None):
    return clipped_grad_sum(_loss, PARAMS, (xs, ys), mask, C, strategy=strategy, chunk_size=chunk_size)


def _sum(xs, ys, C, mask=None, **kw):
    return _jit_sum(jnp.asarray(xs), jnp.asarray(ys), mask, C, **kw)


def _flat(tree):
    return np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])


def _records(seed=0, B=8):
    rng = np.random.default_rng(seed)
    xs = rng.normal(size=(B, 3)) * np.array([[1.0], [100.0], [0.01], [5.0], [1e6], [1.0], [3.0], [0.5]])[:B]
    ys = rng.normal(size=(B,)) * 10
    return xs.astype(np.float32), ys.astype(np.float32)


# the margin of float32 sums documented in d3p.gradients: records are clipped to C (1 - ETA)
ETA = 2.0**-7


def test_clipped_sum_matches_per_record_clipping_by_hand():
    xs, ys = _records()
    C = 1.5
    got = _sum(xs, ys, C).grad_sum
    # the documented margin: 2^-7 for float32 parameters, 2^-30 for float64 (x64 step)
    eta = ETA if jnp.result_type(got["w"]) == jnp.float32 else 2.0**-30
    expected = np.zeros(4)
    for x, y in zip(xs, ys):
        g = np.concatenate([x, [y]]).astype(np.float64)
        n = np.linalg.norm(g)
        expected += g * min(1.0, C * (1 - eta) / n)
    np.testing.assert_allclose(np.concatenate([got["w"], [got["b"]]]), expected, rtol=2e-5, atol=1e-5)


@pytest.mark.parametrize("strategy, chunk", [("vmap", None), ("chunked", 3), ("chunked", 1)])
@pytest.mark.parametrize("C", [0.1, 7.0])
def test_sensitivity_remove_mask_and_substitute(strategy, chunk, C):
    """Adding/removing/masking one record moves the sum by <= C, substituting by <= 2C,
    and the worst cases come close to these bounds (so a missing or per-leaf clip fails)."""
    xs, ys = _records(1)
    # every call with a mask: one compiled program per batch size
    every = jnp.ones(len(xs), bool)
    base = _flat(_sum(xs, ys, C, mask=every, strategy=strategy, chunk_size=chunk).grad_sum)
    worst_remove = worst_sub = 0.0
    for i in range(len(xs)):
        # remove record i
        removed = _flat(_sum(np.delete(xs, i, 0), np.delete(ys, i), C, mask=every[1:], strategy=strategy,
                             chunk_size=chunk).grad_sum)
        # mask record i
        mask = np.ones(len(xs), bool)
        mask[i] = False
        masked = _flat(_sum(xs, ys, C, mask=jnp.asarray(mask), strategy=strategy, chunk_size=chunk).grad_sum)
        np.testing.assert_allclose(masked, removed, rtol=1e-5, atol=1e-5 * C)
        d = np.linalg.norm(base - removed)
        assert d <= C
        worst_remove = max(worst_remove, d)
        # substitute record i by an adversarial record pointing the other way
        xs2, ys2 = xs.copy(), ys.copy()
        xs2[i], ys2[i] = -xs[i] * 1e3, -ys[i] * 1e3
        sub = _flat(_sum(xs2, ys2, C, mask=every, strategy=strategy, chunk_size=chunk).grad_sum)
        d = np.linalg.norm(base - sub)
        assert d <= 2 * C
        worst_sub = max(worst_sub, d)
    # records with norm > C exist, so the bounds are attained (up to the margin)
    assert worst_remove >= C * (1 - ETA) * (1 - 1e-4)
    assert worst_sub >= 2 * C * (1 - ETA) * (1 - 1e-4)


def test_non_finite_and_masked_records_contribute_zero():
    xs, ys = _records(2)
    C = 1.0
    ref = _sum(xs[:4], ys[:4], C)
    xs_bad = xs.copy()
    xs_bad[4] = np.nan
    xs_bad[5, 1] = np.inf
    ys_bad = ys.copy()
    ys_bad[6] = np.nan
    mask = np.array([True] * 7 + [False])
    xs_bad[7] = np.nan  # padded record with garbage
    got = _sum(xs_bad, ys_bad, C, mask=jnp.asarray(mask))
    np.testing.assert_allclose(_flat(got.grad_sum), _flat(ref.grad_sum), rtol=1e-6)
    assert np.all(np.isfinite(_flat(got.grad_sum)))
    # a NaN record cannot break the bound: its contribution is zero, not NaN
    assert float(got.norms[7]) == 0.0 and float(got.losses[7]) == 0.0


def test_empty_batch_gives_exact_zero_sum():
    xs, ys = _records(3)
    xs[:] = np.nan
    got = _sum(xs, ys, 1.0, mask=jnp.zeros(len(xs), bool))
    assert np.all(_flat(got.grad_sum) == 0.0)


def test_noise_std_and_no_privacy_setting():
    assert noise_std(1.5, 2.0) == 3.0
    assert noise_std(0.0, float("inf")) == 0.0
    tree = {"a": jnp.ones(3)}
    out = add_gaussian_noise(tree, d3p.random.PRNGKey(0), 0.0, float("inf"))
    np.testing.assert_array_equal(out["a"], tree["a"])


def test_noise_is_one_draw_over_all_coordinates_from_the_suite():
    tree = {"a": jnp.zeros((2, 3)), "b": jnp.zeros(4)}
    key = d3p.random.PRNGKey(5)
    out = add_gaussian_noise(tree, key, 2.0, 0.5)
    expected = np.asarray(d3p.random.normal(key, (10,))) * 1.0
    flat = np.concatenate([np.ravel(out["a"]), np.ravel(out["b"])])
    np.testing.assert_allclose(flat, expected, rtol=1e-6)


def test_noise_matches_the_flattened_formula_leaf_by_leaf():
    """Leaves get the values of unravel(ravel(tree) + std * normal(key, (P,)))
    exactly, in their own dtypes, also for mixed dtypes and scalar leaves."""
    from jax.flatten_util import ravel_pytree

    tree = {
        "a": jnp.arange(12.0).reshape(3, 4),
        "b": [jnp.linspace(-1, 1, 5), jnp.asarray(2.5)],
        "c": jnp.ones((2,), jnp.float16),
    }
    key = d3p.random.PRNGKey(11)
    out = add_gaussian_noise(tree, key, 1.3, 0.7)
    flat, unravel = ravel_pytree(tree)
    noise = d3p.random.normal(key, flat.shape, flat.dtype)
    expected = unravel(flat + noise * np.asarray(1.3 * 0.7, flat.dtype))
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(expected)):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


def test_bad_strategy_and_mask():
    xs, ys = _records()
    with pytest.raises(ValueError, match="strategy"):
        clipped_grad_sum(_loss, PARAMS, (xs, ys), None, 1.0, strategy="magic")
    with pytest.raises(ValueError, match="mask"):
        clipped_grad_sum(_loss, PARAMS, (xs, ys), jnp.ones(3, bool), 1.0)


def test_on_choice_reports_the_choice_once_per_trace():
    xs, ys = _records()
    seen = []

    @jax.jit
    def run(xs, ys):
        return clipped_grad_sum(_loss, PARAMS, (xs, ys), None, 1.0, strategy="chunked", chunk_size=3,
                                on_choice=seen.append)

    run(xs, ys)
    run(xs * 2, ys)  # cached: not traced again
    assert seen == [StrategyChoice("chunked", 3, "requested")]
    assert seen[0] == choose_strategy(_loss, PARAMS, (xs, ys), strategy="chunked", chunk_size=3)
    # one call per trace, also without jit, and also for an empty batch
    empty = []
    clipped_grad_sum(_loss, PARAMS, (xs[:0], ys[:0]), None, 1.0, on_choice=empty.append)
    assert empty == [StrategyChoice("vmap", None, "empty batch")]


def test_on_choice_must_be_callable():
    xs, ys = _records()
    with pytest.raises(InvalidArgumentType, match=r"Expected on_choice to be a callable or None, got on_choice=3\."):
        clipped_grad_sum(_loss, PARAMS, (xs, ys), None, 1.0, on_choice=3)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"strategy": "magic"}, ValueError, "Expected strategy to be one of 'auto', 'vmap', 'chunked', 'scan', "
                                            "'ghost', got strategy='magic'."),
        ({"strategy": None}, InvalidArgumentType, "Expected strategy to be one of"),
        ({"chunk_size": 0}, ValueError, "Expected chunk_size to be an integer >= 1, got chunk_size=0."),
        ({"chunk_size": True}, InvalidArgumentType,
         "Expected chunk_size to be an integer >= 1, got chunk_size=True."),
        ({"memory_budget_bytes": -1}, ValueError,
         "Expected memory_budget_bytes to be an integer >= 1, got memory_budget_bytes=-1."),
        ({"forward_mode": "yes"}, InvalidArgumentType,
         "Expected forward_mode to be True or False, got forward_mode='yes'."),
    ],
)
def test_strategy_arguments_get_the_shared_checks_in_both_entry_points(kwargs, error, message):
    xs, ys = _records()
    with pytest.raises(error) as err:
        clipped_grad_sum(_loss, PARAMS, (xs, ys), None, 1.0, **kwargs)
    assert str(err.value).startswith(message)
    with pytest.raises(error) as err:
        choose_strategy(_loss, PARAMS, (xs, ys), **kwargs)
    assert str(err.value).startswith(message)


def test_strategy_names_are_matched_like_every_choice():
    xs, ys = _records()
    assert choose_strategy(_loss, PARAMS, (xs, ys), strategy=" VMAP ") == StrategyChoice("vmap", None, "requested")
    got = clipped_grad_sum(_loss, PARAMS, (xs, ys), None, 1.5, strategy="Chunked", chunk_size=np.int64(3))
    np.testing.assert_allclose(_flat(got.grad_sum), _flat(_sum(xs, ys, 1.5).grad_sum), rtol=1e-6)


@pytest.mark.parametrize(
    "dp_scale, C, error, name",
    [
        (-1.0, 1.0, ValueError, "dp_scale"),
        (float("nan"), 1.0, ValueError, "dp_scale"),
        (float("inf"), 1.0, ValueError, "dp_scale"),
        ("1", 1.0, InvalidArgumentType, "dp_scale"),
        (1.0, 0.0, ValueError, "clipping_threshold"),
        (1.0, -2.0, ValueError, "clipping_threshold"),
        (1.0, float("nan"), ValueError, "clipping_threshold"),
    ],
)
def test_noise_std_refuses_invalid_privacy_settings(dp_scale, C, error, name):
    with pytest.raises(error, match=f"Expected {name} to be"):
        noise_std(dp_scale, C)
    with pytest.raises(error, match=f"Expected {name} to be"):
        add_gaussian_noise({"a": jnp.ones(2)}, d3p.random.PRNGKey(0), dp_scale, C)


def test_noise_std_accepts_zero_d_arrays():
    assert noise_std(np.float32(0.5), jnp.asarray(4.0)) == 2.0
