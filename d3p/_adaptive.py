# SPDX-License-Identifier: Apache-2.0
"""Adaptive clipping: the clipping threshold ``C`` follows a private estimate
of a quantile of the per-record gradient norms.

The method is that of Andrew, Thakkar, McMahan & Ramaswamy, "Differentially
private learning with adaptive clipping" (NeurIPS 2021). Each step, beside the
noisy gradient sum, releases the noisy count of the records whose gradient
norm is at most the current ``C_t``, and moves ``C`` geometrically towards
the target quantile:

- ``b_i = 1[‖g_i‖ <= C_t]`` for every real record (padded records count
  nothing; a record whose gradient is not finite has ``b_i = 0``);
- the count ``Σ_i (b_i - 1/2)`` over the real records, plus Gaussian noise of
  standard deviation ``σ_b``: one record changes it by at most 1/2 when it
  is added or removed and by at most 1 when it is substituted;
- ``b̃ = noisy count / B_e + 1/2`` with ``B_e`` the public expected batch size;
- ``C_{t+1} = clip(C_t exp(-η (b̃ - γ)), C_min, C_max)``.

The gradient sum (sensitivity ``C_t``) with noise ``σ C_t`` and the count
(sensitivity 1/2) with noise ``σ_b`` are released on the same batch: in units
of their noise, one record's contribution to the pair is a vector of norm at
most ``sqrt(σ^-2 + (2 σ_b)^-2)``, so the pair is one Gaussian mechanism with
sensitivity 1 and noise multiplier
``σ_eff = (σ^-2 + (2 σ_b)^-2)^(-1/2)`` (:func:`effective_sigma`); a
substitution doubles both sensitivities, which is exactly how the accounting
of one Gaussian sum treats it. A run is therefore accounted as DP-SGD with
noise multiplier ``σ_eff`` through :func:`d3p.accounting.accounting_for`.
The derivation is in the privacy guide (docs/privacy.md, "Adaptive
clipping").

:class:`AdaptiveClipping` holds the public settings (re-exported as
:class:`d3p.svi.AdaptiveClipping`); the functions are the step's pure math,
used by :class:`d3p.svi.DPSVI`.
"""

import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from d3p import _validate
from d3p.gradients import add_gaussian_noise

__all__ = [
    "AdaptiveClipping",
    "chosen",
    "describe_chosen",
    "effective_sigma",
    "gradient_sigma",
    "centred_count",
    "noisy_fraction",
    "next_threshold",
    "learning_rate",
    "noise_ratio",
    "target_quantile",
]

#: The count's default share of the step's privacy: with ``count_noise`` not
#: given, ``(2 σ_b)^-2 = COUNT_SHARE · σ_eff^-2`` (a tenth of the step's
#: Gaussian "precision"; the gradient's noise is ``1 / sqrt(0.9)``, 5.4 %,
#: above what the same ε gives without adaptive clipping).
COUNT_SHARE = 0.1
#: The default bounds of ``C``: the initial threshold divided and multiplied by this.
BOUND_FACTOR = 1000.0
#: ``C`` chosen for the user (``DPSVI`` without ``clipping_threshold``, asking
#: ``run`` for an ε): adaptive clipping to this quantile of the per-record
#: gradient norms where the noise is small (benchmarks/README.md, "C chosen by
#: adaptive clipping") ...
CHOSEN_QUANTILE = 0.98
#: ... and to this one where it is large (:func:`target_quantile`): the
#: noise's share of the error outweighs the bias of clipping more records.
NOISY_QUANTILE = 0.9
#: The noise ratio ``ρ = σ sqrt(P) / B_e`` (the norm of a step's noise against
#: the largest possible clipped sum, ``B_e C``) up to which the quantile chosen
#: is :data:`CHOSEN_QUANTILE`, and from which it is :data:`NOISY_QUANTILE`;
#: between them ``γ`` falls linearly in ``log ρ``. Measured: ``ρ`` of 0.035 to
#: 0.107 preferred 0.98, of 0.24 to 3.0 preferred 0.9 (benchmarks/README.md,
#: "The quantile chosen from the noise").
NOISE_RATIO_LOW, NOISE_RATIO_HIGH = 0.1, 0.25
#: ... starting from this ``C``.
CHOSEN_FIRST_THRESHOLD = 1.0
#: The learning rate ``η`` with ``learning_rate=None`` (what ``C`` chosen gets)
#: is at most this (the paper's 0.2) ...
RATE_CAP = 0.2
#: ... and at most ``2 DRIFT_SCALE (1 - γ) / s²`` with ``s = σ_b / B_e`` the
#: noise of the estimated fraction: above the norms, where ``b̃`` is ``1 +
#: s z``, ``log C`` drifts down by ``η (1 - γ)`` a step and spreads by ``η s``,
#: so it sits above the target quantile by about ``η s² / (2 (1 - γ))``
#: (an exponential tail), at most this many nats. Without it a high quantile
#: under a noisy count lets ``C`` wander far above the norms (the README's
#: data at ε = 1: to 30 from norms of about 3; benchmarks/README.md,
#: "The chosen settings").
DRIFT_SCALE = 0.25


