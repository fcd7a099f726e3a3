"""Small array helpers: type predicates, shape normalisation, per-column maps,
and sampling rows of an array.

**Arrays and scalars** follow d3p 0.2: :func:`is_array` is true for arrays
with at least one dimension; a single number, including a 0-d or a
one-element array, is a scalar (:func:`is_scalar`).

**Shapes of values with leading dimensions stripped.** A model or guide
written for a batch of records, shape ``(N, *record)``, is sometimes called
with one record whose leading dimension is missing (e.g. ``x[0]`` of shape
``record``). ``unvectorize_shape_Kd(x)`` gives the shape of ``x`` with at
least ``K`` dimensions: missing leading dimensions are added with size 1; a
value with ``K`` or more dimensions keeps its shape (as in d3p 0.2).
``unvectorize_Kd(x)`` returns ``x`` reshaped to that shape.

>>> import jax.numpy as jnp
>>> N, D = unvectorize_shape_2d(jnp.zeros(3))
>>> N, D
(1, 3)
>>> unvectorize_shape_2d(jnp.zeros((4, 3))), unvectorize_shape(jnp.zeros((3, 2)), 1)
((4, 3), (3, 2))
>>> unvectorize_2d(jnp.zeros(3)).shape
(1, 3)
"""

import functools
import numbers
from typing import Callable, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from d3p import _validate

__all__ = [
    "is_array",
    "is_scalar",
    "is_integer",
    "is_int_scalar",
    "has_shape",
    "example_count",
    "map_over_secondary_dims",
    "normalize",
    "sample_from_array",
    "unvectorize_shape",
    "unvectorize_shape_1d",
    "unvectorize_shape_2d",
    "unvectorize_shape_3d",
    "unvectorize",
    "unvectorize_1d",
    "unvectorize_2d",
    "unvectorize_3d",
]


# ----------------------------------------------------------------- predicates


def _is_array_type(x) -> bool:
    """Whether ``x`` is a JAX array (also a traced one) or a NumPy ``ndarray``,
    of any number of dimensions (0-d included)."""
    return isinstance(x, (jax.Array, np.ndarray))


def _is_numeric_dtype(dtype) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_))


def _is_single_int(x) -> bool:
    """Whether ``x`` is one integer that is not an array of one or more
    dimensions: a Python ``int`` (not ``bool``), a NumPy integer scalar or a
    0-d integer array. (The argument checks here use it: an index or a count
    given as ``[3]`` is a mistake even though d3p 0.2's :func:`is_int_scalar`
    accepts it.)"""
    if isinstance(x, (bool, np.bool_)):
        return False
    if isinstance(x, numbers.Integral):
        return True
    if isinstance(x, np.generic) or (_is_array_type(x) and x.ndim == 0):
        return bool(jnp.issubdtype(x.dtype, jnp.integer))
    return False


def is_array(x) -> bool:
    """Whether ``x`` is an array with at least one dimension: a JAX array (also
    a traced one) or a NumPy ``ndarray`` with ``ndim >= 1``.

    As in d3p 0.2, a 0-d array is not an array here: it holds a single number
    (:func:`is_scalar`). Python numbers, NumPy scalars (``np.float32(1.0)``)
    and lists are not arrays.

    >>> import numpy as np, jax.numpy as jnp
    >>> is_array(jnp.zeros(3)), is_array(jnp.zeros(1)), is_array(np.array(1.0)), is_array(1.0)
    (True, True, False, False)
    """
    return _is_array_type(x) and x.ndim > 0


def is_scalar(x) -> bool:
    """Whether ``x`` is a single number: a Python number (``bool``, ``int``,
    ``float``, ``complex``), a NumPy scalar of numeric or boolean type, or an
    array (JAX or NumPy, of numeric or boolean dtype) with exactly one
    element, whatever its number of dimensions (d3p 0.2's meaning: ``[2.0]``
    and ``[[2.0]]`` are scalars).

    >>> import jax.numpy as jnp
    >>> is_scalar(2), is_scalar(jnp.array(2.0)), is_scalar(jnp.zeros(1)), is_scalar(jnp.zeros(2)), is_scalar("2")
    (True, True, True, False, False)
    """
    if isinstance(x, numbers.Number):
        return True
    if isinstance(x, np.generic) or _is_array_type(x):
        return _is_numeric_dtype(x.dtype) and x.size == 1
    return False


