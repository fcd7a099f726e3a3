"""Argument checks shared by every public entry point of d3p.

Each check takes the argument's name and value, returns the value converted to
a plain Python type, and otherwise raises with one message format everywhere::

    Expected <name> to be <what is accepted>, got <name>=<value>.

A value of the wrong kind (a string where a number belongs, a bool where an
integer belongs) raises :class:`InvalidArgumentType`, which is both a
``TypeError`` and a ``ValueError`` so that callers catching either see it; a
value of the right kind outside its range raises ``ValueError``.

Numbers are public settings of a run (sizes, probabilities, privacy
parameters): 0-d NumPy or concrete JAX arrays are accepted, values traced by a
JAX transformation are not, and NaN is never accepted.
"""

import argparse
import math
import numbers
from typing import Callable, Iterable, Mapping, Optional, Tuple, TypeVar, Union

import numpy as np

T = TypeVar("T")

__all__ = [
    "InvalidArgumentType",
    "integer",
    "number",
    "positive",
    "non_negative",
    "probability",
    "open_unit",
    "boolean",
    "choice",
    "rng_suite",
    "mesh",
    "mesh_axes",
    "cli",
]


class InvalidArgumentType(TypeError, ValueError):
    """An argument of the wrong kind (both a ``TypeError`` and a ``ValueError``)."""


def _fail(name: str, what: str, value, kind=ValueError):
    raise kind(f"Expected {name} to be {what}, got {name}={value!r}.")


def _scalar(value):
    """A 0-d concrete array as a NumPy scalar; anything else unchanged."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        return value[()]
    if type(value).__module__.startswith("jax") and np.ndim(value) == 0:
        try:
            return np.asarray(value)[()]
        except Exception:  # a tracer: not a public constant
            return value
    return value


def _interval(low, high, low_open, high_open) -> str:
    if math.isinf(low) and math.isinf(high):
        return ""
    if math.isinf(high):
        return f" {'>' if low_open else '>='} {low:g}"
    if math.isinf(low):
        return f" {'<' if high_open else '<='} {high:g}"
    return f" in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


def integer(name: str, value, *, minimum: Optional[int] = None, maximum: Optional[int] = None) -> int:
    """An integer (Python or NumPy, not bool) in ``[minimum, maximum]``."""
    if minimum is not None and maximum is not None:
        what = f"an integer in [{minimum}, {maximum}]"
    elif minimum is not None:
        what = f"an integer >= {minimum}"
    elif maximum is not None:
        what = f"an integer <= {maximum}"
    else:
        what = "an integer"
    v = _scalar(value)
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral):
        _fail(name, what, value, InvalidArgumentType)
    v = int(v)
    if (minimum is not None and v < minimum) or (maximum is not None and v > maximum):
        _fail(name, what, value)
    return v


def number(
    name: str,
    value,
    *,
    low: float = -math.inf,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
    finite: bool = True,
) -> float:
    """A real number (not bool, not NaN) in the given interval, as a float."""
    what = ("a finite number" if finite else "a number") + _interval(low, high, low_open, high_open)
    v = _scalar(value)
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
        _fail(name, what, value, InvalidArgumentType)
    x = float(v)
    ok = not math.isnan(x) and (not finite or math.isfinite(x))
    ok = ok and (x > low if low_open else x >= low) and (x < high if high_open else x <= high)
    if not ok:
        _fail(name, what, value)
    return x


def positive(name: str, value, *, finite: bool = True) -> float:
    """A number > 0 (finite unless ``finite=False``)."""
    return number(name, value, low=0.0, low_open=True, finite=finite)


def non_negative(name: str, value, *, finite: bool = True) -> float:
    """A number >= 0 (finite unless ``finite=False``)."""
    return number(name, value, low=0.0, finite=finite)


def probability(name: str, value) -> float:
    """A sampling probability in (0, 1]."""
    return number(name, value, low=0.0, high=1.0, low_open=True)


def open_unit(name: str, value) -> float:
    """A number in (0, 1), e.g. δ."""
    return number(name, value, low=0.0, high=1.0, low_open=True, high_open=True)


def boolean(name: str, value) -> bool:
    """True or False (Python or NumPy bool)."""
    v = _scalar(value)
    if not isinstance(v, (bool, np.bool_)):
        _fail(name, "True or False", value, InvalidArgumentType)
    return bool(v)


def choice(name: str, value, choices: Union[Mapping[str, T], Iterable[str]]) -> Union[str, T]:
    """One of the given names, case-insensitively and ignoring surrounding
    spaces; with a mapping, the value it maps the name to (aliases)."""
    table = dict(choices) if isinstance(choices, Mapping) else {c: c for c in choices}
    canonical = sorted({str(v) for v in table.values()}) if isinstance(choices, Mapping) else list(table)
    what = "one of " + ", ".join(repr(c) for c in canonical)
    if isinstance(value, str):
        key = value.strip().lower()
        for k, v in table.items():
            if k.lower() == key:
                return v
        _fail(name, what, value)
    found = [v for v in table.values() if v is value]
    if found:
        return found[0]
    _fail(name, what, value, InvalidArgumentType)


_RNG_SUITE_FUNCTIONS = ("PRNGKey", "split", "fold_in", "random_bits", "convert_to_jax_rng_key")


def rng_suite(name: str, value):
    """A PRNG suite: a module (or object) with the functions of
    :mod:`d3p.random` (``PRNGKey``, ``split``, ``fold_in``, ``random_bits``,
    ``convert_to_jax_rng_key``), e.g. ``d3p.random`` or ``d3p.random.debug``."""
    if isinstance(value, (str, bytes, numbers.Number)) or not all(
        callable(getattr(value, f, None)) for f in _RNG_SUITE_FUNCTIONS
    ):
        _fail(name, "a PRNG suite such as d3p.random or d3p.random.debug", value, InvalidArgumentType)
    return value


def mesh(name: str, value):
    """None or a concrete :class:`jax.sharding.Mesh` (devices, not an abstract mesh)."""
    import jax

    if value is not None and not isinstance(value, jax.sharding.Mesh):
        _fail(name, "a jax.sharding.Mesh (e.g. from jax.make_mesh) or None", value, InvalidArgumentType)
    return value


def mesh_axes(name: str, value, axis_names: Iterable[str], mesh_name: str = "mesh") -> Tuple[str, ...]:
    """Names of axes of a mesh whose axis names are ``axis_names``, as a tuple:
    one name, or a tuple or list of distinct names; None gives all of them."""
    axis_names = tuple(axis_names)
    if value is None:
        return axis_names
    what = f"an axis name of {mesh_name} or a tuple of them ({mesh_name} has axes {axis_names})"
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, (tuple, list)) or not names or not all(isinstance(n, str) for n in names):
        _fail(name, what, value, InvalidArgumentType)
    if len(set(names)) != len(names) or not set(names) <= set(axis_names):
        _fail(name, what, value)
    return tuple(names)


def cli(check: Callable, *args, integral: bool = False, **kwargs) -> Callable[[str], object]:
    """An ``argparse`` ``type=`` function: parses the text as a number (an
    integer if ``integral``) and applies ``check(name, number, *args,
    **kwargs)``; any failure becomes an ``argparse.ArgumentTypeError`` with
    the same message."""

    def parse(text: str):
        try:
            value = float(text)
            if integral and math.isfinite(value) and value == int(value):
                value = int(value)
        except (TypeError, ValueError):
            value = text
        try:
            return check("the value", value, *args, **kwargs)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    parse.__name__ = getattr(check, "__name__", "value")
    return parse
