"""A run of :class:`d3p.svi.DPSVI` (:meth:`~d3p.svi.DPSVI.run`): its wiring
(:func:`run`: the plan, the initial state or checkpoint, the ledger, the
steps, the result) and its machinery (batch gathering, the compiled chunks
of steps, the progress bar). What the run samples with and accounts for
is :mod:`d3p._run_plan`."""

import contextlib
import functools
import logging
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import tqdm
from jax import lax

from d3p import _adaptive, _init_state, _model_facts, _private_step, _run_plan, _sharding, _validate, minibatch
from d3p._checkpoint import Checkpoint, continue_from
from d3p._public_init import public_records
from d3p._records import _records
from d3p._state import check_state
from d3p.ledger import PrivacyLedger, key_fingerprint
from d3p.random._common import on_the_host, unstacked


def _batch_gatherer(sampler, rng_suite, treedef):
    """``gather(batch_key, data, i) -> (args, kwargs, mask, ok)``: batch ``i`` of
    :meth:`DPSVI.run`, the records ``sampler`` picks with ``fold_in(batch_key, i)``
    from the per-record leaves ``data`` of the arguments of structure ``treedef``.

    ``table``: a Poisson sampler's count table as arrays (see
    :func:`batch_arguments`), else None.

    ``ok`` is False if the sampler's loop reached its bound (a broken random
    source, see :class:`d3p.minibatch.SamplingError`); the batch is then empty
    (mask all False). The caller raises after the compiled steps: checking in
    the step itself would cost a GPU a host round trip per step.
    """

    def gather(batch_key, data, i, table=None):
        # jitted once per sampler and suite: the eager first batch compiles no loop again
        indices, mask, ok = minibatch._sample_batch_jit(sampler, batch_key, i, rng_suite, table)
        a, k = jax.tree.unflatten(treedef, [jnp.take(x, indices, axis=0) for x in data])
        return a, k, mask, ok

    return gather


def _compiled_chunks(update, gather, expected_batch_size, forward_mode, get_params, fold_in, steps_traced=False):
    """``run_chunk(svi_state, average, keys, start, average_from, data, length,
    sigma, clip, run_steps, batch) -> (svi_state, average, losses, ok)``: ``length`` steps of
    ``update`` from step ``start`` on, in one jitted loop. The keys, the data,
    ``average_from``, ``sigma`` and ``clip`` are arguments, so the compiled
    program serves every run. With ``steps_traced`` (:func:`_steps_traced`:
    on CPU) ``length`` is an argument too, at most :data:`_CHUNK_STEPS`: one
    program for every number of steps, and ``losses`` has
    :data:`_CHUNK_STEPS` entries, the first ``length`` of them the steps';
    otherwise the loop is a ``lax.scan`` of ``length`` steps, one program per
    ``length`` (a loop whose trip count is a constant of the program spares
    a GPU the copy of its predicate to the host at every step).

    ``sigma``: the noise multiplier where the steps take it as an argument
    (:func:`d3p._private_step.traced_sigma`: a run at another ε compiles
    nothing), else None and σ is a constant of the program; ``clip`` likewise the clipping threshold
    (:func:`d3p._private_step.traced_threshold`: a run at another ``C``
    compiles nothing); ``batch``: a Poisson sampler's count table and its
    expected batch size (:func:`batch_arguments`: a run at another ``q`` with
    the same padded batch compiles nothing), else None and the sampler's
    are constants. ``keys``: ``(batch_key, step_key)``; step ``i`` draws its batch
    with ``fold_in(batch_key, i)`` and its noise and Monte Carlo draws from
    ``fold_in(step_key, i)`` (:func:`step_keys`), never from the state's
    key, so that two releases share noise only if they share the run's key
    and a step, which the ledger and a checkpoint refuse. ``average``:
    ``(mean, count)``, the running mean of the optimizer's parameters after
    each step ``>= average_from`` and their number (:func:`_averaged`);
    ``ok``: whether every batch was drawn (see :func:`_batch_gatherer`)."""
    svi = update.__self__

    def body_fn(carry, keys, i, average_from, data, batch=None):
        svi_state, average, ok = carry
        batch_key, step_key = keys
        table, batch_size = (None, expected_batch_size) if batch is None else batch
        a, k, mask, batch_ok = gather(batch_key, data, i, table)
        svi_state = svi_state._replace(rng_key=fold_in(step_key, i))
        svi_state, loss = update(
            svi_state, *a, mask=mask, expected_batch_size=batch_size,
            forward_mode_differentiation=forward_mode, **k,
        )
        average = _averaged(average, get_params(svi_state.optim_state), i >= average_from)
        return (svi_state, average, ok & batch_ok), loss

    if steps_traced:
        return jax.jit(functools.partial(_traced_length_chunk, svi, body_fn))

    @functools.partial(jax.jit, static_argnums=6)
    def run_chunk(svi_state, average, keys, start, average_from, data, length, sigma=None, clip=None,
                  run_steps=None, batch=None):
        steps = start + jnp.arange(length, dtype=jnp.uint32)
        with _step_arguments(svi, sigma, clip, run_steps):
            (svi_state, average, ok), losses = lax.scan(
                lambda c, i: body_fn(c, keys, i, average_from, data, batch), (svi_state, average, jnp.bool_(True)),
                steps)
        return svi_state, average, losses, ok

    return run_chunk


