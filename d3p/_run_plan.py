# SPDX-License-Identifier: Apache-2.0
"""What a run of :class:`d3p.svi.DPSVI` samples with and accounts for.

:func:`run_plan` turns :meth:`DPSVI.run <d3p.svi.DPSVI.run>`'s arguments into
its sampler, that sampler's accounting (:func:`d3p.accounting.accounting_for`,
the one mapping from samplers to accountings), the noise multiplier (given,
or calibrated for ``run(epsilon=...)``: :func:`run_sigma`) and the ε tracker
of the run; :func:`release` is the ledger's record of it and
:func:`run_result` the result with the privacy spent. :func:`account` is the
accounting of :meth:`DPSVI.get_epsilon <d3p.svi.DPSVI.get_epsilon>` and
:meth:`DPSVI.get_delta <d3p.svi.DPSVI.get_delta>`. All of it reads public
facts only: σ, C, q, the number of steps and records, δ.
"""

import math
from typing import Any, NamedTuple, Optional

import numpy as np

from d3p import _adaptive, _private_step, _sampling, _validate, accounting
from d3p._state import DPSVIRunResult
from d3p.ledger import GaussianSteps

#: The values of :meth:`DPSVI.run`'s ``sampling``.
SAMPLINGS = ("poisson", "fixed")


class RunPlan(NamedTuple):
    """What :meth:`DPSVI.run` samples with and accounts for: the sampler, its
    accounting (:func:`d3p.accounting.accounting_for`), the ε tracker of the
    run, the target δ and the noise multiplier σ (``dp_scale``, or calibrated
    for ``run(epsilon=...)``)."""

    sampler: Any
    accounting: Any
    tracker: Any
    target_delta: float
    sigma: float = None


#: The largest (expected) batch :meth:`DPSVI.run` chooses by itself (:func:`automatic_q`).
AUTOMATIC_MAX_BATCH_SIZE = 4096

#: The most that the add/remove neighbour's overflow of the automatic Poisson
#: batches (``N + 1`` records drawn into ``N`` slots) may add to δ, as a share of δ.
AUTOMATIC_OVERFLOW_SHARE = 1e-3


#: Adam's largest step size when :class:`d3p.svi.DPSVI` is given no optimizer
#: (:class:`ChosenStepSize`; benchmarks/README.md, "The settings chosen").
CHOSEN_STEP_SIZE = 0.05

#: ... and the norm of its step over all ``P`` parameters: the step size is
#: at most ``CHOSEN_STEP_NORM / sqrt(P)``. Where the noise dominates, Adam
#: moves every coordinate by about the step size, so a step moves the
#: parameters by about ``step size * sqrt(P)``: without the bound a network
#: (the VAE's 4,600 parameters) is driven to overflow.
CHOSEN_STEP_NORM = 0.4

#: :meth:`DPSVI.run`'s number of steps when ``num_steps`` is None (:func:`chosen_run`),
#: the most that :func:`steps_for_the_noise` chooses.
CHOSEN_NUM_STEPS = 2000

#: The noise ratio ``ρ = σ sqrt(P) / B_e`` (:func:`d3p._adaptive.noise_ratio`)
#: above which :func:`steps_for_the_noise` takes fewer steps than
#: :data:`CHOSEN_NUM_STEPS` (benchmarks/README.md, "Fewer steps where the
#: noise is large").
STEPS_NOISE_RATIO = 0.3

#: ... but never fewer than ``STEPS_TRAVEL / step size``: Adam moves a
#: coordinate by at most about its step size per step, so this many steps let
#: it travel ``STEPS_TRAVEL`` (500 steps at the step size 0.05; a network's
#: smaller step keeps its 2,000).
STEPS_TRAVEL = 25.0

#: The share of the last steps whose parameters :meth:`DPSVI.run` averages by
#: default with the optimizer it chose (:func:`chosen_run`; with a user's
#: optimizer, none: at a small step size the iterates still move and their
#: mean lags).
CHOSEN_AVERAGE = 0.25

