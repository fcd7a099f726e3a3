# SPDX-License-Identifier: Apache-2.0
"""The sampling/accounting layers import in one direction only.

From the bottom: ``d3p._sampling`` (the names of samplers and relations,
the overflow δ) < ``d3p.minibatch`` (samplers) and ``d3p._accounting`` <
``d3p.accounting`` < ``d3p.dputil`` (calibration) and ``d3p.ledger``. The
imports are read from the source with :mod:`ast`, including those inside
functions, so a lazy import that closes a loop is found too.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "d3p"


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: pathlib.Path) -> set:
    """Every d3p module that ``path`` imports, anywhere in the file
    (``from d3p import x`` counts as ``d3p.x``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name == "d3p" or name.startswith("d3p.")}


def _graph() -> dict:
    return {_module_name(p): _imports(p) for p in PACKAGE.rglob("*.py")}


def _reaches(graph: dict, start: str, prefixes) -> set:
    """The modules matching ``prefixes`` that ``start`` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for name in graph.get(todo.pop(), ()):
            if name not in seen:
                seen.add(name)
                todo.append(name)
    return {n for n in seen if any(n == p or n.startswith(p + ".") for p in prefixes)}


GRAPH = _graph()


def test_the_graph_is_read():
    assert "d3p._sampling" in GRAPH["d3p.minibatch"]
    assert "d3p.accounting" in GRAPH["d3p.dputil"]


@pytest.mark.parametrize("module", ["d3p.minibatch", "d3p._sampling"])
def test_samplers_know_nothing_of_accounting(module):
    assert _reaches(GRAPH, module, ["d3p.accounting", "d3p._accounting", "d3p.dputil", "d3p.ledger"]) == set()


@pytest.mark.parametrize("module", ["d3p.accounting"] + sorted(n for n in GRAPH if n.startswith("d3p._accounting")))
def test_accounting_imports_neither_samplers_nor_calibration(module):
    assert _reaches(GRAPH, module, ["d3p.minibatch", "d3p.dputil", "d3p.ledger", "d3p.svi"]) == set()


def test_calibration_and_ledger_sit_above_accounting():
    for module in ("d3p.dputil", "d3p.ledger"):
        assert "d3p.accounting" in _reaches(GRAPH, module, ["d3p.accounting"])
        assert _reaches(GRAPH, module, ["d3p.minibatch", "d3p.svi"]) == set()


def test_the_names_are_shared():
    import d3p.accounting
    import d3p.minibatch

    assert d3p.minibatch.ADD_REMOVE is d3p.accounting.ADD_REMOVE
    assert d3p.minibatch.SUBSTITUTE is d3p.accounting.SUBSTITUTE
