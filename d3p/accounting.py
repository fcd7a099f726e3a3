# SPDX-License-Identifier: Apache-2.0
"""Privacy accounting for DP-SGD style runs: ε and δ from (σ, q, T, relation).

The mechanism accounted for is the *subsampled Gaussian mechanism*: every step
releases the sum of a subsample of per-record contributions, each clipped to
L2 norm at most C, plus N(0, σ²C²) noise in every coordinate; T such steps are
composed adaptively. σ is the noise multiplier (``dp_scale``), q the sampling
probability (batch size B over data size N).

A run is accounted for the sampler that drew its batches and the
neighbouring relation under which its guarantee is stated; one function,
:func:`accounting_for`, maps the pair to the privacy-loss pair that is
composed (each row's proof or reference is in its docstring):

=======================================  ==============  ==========================================
sampler                                  relation        pair composed per step (noise multiplier σ)
=======================================  ==============  ==========================================
Poisson (prob. q), fixed shape + mask    add/remove      N(0,σ²) vs (1-q)N(0,σ²)+qN(1,σ²), both
  (**the default**)                                      directions
Poisson, as above                        substitute      (1-q)N(0,σ²)+qN(1,σ²) vs
                                                         (1-q)N(0,σ²)+qN(-1,σ²)
fixed size B without replacement         substitute      N(0,(σ/2)²) vs (1-q)N(0,(σ/2)²)+qN(1,(σ/2)²),
                                                         both directions: the add/remove pair with
                                                         noise multiplier σ/2
=======================================  ==============  ==========================================

The relations:

* ``ADD_REMOVE`` ("add/remove one record"): neighbouring data sets differ by
  the presence of one record. The data set size N is treated as public
  (it sets the normalisation ``q N`` and the default δ).
* ``SUBSTITUTE`` ("replace one record"): neighbouring data sets have the same
  size and differ in the value of one record; a replaced record can move the
  clipped sum by 2C rather than C.

Fixed-size batches are NOT accounted with the substitute pair of the second
row (the midpoint pair used by the d3p paper, the Fourier accountant's "S"
relation and dp-accounting's ``REPLACE_ONE``): that pair assumes that an
unsampled record's slot contributes nothing, but with a fixed batch size the
slot is filled by another record, which may equal it. With every clipped
contribution of D equal to +C and record 0 of D' at -C, every batch of D sums
to BC while a batch of D' sums to (B-2)C with probability q: the third row's
pair, exactly (Zhu, Dong & Wang 2022; Lebeda, Regehr, Kamath & Steinke 2024).
At σ = 0.822, q = 0.01, T = 1000 the midpoint pair claims ε = 4 at δ = 1e-5
where the fixed-size pair gives ε ≈ 25.

Choosing δ: δ bounds the probability of a catastrophic failure of the
guarantee, so choose it well below 1/N (e.g. δ ≤ 1/(10 N), or 1e-5 .. 1e-7 for
typical N). δ ≥ 1/N permits mechanisms that publish a random record verbatim.

Accountants (``accountant=`` argument):

* ``"fourier"`` (default): the Fourier accountant of Koskela, Jälkö and
  Honkela (2020): the privacy-loss distribution of one step on a grid,
  composed by FFT. d3p discretises it with exact cell masses, chooses the
  grid from tail bounds and accepts a value only once it is stable under
  refinement; for the midpoint pair (Poisson sampling, substitute relation)
  every value is cross-checked with the ``fourier-accountant`` package (its
  public ``get_delta_S`` on the same grid). Falls back to ``"rdp"`` where a value cannot be verified (see
  :func:`compute_epsilon`, "Formal guarantees").
* ``"rdp"``: a Rényi-DP bound of our own: the exact integer-order RDP of
  the Poisson subsampled Gaussian (Mironov, Talwar and Zhang 2019) for the
  add/remove pair (Poisson/add-remove, and fixed-size batches with σ/2); for
  the midpoint pair (Poisson/substitute) its RDP by quadrature; converted to
  (ε, δ) with Canonne, Kamath and Steinke (2020, Prop. 12). Typically 5-15%
  above the tight ε.
* ``"pld"``: the privacy loss distribution accountant of Google's
  ``dp-accounting`` package (optional dependency, ``pip install dp-accounting``;
  pessimistic discretisation). Used as the independent reference.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Callable, Iterable, NamedTuple, Optional, Sequence, Union

import numpy as np
from scipy import special

__all__ = [
    "ADD_REMOVE",
    "SUBSTITUTE",
    "RELATIONS",
    "ACCOUNTANTS",
    "SAMPLER_RELATIONS",
    "SAMPLERS",
    "Phase",
    "SamplerAccounting",
    "accounting_for",
    "relation_for_sampler",
    "normalize_relation",
    "compute_epsilon",
    "compute_delta",
    "compose_epsilon",
    "compose_delta",
    "EpsilonTracker",
]

#: Add/remove-one-record relation; goes with Poisson sampling.
ADD_REMOVE = "add_remove"
#: Substitute-one-record (replace-one) relation; goes with fixed-size sampling
#: without replacement (``subsample_batchify_data``).
SUBSTITUTE = "substitute"
#: The supported neighbouring relations.
RELATIONS = (ADD_REMOVE, SUBSTITUTE)
#: The supported accountants.
ACCOUNTANTS = ("fourier", "rdp", "pld")

#: The batch samplers the accountants cover.
SAMPLERS = ("poisson", "fixed_size")

#: The default relation of each sampler (Poisson sampling also supports
#: :data:`SUBSTITUTE`; fixed-size sampling only :data:`SUBSTITUTE`).
SAMPLER_RELATIONS = {
    "poisson": ADD_REMOVE,
    "fixed_size": SUBSTITUTE,
}

_SAMPLER_ALIASES = {
    "poisson": "poisson",
    "poisson_batchify_data": "poisson",
    "fixed_size": "fixed_size",
    "fixed-size": "fixed_size",
    "fixed": "fixed_size",
    "feistel": "fixed_size",
    "without_replacement": "fixed_size",
    "subsample_batchify_data": "fixed_size",
}

_RELATION_ALIASES = {
    "add_remove": ADD_REMOVE,
    "add-remove": ADD_REMOVE,
    "add/remove": ADD_REMOVE,
    "remove": ADD_REMOVE,
    "substitute": SUBSTITUTE,
    "substitution": SUBSTITUTE,
    "replace": SUBSTITUTE,
    "replace_one": SUBSTITUTE,
}


class Phase(NamedTuple):
    """One phase of a run: ``num_steps`` steps with noise multiplier ``sigma``
    and sampling probability ``q``."""

    sigma: float
    """Noise multiplier σ (noise std over the clipping threshold)."""
    q: float
    """Sampling probability q in (0, 1] (B/N for fixed-size batches)."""
    num_steps: int
    """Number of steps T in this phase."""


# ---------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------


def _as_float(name: str, value) -> float:
    if isinstance(value, bool):
        raise TypeError(f"Expected {name} to be a number, got {name}={value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"Expected {name} to be a number, got {name}={value!r}") from None


def _check_sigma(value, name: str = "sigma") -> float:
    x = _as_float(name, value)
    if not x >= 0:  # also catches NaN
        raise ValueError(f"Expected {name} >= 0, got {name}={value!r}")
    return x


def _check_q(value, name: str = "q") -> float:
    x = _as_float(name, value)
    if not 0 < x <= 1:
        raise ValueError(f"Expected {name} in (0, 1], got {name}={value!r}")
    return x


def _check_delta(value, name: str = "delta") -> float:
    x = _as_float(name, value)
    if not 0 < x < 1:
        raise ValueError(f"Expected {name} in (0, 1), got {name}={value!r}")
    return x


def _check_epsilon(value, name: str = "epsilon") -> float:
    x = _as_float(name, value)
    if not (x >= 0 and math.isfinite(x)):
        raise ValueError(f"Expected {name} >= 0 and finite, got {name}={value!r}")
    return x


def _check_steps(value, name: str = "num_steps", minimum: int = 0) -> int:
    if isinstance(value, bool):
        raise TypeError(f"Expected {name} to be an integer, got {name}={value!r}")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"Expected {name} to be an integer, got {name}={value!r}") from None
    if not (math.isfinite(x) and x == int(x) and x >= minimum):
        raise ValueError(f"Expected {name} to be an integer >= {minimum}, got {name}={value!r}")
    return int(x)


def normalize_relation(relation: str) -> str:
    """Returns the canonical name (:data:`ADD_REMOVE` or :data:`SUBSTITUTE`)
    of a neighbouring relation.

    Accepts the canonical names and the spellings ``"add-remove"``,
    ``"add/remove"``, ``"replace_one"``, case-insensitively.

    :param str relation: name of the relation.
    :return: ``"add_remove"`` or ``"substitute"``.
    :raises ValueError: for any other value.
    """
    if isinstance(relation, str):
        canonical = _RELATION_ALIASES.get(relation.strip().lower())
        if canonical is not None:
            return canonical
    raise ValueError(
        f"Expected relation in {RELATIONS!r}, got relation={relation!r}"
    )


def _check_accountant(accountant: str) -> str:
    if isinstance(accountant, str) and accountant.strip().lower() in ACCOUNTANTS:
        return accountant.strip().lower()
    raise ValueError(f"Expected accountant in {ACCOUNTANTS!r}, got accountant={accountant!r}")


def relation_for_sampler(sampler: str) -> str:
    """The default neighbouring relation of a batch sampler (see
    :func:`accounting_for` for how each is accounted).

    ============================================  ===================
    ``sampler``                                    relation
    ============================================  ===================
    ``"poisson"`` (``poisson_batchify_data``)      :data:`ADD_REMOVE`
    ``"fixed_size"``, ``"feistel"``,               :data:`SUBSTITUTE`
    ``"without_replacement"``
    (``subsample_batchify_data``)
    ============================================  ===================

    Calibrate σ for a Poisson sampler with
    :func:`d3p.dputil.approximate_sigma_remove_relation` and for a fixed-size
    sampler with :func:`d3p.dputil.approximate_sigma`.

    :param str sampler: sampler name (see table).
    :return: the relation name.
    :raises ValueError: for an unknown sampler name.
    """
    return SAMPLER_RELATIONS[_normalize_sampler(sampler)]


def _normalize_sampler(sampler: str) -> str:
    key = _SAMPLER_ALIASES.get(sampler.strip().lower()) if isinstance(sampler, str) else None
    if key is None:
        raise ValueError(
            f"Expected sampler in {SAMPLERS!r} (or an alias such as 'fixed' or "
            f"'subsample_batchify_data'), got sampler={sampler!r}"
        )
    return key


class SamplerAccounting(NamedTuple):
    """How runs with one batch sampler are accounted under one relation.

    Built by :func:`accounting_for`, the one place that maps a sampler to
    the privacy-loss pair composed per step. ``pair`` names that pair:
    ``"add_remove"`` for N(0, s²) vs (1-q)N(0, s²) + qN(1, s²) (both
    directions), ``"substitute"`` for the midpoint pair (1-q)N(0, s²) +
    qN(1, s²) vs (1-q)N(0, s²) + qN(-1, s²), where s = σ / ``noise_divisor``.
    """

    sampler: str
    """``"poisson"`` or ``"fixed_size"``."""
    relation: str
    """:data:`ADD_REMOVE` or :data:`SUBSTITUTE`: the relation of the guarantee."""
    pair: str
    """The composed pair (see above)."""
    noise_divisor: float
    """σ of the pair = σ of the run / ``noise_divisor``."""

    def engine_phases(self, phases: Sequence[Phase]) -> list:
        """The phases as the composed pair sees them (σ divided by ``noise_divisor``)."""
        return [Phase(p.sigma / self.noise_divisor, p.q, p.num_steps) for p in phases]

    def describe(self) -> str:
        """A one-line description, e.g. ``"fixed-size sampling without
        replacement, substitute relation"``."""
        names = {"poisson": "Poisson sampling",
                 "fixed_size": "fixed-size sampling without replacement"}
        return f"{names[self.sampler]}, {self.relation.replace('_', '/')} relation"

    def epsilon(self, sigma: float, q: float, num_steps: int, delta: float,
                accountant: str = "fourier") -> float:
        """:func:`compute_epsilon` for this sampler and relation."""
        return compute_epsilon(sigma, q, num_steps, delta, relation=self.relation,
                               sampler=self.sampler, accountant=accountant)

    def delta(self, sigma: float, q: float, num_steps: int, epsilon: float,
              accountant: str = "fourier") -> float:
        """:func:`compute_delta` for this sampler and relation."""
        return compute_delta(sigma, q, num_steps, epsilon, relation=self.relation,
                             sampler=self.sampler, accountant=accountant)

    def tracker(self, sigma: float, q: float, delta: float, **kwargs) -> "EpsilonTracker":
        """An :class:`EpsilonTracker` for this sampler and relation."""
        return EpsilonTracker(sigma, q, delta, relation=self.relation, sampler=self.sampler, **kwargs)

    def calibrate(self, target_eps: float, delta: float, q: float, num_steps: int, **kwargs):
        """:func:`d3p.dputil.calibrate_sigma` for this sampler and relation:
        ``(sigma, eps, num_evals)``."""
        from d3p import dputil

        return dputil.calibrate_sigma(target_eps, delta, q, num_steps, sampler=self.sampler,
                                      relation=self.relation, **kwargs)

    def overflow_delta(self, num_records: int, q: float, max_batch_size: int,
                       num_steps: int, epsilon: float) -> float:
        """What a sampler's deviation from its accounted distribution adds to
        δ over ``num_steps`` steps: for Poisson sampling padded to
        ``max_batch_size``, the truncation of overflowing batches
        (:func:`d3p.minibatch.poisson_overflow_delta`); 0 for fixed-size
        batches, which are exactly what is accounted. ``inf`` ε gives 0 (no
        guarantee to add to)."""
        if self.sampler != "poisson" or not math.isfinite(epsilon):
            return 0.0
        from d3p import minibatch

        return minibatch.poisson_overflow_delta(num_records, q, max_batch_size, num_steps, epsilon)


