"""Tests of how the samplers compute their batches: the duplicate search and
the compiled draw as a GPU gets it (no host callback, no loop where N is well
above B).

The samplers' output is pinned to a plain sequential reference: for the same
keystream words, Lemire's rejection and "keep a value the first time it is
seen, in draw order" written as a Python loop. The statistical tests of the
distribution itself are in test_minibatch_uniformity.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import d3p.random
from d3p import minibatch
from d3p.minibatch import FixedSizeSampler, PoissonSampler

import _lowered
from _backend import cpu_default

SENTINEL = 2**31 - 1


def _first_occurrences_reference(pool):
    seen, out = set(), []
    for v in pool.tolist():
        out.append(v != SENTINEL and v not in seen)
        seen.add(v)
    return np.array(out)


def _pool(rng, size, num_records, distinct):
    """A pool with many repeats (values from ``distinct`` choices) and some sentinels."""
    choices = rng.choice(num_records, size=min(distinct, num_records), replace=False)
    pool = rng.choice(choices, size=size)
    pool[rng.random(size) < 0.2] = SENTINEL
    return pool.astype(np.int32)


# (pool size, N): packed words where bits(N) + bits(size - 1) <= 32, and both sides
# of that border; the general search (binary search and scatter-min) above it
@pytest.mark.parametrize("size,num_records", [
    (1, 5), (2, 2), (7, 3), (300, 1000), (2048, 2**21 - 1), (2049, 2**21 - 1), (2048, 2**21),
    (513, 2**31 - 1), (1000, 10**7),
])
def test_first_occurrences_is_the_first_of_each_value_in_pool_order(size, num_records):
    rng = np.random.default_rng(size + num_records)
    packed = num_records.bit_length() + max((size - 1).bit_length(), 1) <= 32
    assert packed == ((size, num_records) in [(1, 5), (2, 2), (7, 3), (300, 1000), (2048, 2**21 - 1)])
    fn = jax.jit(lambda p: minibatch._first_occurrences(p, num_records))
    for distinct in (3, size // 2 + 1, 10 * size):
        pool = _pool(rng, size, num_records, distinct)
        np.testing.assert_array_equal(np.asarray(fn(pool)), _first_occurrences_reference(pool))
    # extreme values: 0, N - 1 next to the sentinel
    pool = np.array(([0, num_records - 1, SENTINEL, num_records - 1, 0] * size)[:size], np.int32)
    np.testing.assert_array_equal(np.asarray(fn(pool)), _first_occurrences_reference(pool))


def _distinct_uniform_reference(rng_key, num, num_records):
    """The first ``num`` distinct accepted values, block t of words stream t of (key, 0)
    (``d3p.random.stream_words``, checked against the block function in test_random_host_blocks.py)."""
    single = minibatch._single_pass_draws(num, num_records)
    block = minibatch._draw_block_size(num, num_records) if single is None else single
    max_blocks = 1 if single is not None else minibatch._distinct_uniform_max_iterations(num, num_records, block)
    words_of = jax.jit(lambda k, t: d3p.random.stream_words(k, 0, (block,), t)[0])
    found, seen = [], set()
    for t in range(max_blocks):
        words = np.asarray(words_of(rng_key, jnp.uint32(t)), np.uint64)
        for w in words.tolist():
            product = w * num_records
            if product % 2**32 < 2**32 % num_records:  # Lemire's rejection
                continue
            value = product >> 32
            if value not in seen and len(found) < num:
                seen.add(value)
                found.append(value)
        if len(found) == num:
            break
    return found


# single pass with packed words (N = 1e6), single pass with the general search
# (N = 1e7, B = 1024), the loop over blocks (B close to N), tiny N
@pytest.mark.parametrize("num_records,num", [
    (10**6, 1024), pytest.param(10**7, 1024, marks=pytest.mark.slow), (50, 50),
    pytest.param(20, 13, marks=pytest.mark.slow), pytest.param(3, 1, marks=pytest.mark.slow),
])
def test_distinct_uniform_is_the_sequential_first_distinct_draws(num_records, num):
    fn = jax.jit(lambda k: minibatch._distinct_uniform(k, num, num_records, d3p.random))
    for seed in range(2):
        key = d3p.random.PRNGKey(seed)
        indices, ok = fn(key)
        assert bool(ok)
        assert np.asarray(indices).tolist() == _distinct_uniform_reference(key, num, num_records)


# ----------------------------------------------------------------------------
# the compiled draw as a GPU gets it (lowered for CUDA, no GPU needed)


def _lowered_for_cuda(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("sampler,loops", [
    (FixedSizeSampler(10**6, 1024), 0),
    (FixedSizeSampler(10**7, 1024), 0),  # the general duplicate search: binary search written out
    (PoissonSampler(10**6, 1024 / 10**6), 0),
    (FixedSizeSampler(50, 50), 1),
    (minibatch.WithReplacementSampler(100, 10), 1),
], ids=["fixed", "fixed-large-N", "poisson", "fixed-all", "with-replacement"])
def test_sample_under_jit_lowered_for_cuda_has_no_host_callback(sampler, loops):
    key = d3p.random.PRNGKey(0)
    text = _lowered_for_cuda(lambda k: sampler.sample(k), key)
    assert "callback" not in text and "custom_call" not in text
    assert _lowered.other_loops(text) == loops   # besides ChaCha20's over its double rounds
    # get_batch under jit too
    init, get_batch = minibatch.subsample_batchify_data(jnp.zeros((1000, 2)), batch_size=8)
    _, state = init(key)
    text = _lowered_for_cuda(get_batch, 3, state)
    assert "callback" not in text and "custom_call" not in text


@cpu_default
def test_the_cuda_check_has_power():
    # a host callback in a jitted function does show in the lowered text
    def with_callback(k):
        return jax.pure_callback(lambda x: x, jax.ShapeDtypeStruct((8,), jnp.uint32), k)

    text = jax.jit(with_callback).trace(d3p.random.PRNGKey(0)).lower(lowering_platforms=("cpu",)).as_text()
    assert "callback" in text or "custom_call" in text
