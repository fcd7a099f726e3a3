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

import math
import time
from typing import Optional, Tuple

import numpy as np

from d3p import accounting as _acc
from d3p.accounting import ADD_REMOVE, SUBSTITUTE, Phase

__all__ = ["calibrate_sigma", "approximate_sigma", "approximate_sigma_remove_relation"]


def _check_target_eps(value) -> float:
    x = _acc._as_float("target_eps", value)
    if not (x > 0 and math.isfinite(x)):
        raise ValueError(f"Expected target_eps > 0 and finite, got target_eps={value!r}")
    return x


def _check_positive(name: str, value) -> float:
    x = _acc._as_float(name, value)
    if not (x > 0 and math.isfinite(x)):
        raise ValueError(f"Expected {name} > 0 and finite, got {name}={value!r}")
    return x


def _clt_variance(relation: str, sigma: float, q: float) -> float:
    """Small-q approximation of the variance of the one-step privacy loss."""
    a = 1.0 / (sigma * sigma)
    if a > 600:
        return math.inf
    if relation == ADD_REMOVE:
        return q * q * math.expm1(a)
    return 4.0 * q * q * math.sinh(a)


def _clt_epsilon(relation: str, sigma: float, q: float, num_iter: int, delta: float) -> float:
    """Central-limit (Gaussian) approximation of ε; used only as a start."""
    if q == 1.0:
        var = (_acc._SENSITIVITY[relation] / sigma) ** 2
    else:
        var = _clt_variance(relation, sigma, q)
    if not math.isfinite(var):
        return math.inf
    return _acc._gaussian_epsilon(math.sqrt(num_iter * var), delta)


def _bisect_log_sigma(eps_fn, target: float, lo: float = 1e-3, hi: float = 1e5, iters: int = 60) -> float:
    """Smallest σ in [lo, hi] (up to bisection accuracy) with eps_fn(σ) ≤ target,
    assuming eps_fn decreasing. Returns the feasible end."""
    if eps_fn(hi) > target:
        return hi
    if eps_fn(lo) <= target:
        return lo
    a, b = math.log(lo), math.log(hi)
    for _ in range(iters):
        m = 0.5 * (a + b)
        if eps_fn(math.exp(m)) > target:
            a = m
        else:
            b = m
        if b - a < 1e-7:
            break
    return math.exp(b)


def _coarse_search(relation, q, num_iter, delta, target_eps, s0, aim, slope, state, deadline,
                   max_steps: int = 8):
    """Secant search on log σ with :func:`d3p.accounting._fourier_estimate`;
    returns (σ, slope) to start the verified search from."""
    u, pts = math.log(s0), []
    for _ in range(max_steps):
        if time.monotonic() > deadline:
            break
        try:
            e = _acc._fourier_estimate(relation, [Phase(math.exp(u), q, num_iter)], delta)
        except (ValueError, FloatingPointError, OverflowError, MemoryError):  # pragma: no cover
            e = None
        state["evals"] += 1
        if e is None:
            break
        g = math.log(e / target_eps) if e > 0 else -math.inf
        pts.append((u, g))
        if not math.isfinite(g):
            u += -1.0 if g < 0 else 1.0
            continue
        if len(pts) >= 2:
            (u1, g1), (u2, g2) = pts[-2], pts[-1]
            if math.isfinite(g1) and u1 != u2 and g1 != g2:
                s = (g2 - g1) / (u2 - u1)
                if s < 0:
                    slope = max(min(s, -0.2), -20.0)
        if abs(g - aim) <= 0.25 * abs(aim):
            break
        u += max(min((aim - g) / slope, 2.0), -2.0)
    return math.exp(u), slope


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
    target_eps = _check_target_eps(target_eps)
    delta = _acc._check_delta(delta)
    q = _acc._check_q(q)
    num_iter = _acc._check_steps(num_iter, "num_iter", minimum=1)
    tol = _check_positive("tol", tol)
    if tol >= 0.5:
        raise ValueError(f"Expected tol in (0, 0.5), got tol={tol!r}")
    max_time = _check_positive("max_time", max_time)
    max_evals = _acc._check_steps(max_evals, "max_evals", minimum=1)
    accountant = _acc._check_accountant(accountant)
    sigma, eps, evals = _calibrate_pair(accounting.pair, target_eps, delta, q, num_iter, tol=tol,
                                        max_time=max_time, max_evals=max_evals, accountant=accountant)
    return sigma * accounting.noise_divisor, eps, evals


