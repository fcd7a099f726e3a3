# SPDX-License-Identifier: Apache-2.0
"""The private step of :class:`d3p.svi.DPSVI`: per-record losses, their
clipped sum, the noise, the public normalisation and the optimizer step.

One step (:func:`step`) draws its keys from the state, forms each record's
loss (:func:`step_losses`, under the resolved ``formulation``), releases the
noisy clipped sum (:func:`private_sum`: the continuous or the discrete
mechanism, over the devices of a mesh if there is one), rescales it by public
constants (:func:`noisy_gradient`), adds the data-independent terms after
the noise and updates the optimizer. With adaptive clipping the threshold of
the next step follows from a noisy count (:func:`next_threshold`). The
functions take the :class:`~d3p.svi.DPSVI` whose settings they read; the
settings themselves are validated here (:func:`privacy_settings`,
:func:`noise_setting`).

**Formal guarantees.** The released quantity of a step is the noisy clipped
sum; everything after it is post-processing of it and of public constants
(see :class:`d3p.svi.DPSVI` and docs/privacy.md).
"""

import functools
import math
import types
import warnings
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from numpyro.optim import Minimize

from d3p import _adaptive, _clipping, _elbo_terms, _model_facts, _sharding, _validate, accounting, discrete, gradients
from d3p._certified_sum import _check_sum_threshold
from d3p._gradient_lists import _public_number
from d3p._records import _records
from d3p._state import DPSVIState, check_state, state_scale
from d3p.gradients import add_gaussian_noise, clipped_grad_sum
from d3p.random import _threefry, chacha
from d3p.random._common import suite_key

# ---------------------------------------------------------------- settings

#: The attributes of a DPSVI that its steps read while they are traced,
#: besides σ and C: a compiled program serves only the objects it was traced
#: with (a run after ``svi.optim = ...`` compiles its steps again, never runs
#: the old optimizer; :class:`SettingsMethod`).
TRACED_SETTINGS = ("model", "guide", "loss", "optim", "static_kwargs", "clip_unscaled_observations",
                   "gradient_strategy", "chunk_size", "memory_budget_bytes", "noise", "mesh", "batch_axis",
                   "adaptive_clipping", "formulation", "rng_suite")


def traced_settings(svi) -> tuple:
    """The values of ``svi``'s :data:`TRACED_SETTINGS`, in order."""
    return tuple(getattr(svi, name) for name in TRACED_SETTINGS)


def settings_version(svi, name: str, settings: tuple) -> tuple:
    """The key of a version of ``svi``'s method ``name``: ``dp_scale`` and
    ``clipping_threshold`` by value, ``settings`` (:func:`traced_settings`)
    by identity (whoever keeps the key keeps ``settings`` alive)."""
    return name, svi.dp_scale, svi.clipping_threshold, tuple(map(id, settings))


class SettingsMethod:
    """A method of :class:`DPSVI` (``update``, ``stable_update``) whose bound
    method is a function of its own for every version of the settings a
    step reads while traced (``dp_scale`` and ``clipping_threshold`` by
    value, :data:`TRACED_SETTINGS` by identity; the entry keeps them alive,
    so no other object takes their ids). ``jax.jit`` keeps one traced
    program per function it is given, and a method bound to the same
    instance is the same function to it: a ``jax.jit(svi.update)`` made
    after ``svi.dp_scale = ...`` would otherwise reuse the program of a
    jitted ``svi.update`` traced before, with the old σ, as long as that one
    lives. On the class, the plain function (its documentation)."""

    def __init__(self, fn):
        self.fn = fn
        functools.update_wrapper(self, fn)

    def __get__(self, svi, owner=None):
        if svi is None:
            return self.fn
        settings = traced_settings(svi)
        key = settings_version(svi, self.fn.__name__, settings)
        kept = svi.__dict__.setdefault("_settings_methods", {})
        if key not in kept:
            fn = self.fn
            copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
            copy.__kwdefaults__ = fn.__kwdefaults__
            kept[key] = (functools.update_wrapper(copy, fn), settings)
        return types.MethodType(kept[key][0], svi)


