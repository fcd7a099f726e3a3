"""Command line: ``python -m d3p twin INPUT.csv OUTPUT.csv --epsilon 1 ...``.

Reads a CSV table, fits a twin at the target (ε, δ) (the marginal twin or a
mixture fitted with DP-VI, ``--family``), writes a synthetic CSV and,
optionally, a report folder and the saved twin. Prints a progress bar and a
summary (ε, δ, the noise, time, what was read from the data without
privacy, where the files went), then the headline utility
figures of the report, which are computed on the real data and NOT private
(``--no-utility`` omits them). Errors and warnings are worded in terms of
the options and their values.

Outputs are written to temporary files next to their destinations and
renamed only once everything succeeded: a failure leaves no partial output.
The input file is only read. Bad input (missing or empty file, unusable
columns, ε ≤ 0, ...) prints ``d3p twin: error: ...`` to stderr and exits with
status 2, without a traceback. With a complete ``--schema``, no record can
cause such an error, a warning or a printed line, nor change the number of
records: every line after the header is exactly one record, whatever bytes
it holds (:mod:`d3p.twin._csv_records`), and each record is mapped by the
schema's public rules (:meth:`d3p.twin.ColumnSpec.encode`); the errors that
quote the data's values come from schema inference, which reads the data
outside (ε, δ).

For ``d3p/__main__.py``: ``add_twin_subparser(subparsers)`` (alias
``register_twin``, to append to ``COMMANDS``) registers the ``twin``
sub-command and sets the defaults ``func=main_twin`` and ``command_parser``;
``main_twin(args, parser=None)`` runs it and returns the exit status.
``python -m d3p.twin ...`` runs it alone.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from typing import List, Optional

from d3p import _validate
from d3p._validate import plural

__all__ = ["add_twin_subparser", "register_twin", "add_twin_arguments", "main_twin", "main", "EXIT_BAD_INPUT",
           "add_twin_schema_subparser", "add_twin_schema_arguments", "main_twin_schema"]

#: Exit status for bad input or arguments.
EXIT_BAD_INPUT = 2

_DESCRIPTION = (
    "Fit a differentially private synthetic twin of a CSV table (noisy marginal tables and a graphical "
    "model, or a mixture fitted with DP-VI: see --family) and write synthetic records. The synthetic data carry the (epsilon, delta) guarantee for the records of INPUT, "
    "schema included: the fields --schema does not give (kinds, levels, bounds, missingness) are read "
    "privately with a share of the budget (--schema-share); N and the column names are public. The report "
    "(--report-dir) shows statistics of the REAL data and is not private."
)


# argparse ``type=`` checks: the shared checks of ``d3p._validate``, so that the
# command line accepts and words each kind of argument as the library does
_EPSILON = _validate.cli_option(_validate.positive, finite=False)  # inf: a non-private fit
_DELTA = _validate.cli_option(_validate.open_unit)
_Q = _validate.cli_option(_validate.probability)
_POSITIVE_INT = _validate.cli_option(_validate.integer, minimum=1, integral=True)
_POSITIVE_FLOAT = _validate.cli_option(_validate.positive)
_OPEN_UNIT = _validate.cli_option(_validate.open_unit)
_INTEGER = _validate.cli_option(_validate.integer, integral=True)

#: :func:`d3p.twin.fit`'s argument names, as options of ``twin`` (for its messages),
#: and the neighbouring relation (of a ledger's releases), which ``--sampling`` sets.
_OPTIONS = {"epsilon": "--epsilon", "delta": "--delta", "num_components": "--components", "num_steps": "--steps",
            "q": "--q", "sampling": "--sampling", "clipping_threshold": "--clip", "learning_rate": "--learning-rate",
            "max_levels": "--max-levels", "family": "--family", "target": "--target",
            "adaptive_clipping": "--adaptive-clipping", "count_noise": "--adaptive-clipping",
            "schema_inference": "--schema-inference", "schema_share": "--schema-share", "strict": "--strict",
            "relation": "--sampling"}
_VALUES = {"sampling": {"fixed_size": "fixed"}, "relation": {"add_remove": "poisson", "substitute": "fixed"}}
#: The options that set up the mixture fitted with DP-VI (they select it with --family auto).
_MIXTURE_OPTIONS = (("components", "--components"), ("steps", "--steps"), ("q", "--q"), ("clip", "--clip"),
                    ("learning_rate", "--learning-rate"), ("adaptive_clipping", "--adaptive-clipping"))


def _seed(text: str) -> int:
    """Any integer; integer text is parsed exactly (``_validate.cli`` reads numbers
    as floats, which would round a seed beyond 2**53 and change its key)."""
    try:
        return int(text)
    except ValueError:
        return _INTEGER(text)


def _add_reading_options(parser):
    """The options of how the input table is read, shared by ``twin`` and ``twin-schema``."""
    parser.add_argument("--na-values", action="append", default=None, metavar="TEXT",
                        help="an additional string to read as a missing value (repeatable)")
    parser.add_argument("--max-levels", type=_POSITIVE_INT, default=None,
                        help="largest number of levels of a categorical column read from the data (default 50)")


def add_twin_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``twin`` command's arguments to ``parser``.

    :param argparse.ArgumentParser parser: the parser.
    :return: the parser.
    """
    parser.add_argument("input", metavar="INPUT.csv", help="the private table (CSV with a header row); only read")
    parser.add_argument("output", metavar="OUTPUT.csv", help="where to write the synthetic records")
    parser.add_argument("--epsilon", type=_EPSILON, required=True,
                        help="target epsilon > 0; 'inf' fits without privacy (sigma = 0, same clipping)")
    parser.add_argument("--delta", type=_DELTA, default=None,
                        help="target delta in (0, 1) (default 1/N^2 for N records)")
    parser.add_argument("--num-synthetic", type=_POSITIVE_INT, default=None, metavar="N",
                        help="number of synthetic records (default: as many as the input)")
    parser.add_argument("--family", choices=("auto", "marginal", "mixture"), default="auto",
                        help="model: 'marginal' (noisy marginal tables and a graphical model), 'mixture' "
                             "(a mixture fitted with DP-VI) or 'auto' (default: from public settings only, "
                             "the marginal twin if the noise of its one-way tables, as planned for epsilon, "
                             "delta, the schema's cells and N, is expected to put them at most 0.3 in "
                             "total-variation distance from the true ones on average over the columns (or "
                             "with epsilon inf or fewer than 20 records); the mixture otherwise; --components, "
                             "--steps, --q, --clip, "
                             "--learning-rate and --adaptive-clipping mean mixture)")
    parser.add_argument("--components", type=_POSITIVE_INT, default=None, metavar="K",
                        help="mixture components (default: max(3, min(8, max(N // 1000, D // 4))))")
    parser.add_argument("--steps", type=_POSITIVE_INT, default=None, metavar="T",
                        help="DP-VI steps (default: 50 epochs, between 200 and 2000)")
    parser.add_argument("--q", type=_Q, default=None,
                        help="sampling probability per step (default: min(0.5, max(0.01, 200/N)))")
    parser.add_argument("--sampling", choices=("poisson", "fixed"), default="poisson",
                        help="batch sampling: poisson (add/remove relation, default) or fixed (substitute)")
    parser.add_argument("--clip", type=_POSITIVE_FLOAT, default=None, metavar="C",
                        help="clipping threshold of per-record gradients (default 1.0)")
    parser.add_argument("--adaptive-clipping", type=_OPEN_UNIT, nargs="?", const=0.5, default=None,
                        metavar="QUANTILE",
                        help="let the clipping threshold follow a private estimate of this quantile of the "
                             "per-record gradient norms (default quantile 0.5; --clip is then the first "
                             "threshold); its noisy counts are accounted with the gradients, in the same epsilon")
    parser.add_argument("--learning-rate", type=_POSITIVE_FLOAT, default=None, metavar="LR",
                        help="initial Adam step size, decaying (cosine) to 5%% of it (default 0.05)")
    parser.add_argument("--schema", default=None, metavar="schema.json",
                        help="JSON schema with public column information (levels, bounds, nullable, decimals); "
                             "fields it leaves out are read from the data, with a warning")
    parser.add_argument("--schema-inference", choices=("private", "data"), default="private",
                        help="how the fields --schema leaves out are read: 'private' (default: in the budget) or "
                             "'data' (outside epsilon, delta; listed in the summary)")
    parser.add_argument("--schema-share", type=_OPEN_UNIT, default=0.1, metavar="S",
                        help="share of the budget (zCDP rho) spent reading the schema privately (default 0.1)")
    parser.add_argument("--strict", action="store_true",
                        help="refuse to run if anything released would be read from the data outside epsilon, delta")
    parser.add_argument("--seed", type=_seed, default=None,
                        help="seed for the noise and sampling (default: fresh OS entropy)")
    parser.add_argument("--report-dir", default=None, metavar="DIR",
                        help="write marginal plots, a correlation-difference heat map and report.json "
                             "(NOT private: statistics of the real data)")
    parser.add_argument("--target", default=None, metavar="COLUMN",
                        help="column a downstream model will predict: the marginal twin spends a third of "
                             "its rounds on tables that hold it (same epsilon), and the report's "
                             "train-on-synthetic / test-on-real accuracy predicts it")
    parser.add_argument("--save-model", default=None, metavar="DIR",
                        help="save the fitted twin (parameters, schema, privacy record; no records)")
    parser.add_argument("--ledger", default=None, metavar="LEDGER.json",
                        help="record the twin's release in this privacy ledger of the data set (created if "
                             "missing); the fit is refused if it would pass the ledger's budget")
    parser.add_argument("--budget-epsilon", type=_EPSILON, default=None, metavar="E",
                        help="with --ledger, when it creates the ledger: the total epsilon it allows")
    parser.add_argument("--budget-delta", type=_DELTA, default=None, metavar="D",
                        help="with --budget-epsilon: the delta of the budget")
    _add_reading_options(parser)
    parser.add_argument("--no-utility", action="store_true",
                        help="do not print the utility figures at the end (they are computed on the real data, "
                             "outside epsilon)")
    parser.add_argument("--overwrite", action="store_true", help="replace existing output files/directories")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def add_twin_subparser(subparsers) -> argparse.ArgumentParser:
    """Register the ``twin`` sub-command on an ``argparse`` sub-parsers object.

    Sets the defaults ``func=main_twin`` and ``command_parser`` (the ``twin``
    parser), so a dispatcher can call ``args.func(args)`` or
    ``args.func(args, args.command_parser)``.

    :param subparsers: the result of ``parser.add_subparsers()``.
    :return: the ``twin`` parser.
    """
    p = subparsers.add_parser("twin", help="fit a DP synthetic twin of a CSV table and sample from it",
                              description=_DESCRIPTION, allow_abbrev=False)
    add_twin_arguments(p)
    p.set_defaults(func=main_twin, command_parser=p)
    return p


