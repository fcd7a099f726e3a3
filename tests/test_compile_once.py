"""``run``'s compiled steps serve every ε: the noise's σ C is an argument of
the compiled program, not a constant (issue "Compile once"); so are C, a
Poisson sampler's q (with the same padded batch) and, on CPU, the number of
steps.

- A second run at another ε (or with another noise multiplier) compiles
  nothing: the jitted chunk's cache holds one program.
- The reused program applies the new σ: its release is bit for bit that of
  a fresh DPSVI run at that ε whose program holds σ as a constant, and
  differs from the first run's.
- The first run says that it compiles, before it does; a run that reuses the
  program says nothing of the kind.
- On CPU the number of steps is an argument too: runs of any length, with or
  without the progress bar, share one program and release what the programs
  with the length a constant (the path of accelerators) release.
- A program serves only the optimizer (and model, guide, loss, settings) it
  was traced with: ``svi.optim = ...`` between runs compiles anew.

The default step checks σ and C as arguments, the message and the
constants; the checks that compile several whole runs each (adaptive
clipping's C, q, the number of steps, a run inside a user's ``jit``,
another optimizer, the twin's fits) run in the slow step, also in CI.
"""

import logging

import jax
import numpy as np
import numpyro.optim
import pytest
from numpyro.infer import Trace_ELBO
from numpyro.infer.autoguide import AutoDiagonalNormal

import d3p.random
from d3p import _private_step, _run as run_module
from d3p.svi import DPSVI

from _backend import cpu_default, traced_programs
from _normal_mean import model as normal_mean_model, normal_mean_svi

N, T, B = 40, 6, 10
XS = np.linspace(0.0, 1.0, N).astype(np.float32)


def _chunks(svi):
    """The jitted chunk functions of ``svi``'s runs."""
    return [run_chunk for _, run_chunk in svi._run_cache._chunks.values()]


def _run(svi, epsilon, seed=3):
    return svi.run(d3p.random.PRNGKey(seed), T, XS, batch_size=B, epsilon=epsilon, delta=1e-4,
                   progress_bar=False)


def _leaves(result):
    return [np.asarray(x) for x in jax.tree.leaves((result.params, result.losses))]


def test_a_run_at_another_epsilon_reuses_the_compiled_steps_with_the_new_sigma(monkeypatch):
    svi = normal_mean_svi(clipping_threshold=1.0, N=N)
    first = _run(svi, 1.0)
    second = _run(svi, 4.0)
    (run_chunk,) = _chunks(svi)
    assert run_chunk._cache_size() == 1
    assert second.sigma < first.sigma / 2
    assert any(a.tobytes() != b.tobytes() for a, b in zip(_leaves(first), _leaves(second)))
    # the reference: a fresh DPSVI whose program holds σ as a constant (the
    # path of the discrete mechanism and of update); a σ stuck at the first
    # run's, or any other scale, differs from it. With C = 1 the noise's std
    # σ C is σ rounded to float32 either way: the same bits
    monkeypatch.setattr(_private_step, "traced_sigma", lambda svi, sigma: False)
    reference = _run(normal_mean_svi(clipping_threshold=1.0, N=N), 4.0)
    assert reference.sigma == second.sigma
    for a, b in zip(_leaves(second), _leaves(reference)):
        assert a.tobytes() == b.tobytes()


