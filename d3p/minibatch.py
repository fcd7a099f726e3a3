"""Minibatch samplers whose output distribution is exactly what the accountant assumes.

DP-VI's privacy guarantee holds only if the batch of every step is drawn
independently, from a secret key, and from exactly the distribution that the
privacy accountant analyses. This module provides those samplers:

- :class:`FixedSizeSampler`: uniform over all B-subsets of the N records;
  neighbouring relation :data:`SUBSTITUTE`.
- :class:`PoissonSampler`: every record independently with probability q,
  padded to a fixed shape with a mask; relation :data:`ADD_REMOVE`.
- :class:`WithReplacementSampler`: B independent uniform indices; not covered
  by d3p's accountants (``relation`` is None).

A sampler holds only public settings (N, B or q, the output shape) and is a
hashable frozen dataclass, so it can be a static argument of ``jax.jit``. Its
``sample(rng_key, rng_suite)`` method is jittable and returns
``(indices, mask)`` of fixed shape ``(max_batch_size,)``; :func:`take_batch`
gathers the records.

**How the indices are drawn (exactly).** Both private samplers draw an
*ordered* sequence of distinct indices that is exactly uniform over all
sequences of distinct indices ("sequential distinct draws"): 32-bit words from
the PRNG suite are turned into exactly uniform integers in ``[0, N)`` by
Lemire's multiply-and-reject method, and a value is kept if it has not been
drawn before (earlier in the same block of draws or in an earlier block). If
every uniform draw is kept only when new, each kept value is uniform over the
values not yet kept, so the kept sequence is a uniform random sequence of
distinct indices. The work is vectorised: a block of candidates is drawn at
once and duplicates are found with one sort (of each value packed with its
draw position into one word where both fit, see :func:`_first_occurrences`):
which candidates are kept depends on the values only, not on how the sort
finds them. Where N is well above B
the block is large enough to hold B distinct values except with probability
:data:`LOOP_FAILURE_PROBABILITY` (a few percent more words than B for
``N >> B``) and is the only one: no loop, which spares a GPU a host round trip
per batch. Where B is close to N (collecting nearly every index), a
``lax.while_loop`` draws blocks until the sequence is complete (the block
size chosen on the host from the expected number of draws, so the loop body
runs once almost always). The cost is ``O(B log B)`` and does not depend on
N. With ideal random bits the result is exactly uniform; with
:mod:`d3p.random` it is ChaCha20's keystream turned into that distribution,
i.e. indistinguishable from it as far as ChaCha20 is a secure stream cipher.

**Every loop is bounded.** Each ``lax.while_loop`` (and the single pass)
stops after a number of words computed on the host so that, with ideal
random bits, a draw needs more with probability at most
:data:`LOOP_FAILURE_PROBABILITY` (``2**-64``) per batch (see
:func:`_distinct_uniform_draws_bound`). A draw that reaches its bound has
not produced a batch of the sampler's distribution, which in practice means
a broken random source: the batch is then never used as if it were one.
Called with concrete values, ``sample`` and ``get_batch`` raise
:class:`SamplingError` (so does :meth:`d3p.svi.DPSVI.run`, after its
compiled steps, and a run traced as a whole fails at run time). Inside a
traced computation (``jit``, ``vmap``, ``lax.scan``) ``sample`` and
``get_batch`` return the batch emptied: mask all False and every index the
out-of-range value ``2**31 - 1``, which ``jnp.take`` (and so
``get_batch``) turns into fill values (NaN for floating-point records). The
compiled draw holds no host callback, which would cost a GPU a host round
trip per batch and cannot be lowered for one without it; an empty batch adds
nothing but noise to a DP-VI step. Conditioned on not
reaching the bound, the output distribution is exactly the one stated (the
event depends only on the random bits and is invariant under relabelling the
records), and reaching it depends on no data, so the failure itself reveals
nothing about the records.

**Why not a Feistel network.** A keyed Feistel permutation with cycle-walking
(:func:`feistel_permutation`) gives distinct indices with only integer ops, but
its output is not uniform: even with truly random round functions, on the
8-element domain (N=5..8) the total variation distance between its B-subsets
and the uniform distribution decays only by a factor of about 0.83 per round
(computed exactly: 3e-2 after 8 rounds, 9e-4 after 24, 4e-5 after 40 for
N=5, B=2), and for large N the entropy of r random round functions, about
``r * (b/2) * 2**(b/2)`` bits for ``b = ceil(log2 N)``, falls short of
``log2 C(N, B)`` for large batches, so no fixed number of rounds is exact. With a ChaCha20 round function it is also
5 to 25 times slower on CPU than the exact method above (see
``benchmarks/README.md``). It is kept for :func:`split_batchify_data`
(non-private shuffling in ``O(B)`` per batch) only.
"""

