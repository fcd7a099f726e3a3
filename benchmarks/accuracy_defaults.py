"""Accuracy of what ``DPSVI.run(epsilon=...)`` gives by default, against non-private SVI.

For the d3p paper's models the script fits non-private NumPyro SVI to
convergence (full batch, 4 particles, ``--reference-steps`` Adam steps: the
reference posterior) and DPSVI at ε = 1 and ε = 8 (δ = 1/N²), 3 seeds, as:

- ``earlier recipe``: what the README showed before d3p chose settings: the
  problem's Adam step size, C and explicit expected batch ``B`` (Poisson,
  add/remove), the problem's number of steps, no averaging;
- ``defaults``: what a user gets from ``DPSVI(model, guide, loss=Trace_ELBO(),
  N=N).run(key, None, *data, epsilon=ε)``: every setting chosen by d3p (the
  batch, :func:`d3p._run_plan.automatic_q`; C by adaptive clipping to the 0.98
  quantile; Adam at :data:`d3p._run_plan.CHOSEN_STEP_SIZE`; the number of
  steps; the mean of the last half of the iterates);
- the ablations ``defaults, σ = 0`` (the same without noise: C follows the
  exact quantile; what clipping and optimisation leave) and ``defaults, no
  clipping, σ = 0`` (C = ∞ as well: what the optimisation alone leaves).

Problems (no downloads): ``readme``, the README's logistic regression on
scikit-learn's breast-cancer data (N = 455, d = 31); ``logreg20k``, generated
logistic regression (N = 20,000, d = 30); ``hlogreg``, ``gmm`` and ``vae``
as in ``formulation_accuracy.py`` (the VAE has no global latent variable: its
rows have the held-out ELBO per image only).

Each row: the posterior mean's error in units of the reference posterior sd
(mean over coordinates of |μ − μ_ref| / sd_ref), the ratio of posterior sds
(geometric mean over coordinates), and the held-out log predictive density
per record against the reference's; means over the seeds. Writes the table
as JSON and a figure (private vs non-private posterior means ± sd at ε = 1)
to ``--output-dir``. With ``--clip``, ``--lr``, ``--formulation`` or
``--adaptive`` it runs the earlier sweep instead (:func:`sweep`).

Usage::

    python benchmarks/accuracy_defaults.py                      # all problems, 3 seeds
    python benchmarks/accuracy_defaults.py --problems readme --seeds 1
"""

import argparse
import os
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
from numpyro.infer import SVI, Trace_ELBO
from scipy.optimize import linear_sum_assignment

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import formulation_accuracy as fa  # noqa: E402

import d3p.random  # noqa: E402
from d3p._paper_models import logistic_regression_guide, logistic_regression_model  # noqa: E402
from d3p import _run_plan  # noqa: E402
from d3p.svi import AdaptiveClipping, DPSVI  # noqa: E402

EPSILONS = (1.0, 8.0)


def _readme_problem():
    from sklearn.datasets import load_breast_cancer

    X, y = load_breast_cancer(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(X))
    n = int(0.8 * len(X))
    train, test = order[:n], order[n:]
    X = (X - X[train].mean(0)) / X[train].std(0)
    X = np.concatenate([X, np.ones((len(X), 1))], axis=1).astype(np.float32)
    y = y.astype(np.float32)
    return fa.LogReg("readme", logistic_regression_model, logistic_regression_guide, (X[train], y[train]),
                     (X[test], y[test]), {}, 64, 2000, 0.01, 1.0)


def _logreg20k_problem():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(22000, 30)).astype(np.float32)
    w = rng.normal(size=30) * 0.5
    y = (rng.uniform(size=22000) < 1 / (1 + np.exp(-X @ w))).astype(np.float32)
    return fa.LogReg("logreg20k", logistic_regression_model, logistic_regression_guide, (X[:20000], y[:20000]),
                     (X[20000:], y[20000:]), {}, 256, 2000, 0.01, 3.0)


def problems():
    made = fa.make_problems()
    return {"readme": _readme_problem(), "logreg20k": _logreg20k_problem(), "hlogreg": made["hlogreg"],
            "gmm": made["gmm"], "vae": made["vae"]}


