"""Time the private DPSVI step sharded over 1, 2, 4 and 8 devices.

The d3p paper's MNIST VAE (``d3p._paper_models.make_vae``, 688,884
parameters) on a batch of B = 4096 MNIST-shaped binary images (generated, no
downloads), one jitted ``DPSVI.update`` per configuration, all in this one
process: the step without a mesh (the baseline), then with a mesh of 1, 2, 4
and 8 devices (``DPSVI(..., mesh=jax.make_mesh((D,), ("batch",)))``). The
configurations are compiled first and then timed in interleaved rounds, so
that load from other processes hits them alike; per round the ratio
baseline / sharded is taken, and the table gives the median step time and
the median ratio over rounds (above 1: faster than one device), the CPU time
per step (all threads of the process), the compile time, and how far the
released gradient of one step (same key and batch, taken with SGD so that
the parameters move by exactly that gradient) is from the baseline's: the
largest difference per parameter array relative to its largest entry.

On a machine without several accelerators the devices are CPU host devices
(``--xla_force_host_platform_device_count``, set by this script before JAX
starts unless ``XLA_FLAGS`` already sets it; ``--platform`` picks another
backend), which share the machine's cores.

Usage::

    python benchmarks/sharding.py                  # D = 1, 2, 4, 8; B = 4096
    python benchmarks/sharding.py --quick          # B = 256, fewer rounds
    python benchmarks/sharding.py --devices 1 2 --batch-size 1024

The results are printed as a Markdown table and written as JSON to
``--output-dir`` (default ``benchmarks/output/``).
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8], help="device counts (default 1 2 4 8)")
    p.add_argument("--batch-size", type=int, default=None, help="B (default 4096; 256 with --quick)")
    p.add_argument("--strategy", default="auto", help="gradient_strategy (default auto: ghost norms)")
    p.add_argument("--rounds", type=int, default=None, help="timing rounds (default 7; 2 with --quick)")
    p.add_argument("--steps", type=int, default=5, help="steps per configuration and round (default 5)")
    p.add_argument("--platform", default="cpu", help="JAX platform (default cpu: host devices)")
    p.add_argument("--quick", action="store_true", help="a small smoke run")
    p.add_argument("--output-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "output"),
                   help="where the JSON goes (default benchmarks/output/)")
    args = p.parse_args(argv)
    args.batch_size = args.batch_size or (256 if args.quick else 4096)
    args.rounds = args.rounds or (2 if args.quick else 7)
    return args


def force_host_devices(count: int) -> None:
    """Ask XLA for ``count`` CPU devices; must run before JAX initialises."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


ARGS = parse_args()
if ARGS.platform == "cpu":
    force_host_devices(max(ARGS.devices))
os.environ.setdefault("JAX_PLATFORMS", ARGS.platform)

import jax  # noqa: E402  (after the device count is set)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import numpyro  # noqa: E402
from numpyro.infer import Trace_ELBO  # noqa: E402

import d3p.random  # noqa: E402
from d3p._paper_models import make_vae  # noqa: E402
from d3p.svi import DPSVI  # noqa: E402

N = 60000


def vae_batch(B, seed=0, D=784):
    """B MNIST-shaped binary images: 10 random prototypes with bit flips."""
    rng = np.random.default_rng(seed)
    protos = rng.random((10, D)) < 0.2
    flips = rng.random((B, D)) < 0.05
    return jnp.asarray((protos[rng.integers(0, 10, B)] ^ flips).astype(np.float32))