import math
import numbers
import types
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Any, Callable, NamedTuple, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_batching import custom_vmap
from jax.experimental import io_callback

import d3p.random
from d3p import _validate
from d3p import _sampling
from d3p.random import _keystream
from d3p.random._common import mulhi_u32

__all__ = [
    "SUBSTITUTE",
    "ADD_REMOVE",
    "DEFAULT_OVERFLOW_PROBABILITY",
    "LOOP_FAILURE_PROBABILITY",
    "SamplingError",
    "FixedSizeSampler",
    "PoissonSampler",
    "WithReplacementSampler",
    "BatchifyState",
    "take_batch",
    "subsample_batchify_data",
    "poisson_batchify_data",
    "split_batchify_data",
    "q_to_batch_size",
    "batch_size_to_q",
    "poisson_max_batch_size",
    "poisson_overflow_probability",
    "poisson_overflow_delta",
    "feistel_permutation",
]

#: Neighbouring relation "replace one record by another" (data sets of equal
#: size N). Fixed-size sampling without replacement is analysed under it.
#: The same object as :data:`d3p.accounting.SUBSTITUTE`.
SUBSTITUTE = _sampling.Relation.SUBSTITUTE
#: Neighbouring relation "add or remove one record". Poisson sampling is
#: analysed under it. The same object as :data:`d3p.accounting.ADD_REMOVE`.
ADD_REMOVE = _sampling.Relation.ADD_REMOVE

#: Default bound on the per-step probability that a Poisson batch has more
#: records than ``max_batch_size`` (see :func:`poisson_max_batch_size`).
DEFAULT_OVERFLOW_PROBABILITY = 1e-18

#: Largest supported data set size: indices are int32.
MAX_NUM_RECORDS = 2**31 - 1

#: Number of Feistel rounds used by :func:`split_batchify_data`.
DEFAULT_FEISTEL_ROUNDS = 8

_SENTINEL = np.int32(2**31 - 1)  # larger than every valid index

#: Per batch, the probability (given ideal random bits) that a sampler's loop
#: reaches its iteration bound; a batch that reaches it is never used (see
#: :class:`SamplingError`).
LOOP_FAILURE_PROBABILITY = 2.0**-64


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

Dataset = Union[jax.typing.ArrayLike, Sequence[jax.typing.ArrayLike]]


# ----------------------------------------------------------------------------
# validation at the boundary


def _num_records(value, name: str = "num_records") -> int:
    """A data set size N in ``[1, MAX_NUM_RECORDS]`` (indices are int32)."""
    return _validate.integer(name, value, minimum=1, maximum=MAX_NUM_RECORDS)


def _suite_in_place_of(name: str, value, default, rng_suite):
    """``(value, rng_suite)`` of a call, with a PRNG suite passed positionally
    in the place of ``name`` taken as ``rng_suite`` (the position ``rng_suite``
    has in the signatures without ``name``) and ``name`` then its default."""
    if value is None or isinstance(value, (str, bytes, numbers.Number)):
        return value, rng_suite
    try:
        _validate.rng_suite(name, value)
    except ValueError:
        return value, rng_suite  # not a suite: the argument's own check names it
    if rng_suite is not d3p.random:
        raise ValueError(
            f"Expected one PRNG suite, got {name}={value!r} and rng_suite={rng_suite!r}."
        )
    return default, value


def _check_dataset(dataset: Dataset) -> Tuple[Tuple[jax.Array, ...], bool, int]:
    """Returns (arrays as a tuple, whether a single array was given, N)."""
    single = not isinstance(dataset, (tuple, list))
    arrays = (dataset,) if single else tuple(dataset)
    if len(arrays) == 0:
        raise ValueError("Expected dataset to hold at least one array, got an empty dataset=().")
    lengths = []
    for k, x in enumerate(arrays):
        shape = np.shape(x)
        if len(shape) == 0:
            raise ValueError(
                f"Expected every array of dataset to have a leading record axis, got a scalar at "
                f"dataset[{k}]."
            )
        lengths.append(shape[0])
    if any(n != lengths[0] for n in lengths):
        raise ValueError(
            f"Expected all arrays of dataset to have the same number of records (leading "
            f"dimension), got lengths {lengths}."
        )
    if lengths[0] == 0:
        raise ValueError("Expected a non-empty dataset, got N=0 records.")
    # jnp.asarray copies host arrays to the device; the user's arrays are never modified
    arrays = tuple(jnp.asarray(x) for x in arrays)
    return arrays, single, int(lengths[0])