#: In a run of ``T`` steps from a fresh state, the chosen step size is held
#: for the first ``CHOSEN_HOLD`` share of the steps, then decayed along a
#: cosine to ``CHOSEN_FINAL`` times itself at the last step
#: (:meth:`ChosenStepSize.__call__`; benchmarks/README.md, "The second half
#: of the steps decayed").
CHOSEN_HOLD, CHOSEN_FINAL = 0.5, 0.02


def chosen_step_size(num_params: int) -> float:
    """``min(CHOSEN_STEP_SIZE, CHOSEN_STEP_NORM / sqrt(P))`` for ``P = num_params``."""
    return min(CHOSEN_STEP_SIZE, CHOSEN_STEP_NORM / math.sqrt(max(num_params, 1)))


class RunStepSize:
    """A step-size schedule of d3p's own (an optimizer's ``step_size``) whose
    settings are arguments of :meth:`DPSVI.run <d3p.svi.DPSVI.run>`'s
    compiled steps: a run with other settings reuses the program. ``run``
    asks for :meth:`arguments` and, while its steps are traced, sets
    :attr:`run_steps` to them as traced values (None otherwise: the
    schedule's constants); ``fit`` sees the parameters before an update is
    traced. Registered with a DPSVI by :func:`use_schedule`."""

    def __init__(self):
        #: this schedule's arguments while a run's steps are traced, else None
        self.run_steps = None

    def arguments(self, num_steps: int, fresh: bool):
        """The schedule's arguments for a run of ``num_steps`` steps
        (``fresh``: from a fresh state), or None: constants of the program."""
        return None

    def fit(self, params):
        """Called with the parameters (or gradients) before an update is traced."""


def use_schedule(svi, optim, schedule: RunStepSize) -> None:
    """Make ``schedule`` (the step size of ``optim``, ``svi``'s optimizer) take
    its settings from ``svi``'s runs (:class:`RunStepSize`)."""
    svi._step_schedule = (optim, schedule)


class ChosenStepSize(RunStepSize):
    """The step size of the Adam that :class:`d3p.svi.DPSVI` chooses:
    ``min(CHOSEN_STEP_SIZE, CHOSEN_STEP_NORM / sqrt(P))`` for ``P``
    parameters (public: their shapes), known once :meth:`fit` has seen them
    (the step does so before each optimizer update is traced). Called with
    the step's index, as an optimizer's schedule; its argument in a run
    from a fresh state is the run's number of steps ``T`` (the decay's)."""

    def __init__(self):
        super().__init__()
        self.value = None

    def arguments(self, num_steps: int, fresh: bool):
        return np.float32(num_steps) if fresh else None

    def fit(self, params) -> float:
        self.value = chosen_step_size(_private_step.count_parameters(params))
        return self.value

    def __call__(self, step):
        """The step size at the optimizer's step ``step``: :attr:`value`; in
        :meth:`DPSVI.run`'s steps from a fresh state, held for the first
        :data:`CHOSEN_HOLD` share of its ``T`` steps, then decayed along a
        cosine to :data:`CHOSEN_FINAL` times itself at step ``T``."""
        if self.value is None:
            raise RuntimeError("The chosen step size is set from the parameters' shapes: update the state "
                               "through DPSVI.update or DPSVI.run.")
        if self.run_steps is None:
            return self.value
        import jax.numpy as jnp

        total = jnp.asarray(self.run_steps, jnp.float32)
        t = jnp.clip((step - CHOSEN_HOLD * total) / ((1 - CHOSEN_HOLD) * total), 0.0, 1.0)
        return self.value * (CHOSEN_FINAL + (1 - CHOSEN_FINAL) * 0.5 * (1 + jnp.cos(jnp.pi * t)))


