# SPDX-License-Identifier: Apache-2.0
"""The releases of DPSVI that ``tests/test_restructure_identity.py`` checks bit for bit.

:func:`compute` runs, on fixed data and keys, two steps of :meth:`DPSVI.update`
(the second with padded records and a public ``expected_batch_size``) for
every gradient strategy and every formulation on tiny models (the paper's
logistic regression and hierarchical logistic regression, and a small VAE for
ghost norms), with noise on; adaptive clipping and the discrete mechanism
once each; and short :meth:`DPSVI.run` calls, Poisson and fixed-size
sampling. It returns every value as an array: the final states' leaves, the
losses and the run's privacy figures.

Every case exists twice: with the debugging PRNG suite (``d3p.random.debug``,
quick to compile) for a covering subset (:data:`FAST`: every strategy, every
formulation, every model, adaptive clipping, discrete noise and both
samplers once), which the default test step checks; and with the default
suite (ChaCha20) for the whole product, which the slow step checks.

Run as a script, it writes those values to ``tests/data/restructure_identity.json``
(each array as its dtype, shape and the hex of its bytes, with the versions
and machine they were computed on). The recorded values come from the code
before DPSVI was split into modules, computed with that code on the import
path::

    git worktree add /tmp/d3p-base <commit>
    PYTHONPATH=/tmp/d3p-base .venv/bin/python tests/_make_identity_values.py

The test recomputes them with the code of the working tree: a restructuring
that changes no behaviour gives the same bits.

A deliberate change of behaviour is recorded on its own: since a run draws
step ``i``'s noise and Monte Carlo keys from its ``rng_key`` and ``i`` (no
longer from the state's key, so that no two releases share noise), the runs'
values were recorded again with that code, the updates' kept::

    .venv/bin/python tests/_make_identity_values.py --runs

So is a change of how a value is rounded: since the Monte Carlo draws are
computed once on CPU (in a loop of two halves: the same bits, whose float
transform XLA now compiles in another fusion), 75 of the 550 values moved by
at most 4 units in the last place of their array's largest value, and all
values were recorded again with that code (the script without arguments).
Since ``run``'s compiled steps take σ as an argument (one program for every
ε), the noise's std σ C is computed in float32 in the program instead of
rounded once from two constants: the runs' values moved by at most 2 units
in the last place and were recorded again (``--runs``). Since they take the
clipping threshold C as an argument too, the debugging suite's runs moved by
at most 2 units in the last place (11 of 52 run values; ChaCha20's none) and
were recorded again (``--runs``). Since ``formulation="auto"`` chooses
``"aligned"`` for these models, the runs ask for ``"own_sample"`` by name
(the formulation they were recorded with; ``"aligned"`` has its own tests).
Since a step takes its keys from one call (``split_with_jax_key``: the
Monte Carlo key from the state's key, no longer from a key of its split)
and a sampler its words from streams of its key (``stream_words``, a
Poisson batch's count and candidates in one call), every value was recorded
again with that code (the script without arguments). Since a step with
ChaCha20 takes its records' and its shared draw's Monte Carlo keys from
the block-function call that gives its own keys (``split_with_jax_keys``),
no longer from a Threefry split of one JAX key, the ChaCha20 product's
values changed; the debugging suite's (the covering subset) gave the same
bits before and after on one machine. The ChaCha20 values are to be
recorded again on a machine of the recorded environment (the script
without arguments): the change's session had none, and the manual test
fails until then.
"""

import json
import pathlib
import platform
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
from numpyro.infer import Trace_ELBO

#: Where the values are recorded.
DATA = pathlib.Path(__file__).resolve().parent / "data" / "restructure_identity.json"

