"""Shared test set-up."""

import jax
import pytest


@pytest.fixture(autouse=True)
def _float32_checks(request):
    """Tests marked ``float32`` check float32 results (exact values of the
    float32 algorithms, doctest reprs, statistics at fixed seeds, 32-bit
    limits): they run with ``jax_enable_x64`` off, also in CI's x64 step,
    where every other test runs with it on."""
    if request.node.get_closest_marker("float32") is None:
        yield
        return
    with jax.enable_x64(False):
        yield
