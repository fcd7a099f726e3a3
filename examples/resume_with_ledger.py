"""Resume an interrupted DP-VI run from a checkpoint and keep one privacy ledger.

A data holder fits a logistic regression on private records within a total
budget ε = 2 at δ = 1e-6 (``d3p.ledger.PrivacyLedger``). The fit asks for
ε = 1 (``DPSVI.run(..., epsilon=1, delta=...)`` calibrates σ for the
sampler, relation and number of steps of the run) and is interrupted half
way: its state, step and ledger are saved (``d3p.svi.save_checkpoint``), and
the run continues from the file (``run(init_state=load_checkpoint(...))``).
The resumed parameters equal those of a run without the interruption, bit
for bit, and the ledger holds both parts with the ε of the whole run. A
second analysis then spends part of what is left; a third, asking for the
whole budget again, would pass it and is refused before its first step.

Outputs:

* ``resume_ledger.png``: the ledger's ε after each release against the
  budget, and the accuracy of the resumed and the uninterrupted fit;
* ``resume_ledger.json``: the ledger, as saved with the checkpoint.

Usage::

    python examples/resume_with_ledger.py            # full
    python examples/resume_with_ledger.py --quick    # CI
    python examples/resume_with_ledger.py --output-dir /tmp/ledger
"""

import os
import sys
import tempfile

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import numpyro  # noqa: E402
import numpyro.distributions as dist  # noqa: E402
from numpyro.infer import Trace_ELBO  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as common  # noqa: E402

import d3p.random  # noqa: E402
from d3p.ledger import BudgetExceededError, PrivacyLedger  # noqa: E402
from d3p.svi import DPSVI, load_checkpoint, save_checkpoint  # noqa: E402


def model(xs, ys, N):
    d = xs.shape[1]
    w = numpyro.sample("w", dist.Normal(0.0, 4.0).expand([d]).to_event(1))
    with numpyro.plate("batch", N, subsample_size=xs.shape[0]):
        numpyro.sample("ys", dist.Bernoulli(logits=xs @ w), obs=ys)


def guide(xs, ys, N):
    d = xs.shape[1]
    loc = numpyro.param("w_loc", jnp.zeros(d))
    scale = jnp.exp(numpyro.param("w_scale_log", -jnp.ones(d)))
    numpyro.sample("w", dist.Normal(loc, scale).to_event(1))


def make_data(N: int, d: int, seed: int):
    """Generated records (nothing is downloaded): features and labels of a
    logistic model with known weights."""
    rng = np.random.default_rng(seed)
    xs = rng.normal(size=(N, d)).astype(np.float32)
    w = rng.normal(size=d)
    ys = (rng.uniform(size=N) < 1 / (1 + np.exp(-xs @ w))).astype(np.float32)
    return jnp.asarray(xs), jnp.asarray(ys)


def accuracy(params, xs, ys) -> float:
    return float(jnp.mean(((xs @ params["w_loc"]) > 0) == (ys > 0.5)))


