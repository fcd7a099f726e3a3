# SPDX-License-Identifier: Apache-2.0
"""Command-line interface: ``python -m d3p <command> ...``.

Commands:

* ``sigma``: calibrate the noise multiplier σ for a target (ε, δ).
* ``epsilon``: ε spent by a run with given (σ, q, T, δ).
* ``twin``: a private synthetic twin of a CSV file (:mod:`d3p.twin`).
* ``twin-schema``: the schema ``twin`` would infer for a CSV file, as JSON to
  edit and pass back with ``twin --schema``.
* ``audit``: an empirical lower bound on ε (:mod:`d3p.audit`).

Each command is one ``register_<name>(subparsers)`` function that adds its
subparser and sets the defaults ``func`` (called as ``func(args, parser)``,
returns the exit status) and ``command_parser`` (the subparser, used for
error messages). To add a command, write such a function (in this
module or in the command's own module) and append it to :data:`COMMANDS`.

Every parser is built with ``allow_abbrev=False`` (``--eps`` is not taken for
``--epsilon``), every error names options and the values as typed, and each
value has one spelling on every command (``--sampling poisson|fixed``,
``--relation add-remove|substitute``).

``--help`` stays fast: a register function marked with :func:`command`
(its name and one-line help) is only called, and so its module only
imported, when its command is the one being run; the others are listed by
name and help.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, List, Optional, Sequence

from d3p import _validate

__all__ = [
    "COMMANDS",
    "command",
    "build_parser",
    "main",
    "register_sigma",
    "register_epsilon",
    "register_twin",
    "register_twin_schema",
    "register_audit",
]

# ---------------------------------------------------------------------------
# argument types: raise ArgumentTypeError, which argparse reports with the
# argument's name and exit status 2
# ---------------------------------------------------------------------------

_positive = _validate.cli_option(_validate.positive)
_non_negative = _validate.cli_option(_validate.non_negative)
_open_unit = _validate.cli_option(_validate.open_unit)
_probability = _validate.cli_option(_validate.probability)
_steps = _validate.cli_option(_validate.integer, minimum=1, integral=True)

#: The command line's spelling of each sampler and relation, and the name the
#: library uses for it (:class:`d3p.accounting.Sampler`, :class:`d3p.accounting.Relation`).
SAMPLING_VALUES = {"poisson": "poisson", "fixed": "fixed_size"}
RELATION_VALUES = {"add-remove": "add_remove", "substitute": "substitute"}
_sampler = _validate.option_choice("--sampling", SAMPLING_VALUES)
_relation = _validate.option_choice("--relation", RELATION_VALUES)

#: The accounting functions' argument names and values, as options of these commands.
_OPTION_NAMES = {"sampler": "--sampling", "sampling": "--sampling", "relation": "--relation", "q": "--q",
                 "num_iter": "--steps", "num_steps": "--steps", "steps": "--steps", "delta": "--delta",
                 "target_eps": "--epsilon", "target_epsilon": "--epsilon", "epsilon": "--epsilon",
                 "dp_scale": "--sigma", "sigma": "--sigma", "noise": "--noise", "accountant": "--accountant"}
_OPTION_VALUES = {"sampler": {v: k for k, v in SAMPLING_VALUES.items()},
                  "sampling": {v: k for k, v in SAMPLING_VALUES.items()},
                  "relation": {v: k for k, v in RELATION_VALUES.items()}}


def _option_error(parser: argparse.ArgumentParser, err: Exception) -> None:
    """Reports an error of the accounting functions as a usage error, in the options' terms."""
    parser.error(_validate.in_option_terms(str(err), _OPTION_NAMES, _OPTION_VALUES))


