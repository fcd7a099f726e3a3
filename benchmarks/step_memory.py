"""Peak memory of one process running the VAE's step: DPSVI against NumPyro SVI.

Each configuration runs in a fresh Python process (the peak RSS only grows):
the d3p paper's MNIST-sized VAE of ``dpsvi_vs_svi.py`` (688,884 parameters,
60,000 generated records), ``init``, the jitted ``update`` compiled, one
warm-up step and 5 timed steps. Prints per batch size the whole-process peak
RSS, XLA's temporary buffers of the compiled step and the step's time, for
SVI and for DPSVI (C = 1, σ = 1, the default strategy), and the DPSVI/SVI
ratios. ``--budget-mib`` sets DPSVI's ``memory_budget_bytes`` (default: the
library's).

Usage::

    python benchmarks/step_memory.py                      # B = 128, 1024, 4096
    python benchmarks/step_memory.py --budget-mib 1024    # the budget of d3p before 0.3's CPU default
"""

import argparse
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def child(kind: str, B: int, budget_mib) -> None:
    sys.path.insert(0, HERE)
    import jax
    import numpy as np
    import numpyro
    from numpyro.infer import SVI, Trace_ELBO

    import d3p.random
    import dpsvi_vs_svi as b
    from d3p.svi import DPSVI

    model, guide, batch, shared, B, N, lr = b.make_problem("vae", np.random.default_rng(0), batch_size=B)
    if kind == "svi":
        svi = SVI(model, guide, numpyro.optim.Adam(lr), Trace_ELBO(), **shared)
        state = svi.init(jax.random.PRNGKey(0), *batch)
    else:
        budget = None if budget_mib is None else budget_mib << 20
        svi = DPSVI(model, guide, numpyro.optim.Adam(lr), Trace_ELBO(), clipping_threshold=1.0, dp_scale=1.0,
                    memory_budget_bytes=budget, **shared)
        state = svi.init(d3p.random.PRNGKey(0), *batch)
    compiled = jax.jit(svi.update).lower(state, *batch).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    state, _ = compiled(state, *batch)
    jax.block_until_ready(state)
    t = time.perf_counter()
    for _ in range(5):
        state, _ = compiled(state, *batch)
    jax.block_until_ready(state)
    step = (time.perf_counter() - t) / 5
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    print(f"RESULT {peak} {temp} {step}")


def measure(kind: str, B: int, budget_mib) -> tuple:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, str(B)]
    if budget_mib is not None:
        cmd += ["--budget-mib", str(budget_mib)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    peak, temp, step = next(line for line in out.splitlines() if line.startswith("RESULT")).split()[1:]
    return int(peak) / 2**20, int(temp) / 2**20, float(step) * 1e3


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[128, 1024, 4096])
    parser.add_argument("--budget-mib", type=int, default=None)
    parser.add_argument("--child", nargs=2, metavar=("KIND", "B"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child[0], int(args.child[1]), args.budget_mib)
    budget = "default" if args.budget_mib is None else f"{args.budget_mib} MiB"
    print(f"VAE step, DPSVI memory budget {budget}")
    print("| B | SVI peak MB | DPSVI peak MB | peak ratio | SVI / DPSVI XLA temp MB | SVI / DPSVI step ms |")
    print("|---|---|---|---|---|---|")
    for B in args.batch_sizes:
        s_peak, s_temp, s_step = measure("svi", B, None)
        d_peak, d_temp, d_step = measure("dpsvi", B, args.budget_mib)
        print(f"| {B} | {s_peak:.0f} | {d_peak:.0f} | {d_peak / s_peak:.2f} | {s_temp:.0f} / {d_temp:.0f} | "
              f"{s_step:.1f} / {d_step:.1f} |", flush=True)


if __name__ == "__main__":
    main()
