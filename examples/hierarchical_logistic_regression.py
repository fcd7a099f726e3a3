"""Hierarchical logistic regression with DP-VI: the d3p paper's section 5.3.

The model is the paper's listing 4 (section 3.3): records ``x_i`` in R^D with
binary labels ``y_i`` fall into one of L groups; group ``l`` is described by a
public vector of characteristics ``g_l`` in R^K, and its weight vector has
the hierarchical prior ``w_l ~ N(M g_l, I)`` with ``M_kd ~ N(0, 4^2)``. The
variational posterior is a diagonal Gaussian over ``M``.

The records, their labels and their group indices are private (one row per
individual); the group characteristics ``gs`` are public and shared by all
records, so they are passed to the :class:`~d3p.svi.DPSVI` constructor as a
keyword argument (a "static kwarg"), as is ``N``. The group index ``ls`` is
per-record data and goes through the batch sampler with ``xs`` and ``ys``.

The experiment (paper, section 5.3): synthetic data drawn from the model's
generative process with L=3 groups, K=3 group characteristics and D=5
dimensional records; train on N records, evaluate the AUC of the posterior
predictive distribution on a held-out test set of the same size N, for
ε in {2, 4, 8} (δ = 1/N, as in the paper) and non-privately, ten seeds each;
compare with a non-private, non-hierarchical logistic regression (scikit-learn)
as a simple baseline.

Sampling and accounting (d3p's default): each step includes every training
record independently with probability q = B/N (Poisson sampling with an
expected batch size B, padded to a fixed shape with a mask), and ε is stated
under the add/remove relation; σ comes from
:func:`d3p.dputil.calibrate_sigma` for that sampler. ``--sampling fixed``
uses batches of exactly B distinct records instead, accounted under the
substitute relation with the pair that dominates fixed-size sampling (see
:func:`d3p.accounting.accounting_for`); it needs about twice the σ.

Outputs:

* ``hlr_auc_by_epsilon.png``: box plots of the AUC at N=500 per privacy
  level, with the baseline as a red line (the paper's Figure 4);
* ``hlr_auc_by_n.png``: mean ± one standard deviation of the AUC against N
  (the paper's Figure 5);
* ``hlr_results.csv``: every run (N, level, seed, sampler, relation, σ, ε, AUC).

The paper trained for 100 000 iterations. Here every configuration (N, ε)
runs its ten seeds at once (``jax.vmap`` over :meth:`DPSVI.run` with
``progress_bar=False``, i.e. one ``lax.scan``) and up to ``--jobs``
configurations run in parallel threads. The default ``--num-steps`` is the
paper's 100 000; see ``examples/README.md`` for the measured runtime and
for a shorter setting.

Usage::

    python examples/hierarchical_logistic_regression.py            # full
    python examples/hierarchical_logistic_regression.py --quick    # CI, ~1 min
    python examples/hierarchical_logistic_regression.py --num-steps 30000 --output-dir /tmp/hlr
    python examples/hierarchical_logistic_regression.py --sampling fixed   # fixed-size batches
"""

import os
import sys
from typing import Dict, NamedTuple, Optional, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import numpyro  # noqa: E402
from numpyro.infer import Trace_ELBO  # noqa: E402
from sklearn.linear_model import LogisticRegression  # noqa: E402
from sklearn.metrics import roc_auc_score  # noqa: E402

import _common as common  # noqa: E402
import d3p.random  # noqa: E402
from d3p._paper_models import hierarchical_logistic_regression_guide as guide  # noqa: E402
from d3p._paper_models import hierarchical_logistic_regression_model as model  # noqa: E402
from d3p.svi import DPSVI  # noqa: E402

NON_PRIVATE = common.NON_PRIVATE
label = common.label

D, K, L = 5, 3, 3  # record dimension, group characteristics, groups


# ---------------------------------------------------------------------- data


class Truth(NamedTuple):
    gs: np.ndarray  # (L, K) public group characteristics
    M: np.ndarray  # (D, K)
    ws: np.ndarray  # (L, D) group weight vectors


