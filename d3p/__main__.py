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
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, List, Optional, Sequence

from d3p import _validate
from d3p.accounting import Relation, Sampler

__all__ = [
    "COMMANDS",
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

_positive = _validate.cli(_validate.positive)
_non_negative = _validate.cli(_validate.non_negative)
_open_unit = _validate.cli(_validate.open_unit)
_probability = _validate.cli(_validate.probability)
_steps = _validate.cli(_validate.integer, minimum=1, integral=True)


def _name_of(kind: Callable) -> Callable[[str], object]:
    """An ``argparse`` ``type=`` for a name that ``kind`` (:class:`Relation`
    or :class:`Sampler`) looks up, with every spelling it accepts."""

    def parse(text: str):
        try:
            return kind(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    parse.__name__ = kind.__name__.lower()
    return parse


_relation = _name_of(Relation)
_sampler = _name_of(Sampler)


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

    try:
        return accounting.accounting_for(args.sampling, args.relation, args.noise)
    except ValueError as e:
        parser.error(str(e))


def _accountant_used(args: argparse.Namespace) -> str:
    """The accountant that answers: --accountant, or the discrete mechanism's RDP bound."""
    return "rdp (discrete Gaussian bound)" if args.noise == "discrete" else args.accountant


def _display(acc) -> str:
    return f"{acc.relation.replace('_', '-')} [{acc.describe()}]"


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
        parser.error(str(e))


def _run_sigma(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    acc = _accounting(args, parser)
    sigma, eps, _ = _evaluate(parser, acc.calibrate, args.epsilon, args.delta, args.q, args.steps,
                              accountant=args.accountant)
    print(f"sigma={sigma:.6g} (epsilon={eps:.6g} <= {args.epsilon:g} at delta={args.delta:g}, "
          f"q={args.q:g}, steps={args.steps}, relation={_display(acc)}, "
          f"accountant={_accountant_used(args)})")
    return 0


def _add_command(subparsers, name: str, func: Callable) -> argparse.ArgumentParser:
    """Adds the accounting command ``name`` (texts in :data:`_COMMAND_TEXTS`):
    its first option, ``--delta``, the options of :func:`_add_common`, and the
    defaults ``func`` and ``command_parser``."""
    (flag, kind, text), delta_help, help_text, description = _COMMAND_TEXTS[name]
    p = subparsers.add_parser(name, help=help_text, description=description)
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
          f"delta={args.delta:g}, relation={_display(acc)}, accountant={_accountant_used(args)})")
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


def register_twin(subparsers) -> argparse.ArgumentParser:
    """``python -m d3p twin``: a private synthetic twin of a CSV file (:mod:`d3p.twin`)."""
    from d3p.twin.cli import add_twin_subparser

    return add_twin_subparser(subparsers)


def register_twin_schema(subparsers) -> argparse.ArgumentParser:
    """``python -m d3p twin-schema``: write the schema a twin would infer, to edit and pass back."""
    from d3p.twin.cli import add_twin_schema_subparser

    return add_twin_schema_subparser(subparsers)


def register_audit(subparsers) -> argparse.ArgumentParser:
    """``python -m d3p audit``: an empirical lower bound on ε (:mod:`d3p.audit`)."""
    from d3p.audit import add_audit_subparser

    return add_audit_subparser(subparsers)


#: Functions that register the subcommands, in the order shown by --help.
COMMANDS: List[Callable] = [register_sigma, register_epsilon, register_twin, register_twin_schema, register_audit]


def build_parser() -> argparse.ArgumentParser:
    """Builds the ``python -m d3p`` parser with every registered command."""
    parser = argparse.ArgumentParser(
        prog="python -m d3p",
        description="d3p: differentially private probabilistic programming for NumPyro.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for register in COMMANDS:
        register(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the command line; returns the exit status (2 for usage errors,
    which argparse reports by raising ``SystemExit``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.func(args, getattr(args, "command_parser", parser))


if __name__ == "__main__":
    sys.exit(main())
