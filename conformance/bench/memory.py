"""`python -m conformance compare --variant long --memory`: the memory of flash_attention and of its gradient
at a length where the scores could not be held, each backend measured its own way, against the targets.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width.

At B = 1, H = 1, L = S = 32768, E = 64, float32, the (L, S) scores alone are 4 GiB. flash_attention runs with
its default tiles, as a user calls it (checks.default_tiles: 512 x 1024 at H = 1). Measured beyond the inputs
and the results (out and lse; with the gradient also dq, dk, dv):
- NumPy: tracemalloc's peak over the call (flash_attention; flash_attention_vjp's forward; its pullback).
- JAX: the temporaries of XLA's memory plan of the jitted forward, and of jax.grad of sum(out) (compiled, not
  run); beside, for comparison, the peak resident memory of the untiled jitted fast path in a fresh process
  (its plan misses the scratch of the library XLA:CPU runs fused attention in).
- torch: the growth of the process's peak resident memory (VmHWM, reset through /proc/self/clear_refs after a
  warm-up) in a fresh process per measurement, the results subtracted.

`compare --variant flex --memory` measures flex_attention the same ways (measure_flex): B = 1, H = 8,
L = S = 32768, E = 64, float32, with the document mask of --variant flex (8 documents of 4096 positions, block
mask of BLOCK_SIZE 128, made before the measurement), where the (B, H, L, S) float32 scores would be 32 GiB;
beyond q, k, v and the result out (B, H, L, E), NumPy's tracemalloc peak over the call, JAX's plan of the
jitted call, torch's peak resident memory growth in a fresh process (under inference_mode, as compare times
it); target 64 MiB each.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from ..frameworks.registry import framework_of
from . import variants

L = 32768  # L = S
E = 64
MIB = 2**20
TARGETS = {"forward": 64, "gradient": 64}  # MiB beyond inputs and results; torch's gradient: 128 (RSS)
TORCH_GRADIENT = 128
FLEX_HEADS = 8  # H of --variant flex
FLEX_TARGET = 64  # MiB beyond q, k, v and out: flex_attention with the document mask


class MemoryRow(NamedTuple):
    backend: str
    call: str  # "forward" or "gradient" (the vjp's forward and its pullback, or jax.grad)
    is_causal: bool
    how: str  # what was measured
    mib: float | None  # beyond the inputs and the results; None: not measured
    bound: float | None  # the target, MiB
    note: str = ""

    @property
    def met(self) -> bool | None:
        return None if self.mib is None or self.bound is None else self.mib <= self.bound


def measure(backends: dict[str, Any], *, length: int = L, causal: tuple[bool, ...] = (False, True),
            untiled: bool = True) -> list[MemoryRow]:
    """One row per backend, call and causal flag (and, with `untiled`, JAX's untiled jit for comparison)."""
    rows: list[MemoryRow] = []
    for name, module in backends.items():
        rows += _MEASURES[framework_of(module).name](name, module, length, causal, untiled)
    return rows


def _inputs(length: int, *, heads: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.standard_normal((1, heads, length, E)).astype(np.float32) for _ in range(4)]  # q, k, v, d_out


def _numpy(name: str, module: Any, length: int, flags: tuple[bool, ...], untiled: bool) -> list[MemoryRow]:
    q, k, v, d_out = _inputs(length)
    rows = []
    for causal in flags:
        options = dict(is_causal=causal)
        forward = _traced(functools.partial(module.flash_attention, q, k, v, **options))
        rows.append(MemoryRow(name, call="forward", is_causal=causal, how="tracemalloc", mib=forward / MIB,
                              bound=TARGETS["forward"]))
        vjp, (out, lse, pullback) = _traced_result(functools.partial(module.flash_attention_vjp, q, k, v, **options))
        pull = _traced(functools.partial(pullback, d_out))  # beyond the gradients
        rows.append(MemoryRow(name, call="gradient", is_causal=causal,
                              how="tracemalloc: the vjp's forward, then its pullback",
                              mib=max(vjp - out.nbytes - lse.nbytes, pull) / MIB, bound=TARGETS["gradient"]))
    return rows


def _traced(run: Callable[[], Any]) -> int:
    """tracemalloc's peak over run(), less what it returns (its results)."""
    peak, result = _traced_result(run)
    return peak - sum(x.nbytes for x in _arrays(result))


def _traced_result(run: Callable[[], Any]) -> tuple[int, Any]:
    tracemalloc.start()
    try:
        result = run()
        return tracemalloc.get_traced_memory()[1], result
    finally:
        tracemalloc.stop()


def _arrays(result: Any) -> list[np.ndarray]:
    if isinstance(result, tuple | list):
        return [x for part in result for x in _arrays(part)]
    return [result] if isinstance(result, np.ndarray) else []


def _jax(name: str, module: Any, length: int, flags: tuple[bool, ...], untiled: bool) -> list[MemoryRow]:
    import jax
    import jax.numpy as jnp

    rows = []
    for causal in flags:
        q, k, v = (jax.ShapeDtypeStruct((1, 1, length, E), jnp.float32) for _ in range(3))

        def forward(q: Any, k: Any, v: Any, causal: bool = causal) -> Any:
            return module.flash_attention(q, k, v, is_causal=causal)

        def loss(q: Any, k: Any, v: Any, causal: bool = causal) -> Any:
            return jnp.sum(forward(q, k, v, causal)[0])

        for call, function in (("forward", forward), ("gradient", jax.grad(loss, argnums=(0, 1, 2)))):
            plan = jax.jit(function).lower(q, k, v).compile().memory_analysis()
            rows.append(MemoryRow(name, call=call, is_causal=causal, how="XLA's plan: temporaries",
                                  mib=plan.temp_size_in_bytes / MIB, bound=TARGETS[call]))
    if not untiled:
        return rows
    script = JAX_UNTILED.format(module=module.__name__, length=length, E=E)  # for comparison: the untiled jit
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    mib = json.loads(done.stdout) / MIB if done.returncode == 0 else None
    rows.append(MemoryRow(f"{name} untiled",
                          call="forward",
                          is_causal=False,
                          how="peak RSS growth, a fresh process",
                          mib=mib,
                          bound=None,
                          note="the jitted fast path, for comparison: the (L, S) scores; H = 8 would need 8 times as "
                               "much" if done.returncode == 0 else done.stderr.strip().splitlines()[-1]))
    return rows


JAX_UNTILED = """
import json, jax, jax.numpy as jnp, {module}
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
q = jnp.asarray(jax.random.normal(jax.random.key(0), (3, 1, 1, {length}, {E}), jnp.float32))
attend = jax.jit(lambda q, k, v: {module}.scaled_dot_product_attention(q, k, v, need_weights=False)[0])
compiled = attend.lower(*q).compile()
open("/proc/self/clear_refs", "w").write("5")  # the peak resident memory from here on
before = status("VmRSS:")
out = jax.block_until_ready(compiled(*q))
print(json.dumps(status("VmHWM:") - before - out.nbytes))
"""


TORCH_SCRIPT = """
import json, sys, torch, {module}
length, E, causal, call = {length}, {E}, {causal}, {call!r}
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
torch.manual_seed(0)
q, k, v, d_out = (torch.randn(1, 1, length, E) for _ in range(4))
tiles = dict(is_causal=causal)  # the default tiles
out, lse, pullback = {module}.flash_attention_vjp(*(x[..., :300, :] for x in (q, k, v)), **tiles)  # warm-up
pullback(d_out[..., :300, :])
del out, lse, pullback
open("/proc/self/clear_refs", "w").write("5")  # the peak resident memory from here on
before = status("VmRSS:")
if call == "forward":
    results = {module}.flash_attention(q, k, v, **tiles)
else:
    out, lse, pullback = {module}.flash_attention_vjp(q, k, v, **tiles)
    results = (out, lse, *pullback(d_out)[:3])
print(json.dumps(status("VmHWM:") - before - sum(x.numel() * x.element_size() for x in results)))
"""


def _torch(name: str, module: Any, length: int, flags: tuple[bool, ...], untiled: bool) -> list[MemoryRow]:
    rows = []
    for causal in flags:
        for call in ("forward", "gradient"):
            script = TORCH_SCRIPT.format(module=module.__name__, length=length, E=E, causal=causal, call=call)
            done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
            mib = json.loads(done.stdout) / MIB if done.returncode == 0 else None
            note = "" if done.returncode == 0 else done.stderr.strip().splitlines()[-1]
            rows.append(MemoryRow(name,
                                  call=call,
                                  is_causal=causal,
                                  how="peak RSS growth, a fresh process",
                                  mib=mib,
                                  bound=TARGETS["forward"] if call == "forward" else TORCH_GRADIENT,
                                  note=note))
    return rows


_MEASURES = {"numpy": _numpy, "jax": _jax, "torch": _torch}


def format_rows(rows: Sequence[MemoryRow], length: int = L) -> str:
    header = ("backend", "call", "causal", "measured", "MiB beyond inputs and results", "target", "verdict")
    lines = [header]
    for row in rows:
        mib = "-" if row.mib is None else f"{row.mib:.1f}"
        target = "-" if row.bound is None else f"<= {row.bound:g}"
        verdict = {None: "-", True: "MET", False: "MISSED"}[row.met]
        lines.append((row.backend, row.call, str(row.is_causal), row.how, mib, target,
                      verdict + (f" ({row.note})" if row.note else "")))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    scores = length * length * 4 / MIB
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
                     for line in lines) + f"\n(the (L, S) float32 scores of one head: {scores:.0f} MiB)"


