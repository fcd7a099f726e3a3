"""Data parallelism for DP-VI: the record slots of a batch sharded over a device mesh.

One DP-VI step is data parallel by construction: each record's clipped
gradient depends on that record alone, the clipped sum is the only reduction
over records, and the noise is drawn once, for that sum. With a
:class:`jax.sharding.Mesh` (given to :class:`d3p.svi.DPSVI` or set in context
with :func:`jax.set_mesh`), a step on a batch of ``B`` record slots runs on
the ``D`` devices of the mesh axes named by ``batch_axis`` (all of them by
default), with :func:`jax.shard_map`:

1. the batch (records, their Monte Carlo keys, the mask) is padded with
   masked slots to a multiple of ``D`` (padded slots contribute exactly
   zero) and split by position: device ``d`` gets slots ``d B'/D`` to
   ``(d + 1) B'/D - 1`` of the padded length ``B'``. Only positions decide
   where a record goes, never data; the batch itself was drawn whole, by one
   sampler from one key (:meth:`d3p.svi.DPSVI.run` draws it the same in
   every process), so the union of the shards is the batch the accountant
   assumes;
2. every device computes the clipped sum of its shard with the same
   function as on one device (:func:`d3p.gradients.clipped_grad_sum` with
   ``num_shards=D``, whose public error bound then covers the whole batch
   of ``D`` shards and step 3, and whose clipping threshold is the
   one-device one; or :func:`d3p.discrete.clipped_integer_sum`, whose int32
   sum is exact), with the parameters cast to device-varying values so
   that each device differentiates its own records only (a replicated
   parameter's gradient would otherwise be summed over devices by the
   transpose of its implicit broadcast, mixing records of different devices
   before clipping);
3. the partial sums are gathered on every device (``all_gather`` over the
   batch axes, in device order) and added up there by the same double-float
   tree (:func:`d3p.gradients._df_tree`; integer sums exactly): the clipped
   sum over the whole batch, the same bits on every device, with the error
   bound of ``d3p.gradients._SumBudget`` whatever order an all-reduce would
   have chosen;
4. the caller adds the noise to that replicated sum once, from the replicated
   noise key (outside the ``shard_map``, as on one device): every device
   holds the same released value, with noise of the one-device scale.

Losses and norms come back per slot (sharded like the batch) and are not
private, as on one device.
"""

import math
from typing import Callable, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from d3p import _validate
from d3p import gradients
from d3p.gradients import ClippedSum


class BatchLayout(NamedTuple):
    """How a step's batch is sharded (static): the mesh and the names of the
    axes over whose devices the record slots are split.

    - **mesh** - the :class:`jax.sharding.Mesh` given to DPSVI, or None for
      the mesh in context (:func:`jax.set_mesh`), which ``shard_map`` finds itself.
    - **axes** - the batch axes' names.
    - **sizes** - their sizes.
    - **explicit** - whether they are of type ``AxisType.Explicit`` (the
      inputs are then resharded explicitly before the ``shard_map``).
    """

    mesh: Optional[jax.sharding.Mesh]
    axes: Tuple[str, ...]
    sizes: Tuple[int, ...]
    explicit: bool

    @property
    def num_shards(self) -> int:
        """``D``: the number of shards of the batch (devices along the batch axes)."""
        return math.prod(self.sizes)

    @property
    def spec(self) -> P:
        """The partition spec of per-slot arrays: the leading axis split over the batch axes."""
        return P(self.axes)


