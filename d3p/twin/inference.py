"""Fit a twin with DP-VI at a target (ε, δ), generate synthetic data, save and load.

:func:`fit` is the entry point; it returns a :class:`TwinResult`, which can
:meth:`~TwinResult.generate` synthetic tables and :meth:`~TwinResult.save`
itself (parameters, model description, schema and privacy level; never the
data). :func:`load` reads a saved twin back.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import time
from typing import Callable, Dict, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import pandas as pd
from numpyro import handlers
from numpyro.infer import Predictive, Trace_ELBO
from numpyro.infer.autoguide import AutoDiagonalNormal, AutoGuide

import d3p.random
from d3p import _adaptive, _run_plan, _validate, accounting
from d3p.ledger import PrivacyLedger, ZCDPRelease
from d3p.svi import DPSVI
from d3p.twin import _fit_plan, _mixture_setups
from d3p.twin._io import atomic_directory
from d3p.twin.cells import CellSpace
from d3p.twin.marginal import MarginalModel, fit_marginals, one_way_shares, plan_marginals
from d3p.twin.model import DEFAULT_CONTINUOUS_GAIN, MixtureGuide, MixtureModel, guide_sample_numpy, mixture_sample_numpy
from d3p.twin._schema_private import SCHEMA_SHARE, schema_releases
from d3p.twin.schema import DEFAULT_MAX_LEVELS, Schema, TwinInputError, check_frame, check_type
from d3p.version import VERSION

__all__ = ["fit", "TwinResult", "load", "default_num_steps", "default_q", "cosine_decay", "choose_family",
           "FAMILIES", "FORMAT"]

#: Name of the saved-twin format (``twin.json`` field ``format``).
FORMAT = "d3p-twin"
_FORMAT_VERSION = 1
#: Default clipping threshold C of the per-record gradients.
DEFAULT_CLIPPING_THRESHOLD = 1.0
#: Default Adam learning rate (the initial step size; see :func:`cosine_decay`).
DEFAULT_LEARNING_RATE = 0.05
#: The default step size decays (cosine) to this fraction of the learning rate.
DEFAULT_FINAL_LEARNING_RATE_FRACTION = 0.05


def cosine_decay(learning_rate: float, num_steps: int, final_fraction: float = DEFAULT_FINAL_LEARNING_RATE_FRACTION):
    """Step-size schedule ``i -> learning_rate * (f + (1 - f) * (1 + cos(pi * i / T)) / 2)``
    (``f = final_fraction``, ``T = num_steps``; constant after step T): large steps
    while the parameters travel, small ones at the end, where under DP the last
    iterate would otherwise keep jumping with the noise. This is optax's
    ``cosine_decay_schedule(learning_rate, T, alpha=f)``; optax comes with the
    ``twin`` extra (``pip install d3p[twin]``).

    :param float learning_rate: the initial step size, > 0.
    :param int num_steps: T >= 1.
    :param float final_fraction: f in [0, 1] (default 0.05).
    :return: the schedule, a function of the (traced) step number, for
        ``numpyro.optim.Adam(schedule)``.
    :raises ImportError: if optax is not installed.

    .. doctest::

        >>> from d3p.twin.inference import cosine_decay
        >>> schedule = cosine_decay(0.1, 100)
        >>> [round(float(schedule(i)), 5) for i in (0, 50, 100, 1000)]
        [0.1, 0.0525, 0.005, 0.005]
    """
    learning_rate = _validate.positive("learning_rate", learning_rate)
    num_steps = _validate.integer("num_steps", num_steps, minimum=1)
    final_fraction = _validate.number("final_fraction", final_fraction, low=0.0, high=1.0)
    try:
        import optax
    except ImportError:
        raise ImportError(
            "d3p.twin's step-size schedule needs optax, which is not installed; install it with "
            "`pip install d3p[twin]` (or `pip install optax`)."
        ) from None
    return optax.cosine_decay_schedule(learning_rate, num_steps, alpha=final_fraction)


def default_q(num_records: int) -> float:
    """Default sampling probability: an expected batch of 200 records,
    ``min(0.5, max(0.01, 200 / N))``."""
    return float(min(0.5, max(0.01, 200.0 / num_records)))


def default_num_steps(num_records: int, q: float) -> int:
    """Default number of steps: 50 epochs (``50 / q``), between 200 and 2000."""
    return int(min(2000, max(200, round(50.0 / q))))


def _is_int_seed(value) -> bool:
    """Whether a key argument is an integer seed (not a bool, not an array)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _as_d3p_key(rng_key):
    if rng_key is None:
        raise ValueError(
            "Expected an explicit rng_key (the privacy noise is drawn from it): pass "
            "d3p.random.PRNGKey() for fresh OS entropy or d3p.random.PRNGKey(seed)."
        )
    if _is_int_seed(rng_key):
        return d3p.random.PRNGKey(int(rng_key))
    try:   # a d3p.random key, or a JAX key converted (d3p.random.as_key)
        return d3p.random.as_key(rng_key, "rng_key")
    except TypeError as err:
        raise ValueError(f"{err} An integer seed is also accepted.") from None


