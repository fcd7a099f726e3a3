"""σ needed for the same (ε, δ) under each sampler's accounting, and the true
ε of fixed-size runs calibrated with the midpoint pair.

Run: .venv/bin/python benchmarks/sampler_accounting.py
Prints the markdown tables of docs/privacy_accounting.md.
"""

import argparse

from d3p.accounting import compute_epsilon
from d3p.dputil import calibrate_sigma

COMBOS = [("poisson", "add_remove"), ("poisson", "substitute"), ("fixed_size", "substitute")]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--settings", default="0.01:1000,0.001:10000",
                        help="comma-separated q:T pairs (default: %(default)s)")
    parser.add_argument("--epsilons", default="0.5,1,2,4,8")
    args = parser.parse_args()
    settings = [(float(a), int(b)) for a, b in (s.split(":") for s in args.settings.split(","))]
    epsilons = [float(e) for e in args.epsilons.split(",")]

    print(f"σ for the target ε at δ = {args.delta:g}\n")
    print("| q | T | ε | Poisson, add/remove | Poisson, substitute | fixed size, substitute |")
    print("|---|---|---|---|---|---|")
    midpoint = {}
    for q, T in settings:
        for eps in epsilons:
            row = []
            for sampler, relation in COMBOS:
                sigma, _, _ = calibrate_sigma(eps, args.delta, q, T, sampler=sampler, relation=relation)
                row.append(sigma)
            midpoint[(q, T, eps)] = row[1]
            print(f"| {q:g} | {T} | {eps:g} | " + " | ".join(f"{s:.3f}" for s in row) + " |")
    print("\nFixed-size batches calibrated with the midpoint pair (the d3p paper's "
          "accounting): claimed ε and true ε\n")
    print("| q | T | σ (midpoint pair) | claimed ε | true ε (fixed size, substitute) |")
    print("|---|---|---|---|---|")
    for (q, T, eps), sigma in midpoint.items():
        true = compute_epsilon(sigma, q, T, args.delta, sampler="fixed_size")
        print(f"| {q:g} | {T} | {sigma:.3f} | {eps:g} | {true:.2f} |")


if __name__ == "__main__":
    main()
