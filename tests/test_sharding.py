"""DPSVI sharded over a device mesh (d3p._sharding).

The sharded step itself is checked on 8 CPU host devices in a subprocess
(``tests/multi_device/check_sharding.py``: the device count must be set before
JAX initialises), in CI's slow step; here, in the default step, on whatever devices this process has: the argument
checks, the cross-device term of the certified bound, and the refusal of a
step traced inside ``shard_map``.
"""

import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from numpyro.infer import Trace_ELBO

import d3p.random
from d3p import gradients
from d3p._paper_models import logistic_regression_guide as guide
from d3p._paper_models import logistic_regression_model as model
from d3p.svi import DPSVI

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHECKS = ROOT / "tests" / "multi_device" / "check_sharding.py"


def _host_devices_env(count: int = 8) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={count}").strip()
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _run_checks(marker: str):
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", str(CHECKS), "-m", marker],
        cwd=ROOT, env=_host_devices_env(), capture_output=True, text=True, timeout=1800,
    )
    assert proc.returncode == 0, f"{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]


@pytest.mark.slow
def test_sharded_step_on_eight_host_devices():
    """Equality with one device, bound, noise and sensitivity on 1 to 8
    devices, for a covering subset of paper model x strategy x device count x
    sampler: every strategy, model, device count and sampler (see the checks'
    module documentation; the other cells: the manual test below). In the
    slow step: the subprocess starts JAX again and compiles every program
    for 8 devices."""
    _run_checks("not manual")


@pytest.mark.manual
def test_sharded_step_whole_matrix_on_eight_host_devices():
    """The cells of the checks' matrices that CI leaves out (``manual`` there:
    the rest of model x strategy and model x sampler, the discrete runs on 1
    and 4 devices, the paper's batch sizes on 2 and 4 devices); by hand only."""
    _run_checks("manual")


def _data(B=6):
    rng = np.random.default_rng(0)
    return jnp.asarray(rng.normal(size=(B, 3)), jnp.float32), jnp.asarray(rng.random(B) < 0.5, jnp.float32)


def _svi(**kw):
    # own_sample: what "auto" is over a mesh, by name, so that the one-device step compared is the same
    return DPSVI(model, guide, numpyro.optim.Adam(0.1), Trace_ELBO(), 1.0, 1.0, N=100,
                 **{"formulation": "own_sample", **kw})


def _one_device_mesh(axis_type=AxisType.Explicit, name="batch"):
    return jax.make_mesh((1,), (name,), axis_types=(axis_type,), devices=jax.devices()[:1])


@pytest.mark.parametrize("kw, error, match", [
    ({"mesh": "batch"}, TypeError, r"Expected mesh to be a jax\.sharding\.Mesh .* got mesh='batch'"),
    ({"mesh": "mesh", "batch_axis": "data"}, ValueError,
     r"Expected batch_axis to be an axis name of mesh .*\('batch',\).* got batch_axis='data'"),
    ({"mesh": "mesh", "batch_axis": ("batch", "batch")}, ValueError, r"got batch_axis=\('batch', 'batch'\)"),
    ({"mesh": "mesh", "batch_axis": 3}, TypeError, r"got batch_axis=3"),
])
def test_mesh_arguments_are_checked(kw, error, match):
    kw = {k: _one_device_mesh() if v == "mesh" else v for k, v in kw.items()}
    with pytest.raises(error, match=match):
        _svi(**kw)


def test_batch_axis_is_checked_against_the_mesh_in_context():
    xs, ys = _data()
    svi = _svi(batch_axis="data")
    with pytest.raises(ValueError, match=r"Expected a mesh for batch_axis='data'"):
        svi.init(d3p.random.PRNGKey(0), xs, ys)
    with jax.set_mesh(_one_device_mesh()):
        with pytest.raises(ValueError, match=r"batch_axis to be an axis name of the mesh in context"):
            svi.init(d3p.random.PRNGKey(0), xs, ys)


@pytest.mark.float32
@pytest.mark.slow
def test_one_device_mesh_gives_the_one_device_step():
    """A mesh of one device (all the sharding machinery, one shard) gives the
    step without a mesh, and the state comes back replicated on the mesh."""
    xs, ys = _data()
    results = []
    for kw in [{}, {"mesh": _one_device_mesh()}]:
        svi = _svi(**kw)
        state = svi.init(d3p.random.PRNGKey(0), xs, ys)
        state, _ = jax.jit(svi.update)(state, xs, ys, mask=jnp.arange(6) < 4, expected_batch_size=5.0)
        results.append(np.concatenate([np.ravel(x) for x in jax.tree.leaves(svi.get_params(state))]))
    np.testing.assert_allclose(results[1], results[0], rtol=1e-6, atol=1e-7)
    assert isinstance(jax.tree.leaves(state)[0].sharding, jax.sharding.NamedSharding)


