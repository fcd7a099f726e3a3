"""``update`` called as NumPyro code often calls it: eagerly, in a Python loop.

NumPyro's ``SVI.update`` runs operation by operation when called outside
``jax.jit``: every operation of the step is dispatched (and, the first time
a shape is seen in a process, compiled) on its own. d3p's ``DPSVI.update``
did too; it now runs an eager call as one compiled program. Each configuration runs in a fresh Python process (an empty
compilation cache: ``JAX_ENABLE_COMPILATION_CACHE=0``): the first call
(compilation included) and the median of the next calls, for

- ``svi`` / ``dpsvi``: NumPyro ``SVI`` / ``DPSVI`` (C = 1, σ = 1, the
  default strategy and generator);
- ``eager`` / ``jit``: ``svi.update(state, *batch)`` / ``jax.jit(svi.update)``.

The models and batches are those of ``benchmarks/dpsvi_vs_svi.py``; the
ratios are DPSVI's over SVI's, called the same way.

Usage::

    python benchmarks/eager_update.py                  # logreg and vae, 5 calls
    python benchmarks/eager_update.py --models hlogreg --calls 8
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))


def child(kind: str, how: str, name: str, calls: int) -> None:
    import jax
    import numpy as np
    import numpyro
    from numpyro.infer import SVI, Trace_ELBO

    import d3p.random
    from d3p.svi import DPSVI

    sys.path.insert(0, HERE)
    from dpsvi_vs_svi import make_problem

    warnings.simplefilter("ignore")
    model, guide, batch, shared, _, _, lr = make_problem(name, np.random.default_rng(0))
    if kind == "svi":
        svi = SVI(model, guide, numpyro.optim.Adam(lr), Trace_ELBO(), **shared)
        state = svi.init(jax.random.PRNGKey(0), *batch)
    else:
        svi = DPSVI(model, guide, numpyro.optim.Adam(lr), Trace_ELBO(), clipping_threshold=1.0, dp_scale=1.0,
                    **shared)
        state = svi.init(d3p.random.PRNGKey(0), *batch)
    update = svi.update if how == "eager" else jax.jit(svi.update)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        state, loss = update(state, *batch)
        jax.block_until_ready((state, loss))
        times.append(time.perf_counter() - start)
    print(json.dumps({"first": times[0], "then": statistics.median(times[1:])}))


def measure(kind: str, how: str, name: str, calls: int) -> dict:
    env = dict(os.environ, JAX_ENABLE_COMPILATION_CACHE="0")
    out = subprocess.run([sys.executable, __file__, "--child", kind, how, name, str(calls)],
                         env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["logreg", "vae"], choices=["logreg", "hlogreg", "vae"])
    parser.add_argument("--calls", type=int, default=5, help="calls per process (the first one compiles)")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, how, name, calls = args.child
        child(kind, how, name, int(calls))
        return
    if args.calls < 2:
        parser.error(f"Expected --calls >= 2 (the first call, then at least one more), got {args.calls}.")
    print("| model | called | SVI first s | DPSVI first s (ratio) | SVI then ms | DPSVI then ms (ratio) |")
    print("|---|---|---|---|---|---|")
    for name in args.models:
        for how in ("eager", "jit"):
            svi, dp = measure("svi", how, name, args.calls), measure("dpsvi", how, name, args.calls)
            print(f"| {name} | {how} | {svi['first']:.2f} | {dp['first']:.2f} ({dp['first'] / svi['first']:.2g}) | "
                  f"{1e3 * svi['then']:.1f} | {1e3 * dp['then']:.1f} ({dp['then'] / svi['then']:.2g}) |", flush=True)


if __name__ == "__main__":
    main()
