"""Comparison helpers for the tests: the suite's norm-wise relative error and tolerances (one home:
conformance/contract/tolerances.py), and a backend's attention on NumPy inputs."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import numpy as np

from conformance.contract.tolerances import TOLERANCES, relative_error

TOLERANCE = {np.dtype(dtype): TOLERANCES[dtype]["values"] for dtype in ("float32", "float64")}
REORDERED = TOLERANCES["float64"]["reordered"]  # float64: the same math computed another way (SPEC.md section 9)


def assert_close(actual: np.ndarray, expected: np.ndarray, rtol: float, what: str = "") -> None:
    """Same shape, NaN in the same places, and relative error at most rtol."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    nan_a, nan_e = np.isnan(actual), np.isnan(expected)
    assert np.array_equal(nan_a, nan_e), f"{what}: NaN positions differ"
    error = relative_error(np.where(nan_a, 0, actual), np.where(nan_e, 0, expected))
    assert error <= rtol, f"{what}: relative error {error:.3g} > {rtol:.3g}"


def central_differences(f: Callable[[np.ndarray], np.ndarray], x: np.ndarray, d_out: np.ndarray,
                        h: float) -> np.ndarray:
    """d <f(x), d_out> / dx, entry by entry: (<f(x + h e_i), d_out> - <f(x - h e_i), d_out>) / 2h."""
    grad = np.zeros_like(x)
    for index in np.ndindex(x.shape):
        step = np.zeros_like(x)
        step[index] = h
        grad[index] = np.sum((f(x + step) - f(x - step)) * d_out) / (2 * h)
    return grad


def converted(M: ModuleType, value: object) -> object:
    """NumPy arrays become M's arrays; Python values stay as they are."""
    return M.asarray(value) if isinstance(value, np.ndarray) else value


def sdpa(M: ModuleType, q, k, v, mask=None, **options) -> tuple[np.ndarray, np.ndarray | None]:
    """M's attention on NumPy inputs, every array option converted to M's arrays; outputs as NumPy arrays."""
    options = {name: converted(M, value) for name, value in options.items()}
    out, weights = M.scaled_dot_product_attention(*(M.asarray(x) for x in (q, k, v)), converted(M, mask), **options)
    return M.to_numpy(out), None if weights is None else M.to_numpy(weights)


__all__ = ["REORDERED", "TOLERANCE", "assert_close", "converted", "relative_error", "sdpa"]
