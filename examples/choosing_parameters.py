"""Choosing the privacy parameters of a DP-VI run: a walkthrough.

A notebook-free tour, printed as it computes, of the decisions to make before
fitting a new model with :class:`d3p.svi.DPSVI`:

1. ε, the privacy budget (a policy decision, not a tuning knob);
2. δ, well below 1/N;
3. the clipping threshold C, from public knowledge or pilot data, never from
   the private records;
4. the batch size B (equivalently q = B/N) and the number of steps T;
5. the noise multiplier σ from (ε, δ, q, T) for the sampler and relation of
   the run, and how to check it. d3p's default is Poisson sampling (every
   record in a step with probability q; B = qN is the expected batch size)
   under the add/remove relation: :func:`d3p.dputil.approximate_sigma_remove_relation`.
   The walkthrough also prints what the two other accountings need:
   Poisson sampling under the substitute relation
   (``calibrate_sigma(..., sampler="poisson", relation="substitute")``) and
   fixed-size batches without replacement under the substitute relation
   (:func:`d3p.dputil.approximate_sigma`, ``DPSVI.run(sampling="fixed")``).

The running example is the logistic regression of the d3p paper (listing 2)
on a hypothetical private data set of N = 20 000 records with d = 10 features
scaled to [-1, 1]. Every table is computed here; the figure
``choosing_parameters.png`` shows the noise level in the averaged gradient
against B and T at a fixed (ε, δ).

Usage::

    python examples/choosing_parameters.py            # about a minute
    python examples/choosing_parameters.py --quick    # smaller tables
    python examples/choosing_parameters.py --output-dir /tmp/params
"""

import math
import os
import sys
import textwrap
from typing import Dict, Optional, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from numpyro.infer import Trace_ELBO  # noqa: E402

import _common as common  # noqa: E402
from d3p._paper_models import logistic_regression_guide as guide  # noqa: E402
from d3p._paper_models import logistic_regression_model as model  # noqa: E402
from d3p.accounting import accounting_for, compute_epsilon  # noqa: E402
from d3p.dputil import approximate_sigma, approximate_sigma_remove_relation, calibrate_sigma  # noqa: E402

N = 20_000  # records in the (hypothetical) private data set
D = 10  # features, each scaled to [-1, 1] using PUBLIC bounds (e.g. a questionnaire's ranges)


def say(text: str = "") -> None:
    """Print a paragraph of the narrative, wrapped."""
    for para in textwrap.dedent(text).strip("\n").split("\n\n"):
        print(textwrap.fill(" ".join(para.split()), width=88))
        print()


def table(header: Sequence[str], rows: Sequence[Sequence], fmt: str = "{:>12}") -> None:
    print("  " + "".join(fmt.format(h) for h in header))
    for row in rows:
        cells = [f"{x:.4g}" if isinstance(x, float) else str(x) for x in row]
        print("  " + "".join(fmt.format(c) for c in cells))
    print()


def per_record_gradient_norms(params, xs, ys, rng_key, num_records):
    """Norms of the per-record gradients that DPSVI clips: the ELBO loss of a
    batch of one record with the plate scale ``N`` undone (so the record's
    likelihood enters with weight 1 and the prior/entropy terms with 1/N)."""
    elbo = Trace_ELBO()

    def loss(p, x, y, key):
        return elbo.loss(key, p, model, guide, x[None], y[None], N=num_records) / num_records

    keys = jax.random.split(rng_key, xs.shape[0])
    grads = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0, 0))(params, xs, ys, keys)
    return jnp.sqrt(sum(jnp.sum(g.reshape(g.shape[0], -1) ** 2, axis=1) for g in jax.tree.leaves(grads)))


def introduce():
    """The setting of the walkthrough."""
    print("=" * 88)
    print("Choosing ε, δ, C, B (or q), T and σ for a DP-VI run with d3p")
    print("=" * 88)
    print()
    say(f"""
    The setting: a logistic regression (the d3p paper's listing 2) is to be fitted to a
    private data set of N = {N} records with d = {D} features. Each record belongs to one
    person. DP-VI releases the variational parameters; their distribution must change
    little when one person's record changes.
    """)


