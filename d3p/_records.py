"""The per-record data of a DPSVI step: validation and conversion of the
arguments (every argument is per-record data), and the dependency walk on a
jaxpr that proves the observation scale a public constant."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from d3p import _inputs


#: How the data-validation errors say where shared values belong.
_SHARED_VALUES_HINT = (
    "Every argument of init/update/evaluate/run (positional or keyword) is per-record data "
    "with one row per record; values shared by all records (e.g. N or group-level "
    "covariates) go to the DPSVI constructor as keyword arguments: DPSVI(..., name=value)."
)


def _leaf_name(path) -> str:
    """``args[i]...`` or ``'key'...`` for a path into ``(args, kwargs)``."""
    head, rest = path[1], path[2:]
    name = f"args[{head.idx}]" if path[0].idx == 0 else repr(head.key)
    return name + "".join(str(p) for p in rest)


#: Arrays refused for their dtype, by kind: the item size of a NumPy text
#: dtype (``<U30``) is the length of the longest text NumPy saw, so it is
#: never named.
_NON_NUMERIC = {"O": "Python objects (dtype object)", "U": "text (a NumPy str dtype)",
                "S": "bytes (a NumPy bytes dtype)", "V": "raw or structured records (a NumPy void dtype)"}


def _check_record_leaf(name: str, x):
    """Raise unless ``x`` is an array of numbers or booleans with a leading
    (records) dimension."""
    if isinstance(x, (bool, int, float, complex, np.generic)) or (
        isinstance(x, (jax.Array, np.ndarray)) and np.ndim(x) == 0
    ):   # named by its type only: the message never quotes a value
        raise ValueError(
            f"Expected {name} to be an array with one row per record, got a scalar "
            f"({type(x).__name__}). {_SHARED_VALUES_HINT}"
        )
    if not isinstance(x, (jax.Array, np.ndarray)):
        raise TypeError(
            f"Expected {name} to be an array with one row per record, got an object of "
            f"type {type(x).__name__}. {_SHARED_VALUES_HINT}"
        )
    if not (jnp.issubdtype(x.dtype, jnp.number) or jnp.issubdtype(x.dtype, jnp.bool_)):
        raise TypeError(
            f"Expected {name} to hold numbers or booleans, got an array of "
            f"{_NON_NUMERIC.get(x.dtype.kind, 'dtype ' + str(x.dtype))}. Convert categorical "
            "or text columns to numbers first (e.g. category codes), as an array of a numeric dtype."
        )


def _records(args, kwargs, *, expected_size=None, what="batch"):
    """The per-record data of ``(args, kwargs)``: ``(leaves, treedef, size)``.

    Every leaf is per-record, converted by the fixed rule of
    :mod:`d3p._inputs` (no record's value chooses a dtype, a shape or an
    error): arrays keep their own dtype (canonicalised as JAX does); a plain
    list or tuple of records is one column and every pandas column becomes
    JAX's default float dtype, element by element (NaN for an element that is
    not a real number); lists, tuples and dicts holding arrays are pytree
    containers. Each leaf must be a numeric or boolean array whose leading
    dimension is the number of records, the same for all (``expected_size``
    if given). Scalars and other objects are refused with an error naming the
    argument and its type, never a value: nothing is treated as shared by the
    records. The caller's data is never modified.
    ``jax.tree.unflatten(treedef, leaves)`` gives the (converted) ``(args, kwargs)``.
    """
    def convert(arg):
        return jax.tree.map(_inputs.as_records_array, arg,
                            is_leaf=lambda x: _inputs.is_column(x) or _inputs.is_pandas(x))

    converted = (tuple(convert(a) for a in args), {k: convert(v) for k, v in kwargs.items()})
    paths, treedef = jax.tree_util.tree_flatten_with_path(converted)
    leaves = [x for _, x in paths]
    names = [_leaf_name(path) for path, _ in paths]
    size, first_name = expected_size, None
    for name, leaf in zip(names, leaves):
        _check_record_leaf(name, leaf)
        n = int(np.shape(leaf)[0])
        if size is None:
            size, first_name = n, name
        elif n != size:
            ref = f"{first_name} has {size}" if first_name else f"the {what} has {size} records"
            raise ValueError(
                f"Expected every data argument to hold one row per record, but {name} has "
                f"leading dimension {n} and {ref}. {_SHARED_VALUES_HINT}"
            )
    if size is None:
        raise ValueError(
            "Expected at least one per-record data array among the arguments (DP-VI "
            "needs the records to clip each one's contribution), got none. DPSVI protects the "
            "records of a data set passed as arguments (one row per record) to a model that "
            "declares them under numpyro.plate('data', N, subsample_size=xs.shape[0]); a model "
            "without data arguments (data held as constants in its code, or none) has no records "
            "to protect: fit it with numpyro.infer.SVI."
        )
    return leaves, treedef, size


def _depends_on_inputs(jaxpr) -> list:
    """For each output of ``jaxpr``: whether it may depend on any input.

    A conservative forward walk: every output of an equation with at least one
    dependent operand is dependent, whatever the equation computes (calls,
    loops and conditionals included, without looking inside them). So False
    is a proof of independence; True may be a false alarm.
    """
    dependent = set(jaxpr.invars)
    for eqn in jaxpr.eqns:
        if any(isinstance(v, jex_core.Var) and v in dependent for v in eqn.invars):
            dependent.update(eqn.outvars)
    return [isinstance(v, jex_core.Var) and v in dependent for v in jaxpr.outvars]


def _evaluate_constant_outputs(closed) -> list:
    """The outputs of the closed jaxpr ``closed``, all independent of its
    inputs (see :func:`_depends_on_inputs`), evaluated now from its constants
    alone: only the equations they need are run, without any input."""
    jaxpr = closed.jaxpr
    needed = {v for v in jaxpr.outvars if isinstance(v, jex_core.Var)}
    kept = []
    for eqn in reversed(jaxpr.eqns):
        if any(v in needed for v in eqn.outvars):
            kept.append(eqn)
            needed.update(v for v in eqn.invars if isinstance(v, jex_core.Var))
    info = jaxpr.debug_info
    info = info._replace(arg_names=()) if info is not None else None  # the slice has no inputs
    sliced = jaxpr.replace(invars=[], eqns=kept[::-1], debug_info=info)
    with jax.ensure_compile_time_eval():
        return jax.core.eval_jaxpr(sliced, closed.consts)


