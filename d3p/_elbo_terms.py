"""The ELBO of one DP-VI step, split into per-record and data-independent terms.

Private helper of :class:`d3p.svi.DPSVI` (its ``formulation`` argument). The
ELBO loss of a batch is a sum over sample sites. A site inside a plate over
the records (a subsampling plate holding an observed site: the likelihood,
and local latent variables such as a VAE's per-record code) has one term per
record that reads that record's row; every other site (global latent
variables: their prior and their guide density) has a term that depends on
the variational parameters and the Monte Carlo draw only. DPSVI clips each
record's own terms and adds the global ones once per step, after the noise:

- ``"per_record"``: each record's whole ELBO (with the global terms weighted
  ``1 / N``) with its own guide sample, clipped (d3p 0.2);
- ``"own_sample"``: each record's local terms with its own guide sample,
  clipped; the global terms once per step from one further draw;
- ``"shared_sample"``: one draw of the global latent variables per step,
  shared by all records and by the global terms (as NumPyro's SVI draws one
  sample per step); local latent variables still get one draw per record.
- ``"aligned"``: the draw of ``"shared_sample"``, but what each record
  contributes (and what is clipped and noised) is the gradient of its terms
  with respect to the *values* of the global latent variables (and to the
  parameters its terms read directly: a model's own parameters, a local
  guide's), not to the guide's parameters. The gradient for the guide's
  parameters of the global variables follows by the chain rule through the
  shared draw, after the noise (:func:`aligned_terms`). A guide's location
  and scale then see the same noisy vector, the scale's part multiplied by
  the standardised draw (Jälkö, Prediger, Honkela & Kaski, "DPVIm:
  Differentially private variational inference improved", TMLR 2023): the
  noise no longer drives the scales, whose own gradient is weak.

Keys: under ``"shared_sample"`` every unobserved sample site gets its key by
name (:class:`SiteKeys`): ``fold_in(record_key, site)`` inside a records
plate; outside, the step's key of that site (:class:`SharedKey`: with
ChaCha20 more words of the call that gives the step's keys, else
``fold_in(shared_key, site)``), so the per-record terms and the global terms
see the same global draw whatever the order of the sites. The shared key
is a per-step key of the PRNG suite, independent of the data.

The global terms are evaluated on a public placeholder record (ones shaped
like one record), never on data, and are used only once an abstract trace
(:func:`split_facts`) proves that they do not depend on the record's values.
"""

import copy
import zlib
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core
from numpyro.handlers import replay, seed, substitute, trace
from numpyro.infer import Trace_ELBO, TraceMeanField_ELBO
from numpyro.primitives import Messenger

#: The values of DPSVI's ``formulation``.
FORMULATIONS = ("auto", "aligned", "shared_sample", "own_sample", "per_record")

#: The ELBOs whose per-site terms d3p can separate (``sum_sites=False``).
SPLITTABLE = (Trace_ELBO, TraceMeanField_ELBO)


def splittable(loss) -> bool:
    """Whether ``loss`` is exactly one of :data:`SPLITTABLE` (a subclass may
    compute its terms otherwise)."""
    return type(loss) in SPLITTABLE


def requested(formulation: str, loss) -> str:
    """The validated ``formulation`` for the ELBO ``loss``: an explicit split
    formulation needs a :data:`SPLITTABLE` ELBO."""
    if formulation in ("aligned", "shared_sample", "own_sample") and not splittable(loss):
        raise ValueError(
            f"Expected per_example_loss to be numpyro's Trace_ELBO or TraceMeanField_ELBO with "
            f"formulation={formulation!r}, got {type(loss).__name__}: d3p separates the ELBO's terms "
            "per sample site only for those. Use formulation='per_record' (or 'auto')."
        )
    return formulation


def _site_number(name: str) -> int:
    """A fixed 31-bit number of a site name (the data of its key's fold_in)."""
    return zlib.crc32(name.encode("utf-8")) & 0x7FFFFFFF


def _in_plates(msg, plates) -> bool:
    return any(frame.name in plates for frame in msg["cond_indep_stack"])


class SharedKey(NamedTuple):
    """The key of a step's draw shared by the batch, with the keys of the
    sites it draws computed once for the step, where each use would
    otherwise derive its own: the global loss, the shared draw and every
    record's loss read the same keys. With ChaCha20 they are words of the
    call that gives the step's keys (``d3p._private_step._step_keys``), else
    ``fold_in(key, site)`` (:func:`shared_site_keys`)."""

    key: jax.Array
    sites: dict


