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
import functools
import inspect
import math
import numbers
import re
import warnings
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
    "plural",
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


# ---------------------------------------------------------------------------
# The model and guide of DPSVI, and warnings on public settings.
#
# Everything below reads public facts only: signatures and code objects of the
# model and guide, the number and names of the arguments, and the settings of
# a run (sigma, C, the batch size, N, delta). None of it reads a data value.


def _unwrapped(fn):
    """``fn`` without the wrappers that hide the user's function: NumPyro
    handlers (their ``fn``) and :func:`functools.partial`."""
    from numpyro.primitives import Messenger

    for _ in range(100):   # a bound on wrappers wrapping themselves
        if isinstance(fn, Messenger) and fn.fn is not None:
            fn = fn.fn
        elif isinstance(fn, functools.partial):
            fn = fn.func
        else:
            break
    return fn


def _display_name(fn) -> str:
    fn = _unwrapped(fn)
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return f"{name}()" if name else f"(an object of type {type(fn).__name__})"


def _codes(fn) -> set:
    """The code objects whose frames are ``fn`` running."""

    fn = _unwrapped(fn)
    if inspect.ismethod(fn):
        fn = fn.__func__
    code = getattr(fn, "__code__", None)
    if code is None:
        call = getattr(type(fn), "__call__", None)
        code = getattr(call, "__code__", None)
    return {code} if code is not None else set()


def _call_problem(fn, num_args: int, keywords: Iterable[str]) -> Optional[str]:
    """Why ``fn`` cannot be called with ``num_args`` positional arguments and
    the keyword arguments ``keywords`` (from its signature), or None if it can
    or its signature is unknown."""

    try:
        signature = inspect.signature(_unwrapped(fn))
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(*([None] * num_args), **{k: None for k in keywords})
    except TypeError as err:
        return str(err)
    return None


class ModelCodeError(TypeError):
    """A model or guide that DPSVI cannot run as written: it rejects the
    arguments DPSVI passes to it, or uses data values in Python or NumPy code.
    The error JAX or Python raised is its ``__cause__``."""


def model_call_error(err: BaseException, model, guide, num_args: int, data_keywords: Iterable[str],
                     static_keywords: Iterable[str]) -> Optional[ModelCodeError]:
    """A :class:`ModelCodeError` that explains ``err``, raised while DPSVI ran
    ``model`` and ``guide`` with ``num_args`` positional data arrays, the keyword
    data arrays ``data_keywords`` and the constructor's static keyword
    arguments ``static_keywords``; None where ``err`` is something else.

    Two mistakes are recognised: a model or guide whose signature does not
    accept those arguments (static keywords go to both, as in NumPyro's SVI),
    and JAX's errors for data values used in Python or NumPy code, raised in
    a frame of the model or guide.
    """
    import jax

    if isinstance(err, ModelCodeError) or not isinstance(err, TypeError):
        return None
    data_keywords, static_keywords = sorted(data_keywords), sorted(static_keywords)
    if not isinstance(err, jax.errors.JAXTypeError):
        return _signature_error(model, guide, num_args, data_keywords, static_keywords)
    # the errors JAX raises where a traced value is used as a concrete one
    # (TracerBoolConversionError is a ConcretizationTypeError)
    traced = (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError,
              jax.errors.TracerIntegerConversionError)
    return _traced_data_error(err, model, guide) if isinstance(err, traced) else None


def _signature_error(model, guide, num_args, data_keywords, static_keywords) -> Optional[ModelCodeError]:
    keywords = data_keywords + static_keywords
    problems = [(role, fn, _call_problem(fn, num_args, keywords)) for role, fn in (("model", model), ("guide", guide))]
    problems = [(role, fn, p) for role, fn, p in problems if p is not None]
    if not problems:
        return None
    which = "; ".join(f"the {role} {_display_name(fn)} cannot take them: {p}" for role, fn, p in problems)
    static = ", ".join(f"{k}=..." for k in static_keywords) or "none"
    data = ", ".join(data_keywords) or "none"
    return ModelCodeError(
        f"Expected the model and the guide to accept the arguments DPSVI calls them with: "
        f"{num_args} positional data array(s), the keyword data arrays ({data}) and the static "
        f"keyword arguments of the DPSVI constructor ({static}); {which}. As in numpyro's SVI, "
        f"static keyword arguments (such as N, the plate's size) are passed to the model AND the "
        f"guide at every call: add them to both signatures (or accept **kwargs)."
    )


