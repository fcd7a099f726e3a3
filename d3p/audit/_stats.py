# SPDX-License-Identifier: Apache-2.0
"""Statistics of an audit, for any mechanism: from the attack scores of runs
with and without the canary to a lower bound on ε that holds with confidence
``1 - beta`` (:func:`epsilon_lower_bound`), with its building blocks
(one-sided Clopper-Pearson bounds, the ε implied by an attack's rates), the
attack's AUC next to the largest AUC an (ε, δ)-DP mechanism allows, and the
likelihood-ratio score against T steps of the Poisson subsampled Gaussian
mechanism. Nothing here runs a mechanism; see :mod:`d3p.audit`.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence, Tuple

import jax
import numpy as np
from scipy import special, stats

from d3p import _validate

__all__ = [
    "EpsilonLowerBound",
    "clopper_pearson_bounds",
    "epsilon_from_rates",
    "epsilon_lower_bound",
    "auc",
    "dp_max_auc",
    "subsampled_gaussian_log_ratio",
]


def _delta(value) -> float:
    """δ in [0, 1)."""
    return _validate.number("delta", value, low=0.0, high=1.0, high_open=True)


def _scores(name: str, values, minimum: int = 1) -> np.ndarray:
    """A one-dimensional float64 array of at least ``minimum`` scores, none NaN."""
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"Expected {name} to be one-dimensional, got shape {x.shape}.")
    if x.shape[0] < minimum:
        raise ValueError(f"Expected at least {minimum} values in {name}, got {x.shape[0]}.")
    if np.any(np.isnan(x)):
        raise ValueError(f"Expected {name} without NaN, got {int(np.sum(np.isnan(x)))} NaN value(s).")
    return x


def _check_counts(successes, trials) -> Tuple[np.ndarray, np.ndarray]:
    """Integer counts ``0 <= successes <= trials`` with ``trials >= 1``, as arrays."""
    k = np.asarray(successes)
    n = np.asarray(trials)
    if not (np.issubdtype(k.dtype, np.integer) or np.all(k == np.round(k))):
        raise ValueError(f"Expected integer successes, got {successes!r}.")
    if np.any(n < 1) or not (np.issubdtype(n.dtype, np.integer) or np.all(n == np.round(n))):
        raise ValueError(f"Expected integer trials >= 1, got trials={trials!r}.")
    if np.any(k < 0) or np.any(k > n):
        raise ValueError(f"Expected 0 <= successes <= trials, got successes={successes!r}, trials={trials!r}.")
    return k, n


def clopper_pearson_bounds(successes, trials, alpha: float) -> Tuple[np.ndarray, np.ndarray]:
    """One-sided Clopper-Pearson confidence bounds for a binomial proportion.

    :param successes: number(s) of successes ``k`` (integer array-like).
    :param trials: number(s) of trials ``n >= 1`` (broadcastable with ``successes``).
    :param float alpha: error level of EACH bound, in (0, 1).
    :return: ``(lower, upper)``: ``P(p < lower) <= alpha`` and
        ``P(p > upper) <= alpha`` for ``k ~ Binomial(n, p)``, every ``p``.

    **Formal guarantees.** Exact (conservative) coverage for every ``p`` and
    ``n``: ``lower`` is the ``alpha`` quantile of ``Beta(k, n - k + 1)`` (0 for
    ``k = 0``) and ``upper`` the ``1 - alpha`` quantile of
    ``Beta(k + 1, n - k)`` (1 for ``k = n``), computed with SciPy. The pair
    ``(lower, upper)`` is a two-sided interval at level ``2 alpha``.

    >>> lo, hi = clopper_pearson_bounds(0, 100, 0.05)
    >>> float(lo), round(float(hi), 4)  # 1 - 0.05 ** (1 / 100)
    (0.0, 0.0295)
    """
    alpha = _validate.open_unit("alpha", alpha)
    k, n = _check_counts(successes, trials)
    k, n = np.broadcast_arrays(k.astype(np.float64), n.astype(np.float64))
    with np.errstate(all="ignore"):
        lower = np.where(k > 0, stats.beta.ppf(alpha, np.maximum(k, 1), n - k + 1), 0.0)
        upper = np.where(k < n, stats.beta.ppf(1 - alpha, k + 1, np.maximum(n - k, 1)), 1.0)
    return lower, upper


def _rate(name: str, value) -> np.ndarray:
    """Rate(s) in [0, 1], as a float64 array."""
    x = np.asarray(value, dtype=np.float64)
    if np.any(~((x >= 0) & (x <= 1))):
        raise ValueError(f"Expected {name} in [0, 1], got {name}={x!r}.")
    return x


def epsilon_from_rates(tpr, fpr, delta: float) -> np.ndarray:
    """The smallest ε compatible with an attack's rates under (ε, δ)-DP.

    An (ε, δ)-DP mechanism forces every test of ``D`` (positive) against a
    neighbour ``D'`` to satisfy ``TPR <= e^ε FPR + δ`` and
    ``TNR <= e^ε FNR + δ``. This returns
    ``max(0, log((TPR - δ) / FPR), log((TNR - δ) / FNR))`` (terms whose
    numerator is not positive are skipped; a zero denominator gives ``inf``).

    :param tpr: true positive rate(s) in [0, 1].
    :param fpr: false positive rate(s) in [0, 1].
    :param float delta: δ in [0, 1).
    :return: ε (array, or 0-d array for scalars).

    Applied to point estimates of the rates this is NOT a confidence bound;
    :func:`epsilon_lower_bound` applies it to confidence bounds instead. It is
    non-decreasing in ``tpr`` and non-increasing in ``fpr``.

    >>> round(float(epsilon_from_rates(0.5, 0.1, delta=0.0)), 4)  # log(0.5 / 0.1)
    1.6094
    >>> float(epsilon_from_rates(0.5, 0.0, delta=0.0))
    inf
    """
    delta = _delta(delta)
    tpr = _rate("tpr", tpr)
    fpr = _rate("fpr", fpr)
    with np.errstate(divide="ignore", invalid="ignore"):
        num1, den1 = tpr - delta, fpr
        num2, den2 = (1.0 - fpr) - delta, 1.0 - tpr
        e1 = np.where(num1 > 0, np.log(np.where(num1 > 0, num1, 1.0)) - np.log(den1), -np.inf)
        e2 = np.where(num2 > 0, np.log(np.where(num2 > 0, num2, 1.0)) - np.log(den2), -np.inf)
    return np.maximum(np.maximum(e1, e2), 0.0)


class EpsilonLowerBound(NamedTuple):
    """The result of :func:`epsilon_lower_bound`.

    - **epsilon** - the lower bound on ε at ``delta``, valid with confidence
      ``1 - beta`` (see :func:`epsilon_lower_bound`, "Formal guarantees").
    - **threshold** - the attack's threshold: it guesses "canary present"
      when the score is ``>= threshold``.
    - **tpr**, **fpr** - point estimates of the attack's rates on the
      evaluation runs (descriptive only).
    - **tpr_lower**, **fpr_upper** - the one-sided Clopper-Pearson bounds used.
    - **num_in**, **num_out** - evaluation runs with and without the canary.
    - **delta**, **beta** - as given.
    - **selection** - ``"split"``, ``"fixed"`` or ``"bonferroni"``.
    """

    epsilon: float
    threshold: float
    tpr: float
    fpr: float
    tpr_lower: float
    fpr_upper: float
    num_in: int
    num_out: int
    delta: float
    beta: float
    selection: str


def _counts_at(sorted_scores: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """Number of scores ``>= t`` for every t."""
    return sorted_scores.shape[0] - np.searchsorted(sorted_scores, thresholds, side="left")


def _bound_from_counts(k_in, n_in, k_out, n_out, delta, alpha):
    tpr_lo, _ = clopper_pearson_bounds(k_in, n_in, alpha)
    _, fpr_hi = clopper_pearson_bounds(k_out, n_out, alpha)
    return epsilon_from_rates(tpr_lo, fpr_hi, delta), tpr_lo, fpr_hi


def _wilson(k, n, z):
    """Fast approximate one-sided (lower, upper) binomial bounds (Wilson score)."""
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return np.clip(centre - half, 0, 1), np.clip(centre + half, 0, 1)


def _choose_threshold(cal_in, cal_out, delta, alpha, max_exact=256):
    """The threshold maximising the ε lower bound on the calibration runs."""
    s_in, s_out = np.sort(cal_in), np.sort(cal_out)
    candidates = np.unique(np.concatenate([s_in, s_out]))
    n_in, n_out = s_in.shape[0], s_out.shape[0]
    k_in = _counts_at(s_in, candidates)
    k_out = _counts_at(s_out, candidates)
    if candidates.shape[0] > max_exact:
        # screen with fast approximate bounds, then rank the best exactly
        z = special.ndtri(1 - alpha)
        tpr_lo, _ = _wilson(k_in, n_in, z)
        _, fpr_hi = _wilson(k_out, n_out, z)
        approx = epsilon_from_rates(tpr_lo, fpr_hi, delta)
        keep = np.argsort(-approx, kind="stable")[:max_exact]
        candidates, k_in, k_out = candidates[keep], k_in[keep], k_out[keep]
    eps, _, _ = _bound_from_counts(k_in, n_in, k_out, n_out, delta, alpha)
    best = int(np.argmax(eps))
    return float(candidates[best])


def calibration_size(n: int, calibration_fraction: float) -> int:
    """Number of leading runs (of ``n >= 2``) that choose the threshold in the split mode.

    :param int n: number of runs.
    :param float calibration_fraction: share of the runs, in (0, 1).
    :return: an integer in ``[1, n - 1]``, so that both parts are non-empty.
    """
    frac = _validate.open_unit("calibration_fraction", calibration_fraction)
    return min(max(int(round(frac * n)), 1), n - 1)


def _check_bound_scores(scores_in, scores_out, threshold, thresholds) -> Tuple[np.ndarray, np.ndarray]:
    """The score arrays of :func:`epsilon_lower_bound`, checked: at least two
    runs each when the split mode needs calibration runs, else one; at most
    one of ``threshold`` and ``thresholds``."""
    if threshold is not None and thresholds is not None:
        raise ValueError(
            f"Expected at most one of threshold and thresholds, got threshold={threshold!r} "
            f"and thresholds={thresholds!r}."
        )
    minimum = 2 if threshold is None and thresholds is None else 1
    return _scores("scores_in", scores_in, minimum), _scores("scores_out", scores_out, minimum)


class _Selection(NamedTuple):
    """The thresholds to evaluate, the runs to evaluate them on, and the level of each bound."""

    candidates: np.ndarray
    scores_in: np.ndarray
    scores_out: np.ndarray
    alpha: float
    name: str


def _select(scores_in, scores_out, delta, beta, threshold, thresholds, calibration_fraction) -> _Selection:
    """The ``fixed``, ``bonferroni`` or ``split`` selection of :func:`epsilon_lower_bound`."""
    alpha = beta / 2
    if threshold is not None:
        t = _validate.number("threshold", threshold, finite=False)
        return _Selection(np.asarray([t]), scores_in, scores_out, alpha, "fixed")
    if thresholds is not None:
        candidates = np.asarray(thresholds, dtype=np.float64).reshape(-1)
        if candidates.shape[0] == 0 or np.any(np.isnan(candidates)):
            raise ValueError(f"Expected a non-empty list of thresholds without NaN, got thresholds={thresholds!r}.")
        return _Selection(candidates, scores_in, scores_out, beta / (2 * candidates.shape[0]), "bonferroni")
    c_in = calibration_size(scores_in.shape[0], calibration_fraction)
    c_out = calibration_size(scores_out.shape[0], calibration_fraction)
    t = _choose_threshold(scores_in[:c_in], scores_out[:c_out], delta, alpha)
    return _Selection(np.asarray([t]), scores_in[c_in:], scores_out[c_out:], alpha, "split")


def _best_bound(sel: _Selection, delta: float, beta: float) -> EpsilonLowerBound:
    """The largest bound over the selection's thresholds, on its evaluation runs."""
    s_in, s_out = np.sort(sel.scores_in), np.sort(sel.scores_out)
    n_in, n_out = s_in.shape[0], s_out.shape[0]
    k_in = _counts_at(s_in, sel.candidates)
    k_out = _counts_at(s_out, sel.candidates)
    eps, tpr_lo, fpr_hi = _bound_from_counts(k_in, n_in, k_out, n_out, delta, sel.alpha)
    best = int(np.argmax(eps))
    return EpsilonLowerBound(
        epsilon=float(eps[best]),
        threshold=float(sel.candidates[best]),
        tpr=float(k_in[best] / n_in),
        fpr=float(k_out[best] / n_out),
        tpr_lower=float(tpr_lo[best]),
        fpr_upper=float(fpr_hi[best]),
        num_in=int(n_in),
        num_out=int(n_out),
        delta=delta,
        beta=beta,
        selection=sel.name,
    )


