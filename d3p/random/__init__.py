"""Secure randomness for d3p: a PRNG suite on ChaCha20 (RFC 8439) in pure JAX.

The suite is a module with a fixed interface (``PRNGKey``, ``PRNGState``,
``split``, ``fold_in``, ``random_bits``, ``uniform``, ``normal``, ``randint``,
``convert_to_jax_rng_key``). Pass ``rng_suite=d3p.random`` (the default) to
d3p's samplers and to :class:`d3p.svi.DPSVI` for privacy noise and batch
selection; ``d3p.random.debug`` has the same interface on JAX's fast,
non-cryptographic generator and is meant for debugging only. :func:`as_key`
turns a JAX key (``jax.random.key``, ``jax.random.PRNGKey``) into a key of
the secure suite; d3p's entry points (``DPSVI.init``, ``update``, ``run``,
``evaluate``, the samplers, the twin's ``fit``) apply it to the keys they are
given.

Both suites also have :func:`split_with_jax_key` (``split`` and
``convert_to_jax_rng_key`` of one key, independent of each other; with ChaCha20
from one call of the block function), :func:`split_with_jax_keys` (the same
with as many JAX keys as asked for) and :func:`stream_words` (independent
streams of 32-bit words of one key, in one call), with which a private step
takes its keys and a sampler its words; a suite with the plain interface
does without them (``d3p._private_step``, :func:`d3p.random._common.stream_words`).
"""

from d3p.random import debug
from d3p.random._common import SUITE_API
from d3p.random.chacha import (  # noqa: F401 (re-exported, see __all__)
    PRNGKey,
    as_key,
    PRNGState,
    convert_to_jax_rng_key,
    fold_in,
    normal,
    randint,
    random_bits,
    split,
    split_with_jax_key,
    split_with_jax_keys,
    stream_words,
    uniform,
)

from d3p.random.discrete import discrete_gaussian
from d3p.random.host import normal_float64

__all__ = [*SUITE_API, "as_key", "debug", "discrete_gaussian", "normal_float64", "split_with_jax_key",
           "split_with_jax_keys", "stream_words"]
