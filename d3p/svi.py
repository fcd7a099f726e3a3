"""Differentially private stochastic variational inference (DP-VI) for NumPyro.

:class:`DPSVI` is a drop-in replacement for :class:`numpyro.infer.SVI`: the
same constructor arguments (plus the clipping threshold and the noise
multiplier), the same methods and states, and parameters that work with
``numpyro.infer.Predictive`` as after SVI.

The module also keeps d3p 0.2's helpers on lists of gradient parts
(:func:`full_norm`, :func:`clip_gradient`, :func:`normalize_gradient`) and
:func:`get_observations_scale`; they accept any pytree as well.
"""

import contextlib
import dataclasses
import functools
import math
import warnings
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from numpyro.handlers import seed, substitute, trace
from numpyro.infer.svi import SVI
from numpyro.primitives import Messenger
from numpyro.optim import Minimize

import d3p.random
from d3p import _adaptive, _sampling, _sharding, _validate, accounting, discrete, gradients
from d3p._adaptive import AdaptiveClipping
from d3p import _elbo_terms
from d3p._checkpoint import Checkpoint
from d3p.ledger import GaussianSteps, PrivacyLedger, key_fingerprint
from d3p.gradients import add_gaussian_noise, clipped_grad_sum
from d3p.random import _threefry

from d3p._gradient_lists import (  # noqa: F401 (public, see __all__)
    _common_scale,
    _public_number,
    clip_gradient,
    full_norm,
    get_observations_scale,
    normalize_gradient,
)
from d3p._public_init import placeholder_dependent_params, public_guide_setup, public_records
from d3p._records import _depends_on_inputs, _evaluate_constant_outputs, _records
from d3p._run import _require_batches, _run_with_progress_bar, _RunCache, _RunPlan

__all__ = [
    "DPSVI",
    "DPSVIState",
    "DPSVIRunResult",
    "AdaptiveClipping",
    "Checkpoint",
    "save_checkpoint",
    "load_checkpoint",
    "full_norm",
    "clip_gradient",
    "normalize_gradient",
    "get_observations_scale",
]


class DPSVIState(NamedTuple):
    """State of :class:`DPSVI`, a pytree.

    - **optim_state** - the optimizer's state (holds the unconstrained
      variational parameters); as in :data:`numpyro.infer.svi.SVIState`.
    - **mutable_state** - always ``None``: DP-VI does not support mutable
      state (see :class:`DPSVI`).
    - **rng_key** - the key of the PRNG suite (``d3p.random`` by default) from
      which the next step draws its privacy noise and Monte Carlo samples.
    - **observation_scale** - the likelihood scale of ONE record, as d3p
      0.2's state held it: the model's scale of its observed sites on a batch
      of one record (the plate's ``N / 1``, times constant
      ``numpyro.handlers.scale`` factors), the public constant by which DPSVI
      divides each record's loss before clipping. It does not depend on the
      batch's length (the likelihood scale of a batch of ``B`` records is
      this over ``B``). It is a 0-d array of JAX's default float dtype, so the
      state keeps its pytree structure and dtypes as a
      ``lax.scan``/``fori_loop``/``while_loop`` carry; it is set by
      :meth:`DPSVI.init` and again by every update (for the records' structure
      at hand), from shapes and public constants only, never from data values.
      With ``clip_unscaled_observations=False`` DPSVI neither reads nor
      applies the model's scale (it is not checked to be public) and the
      field is 1.0. Defaults to ``None`` so that a state can be built from the
      first three fields; ``update`` keeps ``None`` in such a state (its
      structure stays the same).
    - **clipping_threshold** - with adaptive clipping (:class:`AdaptiveClipping`),
      the threshold ``C_t`` of the next step: a 0-d array of JAX's default
      float dtype, set to the initial ``C`` by :meth:`DPSVI.init` and by every
      update from the noisy count it releases (public: post-processing of a
      private release); saved with checkpoints. ``None`` without adaptive
      clipping (the constructor's ``C`` is used).
    """

    optim_state: Any
    mutable_state: Any
    rng_key: Any
    observation_scale: Any = None
    clipping_threshold: Any = None


_PRIVACY_FIELD = functools.partial(dataclasses.field, default=None, kw_only=True)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["params", "state", "losses"],
    meta_fields=["epsilon", "delta", "relation", "sampler", "sigma", "q", "num_steps", "start_step"],
)
@dataclasses.dataclass(eq=False)
class DPSVIRunResult:
    """The result of :meth:`DPSVI.run`: ``(params, state, losses)`` as NumPyro's
    :data:`~numpyro.infer.svi.SVIRunResult`, with the privacy spent.

    It behaves as that three-tuple (``params, state, losses = result``,
    ``result[0]``, ``len(result) == 3``, iteration) without being a tuple:
    the privacy figures are declared fields beside the three, keyword-only
    when constructing it. It is a pytree whose leaves are those of ``params``,
    ``state`` and ``losses``; the privacy figures are static metadata. It is
    not an instance of ``SVIRunResult`` (a ``NamedTuple`` cannot hold further
    fields without changing its length).

    - **params** - the constrained parameters (:meth:`DPSVI.get_params` of ``state``).
    - **state** - the final :class:`DPSVIState`.
    - **losses** - the loss of every step; NOT private.
    - **epsilon** - ε of the run at ``delta``, for its sampler and relation.
    - **delta** - δ of the guarantee: the target δ plus, under Poisson
      sampling, the probability that a batch overflowed its padded size.
    - **relation** - ``"add_remove"`` or ``"substitute"``.
    - **sampler** - ``"poisson"`` or ``"fixed_size"``.
    - **sigma** - the noise multiplier the run is accounted with: ``dp_scale``,
      or with adaptive clipping ``σ_eff`` of the gradient and count releases
      together (the gradient's own multiplier is
      :meth:`AdaptiveClipping.gradient_sigma` of it and the count noise).
    - **q** - the sampling probability of each record per step.
    - **num_steps** - the number of steps (ε covers these steps only; a
      :class:`d3p.ledger.PrivacyLedger` given to ``run`` holds the total).
    - **start_step** - the index of the run's first step in the stream of
      batch keys (see ``run``'s ``start_step``); ``start_step + num_steps`` is
      where a continued run starts.
    """

    params: Any
    state: Any
    losses: Any
    epsilon: Optional[float] = _PRIVACY_FIELD()
    delta: Optional[float] = _PRIVACY_FIELD()
    relation: Optional[str] = _PRIVACY_FIELD()
    sampler: Optional[str] = _PRIVACY_FIELD()
    sigma: Optional[float] = _PRIVACY_FIELD()
    q: Optional[float] = _PRIVACY_FIELD()
    num_steps: Optional[int] = _PRIVACY_FIELD()
    start_step: Optional[int] = _PRIVACY_FIELD()

    def _triple(self) -> tuple:
        return (self.params, self.state, self.losses)

    def __iter__(self):
        return iter(self._triple())

    def __len__(self) -> int:
        return 3

    def __getitem__(self, index):
        return self._triple()[index]


def _privacy_settings(clipping_threshold, dp_scale):
    """``(C, sigma)`` as floats: ``C > 0`` and ``sigma >= 0`` finite, except
    ``C = inf`` together with ``sigma = 0`` (no privacy, for testing)."""
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


def _noise_setting(noise, dp_scale: float, clipping_threshold: float, strategy: str) -> str:
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


def _optional_count(name, value) -> Optional[int]:
    """``None``, or an integer ``>= 1``."""
    return None if value is None else _validate.integer(name, value, minimum=1)


def _state_scale(record_scale: Optional[float]) -> jax.Array:
    """:attr:`DPSVIState.observation_scale` for the public one-record scale
    ``record_scale`` (``None``, without ``clip_unscaled_observations``: 1.0)."""
    value = 1.0 if record_scale is None else record_scale
    return jnp.asarray(value, dtype=jnp.result_type(float))