#: Same as :func:`add_twin_subparser` (the naming of ``d3p.__main__.COMMANDS``).
register_twin = add_twin_subparser


class _BadInput(Exception):
    pass


def _err(msg: str, command: str = "twin") -> int:
    print(f"d3p {command}: error: {msg}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _check_options(args) -> None:
    """Combinations of options that cannot work, refused before the data are read."""
    given = [(flag, getattr(args, name)) for name, flag in _MIXTURE_OPTIONS if getattr(args, name) is not None]
    if args.family == "marginal" and given:
        shown = ", ".join(f"{flag} {value:g}" for flag, value in given)
        raise _BadInput(f"{shown}: {'this option sets' if len(given) == 1 else 'these options set'} up the "
                        "mixture fitted with DP-VI (--family mixture) and cannot be used with --family marginal")


def _check_paths(args) -> None:
    """The input exists and every file written can be: the folders of the
    output, ``--report-dir``, ``--save-model`` and ``--ledger`` exist and are
    writable, no two are the same path nor the input, and an existing output
    is replaced only with ``--overwrite`` (the ledger, read and updated, may
    exist). Before the data are read."""
    inp = os.path.abspath(args.input)
    if not os.path.exists(args.input):
        raise _BadInput(f"input file {args.input!r} not found")
    if os.path.isdir(args.input):
        raise _BadInput(f"input {args.input!r} is a directory, expected a CSV file")
    if os.path.getsize(args.input) == 0:
        raise _BadInput(f"input file {args.input!r} is empty")
    # (option, path, a directory, replaced only with --overwrite)
    outs = [("output", args.output, False, True), ("--report-dir", args.report_dir, True, True),
            ("--save-model", args.save_model, True, True), ("--ledger", args.ledger, False, False)]
    seen = {}
    for what, path, is_dir, replaced in outs:
        if path is None:
            continue
        ap = os.path.abspath(path)
        if ap == inp:
            raise _BadInput(f"{what} {path!r} is the input file; it would be overwritten")
        if ap in seen:
            raise _BadInput(f"{what} and {seen[ap]} are the same path {path!r}")
        seen[ap] = what
        parent = os.path.dirname(ap)
        if not os.path.isdir(parent):
            raise _BadInput(f"the directory {parent!r} for {what} does not exist")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise _BadInput(f"the directory {parent!r} for {what} is not writable")
        if os.path.exists(path):
            if replaced and not args.overwrite:
                raise _BadInput(f"{what} {path!r} exists; pass --overwrite to replace it")
            if is_dir != os.path.isdir(path):
                raise _BadInput(f"{what} {path!r} exists and is not a {'directory' if is_dir else 'file'}")


def _read_csv(args, schema=None, all_text: bool = False):
    """The input table.

    With a schema (``--schema``), every line after the header is exactly one
    record, whatever bytes it holds (:mod:`d3p.twin._csv_records`: the file
    is split at ``\\n`` only, each line into fields on its own), and the
    columns the schema describes completely are read as text, value by value
    (pandas would type a column by all of its values: one text value turns
    ``"01"`` from the number 1 into the text ``01`` in every other record);
    :meth:`~d3p.twin.Schema.encode` then reads each value by the schema's
    public rules. No record can make the read fail or warn, change the number
    of records or change how another record is read.

    Without a schema, pandas reads the file as a whole (multi-line quoted
    fields allowed, a carriage return outside quotes ends a record, column
    types inferred) and a malformed file is an error that quotes pandas'
    message: that path reads the data to infer the schema, outside the
    (epsilon, delta) guarantee.
    """
    import pandas as pd

    if schema is not None or all_text:
        from d3p.twin._csv_records import CarriageReturnInHeader, records_frame

        with open(args.input, "rb") as f:
            content = f.read()
        as_text = [c.name for c in schema.columns if c.missing_fields() in ([], ["dtype"])] if schema else []
        try:
            frame = records_frame(content, text_columns=as_text, na_values=args.na_values, all_text=all_text)
        except CarriageReturnInHeader as e:
            raise _BadInput(f"input file {args.input!r}: {e}") from None
        if frame is None:
            raise _BadInput(f"input file {args.input!r} is empty (no header row)")
        return frame
    # low_memory=False: pandas would otherwise type a column chunk by chunk and
    # warn (DtypeWarning) when one record makes the chunks' types differ
    options = dict(na_values=args.na_values, low_memory=False)
    try:
        return pd.read_csv(args.input, skipinitialspace=True, **options)
    except pd.errors.EmptyDataError:
        raise _BadInput(f"input file {args.input!r} is empty (no header row)") from None
    except pd.errors.ParserError as e:
        raise _BadInput(f"could not parse {args.input!r} as CSV: {str(e).strip()}") from None
    except UnicodeDecodeError:
        raise _BadInput(f"input file {args.input!r} is not UTF-8 text") from None


def main_twin(args: argparse.Namespace, parser: Optional[argparse.ArgumentParser] = None) -> int:
    """Run the ``twin`` command with parsed arguments.

    :param argparse.Namespace args: from a parser set up by :func:`add_twin_arguments`.
    :param parser: unused (accepted for the ``func(args, parser)`` convention of ``d3p.__main__``).
    :return: exit status: 0 on success, 2 on bad input (message on stderr).
    """
    try:
        return _run(args)
    except _BadInput as e:
        return _err(str(e))
    except (ValueError, TypeError) as e:
        return _err(_validate.in_option_terms(str(e), _OPTIONS, _VALUES))
    except (FileExistsError, FileNotFoundError, PermissionError, IsADirectoryError) as e:
        return _err(str(e))


def _run(args) -> int:
    t_start = time.monotonic()
    # every check that needs neither the data nor a fit, then those that need the data
    _check_options(args)
    _check_paths(args)
    _check_report_needs(args)
    ledger = _ledger(args)
    from d3p.twin.schema import TwinInputError

    try:
        key, seed_text = _rng_key(args)
        recorded = len(ledger) if ledger is not None else 0
        data, schema, private = _read_inputs(args, key=key, ledger=ledger)
        try:
            # the report's real data: with --schema or a private schema the records as the
            # schema maps them, i.e. as the twin sees them (the columns were read as text)
            report_data = _report_data(args, data, schema, private)
            _check_target(args, report_data, schema)
            twin = _fit(args, data, private or schema, key, ledger)
        except (ValueError, TwinInputError):
            _keep_schema_release(args, ledger, private, recorded)
            raise
        if ledger is not None:
            _save_ledger(args, ledger, twin)
        num_synthetic = args.num_synthetic or len(data)
        synthetic = twin.generate(num_synthetic, _generation_key(key))
    except TwinInputError as e:
        raise _BadInput(_validate.in_option_terms(str(e), _OPTIONS, _VALUES)) from None
    data = report_data
    metrics = None if args.no_utility and not args.report_dir else _utility(args, data, synthetic, twin)
    num_report_files = _write_outputs(args, data, synthetic, twin, metrics)
    lines = _summary(args, twin, num_records=len(data), num_synthetic=num_synthetic, seed_text=seed_text,
                     num_report_files=num_report_files, seconds=time.monotonic() - t_start)
    if ledger is not None:   # after the twin's own privacy and noise (the summary's lines 2 and 3)
        lines[4:4] = _ledger_lines(args, ledger, twin)
    if not args.no_utility:
        lines += _utility_lines(metrics)
    print("\n".join(lines))
    return 0


def _report_data(args, data, schema, private=None):
    """The real records the report compares with: with ``--schema`` or a private schema, as the
    schema maps them (as the twin sees them); else as read."""
    return schema.decode(schema.encode(data)) if args.schema is not None or private is not None else data


def _check_report_needs(args) -> None:
    """Before the data are read: the plotting library of ``--report-dir``
    (scikit-learn, for ``--target``, is checked with the target)."""
    if args.report_dir is None:
        return
    from d3p.twin.report import require_matplotlib

    try:
        require_matplotlib()
    except ImportError as e:
        raise _BadInput(f"--report-dir {args.report_dir!r}: {e}") from None


def _check_target(args, report_data, schema) -> None:
    """Before the fit: whether the report can predict ``--target`` (the
    checks of the train-on-synthetic accuracy, on ``report_data``, the real
    records it will be tested on, and the target's kind in ``schema``, the
    schema of the fit), where the utility figures or the report are asked for."""
    if args.target is None or (args.no_utility and not args.report_dir):
        return
    from d3p.twin.metrics import check_classification_target

    try:
        check_classification_target(report_data.rename(columns=str), args.target, schema=schema)
    except (ValueError, ImportError) as e:
        raise _BadInput(f"--target {args.target!r}: {e} (checked before the fit: the utility figures predict "
                        "it; --no-utility without --report-dir skips them)") from None


def _read_inputs(args, *, command: str = "twin", key=None, ledger=None):
    """The table, its completed schema and, where its fields were read privately (``twin``'s default),
    their release; says, in one line, whether schema fields were read from the data outside epsilon
    (``twin`` lists them in its summary, ``twin-schema`` in the schema it prints)."""
    from d3p.twin import _fit_plan
    from d3p.twin.schema import DEFAULT_MAX_LEVELS, Schema, SchemaInferenceWarning

    given = Schema.load(args.schema) if args.schema else None
    private_path = command == "twin" and args.schema_inference == "private" and math.isfinite(args.epsilon)
    data = _read_csv(args, given, all_text=private_path)
    columns = [str(c) for c in data.columns]
    if args.target is not None and args.target not in columns:
        raise _BadInput(f"--target {args.target!r} is not a column of the input (columns: {columns})")
    how = args.schema_inference if command == "twin" else "data"
    share = args.schema_share if command == "twin" else 0.1
    if command == "twin":
        _fit_plan.check_schema_options(data, args.epsilon, given, how, share, args.strict)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SchemaInferenceWarning)  # said below, in the options' terms
        schema, private = _fit_plan.resolve_schema(data, args.epsilon if command == "twin" else math.inf,
                                                   getattr(args, "delta", None), key, given, how, share,
                                                   getattr(args, "sampling", "poisson"),
                                                   args.max_levels or DEFAULT_MAX_LEVELS, ledger)
    print(f"d3p {command}: read {plural(len(data), 'record')} x {plural(len(schema), 'column')} from "
          f"{args.input}", file=sys.stderr)
    if private is not None:
        print(f"d3p {command}: schema fields of {plural(len(private.columns), 'column')} read privately, with "
              f"{args.schema_share:g} of the budget (inside epsilon, delta)", file=sys.stderr)
    where = "in the summary at the end" if command == "twin" else "below"
    before = given.inferred_fields() if given is not None else {}
    new = [c for c, fields in schema.inferred_fields().items() if set(fields) - set(before.get(c, ()))]
    if new:
        print(f"WARNING: schema fields of {len(new)} of {plural(len(schema), 'column')} were read from the data "
              f"WITHOUT privacy (not covered by epsilon, delta; listed {where})", file=sys.stderr)
    elif before:
        print(f"WARNING: {args.schema} marks schema fields of {plural(len(before), 'column')} as read from the "
              f"data ('inferred'): not covered by epsilon, delta (listed {where})", file=sys.stderr)
    return data, schema, private


