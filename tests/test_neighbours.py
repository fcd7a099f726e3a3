"""Neighbour-differential tests of every public entry point that reads private data.

Each test runs an entry point on two neighbouring data sets with the same keys,
where the changed record is adversarial (non-finite, huge, subnormal, an
outlier, outside the schema, of another dtype), and compares everything it
lets out (see ``tests/_neighbours.py``): the same path (exception, warnings,
output, log records, files), identical public values, and noisy releases
within the stated sensitivity. Entry points, record kinds and relations are
rows of the tables below; a new one is a new row.

Entry points and what is compared:

- :meth:`DPSVI.init` (substitute): the initial state, identical;
- :meth:`DPSVI.update` and :meth:`DPSVI.stable_update` (substitute, masked
  out), under the default ``formulation`` and the others (the prior and
  guide terms inside or outside the clipped sum), among typical records and
  among records that all clip at ``C``
  (where a normalisation that reads the data shows), σ = 0 and SGD with step
  size 1, jitted (default) and eager (slow), so that the released
  (normalised) gradient is the change of the parameters: within ``C`` (``2 C``
  substituted) times the public normalisation;
- :meth:`DPSVI.run` (substitute; Poisson and full-batch fixed-size sampling),
  σ > 0 and step size 0, so that the parameters are the initial ones: identical,
  as is the pickled guide;
- :func:`d3p.twin.fit`, both families, with a complete (public) schema
  (substitute): the path, the public parts of the twin and of its saved
  files; the mixture with step size 0 (its parameters are the initial ones);
- ``python -m d3p twin --schema`` (substitute): exit status, printed lines
  (timings masked), the files written (the synthetic table's contents are
  a noisy release: its header and length only);
- the marginal twin's measurement (``d3p.twin.marginal._measure``) on count
  tables beyond float32's exact integers: every cell within the count
  sensitivity;
- the clipped sum under the ``"scan"`` strategy on records built greedily so
  that the rounding of the other records' sum moves with the removed record.

Declared outside ε, hence not compared (each listed where returned):
the losses of ``update``/``stable_update``/``run`` and all of ``evaluate``
(``DPSVI``'s "Formal guarantees" and the methods' docstrings: "NOT private"),
``TwinResult.losses`` and the twin's ``fit_info["seconds"]`` (a timing).
``test_declared_not_private`` keeps those declarations in the docs.

The audit (:mod:`d3p.audit`) reads no user data: it builds its own canary and
other records from its public arguments (``test_audit_reads_no_user_data``
keeps it so; an audit entry point that takes data must get a row here).
"""

import inspect
import math
import os
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pandas as pd
import pytest
from numpyro.infer import Trace_ELBO
from numpyro.infer.autoguide import AutoDiagonalNormal

import d3p.random
from _neighbours import FLOAT_KINDS, Release, compare, observe
from d3p.svi import DPSVI


@pytest.fixture(scope="module", autouse=True)
def _shared_compilation(tmp_path_factory):
    """A persistent compilation cache for this module: the two runs of a pair
    compile the same programs (the same shapes, the same settings), and entry
    points such as ``run`` and ``twin.fit`` compile afresh on every call; the
    cache lets the second run reuse the first's executables (tens of seconds
    each on CPU). Results do not depend on it. Restored afterwards."""
    try:
        from jax._src import compilation_cache
    except ImportError:  # pragma: no cover - other JAX versions: slower, same results
        yield None
        return
    reset = getattr(compilation_cache, "reset_cache", None)
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    old = {n: getattr(jax.config, n) for n in names}
    directory = str(tmp_path_factory.mktemp("compiled"))
    if reset is not None:
        jax.config.update("jax_compilation_cache_dir", directory)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
        reset()
    yield directory
    if reset is not None:
        for n, v in old.items():
            jax.config.update(n, v)
        reset()


# --------------------------------------------------------------- DP-VI set-up

#: Records in a batch (update) or the data set (init, run), features, the
#: plate's N (public), the index of the changed record, C.
B, DIM, N_PLATE, CHANGED, C = 16, 2, 64, 3, 1.0
KEY = d3p.random.PRNGKey(7)
EPS32 = float(np.finfo(np.float32).eps)


def poisson_model(xs, ys, N):
    """Poisson regression with a log link (as in the issue's reproduction):
    an outlier feature overflows the rate for half of the initial values."""
    w = numpyro.sample("w", dist.Normal(0, 4).expand([xs.shape[1]]).to_event(1))
    with numpyro.plate("batch", N, subsample_size=xs.shape[0]):
        numpyro.sample("ys", dist.Poisson(jnp.exp(xs @ w)), obs=ys)


