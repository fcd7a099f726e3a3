# SPDX-License-Identifier: Apache-2.0
"""The audited mechanisms: the package's real private step and DPSVI on a tiny
logistic regression, run many times on two neighbouring data sets.

Every function here runs the package's own code (``d3p.gradients``,
:meth:`d3p.svi.DPSVI.update`, the samplers of :mod:`d3p.minibatch`), looked up
when it traces and compiled afresh on every call, so that a monkeypatched
function is what the audit runs. Runs are vectorised with ``vmap``; run ``i``
draws all its randomness from ``fold_in(rng_key, i)``, so the result does not
depend on how the runs are chunked. See :mod:`d3p.audit` for the threat model.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

import d3p.random
from d3p import _validate
from d3p import accounting as _accounting
from d3p.audit._stats import projection_scores

__all__ = [
    "THREAT_MODELS",
    "gaussian_step_scores",
    "dpsvi_projections",
    "dpsvi_fixed_size_projections",
    "dpsvi_scores",
]

# what the attacker of dpsvi_projections sees: every step's parameters, or the final ones
THREAT_MODELS = ("every_step", "final_params")

#: The neighbouring relations of :func:`gaussian_step_scores` by name, each
#: mapped to the object :mod:`d3p.accounting` names it with.
_RELATIONS = {str(r): r for r in _accounting.RELATIONS}

#: How :func:`dpsvi_projections` draws its Poisson-sampled batches.
_SAMPLERS = ("bernoulli", "poisson_sampler")

#: Fold-in index of the key that initialises DPSVI, outside the runs' indices.
_INIT_INDEX = 2**32 - 1


# ---------------------------------------------------------------------------
# shared set-up: arguments, data, chunked runs
# ---------------------------------------------------------------------------


class _Common(NamedTuple):
    """The checked arguments every mechanism takes."""

    num_runs: int
    sigma: float
    C: float
    num_other_records: int
    dim: int
    canary_norm: float
    runs_per_chunk: int
    rng_suite: Any


def _check_common(
    num_runs, dp_scale, clipping_threshold, num_other_records, dim, canary_norm, runs_per_chunk, rng_suite
) -> _Common:
    """The arguments every mechanism takes, checked with the package's shared validators."""
    return _Common(
        num_runs=_validate.integer("num_runs", num_runs, minimum=2),
        sigma=_validate.non_negative("dp_scale", dp_scale),
        C=_validate.positive("clipping_threshold", clipping_threshold),
        num_other_records=_validate.integer("num_other_records", num_other_records, minimum=0),
        dim=_validate.integer("dim", dim, minimum=2),
        # > 2: the canary's gradient norm, about canary_norm * C / 2, must exceed C
        canary_norm=_validate.number("canary_norm", canary_norm, low=2.0, low_open=True),
        runs_per_chunk=_validate.integer("runs_per_chunk", runs_per_chunk, minimum=1),
        rng_suite=_validate.rng_suite("rng_suite", rng_suite),
    )


def _svi_class(svi_module, svi_class: Optional[type]) -> type:
    """:class:`d3p.svi.DPSVI` (looked up at call time) for None, else a checked subclass of it."""
    cls = svi_module.DPSVI if svi_class is None else svi_class
    if not (isinstance(cls, type) and issubclass(cls, svi_module.DPSVI)):
        raise _validate.InvalidArgumentType(
            f"Expected svi_class to be DPSVI or a subclass, got svi_class={svi_class!r}."
        )
    return cls


def _other_records(num_other_records: int, dim: int):
    """Fixed public records whose first feature is 0 (orthogonal to the canary)."""
    rng = np.random.default_rng(20240601)
    x = np.zeros((num_other_records, dim), np.float32)
    x[:, 1:] = rng.normal(size=(num_other_records, dim - 1)) / math.sqrt(dim - 1)
    y = rng.integers(0, 2, num_other_records).astype(np.float32)
    return x, y


