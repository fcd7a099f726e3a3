"""Time to draw one batch of B=128 distinct indices as the data set size N grows.

Compares, jitted, after warm-up, median of repeats, on the default JAX device:

- ``exact``: :class:`d3p.minibatch.FixedSizeSampler` (sequential distinct
  draws, exactly uniform), with the ChaCha20 suite :mod:`d3p.random`;
- ``exact-jaxrng``: the same with :mod:`d3p.random.debug` (JAX's PRNG), to
  separate the method's cost from ChaCha20's;
- ``feistel``: :func:`d3p.minibatch.feistel_permutation` of positions 0..B-1
  (8 rounds, ChaCha20 round function; not exactly uniform);
- ``choice``: ``jax.random.choice(key, N, (B,), replace=False)``;
- ``permutation``: ``jax.random.permutation(key, N)[:B]``.

Only index sampling is timed, not gathering data. A baseline is skipped for
larger N once one call takes longer than ``--max-seconds`` (its cost grows
linearly or worse in N), and every method is skipped where its working memory
would exceed ``--max-memory-gib``.

Run: ``python benchmarks/sampling.py`` (a few minutes on 2 CPU cores). Prints
a Markdown table and writes ``benchmarks/output/sampling.png`` and a copy at
``benchmarks/sampling.png``.

``python benchmarks/sampling.py --chunk`` measures instead the samplers as
``DPSVI.run`` uses them: per step of a compiled chunk of ``lax.scan`` steps
(N = 10**6, B = 1024; the Poisson sampler pads to 1,312), the draw of the
batches alone and the whole private step of the paper's logistic regression
(``d3p._run``'s compiled chunk), configurations interleaved over rounds:
``argsort`` is the duplicate search of the previous code (a stable argsort of
the found values and the candidates, and a scatter back to draw order),
``sort`` the search of :func:`d3p.minibatch._first_occurrences` (one sort of
packed words), ``vmap over steps`` the same draws for 64 steps at a time under
``vmap`` (ChaCha20 keystream and sorts of a block of steps as one operation;
measured, not used by ``run``: see ``benchmarks/README.md``). The same
batches come out of all three. NumPyro SVI in a ``lax.scan`` with
``randint`` batches is the baseline of the whole step.

``python benchmarks/sampling.py --noise`` times the VAE's secure noise,
``d3p.random.normal`` for 688,884 values, and its parts (OpenSSL's ChaCha20
keystream on one thread and in two pieces on two threads, the float32
transform in XLA) against ``jax.random.normal``, interleaved.
"""

import argparse
import functools
import os
import platform
import shutil
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import d3p.random
import d3p.random.debug
from d3p import _samplers, minibatch
from d3p.minibatch import FixedSizeSampler, feistel_permutation

HERE = os.path.dirname(os.path.abspath(__file__))

# bytes of working memory per record, a rough upper estimate, for the O(N) baselines
_BYTES_PER_RECORD = {"choice": 48, "permutation": 48}


def make_methods(num_records: int, batch_size: int):
    sampler = FixedSizeSampler(num_records, batch_size)
    positions = jnp.arange(batch_size)
    return {
        "exact": (lambda k: sampler.sample(k, d3p.random)[0], "d3p"),
        "exact-jaxrng": (lambda k: sampler.sample(k, d3p.random.debug)[0], "jax"),
        "feistel": (lambda k: feistel_permutation(k, positions, num_records), "d3p"),
        "choice": (lambda k: jax.random.choice(k, num_records, (batch_size,), replace=False), "jax"),
        "permutation": (lambda k: jax.random.permutation(k, num_records)[:batch_size], "jax"),
    }


def time_method(fn, keys, max_seconds: float):
    f = jax.jit(fn)
    f(keys[0]).block_until_ready()  # compile and warm up
    t0 = time.perf_counter()
    f(keys[1]).block_until_ready()
    first = time.perf_counter() - t0
    repeats = int(min(len(keys) - 2, max(3, 1.0 / max(first, 1e-6))))
    if first > max_seconds:
        repeats = 1
    times = [first]
    for k in keys[2 : 2 + repeats - 1]:
        t0 = time.perf_counter()
        f(k).block_until_ready()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), len(times)


