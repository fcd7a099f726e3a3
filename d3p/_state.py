# SPDX-License-Identifier: Apache-2.0
"""What :class:`d3p.svi.DPSVI` returns: the state of its steps
(:class:`DPSVIState`) and the result of a run (:class:`DPSVIRunResult`), both
pytrees, with the state's checks."""

import dataclasses
import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp


class DPSVIState(NamedTuple):
    """State of :class:`DPSVI`, a pytree.

    - **optim_state** - the optimizer's state (holds the unconstrained
      variational parameters); as in :data:`numpyro.infer.svi.SVIState`.
    - **mutable_state** - always ``None``: DP-VI does not support mutable
      state (see :class:`DPSVI`).
    - **rng_key** - the key of the PRNG suite (``d3p.random`` by default) from
      which the next step draws its privacy noise and Monte Carlo samples.
    - **observation_scale** - the likelihood scale of ONE record, as d3p
      0.2's state held it: the model's scale of its observed sites on a batch
      of one record (the plate's ``N / 1``, times constant
      ``numpyro.handlers.scale`` factors), the public constant by which DPSVI
      divides each record's loss before clipping. It does not depend on the
      batch's length (the likelihood scale of a batch of ``B`` records is
      this over ``B``). It is a 0-d array of JAX's default float dtype, so the
      state keeps its pytree structure and dtypes as a
      ``lax.scan``/``fori_loop``/``while_loop`` carry; it is set by
      :meth:`DPSVI.init` and again by every update (for the records' structure
      at hand), from shapes and public constants only, never from data values.
      With ``clip_unscaled_observations=False`` DPSVI neither reads nor
      applies the model's scale (it is not checked to be public) and the
      field is 1.0. Defaults to ``None`` so that a state can be built from the
      first three fields; ``update`` keeps ``None`` in such a state (its
      structure stays the same).
    - **clipping_threshold** - with adaptive clipping (:class:`AdaptiveClipping`),
      the threshold ``C_t`` of the next step: a 0-d array of JAX's default
      float dtype, set to the initial ``C`` by :meth:`DPSVI.init` and by every
      update from the noisy count it releases (public: post-processing of a
      private release); saved with checkpoints. ``None`` without adaptive
      clipping (the constructor's ``C`` is used).
    """

    optim_state: Any
    mutable_state: Any
    rng_key: Any
    observation_scale: Any = None
    clipping_threshold: Any = None


def state_scale(record_scale: Optional[float]) -> jax.Array:
    """:attr:`DPSVIState.observation_scale` for the public one-record scale
    ``record_scale`` (``None``, without ``clip_unscaled_observations``: 1.0)."""
    value = 1.0 if record_scale is None else record_scale
    return jnp.asarray(value, dtype=jnp.result_type(float))


def check_state(svi_state) -> None:
    """Raise ``TypeError`` unless ``svi_state`` is a :class:`DPSVIState`."""
    if not isinstance(svi_state, DPSVIState):
        raise TypeError(
            f"Expected svi_state to be a DPSVIState (from DPSVI.init), got {type(svi_state).__name__}."
        )


_PRIVACY_FIELD = functools.partial(dataclasses.field, default=None, kw_only=True)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["params", "state", "losses"],
    meta_fields=["epsilon", "delta", "relation", "sampler", "sigma", "q", "num_steps", "start_step",
                 "averaged_steps", "total_epsilon"],
)
@dataclasses.dataclass(eq=False)
class DPSVIRunResult:
    """The result of :meth:`DPSVI.run`: ``(params, state, losses)`` as NumPyro's
    :data:`~numpyro.infer.svi.SVIRunResult`, with the privacy spent.

    It behaves as that three-tuple (``params, state, losses = result``,
    ``result[0]``, ``len(result) == 3``, iteration) without being a tuple:
    the privacy figures are declared fields beside the three, keyword-only
    when constructing it. It is a pytree whose leaves are those of ``params``,
    ``state`` and ``losses``; the privacy figures are static metadata. It is
    not an instance of ``SVIRunResult`` (a ``NamedTuple`` cannot hold further
    fields without changing its length).

    - **params** - the constrained parameters: :meth:`DPSVI.get_params` of
      ``state``, or with ``run(average=...)`` the mean of the unconstrained
      parameters over the run's last ``averaged_steps`` steps, constrained
      (post-processing: as private as the steps it averages).
    - **state** - the final :class:`DPSVIState`.
    - **losses** - the loss of every step; NOT private.
    - **epsilon** - ε of this run's steps at ``delta``, for its sampler and
      relation: this release's own share.
    - **delta** - δ of the guarantee: the target δ plus, under Poisson
      sampling, the probability that a batch overflowed its padded size.
    - **relation** - ``"add_remove"`` or ``"substitute"``.
    - **sampler** - ``"poisson"`` or ``"fixed_size"``.
    - **sigma** - the noise multiplier the run is accounted with: ``dp_scale``,
      or with adaptive clipping ``σ_eff`` of the gradient and count releases
      together (the gradient's own multiplier is
      :meth:`AdaptiveClipping.gradient_sigma` of it and the count noise).
    - **q** - the sampling probability of each record per step.
    - **num_steps** - the number of steps (``epsilon`` covers these steps only).
    - **start_step** - the index of the run's first step in the stream of
      batch keys (see ``run``'s ``start_step``); ``start_step + num_steps`` is
      where a continued run starts.
    - **averaged_steps** - the number of steps whose parameters ``params``
      averages (0: ``params`` are the final state's).
    - **total_epsilon** - with a ledger (``run``'s ``ledger``, or a
      checkpoint's): ε at the same ``delta`` of everything the ledger holds
      after this run, its earlier releases (e.g. the parts of a resumed
      training) and this run composed: the figure that covers the released
      parameters. None without a ledger.
    """

    params: Any
    state: Any
    losses: Any
    epsilon: Optional[float] = _PRIVACY_FIELD()
    delta: Optional[float] = _PRIVACY_FIELD()
    relation: Optional[str] = _PRIVACY_FIELD()
    sampler: Optional[str] = _PRIVACY_FIELD()
    sigma: Optional[float] = _PRIVACY_FIELD()
    q: Optional[float] = _PRIVACY_FIELD()
    num_steps: Optional[int] = _PRIVACY_FIELD()
    start_step: Optional[int] = _PRIVACY_FIELD()
    averaged_steps: Optional[int] = _PRIVACY_FIELD()
    total_epsilon: Optional[float] = _PRIVACY_FIELD()

    def _triple(self) -> tuple:
        return (self.params, self.state, self.losses)

    def __iter__(self):
        return iter(self._triple())

    def __len__(self) -> int:
        return 3

    def __getitem__(self, index):
        return self._triple()[index]

