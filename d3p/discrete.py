# SPDX-License-Identifier: Apache-2.0
"""The discrete Gaussian mechanism: noise that is private in floating point.

The continuous mechanism (:func:`d3p.gradients.add_gaussian_noise`) adds
floating-point approximations of Gaussian noise to a floating-point sum. The
set of values such noise can produce has gaps, and where they fall depends
on the value the noise is added to: an observer of exact outputs can then see
events of probability zero under one data set and not under its neighbour
(Mironov 2012), which no accountant covers. This module releases integers
instead, with every step from the clipped gradients to the noisy sum exact:

1. Each record's clipped gradient ``g`` (all parameter leaves together, exact
   L2 norm at most ``C``, see :func:`d3p.gradients.clipped_grad_sum`) is
   rounded to the public grid ``γ``: ``r = round(g / γ)``, an integer vector.
2. The L2 norm of ``r`` is bounded from above with the certified norm bound
   of :mod:`d3p.gradients`; if the bound exceeds the public ``T``, a smaller
   rounding ``round(ρ g / γ)`` is tried, and if that fails too the record
   contributes zero. So every record's integer vector has exact norm at most
   ``T``, whatever its gradient, by construction; padded records and records
   with a non-finite gradient contribute exactly zero.
3. The vectors are summed in int32, exactly (the plan refuses batches for
   which the sum could leave the int32 range).
4. Discrete Gaussian noise ``N_Z(0, s)`` with ``s = 2**k = (σ T)²`` is added
   to every coordinate, drawn exactly from integer random words
   (:func:`d3p.random.discrete_gaussian`), and the integer result is
   released: multiplied by ``γ`` (a function of the released integers only,
   hence post-processing, whatever its rounding).

The integer sum has L2 sensitivity ``T`` under adding or removing one record
and ``2 T`` under substituting one; with noise ``σ T`` its privacy is that of
the discrete Gaussian mechanism with noise multiplier ``σ``, accounted by
:mod:`d3p.accounting` with ``noise="discrete"``.

**Choice of the grid** (:func:`discrete_plan`). ``T`` is ``(1 + η) C / γ``:
the noise, in gradient units, has standard deviation ``(1 + η) σ C``, a
relative increase of ``η`` (``inflation``, default 1%) over the continuous
mechanism. The grid is fine enough that a clipped gradient's rounding error
(at most ``γ/2`` per coordinate, ``γ √d / 2`` in norm for ``d`` parameters)
fits in the margin: ``(C/γ)² ((1 + η)² − 1) ≥ d / 4``, so ``‖r‖² ≤ ‖g/γ‖² +
‖g/γ‖ √d + d/4`` stays below ``T²`` for every record whose rounding errors are
not aligned with its gradient, and such records keep their exact rounding.
``T`` is then raised to the next value with ``(σ T)²`` a power of two (the
exact sampler's requirement), which only makes the grid finer, and to at
least ``(1 + η)·min_resolution`` grid steps per ``C``.
"""

import math
from dataclasses import dataclass
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import d3p.random
from d3p import _validate, gradients
from d3p.random.discrete import MAX_LOG2_VARIANCE, discrete_gaussian

__all__ = ["DiscretePlan", "discrete_plan", "clipped_integer_sum", "add_discrete_gaussian_noise"]

#: The sum of a batch, plus noise, must stay within ``± 2**30`` grid steps.
_SUM_LIMIT = 2 ** 30


