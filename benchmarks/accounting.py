# SPDX-License-Identifier: Apache-2.0
"""Benchmark of the accounting of a run: its cost, first and repeated, and
its ε at small δ against dp-accounting.

Two tables (σ = 1, q = 1e-3, δ = 1e-12: ``DPSVI.run``'s default δ = 1/N² at
N = 1e6), for each sampler's accounting (Poisson/add-remove,
Poisson/substitute, fixed-size/substitute):

* **time**: seconds of the ε at the end of a run as ``DPSVI.run`` asks for
  it (a new ``EpsilonTracker`` per run, its ``epsilon(T)``): ``first`` with
  every cache cleared (a fresh process's first run), ``second`` a second
  run with the same plan (the process-wide cache), at T = 1e3, 1e4, 1e5;
  median of ``--repeats``; the first run's process time too (all threads),
  which a loaded machine inflates less than wall-clock time.
* **epsilon**: d3p's ε against dp-accounting's PLD accountant (called
  directly: pessimistic "connect the dots" and optimistic discretisation at
  ``--interval``) and its RDP accountant (d3p's own RDP bound, starred,
  for Poisson/substitute, which dp-accounting's RDP does not cover), at
  T = 500, 1000, 2000, 4000, with the ratio of d3p's ε to the pessimistic PLD
  value. At δ = 1e-12 and T ≥ 2000 dp-accounting's PLD values move by several
  per cent with its truncation settings (its FFT round-off): read them as
  approximate there.

Usage::

    python benchmarks/accounting.py                  # both tables, all samplers
    python benchmarks/accounting.py --quick          # Poisson/add-remove, fewer points
    python benchmarks/accounting.py --interval 2e-5  # a finer PLD reference (slower)
"""

import argparse
import logging
import statistics
import time

from d3p import accounting
from d3p._accounting._window import phase_stats

SIGMA, Q, DELTA = 1.0, 1e-3, 1e-12
#: label -> (sampler, relation)
COMBOS = {
    "poisson/add_remove": ("poisson", "add_remove"),
    "poisson/substitute": ("poisson", "substitute"),
    "fixed/substitute": ("fixed_size", "substitute"),
}


def clear_caches():
    """Every cache an accounting question fills."""
    accounting.clear_cache()
    phase_stats.cache_clear()


def run_epsilon(sampler, relation, steps):
    """The ε ``DPSVI.run`` reports at the end of a run of ``steps`` steps."""
    acc = accounting.accounting_for(sampler, relation)
    return acc.tracker(SIGMA, Q, DELTA, num_steps=steps).epsilon(steps)


def timing_table(combos, steps_list, repeats):
    print("| accounting | T | first run (s) | first run, CPU (s) | second run (s) | ε |\n|---|---|---|---|---|---|")
    for label in combos:
        sampler, relation = COMBOS[label]
        for steps in steps_list:
            first, cpu, second = [], [], []
            for _ in range(repeats):
                clear_caches()
                t0, c0 = time.perf_counter(), time.process_time()
                eps = run_epsilon(sampler, relation, steps)
                t1, c1 = time.perf_counter(), time.process_time()
                run_epsilon(sampler, relation, steps)
                t2 = time.perf_counter()
                first.append(t1 - t0)
                cpu.append(c1 - c0)
                second.append(t2 - t1)
            print(f"| {label} | {steps:g} | {statistics.median(first):.3f} | {statistics.median(cpu):.3f} "
                  f"| {statistics.median(second):.2e} | {eps:.4f} |")


def reference(label, steps, interval):
    """dp-accounting's (pessimistic PLD, optimistic PLD, RDP) ε at δ, called directly."""
    import dp_accounting
    from dp_accounting.pld import privacy_loss_distribution as pld

    sampler, relation = COMBOS[label]
    nr = dp_accounting.NeighboringRelation
    std = SIGMA / 2 if sampler == "fixed_size" else SIGMA
    rel = nr.REPLACE_ONE if (sampler, relation) == ("poisson", "substitute") else nr.ADD_OR_REMOVE_ONE
    out = []
    logging.disable(logging.WARNING)   # the optimistic estimate's notice
    try:
        for pessimistic in (True, False):
            one = pld.from_gaussian_mechanism(std, sampling_prob=Q, neighboring_relation=rel,
                                              value_discretization_interval=interval,
                                              pessimistic_estimate=pessimistic, use_connect_dots=pessimistic)
            out.append(one.self_compose(steps).get_epsilon_for_delta(DELTA))
    finally:
        logging.disable(logging.NOTSET)
    rdp = dp_accounting.rdp.RdpAccountant(neighboring_relation=rel)
    event = dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.GaussianDpEvent(std))
    if rdp.supports(dp_accounting.SelfComposedDpEvent(event, steps)):
        rdp.compose(event, steps)
        out.append(f"{rdp.get_epsilon(DELTA):.4f}")
    else:   # dp-accounting's RDP has no Poisson/replace-one: d3p's own RDP bound, starred
        eps = accounting.compute_epsilon(SIGMA, Q, steps, DELTA, sampler=sampler, relation=relation,
                                         accountant="rdp")
        out.append(f"{eps:.4f}*")
    return out


def epsilon_table(combos, steps_list, interval):
    print(f"\n| accounting | T | d3p ε | PLD pessimistic | PLD optimistic | RDP | d3p / PLD pess. |\n"
          f"|---|---|---|---|---|---|---|")
    for label in combos:
        sampler, relation = COMBOS[label]
        for steps in steps_list:
            eps = accounting.compute_epsilon(SIGMA, Q, steps, DELTA, sampler=sampler, relation=relation)
            pess, opt, rdp = reference(label, steps, interval)
            print(f"| {label} | {steps} | {eps:.4f} | {pess:.4f} | {opt:.4f} | {rdp} | {eps / pess:.4f} |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--interval", type=float, default=1e-4,
                        help="dp-accounting's value_discretization_interval (default 1e-4)")
    parser.add_argument("--no-reference", action="store_true", help="skip the ε table")
    args = parser.parse_args(argv)
    combos = ["poisson/add_remove"] if args.quick else list(COMBOS)
    print(f"σ = {SIGMA}, q = {Q}, δ = {DELTA}\n")
    timing_table(combos, [1000] if args.quick else [1000, 10_000, 100_000], 1 if args.quick else args.repeats)
    if not args.no_reference:
        epsilon_table(combos, [1000] if args.quick else [500, 1000, 2000, 4000], args.interval)


if __name__ == "__main__":
    main()
