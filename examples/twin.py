"""Synthetic data twins at several privacy levels, on real bundled data.

Fits a d3p twin (``family="mixture"``: a mixture of product distributions,
fitted with DP-VI) to 80% of a real data set at ε ∈ {0.5, 1, 4, inf}, samples a synthetic table of
the same size from each, and compares them with the held-out 20%:

* mean total-variation distance of the marginals (numbers in 20 bins),
* mean absolute difference of pairwise correlations,
* accuracy on the real test records of a logistic regression trained on the
  synthetic records (train on synthetic, test on real), against one trained
  on the real training records,

next to an independent-uniform baseline. ε = inf means σ = 0 with the same
clipping (a non-private fit with the same optimiser), so the gap between inf
and the finite ε is the cost of the noise alone.

Sampling and accounting: d3p.twin's default, Poisson sampling (every record in
a step with probability q, padded with a mask) under the add/remove relation;
``--sampling fixed`` fits on fixed-size batches without replacement instead,
accounted under the substitute relation (about twice the σ for the same ε).

Data:

* ``breast_cancer`` (default): scikit-learn's Wisconsin breast-cancer data,
  569 records, 30 real-valued measurements plus the diagnosis as a
  categorical column (the classification target). There is no public code
  book, so levels and bounds are read from the data (the warning says so).
* ``fair``: statsmodels' ``fair`` (affairs) survey, 6366 records; the coded
  answers are categoricals with the levels of the public code book, the
  target is ``had_affair = affairs > 0`` (``affairs`` itself is dropped).

Writes to ``--output-dir`` (default ``examples/output/``): a table
(``twin_<data>_results.json``), a plot (``twin_<data>_epsilon.png``), the
ε = 1 synthetic table (CSV) and its report folder (``<data>`` gets
``_fixed`` appended with ``--sampling fixed``, ``_quick`` with ``--quick``).

Usage::

    python examples/twin.py                 # breast cancer, full settings
    python examples/twin.py --dataset fair
    python examples/twin.py --quick         # CI: fewer steps, ε ∈ {1, inf}
    python examples/twin.py --sampling fixed   # fixed-size batches (substitute relation)
"""

import argparse
import json
import math
import os
import time
import warnings

import matplotlib

matplotlib.use("Agg")
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

import _common as common  # noqa: E402
import d3p.random  # noqa: E402
import d3p.twin as twin  # noqa: E402
from d3p.accounting import accounting_for  # noqa: E402


def load_breast_cancer():
    from sklearn.datasets import load_breast_cancer

    b = load_breast_cancer(as_frame=True)
    frame = b.data.copy()
    frame["diagnosis"] = pd.Series(np.where(b.target == 0, "malignant", "benign"), dtype="str")
    return frame, "diagnosis", None


def load_fair():
    import statsmodels.api as sm

    d = sm.datasets.fair.load_pandas().data

    def coded(s, levels, ordered=True):
        return pd.Categorical(s.astype(int), categories=levels, ordered=ordered)

    frame = pd.DataFrame({
        "rate_marriage": coded(d.rate_marriage, [1, 2, 3, 4, 5]),
        "age": d.age,
        "yrs_married": d.yrs_married,
        "children": d.children,
        "religious": coded(d.religious, [1, 2, 3, 4]),
        "educ": coded(d.educ, [9, 12, 14, 16, 17, 20]),
        "occupation": coded(d.occupation, [1, 2, 3, 4, 5, 6], ordered=False),
        "occupation_husb": coded(d.occupation_husb, [1, 2, 3, 4, 5, 6], ordered=False),
        "had_affair": d.affairs > 0,
    })
    # public information: the code book's levels, plausible ranges for the numbers
    cat = lambda name, levels, ordered=True: {"name": name, "kind": "categorical", "levels": levels,  # noqa: E731
                                              "ordered": ordered, "nullable": False}
    num = lambda name, lo, hi: {"name": name, "kind": "real", "lower": lo, "upper": hi,  # noqa: E731
                                "nullable": False, "distribution": "normal"}
    schema = {"columns": [
        cat("rate_marriage", [1, 2, 3, 4, 5]), num("age", 16.0, 45.0), num("yrs_married", 0.0, 25.0),
        num("children", 0.0, 6.0), cat("religious", [1, 2, 3, 4]), cat("educ", [9, 12, 14, 16, 17, 20]),
        cat("occupation", [1, 2, 3, 4, 5, 6], False), cat("occupation_husb", [1, 2, 3, 4, 5, 6], False),
        {"name": "had_affair", "kind": "boolean", "nullable": False},
    ]}
    return frame, "had_affair", schema