def privacy_settings(clipping_threshold, dp_scale):
    """``(C, sigma)`` as floats: ``C > 0`` and ``sigma >= 0`` finite, except
    ``C = inf`` together with ``sigma = 0`` (no privacy, for testing)."""
    if clipping_threshold is None:
        if dp_scale is None:   # C chosen by adaptive clipping (d3p._adaptive.chosen), σ by run(epsilon=...)
            return _adaptive.CHOSEN_FIRST_THRESHOLD, None
        raise TypeError("Expected clipping_threshold, the clipping threshold C > 0 of each record's gradient "
                        "(inf only with dp_scale=0, no privacy), got none with dp_scale given. (Leave out both "
                        "to ask run(..., epsilon=...) for an ε: it then calibrates σ and C follows adaptive "
                        "clipping.)")
    C = _validate.positive("clipping_threshold", clipping_threshold, finite=False)
    if dp_scale is None:   # chosen by run(..., epsilon=...)
        if math.isinf(C):
            raise ValueError("Expected a finite clipping_threshold when dp_scale is left to run(epsilon=...), got "
                             f"clipping_threshold={C}.")
        return C, None
    s = _validate.non_negative("dp_scale", dp_scale)
    if math.isinf(C) and s != 0:
        raise ValueError(
            f"Expected a finite clipping_threshold, got clipping_threshold={C} with "
            f"dp_scale={s}: the noise would be infinite. (C=inf is allowed only with "
            "dp_scale=0, i.e. without privacy.)"
        )
    return C, s


def checked_threshold(svi) -> float:
    """The DPSVI's ``clipping_threshold``, which a user may set between runs
    (``run``'s steps take it as an argument: :func:`traced_threshold`),
    checked as its constructor checks it: with its ``dp_scale``, ``noise``
    and adaptive clipping's bounds."""
    C = _validate.positive("clipping_threshold", svi.clipping_threshold, finite=False)
    privacy_settings(C, svi.dp_scale)
    noise_setting(svi.noise, svi.dp_scale, C, svi.gradient_strategy)
    settings = svi.adaptive_clipping
    if settings is not None and not settings.min_threshold <= C <= settings.max_threshold:
        raise ValueError(f"Expected min_threshold <= clipping_threshold <= max_threshold, got "
                         f"min_threshold={settings.min_threshold}, clipping_threshold={C}, "
                         f"max_threshold={settings.max_threshold}.")
    return C


def optim_value(optim):
    """The loss value NumPyro hands an optimizer that asks for one (optax
    transformations): a public constant 0, never the loss, which is not
    private (loss-reading transformations such as reduce_on_plateau then
    never adapt); None for the others."""
    return jnp.zeros(()) if getattr(optim, "update_with_value", False) else None


def step_schedule_of(svi):
    """The :class:`d3p._run_plan.RunStepSize` of ``svi``'s optimizer where d3p
    made it (``optim=None``, or a twin's Adam), else None (also after
    ``svi.optim = ...``)."""
    chosen = svi._step_schedule
    return chosen[1] if chosen is not None and svi.optim is chosen[0] else None


def check_optimizer(optim) -> None:
    """Refuse optimizers that update from the loss value (``numpyro.optim.Minimize``,
    ``update_with_value``): the loss is computed from un-noised data. Optax
    transformations, also wrapped by ``numpyro.optim.optax_to_numpyro``, are
    accepted: they are given a public constant 0 as the value (see :class:`DPSVI`)."""
    update_fn = getattr(optim, "update_fn", None)
    optax_wrapper = getattr(update_fn, "__qualname__", "").startswith("optax_to_numpyro.")
    if isinstance(optim, Minimize) or (getattr(optim, "update_with_value", False) and not optax_wrapper):
        raise ValueError(
            f"optim={type(optim).__name__} uses the loss value to update, but the loss is "
            "computed from un-noised data and is not private; choose a gradient-based "
            "optimizer such as numpyro.optim.Adam."
        )


def noise_setting(noise, dp_scale: float, clipping_threshold: float, strategy: str) -> str:
    """The validated ``noise`` argument of :class:`DPSVI`."""
    noise = accounting._noise(noise)   # the one list of mechanisms
    if noise == "discrete":
        if dp_scale == 0 or math.isinf(clipping_threshold):
            raise ValueError(
                f"Expected dp_scale > 0 and a finite clipping_threshold with noise='discrete', got "
                f"dp_scale={dp_scale!r} and clipping_threshold={clipping_threshold!r}."
            )
        if strategy not in ("auto", "scan"):
            raise ValueError(
                f"Expected gradient_strategy 'auto' or 'scan' with noise='discrete' (it forms each "
                f"record's gradient on its own, one record at a time, so that its rounding does not "
                f"depend on the batch), got gradient_strategy={strategy!r}."
            )
    return noise


def optional_count(name, value) -> Optional[int]:
    """``None``, or an integer ``>= 1``."""
    return None if value is None else _validate.integer(name, value, minimum=1)


