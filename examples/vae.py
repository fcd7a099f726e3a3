"""Variational autoencoder with DP-VI: the d3p paper's section 5.1.

The paper's MNIST model is a feed-forward VAE with one hidden layer in the
encoder and in the decoder: 784-400-(2x50) encoder (mean and log-scale of a
50-dimensional Gaussian latent), 50-400-784 decoder with Bernoulli pixels,
688 884 parameters in all; batch size 128, Adam, and σ = 1.5 for the DP runs
(ε ≈ 0.5 at δ = 1/60000 after 20 epochs in the paper).

No data set is downloaded here. This script does two things:

1. **Training on scikit-learn's bundled digits** (1 797 images of 8x8 = 64
   pixels, binarised at half intensity; 1 497 for training, 300 held out).
   The network is the paper's scaled down in proportion to the input
   (784 -> 64 pixels: 400 -> 32 hidden units, 50 -> 4 latent dimensions;
   64-32-(2x4) encoder and 4-32-64 decoder, 4 616 parameters). It is trained
   with DP-VI (σ = 1.5, Adam) on Poisson-sampled batches (d3p's default:
   every record in a step with probability q = B/N, expected batch size
   B = 128, padded to a fixed shape with a mask, normalised by the public
   q·N; ε under the add/remove relation) and non-privately (NumPyro's SVI
   on random batches of exactly B records), and the held-out loss (negative
   ELBO per image) and time per epoch are recorded. ``--sampling fixed``
   trains DP-VI on batches of exactly B distinct records instead (ε under
   the substitute relation, with the pair that dominates fixed-size
   sampling; see :func:`d3p.accounting.accounting_for`).
2. **Timing on MNIST-shaped generated data** (random binary 784-pixel images,
   N = 60 000): the paper's exact network, time per step of DP-VI on
   Poisson-sampled batches (expected size 128, padded), of DP-VI on
   fixed-size batches of 128 and of non-private SVI on batches of 128 (one
   step of each in turn, so that load from other processes hits all alike;
   wall-clock and CPU time), and the time per epoch (468 steps) they imply.

The networks (``make_vae`` of the paper's models) are plain ``jax.numpy``
functions whose weights are ``numpyro.param`` sites: no neural-network library
is needed.

Outputs (in ``--output-dir``): ``vae_digits_loss.png`` (held-out loss per
epoch, private and non-private), ``vae_digits_samples.png`` (test digits,
their reconstructions and samples from both models), ``vae_results.csv``.

Usage::

    python examples/vae.py               # full
    python examples/vae.py --quick       # CI
    python examples/vae.py --gradient-strategy scan   # time another per-record gradient strategy
    python examples/vae.py --sampling fixed           # train DP-VI on fixed-size batches
"""

import os
import sys
import time
from typing import Callable, Dict, Optional, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import numpyro  # noqa: E402
from jax import lax  # noqa: E402
from numpyro.infer import SVI, Trace_ELBO  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import _common as common  # noqa: E402
import d3p.gradients  # noqa: E402
import d3p.random  # noqa: E402
from d3p._paper_models import make_vae, vae_decode, vae_encode  # noqa: E402
from d3p.accounting import accounting_for  # noqa: E402
from d3p.minibatch import poisson_batchify_data, subsample_batchify_data  # noqa: E402
from d3p.svi import DPSVI  # noqa: E402


def num_params(params: Dict) -> int:
    return int(sum(np.size(v) for v in params.values()))


# ---------------------------------------------------------------------- data


def load_binary_digits(num_test: int = 300, seed: int = 0):
    """scikit-learn's digits, binarised at half intensity, split train/test."""
    x = (load_digits().data / 16.0 > 0.5).astype(np.float32)
    perm = np.random.default_rng(seed).permutation(len(x))
    return x[perm[num_test:]], x[perm[:num_test]]


def mnist_shaped(n: int, seed: int = 0) -> np.ndarray:
    """Random binary 28x28 images (about 13% ink, like MNIST) for timing."""
    rng = np.random.default_rng(seed)
    return (rng.uniform(size=(n, 784)) < 0.13).astype(np.float32)


# ------------------------------------------------------------------ training