# --- flex_attention: --variant flex --memory ---------------------------------------------------------------


def measure_flex(backends: dict[str, Any], *, length: int = L, heads: int = FLEX_HEADS) -> list[MemoryRow]:
    """One row per backend: flex_attention's peak beyond its inputs and its result, with --variant flex's
    document mask over L = S = length, its block mask made beforehand."""
    return [_FLEX_MEASURES[framework_of(module).name](name, module, length, heads) for name, module in backends.items()]


def _flex_row(name: str, how: str, mib: float | None, note: str = "") -> MemoryRow:
    return MemoryRow(name, call="flex_attention, document mask", is_causal=False, how=how, mib=mib,
                     bound=FLEX_TARGET, note=note)


def _document_block_mask(module: Any, length: int) -> Any:
    return module.create_block_mask(variants.FLEX_MASKS["document"](length), None, None, length, length,
                                    BLOCK_SIZE=variants.FLEX_BLOCK)


def _numpy_flex(name: str, module: Any, length: int, heads: int) -> MemoryRow:
    q, k, v, _ = _inputs(length, heads=heads)
    block_mask = _document_block_mask(module, length)
    peak = _traced(functools.partial(module.flex_attention, q, k, v, block_mask=block_mask))  # less out
    return _flex_row(name, "tracemalloc", peak / MIB)


