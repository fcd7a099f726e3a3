"""A neighbour-differential harness: run an entry point on two neighbouring
data sets with the same keys and compare everything it lets out.

Differential privacy promises that one record changes nothing but the noisy
release, and that by at most its sensitivity. Data read anywhere else (an
initialisation, a schema check, an error message, a warning, a file) breaks
that promise in a way no statistical test of the mechanism sees. The harness
looks for this whole class: :func:`observe` runs an entry point and records
its *path* (exception, warnings, printed output, log records, files written)
and what it returns, split by the entry point itself into

- ``public``: values that must be IDENTICAL on neighbouring data sets
  (shapes, dtypes, structure, privacy metadata, initial values, schemas);
- ``noisy``: the mechanism's releases, run with the same keys (and where
  useful with the noise switched off), whose difference must stay within
  the stated sensitivity (L2 over all of them together);
- ``not_private``: values the documentation declares outside ε (losses,
  per-record norms); each entry point lists their names explicitly, with a
  pointer to where the docs declare them, and :func:`compare` checks that
  nothing else was left out.

:func:`compare` asserts the two observations agree. Tests add entry points,
record kinds and relations as rows of tables (see ``tests/test_neighbours.py``).
"""

import contextlib
import dataclasses
import io
import logging
import math
import os
import re
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

# ----------------------------------------------------------------- records

#: Adversarial values of a real-valued feature, by name.
FLOAT_KINDS = {
    "nan": float("nan"),
    "+inf": float("inf"),
    "-inf": float("-inf"),
    "1e30": 1e30,
    "subnormal": float(np.float32(1e-45)),  # the smallest float32 subnormal
    "outlier": 300.0,
}


@dataclasses.dataclass
class Release:
    """What an entry point returns, split for the comparison (see the module docstring).

    ``sensitivity``: the L2 bound of the difference of ``noisy`` between the
    two runs (None: no bounded noisy part); ``tolerance``: an absolute
    allowance for rounding in the post-processing that turns the release
    into the observed values (stated by the entry point, 0 by default).
    """

    public: Dict[str, Any] = dataclasses.field(default_factory=dict)
    noisy: Dict[str, Any] = dataclasses.field(default_factory=dict)
    not_private: Dict[str, Any] = dataclasses.field(default_factory=dict)
    sensitivity: Optional[float] = None
    tolerance: float = 0.0


@dataclasses.dataclass
class Observation:
    """One run of an entry point: its path and its release."""

    error: Optional[Tuple[str, str]]  # (exception type, message) or None
    warnings: List[Tuple[str, str]]   # (category, message)
    stdout: str
    stderr: str
    logs: List[Tuple[str, str, str]]  # (logger, level, message)
    files: Dict[str, Any]             # relative path -> what is compared (see read_files)
    release: Optional[Release]

    def path(self) -> dict:
        """Everything of the path, for one equality test."""
        return {"error": self.error, "warnings": self.warnings, "stdout": self.stdout,
                "stderr": self.stderr, "logs": self.logs, "files": sorted(self.files)}


