"""Time a private DPSVI step against a non-private NumPyro SVI step.

Both ``update`` functions are jitted and run in this one process on the same
data, after warm-up. For every model and configuration the script reports the
median wall time per step, the ratio DP / non-private, the compile time, XLA's
temporary buffer size of the compiled step (``memory_analysis``) and the growth
of the process's peak resident memory (``getrusage`` maxrss) during the
configuration.

Models (all with generated data; no downloads):

- ``vae``: the d3p paper's MNIST VAE, encoder 784-400-(50, 50) and decoder
  50-400-784 (688,884 parameters), Bernoulli likelihood, batch 128 of
  N = 60,000 MNIST-shaped binary images; weights are ``numpyro.param`` sites
  in the model (decoder) and the guide (encoder), the latent ``z`` is local,
  under the data plate.

The models and guides are the paper's, from ``d3p._paper_models``.
- ``logreg``: the paper's logistic regression (listing 2), d = 30,
  N = 100,000, B = 256, mean-field Gaussian guide.
- ``hlogreg``: the paper's hierarchical logistic regression (listing 4),
  D = 5, K = 3, L = 3 (section 5.3), N = 500, B = 100; the group covariates
  ``gs`` are shared by all records and go to the DPSVI constructor.

Usage::

    python benchmarks/dpsvi_vs_svi.py                 # all models, all strategies
    python benchmarks/dpsvi_vs_svi.py --quick         # fewer steps (CI smoke run)
    python benchmarks/dpsvi_vs_svi.py --models vae --large-batch 4096

The results are printed as a Markdown table and written as JSON to
``--output-dir`` (default ``benchmarks/output/``).
"""

import argparse
import gc
import itertools
import json
import os
import platform
import resource
import statistics
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
from numpyro.infer import SVI, Trace_ELBO

import d3p.random
import d3p.random.debug
from d3p import gradients
from d3p._paper_models import (
    hierarchical_logistic_regression_guide,
    hierarchical_logistic_regression_model,
    logistic_regression_guide,
    logistic_regression_model,
    make_vae,
)
from d3p.svi import DPSVI

# --------------------------------------------------------------------- models

# the paper's MNIST network
VAE_MODEL, VAE_GUIDE = make_vae(784, 400, 50)


def vae_data(rng, N=60000, D=784):
    """MNIST-shaped binary images: 10 random prototypes with bit flips."""
    protos = rng.random((10, D)) < 0.2
    labels = rng.integers(0, 10, N)
    flips = rng.random((N, D)) < 0.05
    return ((protos[labels] ^ flips).astype(np.float32),)


def logreg_data(rng, N=100000, d=30):
    xs = rng.normal(size=(N, d)).astype(np.float32)
    w = rng.normal(size=d)
    ys = (rng.random(N) < 1 / (1 + np.exp(-xs @ w))).astype(np.float32)
    return xs, ys


def hlogreg_data(rng, N=500, D=5, K=3, L=3):
    gs = rng.normal(size=(L, K)).astype(np.float32)
    M = rng.normal(size=(D, K))
    ws = gs @ M.T + rng.normal(size=(L, D))
    ls = rng.integers(0, L, N).astype(np.int32)
    xs = rng.normal(size=(N, D)).astype(np.float32)
    logits = np.einsum("nd,nd->n", xs, ws[ls])
    ys = (rng.random(N) < 1 / (1 + np.exp(-logits))).astype(np.float32)
    return (xs, ys, ls), gs


MODELS = {
    # name: (model, guide, batch size, learning rate)
    "vae": (VAE_MODEL, VAE_GUIDE, 128, 1e-3),
    "logreg": (logistic_regression_model, logistic_regression_guide, 256, 1e-3),
    "hlogreg": (hierarchical_logistic_regression_model, hierarchical_logistic_regression_guide, 100, 1e-3),
}