def _canary_data(c: _Common) -> Tuple[jax.Array, jax.Array]:
    """``D``: the other records, then the canary ``x = canary_norm * C * e_0, y = 1`` last."""
    xo, yo = _other_records(c.num_other_records, c.dim)
    canary_x = np.zeros((1, c.dim), np.float32)
    canary_x[0, 0] = c.canary_norm * c.C
    x = jnp.asarray(np.concatenate([xo, canary_x]))
    y = jnp.asarray(np.concatenate([yo, [1.0]]).astype(np.float32))
    return x, y


def _logistic_loss(params, record):
    """Negative log-likelihood of one logistic regression record ``(x, y)``."""
    x, y = record
    z = jnp.dot(x, params)
    return -(y * jax.nn.log_sigmoid(z) + (1 - y) * jax.nn.log_sigmoid(-z))


def _run_chunks(fn: Callable, num: int, chunk: int, progress_bar: bool, desc: str) -> np.ndarray:
    """``fn(start_indices)`` over ``range(num)`` in fixed-size chunks; returns the concatenation."""
    out = []
    starts = range(0, num, chunk)
    it = tqdm.tqdm(starts, desc=desc, disable=not progress_bar)
    for start in it:
        idx = jnp.arange(start, start + chunk, dtype=jnp.uint32)
        out.append(np.asarray(jax.device_get(fn(idx)), dtype=np.float64))
    return np.concatenate(out)[:num]


def _run_both(one_run: Callable, c: _Common, progress_bar: bool, desc: str) -> Tuple[np.ndarray, np.ndarray]:
    """``one_run(i)`` for the runs ``0 .. 2 num_runs - 1``, vectorised and compiled
    afresh (so that what it looks up is traced now); returns the first
    ``num_runs`` results and the rest."""
    fn = jax.jit(jax.vmap(one_run))
    num = 2 * c.num_runs
    out = _run_chunks(fn, num, min(c.runs_per_chunk, num), progress_bar, desc)
    return out[: c.num_runs], out[c.num_runs:]


# ---------------------------------------------------------------------------
# one private step: clipped_grad_sum + add_gaussian_noise
# ---------------------------------------------------------------------------


def gaussian_step_scores(
    rng_key: jax.Array,
    num_runs: int,
    *,
    dp_scale: float,
    clipping_threshold: float = 1.0,
    relation: str = _accounting.ADD_REMOVE,
    num_other_records: int = 7,
    dim: int = 3,
    canary_norm: float = 100.0,
    rng_suite=d3p.random,
    runs_per_chunk: int = 16384,
    progress_bar: bool = False,
) -> Tuple[np.ndarray, np.ndarray]:
    """Attack scores of one private gradient step (q = 1, T = 1), with and without the canary.

    Every run computes, at parameters 0 of a logistic regression with ``dim``
    weights, ``d3p.gradients.clipped_grad_sum`` over the records of the data
    set, then ``d3p.gradients.add_gaussian_noise`` (both looked up when the
    function is traced, so a monkeypatched version is what runs). ``D`` holds
    ``num_other_records`` fixed records (first feature 0) and the canary
    ``x = canary_norm * C * e_0, y = 1``, whose gradient ``-x / 2`` is clipped
    to ``-C e_0``. The neighbour ``D'``:

    - ``relation="add_remove"``: the canary removed (masked out);
    - ``relation="substitute"``: the canary replaced by its mirror (``y = 0``,
      gradient clipped to ``+C e_0``).

    The score is the released noisy sum projected on the canary's direction,
    in units of C: ``<noisy_sum, -e_0> / C``. For the correct mechanism it is
    ``N(1, σ²)`` with the canary and ``N(0, σ²)`` (add/remove) or
    ``N(-1, σ²)`` (substitute) without: exactly the Gaussian mechanism the
    accountant analyses (with q = 1, T = 1), ε tight.

    :param rng_key: a key of ``rng_suite``; run ``i`` uses ``fold_in(rng_key, i)``
        for its noise (the first ``num_runs`` runs use ``D``, the next ``D'``).
    :param int num_runs: runs per data set, ``>= 2``.
    :param float dp_scale: noise multiplier σ >= 0.
    :param float clipping_threshold: C > 0.
    :param str relation: ``"add_remove"`` or ``"substitute"``.
    :param int num_other_records: records besides the canary, ``>= 0``.
    :param int dim: number of weights, ``>= 2``.
    :param float canary_norm: the canary's feature in units of C, ``> 2``.
    :param rng_suite: the PRNG suite passed to ``add_gaussian_noise``.
    :param int runs_per_chunk: runs vectorised in one call (memory bound).
    :param bool progress_bar: show a tqdm bar over chunks.
    :return: ``(scores_in, scores_out)``, float64 arrays of ``num_runs`` each.
    """
    c = _check_common(
        num_runs, dp_scale, clipping_threshold, num_other_records, dim, canary_norm, runs_per_chunk, rng_suite
    )
    relation = _validate.choice("relation", relation, _RELATIONS)
    one_run = _gaussian_step_run(rng_key, c, substitute=relation == _accounting.SUBSTITUTE)
    return _run_both(one_run, c, progress_bar, "audit: gaussian step")


