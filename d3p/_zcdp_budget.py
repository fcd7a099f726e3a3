# SPDX-License-Identifier: Apache-2.0
"""Zero-concentrated DP budgets of released statistics (counts, selections).

The twin's marginal family and private schema steps release tables of
counts and selections; their privacy is composed in ρ-zCDP
(:mod:`d3p._accounting._zcdp`) and converted to (ε, δ) once. These are the
public helpers, re-exported by :mod:`d3p.accounting` (import them from
there).
"""

import math

from d3p import _validate
from d3p._accounting import _zcdp
from d3p._sampling import Relation

def count_sensitivity(relation: str, norm: str = "l2") -> float:
    """The sensitivity of a table of counts (a histogram: every record adds one
    to exactly one cell) under a neighbouring relation.

    ===============  ==============  ==========
    relation         L2 (``"l2"``)   L1 (``"l1"``)
    ===============  ==============  ==========
    add/remove       1               1
    substitute       √2              2
    ===============  ==============  ==========

    Adding or removing a record changes one cell by one; substituting it
    moves one count from one cell to another (or changes nothing). A set of k
    such tables released together (e.g. all one-way marginals, each record
    in one cell of each) has √k times the L2 sensitivity.

    :param str relation: :data:`d3p.accounting.ADD_REMOVE` or :data:`d3p.accounting.SUBSTITUTE` (any spelling of :class:`Relation`).
    :param str norm: ``"l2"`` (default) or ``"l1"``.
    :return: the sensitivity.

    >>> from d3p.accounting import count_sensitivity
    >>> count_sensitivity("substitute", "l1")
    2.0
    """
    relation = Relation(relation)
    norm = _validate.choice("norm", norm, ("l1", "l2"))
    if relation == Relation.ADD_REMOVE:
        return 1.0
    return 2.0 if norm == "l1" else math.sqrt(2.0)


def gaussian_rho(sensitivity: float, std: float) -> float:
    """ρ (zero-concentrated DP) of the Gaussian mechanism: ``Δ² / (2 s²)``.

    :param float sensitivity: the L2 sensitivity Δ ≥ 0 of the released vector.
    :param float std: the noise standard deviation s ≥ 0 per coordinate (0: ``inf``).
    :return: ρ.

    **Formal guarantees.** Adding N(0, s²) to every coordinate of a vector
    whose L2 norm changes by at most Δ between neighbouring data sets is
    Δ²/(2s²)-zCDP under that relation (Bun & Steinke 2016, Prop. 1.6).

    >>> from d3p.accounting import gaussian_rho
    >>> gaussian_rho(1.0, 5.0)
    0.02
    """
    sensitivity = _validate.non_negative("sensitivity", sensitivity)
    std = _validate.non_negative("std", std)
    return _zcdp.gaussian_rho(sensitivity, std)


def exponential_rho(epsilon: float) -> float:
    """ρ (zero-concentrated DP) of an ε-DP exponential mechanism: ``ε² / 8``
    (:func:`d3p.selection.exponential_mechanism`).

    :param float epsilon: ε ≥ 0 of the selection (``inf``: no privacy).
    :return: ρ.

    **Formal guarantees.** The exponential mechanism with probabilities
    ∝ exp(ε u / (2Δu)) is ε-bounded range, and an ε-bounded-range mechanism
    is ε²/8-zCDP (Cesar & Rogers 2021, Lemma 3.2; Durfee & Rogers 2019).
    """
    epsilon = _validate.non_negative("epsilon", epsilon, finite=False)
    return _zcdp.exponential_rho(epsilon)


def zcdp_epsilon(rho: float, delta: float) -> float:
    """ε at ``delta`` of a ρ-zCDP mechanism.

    :param float rho: ρ ≥ 0 (``inf``: ``inf``).
    :param float delta: δ in (0, 1).
    :return: ε ≥ 0.

    **Formal guarantees.** ρ-zCDP is Rényi DP of every order α > 1 at αρ; the
    returned ε is the conversion of Canonne, Kamath & Steinke (2020, Prop. 12)
    at a numerically minimised α, evaluated at that α (an upper bound
    whatever the minimiser's accuracy). Checked against dp-accounting's RDP
    accountant (``ZCDpEvent``) in the tests.

    >>> from d3p.accounting import zcdp_epsilon
    >>> round(zcdp_epsilon(0.02, 1e-6), 4)
    0.8999
    """
    rho = _validate.non_negative("rho", rho, finite=False)
    delta = _validate.open_unit("delta", delta)
    return _zcdp.epsilon(rho, delta)