def _distinct_uniform_argsort(rng_key, num, num_records, rng_suite):
    """The fixed-size sampler's single pass with the previous duplicate search
    (stable argsort of the found values and the candidates, scatter back), for
    comparison; the same output as :func:`d3p.minibatch._distinct_uniform`
    wherever that takes one pass."""
    block = minibatch._single_pass_draws(num, num_records)
    assert block is not None
    sentinel = minibatch._SENTINEL
    words = rng_suite.random_bits(rng_suite.fold_in(rng_key, jnp.uint32(0)), 32, (block,))
    values, accepted = minibatch._uniform_below(words, num_records)
    cand = jnp.where(accepted, values, sentinel)
    found = jnp.full((num,), sentinel, jnp.int32)
    pool = jnp.concatenate([found, cand])
    order = jnp.argsort(pool, stable=True)
    sorted_pool = pool[order]
    first = jnp.concatenate([jnp.ones((1,), bool), sorted_pool[1:] != sorted_pool[:-1]])
    new = jnp.zeros(num + block, bool).at[order].set(first & (sorted_pool != sentinel))[num:]
    slot = jnp.cumsum(new.astype(jnp.int32)) - 1
    slot = jnp.where(new & (slot < num), slot, num)
    found = found.at[slot].set(cand, mode="drop")
    return found, jnp.sum(new, dtype=jnp.int32) >= num


def _vectorised_over_steps(sampler, key, length: int, block: int = 64):
    """The batches of steps 0..length-1 drawn ``block`` steps at a time under
    ``vmap`` (the same batches as step by step)."""
    from jax import lax

    blocks = -(-length // block)
    steps = jnp.arange(blocks * block, dtype=jnp.uint32).reshape(blocks, block)
    draw = jax.vmap(lambda i: minibatch._draw_checked(sampler, d3p.random.fold_in(key, i), d3p.random)[:2])
    drawn = lax.map(draw, steps)
    return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:])[:length], drawn)


