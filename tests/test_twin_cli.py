"""Tests of the twin command line (``python -m d3p.twin`` / ``python -m d3p twin``).

Bad input: a clear message on stderr, exit status 2, no traceback, no output
files, the input untouched. One full in-process run checks the outputs.
"""

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from d3p.twin.cli import _MIXTURE_OPTIONS, EXIT_BAD_INPUT, add_twin_subparser, main


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def write_csv(path, frame):
    frame.to_csv(path, index=False)
    return str(path)


def good_frame(n=120, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=n)
    return pd.DataFrame({
        "x": x,
        "k": rng.poisson(2, n),
        "flag": x > 0,
        "colour": rng.choice(["red", "green", "blue"], n),
    })


def run_main(args, capsys):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow
def test_full_run_writes_outputs_and_summary(tmp_path, capsys):
    # records enough for the schema read privately to keep the target's two levels
    inp = write_csv(tmp_path / "in.csv", good_frame(2000))
    before = sha256(inp)
    out_csv, rep, mod = tmp_path / "out.csv", tmp_path / "report", tmp_path / "model"
    code, out, err = run_main([inp, out_csv, "--epsilon", "1", "--steps", "10", "--components", "2",
                               "--seed", "3", "--num-synthetic", "77", "--report-dir", rep,
                               "--save-model", mod, "--target", "flag", "--no-progress"], capsys)
    assert code == 0, err
    assert sha256(inp) == before
    syn = pd.read_csv(out_csv)
    assert list(syn.columns) == ["x", "k", "flag", "colour"] and len(syn) == 77
    # the schema read privately adds the catch-all level "other", which the twin may generate
    assert set(syn.colour) <= {"red", "green", "blue", "other"} and syn.flag.dtype == bool
    report = json.loads((rep / "report.json").read_text())
    assert report["privacy"]["epsilon"] <= 1.0 and report["privacy"]["sigma"] > 0
    assert len([f for f in os.listdir(rep) if f.endswith(".png")]) == 5
    assert sorted(os.listdir(mod)) == ["params.npz", "twin.json"]
    for word in ("epsilon =", "delta =", "sigma =", "steps = 10", "schema    read privately in the budget above",
                 str(out_csv), str(rep), str(mod), "time"):
        assert word in out, word
    assert "WITHOUT privacy" not in out + err and "read privately" in err  # said before the fit
    # nothing else was left in the directory
    assert sorted(os.listdir(tmp_path)) == ["in.csv", "model", "out.csv", "report"]


_DATA = ("--schema-inference", "data")


def _bad_cases(tmp_path):
    d = tmp_path
    empty = d / "empty.csv"
    empty.write_text("")
    header_only = d / "header.csv"
    header_only.write_text("a,b\n")
    all_missing = write_csv(d / "allmissing.csv", good_frame().assign(x=np.nan))
    many = write_csv(d / "many.csv", pd.DataFrame({"id": [f"person-{i}" for i in range(2000)],
                                                   "v": np.arange(2000.0)}))
    text = good_frame()
    text["x"] = text["x"].astype(object)
    text.loc[3, "x"] = "n/a?"
    text_num = write_csv(d / "text.csv", text)
    good = write_csv(d / "good.csv", good_frame())
    return [
        ("missing file", [d / "nope.csv", d / "o.csv", "--epsilon", "1"], "not found"),
        ("empty file", [empty, d / "o.csv", "--epsilon", "1"], "is empty"),
        ("no records", [header_only, d / "o.csv", "--epsilon", "1"], "no rows"),
        # errors that quote the data exist only where the schema is read outside epsilon
        ("column entirely missing", [all_missing, d / "o.csv", "--epsilon", "1", *_DATA], "entirely missing"),
        ("thousands of levels", [many, d / "o.csv", "--epsilon", "1", *_DATA], "2000 distinct values"),
        ("text in numeric column", [text_num, d / "o.csv", "--epsilon", "1", *_DATA], "non-numeric"),
        ("output is input", [good, good, "--epsilon", "1"], "is the input file"),
        ("bad schema file", [good, d / "o.csv", "--epsilon", "1", "--schema", d / "none.json"], "not found"),
        ("unknown target", [good, d / "o.csv", "--epsilon", "1", "--target", "zzz"], "not a column"),
        ("output dir missing", [good, d / "no" / "o.csv", "--epsilon", "1"], "does not exist"),
    ]


