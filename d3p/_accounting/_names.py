# SPDX-License-Identifier: Apache-2.0
"""The neighbouring relations and batch samplers, as the engines name them:
defined in :mod:`d3p._sampling`, the description of samplers that both
:mod:`d3p.minibatch` and :mod:`d3p.accounting` build on."""

from d3p._sampling import Relation, Sampler

__all__ = ["Relation", "Sampler"]
