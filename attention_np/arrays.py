"""Conversions between NumPy and this backend's arrays, and state dicts saved as files.

A state dict is saved in the one file format of `attention_np.common.npz`: an uncompressed `.npz` holding
one array per name, read back without pickle, so the same file loads into every backend and every array
comes back bit for bit.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from attention_np.common import npz


def asarray(x: Any) -> np.ndarray:
    """NumPy array -> this backend's array, same dtype (NumPy: the array itself; ml_dtypes' bfloat16 too, which
    the NumPy backend holds but does not compute with: its functions take float16, float32 and float64)."""
    return np.asarray(x)


def to_numpy(x: Any) -> np.ndarray:
    """This backend's array -> NumPy array."""
    return np.asarray(x)


def save_state_dict(path: str | os.PathLike, state: Mapping[str, Any]) -> None:
    """Write {name: array} to an `.npz` file (no pickle); load_state_dict of any backend reads it."""
    npz.save(path, {name: to_numpy(value) for name, value in state.items()})


def load_state_dict(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Read a file written by save_state_dict into {name: array of this backend}."""
    return {name: asarray(value) for name, value in npz.load(path).items()}