def noise_multiplier(svi) -> float:
    """``dp_scale``, or a ``ValueError`` where it is left to ``run(epsilon=...)``."""
    if svi.dp_scale is None:
        raise ValueError(
            "Expected a noise multiplier: this DPSVI was made with dp_scale=None, so only "
            "run(..., epsilon=..., delta=...) can choose it; pass dp_scale to DPSVI for update, "
            "get_epsilon and get_delta.")
    return svi.dp_scale


def step_sigma(svi):
    """σ of a step being traced: ``run``'s argument (:func:`traced_sigma`),
    else the DPSVI's ``dp_scale``, a constant of the program, which is
    remembered for :func:`warn_if_sigma_changed`."""
    if svi._run_sigma is not None:
        return svi._run_sigma
    sigma = noise_multiplier(svi)
    svi._traced_sigmas.add(sigma)
    return sigma


def warn_if_sigma_changed(svi, stacklevel: int) -> None:
    """Warn where ``dp_scale``, which :meth:`DPSVI.get_epsilon` accounts for, is
    none of the σ that steps of this DPSVI were traced with as a constant:
    a ``jax.jit(svi.update)`` made before ``dp_scale`` was set keeps adding
    the noise of the σ it was traced with. ``stacklevel`` counts from this
    function's caller (1)."""
    sigma = noise_multiplier(svi)
    if svi._traced_sigmas and sigma not in svi._traced_sigmas:
        warnings.warn(
            f"Accounting for dp_scale={sigma!r}, but the steps of this DPSVI were traced with "
            f"dp_scale={', '.join(map(repr, sorted(svi._traced_sigmas)))}: a jax.jit(svi.update) made before "
            "dp_scale was set keeps the noise of the sigma it was traced with. Jit svi.update again after "
            "setting dp_scale (DPSVI.run takes sigma as an argument), or account for the sigma the steps used.",
            UserWarning, stacklevel=stacklevel + 1)


def warn_if_all_noise(svi, batch_size, stacklevel: int, sigma: Optional[float] = None) -> None:
    """:func:`d3p._validate.warn_if_all_noise` for the DPSVI's σ and C and a
    public (expected) batch size, once per batch size; nothing for a traced
    one. ``stacklevel`` counts from this function's caller (1)."""
    if isinstance(batch_size, jax.core.Tracer):
        return
    sigma = noise_multiplier(svi) if sigma is None else sigma
    key = (sigma, float(batch_size), svi.clipping_threshold)
    if key not in svi._noise_warnings:
        svi._noise_warnings.add(key)
        _validate.warn_if_all_noise(sigma, float(batch_size), svi.clipping_threshold, stacklevel=stacklevel + 1)


def discrete_plan(svi, params) -> "discrete.DiscretePlan":
    """See :meth:`DPSVI.discrete_plan`: kept per σ, C and parameter count."""
    num_params = count_parameters(params)
    key = (noise_multiplier(svi), svi.clipping_threshold, num_params)
    if key not in svi._discrete_plans:
        svi._discrete_plans[key] = discrete.discrete_plan(svi.dp_scale, svi.clipping_threshold, num_params)
    return svi._discrete_plans[key]


def batch_layout(svi):
    """How a step's batch is sharded (:func:`d3p._sharding.batch_layout`):
    over ``mesh``, else the mesh in context, else None (one device)."""
    return _sharding.batch_layout(svi.mesh, svi.batch_axis)


def replicated(svi, *trees) -> tuple:
    """``trees`` placed whole on every device of the mesh, if there is one."""
    return _sharding.replicate(trees, _sharding.concrete_mesh(batch_layout(svi)))


# ---------------------------------------------------------------- thresholds


def initial_threshold(svi) -> Optional[jax.Array]:
    """:attr:`DPSVIState.clipping_threshold` of :meth:`DPSVI.init`: the initial
    ``C`` with adaptive clipping, else None."""
    if svi.adaptive_clipping is None:
        return None
    return jnp.asarray(svi.clipping_threshold, dtype=jnp.result_type(float))


def step_threshold(svi, svi_state):
    """``C`` of this step: the state's ``C_t`` with adaptive clipping, else
    the DPSVI's (the argument of ``run``'s steps where they take it,
    :func:`traced_threshold`)."""
    if svi.adaptive_clipping is None:
        return checked_threshold(svi) if svi._run_clip is None else svi._run_clip   # traced in run's steps
    if svi_state.clipping_threshold is None:
        raise ValueError(
            "Expected a state with a clipping_threshold (from init of a DPSVI with adaptive_clipping), got "
            "svi_state.clipping_threshold=None.")
    return svi_state.clipping_threshold


