# SPDX-License-Identifier: Apache-2.0
"""No noise draw is used in two releases, whatever is done with checkpoints,
``init_state``, ``start_step`` and keys.

A run draws step ``i``'s noise from its ``rng_key`` and ``i`` (never from the
state's key), the ledger refuses a repeated key and step, and a checkpoint
refuses a second continuation with the same key and steps (in memory and in
its file). The construction: two continuations from one checkpoint on
neighbouring data sets (one record replaced between them, as when a data set
is refreshed). With the same key the second is refused before anything runs;
with new keys their noises are independent: the difference of the two
releases has the full noise std and the two are uncorrelated.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import pytest
from numpyro.infer import Trace_ELBO
from numpyro.infer.autoguide import AutoDelta

import d3p._run
import d3p.random
from d3p.ledger import PrivacyLedger
from d3p.svi import DPSVI, Checkpoint, load_checkpoint, save_checkpoint

from _normal_mean import model

N, LR, SIGMA, C = 200, 1e-3, 2.0, 1.0
D = jnp.linspace(0.0, 2.0, N)
D_PRIME = D.at[0].set(50.0)   # one record replaced (substitute)
#: Every record in every batch (fixed-size batches of N): nothing random but the noise.
FULL = {"batch_size": N, "sampling": "fixed"}
#: The noise std of one SGD step's change of the mean with batches of all N
#: records (the gradient's scale N / B = 1): lr σ C.
NOISE_STD = LR * SIGMA * C


@pytest.fixture(scope="module")
def svi():
    # MAP (AutoDelta) and SGD: one step moves the mean by -lr (clipped sum + σ C z), nothing else random
    return DPSVI(model, AutoDelta(model), numpyro.optim.SGD(LR), Trace_ELBO(), clipping_threshold=C,
                 dp_scale=SIGMA, N=N)


@pytest.fixture(scope="module")
def first(svi):
    ledger = PrivacyLedger()
    return svi.run(d3p.random.PRNGKey(0), 3, D, **FULL, ledger=ledger, progress_bar=False), ledger


def _mean(result):
    return float(result.params["mu_auto_loc"])


def _nothing_runs(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the run built its state: it should have been refused before")
    monkeypatch.setattr(d3p._run, "_initial_state", refuse)


def test_a_file_continued_twice_with_one_key_is_refused_before_anything_runs(svi, first, tmp_path, monkeypatch):
    result, ledger = first
    path = tmp_path / "run.npz"
    save_checkpoint(path, result, ledger=ledger)
    key = d3p.random.PRNGKey(7)
    svi.run(key, 2, D, **FULL, init_state=load_checkpoint(path), progress_bar=False)
    again = load_checkpoint(path)   # loaded afresh: the file remembers the continuation
    assert len(again.ledger) == 2 and again.ledger.releases[1].first_step == 3
    written = path.read_bytes()
    _nothing_runs(monkeypatch)
    with pytest.raises(ValueError, match="new rng_key"):
        svi.run(key, 2, D_PRIME, **FULL, init_state=again, progress_bar=False)
    assert path.read_bytes() == written   # a refused run records nothing


def test_an_in_memory_checkpoint_without_ledger_is_refused_too(svi, first, tmp_path, monkeypatch):
    result, _ = first
    path = tmp_path / "run.npz"
    save_checkpoint(path, result)
    checkpoint = load_checkpoint(path)
    assert checkpoint.ledger is None
    key = d3p.random.PRNGKey(8)
    svi.run(key, 2, D, **FULL, init_state=checkpoint, progress_bar=False)
    for again in (checkpoint, load_checkpoint(path), checkpoint._replace(path=None)):
        with monkeypatch.context() as m:
            _nothing_runs(m)
            with pytest.raises(ValueError, match="already continued with this rng_key at steps 3 to 4"):
                svi.run(key, 2, D_PRIME, **FULL, init_state=again, progress_bar=False)
            # a ledger of the user's own does not lift the refusal
            with pytest.raises(ValueError, match="already continued"):
                svi.run(key, 1, D_PRIME, **FULL, init_state=again, ledger=PrivacyLedger(), start_step=4,
                        progress_bar=False)


def test_the_refusals_advice_gives_fresh_noise(svi, first, tmp_path):
    """The ledger's error says to continue at a later start_step or with a new
    key; either gives steps whose noise was never used."""
    result, ledger = first
    path = tmp_path / "run.npz"
    save_checkpoint(path, result, ledger=ledger)
    key = d3p.random.PRNGKey(9)
    one = svi.run(key, 1, D, **FULL, init_state=load_checkpoint(path), progress_bar=False)
    with pytest.raises(ValueError, match=r"Continue with start_step=4, or use a new rng_key") as refused:
        svi.run(key, 1, D, **FULL, init_state=load_checkpoint(path), progress_bar=False)
    assert "noise would be the same" in str(refused.value)
    later = svi.run(key, 1, D, **FULL, init_state=load_checkpoint(path), start_step=4, progress_bar=False)
    new = svi.run(d3p.random.PRNGKey(10), 1, D, **FULL, init_state=load_checkpoint(path), progress_bar=False)
    # same data, same starting state, every record in the batch: only the noise tells the three apart
    moves = [_mean(r) - _mean(result) for r in (one, later, new)]
    assert len(set(moves)) == 3
    total = load_checkpoint(path).ledger
    assert [(r.first_step, r.num_steps) for r in total.releases] == [(0, 3), (3, 1), (4, 1), (3, 1)]


def test_continuations_with_new_keys_on_neighbouring_data_have_independent_noise(svi, first):
    """The issue's construction with a new key per continuation. Under shared
    noise the difference would be the data's alone (a constant here: every batch holds every record)
    and the correlation 1; independent noises give std sqrt(2) lr σ C and a
    correlation within its null band."""
    result, _ = first
    # in memory only (no file to rewrite on each continuation)
    checkpoint = Checkpoint(None, [np.asarray(x) for x in jax.tree.leaves(result.state)],
                            str(jax.tree.structure(result.state)), 3, None)
    start, pairs = _mean(result), 60
    a, b = np.empty(pairs), np.empty(pairs)
    for i in range(pairs):
        a[i] = _mean(svi.run(d3p.random.PRNGKey(1000 + 2 * i), 1, D, **FULL, init_state=checkpoint,
                             progress_bar=False)) - start
        b[i] = _mean(svi.run(d3p.random.PRNGKey(1001 + 2 * i), 1, D_PRIME, **FULL, init_state=checkpoint,
                             progress_bar=False)) - start
    ratio = np.std(a - b, ddof=1) / (np.sqrt(2) * NOISE_STD)
    corr = np.corrcoef(a, b)[0, 1]
    # std ratio: standard error 1/sqrt(2(n-1)) = 0.09, band 3.3 of them; correlation: 3/sqrt(n)
    print(f"std(A - B) / (sqrt(2) lr sigma C) = {ratio:.3f}, corr(A, B) = {corr:.3f} over {pairs} pairs")
    assert 0.7 < ratio < 1.3, ratio
    assert abs(corr) < 3 / np.sqrt(pairs), corr


def test_a_resumed_run_shows_the_trainings_total_beside_its_part(svi, first, tmp_path, capsys):
    """One release, one ε: the result and the progress bar of a resumed run
    state the ledger's total (both parts composed) at the run's δ, beside
    the run's own part."""
    result, ledger = first
    path = tmp_path / "run.npz"
    save_checkpoint(path, result, ledger=ledger)
    capsys.readouterr()
    second = svi.run(d3p.random.PRNGKey(11), 3, D, **FULL, init_state=load_checkpoint(path), progress_bar=True)
    total = load_checkpoint(path).ledger   # the file's ledger with this continuation
    assert second.total_epsilon == pytest.approx(total.epsilon(second.delta), rel=1e-9)
    assert second.total_epsilon > second.epsilon * 1.05
    bar = capsys.readouterr().err
    shown = float(bar.rsplit("ε ≤ ", 1)[1].split(" in total, ")[0])
    # the bar's δ: the run's target δ (its delta: no Poisson overflow with fixed-size batches)
    assert shown == pytest.approx(total.epsilon(second.delta), rel=5e-3)
    assert f"{second.epsilon:.3g} this run (δ={second.delta:.2g})" in bar
    assert svi.run(d3p.random.PRNGKey(12), 1, D, **FULL, progress_bar=False).total_epsilon is None


