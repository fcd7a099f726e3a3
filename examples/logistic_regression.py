"""Private logistic regression on the breast-cancer data (the d3p paper's first example).

Fits the paper's model (weights with a Normal(0, 4) prior, a plate over the
records) and mean-field Gaussian guide with DPSVI on scikit-learn's bundled
Wisconsin breast-cancer data, calibrating the noise from (ε, δ), and compares
held-out accuracy with non-private NumPyro SVI. Prints σ, the ε spent and the
accuracies, and writes a PNG with the loss curves and posterior means.

Sampling and accounting (d3p's default): every step includes each training
record independently with probability q = B/N (Poisson sampling, expected
batch size B, padded to a fixed shape with a mask), and ε is stated under the
add/remove relation; σ comes from
:func:`d3p.dputil.approximate_sigma_remove_relation`. ``--sampling fixed``
draws batches of exactly B distinct records instead; they are accounted under
the substitute relation (with the pair that dominates fixed-size sampling,
see :func:`d3p.accounting.accounting_for`), σ comes from
:func:`d3p.dputil.approximate_sigma` and is about twice as large.

Run:  python examples/logistic_regression.py [--epsilon 1] [--sampling poisson|fixed] [--quick]

Privacy notes: the features are standardised with the mean and standard
deviation of the training split and the labels are the data's own; that
pre-processing reads the private data and is NOT covered by the reported ε
(in a real analysis use public scales or spend budget on them). The train/test
split and the held-out accuracy are evaluation aids, not part of the release.
"""

import os
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import numpyro  # noqa: E402
from numpyro.infer import SVI, Trace_ELBO  # noqa: E402

import _common as common  # noqa: E402
import d3p.random  # noqa: E402
from d3p._paper_models import logistic_regression_guide as guide  # noqa: E402
from d3p._paper_models import logistic_regression_model as model  # noqa: E402
from d3p.accounting import accounting_for  # noqa: E402
from d3p.dputil import approximate_sigma, approximate_sigma_remove_relation  # noqa: E402
from d3p.svi import DPSVI  # noqa: E402


def load_data(seed: int):
    from sklearn.datasets import load_breast_cancer

    X, y = load_breast_cancer(return_X_y=True)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(X))
    n_train = int(0.8 * len(X))
    train, test = order[:n_train], order[n_train:]
    mean, std = X[train].mean(0), X[train].std(0)
    X = (X - mean) / std
    X = np.concatenate([X, np.ones((len(X), 1))], axis=1)  # intercept column
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    return f32(X[train]), f32(y[train]), f32(X[test]), f32(y[test])


def accuracy(params, xs, ys):
    logits = xs @ params["w_loc"]
    return float(jnp.mean((logits > 0) == (ys > 0.5)))


