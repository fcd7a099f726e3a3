"""The minibatch samplers: what they draw, their public settings, and their failure.

:class:`FixedSizeSampler`, :class:`PoissonSampler` (with the binomial batch
size drawn by inverse CDF and the overflow bounds :func:`poisson_max_batch_size`,
:func:`poisson_overflow_probability`, :func:`poisson_overflow_delta`) and
:class:`WithReplacementSampler`, built on the exact draws of
``d3p._uniform_draws``; a draw that reaches its loop's bound raises
:class:`SamplingError` or empties the batch (``_require``, ``_draw_checked``);
and the keyed Feistel permutation (:func:`feistel_permutation`) used for
non-private shuffling. The public names are documented and imported from
:mod:`d3p.minibatch`, whose documentation states the method and the
guarantees; the d3p 0.2 batchify interface built on these samplers is in
``d3p._batchify``.
"""

import math
import types
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Callable, Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_batching import custom_vmap
from jax.experimental import io_callback

import d3p.random
from d3p import _sampling, _validate
from d3p._uniform_draws import (LOOP_FAILURE_PROBABILITY, _SENTINEL, _distinct_uniform, _round_words,
                                _single_pass_draws, _uniform_indices)
from d3p.random._common import stream_words, suite_key

# The relations the samplers are analysed under, and the default overflow
# bound of Poisson batches (each documented where d3p.minibatch exports it).
SUBSTITUTE = _sampling.Relation.SUBSTITUTE
ADD_REMOVE = _sampling.Relation.ADD_REMOVE
DEFAULT_OVERFLOW_PROBABILITY = 1e-18

#: Largest supported data set size: indices are int32.
MAX_NUM_RECORDS = 2**31 - 1

#: Number of Feistel rounds used by :func:`split_batchify_data`.
DEFAULT_FEISTEL_ROUNDS = 8


class SamplingError(RuntimeError):
    """A sampler's loop reached its iteration bound without completing a batch.

    With a working random source this happens with probability at most
    :data:`LOOP_FAILURE_PROBABILITY` per batch; in practice it means that the
    PRNG suite is broken (e.g. returns constant words). The batch is not of the
    sampler's distribution and is never returned for use: a traced ``sample``
    returns an empty batch with out-of-range indices instead (see the module
    docstring), and :meth:`d3p.svi.DPSVI.run` traced as a whole fails at run
    time with a ``jax.errors.JaxRuntimeError`` carrying this error's message.
    """


# ----------------------------------------------------------------------------
# validation at the boundary


def _num_records(value, name: str = "num_records") -> int:
    """A data set size N in ``[1, MAX_NUM_RECORDS]`` (indices are int32)."""
    return _validate.integer(name, value, minimum=1, maximum=MAX_NUM_RECORDS)


# ----------------------------------------------------------------------------
# the binomial batch size


def poisson_overflow_probability(num_records: int, q: float, max_batch_size: int) -> float:
    """Probability that one Poisson batch has more than ``max_batch_size`` records.

    :param int num_records: number of records N.
    :param float q: sampling probability.
    :param int max_batch_size: padded batch size.
    :return: ``P(K > max_batch_size)`` for ``K ~ Binomial(N, q)`` (0 if
        ``max_batch_size >= N``). The sampler realises this probability up
        to about ``2**-64`` (see :class:`PoissonSampler`).
    """
    num_records = _num_records(num_records)
    q = _validate.probability("q", q)
    max_batch_size = _validate.integer("max_batch_size", max_batch_size, minimum=0)
    return _sampling.overflow_probability(num_records, q, max_batch_size)