class CosineStepSize(RunStepSize):
    """``i -> learning_rate * ((1 - f) * (1 + cos(pi * min(i, T) / T)) / 2 + f)``
    (``f = final_fraction``), the arithmetic of optax's
    ``cosine_decay_schedule(learning_rate, T, alpha=f)``, with
    ``learning_rate`` and ``T = num_steps`` arguments of a run's compiled
    steps (attributes: set them between runs). As arguments its values are
    within a unit in the last place of optax's with the two as constants
    (which XLA may divide by differently)."""

    def __init__(self, learning_rate: float, num_steps: int, final_fraction: float):
        super().__init__()
        self.learning_rate, self.num_steps, self.final_fraction = learning_rate, num_steps, final_fraction

    def arguments(self, num_steps: int, fresh: bool):
        return np.float32(self.learning_rate), np.float32(self.num_steps)

    def __call__(self, count):
        import jax.numpy as jnp

        learning_rate, decay_steps = (self.learning_rate, float(self.num_steps)) if self.run_steps is None \
            else self.run_steps
        count = jnp.minimum(count, decay_steps)
        cosine_decay = 0.5 * (1 + jnp.cos(jnp.pi * count / decay_steps))
        return learning_rate * ((1 - self.final_fraction) * cosine_decay + self.final_fraction)


def optimizer(optim):
    """``(optim, chosen)``: :class:`DPSVI`'s optimizer (a user's checked by
    :func:`d3p._private_step.check_optimizer`), and where d3p chose it
    (``optim`` None: Adam at a :class:`ChosenStepSize`) the pair of that
    optimizer and its step size, else None (:func:`use_schedule`)."""
    if optim is not None:
        _private_step.check_optimizer(optim)
        return optim, None
    import numpyro.optim

    step_size = ChosenStepSize()
    adam = numpyro.optim.Adam(step_size)
    return adam, (adam, step_size)


def chosen_run(svi, num_steps, average):
    """``(num_steps, average, said)``: :meth:`DPSVI.run`'s number of steps
    (:data:`CHOSEN_NUM_STEPS` for None) and the share of steps it averages
    (None: :data:`CHOSEN_AVERAGE` with the optimizer d3p chose, else 0), and
    what to say of the number of steps chosen. Constants: public."""
    said = []
    if num_steps is None:
        num_steps = CHOSEN_NUM_STEPS
        said.append(f"d3p: no num_steps given: {num_steps:,} steps")
    if average is None:
        average = CHOSEN_AVERAGE if svi.optim_chosen else 0.0
    return num_steps, average, said


def steps_for_the_noise(rho: float, step_size: float) -> int:
    """The number of steps :meth:`DPSVI.run` takes when asked for ε with
    neither ``num_steps`` nor an optimizer: :data:`CHOSEN_NUM_STEPS` where the
    noise ratio ``rho`` (:func:`d3p._adaptive.noise_ratio` of the gradient's σ
    calibrated for that many steps) is at most :data:`STEPS_NOISE_RATIO`;
    above it, the number at which ``ρ`` would be about that ratio if σ grew
    as the square root of the number of steps (as it does once σ is large),
    ``CHOSEN_NUM_STEPS * (STEPS_NOISE_RATIO / rho)**2``, rounded down to a
    multiple of 10, but at least ``STEPS_TRAVEL / step_size``. At a fixed ε a
    step's noise grows with the number of steps: where it swamps each step,
    fewer, less noisy steps fit better (measured). Public facts only."""
    rho = _validate.number("rho", rho, low=0.0)
    if rho <= STEPS_NOISE_RATIO:
        return CHOSEN_NUM_STEPS
    fewest = min(CHOSEN_NUM_STEPS, math.ceil(STEPS_TRAVEL / step_size))
    wanted = 10 * math.floor(CHOSEN_NUM_STEPS * (STEPS_NOISE_RATIO / rho) ** 2 / 10)
    return max(fewest, min(CHOSEN_NUM_STEPS, wanted))


