"""Tests of d3p.random: ChaCha20 correctness, stream separation, determinism, API.

The statistical tests of the samplers are in ``test_random_stats.py``.
"""

import inspect
import os
import struct
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

import d3p.random
import d3p.random.debug
from d3p.random import _keystream, chacha
from d3p.random.chacha import chacha20_block

# ---------------------------------------------------------------------------
# helpers: an independent ChaCha20 (OpenSSL, through the cryptography package)


def _key_bytes(key_words) -> bytes:
    return np.asarray(key_words, dtype=np.uint32).astype("<u4").tobytes()


def _reference_keystream(key_words, counter: int, nonce_words, num_bytes: int) -> bytes:
    """ChaCha20 keystream of RFC 8439 from the `cryptography` package."""
    nonce16 = struct.pack("<I", counter) + np.asarray(nonce_words, dtype=np.uint32).astype("<u4").tobytes()
    encryptor = Cipher(algorithms.ChaCha20(_key_bytes(key_words), nonce16), mode=None).encryptor()
    return encryptor.update(bytes(num_bytes))


def _reference_words(key_words, counter: int, nonce_words, num_words: int) -> np.ndarray:
    return np.frombuffer(_reference_keystream(key_words, counter, nonce_words, 4 * num_words), dtype="<u4")