def epsilon_lower_bound(
    scores_in: jax.typing.ArrayLike,
    scores_out: jax.typing.ArrayLike,
    delta: float,
    *,
    beta: float = 0.05,
    threshold: Optional[float] = None,
    thresholds: Optional[Sequence[float]] = None,
    calibration_fraction: float = 0.5,
) -> EpsilonLowerBound:
    """A lower bound on ε at ``delta`` from attack scores, valid with confidence ``1 - beta``.

    The attack guesses "canary present" when a run's score is ``>= t``. Its
    true positive rate ``TPR = P(score >= t | D)`` and false positive rate
    ``FPR = P(score >= t | D')`` are bounded with one-sided Clopper-Pearson
    bounds, each at level ``beta / 2`` (Bonferroni over the two rates):
    ``TPR >= TPR_lb`` and ``FPR <= FPR_ub``. Then
    ``ε_lb = max(0, log((TPR_lb - δ) / FPR_ub), log((1 - FPR_ub - δ) / (1 - TPR_lb)))``
    (:func:`epsilon_from_rates`; ``TNR_lb = 1 - FPR_ub`` and
    ``FNR_ub = 1 - TPR_lb``, so two rate bounds serve both inequalities).

    The threshold is chosen in one of three ways:

    - ``threshold`` given: that threshold, fixed before seeing the scores; all
      scores are used for the bound (``selection="fixed"``).
    - ``thresholds`` given: each threshold of this list (fixed before seeing
      the scores) at level ``beta / (2 k)`` for ``k`` thresholds, the best
      one reported (Bonferroni over thresholds; ``selection="bonferroni"``).
    - neither (default): the first ``calibration_fraction`` of each score
      array (the runs in the order they were made) chooses the threshold that
      maximises this bound on them; the remaining runs, which the choice never
      saw, give the bound (``selection="split"``).

    :param scores_in: scores of independent runs on ``D`` (with the canary),
        in the order they were made; larger means "canary more likely".
    :param scores_out: scores of independent runs on the neighbour ``D'``.
    :param float delta: δ in [0, 1).
    :param float beta: error probability in (0, 1); confidence ``1 - beta``.
    :param float threshold: a fixed threshold (see above).
    :param thresholds: fixed thresholds for the Bonferroni mode.
    :param float calibration_fraction: share of runs used to choose the
        threshold in the split mode, in (0, 1).
    :return: :class:`EpsilonLowerBound`.

    **Formal guarantees.** Let ``M`` be (ε, δ)-DP for the pair ``(D, D')``
    (both directions, as for any symmetric neighbouring relation), let the
    scores be ``f(M(D))`` and ``f(M(D'))`` for a fixed function ``f``, all runs
    mutually independent, and let ``threshold``/``thresholds`` not depend on
    the scores. Then ``P[result.epsilon > ε] <= beta``, for every ``M``,
    ``f``, sample size and score distribution (ties and discrete scores
    included). Proof: for any fixed ``t``, (ε, δ)-DP gives
    ``TPR <= e^ε FPR + δ`` and ``TNR <= e^ε FNR + δ``; on the event
    ``TPR_lb <= TPR`` and ``FPR_ub >= FPR``, which fails with probability at
    most ``beta/2 + beta/2`` (Clopper-Pearson is exact), both logarithms are
    at most ε because :func:`epsilon_from_rates` is monotone. In the split
    mode the threshold is a function of the calibration runs only, which are
    independent of the evaluation runs, so the argument holds conditionally
    on it; in the Bonferroni mode a union bound over the ``k`` thresholds
    applies. Consequently, ``result.epsilon > ε_claimed`` refutes the claim
    "``M`` is (ε_claimed, δ)-DP" at significance level ``beta``. The bound
    says nothing about data sets, canaries or attacks other than those used.

    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> out = rng.normal(0.0, 1.0, 20000); inn = rng.normal(3.0, 1.0, 20000)
    >>> b = epsilon_lower_bound(inn, out, delta=1e-5)
    >>> 2.0 < b.epsilon < 16.6  # the exact ε(1e-5) of N(3, 1) vs N(0, 1) is 16.7
    True
    """
    delta = _delta(delta)
    beta = _validate.open_unit("beta", beta)
    scores_in, scores_out = _check_bound_scores(scores_in, scores_out, threshold, thresholds)
    sel = _select(scores_in, scores_out, delta, beta, threshold, thresholds, calibration_fraction)
    return _best_bound(sel, delta, beta)


