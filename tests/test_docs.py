"""The documentation builds without warnings, documents every public name, and
its docstring examples run as doctests."""

import doctest
import importlib
import inspect
import io
import pathlib
import subprocess
import sys
import zlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

# Modules whose ``__all__`` is public API and must appear in docs/api.rst.
PUBLIC_MODULES = [
    "d3p",
    "d3p.__main__",
    "d3p.svi",
    "d3p.minibatch",
    "d3p.gradients",
    "d3p.discrete",
    "d3p.accounting",
    "d3p.selection",
    "d3p.dputil",
    "d3p.random",
    "d3p.random.debug",
    "d3p.modelling",
    "d3p.util",
    "d3p.audit",
    "d3p.gmm",
    "d3p.optimizers",
    "d3p.twin",
]


def _module_name(path):
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# Every module of the package with a docstring example, found without importing.
DOCTEST_MODULES = sorted(
    _module_name(path)
    for path in (ROOT / "d3p").rglob("*.py")
    if ">>>" in path.read_text(encoding="utf-8")
)


@pytest.fixture(scope="module")
def html_build(tmp_path_factory):
    """Build the HTML site once, as CI does: warnings are errors."""
    out = tmp_path_factory.mktemp("docs")
    command = [
        sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
        "-d", str(out / "doctrees"), str(DOCS), str(out / "html"),
    ]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    return proc, out / "html"


def _inventory_names(path):
    """Names of the objects in a Sphinx ``objects.inv`` (format version 2)."""
    data = path.read_bytes()
    for _ in range(4):  # four plain-text header lines, then zlib
        data = data[data.index(b"\n") + 1:]
    lines = zlib.decompress(data).decode().splitlines()
    return {line.split(" ", 1)[0] for line in lines if line.strip()}


def test_docs_build_without_warnings(html_build):
    proc, html = html_build
    assert proc.returncode == 0, f"sphinx-build failed:\n{proc.stdout}\n{proc.stderr}"
    for page in ["index", "api", "privacy", "auditing", "twin", "examples", "benchmarks"]:
        assert (html / f"{page}.html").is_file(), page


def test_api_reference_covers_every_public_name(html_build):
    _, html = html_build
    documented = _inventory_names(html / "objects.inv")
    missing = []
    for module_name in PUBLIC_MODULES:
        assert module_name in documented, f"module {module_name} is not in the API reference"
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            candidates = {f"{module_name}.{name}"}
            if inspect.ismodule(obj):
                candidates.add(obj.__name__)
            elif getattr(obj, "__module__", None) and hasattr(obj, "__qualname__"):
                candidates.add(f"{obj.__module__}.{obj.__qualname__}")  # re-exported
            if not candidates & documented:
                missing.append(f"{module_name}.{name}")
    assert not missing, f"public names missing from docs/api.rst: {missing}"


@pytest.mark.parametrize("module_name", DOCTEST_MODULES)
@pytest.mark.float32
def test_docstring_examples(module_name):
    module = importlib.import_module(module_name)
    tests = [t for t in doctest.DocTestFinder().find(module) if t.examples]
    assert tests, f"{module_name} has '>>>' in its source but no doctest was found"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    report = io.StringIO()
    for test in tests:
        runner.run(test, out=report.write)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, report.getvalue()
