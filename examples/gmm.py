"""Gaussian mixture model with DP-VI: the d3p paper's section 5.4 and appendix A.

A mixture of k spherical Gaussians in d dimensions,

    p(x_i) = sum_j pi_j N(x_i; mu_j, sigma_j^2 I),

with the latent component assignment z_i marginalised out: DP-VI must not
learn a latent variable per record (its posterior would be a per-record
release), so the likelihood of a record is the log-sum-exp over components.
:class:`d3p.gmm.GaussianMixture` is a NumPyro ``Distribution`` doing that
(the paper's listing 5); the model (listing 6, ``gmm_model`` of the paper's
models) puts a Dirichlet prior on
the weights pi, N(0, I) priors on the means and InverseGamma(1, 1) priors on
the scales sigma_j, as in the paper.

The experiment (after Jälkö et al. 2017, as replicated in the paper): two
dimensional data from 5 spherical clusters, 1 000 DP-VI iterations, the
log-likelihood of a held-out test set under the learned posterior predictive,
for ε from 0.1 to 10 and non-privately, five seeds each. The paper reused the
original code's noise levels σ; here σ is calibrated from (ε, δ) with
:func:`d3p.dputil.calibrate_sigma` for the sampler the run uses: by default
(d3p's default) Poisson sampling, each record in a step with probability
q = B/N (expected batch size B, padded with a mask), under the add/remove
relation; with ``--sampling fixed``, batches of exactly B distinct records
under the substitute relation (accounted with the pair that dominates
fixed-size sampling, :func:`d3p.accounting.accounting_for`; about twice the
σ). Outputs:

* ``gmm_test_loglik.png``: mean test log-likelihood per record against ε
  (log axis) with standard-error bars, the non-private level and the
  log-likelihood of the true mixture as horizontal lines (cf. the paper's
  Figure 7);
* ``gmm_fit.png``: the test data and the learned mixtures (one seed) at a
  few ε;
* ``gmm_results.csv``: every run.

Usage::

    python examples/gmm.py               # full (see examples/README.md for the time)
    python examples/gmm.py --quick       # CI
    python examples/gmm.py --sampling fixed   # fixed-size batches (substitute relation)
    python examples/gmm.py --output-dir /tmp/gmm
"""

import math
import os
import sys
from typing import Dict, Optional, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import numpyro  # noqa: E402
from jax.scipy.special import logsumexp  # noqa: E402
from numpyro.infer import Trace_ELBO  # noqa: E402
from numpyro.infer.autoguide import AutoDiagonalNormal  # noqa: E402
from numpyro.infer.initialization import init_to_uniform  # noqa: E402

import _common as common  # noqa: E402
import d3p.random  # noqa: E402
from d3p._paper_models import gmm_model as model  # noqa: E402
from d3p.gmm import GaussianMixture  # noqa: E402
from d3p.svi import DPSVI  # noqa: E402

NON_PRIVATE = common.NON_PRIVATE
label = common.label


# ---------------------------------------------------------------------- data

TRUE_PIS = np.array([0.3, 0.25, 0.2, 0.15, 0.1])
TRUE_LOCS = 1.5 * np.stack([np.cos(2 * np.pi * np.arange(5) / 5 + 0.3),
                            np.sin(2 * np.pi * np.arange(5) / 5 + 0.3)], axis=1)
TRUE_SCALES = np.array([0.3, 0.25, 0.35, 0.2, 0.3])


def mixture(pis, locs, scales) -> GaussianMixture:
    """The mixture with weights ``pis`` ``(k,)``, means ``locs`` ``(k, d)`` and
    spherical scales ``scales`` ``(k,)``."""
    return GaussianMixture(locs, jnp.asarray(scales)[:, None], pis)


def make_data(n: int, seed: int) -> np.ndarray:
    """``n`` points from the 5-cluster ground truth mixture in 2-d."""
    x = mixture(TRUE_PIS, TRUE_LOCS, TRUE_SCALES).sample(jax.random.PRNGKey(seed), (n,))
    return np.asarray(x, np.float32)


def true_loglik(test: np.ndarray) -> float:
    """Mean log-likelihood of ``test`` under the true mixture (an upper reference)."""
    return float(jnp.mean(mixture(TRUE_PIS, TRUE_LOCS, TRUE_SCALES).log_prob(test)))


def predictive_loglik(guide, params, test, rng_key, num_samples=200) -> float:
    """Mean over test records of log E_q[p(x | θ)] (posterior predictive), by Monte Carlo."""
    post = guide.sample_posterior(rng_key, params, sample_shape=(num_samples,))
    ll = jax.vmap(lambda p, l, s: mixture(p, l, s).log_prob(test))(
        post["pis"], post["locs"], post["sigmas"]
    )  # (S, n)
    return float(jnp.mean(logsumexp(ll, axis=0) - math.log(num_samples)))