def test_step_inside_shard_map_is_refused():
    """Inside shard_map every device would add its own noise to its own part of the sum."""
    xs, ys = _data()
    svi = _svi()
    state = svi.init(d3p.random.PRNGKey(0), xs, ys)
    mesh = _one_device_mesh(AxisType.Auto, "d")
    step = jax.shard_map(lambda s, x, y: svi.update(s, x, y)[1], mesh=mesh, in_specs=(P(), P("d"), P("d")),
                         out_specs=P(), check_vma=False)
    with pytest.raises(ValueError, match=r"Expected DPSVI's step outside shard_map.*axes \('d',\)"):
        step(state, xs, ys)


def test_sum_budget_covers_the_whole_batch_of_all_shards():
    """A shard's error bound is that of all ``D`` shards' slots, with the
    cross-device tree and each device's extra rounding: larger than one
    device's for the same slots, with the same margin."""
    params = {"w": jnp.zeros(3, jnp.float32)}
    one = gradients._sum_budget(1024, 1024, 1, params)
    eight = gradients._sum_budget(128, 128, 8, params)
    assert eight.slots == one.slots == 1024
    assert eight.rel > one.rel and eight.margin == one.margin and eight.tiny == one.tiny
    with pytest.raises(ValueError, match=r"got batch size B=65536 \(8 devices of 8192\)"):
        gradients._sum_budget(8192, 8192, 8, params)


def test_num_shards_changes_no_bound_and_no_clipped_record():
    """Every record is clipped to the same threshold whatever the number of
    shards the sum is added to, for every strategy (the rounding of the
    cross-shard sum is inside the margin)."""
    rng = np.random.default_rng(3)
    params = {"W": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32)}
    records = (jnp.asarray(rng.normal(size=(5, 3)) * 3, jnp.float32),)

    def loss(p, r):
        return jnp.sum(jnp.tanh(r[0] @ p["W"]))

    # every strategy and shard count in one compiled program (op by op costs more)
    all_outs = jax.jit(lambda p, r: {strategy: [
        gradients.clipped_grad_sum(loss, p, r, None, 1.0, strategy=strategy, chunk_size=2, num_shards=k)
        for k in (1, 2, 2**12)] for strategy in ["vmap", "chunked", "ghost"]})(params, records)
    for strategy, outs in all_outs.items():
        for out in outs[1:]:
            np.testing.assert_array_equal(np.asarray(out.norms), np.asarray(outs[0].norms))
            # ghost's products may contract fewer rows each for more shards: a rounding apart
            np.testing.assert_allclose(np.asarray(out.grad_sum["W"]), np.asarray(outs[0].grad_sum["W"]),
                                       rtol=0 if strategy != "ghost" else 1e-6, atol=0)
        assert np.any(np.asarray(outs[0].norms) > 1.0)
    with pytest.raises(ValueError, match=r"got batch size B=81920"):
        gradients.clipped_grad_sum(loss, params, records, None, 1.0, num_shards=2**14)
    with pytest.raises(ValueError, match=r"Expected num_shards to be an integer >= 1, got num_shards=0"):
        gradients.clipped_grad_sum(loss, params, records, None, 1.0, num_shards=0)


# ---------------------------------------------------------------------------
# several processes (jax.distributed over localhost): examples/multi_host.py
# ---------------------------------------------------------------------------

EXAMPLE = ROOT / "examples" / "multi_host.py"


def _example(*args, timeout=900):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    return subprocess.run([sys.executable, str(EXAMPLE), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_multi_host_example_two_processes_agree_with_one_device(tmp_path):
    """Two processes of two CPU devices each: both end with the same parameters
    (bit for bit), and those of the one-device run with the same seed (up to
    rounding)."""
    proc = _example("--quick", "--output-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    prints = re.findall(r"parameter fingerprint ([0-9a-f]{16})", proc.stdout)
    assert len(prints) == 2 and prints[0] == prints[1], proc.stdout
    assert "2 processes, 4 devices (cpu)" in proc.stdout and "ε spent=" in proc.stdout
    assert (tmp_path / "multi_host_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import multi_host

        # the same fit in this process: a mesh of its one device
        result, _, _ = multi_host.fit(multi_host.parse_args(["--quick"]), jax)
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    sharded = np.load(tmp_path / "multi_host_params.npz")
    for k, v in result.params.items():
        v = np.asarray(v, np.float64)
        assert np.max(np.abs(sharded[k] - v)) <= 1e-5 * np.max(np.abs(v)), k


@pytest.mark.slow
def test_multi_host_keys_that_differ_between_processes_are_refused():
    """Processes started with different seeds: run refuses, naming rng_key,
    before any batch is drawn (each would sample its own batches and add its own noise)."""
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        coordinator = f"localhost:{s.getsockname()[1]}"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    procs = [subprocess.Popen([sys.executable, str(EXAMPLE), "--quick", "--steps", "5", "--seed", str(i),
                               "--process-id", str(i), "--coordinator", coordinator],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outputs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode != 0
        assert "Expected rng_key to be the same in every process" in err, err[-3000:]
        assert "fingerprint" not in out
