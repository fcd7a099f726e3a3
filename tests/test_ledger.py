# SPDX-License-Identifier: Apache-2.0
"""The privacy ledger (d3p.ledger): composition of heterogeneous releases
against dp-accounting called directly, the budget, the relation, JSON."""

import json
import math

import pytest
from dp_accounting import NeighboringRelation, dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.pld import privacy_loss_distribution as pld
from dp_accounting.rdp import rdp_privacy_accountant

from d3p.ledger import (BudgetExceededError, EpsilonDeltaRelease, GaussianSteps, PrivacyLedger, ZCDPRelease,
                        key_fingerprint)

DELTA = 1e-5


def _pld_reference(phases, sigma_divisor=1.0):
    """dp-accounting's PLD accountant composing Poisson-subsampled Gaussian
    steps (add/remove; σ divided by ``sigma_divisor``)."""
    acc = pld_privacy_accountant.PLDAccountant(NeighboringRelation.ADD_OR_REMOVE_ONE,
                                               value_discretization_interval=1e-4)
    for sigma, q, steps in phases:
        acc.compose(dp_event.SelfComposedDpEvent(
            dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma / sigma_divisor)), steps))
    return acc.get_epsilon(DELTA)


def _ledger(phases, sampler="poisson", relation=None):
    ledger = PrivacyLedger(relation)
    for i, (sigma, q, steps) in enumerate(phases):
        ledger.record_steps(f"run {i}", sigma=sigma, q=q, num_steps=steps, sampler=sampler)
    return ledger


HETEROGENEOUS = [(2.0, 0.01, 1000), (1.2, 0.03, 300), (4.0, 0.1, 50)]


def test_heterogeneous_poisson_runs_match_dp_accounting():
    """Runs with different σ and q compose as dp-accounting's PLD of the same
    events: never below it (beyond its discretisation), and not far above."""
    ours = _ledger(HETEROGENEOUS).epsilon(DELTA)
    ref = _pld_reference(HETEROGENEOUS)
    assert ref * (1 - 1e-3) <= ours <= ref * 1.01


def test_heterogeneous_fixed_size_runs_are_accounted_at_half_sigma():
    """Fixed-size runs (substitute) compose as the add/remove pair at σ/2."""
    phases = [(3.0, 0.01, 800), (2.0, 0.02, 200)]
    ours = _ledger(phases, sampler="fixed_size").epsilon(DELTA)
    ref = _pld_reference(phases, sigma_divisor=2.0)
    assert ref * (1 - 1e-3) <= ours <= ref * 1.01
    # the midpoint pair would be optimistic: a ledger that used it would fail the line above
    midpoint = _ledger(phases, sampler="poisson", relation="substitute").epsilon(DELTA)
    assert midpoint < ref * (1 - 1e-3)


def test_different_pairs_under_one_relation_are_not_optimistic():
    """A fixed-size run and a Poisson run, both under substitute: each pair
    dominates its run, so their PLDs composed (dp-accounting, directly) are a
    valid and tight reference; the ledger's bound is above it and within 40%."""
    ledger = PrivacyLedger("substitute")
    ledger.record_steps("fixed", sigma=3.0, q=0.01, num_steps=500, sampler="fixed_size")
    ledger.record_steps("poisson", sigma=3.0, q=0.01, num_steps=500, sampler="poisson")
    ours = ledger.epsilon(DELTA)
    fixed = pld.from_gaussian_mechanism(1.5, sampling_prob=0.01, value_discretization_interval=1e-4,
                                        neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE)
    poisson = pld.from_gaussian_mechanism(3.0, sampling_prob=0.01, value_discretization_interval=1e-4,
                                          neighboring_relation=NeighboringRelation.REPLACE_ONE)
    ref = fixed.self_compose(500).compose(poisson.self_compose(500)).get_epsilon_for_delta(DELTA)
    assert ref * (1 - 1e-3) <= ours <= ref * 1.4


