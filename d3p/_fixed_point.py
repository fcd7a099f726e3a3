"""The clipped sum in fixed point: exact integer accumulation on a public grid.

Every entry of a record's clipped contribution is rounded to a grid of
spacing ``2^(e - k)`` (``2^e`` the power of two above the threshold; ``k``
from the dtype, see ``_FixedPoint``), the grid values are added as integers,
exactly and in any order (``_to_grid``), and the exact integer sum is
rounded once to a float (``_from_grid``). Why this keeps the released sum
within ``C`` of its neighbour's is stated in :mod:`d3p.gradients`.
"""
from typing import Any, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from d3p._certified_sum import _sum_margin, _sum_rel
from d3p._clipping import _acc_dtype, _exponent, _times_pow2

PyTree = Any


class _FixedPoint(NamedTuple):
    """How the clipped contributions are summed exactly, as integers on a
    public grid (static: from the parameters' dtypes and sizes only, the
    same for every batch size and strategy).

    - **int_dtype** - ``int32`` for a float32 accumulation, ``int64`` for float64.
    - **k** - every entry ``c`` (``|c| < 2^e``, ``2^e`` the power of two above
      the threshold ``C (1 - η)``) becomes the integer ``q = round(c 2^(k - e))``,
      ``|q| <= 2^k``: the grid spacing is ``2^(e - k) <= 2^(1 - k) C``.
    - **m** - ``q = 2^m h + l`` with ``0 <= l < 2^m``: the sums of ``h`` and of
      ``l`` over up to ``slots`` records cannot overflow.
    - **slots** - the most record slots one device sums (the margin's limit).
    - **fraction** - ``η_q = sqrt(P) 2^(1 - k)`` (rounded up): the fraction of
      the threshold reserved for the grid (``P`` parameter entries; each entry
      moves by at most one spacing), so that a record's contribution on the
      grid still has norm at most ``C (1 - η)``.
    """

    int_dtype: Any
    k: int
    m: int
    slots: int
    fraction: float


def _fixed_point(params: PyTree) -> Optional[_FixedPoint]:
    """The :class:`_FixedPoint` of a sum of gradients shaped like ``params``
    (the accumulation dtype, float32 or float64, gives an integer type of its
    width: a float64 accumulation implies ``jax_enable_x64``), or None where
    the grid would take more than ``η / 16`` of the threshold."""
    leaves = jax.tree.leaves(params)
    dtypes = [jnp.result_type(x) for x in leaves]
    acc = _acc_dtype(*dtypes)
    int_dtype = {4: jnp.int32, 8: jnp.int64}[jnp.dtype(acc).itemsize]
    bits = 8 * jnp.dtype(acc).itemsize - 1   # magnitude bits of the signed integer
    rel = _sum_rel(acc, dtypes, 0, 1)
    slots = int(_sum_margin(acc, *dtypes) / (2 * rel))
    slot_bits = int(np.ceil(np.log2(slots + 1))) + 1
    m = bits - slot_bits
    k = min(bits - 1, 2 * m)
    P = sum(int(np.size(x)) for x in leaves)
    fraction = float(np.sqrt(max(P, 1))) * 2.0 ** (1 - k) * (1 + 1e-6)
    if m < 1 or fraction > _sum_margin(acc, *dtypes) / 16:
        return None
    return _FixedPoint(int_dtype, k, m, slots, fraction)


def _grid_shift(fp: _FixedPoint, threshold: jax.Array) -> jax.Array:
    """``k - e``: entries times ``2^(k - e)`` lie in ``[-2^k, 2^k]`` (``2^e``
    the power of two above ``threshold``; exact from its bits)."""
    return np.int32(fp.k) - (_exponent(threshold) + np.int32(1))


def _to_grid(fp: _FixedPoint, x: jax.Array, shift: jax.Array) -> Tuple[jax.Array, jax.Array]:
    """``(Σ h, Σ l)`` over the leading (record) axis of ``x`` (entries below the
    threshold in magnitude): each entry scaled by ``2^shift`` (exact, barring
    values below the smallest normal number), rounded to the nearest integer
    ``q`` (an exact operation) and split as ``q = 2^m h + l``, ``0 <= l < 2^m``
    (two's complement: ``l`` the low bits, ``h`` the arithmetic shift). The
    sums are exact: at most ``slots`` terms of magnitude at most ``2^(k - m)``
    and ``2^m``."""
    q = jnp.round(_times_pow2(x, shift)).astype(fp.int_dtype)
    low = q & np.asarray((1 << fp.m) - 1, fp.int_dtype)
    high = q >> np.asarray(fp.m, fp.int_dtype)
    return jnp.sum(high, axis=0, dtype=fp.int_dtype), jnp.sum(low, axis=0, dtype=fp.int_dtype)


def _from_grid(fp: _FixedPoint, high: jax.Array, low: jax.Array, shift: jax.Array, dtype) -> jax.Array:
    """The float nearest the exact ``Z = 2^m Σh + Σl``, times ``2^-shift``: one
    rounding of ``Z`` (correctly rounded addition of two exact floats) and an
    exact scaling by a power of two (barring results below the smallest
    normal number)."""
    int_t = fp.int_dtype
    high = high + (low >> np.asarray(fp.m, int_t))   # carry: 0 <= low < 2^m after
    low = low & np.asarray((1 << fp.m) - 1, int_t)
    top = high.astype(dtype)                          # rounded
    rest = high - top.astype(int_t)                   # its rounding error, exactly
    exact_top = top * np.asarray(2.0**fp.m, dtype)    # exact
    exact_rest = ((rest << np.asarray(fp.m, int_t)) + low).astype(dtype)   # below 2^(m + 8): exact
    return _times_pow2(exact_top + exact_rest, -shift)

