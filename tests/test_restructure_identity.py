# SPDX-License-Identifier: Apache-2.0
"""DPSVI's releases are the same, bit for bit, as those recorded before DPSVI
was split into modules.

``tests/_make_identity_values.py`` says what is computed (every gradient
strategy and formulation, adaptive clipping, discrete noise, Poisson and
fixed-size runs) and how the values in ``tests/data/restructure_identity.json``
were recorded. Moving code between modules changes no bit of the release;
a change of behaviour shows here as the first value that differs.

The bits depend on the versions of JAX, jaxlib, NumPyro and NumPy and on the
machine's backend and instruction set as well as on the code: where any of
those differs from the recorded environment the test is skipped, saying which.
"""

import json

import numpy as np
import pytest

import _make_identity_values as values

pytestmark = pytest.mark.float32


def _recorded():
    recorded = json.loads(values.DATA.read_text())
    now = values.environment()
    differ = {k: (v, now.get(k)) for k, v in recorded["environment"].items() if now.get(k) != v}
    if differ:
        pytest.skip(f"recorded in another environment (recorded, now): {differ}")
    return values.decode(recorded["values"])


def _check(fast: bool):
    recorded = {k: v for k, v in _recorded().items() if k.startswith(values.prefix(fast))}
    got = values.compute(fast)
    assert sorted(got) == sorted(recorded)
    for name in sorted(recorded):
        want, have = recorded[name], got[name]
        assert (have.dtype, have.shape) == (want.dtype, want.shape), name
        assert have.tobytes() == want.tobytes(), f"{name}: {have!r} != {want!r} (recorded)"


def test_releases_of_every_strategy_formulation_and_sampler_are_unchanged():
    """A covering subset, with the debugging PRNG suite (quick to compile)."""
    _check(fast=True)


@pytest.mark.slow
def test_releases_of_the_whole_product_with_chacha20_are_unchanged():
    """Every strategy times every formulation on every model, with ChaCha20."""
    _check(fast=False)