@pytest.mark.parametrize("case", range(10))
def test_bad_input_clear_error_no_output(tmp_path, capsys, case):
    name, args, words = _bad_cases(tmp_path)[case]
    inputs = {p: sha256(tmp_path / p) for p in os.listdir(tmp_path)}
    code, out, err = run_main(args, capsys)
    assert code == EXIT_BAD_INPUT, name
    assert words in err and err.startswith("d3p twin: error:"), (name, err)
    assert "Traceback" not in err + out
    assert {p: sha256(tmp_path / p) for p in os.listdir(tmp_path)} == inputs, name  # no output, input intact


@pytest.mark.parametrize("eps", ["0", "-1", "nan", "abc"])
def test_epsilon_must_be_positive(tmp_path, capsys, eps):
    inp = write_csv(tmp_path / "in.csv", good_frame())
    with pytest.raises(SystemExit) as e:
        main([inp, str(tmp_path / "o.csv"), "--epsilon", eps])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "epsilon" in err and "Traceback" not in err
    assert os.listdir(tmp_path) == ["in.csv"]


def test_existing_output_needs_overwrite(tmp_path, capsys):
    inp = write_csv(tmp_path / "in.csv", good_frame())
    (tmp_path / "o.csv").write_text("keep me")
    code, out, err = run_main([inp, tmp_path / "o.csv", "--epsilon", "1"], capsys)
    assert code == EXIT_BAD_INPUT and "--overwrite" in err
    assert (tmp_path / "o.csv").read_text() == "keep me"


def test_subparser_registration():
    import argparse

    parser = argparse.ArgumentParser(prog="d3p")
    sub = parser.add_subparsers(dest="command")
    add_twin_subparser(sub)
    args = parser.parse_args(["twin", "a.csv", "b.csv", "--epsilon", "inf", "--components", "3"])
    assert args.command == "twin" and args.epsilon == float("inf") and args.components == 3
    assert args.func.__name__ == "main_twin" and args.command_parser.prog.endswith("twin")


def test_module_entry_point_exit_status(tmp_path):
    """``python -m d3p.twin`` really exits with status 2 and no traceback."""
    res = subprocess.run([sys.executable, "-m", "d3p.twin", str(tmp_path / "missing.csv"),
                          str(tmp_path / "o.csv"), "--epsilon", "1"], capture_output=True, text=True)
    assert res.returncode == EXIT_BAD_INPUT
    assert "not found" in res.stderr and "Traceback" not in res.stderr
    assert os.listdir(tmp_path) == []


def test_na_values_turn_text_into_missing(tmp_path, capsys, monkeypatch):
    """The documented fix for text in a numeric column: --na-values (checked up to the fit)."""
    import d3p.twin.cli as cli

    frame = good_frame()
    frame["x"] = frame["x"].astype(object)
    frame.loc[3, "x"] = "n/a?"
    inp = write_csv(tmp_path / "in.csv", frame)
    seen = {}

    def fake_run(args):
        data = cli._read_csv(args)
        seen["dtype"], seen["missing"] = str(data["x"].dtype), int(data["x"].isna().sum())
        return 0

    monkeypatch.setattr(cli, "_run", fake_run)
    assert main([inp, str(tmp_path / "o.csv"), "--epsilon", "1", "--na-values", "n/a?"]) == 0
    assert seen == {"dtype": "float64", "missing": 1}


def parse(argv):
    import argparse

    from d3p.twin.cli import add_twin_arguments

    parser = add_twin_arguments(argparse.ArgumentParser(prog="twin"))
    return parser.parse_args(["a.csv", "b.csv", "--epsilon", "1", *argv])


