"""Empirical privacy audit of d3p: a lower bound on ε next to the accountant's ε.

Runs d3p's private step many times on two neighbouring data sets (with and
without a canary record whose gradient is clipped), attacks every run, and
turns the attack's success into a lower bound on ε valid with confidence
1 - beta (d3p.audit). Three parts:

1. the real step (clipped_grad_sum + add_gaussian_noise; q = 1, T = 1, the
   Gaussian mechanism, where the accountant's ε is exact) for several σ;
2. several steps of DPSVI.update under Poisson sampling (d3p's default; the
   canary added or removed, add/remove relation) and with fixed-size batches
   without replacement (the canary substituted; substitute relation,
   accounted with the add/remove pair at σ/2, so σ = 4 there claims the same
   ε as σ = 2 with Poisson sampling); the attacker sees every step;
3. deliberately broken versions of the step (noise off, noise 10x too small,
   clipping disabled, noise divided by the realised batch size), made by
   swapping d3p's functions for broken ones for the duration of the audit.
   Their lower bound must land far above the claimed ε.

Prints a table (ε_lower and ε_accountant side by side) and writes two PNGs.

Run:  python examples/audit.py [--quick] [--output-dir DIR] [--seed 0]
"""

import contextlib
import math
import os
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import _common as common  # noqa: E402
import d3p.random  # noqa: E402
from d3p import _private_step, audit, gradients  # noqa: E402

def _without_noise(real_sum, real_noise):
    """The noise left out."""
    return real_sum, lambda grad_sum, key, dp_scale, C, rng_suite=d3p.random: grad_sum


def _with_small_noise(real_sum, real_noise):
    """Noise 10 times too small."""
    return real_sum, lambda grad_sum, key, dp_scale, C, rng_suite=d3p.random: real_noise(
        grad_sum, key, dp_scale / 10, C, rng_suite)


def _without_clipping(real_sum, real_noise):
    """Every record's gradient summed unclipped."""
    return (lambda loss_fn, params, records, mask, C, **kwargs: real_sum(
        loss_fn, params, records, mask, math.inf, **kwargs)), real_noise


def _noise_over_realised_count(real_sum, real_noise):
    """The noise std divided by the realised number of records (the sum not):
    the noise then depends on the data."""
    seen = {}

    def counting_sum(loss_fn, params, records, mask, C, **kwargs):
        seen["count"] = jnp.sum(jnp.asarray(mask))
        return real_sum(loss_fn, params, records, mask, C, **kwargs)

    def noise(grad_sum, key, dp_scale, C, rng_suite=d3p.random):
        unit = real_noise(jax.tree.map(jnp.zeros_like, grad_sum), key, 1.0, 1.0, rng_suite)
        std = dp_scale * C / jnp.maximum(seen["count"], 1)
        return jax.tree.map(lambda g, z: g + z * std.astype(z.dtype), grad_sum, unit)

    return counting_sum, noise


# each broken variant: (real clipped sum, real noise) -> (clipped sum, noise) to use instead
BROKEN = {
    "no_noise": _without_noise,
    "small_noise": _with_small_noise,
    "no_clipping": _without_clipping,
    "realised_count": _noise_over_realised_count,
}


@contextlib.contextmanager
def broken_package(kind: str):
    """Temporarily replace d3p's clipped sum / noise (where d3p looks them up) by a broken one."""
    if kind not in BROKEN:
        raise ValueError(f"Expected kind in {tuple(BROKEN)}, got kind={kind!r}.")
    new_sum, new_noise = BROKEN[kind](gradients.clipped_grad_sum, gradients.add_gaussian_noise)
    names = ("clipped_grad_sum", "add_gaussian_noise")
    saved = [(m, name, getattr(m, name)) for m in (gradients, _private_step) for name in names]
    try:
        for m in (gradients, _private_step):   # the step looks them up in d3p._private_step
            m.clipped_grad_sum, m.add_gaussian_noise = new_sum, new_noise
        yield
    finally:
        for m, name, value in saved:
            setattr(m, name, value)


def roc_curve(s_in, s_out, num=400):
    ts = np.quantile(np.concatenate([s_in, s_out]), np.linspace(0, 1, num))
    tpr = np.array([np.mean(s_in >= t) for t in ts])
    fpr = np.array([np.mean(s_out >= t) for t in ts])
    return fpr, tpr


