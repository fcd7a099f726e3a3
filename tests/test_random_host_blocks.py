"""Key derivations outside a traced program are computed on the host and compile nothing.

``split``, ``fold_in`` and ``convert_to_jax_rng_key`` of :mod:`d3p.random`,
called on concrete keys (a run's set-up), take the block function from NumPy
(:func:`d3p.random._keystream._blocks_host`) instead of compiling a program
per shape (issue "Compile once", item 4). The words must be those of every
other branch and of RFC 8439, and traced, vmapped or committed keys must keep
the compiled path.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import d3p.random
from d3p import _run
from d3p.random import _keystream
from d3p.random import _common
from d3p.random._common import unstacked

from _backend import traced_programs
from _lowered import lowered_text, other_loops, round_loops

# RFC 8439, section 2.3.2: key 00 01 .. 1f, counter 1, nonce 00:00:00:09:00:00:00:4a:00:00:00:00
_RFC_KEY = np.frombuffer(bytes(range(32)), dtype="<u4").astype(np.uint32)
_RFC_NONCE = np.frombuffer(bytes.fromhex("000000090000004a00000000"), dtype="<u4").astype(np.uint32)
_RFC_BLOCK = np.array([
    0xe4e7f110, 0x15593bd1, 0x1fdd0f50, 0xc47120a3, 0xc7f4d1c7, 0x0368c033, 0x9aaa2204, 0x4e6cd4c3,
    0x466482d2, 0x09aa9f07, 0x05d7c214, 0xa2028bd9, 0xd19c12b5, 0xb94e16de, 0xe883d0cb, 0x4e3c50a2,
], dtype=np.uint32)


def _compiled_blocks(key, counter, nonce):
    """The compiled block function of this backend (the path a traced program takes)."""
    return np.asarray(jax.jit(lambda k, c, n: _keystream.chacha20_block(k, c, n))(key, counter, tuple(nonce)))


def test_the_host_block_function_is_rfc_8439s():
    # the RFC serialises the state words little-endian; these are the words
    block = _keystream._blocks_host(_RFC_KEY, np.uint32(1), tuple(_RFC_NONCE))
    np.testing.assert_array_equal(block, _RFC_BLOCK)
    words = np.asarray(_keystream.block_words(_RFC_KEY, np.uint32(1), tuple(_RFC_NONCE)))
    np.testing.assert_array_equal(words, _RFC_BLOCK)


@pytest.mark.parametrize("shape", [(), (1,), (5,), (3, 4), (0,), (64,)])
def test_the_host_block_function_equals_the_compiled_ones(shape):
    rng = np.random.default_rng(sum(shape) + len(shape))
    key = rng.integers(0, 2**32, 8, dtype=np.uint32)
    counter = rng.integers(0, 2**32, shape, dtype=np.uint32)
    if counter.size:
        counter.reshape(-1)[0] = 0xFFFFFFFF   # the 32-bit counter at its largest
    nonce = (np.uint32(7), rng.integers(0, 2**32, shape[-1:], dtype=np.uint32), np.uint32(0xFFFFFFFF))
    host = _keystream._blocks_host(key, counter, nonce)
    assert host.shape == shape + (16,) and host.dtype == np.uint32
    np.testing.assert_array_equal(host, _compiled_blocks(key, counter, nonce))
    # both compiled branches, whichever this backend lowers
    np.testing.assert_array_equal(host, np.asarray(_keystream._blocks_cpu(key, counter, nonce)))
    np.testing.assert_array_equal(host, np.asarray(_keystream._blocks_vectorised(key, counter, nonce)))


def test_derivations_on_the_host_equal_the_traced_ones():
    suite = d3p.random
    for seed in (0, 1, 2**255 + 12345):
        key = suite.PRNGKey(seed)
        np.testing.assert_array_equal(suite.split(key, 5), jax.jit(lambda k: suite.split(k, 5))(key))
        for data in (0, 1, 2**32 - 1):
            traced = jax.jit(suite.fold_in)(key, jnp.asarray(np.uint32(data)))
            np.testing.assert_array_equal(suite.fold_in(key, data), traced)
        for data in (np.uint32(77), np.array(-1, np.int32), np.array([3, 4, -5], np.int64)):
            np.testing.assert_array_equal(suite.fold_in(key, data), jax.jit(suite.fold_in)(key, data))
        np.testing.assert_array_equal(suite.convert_to_jax_rng_key(key),
                                      jax.jit(suite.convert_to_jax_rng_key)(key))
    # a wrapped negative integer is the same word as on the compiled path
    key = suite.PRNGKey(9)
    np.testing.assert_array_equal(suite.fold_in(key, np.array(-1, np.int64)), suite.fold_in(key, 2**32 - 1))


def test_a_runs_key_derivations_compile_nothing():
    key = d3p.random.PRNGKey(4)
    (init_key, batch_key, step_key), traced = traced_programs(lambda: _run.step_keys(d3p.random, key))
    assert traced == 0
    jax_key, traced = traced_programs(lambda: d3p.random.convert_to_jax_rng_key(init_key))
    assert traced == 0
    # the same keys as the compiled derivations give
    split = jax.jit(lambda k: d3p.random.split(k, 2))(key)
    np.testing.assert_array_equal(init_key, split[0])
    np.testing.assert_array_equal(batch_key, split[1])
    np.testing.assert_array_equal(step_key, jax.jit(d3p.random.fold_in)(split[0], jnp.uint32(1)))
    assert all(isinstance(k, jax.Array) and k.dtype == jnp.uint32 and k.shape == (8,)
               for k in (init_key, batch_key, step_key, ))


def test_traced_vmapped_committed_and_large_derivations_keep_the_compiled_path(monkeypatch):
    calls = []
    host = _keystream._blocks_host
    monkeypatch.setattr(_keystream, "_blocks_host", lambda *a: calls.append(1) or host(*a))
    key = d3p.random.PRNGKey(5)
    keys = d3p.random.split(key, 3)
    assert len(calls) == 1
    jax.jit(lambda k: d3p.random.fold_in(k, 2))(key)
    jax.vmap(lambda k: d3p.random.split(k, 2))(keys)
    committed = jax.device_put(key, jax.devices()[0])
    out = d3p.random.fold_in(committed, 3)
    assert out.committed and out.devices() == committed.devices()
    d3p.random.split(key, _keystream.HOST_EAGER_MAX_BLOCKS + 1)
    assert len(calls) == 1
    np.testing.assert_array_equal(out, d3p.random.fold_in(key, 3))


def test_unstacked_gives_the_rows():
    keys = d3p.random.split(d3p.random.PRNGKey(6), 3)
    rows, traced = traced_programs(lambda: unstacked(keys))
    assert traced == 0 and len(rows) == 3
    for row, expected in zip(rows, np.asarray(keys)):
        assert isinstance(row, jax.Array)
        np.testing.assert_array_equal(row, expected)
    assert len(jax.jit(lambda k: jnp.stack(unstacked(k)))(keys)) == 3


# ---------------------------------------------------------------- a step's keys in one call


@pytest.mark.parametrize("num", [1, 2, 3])
@pytest.mark.parametrize("where", ["host", "traced"])
def test_split_with_jax_key_gives_the_keys_of_split_and_convert_to_jax_rng_key(num, where):
    key = d3p.random.PRNGKey(31 + num)
    if where == "host":
        keys, jax_key = d3p.random.split_with_jax_key(key, num)
    else:
        keys, jax_key = jax.jit(d3p.random.split_with_jax_key, static_argnums=1)(key, num)
    np.testing.assert_array_equal(np.asarray(keys), np.asarray(d3p.random.split(key, num)))
    np.testing.assert_array_equal(np.asarray(jax_key), np.asarray(d3p.random.convert_to_jax_rng_key(key)))
    assert jax_key.shape == jax.random.PRNGKey(0).shape and jax_key.dtype == jnp.uint32
    with pytest.raises(ValueError, match="num >= 1"):
        d3p.random.split_with_jax_key(key, 0)


def test_split_with_jax_key_and_keys_are_one_block_function_call(monkeypatch):
    calls = []
    real = _keystream.chacha20_block

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(_keystream, "chacha20_block", counted)
    jax.jit(lambda k: d3p.random.split_with_jax_key(k, 3)).trace(d3p.random.PRNGKey(0))   # a fresh trace
    assert len(calls) == 1
    calls.clear()
    jax.jit(lambda k: d3p.random.split_with_jax_keys(k, 3, 129)).trace(d3p.random.PRNGKey(0))
    assert len(calls) == 1
    # power: the two functions it stands for are two calls
    calls.clear()
    jax.jit(lambda k: (d3p.random.split(k, 3), d3p.random.convert_to_jax_rng_key(k))).trace(d3p.random.PRNGKey(0))
    assert len(calls) == 2


@pytest.mark.parametrize("count", [1, 8, 9, 17, 257])
@pytest.mark.parametrize("where", ["host", "traced"])
def test_split_with_jax_keys_gives_split_and_the_keystream_of_convert_to_jax_rng_key(count, where):
    """The JAX keys are the words of the keystream under nonce (3, 0, 0), block
    counters 0, 1, ... (the host block function, RFC 8439's), two words a key:
    the first is convert_to_jax_rng_key's, and past 8 keys a second block."""
    key = d3p.random.PRNGKey(40 + count)
    if where == "host":
        keys, jax_keys = d3p.random.split_with_jax_keys(key, 3, count)
    else:
        keys, jax_keys = jax.jit(d3p.random.split_with_jax_keys, static_argnums=(1, 2))(key, 3, count)
    blocks = _keystream._blocks_host(np.asarray(key), np.arange(-(-2 * count // 16), dtype=np.uint32),
                                     (np.uint32(3), np.uint32(0), np.uint32(0)))
    np.testing.assert_array_equal(np.asarray(jax_keys), blocks.reshape(-1)[:2 * count].reshape(count, 2))
    np.testing.assert_array_equal(np.asarray(jax_keys[0]), np.asarray(d3p.random.convert_to_jax_rng_key(key)))
    np.testing.assert_array_equal(np.asarray(keys), np.asarray(d3p.random.split(key, 3)))
    assert jax_keys.dtype == jnp.uint32 and len({tuple(k) for k in np.asarray(jax_keys)}) == count
    with pytest.raises(ValueError, match="count >= 1"):
        d3p.random.split_with_jax_keys(key, 3, 0)
    with pytest.raises(ValueError, match="num >= 1"):
        d3p.random.split_with_jax_keys(key, 0, 2)


def test_a_steps_keys_are_one_block_at_a_time_on_cpu():
    """For a step's keys (256 records: 33 blocks and the step's own) the CPU
    block function loops over single blocks, which compiles in about half the
    time of rounds vectorised over the blocks (tests/_lowered.py: a loop
    other than the double rounds'); a long keystream keeps the vectorised
    rounds."""
    key = d3p.random.PRNGKey(0)
    keys_text = lowered_text(lambda k: d3p.random.split_with_jax_keys(k, 2, 257), key, platform="cpu")
    assert round_loops(keys_text) == 1 and other_loops(keys_text) == 1
    blocks_text = lowered_text(lambda k: _keystream.chacha20_block(k, jnp.arange(35, dtype=jnp.uint32), (1, 0, 0)),
                               key, platform="cpu")
    assert round_loops(blocks_text) == 1 and other_loops(blocks_text) == 0


@pytest.mark.filterwarnings("ignore::d3p.random.debug.DebugRNGWarning")
@pytest.mark.parametrize("typed", [False, True])
def test_the_debug_suites_split_with_jax_keys_splits_its_jax_key(typed):
    key = jax.random.key(6) if typed else d3p.random.debug.PRNGKey(6)
    keys, jax_keys = d3p.random.debug.split_with_jax_keys(key, 2, 5)
    parent = jax.random.split(key, 3)
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(keys) if typed else keys),
                                  np.asarray(jax.random.key_data(parent[:2]) if typed else parent[:2]))
    want = jax.random.split(parent[2], 5)
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(jax_keys) if typed else jax_keys),
                                  np.asarray(jax.random.key_data(want) if typed else want))
    with pytest.raises(ValueError, match="count >= 1"):
        d3p.random.debug.split_with_jax_keys(key, 2, 0)


