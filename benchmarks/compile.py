"""What a user waits for before the first step: compiling DPSVI's step against
NumPyro SVI's, in one process (issue "Compile once").

For each model of ``benchmarks/dpsvi_vs_svi.py`` (the paper's logistic
regression, hierarchical logistic regression and VAE, generated data), the
jitted ``update`` of NumPyro's SVI and of DPSVI (C = 1, σ = 1, Adam, the
default gradient strategy, formulation and ChaCha20 noise) are traced,
lowered and compiled for the CPU, alternating SVI and DPSVI ``--rounds``
times; the table gives the medians over rounds of

- **trace + lower** and **compile** (XLA) seconds, each a fresh ``jax.jit``
  of a fresh bound method, so nothing is cached between rounds but XLA's own
  (no persistent compilation cache is set);
- **optimized ops**: instructions of the compiled CPU program (``" = "`` lines
  of its optimized HLO text);
- **CUDA-lowered ops**: operations of the StableHLO lowered for CUDA on this
  machine (``lower(lowering_platforms=("cuda",))``: what a GPU's compiler is
  given; no GPU needed);

and the ratios DPSVI / SVI. Then ``run()`` three times on the logistic
regression (N = 10,000, B = 256, 200 steps), at ε = 1, at ε = 4, and at
ε = 4 after ``clipping_threshold`` is set to 0.5: the seconds of each call
and the number of programs the later ones compile (the jitted chunk's cache
size and JAX's compile log).

Usage::

    python benchmarks/compile.py [--models logreg hlogreg vae] [--rounds 3] [--json OUT] [--rng-suite debug]

The code measured is the ``d3p`` on the import path: with
``PYTHONPATH=<a worktree of an earlier commit>`` the same script measures
that commit (``benchmarks/README.md`` gives both).
"""

import argparse
import json
import logging
import os
import sys
import time
import warnings

import jax
import numpy as np
import numpyro
from numpyro.infer import SVI, Trace_ELBO

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dpsvi_vs_svi import make_problem  # noqa: E402

import d3p.random  # noqa: E402
import d3p.random.debug  # noqa: E402
from d3p.svi import DPSVI  # noqa: E402


def _op_lines(text: str) -> int:
    return sum(1 for line in text.splitlines() if " = " in line)


def measure(make_update, state, batch) -> dict:
    """Trace + lower, compile (CPU) and op counts of ``jit(make_update())``."""
    update = make_update()
    t0 = time.perf_counter()
    lowered = jax.jit(lambda s, *b: update(s, *b)).trace(state, *batch).lower()
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    cuda = jax.jit(lambda s, *b: make_update()(s, *b)).trace(state, *batch).lower(
        lowering_platforms=("cuda",)).as_text()
    return {"trace_lower_s": t1 - t0, "compile_s": t2 - t1, "optimized_ops": _op_lines(compiled.as_text()),
            "cuda_lowered_ops": _op_lines(cuda)}


