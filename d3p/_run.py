"""The machinery of :meth:`d3p.svi.DPSVI.run`: batch gathering, the compiled
chunked ``lax.scan`` and the progress bar."""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import tqdm
from jax import lax

from d3p import minibatch


class _RunPlan(NamedTuple):
    """What :meth:`DPSVI.run` samples with and accounts for: the sampler, its
    accounting (:func:`d3p.accounting.accounting_for`), the ε tracker of the
    run, the target δ and the noise multiplier σ (``dp_scale``, or calibrated
    for ``run(epsilon=...)``)."""

    sampler: Any
    accounting: Any
    tracker: Any
    target_delta: float
    sigma: float = None


def _batch_gatherer(sampler, rng_suite, treedef):
    """``gather(batch_key, data, i) -> (args, kwargs, mask, ok)``: batch ``i`` of
    :meth:`DPSVI.run`, the records ``sampler`` picks with ``fold_in(batch_key, i)``
    from the per-record leaves ``data`` of the arguments of structure ``treedef``.

    ``ok`` is False if the sampler's loop reached its bound (a broken random
    source, see :class:`d3p.minibatch.SamplingError`); the batch is then empty
    (mask all False). The caller raises after the compiled steps: checking in
    the step itself would cost a GPU a host round trip per step.
    """

    def gather(batch_key, data, i):
        # jitted once per sampler and suite: the eager first batch compiles no loop again
        indices, mask, ok = minibatch._sample_batch_jit(sampler, batch_key, i, rng_suite)
        a, k = jax.tree.unflatten(treedef, [jnp.take(x, indices, axis=0) for x in data])
        return a, k, mask, ok

    return gather


def _compiled_chunks(update, gather, expected_batch_size, forward_mode):
    """``run_chunk(svi_state, batch_key, start, data, length) -> (svi_state, losses, ok)``:
    ``length`` steps of ``update`` from step ``start`` on, in one jitted
    ``lax.scan`` (one compilation per ``length`` and data shapes; the keys and
    the data are arguments, so the compiled program serves every run); ``ok``:
    whether every batch was drawn (see :func:`_batch_gatherer`)."""

    def body_fn(carry, batch_key, i, data):
        svi_state, ok = carry
        a, k, mask, batch_ok = gather(batch_key, data, i)
        svi_state, loss = update(
            svi_state, *a, mask=mask, expected_batch_size=expected_batch_size,
            forward_mode_differentiation=forward_mode, **k,
        )
        return (svi_state, ok & batch_ok), loss

    @functools.partial(jax.jit, static_argnums=4)
    def run_chunk(svi_state, batch_key, start, data, length):
        steps = start + jnp.arange(length, dtype=jnp.uint32)
        (svi_state, ok), losses = lax.scan(
            lambda c, i: body_fn(c, batch_key, i, data), (svi_state, jnp.bool_(True)), steps)
        return svi_state, losses, ok

    return run_chunk


class _RunCache:
    """The compiled parts of :meth:`DPSVI.run` of one DPSVI, kept between runs
    with the same sampler, data structure and settings, so that a second run
    starts without compiling again."""

    def __init__(self):
        self._chunks = {}

    def steps(self, update, sampler, rng_suite, treedef, forward_mode, layout=None):
        """``(gather, run_chunk)`` of :func:`_batch_gatherer` and
        :func:`_compiled_chunks` for these settings (cached); ``layout``:
        anything else the steps depend on (the device mesh)."""
        key = (update.__name__, sampler, rng_suite, treedef, forward_mode, layout)
        if key not in self._chunks:
            gather = _batch_gatherer(sampler, rng_suite, treedef)
            self._chunks[key] = (
                gather, _compiled_chunks(update, gather, sampler.expected_batch_size, forward_mode))
        return self._chunks[key]


def _require_batches(ok, sampler, values):
    """``values`` if every batch was drawn; otherwise raise
    :class:`d3p.minibatch.SamplingError`, or, where the run itself is traced
    (``run`` under ``jit`` or ``vmap``), make the traced computation fail at
    run time."""
    return minibatch._require(ok, values, minibatch._failure_message(repr(sampler)))


def _run_with_progress_bar(run_chunk, svi_state, records, num_steps, plan, start=0):
    """All steps of :meth:`DPSVI.run` with a tqdm bar showing the loss and ε.

    Steps run in compiled chunks of about 5% of the run (``lax.scan``, as
    without the bar; at most two chunk lengths are compiled), the bar
    advancing after each: one Python dispatch per step would cost more than a
    small model's step. Step ``i`` of the run has index ``start + i`` in the
    stream of batch keys.
    """
    chunk = min(max(-(-num_steps // 20), 1), _MAX_BAR_CHUNK)
    losses, done = [], 0
    with tqdm.tqdm(total=num_steps) as bar:
        while done < num_steps:
            length = min(chunk, num_steps - done)
            svi_state, chunk_losses = run_chunk(svi_state, jnp.uint32(start + done), records, length)
            losses.append(chunk_losses)
            done += length
            recent = np.asarray(jax.device_get(chunk_losses))
            recent = recent[recent == recent]
            avg = float(recent.mean()) if recent.size else float("nan")
            bar.set_postfix_str(
                f"avg. loss (not private): {avg:.4g}, ε ≤ {plan.tracker.epsilon(done):.3g} (δ={plan.target_delta:.2g})",
                refresh=False,
            )
            bar.update(length)
    return svi_state, jnp.concatenate(losses)


#: Most steps run between two updates of ``run``'s progress bar.
_MAX_BAR_CHUNK = 1000


