"""The sweep behind the step size, number of steps and formulation that d3p chooses.

For each problem of ``accuracy_defaults.py`` (non-private reference as
there), DPSVI with every setting but the swept ones left to d3p (no batch
size, C by adaptive clipping to the 0.98 quantile) is fitted at ε = 1 and
ε = 8 (δ = 1/N²) with Adam at each step size and number of steps of the
grid, the parameters averaged over the last half of the steps, under the
formulations ``own_sample`` and ``aligned``; and, as the baseline, the
earlier recipe's Adam(0.01) for 2,000 steps without averaging. Prints one
row per setting (means over ``--seeds`` seeds: error in reference sds, sd
ratio, held-out log predictive density, the final C) and appends the rows
as JSON lines to ``--output``.

Usage::

    python benchmarks/chosen_settings_sweep.py --problems readme logreg20k hlogreg gmm --seeds 2
"""

import argparse
import json
import os
import sys
import time
import warnings

import jax
import numpy as np
import numpyro
from numpyro.infer import Trace_ELBO

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import accuracy_defaults as ad  # noqa: E402

import d3p.random  # noqa: E402
from d3p.svi import DPSVI  # noqa: E402

#: ``(formulation, Adam's step size, number of steps, share averaged)``.
GRID = [("own_sample", 0.01, 2000, 0.0), ("own_sample", 0.05, 2000, 0.5), ("aligned", 0.05, 2000, 0.5),
        ("own_sample", 0.02, 2000, 0.5), ("own_sample", 0.1, 2000, 0.5), ("own_sample", 0.05, 1000, 0.5),
        ("own_sample", 0.05, 4000, 0.5), ("aligned", 0.02, 2000, 0.5), ("aligned", 0.1, 2000, 0.5),
        ("aligned", 0.05, 4000, 0.5), ("aligned", 0.05, 1000, 0.5)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--problems", nargs="+", default=["readme", "logreg20k", "hlogreg", "gmm"])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--output", default=os.path.join("benchmarks", "output", "chosen_settings_sweep.jsonl"))
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
    problems = ad.problems()
    with open(args.output, "a") as out:
        for name in args.problems:
            p = problems[name]
            ref = ad.reference(p, 8000)
            ref_pred = p.predictive(ref, jax.random.PRNGKey(100))
            cache = {}
            for form, lr, steps, average in GRID:
                svi = cache.setdefault((form, lr), DPSVI(p.model, p.guide, numpyro.optim.Adam(lr), Trace_ELBO(),
                                                         N=p.N, formulation=form, **p.shared))
                for epsilon in (1.0, 8.0):
                    got, final_C, t0 = [], [], time.perf_counter()
                    for seed in range(args.seeds):
                        r = svi.run(d3p.random.PRNGKey(seed), steps, *p.train, epsilon=epsilon, delta=1 / p.N**2,
                                    progress_bar=False, average=average)
                        got.append(ad.figures(p, r.params, ref, jax.random.PRNGKey(100 + seed)))
                        final_C.append(float(r.state.clipping_threshold))
                    row = dict(problem=name, formulation=form, lr=lr, steps=steps, average=average, epsilon=epsilon,
                               reference_predictive=ref_pred, **ad._over_seeds(got), per_seed=got,
                               final_C=final_C, seconds=time.perf_counter() - t0)
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    print(f"| {name} | {form} | {lr:g} | {steps} | {average:g} | {epsilon:g} | "
                          f"{row['error_sds']:.2f} | {row['sd_ratio']:.2f} | {row['predictive']:.4f} "
                          f"({ref_pred:.4f}) | {np.mean(final_C):.3g} |", flush=True)


if __name__ == "__main__":
    main()