def bench_model(name: str, rounds: int, rng_suite=d3p.random) -> dict:
    model, guide, batch, shared, B, N, lr = make_problem(name, np.random.default_rng(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        svi = SVI(model, guide, numpyro.optim.Adam(lr), Trace_ELBO(), **shared)
        svi_state = svi.init(jax.random.PRNGKey(0), *batch)
        dpsvi = DPSVI(model, guide, numpyro.optim.Adam(lr), Trace_ELBO(), clipping_threshold=1.0, dp_scale=1.0,
                      rng_suite=rng_suite, **shared)
        dp_state = dpsvi.init(rng_suite.PRNGKey(0), *batch)
        out = {"svi": [], "dpsvi": []}
        for _ in range(rounds):
            out["svi"].append(measure(lambda: svi.update, svi_state, batch))
            out["dpsvi"].append(measure(lambda: dpsvi.update, dp_state, batch))
    row = {"model": name, "B": B}
    for who in ("svi", "dpsvi"):
        for k in out[who][0]:
            row[f"{who}_{k}"] = float(np.median([r[k] for r in out[who]]))
    for k in ("compile_s", "optimized_ops", "cuda_lowered_ops"):
        row[f"ratio_{k}"] = row[f"dpsvi_{k}"] / row[f"svi_{k}"]
    row["ratio_trace_lower_plus_compile"] = (
        (row["dpsvi_trace_lower_s"] + row["dpsvi_compile_s"]) / (row["svi_trace_lower_s"] + row["svi_compile_s"]))
    return row


class _CompileCounter(logging.Handler):
    """Counts JAX's "Compiling ..." log records (``jax_log_compiles``)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.names = []

    def emit(self, record):
        message = record.getMessage()
        if message.startswith("Compiling "):
            self.names.append(message.split(" ")[1])


def bench_runs() -> dict:
    """Runs of one DPSVI at ε = 1, at ε = 4, then at ε = 4 with the clipping
    threshold set to 0.5 between runs: seconds and what each compiles."""
    from d3p._paper_models import logistic_regression_guide, logistic_regression_model

    rng = np.random.default_rng(1)
    N, d = 10_000, 30
    xs = rng.normal(size=(N, d)).astype(np.float32)
    ys = (rng.random(N) < 1 / (1 + np.exp(-xs @ rng.normal(size=d)))).astype(np.float32)
    dpsvi = DPSVI(logistic_regression_model, logistic_regression_guide, numpyro.optim.Adam(1e-3), Trace_ELBO(),
                  clipping_threshold=1.0, N=N)
    counter = _CompileCounter()
    logger = logging.getLogger("jax")
    logger.addHandler(counter)
    out = {}
    try:
        with warnings.catch_warnings(), jax.log_compiles(True):
            warnings.simplefilter("ignore")
            for label, epsilon, C in (("first", 1.0, 1.0), ("second", 4.0, 1.0), ("third", 4.0, 0.5)):
                dpsvi.clipping_threshold = C
                counter.names.clear()
                t0 = time.perf_counter()
                result = dpsvi.run(d3p.random.PRNGKey(0), 200, xs, ys, batch_size=256, epsilon=epsilon,
                                   delta=1 / N**2, progress_bar=False)
                jax.block_until_ready(result.params)
                out[f"{label}_run_s"] = time.perf_counter() - t0
                out[f"{label}_sigma"] = float(result.sigma)
                out[f"{label}_compiled_programs"] = len(counter.names)
                out[f"{label}_compiled_names"] = sorted(set(counter.names))
    finally:
        logger.removeHandler(counter)
    chunks = [entry[1] for entry in dpsvi._run_cache._chunks.values()]
    out["run_chunk_cache_sizes"] = [c._cache_size() for c in chunks]
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["logreg", "hlogreg", "vae"],
                        choices=["logreg", "hlogreg", "vae"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-runs", action="store_true", help="skip the two runs")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--rng-suite", choices=["chacha", "debug"], default="chacha",
                        help="DPSVI's PRNG suite: d3p.random (ChaCha20, the default) or d3p.random.debug "
                             "(JAX's Threefry; for telling the generator's share of the compile)")
    args = parser.parse_args(argv)
    rng_suite = d3p.random.debug if args.rng_suite == "debug" else d3p.random
    print(f"d3p from {os.path.dirname(d3p.__file__)}, jax {jax.__version__}, numpyro {numpyro.__version__}, "
          f"{os.cpu_count()} CPUs", flush=True)
    rows = []
    print("| model | B | SVI trace+lower s | SVI compile s | DPSVI trace+lower s | DPSVI compile s | compile ratio | "
          "(trace+lower+compile) ratio | optimized ops SVI / DPSVI (ratio) | CUDA-lowered ops SVI / DPSVI (ratio) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        r = bench_model(name, args.rounds, rng_suite)
        rows.append(r)
        print(f"| {name} | {r['B']} | {r['svi_trace_lower_s']:.2f} | {r['svi_compile_s']:.2f} | "
              f"{r['dpsvi_trace_lower_s']:.2f} | {r['dpsvi_compile_s']:.2f} | {r['ratio_compile_s']:.2f} | "
              f"{r['ratio_trace_lower_plus_compile']:.2f} | {r['svi_optimized_ops']:.0f} / "
              f"{r['dpsvi_optimized_ops']:.0f} ({r['ratio_optimized_ops']:.2f}) | {r['svi_cuda_lowered_ops']:.0f} / "
              f"{r['dpsvi_cuda_lowered_ops']:.0f} ({r['ratio_cuda_lowered_ops']:.2f}) |", flush=True)
    runs = None if args.no_runs else bench_runs()
    if runs is not None:
        print(f"run() at ε = 1: {runs['first_run_s']:.2f} s ({runs['first_compiled_programs']} programs compiled); "
              f"then at ε = 4: {runs['second_run_s']:.2f} s ({runs['second_compiled_programs']} programs compiled: "
              f"{', '.join(runs['second_compiled_names']) or 'none'}); then at C = 0.5: {runs['third_run_s']:.2f} s "
              f"({runs['third_compiled_programs']} programs compiled: "
              f"{', '.join(runs['third_compiled_names']) or 'none'}); run chunk cache sizes "
              f"{runs['run_chunk_cache_sizes']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"models": rows, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
