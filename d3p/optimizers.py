"""ADADP: the adaptive-step-size optimizer for DP learning of Koskela & Honkela.

A. Koskela and A. Honkela, "Learning Rate Adaptation for Federated and
Differentially Private Learning", AISTATS 2020 (arXiv:1809.03832).

Noisy gradients make a fixed learning rate hard to choose: too large and the
noise dominates, too small and progress stalls. ADADP compares, every two
steps, one full step of size η against two half steps of size η/2 (each with
its own gradient) and adapts η so that their discrepancy stays near a
tolerance, as an adaptive ODE solver would.

:func:`adadp` returns the ``(init, update, get_params)`` triple in the style of
:mod:`jax.example_libraries.optimizers`; :class:`ADADP` wraps it as a NumPyro
optimizer, usable with :class:`d3p.svi.DPSVI` (and ``numpyro.infer.SVI``)
like ``numpyro.optim.Adam``.

**Formal guarantees.** ADADP only post-processes the gradients it is given:
with DPSVI each of its steps consumes one private (clipped and noised)
gradient, so it adds no privacy cost of its own, and the accountant counts
every step, even and odd, as usual. Its state (parameters, the remembered
points and η) is a function of the private gradients only.
"""

from functools import partial
from typing import Any, Callable, NamedTuple, Union

import jax
import jax.numpy as jnp
from jax import lax
from jax.example_libraries.optimizers import Optimizer
from numpyro.optim import _NumPyroOptim

from d3p import _validate

__all__ = ["ADADP", "ADADPState", "adadp"]


class ADADPState(NamedTuple):
    """The state of :func:`adadp` (a pytree).

    - **x** - the current parameters (a pytree); after an even step the half
      step, after an odd step the end of the pair.
    - **x_prev** - the parameters at the start of the current pair of steps.
    - **x_full** - the full step ``x_prev - η g`` taken from ``x_prev``.
    - **lr** - the current learning rate η (a scalar array).
    """

    x: Any
    x_prev: Any
    x_full: Any
    lr: jax.Array


class _Settings(NamedTuple):
    """The checked constants of one ADADP optimizer."""

    tol: float
    stability_check: bool
    alpha_min: float
    alpha_max: float


def _make_schedule(step_size) -> Callable:
    if callable(step_size):
        return step_size
    value = _validate.positive("step_size", step_size)
    return lambda i: value


def _settings(tol, stability_check, alpha_min, alpha_max) -> _Settings:
    return _Settings(
        _validate.positive("tol", tol),
        _validate.boolean("stability_check", stability_check),
        _validate.number("alpha_min", alpha_min, low=0.0, high=1.0, low_open=True),
        _validate.number("alpha_max", alpha_max, low=1.0),
    )


def _even_step(g, state: ADADPState) -> ADADPState:
    """Remember ``x_prev`` and the full step; move to the half step."""
    x, _, _, lr = state
    x_full = jax.tree.map(lambda p, d: _step(p, d, lr), x, g)
    x_half = jax.tree.map(lambda p, d: _step(p, d, 0.5 * lr), x, g)
    return ADADPState(x_half, x, x_full, lr)


def _odd_step(settings: _Settings, g, state: ADADPState) -> ADADPState:
    """The second half step; adapt η from the discrepancy; reject if unstable."""
    x, x_prev, x_full, lr = state
    x2 = jax.tree.map(lambda p, d: _step(p, d, 0.5 * lr), x, g)
    err = _error(x_full, x2)
    factor = jnp.clip(jnp.sqrt(settings.tol / err), settings.alpha_min, settings.alpha_max)
    new_lr = (lr * factor).astype(lr.dtype)
    if settings.stability_check:
        reject = err > settings.tol
        x2 = jax.tree.map(lambda back, new: jnp.where(reject, back, new), x_prev, x2)
    return ADADPState(x2, x_prev, x_full, new_lr)