def make_truth(seed: int = 0) -> Truth:
    """Ground truth drawn from the model's generative process (M with unit scale)."""
    rng = np.random.default_rng(seed)
    gs = rng.normal(size=(L, K))
    M = rng.normal(size=(D, K))
    ws = gs @ M.T + rng.normal(size=(L, D))
    return Truth(gs.astype(np.float32), M, ws)


def make_data(truth: Truth, n: int, seed: int):
    """``n`` records ``(xs, ys, ls)``: x ~ N(0, I), l uniform, y ~ Bernoulli(σ(w_l·x))."""
    rng = np.random.default_rng(seed)
    xs = rng.normal(size=(n, D))
    ls = rng.integers(0, L, size=n)
    thetas = 1.0 / (1.0 + np.exp(-np.einsum("nd,nd->n", xs, truth.ws[ls])))
    ys = rng.uniform(size=n) < thetas
    return xs.astype(np.float32), ys.astype(np.float32), ls.astype(np.int32)


# ---------------------------------------------------------------- evaluation


def predictive_probabilities(params, xs, ls, gs, rng_key, num_samples=1000):
    """Posterior predictive P(y=1 | x, l): average of σ(w_l·x) over
    M ~ q(M) and w_l ~ N(M g_l, I). Post-processing of the released parameters."""
    loc, scale = params["M_loc"], jnp.exp(params["M_scale_log"])
    k1, k2 = jax.random.split(rng_key)
    Ms = loc + scale * jax.random.normal(k1, (num_samples,) + loc.shape)
    etas = jnp.einsum("lk,sdk->sld", gs, Ms)
    ws = etas + jax.random.normal(k2, etas.shape)
    logits = jnp.einsum("nd,snd->sn", xs, ws[:, ls])
    return jnp.mean(jax.nn.sigmoid(logits), axis=0)


def baseline_auc(train, test) -> float:
    """AUC of a non-private, non-hierarchical logistic regression (scikit-learn)."""
    clf = LogisticRegression().fit(train[0], train[1])
    return float(roc_auc_score(test[1], clf.predict_proba(test[0])[:, 1]))


def oracle_auc(truth: Truth, test) -> float:
    """AUC of the true data-generating probabilities (an upper reference)."""
    xs, ys, ls = test
    return float(roc_auc_score(ys, np.einsum("nd,nd->n", xs, truth.ws[ls])))


def heldout_aucs(params, test, gs, num_seeds: int):
    """The AUC on ``test`` of each seed's posterior predictive."""
    eval_keys = jax.random.split(jax.random.PRNGKey(12345), num_seeds)
    aucs = []
    for s in range(num_seeds):
        p = jax.tree.map(lambda a: a[s], params)
        probs = predictive_probabilities(p, jnp.asarray(test[0]), jnp.asarray(test[2]), gs, eval_keys[s])
        aucs.append(float(roc_auc_score(test[1], np.asarray(probs))))
    return aucs


# ---------------------------------------------------------------- experiment


class Config(NamedTuple):
    N: int
    epsilon: float  # NON_PRIVATE for non-private VI


def run_config(cfg: Config, data, truth: Truth, args) -> Dict:
    """Train ``args.seeds`` runs for one (N, ε) at once and return their AUCs."""
    train, test = data
    N, B, delta = cfg.N, args.batch_size, 1.0 / cfg.N
    sigma, C = common.noise_and_clip(cfg.epsilon, delta, B / N, args.num_steps, args.sampling,
                                     args.clipping_threshold)
    gs = jnp.asarray(truth.gs)
    # gs is shared and public: a constructor keyword, not per-record data
    svi = DPSVI(model, guide, numpyro.optim.Adam(args.learning_rate), Trace_ELBO(),
                clipping_threshold=C, dp_scale=sigma, gs=gs, N=N)
    keys = jnp.stack([d3p.random.PRNGKey(1000 * args.seed_offset + s) for s in range(args.seeds)])
    xs, ys, ls = (jnp.asarray(a) for a in train)
    accounted = []

    def one_run(key):
        result = svi.run(key, args.num_steps, xs, ys, ls, batch_size=B, sampling=args.sampling,
                         target_delta=delta, progress_bar=False)
        accounted.append((result.epsilon, result.sampler, result.relation))  # on the host, once
        return result.params

    # the model's group weights `ws` have no guide site on purpose (listing 4)
    params, seconds = common.train_seeds(one_run, keys, ignore_warnings=["Found vars in model but not guide"])
    eps_spent, sampler, relation = accounted[0]
    return dict(N=N, epsilon=cfg.epsilon, sigma=sigma, clip=C, epsilon_spent=eps_spent,
                sampler=sampler, relation=relation, aucs=heldout_aucs(params, test, gs, args.seeds),
                seconds=seconds)