def choose_epsilon():
    """Step 1: ε, a policy decision."""
    print("-- Step 1: ε " + "-" * 75)
    say("""
    ε bounds how much any one record can change the probability of any outcome: by a
    factor of at most e^ε (up to δ). One concrete reading: an adversary who knows every
    other record and thinks, before seeing the result, that a person's record is one of
    two candidates with probability 50% each, can afterwards be at most e^ε / (1 + e^ε)
    sure. ε is a policy decision (what risk is acceptable for these people), so make it
    before looking at utility; common practice is ε ≤ 1, and values up to about 8 are
    used where the utility otherwise is too low.
    """)
    eps_list = [0.1, 0.5, 1.0, 2.0, 4.0, 8.0]
    table(["ε", "e^ε", "max belief"],
          [[e, math.exp(e), f"{100 * math.exp(e) / (1 + math.exp(e)):.2f}%"] for e in eps_list])
    epsilon = 1.0
    say(f"We choose ε = {epsilon:g}.")
    return epsilon


def choose_delta(quick: bool):
    """Step 2: δ, well below 1/N."""
    print("-- Step 2: δ " + "-" * 75)
    say(f"""
    δ is the probability mass on which the e^ε bound may fail. A mechanism that publishes
    one random record in full satisfies (0, 1/N)-DP, so δ must be well below 1/N =
    {1 / N:.0e}; δ = 1/N² or 1e-6..1e-8 are typical. Smaller δ costs little: below is the
    ε that the same run (σ = 3, q = 0.005, T = 20 000, Poisson sampling, add/remove
    relation: d3p's default) spends at several δ.
    """)
    deltas = [1.0 / N, 0.1 / N, 1e-6, 1.0 / N**2, 1e-10]
    rows = []
    for d_ in deltas if not quick else deltas[:3]:
        rows.append([f"{d_:.1e}", compute_epsilon(3.0, 0.005, 20_000, d_, sampler="poisson",
                                                  relation="add_remove")])
    table(["δ", "ε"], rows)
    delta = 1e-6
    say(f"We choose δ = {delta:g} (= 1/(50 N)).")
    return delta


def pilot_gradient_norms():
    """Per-record gradient norms on synthetic pilot records, at the initial
    parameters and near a fit; prints their quantiles."""
    rng = np.random.default_rng(0)
    n_pilot = 2000
    xs = rng.uniform(-1, 1, size=(n_pilot, D)).astype(np.float32)
    w_true = rng.normal(0, 1.5, size=D)
    ys = (rng.uniform(size=n_pilot) < 1 / (1 + np.exp(-xs @ w_true))).astype(np.float32)
    init = {"w_loc": jnp.zeros(D), "w_scale_log": jnp.zeros(D)}
    fitted = {"w_loc": jnp.asarray(w_true, jnp.float32), "w_scale_log": jnp.full(D, -3.0)}
    key = jax.random.PRNGKey(0)
    norms_init = np.asarray(per_record_gradient_norms(init, jnp.asarray(xs), jnp.asarray(ys), key, N))
    norms_fit = np.asarray(per_record_gradient_norms(fitted, jnp.asarray(xs), jnp.asarray(ys), key, N))
    qs = [0.5, 0.9, 0.99]
    table(["parameters"] + [f"{int(100 * q)}% quantile" for q in qs] + ["max"],
          [["initial"] + [float(np.quantile(norms_init, q)) for q in qs] + [float(norms_init.max())],
           ["near fit"] + [float(np.quantile(norms_fit, q)) for q in qs] + [float(norms_fit.max())]],
          fmt="{:>15}")
    return norms_init, norms_fit


