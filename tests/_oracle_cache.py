"""The float64 oracle's answers kept for a test file that runs the suite on many modules: the suite draws the same
cases for one seed whatever the module is (test_partial_contract.py shows it), so a file that checks twenty
variants of one module asks the oracle the same questions twenty times, most of them from the gradient rows'
central differences. Within `oracle_answered_once()` (a test file's module-scoped fixture) the suite asks each
question once: the same oracle, the same case (its every array compared bit for bit, a function by identity), a
fresh copy of the same arrays.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from conformance.run import checks, fixed_checks, gradient_checks

USERS = (checks, fixed_checks, gradient_checks)  # the modules that ask the oracle through `expected`


class _Same:
    """An object compared by identity (a mask or score function), held so that its id is never reused."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.value is self.value

    def __hash__(self) -> int:
        return id(self.value)


def _key(x: Any) -> Any:
    """What the oracle reads of x, exactly: arrays by dtype, shape and bytes; numbers by repr (-0.0 is not 0.0, a
    NaN equals itself); tuples, lists and dicts entry by entry, in order; anything else by identity."""
    if isinstance(x, np.ndarray) and not x.dtype.hasobject:
        return (np.ndarray, x.dtype, x.shape, x.tobytes())  # dtypes are equal only if the same (bfloat16 too)
    if x is None or isinstance(x, bool | int | float | str | np.generic):
        return (type(x), repr(x))
    if isinstance(x, tuple | list):
        return (type(x), tuple(_key(item) for item in x))
    if isinstance(x, dict):
        return (dict, tuple((name, _key(value)) for name, value in x.items()))
    return _Same(x)


def _copy(pair: tuple) -> tuple:
    """(out, weights) with fresh arrays: a caller that writes into its answer changes no later one."""
    copied = [x.copy() if isinstance(x, np.ndarray) else x for x in pair]
    return type(pair)(*copied) if hasattr(pair, "_fields") else tuple(copied)


def remembering(oracle: Callable[..., Any]) -> Callable[..., Any]:
    """`oracle` (checks.expected's signature) answering each question once."""
    answers: dict[Any, Any] = {}

    def expected(case, precision: str = "float64", *, fused_bias: bool = True):
        key = (_key(case), precision, fused_bias)
        if key not in answers:
            answers[key] = _copy(oracle(case, precision, fused_bias=fused_bias))
        return _copy(answers[key])
    return expected


@contextmanager
def oracle_answered_once() -> Iterator[None]:
    """Within it, the suite's `expected` (checks, fixed_checks and gradient_checks read it) answers each question
    once."""
    shared = remembering(checks.expected)
    with pytest.MonkeyPatch.context() as patch:
        for module in USERS:
            patch.setattr(module, "expected", shared)
        yield