def base_records(n=B, base="typical"):
    """The other records: ``typical`` (small features, Poisson(1) counts) or
    ``clipped`` (every record's gradient far above C and all nearly aligned:
    the released sum is then as large as clipping allows, so that a record
    whose contribution is not bounded, or a normalisation that reads the
    data, shows in the difference)."""
    if base == "clipped":
        return {"xs": np.full((n, DIM), 0.5, np.float32), "ys": np.full(n, 50.0, np.float32)}
    rng = np.random.default_rng(0)
    return {"xs": rng.normal(0.0, 0.5, (n, DIM)).astype(np.float32),
            "ys": rng.poisson(1.0, n).astype(np.float32)}


#: Adversarial records for DP-VI: (array, column or None, value).
DPSVI_KINDS = {
    **{f"x_{name}": ("xs", 0, v) for name, v in FLOAT_KINDS.items()},
    "x_all_nan": ("xs", None, float("nan")),
    "x_large": ("xs", None, 3.0),  # a large finite gradient, clipped
    "x_opposite": ("xs", None, -0.5),  # among the clipped records: a clipped gradient against theirs
    "y_nan": ("ys", None, float("nan")),
    "y_non_integer": ("ys", None, 2.5),
    "y_negative": ("ys", None, -1.0),
    "y_huge": ("ys", None, 1e30),
}


def _with_record(data, kind):
    """``data`` with record CHANGED set to the adversarial record ``kind``."""
    name, column, value = DPSVI_KINDS[kind]
    out = {k: v.copy() for k, v in data.items()}
    if column is None:
        out[name][CHANGED] = value
    else:
        out[name][CHANGED, column] = value
    return out


def neighbours(relation, kind, n=B, base="typical"):
    """``(D, D')`` as dicts of per-record arrays (and ``mask`` where used).

    - ``substitute``: record CHANGED typical in D, adversarial in D';
    - ``mask``: D holds the adversarial record, D' has it masked out (removal
      with the same shapes, see RELATIONS).
    """
    data = base_records(n, base)
    if relation == "substitute":
        return data, _with_record(data, kind)
    adversarial = _with_record(data, kind)
    if relation == "mask":
        mask = np.ones(n, bool)
        off = mask.copy()
        off[CHANGED] = False
        return dict(adversarial, mask=mask), dict(adversarial, mask=off)
    raise ValueError(relation)


def make_svi(optim, dp_scale, **kwargs):
    model = poisson_model
    return DPSVI(model, AutoDiagonalNormal(model), optim, Trace_ELBO(), clipping_threshold=C,
                 dp_scale=dp_scale, N=N_PLATE, **kwargs)


def public_state(state):
    """The parts of a DPSVIState that never depend on a record."""
    return {"rng_key": state.rng_key, "observation_scale": state.observation_scale,
            "mutable_state": state.mutable_state}


# ------------------------------------------------------------- DPSVI.init

#: The kinds every default-step test runs; the ``slow`` tests run all of DPSVI_KINDS.
DEFAULT_KINDS = ("x_nan", "x_1e30", "x_outlier", "y_negative")
ALL_KINDS = sorted(DPSVI_KINDS)
SLOW_KINDS = [k for k in ALL_KINDS if k not in DEFAULT_KINDS]

_observed = {}


def observe_once(key, fn):
    """``observe(fn)``, kept under ``key``: the unchanged data set D of the
    substitute pairs is the same for every kind, so it runs once."""
    if key not in _observed:
        _observed[key] = observe(fn)
    return _observed[key]


def init_release(data):
    svi = make_svi(numpyro.optim.SGD(1.0), 1.0)
    state = svi.init(KEY, data["xs"], data["ys"])
    # the whole initial state is public: nothing in it may come from a record
    return Release(public={"params": svi.get_params(state), "state": state, "guide_pickle": pickle.dumps(svi.guide)})


def check_init(kind):
    d, d2 = neighbours("substitute", kind)
    compare(observe_once("init", lambda: init_release(d)), observe(lambda: init_release(d2)), what=f"init {kind}")


@pytest.mark.parametrize("kind", DEFAULT_KINDS)
def test_init(kind):
    check_init(kind)


@pytest.mark.slow
@pytest.mark.parametrize("kind", SLOW_KINDS)
def test_init_slow(kind):
    check_init(kind)


# ------------------------------------------- DPSVI.update and stable_update


def _placeholder_state(svi):
    """An initial state from public placeholder records (zeros), the same for D and D'."""
    return svi.init(KEY, np.zeros((B, DIM), np.float32), np.zeros(B, np.float32))


