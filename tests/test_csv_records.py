"""With a schema, the command line reads a CSV file one record per line.

``python -m d3p twin --schema`` and ``twin-schema --schema`` read every line
after the header as exactly one record, whatever bytes it holds: the record
boundary is a public rule (the ``\\n`` byte) that no content can move. If a
line could become several records (a carriage return the parser took for a
line break, a quote that runs on), one person would weigh as many: N, the
default delta, the number of synthetic rows and the noise calibrated to N
would all change with one record's content.

The tests write a small table, then for every kind of adversarial line
(:data:`VARIANTS`: carriage returns, quotes, NUL, a BOM, a field over the
``csv`` module's size limit, invalid UTF-8, extra or missing separators, ...)
run the command's entry point (``d3p.__main__.main``) on D and on its
neighbour D' (:data:`POSITIONS`: the line replaced under the substitute
relation, or added under add/remove, at the first, a middle or the last
line, with or without a final newline) and compare, with the neighbour
harness (``tests/_neighbours.py``), the records read, the public outputs
(the schema, the summary with epsilon and delta, the number of synthetic
rows) and the path (exit status, errors, warnings, printed lines with
timings masked). The reader's rules themselves (how a line is split into
fields, BOM, line endings, blank lines) are tested on :mod:`d3p.twin._csv_records`.
"""

import argparse
import os
import re

import pandas as pd
import pytest

from _neighbours import Release, compare, observe

# ------------------------------------------------------------------ the data

#: The header and the typical records of D (30 records, every level and both booleans).
HEADER = b"x,c,b"
TYPICAL = [f"{10 + 2.5 * i:g},{'abc'[i % 3]},{'True' if i % 2 else 'False'}".encode() for i in range(30)]
#: The typical line that D holds where D' holds the adversarial one.
TYPICAL_LINE = b"50.5,a,True"

#: Adversarial lines (no ``\\n`` byte: each is one line of the file).
VARIANTS = {
    "cr_1000_in_field": b"50.5,a" + b"\r" * 1000 + b",True",
    "cr_unquoted_records": b"50.5,a\r1,b,False\r2,c,True\r3,a,False",
    "cr_lone_field": b"50.5,\r,True",
    "cr_quoted": b'50.5,"a\rb\r",True',
    "cr_only": b"\r",
    "cr_only_1000": b"\r" * 1000,
    "cr_ending_doubled": b"50.5,a,True\r\r",
    "cr_leading": b"\r50.5,a,True",
    "line_separators": "50.5,a\u2028b\u2029c\x85d\x0be\x0cf\x1cg\x1dh\x1e,True".encode(),
    "quote_unclosed": b'50.5,"a,True',
    "quote_unclosed_cr": b'"' + b"\r1,a,True" * 50,
    "quote_doubled_cr": b'50.5,"a""\r""b",True',
    "quote_in_field": b'50.5,a"b\r"c,True',
    "quotes_only": b'"' * 1001,
    "quote_then_text": b'"50.5"x,"a" "b",True',
    "nul": b"50.5\x00,a\x00,\x00True",
    "nul_only": b"\x00" * 100,
    "bom_at_start": b"\xef\xbb\xbf50.5,a,True",
    "bom_in_field": b"50.5,\xef\xbb\xbfa,True",
    "huge_field": b"50.5," + b"a" * 200_000 + b",True",
    "huge_quoted_field": b'50.5,"' + b"\r," * 100_000 + b'",True',
    "huge_unclosed_quote": b'50.5,"' + b"a\r" * 100_000,
    "invalid_utf8": b"\xff\xfe50.5,\xc3(,\xed\xa0\x80True",
    "truncated_utf8_at_end": b"50.5,a,True\xe2\x82",
    "utf16": "50.5,a,True\r".encode("utf-16"),
    "extra_fields": b"50.5,a,True,1,2,3,,,,",
    "missing_fields": b"50.5",
    "empty": b"",
    "blank": b"   \t ",
    "commas_only": b"," * 1000,
    "other_separators": b"50.5;a;True\t1|2",
    "header_again": HEADER,
    "comment": b"#50.5,a,True",
    "backslashes": b"50.5,a\\,True\\",
    "eof_char": b"\x1a50.5,a,True",
    "out_of_schema": b"1e999,HIV+ (confidential),sometimes",
}
#: The kinds the issue names: the default step runs the whole command on these
#: (and ``twin-schema`` on every kind); the slow step runs ``twin`` on all kinds.
DEFAULT_TWIN_VARIANTS = ("cr_1000_in_field", "cr_quoted", "cr_only_1000", "quote_unclosed_cr", "nul",
                         "bom_at_start", "huge_quoted_field", "invalid_utf8", "extra_fields", "missing_fields",
                         "empty", "line_separators")

