# SPDX-License-Identifier: Apache-2.0
"""Benchmark of noise calibration (d3p.dputil) and agreement with dp-accounting.

For a grid of (ε, q, T) at δ = 1e-5 and both relations, prints a markdown
table with:

* ``time``: median wall-clock seconds of one calibration (caches cleared
  before every run), and ``cpu`` its process time;
* ``x base``: that median as a multiple of the baseline measured in the same
  process: one call of the fourier-accountant package's ``get_epsilon_*`` at
  its default grid (nx=1e6, L=20) for the same (q, T) at the calibrated σ:
  the cost of a single evaluation of the old calibrator;
* ``sigma``, ``eps``: the calibrated σ and the ε it achieves (≤ target);
* ``evals``: accountant evaluations (FFT compositions) of the calibration;
* ``sigma_pld``: σ calibrated with dp-accounting's PLD accountant
  (``approximate_sigma*(..., accountant="pld")``), ``dsigma`` = σ/σ_pld − 1;
* ``eps_pld``: ε of our σ according to the PLD accountant.

Usage::

    python benchmarks/calibration.py            # full grid, with PLD
    python benchmarks/calibration.py --quick    # headline setting only
    python benchmarks/calibration.py --no-pld   # skip the (slow) PLD columns
"""

import argparse
import statistics
import time
import warnings

import numpy as np

from d3p import accounting
from d3p.dputil import approximate_sigma, approximate_sigma_remove_relation

DELTA = 1e-5
HEADLINE = (1.0, 0.01, 2000)
GRID = [(eps, q, T) for eps in (0.5, 1.0, 4.0) for q in (0.001, 0.01, 0.1) for T in (1000, 10000)]
CALIBRATORS = {
    "substitute": approximate_sigma,
    "add_remove": approximate_sigma_remove_relation,
}


def _clear_caches():
    accounting._phase_stats.cache_clear()


def _baseline(relation, sigma, q, steps):
    import fourier_accountant as fa

    fn = fa.get_epsilon_S if relation == "substitute" else fa.get_epsilon_R
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            fn(DELTA, sigma, q, steps)
    except ValueError:
        pass
    return time.perf_counter() - t0


def run_one(relation, eps, q, steps, repeats, pld):
    fn = CALIBRATORS[relation]
    walls, cpus = [], []
    for _ in range(repeats):
        _clear_caches()
        w0, c0 = time.perf_counter(), time.process_time()
        sigma, achieved, evals = fn(eps, DELTA, q, steps)
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    base = _baseline(relation, sigma, q, steps)
    row = dict(relation=relation, eps=eps, q=q, T=steps, time=statistics.median(walls),
               cpu=statistics.median(cpus), base=base, sigma=sigma, achieved=achieved, evals=evals)
    if pld:
        row["sigma_pld"] = fn(eps, DELTA, q, steps, accountant="pld")[0]
        row["eps_pld"] = accounting.compute_epsilon(sigma, q, steps, DELTA, relation=relation, accountant="pld")
    return row


def _fmt(row, pld):
    cells = [row["relation"], f"{row['eps']:g}", f"{row['q']:g}", f"{row['T']}",
             f"{row['time']:.3f}", f"{row['cpu']:.3f}", f"{row['time'] / row['base']:.2f}",
             f"{row['sigma']:.5f}", f"{row['achieved']:.5f}", f"{row['evals']}"]
    if pld:
        cells += [f"{row['sigma_pld']:.5f}", f"{row['sigma'] / row['sigma_pld'] - 1:+.2%}",
                  f"{row['eps_pld']:.5f}"]
    return "| " + " | ".join(cells) + " |"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="only the headline setting (1, 1e-5, 0.01, 2000)")
    ap.add_argument("--no-pld", action="store_true", help="skip the dp-accounting columns")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per setting (median)")
    args = ap.parse_args(argv)
    pld = not args.no_pld
    grid = [HEADLINE] if args.quick else [HEADLINE] + [g for g in GRID if g != HEADLINE]
    header = ["relation", "eps", "q", "T", "time [s]", "cpu [s]", "x base", "sigma", "eps achieved", "evals"]
    if pld:
        header += ["sigma_pld", "dsigma", "eps_pld(sigma)"]
    print(f"delta = {DELTA:g}; time = median of {args.repeats} runs; "
          f"x base = time / one default-grid fourier-accountant evaluation")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    rows = []
    for relation in CALIBRATORS:
        for eps, q, steps in grid:
            reps = max(args.repeats, 5) if (eps, q, steps) == HEADLINE else args.repeats
            row = run_one(relation, eps, q, steps, reps, pld)
            rows.append(row)
            print(_fmt(row, pld), flush=True)
    print()
    for relation in CALIBRATORS:
        rs = [r for r in rows if r["relation"] == relation]
        head = [r for r in rs if (r["eps"], r["q"], r["T"]) == HEADLINE][0]
        line = (f"{relation}: headline {head['time']:.3f} s; grid median {statistics.median(r['time'] for r in rs):.3f} s, "
                f"max {max(r['time'] for r in rs):.3f} s; max eps overshoot "
                f"{max(r['achieved'] - r['eps'] for r in rs):+.2e}")
        if pld:
            line += (f"; dsigma vs PLD in [{min(r['sigma'] / r['sigma_pld'] - 1 for r in rs):+.2%}, "
                     f"{max(r['sigma'] / r['sigma_pld'] - 1 for r in rs):+.2%}]; "
                     f"max eps_pld - target {max(r['eps_pld'] - r['eps'] for r in rs):+.2e}")
        print(line)


if __name__ == "__main__":
    main()