def _rng_key(args):
    """The d3p.random key of the run (noise, sampling, generation) and how it was seeded."""
    import d3p.random

    if args.seed is None:
        return d3p.random.PRNGKey(), "fresh OS entropy"
    return d3p.random.PRNGKey(args.seed), str(args.seed)


def _generation_key(key):
    """A key for generating the synthetic records, independent of the fit's keys."""
    import d3p.random

    return d3p.random.fold_in(key, 0x7717)


def _ledger(args):
    """The privacy ledger of ``--ledger`` (read, or new with the budget of
    ``--budget-epsilon``/``--budget-delta``), or None."""
    from d3p.ledger import PrivacyLedger

    budget = (args.budget_epsilon, args.budget_delta)
    if args.ledger is None:
        if budget != (None, None):
            raise _BadInput("--budget-epsilon and --budget-delta need --ledger")
        return None
    if os.path.exists(args.ledger):
        if budget != (None, None):
            raise _BadInput(f"--budget-epsilon and --budget-delta set the budget of a new ledger; {args.ledger} "
                            "exists and keeps its own")
        return PrivacyLedger.load(args.ledger)
    if (args.budget_epsilon is None) != (args.budget_delta is None):
        raise _BadInput("--budget-epsilon and --budget-delta go together")
    return PrivacyLedger(budget_epsilon=args.budget_epsilon, budget_delta=args.budget_delta)