def _calibrate_pair(relation, target_eps, delta, q, num_iter, *, tol, max_time, max_evals, accountant):
    """:func:`_calibrate` for the composed pair ``relation`` (validated inputs)."""
    # σ = 0 already meets the target if the record is used with prob. ≤ δ.
    if -math.expm1(num_iter * math.log1p(-q) if q < 1 else -math.inf) <= delta:
        return 0.0, 0.0, 0

    if q == 1.0:
        # Gaussian mechanism: exact. ε is increasing in μ = Δ sqrt(T) / σ.
        scale = _acc._SENSITIVITY[relation] * math.sqrt(num_iter)
        lo, hi = 0.0, 1.0
        while _acc._gaussian_epsilon(hi, delta) <= target_eps:
            lo, hi = hi, hi * 2
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            if _acc._gaussian_epsilon(mid, delta) <= target_eps:
                lo = mid
            else:
                hi = mid
            if hi - lo <= 1e-12 * hi:
                break
        lo = max(lo, 1e-300)
        return scale / lo, float(_acc._gaussian_epsilon(lo, delta)), 1

    deadline = time.monotonic() + max_time
    state = {"evals": 0, "grid": None}

    def eps_of(sigma: float) -> float:
        # the cross-check with the fourier-accountant package is done once,
        # for the σ that is returned, on the grid that certified it
        grid = {}
        eps, n, engine, _ = _acc._epsilon_impl(
            relation, [Phase(sigma, q, num_iter)], delta, accountant,
            deadline=deadline, package_check=False, grid_out=grid,
        )
        state["evals"] += n
        state["grid"] = grid if engine == "exact" else None
        return eps

    # Starting point: central-limit approximation (cheap, closed form).
    s0 = _bisect_log_sigma(lambda s: _clt_epsilon(relation, s, q, num_iter, delta), target_eps)
    aim = math.log1p(-tol / 2)
    accept = math.log1p(-tol)
    slope = -1.5            # d log ε / d log σ, refined from the points
    if accountant == "fourier":
        # Coarse search with cheap unverified estimates (one exact-mass grid
        # each); only its end point is carried over, every σ returned is
        # evaluated by the verified accountant below.
        s0, slope = _coarse_search(relation, q, num_iter, delta, target_eps, s0, aim, slope, state, deadline)
    # Search on u = log σ for g(u) = log(ε(σ) / target) = 0, aiming slightly
    # below the target; keep a bracket [lo (infeasible), hi (feasible)].
    lo = hi = None          # (u, g)
    hi_eps = hi_grid = None
    pts = []
    u = math.log(s0)
    for _ in range(max_evals):
        e = eps_of(math.exp(u))
        g = math.log(e / target_eps) if e > 0 else -math.inf
        pts.append((u, g))
        if g <= 0:
            if hi is None or u < hi[0]:
                hi, hi_eps, hi_grid = (u, g), e, state["grid"]
        else:
            if lo is None or u > lo[0]:
                lo = (u, g)
        if hi is not None and (hi[1] >= accept or (lo is not None and hi[0] - lo[0] <= math.log1p(tol))):
            break  # (also when numerical noise inverted the bracket)
        if time.monotonic() > deadline or state["evals"] >= max_evals:
            break
        # next point: secant on the last two finite points, else slope step
        if len(pts) >= 2:
            (u1, g1), (u2, g2) = pts[-2], pts[-1]
            if math.isfinite(g1) and math.isfinite(g2) and u1 != u2 and g1 != g2:
                s = (g2 - g1) / (u2 - u1)
                if s < 0:
                    slope = max(min(s, -0.2), -20.0)
        if math.isfinite(g):
            step = (aim - g) / slope
        else:
            step = -1.0 if g < 0 else 1.0   # ε = 0: far too much noise
        step = max(min(step, 2.0), -2.0)
        u_new = u + step
        if lo is not None and hi is not None:
            if not (lo[0] < u_new < hi[0]):
                u_new = 0.5 * (lo[0] + hi[0])
            # avoid creeping: stay at least 5% of the bracket from its ends
            w = hi[0] - lo[0]
            u_new = min(max(u_new, lo[0] + 0.05 * w), hi[0] - 0.05 * w)
        u = u_new
    if hi is not None and hi_grid is not None:
        # a disagreement with the package: the RDP calibration below instead
        if not _acc._package_agrees(relation, [Phase(math.exp(hi[0]), q, num_iter)], hi_eps, delta,
                                    hi_grid["nx"], hi_grid["L"]):
            hi = None
    if hi is not None:
        return math.exp(hi[0]), hi_eps, state["evals"]
    # No feasible point within the budget: the RDP bound (rigorous, cheap).
    n_rdp = [0]

    def rdp_fn(s: float) -> float:
        n_rdp[0] += 1
        return _acc._rdp_epsilon(relation, [Phase(s, q, num_iter)], delta)

    lo, hi = s0 / 2, s0 * 2
    while rdp_fn(hi) > target_eps and hi < 1e8:
        lo, hi = hi, hi * 4
    while rdp_fn(lo) <= target_eps and lo > 1e-8:
        lo, hi = lo / 4, lo
    sigma = _bisect_log_sigma(rdp_fn, target_eps, lo=lo, hi=hi, iters=int(math.ceil(math.log2(
        math.log(hi / lo) / math.log1p(tol)))) + 1)
    eps = rdp_fn(sigma)
    for _ in range(64):
        if eps <= target_eps:
            break
        sigma *= 2
        eps = rdp_fn(sigma)
    return sigma, eps, state["evals"] + n_rdp[0]