def accounting_for(sampler: Optional[str] = None, relation: Optional[str] = None) -> SamplerAccounting:
    """The accounting of runs whose batches come from ``sampler``, with the
    guarantee stated under ``relation``: the one mapping from samplers to
    composed privacy-loss pairs, used by every accountant, calibration,
    :meth:`d3p.svi.DPSVI.run`, twins and the command line.

    Defaults: neither given, Poisson sampling under add/remove; only
    ``sampler``, that sampler's relation in :data:`SAMPLER_RELATIONS`; only
    ``relation``: add/remove means Poisson sampling, substitute means
    fixed-size batches (the meaning of d3p's substitute-relation functions
    such as :func:`d3p.dputil.approximate_sigma`).

    **Formal guarantees** (the pairs dominate the sampled Gaussian sum
    mechanism with clipping threshold C and noise std σC, for the relation
    stated; Zhu, Dong & Wang 2022, "Optimal accounting of differential privacy
    via characteristic function", give dominating pairs for Poisson and
    without-replacement subsampling under both relations):

    * Poisson, add/remove: adding or removing one record changes the sum by a
      vector of norm ≤ C when the record is sampled (probability q) and by
      nothing otherwise; the worst case is N(0, σ²) vs (1-q)N(0, σ²) +
      qN(1, σ²) in units of C, in both directions (Mironov, Talwar & Zhang
      2019; Zhu et al. 2022, Poisson subsampling).
    * Poisson, substitute: the substituted record enters both sums with the
      same probability q, and when it is not sampled its slot is empty, so
      the sums differ by (x - x') with probability q; centred at the
      midpoint, the pair (1-q)N(0)+qN(1) vs (1-q)N(0)+qN(-1) (with ‖x - x'‖
      ≤ 2C) dominates (Zhu et al. 2022, Poisson subsampling under the
      substitute relation).
    * Fixed size B without replacement, substitute: the batch always holds B
      records, so when the substituted record is not sampled its slot is
      filled by another record, which may equal it. D: every clipped
      contribution +C; D': record 0 at -C. Every batch of D sums to BC; a
      batch of D' sums to (B-2)C with probability q = B/N and to BC
      otherwise: N(0, σ²) vs (1-q)N(0, σ²) + qN(-2, σ²), i.e. the add/remove
      pair with noise multiplier σ/2, in both directions; it dominates every
      pair of neighbouring data sets under this sampler (Zhu et al. 2022,
      sampling without replacement; Lebeda, Regehr, Kamath & Steinke 2024,
      arXiv:2405.20769). The midpoint pair is optimistic here.
    * Fixed size under add/remove is refused: the batch size or q would
      change with N, which is not covered.

    :param str sampler: ``"poisson"`` or ``"fixed_size"`` (aliases
        ``"fixed"``, ``"subsample_batchify_data"``, ``"poisson_batchify_data"``).
    :param str relation: :data:`ADD_REMOVE` or :data:`SUBSTITUTE` (aliases as
        :func:`normalize_relation`).
    :return: :class:`SamplerAccounting`.
    :raises ValueError: for unknown names or an unsupported combination.

    >>> from d3p.accounting import accounting_for
    >>> accounting_for("fixed_size").noise_divisor
    2.0
    >>> accounting_for().describe()
    'Poisson sampling, add/remove relation'
    """
    if sampler is None:
        if relation is None:
            sampler = "poisson"
        else:
            sampler = "fixed_size" if normalize_relation(relation) == SUBSTITUTE else "poisson"
    sampler = _normalize_sampler(sampler)
    relation = SAMPLER_RELATIONS[sampler] if relation is None else normalize_relation(relation)
    if sampler == "poisson":
        return SamplerAccounting(sampler, relation, relation, 1.0)
    if relation != SUBSTITUTE:
        raise ValueError(
            f"Expected relation='substitute' for sampler='fixed_size', got relation={relation!r}: "
            "fixed-size batches are accounted under the substitute relation only; use "
            "sampler='poisson' for add/remove."
        )
    return SamplerAccounting(sampler, SUBSTITUTE, ADD_REMOVE, 2.0)