def batches(data, batch_size: int, poisson: bool):
    """``(init, get_batch, update_args)`` for random batches of ``data``.

    ``poisson``: d3p's Poisson sampler (every record with probability
    q = B/N, padded to a fixed shape with a mask; add/remove relation), and
    ``update_args(batch)`` gives the keywords of ``DPSVI.update``: the mask and
    the public expected batch size q·N by which the noisy sum is normalised
    (never the realised count). Otherwise batches of exactly B distinct records
    (d3p's fixed-size sampler; substitute relation), ``update_args`` empty.
    Both samplers draw each batch independently from the whole data set.
    """
    if poisson:
        init_batch, get_batch = poisson_batchify_data(data, q=batch_size / len(data))
        expected = get_batch.sampler.expected_batch_size

        def update_args(batch):
            xs, mask = batch
            return (xs,), dict(mask=mask, expected_batch_size=expected)
    else:
        init_batch, get_batch = subsample_batchify_data(data, batch_size=batch_size)

        def update_args(batch):
            return (batch,), {}
    return init_batch, get_batch, update_args


def train(svi, train_x, test_x, batch_size, num_epochs, seed, poisson: bool):
    """Train for ``num_epochs`` epochs of ``N // B`` steps, each on a fresh
    random batch (see :func:`batches`; ``poisson`` only for DPSVI). Returns
    params, per-epoch held-out loss and seconds."""
    init_batch, get_batch, update_args = batches(train_x, batch_size, poisson)
    steps, batch_state = init_batch(d3p.random.PRNGKey(seed))
    epoch_key = batch_state.rng_key
    first, _ = update_args(get_batch(0, batch_state))
    if isinstance(svi, DPSVI):
        state = svi.init(d3p.random.PRNGKey(seed + 1), *first)
    else:
        state = svi.init(jax.random.PRNGKey(seed + 1), *first)
    test_x = jnp.asarray(test_x)

    @jax.jit
    def epoch(state, batch_state):
        def step(s, i):
            args, kwargs = update_args(get_batch(i, batch_state))
            return svi.update(s, *args, **kwargs)

        return lax.scan(step, state, jnp.arange(steps, dtype=jnp.uint32))

    @jax.jit
    def test_loss(state):
        # non-private NumPyro SVI and DPSVI both have evaluate(); the loss of the
        # held-out set is per image (the plate scales the batch to N records)
        return svi.evaluate(state, test_x) / svi.static_kwargs["N"]

    losses, seconds = [], []
    for e in range(num_epochs):
        start = time.perf_counter()
        batch_state = batch_state._replace(rng_key=d3p.random.fold_in(epoch_key, e))
        state, _ = epoch(state, batch_state)
        jax.block_until_ready(state)
        seconds.append(time.perf_counter() - start)
        losses.append(float(test_loss(state)))
    return svi.get_params(state), losses, seconds, steps


def make_stepper(svi, data, batch_size, poisson: bool) -> Callable[[int], None]:
    """A compiled ``svi.update`` on random batches of ``data`` (see
    :func:`batches`): ``step(i)`` runs step ``i`` and waits for its result
    (the first call, compilation, is made here)."""
    init_batch, get_batch, update_args = batches(data, batch_size, poisson)
    _, batch_state = init_batch(d3p.random.PRNGKey(0))
    key = d3p.random.PRNGKey(1) if isinstance(svi, DPSVI) else jax.random.PRNGKey(1)
    first, _ = update_args(get_batch(0, batch_state))
    state = [svi.init(key, *first)]

    def update_fn(s, i):
        args, kwargs = update_args(get_batch(i, batch_state))
        return svi.update(s, *args, **kwargs)

    update = jax.jit(update_fn)

    def step(i: int) -> None:
        state[0], loss = update(state[0], jnp.uint32(i))
        jax.block_until_ready(loss)

    step(0)  # compile
    return step