def batch_layout(mesh: Optional[jax.sharding.Mesh], batch_axis) -> Optional[BatchLayout]:
    """The layout of a step: over ``mesh`` (DPSVI's) if given, else over the mesh
    set in context with :func:`jax.set_mesh`, else None (one device).

    Raises ``ValueError`` naming ``batch_axis`` for an axis the mesh lacks, for
    batch axes of mixed types, and when called inside ``shard_map`` (manual
    axes in context): there every device would add its own noise to its own
    part of the sum.
    """
    context = jax.sharding.get_abstract_mesh()
    manual = [n for n, t in zip(context.axis_names, context.axis_types) if t == AxisType.Manual]
    if manual:
        raise ValueError(
            f"Expected DPSVI's step outside shard_map, got it traced inside shard_map over the mesh "
            f"axes {tuple(manual)}: every device would add its own noise to its own part of the "
            "sum. Call it outside shard_map with the mesh (DPSVI(..., mesh=mesh) or jax.set_mesh): "
            "DPSVI shards the batch itself and adds the noise once."
        )
    if mesh is None and context.empty:
        if batch_axis is not None:
            raise ValueError(
                f"Expected a mesh for batch_axis={batch_axis!r}, got none: give DPSVI(..., mesh=mesh) or "
                "set one with jax.set_mesh(mesh)."
            )
        return None
    source = mesh.abstract_mesh if mesh is not None else context
    mesh_name = "mesh" if mesh is not None else "the mesh in context (jax.set_mesh)"
    axes = _validate.mesh_axes("batch_axis", batch_axis, source.axis_names, mesh_name)
    types = {source.axis_types[source.axis_names.index(a)] for a in axes}
    if len(types) > 1:
        raise ValueError(
            f"Expected batch_axis to name axes of one type (all Explicit or all Auto), got "
            f"batch_axis={batch_axis!r} with axis types {sorted(str(t) for t in types)}."
        )
    sizes = tuple(int(source.shape[a]) for a in axes)
    return BatchLayout(mesh, axes, sizes, types == {AxisType.Explicit})


def _place(tree, layout: BatchLayout, spec: P):
    """``tree`` resharded to ``spec`` where the batch axes are explicit (a
    ``shard_map`` then needs its inputs' types to match its specs); unchanged
    for auto axes, where ``shard_map`` reshards its inputs itself."""
    if not layout.explicit:
        return tree
    target = spec if layout.mesh is None else NamedSharding(layout.mesh, spec)
    return jax.tree.map(lambda x: jax.sharding.reshard(x, target), tree)


def _pad(records, mask: jax.Array, extra: int):
    """``records`` and ``mask`` with ``extra`` slots appended: zeros, masked out."""
    if extra == 0:
        return records, mask

    def pad(x):
        x = jnp.asarray(x)
        return jnp.concatenate([x, jnp.zeros((extra,) + x.shape[1:], x.dtype)])

    return jax.tree.map(pad, records), pad(mask)


