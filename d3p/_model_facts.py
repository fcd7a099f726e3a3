# SPDX-License-Identifier: Apache-2.0
"""What :class:`d3p.svi.DPSVI` knows about a model, from public facts only.

The plate over the records and its declared size ``N``, the observation scale
of one record (the public constant by which each record's loss is divided
before clipping), the split of the ELBO's sites (``formulation``), and the
checks that refuse what DP-VI cannot make private (mutable state, no observed
site, a scale that depends on data), with the errors that explain a model's
mistakes. All of it is found from abstract traces of shapes and dtypes, never
from a record's values. The functions take the :class:`~d3p.svi.DPSVI` whose
model they read and keep what they find in its caches.
"""

import contextlib
import math
import warnings
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.handlers import seed, substitute, trace
from numpyro.primitives import Messenger

from d3p import _elbo_terms, _validate
from d3p._gradient_lists import _common_scale
from d3p._records import _depends_on_inputs, _evaluate_constant_outputs


class RecordsPlateError(ValueError):
    """A model whose records DP-VI cannot make private as declared: mutable
    state, no observed site, an observed site outside a subsampling plate, a
    records plate that does not subsample the batch, a ``numpyro.subsample``."""


def _subsampling_plates(tr, observed) -> dict:
    """The plates of the trace ``tr`` that subsample (declared size other than
    the subsample size) and hold one of the ``observed`` sites: name -> the
    declared size, a public constant of the model."""
    found = {}
    for site in observed:
        for frame in site["cond_indep_stack"]:
            plate = tr.get(frame.name)
            if plate is None or plate["type"] != "plate":
                continue
            size, subsample_size = plate["args"]
            if subsample_size is not None and subsample_size != size and isinstance(size, (int, np.integer)):
                found[frame.name] = int(size)
    return found


def one_record(leaves) -> tuple:
    """The abstract shape and dtype of one record of the per-record ``leaves``."""
    return tuple(jax.ShapeDtypeStruct(np.shape(x)[1:], jax.dtypes.canonicalize_dtype(x.dtype)) for x in leaves)


def _param_structs(params):
    return jax.tree.map(lambda p: jax.ShapeDtypeStruct(jnp.shape(p), jnp.result_type(p)), params)


# ------------------------------------------------- the records and their scale


def observation_scale(svi, params, treedef, leaves) -> Optional[float]:
    """The public observation scale of one record, a Python float: the
    likelihood scale of the model on a batch of one record (the plate's
    ``N / 1``, times any constant ``numpyro.handlers.scale``); ``None``
    with ``clip_unscaled_observations=False``, which divides by nothing.

    Found from the abstract shape of one record (each leaf's ``shape[1:]``
    and dtype), never from data values, so an empty batch has it too; found
    once per record structure and parameter shapes, then reused.

    Raises ``ValueError`` for a model DP-VI cannot make private (mutable
    state, no observed site, an observed site outside a subsampling plate)
    and, with ``clip_unscaled_observations=True``, for a scale that may
    depend on the record, the parameters or the random key (it is released
    without noise, as the normalisation), that differs between observed
    sites, or that is not finite and positive.
    """
    return model_facts(svi, params, treedef, leaves)[0]


def records_plates(svi, params, treedef, leaves) -> dict:
    """The subsampling plates of the model's observed sites, name -> the
    declared size (``N``), for records shaped like ``leaves``: public,
    from the same trace of shapes as :func:`observation_scale`."""
    return model_facts(svi, params, treedef, leaves)[1]


def model_facts(svi, params, treedef, leaves) -> tuple:
    """``(observation scale, subsampling plates)``: see :func:`observation_scale`
    and :func:`records_plates`; found once per record structure and
    parameter shapes (kept in ``svi._public_scales``)."""
    record = one_record(leaves)
    param_structs = _param_structs(params)
    key = (
        treedef,
        record,
        jax.tree.structure(param_structs),
        tuple(jax.tree.leaves(param_structs)),
        svi.clip_unscaled_observations,
    )
    if key not in svi._public_scales:
        plates = {}
        scale = _find_observation_scale(svi, param_structs, treedef, record, plates)
        svi._public_scales[key] = (scale, plates)
    return svi._public_scales[key]