def test_gaussian_steps_with_a_zcdp_release():
    """Steps and a ρ-zCDP release: at least the exact ε of the steps composed
    with a Gaussian mechanism that is ρ-zCDP (a valid instance), at most
    dp-accounting's RDP accountant for the same events."""
    rho, (sigma, q, steps) = 0.02, HETEROGENEOUS[0]
    ledger = _ledger([(sigma, q, steps)])
    ledger.record_zcdp("tables", rho, relation="add_remove")
    ours = ledger.epsilon(DELTA)
    acc = pld_privacy_accountant.PLDAccountant(NeighboringRelation.ADD_OR_REMOVE_ONE,
                                               value_discretization_interval=1e-4)
    acc.compose(dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)),
                                             steps))
    acc.compose(dp_event.GaussianDpEvent(1 / math.sqrt(2 * rho)))
    rdp = rdp_privacy_accountant.RdpAccountant()
    rdp.compose(dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)),
                                             steps))
    rdp.compose(dp_event.ZCDpEvent(rho))
    assert acc.get_epsilon(DELTA) * (1 - 1e-3) <= ours <= rdp.get_epsilon(DELTA) * (1 + 1e-6)


def test_epsilon_delta_releases_add_up():
    ledger = PrivacyLedger()
    ledger.record_epsilon_delta("a", 1.0, 1e-6, relation="add_remove")
    ledger.record_epsilon_delta("b", 0.5, 2e-6, relation="add_remove")
    assert ledger.epsilon(1e-5) == pytest.approx(1.5)
    assert ledger.epsilon(2e-6) == math.inf   # δ of the releases alone is above it
    assert PrivacyLedger().epsilon(DELTA) == 0.0


def test_overflow_adds_to_delta():
    plain = _ledger([(2.0, 0.01, 1000)]).epsilon(DELTA)
    small = PrivacyLedger()
    small.record(GaussianSteps("run", 2.0, 0.01, 1000, "poisson", "add_remove", overflow=1e-12))
    assert small.epsilon(DELTA) >= plain
    large = PrivacyLedger()
    large.record(GaussianSteps("run", 2.0, 0.01, 1000, "poisson", "add_remove", overflow=DELTA))
    assert large.epsilon(DELTA) == math.inf


def test_budget_refuses_a_release_and_records_nothing():
    ledger = PrivacyLedger(budget_epsilon=1.0, budget_delta=DELTA)
    ledger.record_steps("first", sigma=2.0, q=0.01, num_steps=300)
    spent = ledger.epsilon(DELTA)
    assert spent <= 1.0
    with pytest.raises(BudgetExceededError, match=r"'second' to fit the ledger's budget of epsilon 1 at delta 1e-05"):
        ledger.record_steps("second", sigma=1.0, q=0.02, num_steps=1000)
    assert len(ledger) == 1 and ledger.epsilon(DELTA) == spent
    with pytest.raises(ValueError, match="budget_epsilon and budget_delta"):
        PrivacyLedger(budget_epsilon=1.0)


def test_one_relation_per_ledger():
    ledger = _ledger([(2.0, 0.01, 10)])
    assert ledger.relation == "add_remove"
    with pytest.raises(ValueError, match="relation='add_remove'.*relation='substitute'"):
        ledger.record_steps("fixed", sigma=2.0, q=0.01, num_steps=10, sampler="fixed_size")
    with pytest.raises(ValueError, match="relation"):
        ledger.record_zcdp("tables", 0.1, relation="substitute")


def test_batch_keys_are_not_reused():
    import d3p.random

    key = key_fingerprint(d3p.random.PRNGKey(1))
    assert key == key_fingerprint(d3p.random.PRNGKey(1)) != key_fingerprint(d3p.random.PRNGKey(2))
    ledger = PrivacyLedger()
    ledger.record_steps("a", sigma=2.0, q=0.01, num_steps=100, key=key)
    assert ledger.steps_taken(key) == 100 and ledger.steps_taken(None) == 0
    with pytest.raises(ValueError, match="start_step=100"):
        ledger.record_steps("b", sigma=2.0, q=0.01, num_steps=10, first_step=50, key=key)
    ledger.record_steps("b", sigma=2.0, q=0.01, num_steps=10, first_step=100, key=key)
    assert ledger.steps_taken(key) == 110


