"""The discrete Gaussian mechanism (d3p.discrete): grid, certified integer bound, exact sum, noise.

Every record's integer vector must have exact L2 norm at most the plan's
bound, whatever its gradient, including gradients built so that every
coordinate's rounding error points the same way as the gradient (the worst
case of rounding to the grid). Norms are checked with exact integer arithmetic
in NumPy, independent of the certified float bound the mechanism uses.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import d3p.random
from d3p.discrete import add_discrete_gaussian_noise, clipped_integer_sum, discrete_plan


def linear_loss(params, record):
    """The gradient of one record's loss is the record itself."""
    return jnp.vdot(params["w"], record)


_PROGRAMS = {}


def _summed(loss, plan):
    """One jitted program per loss and plan: the records and the mask are arguments."""
    key = (loss, plan)
    if key not in _PROGRAMS:
        _PROGRAMS[key] = jax.jit(lambda p, r, m: clipped_integer_sum(loss, p, r, m, plan).grad_sum)
    return _PROGRAMS[key]


def integer_vectors(records, plan, loss=linear_loss, params=None):
    """Each record's integer vector: the exact integer sum of the batch with
    only that record real (the others masked), in the same compiled program."""
    if params is None:
        params = {"w": jnp.zeros(records.shape[1], records.dtype)}
    B = records.shape[0]
    one_hot = _summed(loss, plan)
    out = []
    for i in range(B):
        s = one_hot(params, records, jnp.arange(B) == i)
        out.append(np.concatenate([np.asarray(x, np.int64).ravel() for x in jax.tree.leaves(s)]))
    return np.stack(out)


def exact_norms(ints):
    return np.sqrt(np.sum(ints.astype(np.int64) ** 2, axis=1).astype(np.float64))


@pytest.mark.parametrize("sigma, d", [(0.5, 1), (1.0, 10), (1.3, 1000), (4.0, 100_000), (0.8, 688_884)])
def test_plan_constants(sigma, d):
    C = 2.5
    plan = discrete_plan(sigma, C, d)
    # the noise is exactly sigma times the bound, and 2**k is its variance in grid steps
    assert math.isclose(2 ** (plan.log2_variance / 2), sigma * plan.bound, rel_tol=1e-12)
    assert math.isclose(plan.bound, (1 + plan.inflation) * C / plan.grid, rel_tol=1e-12)
    # the rounding error of a clipped gradient fits in the margin
    steps = C / plan.grid
    assert steps ** 2 * ((1 + plan.inflation) ** 2 - 1) >= d / 4 * (1 - 1e-12)
    assert steps >= 256 * (1 - 1e-12)
    # the smallest such power of two: half the variance would violate one of the two
    smaller = 2 ** ((plan.log2_variance - 1) / 2) / sigma
    assert smaller < max((1 + plan.inflation) * 256,
                         (1 + plan.inflation) * math.sqrt(d) / (2 * math.sqrt((1 + plan.inflation) ** 2 - 1)))
    assert math.isclose(plan.noise_std, (1 + plan.inflation) * sigma * C, rel_tol=1e-12)


@pytest.mark.parametrize("kwargs, name", [
    (dict(dp_scale=0.0, clipping_threshold=1.0, num_params=3), "dp_scale"),
    (dict(dp_scale=1.0, clipping_threshold=math.inf, num_params=3), "clipping_threshold"),
    (dict(dp_scale=1.0, clipping_threshold=1.0, num_params=0), "num_params"),
    (dict(dp_scale=1.0, clipping_threshold=1.0, num_params=3, inflation=0.0), "inflation"),
    (dict(dp_scale=1.0, clipping_threshold=1.0, num_params=3, min_resolution=0), "min_resolution"),
    (dict(dp_scale="1", clipping_threshold=1.0, num_params=3), "dp_scale"),
])
def test_plan_rejects_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        discrete_plan(**kwargs)


def test_plan_refuses_noise_beyond_the_sampler():
    with pytest.raises(ValueError, match="num_params"):
        discrete_plan(1e5, 1.0, 10 ** 8)


