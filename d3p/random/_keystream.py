"""The ChaCha20 block function and keystream of :mod:`d3p.random`, one program per platform.

Every function here computes RFC 8439's ChaCha20 exactly; the platforms
differ only in how, and the choice is made when a program is lowered
(``jax.lax.platform_dependent``), not from the default backend at trace time,
so that a program lowered for one platform and run there gets that platform's
code:

- **GPUs and other accelerators** (``default`` branch): the ten double rounds
  as a loop of known trip count (``fori_loop``), each double round computed
  once for all blocks at a time, with the state held as four rows of four
  words (``_blocks_as_rows``, as on CPU): each step of a round is one
  operation on a row of every block. Written out without a loop, XLA gave
  each of the 16 output words its own fusion, which recomputed that word's
  whole dependency chain from the key: about 25,000 optimized operations for
  one keystream, and a step that took a minute to compile on a GPU. The
  loop's body is one double round: the lowered program holds one copy of it
  (one block function lowers to 139 operations; sixteen separate words took 367).
- **CPU** (``cpu`` branch): XLA:CPU splits each written-out round into
  kernels that pass the state through memory and compiles such code slowly,
  so the rounds stay a ``fori_loop`` on the rows (sixteen separate words
  compiled into 47 to 78 kernels per call, the rows into 9 to 20); a few
  blocks are computed one at a time (``lax.map``), long keystreams in
  cache-sized tiles. Keystreams of
  :data:`HOST_MIN_BLOCKS` blocks or more come from OpenSSL's ChaCha20 (through
  the ``cryptography`` package, in a ``jax.pure_callback``), which follows
  RFC 8439 and so yields the same words for the same key, nonce and counter;
  it is about five times faster than the looped rounds for the noise of a
  large model. Where OpenSSL's ChaCha20 is unavailable, the tiles are used.
- **Outside a traced program** (key derivations on concrete keys: ``split``,
  ``fold_in``, ``convert_to_jax_rng_key`` in a run's set-up), blocks of up to
  :data:`HOST_EAGER_MAX_BLOCKS` come from NumPy (:func:`block_words`): an
  eager call compiles nothing, where each shape of it compiled a program.

``tests/test_random.py`` checks every branch bit for bit against OpenSSL and
RFC 8439's test vectors (the host branch: ``tests/test_random_host_blocks.py``),
and ``tests/test_random_platforms.py`` checks that the program lowered for
CUDA holds one double round per block function and no host call.
"""

import functools
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from d3p.random._common import on_the_host, rotl_u32

KEY_WORDS = 8
_CONSTANTS = np.array([0x61707865, 0x3320646E, 0x79622D32, 0x6B206574], dtype=np.uint32)

#: Nonce word 0 of the keystream read by ``random_bits`` and the draws built on it.
NONCE_BITS = 0

# up to this many blocks, the CPU block function computes one block at a time
_SMALL_BLOCKS = 8

#: Up to this many blocks, a private step's keys (its own and its Monte Carlo
#: keys, ``d3p.random.chacha.split_with_jax_keys``: 33 blocks for 256 records)
#: are computed one block at a time on CPU: half the compile time of the
#: vectorised rounds, a few microseconds more per step (see :func:`_blocks_cpu`).
KEY_LOOP_BLOCKS = 64

# On CPU the looped block function is limited by memory traffic: each step of
# a round is a pass over 16 state arrays of one word per block. Generated in
# tiles of this many blocks (16 x 4 KiB x 4 = 256 KiB of state), the state
# stays in the cache (1.5 to 2.2 times faster for 86,000 blocks). The
# keystream is the same either way.
_TILE_BLOCKS = 4096

#: From this many blocks on, the CPU keystream comes from OpenSSL (when
#: available): below it, the host call costs more than it saves.
HOST_MIN_BLOCKS = 512


def _quarter_round(s, a, b, c, d):
    """The quarter round on words ``a, b, c, d`` of the state ``s`` (a list), in place."""
    s[a], s[b], s[c], s[d] = _quarter_round_rows(s[a], s[b], s[c], s[d])


def _double_round(state):
    """One double round of the state held as sixteen words (the host's NumPy
    block function, :func:`_blocks_host`)."""
    s = list(state)
    _quarter_round(s, 0, 4, 8, 12)
    _quarter_round(s, 1, 5, 9, 13)
    _quarter_round(s, 2, 6, 10, 14)
    _quarter_round(s, 3, 7, 11, 15)
    _quarter_round(s, 0, 5, 10, 15)
    _quarter_round(s, 1, 6, 11, 12)
    _quarter_round(s, 2, 7, 8, 13)
    _quarter_round(s, 3, 4, 9, 14)
    return tuple(s)


