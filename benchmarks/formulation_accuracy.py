"""Accuracy of DPSVI's ELBO formulations against non-private SVI.

For the d3p paper's models (logistic regression, hierarchical logistic
regression, Gaussian mixture, VAE) the script fits

- non-private NumPyro SVI (minibatches of the same size, the same steps and
  optimizer), the reference;
- DPSVI with ``formulation="per_record"`` (each record's whole ELBO with its
  own guide sample, clipped: d3p 0.2), ``"own_sample"`` (only the terms of
  sites in the records plate clipped, the prior and guide terms of global
  sites once per step, after the noise) and ``"shared_sample"`` (as
  ``"own_sample"``, with one guide draw of the global latent variables per
  step, shared by the batch), at ε = 1 and ε = 8 (Poisson sampling,
  add/remove, δ = 1/N², σ calibrated by ``DPSVI.run(epsilon=...)``),

and reports, on held-out data, the mean log predictive density per record
(for the VAE: the ELBO per image, a lower bound of it), and the distance of
the posterior mean from SVI's (relative to the norm of SVI's) and the ratio
of posterior standard deviations (geometric mean over coordinates); means
over ``--seeds`` seeds. The VAE has no global latent variable (its weights
are parameters), so there the formulations differ only in how the
per-record keys are drawn and its posterior columns are empty.

Data (no downloads): generated for the regressions and the mixture;
scikit-learn's bundled ``load_digits`` (8×8 images, binarised at 8/16) for a
small VAE (64-32-(4, 4), decoder 4-32-64).

Usage::

    python benchmarks/formulation_accuracy.py             # all models, 2 seeds
    python benchmarks/formulation_accuracy.py --models logreg --seeds 1
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
from scipy.optimize import linear_sum_assignment

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
from d3p.svi import DPSVI

FORMULATIONS = ("per_record", "own_sample", "shared_sample")
ALL_FORMULATIONS = FORMULATIONS + ("aligned",)
EPSILONS = (1.0, 8.0)
SAMPLES = 200   # posterior samples for the predictive densities and moments


# ----------------------------------------------------------------- problems


class Problem:
    """A model, its guide, training and held-out data, and its measures."""

    def __init__(self, name, model, guide, train, test, shared, batch_size, steps, lr, C):
        self.name, self.model, self.guide = name, model, guide
        self.train, self.test, self.shared = train, test, shared
        self.N = train[0].shape[0]
        self.batch_size, self.steps, self.lr, self.C = batch_size, steps, lr, C

    def posterior(self, params, key):
        """``(mean, sd)`` vectors of the global latent variables, or None."""
        return None

    def predictive(self, params, key):
        """Mean held-out log predictive density per record."""
        raise NotImplementedError


def _logmeanexp(x, axis=0):
    return jax.scipy.special.logsumexp(x, axis=axis) - np.log(x.shape[axis])


class LogReg(Problem):
    def posterior(self, params, key):
        return np.asarray(params["w_loc"]), np.exp(np.asarray(params["w_scale_log"]))

    def predictive(self, params, key):
        xs, ys = self.test
        eps = jax.random.normal(key, (SAMPLES,) + params["w_loc"].shape)
        w = params["w_loc"] + jnp.exp(params["w_scale_log"]) * eps
        logp = dist.Bernoulli(logits=w @ xs.T).log_prob(ys)   # (S, n)
        return float(jnp.mean(_logmeanexp(logp)))


class HLogReg(Problem):
    def posterior(self, params, key):
        return np.ravel(params["M_loc"]), np.ravel(np.exp(np.asarray(params["M_scale_log"])))

    def predictive(self, params, key):
        xs, ys, ls = self.test
        gs = self.shared["gs"]
        k1, k2 = jax.random.split(key)
        M = params["M_loc"] + jnp.exp(params["M_scale_log"]) * jax.random.normal(k1, (SAMPLES,) + params["M_loc"].shape)
        ws = jnp.einsum("lk,sdk->sld", gs, M) + jax.random.normal(k2, (SAMPLES, gs.shape[0], xs.shape[1]))
        logits = jnp.einsum("nd,snd->sn", xs, ws[:, ls])
        logp = dist.Bernoulli(logits=logits).log_prob(ys)
        return float(jnp.mean(_logmeanexp(logp)))


class GMM(Problem):
    def _samples(self, params, key):
        s = Predictive(self.guide, params=params, num_samples=SAMPLES)(key, self.test[0][:1], N=self.N, k=self.k)
        return s["pis"], s["locs"], s["sigmas"]

    def posterior(self, params, key):
        pis, locs, sigmas = self._samples(params, key)
        parts = [locs.reshape(SAMPLES, self.k, -1), sigmas[..., None], pis[..., None]]
        return np.asarray(jnp.concatenate(parts, -1))   # (S, k, d + 2): aligned in compare()

    def predictive(self, params, key):
        pis, locs, sigmas = self._samples(params, key)
        logp = jax.vmap(lambda p, m, s: GaussianMixture(m, s[:, None], p).log_prob(self.test[0]))(pis, locs, sigmas)
        return float(jnp.mean(_logmeanexp(logp)))


class VAE(Problem):
    def predictive(self, params, key):
        (xs,) = self.test
        loss = Trace_ELBO(num_particles=20).loss(key, params, self.model, self.guide, xs, N=xs.shape[0])
        return -float(loss) / xs.shape[0]


def make_problems(seed=0):
    rng = np.random.default_rng(seed)
    problems = {}

    # logistic regression, d = 10, N = 10,000 (+ 2,000 held out)
    d, n = 10, 12000
    xs = rng.normal(size=(n, d)).astype(np.float32)
    w = rng.normal(size=d) * 0.7
    ys = (rng.random(n) < 1 / (1 + np.exp(-xs @ w))).astype(np.float32)
    problems["logreg"] = LogReg("logreg", logistic_regression_model, logistic_regression_guide,
                                (xs[:10000], ys[:10000]), (xs[10000:], ys[10000:]), {}, 200, 1500, 0.01, 1.0)

    # hierarchical logistic regression, D = 5, K = 3, L = 3 (paper, section 5.3), N = 5,000 (+ 1,000)
    D, K, L, n = 5, 3, 3, 6000
    gs = rng.normal(size=(L, K)).astype(np.float32)
    M = rng.normal(size=(D, K))
    ws = gs @ M.T + rng.normal(size=(L, D))
    ls = rng.integers(0, L, n).astype(np.int32)
    xs = rng.normal(size=(n, D)).astype(np.float32)
    ys = (rng.random(n) < 1 / (1 + np.exp(-np.einsum("nd,nd->n", xs, ws[ls])))).astype(np.float32)
    problems["hlogreg"] = HLogReg(
        "hlogreg", hierarchical_logistic_regression_model, hierarchical_logistic_regression_guide,
        (xs[:5000], ys[:5000], ls[:5000]), (xs[5000:], ys[5000:], ls[5000:]), {"gs": jnp.asarray(gs)},
        100, 1500, 0.01, 1.0)

    # Gaussian mixture, k = 3 in 2-d, N = 10,000 (+ 2,000)
    k, n = 3, 12000
    centres = np.array([[-2.0, 0.0], [2.0, 1.0], [0.0, -2.5]])
    z = rng.choice(k, n, p=[0.5, 0.3, 0.2])
    xs = (centres[z] + rng.normal(size=(n, 2)) * np.array([0.6, 0.8, 0.5])[z, None]).astype(np.float32)
    gmm = GMM("gmm", gmm_model, AutoDiagonalNormal(gmm_model), (xs[:10000],), (xs[10000:],), {"k": k},
              200, 1500, 0.02, 2.0)
    gmm.k = k
    problems["gmm"] = gmm

    # VAE on scikit-learn's digits, binarised
    from sklearn.datasets import load_digits

    digits = (load_digits().data >= 8).astype(np.float32)
    order = rng.permutation(len(digits))
    digits = digits[order]
    model, guide = make_vae(64, 32, 4)
    problems["vae"] = VAE("vae", model, guide, (digits[:1500],), (digits[1500:],), {}, 50, 1500, 3e-3, 5.0)
    return problems


# --------------------------------------------------------------------- fits


def fit_svi(p, seed):
    """Non-private SVI on minibatches of B drawn uniformly (without replacement) per step."""
    svi = SVI(p.model, p.guide, numpyro.optim.Adam(p.lr), Trace_ELBO(), N=p.N, **p.shared)
    data = tuple(jnp.asarray(x) for x in p.train)
    key = jax.random.PRNGKey(seed)
    state = svi.init(key, *(x[: p.batch_size] for x in data))

    def body(state, k):
        idx = jax.random.choice(k, p.N, (p.batch_size,), replace=False)
        return svi.update(state, *(x[idx] for x in data))[0], None

    state, _ = jax.jit(lambda s, ks: jax.lax.scan(body, s, ks))(state, jax.random.split(key, p.steps))
    return svi.get_params(state)


_dpsvis = {}


def fit_dpsvi(p, formulation, epsilon, seed):
    """DPSVI.run with Poisson batches of expected size B at ``epsilon``
    (δ = 1/N²); one DPSVI per setting, so the seeds reuse its compiled steps."""
    key = (p.name, formulation, epsilon)
    if key not in _dpsvis:
        _dpsvis[key] = DPSVI(p.model, p.guide, numpyro.optim.Adam(p.lr), Trace_ELBO(), clipping_threshold=p.C,
                             dp_scale=None, formulation=formulation, N=p.N, **p.shared)
    svi = _dpsvis[key]
    result = svi.run(d3p.random.PRNGKey(seed), p.steps, *p.train, batch_size=p.batch_size, epsilon=epsilon,
                     delta=1.0 / p.N**2, accountant="rdp", progress_bar=False)
    return result.params, result.sigma


# ------------------------------------------------------------------ measures


def compare(p, params, ref_params, key):
    """``(predictive, mean distance, sd ratio)`` of ``params`` against SVI's."""
    pred = p.predictive(params, key)
    post, ref = p.posterior(params, key), p.posterior(ref_params, key)
    if post is None:
        return pred, None, None
    if isinstance(p, GMM):   # align the components with SVI's (label switching)
        m, r = post.mean(0), ref.mean(0)
        rows, cols = linear_sum_assignment(((r[:, None, :2] - m[None, :, :2]) ** 2).sum(-1))
        post = post[:, cols]
        mean, sd, ref_mean, ref_sd = post.mean(0).ravel(), post.std(0).ravel(), ref.mean(0).ravel(), ref.std(0).ravel()
    else:
        (mean, sd), (ref_mean, ref_sd) = post, ref
    distance = float(np.linalg.norm(mean - ref_mean) / np.linalg.norm(ref_mean))
    ratio = float(np.exp(np.mean(np.log(sd / ref_sd))))
    return pred, distance, ratio