def _gaussian_step_run(rng_key, c: _Common, substitute: bool) -> Callable:
    """``one_run(i)`` of :func:`gaussian_step_scores`: runs ``i < num_runs`` use ``D``."""
    from d3p import gradients

    x, y_in = _canary_data(c)
    y_sub = y_in.at[-1].set(0.0)  # the mirrored canary
    slots = c.num_other_records + 1
    params = jnp.zeros((c.dim,), jnp.float32)

    def one_run(i):
        present = i < c.num_runs
        key = c.rng_suite.fold_in(rng_key, i)
        if substitute:
            y, mask = jnp.where(present, y_in, y_sub), jnp.ones((slots,), bool)
        else:
            y, mask = y_in, jnp.ones((slots,), bool).at[-1].set(present)
        summed = gradients.clipped_grad_sum(_logistic_loss, params, (x, y), mask, c.C)
        noisy = gradients.add_gaussian_noise(summed.grad_sum, key, c.sigma, c.C, c.rng_suite)
        return -noisy[0] / c.C

    return one_run


# ---------------------------------------------------------------------------
# DPSVI: the model, the audited instance, reading the released sums
# ---------------------------------------------------------------------------


def _logistic_model(x, y, N):
    import numpyro
    import numpyro.distributions as dist

    w = numpyro.sample("w", dist.Normal(0.0, 10.0).expand([x.shape[-1]]).to_event(1))
    with numpyro.plate("data", N, subsample_size=x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)


def _delta_guide(x, y, N):
    import numpyro
    import numpyro.distributions as dist

    loc = numpyro.param("w_loc", jnp.zeros((x.shape[-1],), jnp.float32))
    numpyro.sample("w", dist.Delta(loc).to_event(1))


def _learning_rate(c: _Common, factor: float, load: float, num_steps: int) -> float:
    """A learning rate so small that every gradient stays clipped to C.

    In a run the parameters move by at most about ``lr * factor * C * load * T``
    (``factor``: DPSVI's normalisation N / B; ``load``: the released sum's
    magnitude per step in units of C, records plus noise). Keeping
    ``x . w`` far below 1 for the records' feature ``x = canary_norm * C``
    keeps their gradients far above C, hence clipped to exactly C.
    """
    return 1e-4 / (c.canary_norm * factor * load * num_steps * c.C * c.C)


class _AuditedSVI(NamedTuple):
    """The audited DPSVI, its initial state, and how released sums are read off it."""

    svi: Any
    state0: Any
    state_type: type
    rng_key: Any
    rng_suite: Any
    scale: float
    """Change of the first weight per unit of C in the released noisy sum."""

    def first_weight(self, state):
        return self.svi.get_params(state)["w_loc"][0]

    def run_start(self, i):
        """Run ``i``'s initial state (its own noise key) and its batch key."""
        run_key = self.rng_suite.fold_in(self.rng_key, i)
        state_key, batch_key = self.rng_suite.split(run_key, 2)
        return self.state_type(self.state0.optim_state, None, state_key), batch_key

    def step(self, state, *batch, mask=None, expected_batch_size):
        """One :meth:`DPSVI.update`, as :meth:`DPSVI.run` calls it; returns the
        new state and the released noisy sum's first coordinate in units of C."""
        before = self.first_weight(state)
        state, _ = self.svi.update(state, *batch, mask=mask, expected_batch_size=expected_batch_size)
        return state, (self.first_weight(state) - before) / self.scale


