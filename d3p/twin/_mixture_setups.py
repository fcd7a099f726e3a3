"""The DP-VI set-ups of :func:`d3p.twin.fit`'s default mixture, kept between fits.

A set-up (model, guide, optimizer, :class:`d3p.svi.DPSVI` and its
initialisation) is kept under the public settings it was built from (the
schema, N and the number of components), for the last :data:`KEPT`
settings. A fit at another ε, C, step size or number of steps with the
same settings reuses it: its DPSVI's compiled steps take σ, C, the step
size and the number of steps as arguments
(:func:`d3p._private_step.traced_sigma`,
:func:`d3p._private_step.traced_threshold`,
:class:`d3p._run_plan.CosineStepSize`; the number of steps where the steps
run on CPU), so the fit compiles nothing.
Only set-ups whose steps take σ and C as arguments are kept (Gaussian
noise, a fixed finite C, σ > 0). Nothing of the data is kept: the compiled programs and the
model's public facts only.
"""

from collections import OrderedDict
from typing import Callable, NamedTuple, Optional

from d3p import _private_step, _validate

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


def kept(key: Optional[tuple], build: Callable[[], MixtureSetup], dp_scale: float,
         clipping_threshold: float, learning_rate: float, num_steps: int) -> MixtureSetup:
    """The set-up kept under ``key`` with its noise multiplier set to
    ``dp_scale``, its clipping threshold to ``clipping_threshold`` and its
    step-size schedule to ``learning_rate`` over ``num_steps``, else
    ``build()`` (kept under ``key`` if its steps take σ and C as arguments);
    ``key=None``: ``build()``, not kept."""
    if key is not None and key in SETUPS:
        SETUPS.move_to_end(key)
        setup = SETUPS[key]
        setup.svi.dp_scale = _validate.positive("dp_scale", dp_scale)
        setup.svi.clipping_threshold = _validate.positive("clipping_threshold", clipping_threshold)
        schedule = _private_step.step_schedule_of(setup.svi)
        schedule.learning_rate = _validate.positive("learning_rate", learning_rate)
        schedule.num_steps = _validate.integer("num_steps", num_steps, minimum=1)
        return setup
    setup = build()
    # the caller keys only a fixed C and σ > 0
    if key is not None and setup.svi.noise == "gaussian" and _private_step.traced_threshold(setup.svi):
        SETUPS[key] = setup
        while len(SETUPS) > KEPT:
            SETUPS.popitem(last=False)
    return setup
