"""What a twin of ``insurance_like`` must keep for a TSTR AUC of 0.65 without a target,
and what choosing it costs at ε = 1 (issue 37, item 2; benchmarks/README.md).

1. **The ceiling of one tie.** A logistic regression trained on the real 80% of
   each seed's split (``benchmarks/twins.py``'s split) with only some of the
   target's predictors, its ROC AUC on the real 20%: what a synthetic target
   tied to those columns alone can give at best.
2. **The choice.** Every pair's dependence in the real records (the L1
   distance between the pair's count table and the product of its margins:
   the score of a tree round without the one-way tables' noise, an optimistic
   stand-in for it) and, for the target ``buys``, the probability that the
   exponential mechanism with sensitivity 1 and ε₀ picks ``p_car`` or
   ``s_income`` as its partner among the other 85 columns.

Usage::

    python benchmarks/wide_target_ceiling.py
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from twins import load_insurance_like, split  # noqa: E402

SUBSETS = [["p_car"], ["s_income"], ["p_fire"], ["p_car", "s_income"],
           ["p_car", "s_income", "p_fire"], ["p_car", "s_income", "p_fire", "contract"]]
EPSILONS = [0.0096, 0.02, 0.03, 0.045, 0.06]


def ceilings(frame, seeds=(0, 1, 2)):
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import roc_auc_score

    rows = []
    for cols in SUBSETS:
        aucs = []
        for seed in seeds:
            train, test = split(frame, seed)
            clf = LogisticRegression(max_iter=2000).fit(train[cols], train["buys"])
            aucs.append(roc_auc_score(test["buys"], clf.decision_function(test[cols])))
        rows.append((cols, aucs))
    return rows


def dependence(frame) -> np.ndarray:
    x = frame.to_numpy()
    n, d = x.shape
    k = int(x.max()) + 1
    scores = np.zeros((d, d))
    for i in range(d):
        for j in range(i + 1, d):
            joint = np.zeros((k, k))
            np.add.at(joint, (x[:, i], x[:, j]), 1)
            scores[i, j] = scores[j, i] = np.abs(joint - np.outer(joint.sum(1), joint.sum(0)) / n).sum()
    return scores


def main() -> int:
    frame = load_insurance_like().frame
    print("| predictors | AUC, seeds 0 / 1 / 2 |")
    print("|---|---|")
    for cols, aucs in ceilings(frame):
        print(f"| {', '.join(cols)} | {' / '.join(f'{a:.3f}' for a in aucs)} |")
    names = list(frame.columns)
    scores = dependence(frame)
    b = names.index("buys")
    others = [j for j in range(len(names)) if j != b]
    ranked = sorted(others, key=lambda j: -scores[b, j])
    print("\nbuys's dependence on its strongest partners: "
          + ", ".join(f"{names[j]} {scores[b, j]:.0f}" for j in ranked[:6])
          + f"; median of the 85: {np.median(scores[b, others]):.0f}")
    good = [names.index("p_car"), names.index("s_income")]
    print("\n| ε₀ | P(partner is p_car or s_income) |")
    print("|---|---|")
    for eps in EPSILONS:
        s = scores[b, others]
        w = np.exp(eps * (s - s.max()) / 2)
        print(f"| {eps} | {w[[others.index(g) for g in good]].sum() / w.sum():.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