def _check_phases(phases) -> list:
    if isinstance(phases, Phase) or (
        isinstance(phases, tuple) and len(phases) == 3 and not isinstance(phases[0], (tuple, list))
    ):
        phases = [phases]
    try:
        items = list(phases)
    except TypeError:
        raise TypeError(f"Expected phases to be a sequence of (sigma, q, num_steps), got phases={phases!r}") from None
    out = []
    for i, ph in enumerate(items):
        try:
            sigma, q, steps = ph
        except (TypeError, ValueError):
            raise ValueError(
                f"Expected phases[{i}] to be (sigma, q, num_steps), got phases[{i}]={ph!r}"
            ) from None
        out.append(Phase(
            _check_sigma(sigma, f"phases[{i}].sigma"),
            _check_q(q, f"phases[{i}].q"),
            _check_steps(steps, f"phases[{i}].num_steps"),
        ))
    return out


# ---------------------------------------------------------------------------
# Gaussian mechanism (q = 1): exact closed form
# ---------------------------------------------------------------------------

_SENSITIVITY = {ADD_REMOVE: 1.0, SUBSTITUTE: 2.0}


def _gaussian_log_delta(mu: float, eps: float) -> float:
    """log δ(ε) of the μ-Gaussian mechanism (Balle & Wang 2018):
    δ = Φ(μ/2 − ε/μ) − e^ε Φ(−μ/2 − ε/μ)."""
    if mu <= 0:
        return -math.inf
    a = special.log_ndtr(mu / 2 - eps / mu)
    b = eps + special.log_ndtr(-mu / 2 - eps / mu)
    if b >= a:
        return -math.inf
    return float(a + math.log1p(-math.exp(b - a)))


def _gaussian_epsilon(mu: float, delta: float) -> float:
    """ε(δ) of the μ-Gaussian mechanism, rounded up (exact up to 1e-12)."""
    if mu == 0:
        return 0.0
    if not math.isfinite(mu):
        return math.inf
    log_d = math.log(delta)
    if _gaussian_log_delta(mu, 0.0) <= log_d:
        return 0.0
    # δ(ε) ≤ P(N(μ²/2, μ²) > ε) gives an upper bracket.
    hi = mu * mu / 2 + mu * max(-special.ndtri(delta), 1.0) + 1.0
    while _gaussian_log_delta(mu, hi) > log_d:  # pragma: no cover - safety
        hi *= 2
    lo = 0.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if _gaussian_log_delta(mu, mid) > log_d:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * max(1.0, hi):
            break
    return hi


def _gaussian_mu(relation: str, phases: Sequence[Phase]) -> float:
    """μ of the Gaussian mechanism equivalent to composing q = 1 phases."""
    sens = _SENSITIVITY[relation]
    total = 0.0
    for p in phases:
        if p.num_steps == 0:
            continue
        if p.sigma == 0:
            return math.inf
        total += p.num_steps * (sens / p.sigma) ** 2
    return math.sqrt(total)


# ---------------------------------------------------------------------------
# RDP upper bound
# ---------------------------------------------------------------------------

_RDP_ORDERS = {
    ADD_REMOVE: np.unique(np.concatenate([
        np.arange(2, 65), np.round(np.geomspace(64, 20000, 90)),
    ])).astype(np.int64),
    SUBSTITUTE: np.unique(np.concatenate([
        np.arange(2, 17), np.round(np.geomspace(16, 5000, 24)),
    ])).astype(np.int64),
}


def _log_binom(n: np.ndarray, k: np.ndarray) -> np.ndarray:
    return special.gammaln(n + 1) - special.gammaln(k + 1) - special.gammaln(n - k + 1)


def _rdp_phase(relation: str, sigma: float, q: float, orders: np.ndarray) -> np.ndarray:
    """Per-step RDP ε(α) at integer orders α."""
    orders = np.asarray(orders, dtype=np.int64)
    if q == 1.0:
        return orders * _SENSITIVITY[relation] ** 2 / (2 * sigma ** 2)
    if relation == SUBSTITUTE:
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


def _log_mgf_substitute(sigma: float, q: float, lambdas: np.ndarray) -> np.ndarray:
    """log E_P[exp(λ X)] for the substitute pair, X = log(P/Q),
    P = (1-q)N(0,σ²) + qN(1,σ²), Q = (1-q)N(0,σ²) + qN(-1,σ²).

    Trapezoidal quadrature (spectrally accurate for these smooth, Gaussian-
    tailed integrands) at two resolutions; the larger value is used, and an
    order where the two disagree by more than 1e-7 (relative to log-scale
    value) is reported as +inf (unusable rather than optimistic).
    """
    out = np.empty(len(lambdas))
    for i, lam in enumerate(np.asarray(lambdas, dtype=np.float64)):
        vals = []
        for n_min, frac in ((1000, 0.5), (1500, 0.35)):
            lo = -1.0 - 14.0 * sigma
            hi = 1.0 + lam + 14.0 * sigma
            n = int(min(max(n_min, (hi - lo) / (frac * sigma)), 400_000))
            t = np.linspace(lo, hi, n)
            log_dt = math.log(t[1] - t[0])
            vals.append(float(special.logsumexp(
                _log_density_p(sigma, q, t) + lam * _loss(SUBSTITUTE, sigma, q, t) + log_dt)))
        a, b = vals
        if not (math.isfinite(a) and math.isfinite(b)) or abs(a - b) > 1e-7 * max(1.0, abs(b)):
            out[i] = math.inf
        else:
            out[i] = max(a, b) + 1e-9 * max(1.0, abs(b))
    return out


def _rdp_total(relation: str, phases: Sequence[Phase]) -> np.ndarray:
    orders = _RDP_ORDERS[relation]
    total = np.zeros(orders.shape)
    for p in phases:
        if p.num_steps == 0:
            continue
        total = total + p.num_steps * _rdp_phase(relation, p.sigma, p.q, orders)
    return total


def _rdp_epsilon(relation: str, phases: Sequence[Phase], delta: float) -> float:
    """ε upper bound from RDP (Canonne, Kamath, Steinke 2020, Prop. 12)."""
    rdp = _rdp_total(relation, phases)
    a = _RDP_ORDERS[relation].astype(np.float64)
    eps = rdp + np.log1p(-1 / a) - (math.log(delta) + np.log(a)) / (a - 1)
    return float(max(np.min(eps), 0.0))


def _rdp_delta(relation: str, phases: Sequence[Phase], epsilon: float) -> float:
    rdp = _rdp_total(relation, phases)
    a = _RDP_ORDERS[relation].astype(np.float64)
    log_delta = (a - 1) * (rdp - epsilon + np.log1p(-1 / a)) - np.log(a)
    return float(min(math.exp(min(np.min(log_delta), 0.0)), 1.0))


