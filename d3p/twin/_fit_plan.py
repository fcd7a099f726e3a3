"""A twin fit's privacy plan: the schema (read privately, from the data outside ε, or given) and the
accounting of the whole release (schema and model) in one (ε, δ).

Public settings only: nothing here reads a record except :func:`resolve_schema`, through
:func:`d3p.twin._schema_private.infer_schema_private` (private) or
:func:`d3p.twin.schema.infer_schema` (outside ε, warned).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple

from d3p import _validate, accounting, dputil, minibatch
from d3p.twin._schema_private import PrivateSchema, SchemaPlan, infer_schema_private, schema_key
from d3p.twin.schema import Schema, infer_schema

#: The ways of completing a schema: ``"private"`` (the default: :func:`infer_schema_private`, in the
#: twin's budget) and ``"data"`` (:func:`d3p.twin.schema.infer_schema`: outside ε, warned).
SCHEMA_INFERENCE = ("private", "data")


def _is_complete(schema, names) -> bool:
    """Whether a given schema describes every column of ``names`` completely (no field to read)."""
    if schema is None:
        return False
    from d3p.twin._schema_inference import _as_schema

    schema = _as_schema(schema, names)
    given = {c.name: c for c in schema.columns}
    return all(n in given and given[n].missing_fields() in ([], ["dtype"]) for n in names)


def check_schema_options(data, epsilon: float, schema, schema_inference: str, schema_share: float,
                         strict: bool) -> Tuple[str, float]:
    """Checks before anything is read: ``(schema_inference, schema_share)``; with ``strict``, refuses
    every path on which something would be read from the data outside ε."""
    schema_inference = _validate.choice("schema_inference", schema_inference, SCHEMA_INFERENCE)
    schema_share = _validate.number("schema_share", schema_share, low=0.0, high=1.0, low_open=True,
                                    high_open=True)
    _validate.boolean("strict", strict)
    if isinstance(schema, PrivateSchema):
        return schema_inference, schema_share
    names = [c if isinstance(c, str) else str(c) for c in data.columns]
    if strict:
        if math.isinf(epsilon):
            raise ValueError("Expected a finite epsilon under strict (epsilon=inf fits without privacy).")
        marked = schema is not None and any(c.inferred for c in
                                            (Schema.from_dict(schema) if isinstance(schema, dict) else schema).columns)
        if marked:
            raise ValueError("Expected a schema without fields marked 'inferred' under strict: they were read "
                             "from the data outside epsilon.")
        if schema_inference == "data" and not _is_complete(schema, names):
            raise ValueError("Expected schema_inference='private' or a complete schema under strict: "
                             "schema_inference='data' reads the fields the schema leaves out outside epsilon.")
    return schema_inference, schema_share


def resolve_schema(data, epsilon: float, delta: Optional[float], key, schema, schema_inference: str,
                   schema_share: float, sampling: str, max_levels: int,
                   ledger=None) -> Tuple[Schema, Optional[PrivateSchema]]:
    """The complete schema of a fit and, where fields were read privately, their release.

    A :class:`PrivateSchema` (from :func:`infer_schema_private` with the fit's ε, δ and sampling) is
    used as it is; else the fields the schema leaves out are read privately with the key
    :func:`schema_key` of the fit's key (``schema_inference="private"``, finite ε), or from the
    data outside ε (``"data"``, or ε = inf: no privacy anyway)."""
    if isinstance(schema, PrivateSchema):
        _check_release(schema, data.shape[0], epsilon, delta, sampling, key)
        return schema.schema, (schema if schema.plan is not None else None)
    names = [c if isinstance(c, str) else str(c) for c in data.columns]
    if schema_inference == "private" and math.isfinite(epsilon) and not _is_complete(schema, names):
        private = infer_schema_private(data, epsilon, delta, rng_key=schema_key(key), schema=schema,
                                       sampling=sampling, share=schema_share, max_levels=max_levels, ledger=ledger)
        return private.schema, (private if private.plan is not None else None)
    return infer_schema(data, schema, max_levels=max_levels), None


def _check_release(private: PrivateSchema, num_records: int, epsilon: float, delta, sampling: str, key) -> None:
    """A given :class:`PrivateSchema` must have been planned for this fit's N, ε, δ and relation, and
    released with another key than the fit's (the fit's noise would repeat the schema's)."""
    plan = private.plan
    if plan is None:
        return
    from d3p.ledger import key_fingerprint

    if private.key is not None and private.key == key_fingerprint(key):
        raise ValueError("Expected rng_key to differ from the key the private schema was released with (the fit "
                         "would draw the same noise); pass d3p.twin._schema_private.schema_key(rng_key) to "
                         "infer_schema_private, as fit does.")
    from d3p.twin._schema_private import _sampler_relation

    delta = 1.0 / num_records**2 if delta is None else delta
    if (plan.epsilon, plan.delta, plan.relation) != (epsilon, delta, _sampler_relation(sampling)):
        raise ValueError(
            f"Expected the private schema to be released for this fit's epsilon={epsilon}, delta={delta:g} and "
            f"sampling={sampling!r}; it was planned for epsilon={plan.epsilon}, delta={plan.delta:g}, "
            f"relation={plan.relation}.")


# ------------------------------------------------------------------ the mixture's plan


class Plan(NamedTuple):
    """The public settings of a mixture fit and their accounting (no private value)."""

    num_records: int
    epsilon: float  # the target
    delta: float  # the target, which includes the overflow term and the schema's threshold
    delta_run: float  # what DPSVI.run accounts for: delta - overflow - the schema's threshold
    overflow: float  # probability that a Poisson batch overflows its padded size
    q: float  # the sampler's sampling probability
    num_steps: int
    sampling: str
    sampler: object
    relation: object
    sigma: float
    accountant: str
    run_kwargs: dict
    schema: Optional[SchemaPlan] = None  # a private schema release composed with the run

    def phases(self, sigma: Optional[float] = None) -> list:
        """The run's steps (at ``sigma``, default the plan's) and the schema's Gaussian part, as phases."""
        steps = [(self.sigma if sigma is None else sigma, self.q, self.num_steps)]
        return steps if self.schema is None else [(self.schema.phase_sigma(), 1.0, 1)] + steps

    def epsilon_of(self, sigma: Optional[float] = None) -> float:
        """ε of the whole release (schema and run) at ``delta_run``."""
        return accounting.compose_epsilon(self.phases(sigma), self.delta_run, sampler=self.sampler.name,
                                          relation=str(self.relation), accountant=self.accountant)


def privacy_plan(num_records: int, epsilon: float, delta, q: float, num_steps: int, sampling: str,
                 accountant: str, schema: Optional[SchemaPlan] = None) -> Plan:
    """The sampler, its accounting (:func:`d3p.accounting.accounting_for`) and σ calibrated to (ε, δ);
    with a private schema release, σ is the smallest for which the release and the run composed meet
    (ε, δ - δ_thr - overflow)."""
    N = num_records
    delta = _validate.open_unit("delta", 1.0 / N**2 if delta is None else delta)
    if sampling == "poisson":
        sampler = minibatch.PoissonSampler(N, q)
        run_kwargs = {"q": q, "sampling": "poisson"}
    else:
        batch_size = minibatch.q_to_batch_size(q, N)
        sampler = minibatch.FixedSizeSampler(N, batch_size)
        run_kwargs = {"batch_size": batch_size, "sampling": "fixed"}
    acc = accounting.accounting_for(sampler.name)
    overflow = acc.overflow_delta(N, sampler.q, sampler.max_batch_size, num_steps, epsilon)
    delta_run = delta - overflow - (schema.delta_threshold if schema is not None else 0.0)
    if not delta_run > 0.5 * delta:
        raise ValueError(
            f"Expected q to be small enough for Poisson sampling of N={N} records, got q={q}: the padded "
            f"batch ({sampler.max_batch_size} records) would overflow for a neighbouring data set with "
            f"probability {overflow:.3g} (added to delta={delta:g}). Use q=0.5 or less, or "
            "sampling='fixed'."
        )
    q_used = float(sampler.q)
    plan = Plan(N, epsilon, delta, delta_run, overflow, q_used, num_steps, sampling, sampler, acc.relation, 0.0,
                accountant, run_kwargs, schema)
    if math.isinf(epsilon):
        return plan
    sigma, _, _ = dputil.calibrate_sigma(epsilon, delta_run, q_used, num_steps, sampler=acc.sampler,
                                          relation=acc.relation, noise=acc.noise, accountant=accountant)
    if schema is not None:
        sigma, _, _ = dputil._bracketed_calibration(plan.epsilon_of, epsilon, sigma * 1.05, 1e-3, 1.001)
    return plan._replace(sigma=float(sigma))