def parse_args(argv: Optional[Sequence[str]] = None):
    parser = common.parser(__doc__)
    parser.add_argument("--quick", action="store_true",
                        help="tiny CI run: 2 000 steps, 3 seeds, ε=4 and non-private, N in {200, 500}")
    parser.add_argument("--output-dir", default=common.OUTPUT_DIR, help=common.OUTPUT_HELP)
    parser.add_argument("--num-steps", type=int, default=None,
                        help="training iterations per run (default 100000, the paper's; --quick: 2000)")
    parser.add_argument("--seeds", type=int, default=None, help="runs per configuration (default 10)")
    parser.add_argument("--epsilons", type=float, nargs="+", default=None,
                        help="privacy levels ε (default 2 4 8); a non-private run is always added")
    parser.add_argument("--sizes", type=int, nargs="+", default=None,
                        help="training set sizes N (default 100 200 500 1000); must include 500")
    parser.add_argument("--batch-size", type=int, default=10,
                        help="B: expected records per step (Poisson, q = B/N) or records per step (fixed); "
                             "default 10")
    parser.add_argument("--sampling", choices=("poisson", "fixed"), default="poisson", help=common.SAMPLING_HELP)
    parser.add_argument("--clipping-threshold", type=float, default=2.0, help="C (default 2)")
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="Adam step size (default 1e-3)")
    parser.add_argument("--jobs", type=int, default=2, help="configurations trained in parallel (default 2)")
    parser.add_argument("--data-seed", type=int, default=0, help="seed of the synthetic ground truth")
    parser.add_argument("--seed-offset", type=int, default=0, help="offset of the training seeds")
    args = common.fill_defaults(
        parser.parse_args(argv),
        quick=dict(num_steps=2000, seeds=3, epsilons=[4.0], sizes=[200, 500]),
        full=dict(num_steps=100_000, seeds=10, epsilons=[2.0, 4.0, 8.0], sizes=[100, 200, 500, 1000]))
    if 500 not in args.sizes:
        parser.error("--sizes must include 500 (the N of the box plot)")
    if args.batch_size > min(args.sizes):
        parser.error(f"--batch-size={args.batch_size} is larger than the smallest N={min(args.sizes)}")
    return args


def make_datasets(args):
    """The ground truth and, per N, a training and a test set of N records each."""
    truth = make_truth(args.data_seed)
    data = {}
    for N in args.sizes:
        train = make_data(truth, N, seed=10_000 + 2 * N + args.data_seed)
        test = make_data(truth, N, seed=10_001 + 2 * N + args.data_seed)
        data[N] = (train, test)
    return truth, data


def train_all(args, truth, data, levels):
    """Every configuration (N, level), ``args.jobs`` at a time; prints a line for each."""
    configs = [Config(N, eps) for N in args.sizes for eps in levels]
    print(f"Hierarchical logistic regression (L={L}, K={K}, D={D}), DP-VI with d3p")
    print(f"  {args.num_steps} steps per run, {common.batch_size_words(args.sampling)} {args.batch_size}, "
          f"C={args.clipping_threshold}, Adam({args.learning_rate}), {args.seeds} seeds, δ=1/N, "
          f"{common.describe_sampling(args.sampling)}")
    print(f"  training {len(configs)} configurations ({args.jobs} in parallel) ...", flush=True)

    def report(r):
        return (f"  N={r['N']:5d} {label(r['epsilon']):>12s}: σ={r['sigma']:.3g}, ε spent={r['epsilon_spent']:.3g}, "
                f"AUC {np.mean(r['aucs']):.3f} ± {np.std(r['aucs']):.3f} ({r['seconds']:.0f} s)")

    return common.run_in_parallel(lambda cfg: run_config(cfg, data[cfg.N], truth, args), configs, args.jobs, report)


