"""Shared test set-up."""

import gc

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


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
    """Drop JAX's compiled executables after each test module.

    Every compiled XLA:CPU executable keeps its own memory mappings; a whole
    suite in one process compiles thousands of them and, left cached, runs
    into the kernel's limit on mappings per process (``vm.max_map_count``,
    65530 by default), where the compiler crashes with a segmentation fault.
    Tests share no compiled state across modules, so clearing costs only the
    recompilation of functions that several modules use."""
    yield
    jax.clear_caches()
    gc.collect()
