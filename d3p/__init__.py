"""d3p: differentially private probabilistic programming for NumPyro.

Importing d3p has no side effects: it changes no JAX configuration and
selects no platform. The submodules are re-exported explicitly below.
"""

from d3p import (accounting, discrete, dputil, gmm, gradients, minibatch, modelling, optimizers, random, selection,
                 svi, util)
from d3p.svi import DPSVI, DPSVIState
from d3p.version import VERSION

__version__ = VERSION

__all__ = [
    "accounting",
    "discrete",
    "dputil",
    "gmm",
    "gradients",
    "minibatch",
    "modelling",
    "optimizers",
    "random",
    "selection",
    "svi",
    "util",
    "DPSVI",
    "DPSVIState",
    "__version__",
]