def reference(p, steps):
    """Non-private SVI to convergence: full batch, 4 particles."""
    svi = SVI(p.model, p.guide, numpyro.optim.Adam(p.lr), Trace_ELBO(num_particles=4), N=p.N, **p.shared)
    return svi.run(jax.random.PRNGKey(0), steps, *(jnp.asarray(x) for x in p.train), progress_bar=False).params


def _moments(p, params, ref_params, key):
    """``(mean, sd, ref_mean, ref_sd)`` of the global latent variables (GMM: components matched)."""
    post, ref = p.posterior(params, key), p.posterior(ref_params, key)
    if isinstance(p, fa.GMM):
        m, r = post.mean(0), ref.mean(0)
        _, cols = linear_sum_assignment(((r[:, None, :2] - m[None, :, :2]) ** 2).sum(-1))
        post = post[:, cols]
        return post.mean(0).ravel(), post.std(0).ravel(), ref.mean(0).ravel(), ref.std(0).ravel()
    (mean, sd), (ref_mean, ref_sd) = post, ref
    return mean, sd, ref_mean, ref_sd


def figures(p, params, ref_params, key):
    if isinstance(p, fa.VAE):   # no global latent variable: the held-out ELBO only
        return {"error_sds": float("nan"), "sd_ratio": float("nan"), "predictive": p.predictive(params, key)}
    mean, sd, ref_mean, ref_sd = _moments(p, params, ref_params, key)
    return {"error_sds": float(np.mean(np.abs(mean - ref_mean) / ref_sd)),
            "sd_ratio": float(np.exp(np.mean(np.log(sd / ref_sd)))),
            "predictive": p.predictive(params, key)}


def _over_seeds(got):
    """The figures of one fit over its seeds: mean error and predictive, geometric mean sd ratio."""
    return {"error_sds": float(np.mean([g["error_sds"] for g in got])),
            "sd_ratio": float(np.exp(np.mean(np.log([g["sd_ratio"] for g in got])))),
            "predictive": float(np.mean([g["predictive"] for g in got]))}


#: The sweep's fits (:func:`sweep`): name -> run's keywords.
FITS = {
    "batch B": lambda p: dict(batch_size=p.batch_size),
    "defaults": lambda p: dict(),
    "defaults, average 0.5": lambda p: dict(average=0.5),
    "defaults, σ = 0": lambda p: dict(),
}


def fit(p, name, epsilon, seed, cache, formulation="own_sample", adaptive=None):
    """One private fit of the sweep; ``adaptive``: the target quantile of adaptive
    clipping (``p.C`` its first threshold), or None for a fixed ``p.C``."""
    if name not in cache:
        clipping = None if adaptive is None else AdaptiveClipping(target_quantile=adaptive)
        cache[name] = DPSVI(p.model, p.guide, numpyro.optim.Adam(p.lr), Trace_ELBO(), clipping_threshold=p.C,
                            dp_scale=None, N=p.N, formulation=formulation, adaptive_clipping=clipping, **p.shared)
    epsilon = float("inf") if name.endswith("σ = 0") else epsilon
    result = cache[name].run(d3p.random.PRNGKey(seed), p.steps, *p.train, epsilon=epsilon, delta=1.0 / p.N**2,
                             progress_bar=False, **FITS[name](p))
    return result


#: The main table's fits (:func:`fit_chosen`).
CHOSEN_FITS = ("earlier recipe", "defaults", "defaults, σ = 0", "defaults, no clipping, σ = 0")