def effective_sigma(sigma: float, count_noise: float) -> float:
    """``σ_eff = (σ^-2 + (2 σ_b)^-2)^(-1/2)``: the noise multiplier of the
    gradient sum (noise multiplier ``sigma``) and the count (noise std
    ``count_noise``, sensitivity 1/2) released together; 0 if either is 0.

    >>> round(effective_sigma(1.0, 0.5), 6)   # equal shares: sqrt(1/2)
    0.707107
    """
    sigma = _validate.non_negative("dp_scale", sigma)
    count_noise = _validate.non_negative("count_noise", count_noise)
    if sigma == 0 or count_noise == 0:
        return 0.0
    return (sigma**-2 + (2 * count_noise) ** -2) ** -0.5


def gradient_sigma(sigma_eff: float, count_noise: float) -> float:
    """The gradient's noise multiplier ``σ = (σ_eff^-2 - (2 σ_b)^-2)^(-1/2)``
    for which :func:`effective_sigma` is ``sigma_eff`` (0 for 0), never
    smaller than that; ``ValueError`` naming ``count_noise`` if the count
    alone needs more than ``sigma_eff`` allows (``2 σ_b <= σ_eff``).

    >>> round(gradient_sigma(0.707107, 0.5), 4)
    1.0
    """
    sigma_eff = _validate.non_negative("sigma", sigma_eff)
    count_noise = _validate.non_negative("count_noise", count_noise)
    if sigma_eff == 0:
        return 0.0
    if not 2 * count_noise > sigma_eff:
        raise ValueError(
            f"Expected count_noise > sigma / 2 = {sigma_eff / 2:.4g} for adaptive clipping at the calibrated "
            f"noise multiplier sigma={sigma_eff:.4g} (the count's share of the budget would leave the gradient "
            f"none), got count_noise={count_noise:.4g}. Give a larger count_noise to AdaptiveClipping, or ask "
            "for a larger epsilon (or fewer steps).")
    sigma = (sigma_eff**-2 - (2 * count_noise) ** -2) ** -0.5
    while effective_sigma(sigma, count_noise) < sigma_eff:   # rounding: never below the calibrated σ_eff
        sigma = math.nextafter(sigma, math.inf)
    return sigma