@pytest.mark.slow
def test_with_c_chosen_by_adaptive_clipping_a_run_at_another_epsilon_compiles_nothing(monkeypatch):
    # DPSVI without clipping_threshold: adaptive clipping, whose count's
    # noise is a share of σ's, computed from σ the argument
    svi = normal_mean_svi(N=N)
    first = _run(svi, 1.0)
    second = _run(svi, 4.0)
    (run_chunk,) = _chunks(svi)
    assert run_chunk._cache_size() == 1
    assert second.sigma < first.sigma / 2
    monkeypatch.setattr(_private_step, "traced_sigma", lambda svi, sigma: False)
    reference = _run(normal_mean_svi(N=N), 4.0)
    assert reference.sigma == second.sigma
    for a, b in zip(_leaves(second) + [np.asarray(second.state.clipping_threshold)],
                    _leaves(reference) + [np.asarray(reference.state.clipping_threshold)]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # and not the first run's σ: its releases differ from the reference's
    assert not np.allclose(np.asarray(first.state.clipping_threshold), np.asarray(reference.state.clipping_threshold),
                           rtol=1e-5) or any(not np.allclose(a, b, rtol=1e-5)
                                              for a, b in zip(_leaves(first), _leaves(reference)))


def test_the_first_run_says_it_compiles_and_a_reusing_run_does_not(caplog):
    svi = normal_mean_svi(clipping_threshold=1.0, N=N)
    with caplog.at_level(logging.INFO, logger="d3p"):
        _run(svi, 1.0)
        first = [r.getMessage() for r in caplog.records if "compiling" in r.getMessage()]
        caplog.clear()
        _run(svi, 2.0)
        second = [r.getMessage() for r in caplog.records if "compiling" in r.getMessage()]
    assert len(first) == 1 and "private step" in first[0]
    assert second == []


@pytest.mark.parametrize("settings", [dict(dp_scale=0.0, clipping_threshold=1.0),
                                      dict(noise="discrete", dp_scale=2.0, clipping_threshold=1.0)])
def test_sigma_stays_a_constant_where_the_program_depends_on_it(settings):
    # σ = 0 draws no noise at all, the discrete mechanism's plan depends on σ:
    # these keep σ in the program (and in the cache's key)
    svi = normal_mean_svi(N=N, **settings)
    svi.run(d3p.random.PRNGKey(0), 2, XS, batch_size=B, progress_bar=False)
    ((key, _),) = svi._run_cache._chunks.items()
    layout, sigma, clipping_threshold = key[-2]
    assert sigma == settings["dp_scale"]
    # the discrete mechanism's plan depends on C too
    assert clipping_threshold == (1.0 if settings.get("noise") == "discrete" else None)


@pytest.mark.slow
def test_a_twin_fit_at_another_epsilon_clipping_threshold_or_step_size_compiles_nothing():
    pd = pytest.importorskip("pandas")
    import d3p.twin as twin
    on_cpu = jax.default_backend() == "cpu"
    from d3p.twin import ColumnSpec, Schema, _mixture_setups

    rng = np.random.default_rng(0)
    df = pd.DataFrame({"x": rng.normal(size=60), "c": rng.choice(["a", "b"], 60).astype(object)})
    schema = Schema((ColumnSpec("x", "real", "float64", False, lower=-4.0, upper=4.0, distribution="normal"),
                     ColumnSpec("c", "categorical", "str", False, levels=("a", "b"), distribution="categorical")))

    def fit(epsilon, seed, clipping_threshold=1.0, learning_rate=0.05, num_steps=4):
        return twin.fit(df, epsilon, rng_key=d3p.random.PRNGKey(seed), schema=schema, family="mixture",
                        num_components=2, num_steps=num_steps, q=0.3, progress_bar=False,
                        clipping_threshold=clipping_threshold, learning_rate=learning_rate)

    _mixture_setups.SETUPS.clear()
    first, traced_first = traced_programs(lambda: fit(1.0, 0))
    second, traced_second = traced_programs(lambda: fit(4.0, 1))
    # another C too: the steps take it as an argument (test above)
    _, traced_third = traced_programs(lambda: fit(4.0, 2, clipping_threshold=0.5))
    assert traced_first > 0 and traced_second == 0 and traced_third == 0
    assert len(_mixture_setups.SETUPS) == 1
    # another step size and, on CPU, number of steps: arguments of the steps too
    other, traced_other = traced_programs(lambda: fit(4.0, 1, learning_rate=0.2, num_steps=6 if on_cpu else 4))
    assert traced_other == 0 and len(_mixture_setups.SETUPS) == 1
    _mixture_setups.SETUPS.clear()   # the reference: a set-up built for that step size
    reference = fit(4.0, 1, learning_rate=0.2, num_steps=6 if on_cpu else 4)
    for a, b in zip(jax.tree.leaves(other.params), jax.tree.leaves(reference.params)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    # and not the first step size's (nor its number of steps)
    assert all(not np.allclose(a, b, rtol=1e-3)
               for a, b in zip(jax.tree.leaves(other.params), jax.tree.leaves(second.params)))
    assert second.privacy["sigma"] < first.privacy["sigma"] / 2
    # the σ applied is the one reported: run sets the program's σ argument
    # from the DPSVI's (test above); a σ left at the first fit's is refused
    # by the fit's own check of the run against its plan
    assert any(np.asarray(a).tobytes() != np.asarray(b).tobytes()
               for a, b in zip(jax.tree.leaves(first.params), jax.tree.leaves(second.params)))


def test_a_run_at_another_clipping_threshold_reuses_the_compiled_steps_with_the_new_c(monkeypatch):
    # C set between runs (run checks it as the constructor does): the
    # steps take C as an argument, so the second run compiles nothing
    svi = normal_mean_svi(clipping_threshold=1.0, N=N)
    first = _run(svi, 1.0)
    svi.clipping_threshold = 0.05
    second = _run(svi, 1.0)
    (run_chunk,) = _chunks(svi)
    assert run_chunk._cache_size() == 1
    assert second.sigma == first.sigma
    # the reference: a fresh DPSVI made with C = 0.05 whose program holds C
    # as a constant; a C stuck at the first run's (a clip to 1 and noise of
    # std σ) differs from it
    monkeypatch.setattr(_private_step, "traced_threshold", lambda svi: False)
    reference = _run(normal_mean_svi(clipping_threshold=0.05, N=N), 1.0)
    for a, b in zip(_leaves(second), _leaves(reference)):
        np.testing.assert_array_equal(a, b)
    assert any(a.tobytes() != b.tobytes() for a, b in zip(_leaves(first), _leaves(second)))


def test_a_clipping_threshold_set_between_runs_is_checked():
    svi = normal_mean_svi(clipping_threshold=1.0, N=N)
    _run(svi, 1.0)   # the steps are traced here, with C = 1
    # C B must not overflow the sum (float32: below 3.4e38 / 8): checked at every run
    for bad, error in ((0.0, ValueError), (-1.0, ValueError), (float("inf"), ValueError), ("1", TypeError),
                       (1e37, ValueError)):
        svi.clipping_threshold = bad
        with pytest.raises(error, match="clipping_threshold"):
            _run(svi, 1.0)
    svi.clipping_threshold = 1e36   # C B = 1e37: accepted
    _run(svi, 1.0)


def _lengths_run(svi):
    """A run of 6 steps without the bar, then one of 3 with it (chunks of one
    step), continuing the first's state."""
    key = d3p.random.PRNGKey(5)
    first = svi.run(key, 6, XS, batch_size=B, progress_bar=False)
    return first, svi.run(key, 3, XS, batch_size=B, progress_bar=True, init_state=first.state, start_step=6)


@pytest.mark.slow
@cpu_default
def test_on_cpu_runs_of_any_number_of_steps_share_one_program(monkeypatch):
    monkeypatch.setattr(run_module, "_CHUNK_STEPS", 4)   # 6 steps without the bar: chunks of 4 and 2
    svi = normal_mean_svi(clipping_threshold=1.0, dp_scale=1.0, N=N)
    results = _lengths_run(svi)
    (run_chunk,) = _chunks(svi)
    assert run_chunk._cache_size() == 1
    assert [r.losses.shape for r in results] == [(6,), (3,)]
    # the reference: the length a constant of the program (one program per length)
    monkeypatch.setattr(run_module, "_steps_traced", lambda svi: False)
    reference_svi = normal_mean_svi(clipping_threshold=1.0, dp_scale=1.0, N=N)
    reference = _lengths_run(reference_svi)
    (reference_chunk,) = _chunks(reference_svi)
    assert reference_chunk._cache_size() == 2   # lengths 6 and 1
    for got, want in zip(results, reference):
        assert got.losses.dtype == want.losses.dtype
        for a, b in zip(_leaves(got) + jax.tree.leaves(got.state), _leaves(want) + jax.tree.leaves(want.state)):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert not np.isnan(np.asarray(results[0].losses)).any()   # no entry of the chunk's buffer beyond its steps


@pytest.mark.slow
@cpu_default
def test_a_run_inside_a_users_jit_slices_and_joins_its_chunks_as_outside(monkeypatch):
    # chunks of 4 and 2 steps: the second's losses sliced from its buffer, then joined; traced inside jit
    monkeypatch.setattr(run_module, "_CHUNK_STEPS", 4)
    svi = normal_mean_svi(clipping_threshold=1.0, dp_scale=1.0, N=N)
    key = d3p.random.PRNGKey(5)
    outside = svi.run(key, 6, XS, batch_size=B, progress_bar=False).losses
    inside = jax.jit(lambda k: svi.run(k, 6, XS, batch_size=B, progress_bar=False).losses)(key)
    assert outside.shape == inside.shape == (6,)
    np.testing.assert_allclose(np.asarray(inside), np.asarray(outside), rtol=1e-6)   # another program's fusions


@cpu_default
def test_the_number_of_steps_is_an_argument_on_cpu_only(monkeypatch):
    svi = normal_mean_svi(clipping_threshold=1.0, dp_scale=1.0, N=N)
    assert run_module._steps_traced(svi)   # JAX's default device here: a CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert not run_module._steps_traced(svi)


def _q_run(svi, q, seed=7):
    return svi.run(d3p.random.PRNGKey(seed), T, XS, q=q, progress_bar=False)


@pytest.mark.slow
def test_a_run_at_another_q_with_the_same_padded_batch_reuses_the_compiled_steps(monkeypatch):
    # Poisson batches: the count's table and q N are arguments of the
    # program, which depends only on N and the padded size
    svi = normal_mean_svi(clipping_threshold=1.0, dp_scale=1.0, N=N)
    first = _q_run(svi, 0.6)
    second = _q_run(svi, 0.45)
    (run_chunk,) = _chunks(svi)
    assert run_chunk._cache_size() == 1
    assert (first.q, second.q) == (0.6, 0.45)
    # the reference: fresh DPSVIs whose programs hold the count's table and
    # q N as constants (d3p's path before); the batches are drawn from the
    # same bits, the normalisation may round differently (one unit in the
    # last place of N / (q N) in float32)
    monkeypatch.setattr(run_module, "batch_arguments", lambda sampler: None)
    reference = _q_run(normal_mean_svi(clipping_threshold=1.0, dp_scale=1.0, N=N), 0.45)
    for a, b in zip(_leaves(second), _leaves(reference)):
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)
    # a program stuck at the first run's q (its table or its q N) would
    # release the first run's values: the same key, σ and C (every value moves
    # by far more than the tolerance above: the mean's by 7e-4 of itself)
    assert all(not np.allclose(a, b, rtol=1e-4) for a, b in zip(_leaves(first), _leaves(reference)))


def test_asking_for_another_epsilon_with_the_automatic_q_compiles_nothing(caplog):
    # without batch_size or q the automatic q of a small data set depends on
    # ε (its padded batch is the whole data set): the program serves both
    svi = normal_mean_svi(clipping_threshold=1.0, N=N)

    def traced_jits(epsilon):
        caplog.clear()
        with jax.log_compiles(), caplog.at_level(logging.WARNING, logger="jax"):
            result = svi.run(d3p.random.PRNGKey(1), T, XS, epsilon=epsilon, delta=1e-4, progress_bar=False)
        # the first batch's shapes (jax.eval_shape: traced, never compiled) are looked up at every run
        return result, [r.getMessage() for r in caplog.records
                        if r.getMessage().startswith("Finished tracing") and " gather " not in r.getMessage()]

    first, traced_first = traced_jits(1.0)
    second, traced_second = traced_jits(4.0)
    assert first.q != second.q
    assert any("run_chunk" in m or "_traced_length_chunk" in m for m in traced_first)
    assert traced_second == []
    (run_chunk,) = _chunks(svi)
    assert run_chunk._cache_size() == 1


@pytest.mark.slow
def test_a_run_after_the_optimizer_is_replaced_uses_the_new_optimizer():
    # the compiled steps hold the optimizer they were traced with: a run
    # after svi.optim = ... compiles its own (before, it silently reused the
    # first optimizer's program)
    svi = normal_mean_svi(clipping_threshold=1.0, dp_scale=1.0, N=N)
    first = _run_steps(svi)
    svi.optim = numpyro.optim.SGD(0.5)
    second = _run_steps(svi)
    reference = _run_steps(DPSVI(normal_mean_model, AutoDiagonalNormal(normal_mean_model), numpyro.optim.SGD(0.5),
                                 Trace_ELBO(), clipping_threshold=1.0, dp_scale=1.0, N=N))
    for a, b in zip(_leaves(second), _leaves(reference)):
        assert a.tobytes() == b.tobytes()
    assert any(a.tobytes() != b.tobytes() for a, b in zip(_leaves(first), _leaves(second)))
    assert len(_chunks(svi)) == 2
    # checked as the constructor checks it
    svi.optim = numpyro.optim.Minimize()
    with pytest.raises(ValueError, match="optim=Minimize"):
        _run_steps(svi)


@pytest.mark.slow
def test_replacing_the_optimizer_d3p_chose_makes_it_the_users():
    svi = DPSVI(normal_mean_model, AutoDiagonalNormal(normal_mean_model), loss=Trace_ELBO(),
                clipping_threshold=1.0, dp_scale=1.0, N=N)
    assert svi.optim_chosen
    svi.optim = numpyro.optim.Adam(0.01)
    assert not svi.optim_chosen
    assert _run_steps(svi).averaged_steps == 0   # no averaging: the user's optimizer's default


def _run_steps(svi):
    return svi.run(d3p.random.PRNGKey(2), T, XS, batch_size=B, progress_bar=False)