#: Where D' differs from D: (relation, place, whether the file ends with a newline).
POSITIONS = {
    "substitute-first": ("substitute", 0, True),
    "substitute-middle": ("substitute", 15, True),
    "substitute-last": ("substitute", len(TYPICAL) - 1, True),
    "substitute-last-unterminated": ("substitute", len(TYPICAL) - 1, False),
    "add-first": ("add", 0, True),
    "add-middle": ("add", 15, True),
    "add-end-unterminated": ("add", len(TYPICAL), False),
}
DEFAULT_TWIN_POSITIONS = ("substitute-middle", "add-end-unterminated")


def applies(variant, position):
    """An empty last line without a final newline is no line: those files are
    the file without it (an empty line elsewhere is a record: ``empty``)."""
    return VARIANTS[variant] or POSITIONS[position][2]


#: Every variant at every position.
PAIRS = [(v, p) for v in VARIANTS for p in POSITIONS if applies(v, p)]


def schema():
    """A complete (public) schema: nothing is read from the data."""
    from d3p.twin.schema import ColumnSpec, Schema

    return Schema((
        ColumnSpec("x", "real", "float64", False, lower=0.0, upper=100.0, distribution="normal"),
        ColumnSpec("c", "categorical", "str", False, levels=("a", "b", "c", "other"), other="other",
                   distribution="categorical"),
        ColumnSpec("b", "boolean", "bool", True, distribution="bernoulli"),
    ))


def file_bytes(lines, terminated=True):
    """The file of ``lines`` (bytes, without their ``\\n``) under :data:`HEADER`."""
    return b"\n".join([HEADER, *lines]) + (b"\n" if terminated else b"")


def neighbours(variant, position):
    """(D, D', the number of records of D') as file contents.

    Substitute: D' is D with one line replaced. Add/remove: D' is D with one
    line added; D is then D' with the typical line in its place (the same N),
    and D' must hold exactly one record more than the table without it.
    """
    relation, place, terminated = POSITIONS[position]
    line = VARIANTS[variant]
    assert b"\n" not in line, variant
    d, d2 = list(TYPICAL), list(TYPICAL)
    if relation == "substitute":
        d[place] = TYPICAL_LINE
        d2[place] = line
    else:
        d.insert(place, TYPICAL_LINE)
        d2.insert(place, line)
    assert len(d2) == len(TYPICAL) + (relation == "add")
    return file_bytes(d, terminated), file_bytes(d2, terminated), len(d2)


# ------------------------------------------------------------ the command line

#: Figures in the command's output that are timings, masked before the comparison.
MASKS = (r"\d+(\.\d+)? s\b",)
#: The command's fast settings (the marginal twin: no DP-VI compilation).
TWIN_ARGS = ["--family", "marginal", "--epsilon", "1", "--seed", "5", "--no-progress", "--no-utility"]
#: The batch sampling of each relation: the twin's guarantee is stated under it.
SAMPLING = {"substitute": "fixed", "add": "poisson"}

_READ = re.compile(r"read (\d+) records?")


def _write(directory, content):
    os.makedirs(directory)
    with open(os.path.join(directory, "in.csv"), "wb") as f:
        f.write(content)
    schema().save(os.path.join(directory, "schema.json"))


def _run(directory, argv):
    from d3p.__main__ import main

    old = os.getcwd()
    os.chdir(directory)
    try:
        return main(argv)
    finally:
        os.chdir(old)


def twin_release(directory, relation):
    """``python -m d3p twin in.csv out.csv --schema schema.json ...``: its exit
    status and the synthetic table's header and number of lines (its rows are
    post-processing of the noisy release); the summary (epsilon, delta, N,
    the synthetic rows) is printed, and compared as the path."""
    status = _run(directory, ["twin", "in.csv", "out.csv", "--schema", "schema.json",
                              "--sampling", SAMPLING[relation], *TWIN_ARGS])
    public = {"status": status}
    if status == 0:
        with open(os.path.join(directory, "out.csv"), "rb") as f:
            lines = f.read().split(b"\n")
        public["synthetic"] = {"header": lines[0], "lines": len(lines)}
    return Release(public=public)


def twin_schema_release(directory, relation):
    """``python -m d3p twin-schema in.csv out.json --schema schema.json``: its
    exit status and the schema it writes (printed lines are the path)."""
    status = _run(directory, ["twin-schema", "in.csv", "out.json", "--schema", "schema.json"])
    public = {"status": status}
    if status == 0:
        with open(os.path.join(directory, "out.json"), "rb") as f:
            public["schema"] = f.read()
    return Release(public=public)


COMMANDS = {"twin": twin_release, "twin-schema": twin_schema_release}

