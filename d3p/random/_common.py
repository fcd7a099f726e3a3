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


def in_two_halves(fn, xs, axis: int = 0, out_axis: int = 0, cpu_only: bool = True):
    """``fn(*xs)`` computed in a ``lax.scan`` of two steps, each over one half
    of ``xs`` along ``axis``, for a ``fn`` that computes each position along
    ``axis`` of its arguments into the same position along ``out_axis`` of
    each of its outputs (an array or a tuple of arrays). The same values.

    Why: a loop's output is a buffer, so XLA computes it once. Left to fuse
    freely, XLA:CPU copies a cheap elementwise computation into every kernel
    that reads it (a Threefry evaluation into each consumer of its bits, the
    noise's transform into each parameter's slice of it, a sum over records
    into each parameter's slice of the sum): programs several times larger,
    which compile several times slower. XLA:CPU drops optimization barriers
    before it fuses, so a barrier does not do this. With ``cpu_only`` (the
    default) only programs lowered for CPU take the loop
    (``jax.lax.platform_dependent``); other platforms compute ``fn(*xs)``.
    """
    n = xs[0].shape[axis]
    if n < 2:
        return fn(*xs)
    half = -(-n // 2)

    def halves(x):
        x = jnp.moveaxis(x, axis, 0)
        x = jnp.pad(x, [(0, 2 * half - n)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape((2, half) + x.shape[1:])

    def looped(*xs):
        _, out = jax.lax.scan(lambda carry, h: (carry, fn(*(jnp.moveaxis(x, 0, axis) for x in h))), None,
                              [halves(x) for x in xs])
        # the halves joined along out_axis, cut to n
        return jax.tree.map(
            lambda y: jax.lax.slice_in_dim(jnp.concatenate([y[0], y[1]], axis=out_axis), 0, n, axis=out_axis), out)

    if not cpu_only:
        return looped(*xs)
    return jax.lax.platform_dependent(*xs, cpu=looped, default=fn)


def on_the_host(value) -> bool:
    """Whether an eager operation on ``value`` may run in NumPy instead (a
    JAX operation outside a traced program compiles a program for its shape):
    ``value`` is concrete (no tracer) and, if a JAX array, uncommitted on one
    device, so that ``jax.device_put`` of the result lands where the eager
    operation's would (the default device, uncommitted)."""
    if isinstance(value, jax.core.Tracer):
        return False
    return not isinstance(value, jax.Array) or (not value.committed and len(value.devices()) == 1)


def unstacked(keys) -> list:
    """The rows of ``keys`` (e.g. of ``split``) as a list: split on the host
    where :func:`on_the_host` allows, else iterated as they are."""
    if isinstance(keys, (jax.Array, np.ndarray)) and keys.dtype == np.uint32 and on_the_host(keys):
        return [jax.device_put(row) for row in np.asarray(keys)]
    return list(keys)


def stream_words(rng_suite, key, data, counts, first=0) -> tuple:
    """``rng_suite.stream_words(key, data, counts, first)`` (both of d3p's suites have it: one
    block-function call with ChaCha20), or for a suite with the plain interface the words of
    ``random_bits(fold_in(fold_in(key, data), first + j), 32, (counts[j],))``: independent
    streams of 32-bit words, one per use, for a sampler's batch ``data``."""
    own = getattr(rng_suite, "stream_words", None)
    if own is not None:
        return own(key, data, counts, first)
    return composed_stream_words(rng_suite.fold_in, rng_suite.random_bits, key, data, counts, first)


def composed_stream_words(fold_in, random_bits, key, data, counts, first=0) -> tuple:
    """The streams of a suite's plain interface (its ``fold_in`` and ``random_bits``):
    stream ``j`` of ``(key, data)`` is ``random_bits(fold_in(fold_in(key, data), j), 32, (count,))``."""
    outer = fold_in(key, data)
    return tuple(random_bits(fold_in(outer, jnp.uint32(first) + np.uint32(j)), 32, (int(c),))
                 for j, c in enumerate(counts))
