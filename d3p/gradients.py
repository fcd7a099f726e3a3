"""Per-record gradients, clipping and the noisy sum: the privacy-critical math.

Everything here is a pure JAX function of explicit inputs. :class:`d3p.svi.DPSVI`
wires them together; they can also be used on their own to build other
DP-SGD style algorithms.

Glossary: clipping threshold ``C``, noise multiplier ``sigma`` (``dp_scale``),
batch size ``B`` (the number of record slots, real or padded).
"""

import logging
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.flatten_util import ravel_pytree

import d3p.random
from d3p import _ghost

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
    "last_choice",
    "DEFAULT_MEMORY_BUDGET_BYTES",
]

PyTree = Any

#: Names of the per-record gradient strategies; all compute the same clipped sum
#: (see :func:`clipped_grad_sum`).
STRATEGIES = ("auto", "vmap", "chunked", "scan", "ghost")


class ClippedSum(NamedTuple):
    """The result of :func:`clipped_grad_sum`.

    - **grad_sum** - the sum over real records of clipped per-record
      gradients (a pytree like the parameters).
    - **losses** - per-record losses, shape ``(B,)``, 0 for padded records.
      NOT private: never release them.
    - **norms** - per-record total gradient norms before clipping, shape
      ``(B,)``, 0 for padded records. NOT private.
    """

    grad_sum: PyTree
    losses: jax.Array
    norms: jax.Array


def total_norm(tree: PyTree) -> jax.Array:
    """The L2 norm of all leaves of ``tree`` taken together as one vector.

    Computed with scaling by the largest magnitude, so that large finite
    gradients do not overflow to ``inf``. Returns ``nan`` or ``inf`` if any
    entry is non-finite.
    """
    leaves = [jnp.ravel(x) for x in jax.tree.leaves(tree)]
    if not leaves:
        return jnp.zeros(())
    flat = jnp.concatenate(leaves)
    peak = jnp.max(jnp.abs(flat))
    safe_peak = jnp.where((peak > 0) & jnp.isfinite(peak), peak, 1.0)
    scaled = jnp.sqrt(jnp.sum(jnp.square(flat / safe_peak))) * safe_peak
    return jnp.where(jnp.isfinite(peak), scaled, jnp.inf)


def clip_gradient(grad: PyTree, clipping_threshold: float):
    """Scale ``grad`` so that its total L2 norm is at most ``clipping_threshold``.

    :param grad: one record's gradient (any pytree of arrays).
    :param float clipping_threshold: ``C > 0``; ``inf`` leaves finite gradients
        unchanged.
    :return: ``(clipped, norm)``: the clipped gradient and the total norm of
        ``grad`` before clipping.

    **Formal guarantees.** ``total_norm(clipped) <= C`` for every input,
    up to floating-point rounding of ``C / norm`` (relative 1e-6 in float32).
    A gradient with any non-finite entry (``nan``, ``inf``) is replaced by
    zeros, so it contributes nothing rather than breaking the bound. A
    gradient with norm at most ``C`` is returned unchanged.

    **Example**

    >>> import jax.numpy as jnp
    >>> grad = {"w": jnp.array([3.0, 4.0]), "b": jnp.array([0.0])}
    >>> clipped, norm = clip_gradient(grad, 1.0)
    >>> float(norm), float(total_norm(clipped))
    (5.0, 1.0)
    >>> clipped["w"]
    Array([0.6, 0.8], dtype=float32)
    >>> clip_gradient({"w": jnp.array([jnp.nan, 1.0])}, 1.0)[0]["w"].tolist()
    [0.0, 0.0]
    """
    norm = total_norm(grad)
    finite = jnp.isfinite(norm)
    safe_norm = jnp.where(finite & (norm > 0), norm, 1.0)
    factor = jnp.where(norm > clipping_threshold, clipping_threshold / safe_norm, 1.0)
    factor = jnp.where(finite, factor, 0.0)
    clipped = jax.tree.map(
        lambda g: jnp.where(finite, g * factor.astype(g.dtype), jnp.zeros_like(g)), grad
    )
    return clipped, norm


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
    if forward_mode:

        def value_and_grad(p, r):
            flat, unravel = ravel_pytree(p)
            f = lambda fp: loss_fn(unravel(fp), r)  # noqa: E731
            return f(flat), unravel(jax.jacfwd(f)(flat))

    else:
        value_and_grad = jax.value_and_grad(loss_fn)
    return jax.vmap(value_and_grad, in_axes=(None, 0))(params, records)


def _value_and_grad_one(loss_fn, params, record, forward_mode):
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


