"""The models of the d3p paper, defined once for the examples, benchmarks and tests.

Prediger et al., "d3p – A Python Package for Differentially-Private
Probabilistic Programming", PoPETs 2022. Every model takes its per-record
data first and the data set size ``N`` as a keyword (a static keyword of
:class:`~d3p.svi.DPSVI`, as ``DPSVI(model, guide, ..., N=N)``), and puts the
records under ``numpyro.plate(name, N, subsample_size=B)`` so that DPSVI can
undo the plate's scale for each record.

These are experiment code, not API: the module is private and may change with
the experiments.
"""

import math
from typing import Callable, Dict, Tuple

import jax
import jax.numpy as jnp
import numpyro
import numpyro.distributions as dist

from d3p.gmm import GaussianMixture

__all__ = [
    "logistic_regression_model",
    "logistic_regression_guide",
    "hierarchical_logistic_regression_model",
    "hierarchical_logistic_regression_guide",
    "gmm_model",
    "make_vae",
    "vae_encode",
    "vae_decode",
]


# ------------------------------------------------------- logistic regression


def logistic_regression_model(xs, ys, N):
    """Logistic regression (paper, section 3, listing 2).

    ``w ~ Normal(0, 4²)`` in every coordinate, ``y_i ~ Bernoulli(sigmoid(x_i·w))``
    for the records of the batch under a plate of size ``N``. Written with
    Bernoulli logits and ``w`` as one event, which has the density of the
    listing (``Bernoulli(sigmoid(·))`` with ``sample_shape=(d,)``).

    :param xs: the batch's features, ``(B, d)`` (per-record, private).
    :param ys: the batch's labels in {0, 1}, ``(B,)`` (per-record, private).
    :param int N: the number of records in the data set (public).
    """
    batch_size, d = xs.shape
    w = numpyro.sample("w", dist.Normal(0.0, 4.0).expand([d]).to_event(1))
    with numpyro.plate("batch", N, subsample_size=batch_size):
        numpyro.sample("ys", dist.Bernoulli(logits=xs @ w), obs=ys)


def logistic_regression_guide(xs, ys, N):
    """Mean-field Gaussian posterior over ``w`` (paper, section 3, listing 2).

    Parameters ``w_loc`` (initially 0) and ``w_scale_log`` (the log of the
    standard deviation, initially 0); the arguments are the model's.
    """
    d = xs.shape[1]
    w_loc = numpyro.param("w_loc", jnp.zeros(d))
    w_scale = jnp.exp(numpyro.param("w_scale_log", jnp.zeros(d)))
    numpyro.sample("w", dist.Normal(w_loc, w_scale).to_event(1))


# ------------------------------------------ hierarchical logistic regression


def hierarchical_logistic_regression_model(xs, ys, ls, gs, N):
    """Hierarchical logistic regression (paper, sections 3.3 and 5.3, listing 4).

    Records fall into L groups; group ``l`` has public characteristics
    ``g_l`` in R^K and weights ``w_l ~ N(M g_l, I)`` with ``M_dk ~ N(0, 4²)``;
    ``y_i ~ Bernoulli(sigmoid(x_i·w_{l_i}))``.

    :param xs: records, ``(B, D)`` (per-record, private).
    :param ys: binary labels, ``(B,)`` (per-record, private).
    :param ls: group index of every record, ``(B,)`` ints (per-record, private).
    :param gs: group characteristics, ``(L, K)`` (shared by all records and
        public: a static keyword of DPSVI, not batch data).
    :param int N: the number of records in the data set (public).
    """
    batch_size, d = xs.shape
    num_groups, k = gs.shape
    M = numpyro.sample("M", dist.Normal(0.0, 4.0), sample_shape=(d, k))
    with numpyro.plate("group", num_groups, num_groups):
        etas = gs @ M.T
        ws = numpyro.sample("ws", dist.Normal(etas, 1.0).to_event(1))
    with numpyro.plate("batch", N, batch_size):
        thetas = jax.nn.sigmoid(jnp.einsum("nd,nd->n", xs, ws[ls]))
        numpyro.sample("ys", dist.Bernoulli(thetas), obs=ys)


def hierarchical_logistic_regression_guide(xs, ys, ls, gs, N):
    """Diagonal Gaussian posterior over ``M`` (paper, section 3.3, listing 4).

    Parameters ``M_loc`` and ``M_scale_log``, ``(D, K)``, initially 0. The
    group weights ``ws`` have no guide site, as in the listing (NumPyro warns
    "Found vars in model but not guide").
    """
    d = xs.shape[1]
    k = gs.shape[1]
    M_loc = numpyro.param("M_loc", jnp.zeros((d, k)))
    M_scale = jnp.exp(numpyro.param("M_scale_log", jnp.zeros((d, k))))
    numpyro.sample("M", dist.Normal(M_loc, M_scale))


