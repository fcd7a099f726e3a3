"""Differentially private stochastic variational inference (DP-VI) for NumPyro.

:class:`DPSVI` is a drop-in replacement for :class:`numpyro.infer.SVI`: the
same constructor arguments (plus the clipping threshold and the noise
multiplier), the same methods and states, and parameters that work with
``numpyro.infer.Predictive`` as after SVI. It wires together what a model is
(:mod:`d3p._model_facts`), the initial state from public information
(:mod:`d3p._init_state`), the private step (:mod:`d3p._private_step`), and a
run with its sampling and accounting (:mod:`d3p._run`, :mod:`d3p._run_plan`).

The module also keeps d3p 0.2's helpers on lists of gradient parts
(:func:`full_norm`, :func:`clip_gradient`, :func:`normalize_gradient`) and
:func:`get_observations_scale`; they accept any pytree as well.
"""

from typing import Callable, Optional

import jax
from numpyro.infer.svi import SVI

import d3p.random
from d3p import (
    _adaptive, _elbo_terms, _init_state, _model_facts, _numpyro_compat, _private_step, _run, _run_plan, _sharding,
    _validate, discrete, gradients,
)
from d3p._adaptive import AdaptiveClipping
from d3p._checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from d3p._gradient_lists import (  # noqa: F401 (public, see __all__)
    clip_gradient,
    full_norm,
    get_observations_scale,
    normalize_gradient,
)
from d3p._records import _records
from d3p._run import _RunCache
from d3p._state import DPSVIRunResult, DPSVIState, check_state
from d3p.ledger import PrivacyLedger
from d3p.random._common import suite_key

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


