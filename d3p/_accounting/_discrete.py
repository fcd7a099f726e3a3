# SPDX-License-Identifier: Apache-2.0
"""Rényi-DP upper bounds for the subsampled discrete Gaussian sum.

**The mechanism.** Every record's contribution is an integer vector
r_i ∈ Z^d whose L2 norm is certified to be at most Δ (an unsampled or padded
slot contributes 0). One step releases the exact integer sum
Σ_{i ∈ batch} r_i + Z, where the coordinates of Z are independent discrete
Gaussians N_Z(0, s), P(z) ∝ exp(-z²/(2s)) on Z, with s = (σΔ)² and σ the
noise multiplier. Since Δ²/s = 1/σ², the per-step RDP ε(α) depends on σ, the
sampling probability q and the case below only. T steps compose adaptively by
adding ε(α) (Mironov 2017, Prop. 1); every bound here is a supremum over all
neighbouring pairs and both directions, so the sum bounds the composition for
every pair (the pitfall of composing one worst-case pair, Lebeda, Regehr,
Kamath & Steinke 2024, concerns accountants of privacy-loss distributions,
not RDP suprema). (ε, δ) follows by :func:`d3p._accounting._rdp.epsilon_from_rdp`.

**The unsampled step** (Canonne, Kamath & Steinke 2020, "The Discrete
Gaussian for Differential Privacy"): for x, x' ∈ Z^d,
D_α(x + Z ‖ x' + Z) ≤ α‖x - x'‖²/(2s) for every α > 1, with equality when α
is an integer. Derivation from the moment generating function bound
E[e^{tY}] ≤ e^{t²s/2} of Y ~ N_Z(0, s), valid for every real t (CKS 2020):
the coordinates are independent, so D_α adds over them. In one coordinate let
k = x_j - x'_j ∈ Z; shifting both distributions by the integer x'_j and using
α(z - k)² + (1 - α)z² = z² - 2αkz + αk²,

    e^{(α-1) D_α} = Σ_z p(z - k)^α p(z)^{1-α} = E[e^{αkY/s}] e^{-αk²/(2s)}
                  ≤ e^{α²k²/(2s) - αk²/(2s)} = e^{α(α-1)k²/(2s)}.

The bound depends on k² only, so it holds in both directions (k ↦ -k). If αk
is an integer, E[e^{αkY/s}] e^{-α²k²/(2s)} = Σ_z p(z - αk) = 1: equality. No
additive τ term enters: Z is exactly discrete Gaussian (such terms arise for
sums of several discrete Gaussians). Neighbours move the released sum by at
most Δ (add/remove) or 2Δ (substitute), so the unsampled step is
(α, αc²/(2σ²))-RDP with c = 1 (add/remove) or c = 2 (substitute); this is
also the value at q = 1.

**The cases** (``case`` is a ``(sampler, relation)`` pair). Every subsampled
bound is also capped by the unsampled value: coupling the two runs' batch
choices so that they differ in the one record only, joint convexity of
(P, Q) ↦ Σ P^α Q^{1-α} gives e^{(α-1)ε(α)} ≤ (1 - q) + q e^{(α-1)αc²/(2σ²)}.

* ``POISSON_ADD_REMOVE`` -- Zhu & Wang (ICML 2019, "Poisson Subsampled Rényi
  Differential Privacy"), general upper bound, valid for any base mechanism
  with RDP ε(·) under add/remove (both directions) and integer α ≥ 2:
  e^{(α-1)ε(α)} ≤ (1-q)^{α-1}(1 + (α-1)q) + C(α,2) q² (1-q)^{α-2} e^{ε(2)}
  + 3 Σ_{ℓ=3}^{α} C(α,ℓ) q^ℓ (1-q)^{α-ℓ} e^{(ℓ-1)ε(ℓ)}, here ε(ℓ) = ℓ/(2σ²).
* ``FIXED_SIZE_SUBSTITUTE`` -- Wang, Balle & Kasiviswanathan (AISTATS 2019,
  "Subsampled Rényi Differential Privacy and Analytical Moments Accountant"),
  Thm. 9, valid for any base mechanism applied to a uniformly random subset of
  m = qN records drawn without replacement, with RDP ε(·) under substitution,
  and integer α ≥ 2; with ε(∞) = ∞ it reads
  e^{(α-1)ε(α)} ≤ 1 + C(α,2) q² min(4(e^{ε(2)} - 1), 2e^{ε(2)})
  + 2 Σ_{j=3}^{α} C(α,j) q^j e^{(j-1)ε(j)}, here ε(j) = 2j/σ² (sensitivity 2Δ).
* ``POISSON_SUBSTITUTE`` -- the smaller of two bounds (integer α ≥ 2):

  (i) *Direct.* The rest of the batch, S, is independent of whether the
  differing slot is sampled, so the outputs are mixtures over S of
  S + ((1-q)μ_0 + qμ_u) and S + ((1-q)μ_0 + qμ_w), where μ_v is the law of
  v + Z and u, w ∈ Z^d (‖u‖, ‖w‖ ≤ Δ) the two records' contributions. Joint
  convexity and integer translation reduce the divergence to that of
  P = (1-q)μ_0 + qμ_u against R = (1-q)μ_0 + qμ_w. With P = R + q(μ_u - μ_w),
  Σ_z P^α R^{1-α} = Σ_{j=0}^{α} C(α,j) q^j Σ_z (μ_u - μ_w)^j R^{1-j}: the
  j = 0 term is 1, the j = 1 term 0, and R ≥ (1-q)μ_0 bounds the j-th term by
  (1-q)^{1-j} Σ_z |μ_u - μ_w|^j μ_0^{1-j}. Completing the square gives
  Σ_z μ_a μ_b / μ_0 = e^{a·b/s} for a, b ∈ Z^d, so for j = 2 this is
  e^{‖u‖²/s} + e^{‖w‖²/s} - 2e^{u·w/s} ≤ 4 sinh(1/σ²); for j ≥ 3,
  |μ_u - μ_w| ≤ max(μ_u, μ_w) and the unsampled step bound it by
  2e^{j(j-1)/(2σ²)}. Hence
  e^{(α-1)ε(α)} ≤ 1 + C(α,2) q²/(1-q) · 4 sinh(1/σ²)
  + 2 Σ_{j=3}^{α} C(α,j) q^j (1-q)^{1-j} e^{j(j-1)/(2σ²)},
  symmetric in u and w, so valid in both directions. (Our derivation; the
  structure is that of Wang, Balle & Kasiviswanathan's proof.)

  (ii) *Remove, then add.* D⁻, the data set without the substituted record,
  is an add/remove neighbour of both. Mironov (2017, "Rényi Differential
  Privacy", Prop. 11, weak triangle inequality) with Hölder exponent a/α:
  D_α(P_D ‖ P_D') ≤ α(a-1)/(a(α-1)) D_a(P_D ‖ P_D⁻) + D_b(P_D⁻ ‖ P_D') for
  integers a > α, b = ⌈α(a-1)/(a-α)⌉ (D_β is nondecreasing in β). The removal
  direction D_a(P_D ‖ P_D⁻) is bounded by the Zhu & Wang sum without the
  factor 3 (joint convexity over S, then the binomial expansion of
  ((1-q) + q μ_u/μ_0)^a, exact for integer a); the other term by Zhu & Wang's
  general bound above.

Every per-step value is rounded up by a relative 1e-9 to cover floating-point
error of the sums. Functions take validated inputs (:mod:`d3p.accounting`
checks them); only ``case`` is checked here.
"""

