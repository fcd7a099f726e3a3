"""What ``DPSVI.init`` compiles in a fresh process: the model of the README's
"A private fit in a few lines" (logistic regression under a plate of N
records, NumPyro's ``AutoDiagonalNormal``), on generated data; with
``--numpyro``, what NumPyro's own ``SVI.init`` compiles for the same model.

``init`` runs the model and guide eagerly on public placeholders, as
NumPyro's ``SVI.init`` does: every operation is compiled for its shape the
first time a process runs it. Prints the wall time of ``init`` and the XLA
compilation it caused (JAX's ``/jax/core/compile/backend_compile_duration``
events): seconds and number of programs.

Usage::

    python benchmarks/init_compile.py [--records N] [--batch-size B] [--numpyro]
"""

import argparse
import time

import jax

times = []


def _listener(event, duration, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
        times.append(duration)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=569, help="N, the plate's size (default 569)")
    parser.add_argument("--batch-size", type=int, default=32, help="B, the batch's rows (default 32)")
    parser.add_argument("--numpyro", action="store_true", help="NumPyro's SVI.init instead of DPSVI.init")
    args = parser.parse_args()
    jax.monitoring.register_event_duration_secs_listener(_listener)
    import numpy as np
    import numpyro
    import numpyro.distributions as dist
    from numpyro.infer import SVI, Trace_ELBO
    from numpyro.infer.autoguide import AutoDiagonalNormal

    import d3p.random
    from d3p.svi import DPSVI

    def model(xs, ys, N):
        w = numpyro.sample("w", dist.Normal(0, 4).expand([xs.shape[1]]).to_event(1))
        with numpyro.plate("batch", N, subsample_size=xs.shape[0]):
            numpyro.sample("ys", dist.Bernoulli(logits=xs @ w), obs=ys)

    rng = np.random.default_rng(0)
    xs = rng.normal(size=(args.batch_size, 30)).astype(np.float32)
    ys = (rng.random(args.batch_size) < 0.5).astype(np.float32)
    optimizer = numpyro.optim.Adam(1e-2)
    if args.numpyro:
        svi = SVI(model, AutoDiagonalNormal(model), optimizer, Trace_ELBO(), N=args.records)
        key = jax.random.key(0)
    else:
        svi = DPSVI(model, AutoDiagonalNormal(model), optimizer, Trace_ELBO(), clipping_threshold=1.0,
                    dp_scale=1.0, N=args.records)
        key = d3p.random.PRNGKey(0)
    before = len(times)
    t = time.perf_counter()
    jax.block_until_ready(svi.init(key, xs, ys))
    wall = time.perf_counter() - t
    compiled = times[before:]
    print(f"{'SVI' if args.numpyro else 'DPSVI'}.init: {wall:.2f} s, of which compiling {sum(compiled):.2f} s in {len(compiled)} programs "
          f"(N = {args.records}, B = {args.batch_size})")


if __name__ == "__main__":
    main()