# ------------------------------------------------------ Gaussian mixture model


def gmm_model(xs, N, k=5):
    """Mixture of ``k`` spherical Gaussians (paper, section 5.4 and appendix A, listing 6).

    Weights ``π ~ Dirichlet(1)``, means ``μ_j ~ N(0, I)``, scales
    ``σ_j ~ InverseGamma(1, 1)``; a record's likelihood is the mixture's with
    the component assignment marginalised out (:class:`d3p.gmm.GaussianMixture`,
    listing 5), so DP-VI learns no latent variable per record. The paper fits
    it with an ``AutoDiagonalNormal`` guide.

    :param xs: records, ``(B, d)`` (per-record, private).
    :param int N: the number of records in the data set (public).
    :param int k: the number of components.
    """
    batch_size, d = xs.shape
    pis = numpyro.sample("pis", dist.Dirichlet(jnp.ones(k)))
    with numpyro.plate("components", k):
        locs = numpyro.sample("locs", dist.MultivariateNormal(jnp.zeros(d), jnp.eye(d)))
        sigmas = numpyro.sample("sigmas", dist.InverseGamma(1.0, 1.0))
    with numpyro.plate("batch", N, subsample_size=batch_size):
        numpyro.sample("xs", GaussianMixture(locs, sigmas[:, None], pis), obs=xs)


# ----------------------------------------------------- variational autoencoder


def _dense(name: str, n_in: int, n_out: int) -> Callable:
    """A dense layer whose weights are NumPyro params (Glorot-normal init)."""
    std = math.sqrt(2.0 / (n_in + n_out))
    w = numpyro.param(f"{name}_w", lambda key: std * jax.random.normal(key, (n_in, n_out)))
    b = numpyro.param(f"{name}_b", jnp.zeros(n_out))
    return lambda x: x @ w + b


def make_vae(num_pixels: int = 784, hidden: int = 400, latent: int = 50) -> Tuple[Callable, Callable]:
    """Model and guide of the paper's variational autoencoder (section 5.1).

    Encoder ``num_pixels - hidden - (latent, latent)`` (mean and log-scale of
    a Gaussian latent, as one dense layer of ``2 * latent`` outputs), decoder
    ``latent - hidden - num_pixels`` with Bernoulli pixels, ReLU hidden layers;
    the defaults are the paper's MNIST network (688 884 parameters). The
    weights are ``numpyro.param`` sites: the decoder's (``dec_hidden_*``,
    ``dec_out_*``) in the model, the encoder's (``enc_hidden_*``,
    ``enc_out_*``) in the guide; the latent ``z`` is local, under the plate.
    Both take the batch ``xs`` ``(B, num_pixels)`` and ``N``.

    :param int num_pixels: the input size.
    :param int hidden: the hidden units of the encoder and of the decoder.
    :param int latent: the latent dimension.
    :return: ``(model, guide)``.
    """

    def model(xs, N):
        decoder_hidden = _dense("dec_hidden", latent, hidden)
        decoder_out = _dense("dec_out", hidden, num_pixels)
        with numpyro.plate("batch", N, subsample_size=xs.shape[0]):
            z = numpyro.sample("z", dist.Normal(0.0, 1.0).expand([latent]).to_event(1))
            logits = decoder_out(jax.nn.relu(decoder_hidden(z)))
            numpyro.sample("xs", dist.Bernoulli(logits=logits).to_event(1), obs=xs)

    def guide(xs, N):
        encoder_hidden = _dense("enc_hidden", num_pixels, hidden)
        encoder_out = _dense("enc_out", hidden, 2 * latent)
        with numpyro.plate("batch", N, subsample_size=xs.shape[0]):
            out = encoder_out(jax.nn.relu(encoder_hidden(xs)))
            loc, log_scale = out[:, :latent], out[:, latent:]
            numpyro.sample("z", dist.Normal(loc, jnp.exp(log_scale)).to_event(1))

    return model, guide


def vae_decode(params: Dict, z) -> jax.Array:
    """Pixel probabilities of the decoder of :func:`make_vae` at latents ``z`` ``(n, latent)``."""
    h = jax.nn.relu(z @ params["dec_hidden_w"] + params["dec_hidden_b"])
    return jax.nn.sigmoid(h @ params["dec_out_w"] + params["dec_out_b"])


def vae_encode(params: Dict, x, latent: int) -> jax.Array:
    """Latent means of the encoder of :func:`make_vae` for images ``x`` ``(n, num_pixels)``."""
    h = jax.nn.relu(x @ params["enc_hidden_w"] + params["enc_hidden_b"])
    return (h @ params["enc_out_w"] + params["enc_out_b"])[:, :latent]
