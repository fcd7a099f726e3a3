"""Per-record gradients, clipping and the noisy sum: the privacy-critical math.

Everything here is a pure JAX function of explicit inputs. :class:`d3p.svi.DPSVI`
wires them together; they can also be used on their own to build other
DP-SGD style algorithms.

Glossary: clipping threshold ``C``, noise multiplier ``sigma`` (``dp_scale``),
batch size ``B`` (the number of record slots, real or padded).

Each privacy primitive has exactly one implementation, here, which
:func:`clip_gradient`, :func:`total_norm` and every gradient strategy
(``"vmap"``, ``"chunked"``, ``"scan"`` and ``"ghost"``, whose ghost norms live
in the private helper ``d3p._ghost``) use:

- the overflow-safe norm bound: ``_norm_bound`` (scaling by powers of two in
  ``_unit_scaled``, the bound of a scaled norm in ``_scaled_norm_bound``);
  the bound of a record's gradient over all its leaves: ``_record_bound``;
  ghost norms (``d3p._ghost.gram_bound``) build on ``_unit_scaled``,
  ``_scaled_norm_bound`` and ``_norm_bound``;
- the sum over records and its public error bound: ``_FixedPoint``,
  ``_to_grid`` and ``_from_grid`` (exact integer accumulation on a public
  grid, for per-record gradients), ``_df_add`` and ``_df_tree``
  (double-float accumulation, for ghost products and across devices),
  ``_SumBudget`` (the threshold every record is clipped to and the check
  that the sum's error fits the margin);
- the clip factor: ``_clip_factor`` (with ``_flush_slack``), turned into the
  per-record decision by ``_clip_decision`` and applied by ``_keep_records``;
- the noise standard deviation: :func:`noise_std`;
- the noise addition: :func:`add_gaussian_noise`, the only place where
  continuous privacy noise is drawn in JAX (``d3p.random.discrete_gaussian``
  draws the discrete mechanism's integers, ``d3p.random.normal_float64`` the
  marginal twin's float64 noise on the host).

Strategies (:data:`STRATEGIES`) of :func:`clipped_grad_sum`, which all
compute the same clipped sum up to float rounding (except that ``"ghost"``
clips records with several rows per product by their rows' magnitudes, see
:func:`clipped_grad_sum`):

- ``"auto"`` (default): chosen from static information by
  :func:`choose_strategy`;
- ``"vmap"``: all ``B`` per-record gradients at once (whatever the memory
  budget);
- ``"chunked"``: ``chunk_size`` records at a time under ``lax.scan``
  (default: as many as fit ``memory_budget_bytes``);
- ``"scan"``: one record at a time;
- ``"ghost"``: per-record gradient norms from the activations and output
  gradients of the dense products in which a parameter is used (the norm
  of ``Σ_r |a_r| |δ_r|ᵀ``, from ``Σ (|a_u|·|a_v|)(|δ_u|·|δ_v|)``, with a
  certified bound of its rounding error), and the clipped sum as matrix
  products over the rows of all records, never
  forming per-record gradients of such parameters (those whose every use,
  through reshapes and transposes, is an operand of a ``dot_general``
  without batch dimensions); exact per-record gradients for the other
  parameters in the same pass (all of them, if none qualifies). Chunked like
  ``"chunked"`` when the per-record activations exceed the budget; the
  matrix product contracts at most ``k`` rows at a time, ``k`` falling as
  ``B`` grows so that its rounding fits the margin (``"auto"`` takes exact
  per-record gradients where not even ``k = 1`` fits).

Why the clipping bound holds (the formal guarantees of
:func:`clipped_grad_sum` and :func:`clip_gradient`), by construction rather
than by testing:

- the norm used for clipping is an upper bound of the exact norm of the very
  values that are then scaled and summed (per-record gradients, or under
  ``"ghost"`` the activations and output gradients of the dense products, see
  ``d3p._ghost.gram_bound``), computed with exact scaling by powers of two
  and increased by the worst-case error of every rounding that produced it,
  for any order of summation;
- every product that feeds a bound or the sum runs at
  ``lax.Precision.HIGHEST`` (not TF32);
- the clipping factor leaves room for the rounding of applying it and for
  values flushed below the smallest normal number (``_clip_factor``), and a
  factor that would itself be below the smallest normal number is 0.

Why the released sum moves by at most ``C`` when one record is added or
removed, whatever the order of the records and whatever the others are:

- every record is clipped to ``C (1 - η)`` (exact norm of what is added for
  it, as above), ``η`` a public constant of the sum's dtype (``_sum_margin``:
  ``2^-7`` for float32, ``2^-30`` for float64), the same for every batch
  size, strategy and number of devices, so that the other records' clipped
  contributions do not change when one record is added or removed, even if
  the number of slots ``B`` changes with it;
- where per-record gradients are formed (every strategy but ``"ghost"``,
  with a finite ``C``), each clipped contribution is put on a public grid
  (``_FixedPoint``: spacing ``2^(e - k)``, ``2^e`` the power of two above
  ``C (1 - η)``, ``k = 28`` for float32 and ``62`` for float64; every entry
  rounded to the nearest grid point, the record clipped to
  ``C (1 - η)(1 - η_q)`` first so that on the grid its norm is still at most
  ``C (1 - η)``, ``η_q = sqrt(P) 2^(1 - k)``) and the grid values are added
  as integers, exactly, in any order; the float result is the exact integer
  sum rounded once (``_from_grid``). The sum of the contributions is then
  exact, and ``F`` is within ``u ‖S‖`` of it (``u`` the unit roundoff): the
  bound below with ``ε_B = u``. The grid depends on ``C``, the dtype and
  ``P`` only, never on the batch. Its spacing, at most ``2^-27 C`` per
  entry in float32, is the absolute precision of the clipped sum there
  (far below noise of standard deviation ``σ C`` for any ``σ`` above about
  ``1e-4``);
- otherwise (ghost products, and the partial sums of several devices) the
  clipped contributions ``c_i`` are summed in double-float arithmetic
  (``_df_add``: pairs ``(hi, lo)``, each addition made error-free by
  Dekker's Fast2Sum on operands ordered by magnitude,
  ``s = a + b, e = b - (s - a)``, ``a + b = s + e`` exactly, barring
  overflow; no multiplication, so no FMA contraction can alter it): a
  pairwise tree over the records of a chunk (``_df_tree``), sequentially
  over chunks, and a pairwise tree over devices. The computed sum ``F``
  then satisfies, whatever the values and their order,
  ``‖F - S‖ <= E = ε_B Σ_i ‖c_i‖ + e_tiny``, ``S`` the exact sum of the
  ``c_i`` (proof in ``_SumBudget``); ``ε_B`` (of order ``u``) and
  ``e_tiny`` (``2^40 sqrt(P)`` times the smallest normal number, about
  ``1e-26 sqrt(P)`` in float32, for ``P`` parameter entries) are public,
  from the number of slots, chunks and devices and the dtypes only;
- the sum is refused (``ValueError`` naming the batch size) unless
  ``2 ε_B B <= η``; every record's room is further reduced by ``2 e_tiny``.
  Then for neighbouring data sets ``D, D'`` (one record ``c_0`` more in
  ``D``): ``‖F(D) - F(D')‖ <= ‖c_0‖ + E(D) + E(D') <= C``.
"""
import functools
import logging
from typing import Any, Callable, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.flatten_util import ravel_pytree

import d3p.random
from d3p import _validate

logger = logging.getLogger(__name__)

__all__ = [
    "ClippedSum",
    "total_norm",
    "clip_gradient",
    "per_record_value_and_grad",
    "clipped_grad_sum",
    "noise_std",
    "add_gaussian_noise",
    "STRATEGIES",
    "StrategyChoice",
    "choose_strategy",
    "DEFAULT_MEMORY_BUDGET_BYTES",
]

PyTree = Any

#: Names of the per-record gradient strategies; all compute the same clipped sum
#: up to rounding, but for "ghost" on records with several rows per product
#: (see :func:`clipped_grad_sum`).
STRATEGIES = ("auto", "vmap", "chunked", "scan", "ghost")


class ClippedSum(NamedTuple):
    """The result of :func:`clipped_grad_sum`.

    - **grad_sum** - the sum over real records of clipped per-record
      gradients (a pytree like the parameters).
    - **losses** - per-record losses, shape ``(B,)``, 0 for padded records.
      NOT private: never release them.
    - **norms** - per record, the upper bound of its total gradient norm
      from which its clipping factor was computed, shape ``(B,)``, 0 for
      padded records, ``inf`` for non-finite gradients. It includes the
      rounding of computing the norm: within a few units of roundoff (times
      ``sqrt`` of the leaf size) of the exact norm, except under ``"ghost"``
      for records with several rows per product, where it bounds the norm
      of the record's gradient with every row's entries replaced by their
      magnitudes (see :func:`clipped_grad_sum`). NOT private.
    """

    grad_sum: PyTree
    losses: jax.Array
    norms: jax.Array