def write_results(args, results) -> str:
    """Every run as a row of ``hlr_results.csv``."""
    header = ["N", "level", "epsilon_target", "epsilon_spent", "delta", "sampler", "relation", "sigma",
              "C", "num_steps", "batch_size", "seed", "auc"]
    rows = ([r["N"], label(r["epsilon"]), r["epsilon"], r["epsilon_spent"], 1.0 / r["N"], r["sampler"],
             r["relation"], r["sigma"], r["clip"], args.num_steps, args.batch_size, s, f"{auc:.5f}"]
            for r in results for s, auc in enumerate(r["aucs"]))
    return common.write_csv(os.path.join(args.output_dir, "hlr_results.csv"), header, rows)


def plot_by_epsilon(args, by, levels, baseline) -> str:
    """Box plots of the AUC at N=500 per level, the baseline as a red line (Figure 4)."""
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.boxplot([by[(500, e)]["aucs"] for e in levels], tick_labels=[label(e).replace("ε=", "") for e in levels])
    ax.axhline(baseline, color="red", label="non-hierarchical baseline (non-private)")
    ax.set_xlabel("ε")
    ax.set_ylabel("AUC")
    ax.set_title(f"AUC after training on N=500 ({args.num_steps} steps)")
    ax.legend(loc="lower right", fontsize=8)
    return common.save_figure(fig, args.output_dir, "hlr_auc_by_epsilon.png")


def plot_by_n(args, by, levels, baselines) -> str:
    """Mean ± sd of the AUC against N per level (Figure 5)."""
    fig, ax = plt.subplots(figsize=(5, 4))
    sizes = sorted(args.sizes)
    for e in levels:
        m = np.array([np.mean(by[(n, e)]["aucs"]) for n in sizes])
        s = np.array([np.std(by[(n, e)]["aucs"]) for n in sizes])
        (line,) = ax.plot(sizes, m, marker="o", label=label(e))
        ax.fill_between(sizes, m - s, m + s, color=line.get_color(), alpha=0.2)
    ax.plot(sizes, [baselines[n] for n in sizes], "r--", label="baseline")
    ax.set_xlabel("N")
    ax.set_ylabel("AUC")
    ax.set_title("AUC after training per data set size")
    ax.legend(fontsize=8)
    return common.save_figure(fig, args.output_dir, "hlr_auc_by_n.png")


def print_table(args, by, levels, baselines, oracles) -> None:
    print()
    print("AUC on the held-out set (mean ± sd over seeds; median in brackets):")
    header = "  N     " + "".join(f"{label(e):>22s}" for e in levels) + f"{'baseline':>10s}{'oracle':>8s}"
    print(header)
    for n in sorted(args.sizes):
        row = f"  {n:<6d}"
        for e in levels:
            a = by[(n, e)]["aucs"]
            row += f"{np.mean(a):>9.3f} ± {np.std(a):.3f} [{np.median(a):.3f}]"
        row += f"{baselines[n]:>10.3f}{oracles[n]:>8.3f}"
        print(row)
    print()


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    truth, data = make_datasets(args)
    baselines = {N: baseline_auc(*data[N]) for N in args.sizes}
    oracles = {N: oracle_auc(truth, data[N][1]) for N in args.sizes}
    levels = list(args.epsilons) + [NON_PRIVATE]
    results, total = train_all(args, truth, data, levels)
    csv_path = write_results(args, results)
    by = {(r["N"], r["epsilon"]): r for r in results}
    box_path = plot_by_epsilon(args, by, levels, baselines[500])
    n_path = plot_by_n(args, by, levels, baselines)
    print_table(args, by, levels, baselines, oracles)
    print(f"Total training time {total:.0f} s.")
    common.print_written(box_path, n_path, csv_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
