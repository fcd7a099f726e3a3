"""Tests of d3p.minibatch: every sampler loop is bounded, and a broken random source is never a batch.

A PRNG suite whose ``random_bits`` returns one constant word never yields B
distinct indices (or, for a rejected word, any index at all). The samplers
must then stop instead of hanging, raise where called with concrete values,
and never hand out a batch that is not of their distribution (traced, the
batch is empty with out-of-range indices). The runs with a broken suite happen in a
subprocess with a timeout, so that a regression fails the test instead of
hanging the test run.
"""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from d3p import minibatch
from d3p.minibatch import LOOP_FAILURE_PROBABILITY, SamplingError

from _two_steps import marked_slow, outcome_of_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BROKEN_SCRIPT = textwrap.dedent(r'''
    import json, sys, types, warnings
    warnings.simplefilter("ignore")
    import jax, jax.numpy as jnp, numpy as np, numpyro
    from numpyro.infer import Trace_ELBO
    from numpyro.infer.autoguide import AutoDelta
    import d3p.random.debug as base
    from d3p import minibatch
    from d3p.svi import DPSVI

    def broken(word):
        """d3p.random.debug, except that random_bits always returns ``word``."""
        suite = types.ModuleType(f"broken_{word}")
        for name in ("PRNGKey", "split", "fold_in", "uniform", "normal", "randint", "convert_to_jax_rng_key"):
            setattr(suite, name, getattr(base, name))
        suite.random_bits = lambda key, bit_width=32, shape=(): jnp.full(shape, word, jnp.uint32)
        return suite

    ACCEPTED, REJECTED = broken(0x9E3779B9), broken(0)  # for N = 3, word 0 is always rejected
    key = base.PRNGKey(0)
    data = np.arange(10.0)

    def model(x, N=10):
        mu = numpyro.sample("mu", numpyro.distributions.Normal(0.0, 10.0))
        with numpyro.plate("data", N, subsample_size=x.shape[0]):
            numpyro.sample("x", numpyro.distributions.Normal(mu, 1.0), obs=x)

    def run(suite, init_state):
        svi = DPSVI(model, AutoDelta(model), numpyro.optim.SGD(1e-3), Trace_ELBO(), clipping_threshold=1.0,
                    dp_scale=1.0, rng_suite=suite, N=10)
        state = svi.init(key, data[:3]) if init_state else None
        svi.run(key, 2, data, batch_size=3, sampling="fixed", progress_bar=False, init_state=state)

    def run_in_jit_vmap(suite):
        # as the examples run their seeds: the whole run under jit(vmap(...))
        svi = DPSVI(model, AutoDelta(model), numpyro.optim.SGD(1e-3), Trace_ELBO(), clipping_threshold=1.0,
                    dp_scale=1.0, rng_suite=suite, N=10)
        one = lambda k: svi.run(k, 2, data, batch_size=3, sampling="fixed", progress_bar=False).losses
        return jax.jit(jax.vmap(one))(jnp.stack([key, key]))

    def scan_in_vmap(sampler, suite):
        # per lane: (records in the batches, smallest index drawn)
        def one(k):
            def step(c, t):
                indices, mask = sampler.sample(suite.fold_in(k, t), suite)
                return (c[0] + mask.sum(), jnp.minimum(c[1], indices.min())), None
            return lax.scan(step, (0, 2**31 - 1), jnp.arange(3, dtype=jnp.uint32))[0]
        return jax.jit(jax.vmap(one))(jnp.stack([key, key]))

    def get_batch(batchify, traced):
        init, get = batchify
        _, state = init(key)
        return jax.jit(get)(1, state) if traced else get(1, state)

    from jax import lax
    fixed, poisson, replace = minibatch.FixedSizeSampler(10, 3), minibatch.PoissonSampler(10, 0.5), \
        minibatch.WithReplacementSampler(3, 3)
    cases = {
        "fixed": lambda: fixed.sample(key, ACCEPTED),
        "fixed_rejected": lambda: fixed.sample(key, broken(0xFFFFFFFF)),
        "poisson": lambda: poisson.sample(key, ACCEPTED),
        "with_replacement": lambda: replace.sample(key, REJECTED),
        "fixed_jit": lambda: jax.jit(lambda k: fixed.sample(k, ACCEPTED))(key),
        "poisson_jit_vmap": lambda: jax.jit(jax.vmap(lambda i: poisson.sample(ACCEPTED.fold_in(key, i), ACCEPTED)))(
            jnp.arange(4, dtype=jnp.uint32)),
        "with_replacement_jit": lambda: jax.jit(lambda k: replace.sample(k, REJECTED))(key),
        "scan_in_vmap": lambda: scan_in_vmap(fixed, ACCEPTED),
        "get_batch": lambda: get_batch(minibatch.subsample_batchify_data(data, 3, rng_suite=ACCEPTED), False),
        "get_batch_jit": lambda: get_batch(minibatch.subsample_batchify_data(data, 3, rng_suite=ACCEPTED), True),
        "poisson_get_batch": lambda: get_batch(minibatch.poisson_batchify_data(data, 0.5, rng_suite=ACCEPTED), False),
        "dpsvi_run": lambda: run(ACCEPTED, init_state=False),
        "dpsvi_run_traced": lambda: run(ACCEPTED, init_state=True),
        "dpsvi_run_jit_vmap": lambda: run_in_jit_vmap(ACCEPTED),
        "dpsvi_run_jit_vmap_works": lambda: run_in_jit_vmap(base),
        # the batch a failed draw would stand for: empty, with out-of-range indices
        "failed_batch": lambda: [np.asarray(a).tolist() for a in
                                 minibatch._sample_jit(fixed, key, ACCEPTED)],
        # Feistel cycle-walking ends whatever the round functions (a permutation is a permutation)
        "feistel": lambda: sorted(np.asarray(minibatch.feistel_permutation(
            key, jnp.arange(10), 10, rng_suite=ACCEPTED)).tolist()),
    }
    VALUES = ("failed_batch", "feistel", "fixed_jit", "poisson_jit_vmap", "with_replacement_jit", "scan_in_vmap",
              "get_batch_jit")
    out = {}
    for name in json.loads(sys.argv[1]):
        case = cases[name]
        try:
            value = case()
            jax.block_until_ready(value)
            out[name] = {"raised": None, "value": jax.tree.map(lambda a: np.asarray(a).tolist(), value)
                         if name in VALUES else None}
        except Exception as e:
            out[name] = {"raised": type(e).__name__, "message": str(e)}
    print("RESULT" + json.dumps(out))
''')


