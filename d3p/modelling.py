"""Prior and posterior predictive sampling for NumPyro models.

Thin, explicit helpers around NumPyro's effect handlers: one joint sample of
all sample sites of a model, either from the prior or with the latent sites
drawn from a (fitted) guide. The ``*_multi_*`` variants draw ``n`` independent
samples with ``vmap``.

Privacy: sampling from a model whose parameters were fitted with DPSVI is
post-processing of the private release and spends no further privacy budget,
as long as the model arguments passed here are not private data (e.g. pass
``None`` for observations and only public covariates).

Keys are ``jax.random`` keys (the sampling here needs no secure randomness);
convert a d3p key with :func:`d3p.random.convert_to_jax_rng_key`.
"""

from typing import Callable, Dict, Optional, Sequence

import jax
from numpyro.handlers import block, condition, seed, substitute, trace

__all__ = [
    "sample_prior_predictive",
    "sample_posterior_predictive",
    "sample_multi_prior_predictive",
    "sample_multi_posterior_predictive",
]


def _sample_sites(tr, with_intermediates: bool):
    samples = {name: site["value"] for name, site in tr.items() if site["type"] == "sample"}
    if with_intermediates:
        inter = {name: site["intermediates"] for name, site in tr.items() if site["type"] == "sample"}
        return samples, inter
    return samples


def _check_n(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"Expected n to be an integer >= 1, got n={n!r}.")
    return n


def sample_prior_predictive(
    rng_key: jax.Array,
    model: Callable,
    model_args: Sequence = (),
    substitutes: Optional[Dict] = None,
    with_intermediates: bool = False,
    **model_kwargs,
):
    """One joint sample of all sample sites of ``model`` from its prior.

    :param jax.Array rng_key: a ``jax.random`` key.
    :param model: the NumPyro model.
    :param model_args: positional arguments of the model (observations should
        be ``None`` to be sampled).
    :param dict substitutes: optional fixed values for sites (e.g. parameters).
    :param bool with_intermediates: also return each site's intermediates.
    :return: dict site name -> value (and a dict of intermediates).
    """
    if substitutes is not None:
        model = substitute(model, data=substitutes)
    tr = trace(seed(model, rng_key)).get_trace(*model_args, **model_kwargs)
    return _sample_sites(tr, with_intermediates)


def sample_posterior_predictive(
    rng_key: jax.Array,
    model: Callable,
    model_args: Sequence,
    guide: Callable,
    guide_args: Sequence,
    params: Dict,
    with_intermediates: bool = False,
    **kwargs,
):
    """One joint sample of the model's sites with latents drawn from the guide.

    :param jax.Array rng_key: a ``jax.random`` key.
    :param model: the NumPyro model.
    :param model_args: model arguments (observations ``None``).
    :param guide: the guide fitted with (DP)SVI.
    :param guide_args: guide arguments (may be the same as ``model_args``).
    :param dict params: fitted parameters (``DPSVI.get_params(state)``).
    :param bool with_intermediates: also return each site's intermediates.
    :param kwargs: keyword arguments given to both model and guide.
    :return: dict site name -> value (and a dict of intermediates).
    """
    guide_key, model_key = jax.random.split(rng_key)
    guide_tr = trace(seed(substitute(guide, data=params), guide_key)).get_trace(*guide_args, **kwargs)
    latents = {n: s["value"] for n, s in guide_tr.items() if s["type"] == "sample"}
    conditioned = condition(substitute(model, data=params), data=latents)
    tr = trace(seed(block(conditioned, hide_fn=lambda s: False), model_key)).get_trace(*model_args, **kwargs)
    return _sample_sites(tr, with_intermediates)


def sample_multi_prior_predictive(
    rng_key: jax.Array,
    n: int,
    model: Callable,
    model_args: Sequence = (),
    substitutes: Optional[Dict] = None,
    with_intermediates: bool = False,
    **model_kwargs,
):
    """``n`` independent samples of :func:`sample_prior_predictive`, stacked on axis 0."""
    n = _check_n(n)
    keys = jax.random.split(rng_key, n)
    return jax.vmap(
        lambda k: sample_prior_predictive(k, model, model_args, substitutes, with_intermediates, **model_kwargs)
    )(keys)


def sample_multi_posterior_predictive(
    rng_key: jax.Array,
    n: int,
    model: Callable,
    model_args: Sequence,
    guide: Callable,
    guide_args: Sequence,
    params: Dict,
    with_intermediates: bool = False,
    **kwargs,
):
    """``n`` independent samples of :func:`sample_posterior_predictive`, stacked on axis 0.

    >>> import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
    >>> def model(N):
    ...     mu = numpyro.sample("mu", dist.Normal(0, 1))
    ...     with numpyro.plate("data", N):
    ...         numpyro.sample("x", dist.Normal(mu, 1))
    >>> def guide(N):
    ...     numpyro.sample("mu", dist.Normal(numpyro.param("loc", 0.0), 0.1))
    >>> s = sample_multi_posterior_predictive(jax.random.PRNGKey(0), 4, model, (3,),
    ...                                       guide, (3,), {"loc": jnp.array(5.0)})
    >>> s["x"].shape, bool(jnp.all(s["mu"] > 4))
    ((4, 3), True)
    """
    n = _check_n(n)
    keys = jax.random.split(rng_key, n)
    return jax.vmap(
        lambda k: sample_posterior_predictive(
            k, model, model_args, guide, guide_args, params, with_intermediates, **kwargs
        )
    )(keys)