def adadp(
    step_size: Union[float, Callable] = 1e-3,
    tol: float = 1.0,
    stability_check: bool = True,
    alpha_min: float = 0.9,
    alpha_max: float = 1.1,
) -> Optimizer:
    """The ADADP optimizer as an ``(init, update, get_params)`` triple.

    Steps come in pairs, told apart by the step counter ``i`` that ``update``
    receives (even ``i`` starts a pair). With parameters x, learning rate η
    and the gradient g given to the step:

    - even step: remember ``x_prev = x`` and the full step
      ``x_full = x - η g``; move to the half step ``x - (η/2) g``;
    - odd step: take the second half step ``x2 = x - (η/2) g`` with the new
      gradient; measure ``err = ‖(x_full - x2) / max(1, |x_full|)‖₂``
      (elementwise division, the norm over all parameters together); update
      ``η ← η · min(max(√(tol/err), alpha_min), alpha_max)``; if
      ``stability_check`` and ``err > tol``, reject the pair (return to
      ``x_prev``), else keep ``x2``.

    ``err = 0`` grows η by ``alpha_max``; a NaN gradient makes η and the
    parameters NaN (``DPSVI.stable_update`` then keeps the previous state).

    :param step_size: the initial learning rate η > 0, a number or a schedule
        (a function of the step counter). A schedule is evaluated once, at
        step 0, for the initial η; afterwards η follows the adaptation alone,
        as in the paper.
    :param float tol: the tolerance ``tol > 0`` that the discrepancy ``err``
        is steered towards.
    :param bool stability_check: reject a pair whose ``err`` exceeds ``tol``.
    :param float alpha_min: the smallest factor η is multiplied by at the end
        of a pair, ``0 < alpha_min <= 1``.
    :param float alpha_max: the largest factor, ``1 <= alpha_max < inf``.
    :return: ``Optimizer(init, update, get_params)``: ``init(params) ->
        ADADPState``, ``update(i, grads, state) -> ADADPState`` and
        ``get_params(state) -> params`` (the current ``x``).

    >>> import jax.numpy as jnp
    >>> init, update, get_params = adadp(step_size=0.1)
    >>> state = init(jnp.array([1.0, -2.0]))
    >>> state = update(0, jnp.array([1.0, 1.0]), state)  # half step
    >>> get_params(state)
    Array([ 0.95, -2.05], dtype=float32)
    >>> state = update(1, jnp.array([1.0, 1.0]), state)  # err = 0: η grows
    >>> get_params(state), round(float(state.lr), 6)
    (Array([ 0.9, -2.1], dtype=float32), 0.11)
    """
    schedule = _make_schedule(step_size)
    settings = _settings(tol, stability_check, alpha_min, alpha_max)
    odd_step = partial(_odd_step, settings)

    def init(x0) -> ADADPState:
        x0 = jax.tree.map(jnp.asarray, x0)
        lr = jnp.asarray(schedule(0), dtype=jnp.result_type(float))
        return ADADPState(x0, x0, x0, lr)

    def update(i, g, state: ADADPState) -> ADADPState:
        return lax.cond(jnp.asarray(i) % 2 == 0, _even_step, odd_step, g, state)

    def get_params(state: ADADPState):
        return state.x

    return Optimizer(init, update, get_params)


def _step(p, d, lr):
    """``p - lr d`` in the dtype of the parameter ``p``."""
    p = jnp.asarray(p)
    return (p - lr * d).astype(p.dtype)


def _error(x_full, x2) -> jax.Array:
    """ADADP's discrepancy ``‖(x_full - x2) / max(1, |x_full|)‖₂`` over all leaves."""
    leaves = jax.tree.leaves(
        jax.tree.map(lambda f, s: ((f - s) / jnp.maximum(1.0, jnp.abs(f))).ravel(), x_full, x2)
    )
    if not leaves:
        return jnp.zeros(())
    return jnp.linalg.norm(jnp.concatenate(leaves))


class ADADP(_NumPyroOptim):
    """ADADP (:func:`adadp`) as a NumPyro optimizer.

    Use it wherever a ``numpyro.optim`` optimizer is accepted, e.g.
    ``DPSVI(model, guide, ADADP(1e-2), Trace_ELBO(), ...)``; ``init``,
    ``update``, ``get_params`` (the current parameters) follow
    ``numpyro.optim``. The arguments are those of :func:`adadp`. Its state is
    ``(step counter, ADADPState)``.

    **Formal guarantees.** Post-processing: see the module documentation.

    >>> import jax.numpy as jnp
    >>> opt = ADADP(step_size=0.1)
    >>> state = opt.init({"w": jnp.zeros(2)})
    >>> state = opt.update({"w": jnp.ones(2)}, state)
    >>> opt.get_params(state)["w"]
    Array([-0.05, -0.05], dtype=float32)
    """

    def __init__(
        self,
        step_size: Union[float, Callable] = 1e-3,
        tol: float = 1.0,
        stability_check: bool = True,
        alpha_min: float = 0.9,
        alpha_max: float = 1.1,
    ):
        super().__init__(adadp, step_size, tol, stability_check, alpha_min, alpha_max)
