"""The conformance report: every installed backend against the float64 oracle, in one table.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

The pieces are small and separate so that a property-based suite can reuse them: `draw_cases` makes
inputs, `expected` and `actual` run the oracle and a backend, `relative_error` compares, `format_table`
and `format_failure` print. Only `run` prints, and only `run` changes framework precision settings.
"""

from __future__ import annotations

import contextlib
import importlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import MappingProxyType, ModuleType
from typing import Any, NamedTuple

import numpy as np

from . import oracle

BACKENDS = ("attention_np", "attention_jax", "attention_torch")
OPERATIONS = ("sdpa", "mha", "block")
TOLERANCES = {"float32": 1e-4, "float64": 1e-9}  # relative error, see relative_error
TINY = np.finfo(np.float64).tiny

Pair = tuple[np.ndarray, np.ndarray]  # (out, weights)


class Case(NamedTuple):
    """One input to one operation. Floating arrays are float64 until `cast`; masks stay bool or int."""

    op: str  # "sdpa", "mha" or "block"
    name: str  # what the case exercises
    inputs: dict[str, np.ndarray]  # q, k, v, mask, bias (sdpa); q, k, v, mask (mha); x, mask (block)
    options: dict[str, Any]  # keyword settings: is_causal, scale; num_heads, norm_first, activation, eps
    state: Mapping[str, np.ndarray] = MappingProxyType({})  # parameters of mha and block, state-dict names


class Result(NamedTuple):
    """How far one backend is from the oracle on one case in one dtype: the worse of out and weights."""

    backend: str
    case: Case
    dtype: str
    array: str  # "out" or "weights"; "call" when the backend raised
    error: float  # relative error; inf for mismatched shapes or NaN positions, or an exception
    message: str = ""

    @property
    def passed(self) -> bool:
        return self.error <= TOLERANCES[self.dtype]  # False for NaN too


# --- case generation -------------------------------------------------------------------------------------

def draw_cases(seed: int) -> list[Case]:
    """A handful of random cases per operation; the same seed gives the same cases."""
    rng = np.random.default_rng(seed)
    return [*_sdpa_cases(rng), *_mha_cases(rng), *_block_cases(rng)]


def _sdpa_cases(rng: np.random.Generator) -> list[Case]:
    bias = _normal(rng, 5, 6)
    bias[rng.random((5, 6)) < 0.25] = -np.inf
    bias[2] = -np.inf  # query 2 sees no key through the bias alone
    int_mask = (rng.random((2, 1, 3)) > 0.3).astype(np.int32)
    int_mask[0, 0, 0] = 0  # with is_causal, query 0 of sequence 0 then sees no key
    return [
        Case("sdpa", "no mask", _qkv(rng, (3,), 5, 5, 8, 8), {}),
        Case("sdpa", "random mask with fully masked rows, L != S, E != Ev",
             _qkv(rng, (2, 3), 5, 7, 8, 6) | {"mask": _random_mask(rng, (2, 3, 5, 7))}, {}),
        Case("sdpa", "causal L < S, mask broadcast over batch",
             _qkv(rng, (2,), 4, 6, 8, 8) | {"mask": _random_mask(rng, (4, 6), full_rows=0)},
             {"is_causal": True}),
        Case("sdpa", "causal L > S, 0/1 integer mask broadcast over L",
             _qkv(rng, (2,), 7, 3, 4, 5) | {"mask": int_mask}, {"is_causal": True}),
        Case("sdpa", "bias with -inf entries, custom scale, broadcast leading axes",
             {"q": _normal(rng, 2, 1, 5, 8), "k": _normal(rng, 1, 3, 6, 8), "v": _normal(rng, 1, 3, 6, 4),
              "bias": bias}, {"scale": 0.37}),
    ]


