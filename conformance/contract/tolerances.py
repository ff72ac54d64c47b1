"""The tolerances and the one error measure: every number the suite and the tests accept is read from
`tolerances.json` (SPEC.md section 9 says why each is what it is), every relative error is
`relative_error`, and every measure printed beside its tolerance is printed by `shown`.

    from conformance.contract.tolerances import TOLERANCES, relative_error
    TOLERANCES["float64"]["values"]      # 1e-9

Imports NumPy alone.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

_READ = json.loads((Path(__file__).parent / "tolerances.json").read_text())

# {dtype: {measure: the largest accepted value}}; "-" holds the rows whose cases mix dtypes (errors)
TOLERANCES: dict[str, dict[str, float]] = {dtype: limits for dtype, limits in _READ.items()
                                           if not dtype.startswith("_")}


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """max|actual - expected| / max|expected| over the whole array, the expected array the reference;
    max|actual - expected| where the reference is all zeros.

    Entries equal in both (NaN in both, or the same infinity) count as exact; NaN in only one of them,
    or a shape mismatch, gives inf.
    """
    a, b = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    if a.shape != b.shape or np.any(np.isnan(a) != np.isnan(b)):
        return math.inf
    same = (a == b) | np.isnan(b)  # also matching infinities, where a - b would be NaN
    with np.errstate(invalid="ignore"):  # inf - inf in the entries `same` replaces
        diff = np.where(same, 0.0, np.abs(a - b))
    reference = np.max(np.abs(b), where=np.isfinite(b), initial=0.0)
    return float(np.max(diff, initial=0.0) / (reference if reference > 0 else 1.0))


def shown(measure: float, tolerance: float, digits: int = 2) -> tuple[str, str]:
    """A measure and its tolerance as printed: in e-notation with the fewest significant digits, at least `digits`,
    at which the printed numbers compare as the numbers do (1.0004e-4 over 1e-4 prints as 1.0004e-04 and
    1.0000e-04, not as 1.0e-04 twice), so that every verdict can be checked from the printed numbers."""
    for places in range(digits - 1, 17):  # 17 significant digits give every float64 back exactly
        printed = f"{measure:.{places}e}", f"{tolerance:.{places}e}"
        if (float(printed[0]) <= float(printed[1])) == (measure <= tolerance):
            return printed
    return repr(measure), repr(tolerance)