def describe_steps_for_the_noise(num_steps: int, rho: float, step_size: float) -> str:
    """What :meth:`DPSVI.run` says of the number of steps it chose from the noise."""
    return (f"d3p: no num_steps given: {num_steps:,} steps, not {CHOSEN_NUM_STEPS:,}: at {CHOSEN_NUM_STEPS:,} "
            f"steps each step's noise would be {rho:.3g} times the largest clipped sum (sigma sqrt(P) / B, above "
            f"{STEPS_NOISE_RATIO:g}); fewer steps carry less noise each at the same epsilon (at least "
            f"{STEPS_TRAVEL:g} / step size {step_size:.3g})")


def describe_optimizer(step_size: float, average: float, decays: bool = True) -> str:
    """What :meth:`DPSVI.run` says of the optimizer it chose (``decays``: its
    step size decays over the run, which starts from a fresh state)."""
    averaged = f"the parameters averaged over the last {average:.0%} of the steps" if average else \
        "no averaging"
    return (f"d3p: no optimizer given: Adam with step size {step_size:.3g} (min({CHOSEN_STEP_SIZE:g}, "
            f"{CHOSEN_STEP_NORM:g} / sqrt(number of parameters))), "
            + (f"held for the first {CHOSEN_HOLD:.0%} of the steps, then decayed along a cosine to "
               f"{CHOSEN_FINAL:.0%} of itself, " if decays else "constant (the run continues a state), ")
            + f"{averaged} (run(average=...); post-processing)")


def automatic_sampling(sampling: Optional[str], batch_size, q, max_batch_size, epsilon, relation) -> str:
    """:meth:`DPSVI.run`'s ``sampling`` when it is not given (None): ``"fixed"``
    for the whole data set at every step (:func:`automatic_q` is then 1) when
    the noise multiplier is given (no ``epsilon``) and neither ``batch_size``,
    ``q``, ``max_batch_size`` nor ``relation="add_remove"`` is, as
    :meth:`numpyro.infer.SVI.run` uses all the data it is given; else
    ``"poisson"``. Asking for ε, Poisson batches of nearly all the data need
    half the noise of whole-data batches for the same ε (under add/remove one
    record moves the clipped sum by at most C; whole-data batches are
    accounted under substitute, 2C). Public facts only."""
    if sampling is not None:
        return sampling
    if (epsilon is None and batch_size is None and q is None and max_batch_size is None
            and relation != "add_remove"):
        return "fixed"
    return "poisson"


def automatic_q(N: int, sampling: str = "poisson", num_steps: int = 1, delta: float = 1e-12,
                epsilon: Optional[float] = None) -> float:
    """The sampling probability :meth:`DPSVI.run` uses when given neither
    ``batch_size`` nor ``q``: as much of the data set as a step can take, as
    :meth:`numpyro.infer.SVI.run` uses all the data it is given. Fixed-size
    batches with the noise given (``epsilon`` None): the whole data set
    (``q = 1``), whatever its size. Otherwise up to an expected
    :data:`AUTOMATIC_MAX_BATCH_SIZE` records: fixed-size batches the whole
    data set up to that size. Poisson batches are padded to
    at most ``N`` slots and the add/remove neighbour has ``N + 1`` records,
    which all fall in a batch with probability ``q^(N + 1)``; over
    ``num_steps`` steps that adds ``(1 + e^ε) T q^(N + 1)`` to δ, kept at most
    :data:`AUTOMATIC_OVERFLOW_SHARE` of ``delta`` (with ε = 1 where it is not
    given): 0.93 at N = 455, T = 2,000, ε = 8, δ = 1/N². Public facts only.

    Why large batches: at a fixed ε and number of steps, the noise of a step
    relative to the batch's clipped sum barely depends on ``q`` once σ is
    large (σ grows in proportion to ``q``), so the largest affordable batch
    loses nothing to the noise and removes the sampling noise
    (benchmarks/README.md, "Accuracy at the defaults")."""
    if sampling == "fixed" and epsilon is None:
        return 1.0
    q = min(1.0, AUTOMATIC_MAX_BATCH_SIZE / N)
    if sampling == "poisson":
        eps = 1.0 if epsilon is None or math.isinf(epsilon) else epsilon
        allowed = AUTOMATIC_OVERFLOW_SHARE * delta / ((1.0 + math.exp(min(eps, 700.0))) * num_steps)
        q = min(q, math.exp(math.log(allowed) / (N + 1)))
    return q


