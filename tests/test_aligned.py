"""The ``"aligned"`` formulation: what it clips and noises, and what it computes.

Under ``formulation="aligned"`` each record's clipped gradient is taken with
respect to the step's shared draw of the global latent variables (and the
parameters its terms read directly), and the guide's parameters get their
gradient by the chain rule after the noise (``d3p/_elbo_terms.py``). Without
privacy (σ = 0, C = inf) that is exactly the gradient of ``"shared_sample"``;
with clipping, the released sum over the draw moves by at most C when one
record changes, which shows in the location parameters of a guide whose draw
is ``loc + scale * eps`` (their Jacobian is the identity).
"""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer import Trace_ELBO
from numpyro.infer.autoguide import AutoDiagonalNormal

import d3p.random
from d3p import _elbo_terms, _model_facts
from d3p._paper_models import logistic_regression_guide, logistic_regression_model
from d3p.svi import DPSVI

#: Whole-program runs of about a minute in all: CI's slow step.
pytestmark = pytest.mark.slow

N, B, D = 50, 8, 3
KEY = d3p.random.PRNGKey(3)


def _data(seed=0):
    rng = np.random.default_rng(seed)
    xs = rng.normal(size=(B, D)).astype(np.float32)
    ys = (rng.uniform(size=B) < 0.5).astype(np.float32)
    return jnp.asarray(xs), jnp.asarray(ys)


def _model_with_parameter(xs, ys, N):
    """A global latent ``w``, a model parameter ``b`` read by every record and
    a local latent ``u`` per record (guide: a parameter ``u_loc`` per record slot)."""
    w = numpyro.sample("w", dist.Normal(0.0, 2.0).expand([xs.shape[1]]).to_event(1))
    b = numpyro.param("b", jnp.zeros(()))
    with numpyro.plate("batch", N, subsample_size=xs.shape[0]):
        u = numpyro.sample("u", dist.Normal(0.0, 1.0))
        numpyro.sample("ys", dist.Bernoulli(logits=xs @ w + b + 0.1 * u), obs=ys)


def _guide_with_parameter(xs, ys, N):
    loc = numpyro.param("w_loc", jnp.zeros(xs.shape[1]))
    scale = numpyro.param("w_scale", jnp.ones(xs.shape[1]), constraint=dist.constraints.positive)
    numpyro.sample("w", dist.Normal(loc, scale).to_event(1))
    u_loc = numpyro.param("u_loc", jnp.zeros(()))
    with numpyro.plate("batch", N, subsample_size=xs.shape[0]):
        numpyro.sample("u", dist.Normal(u_loc, 1.0))


CASES = {
    "paper": (logistic_regression_model, logistic_regression_guide),
    "autoguide": (logistic_regression_model, AutoDiagonalNormal(logistic_regression_model)),
    "parameters": (_model_with_parameter, _guide_with_parameter),
}


def _one_step(case, formulation, C, sigma, xs, ys, mask=None):
    model, guide = CASES[case]
    svi = DPSVI(model, guide, numpyro.optim.SGD(1.0), Trace_ELBO(), clipping_threshold=C, dp_scale=sigma,
                formulation=formulation, N=N)
    state = svi.init(KEY, jnp.ones_like(xs), jnp.ones_like(ys))
    old = svi.optim.get_params(state.optim_state)
    step = jax.jit(lambda s, x, y, m: svi.update(s, x, y, mask=m, expected_batch_size=B))
    new_state, _ = step(state, xs, ys, jnp.ones(B, bool) if mask is None else mask)
    new = svi.optim.get_params(new_state.optim_state)
    return svi, jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64), old, new)


@pytest.mark.parametrize("case", sorted(CASES))
def test_aligned_is_shared_sample_without_privacy(case):
    """σ = 0, C = inf: the chain rule through the shared draw gives the
    gradient of ``"shared_sample"`` on the same keys, for every parameter."""
    xs, ys = _data()
    svi, aligned = _one_step(case, "aligned", float("inf"), 0.0, xs, ys)
    assert svi.formulation_choice == "aligned"
    _, shared = _one_step(case, "shared_sample", float("inf"), 0.0, xs, ys)
    assert sorted(aligned) == sorted(shared)
    for name in shared:
        np.testing.assert_allclose(aligned[name], shared[name], rtol=2e-5, atol=2e-5, err_msg=name)
        assert np.any(aligned[name] != 0), name   # every parameter moves: nothing is dropped


