# SPDX-License-Identifier: Apache-2.0
"""The Fourier accountant as a rigorous upper bound: a discrete pair that
dominates one step, composed by an exponentially tilted FFT.

**Dominating discretisation.** One step of a composed pair (P, Q) (see
:mod:`d3p._accounting._pair`) has the privacy loss X = log(P/Q)(t), t ~ P,
increasing in t. On the grid x_i = i h, cell i is (x_{i-1}, x_i]; its masses
P_i and Q_i are CDF differences of the Gaussians at the inverse loss of the
cell's edges (exact). Each cell's mass is split between its two edges so that
*both* its P-mass and its Q-mass are kept: the share θ_i of Q_i goes to x_i
and carries P-mass e^{x_i} θ_i Q_i, the rest goes to x_{i-1}, with

    θ_i = (P_i - e^{x_{i-1}} Q_i) / ((e^{x_i} - e^{x_{i-1}}) Q_i) ∈ [0, 1].

As a function of v = e^ε, the privacy profile δ(v) = H_v(P ‖ Q) of the
discrete pair so built is the piecewise-linear interpolation of the true
profile at v = e^{x_i} (between two grid points its slope is -Q(X > x_i) -
θ_i Q_i, which is the chord's slope). δ(v) is convex, so the chords lie
above it: the discrete pair dominates (P, Q), H_v(P̃ ‖ Q̃) ≥ H_v(P ‖ Q) for
every v ≥ 0 ("connect the dots", Doroshenko, Ghazi, Kamath, Kumar &
Manurangsi 2022). Below the lowest grid point the chord runs to (0, 1): the
cell's P-mass goes to the lowest point; above the highest grid point x_top
the chord is flat: P-mass e^{x_top} Q(X > x_top) goes to x_top, the rest,
δ(x_top), to +∞ (added to δ).

**Composition.** A pair dominating each step dominates their adaptive
composition when composed (Zhu, Dong & Wang 2022), so
δ(ε) ≤ E[(1 - e^{ε - S})_+] + P(S = ∞) with S the sum of T independent
discrete losses. Its pmf is computed by one FFT power per phase on n points
(x ≡ i h mod n h), which wraps the sum around a window [-L, L): all wrapped
mass is non-negative, so the pmf read in the window is at least the true one
there, and the mass of S above L is bounded by Chernoff's inequality with the
discrete pmfs' own moment generating functions and added to δ.

**Round-off.** At δ ≪ 1e-10 the FFT's round-off (about 1e-16 of the largest
entry) would swamp δ; the pmfs are therefore tilted by e^{λx} (normalised),
which commutes with convolution, so that the entries that make δ are no
longer 1e-12 of the largest. λ is the one among fractions of the saddle
point (the tilt that centres the sum at ε) whose bound is smallest on a
coarse grid: the saddle point itself spreads the tilted sum beyond the
window (the steps' rare large losses dominate it), and any λ gives an upper
bound. Every entry of the tilted result is widened by a round-off
allowance, 10 times the textbook bound of an FFT convolution with integer
powers, c·log2(n)·u·(1/n) Σ_ω (T |f(ω)|^{T-1} + |f(ω)|^T), before it is
untilted (:func:`_roundoff`); this allowance is an estimate of
floating-point error, not a proof (tests compare it with direct
convolution). δ is then read exactly from the bounded pmf (the profile is
linear in e^ε between grid points).

Nothing here is accepted by a refinement check: every value returned is an
upper bound at any grid; the grid size only makes it tighter.
"""

import math
from typing import NamedTuple, Optional, Sequence

import numpy as np
from scipy import special

from d3p._accounting import _gaussian, _pair, _window
from d3p._accounting._names import Relation

