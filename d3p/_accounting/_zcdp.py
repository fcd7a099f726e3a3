# SPDX-License-Identifier: Apache-2.0
"""Zero-concentrated DP (zCDP): the ρ of the Gaussian and exponential
mechanisms, their composition and the conversion to (ε, δ).

A mechanism is ρ-zCDP if its Rényi divergence of every order α > 1 between
the outputs on neighbouring data sets is at most αρ (Bun & Steinke 2016).

* Gaussian mechanism, L2 sensitivity Δ, noise std s: ρ = Δ² / (2 s²)
  (Bun & Steinke 2016, Prop. 1.6).
* Exponential mechanism, ε₀-DP (selection probability ∝ exp(ε₀ u / (2Δu))
  with Δu the sensitivity of the scores u): ρ = ε₀² / 8 (it is ε₀-bounded
  range, and ε₀-bounded range mechanisms are ε₀²/8-zCDP: Cesar & Rogers
  2021, "Bounding, concentrating, and truncating: unifying privacy loss
  composition for data analytics", Lemma 3.2; Durfee & Rogers 2019).
* Adaptive composition adds ρ (Bun & Steinke 2016, Lemma 2.3).
* Conversion: ρ-zCDP has the RDP curve α ↦ αρ; it is converted to (ε, δ)
  with Canonne, Kamath & Steinke (2020, Prop. 12), the conversion
  :func:`d3p._accounting._rdp.epsilon_from_rdp` uses for the subsampled
  Gaussian, minimised over a real α (any α gives a valid bound, so the
  numerical minimisation can only make ε larger).
"""

import math

import numpy as np
from scipy import optimize

from d3p._accounting._search import safe_root


def gaussian_rho(sensitivity: float, std: float) -> float:
    """ρ of the Gaussian mechanism with L2 ``sensitivity`` and noise std ``std``."""
    if sensitivity == 0:
        return 0.0
    if std == 0:
        return math.inf
    return sensitivity ** 2 / (2.0 * std ** 2)


def exponential_rho(epsilon: float) -> float:
    """ρ of an ``epsilon``-DP exponential mechanism (ε² / 8)."""
    return epsilon ** 2 / 8.0


def _epsilon_at(rho: float, delta: float, alpha: float) -> float:
    """The (ε, δ) bound at order ``alpha`` (Canonne, Kamath & Steinke 2020, Prop. 12)."""
    return alpha * rho + math.log1p(-1.0 / alpha) - (math.log(delta) + math.log(alpha)) / (alpha - 1.0)


def _log_delta_at(rho: float, epsilon: float, alpha: float) -> float:
    """log δ at ``epsilon`` from order ``alpha`` (the same conversion, solved for δ)."""
    return (alpha - 1.0) * (alpha * rho - epsilon + math.log1p(-1.0 / alpha)) - math.log(alpha)


def _best(fun) -> float:
    """The minimum of ``fun`` over α > 1: a log-spaced grid, refined by bounded Brent."""
    grid = np.geomspace(1.0 + 1e-6, 1e8, 600)
    values = np.array([fun(a) for a in grid])
    i = int(np.argmin(values))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    res = optimize.minimize_scalar(fun, bounds=(lo, hi), method="bounded", options={"xatol": 1e-10 * hi})
    return float(min(values[i], fun(float(res.x))))


def epsilon(rho: float, delta: float) -> float:
    """ε at ``delta`` of a ρ-zCDP mechanism (≥ 0; ``inf`` for ``rho = inf``)."""
    if rho == 0:
        return 0.0
    if math.isinf(rho):
        return math.inf
    return max(_best(lambda a: _epsilon_at(rho, delta, a)), 0.0)


def delta(rho: float, epsilon: float) -> float:
    """δ at ``epsilon`` of a ρ-zCDP mechanism (in [0, 1])."""
    if rho == 0:
        return 0.0
    if math.isinf(rho):
        return 1.0
    return float(min(math.exp(min(_best(lambda a: _log_delta_at(rho, epsilon, a)), 0.0)), 1.0))


def largest_rho(target_epsilon: float, delta: float) -> float:
    """The largest ρ whose ε at ``delta`` is at most ``target_epsilon`` (never above it)."""
    if math.isinf(target_epsilon):
        return math.inf
    hi = 1.0
    while epsilon(hi, delta) <= target_epsilon:
        hi *= 4.0
    return safe_root(lambda r: epsilon(r, delta) - target_epsilon, hi, 0.0, xtol=1e-14, rtol=1e-10)
