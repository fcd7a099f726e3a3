# SPDX-License-Identifier: Apache-2.0
"""Command-line interface: ``python -m d3p <command> ...``.

Commands:

* ``sigma``: calibrate the noise multiplier σ for a target (ε, δ).
* ``epsilon``: ε spent by a run with given (σ, q, T, δ).
* ``twin``: a private synthetic twin of a CSV file (:mod:`d3p.twin`).
* ``audit``: an empirical lower bound on ε (:mod:`d3p.audit`).

Each command is one ``register_<name>(subparsers)`` function that adds its
subparser and sets the defaults ``func`` (called as ``func(args, parser)``,
returns the exit status) and ``command_parser`` (the subparser, used for
error messages). To add a command, write such a function (in this
module or in the command's own module) and append it to :data:`COMMANDS`.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Callable, List, Optional, Sequence

__all__ = [
    "COMMANDS",
    "build_parser",
    "main",
    "register_sigma",
    "register_epsilon",
    "register_twin",
    "register_audit",
]

# ---------------------------------------------------------------------------
# argument types: raise ArgumentTypeError, which argparse reports with the
# argument's name and exit status 2
# ---------------------------------------------------------------------------


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _positive(text: str) -> float:
    x = _number(text)
    if not (x > 0 and math.isfinite(x)):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return x


def _non_negative(text: str) -> float:
    x = _number(text)
    if not (x >= 0 and math.isfinite(x)):
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return x


def _open_unit(text: str) -> float:
    x = _number(text)
    if not 0 < x < 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text!r}")
    return x


def _probability(text: str) -> float:
    x = _number(text)
    if not 0 < x <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return x


def _steps(text: str) -> int:
    x = _number(text)
    if not (math.isfinite(x) and x == int(x) and x >= 1):
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(x)


def _relation(text: str) -> str:
    from d3p.accounting import normalize_relation

    try:
        return normalize_relation(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'add-remove' or 'substitute', got {text!r}") from None


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
    p.add_argument("--sampling", choices=("poisson", "fixed"), default=None, help=_SAMPLING_HELP)
    p.add_argument("--relation", type=_relation, default=None, metavar="{add-remove,substitute}",
                   help=_RELATION_HELP)
    p.add_argument("--accountant", choices=("fourier", "rdp", "pld"), default="fourier",
                   help="privacy accountant (default: %(default)s; 'pld' needs dp-accounting)")


def _accounting(args: argparse.Namespace, parser: argparse.ArgumentParser):
    """The accounting of the run described by --sampling and --relation."""
    from d3p import accounting

    try:
        return accounting.accounting_for(args.sampling, args.relation)
    except ValueError as e:
        parser.error(str(e))


def _display(acc) -> str:
    return f"{acc.relation.replace('_', '-')} [{acc.describe()}]"


# ---------------------------------------------------------------------------
# sigma
# ---------------------------------------------------------------------------


def _run_sigma(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    acc = _accounting(args, parser)
    try:
        sigma, eps, _ = acc.calibrate(args.epsilon, args.delta, args.q, args.steps, accountant=args.accountant)
    except ValueError as e:
        parser.error(str(e))
    except ImportError as e:
        parser.error(str(e))
    print(f"sigma={sigma:.6g} (epsilon={eps:.6g} <= {args.epsilon:g} at delta={args.delta:g}, "
          f"q={args.q:g}, steps={args.steps}, relation={_display(acc)}, "
          f"accountant={args.accountant})")
    return 0


def register_sigma(subparsers) -> argparse.ArgumentParser:
    """Adds the ``sigma`` command: calibrate σ for a target (ε, δ)."""
    p = subparsers.add_parser(
        "sigma",
        help="smallest noise multiplier sigma meeting a target (epsilon, delta)",
        description="Smallest noise multiplier sigma for which T steps with sampling "
                    "probability q are (epsilon, delta)-DP. Prints sigma and the epsilon it "
                    "achieves. Choose delta well below 1/N.",
    )
    p.add_argument("--epsilon", type=_positive, required=True, help="target epsilon > 0")
    p.add_argument("--delta", type=_open_unit, required=True, help="target delta in (0, 1)")
    _add_common(p)
    p.set_defaults(func=_run_sigma, command_parser=p)
    return p


# ---------------------------------------------------------------------------
# epsilon
# ---------------------------------------------------------------------------


def _run_epsilon(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    acc = _accounting(args, parser)
    try:
        eps = acc.epsilon(args.sigma, args.q, args.steps, args.delta, accountant=args.accountant)
    except ValueError as e:
        parser.error(str(e))
    except ImportError as e:
        parser.error(str(e))
    print(f"epsilon={eps:.6g} (sigma={args.sigma:g}, q={args.q:g}, steps={args.steps}, "
          f"delta={args.delta:g}, relation={_display(acc)}, accountant={args.accountant})")
    return 0


def register_epsilon(subparsers) -> argparse.ArgumentParser:
    """Adds the ``epsilon`` command: ε of a run with given (σ, q, T, δ)."""
    p = subparsers.add_parser(
        "epsilon",
        help="epsilon spent by T steps with noise multiplier sigma",
        description="Epsilon at delta for T steps of the subsampled Gaussian mechanism "
                    "with noise multiplier sigma and sampling probability q.",
    )
    p.add_argument("--sigma", type=_non_negative, required=True, help="noise multiplier sigma >= 0")
    p.add_argument("--delta", type=_open_unit, required=True, help="delta in (0, 1)")
    _add_common(p)
    p.set_defaults(func=_run_epsilon, command_parser=p)
    return p


def register_twin(subparsers) -> argparse.ArgumentParser:
    """``python -m d3p twin``: a private synthetic twin of a CSV file (:mod:`d3p.twin`)."""
    from d3p.twin.cli import add_twin_subparser

    return add_twin_subparser(subparsers)


def register_audit(subparsers) -> argparse.ArgumentParser:
    """``python -m d3p audit``: an empirical lower bound on ε (:mod:`d3p.audit`)."""
    from d3p.audit import add_audit_subparser

    return add_audit_subparser(subparsers)


#: Functions that register the subcommands, in the order shown by --help.
COMMANDS: List[Callable] = [register_sigma, register_epsilon, register_twin, register_audit]


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