def test_bad_input_names_the_argument():
    ledger = PrivacyLedger()
    with pytest.raises(ValueError, match="sigma"):
        ledger.record_steps("a", sigma=-1.0, q=0.01, num_steps=1)
    with pytest.raises(ValueError, match="q"):
        ledger.record_steps("a", sigma=1.0, q=1.5, num_steps=1)
    with pytest.raises(ValueError, match="delta"):
        ledger.epsilon(0.0)
    with pytest.raises(TypeError, match="release"):
        ledger.record((1.0, 0.01, 10))


def test_json_round_trip(tmp_path):
    ledger = PrivacyLedger(budget_epsilon=math.inf, budget_delta=DELTA, accountant="rdp")
    ledger.record_steps("run", sigma=2.0, q=0.01, num_steps=100, key="ab" * 16)
    ledger.record(ZCDPRelease("tables", 0.01, "add_remove"))
    ledger.record(EpsilonDeltaRelease("count", math.inf, 0.0, "add_remove"))
    path = tmp_path / "ledger.json"
    ledger.save(path)
    data = json.loads(path.read_text())   # standard JSON: no Infinity
    assert data["format"] == "d3p.privacy_ledger" and data["version"] == 1
    back = PrivacyLedger.load(path)
    assert back.releases == ledger.releases
    assert (back.relation, back.budget_epsilon, back.budget_delta, back.accountant) == \
        ("add_remove", math.inf, DELTA, "rdp")
    assert back.epsilon(DELTA) == ledger.epsilon(DELTA) == math.inf
    data["version"] = 99
    with pytest.raises(ValueError, match="version 1"):
        PrivacyLedger.from_dict(data)
    with pytest.raises(ValueError, match="privacy ledger"):
        PrivacyLedger.from_dict({"format": "something else"})


def test_twin_command_records_its_release(tmp_path, capsys):
    """``python -m d3p twin --ledger``: the private schema's release (its ρ and its threshold's δ) and the
    marginal twin's ρ are recorded, the ledger saved, and a twin that would pass the budget is refused."""
    import numpy as np
    import pandas as pd

    from d3p.twin.cli import main

    rng = np.random.default_rng(0)
    pd.DataFrame({"a": rng.integers(0, 3, 200), "b": rng.choice(["x", "y"], 200)}).to_csv(tmp_path / "in.csv",
                                                                                            index=False)
    path = str(tmp_path / "ledger.json")
    common = [str(tmp_path / "in.csv"), "--epsilon", "1", "--delta", "1e-5", "--family", "marginal",
              "--no-progress", "--no-utility", "--ledger", path]
    assert main(common[:1] + [str(tmp_path / "out1.csv")] + common[1:] + ["--seed", "1", "--budget-epsilon", "1.5",
                                                                        "--budget-delta", "1e-5"]) == 0
    ledger = PrivacyLedger.load(path)
    assert [type(r) for r in ledger.releases] == [ZCDPRelease, EpsilonDeltaRelease, ZCDPRelease]
    assert ledger.budget_epsilon == 1.5
    assert 0.9 < ledger.epsilon(1e-5) <= 1.0
    assert main(common[:1] + [str(tmp_path / "out2.csv")] + common[1:] + ["--seed", "2"]) == 0
    assert len(PrivacyLedger.load(path)) == 6
    out = capsys.readouterr().out
    # one release, one figure: the ledger's total stated at the twin's own delta, beside the twin's
    import re
    own = re.search(r"privacy   epsilon = ([0-9.e+-]+) \(target 1\), delta = ([0-9.e+-]+),", out)
    total = re.search(r"6 releases of this data set, this twin included: in total epsilon = ([0-9.e+-]+) at "
                      r"delta = ([0-9.e+-]+)", out)
    assert own and total and total.group(2) == own.group(2)
    assert float(total.group(1)) == pytest.approx(PrivacyLedger.load(path).epsilon(float(own.group(2))), rel=1e-3)
    assert float(total.group(1)) > float(own.group(1))
    spent = re.findall(r"budget epsilon = 1.5 at delta = 1e-05: spent ([0-9.e+-]+)", out)   # after each twin
    assert len(spent) == 2 and float(spent[1]) == pytest.approx(PrivacyLedger.load(path).epsilon(1e-5), rel=1e-3)
    assert main(common[:1] + [str(tmp_path / "out3.csv")] + common[1:] + ["--seed", "3"]) == 2
    err = capsys.readouterr().err
    assert "budget of epsilon 1.5" in err
    # refused before the third schema was read: nothing recorded
    assert "Nothing was recorded" in err and len(PrivacyLedger.load(path)) == 6