def adversarial_records(plan, d, n, rng):
    """Records of norm just below C whose every coordinate is 0.501 grid steps
    above an integer (in magnitude), so that rounding adds 0.499 steps to each,
    in the direction of the gradient: the worst case of rounding to the grid."""
    steps = plan.clipping_threshold / plan.grid
    out = []
    for _ in range(n):
        base = np.abs(rng.normal(size=d))
        base /= np.linalg.norm(base)
        lo, hi = 0.0, steps   # the largest scale whose record stays below C
        for _ in range(60):
            mid = (lo + hi) / 2
            if np.linalg.norm(np.floor(base * mid) + 0.501) < steps * (1 - 1e-6):
                lo = mid
            else:
                hi = mid
        rec = (np.floor(base * lo) + 0.501) * plan.grid
        assert np.linalg.norm(rec) < plan.clipping_threshold
        out.append(rec * np.where(rng.normal(size=d) < 0, -1.0, 1.0))
    return np.stack(out)


@pytest.mark.parametrize("d", [1, 7, 2000, 40_000])
def test_every_integer_vector_within_the_bound(d):
    rng = np.random.default_rng(d)
    plan = discrete_plan(1.0, 1.5, d)
    typical = rng.normal(size=(4, d))
    typical *= 3.0 / np.linalg.norm(typical, axis=1, keepdims=True)       # clipped to C
    small = typical * 0.1                                                  # not clipped
    records = np.concatenate([typical, small, adversarial_records(plan, d, 4, rng)]).astype(np.float32)
    ints = integer_vectors(jnp.asarray(records), plan)
    norms = exact_norms(ints)
    assert np.all(norms <= plan.bound), (norms.max(), plan.bound)
    # typical records keep their exact rounding (clipping is to C, then rounding to the grid)
    clipped = typical / np.linalg.norm(typical, axis=1, keepdims=True) * plan.clipping_threshold
    expected = np.round(np.concatenate([clipped, small]) / plan.grid)
    assert np.max(np.abs(ints[:8] - expected)) <= 1   # the clip factor is rounded in float


@pytest.mark.parametrize("d", [1, 7, 300])
def test_coarse_grid_still_within_the_bound(d):
    """min_resolution=1: a grid so coarse that even typical records may need the fallback."""
    rng = np.random.default_rng(d)
    plan = discrete_plan(1.0, 1.5, d, min_resolution=1)
    typical = rng.normal(size=(20, d))
    records = np.concatenate([typical, adversarial_records(plan, d, 4, rng)]).astype(np.float32)
    norms = exact_norms(integer_vectors(jnp.asarray(records), plan))
    assert np.all(norms <= plan.bound), (norms.max(), plan.bound)


def test_adversarial_rounding_would_exceed_the_bound_without_the_check():
    d = 40_000
    rng = np.random.default_rng(0)
    plan = discrete_plan(1.0, 1.5, d, min_resolution=1)
    records = adversarial_records(plan, d, 3, rng)
    naive = np.round(records / plan.grid)
    assert np.all(exact_norms(naive) > plan.bound)   # the test's records do reach the worst case
    ints = integer_vectors(jnp.asarray(records, jnp.float32), plan)
    assert np.all(exact_norms(ints) <= plan.bound)
    # the fallback, a smaller rounding in the record's direction, not zero
    assert np.all(exact_norms(ints) > 0.8 * plan.bound / (1 + plan.inflation))
    cosine = np.sum(ints * records, axis=1) / exact_norms(ints) / np.linalg.norm(records, axis=1)
    assert np.all(cosine > 0.99)


def matrix_loss(params, record):
    """Leaves of several shapes: a matrix, a vector and a scalar; the gradient is the record."""
    return (jnp.vdot(params["m"], record[:12].reshape(3, 4)) + jnp.vdot(params["v"], record[12:14])
            + params["s"] * record[14])


def test_leaves_of_several_shapes_are_one_vector():
    rng = np.random.default_rng(4)
    plan = discrete_plan(1.0, 1.0, 15, min_resolution=4)
    params = {"m": jnp.zeros((3, 4)), "v": jnp.zeros(2), "s": jnp.zeros(())}
    records = np.concatenate([rng.normal(size=(6, 15)), adversarial_records(plan, 15, 4, rng)]).astype(np.float32)
    out = clipped_integer_sum(matrix_loss, params, jnp.asarray(records), None, plan).grad_sum
    assert out["m"].shape == (3, 4) and out["s"].shape == () and out["v"].dtype == jnp.int32
    ints = integer_vectors(jnp.asarray(records), plan, matrix_loss, params)
    assert np.all(exact_norms(ints) <= plan.bound)
    total = np.concatenate([np.asarray(x, np.int64).ravel() for x in jax.tree.leaves(out)])
    np.testing.assert_array_equal(total, ints.sum(axis=0))