# ---------------------------------------------------------------------------
# Fourier accountant (fourier-accountant package) with verified grids
# ---------------------------------------------------------------------------

#: Fourier settings; see compute_epsilon's "Formal guarantees".
_FOURIER_RTOL = 5e-4          # accepted relative change of ε under nx -> 2 nx
_FOURIER_ATOL = 1e-6
_FOURIER_MAX_NX = 2 ** 21
_FOURIER_MIN_NX = 2 ** 11
_FOURIER_START_MAX_NX = 2 ** 15
_NOISE_FACTOR = 20.0          # δ must exceed this multiple of the FFT round-off
_CAP_BAND = 2e-2              # at the grid cap: accepted spread of the last three values
_FOURIER_MAX_L = 400.0
_TAIL_FRACTION = 1e-3         # upper-tail mass beyond L allowed, relative to δ
_POINTS_PER_STD = 8.0         # initial resolution: grid points per one-step loss std
# substitute relation: the fourier-accountant package's δ at the certified ε
# (same grid) may exceed the target by at most this relative amount
_PACKAGE_CHECK_RTOL = 2e-2
_PACKAGE_CHECK_MAX_NX = 2 ** 22  # finest grid for the package's check

_CGF_FRACTIONAL = np.array([0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7])
_CGF_INTEGER = np.unique(np.round(np.geomspace(1, 4000, 48))).astype(np.int64)
_CGF_LAMBDAS = np.concatenate([_CGF_FRACTIONAL, _CGF_INTEGER.astype(np.float64)])


def _log1p_q_expm1(q: float, a: np.ndarray) -> np.ndarray:
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


def _loss(relation: str, sigma: float, q: float, t: np.ndarray) -> np.ndarray:
    """Privacy loss log(P(t)/Q(t)) of one step, P = (1-q)N(0,σ²) + qN(1,σ²)."""
    s2 = sigma * sigma
    up = _log1p_q_expm1(q, (2 * t - 1) / (2 * s2))
    if relation == ADD_REMOVE:
        return up
    return up - _log1p_q_expm1(q, (-2 * t - 1) / (2 * s2))


def _log_density_p(sigma: float, q: float, t: np.ndarray) -> np.ndarray:
    c = -0.5 * math.log(2 * math.pi) - math.log(sigma)
    a = c - t * t / (2 * sigma ** 2)
    b = c - (t - 1) ** 2 / (2 * sigma ** 2)
    if q == 1.0:
        return b
    return np.logaddexp(math.log1p(-q) + a, math.log(q) + b)


def _quadrature(sigma: float, upper: float, n_min: int = 2000):
    lo = -1.0 - 14.0 * sigma
    hi = upper + 14.0 * sigma
    n = int(min(max(n_min, (hi - lo) / (0.25 * sigma)), 200_000))
    t = np.linspace(lo, hi, n)
    return t, math.log(t[1] - t[0])


class _PhaseStats(NamedTuple):
    mean: float        # mean of the one-step privacy loss under P
    var: float         # its variance
    cgf: np.ndarray    # log E[exp(λ X)] at _CGF_LAMBDAS (upper bound / accurate)


@functools.lru_cache(maxsize=256)
def _phase_stats(relation: str, sigma: float, q: float) -> _PhaseStats:
    lam = _CGF_LAMBDAS
    if q == 1.0:
        mu2 = (_SENSITIVITY[relation] / sigma) ** 2
        return _PhaseStats(mu2 / 2, mu2, lam * (lam + 1) * mu2 / 2)
    t, log_dt = _quadrature(sigma, 1.0)
    logp = _log_density_p(sigma, q, t) + log_dt
    w = np.exp(logp - special.logsumexp(logp))
    x = _loss(relation, sigma, q, t)
    mean = float(np.sum(w * x))
    var = float(np.sum(w * (x - mean) ** 2))
    cgf = np.empty_like(lam)
    n_frac = len(_CGF_FRACTIONAL)
    quad = range(len(lam)) if relation == SUBSTITUTE else range(n_frac)
    for i in quad:
        tt, ldt = _quadrature(sigma, 1.0 + lam[i])
        cgf[i] = special.logsumexp(_log_density_p(sigma, q, tt) + lam[i] * _loss(relation, sigma, q, tt) + ldt)
    if relation == ADD_REMOVE:
        # exact: E_P[e^{λX}] = A_{λ+1} (Mironov et al. 2019)
        cgf[n_frac:] = _rdp_phase(ADD_REMOVE, sigma, q, _CGF_INTEGER + 1) * lam[n_frac:]
    return _PhaseStats(mean, var, cgf)


class _Window(NamedTuple):
    L: float                         # half-width for the exact-mass engine
    dx_target: float
    tail: Callable[[float], float]   # upper bound on P(X_T ≥ x)
    var: float                       # variance of the composed loss


def _log_sf_p(sigma: float, q: float, t: float) -> float:
    """log P(t' > t) for t' ~ P = (1-q)N(0,σ²) + qN(1,σ²)."""
    b = math.log(q) + float(special.log_ndtr((1.0 - t) / sigma))
    if q == 1.0:
        return b
    return float(np.logaddexp(math.log1p(-q) + float(special.log_ndtr(-t / sigma)), b))


def _truncated_moments(relation: str, sigma: float, q: float, log_tail: float):
    """(a, P(X > a), E[min(X, a)], Var[min(X, a)]) for the one-step loss X,
    with a chosen such that P(X > a) ≤ exp(log_tail)."""
    lo, hi = -1.0 - 60.0 * sigma, 1.0 + 60.0 * sigma
    if _log_sf_p(sigma, q, hi) > log_tail:  # pragma: no cover - extreme
        hi = 1.0 + 200.0 * sigma
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        if _log_sf_p(sigma, q, mid) > log_tail:
            lo = mid
        else:
            hi = mid
    t_a = hi
    s_a = math.exp(_log_sf_p(sigma, q, t_a))
    a = float(_loss(relation, sigma, q, np.array([t_a]))[0])
    n = int(min(max(4000, (t_a + 1.0 + 14.0 * sigma) / (0.1 * sigma)), 200_000))
    t = np.linspace(-1.0 - 14.0 * sigma, t_a, n)
    w = np.exp(_log_density_p(sigma, q, t)) * (t[1] - t[0])
    x = _loss(relation, sigma, q, t)
    m1 = float(np.sum(w * x)) + a * s_a
    m2 = float(np.sum(w * x * x)) + a * a * s_a
    return a, s_a, m1, max(m2 - m1 * m1, 0.0)


def _bennett_h(u: float) -> float:
    return (1.0 + u) * math.log1p(u) - u


def _choose_window(relation: str, phases: Sequence[Phase], stats: Sequence[_PhaseStats], tail_mass: float) -> _Window:
    lam = _CGF_LAMBDAS
    cgf = np.zeros_like(lam)
    mean = var = 0.0
    dx_target = math.inf
    lower_hard = 0.0
    for p, s in zip(phases, stats):
        cgf = cgf + p.num_steps * s.cgf
        mean += p.num_steps * s.mean
        var += p.num_steps * s.var
        if p.q < 1.0:
            dx_target = min(dx_target, math.sqrt(s.var) / _POINTS_PER_STD)
            lower_hard += p.num_steps * math.log1p(-p.q)
        else:
            dx_target = min(dx_target, math.sqrt(p.num_steps * s.var) / _POINTS_PER_STD)
    log_inv_tail = math.log(1 / tail_mass)

    def chernoff(x: float) -> float:
        return float(min(1.0, math.exp(min(0.0, float(np.min(cgf - lam * x))))))

    upper = float(np.min((cgf + log_inv_tail) / lam))

    # Bennett's inequality for the losses truncated at a_i (each step's loss
    # exceeds a_i with probability ≤ tail/(2 n T_i)): better than Chernoff
    # when the loss has rare, huge values (tiny q).
    bennett = None
    if all(p.q < 1.0 for p in phases):
        n_ph = len(phases)
        trunc = [_truncated_moments(relation, p.sigma, p.q, math.log(tail_mass / (2 * n_ph * p.num_steps)))
                 for p in phases]
        p_trunc = sum(p.num_steps * t[1] for p, t in zip(phases, trunc))
        m_t = sum(p.num_steps * t[2] for p, t in zip(phases, trunc))
        v_t = sum(p.num_steps * t[3] for p, t in zip(phases, trunc))
        b = max(t[0] - t[2] for t in trunc)
        if b > 0 and v_t > 0:
            def bennett(x: float) -> float:
                if x <= m_t:
                    return 1.0
                return float(min(1.0, p_trunc + math.exp(-(v_t / b ** 2) * _bennett_h(b * (x - m_t) / v_t))))

            c = (b * b / v_t) * math.log(2 / tail_mass)
            u_lo, u_hi = 0.0, 1.0
            while _bennett_h(u_hi) < c:
                u_hi *= 2
            for _ in range(100):
                u = 0.5 * (u_lo + u_hi)
                if _bennett_h(u) < c:
                    u_lo = u
                else:
                    u_hi = u
            upper = min(upper, m_t + u_hi * v_t / b)

    def tail(x: float) -> float:
        t = chernoff(x)
        if bennett is not None:
            t = min(t, bennett(x))
        return t

    std = math.sqrt(var)
    lower = mean - 12.0 * std - 1.0 * max(math.sqrt(s.var) for s in stats)
    if relation == ADD_REMOVE and all(p.q < 1 for p in phases):
        lower = max(lower, lower_hard)
    L = max(upper, -lower, 1e-12)
    L = min(1.05 * L, _FOURIER_MAX_L)
    if not math.isfinite(dx_target) or dx_target <= 0:
        dx_target = L / _FOURIER_MIN_NX
    return _Window(L, dx_target, tail, var)