def chunk_benchmark(num_records: int, batch_size: int, length: int, rounds: int):
    """Per-step times in a compiled chunk of steps (see the module docstring)."""
    import numpyro
    from jax import lax
    from numpyro.infer import SVI, Trace_ELBO

    from d3p import _run
    from d3p._paper_models import logistic_regression_guide, logistic_regression_model
    from d3p.svi import DPSVI

    rng = np.random.default_rng(0)
    xs = jnp.asarray(rng.normal(size=(num_records, 30)).astype(np.float32))
    ys = jnp.asarray((rng.random(num_records) < 0.5).astype(np.float32))
    samplers = {"poisson": minibatch.PoissonSampler(num_records, batch_size / num_records),
                "fixed": minibatch.FixedSizeSampler(num_records, batch_size)}
    variants = {"argsort": _distinct_uniform_argsort, "sort": minibatch._distinct_uniform}
    original = _samplers._distinct_uniform  # where the samplers look it up
    key = d3p.random.PRNGKey(1)
    fns, outputs, compile_seconds = {}, {}, {}
    treedef = jax.tree.structure(((0, 0), {}))
    for sname, sampler in samplers.items():
        for vname, distinct in [*variants.items(), ("vmap", minibatch._distinct_uniform)]:
            _samplers._distinct_uniform = distinct
            minibatch._sample_batch_jit.clear_cache()  # traced again with this variant
            try:
                if vname == "vmap":
                    draw_fn = jax.jit(lambda k, s=sampler: _vectorised_over_steps(s, k, length))
                else:
                    draw_fn = jax.jit(lambda k, s=sampler: lax.map(lambda i: minibatch._draw_checked(
                        s, d3p.random.fold_in(k, i), d3p.random)[:2], jnp.arange(length, dtype=jnp.uint32)))
                start = time.process_time()
                outputs[sname, vname] = jax.device_get(draw_fn(key))
                compile_seconds[sname, vname] = time.process_time() - start
                fns[sname, "draw", vname] = functools.partial(draw_fn, key)
                if vname == "vmap":
                    continue
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    dpsvi = DPSVI(logistic_regression_model, logistic_regression_guide, numpyro.optim.Adam(1e-3),
                                  Trace_ELBO(), clipping_threshold=1.0, dp_scale=1.0, N=num_records)
                state = dpsvi.init(d3p.random.PRNGKey(0), xs[:batch_size], ys[:batch_size])
                gather = _run._batch_gatherer(sampler, d3p.random, treedef)
                run_chunk = _run._compiled_chunks(dpsvi.update, gather, sampler.expected_batch_size, False,
                                                  dpsvi.optim.get_params, d3p.random.fold_in)
                no_average = (dpsvi.optim.get_params(state.optim_state), jnp.zeros((), jnp.int32))
                chunk = functools.partial(run_chunk, state, no_average, _run.step_keys(d3p.random, key)[1:],
                                          jnp.uint32(0), jnp.uint32(length), [xs, ys], length)
                jax.block_until_ready(chunk())  # compiled while the variant is in place
                fns[sname, "step", vname] = chunk
            finally:
                _samplers._distinct_uniform = original
                minibatch._sample_batch_jit.clear_cache()
        for vname in ("sort", "vmap"):
            for a, b in zip(outputs[sname, vname], outputs[sname, "argsort"]):
                assert (np.asarray(a) == np.asarray(b)).all(), "the variants must draw the same batches"

    svi = SVI(logistic_regression_model, logistic_regression_guide, numpyro.optim.Adam(1e-3), Trace_ELBO(),
              N=num_records)
    svi_state = svi.init(jax.random.PRNGKey(0), xs[:batch_size], ys[:batch_size])

    def svi_step(state, k):
        idx = jax.random.randint(k, (batch_size,), 0, num_records)
        return svi.update(state, jnp.take(xs, idx, axis=0), jnp.take(ys, idx, axis=0))

    svi_loop = jax.jit(lambda s, k: lax.scan(svi_step, s, jax.random.split(k, length)))
    fns["svi", "step", "randint"] = functools.partial(svi_loop, svi_state, jax.random.PRNGKey(0))
    jax.block_until_ready(fns["svi", "step", "randint"]())

    times = {name: [] for name in fns}
    for _ in range(rounds):  # interleaved: load from other processes hits every configuration alike
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append((time.perf_counter() - start) / length)
    t = {name: np.asarray(v) for name, v in times.items()}
    med = lambda name: f"{1e6 * float(np.median(t[name])):.1f}"
    ratio = lambda a, b: f"{float(np.median(t[a] / t[b])):.2f}"
    svi_t = ("svi", "step", "randint")
    print(f"# N={num_records:,d}, B={batch_size}, {length} steps per chunk, {rounds} rounds, "
          f"jax {jax.__version__}, {os.cpu_count()} CPU cores; µs per step, ratios: median over rounds")
    print("| sampler | what | argsort | sort | sort / argsort | vmap over steps | vmap / sort | argsort / SVI step "
          "| sort / SVI step |\n|---|---|---|---|---|---|---|---|---|")
    for sname in samplers:
        d = lambda v: (sname, "draw", v)
        print(f"| {sname} | draw | {med(d('argsort'))} | {med(d('sort'))} | {ratio(d('sort'), d('argsort'))} | "
              f"{med(d('vmap'))} | {ratio(d('vmap'), d('sort'))} | | |")
        s = lambda v: (sname, "step", v)
        print(f"| {sname} | private step | {med(s('argsort'))} | {med(s('sort'))} | "
              f"{ratio(s('sort'), s('argsort'))} | | | {ratio(s('argsort'), svi_t)} | {ratio(s('sort'), svi_t)} |")
    print(f"| svi | step, randint batches | {med(svi_t)} | | | | | | |")
    print("compile + first call of the draws of one chunk, CPU seconds: " + ", ".join(
        f"{s} {v} {compile_seconds[s, v]:.1f}" for s, v in compile_seconds))


