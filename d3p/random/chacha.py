"""ChaCha20 (RFC 8439) in ``jax.numpy`` uint32 arithmetic, and a PRNG suite on it.

The cipher is written with plain 32-bit integer operations (add, xor,
rotate), so it runs under ``jit``/``vmap``/``grad``-free code on every JAX
backend without custom operations. The rounds are a loop on every
platform, each double round computed once for all blocks; each platform
gets its own arrangement, chosen when the program is lowered: on CPU a few
blocks are computed one at a time and long keystreams (the noise of a large
model) come from OpenSSL's implementation of the same cipher, bit for bit
the same words (see :mod:`d3p.random._keystream`).

A key of this suite is a ``uint32`` array of shape ``(8,)``: a 256-bit ChaCha20
key. Every output is ChaCha20's keystream for that key under a nonce that
separates purposes, so no two functions of the suite ever read the same part
of one stream (but :func:`split_with_jax_key` and :func:`split_with_jax_keys`,
which give ``split``'s and ``convert_to_jax_rng_key``'s words in one call):

==========================  ==================  ============================
purpose                     nonce (3 words)     block counter
==========================  ==================  ============================
``random_bits`` output      ``(0, 0, 0)``       0, 1, 2, ... (one per block)
``split``                   ``(1, 0, 0)``       index of the child key
``fold_in(key, data)``      ``(2, data, 0)``    0
``convert_to_jax_rng_key``  ``(3, 0, 0)``       0
``split_with_jax_keys``     ``(3, 0, 0)``       0, 1, 2, ... (its first JAX key is the row above's)
``as_key`` of a JAX key     ``(4, n, 0)``       0 (keyed by the JAX key)
``stream_words`` stream j   ``(5, data, j)``    0, 1, 2, ... (one per block)
==========================  ==================  ============================

:func:`split_with_jax_key` computes ``split``'s and ``convert_to_jax_rng_key``'s
blocks in one call of the block function (:func:`split_with_jax_keys`, with
as many JAX keys as asked for), :func:`stream_words` several
streams in one call: the same words, fewer loops in a compiled program.

A child key (from ``split`` or ``fold_in``) is the first 8 words of one
keystream block; with ChaCha20 as a pseudo-random function these are
independent uniform keys for distinct (purpose, index) pairs.

:func:`as_key` also takes JAX's keys (``jax.random.key``, or the raw
``uint32[2]`` of ``jax.random.PRNGKey``) and turns one into a key of this
suite: ChaCha20 keyed by the JAX key's ``n`` words of key data (zero-padded
to 256 bits), block 0 under nonce ``(4, n, 0)``, its first 8 words. Such a
key is as secret as the JAX key, i.e. at most 64 bits for JAX's default
generator; the noise is still ChaCha20's (see docs/privacy.md, "Keys").
"""

import functools
import os
from typing import Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.scipy.special import ndtri

from d3p.random import _keystream
from d3p.random._common import (
    SUITE_API, describe_key, float_dtype, in_two_halves, is_typed_jax_key, is_uint32_array, mulhi_u32,
    raw_jax_key_shape,
)

__all__ = [*SUITE_API, "as_key", "chacha20_block", "split_with_jax_key", "split_with_jax_keys", "stream_words"]

#: Type of a key of this suite: a ``uint32`` array of shape ``(8,)``.
PRNGState = jax.Array

_KEY_WORDS = _keystream.KEY_WORDS

_NONCE_BITS = _keystream.NONCE_BITS
_NONCE_SPLIT = 1
_NONCE_FOLD_IN = 2
_NONCE_JAX_KEY = 3
_NONCE_FROM_JAX_KEY = 4
_NONCE_STREAMS = 5

chacha20_block = _keystream.chacha20_block
_keystream_words = _keystream.keystream_words