def _quarter_round_rows(a, b, c, d):
    """RFC 8439's quarter round on four words, or on four rows of the state at
    once (``a, b, c, d`` holding words ``j``, ``4 + j``, ``8 + j``, ``12 + j``
    for every column ``j`` and every block)."""
    a = a + b
    d = rotl_u32(d ^ a, 16)
    c = c + d
    b = rotl_u32(b ^ c, 12)
    a = a + b
    d = rotl_u32(d ^ a, 8)
    c = c + d
    b = rotl_u32(b ^ c, 7)
    return a, b, c, d


def _double_round_rows(_, x):
    """One double round of blocks held as rows: ``x`` is ``uint32[4, 4, n]``
    (row, column, block), word ``4 r + j`` of block ``k`` at ``x[r, j, k]``.
    The column round is the quarter round on the four rows; the diagonal
    round is the same on rows 1, 2 and 3 turned left by 1, 2 and 3 columns
    (so that column ``j`` holds words ``j``, ``4 + (j+1) % 4``, ``8 + (j+2) % 4``,
    ``12 + (j+3) % 4``: RFC 8439's diagonals), turned back after."""
    a, b, c, d = _quarter_round_rows(x[0], x[1], x[2], x[3])
    a, b, c, d = _quarter_round_rows(a, jnp.roll(b, -1, 0), jnp.roll(c, -2, 0), jnp.roll(d, -3, 0))
    return jnp.stack([a, jnp.roll(b, 1, 0), jnp.roll(c, 2, 0), jnp.roll(d, 3, 0)])


def _blocks_as_rows(key, counter, nonce) -> jax.Array:
    """Keystream blocks ``(*shape, 16)`` for broadcast ``counter`` and
    ``nonce`` words, with the state held as four rows of four words for
    every block (:func:`_double_round_rows`): each step of a round is one
    operation on a row of every block. XLA:CPU compiles the loop into a few
    kernels, where sixteen separate words gave some sixty (a block function
    compiled in about a third of the time); lowered for CUDA, the loop's body
    and its set-up lower to 139 operations, where sixteen separate words took 367."""
    shape = jnp.broadcast_shapes(counter.shape, *(n.shape for n in nonce))
    n = int(np.prod(shape, dtype=np.int64))
    last = jnp.stack([jnp.broadcast_to(x, shape).reshape(n) for x in [counter, *nonce]])
    init = jnp.concatenate([
        jnp.broadcast_to(jnp.asarray(_CONSTANTS)[:, None], (4, n)),
        jnp.broadcast_to(jnp.asarray(key, jnp.uint32)[:, None], (KEY_WORDS, n)),
        last,
    ]).reshape(4, 4, n)
    out = lax.fori_loop(0, 10, _double_round_rows, init)
    return (out + init).reshape(16, n).T.reshape(shape + (16,))


@functools.partial(jax.jit, static_argnums=3)
def _blocks_cpu(key, counter, nonce, loop_blocks: int = _SMALL_BLOCKS) -> jax.Array:
    """The CPU block function: looped rounds on the state held as rows
    (:func:`_blocks_as_rows`); up to ``loop_blocks`` blocks one at a time (XLA
    compiles a loop over single blocks into one call, where it runs rounds
    vectorised over a few blocks as several kernels: for key derivations and
    short draws the loop is faster, and it compiles in about half the time:
    0.2 s against 0.4 s for 17 to 513 blocks, 2 cores; at run time 25 against
    22 microseconds for 17 blocks, 64 against 31 for 65, 420 against 108 for
    513)."""
    shape = jnp.broadcast_shapes(counter.shape, *(n.shape for n in nonce))
    size = int(np.prod(shape, dtype=np.int64))
    if 1 < size <= loop_blocks:
        flat = [jnp.broadcast_to(x, shape).reshape(-1) for x in [counter, *nonce]]
        blocks = lax.map(lambda xs: _blocks_as_rows(key, xs[0], xs[1:]), flat)
        return blocks.reshape(shape + (16,))
    return _blocks_as_rows(key, counter, nonce)


@jax.jit
def _blocks_vectorised(key, counter, nonce) -> jax.Array:
    """The block function of GPUs and other accelerators: looped rounds on the
    state held as rows, all blocks at once. (Jitted, as :func:`_blocks_cpu`:
    traced once per shape, not at every use.)"""
    return _blocks_as_rows(key, counter, nonce)