def _save_ledger(args, ledger, twin) -> None:
    """Write the ledger (atomically, never through a link planted at a predictable name)."""
    from d3p import _files

    text = json.dumps(ledger.to_dict(), indent=1) + "\n"
    _files.write_private(args.ledger, lambda f: f.write(text.encode("utf-8")))


def _ledger_lines(args, ledger, twin) -> List[str]:
    """What the ledger holds after the twin, at the twin's own δ (the figure
    that covers every release of the data set, beside the twin's own), and
    against its budget at the budget's δ."""
    delta = twin.privacy.get("delta") if twin.privacy.get("private") else None
    delta = delta or ledger.budget_delta
    total = f"epsilon = {ledger.epsilon(delta):.4g} at delta = {delta:.3g}" if delta else "not private"
    lines = [f"  ledger    {args.ledger}: {plural(len(ledger), 'release')} of this data set, this twin included: "
             f"in total {total}"]
    if ledger.budget_epsilon is not None:
        lines.append(f"            budget epsilon = {ledger.budget_epsilon:g} at delta = {ledger.budget_delta:.3g}: "
                     f"spent {ledger.epsilon(ledger.budget_delta):.4g}")
    return lines


def _keep_schema_release(args, ledger, private, recorded: int) -> None:
    """Where the run stops after the schema was read privately, the ledger keeps that release (recorded
    by the fit, or here as zCDP) and is saved, and the user is told."""
    if ledger is None or private is None:
        return
    from d3p.twin._schema_private import schema_releases

    if len(ledger) == recorded:
        for release in schema_releases(private.plan):
            ledger.record(release)
    _save_ledger(args, ledger, None)
    print(f"d3p twin: the schema was read privately before the error: its release is recorded in {args.ledger}",
          file=sys.stderr)