def _jax_flex(name: str, module: Any, length: int, heads: int) -> MemoryRow:
    import jax
    import jax.numpy as jnp

    block_mask = _document_block_mask(module, length)
    q, k, v = (jax.ShapeDtypeStruct((1, heads, length, E), jnp.float32) for _ in range(3))
    attend = jax.jit(lambda q, k, v: module.flex_attention(q, k, v, block_mask=block_mask))
    plan = attend.lower(q, k, v).compile().memory_analysis()
    return _flex_row(name, "XLA's plan: temporaries", plan.temp_size_in_bytes / MIB)


TORCH_FLEX_SCRIPT = """
import json, torch, {module}
from attention_np.common import mods
length, heads, E, documents, block = {length}, {heads}, {E}, {documents}, {block}
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
def block_mask(n):  # --variant flex's document mask: documents runs of n / documents positions
    mask_mod = mods.document(torch.arange(n) * documents // n)
    return {module}.create_block_mask(mask_mod, None, None, n, n, BLOCK_SIZE=block)
torch.manual_seed(0)
q, k, v = (torch.randn(1, heads, length, E) for _ in range(3))
made = block_mask(length)
with torch.inference_mode():
    {module}.flex_attention(q, k, v, block_mask=made)  # warm-up: the call itself, so that a compilation
    # (the torch backend hands this size to torch's compiled FlexAttention) is made before the peak is reset;
    # its out, 64 MiB, mmap-ed, goes back to the system when freed
    open("/proc/self/clear_refs", "w").write("5")  # the peak resident memory from here on
    before = status("VmRSS:")
    out = {module}.flex_attention(q, k, v, block_mask=made)
print(json.dumps(status("VmHWM:") - before - out.numel() * out.element_size()))
"""


def _torch_flex(name: str, module: Any, length: int, heads: int) -> MemoryRow:
    script = TORCH_FLEX_SCRIPT.format(module=module.__name__, length=length, heads=heads, E=E,
                                      documents=variants.DOCUMENTS, block=variants.FLEX_BLOCK)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    mib = json.loads(done.stdout) / MIB if done.returncode == 0 else None
    return _flex_row(name, "peak RSS growth, a fresh process", mib,
                     "" if done.returncode == 0 else done.stderr.strip().splitlines()[-1])


_FLEX_MEASURES = {"numpy": _numpy_flex, "jax": _jax_flex, "torch": _torch_flex}
