"""Exact samples of the discrete Gaussian, in 32-bit integer arithmetic only.

The discrete Gaussian ``N_Z(0, s)`` has ``P(y)`` proportional to
``exp(-y**2 / (2 s))`` on the integers. Added to an exact integer sum (of
rounded, clipped gradients), it releases integers: there is no floating-point
support whose gaps depend on the value the noise is added to. The samples here
are computed exactly from uniform 32-bit words of a PRNG suite with uint32 and
int32 operations only.

**Method.** Canonne, Kamath and Steinke, "The Discrete Gaussian for
Differential Privacy" (2020), Algorithms 1 to 3, for ``s = 2**k``, so that
every rational in it is dyadic:

* A candidate ``Y`` is discrete Laplace of scale ``t = 2**ceil(k/2)``: ``U``
  uniform in ``[0, t)``, kept with probability ``exp(-U/t)`` (else a new
  ``U``); ``V`` the number of successes of ``Bernoulli(exp(-1))`` before its
  first failure; ``X = U + t V``; a fair sign ``B``, where ``B = 1, X = 0`` is
  rejected; ``Y = (1 - 2B) X``. Then ``P(Y = y)`` is proportional to
  ``exp(-|y|/t)``.
* ``Y`` is accepted with probability ``exp(-(|Y| - m)**2 / 2**(k+1))``,
  ``m = s/t = 2**floor(k/2)``; else a new candidate. As ``m/s = 1/t``, the law
  of an accepted ``Y`` is proportional to ``exp(-|y|/t - (|y| - m)**2 / (2s))
  = exp(-y**2 / (2s)) exp(-m**2 / (2s))``, that is ``N_Z(0, s)``.
* ``Bernoulli(exp(-x))`` for a dyadic ``x`` in ``[0, 1]``: for ``K = 1, 2,
  ...`` draw ``A_K = Bernoulli(x) * Bernoulli(1/K)`` until the first ``A_K =
  0``; the result is 1 if that ``K`` is odd. ``Bernoulli(x)`` compares uniform
  bits with the bits of ``x``; ``Bernoulli(1/K)`` is "a uniform digit in
  ``[0, K)`` is 0". For ``x > 1``: ``floor(x)`` trials of
  ``Bernoulli(exp(-1))``, stopping at the first failure, then
  ``Bernoulli(exp(-(x - floor(x))))``. ``(|Y| - m)**2`` has up to 62 bits: it is
  a pair of uint32 words, and ``floor(x)`` and the fraction are shifts of it.

**Digits.** ``Bernoulli(1/K), Bernoulli(1/(K+1)), ...`` come from one word
``w`` as the mixed-radix digits of ``floor(w P / 2**32)``, ``P = K (K+1) ...``,
and the word is rejected where ``w P mod 2**32 < 2**32 mod P`` (Lemire's
method): a value kept is exactly uniform in ``[0, P)``, so its digits are
independent and exactly uniform. A rejected word (probability below
``P / 2**32``) leaves the lane as it was.

**State machine.** One lane per output value, each in a phase: ``NEW`` (draw
``U`` and ``B``), ``U`` (the event ``exp(-U/t)``), ``V`` (count the
``exp(-1)`` successes), ``G`` (the acceptance: its ``exp(-1)`` trials, then its
fraction) or ``DONE``. Each iteration of one ``lax.while_loop`` draws one word
for every lane from ``fold_in(key, iteration)`` and takes one step of every
unfinished lane: it first moves on the lanes whose event ended in the previous
step, then spends the word on the lane's current event: ``U`` and ``B`` (for
``k <= 30`` also the bits of ``A_1``); up to five trials of an ``exp(-1)``
event; or one trial's bits or digit of an event with ``x < 1`` (both in one
word where ``x`` has at most 20 bits). A finished lane keeps its value. Once
at most an eighth of the lanes still run (and they are at least 1024), they
are gathered into an array of that size with a key of their own and finished
there, recursively (``_finish``): every step of a lane still spends a word
that no other step uses, so the law is unchanged.

**Cost.** A lane needs 7.4 (``k <= 30``) to 10.5 steps on average, but a loop
runs until the slowest of its lanes is done: about 70 to 130 iterations for
``10**6`` values in all, most of them on the gathered few. Several candidates
per lane and step (the first accepted of ``R``, in a fixed
order, keeps the law exact) would not pay: measured, they cut the iterations
by a factor of about ``R`` at best, for ``R`` times the work of a step.

**Range.** Every quantity is a uint32 or int32. ``V`` is kept below
``2**(31 - c)`` (``t = 2**c``), so ``X <= 2**31 - 1``: a candidate with one
more success is rejected, and so is one whose exponent's floor reaches
``2**32``. The output is therefore exactly ``N_Z(0, s)`` conditioned on
``|y| <= 2**31 - 1`` and ``(|y| - m)**2 < 2**(k+33)`` (see
:func:`discrete_gaussian` for the bound). The uint32 loop counter would wrap
only after ``2**32`` iterations, and ``K`` only in an event of more than
``2**29`` trials (probability below ``1/(2**29)!``); a lane still runs after
``t`` steps with a probability that decays geometrically in ``t`` (about
``0.83**t`` to ``0.89**t``), so neither happens in a run that ends.
"""

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from d3p import _validate
from d3p.random._common import mulhi_u32

