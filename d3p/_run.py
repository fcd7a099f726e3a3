"""The machinery of :meth:`d3p.svi.DPSVI.run`: batch gathering, the compiled
chunked ``lax.scan`` and the progress bar."""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import tqdm
from jax import lax


class _RunPlan(NamedTuple):
    """What :meth:`DPSVI.run` samples with and accounts for: the sampler, its
    accounting (:func:`d3p.accounting.accounting_for`), the ε tracker of the
    run and the target δ."""

    sampler: Any
    accounting: Any
    tracker: Any
    target_delta: float


def _batch_gatherer(sampler, rng_suite, batch_key, rebuild, per_record):
    """``gather(data, i) -> (args, kwargs, mask)``: batch ``i`` of :meth:`DPSVI.run`,
    the records ``sampler`` picks with ``fold_in(batch_key, i)``."""

    def gather(data, i):
        indices, mask = sampler.sample(rng_suite.fold_in(batch_key, i), rng_suite)
        batch = [jnp.take(x, indices, axis=0) if p else None for x, p in zip(data, per_record)]
        a, k = rebuild(batch)
        return a, k, mask

    return gather


def _compiled_chunks(update, gather, expected_batch_size, forward_mode):
    """``run_chunk(svi_state, start, data, length) -> (svi_state, losses)``:
    ``length`` steps of ``update`` from step ``start`` on, in one jitted
    ``lax.scan`` (one compilation per ``length``)."""

    def body_fn(svi_state, i, data):
        a, k, mask = gather(data, i)
        return update(
            svi_state, *a, mask=mask, expected_batch_size=expected_batch_size,
            forward_mode_differentiation=forward_mode, **k,
        )

    @functools.partial(jax.jit, static_argnums=3)
    def run_chunk(svi_state, start, data, length):
        steps = start + jnp.arange(length, dtype=jnp.uint32)
        return lax.scan(lambda s, i: body_fn(s, i, data), svi_state, steps)

    return run_chunk


def _run_with_progress_bar(run_chunk, svi_state, records, num_steps, plan):
    """All steps of :meth:`DPSVI.run` with a tqdm bar showing the loss and ε.

    Steps run in compiled chunks of about 5% of the run (``lax.scan``, as
    without the bar; at most two chunk lengths are compiled), the bar
    advancing after each: one Python dispatch per step would cost more than a
    small model's step.
    """
    chunk = min(max(-(-num_steps // 20), 1), _MAX_BAR_CHUNK)
    losses, done = [], 0
    with tqdm.tqdm(total=num_steps) as bar:
        while done < num_steps:
            length = min(chunk, num_steps - done)
            svi_state, chunk_losses = run_chunk(svi_state, jnp.uint32(done), records, length)
            losses.append(chunk_losses)
            done += length
            recent = np.asarray(jax.device_get(chunk_losses))
            recent = recent[recent == recent]
            avg = float(recent.mean()) if recent.size else float("nan")
            bar.set_postfix_str(
                f"avg. loss: {avg:.4g}, ε ≤ {plan.tracker.epsilon(done):.3g} (δ={plan.target_delta:.2g})",
                refresh=False,
            )
            bar.update(length)
    return svi_state, jnp.concatenate(losses)


#: Most steps run between two updates of ``run``'s progress bar.
_MAX_BAR_CHUNK = 1000


