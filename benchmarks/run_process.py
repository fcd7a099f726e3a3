"""Whole processes: a private fit with ``DPSVI.run`` against NumPyro SVI in one jitted ``lax.scan``.

What a user waits for, start to end: each configuration runs in a fresh
Python process (interpreter start, imports, data generation, compilation,
the steps and, for DPSVI, the ε of the run from the accountant), timed
from outside by the parent process. The two processes of a pair run back to
back, in alternating order, and the ratio is taken per pair (so that load
from other jobs hits both alike); the table gives medians.

- ``dpsvi``: ``DPSVI(...).run(key, T, xs, ys, batch_size=B)`` (Poisson
  sampling, the default; σ = 1, C = 1; the ε of the run read from the
  result, as a user would print it);
- ``svi``: ``numpyro.infer.SVI.update`` in one jitted ``lax.scan`` of ``T``
  steps whose batches are ``jax.random.randint`` indices (with replacement:
  the cheapest batch there is).

Model: the d3p paper's logistic regression (d = 30), N = 10**6 generated
records, B = 1024, T = 2000 steps, Adam. No downloads.

Usage::

    python benchmarks/run_process.py               # 5 pairs
    python benchmarks/run_process.py --pairs 3 --steps 500
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def child(kind: str, N: int, B: int, T: int) -> None:
    import jax
    import numpy as np
    import numpyro
    from jax import lax
    from numpyro.infer import SVI, Trace_ELBO

    from d3p._paper_models import logistic_regression_guide as guide
    from d3p._paper_models import logistic_regression_model as model

    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(N, 30)).astype(np.float32)
    ys = (rng.random(N) < 1 / (1 + np.exp(-xs @ rng.normal(size=30)))).astype(np.float32)
    t_data = time.perf_counter() - t0
    if kind == "svi":
        xs, ys = jax.numpy.asarray(xs), jax.numpy.asarray(ys)
        svi = SVI(model, guide, numpyro.optim.Adam(1e-3), Trace_ELBO(), N=N)
        state = svi.init(jax.random.PRNGKey(0), xs[:B], ys[:B])

        def step(s, k):
            idx = jax.random.randint(k, (B,), 0, N)
            return svi.update(s, xs[idx], ys[idx])

        state, losses = jax.jit(lambda s, k: lax.scan(step, s, jax.random.split(k, T)))(state, jax.random.PRNGKey(1))
        jax.block_until_ready(losses)
        print(f"svi: loss {float(losses[-1]):.1f}, data {t_data:.2f} s", flush=True)
    else:
        import d3p.random
        from d3p.svi import DPSVI

        dpsvi = DPSVI(model, guide, numpyro.optim.Adam(1e-3), Trace_ELBO(), clipping_threshold=1.0, dp_scale=1.0,
                      N=N)
        result = dpsvi.run(d3p.random.PRNGKey(1), T, xs, ys, batch_size=B, progress_bar=False)
        t_steps = time.perf_counter() - t0
        eps = result.epsilon
        t_eps = time.perf_counter() - t0 - t_steps
        print(f"dpsvi: epsilon {eps:.3f} (delta {result.delta:.1e}), data {t_data:.2f} s, "
              f"accounting {t_eps:.2f} s", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--num-records", type=int, default=10**6)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--child", choices=["svi", "dpsvi"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.num_records, args.batch_size, args.steps)
        return
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    base = [sys.executable, os.path.abspath(__file__), "--num-records", str(args.num_records),
            "--batch-size", str(args.batch_size), "--steps", str(args.steps), "--child"]
    times = {"svi": [], "dpsvi": []}
    for pair in range(args.pairs):
        for kind in (("svi", "dpsvi") if pair % 2 == 0 else ("dpsvi", "svi")):
            t = time.perf_counter()
            out = subprocess.run(base + [kind], env=env, capture_output=True, text=True, check=True)
            times[kind].append(time.perf_counter() - t)
            print(f"pair {pair}: {kind} {times[kind][-1]:.2f} s | {out.stdout.strip()}", flush=True)
    ratios = [d / s for d, s in zip(times["dpsvi"], times["svi"])]
    print(f"\nN = {args.num_records}, B = {args.batch_size}, T = {args.steps}, {args.pairs} pairs")
    print("| process | s (median) | ratio to SVI (median of pairs) |\n|---|---|---|")
    print(f"| numpyro SVI, jitted lax.scan | {statistics.median(times['svi']):.2f} | 1.00 |")
    print(f"| DPSVI.run (epsilon included) | {statistics.median(times['dpsvi']):.2f} | "
          f"{statistics.median(ratios):.2f} |")


if __name__ == "__main__":
    main()