def parse_error(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_q_is_a_probability_in_zero_one_closed(capsys):
    """q accepts (0, 1] on the command line as in the library and ``python -m d3p``."""
    assert parse(["--q", "1"]).q == 1.0 and parse(["--q", "0.25"]).q == 0.25
    for bad in ("0", "1.5", "-0.1", "nan", "abc"):
        err = parse_error(["--q", bad], capsys)
        assert f"argument --q: expected a finite number in (0, 1], got {bad!r}" in err, err


def test_delta_is_in_the_open_unit_interval(capsys):
    assert parse(["--delta", "1e-6"]).delta == 1e-6
    for bad in ("0", "1"):
        assert f"argument --delta: expected a finite number in (0, 1), got {bad!r}" in parse_error(
            ["--delta", bad], capsys)


@pytest.mark.parametrize("option", ["--steps", "--components", "--num-synthetic", "--max-levels"])
def test_counts_are_integers_of_at_least_one(option, capsys):
    assert getattr(parse([option, "12"]), option[2:].replace("-", "_")) == 12
    for bad in ("0", "2.5", "x"):
        assert f"argument {option}: expected an integer >= 1, got {bad!r}" in parse_error([option, bad], capsys)


@pytest.mark.parametrize("option", ["--clip", "--learning-rate"])
def test_scales_are_positive_finite(option, capsys):
    assert getattr(parse([option, "0.5"]), option[2:].replace("-", "_")) == 0.5
    for bad in ("0", "-1", "inf"):
        assert f"argument {option}: expected a finite number > 0, got {bad!r}" in parse_error([option, bad], capsys)


def test_epsilon_accepts_inf_and_names_the_range(capsys):
    assert parse(["--epsilon", "inf"]).epsilon == float("inf")
    assert "argument --epsilon: expected a number > 0, got '0'" in parse_error(["--epsilon", "0"], capsys)


def test_seed_is_any_integer_parsed_exactly(capsys):
    big = 2**70 + 1  # not representable as a float: must not be rounded
    assert parse(["--seed", str(big)]).seed == big and parse(["--seed", "-3"]).seed == -3
    assert "argument --seed: expected an integer, got '1.5'" in parse_error(["--seed", "1.5"], capsys)


def test_twin_schema_writes_the_inferred_schema_to_pass_back(tmp_path, capsys):
    """``python -m d3p twin-schema`` writes what ``twin`` would infer, naming what was read."""
    import warnings

    from d3p.__main__ import main as d3p_main
    from d3p.twin import Schema, SchemaInferenceWarning, infer_schema

    frame = good_frame()
    inp = write_csv(tmp_path / "in.csv", frame)
    out = tmp_path / "schema.json"
    assert d3p_main(["twin-schema", inp, str(out)]) == 0
    stdout, stderr = capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SchemaInferenceWarning)
        want = infer_schema(pd.read_csv(inp))
    assert Schema.load(out) == want
    assert "read from data" in stdout and "--schema" in stdout and "WARNING" in stderr
    assert "d3p twin-schema: read 120 records x 4 columns" in stderr
    assert d3p_main(["twin-schema", inp, str(out)]) == EXIT_BAD_INPUT  # no silent overwrite
    assert "--overwrite" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["in.csv", "schema.json"]


def test_target_steers_the_marginal_twin_and_is_saved(tmp_path, capsys):
    inp = write_csv(tmp_path / "in.csv", good_frame(400))
    mod = tmp_path / "model"
    code, out, err = run_main([inp, tmp_path / "out.csv", "--epsilon", "1", "--family", "marginal", "--seed", "1",
                               "--target", "colour", "--save-model", mod, "--no-progress"], capsys)
    assert code == 0, err
    desc = json.loads((mod / "twin.json").read_text())
    assert desc["fit"]["target"] == ["colour"]
    assert all(3 in c for c in desc["privacy"]["measured"][4::3])  # rounds 0, 3, ...: tables with colour


def test_family_option(capsys):
    assert parse(["--family", "marginal"]).family == "marginal"
    assert parse([]).family == "auto"
    assert "--family" in parse_error(["--family", "graph"], capsys)


@pytest.mark.slow
def test_adaptive_clipping_option(tmp_path, capsys):
    """``--adaptive-clipping [QUANTILE]`` fits the mixture with adaptive clipping
    and says so; a quantile outside (0, 1) and the marginal family are refused
    in flag terms before anything is written."""
    inp = write_csv(tmp_path / "in.csv", good_frame())
    code, out, err = run_main([inp, tmp_path / "o.csv", "--epsilon", "2", "--steps", "10", "--components", "2",
                               "--adaptive-clipping", "0.9", "--seed", "1", "--no-progress", "--no-utility"],
                              capsys)
    assert code == 0, err
    assert "adaptive clipping to the 0.9 quantile, C = 1 -> " in out
    for bad, match in ((["--adaptive-clipping", "1.5"], "argument --adaptive-clipping"),
                       (["--adaptive-clipping", "--family", "marginal"], "--adaptive-clipping")):
        out_csv = tmp_path / "bad.csv"
        try:   # argparse exits; a refused combination returns the status
            code = main([inp, str(out_csv), "--epsilon", "1", *bad])
        except SystemExit as exc:
            code = exc.code
        assert code == EXIT_BAD_INPUT
        assert match in capsys.readouterr().err and not out_csv.exists()


