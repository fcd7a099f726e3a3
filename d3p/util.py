"""Reshape helpers for values that may carry extra leading (vectorised) dimensions.

Models and guides are sometimes called with values that have more leading
dimensions than the code expects (e.g. under ``vmap`` of a sampler, or with a
sample shape) or fewer (a single record). ``unvectorize_shape_Kd(x)`` returns
``x`` with exactly ``K`` dimensions: surplus leading dimensions are merged
into the first one, missing ones are added in front with size 1. The trailing
``K - 1`` dimensions are never changed.

>>> import jax.numpy as jnp
>>> unvectorize_shape_2d(jnp.zeros((4, 5, 3))).shape
(20, 3)
>>> unvectorize_shape_2d(jnp.zeros(3)).shape
(1, 3)
>>> unvectorize_shape_1d(jnp.zeros((2, 3))).shape
(6,)
"""

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["unvectorize_shape", "unvectorize_shape_1d", "unvectorize_shape_2d", "unvectorize_shape_3d"]


def unvectorize_shape(a: jax.typing.ArrayLike, d: int) -> jax.Array:
    """``a`` reshaped to exactly ``d >= 1`` dimensions (see the module docstring).

    :param a: an array.
    :param int d: the number of dimensions wanted.
    :return: the reshaped array (no copy where JAX can avoid one; ``a`` itself is
        never modified).
    """
    if isinstance(d, bool) or not isinstance(d, int) or d < 1:
        raise ValueError(f"Expected d to be an integer >= 1, got d={d!r}.")
    a = jnp.asarray(a)
    if a.ndim < d:
        return a.reshape((1,) * (d - a.ndim) + a.shape)
    trailing = a.shape[a.ndim - d + 1 :]
    lead = int(np.prod(a.shape[: a.ndim - d + 1], dtype=np.int64))
    return a.reshape((lead,) + trailing)


def unvectorize_shape_1d(a: jax.typing.ArrayLike) -> jax.Array:
    """``a`` as a 1-dimensional array (all dimensions merged)."""
    return unvectorize_shape(a, 1)


def unvectorize_shape_2d(a: jax.typing.ArrayLike) -> jax.Array:
    """``a`` as a 2-dimensional array ``(records, features)``."""
    return unvectorize_shape(a, 2)


def unvectorize_shape_3d(a: jax.typing.ArrayLike) -> jax.Array:
    """``a`` as a 3-dimensional array."""
    return unvectorize_shape(a, 3)
