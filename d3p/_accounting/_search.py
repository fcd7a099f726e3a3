# SPDX-License-Identifier: Apache-2.0
"""The one monotone root search of the accountants and the calibration.

Privacy needs the answer on a known side of the root (an ε that is not too
small, a σ that is not too small), which a root finder alone does not give:
:func:`safe_root` runs :func:`scipy.optimize.brentq` and then returns the
evaluated point on the safe side, so that the answer is always a point at
which the condition was checked.
"""

import math
import sys
from typing import Callable

from scipy import optimize

#: Finite stand-in for an infinite (or NaN: treated as unsafe) function value.
_HUGE = 1e300


def _finite(value: float) -> float:
    """``value`` with ±inf clipped to ±1e300 and NaN read as unsafe (+1e300)."""
    if math.isnan(value):
        return _HUGE
    return max(min(float(value), _HUGE), -_HUGE)


def safe_root(
    f: Callable[[float], float],
    unsafe: float,
    safe: float,
    *,
    xtol: float,
    rtol: float = 1e-15,
    maxiter: int = 200,
) -> float:
    """The point between ``unsafe`` and ``safe`` nearest to ``unsafe`` at which
    ``f(x) <= 0``, to tolerance, for ``f`` monotone on that interval.

    ``f(safe) <= 0`` is required (``ValueError`` otherwise); if ``f(unsafe)
    <= 0`` too, ``unsafe`` is returned. Otherwise :func:`scipy.optimize.brentq`
    narrows the bracket to a width of ``xtol + rtol * |x|`` and the evaluated
    end with ``f <= 0`` is returned: within that width of the root and never
    on the wrong side of it. Infinite values are clipped and NaN counts as
    ``f > 0``.
    """
    seen = {}

    def g(x: float) -> float:
        """f(x), clipped, evaluated once per point."""
        if x not in seen:
            seen[x] = _finite(f(x))
        return seen[x]

    if g(safe) > 0:
        raise ValueError(f"Expected f(safe) <= 0 at safe={safe!r}, got f(safe)={seen[safe]!r}.")
    if g(unsafe) <= 0:
        return unsafe
    optimize.brentq(g, unsafe, safe, xtol=xtol, rtol=max(rtol, 4 * sys.float_info.epsilon), maxiter=maxiter,
                    full_output=True, disp=False)
    return min((x for x, v in seen.items() if v <= 0), key=lambda x: abs(x - unsafe))
