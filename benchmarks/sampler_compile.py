"""What a sampler's program costs to build: its trace, lowering and XLA
compilation on the CPU, its size, and the ChaCha20 block functions in it.

A private run's compiled chunk holds its sampler's draw (``sample`` of a batch
key), so what the draw costs to compile is part of every first ``run()``. For
the samplers below, ``jax.jit(lambda key: sampler.sample(key))`` is traced,
lowered and compiled ``--rounds`` times in one process (a fresh ``jax.jit``
each time: nothing cached but XLA's own), medians printed: trace + lower and
compile seconds, optimized ops (``" = "`` lines of the compiled CPU program),
CUDA-lowered ops (the StableHLO lowered for CUDA on this machine, no GPU
needed) and the CUDA program's ChaCha20 double-round loops (one per call of
the block function).

Usage::

    python benchmarks/sampler_compile.py [--rounds 5]

The ``d3p`` on the import path is measured: with ``PYTHONPATH=<a worktree of
an earlier commit>`` the same script measures that commit.
"""

import argparse
import os
import sys
import time

import jax
import numpy as np

import d3p.random
from d3p.minibatch import FixedSizeSampler, PoissonSampler

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from _lowered import round_loops  # noqa: E402

#: ``(label, sampler)``: the README's job (breast cancer, N = 455 training records, B = 32), a
#: small Poisson sampler with a tight shape, and a large data set.
SAMPLERS = [
    ("Poisson, N = 455, q = 32/455", PoissonSampler(455, 32 / 455)),
    ("fixed size, N = 455, B = 32", FixedSizeSampler(455, 32)),
    ("Poisson, N = 100, q = 0.5, at most 5", PoissonSampler(100, 0.5, max_batch_size=5)),
    ("Poisson, N = 10**6, q = 1024/10**6", PoissonSampler(10**6, 1024 / 10**6)),
    ("fixed size, N = 10**6, B = 1024", FixedSizeSampler(10**6, 1024)),
]


def _ops(text: str) -> int:
    return sum(1 for line in text.splitlines() if " = " in line)


def measure(sampler, rounds: int) -> dict:
    key = d3p.random.PRNGKey(0)
    rows = []
    for _ in range(rounds):
        fn = jax.jit(lambda k: sampler.sample(k))
        t0 = time.perf_counter()
        lowered = fn.trace(key).lower()
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        rows.append((t1 - t0, t2 - t1))
    cuda = jax.jit(lambda k: sampler.sample(k)).trace(key).lower(lowering_platforms=("cuda",)).as_text()
    trace, comp = np.median(np.array(rows), axis=0)
    return {"trace_lower_s": float(trace), "compile_s": float(comp), "optimized_ops": _ops(compiled.as_text()),
            "cuda_ops": _ops(cuda), "block_function_loops": round_loops(cuda)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    print("| sampler | trace + lower s | compile s | optimized ops | CUDA-lowered ops | block-function loops |")
    print("|---|---|---|---|---|---|")
    for label, sampler in SAMPLERS:
        r = measure(sampler, args.rounds)
        print(f"| {label} | {r['trace_lower_s']:.2f} | {r['compile_s']:.2f} | {r['optimized_ops']:,} | "
              f"{r['cuda_ops']:,} | {r['block_function_loops']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