def _all_finite(tree) -> jax.Array:
    """Whether every inexact entry of ``tree`` is finite (True for none)."""
    leaves = [jnp.asarray(x) for x in jax.tree.leaves(tree)]
    checks = [jnp.all(jnp.isfinite(x)) for x in leaves if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.asarray(checks or [True]))


def _keep_if_not_finite(old_state, new_state, loss, grad):
    """:meth:`DPSVI.stable_update`'s guard: ``new_state`` if the noisy gradient
    and its optimizer state are finite, else ``new_state`` with the optimizer
    state of ``old_state`` (the key still advances) and a ``nan`` loss."""
    ok = jnp.all(jnp.isfinite(ravel_pytree(grad)[0])) & _all_finite(new_state.optim_state)
    optim_state = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_state.optim_state, old_state.optim_state)
    return new_state._replace(optim_state=optim_state), jnp.where(ok, loss, jnp.nan)


class _BatchSubsample(Messenger):
    """While :meth:`DPSVI.init` runs the model and guide on its batch, a
    subsampling plate's indices are those of the batch, ``0 .. B-1``.

    NumPyro would draw a random subsample of the plate's ``N`` (in ``O(N)``
    time, compiled anew at every eager call: seconds for a large ``N``),
    which DP-VI never uses: the batch is the data given. The site's random key
    is still drawn, so the keys of the other sites are unchanged.
    """

    def process_message(self, msg):
        if msg["type"] == "plate" and msg["value"] is None:
            msg["fn"] = _batch_indices


def _batch_indices(size, subsample_size, rng_key=None):
    return jnp.arange(subsample_size)


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