def _check_key(key) -> jax.Array:
    key = jnp.asarray(key)
    if key.shape[-1:] != (_KEY_WORDS,) or key.dtype != jnp.uint32:
        raise TypeError(
            f"Expected a d3p.random key (uint32 array of shape (8,)), got an array of "
            f"shape {key.shape} and dtype {key.dtype}. Create one with d3p.random.PRNGKey, or convert a JAX "
            "key with d3p.random.as_key."
        )
    if key.ndim != 1:
        raise ValueError(
            f"Expected a single key of shape (8,), got shape {key.shape}; use jax.vmap over "
            "a batch of keys."
        )
    return key


def _from_jax_key_data(words: jax.Array) -> PRNGState:
    """The key of this suite for the ``n`` (at most 8) uint32 words of a JAX
    key's data: ChaCha20 keyed by the words, zero-padded to 8, block 0 under
    nonce ``(4, n, 0)``, its first 8 words."""
    n = words.shape[0]
    chacha_key = jnp.zeros(_KEY_WORDS, jnp.uint32).at[:n].set(words)
    return chacha20_block(chacha_key, jnp.uint32(0), (_NONCE_FROM_JAX_KEY, n, 0))[:_KEY_WORDS]


def as_key(key, name: str = "rng_key") -> PRNGState:
    """``key`` as a key of this suite: a d3p key as it is, a JAX key converted.

    The kind is told by shape and dtype only, never by value (so a traced key
    works under ``jit``): a ``uint32`` array of shape ``(8,)`` is a key of
    this suite (:func:`PRNGKey`); a typed JAX key (``jax.random.key``, dtype
    ``key<...>``, shape ``()``) or a raw JAX key (``jax.random.PRNGKey``:
    ``uint32`` of shape ``(2,)`` for JAX's default Threefry) is converted to
    the key of this suite that ChaCha20, keyed by its key data, gives (see the
    module's table: nonce ``(4, n, 0)``); a typed key and the raw key with the
    same data and word count give the same key.

    **Formal guarantees.**

    - Deterministic: the same JAX key always gives the same key of this suite;
      distinct key data give keys as independent as ChaCha20 is a
      pseudo-random function. Everything drawn from the result is ChaCha20's
      keystream, whatever kind of key was given.
    - The result is only as secret as ``key``: a JAX key holds at most 64
      bits (Threefry), one made from a small seed such as ``PRNGKey(0)`` none.
      ``d3p.random.PRNGKey()`` without a seed draws 256 bits from the
      operating system.

    :param key: a key of this suite, a typed JAX key or a raw JAX key.
    :param str name: the argument's name, for the error message.
    :return: a ``uint32`` array of shape ``(8,)``.
    :raises TypeError: for anything else, naming ``name``.

    >>> import jax, d3p.random
    >>> bool((d3p.random.as_key(jax.random.key(0)) == d3p.random.as_key(jax.random.PRNGKey(0))).all())
    True
    """
    if is_typed_jax_key(key):
        if key.shape != ():
            raise TypeError(f"Expected {name} to be a single JAX key, got a key array of shape {key.shape}.")
        words = jnp.ravel(jax.random.key_data(key)).astype(jnp.uint32)
        if words.shape[0] > _KEY_WORDS:
            raise TypeError(f"Expected {name} to be a JAX key of at most {_KEY_WORDS} words of key data, got "
                            f"{words.shape[0]} (dtype {key.dtype}).")
        return _from_jax_key_data(words)
    if is_uint32_array(key, (_KEY_WORDS,)):
        return jnp.asarray(key)
    if is_uint32_array(key, raw_jax_key_shape()):
        return _from_jax_key_data(jnp.asarray(key))
    got = describe_key(key)
    raise TypeError(
        f"Expected {name} to be a d3p.random key (uint32 array of shape (8,), from d3p.random.PRNGKey), a "
        f"JAX key (jax.random.key) or a raw JAX key (uint32 array of shape {raw_jax_key_shape()}, from "
        f"jax.random.PRNGKey), got {got}."
    )


