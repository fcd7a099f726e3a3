"""DPSVI initialises from public information only: the batch's shapes and
dtypes, ``init_params`` and records the caller declares public (``init_data``).

Each test runs ``init`` or ``run`` on neighbouring data sets with the same keys
and asks for bit-identical initial states, the same path (no exception on one
side only) and guides that hold no private value afterwards."""

import pickle

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer import Trace_ELBO
from numpyro.infer.autoguide import AutoDiagonalNormal, AutoGuideList, AutoNormal

import d3p.random
from d3p import _public_init
from d3p.minibatch import PoissonSampler
from d3p.svi import DPSVI

N = 200


def logistic_model(xs, ys, N):
    w = numpyro.sample("w", dist.Normal(0, 4).expand([xs.shape[1]]).to_event(1))
    with numpyro.plate("batch", N, subsample_size=xs.shape[0]):
        numpyro.sample("ys", dist.Bernoulli(logits=xs @ w), obs=ys)


def poisson_model(xs, ys, N):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([xs.shape[1]]).to_event(1))
    with numpyro.plate("batch", N, subsample_size=xs.shape[0]):
        numpyro.sample("ys", dist.Poisson(jnp.exp(xs @ w)), obs=ys)


def beta_model(xs, N):
    """The placeholders (ones) are on the boundary of the likelihood's support
    (log density -inf): initialising on them works only because the
    likelihood is left out of the search for initial values."""
    concentration = numpyro.sample("c", dist.LogNormal(0.0, 1.0))
    with numpyro.plate("batch", N, subsample_size=xs.shape[0]):
        numpyro.sample("x", dist.Beta(concentration, 2.0), obs=xs)


def mean_guide(xs, ys, N):
    """A guide whose initial value reads the data (issue: ``jnp.mean(xs)``)."""
    loc = numpyro.param("loc", jnp.mean(xs, axis=0))
    numpyro.sample("w", dist.Delta(loc).to_event(1))


def _data(seed=0):
    rng = np.random.default_rng(seed)
    xs = rng.normal(size=(N, 3)).astype(np.float32)
    ys = (rng.random(N) < 0.5).astype(np.float32)
    return xs, ys


ADVERSARIAL = [np.nan, np.inf, -np.inf, 1e30, 1e-45, 300.0]


def _neighbour(xs, value, row=7):
    changed = xs.copy()
    changed[row, 1] = value
    return changed


def _leaves_equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)
        for x, y in zip(la, lb)
    )


def _svi(model=logistic_model, guide=None, lr=0.0):
    guide = AutoDiagonalNormal(model) if guide is None else guide
    return DPSVI(model, guide, numpyro.optim.SGD(lr), Trace_ELBO(), clipping_threshold=1.0, dp_scale=1.0, N=N)


def test_init_reads_only_shapes_and_dtypes():
    xs, ys = _data()
    svi = _svi()
    key = d3p.random.PRNGKey(5)
    state = svi.init(key, xs[:16], ys[:16])
    # any values of the same shapes give the same state
    assert _leaves_equal(state, svi.init(key, np.zeros((16, 3), np.float32), np.zeros(16, np.float32)))
    for value in ADVERSARIAL:
        other = svi.init(key, _neighbour(xs, value)[:16], ys[:16])
        assert _leaves_equal(state, other), value


@pytest.mark.parametrize("sampling", ["poisson", "fixed"])
def test_run_starts_from_the_same_point_on_neighbouring_data(sampling):
    """With learning rate 0 the run's parameters are its initial ones: they must
    not depend on a record (a NaN used to make run raise, an outlier moved the
    start), and the guide must hold the same (public) values afterwards. One
    DPSVI runs on every data set (one compilation); DPSVI.init sets its guide up
    again on public placeholders before each run."""
    xs, ys = _data()
    guide = AutoDiagonalNormal(poisson_model)
    svi = _svi(poisson_model, guide)
    outcomes = []
    for data in (xs, _neighbour(xs, np.nan), _neighbour(xs, 300.0)):
        result = svi.run(d3p.random.PRNGKey(11), 3, data, ys, batch_size=16, sampling=sampling,
                         progress_bar=False)
        outcomes.append((result.params, pickle.dumps(guide)))
    for params, pickled in outcomes[1:]:
        assert _leaves_equal(outcomes[0][0], params)
    # each time, the guide holds what a fresh guide set up by init on zeros (with run's
    # init key, shaped like run's padded batch) holds: the shared guide cannot keep
    # values of the first data set either
    rows = PoissonSampler(N, 16 / N).max_batch_size if sampling == "poisson" else 16
    public = AutoDiagonalNormal(poisson_model)
    init_key = d3p.random.split(d3p.random.PRNGKey(11), 2)[0]
    _svi(poisson_model, public).init(init_key, np.zeros((rows, 3), np.float32), np.zeros(rows, np.float32))
    assert all(pickled == pickle.dumps(public) for _, pickled in outcomes)