@dataclass(frozen=True)
class DiscretePlan:
    """The public constants of the discrete Gaussian mechanism (see the module documentation).

    - **dp_scale** - the noise multiplier ``σ``;
    - **clipping_threshold** - ``C``;
    - **num_params** - ``d``, the number of parameter coordinates;
    - **grid** - ``γ``, the gradient value of one integer step;
    - **bound** - ``T``, the certified L2 norm bound of one record's integer vector;
    - **log2_variance** - ``k``: the noise is ``N_Z(0, 2**k)`` in grid steps, ``2**(k/2) = σ T``;
    - **inflation** - ``η``: ``T = (1 + η) C / γ``.
    """

    dp_scale: float
    clipping_threshold: float
    num_params: int
    grid: float
    bound: float
    log2_variance: int
    inflation: float

    @property
    def noise_std(self) -> float:
        """The noise standard deviation per coordinate in gradient units, ``(1 + η) σ C``
        (up to the difference between the discrete and the continuous Gaussian's)."""
        return self.grid * 2.0 ** (self.log2_variance / 2)

    def max_batch_size(self) -> int:
        """The largest batch whose exact integer sum the plan can carry in int32."""
        return int(_SUM_LIMIT // (math.floor(self.bound) + 1))


def _log2_variance(sigma_t: float) -> int:
    """The smallest integer ``k >= 0`` with ``2**(k/2) >= sigma_t``."""
    k = max(0, math.ceil(2 * math.log2(sigma_t))) if sigma_t > 1 else 0
    while 2.0 ** (k / 2) < sigma_t:
        k += 1
    while k > 0 and 2.0 ** ((k - 1) / 2) >= sigma_t:
        k -= 1
    return k


def _largest_bound(k: int, sigma: float) -> float:
    """The largest float ``T`` with ``σ T <= 2**(k/2)`` exactly (compared in
    rationals, squared), so that the noise is at least σ times the bound."""
    bound = 2.0 ** (k / 2) / sigma
    while (Fraction(bound) * Fraction(sigma)) ** 2 > 2 ** k:
        bound = math.nextafter(bound, 0.0)
    return bound


def discrete_plan(dp_scale: float, clipping_threshold: float, num_params: int, *,
                  inflation: float = 0.01, min_resolution: int = 256) -> DiscretePlan:
    """The grid, the norm bound and the noise of the discrete mechanism.

    :param float dp_scale: the noise multiplier ``σ > 0``.
    :param float clipping_threshold: ``C > 0``, finite.
    :param int num_params: ``d >= 1``, the number of parameter coordinates.
    :param float inflation: ``η`` in (0, 1]: the noise is ``(1 + η) σ C`` per
        coordinate (default 0.01).
    :param int min_resolution: at least this many grid steps per ``C`` (>= 1).
    :raises ValueError: if the noise would need more than
        ``2**(MAX_LOG2_VARIANCE/2)`` grid steps (an extremely large ``σ``).
    """
    sigma = _validate.positive("dp_scale", dp_scale)
    c = _validate.positive("clipping_threshold", clipping_threshold)
    d = _validate.integer("num_params", num_params, minimum=1)
    eta = _validate.number("inflation", inflation, low=0.0, high=1.0, low_open=True)
    resolution = _validate.integer("min_resolution", min_resolution, minimum=1)
    margin = math.sqrt((1 + eta) ** 2 - 1)
    t_grid = (1 + eta) * math.sqrt(d) / (2 * margin)   # the rounding error fits
    t_min = max(t_grid, (1 + eta) * resolution)
    if sigma * t_min > 2.0 ** (MAX_LOG2_VARIANCE / 2):
        t_min = t_grid   # give up the resolution floor before the support
    k = _log2_variance(sigma * t_min)
    if k > MAX_LOG2_VARIANCE:
        raise ValueError(
            f"Expected dp_scale * sqrt(num_params) below about {2 ** 20 * 2 * margin / (1 + eta):.3g} "
            f"for the exact discrete sampler, got dp_scale={dp_scale!r} and num_params={num_params!r}; "
            "use noise='gaussian' or a larger inflation."
        )
    bound = _largest_bound(k, sigma)
    return DiscretePlan(sigma, c, d, (1 + eta) * c / bound, bound, k, eta)


def _below(value: float, dtype) -> np.ndarray:
    """The largest number of ``dtype`` that is at most ``value``."""
    x = np.asarray(value, dtype)
    return x if float(x) <= value else np.nextafter(x, np.asarray(-np.inf, dtype))


def _exactly_within(r, bound: float) -> jax.Array:
    """Per record, whether the integer-valued float leaves ``r`` have exact L2
    norm at most ``bound``, decided in int32 arithmetic where that is exact
    (every entry at most ``m`` in magnitude with ``n m² < 2**30`` for ``n``
    entries); False where it is not."""
    limit_sq = math.floor(Fraction(bound) ** 2)   # exact, not the rounded square
    n = sum(int(np.prod(x.shape[1:], dtype=np.int64)) for x in r)
    if limit_sq >= 2 ** 31 - 1 or n >= 2 ** 30:
        return jnp.zeros((r[0].shape[0],), bool)
    rows = [gradients._rows(x) for x in r]
    fits = jnp.all(jnp.stack([jnp.all(jnp.abs(x) <= 46340, axis=1) for x in rows]), axis=0)
    ints = [jnp.clip(x, -46340, 46340).astype(jnp.int32) for x in rows]
    peak = jnp.max(jnp.stack([jnp.max(jnp.abs(x), axis=1) for x in ints]), axis=0)
    small = jnp.float32(n) * jnp.square(peak.astype(jnp.float32)) < 2.0 ** 30
    exact = sum(jnp.sum(jnp.square(x), axis=1, dtype=jnp.int32) for x in ints)
    return fits & small & (exact <= limit_sq)


def _integer_records(clipped, keep: jax.Array, plan: DiscretePlan):
    """Per record (leading axis of every leaf of ``clipped``), the integer vector
    whose exact L2 norm is at most ``plan.bound`` (see the module documentation),
    as int32 leaves; zero where ``keep`` is False."""
    leaves, treedef = jax.tree.flatten(clipped)
    acc = gradients._acc_dtype(*[x.dtype for x in leaves])
    limit = _below(plan.bound, acc)
    steps = plan.bound / (1 + plan.inflation)   # C / γ
    # the fallback's worst case: ρ C/γ (1 + u) + √d/2 + 1 <= T
    rho = max(0.0, (plan.bound - math.sqrt(plan.num_params) / 2 - 2) / steps) * (1 - 1e-3)

    def rounded(scale: float):
        r = [jnp.round(x.astype(acc) * np.asarray(scale / plan.grid, acc)) for x in leaves]
        # certified: the float bound is >= the exact norm of the integers; or exact in int32
        within = (gradients._record_bound(r) <= limit) | _exactly_within(r, plan.bound)
        return r, within

    first, first_ok = rounded(1.0)
    second, second_ok = rounded(rho)
    out = []
    for a, b in zip(first, second):
        pick = jnp.where(gradients._per_record(first_ok, a), a, b)
        ok = gradients._per_record(keep & (first_ok | second_ok), a)
        out.append(jnp.where(ok, pick, jnp.zeros_like(pick)).astype(jnp.int32))
    return jax.tree.unflatten(treedef, out)


def _integer_record(loss_fn, params, record, mask, plan, forward_mode):
    """``(integer vector, loss, gradient norm bound)`` of one record (``mask``: a
    boolean scalar, False for padding); 0, 0, 0 for padding."""
    loss, grad = gradients._value_and_grad_one(loss_fn, params, record, forward_mode)
    grads = jax.tree.map(lambda g: g[None], grad)
    m = mask[None]
    clipped, norms = gradients._clip_records(grads, plan.clipping_threshold, mask=m)
    ints = _integer_records(clipped, m & jnp.isfinite(norms), plan)
    loss, norm = gradients._real_only(m, loss[None], norms)
    return jax.tree.map(lambda r: r[0], ints), loss[0], norm[0]


def _check_slots(plan: DiscretePlan, B: int) -> None:
    """Raise unless a batch of ``B`` record slots has an exact int32 sum under ``plan``."""
    if B > plan.max_batch_size():
        raise ValueError(f"Expected at most {plan.max_batch_size()} record slots per batch for the exact "
                         f"int32 sum at {plan.bound:.4g} grid steps per record, got {B}.")


def clipped_integer_sum(loss_fn, params, records, mask, plan: DiscretePlan, *,
                        forward_mode: bool = False) -> gradients.ClippedSum:
    """The exact int32 sum over records of their clipped, rounded gradients.

    Steps 1 to 3 of the module documentation: every record's gradient is
    clipped to ``plan.clipping_threshold`` (as :func:`d3p.gradients.clipped_grad_sum`
    does), rounded to ``plan.grid`` and kept only with a certified L2 norm of at
    most ``plan.bound`` grid steps (else a smaller rounding, else zero), so the
    sum has L2 sensitivity ``plan.bound`` under adding or removing a record
    and twice that under substituting one.

    The records are processed one at a time by one ``lax.scan`` body (as the
    ``"scan"`` strategy does), so every record's integer vector is computed by
    the same compiled code whatever its position in the batch and whatever
    the other records are: the floating-point steps before the rounding are
    one fixed function of the record, and the sum of integers is exact, so
    the sum over a batch is exactly the sum of those functions (batched
    per-record computations may round differently at different positions,
    which could move another record's rounding by a grid step). This rests on
    the compiler running one copy of the loop body for every record (the scan
    is not unrolled, ``unroll=1``).

    :param loss_fn: ``loss_fn(params, record) -> scalar`` for one record.
    :param params: the parameters to differentiate.
    :param records: pytree of per-record inputs with leading dimension ``B``.
    :param mask: boolean ``(B,)``, True for real records, or None (all real).
    :param DiscretePlan plan: from :func:`discrete_plan` with ``num_params`` the
        number of coordinates of ``params``.
    :return: :class:`d3p.gradients.ClippedSum` whose ``grad_sum`` has int32 leaves
        (grid steps); its ``losses`` and ``norms`` are NOT private.
    :raises ValueError: if ``B`` records could overflow the int32 sum
        (:meth:`DiscretePlan.max_batch_size`) or ``params`` does not have
        ``plan.num_params`` coordinates.
    """
    if not isinstance(plan, DiscretePlan):
        raise _validate.InvalidArgumentType(f"Expected plan to be a DiscretePlan, got plan={plan!r}.")
    B = gradients._batch_size(records)
    mask = gradients._check_mask(mask, B)
    num_params = sum(int(np.size(x)) for x in jax.tree.leaves(params))
    if num_params != plan.num_params:
        raise ValueError(f"Expected params with plan.num_params={plan.num_params} coordinates, "
                         f"got {num_params}.")
    _check_slots(plan, B)
    if B == 0:
        zero = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.int32), params)
        return gradients.ClippedSum(zero, jnp.zeros((0,)), jnp.zeros((0,)))

    def one_record(acc, xs):
        record, m = xs
        s, loss, norm = _integer_record(loss_fn, params, record, m, plan, forward_mode)
        return jax.tree.map(jnp.add, acc, s), (loss, norm)

    zero = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.int32), params)
    total, (losses, norms) = lax.scan(one_record, zero, (records, mask), unroll=1)
    return gradients.ClippedSum(total, losses, norms)