def sharded_sum(layout: Optional[BatchLayout], sum_fn: Callable[..., ClippedSum], params, records,
                mask: Optional[jax.Array], shared=None) -> ClippedSum:
    """The clipped sum of a batch, over the devices of ``layout`` (steps 1 to 3
    of the module documentation), or on one device if ``layout`` is None.

    :param layout: from :func:`batch_layout`.
    :param sum_fn: ``sum_fn(params, records, mask, num_shards) -> ClippedSum``:
        the clipped sum of one shard, certified for being added to the sums of
        ``num_shards - 1`` other shards.
    :param params: the parameters (replicated).
    :param records: pytree of per-slot arrays with leading dimension ``B``.
    :param mask: boolean ``(B,)`` (True for real records) or None (all real).
    :param shared: None, or a pytree of public values the same for every
        record (e.g. the key of a Monte Carlo draw shared by the batch),
        replicated on every device and passed as ``sum_fn``'s fifth argument
        (values of an explicit mesh cannot be closed over by ``shard_map``).
    :return: the :class:`ClippedSum` of the whole batch: ``grad_sum``
        replicated on every device, ``losses`` and ``norms`` ``(B,)``.

    **Formal guarantees.** The sum is that of ``sum_fn`` over the shards, and
    every record is in exactly one shard, chosen by its position alone:
    added slots are masked out and contribute exactly zero. The partial sums
    are added by a fixed double-float tree, identical on every device, so if
    ``sum_fn`` clips every record to ``C (1 - η)`` and certifies its error for
    ``num_shards`` partial sums so added (as
    :func:`d3p.gradients.clipped_grad_sum` does), the released sum has
    sensitivity ``C`` (``2 C`` substituted) as on one device.
    """
    B = int(jax.tree.leaves(records)[0].shape[0])
    extra = () if shared is None else (shared,)
    if layout is None:
        return sum_fn(params, records, mask, 1, *extra)
    D = layout.num_shards
    mask = jnp.ones((B,), bool) if mask is None else jnp.asarray(mask)
    records, mask = _pad(records, mask, max(D, -(-B // D) * D) - B)
    spec = layout.spec
    params, extra = _place((params, extra), layout, P())
    records, mask = _place((records, mask), layout, spec)

    def local(params, records, mask, *extra):
        # device-varying parameters: each device's gradients are of its own records only
        params = jax.lax.pcast(params, layout.axes, to="varying")
        result = sum_fn(params, records, mask, D, *extra)
        return _gathered_sum(result.grad_sum, layout.axes), result.losses, result.norms

    # check_vma=False: models' own loops (e.g. numpyro's plate subsampling)
    # carry device-invariant values that device-varying keys update, which the
    # check refuses; without it, a replicated input's gradient is local too
    grad_sum, losses, norms = jax.shard_map(
        local, mesh=layout.mesh, in_specs=(P(), spec, spec) + (P(),) * len(extra), out_specs=(P(), spec, spec),
        check_vma=False,
    )(params, records, mask, *extra)
    losses, norms = _place((losses, norms), layout, P())   # explicit axes: sliceable to B
    return ClippedSum(grad_sum, losses[:B], norms[:B])


def _gathered_sum(partial, axes):
    """The sum over the devices of ``axes`` of ``partial`` (a pytree), the same on
    every device: gathered in device order, then a double-float tree of
    additions for float leaves (see :func:`d3p.gradients._df_tree`), an
    exact sum for integer leaves."""

    def total(x):
        gathered = jax.lax.all_gather(x, axes, tiled=False)
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return jnp.sum(gathered, axis=0)
        return gradients._df_tree(gathered.astype(gradients._acc_dtype(x.dtype)))[0].astype(x.dtype)

    return jax.tree.map(total, partial)


def partitioned(layout: Optional[BatchLayout], fn: Callable, leaves):
    """``fn(leaves)``, with the per-record arrays ``leaves`` split along their
    leading axis over batch axes of type ``Auto`` (those whose length divides
    evenly), for computations that JAX partitions itself
    (:meth:`d3p.svi.DPSVI.evaluate`). With ``Explicit`` batch axes ``fn``
    runs on the arrays as they are: explicit sharding would make every
    operation of the model state how its result is sharded."""
    if layout is None or layout.explicit:
        return fn(leaves)
    mesh = concrete_mesh(layout)
    target = layout.spec if mesh is None else NamedSharding(mesh, layout.spec)

    def shard(x):
        divisible = np.ndim(x) > 0 and np.shape(x)[0] % layout.num_shards == 0
        return jax.lax.with_sharding_constraint(x, target) if divisible else x

    return fn([shard(x) for x in leaves])


def concrete_mesh(layout: Optional[BatchLayout]) -> Optional[jax.sharding.Mesh]:
    """The concrete mesh of ``layout`` (outside ``jax.jit`` also the one in context), or None."""
    if layout is None:
        return None
    if layout.mesh is not None:
        return layout.mesh
    try:
        mesh = jax.sharding.get_mesh()
    except ValueError:   # traced: no concrete mesh
        return None
    return None if mesh.empty else mesh


def replicate(tree, mesh: Optional[jax.sharding.Mesh]):
    """``tree``'s concrete arrays placed on every device of ``mesh``, whole
    (``P()``); traced values and everything else unchanged. In a multi-process
    run every process must pass the same values (see :func:`check_same_in_every_process`)."""
    if mesh is None:
        return tree
    sharding = NamedSharding(mesh, P())

    def put(x):
        if isinstance(x, jax.core.Tracer) or not isinstance(x, (jax.Array, np.ndarray)):
            return x
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return x   # already a global array of a multi-process run
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.device_put(x, sharding)
        value = np.asarray(x)
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    return jax.tree.map(put, tree)


def check_same_in_every_process(name: str, value) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` (a key, or any
    pytree of arrays) is the same in every process of a multi-process JAX
    run; nothing to check in one process.

    Every process must derive the same batches and the same noise: with keys
    that differ between processes, each would sample its own batch (a record
    could enter twice) and release its own noisy sum (independent noises,
    whose average has less noise than accounted). The values are compared
    without being printed (keys are secret)."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    def raw(x):
        x = jax.random.key_data(x) if jnp.issubdtype(jnp.result_type(x), jax.dtypes.prng_key) else x
        return np.asarray(x)

    local = [raw(x) for x in jax.tree.leaves(value)]
    gathered = multihost_utils.process_allgather(local)
    if not all(np.all(g == g[0]) for g in gathered):
        raise ValueError(
            f"Expected {name} to be the same in every process, got different values in the "
            f"{jax.process_count()} processes: derive it from one seed shared by all processes "
            "(e.g. d3p.random.PRNGKey(seed)), never from per-process entropy (PRNGKey() without a seed)."
        )