def next_threshold(svi, svi_state, result, mask, C, expected_batch_size, count_key):
    """``C_{t+1}`` of adaptive clipping, from the noisy count of the
    records whose norm is at most ``C`` (:mod:`d3p._adaptive`); without
    it, the state's field unchanged."""
    settings = svi.adaptive_clipping
    if settings is None:
        return svi_state.clipping_threshold
    sigma = step_sigma(svi)   # traced in run's steps
    count_noise = settings.count_std(sigma)
    fraction = _adaptive.noisy_fraction(result.norms, mask, C, count_noise, expected_batch_size, count_key,
                                        svi.rng_suite)
    gamma = _adaptive.target_quantile(settings, sigma, num_params(svi, svi_state), expected_batch_size)
    return _adaptive.next_threshold(C, fraction, settings, count_noise, expected_batch_size, gamma)


def num_params(svi, svi_state) -> int:
    """The number of the optimizer's parameters (public: their shapes)."""
    return count_parameters(svi.optim.get_params(svi_state.optim_state))


def count_parameters(params) -> int:
    """The number of values in the pytree ``params`` (their shapes only)."""
    return sum(math.prod(jnp.shape(x)) for x in jax.tree.leaves(params))


def threshold_bound(svi) -> Optional[float]:
    """The public upper bound of ``C`` that the sum's overflow check uses:
    ``max_threshold`` with adaptive clipping, else None (``C`` itself; a
    ``C`` that ``run``'s steps take as an argument is checked by ``run``,
    :func:`check_threshold_fits`)."""
    return None if svi.adaptive_clipping is None else svi.adaptive_clipping.max_threshold


# -------------------------------------------------------- per-record losses


def record_loss_fn(svi, treedef, scale, key_impl=None):
    """loss(params, record) of one record, ``record = (jax_key, leaves)``,
    divided by the public constant ``scale`` unless it is None; with
    ``key_impl``, ``jax_key`` is raw key data of that implementation."""

    def record_loss(params, record):
        key, leaves = record
        if key_impl is not None:
            key = jax.random.wrap_key_data(key, impl=key_impl)
        args, kwargs = jax.tree.unflatten(treedef, [jnp.expand_dims(x, 0) for x in leaves])
        loss = svi.loss.loss(
            key, svi.constrain_fn(params), svi.model, svi.guide, *args, **kwargs, **svi.static_kwargs
        )
        return loss if scale is None else loss / scale

    return record_loss


def shared_sites(svi, params, treedef, leaves) -> tuple:
    """The names of the sites outside the records' plates whose draws a
    step's batch shares, sorted (none under the ``"per_record"``
    formulation): the sites :func:`step_losses` keys once for the step."""
    formulation, facts = _model_facts.split_facts(svi, params, treedef, leaves, sharded=batch_layout(svi) is not None)
    return () if formulation == "per_record" else tuple(sorted(facts.global_sites | set(facts.global_latents)))


def step_losses(svi, params, treedef, leaves, scale, monte_carlo):
    """``(record_loss, global_loss, shared)`` of a step under the resolved
    ``formulation``: the loss of one record (clipped); the loss of the
    data-independent sites, evaluated once per step (None under
    ``"per_record"`` or without such sites); and the key of the draw
    shared by the batch (None under ``"per_record"``: a
    :class:`d3p._elbo_terms.SharedKey` of the keys of ``monte_carlo``, see
    :func:`_monte_carlo_keys`), from which ``record_loss(shared)`` is the loss of
    one record."""
    _, key_impl, shared_base, site_keys = monte_carlo
    formulation, facts = _model_facts.split_facts(svi, params, treedef, leaves, sharded=batch_layout(svi) is not None)
    svi.formulation_choice = formulation
    if formulation == "per_record":
        return record_loss_fn(svi, treedef, scale, key_impl), None, None
    plates = _model_facts.records_plates(svi, params, treedef, leaves)
    # the keys of the sites outside the records' plates, once for the step
    shared = (_elbo_terms.SharedKey(shared_base, site_keys) if site_keys is not None
              else _elbo_terms.shared_site_keys(shared_base, shared_sites(svi, params, treedef, leaves)))

    def record_loss(shared_key):
        return _elbo_terms.record_loss_fn(svi, formulation, facts, plates, treedef, scale, key_impl, shared_key)

    one_record = list(_model_facts.one_record(leaves))
    if formulation == "aligned":   # the mechanism's vector is the draw's: private_sum forms it
        record_loss = _elbo_terms.AlignedStep(svi, facts, plates, treedef, scale, key_impl, tuple(one_record))
    if not facts.global_sites:
        return record_loss, None, shared
    return record_loss, _elbo_terms.global_loss_fn(svi, facts, plates, treedef, one_record, shared), shared


