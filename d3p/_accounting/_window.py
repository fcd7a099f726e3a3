# SPDX-License-Identifier: Apache-2.0
"""The grid window of the Fourier accountant: one-step loss statistics and
tail bounds on the composed privacy loss.

The window [-L, L] is chosen so that a tail bound on the mass of the composed
loss above L (Chernoff with the one-step cumulant generating function, or
Bennett's inequality for the losses truncated at a level each step exceeds
with negligible probability) is at most a small fraction of δ.
"""

import functools
import math
from typing import Callable, NamedTuple, Optional, Sequence

import numpy as np
from scipy import special

from d3p._accounting import _gaussian, _pair, _rdp
from d3p._accounting._names import Relation
from d3p._accounting._search import safe_root

#: Upper bound on the half-width L of the grid.
MAX_L = 400.0
#: Smallest number of grid points.
MIN_NX = 2 ** 11
#: Initial resolution: grid points per one-step loss standard deviation.
POINTS_PER_STD = 8.0

_CGF_FRACTIONAL = np.array([0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7])
_CGF_INTEGER = np.unique(np.round(np.geomspace(1, 4000, 48))).astype(np.int64)
_CGF_LAMBDAS = np.concatenate([_CGF_FRACTIONAL, _CGF_INTEGER.astype(np.float64)])


class PhaseStats(NamedTuple):
    """Statistics of the one-step privacy loss X under P."""

    mean: float        # E[X]
    var: float         # Var[X]
    cgf: np.ndarray    # log E[exp(λ X)] at _CGF_LAMBDAS (upper bound / accurate)


@functools.lru_cache(maxsize=256)
def phase_stats(pair: str, sigma: float, q: float) -> PhaseStats:
    """Mean, variance and cumulant generating function of the one-step loss."""
    lam = _CGF_LAMBDAS
    if q == 1.0:
        mu2 = (_gaussian.SENSITIVITY[pair] / sigma) ** 2
        return PhaseStats(mu2 / 2, mu2, lam * (lam + 1) * mu2 / 2)
    t, log_dt = _pair.quadrature(sigma, 1.0)
    logp = _pair.log_density_p(sigma, q, t) + log_dt
    w = np.exp(logp - special.logsumexp(logp))
    x = _pair.loss(pair, sigma, q, t)
    mean = float(np.sum(w * x))
    var = float(np.sum(w * (x - mean) ** 2))
    cgf = np.empty_like(lam)
    n_frac = len(_CGF_FRACTIONAL)
    quad = range(len(lam)) if pair == Relation.SUBSTITUTE else range(n_frac)
    for i in quad:
        tt, ldt = _pair.quadrature(sigma, 1.0 + lam[i])
        cgf[i] = special.logsumexp(_pair.log_density_p(sigma, q, tt) + lam[i] * _pair.loss(pair, sigma, q, tt) + ldt)
    if pair == Relation.ADD_REMOVE:
        # exact: E_P[e^{λX}] = A_{λ+1} (Mironov et al. 2019)
        cgf[n_frac:] = _rdp.phase(Relation.ADD_REMOVE, sigma, q, _CGF_INTEGER + 1) * lam[n_frac:]
    return PhaseStats(mean, var, cgf)


class Window(NamedTuple):
    """The grid window of a composition."""

    L: float                         # half-width for the exact-mass engine
    dx_target: float                 # grid spacing that resolves every phase
    tail: Callable[[float], float]   # upper bound on P(X_T ≥ x)
    var: float                       # variance of the composed loss


def _truncated_moments(pair: str, sigma: float, q: float, log_tail: float):
    """(a, P(X > a), E[min(X, a)], Var[min(X, a)]) for the one-step loss X,
    with a chosen such that P(X > a) ≤ exp(log_tail)."""
    lo, hi = -1.0 - 60.0 * sigma, 1.0 + 60.0 * sigma
    if _pair.log_sf_p(sigma, q, hi) > log_tail:  # pragma: no cover - extreme
        hi = 1.0 + 200.0 * sigma
    if _pair.log_sf_p(sigma, q, hi) > log_tail:  # pragma: no cover - extreme
        t_a = hi
    else:
        t_a = safe_root(lambda t: _pair.log_sf_p(sigma, q, t) - log_tail, lo, hi,
                        xtol=1e-14 * sigma)
    s_a = math.exp(_pair.log_sf_p(sigma, q, t_a))
    a = float(_pair.loss(pair, sigma, q, np.array([t_a]))[0])
    n = int(min(max(4000, (t_a + 1.0 + 14.0 * sigma) / (0.1 * sigma)), 200_000))
    t = np.linspace(-1.0 - 14.0 * sigma, t_a, n)
    w = np.exp(_pair.log_density_p(sigma, q, t)) * (t[1] - t[0])
    x = _pair.loss(pair, sigma, q, t)
    m1 = float(np.sum(w * x)) + a * s_a
    m2 = float(np.sum(w * x * x)) + a * a * s_a
    return a, s_a, m1, max(m2 - m1 * m1, 0.0)


