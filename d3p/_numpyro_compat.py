# SPDX-License-Identifier: Apache-2.0
"""What makes :class:`d3p.svi.DPSVI` take NumPyro code as NumPyro users write it.

``numpyro.infer.SVI(model, guide, optim, loss, **static_kwargs)`` names its
ELBO ``loss``; d3p 0.2 named it ``per_example_loss``: both are accepted
(:func:`elbo`). d3p's examples pass the data size as ``DPSVI(..., N=N)``; a
model that declares its records plate with a constant size and does not take
``N`` is not given it (:func:`split_static_kwargs`), and the ``N`` given is
then checked against the plate (:func:`check_declared_size`). Keys: see
:func:`d3p.random.as_key` (JAX keys are converted where a key enters).
"""

import inspect
from typing import Mapping, Optional, Tuple

from d3p import _validate


def elbo(loss, per_example_loss):
    """The ELBO of :class:`DPSVI`, given as ``loss`` (NumPyro's name, the fourth
    positional argument) or ``per_example_loss`` (d3p 0.2's keyword)."""
    if loss is not None and per_example_loss is not None:
        raise TypeError(
            "Expected the ELBO once, as loss (numpyro's name, the fourth positional argument) or as "
            f"per_example_loss (d3p 0.2's name), got both: loss={type(loss).__name__}, "
            f"per_example_loss={type(per_example_loss).__name__}."
        )
    value = per_example_loss if loss is None else loss
    name = "per_example_loss" if loss is None else "loss"
    if value is None:
        raise TypeError("Expected loss, the ELBO to minimise (e.g. numpyro.infer.Trace_ELBO()), got none.")
    if not callable(getattr(value, "loss", None)):
        raise TypeError(
            f"Expected {name} to be an ELBO with a loss method (e.g. numpyro.infer.Trace_ELBO()), got an "
            f"object of type {type(value).__name__}."
        )
    return value


def arguments(model, guide, loss, per_example_loss, static_kwargs: Mapping) -> Tuple[object, dict, Optional[int]]:
    """``(ELBO, static_kwargs, declared N)`` of the constructor's arguments:
    :func:`elbo` and :func:`split_static_kwargs`."""
    return (elbo(loss, per_example_loss), *split_static_kwargs(model, guide, static_kwargs))


def _takes_keyword(fn, keyword: str, *, var_keyword: bool) -> bool:
    """Whether ``fn`` accepts the keyword argument ``keyword``: a parameter of
    that name, or with ``var_keyword`` also ``**kwargs``; True where its
    signature cannot be read."""
    try:
        parameters = inspect.signature(_validate._unwrapped(fn)).parameters.values()
    except (TypeError, ValueError):
        return True
    return any((var_keyword and p.kind is p.VAR_KEYWORD) or (p.name == keyword and p.kind is not p.POSITIONAL_ONLY)
               for p in parameters)


def split_static_kwargs(model, guide, static_kwargs: Mapping) -> Tuple[dict, Optional[int]]:
    """``(static_kwargs for model and guide, declared N)``.

    ``N`` is passed on to the model and the guide, as every static keyword
    argument, where the model takes it (a parameter ``N`` or ``**kwargs``:
    d3p 0.2's models, ``model(x, N)``) or the guide names it. Otherwise (a
    NumPyro model whose records plate declares its size itself, with an
    autoguide or a guide without ``N``) it is not passed: it is the data size
    the caller declares, which :func:`check_declared_size` compares with the
    plate's."""
    static_kwargs = dict(static_kwargs)
    if ("N" not in static_kwargs or _takes_keyword(model, "N", var_keyword=True)
            or _takes_keyword(guide, "N", var_keyword=False)):
        return static_kwargs, None
    N = static_kwargs.pop("N")
    return static_kwargs, _validate.integer("N", N, minimum=1)


def check_declared_size(declared: Optional[int], plates: Mapping[str, int]) -> None:
    """Raise unless the size ``declared`` (``DPSVI(..., N=...)`` that the model
    does not take) is that of the model's records plate(s) ``plates``
    (name -> declared size): both public constants."""
    if declared is None:
        return
    other = {name: size for name, size in plates.items() if size != declared}
    if other:
        raise ValueError(
            f"Expected the records plate(s) of the model to declare the data size given as DPSVI(..., "
            f"N={declared}), got {other}. The model does not take N, so N is not passed to it: the plate's "
            "own size is the N by which each step is scaled. Pass the N the plate declares, or none."
        )