def _words(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<u4").astype(np.uint32)


def _hex(text: str) -> bytes:
    return bytes.fromhex(" ".join(text.split()))


def _as_tuples(keys) -> set:
    return {tuple(int(w) for w in k) for k in np.asarray(keys).reshape(-1, 8)}


# ---------------------------------------------------------------------------
# RFC 8439 test vectors

_RFC_KEY = bytes(range(32))

# Most samples below use 4096 keystream words (256 ChaCha20 blocks): 4096
# uniforms or bits, 2048 normals or integers. Eager JAX compiles each
# operation once per shape, so sharing the shape keeps the suite fast.
N_WORDS = 4096
N_PAIRS = N_WORDS // 2


def test_block_function_rfc8439_section_2_3_2():
    nonce = _words(_hex("00 00 00 09 00 00 00 4a 00 00 00 00"))
    block = np.asarray(chacha20_block(_words(_RFC_KEY), np.uint32(1), tuple(nonce)))
    # the state after the 20 rounds plus the initial state, as printed in the RFC
    expected_state = np.array(
        [
            0xE4E7F110, 0x15593BD1, 0x1FDD0F50, 0xC47120A3,
            0xC7F4D1C7, 0x0368C033, 0x9AAA2204, 0x4E6CD4C3,
            0x466482D2, 0x09AA9F07, 0x05D7C214, 0xA2028BD9,
            0xD19C12B5, 0xB94E16DE, 0xE883D0CB, 0x4E3C50A2,
        ],
        dtype=np.uint32,
    )  # fmt: skip
    expected_serialized = _hex(
        """
        10 f1 e7 e4 d1 3b 59 15 50 0f dd 1f a3 20 71 c4
        c7 d1 f4 c7 33 c0 68 03 04 22 aa 9a c3 d4 6c 4e
        d2 82 64 46 07 9f aa 09 14 c2 d7 05 d9 8b 02 a2
        b5 12 9c d1 de 16 4e b9 cb d0 83 e8 a2 50 3c 4e
        """
    )
    assert block.dtype == np.uint32 and block.shape == (16,)
    np.testing.assert_array_equal(block, expected_state)
    assert block.astype("<u4").tobytes() == expected_serialized


def test_encryption_rfc8439_section_2_4_2():
    plaintext = (
        b"Ladies and Gentlemen of the class of '99: If I could offer you only one tip for "
        b"the future, sunscreen would be it."
    )
    expected_ciphertext = _hex(
        """
        6e 2e 35 9a 25 68 f9 80 41 ba 07 28 dd 0d 69 81
        e9 7e 7a ec 1d 43 60 c2 0a 27 af cc fd 9f ae 0b
        f9 1b 65 c5 52 47 33 ab 8f 59 3d ab cd 62 b3 57
        16 39 d6 24 e6 51 52 ab 8f 53 0c 35 9f 08 61 d8
        07 ca 0d bf 50 0d 6a 61 56 a3 8e 08 8a 22 b6 5e
        52 bc 51 4d 16 cc f8 06 81 8c e9 1a b7 79 37 36
        5a f9 0b bf 74 a3 5b e6 b4 0b 8e ed f2 78 5e 42
        87 4d
        """
    )
    nonce = tuple(_words(_hex("00 00 00 00 00 00 00 4a 00 00 00 00")))
    num_blocks = -(-len(plaintext) // 64)
    blocks = chacha20_block(_words(_RFC_KEY), np.arange(1, 1 + num_blocks, dtype=np.uint32), nonce)
    keystream = np.asarray(blocks).astype("<u4").tobytes()[: len(plaintext)]
    ciphertext = bytes(p ^ k for p, k in zip(plaintext, keystream))
    assert ciphertext == expected_ciphertext
    # decryption is the same operation
    assert bytes(c ^ k for c, k in zip(ciphertext, keystream)) == plaintext


def _appendix_a1_vector_4():
    # Test vector #4 of RFC 8439 appendix A.1 (key 00 ff 00 ..., counter 2): its
    # expected bytes are taken from the independent implementation rather
    # than transcribed.
    key = b"\x00\xff" + bytes(30)
    return key, 2, bytes(12), _reference_keystream(_words(key), 2, _words(bytes(12)), 64)


@pytest.mark.parametrize(
    "key, counter, nonce, expected",
    [
        pytest.param(
            bytes(32),
            0,
            bytes(12),
            _hex(
                """
                76 b8 e0 ad a0 f1 3d 90 40 5d 6a e5 53 86 bd 28
                bd d2 19 b8 a0 8d ed 1a a8 36 ef cc 8b 77 0d c7
                da 41 59 7c 51 57 48 8d 77 24 e0 3f b8 d8 4a 37
                6a 43 b8 f4 15 18 a1 1c c3 87 b6 69 b2 ee 65 86
                """
            ),
            id="vector1",
        ),
        pytest.param(
            bytes(32),
            1,
            bytes(12),
            _hex(
                """
                9f 07 e7 be 55 51 38 7a 98 ba 97 7c 73 2d 08 0d
                cb 0f 29 a0 48 e3 65 69 12 c6 53 3e 32 ee 7a ed
                29 b7 21 76 9c e6 4e 43 d5 71 33 b0 74 d8 39 d5
                31 ed 1f 28 51 0a fb 45 ac e1 0a 1f 4b 79 4d 6f
                """
            ),
            id="vector2",
        ),
        pytest.param(
            bytes(31) + b"\x01",
            1,
            bytes(12),
            _hex(
                """
                3a eb 52 24 ec f8 49 92 9b 9d 82 8d b1 ce d4 dd
                83 20 25 e8 01 8b 81 60 b8 22 84 f3 c9 49 aa 5a
                8e ca 00 bb b4 a7 3b da d1 92 b5 c4 2f 73 f2 fd
                4e 27 36 44 c8 b3 61 25 a6 4a dd eb 00 6c 13 a0
                """
            ),
            id="vector3",
        ),
        pytest.param(*_appendix_a1_vector_4(), id="vector4"),
        pytest.param(
            bytes(32),
            0,
            bytes(11) + b"\x02",
            _hex(
                """
                c2 c6 4d 37 8c d5 36 37 4a e2 04 b9 ef 93 3f cd
                1a 8b 22 88 b3 df a4 96 72 ab 76 5b 54 ee 27 c7
                8a 97 0e 0e 95 5c 14 f3 a8 8e 74 1b 97 c2 86 f7
                5f 8f c2 99 e8 14 83 62 fa 19 8a 39 53 1b ed 6d
                """
            ),
            id="vector5",
        ),
    ],
)
def test_block_function_rfc8439_appendix_a1(key, counter, nonce, expected):
    block = chacha20_block(_words(key), np.uint32(counter), tuple(_words(nonce)))
    assert np.asarray(block).astype("<u4").tobytes() == expected


# ---------------------------------------------------------------------------
# agreement with an independent implementation


def test_block_function_matches_cryptography_on_random_inputs():
    rng = np.random.default_rng(20240521)
    special = [0, 1, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1]
    for trial in range(12):
        key = rng.integers(0, 2**32, size=8, dtype=np.uint64).astype(np.uint32)
        nonce = rng.integers(0, 2**32, size=3, dtype=np.uint64).astype(np.uint32)
        counters = np.array(
            special + list(rng.integers(0, 2**32, size=4, dtype=np.uint64)), dtype=np.uint32
        )
        blocks = np.asarray(chacha20_block(key, counters, tuple(nonce)))
        assert blocks.shape == (len(counters), 16)
        for counter, block in zip(counters, blocks):
            np.testing.assert_array_equal(block, _reference_words(key, int(counter), nonce, 16))


def test_block_function_broadcasts_nonce_arrays():
    rng = np.random.default_rng(7)
    key = rng.integers(0, 2**32, size=8, dtype=np.uint64).astype(np.uint32)
    counters = np.array([[0], [5]], dtype=np.uint32)
    nonce1 = np.array([3, 2**32 - 1, 17], dtype=np.uint32)
    blocks = np.asarray(chacha20_block(key, counters, (np.uint32(9), nonce1, np.uint32(0))))
    assert blocks.shape == (2, 3, 16)
    for i in range(2):
        for j in range(3):
            expected = _reference_words(key, int(counters[i, 0]), (9, nonce1[j], 0), 16)
            np.testing.assert_array_equal(blocks[i, j], expected)


def test_block_function_under_jit_and_vmap_matches_cryptography():
    rng = np.random.default_rng(11)
    keys = rng.integers(0, 2**32, size=(4, 8), dtype=np.uint64).astype(np.uint32)
    fn = jax.jit(jax.vmap(lambda k, c: chacha20_block(k, c, (1, 2, 3))))
    counters = np.array([0, 7, 2**32 - 1, 123456], dtype=np.uint32)
    blocks = np.asarray(fn(keys, counters))
    for key, counter, block in zip(keys, counters, blocks):
        np.testing.assert_array_equal(block, _reference_words(key, int(counter), (1, 2, 3), 16))


@pytest.mark.parametrize("shape", [(), (5, 7), (64, 64)])
def test_random_bits_is_the_keystream_under_nonce_zero(shape):
    key = d3p.random.PRNGKey(987654321)
    bits = np.asarray(d3p.random.random_bits(key, 32, shape))
    assert bits.shape == shape and bits.dtype == np.uint32
    size = int(np.prod(shape, dtype=np.int64))
    np.testing.assert_array_equal(bits.reshape(-1), _reference_words(key, 0, (0, 0, 0), size))


def test_random_bits_64_is_the_little_endian_keystream():
    key = d3p.random.PRNGKey(31337)
    with jax.enable_x64(True):
        bits = np.asarray(d3p.random.random_bits(key, 64, (N_PAIRS,)))
    assert bits.dtype == np.uint64 and bits.shape == (N_PAIRS,)
    expected = np.frombuffer(_reference_keystream(key, 0, (0, 0, 0), 4 * N_WORDS), dtype="<u8")
    np.testing.assert_array_equal(bits, expected)


def test_split_outputs_are_the_documented_keystream_words():
    key = d3p.random.PRNGKey(2**200 + 12345)
    children = np.asarray(d3p.random.split(key, 6))
    assert children.shape == (6, 8) and children.dtype == np.uint32
    for i, child in enumerate(children):
        np.testing.assert_array_equal(child, _reference_words(key, i, (1, 0, 0), 8))
    # child i does not depend on how many children were made
    np.testing.assert_array_equal(np.asarray(d3p.random.split(key, 2)), children[:2])
    np.testing.assert_array_equal(np.asarray(d3p.random.split(key)), children[:2])


@pytest.mark.parametrize("data", [0, 1, 12345, 2**31 - 1, np.uint32(2**31), np.uint32(2**32 - 1)])
def test_fold_in_outputs_are_the_documented_keystream_words(data):
    key = d3p.random.PRNGKey(271828)
    child = np.asarray(d3p.random.fold_in(key, data))
    assert child.shape == (8,) and child.dtype == np.uint32
    np.testing.assert_array_equal(child, _reference_words(key, 0, (2, int(data), 0), 8))


def test_fold_in_accepts_python_ints_up_to_2_pow_32():
    key = d3p.random.PRNGKey(5)
    for data in (2**31, 2**32 - 1):
        np.testing.assert_array_equal(
            np.asarray(d3p.random.fold_in(key, data)), _reference_words(key, 0, (2, data, 0), 8)
        )
        np.testing.assert_array_equal(
            np.asarray(d3p.random.fold_in(key, data)),
            np.asarray(d3p.random.fold_in(key, np.uint32(data))),
        )


def test_convert_to_jax_rng_key_is_the_documented_keystream_words():
    key = d3p.random.PRNGKey(99)
    jax_key = d3p.random.convert_to_jax_rng_key(key)
    reference = jax.random.PRNGKey(0)
    assert jax_key.shape == reference.shape and jax_key.dtype == reference.dtype
    n = reference.shape[-1]
    np.testing.assert_array_equal(np.asarray(jax_key), _reference_words(key, 0, (3, 0, 0), n))
    # it is a working jax.random key, distinct for distinct suite keys
    sample = jax.random.normal(jax_key, (4,))
    assert sample.shape == (4,) and bool(jnp.all(jnp.isfinite(sample)))
    other = d3p.random.convert_to_jax_rng_key(d3p.random.PRNGKey(100))
    assert not np.array_equal(np.asarray(other), np.asarray(jax_key))


# ---------------------------------------------------------------------------
# split / fold_in never repeat a stream


def test_split_children_are_distinct_and_differ_from_parent_and_fold_in_children():
    key = d3p.random.PRNGKey(42)
    split_children = _as_tuples(d3p.random.split(key, 2000))
    fold_children = _as_tuples(jax.vmap(lambda i: d3p.random.fold_in(key, i))(jnp.arange(2000)))
    parent = _as_tuples(key[None])
    assert len(split_children) == 2000
    assert len(fold_children) == 2000
    assert not split_children & fold_children
    assert not parent & (split_children | fold_children)


def test_fold_in_distinct_data_gives_distinct_keys_including_extremes():
    key = d3p.random.PRNGKey(0)
    data = np.array([0, 1, 2, 2**16, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1], dtype=np.uint32)
    children = _as_tuples(jax.vmap(lambda d: d3p.random.fold_in(key, d))(data))
    assert len(children) == len(data)


def test_nested_derivations_are_all_distinct():
    all_keys = np.asarray(jax.jit(_nested_derivations)(d3p.random.PRNGKey(2024)))
    assert len(all_keys) > 10_000
    assert len(_as_tuples(all_keys)) == len(all_keys)


def _nested_derivations(root):
    level1 = d3p.random.split(root, 50)
    # split of split, fold_in of split, split of fold_in, fold_in of fold_in
    split_split = jax.vmap(lambda k: d3p.random.split(k, 50))(level1).reshape(-1, 8)
    fold_split = jax.vmap(lambda k: jax.vmap(lambda i: d3p.random.fold_in(k, i))(jnp.arange(50)))(level1)
    folded = jax.vmap(lambda i: d3p.random.fold_in(root, i))(jnp.arange(50))
    split_fold = jax.vmap(lambda k: d3p.random.split(k, 50))(folded).reshape(-1, 8)
    fold_fold = jax.vmap(lambda k: jax.vmap(lambda i: d3p.random.fold_in(k, i))(jnp.arange(50)))(folded)
    # a deeper chain: fold_in(split(fold_in(root, i))[j], k)
    deep = jax.vmap(lambda k: d3p.random.fold_in(k, 7))(split_fold)
    groups = [root[None], level1, folded, split_split, fold_split, split_fold, fold_fold, deep]
    return jnp.concatenate([g.reshape(-1, 8) for g in groups])


def test_random_bits_of_derived_keys_differ():
    root = d3p.random.PRNGKey(7)
    keys = jnp.concatenate(
        [
            root[None],
            d3p.random.split(root, 40),
            jax.vmap(lambda i: d3p.random.fold_in(root, i))(jnp.arange(40)),
        ]
    )
    streams = np.asarray(jax.vmap(lambda k: d3p.random.random_bits(k, 32, (256,)))(keys))
    # no two streams share even a single word at the same position
    for i in range(len(streams)):
        equal = streams[i + 1 :] == streams[i]
        assert not equal.any(), f"stream {i} repeats a word of another stream"
    # and the streams are not shifted copies of each other either
    words = streams.reshape(-1)
    assert len(np.unique(words)) > 0.999 * len(words)


def test_derived_keys_do_not_read_the_parent_stream():
    # a child key is keystream under nonce (1, 0, 0)/(2, d, 0); random_bits of the
    # parent reads nonce (0, 0, 0): no child is a window of the parent's output
    key = d3p.random.PRNGKey(3)
    parent_words = set(np.asarray(d3p.random.random_bits(key, 32, (N_WORDS,))).tolist())
    children = np.concatenate(
        [np.asarray(d3p.random.split(key, 16)), np.asarray(d3p.random.fold_in(key, 0))[None]]
    )
    assert not parent_words & set(children.reshape(-1).tolist())


# ---------------------------------------------------------------------------
# determinism

_SAMPLERS = {
    "random_bits": lambda k: d3p.random.random_bits(k, 32, (64, 64)),
    "random_bits8": lambda k: d3p.random.random_bits(k, 8, (N_WORDS,)),
    "uniform": lambda k: d3p.random.uniform(k, (N_WORDS,), minval=-2.0, maxval=3.0),
    "normal": lambda k: d3p.random.normal(k, (N_PAIRS,)),
    "randint": lambda k: d3p.random.randint(k, (N_PAIRS,), -5, 1000),
    "split": lambda k: d3p.random.split(k, 3),
    "fold_in": lambda k: d3p.random.fold_in(k, 17),
    "convert_to_jax_rng_key": d3p.random.convert_to_jax_rng_key,
}


def _assert_same(actual, expected, name=""):
    """Bit-identical integers; floats within a few float32 rounding errors.

    XLA may contract ``minval + unit * (maxval - minval)`` into a fused
    multiply-add under ``jit``, and its vectorised ``log`` may differ in the
    last bit between shapes, so the same bits can map to floats a rounding
    error apart between compiled programs (for the samplers here, of values
    of magnitude at most about 5). The random bits themselves, the keys and
    the integers must be identical.
    """
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, name
    if np.issubdtype(actual.dtype, np.floating):
        np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=5e-6, err_msg=name)
    else:
        np.testing.assert_array_equal(actual, expected, err_msg=name)


def _all_samplers(key):
    return {name: fn(key) for name, fn in _SAMPLERS.items()}


_all_samplers_jit = jax.jit(_all_samplers)


def test_same_key_gives_same_output():
    first = _all_samplers(d3p.random.PRNGKey(123))
    again = _all_samplers(d3p.random.PRNGKey(123))
    other = _all_samplers(d3p.random.PRNGKey(124))
    for name in _SAMPLERS:
        # the same program on the same key: bit-identical, floats included
        np.testing.assert_array_equal(np.asarray(first[name]), np.asarray(again[name]), err_msg=name)
        assert not np.array_equal(np.asarray(first[name]), np.asarray(other[name])), name


def test_jit_equals_eager():
    key = d3p.random.PRNGKey(2**100 + 5)
    compiled, again, eager = _all_samplers_jit(key), _all_samplers_jit(key), _all_samplers(key)
    for name in _SAMPLERS:
        _assert_same(compiled[name], eager[name], name)
        np.testing.assert_array_equal(np.asarray(again[name]), np.asarray(compiled[name]))


def test_vmap_over_keys_equals_loop():
    keys = d3p.random.split(d3p.random.PRNGKey(8), 4)
    batched = jax.jit(jax.vmap(_all_samplers))(keys)
    looped = [_all_samplers_jit(k) for k in keys]
    for name in _SAMPLERS:
        _assert_same(batched[name], np.stack([np.asarray(out[name]) for out in looped]), name)


def test_unit_uniform_and_bits_are_bit_identical_under_jit_and_vmap():
    # without an affine map there is nothing to round: exact everywhere
    keys = d3p.random.split(d3p.random.PRNGKey(9), 4)
    fn = lambda k: d3p.random.uniform(k, (N_WORDS,))
    looped = np.stack([np.asarray(fn(k)) for k in keys])
    np.testing.assert_array_equal(np.asarray(jax.jit(jax.vmap(fn))(keys)), looped)


def test_fold_in_with_traced_data_equals_concrete():
    key = d3p.random.PRNGKey(77)
    traced = jax.jit(d3p.random.fold_in)(key, jnp.int32(12))
    np.testing.assert_array_equal(np.asarray(traced), np.asarray(d3p.random.fold_in(key, 12)))


# ---------------------------------------------------------------------------
# PRNGKey


def test_prngkey_without_seed_draws_fresh_keys():
    first, second = d3p.random.PRNGKey(), d3p.random.PRNGKey(None)
    for key in (first, second):
        assert key.shape == (8,) and key.dtype == jnp.uint32
    assert not np.array_equal(np.asarray(first), np.asarray(second))
    # and they are not one of the small integer seeds
    assert np.asarray(first)[1:].any() and np.asarray(second)[1:].any()


def test_prngkey_integer_seeds_are_reproducible_and_little_endian():
    np.testing.assert_array_equal(np.asarray(d3p.random.PRNGKey(42)), np.asarray(d3p.random.PRNGKey(42)))
    assert not np.array_equal(np.asarray(d3p.random.PRNGKey(42)), np.asarray(d3p.random.PRNGKey(43)))
    np.testing.assert_array_equal(np.asarray(d3p.random.PRNGKey(0)), np.zeros(8, np.uint32))
    np.testing.assert_array_equal(np.asarray(d3p.random.PRNGKey(2**32 + 3)), [3, 1, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(np.asarray(d3p.random.PRNGKey(2**256 - 1)), np.full(8, 2**32 - 1, np.uint32))
    seed = 0x0123456789ABCDEF_FEDCBA9876543210_0011223344556677_8899AABBCCDDEEFF
    assert _key_bytes(d3p.random.PRNGKey(seed)) == seed.to_bytes(32, "little")
    np.testing.assert_array_equal(np.asarray(d3p.random.PRNGKey(np.int64(7))), np.asarray(d3p.random.PRNGKey(7)))
    np.testing.assert_array_equal(np.asarray(d3p.random.PRNGKey(np.uint8(7))), np.asarray(d3p.random.PRNGKey(7)))


def test_prngkey_integer_array_seed_fills_lowest_word_also_traced():
    np.testing.assert_array_equal(np.asarray(d3p.random.PRNGKey(jnp.int32(9))), np.asarray(d3p.random.PRNGKey(9)))
    traced = jax.jit(d3p.random.PRNGKey)(jnp.uint32(2**32 - 1))
    np.testing.assert_array_equal(np.asarray(traced), np.asarray(d3p.random.PRNGKey(2**32 - 1)))


@pytest.mark.parametrize(
    "seed, error",
    [
        (1.0, TypeError),
        (0.5, TypeError),
        (True, TypeError),
        (np.bool_(False), TypeError),
        (jnp.float32(3.0), TypeError),
        (np.array([1, 2]), TypeError),
    ],
)
def test_prngkey_rejects_bad_seeds_naming_the_argument(seed, error):
    with pytest.raises(error, match="seed"):
        d3p.random.PRNGKey(seed)


# ---------------------------------------------------------------------------
# argument validation and dtypes


def test_functions_reject_keys_that_are_not_suite_keys():
    jax_key = jax.random.PRNGKey(0)  # uint32[2]: a jax key, not a suite key
    for fn in (
        lambda k: d3p.random.split(k),
        lambda k: d3p.random.fold_in(k, 1),
        lambda k: d3p.random.random_bits(k),
        lambda k: d3p.random.uniform(k),
        lambda k: d3p.random.normal(k),
        lambda k: d3p.random.randint(k, (), 0, 3),
        lambda k: d3p.random.convert_to_jax_rng_key(k),
    ):
        with pytest.raises(TypeError, match="key"):
            fn(jax_key)
        with pytest.raises(TypeError, match="key"):
            fn(jnp.zeros(8, jnp.int32))
        with pytest.raises(ValueError, match="key"):
            fn(d3p.random.split(d3p.random.PRNGKey(0), 2))


@pytest.mark.parametrize(
    "call, error, name",
    [
        (lambda k: d3p.random.split(k, 0), ValueError, "num"),
        (lambda k: d3p.random.fold_in(k, 1.5), TypeError, "data"),
        (lambda k: d3p.random.fold_in(k, -1), ValueError, "data"),
        (lambda k: d3p.random.fold_in(k, 2**32), ValueError, "data"),
        (lambda k: d3p.random.random_bits(k, 12), ValueError, "bit_width"),
        (lambda k: d3p.random.random_bits(k, 64), ValueError, "bit_width"),
        (lambda k: d3p.random.random_bits(k, 32, (2, -1)), ValueError, "shape"),
        (lambda k: d3p.random.uniform(k, (3,), jnp.int32), TypeError, "dtype"),
        (lambda k: d3p.random.uniform(k, (-3,)), ValueError, "shape"),
        (lambda k: d3p.random.normal(k, (3,), jnp.int32), TypeError, "dtype"),
        (lambda k: d3p.random.normal(k, (3,), jnp.bool_), TypeError, "dtype"),
        (lambda k: d3p.random.randint(k, (3,), 0), TypeError, "maxval"),
        (lambda k: d3p.random.randint(k, (3,), 5, 5), ValueError, "maxval"),
        (lambda k: d3p.random.randint(k, (3,), 5, 2), ValueError, "minval"),
        (lambda k: d3p.random.randint(k, (3,), 0, 10, jnp.float32), TypeError, "dtype"),
        (lambda k: d3p.random.randint(k, (3,), -(2**31), 2**32), ValueError, "maxval"),
        (lambda k: d3p.random.randint(k, (3,), 0, 300, jnp.int8), ValueError, "maxval"),
        (lambda k: d3p.random.randint(k, (3,), -1, 10, jnp.uint8), ValueError, "minval"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(call, error, name):
    # with x64 disabled, bit_width=64 is refused
    with jax.enable_x64(False), pytest.raises(error, match=name):
        call(d3p.random.PRNGKey(0))


@pytest.mark.parametrize("bit_width, dtype", [(8, np.uint8), (16, np.uint16), (32, np.uint32)])
def test_random_bits_dtypes_and_full_range(bit_width, dtype):
    bits = np.asarray(d3p.random.random_bits(d3p.random.PRNGKey(1), bit_width, (N_WORDS,)))
    assert bits.dtype == dtype
    # the top bit and the bottom bit are both used
    assert (bits >> (bit_width - 1)).any() and (bits & 1).any()
    assert not (bits >> (bit_width - 1)).all() and not (bits & 1).all()
    if bit_width == 8:
        assert len(np.unique(bits)) == 256


def test_random_bits_empty_shapes():
    key = d3p.random.PRNGKey(1)
    assert d3p.random.random_bits(key, 32, (0,)).shape == (0,)
    assert d3p.random.uniform(key, (3, 0)).shape == (3, 0)
    assert d3p.random.normal(key, (0,)).shape == (0,)
    assert d3p.random.randint(key, (0, 2), 0, 5).shape == (0, 2)
    assert d3p.random.random_bits(key, 32, 4).shape == (4,)  # an int is a 1-d shape


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_uniform_and_normal_dtypes(dtype):
    key = d3p.random.PRNGKey(12)
    u = d3p.random.uniform(key, (N_WORDS,), dtype)
    n = d3p.random.normal(key, (N_PAIRS,), dtype)
    assert u.dtype == dtype and n.dtype == dtype
    u32, n32 = np.asarray(u.astype(jnp.float32)), np.asarray(n.astype(jnp.float32))
    assert np.all((u32 >= 0) & (u32 < 1))
    assert np.all(np.isfinite(n32))
    # 4.5 standard errors
    assert abs(u32.mean() - 0.5) < 0.02 and abs(n32.mean()) < 0.1 and abs(n32.std() - 1) < 0.07
    # uniform: the values are exact multiples of 2**-(mantissa bits + 1), each equally likely:
    # a uniform value is the top bits of the keystream word, not a rounded float
    nbits = jnp.finfo(dtype).nmant + 1
    bits = np.asarray(d3p.random.random_bits(key, 32, (N_WORDS,)))
    np.testing.assert_array_equal(u32 * 2.0**nbits, (bits >> (32 - nbits)).astype(np.float64))


@pytest.mark.float32
def test_float64_without_x64_falls_back_to_float32():
    key = d3p.random.PRNGKey(3)
    assert d3p.random.uniform(key, (3,), jnp.float64).dtype == jnp.float32
    assert d3p.random.normal(key, (3,), jnp.float64).dtype == jnp.float32


def test_float64_and_int64_with_x64():
    key = d3p.random.PRNGKey(4)
    with jax.enable_x64(True):
        u = np.asarray(d3p.random.uniform(key, (N_PAIRS,), jnp.float64))
        n = np.asarray(d3p.random.normal(key, (N_PAIRS,), jnp.float64))
        r = np.asarray(d3p.random.randint(key, (N_PAIRS,), -(2**40), -(2**40) + 3 * 2**30, jnp.int64))
        bits = np.asarray(d3p.random.random_bits(key, 64, (N_PAIRS,)))
    assert u.dtype == np.float64 and n.dtype == np.float64 and r.dtype == np.int64
    # 53 random bits per uniform value
    np.testing.assert_array_equal(u * 2.0**53, (bits >> 11).astype(np.float64))
    assert np.all((r >= -(2**40)) & (r < -(2**40) + 3 * 2**30))
    assert np.all(np.isfinite(n))


# ---------------------------------------------------------------------------
# default float dtype: JAX's, at the time of the call


_DEFAULT_DTYPE_SCRIPT = r'''
import warnings
import jax, jax.numpy as jnp, numpy as np
from scipy import stats
import d3p.random, d3p.random.debug
from d3p.random import _keystream, chacha

assert jax.config.jax_enable_x64
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    debug_key = d3p.random.debug.PRNGKey(0)
n = 200_000
suites = [("chacha", chacha, d3p.random.PRNGKey(0)), ("secure", d3p.random, d3p.random.PRNGKey(1)),
          ("debug", d3p.random.debug, debug_key)]
for name, suite, key in suites:
    u, z = suite.uniform(key, (n,)), suite.normal(suite.fold_in(key, 1), (n,))
    assert u.dtype == jnp.float64 and z.dtype == jnp.float64, (name, u.dtype, z.dtype)
    assert suite.uniform(key).dtype == suite.normal(key).dtype == jnp.float64, name
    assert suite.uniform(key, (2,), jnp.float32).dtype == suite.normal(key, (2,), jnp.float32).dtype == jnp.float32
    u, z = np.asarray(u), np.asarray(z)
    # uniform on [0, 1) with float64 resolution: finer than float32's 2**-24 grid
    assert u.min() >= 0.0 and u.max() < 1.0, name
    assert len(np.unique(u)) == n, name
    assert np.mean(u * 2.0**24 != np.floor(u * 2.0**24)) > 0.99, name
    se = 4.5 / np.sqrt(n)
    assert abs(u.mean() - 0.5) < se * np.sqrt(1 / 12) and abs(u.var() - 1 / 12) < se * np.sqrt(1 / 180), name
    assert stats.kstest(u, "uniform").pvalue > 1e-4, name
    # standard normal: moments, shape, and a KS test that rejects the scale 0.95
    assert abs(z.mean()) < se and abs(z.var() - 1) < se * np.sqrt(2), (name, z.mean(), z.var())
    assert stats.kstest(z, "norm").pvalue > 1e-4, name
    assert stats.kstest(z / 1.05, "norm").pvalue < 1e-6, name
    tail = np.mean(np.abs(z) > 3)
    p3 = 2 * stats.norm.sf(3)
    assert abs(tail - p3) < 4.5 * np.sqrt(p3 / n), (name, tail)
# the secure float64 draws are the documented function of the keystream (53 bits per uniform)
key = d3p.random.PRNGKey(0)
bits = np.asarray(d3p.random.random_bits(key, 64, (1000,)))
np.testing.assert_array_equal(np.asarray(d3p.random.uniform(key, (1000,))) * 2.0**53,
                              (bits >> 11).astype(np.float64))
np.testing.assert_array_equal(np.asarray(d3p.random.normal(key, (1000,))),
                              np.asarray(d3p.random.normal(key, (1000,), jnp.float64)))
print("ok")
'''


@pytest.mark.slow
def test_default_float_dtype_is_float64_under_x64_in_a_subprocess():
    """Without a dtype, normal and uniform draw JAX's default float dtype; the
    float64 samples have the right distribution (x64 is process-wide, hence
    the subprocess)."""
    env = dict(os.environ, JAX_ENABLE_X64="1", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", _DEFAULT_DTYPE_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


@pytest.mark.parametrize("suite", ["secure", "debug"])
def test_default_float_dtype_follows_the_x64_setting_at_call_time(suite):
    s, key = (d3p.random, d3p.random.PRNGKey(0)) if suite == "secure" else (d3p.random.debug, _debug_key())
    with jax.enable_x64(False):
        assert s.uniform(key, (3,)).dtype == s.normal(key, (3,)).dtype == jnp.float32
    with jax.enable_x64(True):
        assert s.uniform(key, (3,)).dtype == s.normal(key, (3,)).dtype == jnp.float64
        assert s.uniform(key, (3,), jnp.float32).dtype == jnp.float32
    with jax.enable_x64(False):
        assert s.uniform(key, (3,)).dtype == s.normal(key, (3,)).dtype == jnp.float32
    for f in (s.uniform, s.normal):
        assert inspect.signature(f).parameters["dtype"].default is None


def test_suites_share_one_list_of_names():
    from d3p.random._common import SUITE_API

    # the suite's names, as_key (JAX keys, both suites), the debug suite, discrete_gaussian and
    # normal_float64 (which take a suite), and split_with_jax_key(s) and stream_words (both suites;
    # optional for other suites)
    optional = ["split_with_jax_key", "split_with_jax_keys", "stream_words"]
    assert d3p.random.__all__ == [*SUITE_API, "as_key", "debug", "discrete_gaussian", "normal_float64", *optional]
    assert d3p.random.debug.__all__ == [*SUITE_API, "as_key", *optional]
    assert chacha.__all__ == [*SUITE_API, "as_key", "chacha20_block", *optional]
    for module in (d3p.random, d3p.random.debug, chacha):
        assert all(hasattr(module, name) for name in module.__all__)


def test_keystream_in_tiles_is_the_keystream(monkeypatch):
    # on CPU without OpenSSL's ChaCha20, long keystreams are generated in tiles
    # of blocks (lax.map); the words must be the RFC 8439 keystream all the
    # same, across tile borders
    monkeypatch.setattr(_keystream, "host_cipher_available", lambda: False)
    key = np.arange(8, dtype=np.uint32) * np.uint32(0x01010101)
    num_words = (2 * _keystream._TILE_BLOCKS + 5) * 16 + 3  # above the threshold, uneven tiles
    tiled = np.asarray(jax.jit(lambda k: chacha._keystream_words(k, num_words))(jnp.asarray(key)))
    np.testing.assert_array_equal(tiled, _reference_words(key, 0, (0, 0, 0), num_words))
    monkeypatch.setattr(_keystream, "_TILE_BLOCKS", num_words)  # all blocks at once
    whole = np.asarray(jax.jit(lambda k: chacha._keystream_words(k, num_words))(jnp.asarray(key)))
    np.testing.assert_array_equal(whole, tiled)


@pytest.mark.float32
@pytest.mark.parametrize("host", [True, False])
def test_normal_on_cpu_is_the_documented_function_of_the_keystream(monkeypatch, host):
    # long float32 draws on CPU come from OpenSSL's keystream, or without it
    # from a loop over tiles of blocks with the transform inside; either way
    # they must be the same function of the same keystream words
    if not host:
        monkeypatch.setattr(_keystream, "host_cipher_available", lambda: False)
    key = np.arange(8, dtype=np.uint32) * np.uint32(0x01010101) + np.uint32(7)
    size = (2 * _keystream._TILE_BLOCKS + 5) * 8 + 3  # above the threshold, uneven tiles
    z = np.asarray(jax.jit(lambda k: d3p.random.normal(k, (size,)))(jnp.asarray(key)))
    words = jnp.asarray(_reference_words(key, 0, (0, 0, 0), 2 * size))
    expected = np.asarray(jax.jit(chacha._normal_f32)(words[0::2], words[1::2]))
    np.testing.assert_array_equal(z, expected)
    # and the same as the looped keystream of all blocks at once
    small = np.asarray(jax.jit(lambda k: d3p.random.normal(k, (1000,)))(jnp.asarray(key)))
    np.testing.assert_array_equal(small, z[:1000])
    # a few blocks (2 to 8) go one block per loop step; same words, same function
    # (XLA may contract the polynomials differently inside the loop: 1 ulp)
    for n in (9, 31, 64):
        few = np.asarray(jax.jit(lambda k: d3p.random.normal(k, (n,)))(jnp.asarray(key)))
        np.testing.assert_allclose(few, z[:n], rtol=3e-7, atol=0)


# ---------------------------------------------------------------------------
# normal: accuracy and tails of the float32 inverse CDF


def _normal_exact(h, lo):
    """The exact magnitude -ndtri(p / 2), p = (h 2**32 + lo + 0.5) / 2**63, in float64,
    for integer arrays ``h < 2**31`` and ``lo < 2**32`` (erfinv of x = 1 - p near p = 1)."""
    import scipy.special
    import scipy.stats

    h, lo = np.asarray(h, np.float64), np.asarray(lo, np.float64)
    p = (h * 2.0**32 + lo + 0.5) * 2.0**-63
    x = ((2.0**31 - 1 - h) * 2.0**32 + (2.0**32 - 1 - lo) + 0.5) * 2.0**-63
    return np.where(p < 0.5, scipy.stats.norm.isf(p / 2), np.sqrt(2) * scipy.special.erfinv(x))


def _normal_of_words(monkeypatch, h, lo, negative=False):
    """d3p.random.normal on crafted keystream words (sign bit, 63 bits of p)."""
    h, lo = np.asarray(h, np.uint32), np.asarray(lo, np.uint32)
    words = np.empty(2 * len(h), np.uint32)
    words[0::2] = (h << np.uint32(1)) | np.uint32(negative)
    words[1::2] = lo
    monkeypatch.setattr(chacha, "_keystream_words", lambda key, num_words: jnp.asarray(words[:num_words]))
    return np.asarray(d3p.random.normal(d3p.random.PRNGKey(0), (len(h),)), np.float64)


@pytest.mark.float32
def test_normal_float32_relative_error_over_the_whole_range(monkeypatch):
    # 63-bit tail probabilities: uniform ones, log-uniform ones down to the
    # smallest (the far tails), and the extremes at both ends (p -> 0 and p -> 1)
    rng = np.random.default_rng(3)
    n = 1 << 14  # below the tiled path's threshold: the crafted words are used
    uniform_p = rng.integers(0, 2**63, n, dtype=np.uint64)
    log_p = np.minimum(np.floor(2.0 ** rng.uniform(0, 63, n)), 2.0**63 - 1).astype(np.uint64)
    edges = np.array([0, 1, 2, 3, 2**32 - 1, 2**32, 2**62, 2**63 - 2**40, 2**63 - 2, 2**63 - 1], np.uint64)
    P = np.concatenate([uniform_p, log_p, edges])
    h, lo = (P >> np.uint64(32)).astype(np.uint32), (P & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    exact = _normal_exact(h, lo)
    z = _normal_of_words(monkeypatch, h, lo)
    assert np.all(z >= 0)
    np.testing.assert_allclose(z, exact, rtol=1e-6, atol=0)
    np.testing.assert_allclose(_normal_of_words(monkeypatch, h, lo, negative=True), -exact, rtol=1e-6, atol=0)
    # the largest reachable magnitude, at p = 2**-64: about 9.1553
    assert abs(z[-len(edges)] - 9.15529) < 1e-4 and exact[-len(edges)] > 9.155


@pytest.mark.parametrize("t", [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0])
def test_normal_exact_tail_mass_over_all_keystream_words(monkeypatch, t):
    # The tail mass of the noise is a property of the mapping, not of a sample:
    # |z| > t exactly for the 63-bit p below a threshold P*, so over all 2**64
    # keystream words P(|Z| > t) = P* / 2**63. Find P* by bisection (the mapping
    # decreases in p up to float32 rounding) and compare with 2 sf(t).
    import scipy.stats

    lo_P, hi_P = 0, 2**63 - 1  # z(lo_P) > t >= z(hi_P)
    while hi_P - lo_P > 1:
        mid = (lo_P + hi_P) // 2
        z = _normal_of_words(monkeypatch, [mid >> 32], [mid & 0xFFFFFFFF])[0]
        lo_P, hi_P = (mid, hi_P) if z > t else (lo_P, mid)
    mass = hi_P * 2.0**-63
    expected = 2 * scipy.stats.norm.sf(t)
    # z has relative error below 1e-6, so the mass is off by at most about
    # t**2 * 1e-6 relative, plus one 63-bit step
    tol = 2e-6 * t**2 * expected + 2.0**-63
    assert abs(mass - expected) < tol
    # power: a scale 1 +- 1e-4 (a hundred times the error bound) fails the check,
    # where the mass spans many 63-bit steps (at t = 9 it is 2 of 2**63)
    if expected > 1e3 * 2.0**-63:
        for scale in (1 - 1e-4, 1 + 1e-4):
            assert abs(mass - 2 * scipy.stats.norm.sf(t / scale)) > tol


def test_normal_tail_fractions_beyond_4_and_5_sigma_in_a_large_sample():
    # 2**24 draws: the counts beyond 4 and 5 must be binomial around n P(|Z| > t)
    # (within 4.5 standard deviations), while 5% too wide a normal fails
    import scipy.stats

    n = 1 << 24
    z = np.abs(np.asarray(jax.jit(lambda k: d3p.random.normal(k, (n,)))(d3p.random.PRNGKey(2024))))
    assert np.isfinite(z).all()
    for t in (4.0, 5.0):
        p = 2 * scipy.stats.norm.sf(t)
        bound = 4.5 * np.sqrt(n * p * (1 - p))
        assert abs(np.count_nonzero(z > t) - n * p) < bound, t
        assert abs(np.count_nonzero(1.05 * z > t) - n * p) > bound, t


@pytest.mark.float32
def test_uniform_stays_in_the_half_open_interval():
    key = d3p.random.PRNGKey(55)
    cases = [
        (0.0, 1.0),
        (-3.0, 2.0),
        (1e6, 1e6 + 1.0),  # float32 spacing 0.0625: the affine map rounds up to maxval
        (1.0, float(np.nextafter(np.float32(1.0), np.float32(2.0)))),  # a single value
        (-1e-30, 1e-30),
        (5.0, 5.0 + 2.0**-20),
    ]
    for minval, maxval in cases:
        u = np.asarray(d3p.random.uniform(key, (N_WORDS,), minval=minval, maxval=maxval))
        lo, hi = np.float32(minval), np.float32(maxval)
        assert u.min() >= lo, (minval, maxval)
        assert u.max() < hi, (minval, maxval)
    # an interval holding a single float gives exactly that float
    one_up = float(np.nextafter(np.float32(1.0), np.float32(2.0)))
    u = np.asarray(d3p.random.uniform(key, (N_WORDS,), minval=1.0, maxval=one_up))
    np.testing.assert_array_equal(u, np.float32(1.0))


def test_uniform_with_broadcast_and_traced_bounds():
    key = d3p.random.PRNGKey(56)
    minval = jnp.array([[-1.0], [10.0], [100.0]])
    maxval = jnp.array([0.0, 11.0, 10.5, 1000.0])[None, :] + 101.0
    fn = jax.jit(lambda lo, hi: d3p.random.uniform(key, (3, 4), minval=lo, maxval=hi))
    u = np.asarray(fn(minval, maxval))
    _assert_same(u, d3p.random.uniform(key, (3, 4), minval=minval, maxval=maxval))
    lo, hi = np.broadcast_to(np.asarray(minval), (3, 4)), np.broadcast_to(np.asarray(maxval), (3, 4))
    assert np.all((u >= lo) & (u < hi))
    # the same bits as the unit interval, mapped affinely
    unit = np.asarray(d3p.random.uniform(key, (3, 4)))
    np.testing.assert_allclose(u, lo + unit * (hi - lo), rtol=1e-6)


def _randint_reference(words: np.ndarray, span: int) -> np.ndarray:
    """floor(x * span / 2**64) for the 64-bit value x = hi * 2**32 + lo, exactly."""
    hi, lo = words[0::2].astype(object), words[1::2].astype(object)
    return np.array([((int(h) << 32 | int(l)) * span) >> 64 for h, l in zip(hi, lo)], dtype=np.int64)


@pytest.mark.parametrize(
    "minval, maxval",
    [(0, 1), (0, 2), (0, 7), (-3, 4), (0, 1000), (10, 2**31 - 1), (-(2**31), 2**31 - 1), (-(3 * 2**29), 3 * 2**29)],
)
def test_randint_is_the_exact_multiply_shift_of_64_keystream_bits(minval, maxval):
    # the documented mapping, checked with exact integer arithmetic; this pins the
    # 32x32 -> 64 bit multiplication and the carry, edge words included
    key = d3p.random.PRNGKey(minval % 1000 + maxval % 997)
    out = np.asarray(d3p.random.randint(key, (N_PAIRS,), minval, maxval))
    words = _reference_words(key, 0, (0, 0, 0), N_WORDS)
    np.testing.assert_array_equal(out.astype(np.int64), minval + _randint_reference(words, maxval - minval))


def test_randint_mapping_on_crafted_keystream_words(monkeypatch):
    edge = [0, 1, 2**16 - 1, 2**16, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1]
    rng = np.random.default_rng(3)
    words = np.array(
        [w for h in edge for l in edge for w in (h, l)] + list(rng.integers(0, 2**32, 512, dtype=np.uint64)),
        dtype=np.uint32,
    )
    n = len(words) // 2
    monkeypatch.setattr(chacha, "_keystream_words", lambda key, num_words: jnp.asarray(words[:num_words]))
    key = d3p.random.PRNGKey(0)
    for minval, maxval in [(-(2**31), 2**31 - 1), (0, 3), (5, 6), (-100, 2**30 + 7)]:
        out = np.asarray(d3p.random.randint(key, (n,), minval, maxval, dtype=jnp.int32))
        expected = minval + _randint_reference(words, maxval - minval)
        np.testing.assert_array_equal(out.astype(np.int64), expected)
    out = np.asarray(d3p.random.randint(key, (n,), 0, 2**32 - 1, dtype=jnp.uint32))
    np.testing.assert_array_equal(out.astype(np.int64), _randint_reference(words, 2**32 - 1))


def test_randint_with_broadcast_and_traced_bounds():
    key = d3p.random.PRNGKey(57)
    minval = jnp.array([[-5], [0], [1000], [-(2**30)]], dtype=jnp.int32)
    maxval = jnp.array([3, 1001, 2**30], dtype=jnp.int32)
    # every pair with minval < maxval
    minval = jnp.minimum(minval, maxval - 1)
    fn = jax.jit(lambda k, lo, hi: d3p.random.randint(k, (4, 3), lo, hi))
    out = np.asarray(fn(key, minval, maxval))
    np.testing.assert_array_equal(out, np.asarray(d3p.random.randint(key, (4, 3), minval, maxval)))
    lo, hi = np.broadcast_to(np.asarray(minval), (4, 3)), np.broadcast_to(np.asarray(maxval), (4, 3))
    assert np.all((out >= lo) & (out < hi))
    # many draws under vmap over keys stay in range and hit both ends of a small range
    keys = d3p.random.split(key, 2000)
    draws = np.asarray(jax.vmap(lambda k: fn(k, minval, maxval))(keys))
    assert np.all((draws >= lo) & (draws < hi))
    assert draws[:, 0, 0].min() == -5 and draws[:, 0, 0].max() == 2
    # the same bits with a scalar range are the same offsets
    offsets = np.asarray(d3p.random.randint(key, (4, 3), 0, 7))
    np.testing.assert_array_equal(np.asarray(d3p.random.randint(key, (4, 3), 10, 17)), offsets + 10)


@pytest.mark.parametrize(
    "dtype, minval, maxval",
    [
        (jnp.int8, -128, 128),
        (jnp.uint8, 0, 256),
        (jnp.int16, -300, 300),
        (jnp.uint16, 65000, 65536),
        (jnp.int32, -(2**31), 2**31 - 1),
        (jnp.uint32, 0, 3 * 2**30),
        (jnp.uint32, 2**32 - 10, 2**32),
    ],
)
def test_randint_dtypes_cover_the_range(dtype, minval, maxval):
    out = d3p.random.randint(d3p.random.PRNGKey(58), (N_PAIRS,), minval, maxval, dtype)
    assert out.dtype == dtype
    values = np.asarray(out).astype(np.int64)
    assert np.all((values >= minval) & (values < maxval))
    if maxval - minval <= 600:
        assert values.min() == minval and values.max() == maxval - 1


# ---------------------------------------------------------------------------
# the debug suite


def test_debug_suite_has_the_same_interface():
    from d3p.random._common import SUITE_API

    for name in SUITE_API:
        secure, debug = getattr(d3p.random, name), getattr(d3p.random.debug, name)
        if callable(secure) and not isinstance(secure, type):
            s_params = [(p.name, p.default) for p in inspect.signature(secure).parameters.values()]
            d_params = [(p.name, p.default) for p in inspect.signature(debug).parameters.values()]
            assert [p[0] for p in s_params] == [p[0] for p in d_params], name
            for (pname, s_default), (_, d_default) in zip(s_params, d_params):
                assert s_default is d_default or s_default == d_default, (name, pname)


def test_debug_prngkey_warns():
    with pytest.warns(d3p.random.debug.DebugRNGWarning, match="debug"):
        d3p.random.debug.PRNGKey(0)
    with pytest.warns(d3p.random.debug.DebugRNGWarning):
        first = d3p.random.debug.PRNGKey()
    with pytest.warns(d3p.random.debug.DebugRNGWarning):
        second = d3p.random.debug.PRNGKey()
    assert not np.array_equal(np.asarray(first), np.asarray(second))


def test_secure_prngkey_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        d3p.random.PRNGKey(0)
        d3p.random.PRNGKey()


def _debug_key(seed=0):
    with pytest.warns(d3p.random.debug.DebugRNGWarning):
        return d3p.random.debug.PRNGKey(seed)


_CALLS = {
    "random_bits8": lambda s, k: s.random_bits(k, 8, (3, 2)),
    "random_bits16": lambda s, k: s.random_bits(k, 16, (5,)),
    "random_bits32": lambda s, k: s.random_bits(k, 32, (2, 2, 2)),
    "random_bits_default": lambda s, k: s.random_bits(k),
    "uniform": lambda s, k: s.uniform(k, (4,)),
    "uniform_bounds": lambda s, k: s.uniform(k, (2, 3), minval=jnp.zeros((2, 1)), maxval=5.0),
    "uniform_f16": lambda s, k: s.uniform(k, (3,), jnp.float16),
    "uniform_bf16": lambda s, k: s.uniform(k, (3,), jnp.bfloat16),
    "normal": lambda s, k: s.normal(k, (7, 1)),
    "normal_scalar": lambda s, k: s.normal(k),
    "normal_f16": lambda s, k: s.normal(k, (3,), jnp.float16),
    "randint": lambda s, k: s.randint(k, (6,), 0, 10),
    "randint_i8": lambda s, k: s.randint(k, (2, 3), -3, 3, jnp.int8),
    "randint_u32": lambda s, k: s.randint(k, (2,), 0, 10, jnp.uint32),
    "randint_broadcast": lambda s, k: s.randint(k, (2, 3), jnp.zeros((2, 1), jnp.int32), jnp.array([1, 5, 9])),
}


@pytest.mark.parametrize("name", sorted(_CALLS))
def test_debug_outputs_have_the_shapes_and_dtypes_of_the_secure_suite(name):
    call = _CALLS[name]
    # abstract evaluation traces the very code that runs, without compiling it
    secure = jax.eval_shape(lambda k: call(d3p.random, k), d3p.random.PRNGKey(0))
    debug = jax.eval_shape(lambda k: call(d3p.random.debug, k), _debug_key())
    assert secure.shape == debug.shape and secure.dtype == debug.dtype


def test_debug_and_secure_concrete_outputs_agree_in_shape_and_dtype():
    secure_key, debug_key = d3p.random.PRNGKey(0), _debug_key()
    for name in ("uniform_bounds", "randint_broadcast"):
        secure, debug = _CALLS[name](d3p.random, secure_key), _CALLS[name](d3p.random.debug, debug_key)
        assert secure.shape == debug.shape and secure.dtype == debug.dtype, name


def test_debug_key_derivation_and_determinism():
    key = _debug_key(5)
    children = d3p.random.debug.split(key, 4)
    assert children.shape[0] == 4 and children.shape[1:] == key.shape
    assert len({tuple(np.asarray(c).tolist()) for c in children}) == 4
    assert d3p.random.debug.fold_in(key, 3).shape == key.shape
    np.testing.assert_array_equal(
        np.asarray(d3p.random.debug.normal(key, (5,))), np.asarray(d3p.random.debug.normal(_debug_key(5), (5,)))
    )
    jax_key = d3p.random.debug.convert_to_jax_rng_key(key)
    assert jax.random.normal(jax_key, (2,)).shape == (2,)
    u = np.asarray(d3p.random.debug.uniform(key, (1000,), minval=2.0, maxval=3.0))
    assert np.all((u >= 2.0) & (u < 3.0))


@pytest.mark.parametrize(
    "call, error, name",
    [
        (lambda s, k: s.randint(k, (3,), 0), TypeError, "maxval"),
        (lambda s, k: s.random_bits(k, 12), ValueError, "bit_width"),
        (lambda s, k: s.random_bits(k, 64), ValueError, "bit_width"),
    ],
)
@pytest.mark.float32
def test_debug_rejects_what_the_secure_suite_rejects(call, error, name):
    with pytest.raises(error, match=name):
        call(d3p.random, d3p.random.PRNGKey(0))
    with pytest.raises(error, match=name):
        call(d3p.random.debug, _debug_key())


def test_prngkey_from_any_integer_or_bytes_as_in_d3p_02():
    """Integers are reduced modulo 2**256; bytes are a little-endian integer."""
    key = lambda seed: np.asarray(d3p.random.PRNGKey(seed))  # noqa: E731
    np.testing.assert_array_equal(key(-1), key(2**256 - 1))
    np.testing.assert_array_equal(key(np.int64(-5)), key(2**256 - 5))
    np.testing.assert_array_equal(key(2**256), key(0))
    np.testing.assert_array_equal(key(2**300 + 7), key((2**300 + 7) % 2**256))
    np.testing.assert_array_equal(key(b"\x01\x02"), key(0x0201))
    np.testing.assert_array_equal(key(bytearray(b"seed")), key(int.from_bytes(b"seed", "little")))
    np.testing.assert_array_equal(key(bytes(40)), key(0))
    assert key(b"\xff" * 32).tolist() == [2**32 - 1] * 8