def _clip_factor(norms: jax.Array, clipping_threshold: float) -> jax.Array:
    """``min(1, C / norm)`` per record, 0 for non-finite norms (as :func:`clip_gradient`)."""
    finite = jnp.isfinite(norms)
    safe_norm = jnp.where(finite & (norms > 0), norms, 1.0)
    factor = jnp.where(norms > clipping_threshold, clipping_threshold / safe_norm, 1.0)
    return jnp.where(finite, factor, 0.0).astype(norms.dtype)


def _clipped_chunk(loss_fn, params, records, mask, clipping_threshold, forward_mode):
    if mask.shape[0] == 1:
        # one record: no vmap, so that XLA sees plain (un-batched) products
        one = jax.tree.map(lambda x: x[0], records)
        loss, grad = _value_and_grad_one(loss_fn, params, one, forward_mode)
        losses, grads = loss[None], jax.tree.map(lambda g: g[None], grad)
    else:
        losses, grads = per_record_value_and_grad(loss_fn, params, records, forward_mode=forward_mode)
    clipped, norms = jax.vmap(clip_gradient, in_axes=(0, None))(grads, clipping_threshold)
    keep = mask & jnp.isfinite(norms)
    summed = jax.tree.map(
        lambda g: jnp.sum(jnp.where(keep.reshape((-1,) + (1,) * (g.ndim - 1)), g, 0.0), axis=0),
        clipped,
    )
    losses = jnp.where(mask, losses, 0.0)
    norms = jnp.where(mask, norms, 0.0)
    return summed, losses, norms


