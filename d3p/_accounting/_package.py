# SPDX-License-Identifier: Apache-2.0
"""Cross-check of certified Fourier values with the ``fourier-accountant``
package (its public ``get_delta_S``), under the substitute relation.

The package discretises the same privacy-loss distribution as
:mod:`d3p._accounting._fourier` by sampling its density at the grid points;
two implementations that disagree mean that neither value is trusted.
"""

import math
from typing import Optional, Sequence

import numpy as np

from d3p._accounting._names import Relation

#: The package's δ at the certified ε (same grid) may exceed the target by at
#: most this relative amount.
CHECK_RTOL = 2e-2
#: Finest grid for the package's check.
_CHECK_MAX_NX = 2 ** 22


def package_delta(pair: str, phases: Sequence, epsilon: float, nx: int, L: float) -> Optional[float]:
    """δ at ``epsilon`` of the midpoint pair (the only one checked, see
    :func:`agrees`) from the fourier-accountant package on the grid (nx, L);
    None where the package cannot evaluate it."""
    import fourier_accountant

    if pair != Relation.SUBSTITUTE:
        raise ValueError(f"The package check is for the substitute relation, got relation={pair!r}.")
    try:
        with np.errstate(all="ignore"):
            d = fourier_accountant.get_delta_S(
                target_eps=float(epsilon),
                sigma=np.array([p.sigma for p in phases], dtype=np.float64),
                q=np.array([p.q for p in phases], dtype=np.float64),
                ncomp=np.array([p.num_steps for p in phases], dtype=np.int64),
                nx=int(nx),
                L=float(L),
            )
        d = float(np.real(d))
    except (ValueError, FloatingPointError, OverflowError, ZeroDivisionError, IndexError, MemoryError):
        return None
    return d if math.isfinite(d) else None


def agrees(pair: str, phases: Sequence, epsilon: float, delta: float, nx: Optional[int], L: float) -> bool:
    """Independent check of a certified (ε, δ) of the midpoint pair.

    On the grid that certified ε, the package's δ at ε must not exceed δ by
    more than a relative :data:`CHECK_RTOL`. False means the two
    implementations disagree and neither value is trusted. The package samples
    the density at the grid points, which needs a finer grid than exact cell
    masses where the loss density is peaked (small σ): a δ above the target
    is rechecked on grids 4 and 16 times finer (bounded). Not applied to the
    add/remove pair, where the package's density is poorly sampled next to
    log(1 − q) (its δ there was measured at 0 to 20 times the tight value),
    nor where the package cannot evaluate (an exception, or δ > 1).
    """
    if pair != Relation.SUBSTITUTE or nx is None or not (epsilon > 0 and math.isfinite(epsilon)):
        return True
    n = int(nx)
    while True:
        d = package_delta(pair, phases, epsilon, n, L)
        if d is None or d > 1.0:
            return True   # the package cannot evaluate here: no evidence either way
        if d <= delta * (1.0 + CHECK_RTOL):
            return True
        n *= 4
        if n > min(16 * int(nx), _CHECK_MAX_NX):
            return False