# ---------------------------------------------------------------------------
# Floating-point bounds: the norm used for clipping and the clip factor.
#
# Every per-record norm used for clipping is an upper bound of the exact norm
# of the values that are then scaled and summed, proven from IEEE rounding
# alone: each operation on floats of unit roundoff u is exact up to a factor
# (1 + d), |d| <= u, except that results below the smallest normal number
# may be flushed to zero (XLA's CPU backend does so, and treats such inputs
# as zero). Reductions and products are allowed any order of summation: a
# sum of n terms is exact up to gamma(n - 1) * (sum of their magnitudes),
# gamma(k) = k u / (1 - k u) (Higham, "Accuracy and Stability of Numerical
# Algorithms", 2nd ed., sections 3.1 and 4.2). The private helper
# d3p._ghost uses these same primitives for ghost norms.
# ---------------------------------------------------------------------------


class _Rounding(NamedTuple):
    """Rounding constants of the coarsest of some float dtypes (Python floats)."""

    u: float  # unit roundoff
    eps: float  # 2 u: the spacing of floats just above 1
    tiny: float  # smallest normal number; smaller results may be flushed to zero


def _acc_dtype(*dtypes):
    """The dtype in which bounds are computed: the widest float among ``dtypes``, at least float32."""
    return jnp.result_type(jnp.float32, *[jnp.dtype(d) for d in dtypes])


def _rounding(*dtypes) -> _Rounding:
    fs = [jnp.finfo(d) for d in dtypes] or [jnp.finfo(jnp.float32)]
    eps = max(float(f.eps) for f in fs)
    return _Rounding(eps / 2, eps, max(float(f.tiny) for f in fs))


def _gamma(k: float, rnd: _Rounding) -> float:
    """gamma(k) = k u / (1 - k u): the relative error bound of k roundings."""
    ku = k * rnd.u
    if ku >= 0.25:
        raise ValueError(
            f"Expected fewer than {int(0.25 / rnd.u)} roundings in one error bound, got {k}: "
            "use a smaller chunk_size (or memory_budget_bytes)."
        )
    return ku / (1 - ku)


def _up(x: jax.Array, k: float, rnd: _Rounding) -> jax.Array:
    """``x * (1 + gamma(k + 1))``, rounded: at least the exact value of which ``x``
    is a lower estimate with ``k`` roundings (``x >= exact * (1 - u)^k``, ``x >= 0``),
    including the rounding of this multiplication itself."""
    if k <= 0:
        return x
    steps = int(np.ceil(_gamma(k + 1, rnd) / rnd.eps)) + 1
    return x * np.asarray(1.0 + steps * rnd.eps, x.dtype)  # exactly representable


def _exponent(peak: jax.Array) -> jax.Array:
    """``e`` with ``2^e <= peak < 2^(e+1)`` for normal ``peak >= 0`` (from the bits,
    exactly); the smallest normal exponent for zero and subnormal ``peak``."""
    f = jnp.finfo(peak.dtype)
    int_t = {4: jnp.int32, 8: jnp.int64}[peak.dtype.itemsize]
    bits = lax.bitcast_convert_type(peak, int_t)
    biased = lax.shift_right_logical(bits, np.asarray(f.nmant, int_t))
    biased = lax.bitwise_and(biased, np.asarray((1 << (f.bits - 1 - f.nmant)) - 1, int_t))
    return lax.max(biased, np.asarray(1, int_t)).astype(jnp.int32) - np.int32(f.maxexp - 1)


def _pow2(k: jax.Array, dtype) -> jax.Array:
    """Exactly ``2^k`` for integer ``k`` in the normal range of ``dtype`` (clamped to it)."""
    f = jnp.finfo(dtype)
    int_t = {4: jnp.int32, 8: jnp.int64}[jnp.dtype(dtype).itemsize]
    k = lax.clamp(np.int32(f.minexp), jnp.asarray(k, jnp.int32), np.int32(f.maxexp - 1)).astype(int_t)
    biased = lax.shift_left(k + np.asarray(f.maxexp - 1, int_t), np.asarray(f.nmant, int_t))
    return lax.bitcast_convert_type(biased, jnp.dtype(dtype))


def _scale_exponent(peak: jax.Array) -> jax.Array:
    """``s`` such that ``peak * 2^s`` lies in [1, 4) for normal ``peak``; ``2^s`` is normal."""
    f = jnp.finfo(peak.dtype)
    return lax.clamp(np.int32(f.minexp), -_exponent(peak), np.int32(f.maxexp - 2))


def _times_pow2(x: jax.Array, k: jax.Array) -> jax.Array:
    """``x * 2^k`` for integer ``k`` in twice the normal exponent range: exact
    unless the result overflows (to ``inf``) or is below the smallest normal
    number (then it may be flushed); the two factors have the same sign of
    exponent, so the intermediate never overflows or flushes when the result does not."""
    k = jnp.asarray(k, jnp.int32)
    k1 = lax.shift_right_arithmetic(k, np.int32(1))  # floor(k / 2)
    return (x * _pow2(k1, x.dtype)) * _pow2(k - k1, x.dtype)


# Below this many terms a sum is one reduction (error bound gamma(n - 1));
# above it, two levels of about sqrt(n) terms (gamma(2 sqrt(n))), which costs
# an optimization barrier.
_BLOCKED_SUM_MIN = 1024