def PRNGKey(seed: Optional[Union[int, jax.typing.ArrayLike]] = None) -> PRNGState:
    """Create a key for the secure ChaCha20 suite.

    :param seed: ``None`` (default) draws a fresh 256-bit key from the operating
        system's entropy source (``os.urandom``); this is what private runs
        should use. A Python integer gives a reproducible key: its value
        modulo 2**256, as 256 bits, little-endian (negative integers too, as
        d3p 0.2 accepted them); ``bytes`` are read as a little-endian integer
        (``int.from_bytes(seed, "little")``) and then likewise; an integer
        array (also traced) fills the lowest word.
    :return: the key, a ``uint32`` array of shape ``(8,)``.

    **Formal guarantees.** With ``seed=None`` the key is uniform over 256 bits
    as far as the OS source is. A key from an integer seed is only as
    unpredictable as the seed: noise drawn from a guessable key gives no
    privacy.

    >>> import d3p.random
    >>> d3p.random.PRNGKey(0).shape
    (8,)
    """
    if seed is None:
        return jax.device_put(np.frombuffer(os.urandom(4 * _KEY_WORDS), dtype="<u4").astype(np.uint32))
    if isinstance(seed, (bool, np.bool_)):
        raise TypeError(f"Expected seed to be an integer or None, got seed={seed!r}.")
    if isinstance(seed, (bytes, bytearray)):
        seed = int.from_bytes(bytes(seed), "little")
    if isinstance(seed, (int, np.integer)):
        seed = int(seed) % 2**256
        words = [(seed >> (32 * i)) & 0xFFFFFFFF for i in range(_KEY_WORDS)]
        return jax.device_put(np.array(words, dtype=np.uint32))
    seed = jnp.asarray(seed)
    if not jnp.issubdtype(seed.dtype, jnp.integer) or seed.ndim != 0:
        raise TypeError(
            f"Expected seed to be an integer, bytes or None, got dtype {seed.dtype} shape {seed.shape}."
        )
    return jnp.zeros(_KEY_WORDS, jnp.uint32).at[0].set(seed.astype(jnp.uint32))


def split(key: PRNGState, num: int = 2) -> jax.Array:
    """Split a key into ``num`` new independent keys.

    :param key: a key of this suite.
    :param int num: number of keys to make (static).
    :return: ``uint32`` array of shape ``(num, 8)``.
    """
    key = _check_key(key)
    num = int(num)
    if num < 1:
        raise ValueError(f"Expected num >= 1, got num={num}.")
    return _keystream.block_words(key, np.arange(num, dtype=np.uint32), (_NONCE_SPLIT, 0, 0), _KEY_WORDS)


def fold_in(key: PRNGState, data: jax.typing.ArrayLike) -> PRNGState:
    """Derive a new key from ``key`` and a 32-bit integer ``data``.

    Distinct ``data`` values give independent keys (and keys independent of
    those from :func:`split`). ``data`` may be traced; an integer array is
    taken modulo 2**32, a Python integer must lie in ``[0, 2**32)``.
    """
    key = _check_key(key)
    return _keystream.block_words(key, np.uint32(0), (_NONCE_FOLD_IN, _data_word("data", data), 0), _KEY_WORDS)


def _data_word(name: str, data):
    """A 32-bit integer argument as ``uint32`` (traced or not): an integer array modulo
    2**32, a Python integer checked to lie in ``[0, 2**32)``."""
    if isinstance(data, (int, np.integer)) and not isinstance(data, (bool, np.bool_)):
        if not 0 <= int(data) < 2**32:
            raise ValueError(f"Expected {name} in [0, 2**32), got {name}={int(data)}.")
        data = np.uint32(int(data))
    if not isinstance(data, (np.ndarray, np.generic)):
        data = jnp.asarray(data)
    if not jnp.issubdtype(data.dtype, jnp.integer):
        raise TypeError(f"Expected integer {name}, got dtype {data.dtype}.")
    return data.astype(np.uint32) if data.dtype != np.uint32 else data


def _canonical_shape(shape) -> tuple:
    if isinstance(shape, (int, np.integer)):
        shape = (int(shape),)
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"Expected a shape of non-negative sizes, got shape={shape}.")
    return shape