def _audited_svi(svi_module, cls, rng_key, c: _Common, lr: float, factor: float, N: int, init_batch) -> _AuditedSVI:
    """The audited DPSVI: the logistic model, a point-mass guide, SGD(lr), initialised on ``init_batch``."""
    import numpyro
    from numpyro.infer import Trace_ELBO

    svi = cls(_logistic_model, _delta_guide, numpyro.optim.SGD(lr), Trace_ELBO(),
              clipping_threshold=c.C, dp_scale=c.sigma, rng_suite=c.rng_suite, N=N)
    state0 = svi.init(c.rng_suite.fold_in(rng_key, _INIT_INDEX), *init_batch)
    return _AuditedSVI(svi, state0, svi_module.DPSVIState, rng_key, c.rng_suite, lr * factor * c.C)


def _scan_steps(step: Callable, state, num_steps: int):
    """``lax.scan`` of ``step(state, t)`` over the steps ``t = 0 .. T - 1``."""
    return jax.lax.scan(step, state, jnp.arange(num_steps, dtype=jnp.uint32))


# ---------------------------------------------------------------------------
# DPSVI under Poisson sampling: the canary added or removed
# ---------------------------------------------------------------------------


def dpsvi_projections(
    rng_key: jax.Array,
    num_runs: int,
    *,
    dp_scale: float,
    q: float,
    num_steps: int,
    clipping_threshold: float = 1.0,
    threat_model: str = "every_step",
    num_other_records: int = 7,
    dim: int = 3,
    canary_norm: float = 100.0,
    sampler: str = "bernoulli",
    svi_class: Optional[type] = None,
    rng_suite=d3p.random,
    runs_per_chunk: int = 8192,
    progress_bar: bool = False,
) -> Tuple[np.ndarray, np.ndarray]:
    """What the attacker reads from ``num_steps`` steps of :meth:`d3p.svi.DPSVI.update`
    under Poisson sampling, with and without the canary.

    The model is a Bayesian logistic regression with ``dim`` weights
    (``plate("data", N, subsample_size=B)``, ``N = num_other_records + 1``),
    the guide a point mass (``Delta``) at a parameter initialised to 0, the
    optimizer SGD with a learning rate so small that the parameters stay near
    0 (so the canary's gradient stays clipped to exactly ``C`` along
    ``-e_0``). ``D`` holds ``num_other_records`` fixed records (first feature
    0) and the canary (see :func:`gaussian_step_scores`); ``D'`` is ``D``
    without the canary (add/remove relation). Every step includes each record
    of the data set independently with probability ``q`` (Poisson sampling;
    ``mask`` marks the included records) and calls ``update`` with
    ``expected_batch_size = q N``, as :meth:`DPSVI.run` does.

    :param rng_key: a key of ``rng_suite``; run ``i`` uses ``fold_in(rng_key, i)``
        (the first ``num_runs`` runs use ``D``, the next ``D'``).
    :param int num_runs: runs per data set, ``>= 2``.
    :param float dp_scale: noise multiplier σ >= 0.
    :param float q: sampling probability in (0, 1].
    :param int num_steps: T >= 1.
    :param float clipping_threshold: C > 0.
    :param str threat_model: ``"every_step"``: the parameters after every
        step are seen, from which the released noisy gradient sums are read
        exactly; returned is their projection on the canary's direction in
        units of C, ``x_t`` (for the correct mechanism
        ``x_t ~ N(b_t, σ²)`` with ``b_t = 1`` if the canary was sampled in step
        t, else 0), shape ``(num_runs, T)``. ``"final_params"``: only the final
        parameters are seen; returned is their first coordinate in the same
        units (``= sum_t x_t``), shape ``(num_runs,)``.
    :param int num_other_records: records besides the canary (``>= 1`` for
        ``sampler="poisson_sampler"``).
    :param int dim: number of weights, ``>= 2``.
    :param float canary_norm: the canary's feature in units of C, ``> 2``.
    :param str sampler: ``"bernoulli"`` (default: the mask is
        ``rng_suite.uniform < q`` per record, Poisson sampling by definition)
        or ``"poisson_sampler"`` (:class:`d3p.minibatch.PoissonSampler`, so that
        the package's sampler is audited too; slower to compile).
    :param type svi_class: :class:`d3p.svi.DPSVI` (default, looked up at call
        time) or a subclass.
    :param rng_suite: the PRNG suite for the DPSVI noise and the sampling.
    :param int runs_per_chunk: runs vectorised in one call.
    :param bool progress_bar: show a tqdm bar over chunks.
    :return: ``(projections_in, projections_out)``, float64 arrays.
    """
    c = _check_common(
        num_runs, dp_scale, clipping_threshold, num_other_records, dim, canary_norm, runs_per_chunk, rng_suite
    )
    q, T, threat_model, sampler = _check_poisson(c, q, num_steps, threat_model, sampler)
    x, y = _canary_data(c)
    audited, expected = _poisson_audited_svi(rng_key, c, q, T, svi_class, (x, y))
    batch = _poisson_batch(x, y, q, sampler, c.rng_suite)
    one_run = _poisson_run(audited, batch, c.num_runs, T, expected, threat_model == "final_params")
    return _run_both(one_run, c, progress_bar, "audit: DPSVI")


