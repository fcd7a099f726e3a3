"""What the first ``run`` of the README's model compiles, with d3p's ChaCha20
suite against JAX's own generator (``d3p.random.debug``): the cost of the
secure generator's key derivations in compilation.

One fresh process per suite (run the script once per suite): the README's
logistic regression on the breast-cancer data, ``DPSVI.run`` of 2,000 steps
at B = 32 (Poisson sampling), σ = 2, C = 1, no progress bar (one compiled
``lax.scan``). Prints the run's wall time, the XLA compilation time of the
run's chunk and of everything else (the eager set-up), and the number of
programs compiled (JAX's ``/jax/core/compile/backend_compile_duration``
events).

Usage::

    python benchmarks/first_run_compile.py chacha
    python benchmarks/first_run_compile.py debug
"""

import os
import sys
import time

import jax

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

times = []


def _listener(event, duration, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
        times.append((kwargs.get("fun_name"), duration))


def main(suite_name: str) -> None:
    jax.monitoring.register_event_duration_secs_listener(_listener)
    import numpyro
    from numpyro.infer import Trace_ELBO

    import d3p.random
    import d3p.random.debug
    import logistic_regression as lr
    from d3p.svi import DPSVI

    xs, ys, _, _ = lr.load_data(0)
    suite = d3p.random.debug if suite_name == "debug" else d3p.random
    svi = DPSVI(lr.model, lr.guide, numpyro.optim.Adam(1e-2), Trace_ELBO(), clipping_threshold=1.0, dp_scale=2.0,
                N=xs.shape[0], rng_suite=suite)
    t = time.time()
    svi.run(suite.PRNGKey(0), 2000, xs, ys, batch_size=32, progress_bar=False)
    chunk = sum(d for f, d in times if f and f.endswith("_chunk)"))
    other = sum(d for f, d in times if not (f and f.endswith("_chunk)")))
    print(f"{suite_name}: run {time.time() - t:.2f} s, chunk compile {chunk:.2f} s, other compiles {other:.2f} s, "
          f"{len(times)} programs")


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("chacha", "debug"):
        sys.exit("usage: python benchmarks/first_run_compile.py chacha|debug")
    main(sys.argv[1])