# ------------------------------------------------------------------ the step


def _checked_mask(mask, B: int):
    """``mask`` as a boolean array ``(B,)`` (one boolean: for the whole batch), or None."""
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    if mask.shape == () and mask.dtype == jnp.bool_:
        mask = jnp.broadcast_to(mask, (B,))   # d3p 0.2: one flag for the whole batch
    if mask.shape != (B,) or mask.dtype != jnp.bool_:
        raise ValueError(
            f"Expected mask to be a boolean array of shape ({B},) (True for real "
            f"records) or one boolean for the whole batch, got dtype {mask.dtype} and "
            f"shape {mask.shape}."
        )
    return mask


def _public_batch_size(expected_batch_size, B: int):
    """The public constant by which the noisy sum is normalised: ``expected_batch_size``, or ``B``."""
    if expected_batch_size is None:
        if B == 0:
            raise ValueError(
                "Expected expected_batch_size for a batch of 0 records, got None: the "
                "noisy sum is normalised by the public batch size (e.g. q * N under "
                "Poisson sampling), never by the realised count."
            )
        return B
    return _public_number(_validate.positive, "expected_batch_size", expected_batch_size)


def _monte_carlo_keys(jax_keys, B: int, sites=None):
    """``(keys, key_impl, shared, site_keys)`` of ``B + 1`` JAX keys (and
    one more for each of ``sites``): the Monte Carlo keys of the ``B``
    records, the key of the draw shared by the batch (never a record's,
    independent of the data) and, with ``sites``, the keys of those sites of
    the shared draw, the next keys in the order of ``sites`` (a dict; None
    without ``sites``: :func:`d3p._elbo_terms.shared_site_keys` derives them
    from ``shared``); with the loop-free Threefry implementation where it
    gives the same values (see :mod:`d3p.random._threefry`). Typed record
    keys are carried as raw data (which the strategies can pad and chunk)
    with their implementation ``key_impl``."""
    keys = _threefry.fast_key(jax_keys)
    record_keys, shared = keys[:B], keys[B]
    site_keys = None if sites is None else {name: keys[B + 1 + i] for i, name in enumerate(sites)}
    key_impl = None
    if jnp.issubdtype(record_keys.dtype, jax.dtypes.prng_key):
        key_impl = jax.random.key_impl(record_keys)
        record_keys = jax.random.key_data(record_keys)
    return record_keys, key_impl, shared, site_keys


def _site_keys_in_stream(rng_suite) -> bool:
    """Whether a step's shared sites take their keys from the call that gives
    the step's keys: with ChaCha20 (more words of the same keystream, where
    ``fold_in`` for each site would evaluate Threefry in the step); the
    debugging suite and a suite of the plain interface derive them with
    ``fold_in`` from the shared draw's key (the debugging suite's values
    stay as recorded)."""
    return getattr(rng_suite, "split_with_jax_keys", None) is chacha.split_with_jax_keys


def _step_keys(svi, key, B: int, sites=()):
    """``(next_key, noise_key, count_key, monte_carlo)`` of a step from its
    state's ``key``: the next state's key, the noise's, adaptive clipping's
    count noise's (None without adaptive clipping), all independent, and
    the Monte Carlo keys of :func:`_monte_carlo_keys` (``B`` records', the
    shared draw's and, with ChaCha20, those of the shared draw's ``sites``,
    :func:`shared_sites`, for ``jax.random``). With a suite that has
    ``split_with_jax_keys`` (both of d3p's) they all come from one call of
    it: with ChaCha20, one block-function loop in the compiled step and no
    Threefry of d3p's. A suite with the plain interface splits one key
    more, converts it and splits that JAX key into ``B + 1``."""
    num = 2 if svi.adaptive_clipping is None else 3
    many = getattr(svi.rng_suite, "split_with_jax_keys", None)
    sites = tuple(sites) if _site_keys_in_stream(svi.rng_suite) else None
    if many is not None:
        keys, jax_keys = many(key, num, B + 1 + len(sites or ()))
    else:
        keys = svi.rng_suite.split(key, num + 1)
        jax_key = _threefry.fast_key(svi.rng_suite.convert_to_jax_rng_key(keys[num]))
        jax_keys = jax.random.split(jax_key, B + 1)
    return keys[0], keys[1], (keys[2] if num == 3 else None), _monte_carlo_keys(jax_keys, B, sites)


