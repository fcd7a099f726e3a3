"""A complete (public) schema maps every record on its own: no record outside it
can make a twin fail, warn, print or change how another record is read.

For each kind of record that does not fit the schema (an undeclared level, a
missing value where none is allowed, text or ±inf in a numeric column, 2.5 in
a count, 'sometimes' in a boolean, ...), the tests build neighbouring tables D
and D' (one record replaced, or added) and check, with the same keys on both:
no exception, the same warnings and printed output (none), the mapped record
equals the documented rule's output (written out by hand, from the rules of
``ColumnSpec.encode`` and docs/twin.md), every other record is mapped
identically, and the fit's public outputs are identical (its data argument
differs in that one record only).
"""

import math
import warnings

import numpy as np
import pandas as pd
import pytest

import d3p.random
import d3p.svi
import d3p.twin as twin
from d3p.twin import ColumnSpec, Schema, TwinInputError

from _stub_run import stub_result

SCHEMA = Schema.from_dict({"columns": [
    {"name": "diag", "kind": "categorical", "levels": ["flu", "cold", "other"], "other": "other",
     "nullable": False, "distribution": "categorical", "dtype": "str"},
    {"name": "region", "kind": "categorical", "levels": ["N", "S"], "nullable": True,
     "distribution": "categorical", "dtype": "str"},
    {"name": "code", "kind": "categorical", "levels": ["A", "01", 2, 3.5], "nullable": False,
     "distribution": "categorical", "dtype": "object"},
    {"name": "smoker", "kind": "boolean", "nullable": True, "distribution": "bernoulli", "dtype": "bool"},
    {"name": "insured", "kind": "boolean", "nullable": False, "distribution": "bernoulli", "dtype": "bool"},
    {"name": "age", "kind": "real", "lower": 0, "upper": 100, "nullable": False, "distribution": "normal",
     "dtype": "float64"},
    {"name": "income", "kind": "real", "lower": 0, "upper": 1e6, "nullable": True, "distribution": "lognormal",
     "dtype": "float64"},
    {"name": "visits", "kind": "count", "lower": 0, "upper": 9, "nullable": False, "distribution": "poisson",
     "dtype": "int64"},
    {"name": "stays", "kind": "count", "lower": 0, "upper": 200, "nullable": True, "distribution": "normal",
     "dtype": "int64"},
]})

MISSING = None  # the rule's output "missing" in the expected records below


def clean_frame(n=40, seed=0):
    """A table whose every value fits SCHEMA."""
    rng = np.random.default_rng(seed)
    return pd.DataFrame({
        "diag": rng.choice(["flu", "cold", "other"], n),
        "region": rng.choice(["N", "S"], n),
        "code": rng.choice(["01", "2", "3.5"], n),
        "smoker": rng.uniform(size=n) < 0.3,
        "insured": rng.uniform(size=n) < 0.7,
        "age": rng.uniform(18, 90, n).round(1),
        "income": rng.lognormal(10, 1, n).round(0).clip(0, 1e6),
        "visits": rng.poisson(2, n).clip(0, 9),
        "stays": rng.poisson(20, n),
    }).astype(object)


