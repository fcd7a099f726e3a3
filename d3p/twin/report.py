"""A report folder comparing a real and a synthetic table.

:func:`write_report` writes, into one directory:

* ``marginal_NN_<column>.png``: per column, the real and synthetic marginals
  (bars for categories, histograms for numbers, missing values as a cell);
* ``correlation_difference.png``: heat map of ``|corr(real) - corr(synthetic)|``
  over all pairs of variables (categoricals one-hot);
* ``report.json``: the metrics of :func:`d3p.twin.utility_metrics` (with the
  independent-uniform baseline), the twin's privacy record and fit settings,
  and the list of files.

**The report is NOT private**: it shows statistics of the real data. It is
for the data holder; publish only the synthetic data (and the twin).
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import List, Optional, Union

import numpy as np
import pandas as pd

from d3p.twin import metrics as _metrics
from d3p.twin._io import atomic_directory
from d3p.twin.cells import bin_edges
from d3p.twin.schema import Schema

__all__ = ["write_report", "write_report_files", "headline_lines", "REPORT_NOTE"]

#: The warning stored in every report.
REPORT_NOTE = (
    "This report is computed from the REAL data without privacy protection (marginals, "
    "correlations, classifier accuracies). It is for the data holder only: do not publish it."
)


def require_matplotlib() -> None:
    """Raise ``ImportError`` (saying how to install it) if matplotlib, which
    draws the report's plots, is not installed: the check of
    :func:`write_report_files`, which the command line makes before it fits."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError("the report's plots need matplotlib, which is not installed; install it with "
                          "`pip install matplotlib` (or `pip install d3p[twin]`).") from None


def _safe(name: str) -> str:
    s = re.sub(r"[^A-Za-z0-9._-]+", "_", str(name)).strip("._") or "column"
    return s[:40]


def _json_safe(v):
    if isinstance(v, dict):
        return {str(k): _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    if isinstance(v, (np.floating, float)):
        v = float(v)
        return v if math.isfinite(v) else ("inf" if v > 0 else ("-inf" if v < 0 else None))
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, np.bool_):
        return bool(v)
    return v


def _plot_marginal(path, real: pd.Series, syn: pd.Series, spec, bins: int, tv: float):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.0, 3.6))
    ax = fig.subplots()
    numeric = spec.kind in ("real", "count") if spec is not None else (
        _metrics._is_numeric(real) and _metrics._is_numeric(syn))
    r_miss, s_miss = float(real.isna().mean()), float(syn.isna().mean())
    if numeric:
        r = pd.to_numeric(real, errors="coerce").dropna().to_numpy(float)
        s = pd.to_numeric(syn, errors="coerce").dropna().to_numpy(float)
        if spec is not None and spec.lower is not None:
            lo, hi = spec.lower, spec.upper
        else:
            both = np.concatenate([r, s]) if r.size + s.size else np.zeros(1)
            lo, hi = float(both.min()), float(both.max())
        edges = bin_edges(lo, hi if hi > lo else lo + 1.0, bins)
        ax.hist(np.clip(r, lo, hi), bins=edges, density=True, alpha=0.5, label="real", color="C0")
        ax.hist(np.clip(s, lo, hi), bins=edges, density=True, alpha=0.5, label="synthetic", color="C1")
        ax.set_ylabel("density")
    else:
        lab = lambda x: x.astype(object).where(x.notna(), _metrics._MISSING).map(str)  # noqa: E731
        pr, ps = lab(real).value_counts(normalize=True), lab(syn).value_counts(normalize=True)
        cells = list(dict.fromkeys([str(v) for v in (spec.levels if spec is not None and spec.levels else [])]
                                   + list(pr.index) + list(ps.index)))
        if len(cells) > 40:
            cells = list(pr.sort_values(ascending=False).index[:40])
        x = np.arange(len(cells))
        ax.bar(x - 0.2, [pr.get(c, 0.0) for c in cells], width=0.4, label="real", color="C0")
        ax.bar(x + 0.2, [ps.get(c, 0.0) for c in cells], width=0.4, label="synthetic", color="C1")
        ax.set_xticks(x)
        ax.set_xticklabels(cells, rotation=45 if len(cells) > 6 else 0, ha="right" if len(cells) > 6 else "center",
                           fontsize=8)
        ax.set_ylabel("frequency")
    title = f"{real.name}: TV = {tv:.3f}"
    if r_miss or s_miss:
        title += f" (missing: real {r_miss:.1%}, synthetic {s_miss:.1%})"
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def _plot_correlation(path, cd: _metrics.CorrelationDifference):
    from matplotlib.figure import Figure

    d = np.abs(cd.real.to_numpy() - cd.synthetic.to_numpy())
    n = d.shape[0]
    size = min(4.0 + 0.25 * n, 16.0)
    fig = Figure(figsize=(size + 1.5, size))
    ax = fig.subplots()
    im = ax.imshow(d, vmin=0.0, vmax=1.0, cmap="viridis", interpolation="nearest")
    if n <= 60:
        labels = [str(c) for c in cd.real.columns]
        ax.set_xticks(range(n))
        ax.set_yticks(range(n))
        fs = 8 if n <= 25 else 5
        ax.set_xticklabels(labels, rotation=90, fontsize=fs)
        ax.set_yticklabels(labels, fontsize=fs)
    fig.colorbar(im, ax=ax, label="|corr(real) - corr(synthetic)|")
    ax.set_title(f"Correlation difference: mean {cd.mean_abs:.3f}, max {cd.max_abs:.3f}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def write_report_files(directory: str, real: pd.DataFrame, synthetic: pd.DataFrame, *, schema=None, twin=None,
                       target=None, real_train=None, bins: int = 20, seed: int = 0,
                       metrics: Optional[dict] = None) -> List[str]:
    """Write the report's files into the existing ``directory`` (not atomically;
    see :func:`write_report`). Returns the file names. ``metrics``: those of
    :func:`d3p.twin.utility_metrics` for the same arguments, if already
    computed (default: computed here)."""
    require_matplotlib()
    real, synthetic = real.rename(columns=str), synthetic.rename(columns=str)
    m = metrics if metrics is not None else _metrics.utility_metrics(
        real, synthetic, schema=schema, target=target, real_train=real_train, bins=bins, rng_seed=seed)
    cd = _metrics.correlation_difference(real, synthetic, schema=schema)
    files = []
    for i, c in enumerate(real.columns):
        spec = schema[c] if schema is not None and c in schema else None
        name = f"marginal_{i:02d}_{_safe(c)}.png"
        _plot_marginal(os.path.join(directory, name), real[c], synthetic[c], spec, bins, m["marginal_tv"][c])
        files.append(name)
    _plot_correlation(os.path.join(directory, "correlation_difference.png"), cd)
    files.append("correlation_difference.png")
    report = {
        "note": REPORT_NOTE,
        "metrics": m,
        "correlation": {
            "variables": [str(c) for c in cd.real.columns],
            "real": cd.real.to_numpy().round(6).tolist(),
            "synthetic": cd.synthetic.to_numpy().round(6).tolist(),
        },
        "files": files + ["report.json"],
    }
    if twin is not None:
        report["privacy"] = twin.privacy
        report["fit"] = twin.fit_info
        report["model"] = twin.model_spec
    if schema is not None:
        report["schema"] = schema.to_dict()
    with open(os.path.join(directory, "report.json"), "w", encoding="utf-8") as f:
        json.dump(_json_safe(report), f, indent=2, allow_nan=False)
        f.write("\n")
    return files + ["report.json"]


