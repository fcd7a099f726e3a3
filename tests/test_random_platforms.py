"""d3p.random's per-platform programs: every branch is the same ChaCha20, and
the program lowered for a GPU computes each double round once for all blocks
(a loop over rounds, whose body holds one double round: never the rounds
written out, which XLA copied once per output word) and has no host call
(checked without a GPU by lowering for CUDA on the CPU); compiled for the
CPU, a block function is a few kernels (the state held as rows)."""

import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from jax import lax

import d3p.random
from d3p.random import _keystream, chacha

import _lowered
from _lowered import lowered_text


def _reference_words(key_words, num_words: int, counter: int = 0, nonce=(0, 0, 0)) -> np.ndarray:
    """RFC 8439 keystream words from OpenSSL (the cryptography package)."""
    iv = struct.pack("<I", counter) + np.asarray(nonce, dtype="<u4").tobytes()
    key = np.asarray(key_words, dtype="<u4").tobytes()
    data = Cipher(algorithms.ChaCha20(key, iv), mode=None).encryptor().update(bytes(4 * num_words))
    return np.frombuffer(data, dtype="<u4").astype(np.uint32)


_KEY = (np.arange(8, dtype=np.uint32) * np.uint32(0x9E3779B9)) ^ np.uint32(0xDEADBEEF)


def count_while(fn, *args, platform: str = "cuda") -> int:
    return lowered_text(fn, *args, platform=platform).count("stablehlo.while")


# ---------------------------------------------------------------------------
# every branch computes the RFC 8439 keystream


@pytest.mark.parametrize("num_words", [1, 17, 16 * 8, 16 * 9 + 5, 16 * _keystream.HOST_MIN_BLOCKS + 3])
def test_vectorised_keystream_is_the_rfc_keystream(num_words):
    # the branch that GPUs run, evaluated here on the CPU
    fn = jax.jit(lambda k: _keystream._keystream_vectorised(k, num_words))
    np.testing.assert_array_equal(np.asarray(fn(jnp.asarray(_KEY))), _reference_words(_KEY, num_words))


def test_vectorised_block_function_with_nonce_arrays_is_the_rfc_block():
    counters = np.array([0, 1, 7, 2**32 - 1], dtype=np.uint32)
    nonce1 = np.array([5, 6, 7, 8], dtype=np.uint32)
    blocks = jax.jit(lambda k, c, n: _keystream._blocks_vectorised(k, c, [jnp.uint32(2), n, jnp.uint32(0)]))(
        jnp.asarray(_KEY), counters, nonce1
    )
    for i, (c, n) in enumerate(zip(counters, nonce1)):
        np.testing.assert_array_equal(np.asarray(blocks[i]), _reference_words(_KEY, 16, int(c), (2, int(n), 0)))


@pytest.mark.parametrize("num_words", [16 * _keystream.HOST_MIN_BLOCKS, 16 * _keystream.HOST_MIN_BLOCKS + 9])
def test_host_keystream_is_the_rfc_keystream_and_the_looped_one(num_words, monkeypatch):
    assert _keystream.host_cipher_available()
    key = jnp.asarray(_KEY)
    host = jax.jit(lambda k: _keystream.keystream_words(k, num_words))
    # the CPU program takes it from the host cipher ...
    assert "callback" in host.lower(key).as_text()
    np.testing.assert_array_equal(np.asarray(host(key)), _reference_words(_KEY, num_words))
    # ... and without it the looped rounds give the same words
    monkeypatch.setattr(_keystream, "host_cipher_available", lambda: False)
    looped = jax.jit(lambda k: _keystream.keystream_words(k, num_words))
    assert "callback" not in looped.lower(key).as_text()
    np.testing.assert_array_equal(np.asarray(looped(key)), np.asarray(host(key)))


