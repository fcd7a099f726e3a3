"""Prior and posterior predictive sampling for NumPyro models, and model adapters.

Thin, explicit helpers around NumPyro's effect handlers: one joint sample of
all sample sites of a model, either from the prior or with the latent sites
drawn from a (fitted) guide. The ``*_multi_*`` variants draw ``n`` independent
samples with ``vmap``. :func:`make_observed_model` and
:func:`map_args_obs_to_shape` adapt a model's call signature to one that takes
the observations first.

Privacy: sampling from a model whose parameters were fitted with DPSVI is
post-processing of the private release and spends no further privacy budget,
as long as the model arguments passed here are not private data (e.g. pass
``None`` for observations and only public covariates).

Keys are ``jax.random`` keys (the sampling here needs no secure randomness);
convert a d3p key with :func:`d3p.random.convert_to_jax_rng_key`.
"""

from typing import Callable, Dict, Optional, Sequence

import jax
import jax.numpy as jnp
from numpyro.handlers import block, condition, seed, substitute, trace

from d3p import _validate
from d3p.util import example_count, is_array

__all__ = [
    "sample_prior_predictive",
    "sample_posterior_predictive",
    "sample_multi_prior_predictive",
    "sample_multi_posterior_predictive",
    "get_samples_from_trace",
    "make_observed_model",
    "map_args_obs_to_shape",
]


def get_samples_from_trace(trace: Dict, with_intermediates: bool = False) -> Dict:
    """The values of all sample sites (latent and observed) of a NumPyro trace.

    :param dict trace: a trace, as from ``numpyro.handlers.trace(fn).get_trace(...)``.
    :param bool with_intermediates: give each site's value together with its
        intermediates (e.g. the component of a mixture draw).
    :return: dict site name -> value, or, with ``with_intermediates=True``,
        site name -> ``(value, intermediates)`` (``intermediates`` a list).
        Other sites (``param``, ``deterministic``, plates) are left out.

    >>> import jax, numpyro, numpyro.distributions as dist
    >>> from numpyro.handlers import seed, trace
    >>> def model():
    ...     numpyro.param("p", 1.0)
    ...     numpyro.sample("x", dist.Normal(0, 1))
    >>> tr = trace(seed(model, jax.random.PRNGKey(0))).get_trace()
    >>> list(get_samples_from_trace(tr)), get_samples_from_trace(tr, True)["x"][1]
    (['x'], [])
    """
    if not isinstance(trace, dict):
        raise TypeError(f"Expected trace to be a NumPyro trace (a dict of sites), got trace={trace!r}.")
    sites = {name: site for name, site in trace.items() if site.get("type") == "sample"}
    if with_intermediates:
        return {name: (site["value"], site["intermediates"]) for name, site in sites.items()}
    return {name: site["value"] for name, site in sites.items()}


def _check_n(n) -> int:
    return _validate.integer("n", n, minimum=1)


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
    :param bool with_intermediates: give each site's intermediates too.
    :return: dict site name -> value, or site name -> ``(value,
        intermediates)`` with ``with_intermediates=True``.
    """
    if substitutes is not None:
        model = substitute(model, data=substitutes)
    tr = trace(seed(model, rng_key)).get_trace(*model_args, **model_kwargs)
    return get_samples_from_trace(tr, with_intermediates)


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

    The guide is run first (with ``params``); the model then runs with its
    latent sites set to the guide's draws and its other sample sites (e.g. the
    observations, given as ``None``) drawn. The result holds every sample site
    of the model and, in addition, the sample sites that only the guide has
    (e.g. auxiliary variables).

    :param jax.Array rng_key: a ``jax.random`` key.
    :param model: the NumPyro model.
    :param model_args: model arguments (observations ``None``).
    :param guide: the guide fitted with (DP)SVI.
    :param guide_args: guide arguments (may be the same as ``model_args``).
    :param dict params: fitted parameters (``DPSVI.get_params(state)``).
    :param bool with_intermediates: give each site's intermediates too.
    :param kwargs: keyword arguments given to both model and guide.
    :return: dict site name -> value, or site name -> ``(value,
        intermediates)`` with ``with_intermediates=True``.
    """
    guide_key, model_key = jax.random.split(rng_key)
    guide_tr = trace(seed(substitute(guide, data=params), guide_key)).get_trace(*guide_args, **kwargs)
    latents = {n: s["value"] for n, s in guide_tr.items() if s["type"] == "sample"}
    conditioned = condition(substitute(model, data=params), data=latents)
    tr = trace(seed(block(conditioned, hide_fn=lambda s: False), model_key)).get_trace(*model_args, **kwargs)
    samples = get_samples_from_trace(tr, with_intermediates)
    for name, sample in get_samples_from_trace(guide_tr, with_intermediates).items():
        # guide-only sites; with intermediates, the latents' come from the guide that drew them
        if with_intermediates or name not in samples:
            samples[name] = sample
    return samples


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


