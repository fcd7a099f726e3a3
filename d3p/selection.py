# SPDX-License-Identifier: Apache-2.0
"""Private selection: the exponential mechanism.

:func:`exponential_mechanism` picks one of K candidates with probability
proportional to ``exp(ε u_k / (2 Δu))``, where ``u`` are the candidates'
scores computed from the private data and ``Δu`` bounds how much any score
can change between neighbouring data sets (McSherry & Talwar 2007). It is the
one place in d3p where a private choice among candidates is drawn; Gaussian
noise is drawn in :func:`d3p.gradients.add_gaussian_noise` (and, in float64 on
the host, by :func:`d3p.random.normal_float64`).

Its privacy in zero-concentrated DP, ε²/8, is
:func:`d3p.accounting.exponential_rho` (the mechanism is ε-bounded range:
Cesar & Rogers 2021, Durfee & Rogers 2019).
"""

from __future__ import annotations

import functools
import math

import jax
import numpy as np

import d3p.random
from d3p import _validate

__all__ = ["exponential_mechanism", "selection_probabilities"]


def selection_probabilities(scores, sensitivity: float, epsilon: float) -> np.ndarray:
    """The probabilities of :func:`exponential_mechanism`:
    ``exp(ε u_k / (2 Δu)) / Σ_j exp(ε u_j / (2 Δu))`` (float64; ``epsilon=inf``
    puts equal mass on the best scores).

    :param scores: the candidates' scores ``u`` (finite), higher is better.
    :param float sensitivity: Δu > 0.
    :param float epsilon: ε > 0 (``inf``: no privacy, the best candidate).
    """
    u = np.asarray(scores, np.float64).ravel()
    if u.size == 0 or not np.all(np.isfinite(u)):
        raise ValueError(f"Expected a non-empty vector of finite scores, got scores={scores!r}.")
    sensitivity = _validate.positive("sensitivity", sensitivity)
    epsilon = _validate.positive("epsilon", epsilon, finite=False)
    if math.isinf(epsilon):
        best = u == u.max()
        return best / best.sum()
    logits = epsilon * (u - u.max()) / (2.0 * sensitivity)
    p = np.exp(logits)
    return p / p.sum()


@functools.lru_cache(maxsize=None)
def _two_words(rng_suite):
    """The suite's ``random_bits(key, 32, (2,))``, compiled once per suite."""
    return jax.jit(lambda key: rng_suite.random_bits(key, 32, (2,)))


def _unit_uniform(rng_key, rng_suite) -> float:
    """A uniform value in [0, 1) with 53 random bits (two 32-bit words of the suite)."""
    words = np.asarray(jax.device_get(_two_words(rng_suite)(rng_key)), np.uint64)
    return float(((int(words[0]) << 21) | (int(words[1]) >> 11)) * 2.0 ** -53)


def exponential_mechanism(rng_key, scores, *, sensitivity: float, epsilon: float,
                          rng_suite=d3p.random) -> int:
    """Index of the candidate chosen by the exponential mechanism.

    :param rng_key: a key of ``rng_suite`` (required: the choice is random).
    :param scores: the candidates' scores ``u`` computed from the private data
        (higher is better).
    :param float sensitivity: Δu: the largest change of any score between
        neighbouring data sets (under the relation the caller claims), as the
        scores are computed: in floating point, it must cover their rounding
        (compute them in float64 from exact counts and add a bound of the
        rounding, as ``d3p.twin.marginal._scores`` does).
    :param float epsilon: ε > 0 of the selection (``inf``: the best score, no
        privacy).
    :param rng_suite: ``d3p.random`` (ChaCha20, default) or ``d3p.random.debug``.
    :return: the chosen index.

    **Formal guarantees.** If no score changes by more than ``sensitivity``
    between neighbouring data sets, the returned index is ε-DP and ε²/8-zCDP
    (ε-bounded range; Cesar & Rogers 2021, Lemma 3.2) under that relation,
    up to floating point: the probabilities are computed in float64 and the
    index is the inverse CDF at a uniform with 53 random bits, so a candidate
    has probability 0 only if its exact probability is below about 2⁻⁵³ times
    the number of candidates. The scores themselves are not released.

    >>> import d3p.random
    >>> from d3p.selection import exponential_mechanism
    >>> exponential_mechanism(d3p.random.PRNGKey(0), [0.0, 100.0, 0.0], sensitivity=1.0, epsilon=1.0)
    1
    """
    if rng_key is None:
        raise ValueError("Expected an explicit rng_key for the exponential mechanism, got rng_key=None.")
    p = selection_probabilities(scores, sensitivity, epsilon)
    cum = np.cumsum(p)
    u = _unit_uniform(rng_key, rng_suite) * cum[-1]
    return int(min(np.searchsorted(cum, u, side="right"), p.size - 1))
