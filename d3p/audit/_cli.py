# SPDX-License-Identifier: Apache-2.0
"""The ``audit`` command: ``python -m d3p audit ...`` (registered by
``d3p.__main__``) or ``python -m d3p.audit ...`` (this command on its own).
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import List, Optional, Sequence

from d3p import _validate

__all__ = ["add_audit_subparser", "register_audit", "main_audit", "main"]

#: The command line's spellings of the relation and the library's names for them.
_RELATIONS = {"add-remove": "add_remove", "substitute": "substitute"}
#: The threat models of :data:`d3p.audit.THREAT_MODELS`, as the command line spells them.
_THREAT_MODELS = {"every-step": "every_step", "final-params": "final_params"}
#: The library's argument names, as this command's options (for messages).
_OPTIONS = {"dp_scale": "--sigma", "clipping_threshold": "--clip", "q": "--q", "num_steps": "--steps",
            "num_runs": "--runs", "delta": "--delta", "beta": "--beta", "accountant": "--accountant",
            "sampling": "--sampling", "relation": "--relation", "threat_model": "--threat-model"}
_VALUES = {"relation": {v: k for k, v in _RELATIONS.items()},
           "threat_model": {v: k for k, v in _THREAT_MODELS.items()},
           "sampling": {"fixed_size": "fixed"}}


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
        allow_abbrev=False,
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
    p.add_argument("--sigma", type=_validate.cli_option(_validate.non_negative), default=1.0,
                   help="noise multiplier sigma >= 0 (default: 1.0)")
    p.add_argument("--clip", type=_validate.cli_option(_validate.positive), default=1.0,
                   help="clipping threshold C > 0 (default: 1.0)")
    p.add_argument("--q", type=_validate.cli_option(_validate.probability), default=0.5,
                   help="sampling probability in (0, 1], dpsvi only (default: 0.5)")
    p.add_argument("--steps", type=_validate.cli_option(_validate.integer, minimum=1, integral=True), default=4,
                   help="number of steps T >= 1, dpsvi only (default: 4)")
    p.add_argument("--sampling", choices=("poisson", "fixed"), default="poisson",
                   help="batch sampler, dpsvi only (default: poisson)")
    p.add_argument("--relation", type=_validate.option_choice("--relation", _RELATIONS), default="add-remove",
                   metavar="{add-remove,substitute}",
                   help="neighbouring relation, step only (default: add-remove; dpsvi: the sampler's)")
    p.add_argument("--threat-model", type=_validate.option_choice("--threat-model", _THREAT_MODELS),
                   default="every-step", metavar="{every-step,final-params}",
                   help="dpsvi only: the attacker sees every step (default) or only the final parameters")
    p.add_argument("--runs", type=_validate.cli_option(_validate.integer, minimum=2, integral=True), default=100000,
                   help="runs per data set, >= 2 (default: 100000); half choose the attack's threshold, "
                        "half give the bound")
    p.add_argument("--delta", type=_validate.cli_option(_validate.open_unit), default=1e-5,
                   help="delta in (0, 1) (default: 1e-5)")
    p.add_argument("--beta", type=_validate.cli_option(_validate.open_unit), default=0.05,
                   help="error probability in (0, 1); the bound holds with confidence 1-beta (default: 0.05)")
    p.add_argument("--accountant", choices=("fourier", "rdp", "pld"), default="fourier",
                   help="accountant of the claimed epsilon (default: fourier; 'pld' needs dp-accounting)")
    p.add_argument("--seed", type=_seed, default=None, help="seed of the PRNG key, an integer (default: OS entropy)")
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
    import d3p.random
    from d3p.audit._audits import audit_dpsvi, audit_gaussian_step

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
            print(f"Auditing one noisy clipped gradient step (--sigma {args.sigma:g}, --clip {args.clip:g}, "
                  f"--relation {_VALUES['relation'][args.relation]}) with {args.runs} runs per data set ...",
                  flush=True)
            res = audit_gaussian_step(key, args.runs, relation=args.relation, **common)
        else:
            print(f"Auditing {args.steps} DPSVI steps (--sigma {args.sigma:g}, --clip {args.clip:g}, "
                  f"--q {args.q:g}, --sampling {args.sampling}, --threat-model "
                  f"{_VALUES['threat_model'][args.threat_model]}) with {args.runs} runs per data set ...",
                  flush=True)
            res = audit_dpsvi(
                key, args.runs, q=args.q, num_steps=args.steps, threat_model=args.threat_model,
                sampling=args.sampling, **common
            )
    except (ValueError, TypeError) as e:
        if parser is None:
            raise
        parser.error(_validate.in_option_terms(str(e), _OPTIONS, _VALUES))
    print("\n".join(_result_lines(res, args.accountant)))
    return 1 if res.violation else 0


def _seed(text: str) -> int:
    """An integer seed, parsed exactly."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _result_lines(res, accountant: str) -> List[str]:
    """The result, once: both epsilons, the attack, the verdict and, where the
    runs are too few for the bound to reach the claim, a note on the runs needed."""
    from d3p.audit._stats import dp_max_auc

    b = res.bound
    verdict = ("VIOLATION: the lower bound exceeds the accountant's epsilon" if res.violation
               else "consistent: the lower bound does not exceed the accountant's epsilon")
    lines = [
        f"  epsilon_lower      = {res.epsilon_lower:.4f}  (confidence {1 - res.beta:.3g}, delta={res.delta:.3g}; "
        f"{b.num_in} + {b.num_out} evaluation runs, threshold chosen on the others)",
        f"  epsilon_accountant = {res.epsilon_accountant:.4f}  (accountant {accountant})",
        f"  attack: TPR={b.tpr:.4f} (>= {b.tpr_lower:.4f}), FPR={b.fpr:.4g} (<= {b.fpr_upper:.4g}), "
        f"AUC={res.auc:.4f} (max. for the claim: {dp_max_auc(min(res.epsilon_accountant, 700.0), res.delta):.4f})",
        f"  {verdict}",
    ]
    note = _power_note(len(res.scores_in), b.num_in, b.num_out, res.delta, res.beta, res.epsilon_accountant)
    return lines + ([f"  note: {note}"] if note else [])


