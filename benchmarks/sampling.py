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
"""

import argparse
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--max-exponent", type=int, default=8, help="largest N is 10**this")
    parser.add_argument("--max-seconds", type=float, default=2.0, help="stop a method after a call this slow")
    parser.add_argument("--max-memory-gib", type=float, default=16.0)
    parser.add_argument("--output", default=os.path.join(HERE, "output", "sampling.png"))
    args = parser.parse_args()

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