# (column, adversarial value, what the documented rule maps it to)
ADVERSARIAL = [
    ("diag", "HIV+ (confidential)", "other"),       # undeclared level -> declared other
    ("diag", None, "other"),                        # missing, not nullable -> other
    ("diag", ["a", "list"], "other"),               # not even hashable -> other
    ("region", "HIV+ (confidential)", MISSING),     # undeclared, no other, nullable -> missing
    ("code", "HIV+ (confidential)", "A"),           # undeclared, no other, not nullable -> first level
    ("code", math.nan, "A"),                        # missing, not nullable -> first level
    ("code", "2.0", 2),                             # equal as a number -> that level
    ("smoker", "sometimes", MISSING),               # not a boolean, nullable -> missing
    ("insured", "sometimes", False),                # not a boolean, not nullable -> False
    ("insured", None, False),                       # missing, not nullable -> False
    ("insured", 2, False),                          # a number other than 0/1 -> not a boolean
    ("age", math.nan, 0.0),                         # missing, not nullable -> lower
    ("age", "forty", 0.0),                          # text -> not a number -> missing -> lower
    ("age", math.inf, 100.0),                       # -> nearest bound
    ("age", -math.inf, 0.0),
    ("age", 1e308, 100.0),
    ("age", "1e999", 100.0),                        # text beyond the float range: inf -> upper
    ("age", 5e-324, 5e-324),                        # subnormal: a valid value, kept
    ("income", "n/a?", MISSING),                    # text, nullable -> missing
    ("income", -math.inf, 0.0),
    ("income", 10**400, 1e6),                       # an integer beyond the float range -> upper
    ("visits", 2.5, 2),                             # rounded, halves to even
    ("visits", 3.5, 4),
    ("visits", "2.5", 2),
    ("visits", math.inf, 9),
    ("visits", None, 0),                            # missing, not nullable -> lower
    ("visits", complex(1, 1), 0),                   # not a real number -> missing -> lower
    ("stays", 1e30, 200),
    ("stays", "x", MISSING),
    ("stays", 7.5, 8),
]
IDS = [f"{c}={v!r}"[:40] for c, v, _ in ADVERSARIAL]


def observe(fn):
    """``fn()``'s result, warnings and whether it raised, with every warning recorded."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result, error = fn(), None
        except Exception as e:  # noqa: BLE001 - the point is to see any
            result, error = None, f"{type(e).__name__}: {e}"
    return result, error, [(w.category.__name__, str(w.message)) for w in caught]


def with_record(frame, i, column, value):
    """``frame`` with record ``i``'s value in ``column`` replaced (object column)."""
    out = frame.copy()
    out[column] = out[column].astype(object)
    out.at[i, column] = value
    return out


@pytest.mark.parametrize("column, value, mapped", ADVERSARIAL, ids=IDS)
def test_record_outside_the_schema_maps_by_the_rule(column, value, mapped, capsys):
    """Substitute and add/remove neighbours: no error, warning or output on either
    side; the record becomes the rule's output; every other record is unchanged."""
    D = clean_frame()
    i = 7
    D_sub = with_record(D, i, column, value)
    D_add = pd.concat([D, with_record(D.iloc[[i]], i, column, value)], ignore_index=True)
    mapped_record = with_record(D.iloc[[i]], i, column, mapped)  # the rule's output, written by hand
    observations = [observe(lambda: SCHEMA.encode(t)) for t in (D, D_sub, D_add, mapped_record)]
    for codes, error, warned in observations:
        assert error is None and warned == [], (error, warned)
        assert codes.dtype == np.float32
    (codes, _, _), (sub, _, _), (add, _, _), (want, _, _) = observations
    others = np.arange(len(D)) != i
    np.testing.assert_array_equal(sub[others], codes[others])
    np.testing.assert_array_equal(add[:len(D)], codes)
    np.testing.assert_array_equal(sub[i], want[0])
    np.testing.assert_array_equal(add[len(D)], want[0])
    assert np.isnan(sub[i, SCHEMA.names.index(column)]) == (mapped is MISSING)
    assert capsys.readouterr() == ("", "")


def _closed_form_code(spec, mapped):
    """The code of a valid value, from the module docstring's formulas (not from encode)."""
    if mapped is MISSING:
        return math.nan
    if spec.kind == "categorical":
        return float([str(v) for v in spec.levels].index(str(mapped)))
    if spec.kind == "boolean":
        return float(mapped)
    if spec.distribution in ("poisson", "negbinomial"):
        return float(mapped - spec.lower)
    u = (mapped - spec.lower) / (spec.upper - spec.lower)
    if spec.distribution == "normal":
        return 2 * u - 1
    c = 0.01  # lognormal: log(u + c) onto [-1, 1]
    return 2 * (math.log(u + c) - math.log(c)) / (math.log1p(c) - math.log(c)) - 1


@pytest.mark.parametrize("column, value, mapped", ADVERSARIAL, ids=IDS)
def test_mapped_code_equals_the_closed_form(column, value, mapped):
    spec = SCHEMA[column]
    got = spec.encode(pd.Series([value], dtype=object))[0]
    want = _closed_form_code(spec, mapped)
    if math.isnan(want):
        assert math.isnan(got)
    else:
        assert got == pytest.approx(want, rel=1e-12, abs=1e-12)


