"""Conversions between NumPy and this backend's arrays, and state dicts saved as files.

A state dict is saved as an uncompressed `.npz` holding one array per name, read back without pickle,
so the same file loads into every backend and every array comes back bit for bit.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np


def asarray(x: Any) -> np.ndarray:
    """NumPy array -> this backend's array, same dtype (NumPy: the array itself)."""
    return np.asarray(x)


def to_numpy(x: Any) -> np.ndarray:
    """This backend's array -> NumPy array."""
    return np.asarray(x)


def save_state_dict(path: str | os.PathLike, state: Mapping[str, Any]) -> None:
    """Write {name: array} to an `.npz` file (no pickle); load_state_dict of any backend reads it."""
    with open(path, "wb") as file:  # a file object, so that np.savez keeps the path as given
        np.savez(file, **{name: to_numpy(value) for name, value in state.items()})


def load_state_dict(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Read a file written by save_state_dict into {name: array of this backend}."""
    with np.load(path, allow_pickle=False) as arrays:
        return {name: asarray(arrays[name]) for name in arrays.files}
