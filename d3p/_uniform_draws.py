"""Exactly uniform indices from 32-bit words: the draws every private sampler makes.

Lemire's multiply-and-reject turns words into exactly uniform integers in
``[0, N)`` (``_uniform_below``); ``_distinct_uniform`` keeps the first
occurrence of each value in draw order (``_first_occurrences``, one sort),
which gives an exactly uniform sequence of distinct indices, in one pass
where N is well above the batch and in a bounded ``lax.while_loop``
otherwise; ``_uniform_indices`` draws independent indices (with
replacement). Every loop stops after a number of words computed on the host
(``_distinct_uniform_draws_bound``, ``_uniform_indices_max_iterations``) so
that it is reached with probability at most :data:`LOOP_FAILURE_PROBABILITY`
per batch; the method and its argument are described in
:mod:`d3p.minibatch`, whose samplers (``d3p._samplers``) use these draws.
"""

import math
from functools import lru_cache, partial
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from d3p.random import _keystream
from d3p.random._common import mulhi_u32, stream_words

_SENTINEL = np.int32(2**31 - 1)  # larger than every valid index

# Per batch, the probability (given ideal random bits) that a loop below
# reaches its iteration bound (d3p.minibatch.LOOP_FAILURE_PROBABILITY).
LOOP_FAILURE_PROBABILITY = 2.0**-64


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


def _candidates(words: jax.Array, num_records: int) -> jax.Array:
    """One block of :func:`_distinct_uniform`'s candidates: exactly uniform values in
    ``[0, num_records)`` from ``words``, ``_SENTINEL`` where a word is rejected."""
    values, accepted = _uniform_below(words, num_records)
    return jnp.where(accepted, values, _SENTINEL)


def _round_words(num: int, num_records: int) -> int:
    """The words of each block of candidates of :func:`_distinct_uniform` (its single
    pass, or each iteration of its loop)."""
    single = _single_pass_draws(num, num_records)
    return _draw_block_size(num, num_records) if single is None else single


def _append_new(num: int, found, count, cand, new):
    """The new candidates appended, in draw order, to the ``count`` found
    (``found`` holds ``num`` slots; candidates beyond them are dropped)."""
    slot = count + jnp.cumsum(new.astype(jnp.int32)) - 1
    slot = jnp.where(new & (slot < num), slot, num)
    found = found.at[slot].set(cand, mode="drop")
    # int32 throughout (jnp.sum widens to int64 under jax_enable_x64)
    return found, jnp.minimum(count + jnp.sum(new, dtype=jnp.int32), num).astype(jnp.int32)


def _distinct_uniform(rng_key, num: int, num_records: int, rng_suite, stream: int = 0,
                      first_words: Optional[jax.Array] = None) -> Tuple[jax.Array, jax.Array]:
    """An exactly uniform random sequence of ``num`` distinct indices in ``[0, num_records)``.

    Every ordered sequence of ``num`` distinct indices has probability
    ``(N - num)! / N!`` (given ideal random bits); in particular the first
    ``k`` entries form a uniform k-subset for every ``k <= num``. Block ``t``
    of candidates is stream ``stream + t`` of ``(rng_key, 0)``
    (:func:`d3p.random._common.stream_words`, :func:`_round_words` words);
    ``first_words``: block 0's words where the caller drew them (in the same
    call as its other words).

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
    block = _round_words(num, num_records)

    def candidates(t):
        (words,) = stream_words(rng_suite, rng_key, 0, (block,), jnp.uint32(stream) + t)
        return _candidates(words, num_records)

    keep = partial(_append_new, num)
    empty = jnp.full((num,), _SENTINEL, jnp.int32)
    if single is not None:
        cand = candidates(0) if first_words is None else _candidates(first_words, num_records)
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
    """``num`` independent, exactly uniform indices in ``[0, num_records)``, the words of
    iteration ``t`` stream ``t`` of ``(rng_key, 0)`` (:func:`d3p.random._common.stream_words`).

    Returns ``(indices, ok)``; ``ok`` is False if the loop reached its bound
    (:func:`_uniform_indices_max_iterations`) before every position was drawn.
    """
    max_iterations = _uniform_indices_max_iterations(num, num_records)

    def cond(state):
        return ~jnp.all(state[1]) & (state[2] < max_iterations)

    def body(state):
        out, done, t = state
        (words,) = stream_words(rng_suite, rng_key, 0, (num,), t)
        values, accepted = _uniform_below(words, num_records)
        take = accepted & ~done
        return jnp.where(take, values, out), done | take, t + 1

    init = (jnp.zeros((num,), jnp.int32), jnp.zeros((num,), bool), jnp.uint32(0))
    out, done, _ = lax.while_loop(cond, body, init)
    return out, jnp.all(done)