class _Step:
    """One DPSVI with σ = 0 and SGD(1) and its step ``method``, called eagerly
    or jitted (compiled once per batch shape, traced on public placeholder
    records before any observation, so that both runs of a pair execute the
    same compiled program and only its run-time path is compared; an eager
    call compiles its program at its first call, so the placeholders go
    through an eager call first too)."""

    def __init__(self, method, jitted, formulation="auto"):
        self.svi = make_svi(numpyro.optim.SGD(1.0), 0.0, formulation=formulation)
        self.state = _placeholder_state(self.svi)
        self.method, self.jitted, self._compiled = method, jitted, {}

    def _key(self, data):
        return (data["xs"].shape[0], "mask" in data)

    def prepare(self, data):
        """Compile for the shapes of ``data``, on zeros of those shapes."""
        if self._key(data) in self._compiled:
            return
        step = getattr(self.svi, self.method)
        if not self.jitted:
            placeholder = {"xs": np.zeros_like(data["xs"]), "ys": np.zeros_like(data["ys"])}
            if "mask" in data:
                placeholder["mask"] = np.ones_like(data["mask"])
            self._compiled[self._key(data)] = None
            jax.block_until_ready(self(placeholder))
            return
        if "mask" in data:
            fn = jax.jit(lambda s, x, y, m: step(s, x, y, mask=m, expected_batch_size=B))
            placeholder = (np.zeros_like(data["xs"]), np.zeros_like(data["ys"]), np.ones_like(data["mask"]))
        else:
            fn = jax.jit(lambda s, x, y: step(s, x, y, expected_batch_size=B))
            placeholder = (np.zeros_like(data["xs"]), np.zeros_like(data["ys"]))
        jax.block_until_ready(fn(self.state, *placeholder))
        self._compiled[self._key(data)] = fn

    def __call__(self, data):
        args = (data["xs"], data["ys"]) + ((data["mask"],) if "mask" in data else ())
        if self.jitted:
            return self._compiled[self._key(data)](self.state, *args)
        kwargs = {"mask": data["mask"]} if "mask" in data else {}
        return getattr(self.svi, self.method)(self.state, data["xs"], data["ys"], expected_batch_size=B, **kwargs)


_steps = {}


def _stepper(method, jitted, formulation="auto"):
    if (method, jitted, formulation) not in _steps:
        _steps[(method, jitted, formulation)] = _Step(method, jitted, formulation)
    return _steps[(method, jitted, formulation)]


def update_release(stepper, data, relation):
    """One step with σ = 0 and SGD(1): the change of the unconstrained
    parameters is the released gradient, the noisy sum times the public
    normalisation N / B (``expected_batch_size=B`` on both sides)."""
    svi, state = stepper.svi, stepper.state
    old = svi.optim.get_params(state.optim_state)
    new_state, loss = stepper(data)
    new = svi.optim.get_params(new_state.optim_state)
    as64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    step = jax.tree.map(lambda a, b: as64(a) - as64(b), old, new)
    factor = N_PLATE / B
    sensitivity = (2 * C if relation == "substitute" else C) * factor
    # rounding of the post-processing (scaling by N / B, the SGD step, the
    # subtraction above): a few float32 roundings of |old| + |new| per entry
    size = math.sqrt(sum(float(np.sum((np.abs(as64(a)) + np.abs(as64(b))) ** 2))
                         for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(new))))
    if stepper.svi.formulation_choice == "aligned":   # asked for, or what "auto" chose
        # the release is the sum over the guide's draw loc + scale * eps: the
        # location's step is that release (its Jacobian is the identity); the
        # scale's is the same vector times the draw's eps (post-processing)
        step = {"auto_loc": step["auto_loc"]}
    return Release(
        public={"state": public_state(new_state), "optim_step": new_state.optim_state[0],
                "shapes": jax.tree.map(lambda x: (np.shape(x), str(np.asarray(x).dtype)), new)},
        noisy={"step": step},
        # update's loss is computed from the un-noised data: NOT private
        # (DPSVI "Formal guarantees", DPSVI.update ":return:")
        not_private={"loss": loss},
        sensitivity=sensitivity, tolerance=4 * EPS32 * size)


def check_update(kind, relation, method, jitted, base="typical", formulation="auto"):
    stepper = _stepper(method, jitted, formulation)
    d, d2 = neighbours(relation, kind, base=base)
    stepper.prepare(d)
    stepper.prepare(d2)
    compare(observe(lambda: update_release(stepper, d, relation)),
            observe(lambda: update_release(stepper, d2, relation)),
            not_private=["loss"], what=f"{method} {relation} {kind} among {base} records ({formulation})")


#: The relations of the update tables. Removal is compared as a record masked
#: out (as in run's Poisson batches): a batch with one slot fewer draws every
#: record's Monte Carlo key afresh (``split(key, B)`` is not a prefix of
#: ``split(key, B + 1)``), so the other records' guide samples differ and a
#: same-key comparison says nothing (the guarantee holds in distribution).
#: Literal removal is compared where the loss has no Monte Carlo sample
#: (``test_clipped_sum_rounding_slow``).
RELATIONS = ("substitute", "mask")


BASES = ("typical", "clipped")


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("relation", RELATIONS)
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_update(kind, relation, base):
    check_update(kind, relation, "update", jitted=True, base=base)


#: The slow step's further ``update`` pairs (the default step already runs every
#: kind jitted): eager calls, where concrete values reach NumPyro's argument
#: checks, on the non-finite and extreme kinds; ``stable_update`` jitted on
#: every kind among clipped records. (CI's time budget: all combinations
#: took about 16 minutes on 2 cores.)
EAGER_KINDS = [k for k in ALL_KINDS if k in ("x_nan", "x_+inf", "x_-inf", "x_1e30", "x_subnormal",
                                             "y_nan", "y_non_integer")]