# ----------------------------------------------------------------------------
# conversions between q and B


def q_to_batch_size(q: float, N: int) -> int:
    """The batch size for sampling probability ``q`` from ``N`` records.

    :param float q: sampling probability in (0, 1].
    :param int N: number of records.
    :return: ``floor(q * N)`` (up to floating point round-off), at least 1.

    Rounding down makes ``batch_size / N <= q`` whenever ``q * N >= 1``, so an
    ε computed with the given ``q`` is an upper bound for the resulting batch
    size; account with ``batch_size_to_q(batch_size, N)`` (the sampler's ``q``)
    to get the exact value.

    >>> q_to_batch_size(0.29, 100)
    29
    """
    q = _validate.probability("q", q)
    N = _num_records(N, "N")
    x = q * N
    nearest = round(x)
    b = nearest if abs(x - nearest) <= 1e-9 * max(1.0, x) else math.floor(x)
    return int(min(max(b, 1), N))


def batch_size_to_q(batch_size: int, N: int) -> float:
    """The sampling probability ``batch_size / N`` of a fixed-size batch.

    :param int batch_size: batch size B in [1, N].
    :param int N: number of records.

    >>> batch_size_to_q(10, 1000)
    0.01
    """
    N = _num_records(N, "N")
    batch_size = _validate.integer("batch_size", batch_size, minimum=1, maximum=N)
    return batch_size / N


# ----------------------------------------------------------------------------
# exact integer sampling primitives


def _uniform_below(words: jax.Array, n: int) -> Tuple[jax.Array, jax.Array]:
    """Lemire's multiply-and-reject: exactly uniform integers in ``[0, n)``.

    Returns ``(values int32, accepted bool)``. For ``w`` uniform on 32 bits,
    ``floor(w * n / 2**32)`` conditioned on ``(w * n mod 2**32) >= 2**32 mod n``
    is exactly uniform on ``[0, n)``: every value keeps exactly
    ``floor(2**32 / n)`` of its preimages.
    """
    n_arr = jnp.full(words.shape, n, dtype=jnp.uint32)
    hi, lo = mulhi_u32(words.astype(jnp.uint32), n_arr)
    threshold = np.uint32((2**32) % n)
    return hi.astype(jnp.int32), lo >= threshold


def _draw_block_size(num: int, num_records: int) -> int:
    """Number of candidates per loop iteration of :func:`_distinct_uniform`."""
    n, s = num_records, num
    # expected number of uniform draws until s distinct values: n (H_n - H_{n-s})
    if n - s > 50:
        expected = n * (math.log(n + 0.5) - math.log(n - s + 0.5))
    else:
        expected = n * sum(1.0 / i for i in range(n - s + 1, n + 1))
    k = 1.1 * expected + 4.0 * math.sqrt(expected) + 8
    return int(min(math.ceil(k), 4 * s + 8))


def _acceptance_probability(n: int) -> float:
    """Probability that one 32-bit word is accepted by :func:`_uniform_below` (> 1/2)."""
    return 1.0 - (2**32 % n) / 2**32


@lru_cache(maxsize=256)
def _distinct_uniform_draws_bound(num: int, num_records: int) -> int:
    """A number of words after which :func:`_distinct_uniform` has its ``num``
    distinct values except with probability at most :data:`LOOP_FAILURE_PROBABILITY`.

    The number X of words drawn until ``num`` = s distinct accepted values
    have appeared among ``num_records`` = n is a sum of independent geometric
    variables with success probabilities ``p_i = a (n - i) / n``,
    ``i = 0..s-1`` (``a`` = acceptance probability of one word), so
    ``p_* = min p_i = a (n - s + 1) / n`` and ``mu = E[X] = (n / a) (H_n - H_{n-s})``.
    Janson (2018, "Tail bounds for sums of geometric and exponential
    variables", Theorem 2.1) gives, for ``lambda >= 1``,
    ``P(X >= lambda mu) <= exp(-p_* mu (lambda - 1 - ln lambda))``. The bound
    is decreasing in ``mu`` at fixed ``lambda mu``, so using an upper bound of
    ``mu`` (``H_n - H_{n-s} <= ln(n / (n - s))``, or ``1 + ln n`` for
    ``s = n``) keeps it valid. Returns ``ceil(lambda mu)`` for the ``lambda``
    that makes the bound ``LOOP_FAILURE_PROBABILITY``.
    """
    n, s = num_records, num
    a = _acceptance_probability(n)
    harmonic = 1.0 + math.log(n) if s == n else -math.log1p(-s / n)
    mu = n * harmonic / a * (1.0 + 1e-9)  # an upper bound of E[X], with room for rounding
    p_min = a * (n - s + 1) / n
    c = -math.log(LOOP_FAILURE_PROBABILITY) / (p_min * mu)
    # smallest x = lambda - 1 >= 0 with x - log1p(x) >= c (increasing in x); x = 1 + 2c satisfies it
    lo, hi = 0.0, 1.0 + 2.0 * c
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid - math.log1p(mid) >= c:
            hi = mid
        else:
            lo = mid
    return int(math.ceil((1.0 + hi) * mu))


