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

import argparse
import csv
import os
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, NamedTuple, Optional, Sequence, Tuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import numpyro  # noqa: E402
import numpyro.distributions as dist  # noqa: E402
from numpyro.infer import Trace_ELBO  # noqa: E402
from sklearn.linear_model import LogisticRegression  # noqa: E402
from sklearn.metrics import roc_auc_score  # noqa: E402

import d3p.random  # noqa: E402
from d3p.accounting import accounting_for  # noqa: E402
from d3p.dputil import calibrate_sigma  # noqa: E402
from d3p.svi import DPSVI  # noqa: E402

DEFAULT_OUTPUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "output")
NON_PRIVATE = float("inf")  # the "ε" of the non-private runs

D, K, L = 5, 3, 3  # record dimension, group characteristics, groups
_TRACE_LOCK = threading.Lock()


# --------------------------------------------------------------------- model


def model(xs, ys, ls, gs, N):
    """The hierarchical logistic regression model (paper, listing 4).

    :param xs: records, ``(B, D)`` (per-record, private).
    :param ys: binary labels, ``(B,)`` (per-record, private).
    :param ls: group index of every record, ``(B,)`` ints (per-record, private).
    :param gs: group characteristics, ``(L, K)`` (shared, public).
    :param int N: number of records in the training set (shared, public).
    """
    batch_size, d = xs.shape
    num_groups, k = gs.shape
    M = numpyro.sample("M", dist.Normal(0.0, 4.0), sample_shape=(d, k))
    with numpyro.plate("group", num_groups, num_groups):
        etas = gs @ M.T
        ws = numpyro.sample("ws", dist.Normal(etas, 1.0).to_event(1))
    with numpyro.plate("batch", N, batch_size):
        thetas = jax.nn.sigmoid(jnp.einsum("nd,nd->n", xs, ws[ls]))
        numpyro.sample("ys", dist.Bernoulli(thetas), obs=ys)


def guide(xs, ys, ls, gs, N):
    """Diagonal Gaussian variational posterior over ``M`` (paper, listing 4)."""
    d = xs.shape[1]
    k = gs.shape[1]
    M_loc = numpyro.param("M_loc", jnp.zeros((d, k)))
    M_scale = jnp.exp(numpyro.param("M_scale_log", jnp.zeros((d, k))))
    numpyro.sample("M", dist.Normal(M_loc, M_scale))


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


# ---------------------------------------------------------------- experiment


class Config(NamedTuple):
    N: int
    epsilon: float  # NON_PRIVATE for non-private VI


def sampler_name(sampling: str) -> str:
    """The accounting's name of a ``DPSVI.run`` sampling option."""
    return "poisson" if sampling == "poisson" else "fixed_size"


def run_config(cfg: Config, data, truth: Truth, args) -> Dict:
    """Train ``args.seeds`` runs for one (N, ε) at once and return their AUCs."""
    train, test = data
    N = cfg.N
    B = args.batch_size
    delta = 1.0 / N
    if cfg.epsilon == NON_PRIVATE:
        sigma, C = 0.0, float("inf")
    else:
        # σ for the sampler DPSVI.run uses below (Poisson: add/remove; fixed: substitute)
        sigma, _, _ = calibrate_sigma(cfg.epsilon, delta, B / N, args.num_steps,
                                      sampler=sampler_name(args.sampling))
        C = args.clipping_threshold
    gs = jnp.asarray(truth.gs)
    svi = DPSVI(
        model,
        guide,
        numpyro.optim.Adam(args.learning_rate),
        Trace_ELBO(),
        clipping_threshold=C,
        dp_scale=sigma,
        gs=gs,  # shared, public: a constructor keyword, not per-record data
        N=N,
    )
    keys = jnp.stack(
        [d3p.random.PRNGKey(1000 * args.seed_offset + s) for s in range(args.seeds)]
    )
    xs, ys, ls = (jnp.asarray(a) for a in train)
    eps_spent = []
    accounted = []

    def one_run(key):
        result = svi.run(key, args.num_steps, xs, ys, ls, batch_size=B, sampling=args.sampling,
                         target_delta=delta, progress_bar=False)
        eps_spent.append(result.epsilon)  # computed on the host, once
        accounted.append((result.sampler, result.relation))
        return result.params

    start = time.perf_counter()
    # NumPyro's effect handlers live on one global stack, so tracing must not
    # run in two threads at once; compiling and running can.
    with _TRACE_LOCK, warnings.catch_warnings():
        # the model's group weights `ws` have no guide site on purpose (listing 4)
        warnings.filterwarnings("ignore", message="Found vars in model but not guide")
        lowered = jax.jit(jax.vmap(one_run)).lower(keys)
    params = jax.block_until_ready(lowered.compile()(keys))
    seconds = time.perf_counter() - start
    eval_keys = jax.random.split(jax.random.PRNGKey(12345), args.seeds)
    aucs = []
    for s in range(args.seeds):
        p = jax.tree.map(lambda a: a[s], params)
        probs = predictive_probabilities(p, jnp.asarray(test[0]), jnp.asarray(test[2]), gs, eval_keys[s])
        aucs.append(float(roc_auc_score(test[1], np.asarray(probs))))
    sampler, relation = accounted[0]
    return dict(N=N, epsilon=cfg.epsilon, sigma=sigma, clip=C,
                epsilon_spent=eps_spent[0] if eps_spent else float("nan"),
                sampler=sampler, relation=relation, aucs=aucs, seconds=seconds)


