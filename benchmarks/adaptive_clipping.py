"""Adaptive clipping against fixed clipping thresholds, on the d3p paper's models.

For each model and ε ∈ {1, 8} (Poisson sampling, add/remove, δ = 1e-5, σ
calibrated by ``DPSVI.run(epsilon=...)`` for every configuration) the script
fits DPSVI with

- ``adaptive``: :class:`d3p.svi.AdaptiveClipping` with its defaults
  (target quantile 0.5, or ``--quantile``; learning rate 0.2; count noise: a
  tenth of each step's privacy, or with ``--paper-count-noise`` the paper's
  expected batch size / 20, as the recorded table), starting at C = 1; the run is accounted at σ_eff of the gradient
  and the count together, so it spends the same ε as the others;
- ``C=1``: a fixed threshold of 1;
- ``best C``: the fixed threshold of the grid ``--grid`` (default 0.1, 1, 10)
  whose mean held-out
  log density over the seeds is highest: chosen with the test data, i.e.
  with non-private knowledge, a ceiling that no private run can select,

and reports, on held-out data, the mean log predictive density per record
(for the VAE: the ELBO per image, a lower bound of it), the accuracy of the
classifiers, and for the regressions the distance of the posterior mean from
non-private NumPyro SVI's (relative to the norm of SVI's) and the ratio of
posterior standard deviations (geometric mean over coordinates). Means over
``--seeds`` seeds (± the standard deviation over seeds for the log density).

Models (``d3p._paper_models``) and data, no downloads:

- ``logreg``: logistic regression, 8 generated features and an intercept,
  N = 5000 (2000 held out);
- ``hlogreg``: hierarchical logistic regression, D = 5, K = 3, L = 3 groups,
  generated, N = 5000 (2000 held out);
- ``gmm``: Gaussian mixture with k = 3 components in 2-d (AutoDiagonalNormal
  guide), generated from 3 clusters, N = 5000 (2000 held out);
- ``vae``: a small VAE (64-32-(4, 4), decoder 4-32-64) on scikit-learn's
  bundled ``load_digits`` (8x8 images binarised at 8/16), 1500 training and
  297 held-out images.

Usage::

    python benchmarks/adaptive_clipping.py                    # all models, 3 seeds
    python benchmarks/adaptive_clipping.py --models logreg --seeds 1 --steps 300
"""

import argparse
import json
import os
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer import SVI, Predictive, Trace_ELBO
from numpyro.infer.autoguide import AutoDiagonalNormal

import d3p.random
from d3p._paper_models import (
    gmm_model,
    hierarchical_logistic_regression_guide,
    hierarchical_logistic_regression_model,
    logistic_regression_guide,
    logistic_regression_model,
    make_vae,
)
from d3p.gmm import GaussianMixture
from d3p.svi import DPSVI, AdaptiveClipping

DELTA = 1e-5
EPSILONS = (1.0, 8.0)
SAMPLES = 200     # posterior draws for the predictive density


# ------------------------------------------------------------------ problems

class Problem:
    """A model, its guide, training and held-out data, and how to score a fit."""

    def __init__(self, name, model, guide, train, test, batch_size, lr, static=None, scores=None,
                 posterior=None):
        self.name, self.model, self.guide = name, model, guide
        self.train, self.test = train, test
        self.batch_size, self.lr = batch_size, lr
        self.static = static or {}
        self.scores = jax.jit(scores)   # (params, key) -> dict of held-out figures (0-d arrays)
        self.posterior = posterior      # params -> (mean, sd) vectors, or None

    @property
    def N(self):
        return len(self.train[0])


def _logmeanexp(x, axis=0):
    return jax.scipy.special.logsumexp(x, axis=axis) - np.log(x.shape[axis])


def _classifier_scores(loglik_fn):
    """Scores of a Bernoulli classifier from ``loglik_fn(params, key) ->
    (S, n) log p(y_i | x_i, θ_s)`` over posterior draws."""
    def scores(params, key):
        ll = loglik_fn(params, key)
        pred = _logmeanexp(ll)                       # log p(y_i | x_i, data)
        return {"lpd": jnp.mean(pred), "acc": jnp.mean(pred > np.log(0.5))}
    return scores


def logreg_problem(rng):
    d, n, n_test = 8, 5000, 2000
    w_true = rng.normal(0, 1.5, d + 1)
    xs = np.concatenate([rng.normal(size=(n + n_test, d)), np.ones((n + n_test, 1))], 1).astype(np.float32)
    ys = (rng.random(n + n_test) < 1 / (1 + np.exp(-xs @ w_true))).astype(np.float32)
    train, test = (xs[:n], ys[:n]), (xs[n:], ys[n:])

    def loglik(params, key):
        w = params["w_loc"] + jnp.exp(params["w_scale_log"]) * jax.random.normal(key, (SAMPLES, d + 1))
        logits = test[0] @ w.T                        # (n, S)
        return (test[1][:, None] * jax.nn.log_sigmoid(logits)
                + (1 - test[1][:, None]) * jax.nn.log_sigmoid(-logits)).T

    def posterior(params):
        return np.asarray(params["w_loc"]), np.exp(np.asarray(params["w_scale_log"]))

    return Problem("logreg", logistic_regression_model, logistic_regression_guide, train, test, 100, 0.02,
                   scores=_classifier_scores(loglik), posterior=posterior)


