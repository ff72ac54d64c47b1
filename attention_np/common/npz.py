"""The state-dict file format of every backend: an uncompressed `.npz` holding one NumPy array per name,
read back without pickle, so the same file loads into every backend and every array comes back bit for bit.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np


def save(path: str | os.PathLike, arrays: Mapping[str, np.ndarray]) -> None:
    """Write {name: NumPy array} to an `.npz` file at `path`, exactly that path (no `.npz` appended)."""
    with open(path, "wb") as file:  # a file object, so that np.savez keeps the path as given
        np.savez(file, **arrays)


def load(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Read a file written by `save` into {name: NumPy array}, in the order written, without pickle."""
    with np.load(path, allow_pickle=False) as arrays:
        return {name: arrays[name] for name in arrays.files}
