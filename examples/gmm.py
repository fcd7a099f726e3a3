"""Gaussian mixture model with DP-VI: the d3p paper's section 5.4 and appendix A.

A mixture of k spherical Gaussians in d dimensions,

    p(x_i) = sum_j pi_j N(x_i; mu_j, sigma_j^2 I),

with the latent component assignment z_i marginalised out: DP-VI must not
learn a latent variable per record (its posterior would be a per-record
release), so the likelihood of a record is the log-sum-exp over components.
:class:`GaussianMixture` below is a NumPyro ``Distribution`` subclass doing
that (the paper's listing 5); the model (listing 6) puts a Dirichlet prior on
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

import argparse
import csv
import math
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Optional, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import numpyro  # noqa: E402
import numpyro.distributions as dist  # noqa: E402
from jax.scipy.special import logsumexp  # noqa: E402
from numpyro.distributions import constraints  # noqa: E402
from numpyro.infer import Trace_ELBO  # noqa: E402
from numpyro.infer.autoguide import AutoDiagonalNormal  # noqa: E402
from numpyro.infer.initialization import init_to_uniform  # noqa: E402

import d3p.random  # noqa: E402
from d3p.accounting import accounting_for  # noqa: E402
from d3p.dputil import calibrate_sigma  # noqa: E402
from d3p.svi import DPSVI  # noqa: E402

DEFAULT_OUTPUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "output")
NON_PRIVATE = float("inf")
_TRACE_LOCK = threading.Lock()  # NumPyro's handler stack is global: trace in one thread at a time


# -------------------------------------------------------------- distribution


class GaussianMixture(dist.Distribution):
    """Mixture of spherical Gaussians with the component assignment marginalised out.

    :param pis: mixture weights, ``(k,)``, on the simplex.
    :param locs: component means, ``(k, d)``.
    :param scales: component standard deviations, ``(k,)`` (spherical) or ``(k, d)``.

    ``log_prob(x) = logsumexp_j [log pi_j + sum_e log N(x_e; locs[j, e], scales[j, e])]``
    for ``x`` of shape ``(..., d)``.
    """

    arg_constraints = {
        "pis": constraints.simplex,
        "locs": constraints.real_matrix,
        "scales": constraints.positive,
    }
    support = constraints.real_vector
    reparametrized_params = []

    def __init__(self, pis, locs, scales, *, validate_args=None):
        self.pis = jnp.asarray(pis)
        self.locs = jnp.asarray(locs)
        scales = jnp.asarray(scales)
        self.scales = scales[:, None] if scales.ndim == 1 else scales
        super().__init__(batch_shape=(), event_shape=self.locs.shape[-1:], validate_args=validate_args)

    def sample(self, key, sample_shape=()):
        """Draw ``z ~ Categorical(pis)`` then ``x ~ N(locs[z], scales[z]^2 I)``."""
        z_key, x_key = jax.random.split(key)
        zs = dist.CategoricalProbs(self.pis).sample(z_key, sample_shape)
        eps = jax.random.normal(x_key, tuple(sample_shape) + self.event_shape)
        return self.locs[zs] + self.scales[zs] * eps

    def log_prob(self, value):
        """Marginal log-density of ``value`` (shape ``(..., d)``), shape ``(...)``."""
        per_component = dist.Normal(self.locs, self.scales).log_prob(value[..., None, :]).sum(-1)
        return logsumexp(per_component + jnp.log(self.pis), axis=-1)


# --------------------------------------------------------------------- model


def model(xs, N, k=5):
    """The GMM of the paper's listing 6 (records ``xs``: ``(B, d)``)."""
    batch_size, d = xs.shape
    pis = numpyro.sample("pis", dist.Dirichlet(jnp.ones(k)))
    with numpyro.plate("components", k):
        locs = numpyro.sample("locs", dist.MultivariateNormal(jnp.zeros(d), jnp.eye(d)))
        sigmas = numpyro.sample("sigmas", dist.InverseGamma(1.0, 1.0))
    with numpyro.plate("batch", N, subsample_size=batch_size):
        numpyro.sample("xs", GaussianMixture(pis, locs, sigmas), obs=xs)


# ---------------------------------------------------------------------- data

TRUE_PIS = np.array([0.3, 0.25, 0.2, 0.15, 0.1])
TRUE_LOCS = 1.5 * np.stack([np.cos(2 * np.pi * np.arange(5) / 5 + 0.3),
                            np.sin(2 * np.pi * np.arange(5) / 5 + 0.3)], axis=1)
TRUE_SCALES = np.array([0.3, 0.25, 0.35, 0.2, 0.3])


def make_data(n: int, seed: int) -> np.ndarray:
    """``n`` points from the 5-cluster ground truth mixture in 2-d."""
    x = GaussianMixture(TRUE_PIS, TRUE_LOCS, TRUE_SCALES).sample(jax.random.PRNGKey(seed), (n,))
    return np.asarray(x, np.float32)


