"""Conformance on NumPyro's own SVI tests: ``numpyro.infer.SVI`` replaced by
``DPSVI`` with no noise and no clipping (σ = 0, C = inf).

The script fetches NumPyro's ``test/infer/test_svi.py`` for the installed
NumPyro version (never stored in this repository), writes it with a
``conftest.py`` that replaces ``numpyro.infer.SVI`` by a class with SVI's
signature that builds ``DPSVI(model, guide, optim, loss, clipping_threshold=inf,
dp_scale=0, **static_kwargs)``, runs it under pytest in a temporary folder and
reports the tests run, passed, and each failure's class (exception type and the
head of its message; "d3p refusal" where d3p raised it).

It runs the file twice: as NumPyro wrote it, and with the one-line edit of
docs/migration.md ("From numpyro.infer.SVI") applied to every model that takes
its data as an argument: the records plate declares the data set's size and
subsamples the batch it is given (``numpyro.plate("N", len(data))`` becomes
``numpyro.plate("N", 10, subsample_size=len(data))``, the tests' data having 10
records).

Where the file comes from, in order: ``--tests PATH`` (a copy from a NumPyro
checkout of the installed version); the sdist of the installed version
(``pip download numpyro==VERSION --no-deps --no-binary :all:``), if it ships
``test/infer/``; the source archive of the version's tag on GitHub. (NumPyro
0.22.0's sdist ships only ``test/*.py``, not ``test/infer/``.)

Usage::

    python benchmarks/numpyro_conformance.py [--tests PATH] [--json OUT] [--keep DIR]

Needs the network unless ``--tests`` is given; runs on CPU in a few minutes.
"""

import argparse
import collections
import io
import json
import os
import pathlib
import re
import subprocess
import sys
import tarfile
import tempfile
import urllib.request

TEST_PATH = "test/infer/test_svi.py"

#: The one-line edit of docs/migration.md, as applied to NumPyro's tests: (old, new).
EDITS = (
    ('numpyro.plate("N", len(data))', 'numpyro.plate("N", 10, subsample_size=len(data))'),
)

CONFTEST = '''
import json, math, os
import numpyro.infer, numpyro.infer.svi
from d3p.svi import DPSVI


class SVI(DPSVI):
    """numpyro.infer.SVI's signature; d3p's DPSVI without noise or clipping (sigma = 0, C = inf)."""

    def __init__(self, model, guide, optim, loss, **static_kwargs):
        super().__init__(model, guide, optim, loss, clipping_threshold=math.inf, dp_scale=0.0, **static_kwargs)


numpyro.infer.SVI = SVI
numpyro.infer.svi.SVI = SVI
_RESULTS = []


def _package(path):
    """The package of a source file (d3p, numpyro, jax, optax, or the test)."""
    path = str(path).replace(os.sep, "/")
    for package in ("d3p", "numpyro", "jax", "optax"):
        if f"/{package}/" in path:
            return package
    return "test"


def _innermost(exc):
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return _package(tb.tb_frame.f_code.co_filename) if tb is not None else "unknown"


def _failure(excinfo):
    """type, message and raising package; where pytest.raises or pytest.warns
    failed because another exception came out, that exception's (marked)."""
    exc, inner = excinfo.value, excinfo.value.__cause__ or excinfo.value.__context__
    if inner is not None and excinfo.typename in ("Failed", "AssertionError"):
        return dict(type=type(inner).__name__ + " (the test expected another error or a warning)",
                    message=str(inner), raised_by=_innermost(inner))
    return dict(type=excinfo.typename, message=str(exc), raised_by=_package(excinfo.traceback[-1].path))


def pytest_runtest_makereport(item, call):
    if call.when != "call" and call.excinfo is None:
        return
    entry = {"test": item.nodeid, "when": call.when, "outcome": "passed" if call.excinfo is None else "failed"}
    if call.excinfo is not None:
        if call.excinfo.errisinstance(__import__("pytest").skip.Exception):
            entry["outcome"] = "skipped"
        else:
            entry.update(_failure(call.excinfo))
    _RESULTS.append(entry)


def pytest_sessionfinish(session):
    with open(os.environ["D3P_CONFORMANCE_OUT"], "w") as f:
        json.dump(_RESULTS, f)
'''


def installed_numpyro_version() -> str:
    import numpyro

    return numpyro.__version__


def _from_tar(data: bytes, suffix: str):
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for member in tar.getmembers():
            if member.name.endswith(suffix):
                return tar.extractfile(member).read().decode("utf-8")
    return None