def poisson_max_batch_size(
    num_records: int, q: float, overflow_probability: float = DEFAULT_OVERFLOW_PROBABILITY
) -> int:
    """Smallest padded batch size whose per-step overflow probability is at most the bound.

    :param int num_records: number of records N.
    :param float q: sampling probability.
    :param float overflow_probability: bound on ``P(K > max_batch_size)`` per
        step, ``K ~ Binomial(N, q)``; default :data:`DEFAULT_OVERFLOW_PROBABILITY`.
    :return: the smallest ``m`` in ``[1, N]`` with ``P(K > m) <= overflow_probability``.

    For ``q * N = 128`` the default gives about ``qN + 9 sqrt(qN(1-q))``.

    >>> poisson_max_batch_size(100, 0.5, 0.5)
    50
    """
    num_records = _num_records(num_records)
    q = _validate.probability("q", q)
    p = _validate.number("overflow_probability", overflow_probability, low=0.0, high=1.0, high_open=True)
    return max(_binomial_tail_size(num_records, q, p), 1)


def _binomial_tail_size(num_records: int, q: float, p: float) -> int:
    """The smallest ``m`` in ``[0, N]`` with ``P(K > m) <= p``, ``K ~ Binomial(N, q)``."""
    from scipy.stats import binom

    if p == 0.0 or q == 1.0:
        return num_records
    # binary search: P(K > m) is non-increasing in m (SciPy's isf is unreliable this far out)
    lo, hi = 0, num_records  # invariant: sf(hi) <= p, and sf(lo - 1) > p unless lo == 0
    while lo < hi:
        mid = (lo + hi) // 2
        if binom.sf(mid, num_records, q) <= p:
            hi = mid
        else:
            lo = mid + 1
    return lo


def poisson_overflow_delta(
    num_records: int, q: float, max_batch_size: int, num_steps: int, epsilon: float
) -> float:
    """The amount that truncating overflowing Poisson batches adds to δ over a run.

    :param int num_records: number of records N.
    :param float q: sampling probability.
    :param int max_batch_size: padded batch size.
    :param int num_steps: number of steps T.
    :param float epsilon: the ε of the (ε, δ) guarantee of the untruncated run.
    :return: ``(1 + exp(ε)) * T * P(K > max_batch_size)``, with the
        overflow probability taken for ``N + 1`` records (the larger of the two
        neighbours under add/remove). Add it to δ; see :class:`PoissonSampler`.
    """
    num_records = _num_records(num_records)
    q = _validate.probability("q", q)
    max_batch_size = _validate.integer("max_batch_size", max_batch_size, minimum=0)
    num_steps = _validate.integer("num_steps", num_steps, minimum=0)
    epsilon = _validate.non_negative("epsilon", epsilon, finite=False)
    return _sampling.overflow_delta(num_records, q, max_batch_size, num_steps, epsilon)


@lru_cache(maxsize=64)
def _binomial_thresholds(num_records: int, q: float, max_batch_size: int):
    """64-bit inverse-CDF thresholds for ``K ~ Binomial(N, q)``, ``k = 0..max_batch_size``.

    ``T_k ~= P(K <= k) * 2**64`` (rounded), computed from the CDF where it is
    at most 1/2 and from the survival function above, so that both tails have
    full relative precision. Returns (hi words, lo words, finite flags).
    """
    from scipy.stats import binom

    ks = np.arange(max_batch_size + 1)
    cdf = binom.cdf(ks, num_records, q)
    sf = binom.sf(ks, num_records, q)
    two64 = 2**64
    thresholds = []
    for c, s, k in zip(cdf, sf, ks):
        if k >= num_records:
            t = two64
        elif c <= 0.5:
            t = int(round(float(c) * 2.0**64))
        else:
            t = two64 - int(round(float(s) * 2.0**64))
        thresholds.append(min(max(t, 0), two64))
    thresholds = list(np.maximum.accumulate(np.array(thresholds, dtype=object)))
    finite = np.array([t < two64 for t in thresholds])
    hi = np.array([(t >> 32) & 0xFFFFFFFF if t < two64 else 0 for t in thresholds], dtype=np.uint32)
    lo = np.array([t & 0xFFFFFFFF if t < two64 else 0 for t in thresholds], dtype=np.uint32)
    return hi, lo, finite


