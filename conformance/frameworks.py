"""What the suite needs to know about the framework behind a module: its randomness, how its code runs
best (JAX: traced once per shape with jit), and the precision settings that make float32 mean float32.

The framework is read off the module itself (the type `asarray` returns), so any implementation of the
contract is checked the same way as ours.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any, NamedTuple

BUILT_IN = ("attention_np", "attention_jax", "attention_torch")


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


def framework_of(module: ModuleType) -> Framework:
    """The framework whose arrays `module.asarray` returns."""
    import numpy as np

    kind = type(module.asarray(np.zeros(1, np.float32))).__module__.split(".")[0]
    if kind in ("jax", "jaxlib"):
        return Framework("jax", _jax_rng, _jax_stage, _jax_precision)
    if kind == "torch":
        return Framework("torch", _torch_rng, _eager, _torch_precision)
    return Framework("numpy", _numpy_rng, _eager, _no_settings)


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


# XLA:CPU options for the suite's programs: each runs once or twice on a few dozen numbers, so compiling
# them costs hundreds of times more than running them, and optimising the code buys nothing. Measured on
# the fast profile (2 cores), they cut a compile 5 to 10 times and the JAX suite from 110-115 s to 43-47 s:
# optimisation level 0 (no LLVM optimisation), the older per-operation code emitters (the fusion emitters
# cost more to compile at this size), and one LLVM module per program instead of up to 32 compiled in
# parallel. The results stay within rounding (float64 results change by at most 5e-16).
_JAX_CPU_COMPILER_OPTIONS = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
    "xla_cpu_use_fusion_emitters": False,
    "xla_cpu_parallel_codegen_split_count": 1,
}


@functools.cache
def _jax_compiler_options() -> dict[str, Any] | None:
    """The options of _JAX_CPU_COMPILER_OPTIONS that this jaxlib accepts (each tried once on a tiny
    program), where JAX runs on the CPU; None elsewhere, or where jax.jit takes no compiler options."""
    import jax

    if jax.default_backend() != "cpu":
        return None
    accepted = {}
    for name, value in _JAX_CPU_COMPILER_OPTIONS.items():
        try:
            jax.jit(lambda x: x + 1, compiler_options={name: value})(0)
        except TypeError:  # jax: an older jax.jit, without compiler_options
            return None
        except Exception:  # jax: an option this XLA does not know, "No such compile option"
            continue
        accepted[name] = value
    return accepted or None


def _jax_stage(call: Callable) -> Callable:
    """Trace `call` once per shape with jax.jit, the way JAX code runs: eager JAX compiles every
    primitive anew for each shape, which is many times slower. An implementation that cannot be traced
    (it converts tracers to NumPy, say) runs eagerly instead. On the CPU the program is compiled for
    compile time, not run time (_JAX_CPU_COMPILER_OPTIONS)."""
    import jax

    options = _jax_compiler_options()
    jitted = jax.jit(call, compiler_options=options) if options else jax.jit(call)
    untraceable = (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError,
                   jax.errors.TracerBoolConversionError, jax.errors.TracerIntegerConversionError)

    def run(*args: Any) -> Any:
        try:
            return jitted(*args)
        except untraceable:
            return call(*args)

    return run


@contextlib.contextmanager
def quick_compiles() -> Iterator[None]:
    """While checking from the command line, JAX on the CPU compiles everything with little optimisation
    (jax_disable_most_optimizations: XLA's optimisation level 0), also the operations a check runs
    eagerly, outside _jax_stage (the error table's calls), which its compiler options do not reach.
    Never where code is timed; the setting is restored on exit."""
    jax, name = sys.modules.get("jax"), "jax_disable_most_optimizations"  # jax: imported by a module under check
    saved = None if jax is None or jax.default_backend() != "cpu" else jax.config.values.get(name)
    if saved is None:  # no JAX, not on the CPU, or a JAX without the flag
        yield
        return
    jax.config.update(name, True)
    try:
        yield
    finally:
        jax.config.update(name, saved)


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