class AdaptiveClipping(NamedTuple):
    """Adaptive clipping for :class:`d3p.svi.DPSVI`: the clipping threshold
    follows a private estimate of the ``target_quantile`` of the per-record
    gradient norms (Andrew, Thakkar, McMahan & Ramaswamy 2021).

    Pass it as ``DPSVI(..., clipping_threshold=C0, adaptive_clipping=AdaptiveClipping())``
    (or ``adaptive_clipping=True`` for these defaults): ``C0`` is the first
    step's threshold; the current one is the state's ``clipping_threshold``.
    Each step releases, beside the noisy gradient sum, the noisy count of the
    records whose gradient norm is at most ``C_t``, from which
    ``C_{t+1} = C_t exp(-η (b̃ - γ))``, clamped to ``[min_threshold,
    max_threshold]``, with ``b̃`` the estimated fraction (see
    :mod:`d3p._adaptive` and the privacy guide).

    - **target_quantile** - ``γ`` in (0, 1); default 0.5 (the median, the
      paper's choice). None: chosen from the noise ratio ``ρ = σ sqrt(P) /
      B_e`` (:func:`target_quantile`: 0.98 where ``ρ <= 0.1``, 0.9 where
      ``ρ >= 0.25``); what ``C`` chosen for the user gets.
    - **learning_rate** - ``η > 0`` of the geometric update; default 0.2 (the
      paper's choice; without noise ``C`` changes by at most a factor
      ``e^{η max(γ, 1 - γ)}`` per step). None: from the count's noise,
      ``η = min(0.2, 2 κ (1 - γ) / s²)`` with ``s = σ_b / B_e`` the noise of
      the estimated fraction and ``κ`` = :data:`DRIFT_SCALE` (public facts:
      :func:`learning_rate`); what ``C`` chosen for the user gets.
    - **count_noise** - ``σ_b >= 0``, the standard deviation of the count's
      noise; default None: the count takes :data:`COUNT_SHARE` (a tenth) of
      each step's privacy, ``σ_b = σ sqrt((1 - f) / f) / 2 = 1.5 σ`` for the
      gradient's noise multiplier ``σ`` (so any σ or ε that fixed clipping
      accepts works; the paper's ``B / 20`` is refused where ``2 σ_b <= σ_eff``).
    - **min_threshold**, **max_threshold** - public bounds of ``C``; default
      None: the initial threshold divided and multiplied by 1000. The
      overflow check of the sum uses ``max_threshold``.

    **Formal guarantees.**

    - Relation: add/remove one record (the count moves by at most 1/2) or
      substitute one (at most 1); padded records count nothing, and a record
      with a non-finite gradient counts as above ``C`` (``b_i = 0``).
    - Each step's gradient sum and count together are one Gaussian mechanism
      with noise multiplier ``σ_eff = (σ^-2 + (2 σ_b)^-2)^(-1/2)`` under
      either relation; a run is accounted at ``σ_eff`` for its sampler.
    - ``C_{t+1}`` is post-processing of the released count; the bounds and
      the estimate use public constants only (never the realised count).
    """

    target_quantile: Optional[float] = 0.5
    learning_rate: Optional[float] = 0.2
    count_noise: Optional[float] = None
    min_threshold: Optional[float] = None
    max_threshold: Optional[float] = None

    #: :func:`effective_sigma`, as a static method.
    effective_sigma = staticmethod(effective_sigma)
    #: :func:`gradient_sigma`, as a static method.
    gradient_sigma = staticmethod(gradient_sigma)

    def count_std(self, sigma: float) -> float:
        """``σ_b``: ``count_noise``, or the :data:`COUNT_SHARE` default for the
        gradient's noise multiplier ``sigma`` (0 for 0: no privacy)."""
        if self.count_noise is not None:
            return self.count_noise
        # a float for a float σ; for σ traced in run's steps, an array of its dtype
        sigma = sigma if isinstance(sigma, jax.Array) else float(sigma)
        return sigma * math.sqrt((1.0 - COUNT_SHARE) / COUNT_SHARE) / 2.0

    def split(self, sigma_eff: float) -> float:
        """The gradient's noise multiplier for a calibrated ``σ_eff`` of
        gradient and count together (:func:`gradient_sigma`; with the default
        count noise ``σ_eff / sqrt(1 - COUNT_SHARE)``, never refused)."""
        if self.count_noise is not None:
            return gradient_sigma(sigma_eff, self.count_noise)
        sigma_eff = _validate.non_negative("sigma", sigma_eff)
        sigma = sigma_eff / math.sqrt(1.0 - COUNT_SHARE)
        while sigma_eff and effective_sigma(sigma, self.count_std(sigma)) < sigma_eff:   # rounding
            sigma = math.nextafter(sigma, math.inf)
        return sigma


def chosen(value, clipping_threshold):
    """``DPSVI``'s ``adaptive_clipping`` argument where the user gave no
    ``clipping_threshold`` (then :data:`CHOSEN_FIRST_THRESHOLD` is the first
    ``C``): the user's adaptive clipping, else adaptive clipping to the
    quantile :func:`target_quantile` chooses from the noise; with a
    ``clipping_threshold``, ``value``."""
    if clipping_threshold is not None:
        return value
    if value is False:
        raise TypeError("Expected clipping_threshold with adaptive_clipping=False: without it C is chosen by "
                        "adaptive clipping.")
    return AdaptiveClipping(target_quantile=None, learning_rate=None) if value is None else value


def noise_ratio(sigma, num_params: int, expected_batch_size: float):
    """``ρ = σ sqrt(P) / B_e``: the expected norm of a step's Gaussian noise
    (noise multiplier ``σ`` on ``P`` parameters) against the largest clipped
    sum, ``B_e C`` (public facts; an array where ``σ`` is traced)."""
    return sigma * math.sqrt(max(num_params, 1)) / expected_batch_size