TRICKY = [2, 2.0, "2", "2.0", -0.0, 0.0, "0", True, 1, "1", "01", 1.0, " 01", None, math.nan,
          ["x"], {"a": 1}, complex(2, 0), 10**400, "inf", "-0", np.int64(2), np.float32(3.5), "3.5", b"2"]


@pytest.mark.parametrize("spec", [
    ColumnSpec("c", "categorical", "object", True, levels=("01", 2, 3.5, "0.0", True), distribution="categorical"),
    ColumnSpec("c", "categorical", "object", False, levels=("a", "2", 1.0), distribution="categorical", other="a"),
    ColumnSpec("c", "boolean", "bool", True, distribution="bernoulli"),
    ColumnSpec("c", "real", "float64", False, lower=-1, upper=5, distribution="normal"),
    ColumnSpec("c", "count", "int64", True, lower=0, upper=3, distribution="negbinomial"),
], ids=["categorical", "categorical-other", "boolean", "real", "count"])
def test_each_value_is_mapped_on_its_own(spec):
    """The code of a value is the same alone and among any others, in any order
    (no memo, type or dtype shared between records), and always a valid code."""
    alone = np.array([spec.encode(pd.Series([v], dtype=object))[0] for v in TRICKY])
    together = spec.encode(pd.Series(TRICKY, dtype=object))
    np.testing.assert_array_equal(together, alone)
    order = np.random.default_rng(0).permutation(len(TRICKY))
    np.testing.assert_array_equal(spec.encode(pd.Series([TRICKY[k] for k in order], dtype=object)), alone[order])
    texts = [v for v in TRICKY if isinstance(v, str) or v is None]
    text_alone = np.array([spec.encode(pd.Series([v], dtype=object))[0] for v in texts])
    for dtype in ("str", "category"):  # columns of distinct values: one code per value, as alone
        np.testing.assert_array_equal(spec.encode(pd.Series(texts, dtype=dtype)), text_alone)
    mixed = pd.Series(pd.Categorical([2, "2", 2.5, True, None, 2, "2"]))
    np.testing.assert_array_equal(spec.encode(mixed),
                                  [spec.encode(pd.Series([v], dtype=object))[0] for v in mixed.tolist()])
    valid = alone[~np.isnan(alone)]
    assert spec.nullable or not np.isnan(alone).any()
    if spec.kind == "categorical":
        assert set(valid) <= set(range(spec.num_levels))
    elif spec.kind == "boolean":
        assert set(valid) <= {0.0, 1.0}
    elif spec.kind == "count":
        assert set(valid) <= {0.0, 1.0, 2.0, 3.0}
    else:
        assert np.all((valid >= -1) & (valid <= 1))


def test_typed_columns_map_as_their_values():
    """A column typed by pandas (float with NaN, nullable Int64, bool) maps as its values do."""
    spec = SCHEMA["visits"]
    typed = [pd.Series([1.0, np.nan, 2.5, np.inf]), pd.Series([1, None, 3, 20], dtype="Int64")]
    np.testing.assert_array_equal(spec.encode(typed[0]), [1, 0, 2, 9])
    np.testing.assert_array_equal(spec.encode(typed[1]), [1, 0, 3, 9])
    np.testing.assert_array_equal(SCHEMA["insured"].encode(pd.Series([True, None, False], dtype="boolean")),
                                  [1, 0, 0])


def test_values_beyond_float_ranges_map_silently():
    """A float128 value beyond float64's range, and a count code beyond float32's
    (a schema with such a range), map without a warning to finite codes."""
    wide = pd.Series(np.array(["1e4000", "-1e4000", "2"], dtype=np.longdouble))
    spec = ColumnSpec("r", "real", "float64", False, lower=0, upper=5, distribution="normal")
    huge = Schema((ColumnSpec("n", "count", "float64", False, lower=0, upper=1e39, distribution="poisson"),))
    (codes, error, warned), (big, error2, warned2) = (
        observe(lambda: spec.encode(wide)), observe(lambda: huge.encode(pd.DataFrame({"n": [1e39, math.inf, 1.0]}))))
    assert error is error2 is None and warned == warned2 == []
    np.testing.assert_array_equal(codes, [1.0, -1.0, 2 * 2 / 5 - 1])
    assert np.all(np.isfinite(big)) and big[2, 0] == 1.0


