"""Every d3p call that twinify (the main downstream project) makes, made the way
twinify makes it: with ``jax_enable_x64`` on, a model taking ``num_obs_total``
as a keyword, ``init``/``update`` inside ``lax.fori_loop`` and
``lax.while_loop`` under ``jit``, batches from ``subsample_batchify_data``,
σ from ``approximate_sigma(..., maxeval=20)`` and the PRNG functions of
``d3p.random``.

x64 is a process-wide flag, so the calls run in one subprocess; each check
prints ``ok <name>`` and the tests below look for their line.
"""

import os
import subprocess
import sys
import textwrap

import pytest

# a whole program in a subprocess: CI's slow step
pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent(
    """
    import jax
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpy as np
    import numpyro
    import numpyro.distributions as dist
    from numpyro.infer import Trace_ELBO
    from numpyro.infer.autoguide import AutoDiagonalNormal

    import d3p.random
    import d3p.util
    from d3p.dputil import approximate_sigma
    from d3p.minibatch import batch_size_to_q, q_to_batch_size, subsample_batchify_data
    from d3p.svi import DPSVI

    import traceback

    def check(fn):
        # each check runs even if an earlier one failed; a failure is printed, not raised
        try:
            fn()
            print("ok", fn.__name__[6:], flush=True)
        except Exception:
            print("fail", fn.__name__[6:], flush=True)
            traceback.print_exc()
        return fn

    rng_suite = d3p.random
    num_data = np.int64(1000)
    data = np.asarray(np.random.default_rng(0).normal(1.5, 1.0, size=(int(num_data), 2)))
    run = {}

    @check
    def check_random():
        key = rng_suite.PRNGKey(1234)
        assert isinstance(key, jax.Array) and key.dtype == jnp.uint32
        assert rng_suite.PRNGState is not None
        k1, k2, k3 = rng_suite.split(key, 3)
        assert not np.array_equal(np.asarray(k1), np.asarray(k2))
        assert rng_suite.fold_in(key, np.int64(7)).shape == key.shape
        bits = rng_suite.random_bits(k1, 32, (5,))
        assert bits.shape == (5,) and bits.dtype == jnp.uint32
        z = rng_suite.normal(k2, (20000,))
        assert z.dtype == jnp.float64, z.dtype
        assert abs(float(z.mean())) < 0.03 and abs(float(z.std()) - 1) < 0.03
        jax.random.normal(rng_suite.convert_to_jax_rng_key(k3), (2,))

    @check
    def check_util():
        N, D = d3p.util.unvectorize_shape_2d(jnp.zeros((40, 3)))
        assert (N, D) == (40, 3)
        assert d3p.util.unvectorize_shape_2d(jnp.zeros(3)) == (1, 3)

    @check
    def check_q_and_batch_size():
        q = batch_size_to_q(np.int64(100), num_data)
        assert abs(q - 0.1) < 1e-12
        batch_size = q_to_batch_size(q, num_data)
        assert batch_size == 100 and isinstance(batch_size, int)

    @check
    def check_approximate_sigma():
        sigma = float(approximate_sigma(1.0, 1e-5, 0.1, 30, maxeval=20)[0])
        assert np.isfinite(sigma) and sigma > 0

    # a twinify-style model: num_obs_total as a keyword, plate over the batch
    def model(x=None, num_obs_total=None):
        mu = numpyro.sample("mu", dist.Normal(jnp.zeros(2), 10.0).to_event(1))
        with numpyro.plate("batch", num_obs_total, x.shape[0]):
            numpyro.sample("x", dist.Normal(mu, 1.0).to_event(1), obs=x)

    @check
    def check_init():
        svi = DPSVI(model, AutoDiagonalNormal(model), numpyro.optim.Adam(0.05), Trace_ELBO(),
                    num_obs_total=int(num_data), clipping_threshold=5.0, dp_scale=2.0,
                    rng_suite=rng_suite)
        rng, svi_rng, init_batch_rng = rng_suite.split(rng_suite.PRNGKey(0), 3)
        init_batching, get_batch = subsample_batchify_data((data,), 100, rng_suite=rng_suite)
        _, batchify_state = init_batching(init_batch_rng)
        svi_state = svi.init(svi_rng, *get_batch(0, batchify_state))
        run.update(svi=svi, rng=rng, init_batching=init_batching, get_batch=get_batch, state=svi_state)

    @check
    def check_fori_loop():
        svi, get_batch, init_batching = run["svi"], run["get_batch"], run["init_batching"]

        @jax.jit
        def train_epoch(num_epoch_iter, svi_state, batchify_state):
            def train_iteration(i, state_and_loss):
                svi_state, loss = state_and_loss
                batch = get_batch(i, batchify_state)
                svi_state, iter_loss = svi.update(svi_state, *batch)
                return (svi_state, loss + iter_loss / num_epoch_iter)
            return jax.lax.fori_loop(0, num_epoch_iter, train_iteration, (svi_state, 0.0))

        rng, epochs_rng = rng_suite.split(run["rng"])
        svi_state = run["state"]
        for e in range(3):
            num_batches, batchify_state = init_batching(rng_suite.fold_in(epochs_rng, e))
            svi_state, loss = train_epoch(num_batches, svi_state, batchify_state)
            assert np.isfinite(float(loss))
        params = svi.get_params(svi_state)
        assert params["auto_loc"].dtype == jnp.float64
        assert np.all(np.isfinite(np.asarray(params["auto_loc"])))
        run.update(state=svi_state, batchify_state=batchify_state)

    @check
    def check_while_loop():
        svi, get_batch = run["svi"], run["get_batch"]

        @jax.jit
        def train_while(svi_state, batchify_state):
            def body(carry):
                i, svi_state = carry
                svi_state, _ = svi.update(svi_state, *get_batch(i, batchify_state))
                return i + 1, svi_state
            return jax.lax.while_loop(lambda carry: carry[0] < 10, body, (0, svi_state))[1]

        params = svi.get_params(train_while(run["state"], run["batchify_state"]))
        assert params["auto_loc"].dtype == jnp.float64
        # 30 + 10 noisy steps from the guide's start at 0 move towards the data mean 1.5
        assert np.all(np.asarray(params["auto_loc"]) > 0.2), params["auto_loc"]
    """
)

CHECKS = ["random", "util", "q_and_batch_size", "approximate_sigma", "init", "fori_loop", "while_loop"]


@pytest.fixture(scope="module")
def twinify_run():
    env = dict(os.environ, JAX_ENABLE_X64="1", JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.parametrize("name", CHECKS)
def test_twinify_call(twinify_run, name):
    done = [line.split(" ", 1)[1] for line in twinify_run.stdout.splitlines() if line.startswith("ok ")]
    assert name in done, twinify_run.stderr[-4000:]


def test_twinify_run_exits_cleanly(twinify_run):
    assert twinify_run.returncode == 0, twinify_run.stderr[-4000:]
    assert "fail" not in twinify_run.stdout, twinify_run.stderr[-4000:]