def test_host_keystream_under_vmap_scan_and_eager_is_per_key():
    num_words = 16 * _keystream.HOST_MIN_BLOCKS + 1
    keys = jnp.asarray(np.stack([_KEY, _KEY ^ np.uint32(1), _KEY + np.uint32(3)]))
    expected = np.stack([_reference_words(np.asarray(k), num_words) for k in keys])
    vmapped = jax.jit(jax.vmap(lambda k: _keystream.keystream_words(k, num_words)))(keys)
    np.testing.assert_array_equal(np.asarray(vmapped), expected)
    _, scanned = lax.scan(lambda c, k: (c, _keystream.keystream_words(k, num_words)), 0, keys)
    np.testing.assert_array_equal(np.asarray(scanned), expected)
    np.testing.assert_array_equal(np.asarray(_keystream.keystream_words(keys[1], num_words)), expected[1])


@pytest.mark.float32
def test_normal_of_every_platform_is_the_same_function_of_the_keystream():
    size = 8 * _keystream.HOST_MIN_BLOCKS + 5
    key = jnp.asarray(_KEY)
    words = jnp.asarray(_reference_words(_KEY, 2 * size))
    expected = np.asarray(jax.jit(chacha._normal_f32)(words[0::2], words[1::2]))
    cpu = jax.jit(lambda k: d3p.random.normal(k, (size,)))
    assert "callback" in cpu.lower(key).as_text()
    np.testing.assert_array_equal(np.asarray(cpu(key)), expected)
    # the GPU branch: the transform of the vectorised keystream
    other = jax.jit(lambda k: chacha._normal_f32_of_keystream(k, size))
    np.testing.assert_array_equal(np.asarray(other(key)), expected)


# ---------------------------------------------------------------------------
# lowered for CUDA: one double round per block function, no host call


_CALLS = {
    "normal, 688,884 values (the VAE's noise)": lambda k: d3p.random.normal(k, (688884,)),
    "normal, 60 values": lambda k: d3p.random.normal(k, (60,)),
    "normal, 5 values": lambda k: d3p.random.normal(k, (5,)),
    "uniform": lambda k: d3p.random.uniform(k, (1000,)),
    "randint": lambda k: d3p.random.randint(k, (100,), 0, 7),
    "random_bits": lambda k: d3p.random.random_bits(k, 32, (100000,)),
    "split": lambda k: d3p.random.split(k, 3),
    "fold_in": lambda k: d3p.random.fold_in(k, 5),
    "convert_to_jax_rng_key": lambda k: d3p.random.convert_to_jax_rng_key(k),
}


@pytest.mark.parametrize("name", list(_CALLS))
def test_lowered_for_cuda_each_double_round_is_written_once_and_no_host_call(name):
    text = lowered_text(_CALLS[name], jnp.asarray(_KEY))
    # every loop is over the ten double rounds, its body one double round;
    # no xor outside them (the rounds written out would hold 320 per block function)
    assert _lowered.round_loops(text) >= 1
    assert _lowered.other_loops(text) == 0
    assert _lowered.xor_outside_round_loops(text) == 0
    assert "callback" not in text


def test_the_rounds_written_out_exceed_the_bound(monkeypatch):
    # the check above has power: the ten double rounds written out (as GPUs
    # ran them before) hold ten times the xor of the loop's body
    def written_out(lower, upper, body, state):
        for i in range(lower, upper):
            state = body(i, state)
        return state

    monkeypatch.setattr(_keystream.lax, "fori_loop", written_out)
    nonce = [jnp.uint32(0)] * 3
    text = lowered_text(lambda k: _keystream._blocks_as_rows(k, jnp.arange(3, dtype=jnp.uint32), nonce),
                        jnp.asarray(_KEY))
    assert _lowered.round_loops(text) == 0
    assert _lowered.xor_outside_round_loops(text) == 10 * _lowered.DOUBLE_ROUND_XORS


def test_cpu_lowering_keeps_the_cpu_programs():
    # on CPU a few blocks are computed one at a time and the VAE's noise goes
    # through the host cipher
    key = jnp.asarray(_KEY)
    assert count_while(_CALLS["split"], key, platform="cpu") >= 2
    assert "callback" in lowered_text(_CALLS["normal, 688,884 values (the VAE's noise)"], key, platform="cpu")