#: D's observations, kept: D is the same for every variant at a position.
_observed = {}


def records_read(observation):
    """The number of records the command says it read (its stderr), or None."""
    found = _READ.findall(observation.stderr)
    return int(found[0]) if found else None


def observe_file(directory, content, command, relation):
    _write(directory, content)
    return observe(lambda: COMMANDS[command](directory, relation), masks=MASKS)


def check(command, variant, position, tmp_path):
    relation = POSITIONS[position][0]
    d, d2, expected = neighbours(variant, position)
    key = (command, position)
    if key not in _observed:
        _observed[key] = observe_file(os.path.join(tmp_path, "d"), d, command, relation)
    od = _observed[key]
    od2 = observe_file(os.path.join(tmp_path, "d2"), d2, command, relation)
    what = f"{command} {variant} {position}"
    assert od.release.public["status"] == 0, (what, od.stderr)
    # the public rule: every line after the header is exactly one record
    assert records_read(od) == expected, (what, od.stderr)
    assert records_read(od2) == expected, f"[{what}] D' has {expected} lines but read as {records_read(od2)} records"
    compare(od, od2, what=what)


@pytest.mark.parametrize("variant, position", PAIRS)
def test_twin_schema_reads_one_record_per_line(variant, position, tmp_path):
    check("twin-schema", variant, position, tmp_path)


@pytest.mark.parametrize("variant, position", [(v, p) for v, p in PAIRS if v in DEFAULT_TWIN_VARIANTS
                                               and p in DEFAULT_TWIN_POSITIONS])
def test_twin_reads_one_record_per_line(variant, position, tmp_path):
    check("twin", variant, position, tmp_path)


SLOW_TWIN_PAIRS = [(v, p) for v, p in PAIRS if not (v in DEFAULT_TWIN_VARIANTS and p in DEFAULT_TWIN_POSITIONS)]


@pytest.mark.slow
@pytest.mark.parametrize("variant, position", SLOW_TWIN_PAIRS)
def test_twin_reads_one_record_per_line_slow(variant, position, tmp_path):
    check("twin", variant, position, tmp_path)


# ------------------------------------------------------------- the reader


def read(tmp_path, content, name="in.csv"):
    """The table ``d3p twin --schema`` reads from a file of ``content``."""
    from d3p.twin.cli import _read_csv

    path = os.path.join(tmp_path, name)
    with open(path, "wb") as f:
        f.write(content)
    return _read_csv(argparse.Namespace(input=path, na_values=None), schema())


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_line_is_one_record_and_others_are_unchanged(variant, tmp_path):
    """The variant's line is one record; every other record reads as it does without it."""
    d, d2, expected = neighbours(variant, "substitute-middle")
    a, b = read(tmp_path, d, "d.csv"), read(tmp_path, d2, "d2.csv")
    assert len(b) == len(a) == expected
    assert list(b.columns) == list(a.columns) == ["x", "c", "b"]
    others = [i for i in range(expected) if i != 15]
    pd.testing.assert_frame_equal(a.iloc[others], b.iloc[others])


def fields(line):
    from d3p.twin._csv_records import split_line

    return split_line(line)


@pytest.mark.parametrize("line, expected", [
    ("", [""]),
    ("a", ["a"]),
    ("a,b,,c", ["a", "b", "", "c"]),
    ("a, b,  c", ["a", "b", "c"]),                # spaces after a comma skipped
    ("a ,b", ["a ", "b"]),                        # not before one
    ('"a,b",c', ["a,b", "c"]),
    ('"a""b",c', ['a"b', "c"]),                   # a doubled quote is a quote
    ('"a"b,c', ["ab", "c"]),                      # text after the closing quote is kept
    ('"a" "b",c', ['a "b"', "c"]),
    ('a"b,c', ['a"b', "c"]),                      # a quote inside an unquoted field is text
    ('"a,b', ["a,b"]),                            # an unclosed quote runs to the end of the line
    ('"', [""]),
    ('""', [""]),
    ('"""', ['"']),
    ("a\rb,\r", ["a\rb", "\r"]),                  # a carriage return is text
    ('"a\rb"\r,c', ["a\rb\r", "c"]),
    ("\ufeffa,b", ["\ufeffa", "b"]),              # so is a BOM in a record
    ("a\u2028b\x85c,d", ["a\u2028b\x85c", "d"]),  # and Unicode's line separators
    ("a;b\tc", ["a;b\tc"]),                       # only the comma separates
])
def test_fields_of_a_line(line, expected):
    assert fields(line) == expected