def _inverse_loss(relation: str, sigma: float, q: float, x: np.ndarray) -> np.ndarray:
    """t with loss(t) = x (the loss is increasing in t); -inf below the range."""
    s2 = sigma * sigma
    x = np.asarray(x, dtype=np.float64)
    if relation == ADD_REMOVE:
        # t = σ² log((e^x − (1−q))/q) + 1/2, for x > log(1−q)
        with np.errstate(all="ignore"):
            r = np.expm1(x) / q
            t = np.where(r > -1.0, s2 * np.log1p(np.maximum(r, -1.0)) + 0.5, -np.inf)
        return t
    # substitute: u = e^{t/σ²} solves c u² + A u − c e^x = 0,
    # c = q e^{−1/(2σ²)}, A = (1−q)(1−e^x); computed in logs.
    log_c = math.log(q) - 1.0 / (2 * s2)
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
        log_u = np.where(em1 == 0, x / 2, log_u)
    return s2 * log_u


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


def _exact_mass_step(relation: str, sigma: float, q: float, nx: int, L: float):
    """One-step loss pmf on the grid: exact cell masses (CDF differences),
    placed mean-preservingly; mass above the grid is returned separately
    (treated as infinite loss)."""
    dx = 2.0 * L / nx
    pts = -L - dx / 2 + (dx / 2) * np.arange(2 * nx + 1)   # edges and midpoints
    t = _inverse_loss(relation, sigma, q, pts)
    with np.errstate(all="ignore"):
        cdf = (1 - q) * special.ndtr(t / sigma) + q * special.ndtr((t - 1) / sigma)
        sf = (1 - q) * special.ndtr(-t / sigma) + q * special.ndtr((1 - t) / sigma)
    edges = pts[::2]
    pmf = _mean_preserving_pmf(dx, edges[:-1] > 0, cdf[::2], sf[::2], cdf[1::2], sf[1::2])
    return pmf, float(sf[-1])


def _gaussian_step(mu: float, nx: int, L: float):
    """One-step pmf of the loss N(μ²/2, μ²) of the μ-Gaussian mechanism."""
    dx = 2.0 * L / nx
    pts = -L - dx / 2 + (dx / 2) * np.arange(2 * nx + 1)
    z = (pts - mu * mu / 2) / mu
    cdf = special.ndtr(z)
    sf = special.ndtr(-z)
    edges = pts[::2]
    pmf = _mean_preserving_pmf(dx, edges[:-1] > mu * mu / 2, cdf[::2], sf[::2], cdf[1::2], sf[1::2])
    return pmf, float(sf[-1])


def _exact_mass_pmf(relation: str, phases: Sequence[Phase], nx: int, L: float):
    """Composed pmf by FFT from exactly discretised one-step distributions
    (same method as the package, cell masses from CDFs); also returns the
    probability that some step's loss lies above the grid."""
    half = nx // 2
    spec = None
    log_no_inf = 0.0
    sub = [p for p in phases if p.q < 1.0]
    full = [p for p in phases if p.q == 1.0]
    steps = [(_exact_mass_step(relation, p.sigma, p.q, nx, L), p.num_steps) for p in sub]
    if full:
        steps.append((_gaussian_step(_gaussian_mu(relation, full), nx, L), 1))
    with np.errstate(all="ignore"):
        for (mass, p_inf), k in steps:
            f = np.fft.rfft(np.roll(mass, -half)) ** k
            spec = f if spec is None else spec * f
            log_no_inf += k * math.log1p(-min(p_inf, 1.0)) if p_inf < 1.0 else -math.inf
    pmf = np.roll(np.fft.irfft(spec, nx), half)
    return pmf, -math.expm1(log_no_inf)


def _aligned_L(phases: Sequence[Phase], nx: int, L: float) -> float:
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


def _grid(nx: int, L: float) -> np.ndarray:
    dx = 2.0 * L / nx
    return -L + dx * np.arange(nx)


def _eps_from_pmf(x: np.ndarray, p: np.ndarray, delta: float) -> float:
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


def _delta_from_pmf(x: np.ndarray, p: np.ndarray, eps: float) -> float:
    m = x > eps
    return float(max(np.sum((1.0 - np.exp(eps - x[m])) * p[m]), 0.0))


def _package_delta(relation: str, phases: Sequence[Phase], epsilon: float, nx: int, L: float) -> Optional[float]:
    """δ at ``epsilon`` under the substitute relation (the only one checked,
    see :func:`_package_agrees`) from the fourier-accountant package (its
    public ``get_delta_S``) on the grid (nx, L); None where the package cannot
    evaluate it."""
    import fourier_accountant

    if relation != SUBSTITUTE:
        raise ValueError(f"The package check is for the substitute relation, got relation={relation!r}.")
    try:
        with np.errstate(all="ignore"):
            d = fourier_accountant.get_delta_S(
                target_eps=float(epsilon),
                sigma=np.array([p.sigma for p in phases], dtype=np.float64),
                q=np.array([p.q for p in phases], dtype=np.float64),
                ncomp=np.array([p.num_steps for p in phases], dtype=np.int64),
                nx=int(nx),
                L=float(L),
            )
        d = float(np.real(d))
    except (ValueError, FloatingPointError, OverflowError, ZeroDivisionError, IndexError, MemoryError):
        return None
    return d if math.isfinite(d) else None


def _package_agrees(relation: str, phases: Sequence[Phase], epsilon: float, delta: float,
                    nx: Optional[int], L: float) -> bool:
    """Independent check of a certified (ε, δ) under the substitute relation.

    The fourier-accountant package discretises the same privacy-loss
    distribution by sampling its density; on the grid that certified ε its δ
    at ε must not exceed δ by more than a relative ``_PACKAGE_CHECK_RTOL``.
    False means the two implementations disagree and neither value is
    trusted. A δ above the target is rechecked on grids 4 and 16 times finer
    (the package samples the density at the grid points). Not applied under
    add/remove, where the package's density is poorly sampled next to
    log(1 − q) (its δ there was measured at 0 to 20 times the tight value),
    nor where the package cannot evaluate (an exception, or δ > 1).
    """
    if relation != SUBSTITUTE or nx is None or not (epsilon > 0 and math.isfinite(epsilon)):
        return True
    # The package samples the density at the grid points, which needs a finer
    # grid than exact cell masses where the loss density is peaked (small σ):
    # a disagreement is confirmed on grids 4 and 16 times finer (bounded).
    n = int(nx)
    while True:
        d = _package_delta(relation, phases, epsilon, n, L)
        if d is None or d > 1.0:
            return True   # the package cannot evaluate here: no evidence either way
        if d <= delta * (1.0 + _PACKAGE_CHECK_RTOL):
            return True
        n *= 4
        if n > min(16 * int(nx), _PACKAGE_CHECK_MAX_NX):
            return False


