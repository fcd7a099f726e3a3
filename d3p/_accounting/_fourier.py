# SPDX-License-Identifier: Apache-2.0
"""The Fourier accountant (Koskela, Jälkö & Honkela 2020) with verified grids.

The one-step privacy-loss distribution is discretised on a grid of nx points
over [-L, L] with exact cell masses (CDF differences of the two Gaussians
mapped through the loss, placed mean-preservingly), composed by one FFT power
per phase, and a value is accepted only once it is stable under grid
refinement; see :func:`d3p.accounting.compute_epsilon`, "Formal guarantees".
"""

import math
import time
from typing import NamedTuple, Optional, Sequence

import numpy as np
from scipy import special

from d3p._accounting import _gaussian, _pair, _rdp, _window
from d3p._accounting._names import Relation

#: Accepted relative change of ε under nx -> 2 nx.
RTOL = 5e-4
_ATOL = 1e-6
#: Largest grid.
MAX_NX = 2 ** 21
_START_MAX_NX = 2 ** 15
#: δ must exceed this multiple of the FFT round-off.
_NOISE_FACTOR = 20.0
#: At the grid cap: accepted relative spread of the last three values.
_CAP_BAND = 2e-2
#: Upper-tail mass beyond L allowed, relative to δ.
TAIL_FRACTION = 1e-3


def _mean_preserving_pmf(dx: float, split: np.ndarray, cdf_e, sf_e, cdf_m, sf_m) -> np.ndarray:
    """pmf on the cell centres from a distribution given by its CDF/SF at the
    cell edges (``*_e``) and midpoints (``*_m``): each cell's exact mass is
    split between its centre and the neighbouring centre so that the cell's
    first moment is kept (Simpson's rule for ∫(x − c) dF over the cell).
    Cells with ``split`` True use the survival function (accurate in the
    upper tail). Mass below the grid goes to the lowest centre."""
    up = split
    mass = np.where(up, sf_e[:-1] - sf_e[1:], cdf_e[1:] - cdf_e[:-1])
    mass = np.maximum(mass, 0.0)
    # ∫_cell (x − c) dF ≈ (2dx/3) ((F_a + F_b)/2 − F_m) = −(2dx/3) ((S_a + S_b)/2 − S_m)
    moment = np.where(
        up,
        -(2 * dx / 3) * (0.5 * (sf_e[:-1] + sf_e[1:]) - sf_m),
        (2 * dx / 3) * (0.5 * (cdf_e[:-1] + cdf_e[1:]) - cdf_m),
    )
    with np.errstate(all="ignore"):
        r = np.where(mass > 0, moment / (mass * dx), 0.0)
    r = np.clip(np.nan_to_num(r), -0.5, 0.5)
    r[0] = max(r[0], 0.0)
    r[-1] = min(r[-1], 0.0)
    pmf = mass * (1 - np.abs(r))
    pmf[1:] += np.where(r[:-1] > 0, mass[:-1] * r[:-1], 0.0)
    pmf[:-1] += np.where(r[1:] < 0, -mass[1:] * r[1:], 0.0)
    pmf[0] += cdf_e[0]
    return pmf


def _edges_and_midpoints(nx: int, L: float) -> np.ndarray:
    """Cell edges and midpoints of the grid, interleaved (2 nx + 1 points)."""
    dx = 2.0 * L / nx
    return -L - dx / 2 + (dx / 2) * np.arange(2 * nx + 1)


def _exact_mass_step(pair: str, sigma: float, q: float, nx: int, L: float):
    """One-step loss pmf on the grid: exact cell masses (CDF differences),
    placed mean-preservingly; mass above the grid is returned separately
    (treated as infinite loss)."""
    pts = _edges_and_midpoints(nx, L)
    t = _pair.inverse_loss(pair, sigma, q, pts)
    with np.errstate(all="ignore"):
        cdf = (1 - q) * special.ndtr(t / sigma) + q * special.ndtr((t - 1) / sigma)
        sf = (1 - q) * special.ndtr(-t / sigma) + q * special.ndtr((1 - t) / sigma)
    edges = pts[::2]
    pmf = _mean_preserving_pmf(2.0 * L / nx, edges[:-1] > 0, cdf[::2], sf[::2], cdf[1::2], sf[1::2])
    return pmf, float(sf[-1])


