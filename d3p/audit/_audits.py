# SPDX-License-Identifier: Apache-2.0
"""Audits: a mechanism's attack scores, their ε lower bound, and the
accountant's ε for the same setting, side by side in an :class:`AuditResult`.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple

import jax
import numpy as np

from d3p import _validate
from d3p import accounting as _accounting
from d3p.audit._mechanisms import (
    _RELATIONS,
    THREAT_MODELS,
    dpsvi_fixed_size_projections,
    dpsvi_projections,
    gaussian_step_scores,
)
from d3p.audit._stats import (
    EpsilonLowerBound,
    auc,
    calibration_size,
    dp_max_auc,
    epsilon_lower_bound,
    projection_scores,
)

__all__ = ["AuditResult", "audit_gaussian_step", "audit_dpsvi"]

#: Keyword arguments of an audit that go to :func:`epsilon_lower_bound`.
_BOUND_KWARGS = ("threshold", "thresholds", "calibration_fraction")

#: Batch samplers of :func:`audit_dpsvi`.
_SAMPLINGS = ("poisson", "fixed")


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


def _split_kwargs(kwargs: dict, delta) -> Tuple[dict, float]:
    """Removes the arguments of :func:`epsilon_lower_bound` from an audit's
    ``kwargs`` (returned separately) and checks δ in (0, 1)."""
    bound_kwargs = {k: kwargs.pop(k) for k in _BOUND_KWARGS if k in kwargs}
    return bound_kwargs, _validate.open_unit("delta", delta)


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
    relation: str = _accounting.ADD_REMOVE,
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
    bound_kwargs, delta = _split_kwargs(kwargs, delta)
    relation = _validate.choice("relation", relation, _RELATIONS)
    s_in, s_out = gaussian_step_scores(
        rng_key,
        num_runs,
        dp_scale=dp_scale,
        clipping_threshold=clipping_threshold,
        relation=relation,
        progress_bar=progress_bar,
        **kwargs,
    )
    eps_acc = _accounting.compute_epsilon(dp_scale, 1.0, 1, delta, relation=relation, accountant=accountant)
    setting = _setting("gaussian_step", dp_scale, clipping_threshold, 1.0, 1, relation, "noisy_sum")
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
    sampling: str = "poisson", noise: str = "gaussian",
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
    of ``N = round(B / q)``), the claim for fixed-size batches under
    substitute. The bound: :func:`epsilon_lower_bound` (by default with the
    threshold chosen on the first half of the runs).

    With ``threat_model="every_step"`` the score is
    :func:`subsampled_gaussian_log_ratio` with an attacker's σ. By default
    (``score_sigma="estimate"``, split mode) the attacker estimates it from the
    calibration runs without the canary (root mean square of their
    projections, pure noise), so a mechanism whose noise is not what it
    claims is attacked with the right score; the evaluation runs never enter
    it. A number uses that σ; ``None``, ``threshold`` or ``thresholds``
    (no calibration runs), the accounted pair's σ (``dp_scale``, halved
    with fixed-size batches).

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
    :param str noise: ``"gaussian"`` or ``"discrete"``: ``DPSVI(noise=...)`` and its accounting.
    :param kwargs: passed on to :func:`dpsvi_projections` (``num_other_records``, ``dim``,
        ``canary_norm``, ``sampler``, ``svi_class``, ``rng_suite``, ``runs_per_chunk``) or
        :func:`dpsvi_fixed_size_projections` (``batch_size``, ``dim``, ``canary_norm``,
        ``svi_class``, ``rng_suite``, ``runs_per_chunk``), or, for ``threshold``/
        ``thresholds``/``calibration_fraction``, to :func:`epsilon_lower_bound`.
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
    bound_kwargs, delta = _split_kwargs(kwargs, delta)
    score_sigma, sampling, threat_model = _check_dpsvi_choices(score_sigma, sampling, threat_model)
    acc = _dpsvi_accounting(sampling, noise, kwargs)
    kwargs.update(dp_scale=dp_scale, q=q, num_steps=num_steps, clipping_threshold=clipping_threshold)
    s_in, s_out, q, sigma_used = _dpsvi_audit_scores(rng_key, num_runs, sampling, threat_model, score_sigma,
                                                     bound_kwargs, acc, dict(kwargs, progress_bar=progress_bar))
    setting = _setting("dpsvi", dp_scale, clipping_threshold, q, num_steps, acc.relation, threat_model,
                       sampling=sampling, score_sigma=sigma_used)
    eps_acc = acc.epsilon(dp_scale, q, num_steps, delta, accountant=accountant)  # the claim audited
    return _result(s_in, s_out, delta, beta, eps_acc, setting, bound_kwargs)


def _dpsvi_accounting(sampling: str, noise: str, kwargs: dict):
    """The accounting of :func:`audit_dpsvi` (``"fixed"`` is an alias of
    ``"fixed_size"``); for discrete noise, ``kwargs["svi_class"]`` is set to a
    subclass that adds it."""
    acc = _accounting.accounting_for(sampling, noise=noise)
    if acc.noise == "discrete":
        kwargs["svi_class"] = _with_noise(kwargs.get("svi_class"), "discrete")
    return acc


def _with_noise(svi_class, noise: str) -> type:
    """A subclass of ``svi_class`` (default :class:`d3p.svi.DPSVI`) whose instances add ``noise``."""
    from d3p import svi as svi_module

    base = svi_module.DPSVI if svi_class is None else svi_class

    def __init__(self, *args, **kwargs):
        base.__init__(self, *args, noise=noise, **kwargs)

    return type(f"{base.__name__}With{noise.capitalize()}Noise", (base,), {"__init__": __init__})


def _check_dpsvi_choices(score_sigma, sampling: str, threat_model: str):
    """``score_sigma`` ("estimate", None or a number > 0), ``sampling`` and
    ``threat_model`` of :func:`audit_dpsvi`, checked."""
    if not (score_sigma is None or score_sigma == "estimate"):
        score_sigma = _validate.positive("score_sigma", score_sigma, finite=False)
    sampling = _validate.choice("sampling", sampling, _SAMPLINGS)
    threat_model = _validate.choice("threat_model", threat_model, THREAT_MODELS)
    return score_sigma, sampling, threat_model


def _setting(mechanism: str, dp_scale, clipping_threshold, q, num_steps, relation: str, threat_model: str,
             sampling: Optional[str] = None, score_sigma: Optional[float] = None) -> dict:
    """The audited setting of an :class:`AuditResult`, in the order its summary prints it."""
    setting = dict(mechanism=mechanism, sigma=float(dp_scale), C=float(clipping_threshold), q=float(q),
                   steps=int(num_steps))
    if sampling is not None:
        setting["sampling"] = sampling
    setting.update(relation=relation, threat_model=threat_model)
    if score_sigma is not None:
        setting["score_sigma"] = round(score_sigma, 4)
    return setting


def _dpsvi_audit_scores(rng_key, num_runs, sampling, threat_model, score_sigma, bound_kwargs, acc, kwargs):
    """The attack scores of :func:`audit_dpsvi`, the q of its claim and the
    σ of its every-step score (None for ``final_params``, whose score is the
    final parameter itself)."""
    p_in, p_out, q = _dpsvi_audit_projections(rng_key, num_runs, sampling, threat_model, kwargs)
    if threat_model == "final_params":
        return p_in, p_out, q, None
    pair_sigma = float(kwargs["dp_scale"]) / acc.noise_divisor  # σ of the pair the projections follow
    sigma_used = _attacker_sigma(p_out, score_sigma, bound_kwargs, pair_sigma)
    return projection_scores(p_in, q, sigma_used), projection_scores(p_out, q, sigma_used), q, sigma_used


def _dpsvi_audit_projections(rng_key, num_runs, sampling: str, threat_model: str, kwargs: dict):
    """The projections of :func:`audit_dpsvi` for its sampler, and the q that
    the scores and the claim use (for fixed-size batches ``B / N``, with
    ``N = round(B / q)``, at least ``B`` and 2)."""
    if sampling == "poisson":
        p_in, p_out = dpsvi_projections(rng_key, num_runs, threat_model=threat_model, **kwargs)
        return p_in, p_out, kwargs["q"]
    if threat_model != "every_step":
        raise ValueError(f"Expected threat_model='every_step' with sampling='fixed', got {threat_model!r}.")
    q = _validate.probability("q", kwargs.pop("q"))
    batch_size = _validate.integer("batch_size", kwargs.pop("batch_size", 1), minimum=1)
    num_records = max(int(round(batch_size / q)), batch_size, 2)
    p_in, p_out = dpsvi_fixed_size_projections(
        rng_key, num_runs, batch_size=batch_size, num_records=num_records, **kwargs
    )
    return p_in, p_out, batch_size / num_records


def _attacker_sigma(p_out: np.ndarray, score_sigma, bound_kwargs: dict, pair_sigma: float) -> float:
    """The σ of the every-step likelihood-ratio score (see :func:`audit_dpsvi`).

    ``"estimate"`` in the split mode: the root mean square of the calibration
    runs without the canary, which are pure noise (never the evaluation runs,
    which the bound needs unseen); ``"estimate"`` with fixed thresholds or
    None: the pair's σ; a number: that number.
    """
    split = "threshold" not in bound_kwargs and "thresholds" not in bound_kwargs
    if score_sigma == "estimate" and split:
        frac = bound_kwargs.get("calibration_fraction", 0.5)
        cal = p_out[: calibration_size(p_out.shape[0], frac)]
        return max(float(np.sqrt(np.mean(np.square(cal)))), 1e-6)
    if score_sigma is None or score_sigma == "estimate":
        return pair_sigma
    return float(score_sigma)