def step_shared_key(svi, rng_key, B: int):
    """The key of the draw shared by a batch of ``B`` records in a step from
    a state whose key is ``rng_key`` (:func:`_step_keys`)."""
    return _step_keys(svi, suite_key(svi.rng_suite, rng_key, "svi_state.rng_key"), B)[3][2]


def noisy_gradient(svi, svi_state, args, kwargs, mask, expected_batch_size, forward_mode):
    """``(state, noisy_gradient, loss)`` of one step (see :meth:`DPSVI.update`);
    ``state`` has the new key and observation scale, the old optimizer state."""
    check_state(svi_state)
    key = suite_key(svi.rng_suite, svi_state.rng_key, "svi_state.rng_key")
    records, treedef, B = _records(args, kwargs)
    mask = _checked_mask(mask, B)
    expected_batch_size = _public_batch_size(expected_batch_size, B)
    warn_if_all_noise(svi, expected_batch_size, stacklevel=6)   # the caller of update
    C = step_threshold(svi, svi_state)
    params = svi.optim.get_params(svi_state.optim_state)
    with _model_facts.model_errors_explained(svi, args, kwargs):
        # a public constant (None without clip_unscaled_observations): see _model_facts.observation_scale
        scale = _model_facts.observation_scale(svi, params, treedef, records)
        rng_key, noise_key, count_key, monte_carlo = _step_keys(
            svi, key, B, shared_sites(svi, params, treedef, records))
        loss_fn, global_loss, shared = step_losses(svi, params, treedef, records, scale, monte_carlo)
        result, noisy_sum = private_sum(svi, loss_fn, params, (monte_carlo[0], list(records)), mask, forward_mode,
                                        noise_key, C, shared)
    # the public normalisation: N / B when the per-record losses were divided
    # by the observation scale (N, the scale of a batch of one), else 1 / B
    factor = (1.0 if scale is None else scale) / expected_batch_size
    grad = jax.tree.map(lambda g: g * jnp.asarray(factor, g.dtype), noisy_sum)
    loss = jnp.sum(result.losses) * factor
    if global_loss is not None:
        # the data-independent terms (see formulation): public post-processing after the noise
        global_value, global_grad = gradients._value_and_grad_one(
            lambda p, _: global_loss(p), params, None, forward_mode)
        grad = jax.tree.map(lambda g, h: g + h.astype(g.dtype), grad, global_grad)
        loss = loss + global_value
    observation_scale = svi_state.observation_scale
    if observation_scale is not None:
        observation_scale = state_scale(scale)
    next_C = next_threshold(svi, svi_state, result, mask, C, expected_batch_size, count_key)
    return DPSVIState(svi_state.optim_state, None, rng_key, observation_scale, next_C), grad, loss


def private_sum(svi, loss_fn, params, records, mask, forward_mode, noise_key, C, shared=None):
    """``(ClippedSum, noisy sum)``: the clipped sum over records, over the
    devices of the mesh if there is one, and its noisy release (the noise
    drawn once, for the whole sum), by the continuous or the discrete
    mechanism, with this step's clipping threshold ``C``. With ``shared``
    (the key of the draw shared by the batch), ``loss_fn(shared)`` is the
    loss of one record (see :func:`step_losses`). Under ``"aligned"``
    (``loss_fn`` an :class:`d3p._elbo_terms.AlignedStep`) the sum is over
    the records' gradients with respect to the shared draw and the
    parameters they read directly; the noisy sum is then mapped to the
    parameters by the chain rule (post-processing)."""
    if isinstance(loss_fn, _elbo_terms.AlignedStep):
        loss_of, theta, pullback = loss_fn.terms(params, shared)
        result, noisy = private_sum(svi, loss_of, theta, records, mask, forward_mode, noise_key, C, shared)
        return result, pullback(noisy)
    loss_of = (lambda *_: loss_fn) if shared is None else loss_fn
    layout = batch_layout(svi)
    if svi.adaptive_clipping is not None and layout is not None:
        raise ValueError("Expected no mesh in context (jax.set_mesh) with adaptive_clipping: adaptive "
                         "clipping runs on one device.")
    if svi.noise == "discrete":
        step_sigma(svi)   # a constant of the program: remembered
        plan = discrete_plan(svi, params)
        discrete._check_slots(plan, gradients._batch_size(records))   # the whole batch's slots

        def integer_sum(p, recs, m, num_shards, *key):   # int32: exact whatever the number of shards
            return discrete.clipped_integer_sum(loss_of(*key), p, recs, m, plan, forward_mode=forward_mode)

        result = _sharding.sharded_sum(layout, integer_sum, params, records, mask, shared)
        dtype = jnp.result_type(*jax.tree.leaves(params))
        noisy = discrete.add_discrete_gaussian_noise(result.grad_sum, noise_key, plan, svi.rng_suite, dtype)
        noisy = jax.tree.map(lambda g, p: g.astype(jnp.result_type(p)), noisy, params)
        return result, noisy

    def float_sum(p, recs, m, num_shards, *key):
        return clipped_grad_sum(
            loss_of(*key), p, recs, m, C, strategy=svi.gradient_strategy,
            chunk_size=svi.chunk_size, forward_mode=forward_mode,
            memory_budget_bytes=svi.memory_budget_bytes, on_choice=svi._record_choice,
            num_shards=num_shards, threshold_bound=threshold_bound(svi),
        )

    result = _sharding.sharded_sum(layout, float_sum, params, records, mask, shared)
    sigma = step_sigma(svi)
    noisy = add_gaussian_noise(result.grad_sum, noise_key, sigma, C, svi.rng_suite)
    return result, noisy