def _binomial_count(
    words: jax.Array, num_records: int, q: float, max_batch_size: int, suppress: bool = False, table=None
) -> jax.Array:
    """``min(K, max_batch_size)`` for ``K ~ Binomial(N, q)`` by inverse CDF on 64 random bits
    (two random ``words``); with ``suppress``, 0 instead where ``K > max_batch_size``.
    ``table``: :func:`_binomial_thresholds` of ``(N, q, max_batch_size)`` given
    as arrays (arguments of a compiled program, which then serves every ``q``),
    else computed here as constants."""
    hi, lo, finite = _binomial_thresholds(num_records, q, max_batch_size) if table is None else table
    u_hi, u_lo = words[0].astype(jnp.uint32), words[1].astype(jnp.uint32)
    # K = number of k in 0..m with T_k <= u (T is non-decreasing), capped at m + 1:
    # the sum is m + 1 exactly when K > m (T_m is finite only if m < N)
    ge = finite & ((u_hi > hi) | ((u_hi == hi) & (u_lo >= lo)))
    uncapped = jnp.sum(ge.astype(jnp.int32), dtype=jnp.int32)
    if suppress:
        return jnp.where(uncapped > max_batch_size, jnp.int32(0), uncapped)
    return jnp.minimum(uncapped, max_batch_size)


# ----------------------------------------------------------------------------
# samplers


@dataclass(frozen=True)
class _FixedBatchSampler:
    """What the samplers of exactly ``batch_size`` records (always all real) share."""

    num_records: int
    batch_size: int

    def __post_init__(self):
        n = _num_records(self.num_records)
        object.__setattr__(self, "num_records", n)
        object.__setattr__(
            self, "batch_size", _validate.integer("batch_size", self.batch_size, minimum=1, maximum=n)
        )

    @property
    def q(self) -> float:
        """Sampling probability of each record, ``B / N``."""
        return self.batch_size / self.num_records

    @property
    def expected_batch_size(self) -> int:
        """B: the public constant to normalise a batch sum by."""
        return self.batch_size

    @property
    def max_batch_size(self) -> int:
        """Length of the index and mask arrays, B."""
        return self.batch_size

    def sample(self, rng_key, rng_suite: types.ModuleType = d3p.random) -> Tuple[jax.Array, jax.Array]:
        """Draw one batch.

        :param rng_key: a key of ``rng_suite`` (secret, fresh for every batch), or
            a JAX key, converted by :func:`d3p.random.as_key`.
        :param rng_suite: PRNG suite, :mod:`d3p.random` (default) or :mod:`d3p.random.debug`.
        :return: ``(indices int32[B], mask bool[B])``; the mask is all True.
        :raises SamplingError: if the random source is broken (called with
            concrete values; traced, the batch is returned empty, see the module docstring).
        """
        return _sample(self, rng_key, _validate.rng_suite("rng_suite", rng_suite))

    def _draw(self, rng_key, rng_suite, table=None):
        indices, ok = self._indices(rng_key, rng_suite)
        return indices, jnp.ones((self.batch_size,), bool), ok


