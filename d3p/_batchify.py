"""The d3p 0.2 batchify interface: ``(init, get_batch)`` pairs over a data set.

:func:`subsample_batchify_data` (fixed-size batches), :func:`poisson_batchify_data`
(Poisson batches with a mask) and :func:`split_batchify_data` (non-private
shuffle-and-split), with the conversions :func:`q_to_batch_size` and
:func:`batch_size_to_q`, :class:`BatchifyState` and :func:`take_batch`. Each
pair draws its batches with a sampler of ``d3p._samplers`` and carries it as
``.sampler``. The public names are documented and imported from
:mod:`d3p.minibatch`.
"""

import math
import numbers
import types
from functools import partial
from typing import Any, Callable, NamedTuple, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

import d3p.random
from d3p import _inputs, _validate
from d3p.random._common import suite_key
from d3p._samplers import (
    FixedSizeSampler,
    PoissonSampler,
    WithReplacementSampler,
    _num_records,
    _sample,
    feistel_permutation,
)

Dataset = Union[jax.typing.ArrayLike, Sequence[jax.typing.ArrayLike]]


# ----------------------------------------------------------------------------
# validation at the boundary


def _suite_in_place_of(name: str, value, default, rng_suite):
    """``(value, rng_suite)`` of a call, with a PRNG suite passed positionally
    in the place of ``name`` taken as ``rng_suite`` (the position ``rng_suite``
    has in the signatures without ``name``) and ``name`` then its default."""
    if value is None or isinstance(value, (str, bytes, numbers.Number)):
        return value, rng_suite
    try:
        _validate.rng_suite(name, value)
    except ValueError:
        return value, rng_suite  # not a suite: the argument's own check names it
    if rng_suite is not d3p.random:
        raise ValueError(
            f"Expected one PRNG suite, got {name}={value!r} and rng_suite={rng_suite!r}."
        )
    return default, value


def _check_dataset(dataset: Dataset) -> Tuple[Tuple[jax.Array, ...], bool, int]:
    """Returns (arrays as a tuple, whether a single array was given, N)."""
    single = not isinstance(dataset, (tuple, list))
    arrays = (dataset,) if single else tuple(dataset)
    if len(arrays) == 0:
        raise ValueError("Expected dataset to hold at least one array, got an empty dataset=().")
    lengths = []
    for k, x in enumerate(arrays):
        shape = np.shape(x)
        if len(shape) == 0:
            raise ValueError(
                f"Expected every array of dataset to have a leading record axis, got a scalar at "
                f"dataset[{k}]."
            )
        lengths.append(shape[0])
    if any(n != lengths[0] for n in lengths):
        raise ValueError(
            f"Expected all arrays of dataset to have the same number of records (leading "
            f"dimension), got lengths {lengths}."
        )
    if lengths[0] == 0:
        raise ValueError("Expected a non-empty dataset, got N=0 records.")
    # converted by a rule that reads no value (d3p._inputs), copied to the
    # device; the user's arrays are never modified
    arrays = tuple(jnp.asarray(_inputs.as_records_array(x)) for x in arrays)
    return arrays, single, int(lengths[0])


# ----------------------------------------------------------------------------
# conversions between q and B


def q_to_batch_size(q: float, N: int) -> int:
    """The batch size for sampling probability ``q`` from ``N`` records.

    :param float q: sampling probability in (0, 1].
    :param int N: number of records.
    :return: ``floor(q * N)`` (up to floating point round-off), at least 1.

    Rounding down makes ``batch_size / N <= q`` whenever ``q * N >= 1``, so an
    ε computed with the given ``q`` is an upper bound for the resulting batch
    size; account with ``batch_size_to_q(batch_size, N)`` (the sampler's ``q``)
    to get the exact value.

    >>> q_to_batch_size(0.29, 100)
    29
    """
    q = _validate.probability("q", q)
    N = _num_records(N, "N")
    x = q * N
    nearest = round(x)
    b = nearest if abs(x - nearest) <= 1e-9 * max(1.0, x) else math.floor(x)
    return int(min(max(b, 1), N))


def batch_size_to_q(batch_size: int, N: int) -> float:
    """The sampling probability ``batch_size / N`` of a fixed-size batch.

    :param int batch_size: batch size B in [1, N].
    :param int N: number of records.

    >>> batch_size_to_q(10, 1000)
    0.01
    """
    N = _num_records(N, "N")
    batch_size = _validate.integer("batch_size", batch_size, minimum=1, maximum=N)
    return batch_size / N


# ----------------------------------------------------------------------------
# gathering and the (init, get_batch) interface


class BatchifyState(NamedTuple):
    """State of a batchify pair.

    :ivar rng_key: the key of the current epoch; batch i is drawn with
        ``rng_suite.fold_in(rng_key, i)``.
    """

    rng_key: Any