class DPSVI(SVI):
    """Differentially private stochastic variational inference.

    Drop-in replacement for :class:`numpyro.infer.SVI`. Each step
    (:meth:`update`) computes, for a batch of ``B`` records from a data set of
    ``N``:

    1. the ELBO loss terms of every record alone (the model is run on a batch
       holding only that record, vectorised with ``vmap``, with its own guide
       sample): by default (``formulation``) those of the sites inside the
       records plate (its likelihood and its local latent variables); with
       ``clip_unscaled_observations=True`` divided by the public observation
       scale of one record (the plate's ``N / 1``), so that ``C`` bounds the
       record's own likelihood term whatever ``N`` is;
    2. its gradient over all variational parameters, clipped as one vector to
       L2 norm at most ``C`` (``clipping_threshold``);
    3. the sum over real records of the clipped gradients plus Gaussian noise of
       standard deviation ``dp_scale * C`` in every coordinate, drawn from
       ``rng_suite``;
    4. that noisy sum times ``N / B`` (with ``B`` the batch size, or the public
       ``expected_batch_size`` under Poisson sampling; never the realised count),
       plus the gradient of the data-independent terms (the prior and guide
       densities of the global latent variables, once, from one more guide
       sample): the full-data ELBO gradient estimate; then one optimizer step.

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
    per-record gradients (which are zeroed: a record holding NaN or inf
    contributes zero, as if masked, with no message that would depend on
    it). Record ``i`` sees only row ``i``
    of each data array; nothing in the data is shared between records. The
    prior and guide terms added once per step (``formulation``) are computed
    from the parameters, the step's key and a public placeholder record only,
    after an abstract trace has shown that they cannot read a record's values
    (post-processing of the release). Padded
    records (``mask`` False) contribute exactly zero; an empty batch yields
    pure noise, never ``nan``. The noise scale depends only on ``dp_scale``
    and ``C``, and the normalisation (step 4) only on public constants: the
    model's scale, found from shapes alone, and the batch size or
    ``expected_batch_size``; ``static_kwargs`` and the model's own constants
    are treated as public. With ``adaptive_clipping``, ``C`` is the state's
    ``C_t`` (post-processing of earlier releases) and each step also releases
    a noisy count that one record moves by at most 1/2 (1 substituted): the
    step is then one Gaussian mechanism of noise multiplier ``σ_eff`` (see
    :class:`AdaptiveClipping`). Privacy over a run
    follows from the sampling of batches: use the samplers of
    :mod:`d3p.minibatch` (or :meth:`run`) with the matching accountant
    (:meth:`get_epsilon`). The loss returned by :meth:`update`,
    :meth:`evaluate` and :meth:`run` is computed from the un-noised data and is
    NOT private; so is anything else derived from the data without noise.
    Initialisation (:meth:`init`, and :meth:`run` without ``init_state``)
    reads only public information: the data's shapes and dtypes, the keys,
    ``init_params`` and records declared public (``init_data``); no record
    can change the initial state, make it fail, or be kept in the guide.

    **Formal guarantees on several devices.** With a mesh (``mesh``, or one
    set in context with :func:`jax.set_mesh`), all of the above holds
    unchanged for the whole batch: the batch is drawn whole (by :meth:`run`
    from one key, the same in every process), padded with masked slots to a
    multiple of the number ``D`` of devices along ``batch_axis`` and split by
    position alone, never by data; each device clips its records' gradients
    to the same threshold as on one device (``C (1 - η)``, ``η`` a public
    constant of the dtype, independent of ``D`` and of the batch size); the
    partial sums are gathered and added by the same double-float tree on
    every device, so the error of the whole sum stays within a public bound
    covered by the margin whatever the other records and their order, and
    every device holds the same bits; the noise is drawn once, for that sum,
    from the replicated key, with the same standard deviation
    ``dp_scale * C`` as on one device. The sharded and the one-device step
    therefore both release a sum of sensitivity at most ``C`` (``2 C``
    substituted). Their values are not equal bit for bit: each is within
    about ``u B C`` of the exact sum of its own clipped per-record gradients
    (``2 u B C`` with ``D > 1``; ``u = 2^-24`` in float32), and the
    per-record gradients themselves come from programs compiled for
    different batch shapes and devices, whose rounding can differ; that
    difference is not bounded by this argument (a badly conditioned record's
    gradient can differ by several percent). The parameters and the
    optimizer state are replicated. With ``noise="discrete"`` the partial
    integer sums are added exactly; its floating-point guarantee then also
    needs every device to run the compiled per-record code alike (devices of
    one kind). :meth:`init` and :meth:`run` refuse keys that differ between
    the processes of a multi-process run, and a step traced inside
    ``shard_map`` (where every device would add its own noise) is refused.

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
        (from :func:`d3p.dputil.approximate_sigma`); or None, and ask
        :meth:`run` for an ε instead (``run(..., epsilon=...)`` calibrates σ
        for the run's sampler, relation, noise and number of steps).
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
        :func:`d3p.gradients.clipped_grad_sum`). The strategy chosen at the
        latest trace of a step is the attribute ``strategy_choice`` (a
        :class:`d3p.gradients.StrategyChoice`, None before the first step).
    :param int chunk_size: records per chunk for ``"chunked"`` and ``"ghost"``
        (default: from the memory budget).
    :param int memory_budget_bytes: bytes of per-record gradients (or
        activations) held at once; default
        :data:`d3p.gradients.DEFAULT_MEMORY_BUDGET_BYTES`.
    :param str noise: the privacy noise: ``"gaussian"`` (default), continuous
        Gaussian noise of std ``dp_scale * C`` drawn in floating point, or
        ``"discrete"``, the discrete Gaussian mechanism of :mod:`d3p.discrete`:
        each record's clipped gradient rounded to a public grid, summed exactly
        in integers, plus exactly sampled discrete Gaussian noise, so that the
        guarantee holds for the floating-point program (noise ``(1 + η)``
        times larger, ``η`` = 1%; each record's gradient is formed on its own,
        one record at a time, as by the ``"scan"`` strategy; accounted with
        ``noise="discrete"`` in :mod:`d3p.accounting`, which :meth:`run` does).
    :param mesh: a :class:`jax.sharding.Mesh` over whose devices every batch's
        records are sharded (see "Formal guarantees on several devices");
        default None: the mesh set in context with :func:`jax.set_mesh` when
        a step is traced, if any, else one device. ``memory_budget_bytes``
        and ``chunk_size`` then apply per device.
    :param batch_axis: the name of the mesh axis (or a tuple of names) along
        which records are sharded; default None: all axes of the mesh.
        Parameters and optimizer state are replicated along every axis.
    :param adaptive_clipping: None (default: ``C`` is fixed), True, or an
        :class:`AdaptiveClipping`: ``C`` starts at ``clipping_threshold`` and
        follows a private estimate of a quantile of the per-record gradient
        norms, held in the state (Andrew et al. 2021). ``dp_scale`` is then the
        gradient's noise multiplier (noise std ``dp_scale * C_t``); each step
        also releases a noisy count, and runs are accounted at the effective
        multiplier ``σ_eff`` of both (see :class:`AdaptiveClipping`). Not with
        ``noise="discrete"`` or a mesh (``ValueError``).
    :param str formulation: which ELBO terms each record's clipped gradient
        holds (see docs/privacy.md, "Which terms are clipped"):
        ``"own_sample"``: those of the sites inside the records plate
        (likelihood, local latent variables), each record with its own guide
        draw; the prior and guide terms of the global sites are evaluated once
        per step (one more draw, on a public placeholder record) and their
        gradient is added after the noise; ``"shared_sample"``: the same split
        with one guide draw of the global latent variables per step, shared by
        the batch (as SVI; its posteriors came out 3-14% wider on the paper's
        models, and its speed depends on the model, ``benchmarks/README.md``); ``"per_record"``:
        each record's whole ELBO with its own guide draw, the global terms
        weighted ``1 / N`` (d3p 0.2);
        ``"auto"`` (default): ``"own_sample"`` for numpyro's ``Trace_ELBO`` and
        ``TraceMeanField_ELBO``, else ``"per_record"``, and ``"per_record"``
        with a ``UserWarning`` where a term outside the records plate may read
        a record (an explicit split is then refused). The released sum and its
        sensitivity are the same under all: every record's data-dependent
        gradient is clipped to ``C``. The one a step uses is the attribute
        ``formulation_choice`` once the step is traced.
    :param static_kwargs: keyword arguments passed to model AND guide at every
        call, shared by all records (e.g. ``N``, or group-level data); the only
        place for such values, and treated as public (they are used without
        noise). A model or guide that does not accept them, or that uses data
        values in Python or NumPy code, is refused with a ``TypeError`` that
        names it; see "Common mistakes" in the getting-started guide.

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
        dp_scale: Optional[float] = None,
        rng_suite=d3p.random,
        clip_unscaled_observations: bool = True,
        gradient_strategy: str = "auto",
        chunk_size: Optional[int] = None,
        memory_budget_bytes: Optional[int] = None,
        noise: str = "gaussian",
        mesh: Optional[jax.sharding.Mesh] = None,
        batch_axis=None,
        adaptive_clipping=None,
        formulation: str = "auto",
        **static_kwargs,
    ):
        if isinstance(optim, Minimize) or getattr(optim, "update_with_value", False):
            raise ValueError(
                f"optim={type(optim).__name__} uses the loss value to update, but the loss is "
                "computed from un-noised data and is not private; choose a gradient-based "
                "optimizer such as numpyro.optim.Adam."
            )
        super().__init__(model, guide, optim, per_example_loss, **static_kwargs)
        self.clipping_threshold, self.dp_scale = _privacy_settings(clipping_threshold, dp_scale)
        self.rng_suite = _validate.rng_suite("rng_suite", rng_suite)
        self.clip_unscaled_observations = _validate.boolean(
            "clip_unscaled_observations", clip_unscaled_observations
        )
        self.gradient_strategy = _validate.choice("gradient_strategy", gradient_strategy, gradients.STRATEGIES)
        self.chunk_size = _optional_count("chunk_size", chunk_size)
        self.memory_budget_bytes = _optional_count("memory_budget_bytes", memory_budget_bytes)
        self.noise = _noise_setting(noise, self.dp_scale, self.clipping_threshold, self.gradient_strategy)
        self.mesh = _validate.mesh("mesh", mesh)
        if self.mesh is not None:
            batch_axis = _validate.mesh_axes("batch_axis", batch_axis, self.mesh.axis_names)
        #: The mesh axes over which batches are sharded (None: all axes of the mesh).
        self.batch_axis = batch_axis
        #: The :class:`AdaptiveClipping` settings, bounds filled in (None: ``C`` is fixed).
        self.adaptive_clipping = _adaptive.resolve(adaptive_clipping, self.clipping_threshold, noise=self.noise,
                                                   mesh=self.mesh)
        # the discrete mechanism's public constants per parameter count (see d3p.discrete)
        self._discrete_plans = {}
        # per_example_loss is also available as self.loss (numpyro's name)
        self.per_example_loss = per_example_loss
        # numpyro hands optax transformations the loss value; the loss is not
        # private, so they get a public constant instead (loss-reading
        # transformations such as reduce_on_plateau then never adapt).
        self._optim_value = jnp.zeros(()) if getattr(self.optim, "update_with_value", False) else None
        # the public observation scale and the subsampling plates of the observed
        # sites, per record structure (_model_facts)
        self._public_scales = {}
        # the (sigma, batch size) pairs already warned about (_warn_if_all_noise)
        self._noise_warnings = set()
        # run's compiled steps, reused by later runs (see d3p._run._RunCache)
        self._run_cache = _RunCache()
        #: The :class:`d3p.gradients.StrategyChoice` of the most recent trace of
        #: this DPSVI's step (None before the first): which gradient strategy runs.
        self.strategy_choice = None
        #: The ``formulation`` asked for; the one the latest trace of a step
        #: used (``"auto"`` resolved) is ``formulation_choice`` (None before).
        self.formulation = _elbo_terms.requested(
            _validate.choice("formulation", formulation, _elbo_terms.FORMULATIONS), per_example_loss)
        self.formulation_choice = None
        # the split of the ELBO's sites per record structure (_split_facts)
        self._split_facts_cache = {}

    # ---------------------------------------------------------------- helpers

    def _record_choice(self, choice) -> None:
        self.strategy_choice = choice

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
        return self._model_facts(params, treedef, leaves)[0]

    def _records_plates(self, params, treedef, leaves) -> dict:
        """The subsampling plates of the model's observed sites, name -> the
        declared size (``N``), for records shaped like ``leaves``: public,
        from the same trace of shapes as :meth:`_observation_scale`."""
        return self._model_facts(params, treedef, leaves)[1]

    def _model_facts(self, params, treedef, leaves) -> tuple:
        """``(observation scale, subsampling plates)``: see :meth:`_observation_scale`
        and :meth:`_records_plates`; found once per record structure and
        parameter shapes."""
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
            plates = {}
            scale = self._find_observation_scale(param_structs, treedef, one_record, plates)
            self._public_scales[key] = (scale, plates)
        return self._public_scales[key]

    def _find_observation_scale(self, param_structs, treedef, one_record, plates) -> Optional[float]:
        """See :meth:`_observation_scale`: traces ``(params, key, record) ->
        scales of the observed sites`` and checks that they depend on none of
        the three before evaluating them. Fills ``plates`` with the
        subsampling plates of the observed sites (see :func:`_subsampling_plates`)."""
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
            plates.update(_subsampling_plates(tr, observed))
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
        scale = _common_scale(observed_names, values)
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

    def _step_losses(self, params, treedef, leaves, scale, key_impl, jax_key):
        """``(record_loss, global_loss, shared)`` of a step under the resolved
        ``formulation``: the loss of one record (clipped); the loss of the
        data-independent sites, evaluated once per step (None under
        ``"per_record"`` or without such sites); and the key of the draw
        shared by the batch (None under ``"per_record"``), from which
        ``record_loss(shared)`` is the loss of one record."""
        formulation, facts = self._split_facts(params, treedef, leaves)
        self.formulation_choice = formulation
        if formulation == "per_record":
            return self._record_loss_fn(treedef, scale, key_impl), None, None
        plates = self._records_plates(params, treedef, leaves)
        # one key per step for the draw shared by the batch: from the step's
        # Monte Carlo key, never from data (fold_in tag: "shared")
        shared = jax.random.fold_in(_threefry.fast_key(jax_key), 0x5348)

        def record_loss(shared_key):
            return _elbo_terms.record_loss_fn(self, formulation, facts, plates, treedef, scale, key_impl,
                                              shared_key)

        if not facts.global_sites:
            return record_loss, None, shared
        one_record = [jax.ShapeDtypeStruct(np.shape(x)[1:], jax.dtypes.canonicalize_dtype(x.dtype))
                      for x in leaves]
        return record_loss, _elbo_terms.global_loss_fn(self, facts, plates, treedef, one_record, shared), shared

    def _split_facts(self, params, treedef, leaves) -> tuple:
        """``(formulation, SplitFacts or None)``: ``formulation`` resolved for
        records shaped like ``leaves`` (public: from an abstract trace of one
        record, found once per record structure and parameter shapes).

        ``"auto"`` is ``"own_sample"`` for NumPyro's ``Trace_ELBO`` and
        ``TraceMeanField_ELBO``, else ``"per_record"``; and ``"per_record"``,
        with a warning, where a term outside the records plate may read the
        record, which an explicit split formulation refuses."""
        one_record = tuple(
            jax.ShapeDtypeStruct(np.shape(x)[1:], jax.dtypes.canonicalize_dtype(x.dtype)) for x in leaves)
        param_structs = jax.tree.map(lambda p: jax.ShapeDtypeStruct(jnp.shape(p), jnp.result_type(p)), params)
        key = (treedef, one_record, jax.tree.structure(param_structs), tuple(jax.tree.leaves(param_structs)))
        if key in self._split_facts_cache:
            return self._split_facts_cache[key]
        formulation = self.formulation
        if formulation == "auto":
            formulation = "own_sample" if _elbo_terms.splittable(self.loss) else "per_record"
        facts = None
        if formulation != "per_record":
            plates = self._records_plates(params, treedef, leaves)
            facts = _elbo_terms.split_facts(self.loss, self.model, self.guide, self.constrain_fn,
                                            self.static_kwargs, param_structs, treedef, one_record, plates)
            if facts.dependent:
                message = (
                    f"The terms of the site(s) {list(facts.dependent)}, outside the plate over the records "
                    f"({sorted(plates)}), may depend on a record's values, so they cannot be evaluated once per "
                    "step outside the clipped sum")
                if self.formulation != "auto":
                    raise ValueError(f"{message}: expected formulation='per_record' for this model, got "
                                     f"formulation={self.formulation!r}.")
                warnings.warn(f"{message}; DPSVI clips each record's whole ELBO (formulation='per_record').",
                              UserWarning, stacklevel=6)
                formulation, facts = "per_record", None
        self._split_facts_cache[key] = (formulation, facts)
        return formulation, facts

    @contextlib.contextmanager
    def _model_errors_explained(self, args, kwargs):
        """While active, a ``TypeError`` raised by running the model or guide on
        the data ``(args, kwargs)`` that is a known mistake (arguments they do
        not accept, data values used in Python or NumPy code) is raised again
        as a :class:`d3p._validate.ModelCodeError` that says what to change,
        with the original as its ``__cause__``. Reads the signatures and the
        number and names of the arguments only."""
        try:
            yield
        except TypeError as err:
            explained = _validate.model_call_error(err, self.model, self.guide, len(args), kwargs,
                                                   self.static_kwargs)
            if explained is None:
                raise
            raise explained from err

    def _sigma(self) -> float:
        """``dp_scale``, or a ``ValueError`` where it is left to ``run(epsilon=...)``."""
        if self.dp_scale is None:
            raise ValueError(
                "Expected a noise multiplier: this DPSVI was made with dp_scale=None, so only "
                "run(..., epsilon=..., delta=...) can choose it; pass dp_scale to DPSVI for update, "
                "get_epsilon and get_delta.")
        return self.dp_scale

    def _warn_if_all_noise(self, batch_size, stacklevel: int, sigma: Optional[float] = None) -> None:
        """:func:`d3p._validate.warn_if_all_noise` for this DPSVI's σ and C and a
        public (expected) batch size, once per batch size; nothing for a traced
        one. ``stacklevel`` counts from this method's caller (1)."""
        if isinstance(batch_size, jax.core.Tracer):
            return
        sigma = self._sigma() if sigma is None else sigma
        key = (sigma, float(batch_size))
        if key not in self._noise_warnings:
            self._noise_warnings.add(key)
            _validate.warn_if_all_noise(sigma, float(batch_size), self.clipping_threshold,
                                        stacklevel=stacklevel + 1)

    def _check_records_plate(self, svi_state, treedef, records, num_records: int) -> None:
        """Raise unless the model's subsampling plate over the records declares
        ``N = num_records``, the rows given to :meth:`run` (both public; a model
        with several subsampling plates of different sizes is not checked)."""
        params = self.optim.get_params(svi_state.optim_state)
        args, kwargs = jax.tree.unflatten(treedef, records)
        with self._model_errors_explained(args, kwargs):
            plates = self._records_plates(params, treedef, records)
        if len(set(plates.values())) == 1:
            name, size = next(iter(plates.items()))
            _validate.records_plate_size(name, size, num_records, self.static_kwargs)

    def _warn_if_placeholder_dependent(self, public, treedef, init_params) -> None:
        """Warn when the initial value of a param site of a guide written by
        hand (or of the model) depends on the values of the records it was
        initialised on, here the placeholders: found from an abstract trace
        of shapes and dtypes only, never from values."""
        args, kwargs = jax.tree.unflatten(treedef, public)
        try:
            dependent = placeholder_dependent_params(self.model, self.guide, treedef, public, self.static_kwargs,
                                                     init_params)
        except Exception as err:   # noqa: BLE001 - the check is a courtesy; the step reports real errors
            explained = _validate.model_call_error(err, self.model, self.guide, len(args), kwargs,
                                                   self.static_kwargs)
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
            UserWarning, stacklevel=4,
        )

    def _check_state(self, svi_state):
        if not isinstance(svi_state, DPSVIState):
            raise TypeError(
                f"Expected svi_state to be a DPSVIState (from DPSVI.init), got {type(svi_state).__name__}."
            )

    # ------------------------------------------------------------------ API

    def init(self, rng_key, *args, init_params=None, init_data=None, **kwargs) -> DPSVIState:
        """Gets the initial :class:`DPSVIState`, from public information only.

        The model and guide are run to find the parameters and their shapes,
        but never on the batch's values: they run on ones with the batch's
        shapes and dtypes (public), with the observed sites' likelihood left
        out of NumPyro's search for valid initial values, or on ``init_data``
        that the caller declares public. So the initial parameters, and what
        the guide keeps afterwards (an autoguide's prototype trace), hold no
        private value; an autoguide set up earlier on other data is set up
        again. A model or guide that needs real values to initialise (e.g. a
        likelihood evaluated in a latent site's prior) raises a ``ValueError``
        that says to pass ``init_data`` or ``init_params``. Models DP-VI
        cannot make private are refused here, with a ``ValueError`` that says
        why (see :class:`DPSVI`).

        **Formal guarantees.** The returned state is a function of the key,
        the batch's shapes and dtypes, ``init_params``, ``init_data`` and the
        model, guide and ``static_kwargs`` only: two batches of the same
        shapes give the same state whatever their values (non-finite and
        extreme values included), and the same errors.

        :param rng_key: a key of the PRNG suite (``d3p.random.PRNGKey(...)``).
        :param args: a batch of per-record data, as for :meth:`update`; only
            its shapes and dtypes are read (at least one row).
        :param dict init_params: if not None, initial values of param sites
            (public).
        :param init_data: optional PUBLIC records on which model and guide are
            initialised instead of ones (e.g. a public sample, or synthetic
            records): the positional data as a tuple, or ``(args, kwargs)``
            when the data has keyword arrays; per-record shapes and dtypes as
            the batch's. Their values enter the initial state: never pass
            private data here.
        :param kwargs: per-record keyword data for model and guide, as for
            :meth:`update`; only shapes and dtypes are read.
        :return: the initial state.
        """
        records, treedef, size = _records(args, kwargs)
        if size == 0:
            raise ValueError(
                "Expected at least one record in the batch given to init, got 0 rows: init "
                "runs the model and guide on ones shaped like the batch."
            )
        public, rows = public_records(init_data, records, treedef, size)
        return self._init_public(rng_key, public, treedef, rows, init_params, real_values=init_data is not None)

    def _init_public(self, rng_key, public, treedef, size, init_params, real_values) -> DPSVIState:
        """:meth:`init` on the public records ``public`` (ones shaped like a batch
        of ``size`` rows, or ``init_data``: ``real_values``)."""
        mesh = _sharding.concrete_mesh(self._batch_layout())   # checks the mesh and batch_axis first
        _sharding.check_same_in_every_process("rng_key", rng_key)
        args, kwargs = jax.tree.unflatten(treedef, public)
        rng_key, init_key = self.rng_suite.split(rng_key, 2)
        jax_init_key = self.rng_suite.convert_to_jax_rng_key(init_key)
        with _BatchSubsample(), public_guide_setup(self.guide, ignore_likelihood=not real_values), \
                self._model_errors_explained(args, kwargs):
            try:
                state = super().init(jax_init_key, *args, init_params=init_params, **kwargs)
            except (ValueError, RuntimeError) as err:
                if real_values:
                    raise
                raise ValueError(
                    f"The model or guide could not be initialised on public placeholders (ones "
                    f"shaped like the data; DPSVI never initialises from private records): {err} "
                    "Pass public values: init_params={...} for the parameters, or init_data=... "
                    "(records you declare public, e.g. synthetic ones) to init or run."
                ) from err
            if not real_values:
                self._warn_if_placeholder_dependent(public, treedef, init_params)
        if state.mutable_state is not None:
            raise ValueError(
                f"The model or guide has mutable state ({sorted(state.mutable_state)}). DP-VI "
                "cannot support it: mutable state is updated from the un-noised data and would "
                "leak it without any privacy guarantee."
            )
        # the model's structure and its public scale, now, for a clear early error
        with self._model_errors_explained(args, kwargs):
            scale = self._observation_scale(self.optim.get_params(state.optim_state), treedef, public)
        state = DPSVIState(state.optim_state, None, rng_key, _state_scale(scale), self._initial_threshold())
        # with a mesh: replicated on its devices, the same in every process
        return _sharding.replicate(state, mesh)

    def _noisy_gradient(self, svi_state, args, kwargs, mask, expected_batch_size, forward_mode):
        """``(state, noisy_gradient, loss)`` of one step (see :meth:`update`);
        ``state`` has the new key and observation scale, the old optimizer state."""
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
        else:
            expected_batch_size = _public_number(_validate.positive, "expected_batch_size", expected_batch_size)
        self._warn_if_all_noise(expected_batch_size, stacklevel=5)   # the caller of update
        C = self._step_threshold(svi_state)
        count_key = None
        if self.adaptive_clipping is not None:   # the noise of adaptive clipping's count: a key of its own
            noise_key, count_key = self.rng_suite.split(noise_key, 2)

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
        with self._model_errors_explained(args, kwargs):
            # a public constant (None without clip_unscaled_observations): see _observation_scale
            scale = self._observation_scale(params, treedef, records)
            loss_fn, global_loss, shared = self._step_losses(params, treedef, records, scale, key_impl, jax_key)
            result, noisy_sum = self._private_sum(loss_fn, params, (record_keys, list(records)), mask,
                                                  forward_mode, noise_key, C, shared)
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
            observation_scale = _state_scale(scale)
        next_C = self._next_threshold(svi_state, result, mask, C, expected_batch_size, count_key)
        return DPSVIState(svi_state.optim_state, None, rng_key, observation_scale, next_C), grad, loss

    def _initial_threshold(self) -> Optional[jax.Array]:
        """:attr:`DPSVIState.clipping_threshold` of :meth:`init`: the initial
        ``C`` with adaptive clipping, else None."""
        if self.adaptive_clipping is None:
            return None
        return jnp.asarray(self.clipping_threshold, dtype=jnp.result_type(float))

    def _step_threshold(self, svi_state):
        """``C`` of this step: the state's ``C_t`` with adaptive clipping, else
        the constructor's."""
        if self.adaptive_clipping is None:
            return self.clipping_threshold
        if svi_state.clipping_threshold is None:
            raise ValueError(
                "Expected a state with a clipping_threshold (from init of a DPSVI with adaptive_clipping), got "
                "svi_state.clipping_threshold=None.")
        return svi_state.clipping_threshold

    def _next_threshold(self, svi_state, result, mask, C, expected_batch_size, count_key):
        """``C_{t+1}`` of adaptive clipping, from the noisy count of the
        records whose norm is at most ``C`` (:mod:`d3p._adaptive`); without
        it, the state's field unchanged."""
        settings = self.adaptive_clipping
        if settings is None:
            return svi_state.clipping_threshold
        fraction = _adaptive.noisy_fraction(result.norms, mask, C, settings.count_std(expected_batch_size),
                                            expected_batch_size, count_key, self.rng_suite)
        return _adaptive.next_threshold(C, fraction, settings)

    def discrete_plan(self, params) -> "discrete.DiscretePlan":
        """The public constants of ``noise="discrete"`` for parameters shaped like
        ``params``: grid, norm bound and noise (see :func:`d3p.discrete.discrete_plan`)."""
        num_params = sum(int(np.size(x)) for x in jax.tree.leaves(params))
        key = (self._sigma(), num_params)
        if key not in self._discrete_plans:
            self._discrete_plans[key] = discrete.discrete_plan(self.dp_scale, self.clipping_threshold, num_params)
        return self._discrete_plans[key]

    def _batch_layout(self):
        """How this step's batch is sharded (:func:`d3p._sharding.batch_layout`):
        over ``mesh``, else the mesh in context, else None (one device)."""
        return _sharding.batch_layout(self.mesh, self.batch_axis)

    def _run_layout(self):
        """What the compiled steps of :meth:`run` depend on beyond their
        arguments: the batch layout and the mesh in context."""
        return self._batch_layout(), jax.sharding.get_abstract_mesh()

    def _replicated(self, *trees) -> tuple:
        """``trees`` placed whole on every device of the mesh, if there is one."""
        return _sharding.replicate(trees, _sharding.concrete_mesh(self._batch_layout()))

    def _private_sum(self, loss_fn, params, records, mask, forward_mode, noise_key, C, shared=None):
        """``(ClippedSum, noisy sum)``: the clipped sum over records, over the
        devices of the mesh if there is one, and its noisy release (the noise
        drawn once, for the whole sum), by the continuous or the discrete
        mechanism, with this step's clipping threshold ``C``. With ``shared``
        (the key of the draw shared by the batch), ``loss_fn(shared)`` is the
        loss of one record (see :meth:`_step_losses`)."""
        loss_of = (lambda *_: loss_fn) if shared is None else loss_fn
        layout = self._batch_layout()
        if self.adaptive_clipping is not None and layout is not None:
            raise ValueError("Expected no mesh in context (jax.set_mesh) with adaptive_clipping: adaptive "
                             "clipping runs on one device.")
        if self.noise == "discrete":
            plan = self.discrete_plan(params)
            discrete._check_slots(plan, gradients._batch_size(records))   # the whole batch's slots

            def integer_sum(p, recs, m, num_shards, *key):   # int32: exact whatever the number of shards
                return discrete.clipped_integer_sum(loss_of(*key), p, recs, m, plan, forward_mode=forward_mode)

            result = _sharding.sharded_sum(layout, integer_sum, params, records, mask, shared)
            dtype = jnp.result_type(*jax.tree.leaves(params))
            noisy = discrete.add_discrete_gaussian_noise(result.grad_sum, noise_key, plan, self.rng_suite, dtype)
            noisy = jax.tree.map(lambda g, p: g.astype(jnp.result_type(p)), noisy, params)
            return result, noisy

        def float_sum(p, recs, m, num_shards, *key):
            return clipped_grad_sum(
                loss_of(*key), p, recs, m, C, strategy=self.gradient_strategy,
                chunk_size=self.chunk_size, forward_mode=forward_mode,
                memory_budget_bytes=self.memory_budget_bytes, on_choice=self._record_choice,
                num_shards=num_shards, threshold_bound=self._threshold_bound(),
            )

        result = _sharding.sharded_sum(layout, float_sum, params, records, mask, shared)
        noisy = add_gaussian_noise(result.grad_sum, noise_key, self._sigma(), C, self.rng_suite)
        return result, noisy

    def _threshold_bound(self) -> Optional[float]:
        """The public upper bound of ``C`` that the sum's overflow check uses:
        ``max_threshold`` with adaptive clipping, else None (``C`` itself)."""
        return None if self.adaptive_clipping is None else self.adaptive_clipping.max_threshold

    def _step(self, svi_state, args, kwargs, mask, expected_batch_size, forward_mode):
        """One step: ``(new_state, loss, noisy_gradient)``; see :meth:`update`."""
        state, grad, loss = self._noisy_gradient(svi_state, args, kwargs, mask, expected_batch_size, forward_mode)
        optim_state = self.optim.update(grad, svi_state.optim_state, value=self._optim_value)
        return state._replace(optim_state=optim_state), loss, grad

    def update(self, svi_state: DPSVIState, *args, mask: Optional[jax.Array] = None,
               expected_batch_size: Optional[float] = None, forward_mode_differentiation: bool = False,
               **kwargs):
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
        state, loss, _ = self._step(
            svi_state, args, kwargs, mask, expected_batch_size, forward_mode_differentiation
        )
        return state, loss

    def stable_update(self, svi_state: DPSVIState, *args, mask: Optional[jax.Array] = None,
                      expected_batch_size: Optional[float] = None, forward_mode_differentiation: bool = False,
                      **kwargs):
        """Like :meth:`update`, but keeps the parameters when the step is not finite.

        The decision looks only at the noisy gradient and the resulting
        optimizer state (post-processing of the private release), never at the
        un-noised loss, so skipping leaks nothing. The key advances either way.
        Arguments, data rules and guarantees as for :meth:`update`.

        :return: ``(svi_state, loss)``; ``loss`` is ``nan`` for a skipped step
            and is NOT private.
        """
        state, loss, grad = self._step(
            svi_state, args, kwargs, mask, expected_batch_size, forward_mode_differentiation
        )
        return _keep_if_not_finite(svi_state, state, loss, grad)

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
        _, eval_key = self.rng_suite.split(svi_state.rng_key, 2)
        params = self.get_params(svi_state)

        def loss(records):
            args, kwargs = jax.tree.unflatten(treedef, records)
            return self.loss.loss(self.rng_suite.convert_to_jax_rng_key(eval_key), params, self.model,
                                  self.guide, *args, **kwargs, **self.static_kwargs)

        # with a mesh, JAX partitions the loss over the records' shards
        with self._model_errors_explained(args, kwargs):
            return _sharding.partitioned(self._batch_layout(), loss, records)

    @staticmethod
    def perturbation_function(rng_suite, rng, values, perturbation_scale):
        """``values`` plus independent Gaussian noise of standard deviation
        ``perturbation_scale`` in every entry (d3p 0.2's perturbation step).

        The noise comes from :func:`d3p.gradients.add_gaussian_noise`, the one
        place where d3p draws privacy noise, with noise multiplier
        ``perturbation_scale`` and sensitivity 1; every part (pytree leaf) gets
        its own key, split from ``rng``.

        **Formal guarantees.** If ``values`` has L2 sensitivity 1, the result
        is the Gaussian mechanism with noise multiplier ``perturbation_scale``;
        for sensitivity ``C`` pass ``perturbation_scale = sigma * C``. The
        noise does not depend on ``values``.

        :param rng_suite: the PRNG suite of ``rng`` (e.g. :mod:`d3p.random`).
        :param rng: a key of ``rng_suite``.
        :param values: a list or tuple of arrays, or any pytree.
        :param float perturbation_scale: the noise standard deviation, ``>= 0``
            and finite.
        :return: the noisy values, in the same structure.
        """
        rng_suite = _validate.rng_suite("rng_suite", rng_suite)
        scale = _validate.non_negative("perturbation_scale", perturbation_scale)
        leaves, treedef = jax.tree.flatten(values)
        if not leaves:
            return values
        keys = rng_suite.split(rng, len(leaves))
        noisy = [add_gaussian_noise(leaf, keys[i], scale, 1.0, rng_suite) for i, leaf in enumerate(leaves)]
        return jax.tree.unflatten(treedef, noisy)

    # ------------------------------------------------------------ accounting

    def get_epsilon(self, target_delta: float, q: float, num_epochs: Optional[float] = None,
                    num_iter: Optional[int] = None, *, relation: Optional[str] = None,
                    accountant: str = "fourier", sampler: Optional[str] = None) -> float:
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
            substitute relation are assumed (the most conservative of the
            supported accountings; d3p 0.2 instead composed the Poisson
            add/remove bound whatever drew the batches, which is valid for
            Poisson batches only); otherwise resolved by
            :func:`d3p.accounting.accounting_for`. Poisson-sampled runs pass
            ``sampler="poisson"`` (add/remove) for their smaller ε, which is
            d3p 0.2's figure.
        """
        return self._account("epsilon", target_delta, q, num_epochs, num_iter, relation, accountant, sampler)

    def get_delta(self, target_epsilon: float, q: float, num_epochs: Optional[float] = None,
                  num_iter: Optional[int] = None, *, relation: Optional[str] = None,
                  accountant: str = "fourier", sampler: Optional[str] = None) -> float:
        """The δ of a run with this DPSVI's ``dp_scale`` at the given ε.

        Arguments as for :meth:`get_epsilon`, with ``target_epsilon`` for δ.
        """
        return self._account("delta", target_epsilon, q, num_epochs, num_iter, relation, accountant, sampler)

    def _account(self, figure, target, q, num_epochs, num_iter, relation, accountant, sampler) -> float:
        """The arguments of :meth:`get_epsilon` and :meth:`get_delta` resolved to
        a number of steps and an accounting, whose ``figure`` (``"epsilon"`` or
        ``"delta"``) is returned for ``target`` (δ or ε)."""
        steps = _num_steps(q, num_epochs, num_iter)
        compute = getattr(_method_accounting(sampler, relation, self.noise), figure)
        return compute(self._accounted_sigma(self._sigma()), q, steps, target, accountant=accountant)

    def _accounted_sigma(self, sigma: float, expected_batch_size: Optional[float] = None) -> float:
        """The noise multiplier that steps with gradient noise multiplier
        ``sigma`` are accounted with: ``sigma``, or with adaptive clipping
        ``σ_eff`` of the gradient sum and the count together
        (:meth:`AdaptiveClipping.effective_sigma`; the count noise for the public
        ``expected_batch_size`` if ``count_noise`` is not given)."""
        settings = self.adaptive_clipping
        if settings is None:
            return sigma
        if settings.count_noise is None and expected_batch_size is None:
            raise ValueError(
                "Expected count_noise in AdaptiveClipping for get_epsilon and get_delta: the default count noise "
                "(the expected batch size / 20) is known to run and update only, not from q.")
        return _adaptive.effective_sigma(sigma, settings.count_std(expected_batch_size))

    # ------------------------------------------------------------------ run

    def run(self, rng_key, num_steps: int, *args, batch_size: Optional[int] = None, q: Optional[float] = None,
            sampling: str = "poisson", max_batch_size: Optional[int] = None, target_delta: Optional[float] = None,
            accountant: str = "fourier", relation: Optional[str] = None, progress_bar: bool = True,
            stable_update: bool = False, forward_mode_differentiation: bool = False,
            init_state: Optional[DPSVIState] = None, init_params: Optional[dict] = None,
            init_data=None, epsilon: Optional[float] = None, delta: Optional[float] = None,
            ledger: Optional[PrivacyLedger] = None, start_step: Optional[int] = None,
            **kwargs) -> DPSVIRunResult:
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

        From public facts only: a ``ValueError`` if the model's subsampling
        plate declares an ``N`` other than the number of rows given; a
        ``UserWarning`` if ``dp_scale`` is at least the expected batch size
        ``B`` (the noise in each step's averaged gradient, ``sigma C / B`` per
        coordinate, is then at least ``C``, the largest norm the average of
        the clipped gradients can have), and if ``target_delta >= 1 / N``.

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
        :param float epsilon: ask for this ε instead of giving ``dp_scale``
            to the constructor (which must then be None; both is an error): σ
            is calibrated by :func:`d3p.dputil.calibrate_sigma` for the
            sampler, relation, noise and number of steps of this run, at
            ``delta`` minus what Poisson batch overflow adds to it, and
            reported as the result's ``sigma``. ``inf``: no noise. With
            ``adaptive_clipping`` the calibrated σ is ``σ_eff`` of the
            gradient and the count, and the gradient's noise multiplier is
            :meth:`AdaptiveClipping.gradient_sigma` of it (``ValueError``
            naming ``count_noise`` if the count noise is too small for it).
        :param float delta: the δ of ``epsilon`` (the same as ``target_delta``;
            give one of the two).
        :param PrivacyLedger ledger: record this run's steps in ``ledger``
            (:class:`d3p.ledger.PrivacyLedger`): the run is refused before its
            first step if it would pass the ledger's budget, or reuse the
            batch keys of a run recorded there; it is recorded once it has
            finished.
        :param int start_step: the index of the first step in the stream of
            batch keys drawn from ``rng_key`` (batch ``i`` is drawn with
            ``fold_in(batch_key, start_step + i)``). Default: 0, or, with a
            ``ledger``, the steps it has recorded with this ``rng_key``, or a
            :class:`Checkpoint`'s ``step``. Continuing a run with the same
            ``rng_key`` from where it stopped gives the same parameters, bit
            for bit, as the run without the interruption.
        :param str accountant: ``"fourier"``, ``"rdp"`` or ``"pld"``.
        :param str relation: the relation of the reported guarantee:
            ``"add_remove"`` (default for Poisson sampling) or ``"substitute"``
            (Poisson or fixed-size; the only one for fixed-size).
        :param bool progress_bar: show a tqdm bar (loss and ε), advanced
            after each compiled chunk of about 5% of the steps (at most 1000);
            without it all steps run in one ``lax.scan``. The result is the
            same either way. The compiled steps are kept by this DPSVI: a later
            run with the same sampler, settings and data shapes (any key, any
            values) starts without compiling them again.
        :param bool stable_update: use :meth:`stable_update`.
        :param bool forward_mode_differentiation: as in NumPyro.
        :param DPSVIState init_state: continue from this state, or from a
            :class:`Checkpoint` (:func:`load_checkpoint`), whose ``step`` and
            ``ledger`` are then the defaults of ``start_step`` and
            ``ledger``. The reported ε is that of this run's steps; the ledger
            holds the total.
        :param dict init_params: initial values of param sites (public).
        :param init_data: optional public records to initialise on, as for
            :meth:`init`; by default the run initialises on ones shaped like
            one batch (never on the data).
        :param kwargs: per-record keyword data (``N`` rows each).
        :return: :class:`DPSVIRunResult` ``(params, state, losses)`` with the
            fields ``epsilon``, ``delta``, ``relation``, ``sampler``, ``sigma``,
            ``q``, ``num_steps`` and ``start_step``. The losses are NOT private.
        """
        num_steps = _validate.integer("num_steps", num_steps, minimum=1)
        records, treedef, N = _records(args, kwargs, what="data")
        if delta is not None:
            if target_delta is not None:
                raise ValueError(f"Expected one of delta and target_delta, got delta={delta!r} and "
                                 f"target_delta={target_delta!r}.")
            target_delta = delta
        checkpoint = init_state if isinstance(init_state, Checkpoint) else None
        if checkpoint is not None:
            ledger = checkpoint.ledger if ledger is None else ledger
            start_step = checkpoint.step if start_step is None else start_step
        if ledger is not None and not isinstance(ledger, PrivacyLedger):
            raise TypeError(f"Expected ledger to be a d3p.ledger.PrivacyLedger, got {type(ledger).__name__}.")
        plan = self._run_plan(N, num_steps, batch_size, q, sampling, max_batch_size, target_delta,
                              accountant, relation, epsilon)
        given = self.dp_scale
        self.dp_scale = plan.sigma   # for this run's steps (the compiled steps are kept per σ); restored below
        try:
            _sharding.check_same_in_every_process("rng_key", rng_key)
            init_key, batch_key = self.rng_suite.split(rng_key, 2)
            fingerprint = key_fingerprint(batch_key) if ledger is not None else None
            if start_step is None:
                start_step = ledger.steps_taken(fingerprint) if ledger is not None else 0
            start_step = _validate.integer("start_step", start_step, minimum=0, maximum=2**32 - num_steps)
            release = None
            if ledger is not None:   # refused here, before any step, if it would pass the budget
                release = self._release(plan, N, num_steps, start_step, fingerprint)
                ledger.check(release)
            # with a mesh: the data set whole on every device, each taking its shard of every batch
            records, batch_key = self._replicated(records, batch_key)
            update = self.stable_update if stable_update else self.update
            gather, run_chunk = self._run_cache.steps(update, plan.sampler, self.rng_suite, treedef,
                                                      forward_mode_differentiation, (self._run_layout(), plan.sigma))
            svi_state = init_state
            if svi_state is None or checkpoint is not None:
                # initialised from public information: a batch's shapes, or init_data
                if checkpoint is not None and (init_data is not None or init_params is not None):
                    raise ValueError(
                        "Expected neither init_data nor init_params with a checkpoint: it holds the state.")
                batch = jax.eval_shape(gather, batch_key, records, 0)[:2]
                like_batch = [jnp.zeros(x.shape, x.dtype) for x in jax.tree.leaves(batch)]
                public, rows = public_records(init_data, like_batch, treedef, len(like_batch[0]) if like_batch else 0)
                svi_state = self._init_public(init_key, public, treedef, rows, init_params,
                                              real_values=init_data is not None)
                if checkpoint is not None:
                    svi_state = checkpoint.into(svi_state)
            elif init_data is not None:
                raise ValueError("Expected init_data only without init_state: the state is already initialised.")
            self._check_state(svi_state)
            self._check_records_plate(svi_state, treedef, records, N)
            _sharding.check_same_in_every_process("init_state", svi_state.rng_key)
            (svi_state,) = self._replicated(svi_state)

            def run_steps(svi_state, start, data, length):
                svi_state, losses, ok = run_chunk(svi_state, batch_key, start, data, length)
                return _require_batches(ok, plan.sampler, (svi_state, losses))

            if progress_bar:
                svi_state, losses = _run_with_progress_bar(run_steps, svi_state, records, num_steps, plan, start_step)
            else:
                svi_state, losses = run_steps(svi_state, jnp.uint32(start_step), records, num_steps)
            if ledger is not None:
                ledger.record(release)
            return self._run_result(svi_state, losses, plan, N, num_steps, start_step)
        finally:
            self.dp_scale = given

    def _release(self, plan, N: int, num_steps: int, start_step: int, fingerprint) -> GaussianSteps:
        """The ledger's record of a run: its steps, with the probability η that
        a Poisson batch overflowed its padded size (for the larger neighbour)."""
        sampler, acc = plan.sampler, plan.accounting
        eta = 0.0
        if acc.sampler == "poisson":
            eta = min(1.0, num_steps * _sampling.overflow_probability(N + 1, sampler.q, sampler.max_batch_size))
        sigma = self._accounted_sigma(plan.sigma, sampler.expected_batch_size)
        return GaussianSteps(f"DPSVI.run: {num_steps} steps", sigma, float(sampler.q), num_steps,
                             str(acc.sampler), str(acc.relation), acc.noise, eta, start_step, fingerprint)

    def _run_plan(self, N, num_steps, batch_size, q, sampling, max_batch_size, target_delta, accountant,
                  relation, epsilon=None) -> "_RunPlan":
        """:meth:`run`'s sampler and its accounting, from run's arguments."""
        from d3p import minibatch

        if N < 1:
            raise ValueError("Expected a non-empty data set, got 0 records.")
        if not (isinstance(sampling, str) and sampling in _SAMPLINGS):  # exactly, as the docs spell them
            raise ValueError(f"Expected sampling to be one of 'poisson', 'fixed', got sampling={sampling!r}.")
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
        acc = accounting.accounting_for(sampler.name, relation, self.noise)
        if target_delta is None:
            target_delta = 1.0 / N**2
        target_delta = _validate.open_unit("delta" if epsilon is not None else "target_delta", target_delta)
        _validate.warn_if_large_delta("target_delta", target_delta, N, stacklevel=4)
        sigma, target_delta = self._run_sigma(epsilon, acc, sampler, num_steps, target_delta, accountant)
        tracker = acc.tracker(self._accounted_sigma(sigma, sampler.expected_batch_size), sampler.q, target_delta,
                              num_steps=num_steps, accountant=accountant)
        # public facts only: σ, C, the expected batch size, N and δ
        self._warn_if_all_noise(sampler.expected_batch_size, stacklevel=4, sigma=sigma)   # the caller of run
        return _RunPlan(sampler, acc, tracker, target_delta, sigma)

    def _run_sigma(self, epsilon, acc, sampler, num_steps, delta, accountant):
        """``(sigma, delta_run)``: ``dp_scale`` and ``delta``, or, for
        ``run(epsilon=...)``, σ calibrated for this run's accounting at
        ``delta_run``, ``delta`` less the Poisson overflow term at ``epsilon``."""
        if epsilon is None:
            return self._sigma(), delta
        epsilon = _validate.positive("epsilon", epsilon, finite=False)
        if self.dp_scale is not None:
            raise ValueError(
                f"Expected either a noise multiplier or an epsilon, got dp_scale={self.dp_scale!r} (given to "
                f"DPSVI) and epsilon={epsilon!r} (asked of run): make DPSVI with dp_scale=None to ask for an "
                "epsilon, or leave epsilon out to use dp_scale.")
        if math.isinf(epsilon):
            return 0.0, delta
        overflow = acc.overflow_delta(sampler.num_records, sampler.q, sampler.max_batch_size, num_steps, epsilon)
        delta_run = delta - overflow
        if not delta_run > 0.5 * delta:
            raise ValueError(
                f"Expected the Poisson batches to overflow rarely: with max_batch_size={sampler.max_batch_size} "
                f"they add {overflow:.3g} to delta={delta:g}. Use a larger max_batch_size or the default.")
        from d3p import dputil

        sigma, _, _ = dputil.calibrate_sigma(epsilon, delta_run, sampler.q, num_steps, sampler=acc.sampler,
                                             relation=acc.relation, noise=acc.noise, accountant=accountant)
        if self.adaptive_clipping is not None:   # σ is σ_eff of gradient and count: the gradient's share
            return _adaptive.gradient_sigma(float(sigma), self.adaptive_clipping.count_std(
                sampler.expected_batch_size)), delta_run
        return float(sigma), delta_run

    def _run_result(self, svi_state, losses, plan, N, num_steps, start_step=0) -> DPSVIRunResult:
        """:meth:`run`'s result: the final state with the privacy spent by its steps."""
        sampler, acc = plan.sampler, plan.accounting
        epsilon = plan.tracker.epsilon(num_steps)
        # a Poisson batch larger than max_batch_size is truncated: that event's
        # probability adds to δ
        delta = min(1.0, plan.target_delta + acc.overflow_delta(
            N, sampler.q, sampler.max_batch_size, num_steps, epsilon))
        return DPSVIRunResult(
            self.get_params(svi_state), svi_state, losses, epsilon=epsilon, delta=delta,
            relation=acc.relation, sampler=acc.sampler,
            sigma=self._accounted_sigma(plan.sigma, sampler.expected_batch_size), q=sampler.q,
            num_steps=num_steps, start_step=start_step,
        )