@dataclass(frozen=True)
class FixedSizeSampler(_FixedBatchSampler):
    """Uniformly random batches of exactly ``batch_size`` distinct records.

    :param int num_records: number of records N (public), in ``[1, 2**31 - 1]``.
    :param int batch_size: batch size B (public), in ``[1, N]``.

    Attributes: ``relation`` (:data:`SUBSTITUTE`), ``q = B / N``,
    ``expected_batch_size = B`` (the constant to normalise by),
    ``max_batch_size = B`` (the output shape).

    **Formal guarantees.** For a key ``k``, ``sample(k)`` returns indices
    whose first ``j`` entries, for every ``j <= B``, are a uniformly random
    ordered sequence of ``j`` distinct records: every B-subset of
    ``{0, ..., N-1}`` has probability exactly ``1 / C(N, B)`` given ideal
    random bits (see the module docstring for the method), and batches drawn
    with different keys (``fold_in(key, i)`` for distinct ``i``) are
    independent. The mask is all True. This is sampling without replacement
    of fixed size, whose privacy amplification is analysed under the
    :data:`SUBSTITUTE` relation (neighbouring data sets have the same N and
    differ in one record) with the pair that dominates it, the add/remove
    subsampled Gaussian at noise multiplier σ/2 (see
    :func:`d3p.accounting.accounting_for`), e.g. by
    :func:`d3p.dputil.approximate_sigma`. Nothing about the data enters the
    sampler, only N and B.

    >>> import d3p.random
    >>> sampler = FixedSizeSampler(num_records=100, batch_size=5)
    >>> indices, mask = sampler.sample(d3p.random.PRNGKey(0))
    >>> indices.shape, bool(mask.all()), len(set(indices.tolist()))
    ((5,), True, 5)
    """

    #: The sampler's name for :func:`d3p.accounting.accounting_for`.
    name = "fixed_size"

    @property
    def relation(self) -> str:
        """:data:`SUBSTITUTE`."""
        return SUBSTITUTE

    def _indices(self, rng_key, rng_suite):
        return _distinct_uniform(rng_key, self.batch_size, self.num_records, rng_suite)


#: Settings of :class:`PoissonSampler`'s ``handle_oversized_batch``.
_OVERSIZED_BATCH_HANDLING = ("truncate", "suppress")


def _poisson_max_batch_size(value, num_records: int, q: float) -> int:
    """``max_batch_size`` of a Poisson sampler: None (the default size), an
    integer size in ``[1, N]``, or a float ``p`` in (0, 1), d3p 0.2's
    quantile form: the smallest ``m`` for which a batch has FEWER than ``m``
    records with probability at least ``p``, ``P(K < m) >= p`` for
    ``K ~ Binomial(N, q)`` -- one more than the ``p``-quantile of ``K``
    (capped at N). The overflow probability ``P(K > m)`` is then at most
    ``1 - p`` and is accounted in δ whatever ``m`` is
    (:func:`poisson_overflow_delta`)."""
    if value is None:
        return poisson_max_batch_size(num_records, q)
    try:
        return _validate.integer("max_batch_size", value, minimum=1, maximum=num_records)
    except _validate.InvalidArgumentType:
        pass  # not an integer: a quantile, or wrong
    try:
        quantile = _validate.open_unit("max_batch_size", value)
    except ValueError as err:
        raise type(err)(
            f"Expected max_batch_size to be an integer in [1, {num_records}] or a quantile in "
            f"(0, 1), got max_batch_size={value!r}."
        ) from None
    # P(K < m) >= p  <=>  P(K > m - 1) <= 1 - p: m - 1 is the p-quantile of K
    return min(num_records, _binomial_tail_size(num_records, q, 1.0 - quantile) + 1)