def _check_poisson(c: _Common, q, num_steps, threat_model, sampler):
    """``q``, ``num_steps``, ``threat_model`` and ``sampler`` of :func:`dpsvi_projections`, checked."""
    q = _validate.probability("q", q)
    T = _validate.integer("num_steps", num_steps, minimum=1)
    threat_model = _validate.choice("threat_model", threat_model, THREAT_MODELS)
    sampler = _validate.choice("sampler", sampler, _SAMPLERS)
    if sampler == "poisson_sampler" and c.num_other_records < 1:
        raise ValueError(
            f"Expected num_other_records >= 1 with sampler='poisson_sampler', got {c.num_other_records}."
        )
    return q, T, threat_model, sampler


def _poisson_audited_svi(rng_key, c: _Common, q: float, T: int, svi_class, data) -> Tuple[_AuditedSVI, float]:
    """The audited DPSVI of :func:`dpsvi_projections` on ``data`` (``D``) and
    the expected batch size ``q N`` it normalises by."""
    from d3p import svi as svi_module

    cls = _svi_class(svi_module, svi_class)
    N = c.num_other_records + 1
    expected = q * N
    factor = N / expected  # DPSVI's public normalisation (clip_unscaled_observations=True)
    lr = _learning_rate(c, factor, 1.0 + c.sigma, T)
    return _audited_svi(svi_module, cls, rng_key, c, lr, factor, N, data), expected


def _poisson_batch(x, y, q: float, sampler: str, rng_suite) -> Callable:
    """``batch(key, present)``: a Poisson-sampled batch ``(x, y, mask)`` of ``D``
    (``present``) or of ``D'`` (the canary, the last record, never included)."""
    N = x.shape[0]
    if sampler == "bernoulli":

        def bernoulli_batch(key, present):
            mask = rng_suite.uniform(key, (N,)) < q
            return x, y, mask.at[-1].set(mask[-1] & present)

        return bernoulli_batch

    from d3p import minibatch

    sampler_in = minibatch.PoissonSampler(N, q, N)
    sampler_out = minibatch.PoissonSampler(N - 1, q, N - 1)

    def sampler_batch(key, present):
        key_in, key_out = rng_suite.split(key, 2)
        idx_in, m_in = sampler_in.sample(key_in, rng_suite)
        idx_out, m_out = sampler_out.sample(key_out, rng_suite)
        idx_out = jnp.concatenate([idx_out, jnp.array([N - 1], idx_out.dtype)])  # canary slot, padded
        m_out = jnp.concatenate([m_out, jnp.array([False])])
        idx = jnp.where(present, idx_in, idx_out)
        mask = jnp.where(present, m_in, m_out)
        return x[idx], y[idx], mask

    return sampler_batch


