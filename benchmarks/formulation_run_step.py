"""The marginal cost of a step of ``DPSVI.run`` under each ELBO formulation.

``(time(400 steps) - time(200 steps)) / 200`` of ``DPSVI.run`` (Poisson
batches of expected size B drawn inside its compiled steps, compilation
reused after a first run of each length; the RDP accountant, whose cost is
the same for both lengths) against NumPyro's ``SVI.update`` in a jitted
``lax.scan`` with ``jax.random.randint`` batches, the same difference of two
run lengths; median of 3 repeats. The paper's logistic regression, d = 30,
N = 100,000 generated records, B = 1024, C = 1, σ = 1. No downloads.

Usage::

    python benchmarks/formulation_run_step.py                       # all three formulations
    python benchmarks/formulation_run_step.py own_sample shared_sample
"""

import statistics
import sys
import time
import warnings

import jax
import numpy as np
import numpyro
from jax import lax
from numpyro.infer import SVI, Trace_ELBO

import d3p.random
from d3p._paper_models import logistic_regression_guide as guide
from d3p._paper_models import logistic_regression_model as model
from d3p.svi import DPSVI

N, B, D = 100000, 1024, 30
SHORT, LONG, REPEATS = 200, 400, 3


def main(formulations):
    warnings.simplefilter("ignore")
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(N, D)).astype(np.float32)
    ys = (rng.random(N) < 1 / (1 + np.exp(-xs @ rng.normal(size=D)))).astype(np.float32)
    xs, ys = jax.numpy.asarray(xs), jax.numpy.asarray(ys)
    svi = SVI(model, guide, numpyro.optim.Adam(1e-3), Trace_ELBO(), N=N)
    state = svi.init(jax.random.PRNGKey(0), xs[:B], ys[:B])

    def step(s, k):
        idx = jax.random.randint(k, (B,), 0, N)
        return svi.update(s, xs[idx], ys[idx])[0], None

    loops = {T: jax.jit(lambda s, k, T=T: lax.scan(step, s, jax.random.split(k, T))[0]) for T in (SHORT, LONG)}
    dpsvis = {f: DPSVI(model, guide, numpyro.optim.Adam(1e-3), Trace_ELBO(), 1.0, 1.0, formulation=f, N=N)
              for f in formulations}

    def timed(fn):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        return time.perf_counter() - t

    def svi_run(T):
        return timed(lambda: loops[T](state, jax.random.PRNGKey(1)))

    def dp_run(f, T):
        return timed(lambda: dpsvis[f].run(d3p.random.PRNGKey(1), T, xs, ys, batch_size=B, progress_bar=False,
                                           accountant="rdp").state)

    for T in (SHORT, LONG):   # compile
        svi_run(T)
        for f in dpsvis:
            dp_run(f, T)
    per_step = {k: [] for k in ["numpyro SVI"] + list(dpsvis)}
    for _ in range(REPEATS):
        per_step["numpyro SVI"].append((svi_run(LONG) - svi_run(SHORT)) / (LONG - SHORT))
        for f in dpsvis:
            per_step[f].append((dp_run(f, LONG) - dp_run(f, SHORT)) / (LONG - SHORT))
    base = statistics.median(per_step["numpyro SVI"])
    print("| loop | ms per step (marginal) | ratio to SVI |\n|---|---|---|")
    for k, v in per_step.items():
        print(f"| {k} | {1e3 * statistics.median(v):.3f} | {statistics.median(v) / base:.1f} |")


if __name__ == "__main__":
    main(sys.argv[1:] or ["per_record", "own_sample", "shared_sample"])