UPDATE_SLOW = ([(k, r, "typical", "update", False) for k in EAGER_KINDS for r in RELATIONS]
               + [(k, r, "clipped", "stable_update", True) for k in ALL_KINDS for r in RELATIONS])


@pytest.mark.slow
@pytest.mark.parametrize("kind, relation, base, method, jitted", UPDATE_SLOW)
def test_update_slow(kind, relation, base, method, jitted):
    check_update(kind, relation, method, jitted, base)


#: DPSVI's formulations besides the default (``"auto"``, which is
#: ``"aligned"`` here, in the tables above: the records' gradients taken for
#: the guide's draw shared by the batch): the model's prior and guide terms
#: (the global site ``w``) inside each record's clipped ELBO
#: (``"per_record"``), or added once per step after the noise with one guide
#: draw shared by the batch (``"shared_sample"``) or one per record
#: (``"own_sample"``); either way the released sum moves by at most C (2 C
#: substituted).
OTHER_FORMULATIONS = ("per_record", "shared_sample", "own_sample")


@pytest.mark.parametrize("formulation, relation", [("per_record", "substitute"), ("shared_sample", "mask"),
                                                   ("own_sample", "substitute")])
@pytest.mark.parametrize("kind", ["x_nan", "x_1e30"])
def test_update_other_formulations(kind, relation, formulation):
    """(One compiled step each; the slow step runs every kind, relation and base.)"""
    check_update(kind, relation, "update", jitted=True, base="clipped", formulation=formulation)


@pytest.mark.slow
@pytest.mark.parametrize("formulation", OTHER_FORMULATIONS)
@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("relation", RELATIONS)
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_update_formulations_slow(kind, relation, base, formulation):
    check_update(kind, relation, "update", jitted=True, base=base, formulation=formulation)


# ---------------------------------------------------------------- DPSVI.run


#: run's samplers: (keyword arguments of run).
RUN_SAMPLINGS = {
    "poisson": {"batch_size": 4, "sampling": "poisson"},
    "fixed_full_batch": {"batch_size": B, "sampling": "fixed"},
}


def run_release(data, sampling):
    """Two steps of run with σ = 1 and step size 0: the parameters stay the
    initial ones, which must not depend on the data; so must the guide
    (pickled) after the run."""
    svi = make_svi(numpyro.optim.SGD(0.0), 1.0)
    result = svi.run(KEY, 2, data["xs"], data["ys"], progress_bar=False, target_delta=1e-5,
                     **RUN_SAMPLINGS[sampling])
    return Release(
        public={"params": result.params, "optim_state": result.state.optim_state,
                "state": public_state(result.state),
                "privacy": {k: getattr(result, k) for k in ("epsilon", "delta", "relation", "sampler",
                                                            "sigma", "q", "num_steps")},
                "guide_pickle": pickle.dumps(svi.guide)},
        # run's losses are computed from the un-noised data: NOT private
        # (DPSVI "Formal guarantees", DPSVI.run ":return:")
        not_private={"losses": result.losses})


def check_run(kind, sampling):
    d, d2 = neighbours("substitute", kind)
    compare(observe_once(("run", sampling), lambda: run_release(d, sampling)),
            observe(lambda: run_release(d2, sampling)),
            not_private=["losses"], what=f"run {sampling} {kind}")


def test_run():
    # full-batch: the changed record is in the first batch whatever the key
    check_run("x_nan", "fixed_full_batch")


@pytest.mark.slow
@pytest.mark.parametrize("sampling", sorted(RUN_SAMPLINGS))
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_run_slow(kind, sampling):
    check_run(kind, sampling)


# ------------------------------------------- the rounding of the clipped sum


def greedy_records(size, clipping_threshold=C, seed=0):
    """Per-record gradients (scalars, float32) built so that summing them one
    after another in float32 moves the sum by more than ``clipping_threshold``
    when record 0 is removed: record 0 is as large as clipping leaves it,
    the next records climb to a power of two ``P`` (the sum's spacing grows with
    it), and every later record is chosen greedily, among offsets that put the
    two running sums (with and without record 0) on either side of ``P``, where
    their roundings differ most. Returns ``(records, moved)``, ``moved``: the
    change of the naive sequential float32 sum (the adversary's claim)."""
    eps = float(np.finfo(np.float32).eps)
    # below the largest value the clipping certifies unchanged at this batch size
    largest = clipping_threshold * (1 - (size + 64) * eps)
    rng = np.random.default_rng(seed)
    records = np.empty(size, np.float32)
    records[0] = largest
    with_first, without = np.float32(largest), np.float32(0.0)
    climb = size // 2
    power = 2.0 ** np.floor(np.log2(max(climb * largest * 0.9, 1.0)))
    offsets = np.arange(-64, 65) / 16.0 * power * eps
    for k in range(1, size):
        if with_first < power and k < climb:
            choice = np.array([largest], np.float32)
        else:
            choice = np.concatenate([power - float(with_first) + offsets, power - float(without) + offsets,
                                     rng.uniform(-largest, largest, 64)])
            choice = np.clip(choice, -largest, largest).astype(np.float32)
        moved = (with_first + choice).astype(np.float64) - (without + choice).astype(np.float64)
        best = choice[int(np.argmax(moved))]
        records[k] = best
        with_first, without = np.float32(with_first + best), np.float32(without + best)
    return records, float(with_first) - float(without)


