"""d3p 0.2's helpers on lists of gradient parts (or any pytree) and the
observation scale of a model; public as ``d3p.svi.full_norm``,
``clip_gradient``, ``normalize_gradient`` and ``get_observations_scale``."""

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.handlers import seed, substitute, trace

from d3p import _validate, gradients


def _float_leaves(tree) -> list:
    """The leaves of ``tree`` as arrays, integers converted to the default float dtype."""
    leaves = [jnp.asarray(x) for x in jax.tree.leaves(tree)]
    return [x if jnp.issubdtype(x.dtype, jnp.inexact) else x.astype(jnp.result_type(float)) for x in leaves]


def _public_number(check, name, value, **kwargs):
    """``check(name, value)`` from :mod:`d3p._validate` for a concrete value;
    a value traced by a JAX transformation passes through unchecked."""
    if isinstance(value, jax.core.Tracer):
        return value
    return check(name, value, **kwargs)


def full_norm(list_of_parts_or_tree, ord=2) -> jax.Array:
    """The norm of all parts (or pytree leaves) flattened into one vector.

    ``ord=2`` uses :func:`d3p.gradients.total_norm`, the norm DP-VI clips
    with: an upper bound within a few units of roundoff of the exact L2 norm,
    ``inf`` if any entry is not finite. Other ``ord`` are as in
    :func:`jax.numpy.linalg.norm` of the flattened vector.

    :param list_of_parts_or_tree: a list or tuple of arrays, or any pytree;
        ``None`` or an empty list has norm 0.
    :param ord: the order of the norm.
    :return: a 0-d array.

    >>> import jax.numpy as jnp
    >>> round(float(full_norm([jnp.array([3.0]), jnp.array([[4.0]])])), 5)
    5.0
    >>> float(full_norm([jnp.array([3.0, -4.0])], ord=1)), float(full_norm([]))
    (7.0, 0.0)
    """
    leaves = _float_leaves(list_of_parts_or_tree)
    if not leaves:
        return jnp.zeros(())
    if ord == 2:
        return gradients.total_norm(leaves)
    return jnp.linalg.norm(jnp.concatenate([jnp.ravel(x) for x in leaves]), ord)


def clip_gradient(list_of_gradient_parts, c, rescale_factor=1.0):
    """Clip a gradient given as a list of parts to total L2 norm at most ``c``.

    Every part is multiplied by the clip factor ``1 / max(1, norm / c)`` of
    :func:`d3p.gradients.clip_gradient` (the single implementation: ``norm``
    is an upper bound of the exact norm of all parts together, and the factor
    leaves room for rounding), then by ``rescale_factor``. ``c = inf`` means
    no clipping: the parts are returned as given (times ``rescale_factor``),
    as in d3p 0.2. (:class:`d3p.svi.DPSVI` refuses an infinite clipping
    threshold together with noise: its sensitivity would be unbounded.)

    **Formal guarantees.** For a finite ``c``, before the rescaling, the exact
    L2 norm of all returned parts together is at most ``c``; a gradient with a
    non-finite entry becomes zeros (see :func:`d3p.gradients.clip_gradient`).
    ``c = inf`` bounds nothing.

    :param list_of_gradient_parts: a list or tuple of arrays, or any pytree.
    :param float c: the clipping threshold, ``> 0`` (``inf``: no clipping).
    :param rescale_factor: a factor applied after clipping.
    :return: the clipped parts, in the same container type as given.
    :raises ValueError: if ``c`` is not a number ``> 0`` (``nan``, ``0`` and
        negative thresholds are refused).

    >>> import jax.numpy as jnp
    >>> parts = [jnp.array([3.0]), jnp.array([4.0])]
    >>> [[round(v, 5) for v in p.tolist()] for p in clip_gradient(parts, 1.0)]
    [[0.6], [0.8]]
    >>> [p.tolist() for p in clip_gradient(parts, float("inf"))]
    [[3.0], [4.0]]
    """
    c = _public_number(_validate.positive, "c", c, finite=False)
    if not jax.tree.leaves(list_of_gradient_parts):
        return list_of_gradient_parts

    def rescale(tree):
        return jax.tree.map(lambda g: g * jnp.asarray(rescale_factor, jnp.result_type(g)), tree)

    if not isinstance(c, jax.core.Tracer):
        if c == float("inf"):
            return rescale(jax.tree.map(jnp.asarray, list_of_gradient_parts))
        clipped, _ = gradients.clip_gradient(list_of_gradient_parts, c)
        return rescale(clipped)
    # a threshold traced by an enclosing transformation: inf still means no clipping
    clipped, _ = gradients.clip_gradient(list_of_gradient_parts, c)
    unclipped = jax.tree.map(jnp.asarray, list_of_gradient_parts)
    return rescale(jax.tree.map(lambda g, k: jnp.where(jnp.isposinf(c), g, k), unclipped, clipped))


