# SPDX-License-Identifier: Apache-2.0
"""Noise calibration: the smallest noise multiplier σ meeting a target (ε, δ).

Pick the function that matches the batch sampler of the run:

* :func:`calibrate_sigma`: any sampler and relation, resolved by
  :func:`d3p.accounting.accounting_for` (default: Poisson sampling under
  add/remove, d3p's default).
* :func:`approximate_sigma`: fixed-size batches drawn without replacement
  (``d3p.minibatch.subsample_batchify_data``) under the *substitute*
  (replace-one) relation, accounted with the pair that dominates it: the
  add/remove subsampled Gaussian at noise multiplier σ/2 (not the midpoint
  pair of the Fourier accountant's "S" relation, which is optimistic here).
* :func:`approximate_sigma_remove_relation`: Poisson sampling
  (``d3p.minibatch.poisson_batchify_data``), analysed under the *add/remove*
  relation; Fourier accountant "R".

δ should be well below 1/N for a data set of N records. See
:mod:`d3p.accounting` for the relations, accountants and ε of a finished run.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Callable, NamedTuple, Optional, Tuple

from d3p import _validate
from d3p import accounting as _acc
from d3p._accounting import _dominating, _engine, _gaussian, _rdp
from d3p._accounting._search import safe_root
from d3p.accounting import ADD_REMOVE, SUBSTITUTE, Phase

__all__ = ["calibrate_sigma", "approximate_sigma", "approximate_sigma_remove_relation"]


def _clt_variance(pair: str, sigma: float, q: float) -> float:
    """Small-q approximation of the variance of the one-step privacy loss."""
    a = 1.0 / (sigma * sigma)
    if a > 600:
        return math.inf
    if pair == ADD_REMOVE:
        return q * q * math.expm1(a)
    return 4.0 * q * q * math.sinh(a)


def _clt_epsilon(pair: str, sigma: float, q: float, num_iter: int, delta: float) -> float:
    """Central-limit (Gaussian) approximation of ε; used only as a start."""
    if q == 1.0:
        var = (_gaussian.SENSITIVITY[pair] / sigma) ** 2
    else:
        var = _clt_variance(pair, sigma, q)
    if not math.isfinite(var):
        return math.inf
    return _gaussian.epsilon(math.sqrt(num_iter * var), delta)


def _smallest_sigma(eps_fn: Callable[[float], float], target: float, lo: float, hi: float,
                    log_tol: float) -> float:
    """Smallest σ in [lo, hi] with eps_fn(σ) ≤ target, for eps_fn decreasing,
    to ``log_tol`` in log σ and never below it; ``hi`` if even that misses."""
    values = {}

    def excess(u: float) -> float:
        if u not in values:
            values[u] = eps_fn(math.exp(u)) - target
        return values[u]

    a, b = math.log(lo), math.log(hi)
    if excess(b) > 0:
        return hi
    return math.exp(safe_root(excess, a, b, xtol=log_tol))


class _Verified:
    """The accountant for one search: ε of σ (an upper bound, see
    :func:`d3p.accounting.compute_epsilon`), with the number of evaluations made."""

    def __init__(self, pair: str, q: float, num_iter: int, delta: float, accountant: str, deadline: float):
        self.pair, self.q, self.num_iter, self.delta = pair, q, num_iter, delta
        self.accountant, self.deadline = accountant, deadline
        self.evals = 0

    def __call__(self, sigma: float) -> float:
        """ε of σ."""
        self.evals += 1
        return _engine.epsilon(self.pair, [Phase(sigma, self.q, self.num_iter)], self.delta, self.accountant).value


def _secant_slope(pts, slope: float) -> float:
    """d log ε / d log σ from the last two finite points, bounded to [-20, -0.2]
    (``slope`` where they do not give a decreasing secant)."""
    if len(pts) >= 2:
        (u1, g1), (u2, g2) = pts[-2], pts[-1]
        if math.isfinite(g1) and math.isfinite(g2) and u1 != u2 and g1 != g2:
            s = (g2 - g1) / (u2 - u1)
            if s < 0:
                slope = max(min(s, -0.2), -20.0)
    return slope


def _coarse_search(verified: _Verified, target_eps, s0, aim, slope, max_steps: int = 8):
    """Secant search on log σ with the coarse grid's ε
    (:func:`d3p._accounting._dominating.estimate`, an upper bound too, looser
    and cheaper); returns (σ, slope) to start the search with the full
    accountant from."""
    u, pts = math.log(s0), []
    for _ in range(max_steps):
        if time.monotonic() > verified.deadline:
            break
        try:
            phases = [Phase(math.exp(u), verified.q, verified.num_iter)]
            e = _dominating.estimate(verified.pair, phases, verified.delta,
                                     guess=_rdp.epsilon(verified.pair, phases, verified.delta))
        except (ValueError, FloatingPointError, OverflowError, MemoryError):  # pragma: no cover
            e = None
        verified.evals += 1
        if e is None:
            break
        g = math.log(e / target_eps) if e > 0 else -math.inf
        pts.append((u, g))
        if not math.isfinite(g):
            u += -1.0 if g < 0 else 1.0
            continue
        slope = _secant_slope(pts, slope)
        if abs(g - aim) <= 0.25 * abs(aim):
            break
        u += max(min((aim - g) / slope, 2.0), -2.0)
    return math.exp(u), slope


class _Found(NamedTuple):
    """The smallest σ a search accepted, with its ε."""

    sigma: float
    eps: float


def _next_u(u: float, g: float, slope: float, aim: float, lo, hi) -> float:
    """The next log σ: a secant step towards ``aim`` (at most 2), kept inside
    the bracket (lo infeasible, hi feasible) and 5% of its width from its ends
    (no creeping)."""
    step = (aim - g) / slope if math.isfinite(g) else (-1.0 if g < 0 else 1.0)  # ε = 0: far too much noise
    u_new = u + max(min(step, 2.0), -2.0)
    if lo is not None and hi is not None:
        if not (lo[0] < u_new < hi[0]):
            u_new = 0.5 * (lo[0] + hi[0])
        w = hi[0] - lo[0]
        u_new = min(max(u_new, lo[0] + 0.05 * w), hi[0] - 0.05 * w)
    return u_new


def _verified_search(verified: _Verified, target_eps, s0, slope, tol, max_evals) -> Optional[_Found]:
    """Search on u = log σ for g(u) = log(ε(σ) / target) = 0 with the
    verified accountant, aiming slightly below the target and keeping a
    bracket [lo (infeasible), hi (feasible)]; stops once ε is within ``tol``
    below the target or σ is bracketed to a relative ``tol``. None if no
    evaluated σ meets the target.

    A safeguarded secant rather than :func:`scipy.optimize.brentq` (which the
    other searches use, through ``safe_root``): every evaluation is an FFT
    composition, so the search stops at the first σ whose ε
    lands in the accepted window ``[target (1 - tol), target]`` instead of
    refining towards the root, and it keeps to an evaluation budget and a
    deadline, returning the best verified σ found when either runs out."""
    aim, accept = math.log1p(-tol / 2), math.log1p(-tol)
    lo = hi = found = None          # (u, g)
    pts = []
    u = math.log(s0)
    for _ in range(max_evals):
        e = verified(math.exp(u))
        g = math.log(e / target_eps) if e > 0 else -math.inf
        pts.append((u, g))
        if g <= 0:
            if hi is None or u < hi[0]:
                hi, found = (u, g), _Found(math.exp(u), e)
        elif lo is None or u > lo[0]:
            lo = (u, g)
        if hi is not None and (hi[1] >= accept or (lo is not None and hi[0] - lo[0] <= math.log1p(tol))):
            break  # (also when numerical noise inverted the bracket)
        if time.monotonic() > verified.deadline or verified.evals >= max_evals:
            break
        slope = _secant_slope(pts, slope)
        u = _next_u(u, g, slope, aim, lo, hi)
    return found


def _bracketed_calibration(eps_of: Callable[[float], float], target_eps, s0, tol, grow: float):
    """(σ, ε, evaluations): the smallest σ, to a relative ``tol``, with
    ``eps_of(σ) <= target_eps``, for a rigorous bound ``eps_of`` that is
    non-increasing in σ; bracketed from ``s0``, then bisected, then raised by
    the factor ``grow`` until it meets the target. Every σ returned is evaluated."""
    evals = {}

    def eps_fn(s: float) -> float:
        if s not in evals:
            evals[s] = eps_of(s)
        return evals[s]

    lo, hi = s0 / 2, s0 * 2
    while eps_fn(hi) > target_eps and hi < 1e8:
        lo, hi = hi, hi * 4
    while eps_fn(lo) <= target_eps and lo > 1e-8:
        lo, hi = lo / 4, lo
    sigma = _smallest_sigma(eps_fn, target_eps, lo, hi, 0.5 * math.log1p(tol))
    for _ in range(64):
        if eps_fn(sigma) <= target_eps:
            break
        sigma *= grow
    return sigma, eps_fn(sigma), len(evals)


def _rdp_calibration(pair, target_eps, delta, q, num_iter, s0, tol) -> Tuple[float, float, int]:
    """(σ, ε, evaluations) calibrated with the RDP bound (rigorous, cheap)."""
    return _bracketed_calibration(lambda s: _rdp.epsilon(pair, [Phase(s, q, num_iter)], delta),
                                  target_eps, s0, tol, 2.0)


def _discrete_calibration(accounting, target_eps, delta, q, num_iter, tol) -> Tuple[float, float, int]:
    """(σ, ε, evaluations) for the discrete mechanism: the smallest σ, to a
    relative ``tol``, whose Rényi-DP bound (:func:`d3p.accounting.compute_epsilon`
    with ``noise="discrete"``) meets the target."""
    if -math.expm1(num_iter * math.log1p(-q) if q < 1 else -math.inf) <= delta:
        return 0.0, 0.0, 0
    return _bracketed_calibration(
        lambda s: _acc._epsilon(accounting, [Phase(s, q, num_iter)], delta, "rdp"), target_eps, 1.0, tol, 1 + tol)


def _calibrate(
    accounting: _acc.SamplerAccounting,
    target_eps,
    delta,
    q,
    num_iter,
    *,
    tol: float,
    max_time: float,
    max_evals: int,
    accountant: str,
) -> Tuple[float, float, int]:
    """(σ, ε, evaluations) for the sampler and relation of ``accounting``.

    The search runs on the noise multiplier of the composed pair, σ /
    ``accounting.noise_divisor``; the σ returned is that times the divisor.
    """
    target_eps = _validate.positive("target_eps", target_eps)
    delta = _validate.open_unit("delta", delta)
    q = _validate.probability("q", q)
    num_iter = _acc._steps("num_iter", num_iter, minimum=1)
    tol = _validate.number("tol", tol, low=0.0, high=0.5, low_open=True, high_open=True)
    max_time = _validate.positive("max_time", max_time)
    max_evals = _acc._steps("max_evals", max_evals, minimum=1)
    accountant = _acc._accountant(accountant)
    return _calibrate_cached(accounting, target_eps, delta, q, num_iter, tol, max_time, max_evals, accountant)


@functools.lru_cache(maxsize=1024)
def _calibrate_cached(accounting, target_eps, delta, q, num_iter, tol, max_time, max_evals,
                      accountant) -> Tuple[float, float, int]:
    """:func:`_calibrate` for validated inputs, memoised per process on all of
    them (a second ``DPSVI.run(epsilon=...)`` with the same plan calibrates
    nothing); the number of evaluations is that of the first call."""
    if accounting.noise == "discrete":
        return _discrete_calibration(accounting, target_eps, delta, q, num_iter, tol)
    sigma, eps, evals = _calibrate_pair(accounting.pair, target_eps, delta, q, num_iter, tol=tol,
                                        max_time=max_time, max_evals=max_evals, accountant=accountant)
    return sigma * accounting.noise_divisor, eps, evals


def _calibrate_pair(pair, target_eps, delta, q, num_iter, *, tol, max_time, max_evals, accountant):
    """(σ, ε, evaluations) of the smallest noise multiplier σ of the composed
    ``pair`` that meets (``target_eps``, ``delta``), for validated inputs.

    No noise if the record is used with probability ≤ δ; q = 1 by the closed
    form; otherwise a central-limit start, a coarse search on cheap bounds
    (the Fourier accountant's coarse grid), then the search with the full
    accountant. Where it finds no σ (budget, deadline), the RDP calibration
    is returned.
    """
    # σ = 0 already meets the target if the record is used with prob. ≤ δ.
    if -math.expm1(num_iter * math.log1p(-q) if q < 1 else -math.inf) <= delta:
        return 0.0, 0.0, 0
    if q == 1.0:
        # Gaussian mechanism: exact. ε is increasing in μ = Δ sqrt(T) / σ.
        mu = _gaussian.largest_mu(target_eps, delta)
        scale = _gaussian.SENSITIVITY[pair] * math.sqrt(num_iter)
        return scale / mu, float(_gaussian.epsilon(mu, delta)), 1
    verified = _Verified(pair, q, num_iter, delta, accountant, time.monotonic() + max_time)
    s0 = _smallest_sigma(lambda s: _clt_epsilon(pair, s, q, num_iter, delta), target_eps, 1e-3, 1e5, 1e-7)
    slope = -1.5            # d log ε / d log σ, refined from the points
    if accountant == "fourier":
        # only the coarse search's end point is carried over: every σ
        # returned is evaluated by the full accountant
        s0, slope = _coarse_search(verified, target_eps, s0, math.log1p(-tol / 2), slope)
    found = _verified_search(verified, target_eps, s0, slope, tol, max_evals)
    if found is not None:
        return found.sigma, found.eps, verified.evals
    sigma, eps, n_rdp = _rdp_calibration(pair, target_eps, delta, q, num_iter, s0, tol)
    return sigma, eps, verified.evals + n_rdp


def _compat_max_evals(maxeval, max_evals, force_smaller) -> int:
    """``max_evals``, or d3p 0.2's ``maxeval`` where given; checks ``force_smaller``."""
    _validate.boolean("force_smaller", force_smaller)
    return max_evals if maxeval is None else _acc._steps("maxeval", maxeval, minimum=1)


def calibrate_sigma(target_eps: float, delta: float, q: float, num_iter: int, *, sampler: Optional[str] = None,
                    relation: Optional[str] = None, tol: float = 1e-3, max_time: float = 60.0,
                    max_evals: int = 60, accountant: str = "fourier",
                    noise: str = "gaussian") -> Tuple[float, float, int]:
    """Smallest noise multiplier σ for which ``num_iter`` steps with sampling
    probability ``q`` and the given sampler are (``target_eps``,
    ``delta``)-DP under the given relation.

    ``sampler`` and ``relation`` are resolved by
    :func:`d3p.accounting.accounting_for` (default: Poisson sampling under
    add/remove). :func:`approximate_sigma` is
    ``calibrate_sigma(..., sampler="fixed_size")`` and
    :func:`approximate_sigma_remove_relation` is
    ``calibrate_sigma(..., sampler="poisson")``. ``noise="discrete"``
    calibrates for the discrete Gaussian mechanism of :mod:`d3p.discrete`
    (by its Rényi-DP bound, see :func:`d3p.accounting.accounting_for`).

    Arguments, return value and **Formal guarantees** as
    :func:`approximate_sigma`, for the resolved sampler and relation.

    >>> from d3p.dputil import calibrate_sigma
    >>> sigma, eps, _ = calibrate_sigma(1.0, 1e-6, 0.1, 512)
    >>> 9.5 < sigma < 9.8 and eps <= 1.0
    True
    """
    return _calibrate(_acc.accounting_for(sampler, relation, noise), target_eps, delta, q, num_iter,
                      tol=tol, max_time=max_time, max_evals=max_evals, accountant=accountant)


def approximate_sigma(target_eps: float, delta: float, q: float, num_iter: int, tol: float = 1e-3,
                      force_smaller: bool = True, *, maxeval: Optional[int] = None, max_time: float = 60.0,
                      max_evals: int = 60, accountant: str = "fourier",
                      noise: str = "gaussian") -> Tuple[float, float, int]:
    """Smallest noise multiplier σ for which ``num_iter`` steps with sampling
    ratio ``q`` are (``target_eps``, ``delta``)-DP under the **substitute**
    relation, for fixed-size batches sampled **without replacement**
    (``subsample_batchify_data``, ``DPSVI.run(sampling="fixed")``).

    The pair composed is the add/remove subsampled Gaussian with noise
    multiplier σ/2 (:func:`d3p.accounting.accounting_for`), not the midpoint
    pair, which is optimistic for fixed-size batches (``docs/privacy_accounting.md``).
    Poisson sampling (d3p's default) needs about half the noise for the same
    ε: use :func:`approximate_sigma_remove_relation`.

    :param float target_eps: target ε > 0 (tested for 0.01 ≤ ε ≤ 100).
    :param float delta: target δ in (0, 1); choose it well below 1/N.
    :param float q: sampling ratio B/N in (0, 1]; 1 means full batches.
    :param int num_iter: number of steps T ≥ 1.
    :param float tol: relative tolerance: the search stops once the achieved ε
        is within ``target_eps * (1 - tol)`` and ``target_eps``, or σ is
        bracketed to a relative ``tol`` (default 1e-3). Accepted as the fifth
        positional argument, as in d3p 0.2.
    :param bool force_smaller: accepted for d3p 0.2 programs; the returned ε
        is always at most ``target_eps`` (``False`` does not relax that).
    :param int maxeval: d3p 0.2's name for ``max_evals`` (used if given).
    :param float max_time: soft limit in seconds (default 60); when reached,
        the best σ verified so far (or the RDP calibration) is returned.
    :param int max_evals: limit on the number of accountant evaluations.
    :param str accountant: ``"fourier"`` (default), ``"rdp"`` or ``"pld"``
        (see :mod:`d3p.accounting`).
    :param str noise: ``"gaussian"`` (default) or ``"discrete"``: calibrate for
        ``DPSVI(noise="discrete")`` by its Rényi-DP bound (``accountant`` unused).
    :return: ``(sigma, eps, num_evals)``: the noise multiplier, the ε it
        achieves at ``delta`` (as :func:`d3p.accounting.compute_epsilon`), and
        the accountant evaluations made (by the first call; cached per process).

    **Formal guarantees** (substitute relation, fixed-size sampling without
    replacement, noise std σ·C on the sum of contributions clipped to norm C;
    the details in ``docs/privacy_accounting.md``, "Calibration"):

    * ``eps <= target_eps``, an upper bound on the true ε of σ with the
      accountant's numerical error included; no σ returned is interpolated.
    * σ is within ``tol`` (relative) of the smallest σ the accountant accepts
      (larger, safe, where the Fourier accountant falls back to RDP).
    * ``(0.0, 0.0, 0)`` if the record is used with probability
      1 − (1 − q)^T ≤ δ; q = 1: the Gaussian mechanism's exact closed form.
    * Bounded time; invalid inputs raise ``ValueError`` naming the argument.

    >>> from d3p.dputil import approximate_sigma
    >>> sigma, eps, _ = approximate_sigma(1.0, 1e-5, 0.01, 2000)
    >>> eps <= 1.0
    True
    """
    max_evals = _compat_max_evals(maxeval, max_evals, force_smaller)
    return _calibrate(_acc.accounting_for("fixed_size", SUBSTITUTE, noise), target_eps, delta, q, num_iter, tol=tol,
                      max_time=max_time, max_evals=max_evals, accountant=accountant)


def approximate_sigma_remove_relation(target_eps: float, delta: float, q: float, num_iter: int, tol: float = 1e-3,
                                      force_smaller: bool = True, *, maxeval: Optional[int] = None,
                                      max_time: float = 60.0, max_evals: int = 60,
                                      accountant: str = "fourier",
                                      noise: str = "gaussian") -> Tuple[float, float, int]:
    """Smallest noise multiplier σ for which ``num_iter`` steps with sampling
    probability ``q`` are (``target_eps``, ``delta``)-DP under the
    **add/remove** relation, for **Poisson sampling** (each record included
    independently with probability q: ``poisson_batchify_data``; Fourier
    accountant "R").

    For fixed-size batches without replacement use :func:`approximate_sigma`.

    :param float target_eps: target ε > 0 (tested for 0.01 ≤ ε ≤ 100).
    :param float delta: target δ in (0, 1); choose it well below 1/N.
    :param float q: sampling probability in (0, 1]; 1 means every record in
        every step.
    :param int num_iter: number of steps T ≥ 1.
    :param float tol: relative tolerance (see :func:`approximate_sigma`).
    :param bool force_smaller: see :func:`approximate_sigma`.
    :param int maxeval: d3p 0.2's name for ``max_evals``.
    :param float max_time: soft limit in seconds (default 60).
    :param int max_evals: limit on the number of accountant evaluations.
    :param str accountant: ``"fourier"`` (default), ``"rdp"`` or ``"pld"``.
    :param str noise: ``"gaussian"`` (default) or ``"discrete"`` (see :func:`approximate_sigma`).
    :return: ``(sigma, eps, num_evals)`` as for :func:`approximate_sigma`.

    **Formal guarantees** (add/remove relation, Poisson sampling, Gaussian
    noise of std σ·C on the sum of per-record contributions clipped to norm
    C): as for :func:`approximate_sigma`; q = 1 uses the exact closed form of
    the Gaussian mechanism with sensitivity C.

    >>> from d3p.dputil import approximate_sigma_remove_relation
    >>> sigma, eps, _ = approximate_sigma_remove_relation(1.0, 1e-6, 0.1, 512)
    >>> 9.5 < sigma < 9.8 and eps <= 1.0
    True
    """
    max_evals = _compat_max_evals(maxeval, max_evals, force_smaller)
    return _calibrate(_acc.accounting_for("poisson", ADD_REMOVE, noise), target_eps, delta, q, num_iter, tol=tol,
                      max_time=max_time, max_evals=max_evals, accountant=accountant)