def _compat_max_evals(maxeval, max_evals, force_smaller) -> int:
    """``max_evals``, or d3p 0.2's ``maxeval`` where given; checks ``force_smaller``."""
    if not isinstance(force_smaller, (bool, np.bool_)):
        raise TypeError(f"Expected force_smaller to be a bool, got force_smaller={force_smaller!r}")
    return max_evals if maxeval is None else _acc._check_steps(maxeval, "maxeval", minimum=1)


def calibrate_sigma(
    target_eps: float,
    delta: float,
    q: float,
    num_iter: int,
    *,
    sampler: Optional[str] = None,
    relation: Optional[str] = None,
    tol: float = 1e-3,
    max_time: float = 60.0,
    max_evals: int = 60,
    accountant: str = "fourier",
) -> Tuple[float, float, int]:
    """Smallest noise multiplier σ for which ``num_iter`` steps with sampling
    probability ``q`` and the given sampler are (``target_eps``,
    ``delta``)-DP under the given relation.

    ``sampler`` and ``relation`` are resolved by
    :func:`d3p.accounting.accounting_for` (default: Poisson sampling under
    add/remove). :func:`approximate_sigma` is
    ``calibrate_sigma(..., sampler="fixed_size")`` and
    :func:`approximate_sigma_remove_relation` is
    ``calibrate_sigma(..., sampler="poisson")``.

    Arguments, return value and **Formal guarantees** as
    :func:`approximate_sigma`, for the resolved sampler and relation.

    >>> from d3p.dputil import calibrate_sigma
    >>> sigma, eps, _ = calibrate_sigma(1.0, 1e-6, 0.1, 512)
    >>> 9.5 < sigma < 9.8 and eps <= 1.0
    True
    """
    return _calibrate(_acc.accounting_for(sampler, relation), target_eps, delta, q, num_iter,
                      tol=tol, max_time=max_time, max_evals=max_evals, accountant=accountant)