# the DPSVI runs that compile most run in the slow step (in a second subprocess);
# the default step keeps DPSVI.run's own check and every sampler-level case
# (jit, vmap, scan in vmap: how DPSVI draws its batches)
SLOW_CASES = ["dpsvi_run_traced", "dpsvi_run_jit_vmap", "dpsvi_run_jit_vmap_works"]


def _run_broken(cases):
    proc = subprocess.run([sys.executable, "-c", BROKEN_SCRIPT, json.dumps(cases)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT"):])


@pytest.fixture(scope="module")
def broken_runs():
    return _run_broken([
        "fixed", "fixed_rejected", "poisson", "with_replacement", "fixed_jit", "poisson_jit_vmap",
        "with_replacement_jit", "scan_in_vmap", "get_batch", "get_batch_jit", "poisson_get_batch", "dpsvi_run",
        "failed_batch", "feistel",
    ])


@pytest.fixture(scope="module")
def broken_runs_slow():
    return _run_broken(SLOW_CASES)


@pytest.fixture
def result(request):
    """The outcome of the test's ``case`` in the subprocess of its step."""
    return outcome_of_step(request, "case", SLOW_CASES, "broken_runs", "broken_runs_slow")


def cases(*names):
    return marked_slow(names, SLOW_CASES)


# DPSVI.run draws its batches inside its compiled steps and checks them after
# each compiled chunk (not with a host call in every step): it raises too
@pytest.mark.parametrize("case", cases("fixed", "fixed_rejected", "poisson", "with_replacement", "get_batch",
                                       "poisson_get_batch", "dpsvi_run", "dpsvi_run_traced"))
def test_broken_random_source_raises_at_the_python_boundary(result, case):
    assert result["raised"] == "SamplingError", result
    assert "iteration bound" in result["message"] and "broken" in result["message"]


SENTINEL = 2**31 - 1


@pytest.mark.parametrize("case", ["fixed_jit", "poisson_jit_vmap", "with_replacement_jit"])
def test_broken_random_source_gives_a_traced_sample_an_empty_batch(result, case):
    # no host callback in a compiled draw: the failed batch is empty, every index out of range
    assert result["raised"] is None, result
    indices, mask = (np.asarray(a) for a in result["value"])
    assert indices.size and (indices == SENTINEL).all() and not mask.any()


def test_broken_random_source_in_a_scan_in_vmap_gives_empty_batches(broken_runs):
    result = broken_runs["scan_in_vmap"]
    assert result["raised"] is None, result
    records, smallest = result["value"]
    assert records == [0, 0] and smallest == [SENTINEL, SENTINEL]


def test_broken_random_source_gives_a_traced_get_batch_fill_values(broken_runs):
    # the out-of-range indices gather NaN records: never a real record in place of a batch
    result = broken_runs["get_batch_jit"]
    assert result["raised"] is None, result
    assert len(result["value"]) == 3 and all(v != v for v in result["value"])


@pytest.mark.parametrize("case", cases("dpsvi_run_jit_vmap"))
def test_broken_random_source_fails_a_traced_run(result, case):
    assert result["raised"] == "JaxRuntimeError", result
    assert "SamplingError" in result["message"] and "iteration bound" in result["message"]


@pytest.mark.parametrize("case", cases("dpsvi_run_jit_vmap_works"))
def test_a_traced_run_with_a_working_source_runs(result, case):
    assert result["raised"] is None, result


def test_a_failed_draw_is_an_empty_batch(broken_runs):
    result = broken_runs["failed_batch"]
    assert result["raised"] is None, result
    indices, mask, ok = result["value"]
    assert ok is False and not any(mask) and indices == [2**31 - 1] * 3


def test_feistel_cycle_walking_ends_with_any_round_function(broken_runs):
    assert broken_runs["feistel"] == {"raised": None, "value": list(range(10))}


# ----------------------------------------------------------------------------
# the iteration bounds


def _tail_after(num, n, draws):
    """Exact P(fewer than ``num`` distinct accepted values after ``draws`` words) for _distinct_uniform."""
    a = minibatch._acceptance_probability(n)
    p = np.zeros(num + 1)
    p[0] = 1.0
    step = np.array([a * (n - j) / n for j in range(num)])
    for _ in range(draws):
        moved = p[:num] * step
        p[:num] -= moved
        p[1:] += moved
    return p[:num].sum()


@pytest.mark.parametrize("num_records,num", [(1, 1), (2, 2), (3, 1), (5, 5), (10, 3), (10, 10), (50, 50),
                                             (200, 20), (3, 3), (7, 6)])
def test_distinct_uniform_bound_has_the_stated_failure_probability(num_records, num):
    block = minibatch._draw_block_size(num, num_records)
    t = minibatch._distinct_uniform_max_iterations(num, num_records, block)
    assert _tail_after(num, num_records, t * block) <= LOOP_FAILURE_PROBABILITY
    assert t <= 40  # the bound costs nothing: the loop ends as soon as the batch is complete


@pytest.mark.parametrize("num_records,num", [(10, 3), (5, 2), (17, 3), (200, 20), (1000, 10), (500, 100),
                                             (100, 29), (2000, 400)])
def test_single_pass_has_the_stated_failure_probability(num_records, num):
    # where N is well above B the sampler draws one block of candidates, no loop
    draws = minibatch._single_pass_draws(num, num_records)
    assert draws is not None
    assert _tail_after(num, num_records, draws) <= LOOP_FAILURE_PROBABILITY
    # power: a block of the expected number of words fails far more often
    a = minibatch._acceptance_probability(num_records)
    mean = sum(num_records / (a * (num_records - j)) for j in range(num))
    assert _tail_after(num, num_records, int(np.ceil(mean))) > 1e-3


def test_single_pass_only_where_it_is_cheap():
    # N close to B (coupon collecting): the loop's blocks, not one huge pass
    for num_records, num in [(50, 50), (4, 4), (10**6, 10**6), (1000, 990)]:
        assert minibatch._single_pass_draws(num, num_records) is None
    # N far above B: about B words, not many more
    draws = minibatch._single_pass_draws(1024, 10**6)
    assert 1024 < draws < 1.4 * 1024


@pytest.mark.parametrize("num_records,num", [(1, 1), (3, 3), (10, 10), (1000, 1000), (10**6, 10**6),
                                             (2**31 - 1, 1), (2**31 - 1, 10**5), (2**30 + 1, 2**20)])
def test_bounds_are_small_everywhere(num_records, num):
    block = minibatch._draw_block_size(num, num_records)
    assert 1 <= minibatch._distinct_uniform_max_iterations(num, num_records, block) <= 40
    t = minibatch._uniform_indices_max_iterations(num, num_records)
    reject = 1.0 - minibatch._acceptance_probability(num_records)
    assert num * reject**t <= LOOP_FAILURE_PROBABILITY and t <= 100


# ----------------------------------------------------------------------------
# the check itself, on flags


def test_require_raises_at_the_python_boundary_for_concrete_flags():
    assert minibatch._require(jnp.bool_(True), 7, "msg") == 7
    with pytest.raises(SamplingError, match="msg"):
        minibatch._require(jnp.bool_(False), 7, "msg")


@pytest.mark.parametrize("transform", ["jit", "vmap", "vmap_vmap", "scan", "vmap_scan"])
def test_require_in_a_traced_computation(transform):
    """Fails iff some flag is False, under every transformation (a vmapped cond must not
    run its failure branch for a batch that is all True)."""

    def f(ok):
        return minibatch._require(ok, jnp.where(ok, 1, 0), "sampler broken")

    fns = {
        "jit": jax.jit(f),
        "vmap": jax.jit(jax.vmap(f)),
        "vmap_vmap": jax.jit(jax.vmap(jax.vmap(f))),
        "scan": jax.jit(lambda oks: lax.scan(lambda c, ok: (c + f(ok), None), 0, oks)[0]),
        "vmap_scan": jax.jit(jax.vmap(lambda oks: lax.scan(lambda c, ok: (c + f(ok), None), 0, oks)[0])),
    }
    shape = {"jit": (), "vmap": (4,), "vmap_vmap": (2, 3), "scan": (4,), "vmap_scan": (2, 3)}[transform]
    fn = fns[transform]
    good = jnp.ones(shape, bool)
    jax.block_until_ready(fn(good))
    bad = good.at[(0,) * len(shape)].set(False) if shape else jnp.bool_(False)
    with pytest.raises(jax.errors.JaxRuntimeError, match="sampler broken"):
        jax.block_until_ready(fn(bad))