#: Largest FFT size.
MAX_NX = 2 ** 20
#: Smallest FFT size.
MIN_NX = 2 ** 12
#: FFT size of the passes that locate ε for the tilt.
COARSE_NX = 2 ** 14
#: Grid points per standard deviation of the one-step loss, and
POINTS_PER_STD = 16.0
#: the largest grid spacing relative to the composed loss's standard deviation:
#: on the settings of the tests and benchmarks, ε is then within a relative
#: 1e-4 of its value on grids 16 times finer (every grid gives an upper bound).
COMPOSED_FRACTION = 1.0 / 500
#: Mass of the composed loss above the window allowed by the window choice, relative to δ.
TAIL_FRACTION = 1e-6
#: Safety factor on the FFT round-off bound.
_ROUNDOFF_SAFETY = 10.0
#: Relative round-up of every value returned (summation order and the like).
_ROUND_UP = 1e-9
_U = float(np.finfo(np.float64).eps)


def _cdf_sf(pair: str, sigma: float, q: float, x: np.ndarray):
    """P(X ≤ x), P(X > x), Q(X ≤ x), Q(X > x) of the one-step loss X at ``x``."""
    t = _pair.inverse_loss(pair, sigma, q, x)
    with np.errstate(all="ignore"):
        p_cdf = (1 - q) * special.ndtr(t / sigma) + q * special.ndtr((t - 1) / sigma)
        p_sf = (1 - q) * special.ndtr(-t / sigma) + q * special.ndtr((1 - t) / sigma)
        if pair == Relation.ADD_REMOVE:
            q_cdf, q_sf = special.ndtr(t / sigma), special.ndtr(-t / sigma)
        else:
            q_cdf = (1 - q) * special.ndtr(t / sigma) + q * special.ndtr((t + 1) / sigma)
            q_sf = (1 - q) * special.ndtr(-t / sigma) + q * special.ndtr((-1 - t) / sigma)
    return p_cdf, p_sf, q_cdf, q_sf


def _cell_masses(cdf: np.ndarray, sf: np.ndarray) -> np.ndarray:
    """Masses of the cells between consecutive points, from the CDF below the
    median and the survival function above it (accurate in both tails)."""
    upper = sf[:-1] < 0.5
    return np.maximum(np.where(upper, sf[:-1] - sf[1:], cdf[1:] - cdf[:-1]), 0.0)


class StepPmf(NamedTuple):
    """One step's dominating discrete loss: ``pmf[j]`` at (``lo`` + j) h, and
    the mass at +∞."""

    lo: int
    pmf: np.ndarray
    p_inf: float


def step_pmf(pair: str, sigma: float, q: float, h: float, lo: int, hi: int) -> StepPmf:
    """The connect-the-dots pmf of one step on the grid points lo..hi (times h)."""
    i = np.arange(lo, hi + 1)
    x = i * h
    p_cdf, p_sf, q_cdf, q_sf = _cdf_sf(pair, sigma, q, x)
    p_cell = _cell_masses(p_cdf, p_sf)
    q_cell = _cell_masses(q_cdf, q_sf)
    x_lo = x[:-1]
    with np.errstate(all="ignore"):
        # θ = (P_i/Q_i - e^{x_{i-1}}) / (e^{x_{i-1}} (e^h - 1)), in [0, 1]
        theta = (p_cell / q_cell * np.exp(-x_lo) - 1.0) / math.expm1(h)
    theta = np.where(q_cell > 0, np.clip(np.nan_to_num(theta, nan=1.0, posinf=1.0), 0.0, 1.0), 1.0)
    # P-mass to the upper edge, and the rest to the lower edge (both from Q_i, no cancellation)
    up = np.where(q_cell > 0, np.exp(x[1:]) * theta * q_cell, p_cell)
    down = np.where(q_cell > 0, np.exp(x_lo) * (1.0 - theta) * q_cell, 0.0)
    pmf = np.zeros(len(x))
    pmf[1:] += up
    pmf[:-1] += down
    pmf[0] += p_cdf[0]                       # below the grid: to the lowest point
    top_q = float(q_sf[-1])
    with np.errstate(all="ignore"):
        at_top = math.exp(x[-1]) * top_q if top_q > 0 else 0.0
    p_above = float(p_sf[-1])
    at_top = min(at_top, p_above)
    pmf[-1] += at_top
    return StepPmf(int(lo), pmf, max(p_above - at_top, 0.0))


