"""Conversions between NumPy and this backend's arrays, and state dicts saved as files.

A state dict is saved in the one file format of `attention_np.common.npz`: an uncompressed `.npz` holding
one array per name, read back without pickle, so the same file loads into every backend and every array
comes back bit for bit.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attention_np.common import npz


def asarray(x: Any) -> jax.Array:
    """NumPy array -> this backend's array, same dtype (JAX: float64 needs jax_enable_x64)."""
    # jax: device_put copies a NumPy array onto the device without compiling anything, where jnp.asarray
    # compiles a small copy program for every new shape and dtype
    array = jax.device_put(x) if isinstance(x, np.ndarray) else jnp.asarray(x)
    if hasattr(x, "dtype") and array.dtype != x.dtype:  # jax: without x64, float64 would become float32
        raise TypeError(f"asarray: JAX would turn {x.dtype} into {array.dtype}; enable 64-bit types with "
                        'jax.config.update("jax_enable_x64", True)')
    return array


def to_numpy(x: Any) -> np.ndarray:
    """This backend's array -> NumPy array."""
    return np.asarray(x)


def save_state_dict(path: str | os.PathLike, state: Mapping[str, Any]) -> None:
    """Write {name: array} to an `.npz` file (no pickle); load_state_dict of any backend reads it."""
    npz.save(path, {name: to_numpy(value) for name, value in state.items()})


def load_state_dict(path: str | os.PathLike) -> dict[str, jax.Array]:
    """Read a file written by save_state_dict into {name: array of this backend}."""
    return {name: asarray(value) for name, value in npz.load(path).items()}