def choose_clipping_threshold():
    """Step 3: C, from public bounds and pilot data."""
    print("-- Step 3: the clipping threshold C " + "-" * 52)
    say("""
    Every record's gradient is clipped to norm C and the noise is proportional to C.
    Too small a C biases the gradient (many records clipped, their directions mixed),
    too large a C buries it in noise. Looking at the gradient norms of the PRIVATE
    records to pick C is itself a leak (their quantiles are statistics of the data
    that no accountant covers), so use what is public:

    (a) bounds from the model: for this model the gradient of a record's loss with
    respect to w_loc is (sigmoid(x·w) − y)·x, of norm at most |x| ≤ sqrt(d) = 3.16 for
    features in [-1, 1]; the part for w_scale_log is of the same order (times the
    guide's standard normal draw). So C ≈ 3 already clips rarely, and smaller C trade
    bias for less noise.

    (b) pilot data: public data of the same kind, or synthetic data from the prior
    predictive or from a plausible generative process, never the private records. Below,
    the norms at the initial parameters and at parameters close to a fit (w_loc = w_true)
    on 2 000 synthetic pilot records.
    """)
    norms_init, norms_fit = pilot_gradient_norms()
    Cs = [0.5, 1.0, 2.0, 4.0]
    B_ref, sigma_ref = 200, 1.0
    say(f"""
    The trade-off for a few C (with, e.g., B = {B_ref} and σ = {sigma_ref:g}): the share of pilot
    records that would be clipped, and the standard deviation of the noise in the
    AVERAGED gradient, σ·C/B per coordinate:
    """)
    table(["C", "clipped@init", "clipped@fit", "noise σC/B"],
          [[c, f"{100 * np.mean(norms_init > c):.0f}%", f"{100 * np.mean(norms_fit > c):.0f}%",
            sigma_ref * c / B_ref] for c in Cs], fmt="{:>14}")
    C = 2.0
    say(f"""
    Early in training most gradients are large (the fit is poor); near the optimum most
    are small, so a C that clips early records is fine. We choose C = {C:g}.
    """)
    return C


def noise_grid(epsilon: float, delta: float, C: float, Bs, Ts) -> Dict:
    """σ for every (B, T) at (ε, δ); prints them with the noise σC/B in the averaged gradient."""
    grid = {}
    rows = []
    for B in Bs:
        for T in Ts:
            q = B / N
            sigma, eps, _ = approximate_sigma_remove_relation(epsilon, delta, q, T)
            grid[(B, T)] = sigma
            rows.append([B, f"{q:.4f}", T, f"{q * T:.3g}", sigma, sigma * C / B])
    table(["B", "q", "T", "epochs", "σ", "σC/B"], rows)
    return grid