def random_bits(key: PRNGState, bit_width: int = 32, shape: Sequence[int] = ()) -> jax.Array:
    """Uniformly random bits from the ChaCha20 keystream.

    :param key: a key of this suite.
    :param int bit_width: 8, 16, 32 or 64 (64 needs ``jax_enable_x64``).
    :param shape: output shape.
    :return: unsigned integers of ``bit_width`` bits, of the given shape.
    """
    key = _check_key(key)
    shape = _canonical_shape(shape)
    size = int(np.prod(shape, dtype=np.int64))
    if bit_width in (8, 16, 32):
        words = _keystream_words(key, max(size, 1))[:size]
        dtype = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}[bit_width]
        return words.astype(dtype).reshape(shape)
    if bit_width == 64:
        if not jax.config.jax_enable_x64:
            raise ValueError("bit_width=64 requires jax_enable_x64; use bit_width=32 otherwise.")
        words = _keystream_words(key, max(2 * size, 1))[: 2 * size].astype(jnp.uint64)
        return (words[0::2] | (words[1::2] << 32)).reshape(shape)
    raise ValueError(f"Expected bit_width in (8, 16, 32, 64), got bit_width={bit_width}.")


def _float_info(dtype):
    dtype = float_dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"Expected a floating dtype, got dtype={dtype}.")
    if dtype == jnp.float64 and not jax.config.jax_enable_x64:
        dtype = jnp.dtype(jnp.float32)
    return dtype


def uniform(
    key: PRNGState,
    shape: Sequence[int] = (),
    dtype=None,
    minval: jax.typing.ArrayLike = 0.0,
    maxval: jax.typing.ArrayLike = 1.0,
) -> jax.Array:
    """Uniform floats in ``[minval, maxval)``.

    ``dtype=None`` is JAX's default float dtype at the time of the call:
    float64 under ``jax_enable_x64``, float32 otherwise (float64 without it
    also gives float32).

    In ``[0, 1)`` the values are multiples of 2**-24 (float32), 2**-53
    (float64), 2**-11 (float16) or 2**-8 (bfloat16), every multiple with
    equal probability.
    """
    dtype = _float_info(dtype)
    shape = _canonical_shape(shape)
    if dtype == jnp.float64:
        bits = random_bits(key, 64, shape)
        unit = (bits >> 11).astype(jnp.float64) * (2.0**-53)
    else:
        # as many top bits as the dtype's significand holds: the value is exact
        # in float32 and in ``dtype``, so no rounding can move it (to 1.0 or
        # onto a neighbour)
        nbits = min(jnp.finfo(dtype).nmant + 1, 24)
        bits = random_bits(key, 32, shape)
        unit = (bits >> np.uint32(32 - nbits)).astype(jnp.float32) * np.float32(2.0**-nbits)
    minval = jnp.asarray(minval, dtype)
    maxval = jnp.asarray(maxval, dtype)
    out = minval + unit.astype(dtype) * (maxval - minval)
    # rounding in the affine map must not reach maxval
    return jnp.minimum(out, jnp.nextafter(maxval, minval)).astype(dtype)