def _as_jax_key(rng_key):
    """A JAX key for generation from an int, a JAX key or a d3p.random key."""
    if _is_int_seed(rng_key):
        return jax.random.PRNGKey(int(rng_key))
    if rng_key is None:
        raise ValueError("Expected rng_key (an int seed, a JAX key or a d3p.random key), got None.")
    if isinstance(rng_key, jax.Array) and jax.dtypes.issubdtype(rng_key.dtype, jax.dtypes.prng_key):
        return rng_key
    arr = jnp.asarray(rng_key)
    if arr.dtype == jnp.uint32 and arr.shape == (8,):
        return d3p.random.convert_to_jax_rng_key(arr)
    if arr.dtype == jnp.uint32 and arr.shape == (2,):
        return arr
    raise ValueError(
        f"Expected rng_key to be an int, a JAX PRNG key or a d3p.random key, got shape {arr.shape}, "
        f"dtype {arr.dtype}."
    )


def _numpy_rng(rng_key) -> np.random.Generator:
    """A NumPy generator seeded by the bits of a key (int, JAX key or d3p.random key)."""
    key = _as_jax_key(rng_key)
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return np.random.default_rng([int(v) for v in np.asarray(key, np.uint32).ravel()])


def _encode_float(v):
    if isinstance(v, float) and not math.isfinite(v):
        return "inf" if v > 0 else ("-inf" if v < 0 else "nan")
    if isinstance(v, dict):
        return {k: _encode_float(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_encode_float(x) for x in v]
    return v


def _decode_float(v, keys=("epsilon", "target_epsilon", "rho")):
    if isinstance(v, dict):
        return {k: (float(x) if k in keys and isinstance(x, str) else _decode_float(x, keys))
                for k, x in v.items()}
    return v


def _init_guide(guide, model, schema: Schema, num_records: int, params: Dict) -> None:
    """Set up an autoguide's structure from public placeholder data (no private data)."""
    if guide is None:
        return
    if isinstance(guide, AutoGuide) and getattr(guide, "prototype_trace", None) is None:
        x0 = jnp.asarray(schema.placeholder_codes(1))
        with handlers.block():
            handlers.seed(handlers.substitute(guide, data=params), rng_seed=0)(x0, N=num_records)


class TwinResult:
    """A fitted twin: schema, model, variational parameters and privacy record.

    Attributes:

    - ``schema`` (:class:`Schema`), ``num_records`` (N, treated as public),
    - ``params``: the guide's parameters (NumPy arrays): the private release,
    - ``privacy``: dict with ``epsilon``, ``delta``, ``sigma``, ``relation``,
      ``sampling``, ``q``, ``num_steps``, ``clipping_threshold``,
      ``accountant``, and ``not_covered``: the schema fields read from the
      data without privacy,
    - ``fit_info``: settings and timing of the fit,
    - ``model``, ``guide``: the NumPyro callables,
    - ``losses``: the training losses, only after :func:`fit` (not saved):
      computed from the un-noised data, NOT private.

    Everything except ``losses`` is post-processing of the DP-VI release and
    the schema, so synthetic data from :meth:`generate` carry the privacy of
    ``privacy`` (plus whatever ``not_covered`` lists).
    """

    def __init__(self, schema: Schema, model, guide, params: Dict, *, num_records: int,
                 model_spec: dict, guide_spec: dict, privacy: dict, fit_info: dict,
                 losses: Optional[np.ndarray] = None):
        self.schema = schema
        self.model = model
        self.guide = guide
        self.params = {k: np.asarray(v) for k, v in params.items()}
        self.num_records = int(num_records)
        self.model_spec = dict(model_spec)
        self.guide_spec = dict(guide_spec)
        self.privacy = dict(privacy)
        self.fit_info = dict(fit_info)
        self.losses = losses
        _init_guide(self.guide, self.model, self.schema, self.num_records,
                    {k: jnp.asarray(v) for k, v in self.params.items()})

    def __repr__(self) -> str:
        p = self.privacy
        noise = f"rho={p.get('rho')}" if "rho" in p else f"sigma={p.get('sigma')}"
        return (f"TwinResult({len(self.schema)} columns, N={self.num_records}, model={self.model_spec.get('type')}, "
                f"epsilon={p.get('epsilon')}, delta={p.get('delta')}, {noise})")

    # ------------------------------------------------------------ generate

    def _sampler(self, num_draws: int, per_draw: int):
        """Compiled ``(key, params) -> codes (num_draws, per_draw, D)``, cached."""
        cache = self.__dict__.setdefault("_samplers", {})
        if (num_draws, per_draw) not in cache:
            model, guide, N = self.model, self.guide, self.num_records

            def sample(key, params):
                pred = Predictive(model, guide=guide, params=params, num_samples=num_draws,
                                  return_sites=["x"], parallel=True)
                return pred(key, None, N=N, num_records=per_draw)["x"]

            cache[(num_draws, per_draw)] = jax.jit(sample)
        return cache[(num_draws, per_draw)]

    def generate_codes(self, num_records: int, rng_key, *, num_param_draws: Optional[int] = None) -> np.ndarray:
        """Synthetic records as a code matrix ``(num_records, D)`` (``NaN`` = missing).

        See :meth:`generate`.
        """
        n = _validate.integer("num_records", num_records, minimum=1)
        M = min(n, 100) if num_param_draws is None else num_param_draws
        M = min(_validate.integer("num_param_draws", M, minimum=1), n)
        per_draw = -(-n // M)
        if isinstance(self.model, MarginalModel):
            return self.model.generate_codes(n, _numpy_rng(rng_key))
        if isinstance(self.model, MixtureModel) and isinstance(self.guide, MixtureGuide):
            # NumPy: nothing to compile
            rng = _numpy_rng(rng_key)
            sites = guide_sample_numpy(self.guide, self.params, M, rng)
            x = mixture_sample_numpy(self.model, sites, per_draw, rng).reshape(M * per_draw, -1)
            return x[rng.permutation(M * per_draw)[:n]]
        key, perm_key = jax.random.split(_as_jax_key(rng_key))
        x = self._sampler(M, per_draw)(key, {k: jnp.asarray(v) for k, v in self.params.items()})
        x = np.asarray(x, dtype=np.float64).reshape(M * per_draw, -1)
        order = np.asarray(jax.random.permutation(perm_key, M * per_draw))[:n]
        return x[order]

    def generate(self, num_records: int, rng_key, *, num_param_draws: Optional[int] = None) -> pd.DataFrame:
        """Sample a synthetic table from the posterior predictive distribution.

        ``num_param_draws`` parameter sets are drawn from the variational
        posterior (default ``min(num_records, 100)``) and each generates an
        equal share of the records; the rows are shuffled. Post-processing of
        the private release: the output has the privacy of ``self.privacy``.

        :param int num_records: number of synthetic records.
        :param rng_key: an int seed, a JAX PRNG key or a ``d3p.random`` key.
            The same key gives the same table (also after :meth:`save`/:func:`load`).
        :param int num_param_draws: number of posterior draws.
        :return: DataFrame with the schema's columns, dtypes and categories;
            nullable columns have missing values at the modelled rate.
        """
        return self.schema.decode(self.generate_codes(num_records, rng_key, num_param_draws=num_param_draws))

    # ---------------------------------------------------------------- save

    def description(self) -> dict:
        """The JSON content of ``twin.json`` (no data, no parameters)."""
        return _encode_float({
            "format": FORMAT,
            "format_version": _FORMAT_VERSION,
            "d3p_version": VERSION,
            "num_records": self.num_records,
            "schema": self.schema.to_dict(),
            "model": self.model_spec,
            "guide": self.guide_spec,
            "privacy": self.privacy,
            "fit": self.fit_info,
            "params": {k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in self.params.items()},
        })

    def save(self, path: Union[str, os.PathLike], *, overwrite: bool = False) -> str:
        """Save the twin to the directory ``path`` (``twin.json`` + ``params.npz``).

        Written to a temporary directory next to ``path`` and renamed at the
        end, so a failure leaves no partial output. Contains no records.

        :param path: the directory to create.
        :param bool overwrite: replace an existing directory.
        :return: the path.
        """
        path = os.fspath(path)
        with atomic_directory(path, overwrite=overwrite) as tmp:
            self.write_files(tmp)
        return path

    def write_files(self, directory: Union[str, os.PathLike]) -> None:
        """Write ``twin.json`` and ``params.npz`` into the existing ``directory``
        (not atomically; see :meth:`save`)."""
        with open(os.path.join(directory, "twin.json"), "w", encoding="utf-8") as f:
            json.dump(self.description(), f, indent=2, allow_nan=False)
            f.write("\n")
        np.savez(os.path.join(directory, "params.npz"), **self.params)

    @classmethod
    def load(cls, path: Union[str, os.PathLike], *, model: Optional[Callable] = None,
             guide: Optional[Callable] = None) -> "TwinResult":
        """Load a twin saved by :meth:`save`.

        :param path: the directory.
        :param model: required if the twin was fit with a user-supplied model.
        :param guide: required if it was fit with a user-supplied guide.
        :return: the :class:`TwinResult`.
        """
        path = os.fspath(path)
        try:
            with open(os.path.join(path, "twin.json"), encoding="utf-8") as f:
                desc = json.load(f)
            with np.load(os.path.join(path, "params.npz")) as z:
                params = {k: z[k] for k in z.files}
        except FileNotFoundError:
            raise TwinInputError(f"{path!r} is not a saved twin (twin.json or params.npz missing).") from None
        if desc.get("format") != FORMAT:
            raise TwinInputError(f"{path!r} is not a saved twin (format {desc.get('format')!r}).")
        if desc.get("format_version", 0) > _FORMAT_VERSION:
            raise TwinInputError(f"{path!r} was saved by a newer d3p (format {desc.get('format_version')}).")
        schema = Schema.from_dict(desc["schema"])
        mspec, gspec = desc["model"], desc["guide"]
        if mspec.get("type") == "marginal":
            model = MarginalModel.from_description(schema, mspec, params)
            return cls(schema, model, None, params, num_records=desc["num_records"], model_spec=mspec,
                       guide_spec=gspec, privacy=_decode_float(desc["privacy"]), fit_info=desc.get("fit", {}))
        if mspec.get("type") == "mixture":
            if model is None:
                model = MixtureModel(schema, mspec["num_components"])
        elif model is None:
            raise TwinInputError(
                f"The twin in {path!r} was fit with a user-supplied model ({mspec.get('name')!r}); "
                "pass the same model as model= (and its guide as guide=)."
            )
        if guide is None and gspec.get("type") == "MixtureGuide":
            if not isinstance(model, MixtureModel):
                raise TwinInputError("A MixtureGuide needs the default MixtureModel.")
            # (the gains only scale the optimiser's coordinates: generation does not use them)
            guide = MixtureGuide(model, gspec.get("init_scale", 0.1), gspec.get("learn_scale", True),
                                 continuous_gain=gspec.get("continuous_gain", DEFAULT_CONTINUOUS_GAIN),
                                 discrete_gain=gspec.get("discrete_gain"))
        if guide is None:
            if gspec.get("type") != "AutoDiagonalNormal":
                raise TwinInputError(
                    f"The twin in {path!r} was fit with a user-supplied guide ({gspec.get('name')!r}); "
                    "pass it as guide=."
                )
            guide = AutoDiagonalNormal(model)
        return cls(schema, model, guide, params, num_records=desc["num_records"], model_spec=mspec,
                   guide_spec=gspec, privacy=_decode_float(desc["privacy"]), fit_info=desc.get("fit", {}))


def load(path: Union[str, os.PathLike], *, model: Optional[Callable] = None,
         guide: Optional[Callable] = None) -> TwinResult:
    """Load a saved twin; see :meth:`TwinResult.load`."""
    return TwinResult.load(path, model=model, guide=guide)


#: The model families of :func:`fit`.
FAMILIES = ("auto", "marginal", "mixture")


#: ``family="auto"`` chooses the marginal twin when the expected total-variation
#: error of its noisy one-way tables is at most this (see :func:`choose_family`).
MARGINAL_MAX_NOISE_TV = 0.3
#: ``family="auto"`` chooses the marginal twin for fewer records than this: the
#: mixture's default Poisson batches (q = 0.5) would overflow their padding for a
#: neighbouring table too often to be accounted within δ = 1/N².
MIXTURE_MIN_RECORDS = 20


def choose_family(schema: Schema, num_records: int, epsilon: float, delta: float) -> str:
    """The model family ``family="auto"`` picks (from public settings only).

    ``"marginal"`` (:mod:`d3p.twin.marginal`) if its one-way tables can be
    measured with an expected total-variation error, averaged over the
    columns, of at most :data:`MARGINAL_MAX_NOISE_TV` (that is, the
    Gaussian noise of the plan's one-way tables, ``sqrt(2/π) σ_j`` per cell,
    summed over a column's cells and halved, over N); else ``"mixture"``
    (:class:`MixtureModel` fitted with DP-VI), except with fewer than
    :data:`MIXTURE_MIN_RECORDS` records. Marginal tables capture the
    dependence between discrete columns that products within a few components
    cannot; where binned tables would be drowned in noise (many continuous
    columns, few records), a mixture shares its noise budget across columns.
    On the bundled tables of ``benchmarks/twins.py`` the error is 0.006 to 0.19
    where the marginal twin did better and 0.5 to 1.5 where the mixture did.

    :param Schema schema: a complete schema.
    :param int num_records: N (public).
    :param float epsilon: the target ε.
    :param float delta: the target δ.
    :return: ``"marginal"`` or ``"mixture"``.
    """
    check_type("schema", schema, Schema, "a d3p.twin.Schema")
    num_records = _validate.integer("num_records", num_records, minimum=1)
    plan = plan_marginals(epsilon, delta, len(schema))
    sizes = CellSpace(schema).sizes
    if math.isinf(plan.rho) or num_records < MIXTURE_MIN_RECORDS:
        return "marginal"
    shares = one_way_shares(sizes, plan.rho_one_way)
    noise = [0.5 * n * math.sqrt(2 / math.pi) * plan.l2_sensitivity / math.sqrt(2 * r) for n, r in zip(sizes, shares)]
    return "marginal" if np.mean(noise) / num_records <= MARGINAL_MAX_NOISE_TV else "mixture"


def fit(data: pd.DataFrame, epsilon: float, delta: Optional[float] = None, *, rng_key,
        schema: Optional[Union[Schema, dict]] = None, family: str = "auto", model: Optional[Callable] = None,
        guide: Optional[Callable] = None, num_components: Optional[int] = None, num_steps: Optional[int] = None,
        q: Optional[float] = None, sampling: str = "poisson", clipping_threshold: float = DEFAULT_CLIPPING_THRESHOLD,
        learning_rate: float = DEFAULT_LEARNING_RATE, optimizer=None, accountant: str = "fourier",
        max_levels: int = DEFAULT_MAX_LEVELS, target: Optional[Union[str, Sequence[str]]] = None,
        progress_bar: bool = True, ledger: Optional[PrivacyLedger] = None,
        adaptive_clipping=None, schema_inference: str = "private", schema_share: float = SCHEMA_SHARE,
        strict: bool = False) -> TwinResult:
    """Fit a synthetic-data twin of ``data`` at the target (ε, δ).

    Steps: (1) complete the schema: the fields it leaves out are read privately, in the budget
    (:func:`d3p.twin.infer_schema_private`, ``schema_share`` of the ρ and a tenth of δ: the default),
    or with ``schema_inference="data"`` outside ε (:func:`infer_schema`, warned, in
    ``privacy["not_covered"]``); a complete schema spends nothing; (2) encode the table
    (:meth:`Schema.encode`: each record on its own, by public rules, never an error); (3) choose the
    family (``"auto"``: :func:`choose_family`, from the schema, N, ε and δ) and fit it: ``"marginal"``,
    a graphical model fitted to noisy, privately chosen marginal tables (:mod:`d3p.twin.marginal`, in
    one zCDP budget); ``"mixture"``, :meth:`d3p.svi.DPSVI.run` with σ calibrated for (ε, δ, q, T) and
    the sampler (:func:`d3p.accounting.accounting_for`), from public placeholder records; the model
    :class:`MixtureModel` or a user ``model`` (contract: :mod:`d3p.twin.model`), the guide
    :class:`MixtureGuide` for the default model, else ``AutoDiagonalNormal``.

    :param pandas.DataFrame data: the private table (never modified, never stored).
    :param float epsilon: target ε > 0; ``inf`` fits without privacy (for comparison).
    :param float delta: target δ in (0, 1); default ``1 / N**2``.
    :param rng_key: a ``d3p.random`` key (``d3p.random.PRNGKey()``: fresh entropy), a
        JAX key (:func:`d3p.random.as_key`) or an int seed; the noise is as secret as it.
    :param schema: a :class:`Schema` or its dict (the fields it leaves out are read as
        ``schema_inference`` says), or the :class:`~d3p.twin.PrivateSchema` of
        :func:`~d3p.twin.infer_schema_private` for this fit's ε, δ and sampling.
    :param str family: ``"auto"`` (default), ``"marginal"`` or ``"mixture"`` (``"auto"`` with a
        user model or a DP-VI setting: the mixture).
    :param model: a NumPyro model (contract above); ``guide``: its guide (default above).
    :param int num_components: K of the default model (:func:`~d3p.twin.model.default_num_components`).
    :param int num_steps: T (default :func:`default_num_steps`); ``q``: sampling probability (:func:`default_q`).
    :param str sampling: ``"poisson"`` (default: add/remove) or ``"fixed"`` (substitute relation).
    :param float clipping_threshold: C (default 1.0; the first C with ``adaptive_clipping``).
    :param float learning_rate: Adam's step size (default 0.05), :func:`cosine_decay` to 5%;
        ``optimizer``: instead of Adam, any optimizer :class:`DPSVI` accepts.
    :param str accountant: ``"fourier"`` (default), ``"rdp"`` or ``"pld"`` (mixture).
    :param int max_levels: the most levels of a categorical column whose levels are read.
    :param target: column(s) a downstream model will predict (public): the marginal
        family spends a third of its rounds on tables holding it; the mixture ignores it.
    :param ledger: a :class:`d3p.ledger.PrivacyLedger`: refused before reading (the schema) and before
        the fit (the model) if it would pass its budget; every release recorded. ``progress_bar``: a bar.
    :param adaptive_clipping: None (C fixed), True or a :class:`d3p.svi.AdaptiveClipping` (mixture).
    :param str schema_inference: ``"private"`` (default) or ``"data"`` (outside ε, warned; also the
        path of ``epsilon=inf``); ``schema_share``: the share of ρ for a private schema, default 0.1.
    :param bool strict: refuse, before reading, whatever would read the data outside ε
        (``schema_inference="data"`` with an incomplete schema, fields marked ``inferred``, ε = inf).
    :return: :class:`TwinResult`.
    :raises TwinInputError: on an unusable schema; on unusable data only with ``schema_inference="data"``.
    :raises ValueError: on invalid arguments (named in the message).

    **Formal guarantees.** Given N and the column names, the schema read privately (the default) and the
    released parameters (and every table generated from them) are together (ε, δ)-DP under the relation of
    ``sampling``: the schema's Gaussian part is composed with the model's mechanism by the same accountant,
    its δ share covers its text levels. Given a complete schema, the same holds for the parameters. Mixture:
    ε from the sampler's accountant, δ with the Poisson overflow term; the data enter only through
    :meth:`Schema.encode` into :meth:`DPSVI.run`. Marginal: :func:`d3p.twin.marginal.fit_marginals`
    (zCDP). Not private: a schema read with ``schema_inference="data"``, ``epsilon=inf``, ``losses``.
    """
    t0 = time.monotonic()
    epsilon, key, sampling, clipping_threshold, learning_rate, target, family = _check_arguments(
        data, epsilon, rng_key, sampling, clipping_threshold, learning_rate, model, guide, target, family)
    schema_inference, schema_share = _fit_plan.check_schema_options(data, epsilon, schema, schema_inference,
                                                                    schema_share, strict)
    if ledger is not None and not isinstance(ledger, PrivacyLedger):
        raise TypeError(f"Expected ledger to be a d3p.ledger.PrivacyLedger, got {type(ledger).__name__}.")
    schema, private = _fit_plan.resolve_schema(data, epsilon, delta, key, schema, schema_inference, schema_share,
                                               sampling, max_levels, ledger)
    x = schema.encode(data)
    if _resolve_family(family, schema, x.shape[0], epsilon, delta,
                       (model, num_components, num_steps, q, optimizer, adaptive_clipping)) == "marginal":
        return _fit_marginal(schema, x, epsilon, delta, key, sampling, progress_bar, t0, target, ledger, private)
    plan = _privacy_plan(x.shape[0], epsilon, delta, q, num_steps, sampling, accountant,
                         private.plan if private is not None else None)
    return _fit_mixture(schema, x, plan, key, model, guide, num_components, clipping_threshold, learning_rate,
                        optimizer, progress_bar, t0, ledger, adaptive_clipping, private)


def _check_target(target, data: pd.DataFrame) -> Tuple[str, ...]:
    """``target`` as a tuple of column names of ``data`` (empty for None)."""
    if target is None:
        return ()
    names = [target] if isinstance(target, str) else target
    if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) for n in names):
        raise ValueError(f"Expected target to be a column name or a non-empty list of column names, got {target!r}.")
    missing = [n for n in names if n not in data.columns]
    if missing:
        raise ValueError(f"Expected target to name columns of data; not columns: {missing} "
                         f"(columns: {list(data.columns)}).")
    return tuple(dict.fromkeys(names))


