"""The structure of d3p's programs as a GPU gets them, without a GPU.

Each program is lowered for CUDA on this machine (``jax.jit(f).trace(*args)
.lower(lowering_platforms=("cuda",))``) and its StableHLO is searched for
the constructs that cost a GPU a host round trip: ``while`` loops (a kernel
launch per iteration, and a device-to-host copy of the loop predicate where
the trip count is not known; ChaCha20's loops over its ten double rounds,
counted apart, have a known one),
conditionals (``case``/``if``: a copy of the predicate) and host callbacks.
Programs: ``d3p.random.normal`` for the VAE's 688,884 noise values,
``sample()`` of the fixed-size and Poisson samplers at N = 10**6, B = 1024
(and fixed-size at N = 10**7, where the duplicate search cannot pack a value
and its position into one word), and ``DPSVI.update``
of the paper's three models (logistic regression B = 256, hierarchical
logistic regression B = 100, VAE B = 128), each with a mask.

Usage::

    python benchmarks/cuda_lowering.py
"""

import os
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
from numpyro.infer import Trace_ELBO

import d3p.random
from d3p import minibatch
from d3p._paper_models import (
    hierarchical_logistic_regression_guide,
    hierarchical_logistic_regression_model,
    logistic_regression_guide,
    logistic_regression_model,
    make_vae,
)
from d3p.svi import DPSVI

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests"))
import _lowered  # noqa: E402 - tells ChaCha20's round loops from other loops

CONSTRUCTS = {"while": "stablehlo.while", "case": "stablehlo.case", "if": "stablehlo.if", "callback": "callback"}


def counts(fn, *args) -> dict:
    try:
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    except Exception as err:  # noqa: BLE001 - reported in the table
        return {name: f"fails: {type(err).__name__}" for name in (*CONSTRUCTS, "rounds", "ops")}
    out = {name: text.count(pattern) for name, pattern in CONSTRUCTS.items()}
    out["rounds"] = _lowered.round_loops(text)   # ChaCha20's loops over its double rounds
    out["ops"] = sum(1 for line in text.splitlines() if " = " in line)
    return out


def _step(model, guide, batch, N, **shared):
    dpsvi = DPSVI(model, guide, numpyro.optim.Adam(1e-3), Trace_ELBO(), clipping_threshold=1.0, dp_scale=1.0,
                  N=N, **shared)
    state = dpsvi.init(d3p.random.PRNGKey(0), *batch)
    mask = jnp.ones(batch[0].shape[0], bool)
    return (lambda s, m, *b: dpsvi.update(s, *b, mask=m)), (state, mask, *batch)


def programs(rng):
    key = d3p.random.PRNGKey(0)
    yield "d3p.random.normal, 688,884 values", (lambda k: d3p.random.normal(k, (688884,))), (key,)
    for sampler in (minibatch.FixedSizeSampler(10**6, 1024), minibatch.PoissonSampler(10**6, 1024 / 10**6),
                    minibatch.FixedSizeSampler(10**7, 1024)):
        # sample() under jit, as a user's jitted loop calls it
        yield (f"{type(sampler).__name__}.sample (N = {sampler.num_records:.0e}, B = 1024)",
               (lambda k, s=sampler: s.sample(k)), (key,))
    xs = rng.normal(size=(256, 30)).astype(np.float32)
    ys = (rng.random(256) < 0.5).astype(np.float32)
    yield ("DPSVI.update, logistic regression",
           *_step(logistic_regression_model, logistic_regression_guide, (xs, ys), 100_000))
    xs, ys, ls = xs[:100, :5], ys[:100], rng.integers(0, 3, 100)
    gs = jnp.asarray(rng.normal(size=(3, 3)).astype(np.float32))
    yield ("DPSVI.update, hierarchical logistic regression",
           *_step(hierarchical_logistic_regression_model, hierarchical_logistic_regression_guide, (xs, ys, ls),
                  500, gs=gs))
    model, guide = make_vae(784, 400, 50)
    images = (rng.random((128, 784)) < 0.2).astype(np.float32)
    yield "DPSVI.update, VAE", *_step(model, guide, (images,), 60_000)


def main():
    print(f"jax {jax.__version__}, numpyro {numpyro.__version__}, lowered for CUDA on {jax.default_backend()}")
    print("| program | ops | while (of which ChaCha20's double-round loops) | case | if | host callbacks |\n"
          "|---|---|---|---|---|---|")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, fn, args in programs(np.random.default_rng(0)):
            c = counts(fn, *args)
            print(f"| {name} | {c['ops']} | {c['while']} ({c['rounds']}) | {c['case']} | {c['if']} | "
                  f"{c['callback']} |", flush=True)


if __name__ == "__main__":
    main()
