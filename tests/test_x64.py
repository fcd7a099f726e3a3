"""The samplers, DPSVI's steps in compiled loops and DPSVI.run under 64-bit
JAX (jax_enable_x64, as twinify sets it).

Runs in subprocesses, since x64 is a process-wide flag."""

import os
import subprocess
import sys

import pytest

#: The start of both scripts: a model of one normal mean and its DPSVI.
MODEL = """
import jax, jax.numpy as jnp, numpy as np, numpyro, numpyro.distributions as dist
from jax import lax
from numpyro.infer import Trace_ELBO
from numpyro.infer.autoguide import AutoDiagonalNormal
import d3p.random
from d3p.minibatch import poisson_batchify_data, subsample_batchify_data
from d3p.svi import DPSVI

def model(xs, N):
    mu = numpyro.sample("mu", dist.Normal(0, 10))
    with numpyro.plate("data", N, subsample_size=xs.shape[0]):
        numpyro.sample("x", dist.Normal(mu, 1), obs=xs)

svi = DPSVI(model, AutoDiagonalNormal(model), numpyro.optim.Adam(0.05), Trace_ELBO(),
            clipping_threshold=2.0, dp_scale=1.0, N=100)
"""

SCRIPT = MODEL + """
x = np.arange(100.0)
init, get = subsample_batchify_data((x,), batch_size=10)
(batch,) = get(0, init(d3p.random.PRNGKey(0))[1])
assert batch.shape == (10,) and len(set(np.asarray(batch).tolist())) == 10
init, get = poisson_batchify_data((x,), 0.1, 30)
(batch,), mask = get(0, init(d3p.random.PRNGKey(0))[1])
assert batch.shape == mask.shape == (30,)

for kw in (dict(batch_size=10), dict(batch_size=10, sampling="fixed")):
    r = svi.run(d3p.random.PRNGKey(0), 20, jnp.asarray(x), progress_bar=False, **kw)
    assert np.isfinite(r.epsilon) and r.params["auto_loc"].dtype == jnp.float64
print("ok")
"""

LOOP_SCRIPT = MODEL + """
batch = jnp.arange(10.0)
state = svi.init(d3p.random.PRNGKey(0), batch)
assert state.observation_scale.dtype == jnp.float64, state.observation_scale.dtype
final = jax.jit(lambda s: lax.fori_loop(0, 3, lambda i, s: svi.update(s, batch)[0], s))(state)
final = lax.while_loop(lambda c: c[1] < 2, lambda c: (svi.stable_update(c[0], batch)[0], c[1] + 1),
                       (final, 0))[0]
assert final.observation_scale.dtype == jnp.float64 and float(final.observation_scale) == 100.0
assert jax.tree.structure(final) == jax.tree.structure(state)
assert svi.get_params(final)["auto_loc"].dtype == jnp.float64
print("ok")
"""


def _run_under_x64(script):
    env = dict(os.environ, JAX_ENABLE_X64="1", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


@pytest.mark.slow
def test_samplers_and_run_under_x64():
    _run_under_x64(SCRIPT)


@pytest.mark.slow
def test_init_then_update_in_loops_under_x64():
    """As test_svi_compat.py's test_init_then_update_in_loops, with jax_enable_x64."""
    _run_under_x64(LOOP_SCRIPT)


def test_the_x64_step_runs_the_listed_modules_for_their_reasons():
    """CI's fourth step runs, under 64-bit JAX, exactly the modules that
    ``tests/conftest.py`` lists as changing behaviour with the flag, each with
    a reason; the README's test command and .ci/run select them by marker."""
    import pathlib
    import re

    from conftest import X64_MODULES

    tests = pathlib.Path(__file__).resolve().parent
    for name, reason in X64_MODULES.items():
        assert (tests / name).is_file(), name
        assert len(reason.split()) >= 8, f"{name}: say why x64 changes what it tests"
    # the modules that force x64 themselves (subprocesses, jax.enable_x64) need not be listed;
    # a module that checks float64 results of d3p's dtype-dependent code should be
    for path in tests.glob("test_*.py"):
        if path.name == "test_x64.py":
            continue
        text = path.read_text()
        if re.search(r"_sum_margin|2 \*\* -30|2\*\*-30", text):
            assert path.name in X64_MODULES, f"{path.name} tests the float64 margin: list it in X64_MODULES"
    readme = (tests.parent / "README.md").read_text()
    ci = (tests.parent / ".ci" / "run").read_text()
    step = "JAX_ENABLE_X64=1 .venv/bin/python -m pytest -m \"x64 and not slow and not examples\""
    assert step in readme and step in ci


def test_a_check_run_by_hand_is_not_marked_x64():
    """The x64 step's marker expression replaces the default one, which
    leaves the ``manual`` checks out: a manual test of a listed module is not
    marked ``x64``, so that no CI step runs it."""
    import pathlib
    from types import SimpleNamespace

    import conftest
    from conftest import X64_MODULES

    path = pathlib.Path(__file__).resolve().parent / sorted(X64_MODULES)[0]

    def item(*marks):
        added = list(marks)
        return SimpleNamespace(fspath=path, add_marker=lambda m: added.append(m.name), added=added,
                               get_closest_marker=lambda name: name if name in added else None)

    by_hand, other = item("manual"), item()
    conftest.pytest_collection_modifyitems(None, [by_hand, other])
    assert by_hand.added == ["manual"] and other.added == ["x64"]
