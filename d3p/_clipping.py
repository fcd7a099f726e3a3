"""Certified norm bounds and the clip factor: the clipping of :mod:`d3p.gradients`.

The one implementation of the per-record norm bound (``_norm_bounds``,
of several arrays at once, ``_norm_bound``, ``_record_bound``, with the
exact scaling by powers of two of ``_unit_scaled``), of the clip factor (``_clip_factor``, ``_flush_slack``)
and of its application to a batch of records (``_clip_decision``,
``_keep_records``, ``_clip_records``), and the public :func:`total_norm` and
:func:`clip_gradient` built on them (documented and imported from
:mod:`d3p.gradients`). Why the bound holds is stated in
:mod:`d3p.gradients`.

The bottom of the gradient modules: ``d3p._certified_sum``,
``d3p._fixed_point``, ``d3p._ghost`` and ``d3p._strategies`` import it, it
imports none of them.
"""
from typing import Any, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from d3p.random._common import in_two_halves

PyTree = Any

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
    return x * np.asarray(_up_factor(k, rnd), x.dtype)


def _up_factor(k: float, rnd: _Rounding) -> float:
    """The factor of :func:`_up` for ``k > 0`` roundings (exactly representable)."""
    steps = int(np.ceil(_gamma(k + 1, rnd) / rnd.eps)) + 1
    return 1.0 + steps * rnd.eps


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
    total, flushed, factor = _squares(xs, naxes, rnd)
    return (jnp.sqrt(total) + np.asarray(flushed, xs.dtype)) * np.asarray(factor, xs.dtype)


