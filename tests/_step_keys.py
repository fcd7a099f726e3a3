# SPDX-License-Identifier: Apache-2.0
"""The Monte Carlo keys of a private step, derived here from their definition.

A step whose state holds the ChaCha20 key ``rng_key`` gives record ``i`` of
its batch of ``B`` the JAX key made of words ``2i`` and ``2i + 1`` of the
keystream of ``rng_key`` under nonce ``(3, 0, 0)`` (block counters 0, 1,
...), and the draw the batch shares the next key, ``B`` (JAX's default
Threefry keys, two words each); the sites of that shared draw (outside the
records' plates) take the keys after it, in the order of their names. The
words come from RFC 8439's block function as
:func:`d3p.random.chacha.chacha20_block` computes it (checked against the
RFC's vector and OpenSSL in ``tests/test_random_host_blocks.py`` and
``tests/test_random_platforms.py``), not from the suite function the step
calls.
"""

import jax
import numpy as np

from d3p.random import chacha


def jax_key_words(rng_key, count: int) -> np.ndarray:
    """``uint32[count, 2]``: the first ``count`` JAX keys of ``rng_key``'s stream under nonce (3, 0, 0)."""
    assert jax.random.PRNGKey(0).shape == (2,), "the reference is written for JAX's default Threefry keys"
    blocks = -(-2 * count // 16)
    words = np.asarray(chacha.chacha20_block(np.asarray(rng_key), np.arange(blocks, dtype=np.uint32), (3, 0, 0)))
    return words.reshape(-1)[:2 * count].reshape(count, 2)


def record_keys(rng_key, B: int) -> np.ndarray:
    """The ``B`` records' Monte Carlo keys of the step from ``rng_key`` (raw Threefry keys)."""
    return jax_key_words(rng_key, B + 1)[:B]


def shared_key(rng_key, B: int) -> np.ndarray:
    """The key of the draw shared by a batch of ``B`` records in the step from ``rng_key``."""
    return jax_key_words(rng_key, B + 1)[B]


def site_keys(rng_key, B: int, names) -> dict:
    """The keys of the shared draw's sites ``names`` in the step from ``rng_key``
    with a batch of ``B`` records: keys ``B + 1, B + 2, ...`` in the order of the names."""
    names = sorted(names)
    words = jax_key_words(rng_key, B + 1 + len(names))
    return {name: words[B + 1 + i] for i, name in enumerate(names)}
