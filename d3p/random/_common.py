"""What the PRNG suites of :mod:`d3p.random` share: their public names, the
default float dtype of their draws, and 32-bit integer arithmetic.

Kept in one place so that the secure suite (:mod:`d3p.random.chacha`), the
debug suite (:mod:`d3p.random.debug`) and the samplers of
:mod:`d3p.minibatch` cannot drift apart.
"""

from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np

#: The names every PRNG suite provides (the interface of ``rng_suite``).
SUITE_API = (
    "PRNGKey",
    "PRNGState",
    "split",
    "fold_in",
    "random_bits",
    "uniform",
    "normal",
    "randint",
    "convert_to_jax_rng_key",
)


def float_dtype(dtype=None) -> np.dtype:
    """``dtype``, or for ``None`` JAX's default float dtype at the time of the
    call: float64 under ``jax_enable_x64``, float32 otherwise (as
    ``jax.random.normal`` and ``jax.random.uniform`` choose it)."""
    if dtype is None:
        return jax.dtypes.canonicalize_dtype(jnp.float64)
    return jnp.dtype(dtype)


def rotl_u32(x: jax.Array, n: int) -> jax.Array:
    """Rotate the bits of a uint32 array left by ``n`` (``0 < n < 32``)."""
    return (x << np.uint32(n)) | (x >> np.uint32(32 - n))


def mulhi_u32(a: jax.Array, b: jax.Array) -> Tuple[jax.Array, jax.Array]:
    """High and low 32-bit words of the 64-bit product of two uint32 arrays.

    Computed from 16-bit halves in uint32 arithmetic, so that it needs no
    64-bit integers (which JAX provides only under ``jax_enable_x64``).
    """
    mask = np.uint32(0xFFFF)
    a_lo, a_hi = a & mask, a >> np.uint32(16)
    b_lo, b_hi = b & mask, b >> np.uint32(16)
    ll = a_lo * b_lo
    lh = a_lo * b_hi
    hl = a_hi * b_lo
    hh = a_hi * b_hi
    mid = (ll >> np.uint32(16)) + (lh & mask) + (hl & mask)
    hi = hh + (lh >> np.uint32(16)) + (hl >> np.uint32(16)) + (mid >> np.uint32(16))
    return hi, a * b


def suite_key(rng_suite, key, name: str = "rng_key"):
    """``key`` as a key of ``rng_suite``: through the suite's ``as_key`` where
    it has one (:func:`d3p.random.as_key` converts JAX keys for the secure
    suite; :func:`d3p.random.debug.as_key`), else as given (a suite of the
    caller's own checks its keys itself). ``name``: the argument, for errors."""
    as_key = getattr(rng_suite, "as_key", None)
    return key if as_key is None else as_key(key, name)


def is_typed_jax_key(key) -> bool:
    """Whether ``key`` is a typed JAX key (``jax.random.key``, dtype ``key<...>``)."""
    return isinstance(key, jax.Array) and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)


def raw_jax_key_shape() -> tuple:
    """The shape of ``jax.random.PRNGKey(0)`` under JAX's default implementation
    (``(2,)`` for Threefry)."""
    return tuple(jax.eval_shape(lambda: jax.random.PRNGKey(0)).shape)


def is_uint32_array(key, shape: tuple) -> bool:
    """Whether ``key`` is a JAX or NumPy ``uint32`` array of ``shape``."""
    return isinstance(key, (jax.Array, np.ndarray)) and key.dtype == np.uint32 and tuple(key.shape) == shape


def describe_key(key) -> str:
    """What ``key`` is, for an error message: its shape and dtype, or its type."""
    if hasattr(key, "shape") and hasattr(key, "dtype"):
        return f"an array of shape {tuple(key.shape)} and dtype {key.dtype}"
    return f"an object of type {type(key).__name__}"