#: The most steps of one call of ``run``'s compiled chunk where the number of
#: steps is an argument (:func:`_compiled_chunks`); also the most steps between
#: two updates of the progress bar.
_CHUNK_STEPS = 1000


def _traced_length_chunk(svi, body_fn, svi_state, average, keys, start, average_from, data, length,
                         sigma=None, clip=None, run_steps=None, batch=None):
    """:func:`_compiled_chunks`' chunk whose number of steps ``length`` (a
    ``uint32`` in ``[1, _CHUNK_STEPS]``) is an argument: a ``fori_loop`` whose
    trip count the program reads, the losses written into a buffer of
    :data:`_CHUNK_STEPS` entries (of the default float type while the loop is
    traced, then of the loss's own, which is known only then: both hold every
    loss exactly)."""
    buffer_dtype, loss_dtypes = jnp.result_type(float), []

    def body(j, carry):
        carry, losses = carry
        carry, loss = body_fn(carry, keys, start + j, average_from, data, batch)
        loss_dtypes.append(loss.dtype)
        return carry, losses.at[j].set(loss.astype(buffer_dtype))

    with _step_arguments(svi, sigma, clip, run_steps):
        (svi_state, average, ok), losses = lax.fori_loop(
            jnp.uint32(0), length, body,
            ((svi_state, average, jnp.bool_(True)), jnp.full((_CHUNK_STEPS,), jnp.nan, buffer_dtype)))
    return svi_state, average, losses.astype(loss_dtypes[0]), ok


@contextlib.contextmanager
def _step_arguments(svi, sigma, clip, run_steps=None):
    """σ and C of the chunk's arguments (or None: constants of the step), and
    the arguments of d3p's step-size schedule (:class:`d3p._run_plan.RunStepSize`;
    None: its constants), read by the step while it is traced, and reset after."""
    svi._run_sigma, svi._run_clip = sigma, clip
    step_size = _private_step.step_schedule_of(svi)
    if step_size is not None:
        step_size.run_steps = run_steps
    try:
        yield
    finally:
        svi._run_sigma = svi._run_clip = None
        if step_size is not None:
            step_size.run_steps = None


def _averaged(average, params, include):
    """``(mean, count)`` with ``params`` added to the running mean if ``include``
    (iterate averaging: post-processing of the released parameters)."""
    mean, count = average
    count = count + include.astype(count.dtype)
    weight = jnp.where(include, 1.0 / jnp.maximum(count, 1), 0.0)
    mean = jax.tree.map(lambda m, p: m + (p - m) * weight.astype(m.dtype), mean, params)
    return mean, count


class _RunCache:
    """The compiled parts of :meth:`DPSVI.run` of one DPSVI, kept between runs
    with the same sampler, data structure and settings, so that a second run
    starts without compiling again."""

    def __init__(self):
        self._chunks, self._settings = {}, {}

    def steps(self, update, sampler, rng_suite, treedef, forward_mode, layout=None, steps_traced=False):
        """``(gather, run_chunk, compiled)`` of :func:`_batch_gatherer` and
        :func:`_compiled_chunks` for these settings (cached; ``compiled``: if
        they were asked for before); ``layout``: anything else the steps
        depend on (the device mesh, σ where it is a constant);
        ``steps_traced``: whether the chunk takes its number of steps as an
        argument (:func:`_steps_traced`). The settings are those of
        :data:`d3p._private_step.TRACED_SETTINGS`, told apart by identity (the entry keeps
        them alive, so no other object takes their ids), and the sampler's
        shapes (:func:`_program_sampler`)."""
        svi = update.__self__
        settings = _private_step.traced_settings(svi)
        key = (update.__name__, tuple(map(id, settings)), _program_sampler(sampler), rng_suite, treedef,
               forward_mode, layout, steps_traced)
        compiled = key in self._chunks
        if not compiled:
            gather = _batch_gatherer(sampler, rng_suite, treedef)
            self._chunks[key] = (
                gather, _compiled_chunks(update, gather, sampler.expected_batch_size, forward_mode,
                                         svi.optim.get_params, rng_suite.fold_in, steps_traced))
            self._settings[key] = settings
        return self._chunks[key] + (compiled,)