def _bennett_h(u: float) -> float:
    """Bennett's function h(u) = (1 + u) log(1 + u) − u."""
    return (1.0 + u) * math.log1p(u) - u


class _Bennett(NamedTuple):
    """Bennett's inequality for the composed loss truncated per step."""

    tail: Callable[[float], float]   # upper bound on P(X_T ≥ x)
    upper: float                     # x with tail(x) ≤ the tail mass


def _bennett(pair: str, phases: Sequence, tail_mass: float) -> Optional[_Bennett]:
    """Bennett's inequality for the losses truncated at a_i (each step's loss
    exceeds a_i with probability ≤ tail/(2 n T_i)): better than Chernoff when
    the loss has rare, huge values (tiny q). None where it does not apply."""
    n_ph = len(phases)
    trunc = [_truncated_moments(pair, p.sigma, p.q, math.log(tail_mass / (2 * n_ph * p.num_steps)))
             for p in phases]
    p_trunc = sum(p.num_steps * t[1] for p, t in zip(phases, trunc))
    m_t = sum(p.num_steps * t[2] for p, t in zip(phases, trunc))
    v_t = sum(p.num_steps * t[3] for p, t in zip(phases, trunc))
    b = max(t[0] - t[2] for t in trunc)
    if not (b > 0 and v_t > 0):
        return None

    def tail(x: float) -> float:
        """Bennett's bound on P(X_T ≥ x) plus the truncated mass."""
        if x <= m_t:
            return 1.0
        return float(min(1.0, p_trunc + math.exp(-(v_t / b ** 2) * _bennett_h(b * (x - m_t) / v_t))))

    c = (b * b / v_t) * math.log(2 / tail_mass)
    u_hi = 1.0
    while _bennett_h(u_hi) < c:
        u_hi *= 2
    u = safe_root(lambda v: c - _bennett_h(v), 0.0, u_hi, xtol=1e-300, rtol=1e-14)
    return _Bennett(tail, m_t + u * v_t / b)


def choose_window(pair: str, phases: Sequence, stats: Sequence[PhaseStats], tail_mass: float) -> Window:
    """The window of a composition: L such that the tail bound above L is at
    most ``tail_mass``, a resolving grid spacing, and the tail bound."""
    lam = _CGF_LAMBDAS
    cgf = sum((p.num_steps * s.cgf for p, s in zip(phases, stats)), np.zeros_like(lam))
    mean = sum(p.num_steps * s.mean for p, s in zip(phases, stats))
    var = sum(p.num_steps * s.var for p, s in zip(phases, stats))
    dx_target = min(math.sqrt(s.var if p.q < 1.0 else p.num_steps * s.var) / POINTS_PER_STD
                    for p, s in zip(phases, stats))
    upper = float(np.min((cgf + math.log(1 / tail_mass)) / lam))
    bennett = _bennett(pair, phases, tail_mass) if all(p.q < 1.0 for p in phases) else None
    if bennett is not None:
        upper = min(upper, bennett.upper)

    def tail(x: float) -> float:
        """The smaller of the Chernoff and Bennett bounds on P(X_T ≥ x)."""
        t = float(min(1.0, math.exp(min(0.0, float(np.min(cgf - lam * x))))))   # Chernoff
        return t if bennett is None else min(t, bennett.tail(x))

    lower = mean - 12.0 * math.sqrt(var) - 1.0 * max(math.sqrt(s.var) for s in stats)
    if pair == Relation.ADD_REMOVE and all(p.q < 1 for p in phases):
        lower = max(lower, sum(p.num_steps * math.log1p(-p.q) for p in phases))
    L = max(upper, -lower, 1e-12)
    L = min(1.05 * L, MAX_L)
    if not math.isfinite(dx_target) or dx_target <= 0:
        dx_target = L / MIN_NX
    return Window(L, dx_target, tail, var)
