"""Shared test set-up."""

import gc
import os
import pathlib
import sys

import jax
import pytest

#: Environment variables that turn on JAX's persistent compilation cache for
#: the test run; set in this process before anything compiles, and inherited
#: by the subprocesses that tests start (examples, the multi-device runs).
COMPILATION_CACHE_ENV = {
    "JAX_COMPILATION_CACHE_DIR": str(pathlib.Path(__file__).resolve().parent.parent
                                     / ".pytest_cache" / "jax-compilation-cache"),
    # a file lock shared by the workers comes with the size limit (filelock)
    "JAX_COMPILATION_CACHE_MAX_SIZE": str(2 << 30),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.25",
}


def _use_compilation_cache() -> None:
    """Keep compiled XLA programs on disk, shared by test modules, workers and CI's steps.

    Most of a test's CPU time is XLA compilation, and
    :func:`_release_compiled_code` drops the executables held in memory after
    every module. JAX's persistent cache stores each executable under a key of
    the program (its HLO), the backend, the JAX version and the flags, so the
    same program compiled by another module, worker or later pytest run is
    loaded instead of compiled again; what runs is the executable that
    compiling gives, so results are unchanged. It lives in
    ``.pytest_cache/jax-compilation-cache`` (at most 2 GiB, least recently
    used entries evicted); a ``JAX_COMPILATION_CACHE_DIR`` already set is
    used instead, and ``D3P_TEST_COMPILATION_CACHE=0`` turns it off."""
    if os.environ.get("D3P_TEST_COMPILATION_CACHE", "1") == "0":
        return
    for name, value in COMPILATION_CACHE_ENV.items():
        os.environ.setdefault(name, value)
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_compilation_cache_max_size", int(os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"]))
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))


_use_compilation_cache()

#: The mark expression of the default step (``addopts`` in ``pyproject.toml``).
DEFAULT_STEP_MARKEXPR = "not slow and not examples and not manual"

#: XLA:CPU's flag for the default step: kernels from XLA's earlier (non-MLIR)
#: fusion emitters, which compile in about two thirds of the time but run
#: step-heavy programs about a quarter slower (``benchmarks/emitters_compile.py``;
#: the figures in benchmarks/README.md).
LEGACY_EMITTERS_FLAG = "--xla_cpu_use_fusion_emitters=false"

#: The jaxlib releases whose XLA the flag was checked with; XLA stops the
#: process at a flag it does not know, so a later release, which may have
#: dropped the earlier emitters, compiles the default step as the others.
LEGACY_EMITTERS_JAXLIB = (0, 10)


def _jaxlib_release() -> tuple:
    import jaxlib

    return tuple(int(part) for part in jaxlib.__version__.split(".")[:2])


def default_step_codegen(markexpr: str, environ=os.environ) -> bool:
    """Whether this run compiles with :data:`LEGACY_EMITTERS_FLAG`: the
    default step only (its time is nearly all compiling), unless
    ``D3P_TEST_LEGACY_EMITTERS=0``. Every other step (the examples, the slow
    statistical runs, the modules under 64-bit JAX) compiles with XLA's
    default emitters, the code users run; the default step on the other
    emitters then checks, besides, that no claim depends on how XLA:CPU
    generates code (the certified sums and bounds are meant to hold for any
    order of rounding)."""
    return (markexpr == DEFAULT_STEP_MARKEXPR and environ.get("D3P_TEST_LEGACY_EMITTERS", "1") != "0"
            and _jaxlib_release() <= LEGACY_EMITTERS_JAXLIB)


def pytest_configure(config):
    """Set :data:`LEGACY_EMITTERS_FLAG` in ``XLA_FLAGS`` for the default step
    (:func:`default_step_codegen`), before anything starts a JAX backend (XLA
    reads its flags once, when the backend starts); the subprocesses of its
    tests inherit it."""
    if not default_step_codegen(config.option.markexpr):
        return
    from jax._src import xla_bridge
    if xla_bridge.backends_are_initialized():
        raise RuntimeError("a JAX backend started before tests/conftest.py could set XLA_FLAGS")
    flags = os.environ.get("XLA_FLAGS", "")
    if LEGACY_EMITTERS_FLAG not in flags.split():
        os.environ["XLA_FLAGS"] = f"{flags} {LEGACY_EMITTERS_FLAG}".strip()

#: The modules CI runs a second time under 64-bit JAX (``JAX_ENABLE_X64=1
#: pytest -m x64``, the fourth step), each with the reason: d3p's code takes
#: another path there, or twinify (which enables x64) depends on it. Every
#: other module tests code whose behaviour does not depend on the flag (pure
#: NumPy/SciPy accounting, argument checks, the command line, the docs) or
#: whose dtype-dependent parts one of these modules covers.
#: ``tests/test_x64.py`` checks this list against the tree and the CI command.
X64_MODULES = {
    "test_sum_sensitivity.py": "the certified sum's margin eta is 2**-30 when every dtype is float64 and 2**-7 "
                               "otherwise; the greedy neighbour search checks the bound at the float64 margin",
    "test_clipping_bound.py": "per-record clipping to C(1 - eta) and its certified norm bound at the float64 margin",
    "test_gradients.py": "clipping, norms and noise primitives with float64 gradients (noise dtype follows "
                         "the parameters)",
    "test_sharding.py": "the cross-device double-float sum and its budget at the float64 margin (the "
                        "multi-device subprocess inherits JAX_ENABLE_X64)",
    "test_svi_privacy.py": "a whole DP step (clip, sum, noise) with float64 parameters: released values and "
                           "their sensitivity",
    "test_neighbours.py": "neighbouring runs compared end to end under x64, as twinify runs d3p",
    "test_svi_init_public.py": "initialisation placeholders take the batch's dtypes, float64 and int64 under x64",
    "test_random.py": "uniform and normal default to float64 under x64, drawn from 64-bit words",
    "test_random_host_blocks.py": "key derivations on the host take fold_in's data as int64 under x64, "
                                  "and the run's keys with them",
    "test_random_threefry.py": "the conversion of ChaCha20 keys to JAX keys and 64-bit key data",
    "test_minibatch_bounds.py": "sampler indices and counts are int64 under x64 (index arithmetic near the "
                                "32-bit limits)",
    "test_discrete_mechanism.py": "discrete Gaussian noise and integer sums use int64 under x64",
    "test_svi_discrete.py": "DPSVI with the discrete mechanism: int64 quantised sums under x64",
    "test_twin_dtype.py": "the synthetic table's dtypes under x64 (twinify's setting)",
    "test_twin_marginal_rounding.py": "exact int64 counts and float64 noise of the marginal twin, with x64 on",
}


def pytest_collection_modifyitems(config, items):
    """Mark the tests of :data:`X64_MODULES` ``x64``, but for the checks run by
    hand (``manual``), which no CI step runs: the x64 step's marker expression
    replaces the default one that leaves them out."""
    for item in items:
        if pathlib.Path(str(item.fspath)).name in X64_MODULES and item.get_closest_marker("manual") is None:
            item.add_marker(pytest.mark.x64)


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


@pytest.fixture(autouse=True)
def _fresh_twin_setups():
    """Every test starts and ends without the DP-VI set-ups that ``d3p.twin.fit``
    keeps between fits (``d3p.twin._mixture_setups.SETUPS``): a test that
    spies on the step (or patches it) must trace its own fit."""
    def clear():
        setups = sys.modules.get("d3p.twin._mixture_setups")
        if setups is not None:
            setups.SETUPS.clear()

    clear()
    yield
    clear()   # and the module fixtures set up between tests find none either


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