def auc(scores_in: jax.typing.ArrayLike, scores_out: jax.typing.ArrayLike) -> float:
    """Area under the attack's ROC curve: ``P(s_in > s_out) + P(s_in = s_out) / 2``.

    The Mann-Whitney statistic over all pairs, computed from ranks in
    ``O(n log n)``. 0.5 means the attack is no better than guessing. This is a
    descriptive point estimate, not a privacy bound; compare it with
    :func:`dp_max_auc`.

    :param scores_in: scores of runs with the canary.
    :param scores_out: scores of runs without it.
    :return: AUC in [0, 1].
    """
    a = _scores("scores_in", scores_in)
    b = _scores("scores_out", scores_out)
    ranks = stats.rankdata(np.concatenate([a, b]))  # average ranks for ties
    r_in = float(np.sum(ranks[: a.shape[0]]))
    u = r_in - a.shape[0] * (a.shape[0] + 1) / 2.0
    return u / (a.shape[0] * b.shape[0])


def dp_max_auc(epsilon: float, delta: float) -> float:
    """The largest AUC any attack can reach against an (ε, δ)-DP mechanism.

    Every test of an (ε, δ)-DP mechanism has
    ``TPR <= min(1, e^ε FPR + δ, 1 - e^-ε (1 - δ - FPR))``; this is the area
    under that piecewise-linear, concave curve (exact).

    :param float epsilon: ε >= 0 (``inf`` gives 1).
    :param float delta: δ in [0, 1].
    :return: the maximal AUC, in [0.5, 1].

    >>> dp_max_auc(0.0, 0.0)
    0.5
    """
    eps = _validate.non_negative("epsilon", epsilon, finite=False)
    delta = _validate.number("delta", delta, low=0.0, high=1.0)
    if math.isinf(eps) or delta >= 1:
        return 1.0
    x1 = (1 - delta) / (1 + math.exp(eps))
    xs = np.array([0.0, x1, 1 - delta, 1.0])
    ys = np.minimum.reduce(
        [np.ones(4), math.exp(eps) * xs + delta, 1 - math.exp(-eps) * (1 - delta - xs)]
    )
    return float(np.sum((xs[1:] - xs[:-1]) * (ys[1:] + ys[:-1]) / 2))