def make_problem(name, rng, batch_size=None):
    """(model, guide, batch arrays, shared kwargs, B, N, lr)."""
    model, guide, B, lr = MODELS[name]
    B = batch_size or B
    if name == "vae":
        data, shared = vae_data(rng), {}
    elif name == "logreg":
        data, shared = logreg_data(rng), {}
    else:
        data, shared = hlogreg_data(rng)
        shared = {"gs": jnp.asarray(shared)}
    N = data[0].shape[0]
    idx = rng.choice(N, B, replace=False)
    batch = tuple(jnp.asarray(x[idx]) for x in data)
    shared["N"] = N
    return model, guide, batch, shared, B, N, lr


# ------------------------------------------------------------------ measuring


def _maxrss_bytes():
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


class Config:
    """One compiled update function and its state, timed in interleaved rounds."""

    def __init__(self, label, update, state, batch, info, execute=True, loop=0):
        rss0 = _maxrss_bytes()
        self.loop = loop
        fn = jax.jit(update if not loop else _in_a_loop(update, loop))
        t0 = time.perf_counter()
        self.compiled = fn.lower(state, *batch).compile()
        self.compile_s = time.perf_counter() - t0
        # the strategy the DPSVI chose while tracing its update (DPSVI only)
        choice = update.__self__.strategy_choice if info.get("what") == "DPSVI" else None
        self.chosen = None if choice is None else gradients.choice_on_default_backend(choice)
        try:
            self.temp = int(self.compiled.memory_analysis().temp_size_in_bytes)
        except Exception:  # noqa: BLE001 - not every backend reports it
            self.temp = None
        self.label, self.batch, self.info, self.execute = label, batch, info, execute
        self.times = []
        self.round_medians = []
        self.state, self.loss = state, None
        if execute:
            self.state, self.loss = self.compiled(state, *batch)  # warm-up
            jax.block_until_ready(self.state)
        self.rss_growth = _maxrss_bytes() - rss0

    def run(self, steps, max_seconds=2.0, min_seconds=0.25):
        """``steps`` steps, or fewer (at least one) once ``max_seconds`` have
        passed, or more until ``min_seconds`` have passed (so that a round of
        sub-millisecond steps has enough of them for a stable median)."""
        if not self.execute:
            return
        start = time.perf_counter()
        times = []
        while True:
            elapsed = time.perf_counter() - start
            if times and (elapsed > max_seconds or (len(times) >= steps and elapsed >= min_seconds)):
                break
            t = time.perf_counter()
            self.state, self.loss = self.compiled(self.state, *self.batch)
            jax.block_until_ready(self.state)
            times.append((time.perf_counter() - t) / max(1, self.loop))
        self.times += times
        self.round_medians.append(statistics.median(times))

    def result(self):
        return dict(
            self.info,
            label=self.label,
            compile_s=self.compile_s,
            ms_median=1e3 * statistics.median(self.times) if self.times else None,
            ms_min=1e3 * min(self.times) if self.times else None,
            steps=len(self.times),
            xla_temp_bytes=self.temp,
            maxrss_growth_bytes=self.rss_growth,
            chosen=None if self.chosen is None else f"{self.chosen.strategy}"
            + (f" (chunks of {self.chosen.chunk_size})" if self.chosen.chunk_size else ""),
            chosen_reason=None if self.chosen is None else self.chosen.reason,
            loss_finite=None if self.loss is None else bool(np.isfinite(np.asarray(self.loss))),
        )


def _in_a_loop(update, length):
    """``update`` applied ``length`` times to the same batch in one jitted
    ``lax.fori_loop``: ``(state, *batch) -> (state, loss of the last step)``."""

    def loop(state, *batch):
        def body(i, carry):
            return update(carry[0], *batch)

        first = update(state, *batch)
        return jax.lax.fori_loop(1, length, body, first)

    return loop