def _observed_sites(tr) -> list:
    """The observed sample sites of the model's trace ``tr``, or a
    ``ValueError`` for a model DP-VI cannot make private (mutable state, no
    observed site, an observed site outside a subsampling plate)."""
    for site in tr.values():
        if site["type"] == "mutable":
            raise RecordsPlateError(
                f"The model has mutable state (site {site['name']!r}). DP-VI cannot "
                "support it: mutable state is updated from the un-noised data and "
                "would leak it without any privacy guarantee."
            )
    observed = [s for s in tr.values() if s["type"] == "sample" and s["is_observed"]]
    if not observed:
        raise RecordsPlateError(
            "The model has no observed sample sites. DP-VI needs the data to enter the "
            "model through observed sites under a plate over the records."
        )
    unscaled = [s for s in observed if s["scale"] is None]
    if unscaled:
        raise RecordsPlateError(_unscaled_message(tr, unscaled))
    return observed


def _unscaled_message(tr, unscaled) -> str:
    """Why the observed sites ``unscaled`` have no likelihood scale: in a plate
    that declares no ``subsample_size`` (named), or in no plate at all."""
    names = [s["name"] for s in unscaled]
    plates = sorted({f.name for s in unscaled for f in s["cond_indep_stack"]
                     if tr.get(f.name, {}).get("type") == "plate"})
    fix = ("so the model must declare its records with e.g. `with numpyro.plate('data', N, "
           "subsample_size=xs.shape[0]):` (N: the number of records in the whole data set, a constant; "
           "xs: the batch the model is given), so that a batch's likelihood is scaled by N / batch size.")
    if plates:
        sized = [name for name in plates if tr[name]["args"][1] is not None]
        what = (f"declare as their size the length of the batch they are given (1 on a batch of one "
                f"record: {sized}), not N" if sized else "declare no subsample_size")
        return (f"The observed site(s) {names} are not under a subsampling plate: the plate(s) {plates} over "
                f"them {what}. DP-VI clips each record's contribution and rescales the sum to the full data "
                f"set, {fix}")
    return (f"The observed site(s) {names} are not under a subsampling plate (in no plate at all). DP-VI "
            f"clips each record's contribution and rescales the sum to the full data set, {fix}")


class _SubsampleCalls(Messenger):
    """Counts the ``numpyro.subsample`` statements of a model run under it,
    and gives a plate that subsamples more indices than its size (a constant
    ``subsample_size`` on a batch of one record) all of its indices, as
    NumPyro's shuffle does on CPU, so that the checks below name the cause
    on every backend: elsewhere NumPyro draws subsample indices with
    ``jax.random.choice``, which raises for such a plate first."""

    def __init__(self):
        self.count = 0
        super().__init__()

    def process_message(self, msg):
        if msg["type"] == "subsample":
            self.count += 1
        elif msg["type"] == "plate" and msg["value"] is None:
            size, subsample_size = msg["args"]
            if isinstance(size, int) and isinstance(subsample_size, int) and subsample_size > size >= 1:
                msg["value"] = jnp.arange(size)


def _check_records_follow_batch(tr, plates: dict) -> None:
    """Raise unless each subsampling plate ``plates`` of the model's trace ``tr``
    on ONE record subsamples exactly that record (``subsample_size`` follows
    the batch the model is given, e.g. ``subsample_size=xs.shape[0]``)."""
    fixed = {name: tr[name]["args"][1] for name in plates if tr[name]["args"][1] != 1}
    if fixed:
        raise RecordsPlateError(
            f"Expected the records plate(s) {sorted(fixed)} to subsample the batch the model is given "
            f"(subsample_size=xs.shape[0]), got subsample_size {fixed} on a batch of one record. DPSVI "
            "draws the batches itself and gives the model one (each record alone, for its clipped "
            "gradient): declare numpyro.plate('data', N, subsample_size=xs.shape[0]) with N the number "
            "of records in the whole data set."
        )