def target_quantile(settings: "AdaptiveClipping", sigma=None, num_params=None, expected_batch_size=None):
    """``γ`` of ``settings``: its ``target_quantile``, or for None
    :data:`CHOSEN_QUANTILE` where the noise ratio ``ρ`` (:func:`noise_ratio`
    of the gradient's noise multiplier ``sigma``, ``num_params`` and
    ``expected_batch_size``) is at most :data:`NOISE_RATIO_LOW`,
    :data:`NOISY_QUANTILE` where it is at least :data:`NOISE_RATIO_HIGH`, and
    linear in ``log ρ`` between them. A number, or a 0-d array where ``sigma``
    is traced (a run at another ε compiles nothing). Public facts only."""
    if settings.target_quantile is not None:
        return settings.target_quantile
    rho = noise_ratio(sigma, num_params, expected_batch_size)
    span = math.log(NOISE_RATIO_HIGH / NOISE_RATIO_LOW)
    if isinstance(rho, jax.Array):
        share = jnp.clip(jnp.log(jnp.maximum(rho, NOISE_RATIO_LOW) / NOISE_RATIO_LOW) / span, 0.0, 1.0)
    else:
        share = min(max(math.log(max(rho, NOISE_RATIO_LOW) / NOISE_RATIO_LOW) / span, 0.0), 1.0)
    return CHOSEN_QUANTILE - (CHOSEN_QUANTILE - NOISY_QUANTILE) * share


def learning_rate(settings: "AdaptiveClipping", count_noise, expected_batch_size, gamma=None):
    """``η`` of ``settings``: its ``learning_rate``, or for None
    ``min(RATE_CAP, 2 DRIFT_SCALE (1 - γ) / s²)``, ``s = count_noise /
    expected_batch_size`` (a number, or an array where ``count_noise`` or
    ``gamma`` is traced), ``γ``: ``gamma``, else the settings'. Public facts only."""
    if settings.learning_rate is not None:
        return settings.learning_rate
    gamma = settings.target_quantile if gamma is None else gamma
    limit = 2.0 * DRIFT_SCALE * (1.0 - gamma) * expected_batch_size**2
    if isinstance(count_noise, jax.Array) or isinstance(limit, jax.Array):
        return jnp.minimum(RATE_CAP, limit / jnp.maximum(count_noise**2, limit / RATE_CAP))
    return RATE_CAP if count_noise == 0 else min(RATE_CAP, limit / count_noise**2)


def describe_chosen(settings: "AdaptiveClipping", gamma: float, rho: float) -> str:
    """What ``run`` says when it chose ``C`` (:func:`chosen`): ``gamma`` the
    quantile and ``rho`` the noise ratio of the run (:func:`target_quantile`)."""
    why = "" if settings.target_quantile is not None else (
        f" (chosen from the noise: σ sqrt(parameters) / expected batch size = {rho:.3g}; "
        f"{CHOSEN_QUANTILE:g} up to {NOISE_RATIO_LOW:g}, {NOISY_QUANTILE:g} from {NOISE_RATIO_HIGH:g})")
    return (f"d3p: no clipping_threshold given: C follows a private estimate of the {gamma:.3g} "
            f"quantile of the per-record gradient norms{why}, from C = {CHOSEN_FIRST_THRESHOLD:g} (adaptive "
            f"clipping; its counts take {COUNT_SHARE:.0%} of each step's privacy, within the ε asked; its "
            f"learning rate is at most {RATE_CAP:g}, less where the count's noise is large)")


