"""Comparison helpers for the tests: the suite's norm-wise relative error and tolerances (one home:
conformance/contract/tolerances.py), and a backend's attention on NumPy inputs."""

from __future__ import annotations

import functools
import sys
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


def one_program(M: ModuleType, name: str, *arrays, d_out=None, **options) -> tuple:
    """M's function `name` on NumPy arrays (None allowed), its results as M's arrays; a vjp's are its out, its
    second result and its pullback's gradients at d_out. JAX's runs as one jax.jit per function and set of static
    options (the array options traced): eagerly, each primitive compiles apart at every new shape and set of
    options, several times the one program's cost. Where the claim is eager behaviour, tests call the backend
    directly."""
    arrays = [None if x is None else M.asarray(x) for x in arrays]
    traced = {key: M.asarray(x) for key, x in options.items() if isinstance(x, np.ndarray)}
    static = tuple((key, x) for key, x in options.items() if key not in traced)
    d_out = None if d_out is None else M.asarray(d_out)
    if M.__name__ != "attention_jax":
        return _pulled(getattr(M, name), *arrays, d_out=d_out, **dict(static), **traced)
    return _jitted(M.__name__, name, static)(*arrays, d_out=d_out, **traced)


def _pulled(function: Callable, *arrays, d_out=None, **options) -> tuple:
    """function(*arrays, **options), a vjp's pullback (its last result) taken at d_out."""
    results = function(*arrays, **options)
    return results if d_out is None else (*results[:-1], results[-1](d_out))


@functools.cache
def _jitted(backend: str, name: str, static: tuple) -> Callable:
    """_pulled of the JAX function `name` of the (imported) module `backend` under jax.jit, its static options
    bound: built once."""
    import jax

    function = getattr(sys.modules[backend], name)
    return jax.jit(lambda *arrays, d_out=None, **traced: _pulled(function, *arrays, d_out=d_out, **dict(static),
                                                               **traced))


def method_program(M: ModuleType, method: str, **options) -> Callable:
    """module.<method>(*arguments, **options) as a function of the module and its arguments (M's arrays); JAX's
    under one jax.jit, the module and the arguments traced pytrees, the options static: eagerly, each primitive
    of the module compiles apart at every shape, several times the one program's cost. Where the claim is eager
    behaviour, tests call the module directly."""
    def call(module, *arguments):
        return getattr(module, method)(*arguments, **options)

    if M.__name__ != "attention_jax":
        return call
    import jax

    return jax.jit(call)


__all__ = ["REORDERED", "TOLERANCE", "assert_close", "converted", "method_program", "one_program", "relative_error",
           "sdpa"]