class Config:
    """One compiled step and its state, timed in rounds."""

    def __init__(self, label, svi, xs):
        self.label, self.svi, self.xs = label, svi, xs
        state = svi.init(d3p.random.PRNGKey(0), xs)
        self.gradient = released_gradient(svi, xs)
        t0 = time.perf_counter()
        self.step = jax.jit(svi.update).lower(state, xs).compile()
        self.compile_s = time.perf_counter() - t0
        self.state, _ = self.step(state, xs)   # warm-up
        jax.block_until_ready(self.state)
        self.rounds, self.cpu = [], []

    def run(self, steps):
        times = []
        cpu0 = time.process_time()
        for _ in range(steps):
            t = time.perf_counter()
            self.state, _ = self.step(self.state, self.xs)
            jax.block_until_ready(self.state)
            times.append(time.perf_counter() - t)
        self.cpu.append((time.process_time() - cpu0) / steps)
        self.rounds.append(statistics.median(times))



def released_gradient(svi, xs):
    """The noisy gradient of one step of ``svi``'s configuration with SGD (step size 1)."""
    sgd = DPSVI(svi.model, svi.guide, numpyro.optim.SGD(1.0), Trace_ELBO(), svi.clipping_threshold,
                svi.dp_scale, gradient_strategy=svi.gradient_strategy, mesh=svi.mesh, **svi.static_kwargs)
    state = sgd.init(d3p.random.PRNGKey(0), xs)
    new, _ = jax.jit(sgd.update)(state, xs)
    before, after = (jax.tree.leaves(sgd.optim.get_params(s.optim_state)) for s in (state, new))
    return [np.asarray(b, np.float64) - np.asarray(a, np.float64) for b, a in zip(before, after)]


def make_configs(args, xs):
    model, guide = make_vae()
    configs = []
    for D in [None] + list(args.devices):
        mesh = None if D is None else jax.make_mesh((D,), ("batch",), devices=jax.devices()[:D])
        svi = DPSVI(model, guide, numpyro.optim.Adam(1e-3), Trace_ELBO(), 1.0, 1.0, N=N,
                    gradient_strategy=args.strategy, mesh=mesh)
        configs.append(Config("no mesh" if D is None else f"{D} device{'s' * (D > 1)}", svi, xs))
        print(f"compiled {configs[-1].label}: {configs[-1].compile_s:.1f} s "
              f"({svi.strategy_choice.strategy})", flush=True)
    return configs


def rel_diff(a, b):
    return max(float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-30)) for x, y in zip(a, b))


def table(args, configs):
    base = configs[0]
    ratios = [[b / c for b, c in zip(base.rounds, cfg.rounds)] for cfg in configs]
    rows = []
    for cfg, r in zip(configs, ratios):
        rows.append(dict(
            config=cfg.label, B=args.batch_size, strategy=cfg.svi.strategy_choice.strategy,
            ms_median=1e3 * statistics.median(cfg.rounds), speedup=statistics.median(r),
            cpu_ms_per_step=1e3 * statistics.median(cfg.cpu), compile_s=cfg.compile_s,
            rel_diff=rel_diff(cfg.gradient, base.gradient),
        ))
    return rows


def main(args):
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices, "
          f"{os.cpu_count()} CPU cores, B = {args.batch_size}, strategy {args.strategy}", flush=True)
    configs = make_configs(args, vae_batch(args.batch_size))
    for r in range(args.rounds):
        for cfg in configs:
            cfg.run(args.steps)
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    rows = table(args, configs)
    print("\n| devices | B | strategy | ms/step | speed-up vs no mesh | CPU ms/step | compile [s] | gradient rel. diff |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['config']} | {row['B']} | {row['strategy']} | {row['ms_median']:.0f} | "
              f"{row['speedup']:.2f} | {row['cpu_ms_per_step']:.0f} | {row['compile_s']:.1f} | "
              f"{row['rel_diff']:.1e} |")
    os.makedirs(args.output_dir, exist_ok=True)
    path = os.path.join(args.output_dir, "sharding.json")
    with open(path, "w") as f:
        json.dump(dict(rows=rows, jax=jax.__version__, platform=platform.platform(),
                       cpu_count=os.cpu_count(), argv=sys.argv[1:]), f, indent=1)
    print(f"Wrote {path}")


if __name__ == "__main__":
    main(ARGS)
