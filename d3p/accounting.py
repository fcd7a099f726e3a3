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
composed (each row's proof or reference is in docs/privacy_accounting.md):

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
  Honkela (2020) as an upper bound: each step is replaced by a discrete pair
  that dominates it ("connect the dots", Doroshenko et al. 2022), composed
  by an exponentially tilted FFT (accurate down to δ = 1e-12 and below), the
  mass above the window bounded and added; the smaller of that and the
  ``"rdp"`` bound is returned. Derivation in docs/privacy_accounting.md.
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

import collections
import math
import numbers
from typing import Iterable, NamedTuple, Optional, Sequence, Union

from d3p import _sampling, _validate
from d3p._accounting import _discrete, _engine
from d3p._sampling import Relation, Sampler

__all__ = [
    "ADD_REMOVE",
    "SUBSTITUTE",
    "RELATIONS",
    "ACCOUNTANTS",
    "SAMPLER_RELATIONS",
    "SAMPLERS",
    "Relation",
    "Sampler",
    "Phase",
    "SamplerAccounting",
    "accounting_for",
    "relation_for_sampler",
    "normalize_relation",
    "compute_epsilon",
    "compute_delta",
    "compose_epsilon",
    "compose_delta",
    "clear_cache",
    "EpsilonTracker",
    "count_sensitivity",
    "gaussian_rho",
    "exponential_rho",
    "zcdp_epsilon",
    "zcdp_delta",
    "zcdp_rho",
    "ZCDPBudget",
]

#: Add/remove-one-record relation (:attr:`Relation.ADD_REMOVE`, equal to
#: ``"add_remove"``); goes with Poisson sampling.
ADD_REMOVE = Relation.ADD_REMOVE
#: Substitute-one-record (replace-one) relation (:attr:`Relation.SUBSTITUTE`,
#: equal to ``"substitute"``); goes with fixed-size sampling without
#: replacement (``subsample_batchify_data``).
SUBSTITUTE = Relation.SUBSTITUTE
#: The supported neighbouring relations.
RELATIONS = tuple(Relation)
#: The supported accountants.
ACCOUNTANTS = ("fourier", "rdp", "pld")

#: The noise mechanisms accounted: the continuous Gaussian (``"gaussian"``,
#: the default) and the discrete Gaussian of :mod:`d3p.discrete`
#: (``"discrete"``, accounted with its proven Rényi-DP bound whatever the
#: ``accountant``; see :func:`accounting_for`).
NOISE_MECHANISMS = ("gaussian", "discrete")

#: The batch samplers the accountants cover.
SAMPLERS = tuple(Sampler)

#: The default relation of each sampler (Poisson sampling also supports
#: :data:`SUBSTITUTE`; fixed-size sampling only :data:`SUBSTITUTE`).
SAMPLER_RELATIONS = {
    Sampler.POISSON: ADD_REMOVE,
    Sampler.FIXED_SIZE: SUBSTITUTE,
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
# validation (messages of d3p._validate)
# ---------------------------------------------------------------------------


def _steps(name: str, value, minimum: int = 0) -> int:
    """An integer >= ``minimum``; a float with an integral value (``100.0``)
    is accepted as that integer, as step counts computed as ``epochs / q``
    often are."""
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        if float(value).is_integer():
            value = int(value)
    return _validate.integer(name, value, minimum=minimum)


def _sigma(value, name: str = "sigma") -> float:
    """A noise multiplier: a number >= 0, ``inf`` allowed (no release)."""
    return _validate.non_negative(name, value, finite=False)


def _accountant(value) -> str:
    """One of :data:`ACCOUNTANTS`."""
    return _validate.choice("accountant", value, ACCOUNTANTS)


def _noise(value) -> str:
    """One of :data:`NOISE_MECHANISMS`."""
    return _validate.choice("noise", value, NOISE_MECHANISMS)


def normalize_relation(relation: str) -> Relation:
    """The :class:`Relation` of a neighbouring relation's name.

    Accepts the canonical names and the spellings ``"add-remove"``,
    ``"add/remove"``, ``"remove"``, ``"substitution"``, ``"replace"``,
    ``"replace_one"``, case-insensitively.

    :param str relation: name of the relation.
    :return: :data:`ADD_REMOVE` or :data:`SUBSTITUTE` (equal to
        ``"add_remove"`` and ``"substitute"``).
    :raises ValueError: for any other value.

    >>> from d3p.accounting import normalize_relation
    >>> normalize_relation("Add/Remove")
    'add_remove'
    """
    return Relation(relation)


def relation_for_sampler(sampler: str) -> Relation:
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

    :param str sampler: sampler name (see table; any spelling :class:`Sampler` accepts).
    :return: the relation.
    :raises ValueError: for an unknown sampler name.
    """
    return SAMPLER_RELATIONS[Sampler(sampler)]


class SamplerAccounting(NamedTuple):
    """How runs with one batch sampler are accounted under one relation.

    Built by :func:`accounting_for`, the one place that maps a sampler to
    the privacy-loss pair composed per step. ``pair`` names that pair:
    ``"add_remove"`` for N(0, s²) vs (1-q)N(0, s²) + qN(1, s²) (both
    directions), ``"substitute"`` for the midpoint pair (1-q)N(0, s²) +
    qN(1, s²) vs (1-q)N(0, s²) + qN(-1, s²), where s = σ / ``noise_divisor``.
    """

    sampler: Sampler
    """:attr:`Sampler.POISSON` or :attr:`Sampler.FIXED_SIZE`."""
    relation: Relation
    """:data:`ADD_REMOVE` or :data:`SUBSTITUTE`: the relation of the guarantee."""
    pair: Relation
    """The composed pair (see above)."""
    noise_divisor: float
    """σ of the pair = σ of the run / ``noise_divisor``."""
    noise: str = "gaussian"
    """The noise mechanism accounted (:data:`NOISE_MECHANISMS`)."""

    def engine_phases(self, phases: Sequence[Phase]) -> list:
        """The phases as the composed pair sees them (σ divided by ``noise_divisor``)."""
        return [Phase(p.sigma / self.noise_divisor, p.q, p.num_steps) for p in phases]

    def describe(self) -> str:
        """A one-line description, e.g. ``"fixed-size sampling without
        replacement, substitute relation"``."""
        names = {Sampler.POISSON: "Poisson sampling",
                 Sampler.FIXED_SIZE: "fixed-size sampling without replacement"}
        noise = ", discrete Gaussian noise" if self.noise == "discrete" else ""
        return f"{names[self.sampler]}, {self.relation.replace('_', '/')} relation{noise}"

    def epsilon(self, sigma: float, q: float, num_steps: int, delta: float,
                accountant: str = "fourier") -> float:
        """:func:`compute_epsilon` for this sampler and relation."""
        return compute_epsilon(sigma, q, num_steps, delta, relation=self.relation,
                               sampler=self.sampler, accountant=accountant, noise=self.noise)

    def delta(self, sigma: float, q: float, num_steps: int, epsilon: float,
              accountant: str = "fourier") -> float:
        """:func:`compute_delta` for this sampler and relation."""
        return compute_delta(sigma, q, num_steps, epsilon, relation=self.relation,
                             sampler=self.sampler, accountant=accountant, noise=self.noise)

    def tracker(self, sigma: float, q: float, delta: float, **kwargs) -> "EpsilonTracker":
        """An :class:`EpsilonTracker` for this sampler and relation."""
        return EpsilonTracker(sigma, q, delta, relation=self.relation, sampler=self.sampler, noise=self.noise,
                              **kwargs)

    def overflow_delta(self, num_records: int, q: float, max_batch_size: int,
                       num_steps: int, epsilon: float) -> float:
        """What a sampler's deviation from its accounted distribution adds to
        δ over ``num_steps`` steps: for Poisson sampling padded to
        ``max_batch_size``, the truncation of overflowing batches
        (:func:`d3p.minibatch.poisson_overflow_delta`); 0 for fixed-size
        batches, which are exactly what is accounted. ``inf`` ε gives 0 (no
        guarantee to add to)."""
        if self.sampler != Sampler.POISSON or not math.isfinite(epsilon):
            return 0.0
        return _sampling.overflow_delta(num_records, q, max_batch_size, num_steps, epsilon)


def accounting_for(sampler: Optional[str] = None, relation: Optional[str] = None,
                   noise: str = "gaussian") -> SamplerAccounting:
    """The accounting of runs whose batches come from ``sampler``, with the
    guarantee stated under ``relation``: the one mapping from samplers to
    composed privacy-loss pairs, used by every accountant, calibration,
    :meth:`d3p.svi.DPSVI.run`, twins and the command line.

    Defaults: neither given, Poisson sampling under add/remove; only
    ``sampler``, that sampler's relation in :data:`SAMPLER_RELATIONS`; only
    ``relation``: add/remove means Poisson sampling, substitute means
    fixed-size batches (the meaning of d3p's substitute-relation functions
    such as :func:`d3p.dputil.approximate_sigma`).

    :param str sampler: ``"poisson"`` or ``"fixed_size"`` (aliases
        ``"fixed"``, ``"subsample_batchify_data"``, ``"poisson_batchify_data"``).
    :param str relation: :data:`ADD_REMOVE` or :data:`SUBSTITUTE` (aliases as
        :func:`normalize_relation`).
    :param str noise: ``"gaussian"`` (default) or ``"discrete"``.
    :return: :class:`SamplerAccounting`.
    :raises ValueError: for unknown names or an unsupported combination.

    **Formal guarantees.** The pair dominates the sampled Gaussian sum
    mechanism (clipping threshold C, noise std σC) under the relation stated
    (proofs and references: ``docs/privacy_accounting.md``):

    * Poisson, add/remove: N(0, σ²) vs (1-q)N(0, σ²) + qN(1, σ²) in units of
      C, both directions.
    * Poisson, substitute: the midpoint pair (1-q)N(0, σ²) + qN(1, σ²) vs
      (1-q)N(0, σ²) + qN(-1, σ²).
    * Fixed size B without replacement, substitute: the add/remove pair with
      noise multiplier σ/2, both directions (the midpoint pair is optimistic).
    * Fixed size under add/remove is refused (B or q would change with N).
    * ``noise="discrete"`` (:mod:`d3p.discrete`): each step's Rényi DP is
      bounded by proven subsampling theorems (``d3p/_accounting/_discrete.py``),
      composed and converted to (ε, δ); no ``accountant`` is used.

    >>> from d3p.accounting import accounting_for
    >>> accounting_for("fixed_size").noise_divisor
    2.0
    >>> accounting_for().describe()
    'Poisson sampling, add/remove relation'
    """
    if sampler is None:
        if relation is None:
            sampler = Sampler.POISSON
        else:
            sampler = Sampler.FIXED_SIZE if Relation(relation) == SUBSTITUTE else Sampler.POISSON
    sampler = Sampler(sampler)
    relation = SAMPLER_RELATIONS[sampler] if relation is None else Relation(relation)
    noise = _noise(noise)
    if sampler == Sampler.POISSON:
        return SamplerAccounting(sampler, relation, relation, 1.0, noise)
    if relation != SUBSTITUTE:
        raise ValueError(
            f"Expected relation='substitute' for sampler='fixed_size', got relation={relation!r}: "
            "fixed-size batches are accounted under the substitute relation only; use "
            "sampler='poisson' for add/remove."
        )
    return SamplerAccounting(sampler, SUBSTITUTE, ADD_REMOVE, 2.0, noise)


#: The most entries the process-wide cache of accounted values holds.
CACHE_SIZE = 4096
_CACHE: "collections.OrderedDict[tuple, float]" = collections.OrderedDict()


def clear_cache() -> None:
    """Empty the process-wide cache of accounted values (see
    :func:`compute_epsilon`): the next question is computed afresh."""
    _CACHE.clear()


def _cached(figure: str, acc: SamplerAccounting, phases: Sequence[Phase], target: float, accountant: str,
            compute) -> float:
    """``compute()``, memoised per (figure, accounting, phases, target,
    accountant): every input that changes the value is part of the key
    (σ, q and T of every phase in order, δ or ε, sampler, relation, composed
    pair, noise divisor, noise mechanism, accountant); least recently used
    entries beyond :data:`CACHE_SIZE` are dropped."""
    key = (figure, tuple(acc), tuple((float(p.sigma), float(p.q), int(p.num_steps)) for p in phases),
           float(target), accountant)
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key]
    value = float(compute())
    _CACHE[key] = value
    while len(_CACHE) > CACHE_SIZE:
        _CACHE.popitem(last=False)
    return value


def _epsilon(acc: SamplerAccounting, phases: Sequence[Phase], delta: float, accountant: str) -> float:
    """ε of validated phases under ``acc`` (cached): the composed pair's
    engine, or the discrete mechanism's Rényi-DP bound."""
    def compute() -> float:
        if acc.noise == "discrete":
            return _discrete_engine("epsilon", acc, phases, delta)
        return _engine.epsilon(acc.pair, acc.engine_phases(phases), delta, accountant).value

    return _cached("epsilon", acc, phases, delta, accountant, compute)


def _delta(acc: SamplerAccounting, phases: Sequence[Phase], epsilon: float, accountant: str) -> float:
    """δ of validated phases under ``acc`` (cached; see :func:`_epsilon`)."""
    def compute() -> float:
        if acc.noise == "discrete":
            return _discrete_engine("delta", acc, phases, epsilon)
        return _engine.delta(acc.pair, acc.engine_phases(phases), epsilon, accountant)

    return _cached("delta", acc, phases, epsilon, accountant, compute)


def _discrete_engine(figure: str, acc: SamplerAccounting, phases: Sequence[Phase], target: float) -> float:
    """ε or δ of the discrete mechanism; nothing released, or σ = ∞, is free,
    and σ = 0 is the non-private query."""
    kind, active = _engine._trivial(phases)
    if kind == "zero":
        return 0.0
    if kind == "inf":
        return math.inf if figure == "epsilon" else _engine.delta(acc.pair, acc.engine_phases(phases), target,
                                                                  "rdp")
    fn = _discrete.epsilon if figure == "epsilon" else _discrete.delta
    return fn((acc.sampler, acc.relation), active, target)


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
            _sigma(sigma, f"phases[{i}].sigma"),
            _validate.probability(f"phases[{i}].q", q),
            _steps(f"phases[{i}].num_steps", steps),
        ))
    return out