def _gaussian_step(mu: float, nx: int, L: float):
    """One-step pmf of the loss N(μ²/2, μ²) of the μ-Gaussian mechanism."""
    pts = _edges_and_midpoints(nx, L)
    z = (pts - mu * mu / 2) / mu
    cdf = special.ndtr(z)
    sf = special.ndtr(-z)
    edges = pts[::2]
    pmf = _mean_preserving_pmf(2.0 * L / nx, edges[:-1] > mu * mu / 2, cdf[::2], sf[::2], cdf[1::2], sf[1::2])
    return pmf, float(sf[-1])


def exact_mass_pmf(pair: str, phases: Sequence, nx: int, L: float):
    """Composed pmf by FFT from exactly discretised one-step distributions;
    also returns the probability that some step's loss lies above the grid."""
    half = nx // 2
    spec = None
    log_no_inf = 0.0
    sub = [p for p in phases if p.q < 1.0]
    full = [p for p in phases if p.q == 1.0]
    steps = [(_exact_mass_step(pair, p.sigma, p.q, nx, L), p.num_steps) for p in sub]
    if full:
        steps.append((_gaussian_step(_gaussian.mu_of(pair, full), nx, L), 1))
    with np.errstate(all="ignore"):
        for (mass, p_inf), k in steps:
            f = np.fft.rfft(np.roll(mass, -half)) ** k
            spec = f if spec is None else spec * f
            log_no_inf += k * math.log1p(-min(p_inf, 1.0)) if p_inf < 1.0 else -math.inf
    pmf = np.roll(np.fft.irfft(spec, nx), half)
    return pmf, -math.expm1(log_no_inf)


def aligned_L(phases: Sequence, nx: int, L: float) -> float:
    """L' ≥ L such that log(1−q) of the first subsampled phase is a grid point
    (for add/remove, where much of the one-step mass sits just above it)."""
    sub = [p for p in phases if p.q < 1.0]
    if not sub:
        return L
    a = math.log1p(-min(sub, key=lambda p: p.sigma).q)
    j = math.ceil(nx / 2 * (1 + a / L))
    if j >= nx // 2 or j <= 0:
        return L
    return -a / (1 - 2 * j / nx)


def grid(nx: int, L: float) -> np.ndarray:
    """The loss values of the grid's points."""
    dx = 2.0 * L / nx
    return -L + dx * np.arange(nx)


def eps_from_pmf(x: np.ndarray, p: np.ndarray, delta: float) -> float:
    """ε at δ of the discrete loss distribution (exact for the pmf)."""
    i0 = int(np.searchsorted(x, 0.0, side="right"))  # first x > 0
    xs, ps = x[i0:], p[i0:]
    s1 = np.cumsum(ps[::-1])[::-1]
    s2 = np.cumsum((np.exp(-xs) * ps)[::-1])[::-1]
    if s1[0] - s2[0] <= delta:  # δ(0) ≤ target
        return 0.0
    # δ at ε = xs[j]: Σ_{k>j} (1 - e^{xs[j]-xs[k]}) p_k
    d = np.append(s1[1:] - np.exp(xs[:-1]) * s2[1:], 0.0)
    ok = d <= delta
    j = int(np.argmax(ok))
    if not ok[j] or j == len(xs) - 1:
        return math.inf  # beyond the window
    # ε in (xs[j-1], xs[j]] (or (0, xs[0]]): sums over k ≥ j are constant
    lo = xs[j - 1] if j > 0 else 0.0
    if s2[j] <= 0 or s1[j] <= delta:
        return float(xs[j])
    eps = math.log((s1[j] - delta) / s2[j])
    return float(min(max(eps, lo), xs[j]))