def _poisson_run(audited: _AuditedSVI, batch: Callable, num_runs: int, T: int, expected: float,
                 final_only: bool) -> Callable:
    """``one_run(i)`` of :func:`dpsvi_projections`: runs ``i < num_runs`` use ``D``."""
    w_init = audited.first_weight(audited.state0)

    def one_run(i):
        present = i < num_runs
        state, batch_key = audited.run_start(i)

        def step(state, t):
            xb, yb, mask = batch(audited.rng_suite.fold_in(batch_key, t), present)
            return audited.step(state, xb, yb, mask=mask, expected_batch_size=expected)

        state, xs = _scan_steps(step, state, T)
        if final_only:
            return (audited.first_weight(state) - w_init) / audited.scale
        return xs

    return one_run


def dpsvi_scores(
    rng_key: jax.Array,
    num_runs: int,
    *,
    dp_scale: float,
    q: float,
    num_steps: int,
    threat_model: str = "every_step",
    score_sigma: Optional[float] = None,
    **kwargs: Any,
) -> Tuple[np.ndarray, np.ndarray]:
    """Attack scores of ``num_steps`` DPSVI steps under Poisson sampling, with and without the canary.

    The set-up and the threat models are those of :func:`dpsvi_projections`.
    The score is

    - ``threat_model="every_step"``: :func:`subsampled_gaussian_log_ratio` of the
      projections with ``sigma = score_sigma`` (default: ``dp_scale``; if that
      is 0, the sum of the projections);
    - ``threat_model="final_params"``: the final parameter, rescaled.

    :param rng_key: a key of the PRNG suite.
    :param int num_runs: runs per data set.
    :param float dp_scale: σ.
    :param float q: sampling probability.
    :param int num_steps: T.
    :param str threat_model: ``"every_step"`` or ``"final_params"``.
    :param float score_sigma: σ assumed by the likelihood-ratio score.
    :param kwargs: further arguments of :func:`dpsvi_projections`.
    :return: ``(scores_in, scores_out)``, float64 arrays of ``num_runs`` each.
    """
    threat_model = _validate.choice("threat_model", threat_model, THREAT_MODELS)
    p_in, p_out = dpsvi_projections(
        rng_key, num_runs, dp_scale=dp_scale, q=q, num_steps=num_steps, threat_model=threat_model, **kwargs
    )
    if threat_model == "final_params":
        return p_in, p_out
    sigma = dp_scale if score_sigma is None else score_sigma
    return projection_scores(p_in, q, sigma), projection_scores(p_out, q, sigma)


# ---------------------------------------------------------------------------
# DPSVI with fixed-size batches: the extreme substitute pair
# ---------------------------------------------------------------------------