def compose_epsilon(phases: Iterable[Union[Phase, tuple]], delta: float, *, relation: Optional[str] = None,
                    accountant: str = "fourier", sampler: Optional[str] = None, noise: str = "gaussian") -> float:
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
    acc = accounting_for(sampler, relation, noise)
    accountant = _accountant(accountant)
    delta = _validate.open_unit("delta", delta)
    phases = _check_phases(phases)
    return _epsilon(acc, phases, delta, accountant)


def compose_delta(phases: Iterable[Union[Phase, tuple]], epsilon: float, *, relation: Optional[str] = None,
                  accountant: str = "fourier", sampler: Optional[str] = None, noise: str = "gaussian") -> float:
    """δ at ``epsilon`` for a run made of phases with different settings.

    :param phases: sequence of ``(sigma, q, num_steps)``.
    :param float epsilon: ε ≥ 0.
    :param str relation: :data:`ADD_REMOVE` or :data:`SUBSTITUTE`.
    :param str accountant: ``"fourier"`` (default), ``"rdp"`` or ``"pld"``.
    :param str sampler: ``"poisson"`` or ``"fixed_size"`` (see :func:`accounting_for`).
    :return: δ in [0, 1].

    **Formal guarantees**: as :func:`compute_delta`, for the composition.
    """
    acc = accounting_for(sampler, relation, noise)
    accountant = _accountant(accountant)
    epsilon = _validate.non_negative("epsilon", epsilon)
    phases = _check_phases(phases)
    return _delta(acc, phases, epsilon, accountant)