def approximate_sigma(
    target_eps: float,
    delta: float,
    q: float,
    num_iter: int,
    tol: float = 1e-3,
    force_smaller: bool = True,
    *,
    maxeval: Optional[int] = None,
    max_time: float = 60.0,
    max_evals: int = 60,
    accountant: str = "fourier",
) -> Tuple[float, float, int]:
    """Smallest noise multiplier σ for which ``num_iter`` steps with sampling
    ratio ``q`` are (``target_eps``, ``delta``)-DP under the **substitute**
    relation, for fixed-size batches sampled **without replacement**
    (``subsample_batchify_data``, ``DPSVI.run(sampling="fixed")``).

    The pair composed is the one that dominates this sampler (see
    :func:`d3p.accounting.accounting_for`): the add/remove subsampled
    Gaussian with noise multiplier σ/2, because a substituted record's slot
    is refilled by another record when it is not sampled. (The midpoint pair
    of the Fourier accountant's "S" relation and of the d3p paper is
    optimistic for fixed-size batches: at q = 0.01, T = 1000, δ = 1e-5 it
    accepts σ = 0.822 for ε = 4, whose true ε is about 25; this function
    returns σ = 1.47 there.)

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
    :param int maxeval: d3p 0.2's name for ``max_evals`` (if given, it is used
        instead).
    :param float max_time: soft limit in seconds for the search (default 60);
        when reached, the best σ verified so far (or the RDP calibration) is
        returned.
    :param int max_evals: limit on the number of accountant evaluations.
    :param str accountant: ``"fourier"`` (default), ``"rdp"`` or ``"pld"``
        (see :mod:`d3p.accounting`).
    :return: ``(sigma, eps, num_evals)``: the noise multiplier, the ε it
        achieves at ``delta`` (by the accountant and rules of
        :func:`d3p.accounting.compute_epsilon`), and the number of accountant
        evaluations made (FFT compositions, or accountant calls for
        ``"rdp"``/``"pld"``).

    **Formal guarantees** (substitute relation, fixed-size sampling without
    replacement, Gaussian noise of std σ·C on the sum of per-record
    contributions clipped to norm C; the pair's proof is in
    :func:`d3p.accounting.accounting_for`):

    * ``eps <= target_eps``, and ``eps`` is an upper bound on the true ε of
      the returned σ with the accountant's numerical error included (see
      :func:`d3p.accounting.compute_epsilon`): every σ returned was evaluated
      and accepted, none is interpolated.
    * σ is within ``tol`` (relative) of the smallest σ the accountant accepts,
      and, with the Fourier accountant, within 0.5% of the smallest σ meeting
      the target (checked against dp-accounting's PLD accountant in the
      tests, called directly with a ``PoissonSampledDpEvent`` of a Gaussian
      with noise multiplier σ/2). Where the Fourier accountant cannot verify
      a value, the RDP bound is used and σ can be larger (safe, not optimal).
    * If the record is used with probability 1 − (1 − q)^T ≤ δ, no noise is
      needed: returns ``(0.0, 0.0, 0)``.
    * q = 1: exact closed form of the Gaussian mechanism (sensitivity 2C).
    * No exception for valid inputs; bounded time (``max_time``, a grid cap
      of 2^21 points and ``max_evals``). Invalid inputs raise ``ValueError``
      naming the argument.

    >>> from d3p.dputil import approximate_sigma
    >>> sigma, eps, _ = approximate_sigma(1.0, 1e-5, 0.01, 2000)
    >>> eps <= 1.0
    True
    """
    max_evals = _compat_max_evals(maxeval, max_evals, force_smaller)
    return _calibrate(_acc.accounting_for("fixed_size", SUBSTITUTE), target_eps, delta, q, num_iter, tol=tol,
                      max_time=max_time, max_evals=max_evals, accountant=accountant)


def approximate_sigma_remove_relation(
    target_eps: float,
    delta: float,
    q: float,
    num_iter: int,
    tol: float = 1e-3,
    force_smaller: bool = True,
    *,
    maxeval: Optional[int] = None,
    max_time: float = 60.0,
    max_evals: int = 60,
    accountant: str = "fourier",
) -> Tuple[float, float, int]:
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
    return _calibrate(_acc.accounting_for("poisson", ADD_REMOVE), target_eps, delta, q, num_iter, tol=tol,
                      max_time=max_time, max_evals=max_evals, accountant=accountant)