import functools
import math
from typing import Sequence, Tuple

import numpy as np
from scipy import special

from d3p._accounting import _rdp
from d3p._accounting._names import Relation, Sampler

#: Poisson sampling (each record with probability q), add/remove one record.
POISSON_ADD_REMOVE = (Sampler.POISSON, Relation.ADD_REMOVE)
#: Poisson sampling, substitute one record.
POISSON_SUBSTITUTE = (Sampler.POISSON, Relation.SUBSTITUTE)
#: B = qN records drawn without replacement, substitute one record.
FIXED_SIZE_SUBSTITUTE = (Sampler.FIXED_SIZE, Relation.SUBSTITUTE)

#: The supported cases.
CASES = (POISSON_ADD_REMOVE, POISSON_SUBSTITUTE, FIXED_SIZE_SUBSTITUTE)

#: Sensitivity of one step's sum in units of Δ, per case.
_SENSITIVITY = {POISSON_ADD_REMOVE: 1.0, POISSON_SUBSTITUTE: 2.0, FIXED_SIZE_SUBSTITUTE: 2.0}

#: The integer orders at which each case is evaluated: the fixed-size case's
#: tight continuous counterpart is the add/remove pair at σ/2, whose best
#: orders span the add/remove range.
ORDERS = {
    POISSON_ADD_REMOVE: _rdp.ORDERS[Relation.ADD_REMOVE],
    POISSON_SUBSTITUTE: _rdp.ORDERS[Relation.SUBSTITUTE],
    FIXED_SIZE_SUBSTITUTE: _rdp.ORDERS[Relation.ADD_REMOVE],
}

