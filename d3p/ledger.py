# SPDX-License-Identifier: Apache-2.0
"""One privacy ledger for everything a project releases from one data set.

A :class:`PrivacyLedger` records every release made from the data: each
:meth:`d3p.svi.DPSVI.run` (its σ, q, steps, sampler, relation and noise),
each twin's releases, and anything else that spends privacy (a ρ-zCDP
release, or an (ε, δ)-DP one). It answers "ε at δ so far" for all of them
together, refuses a release that would pass a budget set by the user, and is
saved to and loaded from JSON (with a checkpoint, see
:func:`d3p.svi.save_checkpoint`).

How the releases are composed (every figure is an upper bound; the
derivations are in the privacy guide, "One ledger across runs"):

* Steps of the subsampled Gaussian mechanism with the same accounting
  (sampler, relation, noise) are composed together, whatever their σ and q,
  by :func:`d3p.accounting.compose_epsilon`: for continuous noise one
  privacy-loss distribution of all phases (the Fourier accountant, or the
  accountant the ledger was made with).
* Releases known by their Rényi DP (discrete-Gaussian steps, zCDP
  releases) are composed by adding their Rényi divergences.
* Groups with different accountings are combined in two ways, of which the
  smaller ε is reported: adding the Rényi-DP curves of every group (each
  Gaussian group by its Rényi-DP bound), and adding the ε of each group at an
  equal share of δ (basic composition of (ε, δ)-DP mechanisms). Both are valid
  bounds, so their minimum is.
* (ε, δ)-DP releases add their ε and δ (basic composition).
* Poisson batches truncated at their padded size deviate from Poisson
  sampling with a probability η per run (see
  :func:`d3p.minibatch.poisson_overflow_delta`): with η the sum over runs,
  the ledger is (ε, δ)-DP where the composition gives ε at δ − (1 + e^ε) η.

All releases of one ledger are stated under one neighbouring relation (the
first release's, unless given): a release under another relation is refused.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Dict, List, NamedTuple, Optional, Tuple, Union

import numpy as np

from d3p import _validate, accounting
from d3p._accounting import _discrete, _rdp
from d3p._sampling import Relation, Sampler

__all__ = [
    "PrivacyLedger",
    "GaussianSteps",
    "ZCDPRelease",
    "EpsilonDeltaRelease",
    "BudgetExceededError",
    "key_fingerprint",
]

#: The ``format`` field of a saved ledger.
FORMAT = "d3p.privacy_ledger"
#: The version of the saved format; :meth:`PrivacyLedger.load` reads this version.
VERSION = 1

#: Fraction of δ set aside for the Poisson overflow term before composing.
_OVERFLOW_SHARE = 1e-3
#: Relative rounding tolerance of the budget check.
_BUDGET_RTOL = 1e-9


class BudgetExceededError(ValueError):
    """A release would pass the budget of a :class:`PrivacyLedger`; nothing was
    recorded (and, from :meth:`d3p.svi.DPSVI.run`, nothing was run)."""


class GaussianSteps(NamedTuple):
    """``num_steps`` steps of the subsampled Gaussian sum mechanism, e.g. one
    :meth:`d3p.svi.DPSVI.run` (accounted by
    :func:`d3p.accounting.accounting_for` of ``sampler``, ``relation`` and
    ``noise``)."""

    what: str
    """What was released (for the reader of the ledger)."""
    sigma: float
    """Noise multiplier σ."""
    q: float
    """Sampling probability per step."""
    num_steps: int
    """Number of steps T."""
    sampler: str
    """``"poisson"`` or ``"fixed_size"``."""
    relation: str
    """``"add_remove"`` or ``"substitute"``."""
    noise: str = "gaussian"
    """``"gaussian"`` or ``"discrete"``."""
    overflow: float = 0.0
    """η: probability that some batch of these steps overflowed its padded
    size (Poisson sampling), for the larger neighbour; adds (1 + e^ε) η to δ."""
    first_step: int = 0
    """Index of the first step in the run's stream of batch keys."""
    key: Optional[str] = None
    """:func:`key_fingerprint` of the batch key (None: unknown), so that a
    continued run cannot draw the same batches again."""