def test_own_parameters_are_read_from_the_model_structure():
    """The parameters a record's terms read besides the draw: none for the
    paper's guide, the model's ``b`` and the local guide's ``u_loc`` here."""
    xs, ys = _data()
    for case, expected in (("paper", ()), ("parameters", ("b", "u_loc"))):
        model, guide = CASES[case]
        svi = DPSVI(model, guide, numpyro.optim.SGD(1.0), Trace_ELBO(), clipping_threshold=1.0, dp_scale=0.0,
                    formulation="aligned", N=N)
        state = svi.init(KEY, xs, ys)
        params = svi.optim.get_params(state.optim_state)
        leaves, treedef = [xs, ys], jax.tree.structure(((xs, ys), {}))
        formulation, facts = _model_facts.split_facts(svi, params, treedef, leaves)
        plates = _model_facts.records_plates(svi, params, treedef, leaves)
        one_record = tuple(_model_facts.one_record(leaves))
        _, theta, _ = _elbo_terms.aligned_terms(svi, facts, plates, treedef, None, None, jax.random.PRNGKey(0),
                                                params, one_record)
        assert formulation == "aligned" and facts.global_latents == ("w",)
        assert tuple(sorted(theta[1])) == expected


@pytest.mark.parametrize("kind", ["outlier", "nan", "1e30"])
def test_aligned_release_moves_by_at_most_C(kind):
    """One record replaced by an adversarial one (every record clipping):
    the location's step, which equals the released sum over the draw times
    N / B (SGD(1), σ = 0), moves by at most 2 C N / B (substitute); the
    outlier moves it by at least C N / B (nearly its whole clipped
    gradient), so the measure sees a change of the release's size."""
    C = 0.5
    xs, ys = _data()
    xs = xs * 50.0   # every record's gradient is far above C: all clip
    xs2 = xs.at[2].set({"outlier": -xs[2] * 10.0, "nan": jnp.full(D, jnp.nan),
                        "1e30": jnp.full(D, 1e30)}[kind])
    ys2 = ys   # the same label with the features reversed: the clipped gradient turns round
    _, step1 = _one_step("paper", "aligned", C, 0.0, xs, ys)
    _, step2 = _one_step("paper", "aligned", C, 0.0, xs2, ys2)
    diff = np.linalg.norm(step1["w_loc"] - step2["w_loc"])
    bound = 2 * C * N / B
    assert diff <= bound * (1 + 1e-5)
    if kind == "outlier":
        assert diff > 0.45 * bound


def test_aligned_leaves_latents_without_a_guide_site_to_the_model():
    """The hierarchical model's group weights ``ws`` have no guide site: the
    model draws them from their prior (from the shared key, as under
    ``"shared_sample"``), and the step is still ``"shared_sample"``'s."""
    from d3p._paper_models import hierarchical_logistic_regression_guide, hierarchical_logistic_regression_model

    rng = np.random.default_rng(0)
    xs = jnp.asarray(rng.normal(size=(B, 3)), jnp.float32)
    ys = jnp.asarray(rng.integers(0, 2, B), jnp.float32)
    ls = jnp.asarray(rng.integers(0, 2, B))
    gs = jnp.asarray(rng.normal(size=(2, 2)), jnp.float32)
    params = {}
    for formulation in ("aligned", "shared_sample"):
        svi = DPSVI(hierarchical_logistic_regression_model, hierarchical_logistic_regression_guide,
                    numpyro.optim.SGD(1.0), Trace_ELBO(), clipping_threshold=float("inf"), dp_scale=0.0,
                    formulation=formulation, N=N, gs=gs)
        state = svi.init(KEY, xs, ys, ls)
        params[formulation] = svi.get_params(svi.update(state, xs, ys, ls)[0])
    for name in params["shared_sample"]:
        np.testing.assert_allclose(params["aligned"][name], params["shared_sample"][name], rtol=2e-5, atol=2e-5)