#: Hölder exponents a/α tried by the remove-then-add bound.
_HOLDER = (1.25, 1.5, 2.0, 3.0, 4.0)

_ROUND_UP = 1e-9


def _case(case) -> Tuple[Sampler, Relation]:
    """The canonical ``(sampler, relation)`` pair of ``case``."""
    try:
        sampler, relation = case
        key = (Sampler(sampler), Relation(relation))
    except (TypeError, ValueError):
        key = None
    if key not in _SENSITIVITY:
        names = ", ".join(f"({s.value!r}, {r.value!r})" for s, r in CASES)
        raise ValueError(f"Expected case to be one of {names}, got case={case!r}.")
    return key


def _logsumexp(terms: np.ndarray) -> float:
    """log Σ exp(terms), shifted by the maximum (scipy.special.logsumexp's
    algorithm without its per-call overhead, which dominates here: a phase
    takes hundreds of such sums)."""
    top = float(np.max(terms))
    if not math.isfinite(top):
        return top
    return top + math.log(float(np.sum(np.exp(terms - top))))


def _log_expm1(y: float) -> float:
    """log(e^y - 1) for y ≥ 0 without overflow (-inf at 0)."""
    return y + math.log(-math.expm1(-y)) if y > 0 else -math.inf


@functools.lru_cache(maxsize=None)
def _log_factorials(size: int) -> np.ndarray:
    """log k! for k = 0 .. size - 1."""
    return special.gammaln(np.arange(size, dtype=np.float64) + 1)


def _log_binomials(alpha: int, start: int) -> Tuple[np.ndarray, np.ndarray]:
    """k = start..α (as floats) and log C(α, k)."""
    table = _log_factorials(1 << (alpha + 1).bit_length())
    k = np.arange(start, alpha + 1)
    return k.astype(np.float64), table[alpha] - table[k] - table[alpha - k]


def _log_poisson_sum(alpha: int, q: float, x: float, high_factor: float) -> float:
    """log Σ_{ℓ=0}^{α} C(α,ℓ) q^ℓ (1-q)^{α-ℓ} e^{ℓ(ℓ-1)x/2}, the terms ℓ ≥ 3
    multiplied by ``high_factor`` (q < 1)."""
    k, log_binom = _log_binomials(alpha, 0)
    terms = log_binom + (alpha - k) * math.log1p(-q) + k * math.log(q) + k * (k - 1) * x / 2
    terms[3:] += math.log(high_factor)
    return _logsumexp(terms)


def _poisson_remove(sigma: float, q: float, alpha: int) -> float:
    """RDP of the removal direction, Poisson sampling, sensitivity Δ."""
    x = (1.0 / sigma) ** 2
    return min(_log_poisson_sum(alpha, q, x, 1.0) / (alpha - 1), alpha * x / 2)


def _poisson_add_remove(sigma: float, q: float, alpha: int) -> float:
    """Zhu & Wang's general bound (both directions), sensitivity Δ."""
    x = (1.0 / sigma) ** 2
    return min(_log_poisson_sum(alpha, q, x, 3.0) / (alpha - 1), alpha * x / 2)


def _fixed_size_substitute(sigma: float, q: float, alpha: int) -> float:
    """Wang, Balle & Kasiviswanathan's Thm. 9 with ε(j) = 2j/σ², ε(∞) = ∞."""
    y = 4.0 * (1.0 / sigma) ** 2  # ε(2)
    j, log_binom = _log_binomials(alpha, 3)
    high = log_binom + j * math.log(q) + math.log(2) + j * (j - 1) * y / 2
    second = min(_log_expm1(y) + math.log(4), math.log(2) + y)
    low = [0.0, _log_binomials(alpha, 2)[1][0] + 2 * math.log(q) + second]
    log_sum = _logsumexp(np.concatenate([low, high]))
    return min(log_sum / (alpha - 1), alpha * y / 2)