def parse_args(argv=None):
    parser = common.parser(__doc__)
    parser.add_argument("--epsilon", type=float, default=1.0, help="target ε (default 1)")
    parser.add_argument("--delta", type=float, default=None, help="δ (default 1/N²)")
    parser.add_argument("--batch-size", type=int, default=32,
                        help="B: expected batch size (Poisson sampling, q = B/N) or batch size (fixed)")
    parser.add_argument("--sampling", choices=("poisson", "fixed"), default="poisson", help=common.SAMPLING_HELP)
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--clip", type=float, default=1.0, help="clipping threshold C")
    parser.add_argument("--learning-rate", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0, help="seed for the data split and the run")
    parser.add_argument("--output-dir", default=common.OUTPUT_DIR, help=common.OUTPUT_HELP)
    parser.add_argument("--quick", action="store_true", help="a short run (for CI)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps = min(args.steps, 400)
    if not args.epsilon > 0:
        parser.error(f"--epsilon must be > 0, got {args.epsilon}")
    return args


def calibrate(args, N, delta):
    """σ for the target ε under the accounting of the sampler the run uses."""
    q = args.batch_size / N
    approximate = approximate_sigma_remove_relation if args.sampling == "poisson" else approximate_sigma
    t0 = time.time()
    sigma, _, _ = approximate(args.epsilon, delta, q, args.steps)
    print(f"calibrated σ={sigma:.4f} for ε={args.epsilon}, δ={delta:.3g}, q={q:.4f}, "
          f"T={args.steps} ({common.describe_sampling(args.sampling)}, {time.time() - t0:.2f} s)")
    return sigma


def fit(args, xs, ys, sigma, delta):
    """The private fit (DPSVI.run) and the non-private one (SVI, full batch), with their seconds."""
    N = xs.shape[0]
    optimizer = numpyro.optim.Adam(args.learning_rate)
    dpsvi = DPSVI(model, guide, optimizer, Trace_ELBO(), clipping_threshold=args.clip, dp_scale=sigma, N=N)
    t0 = time.time()
    result = dpsvi.run(d3p.random.PRNGKey(args.seed), args.steps, xs, ys,
                       batch_size=args.batch_size, sampling=args.sampling, target_delta=delta)
    t_dp = time.time() - t0
    svi = SVI(model, guide, optimizer, Trace_ELBO(), N=N)
    t0 = time.time()
    ref = svi.run(jax.random.PRNGKey(args.seed), args.steps, xs, ys, progress_bar=False)
    return result, t_dp, ref, time.time() - t0


def plot(args, result, ref, accuracies):
    """Loss curves and posterior means ± 2 sd of both fits; returns the PNG's path."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    window = max(1, args.steps // 50)
    smooth = lambda l: np.convolve(np.asarray(l), np.ones(window) / window, mode="valid")  # noqa: E731
    ax1.plot(smooth(result.losses), label=f"DPSVI (ε={result.epsilon:.2f})")
    ax1.plot(smooth(ref.losses), label="SVI (non-private)")
    ax1.set_yscale("log")
    ax1.set_xlabel("step")
    ax1.set_ylabel(f"ELBO loss (moving average of {window})")
    ax1.set_title("Training loss (the DP loss is not private)")
    ax1.legend()
    idx = np.arange(len(result.params["w_loc"]))
    for offset, params, label in ((-0.2, result.params, "DPSVI"), (0.2, ref.params, "SVI")):
        loc = np.asarray(params["w_loc"])
        scale = np.exp(np.asarray(params["w_scale_log"]))
        ax2.errorbar(idx + offset, loc, yerr=2 * scale, fmt="o", ms=3, label=label)
    ax2.axhline(0, color="grey", lw=0.5)
    ax2.set_xlabel("coefficient")
    ax2.set_ylabel("posterior mean ± 2 sd")
    ax2.set_title("Held-out accuracy: DP {:.3f}, non-private {:.3f}".format(*accuracies))
    ax2.legend()
    os.makedirs(args.output_dir, exist_ok=True)
    return common.save_figure(fig, args.output_dir, "logistic_regression.png")


def main(argv=None):
    args = parse_args(argv)
    xs, ys, xs_test, ys_test = load_data(args.seed)
    N, d = xs.shape
    delta = args.delta if args.delta is not None else 1.0 / N**2
    print(f"breast-cancer data: N={N} training records, d={d} (incl. intercept), "
          f"{len(xs_test)} held out")
    sigma = calibrate(args, N, delta)
    result, t_dp, ref, t_svi = fit(args, xs, ys, sigma, delta)
    acc_dp = accuracy(result.params, xs_test, ys_test)
    acc_ref = accuracy(ref.params, xs_test, ys_test)
    majority = float(max(ys_test.mean(), 1 - ys_test.mean()))
    # result.sampler and result.relation say how DPSVI.run accounted the run
    print(f"DPSVI:  ε spent={result.epsilon:.3f} (δ={result.delta:.3g}, "
          f"{accounting_for(result.sampler, result.relation).describe()}), "
          f"held-out accuracy {acc_dp:.3f}, {t_dp:.1f} s")
    print(f"SVI (non-private, full batch): held-out accuracy {acc_ref:.3f}, {t_svi:.1f} s")
    print(f"majority-class baseline: {majority:.3f}")
    common.print_written(plot(args, result, ref, (acc_dp, acc_ref)))
    return {"sigma": sigma, "epsilon": result.epsilon, "sampler": result.sampler, "relation": result.relation,
            "accuracy_dp": acc_dp, "accuracy_svi": acc_ref}


if __name__ == "__main__":
    main()