def zcdp_delta(rho: float, epsilon: float) -> float:
    """δ at ``epsilon`` of a ρ-zCDP mechanism (the same conversion as :func:`zcdp_epsilon`).

    :param float rho: ρ ≥ 0.
    :param float epsilon: ε ≥ 0.
    :return: δ in [0, 1].
    """
    rho = _validate.non_negative("rho", rho, finite=False)
    epsilon = _validate.non_negative("epsilon", epsilon)
    return _zcdp.delta(rho, epsilon)


def zcdp_rho(epsilon: float, delta: float) -> float:
    """The largest ρ whose :func:`zcdp_epsilon` at ``delta`` is at most ``epsilon``.

    :param float epsilon: target ε > 0 (``inf``: ``inf``).
    :param float delta: δ in (0, 1).
    :return: ρ (never with an ε above the target).

    >>> from d3p.accounting import zcdp_epsilon, zcdp_rho
    >>> rho = zcdp_rho(1.0, 1e-6)
    >>> 0.024 < rho < 0.025 and zcdp_epsilon(rho, 1e-6) <= 1.0
    True
    """
    epsilon = _validate.positive("epsilon", epsilon, finite=False)
    delta = _validate.open_unit("delta", delta)
    return _zcdp.largest_rho(epsilon, delta)


class ZCDPBudget:
    """A zCDP budget ρ spent by adaptively composed mechanisms, each recorded.

    ``spend(rho, what)`` records one mechanism and refuses to exceed the
    total; :attr:`ledger` lists what was spent on what; :meth:`epsilon` is the
    (ε, δ) guarantee of what has been spent so far.

    :param float rho: the total ρ ≥ 0 (``inf``: no privacy, nothing is refused).

    **Formal guarantees.** Adaptive composition of mechanisms that are
    ρ_i-zCDP (each chosen given the outputs of those before it, its ρ_i fixed
    in advance or chosen from those outputs) is Σρ_i-zCDP (Bun & Steinke
    2016, Lemma 2.3; for ρ_i chosen from earlier outputs, the Rényi filter of
    Feldman & Zrnic 2021 at every order), so as long as every release goes
    through :meth:`spend` the whole is ``total``-zCDP, and
    ``zcdp_epsilon(spent, δ)``-DP. The ρ of each release is the caller's
    claim (e.g. :func:`gaussian_rho` with the right sensitivity).

    >>> from d3p.accounting import ZCDPBudget, gaussian_rho
    >>> budget = ZCDPBudget(0.05)
    >>> budget.spend(gaussian_rho(1.0, 5.0), "one-way marginals")
    0.02
    >>> round(budget.remaining, 6)
    0.03
    """

    def __init__(self, rho: float):
        self.total = _validate.non_negative("rho", rho, finite=False)
        self.ledger: list = []

    @property
    def spent(self) -> float:
        """ρ spent so far."""
        return float(sum(r for _, r in self.ledger))

    @property
    def remaining(self) -> float:
        """ρ left."""
        return self.total - self.spent

    def spend(self, rho: float, what: str) -> float:
        """Record a release of ``rho`` (refused, with ``ValueError``, beyond the total
        by more than a relative 1e-9 of rounding).

        :param float rho: its ρ ≥ 0.
        :param str what: what it released (for the ledger).
        :return: ``rho``.
        """
        rho = _validate.non_negative("rho", rho, finite=False)
        if self.spent + rho > self.total * (1 + 1e-9):
            raise ValueError(
                f"Expected the release {what!r} to fit the zCDP budget: rho={rho:.6g} with "
                f"{self.spent:.6g} of {self.total:.6g} spent."
            )
        self.ledger.append((str(what), float(rho)))
        return rho

    def epsilon(self, delta: float) -> float:
        """ε at ``delta`` of what has been spent (:func:`zcdp_epsilon`)."""
        return zcdp_epsilon(self.spent, delta)