def is_integer(x) -> bool:
    """Whether ``x`` holds integers: a Python ``int``, a NumPy integer scalar, or
    an array (of any shape) of a signed or unsigned integer dtype.

    Booleans (``True``, arrays of dtype ``bool``) are not integers here, and a
    ``float`` with an integral value (``2.0``) is not either.

    >>> import jax.numpy as jnp
    >>> is_integer(3), is_integer(jnp.arange(3)), is_integer(True), is_integer(3.0)
    (True, True, False, False)
    """
    if isinstance(x, bool):
        return False
    if isinstance(x, numbers.Integral):
        return True
    if isinstance(x, np.generic) or _is_array_type(x):
        return bool(jnp.issubdtype(x.dtype, jnp.integer))
    return False


def is_int_scalar(x) -> bool:
    """Whether ``x`` is a single integer: :func:`is_scalar` and :func:`is_integer`
    (so a one-element integer array is one, as in d3p 0.2).

    >>> import jax.numpy as jnp
    >>> is_int_scalar(3), is_int_scalar(jnp.array([3])), is_int_scalar(jnp.arange(3)), is_int_scalar(True)
    (True, True, False, False)
    """
    return is_scalar(x) and is_integer(x)


def has_shape(x) -> bool:
    """Whether ``x`` has a ``shape`` attribute (arrays, traced values, NumPy
    scalars, ``jax.ShapeDtypeStruct``); Python numbers and lists have none.

    >>> import jax.numpy as jnp
    >>> has_shape(jnp.zeros(2)), has_shape(2.0), has_shape([1.0])
    (True, False, False)
    """
    return hasattr(x, "shape")


def example_count(a) -> int:
    """The number of examples (records) in ``a``: the length of its leading
    axis, or 1 for a scalar (a single example).

    :param a: an array, a (nested) list of numbers or a scalar.
    :return: a Python ``int`` (shapes are static, so also under ``jit``).

    >>> import jax.numpy as jnp
    >>> example_count(jnp.zeros((5, 3))), example_count(jnp.zeros(4)), example_count(2.0)
    (5, 4, 1)
    """
    if not (has_shape(a) or is_scalar(a) or isinstance(a, (list, tuple))):
        raise TypeError(f"Expected a to be an array or a scalar, got a={a!r}.")
    shape = np.shape(a)
    return int(shape[0]) if shape else 1


# ------------------------------------------------------- maps over the columns


def map_over_secondary_dims(f: Callable) -> Callable:
    """Lift ``f``, defined on 1-dimensional vectors, to act along the leading
    axis of arrays of any number of dimensions, independently for every index
    of the secondary (trailing) dimensions.

    ``map_over_secondary_dims(f)(x, *args, **kwargs)`` for ``x`` of shape
    ``(n, *rest)`` applies ``f(x[:, j...], *args, **kwargs)`` to every
    trailing index ``j...`` (with ``jax.vmap``) and returns an array of shape
    ``f_out + rest``, where ``f_out`` is the shape of ``f``'s result on one
    vector (``(n,)`` for a function returning a vector like its input, ``()``
    for a reduction). A 1-dimensional ``x`` is passed to ``f`` unchanged.
    Extra arguments are shared by all columns. Usable as a decorator.

    >>> import jax.numpy as jnp
    >>> centre = map_over_secondary_dims(lambda v: v - v.mean())
    >>> centre(jnp.array([[1.0, 10.0], [3.0, 20.0]]))
    Array([[-1., -5.],
           [ 1.,  5.]], dtype=float32)
    >>> map_over_secondary_dims(jnp.sum)(jnp.ones((3, 2, 4))).shape
    (2, 4)
    """
    if not callable(f):
        raise TypeError(f"Expected f to be callable, got f={f!r}.")

    @functools.wraps(f)
    def mapped(x, *args, **kwargs):
        x = jnp.asarray(x)
        if x.ndim == 0:
            raise ValueError(
                "Expected x with at least one dimension (f acts along its leading axis), "
                f"got x.shape={x.shape}."
            )
        if x.ndim == 1:
            return f(x, *args, **kwargs)
        rest = x.shape[1:]
        columns = x.reshape(x.shape[0], -1)
        out = jax.vmap(lambda column: f(column, *args, **kwargs), in_axes=1, out_axes=-1)(columns)
        return jax.tree.map(lambda o: o.reshape(o.shape[:-1] + rest), out)

    return mapped


