"""Comparison helpers for the tests: the suite's norm-wise relative error and tolerances (one home:
conformance/tolerances.py)."""

from __future__ import annotations

import numpy as np

from conformance.tolerances import TOLERANCES, relative_error

TOLERANCE = {np.dtype(dtype): TOLERANCES[dtype]["values"] for dtype in ("float32", "float64")}


def assert_close(actual: np.ndarray, expected: np.ndarray, rtol: float, what: str = "") -> None:
    """Same shape, NaN in the same places, and relative error at most rtol."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    nan_a, nan_e = np.isnan(actual), np.isnan(expected)
    assert np.array_equal(nan_a, nan_e), f"{what}: NaN positions differ"
    error = relative_error(np.where(nan_a, 0, actual), np.where(nan_e, 0, expected))
    assert error <= rtol, f"{what}: relative error {error:.3g} > {rtol:.3g}"


__all__ = ["TOLERANCE", "assert_close", "relative_error"]
