"""What a private step's parts cost: DPSVI's step with parts taken out, against SVI, in a loop.

Each configuration is ``update`` applied ``--loop`` times to the same batch in
one jitted ``lax.fori_loop`` (as ``dpsvi_vs_svi.py --loop``), timed in
interleaved rounds; per-step times and the ratio to NumPyro's SVI step in
the same kind of loop (medians over rounds):

- ``full``: the default DPSVI step (C = 1, σ = 1, ChaCha20 noise);
- ``no noise``: σ = 0 (no noise is drawn);
- ``JAX noise``: the noise from ``d3p.random.debug`` (JAX's generator);
- ``no clipping``: the per-record gradients summed without clipping
  (``d3p._strategies._clip_records`` replaced by the identity *in this
  process only*: not private, for timing);
- ``no clipping, no noise``: both;
- ``hand-written`` (logreg only): the same formulation written directly in
  JAX (one guide draw per record, ``jax.random.normal`` of B × d values,
  vmapped gradients of the likelihood, a plain sum, an SGD update): the
  floor of drawing a guide sample per record.

Models and data as in ``dpsvi_vs_svi.py`` (no downloads).

Usage::

    python benchmarks/step_ablation.py logreg
    python benchmarks/step_ablation.py vae --loop 10
"""

import argparse
import os
import statistics
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
from numpyro.infer import SVI, Trace_ELBO

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dpsvi_vs_svi as bm  # noqa: E402

import d3p.random  # noqa: E402
from d3p import _strategies  # noqa: E402
from d3p.random import _threefry  # noqa: E402
from d3p.svi import DPSVI  # noqa: E402


def _no_clipping(grads, clipping_threshold, abs_err=0.0, mask=None):
    return grads, jnp.zeros((jax.tree.leaves(grads)[0].shape[0],))


def _hand_written_logreg(batch):
    """One private-formulation step of the logistic regression without d3p:
    ``(state, xs, ys) -> (state, 0)``."""
    xs, _ = batch
    d = xs.shape[1]

    def step(state, xs, ys):
        params, key = state
        key = _threefry.fast_key(key)
        draw, key = jax.random.split(key)
        eps = jax.random.normal(draw, xs.shape)

        def record(p, e, x, y):
            w = p["loc"] + jax.nn.softplus(p["scale"]) * e
            logit = x @ w
            return -(y * logit - jax.nn.softplus(logit))

        grads = jax.vmap(jax.grad(record), (None, 0, 0, 0))(params, eps, xs, ys)
        params = jax.tree.map(lambda p, g: p - 1e-3 * g.sum(0), params, grads)
        return (params, jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key), 0.0

    return step, ({"loc": jnp.zeros(d), "scale": jnp.zeros(d)}, jax.random.PRNGKey(0))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", choices=list(bm.MODELS))
    parser.add_argument("--loop", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    model, guide, batch, shared, B, N, lr = bm.make_problem(args.model, np.random.default_rng(0))

    def compiled(update, state):
        fn = jax.jit(bm._in_a_loop(update, args.loop))
        jax.block_until_ready(fn(state, *batch))
        return lambda: fn(state, *batch)

    svi = SVI(model, guide, numpyro.optim.Adam(lr), Trace_ELBO(), **shared)
    configs = {"numpyro SVI": compiled(svi.update, svi.init(jax.random.PRNGKey(0), *batch))}
    variants = {
        "full": {},
        "no noise": {"dp_scale": 0.0},
        "JAX noise": {"rng_suite": d3p.random.debug},
        "no clipping": {"_clip": _no_clipping},
        "no clipping, no noise": {"_clip": _no_clipping, "dp_scale": 0.0},
    }
    clip_records = _strategies._clip_records  # where the exact strategies look it up
    try:
        for name, settings in variants.items():
            settings = dict(settings)
            _strategies._clip_records = settings.pop("_clip", clip_records)
            kwargs = {"clipping_threshold": 1.0, "dp_scale": 1.0, **settings}
            suite = kwargs.get("rng_suite", d3p.random)
            dpsvi = DPSVI(model, guide, numpyro.optim.Adam(lr), Trace_ELBO(), **kwargs, **shared)
            configs[f"DPSVI {name}"] = compiled(dpsvi.update, dpsvi.init(suite.PRNGKey(0), *batch))
    finally:
        _strategies._clip_records = clip_records
    if args.model == "logreg":
        configs["hand-written per-record draws"] = compiled(*_hand_written_logreg(batch))
    times = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name, fn in configs.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append((time.perf_counter() - start) / args.loop)
    base = times["numpyro SVI"]
    print(f"{args.model}, B = {B}, {args.loop} steps per loop, {args.rounds} rounds, jax {jax.__version__}, "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| step | µs per step (median) | ratio to SVI (median of rounds) |\n|---|---|---|")
    for name, t in times.items():
        ratio = statistics.median(a / b for a, b in zip(t, base))
        print(f"| {name} | {1e6 * statistics.median(t):.1f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