def _program_sampler(sampler):
    """What of ``sampler`` :func:`_compiled_chunks`' program depends on: a
    Poisson sampler's N, padded size and overflow handling (its ``q`` is an
    argument, :func:`batch_arguments`), else the sampler itself."""
    if isinstance(sampler, minibatch.PoissonSampler):
        return (type(sampler), sampler.num_records, sampler.max_batch_size, sampler.handle_oversized_batch)
    return sampler


def batch_arguments(sampler):
    """The ``batch`` argument of :func:`_compiled_chunks`' program: for a
    Poisson sampler its count table (``_count_table``, public: from N, q and the
    padded size) and its expected batch size ``q N`` in JAX's default float
    dtype, by which the step normalises the noisy sum (in float32 the
    quotient is then within a unit in the last place of the one that a
    program holding ``q N`` as a constant rounds once); else None."""
    if not isinstance(sampler, minibatch.PoissonSampler):
        return None
    return sampler._count_table(), np.asarray(sampler.expected_batch_size, jnp.result_type(float))


def _require_batches(ok, sampler, values):
    """``values`` if every batch was drawn; otherwise raise
    :class:`d3p.minibatch.SamplingError`, or, where the run itself is traced
    (``run`` under ``jit`` or ``vmap``), make the traced computation fail at
    run time."""
    return minibatch._require(ok, values, minibatch._failure_message(repr(sampler)))


def _epsilon_text(svi, plan, N, start_step, fingerprint, ledger):
    """``text(done)``: the ε the progress bar shows after ``done`` steps: this
    run's, and with a ledger that holds earlier releases (a resumed training)
    the total the ledger composes with them, at the same δ."""
    delta = plan.target_delta
    if ledger is None or not len(ledger):
        return lambda done: f"ε ≤ {plan.tracker.epsilon(done):.3g} (δ={delta:.2g})"

    def text(done):
        part = _run_plan.release(svi, plan, N, done, start_step, fingerprint)
        total = ledger._epsilon(tuple(ledger.releases) + (part,), delta)
        return f"ε ≤ {total:.3g} in total, {plan.tracker.epsilon(done):.3g} this run (δ={delta:.2g})"

    return text