class DPSVI(SVI):
    """Differentially private stochastic variational inference.

    Drop-in replacement for :class:`numpyro.infer.SVI`. Each step
    (:meth:`update`) computes, for a batch of ``B`` records from ``N``:

    1. the ELBO terms of every record alone, with its own guide sample (by
       default those of the sites inside the records plate, ``formulation``),
       divided by the public scale of one record (the plate's ``N / 1``; with
       ``clip_unscaled_observations=True``), so that ``C`` bounds the record's
       own term whatever ``N`` is;
    2. its gradient over all variational parameters, clipped as one vector to
       L2 norm at most ``C`` (``clipping_threshold``);
    3. the sum over real records of the clipped gradients plus Gaussian noise
       of standard deviation ``dp_scale * C`` per coordinate, from ``rng_suite``;
    4. that noisy sum times ``N / B`` (``B``: the batch size, or the public
       ``expected_batch_size`` under Poisson sampling, never the realised
       count), plus the gradient of the data-independent terms, evaluated once
       per step: the full-data ELBO gradient estimate; then an optimizer step.

    The model must declare its records with a plate that subsamples, e.g.
    ``with numpyro.plate("data", N, subsample_size=xs.shape[0])``, as in
    minibatch SVI: its scale is how DPSVI knows ``N``, and it must be a public
    constant (a scale that may depend on a record, the parameters or the key
    is refused with a ``ValueError``). All data passed to :meth:`init`,
    :meth:`update`, :meth:`stable_update`, :meth:`evaluate` and :meth:`run` is
    per-record, one row per record; values shared by all records go to the
    constructor as ``static_kwargs``. :meth:`run` draws every batch with the
    sampler its accounting assumes and reports the ε spent. The privacy
    argument in full, in floating point and on several devices, is in
    docs/privacy.md ("What one step releases", "What is read outside ε") and
    docs/multi_device.md.

    :param model: NumPyro model; its records must sit under a subsampling plate.
    :param guide: NumPyro guide (e.g. an autoguide).
    :param optim: a NumPyro optimizer, a ``jax.example_libraries`` optimizer or
        an ``optax`` transformation (also through ``numpyro.optim.optax_to_numpyro``);
        or None (default): ``numpyro.optim.Adam`` at the step size
        ``min(0.05, 0.4 / sqrt(P))`` for ``P`` parameters
        (:class:`d3p._run_plan.ChosenStepSize`; in :meth:`run` decayed over the second half), :meth:`run`
        averaging the parameters over the last quarter of its steps (``run`` says so; docs/privacy.md,
        "Settings chosen for you"). NumPyro optimizers that use the loss value
        (``numpyro.optim.Minimize``, ``update_with_value``) are refused: the loss
        is not private. Optax transformations are given a constant 0 as the loss
        value, so those that read it (e.g. ``reduce_on_plateau``) never adapt.
    :param loss: the ELBO, e.g. ``numpyro.infer.Trace_ELBO()``, evaluated on
        one record at a time (NumPyro's name; d3p 0.2's keyword
        ``per_example_loss=`` is the same argument: give one of the two).
    :param float clipping_threshold: ``C > 0``, finite; ``inf`` only together
        with ``dp_scale=0`` (no privacy, for testing). Or None (default)
        together with ``dp_scale=None``: ``C`` is chosen, by adaptive
        clipping from ``C = 1`` to the 0.98 quantile of the per-record
        gradient norms, or the 0.9 quantile where the noise is large
        (:func:`d3p._adaptive.target_quantile`; or the
        ``adaptive_clipping`` given), within the ε asked
        of :meth:`run` (``run`` says so; docs/privacy.md, "Without a
        clipping threshold, C is chosen").
    :param float dp_scale: the noise multiplier ``sigma >= 0``
        (from :func:`d3p.dputil.approximate_sigma`); or None, and ask
        :meth:`run` for an ε instead (``run(..., epsilon=...)`` calibrates σ
        for the run's sampler, relation, noise and number of steps).
    :param rng_suite: the PRNG suite for noise and batch selection;
        :mod:`d3p.random` (ChaCha20) by default, :mod:`d3p.random.debug` for
        debugging. Every method that takes a key also takes JAX's keys
        (``jax.random.key``, ``jax.random.PRNGKey``), converted by
        :func:`d3p.random.as_key` (the noise stays ChaCha20's, as secret as
        the key: docs/privacy.md, "Keys"). The records' Monte Carlo samples come from JAX's default
        generator, a key per record and one for the draw the batch shares, from
        ``rng_suite.split_with_jax_keys`` (else ``convert_to_jax_rng_key``); no privacy role.
    :param bool clip_unscaled_observations: see step 1 (default True); with
        False, ``C`` bounds ``N`` times a record's term and step 4 uses ``1 / B``.
    :param str gradient_strategy: how per-record gradients are formed:
        ``"auto"`` (default: from the model, the backend and the memory
        budget), ``"vmap"``, ``"chunked"``, ``"scan"`` or ``"ghost"``, all with
        the same clipped sum and privacy (:func:`d3p.gradients.clipped_grad_sum`);
        the attribute ``strategy_choice`` (a :class:`d3p.gradients.StrategyChoice`)
        is the one of the latest trace of a step.
    :param int chunk_size: records per chunk for ``"chunked"`` and ``"ghost"``
        (default: from the memory budget).
    :param int memory_budget_bytes: bytes of per-record gradients (or
        activations) held at once; default
        :data:`d3p.gradients.DEFAULT_CPU_MEMORY_BUDGET_BYTES` (64 MiB) where
        JAX's default backend is the CPU, else
        :data:`d3p.gradients.DEFAULT_MEMORY_BUDGET_BYTES` (1 GiB).
    :param str noise: ``"gaussian"`` (default): continuous Gaussian noise of
        std ``dp_scale * C`` drawn in floating point; or ``"discrete"``: the
        discrete Gaussian mechanism of :mod:`d3p.discrete` (records summed
        exactly in integers, the guarantee holding for the floating-point
        program; noise 1% larger, gradients formed one record at a time;
        accounted as such by :meth:`run`; see docs/privacy.md).
    :param mesh: a :class:`jax.sharding.Mesh` over whose devices every batch's
        records are sharded (see docs/multi_device.md); default None: the mesh
        set in context with :func:`jax.set_mesh` when a step is traced, if
        any, else one device. ``memory_budget_bytes`` and ``chunk_size`` then
        apply per device.
    :param batch_axis: the name of the mesh axis (or a tuple of names) along
        which records are sharded; default None: all axes of the mesh.
        Parameters and optimizer state are replicated along every axis.
    :param adaptive_clipping: None (default: ``C`` is fixed), True, or an
        :class:`AdaptiveClipping`: ``C`` starts at ``clipping_threshold`` and
        follows a private estimate of a quantile of the per-record gradient
        norms, held in the state (Andrew et al. 2021); ``dp_scale`` is the
        gradient's noise multiplier and runs are accounted at ``σ_eff`` of the
        gradient and the count (see :class:`AdaptiveClipping`). Not with
        ``noise="discrete"`` or a mesh (``ValueError``).
    :param str formulation: which ELBO terms each record's clipped gradient
        holds (docs/privacy.md, "Which terms are clipped"): ``"own_sample"``:
        those of the sites inside the records plate, each record with its own
        guide draw, the global sites' terms evaluated once per step and added
        after the noise; ``"shared_sample"``: the same split with one draw of
        the global latent variables per step, shared by the batch (as SVI);
        ``"aligned"``: that shared draw, each record's gradient taken with
        respect to the draw's value (the guide's parameters get theirs by the
        chain rule after the noise, so the noise no longer drives the scales);
        ``"per_record"``: each record's whole ELBO, the global terms weighted
        ``1 / N`` (d3p 0.2); ``"auto"`` (default): ``"aligned"`` for
        ``Trace_ELBO`` and ``TraceMeanField_ELBO`` where the guide draws every
        global latent variable reparameterised (``"own_sample"`` where not,
        and over a mesh),
        else, or with a warning where a global term may read a record,
        ``"per_record"``. The released
        sum and its sensitivity are the same under all. The one a step uses is
        the attribute ``formulation_choice`` once the step is traced.
    :param static_kwargs: keyword arguments passed to model AND guide at every
        call, shared by all records (e.g. group-level data); the only place
        for such values, and treated as public (they are used without noise).
        ``N`` is passed on only to a model that takes it; otherwise it is
        checked against the size the records plate declares. A model or guide that does not accept them, or that uses data
        values in Python or NumPy code, is refused with a ``TypeError`` that
        names it; see "Common mistakes" in the getting-started guide.

    **Formal guarantees.**

    - Under either neighbouring relation a step releases the noisy clipped sum
      (step 3); everything after it is post-processing. One record added,
      removed or masked out moves the sum by at most ``C`` in L2 norm, one
      substituted by at most ``2 C``, in floating point, whatever the model,
      the data and the other records.
    - A record whose gradient is not finite contributes zero, as if masked,
      with no message; padded records (``mask`` False) contribute exactly
      zero; an empty batch yields pure noise, never ``nan``.
    - The noise depends only on ``dp_scale`` and ``C``; the normalisation only
      on public constants (the model's scale, found from shapes alone, and the
      batch size or ``expected_batch_size``). ``static_kwargs`` and the
      model's own constants are treated as public.
    - The terms added once per step (``formulation``) come from the
      parameters, the step's key and a public placeholder record only, after
      an abstract trace has shown that they cannot read a record.
    - With ``adaptive_clipping``, ``C`` is the state's ``C_t`` and each step
      also releases a noisy count that one record moves by at most 1/2 (1
      substituted): one Gaussian mechanism of multiplier ``σ_eff``.
    - Initialisation (:meth:`init`, and :meth:`run` without ``init_state``)
      reads only the data's shapes and dtypes, the keys, ``init_params`` and
      ``init_data``: no record can change the initial state or make it fail.
    - On a mesh the same holds for the whole batch: shards by position only,
      the noise drawn once from the replicated key; a step traced inside
      ``shard_map`` and keys that differ between processes are refused.
    - Privacy over a run follows from the sampling: use :meth:`run`, or the
      samplers of :mod:`d3p.minibatch` with :meth:`get_epsilon`. The losses
      returned are computed from un-noised data and are NOT private.

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
        optim=None,
        loss=None,
        clipping_threshold: Optional[float] = None,
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
        *,
        per_example_loss=None,
        **static_kwargs,
    ):
        optim, self._step_schedule = _run_plan.optimizer(optim)   # checked; None: Adam at a chosen step size
        per_example_loss, static_kwargs, declared_N = _numpyro_compat.arguments(model, guide, loss,
                                                                                 per_example_loss, static_kwargs)
        super().__init__(model, guide, optim, per_example_loss, **static_kwargs)
        self.declared_N, self.clipping_chosen = declared_N, clipping_threshold is None   # N checked; C left to run
        self.clipping_threshold, self.dp_scale = _private_step.privacy_settings(clipping_threshold, dp_scale)
        self.rng_suite = _validate.rng_suite("rng_suite", rng_suite)
        self.clip_unscaled_observations = _validate.boolean("clip_unscaled_observations", clip_unscaled_observations)
        self.gradient_strategy = _validate.choice("gradient_strategy", gradient_strategy, gradients.STRATEGIES)
        self.chunk_size = _private_step.optional_count("chunk_size", chunk_size)
        self.memory_budget_bytes = _private_step.optional_count("memory_budget_bytes", memory_budget_bytes)
        self.noise = _private_step.noise_setting(noise, self.dp_scale, self.clipping_threshold, self.gradient_strategy)
        self.mesh = _validate.mesh("mesh", mesh)
        if self.mesh is not None:
            batch_axis = _validate.mesh_axes("batch_axis", batch_axis, self.mesh.axis_names)
        #: The mesh axes over which batches are sharded (None: all axes of the mesh).
        self.batch_axis = batch_axis
        #: The :class:`AdaptiveClipping` settings, bounds filled in (None: ``C`` is fixed; chosen without C).
        self.adaptive_clipping = _adaptive.resolve(_adaptive.chosen(adaptive_clipping, clipping_threshold),
                                                   self.clipping_threshold, noise=self.noise, mesh=self.mesh)
        # per_example_loss is also available as self.loss (numpyro's name)
        self.per_example_loss = per_example_loss
        # found once: the model's public facts, its ELBO's split per record structure (d3p._model_facts),
        # the discrete mechanism's constants per parameter count, the (σ, batch size) pairs warned about
        # and the σ steps were traced with as a constant (d3p._private_step), run's compiled steps
        # (d3p._run._RunCache) and the σ and C they trace (while traced)
        self._public_scales, self._split_facts_cache, self._discrete_plans, self._traced_sigmas = {}, {}, {}, set()
        self._noise_warnings, self._run_cache, self._run_sigma, self._run_clip = set(), _RunCache(), None, None
        #: The :class:`d3p.gradients.StrategyChoice` of the most recent trace of
        #: this DPSVI's step (None before the first): which gradient strategy runs.
        self.strategy_choice = None
        #: The ``formulation`` asked for; the one the latest trace of a step
        #: used (``"auto"`` resolved) is ``formulation_choice`` (None before).
        self.formulation = _elbo_terms.requested(
            _validate.choice("formulation", formulation, _elbo_terms.FORMULATIONS), per_example_loss)
        self.formulation_choice = None

    @property
    def optim_chosen(self) -> bool:
        """Whether d3p chose the optimizer (``optim=None``: Adam, its step size from the parameters' number)."""
        return isinstance(_private_step.step_schedule_of(self), _run_plan.ChosenStepSize)

    def _record_choice(self, choice) -> None:
        self.strategy_choice = choice

    def init(self, rng_key, *args, init_params=None, init_data=None, **kwargs) -> DPSVIState:
        """Gets the initial :class:`DPSVIState`, from public information only.

        The model and guide run on ones with the batch's shapes and dtypes
        (the likelihood left out of NumPyro's search for valid initial
        values), or on ``init_data`` that the caller declares public, never on
        the batch's values; an autoguide set up earlier is set up again. A
        model or guide that needs real values to initialise raises a
        ``ValueError`` that says to pass ``init_data`` or ``init_params``, as
        do models DP-VI cannot make private (saying why).

        **Formal guarantees.**

        - The state is a function of the key, the batch's shapes and dtypes,
          ``init_params``, ``init_data``, the model, guide and
          ``static_kwargs`` only: batches of the same shapes give the same
          state and the same errors, whatever their values.

        :param rng_key: a key of the PRNG suite (``d3p.random.PRNGKey(...)``) or a
            JAX key (:func:`d3p.random.as_key`).
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
        return _init_state.init(self, rng_key, args, kwargs, init_params, init_data)

    def discrete_plan(self, params) -> "discrete.DiscretePlan":
        """The public constants of ``noise="discrete"`` for parameters shaped like
        ``params``: grid, norm bound and noise (see :func:`d3p.discrete.discrete_plan`)."""
        return _private_step.discrete_plan(self, params)

    @_private_step.SettingsMethod   # jit(svi.update) after a setting changed: traced anew
    def update(self, svi_state: DPSVIState, *args, mask: Optional[jax.Array] = None,
               expected_batch_size: Optional[float] = None, forward_mode_differentiation: bool = False,
               **kwargs):
        """Take one DP-VI step on a batch.

        **Formal guarantees.**

        - Every array in ``args`` and ``kwargs`` is per-record data with the
          batch's leading dimension ``B``; record ``i`` sees only row ``i`` of
          each, so one record moves the released sum by at most ``C`` (``2 C``
          substituted). Scalars, strings and other objects are refused, naming
          the argument: shared values go to the constructor.
        - The released gradient is the noisy sum times a public constant (the
          plate's ``N`` over ``expected_batch_size``), never read from a
          record; a batch with no real record yields that times pure noise.

        :param DPSVIState svi_state: current state (a JAX key in its ``rng_key``
            is converted by :func:`d3p.random.as_key`; the new state holds the suite's key).
        :param args: the batch: arrays with one row per record (leading
            dimension ``B``, real and padded records). Arrays keep their
            dtype; a plain list or tuple is one column (one value per record)
            and every pandas column becomes JAX's default float dtype,
            element by element, an element that is not a real number NaN (no
            value chooses a dtype or an error; docs/privacy.md, "Input data
            and their dtypes"). Arrays of text or objects raise ``TypeError``.
            The caller's data is never modified.
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

        Called outside ``jax.jit``, the step runs as one program compiled for
        its settings and shapes, not operation by operation: the release of
        ``jax.jit(svi.update)``.
        """
        return _private_step.update(self, "update", svi_state, args, kwargs, mask, expected_batch_size,
                                    forward_mode_differentiation)

    @_private_step.SettingsMethod
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
        return _private_step.update(self, "stable_update", svi_state, args, kwargs, mask, expected_batch_size,
                                    forward_mode_differentiation)

    def evaluate(self, svi_state: DPSVIState, *args, **kwargs):
        """The ELBO loss on the given data at the current parameters.

        NOT private: it is computed from the un-noised data. Its Monte Carlo
        draws are keyed as a step's shared draw from ``svi_state`` (never by a noise key).

        :param DPSVIState svi_state: current state.
        :param args: per-record data, as for :meth:`update` (lists, tuples
            and pandas objects converted by the same rule, scalars refused).
        :param kwargs: per-record keyword data, as for :meth:`update`.
        """
        check_state(svi_state)
        records, treedef, B = _records(args, kwargs)
        jax_key = _private_step.step_shared_key(self, svi_state.rng_key, B)
        params = self.get_params(svi_state)

        def loss(records):
            args, kwargs = jax.tree.unflatten(treedef, records)
            return self.loss.loss(jax_key, params, self.model, self.guide, *args, **kwargs, **self.static_kwargs)

        # with a mesh, JAX partitions the loss over the records' shards
        with _model_facts.model_errors_explained(self, args, kwargs):
            return _sharding.partitioned(_private_step.batch_layout(self), loss, records)

    @staticmethod
    def perturbation_function(rng_suite, rng, values, perturbation_scale):
        """``values`` plus independent Gaussian noise of standard deviation
        ``perturbation_scale`` in every entry (d3p 0.2's perturbation step).

        The noise comes from :func:`d3p.gradients.add_gaussian_noise` (the one
        place where d3p draws privacy noise), one key per pytree leaf.

        **Formal guarantees.**

        - If ``values`` has L2 sensitivity 1, the result is the Gaussian
          mechanism with noise multiplier ``perturbation_scale`` (for
          sensitivity ``C`` pass ``sigma * C``); the noise does not depend on
          ``values``.

        :param rng_suite: the PRNG suite of ``rng`` (e.g. :mod:`d3p.random`).
        :param rng: a key of ``rng_suite``.
        :param values: a list or tuple of arrays, or any pytree.
        :param float perturbation_scale: the noise standard deviation, finite, ``>= 0``.
        :return: the noisy values, in the same structure.
        """
        return _private_step.perturbation(rng_suite, rng, values, perturbation_scale)

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
            (:func:`d3p.minibatch.subsample_batchify_data`), resolved with
            ``relation`` by :func:`d3p.accounting.accounting_for`. With
            neither, fixed-size batches under substitute are assumed (the most
            conservative accounting; d3p 0.2 composed the Poisson add/remove
            bound, valid for Poisson batches only: pass ``sampler="poisson"``).
        """
        return _run_plan.account(self, "epsilon", target_delta, q, num_epochs, num_iter, relation, accountant,
                                 sampler)

    def get_delta(self, target_epsilon: float, q: float, num_epochs: Optional[float] = None,
                  num_iter: Optional[int] = None, *, relation: Optional[str] = None,
                  accountant: str = "fourier", sampler: Optional[str] = None) -> float:
        """The δ of a run with this DPSVI's ``dp_scale`` at the given ε.

        Arguments as for :meth:`get_epsilon`, with ``target_epsilon`` for δ.
        """
        return _run_plan.account(self, "delta", target_epsilon, q, num_epochs, num_iter, relation, accountant, sampler)

    # ------------------------------------------------------------------ run

    def run(self, rng_key, num_steps: Optional[int], *args, batch_size: Optional[int] = None, q: Optional[float] = None,
            sampling: Optional[str] = None, max_batch_size: Optional[int] = None, target_delta: Optional[float] = None,
            accountant: str = "fourier", relation: Optional[str] = None, progress_bar: bool = True,
            stable_update: bool = False, forward_mode_differentiation: bool = False,
            init_state: Optional[DPSVIState] = None, init_params: Optional[dict] = None,
            init_data=None, epsilon: Optional[float] = None, delta: Optional[float] = None,
            ledger: Optional[PrivacyLedger] = None, start_step: Optional[int] = None,
            average: Optional[float] = None, **kwargs) -> DPSVIRunResult:
        """Run ``num_steps`` DP-VI steps, each on a fresh random batch of the data.

        Batches come from the sampler the accounting assumes (Poisson by default, or
        fixed-size); the ε spent for it (:func:`d3p.accounting.accounting_for`) is
        shown in the progress bar and attached to the result. Public checks only: a
        ``ValueError`` if the model's plate declares another ``N``; a ``UserWarning`` if
        the noise will dominate or ``target_delta >= 1 / N``. Details: docs/privacy.md.

        :param rng_key: a key of the PRNG suite (``d3p.random.PRNGKey()``, or a JAX
            key: :func:`d3p.random.as_key`): step
            ``i``'s batch, noise and Monte Carlo draws come from it and ``i``
            alone (not from ``init_state``'s key); use a key for one release
            (the ledger and a checkpoint refuse a repeat of its steps).
        :param int num_steps: number of steps, ``>= 1``; or None: 2,000, fewer where the noise would swamp
            each step (:func:`d3p._run_plan.steps_for_the_noise`, asking for ε with d3p's optimizer; said).
        :param args: the FULL data set, one row per record (``N`` rows); ``kwargs`` likewise.
        :param int batch_size: the (expected) batch size, or give ``q``, or neither:
            all the data at every step with ``dp_scale`` given, nearly all asking for ε (printed).
        :param float q: sampling probability (fixed size: ``round(q N)`` records).
        :param str sampling: ``"poisson"`` (default; add/remove or substitute) or
            ``"fixed"`` (substitute; about twice the noise for the same ε); not given:
            :func:`d3p._run_plan.automatic_sampling`.
        :param int max_batch_size: Poisson batches' padded size (default: overflow negligible).
        :param float epsilon: ask for this ε (``dp_scale=None`` in the constructor):
            σ is calibrated for this run's sampler and steps (``inf``: no noise).
        :param float delta: δ of ``epsilon``; ``target_delta`` is the same (default ``1 / N**2``).
        :param PrivacyLedger ledger: check the run against the ledger's budget
            before its first step and record it after the last (the result's
            ``total_epsilon`` is then the ledger's total).
        :param int start_step: index of the first step in ``rng_key``'s stream of
            batch keys (default 0, the ledger's count or a checkpoint's step).
        :param str accountant: ``"fourier"``, ``"rdp"`` or ``"pld"``.
        :param str relation: ``"add_remove"`` (Poisson's default) or ``"substitute"``.
        :param bool progress_bar: a tqdm bar (loss and ε); the result is the same without.
        :param bool stable_update: use :meth:`stable_update`.
        :param bool forward_mode_differentiation: as in NumPyro.
        :param DPSVIState init_state: continue from a state or a :class:`Checkpoint`
            (recorded in it, and refused if it repeats a continuation's key and steps).
        :param dict init_params: initial values of param sites (public).
        :param init_data: public records to initialise on (default: placeholders).
        :param float average: the share in [0, 1) of the last steps whose parameters
            are averaged into ``params`` (post-processing); ``state`` is the last.
            Default None: 0.5 with the optimizer d3p chose (``optim=None``), else 0.
        :return: :class:`DPSVIRunResult` ``(params, state, losses)`` with the privacy
            spent (``epsilon``, ``delta``, ``sigma``, ``q``, ...); the losses are NOT private.
        """
        return _run.run(
            self, suite_key(self.rng_suite, rng_key), num_steps, args, kwargs, batch_size=batch_size, q=q, sampling=sampling,
            max_batch_size=max_batch_size, target_delta=target_delta, accountant=accountant, relation=relation,
            progress_bar=progress_bar, stable_update=stable_update, forward_mode=forward_mode_differentiation,
            init_state=init_state, init_params=init_params, init_data=init_data, epsilon=epsilon, delta=delta,
            ledger=ledger, start_step=start_step, average=average)