def linear_model(xs, N):
    """One record's loss is ``-x * theta`` exactly (``N`` a power of two, so the
    plate's scale and DPSVI's division by it are exact): its gradient is ``-x``."""
    theta = numpyro.param("theta", jnp.zeros(()))
    with numpyro.plate("data", N, subsample_size=xs.shape[0]):
        numpyro.factor("f", xs * theta)


def no_guide(xs, N):
    pass


def greedy_release(step, get_params, state, data):
    new_state, loss = step(state, data["xs"], data["mask"])
    # σ = 0, N / B = 1, SGD(1) from theta = 0: theta is minus the released sum, exactly
    return Release(public={"rng_key": new_state.rng_key},
                   noisy={"theta": np.asarray(get_params(new_state)["theta"], np.float64)},
                   # the loss is computed from the un-noised data: NOT private (DPSVI.update)
                   not_private={"loss": loss}, sensitivity=C)


def check_greedy(size, relation, strategy="scan"):
    records, moved = greedy_records(size)
    assert moved > C  # the pair is adversarial for a plain sequential float32 sum
    svi = DPSVI(linear_model, no_guide, numpyro.optim.SGD(1.0), Trace_ELBO(), clipping_threshold=C, dp_scale=0.0,
                gradient_strategy=strategy, N=size)
    state = svi.init(KEY, np.zeros(size, np.float32))
    step = jax.jit(lambda s, x, m: svi.update(s, x, mask=m, expected_batch_size=size))
    if relation == "mask":
        d = {"xs": records, "mask": np.ones(size, bool)}
        d2 = {"xs": records, "mask": np.arange(size) != 0}
    else:  # remove record 0 (no Monte Carlo sample in this loss: the same-key comparison holds)
        d, d2 = ({"xs": records, "mask": np.ones(size, bool)},
                 {"xs": records[1:], "mask": np.ones(size - 1, bool)})
    for data in (d, d2):  # compile outside the observations
        jax.block_until_ready(step(state, np.zeros_like(data["xs"]), data["mask"]))
    return compare(observe(lambda: greedy_release(step, svi.get_params, state, d)),
                   observe(lambda: greedy_release(step, svi.get_params, state, d2)),
                   not_private=["loss"], what=f"{strategy} sum, B={size}, {relation}")


@pytest.mark.float32  # the float32 sum (under x64 the parameters, hence the sum, are float64)
def test_clipped_sum_rounding():
    """Finding 4's pair at a small batch (on a plain float32 scan it moves the sum by 1.0009 C)."""
    check_greedy(256, "mask")


@pytest.mark.slow
@pytest.mark.float32
@pytest.mark.parametrize("strategy", ["scan", "chunked", "vmap"])
@pytest.mark.parametrize("relation", ["mask", "remove"])
@pytest.mark.parametrize("size", [1024, 16384])
def test_clipped_sum_rounding_slow(size, relation, strategy):
    check_greedy(size, relation, strategy)


# ------------------------------------------- the marginal twin's measurement


#: Count tables whose cells lie beyond float32's exact integers (2**24), where a
#: cast to float32 moves a cell by 0 or by a whole float32 step: (cells of D, shares).
MEASURE_TABLES = {
    "one_table": ([np.array([2**25 + 1, 3 * 10**7 + 3, 3 * 10**8 + 7, 5, 2**24, 0], np.int64)], [0.01]),
    "two_tables": ([np.array([2**26 + 3, 10**8 + 1], np.int64),
                    np.array([[2**25 + 5, 7], [3 * 10**8 + 9, 2**24 + 1]], np.int64)], [0.3, 0.02]),
}


def measure_release(tables, shares):
    from d3p.twin.marginal import _measure

    noisy, stds = _measure(d3p.random.PRNGKey(3), tables, shares, 1.0, 16)
    cells = [np.asarray(t, np.float64) for t in noisy]
    largest = max(float(np.max(np.abs(c))) for c in cells)
    # a record moves one cell of each table by one count (add/remove), and each
    # table's noise is scaled to that sensitivity: sqrt(#tables) in L2 over all
    # of them, one count per cell (checked by the test). Allowance: the float64
    # rounding of the released cells.
    return Release(public={"stds": [float(x) for x in stds], "shapes": [c.shape for c in cells]},
                   noisy={"cells": cells}, sensitivity=math.sqrt(len(cells)),
                   tolerance=4 * np.finfo(np.float64).eps * largest)