def headline_lines(metrics: dict) -> List[str]:
    """The headline figures of :func:`d3p.twin.utility_metrics`, one per line:
    the mean total-variation distance of the one-way marginals and the
    largest correlation error, each against the independent-uniform baseline
    where the metrics have it, and the train-on-synthetic accuracy where a
    target was given. NOT private: they describe the real data."""
    base = metrics.get("baseline")
    versus = lambda key: f" (uniform baseline {base[key]:.3f})" if base else ""  # noqa: E731
    lines = [f"mean TV of the one-way marginals       {metrics['mean_marginal_tv']:.3f}{versus('mean_marginal_tv')}"
             "  (0 = same marginals)"]
    worst = metrics.get("correlation_worst_pair")
    compared = ["mean_marginal_tv"]
    if worst:  # at least two variables
        a, b = worst["variables"]
        lines.append(f"largest correlation error             {metrics['correlation_max_abs_difference']:.3f}"
                     f"{versus('correlation_max_abs_difference')}  ({a} ~ {b}: real {worst['real']:.3f}, "
                     f"synthetic {worst['synthetic']:.3f})")
        compared.append("correlation_max_abs_difference")
    words = {"mean_marginal_tv": "the marginals", "correlation_max_abs_difference": "the largest correlation error"}
    worse = [words[key] for key in compared if base and metrics[key] >= base[key]]
    if worse:
        lines.append(f"WARNING: no better than independent uniform columns on {' and '.join(worse)}")
    cls = metrics.get("classification")
    if cls:
        protocol = str(cls["reference_protocol"]).replace("real_test", "the real data")
        lines.append(f"accuracy predicting {cls['target']!r}: trained on synthetic {cls['train_on_synthetic']:.3f}, "
                     f"on real {cls['train_on_real']:.3f} ({protocol}), majority class {cls['majority']:.3f}")
    return lines


def write_report(
    real: pd.DataFrame,
    synthetic: pd.DataFrame,
    report_dir: Union[str, os.PathLike],
    *,
    schema: Optional[Schema] = None,
    twin=None,
    target: Optional[str] = None,
    real_train: Optional[pd.DataFrame] = None,
    bins: int = 20,
    seed: int = 0,
    overwrite: bool = False,
) -> dict:
    """Write the report folder (see the module docstring).

    The files are written to a temporary directory next to ``report_dir``
    and renamed at the end: a failure leaves nothing behind.

    :param pandas.DataFrame real: the real data (test part if ``real_train`` is given).
    :param pandas.DataFrame synthetic: the synthetic data.
    :param report_dir: the directory to create.
    :param Schema schema: the schema (default: ``twin.schema`` if a twin is given).
    :param twin: the :class:`d3p.twin.TwinResult`, for its privacy record.
    :param str target: column for the train-on-synthetic accuracy (optional).
    :param pandas.DataFrame real_train: see :func:`d3p.twin.train_on_synthetic_accuracy`.
    :param int bins: bins for numeric marginals.
    :param int seed: seed of the baseline and the classifiers.
    :param bool overwrite: replace an existing directory.
    :return: the content of ``report.json``.

    NOT private: reads the real data; do not publish the report.
    """
    report_dir = os.fspath(report_dir)
    if schema is None and twin is not None:
        schema = twin.schema
    with atomic_directory(report_dir, overwrite=overwrite) as tmp:
        write_report_files(tmp, real, synthetic, schema=schema, twin=twin, target=target,
                           real_train=real_train, bins=bins, seed=seed)
    with open(os.path.join(report_dir, "report.json"), encoding="utf-8") as f:
        return json.load(f)