def hlogreg_problem(rng):
    D, K, L, n, n_test = 5, 3, 3, 5000, 2000
    gs = rng.normal(size=(L, K)).astype(np.float32)
    M = rng.normal(0, 1.0, (D, K))
    ws = gs @ M.T + rng.normal(size=(L, D))
    xs = rng.normal(size=(n + n_test, D)).astype(np.float32)
    ls = rng.integers(0, L, n + n_test).astype(np.int32)
    ys = (rng.random(n + n_test) < 1 / (1 + np.exp(-np.einsum("nd,nd->n", xs, ws[ls])))).astype(np.float32)
    train = (xs[:n], ys[:n], ls[:n])
    test = (xs[n:], ys[n:], ls[n:])
    gs = jnp.asarray(gs)

    def loglik(params, key):
        k1, k2 = jax.random.split(key)
        M_s = params["M_loc"] + jnp.exp(params["M_scale_log"]) * jax.random.normal(k1, (SAMPLES, D, K))
        w_s = jnp.einsum("lk,sdk->sld", gs, M_s) + jax.random.normal(k2, (SAMPLES, L, D))
        logits = jnp.einsum("nd,snd->sn", test[0], w_s[:, test[2]])
        return test[1] * jax.nn.log_sigmoid(logits) + (1 - test[1]) * jax.nn.log_sigmoid(-logits)

    def posterior(params):
        return np.asarray(params["M_loc"]).ravel(), np.exp(np.asarray(params["M_scale_log"])).ravel()

    return Problem("hlogreg", hierarchical_logistic_regression_model, hierarchical_logistic_regression_guide,
                   train, test, 100, 0.02, static={"gs": gs},
                   scores=_classifier_scores(loglik), posterior=posterior)


def gmm_problem(rng):
    k, n, n_test = 3, 5000, 2000
    centres = np.array([[-1.5, -1.0], [1.5, -0.5], [0.0, 1.5]])
    z = rng.integers(0, k, n + n_test)
    xs = (centres[z] + 0.4 * rng.normal(size=(n + n_test, 2))).astype(np.float32)
    train, test = (xs[:n],), (xs[n:],)

    def model(xs, N):
        return gmm_model(xs, N, k=k)

    guide = AutoDiagonalNormal(model)

    def scores(params, key):
        draws = guide.sample_posterior(key, params, sample_shape=(SAMPLES,))

        def one(locs, sigmas, pis):
            return GaussianMixture(locs, sigmas[:, None], pis).log_prob(test[0])

        ll = jax.vmap(one)(draws["locs"], draws["sigmas"], draws["pis"])   # (S, n)
        return {"lpd": jnp.mean(_logmeanexp(ll))}

    return Problem("gmm", model, guide, train, test, 100, 0.02, scores=scores)


def vae_problem(rng):
    from sklearn.datasets import load_digits

    images = (load_digits().data >= 8).astype(np.float32)
    images = images[rng.permutation(len(images))]
    train, test = (images[:1500],), (images[1500:],)
    model, guide = make_vae(64, 32, 4)
    elbo = Trace_ELBO(num_particles=20)

    def scores(params, key):
        loss = elbo.loss(key, params, model, guide, test[0], N=len(test[0]))
        return {"lpd": -loss / len(test[0])}

    return Problem("vae", model, guide, train, test, 50, 0.01, scores=scores)


PROBLEMS = {"logreg": logreg_problem, "hlogreg": hlogreg_problem, "gmm": gmm_problem, "vae": vae_problem}


# ------------------------------------------------------------------ fits

def fit_dpsvi(p, C, adaptive, epsilon, seed, steps, cache, quantile=0.5, paper_count_noise=False):
    """One private fit; the DPSVI (and its compiled steps) is kept per (C, adaptive)."""
    key = (C, adaptive)
    if key not in cache:
        count_noise = p.batch_size / 20 if paper_count_noise else None
        settings = AdaptiveClipping(target_quantile=quantile, count_noise=count_noise) if adaptive else None
        cache[key] = DPSVI(p.model, p.guide, numpyro.optim.Adam(p.lr), Trace_ELBO(), clipping_threshold=C,
                           dp_scale=None, adaptive_clipping=settings, N=p.N, **p.static)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = cache[key].run(d3p.random.PRNGKey(seed), steps, *p.train, batch_size=p.batch_size,
                                epsilon=epsilon, delta=DELTA, progress_bar=False)
    final_C = float(result.state.clipping_threshold) if adaptive else C
    return result.params, final_C, result.epsilon