def largest_detectable_epsilon(num_in: int, num_out: int, delta: float, beta: float) -> float:
    """The largest ε lower bound that ``num_in`` and ``num_out`` evaluation runs
    can give at confidence ``1 - beta``: that of an attack that is always right
    (all runs with the canary above the threshold, none without it)."""
    from d3p.audit._stats import clopper_pearson_bounds, epsilon_from_rates

    alpha = beta / 2
    tpr_lower, _ = clopper_pearson_bounds(num_in, num_in, alpha)
    _, fpr_upper = clopper_pearson_bounds(0, num_out, alpha)
    return float(epsilon_from_rates(tpr_lower, fpr_upper, delta))


def _detectable_with(runs: int, delta: float, beta: float) -> float:
    """:func:`largest_detectable_epsilon` for ``runs`` runs per data set, half of them evaluation runs."""
    from d3p.audit._stats import calibration_size

    evaluation = runs - calibration_size(runs, 0.5)
    return largest_detectable_epsilon(evaluation, evaluation, delta, beta)


def _power_note(runs: int, num_in: int, num_out: int, delta: float, beta: float, claimed: float) -> Optional[str]:
    """A note when even a perfect attack could not show a bound up to the claimed ε with these runs."""
    best = largest_detectable_epsilon(num_in, num_out, delta, beta)
    if not math.isfinite(claimed) or best >= claimed:
        return None
    needed, limit = runs, 10 ** 9
    while needed < limit and _detectable_with(needed, delta, beta) < claimed:
        needed *= 2
    low = max(needed // 2, runs)
    while low < needed - max(1, needed // 100):  # to about 1%
        middle = (low + needed) // 2
        if _detectable_with(middle, delta, beta) >= claimed:
            needed = middle
        else:
            low = middle
    what = ("no attack can give epsilon_lower > 0" if best <= 0
            else f"even an attack that is always right gives epsilon_lower <= {best:.3f}")
    more = (f"about {needed} runs per data set (--runs {needed}) are needed before an audit could "
            f"reach the claimed {claimed:.3f}" if needed < limit else
            f"more than {limit} runs per data set would be needed to reach the claimed {claimed:.3f}")
    return (f"with {runs} runs per data set {what} at confidence {1 - beta:.3g} and delta={delta:.3g}; "
            f"{more}. This audit could not have detected a violation.")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m d3p.audit [options]``: the ``audit`` command on its own.

    :param argv: arguments (default: ``sys.argv[1:]``); a leading ``audit`` is optional.
    :return: exit status, as :func:`main_audit`.
    """
    parser = argparse.ArgumentParser(prog="python -m d3p.audit", allow_abbrev=False)
    sub = parser.add_subparsers(dest="command")
    add_audit_subparser(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "audit":
        argv = ["audit"] + argv
    args = parser.parse_args(argv)
    return args.func(args, args.command_parser)
