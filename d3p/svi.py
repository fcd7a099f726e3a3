"""Differentially private stochastic variational inference (DP-VI) for NumPyro.

:class:`DPSVI` is a drop-in replacement for :class:`numpyro.infer.SVI`: the
same constructor arguments (plus the clipping threshold and the noise
multiplier), the same methods and states, and parameters that work with
``numpyro.infer.Predictive`` as after SVI.
"""

import functools
import math
import warnings
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import tqdm
from jax import lax
from jax.extend import core as jex_core
from numpyro.handlers import seed, substitute, trace
from numpyro.infer.svi import SVI, SVIRunResult
from numpyro.optim import Minimize

import d3p.random
from d3p import gradients
from d3p.gradients import add_gaussian_noise, clipped_grad_sum
from d3p.random import _threefry

__all__ = ["DPSVI", "DPSVIState", "DPSVIRunResult"]


class DPSVIState(NamedTuple):
    """State of :class:`DPSVI`, a pytree.

    - **optim_state** - the optimizer's state (holds the unconstrained
      variational parameters); as in :data:`numpyro.infer.svi.SVIState`.
    - **mutable_state** - always ``None``: DP-VI does not support mutable
      state (see :class:`DPSVI`).
    - **rng_key** - the key of the PRNG suite (``d3p.random`` by default) from
      which the next step draws its privacy noise and Monte Carlo samples.
    """

    optim_state: Any
    mutable_state: Any
    rng_key: Any


class DPSVIRunResult(SVIRunResult):
    """:data:`numpyro.infer.svi.SVIRunResult` ``(params, state, losses)`` from
    :meth:`DPSVI.run`, with the privacy spent as attributes.

    Attributes (not tuple fields, so ``params, state, losses = result`` works
    as in NumPyro): ``epsilon``, ``delta``, ``relation``, ``sampler`` (``"poisson"`` or
    ``"fixed_size"``), ``sigma``, ``q``,
    ``num_steps``. ``losses`` are NOT private.
    """


#: How the data-validation errors say where shared values belong.
_SHARED_VALUES_HINT = (
    "Every argument of init/update/evaluate/run (positional or keyword) is per-record data "
    "with one row per record; values shared by all records (e.g. N or group-level "
    "covariates) go to the DPSVI constructor as keyword arguments: DPSVI(..., name=value)."
)


def _is_number_sequence(x) -> bool:
    """True for a non-empty plain list or tuple (not a namedtuple) of numbers or
    strings, possibly nested: one column (or table) of data, rows first."""
    return (
        type(x) in (list, tuple)
        and len(x) > 0
        and all(isinstance(e, (int, float, complex, str, bytes, np.generic)) or _is_number_sequence(e)
                for e in x)
    )


def _as_array(x):
    """``x`` as an array if it is a column or table of data held in something
    other than an array (a list of numbers, a pandas object, ...); else ``x``."""
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        return x
    if _is_number_sequence(x) or (hasattr(x, "__array__") and hasattr(x, "shape")):
        return np.asarray(x)
    return x


def _leaf_name(path) -> str:
    """``args[i]...`` or ``'key'...`` for a path into ``(args, kwargs)``."""
    head, rest = path[1], path[2:]
    name = f"args[{head.idx}]" if path[0].idx == 0 else repr(head.key)
    return name + "".join(str(p) for p in rest)


def _check_record_leaf(name: str, x):
    """Raise unless ``x`` is an array of numbers or booleans with a leading
    (records) dimension."""
    if isinstance(x, (bool, int, float, complex, np.generic)) or (
        isinstance(x, (jax.Array, np.ndarray)) and np.ndim(x) == 0
    ):
        raise ValueError(
            f"Expected {name} to be an array with one row per record, got the scalar "
            f"{name}={x!r}. {_SHARED_VALUES_HINT}"
        )
    if not isinstance(x, (jax.Array, np.ndarray)):
        raise TypeError(
            f"Expected {name} to be an array with one row per record, got an object of "
            f"type {type(x).__name__}. {_SHARED_VALUES_HINT}"
        )
    if not (jnp.issubdtype(x.dtype, jnp.number) or jnp.issubdtype(x.dtype, jnp.bool_)):
        raise TypeError(
            f"Expected {name} to hold numbers or booleans, got dtype {x.dtype}. Convert "
            "categorical or text columns to numbers first (e.g. pandas' "
            "`df.to_numpy(dtype=float)` or category codes)."
        )


def _records(args, kwargs, *, expected_size=None, what="batch"):
    """The per-record data of ``(args, kwargs)``: ``(leaves, treedef, size)``.

    Every leaf is per-record: lists or tuples of numbers and pandas (or other
    array-like) objects are converted with ``np.asarray``, their rows the
    records; lists, tuples and dicts holding arrays are pytree containers. Each
    leaf must be a numeric or boolean array whose leading dimension is the
    number of records, the same for all (``expected_size`` if given). Scalars
    and other objects are refused with an error naming the argument: nothing
    is treated as shared by the records. The caller's data is never modified.
    ``jax.tree.unflatten(treedef, leaves)`` gives the (converted) ``(args, kwargs)``.
    """
    def convert(arg):
        return jax.tree.map(_as_array, arg, is_leaf=_is_number_sequence)

    converted = (tuple(convert(a) for a in args), {k: convert(v) for k, v in kwargs.items()})
    paths, treedef = jax.tree_util.tree_flatten_with_path(converted)
    leaves = [x for _, x in paths]
    names = [_leaf_name(path) for path, _ in paths]
    size, first_name = expected_size, None
    for name, leaf in zip(names, leaves):
        _check_record_leaf(name, leaf)
        n = int(np.shape(leaf)[0])
        if size is None:
            size, first_name = n, name
        elif n != size:
            ref = f"{first_name} has {size}" if first_name else f"the {what} has {size} records"
            raise ValueError(
                f"Expected every data argument to hold one row per record, but {name} has "
                f"leading dimension {n} and {ref}. {_SHARED_VALUES_HINT}"
            )
    if size is None:
        raise ValueError(
            "Expected at least one per-record data array among the arguments (DP-VI "
            "needs the records to clip each one's contribution)."
        )
    return leaves, treedef, size


