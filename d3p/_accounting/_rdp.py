# SPDX-License-Identifier: Apache-2.0
"""Rényi-DP upper bound for the composed pairs.

The add/remove pair has the exact integer-order RDP of the Poisson subsampled
Gaussian (Mironov, Talwar & Zhang 2019); the midpoint pair its RDP by
quadrature, checked at two resolutions. Converted to (ε, δ) with Canonne,
Kamath & Steinke (2020, Prop. 12).
"""

import math
from typing import Sequence

import numpy as np
from scipy import special

from d3p._accounting import _gaussian, _pair
from d3p._accounting._names import Relation

ORDERS = {
    Relation.ADD_REMOVE: np.unique(np.concatenate([
        np.arange(2, 65), np.round(np.geomspace(64, 20000, 90)),
    ])).astype(np.int64),
    Relation.SUBSTITUTE: np.unique(np.concatenate([
        np.arange(2, 17), np.round(np.geomspace(16, 5000, 24)),
    ])).astype(np.int64),
}


def _log_binom(n: np.ndarray, k: np.ndarray) -> np.ndarray:
    """log of the binomial coefficient C(n, k)."""
    return special.gammaln(n + 1) - special.gammaln(k + 1) - special.gammaln(n - k + 1)


def phase(pair: str, sigma: float, q: float, orders: np.ndarray) -> np.ndarray:
    """Per-step RDP ε(α) at integer orders α."""
    orders = np.asarray(orders, dtype=np.int64)
    if q == 1.0:
        return orders * _gaussian.SENSITIVITY[pair] ** 2 / (2 * sigma ** 2)
    if pair == Relation.SUBSTITUTE:
        return _log_mgf_substitute(sigma, q, orders - 1.0) / (orders - 1.0)
    out = np.empty(orders.shape, dtype=np.float64)
    log_q, log_1mq = math.log(q), math.log1p(-q)
    for i, a in enumerate(orders):
        # Mironov, Talwar, Zhang (2019), exact for integer α:
        # A_α = Σ_k C(α,k) (1-q)^{α-k} q^k exp((k²-k)/(2σ²))
        k = np.arange(a + 1, dtype=np.float64)
        terms = _log_binom(float(a), k) + (a - k) * log_1mq + k * log_q + (k * k - k) / (2 * sigma ** 2)
        out[i] = special.logsumexp(terms) / (a - 1)
    return out


def _log_mgf_once(sigma: float, q: float, lam: float, n_min: int, frac: float) -> float:
    """One trapezoidal estimate of log E_P[exp(λ X)] for the midpoint pair."""
    lo = -1.0 - 14.0 * sigma
    hi = 1.0 + lam + 14.0 * sigma
    n = int(min(max(n_min, (hi - lo) / (frac * sigma)), 400_000))
    t = np.linspace(lo, hi, n)
    log_dt = math.log(t[1] - t[0])
    return float(special.logsumexp(
        _pair.log_density_p(sigma, q, t) + lam * _pair.loss(Relation.SUBSTITUTE, sigma, q, t) + log_dt))


def _log_mgf_substitute(sigma: float, q: float, lambdas: np.ndarray) -> np.ndarray:
    """log E_P[exp(λ X)] for the midpoint pair, X = log(P/Q).

    Trapezoidal quadrature (spectrally accurate for these smooth, Gaussian-
    tailed integrands) at two resolutions; the larger value is used, and an
    order where the two disagree by more than 1e-7 (relative to log-scale
    value) is reported as +inf (unusable rather than optimistic).
    """
    out = np.empty(len(lambdas))
    for i, lam in enumerate(np.asarray(lambdas, dtype=np.float64)):
        a = _log_mgf_once(sigma, q, lam, 1000, 0.5)
        b = _log_mgf_once(sigma, q, lam, 1500, 0.35)
        if not (math.isfinite(a) and math.isfinite(b)) or abs(a - b) > 1e-7 * max(1.0, abs(b)):
            out[i] = math.inf
        else:
            out[i] = max(a, b) + 1e-9 * max(1.0, abs(b))
    return out


def _total(pair: str, phases: Sequence) -> np.ndarray:
    """RDP of the composition at :data:`ORDERS` of ``pair``."""
    orders = ORDERS[pair]
    total = np.zeros(orders.shape)
    for p in phases:
        if p.num_steps == 0:
            continue
        total = total + p.num_steps * phase(pair, p.sigma, p.q, orders)
    return total


def epsilon_from_rdp(orders: np.ndarray, rdp: np.ndarray, delta: float) -> float:
    """ε at ``delta`` of a mechanism that is (α, rdp[i])-RDP at each α = orders[i] > 1
    (Canonne, Kamath, Steinke 2020, Prop. 12), minimised over the orders."""
    a = np.asarray(orders, dtype=np.float64)
    eps = rdp + np.log1p(-1 / a) - (math.log(delta) + np.log(a)) / (a - 1)
    return float(max(np.min(eps), 0.0))


def delta_from_rdp(orders: np.ndarray, rdp: np.ndarray, epsilon: float) -> float:
    """δ at ``epsilon`` from the same RDP curve and conversion as
    :func:`epsilon_from_rdp` (at most 1)."""
    a = np.asarray(orders, dtype=np.float64)
    log_delta = (a - 1) * (rdp - epsilon + np.log1p(-1 / a)) - np.log(a)
    return float(min(math.exp(min(np.min(log_delta), 0.0)), 1.0))


def epsilon(pair: str, phases: Sequence, delta: float) -> float:
    """ε upper bound from RDP (Canonne, Kamath, Steinke 2020, Prop. 12)."""
    return epsilon_from_rdp(ORDERS[pair], _total(pair, phases), delta)


def delta(pair: str, phases: Sequence, epsilon: float) -> float:
    """δ upper bound at ``epsilon`` from RDP (same conversion as :func:`epsilon`)."""
    return delta_from_rdp(ORDERS[pair], _total(pair, phases), epsilon)