# ------------------------------------------------- checks before the fit, wording


@pytest.fixture
def no_fit(monkeypatch):
    """Make any fit an error: the checks under test must come before it."""
    import d3p.twin.cli as cli

    def refuse(*args, **kwargs):
        raise AssertionError("the fit started")

    monkeypatch.setattr(cli, "_fit", refuse)


@pytest.mark.parametrize("target, message", [
    ("x", "is continuous"),                  # a real-valued column
    ("id", "at most 50 classes"),            # an integer column with 120 values
])
def test_a_target_the_report_cannot_predict_is_refused_before_the_fit(tmp_path, capsys, no_fit, target, message):
    frame = good_frame().assign(id=np.arange(120))
    inp, out_csv = write_csv(tmp_path / "in.csv", frame), tmp_path / "out.csv"
    code, out, err = run_main([inp, out_csv, "--epsilon", "1", "--target", target, "--max-levels", "200", *_DATA],
                              capsys)
    assert code == EXIT_BAD_INPUT and f"--target '{target}'" in err and message in err
    assert "Traceback" not in err and not out_csv.exists()


def _schema_file(tmp_path, frame, **changes):
    """The schema inferred from ``frame``, with ``changes`` ({column: {field: value}}), as a file."""
    import warnings

    from d3p.twin.schema import infer_schema

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        schema = infer_schema(frame).to_dict()
    for column in schema["columns"]:
        column.update(changes.get(column["name"], {}))
        column["inferred"] = []
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    return str(path)


def test_the_target_kind_is_the_schema_s_checked_before_the_fit(tmp_path, capsys, no_fit):
    """A column the schema of the fit declares real is refused as a target
    before the fit, though its values (five distinct ones) would do as classes."""
    frame = good_frame().assign(score=np.tile([0.5, 1.5, 2.5, 3.5, 4.5], 24))
    inp = write_csv(tmp_path / "in.csv", frame)
    schema = _schema_file(tmp_path, frame, score={"kind": "real", "lower": 0.0, "upper": 5.0,
                                                  "distribution": "normal", "decimals": 1, "levels": None,
                                                  "dtype": "float64"})
    code, out, err = run_main([inp, tmp_path / "o.csv", "--epsilon", "1", "--target", "score", "--schema", schema],
                              capsys)
    assert code == EXIT_BAD_INPUT and "--target 'score': Expected a categorical target" in err
    assert "(a real column in the schema)" in err and "Traceback" not in err


def test_a_categorical_target_of_the_schema_is_predicted_whatever_its_values():
    """With a schema, a categorical target of 30 numeric levels is a target
    (without one, its values make it continuous): the check before the fit
    and the report's accuracy after it agree."""
    from d3p.twin.metrics import check_classification_target, train_on_synthetic_accuracy
    from d3p.twin.schema import ColumnSpec, Schema

    rng = np.random.default_rng(0)
    levels = tuple(float(v) + 0.5 for v in range(30))
    frame = pd.DataFrame({"x": rng.normal(size=300), "y": rng.choice(levels, 300)})
    schema = Schema((ColumnSpec("x", "real", "float64", False, lower=-5.0, upper=5.0, distribution="normal"),
                     ColumnSpec("y", "categorical", "float64", False, levels=levels)))
    with pytest.raises(ValueError, match="is continuous"):
        check_classification_target(frame, "y")
    check_classification_target(frame, "y", schema=schema)
    result = train_on_synthetic_accuracy(frame, frame, "y", schema=schema)
    assert result["num_test"] == 300


def _exhausted_ledger(tmp_path):
    from d3p.ledger import PrivacyLedger

    ledger = PrivacyLedger(budget_epsilon=1.0, budget_delta=1e-4)
    ledger.record_epsilon_delta("an earlier release", 0.9, 1e-5, relation="add_remove")
    path = tmp_path / "ledger.json"
    path.write_text(json.dumps(ledger.to_dict()))
    return path