def shared_site_keys(key, names) -> SharedKey:
    """:class:`SharedKey` of ``key`` with the keys of the sites ``names``: for
    several sites one Threefry evaluation for all (``fold_in`` under
    ``vmap``: the same keys as ``fold_in(key, site)`` one by one); for one
    site its ``fold_in`` (vectorised over one site, the step compiled for
    CPU grew by some 300 operations)."""
    names = sorted(names)
    if len(names) < 2:
        return SharedKey(key, {name: jax.random.fold_in(key, _site_number(name)) for name in names})
    numbers = jnp.asarray([_site_number(name) for name in names], dtype=jnp.uint32)
    keys = jax.vmap(lambda number: jax.random.fold_in(key, number))(numbers)
    return SharedKey(key, {name: keys[i] for i, name in enumerate(names)})


def base_key(key):
    """The key of a :class:`SharedKey`, or ``key`` itself."""
    return key.key if isinstance(key, SharedKey) else key


class SiteKeys(Messenger):
    """Gives every unobserved sample site its Monte Carlo key by name:
    ``fold_in(record_key, site)`` inside one of ``plates`` (the records),
    outside the key a :class:`SharedKey` ``shared_key`` holds for the site,
    else ``fold_in(shared_key, site)``. Sites that already have a key
    or a value are left alone; a key given as None leaves its sites to the
    enclosing ``seed``."""

    def __init__(self, fn, plates, record_key, shared_key):
        self.plates = frozenset(plates)
        self.record_key = record_key
        self.shared_key = shared_key
        super().__init__(fn)

    def process_message(self, msg):
        if msg["type"] != "sample" or msg["is_observed"] or msg["value"] is not None:
            return
        if msg["kwargs"].get("rng_key") is not None:
            return
        local = _in_plates(msg, self.plates)
        base = self.record_key if local else self.shared_key
        if not local and isinstance(base, SharedKey) and msg["name"] in base.sites:
            msg["kwargs"]["rng_key"] = base.sites[msg["name"]]
        elif base is not None:
            msg["kwargs"]["rng_key"] = jax.random.fold_in(base_key(base), _site_number(msg["name"]))


def site_losses(loss, rng_key, params, model, guide, args, kwargs) -> dict:
    """The ELBO loss of ``loss`` (a :data:`SPLITTABLE` ELBO) per sample site:
    site name -> that site's part of ``-ELBO`` (scaled as in the model)."""
    per_site = copy.copy(loss)
    per_site.sum_sites = False
    return per_site.loss(rng_key, params, model, guide, *args, **kwargs)


def total(terms: dict, names, dtype) -> jax.Array:
    """The sum of ``terms`` over ``names`` (0 for none)."""
    parts = [jnp.asarray(terms[n]) for n in sorted(names) if n in terms]
    return sum(parts, jnp.zeros((), dtype))


class SplitFacts(NamedTuple):
    """Public facts of a model and guide for the split formulations, from an
    abstract trace of one record's shapes.

    - **global_sites** - the sites whose terms are evaluated once per step:
      outside every records plate in model and guide, and proven not to
      depend on the record (frozenset of names).
    - **dependent** - the sites outside the records plates whose terms may
      depend on the record's values (they make the split unusable).
    - **global_latents** - the model's latent (unobserved) sample sites
      outside every records plate that the guide draws: the values
      ``"aligned"`` differentiates (a latent without a guide site is drawn
      by the model from its prior, as under ``"shared_sample"``).
    - **reparameterized** - whether the guide draws every global latent
      variable from a continuous distribution with a reparameterised sample
      (``has_rsample``): what ``"auto"`` needs to choose ``"aligned"``.
    """

    global_sites: frozenset
    dependent: tuple
    global_latents: tuple = ()
    reparameterized: bool = True


def split_facts(loss, model, guide, constrain_fn, static_kwargs, param_structs, treedef, one_record,
                plates) -> SplitFacts:
    """:class:`SplitFacts` from the abstract shapes ``param_structs`` (the
    unconstrained parameters) and ``one_record`` (one record's leaves)."""
    roles = {}

    def global_terms(params, rng_key, leaves):
        args, kwargs = jax.tree.unflatten(treedef, [jnp.expand_dims(x, 0) for x in leaves])
        kwargs = {**kwargs, **static_kwargs}
        constrained = constrain_fn(params)
        guide_tr = trace(seed(substitute(guide, data=constrained), rng_key)).get_trace(*args, **kwargs)
        model_tr = trace(replay(seed(substitute(model, data=constrained), rng_key), guide_tr)).get_trace(
            *args, **kwargs)
        for tr in (guide_tr, model_tr):
            for name, site in tr.items():
                if site["type"] == "sample":
                    roles[name] = roles.get(name, False) or _in_plates(site, plates)
        latents[:] = sorted(n for n, site in model_tr.items() if site["type"] == "sample"
                            and not site["is_observed"] and not _in_plates(site, plates)
                            and guide_tr.get(n, {}).get("type") == "sample")
        smooth[:] = [getattr(guide_tr[n]["fn"], "has_rsample", False)
                     and not getattr(guide_tr[n]["fn"], "is_discrete", True) for n in latents]
        terms = site_losses(loss, rng_key, constrained, SiteKeys(model, plates, rng_key, rng_key),
                            SiteKeys(guide, plates, rng_key, rng_key), args, kwargs)
        outside[:] = sorted(n for n, local in roles.items() if not local and n in terms)
        return [jnp.asarray(terms[n]) for n in outside]

    outside, latents, smooth = [], [], []
    abstract_key = jax.eval_shape(jax.random.PRNGKey, 0)
    closed = jax.make_jaxpr(global_terms)(param_structs, abstract_key, list(one_record))
    num_records = len(one_record)
    record_vars = closed.jaxpr.invars[len(closed.jaxpr.invars) - num_records:] if num_records else []
    depends = _depends_on(closed.jaxpr, record_vars)
    dependent = tuple(n for n, d in zip(outside, depends) if d)
    return SplitFacts(frozenset(n for n in outside if n not in dependent), dependent, tuple(latents), all(smooth))


