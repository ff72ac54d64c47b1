"""What the suite and the benchmark need to know about the framework behind a module, declared once per
framework: the forms of its rng argument, how its code runs best (JAX: traced once per shape with jit), the precision
settings that make float32 mean float32, the dtypes its arrays have, and for `python -m conformance compare`
its built-ins, how it places arrays on a device, finishes a call, measures peak memory and describes itself.

The framework is read off the module itself (the type `asarray` returns), so any implementation of the
contract is checked the same way as ours.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys
import tracemalloc
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import ModuleType
from typing import Any, NamedTuple

from . import peers  # imports torch only when peers start

BUILT_IN = ("attention_np", "attention_jax", "attention_torch")
DTYPES = ("float16", "float32", "float64", "bool", "int32", "int64")  # every framework's

Timed = tuple[Callable[[], Any], Callable[[], "int | None"]]  # (run, peak), see Framework.timed


def import_modules(names: Sequence[str]) -> tuple[dict[str, ModuleType], dict[str, str]]:
    """({name: module} for those that import, {name: why not} for the others)."""
    modules, skipped = {}, {}
    for name in names:
        try:
            modules[name] = importlib.import_module(name)
        except Exception as error:  # a missing framework skips that backend only
            skipped[name] = f"{type(error).__name__}: {error}"
    return modules, skipped


class RngForm(NamedTuple):
    """One form of the rng argument that SPEC.md section 6 allows the framework's modules."""

    name: str  # as a failure names it: "an int seed", "jax.random.PRNGKey", ...
    given: Callable[[int], contextlib.AbstractContextManager[Any]]  # seed -> a context that gives the rng argument


class Framework(NamedTuple):
    name: str  # "numpy", "jax" or "torch"
    rngs: tuple[RngForm, ...]  # every form of the rng argument, the usual one first
    stage: Callable[[Callable], Callable]  # how a whole operation runs (JAX: jit)
    pinned: Callable[[], contextlib.AbstractContextManager[str]]  # precision settings for a run
    dtypes: tuple[str, ...]  # the dtypes its arrays have, as NumPy names (bfloat16: ml_dtypes)
    # where its users switch automatic differentiation off (torch: inference mode), in which a vjp must still
    # work and give the same gradients; None: no such mode
    no_autograd: Callable[[], contextlib.AbstractContextManager[Any]] | None
    # what the benchmark (conformance/bench) reads as well
    built_ins: Mapping[str, str]  # operation -> the framework's own implementation of it
    sees_gpu: Callable[[], bool]  # whether it sees a CUDA GPU
    converter: Callable[[str, str], Callable[[Any], Any]]  # (dtype, device) -> NumPy array -> its array there
    to_float64: Callable[[Any], Any]  # its array, any dtype, any device -> a float64 NumPy array
    timed: Callable[[Callable, tuple, str], Timed]  # (call, args, device) -> (run, peak), see _numpy_timed
    permissive: Callable[[], contextlib.AbstractContextManager[None]]  # its default promotion rules
    describe: Callable[[], str]  # its version and what it runs on, one line
    # ring attention (SPEC 2d): given the devices asked for (None: none), a context holding the devices a ring may
    # use here (NumPy: any number, simulated; JAX: those it sees; torch: this process and peers it starts), and
    # a call over P of them that takes and gives whole arrays, see ring_job
    ring_devices: Callable[[int | None], contextlib.AbstractContextManager[int]]
    ring: Callable[[ModuleType, int, dict[str, Any], dict[str, Any], tuple[int | None, ...]], Any]


def framework_of(module: ModuleType) -> Framework:
    """The framework whose arrays `module.asarray` returns."""
    import numpy as np

    kind = type(module.asarray(np.zeros(1, np.float32))).__module__.split(".")[0]
    return FRAMEWORKS.get("jax" if kind == "jaxlib" else kind, NUMPY)


# --- randomness and staging (the suite) ----------------------------------------------------------------


def _eager(call: Callable) -> Callable:
    return call


def _passed(make: Callable[[int], Any]) -> Callable[[int], contextlib.AbstractContextManager[Any]]:
    """A form that is an object made from the seed and passed as it is."""
    return lambda seed: contextlib.nullcontext(make(seed))


def _numpy_generator(seed: int) -> Any:
    import numpy as np

    return np.random.default_rng(seed)


def _jax_key(seed: int) -> Any:
    import jax

    return jax.random.key(seed)