def _traced_data_error(err, model, guide) -> Optional[ModelCodeError]:
    frames, tb = [], err.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code)
        tb = tb.tb_next
    roles = {"model": _codes(model), "guide": _codes(guide)}
    # the innermost frame of the model or guide: the one whose code raised
    found = [(i, role) for i, code in enumerate(frames) for role, codes in roles.items() if code in codes]
    if not found:
        return None
    role = max(found)[1]
    fn = model if role == "model" else guide
    return ModelCodeError(
        f"The {role} {_display_name(fn)} uses the values of the data in Python or NumPy code "
        f"({type(err).__name__}, shown above). DPSVI runs the model and the guide on traced data "
        "(each record on its own, under jax.vmap and jax.jit, and on abstract records to find the "
        "model's public scale), so they cannot turn data values into NumPy arrays or Python "
        "numbers (np.unique, np.asarray, float(x), int(x), .item()) or branch on them in Python "
        "(`if xs.sum() > 0:`). Use jax.numpy and jax.lax instead (jnp.where, lax.cond), and pass "
        "sizes that depend on the data (e.g. the number of categories) as static keyword "
        "arguments of the constructor, DPSVI(..., num_categories=K), which are treated as public."
    )


def records_plate_size(plate: str, size: int, rows: int, static_kwargs: Mapping) -> None:
    """Raise unless the size ``size`` of the model's plate ``plate`` over the
    records equals the number of records ``rows`` of the data given to
    :meth:`DPSVI.run` (both public)."""
    if size == rows:
        return
    given = [k for k, v in static_kwargs.items() if isinstance(v, numbers.Integral) and v == size]
    source = f" (DPSVI(..., {given[0]}={size}))" if given else ""
    raise ValueError(
        f"Expected N, the size of the model's plate {plate!r} over the records, to equal the number "
        f"of records in the data given to run, got N={size}{source} and {rows} rows. run draws its "
        f"batches from the data it is given and scales each step's gradient by N / batch size, so "
        f"with another N the fit describes a data set of another size. Pass N={rows} to the DPSVI "
        f"constructor, or the full data set to run. (N is treated as public.)"
    )


def warn_if_all_noise(dp_scale: float, batch_size: float, clipping_threshold: float, *, stacklevel: int = 3) -> bool:
    """Warn (:class:`UserWarning`) when the noise swamps every step: when the
    standard deviation ``sigma * C / B`` of the noise in the averaged gradient
    of a step is at least ``C``, the largest norm the average of the clipped
    per-record gradients can have (reached only when every record of the batch
    has the same gradient, of norm ``C``), i.e. when ``sigma >= B``. Public
    facts only. Returns whether it warned."""

    if not (dp_scale > 0 and batch_size > 0 and dp_scale >= batch_size):
        return False
    std = dp_scale * clipping_threshold / batch_size
    warnings.warn(
        f"The noise multiplier dp_scale={dp_scale:.4g} is at least the (expected) batch size "
        f"B={batch_size:.4g}: the noise in each step's averaged gradient has standard deviation "
        f"sigma*C/B = {std:.4g} in every coordinate, at least C = {clipping_threshold:.4g}, the "
        f"largest norm the average of the clipped gradients can have (when every record agrees). "
        f"Each step is then mostly noise and the fit will be too. Use a larger batch size or q "
        f"(sigma grows more slowly than B), more records, a larger epsilon, or fewer steps.",
        UserWarning, stacklevel=stacklevel,
    )
    return True