def _depends_on(jaxpr, inputs) -> list:
    """For each output of ``jaxpr``: whether it may depend on one of ``inputs``
    (a conservative forward walk, as :func:`d3p._records._depends_on_inputs`:
    False is a proof of independence)."""
    dependent = set(inputs)
    for eqn in jaxpr.eqns:
        if any(isinstance(v, jex_core.Var) and v in dependent for v in eqn.invars):
            dependent.update(eqn.outvars)
    return [isinstance(v, jex_core.Var) and v in dependent for v in jaxpr.outvars]


def placeholder_record(one_record) -> list:
    """Ones shaped like one record (a batch of one), the public values on which
    the global terms are evaluated."""
    return [jnp.ones((1,) + tuple(np.shape(x)), x.dtype) for x in one_record]


def record_loss_fn(svi, formulation: str, facts: SplitFacts, plates, treedef, scale: Optional[float],
                   key_impl, shared_key):
    """``loss(params, (key, leaves))`` of one record under a split
    ``formulation``: the terms of its sites other than ``facts.global_sites``,
    divided by the public ``scale`` unless it is None."""

    def record_loss(params, record):
        key, leaves = record
        if key_impl is not None:
            key = jax.random.wrap_key_data(key, impl=key_impl)
        args, kwargs = jax.tree.unflatten(treedef, [jnp.expand_dims(x, 0) for x in leaves])
        kwargs = {**kwargs, **svi.static_kwargs}
        constrained = svi.constrain_fn(params)
        if formulation == "shared_sample":
            model = SiteKeys(svi.model, plates, key, shared_key)
            guide = SiteKeys(svi.guide, plates, key, shared_key)
            terms = site_losses(svi.loss, base_key(shared_key), constrained, model, guide, args, kwargs)
        else:
            terms = site_losses(svi.loss, key, constrained, svi.model, svi.guide, args, kwargs)
        dtype = jnp.result_type(*jax.tree.leaves(params)) if jax.tree.leaves(params) else jnp.float32
        loss = total(terms, [n for n in terms if n not in facts.global_sites], dtype)
        return loss if scale is None else loss / scale

    return record_loss


def global_loss_fn(svi, facts: SplitFacts, plates, treedef, one_record, shared_key):
    """``loss(params)``: the global sites' terms of the ELBO loss, once, from
    the shared key, on a placeholder record (public)."""
    placeholder = placeholder_record(one_record)

    def global_loss(params):
        args, kwargs = jax.tree.unflatten(treedef, placeholder)
        kwargs = {**kwargs, **svi.static_kwargs}
        model = SiteKeys(svi.model, plates, shared_key, shared_key)
        guide = SiteKeys(svi.guide, plates, shared_key, shared_key)
        terms = site_losses(svi.loss, base_key(shared_key), svi.constrain_fn(params), model, guide, args, kwargs)
        dtype = jnp.result_type(*jax.tree.leaves(params)) if jax.tree.leaves(params) else jnp.float32
        return total(terms, facts.global_sites, dtype)

    return global_loss


def global_draws_fn(svi, facts: SplitFacts, plates, treedef, one_record, shared_key):
    """``draws(params) -> {site: value}``: the step's shared draw of the
    model's global latent variables (``facts.global_latents``) from the guide,
    on a placeholder record (public: the draw reads parameters and the shared
    key only, as :func:`global_loss_fn`)."""
    placeholder = placeholder_record(one_record)

    def draws(params):
        args, kwargs = jax.tree.unflatten(treedef, placeholder)
        kwargs = {**kwargs, **svi.static_kwargs}
        guide = SiteKeys(svi.guide, plates, shared_key, shared_key)
        tr = trace(seed(substitute(guide, data=svi.constrain_fn(params)), base_key(shared_key))).get_trace(
            *args, **kwargs)
        return {name: tr[name]["value"] for name in facts.global_latents}

    return draws