def _next_pow2(n: float) -> int:
    return 1 << max(0, int(math.ceil(math.log2(max(n, 1.0)))))


class _FourierResult(NamedTuple):
    value: Optional[float]   # certified ε (or δ); None if not verified
    num_evals: int
    nx: int
    L: float
    engine: str


def _fourier_certified(
    relation: str,
    phases: Sequence[Phase],
    *,
    delta: Optional[float] = None,
    epsilon: Optional[float] = None,
    rtol: float = _FOURIER_RTOL,
    max_nx: int = _FOURIER_MAX_NX,
    nx_hint: Optional[int] = None,
    deadline: Optional[float] = None,
) -> _FourierResult:
    """ε at ``delta`` (or δ at ``epsilon``) from the Fourier accountant,
    accepted only once stable under grid refinement; see compute_epsilon.

    The privacy-loss distribution is discretised with exact cell masses
    (:func:`_exact_mass_pmf`) and composed by FFT.
    """
    stats = [_phase_stats(relation, p.sigma, p.q) for p in phases]
    if delta is not None:
        tail_target = _TAIL_FRACTION * delta
    else:
        tail_target = _TAIL_FRACTION * max(_rdp_delta(relation, phases, epsilon) * 1e-3, 1e-300)
    win = _choose_window(relation, phases, stats, tail_target)
    nx0 = _next_pow2(2 * win.L / win.dx_target) if math.isfinite(win.dx_target) else _FOURIER_MIN_NX
    if nx_hint is not None:
        nx0 = max(nx0, nx_hint // 2)  # warm start: a grid that was needed before
    nx0 = int(min(max(nx0, _FOURIER_MIN_NX), _FOURIER_START_MAX_NX, max_nx // 4))
    evals = 0
    nx, L = nx0, win.L
    if epsilon is not None and epsilon >= 0.9 * L:
        L = min(1.2 * epsilon + 1.0, _FOURIER_MAX_L)
    if relation == ADD_REMOVE:
        L = _aligned_L(phases, nx, L)
    prev = prev2 = value_3 = None
    widenings = 0
    while True:
        if deadline is not None and time.monotonic() > deadline:
            return _FourierResult(None, evals, nx, L, "none")
        tail = win.tail(L)
        if delta is not None and tail > 0.5 * delta:
            break
        value = None
        evals += 1
        with np.errstate(all="ignore"):
            p, p_inf = _exact_mass_pmf(relation, phases, nx, L)
        if np.all(np.isfinite(p)) and math.isfinite(p_inf):
            x = _grid(nx, L)
            # FFT round-off: negative values on the side where δ is read
            pos = p[nx // 2:]
            noise = float(-np.sum(pos[pos < 0]))
            edge = max(1, nx // 40)
            edge_mass = float(np.sum(np.abs(p[:edge])) + np.sum(np.abs(p[-edge:])))
            # sanity: the composed distribution must be resolved (an
            # unresolved one-step loss collapses into one cell, ε = 0)
            mean_c = float(np.dot(p, x))
            var_c = float(np.dot(p, (x - mean_c) ** 2))
            if var_c >= 0.25 * win.var:
                if edge_mass > max(10 * tail_target, 1e3 * noise, 1e-12) and widenings < 3:
                    # mass reaches the window's edges (aliasing): widen it
                    widenings += 1
                    L = min(1.5 * L, _FOURIER_MAX_L)
                    nx = int(min(_next_pow2(1.5 * nx), max_nx // 2))
                    if relation == ADD_REMOVE:
                        L = _aligned_L(phases, nx, L)
                    prev = prev2 = value_3 = None
                    continue
                extra = tail + p_inf
                if delta is not None:
                    d_eff = delta - extra
                    if d_eff > _NOISE_FACTOR * noise:
                        value = _eps_from_pmf(x, p, d_eff)
                        if not math.isfinite(value):
                            value = None
                else:
                    value = _delta_from_pmf(x, p, epsilon) + extra
                    if value < _NOISE_FACTOR * noise:
                        value = None
        if value is not None and prev is not None and prev2 is not None:
            # stable: the last two grids agree to rtol and the two before
            # to 8 rtol (rules out chance agreement of oscillating values)
            diff = abs(value - prev)
            diff2 = abs(prev - prev2)
            scale = max(abs(value), abs(prev), abs(prev2))
            tol = rtol if delta is not None else 10 * rtol
            atol = _FOURIER_ATOL * min(1.0, scale + 1e-3) if delta is not None else 1e-300
            if diff <= tol * scale + atol and diff2 <= 8 * (tol * scale + atol):
                return _FourierResult(max(value, prev) + 2 * diff, evals, nx, L, "exact")
        prev2, prev = prev, value
        if nx * 2 > max_nx:
            # at the grid cap: accept a band of the last three values no
            # wider than _CAP_BAND (relative), with its width as margin
            last = (prev, prev2, value_3)
            if all(v is not None for v in last):
                hi, lo = max(last), min(last)
                if hi - lo <= _CAP_BAND * hi:
                    return _FourierResult(hi + (hi - lo), evals, nx, L, "exact")
            break
        value_3 = prev2
        nx *= 2
    return _FourierResult(None, evals, nx, L, "none")


# ---------------------------------------------------------------------------
# dp-accounting PLD (optional)
# ---------------------------------------------------------------------------


def _import_dp_accounting():
    try:
        from dp_accounting.pld import privacy_loss_distribution as pld
        from dp_accounting import privacy_accountant
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "accountant='pld' needs the optional dependency dp-accounting; "
            "install it with `pip install dp-accounting` (or `pip install d3p[tests]`), "
            "or use accountant='fourier'."
        ) from e
    return pld, privacy_accountant.NeighboringRelation


def _pld_object(relation: str, phases: Sequence[Phase], value_discretization_interval: float = 1e-4):
    pld, NR = _import_dp_accounting()
    nr = NR.ADD_OR_REMOVE_ONE if relation == ADD_REMOVE else NR.REPLACE_ONE
    total = None
    for p in phases:
        if p.num_steps == 0:
            continue
        one = pld.from_gaussian_mechanism(
            standard_deviation=p.sigma,
            sensitivity=1.0,
            sampling_prob=p.q,
            neighboring_relation=nr,
            value_discretization_interval=value_discretization_interval,
        ).self_compose(p.num_steps)
        total = one if total is None else total.compose(one)
    return total


# ---------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------


def _trivial(phases: Sequence[Phase]):
    """Returns 'zero' if nothing is released, 'inf' if some phase is non-private."""
    active = [p for p in phases if p.num_steps > 0]
    if not active:
        return "zero", active
    if any(p.sigma == 0 for p in active):
        return "inf", active
    if all(math.isinf(p.sigma) for p in active):
        return "zero", active
    return None, [p for p in active if not math.isinf(p.sigma)]


def _fourier_estimate(relation: str, phases: Sequence[Phase], delta: float) -> Optional[float]:
    """Unverified ε from one exact-mass grid (4 times the initial grid of the
    verified evaluation, at most 2^17 points): a cheap estimate used to steer
    the calibration search (never returned to the user)."""
    stats = [_phase_stats(relation, p.sigma, p.q) for p in phases]
    win = _choose_window(relation, phases, stats, _TAIL_FRACTION * delta)
    nx = 4 * _next_pow2(2 * win.L / win.dx_target)
    nx = int(min(max(nx, 2 ** 13), 2 ** 17))
    L = _aligned_L(phases, nx, win.L) if relation == ADD_REMOVE else win.L
    tail = win.tail(L)
    pmf, p_inf = _exact_mass_pmf(relation, phases, nx, L)
    d_eff = delta - tail - p_inf
    if not d_eff > 0:
        return None
    eps = _eps_from_pmf(_grid(nx, L), pmf, d_eff)
    return eps if math.isfinite(eps) else None


def _epsilon_impl(
    relation: str,
    phases: Sequence[Phase],
    delta: float,
    accountant: str,
    *,
    nx_hint: Optional[int] = None,
    deadline: Optional[float] = None,
    max_nx: int = _FOURIER_MAX_NX,
    package_check: bool = True,
    grid_out: Optional[dict] = None,
):
    """Returns (ε, num_evals, engine, nx) for validated inputs.

    ``package_check``: cross-check a certified Fourier ε with the
    fourier-accountant package (substitute relation; see
    :func:`_package_agrees`); on disagreement the RDP bound is returned.
    ``grid_out``: if a dict, receives ``nx`` and ``L`` of the certifying grid.
    """
    kind, active = _trivial(phases)
    if kind == "zero":
        return 0.0, 0, "trivial", None
    if kind == "inf":
        return math.inf, 0, "trivial", None
    if accountant == "pld":
        return float(_pld_object(relation, active).get_epsilon_for_delta(delta)), 1, "pld", None
    if all(p.q == 1.0 for p in active):
        return _gaussian_epsilon(_gaussian_mu(relation, active), delta), 1, "gaussian", None
    if accountant == "rdp":
        return _rdp_epsilon(relation, active, delta), 1, "rdp", None
    res = _fourier_certified(relation, active, delta=delta, nx_hint=nx_hint,
                             deadline=deadline, max_nx=max_nx)
    if res.value is None:
        return _rdp_epsilon(relation, active, delta), res.num_evals + 1, "rdp", res.nx
    if grid_out is not None:
        grid_out.update(nx=res.nx, L=res.L)
    if package_check and not _package_agrees(relation, active, res.value, delta, res.nx, res.L):
        return _rdp_epsilon(relation, active, delta), res.num_evals + 2, "rdp", res.nx
    return res.value, res.num_evals, res.engine, res.nx


def _delta_impl(relation: str, phases: Sequence[Phase], epsilon: float, accountant: str):
    kind, active = _trivial(phases)
    if kind == "zero":
        return 0.0
    if kind == "inf":
        # σ = 0: the record is revealed whenever it is used.
        log_unused = sum(p.num_steps * math.log1p(-p.q) if p.q < 1 else -math.inf
                         for p in active if p.sigma == 0)
        return float(-math.expm1(log_unused)) if log_unused > -math.inf else 1.0
    if accountant == "pld":
        return float(min(1.0, _pld_object(relation, active).get_delta_for_epsilon(epsilon)))
    if all(p.q == 1.0 for p in active):
        mu = _gaussian_mu(relation, active)
        # exact; rounded up by a relative 1e-12
        return float(min(1.0, math.exp(_gaussian_log_delta(mu, epsilon)) * (1 + 1e-12)))
    if accountant == "rdp":
        return _rdp_delta(relation, active, epsilon)
    res = _fourier_certified(relation, active, epsilon=epsilon)
    if res.value is None:
        return _rdp_delta(relation, active, epsilon)
    if not _package_agrees(relation, active, epsilon, res.value, res.nx, res.L):
        return _rdp_delta(relation, active, epsilon)
    return float(min(res.value, 1.0))


def compose_epsilon(
    phases: Iterable[Union[Phase, tuple]],
    delta: float,
    *,
    relation: Optional[str] = None,
    accountant: str = "fourier",
    sampler: Optional[str] = None,
) -> float:
    """ε at ``delta`` for a run made of phases with different settings.

    Each phase is ``(sigma, q, num_steps)`` (or a :class:`Phase`); the phases
    are composed (adaptively, in any order). The Fourier accountant composes
    them on one grid; the PLD accountant composes their PLDs.

    :param phases: sequence of ``(sigma, q, num_steps)``.
    :param float delta: δ in (0, 1).
    :param str relation: :data:`ADD_REMOVE` or :data:`SUBSTITUTE`.
    :param str accountant: ``"fourier"`` (default), ``"rdp"`` or ``"pld"``.
    :param str sampler: the sampler of every phase, ``"poisson"`` or
        ``"fixed_size"``; with ``relation``, resolved by :func:`accounting_for`
        (default: Poisson under add/remove).
    :return: ε ≥ 0; ``inf`` if some phase with steps has σ = 0.

    **Formal guarantees**: as :func:`compute_epsilon`, for the composition.

    >>> from d3p.accounting import compose_epsilon, ADD_REMOVE
    >>> eps = compose_epsilon([(2.0, 0.01, 1000), (1.0, 0.01, 100)], 1e-5, relation=ADD_REMOVE)
    >>> 0.5 < eps < 1.5
    True
    """
    acc = accounting_for(sampler, relation)
    accountant = _check_accountant(accountant)
    delta = _check_delta(delta)
    phases = _check_phases(phases)
    return _epsilon_impl(acc.pair, acc.engine_phases(phases), delta, accountant)[0]


def compose_delta(
    phases: Iterable[Union[Phase, tuple]],
    epsilon: float,
    *,
    relation: Optional[str] = None,
    accountant: str = "fourier",
    sampler: Optional[str] = None,
) -> float:
    """δ at ``epsilon`` for a run made of phases with different settings.

    :param phases: sequence of ``(sigma, q, num_steps)``.
    :param float epsilon: ε ≥ 0.
    :param str relation: :data:`ADD_REMOVE` or :data:`SUBSTITUTE`.
    :param str accountant: ``"fourier"`` (default), ``"rdp"`` or ``"pld"``.
    :param str sampler: ``"poisson"`` or ``"fixed_size"`` (see :func:`accounting_for`).
    :return: δ in [0, 1].

    **Formal guarantees**: as :func:`compute_delta`, for the composition.
    """
    acc = accounting_for(sampler, relation)
    accountant = _check_accountant(accountant)
    epsilon = _check_epsilon(epsilon)
    phases = _check_phases(phases)
    return _delta_impl(acc.pair, acc.engine_phases(phases), epsilon, accountant)


def compute_epsilon(
    sigma: float,
    q: float,
    num_steps: int,
    delta: float,
    *,
    relation: Optional[str] = None,
    accountant: str = "fourier",
    sampler: Optional[str] = None,
) -> float:
    """ε at ``delta`` for ``num_steps`` steps of the subsampled Gaussian
    mechanism with noise multiplier ``sigma`` and sampling probability ``q``.

    :param float sigma: noise multiplier σ ≥ 0 (noise std / clipping threshold).
        σ = 0 gives ``inf``.
    :param float q: sampling probability in (0, 1]; q = 1 means no subsampling.
    :param int num_steps: number of steps T ≥ 0 (T = 0 gives 0).
    :param float delta: δ in (0, 1); choose it well below 1/N.
    :param str relation: :data:`ADD_REMOVE` or :data:`SUBSTITUTE`.
    :param str accountant: ``"fourier"`` (default), ``"rdp"`` or ``"pld"``
        (needs the optional ``dp-accounting`` package).
    :param str sampler: ``"poisson"`` or ``"fixed_size"``. ``sampler`` and
        ``relation`` are resolved by :func:`accounting_for`: neither given,
        Poisson under add/remove; ``relation=SUBSTITUTE`` alone means
        fixed-size batches without replacement, accounted with the add/remove
        pair at noise multiplier σ/2; ``sampler="poisson",
        relation=SUBSTITUTE`` uses the midpoint pair.
    :return: ε ≥ 0.

    **Formal guarantees** (for the sampler and relation as resolved by
    :func:`accounting_for`, whose docstring gives each pair's proof; the
    mechanism releases every step's noisy sum, adaptive composition; below,
    "add/remove pair" and "midpoint pair" are the pairs composed):

    * ``"fourier"``: the returned ε is an upper bound on the ε of the
      mechanism, with the numerical error of the accountant included, as far
      as a refinement check can establish it:

      - the grid window [-L, L] is chosen by d3p so that a tail bound on the
        mass of the composed privacy-loss distribution above L (Chernoff with
        the exact cumulant generating function for the add/remove pair,
        accurate quadrature for the midpoint pair; Bennett's inequality for the losses
        truncated at a level each step exceeds with negligible probability)
        is at most 1e-3·δ; ε is read at δ minus that bound, so truncated mass
        can only make ε larger;
      - the one-step distribution is discretised with exact cell masses
        (CDF differences of the two Gaussians mapped through the loss), each
        split between two grid points so that its first moment is kept
        (mean-preserving); mass above the grid counts as infinite loss (it
        is added to δ); the T-fold composition is one FFT power;
      - a value is accepted only once it is stable under refinement: ε on
        grids with nx and 2·nx points must agree to a relative 5e-4, and the
        two grids before to 4e-3 (this rules out chance agreement of
        oscillating values); the larger of the last two plus twice their
        difference is returned (covers convergence of order ≥ 1/2). If mass reaches the window's edges the window is widened
        first;
      - midpoint pair: the fourier-accountant package (public
        ``get_delta_S``, which samples the loss density on the same grid)
        must give a δ at the certified ε at most 2% above the target (on the
        same grid, or on one 4 or 16 times finer, since it samples the
        density at the grid points); if it does not, the two implementations
        disagree and the RDP bound is
        returned. (Not applied to the add/remove pair: there the package's
        one-step density has a near-singular peak just above log(1-q) that
        point sampling misses; its δ was measured at 0 to 20 times the
        tight value, and its ε at its default grid 4% too low, in the cases
        of the test suite);
      - a grid whose composed distribution has less than a quarter of the
        true variance (an unresolved one-step loss) is never accepted;
      - at the grid cap (2^21 points) the last three values are accepted if
        they lie within a relative 2%, with the band's width added;
      - where no grid verifies (or the FFT round-off exceeds δ/20)
        the RDP bound is returned instead (see ``"rdp"``).

      For the add/remove pair the remove direction is analysed, which
      dominates the add direction for the subsampled Gaussian (checked
      against dp-accounting called directly, which takes the maximum of
      both, in tests/test_accounting_reference.py).
    * ``"rdp"``: for the add/remove pair a rigorous upper bound (exact
      integer-order RDP); for the midpoint pair its RDP by
      quadrature, checked at two resolutions (orders where they disagree are
      dropped). Converted to (ε, δ) with Canonne, Kamath, Steinke (2020).
    * ``"pld"``: dp-accounting's pessimistic estimate.
    * q = 1 (all phases): exact closed form of the Gaussian mechanism with
      μ = Δ·sqrt(T)/σ (Δ = 1 for add/remove, 2 for substitute under either
      sampler), rounded up.
    * σ = 0 with T ≥ 1 gives ``inf``; T = 0 gives 0; σ = inf gives 0.

    >>> from d3p.accounting import compute_epsilon, ADD_REMOVE
    >>> round(compute_epsilon(3.0, 0.1, 512, 1e-6, relation=ADD_REMOVE), 2)
    3.77
    """
    phase = Phase(_check_sigma(sigma), _check_q(q), _check_steps(num_steps))
    acc = accounting_for(sampler, relation)
    accountant = _check_accountant(accountant)
    delta = _check_delta(delta)
    return _epsilon_impl(acc.pair, acc.engine_phases([phase]), delta, accountant)[0]


def compute_delta(
    sigma: float,
    q: float,
    num_steps: int,
    epsilon: float,
    *,
    relation: Optional[str] = None,
    accountant: str = "fourier",
    sampler: Optional[str] = None,
) -> float:
    """δ at ``epsilon`` for ``num_steps`` steps of the subsampled Gaussian
    mechanism with noise multiplier ``sigma`` and sampling probability ``q``.

    :param float sigma: noise multiplier σ ≥ 0.
    :param float q: sampling probability in (0, 1].
    :param int num_steps: number of steps T ≥ 0.
    :param float epsilon: ε ≥ 0.
    :param str relation: :data:`ADD_REMOVE` or :data:`SUBSTITUTE`.
    :param str accountant: ``"fourier"`` (default), ``"rdp"`` or ``"pld"``.
    :param str sampler: ``"poisson"`` or ``"fixed_size"`` (resolved with
        ``relation`` by :func:`accounting_for`, as in :func:`compute_epsilon`).
    :return: δ in [0, 1].

    **Formal guarantees**: an upper bound on δ(ε) with the numerical error
    included, by the same rules as :func:`compute_epsilon`: δ on grids with nx
    and 2·nx points must agree to a relative 5e-3, the larger plus the
    difference plus the Chernoff bound on the mass above the window is
    returned, and never more than the RDP bound (returned where no stable value
    is found). σ = 0 gives 1 − (1 − q)^T, the probability that the record is
    used at all (its exact δ for a non-private query).
    """
    phase = Phase(_check_sigma(sigma), _check_q(q), _check_steps(num_steps))
    acc = accounting_for(sampler, relation)
    accountant = _check_accountant(accountant)
    epsilon = _check_epsilon(epsilon)
    return _delta_impl(acc.pair, acc.engine_phases([phase]), epsilon, accountant)


class EpsilonTracker:
    """Cheap running upper bound on the ε spent by a training run.

    Meant to be called every step (e.g. from a progress bar): ε is computed
    lazily on a geometric grid of step counts (ratio ``growth``, plus the
    planned total), cached, and :meth:`epsilon` reports the value at the
    smallest grid point ≥ t. As ε is non-decreasing in the number of steps,
    that is an upper bound on the ε after t steps.

    :param float sigma: noise multiplier σ ≥ 0.
    :param float q: sampling probability in (0, 1].
    :param float delta: δ in (0, 1).
    :param str relation: :data:`ADD_REMOVE` or :data:`SUBSTITUTE`.
    :param int num_steps: planned total number of steps (optional).
    :param str accountant: ``"fourier"`` (default), ``"rdp"`` or ``"pld"``.
    :param float growth: ratio of the geometric grid, > 1 (default 1.1).
    :param str sampler: ``"poisson"`` or ``"fixed_size"`` (resolved with
        ``relation`` by :func:`accounting_for`).

    **Formal guarantees**: ``epsilon(t)`` ≥ the ε of the first t steps, with
    the guarantees of :func:`compute_epsilon` (it is :func:`compute_epsilon` at
    a step count ≥ t); ``total_epsilon`` is :func:`compute_epsilon` at the
    planned ``num_steps``.

    >>> from d3p.accounting import EpsilonTracker, ADD_REMOVE
    >>> tracker = EpsilonTracker(2.0, 0.01, 1e-5, relation=ADD_REMOVE, num_steps=1000)
    >>> tracker.epsilon(500) <= tracker.total_epsilon
    True
    """

    def __init__(
        self,
        sigma: float,
        q: float,
        delta: float,
        *,
        relation: Optional[str] = None,
        num_steps: Optional[int] = None,
        accountant: str = "fourier",
        growth: float = 1.1,
        sampler: Optional[str] = None,
    ):
        self.sigma = _check_sigma(sigma)
        self.q = _check_q(q)
        self.delta = _check_delta(delta)
        self.accounting = accounting_for(sampler, relation)
        self.relation = self.accounting.relation
        self.sampler = self.accounting.sampler
        self.accountant = _check_accountant(accountant)
        self.num_steps = None if num_steps is None else _check_steps(num_steps)
        growth = _as_float("growth", growth)
        if not (growth > 1 and math.isfinite(growth)):
            raise ValueError(f"Expected growth > 1, got growth={growth!r}")
        self.growth = growth
        self._cache: dict = {}

    def _grid_point(self, t: int) -> int:
        if t <= 0:
            return 0
        if self.num_steps is not None and t <= self.num_steps:
            # next grid point, capped at the planned total
            k = math.ceil(math.log(t) / math.log(self.growth) - 1e-12)
            g = max(t, int(math.ceil(self.growth ** k)))
            return min(g, self.num_steps)
        k = math.ceil(math.log(t) / math.log(self.growth) - 1e-12)
        return max(t, int(math.ceil(self.growth ** k)))

    def _eps_at(self, t: int) -> float:
        if t not in self._cache:
            self._cache[t] = compute_epsilon(
                self.sigma, self.q, t, self.delta, relation=self.relation,
                accountant=self.accountant, sampler=self.sampler,
            )
        return self._cache[t]

    def epsilon(self, num_steps_done: int) -> float:
        """Upper bound on ε after ``num_steps_done`` steps (cached, cheap).

        :param int num_steps_done: steps taken so far, ≥ 0.
        :return: ε at the next grid point ≥ ``num_steps_done``.
        """
        t = _check_steps(num_steps_done, "num_steps_done")
        return self._eps_at(self._grid_point(t))

    @property
    def total_epsilon(self) -> float:
        """ε for the planned ``num_steps`` (exact step count)."""
        if self.num_steps is None:
            raise ValueError("total_epsilon needs the planned num_steps, got num_steps=None")
        return self._eps_at(self.num_steps)

    def __repr__(self) -> str:
        return (f"EpsilonTracker(sigma={self.sigma!r}, q={self.q!r}, delta={self.delta!r}, "
                f"relation={self.relation!r}, sampler={self.sampler!r}, num_steps={self.num_steps!r}, "
                f"accountant={self.accountant!r})")