DATASETS = {"breast_cancer": load_breast_cancer, "fair": load_fair}
#: Mixture components per data set (None: d3p.twin's default, 5 for fair's N).
DEFAULT_COMPONENTS = {"breast_cancer": 3, "fair": None}


def parse_epsilon(text):
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"expected epsilon > 0 or inf, got {text!r}")
    return v


def parse_args(argv=None):
    parser = common.parser(__doc__)
    parser.add_argument("--dataset", choices=sorted(DATASETS), default="breast_cancer")
    parser.add_argument("--epsilons", type=parse_epsilon, nargs="+", default=None,
                        help="privacy levels (default 0.5 1 4 inf; --quick: 1 inf)")
    parser.add_argument("--steps", type=int, default=None, help="DP-VI steps (default: d3p.twin's default)")
    parser.add_argument("--components", type=int, default=None,
                        help="mixture components (default: 3 for breast_cancer, d3p.twin's default for fair)")
    parser.add_argument("--sampling", choices=("poisson", "fixed"), default="poisson", help=common.SAMPLING_HELP)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="few steps and two privacy levels (for CI)")
    parser.add_argument("--output-dir", default=common.OUTPUT_DIR, help=common.OUTPUT_HELP)
    return parser.parse_args(argv)


def split(frame, seed: int):
    """80% of the records for training, the rest held out."""
    order = np.random.default_rng(seed).permutation(len(frame))
    n_train = int(0.8 * len(frame))
    train = frame.iloc[order[:n_train]].reset_index(drop=True)
    test = frame.iloc[order[n_train:]].reset_index(drop=True)
    return train, test