@dataclass(frozen=True)
class PoissonSampler:
    """Poisson sampling: every record independently with probability ``q``, padded with a mask.

    :param int num_records: number of records N (public).
    :param float q: sampling probability in (0, 1] (public).
    :param max_batch_size: length of the padded output: an integer in
        ``[1, N]``, or a float ``p`` in (0, 1) as in d3p 0.2: the smallest
        ``m`` with ``P(K < m) >= p`` for the batch size ``K ~ Binomial(N, q)``,
        i.e. one more than the ``p``-quantile of K, at most N (stored as that
        integer; e.g. 39 where the quantile is 38).
        Default :func:`poisson_max_batch_size` ``(N, q)``, the smallest size
        whose overflow probability per step is at most
        :data:`DEFAULT_OVERFLOW_PROBABILITY` (1e-18).
    :param str handle_oversized_batch: what a batch with more than
        ``max_batch_size`` records becomes: ``"truncate"`` (default),
        ``max_batch_size`` of its records chosen uniformly at random, or
        ``"suppress"``, an empty batch (mask all False).

    Attributes: ``relation`` (:data:`ADD_REMOVE`, the default; the
    substitute relation is accounted too, see
    :func:`d3p.accounting.accounting_for`), ``q``,
    ``expected_batch_size = q * N`` (the public constant to normalise by,
    never the realised count), ``max_batch_size``, ``overflow_probability``.

    **Method.** The number of records ``K ~ Binomial(N, q)`` is drawn by
    inverse CDF: 64 random bits ``u`` are compared with a table
    ``T_k = round(P(K <= k) * 2**64)``, ``k = 0..max_batch_size``, computed on
    the host with SciPy from the public N and q (both tails in full relative
    precision). Then ``K`` records are the first ``K`` entries of a uniformly
    random sequence of ``max_batch_size`` distinct indices (as in
    :class:`FixedSizeSampler`), and ``mask[j] = j < K``. Given K, the included
    set is a uniform K-subset, so every record is included independently with
    probability q; no index is favoured. Cost ``O(max_batch_size log
    max_batch_size)``, independent of N.

    **Formal guarantees.** If ``K <= max_batch_size``, the set ``{indices[j] :
    mask[j]}`` has exactly the distribution of Poisson sampling: each record
    independently with probability ``q`` (up to the precision of the table:
    each ``P(K = k)`` is realised with absolute error below ``2**-63`` plus
    the float64 error of SciPy's binomial CDF, about 1e-15 relative). Padded
    positions (``mask == False``) hold valid indices of other records, so
    gathering never goes out of range; their values must be ignored, and
    DPSVI gives them exactly zero weight. ``K = 0`` (an empty batch) returns an
    all-False mask. Poisson sampling is analysed under the :data:`ADD_REMOVE`
    relation (neighbouring data sets differ by one added or removed record),
    e.g. by :func:`d3p.dputil.approximate_sigma_remove_relation`; N is treated
    as public, as in the normalisation by ``q * N``.

    *Overflow.* If ``K > max_batch_size`` (probability
    ``p = poisson_overflow_probability(N, q, max_batch_size)`` per step), the
    batch is, with ``handle_oversized_batch="truncate"``, truncated to
    ``max_batch_size`` records chosen uniformly at random among the ``K`` (the
    mask is all True), and with ``"suppress"`` replaced by an empty batch (the
    mask is all False; the step adds noise only). Either way this is the only
    deviation from Poisson sampling, and it is bounded as follows: run the
    real (truncating or suppressing) mechanism ``M'`` and the ideal Poisson
    mechanism ``M`` on the same random bits; their outputs differ only if some
    step overflows, which has probability at most ``eta = T * p`` whatever the
    data. If ``M`` is (ε, δ)-DP, then for neighbours D, D' and any event S,
    ``P[M'(D) in S] <= P[M(D) in S] + eta <= e^ε P[M(D') in S] + δ + eta <=
    e^ε P[M'(D') in S] + δ + (1 + e^ε) eta``, so ``M'`` is
    ``(ε, δ + (1 + e^ε) T p)``-DP (with p evaluated at the larger N of the
    two neighbours, see :func:`poisson_overflow_delta`), for both settings.
    With the default bound ``p <= 1e-18`` this is below 1e-8 for
    ``T <= 1e6`` and ``ε <= 9``.

    >>> import d3p.random
    >>> sampler = PoissonSampler(num_records=1000, q=0.01)
    >>> indices, mask = sampler.sample(d3p.random.PRNGKey(0))
    >>> indices.shape == mask.shape == (sampler.max_batch_size,)
    True
    """

    num_records: int
    q: float
    max_batch_size: Optional[Union[int, float]] = None
    handle_oversized_batch: str = "truncate"

    #: The sampler's name for :func:`d3p.accounting.accounting_for`.
    name = "poisson"

    def __post_init__(self):
        n = _num_records(self.num_records)
        q = _validate.probability("q", self.q)
        handling = _validate.choice(
            "handle_oversized_batch", self.handle_oversized_batch, _OVERSIZED_BATCH_HANDLING
        )
        object.__setattr__(self, "num_records", n)
        object.__setattr__(self, "q", q)
        object.__setattr__(self, "max_batch_size", _poisson_max_batch_size(self.max_batch_size, n, q))
        object.__setattr__(self, "handle_oversized_batch", handling)

    @property
    def relation(self) -> str:
        """:data:`ADD_REMOVE`."""
        return ADD_REMOVE

    @property
    def expected_batch_size(self) -> float:
        """``q * N``: the public constant to normalise a batch sum by."""
        return self.q * self.num_records

    @property
    def overflow_probability(self) -> float:
        """Per-step probability that ``K > max_batch_size`` (truncation or suppression)."""
        return poisson_overflow_probability(self.num_records, self.q, self.max_batch_size)

    def sample(self, rng_key, rng_suite: types.ModuleType = d3p.random) -> Tuple[jax.Array, jax.Array]:
        """Draw one batch.

        :param rng_key: a key of ``rng_suite`` (secret, fresh for every batch), or
            a JAX key, converted by :func:`d3p.random.as_key`.
        :param rng_suite: PRNG suite, :mod:`d3p.random` (default) or :mod:`d3p.random.debug`.
        :return: ``(indices int32[max_batch_size], mask bool[max_batch_size])``;
            ``mask[j]`` is True for the real records, which come first:
            ``min(K, max_batch_size)`` of them, or none if ``K >
            max_batch_size`` and ``handle_oversized_batch="suppress"``.
        :raises SamplingError: if the random source is broken (called with
            concrete values; traced, the batch is returned empty, see the module docstring).
        """
        return _sample(self, rng_key, _validate.rng_suite("rng_suite", rng_suite))

    def _count_table(self):
        """The public table of the batch size's inverse CDF (:func:`_binomial_thresholds`
        of N, q and ``max_batch_size``): what :meth:`DPSVI.run <d3p.svi.DPSVI.run>`'s
        compiled steps take as an argument, so that one program serves every
        ``q`` with the same N and ``max_batch_size``."""
        return _binomial_thresholds(self.num_records, self.q, self.max_batch_size)

    def _draw(self, rng_key, rng_suite, table=None):
        # the count's two words are stream 0 of rng_key (d3p.random.stream_words), the candidates'
        # blocks streams 1, 2, ...: in one call with the first block where one block is all it takes
        m, n = self.max_batch_size, self.num_records
        if _single_pass_draws(m, n) is None:
            (words,) = stream_words(rng_suite, rng_key, 0, (2,))
            first = None
        else:
            words, first = stream_words(rng_suite, rng_key, 0, (2, _round_words(m, n)))
        count = _binomial_count(words, n, self.q, m, self.handle_oversized_batch == "suppress", table)
        indices, ok = _distinct_uniform(rng_key, m, n, rng_suite, stream=1, first_words=first)
        mask = jnp.arange(self.max_batch_size) < count
        return indices, mask, ok