def per_platform(cpu: Callable, other: Callable, *args):
    """``cpu(*args)`` in a program lowered for CPU, ``other(*args)`` elsewhere;
    chosen at lowering time (``jax.lax.platform_dependent``)."""
    return lax.platform_dependent(*args, cpu=cpu, default=other)


#: Up to this many blocks, a block function called outside a traced program
#: on concrete values is computed on the host (:func:`_blocks_host`): a key
#: derivation then compiles nothing (each shape of it compiled a program of
#: its own, 0.1 to 0.5 s, in every process).
HOST_EAGER_MAX_BLOCKS = 64


def _blocks_host(key, counter, nonce) -> np.ndarray:
    """The block function in NumPy (``uint32`` arithmetic wraps, as XLA's):
    the sixteen words as arrays over the blocks, :func:`_double_round` ten times."""
    shape = np.broadcast_shapes(np.shape(counter), *(np.shape(n) for n in nonce))
    size = int(np.prod(shape, dtype=np.int64))
    if size == 0:
        return np.zeros(shape + (16,), np.uint32)

    def flat(x):   # at least one dimension: NumPy's scalars warn where they wrap
        return np.broadcast_to(np.asarray(x, np.uint32), shape).reshape(size).copy()

    key = np.asarray(key, np.uint32)
    init = ([np.full(size, c, np.uint32) for c in _CONSTANTS] + [np.full(size, key[i]) for i in range(KEY_WORDS)]
            + [flat(counter)] + [flat(n) for n in nonce])
    state = tuple(init)
    for _ in range(10):
        state = _double_round(state)
    return np.stack([o + i for o, i in zip(state, init)], axis=-1).reshape(shape + (16,))


def _on_host(*values) -> bool:
    """Whether a block function of ``values`` (key, counter, nonce words) is
    computed on the host: every value :func:`on_the_host`, and at most
    :data:`HOST_EAGER_MAX_BLOCKS` blocks."""
    if not all(on_the_host(value) for value in values):
        return False
    shape = np.broadcast_shapes(*(np.shape(v) for v in values[1:]))
    return int(np.prod(shape, dtype=np.int64)) <= HOST_EAGER_MAX_BLOCKS


def block_words(key, counter, nonce: Sequence, words: int = 16, loop_blocks: Optional[int] = None) -> jax.Array:
    """The first ``words`` words of each block of :func:`chacha20_block`:
    sliced on the host where the block function runs there, so that a key
    derivation outside a traced program compiles nothing. ``loop_blocks``:
    see :func:`chacha20_block`."""
    if _on_host(key, counter, *nonce):
        return jax.device_put(_blocks_host(key, counter, nonce)[..., :words])
    if loop_blocks is None:
        return chacha20_block(key, counter, nonce)[..., :words]
    return chacha20_block(key, counter, nonce, loop_blocks=loop_blocks)[..., :words]


def chacha20_block(key: jax.Array, counter: jax.Array, nonce: Sequence, loop_blocks: int = _SMALL_BLOCKS) -> jax.Array:
    """The ChaCha20 block function of RFC 8439, section 2.3.

    :param jax.Array key: ``uint32[8]``, the 256-bit key as little-endian words.
    :param jax.Array counter: ``uint32`` array of block counters (any shape ``S``).
    :param nonce: three ``uint32`` words (scalars or arrays broadcastable to ``S``).
    :param int loop_blocks: on CPU, up to this many blocks are computed one
        at a time (see :func:`_blocks_cpu`); the words are the same.
    :return: ``uint32`` array of shape ``S + (16,)``: the serialised keystream
        blocks as little-endian words. The rounds are a loop on every
        platform, arranged per platform (see the module docstring); the
        words are the same.
    """
    key = jnp.asarray(key, dtype=jnp.uint32)
    counter = jnp.asarray(counter, dtype=jnp.uint32)
    nonce = [jnp.asarray(n, dtype=jnp.uint32) for n in nonce]
    return per_platform(
        lambda k, c, *n: _blocks_cpu(k, c, n, loop_blocks),
        lambda k, c, *n: _blocks_vectorised(k, c, n),
        key, counter, *nonce,
    )