def test_a_record_vector_does_not_depend_on_its_position_or_the_others():
    """The same record at every position of a batch, among different other
    records, gets the same integer vector (one record per scan step)."""
    rng = np.random.default_rng(9)
    d = 64
    plan = discrete_plan(1.0, 1.0, d)
    target = adversarial_records(plan, d, 1, rng)[0] * 0.999
    vectors = []
    for position in (0, 5, 12):
        records = rng.normal(size=(13, d)) * rng.uniform(0.1, 3.0, size=(13, 1))
        records[position] = target
        vectors.append(integer_vectors(jnp.asarray(records, jnp.float32), plan)[position])
    for v in vectors[1:]:
        np.testing.assert_array_equal(v, vectors[0])


def test_huge_and_non_finite_gradients():
    d = 50
    plan = discrete_plan(1.0, 1.0, d)
    records = np.zeros((4, d), np.float32)
    records[0] = 1e37
    records[1, 0] = np.nan
    records[2, 1] = np.inf
    records[3] = -1e30
    ints = integer_vectors(jnp.asarray(records), plan)
    norms = exact_norms(ints)
    assert np.all(norms <= plan.bound)
    assert np.all(ints[1:3] == 0)   # non-finite gradients contribute nothing
    assert norms[0] > 0.9 * plan.bound / (1 + plan.inflation)
    assert norms[3] > 0.9 * plan.bound / (1 + plan.inflation)


def test_sum_is_exact_and_neighbours_differ_by_one_vector():
    d = 300
    rng = np.random.default_rng(1)
    plan = discrete_plan(0.9, 2.0, d)
    records = rng.normal(size=(33, d)) * rng.uniform(0.01, 2.0, size=(33, 1))
    records = np.concatenate([records, adversarial_records(plan, d, 3, rng)]).astype(np.float32)
    params = {"w": jnp.zeros(d)}
    program = _summed(linear_loss, plan)

    def summed(m):
        return program(params, jnp.asarray(records), m)["w"]

    full = np.asarray(summed(jnp.ones(len(records), bool)), np.int64)
    ints = integer_vectors(jnp.asarray(records), plan, params=params)
    np.testing.assert_array_equal(full, ints.sum(axis=0))      # exact: the sum of the records' vectors
    for i in (0, 7, 35):   # add/remove: mask one record out
        mask = np.ones(len(records), bool)
        mask[i] = False
        without = np.asarray(summed(jnp.asarray(mask)), np.int64)
        diff = full - without
        np.testing.assert_array_equal(diff, ints[i])
        assert math.sqrt(float(np.sum(diff ** 2))) <= plan.bound


def test_padded_and_empty_batches_give_zero():
    plan = discrete_plan(1.0, 1.0, 5)
    params = {"w": jnp.zeros(5)}
    records = jnp.full((3, 5), jnp.nan)
    out = clipped_integer_sum(linear_loss, params, records, jnp.zeros(3, bool), plan).grad_sum["w"]
    assert out.dtype == jnp.int32 and np.all(np.asarray(out) == 0)
    empty = clipped_integer_sum(linear_loss, params, jnp.zeros((0, 5)), None, plan).grad_sum["w"]
    assert np.all(np.asarray(empty) == 0)


def test_batch_that_could_overflow_int32_is_refused():
    plan = discrete_plan(1.0, 1.0, 4, min_resolution=2 ** 20)
    B = plan.max_batch_size() + 1
    with pytest.raises(ValueError, match="record slots"):
        clipped_integer_sum(linear_loss, {"w": jnp.zeros(4)}, jnp.zeros((B, 4)), None, plan)


def test_params_must_match_the_plan():
    plan = discrete_plan(1.0, 1.0, 4)
    with pytest.raises(ValueError, match="num_params"):
        clipped_integer_sum(linear_loss, {"w": jnp.zeros(5)}, jnp.zeros((2, 5)), None, plan)