def _log_mgf(step: StepPmf, h: float, lam: float) -> float:
    """log Σ pmf e^{λx} of the finite part of a step (−inf if it has no mass)."""
    x = (step.lo + np.arange(len(step.pmf))) * h
    with np.errstate(divide="ignore"):
        return float(special.logsumexp(np.log(step.pmf) + lam * x))


def _tilted_mean(steps, counts, h: float, lam: float) -> float:
    """Mean of the sum under the tilt e^{λx}."""
    total = 0.0
    for step, k in zip(steps, counts):
        x = (step.lo + np.arange(len(step.pmf))) * h
        with np.errstate(divide="ignore"):
            w = np.log(step.pmf) + lam * x
        w = np.exp(w - np.max(w))
        total += k * float(np.sum(w * x) / np.sum(w))   # not np.dot: BLAS threads cost more here
    return total


def saddle_tilt(steps, counts, h: float, target: float) -> float:
    """λ ≥ 0 with the tilted sum's mean at ``target`` (0 if the plain mean is
    above it; bisection on log λ)."""
    if _tilted_mean(steps, counts, h, 0.0) >= target:
        return 0.0
    lo, hi = 1e-3, 1.0
    while _tilted_mean(steps, counts, h, hi) < target and hi < 1e4:
        lo, hi = hi, hi * 2
    while hi / lo > 1.01:
        mid = math.sqrt(lo * hi)
        if _tilted_mean(steps, counts, h, mid) < target:
            lo = mid
        else:
            hi = mid
    return hi


def _roundoff(specs, counts, nx: int) -> float:
    """Allowance for the round-off of every entry of the tilted composed pmf
    (see the module docstring): ``_ROUNDOFF_SAFETY`` times
    c log2(n) u (1/n) Σ_ω (Σ_i T_i |f_i|^{T_i - 1} Π_{j≠i} |f_j|^{T_j} + |f|^T), c = 5."""
    absf = [np.minimum(np.abs(f), 1.0) for f in specs]
    with np.errstate(all="ignore"):
        logs = [np.log(a) for a in absf]
        total = sum(k * lg for k, lg in zip(counts, logs))
        deriv = sum(k * np.exp(total - lg) for k, lg in zip(counts, logs))
        deriv = np.nan_to_num(deriv, nan=0.0)
        power = np.exp(total)
    # rfft holds half the spectrum: the full sum is at most twice this one
    s = 2.0 * float(np.sum(deriv + power)) / nx
    return _ROUNDOFF_SAFETY * 5.0 * (math.log2(nx) + 1) * _U * max(s, 1.0 / nx)


class Composed(NamedTuple):
    """The tilted composed pmf on the window and what it needs to be read."""

    x: np.ndarray         # grid values of the window, increasing
    r: np.ndarray         # tilted pmf, each entry an upper bound (round-off added)
    log_scale: float      # untilted pmf = r · exp(log_scale − λ x)
    lam: float
    extra: float          # added to δ: mass at +∞ and above the window


def compose(steps, counts, grid: "Grid", lam: float, tail: Optional[float] = None) -> Composed:
    """The sum of ``counts[i]`` draws of each ``steps[i]``, tilted by λ, on the
    window [-nx/2, nx/2) h; ``tail``: :func:`upper_tail` of the steps (computed if None)."""
    h, nx = grid.h, grid.nx
    half = nx // 2
    spec, specs, log_scale, log_finite = None, [], 0.0, 0.0
    for step, k in zip(steps, counts):
        x = (step.lo + np.arange(len(step.pmf))) * h
        with np.errstate(divide="ignore"):
            w = np.log(step.pmf) + lam * x
        log_m = float(special.logsumexp(w))
        arr = np.zeros(nx)
        arr[(step.lo + np.arange(len(step.pmf))) % nx] = np.exp(w - log_m)
        f = np.fft.rfft(arr)
        specs.append(f)
        fk = f ** k
        spec = fk if spec is None else spec * fk
        log_scale += k * log_m
        log_finite += k * math.log1p(-min(step.p_inf, 1.0)) if step.p_inf < 1.0 else -math.inf
    r = np.fft.irfft(spec, nx)
    r = np.maximum(np.roll(r, half), 0.0) + _roundoff(specs, counts, nx)
    x = (np.arange(nx) - half) * h
    p_inf = -math.expm1(log_finite) if log_finite > -math.inf else 1.0
    if tail is None:
        tail = upper_tail(steps, counts, grid)
    return Composed(x, r, log_scale, lam, min(1.0, p_inf + tail))