def _mha_cases(rng: np.random.Generator) -> list[Case]:
    padding = np.arange(6) < np.array([4, 0])[:, None, None, None]  # (B, 1, 1, S); sequence 1 all padding
    return [
        Case("mha", "self-attention, random mask with a fully masked row",
             _self(_normal(rng, 2, 5, 8)) | {"mask": _random_mask(rng, (2, 1, 5, 5))},
             {"num_heads": 2}, _mha_state(rng, 8)),
        Case("mha", "cross-attention L != S, key padding, one sequence all padding",
             {"q": _normal(rng, 2, 4, 12), "k": _normal(rng, 2, 6, 12), "v": _normal(rng, 2, 6, 12),
              "mask": padding}, {"num_heads": 3}, _mha_state(rng, 12)),
        Case("mha", "one mask per head",
             _self(_normal(rng, 2, 3, 8)) | {"mask": _random_mask(rng, (2, 4, 3, 3))},
             {"num_heads": 4}, _mha_state(rng, 8)),
    ]


def _block_cases(rng: np.random.Generator) -> list[Case]:
    padding = np.arange(5) < np.array([5, 3])[:, None, None, None]  # (B, 1, 1, L)
    return [
        Case("block", "post-LN + ReLU, random mask per head with fully masked rows",
             {"x": _normal(rng, 2, 6, 8), "mask": _random_mask(rng, (2, 2, 6, 6))},
             {"num_heads": 2, "norm_first": False, "activation": "relu"}, _block_state(rng, 8, 16)),
        Case("block", "pre-LN + GELU, key padding, eps 1e-6", {"x": _normal(rng, 2, 5, 12), "mask": padding},
             {"num_heads": 3, "norm_first": True, "activation": "gelu", "eps": 1e-6},
             _block_state(rng, 12, 24)),
    ]


def _normal(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape)


def _qkv(rng: np.random.Generator, batch: tuple[int, ...], L: int, S: int, E: int,
         Ev: int) -> dict[str, np.ndarray]:
    return {"q": _normal(rng, *batch, L, E),  # (..., L, E)
            "k": _normal(rng, *batch, S, E),  # (..., S, E)
            "v": _normal(rng, *batch, S, Ev)}  # (..., S, Ev)


def _self(x: np.ndarray) -> dict[str, np.ndarray]:
    return {"q": x, "k": x, "v": x}


def _random_mask(rng: np.random.Generator, shape: tuple[int, ...], full_rows: int = 2) -> np.ndarray:
    """Boolean mask hiding about 30% of the keys, with `full_rows` rows hiding every key."""
    mask = rng.random(shape) > 0.3  # (..., L, S)
    rows = mask.reshape(-1, shape[-1])  # a view: (... * L, S)
    rows[rng.choice(len(rows), size=full_rows, replace=False)] = False
    return mask


def _mha_state(rng: np.random.Generator, d_model: int) -> dict[str, np.ndarray]:
    return {f"{proj}.{name}": value for proj in ("w_q", "w_k", "w_v", "w_o")
            for name, value in _linear_state(rng, d_model, d_model).items()}


def _block_state(rng: np.random.Generator, d_model: int, d_ff: int) -> dict[str, np.ndarray]:
    """Random parameters; LayerNorm gains away from 1 and every bias away from 0."""
    norms = {}
    for norm in ("norm1", "norm2"):
        norms[f"{norm}.weight"] = rng.uniform(0.5, 1.5, d_model)
        norms[f"{norm}.bias"] = 0.1 * _normal(rng, d_model)
    ffn = {f"ffn.0.{name}": value for name, value in _linear_state(rng, d_model, d_ff).items()}
    ffn |= {f"ffn.3.{name}": value for name, value in _linear_state(rng, d_ff, d_model).items()}
    return {f"attn.{name}": value for name, value in _mha_state(rng, d_model).items()} | norms | ffn


