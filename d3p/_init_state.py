# SPDX-License-Identifier: Apache-2.0
"""The initial state of :class:`d3p.svi.DPSVI`, from public information only.

:meth:`DPSVI.init <d3p.svi.DPSVI.init>` and :meth:`DPSVI.run
<d3p.svi.DPSVI.run>` run the model and guide on public records (ones shaped
like a batch, or records the caller declares public), never on the data: the
initial parameters hold no private value (see :mod:`d3p._public_init`).
"""

import warnings

import jax
from numpyro.infer.svi import SVI

from d3p import _model_facts, _numpyro_compat, _private_step, _sharding, _validate
from d3p._public_init import BatchSubsample, placeholder_dependent_params, public_guide_setup, public_records
from d3p._records import _records
from d3p._state import DPSVIState, state_scale
from d3p.random._common import suite_key, unstacked


def _warn_if_placeholder_dependent(svi, public, treedef, init_params, stacklevel: int) -> None:
    """Warn when the initial value of a param site of a guide written by
    hand (or of the model) depends on the values of the records it was
    initialised on, here the placeholders: found from an abstract trace
    of shapes and dtypes only, never from values. ``stacklevel``: that of
    :func:`warnings.warn` here (1: this function)."""
    args, kwargs = jax.tree.unflatten(treedef, public)
    try:
        dependent = placeholder_dependent_params(svi.model, svi.guide, treedef, public, svi.static_kwargs,
                                                 init_params)
    except Exception as err:   # noqa: BLE001 - the check is a courtesy; the step reports real errors
        explained = _validate.model_call_error(err, svi.model, svi.guide, len(args), kwargs, svi.static_kwargs)
        if explained is not None:
            raise explained from err
        return
    names = [n for role in ("guide", "model") for n in dependent.get(role, [])]
    if not names:
        return
    where = " and ".join(f"{sorted(dependent[r])} of the {r}" for r in ("guide", "model") if dependent.get(r))
    example = ", ".join(f"{n!r}: ..." for n in names)
    warnings.warn(
        f"The initial value of the param site(s) {where} depends on the values of the data, but "
        "DPSVI initialises from public information only: model and guide ran on placeholders "
        "(ones shaped like the data), never on the private records, so these parameters start "
        "from values computed from the placeholders. Pass public initial values instead: "
        f"init_params={{{example}}}, or init_data=... (records you declare public, e.g. synthetic "
        "ones) to init or run.",
        UserWarning, stacklevel=stacklevel,
    )


def init_public(svi, rng_key, public, treedef, size, init_params, real_values, stacklevel: int) -> DPSVIState:
    """:meth:`DPSVI.init` on the public records ``public`` (ones shaped like a batch
    of ``size`` rows, or ``init_data``: ``real_values``). ``stacklevel``: that
    of the placeholder warning (see :func:`_warn_if_placeholder_dependent`)."""
    mesh = _sharding.concrete_mesh(_private_step.batch_layout(svi))   # checks the mesh and batch_axis first
    rng_key = suite_key(svi.rng_suite, rng_key)
    _sharding.check_same_in_every_process("rng_key", rng_key)
    args, kwargs = jax.tree.unflatten(treedef, public)
    rng_key, init_key = unstacked(svi.rng_suite.split(rng_key, 2))
    jax_init_key = svi.rng_suite.convert_to_jax_rng_key(init_key)
    with BatchSubsample(), public_guide_setup(svi.guide, ignore_likelihood=not real_values), \
            _model_facts.model_errors_explained(svi, args, kwargs):
        try:
            state = SVI.init(svi, jax_init_key, *args, init_params=init_params, **kwargs)
        except (ValueError, RuntimeError) as err:
            if real_values:
                raise
            cause = _model_facts.structure_error(svi, treedef, public)
            if cause is not None:   # the way the model declares its records, named
                raise cause from err
            raise ValueError(
                f"Initialising the model and guide failed: {err} DPSVI initialises them on public "
                "placeholders (ones shaped like the data), never on private records, with keys "
                "derived from the key given (not NumPyro's SVI's draws for the same key). If the "
                "failure comes from those values, pass public ones: init_params={...} for the "
                "parameters, or init_data=... (records you declare public, e.g. synthetic ones) to "
                "init or run."
            ) from err
        if not real_values:
            _warn_if_placeholder_dependent(svi, public, treedef, init_params, stacklevel)
    if state.mutable_state is not None:
        raise ValueError(
            f"The model or guide has mutable state ({sorted(state.mutable_state)}). DP-VI "
            "cannot support it: mutable state is updated from the un-noised data and would "
            "leak it without any privacy guarantee."
        )
    # the model's structure and its public scale, now, for a clear early error
    with _model_facts.model_errors_explained(svi, args, kwargs):
        params = svi.optim.get_params(state.optim_state)
        scale = _model_facts.observation_scale(svi, params, treedef, public)
        _numpyro_compat.check_declared_size(svi.declared_N, _model_facts.records_plates(svi, params, treedef, public))
    state = DPSVIState(state.optim_state, None, rng_key, state_scale(scale), _private_step.initial_threshold(svi))
    # with a mesh: replicated on its devices, the same in every process
    return _sharding.replicate(state, mesh)


def init(svi, rng_key, args, kwargs, init_params, init_data) -> DPSVIState:
    """:meth:`DPSVI.init`: the initial state for a batch ``(args, kwargs)``
    of at least one record, from its shapes and dtypes or from ``init_data``."""
    records, treedef, size = _records(args, kwargs)
    if size == 0:
        raise ValueError(
            "Expected at least one record in the batch given to init, got 0 rows: init "
            "runs the model and guide on ones shaped like the batch."
        )
    public, rows = public_records(init_data, records, treedef, size)
    # the placeholder warning names the caller of DPSVI.init (through here and init_public)
    return init_public(svi, rng_key, public, treedef, rows, init_params, real_values=init_data is not None,
                       stacklevel=5)