def bench_model(name, strategies, suites, steps, rounds, rng, batch_size=None, with_svi=True,
                compile_only=(), chunk_size=None, noises=("gaussian",), formulations=("auto",), loop=0,
                **dp_kwargs):
    """Compile SVI and every DPSVI configuration, then time them in interleaved
    rounds (so that load from other processes hits all alike)."""
    model, guide, batch, shared, B, N, lr = make_problem(name, rng, batch_size)
    configs = []
    if with_svi:
        svi = SVI(model, guide, numpyro.optim.Adam(lr), Trace_ELBO(), **shared)
        state = svi.init(jax.random.PRNGKey(0), *batch)
        configs.append(Config("numpyro SVI", svi.update, state, batch, {"model": name, "B": B, "what": "SVI"},
                              loop=loop))
    for suite, strategy, noise, formulation in itertools.product(
            suites, list(strategies) + list(compile_only), noises, formulations):
        if noise == "discrete" and strategy not in ("auto", "scan"):
            continue   # the discrete mechanism forms one record's gradient at a time
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", category=Warning)
            extra = dict(dp_kwargs, noise=noise, formulation=formulation)
            if strategy == "chunked" and chunk_size:
                extra["chunk_size"] = chunk_size
            dpsvi = DPSVI(
                model, guide, numpyro.optim.Adam(lr), Trace_ELBO(), clipping_threshold=1.0,
                dp_scale=1.0, rng_suite=suite, gradient_strategy=strategy, **extra, **shared
            )
            state = dpsvi.init(suite.PRNGKey(0), *batch)
        suite_name = "chacha" if suite is d3p.random else "debug"
        execute = strategy in strategies
        noise_name = "" if noise == "gaussian" else f", {noise}"
        formulation_name = "" if formulation == "auto" else f", {formulation}"
        configs.append(Config(
            f"DPSVI {strategy} ({suite_name}{noise_name}{formulation_name})" + ("" if execute else " [compiled only]"),
            dpsvi.update, state, batch,
            {"model": name, "B": B, "what": "DPSVI", "strategy": strategy, "rng_suite": suite_name,
             "noise": noise, "formulation": formulation},
            execute=execute, loop=loop,
        ))
        gc.collect()
    per_round = max(1, steps // rounds)
    for _ in range(rounds):
        for c in configs:
            c.run(per_round)
    results = [c.result() for c in configs]
    if with_svi:
        # the ratio in each round (same load for both), then the median over rounds
        base = configs[0].round_medians
        for c, r in zip(configs, results):
            if c.round_medians:
                r["ratio"] = statistics.median(m / b for m, b in zip(c.round_medians, base))
                r["ratio_per_round"] = [m / b for m, b in zip(c.round_medians, base)]
    _discrete_ratios(configs, results)
    for r in results:
        print(_fmt_row(r), flush=True)
    return results


def _discrete_ratios(configs, results):
    """Each discrete-noise row's time over the same strategy and suite with
    Gaussian noise, per round (same load), median over rounds."""
    gaussian = {(r.get("strategy"), r.get("rng_suite"), r.get("formulation")): c for c, r in zip(configs, results)
                if r.get("noise") == "gaussian" and c.round_medians}
    for c, r in zip(configs, results):
        base = gaussian.get((r.get("strategy"), r.get("rng_suite"), r.get("formulation")))
        if r.get("noise") == "discrete" and base is not None and c.round_medians:
            r["vs_gaussian"] = statistics.median(m / b for m, b in zip(c.round_medians, base.round_medians))


def _fmt_bytes(b):
    if b is None:
        return "n/a"
    if b < 2**20:
        return f"{b / 2**10:.0f} KiB"
    if b < 2**30:
        return f"{b / 2**20:.0f} MiB"
    return f"{b / 2**30:.1f} GiB"


def _fmt_row(r):
    ratio = f"{r['ratio']:.2f}" if "ratio" in r else "n/a"
    ms = "not run" if r["ms_median"] is None else f"{r['ms_median']:.2f}"
    label = r["label"]
    if r.get("chosen"):
        label += f" → {r['chosen']}"
    if "vs_gaussian" in r:
        label += f" [{r['vs_gaussian']:.2f}× the Gaussian-noise step]"
    return (
        f"| {r['model']} | {r['B']} | {label} | {ms} | {ratio} | {r['compile_s']:.1f} | "
        f"{_fmt_bytes(r['xla_temp_bytes'])} | {_fmt_bytes(r['maxrss_growth_bytes'])} |"
    )


HEADER = (
    "| model | B | step | ms/step (median) | ratio to SVI (median over rounds) | compile s | XLA temp | peak RSS growth |\n"
    "|---|---|---|---|---|---|---|---|"
)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS),
                        help="models at their paper batch sizes (none: only --large-batch)")
    parser.add_argument("--strategies", nargs="+", default=None,
                        help="gradient strategies to time (default: all in d3p.gradients.STRATEGIES)")
    parser.add_argument("--suites", nargs="+", default=["chacha", "debug"], choices=["chacha", "debug"],
                        help="PRNG suites for the privacy noise")
    parser.add_argument("--steps", type=int, default=200, help="timed steps per configuration")
    parser.add_argument("--rounds", type=int, default=10,
                        help="interleaved rounds over the configurations (steps are split among them)")
    parser.add_argument("--chunk-size", type=int, default=16,
                        help="records per chunk for the 'chunked' strategy (0: from the memory budget)")
    parser.add_argument("--large-batch", type=int, default=0,
                        help="also run the VAE with this batch size (e.g. 4096) under the memory budget")
    parser.add_argument("--noises", nargs="+", default=["gaussian"], choices=["gaussian", "discrete"],
                        help="noise mechanisms (DPSVI's noise=); 'discrete' rows also report their time "
                             "over the Gaussian row of the same strategy and suite")
    parser.add_argument("--formulations", nargs="+", default=["auto"],
                        choices=["auto", "shared_sample", "own_sample", "per_record"],
                        help="DPSVI's formulation= (which ELBO terms are clipped per record, see d3p.svi.DPSVI)")
    parser.add_argument("--loop", type=int, default=0,
                        help="time LOOP steps inside one jitted lax.fori_loop per call (per-step time reported; "
                             "0: one jitted step per call from Python)")
    parser.add_argument("--quick", action="store_true", help="few steps, auto strategy only")
    parser.add_argument("--output-dir", default=os.path.join("benchmarks", "output"))
    args = parser.parse_args(argv)

    strategies = args.strategies or [s for s in gradients.STRATEGIES]
    steps = args.steps
    if args.quick:
        strategies, steps, args.rounds = args.strategies or ["auto"], 3, 1
    suites = [{"chacha": d3p.random, "debug": d3p.random.debug}[s] for s in args.suites]
    print(f"jax {jax.__version__}, numpyro {numpyro.__version__}, backend {jax.default_backend()}, "
          f"devices {jax.devices()}, {os.cpu_count()} CPUs, {platform.platform()}")
    print(HEADER)
    rows = []
    rng = np.random.default_rng(0)
    for name in args.models:
        rows += bench_model(name, strategies, suites, steps, args.rounds, rng, chunk_size=args.chunk_size,
                            noises=args.noises, formulations=args.formulations, loop=args.loop)
    if args.large_batch:
        # all B per-record gradients at once would need B x 2.6 MiB: compile it
        # only, to show the XLA buffer it would allocate
        big = [s for s in (args.strategies or ["auto", "scan"]) if s != "vmap"]
        rows += bench_model("vae", big, suites[:1], 3, 3, rng, batch_size=args.large_batch,
                            compile_only=("vmap",))

    os.makedirs(args.output_dir, exist_ok=True)
    out = os.path.join(args.output_dir, "dpsvi_vs_svi.json")
    with open(out, "w") as f:
        json.dump({"argv": sys.argv, "jax": jax.__version__, "backend": jax.default_backend(),
                   "rows": rows}, f, indent=1)
    print(f"peak RSS of this process: {_fmt_bytes(_maxrss_bytes())}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