def fit_chosen(p, name, epsilon, seed, cache):
    """One fit of the main table (the module's docstring); ``cache``: the
    DPSVI of each fit, kept between seeds and ε (a run at another ε or
    number of steps compiles nothing)."""
    delta, key = 1.0 / p.N**2, d3p.random.PRNGKey(seed)
    if name == "earlier recipe":
        svi = cache.setdefault(name, DPSVI(p.model, p.guide, numpyro.optim.Adam(p.lr), Trace_ELBO(),
                                           clipping_threshold=p.C, N=p.N, **p.shared))
        return svi.run(key, p.steps, *p.train, batch_size=p.batch_size, epsilon=epsilon, delta=delta,
                       progress_bar=False)
    if name == "defaults, no clipping, σ = 0":   # the batches of the defaults at ε = 1
        svi = cache.setdefault(name, DPSVI(p.model, p.guide, loss=Trace_ELBO(), clipping_threshold=float("inf"),
                                           dp_scale=0.0, N=p.N, **p.shared))
        q = _run_plan.automatic_q(p.N, "poisson", _run_plan.CHOSEN_NUM_STEPS, delta, 1.0)
        return svi.run(key, None, *p.train, q=q, sampling="poisson", target_delta=delta, progress_bar=False)
    svi = cache.setdefault("defaults", DPSVI(p.model, p.guide, loss=Trace_ELBO(), N=p.N, **p.shared))
    epsilon = float("inf") if name == "defaults, σ = 0" else epsilon
    return svi.run(key, None, *p.train, epsilon=epsilon, delta=delta, progress_bar=False)


