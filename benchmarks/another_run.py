"""What a second ``run`` costs when only a setting changed (issue "Compile
once", item 2): the ε-first defaults at another ε, where the automatic q of
a small data set depends on ε, and a twin fitted again at another step size
and number of steps.

One process, in order:

1. ``DPSVI(model, guide, loss=Trace_ELBO())`` of the README's logistic
   regression (breast-cancer data, 455 training records), ``run(key, None,
   xs, ys, epsilon=...)`` at ε = 1, then at ε = 4, then at ε = 2;
2. ``d3p.twin.fit`` of the breast-cancer table (its first 8 columns and the
   target), the mixture family, ε = 1, 300 steps at the step size 0.05,
   then 400 steps at 0.1.

Prints each call's wall time and the programs XLA compiled during it (JAX's
``/jax/core/compile/backend_compile_duration`` events; no persistent
compilation cache), with their compilation seconds.

Usage::

    python benchmarks/another_run.py
"""

import os
import sys
import time

import jax

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

compiles = []


def _listener(event, duration, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
        compiles.append(duration)


def _timed(label, fn):
    compiles.clear()
    start = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - start
    print(f"{label}: {seconds:.2f} s, {len(compiles)} programs compiled ({sum(compiles):.2f} s)", flush=True)
    return result


def main() -> None:
    jax.monitoring.register_event_duration_secs_listener(_listener)
    import pandas as pd
    from numpyro.infer import Trace_ELBO
    from sklearn.datasets import load_breast_cancer

    import d3p.random
    import d3p.twin as twin
    import logistic_regression as lr
    from d3p.svi import DPSVI

    xs, ys, _, _ = lr.load_data(0)
    svi = DPSVI(lr.model, lr.guide, loss=Trace_ELBO(), N=xs.shape[0])
    for epsilon in (1.0, 4.0, 2.0):
        result = _timed(f"defaults, run at epsilon={epsilon:g}",
                        lambda: svi.run(d3p.random.PRNGKey(0), None, xs, ys, epsilon=epsilon, progress_bar=False))
        print(f"   q = {result.q:.4f}, sigma = {result.sigma:.3f}, steps = {result.num_steps}")

    frame = load_breast_cancer(as_frame=True).frame
    table = frame[list(frame.columns[:8]) + ["target"]].astype({"target": "category"})
    assert isinstance(table, pd.DataFrame)
    for steps, step_size in ((300, 0.05), (400, 0.1)):
        _timed(f"twin.fit, {steps} steps at step size {step_size:g}",
               lambda: twin.fit(table, 1.0, rng_key=d3p.random.PRNGKey(1), family="mixture", num_steps=steps,
                                learning_rate=step_size, progress_bar=False))


if __name__ == "__main__":
    main()
