"""Test parameters whose outcomes are computed in one module fixture per CI step.

Some modules compute the outcomes of many parametrised tests at once (a
subprocess, one compiled program): one fixture for the default step and
another for the cases of the slow step. These helpers mark a test's
parameters slow where their outcome comes from the slow fixture, and hand a
test the outcome of its own parameter from the fixture of its step.
"""

import pytest


def marked_slow(names, slow):
    """``names`` as pytest parameters, marked slow where they are in ``slow``."""
    return [pytest.param(n, marks=pytest.mark.slow) if n in slow else n for n in names]


def outcome_of_step(request, param, slow, fixture, slow_fixture):
    """The outcome of the test's parameter ``param``: from the module fixture
    ``slow_fixture`` where the parameter is in ``slow``, else from ``fixture``."""
    name = request.node.callspec.params[param]
    return request.getfixturevalue(slow_fixture if name in slow else fixture)[name]
