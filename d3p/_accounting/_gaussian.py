# SPDX-License-Identifier: Apache-2.0
"""Closed forms of the Gaussian mechanism (no subsampling, q = 1).

T steps with noise multiplier σ and sensitivity Δ compose to the μ-Gaussian
mechanism with μ = Δ sqrt(T) / σ, whose exact δ(ε) is given by Balle & Wang
(2018). Δ is C under add/remove and 2C under substitute (either sampler).
"""

import math
from typing import Sequence

from scipy import special

from d3p._accounting._names import Relation
from d3p._accounting._search import safe_root

#: Sensitivity of one step's sum in units of C, per relation of the pair.
SENSITIVITY = {Relation.ADD_REMOVE: 1.0, Relation.SUBSTITUTE: 2.0}


def log_delta(mu: float, eps: float) -> float:
    """log δ(ε) of the μ-Gaussian mechanism (Balle & Wang 2018):
    δ = Φ(μ/2 − ε/μ) − e^ε Φ(−μ/2 − ε/μ)."""
    if mu <= 0:
        return -math.inf
    a = special.log_ndtr(mu / 2 - eps / mu)
    b = eps + special.log_ndtr(-mu / 2 - eps / mu)
    if b >= a:
        return -math.inf
    return float(a + math.log1p(-math.exp(b - a)))


def epsilon(mu: float, delta: float) -> float:
    """ε(δ) of the μ-Gaussian mechanism, rounded up (exact up to 1e-12)."""
    if mu == 0:
        return 0.0
    if not math.isfinite(mu):
        return math.inf
    log_d = math.log(delta)
    if log_delta(mu, 0.0) <= log_d:
        return 0.0
    # δ(ε) ≤ P(N(μ²/2, μ²) > ε) gives an upper bracket.
    hi = mu * mu / 2 + mu * max(-special.ndtri(delta), 1.0) + 1.0
    while log_delta(mu, hi) > log_d:  # pragma: no cover - safety
        hi *= 2
    return safe_root(lambda e: log_delta(mu, e) - log_d, 0.0, hi, xtol=1e-13, rtol=1e-13)


def mu_of(pair: str, phases: Sequence) -> float:
    """μ of the Gaussian mechanism equivalent to composing q = 1 phases."""
    sens = SENSITIVITY[pair]
    total = 0.0
    for p in phases:
        if p.num_steps == 0:
            continue
        if p.sigma == 0:
            return math.inf
        total += p.num_steps * (sens / p.sigma) ** 2
    return math.sqrt(total)


def largest_mu(target_eps: float, delta: float) -> float:
    """The largest μ whose ε at ``delta`` is at most ``target_eps`` (to a
    relative 1e-12, never above the target); at least 1e-300."""
    lo, hi = 0.0, 1.0
    while epsilon(hi, delta) <= target_eps:
        lo, hi = hi, hi * 2
    mu = safe_root(lambda m: epsilon(m, delta) - target_eps, hi, lo, xtol=1e-300, rtol=1e-12)
    return max(mu, 1e-300)