def warn_if_large_delta(name: str, delta: float, num_records: int, *, stacklevel: int = 3) -> bool:
    """Warn (:class:`UserWarning`) when ``delta >= 1 / num_records``: a
    mechanism that publishes one record chosen at random in full satisfies
    (0, 1/N)-DP, so such a delta promises nothing. Returns whether it warned."""

    if not (num_records >= 1 and delta * num_records >= 1):
        return False
    warnings.warn(
        f"{name}={delta:.3g} is at least 1/N = {1 / num_records:.3g} for N={num_records} records: "
        f"releasing one record chosen at random, in full, satisfies (0, 1/N)-DP, so this delta "
        f"promises nothing. Choose delta much smaller than 1/N (the default is 1/N**2).",
        UserWarning, stacklevel=stacklevel,
    )
    return True


# ---------------------------------------------------------------------------
# The command line: checks and messages in terms of its options and their
# values (``--steps 0``), not of the Python arguments behind them
# (``num_steps=0``).

_API_MESSAGE = None  # the compiled pattern of :func:`_fail`'s message, built on first use


def cli_option(check: Callable, *args, integral: bool = False, **kwargs) -> Callable[[str], object]:
    """As :func:`cli`, with the message in the option's terms: argparse puts
    the option in front (``argument --q: expected a finite number in (0, 1],
    got '1.5'``) and the value is quoted as it was typed."""
    parse_number = cli(check, *args, integral=integral, **kwargs)

    def parse(text: str):
        try:
            return parse_number(text)
        except argparse.ArgumentTypeError as err:
            raise argparse.ArgumentTypeError(_option_message(str(err), text)) from None

    parse.__name__ = getattr(check, "__name__", "value")
    return parse


def _option_message(message: str, text: str) -> str:
    """``Expected the value to be WHAT, got the value=V.`` as ``expected WHAT, got 'TEXT'``."""

    match = re.fullmatch(r"Expected the value to be (.*), got the value=.*\.", message, flags=re.S)
    return f"expected {match.group(1)}, got {text!r}" if match else message


def option_choice(option: str, choices: Mapping[str, T]) -> Callable[[str], T]:
    """An ``argparse`` ``type=`` for an option with a fixed set of spellings:
    ``choices`` maps each accepted text (exactly as typed) to the value it
    stands for. Anything else is an error that lists the accepted texts."""
    accepted = " or ".join(repr(c) for c in choices)

    def parse(text: str):
        if text in choices:
            return choices[text]
        raise argparse.ArgumentTypeError(f"expected {accepted}, got {text!r}")

    parse.__name__ = option.lstrip("-").replace("-", "_")
    return parse


def plural(count: int, word: str) -> str:
    """``count`` and ``word``, in the plural unless ``count`` is 1 (``1 column``,
    ``2 columns``, ``0 columns``): the one rule of every printed count."""
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def in_option_terms(message: str, options: Mapping[str, str],
                    values: Optional[Mapping[str, Mapping[str, str]]] = None) -> str:
    """A message of a check of the Python API, rewritten for the command line.

    ``options`` maps Python argument names to the options that set them
    (``{"num_steps": "--steps"}``), ``values`` maps, per argument name, Python
    values to the option's spelling of them (``{"sampling": {"fixed_size":
    "fixed"}}``). ``Expected num_steps to be ...`` becomes ``Expected --steps
    to be ...`` and ``num_steps=0`` or ``sampler='fixed_size'`` become
    ``--steps 0`` and ``--sampling fixed``. Only whole argument names followed
    by ``=`` or preceded by ``Expected`` are rewritten, so that the rest of
    the message (column names, file names) stays as it was.
    """

    values = values or {}
    for name, option in options.items():
        mapping = values.get(name, {})

        def assignment(match, option=option, mapping=mapping):
            quote, value = match.group(1), match.group(2)
            return f"{option} {mapping.get(value, value)}" if quote or value else match.group(0)

        message = re.sub(rf"(?<![\w.-]){re.escape(name)}=(['\"]?)([\w.+-]*)\1", assignment, message)
        message = re.sub(rf"\bExpected {re.escape(name)} ", f"Expected {option} ", message)
    return message