def _resolve_family(family: str, schema: Schema, num_records: int, epsilon: float, delta, dpvi_settings) -> str:
    """``family``, with ``"auto"`` resolved: the mixture if any DP-VI setting is given, else
    :func:`choose_family`; ``"marginal"`` with a DP-VI setting is an error."""
    given = any(v is not None for v in dpvi_settings)
    if family == "auto":
        return "mixture" if given else choose_family(schema, num_records, epsilon,
                                                     1.0 / num_records**2 if delta is None else delta)
    if family == "marginal" and given:
        raise ValueError("Expected no model, num_components, num_steps, q, optimizer or adaptive_clipping "
                         "with family='marginal' (they set up the mixture fitted with DP-VI).")
    return family


def _fit_mixture(schema: Schema, x: np.ndarray, plan: "_Plan", key, model, guide, num_components,
                 clipping_threshold: float, learning_rate: float, optimizer, progress_bar: bool,
                 t0: float, ledger: Optional[PrivacyLedger] = None, adaptive_clipping=None,
                 private=None) -> TwinResult:
    """:func:`fit` with ``family="mixture"``: DP-VI with the plan's σ and sampler
    (with adaptive clipping, the plan's σ is the effective one of the gradient
    sums and the counts, and the gradient's own σ follows from it)."""
    adaptive = _adaptive.resolve(adaptive_clipping, clipping_threshold)
    dp_scale = plan.sigma
    if adaptive is not None:
        dp_scale = adaptive.split(plan.sigma)
    setup = _mixture_setup(schema, plan, model, guide, num_components, clipping_threshold, learning_rate, optimizer,
                           adaptive, dp_scale)
    svi, model, model_spec, guide, guide_spec = setup.svi, setup.model, setup.model_spec, setup.guide, setup.guide_spec
    for release in schema_releases(plan.schema, plan.sampler.name) if ledger is not None else ():
        ledger.record(release)
    result = _run(svi, setup.init, schema, x, plan, key, progress_bar, ledger)
    fit_info = _fit_info(plan, learning_rate, clipping_threshold, optimizer, seconds=time.monotonic() - t0)
    fit_info["adaptive_clipping"] = None if adaptive is None else {
        "target_quantile": adaptive.target_quantile, "learning_rate": adaptive.learning_rate,
        "count_noise": adaptive.count_std(dp_scale), "gradient_sigma": dp_scale,
        "final_clipping_threshold": float(result.state.clipping_threshold)}
    return TwinResult(schema, model, guide, result.params, num_records=plan.num_records, model_spec=model_spec,
                      guide_spec=guide_spec, privacy=_privacy_record(plan, result, clipping_threshold, schema, private),
                      fit_info=fit_info, losses=np.asarray(result.losses))


