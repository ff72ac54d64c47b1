"""The tolerances and the one error measure: every number the suite and the tests accept is read from
`tolerances.json` (SPEC.md section 9 says why each is what it is), and every relative error is
`relative_error`.

    from conformance.tolerances import TOLERANCES, relative_error
    TOLERANCES["float64"]["values"]      # 1e-9

Imports NumPy alone.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

_TABLE = json.loads((Path(__file__).parent / "tolerances.json").read_text())

# {dtype: {measure: the largest accepted value}}; "-" holds the rows whose cases mix dtypes (errors)
TOLERANCES: dict[str, dict[str, float]] = {dtype: table for dtype, table in _TABLE.items() if not dtype.startswith("_")}


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
