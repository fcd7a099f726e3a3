"""What the example scripts share: options, calibration, parallel runs and output.

The scripts import it as ``_common``: Python puts a script's own folder first
on the module path, so this works with ``python examples/x.py`` from the
repository root as well as ``python x.py`` from inside ``examples/``.
"""

import argparse
import csv
import os
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, Iterable, List, Mapping, Sequence, Tuple

import jax

from d3p.accounting import accounting_for
from d3p.dputil import calibrate_sigma

NON_PRIVATE = float("inf")  # the "ε" of the non-private runs

SAMPLING_HELP = ("poisson (default; add/remove relation) or fixed-size batches without replacement "
                 "(substitute relation)")

# NumPyro's effect handlers live on one global stack, so tracing must not run
# in two threads at once; compiling and running can.
TRACE_LOCK = threading.Lock()


def _default_output_dir() -> str:
    """``examples/output``, relative to the working directory where it can be."""
    folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), "output")
    try:
        return os.path.relpath(folder)
    except ValueError:  # another drive: no relative path
        return folder


OUTPUT_DIR = _default_output_dir()
OUTPUT_HELP = "where the outputs go (default: examples/output/)"


def parser(doc: str) -> argparse.ArgumentParser:
    """An argument parser described by the first paragraph of ``doc``."""
    return argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def fill_defaults(args: argparse.Namespace, quick: Mapping, full: Mapping) -> argparse.Namespace:
    """Set every option still ``None`` to its ``quick`` or ``full`` default (by ``args.quick``)."""
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def sampler_name(sampling: str) -> str:
    """The accounting's name of a ``DPSVI.run`` sampling option."""
    return "poisson" if sampling == "poisson" else "fixed_size"


def describe_sampling(sampling: str) -> str:
    """The sampler and relation a ``--sampling`` option is accounted with, in words."""
    return accounting_for(sampler_name(sampling)).describe()


def batch_size_words(sampling: str) -> str:
    """What B is under a ``--sampling`` option."""
    return "expected batch size" if sampling == "poisson" else "batch size"


def label(eps: float) -> str:
    """``ε=<eps>``, or ``non-private`` for :data:`NON_PRIVATE`."""
    return "non-private" if eps == NON_PRIVATE else f"ε={eps:g}"


def noise_and_clip(epsilon: float, delta: float, q: float, num_steps: int, sampling: str,
                   clipping_threshold: float) -> Tuple[float, float]:
    """``(σ, C)`` of a run at ``epsilon``: σ calibrated for the sampler the run
    uses (Poisson: add/remove; fixed: substitute), or ``(0, inf)`` (plain
    minibatch VI) for :data:`NON_PRIVATE`."""
    if epsilon == NON_PRIVATE:
        return 0.0, float("inf")
    sigma, _, _ = calibrate_sigma(epsilon, delta, q, num_steps, sampler=sampler_name(sampling))
    return sigma, clipping_threshold


def train_seeds(one_run: Callable, keys, *, ignore_warnings: Sequence[str] = ()):
    """``one_run`` for every key at once (``jax.vmap`` in one compiled program).

    :return: the stacked outputs and the seconds taken (compiling included).
    """
    start = time.perf_counter()
    with TRACE_LOCK, warnings.catch_warnings():
        for message in ignore_warnings:
            warnings.filterwarnings("ignore", message=message)
        lowered = jax.jit(jax.vmap(one_run)).lower(keys)
    out = jax.block_until_ready(lowered.compile()(keys))
    return out, time.perf_counter() - start


def run_in_parallel(fn: Callable, items: Iterable, jobs: int, report: Callable[[Dict], str]) -> Tuple[List, float]:
    """``fn(item)`` for every item in up to ``jobs`` threads, printing
    ``report(result)`` for each in order; returns the results and the seconds."""
    start = time.perf_counter()
    results = []
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for fut in [pool.submit(fn, item) for item in items]:
            results.append(fut.result())
            print(report(results[-1]), flush=True)
    return results, time.perf_counter() - start


def save_figure(fig, output_dir: str, name: str, dpi: int = 120) -> str:
    """Lay out, write ``output_dir/name`` and close ``fig``; returns the path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = os.path.join(output_dir, name)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def write_csv(path: str, header: Sequence[str], rows: Iterable[Sequence]) -> str:
    """Write ``header`` and ``rows`` as CSV to ``path``; returns the path."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def print_written(*paths: str) -> None:
    """Say where each output went."""
    for path in paths:
        print(f"Wrote {path}")