def add_discrete_gaussian_noise(integer_sum, noise_key, plan: DiscretePlan, rng_suite=d3p.random,
                                dtype=None):
    """Release ``integer_sum`` (int32 leaves, grid steps) plus discrete Gaussian
    noise ``N_Z(0, 2**plan.log2_variance)`` per coordinate, in gradient units.

    The noise for all leaves comes from one exact draw of
    :func:`d3p.random.discrete_gaussian` over the flattened coordinates; the
    noisy integers are formed exactly (int32; a sum beyond its range wraps,
    which is still a function of the exact noisy integers) and only then
    multiplied by ``plan.grid`` in ``dtype`` (default: JAX's default float):
    post-processing of the released integers.

    **Formal guarantee.** If ``integer_sum`` has L2 sensitivity ``plan.bound``
    (see :func:`clipped_integer_sum`), the released integers are the discrete
    Gaussian mechanism with noise multiplier ``plan.dp_scale``; the noise does
    not depend on the data, the mask or the number of real records.
    """
    if not isinstance(plan, DiscretePlan):
        raise _validate.InvalidArgumentType(f"Expected plan to be a DiscretePlan, got plan={plan!r}.")
    suite = _validate.rng_suite("rng_suite", rng_suite)
    dtype = jnp.zeros(()).dtype if dtype is None else jnp.dtype(dtype)
    leaves, treedef = jax.tree.flatten(integer_sum)
    sizes = [int(np.size(x)) for x in leaves]
    noise = discrete_gaussian(noise_key, (sum(sizes),), plan.log2_variance, suite)
    out, start = [], 0
    for leaf, size in zip(leaves, sizes):
        z = lax.slice_in_dim(noise, start, start + size).reshape(jnp.shape(leaf))
        noisy = lax.add(jnp.asarray(leaf, jnp.int32), z)   # exact; wraps beyond int32
        out.append(noisy.astype(dtype) * np.asarray(plan.grid, dtype))
        start += size
    return jax.tree.unflatten(treedef, out)
