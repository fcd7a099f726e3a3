"""The d3p PRNG suite interface on JAX's default (non-cryptographic) generator.

Fast and reproducible, for debugging and tests only: JAX's generator is not
designed to resist an adversary who tries to predict the noise, so a private
release made with it carries no formal guarantee. :func:`PRNGKey` warns.
"""

import warnings
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from d3p.random import _threefry
from d3p.random._common import (
    SUITE_API, composed_stream_words, describe_key, float_dtype, is_typed_jax_key, is_uint32_array, raw_jax_key_shape,
)

__all__ = [*SUITE_API, "as_key", "split_with_jax_key", "split_with_jax_keys", "stream_words"]

#: Type of a key of this suite: a key of ``jax.random``.
PRNGState = jax.Array


class DebugRNGWarning(UserWarning):
    """Warns that the non-cryptographic debug PRNG suite is in use."""


def PRNGKey(seed: Optional[jax.typing.ArrayLike] = None) -> PRNGState:
    """A ``jax.random`` key; ``seed=None`` draws a seed from OS entropy.

    Warns with :class:`DebugRNGWarning`: results are not private.
    """
    warnings.warn(
        "d3p.random.debug uses JAX's non-cryptographic PRNG: use it for debugging only, "
        "never for a private release (use d3p.random instead).",
        DebugRNGWarning,
        stacklevel=2,
    )
    if seed is None:
        seed = int(np.frombuffer(np.random.default_rng().bytes(4), dtype=np.uint32)[0])
    return jax.random.PRNGKey(seed)


def as_key(key, name: str = "rng_key") -> PRNGState:
    """``key`` as a key of this suite: a JAX key (typed or raw) as it is, a
    ``d3p.random`` key (``uint32[8]``) through
    :func:`d3p.random.convert_to_jax_rng_key`. Told apart by shape and dtype
    only; anything else raises ``TypeError`` naming ``name``."""
    if is_typed_jax_key(key) or is_uint32_array(key, raw_jax_key_shape()):
        return key
    if is_uint32_array(key, (8,)):
        from d3p.random import chacha

        return chacha.convert_to_jax_rng_key(key)
    got = describe_key(key)
    raise TypeError(f"Expected {name} to be a JAX key (jax.random.key or jax.random.PRNGKey) or a d3p.random "
                    f"key, got {got}.")


def split(key: PRNGState, num: int = 2) -> jax.Array:
    """As :func:`jax.random.split`."""
    return jax.random.split(key, num)


def fold_in(key: PRNGState, data: jax.typing.ArrayLike) -> PRNGState:
    """As :func:`jax.random.fold_in`."""
    return jax.random.fold_in(key, data)


def random_bits(key: PRNGState, bit_width: int = 32, shape: Sequence[int] = ()) -> jax.Array:
    """As :func:`jax.random.bits`."""
    dtype = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint64}.get(bit_width)
    if dtype is None:
        raise ValueError(f"Expected bit_width in (8, 16, 32, 64), got bit_width={bit_width}.")
    if bit_width == 64 and not jax.config.jax_enable_x64:
        # as the secure suite: no silent truncation to 32 bits
        raise ValueError("bit_width=64 requires jax_enable_x64; use bit_width=32 otherwise.")
    return jax.random.bits(key, shape, dtype)


def uniform(key: PRNGState, shape: Sequence[int] = (), dtype=None, minval=0.0, maxval=1.0):
    """As :func:`jax.random.uniform`; ``dtype=None`` is JAX's default float
    dtype (float64 under ``jax_enable_x64``, float32 otherwise)."""
    return jax.random.uniform(key, shape, float_dtype(dtype), minval, maxval)


def normal(key: PRNGState, shape: Sequence[int] = (), dtype=None) -> jax.Array:
    """As :func:`jax.random.normal`; ``dtype=None`` is JAX's default float
    dtype (float64 under ``jax_enable_x64``, float32 otherwise)."""
    return jax.random.normal(key, shape, float_dtype(dtype))


def randint(key: PRNGState, shape: Sequence[int] = (), minval=0, maxval=None, dtype=jnp.int32):
    """As :func:`jax.random.randint`."""
    if maxval is None:
        raise TypeError("randint requires maxval (an upper bound, exclusive).")
    return jax.random.randint(key, shape, minval, maxval, dtype)


def convert_to_jax_rng_key(key: PRNGState) -> jax.Array:
    """Returns ``key`` itself: keys of this suite are ``jax.random`` keys."""
    return key


def split_with_jax_key(key: PRNGState, num: int = 2):
    """``num`` keys and a key for ``jax.random`` independent of them, as
    :func:`d3p.random.chacha.split_with_jax_key`: here the ``num + 1`` keys
    of ``jax.random.split(key, num + 1)`` (``key`` itself, which
    :func:`convert_to_jax_rng_key` returns, is not independent of its split)."""
    keys = jax.random.split(key, int(num) + 1)
    return keys[:-1], keys[-1]


def split_with_jax_keys(key: PRNGState, num: int, count: int):
    """``num`` keys and ``count`` keys for ``jax.random``, all independent, as
    :func:`d3p.random.chacha.split_with_jax_keys`: here the ``num`` keys of
    :func:`split_with_jax_key` and ``jax.random.split(jax_key, count)`` of
    its JAX key (computed with d3p's loop-free Threefry where that gives the
    same values, see :func:`d3p.random._threefry.fast_key`)."""
    count = int(count)
    if count < 1:
        raise ValueError(f"Expected count >= 1, got count={count}.")
    keys, jax_key = split_with_jax_key(key, num)
    fast = _threefry.fast_key(jax_key)
    jax_keys = jax.random.split(fast, count)
    return keys, (jax_keys if fast is jax_key else jax.random.key_data(jax_keys))


def stream_words(key: PRNGState, data, counts, first=0):
    """The words of streams ``first``, ``first + 1``, ... of ``(key, data)``, as
    :func:`d3p.random.chacha.stream_words`: here stream ``j`` is
    ``jax.random.bits(fold_in(fold_in(key, data), j), (count,))`` (the
    construction :func:`d3p.random._common.stream_words` uses for a suite
    without the function)."""
    return composed_stream_words(fold_in, random_bits, key, data, counts, first)