def _fit_marginal(schema: Schema, x: np.ndarray, epsilon: float, delta, key, sampling: str, progress_bar: bool,
                  t0: float, targets: Tuple[str, ...] = (), ledger: Optional[PrivacyLedger] = None,
                  private=None) -> TwinResult:
    """:func:`fit` with ``family="marginal"``: the private rounds of :mod:`d3p.twin.marginal` (in the
    ρ a private schema leaves: ``zcdp_rho(ε, δ - δ_thr)`` less its own)."""
    num_records = x.shape[0]
    delta = _validate.open_unit("delta", 1.0 / num_records**2 if delta is None else delta)
    relation = accounting.accounting_for(sampling).relation
    space = CellSpace(schema)
    s = private.plan if private is not None else None
    delta_model = delta - (s.delta_threshold if s is not None else 0.0)
    rho = None if s is None else accounting.zcdp_rho(epsilon, delta_model) - s.rho
    plan = plan_marginals(epsilon, delta, len(schema), relation=relation, rho=rho, num_targets=len(targets))
    for release in schema_releases(s) if ledger is not None else ():
        ledger.record(release)
    if ledger is not None:   # refused before the fit if the planned ρ would pass the budget
        ledger.check(ZCDPRelease("marginal twin (planned)", plan.rho, str(relation)))
    bar = None
    if progress_bar and plan.num_rounds:
        from tqdm.auto import tqdm

        bar = tqdm(total=plan.num_rounds, desc="marginal rounds")
    try:
        names = [c.name for c in schema.columns]
        graph, measurements, budget = fit_marginals(space.cells(x), space, plan, key,
                                                    progress=(lambda t, n: bar.update(1)) if bar else None,
                                                    target=[names.index(n) for n in targets])
    finally:
        if bar is not None:
            bar.close()
    model = MarginalModel(schema, space, graph)
    if ledger is not None:
        ledger.record(ZCDPRelease(f"marginal twin: {_validate.plural(len(budget.ledger), 'release')}", budget.spent,
                                  str(relation)))
    spent = budget.spent + (s.rho if s is not None else 0.0)
    eps = accounting.zcdp_epsilon(spent, delta_model) if math.isfinite(spent) else math.inf
    privacy = {
        "epsilon": eps, "target_epsilon": epsilon, "delta": delta if math.isfinite(eps) else None,
        "rho": spent, "relation": _relation_name(relation), "sampling": sampling,
        "schema": None if private is None else private.record(),
        "mechanism": "zCDP: Gaussian noise on marginal tables, exponential mechanism for their choice",
        "num_measurements": len(measurements), "num_releases": len(budget.ledger),
        "measured": [list(m.clique) for m in measurements],
        "num_records_public": True, "private": math.isfinite(eps),
        "not_covered": {k: list(v) for k, v in schema.inferred_fields().items()},
    }
    if eps > epsilon * (1 + 1e-9):
        raise RuntimeError(f"Internal error: the marginal twin's epsilon {eps} exceeds the target {epsilon}.")
    fit_info = {"family": "marginal", "num_rounds": plan.num_rounds, "num_tree_rounds": plan.num_tree_rounds,
                "rho_one_way": plan.rho_one_way, "rho_select": plan.rho_select, "rho_measure": plan.rho_measure,
                "num_target_rounds": plan.num_target_rounds, "rho_target_select": plan.rho_target_select,
                "rho_target_measure": plan.rho_target_measure, "target": list(targets) or None, "seconds": round(time.monotonic() - t0, 3)}
    return TwinResult(schema, model, None, model.params(), num_records=num_records, model_spec=model.description(),
                      guide_spec={"type": "none"}, privacy=privacy, fit_info=fit_info)