def _squares(xs: jax.Array, naxes: int, rnd: _Rounding) -> Tuple[jax.Array, float, float]:
    """``(total, flushed, factor)`` of :func:`_scaled_norm_bound`: the sum of
    squares over the last ``naxes`` axes, the allowance for squares flushed to
    zero, and the factor of :func:`_up` for the roundings; the bound is
    ``(sqrt(total) + flushed) * factor``."""
    n = int(np.prod(xs.shape[xs.ndim - naxes:], dtype=np.int64))
    total, depth = _blocked_sum(jnp.square(xs), naxes)
    # squares below `tiny` may be flushed: at most n * tiny in total, i.e. at
    # most sqrt(n * tiny) in the norm (sqrt(a + b) <= sqrt(a) + sqrt(b));
    # squares: 1 rounding; sums: depth; halved by the square root, which adds
    # at most 2 (allowing for a square root that is not correctly rounded);
    # the addition of `flushed`: 1
    return total, 2.0 * np.sqrt(n * rnd.tiny), _up_factor(-(-(depth + 1) // 2) + 3, rnd)


def _norm_bound(x: jax.Array, naxes: int = 1) -> jax.Array:
    """Upper bound of the L2 norm of ``x`` over its last ``naxes`` axes, in a dtype
    of at least float32: ``inf`` if any entry is non-finite or if the bound
    overflows, otherwise at least the exact norm of the finite values of ``x``
    minus ``sqrt(n) * tiny`` (entries below the smallest normal number, which a
    backend may treat as zero). Scaled by a power of two (exact) so that large
    and small finite entries neither overflow nor underflow; within a factor
    ``1 + (sqrt(n) + 5) u`` of the exact norm.
    """
    return _norm_bounds([x], naxes)[0]


def _norm_bounds(xs, naxes: int = 1) -> list:
    """:func:`_norm_bound` of each array of ``xs`` (over its last ``naxes``
    axes). The arithmetic on one value per slice (the scaling exponent of
    :func:`_unit_scaled`, the bound of :func:`_scaled_norm_bound` from the sum
    of squares, the scaling back) is computed once for all arrays of one
    accumulation dtype, their slices' values joined: a norm bound is some
    sixty operations, all but a dozen of them on one value per slice, and a
    private step with ghost norms bounds a dozen arrays."""
    out = [None] * len(xs)
    groups = {}
    for i, x in enumerate(xs):
        groups.setdefault(_acc_dtype(x.dtype), []).append(i)
    for acc, idx in groups.items():
        for i, bound in zip(idx, _norm_bounds_joined([xs[i].astype(acc) for i in idx], naxes)):
            out[i] = bound
    return out


def _norm_bounds_joined(xs, naxes: int) -> list:
    """:func:`_norm_bounds` of arrays of one dtype (at least float32)."""
    acc, rnd = xs[0].dtype, _rounding(xs[0].dtype)
    leads = [x.shape[: x.ndim - naxes] for x in xs]
    sizes = [int(np.prod(lead, dtype=np.int64)) for lead in leads]
    peak = jnp.concatenate([_peak(x, naxes).reshape(-1) for x in xs])
    # joined values computed once (in_two_halves), not again in each array's
    # slice of them; for one or two arrays the loops cost more than they save
    once = (lambda fn, *args: fn(*args)) if len(xs) <= 2 else (lambda fn, *args: in_two_halves(fn, list(args)))
    s, unit = once(lambda p: _scale_of(p, acc), peak)
    totals, flushed, factors = [], [], []
    for x, lead, size, scale in zip(xs, leads, sizes, _split(unit, sizes)):
        total, flush, factor = _squares(x * scale.reshape(lead + (1,) * naxes), naxes, rnd)
        totals.append(total.reshape(-1))
        flushed.append(np.full(size, flush, acc))
        factors.append(np.full(size, factor, acc))
    bound = once(_scaled_back, jnp.concatenate(totals), np.concatenate(flushed), np.concatenate(factors), s, peak)
    return [b.reshape(lead) for b, lead in zip(_split(bound, sizes), leads)]


def _scale_of(peak: jax.Array, acc) -> Tuple[jax.Array, jax.Array]:
    """``(s, 2^s)`` of :func:`_unit_scaled` for slices of largest magnitude ``peak``
    (``2^0`` for slices of zeros)."""
    s = _scale_exponent(peak)
    return s, jnp.where(peak == 0, np.asarray(1, acc), _pow2(s, acc))


def _scaled_back(total, flushed, factor, s, peak) -> jax.Array:
    """The bound of :func:`_norm_bound` from the sum of squares ``total`` of the
    scaled slice, its allowances (``flushed``, the factor of ``_up``) and scale."""
    bound = (jnp.sqrt(total) + flushed) * factor
    return jnp.where(jnp.isfinite(peak), _times_pow2(bound, -s), jnp.inf)


def _split(x: jax.Array, sizes) -> list:
    """``x`` cut into consecutive pieces of ``sizes``."""
    bounds = np.cumsum([0] + list(sizes))
    return [x[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def _peak(x: jax.Array, naxes: int) -> jax.Array:
    """The largest magnitude of every slice over the last ``naxes`` axes (``nan``
    or ``inf`` if an entry is non-finite; zeros for empty slices)."""
    axes = tuple(range(x.ndim - naxes, x.ndim))
    return jnp.max(jnp.abs(x), axis=axes) if x.size else jnp.zeros(x.shape[: x.ndim - naxes], x.dtype)


def _unit_scaled(x: jax.Array, naxes: int) -> Tuple[jax.Array, jax.Array, jax.Array]:
    """``(x * 2^s, s, peak)`` in a dtype of at least float32: every slice over the
    last ``naxes`` axes scaled by a power of two (exact) so that its largest
    magnitude ``peak`` (``nan`` or ``inf`` if an entry is non-finite) lies in
    [1, 4) when it is normal; the scaled entries then neither overflow nor
    underflow in squares and products."""
    acc = _acc_dtype(x.dtype)
    x = x.astype(acc)
    peak = _peak(x, naxes)
    # slices of zeros are left as they are (scaled, they are the same zeros):
    # where they were constants of the program, XLA's constant folding turned
    # the squares of zeros scaled by 2^126 into nan, so that a ghost leaf whose
    # output gradient was a constant zero had every record's bound inf and
    # every record dropped (tests/test_clipping_bound.py)
    s, unit = _scale_of(peak, acc)
    return x * unit.reshape(s.shape + (1,) * naxes), s, peak


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
    per_leaf = jnp.stack([b.astype(acc) for b in _norm_bounds([_rows(g) for g in leaves])], axis=1)
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