class _Records(logging.Handler):
    """Collects the records of d3p's loggers (every level) and of all others
    at WARNING and above (JAX's debug records carry timings)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        if record.name.startswith("d3p") or record.levelno >= logging.WARNING:
            self.records.append((record.name, record.levelname, record.getMessage()))


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _clean(text: str, masks: Sequence[str]) -> str:
    """``text`` without memory addresses and without the spans of ``masks``
    (regular expressions of declared noisy or timing figures)."""
    text = _ADDRESS.sub(" at 0x?", text)
    for m in masks:
        text = re.sub(m, "<masked>", text)
    return text


def observe(fn: Callable[[], Optional[Release]], *, masks: Sequence[str] = (),
            directory: Optional[str] = None, noisy_files: Sequence[str] = ()) -> Observation:
    """Run ``fn()`` and record its path and release.

    :param fn: the entry point, bound to one data set and its keys; returns a
        :class:`Release` (or None if it returns nothing to compare).
    :param masks: regular expressions of figures in messages that are
        declared noisy or are timings; replaced before the comparison.
    :param directory: if given, the files under it after the run are read
        (:func:`read_files`).
    :param noisy_files: relative paths whose contents are noisy releases
        (only their presence, size class and, for CSV, header and row count
        are compared).
    """
    handler = _Records()
    root, d3p_logger = logging.getLogger(), logging.getLogger("d3p")
    old_level = d3p_logger.level
    out, err = io.StringIO(), io.StringIO()
    error, release = None, None
    root.addHandler(handler)
    d3p_logger.setLevel(logging.DEBUG)
    try:
        with warnings.catch_warnings(record=True) as caught, \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            warnings.simplefilter("always")
            try:
                release = fn()
            except Exception as e:  # noqa: BLE001 - the exception is part of the path
                error = (type(e).__qualname__, _clean(str(e), masks))
    finally:
        root.removeHandler(handler)
        d3p_logger.setLevel(old_level)
    return Observation(
        error=error,
        warnings=[(w.category.__qualname__, _clean(str(w.message), masks)) for w in caught],
        stdout=_clean(out.getvalue(), masks),
        stderr=_clean(err.getvalue(), masks),
        logs=[(n, lv, _clean(m, masks)) for n, lv, m in handler.records],
        files=read_files(directory, noisy_files) if directory is not None else {},
        release=release,
    )


def read_files(directory: str, noisy_files: Sequence[str] = ()) -> Dict[str, Any]:
    """The files under ``directory``: relative path -> contents (bytes), or for
    a path in ``noisy_files`` only what is public about it (for a CSV its
    header line and number of lines)."""
    found = {}
    for top, _, names in os.walk(directory):
        for name in names:
            full = os.path.join(top, name)
            rel = os.path.relpath(full, directory).replace(os.sep, "/")
            with open(full, "rb") as f:
                data = f.read()
            if rel in noisy_files:
                lines = data.splitlines()
                data = ("noisy", lines[0] if rel.endswith(".csv") and lines else None,
                        len(lines) if rel.endswith(".csv") else None)
            found[rel] = data
    return found


# ------------------------------------------------------------- comparison


def flatten(value, prefix: str = "") -> Dict[str, Any]:
    """Nested dicts, lists, tuples and NamedTuples as ``{path: leaf}``; arrays
    (NumPy or JAX) as NumPy arrays."""
    if isinstance(value, dict):
        out = {}
        for k in value:  # in the entry point's order: the first difference is reported
            out.update(flatten(value[k], f"{prefix}/{k}"))
        return out or {prefix: "{}"}
    if isinstance(value, (list, tuple)) and not hasattr(value, "shape"):
        fields = getattr(value, "_fields", None)
        out = {f"{prefix}/<{type(value).__name__}:{len(value)}>": None}
        for i, v in enumerate(value):
            out.update(flatten(v, f"{prefix}/{fields[i] if fields else i}"))
        return out
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        try:
            import jax

            if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
                value = jax.random.key_data(value)
        except (ImportError, TypeError):
            pass
        return {prefix: np.asarray(value)}
    return {prefix: value}


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
            return False
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.dtype.kind in "fc":
            return bool(np.array_equal(a, b, equal_nan=True))
        return bool(np.array_equal(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def _describe(v) -> str:
    if isinstance(v, np.ndarray):
        text = np.array2string(v.ravel()[:6], precision=9)
        return f"array{v.shape}:{v.dtype} {text}{' ...' if v.size > 6 else ''}"
    return repr(v)[:200]


def noisy_distance(a: Dict[str, Any], b: Dict[str, Any]) -> float:
    """L2 distance of two noisy releases of the same structure (float64)."""
    fa, fb = flatten(a), flatten(b)
    assert sorted(fa) == sorted(fb), f"noisy releases differ in structure: {sorted(fa)} != {sorted(fb)}"
    total = 0.0
    for k in fa:
        if fa[k] is None:
            continue
        x = np.asarray(fa[k], np.float64)
        y = np.asarray(fb[k], np.float64)
        assert x.shape == y.shape, f"noisy {k}: shape {x.shape} != {y.shape}"
        total += float(np.sum((x - y) ** 2))
    return math.sqrt(total)


def compare(d: Observation, d2: Observation, *, not_private: Sequence[str] = (), what: str = "") -> dict:
    """Assert that the runs on neighbouring data sets ``d`` and ``d2`` agree:
    same path (exception, warnings, output, log records, file names), the
    same contents of the files and identical public values, and noisy
    releases within the stated sensitivity; ``not_private``: the names the
    entry point declares outside ε (checked to be exactly those left out).

    :return: ``{"distance": ..., "bound": ...}`` of the noisy part (for reports).
    """
    label = f"[{what}] " if what else ""
    assert d.error == d2.error, f"{label}the runs take different paths: exception {d.error} vs {d2.error}"
    for part in ("stderr", "warnings", "stdout", "logs"):
        assert getattr(d, part) == getattr(d2, part), (
            f"{label}the runs differ in {part}:\n  D:  {getattr(d, part)!r}\n  D': {getattr(d2, part)!r}")
    assert sorted(d.files) == sorted(d2.files), f"{label}files written differ: {sorted(d.files)} vs {sorted(d2.files)}"
    for name in d.files:
        assert d.files[name] == d2.files[name], f"{label}the file {name} differs between the runs"
    if d.release is None or d2.release is None:
        assert d.release is None and d2.release is None, f"{label}one run released nothing"
        return {"distance": 0.0, "bound": None}
    r, r2 = d.release, d2.release
    for rel in (r, r2):
        assert sorted(rel.not_private) == sorted(not_private), (
            f"{label}values declared not private: {sorted(rel.not_private)}, expected {sorted(not_private)}")
    fa, fb = flatten(r.public), flatten(r2.public)
    assert sorted(fa) == sorted(fb), f"{label}public structure differs: {sorted(set(fa) ^ set(fb), key=str)}"
    for k in fa:
        assert _same(fa[k], fb[k]), f"{label}public value {k} differs: {_describe(fa[k])} vs {_describe(fb[k])}"
    if not r.noisy and not r2.noisy:
        return {"distance": 0.0, "bound": None}
    distance = noisy_distance(r.noisy, r2.noisy)
    bound = r.sensitivity + max(r.tolerance, r2.tolerance)
    assert distance <= bound, (
        f"{label}the noisy release moved by {distance!r} (L2), more than its sensitivity "
        f"{r.sensitivity!r} (+ rounding allowance {max(r.tolerance, r2.tolerance):.3g}): "
        f"{distance / r.sensitivity:.6f} x the sensitivity")
    return {"distance": distance, "bound": bound}
