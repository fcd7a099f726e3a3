# SPDX-License-Identifier: Apache-2.0
"""Benchmark of noise calibration (d3p.dputil) and agreement with dp-accounting.

For a grid of (ε, q, T) at δ = 1e-5 and each sampler's accounting
(Poisson/add-remove, Poisson/substitute, fixed-size/substitute), prints a
markdown table with:

* ``time``: median wall-clock seconds of one calibration (caches cleared
  before every run), and ``cpu`` its process time;
* ``x base``: that median as a multiple of the baseline measured in the same
  process: one call of the fourier-accountant package's ``get_epsilon_*`` at
  its default grid (nx=1e6, L=20) for the same (q, T) at the calibrated σ
  of the composed pair ("R" for the add/remove pair, "S" for the midpoint
  pair): the cost of one accountant evaluation at the package's default grid;
* ``sigma``, ``eps``: the calibrated σ and the ε it achieves (≤ target);
* ``evals``: accountant evaluations (FFT compositions) of the calibration;
* ``sigma_pld``: σ calibrated with dp-accounting's PLD accountant
  (``calibrate_sigma(..., accountant="pld")``), ``dsigma`` = σ/σ_pld − 1;
* ``eps_pld``: ε of our σ according to the PLD accountant.

Usage::

    python benchmarks/calibration.py            # full grid, with PLD
    python benchmarks/calibration.py --quick    # headline setting only
    python benchmarks/calibration.py --no-pld   # skip the (slow) PLD columns
    python benchmarks/calibration.py --combos fixed/substitute   # one accounting
"""

import argparse
import os
import signal
import statistics
import sys
import time
import warnings

import numpy as np

from d3p import accounting
from d3p.dputil import _calibrate_cached, calibrate_sigma

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# benchmarks/accounting.py: the table of accountings and the caches an accounting question fills
import accounting as accounting_benchmark  # noqa: E402

DELTA = 1e-5
HEADLINE = (1.0, 0.01, 2000)
BASELINE_TIMEOUT = 60
GRID = [(eps, q, T) for eps in (0.5, 1.0, 4.0) for q in (0.001, 0.01, 0.1) for T in (1000, 10000)]
#: label -> (sampler, relation)
CALIBRATORS = accounting_benchmark.COMBOS


def _clear_caches():
    # every timing starts cold
    accounting_benchmark.clear_caches()
    _calibrate_cached.cache_clear()


def _baseline(label, sigma, q, steps):
    import fourier_accountant as fa

    acc = accounting.accounting_for(*CALIBRATORS[label])
    fn = fa.get_epsilon_S if acc.pair == "substitute" else fa.get_epsilon_R
    t0 = time.perf_counter()
    # the package's own search can run without end at some settings: give up
    # after BASELINE_TIMEOUT seconds (the row then shows "x base" as a bound)
    signal.signal(signal.SIGALRM, _timeout)
    signal.alarm(BASELINE_TIMEOUT)
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            fn(DELTA, sigma / acc.noise_divisor, q, steps)
    except (ValueError, _BaselineTimeout):
        pass
    finally:
        signal.alarm(0)
    return time.perf_counter() - t0


class _BaselineTimeout(Exception):
    pass


def _timeout(signum, frame):
    raise _BaselineTimeout()


def run_one(relation, eps, q, steps, repeats, pld):
    sampler, rel = CALIBRATORS[relation]

    def fn(*args, **kwargs):
        return calibrate_sigma(*args, sampler=sampler, relation=rel, **kwargs)
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
        row["eps_pld"] = accounting.compute_epsilon(sigma, q, steps, DELTA, sampler=sampler, relation=rel,
                                                    accountant="pld")
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
    ap.add_argument("--combos", nargs="+", choices=list(CALIBRATORS), default=list(CALIBRATORS),
                    help="sampler/relation combinations (default: all)")
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
    for relation in args.combos:
        for eps, q, steps in grid:
            reps = max(args.repeats, 5) if (eps, q, steps) == HEADLINE else args.repeats
            row = run_one(relation, eps, q, steps, reps, pld)
            rows.append(row)
            print(_fmt(row, pld), flush=True)
    print()
    for relation in args.combos:
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