_SAMPLINGS = ("poisson", "fixed")


def _check_arguments(data, epsilon, rng_key, sampling, clipping_threshold, learning_rate, model, guide, target,
                     family):
    """:func:`fit`'s checks before the schema: ``(epsilon, key, sampling, C, learning rate, target, family)``."""
    epsilon = _validate.positive("epsilon", epsilon, finite=False)
    key = _as_d3p_key(rng_key)
    check_frame("data", data)
    sampling = _validate.choice("sampling", sampling, _SAMPLINGS)
    clipping_threshold = _validate.positive("clipping_threshold", clipping_threshold)
    learning_rate = _validate.positive("learning_rate", learning_rate)
    if guide is not None and model is None:
        raise ValueError("Expected a model together with the guide (guide without model).")
    family = _validate.choice("family", family, FAMILIES)
    return epsilon, key, sampling, clipping_threshold, learning_rate, _check_target(target, data), family


_Plan = _fit_plan.Plan


def _privacy_plan(num_records: int, epsilon: float, delta, q, num_steps, sampling: str, accountant: str,
                  schema=None) -> _Plan:
    """Defaults and checks of (q, T), then :func:`d3p.twin._fit_plan.privacy_plan` (the sampler, its
    accounting and σ calibrated to (ε, δ) with the schema's release, if private)."""
    q = _validate.probability("q", default_q(num_records) if q is None else q)
    num_steps = _validate.integer("num_steps", default_num_steps(num_records, q) if num_steps is None else num_steps,
                                  minimum=1)
    return _fit_plan.privacy_plan(num_records, epsilon, delta, q, num_steps, sampling, accountant, schema)


