"""Per-record gradient strategies: how :func:`clipped_grad_sum` forms and sums them.

The strategies ``"vmap"``, ``"chunked"``, ``"scan"`` and ``"ghost"`` (ghost
norms in ``d3p._ghost``), the rule of ``"auto"`` (:func:`choose_strategy`,
:class:`StrategyChoice`) from static sizes and the memory budget, the loop
over chunks of records, and the choice of the sum for each: exact in fixed
point (``d3p._fixed_point``) for per-record gradients, double-float
(``d3p._certified_sum``) for ghost products. Every strategy clips with the
primitives of ``d3p._clipping``. The public names are documented and
imported from :mod:`d3p.gradients`, which states the guarantees.
"""
import functools
import logging
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.flatten_util import ravel_pytree

from d3p import _ghost, _validate
from d3p._certified_sum import (
    _check_sum_threshold,
    _df_add_pytrees,
    _df_rounded,
    _df_tree_pytree,
    _ghost_rows_per_product,
    _sum_budget,
    _unzip,
)
from d3p._clipping import _acc_dtype, _clip_records, _gamma, _real_only, _rounding
from d3p._fixed_point import _fixed_point, _from_grid, _grid_shift, _to_grid

# the public module's name: what the strategy choice is logged under
logger = logging.getLogger("d3p.gradients")

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
#: ``"ghost"`` on accelerators (GPU, TPU); override per call with ``memory_budget_bytes``.
DEFAULT_MEMORY_BUDGET_BYTES = 1 << 30
#: ... and where JAX's default backend is the CPU: smaller chunks, with a
#: peak memory near SVI's and faster at large batches (benchmarks/README.md,
#: "Memory of a step": the VAE at B = 4096, peak RSS 1.43 times SVI's against
#: 3.28 times with 1 GiB, and its step 39 % faster).
DEFAULT_CPU_MEMORY_BUDGET_BYTES = 64 << 20


def default_memory_budget() -> int:
    """The memory budget without ``memory_budget_bytes``: :data:`DEFAULT_CPU_MEMORY_BUDGET_BYTES`
    where JAX's default backend is the CPU, else :data:`DEFAULT_MEMORY_BUDGET_BYTES`."""
    return DEFAULT_CPU_MEMORY_BUDGET_BYTES if jax.default_backend() == "cpu" else DEFAULT_MEMORY_BUDGET_BYTES

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
        budget = default_memory_budget()
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
    loss_fn: Callable, params: PyTree, records: PyTree, mask: Optional[jax.Array], clipping_threshold: float,
    *, on_choice: Optional[Callable[[StrategyChoice], None]] = None, strategy: str = "auto",
    chunk_size: Optional[int] = None, forward_mode: bool = False, memory_budget_bytes: Optional[int] = None,
    num_shards: int = 1, threshold_bound: Optional[float] = None,
) -> ClippedSum:
    """Sum over records of per-record gradients, each clipped to norm ``C``.

    The strategies and why the guarantees hold: :mod:`d3p.gradients`.

    :param loss_fn: ``loss_fn(params, record) -> scalar``, the loss of one
        record (one slice of ``records`` along axis 0); a pure function.
    :param params: the parameters to differentiate.
    :param records: pytree of per-record inputs, every leaf with leading
        dimension ``B`` (include per-record random keys here).
    :param mask: boolean ``(B,)``, True for real records, or None (all real).
    :param clipping_threshold: ``C``: a number, or a 0-d (traced) array.
    :param on_choice: called once per trace with the :class:`StrategyChoice`.
    :param str strategy: one of :data:`STRATEGIES`; ``"auto"`` (default) is
        chosen by :func:`choose_strategy`.
    :param int chunk_size: records per chunk for ``"chunked"`` and ``"ghost"``.
    :param bool forward_mode: forward-mode differentiation (not with ``"ghost"``).
    :param int memory_budget_bytes: bytes of per-record quantities held at
        once; default :data:`DEFAULT_MEMORY_BUDGET_BYTES`.
    :param int num_shards: partial sums (one per device, ``B`` slots each) in the release.
    :param float threshold_bound: a public bound of a traced ``C``, checked
        for overflow in its place; None: ``clipping_threshold`` is checked.
    :return: :class:`ClippedSum`.
    :raises ValueError: naming the batch size if ``B * num_shards`` slots
        cannot be certified (about 65,000 in float32, fewer under ``"ghost"``),
        naming ``clipping_threshold`` (``threshold_bound``) if ``B C`` could
        overflow, or if ``"ghost"`` cannot trace the loss of one record alone.

    **Formal guarantees.** Relation: add/remove one record (masked out, or
    its row deleted), or substitute one.

    - What a record adds has exact L2 norm at most ``C (1 - η)`` over all
      leaves, for every ``C > 0``, strategy and backend; ``η`` is a public
      constant of the dtype (``2^-7`` float32, ``2^-30`` float64).
    - The released sum moves by at most ``C`` when a record is added,
      removed or masked out, by at most ``2 C`` when one is substituted,
      whatever the other records and their order.
    - Padded records and non-finite gradients add exactly zero, never ``nan``.
    - ``"ghost"`` clips a record with several rows per product by the norm
      of its rows' magnitudes: never less than its gradient's norm.
    - ``losses`` and ``norms`` are NOT private.
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
        plan, p_def, _ = plan
        p_leaves = jax.tree.leaves(params)

        def ghost_chunk_fn(recs, m):
            return _ghost.ghost_chunk(plan, p_def, p_leaves, jax.tree.leaves(recs), m, threshold, reserve,
                                      block_rows)

        return ghost_chunk_fn

    def chunk_fn(recs, m):
        return _clipped_chunk(loss_fn, params, recs, m, threshold, forward_mode, reserve)

    return chunk_fn