def test_the_debug_suites_split_with_jax_key_is_jax_splitting_once_more():
    key = d3p.random.debug.PRNGKey(5)
    keys, jax_key = d3p.random.debug.split_with_jax_key(key, 2)
    np.testing.assert_array_equal(np.asarray(keys), np.asarray(jax.random.split(key, 3)[:2]))
    np.testing.assert_array_equal(np.asarray(jax_key), np.asarray(jax.random.split(key, 3)[2]))


# ---------------------------------------------------------------- a batch's words in one call


def _stream_reference(key, data, count, j):
    """Stream ``j`` of ``(key, data)`` from the host block function: nonce (5, data, j), counters 0, 1, ..."""
    blocks = _keystream._blocks_host(np.asarray(key), np.arange(-(-count // 16), dtype=np.uint32),
                                     (np.uint32(5), np.uint32(data), np.uint32(j)))
    return blocks.reshape(-1)[:count]


@pytest.mark.parametrize("where", ["host", "traced"])
def test_stream_words_are_the_keystreams_of_their_nonces(where):
    key = d3p.random.PRNGKey(7)
    counts, data, first = (2, 40, 16, 1), 12, 3
    if where == "host":
        streams = d3p.random.stream_words(key, data, counts, first)
    else:
        streams = jax.jit(lambda k, d, f: d3p.random.stream_words(k, d, counts, f))(
            key, jnp.uint32(data), jnp.uint32(first))
    assert [s.shape for s in streams] == [(c,) for c in counts]
    for j, (s, c) in enumerate(zip(streams, counts)):
        np.testing.assert_array_equal(np.asarray(s), _stream_reference(key, data, c, first + j))
    # another batch or stream is another keystream
    assert not np.array_equal(_stream_reference(key, data, 16, 0), _stream_reference(key, data + 1, 16, 0))
    assert not np.array_equal(_stream_reference(key, data, 16, 0), _stream_reference(key, data, 16, 1))
    with pytest.raises(ValueError, match="at least one word"):
        d3p.random.stream_words(key, data, (2, 0))
    with pytest.raises(ValueError, match="data in"):
        d3p.random.stream_words(key, -1, (2,))


def test_stream_words_is_one_block_function_call(monkeypatch):
    calls = []
    real = _keystream.chacha20_block
    monkeypatch.setattr(_keystream, "chacha20_block", lambda *a: calls.append(a) or real(*a))
    jax.jit(lambda k, i: d3p.random.stream_words(k, i, (2, 300))).trace(d3p.random.PRNGKey(0), jnp.uint32(1))
    assert len(calls) == 1
    # power: a key per stream and its bits are two calls per stream
    calls.clear()
    jax.jit(lambda k, i: d3p.random.split(d3p.random.fold_in(k, i), 2)).trace(d3p.random.PRNGKey(0), jnp.uint32(1))
    assert len(calls) == 2


class _PlainSuite:
    """A suite with the plain interface only (d3p.random.debug's functions)."""
    fold_in = staticmethod(d3p.random.debug.fold_in)
    random_bits = staticmethod(d3p.random.debug.random_bits)


def test_a_suite_without_stream_words_gets_the_composition_the_debug_suite_has():
    key = d3p.random.debug.PRNGKey(3)
    got = _common.stream_words(_PlainSuite, key, 4, (2, 5), 1)
    want = d3p.random.debug.stream_words(key, 4, (2, 5), 1)
    inner = jax.random.fold_in(key, 4)
    for g, w, j, c in zip(got, want, (1, 2), (2, 5)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        np.testing.assert_array_equal(np.asarray(g), np.asarray(jax.random.bits(jax.random.fold_in(inner, j), (c,), jnp.uint32)))
