"""Utility metrics for synthetic data, usable on any pair of real/synthetic frames.

* :func:`marginal_tv_distances`: per-column total-variation distance of the
  marginal distributions (numeric columns binned, missing values as a cell);
* :func:`correlation_difference`: mean absolute difference of pairwise
  correlations (categoricals one-hot encoded);
* :func:`train_on_synthetic_accuracy`: accuracy on real data of a classifier
  trained on synthetic data, against one trained on real data (needs
  scikit-learn);
* :func:`uniform_baseline`: an independent-uniform table over a schema's
  domain, the reference that a useful twin must beat;
* :func:`utility_metrics`: all of the above in one JSON-serialisable dict.

**Privacy.** These functions read the real data without any privacy
protection. Their results (and plots made from them) describe the real data
and are NOT covered by a twin's (ε, δ) guarantee: they are meant for the data
holder's own evaluation, not for publication.
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional

import numpy as np
import pandas as pd

from d3p import _validate
from d3p.twin.cells import bin_edges
from d3p.twin.schema import INTEGER_CODE_DISTRIBUTIONS, NUMERIC_MAX_LEVELS, Schema, check_frame

__all__ = [
    "marginal_tv_distances",
    "correlation_difference",
    "CorrelationDifference",
    "train_on_synthetic_accuracy",
    "uniform_baseline",
    "utility_metrics",
    "numeric_view",
    "worst_pair",
]

_MISSING = "<missing>"


def _check_frames(real, synthetic) -> List[str]:
    check_frame("real", real)
    check_frame("synthetic", synthetic)
    rc, sc = [str(c) for c in real.columns], [str(c) for c in synthetic.columns]
    if sorted(rc) != sorted(sc):
        raise ValueError(
            f"Expected real and synthetic to have the same columns, got {rc} and {sc}."
        )
    if len(real) == 0 or len(synthetic) == 0:
        raise ValueError(
            f"Expected non-empty frames, got {len(real)} real and {len(synthetic)} synthetic rows."
        )
    return rc


def _check_bins(bins) -> int:
    return _validate.integer("bins", bins, minimum=1)


def _is_numeric(s: pd.Series) -> bool:
    return (pd.api.types.is_numeric_dtype(s.dtype) and not pd.api.types.is_bool_dtype(s.dtype)
            and not isinstance(s.dtype, pd.CategoricalDtype))


def _cells(real: pd.Series, syn: pd.Series, spec, bins: int):
    """Cell labels of both columns (numbers binned, missing as its own cell)."""
    numeric = _is_numeric(real) and _is_numeric(syn)
    if spec is not None:
        numeric = spec.kind in ("real", "count")
    if not numeric:
        lab = lambda s: s.astype(object).where(s.notna(), _MISSING).map(str)  # noqa: E731
        return lab(real), lab(syn)
    r = pd.to_numeric(real, errors="coerce").to_numpy(float)
    s = pd.to_numeric(syn, errors="coerce").to_numpy(float)
    if spec is not None and spec.lower is not None:
        lo, hi = spec.lower, spec.upper
    else:
        finite = r[np.isfinite(r)]
        lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    integer = (pd.api.types.is_integer_dtype(real.dtype) or (spec is not None and spec.kind == "count"))
    if integer and hi - lo + 1 <= bins:
        edges = np.arange(lo - 0.5, hi + 1.0, 1.0)
    else:
        edges = bin_edges(lo, hi if hi > lo else lo + 1.0, bins)
    nb = len(edges) - 1

    def lab(x):
        idx = np.clip(np.searchsorted(edges, x, side="right") - 1, 0, nb - 1).astype(object)
        idx[~np.isfinite(x)] = _MISSING
        return pd.Series(idx).map(str)

    return lab(r), lab(s)


def marginal_tv_distances(
    real: pd.DataFrame,
    synthetic: pd.DataFrame,
    *,
    schema: Optional[Schema] = None,
    bins: int = 20,
) -> Dict[str, float]:
    """Total-variation distance between the real and synthetic marginal of every column.

    ``TV(p, q) = 1/2 sum_cells |p(cell) - q(cell)|``, in [0, 1]. Categorical,
    boolean and text columns use their values as cells; numeric columns are
    cut into ``bins`` equal-width bins over the schema's bounds (or the real
    data's range; values outside go to the end bins), integer columns with a
    range of at most ``bins`` values use one cell per integer. A missing
    value is one more cell everywhere.

    :param pandas.DataFrame real: the real data.
    :param pandas.DataFrame synthetic: the synthetic data (same columns).
    :param Schema schema: optional; gives kinds and bounds.
    :param int bins: number of bins for numeric columns (default 20).
    :return: ``{column: tv}`` in the real data's column order.

    NOT private: reads the real data.
    """
    cols = _check_frames(real, synthetic)
    bins = _check_bins(bins)
    real, synthetic = real.rename(columns=str), synthetic.rename(columns=str)
    out = {}
    for c in cols:
        spec = schema[c] if schema is not None and c in schema else None
        a, b = _cells(real[c], synthetic[c], spec, bins)
        pa, pb = a.value_counts(normalize=True), b.value_counts(normalize=True)
        out[c] = float(0.5 * pa.sub(pb, fill_value=0.0).abs().sum())
    return out


def numeric_view(frame: pd.DataFrame, *, schema: Optional[Schema] = None, levels: Optional[Dict] = None) -> pd.DataFrame:
    """All columns as numbers, for correlations: numeric as is, booleans 0/1,
    ordered categoricals as codes, other categoricals one-hot (``"col=level"``,
    missing: all 0). ``levels`` fixes the one-hot levels per column (default:
    the schema's levels, else the frame's values).

    :param pandas.DataFrame frame: the table.
    :param Schema schema: optional; gives kinds and levels.
    :param dict levels: optional ``{column: levels}``.
    :return: a float DataFrame (``NaN`` for missing numeric values).
    """
    parts = {}
    for c in frame.columns:
        s = frame[c]
        name = str(c)
        spec = schema[name] if schema is not None and name in schema else None
        kind = spec.kind if spec is not None else None
        if kind is None:
            if pd.api.types.is_bool_dtype(s.dtype):
                kind = "boolean"
            elif _is_numeric(s):
                kind = "real"
            else:
                kind = "categorical"
        if kind in ("real", "count"):
            parts[name] = pd.to_numeric(s, errors="coerce").astype(float).to_numpy()
        elif kind == "boolean":
            v = s.astype(object)
            parts[name] = np.asarray([np.nan if pd.isna(x) else float(bool(x) if not isinstance(x, str)
                                      else x.strip().lower() in ("true", "t", "yes", "1")) for x in v])
        else:
            if isinstance(s.dtype, pd.CategoricalDtype) and s.cat.ordered:
                codes = s.cat.codes.to_numpy().astype(float)
                codes[codes < 0] = np.nan
                parts[name] = codes
                continue
            if levels is not None and name in levels:
                levs = list(levels[name])
            elif spec is not None and spec.levels is not None:
                levs = list(spec.levels)
            else:
                levs = sorted({str(v) for v in s.dropna().tolist()})
            sv = s.astype(object).map(lambda v: None if pd.isna(v) else str(v))
            for lev in levs:
                parts[f"{name}={lev}"] = (sv == str(lev)).to_numpy(float)
    return pd.DataFrame(parts, index=frame.index)


class CorrelationDifference(NamedTuple):
    """Result of :func:`correlation_difference`.

    - **mean_abs** - mean absolute difference over all pairs of variables.
    - **max_abs** - largest absolute difference.
    - **real** - correlation matrix of the real data (DataFrame).
    - **synthetic** - correlation matrix of the synthetic data.
    """

    mean_abs: float
    max_abs: float
    real: pd.DataFrame
    synthetic: pd.DataFrame


def correlation_difference(
    real: pd.DataFrame, synthetic: pd.DataFrame, *, schema: Optional[Schema] = None
) -> CorrelationDifference:
    """Mean absolute difference of pairwise Pearson correlations.

    Both frames are turned into numbers with :func:`numeric_view` (one-hot
    levels of unordered categoricals taken from the schema, else from the
    real data); correlations use pairwise-complete observations; a correlation
    that is undefined (a constant variable) counts as 0. The mean is over all
    pairs of distinct variables.

    :param pandas.DataFrame real: the real data.
    :param pandas.DataFrame synthetic: the synthetic data (same columns).
    :param Schema schema: optional; gives kinds and levels.
    :return: :class:`CorrelationDifference`.

    NOT private: reads the real data.
    """
    _check_frames(real, synthetic)
    real, synthetic = real.rename(columns=str), synthetic.rename(columns=str)
    synthetic = synthetic[list(real.columns)]
    rv = numeric_view(real, schema=schema)
    levels = {}
    for c in real.columns:
        pref = f"{c}="
        levs = [k[len(pref):] for k in rv.columns if k.startswith(pref)]
        if levs:
            levels[c] = levs
    sv = numeric_view(synthetic, schema=schema, levels=levels)
    sv = sv.reindex(columns=rv.columns, fill_value=0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        cr = rv.corr().fillna(0.0)
        cs = sv.corr().fillna(0.0)
    d = np.abs(cr.to_numpy() - cs.to_numpy())
    iu = np.triu_indices(d.shape[0], k=1)
    if iu[0].size == 0:
        return CorrelationDifference(0.0, 0.0, cr, cs)
    return CorrelationDifference(float(d[iu].mean()), float(d[iu].max()), cr, cs)


def worst_pair(cd: CorrelationDifference) -> Optional[dict]:
    """The pair of variables whose correlation differs most in ``cd``:
    ``{"variables": [a, b], "real": r, "synthetic": s}`` (None with fewer
    than two variables). NOT private: ``r`` is a statistic of the real data."""
    d = np.abs(cd.real.to_numpy() - cd.synthetic.to_numpy())
    iu = np.triu_indices(d.shape[0], k=1)
    if iu[0].size == 0:
        return None
    k = int(np.argmax(d[iu]))
    i, j = int(iu[0][k]), int(iu[1][k])
    names = [str(c) for c in cd.real.columns]
    return {"variables": [names[i], names[j]], "real": float(cd.real.iat[i, j]),
            "synthetic": float(cd.synthetic.iat[i, j])}


def _require_sklearn():
    try:
        import sklearn  # noqa: F401
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError(
            "train_on_synthetic_accuracy needs scikit-learn, which is not installed; install it "
            "with `pip install scikit-learn` (or `pip install d3p[examples]`)."
        ) from None


def _classifier(kind: str, random_state: int):
    from sklearn.compose import ColumnTransformer
    from sklearn.ensemble import RandomForestClassifier
    from sklearn.impute import SimpleImputer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import OneHotEncoder, StandardScaler

    def build(numeric_cols, other_cols):
        pre = ColumnTransformer([
            ("num", make_pipeline(SimpleImputer(strategy="median", add_indicator=True,
                                                keep_empty_features=True), StandardScaler()),
             numeric_cols),
            ("cat", OneHotEncoder(handle_unknown="ignore"), other_cols),
        ])
        if kind == "logistic":
            clf = LogisticRegression(max_iter=5000)
        else:
            clf = RandomForestClassifier(n_estimators=200, random_state=random_state, n_jobs=1)
        return make_pipeline(pre, clf)

    return build


def _features(frame: pd.DataFrame, numeric_cols, other_cols) -> pd.DataFrame:
    out = pd.DataFrame(index=frame.index)
    for c in numeric_cols:
        out[c] = pd.to_numeric(frame[c], errors="coerce").astype(float)
    for c in other_cols:
        out[c] = frame[c].astype(object).map(lambda v: _MISSING if pd.isna(v) else str(v))
    return out


def _labels(s: pd.Series) -> pd.Series:
    return s.astype(object).map(lambda v: None if pd.isna(v) else str(v))


def train_on_synthetic_accuracy(
    real_test: pd.DataFrame,
    synthetic: pd.DataFrame,
    target: str,
    *,
    real_train: Optional[pd.DataFrame] = None,
    classifier: str = "logistic",
    cv: int = 5,
    random_state: int = 0,
    schema: Optional[Schema] = None,
) -> Dict[str, float]:
    """Train on synthetic, test on real (TSTR), against train on real.

    A classifier for ``target`` from all other columns (numeric: median-imputed
    with missing indicators and standardised; others: one-hot with missing as
    a level) is trained on ``synthetic`` and scored on ``real_test``. The
    reference is the same classifier trained on ``real_train`` and scored on
    ``real_test``, or, without ``real_train``, its ``cv``-fold cross-validated
    accuracy on ``real_test``. Rows with a missing target are dropped.

    For an honest comparison, fit the twin on ``real_train`` only and keep
    ``real_test`` apart (see ``examples/twin.py``).

    :param pandas.DataFrame real_test: real records to test on.
    :param pandas.DataFrame synthetic: synthetic records to train on.
    :param str target: the column to predict (categorical, boolean, integer,
        or numbers with at most 20 distinct values; with ``schema``, any but a
        ``real`` column; at most 50 classes: :func:`check_classification_target`).
    :param pandas.DataFrame real_train: real records to train the reference on.
    :param str classifier: ``"logistic"`` (default) or ``"random_forest"``.
    :param int cv: folds for the reference without ``real_train`` (>= 2).
    :param int random_state: seed for the folds and the forest.
    :param Schema schema: the twin's schema (optional): the target's kind.
    :return: dict with ``train_on_synthetic``, ``train_on_real``,
        ``majority`` (accuracy of always predicting the most common class of
        ``real_test``), ``num_test``.
    :raises ImportError: if scikit-learn is not installed.

    NOT private: reads the real data.
    """
    _require_sklearn()
    _check_frames(real_test, synthetic)
    classifier = _validate.choice("classifier", classifier, _CLASSIFIERS)
    cv = _validate.integer("cv", cv, minimum=2)
    real_test = real_test.rename(columns=str)
    synthetic = synthetic.rename(columns=str)[list(real_test.columns)]
    if real_train is not None:
        _check_frames(real_test, real_train)
        real_train = real_train.rename(columns=str)[list(real_test.columns)]
    task = _Classification(real_test, target, classifier, random_state, schema)
    tstr = task.train_and_score(synthetic)
    if real_train is not None:
        trtr, protocol = task.train_and_score(real_train), "train on real_train, test on real_test"
    else:
        trtr, protocol = task.cross_validated(cv)
    return {
        "target": target,
        "classifier": classifier,
        "train_on_synthetic": tstr,
        "train_on_real": trtr,
        "majority": task.majority,
        "num_test": int(len(task.y_test)),
        "reference_protocol": protocol,
    }


_CLASSIFIERS = ("logistic", "random_forest")


def check_classification_target(real_test: pd.DataFrame, target: str, *, schema: Optional[Schema] = None) -> None:
    """Raise ``ValueError`` if :func:`train_on_synthetic_accuracy` cannot
    predict ``target`` on ``real_test`` (a continuous column, more than 50
    classes, no value), and ``ImportError`` without scikit-learn: the checks
    it makes, which need no synthetic data (the command line makes them
    before it fits). A column is continuous if ``schema`` says it is
    ``real``; without a schema (or a column it does not describe), if it
    holds non-integer numbers with more than :data:`NUMERIC_MAX_LEVELS`
    distinct values. NOT private: reads the real data.

    :param pandas.DataFrame real_test: the real records to test on.
    :param str target: the column to predict.
    :param Schema schema: the schema of the twin (optional): the target's kind.
    """
    _require_sklearn()
    if target not in real_test.columns:
        raise ValueError(f"Expected target to be one of the columns {list(real_test.columns)}, got "
                         f"target={target!r}.")
    t = real_test[target]
    if schema is not None and target in schema:
        continuous, why = schema[target].kind == "real", "a real column in the schema"
    else:
        continuous = (_is_numeric(t) and not pd.api.types.is_integer_dtype(t.dtype)
                      and t.nunique() > NUMERIC_MAX_LEVELS)
        why = f"{t.dtype}, more than {NUMERIC_MAX_LEVELS} distinct values"
    if continuous:
        raise ValueError(f"Expected a categorical target, but column {target!r} is continuous ({why}); choose a "
                         "categorical, boolean or integer column.")
    if t.nunique() > 50:
        raise ValueError(f"Expected a target with at most 50 classes, column {target!r} has {t.nunique()}.")
    if not t.notna().any():
        raise ValueError(
            f"Expected some real test records with a target value, column {target!r} is all missing.")
    if t.nunique() < 2:
        raise ValueError(f"Expected a target with at least two classes, column {target!r} has one (as the schema "
                         "maps the records: a schema read privately from few records may keep one level; give the "
                         "column's levels in the schema).")


class _Classification:
    """One classification task of :func:`train_on_synthetic_accuracy`: predict
    ``target`` from the other columns, scored on the real test records."""

    def __init__(self, real_test: pd.DataFrame, target: str, classifier: str, random_state: int,
                 schema: Optional[Schema] = None):
        check_classification_target(real_test, target, schema=schema)
        features = [c for c in real_test.columns if c != target]
        self.target, self.random_state = target, random_state
        self.numeric_cols = [c for c in features if _is_numeric(real_test[c])]
        self.other_cols = [c for c in features if c not in self.numeric_cols]
        self.build = _classifier(classifier, random_state)
        self.X_test, self.y_test = self.xy(real_test)   # not empty: the check above
        _, self.class_counts = np.unique(self.y_test, return_counts=True)
        self.majority = float(self.class_counts.max() / self.class_counts.sum())

    def xy(self, frame: pd.DataFrame):
        """Features and labels of the records of ``frame`` that have a target value."""
        y = _labels(frame[self.target])
        keep = y.notna().to_numpy()
        return _features(frame[keep], self.numeric_cols, self.other_cols), y[keep].to_numpy()

    def train_and_score(self, frame: pd.DataFrame) -> float:
        """Accuracy on the test records of the classifier trained on ``frame``
        (NaN without training records; a single class is predicted as such)."""
        X, y = self.xy(frame)
        if len(y) == 0:
            return float("nan")
        classes = np.unique(y)
        if len(classes) == 1:
            return float(np.mean(self.y_test == classes[0]))
        return float(self.build(self.numeric_cols, self.other_cols).fit(X, y).score(self.X_test, self.y_test))

    def cross_validated(self, cv: int):
        """``(accuracy, protocol)`` of stratified cross-validation on the test
        records, with at most as many folds as the rarest class has records."""
        from sklearn.model_selection import StratifiedKFold, cross_val_score

        smallest = int(self.class_counts.min())
        folds = min(cv, smallest) if smallest >= 2 else 0
        if folds < 2:
            return float("nan"), f"{folds}-fold cross-validation on real_test"
        splitter = StratifiedKFold(folds, shuffle=True, random_state=self.random_state)
        model = self.build(self.numeric_cols, self.other_cols)
        accuracy = float(cross_val_score(model, self.X_test, self.y_test, cv=splitter).mean())
        return accuracy, f"{folds}-fold cross-validation on real_test"


def uniform_baseline(schema: Schema, num_records: int, rng_seed: int = 0, *, bins: int = 20) -> pd.DataFrame:
    """An independent-uniform table over the schema's domain.

    Every column independently: categoricals uniform over their levels,
    booleans over {False, True}, reals uniform on ``[lower, upper]``, counts
    uniform over the integers in it. A nullable column is missing with the
    probability of one more cell: ``1 / (levels + 1)`` for categoricals,
    ``1/3`` for booleans, ``1 / (bins + 1)`` for numeric columns (matching the
    cells of :func:`marginal_tv_distances`).

    :param Schema schema: a complete schema.
    :param int num_records: number of rows.
    :param int rng_seed: NumPy seed.
    :param int bins: see above.
    :return: a DataFrame like a twin's output.
    """
    if not isinstance(schema, Schema) or not schema.is_complete:
        raise ValueError("Expected schema to be a complete d3p.twin.Schema.")
    n = _validate.integer("num_records", num_records, minimum=1)
    bins = _check_bins(bins)
    rng = np.random.default_rng(rng_seed)
    codes = np.empty((n, len(schema)))
    for j, c in enumerate(schema.columns):
        if c.kind == "categorical":
            cells = c.num_levels + int(bool(c.nullable))
            v = rng.integers(0, cells, n).astype(float)
            v[v >= c.num_levels] = np.nan
            codes[:, j] = v
            continue
        if c.kind == "boolean":
            v = rng.integers(0, 2, n).astype(float)
            p_missing = 1.0 / 3.0
        elif c.kind == "count":
            vals = rng.integers(int(c.lower), int(c.upper) + 1, n).astype(float)
            v = vals - c.lower if c.distribution in INTEGER_CODE_DISTRIBUTIONS else c.scale(vals)
            p_missing = 1.0 / (bins + 1)
        else:
            v = c.scale(rng.uniform(c.lower, c.upper, n))
            p_missing = 1.0 / (bins + 1)
        if c.nullable:
            v = np.where(rng.uniform(size=n) < p_missing, np.nan, v)
        codes[:, j] = v
    return schema.decode(codes)


def utility_metrics(
    real: pd.DataFrame,
    synthetic: pd.DataFrame,
    *,
    schema: Optional[Schema] = None,
    target: Optional[str] = None,
    real_train: Optional[pd.DataFrame] = None,
    bins: int = 20,
    baseline: bool = True,
    rng_seed: int = 0,
) -> dict:
    """All metrics in one JSON-serialisable dict (as written to ``report.json``).

    :param pandas.DataFrame real: the real data (the test part, if ``real_train`` is given).
    :param pandas.DataFrame synthetic: the synthetic data.
    :param Schema schema: optional; needed for the uniform baseline.
    :param str target: optional column for :func:`train_on_synthetic_accuracy`.
    :param pandas.DataFrame real_train: optional, see :func:`train_on_synthetic_accuracy`.
    :param int bins: bins for numeric marginals.
    :param bool baseline: also score :func:`uniform_baseline` (needs ``schema``).
    :param int rng_seed: seed of the baseline.
    :return: ``{"marginal_tv": {...}, "mean_marginal_tv", "correlation_mean_abs_difference",
        "correlation_max_abs_difference", "correlation_worst_pair" (see :func:`worst_pair`),
        "baseline": {...}, "classification": {...}}``.

    NOT private: reads the real data.
    """
    tv = marginal_tv_distances(real, synthetic, schema=schema, bins=bins)
    cd = correlation_difference(real, synthetic, schema=schema)
    out = {
        "num_real": int(len(real)),
        "num_synthetic": int(len(synthetic)),
        "marginal_tv": tv,
        "mean_marginal_tv": float(np.mean(list(tv.values()))),
        "correlation_mean_abs_difference": cd.mean_abs,
        "correlation_max_abs_difference": cd.max_abs,
        "correlation_worst_pair": worst_pair(cd),
    }
    if baseline and schema is not None:
        base = uniform_baseline(schema, max(len(real), 1000), rng_seed, bins=bins)
        btv = marginal_tv_distances(real, base, schema=schema, bins=bins)
        bcd = correlation_difference(real, base, schema=schema)
        out["baseline"] = {
            "name": "independent uniform over the schema's domain",
            "marginal_tv": btv,
            "mean_marginal_tv": float(np.mean(list(btv.values()))),
            "correlation_mean_abs_difference": bcd.mean_abs,
            "correlation_max_abs_difference": bcd.max_abs,
            "correlation_worst_pair": worst_pair(bcd),
        }
    if target is not None:
        out["classification"] = train_on_synthetic_accuracy(
            real, synthetic, target, real_train=real_train, random_state=rng_seed, schema=schema)
    return out