@map_over_secondary_dims
def _unit_norm(v: jax.Array) -> jax.Array:
    norm = jnp.linalg.norm(v)
    return v / jnp.where(norm > 0, norm, 1.0)


def normalize(x: jax.typing.ArrayLike) -> jax.Array:
    """``x`` scaled to unit Euclidean (L2) norm along its leading axis.

    A vector becomes ``x / ‖x‖₂``; for more dimensions every column
    ``x[:, j...]`` is normalised separately (:func:`map_over_secondary_dims`).
    A zero vector (column) stays zero. Integer input gives floats.

    :param x: an array with at least one dimension.

    >>> import jax.numpy as jnp
    >>> normalize(jnp.array([3.0, 4.0]))
    Array([0.6, 0.8], dtype=float32)
    >>> normalize(jnp.array([[3.0, 0.0], [4.0, 0.0]]))
    Array([[0.6, 0. ],
           [0.8, 0. ]], dtype=float32)
    """
    x = jnp.asarray(x)
    if x.ndim == 0:
        raise ValueError(f"Expected x with at least one dimension, got a scalar x={x!r}.")
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        x = x.astype(jnp.result_type(float))
    return _unit_norm(x)


# -------------------------------------------------------------------- sampling


def sample_from_array(
    rng_key, x: jax.typing.ArrayLike, n: int, axis: int = 0, rng_suite=jax.random
) -> jax.Array:
    """``n`` entries of ``x`` along ``axis``, drawn uniformly without replacement.

    Every ordered selection of ``n`` distinct indices is equally likely (a
    partial Fisher-Yates shuffle, with the generator's ``randint``); the
    result holds them in the order drawn.

    :param rng_key: a key of ``rng_suite``.
    :param x: the array to draw from.
    :param int n: how many entries, ``0 <= n <= x.shape[axis]``.
    :param int axis: the axis to draw along (negative counts from the end).
    :param rng_suite: the generator: ``jax.random`` (default), or
        :mod:`d3p.random` / :mod:`d3p.random.debug` with their keys. For
        private minibatches use the samplers of :mod:`d3p.minibatch`, which
        the privacy accounting is stated for.
    :return: an array of the shape of ``x`` with ``x.shape[axis]`` replaced by
        ``n``.

    >>> import jax, jax.numpy as jnp
    >>> s = sample_from_array(jax.random.PRNGKey(0), jnp.arange(10), 4)
    >>> s.shape, len(set(s.tolist()))
    ((4,), 4)
    """
    x = jnp.asarray(x)
    if x.ndim == 0:
        raise ValueError(f"Expected x with at least one dimension, got a scalar x={x!r}.")
    if not _is_single_int(axis) or not -x.ndim <= int(axis) < x.ndim:
        raise ValueError(f"Expected axis to be an integer in [{-x.ndim}, {x.ndim}), got axis={axis!r}.")
    axis = int(axis) % x.ndim
    size = x.shape[axis]
    if not _is_single_int(n) or _is_array_type(n) or not 0 <= int(n) <= size:
        raise ValueError(f"Expected n to be an integer in [0, {size}] (x.shape[{axis}]), got n={n!r}.")
    n = int(n)

    def swap_step(i, perm):
        j = rng_suite.randint(rng_suite.fold_in(rng_key, i), (), i, size)
        perm_i, perm_j = perm[i], perm[j]
        return perm.at[i].set(perm_j).at[j].set(perm_i)

    perm = jax.lax.fori_loop(0, n, swap_step, jnp.arange(size))
    return jnp.take(x, perm[:n], axis=axis)


# --------------------------------------------------------------------- shapes