def test_released_values_lie_on_the_grid_with_the_right_variance():
    plan = discrete_plan(1.0, 1.0, 50_000, min_resolution=1)
    n = plan.num_params
    zero = {"w": jnp.zeros(n, jnp.int32)}
    out = np.asarray(add_discrete_gaussian_noise(zero, d3p.random.PRNGKey(3), plan)["w"], np.float64)
    steps = out / plan.grid
    np.testing.assert_allclose(steps, np.round(steps), rtol=0, atol=1e-6 * np.abs(steps).max())
    var = np.var(np.round(steps))
    s = 2.0 ** plan.log2_variance
    # chi-square interval for the variance at n samples: rejects 0.95 s and 1.05 s
    lo, hi = stats.chi2.ppf([1e-4, 1 - 1e-4], n - 1) / (n - 1)
    assert lo * s <= var <= hi * s
    assert not lo * 0.95 * s <= var <= hi * 0.95 * s and not lo * 1.05 * s <= var <= hi * 1.05 * s
    assert abs(np.mean(np.round(steps))) < 5 * math.sqrt(s / n)


def test_every_released_value_is_reachable_from_every_sum():
    """The band experiment of the continuous mechanism's attack: outputs near
    3-3.25 noise stds. Under the discrete mechanism the released value is
    grid * (sum + z) with z of full support on the integers, so the set of
    values that can be released is grid * Z whatever the sum: a value seen
    under one sum is reachable under its neighbour. Checked on the outputs:
    every one is an exact grid multiple, the same map for both sums."""
    plan = discrete_plan(1.0, 1.0, 1)
    n = 150_000
    key = d3p.random.PRNGKey(11)
    zero = {"w": jnp.zeros(n, jnp.int32)}
    one = {"w": jnp.ones(n, jnp.int32)}
    seen = []
    for s in (zero, one):
        out = np.asarray(add_discrete_gaussian_noise(s, key, plan, dtype=jnp.float32)["w"], np.float64)
        band = out[(out >= 3.0 * plan.noise_std) & (out <= 3.25 * plan.noise_std)]
        k = np.round(band / plan.grid)
        # one fixed function of the integer k: float32(k) * float32(grid), rounded
        np.testing.assert_array_equal(k.astype(np.float32) * np.float32(plan.grid), np.float32(band))
        seen.append(set(k.astype(np.int64).tolist()))
    assert len(seen[0]) > 20 and len(seen[1]) > 20
    # both sums reach integers on both sides of each other's values
    assert seen[0] & seen[1]


@pytest.mark.float32
def test_noise_is_deterministic_per_key_and_independent_of_the_sum():
    plan = discrete_plan(2.0, 1.0, 50)
    key = d3p.random.PRNGKey(5)
    a = add_discrete_gaussian_noise({"w": jnp.zeros(50, jnp.int32)}, key, plan)["w"]
    b = add_discrete_gaussian_noise({"w": jnp.full(50, 7, jnp.int32)}, key, plan)["w"]
    np.testing.assert_array_equal(np.round(np.asarray(b) / plan.grid) - np.round(np.asarray(a) / plan.grid), 7)
    c = add_discrete_gaussian_noise({"w": jnp.zeros(50, jnp.int32)}, d3p.random.PRNGKey(6), plan)["w"]
    assert not np.array_equal(np.asarray(a), np.asarray(c))


def test_jit_and_the_debug_suite():
    plan = discrete_plan(1.0, 1.0, 8)
    f = jax.jit(lambda k, s: add_discrete_gaussian_noise(s, k, plan, d3p.random.debug))
    out = f(d3p.random.debug.PRNGKey(0), {"w": jnp.zeros(8, jnp.int32)})["w"]
    assert out.shape == (8,) and np.all(np.isfinite(np.asarray(out)))


def test_noise_rejects_bad_arguments():
    with pytest.raises(TypeError, match="plan"):
        add_discrete_gaussian_noise({"w": jnp.zeros(2, jnp.int32)}, d3p.random.PRNGKey(0), None)
    with pytest.raises(TypeError, match="plan"):
        clipped_integer_sum(linear_loss, {"w": jnp.zeros(2)}, jnp.zeros((1, 2)), None, "plan")
    plan = discrete_plan(1.0, 1.0, 2)
    with pytest.raises(ValueError, match="rng_suite"):
        add_discrete_gaussian_noise({"w": jnp.zeros(2, jnp.int32)}, d3p.random.PRNGKey(0), plan, "chacha")