_LEFTOVER_SUBSAMPLE = (
    "The model calls numpyro.subsample, which selects a minibatch from full data inside the model. DPSVI "
    "draws the batches itself (with the sampler its privacy accounting assumes) and gives the model a batch, "
    "one record at a time for its clipped gradient: remove the numpyro.subsample call and use the data "
    "given as the batch, under numpyro.plate('data', N, subsample_size=xs.shape[0])."
)


def _records_structure(model, args, kwargs) -> tuple:
    """``(observed sites, subsampling plates)`` of ``model`` run on a batch of
    one record ``(args, kwargs)``, or a :class:`RecordsPlateError` that names
    what DP-VI cannot make private in the way it declares its records."""
    calls = _SubsampleCalls()
    with calls:
        tr = trace(model).get_trace(*args, **kwargs)
    if calls.count:
        raise RecordsPlateError(_LEFTOVER_SUBSAMPLE)
    observed = _observed_sites(tr)
    found = _subsampling_plates(tr, observed)
    _check_records_follow_batch(tr, found)
    return observed, found


def structure_error(svi, treedef, leaves) -> Optional["RecordsPlateError"]:
    """The :class:`RecordsPlateError` of the model's records structure for
    records shaped like ``leaves``, or None: from an abstract trace of one
    record (shapes only), the model's parameters at their own initial
    values. Used to name the real cause where initialisation failed; any
    other error of the model gives None (the caller reports its own)."""
    def run(rng_key, leaves):
        args, kwargs = jax.tree.unflatten(treedef, [jnp.expand_dims(x, 0) for x in leaves])
        _records_structure(seed(svi.model, rng_key), args, {**kwargs, **svi.static_kwargs})
        return jnp.zeros(())

    try:
        jax.eval_shape(run, jax.eval_shape(jax.random.PRNGKey, 0), list(one_record(leaves)))
    except RecordsPlateError as err:
        return err
    except Exception:   # noqa: BLE001 - a diagnosis only; the caller raises its own error
        return None
    return None


def _find_observation_scale(svi, param_structs, treedef, record, plates) -> Optional[float]:
    """See :func:`observation_scale`: traces ``(params, key, record) ->
    scales of the observed sites`` and checks that they depend on none of
    the three before evaluating them. Fills ``plates`` with the
    subsampling plates of the observed sites (see :func:`_subsampling_plates`)."""
    observed_names = []

    def observation_scales(params, rng_key, leaves):
        args, kwargs = jax.tree.unflatten(treedef, [jnp.expand_dims(x, 0) for x in leaves])
        model = seed(substitute(svi.model, data=svi.constrain_fn(params)), rng_key)
        observed, found = _records_structure(model, args, {**kwargs, **svi.static_kwargs})
        observed_names[:] = [s["name"] for s in observed]
        plates.update(found)
        return [jnp.asarray(s["scale"]) for s in observed]

    abstract_key = jax.eval_shape(jax.random.PRNGKey, 0)
    closed = jax.make_jaxpr(observation_scales)(param_structs, abstract_key, list(record))
    if not svi.clip_unscaled_observations:
        return None
    return _public_scale(closed, observed_names)


def _public_scale(closed, observed_names) -> float:
    """The one value of the observation scales that the closed jaxpr
    ``closed`` computes, checked to depend on none of its inputs, to be a
    constant, the same for every observed site, finite and positive."""
    dependent = [n for n, d in zip(observed_names, _depends_on_inputs(closed.jaxpr)) if d]
    if dependent:
        raise ValueError(
            f"The likelihood scale of the observed site(s) {dependent} depends on the "
            "record's data (or on the parameters or the random key). DP-VI releases the "
            "normalisation of its noisy sum without noise, so the scale must be a public "
            "constant: the plate's size N over its subsample size, times constants. "
            "Weights per record (e.g. numpyro.handlers.scale with a weight from the data) "
            "are not supported, because the normalisation would reveal them."
        )
    values = _evaluate_constant_outputs(closed)
    if any(isinstance(v, jax.core.Tracer) for v in values):
        raise ValueError(
            f"The likelihood scale of the observed site(s) {observed_names} is a value "
            "traced by an enclosing JAX transformation, not a constant. DP-VI needs it "
            "as a public constant: pass N as a Python number (DPSVI(..., N=N))."
        )
    scale = _common_scale(observed_names, values)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(
            f"Expected the likelihood scale of the observed site(s) {observed_names} to be "
            f"finite and > 0, got {scale}."
        )
    return scale