def _model(schema: Schema, model, num_components, num_records: int) -> Tuple[Callable, dict]:
    """The model (default :class:`MixtureModel`) and its saved description."""
    if model is None:
        model = MixtureModel(schema, num_components, num_records=num_records)
    elif num_components is not None:
        raise ValueError("num_components applies only to the default model, not to a user-supplied one.")
    if not isinstance(model, MixtureModel):
        return model, {"type": "custom", "name": getattr(model, "__qualname__", type(model).__name__)}
    if model.schema.names != schema.names:
        raise ValueError("Expected the MixtureModel to be built for the data's schema.")
    return model, model.description()


def _guide(model, guide) -> Tuple[Callable, dict]:
    """The guide (default :class:`MixtureGuide` for a :class:`MixtureModel`, else
    ``AutoDiagonalNormal``) and its saved description."""
    if guide is None:
        guide = MixtureGuide(model) if isinstance(model, MixtureModel) else AutoDiagonalNormal(model)
    if isinstance(guide, MixtureGuide):
        return guide, {"type": "MixtureGuide", "init_scale": guide.init_scale, "learn_scale": guide.learn_scale,
                       "continuous_gain": guide.continuous_gain, "discrete_gain": guide.discrete_gain}
    if type(guide) is AutoDiagonalNormal:
        return guide, {"type": "AutoDiagonalNormal"}
    return guide, {"type": "custom", "name": getattr(guide, "__qualname__", type(guide).__name__)}