def traced_sigma(svi, sigma) -> bool:
    """Whether ``run``'s compiled steps take σ as an argument (one program
    for every σ, :func:`sigma_value`): for Gaussian noise and ``σ > 0`` (so
    ``C`` is finite; with adaptive clipping the count's noise, a share of
    σ's, is then computed from the argument too). Otherwise σ is a constant
    of the program (the discrete mechanism's plan depends on it; ``σ = 0``
    draws no noise at all)."""
    return svi.noise == "gaussian" and sigma > 0


def traced_threshold(svi) -> bool:
    """Whether ``run``'s compiled steps take ``C`` as an argument (one program
    for every ``C``, :func:`threshold_value`): a fixed finite ``C`` with
    Gaussian noise, on one device. Otherwise ``C`` is a constant of the
    program (adaptive clipping's ``C`` is the state's; the discrete
    mechanism's plan depends on ``C``; ``C = inf`` clips nothing)."""
    return (svi.adaptive_clipping is None and svi.noise == "gaussian" and math.isfinite(svi.clipping_threshold)
            and batch_layout(svi) is None)


def threshold_value(C, params):
    """``C`` as the argument of ``run``'s compiled steps (see
    :func:`traced_threshold`), in the dtype the sum computes its bounds in
    (the widest of the parameters' dtypes, at least float32): rounded as the
    program without the argument rounds its constant."""
    return np.asarray(C, _clipping._acc_dtype(*[jnp.result_type(x) for x in jax.tree.leaves(params)]))


def check_threshold_fits(C: float, acc, batch_size: int) -> None:
    """The sum's overflow check (:func:`d3p._certified_sum._check_sum_threshold`:
    ``C B`` below the limit of the accumulator dtype ``acc``) of a ``C`` that
    ``run``'s steps take as an argument: at every run, since the steps (and
    the check within them, which cannot read a traced ``C``) are traced once."""
    _check_sum_threshold(C, _Slots(int(batch_size), acc))


class _Slots(NamedTuple):
    """What the overflow check reads of a sum's budget: its slots and accumulator dtype."""

    slots: int
    acc: object


def sigma_value(sigma, params):
    """σ as the argument of ``run``'s compiled steps (see :func:`traced_sigma`),
    in the dtype of the parameters: the noise's std is then ``σ C`` computed
    in that dtype (within a unit in the last place of the product of the
    constants, which the program without the argument rounds once)."""
    return np.asarray(_validate.non_negative("dp_scale", sigma), jnp.result_type(*jax.tree.leaves(params)))


def update(svi, name, svi_state, args, kwargs, mask, expected_batch_size, forward_mode):
    """:meth:`DPSVI.update` (``name`` ``"update"``) or :meth:`DPSVI.stable_update`
    (``"stable_update"``, which keeps the optimizer state where the step is
    not finite): ``(svi_state, loss)``; called outside a traced program, by
    one compiled program (:func:`compiled_eager_call`)."""
    compiled = compiled_eager_call(svi, name, svi_state, args, kwargs, mask, expected_batch_size, forward_mode)
    if compiled is not None:
        return compiled
    state, loss, grad = step(svi, svi_state, args, kwargs, mask, expected_batch_size, forward_mode)
    if name == "stable_update":
        return keep_if_not_finite(svi_state, state, loss, grad)
    return state, loss