def fit_svi(p, steps):
    """Non-private NumPyro SVI on minibatches of the same size, 3 times the steps."""
    svi = SVI(p.model, p.guide, numpyro.optim.Adam(p.lr), Trace_ELBO(), N=p.N, **p.static)
    B = p.batch_size
    data = [jnp.asarray(x) for x in p.train]
    state = svi.init(jax.random.PRNGKey(0), *[x[:B] for x in data])

    @jax.jit
    def step(state, key):
        idx = jax.random.choice(key, p.N, (B,), replace=False)
        state, _ = svi.update(state, *[x[idx] for x in data])
        return state, None

    state, _ = jax.lax.scan(step, state, jax.random.split(jax.random.PRNGKey(1), 3 * steps))
    return svi.get_params(state)


def posterior_figures(p, params, ref):
    if p.posterior is None or ref is None:
        return {}
    (m, s), (m0, s0) = p.posterior(params), p.posterior(ref)
    return {"dist": float(np.linalg.norm(m - m0) / np.linalg.norm(m0)),
            "sd_ratio": float(np.exp(np.mean(np.log(s / s0))))}


# ------------------------------------------------------------------ main

def _mean(rows, field):
    values = [r[field] for r in rows if field in r]
    return (float(np.mean(values)), float(np.std(values))) if values else (None, None)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(PROBLEMS), choices=list(PROBLEMS))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--grid", type=float, nargs="+", default=[0.1, 1.0, 10.0])
    parser.add_argument("--quantile", type=float, default=0.5, help="adaptive clipping's target quantile")
    parser.add_argument("--paper-count-noise", action="store_true",
                        help="count noise = expected batch size / 20 (Andrew et al.; the recorded table)")
    parser.add_argument("--output-dir", default=os.path.join("benchmarks", "output"))
    args = parser.parse_args(argv)
    if 1.0 not in args.grid:
        parser.error("--grid must contain 1.0 (the C = 1 baseline)")
    t0 = time.time()
    table, records = [], []
    for name in args.models:
        p = PROBLEMS[name](np.random.default_rng(0))
        ref = fit_svi(p, args.steps) if p.posterior is not None else None
        cache = {}
        for epsilon in EPSILONS:
            runs = {}   # method -> list of per-seed figures
            for C, adaptive in [(c, False) for c in args.grid] + [(1.0, True)]:
                rows = []
                for seed in range(args.seeds):
                    params, final_C, eps = fit_dpsvi(p, C, adaptive, epsilon, seed, args.steps, cache,
                                                     args.quantile, args.paper_count_noise)
                    row = {k: float(v) for k, v in p.scores(params, jax.random.PRNGKey(100 + seed)).items()}
                    row.update(posterior_figures(p, params, ref), C=final_C, epsilon=eps)
                    rows.append(row)
                runs["adaptive" if adaptive else C] = rows
                print(f"[{time.time() - t0:6.0f} s] {name} eps={epsilon:g} "
                      f"{'adaptive' if adaptive else f'C={C:g}'}: lpd {_mean(rows, 'lpd')[0]:.4f}, "
                      f"C {_mean(rows, 'C')[0]:.3g}", flush=True)
            best = max(args.grid, key=lambda c: _mean(runs[c], "lpd")[0])
            adaptive_label = "adaptive" + ("" if args.quantile == 0.5 else f" (γ = {args.quantile:g})")
            for label, key in [(adaptive_label, "adaptive"), (f"best C = {best:g}", best), ("C = 1", 1.0)]:
                rows = runs[key]
                entry = {"model": name, "epsilon": epsilon, "method": label}
                for field in ("lpd", "acc", "dist", "sd_ratio", "C"):
                    entry[field], entry[field + "_sd"] = _mean(rows, field)
                table.append(entry)
            records.append({"model": name, "epsilon": epsilon,
                            "runs": {str(k): v for k, v in runs.items()}})

    def fmt(x, digits=3):
        return "—" if x is None else f"{x:.{digits}f}"

    lines = ["| model | ε | method | final C | held-out log density | accuracy | mean dist. | sd ratio |",
             "|---|---|---|---|---|---|---|---|"]
    for e in table:
        lines.append(f"| {e['model']} | {e['epsilon']:g} | {e['method']} | {e['C']:.3g} | "
                     f"{fmt(e['lpd'])} ± {fmt(e['lpd_sd'])} | {fmt(e['acc'])} | {fmt(e['dist'])} | "
                     f"{fmt(e['sd_ratio'])} |")
    print("\n".join(lines))
    os.makedirs(args.output_dir, exist_ok=True)
    path = os.path.join(args.output_dir, "adaptive_clipping.json")
    with open(path, "w") as f:
        json.dump({"args": vars(args), "table": table, "runs": records}, f, indent=1)
    print(f"{time.time() - t0:.0f} s; wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
