# SPDX-License-Identifier: Apache-2.0
"""Which engine answers a validated question about a composed pair.

Nothing released or a non-private phase is answered directly; q = 1 by the
Gaussian closed form; otherwise the accountant asked for: the Fourier
accountant (falling back to the RDP bound where no grid verifies or the
package cross-check disagrees), the RDP bound, or dp-accounting's PLD.
"""

import math
from typing import NamedTuple, Optional, Sequence

from d3p._accounting import _fourier, _gaussian, _package, _pld, _rdp


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
    num_evals: int          # FFT compositions (or accountant calls)
    engine: str             # "trivial", "gaussian", "exact", "rdp" or "pld"
    nx: Optional[int]       # the last Fourier grid, if any


def epsilon(
    pair: str,
    phases: Sequence,
    delta: float,
    accountant: str,
    *,
    nx_hint: Optional[int] = None,
    deadline: Optional[float] = None,
    max_nx: int = _fourier.MAX_NX,
    package_check: bool = True,
    grid_out: Optional[dict] = None,
) -> Epsilon:
    """ε at ``delta`` for validated inputs.

    ``package_check``: cross-check a certified Fourier ε with the
    fourier-accountant package (midpoint pair; see
    :func:`d3p._accounting._package.agrees`); on disagreement the RDP bound is
    returned. ``grid_out``: if a dict, receives ``nx`` and ``L`` of the
    certifying grid.
    """
    kind, active = _trivial(phases)
    if kind == "zero":
        return Epsilon(0.0, 0, "trivial", None)
    if kind == "inf":
        return Epsilon(math.inf, 0, "trivial", None)
    if accountant == "pld":
        return Epsilon(_pld.epsilon(pair, active, delta), 1, "pld", None)
    if all(p.q == 1.0 for p in active):
        return Epsilon(_gaussian.epsilon(_gaussian.mu_of(pair, active), delta), 1, "gaussian", None)
    if accountant == "rdp":
        return Epsilon(_rdp.epsilon(pair, active, delta), 1, "rdp", None)
    res = _fourier.certified(pair, active, delta=delta, nx_hint=nx_hint, deadline=deadline, max_nx=max_nx)
    if res.value is None:
        return Epsilon(_rdp.epsilon(pair, active, delta), res.num_evals + 1, "rdp", res.nx)
    if grid_out is not None:
        grid_out.update(nx=res.nx, L=res.L)
    if package_check and not _package.agrees(pair, active, res.value, delta, res.nx, res.L):
        return Epsilon(_rdp.epsilon(pair, active, delta), res.num_evals + 2, "rdp", res.nx)
    return Epsilon(res.value, res.num_evals, res.engine, res.nx)


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
    if accountant == "rdp":
        return _rdp.delta(pair, active, epsilon)
    res = _fourier.certified(pair, active, epsilon=epsilon)
    if res.value is None:
        return _rdp.delta(pair, active, epsilon)
    if not _package.agrees(pair, active, epsilon, res.value, res.nx, res.L):
        return _rdp.delta(pair, active, epsilon)
    return float(min(res.value, 1.0))
