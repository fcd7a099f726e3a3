"""JAX's default generator (Threefry-2x32) as a loop-free JAX PRNG implementation.

On CPU, ``jax.random`` lowers each Threefry-2x32 evaluation to a rolled loop
over its five groups of four rounds, and XLA runs every loop iteration as
several small kernels. A per-record ELBO draws a few guide samples and splits
a few keys for each of the B records of a batch, so that loop overhead was
most of a private step on small models (the hierarchical logistic regression
of ``benchmarks/dpsvi_vs_svi.py``: 3.3 times its non-private step).

This module registers the same generator with its 20 rounds written out. On
CPU each evaluation (of ``split`` and ``random_bits``) runs as a ``lax.scan``
of two steps, each computing half of the values: a loop's output is a
buffer, so XLA computes the values once (XLA:CPU drops optimization
barriers before it fuses). Without the loop, XLA:CPU fused the whole
evaluation into every kernel that read its values, up to seven copies of
each in a private step of the logistic regression, which made the step
compile 2.7 times slower (8.4 s against 3.1 s; ``benchmarks/compile.py``).
On other platforms the rounds are written out without a loop, as
``jax.random`` lowers them there. The key
derivations (``split``, ``fold_in``) and the bit streams (``random_bits``)
are those of ``jax.random`` with its default ``threefry2x32`` implementation
and ``jax_threefry_partitionable=True`` (JAX's default): wrapping raw key data
with :func:`fast_key` changes how the values are computed, never the values
(``tests/test_random_threefry.py`` checks this bit for bit, also under ``vmap``).

It carries no privacy role: DPSVI uses it only for the Monte Carlo samples of
the ELBO, which JAX's generator draws anyway. Privacy noise and batch
selection come from the ChaCha20 suite.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import define_prng_impl

from d3p.random._common import in_two_halves, rotl_u32

__all__ = ["threefry2x32", "fast_key", "IMPL"]

# Threefry-2x32: rotation constants of its eight round positions and the key
# schedule parity constant (Salmon et al., "Parallel random numbers: as easy
# as 1, 2, 3", SC 2011)
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = np.uint32(0x1BD11BDA)


def threefry2x32(k0, k1, x0, x1):
    """Threefry-2x32 with 20 rounds of the counter ``(x0, x1)`` under the key
    ``(k0, k1)``; all ``uint32`` arrays (broadcast together). Returns the two
    output words."""
    schedule = (k0, k1, k0 ^ k1 ^ _PARITY)
    x0 = x0 + schedule[0]
    x1 = x1 + schedule[1]
    for group in range(5):
        for r in _ROTATIONS[group % 2]:
            x0 = x0 + x1
            x1 = rotl_u32(x1, r) ^ x0
        x0 = x0 + schedule[(group + 1) % 3]
        x1 = x1 + schedule[(group + 2) % 3] + np.uint32(group + 1)
    return x0, x1


def _index_words(shape):
    """The flat index of every position of ``shape`` as (high, low) uint32 words."""
    size = int(np.prod(shape, dtype=np.int64))
    if size >= 2**32:
        raise ValueError(f"Expected fewer than 2**32 values, got shape {tuple(shape)}.")
    low = jnp.arange(size, dtype=jnp.uint32).reshape(shape)
    return jnp.zeros(shape, jnp.uint32), low


def _seed(seed):
    seed = jnp.asarray(seed)
    if seed.ndim != 0 or not jnp.issubdtype(seed.dtype, jnp.integer):
        raise TypeError(f"Expected an integer scalar seed, got dtype {seed.dtype} and shape {seed.shape}.")
    low = seed.astype(jnp.uint32)
    if seed.dtype.itemsize == 8:
        high = (seed.astype(jnp.uint64) >> np.uint64(32)).astype(jnp.uint32)
    else:
        high = jnp.uint32(0)
    return jnp.stack([high, low])


def _evaluated_once(key, high, low):
    """``threefry2x32(*key, high, low)``, on CPU in a loop of two halves
    (:func:`d3p.random._common.in_two_halves`, see the module docstring);
    elsewhere written out, as ``jax.random`` lowers it for GPUs."""
    shape = high.shape
    b0, b1 = in_two_halves(lambda h, lo: threefry2x32(key[0], key[1], h, lo), [high.reshape(-1), low.reshape(-1)])
    return b0.reshape(shape), b1.reshape(shape)


def _split(key, shape):
    high, low = _index_words(shape)
    b0, b1 = _evaluated_once(key, high, low)
    return jnp.stack([b0, b1], axis=-1)


def _fold_in(key, data):
    b0, b1 = threefry2x32(key[0], key[1], jnp.uint32(0), jnp.asarray(data).astype(jnp.uint32))
    return jnp.stack([b0, b1])


def _random_bits(key, bit_width, shape):
    high, low = _index_words(shape)
    b0, b1 = _evaluated_once(key, high, low)
    if bit_width == 64:
        return (b0.astype(jnp.uint64) << np.uint64(32)) | b1.astype(jnp.uint64)
    bits = b0 ^ b1
    if bit_width == 32:
        return bits
    return bits.astype({8: jnp.uint8, 16: jnp.uint16}[bit_width])


#: The implementation, for ``jax.random.wrap_key_data(data, impl=IMPL)``.
IMPL = define_prng_impl(
    key_shape=(2,),
    seed=_seed,
    split=_split,
    random_bits=_random_bits,
    fold_in=_fold_in,
    name="d3p_threefry2x32_unrolled",
    tag="d3pfry",
)


def fast_key(key: jax.Array) -> jax.Array:
    """``key`` with the loop-free Threefry-2x32 implementation, where that
    gives the same values as ``jax.random`` would give for ``key``.

    :param key: a raw key of ``jax.random`` (``uint32`` data of shape
        ``(..., 2)``) or a typed key.
    :return: a typed key array of :data:`IMPL` if ``key`` is raw Threefry key
        data and JAX's default implementation is ``threefry2x32`` with
        ``jax_threefry_partitionable`` set; otherwise ``key`` unchanged.
    """
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key
    if (
        key.dtype != jnp.uint32
        or key.shape[-1:] != (2,)
        or jax.config.jax_default_prng_impl != "threefry2x32"
        or not jax.config.jax_threefry_partitionable
    ):
        return key
    return jax.random.wrap_key_data(key, impl=IMPL)