@pytest.mark.parametrize("case", sorted(MEASURE_TABLES))
def test_marginal_measure(case):
    tables, shares = MEASURE_TABLES[case]
    for t in range(len(tables)):
        for cell in range(tables[t].size):
            changed = [x.copy() for x in tables]
            changed[t].flat[cell] += 1
            for i, x in enumerate(changed):
                if i != t:  # the record is in one cell of every table
                    x.flat[cell % x.size] += 1
            d = observe(lambda: measure_release(tables, shares))
            d2 = observe(lambda: measure_release(changed, shares))
            compare(d, d2, what=f"measure {case} table {t} cell {cell}")
            for a, b in zip(d.release.noisy["cells"], d2.release.noisy["cells"]):
                moved = float(np.max(np.abs(a - b)))
                assert moved <= 1.0 + d.release.tolerance, (
                    f"[measure {case} table {t} cell {cell}] a released cell moved by {moved!r} counts, "
                    "more than the count sensitivity 1")


@pytest.mark.slow
def test_marginal_fit_beyond_float32_counts():
    """fit_marginals' one-way tables on N > 2**24 records (two binary columns): one
    added record moves every released cell by at most one count."""
    from d3p.twin.cells import CellSpace
    from d3p.twin.marginal import fit_marginals, one_way_shares, plan_marginals
    from d3p.twin.schema import ColumnSpec, Schema

    schema = Schema((ColumnSpec("a", "boolean", "bool", False, distribution="bernoulli"),
                     ColumnSpec("b", "boolean", "bool", False, distribution="bernoulli")))
    space = CellSpace(schema)
    plan = plan_marginals(1.0, 1e-9, 2, num_rounds=0)
    weights = np.sqrt(one_way_shares(space.sizes, plan.rho_one_way))

    def adversarial_count(start, weight):
        """The count near ``start`` at which one more record moves ``weight * count``
        by the most after a cast to float32 (the other records choose their counts)."""
        ts = np.arange(start, start + 64, dtype=np.int64)
        step = (weight * (ts + 1)).astype(np.float32) - (weight * ts).astype(np.float32)
        return int(ts[np.argmax(step)])

    n = 2**25 + 3
    ones_a = adversarial_count(n // 3, weights[0])           # the added record has a = 1 ...
    zeros_b = adversarial_count(n - n // 5, weights[1])      # ... and b = 0
    cells = np.zeros((n, 2), np.int64)
    cells[:ones_a, 0] = 1
    cells[: n - zeros_b, 1] = 1
    added = np.concatenate([cells, np.array([[1, 0]], np.int64)])

    def release(c):
        _, measurements, budget = fit_marginals(c, space, plan, d3p.random.PRNGKey(11))
        values = [np.asarray(m[1], np.float64) for m in measurements]
        return Release(public={"cliques": [m[0] for m in measurements], "rho": budget.spent},
                       noisy={"cells": values}, sensitivity=math.sqrt(2.0),  # one cell of each of 2 tables
                       tolerance=4 * np.finfo(np.float64).eps * n)

    d, d2 = observe(lambda: release(cells)), observe(lambda: release(added))
    compare(d, d2, what="fit_marginals N > 2**24")
    for a, b in zip(d.release.noisy["cells"], d2.release.noisy["cells"]):
        moved = float(np.max(np.abs(a - b)))
        assert moved <= 1.0 + d.release.tolerance, (
            f"[fit_marginals N > 2**24] a released cell moved by {moved!r} counts, more than 1")


# -------------------------------------------------------------- twin.fit


def twin_schema():
    from d3p.twin.schema import ColumnSpec, Schema

    return Schema((
        ColumnSpec("x", "real", "float64", False, lower=0.0, upper=100.0, distribution="normal"),
        ColumnSpec("k", "count", "int64", False, lower=0, upper=20, distribution="poisson"),
        ColumnSpec("c", "categorical", "str", False, levels=("a", "b", "c"), distribution="categorical"),
        ColumnSpec("b", "boolean", "bool", False, distribution="bernoulli"),
    ))


def twin_frame(n=60):
    rng = np.random.default_rng(1)
    return {"x": list(rng.uniform(10, 90, n)), "k": [int(v) for v in rng.poisson(3, n)],
            "c": list(rng.choice(["a", "b", "c"], n)), "b": [bool(v) for v in rng.uniform(size=n) < 0.4]}


#: Adversarial records for the twin (with a complete public schema): (column, value).
TWIN_KINDS = {
    **{f"x_{name}": ("x", v) for name, v in FLOAT_KINDS.items() if name != "subnormal"},
    "x_subnormal": ("x", 5e-324),
    "x_out_of_range": ("x", 1e4),
    "x_text": ("x", "abc"),          # another dtype: the column becomes object
    "k_non_integer": ("k", 2.5),     # another dtype: the column becomes float
    "k_negative": ("k", -3),
    "k_huge": ("k", 10**12),
    "c_undeclared": ("c", "HIV+ (confidential)"),
    "c_missing": ("c", None),
    "c_number": ("c", 7),
    "b_text": ("b", "sometimes"),
    "b_missing": ("b", None),
}
TWIN_DEFAULT_KINDS = ("x_nan", "c_undeclared", "k_non_integer")
TWIN_SLOW_KINDS = [k for k in sorted(TWIN_KINDS) if k not in TWIN_DEFAULT_KINDS]


def twin_neighbours(kind, n=60):
    """Substitute pairs (N is public): record 0 typical in D, adversarial in D'."""
    column, value = TWIN_KINDS[kind]
    d = twin_frame(n)
    d2 = {k: list(v) for k, v in d.items()}
    d2[column][0] = value
    return pd.DataFrame(d), pd.DataFrame(d2)


#: twin.fit settings per family: fast, and for the mixture step size 0 (its
#: parameters are then the initial ones, which must not depend on the data).
TWIN_FAMILIES = {
    "marginal": {"family": "marginal"},
    "mixture": {"family": "mixture", "num_steps": 2, "q": 0.25, "num_components": 2,
                "optimizer": numpyro.optim.SGD(0.0)},
}


def _public_twin_parts(description, family):
    """The public parts of a twin's description (``TwinResult.description()``,
    the content of ``twin.json``): all but the noisy releases of the marginal
    twin (the tables it chose: ``model.factors``, ``privacy.measured``) and the
    fit's duration (``fit.seconds``, a timing)."""
    description = {k: dict(v) if isinstance(v, dict) else v for k, v in description.items()}
    description["fit"].pop("seconds", None)
    if family == "marginal":
        description["model"].pop("factors", None)
        description["privacy"].pop("measured", None)
        description.pop("params", None)  # one potential per chosen factor
    return description


def twin_release(frame, family, tmp_path, name):
    import d3p.twin as twin

    tw = twin.fit(frame, 1.0, rng_key=d3p.random.PRNGKey(5), schema=twin_schema(), progress_bar=False,
                  **TWIN_FAMILIES[family])
    directory = tw.save(os.path.join(tmp_path, name))
    with open(os.path.join(directory, "twin.json"), encoding="utf-8") as f:
        import json

        saved = json.load(f)
    with np.load(os.path.join(directory, "params.npz")) as z:
        arrays = {k: z[k] for k in z.files}
    public = {"repr": repr(tw), "description": _public_twin_parts(tw.description(), family),
              "saved": _public_twin_parts(saved, family), "files": sorted(os.listdir(directory))}
    if family == "mixture":
        # step size 0: the parameters are the initial ones
        public["params"] = tw.params
        public["saved_params"] = arrays
    # the marginal twin's potentials are post-processing of the noisy tables;
    # their mechanism is bounded in test_marginal_measure
    return Release(public=public,
                   # TwinResult.losses: computed from the un-noised data, NOT private (TwinResult docstring)
                   not_private={"losses": tw.losses} if family == "mixture" else {})


def check_twin(kind, family, tmp_path):
    d, d2 = twin_neighbours(kind)
    compare(observe_once(("twin", family), lambda: twin_release(d, family, tmp_path, "d")),
            observe(lambda: twin_release(d2, family, tmp_path, "d2")),
            not_private=["losses"] if family == "mixture" else [], what=f"twin.fit {family} {kind}")


@pytest.mark.parametrize("kind", TWIN_DEFAULT_KINDS)
def test_twin_fit_marginal(kind, tmp_path):
    check_twin(kind, "marginal", tmp_path)


#: The slow step's twin pairs: every kind with the marginal family, the mixture
#: (tens of seconds of compilation a pair) on one kind per column type. The
#: default step compares the marginal family above, and the mixture's DP-VI
#: fit through ``DPSVI.run`` (``test_run``).
TWIN_SLOW_PAIRS = ([(k, "marginal") for k in TWIN_SLOW_KINDS]
                   + [(k, "mixture") for k in ("x_+inf", "k_huge", "b_text", "c_undeclared")])


@pytest.mark.slow
@pytest.mark.parametrize("kind, family", TWIN_SLOW_PAIRS)
def test_twin_fit_slow(kind, family, tmp_path):
    check_twin(kind, family, tmp_path)


# ------------------------------------------------------ python -m d3p twin


#: Figures in the command's output that are timings, masked before the comparison.
CLI_MASKS = (r"\d+(\.\d+)? s\b",)
#: The command's settings per family (fast).
CLI_FAMILIES = {
    "marginal": ["--family", "marginal"],
    "mixture": ["--family", "mixture", "--steps", "2", "--q", "0.25", "--components", "2"],
}


def _cli_outputs(directory, family):
    """What is public in the files the command wrote: every name; the synthetic
    table's header and length (its rows are post-processing of the noisy
    release); the saved twin's description without its noisy parts and timing;
    the names of its parameters."""
    import json

    names = sorted(os.path.relpath(os.path.join(top, n), directory).replace(os.sep, "/")
                   for top, _, files in os.walk(directory) for n in files)
    with open(os.path.join(directory, "out.csv"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    with open(os.path.join(directory, "model", "twin.json"), encoding="utf-8") as f:
        description = _public_twin_parts(json.load(f), family)
    with np.load(os.path.join(directory, "model", "params.npz")) as z:
        params = sorted(z.files) if family == "mixture" else None
    return {"files": names, "csv_header": lines[:1], "csv_lines": len(lines), "twin": description, "params": params}


def _write_inputs(directory, frame):
    os.makedirs(directory)
    frame.to_csv(os.path.join(directory, "in.csv"), index=False)
    twin_schema().save(os.path.join(directory, "schema.json"))


def cli_args(family):
    # --no-utility: the utility figures are computed on the real data and
    # printed as NOT private (outside epsilon, like the losses): left out
    return (["twin", "in.csv", "out.csv", "--epsilon", "1", "--schema", "schema.json", "--seed", "5",
             "--no-progress", "--no-utility", "--save-model", "model"] + CLI_FAMILIES[family])


def cli_release_in_process(directory, family):
    """``python -m d3p twin`` through its entry point (``d3p.__main__.main``), in this process."""
    from d3p.__main__ import main

    old = os.getcwd()
    os.chdir(directory)
    try:
        status = main(cli_args(family))
    finally:
        os.chdir(old)
    public = {"status": status}
    if status == 0:
        public["outputs"] = _cli_outputs(directory, family)
    return Release(public=public)


def cli_release_subprocess(directory, family, cache):
    """``python -m d3p twin`` in a fresh interpreter, on the d3p this test imports."""
    import subprocess
    import sys

    import d3p

    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(d3p.__file__))))
    if cache is not None:
        env.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.5")
    done = subprocess.run([sys.executable, "-m", "d3p"] + cli_args(family), cwd=directory, env=env,
                          capture_output=True, text=True, timeout=900)
    print(done.stdout, end="")
    print(done.stderr, end="", file=sys.stderr)
    public = {"status": done.returncode}
    if done.returncode == 0:
        public["outputs"] = _cli_outputs(directory, family)
    return Release(public=public)


def check_cli(kind, family, tmp_path, cache=None, subprocess=False):
    d, d2 = twin_neighbours(kind)
    observations = []
    for name, frame in (("d", d), ("d2", d2)):
        directory = os.path.join(tmp_path, name)
        _write_inputs(directory, frame)
        if subprocess:
            fn = lambda: cli_release_subprocess(directory, family, cache)  # noqa: E731
        else:
            fn = lambda: cli_release_in_process(directory, family)  # noqa: E731
        observations.append(observe(fn, masks=CLI_MASKS))
    compare(*observations, what=f"python -m d3p twin {family} {kind}")


def test_cli_twin(tmp_path):
    check_cli("c_undeclared", "marginal", tmp_path)


#: The slow command-line pairs, as subprocesses: a kind per column type with the
#: marginal family, one with the mixture (each of its runs compiles DP-VI afresh:
#: about a minute on CPU); the fits themselves are compared in-process above.


CLI_SLOW_PAIRS = ([(k, "marginal") for k in ("x_text", "k_negative", "c_missing", "b_text")]
                  + [("c_undeclared", "mixture")])


@pytest.mark.slow
@pytest.mark.parametrize("kind, family", CLI_SLOW_PAIRS)
def test_cli_twin_slow(kind, family, tmp_path, _shared_compilation):
    check_cli(kind, family, tmp_path, cache=_shared_compilation, subprocess=True)


# --------------------------------------------------- declared outside ε


def test_declared_not_private():
    """The values the harness leaves out are declared NOT private where they are returned."""
    from d3p.gradients import ClippedSum
    from d3p.twin.inference import TwinResult

    assert "NOT private" in DPSVI.evaluate.__doc__
    assert "NOT" in DPSVI.update.__doc__.split(":return:")[1] and "private" in DPSVI.update.__doc__.split(":return:")[1]
    assert "NOT private" in DPSVI.stable_update.__doc__.split(":return:")[1].replace("\n", " ").replace("  ", " ")
    assert "NOT private" in DPSVI.run.__doc__.split(":return:")[1]
    assert "NOT private" in " ".join(ClippedSum.__doc__.split())
    assert "NOT private" in " ".join(TwinResult.__doc__.split())


def test_audit_reads_no_user_data():
    """The audit's entry points build their own data sets from public
    arguments: none takes a data set (if one does, it needs a row here)."""
    import d3p.audit as audit

    data_words = ("data", "records", "xs", "frame", "table", "dataset")
    for name in ("audit_dpsvi", "audit_gaussian_step", "dpsvi_projections", "dpsvi_scores",
                 "dpsvi_fixed_size_projections", "gaussian_step_scores"):
        params = inspect.signature(getattr(audit, name)).parameters
        assert not [p for p in params if p in data_words], (name, list(params))
