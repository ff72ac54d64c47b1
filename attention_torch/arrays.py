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
import torch

from attention_np.common import npz


def asarray(x: Any) -> torch.Tensor:
    """NumPy array -> this backend's array, same dtype (torch: a CPU tensor sharing the memory)."""
    if isinstance(x, np.ndarray):
        x = x if x.flags.writeable else x.copy()  # torch: a tensor cannot be read-only, so it gets a copy
        if x.dtype.name == "bfloat16":  # torch: as_tensor refuses ml_dtypes' bfloat16; the same bits, reinterpreted
            return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    return torch.as_tensor(x)


def to_numpy(x: Any) -> np.ndarray:
    """This backend's array -> NumPy array."""
    x = x.detach().cpu()
    if x.dtype == torch.bfloat16:  # torch: NumPy has no bfloat16; ml_dtypes (which JAX uses) provides one
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError("to_numpy of a bfloat16 tensor needs the ml_dtypes package (pip install ml_dtypes), "
                            "as NumPy has no bfloat16 of its own") from None
        return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)  # the same bits, reinterpreted
    return x.numpy()


def save_state_dict(path: str | os.PathLike, state: Mapping[str, Any]) -> None:
    """Write {name: array} to an `.npz` file (no pickle); load_state_dict of any backend reads it."""
    npz.save(path, {name: to_numpy(value) for name, value in state.items()})


def load_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read a file written by save_state_dict into {name: array of this backend}."""
    return {name: asarray(value) for name, value in npz.load(path).items()}
