"""DP-VI over several processes with jax.distributed: a multi-host run on one machine.

Starts ``--num-processes`` Python processes (2 by default) that talk over
localhost, as the hosts of a cluster would over the network; each has
``--devices-per-process`` CPU devices (2 by default). Every process calls
``jax.distributed.initialize``, builds one mesh over all devices of all
processes and runs the same program: the d3p paper's logistic regression
fitted with ``DPSVI(..., mesh=mesh).run``. Every batch is drawn whole, from
the same key, in every process; each device takes its shard of the batch
by position, clips its records' gradients, one all-reduce adds the partial
sums and the noise is drawn once for the sum, so every process ends with the
same parameters. Process 0 prints σ, the ε spent, the held-out accuracy and
a fingerprint of the parameters (which every process prints too), and
writes a PNG of the loss per step and the parameters (``.npz``).

Sampling and accounting (d3p's default): Poisson sampling with expected
batch size B (q = B/N), ε under the add/remove relation, σ from
:func:`d3p.dputil.calibrate_sigma` for that sampler; ``--sampling fixed`` for
fixed-size batches (substitute relation).

Run:  python examples/multi_host.py [--num-processes 2] [--devices-per-process 2] [--quick]

On a real cluster, start one process per host with ``--process-id`` and
``--coordinator HOST:PORT`` (process 0's address) instead of the launcher
(see ``docs/multi_device.md``); on GPUs leave out ``--devices-per-process``.

Privacy notes: the data are generated; every process holds all of them and
uses the same seed (``--seed``): keys that differ between processes are
refused. The loss values and the held-out accuracy are not private.
"""

import hashlib
import os
import socket
import subprocess
import sys


def parse_args(argv=None):
    import _common as common

    parser = common.parser(__doc__)
    parser.add_argument("--num-processes", type=int, default=2, help="processes (default 2)")
    parser.add_argument("--devices-per-process", type=int, default=2,
                        help="CPU devices per process (default 2; 0: the platform's own devices)")
    parser.add_argument("--process-id", type=int, default=None,
                        help="run as this process of --num-processes (default: launch them all here)")
    parser.add_argument("--coordinator", default=None, help="HOST:PORT of process 0 (with --process-id)")
    parser.add_argument("--epsilon", type=float, default=1.0, help="target ε (default 1)")
    parser.add_argument("--batch-size", type=int, default=64, help="B: expected batch size (Poisson) or batch size")
    parser.add_argument("--sampling", choices=("poisson", "fixed"), default="poisson", help=common.SAMPLING_HELP)
    parser.add_argument("--steps", type=int, default=None, help="steps (default 1000; 100 with --quick)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and the run, the same in every process")
    parser.add_argument("--quick", action="store_true", help="a short run for CI")
    parser.add_argument("--output-dir", default=common.OUTPUT_DIR, help=common.OUTPUT_HELP)
    args = parser.parse_args(argv)
    args.steps = args.steps or (100 if args.quick else 1000)
    return args


# ------------------------------------------------------------------ launcher


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch(args, argv) -> int:
    """Start every process of the run on this machine and wait for them."""
    coordinator = f"localhost:{free_port()}"
    procs = [
        subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv, "--process-id", str(i),
                          "--coordinator", coordinator])
        for i in range(args.num_processes)
    ]
    print(f"Started {args.num_processes} processes, coordinator {coordinator}", flush=True)
    codes = [p.wait(timeout=1800) for p in procs]
    if any(codes):
        print(f"Processes exited with codes {codes}", flush=True)
        return 1
    return 0


# -------------------------------------------------------------------- worker


def initialize(args):
    """``jax.distributed.initialize`` for this process; returns ``jax``."""
    import jax

    if args.devices_per_process > 0:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.devices_per_process)
        # CPU collectives between processes (gloo is jax's default, set here to be explicit)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, num_processes=args.num_processes, process_id=args.process_id)
    return jax