def _host_keystream_in_pieces(key_words: np.ndarray, num_words: int, pool) -> np.ndarray:
    """The host keystream of ``d3p.random._keystream._host_words``, computed as
    two pieces on two threads (OpenSSL releases Python's lock), each from its
    own block counter: the same words."""
    from d3p.random import _keystream

    cipher, chacha20 = _keystream._host_cipher()
    out = np.empty(num_words, np.uint32)
    zeros = bytes(4 * num_words)
    key = np.asarray(key_words, "<u4").tobytes()
    half = (num_words // 2) // 16 * 16

    def piece(a, b):
        iv = np.array([a // 16, _keystream.NONCE_BITS, 0, 0], dtype="<u4").tobytes()
        cipher(chacha20(key, iv), mode=None).encryptor().update_into(zeros[4 * a:4 * b], out[a:b].view(np.uint8))

    for future in [pool.submit(piece, 0, half), pool.submit(piece, half, num_words)]:
        future.result()
    return out


def noise_benchmark(size: int, rounds: int):
    """The VAE's secure noise and its parts, against ``jax.random.normal``, interleaved."""
    from concurrent.futures import ThreadPoolExecutor

    from d3p.random import _keystream, chacha

    key = d3p.random.PRNGKey(3)
    key_words = np.asarray(key)
    host = _keystream.host_cipher_available()   # OpenSSL's ChaCha20 (the ``cryptography`` package)
    pool = ThreadPoolExecutor(2)
    if host:
        words = jnp.asarray(_keystream._host_words(key_words, 2 * size))
        assert (_host_keystream_in_pieces(key_words, 2 * size, pool) == np.asarray(words)).all()
    else:   # e.g. a GPU machine without the package: the keystream computed by XLA, and no host rows
        words = jax.jit(lambda k: _keystream.keystream_words(k, 2 * size))(key)
    normal = jax.jit(lambda k: d3p.random.normal(k, (size,)))
    transform = jax.jit(lambda w: chacha._normal_f32(w[0::2], w[1::2]))
    jax_normal = jax.jit(lambda k: jax.random.normal(k, (size,)))
    # an independent computation of about a VAE step's products (B = 128,
    # 784-400 layers): in one program with the noise, does XLA overlap them?
    images = jnp.asarray(np.random.default_rng(0).random((128, 784)).astype(np.float32))
    weights = jnp.asarray(np.random.default_rng(1).normal(size=(784, 400)).astype(np.float32))

    def products(a, w):
        for _ in range(3):
            a = jnp.tanh(a @ w) @ w.T
        return a.sum()

    work = jax.jit(lambda k, a, w: products(a, w))
    both = jax.jit(lambda k, a, w: d3p.random.normal(k, (size,)).sum() + products(a, w))
    fns = {
        "d3p.random.normal": lambda: normal(key),
        "products alone": lambda: work(key, images, weights),
        "normal and products in one program": lambda: both(key, images, weights),
        "jax.random.normal": lambda: jax_normal(jax.random.PRNGKey(0)),
        "float32 transform (XLA)": lambda: transform(words),
    }
    if host:
        fns["OpenSSL keystream, one thread"] = lambda: _keystream._host_words(key_words, 2 * size)
        fns["OpenSSL keystream, two threads"] = lambda: _host_keystream_in_pieces(key_words, 2 * size, pool)
    for fn in fns.values():
        jax.block_until_ready(fn())
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - start)
    t = {name: np.asarray(v) for name, v in times.items()}
    print(f"# {size:,d} standard normals, {rounds} rounds, jax {jax.__version__}, {os.cpu_count()} CPU cores, "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| what | ms (median) | ms (10th percentile) | ratio to jax.random.normal | ratio to d3p.random.normal |")
    print("|---|---|---|---|---|")
    for name, v in t.items():
        print(f"| {name} | {1e3 * np.median(v):.2f} | {1e3 * np.percentile(v, 10):.2f} | "
              f"{np.median(v / t['jax.random.normal']):.2f} | {np.median(v / t['d3p.random.normal']):.2f} |")
    # per draw inside one compiled loop (no dispatch per draw): the device's own time
    def in_a_loop(normal, fold_in):
        return jax.jit(lambda k: jax.lax.fori_loop(
            0, 100, lambda i, acc: acc + normal(fold_in(k, i), (size,))[::997].sum(), 0.0))

    loops = {
        "d3p.random.normal": in_a_loop(d3p.random.normal, d3p.random.fold_in),
        "jax.random.normal": in_a_loop(jax.random.normal, jax.random.fold_in),
    }
    keys = {"d3p.random.normal": key, "jax.random.normal": jax.random.PRNGKey(0)}
    per_draw = {}
    for name, fn in loops.items():
        jax.block_until_ready(fn(keys[name]))
        reps = []
        for _ in range(max(3, rounds // 5)):
            start = time.perf_counter()
            jax.block_until_ready(fn(keys[name]))
            reps.append((time.perf_counter() - start) / 100)
        per_draw[name] = float(np.median(reps))
        print(f"{name}: {1e6 * per_draw[name]:.1f} us per draw of {size:,d} inside a jitted loop of 100")
    overlap = np.median(t["normal and products in one program"] / (t["d3p.random.normal"] + t["products alone"]))
    print(f"normal and products in one program / (normal + products alone): {overlap:.2f} "
          "(1.00: no overlap; 0.5 at best on two cores)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--max-exponent", type=int, default=8, help="largest N is 10**this")
    parser.add_argument("--max-seconds", type=float, default=2.0, help="stop a method after a call this slow")
    parser.add_argument("--max-memory-gib", type=float, default=16.0)
    parser.add_argument("--output", default=os.path.join(HERE, "output", "sampling.png"))
    parser.add_argument("--chunk", action="store_true", help="run's compiled chunk instead (see above)")
    parser.add_argument("--chunk-records", type=int, default=10**6)
    parser.add_argument("--chunk-batch-size", type=int, default=1024)
    parser.add_argument("--chunk-length", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--noise", action="store_true", help="the VAE's secure noise instead (see above)")
    parser.add_argument("--noise-size", type=int, default=688_884)
    args = parser.parse_args()
    if args.noise:
        noise_benchmark(args.noise_size, 4 * args.rounds)
        return
    if args.chunk:
        chunk_benchmark(args.chunk_records, args.chunk_batch_size, args.chunk_length, args.rounds)
        return

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        jax_keys = [jax.random.PRNGKey(i) for i in range(60)]
        debug_keys = [d3p.random.debug.PRNGKey(i) for i in range(60)]
    d3p_keys = [d3p.random.PRNGKey(i) for i in range(60)]
    key_sets = {"d3p": d3p_keys, "jax": jax_keys}
    del debug_keys

    sizes = [10**e for e in range(3, args.max_exponent + 1)]
    names = list(make_methods(10, 1).keys())
    results = {name: {} for name in names}
    stopped = set()
    print(f"# B={args.batch_size}, device={jax.devices()[0].platform}, jax {jax.__version__}, "
          f"{os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}", flush=True)
    for n in sizes:
        for name, (fn, suite) in make_methods(n, args.batch_size).items():
            if name in stopped:
                continue
            if n * _BYTES_PER_RECORD.get(name, 0) > args.max_memory_gib * 2**30:
                stopped.add(name)
                continue
            seconds, repeats = time_method(fn, key_sets[suite], args.max_seconds)
            results[name][n] = seconds
            print(f"N={n:>10,d}  {name:<13s} {seconds * 1e3:10.3f} ms  (median of {repeats})", flush=True)
            if seconds > args.max_seconds:
                stopped.add(name)

    header = "| N | " + " | ".join(names) + " |"
    print()
    print(header)
    print("|" + "---|" * (len(names) + 1))
    for n in sizes:
        cells = [f"{results[name][n] * 1e3:.3f}" if n in results[name] else "skipped" for name in names]
        print(f"| 1e{int(np.log10(n))} | " + " | ".join(cells) + " |")
    print("(milliseconds per batch)")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for name in names:
        xs = sorted(results[name])
        ax.plot(xs, [results[name][x] * 1e3 for x in xs], marker="o", label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("number of records N")
    ax.set_ylabel("time per batch [ms]")
    ax.set_title(f"Drawing B={args.batch_size} distinct indices (jit, CPU, median)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    fig.savefig(args.output, dpi=110)
    committed = os.path.join(HERE, "sampling.png")
    if os.path.abspath(args.output) != committed:
        shutil.copyfile(args.output, committed)
    print(f"wrote {args.output} and {committed}")


if __name__ == "__main__":
    main()