def write_rows(output_dir, name, rows):
    """The table's rows and the command line as JSON in ``output_dir/name``; says where."""
    os.makedirs(output_dir, exist_ok=True)
    out = os.path.join(output_dir, name)
    with open(out, "w") as f:
        json.dump({"argv": sys.argv, "rows": rows}, f, indent=1, default=float)
    print(f"wrote {out}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["logreg", "hlogreg", "gmm", "vae"])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--formulations", nargs="+", default=list(FORMULATIONS), choices=ALL_FORMULATIONS)
    parser.add_argument("--epsilons", nargs="+", type=float, default=list(EPSILONS))
    parser.add_argument("--output-dir", default=os.path.join("benchmarks", "output"))
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    print(f"jax {jax.__version__}, numpyro {numpyro.__version__}, backend {jax.default_backend()}", flush=True)
    problems = make_problems()
    rows = []
    print("| model | ε | fit | held-out log pred. density | mean distance to SVI | sd ratio to SVI | σ |")
    print("|---|---|---|---|---|---|---|", flush=True)
    for name in args.models:
        p = problems[name]
        t0 = time.perf_counter()
        refs = [fit_svi(p, s) for s in range(args.seeds)]
        results = {("svi", None): [compare(p, r, refs[0], jax.random.PRNGKey(100)) for r in refs]}
        sigmas = {}
        for epsilon in args.epsilons:
            for formulation in args.formulations:
                got = []
                for s in range(args.seeds):
                    params, sigma = fit_dpsvi(p, formulation, epsilon, s)
                    got.append(compare(p, params, refs[s], jax.random.PRNGKey(100 + s)))
                    sigmas[epsilon] = sigma
                results[(formulation, epsilon)] = got
        for (fit, epsilon), got in results.items():
            pred = np.mean([g[0] for g in got])
            dist_ = None if got[0][1] is None else np.mean([g[1] for g in got])
            ratio = None if got[0][2] is None else np.exp(np.mean(np.log([g[2] for g in got])))
            row = dict(model=name, epsilon=epsilon, fit=fit, predictive=pred, mean_distance=dist_, sd_ratio=ratio,
                       sigma=sigmas.get(epsilon), seeds=args.seeds,
                       per_seed=[list(g) for g in got])
            rows.append(row)
            fmt = lambda v, f: "n/a" if v is None else format(v, f)  # noqa: E731
            print(f"| {name} | {fmt(epsilon, 'g') if epsilon else '∞'} | {fit} | {pred:.4f} | "
                  f"{fmt(dist_, '.3f')} | {fmt(ratio, '.2f')} | {fmt(sigmas.get(epsilon), '.3f')} |", flush=True)
        print(f"<!-- {name}: {time.perf_counter() - t0:.0f} s -->", flush=True)
    write_rows(args.output_dir, "formulation_accuracy.json", rows)


if __name__ == "__main__":
    main()