@pytest.mark.parametrize("name", ["split", "fold_in", "convert_to_jax_rng_key", "normal, 60 values"])
def test_cpu_optimized_block_function_holds_at_most_two_copies_of_a_double_round(name):
    # compiled for CPU, XLA splits the loop's body into at most two kernels
    # that share a double round's work; never the 16 per-word copies of ten
    # written-out rounds (3,200 xor)
    text = jax.jit(_CALLS[name]).lower(jnp.asarray(_KEY)).compile().as_text()
    assert text.count(" xor(") <= 2 * _lowered.DOUBLE_ROUND_XORS


_CPU_CALLS = {
    "split": _CALLS["split"],
    "fold_in": _CALLS["fold_in"],
    "convert_to_jax_rng_key": _CALLS["convert_to_jax_rng_key"],
    "normal, 60 values": _CALLS["normal, 60 values"],
    "random_bits, 19 blocks": lambda k: d3p.random.random_bits(k, 32, (300,)),
    "random_bits, 313 blocks": lambda k: d3p.random.random_bits(k, 32, (5000,)),
}


@pytest.mark.parametrize("name", list(_CPU_CALLS))
def test_cpu_optimized_block_function_is_a_few_kernels(name):
    # The state held as four rows of four words (_keystream._blocks_as_rows):
    # XLA:CPU compiles a key derivation or a short draw into at most a couple
    # of dozen kernels, each of which LLVM compiles on its own. With sixteen
    # separate words (the layout GPUs run) the same calls compiled into 47 to
    # 78 kernels, and a private step, which derives its keys with nine such
    # calls, spent about a fifth of its compile time on them.
    text = jax.jit(_CPU_CALLS[name]).lower(jnp.asarray(_KEY)).compile().as_text()
    assert text.count(" fusion(") <= 24


def _blocks_as_sixteen_words(key, counter, nonce):
    """The block function looped with the state held as sixteen separate words
    (the layout GPUs ran before, and the host's NumPy block function runs)."""
    shape = jnp.shape(counter)
    words = ([jnp.uint32(c) for c in _keystream._CONSTANTS] + [key[i] for i in range(8)]
             + [jnp.asarray(counter, jnp.uint32)] + list(nonce))
    init = [jnp.broadcast_to(w, shape) for w in words]
    out = lax.fori_loop(0, 10, lambda _, state: _keystream._double_round(state), tuple(init))
    return jnp.stack([o + i for o, i in zip(out, init)], axis=-1)


def test_the_sixteen_word_layout_exceeds_the_kernel_bound():
    # the check above has power: the layout of sixteen separate words, compiled for CPU
    nonce = [jnp.uint32(0)] * 3
    key = jnp.asarray(_KEY)
    np.testing.assert_array_equal(np.asarray(jax.jit(_blocks_as_sixteen_words)(key, jnp.uint32(0), nonce)),
                                  _reference_words(_KEY, 16))
    fn = jax.jit(lambda k: _blocks_as_sixteen_words(k, jnp.uint32(0), nonce))
    assert fn.lower(key).compile().as_text().count(" fusion(") > 24


def test_lowered_for_cuda_the_rows_take_fewer_operations_than_sixteen_words():
    # the state held as rows: each step of a round one operation on a row of
    # every block; sixteen separate words take one per word (and their
    # constants), more than twice the operations for the same block
    def ops(fn):
        text = lowered_text(fn, jnp.asarray(_KEY))
        assert _lowered.round_loops(text) == 1
        return sum(1 for line in text.splitlines() if " = " in line)

    nonce = [jnp.uint32(0)] * 3
    counter = jnp.arange(3, dtype=jnp.uint32)
    rows = ops(lambda k: _keystream._blocks_vectorised(k, counter, nonce))
    words = ops(lambda k: _blocks_as_sixteen_words(k, counter, nonce))
    assert 2 * rows < words