def make_observed_model(model: Callable, obs_to_model_args_fn: Callable) -> Callable:
    """A model that takes the observations first, built from one that does not.

    ``make_observed_model(model, fn)`` returns ``observed_model(obs, *args,
    **kwargs)``, which computes ``(model_args, model_kwargs) = fn(obs, *args,
    **kwargs)`` and runs ``model(*model_args, **model_kwargs)`` (returning its
    return value). The mapping decides how the observations reach the model
    (e.g. as its ``obs=`` keyword, or as the first positional argument, with
    shared arguments broadcast: :func:`map_args_obs_to_shape`). It must be
    traceable when the observed model is used under ``jit``/``vmap`` (DPSVI
    calls the model on one record at a time).

    :param model: a NumPyro model.
    :param obs_to_model_args_fn: ``(obs, *args, **kwargs) -> (model_args,
        model_kwargs)``, a sequence of positional arguments and a dict of
        keyword arguments.
    :return: the observed model.

    >>> import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
    >>> from numpyro.handlers import seed, trace
    >>> def model(mu_scale, x=None):
    ...     mu = numpyro.sample("mu", dist.Normal(0, mu_scale))
    ...     with numpyro.plate("data", 3):
    ...         numpyro.sample("x", dist.Normal(mu, 1), obs=x)
    >>> observed = make_observed_model(model, lambda obs, mu_scale: ((mu_scale,), {"x": obs}))
    >>> tr = trace(seed(observed, jax.random.PRNGKey(0))).get_trace(jnp.ones(3), 10.0)
    >>> tr["x"]["value"], tr["x"]["is_observed"]
    (Array([1., 1., 1.], dtype=float32), True)
    """
    if not callable(model):
        raise TypeError(f"Expected model to be callable, got model={model!r}.")
    if not callable(obs_to_model_args_fn):
        raise TypeError(
            "Expected obs_to_model_args_fn to be callable, got "
            f"obs_to_model_args_fn={obs_to_model_args_fn!r}."
        )

    def observed_model(obs, *args, **kwargs):
        mapped = obs_to_model_args_fn(obs, *args, **kwargs)
        if not (
            isinstance(mapped, (tuple, list))
            and len(mapped) == 2
            and isinstance(mapped[0], (tuple, list))
            and isinstance(mapped[1], dict)
        ):
            raise TypeError(
                "Expected obs_to_model_args_fn to return (model_args, model_kwargs), a sequence "
                f"and a dict, got {mapped!r}."
            )
        model_args, model_kwargs = mapped
        return model(*model_args, **model_kwargs)

    return observed_model


def _broadcast_to_leading(name: str, value, num_obs: int):
    """``value`` with its leading axis broadcast from 1 to ``num_obs`` (arrays of
    ``ndim >= 1``); scalars and non-arrays unchanged."""
    if not is_array(value) or value.ndim == 0:
        return value
    if value.shape[0] == num_obs:
        return value
    if value.shape[0] == 1:
        return jnp.broadcast_to(value, (num_obs,) + value.shape[1:])
    raise ValueError(
        f"Expected {name} to have a leading axis of length 1 or {num_obs} (the number of "
        f"observations), got {name}.shape={value.shape}."
    )


def map_args_obs_to_shape(obs, *args, **kwargs):
    """Map the observations and arguments onto a model's call, broadcast to the
    observations' leading shape (an ``obs_to_model_args_fn`` for
    :func:`make_observed_model`).

    With ``N`` the number of observations (the length of the leading axis of
    ``obs``, :func:`d3p.util.example_count`), every array argument (positional
    or keyword) of at least one dimension has its leading axis broadcast to
    ``N``: length 1 is repeated ``N`` times, length ``N`` is kept, any other
    length is an error. Scalars (Python numbers, 0-d arrays) and non-array
    arguments (``None``, lists, functions) pass unchanged. The observations
    become the first positional argument.

    :param obs: the observations, an array with the records on axis 0.
    :return: ``((obs, *args), kwargs)`` with the arguments broadcast.

    >>> import jax.numpy as jnp
    >>> args, kwargs = map_args_obs_to_shape(jnp.zeros((4, 2)), jnp.ones((1, 3)), 2.0, w=jnp.ones(4))
    >>> [jnp.shape(a) for a in args], kwargs["w"].shape
    ([(4, 2), (4, 3), ()], (4,))
    """
    if not is_array(obs) or jnp.ndim(obs) == 0:
        raise ValueError(
            f"Expected obs to be an array with the records on axis 0, got obs={obs!r}."
        )
    num_obs = example_count(obs)
    mapped_args = tuple(_broadcast_to_leading(f"args[{i}]", a, num_obs) for i, a in enumerate(args))
    mapped_kwargs = {k: _broadcast_to_leading(k, v, num_obs) for k, v in kwargs.items()}
    return (obs,) + mapped_args, mapped_kwargs