def plot(rows_by_problem, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows_by_problem), figsize=(5.5 * len(rows_by_problem), 4.2), squeeze=False)
    for ax, (name, (ref, fits)) in zip(axes[0], rows_by_problem.items()):
        order = np.argsort(ref[0])
        idx = np.arange(len(order))
        ax.errorbar(idx, ref[0][order], yerr=ref[1][order], fmt="o", ms=3, color="k", label="non-private SVI")
        for offset, (label, (mean, sd)) in zip((-0.25, 0.25), fits.items()):
            ax.errorbar(idx + offset, mean[order], yerr=sd[order], fmt="o", ms=3, alpha=0.7, label=label)
        ax.set_title(f"{name}, ε = 1")
        ax.set_xlabel("coefficient (sorted by the reference mean)")
        ax.set_ylabel("posterior mean ± sd")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sweep(args):
    """The ablation of the clipping threshold, step size and formulation: the
    chosen ``--fits`` for each C of ``--clip`` (JSON: ``accuracy_sweep.json``)."""
    warnings.simplefilter("ignore")
    print(f"jax {jax.__version__}, numpyro {numpyro.__version__}, backend {jax.default_backend()}, "
          f"formulation {args.formulation}", flush=True)
    print("| problem | C | step size | ε | fit | σ | error (ref. sds) | sd ratio | held-out log pred. (ref.) |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    rows, all_problems = [], problems()
    for pname in args.problems:
        p = all_problems[pname]
        ref = reference(p, args.reference_steps)
        ref_pred = p.predictive(ref, jax.random.PRNGKey(100))
        p.lr = args.lr or p.lr
        for C in args.clip or [p.C]:
            p.C, cache = C, {}
            for epsilon in args.epsilons:
                for name in args.fits or FITS:
                    if name.endswith("σ = 0") and epsilon != args.epsilons[0]:
                        continue
                    results = [fit(p, name, epsilon, seed, cache, args.formulation,
                                   None if name.endswith("σ = 0") else args.adaptive) for seed in range(args.seeds)]
                    got = [figures(p, r.params, ref, jax.random.PRNGKey(100 + seed)) for seed, r in enumerate(results)]
                    final_C = [None if r.state.clipping_threshold is None else float(r.state.clipping_threshold)
                               for r in results]
                    row = dict(problem=pname, C=C, lr=p.lr, formulation=args.formulation, adaptive=args.adaptive,
                               final_C=final_C,
                               epsilon=None if name.endswith("σ = 0") else epsilon, fit=name, **_over_seeds(got),
                               sigma=results[-1].sigma, reference_predictive=ref_pred, seeds=args.seeds,
                               per_seed=got)
                    rows.append(row)
                    eps_text = "—" if row["epsilon"] is None else f"{epsilon:g}"
                    C_text = f"{C:g}" if args.adaptive is None or name.endswith("σ = 0") else \
                        f"adaptive {args.adaptive:g} from {C:g} (final {np.mean(final_C):.3g})"
                    print(f"| {pname} | {C_text} | {p.lr:g} | {eps_text} | {name} | {results[-1].sigma:.3g} | "
                          f"{row['error_sds']:.2f} | {row['sd_ratio']:.2f} | {row['predictive']:.4f} "
                          f"({ref_pred:.4f}) |", flush=True)
    fa.write_rows(args.output_dir, "accuracy_sweep.json", rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--problems", nargs="+", default=["readme", "logreg20k", "hlogreg", "gmm", "vae"])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--reference-steps", type=int, default=8000)
    parser.add_argument("--output-dir", default=os.path.join("benchmarks", "output"))
    parser.add_argument("--fits", nargs="+", choices=list(FITS) + list(CHOSEN_FITS), default=None,
                        help="the fits to run (default: all of the table's, or of the sweep's)")
    parser.add_argument("--epsilons", nargs="+", type=float, default=list(EPSILONS))
    parser.add_argument("--clip", type=float, nargs="+", default=None,
                        help="clipping thresholds C to sweep (default: the problem's own)")
    parser.add_argument("--lr", type=float, default=None, help="Adam's step size (default: the problem's own)")
    parser.add_argument("--formulation", default="own_sample", help="DPSVI's formulation (default own_sample)")
    parser.add_argument("--adaptive", type=float, default=None, metavar="QUANTILE",
                        help="adaptive clipping to this quantile, each --clip its first threshold (the σ = 0 "
                             "rows keep C fixed)")
    args = parser.parse_args(argv)
    if args.clip or args.lr or args.formulation != "own_sample" or args.adaptive is not None:
        return sweep(args)
    return chosen_table(args)


def chosen_table(args):
    """The main table (the module's docstring): JSON ``accuracy_defaults.json`` and the figure."""
    warnings.simplefilter("ignore")
    print(f"jax {jax.__version__}, numpyro {numpyro.__version__}, backend {jax.default_backend()}", flush=True)
    print("| problem | ε | fit | q | σ | steps | final C | error (ref. sds) | sd ratio | held-out (ref.) |")
    print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
    rows, plotted = [], {}
    all_problems = problems()
    for pname in args.problems:
        p = all_problems[pname]
        t0 = time.perf_counter()
        ref = reference(p, args.reference_steps)
        ref_pred = p.predictive(ref, jax.random.PRNGKey(100))
        cache = {}
        for epsilon in args.epsilons:
            for name in args.fits or CHOSEN_FITS:
                if "σ = 0" in name and epsilon != args.epsilons[0]:
                    continue
                got, last, final_C = [], None, []
                for seed in range(args.seeds):
                    last = fit_chosen(p, name, epsilon, seed, cache)
                    got.append(figures(p, last.params, ref, jax.random.PRNGKey(100 + seed)))
                    final_C.append(None if last.state.clipping_threshold is None
                                   else float(last.state.clipping_threshold))
                    if epsilon == 1.0 and seed == 0 and name in ("earlier recipe", "defaults") \
                            and not isinstance(p, (fa.GMM, fa.VAE)):
                        mean, sd, ref_mean, ref_sd = _moments(p, last.params, ref, jax.random.PRNGKey(100))
                        plotted.setdefault(pname, ((ref_mean, ref_sd), {}))[1][name] = (mean, sd)
                row = dict(problem=pname, epsilon=None if "σ = 0" in name else epsilon, fit=name,
                           q=last.q, sigma=last.sigma, num_steps=last.num_steps, final_C=final_C,
                           **_over_seeds(got), reference_predictive=ref_pred, seeds=args.seeds, per_seed=got)
                rows.append(row)
                eps_text = "—" if row["epsilon"] is None else f"{epsilon:g}"
                C_text = "—" if final_C[0] is None else f"{np.mean(final_C):.3g}"
                print(f"| {pname} | {eps_text} | {name} | {last.q:.3g} | {last.sigma:.3g} | {last.num_steps} | "
                      f"{C_text} | {row['error_sds']:.2f} | {row['sd_ratio']:.2f} | {row['predictive']:.4f} "
                      f"({ref_pred:.4f}) |", flush=True)
        print(f"<!-- {pname}: {time.perf_counter() - t0:.0f} s -->", flush=True)
    fa.write_rows(args.output_dir, "accuracy_defaults.json", rows)
    if plotted:
        png = os.path.join(args.output_dir, "accuracy_defaults.png")
        plot(plotted, png)
        print(f"wrote {png}")


if __name__ == "__main__":
    main()
