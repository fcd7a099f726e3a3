"""Synthetic data twins: fit a generative model with DP-VI, then sample.

A *twin* of a private table is a generative model fitted privately at a
target (ε, δ): a graphical model fitted to noisy marginal tables (mostly
discrete tables) or a mixture fitted with differentially private variational
inference (:class:`d3p.svi.DPSVI`); synthetic tables sampled from it are
post-processing and carry the same guarantee. See ``docs/twin.md``.

>>> import pandas as pd, d3p.twin, d3p.random   # doctest: +SKIP
>>> twin = d3p.twin.fit(frame, epsilon=1.0, rng_key=d3p.random.PRNGKey())  # doctest: +SKIP
>>> synthetic = twin.generate(1000, rng_key=0)  # doctest: +SKIP
"""

from d3p.twin._schema_private import SCHEMA_SHARE, PrivateSchema, infer_schema_private, plan_schema
from d3p.twin.inference import TwinResult, choose_family, default_num_steps, default_q, fit, load
from d3p.twin.marginal import MarginalModel
from d3p.twin.metrics import (
    CorrelationDifference,
    correlation_difference,
    marginal_tv_distances,
    train_on_synthetic_accuracy,
    uniform_baseline,
    utility_metrics,
)
from d3p.twin.report import write_report
from d3p.twin.model import MixtureGuide, MixtureModel, MixtureOfProducts, default_num_components
from d3p.twin.schema import (
    ColumnSpec,
    Schema,
    SchemaInferenceWarning,
    TwinInputError,
    infer_schema,
)

__all__ = [
    # fitting, generating, saving
    "fit", "load", "TwinResult", "default_num_steps", "default_q", "choose_family",
    # schemas
    "Schema", "ColumnSpec", "infer_schema", "SchemaInferenceWarning", "TwinInputError",
    "infer_schema_private", "PrivateSchema",
    # the models: marginal tables and a graphical model, or a mixture fitted with DP-VI
    "MarginalModel", "MixtureModel", "MixtureGuide", "MixtureOfProducts", "default_num_components",
    # utility metrics and the report (NOT private: they read the real data)
    "marginal_tv_distances", "correlation_difference", "CorrelationDifference", "train_on_synthetic_accuracy",
    "uniform_baseline", "utility_metrics", "write_report",
]