def upper_tail(steps, counts, grid: "Grid") -> float:
    """Chernoff's bound on P(S ≥ L) for the finite parts of the steps (L the
    window's top), the best of μ/2, μ and 2μ with μ = ``grid.mu``."""
    top = grid.h * (grid.nx // 2)
    best = 0.0
    for m in (0.5 * grid.mu, grid.mu, 2.0 * grid.mu):
        log_b = sum(k * _log_mgf(s, grid.h, m) for s, k in zip(steps, counts)) - m * top
        best = min(best, log_b)
    return math.exp(best)


class _Reader(NamedTuple):
    """Suffix sums of the untilted bound above a reference point: for grid
    index j, S1[j] = Σ_{k≥j} p_k and S2[j] = Σ_{k≥j} p_k e^{-x_k}, both scaled by
    e^{-log_c}."""

    x: np.ndarray
    s1: np.ndarray
    s2: np.ndarray
    log_c: float


def _reader(c: Composed, x_ref: float) -> _Reader:
    """Suffix sums for ε ≥ ``x_ref`` (≥ 0)."""
    m = c.x > x_ref
    x = c.x[m]
    log_c = c.log_scale - c.lam * x_ref
    with np.errstate(all="ignore"):
        a = c.r[m] * np.exp(-c.lam * (x - x_ref))
        b = a * np.exp(-(x - x_ref))
    s1 = np.cumsum(a[::-1])[::-1]
    s2 = np.cumsum(b[::-1])[::-1]
    return _Reader(x, s1, s2, log_c)


def read_epsilon(c: Composed, delta: float, x_ref: float) -> Optional[float]:
    """Smallest ε ≥ ``x_ref`` with δ(ε) ≤ ``delta`` for the bounded pmf
    (``x_ref`` itself if δ(x_ref) is below it already; None if no ε in the
    window qualifies)."""
    target = delta - c.extra
    if not target > 0:
        return None
    rd = _reader(c, x_ref)
    if len(rd.x) < 2:
        return None
    t = math.exp(math.log(target) - rd.log_c) if math.log(target) - rd.log_c < 700 else math.inf
    # δ at grid point x_j: Σ_{k>j} (1 - e^{x_j - x_k}) p_k
    d = np.append(rd.s1[1:] - np.exp(rd.x[:-1] - x_ref) * rd.s2[1:], 0.0)
    d0 = rd.s1[0] - rd.s2[0]     # at x_ref itself: every point lies above
    if d0 <= t:
        return x_ref
    ok = d[:-1] <= t
    if not np.any(ok):
        return None
    j = int(np.argmax(ok))
    # ε in (x_{j-1}, x_j]: δ(ε) = S1[j] - e^ε S2[j]
    lo = rd.x[j - 1] if j > 0 else x_ref
    if rd.s2[j] <= 0 or rd.s1[j] <= t:
        return float(rd.x[j])
    eps = x_ref + math.log((rd.s1[j] - t) / rd.s2[j])
    return float(min(max(eps, lo), rd.x[j]))


def read_delta(c: Composed, epsilon: float) -> float:
    """δ(ε) of the bounded pmf, plus the mass at +∞ and above the window."""
    x_ref = max(0.0, epsilon - 1.0)
    rd = _reader(c, x_ref)
    j = int(np.searchsorted(rd.x, epsilon, side="right"))    # first x > ε
    if j >= len(rd.x):
        return min(1.0, c.extra)
    value = rd.s1[j] - math.exp(epsilon - x_ref) * rd.s2[j]
    return float(min(1.0, max(value, 0.0) * math.exp(rd.log_c) + c.extra))


class Grid(NamedTuple):
    """Spacing and size of the grid of a question, with the Chernoff
    parameter μ that bounds the sum above the window best (set by :func:`_grids`)."""

    h: float
    nx: int
    mu: float


def choose_grid(pair: str, phases: Sequence, tail_mass: float) -> Grid:
    """The FFT size and spacing: the window [-L, L) from the tail bounds of
    :mod:`d3p._accounting._window`, resolved to :data:`POINTS_PER_STD` points
    per one-step standard deviation (and a fraction of the composed one)."""
    stats = [_window.phase_stats(pair, p.sigma, p.q) for p in phases]
    win = _window.choose_window(pair, phases, stats, tail_mass)
    L = win.L
    # a step's own loss above L (rare, large losses at tiny q) must be rarer still
    while L < _window.MAX_L and sum(p.num_steps * _step_sf(pair, p, L) for p in phases) > tail_mass:
        L = min(2.0 * L, _window.MAX_L)
    sd_step = min(math.sqrt(s.var) for s in stats)
    h = min(sd_step / POINTS_PER_STD, math.sqrt(win.var) * COMPOSED_FRACTION)
    if not (math.isfinite(h) and h > 0):
        h = 2 * L / MAX_NX
    nx = 1 << max(0, math.ceil(math.log2(2 * L / h)))
    nx = int(min(max(nx, MIN_NX), MAX_NX))
    return Grid(2 * L / nx, nx, 1.0)


def _step_sf(pair: str, phase, x: float) -> float:
    """P(X > x) for one step's loss X (q = 1: the Gaussian mechanism's)."""
    if phase.q == 1.0:
        mu = _gaussian.SENSITIVITY[pair] / phase.sigma
        return float(special.ndtr(-(x - mu * mu / 2) / mu))
    t = float(_pair.inverse_loss(pair, phase.sigma, phase.q, np.array([x]))[0])
    return math.exp(_pair.log_sf_p(phase.sigma, phase.q, t))


def _steps(pair: str, phases: Sequence, grid: Grid):
    """The phases' step pmfs on ``grid`` (one-step support within the window).
    A phase with q = 1 is the Gaussian mechanism, whose pair is the add/remove
    pair at q = 1 with σ over the sensitivity."""
    half = grid.nx // 2
    out = []
    for p in phases:
        step_pair, sigma = pair, p.sigma
        if p.q == 1.0:
            step_pair, sigma = Relation.ADD_REMOVE, p.sigma / _gaussian.SENSITIVITY[pair]
        lo = -half
        if step_pair == Relation.ADD_REMOVE and p.q < 1.0:
            lo = max(lo, math.floor(math.log1p(-p.q) / grid.h) - 1)
        out.append(step_pmf(step_pair, sigma, p.q, grid.h, lo, half - 1))
    return out


def _coarse(grid: Grid) -> Grid:
    """A grid with the same window and at most :data:`COARSE_NX` points."""
    if grid.nx <= COARSE_NX:
        return grid
    return Grid(grid.h * grid.nx / COARSE_NX, COARSE_NX, grid.mu)


def _grids(pair: str, phases: Sequence, tail_mass: float):
    """(fine grid, coarse grid, the coarse grid's steps), with the μ of
    Chernoff's bound above the window chosen on the coarse steps (a wide
    scan; :func:`upper_tail` tries it and its neighbours on each grid)."""
    counts = [p.num_steps for p in phases]
    grid = choose_grid(pair, phases, tail_mass)
    coarse = _coarse(grid)
    steps = _steps(pair, phases, coarse)
    top = coarse.h * (coarse.nx // 2)
    mus = np.geomspace(1e-2, 1e7, 28)
    bounds = [sum(k * _log_mgf(s, coarse.h, float(m)) for s, k in zip(steps, counts)) - m * top for m in mus]
    mu = float(mus[int(np.argmin(bounds))])
    return grid._replace(mu=mu), coarse._replace(mu=mu), steps


#: Fractions of the saddle-point tilt tried on the coarse grid, then halfway
#: between the best and its neighbours.
_TILT_FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)


def _best_tilt(steps, counts, grid: Grid, delta: float, target: float):
    """(ε, λ): the smallest coarse-grid ε over tilts that are fractions of the
    saddle point at ``target`` (None if none reads an ε). The saddle point
    centres the tilted sum at ε, but the steps' rare large losses then spread
    it beyond the window; a smaller λ keeps it in and is still far above the
    round-off where δ is read."""
    lam_s = saddle_tilt(steps, counts, grid.h, target)
    tail = upper_tail(steps, counts, grid)
    tried = {}

    def value(frac: float):
        if frac not in tried:
            tried[frac] = read_epsilon(compose(steps, counts, grid, frac * lam_s, tail), delta, 0.0)
        return tried[frac]

    for frac in _TILT_FRACTIONS:
        value(frac)
    found = {f: v for f, v in tried.items() if v is not None}
    if not found:
        return None, 0.0
    best = min(found, key=found.get)
    for frac in (best - 0.125, best + 0.125):
        if 0.0 <= frac <= 1.0:
            value(frac)
    found = {f: v for f, v in tried.items() if v is not None}
    best = min(found, key=found.get)
    return found[best], float(best * lam_s)


def epsilon(pair: str, phases: Sequence, delta: float, guess: float) -> Optional[float]:
    """An upper bound on ε at ``delta`` (None where the window holds none):
    the tilt chosen on a coarse grid (towards ``guess``, then towards the
    coarse ε), the value read on the fine grid."""
    counts = [p.num_steps for p in phases]
    grid, coarse, coarse_steps = _grids(pair, phases, TAIL_FRACTION * delta)
    found, lam = _best_tilt(coarse_steps, counts, coarse, delta, guess)
    if found is not None:
        found, lam = _best_tilt(coarse_steps, counts, coarse, delta, found)
    steps = coarse_steps if grid.nx == coarse.nx else _steps(pair, phases, grid)
    comp = compose(steps, counts, grid, lam)
    found = read_epsilon(comp, delta, 0.0)
    if found is None:
        return None
    return found * (1 + _ROUND_UP) + 1e-15


def estimate(pair: str, phases: Sequence, delta: float, guess: float) -> Optional[float]:
    """ε at ``delta`` on the coarse grid alone (an upper bound too, looser):
    cheap, for steering the calibration search."""
    counts = [p.num_steps for p in phases]
    _, coarse, coarse_steps = _grids(pair, phases, TAIL_FRACTION * delta)
    return _best_tilt(coarse_steps, counts, coarse, delta, guess)[0]


def _delta_once(pair: str, phases: Sequence, epsilon: float, scale: float) -> float:
    """δ at ``epsilon`` on a window sized for a δ of about ``scale``."""
    counts = [p.num_steps for p in phases]
    grid, coarse, coarse_steps = _grids(pair, phases, TAIL_FRACTION * max(scale * 1e-3, 1e-300))
    lam_s = saddle_tilt(coarse_steps, counts, coarse.h, epsilon)
    tail = upper_tail(coarse_steps, counts, coarse)
    lam = min((float(f * lam_s) for f in _TILT_FRACTIONS),
              key=lambda t: read_delta(compose(coarse_steps, counts, coarse, t, tail), epsilon))
    steps = coarse_steps if grid.nx == coarse.nx else _steps(pair, phases, grid)
    return min(1.0, read_delta(compose(steps, counts, grid, lam), epsilon) * (1 + _ROUND_UP))


def delta(pair: str, phases: Sequence, epsilon: float, guess_delta: float) -> float:
    """An upper bound on δ at ``epsilon``, the smallest over the tilts tried on a
    coarse grid; the window is sized for ``guess_delta`` and, where the value is
    far smaller, sized again for the value (both are upper bounds)."""
    value = _delta_once(pair, phases, epsilon, guess_delta)
    if 0.0 < value < 1e-2 * guess_delta:
        value = min(value, _delta_once(pair, phases, epsilon, value))
    return value
