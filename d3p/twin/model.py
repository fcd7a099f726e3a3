"""The default twin model: a mixture of K product distributions over the columns.

Each record is drawn from one of K components; within a component the
columns are independent, each with a distribution chosen by its
:class:`~d3p.twin.schema.ColumnSpec`:

==============  ===================================================================
distribution    per component (all parameters have priors, see below)
==============  ===================================================================
categorical     Categorical over the levels, plus a "missing" level if nullable
bernoulli       Bernoulli
normal          Normal on the code in [-1, 1] (the value scaled by its bounds),
                truncated to [-1, 1]
lognormal       the same on the code of the log-transformed value (see the schema)
poisson         Poisson on ``value - lower``
==============  ===================================================================

Missing values of non-categorical nullable columns are modelled by a
Bernoulli missingness indicator per column and component; a missing value
contributes only that indicator to the likelihood. The component of a record
is marginalised out (``logsumexp`` over components), so the model has no
discrete latent variables and works with any continuous guide: the default is
:class:`MixtureGuide`, a hand-written mean-field Gaussian guide on the
unconstrained parameters (the same family as
:class:`numpyro.infer.autoguide.AutoDiagonalNormal`, but with no set-up
pass over the model, so that initialisation can be compiled).

Priors: mixture weights ``Dirichlet(1)``; categorical probabilities
``Dirichlet(1)``; Bernoulli and missingness probabilities ``Beta(1, 1)``;
normal locations ``Normal(0, 1)`` and scales ``LogNormal(-1, 1)`` (on the
[-1, 1] code scale); Poisson rates ``s * exp(r)`` with ``r ~ Normal(0, 1)``
and ``s = max((upper - lower) / 4, 0.5)``.

Model contract (shared with user-supplied models, see :func:`d3p.twin.fit`):
``model(x=None, *, N, num_records=None)``, where ``x`` is a ``float32``
matrix ``(B, D)`` of codes from :meth:`d3p.twin.Schema.encode` (``NaN`` for a
missing value), observed at a site named ``"x"`` under
``numpyro.plate("data", N, subsample_size=B)``; with ``x=None`` the model
samples ``num_records`` records at site ``"x"`` instead.
"""

from __future__ import annotations

import math
from typing import Dict, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import scipy.special
from numpyro.distributions import constraints

from d3p import _validate
from d3p.twin.schema import Schema, check_type

__all__ = ["MixtureModel", "MixtureGuide", "MixtureOfProducts", "default_num_components",
           "default_discrete_gain", "DEFAULT_CONTINUOUS_GAIN", "DISCRETE_GAIN_RANGE"]

_TINY = 1e-30
_EPS = 1e-7


class _Layout(NamedTuple):
    """Static (hashable) description of which code columns go where."""

    num_columns: int
    categorical: Tuple[Tuple[int, int, bool], ...]  # (column, levels, nullable)
    bernoulli: Tuple[int, ...]
    normal: Tuple[int, ...]
    poisson: Tuple[int, ...]
    poisson_range: Tuple[float, ...]
    missing: Tuple[int, ...]  # nullable non-categorical columns
    hurdle: Tuple[int, ...] = ()  # positions in ``normal`` with a point mass at the code -1
    negbin: Tuple[int, ...] = ()
    negbin_range: Tuple[float, ...] = ()


def _layout(schema: Schema) -> _Layout:
    cat, bern, normal, pois, prange, miss, hurdle, nb, nbrange = [], [], [], [], [], [], [], [], []
    for j, c in enumerate(schema.columns):
        if c.kind == "categorical":
            cat.append((j, c.num_levels, bool(c.nullable)))
            continue
        if c.nullable:
            miss.append(j)
        if c.kind == "boolean":
            bern.append(j)
        elif c.distribution == "poisson":
            pois.append(j)
            prange.append(float(c.upper - c.lower))
        elif c.distribution == "negbinomial":
            nb.append(j)
            nbrange.append(float(c.upper - c.lower))
        else:
            if c.distribution == "hurdle" and c.upper > c.lower:
                hurdle.append(len(normal))
            normal.append(j)
    return _Layout(len(schema.columns), tuple(cat), tuple(bern), tuple(normal), tuple(pois),
                   tuple(prange), tuple(miss), tuple(hurdle), tuple(nb), tuple(nbrange))