@pytest.mark.slow
def test_mixture_twin_records_its_steps():
    """``d3p.twin.fit(..., ledger=...)`` with the DP-VI mixture records its steps
    with the σ, q and sampler of its privacy record."""
    import numpy as np
    import pandas as pd

    import d3p.random
    from d3p import twin

    rng = np.random.default_rng(0)
    df = pd.DataFrame({"a": rng.integers(0, 3, 200), "b": rng.normal(size=200)})
    ledger = PrivacyLedger()
    tw = twin.fit(df, 1.0, 1e-5, rng_key=d3p.random.PRNGKey(0), family="mixture", num_steps=10, q=0.1,
                  progress_bar=False, ledger=ledger)
    schema_part, threshold, release = ledger.releases   # the private schema's two entries, then the run
    assert isinstance(schema_part, GaussianSteps) and (schema_part.q, schema_part.num_steps) == (1.0, 1)
    assert threshold.delta == tw.privacy["schema"]["delta_threshold"]
    assert isinstance(release, GaussianSteps)
    assert (release.sigma, release.q, release.num_steps, release.sampler) == \
        (tw.privacy["sigma"], 0.1, 10, "poisson")
    assert ledger.epsilon(1e-5) <= 1.0


def test_twin_command_line_keeps_a_ledger_and_refuses_past_its_budget(tmp_path, capsys):
    """``python -m d3p twin --ledger``: the first twin is recorded in a new
    ledger with the given budget; a second twin that would pass it is refused
    before it is fitted, writing nothing and leaving the ledger as it was
    (two releases of epsilon = 1 compose to about 1.45 as zCDP, over 1.2)."""
    import numpy as np

    from d3p.__main__ import main

    rng = np.random.default_rng(0)
    table = tmp_path / "in.csv"
    table.write_text("a,b\n" + "".join(f"{x:.2f},{'yes' if y else 'no'}\n"
                                       for x, y in zip(rng.normal(size=300), rng.random(300) < 0.4)))
    ledger = tmp_path / "ledger.json"
    common = ["--family", "marginal", "--no-progress", "--no-utility", "--seed", "1", "--ledger", str(ledger)]
    code = main(["twin", str(table), str(tmp_path / "one.csv"), "--epsilon", "1", "--delta", "1e-6", *common,
                 "--budget-epsilon", "1.2", "--budget-delta", "1e-6"])
    assert code == 0, capsys.readouterr().err
    first = PrivacyLedger.load(str(ledger))
    assert len(first) == 3 and first.budget_epsilon == 1.2   # the schema's two entries and the twin
    assert 0.9 <= first.epsilon(1e-6) <= 1.0 + 1e-9
    saved = ledger.read_text()
    capsys.readouterr()
    code = main(["twin", str(table), str(tmp_path / "two.csv"), "--epsilon", "1", "--delta", "1e-6", *common])
    err = capsys.readouterr().err
    assert code != 0 and "budget" in err, err
    assert not (tmp_path / "two.csv").exists()
    # the second schema fitted the budget and was read: its release stays on record, the model's is refused
    assert "its release is recorded in" in err
    assert [r.what for r in PrivacyLedger.load(str(ledger)).releases][3:] == [
        "twin schema (noisy histograms)", "twin schema (levels' threshold)"]
    saved = ledger.read_text()
    # a budget given for an existing ledger is an error in flag terms
    code = main(["twin", str(table), str(tmp_path / "two.csv"), "--epsilon", "0.1", *common,
                 "--budget-epsilon", "5", "--budget-delta", "1e-6"])
    assert code == 2 and "--budget-epsilon and --budget-delta set the budget of a new ledger" in capsys.readouterr().err