def _distinct_uniform_max_iterations(num: int, num_records: int, block: int) -> int:
    """Iteration bound of :func:`_distinct_uniform`'s loop of ``block`` words per
    iteration: after ``t`` iterations it has drawn ``t * block`` words, and the
    returned ``t`` makes ``P(X > t * block) <= LOOP_FAILURE_PROBABILITY``
    (see :func:`_distinct_uniform_draws_bound`)."""
    return -(-_distinct_uniform_draws_bound(num, num_records) // block) + 1


def _single_pass_draws(num: int, num_records: int) -> Optional[int]:
    """The number of words of :func:`_distinct_uniform`'s single pass, or None
    where one pass would cost more than about twice the loop's usual block
    (``N`` close to ``B``), and the loop is used instead."""
    draws = _distinct_uniform_draws_bound(num, num_records)
    return draws if draws <= 2 * _draw_block_size(num, num_records) + 64 else None


def _uniform_indices_max_iterations(num: int, num_records: int) -> int:
    """Iteration bound of :func:`_uniform_indices`: every one of ``num``
    positions is rejected ``t`` times in a row with probability ``(1 - a)**t``,
    so the union bound ``num * (1 - a)**t <= LOOP_FAILURE_PROBABILITY`` gives ``t``."""
    reject = 1.0 - _acceptance_probability(num_records)
    if reject == 0.0:
        return 1
    t = (math.log(num) - math.log(LOOP_FAILURE_PROBABILITY)) / -math.log(reject)
    return int(math.ceil(t)) + 1


def _first_occurrences(pool: jax.Array, num_records: int) -> jax.Array:
    """Which entries of ``pool`` (int32 values in ``[0, num_records)``, or
    ``_SENTINEL`` for none) hold the first occurrence of their value in
    ``pool``'s order, sentinels excluded: a bool array of ``pool``'s shape.

    With ``v`` bits for a value (``num_records.bit_length()``, the all-ones
    code standing for the sentinel) and ``p`` bits for a position, where
    ``v + p <= 32``, each entry is packed into one uint32 word ``value << p |
    position`` and the words are sorted once: equal values become adjacent and
    in pool order, so an entry is a first occurrence iff its value differs from
    its predecessor's in the sorted order. XLA:CPU sorts a single array of
    words several times faster than it sorts values with their positions
    (a comparator called per comparison). Otherwise the values alone are
    sorted, each entry finds the start of its value's run by binary search,
    and the smallest position that lands on a run start (a scatter-min) is its
    first occurrence. Both give the same answer, which depends on the values
    only.
    """
    n = pool.shape[0]
    positions = jnp.arange(n, dtype=jnp.uint32)
    value_bits, position_bits = int(num_records).bit_length(), max(int(n - 1).bit_length(), 1)
    if value_bits + position_bits <= 32:
        none = np.uint32(2**value_bits - 1)  # above every value: num_records <= 2**value_bits - 1
        values = jnp.where(pool == _SENTINEL, none, pool.astype(jnp.uint32))
        words = lax.sort((values << np.uint32(position_bits)) | positions, is_stable=False)
        sorted_values = words >> np.uint32(position_bits)
        sorted_positions = words & np.uint32(2**position_bits - 1)
        first = jnp.concatenate([jnp.ones((1,), bool), sorted_values[1:] != sorted_values[:-1]])
        first = first & (sorted_values != none)
        return jnp.zeros(n, bool).at[sorted_positions].set(first, unique_indices=True)
    sorted_values = lax.sort(pool, is_stable=False)
    # a loop of log2(n) steps on CPU; written out where a loop costs a host round trip
    start = _keystream.per_platform(
        lambda s, v: jnp.searchsorted(s, v, side="left", method="scan"),
        lambda s, v: jnp.searchsorted(s, v, side="left", method="scan_unrolled"),
        sorted_values, pool,
    ).astype(jnp.int32)
    positions = positions.astype(jnp.int32)
    earliest = jnp.full((n,), n, jnp.int32).at[start].min(positions)
    return (earliest[start] == positions) & (pool != _SENTINEL)


def _distinct_uniform(rng_key, num: int, num_records: int, rng_suite) -> Tuple[jax.Array, jax.Array]:
    """An exactly uniform random sequence of ``num`` distinct indices in ``[0, num_records)``.

    Every ordered sequence of ``num`` distinct indices has probability
    ``(N - num)! / N!`` (given ideal random bits); in particular the first
    ``k`` entries form a uniform k-subset for every ``k <= num``. Block ``t``
    of candidates uses the key ``rng_suite.fold_in(rng_key, t)``.

    Where ``N`` is well above ``num`` (:func:`_single_pass_draws`), one block
    of candidates large enough to hold ``num`` distinct values except with
    probability :data:`LOOP_FAILURE_PROBABILITY` is drawn, with no loop (a
    loop costs a GPU a host round trip per iteration); otherwise blocks are
    drawn in a ``lax.while_loop`` until the sequence is complete, at most
    :func:`_distinct_uniform_max_iterations` times. Either way the outcome
    is the first ``num`` distinct accepted candidates in draw order
    (:func:`_first_occurrences` of the values found so far followed by the
    block), and whether it is complete depends only on which candidates
    coincide or are rejected, an event invariant under relabelling the
    records, so conditioned on completion the sequence is exactly uniform.

    Returns ``(indices, ok)``: ``ok`` is False if the sequence is not
    complete, and then ``indices`` is not a valid batch.
    """
    single = _single_pass_draws(num, num_records)
    block = _draw_block_size(num, num_records) if single is None else single

    def candidates(t):
        words = rng_suite.random_bits(rng_suite.fold_in(rng_key, t), 32, (block,))
        values, accepted = _uniform_below(words, num_records)
        return jnp.where(accepted, values, _SENTINEL)

    def keep(found, count, cand, new):
        """The new candidates appended, in draw order, to the ``count`` found."""
        slot = count + jnp.cumsum(new.astype(jnp.int32)) - 1
        slot = jnp.where(new & (slot < num), slot, num)
        found = found.at[slot].set(cand, mode="drop")
        # int32 throughout (jnp.sum widens to int64 under jax_enable_x64)
        return found, jnp.minimum(count + jnp.sum(new, dtype=jnp.int32), num).astype(jnp.int32)

    empty = jnp.full((num,), _SENTINEL, jnp.int32)
    if single is not None:
        cand = candidates(jnp.uint32(0))
        found, count = keep(empty, jnp.int32(0), cand, _first_occurrences(cand, num_records))
        return found, count == num

    def draw(state):
        found, count, t = state
        cand = candidates(t)
        # a candidate is new iff it is the first occurrence of its value among
        # (already found values, then candidates in draw order)
        new = _first_occurrences(jnp.concatenate([found, cand]), num_records)[num:]
        found, count = keep(found, count, cand, new)
        return found, count, t + 1

    max_iterations = _distinct_uniform_max_iterations(num, num_records, block)

    def cond(state):
        return (state[1] < num) & (state[2] < max_iterations)

    found, count, _ = lax.while_loop(cond, draw, (empty, jnp.int32(0), jnp.uint32(0)))
    return found, count == num


def _uniform_indices(rng_key, num: int, num_records: int, rng_suite) -> Tuple[jax.Array, jax.Array]:
    """``num`` independent, exactly uniform indices in ``[0, num_records)``.

    Returns ``(indices, ok)``; ``ok`` is False if the loop reached its bound
    (:func:`_uniform_indices_max_iterations`) before every position was drawn.
    """
    max_iterations = _uniform_indices_max_iterations(num, num_records)

    def cond(state):
        return ~jnp.all(state[1]) & (state[2] < max_iterations)

    def body(state):
        out, done, t = state
        words = rng_suite.random_bits(rng_suite.fold_in(rng_key, t), 32, (num,))
        values, accepted = _uniform_below(words, num_records)
        take = accepted & ~done
        return jnp.where(take, values, out), done | take, t + 1

    init = (jnp.zeros((num,), jnp.int32), jnp.zeros((num,), bool), jnp.uint32(0))
    out, done, _ = lax.while_loop(cond, body, init)
    return out, jnp.all(done)


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
    rng_key, num_records: int, q: float, max_batch_size: int, rng_suite, suppress: bool = False
) -> jax.Array:
    """``min(K, max_batch_size)`` for ``K ~ Binomial(N, q)`` by inverse CDF on 64 random bits;
    with ``suppress``, 0 instead where ``K > max_batch_size``."""
    hi, lo, finite = _binomial_thresholds(num_records, q, max_batch_size)
    words = rng_suite.random_bits(rng_key, 32, (2,))
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

        :param rng_key: a key of ``rng_suite`` (secret, fresh for every batch).
        :param rng_suite: PRNG suite, :mod:`d3p.random` (default) or :mod:`d3p.random.debug`.
        :return: ``(indices int32[B], mask bool[B])``; the mask is all True.
        :raises SamplingError: if the random source is broken (called with
            concrete values; traced, the batch is returned empty, see the module docstring).
        """
        return _sample(self, rng_key, _validate.rng_suite("rng_suite", rng_suite))

    def _draw(self, rng_key, rng_suite):
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

        :param rng_key: a key of ``rng_suite`` (secret, fresh for every batch).
        :param rng_suite: PRNG suite, :mod:`d3p.random` (default) or :mod:`d3p.random.debug`.
        :return: ``(indices int32[max_batch_size], mask bool[max_batch_size])``;
            ``mask[j]`` is True for the real records, which come first:
            ``min(K, max_batch_size)`` of them, or none if ``K >
            max_batch_size`` and ``handle_oversized_batch="suppress"``.
        :raises SamplingError: if the random source is broken (called with
            concrete values; traced, the batch is returned empty, see the module docstring).
        """
        return _sample(self, rng_key, _validate.rng_suite("rng_suite", rng_suite))

    def _draw(self, rng_key, rng_suite):
        count_key, index_key = rng_suite.split(rng_key, 2)
        suppress = self.handle_oversized_batch == "suppress"
        count = _binomial_count(
            count_key, self.num_records, self.q, self.max_batch_size, rng_suite, suppress
        )
        indices, ok = _distinct_uniform(index_key, self.max_batch_size, self.num_records, rng_suite)
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


