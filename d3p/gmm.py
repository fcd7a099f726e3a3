"""A mixture of Gaussians as a NumPyro distribution (the d3p paper's GMM example).

DP-VI should not learn a latent variable per record (its posterior would be a
per-record release), so a mixture model is written with the component
assignment marginalised out: :class:`GaussianMixture` has the mixture's
marginal density, and the assignments appear only as intermediates of
sampling.
"""

from typing import Optional

import jax
import jax.numpy as jnp
import numpyro.distributions as dist
from jax.scipy.special import logsumexp
from numpyro.distributions import constraints
from numpyro.distributions.util import validate_sample

__all__ = ["GaussianMixture"]


class GaussianMixture(dist.Distribution):
    """A mixture of K Gaussians, the component assignment marginalised out.

    ``locs`` and ``scales`` have shape ``(K, *event)``: the first axis indexes
    the components; the further axes are independent one-dimensional
    Gaussians that share the component (one assignment per sample, for all
    of them). ``mixture_probabilities`` has shape ``(K,)`` and lies on the
    simplex. The density of ``x`` (shape ``event``) is

        p(x) = Σ_k π_k Π_e N(x_e; μ_{k,e}, σ_{k,e}²),

    so ``log_prob(x) = logsumexp_k (log π_k + Σ_e log N(x_e; μ_{k,e}, σ_{k,e}²))``.
    ``batch_shape`` is ``()`` and ``event_shape`` is ``locs.shape[1:]``;
    the support is the reals (for every event dimension).

    :param locs: the component means, shape ``(K, *event)``.
    :param scales: the component standard deviations, positive, of the shape
        of ``locs`` (or broadcastable to it with the same number of dimensions,
        e.g. ``(K, 1)`` for spherical components).
    :param mixture_probabilities: the weights π, shape ``(K,)``, on the simplex.
    :param validate_args: check the arguments' constraints (and the values
        given to :meth:`log_prob`); NumPyro's default when ``None``.

    **Example**

    >>> import jax, jax.numpy as jnp
    >>> d = GaussianMixture(jnp.array([[-2.0, 0.0], [2.0, 1.0]]), jnp.ones((2, 2)),
    ...                     jnp.array([0.3, 0.7]))
    >>> d.batch_shape, d.event_shape
    ((), (2,))
    >>> x, [z] = d.sample_with_intermediates(jax.random.PRNGKey(0), (5,))
    >>> x.shape, z.shape, d.log_prob(x).shape
    ((5, 2), (5,), (5,))
    """

    arg_constraints = {
        "locs": constraints.real,
        "scales": constraints.positive,
        "mixture_probabilities": constraints.simplex,
    }
    pytree_data_fields = ("locs", "scales", "mixture_probabilities")
    reparametrized_params = []

    def __init__(self, locs, scales, mixture_probabilities, validate_args: Optional[bool] = None):
        locs = jnp.asarray(locs)
        scales = jnp.asarray(scales)
        mixture_probabilities = jnp.asarray(mixture_probabilities)
        if locs.ndim < 1:
            raise ValueError(f"Expected locs of shape (K, *event), got locs.shape={locs.shape}.")
        if scales.ndim != locs.ndim:
            raise ValueError(
                f"Expected scales of the shape of locs {locs.shape}, got scales.shape={scales.shape}."
            )
        try:
            shape = jnp.broadcast_shapes(locs.shape, scales.shape)
        except ValueError:
            raise ValueError(
                f"Expected scales of the shape of locs {locs.shape}, got scales.shape={scales.shape}."
            ) from None
        num_components = shape[0]
        if mixture_probabilities.shape != (num_components,):
            raise ValueError(
                f"Expected mixture_probabilities of shape ({num_components},) (one per component), "
                f"got mixture_probabilities.shape={mixture_probabilities.shape}."
            )
        self.locs = jnp.broadcast_to(locs, shape)
        self.scales = jnp.broadcast_to(scales, shape)
        self.mixture_probabilities = mixture_probabilities
        super().__init__(batch_shape=(), event_shape=shape[1:], validate_args=validate_args)

    @constraints.dependent_property(is_discrete=False)
    def support(self):
        """The reals, for every event dimension."""
        if not self.event_shape:
            return constraints.real
        return constraints.independent(constraints.real, len(self.event_shape))

    @property
    def num_components(self) -> int:
        """The number of components K."""
        return self.mixture_probabilities.shape[0]

    def _component_log_probs(self, value) -> jax.Array:
        """``log π_k + Σ_e log N(value_e; μ_k, σ_k)``, shape ``value.shape[:-event_dim] + (K,)``."""
        value = jnp.asarray(value)
        event_dim = len(self.event_shape)
        if value.ndim < event_dim or value.shape[value.ndim - event_dim:] != self.event_shape:
            raise ValueError(
                f"Expected value of shape (..., *{self.event_shape}), got value.shape={value.shape}."
            )
        value = jnp.expand_dims(value, value.ndim - event_dim)  # the component axis
        log_pdfs = dist.Normal(self.locs, self.scales).log_prob(value)
        if event_dim:
            log_pdfs = jnp.sum(log_pdfs, axis=tuple(range(-event_dim, 0)))
        return log_pdfs + jnp.log(self.mixture_probabilities)

    @validate_sample
    def log_prob(self, value, intermediates=None) -> jax.Array:
        """The mixture's log-density at ``value`` (shape ``(*sample, *event)``), shape ``sample``.

        :param value: the points.
        :param intermediates: ignored (the assignments are marginalised out).
        """
        return logsumexp(self._component_log_probs(value), axis=-1)

    def sample_with_intermediates(self, key: jax.Array, sample_shape: tuple = ()):
        """Samples and their component assignments.

        Each sample draws a component ``z ~ Categorical(π)``, then each event
        entry from ``N(μ_z, σ_z²)``.

        :param jax.Array key: a ``jax.random`` key.
        :param tuple sample_shape: the number of samples, as a shape.
        :return: ``(x, [z])``: ``x`` of shape ``(*sample_shape, *event)`` and
            the component indices ``z`` (integers in ``[0, K)``) of shape
            ``sample_shape``.
        """
        sample_shape = tuple(sample_shape)
        z_key, x_key = jax.random.split(key)
        z = dist.CategoricalProbs(self.mixture_probabilities).sample(z_key, sample_shape)
        dtype = jnp.result_type(self.locs, float)
        eps = jax.random.normal(x_key, sample_shape + self.event_shape, dtype=dtype)
        x = self.locs[z] + self.scales[z] * eps
        return x, [z]

    def sample(self, key: jax.Array, sample_shape: tuple = ()) -> jax.Array:
        """Samples of shape ``(*sample_shape, *event)`` (see :meth:`sample_with_intermediates`)."""
        return self.sample_with_intermediates(key, sample_shape)[0]

    @property
    def mean(self) -> jax.Array:
        """``Σ_k π_k μ_k``, shape ``event``."""
        return jnp.tensordot(self.mixture_probabilities, self.locs, axes=1)

    @property
    def variance(self) -> jax.Array:
        """The per-entry variance ``Σ_k π_k (σ_k² + μ_k²) - mean²``, shape ``event``."""
        second = jnp.tensordot(self.mixture_probabilities, self.scales**2 + self.locs**2, axes=1)
        return second - self.mean**2