_RELATION_HELP = (
    "neighbouring relation: 'add-remove' (default with Poisson sampling) or 'substitute' "
    "(the only one for fixed-size batches; alone, it means fixed-size batches)"
)
_SAMPLING_HELP = (
    "batch sampler of the run: 'poisson' (each record with probability q; d3p's default) "
    "or 'fixed' (B = qN records without replacement, accounted under substitute with the "
    "pair that dominates it); default: poisson, or fixed with --relation substitute alone"
)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--q", type=_probability, required=True, metavar="Q",
                   help="sampling probability / ratio B/N, in (0, 1]")
    p.add_argument("--steps", type=_steps, required=True, metavar="T",
                   help="number of steps (iterations) T >= 1")
    p.add_argument("--sampling", type=_sampler, default=None, metavar="{poisson,fixed}", help=_SAMPLING_HELP)
    p.add_argument("--relation", type=_relation, default=None, metavar="{add-remove,substitute}",
                   help=_RELATION_HELP)
    p.add_argument("--accountant", choices=("fourier", "rdp", "pld"), default="fourier",
                   help="privacy accountant (default: %(default)s; 'pld' needs dp-accounting)")
    p.add_argument("--noise", choices=("gaussian", "discrete"), default="gaussian",
                   help="noise mechanism: 'gaussian' (default) or 'discrete', DPSVI(noise='discrete'), "
                        "accounted with its Renyi-DP bound (--accountant is then not used)")


def _accounting(args: argparse.Namespace, parser: argparse.ArgumentParser):
    """The accounting of the run described by --sampling and --relation."""
    from d3p import accounting

    if args.sampling == "fixed_size" and args.relation == "add_remove":
        parser.error("--sampling fixed cannot be accounted under --relation add-remove: fixed-size batches "
                     "are accounted under substitute only; use --sampling poisson for add-remove, or "
                     "--relation substitute")
    try:
        return accounting.accounting_for(args.sampling, args.relation, args.noise)
    except ValueError as e:
        _option_error(parser, e)


def _accountant_used(args: argparse.Namespace) -> str:
    """The accountant that answers: --accountant, or the discrete mechanism's RDP bound."""
    return "rdp (discrete Gaussian bound)" if args.noise == "discrete" else args.accountant


def _display(acc) -> str:
    """The sampler and its relation, each named once, as the options spell
    them (``sampling=poisson, relation=add-remove``)."""
    sampling = {"fixed_size": "fixed"}.get(str(acc.sampler), str(acc.sampler))
    return f"sampling={sampling}, relation={acc.relation.replace('_', '-')}"


# ---------------------------------------------------------------------------
# sigma
# ---------------------------------------------------------------------------


def _evaluate(parser: argparse.ArgumentParser, compute: Callable, *args, **kwargs):
    """``compute(*args, **kwargs)``, with a ValueError (a value the
    accountant refuses) or an ImportError (a missing optional dependency)
    reported as a usage error."""
    try:
        return compute(*args, **kwargs)
    except (ValueError, ImportError) as e:
        _option_error(parser, e)