def _draw_checked(sampler, rng_key, rng_suite):
    """``(indices, mask, ok)``; if not ok, the batch is emptied (mask all False,
    indices out of range) so that no part of it can stand in for a real batch."""
    indices, mask, ok = sampler._draw(rng_key, rng_suite)
    indices = jnp.where(ok, indices, _SENTINEL)
    mask = mask & ok
    return indices, mask, ok


@partial(jax.jit, static_argnums=(0, 2))
def _sample_jit(sampler, rng_key, rng_suite):
    # compiled once per (sampler, suite), so that eager calls are fast too
    return _draw_checked(sampler, rng_key, rng_suite)


@partial(jax.jit, static_argnums=(0, 3))
def _sample_batch_jit(sampler, rng_key, i, rng_suite):
    return _draw_checked(sampler, rng_suite.fold_in(rng_key, i), rng_suite)


def _sample(sampler, rng_key, rng_suite, i=None):
    """Batch ``sampler.sample(rng_key)`` (or of ``fold_in(rng_key, i)``), checked."""
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

    :param rng_key: a key of ``rng_suite``.
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


# ----------------------------------------------------------------------------
# gathering and the (init, get_batch) interface


class BatchifyState(NamedTuple):
    """State of a batchify pair.

    :ivar rng_key: the key of the current epoch; batch i is drawn with
        ``rng_suite.fold_in(rng_key, i)``.
    """

    rng_key: Any


