"""Command line: ``python -m d3p twin INPUT.csv OUTPUT.csv --epsilon 1 ...``.

Reads a CSV table, fits a twin with DP-VI at the target (ε, δ), writes a
synthetic CSV and, optionally, a report folder and the saved twin. Prints a
progress bar and a summary (ε, δ, σ, steps, time, what was read from the
data without privacy, where the files went).

Outputs are written to temporary files next to their destinations and
renamed only once everything succeeded: a failure leaves no partial output.
The input file is only read. Bad input (missing or empty file, unusable
columns, ε ≤ 0, ...) prints ``d3p twin: error: ...`` to stderr and exits with
status 2, without a traceback.

For ``d3p/__main__.py``: ``add_twin_subparser(subparsers)`` (alias
``register_twin``, to append to ``COMMANDS``) registers the ``twin``
sub-command and sets the defaults ``func=main_twin`` and ``command_parser``;
``main_twin(args, parser=None)`` runs it and returns the exit status.
``python -m d3p.twin ...`` runs it alone.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings
from typing import List, Optional

__all__ = ["add_twin_subparser", "register_twin", "add_twin_arguments", "main_twin", "main", "EXIT_BAD_INPUT"]

#: Exit status for bad input or arguments.
EXIT_BAD_INPUT = 2

_DESCRIPTION = (
    "Fit a differentially private synthetic twin of a CSV table with DP-VI and write synthetic "
    "records. The synthetic data carry the (epsilon, delta) guarantee for the records of INPUT, "
    "except for schema information read from the data (levels, bounds, missingness), which is "
    "listed in the summary: pass --schema to supply it from public knowledge instead. The report "
    "(--report-dir) shows statistics of the REAL data and is not private."
)


def _epsilon(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if math.isnan(v) or v <= 0:
        raise argparse.ArgumentTypeError(
            f"expected epsilon > 0 (or 'inf' for a non-private fit), got {text!r}")
    return v


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def _probability(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text!r}") from None
    if not 0 < v < 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text!r}")
    return v


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text!r}")
    return v


def _q(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return v


def add_twin_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``twin`` command's arguments to ``parser``.

    :param argparse.ArgumentParser parser: the parser.
    :return: the parser.
    """
    parser.add_argument("input", metavar="INPUT.csv", help="the private table (CSV with a header row); only read")
    parser.add_argument("output", metavar="OUTPUT.csv", help="where to write the synthetic records")
    parser.add_argument("--epsilon", type=_epsilon, required=True,
                        help="target epsilon > 0; 'inf' fits without privacy (sigma = 0, same clipping)")
    parser.add_argument("--delta", type=_probability, default=None,
                        help="target delta in (0, 1) (default 1/N^2 for N records)")
    parser.add_argument("--num-synthetic", type=_positive_int, default=None, metavar="N",
                        help="number of synthetic records (default: as many as the input)")
    parser.add_argument("--components", type=_positive_int, default=None, metavar="K",
                        help="mixture components (default: max(3, min(8, N // 1000)))")
    parser.add_argument("--steps", type=_positive_int, default=None, metavar="T",
                        help="DP-VI steps (default: 50 epochs, between 200 and 2000)")
    parser.add_argument("--q", type=_q, default=None,
                        help="sampling probability per step (default: min(0.5, max(0.01, 200/N)))")
    parser.add_argument("--sampling", choices=("poisson", "fixed"), default="poisson",
                        help="batch sampling: poisson (add/remove relation, default) or fixed (substitute)")
    parser.add_argument("--clip", type=_positive_float, default=None, metavar="C",
                        help="clipping threshold of per-record gradients (default 1.0)")
    parser.add_argument("--learning-rate", type=_positive_float, default=None, metavar="LR",
                        help="initial Adam step size, decaying (cosine) to 5%% of it (default 0.05)")
    parser.add_argument("--schema", default=None, metavar="schema.json",
                        help="JSON schema with public column information (levels, bounds, nullable); "
                             "fields it leaves out are read from the data, with a warning")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed for the noise and sampling (default: fresh OS entropy)")
    parser.add_argument("--report-dir", default=None, metavar="DIR",
                        help="write marginal plots, a correlation-difference heat map and report.json "
                             "(NOT private: statistics of the real data)")
    parser.add_argument("--target", default=None, metavar="COLUMN",
                        help="column for the train-on-synthetic / test-on-real accuracy in the report")
    parser.add_argument("--save-model", default=None, metavar="DIR",
                        help="save the fitted twin (parameters, schema, privacy record; no records)")
    parser.add_argument("--na-values", action="append", default=None, metavar="TEXT",
                        help="an additional string to read as a missing value (repeatable)")
    parser.add_argument("--max-levels", type=_positive_int, default=None,
                        help="largest number of levels of a categorical column read from the data (default 50)")
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
                              description=_DESCRIPTION)
    add_twin_arguments(p)
    p.set_defaults(func=main_twin, command_parser=p)
    return p