def take_batch(dataset: Dataset, indices: jax.typing.ArrayLike):
    """Gather the records at ``indices`` from every array of ``dataset``.

    :param dataset: an array, or a tuple/list of arrays with equal leading dimension.
    :param indices: int array of record indices (may be traced).
    :return: the gathered array for a single array, otherwise a tuple of gathered arrays.
    """
    if isinstance(dataset, (tuple, list)):
        return tuple(jnp.take(jnp.asarray(_inputs.as_records_array(x)), indices, axis=0) for x in dataset)
    return jnp.take(jnp.asarray(_inputs.as_records_array(dataset)), indices, axis=0)


def _make_batchify(arrays, single, sampler, rng_suite, num_batches, with_mask):
    def init(rng_key) -> Tuple[int, BatchifyState]:
        """Start an epoch: returns ``(num_batches, BatchifyState(rng_key))``; a JAX
        key is first turned into a key of ``rng_suite`` (:func:`d3p.random.as_key`)."""
        return num_batches, BatchifyState(suite_key(rng_suite, rng_key))

    def get_batch(i, state: BatchifyState):
        """The i-th batch (``i`` may be traced)."""
        indices, mask = _sample(sampler, state.rng_key, rng_suite, i)
        batch = take_batch(arrays[0] if single else arrays, indices)
        return (batch, mask) if with_mask else batch

    init.sampler = sampler
    get_batch.sampler = sampler
    return init, get_batch


def _fixed_batch_size(batch_size, q, num_records: int) -> int:
    """B from exactly one of ``batch_size`` and ``q`` (``q_to_batch_size(q, N)``)."""
    if (batch_size is None) == (q is None):
        raise ValueError(
            f"Expected exactly one of batch_size and q, got batch_size={batch_size!r}, q={q!r}."
        )
    if batch_size is None:
        batch_size = q_to_batch_size(q, num_records)
    return _validate.integer("batch_size", batch_size, minimum=1, maximum=num_records)


