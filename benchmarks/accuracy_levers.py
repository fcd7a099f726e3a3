"""Where the private posterior's error comes from at ε = 1 with the settings
d3p chooses, and what other choices of step size, schedule and clipping do
(issue "Accurate private posteriors by default").

For one problem of ``accuracy_defaults.py`` (``readme``, ``logreg20k``,
``hlogreg``, ``gmm``) the script fits the non-private reference (as there)
and then each named variant of ``DPSVI(model, guide, loss=Trace_ELBO(),
N=N).run(key, None, *data, epsilon=ε)`` over ``--seeds`` seeds. A variant
is a comma-separated list of ``key=value`` (``default``: nothing changed):

- ``lr=η``: Adam at the constant step size η (``avg``: the share of the last
  steps averaged, default 0.5);
- ``sched=f``: Adam at d3p's chosen step size η₀ decayed along a cosine to
  ``f η₀`` over the run (2,000 steps, or ``steps=T``), or over its last
  ``1 − h`` share with ``hold=h`` (``avg`` as above);
- ``C=c``: a fixed clipping threshold; ``quant=γ``: adaptive clipping to the
  γ quantile (from C = 1, the learning rate d3p sets);
- ``steps=T``: ``T`` steps instead of the chosen number (σ calibrated for them).

Each line: the error in reference sds (mean over coordinates of
``|μ − μ_ref| / sd_ref``), the sd ratio (geometric mean), the held-out log
predictive density, and for the regressions the slope and correlation of
``μ − μ_ref`` against ``μ_ref`` (a slope above 0: the coefficients too large
by that share, a bias, not noise), the final C, σ and q. ``--floor`` prints
instead, for the logistic regressions, the error the Gaussian noise of one
release of the whole clipped gradient sum at (ε, δ) would leave in a fit
that follows that sum to its root (a Laplace approximation at the reference
posterior, no clipping bias counted; σ of the release from dp-accounting's
PLD accountant), beside the error of the prior's mean μ = 0. It is no lower
bound for a run that stays near its start or the prior: on a metric in
reference sds such a fit can be nearer than one that follows the noise.

Usage::

    python benchmarks/accuracy_levers.py logreg20k default sched=0.02,avg=0.25 lr=0.1
    python benchmarks/accuracy_levers.py --floor readme logreg20k
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
from numpyro.infer import Trace_ELBO

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import accuracy_defaults as ad  # noqa: E402

import d3p.random  # noqa: E402
from d3p import _run_plan  # noqa: E402
from d3p.svi import AdaptiveClipping, DPSVI  # noqa: E402


def _cosine(step_size, num_steps, final, hold=0.0):
    """The step size held for the first ``hold`` share of the steps, then
    decayed along a cosine to ``final`` times itself at the last step."""
    def schedule(i):
        t = jnp.clip((i - hold * num_steps) / ((1 - hold) * num_steps), 0, 1)
        return step_size * (final + (1 - final) * 0.5 * (1 + jnp.cos(jnp.pi * t)))
    return schedule


def _chosen_step_size(p):
    probe = DPSVI(p.model, p.guide, loss=Trace_ELBO(), N=p.N, clipping_threshold=1.0, dp_scale=1.0, **p.shared)
    state = probe.init(d3p.random.PRNGKey(0), *(x[:8] for x in p.train))
    return probe._chosen_step_size.fit(probe.get_params(state))


def variant(p, name):
    """``(DPSVI, run keywords)`` of the variant ``name`` (the module's docstring)."""
    parts = dict(item.split("=") for item in name.split(",") if "=" in item)
    unknown = set(parts) - {"lr", "sched", "hold", "avg", "C", "quant", "steps"}
    if unknown:
        raise ValueError(f"unknown variant keys {sorted(unknown)} in {name!r}")
    optim, kw = None, {}
    if "sched" in parts:
        optim = numpyro.optim.Adam(_cosine(_chosen_step_size(p), int(parts.get("steps", _run_plan.CHOSEN_NUM_STEPS)),
                                           float(parts["sched"]),
                                           float(parts.get("hold", 0.0))))
    elif "lr" in parts:
        optim = numpyro.optim.Adam(float(parts["lr"]))
    if optim is not None:
        kw["average"] = float(parts.get("avg", _run_plan.CHOSEN_AVERAGE))
    clipping = AdaptiveClipping(target_quantile=float(parts["quant"]), learning_rate=None) if "quant" in parts \
        else None
    C = float(parts["C"]) if "C" in parts else None
    if "steps" in parts:
        kw["num_steps"] = int(parts["steps"])
    return DPSVI(p.model, p.guide, optim, loss=Trace_ELBO(), N=p.N, clipping_threshold=C,
                 adaptive_clipping=clipping, **p.shared), kw


def _bias(p, params, ref):
    """Slope and correlation of ``μ − μ_ref`` on ``μ_ref`` (regressions only)."""
    if not hasattr(p, "posterior") or isinstance(p, (ad.fa.GMM, ad.fa.VAE)):
        return float("nan"), float("nan")
    (m, _), (m0, _) = p.posterior(params, None), p.posterior(ref, None)
    return float(np.polyfit(m0, m - m0, 1)[0]), float(np.corrcoef(m - m0, m0)[0, 1])


def run_variants(args):
    p = ad.problems()[args.problem]
    ref = ad.reference(p, args.reference_steps)
    print(f"{args.problem}: reference held-out {p.predictive(ref, jax.random.PRNGKey(100)):.4f}; ε = {args.epsilon:g}, "
          f"δ = 1/N², {args.seeds} seeds", flush=True)
    print("| variant | error (ref. sds) | sd ratio | held-out | per seed | slope, corr of μ − μ_ref on μ_ref | "
          "final C | σ | q |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.variants:
        svi, kw = variant(p, name)
        num_steps = kw.pop("num_steps", None)
        got, Cs, bias = [], [], []
        for seed in range(args.seeds):
            r = svi.run(d3p.random.PRNGKey(seed), num_steps, *p.train, epsilon=args.epsilon, delta=1.0 / p.N**2,
                        progress_bar=False, **kw)
            got.append(ad.figures(p, r.params, ref, jax.random.PRNGKey(100 + seed)))
            Cs.append(float("nan") if r.state.clipping_threshold is None else float(r.state.clipping_threshold))
            bias.append(_bias(p, r.params, ref))
        o = ad._over_seeds(got)
        C_text = f"{np.mean(Cs):.3g}" if np.isfinite(Cs).all() else "given"
        per_seed = ", ".join(f"{g['error_sds']:.2f}" for g in got)
        slopes = "; ".join(f"{b[0]:.3f}, {b[1]:.2f}" for b in bias)
        print(f"| {name} | {o['error_sds']:.2f} | {o['sd_ratio']:.2f} | {o['predictive']:.4f} | "
              f"{per_seed} | {slopes} | {C_text} | {r.sigma:.3g} | {r.q:.3g} |",
              flush=True)


def _sigma_one_release(epsilon, delta):
    """σ of one Gaussian release at (ε, δ), by bisection on dp-accounting's PLD accountant."""
    from dp_accounting import dp_event
    from dp_accounting.pld import pld_privacy_accountant

    lo, hi = 0.05, 200.0
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        accountant = pld_privacy_accountant.PLDAccountant()
        accountant.compose(dp_event.GaussianDpEvent(mid))
        lo, hi = (mid, hi) if accountant.get_epsilon(delta) > epsilon else (lo, mid)
    return hi


def floors(args):
    print("| problem | N | σ of one release | per-record gradient norms at μ_ref (0.5 / 0.9 / 0.98) | "
          "error of μ = 0 | C | curvature kept | the release's noise (ref. sds) |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.variants:
        p = ad.problems()[name]
        ref = ad.reference(p, args.reference_steps)
        m, s = p.posterior(ref, None)
        X, y = (np.asarray(a, np.float64) for a in p.train)
        prob = 1 / (1 + np.exp(-(X @ m)))
        norms = np.abs(y - prob) * np.linalg.norm(X, axis=1)
        sigma = _sigma_one_release(args.epsilon, 1.0 / len(y) ** 2)
        q = np.quantile(norms, [0.5, 0.9, 0.98])
        for C in (0.03, 0.1, 0.3, 1.0, 3.0, 5.0):
            # the clipped sum's curvature at μ_ref: records above C count C / norm of theirs
            kept = np.mean(np.minimum(1, C / np.maximum(norms, 1e-30)) * prob * (1 - prob)) / np.mean(prob * (1 - prob))
            floor = np.sqrt(2 / np.pi) * sigma * C * np.mean(s / kept)
            print(f"| {name} | {len(y)} | {sigma:.2f} | {q[0]:.3g} / {q[1]:.3g} / {q[2]:.3g} | "
                  f"{np.mean(np.abs(m) / s):.2f} | {C:g} | {kept:.3f} | "
                  f"{floor:.2f} |", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("problem", help="readme, logreg20k, hlogreg or gmm (with --floor: the first problem)")
    parser.add_argument("variants", nargs="*", default=["default"])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--epsilon", type=float, default=1.0)
    parser.add_argument("--reference-steps", type=int, default=8000)
    parser.add_argument("--floor", action="store_true", help="the noise floors of the logistic regressions")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    if args.floor:
        args.variants = [args.problem] + args.variants
        return floors(args)
    return run_variants(args)


if __name__ == "__main__":
    main()