def compute_epsilon(sigma: float, q: float, num_steps: int, delta: float, *, relation: Optional[str] = None,
                    accountant: str = "fourier", sampler: Optional[str] = None, noise: str = "gaussian") -> float:
    """ε at ``delta`` for ``num_steps`` steps of the subsampled Gaussian
    mechanism with noise multiplier ``sigma`` and sampling probability ``q``.

    :param float sigma: noise multiplier σ ≥ 0 (noise std / clipping threshold); 0 gives ``inf``.
    :param float q: sampling probability in (0, 1]; q = 1 means no subsampling.
    :param int num_steps: number of steps T ≥ 0 (T = 0 gives 0).
    :param float delta: δ in (0, 1); choose it well below 1/N.
    :param str relation: :data:`ADD_REMOVE` or :data:`SUBSTITUTE`.
    :param str accountant: ``"fourier"`` (default), ``"rdp"`` or ``"pld"`` (needs the optional
        ``dp-accounting`` package).
    :param str sampler: ``"poisson"`` or ``"fixed_size"``. ``sampler`` and ``relation`` are
        resolved by :func:`accounting_for`: neither given, Poisson under add/remove;
        ``relation=SUBSTITUTE`` alone means fixed-size batches without replacement, accounted
        with the add/remove pair at noise multiplier σ/2; ``sampler="poisson",
        relation=SUBSTITUTE`` uses the midpoint pair.
    :param str noise: ``"gaussian"`` (default) or ``"discrete"``, the discrete Gaussian
        mechanism of :mod:`d3p.discrete` (its Rényi-DP bound; ``accountant`` is not used).
    :return: ε ≥ 0.

    **Formal guarantees** (for the sampler and relation as resolved by :func:`accounting_for`,
    whose docstring gives each pair's proof; the mechanism releases every step's noisy sum,
    adaptive composition; "add/remove pair" and "midpoint pair" are the pairs composed):

    * ``"fourier"``: an upper bound at any grid, numerical error included: the one-step pair is
      replaced by a discrete pair whose privacy profile is the chord interpolation of the
      true (convex) one, hence dominates it for every ε; mass above the window is bounded
      by Chernoff's inequality and added to δ; FFT round-off is covered by an allowance
      of 10 times its textbook bound (an estimate, not interval arithmetic). The grid only
      sets how tight it is (within 1e-4 relative of much finer grids, and within 1% of
      dp-accounting's pessimistic PLD at δ = 1e-5 and, where that reference is reliable,
      at δ = 1e-12; the tests allow 2%). Never above the
      ``"rdp"`` bound, which is returned where the window holds no value. For the
      add/remove pair the remove direction is analysed, which dominates the add direction
      for the subsampled Gaussian (checked against dp-accounting called directly, which
      takes the maximum of both, in tests/test_accounting_reference.py).
    * ``"rdp"``: for the add/remove pair a rigorous upper bound (exact integer-order RDP); for
      the midpoint pair its RDP by quadrature, checked at two resolutions (orders where they
      disagree are dropped). Converted to (ε, δ) with Canonne, Kamath, Steinke (2020).
    * ``"pld"``: dp-accounting's pessimistic estimate.
    * q = 1 (all phases): exact closed form of the Gaussian mechanism with μ = Δ·sqrt(T)/σ
      (Δ = 1 for add/remove, 2 for substitute under either sampler), rounded up.
    * σ = 0 with T ≥ 1 gives ``inf``; T = 0 gives 0; σ = inf gives 0.
    * Cached: computed once per process for each (σ, q, T, δ, sampler, relation, noise,
      accountant) and looked up afterwards (:func:`clear_cache`).

    >>> from d3p.accounting import compute_epsilon, ADD_REMOVE
    >>> round(compute_epsilon(3.0, 0.1, 512, 1e-6, relation=ADD_REMOVE), 2)
    3.77
    """
    phase = Phase(_sigma(sigma), _validate.probability("q", q), _steps("num_steps", num_steps))
    acc = accounting_for(sampler, relation, noise)
    accountant = _accountant(accountant)
    delta = _validate.open_unit("delta", delta)
    return _epsilon(acc, [phase], delta, accountant)