def parse_args(argv=None):
    parser = common.parser(__doc__)
    parser.add_argument("--records", type=int, default=None, help="N (default 20000; --quick 2000)")
    parser.add_argument("--steps", type=int, default=None, help="steps of the fit (default 2000; --quick 200)")
    parser.add_argument("--budget", type=float, default=2.0, help="the ledger's total ε (default 2)")
    parser.add_argument("--delta", type=float, default=1e-6, help="δ of the budget (default 1e-6)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default=common.OUTPUT_DIR, help=common.OUTPUT_HELP)
    parser.add_argument("--quick", action="store_true", help="a short run (for CI)")
    args = parser.parse_args(argv)
    return common.fill_defaults(args, quick={"records": 2000, "steps": 200},
                                full={"records": 20000, "steps": 2000})


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    N, T, delta = args.records, args.steps, args.delta
    xs, ys = make_data(N, 5, args.seed)
    q = 100 / N
    key = d3p.random.PRNGKey(args.seed)

    # for the comparison only (a real project would not make it: it is a release
    # too): the run without an interruption, asking for ε = 1 (dp_scale=None)
    asking = DPSVI(model, guide, numpyro.optim.Adam(0.02), Trace_ELBO(), clipping_threshold=1.0, N=N)
    whole = asking.run(key, T, xs, ys, q=q, epsilon=1.0, delta=delta, progress_bar=False)
    print(f"ask for ε=1 at δ={delta:g}: calibrated σ={whole.sigma:.4f} for {T} steps, q={q:g} "
          f"({common.describe_sampling('poisson')})")

    # the interrupted run, with the σ of the whole run (asking each part for ε = 1
    # would calibrate σ for its own steps): half the steps, a checkpoint, the rest from the file
    svi = DPSVI(model, guide, numpyro.optim.Adam(0.02), Trace_ELBO(), clipping_threshold=1.0,
                dp_scale=whole.sigma, N=N)
    ledger = PrivacyLedger(budget_epsilon=args.budget, budget_delta=delta)
    first = svi.run(key, T // 2, xs, ys, q=q, delta=delta, progress_bar=False, ledger=ledger)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "checkpoint.npz")
        save_checkpoint(path, first, ledger=ledger)
        checkpoint = load_checkpoint(path)
    ledger = checkpoint.ledger
    eps_steps = [ledger.epsilon(delta)]
    second = svi.run(key, T - T // 2, xs, ys, q=q, delta=delta, progress_bar=False, init_state=checkpoint)
    eps_steps.append(ledger.epsilon(delta))
    same = all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(whole.state), jax.tree.leaves(second.state)))
    print(f"resumed at step {second.start_step}: parameters {'identical' if same else 'DIFFERENT'} to the "
          f"uninterrupted run, bit for bit")
    print(f"ε of the uninterrupted run {whole.epsilon:.4f}; the ledger's total for the two parts "
          f"{ledger.epsilon(delta):.4f}")

    # a second analysis with what is left, then one that would pass the budget
    other = asking
    extra = other.run(d3p.random.PRNGKey(args.seed + 1), T // 2, xs, ys, q=q, epsilon=0.5, delta=delta,
                      progress_bar=False, ledger=ledger)
    eps_steps.append(ledger.epsilon(delta))
    print(f"second analysis: ε=0.5 asked, σ={extra.sigma:.4f}; ledger total {ledger.epsilon(delta):.4f} "
          f"of the budget {args.budget:g}")
    try:
        other.run(d3p.random.PRNGKey(args.seed + 2), T, xs, ys, q=q, epsilon=args.budget, delta=delta,
                  progress_bar=False, ledger=ledger)
    except BudgetExceededError as err:
        print(f"third analysis refused before its first step: {err}")
    print(ledger.summary())

    ledger_path = os.path.join(args.output_dir, "resume_ledger.json")
    ledger.save(ledger_path)
    figure = plot(eps_steps, args.budget, delta, accuracy(whole.params, xs, ys), accuracy(second.params, xs, ys))
    common.print_written(common.save_figure(figure, args.output_dir, "resume_ledger.png"), ledger_path)


def plot(eps_steps, budget, delta, acc_whole, acc_resumed):
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(9, 3.5), gridspec_kw={"width_ratios": [2, 1]})
    labels = ["fit: first half", "fit: resumed", "second analysis"]
    ax.bar(labels, eps_steps, color=["C0", "C0", "C1"])
    ax.axhline(budget, color="C3", linestyle="--", label=f"budget ε={budget:g}")
    ax.set_ylabel(f"ledger's total ε (δ={delta:g})")
    ax.set_title("ε spent so far, after each release")
    ax.legend()
    bx.bar(["uninterrupted", "resumed"], [acc_whole, acc_resumed], color=["C2", "C0"])
    bx.set_ylim(0, 1)
    bx.set_ylabel("training accuracy")
    bx.set_title("the same parameters")
    return fig


if __name__ == "__main__":
    main()