@dataclass(frozen=True)
class WithReplacementSampler(_FixedBatchSampler):
    """``batch_size`` independent, uniformly random records (with replacement).

    :param int num_records: number of records N (public).
    :param int batch_size: batch size B (public), in ``[1, N]``.

    Attributes: ``relation = None``, ``q = B / N`` (the expected fraction of
    draws that hit one given record is ``1/N`` per draw), ``expected_batch_size = B``,
    ``max_batch_size = B``.

    **Formal guarantees.** The B indices are independent and each exactly
    uniform on ``[0, N)`` (Lemire's method with rejection; given ideal random
    bits); the mask is all True. A record may appear several times in a
    batch, so one record can contribute up to B clipped gradients.
    **No accountant in d3p covers this sampler**: the substitute-relation
    accountant for sampling without replacement does not apply, hence
    ``relation`` is None, and :class:`d3p.svi.DPSVI` must refuse to account
    for it. (Amplification by sampling with replacement has been analysed,
    e.g. by Balle, Barthe and Gaboardi, 2018, under the substitute relation,
    but that analysis is not implemented here.)
    """

    @property
    def relation(self) -> None:
        """None: not covered by any accountant in d3p."""
        return None

    def _indices(self, rng_key, rng_suite):
        return _uniform_indices(rng_key, self.batch_size, self.num_records, rng_suite)