#: Same as :func:`add_twin_subparser` (the naming of ``d3p.__main__.COMMANDS``).
register_twin = add_twin_subparser


class _BadInput(Exception):
    pass


def _err(msg: str) -> int:
    print(f"d3p twin: error: {msg}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _check_paths(args) -> None:
    inp = os.path.abspath(args.input)
    if not os.path.exists(args.input):
        raise _BadInput(f"input file {args.input!r} not found")
    if os.path.isdir(args.input):
        raise _BadInput(f"input {args.input!r} is a directory, expected a CSV file")
    if os.path.getsize(args.input) == 0:
        raise _BadInput(f"input file {args.input!r} is empty")
    outs = [("output", args.output, False), ("--report-dir", args.report_dir, True),
            ("--save-model", args.save_model, True)]
    seen = {}
    for what, path, is_dir in outs:
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
        if os.path.exists(path):
            if not args.overwrite:
                raise _BadInput(f"{what} {path!r} exists; pass --overwrite to replace it")
            if is_dir != os.path.isdir(path):
                raise _BadInput(f"{what} {path!r} exists and is not a {'directory' if is_dir else 'file'}")


def _read_csv(args):
    import pandas as pd

    try:
        return pd.read_csv(args.input, na_values=args.na_values, skipinitialspace=True)
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
    except (ValueError, TypeError, FileExistsError, FileNotFoundError, PermissionError,
            IsADirectoryError) as e:
        return _err(str(e))


def _run(args) -> int:
    t_start = time.monotonic()
    _check_paths(args)
    import d3p.random
    from d3p.twin import _io
    from d3p.twin.inference import (DEFAULT_CLIPPING_THRESHOLD, DEFAULT_LEARNING_RATE, fit)
    from d3p.twin.report import write_report_files
    from d3p.twin.schema import DEFAULT_MAX_LEVELS, Schema, SchemaInferenceWarning, TwinInputError, infer_schema

    try:
        schema = Schema.load(args.schema) if args.schema else None
        data = _read_csv(args)
        if args.target is not None and args.target not in [str(c) for c in data.columns]:
            raise _BadInput(f"--target {args.target!r} is not a column of the input "
                            f"(columns: {[str(c) for c in data.columns]})")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", SchemaInferenceWarning)
            schema = infer_schema(data, schema, max_levels=args.max_levels or DEFAULT_MAX_LEVELS)
        leaks = [str(w.message) for w in caught if issubclass(w.category, SchemaInferenceWarning)]
        for msg in leaks:
            print(f"WARNING: {msg}", file=sys.stderr)
        N = len(data)
        print(f"d3p twin: read {N} records x {len(schema)} columns from {args.input}", file=sys.stderr)
        if args.seed is None:
            key, seed_text = d3p.random.PRNGKey(), "fresh OS entropy"
        else:
            key, seed_text = d3p.random.PRNGKey(args.seed), str(args.seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SchemaInferenceWarning)  # already reported
            twin = fit(data, args.epsilon, args.delta, rng_key=key, schema=schema,
                       num_components=args.components, num_steps=args.steps, q=args.q,
                       sampling=args.sampling,
                       clipping_threshold=args.clip or DEFAULT_CLIPPING_THRESHOLD,
                       learning_rate=args.learning_rate or DEFAULT_LEARNING_RATE,
                       max_levels=args.max_levels or DEFAULT_MAX_LEVELS,
                       progress_bar=not args.no_progress)
        n_syn = args.num_synthetic or N
        synthetic = twin.generate(n_syn, d3p.random.fold_in(key, 0x7717))
    except TwinInputError as e:
        raise _BadInput(str(e)) from None

    # write everything to temporary paths, then rename
    temps: List[str] = []
    written = []
    try:
        tmp_csv = _io.temporary_file_for(args.output)
        temps.append(tmp_csv)
        synthetic.to_csv(tmp_csv, index=False)
        moves = [(tmp_csv, args.output)]
        n_files = 0
        if args.report_dir:
            tmp_rep = _io.temporary_directory_for(args.report_dir)
            temps.append(tmp_rep)
            n_files = len(write_report_files(tmp_rep, data, synthetic, schema=twin.schema, twin=twin,
                                             target=args.target))
            moves.append((tmp_rep, args.report_dir))
        if args.save_model:
            tmp_model = _io.temporary_directory_for(args.save_model)
            temps.append(tmp_model)
            twin.write_files(tmp_model)
            moves.append((tmp_model, args.save_model))
        for tmp, final in moves:
            _io.move_into_place(tmp, final)
            temps.remove(tmp)
            written.append(final)
    finally:
        import shutil

        for t in temps:
            if os.path.isdir(t):
                shutil.rmtree(t, ignore_errors=True)
            elif os.path.exists(t):
                os.remove(t)

    p = twin.privacy
    eps = p["epsilon"]
    lines = ["", "d3p twin: done"]
    if p["private"]:
        lines.append(f"  privacy   epsilon = {eps:.4g} (target {p['target_epsilon']:g}), delta = {p['delta']:.3g}, "
                     f"{p['relation']} relation, {p['sampling']} sampling")
    else:
        lines.append("  privacy   NONE: epsilon = inf (sigma = 0, non-private fit for comparison)")
    lines.append(f"  noise     sigma = {p['sigma']:.4g}, clipping threshold C = {p['clipping_threshold']:g}, "
                 f"q = {p['q']:.4g}, steps = {p['num_steps']}, seed: {seed_text}")
    lines.append(f"  model     {twin.model_spec.get('num_components')}-component mixture, {len(twin.schema)} columns, "
                 f"{N} records (N treated as public)")
    lines.append(f"  time      {time.monotonic() - t_start:.1f} s (fit {twin.fit_info['seconds']:.1f} s)")
    if p["not_covered"]:
        lines.append("  WARNING   read from the data WITHOUT privacy (not covered by epsilon, delta; pass --schema "
                     "to avoid):")
        for col, fields in p["not_covered"].items():
            lines.append(f"              {col}: {', '.join(fields)}")
    lines.append(f"  synthetic {n_syn} records -> {args.output}")
    if args.report_dir:
        lines.append(f"  report    {n_files} files -> {args.report_dir}  (NOT private: statistics of the real data, do not publish)")
    if args.save_model:
        lines.append(f"  model     saved -> {args.save_model}")
    print("\n".join(lines))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``python -m d3p.twin`` (the ``twin`` command on its own).

    :param argv: arguments (default ``sys.argv[1:]``).
    :return: exit status.
    """
    parser = argparse.ArgumentParser(prog="python -m d3p.twin", description=_DESCRIPTION)
    add_twin_arguments(parser)
    args = parser.parse_args(argv)
    return main_twin(args)