# Minimax polynomial fits (in float64, against scipy's ndtri) of the ratio
# r = z / x, where z = -ndtri(p / 2) > 0 is the magnitude of a normal for the
# tail probability p in (0, 1), x = 1 - p and w = -log(p (2 - p)) (as in
# Giles, "Approximating the erfinv function", 2010: z = sqrt(2) erfinv(x)).
# Lowest order first; maximum relative error of r on each piece, in float64:
# central, w in [0, 5], in powers of (w - 2.5): 5.6e-9;
# tail 1, sqrt(w) in [sqrt(5), 4], in powers of (sqrt(w) - 3): 5.7e-9;
# tail 2, sqrt(w) in [4, 6.7], in powers of (sqrt(w) - 5.35): 2.8e-9.
# sqrt(w) <= 6.61 for every p >= 2**-64, the smallest this mapping produces.
_R_CENTRAL = (
    2.123313478571034, 0.3488020377085385, -0.00590771704040599, -0.0017716445609501658,
    0.00030878566707522384, -7.019230028793358e-06, -4.89700395485404e-06,
    6.592640257544607e-07, 3.2855917320162575e-08, -1.2432368787229642e-08,
)
_R_TAIL1 = (
    4.006434206349736, 1.416582492786826, 0.013358214700198934, -0.010803757275431786,
    0.008037219227410408, -0.005072766675714935, 0.0021154614649009917,
    -0.00010835611946569124, -0.0004507432418098256, 0.00018238285210708804,
)
_R_TAIL2 = (
    7.358841016587992, 1.4285481347636848, -0.0004468265595828913, -0.0001832542662933978,
    6.791006462703031e-05, -1.6863624169805025e-05, 4.481626752372847e-06,
    -1.0315594566323583e-06,
)


def _horner(coefficients, v):
    acc = np.float32(coefficients[-1])
    for c in coefficients[-2::-1]:
        acc = acc * v + np.float32(c)
    return acc


def _normal_magnitude_f32(h: jax.Array, lo: jax.Array) -> jax.Array:
    """``-ndtri(p / 2)`` in float32 for ``p = (h * 2**32 + lo + 0.5) / 2**63``
    (``h < 2**31`` and ``lo`` as uint32), without ``ndtri``: one log, one sqrt
    and three polynomials (see ``_R_CENTRAL``)."""
    f32 = jnp.float32

    def unit(a, b):  # (a * 2**32 + b + 0.5) / 2**63 in float32
        return (a.astype(f32) + (b.astype(f32) + f32(0.5)) * f32(2.0**-32)) * f32(2.0**-31)

    p = unit(h, lo)
    # x = 1 - p from the complemented bits: full relative precision also near p = 1
    x = unit(np.uint32(0x7FFFFFFF) - h, ~lo)
    # p (2 - p) = p (1 + x) lies in (0, 1]: no log(0); the clamp absorbs rounding above 1
    w = jnp.maximum(-jnp.log(p * (f32(1.0) + x)), f32(0.0))
    s = jnp.sqrt(w)
    r = jnp.where(
        w < f32(5.0),
        _horner(_R_CENTRAL, w - f32(2.5)),
        jnp.where(s < f32(4.0), _horner(_R_TAIL1, s - f32(3.0)), _horner(_R_TAIL2, s - f32(5.35))),
    )
    return x * r


def _normal_f32(hi: jax.Array, lo: jax.Array) -> jax.Array:
    """The normal of two keystream words (uint32 arrays) in float32: sign from bit 0 of ``hi``."""
    magnitude = _normal_magnitude_f32(hi >> np.uint32(1), lo)
    return jnp.where((hi & np.uint32(1)) == 1, -magnitude, magnitude)


