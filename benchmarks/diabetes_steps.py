"""A private linear regression on scikit-learn's diabetes data, as a new user
would write it, asking for ε = 1 and nothing else: the held-out R² of the
settings d3p chooses, and of the same run at other numbers of steps
(issue "Accurate private posteriors by default": the case where a fit is
mostly noise).

The data: scikit-learn's bundled diabetes set (442 records, 10 features as
scikit-learn scales them), the target standardised; 353 records to fit, 89
held out (one fixed permutation). The model: ``y ~ Normal(x w + b, s)``,
``w, b ~ Normal(0, 1)``, ``s ~ HalfNormal(1)``, NumPyro's ``AutoNormal``
guide. Each line: the number of steps (``chosen``: ``num_steps=None``), the
noise multiplier σ calibrated for them, the noise ratio ``σ sqrt(P) / B_e``
of the gradient's σ, and the held-out R² per seed; then non-private NumPyro
SVI with the same guide (Adam(0.01), 20,000 full-data steps) and ordinary
least squares.

Usage::

    python benchmarks/diabetes_steps.py [--seeds 3] [--steps 200 500 1000 2000]
"""

import argparse
import math

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer import SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoNormal

import d3p.random
from d3p.svi import DPSVI

N_FIT = 353


def load():
    from sklearn.datasets import load_diabetes

    X, y = load_diabetes(return_X_y=True)
    y = (y - y.mean()) / y.std()
    order = np.random.default_rng(0).permutation(len(X))
    fit, held = order[:N_FIT], order[N_FIT:]
    return (jnp.asarray(X[fit], jnp.float32), jnp.asarray(y[fit], jnp.float32)), (X[held], y[held])


def model(x, y, N=N_FIT):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([x.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0, 1))
    s = numpyro.sample("s", dist.HalfNormal(1))
    with numpyro.plate("data", N, subsample_size=x.shape[0]):
        numpyro.sample("y", dist.Normal(x @ w + b, s), obs=y)


def r2(params, held):
    x, y = held
    pred = x @ np.asarray(params["w_auto_loc"]) + float(params["b_auto_loc"])
    return 1.0 - np.mean((y - pred) ** 2) / np.var(y)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, nargs="+", default=[200, 500, 1000, 2000])
    args = parser.parse_args(argv)
    train, held = load()
    guide = AutoNormal(model)
    svi = DPSVI(model, guide, loss=Trace_ELBO(), N=N_FIT)
    print("| steps | σ | noise ratio | held-out R² per seed | mean |")
    print("|---|---|---|---|---|")
    for steps in [None] + args.steps:
        got = [svi.run(d3p.random.PRNGKey(seed), steps, *train, epsilon=1.0, progress_bar=False)
               for seed in range(args.seeds)]
        scores = [r2(r.params, held) for r in got]
        # the gradient's σ (the adaptive clipping's count takes a tenth of the precision); P = 24
        rho = got[0].sigma / math.sqrt(0.9) * math.sqrt(24) / (got[0].q * N_FIT)
        name = f"chosen ({got[0].num_steps})" if steps is None else str(steps)
        print(f"| {name} | {got[0].sigma:.3g} | {rho:.3g} | {', '.join(f'{s:.3f}' for s in scores)} | "
              f"{np.mean(scores):.3f} |", flush=True)
    ref = SVI(model, guide, numpyro.optim.Adam(0.01), Trace_ELBO()).run(
        jax.random.PRNGKey(0), 20000, *train, progress_bar=False)
    x = np.c_[np.asarray(train[0]), np.ones(N_FIT)]
    coef = np.linalg.lstsq(x, np.asarray(train[1]), rcond=None)[0]
    ols = 1.0 - np.mean((held[1] - np.c_[held[0], np.ones(len(held[0]))] @ coef) ** 2) / np.var(held[1])
    print(f"non-private SVI: held-out R² {r2(ref.params, held):.3f}; least squares {ols:.3f}")


if __name__ == "__main__":
    main()