def _in_chunks(chunk_fn, params, records, mask, chunk):
    """Run ``chunk_fn(records, mask) -> (sum, losses, norms)`` over chunks of
    ``chunk`` records under ``lax.scan`` and add up the sums."""
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
    zero = jax.tree.map(jnp.zeros_like, params)

    def body(acc, xs):
        recs, m = xs
        s, losses, norms = chunk_fn(recs, m)
        return jax.tree.map(jnp.add, acc, s), (losses, norms)

    total, (losses, norms) = lax.scan(body, zero, (chunked_records, chunked_mask))
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
    """

    strategy: str
    chunk_size: Optional[int]
    reason: str
    ghost_params: int = 0


def _param_count_and_itemsize(params):
    leaves = jax.tree.leaves(params)
    count = sum(int(np.prod(np.shape(x), dtype=np.int64)) for x in leaves)
    itemsize = max([jnp.dtype(jnp.result_type(x)).itemsize for x in leaves] or [4])
    return count, itemsize


def _budget_chunk(per_record_bytes, budget, B):
    return int(max(1, min(B, budget // max(per_record_bytes, 1))))


def _choose(loss_fn, params, records, B, strategy, chunk_size, forward_mode, budget):
    """(StrategyChoice, ghost plan or None)."""
    P, itemsize = _param_count_and_itemsize(params)
    per_record = P * itemsize * _COPIES
    if chunk_size is not None:
        chunk_size = int(chunk_size)
    fixed_chunk = None if chunk_size is None or chunk_size >= B else chunk_size

    if strategy == "ghost" and forward_mode:
        raise ValueError(
            "Expected forward_mode=False with strategy='ghost': ghost norms need "
            "reverse-mode differentiation; use strategy='chunked' or 'vmap'."
        )
    if B == 0:
        return StrategyChoice("vmap", None, "empty batch"), None
    if strategy == "vmap":
        return StrategyChoice("vmap", None, "requested"), None
    if strategy == "scan":
        return StrategyChoice("chunked", 1 if B > 1 else None, "requested (one record at a time)"), None
    if strategy == "chunked":
        chunk = chunk_size if chunk_size is not None else _budget_chunk(per_record, budget, B)
        return StrategyChoice("chunked", None if chunk >= B else chunk, "requested"), None

    plan, why_not = None, None
    if forward_mode:
        why_not = "forward-mode differentiation"
    else:
        try:
            plan = _ghost.trace_plan(loss_fn, params, records)
        except _ghost.Unsupported as err:
            why_not = str(err)
        else:
            if not plan[0].ghost_leaves:
                why_not = "no parameter is used only in dense products"
    if strategy == "ghost":
        if plan is None:
            raise ValueError(f"strategy='ghost' cannot be used for this loss: {why_not}.")
        p = plan[0]
        chunk = fixed_chunk or _budget_chunk(p.per_record_floats * itemsize * _COPIES, budget, B)
        reason = "requested" + ("" if p.ghost_leaves else f"; exact per-record gradients only ({why_not})")
        return StrategyChoice("ghost", None if chunk >= B else chunk, reason, p.ghost_size), plan

    # strategy == "auto"
    if plan is not None and plan[0].ghost_leaves:
        p = plan[0]
        per = p.per_record_floats * itemsize * _COPIES
        chunk = fixed_chunk or _budget_chunk(per, budget, B)
        reason = (
            f"ghost norms for {p.ghost_size} of {P} parameter entries, exact per-record "
            f"gradients for {p.residual_size}"
        )
        return StrategyChoice("ghost", None if chunk >= B else chunk, reason, p.ghost_size), plan
    fits = B * per_record <= budget
    if fixed_chunk is not None:
        return StrategyChoice("chunked", fixed_chunk, f"chunk_size given ({why_not})"), None
    # entries whose per-record gradients are outer products (all, if unknown)
    outer = P if plan is None else plan[0].outer_residual_size
    if jax.default_backend() == "cpu" and outer > _CPU_OUTER_MAX_PARAMS:
        return StrategyChoice(
            "chunked", 1,
            f"{outer} parameter entries with outer-product per-record gradients, which are "
            f"slow to batch on CPU ({why_not})",
        ), None
    if fits:
        return StrategyChoice("vmap", None, f"{B} per-record gradients fit the budget ({why_not})"), None
    chunk = _budget_chunk(per_record, budget, B)
    return StrategyChoice(
        "chunked", None if chunk >= B else chunk,
        f"{B} per-record gradients exceed the memory budget ({why_not})",
    ), None


def _check_strategy_args(strategy, chunk_size, memory_budget_bytes):
    if strategy not in STRATEGIES:
        raise ValueError(f"Expected strategy in {STRATEGIES}, got strategy={strategy!r}.")
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1
    ):
        raise ValueError(f"Expected chunk_size >= 1 (an integer) or None, got chunk_size={chunk_size!r}.")
    budget = DEFAULT_MEMORY_BUDGET_BYTES if memory_budget_bytes is None else memory_budget_bytes
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 1:
        raise ValueError(
            f"Expected memory_budget_bytes to be a positive integer or None, got "
            f"memory_budget_bytes={memory_budget_bytes!r}."
        )
    return int(budget)


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
    3. otherwise all records at once (``"vmap"``) if ``B`` per-record
       gradients fit the memory budget, else chunks that fit it.

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
    budget = _check_strategy_args(strategy, chunk_size, memory_budget_bytes)
    return _choose(loss_fn, params, records, _batch_size(records), strategy, chunk_size,
                   forward_mode, budget)[0]


def clipped_grad_sum(
    loss_fn: Callable,
    params: PyTree,
    records: PyTree,
    mask: Optional[jax.Array],
    clipping_threshold: float,
    *,
    strategy: str = "auto",
    chunk_size: Optional[int] = None,
    forward_mode: bool = False,
    memory_budget_bytes: Optional[int] = None,
) -> ClippedSum:
    """Sum over records of per-record gradients, each clipped to norm ``C``.

    :param loss_fn: ``loss_fn(params, record) -> scalar``, the loss of one
        record; ``record`` is one slice of ``records`` along axis 0. It must be
        a pure function of its arguments (as everything under ``jax.jit``).
    :param params: the parameters to differentiate.
    :param records: pytree of per-record inputs, every leaf with leading
        dimension ``B`` (include per-record random keys here).
    :param mask: boolean ``(B,)``, True for real records, or None (all real).
    :param float clipping_threshold: ``C``.
    :param str strategy: how per-record gradients are formed; all strategies
        compute the same clipped sum (up to float rounding):

        - ``"auto"`` (default): chosen from static information by
          :func:`choose_strategy`;
        - ``"vmap"``: all ``B`` per-record gradients at once (whatever the
          memory budget);
        - ``"chunked"``: ``chunk_size`` records at a time under ``lax.scan``
          (default: as many as fit ``memory_budget_bytes``);
        - ``"scan"``: one record at a time;
        - ``"ghost"``: per-record gradient norms from the activations and
          output gradients of the dense products in which a parameter is used
          (``‖∂W‖² = Σ (a_u·a_v)(δ_u·δ_v)``), and the clipped sum as one
          matrix product over all records, never forming per-record gradients
          of such parameters (those whose every use, through reshapes and
          transposes, is an operand of a ``dot_general`` without batch
          dimensions); exact per-record gradients for the other parameters in
          the same pass (all of them, if none qualifies). Chunked like
          ``"chunked"`` when the per-record activations exceed the budget.
          Raises ``ValueError`` if the loss of one record cannot be traced on
          its own.
    :param int chunk_size: records per chunk for ``"chunked"`` and ``"ghost"``.
    :param bool forward_mode: forward-mode differentiation (not with ``"ghost"``).
    :param int memory_budget_bytes: bytes of per-record quantities held at once
        (``"auto"``, ``"chunked"``, ``"ghost"``); default
        :data:`DEFAULT_MEMORY_BUDGET_BYTES`.
    :return: :class:`ClippedSum`.

    **Formal guarantees.** The gradient of every record is clipped as one
    vector over all parameter leaves (:func:`clip_gradient`), so for any two
    record sets that differ by adding or removing one record (or by masking
    it out) the sum moves by at most ``C`` in L2 norm, and for two that
    differ by substituting one record it moves by at most ``2 C``. Padded
    records (``mask`` False) and records with non-finite gradients contribute
    exactly zero; their values, even ``nan``, never reach the sum. An all-padded
    batch gives an exact zero sum. The strategy changes only how the sum is
    computed, never these guarantees: under ``"ghost"`` each record's
    clipping factor is computed from the norm of exactly the quantities that
    are then summed for it, so the bound holds whatever the structure of the
    loss. ``losses`` and ``norms`` are computed from the un-noised data and are
    NOT private.
    """
    budget = _check_strategy_args(strategy, chunk_size, memory_budget_bytes)
    B = _batch_size(records)
    mask = jnp.ones((B,), bool) if mask is None else jnp.asarray(mask, bool)
    if mask.shape != (B,):
        raise ValueError(f"Expected mask of shape ({B},), got shape {mask.shape}.")
    choice, plan = _choose(loss_fn, params, records, B, strategy, chunk_size, forward_mode, budget)
    logger.debug("clipped_grad_sum: B=%d, %s", B, choice)
    _LAST_CHOICE[0] = choice
    if B == 0:
        return ClippedSum(*_clipped_chunk(loss_fn, params, records, mask, clipping_threshold, forward_mode))

    if choice.strategy == "ghost":
        plan, p_def, _ = plan
        p_leaves = jax.tree.leaves(params)

        def chunk_fn(recs, m):
            return _ghost.ghost_chunk(
                plan, p_def, p_leaves, jax.tree.leaves(recs), m,
                lambda n: _clip_factor(n, clipping_threshold),
            )
    else:

        def chunk_fn(recs, m):
            return _clipped_chunk(loss_fn, params, recs, m, clipping_threshold, forward_mode)

    chunk = B if choice.chunk_size is None else choice.chunk_size
    return ClippedSum(*_in_chunks(chunk_fn, params, records, mask, chunk))


_LAST_CHOICE = [None]


def last_choice() -> Optional[StrategyChoice]:
    """The :class:`StrategyChoice` of the most recent trace of :func:`clipped_grad_sum`
    in this process (``None`` before the first); for benchmarks and debugging."""
    return _LAST_CHOICE[0]


def noise_std(dp_scale: float, clipping_threshold: float) -> float:
    """Standard deviation of the Gaussian noise per coordinate: ``dp_scale * C``.

    ``dp_scale = 0`` gives 0 even for ``C = inf`` (the non-private setting).

    >>> noise_std(1.5, 2.0)
    3.0
    >>> noise_std(0.0, float("inf"))
    0.0
    """
    if dp_scale == 0:
        return 0.0
    return float(dp_scale) * float(clipping_threshold)


def add_gaussian_noise(
    grad_sum: PyTree,
    noise_key,
    dp_scale: float,
    clipping_threshold: float,
    rng_suite=d3p.random,
) -> PyTree:
    """``grad_sum`` plus i.i.d. Gaussian noise of std ``dp_scale * C`` per coordinate.

    The only place in d3p where privacy noise is drawn. The noise for all
    parameter leaves comes from one draw of ``rng_suite.normal(noise_key, (P,))``
    over the ``P`` flattened coordinates.

    **Formal guarantees.** If ``grad_sum`` has L2 sensitivity ``C`` (add/remove
    one record, see :func:`clipped_grad_sum`), the output is the Gaussian
    mechanism with noise multiplier ``dp_scale``; its privacy under subsampling
    and composition is what :mod:`d3p.accounting` computes. The noise does not
    depend on the data, the mask or the number of real records.
    """
    std = noise_std(dp_scale, clipping_threshold)
    leaves, treedef = jax.tree.flatten(grad_sum)
    if std == 0.0 or not leaves:
        return grad_sum
    # the values of ravel_pytree(grad_sum) + noise, unravelled, without
    # forming the flat vector: each leaf adds its own slice of the one draw
    dtype = jnp.result_type(*leaves)
    sizes = [int(np.size(x)) for x in leaves]
    noise = rng_suite.normal(noise_key, (sum(sizes),), dtype if dtype != jnp.float16 else jnp.float32)
    noise = noise.astype(dtype) * np.asarray(std, dtype)
    out, start = [], 0
    for leaf, size in zip(leaves, sizes):
        z = lax.slice_in_dim(noise, start, start + size).reshape(jnp.shape(leaf))
        out.append((jnp.asarray(leaf, dtype) + z).astype(jnp.result_type(leaf)))
        start += size
    return jax.tree.unflatten(treedef, out)