def subsample_batchify_data(
    dataset: Dataset,
    batch_size: Optional[int] = None,
    q: Optional[float] = None,
    with_replacement: bool = False,
    rng_suite: types.ModuleType = d3p.random,
    return_mask: bool = False,
) -> Tuple[Callable, Callable]:
    """Fixed-size random batches, each drawn independently (the d3p 0.2 interface).

    :param dataset: a tuple (or list) of arrays with equal leading dimension N,
        or a single array. Batches mirror it: a tuple of arrays for a
        tuple/list, a single array for a single array. The arrays are copied
        to the device once; the caller's arrays are never modified.
    :param int batch_size: B in ``[1, N]``; exactly one of ``batch_size`` and ``q``.
    :param float q: sampling probability; B = :func:`q_to_batch_size` ``(q, N)``.
    :param bool with_replacement: draw B independent uniform indices instead
        (see :class:`WithReplacementSampler`: not covered by d3p's accountants).
    :param rng_suite: PRNG suite for batch selection.
    :param bool return_mask: if True, ``get_batch`` returns ``(batch, mask)``
        with ``mask`` a bool array of shape ``(B,)``, all True (the batches
        are full), so that code written for :func:`poisson_batchify_data`
        runs unchanged.
    :return: ``(init, get_batch)``: ``init(rng_key) -> (num_batches, state)`` with
        ``num_batches = N // B`` (batches per epoch) and ``state`` a
        :class:`BatchifyState`; ``get_batch(i, state)`` returns batch ``i``,
        drawn with ``fold_in(state.rng_key, i)``; jittable, ``i`` may be
        traced. Both functions carry the sampler as attribute ``.sampler``
        (its ``relation``, ``q`` and ``expected_batch_size`` are what
        accounting and normalisation must use).

    **Formal guarantees.** Those of :class:`FixedSizeSampler` (uniform
    B-subsets, independent across i; :data:`SUBSTITUTE` relation), or of
    :class:`WithReplacementSampler` if ``with_replacement``.

    >>> import numpy as np, d3p.random
    >>> init, get_batch = subsample_batchify_data((np.arange(10.0), np.ones((10, 2))), batch_size=3)
    >>> num_batches, state = init(d3p.random.PRNGKey(0))
    >>> x, y = get_batch(0, state)
    >>> num_batches, x.shape, y.shape
    (3, (3,), (3, 2))
    """
    rng_suite = _validate.rng_suite("rng_suite", rng_suite)
    with_replacement = _validate.boolean("with_replacement", with_replacement)
    return_mask = _validate.boolean("return_mask", return_mask)
    arrays, single, n = _check_dataset(dataset)
    batch_size = _fixed_batch_size(batch_size, q, n)
    if with_replacement:
        sampler = WithReplacementSampler(n, batch_size)
    else:
        sampler = FixedSizeSampler(n, batch_size)
    return _make_batchify(arrays, single, sampler, rng_suite, n // batch_size, with_mask=return_mask)


def poisson_batchify_data(
    dataset: Dataset,
    q: float,
    max_batch_size: Optional[Union[int, float]] = None,
    handle_oversized_batch: str = "truncate",
    rng_suite: types.ModuleType = d3p.random,
) -> Tuple[Callable, Callable]:
    """Poisson-sampled batches of fixed shape with a mask.

    :param dataset: a tuple (or list) of arrays with equal leading dimension N,
        or a single array (batches mirror its structure).
    :param float q: sampling probability of every record, in (0, 1].
    :param max_batch_size: padded batch length: an integer in ``[1, N]``, or a
        float ``p`` in (0, 1) for one more than the ``p``-quantile of the batch
        size distribution (d3p 0.2's value: a batch is shorter with probability
        at least ``p``); default: overflow probability at most 1e-18 per step
        (see :class:`PoissonSampler`).
    :param str handle_oversized_batch: ``"truncate"`` (default) or
        ``"suppress"``: what a batch of more than ``max_batch_size`` records
        becomes (see :class:`PoissonSampler`).
    :param rng_suite: PRNG suite for batch selection. A PRNG suite passed as
        the fourth positional argument is taken as ``rng_suite`` (the
        signature without ``handle_oversized_batch``).
    :return: ``(init, get_batch)``: ``init(rng_key) -> (num_batches, state)``
        with ``num_batches = floor(1 / q)``; ``get_batch(i, state)`` returns
        ``(batch, mask)`` with ``mask`` bool of shape ``(max_batch_size,)``,
        True for real records. Both carry the :class:`PoissonSampler` as
        ``.sampler``; normalise by ``sampler.expected_batch_size = q N``.

    **Formal guarantees.** Those of :class:`PoissonSampler`, including the
    overflow term added to δ (the same for both settings of
    ``handle_oversized_batch``); :data:`ADD_REMOVE` relation.
    """
    handle_oversized_batch, rng_suite = _suite_in_place_of(
        "handle_oversized_batch", handle_oversized_batch, "truncate", rng_suite
    )
    rng_suite = _validate.rng_suite("rng_suite", rng_suite)
    arrays, single, n = _check_dataset(dataset)
    sampler = PoissonSampler(n, q, max_batch_size, handle_oversized_batch)
    num_batches = max(1, int(1.0 / sampler.q))
    return _make_batchify(arrays, single, sampler, rng_suite, num_batches, with_mask=True)


@partial(jax.jit, static_argnums=(2, 3, 4))
def _split_indices_jit(rng_key, i, num_records, batch_size, rng_suite):
    positions = jnp.asarray(i, jnp.int32) * batch_size + jnp.arange(batch_size, dtype=jnp.int32)
    return feistel_permutation(rng_key, positions, num_records, rng_suite=rng_suite)


def split_batchify_data(
    dataset: Dataset,
    batch_size: Optional[int] = None,
    q: Optional[float] = None,
    rng_suite: types.ModuleType = d3p.random,
    return_mask: bool = False,
) -> Tuple[Callable, Callable]:
    """Shuffle-and-split: disjoint batches that together cover an epoch. **Not private.**

    For non-private use (evaluation, or a non-private baseline): batches of an
    epoch are disjoint and therefore dependent, which no d3p accountant
    covers. Batch ``i`` holds the records at positions ``i*B .. (i+1)*B - 1``
    of a pseudo-random permutation (:func:`feistel_permutation`) keyed by
    ``state.rng_key``, computed in ``O(B)`` without materialising the
    permutation; call ``init`` with a new key for every epoch.

    :param dataset: a tuple (or list) of arrays, or a single array.
    :param int batch_size: B in ``[1, N]``; exactly one of ``batch_size`` and ``q``.
    :param float q: B = :func:`q_to_batch_size` ``(q, N)``.
    :param rng_suite: PRNG suite for the permutation. A PRNG suite passed as
        the third positional argument is taken as ``rng_suite`` (the
        signature without ``q``).
    :param bool return_mask: if True, ``get_batch`` returns ``(batch, mask)``
        with ``mask`` a bool array of shape ``(B,)``, all True.
    :return: ``(init, get_batch)`` as in :func:`subsample_batchify_data`;
        ``num_batches = N // B`` (the last ``N mod B`` positions are skipped).
        ``get_batch.sampler`` is None.
    """
    q, rng_suite = _suite_in_place_of("q", q, None, rng_suite)
    rng_suite = _validate.rng_suite("rng_suite", rng_suite)
    return_mask = _validate.boolean("return_mask", return_mask)
    arrays, single, n = _check_dataset(dataset)
    batch_size = _fixed_batch_size(batch_size, q, n)
    num_batches = n // batch_size

    def init(rng_key) -> Tuple[int, BatchifyState]:
        """Start an epoch: returns ``(num_batches, BatchifyState(rng_key))``; a JAX
        key is first turned into a key of ``rng_suite`` (:func:`d3p.random.as_key`)."""
        return num_batches, BatchifyState(suite_key(rng_suite, rng_key))

    def get_batch(i, state: BatchifyState):
        """The i-th batch of the epoch (``i`` may be traced)."""
        indices = _split_indices_jit(state.rng_key, i, n, batch_size, rng_suite)
        batch = take_batch(arrays[0] if single else arrays, indices)
        return (batch, jnp.ones((batch_size,), bool)) if return_mask else batch

    init.sampler = None
    get_batch.sampler = None
    return init, get_batch