def _split_records(args, kwargs, *, expected_size=None, what="batch"):
    """:func:`_records` as ``(leaves, rebuild, size, per_record)``, with
    ``rebuild(leaves) -> (args, kwargs)`` and ``per_record`` all True."""
    leaves, treedef, size = _records(args, kwargs, expected_size=expected_size, what=what)
    return leaves, functools.partial(jax.tree.unflatten, treedef), size, [True] * len(leaves)


def _depends_on_inputs(jaxpr) -> list:
    """For each output of ``jaxpr``: whether it may depend on any input.

    A conservative forward walk: every output of an equation with at least one
    dependent operand is dependent, whatever the equation computes (calls,
    loops and conditionals included, without looking inside them). So False
    is a proof of independence; True may be a false alarm.
    """
    dependent = set(jaxpr.invars)
    for eqn in jaxpr.eqns:
        if any(isinstance(v, jex_core.Var) and v in dependent for v in eqn.invars):
            dependent.update(eqn.outvars)
    return [isinstance(v, jex_core.Var) and v in dependent for v in jaxpr.outvars]


def _evaluate_constant_outputs(closed) -> list:
    """The outputs of the closed jaxpr ``closed``, all independent of its
    inputs (see :func:`_depends_on_inputs`), evaluated now from its constants
    alone: only the equations they need are run, without any input."""
    jaxpr = closed.jaxpr
    needed = {v for v in jaxpr.outvars if isinstance(v, jex_core.Var)}
    kept = []
    for eqn in reversed(jaxpr.eqns):
        if any(v in needed for v in eqn.outvars):
            kept.append(eqn)
            needed.update(v for v in eqn.invars if isinstance(v, jex_core.Var))
    sliced = jaxpr.replace(invars=[], eqns=kept[::-1], debug_info=None)
    with jax.ensure_compile_time_eval():
        return jax.core.eval_jaxpr(sliced, closed.consts)


def _check_positive_int(name, value, minimum=1):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"Expected {name} to be an integer >= {minimum}, got {name}={value!r}.")
    return int(value)


