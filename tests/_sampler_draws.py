"""Draws of several samplers, each compiled once, shared by the sampler tests."""

import jax
import jax.numpy as jnp
import numpy as np

import d3p.random


def draw_all(samplers):
    """Batches of several samplers, each compiled once (compiling a sampler costs far
    more than drawing from it): ``samplers`` maps a name to ``(sampler, num, seed)``,
    and batch ``i < num`` uses the key ``fold_in(PRNGKey(seed), i)``. Returns a dict
    of numpy ``(indices, mask)``."""
    out = {}
    for name, (sampler, num, seed) in samplers.items():
        key = d3p.random.PRNGKey(seed)
        batch = jax.jit(jax.vmap(lambda i, sampler=sampler, key=key: sampler.sample(d3p.random.fold_in(key, i))))
        indices, mask = batch(jnp.arange(num, dtype=jnp.uint32))
        out[name] = (np.asarray(indices), np.asarray(mask))
    return out