def delta_from_pmf(x: np.ndarray, p: np.ndarray, eps: float) -> float:
    """δ at ε of the discrete loss distribution (exact for the pmf)."""
    m = x > eps
    return float(max(np.sum((1.0 - np.exp(eps - x[m])) * p[m]), 0.0))


def next_pow2(n: float) -> int:
    """The smallest power of two ≥ n (at least 1)."""
    return 1 << max(0, int(math.ceil(math.log2(max(n, 1.0)))))


class FourierResult(NamedTuple):
    """A verified Fourier value with the grid that certified it."""

    value: Optional[float]   # certified ε (or δ); None if not verified
    num_evals: int
    nx: int
    L: float
    engine: str


class _Question(NamedTuple):
    """What is asked of the grids: ε at ``delta`` or δ at ``epsilon``."""

    pair: str
    phases: Sequence
    delta: Optional[float]
    epsilon: Optional[float]
    window: _window.Window
    tail_target: float


def _question(pair, phases, delta, epsilon) -> _Question:
    """The window and tail target of a question."""
    stats = [_window.phase_stats(pair, p.sigma, p.q) for p in phases]
    if delta is not None:
        tail_target = TAIL_FRACTION * delta
    else:
        tail_target = TAIL_FRACTION * max(_rdp.delta(pair, phases, epsilon) * 1e-3, 1e-300)
    return _Question(pair, phases, delta, epsilon, _window.choose_window(pair, phases, stats, tail_target),
                     tail_target)