def take_batch(dataset: Dataset, indices: jax.typing.ArrayLike):
    """Gather the records at ``indices`` from every array of ``dataset``.

    :param dataset: an array, or a tuple/list of arrays with equal leading dimension.
    :param indices: int array of record indices (may be traced).
    :return: the gathered array for a single array, otherwise a tuple of gathered arrays.
    """
    if isinstance(dataset, (tuple, list)):
        return tuple(jnp.take(jnp.asarray(x), indices, axis=0) for x in dataset)
    return jnp.take(jnp.asarray(dataset), indices, axis=0)


def _make_batchify(arrays, single, sampler, rng_suite, num_batches, with_mask):
    def init(rng_key) -> Tuple[int, BatchifyState]:
        """Start an epoch: returns ``(num_batches, BatchifyState(rng_key))``."""
        return num_batches, BatchifyState(rng_key)

    def get_batch(i, state: BatchifyState):
        """The i-th batch (``i`` may be traced)."""
        indices, mask = _sample(sampler, state.rng_key, rng_suite, i)
        batch = take_batch(arrays[0] if single else arrays, indices)
        return (batch, mask) if with_mask else batch

    init.sampler = sampler
    get_batch.sampler = sampler
    return init, get_batch


def _fixed_batch_size(batch_size, q, num_records: int) -> int:
    """B from exactly one of ``batch_size`` and ``q`` (``q_to_batch_size(q, N)``)."""
    if (batch_size is None) == (q is None):
        raise ValueError(
            f"Expected exactly one of batch_size and q, got batch_size={batch_size!r}, q={q!r}."
        )
    if batch_size is None:
        batch_size = q_to_batch_size(q, num_records)
    return _validate.integer("batch_size", batch_size, minimum=1, maximum=num_records)


