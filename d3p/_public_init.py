"""Initialisation of :class:`d3p.svi.DPSVI` from public information only.

:meth:`DPSVI.init` and :meth:`DPSVI.run` run the model and guide once to find
the parameters. Doing so on private records would let a record choose the
starting point, or make initialisation fail (NumPyro's autoguides search for
initial values at which the model's log density is finite, evaluating every
observed record's likelihood outside any clipping), and an autoguide would
keep those records in its prototype trace. Here the records are replaced by
public placeholders: ones with the batch's shapes and dtypes, with the
likelihood of the observed sites left out of that search (their values are
placeholders, so it would say nothing about the model), or records the
caller declares public (``init_data``).
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.handlers import replay, seed, substitute, trace
from numpyro.infer.autoguide import AutoGuide, AutoGuideList
from numpyro.primitives import Messenger

from d3p._records import _depends_on_inputs, _records


def _record_shapes(leaves) -> list:
    """Per leaf, the shape of one record and the dtype (public facts)."""
    return [(tuple(np.shape(x)[1:]), jnp.result_type(x)) for x in leaves]


def public_records(init_data, leaves, treedef, size: int):
    """``(public leaves, rows)``: the records :meth:`DPSVI.init` runs model and
    guide on, for a batch whose per-record leaves are ``leaves`` (structure
    ``treedef``, ``size`` rows).

    Without ``init_data``: ones of every leaf's shape and dtype (read from the
    leaves' shapes only, so traced leaves work too): inside the support of
    most likelihoods, and a valid weight, log argument, divisor and index.
    With ``init_data`` (records declared public): those, validated to have
    the batch's structure and per-record shapes, converted to its dtypes.
    """
    if init_data is None:
        return [jax.device_put(np.ones(np.shape(x), jnp.result_type(x))) for x in leaves], size   # compiles nothing
    args, kwargs = _split_init_data(init_data, treedef)
    public, public_def, rows = _records(args, kwargs, what="init_data")
    if public_def != treedef:
        raise ValueError(
            "Expected init_data to have the structure of the data (the positional arrays as a "
            f"tuple, or (args, kwargs) when the data has keyword arrays): the data is {treedef}, "
            f"init_data is {public_def}."
        )
    expected = _record_shapes(leaves)
    got = _record_shapes(public)
    for (want_shape, dtype), (shape, _) in zip(expected, got):
        if want_shape != shape:
            raise ValueError(
                f"Expected init_data's records to have the data's per-record shapes "
                f"{[s for s, _ in expected]}, got {[s for s, _ in got]}."
            )
    return [jnp.asarray(x, dtype) for x, (_, dtype) in zip(public, expected)], rows


def _split_init_data(init_data, treedef):
    """``init_data`` as ``(args, kwargs)``."""
    if not isinstance(init_data, (tuple, list)):
        raise TypeError(
            "Expected init_data to be a tuple of the positional data arrays (or (args, kwargs) "
            f"when the data has keyword arrays), got an object of type {type(init_data).__name__}."
        )
    _, data_kwargs = jax.tree.unflatten(treedef, [0] * treedef.num_leaves)
    if data_kwargs:
        if len(init_data) != 2 or not isinstance(init_data[1], dict):
            raise ValueError(
                f"Expected init_data to be a pair (args, kwargs) since the data has keyword arrays "
                f"{sorted(data_kwargs)}, got a sequence of {len(init_data)} items."
            )
        return tuple(init_data[0]), dict(init_data[1])
    return tuple(init_data), {}


class _LikelihoodLeftOut(Messenger):
    """Observed sites contribute nothing to the log density (their
    distribution is masked), so that a search for valid initial values
    depends on the latent sites only."""

    def process_message(self, msg):
        if msg["type"] == "sample" and msg.get("is_observed"):
            msg["fn"] = msg["fn"].mask(False)


class BatchSubsample(Messenger):
    """While :meth:`DPSVI.init` runs the model and guide on its batch, a
    subsampling plate's indices are those of the batch, ``0 .. B-1``.

    NumPyro would draw a random subsample of the plate's ``N`` (a scan over
    the subsample on a vector of ``N`` indices, compiled anew for every ``N``
    at an eager call: about a third of a second on a 2-core CPU), which DP-VI
    never uses: the batch is the data given. The site's random key is still
    drawn, so the keys of the other sites are unchanged.
    """

    def process_message(self, msg):
        if msg["type"] == "plate" and msg["value"] is None:
            msg["fn"] = _batch_indices


def _batch_indices(size, subsample_size, rng_key=None):
    # from the host: nothing to compile
    return jax.device_put(np.arange(subsample_size, dtype=jax.dtypes.canonicalize_dtype(np.int64)))


class _PublicSetupModel:
    """``model`` as a NumPyro autoguide runs it to set itself up inside
    :func:`public_guide_setup`: under :class:`BatchSubsample` (the autoguide
    runs it under ``handlers.block``, which hides its sites from the
    messengers that :meth:`DPSVI.init` holds around the guide) and, with
    ``ignore_likelihood``, :class:`_LikelihoodLeftOut`. A class, so that a
    guide that keeps a reference to it can still be pickled."""

    def __init__(self, model, ignore_likelihood: bool):
        self.model = model
        self.ignore_likelihood = ignore_likelihood

    def __call__(self, *args, **kwargs):
        with BatchSubsample(), (_LikelihoodLeftOut() if self.ignore_likelihood else contextlib.nullcontext()):
            return self.model(*args, **kwargs)


def _autoguides(guide):
    """``guide`` and, for an :class:`AutoGuideList`, its parts (recursively),
    those that are NumPyro autoguides."""
    if not isinstance(guide, AutoGuide):
        return []
    found = [guide]
    if isinstance(guide, AutoGuideList):
        for part in guide._guides:
            found.extend(_autoguides(part))
    return found


@contextlib.contextmanager
def public_guide_setup(guide, *, ignore_likelihood: bool):
    """While active, NumPyro autoguides among ``guide`` set themselves up anew
    on the next call (their prototype trace, which holds the records they were
    set up on, is dropped), on the batch's own plate indices, and with
    ``ignore_likelihood`` their search for initial values leaves out the
    observed sites (see :class:`_PublicSetupModel`). Their models are
    restored on exit."""
    guides = _autoguides(guide)
    models = [g.model for g in guides]
    for g in guides:
        g.prototype_trace = None
        g.model = _PublicSetupModel(g.model, ignore_likelihood)
    try:
        yield
    finally:
        for g, model in zip(guides, models):
            g.model = model


def placeholder_dependent_params(model, guide, treedef, leaves, static_kwargs, init_params) -> dict:
    """``{"guide": names, "model": names}``: the param sites whose initial value
    may depend on the values of the records ``leaves`` (structure ``treedef``)
    that model and guide are initialised on, as :meth:`numpyro.infer.SVI.init`
    finds them (guide first, then the model replayed against it; sites in
    ``init_params`` are given, not computed).

    Found from one abstract trace of shapes and dtypes (``jax.make_jaxpr``, no
    compilation, no value read) and :func:`d3p._records._depends_on_inputs`,
    which may report a dependence that cancels out but never misses one. A
    NumPyro autoguide is not traced (its setup searches for initial values at
    a cost; its parameters come from the model's latent sites): ``{}``.
    Errors of the model or guide propagate.
    """
    if _autoguides(guide):
        return {}
    init_params = dict(init_params or {})
    structs = [jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)) for x in leaves]
    names = {}

    def initial_params(leaves):
        args, kwargs = jax.tree.unflatten(treedef, leaves)
        model_key, guide_key = jax.random.split(jax.random.PRNGKey(0))
        guide_trace = trace(substitute(seed(guide, guide_key), init_params)).get_trace(
            *args, **kwargs, **static_kwargs)
        guide_params = {n: site["value"] for n, site in guide_trace.items()
                        if site["type"] == "param" and n not in init_params}
        model_trace = trace(substitute(replay(seed(model, model_key), guide_trace), data={
            **guide_params, **init_params})).get_trace(*args, **kwargs, **static_kwargs)
        model_params = {n: site["value"] for n, site in model_trace.items()
                        if site["type"] == "param" and n not in guide_params and n not in init_params}
        names["guide"], names["model"] = list(guide_params), list(model_params)
        return [jnp.asarray(v) for v in guide_params.values()], [jnp.asarray(v) for v in model_params.values()]

    closed = jax.make_jaxpr(initial_params)(structs)
    dependent = iter(_depends_on_inputs(closed.jaxpr))
    found = {role: [n for n in names[role] if next(dependent)] for role in ("guide", "model")}
    return {role: found_names for role, found_names in found.items() if found_names}