# ------------------------------------------------------------- the schema format


def test_other_is_a_declared_level_of_a_categorical():
    spec = ColumnSpec.from_dict({"name": "d", "kind": "categorical", "levels": ["a", "z"], "other": "z"})
    assert spec.other == "z" and spec.to_dict()["other"] == "z"
    assert ColumnSpec.from_dict(spec.to_dict()) == spec
    assert "other" not in ColumnSpec("d", "categorical", levels=("a",)).to_dict()  # old files unchanged
    with pytest.raises(TwinInputError, match="Expected other to be one of the levels of column 'd'"):
        ColumnSpec.from_dict({"name": "d", "kind": "categorical", "levels": ["a"], "other": "z"})
    with pytest.raises(TwinInputError, match="Expected other only for a categorical column"):
        ColumnSpec.from_dict({"name": "d", "kind": "real", "other": "z"})


def test_other_joins_levels_read_from_the_data():
    """On the inference path (outside epsilon), a declared other is added to the levels read."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", twin.SchemaInferenceWarning)
        s = twin.infer_schema(pd.DataFrame({"d": ["b", "a", "b"]}), {"columns": [{"name": "d", "other": "rest"}]})
    assert s["d"].levels == ("a", "b", "rest") and s["d"].other == "rest"


def test_bounds_with_an_infinite_range_are_refused():
    with pytest.raises(TwinInputError, match="finite range upper - lower for column 'x'"):
        ColumnSpec("x", "real", lower=-1e308, upper=1e308)


def test_schema_level_errors_quote_no_record():
    """A table whose columns are not the schema's is a public error: the message
    names columns, never a value or a count of records."""
    D = with_record(clean_frame(), 3, "diag", "HIV+ (confidential)").drop(columns=["age"])
    with pytest.raises(TwinInputError) as e:
        SCHEMA.encode(D)
    assert "'age'" in str(e.value) and "HIV" not in str(e.value) and "40" not in str(e.value)


# ---------------------------------------------------------------- the fit


def _stub_run(seen):
    """A DPSVI.run that records its data and returns the initial parameters,
    accounted as the real run would be: the fit without its mechanism."""
    def run(self, rng_key, num_steps, data, *, q=None, batch_size=None, sampling="fixed", target_delta=None,
            init_state=None, **kwargs):
        seen["data"] = np.array(data)
        return stub_result(self, init_state, np.zeros(num_steps), data.shape[0], num_steps, q=q,
                           batch_size=batch_size, sampling=sampling, target_delta=target_delta)

    return run


def _fit_observation(frame, family, monkeypatch, stub=False):
    """fit's path and public outputs, and the data it passed to the mechanism
    (with ``stub``, the mixture's DPSVI.run is replaced by :func:`_stub_run`)."""
    import d3p.twin.inference as inference

    seen = {}
    if family == "marginal":
        real = inference.fit_marginals

        def spy(cells, *args, **kwargs):
            seen["data"] = np.array(cells)
            return real(cells, *args, **kwargs)

        monkeypatch.setattr(inference, "fit_marginals", spy)
        kw = dict(family="marginal")
    else:
        real = d3p.svi.DPSVI.run

        def spy(self, rng_key, num_steps, data, *args, **kwargs):
            seen["data"] = np.array(data)
            return real(self, rng_key, num_steps, data, *args, **kwargs)

        monkeypatch.setattr(d3p.svi.DPSVI, "run", _stub_run(seen) if stub else spy)
        kw = dict(family="mixture", num_steps=3, num_components=2, q=0.2)
    tw, error, warned = observe(lambda: twin.fit(frame, 1.0, rng_key=d3p.random.PRNGKey(11), schema=SCHEMA,
                                                 progress_bar=False, **kw))
    public = None
    if tw is not None:
        public = tw.description()
        public["fit"].pop("seconds")
        if family == "marginal":  # the measured tables are chosen privately: noisy releases
            public.pop("model"), public.pop("params"), public["privacy"].pop("measured")
    monkeypatch.undo()
    return public, error, warned, seen.get("data")


def _neighbours(n=60, i=5):
    """A clean table and its substitute neighbour whose record ``i`` holds a value
    outside the schema in every third of the ADVERSARIAL kinds."""
    D = clean_frame(n)
    D2 = D.copy()
    for column, value, _ in ADVERSARIAL[::3]:
        D2 = with_record(D2, i, column, value)
    return D, D2, i


def _assert_same_path(a, b, i):
    assert a[1] is None and b[1] is None, (a[1], b[1])
    assert a[2] == b[2] == []
    assert a[0] == b[0]
    assert a[3].shape == b[3].shape
    assert set(np.flatnonzero(np.any(a[3] != b[3], axis=1))) <= {i}


def test_fit_on_neighbours_takes_the_same_path(monkeypatch, capsys):
    """A record with values outside the schema and its neighbour: the same (absent)
    errors, warnings and output, identical public parts of the twin (the
    mechanism, DPSVI.run, stubbed), and the mechanism's input differs in that
    record only."""
    D, D2, i = _neighbours()
    _assert_same_path(_fit_observation(D, "mixture", monkeypatch, stub=True),
                      _fit_observation(D2, "mixture", monkeypatch, stub=True), i)
    assert capsys.readouterr() == ("", "")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["marginal", "mixture"])