def _first_grid(qn: _Question, max_nx: int, nx_hint: Optional[int]):
    """(nx, L) of the first grid."""
    win = qn.window
    nx0 = next_pow2(2 * win.L / win.dx_target) if math.isfinite(win.dx_target) else _window.MIN_NX
    if nx_hint is not None:
        nx0 = max(nx0, nx_hint // 2)  # warm start: a grid that was needed before
    nx = int(min(max(nx0, _window.MIN_NX), _START_MAX_NX, max_nx // 4))
    L = win.L
    if qn.epsilon is not None and qn.epsilon >= 0.9 * L:
        L = min(1.2 * qn.epsilon + 1.0, _window.MAX_L)
    if qn.pair == Relation.ADD_REMOVE:
        L = aligned_L(qn.phases, nx, L)
    return nx, L


class _GridValue(NamedTuple):
    """What one grid gave: a value (or None), or a request to widen the window."""

    value: Optional[float]
    widen: bool


def _grid_value(qn: _Question, nx: int, L: float, tail: float, may_widen: bool) -> _GridValue:
    """The value of the question on grid (nx, L), None if it cannot be read
    reliably (round-off, an unresolved distribution), or a request to widen
    the window when mass reaches its edges (aliasing)."""
    with np.errstate(all="ignore"):
        p, p_inf = exact_mass_pmf(qn.pair, qn.phases, nx, L)
    if not (np.all(np.isfinite(p)) and math.isfinite(p_inf)):
        return _GridValue(None, False)
    x = grid(nx, L)
    # FFT round-off: negative values on the side where δ is read
    pos = p[nx // 2:]
    noise = float(-np.sum(pos[pos < 0]))
    edge = max(1, nx // 40)
    edge_mass = float(np.sum(np.abs(p[:edge])) + np.sum(np.abs(p[-edge:])))
    # sanity: the composed distribution must be resolved (an unresolved
    # one-step loss collapses into one cell, ε = 0)
    mean_c = float(np.dot(p, x))
    var_c = float(np.dot(p, (x - mean_c) ** 2))
    if var_c < 0.25 * qn.window.var:
        return _GridValue(None, False)
    if edge_mass > max(10 * qn.tail_target, 1e3 * noise, 1e-12) and may_widen:
        return _GridValue(None, True)
    extra = tail + p_inf
    if qn.delta is not None:
        d_eff = qn.delta - extra
        if not d_eff > _NOISE_FACTOR * noise:
            return _GridValue(None, False)
        value = eps_from_pmf(x, p, d_eff)
        return _GridValue(value if math.isfinite(value) else None, False)
    value = delta_from_pmf(x, p, qn.epsilon) + extra
    return _GridValue(None if value < _NOISE_FACTOR * noise else value, False)


def _stable_value(qn: _Question, value, prev, prev2, rtol: float) -> Optional[float]:
    """The certified value if the last two grids agree to ``rtol`` and the two
    before to 8 ``rtol`` (rules out chance agreement of oscillating values):
    the larger of the last two plus twice their difference."""
    if value is None or prev is None or prev2 is None:
        return None
    diff = abs(value - prev)
    diff2 = abs(prev - prev2)
    scale = max(abs(value), abs(prev), abs(prev2))
    tol = rtol if qn.delta is not None else 10 * rtol
    atol = _ATOL * min(1.0, scale + 1e-3) if qn.delta is not None else 1e-300
    if diff <= tol * scale + atol and diff2 <= 8 * (tol * scale + atol):
        return max(value, prev) + 2 * diff
    return None


def _cap_value(last) -> Optional[float]:
    """At the grid cap: the band of the last three values with its width as
    margin, if it is no wider than ``_CAP_BAND`` (relative)."""
    if any(v is None for v in last):
        return None
    hi, lo = max(last), min(last)
    return hi + (hi - lo) if hi - lo <= _CAP_BAND * hi else None


def certified(
    pair: str,
    phases: Sequence,
    *,
    delta: Optional[float] = None,
    epsilon: Optional[float] = None,
    rtol: float = RTOL,
    max_nx: int = MAX_NX,
    nx_hint: Optional[int] = None,
    deadline: Optional[float] = None,
) -> FourierResult:
    """ε at ``delta`` (or δ at ``epsilon``) from the Fourier accountant,
    accepted only once stable under grid refinement; see compute_epsilon."""
    qn = _question(pair, phases, delta, epsilon)
    nx, L = _first_grid(qn, max_nx, nx_hint)
    evals = widenings = 0
    prev = prev2 = value_3 = None
    while True:
        if deadline is not None and time.monotonic() > deadline:
            return FourierResult(None, evals, nx, L, "none")
        tail = qn.window.tail(L)
        if delta is not None and tail > 0.5 * delta:
            break
        evals += 1
        got = _grid_value(qn, nx, L, tail, widenings < 3)
        if got.widen:
            widenings += 1
            L = min(1.5 * L, _window.MAX_L)
            nx = int(min(next_pow2(1.5 * nx), max_nx // 2))
            if pair == Relation.ADD_REMOVE:
                L = aligned_L(phases, nx, L)
            prev = prev2 = value_3 = None
            continue
        stable = _stable_value(qn, got.value, prev, prev2, rtol)
        if stable is not None:
            return FourierResult(stable, evals, nx, L, "exact")
        prev2, prev = prev, got.value
        if nx * 2 > max_nx:
            capped = _cap_value((prev, prev2, value_3))
            if capped is not None:
                return FourierResult(capped, evals, nx, L, "exact")
            break
        value_3 = prev2
        nx *= 2
    return FourierResult(None, evals, nx, L, "none")


def estimate(pair: str, phases: Sequence, delta: float) -> Optional[float]:
    """Unverified ε from one exact-mass grid (4 times the initial grid of the
    verified evaluation, at most 2^17 points): a cheap estimate used to steer
    the calibration search (never returned to the user)."""
    stats = [_window.phase_stats(pair, p.sigma, p.q) for p in phases]
    win = _window.choose_window(pair, phases, stats, TAIL_FRACTION * delta)
    nx = 4 * next_pow2(2 * win.L / win.dx_target)
    nx = int(min(max(nx, 2 ** 13), 2 ** 17))
    L = aligned_L(phases, nx, win.L) if pair == Relation.ADD_REMOVE else win.L
    tail = win.tail(L)
    pmf, p_inf = exact_mass_pmf(pair, phases, nx, L)
    d_eff = delta - tail - p_inf
    if not d_eff > 0:
        return None
    eps = eps_from_pmf(grid(nx, L), pmf, d_eff)
    return eps if math.isfinite(eps) else None