def resolve(value, clipping_threshold: float, *, noise: str = "gaussian", mesh=None) -> Optional[AdaptiveClipping]:
    """``DPSVI``'s ``adaptive_clipping`` argument checked and completed for the
    initial threshold ``clipping_threshold`` (None or False: None; True: the
    defaults), with every bound filled in; refused with ``noise="discrete"``
    and with a ``mesh`` (neither is supported)."""
    if value is None or value is False:
        return None
    if value is True:
        value = AdaptiveClipping()
    if not isinstance(value, AdaptiveClipping):
        raise TypeError(f"Expected adaptive_clipping to be None, True or a d3p.svi.AdaptiveClipping, got "
                        f"adaptive_clipping={value!r}.")
    if noise != "gaussian":
        raise ValueError(f"Expected noise='gaussian' with adaptive_clipping, got noise={noise!r}: the discrete "
                         "mechanism's grid and accounting are for a fixed clipping_threshold.")
    if mesh is not None:
        raise ValueError("Expected mesh=None with adaptive_clipping, got a mesh: adaptive clipping runs on one "
                         "device (its count over the records is not sharded).")
    gamma = None if value.target_quantile is None else _validate.number(
        "target_quantile", value.target_quantile, low=0.0, high=1.0, low_open=True, high_open=True)
    eta = None if value.learning_rate is None else _validate.positive("learning_rate", value.learning_rate)
    count_noise = None if value.count_noise is None else _validate.non_negative("count_noise", value.count_noise)
    if not math.isfinite(clipping_threshold):
        raise ValueError(f"Expected a finite clipping_threshold with adaptive_clipping (the first step's C), "
                         f"got clipping_threshold={clipping_threshold}.")
    low = clipping_threshold / BOUND_FACTOR if value.min_threshold is None else \
        _validate.positive("min_threshold", value.min_threshold)
    high = clipping_threshold * BOUND_FACTOR if value.max_threshold is None else \
        _validate.positive("max_threshold", value.max_threshold)
    if not low <= clipping_threshold <= high:
        raise ValueError(f"Expected min_threshold <= clipping_threshold <= max_threshold, got "
                         f"min_threshold={low}, clipping_threshold={clipping_threshold}, max_threshold={high}.")
    return AdaptiveClipping(gamma, eta, count_noise, low, high)


def centred_count(norms: jax.Array, mask: Optional[jax.Array], clipping_threshold) -> jax.Array:
    """``Σ_i (b_i - 1/2)`` over the real records, ``b_i = 1[norms_i <= C]``
    (0 for a non-finite norm), exactly (integers, then halved), as a 0-d
    array of JAX's default float dtype.

    :param norms: ``(B,)``, per record the bound of its gradient norm
        (:attr:`d3p.gradients.ClippedSum.norms`).
    :param mask: boolean ``(B,)``, True for real records, or None (all real).
    :param clipping_threshold: ``C_t`` (a number or a 0-d array).

    **Formal guarantees.** Every real record adds ``+1/2`` or ``-1/2`` and a
    padded one nothing, whatever its norm (NaN, inf or huge included): adding
    or removing one record moves the count by at most 1/2, substituting one
    by at most 1.
    """
    norms = jnp.asarray(norms)
    real = jnp.ones(norms.shape, bool) if mask is None else jnp.asarray(mask, bool)
    below = real & jnp.isfinite(norms) & (norms <= clipping_threshold)
    twice = 2 * jnp.sum(below, dtype=jnp.int32) - jnp.sum(real, dtype=jnp.int32)
    return twice.astype(jnp.result_type(float)) * 0.5


def noisy_fraction(norms, mask, clipping_threshold, count_noise: float, expected_batch_size: float,
                   noise_key, rng_suite) -> jax.Array:
    """``b̃``: the estimated fraction of records with norm at most ``C``,
    ``(centred_count + N(0, σ_b²)) / B_e + 1/2`` with ``σ_b = count_noise``
    and ``B_e`` the public ``expected_batch_size``. The noise is drawn by
    :func:`d3p.gradients.add_gaussian_noise` (noise multiplier ``2 σ_b`` at
    sensitivity 1/2) from ``noise_key``.

    **Formal guarantees.** The count (:func:`centred_count`) is released with
    Gaussian noise of standard deviation ``count_noise``; everything after
    it uses public constants only.
    """
    count = centred_count(norms, mask, clipping_threshold)
    noisy = add_gaussian_noise(count, noise_key, 2.0 * count_noise, 0.5, rng_suite)
    return noisy / jnp.asarray(expected_batch_size, noisy.dtype) + 0.5


def next_threshold(clipping_threshold, fraction, settings: AdaptiveClipping, count_noise=None,
                   expected_batch_size=None, gamma=None) -> jax.Array:
    """``clip(C exp(-η (b̃ - γ)), C_min, C_max)`` of the resolved ``settings``
    (post-processing of the released ``fraction`` b̃), in ``C``'s dtype; ``η``:
    :func:`learning_rate` (``count_noise`` and ``expected_batch_size`` are
    read only for ``learning_rate=None``); ``γ``: ``gamma``
    (:func:`target_quantile`), else the settings' ``target_quantile``."""
    C = jnp.asarray(clipping_threshold)
    gamma = settings.target_quantile if gamma is None else gamma
    eta = learning_rate(settings, count_noise, expected_batch_size, gamma)
    step = jnp.exp(-eta * (fraction - gamma))
    return jnp.clip(C * step.astype(C.dtype), settings.min_threshold, settings.max_threshold).astype(C.dtype)
