# SPDX-License-Identifier: Apache-2.0
"""The ``audit`` command: ``python -m d3p audit ...`` (registered by
``d3p.__main__``) or ``python -m d3p.audit ...`` (this command on its own).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

import d3p.random
from d3p import accounting as _accounting
from d3p.audit._audits import audit_dpsvi, audit_gaussian_step
from d3p.audit._mechanisms import THREAT_MODELS

__all__ = ["add_audit_subparser", "register_audit", "main_audit", "main"]

_ADD_REMOVE = _accounting.ADD_REMOVE
_SUBSTITUTE = _accounting.SUBSTITUTE


def add_audit_subparser(subparsers) -> argparse.ArgumentParser:
    """Register the ``audit`` command on an ``argparse`` subparsers object.

    Follows the convention of ``d3p/__main__.py``: the new parser sets the
    defaults ``func=main_audit`` (called as ``func(args, parser)``, returns the
    exit status) and ``command_parser`` (itself, for error messages).
    ``d3p.__main__.register_audit`` hooks it into ``python -m d3p`` and
    imports this package only when called, because it imports JAX.

    :param subparsers: the result of ``ArgumentParser.add_subparsers()``.
    :return: the ``audit`` parser.
    """
    p = subparsers.add_parser(
        "audit",
        help="empirical lower bound on epsilon for a small DP-VI model, next to the accountant's epsilon",
        description=(
            "Run a private mechanism of d3p many times with and without a canary record, "
            "attack it, and print a lower bound on epsilon valid with confidence 1-beta next to "
            "the epsilon the accountant claims. Exit status 1 if the bound exceeds the claim. "
            "Mechanism 'step': one noisy clipped gradient sum (q=1, T=1; the Gaussian "
            "mechanism, epsilon tight); 'dpsvi': --steps steps of DPSVI.update with Poisson "
            "sampling (add/remove) or, with --sampling fixed, fixed-size batches on the extreme "
            "substitute pair."
        ),
    )
    p.add_argument("--mechanism", choices=("step", "dpsvi"), default="step", help="what to audit (default: step)")
    p.add_argument("--sigma", type=float, default=1.0, help="noise multiplier sigma (default: 1.0)")
    p.add_argument("--clip", type=float, default=1.0, help="clipping threshold C (default: 1.0)")
    p.add_argument("--q", type=float, default=0.5, help="sampling probability, dpsvi only (default: 0.5)")
    p.add_argument("--steps", type=int, default=4, help="number of steps T, dpsvi only (default: 4)")
    p.add_argument("--sampling", choices=("poisson", "fixed"), default="poisson",
                   help="batch sampler, dpsvi only (default: poisson)")
    p.add_argument(
        "--relation",
        choices=(_ADD_REMOVE, _SUBSTITUTE),
        default=_ADD_REMOVE,
        help="neighbouring relation, step only (dpsvi: add_remove)",
    )
    p.add_argument(
        "--threat-model",
        choices=THREAT_MODELS,
        default="every_step",
        help="dpsvi only: the attacker sees every step or only the final parameters",
    )
    p.add_argument("--runs", type=int, default=100000, help="runs per data set (default: 100000)")
    p.add_argument("--delta", type=float, default=1e-5, help="delta (default: 1e-5)")
    p.add_argument("--beta", type=float, default=0.05, help="error probability; confidence 1-beta (default: 0.05)")
    p.add_argument("--accountant", choices=("fourier", "rdp", "pld"), default="fourier")
    p.add_argument("--seed", type=int, default=None, help="seed of the PRNG key (default: OS entropy)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=main_audit, command_parser=p)
    return p


#: Alias following the ``register_<name>`` convention of ``d3p/__main__.py``.
register_audit = add_audit_subparser


def main_audit(args: argparse.Namespace, parser: Optional[argparse.ArgumentParser] = None) -> int:
    """Run the ``audit`` command.

    :param args: the parsed arguments of the ``audit`` parser.
    :param parser: the ``audit`` parser; invalid values are reported through
        ``parser.error`` (exit status 2). Without it they raise ``ValueError``.
    :return: 0 if ``epsilon_lower <= epsilon_accountant``, 1 otherwise.
    """
    try:
        key = d3p.random.PRNGKey(args.seed)
        common = dict(
            dp_scale=args.sigma,
            clipping_threshold=args.clip,
            delta=args.delta,
            beta=args.beta,
            accountant=args.accountant,
            progress_bar=not args.no_progress,
        )
        if args.mechanism == "step":
            print(
                f"Auditing one noisy clipped gradient step (sigma={args.sigma}, C={args.clip}, "
                f"relation={args.relation}) with {args.runs} runs per data set ...",
                flush=True,
            )
            res = audit_gaussian_step(key, args.runs, relation=args.relation, **common)
        else:
            print(
                f"Auditing {args.steps} DPSVI steps (sigma={args.sigma}, C={args.clip}, q={args.q}, "
                f"{args.sampling} sampling, threat model {args.threat_model}) with {args.runs} runs "
                "per data set ...",
                flush=True,
            )
            res = audit_dpsvi(
                key, args.runs, q=args.q, num_steps=args.steps, threat_model=args.threat_model,
                sampling=args.sampling, **common
            )
    except (ValueError, TypeError) as e:
        if parser is None:
            raise
        parser.error(str(e))
    print(res.summary())
    print(f"{'epsilon_lower':>16} {'epsilon_accountant':>20}")
    print(f"{res.epsilon_lower:16.4f} {res.epsilon_accountant:20.4f}")
    return 1 if res.violation else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m d3p.audit [options]``: the ``audit`` command on its own.

    :param argv: arguments (default: ``sys.argv[1:]``); a leading ``audit`` is optional.
    :return: exit status, as :func:`main_audit`.
    """
    parser = argparse.ArgumentParser(prog="python -m d3p.audit")
    sub = parser.add_subparsers(dest="command")
    add_audit_subparser(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "audit":
        argv = ["audit"] + argv
    args = parser.parse_args(argv)
    return args.func(args, args.command_parser)