@pytest.fixture
def no_read(monkeypatch):
    """Make reading the data an error: the checks under test need no data."""
    import d3p.twin.cli as cli

    monkeypatch.setattr(cli, "_read_csv", lambda *a, **k: (_ for _ in ()).throw(AssertionError("read")))


def _no_data_cases(tmp_path):
    """(name, extra arguments, output path, words of the error): checks that need neither the data nor a fit."""
    d = tmp_path
    (d / "dir.json").mkdir()
    (d / "locked").mkdir()
    return [
        ("report folder's directory missing", ["--report-dir", d / "no" / "rep"], d / "o.csv", "--report-dir"),
        ("saved twin's directory missing", ["--save-model", d / "no" / "m"], d / "o.csv", "--save-model"),
        ("saved twin's directory not writable", ["--save-model", d / "locked" / "m"], d / "o.csv",
         "is not writable"),
        ("ledger's directory missing", ["--ledger", d / "no" / "l.json"], d / "o.csv", "for --ledger does not exist"),
        ("ledger is the output", ["--ledger", d / "o.csv"], d / "o.csv", "--ledger and output are the same path"),
        ("ledger is a directory", ["--ledger", d / "dir.json"], d / "o.csv", "--ledger"),
        ("budget without a ledger", ["--budget-epsilon", "1", "--budget-delta", "1e-5"], d / "o.csv",
         "need --ledger"),
        ("budget for an existing ledger", ["--ledger", _exhausted_ledger(d), "--budget-epsilon", "5",
                                           "--budget-delta", "1e-5"], d / "o.csv", "exists and keeps its own"),
    ]


@pytest.mark.parametrize("case", range(8))
def test_checks_that_need_no_data_come_before_reading_it(tmp_path, capsys, monkeypatch, no_read, no_fit, case):
    import d3p.twin.cli as cli

    inp = write_csv(tmp_path / "in.csv", good_frame())
    name, extra, out_csv, words = _no_data_cases(tmp_path)[case]
    locked, real_access = str(tmp_path / "locked"), os.access
    monkeypatch.setattr(cli.os, "access", lambda p, mode: False if str(p) == locked else real_access(p, mode))
    code, out, err = run_main([inp, out_csv, "--epsilon", "1", *extra], capsys)
    assert code == EXIT_BAD_INPUT and err.startswith("d3p twin: error:") and words in err, (name, err)
    assert "Traceback" not in err and not os.path.exists(out_csv), name


def test_a_report_without_matplotlib_is_refused_before_reading(tmp_path, capsys, monkeypatch, no_read, no_fit):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)   # its import fails
    inp = write_csv(tmp_path / "in.csv", good_frame())
    code, out, err = run_main([inp, tmp_path / "o.csv", "--epsilon", "1", "--report-dir", tmp_path / "r"], capsys)
    assert code == EXIT_BAD_INPUT and "--report-dir" in err and "pip install matplotlib" in err


@pytest.mark.parametrize("argv, words", [(["--epsilon", "0"], "--epsilon"), (["--epsilon", "1", "--delta", "1"],
                                                                           "--delta")])
def test_epsilon_and_delta_are_checked_before_reading(tmp_path, capsys, no_read, no_fit, argv, words):
    inp = write_csv(tmp_path / "in.csv", good_frame())
    with pytest.raises(SystemExit) as e:
        main([inp, str(tmp_path / "o.csv"), *argv])
    assert e.value.code == EXIT_BAD_INPUT and words in capsys.readouterr().err


def test_a_schema_that_does_not_fit_the_columns_is_refused_before_the_fit(tmp_path, capsys, no_fit):
    frame = good_frame()
    inp = write_csv(tmp_path / "in.csv", frame)
    schema = _schema_file(tmp_path, frame.assign(extra=1.0))
    code, out, err = run_main([inp, tmp_path / "o.csv", "--epsilon", "1", "--schema", schema], capsys)
    assert code == EXIT_BAD_INPUT and "['extra']" in err and "not in the data" in err


