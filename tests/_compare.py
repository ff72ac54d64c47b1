"""Comparison helpers for the tests: norm-wise relative error, as the spec defines it."""

from __future__ import annotations

import numpy as np

TOLERANCE = {np.dtype(np.float32): 1e-4, np.dtype(np.float64): 1e-9}


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """max |actual - expected| / max |expected| over the whole array (0 when both are all zeros)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    scale = np.max(np.abs(expected), initial=0.0)
    error = np.max(np.abs(actual - expected), initial=0.0)
    return float(error / scale) if scale > 0 else float(error)


def assert_close(actual: np.ndarray, expected: np.ndarray, rtol: float, what: str = "") -> None:
    """Same shape, NaN in the same places, and relative error at most rtol."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    nan_a, nan_e = np.isnan(actual), np.isnan(expected)
    assert np.array_equal(nan_a, nan_e), f"{what}: NaN positions differ"
    error = relative_error(np.where(nan_a, 0, actual), np.where(nan_e, 0, expected))
    assert error <= rtol, f"{what}: relative error {error:.3g} > {rtol:.3g}"