def test_field_over_the_csv_size_limit(tmp_path):
    import csv

    big = "a" * (csv.field_size_limit() + 10)
    assert fields(f'1,{big},"{big}"') == ["1", big, big]
    table = read(tmp_path, file_bytes([f'1,"{big}\r{big}",True'.encode(), TYPICAL_LINE]))
    assert len(table) == 2 and table["c"][0] == f"{big}\r{big}"


def test_values_read_as_text_exactly(tmp_path):
    """The fields of a record reach the schema's rules as the line holds them
    (the columns are read as text, value by value)."""
    table = read(tmp_path, file_bytes([b'01,"a\rb""c",true', b' 1e999 ,\x00,\r', b"\xff,\xef\xbb\xbfa,T"]))
    assert list(table["x"]) == ["01", "1e999 ", "\ufffd"]
    assert list(table["c"]) == ['a\rb"c', "\ufffd", "\ufeffa"]
    assert table["b"][0] == "true" and table["b"][2] == "T"
    assert pd.isna(table["b"][1])  # "\r": the line's ending, then an empty field: missing


def test_line_endings(tmp_path):
    """``\\n`` ends a line; a ``\\r`` just before it (or at the end of the file)
    belongs to the line ending; any other ``\\r`` is text."""
    lf = read(tmp_path, b"x,c,b\n1,a,True\n2,b,False\n", "lf.csv")
    crlf = read(tmp_path, b"x,c,b\r\n1,a,True\r\n2,b,False\r\n", "crlf.csv")
    last = read(tmp_path, b"x,c,b\r\n1,a,True\r\n2,b,False\r", "last.csv")
    pd.testing.assert_frame_equal(lf, crlf)
    pd.testing.assert_frame_equal(lf, last)
    two = read(tmp_path, b"x,c,b\n1,a,True\r\r\n", "two.csv")
    assert len(two) == 1 and two["b"][0] == "True\r"


def test_cr_line_endings_are_refused_without_quoting_the_header(tmp_path, capsys):
    """A header line that holds a ``\\r`` before its end is a file with CR line
    endings (every record would be in the header): refused, and the message
    quotes nothing of the line."""
    directory = os.path.join(tmp_path, "cr")
    _write(directory, b"x,c,b\r1,secret,True\r2,b,False\r")
    status = _run(directory, ["twin-schema", "in.csv", "out.json", "--schema", "schema.json"])
    err = capsys.readouterr().err
    assert status == 2 and "carriage return" in err and "line 1" in err and "secret" not in err


def test_blank_lines_and_the_final_newline(tmp_path):
    """Blank lines before the header are skipped; after it, every line is a
    record (a blank one with every value missing); the final newline ends the
    last line and starts none."""
    table = read(tmp_path, b"\xef\xbb\xbf\n \r\nx,c,b\n1,a,True\n\n  \n\r\n2,b,False\n\n")
    assert len(table) == 6
    assert list(table["x"])[0] == "1" and list(table["x"])[4] == "2"
    for i in (1, 3, 5):
        assert table.iloc[i].isna().all(), i
    assert table["x"].isna()[2]  # "  ": spaces skipped, then an empty field


def test_bom_at_the_start_of_the_file(tmp_path):
    """A BOM that starts the file is not part of the header; anywhere else it is text."""
    plain = read(tmp_path, b"x,c,b\n1,a,True\n", "plain.csv")
    bom = read(tmp_path, b"\xef\xbb\xbfx,c,b\n1,a,True\n", "bom.csv")
    pd.testing.assert_frame_equal(plain, bom)
    in_record = read(tmp_path, b"x,c,b\n\xef\xbb\xbf1,a,True\n", "record.csv")
    assert in_record["x"][0] == "\ufeff1"


def test_too_many_and_too_few_fields(tmp_path):
    table = read(tmp_path, file_bytes([b"1,a,True,extra,,", b"2", b"3,b"]))
    assert list(table["x"]) == ["1", "2", "3"]
    assert list(table["c"].isna()) == [False, True, False]
    assert list(table["b"].isna()) == [False, True, True]


def test_header_only_and_empty(tmp_path):
    assert len(read(tmp_path, b"x,c,b\n", "header.csv")) == 0
    assert len(read(tmp_path, b"\xef\xbb\xbfx,c,b\r\n", "header_crlf.csv")) == 0
    from d3p.twin.cli import _BadInput

    with pytest.raises(_BadInput, match="no header row"):
        read(tmp_path, b"\n \n\r\n", "blank.csv")


def test_the_input_file_is_only_read(tmp_path):
    content = file_bytes([VARIANTS["cr_1000_in_field"], VARIANTS["invalid_utf8"], VARIANTS["nul"]], False)
    read(tmp_path, content)
    with open(os.path.join(tmp_path, "in.csv"), "rb") as f:
        assert f.read() == content
