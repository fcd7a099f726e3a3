"""Compile times on XLA:CPU's default (MLIR fusion) emitters and on its earlier
emitters (``XLA_FLAGS=--xla_cpu_use_fusion_emitters=false``, what the default
test step compiles with: ``tests/conftest.py``).

For each flag and round, a fresh process compiles the jitted ``update`` of
NumPyro's SVI and of DPSVI for the one-parameter model most of the tests fit
(``tests/_normal_mean.py``: the mean of N unit-variance normal records,
``AutoDiagonalNormal``, Adam), one after the other (a small program is
compiled first, so that neither carries the process's one-off costs), then
times DPSVI's first ``run`` of 10 steps (its ``init`` and the compiled chunk
of steps with its sampler). The flags alternate, round by round.

Usage::

    python benchmarks/emitters_compile.py [--rounds 2] [--batch-size 64]
"""

import argparse
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
FLAGS = {"default emitters": "", "earlier emitters": "--xla_cpu_use_fusion_emitters=false"}

CHILD = r"""
import sys, time, warnings
sys.path.insert(0, {tests!r})
import jax, jax.numpy as jnp, numpy as np, numpyro
from numpyro.infer import SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoDiagonalNormal
import d3p.random
from _normal_mean import model, normal_mean_svi

warnings.simplefilter("ignore")
N, B = 1000, {batch_size}
xs = np.random.default_rng(0).normal(1.0, 1.0, N).astype(np.float32)
x = jnp.asarray(xs[:B])
jax.jit(lambda a: jnp.sin(a) @ a.T).lower(jnp.ones((3, 3))).compile()


def compile_seconds(f, *args):
    lowered = jax.jit(f).trace(*args).lower()
    t = time.perf_counter()
    lowered.compile()
    return time.perf_counter() - t


svi = SVI(model, AutoDiagonalNormal(model), numpyro.optim.Adam(0.05), Trace_ELBO(), N=N)
state = svi.init(jax.random.key(0), x)
svi_s = compile_seconds(lambda s, x: svi.update(s, x), state, x)
dp = normal_mean_svi(clipping_threshold=1.0, dp_scale=1.0, N=N)
dp_state = dp.init(d3p.random.PRNGKey(0), x)
mask = jnp.ones(B, bool)
dp_s = compile_seconds(lambda s, x, m: dp.update(s, x, mask=m), dp_state, x, mask)
fresh = normal_mean_svi(clipping_threshold=1.0, dp_scale=1.0, N=N)
t = time.perf_counter()
fresh.run(d3p.random.PRNGKey(1), 10, xs, batch_size=B // 2, progress_bar=False)
run_s = time.perf_counter() - t
print(f"{{svi_s:.2f}} {{dp_s:.2f}} {{run_s:.2f}}")
"""


def measure(flags: str, batch_size: int) -> list:
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip(), JAX_PLATFORMS="cpu")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    code = CHILD.format(tests=str(ROOT / "tests"), batch_size=batch_size)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return [float(v) for v in out.stdout.split()[-3:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    print("| XLA_FLAGS | SVI update compile (s) | DPSVI update compile (s) | DPSVI first run (s) |")
    print("|---|---|---|---|")
    for _ in range(args.rounds):
        for name, flags in FLAGS.items():
            svi_s, dp_s, run_s = measure(flags, args.batch_size)
            print(f"| {name} | {svi_s:.2f} | {dp_s:.2f} | {run_s:.2f} |", flush=True)


if __name__ == "__main__":
    main()
