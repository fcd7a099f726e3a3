"""Per-record gradients, clipping and the noisy sum: the privacy-critical math.

Everything here is a pure JAX function of explicit inputs. :class:`d3p.svi.DPSVI`
wires them together; they can also be used on their own to build other
DP-SGD style algorithms.

Glossary: clipping threshold ``C``, noise multiplier ``sigma`` (``dp_scale``),
batch size ``B`` (the number of record slots, real or padded).
"""

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.flatten_util import ravel_pytree

import d3p.random

__all__ = [
    "ClippedSum",
    "total_norm",
    "clip_gradient",
    "per_record_value_and_grad",
    "clipped_grad_sum",
    "noise_std",
    "add_gaussian_noise",
    "STRATEGIES",
]

PyTree = Any

#: Names of the per-record gradient strategies; all compute the same clipped sum.
STRATEGIES = ("vmap", "chunked")


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


def _batch_size(records: PyTree) -> int:
    leaves = jax.tree.leaves(records)
    if not leaves:
        raise ValueError("Expected at least one per-record array in records.")
    return int(jnp.shape(leaves[0])[0])


def _clipped_chunk(loss_fn, params, records, mask, clipping_threshold, forward_mode):
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


def clipped_grad_sum(
    loss_fn: Callable,
    params: PyTree,
    records: PyTree,
    mask: Optional[jax.Array],
    clipping_threshold: float,
    *,
    strategy: str = "vmap",
    chunk_size: Optional[int] = None,
    forward_mode: bool = False,
) -> ClippedSum:
    """Sum over records of per-record gradients, each clipped to norm ``C``.

    :param loss_fn: ``loss_fn(params, record) -> scalar``, the loss of one
        record; ``record`` is one slice of ``records`` along axis 0.
    :param params: the parameters to differentiate.
    :param records: pytree of per-record inputs, every leaf with leading
        dimension ``B`` (include per-record random keys here).
    :param mask: boolean ``(B,)``, True for real records, or None (all real).
    :param float clipping_threshold: ``C``.
    :param str strategy: ``"vmap"`` (all records at once) or ``"chunked"``
        (records in chunks of ``chunk_size`` under ``lax.scan``, bounding the
        memory of per-record gradients to ``chunk_size`` copies of the
        parameters). Both compute the same sum.
    :param int chunk_size: records per chunk for ``"chunked"``.
    :param bool forward_mode: forward-mode differentiation.
    :return: :class:`ClippedSum`.

    **Formal guarantees.** The gradient of every record is clipped as one
    vector over all parameter leaves (:func:`clip_gradient`), so for any two
    record sets that differ by adding or removing one record (or by masking
    it out) the sum moves by at most ``C`` in L2 norm, and for two that
    differ by substituting one record it moves by at most ``2 C``. Padded
    records (``mask`` False) and records with non-finite gradients contribute
    exactly zero; their values, even ``nan``, never reach the sum. An all-padded
    batch gives an exact zero sum. ``losses`` and ``norms`` are computed from
    the un-noised data and are NOT private.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"Expected strategy in {STRATEGIES}, got strategy={strategy!r}.")
    B = _batch_size(records)
    mask = jnp.ones((B,), bool) if mask is None else jnp.asarray(mask, bool)
    if mask.shape != (B,):
        raise ValueError(f"Expected mask of shape ({B},), got shape {mask.shape}.")
    if strategy == "vmap" or B == 0:
        return ClippedSum(*_clipped_chunk(loss_fn, params, records, mask, clipping_threshold, forward_mode))

    chunk = B if chunk_size is None else int(chunk_size)
    if chunk < 1:
        raise ValueError(f"Expected chunk_size >= 1, got chunk_size={chunk_size}.")
    chunk = min(chunk, B)
    num_chunks = -(-B // chunk)
    pad = num_chunks * chunk - B

    def pad_and_split(x):
        x = jnp.concatenate([x, jnp.zeros((pad,) + x.shape[1:], x.dtype)]) if pad else x
        return x.reshape((num_chunks, chunk) + x.shape[1:])

    chunked_records = jax.tree.map(pad_and_split, records)
    chunked_mask = pad_and_split(mask)  # padding is False
    zero = jax.tree.map(jnp.zeros_like, params)

    def body(acc, xs):
        recs, m = xs
        s, losses, norms = _clipped_chunk(loss_fn, params, recs, m, clipping_threshold, forward_mode)
        return jax.tree.map(jnp.add, acc, s), (losses, norms)

    total, (losses, norms) = lax.scan(body, zero, (chunked_records, chunked_mask))
    return ClippedSum(total, losses.reshape(-1)[:B], norms.reshape(-1)[:B])


def noise_std(dp_scale: float, clipping_threshold: float) -> float:
    """Standard deviation of the Gaussian noise per coordinate: ``dp_scale * C``.

    ``dp_scale = 0`` gives 0 even for ``C = inf`` (the non-private setting).
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
    flat, unravel = ravel_pytree(grad_sum)
    std = noise_std(dp_scale, clipping_threshold)
    if std == 0.0:
        return grad_sum
    noise = rng_suite.normal(noise_key, flat.shape, flat.dtype if flat.dtype != jnp.float16 else jnp.float32)
    return unravel(flat + noise.astype(flat.dtype) * np.asarray(std, flat.dtype))