__all__ = ["discrete_gaussian"]

#: Largest ``log2_variance`` accepted: ``sigma = 2**20``.
MAX_LOG2_VARIANCE = 40

# the phases of a lane
_NEW, _U, _V, _G, _DONE = range(5)

# an exp(-1) event takes up to this many trials A_K from one word
_RADICES = 5
# the product of one word's radices stays at most this (the first radix alone
# excepted), so a word is rejected with probability below 2**-20
_RADIX_CAP = 2**12
# a fraction x of at most this many bits shares its word with a 12-bit digit
_SHORT_BITS = 20
# flag in k_loop: the trial's bits equal x's first 32, its low bits are next
_TIE = 2**31
# k_loop just after an event ended (no position is 0)
_FAILED, _SUCCEEDED = 0, _TIE

_U32 = np.uint32


class _Scale(NamedTuple):
    """Static exponents: ``s = 2**k``, ``t = 2**c``, ``m = 2**f``."""

    k: int
    c: int
    f: int


def _scale(log2_variance: int) -> _Scale:
    return _Scale(log2_variance, (log2_variance + 1) // 2, log2_variance // 2)


class _Lanes(NamedTuple):
    """The state of every lane (flat arrays of one length).

    ``phase`` (int32): ``_NEW``, ``_U``, ``_V``, ``_G`` or ``_DONE``.
    ``k_loop`` (uint32): where the current ``Bernoulli(exp(-x))`` event is, 1
    at its start, ``_FAILED`` or ``_SUCCEEDED`` just after its end. For
    ``x = 1``: the last ``K`` drawn (``A_1 = 1`` needs no draw). For ``x < 1``:
    the position ``p`` in bits(A_1), digit(A_2), bits(A_2), digit(A_3), ...
    (``p`` odd: the bits of ``A_K``, ``K = (p+1)/2``; ``p`` even: the digit of
    ``A_K``, ``K = p/2 + 1``), plus ``_TIE``.
    ``count`` (uint32): ``V`` in phase ``_V``; in phase ``_G`` the ``exp(-1)``
    trials of the acceptance still to pass.
    ``u`` (uint32): ``U`` in the low bits, the sign ``B`` in bit 31.
    ``y`` (int32): the candidate from phase ``_G`` on; the output when ``_DONE``.
    """

    phase: jax.Array
    k_loop: jax.Array
    count: jax.Array
    u: jax.Array
    y: jax.Array


def _initial_lanes(n: int) -> _Lanes:
    ones, zeros = jnp.ones((n,), jnp.uint32), jnp.zeros((n,), jnp.uint32)
    return _Lanes(jnp.full((n,), _NEW, jnp.int32), ones, zeros, zeros, jnp.zeros((n,), jnp.int32))


# ---------------------------------------------------------------------------
# uniform digits and the acceptance's exponent


def _mul_small(a: jax.Array, r: jax.Array):
    """High and low words of ``a * r`` for uint32 ``a`` and ``r < 2**16``."""
    low = (a & _U32(0xFFFF)) * r
    high = (a >> _U32(16)) * r + (low >> _U32(16))
    return high >> _U32(16), (high << _U32(16)) | (low & _U32(0xFFFF))


def _mixed_radix(word: jax.Array, first: jax.Array, num_radices: int):
    """Uniform digits of radices ``first, first + 1, ...`` from one word.

    The digits of ``floor(word * P / 2**32)``, ``P = first (first + 1) ...``,
    most significant first (the word's fraction multiplied through one radix
    at a time); ``valid`` is False where ``word * P mod 2**32 < 2**32 mod P``
    (Lemire's method), elsewhere the digits are independent and exactly
    uniform.

    :param word: uint32 words, uniform.
    :param first: uint32 first radix ``>= 1`` per lane.
    :param int num_radices: at most this many radices: the first always, more
        while ``P`` stays within ``_RADIX_CAP``.
    :return: ``(valid, taken, digits)``; ``taken[i]`` whether radix ``i`` is
        used (a prefix of the radices).
    """
    taken = [jnp.ones(first.shape, bool)]
    product = first
    small = first < _U32(_RADIX_CAP)
    for i in range(1, num_radices):
        grown = product * (first + _U32(i))  # below 2**25 where it is kept: no wrap
        ok = taken[-1] & small & (grown <= _U32(_RADIX_CAP))
        product = jnp.where(ok, grown, product)
        taken.append(ok)
    digit, low = mulhi_u32(word, first)
    digits = [digit]
    for i in range(1, num_radices):
        digit, rest = _mul_small(low, first + _U32(i))  # radix below 2**16 where taken
        digits.append(digit)
        low = jnp.where(taken[i], rest, low)
    # the remainder depends on ``first`` alone (in a step, on k_loop alone):
    # XLA computes it apart, not inside the fused computation of the step
    valid = low >= (_U32(0) - product) % product  # 2**32 mod P
    return valid, taken, digits


def _short_digit(word: jax.Array, radix: jax.Array):
    """A uniform digit in ``[0, radix)`` from the low 12 bits of the word
    (Lemire's method on 12 bits, ``radix < 2**11``): ``(valid, digit)``."""
    product = (word & _U32(0xFFF)) * radix
    valid = (product & _U32(0xFFF)) >= (_U32(4096) - radix) % radix  # 2**12 mod radix
    return valid, product >> _U32(12)


def _acceptance_exponent(y: jax.Array, scale: _Scale):
    """``(|y| - m)**2 / 2**(k+1)`` for ``|y| <= 2**31 - 1``: its floor as uint32
    words ``(hi, lo)`` and its fraction as a 64-bit binary fraction ``(hi,
    lo)``, exactly (shifts of the 62-bit square)."""
    x = jnp.abs(y).astype(jnp.uint32)
    m = _U32(2**scale.f)
    d = jnp.where(x >= m, x - m, m - x)
    sq_hi, sq_lo = mulhi_u32(d, d)
    r = scale.k + 1  # 1 <= r <= 41
    if r < 32:
        floor_hi = sq_hi >> _U32(r)
        floor_lo = (sq_lo >> _U32(r)) | (sq_hi << _U32(32 - r))
    else:
        floor_hi = jnp.zeros_like(sq_hi)
        floor_lo = sq_hi >> _U32(r - 32)
    s = 64 - r  # the fraction is (square << s) mod 2**64
    if s >= 32:
        frac_hi, frac_lo = sq_lo << _U32(s - 32), jnp.zeros_like(sq_lo)
    else:
        frac_hi = (sq_hi << _U32(s)) | (sq_lo >> _U32(32 - s))
        frac_lo = sq_lo << _U32(s)
    return floor_hi, floor_lo, frac_hi, frac_lo


# ---------------------------------------------------------------------------
# one step of an event Bernoulli(exp(-x))


def _one_event(word: jax.Array, k_loop: jax.Array):
    """Trials of ``Bernoulli(exp(-1))`` from one word: ``A_K = Bernoulli(1/K)``
    for ``K = k_loop + 1, k_loop + 2, ...``. Returns ``(ended, k_next)``: where
    no trial was 0 the event goes on at ``k_next``; where it ended, ``k_next``
    is its last ``K``."""
    valid, taken, digits = _mixed_radix(word, k_loop + _U32(1), _RADICES)
    k_next = k_loop + sum(t.astype(jnp.uint32) for t in taken)
    ended = jnp.zeros(k_loop.shape, bool)
    for i in reversed(range(_RADICES)):
        stop = taken[i] & (digits[i] != _U32(0))
        k_next = jnp.where(stop, k_loop + _U32(i + 1), k_next)
        ended = ended | stop
    return valid & ended, jnp.where(valid, k_next, k_loop)


def _fraction_event(word, k_loop, x_hi, x_lo, short, scale: _Scale):
    """One step of ``Bernoulli(exp(-x))`` for ``x = (x_hi + x_lo / 2**32) /
    2**32 < 1`` at position ``k_loop`` (see ``_Lanes``).

    The digit or the bits of ``A_K`` each take a word; bits equal to ``x_hi``
    set ``_TIE``, and the next word's top bits are compared with ``x_lo`` (``x``
    has ``k + 1 - 32`` bits there for ``k >= 32``). Where ``short`` (``x`` has
    at most ``_SHORT_BITS`` bits) and ``K < 2**11``, one word gives both: the
    digit from its low 12 bits, the bits from its high 20. Returns ``(ended,
    k_next)``; where it ended, ``k_next`` is its last ``K``."""
    tie = k_loop >= _U32(_TIE)
    p = k_loop & _U32(_TIE - 1)
    radix = (p >> _U32(1)) + _U32(1)  # K of A_K
    on_bits = (p & _U32(1)) == _U32(1)
    valid, _, (digit,) = _mixed_radix(word, radix, 1)
    combined = short & (radix < _U32(2**11))
    short_valid, short_digit = _short_digit(word, radix)
    valid = on_bits | jnp.where(combined, short_valid, valid)
    hit = jnp.where(combined, short_digit, digit) == _U32(0)
    low_bits = scale.k + 1 - 32
    mask = _U32((0xFFFFFFFF << (32 - low_bits)) & 0xFFFFFFFF if low_bits > 0 else 0)
    bits_pass = jnp.where(
        combined,
        (word >> _U32(12)) < (x_hi >> _U32(12)),  # x has no bits below its 20 high ones
        jnp.where(tie, (word & mask) < x_lo, word < x_hi),
    )
    starts_tie = on_bits & ~tie & ~combined & (word == x_hi) & (x_lo != _U32(0))
    passed = jnp.where(on_bits, bits_pass, hit & (bits_pass | ~combined))
    ended = valid & ~passed & ~starts_tie
    step = jnp.where(combined & ~on_bits, _U32(2), _U32(1))
    k_next = jnp.where(starts_tie, k_loop | _U32(_TIE), jnp.where(passed, p + step, radix))
    return ended, jnp.where(valid, k_next, k_loop)


def _trial(lanes: _Lanes, word: jax.Array, scale: _Scale) -> jax.Array:
    """One step of each lane's current event with one word: the new
    ``k_loop``, ``_FAILED`` or ``_SUCCEEDED`` where the event ended (the last
    ``K`` is odd for a success)."""
    phase = lanes.phase
    x_is_one = (phase == _V) | ((phase == _G) & (lanes.count > _U32(0)))
    ended_one, next_one = _one_event(word, lanes.k_loop)
    # x < 1: U / t in phase _U, the acceptance's fraction in phase _G
    _, _, frac_hi, frac_lo = _acceptance_exponent(lanes.y, scale)
    in_u = phase == _U
    u_frac = (lanes.u << _U32(32 - scale.c)) if scale.c > 0 else jnp.zeros_like(lanes.u)
    x_hi = jnp.where(in_u, u_frac, frac_hi)
    x_lo = jnp.where(in_u, _U32(0), frac_lo)
    short = in_u | (scale.k + 1 <= _SHORT_BITS)
    ended_frac, next_frac = _fraction_event(word, lanes.k_loop, x_hi, x_lo, short, scale)
    ended = jnp.where(x_is_one, ended_one, ended_frac)
    k_next = jnp.where(x_is_one, next_one, next_frac)
    outcome = jnp.where((k_next & _U32(1)) == _U32(1), _U32(_SUCCEEDED), _U32(_FAILED))
    return jnp.where(ended, outcome, k_next)


# ---------------------------------------------------------------------------
# the lanes' phases


def _candidate(u: jax.Array, v: jax.Array, scale: _Scale):
    """``(rejected, Y)`` from ``U`` and the sign (packed in ``u``) and ``V``:
    ``X = U + t V`` (below ``2**31`` as ``V < 2**(31 - c)``), ``Y = -X`` for
    ``B = 1``, rejected for ``B = 1, X = 0``."""
    negative = (u >> _U32(31)) == _U32(1)
    x = ((u & _U32(2**31 - 1)) | (v << _U32(scale.c))).astype(jnp.int32)
    return negative & (x == 0), jnp.where(negative, -x, x)


def _settle(lanes: _Lanes, scale: _Scale) -> _Lanes:
    """Move on the lanes whose event has just ended (``k_loop`` is ``_FAILED``
    or ``_SUCCEEDED``); the others are unchanged."""
    phase, count, one = lanes.phase, lanes.count, _U32(1)
    success = lanes.k_loop == _U32(_SUCCEEDED)
    ended = success | (lanes.k_loop == _U32(_FAILED))
    # _U: on to counting V, or a new candidate
    to_v = ended & (phase == _U) & success
    # _V: one more success (beyond the int32 range: a new candidate), or Y is formed
    counted = ended & (phase == _V) & success
    overflow = counted & (count + one >= _U32(2 ** (31 - scale.c)))
    formed = ended & (phase == _V) & ~success
    sign_rejected, candidate = _candidate(lanes.u, count, scale)
    formed_ok = formed & ~sign_rejected
    y = jnp.where(formed_ok, candidate, lanes.y)
    # the acceptance counts its exp(-1) trials down from the exponent's floor
    floor_hi, floor_lo, _, _ = _acceptance_exponent(y, scale)
    too_far = formed_ok & (floor_hi > _U32(0))
    # _G: one more exp(-1) trial passed, or accepted by the fraction's event
    passed = ended & (phase == _G) & success & (count > _U32(0))
    accepted = ended & (phase == _G) & success & (count == _U32(0))
    restart = ended & ~(to_v | counted | formed | passed | accepted)
    restart = restart | overflow | (formed & sign_rejected) | too_far
    phase = jnp.where(to_v, _V, phase)
    phase = jnp.where(formed_ok, _G, phase)
    phase = jnp.where(accepted, _DONE, phase)
    phase = jnp.where(restart, _NEW, phase)
    count = jnp.where(counted, count + one, jnp.where(passed, count - one, count))
    count = jnp.where(to_v, _U32(0), jnp.where(formed_ok, floor_lo, count))
    return _Lanes(phase, jnp.where(ended, one, lanes.k_loop), count, lanes.u, y)


def _draw_u(word: jax.Array, scale: _Scale):
    """``U`` (the top ``c`` bits of the word) and the sign (bit 0), packed as
    in ``_Lanes.u``, and the ``k_loop`` that starts the event ``exp(-U/t)``.
    Where ``2c + 1 <= 32`` (``k <= 30``), bits 1 to ``c`` are the bits of
    ``A_1 = Bernoulli(U/t)``, and a failed ``A_1`` ends the event (``K = 1``: a
    success)."""
    if scale.c == 0:
        return word << _U32(31), _U32(_SUCCEEDED)  # U = 0: x = 0
    u = (word << _U32(31)) | (word >> _U32(32 - scale.c))
    if 2 * scale.c + 1 > 32:
        return u, _U32(1)
    bits = (word >> _U32(1)) & _U32(2**scale.c - 1)
    return u, jnp.where(bits < (word >> _U32(32 - scale.c)), _U32(2), _U32(_SUCCEEDED))


def _stopped(phase: jax.Array, stop: tuple) -> jax.Array:
    out = phase == _DONE
    for p in stop:
        out = out | (phase == p)
    return out


def _step(lanes: _Lanes, word: jax.Array, scale: _Scale, stop: tuple) -> _Lanes:
    """Every lane not ``_DONE`` (nor in a phase of ``stop``) takes one step
    with one uniform word: a ``_NEW`` lane draws ``U`` and the sign, any other
    lane steps its current event."""
    lanes = _settle(lanes, scale)
    # The event's step goes into k_loop alone, and the other fields move on
    # when the next step settles it: XLA computes elementwise work once for
    # each output that uses it, and settling is cheap.
    k_loop = _trial(lanes, word, scale)
    new = lanes.phase == _NEW
    u, first = _draw_u(word, scale)
    moved = lanes._replace(
        phase=jnp.where(new, _U, lanes.phase),
        k_loop=jnp.where(new, first, k_loop),
        u=jnp.where(new, u, lanes.u),
    )
    frozen = _stopped(lanes.phase, stop)
    return jax.tree.map(lambda old, now: jnp.where(frozen, old, now), lanes, moved)


def _run(key, lanes: _Lanes, scale: _Scale, rng_suite, stop: tuple = (), limit: int = 0):
    """Step all lanes until at most ``limit`` of them are not ``_DONE`` (nor in
    a phase of ``stop``); returns the lanes and the number of iterations (one
    word per lane each)."""
    n = lanes.y.shape[0]

    def running(carry):
        return jnp.sum(~_stopped(_settle(carry[1], scale).phase, stop)) > limit

    def advance(carry):
        iteration, state = carry
        word = rng_suite.random_bits(rng_suite.fold_in(key, iteration), 32, (n,))
        return iteration + _U32(1), _step(state, word, scale, stop)

    iterations, lanes = lax.while_loop(running, advance, (jnp.zeros((), jnp.uint32), lanes))
    return _settle(lanes, scale), iterations


#: Lanes are compacted once at most 1/_SHRINK of them are still running ...
_SHRINK = 8
#: ... while that many are at least this many lanes.
_MIN_COMPACT = 1024
#: The words of compaction level j >= 1 come from fold_in(fold_in(key, _LEVELS), j):
#: the first level's words use fold_in(key, i) for iterations i < 2**32 - 1.
_LEVELS = 2**32 - 1


def _finish(key, lanes: _Lanes, scale: _Scale, rng_suite, level: int):
    """Run ``lanes`` to the end; ``(y, iterations)``.

    Once at most ``1/_SHRINK`` of the lanes still run, those are gathered into
    an array of that size and finished there (recursively), so that the long
    tail of the slowest lanes no longer steps every lane. The law is unchanged:
    whatever array a lane sits in, each of its steps draws a word used by no
    other step (each level has its own key), so every lane's steps still see
    fresh independent uniform words, and the lanes stay independent.
    """
    n = lanes.y.shape[0]
    key_j = key if level == 0 else rng_suite.fold_in(rng_suite.fold_in(key, _LEVELS), level)
    sub = n // _SHRINK
    if sub < _MIN_COMPACT:
        lanes, iterations = _run(key_j, lanes, scale, rng_suite)
        return lanes.y, iterations
    lanes, iterations = _run(key_j, lanes, scale, rng_suite, limit=sub)
    # the running lanes (at most `sub`), padded with lane n: a finished one
    idx = jnp.nonzero(lanes.phase != _DONE, size=sub, fill_value=n)[0]
    done = _Lanes(*(jnp.full((1,), v, a.dtype) for v, a in zip((_DONE, 1, 0, 0, 0), lanes)))
    padded = _Lanes(*(jnp.concatenate([a, b]) for a, b in zip(lanes, done)))
    y_sub, more = _finish(key, _Lanes(*(a[idx] for a in padded)), scale, rng_suite, level + 1)
    return lanes.y.at[idx].set(y_sub, mode="drop"), iterations + more


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _sample(key, n: int, scale: _Scale, rng_suite):
    """``n`` samples (int32) and the number of iterations it took (summed over
    the compaction levels)."""
    return _finish(key, _initial_lanes(n), scale, rng_suite, 0)


# ---------------------------------------------------------------------------
# the parts on their own, for tests


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _laplace_candidates(key, n: int, log2_variance: int, rng_suite) -> jax.Array:
    """``n`` candidates ``Y`` (discrete Laplace of scale ``t``): each lane
    stops when it has formed one."""
    lanes, _ = _run(key, _initial_lanes(n), _scale(log2_variance), rng_suite, stop=(_G,))
    return lanes.y


@functools.partial(jax.jit, static_argnums=(2, 3))
def _acceptances(key, y: jax.Array, log2_variance: int, rng_suite) -> jax.Array:
    """The acceptance of each candidate ``y`` (int32, ``(|y| - m)**2 <
    2**(k+33)``): ``Bernoulli(exp(-(|y| - m)**2 / 2**(k+1)))`` as booleans."""
    scale = _scale(log2_variance)
    y = y.astype(jnp.int32)
    _, floor_lo, _, _ = _acceptance_exponent(y, scale)
    ones = jnp.ones(y.shape, jnp.uint32)
    lanes = _Lanes(jnp.full(y.shape, _G, jnp.int32), ones, floor_lo, ones - ones, y)
    lanes, _ = _run(key, lanes, scale, rng_suite, stop=(_NEW,))
    return lanes.phase == _DONE


# ---------------------------------------------------------------------------
# the sampler


def _validated_shape(shape) -> tuple:
    if not isinstance(shape, (tuple, list)):
        raise _validate.InvalidArgumentType(
            f"Expected shape to be a tuple of non-negative integers, got shape={shape!r}."
        )
    return tuple(_validate.integer(f"shape[{i}]", s, minimum=0) for i, s in enumerate(shape))


def discrete_gaussian(key: jax.Array, shape: Sequence[int], log2_variance: int, rng_suite=None) -> jax.Array:
    """Independent samples of the discrete Gaussian ``N_Z(0, 2**log2_variance)``.

    ``P(y)`` is proportional to ``exp(-y**2 / (2 s))`` on the integers, with
    ``s = 2**log2_variance`` (``sigma**2``; the variance of the law is
    slightly below ``s`` for small ``s``). The samples are computed exactly
    from the suite's uniform 32-bit words with uint32/int32 operations only
    (see :mod:`d3p.random.discrete` for the method). Works under ``jit`` with
    ``shape`` and ``log2_variance`` static.

    :param key: a key of ``rng_suite``.
    :param shape: the output shape, a tuple of non-negative integers.
    :param int log2_variance: ``k`` in ``[0, 40]``: ``s = 2**k``, ``sigma``
        from 1 to ``2**20``.
    :param rng_suite: the PRNG suite of ``key``: ``None`` (default) is
        :mod:`d3p.random` (ChaCha20); :mod:`d3p.random.debug` for debugging.
    :return: an ``int32`` array of ``shape``.

    **Formal guarantees.** If the suite's words are uniform, each value is
    exactly ``N_Z(0, s)`` conditioned on the set ``A`` of ``|y| <= 2**31 - 1``
    (so that ``y`` and ``-y`` are int32) with ``(|y| - m)**2 < 2**(k+33)``,
    ``m = 2**floor(k/2)``; candidates outside ``A`` are rejected and redrawn,
    never wrapped. ``A`` misses probability ``P(|y| >= a) <= exp(-(a - 1)**2 /
    (2s))`` (the normaliser is at least ``sqrt(2 pi s)``, the sum beyond ``a``
    at most the Gaussian integral beyond ``a - 1``): with ``a = 2**31`` and
    ``a = m + 2**((k+33)/2)``, below ``exp(-(2**31 - 1)**2 / 2**(k+1)) +
    exp(-2**32)``, that is below ``exp(-2**21 + 1)`` for every ``k <= 40``.
    This is the total variation distance to ``N_Z(0, s)``. The values are
    independent of each other, the same key gives the same values, and the
    loop runs until every value is accepted (there is no iteration cap). As
    privacy noise on an integer sum of sensitivity ``Delta`` it is the
    discrete Gaussian mechanism (``Delta**2 / (2s)``-zCDP) as far as ``key``
    is secret and the suite's words are indistinguishable from uniform: true
    of ChaCha20 (:mod:`d3p.random`), not of :mod:`d3p.random.debug`.

    >>> import d3p.random
    >>> y = d3p.random.discrete_gaussian(d3p.random.PRNGKey(0), (2, 3), 10)
    >>> y.shape, y.dtype
    ((2, 3), dtype('int32'))
    """
    shape = _validated_shape(shape)
    log2_variance = _validate.integer("log2_variance", log2_variance, minimum=0, maximum=MAX_LOG2_VARIANCE)
    if rng_suite is None:
        import d3p.random as rng_suite  # here, as d3p.random imports this module
    rng_suite = _validate.rng_suite("rng_suite", rng_suite)
    n = int(np.prod(shape, dtype=np.int64))
    if n == 0:
        return jnp.zeros(shape, jnp.int32)
    y, _ = _sample(key, n, _scale(log2_variance), rng_suite)
    return y.reshape(shape)
