"""Where a test step's time goes: XLA compilation against the rest, per test.

A pytest plugin and its summary. As a plugin it records, for every test,
the seconds its protocol took (set-up, call, tear-down) and the seconds
and number of XLA backend compilations that ran meanwhile (JAX's
``backend_compile_duration`` event: compiling only, not tracing or
lowering, nor programs loaded from the persistent cache); each process
(every pytest-xdist worker) writes its own JSON file, ``PREFIX.<worker>.json``
(the summary reads every such file: remove those of an earlier run first).
Compilations in a test's subprocesses are not seen. Run from the repository root::

    PYTHONPATH=benchmarks D3P_COMPILE_TIME_OUT=/tmp/ct .venv/bin/python -m pytest -q -p pytest_compile_time
    .venv/bin/python benchmarks/pytest_compile_time.py /tmp/ct          # per module
    .venv/bin/python benchmarks/pytest_compile_time.py /tmp/ct --tests  # per test

The summary lists modules (or tests) by their time, with the compile
seconds and the number of programs compiled.
"""

import argparse
import collections
import glob
import json
import os
import time

import pytest

OUT_ENV = "D3P_COMPILE_TIME_OUT"

_records = collections.defaultdict(lambda: [0.0, 0, 0.0])   # test id -> [compile s, programs, total s]
_current = [None]


def _on_duration(event, duration, **kwargs):
    if _current[0] is not None and event.endswith("backend_compile_duration"):
        record = _records[_current[0]]
        record[0] += duration
        record[1] += 1


def pytest_configure(config):
    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(_on_duration)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current[0] = item.nodeid
    start = time.perf_counter()
    yield
    _records[item.nodeid][2] += time.perf_counter() - start
    _current[0] = None


def pytest_sessionfinish(session):
    prefix = os.environ.get(OUT_ENV)
    if prefix and _records:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(f"{prefix}.{worker}.json", "w", encoding="utf-8") as f:
            json.dump(dict(_records), f)


def summarise(prefix: str, per_test: bool = False, top: int = 40) -> str:
    """A table of the records written under ``prefix`` by all processes."""
    totals = collections.defaultdict(lambda: [0.0, 0, 0.0])
    for path in sorted(glob.glob(f"{glob.escape(prefix)}.*.json")):
        with open(path, encoding="utf-8") as f:
            for test_id, (seconds, programs, total) in json.load(f).items():
                key = test_id if per_test else test_id.split("::")[0]
                row = totals[key]
                row[0] += seconds
                row[1] += programs
                row[2] += total
    if not totals:
        raise SystemExit(f"no records under {prefix!r} (set {OUT_ENV} and run pytest with -p pytest_compile_time)")
    rows = sorted(totals.items(), key=lambda kv: -kv[1][2])
    compile_s = sum(r[0] for r in totals.values())
    lines = [f"all: {sum(r[2] for r in totals.values()):.1f} s in tests, {compile_s:.1f} s compiling "
             f"{sum(r[1] for r in totals.values())} programs",
             f"{'test s':>8} {'compile s':>9} {'programs':>8}  {'test' if per_test else 'module'}"]
    lines += [f"{total:8.1f} {seconds:9.1f} {programs:8d}  {key}" for key, (seconds, programs, total) in rows[:top]]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prefix", help=f"the value {OUT_ENV} had in the pytest run")
    parser.add_argument("--tests", action="store_true", help="one row per test, not per module")
    parser.add_argument("--top", type=int, default=40, help="rows to print (default 40)")
    args = parser.parse_args(argv)
    print(summarise(args.prefix, args.tests, args.top))


if __name__ == "__main__":
    main()