#: ``(name, model, gradient_strategy, formulation, extra DPSVI arguments)`` of the updates.
UPDATES = (
    [(f"logreg/{s}/{f}", "logreg", s, f, {})
     for s in ("vmap", "chunked", "scan", "ghost") for f in ("own_sample", "shared_sample", "per_record")]
    + [(f"hier/{s}/{f}", "hier", s, f, {})
       for s in ("vmap", "chunked", "scan") for f in ("own_sample", "shared_sample", "per_record")]
    + [(f"vae/{s}/{f}", "vae", s, f, {})
       for s in ("vmap", "ghost") for f in ("own_sample", "shared_sample", "per_record")]
    # adaptive clipping with the count noise that was the default when the values were recorded
    # (expected batch size / 20 = 5 / 20; the default is now a share of the step's privacy)
    + [("logreg/vmap/own_sample/adaptive", "logreg", "vmap", "own_sample", {"adaptive_clipping": {"count_noise": 0.25}}),
       ("logreg/scan/per_record/discrete", "logreg", "scan", "per_record", {"noise": "discrete"})]
)

#: The updates checked in the default test step (with ``d3p.random.debug``).
FAST = ("logreg/vmap/own_sample", "logreg/chunked/shared_sample", "logreg/scan/per_record",
        "logreg/ghost/own_sample", "hier/vmap/shared_sample", "vae/ghost/per_record",
        "logreg/vmap/own_sample/adaptive", "logreg/scan/per_record/discrete")

#: The number of records of every data set, the batch size of the updates and their mask's real records.
N, B, REAL = 40, 6, 4


def environment() -> dict:
    """What the recorded bits depend on besides the code: versions, backend, machine.

    ``cpu`` names the processor (its model and instruction-set flags, hashed):
    XLA compiles for the host's processor, so another one may round a value
    differently in its last bit."""
    import hashlib

    import jaxlib

    info = pathlib.Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    first = {}
    for line in lines:
        key, _, value = line.partition(":")
        first.setdefault(key.strip(), value.strip())
    cpu = " ".join([first.get("model name", ""), *sorted(first.get("flags", "").split())])
    return {
        "jax": jax.__version__, "jaxlib": jaxlib.__version__, "numpyro": numpyro.__version__,
        "numpy": np.__version__, "backend": jax.default_backend(), "machine": platform.machine(),
        "avx512f": " avx512f" in first.get("flags", ""),
        "cpu": hashlib.sha256(cpu.encode()).hexdigest()[:16],
    }


def _data():
    rng = np.random.default_rng(1234)
    xs = rng.normal(size=(N, 3)).astype(np.float32)
    ys = (rng.uniform(size=N) < 0.5).astype(np.float32)
    ls = rng.integers(0, 3, N).astype(np.int32)
    gs = rng.normal(size=(3, 2)).astype(np.float32)
    pixels = (rng.uniform(size=(N, 8)) < 0.4).astype(np.float32)
    return xs, ys, ls, gs, pixels


def _model(name):
    """``(model, guide, per-record data, static_kwargs)`` of the model ``name``."""
    from d3p import _paper_models as pm

    xs, ys, ls, gs, pixels = _data()
    if name == "logreg":
        return pm.logistic_regression_model, pm.logistic_regression_guide, (xs, ys), {"N": N}
    if name == "hier":
        return (pm.hierarchical_logistic_regression_model, pm.hierarchical_logistic_regression_guide,
                (xs, ys, ls), {"N": N, "gs": jnp.asarray(gs)})
    model, guide = pm.make_vae(8, 4, 2)
    return model, guide, (pixels,), {"N": N}


