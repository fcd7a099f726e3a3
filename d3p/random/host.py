"""Float64 standard normals on the host, from the words of a PRNG suite.

JAX computes in float64 only under ``jax_enable_x64``. A mechanism that must
add its noise in float64 whatever that flag says (the marginal twin adds it
to exact integer counts, :mod:`d3p.twin.marginal`) draws it here: the
suite's uniform 32-bit words come from JAX, and the transform to a normal
runs in NumPy and SciPy, always in float64.

The transform is the one of ``d3p.random.normal(key, shape, jnp.float64)``
under ``jax_enable_x64``: two words per value, one bit for the sign and 63 for
a tail probability ``p`` in ``(0, 1)``, and the magnitude ``-ndtri(p / 2)``.
With the secure suite both give the same values up to the last bits of the
two ``ndtri`` implementations.
"""

from typing import Sequence

import jax
import numpy as np
from scipy.special import ndtri

from d3p import _validate

__all__ = ["normal_float64"]


def _normal_of_words(hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """The normal of two words (uint32 arrays): sign from bit 0 of ``hi``, and
    ``-ndtri(p / 2)`` with ``p = (hi // 2 + (lo + 0.5) / 2**32) / 2**31``."""
    hi = np.asarray(hi, np.uint32)
    lo = np.asarray(lo, np.uint32)
    p = ((hi >> np.uint32(1)).astype(np.float64) + (lo.astype(np.float64) + 0.5) * 2.0**-32) * 2.0**-31
    magnitude = -ndtri(0.5 * p)
    return np.where((hi & np.uint32(1)) == 1, -magnitude, magnitude)


def normal_float64(key, shape: Sequence[int] = (), rng_suite=None) -> np.ndarray:
    """Standard normal samples as a float64 NumPy array, with or without ``jax_enable_x64``.

    :param key: a key of ``rng_suite`` (required: privacy noise needs a secret key).
    :param shape: the output shape, a tuple of non-negative integers.
    :param rng_suite: the PRNG suite of ``key``: ``None`` (default) is
        :mod:`d3p.random` (ChaCha20); :mod:`d3p.random.debug` for debugging.
    :return: a ``numpy.ndarray`` of float64 and ``shape``.

    **Formal guarantees.**

    * Value ``i`` is a function of the suite's words ``2i`` and ``2i + 1`` of
      ``rng_suite.random_bits(key, 32, (2 * size,))`` only: a fair sign and
      the inverse-CDF transform of a tail probability ``p`` on a lattice of
      spacing ``2**-63`` (rounded to float64, whose spacing near ``p = 1`` is
      ``2**-53``), so that every value's law is the standard normal's up to
      that discretisation and the float64 accuracy of ``scipy.special.ndtri``.
    * The magnitude is non-increasing in ``p``; magnitudes up to about 9.155
      are reachable (``P(|Z| > 9.15) < 6e-20``).
    * Consecutive attainable magnitudes are less than ``2**-15`` apart wherever
      ``|Z| < 8.1`` (``P(|Z| >= 8.1) < 5.5e-16``), and less than ``2**-23``
      apart wherever ``|Z| < 7.4`` (``P(|Z| >= 7.4) < 1.4e-13``; measured in
      ``tests/test_random_host.py``).
    * As privacy noise, the values are secret as far as ``key`` is and the
      words are indistinguishable from uniform: true of ChaCha20
      (:mod:`d3p.random`), not of :mod:`d3p.random.debug`.

    >>> import d3p.random
    >>> z = d3p.random.normal_float64(d3p.random.PRNGKey(0), (2, 3))
    >>> z.shape, z.dtype
    ((2, 3), dtype('float64'))
    """
    if key is None:
        raise ValueError("Expected an explicit key for normal_float64, got key=None.")
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (shape,)
    if not isinstance(shape, (tuple, list)):
        raise _validate.InvalidArgumentType(
            f"Expected shape to be a tuple of non-negative integers, got shape={shape!r}."
        )
    shape = tuple(_validate.integer(f"shape[{i}]", s, minimum=0) for i, s in enumerate(shape))
    if rng_suite is None:
        import d3p.random as rng_suite  # here, as d3p.random imports this module
    rng_suite = _validate.rng_suite("rng_suite", rng_suite)
    size = int(np.prod(shape, dtype=np.int64))
    if size == 0:
        return np.zeros(shape, np.float64)
    words = np.asarray(jax.device_get(rng_suite.random_bits(key, 32, (2 * size,))), np.uint32)
    return _normal_of_words(words[0::2], words[1::2]).reshape(shape)