def normal(key: PRNGState, shape: Sequence[int] = (), dtype=None) -> jax.Array:
    """Standard normal samples.

    ``dtype=None`` is JAX's default float dtype at the time of the call:
    float64 under ``jax_enable_x64``, float32 otherwise (float64 without it
    also gives float32).

    Each sample uses 64 keystream bits: one for the sign, 63 for a tail
    probability ``p`` in ``(0, 1)`` whose resolution is finest near 0, and the
    magnitude is the inverse normal CDF at ``p / 2``. Magnitudes up to about
    9.155 (at ``p = 2**-64``) are reachable, so the tails are correct to far
    below any privacy parameter in use (``P(abs(Z) > 9.15)`` < 6e-20), unlike
    inversion of a single 24-bit uniform, which stops at about 5.4.

    In float32 (also used for float16 and bfloat16, then rounded) the inverse
    CDF is a piecewise polynomial in ``-log(p (2 - p))`` or its square root
    (no ``ndtri``), whose relative error against the exact inverse CDF at the
    same ``p`` is below 6e-9 in exact arithmetic and a few float32 rounding
    units as computed (below 1e-6 over the whole range, measured in
    ``tests/test_random.py``): as a distribution, the output is the exact
    inverse-CDF transform up to a change of scale within ``1 +- 1e-6``. In
    float64 it is ``jax.scipy.special.ndtri``.
    """
    out_dtype = _float_info(dtype)
    shape = _canonical_shape(shape)
    size = int(np.prod(shape, dtype=np.int64))
    key = _check_key(key)
    if out_dtype == jnp.float64:
        words = _keystream_words(key, max(2 * size, 1))[: 2 * size]
        hi, lo = words[0::2], words[1::2]
        dtype = jnp.dtype(jnp.float64)
        # p = (h + (lo + 0.5) / 2**32) / 2**31, in (0, 1)
        p = ((hi >> np.uint32(1)).astype(dtype) + (lo.astype(dtype) + 0.5) * 2.0**-32) * 2.0**-31
        magnitude = -ndtri(p * 0.5)
        z = jnp.where((hi & np.uint32(1)) == 1, -magnitude, magnitude)
    else:
        # narrower floats (float16, bfloat16) cannot hold p: they are computed in float32
        z = _keystream.per_platform(
            functools.partial(_normal_f32_cpu, size=size), functools.partial(_normal_f32_of_keystream, size=size), key
        )
    return z.astype(out_dtype).reshape(shape)


def _normal_f32_of_keystream(key, size: int) -> jax.Array:
    """``size`` float32 normals, the transform of the keystream's word pairs."""
    words = _keystream_words(key, max(2 * size, 1))[: 2 * size]
    return _normal_f32(words[0::2], words[1::2])


