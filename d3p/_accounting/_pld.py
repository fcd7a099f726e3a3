# SPDX-License-Identifier: Apache-2.0
"""Adapter to the privacy loss distribution (PLD) accountant of Google's
``dp-accounting`` package (optional dependency; pessimistic discretisation)."""

from typing import Sequence

from d3p._accounting._names import Relation


def _import_dp_accounting():
    """dp-accounting's PLD module and its ``NeighboringRelation``, or an
    ImportError that says how to install it."""
    try:
        from dp_accounting.pld import privacy_loss_distribution as pld
        from dp_accounting import privacy_accountant
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "accountant='pld' needs the optional dependency dp-accounting; "
            "install it with `pip install dp-accounting` (or `pip install d3p[tests]`), "
            "or use accountant='fourier'."
        ) from e
    return pld, privacy_accountant.NeighboringRelation


def pld_object(pair: str, phases: Sequence, value_discretization_interval: float = 1e-4):
    """The composed PLD of the phases for ``pair`` (dp-accounting's
    ``ADD_OR_REMOVE_ONE`` for the add/remove pair, ``REPLACE_ONE`` for the
    midpoint pair)."""
    pld, NR = _import_dp_accounting()
    nr = NR.ADD_OR_REMOVE_ONE if pair == Relation.ADD_REMOVE else NR.REPLACE_ONE
    total = None
    for p in phases:
        if p.num_steps == 0:
            continue
        one = pld.from_gaussian_mechanism(
            standard_deviation=p.sigma,
            sensitivity=1.0,
            sampling_prob=p.q,
            neighboring_relation=nr,
            value_discretization_interval=value_discretization_interval,
        ).self_compose(p.num_steps)
        total = one if total is None else total.compose(one)
    return total


def epsilon(pair: str, phases: Sequence, delta: float) -> float:
    """dp-accounting's ε at ``delta``."""
    return float(pld_object(pair, phases).get_epsilon_for_delta(delta))


def delta(pair: str, phases: Sequence, epsilon: float) -> float:
    """dp-accounting's δ at ``epsilon`` (at most 1)."""
    return float(min(1.0, pld_object(pair, phases).get_delta_for_epsilon(epsilon)))
