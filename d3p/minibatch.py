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

**Where the words come from.** A batch's words are independent streams of
its key (:func:`d3p.random.stream_words`): a Poisson batch's count takes two
words of stream 0 and its blocks of candidates streams 1, 2, ...; a
fixed-size batch's blocks streams 0, 1, ... Where one block of candidates
suffices, all of a batch's words come from one call of ChaCha20's block
function (a compiled sampler holds one block-function loop, where a key
split and a key per block took four or five; each compiled in its own
right). Batch ``i`` of a run or of ``get_batch`` is the batch of
``fold_in(key, i)``.

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

**Modules.** This module is the public face; the code lives in private
modules that import each other in one direction only: ``d3p._uniform_draws``
(the exact draws and their loop bounds) < ``d3p._samplers`` (the samplers,
their failure handling, the binomial batch size, the Feistel permutation) <
``d3p._batchify`` (the d3p 0.2 ``(init, get_batch)`` interface).
"""

from d3p import _sampling, _samplers, _uniform_draws

# The private names below are imported from this module by d3p._run, d3p.svi,
# benchmarks and tests.
from d3p._batchify import (  # noqa: F401
    BatchifyState,
    Dataset,
    batch_size_to_q,
    poisson_batchify_data,
    q_to_batch_size,
    split_batchify_data,
    subsample_batchify_data,
    take_batch,
)
from d3p._samplers import (  # noqa: F401
    DEFAULT_FEISTEL_ROUNDS,
    MAX_NUM_RECORDS,
    FixedSizeSampler,
    PoissonSampler,
    Sampler,
    SamplingError,
    WithReplacementSampler,
    _binomial_thresholds,
    _draw_checked,
    _failure_message,
    _require,
    _sample_batch_jit,
    _sample_jit,
    feistel_permutation,
    poisson_max_batch_size,
    poisson_overflow_delta,
    poisson_overflow_probability,
)
from d3p._uniform_draws import (  # noqa: F401
    _SENTINEL,
    _acceptance_probability,
    _distinct_uniform,
    _distinct_uniform_max_iterations,
    _draw_block_size,
    _first_occurrences,
    _single_pass_draws,
    _uniform_below,
    _uniform_indices_max_iterations,
    mulhi_u32,
)

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
DEFAULT_OVERFLOW_PROBABILITY = _samplers.DEFAULT_OVERFLOW_PROBABILITY

#: Per batch, the probability (given ideal random bits) that a sampler's loop
#: reaches its iteration bound; a batch that reaches it is never used (see
#: :class:`SamplingError`).
LOOP_FAILURE_PROBABILITY = _uniform_draws.LOOP_FAILURE_PROBABILITY