def plot_noise(output_dir: str, grid: Dict, Bs, Ts, epsilon: float, delta: float, C: float) -> str:
    """The noise σC/B in the averaged gradient against B, one line per T."""
    fig, ax = plt.subplots(figsize=(5, 4))
    for T in Ts:
        ax.plot(Bs, [grid[(B, T)] * C / B for B in Bs], marker="o", label=f"T={T}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("batch size B")
    ax.set_ylabel("noise std in the averaged gradient, σC/B")
    ax.set_title(f"ε={epsilon:g}, δ={delta:g}, N={N}, C={C:g} (Poisson, add/remove)", fontsize=9)
    ax.legend(fontsize=8)
    return common.save_figure(fig, output_dir, "choosing_parameters.png")


def choose_batch_and_steps(args, epsilon: float, delta: float, C: float):
    """Step 4: B (or q) and T; writes the figure. Returns ``(B, T, path of the PNG)``."""
    print("-- Step 4: batch size B (q = B/N) and number of steps T " + "-" * 32)
    say(f"""
    With (ε, δ) fixed, the accountant turns every (q, T) into a σ. What matters for
    learning is the noise in the averaged gradient, σ·C/B per step, against the number
    of steps. For small q, σ grows roughly like q·sqrt(T), so σ/B is roughly independent
    of B for a fixed number of steps: larger batches cost compute, not privacy, and make
    each step less noisy. More steps need more noise per step, but more steps also
    average the noise out; the table shows σ and σC/B for ε = {epsilon:g}, δ = {delta:g}
    (Poisson sampling with expected batch size B, add/remove relation: d3p's default)
    and the number of epochs q·T. (Fixed-size batches need twice these σ, see step 5.)
    """)
    if args.quick:
        Bs, Ts = [50, 500], [1000, 10_000]
    else:
        Bs, Ts = [20, 100, 500, 2000], [1000, 5000, 20_000, 100_000]
    grid = noise_grid(epsilon, delta, C, Bs, Ts)
    png = plot_noise(args.output_dir, grid, Bs, Ts, epsilon, delta, C)
    B, T = (500, 10_000) if args.quick else (100, 20_000)
    q = B / N
    say(f"""
    A reasonable choice here: an expected batch size B = {B} (q = {q:g}) and T = {T}
    ({q * T:g} epochs); the loss curves of a non-private pilot run on synthetic data tell
    how many steps the model needs (DP-VI usually needs more than non-private VI).
    """)
    return B, T, png


def calibrate_and_check(epsilon: float, delta: float, q: float, T: int):
    """Step 5, first part: σ for d3p's default accounting, checked with two accountants."""
    print("-- Step 5: σ, and checking it " + "-" * 58)
    sigma, eps, evals = approximate_sigma_remove_relation(epsilon, delta, q, T)
    eps_check = compute_epsilon(sigma, q, T, delta, sampler="poisson", relation="add_remove")
    eps_pld = compute_epsilon(sigma, q, T, delta, sampler="poisson", relation="add_remove", accountant="pld")
    say(f"""
    The sampler and the neighbouring relation of the run decide which accounting applies.
    d3p's default is Poisson sampling (DPSVI.run's sampling="poisson", or
    d3p.minibatch.poisson_batchify_data with its mask and expected_batch_size = qN):
    every record enters a step independently with probability q, and the guarantee is
    stated under the add/remove relation (neighbouring data sets differ by the presence
    of one record). Its calibration:
    approximate_sigma_remove_relation(ε={epsilon:g}, δ={delta:g}, q={q:g}, T={T}) returns
    σ = {sigma:.4f} (achieving ε = {eps:.4f}, {evals} accountant evaluations). Check it
    independently: compute_epsilon(σ, q, T, δ) = {eps_check:.4f} (Fourier accountant;
    Poisson sampling under add/remove is its default), and {eps_pld:.4f} with
    dp-accounting's PLD accountant.
    """)
    return sigma, eps


def accounting_options(epsilon: float, delta: float, q: float, T: int, C: float, B: int, sigma: float,
                       eps: float) -> Dict:
    """σ under each of the three supported accountings; prints them as a table."""
    # the three supported accountings; accounting_for maps each to the pair it composes
    options = [("poisson", "add_remove", "approximate_sigma_remove_relation", "run(...) (default)"),
               ("poisson", "substitute", 'calibrate_sigma(sampler="poisson", relation="substitute")',
                'run(..., relation="substitute")'),
               ("fixed_size", "substitute", "approximate_sigma", 'run(..., sampling="fixed")')]
    found = {}
    rows = []
    for sampler, relation, function, run in options:
        if (sampler, relation) == ("poisson", "add_remove"):
            s_, e_ = sigma, eps
        elif sampler == "fixed_size":
            s_, e_, _ = approximate_sigma(epsilon, delta, q, T)
        else:
            s_, e_, _ = calibrate_sigma(epsilon, delta, q, T, sampler=sampler, relation=relation)
        found[(sampler, relation)] = s_
        rows.append([accounting_for(sampler, relation).describe().replace(" without replacement", ""),
                     s_, e_, s_ * C / B])
        rows[-1].insert(1, function)
    print(f"  What each accounting needs for ε = {epsilon:g}, δ = {delta:g}, q = {q:g}, T = {T}:")
    print()
    print(f"  {'sampler, relation':<42}{'calibrated with':<58} {'σ':>8} {'ε':>8} {'σC/B':>8}")
    for how, function, s_, e_, noise in rows:
        print(f"  {how:<42}{function:<58} {s_:8.4f} {e_:8.4f} {noise:8.4f}")
    print()
    return found


def compare_relations(epsilon: float, delta: float, q: float, T: int, sigma: float, found: Dict) -> None:
    """The substitute relation's two pairs, and why the midpoint pair is optimistic for fixed-size batches."""
    sigma_ps = found[("poisson", "substitute")]
    sigma_fx = found[("fixed_size", "substitute")]
    eps_fx_at_ps = compute_epsilon(sigma_ps, q, T, delta, sampler="fixed_size", relation="substitute")
    # where σ is small the gap is wide (the example of docs/privacy_accounting.md)
    small = dict(sigma=0.822, q=0.01, num_steps=1000, delta=1e-5)
    eps_mid_small = compute_epsilon(**small, sampler="poisson", relation="substitute")
    eps_fx_small = compute_epsilon(**small, sampler="fixed_size", relation="substitute")
    say(f"""
    Poisson sampling under the substitute relation (neighbouring data sets of the same
    size, differing in one record's value) composes the midpoint pair
    (1-q)N(0,σ²)+qN(1,σ²) against (1-q)N(0,σ²)+qN(-1,σ²) and needs σ = {sigma_ps:.4f};
    pass relation="substitute" to DPSVI.run for it. Fixed-size batches of exactly B
    records without replacement (sampling="fixed", or
    d3p.minibatch.subsample_batchify_data) are accounted under the substitute relation
    with the add/remove pair at noise multiplier σ/2, because a substituted record's
    slot is refilled by another record when it is not sampled: they need σ =
    {sigma_fx:.4f}, {sigma_fx / sigma:.2f} times the default's. The midpoint pair is
    optimistic for fixed-size batches (the d3p paper accounted them with it): with
    σ = {sigma_ps:.4f} they actually spend ε = {eps_fx_at_ps:.4f}, not {epsilon:g}. Here the
    gap is small because σ is large; at σ = 0.822, q = 0.01, T = 1000 and δ = 1e-5 the
    midpoint pair gives ε = {eps_mid_small:.3g} where fixed-size batches spend
    ε = {eps_fx_small:.3g}. The ε of the two relations are not comparable
    one to one either: substituting one record is like removing one and adding another,
    so the same σ gives roughly twice the ε under "substitute".
    """)


def put_together(delta: float, C: float, B: int, T: int, q: float, sigma: float, eps: float) -> None:
    """The DPSVI call the choices add up to."""
    print("Putting it together (d3p's default: Poisson sampling, add/remove relation):")
    print()
    print("    svi = DPSVI(model, guide, numpyro.optim.Adam(1e-3), Trace_ELBO(),")
    print(f"                clipping_threshold={C:g}, dp_scale={sigma:.4f}, N={N})")
    print(f"    result = svi.run(d3p.random.PRNGKey(), {T}, xs, ys, batch_size={B},")
    print(f"                     target_delta={delta:g})   # q = batch_size / N = {q:g}")
    print()
    say(f"""
    and result.epsilon reports the ε actually spent ({eps:.4f}), with result.sampler
    ("poisson") and result.relation ("add_remove") saying how it was accounted. Each
    further run on the same data (a second try with other hyperparameters included)
    spends budget again: compose them with d3p.accounting.compose_epsilon, or tune on
    public or synthetic data.
    """)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller tables (CI)")
    parser.add_argument("--output-dir", default=common.OUTPUT_DIR, help="where the PNG goes (default: examples/output/)")
    args = parser.parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    introduce()
    epsilon = choose_epsilon()
    delta = choose_delta(args.quick)
    C = choose_clipping_threshold()
    B, T, png = choose_batch_and_steps(args, epsilon, delta, C)
    q = B / N
    sigma, eps = calibrate_and_check(epsilon, delta, q, T)
    found = accounting_options(epsilon, delta, q, T, C, B, sigma, eps)
    compare_relations(epsilon, delta, q, T, sigma, found)
    put_together(delta, C, B, T, q, sigma, eps)
    common.print_written(png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
