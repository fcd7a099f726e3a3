# SPDX-License-Identifier: Apache-2.0
"""Densities and privacy loss of the two composed pairs (units of C, noise σ).

``P = (1-q)N(0,σ²) + qN(1,σ²)`` against ``Q = N(0,σ²)`` (the add/remove pair,
``pair == ADD_REMOVE``) or ``Q = (1-q)N(0,σ²) + qN(-1,σ²)`` (the midpoint
pair, ``pair == SUBSTITUTE``); see :func:`d3p.accounting.accounting_for` for
which run composes which.
"""

import math

import numpy as np
from scipy import special

from d3p._accounting._names import Relation


def log1p_q_expm1(q: float, a: np.ndarray) -> np.ndarray:
    """log((1-q) + q e^a), accurate for small q and large a."""
    a = np.asarray(a, dtype=np.float64)
    small = a < 30.0
    out = np.empty_like(a)
    out[small] = np.log1p(q * np.expm1(a[small]))
    big = ~small
    if q == 1.0:
        out[big] = a[big]
    else:
        out[big] = np.logaddexp(math.log1p(-q), math.log(q) + a[big])
    return out


def loss(pair: str, sigma: float, q: float, t: np.ndarray) -> np.ndarray:
    """Privacy loss log(P(t)/Q(t)) of one step."""
    s2 = sigma * sigma
    up = log1p_q_expm1(q, (2 * t - 1) / (2 * s2))
    if pair == Relation.ADD_REMOVE:
        return up
    return up - log1p_q_expm1(q, (-2 * t - 1) / (2 * s2))


def log_density_p(sigma: float, q: float, t: np.ndarray) -> np.ndarray:
    """log of the density of P at t."""
    c = -0.5 * math.log(2 * math.pi) - math.log(sigma)
    a = c - t * t / (2 * sigma ** 2)
    b = c - (t - 1) ** 2 / (2 * sigma ** 2)
    if q == 1.0:
        return b
    return np.logaddexp(math.log1p(-q) + a, math.log(q) + b)


def log_sf_p(sigma: float, q: float, t: float) -> float:
    """log P(t' > t) for t' ~ P."""
    b = math.log(q) + float(special.log_ndtr((1.0 - t) / sigma))
    if q == 1.0:
        return b
    return float(np.logaddexp(math.log1p(-q) + float(special.log_ndtr(-t / sigma)), b))


def quadrature(sigma: float, upper: float, n_min: int = 2000):
    """Trapezoidal nodes covering P's mass and the loss up to ``upper``: (t, log dt)."""
    lo = -1.0 - 14.0 * sigma
    hi = upper + 14.0 * sigma
    n = int(min(max(n_min, (hi - lo) / (0.25 * sigma)), 200_000))
    t = np.linspace(lo, hi, n)
    return t, math.log(t[1] - t[0])


def inverse_loss(pair: str, sigma: float, q: float, x: np.ndarray) -> np.ndarray:
    """t with loss(t) = x (the loss is increasing in t); -inf below the range."""
    s2 = sigma * sigma
    x = np.asarray(x, dtype=np.float64)
    if pair == Relation.ADD_REMOVE:
        # t = σ² log((e^x − (1−q))/q) + 1/2, for x > log(1−q)
        with np.errstate(all="ignore"):
            r = np.expm1(x) / q
            t = np.where(r > -1.0, s2 * np.log1p(np.maximum(r, -1.0)) + 0.5, -np.inf)
        return t
    return s2 * _log_u_substitute(sigma, q, x)


def _log_u_substitute(sigma: float, q: float, x: np.ndarray) -> np.ndarray:
    """log u for the midpoint pair: u = e^{t/σ²} solves c u² + A u − c e^x = 0,
    c = q e^{−1/(2σ²)}, A = (1−q)(1−e^x); computed in logs."""
    log_c = math.log(q) - 1.0 / (2 * sigma * sigma)
    with np.errstate(all="ignore"):
        em1 = np.expm1(x)
        log_abs_a = math.log1p(-q) + np.log(np.abs(em1))
        log_b = math.log(4.0) + 2 * log_c + x
        r = log_b - 2 * log_abs_a
        log_one_plus_sqrt = np.logaddexp(0.0, 0.5 * np.logaddexp(0.0, r))
        pos = em1 < 0   # A > 0
        log_u = np.where(
            pos,
            math.log(2.0) + log_c + x - (log_abs_a + log_one_plus_sqrt),
            log_abs_a + log_one_plus_sqrt - math.log(2.0) - log_c,
        )
        # at x = 0 exactly: u = e^{x/2}
        return np.where(em1 == 0, x / 2, log_u)