def subsampled_gaussian_log_ratio(projections: jax.typing.ArrayLike, q: float, sigma: float) -> np.ndarray:
    """The log-likelihood-ratio attack score on every-step projections.

    For one step of the Poisson subsampled Gaussian mechanism (in units of C)
    the canary's presence turns ``N(0, σ²)`` into ``(1 - q) N(0, σ²) + q N(1, σ²)``;
    the optimal (Neyman-Pearson) score of T independent steps is
    ``sum_t log(1 - q + q exp((2 x_t - 1) / (2 σ²)))``.

    :param projections: ``x_t``, shape ``(runs, T)`` (from :func:`d3p.audit.dpsvi_projections`).
    :param float q: sampling probability in (0, 1].
    :param float sigma: the noise multiplier assumed by the attacker, ``> 0``.
    :return: scores, shape ``(runs,)``.

    >>> subsampled_gaussian_log_ratio([[0.5, 0.5]], q=1.0, sigma=1.0)
    array([0.])
    """
    q = _validate.probability("q", q)
    sigma = _validate.positive("sigma", sigma, finite=False)
    xs = np.asarray(projections, dtype=np.float64)
    if xs.ndim != 2:
        raise ValueError(f"Expected projections of shape (runs, T), got shape {xs.shape}.")
    log_ratio = (2.0 * xs - 1.0) / (2.0 * sigma**2)
    if q == 1.0:
        return np.sum(log_ratio, axis=1)
    return np.sum(np.logaddexp(math.log1p(-q), math.log(q) + log_ratio), axis=1)


def projection_scores(projections: np.ndarray, q: float, sigma: float) -> np.ndarray:
    """Every-step projections to scores: :func:`subsampled_gaussian_log_ratio`
    at ``sigma``, or, for ``sigma = 0`` (no noise: the ratio is undefined),
    the sum of the projections over the steps.

    :param projections: ``x_t``, shape ``(runs, T)``.
    :param float q: sampling probability in (0, 1].
    :param float sigma: the noise multiplier assumed by the attacker, ``>= 0``.
    :return: scores, shape ``(runs,)``.
    """
    if sigma == 0:
        return np.sum(projections, axis=1)
    return subsampled_gaussian_log_ratio(projections, q, sigma)