def compute_delta(sigma: float, q: float, num_steps: int, epsilon: float, *, relation: Optional[str] = None,
                  accountant: str = "fourier", sampler: Optional[str] = None, noise: str = "gaussian") -> float:
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
    included, by the same construction as :func:`compute_epsilon` (the
    dominating discrete pair, tilted towards ε, plus the bound on the mass
    above the window), never more than the RDP bound; cached likewise. σ = 0
    gives 1 − (1 − q)^T, the probability that the record is used at all (its
    exact δ for a non-private query).
    """
    phase = Phase(_sigma(sigma), _validate.probability("q", q), _steps("num_steps", num_steps))
    acc = accounting_for(sampler, relation, noise)
    accountant = _accountant(accountant)
    epsilon = _validate.non_negative("epsilon", epsilon)
    return _delta(acc, [phase], epsilon, accountant)


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
    :param str noise: ``"gaussian"`` (default) or ``"discrete"`` (see :func:`compute_epsilon`).

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
        noise: str = "gaussian",
    ):
        self.sigma = _sigma(sigma)
        self.q = _validate.probability("q", q)
        self.delta = _validate.open_unit("delta", delta)
        self.accounting = accounting_for(sampler, relation, noise)
        self.noise = self.accounting.noise
        self.relation = self.accounting.relation
        self.sampler = self.accounting.sampler
        self.accountant = _accountant(accountant)
        self.num_steps = None if num_steps is None else _steps("num_steps", num_steps)
        self.growth = _validate.number("growth", growth, low=1.0, low_open=True)
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
                accountant=self.accountant, sampler=self.sampler, noise=self.noise,
            )
        return self._cache[t]

    def epsilon(self, num_steps_done: int) -> float:
        """Upper bound on ε after ``num_steps_done`` steps (cached, cheap).

        :param int num_steps_done: steps taken so far, ≥ 0.
        :return: ε at the next grid point ≥ ``num_steps_done``.
        """
        t = _steps("num_steps_done", num_steps_done)
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
                f"accountant={self.accountant!r}, noise={self.noise!r})")


# zero-concentrated DP budgets of released statistics (counts, selections):
# in d3p._zcdp_budget, re-exported here
from d3p._zcdp_budget import (  # noqa: E402,F401 (public, see __all__)
    ZCDPBudget,
    count_sensitivity,
    exponential_rho,
    gaussian_rho,
    zcdp_delta,
    zcdp_epsilon,
    zcdp_rho,
)