def _normal_f32_cpu(key, size: int) -> jax.Array:
    """:func:`_normal_f32_of_keystream` as computed on CPU: the same function of
    the same words, arranged for XLA:CPU."""
    num_blocks = -(-size // 8)  # 8 normals per block of 16 words
    if num_blocks > 2 * _keystream._TILE_BLOCKS and not _keystream.host_cipher_available():
        # keystream tiles with the transform in the same loop: besides keeping
        # the tile in the cache, the loop materialises the samples once (XLA
        # would otherwise fuse the transform into every consumer)
        z = _keystream.keystream_in_tiles(key, num_blocks, lambda b: _normal_f32(b[:, 0::2], b[:, 1::2]))
        return z.reshape(-1)[:size]
    if 1 < num_blocks <= _keystream._SMALL_BLOCKS:
        # A few blocks (the noise of a small model): the transform runs one
        # block of words per loop step. As one operation on a few dozen
        # samples, XLA ran it on its thread pool, whose hand-over (20-30 us on
        # two cores) cost more than the rest of the draw. Same function.
        words = _keystream_words(key, 2 * size)
        padded = jnp.pad(words, (0, 16 * num_blocks - 2 * size)).reshape(num_blocks, 16)
        return lax.map(lambda w: _normal_f32(w[0::2], w[1::2]), padded).reshape(-1)[:size]
    if size >= _ONCE_MIN_SIZE:
        # computed once (in_two_halves), not fused into each parameter leaf's slice of the noise
        words = _keystream_words(key, 2 * size)
        return in_two_halves(_normal_f32, [words[0::2], words[1::2]], cpu_only=False)
    return _normal_f32_of_keystream(key, size)


#: From this many normals on, the CPU program computes them in a loop of two halves (:func:`_normal_f32_cpu`).
_ONCE_MIN_SIZE = 4096


def randint(
    key: PRNGState,
    shape: Sequence[int] = (),
    minval: jax.typing.ArrayLike = 0,
    maxval: jax.typing.ArrayLike = None,
    dtype=jnp.int32,
) -> jax.Array:
    """Uniform integers in ``[minval, maxval)``.

    Computed as ``minval + floor(x * span / 2**64)`` from a 64-bit keystream
    value ``x`` and ``span = maxval - minval`` (below 2**32): every value has
    probability within ``2**-32`` relative error of ``1/span`` (the largest absolute
    deviation is below ``2**-32``). ``minval`` and ``maxval`` may be traced arrays that
    broadcast against ``shape``; Python integer bounds are checked: the values
    ``minval`` to ``maxval - 1`` must fit in ``dtype``.
    """
    if maxval is None:
        raise TypeError("randint requires maxval (an upper bound, exclusive).")
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"Expected an integer dtype, got dtype={dtype}.")
    shape = _canonical_shape(shape)
    size = int(np.prod(shape, dtype=np.int64))
    key = _check_key(key)
    if isinstance(minval, (int, np.integer)) and isinstance(maxval, (int, np.integer)):
        minval, maxval = int(minval), int(maxval)
        if maxval <= minval:
            raise ValueError(f"Expected maxval > minval, got minval={minval}, maxval={maxval}.")
        if maxval - minval >= 2**32:
            raise ValueError(f"Expected maxval - minval < 2**32, got {maxval - minval}.")
        canonical = jax.dtypes.canonicalize_dtype(dtype)
        info = jnp.iinfo(canonical)
        if minval < info.min:
            raise ValueError(f"Expected minval >= {info.min} for dtype={dtype}, got minval={minval}.")
        if maxval - 1 > info.max:
            raise ValueError(f"Expected maxval <= {info.max + 1} for dtype={dtype}, got maxval={maxval}.")
        # built here, exactly: maxval itself need not fit in dtype (or in int32)
        minval_a = jnp.full(shape, minval, canonical)
        span = jnp.full((size,), maxval - minval, jnp.uint32)
    else:
        minval_a = jnp.broadcast_to(jnp.asarray(minval), shape)
        maxval_a = jnp.broadcast_to(jnp.asarray(maxval), shape)
        # the difference modulo 2**32 is the span, exactly, for any span below 2**32
        span = maxval_a.astype(jnp.uint32) - minval_a.astype(jnp.uint32)
        span = span.reshape(-1)
    words = _keystream_words(key, max(2 * size, 1))[: 2 * size]
    hi, lo = words[0::2], words[1::2]
    # floor((hi * 2**32 + lo) * span / 2**64)
    p1_hi, p1_lo = mulhi_u32(hi, span)
    p2_hi, _ = mulhi_u32(lo, span)
    carry = ((p1_lo + p2_hi) < p1_lo).astype(jnp.uint32)
    offset = p1_hi + carry
    out = minval_a.reshape(-1).astype(dtype) + offset.astype(dtype)
    return out.reshape(shape)


@functools.lru_cache(maxsize=None)
def _jax_key_words(impl: str) -> int:
    """The number of words of ``jax.random.PRNGKey`` under JAX's PRNG ``impl``
    (found once per implementation: tracing it at every call costs a trace)."""
    return jax.eval_shape(lambda: jax.random.PRNGKey(0)).shape[-1]


def convert_to_jax_rng_key(key: PRNGState) -> jax.Array:
    """Derive a key for ``jax.random`` (and NumPyro) from a key of this suite.

    The result has the shape of ``jax.random.PRNGKey`` under JAX's default
    implementation. Use it only where JAX's non-cryptographic generator is
    acceptable (e.g. the ELBO's Monte Carlo samples), never for privacy noise.
    """
    key = _check_key(key)
    n = _jax_key_words(jax.config.jax_default_prng_impl)
    return _keystream.block_words(key, np.uint32(0), (_NONCE_JAX_KEY, 0, 0), n)


def split_with_jax_key(key: PRNGState, num: int = 2) -> Tuple[jax.Array, jax.Array]:
    """``(split(key, num), convert_to_jax_rng_key(key))`` from one call of the
    block function: the ``num`` keys of :func:`split` and the key for
    ``jax.random`` of :func:`convert_to_jax_rng_key`, the same values, as
    ``num + 1`` blocks of one keystream call (their nonces tell them apart,
    so the JAX key is independent of the ``num`` keys).

    :return: ``(uint32[num, 8], uint32[n])`` with ``n`` the words of
        ``jax.random.PRNGKey`` under JAX's default implementation.
    """
    keys, jax_keys = split_with_jax_keys(key, num, 1)
    return keys, jax_keys[0]