def make_data(seed: int, N: int = 4000, d: int = 10):
    """Logistic-regression data, the same in every process (same seed); 80% for training."""
    import numpy as np

    rng = np.random.default_rng(seed)
    xs = rng.normal(size=(N, d)).astype(np.float32)
    w = rng.normal(size=d)
    ys = (rng.random(N) < 1 / (1 + np.exp(-xs @ w))).astype(np.float32)
    n_train = int(0.8 * N)
    return xs[:n_train], ys[:n_train], xs[n_train:], ys[n_train:]


def fingerprint(params) -> str:
    """A short hash of the parameters' bytes (the same in every process if they agree)."""
    import jax
    import numpy as np

    h = hashlib.sha256()
    for leaf in jax.tree.leaves(params):
        h.update(np.asarray(leaf.addressable_data(0)).tobytes())
    return h.hexdigest()[:16]


def fit(args, jax):
    """The private fit, run by every process alike; returns ``(result, sigma, test data)``."""
    import numpyro
    from numpyro.infer import Trace_ELBO

    import _common as common
    import d3p.random
    from d3p._paper_models import logistic_regression_guide, logistic_regression_model
    from d3p.svi import DPSVI

    xs, ys, x_test, y_test = make_data(args.seed)
    N = len(xs)
    q = args.batch_size / N
    sigma, C = common.noise_and_clip(args.epsilon, 1.0 / N**2, q, args.steps, args.sampling, 1.0)
    # one mesh over the devices of every process; the batch is sharded along all of them
    mesh = jax.make_mesh((jax.device_count(),), ("batch",))
    svi = DPSVI(logistic_regression_model, logistic_regression_guide, numpyro.optim.Adam(1e-2), Trace_ELBO(),
                clipping_threshold=C, dp_scale=sigma, N=N, mesh=mesh)
    result = svi.run(d3p.random.PRNGKey(args.seed), args.steps, xs, ys, batch_size=args.batch_size,
                     sampling=args.sampling, progress_bar=False)
    return result, sigma, (x_test, y_test)


def report(args, jax, result, sigma, test) -> None:
    """Print what the fit gave (every process its fingerprint; process 0 the rest) and plot."""
    import numpy as np

    import _common as common

    params = {k: np.asarray(v.addressable_data(0)) for k, v in result.params.items()}
    # one write of the whole line: the processes share the launcher's stdout, and a
    # print() may write the text and its newline separately, interleaving the lines
    sys.stdout.flush()
    os.write(sys.stdout.fileno(),
             f"[process {args.process_id}] parameter fingerprint {fingerprint(result.params)}\n".encode())
    if args.process_id != 0:
        return
    x_test, y_test = test
    accuracy = float(np.mean((x_test @ params["w_loc"] > 0) == (y_test > 0.5)))
    print(f"{jax.process_count()} processes, {jax.device_count()} devices ({jax.devices()[0].platform}); "
          f"calibrated σ={sigma:.4f} for ε={args.epsilon:g}; ε spent={result.epsilon:.3f} at δ={result.delta:.2g} "
          f"({common.describe_sampling(args.sampling)}); held-out accuracy {accuracy:.3f}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(args.output_dir, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(np.asarray(result.losses.addressable_data(0)))
    ax.set(xlabel="step", ylabel="loss (not private)",
           title=f"DP-VI over {jax.process_count()} processes, {jax.device_count()} devices")
    params_path = os.path.join(args.output_dir, "multi_host_params.npz")
    np.savez(params_path, **params)
    common.print_written(common.save_figure(fig, args.output_dir, "multi_host_loss.png"), params_path)


def worker(args) -> int:
    jax = initialize(args)
    result, sigma, test = fit(args, jax)
    report(args, jax, result, sigma, test)
    jax.distributed.shutdown()
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.process_id is None:
        return launch(args, argv)
    return worker(args)


if __name__ == "__main__":
    sys.exit(main())
