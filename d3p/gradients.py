"""Per-record gradients, clipping and the noisy sum: the privacy-critical math.

Everything here is a pure JAX function of explicit inputs. :class:`d3p.svi.DPSVI`
wires them together; they can also be used on their own to build other
DP-SGD style algorithms.

Glossary: clipping threshold ``C``, noise multiplier ``sigma`` (``dp_scale``),
batch size ``B`` (the number of record slots, real or padded).

This module is the public face of the clipped, noisy sum and holds the
noise; the rest lives in private modules, one concept each, which import
each other in one direction only: ``d3p._clipping`` (norm bounds, the clip
factor) < ``d3p._certified_sum`` (the double-float sum and its budget) <
``d3p._fixed_point`` (the exact sum on a public grid); ``d3p._ghost`` (ghost
norms) sits on the first two, and ``d3p._strategies`` (the per-record
gradient strategies, :func:`clipped_grad_sum`) on all of them.

Each privacy primitive has exactly one implementation, which
:func:`clip_gradient`, :func:`total_norm` and every gradient strategy
(``"vmap"``, ``"chunked"``, ``"scan"`` and ``"ghost"``) use:

- the overflow-safe norm bound (``d3p._clipping``): ``_norm_bound`` (scaling
  by powers of two in ``_unit_scaled``, the bound of a scaled norm in
  ``_scaled_norm_bound``), for several arrays at once ``_norm_bounds`` (of
  which ``_norm_bound`` is the case of one); the bound of a record's
  gradient over all its leaves: ``_record_bound``; ghost norms
  (``d3p._ghost.gram_bound``) build on ``_unit_scaled``,
  ``_scaled_norm_bound`` and ``_norm_bounds``;
- the sum over records and its public error bound: ``_FixedPoint``,
  ``_to_grid`` and ``_from_grid`` (``d3p._fixed_point``: exact integer
  accumulation on a public grid, for per-record gradients), ``_df_add`` and
  ``_df_tree`` (``d3p._certified_sum``: double-float accumulation, for ghost
  products and across devices), ``_SumBudget`` (``d3p._certified_sum``: the
  threshold every record is clipped to and the check that the sum's error
  fits the margin);
- the clip factor (``d3p._clipping``): ``_clip_factor`` (with
  ``_flush_slack``), turned into the per-record decision by
  ``_clip_decision`` and applied by ``_keep_records``;
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
- hence every strategy clips a record with one row per product to within
  about ``sqrt(n) u`` (``n`` the largest leaf size, ``u`` the unit roundoff)
  below ``C (1 - η)``, on every backend and at its default matmul precision;
  under ``"ghost"``, the norm of ``Σ_r |a_r| |δ_r|ᵀ`` by which a record with
  several rows per product is clipped also bounds the rounding its rows cause
  in the products that sum the batch: a record whose rows differ in sign is
  clipped more than its exact norm requires (never less);
- padded records (``mask`` False) and records with a non-finite gradient or
  bound contribute exactly zero: their values, even ``nan``, never reach the
  sum, and an all-padded batch gives an exact zero sum.

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
  (the ghost strategy forms products of ``k`` rows, and its leaves that are
  not ghost leaves products of ``k`` records weighted by their clip factors,
  each within ``γ(k)`` of the magnitudes of its terms, and sums those)
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

These guarantees are for the values computed. The same record's per-record
gradient can round differently in programs compiled for different batch
shapes or devices, and the values of two such programs are not bounded
against each other by this argument: masking a record out keeps the shapes
and is covered fully (``docs/privacy.md``).
"""
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import d3p.random
from d3p import _strategies, _validate

# The private names below are imported from this module by d3p.svi,
# d3p.discrete, d3p._sharding, benchmarks and tests.
from d3p._certified_sum import (  # noqa: F401
    _df_tree,
    _df_tree_pytree,
    _fast_two_sum,
    _ghost_rows_per_product,
    _sum_budget,
    _sum_margin,
    _SumBudget,
)
from d3p._clipping import (  # noqa: F401
    _acc_dtype,
    _blocked_sum,
    _clip_decision,
    _clip_factor,
    _clip_records,
    _norm_bound,
    _norm_bounds,
    _per_record,
    _real_only,
    _record_bound,
    _rows,
    clip_gradient,
    total_norm,
)
from d3p._fixed_point import _fixed_point, _FixedPoint, _from_grid  # noqa: F401
from d3p._strategies import (  # noqa: F401
    ClippedSum,
    PyTree,
    StrategyChoice,
    _batch_size,
    _check_mask,
    _ghost_rows,
    _in_chunks,
    _value_and_grad_one,
    choice_on_default_backend,
    choose_strategy,
    clipped_grad_sum,
    per_record_value_and_grad,
)

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
    "DEFAULT_CPU_MEMORY_BUDGET_BYTES",
]

#: Names of the per-record gradient strategies; all compute the same clipped sum
#: up to rounding, but for "ghost" on records with several rows per product
#: (see :func:`clipped_grad_sum`).
STRATEGIES = _strategies.STRATEGIES

#: Default memory budget (bytes) for per-record quantities held at once by
#: :func:`clipped_grad_sum` under ``strategy="auto"``, ``"chunked"`` and
#: ``"ghost"`` on accelerators; override per call with ``memory_budget_bytes``.
DEFAULT_MEMORY_BUDGET_BYTES = _strategies.DEFAULT_MEMORY_BUDGET_BYTES
#: The same where JAX's default backend is the CPU (64 MiB).
DEFAULT_CPU_MEMORY_BUDGET_BYTES = _strategies.DEFAULT_CPU_MEMORY_BUDGET_BYTES


def noise_std(dp_scale: float, clipping_threshold: float) -> float:
    """Standard deviation of the Gaussian noise per coordinate: ``dp_scale * C``.

    ``dp_scale = 0`` gives 0 even for ``C = inf`` (the non-private setting).

    >>> noise_std(1.5, 2.0)
    3.0
    >>> noise_std(0.0, float("inf"))
    0.0

    :param float dp_scale: the noise multiplier ``sigma``, finite and ``>= 0``;
        or a traced 0-d array (σ as an argument of ``run``'s compiled steps,
        which then serve every σ; checked by ``run``): the result is then
        ``dp_scale * clipping_threshold``, a traced array.
    :param clipping_threshold: ``C > 0`` (``inf`` allowed); or a traced 0-d
        array (a ``C`` set during the run, e.g. by adaptive clipping, which
        keeps it within public positive bounds): it passes through
        unchecked and the result is a traced array (0.0 if ``dp_scale = 0``).
    :raises ValueError: for other values (``TypeError`` too for non-numbers).
    """
    if isinstance(dp_scale, jax.core.Tracer):
        return dp_scale * clipping_threshold
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
    over the ``P`` flattened coordinates. ``dp_scale`` and ``clipping_threshold``
    may be traced 0-d arrays, as for :func:`noise_std`.

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