def time_interleaved(steppers: Dict[str, Callable[[int], None]], num_steps: int) -> Dict[str, Dict[str, float]]:
    """Median wall-clock and CPU seconds per step of each stepper, taking one
    step of each in turn so that load from other processes hits them alike;
    also the median of the per-turn ratios of wall-clock times to the first."""
    wall = {name: [] for name in steppers}
    cpu = {name: [] for name in steppers}
    for i in range(1, num_steps + 1):
        for name, step in steppers.items():
            w0, c0 = time.perf_counter(), time.process_time()
            step(i)
            wall[name].append(time.perf_counter() - w0)
            cpu[name].append(time.process_time() - c0)
    first = next(iter(steppers))
    return {name: dict(wall=float(np.median(wall[name])), cpu=float(np.median(cpu[name])),
                       ratio=float(np.median(np.asarray(wall[name]) / np.asarray(wall[first]))))
            for name in steppers}


def parse_args(argv: Optional[Sequence[str]] = None):
    parser = common.parser(__doc__)
    parser.add_argument("--epochs", type=int, default=None, help="digits epochs (default 100)")
    parser.add_argument("--batch-size", type=int, default=128,
                        help="B (default 128, the paper's): expected batch size (Poisson) "
                             "or batch size (fixed)")
    parser.add_argument("--sampling", choices=("poisson", "fixed"), default="poisson",
                        help="DP-VI training batches on the digits: " + common.SAMPLING_HELP)
    parser.add_argument("--sigma", type=float, default=1.5, help="noise multiplier σ (default 1.5, the paper's)")
    parser.add_argument("--clipping-threshold", type=float, default=5.0, help="C (default 5)")
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="Adam step size (default 1e-3)")
    parser.add_argument("--timing-steps", type=int, default=None,
                        help="timed steps on MNIST-shaped data (default 50)")
    parser.add_argument("--timing-batch-size", type=int, default=None,
                        help="B for the MNIST-shaped timing (default 128; --quick: 16)")
    parser.add_argument("--gradient-strategy", choices=list(d3p.gradients.STRATEGIES), default=None,
                        help="DPSVI's per-record gradient strategy (default: DPSVI's default; "
                             "'chunked' holds fewer per-record gradients in memory at once)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="tiny CI run: 2 digits epochs, 2 timed steps at B=16")
    parser.add_argument("--output-dir", default=common.OUTPUT_DIR, help=common.OUTPUT_HELP)
    return common.fill_defaults(parser.parse_args(argv),
                                quick=dict(epochs=2, timing_steps=2, timing_batch_size=16),
                                full=dict(epochs=100, timing_steps=50, timing_batch_size=128))


def strategy_kwargs(args) -> Dict:
    """DPSVI's ``gradient_strategy`` keyword, where ``--gradient-strategy`` sets one."""
    return {} if args.gradient_strategy is None else dict(gradient_strategy=args.gradient_strategy)


def train_on_digits(args, train_x, test_x, hidden: int, latent: int) -> Dict:
    """DP-VI (``--sampling``) and non-private training on the digits; prints and returns the results."""
    N, B = len(train_x), args.batch_size
    model, guide = make_vae(64, hidden, latent)
    print("VAE on scikit-learn digits (8x8, binarised): "
          f"64-{hidden}-(2x{latent}) encoder, {latent}-{hidden}-64 decoder")
    print(f"  N={N} training / {len(test_x)} test images, B={B} ({'expected ' if args.sampling == 'poisson' else ''}"
          f"batch size of DP-VI), {args.epochs} epochs, Adam({args.learning_rate})")
    dpsvi = DPSVI(model, guide, numpyro.optim.Adam(args.learning_rate), Trace_ELBO(),
                  clipping_threshold=args.clipping_threshold, dp_scale=args.sigma, N=N, **strategy_kwargs(args))
    q, delta, poisson = B / N, 1.0 / N, args.sampling == "poisson"
    # the accounting of the sampler the training used (one mapping: accounting_for)
    acc = accounting_for(common.sampler_name(args.sampling))
    dp_params, dp_losses, dp_secs, steps = train(dpsvi, train_x, test_x, B, args.epochs, args.seed, poisson)
    total_steps = steps * args.epochs
    eps = dpsvi.get_epsilon(delta, q, num_iter=total_steps, sampler=acc.sampler, relation=acc.relation)
    print(f"  DP-VI (σ={args.sigma}, C={args.clipping_threshold}): {num_params(dp_params)} parameters, "
          f"{total_steps} steps; ε={eps:.3g} at δ=1/N={delta:.2g} ({acc.describe()}, q={q:.3f})")
    nsvi = SVI(model, guide, numpyro.optim.Adam(args.learning_rate), Trace_ELBO(), N=N)
    np_params, np_losses, np_secs, _ = train(nsvi, train_x, test_x, B, args.epochs, args.seed, False)
    later = slice(1, None) if args.epochs > 1 else slice(None)  # epoch 1 includes compilation
    print(f"  held-out loss (neg. ELBO per image) after {args.epochs} epochs: "
          f"DP-VI {dp_losses[-1]:.2f}, non-private {np_losses[-1]:.2f}")
    print(f"  seconds per epoch ({steps} steps): DP-VI {np.mean(dp_secs[later]):.3f}, "
          f"non-private {np.mean(np_secs[later]):.3f}")
    return dict(eps=eps, dp_params=dp_params, dp_losses=dp_losses, dp_secs=dp_secs,
                np_params=np_params, np_losses=np_losses, np_secs=np_secs)


def time_paper_network(args) -> Dict:
    """Per-step timing of the paper's network on MNIST-shaped data; prints and returns the seconds per epoch."""
    data = mnist_shaped(60_000)
    big_model, big_guide = make_vae(784, 400, 50)
    Bt = args.timing_batch_size
    print(f"Timing on MNIST-shaped generated data (N=60000): the paper's 784-400-(2x50) / 50-400-784 "
          f"VAE, B={Bt}, {args.timing_steps} timed steps (gradient strategy: "
          f"{args.gradient_strategy or 'DPSVI default'}) ...", flush=True)
    big_dp = DPSVI(big_model, big_guide, numpyro.optim.Adam(1e-3), Trace_ELBO(),
                   clipping_threshold=args.clipping_threshold, dp_scale=args.sigma, N=60_000, **strategy_kwargs(args))
    big_np = SVI(big_model, big_guide, numpyro.optim.Adam(1e-3), Trace_ELBO(), N=60_000)
    steppers = {"non-private": make_stepper(big_np, data, Bt, False),
                "DP-VI": make_stepper(big_dp, data, Bt, True)}
    choice = big_dp.strategy_choice
    steppers["DP-VI fixed-size"] = make_stepper(big_dp, data, Bt, False)
    padded = poisson_batchify_data(data, q=Bt / len(data))[1].sampler.max_batch_size
    timed = time_interleaved(steppers, args.timing_steps)
    big_params = num_params(big_np.get_params(big_np.init(jax.random.PRNGKey(0), jnp.asarray(data[:Bt]))))
    if choice is not None:
        print(f"  DPSVI's per-record gradients: {choice.strategy} ({choice.reason})")
    print(f"  DP-VI: Poisson-sampled batches, expected size {Bt}, padded to {padded} with a mask; "
          f"DP-VI fixed-size: batches of exactly {Bt}; non-private: batches of exactly {Bt}")
    print_timing(timed, big_params, 60_000 // Bt)
    print_paper_epsilon(big_dp)
    return {name: t["wall"] * (60_000 // Bt) for name, t in timed.items()}


def print_timing(timed: Dict, num_parameters: int, steps_per_epoch: int) -> None:
    dp, nonpriv, fixed = timed["DP-VI"], timed["non-private"], timed["DP-VI fixed-size"]
    print(f"  {num_parameters} parameters; per step: DP-VI {1e3 * dp['wall']:.1f} ms, "
          f"non-private {1e3 * nonpriv['wall']:.1f} ms (wall-clock medians; median ratio per turn "
          f"{dp['ratio']:.1f}); CPU time per step: "
          f"DP-VI {1e3 * dp['cpu']:.1f} ms, non-private {1e3 * nonpriv['cpu']:.1f} ms")
    print(f"  DP-VI fixed-size: {1e3 * fixed['wall']:.1f} ms per step (wall-clock median; median ratio per turn "
          f"{fixed['ratio']:.1f}), CPU time {1e3 * fixed['cpu']:.1f} ms")
    print(f"  per epoch ({steps_per_epoch} steps, from the wall-clock medians): "
          f"DP-VI {dp['wall'] * steps_per_epoch:.1f} s, DP-VI fixed-size {fixed['wall'] * steps_per_epoch:.1f} s, "
          f"non-private {nonpriv['wall'] * steps_per_epoch:.1f} s")


def print_paper_epsilon(big_dp) -> None:
    """The ε of the paper's DP setting under both accountings."""
    paper_T = 20 * (60_000 // 128)
    paper_eps_ar = big_dp.get_epsilon(1 / 60_000, 128 / 60_000, num_iter=paper_T, sampler="poisson")
    paper_eps = big_dp.get_epsilon(1 / 60_000, 128 / 60_000, num_iter=paper_T, sampler="fixed_size")
    print(f"  the paper's DP setting (σ=1.5, q=128/60000, {paper_T} steps = 20 epochs, δ=1/60000): "
          f"ε={paper_eps_ar:.3g} for Poisson sampling (add/remove relation), ε={paper_eps:.3g} for "
          "fixed-size batches (substitute relation); the paper reports ε ≈ 0.5")


def write_results(args, digits: Dict, epoch_seconds: Dict) -> str:
    """The digits losses per epoch and the MNIST-shaped seconds per epoch as ``vae_results.csv``."""
    rows = []
    # the digits rows' DP-VI used --sampling (default Poisson)
    for name, key in (("DP-VI", "dp"), ("non-private", "np")):
        for e, (l, s) in enumerate(zip(digits[f"{key}_losses"], digits[f"{key}_secs"])):
            rows.append(["digits", name, e + 1, f"{l:.4f}", f"{s:.4f}"])
    for name in ("DP-VI", "DP-VI fixed-size", "non-private"):
        rows.append(["mnist-shaped", name, "", "", f"{epoch_seconds[name]:.4f}"])
    header = ["data", "method", "epoch", "heldout_loss", "seconds"]
    return common.write_csv(os.path.join(args.output_dir, "vae_results.csv"), header, rows)


def plot_losses(args, digits: Dict) -> str:
    fig, ax = plt.subplots(figsize=(5, 4))
    epochs = np.arange(1, args.epochs + 1)
    ax.plot(epochs, digits["dp_losses"], label=f"DP-VI (σ={args.sigma}, ε={digits['eps']:.2g})")
    ax.plot(epochs, digits["np_losses"], label="non-private")
    ax.set_xlabel("epoch")
    ax.set_ylabel("held-out loss (neg. ELBO per image)")
    ax.set_title("VAE on digits (8x8)")
    ax.legend()
    return common.save_figure(fig, args.output_dir, "vae_digits_loss.png")


def plot_samples(args, digits: Dict, test_x, latent: int) -> str:
    """Test digits, their reconstructions and samples from both models."""
    k = 8
    z = jax.random.normal(jax.random.PRNGKey(3), (k, latent))
    rows = [("test images", test_x[:k])]
    for name, p in (("DP-VI", digits["dp_params"]), ("non-private", digits["np_params"])):
        rows.append((f"{name}: reconstruction", vae_decode(p, vae_encode(p, test_x[:k], latent))))
        rows.append((f"{name}: samples", vae_decode(p, z)))
    fig, axes = plt.subplots(len(rows), k, figsize=(k * 0.8, len(rows) * 0.95))
    for r, (name, imgs) in enumerate(rows):
        for c in range(k):
            axes[r, c].imshow(np.asarray(imgs[c]).reshape(8, 8), cmap="gray_r", vmin=0, vmax=1)
            axes[r, c].axis("off")
        axes[r, 0].set_title(name, fontsize=7, loc="left")
    return common.save_figure(fig, args.output_dir, "vae_digits_samples.png")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    train_x, test_x = load_binary_digits()
    hidden, latent = 32, 4  # the paper's 400 and 50, scaled by 64/784
    digits = train_on_digits(args, train_x, test_x, hidden, latent)
    epoch_seconds = time_paper_network(args)
    csv_path = write_results(args, digits, epoch_seconds)
    loss_path = plot_losses(args, digits)
    img_path = plot_samples(args, digits, test_x, latent)
    common.print_written(loss_path, img_path, csv_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
