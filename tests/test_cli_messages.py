# SPDX-License-Identifier: Apache-2.0
"""The command line speaks in its own terms: every error names options and
the values as typed, options are never abbreviated, each value has one
spelling, plurals are right, and ``twin`` ends with short, labelled summaries
(what was read from the data, utility figures computed on the real data).
"""

import argparse
import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from d3p.__main__ import build_parser, main

ACCOUNTING = ["--delta", "1e-5", "--q", "0.01", "--steps", "100"]
PYTHON_NAMES = ("sampler", "fixed_size", "add_remove", "dp_scale", "num_steps", "num_components", "family='",
                "clipping_threshold", "num_runs", "Expected the value")


def usage_error(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return out, err.strip().splitlines()[-1]


def assert_no_python_names(text):
    text = text.split(", got ")[0]  # the value as the user typed it may be anything
    for name in PYTHON_NAMES:
        assert name not in text, (name, text)


# ---------------------------------------------------------------- accounting


@pytest.mark.parametrize("argv, message", [
    (["sigma", "--epsilon", "1", *ACCOUNTING, "--sampling", "uniform"],
     "python -m d3p sigma: error: argument --sampling: expected 'poisson' or 'fixed', got 'uniform'"),
    (["sigma", "--epsilon", "1", *ACCOUNTING, "--sampling", "fixed", "--relation", "add-remove"],
     "python -m d3p sigma: error: --sampling fixed cannot be accounted under --relation add-remove: fixed-size "
     "batches are accounted under substitute only; use --sampling poisson for add-remove, or --relation substitute"),
    (["epsilon", "--sigma", "-1", *ACCOUNTING],
     "python -m d3p epsilon: error: argument --sigma: expected a finite number >= 0, got '-1'"),
])
def test_accounting_errors_name_options_and_values(capsys, argv, message):
    _, last = usage_error(argv, capsys)
    assert last == message
    assert_no_python_names(last)


def test_options_are_never_abbreviated(capsys):
    _, last = usage_error(["sigma", "--eps", "2", *ACCOUNTING], capsys)
    assert "--epsilon" in last  # required, and --eps is not taken for it
    parser = build_parser()
    parsers = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            parsers += list(action.choices.values())
    assert len(parsers) == 6 and all(p.allow_abbrev is False for p in parsers)


def test_help_builds_only_the_command_that_runs():
    """``python -m d3p --help`` lists every command without importing the twin
    or audit modules, pandas, JAX or NumPyro (``import d3p`` loads its
    submodules when first used)."""
    code = ("import sys, d3p.__main__ as m\n"
            "try:\n    m.main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(x for x in ('d3p.twin', 'd3p.twin.cli', 'd3p.audit', 'pandas', 'jax', 'numpyro') if x in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    *help_text, imported = proc.stdout.strip().splitlines()
    assert imported == "[]"
    for name in ("sigma", "epsilon", "twin", "twin-schema", "audit"):
        assert any(line.split()[:1] == [name] for line in help_text), name


# --------------------------------------------------------------------- audit


@pytest.mark.parametrize("argv, message", [
    (["audit", "--sigma", "-1"], "argument --sigma: expected a finite number >= 0, got '-1'"),
    (["audit", "--relation", "add_remove"], "argument --relation: expected 'add-remove' or 'substitute', "
                                           "got 'add_remove'"),
    (["audit", "--runs", "1"], "argument --runs: expected an integer >= 2, got '1'"),
    (["audit", "--threat-model", "every_step"], "argument --threat-model: expected 'every-step' or "
                                                "'final-params', got 'every_step'"),
])
def test_audit_checks_options_before_it_runs(capsys, argv, message):
    out, last = usage_error(argv, capsys)
    assert last.endswith(message) and out == ""  # nothing was audited
    assert_no_python_names(last)


def test_audit_help_describes_every_option(capsys):
    with pytest.raises(SystemExit):
        main(["audit", "--help"])
    text = capsys.readouterr().out
    assert "accountant of the claimed epsilon" in text and "{add-remove,substitute}" in text


def test_audit_prints_its_result_once_with_a_power_note(capsys):
    assert main(["audit", "--runs", "10", "--seed", "0", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert out.count("epsilon_lower      =") == 1 and out.count("epsilon_accountant") == 1
    assert "--relation add-remove" in out and "relation=" not in out
    note = next(line for line in out.splitlines() if "note:" in line)
    assert "no attack can give epsilon_lower > 0" in note and "could not have detected a violation" in note


def test_power_note_runs_are_enough_and_not_many_more():
    from d3p.audit._cli import _detectable_with, _power_note, largest_detectable_epsilon

    assert largest_detectable_epsilon(5, 5, 1e-5, 0.05) == 0.0
    claimed = 4.377
    note = _power_note(10, 5, 5, 1e-5, 0.05, claimed)
    needed = int(note.split("(--runs ")[1].split(")")[0])
    assert _detectable_with(needed, 1e-5, 0.05) >= claimed > _detectable_with(int(needed * 0.95), 1e-5, 0.05)
    assert _power_note(needed, needed // 2, needed // 2, 1e-5, 0.05, claimed) is None


# ---------------------------------------------------------------------- twin


def write(path, frame):
    frame.to_csv(path, index=False)
    return str(path)


def test_twin_schema_errors_say_twin_schema(tmp_path, capsys):
    assert main(["twin-schema", str(tmp_path / "none.csv"), str(tmp_path / "s.json")]) == 2
    assert capsys.readouterr().err.startswith("d3p twin-schema: error: input file")
    assert build_parser("twin-schema").format_help()  # the parser of the command that runs
    with pytest.raises(SystemExit):
        main(["twin-schema", "--help"])
    assert capsys.readouterr().out.startswith("usage: python -m d3p twin-schema")


def test_marginal_twin_refuses_mixture_options_before_reading(tmp_path, capsys):
    inp = write(tmp_path / "in.csv", pd.DataFrame({"a": [1.5, 2.5]}))
    assert main(["twin", inp, str(tmp_path / "o.csv"), "--epsilon", "1", "--family", "marginal",
                 "--steps", "100"]) == 2
    err = capsys.readouterr().err
    assert err == ("d3p twin: error: --steps 100: this option sets up the mixture fitted with DP-VI "
                   "(--family mixture) and cannot be used with --family marginal\n")


def test_library_errors_are_reported_in_option_terms():
    from d3p import _validate

    message = ("Expected q to be small enough for Poisson sampling of N=100 records, got q=0.6: ... (added to "
               "delta=1e-05). Use q=0.5 or less, or sampling='fixed'. Expected num_steps to be an integer >= 1, "
               "got num_steps=0.")
    from d3p.twin.cli import _OPTIONS, _VALUES
    assert _validate.in_option_terms(message, _OPTIONS, _VALUES) == (
        "Expected --q to be small enough for Poisson sampling of N=100 records, got --q 0.6: ... (added to "
        "--delta 1e-05). Use --q 0.5 or less, or --sampling fixed. Expected --steps to be an integer >= 1, "
        "got --steps 0.")


def test_inferred_fields_one_short_line_per_column():
    import warnings

    from d3p.twin.schema import SchemaInferenceWarning, infer_schema

    rng = np.random.default_rng(0)
    wide = pd.DataFrame({f"a rather long column name number {j}": rng.normal(size=50) for j in range(31)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SchemaInferenceWarning)
        schema = infer_schema(wide)
    lines = schema.inferred_lines()
    assert len(lines) == 13 and lines[-1] == "... and 19 more columns"
    assert all(len(line) < 100 for line in lines)
    low, high = schema.columns[0].lower, schema.columns[0].upper
    assert not any(f"{low:g}" in line or f"{high:g}" in line for line in lines)  # no value of the data


def test_decimals_are_inferred_and_written(tmp_path):
    import warnings

    from d3p.twin.schema import ColumnSpec, SchemaInferenceWarning, TwinInputError, infer_schema

    values = np.round(np.random.default_rng(1).uniform(0, 100, 40), 2)
    values[:3] = [3.5, 100.0, 0.1 + 0.2]  # fewer decimals, and float noise in the last bit
    frame = pd.DataFrame({"x": values})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SchemaInferenceWarning)
        spec = infer_schema(frame)["x"]
    assert spec.decimals == 2 and "decimals" in spec.inferred
    decoded = spec.decode(np.linspace(-1, 1, 7))
    assert np.array_equal(decoded.to_numpy(), np.round(decoded.to_numpy(), 2))
    assert ColumnSpec.from_dict(spec.to_dict()) == spec
    assert ColumnSpec("y", "real", lower=0, upper=1, decimals=None).decode(np.array([0.123456])).iloc[0] != 0.12
    with pytest.raises(TwinInputError, match="decimals"):
        ColumnSpec("c", "count", decimals=1)
    with pytest.raises(TwinInputError, match="decimals"):
        ColumnSpec("y", "real", decimals=-1)


def test_twin_summary_is_short_labelled_and_singular(tmp_path, capsys):
    """One tiny marginal twin of a one-column table: right plurals, no sampler,
    values at the input's precision, the noise and delta warnings, the
    per-column schema lines, and the utility figures labelled as not private."""
    rng = np.random.default_rng(0)
    inp = write(tmp_path / "in.csv", pd.DataFrame({"w": rng.normal(50, 5, 40).round(1)}))
    out_csv = tmp_path / "out.csv"
    assert main(["twin", inp, str(out_csv), "--epsilon", "1", "--family", "marginal", "--seed", "0",
                 "--delta", "0.05", "--no-progress", "--schema-inference", "data"]) == 0
    out, err = capsys.readouterr()
    for text in ("in 1 release ", "on 1 noisy marginal table,", " 1 column,", "40 records"):
        assert text in out, text
    assert "sampling" not in out.lower() and "add-remove relation" in out
    assert "read 40 records x 1 column from" in err
    assert "WARNING: --delta 0.05 is at least 1/N" in err and "target_delta" not in err
    assert "the twin will be mostly noise" in out
    assert "w  real  read: kind, nullable, bounds, distribution, decimals" in out
    assert "python -m d3p twin-schema" in out
    assert "computed on the REAL data, NOT private" in out and "mean TV of the one-way marginals" in out
    assert "uniform baseline" in out
    written = out_csv.read_text().splitlines()[1:]
    assert all(len(v.split(".")[1]) <= 1 for v in written if "." in v)  # one decimal, as the input

    # the schema from twin-schema, passed back: no "pass --schema" hint, the file named instead
    schema = tmp_path / "schema.json"
    assert main(["twin-schema", inp, str(schema)]) == 0
    capsys.readouterr()
    assert json.loads(schema.read_text())["columns"][0]["decimals"] == 1
    assert main(["twin", inp, str(out_csv), "--epsilon", "1", "--family", "marginal", "--seed", "0",
                 "--schema", str(schema), "--overwrite", "--no-progress", "--no-utility"]) == 0
    out, err = capsys.readouterr()
    assert f"in {schema}" in out and "pass it with --schema" not in out
    assert f"WARNING: {schema} marks schema fields of 1 column as read from the data" in err
    assert "utility" not in out


@pytest.mark.parametrize("argv, named", [
    (["sigma", "--epsilon", "1", *ACCOUNTING], "sampling=poisson, relation=add-remove"),
    (["epsilon", "--sigma", "1", *ACCOUNTING], "sampling=poisson, relation=add-remove"),
    (["sigma", "--epsilon", "1", *ACCOUNTING, "--sampling", "fixed"], "sampling=fixed, relation=substitute"),
])
def test_sigma_and_epsilon_name_the_sampler_and_relation_once(argv, named, capsys):
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("relation") == 1 and out.count("sampling") == 1 and named in out


def test_one_release_is_one_release_not_one_releases():
    import warnings

    import d3p.random
    import d3p.twin as twin
    from d3p.ledger import PrivacyLedger

    ledger = PrivacyLedger()
    frame = pd.DataFrame({"c": np.random.default_rng(0).choice(["a", "b"], 200)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tw = twin.fit(frame, 1.0, rng_key=d3p.random.PRNGKey(0), family="marginal", ledger=ledger,
                      progress_bar=False, schema_inference="data")
    summary = ledger.summary()
    assert tw.privacy["num_releases"] == 1 and "1 releases" not in summary
    assert "(1 release," in summary and "marginal twin: 1 release:" in summary


#: A count of one followed by a word in the plural (up to two words before it: "1 noisy marginal tables").
ONE_PLURAL = r"(?<![\d.])1 ((?:[a-z-]+ ){0,2}[a-z-]+s)\b"


def singular_errors(text):
    import re

    return [m for m in re.findall(ONE_PLURAL, text) if m.split()[-1] not in ("is", "was", "has", "as", "this")]


def test_every_count_of_one_is_singular(tmp_path, capsys):
    """Everything ``twin`` and ``twin-schema`` print with a count of one: one
    release, table, column, level, decimal, synthetic record, and the noise
    warning of a one-record table."""
    from d3p.twin.marginal import noise_warning
    from d3p.twin.schema import ColumnSpec, Schema

    assert singular_errors("1 releases, 1 noisy marginal tables, 1 level") == ["releases", "noisy marginal tables"]
    frame = pd.DataFrame({"w": np.random.default_rng(0).normal(50, 5, 40).round(1), "c": ["a"] * 40})
    inp, out_csv = write(tmp_path / "in.csv", frame), tmp_path / "out.csv"
    assert main(["twin", inp, str(out_csv), "--epsilon", "1", "--family", "marginal", "--seed", "0",
                 "--no-progress", "--num-synthetic", "1", "--no-utility", "--schema-inference", "data"]) == 0
    out, err = capsys.readouterr()
    assert "c  categorical, 1 level " in out and "synthetic 1 record " in out, out
    assert singular_errors(out + err) == []
    assert main(["twin-schema", inp, str(tmp_path / "schema.json")]) == 0
    out, err = capsys.readouterr()
    assert "1 level" in out and "1 decimal" in out and singular_errors(out + err) == []
    one = Schema((ColumnSpec("w", "real", "float64", False, lower=0.0, upper=100.0, distribution="normal"),))
    warning = noise_warning(one, 1, 0.1, 0.5)
    assert "N = 1 record at" in warning and singular_errors(warning) == []
    from d3p.twin.schema import SchemaInferenceWarning, infer_schema   # the library's warning too

    with pytest.warns(SchemaInferenceWarning) as caught:
        infer_schema(frame)
    text = " ".join(str(w.message) for w in caught)
    assert "'c' (1 level)" in text and singular_errors(text) == []