def test_a_guide_set_up_on_private_data_is_set_up_again():
    """An autoguide that a non-private fit set up on the real records keeps them
    in its prototype trace; DPSVI.init sets it up again on public placeholders."""
    xs, ys = _data()
    fresh, used = AutoNormal(logistic_model), AutoNormal(logistic_model)
    with numpyro.handlers.seed(rng_seed=0):
        used(xs[:16], ys[:16], N=N)   # as numpyro.infer.SVI would on the real batch
    assert np.array_equal(used.prototype_trace["ys"]["value"], ys[:16])
    key = d3p.random.PRNGKey(2)
    states = [_svi(guide=g).init(key, xs[:16], ys[:16]) for g in (fresh, used)]
    assert _leaves_equal(*states)
    assert pickle.dumps(fresh) == pickle.dumps(used)
    assert np.array_equal(used.prototype_trace["ys"]["value"], np.ones(16, np.float32))   # placeholders


def test_autoguide_list_parts_are_set_up_on_placeholders():
    xs, ys = _data()
    guide = AutoGuideList(logistic_model)
    guide.append(AutoNormal(logistic_model))
    state = _svi(guide=guide).init(d3p.random.PRNGKey(0), xs[:8], ys[:8])
    other = _svi(guide=guide).init(d3p.random.PRNGKey(0), _neighbour(xs, np.nan)[:8], ys[:8])
    assert _leaves_equal(state, other)
    assert np.array_equal(guide._guides[0].prototype_trace["ys"]["value"], np.ones(8, np.float32))


@pytest.mark.parametrize("public_data", [False, True])
def test_no_random_subsample_of_the_plate_is_drawn_in_init(monkeypatch, public_data):
    """NumPyro draws a random subsample of a plate's N (compiled anew for
    every N); init never computes one, also inside an autoguide's set-up,
    which runs the model under ``handlers.block``. The plate's key is still drawn: the
    state is the one NumPyro's own subsample gives."""
    xs, ys = _data()
    key = d3p.random.PRNGKey(4)
    kwargs = {"init_data": (xs[:5], ys[:5])} if public_data else {}
    with monkeypatch.context() as m:   # the reference: NumPyro's own subsample
        m.setattr(_public_init.BatchSubsample, "process_message", lambda self, msg: None)
        reference = [_svi(guide=g(logistic_model)).init(key, xs[:16], ys[:16], **kwargs)
                     for g in (AutoDiagonalNormal, AutoNormal)]

    real = numpyro.primitives._subsample_fn

    def refuse(*args, **kwargs):
        # (an abstract trace of the model, which compiles nothing, may draw it)
        if not isinstance(jnp.zeros(()) + 0, jax.core.Tracer):
            raise AssertionError("a random subsample of the plate was drawn")
        return real(*args, **kwargs)

    monkeypatch.setattr(numpyro.primitives, "_subsample_fn", refuse)
    for g, expected in zip((AutoDiagonalNormal, AutoNormal), reference):
        assert _leaves_equal(_svi(guide=g(logistic_model)).init(key, xs[:16], ys[:16], **kwargs), expected)