def test_real_fit_on_neighbours_takes_the_same_path(family, monkeypatch, capsys):
    """As above, with the real mechanism of each family."""
    D, D2, i = _neighbours()
    _assert_same_path(_fit_observation(D, family, monkeypatch), _fit_observation(D2, family, monkeypatch), i)
    assert capsys.readouterr() == ("", "")


# ---------------------------------------------------------- the command line


def _csv_bytes(frame):
    return frame.to_csv(index=False, lineterminator="\n").encode()


#: Lines of a CSV record that pandas alone would refuse, drop or let change other
#: records (by its column typing), each a substitute for a clean record line.
BAD_LINES = {
    "extra field": None,  # built from the clean line: one field more
    "missing fields": b"flu,N",
    "unclosed quote": b'cold,"S,01,True,False,40,1000,1,3',
    "invalid UTF-8": b"\xff\xfe\xfa,N,01,True,False,40,1000,1,3",
    "NUL byte": b"fl\x00u,N,01,True,False,40,1000,1,3",
    "blank line": b"",
    "text in numbers": b"other,S,x,sometimes,maybe,forty,n/a?,2.5,1e999",
}


def _neighbour_files(tmp_path, bad, i=4):
    """A clean CSV and its neighbour with record ``i``'s line replaced by ``bad``."""
    D = clean_frame(50)
    clean = _csv_bytes(D)
    lines = clean.split(b"\n")
    line = lines[i + 1]
    lines[i + 1] = line + b",EXTRA" if bad is None else bad
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    a.write_bytes(clean)
    b.write_bytes(b"\n".join(lines))
    schema = tmp_path / "schema.json"
    SCHEMA.save(schema)
    return a, b, schema, D, i


@pytest.mark.parametrize("bad", list(BAD_LINES), ids=list(BAD_LINES))
def test_cli_reads_each_record_on_its_own(tmp_path, bad):
    """With --schema, a malformed line is one record, mapped by the rules; the read
    neither fails, warns nor changes another record (as pandas' own typing of a
    column by all of its values would: the level "01" is the number 1 in a
    column of numbers, and the text "01" once a record holds text)."""
    import argparse

    from d3p.twin.cli import _read_csv

    a, b, schema, D, i = _neighbour_files(tmp_path, BAD_LINES[bad])
    read = []
    for path in (a, b):
        args = argparse.Namespace(input=str(path), na_values=None, schema=str(schema))
        data, error, warned = observe(lambda: _read_csv(args, SCHEMA))
        assert error is None and warned == [], (error, warned)
        read.append(observe(lambda: SCHEMA.encode(data)))
    (ca, ea, wa), (cb, eb, wb) = read
    assert ea is eb is None and wa == wb == []
    assert ca.shape == cb.shape == (len(D), len(SCHEMA))
    others = np.arange(len(D)) != i
    np.testing.assert_array_equal(ca[others], cb[others])
    np.testing.assert_array_equal(ca, SCHEMA.encode(D))  # the clean file reads as the table written
    assert ca[:, SCHEMA.names.index("code")].tolist().count(1.0) == (D.code == "01").sum()  # "01" is "01"