def fix_schema(train, public_schema):
    """The schema, fixed once before any fit (shared by all privacy levels); says what it read from the data."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", twin.SchemaInferenceWarning)
        schema = twin.infer_schema(train, public_schema)
    if caught:
        print("NOTE:", caught[0].message)
    else:
        print("Schema entirely from public information: nothing read from the data.")
    return schema


def metrics_row(m, **fields):
    """A row of the results table: ``fields`` and the utility metrics ``m``."""
    return dict(fields, mean_marginal_tv=m["mean_marginal_tv"],
                correlation_mean_abs_difference=m["correlation_mean_abs_difference"],
                train_on_synthetic=m["classification"]["train_on_synthetic"],
                train_on_real=m["classification"]["train_on_real"],
                majority=m["classification"]["majority"])


def fit_level(args, i: int, eps: float, data, schema, delta: float):
    """Fit a twin at ``eps``, sample a table of the training size; returns the row, the twin and the table."""
    train, test, target = data
    print(f"\nfitting at epsilon = {eps:g} ...", flush=True)
    t0 = time.monotonic()
    components = args.components or DEFAULT_COMPONENTS[args.dataset]
    tw = twin.fit(train, eps, delta, rng_key=d3p.random.PRNGKey(args.seed + i), schema=schema, family="mixture",
                  num_steps=args.steps or (30 if args.quick else None), num_components=components,
                  sampling=args.sampling, progress_bar=True)
    syn = tw.generate(len(train), args.seed)
    seconds = time.monotonic() - t0
    same = (list(syn.columns) == list(train.columns)
            and dict(syn.dtypes.astype(str)) == dict(train.dtypes.astype(str)))
    m = twin.utility_metrics(test, syn, schema=schema, target=target, real_train=train, baseline=False)
    p = tw.privacy
    row = metrics_row(m, epsilon=eps, achieved_epsilon=p["epsilon"], delta=p["delta"], sampling=p["sampling"],
                      relation=p["relation"], sigma=p["sigma"], num_steps=p["num_steps"], q=p["q"],
                      components=tw.model_spec["num_components"], seconds=round(seconds, 1), same_schema=same)
    how = accounting_for(p["sampling"], p["relation"]).describe()  # how the fit was accounted
    print(f"  sigma = {p['sigma']:.3g}, epsilon spent = {p['epsilon']:.4g} ({how}), "
          f"same columns/dtypes: {same}")
    return row, tw, syn


def print_table(rows, num_test: int) -> None:
    header = f"{'epsilon':>16} {'sigma':>8} {'steps':>6} {'mean TV':>8} {'corr diff':>9} {'TSTR':>6} {'TRTR':>6} {'time s':>7}"
    print("\n" + header + "\n" + "-" * len(header))
    for r in rows:
        e = r["epsilon"] if isinstance(r["epsilon"], str) else f"{r['epsilon']:g}"
        sig = "" if r["sigma"] is None else f"{r['sigma']:.3g}"
        st = "" if r["num_steps"] is None else str(r["num_steps"])
        sec = "" if r["seconds"] is None else f"{r['seconds']:.0f}"
        print(f"{e:>16} {sig:>8} {st:>6} {r['mean_marginal_tv']:8.3f} {r['correlation_mean_abs_difference']:9.3f} "
              f"{r['train_on_synthetic']:6.3f} {r['train_on_real']:6.3f} {sec:>7}")
    print(f"(TSTR: logistic regression trained on synthetic, tested on the {num_test} held-out real records; "
          f"TRTR: trained on the real training records; majority class: {rows[0]['majority']:.3f}. "
          "epsilon = inf: sigma = 0 with the same clipping.)")


def write_outputs(args, rows, delta, data, synthetic_at_1) -> None:
    """The results as JSON and PNG, and the ε = 1 synthetic table with its report."""
    train, test, target = data
    tag = args.dataset + ("_fixed" if args.sampling == "fixed" else "") + ("_quick" if args.quick else "")
    out_json = os.path.join(args.output_dir, f"twin_{tag}_results.json")
    with open(out_json, "w") as f:
        json.dump({"dataset": args.dataset, "delta": delta, "num_train": len(train), "num_test": len(test),
                   "rows": [{k: (str(v) if isinstance(v, float) and math.isinf(v) else v) for k, v in r.items()}
                            for r in rows]}, f, indent=2)
    out_png = os.path.join(args.output_dir, f"twin_{tag}_epsilon.png")
    plot(rows, out_png, args.dataset)
    print(f"\nWrote {out_json}\nWrote {out_png}")
    if synthetic_at_1 is not None:
        tw, syn = synthetic_at_1
        csv = os.path.join(args.output_dir, f"twin_{tag}_synthetic_eps1.csv")
        syn.to_csv(csv, index=False)
        rep = os.path.join(args.output_dir, f"twin_{tag}_report_eps1")
        twin.write_report(test, syn, rep, twin=tw, target=target, real_train=train, overwrite=True)
        print(f"Wrote {csv}\nWrote {rep}/ (report: statistics of the REAL data, not private)")


def main(argv=None):
    args = parse_args(argv)
    epsilons = args.epsilons or ([1.0, math.inf] if args.quick else [0.5, 1.0, 4.0, math.inf])
    os.makedirs(args.output_dir, exist_ok=True)
    frame, target, public_schema = DATASETS[args.dataset]()
    train, test = split(frame, args.seed)
    N = len(train)
    delta = 1.0 / N**2
    print(f"{args.dataset}: {N} training and {len(test)} test records, {frame.shape[1]} columns, "
          f"target {target!r}; delta = 1/N^2 = {delta:.3g}")
    schema = fix_schema(train, public_schema)
    baseline = twin.utility_metrics(test, twin.uniform_baseline(schema, N, args.seed), schema=schema,
                                    target=target, real_train=train, baseline=False)
    rows = [metrics_row(baseline, epsilon="uniform baseline", sigma=None, num_steps=None, seconds=None)]
    synthetic_at_1 = None
    for i, eps in enumerate(epsilons):
        row, tw, syn = fit_level(args, i, eps, (train, test, target), schema, delta)
        rows.append(row)
        if eps == 1.0:
            synthetic_at_1 = (tw, syn)
    print_table(rows, len(test))
    write_outputs(args, rows, delta, (train, test, target), synthetic_at_1)


def plot(rows, path, dataset):
    from matplotlib.figure import Figure

    fits = [r for r in rows if not isinstance(r["epsilon"], str)]
    base = rows[0]
    labels = [f"{r['epsilon']:g}" if math.isfinite(r["epsilon"]) else "inf\n(σ=0)" for r in fits]
    x = np.arange(len(fits))
    fig = Figure(figsize=(12, 3.8))
    axes = fig.subplots(1, 3)
    panels = [("mean_marginal_tv", "mean marginal TV distance (lower is better)"),
              ("correlation_mean_abs_difference", "mean |correlation difference| (lower is better)"),
              ("train_on_synthetic", "accuracy on real test data (higher is better)")]
    for ax, (key, title) in zip(axes, panels):
        ax.plot(x, [r[key] for r in fits], "o-", label="twin")
        ax.axhline(base[key], color="C3", ls="--", label="uniform baseline")
        if key == "train_on_synthetic":
            ax.axhline(fits[0]["train_on_real"], color="C2", ls=":", label="trained on real")
            ax.axhline(base["majority"], color="grey", ls="-.", label="majority class")
        ax.set_xticks(x)
        ax.set_xticklabels(labels)
        ax.set_xlabel("epsilon")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"d3p twin on {dataset}: utility against privacy", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