def label(eps: float) -> str:
    return "non-private" if eps == NON_PRIVATE else f"ε={eps:g}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="tiny CI run: 2 000 steps, 3 seeds, ε=4 and non-private, N in {200, 500}")
    parser.add_argument("--output-dir", default=DEFAULT_OUTPUT_DIR,
                        help="where the PNGs and CSV go (default: examples/output/)")
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
    parser.add_argument("--sampling", choices=("poisson", "fixed"), default="poisson",
                        help="poisson (default; add/remove relation) or fixed-size batches without "
                             "replacement (substitute relation)")
    parser.add_argument("--clipping-threshold", type=float, default=2.0, help="C (default 2)")
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="Adam step size (default 1e-3)")
    parser.add_argument("--jobs", type=int, default=2, help="configurations trained in parallel (default 2)")
    parser.add_argument("--data-seed", type=int, default=0, help="seed of the synthetic ground truth")
    parser.add_argument("--seed-offset", type=int, default=0, help="offset of the training seeds")
    args = parser.parse_args(argv)

    if args.quick:
        defaults = dict(num_steps=2000, seeds=3, epsilons=[4.0], sizes=[200, 500])
    else:
        defaults = dict(num_steps=100_000, seeds=10, epsilons=[2.0, 4.0, 8.0], sizes=[100, 200, 500, 1000])
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if 500 not in args.sizes:
        parser.error("--sizes must include 500 (the N of the box plot)")
    if args.batch_size > min(args.sizes):
        parser.error(f"--batch-size={args.batch_size} is larger than the smallest N={min(args.sizes)}")
    os.makedirs(args.output_dir, exist_ok=True)

    truth = make_truth(args.data_seed)
    data = {}
    for N in args.sizes:
        train = make_data(truth, N, seed=10_000 + 2 * N + args.data_seed)
        test = make_data(truth, N, seed=10_001 + 2 * N + args.data_seed)
        data[N] = (train, test)
    baselines = {N: baseline_auc(*data[N]) for N in args.sizes}
    oracles = {N: oracle_auc(truth, data[N][1]) for N in args.sizes}

    levels = list(args.epsilons) + [NON_PRIVATE]
    configs = [Config(N, eps) for N in args.sizes for eps in levels]
    print(f"Hierarchical logistic regression (L={L}, K={K}, D={D}), DP-VI with d3p")
    how = accounting_for(sampler_name(args.sampling)).describe()
    size = "expected batch size" if args.sampling == "poisson" else "batch size"
    print(f"  {args.num_steps} steps per run, {size} {args.batch_size}, C={args.clipping_threshold}, "
          f"Adam({args.learning_rate}), {args.seeds} seeds, δ=1/N, {how}")
    print(f"  training {len(configs)} configurations ({args.jobs} in parallel) ...", flush=True)
    start = time.perf_counter()
    results = []
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = [pool.submit(run_config, cfg, data[cfg.N], truth, args) for cfg in configs]
        for fut in futures:
            r = fut.result()
            results.append(r)
            print(f"  N={r['N']:5d} {label(r['epsilon']):>12s}: σ={r['sigma']:.3g}, ε spent={r['epsilon_spent']:.3g}, "
                  f"AUC {np.mean(r['aucs']):.3f} ± {np.std(r['aucs']):.3f} ({r['seconds']:.0f} s)", flush=True)
    total = time.perf_counter() - start

    # ------------------------------------------------------------ outputs
    csv_path = os.path.join(args.output_dir, "hlr_results.csv")
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["N", "level", "epsilon_target", "epsilon_spent", "delta", "sampler", "relation", "sigma",
                    "C", "num_steps", "batch_size", "seed", "auc"])
        for r in results:
            for s, auc in enumerate(r["aucs"]):
                w.writerow([r["N"], label(r["epsilon"]), r["epsilon"], r["epsilon_spent"], 1.0 / r["N"],
                            r["sampler"], r["relation"], r["sigma"], r["clip"], args.num_steps,
                            args.batch_size, s, f"{auc:.5f}"])

    by = {(r["N"], r["epsilon"]): r for r in results}
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.boxplot([by[(500, e)]["aucs"] for e in levels], tick_labels=[label(e).replace("ε=", "") for e in levels])
    ax.axhline(baselines[500], color="red", label="non-hierarchical baseline (non-private)")
    ax.set_xlabel("ε")
    ax.set_ylabel("AUC")
    ax.set_title(f"AUC after training on N=500 ({args.num_steps} steps)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    box_path = os.path.join(args.output_dir, "hlr_auc_by_epsilon.png")
    fig.savefig(box_path, dpi=120)
    plt.close(fig)

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
    fig.tight_layout()
    n_path = os.path.join(args.output_dir, "hlr_auc_by_n.png")
    fig.savefig(n_path, dpi=120)
    plt.close(fig)

    print()
    print("AUC on the held-out set (mean ± sd over seeds; median in brackets):")
    header = "  N     " + "".join(f"{label(e):>22s}" for e in levels) + f"{'baseline':>10s}{'oracle':>8s}"
    print(header)
    for n in sizes:
        row = f"  {n:<6d}"
        for e in levels:
            a = by[(n, e)]["aucs"]
            row += f"{np.mean(a):>9.3f} ± {np.std(a):.3f} [{np.median(a):.3f}]"
        row += f"{baselines[n]:>10.3f}{oracles[n]:>8.3f}"
        print(row)
    print()
    print(f"Total training time {total:.0f} s.")
    print(f"Wrote {box_path}")
    print(f"Wrote {n_path}")
    print(f"Wrote {csv_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