def compiled_eager_call(svi, name, svi_state, args, kwargs, mask, expected_batch_size, forward_mode):
    """``svi.<name>(svi_state, *args, ...)`` (``update`` or ``stable_update``)
    called outside any traced program, computed by one compiled program
    instead of operation by operation (which compiled some 200 small programs
    at the first call and ran 2-5 times slower than NumPyro's eager step:
    ``benchmarks/eager_update.py``). None where a value is traced (the caller
    traces the step as written) or ``expected_batch_size`` is not a Python or
    NumPy number (then the step runs eagerly).

    The data are converted and checked here, before anything is compiled
    (errors name the argument as the eager step's do); the program is kept
    per version of the settings a step reads (``dp_scale`` and
    ``clipping_threshold`` by value, :data:`TRACED_SETTINGS` by identity, as
    :class:`SettingsMethod`), so that another σ, C, model or optimizer is
    never served by a program traced with the old one."""
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((svi_state, args, kwargs, mask))):
        return None
    if expected_batch_size is not None and not isinstance(expected_batch_size, (int, float, np.number)):
        return None
    check_state(svi_state)
    records, treedef, B = _records(args, kwargs)
    mask = _checked_mask(mask, B)
    warn_if_all_noise(svi, _public_batch_size(expected_batch_size, B), stacklevel=5)   # the caller of update
    settings = traced_settings(svi)
    key = settings_version(svi, name, settings) + (treedef, expected_batch_size, bool(forward_mode))
    programs = svi.__dict__.setdefault("_eager_programs", {})
    if key not in programs:
        def call(state, leaves, mask):
            args, kwargs = jax.tree.unflatten(treedef, leaves)
            return getattr(svi, name)(state, *args, mask=mask, expected_batch_size=expected_batch_size,
                                      forward_mode_differentiation=forward_mode, **kwargs)

        programs[key] = (jax.jit(call), settings)   # the entry keeps the settings alive: no other object takes their ids
    return programs[key][0](svi_state, list(records), mask)


def step(svi, svi_state, args, kwargs, mask, expected_batch_size, forward_mode):
    """One step: ``(new_state, loss, noisy_gradient)``; see :meth:`DPSVI.update`."""
    check_optimizer(svi.optim)   # as the constructor does: it may have been set since
    state, grad, loss = noisy_gradient(svi, svi_state, args, kwargs, mask, expected_batch_size, forward_mode)
    step_size = step_schedule_of(svi)
    if step_size is not None:   # d3p's Adam: its step size from the parameters' shapes
        step_size.fit(grad)
    optim_state = svi.optim.update(grad, svi_state.optim_state, value=optim_value(svi.optim))
    return state._replace(optim_state=optim_state), loss, grad


def _all_finite(tree) -> jax.Array:
    """Whether every inexact entry of ``tree`` is finite (True for none)."""
    leaves = [jnp.asarray(x) for x in jax.tree.leaves(tree)]
    checks = [jnp.all(jnp.isfinite(x)) for x in leaves if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.asarray(checks or [True]))


def keep_if_not_finite(old_state, new_state, loss, grad):
    """:meth:`DPSVI.stable_update`'s guard: ``new_state`` if the noisy gradient
    and its optimizer state are finite, else ``new_state`` with the optimizer
    state of ``old_state`` (the key still advances) and a ``nan`` loss."""
    ok = jnp.all(jnp.isfinite(ravel_pytree(grad)[0])) & _all_finite(new_state.optim_state)
    optim_state = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_state.optim_state, old_state.optim_state)
    return new_state._replace(optim_state=optim_state), jnp.where(ok, loss, jnp.nan)


def perturbation(rng_suite, rng, values, perturbation_scale):
    """See :meth:`DPSVI.perturbation_function`: one key per leaf, split from ``rng``."""
    rng_suite = _validate.rng_suite("rng_suite", rng_suite)
    scale = _validate.non_negative("perturbation_scale", perturbation_scale)
    leaves, treedef = jax.tree.flatten(values)
    if not leaves:
        return values
    keys = rng_suite.split(rng, len(leaves))
    noisy = [add_gaussian_noise(leaf, keys[i], scale, 1.0, rng_suite) for i, leaf in enumerate(leaves)]
    return jax.tree.unflatten(treedef, noisy)