def _fit(args, data, schema, key, ledger=None):
    from d3p.svi import AdaptiveClipping
    from d3p.twin.inference import DEFAULT_CLIPPING_THRESHOLD, DEFAULT_LEARNING_RATE, fit
    from d3p.twin.schema import DEFAULT_MAX_LEVELS, SchemaInferenceWarning

    family = args.family
    if family == "auto" and (args.clip is not None or args.learning_rate is not None
                             or args.adaptive_clipping is not None):
        family = "mixture"  # the options of the mixture select it, as --steps does
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        warnings.simplefilter("ignore", SchemaInferenceWarning)  # already reported by _read_inputs
        if args.delta is not None:
            _validate.warn_if_large_delta("delta", args.delta, len(data))
        twin = fit(data, args.epsilon, args.delta, rng_key=key, schema=schema, family=family,
                   num_components=args.components, num_steps=args.steps, q=args.q,
                   sampling=args.sampling,
                   clipping_threshold=args.clip or DEFAULT_CLIPPING_THRESHOLD,
                   learning_rate=args.learning_rate or DEFAULT_LEARNING_RATE,
                   max_levels=args.max_levels or DEFAULT_MAX_LEVELS, target=args.target,
                   progress_bar=not args.no_progress, ledger=ledger, schema_inference=args.schema_inference,
                   schema_share=args.schema_share, strict=args.strict,
                   adaptive_clipping=(None if args.adaptive_clipping is None
                                      else AdaptiveClipping(target_quantile=args.adaptive_clipping)))
    _report_warnings(caught)
    return twin