def dpsvi_fixed_size_projections(
    rng_key: jax.Array,
    num_runs: int,
    *,
    dp_scale: float,
    batch_size: int,
    num_records: int,
    num_steps: int,
    clipping_threshold: float = 1.0,
    dim: int = 3,
    canary_norm: float = 100.0,
    svi_class: Optional[type] = None,
    rng_suite=d3p.random,
    runs_per_chunk: int = 4096,
    progress_bar: bool = False,
) -> Tuple[np.ndarray, np.ndarray]:
    """What the attacker reads from ``num_steps`` steps of
    :meth:`d3p.svi.DPSVI.update` with fixed-size batches
    (:class:`d3p.minibatch.FixedSizeSampler`), on the extreme pair of
    neighbouring data sets of the substitute relation.

    ``D``: ``num_records`` copies of a record whose clipped gradient is
    ``C`` along the canary direction (a logistic regression example with a
    huge first feature and label 1); ``D'``: the same, except that record 0
    has label 0, so that its clipped gradient is ``C`` in the opposite
    direction. Every batch of ``D`` sums to ``B C`` along that direction; a
    batch of ``D'`` sums to ``(B - 2) C`` when record 0 is sampled
    (probability ``q = B / N``), else to ``B C``. Model, guide and
    optimizer are those of :func:`dpsvi_projections`; every step draws its
    batch with the package's fixed-size sampler and calls ``update`` as
    :meth:`DPSVI.run` does.

    Returned, per run and step, is ``z_t = (B - x_t) / 2`` with ``x_t`` the
    released noisy sum's projection in units of C: for the correct mechanism
    ``z_t ~ N(0, (σ/2)²)`` under ``D`` and ``(1 - q) N(0, (σ/2)²) + q N(1,
    (σ/2)²)`` under ``D'``, the add/remove pair at noise multiplier σ/2 that
    :func:`d3p.accounting.accounting_for` composes for this sampler. The
    first array belongs to ``D'`` ("in"), the second to ``D`` ("out").

    :param rng_key: a key of ``rng_suite``; run ``i`` uses ``fold_in(rng_key, i)``.
    :param int num_runs: runs per data set, ``>= 2``.
    :param float dp_scale: noise multiplier σ >= 0.
    :param int batch_size: B, in ``[1, num_records]``.
    :param int num_records: N >= 2.
    :param int num_steps: T >= 1.
    :param float clipping_threshold: C > 0.
    :param int dim: number of weights, ``>= 2``.
    :param float canary_norm: the first feature in units of C, ``> 2``.
    :param type svi_class: :class:`d3p.svi.DPSVI` (default) or a subclass.
    :param rng_suite: the PRNG suite for the noise and the sampling.
    :param int runs_per_chunk: runs vectorised in one call.
    :param bool progress_bar: show a tqdm bar over chunks.
    :return: ``(z_in, z_out)``, float64 arrays of shape ``(num_runs, T)``.
    """
    from d3p import minibatch, svi as svi_module

    c = _check_common(num_runs, dp_scale, clipping_threshold, 0, dim, canary_norm, runs_per_chunk, rng_suite)
    N = _validate.integer("num_records", num_records, minimum=2)
    B = _validate.integer("batch_size", batch_size, minimum=1)
    if B > N:
        raise ValueError(f"Expected batch_size <= num_records={N}, got batch_size={B}.")
    T = _validate.integer("num_steps", num_steps, minimum=1)
    cls = _svi_class(svi_module, svi_class)

    factor = N / B  # DPSVI's public normalisation (clip_unscaled_observations=True)
    x = np.zeros((N, c.dim), np.float32)
    x[:, 0] = c.canary_norm * c.C
    x = jnp.asarray(x)
    y_d = jnp.ones((N,), jnp.float32)
    lr = _learning_rate(c, factor, B + c.sigma, T)
    audited = _audited_svi(svi_module, cls, rng_key, c, lr, factor, N, (x[:B], y_d[:B]))
    one_run = _fixed_size_run(audited, minibatch.FixedSizeSampler(N, B), x, y_d, c.num_runs, B, T)
    return _run_both(one_run, c, progress_bar, "audit: DPSVI, fixed-size batches")


def _fixed_size_run(audited: _AuditedSVI, sampler, x, y_d, num_runs: int, B: int, T: int) -> Callable:
    """``one_run(i)`` of :func:`dpsvi_fixed_size_projections`: runs ``i < num_runs`` use ``D'``."""
    y_alt = y_d.at[0].set(0.0)  # D': record 0 mirrored

    def one_run(i):
        neighbour = i < num_runs
        y = jnp.where(neighbour, y_alt, y_d)
        state, batch_key = audited.run_start(i)

        def step(state, t):
            idx, _ = sampler.sample(audited.rng_suite.fold_in(batch_key, t), audited.rng_suite)
            state, x_t = audited.step(state, x[idx], y[idx], expected_batch_size=B)
            return state, (B - x_t) / 2

        return _scan_steps(step, state, T)[1]

    return one_run