def _tile_counters(num_blocks: int) -> jax.Array:
    """Block counters 0, 1, ... in equal tiles of at most _TILE_BLOCKS, shape
    (tiles, tile); the last tile may run past num_blocks."""
    num_tiles = -(-num_blocks // _TILE_BLOCKS)
    tile = -(-num_blocks // num_tiles)
    return jnp.arange(num_tiles * tile, dtype=jnp.uint32).reshape(num_tiles, tile)


def keystream_in_tiles(key, num_blocks: int, tile_fn: Callable) -> jax.Array:
    """``tile_fn(blocks of one tile)`` for every tile of the first ``num_blocks``
    blocks of the keystream under the nonce of ``random_bits`` (CPU, looped
    rounds), concatenated along the first axis (which may run past
    ``num_blocks``: callers slice)."""
    nonce = [jnp.uint32(NONCE_BITS), jnp.uint32(0), jnp.uint32(0)]
    tiles = lax.map(lambda c: tile_fn(_blocks_as_rows(key, c, nonce)), _tile_counters(num_blocks))
    return tiles.reshape((-1,) + tiles.shape[2:])


# ----------------------------------------------------------------------------
# the host cipher (OpenSSL, through the cryptography package)


@functools.lru_cache(maxsize=1)
def _host_cipher():
    """``(Cipher, ChaCha20)`` of the ``cryptography`` package if its OpenSSL
    provides ChaCha20, else None."""
    try:
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

        Cipher(algorithms.ChaCha20(bytes(32), bytes(16)), mode=None).encryptor().update(bytes(64))
    except Exception:  # noqa: BLE001 - not installed, or an OpenSSL without ChaCha20
        return None
    return Cipher, algorithms.ChaCha20


def host_cipher_available() -> bool:
    """Whether CPU programs take long keystreams from OpenSSL (see the module docstring)."""
    return _host_cipher() is not None


_ZEROS = [bytes(0)]


def _zeros(num_bytes: int) -> memoryview:
    """A read-only view of ``num_bytes`` zero bytes, reused between calls."""
    if len(_ZEROS[0]) < num_bytes:
        _ZEROS[0] = bytes(num_bytes)
    return memoryview(_ZEROS[0])[:num_bytes]


def _host_words(key_words: np.ndarray, num_words: int) -> np.ndarray:
    """The first ``num_words`` words of the keystream under the nonce of
    ``random_bits``, counter 0, for every key in ``key_words`` (``(..., 8)``)."""
    cipher, chacha20 = _host_cipher()
    key_words = np.asarray(key_words, dtype=np.uint32)
    batch = key_words.shape[:-1]
    num_bytes = 4 * num_words
    out = np.empty(batch + (num_words,), dtype=np.uint32)
    # OpenSSL's 16-byte IV: the 32-bit block counter, then the three nonce words
    iv = np.array([0, NONCE_BITS, 0, 0], dtype="<u4").tobytes()
    zeros = _zeros(num_bytes)
    for index in np.ndindex(batch):
        encryptor = cipher(chacha20(key_words[index].astype("<u4").tobytes(), iv), mode=None).encryptor()
        encryptor.update_into(zeros, out[index].view(np.uint8))
    if not np.little_endian:  # OpenSSL wrote little-endian words
        out.byteswap(inplace=True)
    return out


def _host_keystream(key, num_words: int) -> jax.Array:
    """The keystream words from OpenSSL, inside a traced program (``pure_callback``;
    under ``vmap`` one host call handles every key)."""
    return jax.pure_callback(
        functools.partial(_host_words, num_words=num_words),
        jax.ShapeDtypeStruct((num_words,), jnp.uint32),
        key,
        vmap_method="expand_dims",
    )


def _keystream_cpu(key, num_words: int) -> jax.Array:
    num_blocks = -(-num_words // 16)
    if num_blocks >= HOST_MIN_BLOCKS and host_cipher_available():
        return _host_keystream(key, num_words)
    if num_blocks > 2 * _TILE_BLOCKS:
        return keystream_in_tiles(key, num_blocks, lambda blocks: blocks).reshape(-1)[:num_words]
    nonce = [jnp.uint32(NONCE_BITS), jnp.uint32(0), jnp.uint32(0)]
    return _blocks_cpu(key, jnp.arange(num_blocks, dtype=jnp.uint32), nonce).reshape(-1)[:num_words]


def _keystream_vectorised(key, num_words: int) -> jax.Array:
    num_blocks = -(-num_words // 16)
    nonce = [jnp.uint32(NONCE_BITS), jnp.uint32(0), jnp.uint32(0)]
    return _blocks_vectorised(key, jnp.arange(num_blocks, dtype=jnp.uint32), nonce).reshape(-1)[:num_words]


def keystream_words(key: jax.Array, num_words: int) -> jax.Array:
    """The first ``num_words`` (``>= 1``) words of the keystream of ``key``
    under the nonce of ``random_bits``, block counter 0 on: ``uint32[num_words]``."""
    return per_platform(
        functools.partial(_keystream_cpu, num_words=num_words),
        functools.partial(_keystream_vectorised, num_words=num_words),
        key,
    )