def _run_in_chunks(run_chunk, svi_state, average, records, num_steps, start=0, epsilon_text=None,
                   steps_traced=False):
    """All steps of :meth:`DPSVI.run`: ``run_chunk(svi_state, average, start,
    data, length)`` (:func:`_compiled_chunks`), all steps in one chunk
    without a bar (in chunks of :data:`_CHUNK_STEPS` where ``steps_traced``);
    step ``i`` of the run has index ``start + i`` in
    the stream of batch keys. With ``epsilon_text`` (:func:`_epsilon_text`), a
    tqdm bar showing the loss and ε advances after each chunk of about 5% of
    the run: one Python dispatch per step would cost more than a small
    model's step. Returns ``(svi_state, average, losses)``."""
    bar = None
    chunk = min(num_steps, _CHUNK_STEPS) if steps_traced else num_steps
    if epsilon_text is not None:
        chunk = min(max(-(-num_steps // 20), 1), _CHUNK_STEPS)
        bar = tqdm.tqdm(total=num_steps)
    losses, done = [], 0
    try:
        while done < num_steps:
            length = min(chunk, num_steps - done)
            svi_state, average, chunk_losses = run_chunk(svi_state, average, np.uint32(start + done), records,
                                                         np.uint32(length) if steps_traced else length)
            if steps_traced and length < chunk_losses.shape[0]:
                chunk_losses = _first(chunk_losses, length)
            losses.append(chunk_losses)
            done += length
            if bar is not None:
                recent = np.asarray(jax.device_get(chunk_losses))
                recent = recent[recent == recent]
                avg = float(recent.mean()) if recent.size else float("nan")
                bar.set_postfix_str(f"avg. loss (not private): {avg:.4g}, {epsilon_text(done)}", refresh=False)
                bar.update(length)
    finally:
        if bar is not None:
            bar.close()
    if len(losses) > 1:
        losses = [_joined(losses)]
    return svi_state, average, losses[0]


def _first(values, length):
    """``values[:length]``, sliced on the host where ``on_the_host`` allows:
    not traced (``run`` inside a user's ``jit`` or ``vmap``), not committed to
    a device or spread over a mesh's devices (kept there, as the steps left them)."""
    return jax.device_put(np.asarray(values)[:length]) if on_the_host(values) else values[:length]


def _joined(chunks):
    """The chunks' losses concatenated, on the host where ``on_the_host`` allows."""
    if all(on_the_host(chunk) for chunk in chunks):
        return jax.device_put(np.concatenate([np.asarray(chunk) for chunk in chunks]))
    return jnp.concatenate(chunks)


# ---------------------------------------------------------------- the run


def run(svi, rng_key, num_steps, args, kwargs, *, batch_size, q, sampling, max_batch_size, target_delta,
        accountant, relation, progress_bar, stable_update, forward_mode, init_state, init_params, init_data,
        epsilon, delta, ledger, start_step, average=None):
    """:meth:`DPSVI.run` of ``svi``, its arguments validated and resolved:
    the plan (sampler, accounting, σ), the ledger's check, then the steps at
    the plan's σ, which :func:`_run_steps` takes."""
    # the number of steps chosen from the noise (public facts), for ε asked with d3p's optimizer
    from_noise = num_steps is None and epsilon is not None and svi.optim_chosen and init_state is None
    num_steps, average, said = _run_plan.chosen_run(svi, num_steps, average)
    num_steps = _validate.integer("num_steps", num_steps, minimum=1)
    svi.clipping_threshold = _private_step.checked_threshold(svi)   # it may have been set since the last run
    average = _validate.number("average", average, low=0.0, high=1.0, high_open=True)
    records, treedef, N = _records(args, kwargs, what="data")
    if delta is not None:
        if target_delta is not None:
            raise ValueError(f"Expected one of delta and target_delta, got delta={delta!r} and "
                             f"target_delta={target_delta!r}.")
        target_delta = delta
    checkpoint = init_state if isinstance(init_state, Checkpoint) else None
    if checkpoint is not None:
        ledger = checkpoint.ledger if ledger is None else ledger
        start_step = checkpoint.step if start_step is None else start_step
    if ledger is not None and not isinstance(ledger, PrivacyLedger):
        raise TypeError(f"Expected ledger to be a d3p.ledger.PrivacyLedger, got {type(ledger).__name__}.")
    plan_of = functools.partial(_run_plan.run_plan, svi, N, batch_size=batch_size, q=q, sampling=sampling,
                                max_batch_size=max_batch_size, target_delta=target_delta, accountant=accountant,
                                relation=relation, epsilon=epsilon)
    plan = plan_of(num_steps, warn=not from_noise)
    _sharding.check_same_in_every_process("rng_key", rng_key)
    init_key, batch_key, step_key = step_keys(svi.rng_suite, rng_key)
    early_state = None
    if from_noise:   # the state first: the noise ratio needs the number of parameters
        gather = _batch_gatherer(plan.sampler, svi.rng_suite, treedef)
        early_state = _initial_state(svi, None, None, init_key, _abstract_batch(gather, batch_key, records),
                                     treedef, init_params, init_data)
        num_steps, said = _steps_for_the_noise(svi, plan, early_state, said)
        plan = plan_of(num_steps)
    given = svi.dp_scale
    svi.dp_scale = plan.sigma   # for this run (its steps take σ as an argument or a constant); restored below
    try:
        for message in said:   # what was chosen: constants and N, public
            _say(message, progress_bar)
        if batch_size is None and q is None:
            _say(_run_plan.describe_choice(plan.sampler), progress_bar)
        fingerprint = key_fingerprint(batch_key) if ledger is not None or checkpoint is not None else None
        if start_step is None:
            start_step = ledger.steps_taken(fingerprint) if ledger is not None else 0
        start_step = _validate.integer("start_step", start_step, minimum=0, maximum=2**32 - num_steps)
        release = None
        if fingerprint is not None:   # refused here, before any step and data
            release = _run_plan.release(svi, plan, N, num_steps, start_step, fingerprint)
        if ledger is not None:   # if it would pass the budget or repeat the key's steps
            ledger.check(release)
        if checkpoint is not None:   # if it would repeat an earlier continuation's key and steps
            checkpoint = continue_from(checkpoint, release)
        # with a mesh: the data set whole on every device, each taking its shard of every batch
        records, batch_key, step_key = _private_step.replicated(svi, records, batch_key, step_key)
        update = svi.stable_update if stable_update else svi.update
        traced, clip_traced = _private_step.traced_sigma(svi, plan.sigma), _private_step.traced_threshold(svi)
        constants = (None if traced else plan.sigma, None if clip_traced else svi.clipping_threshold)
        steps_traced = _steps_traced(svi)
        gather, run_chunk, compiled = svi._run_cache.steps(update, plan.sampler, svi.rng_suite, treedef, forward_mode,
                                                           (_run_layout(svi),) + constants, steps_traced)
        if not compiled:
            _say("d3p: compiling the private step (once: later runs with the same data shapes and batch size "
                 "reuse it, " + ("with any number of steps, " if steps_traced else "with the same number of steps, ")
                 + "at any ε" + (" and clipping threshold)" if clip_traced else ")"), progress_bar)
        # the steps' warning is given while they are traced: a later run with another σ is not traced again
        _private_step.warn_if_all_noise(svi, plan.sampler.expected_batch_size, stacklevel=3, sigma=plan.sigma)
        svi_state = early_state if early_state is not None else _initial_state(
            svi, init_state, checkpoint, init_key, _abstract_batch(gather, batch_key, records), treedef,
            init_params, init_data)
        svi_state = _checked_initial_state(svi, svi_state, treedef, records, N)
        if svi.optim_chosen:   # its step size from the parameters' number (public)
            step_size = _private_step.step_schedule_of(svi).fit(svi.optim.get_params(svi_state.optim_state))
            _say(_run_plan.describe_optimizer(step_size, average, init_state is None), progress_bar)
        if svi.clipping_chosen and svi.adaptive_clipping is not None:   # its quantile from the noise (public)
            _say(_describe_clipping(svi, svi_state, plan), progress_bar)

        average_from = np.uint32(start_step + _averaging_start(average, num_steps))

        params = svi.optim.get_params(svi_state.optim_state)
        sigma = _private_step.sigma_value(plan.sigma, params) if traced else None
        clip = _private_step.threshold_value(svi.clipping_threshold, params) if clip_traced else None
        if clip_traced:   # checked at every run: the steps, and the check within them, are traced once
            _private_step.check_threshold_fits(svi.clipping_threshold, clip.dtype, plan.sampler.max_batch_size)

        # d3p's own step sizes take their settings as arguments (the chosen one decays over this run's
        # steps from a fresh state: any number of steps; a twin's its step size and steps)
        schedule = _private_step.step_schedule_of(svi)
        decay_over = None if schedule is None else schedule.arguments(num_steps, fresh=init_state is None)

        batch = batch_arguments(plan.sampler)   # q an argument too

        def run_steps(svi_state, average, start, data, length):
            svi_state, average, losses, ok = run_chunk(svi_state, average, (batch_key, step_key), start,
                                                       average_from, data, length, sigma, clip, decay_over, batch)
            return _require_batches(ok, plan.sampler, (svi_state, average, losses))

        mean = (params, jax.device_put(np.zeros((), np.int32)))
        epsilon_text = _epsilon_text(svi, plan, N, start_step, fingerprint, ledger) if progress_bar else None
        svi_state, mean, losses = _run_in_chunks(run_steps, svi_state, mean, records, num_steps, start_step,
                                                 epsilon_text, steps_traced)
        params = svi.constrain_fn(mean[0]) if average else None
        result = _run_plan.run_result(svi, svi_state, losses, plan, N, num_steps, start_step, params=params,
                                      averaged_steps=int(mean[1]) if average else 0)
        if ledger is not None:
            ledger.record(release)
            result.total_epsilon = ledger.epsilon(result.delta) if result.delta < 1 else math.inf
        return result
    finally:
        svi.dp_scale = given


def _abstract_batch(gather, batch_key, records):
    """``batch()``: the shapes of the first batch that ``gather`` draws, when needed."""
    return lambda: jax.eval_shape(gather, batch_key, records, 0)[:2]


def _steps_for_the_noise(svi, plan, svi_state, said):
    """``(num_steps, said)``: :func:`d3p._run_plan.steps_for_the_noise` for
    ``plan`` (σ calibrated for :data:`d3p._run_plan.CHOSEN_NUM_STEPS`) and the
    parameters of ``svi_state``; ``said`` with its message where it chose fewer."""
    num_params = _private_step.num_params(svi, svi_state)
    rho = _adaptive.noise_ratio(plan.sigma, num_params, plan.sampler.expected_batch_size)
    step_size = _run_plan.chosen_step_size(num_params)
    num_steps = _run_plan.steps_for_the_noise(rho, step_size)
    if num_steps != _run_plan.CHOSEN_NUM_STEPS:
        said = [_run_plan.describe_steps_for_the_noise(num_steps, rho, step_size)]
    return num_steps, said


def _describe_clipping(svi, svi_state, plan) -> str:
    """What ``run`` says of the adaptive clipping it chose: the quantile for
    this run's σ, number of parameters and expected batch size."""
    args = (plan.sigma, _private_step.num_params(svi, svi_state), plan.sampler.expected_batch_size)
    return _adaptive.describe_chosen(svi.adaptive_clipping, _adaptive.target_quantile(svi.adaptive_clipping, *args),
                                     _adaptive.noise_ratio(*args))


def step_keys(rng_suite, rng_key):
    """``(init_key, batch_key, step_key)`` of a run with ``rng_key``: the
    initial state's key, the root of the batches' keys and the root of the
    steps' own keys (noise and Monte Carlo draws; ``fold_in(init_key, 1)``,
    independent of the keys that ``split`` gives)."""
    init_key, batch_key = unstacked(rng_suite.split(rng_key, 2))
    return init_key, batch_key, rng_suite.fold_in(init_key, 1)


def _say(message: str, progress_bar: bool) -> None:
    """``message`` to d3p's logger, and on the terminal beside the progress bar."""
    logging.getLogger("d3p").info(message)
    if progress_bar:
        tqdm.tqdm.write(message, file=sys.stderr)


def _averaging_start(average: float, num_steps: int) -> int:
    """The index, within a run of ``num_steps``, of the first step averaged:
    the last ``ceil(average * num_steps)`` steps (none for 0)."""
    return num_steps - math.ceil(average * num_steps) if average else num_steps


def _steps_traced(svi) -> bool:
    """Whether ``run``'s compiled chunk takes its number of steps as an
    argument (:func:`_compiled_chunks`): where its steps run on CPU (the
    devices of ``svi``'s mesh, else JAX's default device), which reads a
    loop's trip count for free. On an accelerator the trip count stays a
    constant of the program, as ``lax.scan``'s: a loop that reads it would
    copy its predicate to the host at every step."""
    if svi.mesh is not None:
        return svi.mesh.devices.flat[0].platform == "cpu"
    device = jax.config.jax_default_device
    if device is None:
        return jax.default_backend() == "cpu"
    return (device if isinstance(device, str) else device.platform) == "cpu"


def _run_layout(svi):
    """What the compiled steps of :meth:`DPSVI.run` depend on beyond their
    arguments: the batch layout and the mesh in context."""
    return _private_step.batch_layout(svi), jax.sharding.get_abstract_mesh()


def _initial_state(svi, init_state, checkpoint, init_key, batch, treedef, init_params, init_data):
    """The state the run starts from: ``init_state``, or one initialised from
    public information (the shapes of the abstract batch that ``batch()``
    gives, or ``init_data``), filled with a ``checkpoint``'s arrays if there is one."""
    if init_state is not None and checkpoint is None:
        if init_data is not None:
            raise ValueError("Expected init_data only without init_state: the state is already initialised.")
        return init_state
    if checkpoint is not None and (init_data is not None or init_params is not None):
        raise ValueError("Expected neither init_data nor init_params with a checkpoint: it holds the state.")
    like_batch = [jax.device_put(np.zeros(x.shape, x.dtype)) for x in jax.tree.leaves(batch())]
    public, rows = public_records(init_data, like_batch, treedef, len(like_batch[0]) if like_batch else 0)
    # the placeholder warning names the caller of DPSVI.run (through run and here)
    svi_state = _init_state.init_public(svi, init_key, public, treedef, rows, init_params,
                                        real_values=init_data is not None, stacklevel=6)
    return svi_state if checkpoint is None else checkpoint.into(svi_state)


def _checked_initial_state(svi, svi_state, treedef, records, N):
    """``svi_state`` checked (a state, the model's plate of ``N`` records, the
    same key in every process) and replicated on the mesh's devices."""
    check_state(svi_state)
    _model_facts.check_records_plate(svi, svi_state, treedef, records, N)
    _sharding.check_same_in_every_process("init_state", svi_state.rng_key)
    (svi_state,) = _private_step.replicated(svi, svi_state)
    return svi_state