#: The names in the library's warnings during a fit, as ``twin`` options or words.
_WARNING_NAMES = {**_OPTIONS, "target_delta": "--delta", "dp_scale": "sigma"}


def _report_warnings(caught) -> None:
    """Prints the library's warnings of a fit once each, in the options' terms
    (they read public settings only); re-issues warnings of other kinds."""
    seen = set()
    for w in caught:
        if not issubclass(w.category, UserWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            continue
        text = _validate.in_option_terms(str(w.message), _WARNING_NAMES, _VALUES)
        if text not in seen:
            seen.add(text)
            print(f"WARNING: {text}", file=sys.stderr)


def _write_outputs(args, data, synthetic, twin, metrics=None) -> int:
    """Write every output to a temporary path next to it, then rename them all;
    on failure remove the temporary paths. Returns the number of report files."""
    from d3p.twin import _io
    from d3p.twin.report import write_report_files

    temps: List[str] = []
    num_report_files = 0
    try:
        tmp_csv = _io.temporary_file_for(args.output)
        temps.append(tmp_csv)
        synthetic.to_csv(tmp_csv, index=False)
        moves = [(tmp_csv, args.output)]
        if args.report_dir:
            tmp_report = _io.temporary_directory_for(args.report_dir)
            temps.append(tmp_report)
            num_report_files = len(write_report_files(tmp_report, data, synthetic, schema=twin.schema,
                                                      twin=twin, target=args.target, metrics=metrics))
            moves.append((tmp_report, args.report_dir))
        if args.save_model:
            tmp_model = _io.temporary_directory_for(args.save_model)
            temps.append(tmp_model)
            twin.write_files(tmp_model)
            moves.append((tmp_model, args.save_model))
        for tmp, final in moves:
            _io.move_into_place(tmp, final)
            temps.remove(tmp)
    finally:
        _remove_all(temps)
    return num_report_files


def _remove_all(paths: List[str]) -> None:
    import shutil

    for path in paths:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.exists(path):
            os.remove(path)


def _summary(args, twin, *, num_records: int, num_synthetic: int, seed_text: str, num_report_files: int,
             seconds: float) -> List[str]:
    """The lines printed at the end: privacy, noise, model, time, what is not covered, outputs."""
    p = twin.privacy
    marginal = twin.model_spec.get("type") == "marginal"
    relation = str(p["relation"]).replace("_", "-")
    lines = ["", "d3p twin: done"]
    if p["private"]:
        how = f"{relation} relation" if marginal else f"{relation} relation, {_SAMPLING_WORDS[p['sampling']]}"
        lines.append(f"  privacy   epsilon = {p['epsilon']:.4g} (target {p['target_epsilon']:g}), "
                     f"delta = {p['delta']:.3g}, {how} (this twin)")
    else:
        lines.append("  privacy   NONE: epsilon = inf (no noise: a non-private fit for comparison)")
    if marginal:
        lines.append(f"  noise     zCDP rho = {p['rho']:.4g} in {plural(p['num_releases'], 'release')} (Gaussian "
                     f"marginal tables, exponential-mechanism choices), seed: {seed_text}")
        lines.append(f"  model     graphical model on {plural(p['num_measurements'], 'noisy marginal table')}, "
                     f"{plural(len(twin.schema), 'column')}, {plural(num_records, 'record')} (N treated as public)")
    else:
        adaptive = twin.fit_info.get("adaptive_clipping")
        clip = (f"clipping threshold C = {p['clipping_threshold']:g}" if adaptive is None else
                f"adaptive clipping to the {adaptive['target_quantile']:g} quantile, C = "
                f"{p['clipping_threshold']:g} -> {adaptive['final_clipping_threshold']:.4g}")
        # how sigma follows from epsilon, said once (the line above gives epsilon)
        steps = f"q = {p['q']:.4g} and steps = {p['num_steps']}"
        how = f"calibrated so that {steps} give the epsilon above" if p["private"] else f"no noise, with {steps}"
        lines.append(f"  noise     sigma = {p['sigma']:.4g}, {how}; {clip}, seed: {seed_text}")
        lines.append(f"  model     {twin.model_spec.get('num_components')}-component mixture, "
                     f"{plural(len(twin.schema), 'column')}, {plural(num_records, 'record')} (N treated as public)")
    if p.get("schema"):
        s = p["schema"]
        lines.append(f"  schema    read privately in the budget above: {plural(len(s['columns']), 'column')}, "
                     f"{s['share']:g} of rho; a text level only above {s['level_threshold']:.0f} noisy records")
    lines.append(f"  time      {seconds:.1f} s (fit {twin.fit_info['seconds']:.1f} s)")
    lines += _noise_lines(args, twin, num_records)
    lines += _not_covered_lines(args, twin)
    lines.append(f"  synthetic {plural(num_synthetic, 'record')} -> {args.output}")
    if args.report_dir:
        lines.append(f"  report    {plural(num_report_files, 'file')} -> {args.report_dir}  (NOT private: "
                     "statistics of the real data, do not publish)")
    if args.save_model:
        lines.append(f"  model     saved -> {args.save_model}")
    return lines


#: How the summary names each sampler of the mixture.
_SAMPLING_WORDS = {"poisson": "Poisson sampling", "fixed": "fixed-size batches"}


def _noise_lines(args, twin, num_records: int) -> List[str]:
    """A warning when the marginal twin is mostly noise (public facts: schema, N, epsilon, delta)."""
    from d3p.twin.marginal import noise_warning

    p = twin.privacy
    if twin.model_spec.get("type") != "marginal" or not p["private"]:
        return []
    text = noise_warning(twin.schema, num_records, p["target_epsilon"], p["delta"], relation=p["relation"])
    return [f"  WARNING   {text}"] if text else []


def _not_covered_lines(args, twin) -> List[str]:
    """The schema fields read from the data, one short line per column, and how to avoid reading them."""
    fields = twin.privacy["not_covered"]
    if not fields:
        return []
    if args.schema:
        how = (f"give their values from public knowledge in {args.schema} and remove their names from each "
               "column's 'inferred'")
    else:
        how = ("write the schema with 'python -m d3p twin-schema', replace them by public knowledge and pass it "
               "with --schema")
    lines = [f"  WARNING   schema fields of {plural(len(fields), 'column')} read from the data WITHOUT privacy "
             "(not covered by epsilon, delta):"]
    lines += [f"              {line}" for line in twin.schema.inferred_lines(fields)]
    lines.append(f"            to avoid it: {how}")
    return lines


def _utility(args, data, synthetic, twin) -> dict:
    """The report's metrics of the synthetic against the real data (NOT private)."""
    from d3p.twin.metrics import utility_metrics

    return utility_metrics(data.rename(columns=str), synthetic.rename(columns=str), schema=twin.schema,
                           target=args.target)


def _utility_lines(metrics: dict) -> List[str]:
    """The headline figures of :func:`d3p.twin.report.headline_figures`, labelled as not private."""
    from d3p.twin.report import headline_lines

    return (["  utility   computed on the REAL data, NOT private (outside epsilon, delta; for the data "
             "holder only; --no-utility omits it):"]
            + [f"              {line}" for line in headline_lines(metrics)])


# --------------------------------------------------------------- twin-schema

_SCHEMA_DESCRIPTION = (
    "Write the schema that 'twin' would infer for a CSV table (column kinds, levels, bounds, "
    "distributions) as JSON. Edit it (replace what was read from the data with public knowledge, "
    "change a kind or a distribution) and pass it back with 'twin --schema'. Everything in it that "
    "was read from the data is listed (fields 'inferred') and is NOT covered by a twin's epsilon."
)


def add_twin_schema_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``twin-schema`` command's arguments to ``parser``.

    :param argparse.ArgumentParser parser: the parser.
    :return: the parser.
    """
    parser.add_argument("input", metavar="INPUT.csv", help="the private table (CSV with a header row); only read")
    parser.add_argument("output", metavar="schema.json", help="where to write the schema")
    parser.add_argument("--schema", default=None, metavar="schema.json",
                        help="a partial schema: its fields are kept, the others are inferred")
    _add_reading_options(parser)
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    return parser


def add_twin_schema_subparser(subparsers) -> argparse.ArgumentParser:
    """Register the ``twin-schema`` sub-command (defaults ``func=main_twin_schema``
    and ``command_parser``), as :func:`add_twin_subparser` does for ``twin``.

    :param subparsers: the result of ``parser.add_subparsers()``.
    :return: the ``twin-schema`` parser.
    """
    p = subparsers.add_parser("twin-schema", help="write the schema a twin would infer, to edit and pass back",
                              description=_SCHEMA_DESCRIPTION, allow_abbrev=False)
    add_twin_schema_arguments(p)
    p.set_defaults(func=main_twin_schema, command_parser=p)
    return p


def main_twin_schema(args: argparse.Namespace, parser: Optional[argparse.ArgumentParser] = None) -> int:
    """Run the ``twin-schema`` command with parsed arguments.

    :param argparse.Namespace args: from a parser set up by :func:`add_twin_schema_arguments`.
    :param parser: unused.
    :return: exit status: 0 on success, 2 on bad input (message on stderr).
    """
    from d3p.twin import _io
    from d3p.twin.schema import TwinInputError

    try:
        args.report_dir = args.save_model = args.target = args.ledger = None
        _check_paths(args)
        data, schema, _ = _read_inputs(args, command="twin-schema")
        tmp = _io.temporary_file_for(args.output)
        try:
            schema.save(tmp)
            _io.move_into_place(tmp, args.output)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    except _BadInput as e:
        return _err(str(e), "twin-schema")
    except (TwinInputError, ValueError, TypeError) as e:
        return _err(_validate.in_option_terms(str(e), _OPTIONS, _VALUES), "twin-schema")
    except (PermissionError, IsADirectoryError, FileNotFoundError) as e:
        return _err(str(e), "twin-schema")
    print("\n".join(["d3p twin-schema: inferred schema", *("  " + line for line in schema.summary_lines()),
                      f"  schema    -> {args.output}  (edit it, then: python -m d3p twin {args.input} OUT.csv "
                      f"--epsilon E --schema {args.output})"]))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``python -m d3p.twin`` (the ``twin`` command on its own).

    :param argv: arguments (default ``sys.argv[1:]``).
    :return: exit status.
    """
    parser = argparse.ArgumentParser(prog="python -m d3p.twin", description=_DESCRIPTION, allow_abbrev=False)
    add_twin_arguments(parser)
    args = parser.parse_args(argv)
    return main_twin(args)