def test_a_twin_past_the_ledger_budget_is_refused_before_its_rounds(tmp_path, capsys, monkeypatch):
    import d3p.twin.inference as inference

    monkeypatch.setattr(inference, "fit_marginals", lambda *a, **k: (_ for _ in ()).throw(AssertionError("fit")))
    inp = write_csv(tmp_path / "in.csv", good_frame())
    ledger = _exhausted_ledger(tmp_path)
    saved = ledger.read_text()
    code, out, err = run_main([inp, tmp_path / "o.csv", "--epsilon", "1", "--delta", "1e-5", "--family", "marginal",
                               "--ledger", ledger, "--no-progress"], capsys)
    assert code == EXIT_BAD_INPUT and "to fit the ledger's budget of epsilon 1" in err
    assert ledger.read_text() == saved and not (tmp_path / "o.csv").exists()


@pytest.mark.slow
def test_a_mixture_past_the_ledger_budget_is_refused_before_its_steps(tmp_path, capsys, monkeypatch):
    import d3p._run

    monkeypatch.setattr(d3p._run, "_run_in_chunks", lambda *a, **k: (_ for _ in ()).throw(AssertionError("steps")))
    inp = write_csv(tmp_path / "in.csv", good_frame())
    ledger = _exhausted_ledger(tmp_path)
    code, out, err = run_main([inp, tmp_path / "o.csv", "--epsilon", "1", "--delta", "1e-5", "--family", "mixture",
                               "--steps", "5", "--ledger", ledger, "--no-progress", "--seed", "1"], capsys)
    assert code == EXIT_BAD_INPUT and "to fit the ledger's budget of epsilon 1" in err


def test_a_target_is_not_checked_when_nothing_predicts_it(tmp_path, capsys, monkeypatch):
    import d3p.twin.cli as cli

    seen = []
    monkeypatch.setattr(cli, "_fit", lambda *a, **k: seen.append(True) or (_ for _ in ()).throw(RuntimeError("stop")))
    inp = write_csv(tmp_path / "in.csv", good_frame())
    with pytest.raises(RuntimeError, match="stop"):
        main([inp, str(tmp_path / "out.csv"), "--epsilon", "1", "--target", "x", "--no-utility"])
    assert seen == [True]   # the marginal twin can steer its rounds by a continuous column


def test_an_output_directory_that_is_not_writable_is_refused_before_reading(tmp_path, capsys, monkeypatch):
    import d3p.twin.cli as cli

    inp = write_csv(tmp_path / "in.csv", good_frame())
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(cli.os, "access", lambda p, mode: False if str(p) == str(locked) else real_access(p, mode))
    monkeypatch.setattr(cli, "_read_csv", lambda *a, **k: (_ for _ in ()).throw(AssertionError("read")))
    code, out, err = run_main([inp, locked / "out.csv", "--epsilon", "1"], capsys)
    assert code == EXIT_BAD_INPUT and "is not writable" in err and "output" in err


def test_errors_name_the_options_not_the_arguments(tmp_path, capsys):
    inp = write_csv(tmp_path / "in.csv", good_frame())
    code, out, err = run_main([inp, tmp_path / "out.csv", "--epsilon", "1", "--max-levels", "2", *_DATA], capsys)
    assert code == EXIT_BAD_INPUT and "--max-levels 2" in err and "max_levels" not in err
    import d3p.__main__ as top   # the same wording in twin-schema

    code = top.main(["twin-schema", inp, str(tmp_path / "s.json"), "--max-levels", "2"])
    out, err = capsys.readouterr()
    assert code == EXIT_BAD_INPUT and "--max-levels 2" in err and "max_levels" not in err


