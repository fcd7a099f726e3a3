"""The sum over records in double-float arithmetic and its public error bound.

Pairs ``(hi, lo)`` added error-free by Fast2Sum (``_fast_two_sum``,
``_df_add``), in pairwise trees over records (``_df_tree``,
``_df_tree_pytree``) or over products of records (``_df_weighted_sums``),
sequentially over chunks and in a tree over devices;
the margin ``η`` reserved in the clipping threshold (``_sum_margin``), the
public bound of the sum's error and the threshold every record is clipped to
(``_SumBudget``, ``_sum_budget``), and the rows per ghost product that fit it
(``_ghost_rows_per_product``). The argument is in :mod:`d3p.gradients` and
in ``_SumBudget``'s proof. Ghost products and the partial sums of several
devices are summed here; per-record gradients in fixed point
(``d3p._fixed_point``), under the same budget.
"""
from typing import Any, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from d3p._clipping import _acc_dtype, _gamma, _rounding, _rows
from d3p.random._common import in_two_halves

PyTree = Any


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


def _by_groups(leaves, fn) -> Tuple[list, list]:
    """``(hi, lo)`` lists over ``leaves`` (leading axis: records): ``fn`` of each
    leaf's rows ``(B, entries)`` in its accumulation dtype (at least float32),
    the small leaves of one dtype joined into one matrix (fewer, larger
    operations; the same arithmetic entry by entry) and split again."""
    out = [None] * len(leaves)
    groups = {}
    for i, x in enumerate(leaves):
        x = x.astype(_acc_dtype(x.dtype))
        if _rows(x).shape[1] <= _DF_JOIN_MAX:
            groups.setdefault(x.dtype, []).append(i)
        else:
            hi, lo = fn(_rows(x))
            out[i] = (hi.reshape(x.shape[1:]), lo.reshape(x.shape[1:]))
    for dtype, idx in groups.items():
        rows = [_rows(leaves[i].astype(dtype)) for i in idx]
        hi, lo = fn(jnp.concatenate(rows, axis=1) if len(rows) > 1 else rows[0])
        start = 0
        for i, r in zip(idx, rows):
            shape = leaves[i].shape[1:]
            stop = start + r.shape[1]
            out[i] = (hi[start:stop].reshape(shape), lo[start:stop].reshape(shape))
            start = stop
    return [o[0] for o in out], [o[1] for o in out]


def _df_tree_pytree(clipped: PyTree) -> Tuple[PyTree, PyTree]:
    """``(hi, lo)``: two pytrees like ``clipped`` with the double-float sum
    (:func:`_df_tree`) over the leading (record) axis of every leaf, in the
    accumulation dtype of the leaf (at least float32). Small leaves of one
    dtype are concatenated into one tree: the same additions, entry by entry."""
    leaves, treedef = jax.tree.flatten(clipped)
    # computed once (in_two_halves over the entries), not fused into each leaf's slice of the sum
    hi, lo = _by_groups(leaves, lambda rows: in_two_halves(_df_tree, [rows], axis=1))
    return treedef.unflatten(hi), treedef.unflatten(lo)


def _df_weighted_sums(leaves, weights: jax.Array, k: int) -> Tuple[list, list]:
    """``(hi, lo)`` lists over ``leaves``: the double-float sum over records
    (leading axis) of ``weights[i] * leaves[..][i]``, as products of ``k``
    records each (``Precision.HIGHEST``) added up by :func:`_df_tree`. Each
    product is off by at most ``γ(k)`` times the sum of the magnitudes of its
    terms ``|w_i x_i|`` (any order of summation; converting a weight to the
    leaf's dtype is a rounding the clip factor allows for), as a ghost
    product of ``k`` rows is (:class:`_SumBudget`, (5)). The ghost strategy
    sums the exact gradients of its other leaves so, weighted by the clip
    factors: one product where ``k`` covers the batch, where a tree over the
    records compiled into kernels of its own at every level. Small leaves of
    one dtype are joined."""
    B = weights.shape[0]
    k = max(1, min(int(k), B))
    nb = -(-B // k)

    def weighted(rows):
        w = weights.astype(rows.dtype)
        if nb * k > B:
            w = jnp.concatenate([w, jnp.zeros((nb * k - B,), w.dtype)])
            rows = jnp.concatenate([rows, jnp.zeros((nb * k - B, rows.shape[1]), rows.dtype)])
        products = jnp.einsum("nk,nke->ne", w.reshape(nb, k), rows.reshape(nb, k, rows.shape[1]),
                              precision=jax.lax.Precision.HIGHEST)
        if nb == 1:
            return products[0], jnp.zeros_like(products[0])
        # computed once, not fused into each leaf's slice (see _df_tree_pytree)
        return in_two_halves(_df_tree, [products], axis=1)

    return _by_groups(leaves, weighted)


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
    norm is at most ``f (1 + u) M_i`` per record (``d3p._ghost.gram_bound``);
    the exact per-record gradients ``g_i`` of its other leaves are summed as
    products of ``k`` records with the clip factors as (exact) weights
    (:func:`_df_weighted_sums`), each off by at most ``γ(k)`` times
    ``Σ_i |f_i g_i|``, of norm ``f_i ‖g_i‖`` per record, which is within the
    record's bound ``M_i`` (one row per record, at most the ghost leaves' rows).
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