def describe_choice(sampler) -> str:
    """What :meth:`DPSVI.run` chose without ``batch_size`` or ``q``, in words."""
    return (f"d3p: no batch_size or q given: {sampler.name.replace('_', '-')} batches of "
            f"{'expected ' if sampler.name == 'poisson' else ''}size {sampler.expected_batch_size:.6g} "
            f"(q = {sampler.q:.4g}) from {sampler.num_records} records at every step, accounted as such")


def _sampler(N, batch_size, q, sampling, max_batch_size, num_steps=1, delta=1e-12, epsilon=None):
    """The sampler of :meth:`DPSVI.run`'s arguments (``num_steps``, ``delta``
    and ``epsilon``: for :func:`automatic_q`)."""
    from d3p import minibatch

    if not (isinstance(sampling, str) and sampling in SAMPLINGS):  # exactly, as the docs spell them
        raise ValueError(f"Expected sampling to be one of 'poisson', 'fixed', got sampling={sampling!r}.")
    if batch_size is not None and q is not None:
        raise ValueError(
            f"Expected at most one of batch_size and q for sampling={sampling!r}, got "
            f"batch_size={batch_size}, q={q}."
        )
    if batch_size is None and q is None:
        q = automatic_q(N, sampling, num_steps, delta, epsilon)
    if sampling == "fixed":
        if batch_size is None:
            batch_size = minibatch.q_to_batch_size(q, N)
        if max_batch_size is not None:
            raise ValueError("max_batch_size applies only to sampling='poisson'.")
        return minibatch.FixedSizeSampler(N, batch_size)
    if q is None:
        q = minibatch.batch_size_to_q(batch_size, N)
    return minibatch.PoissonSampler(N, q, max_batch_size)


def run_plan(svi, N, num_steps, batch_size, q, sampling, max_batch_size, target_delta, accountant,
             relation, epsilon=None, warn=True) -> RunPlan:
    """:meth:`DPSVI.run`'s sampler and its accounting, from run's arguments
    (called by :func:`d3p._run.run`: its warnings name the caller of ``DPSVI.run``;
    none with ``warn`` False)."""
    if N < 1:
        raise ValueError("Expected a non-empty data set, got 0 records.")
    if target_delta is None:
        target_delta = 1.0 / N**2
    target_delta = _validate.open_unit("delta" if epsilon is not None else "target_delta", target_delta)
    sampling = automatic_sampling(sampling, batch_size, q, max_batch_size, epsilon, relation)
    sampler = _sampler(N, batch_size, q, sampling, max_batch_size, num_steps, target_delta, epsilon)
    acc = accounting.accounting_for(sampler.name, relation, svi.noise)
    if warn:
        _validate.warn_if_large_delta("target_delta", target_delta, N, stacklevel=5)
    sigma, target_delta = run_sigma(svi, epsilon, acc, sampler, num_steps, target_delta, accountant)
    tracker = acc.tracker(accounted_sigma(svi, sigma), sampler.q, target_delta,
                          num_steps=num_steps, accountant=accountant)
    if warn:   # public facts only: σ, C, the expected batch size, N and δ
        _private_step.warn_if_all_noise(svi, sampler.expected_batch_size, stacklevel=5, sigma=sigma)
    return RunPlan(sampler, acc, tracker, target_delta, sigma)