def split_with_jax_keys(key: PRNGState, num: int, count: int) -> Tuple[jax.Array, jax.Array]:
    """``split(key, num)`` and ``count`` keys for ``jax.random``, from one call
    of the block function. The JAX keys are the first ``count * n`` words of
    the keystream of ``key`` under :func:`convert_to_jax_rng_key`'s nonce
    ``(3, 0, 0)`` (block counters 0, 1, ...), ``n`` words each: the first is
    ``convert_to_jax_rng_key(key)``, and all are independent of each other
    and of the ``num`` keys. A private step takes its keys so: its own, and
    a Monte Carlo key for each record and one for the draw the batch
    shares, in one block-function loop of the compiled step, where a split
    of one JAX key would evaluate Threefry in the program again (on a GPU
    each loop iteration is a launch of its own).

    :return: ``(uint32[num, 8], uint32[count, n])`` with ``n`` the words of
        ``jax.random.PRNGKey`` under JAX's default implementation.
    """
    key = _check_key(key)
    num, count = int(num), int(count)
    if num < 1:
        raise ValueError(f"Expected num >= 1, got num={num}.")
    if count < 1:
        raise ValueError(f"Expected count >= 1, got count={count}.")
    n = _jax_key_words(jax.config.jax_default_prng_impl)
    blocks = -(-count * n // 16)
    counter = np.concatenate([np.arange(num, dtype=np.uint32), np.arange(blocks, dtype=np.uint32)])
    tag = np.array([_NONCE_SPLIT] * num + [_NONCE_JAX_KEY] * blocks, dtype=np.uint32)
    # on CPU one block at a time (_keystream.KEY_LOOP_BLOCKS): half the compile time of vectorised rounds
    words = _keystream.block_words(key, counter, (tag, 0, 0), loop_blocks=_keystream.KEY_LOOP_BLOCKS)
    return words[:num, :_KEY_WORDS], words[num:].reshape(-1)[:count * n].reshape(count, n)


def stream_words(key: PRNGState, data: jax.typing.ArrayLike, counts: Sequence[int],
                 first: jax.typing.ArrayLike = 0) -> Tuple[jax.Array, ...]:
    """The first ``counts[s]`` words of streams ``first``, ``first + 1``, ... of
    ``(key, data)``, from one call of the block function.

    Stream ``j`` of ``(key, data)`` is the keystream of ``key`` under the
    nonce ``(5, data, j)`` (block counter 0 on): for distinct ``(data, j)``
    the streams are independent of each other and of every other use of
    ``key`` (:func:`split`, :func:`fold_in`, :func:`random_bits` and
    :func:`convert_to_jax_rng_key` take other nonces). A sampler draws a
    batch's words so, from the batch's key with ``data`` 0, one stream per
    use (:mod:`d3p.minibatch`).

    :param data: a 32-bit integer, may be traced (as :func:`fold_in`'s).
    :param counts: the number of words of each stream (static, each >= 1).
    :param first: the index of the first stream (may be traced).
    :return: a tuple of ``uint32[counts[s]]``.
    """
    key = _check_key(key)
    counts = [int(c) for c in counts]
    if not counts or min(counts) < 1:
        raise ValueError(f"Expected counts of at least one word each, got counts={counts}.")
    blocks = [-(-c // 16) for c in counts]
    counter = np.concatenate([np.arange(b, dtype=np.uint32) for b in blocks])
    stream = np.concatenate([np.full(b, j, dtype=np.uint32) for j, b in enumerate(blocks)])
    first = _data_word("first", first)
    words = _keystream.block_words(key, counter, (_NONCE_STREAMS, _data_word("data", data), stream + first))
    out, start = [], 0
    for c, b in zip(counts, blocks):
        out.append(words[start:start + b].reshape(-1)[:c])
        start += b
    return tuple(out)
