"""The DP-VI set-ups of :func:`d3p.twin.fit`'s default mixture, kept between fits.

A set-up (model, guide, optimizer, :class:`d3p.svi.DPSVI` and its
initialisation) is kept under the public settings it was built from (the
schema, N, the number of components and steps, C and the step size), for
the last :data:`KEPT` settings. A fit at another ε with the same settings
reuses it: its DPSVI's compiled steps take σ as an argument
(:func:`d3p._private_step.traced_sigma`), so the fit compiles nothing. Only
set-ups whose steps take σ as an argument are kept (Gaussian noise, a fixed
C, σ > 0). Nothing of the data is kept: the compiled programs and the
model's public facts only.
"""

from collections import OrderedDict
from typing import Callable, NamedTuple, Optional

from d3p import _validate

__all__ = ["MixtureSetup", "SETUPS", "KEPT", "kept"]


class MixtureSetup(NamedTuple):
    """A mixture fit's DP-VI set-up: the :class:`~d3p.svi.DPSVI`, its
    initialisation ``init(key, x0)``, the model, the guide and their saved
    descriptions."""

    svi: object
    init: Callable
    model: Callable
    model_spec: dict
    guide: Callable
    guide_spec: dict


#: The kept set-ups by their settings, most recently used last.
SETUPS: "OrderedDict[tuple, MixtureSetup]" = OrderedDict()
#: How many set-ups are kept.
KEPT = 2


def kept(key: Optional[tuple], build: Callable[[], MixtureSetup], dp_scale: float) -> MixtureSetup:
    """The set-up kept under ``key`` with its noise multiplier set to
    ``dp_scale``, else ``build()`` (kept under ``key`` if its steps take σ as
    an argument); ``key=None``: ``build()``, not kept."""
    if key is not None and key in SETUPS:
        SETUPS.move_to_end(key)
        setup = SETUPS[key]
        setup.svi.dp_scale = _validate.positive("dp_scale", dp_scale)
        return setup
    setup = build()
    if key is not None and setup.svi.noise == "gaussian":   # the caller keys only a fixed C and σ > 0
        SETUPS[key] = setup
        while len(SETUPS) > KEPT:
            SETUPS.popitem(last=False)
    return setup