def aligned_terms(svi, facts: SplitFacts, plates, treedef, scale: Optional[float], key_impl, shared_key,
                  params, one_record):
    """``(record_loss_of, theta, pullback)`` of one step under ``"aligned"``.

    ``theta = (z, own)``: the shared draw ``z`` of the global latent
    variables and the parameters ``own`` that a record's terms read other than
    through ``z`` (found from the abstract trace of one record: public).
    ``record_loss_of(shared_key)(theta, record)`` is a record's loss as under
    ``"shared_sample"`` with the global latent variables set to ``z``: the
    mechanism clips and noises its gradient over ``theta``.
    ``pullback(noisy)`` maps a gradient over ``theta`` to one over all
    parameters: ``z``'s part through the vector-Jacobian product of the draw
    (it reads parameters and the shared key only), ``own``'s part in place,
    zeros elsewhere. Post-processing of the release."""
    draws = global_draws_fn(svi, facts, plates, treedef, one_record, shared_key)
    z, vjp = jax.vjp(draws, params)

    def loss_of(key_of_step):
        def record_loss(theta, record):
            z_, own = theta
            return _aligned_record_loss(svi, facts, plates, treedef, scale, key_impl, key_of_step,
                                        {**params, **own}, z_, record)
        return record_loss

    own_names = _own_parameters(svi, facts, plates, treedef, scale, key_impl, shared_key, params, z,
                                one_record)
    theta = (z, {name: params[name] for name in own_names})

    def pullback(noisy):
        noisy_z, noisy_own = noisy
        (grad,) = vjp(noisy_z)
        return {name: (g + noisy_own[name].astype(g.dtype)) if name in noisy_own else g
                for name, g in grad.items()}

    return loss_of, theta, pullback


def _aligned_record_loss(svi, facts, plates, treedef, scale, key_impl, shared_key, params, z, record):
    key, leaves = record
    if key_impl is not None:
        key = jax.random.wrap_key_data(key, impl=key_impl)
    args, kwargs = jax.tree.unflatten(treedef, [jnp.expand_dims(x, 0) for x in leaves])
    kwargs = {**kwargs, **svi.static_kwargs}
    model = SiteKeys(svi.model, plates, key, shared_key)
    guide = SiteKeys(substitute(svi.guide, data=z), plates, key, shared_key)
    terms = site_losses(svi.loss, base_key(shared_key), svi.constrain_fn(params), model, guide, args, kwargs)
    dtype = jnp.result_type(*jax.tree.leaves(params)) if jax.tree.leaves(params) else jnp.float32
    loss = total(terms, [n for n in terms if n not in facts.global_sites], dtype)
    return loss if scale is None else loss / scale


def _own_parameters(svi, facts, plates, treedef, scale, key_impl, shared_key, params, z, one_record) -> tuple:
    """The names of the parameters that one record's loss reads with the
    global latent variables set to ``z`` (an abstract trace of one record's
    shapes: public)."""
    structs = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), tree)  # noqa: E731
    record_structs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in one_record]
    key_struct = jax.eval_shape(lambda: jax.random.PRNGKey(0)) if key_impl is None else \
        jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=key_impl)))
    names = sorted(params)

    def loss(param_list, z_, record_key, leaves):
        return _aligned_record_loss(svi, facts, plates, treedef, scale, key_impl, shared_key,
                                    dict(zip(names, param_list)), z_, (record_key, leaves))

    param_list = [structs(params[n]) for n in names]
    closed = jax.make_jaxpr(loss)(param_list, structs(z), key_struct, record_structs)
    sizes = [len(jax.tree.leaves(p)) for p in param_list]
    used, start = [], 0
    for name, size in zip(names, sizes):
        leaf_vars = closed.jaxpr.invars[start:start + size]
        start += size
        if size and _depends_on(closed.jaxpr, leaf_vars)[0]:
            used.append(name)
    return tuple(used)


class AlignedStep(NamedTuple):
    """What a step under ``"aligned"`` needs to form its per-record losses
    (:meth:`terms`); the mechanism's caller recognises it in place of a loss."""

    svi: object
    facts: SplitFacts
    plates: frozenset
    treedef: object
    scale: Optional[float]
    key_impl: object
    one_record: tuple

    def terms(self, params, shared_key):
        """:func:`aligned_terms` at ``params`` with the step's shared key."""
        return aligned_terms(self.svi, self.facts, self.plates, self.treedef, self.scale, self.key_impl,
                             shared_key, params, self.one_record)