def _jax_raw_key(seed: int) -> Any:
    import jax

    return jax.random.PRNGKey(seed)  # jax: the legacy uint32[2] key, which jax.random takes too


def _torch_generator(seed: int) -> Any:
    import torch

    return torch.Generator().manual_seed(seed)


@contextlib.contextmanager
def _torch_global(seed: int) -> Iterator[None]:
    """rng=None, torch's global RNG seeded with `seed`; its state is restored afterwards (the suite's arrays
    live on the CPU, so only the CPU's generator is forked)."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield None


NUMPY_RNGS = (RngForm("a Generator", _passed(_numpy_generator)), RngForm("an int seed", _passed(lambda seed: seed)))
JAX_RNGS = (RngForm("jax.random.key", _passed(_jax_key)), RngForm("jax.random.PRNGKey", _passed(_jax_raw_key)))
TORCH_RNGS = (RngForm("a torch.Generator", _passed(_torch_generator)),
              RngForm("None after torch.manual_seed", _torch_global))


# XLA:CPU options for the suite's programs: each runs once or twice on a few dozen numbers, so compiling
# them costs hundreds of times more than running them, and optimising the code buys nothing. Measured on
# the fast profile (2 cores), they cut a compile 5 to 10 times and the JAX suite from 110-115 s to 43-47 s:
# optimisation level 0 (no LLVM optimisation), the older per-operation code emitters (the fusion emitters
# cost more to compile at this size), and one LLVM module per program instead of up to 32 compiled in
# parallel. The results stay within rounding (float64 results change by at most 5e-16).
JAX_CPU_COMPILER_OPTIONS = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
    "xla_cpu_use_fusion_emitters": False,
    "xla_cpu_parallel_codegen_split_count": 1,
}


@functools.cache
def _jax_compiler_options() -> dict[str, Any] | None:
    """The options of JAX_CPU_COMPILER_OPTIONS that this jaxlib accepts (each tried once on a tiny
    program), where JAX runs on the CPU; None elsewhere, or where jax.jit takes no compiler options."""
    import jax

    if jax.default_backend() != "cpu":
        return None
    accepted = {}
    for name, value in JAX_CPU_COMPILER_OPTIONS.items():
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
    compile time, not run time (JAX_CPU_COMPILER_OPTIONS)."""
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


# --- ring attention's devices (the suite) ----------------------------------------------------------------

RING_AXIS = "ring"  # JAX: the name of the mesh axis the suite shards the sequence over


def ring_job(module: ModuleType, topology: dict[str, Any], q: Any, k: Any, v: Any, d_out: Any = None,
             **options: Any) -> Any:
    """ring_attention(q, k, v, **topology, **options) -> (out, lse); with d_out, ring_attention_vjp's pullback
    at d_out -> (dq, dk, dv), with sinks (dq, dk, dv, d_sinks). topology: the framework's devices keywords
    (devices=, mesh= and axis=, group=)."""
    if d_out is None:
        return module.ring_attention(q, k, v, **topology, **options)
    _, _, pullback = module.ring_attention_vjp(q, k, v, **topology, **options)
    return pullback(d_out)


def _simulated(requested: int | None) -> contextlib.AbstractContextManager[int]:
    return contextlib.nullcontext(sys.maxsize)  # NumPy simulates the devices: any number


def _numpy_ring(module: ModuleType, devices: int, arrays: dict[str, Any], options: dict[str, Any],
                axes: tuple[int | None, ...]) -> Any:
    return ring_job(module, {"devices": devices}, **arrays, **options)


def simulate_jax_devices(devices: int) -> None:
    """JAX on the CPU with `devices` devices, by XLA_FLAGS, which JAX reads once when it starts: set before it
    starts, here and in the processes started from here (a JAX already started keeps its devices, and the ring
    operation says how many it has)."""
    flag = "--xla_force_host_platform_device_count"
    kept = [option for option in os.environ.get("XLA_FLAGS", "").split() if not option.startswith(flag)]
    os.environ["XLA_FLAGS"] = " ".join([*kept, f"{flag}={devices}"])


def _jax_devices(requested: int | None) -> contextlib.AbstractContextManager[int]:
    """The devices JAX sees: fixed when it starts (XLA_FLAGS=--xla_force_host_platform_device_count=P simulates P
    CPU devices; `python -m conformance check --devices P` sets it before JAX starts)."""
    import jax

    return contextlib.nullcontext(len(jax.devices()))