class DPSVI(SVI):
    """Differentially private stochastic variational inference.

    Drop-in replacement for :class:`numpyro.infer.SVI`. Each step
    (:meth:`update`) computes, for a batch of ``B`` records from a data set of
    ``N``:

    1. the ELBO loss of every record alone, each with its own guide sample
       (the model is run on a batch holding only that record, vectorised with
       ``vmap``); with ``clip_unscaled_observations=True`` the loss is divided by
       the public observation scale of one record (the plate's ``N / 1``), so
       that ``C`` bounds the record's own likelihood term whatever ``N`` is, and
       the data-independent prior/entropy terms enter with weight ``1 / N``;
    2. its gradient over all variational parameters, clipped as one vector to
       L2 norm at most ``C`` (``clipping_threshold``);
    3. the sum over real records of the clipped gradients plus Gaussian noise of
       standard deviation ``dp_scale * C`` in every coordinate, drawn from
       ``rng_suite``;
    4. that noisy sum times ``N / B`` (with ``B`` the batch size, or the public
       ``expected_batch_size`` under Poisson sampling; never the realised count),
       the full-data ELBO gradient scale; then one optimizer step.

    With ``clip_unscaled_observations=False`` the per-record loss keeps the
    plate scale (``C`` then bounds ``N`` times a record's term) and step 4
    multiplies by ``1 / B`` instead.

    The model must declare its records with a plate that subsamples, e.g.
    ``with numpyro.plate("data", N, subsample_size=xs.shape[0])``, as in
    minibatch SVI: the observation scale it sets is how DPSVI knows ``N``.
    That scale is found once, from the shapes of one record, and must be a
    public constant (the plate's declared size ``N``, from ``static_kwargs``,
    times constants such as ``numpyro.handlers.scale(0.5)``): a scale that may
    depend on a record's data, the parameters or the random key (e.g. weights
    per record through ``numpyro.handlers.scale``) is refused with a
    ``ValueError``, because the normalisation is released without noise.

    All data passed to :meth:`init`, :meth:`update`, :meth:`stable_update`,
    :meth:`evaluate` and :meth:`run` (positionally or as keywords) is
    per-record: every array has one row per record. Values shared by all
    records go to the constructor as ``static_kwargs``; a scalar among the
    data is refused, naming the argument.

    **Formal guarantees.** Under either neighbouring relation the released
    quantity of one step is the noisy clipped sum (step 3); everything after it
    is post-processing. The sum changes by at most ``C`` in L2 norm when one
    record is added, removed or masked out, and by at most ``2 C`` when one is
    substituted, whatever the model, the data and the non-finite values in
    per-record gradients (which are zeroed). Record ``i`` sees only row ``i``
    of each data array; nothing in the data is shared between records. Padded
    records (``mask`` False) contribute exactly zero; an empty batch yields
    pure noise, never ``nan``. The noise scale depends only on ``dp_scale``
    and ``C``, and the normalisation (step 4) only on public constants: the
    model's scale, found from shapes alone, and the batch size or
    ``expected_batch_size``; ``static_kwargs`` and the model's own constants
    are treated as public. Privacy over a run
    follows from the sampling of batches: use the samplers of
    :mod:`d3p.minibatch` (or :meth:`run`) with the matching accountant
    (:meth:`get_epsilon`). The loss returned by :meth:`update`,
    :meth:`evaluate` and :meth:`run` is computed from the un-noised data and is
    NOT private; so is anything else derived from the data without noise.

    :param model: NumPyro model; its records must sit under a subsampling plate.
    :param guide: NumPyro guide (e.g. an autoguide).
    :param optim: a NumPyro optimizer, a ``jax.example_libraries`` optimizer or
        an ``optax`` transformation. NumPyro optimizers that use the loss value
        (``numpyro.optim.Minimize``, ``update_with_value``) are refused: the loss
        is not private. Optax transformations are given a constant 0 as the loss
        value, so those that read it (e.g. ``reduce_on_plateau``) never adapt.
    :param per_example_loss: the ELBO, e.g. ``numpyro.infer.Trace_ELBO()``,
        evaluated on one record at a time.
    :param float clipping_threshold: ``C > 0``, finite; ``inf`` only together
        with ``dp_scale=0`` (no privacy, for testing).
    :param float dp_scale: the noise multiplier ``sigma >= 0``
        (from :func:`d3p.dputil.approximate_sigma`).
    :param rng_suite: the PRNG suite for noise and batch selection;
        :mod:`d3p.random` (ChaCha20) by default, :mod:`d3p.random.debug` for
        debugging. The records' Monte Carlo samples (their guide draws) come
        from JAX's default generator under a key from
        ``rng_suite.convert_to_jax_rng_key``, one key per record, as
        ``jax.random.split`` would give them (computed without Threefry's
        loops on CPU); they do not depend on the data and carry no privacy role.
    :param bool clip_unscaled_observations: see above; default True.
    :param str gradient_strategy: how per-record gradients are formed:
        ``"auto"`` (default: chosen from the model's structure, the backend and
        the memory budget), ``"vmap"``, ``"chunked"``, ``"scan"`` or
        ``"ghost"``; all give the same clipped sum and the same privacy (see
        :func:`d3p.gradients.clipped_grad_sum`).
    :param int chunk_size: records per chunk for ``"chunked"`` and ``"ghost"``
        (default: from the memory budget).
    :param int memory_budget_bytes: bytes of per-record gradients (or
        activations) held at once; default
        :data:`d3p.gradients.DEFAULT_MEMORY_BUDGET_BYTES`.
    :param static_kwargs: keyword arguments passed to model and guide at every
        call, shared by all records (e.g. ``N``, or group-level data); the only
        place for such values, and treated as public (they are used without
        noise).

    **Example**

    .. doctest::

        >>> import jax.numpy as jnp
        >>> import numpyro, numpyro.distributions as dist
        >>> from numpyro.infer import Trace_ELBO
        >>> from numpyro.infer.autoguide import AutoDiagonalNormal
        >>> import d3p.random
        >>> from d3p.svi import DPSVI
        >>> def model(xs, N):
        ...     mu = numpyro.sample("mu", dist.Normal(0, 10))
        ...     with numpyro.plate("data", N, subsample_size=xs.shape[0]):
        ...         numpyro.sample("x", dist.Normal(mu, 1), obs=xs)
        >>> xs = jnp.linspace(0.0, 2.0, 100)
        >>> guide = AutoDiagonalNormal(model)
        >>> svi = DPSVI(model, guide, numpyro.optim.Adam(0.05), Trace_ELBO(),
        ...             clipping_threshold=2.0, dp_scale=1.0, N=100)
        >>> result = svi.run(d3p.random.PRNGKey(0), 500, xs, batch_size=10,
        ...                  progress_bar=False)
        >>> result.params["auto_loc"].shape
        (1,)
    """

    def __init__(
        self,
        model: Callable,
        guide: Callable,
        optim,
        per_example_loss,
        clipping_threshold: float,
        dp_scale: float,
        rng_suite=d3p.random,
        clip_unscaled_observations: bool = True,
        gradient_strategy: str = "auto",
        chunk_size: Optional[int] = None,
        memory_budget_bytes: Optional[int] = None,
        **static_kwargs,
    ):
        if isinstance(optim, Minimize) or getattr(optim, "update_with_value", False):
            raise ValueError(
                f"optim={type(optim).__name__} uses the loss value to update, but the loss is "
                "computed from un-noised data and is not private; choose a gradient-based "
                "optimizer such as numpyro.optim.Adam."
            )
        super().__init__(model, guide, optim, per_example_loss, **static_kwargs)
        C = clipping_threshold
        if isinstance(C, bool) or not isinstance(C, (int, float, np.integer, np.floating)):
            raise TypeError(f"Expected clipping_threshold to be a number, got {C!r}.")
        s = dp_scale
        if isinstance(s, bool) or not isinstance(s, (int, float, np.integer, np.floating)):
            raise TypeError(f"Expected dp_scale to be a number, got {s!r}.")
        if not math.isfinite(s) or s < 0:
            raise ValueError(f"Expected dp_scale to be finite and >= 0, got dp_scale={s}.")
        if math.isnan(C) or C <= 0:
            raise ValueError(f"Expected clipping_threshold > 0, got clipping_threshold={C}.")
        if math.isinf(C) and s != 0:
            raise ValueError(
                f"Expected a finite clipping_threshold, got clipping_threshold={C} with "
                f"dp_scale={s}: the noise would be infinite. (C=inf is allowed only with "
                "dp_scale=0, i.e. without privacy.)"
            )
        if gradient_strategy not in gradients.STRATEGIES:
            raise ValueError(
                f"Expected gradient_strategy in {gradients.STRATEGIES}, got "
                f"gradient_strategy={gradient_strategy!r}."
            )
        if chunk_size is not None:
            _check_positive_int("chunk_size", chunk_size)
        if memory_budget_bytes is not None:
            _check_positive_int("memory_budget_bytes", memory_budget_bytes)
        self.clipping_threshold = float(C)
        self.dp_scale = float(s)
        self.rng_suite = rng_suite
        self.clip_unscaled_observations = bool(clip_unscaled_observations)
        self.gradient_strategy = gradient_strategy
        self.chunk_size = chunk_size
        self.memory_budget_bytes = memory_budget_bytes
        # per_example_loss is also available as self.loss (numpyro's name)
        self.per_example_loss = per_example_loss
        # numpyro hands optax transformations the loss value; the loss is not
        # private, so they get a public constant instead (loss-reading
        # transformations such as reduce_on_plateau then never adapt).
        self._optim_value = jnp.zeros(()) if getattr(self.optim, "update_with_value", False) else None
        # the public observation scale per record structure (_observation_scale)
        self._public_scales = {}

    # ---------------------------------------------------------------- helpers

    def _observation_scale(self, params, treedef, leaves) -> Optional[float]:
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
        one_record = tuple(
            jax.ShapeDtypeStruct(np.shape(x)[1:], jax.dtypes.canonicalize_dtype(x.dtype)) for x in leaves
        )
        param_structs = jax.tree.map(lambda p: jax.ShapeDtypeStruct(jnp.shape(p), jnp.result_type(p)), params)
        key = (
            treedef,
            one_record,
            jax.tree.structure(param_structs),
            tuple(jax.tree.leaves(param_structs)),
            self.clip_unscaled_observations,
        )
        if key not in self._public_scales:
            self._public_scales[key] = self._find_observation_scale(param_structs, treedef, one_record)
        return self._public_scales[key]

    def _find_observation_scale(self, param_structs, treedef, one_record) -> Optional[float]:
        """See :meth:`_observation_scale`: traces ``(params, key, record) ->
        scales of the observed sites`` and checks that they depend on none of
        the three before evaluating them."""
        observed_names = []

        def observation_scales(params, rng_key, leaves):
            args, kwargs = jax.tree.unflatten(treedef, [jnp.expand_dims(x, 0) for x in leaves])
            model = seed(substitute(self.model, data=self.constrain_fn(params)), rng_key)
            tr = trace(model).get_trace(*args, **kwargs, **self.static_kwargs)
            for site in tr.values():
                if site["type"] == "mutable":
                    raise ValueError(
                        f"The model has mutable state (site {site['name']!r}). DP-VI cannot "
                        "support it: mutable state is updated from the un-noised data and "
                        "would leak it without any privacy guarantee."
                    )
            observed = [s for s in tr.values() if s["type"] == "sample" and s["is_observed"]]
            if not observed:
                raise ValueError(
                    "The model has no observed sample sites. DP-VI needs the data to enter the "
                    "model through observed sites under a plate over the records."
                )
            unscaled = [s["name"] for s in observed if s["scale"] is None]
            if unscaled:
                raise ValueError(
                    f"The observed site(s) {unscaled} are not under a subsampling plate. DP-VI "
                    "clips each record's contribution and rescales the sum to the full data set, "
                    "so the model must declare its records with e.g. "
                    "`with numpyro.plate('data', N, subsample_size=xs.shape[0]):` so that a "
                    "batch's likelihood is scaled by N / batch size."
                )
            observed_names[:] = [s["name"] for s in observed]
            return [jnp.asarray(s["scale"]) for s in observed]

        abstract_key = jax.eval_shape(jax.random.PRNGKey, 0)
        closed = jax.make_jaxpr(observation_scales)(param_structs, abstract_key, list(one_record))
        if not self.clip_unscaled_observations:
            return None
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
        values = [np.asarray(v) for v in values]
        if any(v.shape != () for v in values) or any(not np.allclose(v, values[0]) for v in values):
            raise ValueError(
                f"The observed sites {observed_names} have different or non-scalar scales "
                f"{[v.tolist() for v in values]}. DP-VI needs all observations of a record "
                "under one plate over the records."
            )
        scale = float(values[0])
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(
                f"Expected the likelihood scale of the observed site(s) {observed_names} to be "
                f"finite and > 0, got {scale}."
            )
        return scale

    def _record_loss_fn(self, treedef, scale, key_impl=None):
        """loss(params, record) of one record, ``record = (jax_key, leaves)``,
        divided by the public constant ``scale`` unless it is None; with
        ``key_impl``, ``jax_key`` is raw key data of that implementation."""

        def record_loss(params, record):
            key, leaves = record
            if key_impl is not None:
                key = jax.random.wrap_key_data(key, impl=key_impl)
            args, kwargs = jax.tree.unflatten(treedef, [jnp.expand_dims(x, 0) for x in leaves])
            loss = self.loss.loss(
                key, self.constrain_fn(params), self.model, self.guide, *args, **kwargs, **self.static_kwargs
            )
            return loss if scale is None else loss / scale

        return record_loss

    def _check_state(self, svi_state):
        if not isinstance(svi_state, DPSVIState):
            raise TypeError(
                f"Expected svi_state to be a DPSVIState (from DPSVI.init), got {type(svi_state).__name__}."
            )

    # ------------------------------------------------------------------ API

    def init(self, rng_key, *args, init_params=None, **kwargs) -> DPSVIState:
        """Gets the initial :class:`DPSVIState`.

        The model and guide are run on the batch to find the parameters and
        their shapes, so the batch needs at least one record (a batch of zero
        rows raises ``ValueError``). Models DP-VI cannot make private are
        refused here, with a ``ValueError`` that says why (see :class:`DPSVI`).

        :param rng_key: a key of the PRNG suite (``d3p.random.PRNGKey(...)``).
        :param args: a batch of per-record data, as for :meth:`update`.
        :param dict init_params: if not None, initial values of param sites.
        :param kwargs: per-record keyword data for model and guide, as for
            :meth:`update`.
        :return: the initial state.
        """
        records, treedef, size = _records(args, kwargs)
        if size == 0:
            raise ValueError(
                "Expected at least one record in the batch given to init, got 0 rows: init "
                "runs the model and guide on the batch to find the parameters."
            )
        args, kwargs = jax.tree.unflatten(treedef, records)
        rng_key, init_key = self.rng_suite.split(rng_key, 2)
        jax_init_key = self.rng_suite.convert_to_jax_rng_key(init_key)
        state = super().init(jax_init_key, *args, init_params=init_params, **kwargs)
        if state.mutable_state is not None:
            raise ValueError(
                f"The model or guide has mutable state ({sorted(state.mutable_state)}). DP-VI "
                "cannot support it: mutable state is updated from the un-noised data and would "
                "leak it without any privacy guarantee."
            )
        # the model's structure and its public scale, now, for a clear early error
        self._observation_scale(self.optim.get_params(state.optim_state), treedef, records)
        return DPSVIState(state.optim_state, None, rng_key)

    def _noisy_gradient(self, svi_state, args, kwargs, mask, expected_batch_size, forward_mode):
        self._check_state(svi_state)
        rng_key, grad_key, noise_key = self.rng_suite.split(svi_state.rng_key, 3)
        records, treedef, B = _records(args, kwargs)
        if mask is not None:
            mask = jnp.asarray(mask)
            if mask.shape == () and mask.dtype == jnp.bool_:
                mask = jnp.broadcast_to(mask, (B,))   # d3p 0.2: one flag for the whole batch
            if mask.shape != (B,) or mask.dtype != jnp.bool_:
                raise ValueError(
                    f"Expected mask to be a boolean array of shape ({B},) (True for real "
                    f"records) or one boolean for the whole batch, got dtype {mask.dtype} and "
                    f"shape {mask.shape}."
                )
        if expected_batch_size is None:
            if B == 0:
                raise ValueError(
                    "Expected expected_batch_size for a batch of 0 records, got None: the "
                    "noisy sum is normalised by the public batch size (e.g. q * N under "
                    "Poisson sampling), never by the realised count."
                )
            expected_batch_size = B
        elif not isinstance(expected_batch_size, jax.core.Tracer):
            if not (float(expected_batch_size) > 0):
                raise ValueError(
                    f"Expected expected_batch_size > 0, got expected_batch_size={expected_batch_size}."
                )

        jax_key = self.rng_suite.convert_to_jax_rng_key(grad_key)
        # the Monte Carlo keys of the records: as jax.random.split(jax_key, B),
        # computed without Threefry's rolled loops (see d3p.random._threefry)
        record_keys = jax.random.split(_threefry.fast_key(jax_key), max(B, 1))[:B]
        key_impl = None
        if jnp.issubdtype(record_keys.dtype, jax.dtypes.prng_key):
            # carried as raw data, which the strategies can pad and chunk
            key_impl = jax.random.key_impl(record_keys)
            record_keys = jax.random.key_data(record_keys)
        params = self.optim.get_params(svi_state.optim_state)
        # a public constant (None without clip_unscaled_observations): see _observation_scale
        scale = self._observation_scale(params, treedef, records)
        loss_fn = self._record_loss_fn(treedef, scale, key_impl)
        result = clipped_grad_sum(
            loss_fn,
            params,
            (record_keys, list(records)),
            mask,
            self.clipping_threshold,
            strategy=self.gradient_strategy,
            chunk_size=self.chunk_size,
            forward_mode=forward_mode,
            memory_budget_bytes=self.memory_budget_bytes,
        )
        noisy_sum = add_gaussian_noise(
            result.grad_sum, noise_key, self.dp_scale, self.clipping_threshold, self.rng_suite
        )
        # the public normalisation: N / B when the per-record losses were divided
        # by the observation scale (N, the scale of a batch of one), else 1 / B
        factor = (1.0 if scale is None else scale) / expected_batch_size
        grad = jax.tree.map(lambda g: g * jnp.asarray(factor, g.dtype), noisy_sum)
        loss = jnp.sum(result.losses) * factor
        return rng_key, grad, loss

    def update(
        self,
        svi_state: DPSVIState,
        *args,
        mask: Optional[jax.Array] = None,
        expected_batch_size: Optional[float] = None,
        forward_mode_differentiation: bool = False,
        **kwargs,
    ):
        """Take one DP-VI step on a batch.

        **Formal guarantees.** Every argument in ``args`` and ``kwargs`` is
        per-record data: each array in them (pytrees of arrays allowed) must
        have the batch's leading dimension ``B``, and record ``i`` sees only
        row ``i`` of each, so one record moves the released sum by at most
        ``C`` (``2 C`` substituted), as in :class:`DPSVI`. Nothing is treated
        as shared by guessing: scalars, 0-d arrays, strings and other objects
        are refused with an error naming the argument; values shared by all
        records go to the constructor (``DPSVI(..., **static_kwargs)``). The
        released gradient is the noisy sum times a public constant: the
        model's likelihood scale of one record (the plate's ``N``, see
        :class:`DPSVI`) over ``expected_batch_size``, never read from a
        record. A batch with no real record (all masked, or ``B = 0`` with
        ``expected_batch_size`` given) yields exactly that constant times pure
        noise, finite.

        :param DPSVIState svi_state: current state.
        :param args: the batch: arrays with one row per record (leading
            dimension ``B``, real and padded records). Lists or tuples of
            numbers and pandas objects are converted with ``np.asarray``, rows
            as records; non-numeric data raise ``TypeError``. The caller's
            data is never modified.
        :param mask: optional boolean array ``(B,)`` (or one boolean for the
            whole batch, as d3p 0.2 accepted), True for real records
            (e.g. from :func:`d3p.minibatch.poisson_batchify_data`).
        :param expected_batch_size: the public constant by which the noisy sum
            is normalised; default ``B`` (right for fixed-size batches; required
            when ``B = 0``). Under Poisson sampling pass ``q * N``; never the
            realised count.
        :param bool forward_mode_differentiation: as in NumPyro.
        :param kwargs: per-record keyword data for model and guide, as ``args``.
        :return: ``(svi_state, loss)``; ``loss`` is the minibatch ELBO estimate
            computed from the un-noised data and is NOT private.
        """
        rng_key, grad, loss = self._noisy_gradient(
            svi_state, args, kwargs, mask, expected_batch_size, forward_mode_differentiation
        )
        optim_state = self.optim.update(grad, svi_state.optim_state, value=self._optim_value)
        return DPSVIState(optim_state, None, rng_key), loss

    def stable_update(
        self,
        svi_state: DPSVIState,
        *args,
        mask: Optional[jax.Array] = None,
        expected_batch_size: Optional[float] = None,
        forward_mode_differentiation: bool = False,
        **kwargs,
    ):
        """Like :meth:`update`, but keeps the parameters when the step is not finite.

        The decision looks only at the noisy gradient and the resulting
        optimizer state (post-processing of the private release), never at the
        un-noised loss, so skipping leaks nothing. The key advances either way.
        Arguments, data rules and guarantees as for :meth:`update`.

        :return: ``(svi_state, loss)``; ``loss`` is ``nan`` for a skipped step
            and is NOT private.
        """
        rng_key, grad, loss = self._noisy_gradient(
            svi_state, args, kwargs, mask, expected_batch_size, forward_mode_differentiation
        )
        new_optim_state = self.optim.update(grad, svi_state.optim_state, value=self._optim_value)
        flat_grad = jax.flatten_util.ravel_pytree(grad)[0]
        ok = jnp.all(jnp.isfinite(flat_grad)) & jnp.all(
            jnp.asarray([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(new_optim_state)
                         if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)] or [True])
        )
        optim_state = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_optim_state, svi_state.optim_state)
        loss = jnp.where(ok, loss, jnp.nan)
        return DPSVIState(optim_state, None, rng_key), loss

    def evaluate(self, svi_state: DPSVIState, *args, **kwargs):
        """The ELBO loss on the given data at the current parameters.

        NOT private: it is computed from the un-noised data.

        :param DPSVIState svi_state: current state.
        :param args: per-record data, as for :meth:`update` (lists, tuples of
            numbers and pandas objects converted, scalars refused).
        :param kwargs: per-record keyword data, as for :meth:`update`.
        """
        self._check_state(svi_state)
        records, treedef, _ = _records(args, kwargs)
        args, kwargs = jax.tree.unflatten(treedef, records)
        _, eval_key = self.rng_suite.split(svi_state.rng_key, 2)
        params = self.get_params(svi_state)
        return self.loss.loss(
            self.rng_suite.convert_to_jax_rng_key(eval_key),
            params,
            self.model,
            self.guide,
            *args,
            **kwargs,
            **self.static_kwargs,
        )

    # ------------------------------------------------------------ accounting

    def get_epsilon(
        self,
        target_delta: float,
        q: float,
        num_epochs: Optional[float] = None,
        num_iter: Optional[int] = None,
        *,
        relation: Optional[str] = None,
        accountant: str = "fourier",
        sampler: Optional[str] = None,
    ) -> float:
        """The ε of a run with this DPSVI's ``dp_scale``.

        :param float target_delta: δ.
        :param float q: sampling probability of each record per step.
        :param num_epochs: length of the run in epochs (``num_iter = num_epochs / q``),
            or give ``num_iter``; exactly one of the two.
        :param int num_iter: number of steps.
        :param str relation: ``"substitute"`` or ``"add_remove"``.
        :param str accountant: ``"fourier"`` (default), ``"rdp"`` or ``"pld"`` (dp-accounting).
        :param str sampler: the sampler that drew the batches: ``"poisson"``
            (:func:`d3p.minibatch.poisson_batchify_data`) or ``"fixed_size"``
            (:func:`d3p.minibatch.subsample_batchify_data`). With neither
            ``sampler`` nor ``relation`` given, fixed-size batches under the
            substitute relation are assumed (d3p 0.2's meaning, and the most
            conservative of the supported accountings); otherwise resolved by
            :func:`d3p.accounting.accounting_for`. Poisson-sampled runs pass
            ``sampler="poisson"`` (add/remove) for their smaller ε.
        """
        steps = _num_steps(q, num_epochs, num_iter)
        return _method_accounting(sampler, relation).epsilon(
            self.dp_scale, q, steps, target_delta, accountant=accountant
        )

    def get_delta(
        self,
        target_epsilon: float,
        q: float,
        num_epochs: Optional[float] = None,
        num_iter: Optional[int] = None,
        *,
        relation: Optional[str] = None,
        accountant: str = "fourier",
        sampler: Optional[str] = None,
    ) -> float:
        """The δ of a run with this DPSVI's ``dp_scale`` at the given ε.

        Arguments as for :meth:`get_epsilon`, with ``target_epsilon`` for δ.
        """
        steps = _num_steps(q, num_epochs, num_iter)
        return _method_accounting(sampler, relation).delta(
            self.dp_scale, q, steps, target_epsilon, accountant=accountant
        )

    # ------------------------------------------------------------------ run

    def run(
        self,
        rng_key,
        num_steps: int,
        *args,
        batch_size: Optional[int] = None,
        q: Optional[float] = None,
        sampling: str = "poisson",
        max_batch_size: Optional[int] = None,
        target_delta: Optional[float] = None,
        accountant: str = "fourier",
        relation: Optional[str] = None,
        progress_bar: bool = True,
        stable_update: bool = False,
        forward_mode_differentiation: bool = False,
        init_state: Optional[DPSVIState] = None,
        init_params: Optional[dict] = None,
        **kwargs,
    ) -> DPSVIRunResult:
        """Run ``num_steps`` DP-VI steps, each on a fresh random batch of the data.

        Unlike :meth:`numpyro.infer.SVI.run`, which uses the data it is given
        at every step, this draws a new minibatch from the full data for every
        step, with the sampler the privacy accounting assumes:

        - ``sampling="poisson"`` (default): each record independently with
          probability ``q`` (or ``batch_size / N``), padded to ``max_batch_size``
          with a mask (:class:`d3p.minibatch.PoissonSampler`); relation
          add/remove by default, or substitute.
        - ``sampling="fixed"``: ``batch_size`` distinct records, uniformly
          (:class:`d3p.minibatch.FixedSizeSampler`, exactly uniform); relation
          substitute, accounted with the add/remove pair at noise multiplier
          σ/2, which dominates it (see :func:`d3p.accounting.accounting_for`);
          it needs about twice the noise of Poisson sampling for the same ε.

        The noisy sum is normalised by the sampler's public expected batch
        size. The ε spent is computed by :func:`d3p.accounting.accounting_for`
        for the sampler actually used (no other accounting can be chosen
        here), shown in the progress bar (an upper bound, updated along the
        way) and attached to the result.

        :param rng_key: a key of the PRNG suite (``d3p.random.PRNGKey()``).
        :param int num_steps: number of steps, ``>= 1``.
        :param args: the FULL data set: arrays with one row per record (``N`` rows).
        :param int batch_size: B: the batch size (fixed sampling) or the
            expected batch size (Poisson sampling, ``q = B / N``); or give ``q``.
        :param float q: sampling probability; ``batch_size = round(q N)`` for fixed
            sampling.
        :param str sampling: ``"poisson"`` (default) or ``"fixed"``.
        :param int max_batch_size: padded batch size for Poisson sampling (default:
            overflow probability negligible, see :class:`d3p.minibatch.PoissonSampler`).
        :param float target_delta: δ for reporting ε; default ``1 / N**2``.
        :param str accountant: ``"fourier"``, ``"rdp"`` or ``"pld"``.
        :param str relation: the relation of the reported guarantee:
            ``"add_remove"`` (default for Poisson sampling) or ``"substitute"``
            (Poisson or fixed-size; the only one for fixed-size).
        :param bool progress_bar: show a tqdm bar (loss and ε), advanced
            after each compiled chunk of about 5% of the steps (at most 1000);
            without it all steps run in one ``lax.scan``. The result is the
            same either way.
        :param bool stable_update: use :meth:`stable_update`.
        :param bool forward_mode_differentiation: as in NumPyro.
        :param DPSVIState init_state: continue from this state (its privacy
            spending is not included in the reported ε).
        :param dict init_params: initial values of param sites.
        :param kwargs: per-record keyword data (``N`` rows each).
        :return: :class:`DPSVIRunResult` ``(params, state, losses)`` with
            attributes ``epsilon``, ``delta``, ``relation``, ``sampler``, ``sigma``, ``q``,
            ``num_steps``. The losses are NOT private.
        """
        from d3p import accounting, minibatch

        num_steps = _check_positive_int("num_steps", num_steps)
        records, rebuild, N, per_record = _split_records(args, kwargs, what="data")
        if N < 1:
            raise ValueError("Expected a non-empty data set, got 0 records.")
        if sampling not in ("poisson", "fixed"):
            raise ValueError(f"Expected sampling in ('poisson', 'fixed'), got sampling={sampling!r}.")
        if (batch_size is None) == (q is None):
            raise ValueError(
                f"Expected exactly one of batch_size and q for sampling={sampling!r}, got "
                f"batch_size={batch_size}, q={q}. (For full-batch training pass batch_size=N.)"
            )
        if sampling == "fixed":
            if batch_size is None:
                batch_size = minibatch.q_to_batch_size(q, N)
            if max_batch_size is not None:
                raise ValueError("max_batch_size applies only to sampling='poisson'.")
            sampler = minibatch.FixedSizeSampler(N, batch_size)
        else:
            if q is None:
                q = minibatch.batch_size_to_q(batch_size, N)
            sampler = minibatch.PoissonSampler(N, q, max_batch_size)
        acc = accounting.accounting_for(sampler.name, relation)
        if target_delta is None:
            target_delta = 1.0 / N**2
        tracker = acc.tracker(self.dp_scale, sampler.q, target_delta, num_steps=num_steps,
                              accountant=accountant)

        init_key, batch_key = self.rng_suite.split(rng_key, 2)
        rng_suite = self.rng_suite
        expected = sampler.expected_batch_size
        update = self.stable_update if stable_update else self.update

        def gather(data, i):
            indices, mask = sampler.sample(rng_suite.fold_in(batch_key, i), rng_suite)
            batch = [jnp.take(x, indices, axis=0) if p else None for x, p in zip(data, per_record)]
            a, k = rebuild(batch)
            return a, k, mask

        if init_state is None:
            a, k, _ = gather(records, 0)
            svi_state = self.init(init_key, *a, init_params=init_params, **k)
        else:
            self._check_state(init_state)
            svi_state = init_state

        def body_fn(svi_state, i, data):
            a, k, mask = gather(data, i)
            return update(
                svi_state,
                *a,
                mask=mask,
                expected_batch_size=expected,
                forward_mode_differentiation=forward_mode_differentiation,
                **k,
            )

        @functools.partial(jax.jit, static_argnums=3)
        def run_chunk(svi_state, start, data, length):
            steps = start + jnp.arange(length, dtype=jnp.uint32)
            return lax.scan(lambda s, i: body_fn(s, i, data), svi_state, steps)

        if progress_bar:
            # Steps run in compiled chunks of about 5% of the run (lax.scan, as
            # without the bar; at most two chunk lengths are compiled), the bar
            # advancing after each: one Python dispatch per step would cost
            # more than a small model's step.
            chunk = min(max(-(-num_steps // 20), 1), _MAX_BAR_CHUNK)
            losses = []
            done = 0
            with tqdm.tqdm(total=num_steps) as t:
                while done < num_steps:
                    length = min(chunk, num_steps - done)
                    svi_state, chunk_losses = run_chunk(svi_state, jnp.uint32(done), records, length)
                    losses.append(chunk_losses)
                    done += length
                    recent = np.asarray(jax.device_get(chunk_losses))
                    recent = recent[recent == recent]
                    avg = float(recent.mean()) if recent.size else float("nan")
                    t.set_postfix_str(
                        f"avg. loss: {avg:.4g}, ε ≤ {tracker.epsilon(done):.3g} (δ={target_delta:.2g})",
                        refresh=False,
                    )
                    t.update(length)
            losses = jnp.concatenate(losses)
        else:
            svi_state, losses = run_chunk(svi_state, jnp.uint32(0), records, num_steps)

        result = DPSVIRunResult(self.get_params(svi_state), svi_state, losses)
        result.epsilon = tracker.epsilon(num_steps)
        # a Poisson batch larger than max_batch_size is truncated: that event's
        # probability adds to δ
        result.delta = min(1.0, target_delta + acc.overflow_delta(
            N, sampler.q, sampler.max_batch_size, num_steps, result.epsilon))
        result.relation = acc.relation
        result.sampler = acc.sampler
        result.sigma = self.dp_scale
        result.q = sampler.q
        result.num_steps = num_steps
        return result


#: Most steps run between two updates of ``run``'s progress bar.
_MAX_BAR_CHUNK = 1000


def _method_accounting(sampler, relation):
    """The accounting of :meth:`DPSVI.get_epsilon`/:meth:`DPSVI.get_delta`:
    with neither argument, fixed-size batches under substitute (d3p 0.2's
    meaning, and the most conservative accounting)."""
    from d3p import accounting

    if sampler is None and relation is None:
        sampler = "fixed_size"
    return accounting.accounting_for(sampler, relation)


def _num_steps(q, num_epochs, num_iter) -> int:
    if (num_epochs is None) == (num_iter is None):
        raise ValueError(
            f"Expected exactly one of num_epochs and num_iter, got num_epochs={num_epochs}, "
            f"num_iter={num_iter}."
        )
    if num_iter is not None:
        return _check_positive_int("num_iter", num_iter)
    if not (float(num_epochs) > 0):
        raise ValueError(f"Expected num_epochs > 0, got num_epochs={num_epochs}.")
    if not (0 < float(q) <= 1):
        raise ValueError(f"Expected q in (0, 1], got q={q}.")
    return max(1, int(math.ceil(float(num_epochs) / float(q))))