def _leaves(name, tree, out):
    """The leaves of ``tree`` into ``out`` as ``name/0``, ``name/1``, ... (keys as their raw data)."""
    for i, leaf in enumerate(jax.tree.leaves(tree)):
        if jnp.issubdtype(jnp.asarray(leaf).dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        out[f"{name}/{i}"] = np.asarray(jax.device_get(leaf))


def _suite(fast: bool):
    import d3p.random

    return d3p.random.debug if fast else d3p.random


def _settings(extra: dict) -> dict:
    """``extra`` with an ``adaptive_clipping`` dict made an :class:`AdaptiveClipping`."""
    from d3p.svi import AdaptiveClipping

    if isinstance(extra.get("adaptive_clipping"), dict):
        return {**extra, "adaptive_clipping": AdaptiveClipping(**extra["adaptive_clipping"])}
    return extra


def _updates(out, fast: bool):
    from d3p.svi import DPSVI

    suite, mask = _suite(fast), jnp.arange(B) < REAL
    for name, model_name, strategy, formulation, extra in UPDATES:
        if fast and name not in FAST:
            continue
        model, guide, data, static = _model(model_name)
        svi = DPSVI(model, guide, numpyro.optim.Adam(0.05), Trace_ELBO(), 1.5, 0.8, rng_suite=suite,
                    gradient_strategy=strategy, formulation=formulation, chunk_size=4, **_settings(extra), **static)
        state = svi.init(suite.PRNGKey(7), *(x[:B] for x in data))
        step = jax.jit(lambda s, m, *a: svi.update(s, *a, mask=m, expected_batch_size=5.0))
        state, loss1 = step(state, jnp.ones(B, bool), *(x[:B] for x in data))
        state, loss2 = step(state, mask, *(x[B:2 * B] for x in data))
        _leaves(f"{prefix(fast)}update/{name}/state", state, out)
        out[f"{prefix(fast)}update/{name}/losses"] = np.asarray([loss1, loss2])


def _runs(out, fast: bool):
    from d3p.svi import DPSVI

    suite = _suite(fast)
    model, guide, data, static = _model("logreg")
    # own_sample: "auto"'s formulation when these were recorded (it is now "aligned" for this guide)
    svi = DPSVI(model, guide, numpyro.optim.Adam(0.05), Trace_ELBO(), 1.5, 0.8, rng_suite=suite,
                formulation="own_sample", **static)
    for sampling in ("poisson", "fixed"):
        result = svi.run(suite.PRNGKey(11), 4, *data, batch_size=B, sampling=sampling, progress_bar=False)
        name = f"{prefix(fast)}run/{sampling}"
        _leaves(f"{name}/state", result.state, out)
        _leaves(f"{name}/params", result.params, out)
        out[f"{name}/losses"] = np.asarray(result.losses)
        out[f"{name}/privacy"] = np.asarray([result.epsilon, result.delta, result.sigma, result.q], dtype=np.float64)


def prefix(fast: bool) -> str:
    """The prefix of the names of the values of :data:`FAST` (``"debug/"``) or of the whole product."""
    return "debug/" if fast else "chacha/"


def compute(fast: bool) -> dict:
    """The recorded values of the covering subset (``fast``) or of the whole
    product, name -> NumPy array, computed with the ``d3p`` on the import path."""
    out = {}
    with warnings.catch_warnings(), jax.enable_x64(False):
        warnings.simplefilter("ignore")   # "Found vars in model but not guide" (ws), all-noise warnings
        _updates(out, fast)
        _runs(out, fast)
    return out


def encode(values: dict) -> dict:
    return {name: {"dtype": str(a.dtype), "shape": list(a.shape), "hex": a.tobytes().hex()}
            for name, a in values.items()}


def decode(recorded: dict) -> dict:
    return {name: np.frombuffer(bytes.fromhex(v["hex"]), dtype=v["dtype"]).reshape(v["shape"])
            for name, v in recorded.items()}


def main():
    import d3p

    if sys.argv[1:] == ["--runs"]:   # the runs' values again, the updates' as recorded
        values = decode(json.loads(DATA.read_text())["values"])
        with warnings.catch_warnings(), jax.enable_x64(False):
            warnings.simplefilter("ignore")
            for fast in (True, False):
                _runs(values, fast)
    else:
        values = {**compute(fast=True), **compute(fast=False)}
    DATA.parent.mkdir(exist_ok=True)
    DATA.write_text(json.dumps({"environment": environment(), "values": encode(values)}, indent=1) + "\n")
    print(f"wrote {len(values)} arrays computed with {pathlib.Path(d3p.__file__).parent} to {DATA}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