def test_errors_of_the_fit_and_the_ledger_name_the_options(tmp_path, capsys, monkeypatch):
    """A q too large for Poisson batches and a ledger of another relation: in
    the options' terms (--q, --delta, --sampling), before anything is fitted."""
    import d3p.twin.inference as inference
    from d3p.ledger import PrivacyLedger

    refuse = lambda *a, **k: (_ for _ in ()).throw(AssertionError("fit"))  # noqa: E731
    monkeypatch.setattr(inference, "_fit_mixture", refuse)
    monkeypatch.setattr(inference, "fit_marginals", refuse)
    inp = write_csv(tmp_path / "in.csv", good_frame(n=40))
    code, out, err = run_main([inp, tmp_path / "o.csv", "--epsilon", "1", "--family", "mixture", "--q", "0.9",
                               "--no-progress"], capsys)
    assert code == EXIT_BAD_INPUT and "Expected --q to be small enough for Poisson sampling" in err
    assert "got --q 0.9" in err and "(added to --delta " in err and "Use --q 0.5 or less, or --sampling fixed" in err
    first = err
    ledger = PrivacyLedger()
    ledger.record_zcdp("an earlier twin", 0.01, relation="add_remove")
    (tmp_path / "ledger.json").write_text(json.dumps(ledger.to_dict()))
    code, out, err = run_main([inp, tmp_path / "o.csv", "--epsilon", "1", "--family", "marginal", "--sampling",
                               "fixed", "--ledger", tmp_path / "ledger.json", "--no-progress"], capsys)
    assert code == EXIT_BAD_INPUT and "ledger under --sampling poisson" in err and "with --sampling fixed" in err
    for name in ("q=", "delta=", "sampling=", "relation=", "add_remove", "substitute"):
        assert name not in first + err, name


@pytest.mark.parametrize("command", [["twin", "in.csv", "out.csv", "--epsilon", "1"],
                                     ["sigma", "--epsilon", "1", "--delta", "1e-5", "--q", "0.01", "--steps", "10"]])