# ---------------------------------------------------------------- experiment


def run_level(epsilon: float, train, test, args) -> Dict:
    N, B = train.shape[0], args.batch_size
    sigma, C = common.noise_and_clip(epsilon, args.delta, B / N, args.num_steps, args.sampling,
                                     args.clipping_threshold)
    # NumPyro's default initialisation (uniform in (-r, r) in the unconstrained
    # space) with r=1 instead of 2: data-independent, and it starts the means
    # near the data's (public) scale; with r=2 or prior draws some runs end in
    # a local optimum (two components on one cluster).
    guide = AutoDiagonalNormal(model, init_loc_fn=init_to_uniform(radius=1.0))
    svi = DPSVI(model, guide, numpyro.optim.Adam(args.learning_rate), Trace_ELBO(),
                clipping_threshold=C, dp_scale=sigma, N=N)
    keys = jnp.stack([d3p.random.PRNGKey(100 + s) for s in range(args.seeds)])
    xs = jnp.asarray(train)
    spent = []

    def one_run(key):
        result = svi.run(key, args.num_steps, xs, batch_size=B, sampling=args.sampling,
                         target_delta=args.delta, progress_bar=False)
        spent.append(result.epsilon)
        return result.params

    params, seconds = common.train_seeds(one_run, keys)
    eval_keys = jax.random.split(jax.random.PRNGKey(7), args.seeds)
    lls, fits = [], []
    with common.TRACE_LOCK:
        for s in range(args.seeds):
            p = jax.tree.map(lambda a: a[s], params)
            lls.append(predictive_loglik(guide, p, jnp.asarray(test), eval_keys[s]))
            fits.append(guide.median(p))
    return dict(epsilon=epsilon, sigma=sigma, clip=C, epsilon_spent=spent[0], lls=lls,
                fit=fits[0], seconds=seconds)


def standard_error(values) -> float:
    """The standard error of the mean, with the population sd (as the paper's figure)."""
    return float(np.std(values) / np.sqrt(len(values)))


def parse_args(argv: Optional[Sequence[str]] = None):
    parser = common.parser(__doc__)
    parser.add_argument("--quick", action="store_true",
                        help="tiny CI run: 300 steps, 2 seeds, ε=1 and non-private")
    parser.add_argument("--output-dir", default=common.OUTPUT_DIR, help=common.OUTPUT_HELP)
    parser.add_argument("--num-steps", type=int, default=None, help="DP-VI iterations (default 1000)")
    parser.add_argument("--seeds", type=int, default=None, help="runs per ε (default 5)")
    parser.add_argument("--epsilons", type=float, nargs="+", default=None,
                        help="privacy levels (default 0.1 0.2 0.5 1 2 5 10); a non-private run is added")
    parser.add_argument("--num-train", type=int, default=10_000, help="training records N (default 10000)")
    parser.add_argument("--num-test", type=int, default=1_000, help="test records (default 1000)")
    parser.add_argument("--batch-size", type=int, default=100,
                        help="B: expected batch size (Poisson) or batch size (fixed); "
                             "default 100, q = B/N = 0.01")
    parser.add_argument("--sampling", choices=("poisson", "fixed"), default="poisson", help=common.SAMPLING_HELP)
    parser.add_argument("--delta", type=float, default=None, help="δ (default 1/(10 N) = 1e-5)")
    parser.add_argument("--clipping-threshold", type=float, default=10.0,
                        help="C (default 10, chosen on pilot data from other seeds of the generator)")
    parser.add_argument("--learning-rate", type=float, default=0.02, help="Adam step size (default 0.02)")
    parser.add_argument("--jobs", type=int, default=2, help="privacy levels trained in parallel (default 2)")
    args = common.fill_defaults(
        parser.parse_args(argv),
        quick=dict(num_steps=300, seeds=2, epsilons=[1.0]),
        full=dict(num_steps=1000, seeds=5, epsilons=[0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0]))
    if args.delta is None:
        args.delta = 1.0 / (10 * args.num_train)
    return args