Sampler = Union[FixedSizeSampler, PoissonSampler, WithReplacementSampler]


def _failure_message(what: str) -> str:
    return (
        f"{what} reached its iteration bound without completing a batch, which a working random "
        f"source does with probability below {LOOP_FAILURE_PROBABILITY:.1e}: the PRNG suite "
        "(rng_suite) looks broken. The batch is not of the sampler's distribution and was not used."
    )


def _raise_sampling_error(message: str) -> None:
    raise SamplingError(message)


def _require_in_graph(ok: jax.Array, values, message: str):
    """Return ``values``; make the running computation fail if ``ok`` is False.

    A host callback that raises :class:`SamplingError`, reached through a
    ``lax.cond`` only when ``ok`` is False (no callback, no host round trip
    otherwise). Under ``vmap`` the flags of the whole batch are combined
    first, so that the ``cond`` keeps a scalar predicate (a batched predicate
    would turn it into a select that runs the callback unconditionally).
    """

    @custom_vmap
    def require(ok, values):
        lax.cond(ok, lambda: None,
                 lambda: io_callback(partial(_raise_sampling_error, message), None))
        return values

    @require.def_vmap
    def require_batched(axis_size, in_batched, ok, values):
        ok_batched, values_batched = in_batched
        return require(jnp.all(ok) if ok_batched else ok, values), values_batched

    return require(ok, values)


def _require(ok, values, message: str):
    """``values`` if ``ok``; otherwise raise :class:`SamplingError` (``ok``
    concrete) or make the traced computation fail at run time."""
    if isinstance(ok, jax.core.Tracer):
        return _require_in_graph(ok, values, message)
    if not bool(ok):
        raise SamplingError(message)
    return values


def _draw_checked(sampler, rng_key, rng_suite, table=None):
    """``(indices, mask, ok)``; if not ok, the batch is emptied (mask all False,
    indices out of range) so that no part of it can stand in for a real batch.
    ``table``: a Poisson sampler's ``PoissonSampler._count_table()`` as arrays (None: its constants)."""
    indices, mask, ok = sampler._draw(rng_key, rng_suite, table)
    indices = jnp.where(ok, indices, _SENTINEL)
    mask = mask & ok
    return indices, mask, ok


@partial(jax.jit, static_argnums=(0, 2))
def _sample_jit(sampler, rng_key, rng_suite):
    # compiled once per (sampler, suite), so that eager calls are fast too
    return _draw_checked(sampler, rng_key, rng_suite)


@partial(jax.jit, static_argnums=(0, 3))
def _sample_batch_jit(sampler, rng_key, i, rng_suite, table=None):
    return _draw_checked(sampler, rng_suite.fold_in(rng_key, i), rng_suite, table)


def _sample(sampler, rng_key, rng_suite, i=None):
    """Batch ``sampler.sample(rng_key)`` (or of ``fold_in(rng_key, i)``), checked;
    a JAX key is first turned into a key of ``rng_suite`` (:func:`d3p.random.as_key`)."""
    rng_key = suite_key(rng_suite, rng_key)
    if i is None:
        indices, mask, ok = _sample_jit(sampler, rng_key, rng_suite)
    else:
        indices, mask, ok = _sample_batch_jit(sampler, rng_key, i, rng_suite)
    if isinstance(ok, jax.core.Tracer):
        # inside jit/vmap/scan: no host callback; a failed batch is already
        # empty, with out-of-range indices (_draw_checked)
        return indices, mask
    return _require(ok, (indices, mask), _failure_message(repr(sampler)))


# ----------------------------------------------------------------------------
# Feistel permutation (non-private shuffling)