def _cli_observation(args, capsys):
    from d3p.twin.cli import main

    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    out = "\n".join(line for line in out.splitlines() if not line.lstrip().startswith("time"))
    return code, out, err


def _saved_public(path, family):
    import json

    desc = json.loads((path / "twin.json").read_text())
    desc["fit"].pop("seconds")
    if family == "marginal":  # the measured tables are chosen privately: noisy releases
        desc.pop("model"), desc.pop("params"), desc["privacy"].pop("measured")
    return desc


def _run_folders(tmp_path):
    """Folders ``run0`` and ``run1``, each with one neighbour's CSV as ``in.csv``
    (a clean one, and one with a record outside the schema)."""
    a, b, schema, D, i = _neighbour_files(tmp_path, BAD_LINES["text in numbers"])
    for k, path in enumerate((a, b)):
        run = tmp_path / f"run{k}"
        run.mkdir()
        (run / "in.csv").write_bytes(path.read_bytes())
        yield run, schema


def _cli_neighbours(tmp_path, capsys, family, extra):
    """``python -m d3p twin --schema`` on a clean CSV and on its neighbour with one
    record outside the schema (text, inf, undeclared levels), same seed."""
    runs = []
    for run, schema in _run_folders(tmp_path):
        args = [run / "in.csv", run / "syn.csv", "--epsilon", "1", "--schema", schema, "--seed", "3",
                "--family", family, "--save-model", run / "model", "--report-dir", run / "report", "--no-progress",
                *extra]
        code, out, err = _cli_observation(args, capsys)
        assert code == 0, err
        # The utility figures compare the twin with the real records and are
        # printed as such (outside the guarantee); everything before them is
        # what the private run shows.
        head, sep, _ = out.partition("  utility   computed on the REAL data")
        assert sep, out
        out = head
        syn = pd.read_csv(run / "syn.csv")
        runs.append((code, out.replace(str(run), "RUN"), err.replace(str(run), "RUN"),
                     _saved_public(run / "model", family), list(syn.columns), len(syn),
                     sorted(p.name for p in (run / "report").iterdir())))
    return runs


def test_cli_on_neighbours_prints_and_writes_the_same(tmp_path, capsys, monkeypatch):
    """Exit status, printed lines (timings masked), saved twin (no parameters)
    and the synthetic table's shape are identical (DPSVI.run stubbed: the
    mechanism's own output is a noisy release)."""
    seen = {}
    monkeypatch.setattr(d3p.svi.DPSVI, "run", _stub_run(seen))
    a, b = _cli_neighbours(tmp_path, capsys, "mixture", ["--steps", "3", "--components", "2", "--q", "0.2"])
    assert a == b


@pytest.mark.slow
def test_cli_on_neighbours_marginal(tmp_path, capsys):
    """As above, the marginal twin with its real mechanism."""
    a, b = _cli_neighbours(tmp_path, capsys, "marginal", [])
    assert a == b


def test_twin_schema_on_neighbours_writes_the_same(tmp_path, capsys):
    """``python -m d3p twin-schema --schema`` with a complete schema: the same
    output and the same schema file (the given one) on both neighbours."""
    from d3p.__main__ import main as d3p_main

    runs = []
    for run, schema in _run_folders(tmp_path):
        code = d3p_main(["twin-schema", str(run / "in.csv"), str(run / "schema.json"), "--schema", str(schema)])
        out, err = capsys.readouterr()
        runs.append((code, out.replace(str(run), "RUN"), err.replace(str(run), "RUN"),
                     (run / "schema.json").read_text()))
    assert runs[0] == runs[1] and runs[0][0] == 0
    assert Schema.from_json(runs[0][3]) == SCHEMA
