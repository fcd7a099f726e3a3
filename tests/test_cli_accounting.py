# SPDX-License-Identifier: Apache-2.0
"""Tests for the `python -m d3p sigma|epsilon` command line."""

import re
import subprocess
import sys

import pytest

from d3p.__main__ import build_parser, main
from d3p.accounting import ADD_REMOVE, SUBSTITUTE, compute_epsilon


def _value(name, text):
    m = re.search(rf"\b{name}=([0-9.eE+-]+|inf)", text)
    assert m, text
    return float(m.group(1))


@pytest.mark.parametrize("relation, expected", [("add-remove", ADD_REMOVE), ("substitute", SUBSTITUTE), (None, ADD_REMOVE)])
def test_sigma_one_liner(capsys, relation, expected):
    argv = ["sigma", "--epsilon", "1", "--delta", "1e-5", "--q", "0.01", "--steps", "2000"]
    if relation:
        argv += ["--relation", relation]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    sigma, eps = _value("sigma", out), _value("epsilon", out)
    assert eps <= 1.0
    assert expected.replace("_", "-") in out
    assert compute_epsilon(sigma, 0.01, 2000, 1e-5, relation=expected) <= 1.0 * (1 + 2e-3)


def test_epsilon_one_liner(capsys):
    argv = ["epsilon", "--sigma", "3", "--q", "0.1", "--steps", "512", "--delta", "1e-6",
            "--relation", "add-remove"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert _value("epsilon", out) == pytest.approx(3.77, abs=0.01)


def test_epsilon_sigma_zero(capsys):
    assert main(["epsilon", "--sigma", "0", "--q", "0.1", "--steps", "5", "--delta", "1e-6"]) == 0
    assert "epsilon=inf" in capsys.readouterr().out


@pytest.mark.parametrize("argv, name", [
    (["sigma", "--epsilon", "1", "--delta", "1e-5", "--q", "1.5", "--steps", "10"], "--q"),
    (["sigma", "--epsilon", "-1", "--delta", "1e-5", "--q", "0.1", "--steps", "10"], "--epsilon"),
    (["sigma", "--epsilon", "1", "--delta", "2", "--q", "0.1", "--steps", "10"], "--delta"),
    (["sigma", "--epsilon", "1", "--delta", "1e-5", "--q", "0.1", "--steps", "2.5"], "--steps"),
    (["sigma", "--epsilon", "1", "--delta", "1e-5", "--q", "0.1", "--steps", "10", "--relation", "poisson"],
     "--relation"),
    (["epsilon", "--sigma", "-2", "--q", "0.1", "--steps", "10", "--delta", "1e-5"], "--sigma"),
    (["epsilon", "--sigma", "abc", "--q", "0.1", "--steps", "10", "--delta", "1e-5"], "--sigma"),
    (["epsilon", "--q", "0.1", "--steps", "10", "--delta", "1e-5"], "--sigma"),
    (["nonsense"], "COMMAND"),
])
def test_bad_values_exit_2_naming_the_argument(capsys, argv, name):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert name in err
    assert "Traceback" not in err


def test_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "sigma" in out and "epsilon" in out
    with pytest.raises(SystemExit) as e:
        main(["sigma", "--help"])
    assert e.value.code == 0
    assert "substitute" in capsys.readouterr().out


def test_commands_are_pluggable():
    # other commands register their own subparser the same way
    import d3p.__main__ as cli

    def register_hello(subparsers):
        p = subparsers.add_parser("hello")
        p.set_defaults(func=lambda args, parser: 7, command_parser=p)

    cli.COMMANDS.append(register_hello)
    try:
        assert main(["hello"]) == 7
    finally:
        cli.COMMANDS.remove(register_hello)
    assert "hello" not in build_parser().format_help()


def test_subprocess_module_entry_point():
    # `python -m d3p` (one run: importing d3p imports JAX, which takes a while)
    bad = subprocess.run(
        [sys.executable, "-m", "d3p", "sigma", "--epsilon", "1", "--delta", "1e-5", "--q", "1.5",
         "--steps", "10"],
        capture_output=True, text=True, timeout=300,
    )
    assert bad.returncode == 2
    assert "--q" in bad.stderr and "1.5" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_fixed_size_sampling_uses_the_dominating_pair(capsys):
    dp_accounting = pytest.importorskip("dp_accounting")
    from dp_accounting.pld import pld_privacy_accountant

    ref = pld_privacy_accountant.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    ref.compose(dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(0.822 / 2)), 1000)
    eps_ref = ref.get_epsilon(1e-5)
    base = ["epsilon", "--sigma", "0.822", "--q", "0.01", "--steps", "1000", "--delta", "1e-5"]
    for extra in (["--sampling", "fixed"], ["--relation", "substitute"]):
        assert main(base + extra) == 0
        out = capsys.readouterr().out
        assert "sampling=fixed, relation=substitute" in out
        assert _value("epsilon", out) == pytest.approx(eps_ref, rel=1e-3)
    assert main(base + ["--sampling", "poisson", "--relation", "substitute"]) == 0
    assert _value("epsilon", capsys.readouterr().out) < 4.01   # the midpoint pair, valid for Poisson only
    with pytest.raises(SystemExit) as e:
        main(base + ["--sampling", "fixed", "--relation", "add-remove"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--sampling fixed cannot be accounted under --relation add-remove" in err
    assert "sampler" not in err and "fixed_size" not in err


def test_sampling_fixed_is_the_fixed_size_sampler(capsys):
    argv = ["epsilon", "--sigma", "2", "--q", "0.01", "--steps", "100", "--delta", "1e-5", "--sampling", "fixed"]
    assert main(argv) == 0
    assert "sampling=fixed, relation=substitute" in capsys.readouterr().out


@pytest.mark.parametrize("option, value, message", [
    ("--sampling", "shuffle", "argument --sampling: expected 'poisson' or 'fixed', got 'shuffle'"),
    # one spelling of each value: the library's names are not options' values
    ("--sampling", "fixed_size", "argument --sampling: expected 'poisson' or 'fixed', got 'fixed_size'"),
    ("--relation", "poisson", "argument --relation: expected 'add-remove' or 'substitute', got 'poisson'"),
    ("--relation", "add_remove", "argument --relation: expected 'add-remove' or 'substitute', got 'add_remove'"),
    ("--steps", "2.5", "argument --steps: expected an integer >= 1, got '2.5'"),
])
def test_bad_names_and_values_give_the_shared_message(capsys, option, value, message):
    argv = ["epsilon", "--sigma", "2", "--q", "0.01", "--steps", "100", "--delta", "1e-5", option, value]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert option in err and message in err