@functools.cache
def _jax_mesh(devices: int) -> Any:
    """A one-axis mesh of JAX's first P devices; a RuntimeError where it sees fewer."""
    import jax
    import numpy as np

    if len(jax.devices()) < devices:
        raise RuntimeError(f"ring attention on P = {devices} devices, but JAX sees {len(jax.devices())} "
                           f"(simulate_jax_devices({devices}) before JAX starts)")
    return jax.sharding.Mesh(np.array(jax.devices()[:devices]), (RING_AXIS,))


def _jax_ring(module: ModuleType, devices: int, arrays: dict[str, Any], options: dict[str, Any],
              axes: tuple[int | None, ...]) -> Any:
    """Whole arrays in and out: ring_attention shards them over the mesh axis itself."""
    return ring_job(module, {"mesh": _jax_mesh(devices), "axis": RING_AXIS}, **arrays, **options)


def _torch_devices(requested: int | None) -> contextlib.AbstractContextManager[int]:
    return peers.started(requested or 1)


def _torch_ring(module: ModuleType, devices: int, arrays: dict[str, Any], options: dict[str, Any],
                axes: tuple[int | None, ...]) -> Any:
    """Each of the first P ranks (this process and its peers) runs ring_job on its contiguous shard of every
    array; the shards of each result are joined along its sequence axis (`axes`, one per result; None: a result
    of the whole sequence that every rank holds alike, d_sinks, taken from the first)."""
    import torch

    parts = peers.run(_torch_ring_shard, module.__name__, devices, arrays, options)[:devices]
    return tuple(shards[0] if axis is None else torch.cat(shards, dim=axis)
                 for shards, axis in zip(zip(*parts, strict=True), axes, strict=True))


def _torch_ring_shard(rank: int, name: str, devices: int, arrays: dict[str, Any], options: dict[str, Any]) -> Any:
    """Rank `rank`'s part of _torch_ring, run on every rank (None beyond the first P). The arrays are cut as a
    caller cuts them: into P contiguous parts along the sequence axis, unequal where P does not divide it (then
    ring_attention raises its error on every rank)."""
    import torch

    group = peers.group(devices)  # every rank makes the same groups in the same order
    if rank >= devices:
        return None
    shards = {name_: torch.tensor_split(x, devices, dim=-2)[rank] for name_, x in arrays.items()}
    return ring_job(importlib.import_module(name), {"group": group}, **shards, **options)


# --- precision and promotion settings ------------------------------------------------------------------