def train_all(args, train, test, levels):
    """Every privacy level, ``args.jobs`` at a time; prints a line for each."""
    print("Gaussian mixture model (k=5 spherical components, d=2), DP-VI with d3p")
    print(f"  N={args.num_train} training / {args.num_test} test records, {args.num_steps} steps, "
          f"{common.batch_size_words(args.sampling)} {args.batch_size} (q={args.batch_size / args.num_train:g}), "
          f"δ={args.delta:g}, C={args.clipping_threshold}, Adam({args.learning_rate}), {args.seeds} seeds")
    print(f"  {common.describe_sampling(args.sampling)}")
    print(f"  training {len(levels)} privacy levels ({args.jobs} in parallel) ...", flush=True)

    def report(r):
        return (f"  {label(r['epsilon']):>12s}: σ={r['sigma']:.3g}, ε spent={r['epsilon_spent']:.3g}, "
                f"test log-lik {np.mean(r['lls']):.3f} ± {standard_error(r['lls']):.3f} ({r['seconds']:.0f} s)")

    return common.run_in_parallel(lambda e: run_level(e, train, test, args), levels, args.jobs, report)


def write_results(args, results) -> str:
    """Every run as a row of ``gmm_results.csv``."""
    header = ["level", "epsilon_target", "epsilon_spent", "delta", "sampling", "sigma", "C",
              "num_steps", "batch_size", "seed", "test_loglik_per_record"]
    rows = ([label(r["epsilon"]), r["epsilon"], r["epsilon_spent"], args.delta, args.sampling,
             r["sigma"], r["clip"], args.num_steps, args.batch_size, s, f"{ll:.5f}"]
            for r in results for s, ll in enumerate(r["lls"]))
    return common.write_csv(os.path.join(args.output_dir, "gmm_results.csv"), header, rows)


def plot_loglik(args, results, reference) -> str:
    """Test log-likelihood against ε, with the non-private and true levels (Figure 7)."""
    private = [r for r in results if r["epsilon"] != NON_PRIVATE]
    nonpriv = [r for r in results if r["epsilon"] == NON_PRIVATE][0]
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.errorbar([r["epsilon"] for r in private], [np.mean(r["lls"]) for r in private],
                yerr=[standard_error(r["lls"]) for r in private], marker="o", capsize=3, label="DP-VI (d3p)")
    ax.axhline(np.mean(nonpriv["lls"]), color="gray", ls="--", label="non-private VI")
    ax.axhline(reference, color="black", ls=":", label="true mixture")
    ax.set_xscale("log")
    ax.set_xlabel("ε")
    ax.set_ylabel("test log-likelihood per record")
    ax.set_title(f"GMM, {args.num_steps} iterations, δ={args.delta:g}")
    ax.legend(fontsize=8)
    return common.save_figure(fig, args.output_dir, "gmm_test_loglik.png")


def plot_fits(args, results, test) -> str:
    """The learned components of the first seed at a few ε over the test data."""
    shown = [r for r in results if r["epsilon"] in (min(args.epsilons), 1.0, NON_PRIVATE)]
    fig, axes = plt.subplots(1, len(shown), figsize=(3.2 * len(shown), 3.2), squeeze=False)
    t = np.linspace(0, 2 * np.pi, 60)
    for ax, r in zip(axes[0], shown):
        ax.scatter(test[:, 0], test[:, 1], s=2, color="lightgray")
        fit = r["fit"]
        for j in range(len(fit["pis"])):
            c, s = np.asarray(fit["locs"][j]), float(fit["sigmas"][j])
            ax.plot(c[0] + 2 * s * np.cos(t), c[1] + 2 * s * np.sin(t), lw=0.5 + 6 * float(fit["pis"][j]))
        ax.set_title(label(r["epsilon"]))
        ax.set_aspect("equal")
        ax.set_xlim(-3, 3)
        ax.set_ylim(-3, 3)
    fig.suptitle("learned components (2σ circles, width ∝ weight), seed 0", fontsize=9)
    return common.save_figure(fig, args.output_dir, "gmm_fit.png")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    train = make_data(args.num_train, seed=1)
    test = make_data(args.num_test, seed=2)
    reference = true_loglik(test)
    results, total = train_all(args, train, test, list(args.epsilons) + [NON_PRIVATE])
    csv_path = write_results(args, results)
    ll_path = plot_loglik(args, results, reference)
    fit_path = plot_fits(args, results, test)
    print()
    print("Test log-likelihood per record (mean ± standard error over seeds):")
    for r in results:
        print(f"  {label(r['epsilon']):>12s} (σ={r['sigma']:6.3g}): {np.mean(r['lls']):8.3f} ± "
              f"{standard_error(r['lls']):.3f}")
    print(f"  {'true mixture':>12s}             : {reference:8.3f}")
    print()
    print(f"Total training time {total:.0f} s.")
    common.print_written(ll_path, fit_path, csv_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
