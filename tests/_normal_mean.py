"""The model most DPSVI.run tests fit: the mean of unit-variance normal records."""

import numpyro
import numpyro.distributions as dist
from numpyro.infer import Trace_ELBO
from numpyro.infer.autoguide import AutoDiagonalNormal

from d3p.svi import DPSVI


def model(xs, N):
    mu = numpyro.sample("mu", dist.Normal(0, 10))
    with numpyro.plate("data", N, subsample_size=xs.shape[0]):
        numpyro.sample("x", dist.Normal(mu, 1), obs=xs)


def normal_mean_svi(**kwargs):
    """DPSVI of :func:`model` with an AutoDiagonalNormal guide, Adam(0.05) and
    Trace_ELBO; ``kwargs`` (``clipping_threshold``, ``dp_scale``, ``N``, ...) go to DPSVI."""
    return DPSVI(model, AutoDiagonalNormal(model), numpyro.optim.Adam(0.05), Trace_ELBO(), **kwargs)