class ZCDPRelease(NamedTuple):
    """A ρ-zCDP release (e.g. a marginal twin's noisy tables and selections)."""

    what: str
    """What was released."""
    rho: float
    """ρ of the release."""
    relation: str
    """``"add_remove"`` or ``"substitute"``."""


class EpsilonDeltaRelease(NamedTuple):
    """An (ε, δ)-DP release known by nothing more (composed by adding ε and δ)."""

    what: str
    """What was released."""
    epsilon: float
    """Its ε."""
    delta: float
    """Its δ."""
    relation: str
    """``"add_remove"`` or ``"substitute"``."""


Release = Union[GaussianSteps, ZCDPRelease, EpsilonDeltaRelease]
_KINDS = {"gaussian_steps": GaussianSteps, "zcdp": ZCDPRelease, "epsilon_delta": EpsilonDeltaRelease}
_KIND_OF = {cls: kind for kind, cls in _KINDS.items()}


def key_fingerprint(rng_key) -> Optional[str]:
    """A SHA-256 fingerprint (hex, 16 bytes) of a PRNG key's bits, or None for
    a traced key. It identifies a key without revealing it; the ledger uses
    it to refuse a run that would draw the same batches as an earlier one."""
    import jax

    leaves = jax.tree.leaves(rng_key)
    digest = hashlib.sha256()
    for leaf in leaves:
        if isinstance(leaf, jax.core.Tracer):
            return None
        if jax.dtypes.issubdtype(getattr(leaf, "dtype", None), jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        array = np.asarray(jax.device_get(leaf))
        digest.update(str(array.dtype).encode() + str(array.shape).encode() + array.tobytes())
    return digest.hexdigest()[:32]


# ---------------------------------------------------------------------------
# validation of releases


def _what(value) -> str:
    if not isinstance(value, str):
        raise TypeError(f"Expected what to be a string describing the release, got what={value!r}.")
    return value


def _gaussian_steps(r: GaussianSteps) -> GaussianSteps:
    acc = accounting.accounting_for(r.sampler, r.relation, r.noise)
    steps = _validate.integer("num_steps", r.num_steps, minimum=0)
    first = _validate.integer("first_step", r.first_step, minimum=0)
    if r.key is not None and not isinstance(r.key, str):
        raise TypeError(f"Expected key to be a fingerprint string or None, got key={r.key!r}.")
    return GaussianSteps(
        _what(r.what), _validate.non_negative("sigma", r.sigma, finite=False), _validate.probability("q", r.q),
        steps, str(acc.sampler), str(acc.relation), acc.noise,
        _validate.number("overflow", r.overflow, low=0.0, high=1.0), first, r.key,
    )


def _checked(release) -> Release:
    """``release`` with validated, canonical fields."""
    if isinstance(release, GaussianSteps):
        return _gaussian_steps(release)
    if isinstance(release, ZCDPRelease):
        return ZCDPRelease(_what(release.what), _validate.non_negative("rho", release.rho, finite=False),
                           str(Relation(release.relation)))
    if isinstance(release, EpsilonDeltaRelease):
        return EpsilonDeltaRelease(
            _what(release.what), _validate.non_negative("epsilon", release.epsilon, finite=False),
            _validate.number("delta", release.delta, low=0.0, high=1.0), str(Relation(release.relation)))
    raise TypeError(
        f"Expected release to be a GaussianSteps, ZCDPRelease or EpsilonDeltaRelease, got {type(release).__name__}.")


# ---------------------------------------------------------------------------
# composition


def _group_key(r: GaussianSteps) -> Tuple[str, str, str]:
    return (r.sampler, r.relation, r.noise)


def _steps_rdp(key, phases, orders) -> np.ndarray:
    """Rényi DP of Gaussian steps with accounting ``key`` at integer ``orders``."""
    sampler, relation, noise = key
    total = np.zeros(orders.shape)
    for sigma, q, steps in phases:
        if steps == 0 or math.isinf(sigma):
            continue
        if sigma == 0:
            return np.full(orders.shape, math.inf)
        if noise == "discrete":
            step = _discrete.phase((sampler, relation), sigma, q, orders)
        else:
            acc = accounting.accounting_for(sampler, relation)
            step = _rdp.phase(acc.pair, sigma / acc.noise_divisor, q, orders)
        total = total + steps * step
    return total


def _rdp_orders(groups) -> np.ndarray:
    """Integer orders at which every group's Rényi DP is computed."""
    midpoint = any(acc_key[0] == Sampler.POISSON and acc_key[1] == Relation.SUBSTITUTE
                   and acc_key[2] == "gaussian" for acc_key in groups)
    return _rdp.ORDERS[Relation.SUBSTITUTE if midpoint else Relation.ADD_REMOVE]


def _compose(releases, delta: float, accountant: str) -> float:
    """ε at ``delta`` of ``releases`` (without the overflow term)."""
    approx = [r for r in releases if isinstance(r, EpsilonDeltaRelease)]
    eps_approx = sum(r.epsilon for r in approx)
    delta_rest = delta - sum(r.delta for r in approx)
    if not delta_rest > 0:
        return math.inf
    groups: Dict[tuple, list] = {}
    for r in releases:
        if isinstance(r, GaussianSteps) and r.num_steps > 0:
            groups.setdefault(_group_key(r), []).append((r.sigma, r.q, r.num_steps))
    rho = sum(r.rho for r in releases if isinstance(r, ZCDPRelease))
    parts = len(groups) + (rho > 0)
    if parts == 0:
        return eps_approx
    if math.isinf(rho):
        return math.inf
    # basic composition of each group at an equal share of δ
    share = delta_rest / parts
    split = eps_approx + (accounting.zcdp_epsilon(rho, share) if rho > 0 else 0.0)
    for (sampler, relation, noise), phases in groups.items():
        split += accounting.compose_epsilon(phases, share, sampler=sampler, relation=relation, noise=noise,
                                            accountant=accountant)
    if parts == 1:
        return split
    # the Rényi-DP curves of every group added
    orders = _rdp_orders(groups)
    curve = orders * rho
    for key, phases in groups.items():
        curve = curve + _steps_rdp(key, phases, orders)
    together = eps_approx + _rdp.epsilon_from_rdp(orders, curve, delta_rest)
    return min(split, together)


# ---------------------------------------------------------------------------
# the ledger


class PrivacyLedger:
    """The releases made from one data set, composed into one (ε, δ).

    :param str relation: the neighbouring relation of every release
        (``"add_remove"`` or ``"substitute"``); default: that of the first
        release recorded.
    :param float budget_epsilon: the total ε allowed (with ``budget_delta``);
        a release that would pass it is refused with
        :class:`BudgetExceededError`. Default: no budget.
    :param float budget_delta: the δ at which the budget's ε is measured.
    :param str accountant: the accountant of Gaussian steps (``"fourier"``,
        ``"rdp"`` or ``"pld"``, as :func:`d3p.accounting.compute_epsilon`).

    **Formal guarantees.**

    * If every release made from the data set is recorded, and each release
      is what its record says (the mechanism, σ, q, T, sampler, relation or
      ρ, or (ε, δ)), the releases together are (:meth:`epsilon` (δ), δ)-DP
      under :attr:`relation`, by adaptive composition (each release may
      depend on the outputs of those before it).
    * :meth:`record` refuses a release under another relation, a run whose
      batch keys overlap an earlier run's (same key fingerprint, overlapping
      step ranges: the batches would not be independent), and a release that
      would take :meth:`epsilon` at ``budget_delta`` above ``budget_epsilon``.
    * The composition is never optimistic: see the module docstring for
      which accountant composes what.

    >>> from d3p.ledger import PrivacyLedger
    >>> ledger = PrivacyLedger(budget_epsilon=2.0, budget_delta=1e-5)
    >>> _ = ledger.record_steps("first fit", sigma=2.0, q=0.01, num_steps=1000, sampler="poisson")
    >>> _ = ledger.record_steps("second fit", sigma=1.5, q=0.02, num_steps=200, sampler="poisson")
    >>> 0.5 < ledger.epsilon(1e-5) < 2.0
    True
    """

    def __init__(self, relation: Optional[str] = None, *, budget_epsilon: Optional[float] = None,
                 budget_delta: Optional[float] = None, accountant: str = "fourier"):
        self._relation = None if relation is None else Relation(relation)
        if (budget_epsilon is None) != (budget_delta is None):
            raise ValueError(
                f"Expected both budget_epsilon and budget_delta or neither, got budget_epsilon={budget_epsilon!r}, "
                f"budget_delta={budget_delta!r}.")
        self.budget_epsilon = (None if budget_epsilon is None
                               else _validate.non_negative("budget_epsilon", budget_epsilon, finite=False))
        self.budget_delta = None if budget_delta is None else _validate.open_unit("budget_delta", budget_delta)
        self.accountant = _validate.choice("accountant", accountant, accounting.ACCOUNTANTS)
        self._releases: List[Release] = []
        self._cache: dict = {}

    # ------------------------------------------------------------ contents

    @property
    def relation(self) -> Optional[Relation]:
        """The neighbouring relation of every release (None before the first)."""
        return self._relation

    @property
    def releases(self) -> Tuple[Release, ...]:
        """The recorded releases, in order."""
        return tuple(self._releases)

    def __len__(self) -> int:
        return len(self._releases)

    def steps_taken(self, key: Optional[str]) -> int:
        """The end of the last step range recorded with batch key fingerprint
        ``key`` (0 if none): where a continued run's steps start."""
        ends = [r.first_step + r.num_steps for r in self._releases
                if isinstance(r, GaussianSteps) and key is not None and r.key == key]
        return max(ends, default=0)

    # ------------------------------------------------------------ figures

    def epsilon(self, delta: float) -> float:
        """ε at ``delta`` of everything recorded (0 for an empty ledger).

        :param float delta: δ in (0, 1), the total δ, the Poisson overflow
            term included.
        """
        delta = _validate.open_unit("delta", delta)
        return self._epsilon(tuple(self._releases), delta)

    def _epsilon(self, releases: tuple, delta: float) -> float:
        cache_key = (releases, delta)
        if cache_key not in self._cache:
            self._cache[cache_key] = self._epsilon_uncached(releases, delta)
        return self._cache[cache_key]

    def _epsilon_uncached(self, releases: tuple, delta: float) -> float:
        eta = min(1.0, sum(r.overflow for r in releases if isinstance(r, GaussianSteps)))
        if eta == 0:
            return _compose(releases, delta, self.accountant)
        # δ = δ_composed + (1 + e^ε) η: try with a small share of δ set aside,
        # else with half of δ (ε at δ/2 bounds the ε that is then found)
        eps = _compose(releases, delta * (1 - _OVERFLOW_SHARE), self.accountant)
        if (1 + math.exp(min(eps, 700.0))) * eta <= delta * _OVERFLOW_SHARE:
            return eps
        eps_half = _compose(releases, delta / 2, self.accountant)
        rest = delta - (1 + math.exp(min(eps_half, 700.0))) * eta
        if not rest >= delta / 2:
            return math.inf
        return _compose(releases, rest, self.accountant)

    def check(self, *releases: Release) -> float:
        """The ε at ``budget_delta`` that recording ``releases`` would give,
        or :class:`BudgetExceededError` if it passes the budget (also for a
        release that :meth:`record` would refuse for another reason, that
        error). Records nothing. Without a budget, returns ``nan``.
        """
        checked = self._admissible(releases)
        if self.budget_epsilon is None:
            return math.nan
        eps = self._epsilon(tuple(self._releases) + tuple(checked), self.budget_delta)
        if eps > self.budget_epsilon * (1 + _BUDGET_RTOL):
            spent = self._epsilon(tuple(self._releases), self.budget_delta) if self._releases else 0.0
            names = ", ".join(repr(r.what) for r in checked)
            raise BudgetExceededError(
                f"Expected the release {names} to fit the ledger's budget of epsilon {self.budget_epsilon:g} at "
                f"delta {self.budget_delta:g}: the ledger has spent epsilon {spent:.4g}, and with the release "
                f"it would spend epsilon {eps:.4g}. Nothing was recorded.")
        return eps

    def _admissible(self, releases) -> list:
        """The releases validated, in one relation with the ledger, with no
        batch key reused."""
        checked = [_checked(r) for r in releases]
        relation = self._relation
        seen = [r for r in self._releases if isinstance(r, GaussianSteps) and r.key is not None]
        for r in checked:
            if relation is None:
                relation = Relation(r.relation)
            elif Relation(r.relation) != relation:
                raise ValueError(
                    f"Expected every release of the ledger under relation={str(relation)!r}, got the release "
                    f"{r.what!r} with relation={r.relation!r}: guarantees under different relations do not "
                    "compose into one.")
            if isinstance(r, GaussianSteps) and r.key is not None:
                for s in seen:
                    if s.key == r.key and r.first_step < s.first_step + s.num_steps \
                            and s.first_step < r.first_step + r.num_steps:
                        raise ValueError(
                            f"Expected the steps of {r.what!r} (first_step={r.first_step}, {r.num_steps} steps) "
                            f"not to reuse the batch keys of {s.what!r} (steps {s.first_step} to "
                            f"{s.first_step + s.num_steps - 1} with the same rng_key): its batches would not be "
                            "independent of the earlier ones, and its noise would be the same. Continue with start_step="
                            f"{self.steps_taken(r.key)}, or use a new rng_key.")
                seen.append(r)
        return checked

    def record(self, release: Release) -> Release:
        """Record ``release`` (after :meth:`check`; refused with
        :class:`BudgetExceededError` or ``ValueError`` as there). Returns the
        release as recorded (validated, names canonical)."""
        self.check(release)
        (checked,) = self._admissible([release])
        if self._relation is None:
            self._relation = Relation(checked.relation)
        self._releases.append(checked)
        return checked

    def record_steps(self, what: str, *, sigma: float, q: float, num_steps: int, sampler: str = "poisson",
                     relation: Optional[str] = None, noise: str = "gaussian", overflow: float = 0.0,
                     first_step: int = 0, key: Optional[str] = None) -> GaussianSteps:
        """Record steps of the subsampled Gaussian mechanism (:class:`GaussianSteps`);
        ``relation`` defaults to the ledger's, else the sampler's."""
        if relation is None and self._relation is not None and Sampler(sampler) == Sampler.POISSON:
            relation = self._relation
        acc = accounting.accounting_for(sampler, relation, noise)
        return self.record(GaussianSteps(what, sigma, q, num_steps, acc.sampler, acc.relation, acc.noise,
                                         overflow, first_step, key))

    def record_zcdp(self, what: str, rho: float, *, relation: str) -> ZCDPRelease:
        """Record a ρ-zCDP release (:class:`ZCDPRelease`)."""
        return self.record(ZCDPRelease(what, rho, relation))

    def record_epsilon_delta(self, what: str, epsilon: float, delta: float, *, relation: str) -> EpsilonDeltaRelease:
        """Record an (ε, δ)-DP release (:class:`EpsilonDeltaRelease`)."""
        return self.record(EpsilonDeltaRelease(what, epsilon, delta, relation))

    # ------------------------------------------------------------ text

    def summary(self, delta: Optional[float] = None) -> str:
        """A table of the releases and the total ε at ``delta`` (default: the
        budget's δ), for printing."""
        delta = self.budget_delta if delta is None else delta
        lines = [f"privacy ledger ({_validate.plural(len(self), 'release')}, relation {self._relation or 'not set'}):"]
        for i, r in enumerate(self._releases, 1):
            if isinstance(r, GaussianSteps):
                detail = (f"sigma={r.sigma:.4g} q={r.q:.4g} steps {r.first_step}..{r.first_step + r.num_steps - 1} "
                          f"({r.sampler}, {r.noise})")
            elif isinstance(r, ZCDPRelease):
                detail = f"rho={r.rho:.4g} (zCDP)"
            else:
                detail = f"epsilon={r.epsilon:.4g} delta={r.delta:.3g}"
            lines.append(f"  {i}. {r.what}: {detail}")
        if delta is not None:
            lines.append(f"  total: epsilon = {self.epsilon(delta):.4g} at delta = {delta:.3g}")
        if self.budget_epsilon is not None:
            lines.append(f"  budget: epsilon = {self.budget_epsilon:g} at delta = {self.budget_delta:g}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"PrivacyLedger(relation={self._relation!r}, releases={len(self)}, "
                f"budget_epsilon={self.budget_epsilon!r}, budget_delta={self.budget_delta!r}, "
                f"accountant={self.accountant!r})")

    # ------------------------------------------------------------ JSON

    def to_dict(self) -> dict:
        """The ledger as JSON-ready data (``format``, ``version``, settings, releases)."""
        releases = [release_to_dict(r) for r in self._releases]
        return {"format": FORMAT, "version": VERSION,
                "relation": None if self._relation is None else str(self._relation),
                "budget_epsilon": _encode(self.budget_epsilon), "budget_delta": self.budget_delta,
                "accountant": self.accountant, "releases": releases}

    @classmethod
    def from_dict(cls, data: dict) -> "PrivacyLedger":
        """The ledger of :meth:`to_dict`'s data (every release checked again)."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"Expected a privacy ledger (format {FORMAT!r}), got format="
                             f"{data.get('format') if isinstance(data, dict) else type(data).__name__!r}.")
        if data.get("version") != VERSION:
            raise ValueError(f"Expected a privacy ledger of version {VERSION}, got version={data.get('version')!r}.")
        ledger = cls(data.get("relation"), budget_epsilon=_decode(data.get("budget_epsilon")),
                     budget_delta=data.get("budget_delta"), accountant=data.get("accountant", "fourier"))
        for i, item in enumerate(data.get("releases", [])):
            ledger._add_recorded(release_from_dict(item, f"releases[{i}]"))
        return ledger

    def _add_recorded(self, release: Release) -> None:
        """Add a release made earlier (loaded as it was: the budget is not
        checked again; the relation and batch keys are)."""
        (checked,) = self._admissible([release])
        if self._relation is None:
            self._relation = Relation(checked.relation)
        self._releases.append(checked)

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write the ledger to ``path`` as JSON."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")

    @classmethod
    def load(cls, path: Union[str, os.PathLike]) -> "PrivacyLedger":
        """The ledger saved at ``path`` by :meth:`save`."""
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))


def release_to_dict(release: Release) -> dict:
    """A release as JSON-ready data (its ``kind`` and fields), as :meth:`PrivacyLedger.to_dict` writes it."""
    item = {"kind": _KIND_OF[type(release)]}
    item.update({k: _encode(v) for k, v in release._asdict().items()})
    return item


def release_from_dict(item: dict, name: str = "release") -> Release:
    """The release of :func:`release_to_dict`'s data (checked); ``name``: what errors call it."""
    kind = _KINDS.get(item.get("kind")) if isinstance(item, dict) else None
    if kind is None:
        raise ValueError(f"Expected {name} to have a kind in {sorted(_KINDS)}, got {item!r}.")
    return _checked(kind(**{k: _decode(item[k]) for k in kind._fields if k in item}))


def _encode(value):
    """JSON has no infinity: ``inf`` as the string ``"inf"``."""
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def _decode(value):
    if value in ("inf", "-inf"):
        return float(value)
    return value