def _run_sigma(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from d3p import dputil

    acc = _accounting(args, parser)
    sigma, eps, _ = _evaluate(parser, dputil.calibrate_sigma, args.epsilon, args.delta, args.q, args.steps,
                              sampler=args.sampling, relation=args.relation, noise=args.noise,
                              accountant=args.accountant)
    print(f"sigma={sigma:.6g} (epsilon={eps:.6g} <= {args.epsilon:g} at delta={args.delta:g}, "
          f"q={args.q:g}, steps={args.steps}, {_display(acc)}, "
          f"accountant={_accountant_used(args)})")
    return 0


def _add_command(subparsers, name: str, func: Callable) -> argparse.ArgumentParser:
    """Adds the accounting command ``name`` (texts in :data:`_COMMAND_TEXTS`):
    its first option, ``--delta``, the options of :func:`_add_common`, and the
    defaults ``func`` and ``command_parser``."""
    (flag, kind, text), delta_help, help_text, description = _COMMAND_TEXTS[name]
    p = subparsers.add_parser(name, help=help_text, description=description, allow_abbrev=False)
    p.add_argument(flag, type=kind, required=True, help=text)
    p.add_argument("--delta", type=_open_unit, required=True, help=delta_help)
    _add_common(p)
    p.set_defaults(func=func, command_parser=p)
    return p


def register_sigma(subparsers) -> argparse.ArgumentParser:
    """Adds the ``sigma`` command: calibrate σ for a target (ε, δ)."""
    return _add_command(subparsers, "sigma", _run_sigma)


# ---------------------------------------------------------------------------
# epsilon
# ---------------------------------------------------------------------------


def _run_epsilon(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    acc = _accounting(args, parser)
    eps = _evaluate(parser, acc.epsilon, args.sigma, args.q, args.steps, args.delta, accountant=args.accountant)
    print(f"epsilon={eps:.6g} (sigma={args.sigma:g}, q={args.q:g}, steps={args.steps}, "
          f"delta={args.delta:g}, {_display(acc)}, accountant={_accountant_used(args)})")
    return 0


def register_epsilon(subparsers) -> argparse.ArgumentParser:
    """Adds the ``epsilon`` command: ε of a run with given (σ, q, T, δ)."""
    return _add_command(subparsers, "epsilon", _run_epsilon)


#: Per accounting command: its first option (flag, type, help), the help of
#: --delta, and the command's help and description.
_COMMAND_TEXTS = {
    "sigma": (("--epsilon", _positive, "target epsilon > 0"), "target delta in (0, 1)",
              "smallest noise multiplier sigma meeting a target (epsilon, delta)",
              "Smallest noise multiplier sigma for which T steps with sampling probability q are (epsilon, "
              "delta)-DP. Prints sigma and the epsilon it achieves. Choose delta well below 1/N."),
    "epsilon": (("--sigma", _non_negative, "noise multiplier sigma >= 0"), "delta in (0, 1)",
                "epsilon spent by T steps with noise multiplier sigma",
                "Epsilon at delta for T steps of the subsampled Gaussian mechanism with noise multiplier "
                "sigma and sampling probability q."),
}


def command(name: str, help: str) -> Callable[[Callable], Callable]:
    """Marks a register function as the one of command ``name`` with the one-line
    ``help`` of ``python -m d3p --help``: :func:`build_parser` then calls it
    only when that command runs, so that its module is imported only then."""

    def mark(register: Callable) -> Callable:
        register.command_name, register.command_help = name, help
        return register

    return mark


@command("twin", "fit a DP synthetic twin of a CSV table and sample from it")
def register_twin(subparsers) -> argparse.ArgumentParser:
    """``python -m d3p twin``: a private synthetic twin of a CSV file (:mod:`d3p.twin`)."""
    from d3p.twin.cli import add_twin_subparser

    return add_twin_subparser(subparsers)


@command("twin-schema", "write the schema a twin would infer, to edit and pass back")
def register_twin_schema(subparsers) -> argparse.ArgumentParser:
    """``python -m d3p twin-schema``: write the schema a twin would infer, to edit and pass back."""
    from d3p.twin.cli import add_twin_schema_subparser

    return add_twin_schema_subparser(subparsers)


@command("audit", "empirical lower bound on epsilon for a small DP-VI model, next to the accountant's epsilon")
def register_audit(subparsers) -> argparse.ArgumentParser:
    """``python -m d3p audit``: an empirical lower bound on ε (:mod:`d3p.audit`)."""
    from d3p.audit._cli import add_audit_subparser

    return add_audit_subparser(subparsers)


#: Functions that register the subcommands, in the order shown by --help.
COMMANDS: List[Callable] = [register_sigma, register_epsilon, register_twin, register_twin_schema, register_audit]


def build_parser(command_to_run: Optional[str] = None) -> argparse.ArgumentParser:
    """Builds the ``python -m d3p`` parser with every registered command.

    :param command_to_run: the command about to run, if known: only its
        register function and those not marked with :func:`command` are
        called; the other commands are listed with their help but take no
        options. Default: every command with all its options.
    """
    parser = argparse.ArgumentParser(
        prog="python -m d3p",
        description="d3p: differentially private probabilistic programming for NumPyro.",
        allow_abbrev=False,
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for register in COMMANDS:
        name = getattr(register, "command_name", None)
        if command_to_run is None or name is None or name == command_to_run:
            register(subparsers)
        else:
            subparsers.add_parser(name, help=register.command_help, add_help=False, allow_abbrev=False)
    return parser


def _command_in(argv: Sequence[str]) -> str:
    """The command of ``argv`` (its first word that is not an option), or "" if none."""
    return next((a for a in argv if not a.startswith("-")), "")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the command line; returns the exit status (2 for usage errors,
    which argparse reports by raising ``SystemExit``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(_command_in(argv))
    args, unknown = parser.parse_known_args(argv)
    if unknown:   # shown with the usage of the command they were given to: before it, python -m d3p
        command = _command_in(argv)
        before = argv[:argv.index(command)] if command in argv else argv
        given_to = parser if any(u in before for u in unknown) else getattr(args, "command_parser", parser)
        given_to.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args.func(args, getattr(args, "command_parser", parser))


if __name__ == "__main__":
    sys.exit(main())