def _poisson_substitute_direct(sigma: float, q: float, alpha: int) -> float:
    """Bound (i) of the module docstring."""
    x = (1.0 / sigma) ** 2
    j, log_binom = _log_binomials(alpha, 3)
    high = log_binom + j * math.log(q) + (1 - j) * math.log1p(-q) + math.log(2) + j * (j - 1) * x / 2
    log_4sinh = math.log(2) - x + _log_expm1(2 * x)  # 4 sinh(x) = 2e^{-x}(e^{2x} - 1)
    low = [0.0, _log_binomials(alpha, 2)[1][0] + 2 * math.log(q) - math.log1p(-q) + log_4sinh]
    return _logsumexp(np.concatenate([low, high])) / (alpha - 1)


def _poisson_substitute_triangle(sigma: float, q: float, alpha: int) -> float:
    """Bound (ii) of the module docstring, minimised over :data:`_HOLDER`."""
    best = math.inf
    for ratio in _HOLDER:
        a = max(alpha + 1, int(round(ratio * alpha)))
        b = -(-alpha * (a - 1) // (a - alpha))  # exact integer ceiling
        weight = alpha * (a - 1) / (a * (alpha - 1))
        best = min(best, weight * _poisson_remove(sigma, q, a) + _poisson_add_remove(sigma, q, b))
    return best


def _poisson_substitute(sigma: float, q: float, alpha: int) -> float:
    """The smaller of bounds (i) and (ii), capped by the unsampled value."""
    return min(_poisson_substitute_direct(sigma, q, alpha),
               _poisson_substitute_triangle(sigma, q, alpha),
               2.0 * alpha * (1.0 / sigma) ** 2)


_STEP = {
    POISSON_ADD_REMOVE: _poisson_add_remove,
    POISSON_SUBSTITUTE: _poisson_substitute,
    FIXED_SIZE_SUBSTITUTE: _fixed_size_substitute,
}


def phase(case, sigma: float, q: float, orders: np.ndarray) -> np.ndarray:
    """Per-step RDP upper bound ε(α) at the integer orders α ≥ 2 of ``orders``.

    :param case: ``(sampler, relation)``, one of :data:`CASES` (any spelling
        that :class:`Sampler` and :class:`Relation` accept).
    :param float sigma: noise multiplier σ of the run, s = (σΔ)²; the factor 2
        of the substitute relation is applied here (do not halve σ).
    :param float q: sampling probability in (0, 1] (B/N for fixed-size batches).
    :param orders: integer orders ≥ 2.
    """
    key = _case(case)
    orders = np.asarray(orders, dtype=np.int64)
    if sigma == 0 or 1.0 / sigma > 1e150:  # no noise, or 1/σ² beyond float range
        return np.full(orders.shape, math.inf)
    if math.isinf(sigma):
        return np.zeros(orders.shape)
    if q == 1.0:
        out = orders * _SENSITIVITY[key] ** 2 * (1.0 / sigma) ** 2 / 2
    else:
        step = _STEP[key]
        out = np.array([step(sigma, q, int(a)) for a in orders], dtype=np.float64)
    return out * (1 + _ROUND_UP)


def _total(key, phases: Sequence) -> np.ndarray:
    """RDP of the composition at the orders of ``key``."""
    total = np.zeros(ORDERS[key].shape)
    for p in phases:
        if p.num_steps > 0:
            total = total + p.num_steps * phase(key, p.sigma, p.q, ORDERS[key])
    return total


def epsilon(case, phases: Sequence, delta: float) -> float:
    """ε at ``delta`` of the composed steps (0 if nothing depends on the data).

    ``phases``: items with ``sigma``, ``q`` and ``num_steps`` (as
    :class:`d3p.accounting.Phase`), σ being the run's noise multiplier.
    """
    key = _case(case)
    rdp = _total(key, phases)
    if not np.any(rdp):
        return 0.0
    return _rdp.epsilon_from_rdp(ORDERS[key], rdp, delta)


def delta(case, phases: Sequence, epsilon: float) -> float:
    """δ at ``epsilon`` of the composed steps (0 if nothing depends on the data)."""
    key = _case(case)
    rdp = _total(key, phases)
    if not np.any(rdp):
        return 0.0
    return _rdp.delta_from_rdp(ORDERS[key], rdp, epsilon)