def _check_d(d) -> int:
    return _validate.integer("d", d, minimum=1)


def unvectorize_shape(a: jax.typing.ArrayLike, d: int) -> Tuple[int, ...]:
    """The shape of ``a`` with at least ``d`` dimensions, as in d3p 0.2 (see
    the module docstring): undoes the stripping of leading dimensions.

    If ``a`` has fewer than ``d`` dimensions, leading dimensions of size 1 are
    added in front; otherwise the shape of ``a`` is returned unchanged (no
    dimensions are merged or dropped).

    :param a: an array (or anything ``numpy.shape`` accepts).
    :param int d: the number of dimensions wanted at least, ``d >= 1``.
    :return: a tuple of ``max(d, a.ndim)`` Python ints.

    >>> import jax.numpy as jnp
    >>> unvectorize_shape(jnp.zeros((4, 5)), 3), unvectorize_shape(jnp.zeros((3, 2)), 1)
    ((1, 4, 5), (3, 2))
    """
    d = _check_d(d)
    shape = tuple(int(s) for s in np.shape(a))
    return (1,) * max(0, d - len(shape)) + shape


def unvectorize_shape_1d(a: jax.typing.ArrayLike) -> Tuple[int, ...]:
    """:func:`unvectorize_shape` ``(a, 1)``: ``(1,)`` for a scalar, else the shape of ``a``.

    >>> import jax.numpy as jnp
    >>> unvectorize_shape_1d(2.0), unvectorize_shape_1d(jnp.zeros(3)), unvectorize_shape_1d(jnp.zeros((2, 3)))
    ((1,), (3,), (2, 3))
    """
    return unvectorize_shape(a, 1)


def unvectorize_shape_2d(a: jax.typing.ArrayLike) -> Tuple[int, ...]:
    """:func:`unvectorize_shape` ``(a, 2)``: the shape ``(records, features)`` of
    a batch, with one record of shape ``(features,)`` taken as a batch of one.

    >>> import jax.numpy as jnp
    >>> unvectorize_shape_2d(jnp.zeros(3)), unvectorize_shape_2d(jnp.zeros((4, 3)))
    ((1, 3), (4, 3))
    """
    return unvectorize_shape(a, 2)


def unvectorize_shape_3d(a: jax.typing.ArrayLike) -> Tuple[int, ...]:
    """:func:`unvectorize_shape` ``(a, 3)``.

    >>> import jax.numpy as jnp
    >>> unvectorize_shape_3d(jnp.zeros((4, 5))), unvectorize_shape_3d(jnp.zeros((2, 3, 4, 5)))
    ((1, 4, 5), (2, 3, 4, 5))
    """
    return unvectorize_shape(a, 3)


def unvectorize(a: jax.typing.ArrayLike, d: int) -> jax.Array:
    """``a`` reshaped to :func:`unvectorize_shape` ``(a, d)``: leading
    dimensions of size 1 added up to ``d`` dimensions.

    :param a: an array; it is never modified (JAX copies only where needed).
    :param int d: the number of dimensions wanted at least, ``d >= 1``.
    :return: a JAX array with ``max(d, a.ndim)`` dimensions and the elements
        of ``a`` in their row-major order.

    >>> import jax.numpy as jnp
    >>> unvectorize(jnp.arange(3), 2)
    Array([[0, 1, 2]], dtype=int32)
    """
    a = jnp.asarray(a)
    return a.reshape(unvectorize_shape(a, d))


def unvectorize_1d(a: jax.typing.ArrayLike) -> jax.Array:
    """``a`` with at least one dimension (:func:`unvectorize` ``(a, 1)``)."""
    return unvectorize(a, 1)


def unvectorize_2d(a: jax.typing.ArrayLike) -> jax.Array:
    """``a`` with at least two dimensions ``(records, features)`` (:func:`unvectorize` ``(a, 2)``)."""
    return unvectorize(a, 2)


def unvectorize_3d(a: jax.typing.ArrayLike) -> jax.Array:
    """``a`` with at least three dimensions (:func:`unvectorize` ``(a, 3)``)."""
    return unvectorize(a, 3)