def _linear_state(rng: np.random.Generator, d_in: int, d_out: int) -> dict[str, np.ndarray]:
    return {"weight": _normal(rng, d_out, d_in) / math.sqrt(d_in), "bias": 0.1 * _normal(rng, d_out)}


def cast(case: Case, dtype: str) -> Case:
    """The case with its floating arrays in `dtype`; masks keep their dtype."""
    def convert(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {name: x.astype(dtype) if np.issubdtype(x.dtype, np.floating) else x
                for name, x in arrays.items()}
    return case._replace(inputs=convert(case.inputs), state=convert(case.state))


# --- running the oracle and a backend ----------------------------------------------------------------------

def expected(case: Case) -> Pair:
    """The oracle's (out, weights) in float64, for the case's inputs exactly as given (already cast)."""
    if case.op == "sdpa":
        return oracle.sdpa(**case.inputs, **case.options)
    if case.op == "mha":
        return oracle.multi_head_attention(case.state, **case.inputs, **case.options)
    return oracle.transformer_block(case.state, **case.inputs, **case.options)


def actual(module: ModuleType, case: Case) -> Pair:
    """The backend's (out, weights) as NumPy arrays; modules in eval mode, so no dropout."""
    def call(inputs: dict[str, Any], state: dict[str, Any]) -> tuple[Any, Any]:
        if case.op == "sdpa":
            return module.scaled_dot_product_attention(**inputs, **case.options)
        if case.op == "mha":
            return module.MultiHeadAttention.from_state_dict(state, **case.options).eval()(**inputs)
        return module.TransformerBlock.from_state_dict(state, **case.options).eval()(**inputs)

    inputs = {name: module.asarray(x) for name, x in case.inputs.items()}
    state = {name: module.asarray(x) for name, x in case.state.items()}
    out, weights = STAGING.get(module.__name__, _eager)(call)(inputs, state)
    return module.to_numpy(out), module.to_numpy(weights)


def _eager(call: Callable) -> Callable:
    return call


def _jax_jit(call: Callable) -> Callable:
    import jax

    return jax.jit(call)


# How a backend runs one whole operation. Eager JAX compiles every primitive anew for each shape and dtype
# (about 20 s for this report); traced once with jax.jit, the way JAX code runs, it takes a few seconds.
STAGING: dict[str, Callable[[Callable], Callable]] = {"attention_jax": _jax_jit}


# --- comparing -------------------------------------------------------------------------------------------

def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    """max|a - b| / max(max|b|, tiny) over the whole array, b the reference.

    Entries equal in both (NaN in both, or the same infinity) count as exact; NaN in only one of them,
    or a shape mismatch, gives inf.
    """
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or np.any(np.isnan(a) != np.isnan(b)):
        return math.inf
    same = (a == b) | np.isnan(b)  # also covers matching infinities, where a - b would be NaN
    diff = np.where(same, 0.0, np.abs(a - b))
    reference = np.max(np.abs(b), where=np.isfinite(b), initial=0.0)
    return float(np.max(diff, initial=0.0) / max(reference, TINY))


def compare(backend: str, module: ModuleType, case: Case, dtype: str, reference: Pair) -> Result:
    """Run the cast case on the backend and return the worse of its out and weights errors."""
    try:
        pair = actual(module, case)
    except Exception as error:  # a backend that raises is a failure to report, not a crash of the report
        return Result(backend, case, dtype, "call", math.inf, f"{type(error).__name__}: {error}")
    errors = {"out": relative_error(pair[0], reference[0]), "weights": relative_error(pair[1], reference[1])}
    worst = max(errors, key=errors.__getitem__)
    return Result(backend, case, dtype, worst, errors[worst])


def check_all(modules: Mapping[str, ModuleType], cases: Sequence[Case]) -> list[Result]:
    """Every case, in every dtype, on every backend; the oracle runs once per case and dtype, on the
    inputs rounded to that dtype, so only the backend's arithmetic is measured."""
    results = []
    for case in cases:
        for dtype in TOLERANCES:
            cast_case = cast(case, dtype)
            reference = expected(cast_case)
            results += [compare(name, module, cast_case, dtype, reference)
                        for name, module in modules.items()]
    return results


# --- formatting ------------------------------------------------------------------------------------------

def format_table(results: Sequence[Result], backends: Sequence[str]) -> str:
    """Rows operation x dtype, columns backends; each cell the worst relative error and PASS / FAIL."""
    width = max(16, *(len(name) for name in backends))
    lines = [f"{'operation':<10}{'dtype':<9}" + "".join(f"{name:<{width + 2}}" for name in backends)]
    for op in OPERATIONS:
        for dtype in TOLERANCES:
            cells = [_cell([r for r in results if (r.case.op, r.dtype, r.backend) == (op, dtype, name)])
                     for name in backends]
            lines.append(f"{op:<10}{dtype:<9}" + "".join(f"{cell:<{width + 2}}" for cell in cells))
    return "\n".join(line.rstrip() for line in lines)


def _cell(results: Sequence[Result]) -> str:
    if not results:
        return "-"
    if any(r.array == "call" for r in results):
        return "ERROR FAIL"
    worst = max(r.error for r in results)
    return f"{worst:.1e} {'PASS' if all(r.passed for r in results) else 'FAIL'}"


def format_failure(result: Result) -> str:
    """One failure: backend, operation, dtype, case, array and input shapes, enough to find and rerun it."""
    shapes = ", ".join(f"{name} {x.shape} {x.dtype}" for name, x in result.case.inputs.items())
    options = ", ".join(f"{name}={value!r}" for name, value in result.case.options.items())
    tolerance = TOLERANCES[result.dtype]
    what = result.message or f"{result.array}: relative error {result.error:.2e} > {tolerance:.0e}"
    return (f"FAIL {result.backend} {result.case.op} {result.dtype} '{result.case.name}': {what}\n"
            f"     inputs {shapes}" + (f"; {options}" if options else ""))


# --- the command-line run --------------------------------------------------------------------------------

def import_backends(names: Sequence[str]) -> tuple[dict[str, ModuleType], dict[str, str]]:
    """({name: module} for those that import, {name: why not} for the others)."""
    modules, skipped = {}, {}
    for name in names:
        try:
            modules[name] = importlib.import_module(name)
        except Exception as error:  # a missing framework or a broken backend skips that backend only
            skipped[name] = f"{type(error).__name__}: {error}"
    return modules, skipped


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


PRECISION: dict[str, Callable[[], contextlib.AbstractContextManager[str]]] = {
    "attention_jax": _jax_precision,
    "attention_torch": _torch_precision,
}


def run(seed: int = 0, backends: Sequence[str] = BACKENDS) -> int:
    """Import the backends, pin their precision for this run, check every case, print the report.

    Returns the exit code: 0 when every backend passes every case in every dtype, else 1.
    """
    modules, skipped = import_backends(backends)
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    if not modules:
        print("no backend could be imported")
        return 1
    with contextlib.ExitStack() as stack:
        pinned = [stack.enter_context(PRECISION[name]()) for name in modules if name in PRECISION]
        cases = draw_cases(seed)
        print(f"seed {seed}: {len(cases)} cases, each in " + " and ".join(TOLERANCES)
              + "; worst relative error max|a - b| / max|oracle| over out and weights")
        print("tolerance " + ", ".join(f"{dtype} {tol:.0e}" for dtype, tol in TOLERANCES.items())
              + "".join(f"; {line}" for line in pinned))
        results = check_all(modules, cases)
    print()
    print(format_table(results, list(modules)))
    failures = [r for r in results if not r.passed]
    if failures:
        print()
        print("\n".join(format_failure(r) for r in failures))
        print(f"\n{len(failures)} failures; rerun with --seed {seed}")
        return 1
    print("\nall pass")
    return 0