def default_num_components(num_records: int, num_columns: int = 0) -> int:
    """Default K: ``max(3, min(8, max(N // 1000, D // 4)))`` for N records of D
    columns: under DP every component costs noise, so small data sets get
    few, but components are what carries dependence between columns, so wide
    tables get more (on scikit-learn's 31-column breast-cancer data, 7
    components instead of 3 raised the train-on-synthetic AUC)."""
    return int(max(3, min(8, max(num_records // 1000, num_columns // 4))))


def _log(p):
    return jnp.log(jnp.clip(p, _TINY, None))


def _truncated_normal_log_prob(v, loc, scale):
    """log density of ``Normal(loc, scale)`` truncated to the code range [-1, 1]."""
    a, b = (-1.0 - loc) / scale, (1.0 - loc) / scale
    mass = jax.scipy.special.ndtr(b) - jax.scipy.special.ndtr(a)
    return dist.Normal(loc, scale).log_prob(v) - jnp.log(jnp.clip(mass, _TINY, None))


def _truncated_normal_icdf(u, loc, scale, xp):
    """Inverse CDF of ``Normal(loc, scale)`` truncated to [-1, 1], at ``u`` in (0, 1)
    (``xp``: ``jax.numpy`` or ``numpy``)."""
    if xp is np:
        from scipy.special import ndtr, ndtri
    else:
        from jax.scipy.special import ndtr, ndtri
    lo, hi = ndtr((-1.0 - loc) / scale), ndtr((1.0 - loc) / scale)
    p = xp.clip(lo + u * (hi - lo), 1e-12, 1.0 - 1e-12)
    return xp.clip(loc + scale * ndtri(p), -1.0, 1.0)


def _negbin_log_prob(v, mean, concentration, xp):
    """log pmf of the negative binomial with ``mean`` and ``concentration`` r
    (variance ``mean + mean² / r``) at the counts ``v`` (``xp``: jax.numpy or numpy)."""
    gammaln = jax.scipy.special.gammaln if xp is jnp else scipy.special.gammaln
    m = xp.clip(mean, _EPS, None)
    r = xp.clip(concentration, _EPS, None)
    return (gammaln(v + r) - gammaln(r) - gammaln(v + 1) + r * (xp.log(r) - xp.log(r + m))
            + v * (xp.log(m) - xp.log(r + m)))


def _capped_count(key, logpmf, R, dtype):
    """A count drawn from ``logpmf`` over 0..R (rows), the mass above R put on R."""
    M = logpmf.shape[0]
    head = jax.nn.logsumexp(logpmf[:, :-1], axis=-1) if R > 0 else jnp.full((M,), -jnp.inf)
    tail = jnp.log(jnp.clip(-jnp.expm1(head), _TINY, None))
    logits = logpmf.at[:, -1].set(tail)
    return jax.random.categorical(key, logits, axis=-1).astype(dtype)


class MixtureOfProducts(dist.Distribution):
    """Mixture of K products of per-column distributions over a code vector.

    ``log_prob(x)`` marginalises the component; ``sample`` draws the component,
    then the columns (``NaN`` for missing values). Parameters (``K`` components):
    ``weights (K,)``; ``categorical``: list of ``(K, L_j)`` probabilities
    (``L_j`` includes the missing level of nullable columns); ``bernoulli (K, Db)``;
    ``loc``, ``scale (K, Dn)``; ``rate (K, Dp)``; ``missing (K, Dm)``.

    :param _Layout layout: the static column layout (from the schema).
    :param dict params: the parameters above.
    """

    arg_constraints = {}
    support = constraints.real_vector
    pytree_data_fields = ("params",)
    pytree_aux_fields = ("layout",)

    def __init__(self, layout: _Layout, params: Dict, *, validate_args=None):
        self.layout = layout
        self.params = params
        super().__init__(batch_shape=(), event_shape=(layout.num_columns,), validate_args=validate_args)

    def component_log_probs(self, x: jax.Array) -> jax.Array:
        """``(M, K)`` log densities of records ``x (M, D)`` under each component."""
        L, p = self.layout, self.params
        nan = jnp.isnan(x)
        xs = jnp.where(nan, 0.0, x)
        K = p["weights"].shape[-1]
        lp = jnp.zeros((x.shape[0], K), x.dtype)
        for (j, n, nullable), probs in zip(L.categorical, p["categorical"]):
            idx = xs[:, j]
            if nullable:
                idx = jnp.where(nan[:, j], n, idx)
            idx = jnp.clip(idx, 0, probs.shape[-1] - 1).astype(jnp.int32)
            lp = lp + jnp.take(_log(probs).T, idx, axis=0)

        def add(cols, lp_cols):  # lp_cols (M, K, d): zero where the value is missing
            m = nan[:, None, jnp.asarray(cols)]
            return jnp.sum(jnp.where(m, 0.0, lp_cols), axis=-1)

        if L.bernoulli:
            v = xs[:, None, jnp.asarray(L.bernoulli)]
            q = jnp.clip(p["bernoulli"], _EPS, 1 - _EPS)
            lp = lp + add(L.bernoulli, v * jnp.log(q) + (1 - v) * jnp.log1p(-q))
        if L.normal:
            v = xs[:, None, jnp.asarray(L.normal)]
            lp_normal = _truncated_normal_log_prob(v, p["loc"], p["scale"])
            if L.hurdle:
                h = jnp.asarray(L.hurdle)
                q = jnp.clip(p["hurdle"], _EPS, 1 - _EPS)
                at = v[..., h] <= -1.0
                lp_normal = lp_normal.at[..., h].set(
                    jnp.where(at, jnp.log(q), jnp.log1p(-q) + lp_normal[..., h]))
            lp = lp + add(L.normal, lp_normal)
        if L.poisson:
            v = xs[:, None, jnp.asarray(L.poisson)]
            rate = jnp.clip(p["rate"], _EPS, None)
            lp = lp + add(L.poisson, v * jnp.log(rate) - rate - jax.scipy.special.gammaln(v + 1))
        if L.negbin:
            v = xs[:, None, jnp.asarray(L.negbin)]
            lp = lp + add(L.negbin, _negbin_log_prob(v, p["nb_mean"], p["nb_concentration"], jnp))
        if L.missing:
            m = nan[:, None, jnp.asarray(L.missing)].astype(x.dtype)
            q = jnp.clip(p["missing"], _EPS, 1 - _EPS)
            lp = lp + jnp.sum(m * jnp.log(q) + (1 - m) * jnp.log1p(-q), axis=-1)
        return lp

    def log_prob(self, value):
        value = jnp.asarray(value)
        batch = value.shape[:-1]
        x = value.reshape((-1, self.layout.num_columns))
        lp = self.component_log_probs(x) + _log(self.params["weights"])
        return jax.nn.logsumexp(lp, axis=-1).reshape(batch)

    def sample(self, key, sample_shape=()):
        L, p = self.layout, self.params
        M = int(np.prod(sample_shape)) if sample_shape else 1
        kz, kc, kb, kn, kp, km = jax.random.split(key, 6)
        z = jax.random.categorical(kz, _log(p["weights"]), shape=(M,))
        out = jnp.zeros((M, L.num_columns))
        for (j, n, nullable), probs in zip(L.categorical, p["categorical"]):
            idx = jax.random.categorical(jax.random.fold_in(kc, j), _log(probs)[z], axis=-1)
            val = idx.astype(out.dtype)
            if nullable:
                val = jnp.where(idx == n, jnp.nan, val)
            out = out.at[:, j].set(val)
        if L.bernoulli:
            u = jax.random.uniform(kb, (M, len(L.bernoulli)))
            out = out.at[:, jnp.asarray(L.bernoulli)].set((u < p["bernoulli"][z]).astype(out.dtype))
        if L.normal:
            u = jax.random.uniform(kn, (M, len(L.normal)))
            v = _truncated_normal_icdf(u, p["loc"][z], p["scale"][z], jnp)
            if L.hurdle:
                h = jnp.asarray(L.hurdle)
                at = jax.random.uniform(jax.random.fold_in(kn, 1), (M, len(L.hurdle))) < p["hurdle"][z]
                v = v.at[:, h].set(jnp.where(at, -1.0, v[:, h]))
            out = out.at[:, jnp.asarray(L.normal)].set(v)
        # counts: inverse CDF on 0..range, the mass above the range put on the range (as
        # clipping would): exact and cheaper to compile than jax.random.poisson
        for i, (j, R) in enumerate(zip(L.poisson, L.poisson_range)):
            rate = jnp.clip(p["rate"][:, i], _EPS, None)[z][:, None]  # (M, 1)
            ks = jnp.arange(int(R) + 1, dtype=out.dtype)
            logpmf = ks * jnp.log(rate) - rate - jax.scipy.special.gammaln(ks + 1)
            out = out.at[:, j].set(_capped_count(jax.random.fold_in(kp, j), logpmf, R, out.dtype))
        for i, (j, R) in enumerate(zip(L.negbin, L.negbin_range)):
            ks = jnp.arange(int(R) + 1, dtype=out.dtype)
            logpmf = _negbin_log_prob(ks, p["nb_mean"][:, i][z][:, None], p["nb_concentration"][:, i][z][:, None],
                                      jnp)
            out = out.at[:, j].set(_capped_count(jax.random.fold_in(kp, 7919 + j), logpmf, R, out.dtype))
        if L.missing:
            m = jax.random.uniform(km, (M, len(L.missing))) < p["missing"][z]
            cols = jnp.asarray(L.missing)
            out = out.at[:, cols].set(jnp.where(m, jnp.nan, out[:, cols]))
        return out.reshape(tuple(sample_shape) + (L.num_columns,))


class MixtureModel:
    """The default twin model for a schema (see the module docstring).

    Call signature (the twin model contract):
    ``model(x=None, *, N, num_records=None)``.

    :param Schema schema: a complete schema.
    :param int num_components: K >= 1 (default :func:`default_num_components`
        of ``num_records``: 3 if it is not given).
    :param int num_records: the data set size N, only used for the default K.
    """

    def __init__(self, schema: Schema, num_components: Optional[int] = None, *, num_records: Optional[int] = None):
        check_type("schema", schema, Schema, "a d3p.twin.Schema")
        if not schema.is_complete:
            raise ValueError("Expected a complete schema (see d3p.twin.infer_schema).")
        if num_components is None:
            num_components = default_num_components(num_records or 0, len(schema.columns))
        self.schema = schema
        self.num_components = _validate.integer("num_components", num_components, minimum=1)
        self.layout = _layout(schema)
        self.poisson_scale = np.asarray([max(r / 4.0, 0.5) for r in self.layout.poisson_range], np.float32)
        self.negbin_scale = np.asarray([max(r / 4.0, 0.5) for r in self.layout.negbin_range], np.float32)

    def description(self) -> dict:
        """JSON-serialisable description (enough to rebuild the model with the schema)."""
        return {"type": "mixture", "num_components": self.num_components, "version": 1}

    def sample_params(self) -> Dict:
        """Sample the global parameters (NumPyro sample sites) and return them."""
        K, L = self.num_components, self.layout
        params = {"weights": numpyro.sample("weights", dist.Dirichlet(jnp.ones(K)))}
        params["categorical"] = [
            numpyro.sample(f"probs_{j}", dist.Dirichlet(jnp.ones((K, n + int(nullable)))).to_event(1))
            for j, n, nullable in L.categorical
        ]
        if L.bernoulli:
            params["bernoulli"] = numpyro.sample(
                "bernoulli", dist.Beta(jnp.ones((K, len(L.bernoulli))), 1.0).to_event(2))
        if L.normal:
            shape = (K, len(L.normal))
            params["loc"] = numpyro.sample("loc", dist.Normal(jnp.zeros(shape), 1.0).to_event(2))
            params["scale"] = numpyro.sample("scale", dist.LogNormal(jnp.full(shape, -1.0), 1.0).to_event(2))
        if L.poisson:
            r = numpyro.sample("log_rate", dist.Normal(jnp.zeros((K, len(L.poisson))), 1.0).to_event(2))
            params["rate"] = jnp.asarray(self.poisson_scale) * jnp.exp(r)
        if L.hurdle:
            params["hurdle"] = numpyro.sample("hurdle", dist.Beta(jnp.ones((K, len(L.hurdle))), 1.0).to_event(2))
        if L.negbin:
            shape = (K, len(L.negbin))
            r = numpyro.sample("nb_log_mean", dist.Normal(jnp.zeros(shape), 1.0).to_event(2))
            params["nb_mean"] = jnp.asarray(self.negbin_scale) * jnp.exp(r)
            c = numpyro.sample("nb_log_concentration", dist.Normal(jnp.zeros(shape), 1.5).to_event(2))
            params["nb_concentration"] = jnp.exp(c)
        if L.missing:
            params["missing"] = numpyro.sample(
                "missing", dist.Beta(jnp.ones((K, len(L.missing))), 1.0).to_event(2))
        return params

    def __call__(self, x=None, *, N, num_records=None):
        d = MixtureOfProducts(self.layout, self.sample_params())
        if x is None:
            if num_records is None:
                raise ValueError("Expected num_records when x is None (generation).")
            with numpyro.plate("data", num_records):
                return numpyro.sample("x", d)
        with numpyro.plate("data", N, subsample_size=x.shape[0]):
            return numpyro.sample("x", d, obs=x)


def _site_shapes(model: "MixtureModel"):
    """``[(site, unconstrained shape, support)]`` of the model's global sites."""
    K, L = model.num_components, model.layout
    sites = [("weights", (K - 1,), constraints.simplex)] if K > 1 else []
    sites += [(f"probs_{j}", (K, n + int(nullable) - 1), constraints.simplex)
              for j, n, nullable in L.categorical if n + int(nullable) > 1]
    # per kind of column: its sites, each of shape (K, the number of such columns)
    per_kind = ((L.bernoulli, (("bernoulli", constraints.unit_interval),)),
                (L.normal, (("loc", constraints.real), ("scale", constraints.positive))),
                (L.poisson, (("log_rate", constraints.real),)),
                (L.hurdle, (("hurdle", constraints.unit_interval),)),
                (L.negbin, (("nb_log_mean", constraints.real), ("nb_log_concentration", constraints.real))),
                (L.missing, (("missing", constraints.unit_interval),)))
    for columns, kind_sites in per_kind:
        if columns:
            sites += [(name, (K, len(columns)), support) for name, support in kind_sites]
    return sites


class _Scaled(constraints.Constraint):
    """Real values optimised as ``value / gain``: a fixed, data-independent
    preconditioner (the optimiser sees the gradient times ``gain`` and takes
    steps ``gain`` times its own in the value)."""

    def __init__(self, gain: float):
        self.gain = float(gain)

    def __call__(self, x):
        return constraints.real(x)

    def feasible_like(self, prototype):
        return jnp.zeros_like(prototype)

    def tree_flatten(self):
        return (), ((), {"gain": self.gain})

    def eq(self, other, static=False):
        return type(other) is type(self) and other.gain == self.gain


class _ScaledPositive(_Scaled):
    """Positive values optimised as ``log(value) / gain``."""

    def __call__(self, x):
        return x > 0

    def feasible_like(self, prototype):
        return jnp.ones_like(prototype)


@dist.biject_to.register(_Scaled)
def _scaled_transform(constraint):
    return dist.transforms.AffineTransform(0.0, constraint.gain)


@dist.biject_to.register(_ScaledPositive)
def _scaled_positive_transform(constraint):
    return dist.transforms.ComposeTransform([dist.transforms.AffineTransform(0.0, constraint.gain),
                                             dist.transforms.ExpTransform()])


#: Default gain of the guide parameters of the continuous sites (normal locations and
#: scales, Poisson log-rates), see :class:`MixtureGuide`.
DEFAULT_CONTINUOUS_GAIN = 1.0
#: Bounds of the default gain of the discrete sites, see :func:`default_discrete_gain`.
DISCRETE_GAIN_RANGE = (1.0, 10.0)
_CONTINUOUS_SITES = ("loc", "scale", "log_rate", "nb_log_mean", "nb_log_concentration")


def default_discrete_gain(model: "MixtureModel") -> float:
    """Default gain of the discrete sites (mixture weights, categorical, Bernoulli
    and missingness probabilities) of :class:`MixtureGuide`:
    ``sqrt(D_continuous / D_discrete)`` clipped to [1, 10], with ``D_*`` the numbers
    of guide locations of the continuous and discrete sites (public: from the
    schema and K). Many continuous columns and few discrete parameters (e.g. one
    class label) get a large gain, so that the label's parameters are not drowned
    in the clipping norm; many discrete parameters get 1, because large noisy steps
    drive category probabilities to 0 or 1, where their gradients vanish.
    """
    check_type("model", model, MixtureModel, "a MixtureModel")
    sizes = {True: 0, False: 0}
    for name, shape, _ in _site_shapes(model):
        sizes[name in _CONTINUOUS_SITES] += int(np.prod(shape))
    lo, hi = DISCRETE_GAIN_RANGE
    if sizes[False] == 0:
        return lo
    return float(np.clip(math.sqrt(sizes[True] / sizes[False]), lo, hi))


class MixtureGuide:
    """Mean-field Gaussian guide for :class:`MixtureModel`.

    Every global site gets an independent Normal on its unconstrained value
    (stick-breaking for simplices, logit for probabilities, log for scales),
    with parameters ``{site}_loc`` and ``{site}_scale``.

    Initialisation (data-independent, from the init key): normal locations
    and Poisson log-rates uniformly in (-1, 1), which breaks the symmetry
    between components; normal scales at 0.5 (broad components); the
    discrete sites (weights, category, Bernoulli and missingness
    probabilities) close to uniform (unconstrained values uniformly in
    (-0.1, 0.1)); posterior scales at ``init_scale``.

    Preconditioning: the optimiser works on ``{site}_loc / gain`` and
    ``log({site}_scale) / gain``, with ``continuous_gain`` for the normal and
    Poisson sites and ``discrete_gain`` for the others (default
    :func:`default_discrete_gain`, from the schema and K). The parameters
    (and what is saved) are unchanged; only the optimiser's coordinates are
    scaled. This matters under DP: each record's gradient is clipped as one
    vector, and the log-likelihood gradients of the continuous columns
    (of order ``1 / scale`` each, for every column) would otherwise take
    nearly all of the clipping norm, leaving the discrete parameters (e.g.
    how a class label goes with the components) with a signal far below the
    noise, so that they end where their random start and the noise put them.
    With the default gains (on the breast-cancer example: 1 and 6) the discrete
    sites get a visible share (there, at initialisation, a few percent of the
    squared norm instead of below 0.1%), and DP fits tie the class label to
    the components much more reliably (see ``docs/twin.md``).

    Sites with a single possible value (a categorical with one level, K = 1
    weights) are fixed and have no parameters.

    :param MixtureModel model: the model.
    :param float init_scale: initial posterior scale (default 0.1).
    :param bool learn_scale: learn the posterior scales (default) or keep them
        at ``init_scale``.
    :param float continuous_gain: see above (default
        :data:`DEFAULT_CONTINUOUS_GAIN`).
    :param float discrete_gain: see above (default :func:`default_discrete_gain`).
    """

    def __init__(self, model: "MixtureModel", init_scale: float = 0.1, learn_scale: bool = True, *,
                 continuous_gain: float = DEFAULT_CONTINUOUS_GAIN, discrete_gain: Optional[float] = None):
        check_type("model", model, MixtureModel, "a MixtureModel")
        if discrete_gain is None:
            discrete_gain = default_discrete_gain(model)
        self.model = model
        self.init_scale = _validate.positive("init_scale", init_scale)
        self.learn_scale = bool(learn_scale)
        self.continuous_gain = _validate.positive("continuous_gain", continuous_gain)
        self.discrete_gain = _validate.positive("discrete_gain", discrete_gain)
        self.sites = _site_shapes(model)

    def _init_loc(self, name: str, shape):
        if name == "scale":
            return lambda key: jnp.full(shape, math.log(0.5))
        width = 1.0 if name in _CONTINUOUS_SITES else 0.1
        return lambda key: jax.random.uniform(key, shape, minval=-width, maxval=width)

    def __call__(self, *args, **kwargs):
        K, L = self.model.num_components, self.model.layout
        out = {}
        for name, shape, support in self.sites:
            gain = self.continuous_gain if name in _CONTINUOUS_SITES else self.discrete_gain
            loc = numpyro.param(f"{name}_loc", self._init_loc(name, shape), constraint=_Scaled(gain))
            if self.learn_scale:
                scale = numpyro.param(f"{name}_scale", jnp.full(shape, self.init_scale),
                                      constraint=_ScaledPositive(gain))
            else:
                scale = jnp.full(shape, self.init_scale)
            base = dist.Normal(loc, scale).to_event(len(shape))
            out[name] = numpyro.sample(name, dist.TransformedDistribution(base, dist.biject_to(support)))
        # degenerate sites: a single possible value
        if K == 1:
            out["weights"] = numpyro.sample("weights", dist.Delta(jnp.ones(1), event_dim=1))
        for j, n, nullable in L.categorical:
            if n + int(nullable) == 1:
                out[f"probs_{j}"] = numpyro.sample(f"probs_{j}", dist.Delta(jnp.ones((K, 1)), event_dim=2))
        return out


# ------------------------------------------------------------------ NumPy sampling
#
# Generation is post-processing of the released parameters; for the default
# model and guide it is done in NumPy (no compilation, any number of records).
# The transforms below are those of numpyro's ``biject_to`` for the sites'
# supports (checked against numpyro in the tests).

_F32 = np.finfo(np.float32)


def _np_expit(x: np.ndarray) -> np.ndarray:
    """The logistic function, clipped to the open unit interval as numpyro's
    ``SigmoidTransform`` clips float32 values (to ``[tiny, 1 - eps]``)."""
    return np.clip(scipy.special.expit(x), _F32.tiny, 1.0 - _F32.eps)


def _np_stick_breaking(x: np.ndarray) -> np.ndarray:
    """numpyro's ``StickBreakingTransform``: R^(L-1) -> simplex in R^L (last axis)."""
    d = x.shape[-1]
    z = _np_expit(x - np.log(d - np.arange(d)))
    cum = np.cumprod(1.0 - z, axis=-1)
    pad = [(0, 0)] * (x.ndim - 1)
    z_padded = np.pad(z, pad + [(0, 1)], constant_values=1.0)
    cum_shifted = np.pad(cum, pad + [(1, 0)], constant_values=1.0)
    return z_padded * cum_shifted


def _np_constrain(value: np.ndarray, support) -> np.ndarray:
    if support is constraints.simplex:
        return _np_stick_breaking(value)
    if support is constraints.unit_interval:
        return _np_expit(value)
    if support is constraints.positive:
        return np.exp(value)
    return value


def _np_categorical(rng: np.random.Generator, probs: np.ndarray) -> np.ndarray:
    """Indices drawn from ``probs`` (..., L) by inverse CDF."""
    cum = np.cumsum(probs, axis=-1)
    u = rng.random(probs.shape[:-1])[..., None] * cum[..., -1:]
    return np.minimum((u >= cum).sum(-1), probs.shape[-1] - 1)


def guide_sample_numpy(guide: "MixtureGuide", params: Dict[str, np.ndarray], num_draws: int,
                       rng: np.random.Generator) -> Dict[str, np.ndarray]:
    """``num_draws`` draws of every global site from :class:`MixtureGuide` (NumPy).

    :param MixtureGuide guide: the guide.
    :param dict params: its constrained parameters (``{site}_loc``, ``{site}_scale``).
    :param int num_draws: number of draws.
    :param numpy.random.Generator rng: the generator.
    :return: ``{site: array (num_draws, ...)}`` of constrained values.
    """
    out = {}
    for name, shape, support in guide.sites:
        loc = np.asarray(params[f"{name}_loc"], np.float64)
        scale = (np.asarray(params[f"{name}_scale"], np.float64) if guide.learn_scale
                 else np.full(loc.shape, guide.init_scale))
        u = loc + scale * rng.standard_normal((num_draws,) + tuple(shape))
        out[name] = _np_constrain(u, support)
    K, L = guide.model.num_components, guide.model.layout
    if K == 1:
        out["weights"] = np.ones((num_draws, 1))
    for j, n, nullable in L.categorical:
        if n + int(nullable) == 1:
            out[f"probs_{j}"] = np.ones((num_draws, K, 1))
    return out


def mixture_sample_numpy(model: "MixtureModel", sites: Dict[str, np.ndarray], per_draw: int,
                         rng: np.random.Generator) -> np.ndarray:
    """Codes ``(M, per_draw, D)``: ``per_draw`` records from each of ``M`` parameter draws.

    The same distribution as :meth:`MixtureOfProducts.sample` (NumPy version).
    """
    L = model.layout
    w = sites["weights"]
    M = w.shape[0]
    R = int(per_draw)
    m = np.arange(M)[:, None]
    z = _np_categorical(rng, np.broadcast_to(w[:, None, :], (M, R, w.shape[-1])))  # (M, R)
    out = np.zeros((M, R, L.num_columns))
    for j, n, nullable in L.categorical:
        probs = sites[f"probs_{j}"][m, z]  # (M, R, L_j)
        idx = _np_categorical(rng, probs).astype(float)
        if nullable:
            idx[idx == n] = np.nan
        out[:, :, j] = idx
    if L.bernoulli:
        p = sites["bernoulli"][m, z]
        out[:, :, list(L.bernoulli)] = (rng.random(p.shape) < p).astype(float)
    if L.normal:
        loc, scale = sites["loc"][m, z], sites["scale"][m, z]
        v = _truncated_normal_icdf(rng.random(loc.shape), loc, scale, np)
        if L.hurdle:
            h = list(L.hurdle)
            at = rng.random(v[..., h].shape) < sites["hurdle"][m, z]
            v[..., h] = np.where(at, -1.0, v[..., h])
        out[:, :, list(L.normal)] = v
    if L.poisson:
        rate = np.clip(model.poisson_scale * np.exp(sites["log_rate"]), _EPS, None)[m, z]
        k = rng.poisson(rate).astype(float)
        out[:, :, list(L.poisson)] = np.minimum(k, np.asarray(L.poisson_range))
    if L.negbin:
        mean = np.clip(model.negbin_scale * np.exp(sites["nb_log_mean"]), _EPS, None)[m, z]
        r = np.clip(np.exp(sites["nb_log_concentration"]), _EPS, None)[m, z]
        k = rng.poisson(rng.gamma(r, mean / r)).astype(float)  # the gamma-Poisson mixture
        out[:, :, list(L.negbin)] = np.minimum(k, np.asarray(L.negbin_range))
    if L.missing:
        q = sites["missing"][m, z]
        miss = rng.random(q.shape) < q
        cols = list(L.missing)
        block = out[:, :, cols]
        block[miss] = np.nan
        out[:, :, cols] = block
    return out