def true_loglik(test: np.ndarray) -> float:
    """Mean log-likelihood of ``test`` under the true mixture (an upper reference)."""
    return float(jnp.mean(GaussianMixture(TRUE_PIS, TRUE_LOCS, TRUE_SCALES).log_prob(test)))


def predictive_loglik(guide, params, test, rng_key, num_samples=200) -> float:
    """Mean over test records of log E_q[p(x | θ)] (posterior predictive), by Monte Carlo."""
    post = guide.sample_posterior(rng_key, params, sample_shape=(num_samples,))
    ll = jax.vmap(lambda p, l, s: GaussianMixture(p, l, s).log_prob(test))(
        post["pis"], post["locs"], post["sigmas"]
    )  # (S, n)
    return float(jnp.mean(logsumexp(ll, axis=0) - math.log(num_samples)))


# ---------------------------------------------------------------- experiment


def sampler_name(sampling: str) -> str:
    """The accounting's name of a ``DPSVI.run`` sampling option."""
    return "poisson" if sampling == "poisson" else "fixed_size"


def run_level(epsilon: float, train, test, args) -> Dict:
    N = train.shape[0]
    B = args.batch_size
    if epsilon == NON_PRIVATE:
        sigma, C = 0.0, float("inf")
    else:
        # σ for the sampler DPSVI.run uses below (Poisson: add/remove; fixed: substitute)
        sigma, _, _ = calibrate_sigma(epsilon, args.delta, B / N, args.num_steps,
                                      sampler=sampler_name(args.sampling))
        C = args.clipping_threshold
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

    start = time.perf_counter()
    with _TRACE_LOCK:
        lowered = jax.jit(jax.vmap(one_run)).lower(keys)
    params = jax.block_until_ready(lowered.compile()(keys))
    seconds = time.perf_counter() - start
    eval_keys = jax.random.split(jax.random.PRNGKey(7), args.seeds)
    lls, fits = [], []
    with _TRACE_LOCK:
        for s in range(args.seeds):
            p = jax.tree.map(lambda a: a[s], params)
            lls.append(predictive_loglik(guide, p, jnp.asarray(test), eval_keys[s]))
            fits.append(guide.median(p))
    return dict(epsilon=epsilon, sigma=sigma, clip=C, epsilon_spent=spent[0], lls=lls,
                fit=fits[0], seconds=seconds)