def test_a_guide_that_reads_the_data_gets_placeholders_or_the_public_init_data():
    xs, ys = _data()
    svi = _svi(guide=mean_guide)
    with pytest.warns(UserWarning, match=r"param site\(s\) \['loc'\] of the guide depends on the values of the data"):
        state = svi.init(d3p.random.PRNGKey(0), xs[:16] + 5.0, ys[:16])
    assert np.array_equal(svi.get_params(state)["loc"], np.ones(3, np.float32))   # the mean of the placeholders
    public = np.full((4, 3), 2.0, np.float32)
    state = svi.init(d3p.random.PRNGKey(0), xs[:16], ys[:16], init_data=(public, np.ones(4, np.float32)))
    np.testing.assert_array_equal(svi.get_params(state)["loc"], np.full(3, 2.0, np.float32))
    result = svi.run(d3p.random.PRNGKey(0), 2, xs, ys, batch_size=16, progress_bar=False,
                     init_data=(public, np.ones(4, np.float32)))
    np.testing.assert_array_equal(result.params["loc"], np.full(3, 2.0, np.float32))   # lr = 0


def test_init_data_is_validated():
    xs, ys = _data()
    svi = _svi()
    key = d3p.random.PRNGKey(0)
    with pytest.raises(ValueError, match=r"init_data's records .* per-record shapes \[\(3,\), \(\)\]"):
        svi.init(key, xs[:4], ys[:4], init_data=(np.zeros((2, 4)), np.zeros(2)))
    with pytest.raises(ValueError, match="init_data to have the structure of the data"):
        svi.init(key, xs[:4], ys[:4], init_data=(np.zeros((2, 3)),))
    with pytest.raises(TypeError, match="Expected init_data to be a tuple"):
        svi.init(key, xs[:4], ys[:4], init_data=np.zeros((2, 3)))
    state = svi.init(key, xs[:4], ys[:4])
    with pytest.raises(ValueError, match="init_data only without init_state"):
        svi.run(key, 1, xs, ys, batch_size=4, init_state=state, init_data=(xs[:2], ys[:2]),
                progress_bar=False)


def test_keyword_data_takes_init_data_as_a_pair():
    xs, ys = _data()

    def model(xs, N, ys=None):
        logistic_model(xs, ys, N)

    svi = _svi(model, AutoDiagonalNormal(model))
    key = d3p.random.PRNGKey(0)
    state = svi.init(key, xs[:4], ys=ys[:4], init_data=((xs[:2],), {"ys": ys[:2]}))
    assert _leaves_equal(state, svi.init(key, xs[:4] * 0, ys=ys[:4] * 0, init_data=((xs[:2],), {"ys": ys[:2]})))
    with pytest.raises(ValueError, match=r"pair \(args, kwargs\)"):
        svi.init(key, xs[:4], ys=ys[:4], init_data=(xs[:2],))


def test_the_likelihood_is_left_out_of_the_search_for_initial_values():
    """The search for initial values looks at the latent sites only, so init
    works whatever the placeholders' likelihood, and on any values."""
    x = np.random.default_rng(0).uniform(0.1, 0.9, size=16).astype(np.float32)
    svi = _svi(beta_model)
    key = d3p.random.PRNGKey(0)
    state = svi.init(key, x)
    assert _leaves_equal(state, svi.init(key, -x))
    assert np.all(np.isfinite(jax.flatten_util.ravel_pytree(svi.get_params(state))[0]))
    # the guide's model is restored afterwards
    assert svi.guide.model is beta_model


def test_a_model_that_cannot_start_on_placeholders_says_to_pass_public_values():
    def model(xs, N):
        # on the placeholders (ones) the prior's location is log(0): no valid initial value
        scale = numpyro.sample("s", dist.LogNormal(jnp.log(jnp.sum(xs) - xs.shape[0]), 1.0))
        with numpyro.plate("batch", N, subsample_size=xs.shape[0]):
            numpyro.sample("x", dist.Normal(0.0, scale), obs=xs)

    x = np.ones(8, np.float32)
    svi = _svi(model)
    with pytest.raises(ValueError, match="init_data"):
        svi.init(d3p.random.PRNGKey(0), x)
    state = svi.init(d3p.random.PRNGKey(0), x, init_data=(np.full(8, 2.0, np.float32),))
    assert np.all(np.isfinite(jax.flatten_util.ravel_pytree(svi.get_params(state))[0]))