def normalize_gradient(list_of_gradient_parts, ord=2):
    """Each part divided by :func:`full_norm` of all parts together.

    A gradient of norm 0 gives ``nan`` (0 / 0), as any normalisation of it.

    :param list_of_gradient_parts: a list or tuple of arrays (or of pytrees),
        or any pytree.
    :param ord: the order of the norm.
    :return: a list for a list or tuple of parts; otherwise a pytree of the
        same structure.

    >>> import jax.numpy as jnp
    >>> [round(float(p[0]), 4) for p in normalize_gradient((jnp.array([3.0]), jnp.array([-4.0])), ord=1)]
    [0.4286, -0.5714]
    """
    norm = full_norm(list_of_gradient_parts, ord)

    def divide(tree):
        return jax.tree.map(lambda g: g / norm.astype(jnp.result_type(g, float)), tree)

    if isinstance(list_of_gradient_parts, (list, tuple)):
        return [divide(part) for part in list_of_gradient_parts]
    return divide(list_of_gradient_parts)


def _common_scale(names, values) -> float:
    """The one scalar scale shared by the observed sites ``names`` (concrete
    ``values``), as a float; ``ValueError`` if they differ or are not scalars."""
    values = [np.asarray(v) for v in values]
    if any(v.shape != () for v in values) or any(not np.allclose(v, values[0]) for v in values):
        raise ValueError(
            f"The observed sites {names} have different or non-scalar scales "
            f"{[v.tolist() for v in values]}. DP-VI needs all observations of a record "
            "under one plate over the records."
        )
    return float(values[0])


def get_observations_scale(model, model_args, model_kwargs, params) -> Optional[float]:
    """The likelihood scale of the observed sample sites of ``model``.

    The model is traced on ``model_args`` and ``model_kwargs`` with ``params``
    (values of its sites by name) substituted and a fixed seed for the other
    latent sites. For a batch of ``B`` records under
    ``numpyro.plate(name, N, subsample_size=B)`` the scale is ``N / B``, times
    any ``numpyro.handlers.scale`` factor.

    :param model: a NumPyro model.
    :param tuple model_args: positional arguments of the model.
    :param dict model_kwargs: keyword arguments of the model.
    :param dict params: values substituted for sites of the model.
    :return: the scale as a float (or as traced by an enclosing JAX
        transformation); ``None`` if the model has no observed site or none
        has a scale.
    :raises ValueError: if the observed sites have different scales (or only
        some have one), or a scale is not a scalar.

    >>> import numpyro, numpyro.distributions as dist
    >>> import jax.numpy as jnp
    >>> def model(xs):
    ...     mu = numpyro.sample("mu", dist.Normal(0, 1))
    ...     with numpyro.plate("data", 100, subsample_size=xs.shape[0]):
    ...         numpyro.sample("x", dist.Normal(mu, 1), obs=xs)
    >>> get_observations_scale(model, (jnp.zeros(10),), {}, {"mu": 0.5})
    10.0
    """
    seeded = seed(substitute(model, data=params), rng_seed=0)
    tr = trace(seeded).get_trace(*model_args, **(model_kwargs or {}))
    observed = [s for s in tr.values() if s["type"] == "sample" and s["is_observed"]]
    names = [s["name"] for s in observed]
    scales = [s["scale"] for s in observed]
    if all(s is None for s in scales):
        return None
    if any(s is None for s in scales):
        raise ValueError(
            f"The observed sites {names} have different scales {scales}: only some are under a "
            "subsampling plate or numpyro.handlers.scale."
        )
    if any(isinstance(s, jax.core.Tracer) for s in scales):
        if all(s is scales[0] for s in scales):
            return scales[0]
        raise ValueError(f"The observed sites {names} have scales {scales} that cannot be compared.")
    return _common_scale(names, scales)