def _blocked_sum(x: jax.Array, naxes: int) -> Tuple[jax.Array, int]:
    """Sum over the last ``naxes`` axes; returns ``(sum, depth)``: every term
    passes through at most ``depth`` additions, so the error is at most
    ``gamma(depth)`` times the sum of magnitudes, for any order of summation.

    Above ``_BLOCKED_SUM_MIN`` terms: a sum of about ``sqrt(n)`` partial sums
    of about ``sqrt(n)`` terms each, with an optimization barrier between the
    two levels so that the compiler cannot merge them into one reduction of
    unknown order."""
    lead = x.shape[: x.ndim - naxes]
    n = int(np.prod(x.shape[x.ndim - naxes:], dtype=np.int64))
    x = x.reshape(lead + (n,))
    if n <= _BLOCKED_SUM_MIN:
        return jnp.sum(x, axis=-1), max(n - 1, 0)
    k = int(np.ceil(np.sqrt(n)))
    m = -(-n // k)
    if m * k > n:
        x = jnp.concatenate([x, jnp.zeros(lead + (m * k - n,), x.dtype)], axis=-1)
    partial = lax.optimization_barrier(jnp.sum(x.reshape(lead + (m, k)), axis=-1))
    return jnp.sum(partial, axis=-1), (k - 1) + (m - 1)


def _scaled_norm_bound(xs: jax.Array, naxes: int, rnd: _Rounding) -> jax.Array:
    """Upper bound of the L2 norm over the last ``naxes`` axes of ``xs`` (entries of
    magnitude below 4), including squares flushed to zero."""
    n = int(np.prod(xs.shape[xs.ndim - naxes:], dtype=np.int64))
    total, depth = _blocked_sum(jnp.square(xs), naxes)
    # squares below `tiny` may be flushed: at most n * tiny in total, i.e. at
    # most sqrt(n * tiny) in the norm (sqrt(a + b) <= sqrt(a) + sqrt(b))
    flushed = np.asarray(2.0 * np.sqrt(n * rnd.tiny), xs.dtype)
    # squares: 1 rounding; sums: depth; halved by the square root, which adds
    # at most 2 (allowing for a square root that is not correctly rounded);
    # the addition of `flushed`: 1
    return _up(jnp.sqrt(total) + flushed, -(-(depth + 1) // 2) + 3, rnd)


def _norm_bound(x: jax.Array, naxes: int = 1) -> jax.Array:
    """Upper bound of the L2 norm of ``x`` over its last ``naxes`` axes, in a dtype
    of at least float32: ``inf`` if any entry is non-finite or if the bound
    overflows, otherwise at least the exact norm of the finite values of ``x``
    minus ``sqrt(n) * tiny`` (entries below the smallest normal number, which a
    backend may treat as zero). Scaled by a power of two (exact) so that large
    and small finite entries neither overflow nor underflow; within a factor
    ``1 + (sqrt(n) + 5) u`` of the exact norm.
    """
    scaled, s, peak = _unit_scaled(x, naxes)
    bound = _times_pow2(_scaled_norm_bound(scaled, naxes, _rounding(scaled.dtype)), -s)
    return jnp.where(jnp.isfinite(peak), bound, jnp.inf)


def _unit_scaled(x: jax.Array, naxes: int) -> Tuple[jax.Array, jax.Array, jax.Array]:
    """``(x * 2^s, s, peak)`` in a dtype of at least float32: every slice over the
    last ``naxes`` axes scaled by a power of two (exact) so that its largest
    magnitude ``peak`` (``nan`` or ``inf`` if an entry is non-finite) lies in
    [1, 4) when it is normal; the scaled entries then neither overflow nor
    underflow in squares and products."""
    acc = _acc_dtype(x.dtype)
    x = x.astype(acc)
    axes = tuple(range(x.ndim - naxes, x.ndim))
    peak = jnp.max(jnp.abs(x), axis=axes) if x.size else jnp.zeros(x.shape[: x.ndim - naxes], acc)
    s = _scale_exponent(peak)
    return x * _pow2(s, acc).reshape(s.shape + (1,) * naxes), s, peak


def _flush_slack(size: int, dtypes) -> float:
    """Bound of the norm of ``size`` entries of a per-record gradient that a
    backend may treat as zero when computing its norm (below the smallest
    normal number of the dtype of the norm) plus the gradual underflow of
    as many products with the clip factor (half the smallest subnormal number
    of the gradient's dtype each; results flushed to zero only shrink)."""
    tiny = float(jnp.finfo(_acc_dtype(*dtypes)).tiny)
    sub = max([float(jnp.finfo(d).smallest_subnormal) for d in dtypes] or [0.0])
    return 2.0 * np.sqrt(max(size, 1)) * (tiny + sub) * (1 + 1e-3)  # the margin covers conversion


def _clip_factor(bound: jax.Array, clipping_threshold, abs_err=0.0, dtypes=()) -> jax.Array:
    """The factor ``f`` in [0, 1] by which a record's gradient is scaled.

    :param bound: per record, ``M``: an upper bound of the norm of the record's
        contribution to the sum per unit of ``f``, including the rounding of
        forming and summing it, but not that of multiplying by ``f`` (a relative
        ``u`` per entry, covered here).
    :param clipping_threshold: ``C``.
    :param abs_err: per record, an absolute error of the contribution that does
        not scale with ``f`` (values flushed below the smallest normal number).
    :param dtypes: the dtypes in which ``f`` is applied and the result summed.

    ``f = 1`` if ``M (1 + 16 u) <= C - abs_err`` (the record is unchanged);
    otherwise ``f`` is ``(C - abs_err) / (M (1 + 16 u))`` rounded, or 0 if that
    is below the smallest normal number (where its relative rounding error is
    not bounded by ``u``) or if ``M`` or ``abs_err`` is not finite. Then
    ``f (1 + u)^k M + abs_err <= C`` for up to ``k = 10`` further roundings of
    each entry (converting ``f`` to the gradient's dtype, the multiplication,
    converting the sum): with ``m = fl(M (1 + 16 u)) >= M (1 + 16 u)(1 - u)``
    and ``f <= (C - abs_err)(1 + u)^2 / m`` (rounding of ``C - abs_err`` and of
    the division), ``f (1 + u)^k M <= (C - abs_err)(1 + u)^(k + 2) / ((1 + 16 u)(1 - u))``,
    which is below ``C - abs_err`` for ``k + 2 <= 13``. When ``f = 1`` is
    returned, ``fl((C - abs_err) / m) >= 1`` gives ``M <= (C - abs_err)(1 - 13 u)``.
    """
    rnd = _rounding(bound.dtype, *dtypes)
    room = jnp.asarray(clipping_threshold, bound.dtype) - jnp.asarray(abs_err, bound.dtype)
    m = bound * np.asarray(1.0 + 8 * rnd.eps, bound.dtype)
    # non-finite M or abs_err give 0, inf or nan here, hence f = 0 below
    f = room / m
    f = jnp.where(f >= 1, jnp.ones_like(f), f)
    return jnp.where(f >= rnd.tiny, f, jnp.zeros_like(f))  # also nan, negative


def total_norm(tree: PyTree) -> jax.Array:
    """An upper bound of the L2 norm of all leaves of ``tree`` taken together as one vector.

    Exact up to a relative ``(sqrt(n) + 5) u`` (``u`` the unit roundoff of the
    leaves' dtype, at least float32's; ``n`` the largest leaf size), and never
    below the exact norm of the values less ``2 sqrt(P) tiny`` (``P`` entries;
    ``tiny`` the smallest normal number: entries below it may be treated as
    zero by the backend, and :func:`clip_gradient` allows for them).
    Computed with exact scaling by powers of two, so that large finite
    gradients do not overflow to ``inf`` and tiny ones do not underflow.
    Returns ``inf`` if any entry is non-finite (or the norm exceeds the
    largest float).

    >>> import jax.numpy as jnp
    >>> float(total_norm({"a": jnp.array([3.0]), "b": jnp.array([[4.0]])}))  # doctest: +ELLIPSIS
    5.000...
    """
    leaves = [jnp.asarray(x)[None] for x in jax.tree.leaves(tree)]
    if not leaves:
        return jnp.zeros(())
    return _record_bound(leaves, 0)[0]


def _rows(x: jax.Array) -> jax.Array:
    """``x`` as (leading axis, all other entries), also for a leading axis of 0."""
    return x.reshape((x.shape[0], int(np.prod(x.shape[1:], dtype=np.int64))))


def _per_record(values: jax.Array, x: jax.Array) -> jax.Array:
    """Per-record ``values`` (shape ``(B,)``) shaped to broadcast against ``x`` (leading axis ``B``)."""
    return values.reshape((x.shape[0],) + (1,) * (x.ndim - 1))


def _record_bound(leaves, extra_roundings: int = 0) -> jax.Array:
    """Per record (leading axis ``B`` of every leaf), an upper bound of the L2 norm
    of its entries in all ``leaves`` taken together as one vector, in the
    widest of the leaves' dtypes (at least float32): ``inf`` if an entry is
    non-finite. ``extra_roundings``: further relative roundings of every
    entry that the bound must cover (``gamma(extra_roundings)``; none for the
    values themselves)."""
    dtypes = [x.dtype for x in leaves]
    acc = _acc_dtype(*dtypes)
    per_leaf = jnp.stack([_norm_bound(_rows(g)).astype(acc) for g in leaves], axis=1)
    return _up(_norm_bound(per_leaf), extra_roundings, _rounding(acc, *dtypes))


def _clip_decision(bound: jax.Array, clipping_threshold, abs_err, dtypes, mask=None):
    """``(factor, keep)`` per record: the clip factor of ``bound`` (see
    :func:`_clip_factor`) and whether the record is added at all: a real record
    (``mask``, if given) whose factor is > 0, which implies finite bounds.
    Testing the factor (not the bounds) keeps the chain that XLA may recompute
    for every entry short."""
    factor = _clip_factor(bound, clipping_threshold, abs_err, dtypes)
    keep = factor > 0
    return factor, (keep if mask is None else mask & keep)


def _keep_records(x: jax.Array, keep: jax.Array, factor: Optional[jax.Array] = None) -> jax.Array:
    """Per record (leading axis of ``x``): ``x`` times ``factor`` (if given), and
    exactly zero where ``keep`` is False (``where``, not a product, so that a
    dropped record's ``nan`` never reaches a sum)."""
    if factor is not None:
        x = x * _per_record(factor, x).astype(x.dtype)
    return jnp.where(_per_record(keep, x), x, jnp.zeros_like(x))


def _real_only(mask: jax.Array, *per_record: jax.Array) -> Tuple[jax.Array, ...]:
    """The per-record values (shape ``(B,)``) with 0 for padded records."""
    return tuple(jnp.where(mask, v, 0.0) for v in per_record)


def _clip_records(grads: PyTree, clipping_threshold, abs_err: float = 0.0, mask: Optional[jax.Array] = None):
    """Clip per-record gradients (leading axis ``B`` on every leaf) so that the
    exact norm of each clipped record plus ``abs_err`` is at most
    ``clipping_threshold``.

    ``abs_err``: an absolute allowance reserved in every record's room besides
    its own flushed entries (the sum's ``2 e_tiny``, see :class:`_SumBudget`;
    0 for a record on its own). Returns ``(clipped, bounds)``; records with
    non-finite entries, and those with ``mask`` False if given, get zeros
    (``where``, so that ``nan`` does not reach the sum).
    """
    leaves = jax.tree.leaves(grads)
    if not leaves:
        return grads, jnp.zeros((0,))
    dtypes = [x.dtype for x in leaves]
    bound = _record_bound(leaves)
    size = sum(_rows(x).shape[1] for x in leaves)
    slack = _flush_slack(size, dtypes) + float(abs_err)
    factor, keep = _clip_decision(bound, clipping_threshold, slack, dtypes, mask)
    return jax.tree.map(lambda g: _keep_records(g, keep, factor), grads), bound


def clip_gradient(grad: PyTree, clipping_threshold: float):
    """Scale ``grad`` so that its total L2 norm is at most ``clipping_threshold``.

    :param grad: one record's gradient (any pytree of arrays).
    :param float clipping_threshold: ``C > 0``; ``inf`` leaves finite gradients
        unchanged.
    :return: ``(clipped, norm)``: the clipped gradient and :func:`total_norm`
        of ``grad`` (an upper bound of its norm) before clipping.

    **Formal guarantees.** The exact L2 norm of the returned values (all
    leaves together) is at most ``C``, for every input and every ``C > 0``,
    whatever the rounding: the factor is computed by ``_clip_factor`` from
    :func:`total_norm`, an upper bound of the norm that covers the rounding of
    computing it, and leaves room for the rounding of the multiplication and
    for entries below the smallest normal number (see ``_clip_factor``). A
    gradient with any non-finite entry (``nan``, ``inf``) is replaced by
    zeros, so it contributes nothing rather than breaking the bound. A
    gradient whose norm bound, increased by 16 units of roundoff, is at most
    ``C`` is returned unchanged; a clipped gradient has norm within a few
    units of roundoff times ``sqrt(n)`` below ``C``.

    **Example**

    >>> import jax.numpy as jnp
    >>> grad = {"w": jnp.array([3.0, 4.0]), "b": jnp.array([0.0])}
    >>> clipped, norm = clip_gradient(grad, 1.0)
    >>> round(float(norm), 5), round(float(total_norm(clipped)), 5)
    (5.0, 1.0)
    >>> [round(v, 5) for v in clipped["w"].tolist()]
    [0.6, 0.8]
    >>> clip_gradient({"w": jnp.array([jnp.nan, 1.0])}, 1.0)[0]["w"].tolist()
    [0.0, 0.0]
    """
    clipped, bounds = _clip_records(jax.tree.map(lambda g: jnp.asarray(g)[None], grad), clipping_threshold, 0)
    return jax.tree.map(lambda g: g[0], clipped), bounds[0]


def per_record_value_and_grad(
    loss_fn: Callable, params: PyTree, records: PyTree, *, forward_mode: bool = False
):
    """Loss and gradient of ``loss_fn(params, record)`` for every record.

    :param loss_fn: ``loss_fn(params, record) -> scalar`` for ONE record.
    :param params: parameters (not batched).
    :param records: pytree whose leaves all have the leading dimension ``B``.
    :param bool forward_mode: use forward-mode differentiation.
    :return: ``(losses, grads)`` with leading dimension ``B``.
    """
    def value_and_grad(p, r):
        return _value_and_grad_one(loss_fn, p, r, forward_mode)

    return jax.vmap(value_and_grad, in_axes=(None, 0))(params, records)


def _value_and_grad_one(loss_fn, params, record, forward_mode):
    """Loss and gradient of ``loss_fn(params, record)`` for one record."""
    if forward_mode:
        flat, unravel = ravel_pytree(params)
        f = lambda fp: loss_fn(unravel(fp), record)  # noqa: E731
        return f(flat), unravel(jax.jacfwd(f)(flat))
    return jax.value_and_grad(loss_fn)(params, record)


def _batch_size(records: PyTree) -> int:
    leaves = jax.tree.leaves(records)
    if not leaves:
        raise ValueError("Expected at least one per-record array in records.")
    return int(jnp.shape(leaves[0])[0])


def _clipped_chunk(loss_fn, params, records, mask, clipping_threshold, forward_mode, abs_err=0.0,
                   summed=None):
    """``(sum, losses, norms)`` of one chunk of records from their exact
    per-record gradients, each record clipped to ``clipping_threshold`` with
    ``abs_err`` reserved (see :func:`_clip_records`): the sum of the clipped
    gradients as double-float pairs ``(hi, lo)`` (see :func:`_df_tree`), or
    ``summed(clipped)`` if given."""
    if mask.shape[0] == 1:
        # one record: no vmap, so that XLA sees plain (un-batched) products
        one = jax.tree.map(lambda x: x[0], records)
        loss, grad = _value_and_grad_one(loss_fn, params, one, forward_mode)
        losses, grads = loss[None], jax.tree.map(lambda g: g[None], grad)
    else:
        losses, grads = per_record_value_and_grad(loss_fn, params, records, forward_mode=forward_mode)
    clipped, norms = _clip_records(grads, clipping_threshold, abs_err, mask)
    total = _df_tree_pytree(clipped) if summed is None else summed(clipped)
    return (total,) + _real_only(mask, losses, norms)


# ---------------------------------------------------------------------------
# The sum over records: double-float accumulation and its public error bound.
# ---------------------------------------------------------------------------


def _fast_two_sum(a: jax.Array, b: jax.Array) -> Tuple[jax.Array, jax.Array]:
    """``(s, e)``: ``s = fl(a + b)`` and its rounding error ``e``, with
    ``a + b = s + e`` exactly (Dekker's Fast2Sum on the operands ordered by
    magnitude; round to nearest, no overflow), up to less than 3 ``tiny``
    where a backend flushes results (or treats inputs) below the smallest
    normal number ``tiny`` to zero: see :class:`_SumBudget`. Additions and
    subtractions only, so FMA contraction cannot alter it, and XLA does not
    reassociate floating-point additions (``tests/test_sum_sensitivity.py``
    checks the exactness after compilation)."""
    swap = jnp.abs(a) < jnp.abs(b)
    big = jnp.where(swap, b, a)
    small = jnp.where(swap, a, b)
    s = big + small
    return s, small - (s - big)


def _df_add(x, y):
    """The sum of two double-float pairs ``(hi, lo)`` (of value ``hi + lo``),
    renormalised (``|lo| <= u |hi|``): the ``hi`` parts are added
    error-free, the ``lo`` parts and that error in floating point, and the
    result split again by Fast2Sum. Its error is at most
    ``3.02 u² (|hi_x| + |hi_y|) + 8 tiny`` per entry (:class:`_SumBudget`)."""
    (h1, l1), (h2, l2) = x, y
    s, e = _fast_two_sum(h1, h2)
    return _fast_two_sum(s, (l1 + l2) + e)


def _df_tree(hi: jax.Array, lo: Optional[jax.Array] = None) -> Tuple[jax.Array, jax.Array]:
    """The double-float sum ``(hi, lo)`` over the leading axis of ``hi`` (and
    ``lo``, zeros if None): a pairwise tree of :func:`_df_add`, levels padded
    with zeros (added exactly), so every entry passes through
    ``ceil(log2(n))`` additions."""
    lo = jnp.zeros_like(hi) if lo is None else lo
    n = hi.shape[0]
    if n == 0:
        return jnp.zeros(hi.shape[1:], hi.dtype), jnp.zeros(hi.shape[1:], hi.dtype)
    while n > 1:
        if n % 2:
            pad = jnp.zeros((1,) + hi.shape[1:], hi.dtype)
            hi, lo = jnp.concatenate([hi, pad]), jnp.concatenate([lo, pad])
            n += 1
        hi, lo = _df_add((hi[0::2], lo[0::2]), (hi[1::2], lo[1::2]))
        n //= 2
    return hi[0], lo[0]


def _unzip(treedef, pairs) -> Tuple[PyTree, PyTree]:
    """Two pytrees of structure ``treedef`` from one whose leaves are pairs."""
    flat = treedef.flatten_up_to(pairs)
    return treedef.unflatten([x[0] for x in flat]), treedef.unflatten([x[1] for x in flat])


# leaves with at most this many entries per record are summed in one tree
# (fewer, larger operations); larger ones on their own (no copy)
_DF_JOIN_MAX = 1 << 12


def _df_tree_pytree(clipped: PyTree) -> Tuple[PyTree, PyTree]:
    """``(hi, lo)``: two pytrees like ``clipped`` with the double-float sum
    (:func:`_df_tree`) over the leading (record) axis of every leaf, in the
    accumulation dtype of the leaf (at least float32). Small leaves of one
    dtype are concatenated into one tree: the same additions, entry by entry."""
    leaves, treedef = jax.tree.flatten(clipped)
    out = [None] * len(leaves)
    groups = {}
    for i, x in enumerate(leaves):
        x = x.astype(_acc_dtype(x.dtype))
        if _rows(x).shape[1] <= _DF_JOIN_MAX:
            groups.setdefault(x.dtype, []).append(i)
        else:
            out[i] = _df_tree(x)
    for dtype, idx in groups.items():
        rows = [_rows(leaves[i].astype(dtype)) for i in idx]
        hi, lo = _df_tree(jnp.concatenate(rows, axis=1) if len(rows) > 1 else rows[0])
        start = 0
        for i, r in zip(idx, rows):
            shape = leaves[i].shape[1:]
            stop = start + r.shape[1]
            out[i] = (hi[start:stop].reshape(shape), lo[start:stop].reshape(shape))
            start = stop
    return treedef.unflatten([o[0] for o in out]), treedef.unflatten([o[1] for o in out])


def _df_add_pytrees(x: Tuple[PyTree, PyTree], y: Tuple[PyTree, PyTree]) -> Tuple[PyTree, PyTree]:
    """:func:`_df_add` leaf by leaf on ``(hi, lo)`` pairs of pytrees."""
    pairs = jax.tree.map(lambda a, b, c, d: _df_add((a, b), (c, d)), x[0], x[1], y[0], y[1])
    return _unzip(jax.tree.structure(x[0]), pairs)


def _df_rounded(pair: Tuple[PyTree, PyTree], like: PyTree) -> PyTree:
    """The ``hi`` part of a renormalised pair of pytrees, in the dtypes of ``like``."""
    return jax.tree.map(lambda h, p: h.astype(jnp.result_type(p)), pair[0], like)


def _sum_margin(*dtypes) -> float:
    """``η``: the fraction of ``C`` reserved for the rounding of the sum over
    records whose accumulation and result have ``dtypes``, the same for every
    batch: ``2^-7`` if any of them is float32 or coarser (the final rounding
    to it dominates; batches up to about 65,000 slots), ``2^-30`` if all are
    float64 (about 4 million slots)."""
    coarse = any(jnp.finfo(d).eps >= 2.0**-23 for d in dtypes)
    return 2.0**-7 if coarse else 2.0**-30


# the counts of roundings flushed below `tiny` that the fixed allowance covers
_TINY_COUNT = 2.0**40


class _SumBudget(NamedTuple):
    """The public error bound of the sum over records and the threshold the
    records are clipped to (static: from shapes and dtypes only).

    - **slots** - ``B``: record slots of the whole batch (all devices).
    - **rel** - ``ε_B``: the computed sum ``F`` of clipped contributions
      ``c_i`` satisfies ``‖F - S‖ <= ε_B Σ_i ‖c_i‖ + e_tiny``.
    - **tiny** - ``e_tiny``, the same for every batch size.
    - **margin** - ``η`` (:func:`_sum_margin`), with ``2 ε_B B <= η``.
    - **acc** - the dtype of the accumulation.

    **Proof.** Per entry, with ``u`` the unit roundoff and ``tiny`` the
    smallest normal number of the accumulation dtype. (1) Fast2Sum: with
    ``|a| >= |b|``, ``s - a`` and ``b - (s - a)`` are exact in round to
    nearest (Dekker 1971; Boldo, Graillat & Muller 2017 with gradual
    underflow); a backend that flushes a result below ``tiny`` to zero
    changes ``e`` by less than ``tiny`` (if ``s - a`` or ``s`` is flushed,
    ``e`` becomes ``b`` or 0 and the defect is ``|s - a|`` or ``|a + b|``,
    below ``tiny``), and inputs below ``tiny`` treated as zero move ``a + b``
    by less than ``2 tiny``. (2) :func:`_df_add` of renormalised pairs
    (``|l| <= u |h| + tiny``): the only inexact steps are the two additions
    forming ``t = (l1 + l2) + e``, off by at most
    ``u (|l1 + l2| + |t|) + 2 tiny <= 3.02 u² (|h1| + |h2|)`` plus ``8 tiny``
    with the Fast2Sum defects. (3) Every ``hi`` is at most ``1.01`` times the
    sum of the magnitudes of the terms below it, so over the whole
    computation the errors add up to ``4 u² d M + 8 n tiny``, ``M`` the sum
    of the magnitudes of the terms, ``d`` the most additions a term passes
    through (``ceil(log2)`` of a chunk's terms, one per chunk, and
    ``ceil(log2 D) + 1`` over ``D`` devices) and ``n`` the additions. (4) The
    result is the final ``hi``: dropping ``lo`` costs ``u |S|`` (and a
    conversion to a coarser parameter dtype ``u_p |S|`` and ``tiny_p``); on
    several devices each device's partial sum is so rounded once more. (5)
    Under ``"ghost"``, every product of ``k`` rows is off by at most
    ``γ(k)`` times ``Σ_r |f a_r| |δ_r|ᵀ`` (plus ``2 tiny`` per row), whose
    norm is at most ``f (1 + u) M_i`` per record (``d3p._ghost.gram_bound``).
    The L2 norm of the per-entry bounds ``u |S| + 4 u² d M`` is at most
    ``(u + 4 u² d) Σ_i ‖c_i‖`` (``‖S‖`` and ``‖M‖`` are at most
    ``Σ_i ‖c_i‖``), and that of the ``tiny`` terms at most
    ``sqrt(P) (2^40 tiny + 2 tiny_p)`` while every entry's count is below
    ``2^40`` (checked). (6) With a fixed-point sum (:class:`_FixedPoint`)
    the contributions ``c_i`` are the grid values, each of norm at most the
    threshold; their sum on a device is exact (integers), so (1) to (3) do
    not arise there and only (4) does: one rounding of the exact sum
    (``depth`` counts the tree over devices only).
    """

    slots: int
    rel: float
    tiny: float
    margin: float
    acc: Any

    def threshold(self, clipping_threshold, dtype) -> jax.Array:
        """``C (1 - η)``, rounded down: what every record is clipped to."""
        eps = float(jnp.finfo(dtype).eps)
        return jnp.asarray(clipping_threshold, dtype) * np.asarray(1.0 - self.margin - 8 * eps, dtype)

    def reserve(self) -> float:
        """The absolute room reserved in every record's bound: ``2 e_tiny``."""
        return 2.0 * self.tiny


def _sum_rel(acc, out_dtypes, depth: int, shards: int, products: float = 0.0) -> float:
    """``ε_B`` of :class:`_SumBudget` for a sum whose terms pass through at
    most ``depth`` double-float additions, over ``shards`` devices, plus
    ``products`` (the relative error of ghost products)."""
    u = _rounding(acc).u
    u_out = max([_rounding(d).u for d in out_dtypes] or [u])
    final = u + (u_out if u_out > u else 0.0)
    return (final * (2 if shards > 1 else 1) + 4 * u * u * depth + products) * (1 + 1e-6)


def _sum_budget(B: int, chunk: int, shards: int, params: PyTree, terms_per_slot: float = 1.0,
                product_rows: int = 0, products: float = 0.0, check: bool = True,
                exact: bool = False) -> _SumBudget:
    """The :class:`_SumBudget` of ``shards`` partial sums of ``B`` slots each in
    chunks of ``chunk`` slots (``terms_per_slot`` double-float terms per slot:
    ghost products per record; ``product_rows`` rows per record in products
    of relative error ``products``), or, if ``check``, ``ValueError`` naming
    the batch size if its error cannot fit the margin."""
    leaves = jax.tree.leaves(params)
    dtypes = [jnp.result_type(x) for x in leaves]
    acc = _acc_dtype(*dtypes)
    chunk = max(1, min(int(chunk), B))
    terms = max(1, int(np.ceil(chunk * terms_per_slot)))
    across = int(np.ceil(np.log2(shards))) + 1 if shards > 1 else 0
    # an exact (integer) sum on each device: only the tree over devices adds
    depth = across if exact else int(np.ceil(np.log2(terms))) + -(-B // chunk) + across
    rel = _sum_rel(acc, dtypes, depth, shards, products)
    margin = _sum_margin(acc, *dtypes)
    slots = B * shards
    if check and 2 * rel * slots > margin:
        limit = int(margin / (2 * rel))
        raise ValueError(
            f"Expected a batch of at most {limit} record slots for a certified {jnp.dtype(acc).name} sum, "
            f"got batch size B={slots}" + (f" ({shards} devices of {B})" if shards > 1 else "")
            + ": its rounding would exceed the margin reserved in the clipping threshold. Use smaller "
            "batches, or float64 parameters (jax_enable_x64)."
        )
    count = 8 * (slots * max(terms_per_slot, 1.0) + -(-B // chunk) * shards + 2 * shards) + 2 * slots * product_rows
    if check and count > _TINY_COUNT:
        raise ValueError(f"Expected fewer record slots, got batch size B={slots}.")
    P = sum(int(np.size(x)) for x in leaves)
    tiny_out = max([float(jnp.finfo(d).tiny) for d in dtypes] or [0.0])
    tiny = float(np.sqrt(max(P, 1))) * (_TINY_COUNT * float(jnp.finfo(acc).tiny) + 2 * tiny_out) * 1.01
    return _SumBudget(slots, rel, tiny, margin, acc)


def _check_sum_threshold(clipping_threshold, budget: _SumBudget, threshold_bound=None) -> None:
    """Raise ``ValueError`` naming ``clipping_threshold`` (or ``threshold_bound``,
    the public upper bound of a ``C`` set during the run, which is checked in
    its place when given) if a concrete ``C`` lets the sum of ``B`` slots
    overflow (its error bound needs finite sums)."""
    name, value = ("clipping_threshold", clipping_threshold) if threshold_bound is None else \
        ("threshold_bound", threshold_bound)
    try:
        C = float(value)
    except (TypeError, jax.errors.ConcretizationTypeError):
        return
    limit = float(jnp.finfo(budget.acc).max) / 8
    if np.isfinite(C) and C * budget.slots >= limit:
        raise ValueError(
            f"Expected {name} * B below {limit:.3g} (the sum of B={budget.slots} clipped "
            f"records must not overflow), got {name}={C}"
            + ("." if threshold_bound is None else " (the largest C: adaptive clipping's max_threshold).")
        )


# ---------------------------------------------------------------------------
# The sum over records in fixed point: exact integer accumulation.
# ---------------------------------------------------------------------------


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


def _in_chunks(chunk_fn, params, records, mask, chunk, fixed_point=None):
    """Run ``chunk_fn(records, mask) -> (pairs, losses, norms)`` over chunks of
    ``chunk`` records under ``lax.scan`` and add up the pairs: ``(hi, lo)``
    in double-float (one :func:`_df_add` per chunk), or, with
    ``fixed_point``, integer pairs ``(Σh, Σl)`` exactly."""
    B = mask.shape[0]
    chunk = max(1, min(int(chunk), B))
    if chunk >= B:
        return chunk_fn(records, mask)
    num_chunks = -(-B // chunk)
    pad = num_chunks * chunk - B

    def pad_and_split(x):
        x = jnp.asarray(x)
        x = jnp.concatenate([x, jnp.zeros((pad,) + x.shape[1:], x.dtype)]) if pad else x
        return x.reshape((num_chunks, chunk) + x.shape[1:])

    chunked_records = jax.tree.map(pad_and_split, records)
    chunked_mask = pad_and_split(mask)  # padding is False
    if fixed_point is None:
        zero = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), _acc_dtype(jnp.result_type(p))), params)
        add = _df_add_pytrees
    else:
        zero = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), fixed_point.int_dtype), params)
        add = functools.partial(jax.tree.map, jnp.add)

    def body(acc, xs):
        recs, m = xs
        s, losses, norms = chunk_fn(recs, m)
        return add(acc, s), (losses, norms)

    total, (losses, norms) = lax.scan(body, (zero, zero), (chunked_records, chunked_mask))
    return total, losses.reshape(-1)[:B], norms.reshape(-1)[:B]


#: Default memory budget (bytes) for per-record quantities held at once by
#: :func:`clipped_grad_sum` under ``strategy="auto"``, ``"chunked"`` and
#: ``"ghost"``; override per call with ``memory_budget_bytes``.
DEFAULT_MEMORY_BUDGET_BYTES = 1 << 30

# On CPU, XLA forms batched per-record outer products slowly (the vmap of the
# gradient of a dense layer: 30x slower than one record at a time for the VAE
# of benchmarks/dpsvi_vs_svi.py). Above this many parameter entries with such
# gradients, "auto" takes records one at a time instead.
_CPU_OUTER_MAX_PARAMS = 1 << 14
# temporaries per per-record gradient (the gradient and its clipped copy)
_COPIES = 2


class StrategyChoice(NamedTuple):
    """How :func:`clipped_grad_sum` forms per-record gradients for a call.

    - **strategy** - ``"vmap"``, ``"chunked"`` or ``"ghost"`` (``"scan"`` is
      ``"chunked"`` with ``chunk_size=1``).
    - **chunk_size** - records per chunk under ``lax.scan``; ``None``: all at once.
    - **reason** - why, in words.
    - **ghost_params** - number of parameter entries whose per-record norm
      comes from ghost norms (0 unless ``strategy == "ghost"``).
    - **elsewhere** - where ``"auto"``'s rule differs between CPUs and other
      platforms: the choice for platforms other than CPU (this choice is then
      the CPU's), both compiled into the program and selected when it is
      lowered (``jax.lax.platform_dependent``); None where one choice holds
      everywhere.
    """

    strategy: str
    chunk_size: Optional[int]
    reason: str
    ghost_params: int = 0
    elsewhere: Optional["StrategyChoice"] = None


class _Sizes(NamedTuple):
    """The static sizes from which a strategy is chosen."""

    B: int  # records (slots) in the batch
    P: int  # parameter entries
    itemsize: int  # bytes per parameter entry (the widest dtype)
    budget: int  # memory budget in bytes
    fixed_chunk: Optional[int]  # chunk_size if given and below B, else None

    @property
    def per_record(self) -> int:
        """Bytes of one per-record gradient and its clipped copy."""
        return self.P * self.itemsize * _COPIES


def _sizes(params, B: int, chunk_size: Optional[int], budget: int) -> _Sizes:
    leaves = jax.tree.leaves(params)
    count = sum(int(np.prod(np.shape(x), dtype=np.int64)) for x in leaves)
    itemsize = max([jnp.dtype(jnp.result_type(x)).itemsize for x in leaves] or [4])
    fixed_chunk = None if chunk_size is None or chunk_size >= B else chunk_size
    return _Sizes(B, count, itemsize, budget, fixed_chunk)


def _budget_chunk(per_record_bytes, budget, B):
    return int(max(1, min(B, budget // max(per_record_bytes, 1))))


def _choose(loss_fn, params, records, B, strategy, chunk_size, forward_mode, budget):
    """``(StrategyChoice, ghost plan or None)`` for validated arguments (see
    :func:`choose_strategy` for the rule)."""
    if strategy == "ghost" and forward_mode:
        raise ValueError(
            "Expected forward_mode=False with strategy='ghost': ghost norms need "
            "reverse-mode differentiation; use strategy='chunked' or 'vmap'."
        )
    sizes = _sizes(params, B, chunk_size, budget)
    if B == 0:
        return StrategyChoice("vmap", None, "empty batch"), None
    if strategy in ("vmap", "scan", "chunked"):
        return _requested_choice(strategy, chunk_size, sizes), None
    plan, why_not = _ghost_plan(loss_fn, params, records, forward_mode)
    if strategy == "ghost":
        if plan is None:
            raise ValueError(f"strategy='ghost' cannot be used for this loss: {why_not}.")
        only_exact = "" if plan[0].ghost_leaves else f"; exact per-record gradients only ({why_not})"
        choice = _ghost_choice(plan, "requested" + only_exact, sizes, params)
        if choice is None:
            raise ValueError(
                f"Expected a batch whose ghost products can be certified, got batch size B={B}: its "
                "rounding would exceed the margin reserved in the clipping threshold even with one row "
                "per product. Use strategy='chunked' or smaller batches."
            )
        return choice
    if plan is not None and plan[0].ghost_leaves:
        p = plan[0]
        reason = (
            f"ghost norms for {p.ghost_size} of {sizes.P} parameter entries, exact per-record "
            f"gradients for {p.residual_size}"
        )
        choice = _ghost_choice(plan, reason, sizes, params)
        if choice is not None:
            return choice
        why_not = f"{B} slots are too many for certified ghost products"
    return _exact_choice(plan, why_not, sizes), None


def _requested_choice(strategy: str, chunk_size: Optional[int], sizes: _Sizes) -> StrategyChoice:
    """The choice for an explicit ``"vmap"``, ``"scan"`` or ``"chunked"``."""
    if strategy == "vmap":
        return StrategyChoice("vmap", None, "requested")
    if strategy == "scan":
        return StrategyChoice("chunked", 1 if sizes.B > 1 else None, "requested (one record at a time)")
    chunk = chunk_size if chunk_size is not None else _budget_chunk(sizes.per_record, sizes.budget, sizes.B)
    return StrategyChoice("chunked", None if chunk >= sizes.B else chunk, "requested")


def _ghost_plan(loss_fn, params, records, forward_mode: bool):
    """``(plan, why_not)``: the ghost plan of the loss (``d3p._ghost.trace_plan``)
    or None, and in words why ghost norms do not apply (None if they do)."""
    if forward_mode:
        return None, "forward-mode differentiation"
    from d3p import _ghost  # imports this module's primitives

    try:
        plan = _ghost.trace_plan(loss_fn, params, records)
    except _ghost.Unsupported as err:
        return None, str(err)
    if not plan[0].ghost_leaves:
        return plan, "no parameter is used only in dense products"
    return plan, None


def _ghost_choice(plan, reason: str, sizes: _Sizes, params):
    """``(StrategyChoice, plan)`` for ghost norms, in chunks that fit the budget
    (per record: its activations, output gradients and residual gradients,
    and its share of the products of ``k`` rows, see
    :func:`_ghost_rows_per_product`); None if no ``k`` fits this batch."""
    p = plan[0]
    rows = _ghost_rows(plan)
    per_record = p.per_record_floats * sizes.itemsize * _COPIES
    chunk = sizes.fixed_chunk or _budget_chunk(per_record, sizes.budget, sizes.B)
    k = _ghost_rows_per_product(params, sizes.B, chunk, 1, rows)
    if k is None:
        return None
    if sizes.fixed_chunk is None and k < chunk * rows:
        per_record += int(np.ceil(p.ghost_size * rows / k)) * sizes.itemsize
        chunk = _budget_chunk(per_record, sizes.budget, sizes.B)
    return StrategyChoice("ghost", None if chunk >= sizes.B else chunk, reason, p.ghost_size), plan


def _exact_choice(plan, why_not: str, sizes: _Sizes) -> StrategyChoice:
    """``"auto"`` without ghost norms: exact per-record gradients (steps 2 and 3
    of the rule in :func:`choose_strategy`)."""
    if sizes.fixed_chunk is not None:
        return StrategyChoice("chunked", sizes.fixed_chunk, f"chunk_size given ({why_not})")
    if sizes.B * sizes.per_record <= sizes.budget:
        general = StrategyChoice("vmap", None, f"{sizes.B} per-record gradients fit the budget ({why_not})")
    else:
        chunk = _budget_chunk(sizes.per_record, sizes.budget, sizes.B)
        general = StrategyChoice(
            "chunked", None if chunk >= sizes.B else chunk,
            f"{sizes.B} per-record gradients exceed the memory budget ({why_not})",
        )
    # entries whose per-record gradients are outer products (all, if unknown)
    outer = sizes.P if plan is None else plan[0].outer_residual_size
    if outer > _CPU_OUTER_MAX_PARAMS and general.chunk_size != 1:
        return StrategyChoice(
            "chunked", 1,
            f"on CPU: {outer} parameter entries with outer-product per-record gradients, which are "
            f"slow to batch on CPU ({why_not})",
            elsewhere=general,
        )
    return general


def choice_on_default_backend(choice: StrategyChoice) -> StrategyChoice:
    """The part of ``choice`` that runs on JAX's default backend (for reports;
    the program itself selects its part when it is lowered)."""
    if choice.elsewhere is None or jax.default_backend() == "cpu":
        return choice._replace(elsewhere=None)
    return choice.elsewhere


def _check_strategy_args(strategy, chunk_size, forward_mode, memory_budget_bytes):
    """The validated ``(strategy, chunk_size, forward_mode, memory budget in bytes)``."""
    strategy = _validate.choice("strategy", strategy, STRATEGIES)
    if chunk_size is not None:
        chunk_size = _validate.integer("chunk_size", chunk_size, minimum=1)
    forward_mode = _validate.boolean("forward_mode", forward_mode)
    if memory_budget_bytes is None:
        budget = DEFAULT_MEMORY_BUDGET_BYTES
    else:
        budget = _validate.integer("memory_budget_bytes", memory_budget_bytes, minimum=1)
    return strategy, chunk_size, forward_mode, budget


def _optional_callable(name: str, value):
    """None or a callable (the message format of :mod:`d3p._validate`)."""
    if value is not None and not callable(value):
        raise _validate.InvalidArgumentType(f"Expected {name} to be a callable or None, got {name}={value!r}.")
    return value


def _resolve(loss_fn, params, records, strategy, chunk_size, forward_mode, memory_budget_bytes):
    """The argument handling of :func:`choose_strategy` and :func:`clipped_grad_sum`:
    ``(B, forward_mode, choice, ghost plan or None)`` from validated arguments."""
    strategy, chunk_size, forward_mode, budget = _check_strategy_args(
        strategy, chunk_size, forward_mode, memory_budget_bytes
    )
    B = _batch_size(records)
    choice, plan = _choose(loss_fn, params, records, B, strategy, chunk_size, forward_mode, budget)
    return B, forward_mode, choice, plan


def choose_strategy(
    loss_fn: Callable,
    params: PyTree,
    records: PyTree,
    *,
    strategy: str = "auto",
    chunk_size: Optional[int] = None,
    forward_mode: bool = False,
    memory_budget_bytes: Optional[int] = None,
) -> StrategyChoice:
    """What :func:`clipped_grad_sum` does with these arguments (static information only).

    The rule for ``strategy="auto"``, applied when the step is traced:

    1. ghost norms if some parameter leaves are used only in dense products
       (``dot_general``), with exact per-record gradients for the others in
       the same pass, in chunks if the per-record activations exceed the
       memory budget;
    2. otherwise, on CPU, one record at a time if more than 16,384 parameter
       entries have outer-product per-record gradients (a parameter-only
       operand of a product with per-record data), which XLA batches slowly
       on CPU;
    3. otherwise (and on other platforms) all records at once (``"vmap"``)
       if ``B`` per-record gradients fit the memory budget, else chunks that
       fit it.

    Where rules 2 and 3 differ, both programs are traced and the one for the
    platform is selected when the step is lowered (never from the default
    backend at trace time): the returned choice is the CPU's, with the other
    platforms' in its ``elsewhere`` field.

    Forward-mode differentiation never uses ghost norms.

    :param loss_fn: ``loss_fn(params, record) -> scalar``, as for :func:`clipped_grad_sum`.
    :param params: the parameters (arrays or abstract values).
    :param records: per-record inputs, leading dimension ``B``.
    :param str strategy: one of :data:`STRATEGIES`.
    :param int chunk_size: records per chunk, or None (from the budget).
    :param bool forward_mode: forward-mode differentiation.
    :param int memory_budget_bytes: bytes for per-record quantities held at once;
        default :data:`DEFAULT_MEMORY_BUDGET_BYTES`.
    :return: :class:`StrategyChoice`.
    """
    return _resolve(loss_fn, params, records, strategy, chunk_size, forward_mode, memory_budget_bytes)[2]


def clipped_grad_sum(
    loss_fn: Callable,
    params: PyTree,
    records: PyTree,
    mask: Optional[jax.Array],
    clipping_threshold: float,
    *,
    on_choice: Optional[Callable[[StrategyChoice], None]] = None,
    strategy: str = "auto",
    chunk_size: Optional[int] = None,
    forward_mode: bool = False,
    memory_budget_bytes: Optional[int] = None,
    num_shards: int = 1,
    threshold_bound: Optional[float] = None,
) -> ClippedSum:
    """Sum over records of per-record gradients, each clipped to norm ``C``.

    :param loss_fn: ``loss_fn(params, record) -> scalar``, the loss of one
        record; ``record`` is one slice of ``records`` along axis 0. It must be
        a pure function of its arguments (as everything under ``jax.jit``).
    :param params: the parameters to differentiate.
    :param records: pytree of per-record inputs, every leaf with leading
        dimension ``B`` (include per-record random keys here).
    :param mask: boolean ``(B,)``, True for real records, or None (all real).
    :param clipping_threshold: ``C``: a number, or a 0-d array (traced, for a
        ``C`` set during the run, as by adaptive clipping).
    :param on_choice: called once per trace of this call with the
        :class:`StrategyChoice` taken (static information only), or None.
    :param str strategy: how per-record gradients are formed, one of
        :data:`STRATEGIES` (described in the module documentation); all compute
        the same clipped sum up to float rounding, but for ``"ghost"`` on
        records with several rows per product (see below). ``"auto"`` (default) is
        chosen by :func:`choose_strategy`; ``"ghost"`` raises ``ValueError``
        if the loss of one record cannot be traced on its own.
    :param int chunk_size: records per chunk for ``"chunked"`` and ``"ghost"``.
    :param bool forward_mode: forward-mode differentiation (not with ``"ghost"``).
    :param int memory_budget_bytes: bytes of per-record quantities held at once
        (``"auto"``, ``"chunked"``, ``"ghost"``); default
        :data:`DEFAULT_MEMORY_BUDGET_BYTES`.
    :param int num_shards: how many such partial sums (one per device, ``B``
        slots each) make up the released sum (see :mod:`d3p._sharding`).
    :param float threshold_bound: a public upper bound of a traced
        ``clipping_threshold``, checked for overflow in its place (a traced
        ``C`` cannot be checked); None: ``clipping_threshold`` is checked.
    :return: :class:`ClippedSum`.
    :raises ValueError: naming the batch size if the sum of ``B * num_shards``
        slots cannot be certified within the margin (more than about 65,000
        float32 slots; fewer under ``"ghost"``, see below), or naming
        ``clipping_threshold`` (``threshold_bound``) if ``B C`` could overflow.

    **Formal guarantees.** Relation: add/remove one record (including masking
    it out and deleting its row, so that ``B`` changes), or substitute one.

    - Every record's gradient is clipped as one vector over all parameter
      leaves to ``C (1 - η)``: what the strategy adds to the sum for it has
      exact L2 norm at most ``C (1 - η)``, computed from the floating-point
      values used, for every ``C > 0``, on every backend and at its default
      matmul precision. ``η`` (``2^-7`` for float32, ``2^-30`` for float64)
      is a public constant: the same for every batch size, strategy and
      number of shards, so a record's clipped contribution never depends on
      the other records or on their number.
    - The returned sum ``F`` is within ``E`` of the exact sum ``S`` of the
      clipped contributions, ``E = ε_B Σ_i ‖c_i‖ + e_tiny`` with ``2 ε_B B
      <= η`` and every record's room reduced by ``2 e_tiny``, whatever the
      values and the order of the records (double-float summation; proof in
      the module documentation and ``_SumBudget``). Hence the released sum
      moves by at most ``C`` in L2 norm when one record is added, removed or
      masked out, and by at most ``2 C`` when one is substituted, by
      construction, not by testing.
    - Padded records (``mask`` False) and records with a non-finite
      gradient or bound contribute exactly zero; their values, even ``nan``,
      never reach the sum. An all-padded batch gives an exact zero sum.
    - The strategy changes only how the sum is computed, never these
      guarantees. Every strategy clips a record with one row per product to
      within about ``sqrt(n) u`` (``n`` the largest leaf size, ``u`` the unit
      roundoff) below ``C (1 - η)``. Under ``"ghost"``, a record with several
      rows per product is clipped by the norm of ``Σ_r |a_r| |δ_r|ᵀ`` (its
      rows' magnitudes), which also bounds the rounding its rows cause in
      the products that sum the batch: a record whose rows differ in sign is
      clipped more than its exact norm requires (never less).
    - The same record's per-record gradient can round differently in
      programs compiled for different batch shapes or devices; the
      guarantees above are for the values computed, and the values of two
      such programs are not bounded against each other by this argument.
    - ``losses`` and ``norms`` are computed from the un-noised data and are
      NOT private.
    """
    on_choice = _optional_callable("on_choice", on_choice)
    num_shards = _validate.integer("num_shards", num_shards, minimum=1)
    B, forward_mode, choice, plan = _resolve(
        loss_fn, params, records, strategy, chunk_size, forward_mode, memory_budget_bytes
    )
    mask = _check_mask(mask, B)
    _report_choice(choice, B, on_choice)
    if B == 0:
        pair, losses, norms = _clipped_chunk(loss_fn, params, records, mask, clipping_threshold, forward_mode)
        return ClippedSum(_df_rounded(pair, params), losses, norms)
    return _sum_on_this_platform(loss_fn, params, records, mask, clipping_threshold, forward_mode,
                                 choice, plan, B, num_shards, threshold_bound)


def _sum_on_this_platform(loss_fn, params, records, mask, clipping_threshold, forward_mode,
                          choice, plan, B, num_shards, threshold_bound=None):
    """The clipped sum under ``choice``, or, where ``choice.elsewhere`` is set,
    under ``choice`` on CPU and ``choice.elsewhere`` on other platforms, picked
    when the program is lowered (:func:`jax.lax.platform_dependent`)."""
    private = not _is_concrete_inf(clipping_threshold)

    def clipped_sum(choice, params, records, mask):
        chunk = B if choice.chunk_size is None else choice.chunk_size
        fp = _fixed_point(params) if private and choice.strategy != "ghost" else None
        budget, block_rows = _budget_of(choice, plan, params, B, chunk, num_shards, private, exact=fp is not None)
        _check_sum_threshold(clipping_threshold, budget, threshold_bound)
        threshold = budget.threshold(clipping_threshold, budget.acc)
        if fp is None:
            chunk_fn = _chunk_function(loss_fn, params, threshold, budget.reserve(), forward_mode, choice, plan,
                                       block_rows)
            pair, losses, norms = _in_chunks(chunk_fn, params, records, mask, chunk)
            return ClippedSum(_df_rounded(pair, params), losses, norms)
        if B > fp.slots:   # the margin check refuses such batches first
            raise ValueError(f"Expected at most {fp.slots} record slots for an exact sum, got batch size B={B}.")
        shift = _grid_shift(fp, threshold)
        room = threshold * np.asarray(1.0 - fp.fraction - 8 * float(jnp.finfo(budget.acc).eps), budget.acc)
        reserve = budget.reserve()

        def chunk_fn(recs, m):
            def summed(clipped):   # (Σh, Σl): two pytrees like params
                return _unzip(jax.tree.structure(clipped), jax.tree.map(lambda x: _to_grid(fp, x, shift), clipped))

            return _clipped_chunk(loss_fn, params, recs, m, room, forward_mode, reserve, summed=summed)

        (high, low), losses, norms = _in_chunks(chunk_fn, params, records, mask, chunk, fixed_point=fp)
        grad = jax.tree.map(lambda h, lo, p: _from_grid(fp, h, lo, shift, budget.acc).astype(jnp.result_type(p)),
                            high, low, params)
        return ClippedSum(grad, losses, norms)

    if choice.elsewhere is None:
        return clipped_sum(choice, params, records, mask)
    return lax.platform_dependent(
        params, records, mask,
        cpu=lambda *a: clipped_sum(choice._replace(elsewhere=None), *a),
        default=lambda *a: clipped_sum(choice.elsewhere, *a),
    )


def _is_concrete_inf(clipping_threshold) -> bool:
    """Whether ``C`` is a concrete ``inf`` (the non-private setting)."""
    try:
        return bool(np.isinf(float(clipping_threshold)))
    except (TypeError, jax.errors.ConcretizationTypeError):
        return False


def _ghost_rows(plan) -> int:
    """The most rows per record of a ghost leaf's products."""
    return max([sum(u.rows for u in us) for us in plan[0].uses] or [1])


def _ghost_rows_per_product(params, B: int, chunk: int, shards: int, rows: int) -> Optional[int]:
    """``k``: the most rows (of ``rows`` per record) contracted in one product
    of the ghost sum so that its rounding, ``γ(k)`` relative (see
    :class:`_SumBudget`), fits the margin with the rest of the sum's error
    for ``shards`` partial sums of ``B`` slots in chunks of ``chunk``; None
    if not even one row per product fits. Larger ``k`` means fewer, larger
    products (less memory, faster); ``k`` falls as ``B`` grows."""
    leaves = jax.tree.leaves(params)
    dtypes = [jnp.result_type(x) for x in leaves]
    acc = _acc_dtype(*dtypes)
    u = _rounding(acc).u
    terms = max(1, min(chunk, B) * rows)
    depth = int(np.ceil(np.log2(terms))) + -(-B // max(1, min(chunk, B))) + int(np.ceil(np.log2(shards))) + 1
    room = _sum_margin(acc, *dtypes) / (2 * B * shards) - _sum_rel(acc, dtypes, depth, shards)
    k = min(int(room / (u * 1.01)), terms)
    while k >= 1 and _gamma(k, _rounding(acc)) * (1 + u) * (1 + 1e-6) > room:
        k = int(k * 0.99)
    return k if k >= 1 else None


def _budget_of(choice, plan, params, B: int, chunk: int, shards: int, check: bool = True, exact: bool = False):
    """``(_SumBudget, rows per ghost product or None)`` of a sum under ``choice``
    (``exact``: in fixed point on each device, see :class:`_FixedPoint`)."""
    if choice.strategy != "ghost":
        return _sum_budget(B, chunk, shards, params, check=check, exact=exact), None
    rows = _ghost_rows(plan)
    k = _ghost_rows_per_product(params, B, chunk, shards, rows)
    if k is None:
        if check:
            raise ValueError(
                f"Expected a batch whose ghost products can be certified, got batch size B={B * shards}: "
                "its rounding would exceed the margin reserved in the clipping threshold even with one "
                "row per product. Use strategy='chunked' or smaller batches."
            )
        k = 1
    acc = _acc_dtype(*[jnp.result_type(x) for x in jax.tree.leaves(params)])
    products = _gamma(k, _rounding(acc)) * (1 + _rounding(acc).u)
    budget = _sum_budget(B, chunk, shards, params, terms_per_slot=max(1.0, rows / k), product_rows=rows,
                         products=products, check=check)
    return budget, k


def _check_mask(mask, B: int) -> jax.Array:
    """The mask as a boolean ``(B,)`` array (all True for None)."""
    mask = jnp.ones((B,), bool) if mask is None else jnp.asarray(mask, bool)
    if mask.shape != (B,):
        raise ValueError(f"Expected mask of shape ({B},), got shape {mask.shape}.")
    return mask


def _report_choice(choice: StrategyChoice, B: int, on_choice) -> None:
    """Log the choice and pass it to ``on_choice``."""
    logger.debug("clipped_grad_sum: B=%d, %s", B, choice)
    if on_choice is not None:
        on_choice(choice)


def _chunk_function(loss_fn, params, threshold, reserve, forward_mode, choice, plan, block_rows):
    """``chunk_fn(records, mask) -> ((hi, lo), losses, norms)`` for one chunk of
    records under ``choice``, every record clipped to ``threshold`` with
    ``reserve`` kept free (see :class:`_SumBudget`); ghost products contract
    ``block_rows`` rows each."""
    if choice.strategy == "ghost":
        from d3p import _ghost

        plan, p_def, _ = plan
        p_leaves = jax.tree.leaves(params)

        def ghost_chunk_fn(recs, m):
            return _ghost.ghost_chunk(plan, p_def, p_leaves, jax.tree.leaves(recs), m, threshold, reserve,
                                      block_rows)

        return ghost_chunk_fn

    def chunk_fn(recs, m):
        return _clipped_chunk(loss_fn, params, recs, m, threshold, forward_mode, reserve)

    return chunk_fn


def noise_std(dp_scale: float, clipping_threshold: float) -> float:
    """Standard deviation of the Gaussian noise per coordinate: ``dp_scale * C``.

    ``dp_scale = 0`` gives 0 even for ``C = inf`` (the non-private setting).

    >>> noise_std(1.5, 2.0)
    3.0
    >>> noise_std(0.0, float("inf"))
    0.0

    :param float dp_scale: the noise multiplier ``sigma``, finite and ``>= 0``.
    :param clipping_threshold: ``C > 0`` (``inf`` allowed); or a traced 0-d
        array (a ``C`` set during the run, e.g. by adaptive clipping, which
        keeps it within public positive bounds): it passes through
        unchecked and the result is a traced array (0.0 if ``dp_scale = 0``).
    :raises ValueError: for other values (``TypeError`` too for non-numbers).
    """
    dp_scale = _validate.non_negative("dp_scale", dp_scale)
    if isinstance(clipping_threshold, jax.core.Tracer):
        return 0.0 if dp_scale == 0 else dp_scale * clipping_threshold
    clipping_threshold = _validate.positive("clipping_threshold", clipping_threshold, finite=False)
    if dp_scale == 0:
        return 0.0
    return dp_scale * clipping_threshold


def add_gaussian_noise(
    grad_sum: PyTree,
    noise_key,
    dp_scale: float,
    clipping_threshold: float,
    rng_suite=d3p.random,
) -> PyTree:
    """``grad_sum`` plus i.i.d. Gaussian noise of std ``dp_scale * C`` per coordinate.

    The only place in d3p where continuous privacy noise is drawn in JAX (the
    discrete mechanism and the marginal twin's float64 noise have their own
    primitives in :mod:`d3p.random`). The noise for all
    parameter leaves comes from one draw of ``rng_suite.normal(noise_key, (P,))``
    over the ``P`` flattened coordinates. ``clipping_threshold`` may be a
    traced 0-d array, as for :func:`noise_std`.

    **Formal guarantees.** If ``grad_sum`` has L2 sensitivity ``C`` (add/remove
    one record, see :func:`clipped_grad_sum`), the output is the Gaussian
    mechanism with noise multiplier ``dp_scale``; its privacy under subsampling
    and composition is what :mod:`d3p.accounting` computes. The noise does not
    depend on the data, the mask or the number of real records.
    """
    std = noise_std(dp_scale, clipping_threshold)
    leaves, treedef = jax.tree.flatten(grad_sum)
    if (isinstance(std, float) and std == 0.0) or not leaves:
        return grad_sum
    # the values of ravel_pytree(grad_sum) + noise, unravelled, without
    # forming the flat vector: each leaf adds its own slice of the one draw
    dtype = jnp.result_type(*leaves)
    sizes = [int(np.size(x)) for x in leaves]
    noise = rng_suite.normal(noise_key, (sum(sizes),), dtype if dtype != jnp.float16 else jnp.float32)
    noise = noise.astype(dtype) * (np.asarray(std, dtype) if isinstance(std, float) else jnp.asarray(std, dtype))
    out, start = [], 0
    for leaf, size in zip(leaves, sizes):
        z = lax.slice_in_dim(noise, start, start + size).reshape(jnp.shape(leaf))
        out.append((jnp.asarray(leaf, dtype) + z).astype(jnp.result_type(leaf)))
        start += size
    return jax.tree.unflatten(treedef, out)