def run_sigma(svi, epsilon, acc, sampler, num_steps, delta, accountant):
    """``(sigma, delta_run)``: ``dp_scale`` and ``delta``, or, for
    ``run(epsilon=...)``, σ calibrated for this run's accounting at
    ``delta_run``, ``delta`` less the Poisson overflow term at ``epsilon``."""
    if epsilon is None:
        return _private_step.noise_multiplier(svi), delta
    epsilon = _validate.positive("epsilon", epsilon, finite=False)
    if svi.dp_scale is not None:
        raise ValueError(
            f"Expected either a noise multiplier or an epsilon, got dp_scale={svi.dp_scale!r} (given to "
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
    if svi.adaptive_clipping is not None:   # σ is σ_eff of gradient and count: the gradient's share
        return svi.adaptive_clipping.split(float(sigma)), delta_run
    return float(sigma), delta_run


def release(svi, plan, N: int, num_steps: int, start_step: int, fingerprint) -> GaussianSteps:
    """The ledger's record of a run: its steps, with the probability η that
    a Poisson batch overflowed its padded size (for the larger neighbour)."""
    sampler, acc = plan.sampler, plan.accounting
    eta = 0.0
    if acc.sampler == "poisson":
        eta = min(1.0, num_steps * _sampling.overflow_probability(N + 1, sampler.q, sampler.max_batch_size))
    sigma = accounted_sigma(svi, plan.sigma)
    return GaussianSteps(f"DPSVI.run: {num_steps} steps", sigma, float(sampler.q), num_steps,
                         str(acc.sampler), str(acc.relation), acc.noise, eta, start_step, fingerprint)


def run_result(svi, svi_state, losses, plan, N, num_steps, start_step=0, params=None,
               averaged_steps=0) -> DPSVIRunResult:
    """:meth:`DPSVI.run`'s result: the final state with the privacy spent by
    its steps; ``params``: the averaged parameters (default: the final
    state's)."""
    sampler, acc = plan.sampler, plan.accounting
    epsilon = plan.tracker.epsilon(num_steps)
    # a Poisson batch larger than max_batch_size is truncated: that event's
    # probability adds to δ
    delta = min(1.0, plan.target_delta + acc.overflow_delta(
        N, sampler.q, sampler.max_batch_size, num_steps, epsilon))
    return DPSVIRunResult(
        svi.get_params(svi_state) if params is None else params, svi_state, losses, epsilon=epsilon, delta=delta,
        relation=acc.relation, sampler=acc.sampler,
        sigma=accounted_sigma(svi, plan.sigma), q=sampler.q,
        num_steps=num_steps, start_step=start_step, averaged_steps=averaged_steps,
    )


# ---------------------------------------------------------------- accounting


def accounted_sigma(svi, sigma: float) -> float:
    """The noise multiplier that steps with gradient noise multiplier
    ``sigma`` are accounted with: ``sigma``, or with adaptive clipping
    ``σ_eff`` of the gradient sum and the count together
    (:meth:`AdaptiveClipping.effective_sigma`)."""
    settings = svi.adaptive_clipping
    if settings is None:
        return sigma
    return _adaptive.effective_sigma(sigma, settings.count_std(sigma))


def account(svi, figure, target, q, num_epochs, num_iter, relation, accountant, sampler) -> float:
    """The arguments of :meth:`DPSVI.get_epsilon` and :meth:`DPSVI.get_delta` resolved to
    a number of steps and an accounting, whose ``figure`` (``"epsilon"`` or
    ``"delta"``) is returned for ``target`` (δ or ε)."""
    steps = _num_steps(q, num_epochs, num_iter)
    compute = getattr(_method_accounting(sampler, relation, svi.noise), figure)
    _private_step.warn_if_sigma_changed(svi, stacklevel=3)   # the caller of get_epsilon / get_delta
    return compute(accounted_sigma(svi, _private_step.noise_multiplier(svi)), q, steps, target, accountant=accountant)


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
