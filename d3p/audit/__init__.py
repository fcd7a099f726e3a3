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

Three layers, one module each, all re-exported here:

* **Statistics** (any mechanism; ``d3p.audit._stats``):
  :func:`epsilon_lower_bound` turns attack scores into an ε lower bound
  (Clopper-Pearson bounds on the attack's true and false positive rates,
  threshold chosen on separate runs or Bonferroni over fixed thresholds);
  :func:`auc` is the area under the attack's ROC curve;
  :func:`clopper_pearson_bounds`, :func:`epsilon_from_rates` and
  :func:`dp_max_auc` are the building blocks;
  :func:`subsampled_gaussian_log_ratio` is the every-step attack score.
* **Mechanisms of d3p** (``d3p.audit._mechanisms``; a tiny logistic
  regression, vectorised over runs with ``vmap``):
  :func:`gaussian_step_scores` runs one private step built from
  :func:`d3p.gradients.clipped_grad_sum` and
  :func:`d3p.gradients.add_gaussian_noise`; :func:`dpsvi_projections` and
  :func:`dpsvi_scores` run ``num_steps`` steps of :meth:`d3p.svi.DPSVI.update`
  under Poisson sampling, :func:`dpsvi_fixed_size_projections` with
  fixed-size batches.
* **Audits** (``d3p.audit._audits``): :func:`audit_gaussian_step` and
  :func:`audit_dpsvi` put both together with the accountant's ε
  (:func:`d3p.accounting.compute_epsilon`) into an :class:`AuditResult`.

The command line (``python -m d3p audit ...`` or ``python -m d3p.audit ...``)
lives in ``d3p.audit._cli``: :func:`add_audit_subparser`, :func:`main_audit`
and :func:`main`.

The mechanism functions look the package's functions up *when they trace*
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

from d3p.audit import _mechanisms
from d3p.audit._audits import AuditResult, audit_dpsvi, audit_gaussian_step
from d3p.audit._cli import add_audit_subparser, main, main_audit, register_audit
from d3p.audit._mechanisms import (
    dpsvi_fixed_size_projections,
    dpsvi_projections,
    dpsvi_scores,
    gaussian_step_scores,
)
from d3p.audit._stats import (
    EpsilonLowerBound,
    auc,
    clopper_pearson_bounds,
    dp_max_auc,
    epsilon_from_rates,
    epsilon_lower_bound,
    subsampled_gaussian_log_ratio,
)

#: Threat models of :func:`dpsvi_scores`: which outputs the attacker sees.
THREAT_MODELS = _mechanisms.THREAT_MODELS

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