def test_an_unknown_option_shows_the_usage_of_its_command(capsys, command):
    import d3p.__main__ as top

    with pytest.raises(SystemExit) as e:
        top.main(command + ["--bogus"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"usage: python -m d3p {command[0]}" in err
    assert f"python -m d3p {command[0]}: error: unrecognized arguments: --bogus" in err


@pytest.mark.parametrize("argv, usage", [
    (["twin", "--bogus", "in.csv", "out.csv", "--epsilon", "1"], "python -m d3p twin"),   # before its arguments
    (["twin", "in.csv", "out.csv", "--epsilon", "1", "--bogus=3"], "python -m d3p twin"),
    (["twin", "in.csv", "out.csv", "extra", "--epsilon", "1"], "python -m d3p twin"),
    (["twin-schema", "in.csv", "s.json", "--bogus"], "python -m d3p twin-schema"),
    (["--bogus", "twin", "in.csv", "out.csv", "--epsilon", "1"], "python -m d3p"),   # given to python -m d3p
])
def test_an_unknown_argument_shows_the_usage_of_what_it_was_given_to(capsys, argv, usage):
    import d3p.__main__ as top

    with pytest.raises(SystemExit) as e:
        top.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"usage: {usage} [") and f"{usage}: error: unrecognized" in err


def test_an_unknown_option_of_twin_shows_its_usage_from_the_shell(tmp_path):
    inp = write_csv(tmp_path / "in.csv", good_frame())
    proc = subprocess.run([sys.executable, "-m", "d3p", "twin", inp, str(tmp_path / "o.csv"), "--epsilon", "1",
                           "--bogus"], capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert proc.returncode == 2 and proc.stderr.startswith("usage: python -m d3p twin [-h] --epsilon EPSILON")
    assert "python -m d3p twin: error: unrecognized arguments: --bogus" in proc.stderr and proc.stdout == ""


def test_family_auto_is_described_by_the_rule_the_code_uses():
    import argparse

    from d3p.twin.inference import MARGINAL_MAX_NOISE_TV, MIXTURE_MIN_RECORDS

    parser = argparse.ArgumentParser()
    add_twin_subparser(parser.add_subparsers())
    (family,) = [a for a in parser._subparsers._group_actions[0].choices["twin"]._actions if a.dest == "family"]
    text = " ".join(family.help.split())
    assert f"at most {MARGINAL_MAX_NOISE_TV:g} in total-variation distance" in text
    assert f"fewer than {MIXTURE_MIN_RECORDS} records" in text and "categorical or boolean" not in text
    assert "from public settings only" in text and "epsilon inf" in text
    assert "epsilon, delta, the schema's cells and N" in text   # what choose_family reads
    options = text[text.index("the mixture otherwise"):]
    assert all(flag in options for _, flag in _MIXTURE_OPTIONS), options   # each selects the mixture
    # the same rule, in the same numbers, in the documentation
    import pathlib

    doc = " ".join((pathlib.Path(__file__).parent.parent / "docs" / "twin.md").read_text().split())
    rule = doc[doc.index("`fit(..., family=\"auto\")`"):doc.index("means the mixture.")]
    assert f"at most {MARGINAL_MAX_NOISE_TV:g} in total-variation distance" in rule
    assert f"fewer than {MIXTURE_MIN_RECORDS} records" in rule and "ε = ∞" in rule
    assert all(f"`{flag}`" in rule for _, flag in _MIXTURE_OPTIONS), rule


@pytest.mark.parametrize("private", [True, False])
def test_the_summary_says_once_how_sigma_follows_from_epsilon(private):
    """The mixture's summary: sigma's line says it was calibrated for the
    epsilon of the line above (with q and the steps), every figure once."""
    import argparse
    import types

    from d3p.twin.cli import _summary

    privacy = {"private": private, "epsilon": 0.9876 if private else float("inf"), "target_epsilon": 1.0,
               "delta": 1.5e-5, "relation": "add_remove", "sampling": "poisson",
               "sigma": 1.2345 if private else 0.0, "clipping_threshold": 2.0, "q": 0.125, "num_steps": 321,
               "not_covered": {}}
    twin = types.SimpleNamespace(privacy=privacy, model_spec={"type": "mixture", "num_components": 3},
                                 schema=["a", "b"], fit_info={"seconds": 1.0, "adaptive_clipping": None})
    args = argparse.Namespace(schema=None, output="out.csv", report_dir=None, save_model=None)
    lines = _summary(args, twin, num_records=100, num_synthetic=100, seed_text="7", num_report_files=0,
                     seconds=2.0)
    text = "\n".join(lines)
    (noise,) = [line for line in lines if "sigma" in line]
    assert lines.index(noise) == 3 and lines[2].startswith("  privacy   ")   # right under epsilon's line
    if private:
        assert "sigma = 1.234, calibrated so that q = 0.125 and steps = 321 give the epsilon above;" in noise
        figures = ("epsilon = 0.9876", "target 1)", "delta = 1.5e-05", "sigma = 1.234", "C = 2", "q = 0.125",
                   "steps = 321", "seed: 7")
        assert all(text.count(f) == 1 for f in figures), text
        assert text.count("epsilon") == 2 and "calibrated" not in lines[2]   # the figure, and the reference to it
    else:
        assert "sigma = 0, no noise, with q = 0.125 and steps = 321;" in noise and "calibrated" not in text


def test_private_schema_reads_odd_tables_without_an_error(tmp_path, capsys):
    """The tables that the schema read outside epsilon refuses (a column entirely missing, thousands of
    levels, text in a numeric column) are read privately without an error or a warning that depends on
    them, and without reading anything outside epsilon."""
    for name, args, _ in _bad_cases(tmp_path)[3:6]:
        code, out, err = run_main([a for a in args if a not in _DATA] + ["--seed", "1", "--no-progress",
                                                                          "--overwrite"], capsys)
        assert code == 0, (name, err)
        assert "read privately" in err and "WITHOUT privacy" not in out + err, name


def test_strict_refuses_the_schema_read_outside_epsilon(tmp_path, capsys):
    inp = write_csv(tmp_path / "in.csv", good_frame())
    code, out, err = run_main([inp, tmp_path / "o.csv", "--epsilon", "1", "--strict", *_DATA], capsys)
    assert code == EXIT_BAD_INPUT and "--schema-inference private" in err and "strict" in err
    assert not (tmp_path / "o.csv").exists()
    code, out, err = run_main([inp, tmp_path / "o.csv", "--epsilon", "1", "--strict", "--schema-share", "0.2",
                               "--family", "marginal", "--no-progress", "--seed", "0"], capsys)
    assert code == 0, err
    assert "0.2 of rho" in out


def test_a_target_with_one_class_in_the_private_schema_is_refused_before_the_fit(tmp_path, capsys, no_fit):
    """120 records are too few for the schema read privately to keep the target's two levels: the
    report could not train a classifier, so the run stops before the fit, saying why."""
    inp, out_csv = write_csv(tmp_path / "in.csv", good_frame()), tmp_path / "out.csv"
    code, out, err = run_main([inp, out_csv, "--epsilon", "1", "--target", "flag", "--seed", "0"], capsys)
    assert code == EXIT_BAD_INPUT and "at least two classes" in err and "give the column's levels" in err
    assert "Traceback" not in err and not out_csv.exists()