def _feistel_network(round_keys, bits: int, num_rounds: int, rng_suite) -> Callable:
    """The keyed Feistel network on ``[0, 2**bits)`` of :func:`feistel_permutation`
    (a bijection for any round functions), as a function of a uint32 array."""

    def round_fn(key, r):
        return jax.vmap(lambda v: rng_suite.random_bits(rng_suite.fold_in(key, v), 32, ()))(r)

    # the two half widths alternate between rounds; loop over rounds (one
    # compiled round function) with the widths as traced shift amounts
    c_even, c_odd = np.uint32(bits // 2), np.uint32(bits - bits // 2)
    one = np.uint32(1)

    def feistel_round(i, flat):
        c = jnp.where(i % 2 == 0, c_even, c_odd)  # width of the right half
        a = np.uint32(bits) - c
        left = flat >> c
        right = flat & ((one << c) - one)
        f = round_fn(round_keys[i], right).astype(jnp.uint32)
        return (right << a) | ((left ^ f) & ((one << a) - one))

    def permute(x):
        flat = lax.fori_loop(0, num_rounds, feistel_round, x.reshape(-1))
        return flat.reshape(x.shape)

    return permute


def feistel_permutation(
    rng_key,
    positions: jax.typing.ArrayLike,
    num_records: int,
    num_rounds: int = DEFAULT_FEISTEL_ROUNDS,
    rng_suite: types.ModuleType = d3p.random,
) -> jax.Array:
    """A keyed pseudo-random permutation of ``[0, num_records)``, evaluated at ``positions``.

    A Feistel network on ``b = max(2, ceil(log2 N))`` bits (halves of
    ``floor(b/2)`` and ``ceil(b/2)`` bits, alternating) with round function
    ``F_i(R) = rng_suite.random_bits(rng_suite.fold_in(round_key_i, R))``
    is a bijection on ``[0, 2**b)``; cycle-walking (re-applying it while the
    value is ``>= N``, in a ``lax.while_loop`` over the whole vector)
    restricts it to a bijection on ``[0, N)``. From a position in ``[0, N)``
    the walk is back in that range within ``2**b - N + 1`` applications,
    whatever the round functions (the position's own cycle passes through
    it); the loop stops there at the latest, and a value still out of range
    (only possible for a position outside ``[0, N)``) fails loudly, as in the
    samplers. Work is ``O(len(positions) * num_rounds)`` integer operations,
    independent of N.

    :param rng_key: a key of ``rng_suite``, or a JAX key (:func:`d3p.random.as_key`).
    :param positions: int array of positions in ``[0, N)`` (distinct positions
        give distinct outputs).
    :param int num_records: N.
    :param int num_rounds: number of Feistel rounds (static).
    :param rng_suite: PRNG suite.
    :return: int32 array of the shape of ``positions``.

    **Formal guarantees.** For a fixed key the map is a bijection of
    ``[0, N)``. Its distribution over keys is *not* uniform over
    permutations or subsets (see the module docstring): use it for
    non-private shuffling only, never for a batch the accountant analyses.
    """
    num_records = _num_records(num_records)
    num_rounds = _validate.integer("num_rounds", num_rounds, minimum=1)
    rng_suite = _validate.rng_suite("rng_suite", rng_suite)
    bits = max(2, math.ceil(math.log2(num_records)))
    rng_key = suite_key(rng_suite, rng_key)
    permute = _feistel_network(rng_suite.split(rng_key, num_rounds), bits, num_rounds, rng_suite)
    x0 = jnp.asarray(positions).astype(jnp.uint32)

    max_walk = 2**bits - num_records  # applications after the first

    def cond(state):
        x, t = state
        return jnp.any(x >= num_records) & (t < max_walk)

    def body(state):
        x, t = state
        return jnp.where(x >= num_records, permute(x), x), t + 1

    x, _ = lax.while_loop(cond, body, (permute(x0), jnp.int32(0)))
    ok = jnp.all(x < num_records)
    x = _require(ok, x, (
        f"feistel_permutation's cycle-walking did not return into [0, N={num_records}) within "
        f"{max_walk + 1} applications, which a permutation always does from a position in that "
        "range: a position is outside [0, N), or the PRNG suite (rng_suite) is broken."))
    return x.astype(jnp.int32)

