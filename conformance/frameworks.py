"""What the suite needs to know about the framework behind a module: its randomness, how its code runs
best (JAX: traced once per shape with jit), and the precision settings that make float32 mean float32.

The framework is read off the module itself (the type `asarray` returns), so any implementation of the
contract is checked the same way as ours.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any, NamedTuple

BUILT_IN = ("attention_np", "attention_jax", "attention_torch")
DTYPES = ("float16", "float32", "float64", "bool", "int32", "int64")  # every framework's


def import_modules(names: Sequence[str]) -> tuple[dict[str, ModuleType], dict[str, str]]:
    """({name: module} for those that import, {name: why not} for the others)."""
    modules, skipped = {}, {}
    for name in names:
        try:
            modules[name] = importlib.import_module(name)
        except Exception as error:  # a missing framework skips that backend only
            skipped[name] = f"{type(error).__name__}: {error}"
    return modules, skipped


class Framework(NamedTuple):
    name: str  # "numpy", "jax" or "torch"
    rng: Callable[[int], Any]  # seed -> the backend's rng argument
    stage: Callable[[Callable], Callable]  # how a whole operation runs (JAX: jit)
    pinned: Callable[[], contextlib.AbstractContextManager[str]]  # precision settings for a run
    dtypes: tuple[str, ...] = ()  # the dtypes its arrays have, as NumPy names (bfloat16: ml_dtypes)


def framework_of(module: ModuleType) -> Framework:
    """The framework whose arrays `module.asarray` returns."""
    import numpy as np

    kind = type(module.asarray(np.zeros(1, np.float32))).__module__.split(".")[0]
    if kind in ("jax", "jaxlib"):
        return Framework("jax", _jax_rng, _jax_stage, _jax_precision, (*DTYPES, "bfloat16"))
    if kind == "torch":
        return Framework("torch", _torch_rng, _eager, _torch_precision, (*DTYPES, "bfloat16"))
    return Framework("numpy", _numpy_rng, _eager, _no_settings, DTYPES)


def _eager(call: Callable) -> Callable:
    return call


def _numpy_rng(seed: int) -> Any:
    import numpy as np

    return np.random.default_rng(seed)


def _jax_rng(seed: int) -> Any:
    import jax

    return jax.random.key(seed)


def _torch_rng(seed: int) -> Any:
    import torch

    return torch.Generator().manual_seed(seed)


def _jax_stage(call: Callable) -> Callable:
    """Trace `call` once per shape with jax.jit, the way JAX code runs: eager JAX compiles every
    primitive anew for each shape, which is many times slower. An implementation that cannot be traced
    (it converts tracers to NumPy, say) runs eagerly instead."""
    import jax

    jitted = jax.jit(call)
    untraceable = (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError,
                   jax.errors.TracerBoolConversionError, jax.errors.TracerIntegerConversionError)

    def run(*args: Any) -> Any:
        try:
            return jitted(*args)
        except untraceable:
            return call(*args)

    return run


@contextlib.contextmanager
def _no_settings() -> Iterator[str]:
    yield ""


@contextlib.contextmanager
def _jax_precision() -> Iterator[str]:
    import jax

    settings = {"jax_enable_x64": True, "jax_default_matmul_precision": "highest"}
    saved = {name: getattr(jax.config, name) for name in settings}
    for name, value in settings.items():
        jax.config.update(name, value)
    try:
        yield "jax: x64 enabled, matmul precision highest"
    finally:
        for name, value in saved.items():
            jax.config.update(name, value)


@contextlib.contextmanager
def _torch_precision() -> Iterator[str]:
    import torch

    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.get_float32_matmul_precision())
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield "torch: TF32 off, float32 matmul precision highest"
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
        torch.set_float32_matmul_precision(saved[2])