def _mixture_setup(schema: Schema, plan: _Plan, model, guide, num_components, clipping_threshold: float,
                   learning_rate: float, optimizer, adaptive, dp_scale: float) -> _mixture_setups.MixtureSetup:
    """The DP-VI set-up of a mixture fit; that of the default model, guide
    and optimizer with a fixed C and σ > 0 is kept between fits under its
    public settings (the schema, N, K), so that a fit at another ε, C, step
    size or number of steps reuses its compiled steps (:mod:`d3p.twin._mixture_setups`)."""
    key = None
    if model is None and guide is None and optimizer is None and adaptive is None and dp_scale > 0:
        key = (schema.to_json(sort_keys=True), num_components, plan.num_records)

    def build():
        the_model, model_spec = _model(schema, model, num_components, plan.num_records)
        the_guide, guide_spec = _guide(the_model, guide)
        schedule = None
        if optimizer is None:   # cosine_decay's arithmetic, its step size and steps arguments of the steps
            schedule = _run_plan.CosineStepSize(learning_rate, plan.num_steps, DEFAULT_FINAL_LEARNING_RATE_FRACTION)
        optim = numpyro.optim.Adam(schedule) if optimizer is None else optimizer
        # own_sample: the formulation the twin's figures were measured with (benchmarks/README.md)
        svi = DPSVI(the_model, the_guide, optim, Trace_ELBO(), clipping_threshold=clipping_threshold,
                    dp_scale=dp_scale, adaptive_clipping=adaptive, N=plan.num_records, formulation="own_sample")
        if schedule is not None:
            _run_plan.use_schedule(svi, optim, schedule)

        def init(k, x):
            return svi.init(k, x, init_data=(x,))

        return _mixture_setups.MixtureSetup(svi, jax.jit(init) if isinstance(the_guide, MixtureGuide) else init,
                                            the_model, model_spec, the_guide, guide_spec)

    return _mixture_setups.kept(key, build, dp_scale, clipping_threshold, learning_rate, plan.num_steps)