def check_records_plate(svi, svi_state, treedef, records, num_records: int) -> None:
    """Raise unless the model's subsampling plate over the records declares
    ``N = num_records``, the rows given to :meth:`DPSVI.run` (both public; a
    model with several subsampling plates of different sizes is not checked)."""
    params = svi.optim.get_params(svi_state.optim_state)
    args, kwargs = jax.tree.unflatten(treedef, records)
    with model_errors_explained(svi, args, kwargs):
        plates = records_plates(svi, params, treedef, records)
    if len(set(plates.values())) == 1:
        name, size = next(iter(plates.items()))
        _validate.records_plate_size(name, size, num_records, svi.static_kwargs)


# ---------------------------------------------------- the split of the ELBO


def split_facts(svi, params, treedef, leaves, sharded: bool = False) -> tuple:
    """``(formulation, SplitFacts or None)``: ``formulation`` resolved for
    records shaped like ``leaves`` (public: from an abstract trace of one
    record, found once per record structure and parameter shapes).

    ``"auto"`` is ``"aligned"`` for NumPyro's ``Trace_ELBO`` and
    ``TraceMeanField_ELBO`` where the guide draws every global latent
    variable reparameterised and the step is not ``sharded`` over a mesh
    (``"own_sample"`` otherwise: ``"aligned"``'s draw cannot be closed over
    in ``shard_map`` on explicit axes), else
    ``"per_record"``; and ``"per_record"``, with a warning, where a term
    outside the records plate may read the record, which an explicit split
    formulation refuses."""
    record = one_record(leaves)
    param_structs = _param_structs(params)
    key = (treedef, record, jax.tree.structure(param_structs), tuple(jax.tree.leaves(param_structs)), sharded)
    if key in svi._split_facts_cache:
        return svi._split_facts_cache[key]
    formulation = svi.formulation
    if formulation == "auto":
        formulation = "own_sample" if _elbo_terms.splittable(svi.loss) else "per_record"
    facts = None
    if formulation != "per_record":
        plates = records_plates(svi, params, treedef, leaves)
        facts = _elbo_terms.split_facts(svi.loss, svi.model, svi.guide, svi.constrain_fn,
                                        svi.static_kwargs, param_structs, treedef, record, plates)
        if svi.formulation == "auto" and facts.reparameterized and not sharded:
            formulation = "aligned"
        if facts.dependent:
            message = (
                f"The terms of the site(s) {list(facts.dependent)}, outside the plate over the records "
                f"({sorted(plates)}), may depend on a record's values, so they cannot be evaluated once per "
                "step outside the clipped sum")
            if svi.formulation != "auto":
                raise ValueError(f"{message}: expected formulation='per_record' for this model, got "
                                 f"formulation={svi.formulation!r}.")
            # stacklevel: the caller of DPSVI.update (update, step, noisy_gradient, shared_sites or step_losses, here)
            warnings.warn(f"{message}; DPSVI clips each record's whole ELBO (formulation='per_record').",
                          UserWarning, stacklevel=6)
            formulation, facts = "per_record", None
    svi._split_facts_cache[key] = (formulation, facts)
    return formulation, facts


# ------------------------------------------------------------------ errors


@contextlib.contextmanager
def model_errors_explained(svi, args, kwargs):
    """While active, a ``TypeError`` raised by running the model or guide on
    the data ``(args, kwargs)`` that is a known mistake (arguments they do
    not accept, data values used in Python or NumPy code) is raised again
    as a :class:`d3p._validate.ModelCodeError` that says what to change,
    with the original as its ``__cause__``. Reads the signatures and the
    number and names of the arguments only."""
    try:
        yield
    except TypeError as err:
        explained = _validate.model_call_error(err, svi.model, svi.guide, len(args), kwargs, svi.static_kwargs)
        if explained is None:
            raise
        raise explained from err