def parse_args(argv=None):
    parser = common.parser(__doc__)
    parser.add_argument("--runs", type=int, default=None, help="runs per data set (default 200000; quick: 20000)")
    parser.add_argument("--delta", type=float, default=1e-5, help="δ (default 1e-5)")
    parser.add_argument("--beta", type=float, default=0.05, help="error probability (default 0.05)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default=common.OUTPUT_DIR, help=common.OUTPUT_HELP)
    parser.add_argument("--quick", action="store_true", help="fewer runs and settings (for CI)")
    return parser.parse_args(argv)


def run_audits(args):
    """The three parts of the audit; returns the rows ``(mechanism, variant, result)``
    and the results of the correct Gaussian step by σ."""
    runs = args.runs or (20_000 if args.quick else 200_000)
    sigmas = [1.0, 4.0] if args.quick else [0.5, 1.0, 2.0, 4.0]
    keys = d3p.random.split(d3p.random.PRNGKey(args.seed), 16)
    common_kwargs = dict(delta=args.delta, beta=args.beta, progress_bar=True)
    rows = []

    # 1. the Gaussian step, correct
    step_results = {}
    for i, sigma in enumerate(sigmas):
        step_results[sigma] = audit.audit_gaussian_step(keys[i], runs, dp_scale=sigma, **common_kwargs)
        rows.append((f"step, σ={sigma}", "correct", step_results[sigma]))

    # 2. DPSVI, several Poisson-subsampled steps (add/remove), then fixed-size batches (substitute)
    dpsvi_runs = max(runs // 4, 2000)
    res = audit.audit_dpsvi(keys[8], dpsvi_runs, dp_scale=2.0, q=0.5, num_steps=4, **common_kwargs)
    rows.append(("DPSVI σ=2 q=0.5 T=4", "correct", res))
    res = audit.audit_dpsvi(keys[9], dpsvi_runs, dp_scale=4.0, q=0.5, num_steps=4, sampling="fixed",
                            **common_kwargs)
    rows.append(("DPSVI fixed σ=4 q=.5 T=4", "correct", res))

    # 3. broken steps, σ = 4 (claimed ε about 0.9 at δ = 1e-5)
    broken_runs = min(runs, 20_000)
    for j, kind in enumerate(BROKEN):
        with broken_package(kind):
            res = audit.audit_gaussian_step(keys[10 + j], broken_runs, dp_scale=4.0, **common_kwargs)
        rows.append(("step, σ=4", kind, res))
    return rows, step_results


def print_table(args, rows, seconds: float) -> None:
    print()
    print(f"Empirical privacy audit (δ={args.delta:g}, confidence {1 - args.beta:g}); {seconds:.0f} s")
    print(f"{'mechanism':<24} {'variant':<16} {'runs':>8} {'AUC':>7} {'ε_lower':>9} {'ε_accountant':>13}  verdict")
    for name, variant, r in rows:
        verdict = "VIOLATION" if r.violation else "ok"
        print(
            f"{name:<24} {variant:<16} {len(r.scores_in):>8} {r.auc:7.4f} {r.epsilon_lower:9.3f} "
            f"{r.epsilon_accountant:13.3f}  {verdict}"
        )


def plot_epsilons(args, rows) -> str:
    """The lower bound next to the claim, for every row."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = [f"{n}\n{v}" for n, v, _ in rows]
    pos = np.arange(len(rows))
    ax.bar(pos - 0.2, [r.epsilon_accountant for _, _, r in rows], 0.4, label="ε claimed by the accountant")
    ax.bar(pos + 0.2, [r.epsilon_lower for _, _, r in rows], 0.4, label=f"ε lower bound ({1 - args.beta:g} conf.)")
    ax.set_xticks(pos, labels, fontsize=7, rotation=30, ha="right")
    ax.set_ylabel(f"ε at δ={args.delta:g}")
    ax.set_title("d3p privacy audit: a lower bound above the claim means a bug")
    ax.legend()
    return common.save_figure(fig, args.output_dir, "audit_epsilons.png")


def plot_step_scores(args, r) -> str:
    """Scores and ROC of the correct step at σ = 1."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    bins = np.linspace(-5, 6, 120)
    a1.hist(r.scores_out, bins, alpha=0.6, density=True, label="without canary (D')")
    a1.hist(r.scores_in, bins, alpha=0.6, density=True, label="with canary (D)")
    a1.axvline(r.bound.threshold, color="k", ls="--", label="threshold (calibration runs)")
    a1.set_xlabel("score: noisy sum projected on the canary gradient / C")
    a1.legend(fontsize=8)
    fpr, tpr = roc_curve(r.scores_in, r.scores_out)
    a2.loglog(np.maximum(fpr, 1e-6), np.maximum(tpr, 1e-6), label=f"attack (AUC {r.auc:.3f})")
    xs = np.logspace(-6, 0, 200)
    eps, d = r.epsilon_accountant, r.delta
    a2.loglog(xs, np.minimum.reduce([np.ones_like(xs), np.exp(eps) * xs + d, 1 - np.exp(-eps) * (1 - d - xs)]),
              "k--", label=f"(ε={eps:.2f}, δ) boundary")
    a2.set_xlabel("false positive rate")
    a2.set_ylabel("true positive rate")
    a2.set_xlim(1e-5, 1)
    a2.set_ylim(1e-4, 1.05)
    a2.legend(fontsize=8)
    fig.suptitle("one private gradient step, σ = 1, add/remove")
    return common.save_figure(fig, args.output_dir, "audit_step_scores.png")


def main(argv=None):
    args = parse_args(argv)
    t0 = time.time()
    rows, step_results = run_audits(args)
    print_table(args, rows, time.time() - t0)
    os.makedirs(args.output_dir, exist_ok=True)
    common.print_written(plot_epsilons(args, rows), plot_step_scores(args, step_results[1.0]))


if __name__ == "__main__":
    main()
