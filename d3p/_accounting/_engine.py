# SPDX-License-Identifier: Apache-2.0
"""Which engine answers a validated question about a composed pair.

Nothing released or a non-private phase is answered directly; q = 1 by the
Gaussian closed form; otherwise the accountant asked for: the Fourier
accountant (the dominating discretisation of
:mod:`d3p._accounting._dominating`, or the RDP bound where that is smaller
or the window holds no value: both are upper bounds), the RDP bound, or
dp-accounting's PLD.
"""

import math
from typing import NamedTuple, Sequence

from d3p._accounting import _dominating, _gaussian, _pld, _rdp


def _trivial(phases: Sequence):
    """('zero', active) if nothing is released, ('inf', active) if some
    phase is non-private, else (None, the phases that release something)."""
    active = [p for p in phases if p.num_steps > 0]
    if not active:
        return "zero", active
    if any(p.sigma == 0 for p in active):
        return "inf", active
    if all(math.isinf(p.sigma) for p in active):
        return "zero", active
    return None, [p for p in active if not math.isinf(p.sigma)]


class Epsilon(NamedTuple):
    """An ε with how it was obtained."""

    value: float
    engine: str             # "trivial", "gaussian", "fourier", "rdp" or "pld"


def epsilon(pair: str, phases: Sequence, delta: float, accountant: str) -> Epsilon:
    """ε at ``delta`` for validated inputs."""
    kind, active = _trivial(phases)
    if kind == "zero":
        return Epsilon(0.0, "trivial")
    if kind == "inf":
        return Epsilon(math.inf, "trivial")
    if accountant == "pld":
        return Epsilon(_pld.epsilon(pair, active, delta), "pld")
    if all(p.q == 1.0 for p in active):
        return Epsilon(_gaussian.epsilon(_gaussian.mu_of(pair, active), delta), "gaussian")
    rdp = _rdp.epsilon(pair, active, delta)
    if accountant == "rdp":
        return Epsilon(rdp, "rdp")
    try:
        value = _dominating.epsilon(pair, active, delta, guess=rdp)
    except (ArithmeticError, ValueError, MemoryError):   # no value from the grid: the RDP bound
        value = None
    if value is None or value >= rdp:
        return Epsilon(rdp, "rdp")
    return Epsilon(value, "fourier")


def _delta_without_noise(active: Sequence) -> float:
    """δ of phases of which some have σ = 0: the probability that the record
    is used in one of them (it is revealed whenever it is used)."""
    log_unused = sum(p.num_steps * math.log1p(-p.q) if p.q < 1 else -math.inf
                     for p in active if p.sigma == 0)
    return float(-math.expm1(log_unused)) if log_unused > -math.inf else 1.0


def delta(pair: str, phases: Sequence, epsilon: float, accountant: str) -> float:
    """δ at ``epsilon`` for validated inputs."""
    kind, active = _trivial(phases)
    if kind == "zero":
        return 0.0
    if kind == "inf":
        return _delta_without_noise(active)
    if accountant == "pld":
        return _pld.delta(pair, active, epsilon)
    if all(p.q == 1.0 for p in active):
        mu = _gaussian.mu_of(pair, active)
        # exact; rounded up by a relative 1e-12
        return float(min(1.0, math.exp(_gaussian.log_delta(mu, epsilon)) * (1 + 1e-12)))
    rdp = _rdp.delta(pair, active, epsilon)
    if accountant == "rdp" or rdp == 0.0:
        return rdp
    try:
        return min(rdp, _dominating.delta(pair, active, epsilon, guess_delta=rdp))
    except (ArithmeticError, ValueError, MemoryError):
        return rdp
