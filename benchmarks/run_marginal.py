"""The marginal cost of a step of ``DPSVI.run`` against a non-private NumPyro SVI loop.

``DPSVI.run`` draws a fresh private batch at every step inside its compiled
``lax.scan`` (the sampler, the gather, the private step). Its marginal cost
per step is measured as ``(time(T2 steps) - time(T1 steps)) / (T2 - T1)``, so
that compilation and initialisation are excluded; both run lengths are
compiled (run once) before they are timed, and that first run also computes
their ε, which :mod:`d3p.accounting` caches per process: the timed runs (same
plan, other keys) look it up. The accounting of a run is printed on its own
line (first and later run), so that a regression of the cache shows there and
not as a per-step cost. The baseline is the
same for non-private minibatch SVI: ``numpyro.infer.SVI.update`` in a jitted
``lax.scan`` whose batches are ``jax.random.randint`` indices (with
replacement, the cheapest batch there is).

Also measured: the set-up time of a later ``run`` of the same DPSVI with
the same shapes and another key (its time minus its steps' marginal cost),
compilation being cached.

Model: the d3p paper's logistic regression (d = 30), N = 10**6 generated
records, B = 1024 (Poisson sampling with expected batch size B, and
fixed-size batches). No downloads.

Usage::

    python benchmarks/run_marginal.py            # N = 1e6, B = 1024
    python benchmarks/run_marginal.py --quick    # N = 1e4, short runs (smoke test)
"""

import argparse
import os
import platform
import statistics
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
from jax import lax
from numpyro.infer import SVI, Trace_ELBO

import d3p.random
from d3p._paper_models import logistic_regression_guide, logistic_regression_model
from d3p.svi import DPSVI


def make_data(num_records: int, dim: int = 30, seed: int = 0):
    rng = np.random.default_rng(seed)
    xs = rng.normal(size=(num_records, dim)).astype(np.float32)
    w = rng.normal(size=dim).astype(np.float32)
    ys = (rng.random(num_records) < 1 / (1 + np.exp(-xs @ w))).astype(np.float32)
    return jnp.asarray(xs), jnp.asarray(ys)


def svi_loop(xs, ys, batch_size: int):
    """``loop(state, key, length)``: ``length`` steps of non-private minibatch SVI."""
    num_records = xs.shape[0]
    svi = SVI(logistic_regression_model, logistic_regression_guide, numpyro.optim.Adam(1e-3), Trace_ELBO(),
              N=num_records)
    state = svi.init(jax.random.PRNGKey(0), xs[:batch_size], ys[:batch_size])

    def step(state, key):
        idx = jax.random.randint(key, (batch_size,), 0, num_records)
        return svi.update(state, jnp.take(xs, idx, axis=0), jnp.take(ys, idx, axis=0))

    @jax.jit(static_argnums=2)
    def loop(state, key, length):
        return lax.scan(step, state, jax.random.split(key, length))

    return state, loop


def _timed(fn) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def marginal(run_steps, t1: int, t2: int, repeats: int) -> float:
    """Median over ``repeats`` of ``(time(t2) - time(t1)) / (t2 - t1)`` in seconds,
    each length run once before (compilation) and the two interleaved."""
    run_steps(t1, 0)
    run_steps(t2, 0)
    values = []
    for r in range(repeats):
        a = _timed(lambda: run_steps(t1, r + 1))
        b = _timed(lambda: run_steps(t2, r + 1))
        values.append((b - a) / (t2 - t1))
    return statistics.median(values)


def run_accounting(dpsvi, sampling, num_records, batch_size, steps):
    """(first, later): seconds of the ε at the end of a run of ``steps`` steps, as
    ``DPSVI.run`` computes it (a new tracker per run), with the cache emptied and
    then again."""
    from d3p import accounting

    sampler = "fixed_size" if sampling == "fixed" else "poisson"
    q = batch_size / num_records
    delta = 1.0 / num_records ** 2      # run's default

    def one():
        acc = accounting.accounting_for(sampler, None, dpsvi.noise)
        return acc.tracker(dpsvi.dp_scale, q, delta, num_steps=steps).epsilon(steps)

    accounting.clear_cache()
    first = _timed(one)
    later = _timed(one)
    return first, later


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-records", type=int, default=10**6)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--steps", type=int, nargs=2, default=[200, 1200], metavar=("T1", "T2"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_records, args.steps, args.repeats = 10**4, [10, 30], 1
    t1, t2 = args.steps
    print(f"jax {jax.__version__}, numpyro {numpyro.__version__}, backend {jax.default_backend()}, "
          f"devices {jax.devices()}, {os.cpu_count()} CPUs, {platform.platform()}")
    xs, ys = make_data(args.num_records)
    B, N = args.batch_size, args.num_records

    state, loop = svi_loop(xs, ys, B)
    base = marginal(lambda t, r: loop(state, jax.random.PRNGKey(r), t), t1, t2, args.repeats)
    print("| loop | ms per step (marginal) | ratio to SVI | set-up of a later run |\n|---|---|---|---|")
    print(f"| numpyro SVI, randint batches | {1e3 * base:.3f} | 1.00 | |")

    accounting_times = {}
    for sampling in ("poisson", "fixed"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dpsvi = DPSVI(logistic_regression_model, logistic_regression_guide, numpyro.optim.Adam(1e-3),
                          Trace_ELBO(), clipping_threshold=1.0, dp_scale=1.0, N=N)

        def run_steps(t, r):
            return dpsvi.run(d3p.random.PRNGKey(r), t, xs, ys, batch_size=B, sampling=sampling,
                             progress_bar=False).params

        per_step = marginal(run_steps, t1, t2, args.repeats)
        accounting_times[sampling] = run_accounting(dpsvi, sampling, N, B, t2)
        # a later run of a compiled length: all but its steps is set-up (init on
        # the first batch, the sampler's tables, accounting)
        overhead = statistics.median(_timed(lambda: run_steps(t1, 10_000 + r)) for r in range(3)) - t1 * per_step
        print(f"| DPSVI.run, {sampling} | {1e3 * per_step:.3f} | {per_step / base:.2f} | {overhead:.2f} s |")
    for sampling, (first, later) in accounting_times.items():
        print(f"accounting of a {sampling} run of {t2} steps: {first:.3f} s when first computed, "
              f"{later:.2e} s in a later run")


if __name__ == "__main__":
    main()