def fetch_tests(version: str, tmp: pathlib.Path) -> tuple:
    """``(text of test_svi.py, where it came from)``."""
    download = tmp / "sdist"
    command = [sys.executable, "-m", "pip", "download", f"numpyro=={version}", "--no-deps", "--no-binary",
               ":all:", "-d", str(download), "-q"]
    subprocess.run(command, check=False, capture_output=True, timeout=600)
    for archive in sorted(download.glob("numpyro-*.tar.gz")):
        text = _from_tar(archive.read_bytes(), "/" + TEST_PATH)
        if text is not None:
            return text, f"the sdist {archive.name}"
        print(f"{archive.name} has no {TEST_PATH}; trying the tag's source archive on GitHub", file=sys.stderr)
    url = f"https://github.com/pyro-ppl/numpyro/archive/refs/tags/{version}.tar.gz"
    try:
        with urllib.request.urlopen(url, timeout=120) as response:
            text = _from_tar(response.read(), "/" + TEST_PATH)
    except OSError as err:
        raise SystemExit(f"Could not fetch {url} ({err}). Pass --tests PATH: NumPyro's {TEST_PATH} of "
                         f"version {version} from a checkout.") from None
    if text is None:
        raise SystemExit(f"{url} has no {TEST_PATH}; pass --tests PATH.")
    return text, url


def apply_edits(text: str) -> tuple:
    """``(edited text, number of places edited)``."""
    count = 0
    for old, new in EDITS:
        count += text.count(old)
        text = text.replace(old, new)
    return text, count


def run_tests(text: str, folder: pathlib.Path) -> list:
    """The per-test results of ``text`` run under pytest in ``folder`` with the conftest."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "test_svi.py").write_text(text, encoding="utf-8")
    (folder / "conftest.py").write_text(CONFTEST, encoding="utf-8")
    (folder / "pytest.ini").write_text("[pytest]\n", encoding="utf-8")
    out = folder / "results.json"
    env = {**os.environ, "D3P_CONFORMANCE_OUT": str(out), "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    command = [sys.executable, "-m", "pytest", "test_svi.py", "-q", "-p", "no:cacheprovider", "-n", "0",
               "-c", "pytest.ini", "--rootdir", "."]
    subprocess.run(command, cwd=folder, env=env, check=False, capture_output=True, timeout=3600)
    return json.loads(out.read_text())


def failure_class(entry: dict) -> str:
    """``[package that raised] ExceptionType: head of the message``."""
    head = re.sub(r"\s+", " ", entry.get("message", ""))[:100]
    return f"[{entry.get('raised_by', 'unknown')}] {entry.get('type', '?')}: {head}"


def summary(results: list) -> dict:
    outcomes = collections.Counter(e["outcome"] for e in results)
    classes = collections.defaultdict(list)
    for entry in results:
        if entry["outcome"] == "failed":
            classes[failure_class(entry)].append(entry["test"].split("::")[-1])
    return {
        "run": len(results), "passed": outcomes["passed"], "failed": outcomes["failed"],
        "skipped": outcomes["skipped"],
        "failures": {k: sorted(v) for k, v in sorted(classes.items(), key=lambda kv: -len(kv[1]))},
    }


def report(name: str, result: dict) -> None:
    print(f"\n== {name}: {result['run']} run, {result['passed']} passed, {result['failed']} failed, "
          f"{result['skipped']} skipped")
    for cls, tests in result["failures"].items():
        print(f"  {len(tests):3d} x {cls}")
        print(f"        {', '.join(tests)}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", type=pathlib.Path, help=f"a local copy of NumPyro's {TEST_PATH}")
    parser.add_argument("--json", type=pathlib.Path, help="write the results as JSON here")
    parser.add_argument("--keep", type=pathlib.Path, help="run in this folder (kept) instead of a temporary one")
    args = parser.parse_args(argv)
    version = installed_numpyro_version()
    with tempfile.TemporaryDirectory() as tmp:
        base = args.keep or pathlib.Path(tmp)
        if args.tests is not None:
            text, source = args.tests.read_text(encoding="utf-8"), str(args.tests)
        else:
            text, source = fetch_tests(version, pathlib.Path(tmp))
        edited, places = apply_edits(text)
        print(f"NumPyro {version}: {TEST_PATH} from {source}; SVI replaced by DPSVI(sigma=0, C=inf)")
        results = {"numpyro": version, "source": source, "edited_places": places,
                   "as_written": summary(run_tests(text, base / "as_written")),
                   "one_line_edit": summary(run_tests(edited, base / "one_line_edit"))}
    report("as NumPyro wrote them", results["as_written"])
    report(f"with the one-line edit ({places} places)", results["one_line_edit"])
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1), encoding="utf-8")
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