def label(eps: float) -> str:
    return "non-private" if eps == NON_PRIVATE else f"ε={eps:g}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="tiny CI run: 300 steps, 2 seeds, ε=1 and non-private")
    parser.add_argument("--output-dir", default=DEFAULT_OUTPUT_DIR,
                        help="where the PNGs and CSV go (default: examples/output/)")
    parser.add_argument("--num-steps", type=int, default=None, help="DP-VI iterations (default 1000)")
    parser.add_argument("--seeds", type=int, default=None, help="runs per ε (default 5)")
    parser.add_argument("--epsilons", type=float, nargs="+", default=None,
                        help="privacy levels (default 0.1 0.2 0.5 1 2 5 10); a non-private run is added")
    parser.add_argument("--num-train", type=int, default=10_000, help="training records N (default 10000)")
    parser.add_argument("--num-test", type=int, default=1_000, help="test records (default 1000)")
    parser.add_argument("--batch-size", type=int, default=100,
                        help="B: expected batch size (Poisson) or batch size (fixed); "
                             "default 100, q = B/N = 0.01")
    parser.add_argument("--sampling", choices=("poisson", "fixed"), default="poisson",
                        help="poisson (default; add/remove relation) or fixed-size batches without "
                             "replacement (substitute relation)")
    parser.add_argument("--delta", type=float, default=None, help="δ (default 1/(10 N) = 1e-5)")
    parser.add_argument("--clipping-threshold", type=float, default=10.0,
                        help="C (default 10, chosen on pilot data from other seeds of the generator)")
    parser.add_argument("--learning-rate", type=float, default=0.02, help="Adam step size (default 0.02)")
    parser.add_argument("--jobs", type=int, default=2, help="privacy levels trained in parallel (default 2)")
    args = parser.parse_args(argv)
    if args.quick:
        defaults = dict(num_steps=300, seeds=2, epsilons=[1.0])
    else:
        defaults = dict(num_steps=1000, seeds=5, epsilons=[0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0])
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.delta is None:
        args.delta = 1.0 / (10 * args.num_train)
    os.makedirs(args.output_dir, exist_ok=True)

    train = make_data(args.num_train, seed=1)
    test = make_data(args.num_test, seed=2)
    reference = true_loglik(test)
    levels = list(args.epsilons) + [NON_PRIVATE]
    print("Gaussian mixture model (k=5 spherical components, d=2), DP-VI with d3p")
    size = "expected batch size" if args.sampling == "poisson" else "batch size"
    print(f"  N={args.num_train} training / {args.num_test} test records, {args.num_steps} steps, "
          f"{size} {args.batch_size} (q={args.batch_size / args.num_train:g}), δ={args.delta:g}, "
          f"C={args.clipping_threshold}, Adam({args.learning_rate}), {args.seeds} seeds")
    print(f"  {accounting_for(sampler_name(args.sampling)).describe()}")
    print(f"  training {len(levels)} privacy levels ({args.jobs} in parallel) ...", flush=True)
    start = time.perf_counter()
    results = []
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = [pool.submit(run_level, e, train, test, args) for e in levels]
        for fut in futures:
            r = fut.result()
            results.append(r)
            print(f"  {label(r['epsilon']):>12s}: σ={r['sigma']:.3g}, ε spent={r['epsilon_spent']:.3g}, "
                  f"test log-lik {np.mean(r['lls']):.3f} ± {np.std(r['lls']) / np.sqrt(len(r['lls'])):.3f} "
                  f"({r['seconds']:.0f} s)", flush=True)
    total = time.perf_counter() - start

    csv_path = os.path.join(args.output_dir, "gmm_results.csv")
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["level", "epsilon_target", "epsilon_spent", "delta", "sampling", "sigma", "C",
                    "num_steps", "batch_size", "seed", "test_loglik_per_record"])
        for r in results:
            for s, ll in enumerate(r["lls"]):
                w.writerow([label(r["epsilon"]), r["epsilon"], r["epsilon_spent"], args.delta, args.sampling,
                            r["sigma"], r["clip"], args.num_steps, args.batch_size, s, f"{ll:.5f}"])

    private = [r for r in results if r["epsilon"] != NON_PRIVATE]
    nonpriv = [r for r in results if r["epsilon"] == NON_PRIVATE][0]
    fig, ax = plt.subplots(figsize=(5, 4))
    eps = [r["epsilon"] for r in private]
    mean = [np.mean(r["lls"]) for r in private]
    sem = [np.std(r["lls"]) / np.sqrt(len(r["lls"])) for r in private]
    ax.errorbar(eps, mean, yerr=sem, marker="o", capsize=3, label="DP-VI (d3p)")
    ax.axhline(np.mean(nonpriv["lls"]), color="gray", ls="--", label="non-private VI")
    ax.axhline(reference, color="black", ls=":", label="true mixture")
    ax.set_xscale("log")
    ax.set_xlabel("ε")
    ax.set_ylabel("test log-likelihood per record")
    ax.set_title(f"GMM, {args.num_steps} iterations, δ={args.delta:g}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    ll_path = os.path.join(args.output_dir, "gmm_test_loglik.png")
    fig.savefig(ll_path, dpi=120)
    plt.close(fig)

    shown = [r for r in results if r["epsilon"] in (min(args.epsilons), 1.0, NON_PRIVATE)]
    fig, axes = plt.subplots(1, len(shown), figsize=(3.2 * len(shown), 3.2), squeeze=False)
    for ax, r in zip(axes[0], shown):
        ax.scatter(test[:, 0], test[:, 1], s=2, color="lightgray")
        fit = r["fit"]
        t = np.linspace(0, 2 * np.pi, 60)
        for j in range(len(fit["pis"])):
            c, s = np.asarray(fit["locs"][j]), float(fit["sigmas"][j])
            ax.plot(c[0] + 2 * s * np.cos(t), c[1] + 2 * s * np.sin(t),
                    lw=0.5 + 6 * float(fit["pis"][j]))
        ax.set_title(label(r["epsilon"]))
        ax.set_aspect("equal")
        ax.set_xlim(-3, 3)
        ax.set_ylim(-3, 3)
    fig.suptitle("learned components (2σ circles, width ∝ weight), seed 0", fontsize=9)
    fig.tight_layout()
    fit_path = os.path.join(args.output_dir, "gmm_fit.png")
    fig.savefig(fit_path, dpi=120)
    plt.close(fig)

    print()
    print("Test log-likelihood per record (mean ± standard error over seeds):")
    for r in results:
        print(f"  {label(r['epsilon']):>12s} (σ={r['sigma']:6.3g}): {np.mean(r['lls']):8.3f} ± "
              f"{np.std(r['lls']) / np.sqrt(len(r['lls'])):.3f}")
    print(f"  {'true mixture':>12s}             : {reference:8.3f}")
    print()
    print(f"Total training time {total:.0f} s.")
    print(f"Wrote {ll_path}")
    print(f"Wrote {fit_path}")
    print(f"Wrote {csv_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