@pytest.mark.parametrize("second_key", [7, 21], ids=["same key", "new key"])
def test_resumed_twice_from_one_file_on_neighbouring_data(svi, first, tmp_path, second_key):
    """The neighbour harness (tests/_neighbours.py) on the entry point "a
    checkpoint file with a ledger, continued on D, then continued again on D
    or D′ (one record replaced)": the path (the refusal of a repeated key,
    with its message), the files and the ledger are the same on both; with a
    new key, the second continuation's release differs by at most its
    sensitivity (one SGD step: lr · 2C under substitute)."""
    from _neighbours import Release, compare, observe

    result, ledger = first

    def entry_point(directory, data):
        os.makedirs(directory)
        path = os.path.join(directory, "run.npz")
        save_checkpoint(path, result, ledger=ledger)
        svi.run(d3p.random.PRNGKey(7), 1, D, **FULL, init_state=load_checkpoint(path), progress_bar=False)

        def second():
            again = svi.run(d3p.random.PRNGKey(second_key), 1, data, **FULL, init_state=load_checkpoint(path),
                            progress_bar=False)
            total = load_checkpoint(path).ledger
            return Release(public={"steps": [(r.first_step, r.num_steps) for r in total.releases],
                                   "total_epsilon": again.total_epsilon, "epsilon": again.epsilon},
                           noisy={"mu": _mean(again)}, sensitivity=LR * 2 * C, tolerance=1e-6)
        return second

    observed = []
    for name, data in (("d", D), ("d2", D_PRIME)):
        second = entry_point(str(tmp_path / name), data)
        observed.append(observe(second))
    if second_key == 7:   # refused (by the file's ledger, which holds the first continuation)
        assert observed[0].error is not None and "new rng_key" in observed[0].error[1]
    else:
        assert observed[0].error is None
    compare(*observed, what="resumed twice")