def subsample_batchify_data(
    dataset: Dataset,
    batch_size: Optional[int] = None,
    q: Optional[float] = None,
    with_replacement: bool = False,
    rng_suite: types.ModuleType = d3p.random,
    return_mask: bool = False,
) -> Tuple[Callable, Callable]:
    """Fixed-size random batches, each drawn independently (the d3p 0.2 interface).

    :param dataset: a tuple (or list) of arrays with equal leading dimension N,
        or a single array. Batches mirror it: a tuple of arrays for a
        tuple/list, a single array for a single array. The arrays are copied
        to the device once; the caller's arrays are never modified.
    :param int batch_size: B in ``[1, N]``; exactly one of ``batch_size`` and ``q``.
    :param float q: sampling probability; B = :func:`q_to_batch_size` ``(q, N)``.
    :param bool with_replacement: draw B independent uniform indices instead
        (see :class:`WithReplacementSampler`: not covered by d3p's accountants).
    :param rng_suite: PRNG suite for batch selection.
    :param bool return_mask: if True, ``get_batch`` returns ``(batch, mask)``
        with ``mask`` a bool array of shape ``(B,)``, all True (the batches
        are full), so that code written for :func:`poisson_batchify_data`
        runs unchanged.
    :return: ``(init, get_batch)``: ``init(rng_key) -> (num_batches, state)`` with
        ``num_batches = N // B`` (batches per epoch) and ``state`` a
        :class:`BatchifyState`; ``get_batch(i, state)`` returns batch ``i``,
        drawn with ``fold_in(state.rng_key, i)``; jittable, ``i`` may be
        traced. Both functions carry the sampler as attribute ``.sampler``
        (its ``relation``, ``q`` and ``expected_batch_size`` are what
        accounting and normalisation must use).

    **Formal guarantees.** Those of :class:`FixedSizeSampler` (uniform
    B-subsets, independent across i; :data:`SUBSTITUTE` relation), or of
    :class:`WithReplacementSampler` if ``with_replacement``.

    >>> import numpy as np, d3p.random
    >>> init, get_batch = subsample_batchify_data((np.arange(10.0), np.ones((10, 2))), batch_size=3)
    >>> num_batches, state = init(d3p.random.PRNGKey(0))
    >>> x, y = get_batch(0, state)
    >>> num_batches, x.shape, y.shape
    (3, (3,), (3, 2))
    """
    rng_suite = _validate.rng_suite("rng_suite", rng_suite)
    with_replacement = _validate.boolean("with_replacement", with_replacement)
    return_mask = _validate.boolean("return_mask", return_mask)
    arrays, single, n = _check_dataset(dataset)
    batch_size = _fixed_batch_size(batch_size, q, n)
    if with_replacement:
        sampler = WithReplacementSampler(n, batch_size)
    else:
        sampler = FixedSizeSampler(n, batch_size)
    return _make_batchify(arrays, single, sampler, rng_suite, n // batch_size, with_mask=return_mask)


def poisson_batchify_data(
    dataset: Dataset,
    q: float,
    max_batch_size: Optional[Union[int, float]] = None,
    handle_oversized_batch: str = "truncate",
    rng_suite: types.ModuleType = d3p.random,
) -> Tuple[Callable, Callable]:
    """Poisson-sampled batches of fixed shape with a mask.

    :param dataset: a tuple (or list) of arrays with equal leading dimension N,
        or a single array (batches mirror its structure).
    :param float q: sampling probability of every record, in (0, 1].
    :param max_batch_size: padded batch length: an integer in ``[1, N]``, or a
        float ``p`` in (0, 1) for one more than the ``p``-quantile of the batch
        size distribution (d3p 0.2's value: a batch is shorter with probability
        at least ``p``); default: overflow probability at most 1e-18 per step
        (see :class:`PoissonSampler`).
    :param str handle_oversized_batch: ``"truncate"`` (default) or
        ``"suppress"``: what a batch of more than ``max_batch_size`` records
        becomes (see :class:`PoissonSampler`).
    :param rng_suite: PRNG suite for batch selection. A PRNG suite passed as
        the fourth positional argument is taken as ``rng_suite`` (the
        signature without ``handle_oversized_batch``).
    :return: ``(init, get_batch)``: ``init(rng_key) -> (num_batches, state)``
        with ``num_batches = floor(1 / q)``; ``get_batch(i, state)`` returns
        ``(batch, mask)`` with ``mask`` bool of shape ``(max_batch_size,)``,
        True for real records. Both carry the :class:`PoissonSampler` as
        ``.sampler``; normalise by ``sampler.expected_batch_size = q N``.

    **Formal guarantees.** Those of :class:`PoissonSampler`, including the
    overflow term added to δ (the same for both settings of
    ``handle_oversized_batch``); :data:`ADD_REMOVE` relation.
    """
    handle_oversized_batch, rng_suite = _suite_in_place_of(
        "handle_oversized_batch", handle_oversized_batch, "truncate", rng_suite
    )
    rng_suite = _validate.rng_suite("rng_suite", rng_suite)
    arrays, single, n = _check_dataset(dataset)
    sampler = PoissonSampler(n, q, max_batch_size, handle_oversized_batch)
    num_batches = max(1, int(1.0 / sampler.q))
    return _make_batchify(arrays, single, sampler, rng_suite, num_batches, with_mask=True)


@partial(jax.jit, static_argnums=(2, 3, 4))
def _split_indices_jit(rng_key, i, num_records, batch_size, rng_suite):
    positions = jnp.asarray(i, jnp.int32) * batch_size + jnp.arange(batch_size, dtype=jnp.int32)
    return feistel_permutation(rng_key, positions, num_records, rng_suite=rng_suite)


def split_batchify_data(
    dataset: Dataset,
    batch_size: Optional[int] = None,
    q: Optional[float] = None,
    rng_suite: types.ModuleType = d3p.random,
    return_mask: bool = False,
) -> Tuple[Callable, Callable]:
    """Shuffle-and-split: disjoint batches that together cover an epoch. **Not private.**

    For non-private use (evaluation, or a non-private baseline): batches of an
    epoch are disjoint and therefore dependent, which no d3p accountant
    covers. Batch ``i`` holds the records at positions ``i*B .. (i+1)*B - 1``
    of a pseudo-random permutation (:func:`feistel_permutation`) keyed by
    ``state.rng_key``, computed in ``O(B)`` without materialising the
    permutation; call ``init`` with a new key for every epoch.

    :param dataset: a tuple (or list) of arrays, or a single array.
    :param int batch_size: B in ``[1, N]``; exactly one of ``batch_size`` and ``q``.
    :param float q: B = :func:`q_to_batch_size` ``(q, N)``.
    :param rng_suite: PRNG suite for the permutation. A PRNG suite passed as
        the third positional argument is taken as ``rng_suite`` (the
        signature without ``q``).
    :param bool return_mask: if True, ``get_batch`` returns ``(batch, mask)``
        with ``mask`` a bool array of shape ``(B,)``, all True.
    :return: ``(init, get_batch)`` as in :func:`subsample_batchify_data`;
        ``num_batches = N // B`` (the last ``N mod B`` positions are skipped).
        ``get_batch.sampler`` is None.
    """
    q, rng_suite = _suite_in_place_of("q", q, None, rng_suite)
    rng_suite = _validate.rng_suite("rng_suite", rng_suite)
    return_mask = _validate.boolean("return_mask", return_mask)
    arrays, single, n = _check_dataset(dataset)
    batch_size = _fixed_batch_size(batch_size, q, n)
    num_batches = n // batch_size

    def init(rng_key) -> Tuple[int, BatchifyState]:
        """Start an epoch: returns ``(num_batches, BatchifyState(rng_key))``."""
        return num_batches, BatchifyState(rng_key)

    def get_batch(i, state: BatchifyState):
        """The i-th batch of the epoch (``i`` may be traced)."""
        indices = _split_indices_jit(state.rng_key, i, n, batch_size, rng_suite)
        batch = take_batch(arrays[0] if single else arrays, indices)
        return (batch, jnp.ones((batch_size,), bool)) if return_mask else batch

    init.sampler = None
    get_batch.sampler = None
    return init, get_batch
