"""d3p.util: the type predicates, example_count, map_over_secondary_dims,
normalize and sample_from_array. (The unvectorize helpers are tested in
test_modelling_util.py; their d3p 0.2 values also here.)"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import d3p.random
from d3p.util import (
    example_count,
    has_shape,
    is_array,
    is_int_scalar,
    is_integer,
    is_scalar,
    map_over_secondary_dims,
    normalize,
    sample_from_array,
    unvectorize_shape,
    unvectorize_shape_1d,
    unvectorize_shape_2d,
    unvectorize_shape_3d,
)

# value, is_array, is_scalar, is_integer, has_shape (d3p 0.2's meanings: an array
# has at least one dimension; a 0-d or one-element array is a scalar)
CASES = [
    (1, False, True, True, False),
    (1.5, False, True, False, False),
    (True, False, True, False, False),
    (1 + 2j, False, True, False, False),
    (np.int32(3), False, True, True, True),
    (np.float64(3.0), False, True, False, True),
    (np.array(2), False, True, True, True),
    (np.array(2.0), False, True, False, True),
    (np.arange(3), True, False, True, True),
    (np.zeros((2, 2)), True, False, False, True),
    (np.array([True]), True, True, False, True),
    (np.array([3]), True, True, True, True),
    (np.array(["a"]), True, False, False, True),
    (jnp.array(2), False, True, True, True),
    (jnp.array(2.0), False, True, False, True),
    (jnp.zeros(1), True, True, False, True),
    (jnp.zeros((1, 1)), True, True, False, True),
    (jnp.arange(1, dtype=jnp.uint8), True, True, True, True),
    (jnp.arange(3, dtype=jnp.uint8), True, False, True, True),
    (jnp.ones(3), True, False, False, True),
    (jnp.zeros(0), True, False, False, True),
    (jax.random.key(0), False, False, False, True),  # a typed key is not a number
    ([1, 2], False, False, False, False),
    ("1", False, False, False, False),
    (None, False, False, False, False),
]


@pytest.mark.parametrize("value, array, scalar, integer, shape", CASES)
def test_predicates(value, array, scalar, integer, shape):
    assert is_array(value) is array
    assert is_scalar(value) is scalar
    assert is_integer(value) is integer
    assert is_int_scalar(value) is (scalar and integer)
    assert has_shape(value) is shape


def test_predicates_on_traced_values():
    seen = {}

    def f(x, i):
        seen["array"] = (is_array(x), is_scalar(x), is_integer(x), is_int_scalar(i), has_shape(x))
        return x

    jax.jit(f)(jnp.ones(3), jnp.array(2))
    assert seen["array"] == (True, False, False, True, True)
    jax.jit(f)(jnp.ones(()), jnp.array([2]))
    assert seen["array"] == (False, True, False, True, True)


def test_predicates_and_unvectorize_shape_keep_d3p_02_values():
    """Issue 29 (item 4): the values d3p 0.2 gave, which programs and twinify rely on."""
    assert is_scalar(jnp.zeros(1)) and is_scalar(np.ones((1, 1))) and is_int_scalar(jnp.array([3]))
    assert not is_array(jnp.array(1.0)) and not is_array(np.array(2)) and is_array(jnp.zeros(1))
    assert unvectorize_shape(jnp.zeros((3, 2)), 1) == (3, 2)
    assert unvectorize_shape_1d(jnp.zeros((3, 2))) == (3, 2) and unvectorize_shape_1d(2.0) == (1,)
    assert unvectorize_shape_2d(jnp.zeros(3)) == (1, 3) and unvectorize_shape_2d(jnp.zeros((4, 5, 3))) == (4, 5, 3)
    assert unvectorize_shape_3d(np.zeros((4, 5))) == (1, 4, 5)


@pytest.mark.parametrize(
    "value, count",
    [(np.zeros((5, 3)), 5), (jnp.zeros(4), 4), (jnp.zeros((0, 2)), 0), (np.array(1.0), 1), (2.0, 1),
     ([[1, 2], [3, 4], [5, 6]], 3)],
)
def test_example_count(value, count):
    assert example_count(value) == count
    assert isinstance(example_count(value), int)


def test_example_count_under_jit_and_errors():
    out = jax.jit(lambda x: jnp.full((), example_count(x)))(jnp.zeros((7, 2)))
    assert int(out) == 7
    with pytest.raises(TypeError, match="a="):
        example_count(None)


def test_map_over_secondary_dims_shapes_and_values():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(5, 2, 3)))
    centre = map_over_secondary_dims(lambda v: v - v.mean())
    out = centre(x)
    assert out.shape == x.shape
    np.testing.assert_allclose(out, x - x.mean(axis=0, keepdims=True), rtol=1e-5, atol=1e-6)
    # a reduction: the leading axis disappears
    np.testing.assert_allclose(map_over_secondary_dims(jnp.max)(x), x.max(axis=0))
    # a vector: f itself; extra arguments are shared by all columns
    scale = map_over_secondary_dims(lambda v, c, shift=0.0: c * v + shift)
    np.testing.assert_allclose(scale(x[:, 0, 0], 2.0), 2.0 * x[:, 0, 0])
    np.testing.assert_allclose(scale(x, 2.0, shift=1.0), 2.0 * x + 1.0, rtol=1e-6)
    # the function sees one column at a time (a 1-d vector)
    shapes = []
    map_over_secondary_dims(lambda v: shapes.append(v.shape) or v)(x)
    assert shapes == [(5,)]  # traced once under vmap
    # works under jit and keeps the name
    np.testing.assert_allclose(jax.jit(centre)(x), out, rtol=1e-6)
    assert map_over_secondary_dims(normalize).__name__ == "normalize"


def test_map_over_secondary_dims_errors():
    with pytest.raises(TypeError, match="f="):
        map_over_secondary_dims(3)
    with pytest.raises(ValueError, match="x.shape"):
        map_over_secondary_dims(jnp.sum)(jnp.array(1.0))


def test_normalize():
    np.testing.assert_allclose(normalize(jnp.array([3.0, 4.0])), [0.6, 0.8], rtol=1e-6)
    np.testing.assert_allclose(normalize(np.array([0, 2])), [0.0, 1.0])  # integers give floats
    np.testing.assert_array_equal(normalize(jnp.zeros(3)), np.zeros(3))  # zero stays zero, no NaN
    x = jnp.asarray(np.random.default_rng(1).normal(size=(6, 2, 3)))
    out = normalize(x)
    assert out.shape == x.shape
    np.testing.assert_allclose(jnp.linalg.norm(out, axis=0), np.ones((2, 3)), rtol=1e-5)
    np.testing.assert_allclose(out * jnp.linalg.norm(x, axis=0), x, rtol=1e-5, atol=1e-6)  # direction kept
    with pytest.raises(ValueError, match="x"):
        normalize(1.0)


@pytest.mark.parametrize("rng_suite, make_key", [
    (jax.random, jax.random.PRNGKey),
    (d3p.random, d3p.random.PRNGKey),
])
def test_sample_from_array_draws_distinct_rows(rng_suite, make_key):
    x = jnp.arange(30).reshape(10, 3)
    s = sample_from_array(make_key(0), x, 4, rng_suite=rng_suite)
    assert s.shape == (4, 3)
    rows = [tuple(r) for r in np.asarray(s).tolist()]
    assert len(set(rows)) == 4 and all(r in [tuple(q) for q in np.asarray(x).tolist()] for r in rows)
    # the same key, the same draw; along another axis
    np.testing.assert_array_equal(s, sample_from_array(make_key(0), x, 4, rng_suite=rng_suite))
    t = sample_from_array(make_key(1), x, 2, axis=-1, rng_suite=rng_suite)
    assert t.shape == (10, 2)
    assert sample_from_array(make_key(1), x, 0, rng_suite=rng_suite).shape == (0, 3)
    everything = sample_from_array(make_key(2), jnp.arange(10), 10, rng_suite=rng_suite)
    np.testing.assert_array_equal(np.sort(everything), np.arange(10))


def test_sample_from_array_is_uniform():
    """Every ordered pair drawn from 5 entries has probability 1/20 (chi-square)."""
    keys = jax.random.split(jax.random.PRNGKey(3), 20_000)
    draws = np.asarray(jax.vmap(lambda k: sample_from_array(k, jnp.arange(5), 2))(keys))
    counts = collections.Counter(map(tuple, draws.tolist()))
    assert len(counts) == 20 and all(a != b for a, b in counts)
    assert stats.chisquare(list(counts.values())).pvalue > 1e-3
    # each position alone is uniform over the 5 entries too
    assert stats.chisquare(np.bincount(draws[:, 1], minlength=5)).pvalue > 1e-3


@pytest.mark.parametrize("kwargs, match", [
    (dict(x=jnp.arange(5), n=6), "n"),
    (dict(x=jnp.arange(5), n=-1), "n"),
    (dict(x=jnp.arange(5), n=2.0), "n"),
    (dict(x=jnp.arange(5), n=jnp.array(2)), "n"),  # a count is a Python or NumPy integer
    (dict(x=jnp.arange(5), n=[2]), "n"),
    (dict(x=jnp.arange(5), n=np.array([2])), "n"),  # though is_int_scalar accepts it (d3p 0.2)
    (dict(x=jnp.arange(5), n=2, axis=1), "axis"),
    (dict(x=jnp.arange(5), n=2, axis=jnp.array([0])), "axis"),
    (dict(x=jnp.array(1.0), n=1), "x"),
])
def test_sample_from_array_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sample_from_array(jax.random.PRNGKey(0), **kwargs)