def _run(svi: DPSVI, init: Callable, schema: Schema, x: np.ndarray, plan: _Plan, key, progress_bar: bool,
         ledger=None):
    """Initialise on public placeholder records with ``init`` (no private
    value enters the initial state), then :meth:`DPSVI.run` with the plan's
    sampler; checks that the run was accounted as planned."""
    init_key, run_key = d3p.random.split(key, 2)
    x0 = jnp.asarray(schema.placeholder_codes(1))   # public: valid codes of every column
    state = init(init_key, x0)
    result = svi.run(run_key, plan.num_steps, jnp.asarray(x), target_delta=plan.delta_run,
                     accountant=plan.accountant, progress_bar=progress_bar, init_state=state, ledger=ledger,
                     **plan.run_kwargs)
    # with adaptive clipping the run's sigma is the effective one, never below the plan's
    if result.relation != plan.relation or not plan.sigma <= result.sigma <= plan.sigma * (1 + 1e-12):
        raise RuntimeError(  # pragma: no cover - a consistency check
            f"Internal error: the run used relation={result.relation}, sigma={result.sigma}; "
            f"expected {plan.relation}, {plan.sigma}."
        )
    if float(result.epsilon) > plan.epsilon * (1 + 1e-9):
        raise RuntimeError(  # pragma: no cover - a consistency check
            f"Internal error: the run's epsilon {float(result.epsilon)} exceeds the target {plan.epsilon}."
        )
    return result


def _relation_name(relation) -> str:
    """A relation as its plain name (``"add_remove"``, ``"substitute"``), for JSON and printing."""
    return str(getattr(relation, "value", relation))


def _privacy_record(plan: _Plan, result, clipping_threshold: float, schema: Schema, private=None) -> dict:
    """``TwinResult.privacy``: what the release guarantees and what it does not cover."""
    eps_run = float(result.epsilon)
    if plan.schema is not None:   # the schema's release and the run, composed
        eps_run = plan.epsilon_of(float(result.sigma))
        if eps_run > plan.epsilon * (1 + 1e-9):
            raise RuntimeError(  # pragma: no cover - a consistency check
                f"Internal error: the twin's epsilon {eps_run} exceeds the target {plan.epsilon}.")
    return {
        "epsilon": eps_run,
        "target_epsilon": plan.epsilon,
        "delta": plan.delta if math.isfinite(eps_run) else None,
        "schema": None if private is None else private.record(),
        "delta_poisson_overflow": plan.overflow,
        "sigma": plan.sigma,
        "clipping_threshold": float(clipping_threshold),
        "relation": _relation_name(plan.relation),
        "sampling": plan.sampling,
        "q": plan.q,
        "num_steps": plan.num_steps,
        "accountant": plan.accountant,
        "num_records_public": True,
        "private": math.isfinite(eps_run),
        "not_covered": {k: list(v) for k, v in schema.inferred_fields().items()},
    }


def _fit_info(plan: _Plan, learning_rate: float, clipping_threshold: float, optimizer, *, seconds: float) -> dict:
    """``TwinResult.fit_info``: the settings and duration of the fit."""
    return {
        "family": "mixture",
        "num_steps": plan.num_steps,
        "q": plan.q,
        "expected_batch_size": float(plan.sampler.expected_batch_size),
        "sampling": plan.sampling,
        "learning_rate": float(learning_rate),
        "clipping_threshold": float(clipping_threshold),
        "target": None,
        "optimizer": (f"adam, cosine decay to {DEFAULT_FINAL_LEARNING_RATE_FRACTION:.0%}" if optimizer is None
                      else type(optimizer).__name__),
        "seconds": round(seconds, 3),
    }