#: The values of :meth:`DPSVI.run`'s ``sampling``.
_SAMPLINGS = ("poisson", "fixed")

def _method_accounting(sampler, relation, noise="gaussian"):
    """The accounting of :meth:`DPSVI.get_epsilon`/:meth:`DPSVI.get_delta`:
    with neither argument, fixed-size batches under substitute (the most
    conservative accounting; d3p 0.2 composed the Poisson add/remove bound
    here, see docs/migration.md)."""
    if sampler is None and relation is None:
        sampler = "fixed_size"
    return accounting.accounting_for(sampler, relation, noise)


def _num_steps(q, num_epochs, num_iter) -> int:
    if (num_epochs is None) == (num_iter is None):
        raise ValueError(
            f"Expected exactly one of num_epochs and num_iter, got num_epochs={num_epochs}, "
            f"num_iter={num_iter}."
        )
    if num_iter is not None:
        return _validate.integer("num_iter", num_iter, minimum=1)
    epochs = _validate.positive("num_epochs", num_epochs)
    q = _validate.probability("q", q)
    return max(1, int(math.ceil(epochs / q)))


def save_checkpoint(path, result_or_state, step: Optional[int] = None,
                    ledger: Optional[PrivacyLedger] = None) -> None:
    """Save a run's state, the step it reached and its privacy ledger to ``path``
    (one ``.npz`` file of arrays and JSON text; nothing is pickled).

    :param path: the file to write (replaced atomically).
    :param result_or_state: a :class:`DPSVIRunResult` (its state, and its
        ``start_step + num_steps`` as ``step``) or a :class:`DPSVIState`.
    :param int step: the steps taken (the next batch's index); required with
        a state, checked against a result's.
    :param PrivacyLedger ledger: the ledger to save with it (optional).

    The file holds the optimizer state (the parameters), the PRNG key of the
    next step's noise and the step index: secret, as the noise must be; keep
    it where the data is kept. Continue with
    ``svi.run(rng_key, more_steps, *data, init_state=load_checkpoint(path), ...)``
    and the same ``rng_key`` (see :meth:`DPSVI.run`).
    """
    from d3p import _checkpoint

    if isinstance(result_or_state, DPSVIRunResult):
        done = int((result_or_state.start_step or 0) + result_or_state.num_steps)
        if step is not None and int(step) != done:
            raise ValueError(f"Expected step={done} for this result (start_step + num_steps), got step={step!r}.")
        state, step = result_or_state.state, done
    elif isinstance(result_or_state, DPSVIState):
        if step is None:
            raise ValueError("Expected step (the number of steps taken) with a DPSVIState.")
        state = result_or_state
    else:
        raise TypeError(
            f"Expected result_or_state to be a DPSVIRunResult or DPSVIState, got {type(result_or_state).__name__}.")
    step = _validate.integer("step", step, minimum=0)
    if ledger is not None and not isinstance(ledger, PrivacyLedger):
        raise TypeError(f"Expected ledger to be a d3p.ledger.PrivacyLedger, got {type(ledger).__name__}.")
    _checkpoint.save_checkpoint(path, state, step, ledger)


def load_checkpoint(path, like: Optional[DPSVIState] = None) -> Checkpoint:
    """Read a checkpoint written by :func:`save_checkpoint`.

    :param path: the file.
    :param DPSVIState like: optionally a state of the same model, guide and
        optimizer, into whose structure the saved arrays are put
        (``checkpoint.state``); without it, :meth:`DPSVI.run` does that when
        given the checkpoint as ``init_state``.
    :return: :class:`Checkpoint` ``(state, leaves, structure, step, ledger)``.
    """
    from d3p import _checkpoint

    return _checkpoint.load_checkpoint(path, like)
