# SPDX-License-Identifier: Apache-2.0
"""The package stays a picture of its architecture (STYLE.md rules 15 and 18).

Measured from the source with :mod:`ast`:

- no module over 800 lines;
- ``DPSVI``'s class body under 500 lines (docstring included), a class that
  wires small parts together as NumPyro's ``SVI`` does;
- no function over 60 lines (from ``def`` to its last line, docstring
  included) in the privacy-critical modules: the step, its sum, clipping and
  noise, the samplers, the accounting and calibration, the ledger, the
  random suites;
- no import circle among d3p's modules (imports inside functions count;
  a package's ``__init__``, which only re-exports, is not a node).
"""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "d3p"

#: The privacy-critical modules (paths relative to the package; a folder: every module in it).
PRIVACY_CRITICAL = (
    "svi.py", "gradients.py", "_strategies.py", "_clipping.py", "_certified_sum.py", "_fixed_point.py",
    "_ghost.py", "_samplers.py", "_uniform_draws.py", "_batchify.py", "minibatch.py", "_private_step.py",
    "_model_facts.py", "_init_state.py", "_elbo_terms.py", "_adaptive.py", "discrete.py", "accounting.py",
    "_zcdp_budget.py", "_accounting", "dputil.py", "ledger.py", "_sharding.py", "random",
    "twin/_schema_private.py", "twin/_fit_plan.py",
)


def _files(entries):
    for entry in entries:
        path = PACKAGE / entry
        yield from (sorted(path.rglob("*.py")) if path.is_dir() else [path])


def _lines(node) -> int:
    return node.end_lineno - node.lineno + 1


def test_no_module_is_over_800_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 800}
    assert not long


def test_dpsvi_class_body_is_under_500_lines():
    tree = ast.parse((PACKAGE / "svi.py").read_text(encoding="utf-8"))
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DPSVI"]
    assert _lines(cls) < 500


def test_no_function_over_60_lines_in_the_privacy_critical_modules():
    long = {}
    for path in _files(PRIVACY_CRITICAL):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _lines(node) > 60:
                long[f"{path.relative_to(PACKAGE)}:{node.name}"] = _lines(node)
    assert not long


def _module(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in PACKAGE.rglob("*.py")}
PACKAGES = {_module(p) for p in PACKAGE.rglob("__init__.py")}


def _edges(path: pathlib.Path) -> set:
    """The non-package d3p modules that ``path`` imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
    return {m for m in found if m in MODULES and m not in PACKAGES}


def _cycle(graph: dict):
    """One import circle of ``graph`` as a list of modules, or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circle():
    graph = {m: _edges(p) for m, p in MODULES.items() if m not in PACKAGES}
    assert _cycle(graph) is None


def test_the_circle_check_can_fail():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
