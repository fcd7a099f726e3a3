"""The posterior's scales under noise: ``formulation="aligned"`` against the default.

Generated logistic regression (N = 20,000 records, d = 30 standard normal
features, weights drawn N(0, 0.5²), 2,000 held out), the d3p paper's model
and mean-field guide (``w_loc``, ``w_scale_log``). The reference is
non-private NumPyro SVI run to convergence (full batch, 4 particles, Adam
1e-2, 8,000 steps). Each private fit is ``DPSVI.run(epsilon=1)`` (Poisson
sampling, add/remove, δ = 1/N²), expected batch 256, 4,000 steps, Adam 1e-2,
C = 3, under ``--formulations`` (default: ``own_sample``, the default, and
``aligned``), plus each with σ = 0 (clipping alone) as the ablation.

Printed per fit, means over ``--seeds``: the posterior mean's error in units
of the reference posterior sd (mean over coordinates of |μ - μ_ref| / sd_ref),
the ratio of posterior sds (geometric mean over coordinates) and the held-out
log predictive density per record (500 posterior draws).

Usage::

    python benchmarks/aligned_scales.py [--seeds 2]
"""

import argparse
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
from numpyro.infer import SVI, Trace_ELBO

import d3p.random
from d3p._paper_models import logistic_regression_guide as guide
from d3p._paper_models import logistic_regression_model as model
from d3p.svi import DPSVI


def data(N=20000, d=30, held_out=2000, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(N + held_out, d))
    w = rng.normal(size=d) * 0.5
    y = (rng.uniform(size=N + held_out) < 1 / (1 + np.exp(-X @ w))).astype(float)
    f = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    return f(X[:N]), f(y[:N]), f(X[N:]), f(y[N:])


def predictive(params, xs, ys, key=jax.random.PRNGKey(1), draws=500):
    w = params["w_loc"] + jnp.exp(params["w_scale_log"]) * jax.random.normal(key, (draws, xs.shape[1]))
    logits = w @ xs.T
    ll = ys * jax.nn.log_sigmoid(logits) + (1 - ys) * jax.nn.log_sigmoid(-logits)
    return float(jnp.mean(jax.scipy.special.logsumexp(ll, 0) - jnp.log(draws)))


def figures(params, ref, xs, ys):
    sd, sd_p = np.exp(np.asarray(ref["w_scale_log"])), np.exp(np.asarray(params["w_scale_log"]))
    error = float(np.mean(np.abs(np.asarray(params["w_loc"]) - np.asarray(ref["w_loc"])) / sd))
    return error, float(np.exp(np.mean(np.log(sd_p / sd)))), predictive(params, xs, ys)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--formulations", nargs="+", default=["own_sample", "aligned"])
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    xs, ys, xt, yt = data()
    N = xs.shape[0]
    ref = SVI(model, guide, numpyro.optim.Adam(1e-2), Trace_ELBO(num_particles=4), N=N).run(
        jax.random.PRNGKey(0), 8000, xs, ys, progress_bar=False).params
    print(f"reference (non-private SVI): held-out log pred. {predictive(ref, xt, yt):.4f}, "
          f"mean posterior sd {float(np.mean(np.exp(ref['w_scale_log']))):.4f}")
    print("| formulation | ε | error (ref. sds) | sd ratio | held-out log pred. | σ |")
    print("|---|---|---|---|---|---|", flush=True)
    for formulation in args.formulations:
        for epsilon in (1.0, float("inf")):
            svi = DPSVI(model, guide, numpyro.optim.Adam(1e-2), Trace_ELBO(), clipping_threshold=3.0,
                        dp_scale=None, formulation=formulation, N=N)
            rows, t0 = [], time.perf_counter()
            for seed in range(args.seeds):
                r = svi.run(d3p.random.PRNGKey(seed), 4000, xs, ys, batch_size=256, epsilon=epsilon,
                            delta=1 / N**2, progress_bar=False)
                rows.append(figures(r.params, ref, xt, yt))
            e, s, p = np.mean(rows, axis=0)
            label = "1" if epsilon == 1.0 else "∞ (σ = 0, clipping only)"
            print(f"| {formulation} | {label} | {e:.2f} | {s:.2f} | {p:.4f} | {r.sigma:.2f} |"
                  f" <!-- {time.perf_counter() - t0:.0f} s -->", flush=True)


if __name__ == "__main__":
    main()
