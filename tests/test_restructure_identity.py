# SPDX-License-Identifier: Apache-2.0
"""DPSVI's releases are the same, bit for bit, as those recorded before DPSVI
was split into modules.

``tests/_make_identity_values.py`` says what is computed (every gradient
strategy and formulation, adaptive clipping, discrete noise, Poisson and
fixed-size runs) and how the values in ``tests/data/restructure_identity.json``
were recorded. Moving code between modules changes no bit of the release;
a change of behaviour shows here as the first value that differs.

The bits depend on the versions of JAX, jaxlib, NumPyro and NumPy and on the
backend as well as on the code: where any of those differs from the recorded
environment the test is skipped, saying which. They depend on the processor
too (XLA compiles for the host's instruction set): on the recorded processor
every bit must agree; on another one each value must agree to within
:data:`ULPS` units in the last place of its array's largest value, which a
moved rounding step passes and any change of what is computed (another draw,
term, scale or clipping) fails by many orders of magnitude.
"""

import json

import numpy as np
import pytest

import _make_identity_values as values

pytestmark = pytest.mark.float32


#: How far, in units in the last place, a value may move on another processor.
ULPS = 16


def _recorded():
    """The recorded values, and whether they were recorded on this processor."""
    recorded = json.loads(values.DATA.read_text())
    now = values.environment()
    differ = {k: (v, now.get(k)) for k, v in recorded["environment"].items()
              if k != "cpu" and now.get(k) != v}
    if differ:
        pytest.skip(f"recorded in another environment (recorded, now): {differ}")
    return values.decode(recorded["values"]), recorded["environment"].get("cpu") == now["cpu"]


def _check(fast: bool):
    recorded, same_cpu = _recorded()
    recorded = {k: v for k, v in recorded.items() if k.startswith(values.prefix(fast))}
    got = values.compute(fast)
    assert sorted(got) == sorted(recorded)
    for name in sorted(recorded):
        want, have = recorded[name], got[name]
        assert (have.dtype, have.shape) == (want.dtype, want.shape), name
        assert _agree(want, have, same_cpu), \
            f"{name}: {have!r} != {want!r} (recorded{'' if same_cpu else f', within {ULPS} ulps'})"


def _agree(want: np.ndarray, have: np.ndarray, same_cpu: bool) -> bool:
    """Bit for bit on the recorded processor; within :data:`ULPS` of the array's scale on another."""
    if same_cpu or not np.issubdtype(want.dtype, np.floating):
        return have.tobytes() == want.tobytes()
    bound = ULPS * np.spacing(np.max(np.abs(want), initial=np.finfo(want.dtype).tiny))
    return bool(np.all(np.abs(have.astype(np.float64) - want) <= bound))


def test_another_processor_allows_a_moved_rounding_but_not_a_changed_value():
    want = np.array([49.546944, 27.96641, -0.0], np.float32)
    one_ulp = np.array([49.546944, np.nextafter(np.float32(27.96641), np.float32(30)), 0.0], np.float32)
    assert _agree(want, one_ulp, same_cpu=False)
    assert not _agree(want, one_ulp, same_cpu=True)
    assert not _agree(want, want * np.float32(1.0001), same_cpu=False)
    assert not _agree(want, want + np.float32([0, 0, 1e-3]), same_cpu=False)


@pytest.mark.slow
def test_releases_of_every_strategy_formulation_and_sampler_are_unchanged():
    """A covering subset, with the debugging PRNG suite (quick to compile)."""
    _check(fast=True)


@pytest.mark.manual
def test_releases_of_the_whole_product_with_chacha20_are_unchanged():
    """Every strategy times every formulation on every model, with ChaCha20
    (by hand: ``pytest -m manual``; five minutes, in no CI step)."""
    _check(fast=False)
