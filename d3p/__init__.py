"""d3p: differentially private probabilistic programming for NumPyro.

Importing d3p has no side effects: it changes no JAX configuration and
selects no platform. The submodules and :class:`~d3p.svi.DPSVI` are loaded
when first used (``d3p.svi``, ``from d3p import DPSVI``), so that
``python -m d3p --help`` and ``import d3p`` do not pay for importing JAX and
NumPyro.
"""

import importlib
from typing import Any

from d3p.version import VERSION

__version__ = VERSION

_SUBMODULES = (
    "accounting",
    "discrete",
    "dputil",
    "gmm",
    "gradients",
    "ledger",
    "minibatch",
    "modelling",
    "optimizers",
    "random",
    "selection",
    "svi",
    "util",
)
_FROM_SVI = ("DPSVI", "DPSVIState")

__all__ = [*_SUBMODULES, *_FROM_SVI, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        module = importlib.import_module(f"d3p.{name}")
        globals()[name] = module
        return module
    if name in _FROM_SVI:
        value = getattr(importlib.import_module("d3p.svi"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'd3p' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
