"""The private step and the samplers as GPUs get them, checked without a GPU by
lowering for CUDA on the CPU: no loop in a DPSVI step but ChaCha20's loops
over its double rounds (each one double round: d3p.random), at most one
more in a sampler, and no host call; the programs for CPU keep their CPU code."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import pytest
from numpyro.infer import Trace_ELBO

import d3p.random
from d3p import minibatch
from d3p._paper_models import (
    hierarchical_logistic_regression_guide,
    hierarchical_logistic_regression_model,
    logistic_regression_guide,
    logistic_regression_model,
    make_vae,
)
from d3p.svi import DPSVI

from _lowered import lowered_text, other_loops, round_loops


def _logreg(rng, B=64):
    xs = rng.normal(size=(B, 30)).astype(np.float32)
    ys = (rng.random(B) < 0.5).astype(np.float32)
    dpsvi = DPSVI(logistic_regression_model, logistic_regression_guide, numpyro.optim.Adam(1e-3), Trace_ELBO(),
                  clipping_threshold=1.0, dp_scale=1.0, N=10_000)
    return dpsvi, (xs, ys)


def _hlogreg(rng, B=50):
    xs = rng.normal(size=(B, 5)).astype(np.float32)
    ys = (rng.random(B) < 0.5).astype(np.float32)
    ls = rng.integers(0, 3, B)
    gs = jnp.asarray(rng.normal(size=(3, 3)).astype(np.float32))
    dpsvi = DPSVI(hierarchical_logistic_regression_model, hierarchical_logistic_regression_guide,
                  numpyro.optim.Adam(1e-3), Trace_ELBO(), clipping_threshold=1.0, dp_scale=1.0, N=500, gs=gs)
    return dpsvi, (xs, ys, ls)


def _vae(rng, B=16):
    model, guide = make_vae(64, 32, 4)
    x = (rng.random((B, 64)) < 0.2).astype(np.float32)
    dpsvi = DPSVI(model, guide, numpyro.optim.Adam(1e-3), Trace_ELBO(), clipping_threshold=1.0, dp_scale=1.0,
                  N=1000)
    return dpsvi, (x,)


@pytest.mark.parametrize("make", [_logreg, _hlogreg, _vae], ids=["logreg", "hlogreg", "vae"])
def test_lowered_for_cuda_a_dpsvi_step_loops_over_double_rounds_only_and_has_no_host_call(make):
    dpsvi, batch = make(np.random.default_rng(0))
    state = dpsvi.init(d3p.random.PRNGKey(0), *batch)
    mask = jnp.arange(batch[0].shape[0]) < batch[0].shape[0] - 3

    def step(state, mask, *batch):
        return dpsvi.update(state, *batch, mask=mask)

    text = lowered_text(step, state, mask, *batch)
    assert other_loops(text) == 0
    # two block functions: the step's keys with its Monte Carlo keys (one call of
    # split_with_jax_keys, where split and convert_to_jax_rng_key took two), and the noise
    assert round_loops(text) == 2
    assert "callback" not in text
    # power: the CPU program of the same step has other loops (few blocks one at a time)
    assert other_loops(lowered_text(step, state, mask, *batch, platform="cpu")) >= 1


def test_an_explicit_loop_strategy_keeps_its_loop_on_cuda():
    # the check above sees loops where there are some: "scan" is one record per iteration
    dpsvi, batch = _logreg(np.random.default_rng(1), B=8)
    dpsvi.gradient_strategy = "scan"
    state = dpsvi.init(d3p.random.PRNGKey(0), *batch)
    assert other_loops(lowered_text(lambda s, *b: dpsvi.update(s, *b), state, *batch)) == 1


@pytest.mark.parametrize("sampler,loops", [
    (minibatch.FixedSizeSampler(1_000_000, 1024), 0),
    (minibatch.PoissonSampler(1_000_000, 1024 / 1_000_000), 0),
    (minibatch.FixedSizeSampler(50, 50), 1),
], ids=["fixed", "poisson", "fixed-all"])
def test_lowered_for_cuda_a_sampler_has_at_most_one_loop(sampler, loops):
    # one pass of candidates where N is well above B, a loop of passes (coupon
    # collecting) where B is close to N; traced, a failed draw returns the batch
    # emptied, so the program holds no host callback
    key = d3p.random.PRNGKey(0)
    text = lowered_text(lambda k: sampler.sample(k), key)
    assert other_loops(text) == loops
    assert "callback" not in text
    # all of a batch's words from one block function (d3p.random.stream_words; a Poisson
    # batch's count and candidates together), where a split and a key per block took four or five
    assert round_loops(text) == 1


def test_lowered_for_cuda_a_run_chunk_loops_over_steps_and_batches_only():
    # run's compiled chunk: the scan over steps (its trip count is known, which
    # spares a GPU the copy of its predicate) and no other loop but ChaCha20's
    # over its double rounds; a broken random
    # source is reported after the chunk, not by a host call in every step
    dpsvi, batch = _logreg(np.random.default_rng(2), B=500)
    sampler = minibatch.PoissonSampler(500, 0.1)
    records = list(batch)
    treedef = jax.tree.structure(((0, 0), {}))
    _, run_chunk, _ = dpsvi._run_cache.steps(dpsvi.update, sampler, d3p.random, treedef, False)
    state = dpsvi.init(d3p.random.PRNGKey(0), *(x[:50] for x in batch))
    average = (dpsvi.optim.get_params(state.optim_state), jnp.zeros((), jnp.int32))   # run(average=...)'s mean
    text = jax.jit(run_chunk, static_argnums=6).trace(
        state, average, (d3p.random.PRNGKey(1), d3p.random.PRNGKey(2)), jnp.uint32(0), jnp.uint32(3), records, 5).lower(
        lowering_platforms=("cuda",)).as_text()
    assert other_loops(text) == 1
    assert "callback" not in text
