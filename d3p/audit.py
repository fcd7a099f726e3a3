# SPDX-License-Identifier: Apache-2.0
"""Empirical privacy auditing: statistically valid lower bounds on ε.

A differentially private implementation that is wrong usually trains *better*,
so nothing looks broken. An audit checks the privacy claim directly: it runs
the private mechanism many times on two neighbouring data sets, ``D`` (with a
*canary* record) and ``D'`` (without it, or with a mirrored canary), computes
an attack score from every run's released output, and turns the attacker's
success into a lower bound on ε that holds with confidence ``1 - beta``. If
that lower bound exceeds the ε the accountant claims, the implementation or
the accounting is wrong.

Two layers:

* **Statistics** (any mechanism): :func:`epsilon_lower_bound` turns attack
  scores into an ε lower bound (Clopper-Pearson bounds on the attack's true
  and false positive rates, threshold chosen on separate runs or Bonferroni
  over fixed thresholds); :func:`auc` is the area under the attack's ROC
  curve; :func:`clopper_pearson_bounds`, :func:`epsilon_from_rates` and
  :func:`dp_max_auc` are the building blocks.
* **Mechanisms of d3p** (a tiny logistic regression, vectorised over runs with
  ``vmap``): :func:`gaussian_step_scores` runs one private step built from
  :func:`d3p.gradients.clipped_grad_sum` and
  :func:`d3p.gradients.add_gaussian_noise`; :func:`dpsvi_scores` runs
  ``num_steps`` steps of :meth:`d3p.svi.DPSVI.update` under Poisson sampling.
  :func:`audit_gaussian_step` and :func:`audit_dpsvi` put both together with
  the accountant's ε (:func:`d3p.accounting.compute_epsilon`) into an
  :class:`AuditResult`.

Both mechanism functions look the package's functions up *when they trace*
(``d3p.gradients.add_gaussian_noise``, ``d3p.svi.DPSVI`` and what it
imports), and compile afresh on every call. A test can therefore break a
function on purpose (``monkeypatch``) and check that the audit notices.

**Threat model.** The attacker knows everything except the random bits of the
mechanism (privacy noise and, with subsampling, which records are in which
batch): the model, the clipping threshold C, the noise multiplier σ, q, the
number of steps T, the initial parameters, every record of ``D'`` and the
canary (which the attacker chose). What the attacker sees:

* :func:`gaussian_step_scores`: the noisy clipped gradient sum of one step
  (q = 1, T = 1) - the Gaussian mechanism, for which the accountant's ε is
  exact, so a good audit comes close to it.
* :func:`dpsvi_scores` with ``threat_model="every_step"``: the parameters
  after every step, hence every noisy gradient (what DP-SGD style accounting
  protects: all intermediate releases). The score is the log-likelihood ratio
  of the subsampled Gaussian mechanism, the most powerful test for one step.
* :func:`dpsvi_scores` with ``threat_model="final_params"``: only the final
  parameters (the accountant's ε is then loose; auditing it checks less).

The canary is an input record (a logistic regression example with a huge
feature value along the first axis), so that its per-record gradient is far
larger than C and is clipped to norm exactly C, pointing along ``-e_0``, at
every step: the learning rate is set so small that the parameters stay near
0 (the noisy gradients are still read exactly from the parameter changes).
The other records have zero first feature, so their gradients are
orthogonal to the canary's; the attack projects the released gradient on the
canary's direction.

**What an audit proves and what it does not.** A lower bound above the
claimed ε is a proof (at confidence ``1 - beta``) that the mechanism as run
is not (ε, δ)-DP: a bug. A lower bound below the claim proves nothing about
other data sets, models or attacks; it only fails to find a violation with
this canary and attack.

References: Jagielski, Ullman and Oprea (2020), "Auditing differentially
private machine learning: how private is private SGD?"; Nasr, Song, Thakurta,
Papernot and Carlini (2021), "Adversary instantiation: lower bounds for
differentially private machine learning".
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any, Callable, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import tqdm
from scipy import special, stats

import d3p.random
from d3p import accounting as _accounting

__all__ = [
    "EpsilonLowerBound",
    "AuditResult",
    "clopper_pearson_bounds",
    "epsilon_from_rates",
    "epsilon_lower_bound",
    "auc",
    "dp_max_auc",
    "gaussian_step_scores",
    "dpsvi_projections",
    "dpsvi_fixed_size_projections",
    "subsampled_gaussian_log_ratio",
    "dpsvi_scores",
    "audit_gaussian_step",
    "audit_dpsvi",
    "THREAT_MODELS",
    "add_audit_subparser",
    "register_audit",
    "main_audit",
    "main",
]

#: Threat models of :func:`dpsvi_scores`: which outputs the attacker sees.
THREAT_MODELS = ("every_step", "final_params")

_ADD_REMOVE = _accounting.ADD_REMOVE
_SUBSTITUTE = _accounting.SUBSTITUTE


# ---------------------------------------------------------------------------
# validation helpers
# ---------------------------------------------------------------------------


def _float(name: str, value, *, low=None, high=None, low_open=False, high_open=False) -> float:
    if isinstance(value, bool):
        raise TypeError(f"Expected {name} to be a number, got {name}={value!r}.")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"Expected {name} to be a number, got {name}={value!r}.") from None
    ok = not math.isnan(x)
    if ok and low is not None:
        ok = x > low if low_open else x >= low
    if ok and high is not None:
        ok = x < high if high_open else x <= high
    if not ok:
        lo = "" if low is None else ("(" if low_open else "[") + f"{low}, "
        hi = "" if high is None else f"{high}" + (")" if high_open else "]")
        raise ValueError(f"Expected {name} in {lo or '(-inf, '}{hi or 'inf)'}, got {name}={value!r}.")
    return x


def _int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"Expected {name} to be an integer >= {minimum}, got {name}={value!r}.")
    return int(value)


def _scores(name: str, values, minimum: int = 1) -> np.ndarray:
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"Expected {name} to be one-dimensional, got shape {x.shape}.")
    if x.shape[0] < minimum:
        raise ValueError(f"Expected at least {minimum} values in {name}, got {x.shape[0]}.")
    if np.any(np.isnan(x)):
        raise ValueError(f"Expected {name} without NaN, got {int(np.sum(np.isnan(x)))} NaN value(s).")
    return x


# ---------------------------------------------------------------------------
# statistics
# ---------------------------------------------------------------------------


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
    alpha = _float("alpha", alpha, low=0, high=1, low_open=True, high_open=True)
    k = np.asarray(successes)
    n = np.asarray(trials)
    if not (np.issubdtype(k.dtype, np.integer) or np.all(k == np.round(k))):
        raise ValueError(f"Expected integer successes, got {successes!r}.")
    if np.any(n < 1) or not (np.issubdtype(n.dtype, np.integer) or np.all(n == np.round(n))):
        raise ValueError(f"Expected integer trials >= 1, got trials={trials!r}.")
    if np.any(k < 0) or np.any(k > n):
        raise ValueError(f"Expected 0 <= successes <= trials, got successes={successes!r}, trials={trials!r}.")
    k, n = np.broadcast_arrays(k.astype(np.float64), n.astype(np.float64))
    with np.errstate(all="ignore"):
        lower = np.where(k > 0, stats.beta.ppf(alpha, np.maximum(k, 1), n - k + 1), 0.0)
        upper = np.where(k < n, stats.beta.ppf(1 - alpha, k + 1, np.maximum(n - k, 1)), 1.0)
    return lower, upper


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
    delta = _float("delta", delta, low=0, high=1, high_open=True)
    tpr = np.asarray(tpr, dtype=np.float64)
    fpr = np.asarray(fpr, dtype=np.float64)
    if np.any(~((tpr >= 0) & (tpr <= 1))):
        raise ValueError(f"Expected tpr in [0, 1], got tpr={tpr!r}.")
    if np.any(~((fpr >= 0) & (fpr <= 1))):
        raise ValueError(f"Expected fpr in [0, 1], got fpr={fpr!r}.")
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


def _calibration_size(n: int, calibration_fraction: float) -> int:
    """Number of leading runs (of ``n >= 2``) used for calibration in the split mode."""
    frac = _float("calibration_fraction", calibration_fraction, low=0, high=1, low_open=True, high_open=True)
    return min(max(int(round(frac * n)), 1), n - 1)


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
    delta = _float("delta", delta, low=0, high=1, high_open=True)
    beta = _float("beta", beta, low=0, high=1, low_open=True, high_open=True)
    if threshold is not None and thresholds is not None:
        raise ValueError(
            f"Expected at most one of threshold and thresholds, got threshold={threshold!r} "
            f"and thresholds={thresholds!r}."
        )
    split = threshold is None and thresholds is None
    scores_in = _scores("scores_in", scores_in, 2 if split else 1)
    scores_out = _scores("scores_out", scores_out, 2 if split else 1)
    alpha = beta / 2

    if threshold is not None:
        t = _float("threshold", threshold)
        candidates, selection = np.asarray([t]), "fixed"
        ev_in, ev_out = scores_in, scores_out
    elif thresholds is not None:
        candidates = np.asarray(thresholds, dtype=np.float64).reshape(-1)
        if candidates.shape[0] == 0 or np.any(np.isnan(candidates)):
            raise ValueError(f"Expected a non-empty list of thresholds without NaN, got thresholds={thresholds!r}.")
        alpha = beta / (2 * candidates.shape[0])
        selection = "bonferroni"
        ev_in, ev_out = scores_in, scores_out
    else:
        c_in = _calibration_size(scores_in.shape[0], calibration_fraction)
        c_out = _calibration_size(scores_out.shape[0], calibration_fraction)
        t = _choose_threshold(scores_in[:c_in], scores_out[:c_out], delta, alpha)
        candidates, selection = np.asarray([t]), "split"
        ev_in, ev_out = scores_in[c_in:], scores_out[c_out:]

    s_in, s_out = np.sort(ev_in), np.sort(ev_out)
    n_in, n_out = s_in.shape[0], s_out.shape[0]
    k_in = _counts_at(s_in, candidates)
    k_out = _counts_at(s_out, candidates)
    eps, tpr_lo, fpr_hi = _bound_from_counts(k_in, n_in, k_out, n_out, delta, alpha)
    best = int(np.argmax(eps))
    return EpsilonLowerBound(
        epsilon=float(eps[best]),
        threshold=float(candidates[best]),
        tpr=float(k_in[best] / n_in),
        fpr=float(k_out[best] / n_out),
        tpr_lower=float(tpr_lo[best]),
        fpr_upper=float(fpr_hi[best]),
        num_in=int(n_in),
        num_out=int(n_out),
        delta=delta,
        beta=beta,
        selection=selection,
    )


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
    eps = _float("epsilon", epsilon, low=0)
    delta = _float("delta", delta, low=0, high=1)
    if math.isinf(eps) or delta >= 1:
        return 1.0
    x1 = (1 - delta) / (1 + math.exp(eps))
    xs = np.array([0.0, x1, 1 - delta, 1.0])
    ys = np.minimum.reduce(
        [np.ones(4), math.exp(eps) * xs + delta, 1 - math.exp(-eps) * (1 - delta - xs)]
    )
    return float(np.sum((xs[1:] - xs[:-1]) * (ys[1:] + ys[:-1]) / 2))


# ---------------------------------------------------------------------------
# the audited mechanisms: a tiny logistic regression
# ---------------------------------------------------------------------------


def _other_records(num_other_records: int, dim: int):
    """Fixed public records whose first feature is 0 (orthogonal to the canary)."""
    rng = np.random.default_rng(20240601)
    x = np.zeros((num_other_records, dim), np.float32)
    x[:, 1:] = rng.normal(size=(num_other_records, dim - 1)) / math.sqrt(dim - 1)
    y = rng.integers(0, 2, num_other_records).astype(np.float32)
    return x, y


def _logistic_loss(params, record):
    """Negative log-likelihood of one logistic regression record ``(x, y)``."""
    x, y = record
    z = jnp.dot(x, params)
    return -(y * jax.nn.log_sigmoid(z) + (1 - y) * jax.nn.log_sigmoid(-z))


def _run_chunks(fn: Callable, num: int, chunk: int, progress_bar: bool, desc: str) -> np.ndarray:
    """``fn(start_indices)`` over ``range(num)`` in fixed-size chunks; returns the concatenation."""
    out = []
    starts = range(0, num, chunk)
    it = tqdm.tqdm(starts, desc=desc, disable=not progress_bar)
    for start in it:
        idx = jnp.arange(start, start + chunk, dtype=jnp.uint32)
        out.append(np.asarray(jax.device_get(fn(idx)), dtype=np.float64))
    return np.concatenate(out)[:num]


def _check_common(num_runs, dp_scale, clipping_threshold, num_other_records, dim, canary_norm, runs_per_chunk):
    num_runs = _int("num_runs", num_runs, 2)
    dp_scale = _float("dp_scale", dp_scale, low=0)
    if math.isinf(dp_scale):
        raise ValueError(f"Expected a finite dp_scale, got dp_scale={dp_scale}.")
    C = _float("clipping_threshold", clipping_threshold, low=0, low_open=True)
    if math.isinf(C):
        raise ValueError(f"Expected a finite clipping_threshold, got clipping_threshold={C}.")
    num_other_records = _int("num_other_records", num_other_records, 0)
    dim = _int("dim", dim, 2)
    canary_norm = _float("canary_norm", canary_norm, low=2, low_open=True)
    if math.isinf(canary_norm):
        raise ValueError(f"Expected a finite canary_norm, got canary_norm={canary_norm}.")
    runs_per_chunk = _int("runs_per_chunk", runs_per_chunk, 1)
    return num_runs, dp_scale, C, num_other_records, dim, canary_norm, runs_per_chunk


def gaussian_step_scores(
    rng_key: jax.Array,
    num_runs: int,
    *,
    dp_scale: float,
    clipping_threshold: float = 1.0,
    relation: str = _ADD_REMOVE,
    num_other_records: int = 7,
    dim: int = 3,
    canary_norm: float = 100.0,
    rng_suite=d3p.random,
    runs_per_chunk: int = 16384,
    progress_bar: bool = False,
) -> Tuple[np.ndarray, np.ndarray]:
    """Attack scores of one private gradient step (q = 1, T = 1), with and without the canary.

    Every run computes, at parameters 0 of a logistic regression with ``dim``
    weights, ``d3p.gradients.clipped_grad_sum`` over the records of the data
    set, then ``d3p.gradients.add_gaussian_noise`` (both looked up when the
    function is traced, so a monkeypatched version is what runs). ``D`` holds
    ``num_other_records`` fixed records (first feature 0) and the canary
    ``x = canary_norm * C * e_0, y = 1``, whose gradient ``-x / 2`` is clipped
    to ``-C e_0``. The neighbour ``D'``:

    - ``relation="add_remove"``: the canary removed (masked out);
    - ``relation="substitute"``: the canary replaced by its mirror (``y = 0``,
      gradient clipped to ``+C e_0``).

    The score is the released noisy sum projected on the canary's direction,
    in units of C: ``<noisy_sum, -e_0> / C``. For the correct mechanism it is
    ``N(1, σ²)`` with the canary and ``N(0, σ²)`` (add/remove) or
    ``N(-1, σ²)`` (substitute) without: exactly the Gaussian mechanism the
    accountant analyses (with q = 1, T = 1), ε tight.

    :param rng_key: a key of ``rng_suite``; run ``i`` uses ``fold_in(rng_key, i)``
        for its noise (the first ``num_runs`` runs use ``D``, the next ``D'``).
    :param int num_runs: runs per data set, ``>= 2``.
    :param float dp_scale: noise multiplier σ >= 0.
    :param float clipping_threshold: C > 0.
    :param str relation: ``"add_remove"`` or ``"substitute"``.
    :param int num_other_records: records besides the canary, ``>= 0``.
    :param int dim: number of weights, ``>= 2``.
    :param float canary_norm: the canary's feature in units of C, ``> 2``.
    :param rng_suite: the PRNG suite passed to ``add_gaussian_noise``.
    :param int runs_per_chunk: runs vectorised in one call (memory bound).
    :param bool progress_bar: show a tqdm bar over chunks.
    :return: ``(scores_in, scores_out)``, float64 arrays of ``num_runs`` each.
    """
    from d3p import gradients

    num_runs, sigma, C, n_other, dim, canary_norm, chunk = _check_common(
        num_runs, dp_scale, clipping_threshold, num_other_records, dim, canary_norm, runs_per_chunk
    )
    if relation not in (_ADD_REMOVE, _SUBSTITUTE):
        raise ValueError(f"Expected relation in {(_ADD_REMOVE, _SUBSTITUTE)}, got relation={relation!r}.")
    chunk = min(chunk, 2 * num_runs)
    xo, yo = _other_records(n_other, dim)
    canary_x = np.zeros((1, dim), np.float32)
    canary_x[0, 0] = canary_norm * C
    x = jnp.asarray(np.concatenate([xo, canary_x]))
    y_in = jnp.asarray(np.concatenate([yo, [1.0]]).astype(np.float32))
    y_sub = jnp.asarray(np.concatenate([yo, [0.0]]).astype(np.float32))
    slots = n_other + 1
    substitute = relation == _SUBSTITUTE

    def one_run(i):
        present = i < num_runs
        key = rng_suite.fold_in(rng_key, i)
        if substitute:
            y, mask = jnp.where(present, y_in, y_sub), jnp.ones((slots,), bool)
        else:
            y, mask = y_in, jnp.ones((slots,), bool).at[-1].set(present)
        summed = gradients.clipped_grad_sum(_logistic_loss, jnp.zeros((dim,), jnp.float32), (x, y), mask, C)
        noisy = gradients.add_gaussian_noise(summed.grad_sum, key, sigma, C, rng_suite)
        return -noisy[0] / C

    fn = jax.jit(jax.vmap(one_run))
    scores = _run_chunks(fn, 2 * num_runs, chunk, progress_bar, "audit: gaussian step")
    return scores[:num_runs], scores[num_runs:]


def _logistic_model(x, y, N):
    import numpyro
    import numpyro.distributions as dist

    w = numpyro.sample("w", dist.Normal(0.0, 10.0).expand([x.shape[-1]]).to_event(1))
    with numpyro.plate("data", N, subsample_size=x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)


def _delta_guide(x, y, N):
    import numpyro
    import numpyro.distributions as dist

    loc = numpyro.param("w_loc", jnp.zeros((x.shape[-1],), jnp.float32))
    numpyro.sample("w", dist.Delta(loc).to_event(1))


def _audited_svi(cls, lr: float, C: float, sigma: float, rng_suite, N: int):
    """The audited DPSVI: the logistic model, a point-mass guide, SGD(lr)."""
    import numpyro
    from numpyro.infer import Trace_ELBO

    return cls(_logistic_model, _delta_guide, numpyro.optim.SGD(lr), Trace_ELBO(),
               clipping_threshold=C, dp_scale=sigma, rng_suite=rng_suite, N=N)


def dpsvi_projections(
    rng_key: jax.Array,
    num_runs: int,
    *,
    dp_scale: float,
    q: float,
    num_steps: int,
    clipping_threshold: float = 1.0,
    threat_model: str = "every_step",
    num_other_records: int = 7,
    dim: int = 3,
    canary_norm: float = 100.0,
    sampler: str = "bernoulli",
    svi_class: Optional[type] = None,
    rng_suite=d3p.random,
    runs_per_chunk: int = 8192,
    progress_bar: bool = False,
) -> Tuple[np.ndarray, np.ndarray]:
    """What the attacker reads from ``num_steps`` steps of :meth:`d3p.svi.DPSVI.update`
    under Poisson sampling, with and without the canary.

    The model is a Bayesian logistic regression with ``dim`` weights
    (``plate("data", N, subsample_size=B)``, ``N = num_other_records + 1``),
    the guide a point mass (``Delta``) at a parameter initialised to 0, the
    optimizer SGD with a learning rate so small that the parameters stay near
    0 (so the canary's gradient stays clipped to exactly ``C`` along
    ``-e_0``). ``D`` holds ``num_other_records`` fixed records (first feature
    0) and the canary (see :func:`gaussian_step_scores`); ``D'`` is ``D``
    without the canary (add/remove relation). Every step includes each record
    of the data set independently with probability ``q`` (Poisson sampling;
    ``mask`` marks the included records) and calls ``update`` with
    ``expected_batch_size = q N``, as :meth:`DPSVI.run` does.

    :param rng_key: a key of ``rng_suite``; run ``i`` uses ``fold_in(rng_key, i)``
        (the first ``num_runs`` runs use ``D``, the next ``D'``).
    :param int num_runs: runs per data set, ``>= 2``.
    :param float dp_scale: noise multiplier σ >= 0.
    :param float q: sampling probability in (0, 1].
    :param int num_steps: T >= 1.
    :param float clipping_threshold: C > 0.
    :param str threat_model: ``"every_step"``: the parameters after every
        step are seen, from which the released noisy gradient sums are read
        exactly; returned is their projection on the canary's direction in
        units of C, ``x_t`` (for the correct mechanism
        ``x_t ~ N(b_t, σ²)`` with ``b_t = 1`` if the canary was sampled in step
        t, else 0), shape ``(num_runs, T)``. ``"final_params"``: only the final
        parameters are seen; returned is their first coordinate in the same
        units (``= sum_t x_t``), shape ``(num_runs,)``.
    :param int num_other_records: records besides the canary (``>= 1`` for
        ``sampler="poisson_sampler"``).
    :param int dim: number of weights, ``>= 2``.
    :param float canary_norm: the canary's feature in units of C, ``> 2``.
    :param str sampler: ``"bernoulli"`` (default: the mask is
        ``rng_suite.uniform < q`` per record, Poisson sampling by definition)
        or ``"poisson_sampler"`` (:class:`d3p.minibatch.PoissonSampler`, so that
        the package's sampler is audited too; slower to compile).
    :param type svi_class: :class:`d3p.svi.DPSVI` (default, looked up at call
        time) or a subclass.
    :param rng_suite: the PRNG suite for the DPSVI noise and the sampling.
    :param int runs_per_chunk: runs vectorised in one call.
    :param bool progress_bar: show a tqdm bar over chunks.
    :return: ``(projections_in, projections_out)``, float64 arrays.
    """
    from d3p import minibatch, svi as svi_module

    num_runs, sigma, C, n_other, dim, canary_norm, chunk = _check_common(
        num_runs, dp_scale, clipping_threshold, num_other_records, dim, canary_norm, runs_per_chunk
    )
    q = _float("q", q, low=0, high=1, low_open=True)
    T = _int("num_steps", num_steps, 1)
    if threat_model not in THREAT_MODELS:
        raise ValueError(f"Expected threat_model in {THREAT_MODELS}, got threat_model={threat_model!r}.")
    if sampler not in ("bernoulli", "poisson_sampler"):
        raise ValueError(f"Expected sampler in ('bernoulli', 'poisson_sampler'), got sampler={sampler!r}.")
    if sampler == "poisson_sampler" and n_other < 1:
        raise ValueError(
            f"Expected num_other_records >= 1 with sampler='poisson_sampler', got {n_other}."
        )
    cls = svi_module.DPSVI if svi_class is None else svi_class
    if not (isinstance(cls, type) and issubclass(cls, svi_module.DPSVI)):
        raise TypeError(f"Expected svi_class to be DPSVI or a subclass, got svi_class={svi_class!r}.")
    chunk = min(chunk, 2 * num_runs)

    N = n_other + 1
    expected = q * N
    factor = N / expected  # DPSVI's public normalisation (clip_unscaled_observations=True)
    # the parameters move by at most about lr * factor * C * (1 + sigma) * T in a run:
    # keep x_canary . w far below 1 so that the canary's gradient stays clipped to C
    lr = 1e-4 / (canary_norm * factor * (1.0 + sigma) * T * C * C)
    scale = lr * factor * C

    xo, yo = _other_records(n_other, dim)
    canary_x = np.zeros((1, dim), np.float32)
    canary_x[0, 0] = canary_norm * C
    x = jnp.asarray(np.concatenate([xo, canary_x]))
    y = jnp.asarray(np.concatenate([yo, [1.0]]).astype(np.float32))

    svi = _audited_svi(cls, lr, C, sigma, rng_suite, N)
    state0 = svi.init(rng_suite.fold_in(rng_key, 2**32 - 1), x, y)
    w_init = svi.get_params(state0)["w_loc"]
    if sampler == "poisson_sampler":
        sampler_in = minibatch.PoissonSampler(N, q, N)
        sampler_out = minibatch.PoissonSampler(n_other, q, n_other)

    def batch(key, present):
        if sampler == "bernoulli":
            mask = rng_suite.uniform(key, (N,)) < q
            return x, y, mask.at[-1].set(mask[-1] & present)
        key_in, key_out = rng_suite.split(key, 2)
        idx_in, m_in = sampler_in.sample(key_in, rng_suite)
        idx_out, m_out = sampler_out.sample(key_out, rng_suite)
        idx_out = jnp.concatenate([idx_out, jnp.array([N - 1], idx_out.dtype)])  # canary slot, padded
        m_out = jnp.concatenate([m_out, jnp.array([False])])
        idx = jnp.where(present, idx_in, idx_out)
        mask = jnp.where(present, m_in, m_out)
        return x[idx], y[idx], mask

    def one_run(i):
        present = i < num_runs
        run_key = rng_suite.fold_in(rng_key, i)
        state_key, batch_key = rng_suite.split(run_key, 2)
        state = svi_module.DPSVIState(state0.optim_state, None, state_key)

        def step(state, t):
            xb, yb, mask = batch(rng_suite.fold_in(batch_key, t), present)
            before = svi.get_params(state)["w_loc"][0]
            state, _ = svi.update(state, xb, yb, mask=mask, expected_batch_size=expected)
            after = svi.get_params(state)["w_loc"][0]
            return state, (after - before) / scale

        state, xs = jax.lax.scan(step, state, jnp.arange(T, dtype=jnp.uint32))
        if threat_model == "final_params":
            return (svi.get_params(state)["w_loc"][0] - w_init[0]) / scale
        return xs

    fn = jax.jit(jax.vmap(one_run))
    out = _run_chunks(fn, 2 * num_runs, chunk, progress_bar, "audit: DPSVI")
    return out[:num_runs], out[num_runs:]


def dpsvi_fixed_size_projections(
    rng_key: jax.Array,
    num_runs: int,
    *,
    dp_scale: float,
    batch_size: int,
    num_records: int,
    num_steps: int,
    clipping_threshold: float = 1.0,
    dim: int = 3,
    canary_norm: float = 100.0,
    svi_class: Optional[type] = None,
    rng_suite=d3p.random,
    runs_per_chunk: int = 4096,
    progress_bar: bool = False,
) -> Tuple[np.ndarray, np.ndarray]:
    """What the attacker reads from ``num_steps`` steps of
    :meth:`d3p.svi.DPSVI.update` with fixed-size batches
    (:class:`d3p.minibatch.FixedSizeSampler`), on the extreme pair of
    neighbouring data sets of the substitute relation.

    ``D``: ``num_records`` copies of a record whose clipped gradient is
    ``C`` along the canary direction (a logistic regression example with a
    huge first feature and label 1); ``D'``: the same, except that record 0
    has label 0, so that its clipped gradient is ``C`` in the opposite
    direction. Every batch of ``D`` sums to ``B C`` along that direction; a
    batch of ``D'`` sums to ``(B - 2) C`` when record 0 is sampled
    (probability ``q = B / N``), else to ``B C``. Model, guide and
    optimizer are those of :func:`dpsvi_projections`; every step draws its
    batch with the package's fixed-size sampler and calls ``update`` as
    :meth:`DPSVI.run` does.

    Returned, per run and step, is ``z_t = (B - x_t) / 2`` with ``x_t`` the
    released noisy sum's projection in units of C: for the correct mechanism
    ``z_t ~ N(0, (σ/2)²)`` under ``D`` and ``(1 - q) N(0, (σ/2)²) + q N(1,
    (σ/2)²)`` under ``D'``, the add/remove pair at noise multiplier σ/2 that
    :func:`d3p.accounting.accounting_for` composes for this sampler. The
    first array belongs to ``D'`` ("in"), the second to ``D`` ("out").

    :param rng_key: a key of ``rng_suite``; run ``i`` uses ``fold_in(rng_key, i)``.
    :param int num_runs: runs per data set, ``>= 2``.
    :param float dp_scale: noise multiplier σ >= 0.
    :param int batch_size: B, in ``[1, num_records]``.
    :param int num_records: N >= 2.
    :param int num_steps: T >= 1.
    :param float clipping_threshold: C > 0.
    :param int dim: number of weights, ``>= 2``.
    :param float canary_norm: the first feature in units of C, ``> 2``.
    :param type svi_class: :class:`d3p.svi.DPSVI` (default) or a subclass.
    :param rng_suite: the PRNG suite for the noise and the sampling.
    :param int runs_per_chunk: runs vectorised in one call.
    :param bool progress_bar: show a tqdm bar over chunks.
    :return: ``(z_in, z_out)``, float64 arrays of shape ``(num_runs, T)``.
    """
    from d3p import minibatch, svi as svi_module

    num_runs, sigma, C, _, dim, canary_norm, chunk = _check_common(
        num_runs, dp_scale, clipping_threshold, 0, dim, canary_norm, runs_per_chunk
    )
    N = _int("num_records", num_records, 2)
    B = _int("batch_size", batch_size, 1)
    if B > N:
        raise ValueError(f"Expected batch_size <= num_records={N}, got batch_size={B}.")
    T = _int("num_steps", num_steps, 1)
    cls = svi_module.DPSVI if svi_class is None else svi_class
    if not (isinstance(cls, type) and issubclass(cls, svi_module.DPSVI)):
        raise TypeError(f"Expected svi_class to be DPSVI or a subclass, got svi_class={svi_class!r}.")
    chunk = min(chunk, 2 * num_runs)

    factor = N / B  # DPSVI's public normalisation (clip_unscaled_observations=True)
    # keep x . w far below 1 over the run, so that every gradient stays clipped to C
    lr = 1e-4 / (canary_norm * factor * (B + sigma) * T * C * C)
    scale = lr * factor * C
    x = np.zeros((N, dim), np.float32)
    x[:, 0] = canary_norm * C
    x = jnp.asarray(x)
    y_d = jnp.ones((N,), jnp.float32)
    y_alt = y_d.at[0].set(0.0)
    svi = _audited_svi(cls, lr, C, sigma, rng_suite, N)
    state0 = svi.init(rng_suite.fold_in(rng_key, 2**32 - 1), x[:B], y_d[:B])
    sampler = minibatch.FixedSizeSampler(N, B)

    def one_run(i):
        neighbour = i < num_runs        # the first num_runs runs use D'
        y = jnp.where(neighbour, y_alt, y_d)
        run_key = rng_suite.fold_in(rng_key, i)
        state_key, batch_key = rng_suite.split(run_key, 2)
        state = svi_module.DPSVIState(state0.optim_state, None, state_key)

        def step(state, t):
            idx, _ = sampler.sample(rng_suite.fold_in(batch_key, t), rng_suite)
            before = svi.get_params(state)["w_loc"][0]
            state, _ = svi.update(state, x[idx], y[idx], expected_batch_size=B)
            after = svi.get_params(state)["w_loc"][0]
            return state, (B - (after - before) / scale) / 2

        return jax.lax.scan(step, state, jnp.arange(T, dtype=jnp.uint32))[1]

    fn = jax.jit(jax.vmap(one_run))
    out = _run_chunks(fn, 2 * num_runs, chunk, progress_bar, "audit: DPSVI, fixed-size batches")
    return out[:num_runs], out[num_runs:]


def subsampled_gaussian_log_ratio(projections: jax.typing.ArrayLike, q: float, sigma: float) -> np.ndarray:
    """The log-likelihood-ratio attack score on every-step projections.

    For one step of the Poisson subsampled Gaussian mechanism (in units of C)
    the canary's presence turns ``N(0, σ²)`` into ``(1 - q) N(0, σ²) + q N(1, σ²)``;
    the optimal (Neyman-Pearson) score of T independent steps is
    ``sum_t log(1 - q + q exp((2 x_t - 1) / (2 σ²)))``.

    :param projections: ``x_t``, shape ``(runs, T)`` (from :func:`dpsvi_projections`).
    :param float q: sampling probability in (0, 1].
    :param float sigma: the noise multiplier assumed by the attacker, ``> 0``.
    :return: scores, shape ``(runs,)``.
    """
    q = _float("q", q, low=0, high=1, low_open=True)
    sigma = _float("sigma", sigma, low=0, low_open=True)
    xs = np.asarray(projections, dtype=np.float64)
    if xs.ndim != 2:
        raise ValueError(f"Expected projections of shape (runs, T), got shape {xs.shape}.")
    log_ratio = (2.0 * xs - 1.0) / (2.0 * sigma**2)
    if q == 1.0:
        return np.sum(log_ratio, axis=1)
    return np.sum(np.logaddexp(math.log1p(-q), math.log(q) + log_ratio), axis=1)


def dpsvi_scores(
    rng_key: jax.Array,
    num_runs: int,
    *,
    dp_scale: float,
    q: float,
    num_steps: int,
    threat_model: str = "every_step",
    score_sigma: Optional[float] = None,
    **kwargs: Any,
) -> Tuple[np.ndarray, np.ndarray]:
    """Attack scores of ``num_steps`` DPSVI steps under Poisson sampling, with and without the canary.

    The set-up and the threat models are those of :func:`dpsvi_projections`.
    The score is

    - ``threat_model="every_step"``: :func:`subsampled_gaussian_log_ratio` of the
      projections with ``sigma = score_sigma`` (default: ``dp_scale``; if that
      is 0, the sum of the projections);
    - ``threat_model="final_params"``: the final parameter, rescaled.

    :param rng_key: a key of the PRNG suite.
    :param int num_runs: runs per data set.
    :param float dp_scale: σ.
    :param float q: sampling probability.
    :param int num_steps: T.
    :param str threat_model: ``"every_step"`` or ``"final_params"``.
    :param float score_sigma: σ assumed by the likelihood-ratio score.
    :param kwargs: further arguments of :func:`dpsvi_projections`.
    :return: ``(scores_in, scores_out)``, float64 arrays of ``num_runs`` each.
    """
    p_in, p_out = dpsvi_projections(
        rng_key, num_runs, dp_scale=dp_scale, q=q, num_steps=num_steps, threat_model=threat_model, **kwargs
    )
    if threat_model == "final_params":
        return p_in, p_out
    sigma = dp_scale if score_sigma is None else score_sigma
    if sigma == 0:
        return np.sum(p_in, axis=1), np.sum(p_out, axis=1)
    return subsampled_gaussian_log_ratio(p_in, q, sigma), subsampled_gaussian_log_ratio(p_out, q, sigma)


# ---------------------------------------------------------------------------
# audits: scores + bound + accountant
# ---------------------------------------------------------------------------


class AuditResult(NamedTuple):
    """The result of :func:`audit_gaussian_step` and :func:`audit_dpsvi`.

    - **epsilon_lower** - the empirical lower bound on ε at ``delta``
      (confidence ``1 - beta``).
    - **epsilon_accountant** - the ε the accountant claims for the audited
      setting (:func:`d3p.accounting.compute_epsilon`).
    - **delta**, **beta** - δ and the error probability.
    - **auc** - the attack's area under the ROC curve (descriptive).
    - **bound** - the full :class:`EpsilonLowerBound`.
    - **scores_in**, **scores_out** - the attack scores.
    - **setting** - a dict describing the audited mechanism and threat model.

    ``violation`` is True when ``epsilon_lower > epsilon_accountant``: at
    confidence ``1 - beta``, the mechanism does not satisfy the claim.
    """

    epsilon_lower: float
    epsilon_accountant: float
    delta: float
    beta: float
    auc: float
    bound: EpsilonLowerBound
    scores_in: np.ndarray
    scores_out: np.ndarray
    setting: dict

    @property
    def violation(self) -> bool:
        """True if the lower bound exceeds the accountant's ε."""
        return self.epsilon_lower > self.epsilon_accountant

    def summary(self) -> str:
        """A short human-readable report."""
        s = self.setting
        desc = ", ".join(f"{k}={v}" for k, v in s.items())
        verdict = (
            "VIOLATION: the lower bound exceeds the accountant's epsilon"
            if self.violation
            else "consistent: lower bound <= accountant's epsilon"
        )
        b = self.bound
        return (
            f"audit ({desc})\n"
            f"  runs per data set: {len(self.scores_in)} (evaluation: {b.num_in}/{b.num_out}, "
            f"threshold selection: {b.selection})\n"
            f"  epsilon_lower = {self.epsilon_lower:.3f}  (confidence {1 - self.beta:.3g}, "
            f"delta={self.delta:.3g})\n"
            f"  epsilon_accountant = {self.epsilon_accountant:.3f}\n"
            f"  attack: TPR={b.tpr:.4f} (>= {b.tpr_lower:.4f}), FPR={b.fpr:.4g} (<= {b.fpr_upper:.4g}), "
            f"AUC={self.auc:.4f} (max. for the claim: "
            f"{dp_max_auc(min(self.epsilon_accountant, 700.0), self.delta):.4f})\n"
            f"  {verdict}"
        )


def _result(scores_in, scores_out, delta, beta, eps_acc, setting, bound_kwargs) -> AuditResult:
    bound = epsilon_lower_bound(scores_in, scores_out, delta, beta=beta, **bound_kwargs)
    return AuditResult(
        epsilon_lower=bound.epsilon,
        epsilon_accountant=float(eps_acc),
        delta=bound.delta,
        beta=bound.beta,
        auc=auc(scores_in, scores_out),
        bound=bound,
        scores_in=scores_in,
        scores_out=scores_out,
        setting=setting,
    )


def audit_gaussian_step(
    rng_key: jax.Array,
    num_runs: int,
    *,
    dp_scale: float,
    clipping_threshold: float = 1.0,
    delta: float = 1e-5,
    beta: float = 0.05,
    relation: str = _ADD_REMOVE,
    accountant: str = "fourier",
    progress_bar: bool = False,
    **kwargs: Any,
) -> AuditResult:
    """Audit one private gradient step (the Gaussian mechanism, q = 1, T = 1).

    Scores from :func:`gaussian_step_scores`, bound from
    :func:`epsilon_lower_bound` (threshold chosen on half of the runs), the
    claim from :func:`d3p.accounting.compute_epsilon` ``(σ, 1, 1, δ,
    relation)``, which is exact for this mechanism.

    :param rng_key: a key of the PRNG suite.
    :param int num_runs: runs per data set.
    :param float dp_scale: σ.
    :param float clipping_threshold: C.
    :param float delta: δ.
    :param float beta: error probability of the lower bound.
    :param str relation: ``"add_remove"`` or ``"substitute"``.
    :param str accountant: accountant for the claim.
    :param bool progress_bar: show progress.
    :param kwargs: passed on to :func:`gaussian_step_scores` (``num_other_records``,
        ``dim``, ``canary_norm``, ``rng_suite``, ``runs_per_chunk``) or, for
        ``threshold``/``thresholds``/``calibration_fraction``, to
        :func:`epsilon_lower_bound`.
    :return: :class:`AuditResult`.

    **Formal guarantees.** As :func:`epsilon_lower_bound`: if the step is
    (ε, δ)-DP for the audited pair of data sets, ``epsilon_lower > ε`` with
    probability at most ``beta`` (over the mechanism's randomness, with ideal
    random bits).
    """
    from d3p import accounting

    bound_kwargs = {k: kwargs.pop(k) for k in ("threshold", "thresholds", "calibration_fraction") if k in kwargs}
    delta = _float("delta", delta, low=0, high=1, low_open=True, high_open=True)
    s_in, s_out = gaussian_step_scores(
        rng_key,
        num_runs,
        dp_scale=dp_scale,
        clipping_threshold=clipping_threshold,
        relation=relation,
        progress_bar=progress_bar,
        **kwargs,
    )
    eps_acc = accounting.compute_epsilon(dp_scale, 1.0, 1, delta, relation=relation, accountant=accountant)
    setting = dict(
        mechanism="gaussian_step",
        sigma=float(dp_scale),
        C=float(clipping_threshold),
        q=1.0,
        steps=1,
        relation=relation,
        threat_model="noisy_sum",
    )
    return _result(s_in, s_out, delta, beta, eps_acc, setting, bound_kwargs)


def audit_dpsvi(
    rng_key: jax.Array,
    num_runs: int,
    *,
    dp_scale: float,
    q: float,
    num_steps: int,
    clipping_threshold: float = 1.0,
    delta: float = 1e-5,
    beta: float = 0.05,
    threat_model: str = "every_step",
    score_sigma: Any = "estimate",
    accountant: str = "fourier",
    progress_bar: bool = False,
    sampling: str = "poisson",
    **kwargs: Any,
) -> AuditResult:
    """Audit ``num_steps`` steps of :meth:`d3p.svi.DPSVI.update` under Poisson
    sampling (add/remove) or with fixed-size batches (substitute).

    ``sampling="poisson"``: projections from :func:`dpsvi_projections` (the
    canary added or removed), the claim from
    :func:`d3p.accounting.compute_epsilon` for Poisson sampling under
    add/remove. ``sampling="fixed"``: projections from
    :func:`dpsvi_fixed_size_projections` (the extreme substitute pair: every
    record's gradient +C, one at -C; ``B = batch_size`` records, default 1,
    out of ``N = round(B / q)``), the claim for fixed-size batches under
    substitute. The bound comes from :func:`epsilon_lower_bound` (threshold
    chosen on the first half of the runs, by default).

    With ``threat_model="every_step"`` the score is
    :func:`subsampled_gaussian_log_ratio` with an attacker's σ. By default
    (``score_sigma="estimate"``, split mode) the attacker estimates it from the
    calibration runs without the canary (root mean square of their
    projections, which are pure noise), so that a mechanism whose noise is not
    what it claims is attacked with the right score; the evaluation runs are
    never used for it, so the guarantee below is unaffected. A number uses
    that σ; ``None`` uses ``dp_scale``. With a fixed ``threshold`` or
    ``thresholds`` there are no calibration runs and ``dp_scale`` is used.

    :param rng_key: a key of the PRNG suite.
    :param int num_runs: runs per data set.
    :param float dp_scale: σ.
    :param float q: sampling probability.
    :param int num_steps: T.
    :param float clipping_threshold: C.
    :param float delta: δ.
    :param float beta: error probability of the lower bound.
    :param str threat_model: ``"every_step"`` or ``"final_params"``.
    :param score_sigma: ``"estimate"``, a number > 0, or None (see above).
    :param str accountant: accountant for the claim.
    :param bool progress_bar: show progress.
    :param str sampling: ``"poisson"`` (default) or ``"fixed"``.
    :param kwargs: passed on to :func:`dpsvi_projections` (``num_other_records``,
        ``dim``, ``canary_norm``, ``sampler``, ``svi_class``, ``rng_suite``,
        ``runs_per_chunk``) or :func:`dpsvi_fixed_size_projections`
        (``batch_size``, ``dim``, ``canary_norm``, ``svi_class``,
        ``rng_suite``, ``runs_per_chunk``), or, for ``threshold``/``thresholds``/
        ``calibration_fraction``, to :func:`epsilon_lower_bound`.
    :return: :class:`AuditResult`.

    **Formal guarantees.** As :func:`epsilon_lower_bound`: if the T released
    steps are (ε, δ)-DP for the audited pair of data sets (add/remove the
    canary; or, with fixed-size batches, the substitute pair above, in the
    direction D' against D), ``epsilon_lower > ε`` with probability at most
    ``beta``. The score function and the threshold depend only on the
    calibration runs. At σ = 0.822, q = 0.01, T = 1000 and 5,000 runs per
    data set the fixed-size audit's bound exceeds 4, the ε that the
    midpoint (Poisson-substitute) pair would claim for fixed-size batches.
    """
    bound_kwargs = {k: kwargs.pop(k) for k in ("threshold", "thresholds", "calibration_fraction") if k in kwargs}
    delta = _float("delta", delta, low=0, high=1, low_open=True, high_open=True)
    if not (score_sigma is None or score_sigma == "estimate"):
        score_sigma = _float("score_sigma", score_sigma, low=0, low_open=True)
    if sampling not in ("poisson", "fixed"):
        raise ValueError(f"Expected sampling in ('poisson', 'fixed'), got sampling={sampling!r}.")
    acc = _accounting.accounting_for(sampling)   # "fixed" is an alias of "fixed_size"
    pair_sigma = float(dp_scale) / acc.noise_divisor   # σ of the pair the scores follow
    if sampling == "poisson":
        p_in, p_out = dpsvi_projections(
            rng_key,
            num_runs,
            dp_scale=dp_scale,
            q=q,
            num_steps=num_steps,
            clipping_threshold=clipping_threshold,
            threat_model=threat_model,
            progress_bar=progress_bar,
            **kwargs,
        )
    else:
        if threat_model != "every_step":
            raise ValueError(f"Expected threat_model='every_step' with sampling='fixed', got {threat_model!r}.")
        q = _float("q", q, low=0, high=1, low_open=True)
        batch_size = _int("batch_size", kwargs.pop("batch_size", 1), 1)
        num_records = max(int(round(batch_size / q)), batch_size, 2)
        q = batch_size / num_records
        p_in, p_out = dpsvi_fixed_size_projections(
            rng_key,
            num_runs,
            dp_scale=dp_scale,
            batch_size=batch_size,
            num_records=num_records,
            num_steps=num_steps,
            clipping_threshold=clipping_threshold,
            progress_bar=progress_bar,
            **kwargs,
        )
    if threat_model == "final_params":
        s_in, s_out, sigma_used = p_in, p_out, None
    else:
        split = "threshold" not in bound_kwargs and "thresholds" not in bound_kwargs
        if score_sigma == "estimate" and split:
            frac = bound_kwargs.get("calibration_fraction", 0.5)
            cal = p_out[: _calibration_size(p_out.shape[0], frac)]
            sigma_used = max(float(np.sqrt(np.mean(np.square(cal)))), 1e-6)
        elif score_sigma is None or score_sigma == "estimate":
            sigma_used = pair_sigma
        else:
            sigma_used = float(score_sigma)
        if sigma_used == 0:
            s_in, s_out = np.sum(p_in, axis=1), np.sum(p_out, axis=1)
        else:
            s_in = subsampled_gaussian_log_ratio(p_in, q, sigma_used)
            s_out = subsampled_gaussian_log_ratio(p_out, q, sigma_used)
    eps_acc = acc.epsilon(dp_scale, q, num_steps, delta, accountant=accountant)
    setting = dict(
        mechanism="dpsvi",
        sigma=float(dp_scale),
        C=float(clipping_threshold),
        q=float(q),
        steps=int(num_steps),
        sampling=sampling,
        relation=acc.relation,
        threat_model=threat_model,
    )
    if sigma_used is not None:
        setting["score_sigma"] = round(sigma_used, 4)
    return _result(s_in, s_out, delta, beta, eps_acc, setting, bound_kwargs)


# ---------------------------------------------------------------------------
# command line: `python -m d3p audit ...` (registered by d3p.__main__) or
# `python -m d3p.audit ...`
# ---------------------------------------------------------------------------


def add_audit_subparser(subparsers) -> argparse.ArgumentParser:
    """Register the ``audit`` command on an ``argparse`` subparsers object.

    Follows the convention of ``d3p/__main__.py``: the new parser sets the
    defaults ``func=main_audit`` (called as ``func(args, parser)``, returns the
    exit status) and ``command_parser`` (itself, for error messages). To hook
    it into ``python -m d3p``, append to ``d3p.__main__.COMMANDS`` a function
    that imports this module lazily (it imports JAX)::

        def register_audit(subparsers):
            from d3p.audit import add_audit_subparser
            return add_audit_subparser(subparsers)

    :param subparsers: the result of ``ArgumentParser.add_subparsers()``.
    :return: the ``audit`` parser.
    """
    p = subparsers.add_parser(
        "audit",
        help="empirical lower bound on epsilon for a small DP-VI model, next to the accountant's epsilon",
        description=(
            "Run a private mechanism of d3p many times with and without a canary record, "
            "attack it, and print a lower bound on epsilon valid with confidence 1-beta next to "
            "the epsilon the accountant claims. Exit status 1 if the bound exceeds the claim. "
            "Mechanism 'step': one noisy clipped gradient sum (q=1, T=1; the Gaussian "
            "mechanism, epsilon tight); 'dpsvi': --steps steps of DPSVI.update with Poisson "
            "sampling (add/remove) or, with --sampling fixed, fixed-size batches on the extreme "
            "substitute pair."
        ),
    )
    p.add_argument("--mechanism", choices=("step", "dpsvi"), default="step", help="what to audit (default: step)")
    p.add_argument("--sigma", type=float, default=1.0, help="noise multiplier sigma (default: 1.0)")
    p.add_argument("--clip", type=float, default=1.0, help="clipping threshold C (default: 1.0)")
    p.add_argument("--q", type=float, default=0.5, help="sampling probability, dpsvi only (default: 0.5)")
    p.add_argument("--steps", type=int, default=4, help="number of steps T, dpsvi only (default: 4)")
    p.add_argument("--sampling", choices=("poisson", "fixed"), default="poisson",
                   help="batch sampler, dpsvi only (default: poisson)")
    p.add_argument(
        "--relation",
        choices=(_ADD_REMOVE, _SUBSTITUTE),
        default=_ADD_REMOVE,
        help="neighbouring relation, step only (dpsvi: add_remove)",
    )
    p.add_argument(
        "--threat-model",
        choices=THREAT_MODELS,
        default="every_step",
        help="dpsvi only: the attacker sees every step or only the final parameters",
    )
    p.add_argument("--runs", type=int, default=100000, help="runs per data set (default: 100000)")
    p.add_argument("--delta", type=float, default=1e-5, help="delta (default: 1e-5)")
    p.add_argument("--beta", type=float, default=0.05, help="error probability; confidence 1-beta (default: 0.05)")
    p.add_argument("--accountant", choices=("fourier", "rdp", "pld"), default="fourier")
    p.add_argument("--seed", type=int, default=None, help="seed of the PRNG key (default: OS entropy)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=main_audit, command_parser=p)
    return p


#: Alias following the ``register_<name>`` convention of ``d3p/__main__.py``.
register_audit = add_audit_subparser


def main_audit(args: argparse.Namespace, parser: Optional[argparse.ArgumentParser] = None) -> int:
    """Run the ``audit`` command.

    :param args: the parsed arguments of the ``audit`` parser.
    :param parser: the ``audit`` parser; invalid values are reported through
        ``parser.error`` (exit status 2). Without it they raise ``ValueError``.
    :return: 0 if ``epsilon_lower <= epsilon_accountant``, 1 otherwise.
    """
    try:
        key = d3p.random.PRNGKey(args.seed)
        common = dict(
            dp_scale=args.sigma,
            clipping_threshold=args.clip,
            delta=args.delta,
            beta=args.beta,
            accountant=args.accountant,
            progress_bar=not args.no_progress,
        )
        if args.mechanism == "step":
            print(
                f"Auditing one noisy clipped gradient step (sigma={args.sigma}, C={args.clip}, "
                f"relation={args.relation}) with {args.runs} runs per data set ...",
                flush=True,
            )
            res = audit_gaussian_step(key, args.runs, relation=args.relation, **common)
        else:
            print(
                f"Auditing {args.steps} DPSVI steps (sigma={args.sigma}, C={args.clip}, q={args.q}, "
                f"{args.sampling} sampling, threat model {args.threat_model}) with {args.runs} runs "
                "per data set ...",
                flush=True,
            )
            res = audit_dpsvi(
                key, args.runs, q=args.q, num_steps=args.steps, threat_model=args.threat_model,
                sampling=args.sampling, **common
            )
    except (ValueError, TypeError) as e:
        if parser is None:
            raise
        parser.error(str(e))
    print(res.summary())
    print(f"{'epsilon_lower':>16} {'epsilon_accountant':>20}")
    print(f"{res.epsilon_lower:16.4f} {res.epsilon_accountant:20.4f}")
    return 1 if res.violation else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m d3p.audit [options]``: the ``audit`` command on its own.

    :param argv: arguments (default: ``sys.argv[1:]``); a leading ``audit`` is optional.
    :return: exit status, as :func:`main_audit`.
    """
    parser = argparse.ArgumentParser(prog="python -m d3p.audit")
    sub = parser.add_subparsers(dest="command")
    add_audit_subparser(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "audit":
        argv = ["audit"] + argv
    args = parser.parse_args(argv)
    return args.func(args, args.command_parser)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