@contextlib.contextmanager
def quick_compiles() -> Iterator[None]:
    """While the suite checks, JAX on the CPU compiles everything with little optimisation
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


def _torch_inference_mode() -> contextlib.AbstractContextManager[Any]:
    import torch

    return torch.inference_mode()


@contextlib.contextmanager
def _jax_permissive() -> Iterator[None]:
    """Implicit broadcasting by rank and standard dtype promotion, whatever a test configuration made strict:
    plain JAX code (the benchmark's baselines) is written against these defaults."""
    import jax

    with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
        yield


# --- devices and arrays (the benchmark) ----------------------------------------------------------------


def _no_gpu() -> bool:
    return False


def _jax_sees_gpu() -> bool:
    import jax

    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:  # jax: no GPU backend in this jaxlib
        return False


def _torch_sees_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _numpy_converter(dtype: str, device: str) -> Callable[[Any], Any]:
    return lambda x: x.astype(dtype)  # NumPy: always on the CPU


def _jax_converter(dtype: str, device: str) -> Callable[[Any], Any]:
    import jax
    import jax.numpy as jnp

    place = jax.devices("gpu" if device == "cuda" else "cpu")[0]
    return lambda x: jax.device_put(x.astype(jnp.dtype(dtype)), place)


def _torch_converter(dtype: str, device: str) -> Callable[[Any], Any]:
    import torch

    return lambda x: torch.from_numpy(x).to(device=device, dtype=getattr(torch, dtype))


def _numpy_to_float64(x: Any) -> Any:
    import numpy as np

    return np.asarray(x).astype(np.float64)  # JAX's arrays too: bfloat16 comes as ml_dtypes' bfloat16


def _torch_to_float64(x: Any) -> Any:
    import torch

    return x.detach().to(device="cpu", dtype=torch.float64).numpy()  # NumPy has no bfloat16; it may be on a GPU


# --- timing: a call made ready to time, and its peak memory ---------------------------------------------


def _numpy_timed(call: Callable, args: tuple, device: str) -> Timed:
    """(run, peak) for call(*args): run() makes one call and returns when its result is finished; peak()
    makes one and returns the bytes it allocated at its peak, None where that is not measurable.
    NumPy: plain calls; tracemalloc sees its buffers."""
    run = lambda: call(*args)  # noqa: E731
    return run, lambda: _traced_peak(run)


def _jax_timed(call: Callable, args: tuple, device: str) -> Timed:
    """JAX: compiled ahead, timed to block_until_ready; on CUDA the peak is XLA's memory plan (on the CPU it
    misses the scratch of the library that runs fused attention, so none is given)."""
    import jax

    compiled = jax.jit(call).lower(*args).compile()
    plan = compiled.memory_analysis() if device == "cuda" else None
    planned = None if plan is None else plan.temp_size_in_bytes + plan.output_size_in_bytes
    return (lambda: jax.block_until_ready(compiled(*args))), (lambda: planned)


def _torch_timed(call: Callable, args: tuple, device: str) -> Timed:
    """torch: under inference_mode, synchronised on CUDA; the peak is the CUDA allocator's (none on the CPU)."""
    import torch

    def run() -> Any:
        with torch.inference_mode():
            result = call(*args)
        if device == "cuda":
            torch.cuda.synchronize()
        return result

    return run, (lambda: _cuda_peak(run)) if device == "cuda" else (lambda: None)


def _traced_peak(run: Callable[[], Any]) -> int:
    """Bytes that one call allocates at its peak, by tracemalloc (NumPy reports its buffers to it)."""
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        run()
        return tracemalloc.get_traced_memory()[1] - before
    finally:
        if not tracing:
            tracemalloc.stop()


def _cuda_peak(run: Callable[[], Any]) -> int:
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    run()
    return torch.cuda.max_memory_allocated() - before


# --- descriptions ---------------------------------------------------------------------------------------


def _numpy_description() -> str:
    import numpy as np

    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return f"numpy {np.__version__}, BLAS: unknown (install threadpoolctl to see it)"
    found = [info for info in threadpool_info() if info.get("user_api") == "blas"
             and "numpy" in info.get("filepath", "")] or [i for i in threadpool_info() if i.get("user_api") == "blas"]
    blas = "; ".join(f"{info['internal_api']} {info.get('version')} ({info.get('architecture', '?')}, "
                     f"{info['num_threads']} threads)" for info in found[:1]) or "none found"
    return f"numpy {np.__version__}, BLAS: {blas}"


def _jax_description() -> str:
    import jax

    return f"jax {jax.__version__}, devices: {', '.join(str(d) for d in jax.devices())}"


def _torch_description() -> str:
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    return f"torch {torch.__version__}, {torch.get_num_threads()} threads, CUDA GPU: {gpu}"


# --- the table ------------------------------------------------------------------------------------------

NUMPY = Framework(
    "numpy", rngs=NUMPY_RNGS, stage=_eager, pinned=_no_settings, dtypes=DTYPES, no_autograd=None,
    built_ins={}, sees_gpu=_no_gpu, converter=_numpy_converter, to_float64=_numpy_to_float64, timed=_numpy_timed,
    permissive=contextlib.nullcontext, describe=_numpy_description, ring_devices=_simulated, ring=_numpy_ring)
JAX = Framework(
    "jax", rngs=JAX_RNGS, stage=_jax_stage, pinned=_jax_precision, dtypes=(*DTYPES, "bfloat16"), no_autograd=None,
    built_ins={"sdpa": "jax.nn.dot_product_attention"}, sees_gpu=_jax_sees_gpu, converter=_jax_converter,
    to_float64=_numpy_to_float64, timed=_jax_timed, permissive=_jax_permissive, describe=_jax_description,
    ring_devices=_jax_devices, ring=_jax_ring)
TORCH = Framework(
    "torch", rngs=TORCH_RNGS, stage=_eager, pinned=_torch_precision, dtypes=(*DTYPES, "bfloat16"),
    no_autograd=_torch_inference_mode,
    built_ins={"sdpa": "F.scaled_dot_product_attention", "mha": "nn.MultiheadAttention",
               "block": "nn.TransformerEncoderLayer"},
    sees_gpu=_torch_sees_gpu, converter=_torch_converter, to_float64=_torch_to_float64, timed=_torch_timed,
    permissive=contextlib.nullcontext, describe=_torch_description, ring_devices=_torch_devices, ring=_torch_ring)
FRAMEWORKS = {framework.name: framework for framework in (NUMPY, JAX, TORCH)}
