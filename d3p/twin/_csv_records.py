"""The records of a CSV file read with a public schema: one record per line.

The command line (``python -m d3p twin --schema``, ``twin-schema --schema``)
reads its input here. The record boundary is a public rule that no content
can move, so that one record is always one record (were a line to become
several, one person would weigh as many, and N, the default delta, the
noise calibrated to N and the number of synthetic rows would change with its
content). Each rule below reads one line only:

* **Lines.** The file's bytes are split at the byte ``\\n`` and at nothing
  else: a carriage return, quotes, NUL, a BOM, Unicode's line separators and
  invalid UTF-8 are content of their line. A ``\\r`` just before the ``\\n``
  (or at the very end of the file) belongs to the line ending and is dropped
  (files written with ``\\r\\n`` read as with ``\\n``); any other ``\\r`` is
  text of its field. A newline that ends the file ends the last line and
  starts none; an unterminated last line is a line if it holds any byte.
* **Header.** A UTF-8 BOM at the very start of the file is dropped. Blank
  lines (only whitespace) before the first other line are skipped; that line
  is the header and every line after it is exactly one record. A header that
  holds a ``\\r`` before its end is refused (:class:`CarriageReturnInHeader`):
  it is a file with CR line endings, whose records would all be in the
  header line.
* **Text.** Each line is decoded as UTF-8 on its own; a byte sequence that
  is not UTF-8 becomes U+FFFD (Python's ``errors="replace"``); NUL characters
  become U+FFFD too.
* **Fields** (:func:`split_line`): the line is split at commas; spaces at the
  start of a field are skipped; a field that then starts with ``"`` is
  quoted: it runs to the next ``"`` that is not doubled (``""`` is a ``"``),
  may hold commas, and text after its closing quote up to the next comma is
  kept; a quote that is never closed runs to the end of the line. Any other
  field is the text up to the next comma (a ``"`` in it is text). There is no
  limit on a field's length.
* **Width.** A record with more fields than the header keeps the first ones;
  one with fewer is padded with empty fields. An empty field, or one that is
  a missing-value string (pandas' default list and ``--na-values``), is
  missing; a blank line is thus a record with every value missing.

The values are then mapped by the schema's documented rules
(:meth:`d3p.twin.Schema.encode`), like any other value.
"""

from __future__ import annotations

import csv
import io
from typing import List, Optional, Sequence, Tuple

__all__ = ["split_line", "read_lines", "read_records", "records_frame", "CarriageReturnInHeader"]

_BOM = b"\xef\xbb\xbf"


class CarriageReturnInHeader(ValueError):
    """The header line holds a carriage return before its end (a file with CR
    line endings); the message quotes nothing of the line."""


def split_line(line: str) -> List[str]:
    """The fields of one line (without its line ending), by the rules of the
    module docstring; never fails, at least one field."""
    fields = []
    n = len(line)
    i = 0
    while True:
        while i < n and line[i] == " ":
            i += 1
        if i < n and line[i] == '"':
            parts = []
            i += 1
            while True:
                close = line.find('"', i)
                if close < 0:  # never closed: to the end of the line
                    parts.append(line[i:])
                    i = n
                    break
                parts.append(line[i:close])
                if close + 1 < n and line[close + 1] == '"':  # a doubled quote
                    parts.append('"')
                    i = close + 2
                    continue
                i = close + 1
                break
            comma = line.find(",", i)
            end = n if comma < 0 else comma
            parts.append(line[i:end])  # text after the closing quote
            fields.append("".join(parts))
            i = end
        else:
            comma = line.find(",", i)
            end = n if comma < 0 else comma
            fields.append(line[i:end])
            i = end
        if i >= n:
            return fields
        i += 1  # the comma
        if i == n:
            fields.append("")
            return fields


def read_lines(data: bytes) -> List[str]:
    """The lines of a file's ``data``, decoded, without their line endings
    (see the module docstring)."""
    if data.startswith(_BOM):
        data = data[len(_BOM):]
    pieces = data.split(b"\n")
    if pieces[-1] == b"":
        pieces.pop()  # the newline that ends the last line
    lines = []
    for piece in pieces:
        if piece.endswith(b"\r"):
            piece = piece[:-1]
        lines.append(piece.decode("utf-8", errors="replace").replace("\0", "\ufffd"))
    return lines


def read_records(data: bytes) -> Optional[Tuple[List[str], List[List[str]]]]:
    """The header's fields and the records (each a list of exactly as many
    fields as the header) of a file's ``data``; None if it has no header line.

    :raises CarriageReturnInHeader: if the header line holds a ``\\r``.
    """
    lines = read_lines(data)
    start = 0
    while start < len(lines) and not lines[start].strip():
        start += 1
    if start == len(lines):
        return None
    if "\r" in lines[start]:
        raise CarriageReturnInHeader(
            f"line {start + 1} (the header) holds a carriage return (\\r) before its end: with a schema, a "
            "record is one line ended by \\n (or \\r\\n), and a file with CR line endings would be read as one "
            "header line; convert its line endings to \\n")
    header = split_line(lines[start])
    width = len(header)
    records = []
    for line in lines[start + 1:]:
        fields = split_line(line)
        if len(fields) >= width:
            records.append(fields[:width])
        else:
            records.append(fields + [""] * (width - len(fields)))
    return header, records


def records_frame(data: bytes, *, text_columns: Sequence[str] = (), na_values: Optional[Sequence[str]] = None,
                  all_text: bool = False):
    """The table of a file's ``data``: one row per record of :func:`read_records`.

    The columns ``text_columns`` (every column with ``all_text``: the schema is then read
    privately, value by value) are read as text, value by value; the others
    are typed by pandas (schema inference, outside epsilon). Missing values:
    empty fields, pandas' default missing-value strings and ``na_values``.
    The fields reach pandas fully quoted, one record per line, so that no
    content is read as a line break, a separator or a quote; the number of
    rows is checked against the number of records.

    :return: a ``pandas.DataFrame``, or None if ``data`` has no header line.
    :raises CarriageReturnInHeader: if the header line holds a ``\\r``.
    """
    import pandas as pd

    read = read_records(data)
    if read is None:
        return None
    header, records = read
    out = io.StringIO()
    writer = csv.writer(out, quoting=csv.QUOTE_ALL, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(records)
    text = out.getvalue()
    as_text = str if all_text else {name: str for name in text_columns}
    # low_memory=False: pandas would otherwise type a column chunk by chunk and
    # warn (DtypeWarning) when one record makes the chunks' types differ
    frame = pd.read_csv(io.StringIO(text), skip_blank_lines=False, dtype=as_text, na_values=na_values,
                        low_memory=False)
    if len(frame) != len(records):  # cannot happen: every record is one quoted line
        raise RuntimeError(f"Internal error: {len(records)} records read as {len(frame)} rows.")
    return frame
