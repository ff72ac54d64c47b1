"""The measurement behind `python -m conformance compare` (bench/report.py prints it): the
candidates, their inputs, how they are timed, and the rows.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
D = d_model = H * E, F = d_ff = 4 * D.

Every installed backend runs each operation twice, with need_weights=False (the fast path) and with
need_weights=True (labelled "explicit"), next to each framework's own built-in and the plain formulations
of bench/baselines.py. The candidates of one framework, operation and L are timed interleaved (A, B,
C, A, B, C, ...) so that machine noise hits them alike, and each gets its median time, its rate, its peak
memory and its relative error against a float64 reference.

FLOPs count the matrix products only, 2 per multiply-add:
    sdpa   4 B H L S E            q k^T and weights v, each 2 B H L S E
    mha    sdpa + 4 * 2 B L D^2   self-attention (S = L) and the projections w_q, w_k, w_v, w_o
    block  mha + 2 * 2 B L D F    and the feed-forward network's two linears

What is timed is declared by a `Variant`: its problem maker, its candidates (`calls`) and its targets;
bench/variants.py declares each (plain: the problems and candidates above; grouped-query attention; a
sliding window; long sequences; programmable attention). This module holds the structures, the problems and our
calls, and the measuring.

JSON rows (--json) hold: implementation, framework, device, operation, variant, dtype, B, H, E, L, S, D, F,
flops, repeats, time_ms, gflops, peak_mib (null where not measurable), rel_error.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import itertools
import math
import operator
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import ModuleType
from typing import Any, NamedTuple, TypeVar

import numpy as np

from ..contract.operations import OPERATIONS as REGISTRY
from ..frameworks.registry import BUILT_IN, FRAMEWORKS, framework_of, import_modules
from . import baselines

# The operations of the registry (conformance/contract/operations.py) that compare's table does not time, and
# where each is timed instead; every other one is timed here, so a new operation of the registry joins the table
# until it is named here
TIMED_ELSEWHERE = {"flash": "--variant long", "ring": "bench/ring.py and bench/ring_torch.py, per device",
                   "linear": "--complexity, with its recurrent form", "decode": "--decode (a loop of calls)",
                   "flex": "--variant flex (block masks against dense masking)",
                   "varlen": "no benchmark yet: its work is its sequences' own blocks (SPEC 2g)",
                   "mla": "--variant mla (the decode step, absorbed against expanded)"}
OPERATIONS = tuple(name for name in REGISTRY if name not in TIMED_ELSEWHERE)  # sdpa, mha, block
SIZES = (128, 256, 512, 1024)
T = TypeVar("T")  # the value of a step of the progress bar
Options = tuple[tuple[str, Any], ...]  # keywords of scaled_dot_product_attention as (name, value) pairs (a
# variant with its own reference reads its own: flex's ("mask", the mask's name))
Call = tuple[Callable, Any, Options]  # (call, params, options): call(params, *inputs); options: what it computes


class Candidate(NamedTuple):
    """One implementation of one operation, prepared with its inputs: `run()` is all that is timed."""

    name: str  # "attention_torch", "attention_torch explicit", "torch built-in", ...
    operation: str  # "sdpa", "mha" or "block"
    run: Callable[[], Any]  # one call; finished when it returns (JAX: blocked, CUDA: synchronized)
    peak: Callable[[], int | None]  # bytes one call allocates at its peak, None where not measurable
    framework: str = "numpy"
    device: str = "cpu"
    options: Options = ()  # the keywords whose result it computes; its reference is our explicit path with them


class Problem(NamedTuple):
    """One operation at one size: float64 values, each exactly representable in the benchmark's dtype."""

    operation: str
    B: int
    H: int
    L: int
    E: int
    inputs: tuple[np.ndarray, ...]  # sdpa: q, k, v (B, H, L, E) (gqa: k, v (B, Hkv, S, E)); mha, block: x (B, L, D)
    state: dict[str, np.ndarray]  # the module's parameters, named as in the state-dict contract ({} for sdpa)


class Row(NamedTuple):
    implementation: str
    framework: str
    device: str
    operation: str
    dtype: str
    B: int
    H: int
    E: int
    L: int
    S: int
    D: int
    F: int
    flops: int
    repeats: int
    time_ms: float
    gflops: float
    peak_mib: float | None
    rel_error: float
    variant: str = "plain"


class Comparison(NamedTuple):
    """What a target compares: one quantity of two candidates, combined into the value held to the bound."""

    quantity: str  # "time" (median ms) or "peak" (peak MiB)
    symbol: str  # how the targets table joins the two names and values: "/" or "-"
    combine: Callable[[float, float], float]  # (numerator's, denominator's) -> measured
    unit: str  # of the quantity
    shown: str  # how the targets table writes the measured value and the bound


COMPARISONS = {
    "time ratio": Comparison("time", symbol="/", combine=operator.truediv, unit="ms", shown="{:.3f}"),
    "peak difference": Comparison("peak", symbol="-", combine=operator.sub, unit="MiB", shown="{:.1f} MiB"),
}


def _unscaled(problem: Problem) -> float:
    return 1.0


class Target(NamedTuple):
    """numerator (op) the best denominator, held to `relation bound`; bound None: measured, no target."""

    framework: str
    numerator: str
    denominators: tuple[str, ...]  # the smallest of their quantity counts: the fastest, or the leanest
    relation: str  # "<=" or ">="
    bound: float | None
    operations: tuple[str, ...] = OPERATIONS
    compared: str = "time ratio"  # a key of COMPARISONS
    scale: Callable[[Problem], float] = _unscaled  # the bound is bound * scale(problem) (a size in MiB, say)


class TargetRow(NamedTuple):
    framework: str
    operation: str
    variant: str
    L: int
    compared: str  # a key of COMPARISONS: "time ratio" or "peak difference"
    numerator: str
    denominator: str  # the best of the target's denominators
    numerator_value: float  # in the comparison's unit: ms or MiB
    denominator_value: float
    measured: float  # numerator_value / denominator_value, or numerator_value - denominator_value
    relation: str
    bound: float | None  # None: no target
    met: bool | None


class Variant(NamedTuple):
    """What `compare --variant NAME` times: one declaration read by compare() and targets()."""

    name: str
    operations: tuple[str, ...]
    dims: Mapping[str, int]  # B, H, E by default
    problem: Callable[..., Problem]  # (operation, *, B, H, L, E, dtype) -> Problem
    calls: Callable[..., dict[str, Call]]  # (name, module, problem, state, *, fused) -> {label: Call}
    targets: tuple[Target, ...]  # what --targets measures, at L = target_L
    describe: Callable[..., str]  # (B, H, E) -> the shapes, one line
    target_L: int = 1024
    ratios: tuple[Target, ...] = ()  # printed under compare's table at every L
    target_dims: Mapping[str, int] | None = None  # B, H, E of --targets, where they differ from dims
    sizes: tuple[int, ...] = SIZES  # the lengths L = S compare times by default
    reference: Callable[[Problem, Options], np.ndarray] | None = None  # (problem, options) -> the float64 output
    # to measure errors against; None: attention_np's explicit path (which holds the (B, H, L, S) weights)
    settle: float = 0.0  # seconds `measure` waits before each call, for the previous call's idle threads to stop


def flops(operation: str, *, B: int, H: int, L: int, S: int, E: int) -> int:
    """Matrix-product FLOPs of one call (2 per multiply-add); mha and block are self-attention (S = L)."""
    D = H * E
    count = 4 * B * H * L * S * E  # q k^T and weights v: 2 B H L S E each
    if operation in ("mha", "block"):
        count += 4 * 2 * B * L * D * D  # w_q, w_k, w_v, w_o: (B, L, D) x (D, D) each
    if operation == "block":
        count += 2 * 2 * B * L * D * (4 * D)  # ffn.0 (B, L, D) x (D, F), ffn.3 (B, L, F) x (F, D)
    return count


def measure(candidates: Sequence[Candidate], *, repeats: int, warmup: int = 1, settle: float = 0.0) -> list[float]:
    """Median seconds per call of each candidate, their repeats interleaved in an order in which each
    candidate follows every other one equally often (`balanced_order`): a call that leaves the caches cold
    or the allocator busy slows whichever call comes next, and a plain rotation (A B C, B C A, C A B) puts
    A after C twice as often as B.

    Interleave candidates of one framework only: a framework's idle threads spin for a while after each
    call (OpenMP, OpenBLAS, XLA's pool), and on a machine with few cores they slow the next framework's call
    by ten times and more; targets() joins only frameworks that a target compares across (timed_together).
    Within one framework they still slow a call that runs on a thread pool of its own: settle > 0 waits, untimed,
    before each call, up to `settle` seconds and at most ten times the previous call (a short call leaves no pool
    spinning for long)."""
    for candidate in candidates:
        for _ in range(warmup):
            candidate.run()
    times: list[list[float]] = [[] for _ in candidates]
    order, previous = balanced_order(len(candidates)), 0.0
    with collector_paused():
        for index in itertools.islice(itertools.cycle(order), math.ceil(repeats / order.count(0)) * len(order)):
            if len(times[index]) < repeats:  # the last pass through `order` may need only some candidates
                time.sleep(min(settle, 10 * previous))
                start = time.perf_counter()
                candidates[index].run()
                previous = time.perf_counter() - start
                times[index].append(previous)
    return [statistics.median(seconds) for seconds in times]


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for a timed region, after a full collection, as timeit does. A
    full collection walks every Python object (about 60 ms with torch imported, on the 2-core machine of the
    README's tables) and lands in whichever timed call crosses its threshold, whoever allocated the objects.
    Inside `older_objects_frozen` (a benchmark's whole run) the collection walks only the objects made since
    that began: the others were alive then, after a collection of their own."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def older_objects_frozen() -> Iterator[None]:
    """A benchmark's run, many timed regions long, with the objects alive at its start out of the collector's
    sight: one full collection, then gc.freeze(), so that each region's collection (collector_paused) walks only
    the objects made since (the candidates, their inputs and outputs), where it walked every module and object
    of torch and JAX too: 0.2 s of CPU per region in `compare`'s process, 0.6 s in a test process, 18 regions in
    `compare --sizes 8,16`. gc.unfreeze() at the end hands them back to the oldest generation. Where objects are
    frozen already (the caller's own, or an enclosing run's), nothing changes."""
    if gc.get_freeze_count():
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def balanced_order(n: int) -> list[int]:
    """Indices 0..n-1 in a cyclic order in which every ordered pair of distinct indices is adjacent exactly
    once (i right before j): an Eulerian circuit of the complete directed graph, so each index appears n - 1
    times (once where n is 1). For n = 3: [0, 2, 1, 2, 0, 1], then again: 0 follows 1 and 2 once each."""
    if n == 1:
        return [0]
    unused = {i: [j for j in range(n) if j != i] for i in range(n)}  # the edges i -> j not yet walked
    stack, circuit = [0], []
    while stack:  # Hierholzer: walk unused edges; back out of a dead end into the circuit
        if unused[stack[-1]]:
            stack.append(unused[stack[-1]].pop())
        else:
            circuit.append(stack.pop())
    return circuit[::-1][:-1]  # the walk ends where it began: that last step is the cycle's wrap-around


def compare(*, variant: Variant, sizes: Sequence[int] = SIZES, operations: Sequence[str] | None = None,
            dtype: str = "float32", repeats: int = 10, device: str = "cpu", B: int | None = None, H: int | None = None,
            E: int | None = None, backends: dict[str, ModuleType] | None = None, progress: bool = False) -> list[Row]:
    """Time every candidate of `variant` on every operation and size; one Row per candidate, operation and L.
    B, H, E, operations: the variant's unless given. progress: a progress bar on stderr where that is a
    terminal."""
    dims = _dims(variant, B=B, H=H, E=E)
    backends = installed_backends()[0] if backends is None else backends
    devices, rows = placement(backends, device), []
    steps = [(f"{operation} L={L}", (operation, L)) for operation in operations or variant.operations for L in sizes]
    with pinned(backends), older_objects_frozen():
        for operation, L in _progress(steps, progress):
            problem = variant.problem(operation, L=L, dtype=dtype, **dims)
            candidates = make_candidates(problem, backends, dtype=dtype, devices=devices, calls=variant.calls)
            reference = variant.reference or functools.partial(_our_output, importlib.import_module("attention_np"))
            references = {options: reference(problem, options)
                          for options in dict.fromkeys(candidate.options for candidate in candidates)}
            for kind in dict.fromkeys(candidate.framework for candidate in candidates):
                group = [candidate for candidate in candidates if candidate.framework == kind]
                seconds_each = measure(group, repeats=repeats, settle=variant.settle)
                for candidate, seconds in zip(group, seconds_each, strict=True):
                    rows.append(_row(candidate, problem, variant.name, dtype, repeats, seconds,
                                     references[candidate.options]))
    return rows


def targets(*, variant: Variant, L: int | None = None, repeats: int = 10, device: str = "cpu",
            backends: dict[str, ModuleType] | None = None, progress: bool = False) -> list[TargetRow]:
    """The performance targets of `variant`, float32 at its dims and L = S = its target_L unless given; one
    TargetRow per target and operation, its candidates timed interleaved. progress: as for compare."""
    L = variant.target_L if L is None else L
    backends = installed_backends()[0] if backends is None else backends
    devices, rows = placement(backends, device), []
    present = {framework_of(module).name for module in backends.values()}
    chosen = [target for target in variant.targets if target.framework in present]
    steps = [(f"{kind} {operation}", (kind, operation))
             for kind in dict.fromkeys(target.framework for target in chosen) for operation in variant.operations]
    with pinned(backends), older_objects_frozen():
        for kind, operation in _progress(steps, progress):
            mine = [target for target in chosen if target.framework == kind and operation in target.operations]
            if not mine:
                continue
            problem = variant.problem(operation, L=L, dtype="float32", **(variant.target_dims or variant.dims))
            wanted = {name for target in mine for name in (target.numerator, *target.denominators)}
            candidates = make_candidates(problem, backends, dtype="float32", devices=devices, wanted=wanted,
                                         calls=variant.calls)
            measured: dict[str, dict[str, float | None]] = {"time": {}}
            for group in timed_together(candidates, mine):
                seconds_each = measure(group, repeats=repeats, settle=variant.settle)
                measured["time"] |= {c.name: 1e3 * seconds for c, seconds in zip(group, seconds_each, strict=True)}
            if any(COMPARISONS[target.compared].quantity == "peak" for target in mine):  # one more call each
                measured["peak"] = {c.name: _mib(c.peak()) for c in candidates}
            rows += [target_row(target, problem, variant.name, measured) for target in mine]
    return rows


def timed_together(candidates: Sequence[Candidate], targets: Sequence[Target]) -> list[list[Candidate]]:
    """The candidates in the groups `measure` interleaves: one per framework, but the frameworks that a target
    compares across (NumPy's flash_attention against torch's kernel) in one group, so that its ratio is of
    calls made under the same load. On the 2-core machine shared with other jobs, the same code timed in two
    groups in two runs gave 1.08 and 2.66; NumPy's call took what it took after its own (535 ms) after
    torch's (523 ms, B=1, H=8, L=S=4096): no idle threads of torch's slow it."""
    framework = {c.name: c.framework for c in candidates}
    group_of = {c.framework: c.framework for c in candidates}  # framework -> the first framework of its group
    for target in targets:
        joined = {group_of[framework[name]] for name in (target.numerator, *target.denominators) if name in framework}
        first = min(joined, key=list(group_of).index, default=None)
        group_of = {kind: first if group in joined else group for kind, group in group_of.items()}
    return [[c for c in candidates if group_of[c.framework] == group] for group in dict.fromkeys(group_of.values())]


def target_row(target: Target, problem: Problem, variant: str,
               measured: Mapping[str, Mapping[str, float | None]]) -> TargetRow:
    """The target's row from measured[quantity][candidate] (ms or MiB): the best (smallest) denominator, the
    value the comparison makes of the two, and the verdict against bound * scale(problem)."""
    comparison = COMPARISONS[target.compared]
    values = measured[comparison.quantity]
    denominator = min(target.denominators, key=lambda name: _known(values[name], name))
    mine, theirs = _known(values[target.numerator], target.numerator), _known(values[denominator], denominator)
    value = comparison.combine(mine, theirs)
    bound = None if target.bound is None else target.bound * target.scale(problem)
    met = None if bound is None else meets(value, target.relation, bound)
    return TargetRow(framework=target.framework,
                     operation=problem.operation,
                     variant=variant,
                     L=problem.L,
                     compared=target.compared,
                     numerator=target.numerator,
                     denominator=denominator,
                     numerator_value=mine,
                     denominator_value=theirs,
                     measured=value,
                     relation=target.relation,
                     bound=bound,
                     met=met)


def meets(value: float, relation: str, bound: float) -> bool:
    """Whether a measured value keeps its target: value <= bound or value >= bound, as `relation` says."""
    return value <= bound if relation == "<=" else value >= bound


class Ratio(NamedTuple):
    """numerator / denominator of a benchmark (serve, mla), its target (bound None: shown without one) and the
    verdict."""

    compared: str
    numerator: str
    denominator: str
    numerator_value: float
    denominator_value: float
    measured: float
    relation: str
    bound: float | None
    met: bool | None


def ratio(compared: str, numerator: str, numerator_value: float, denominator: str, denominator_value: float,
          relation: str, bound: float | None) -> Ratio:
    """numerator_value / denominator_value as a Ratio, with its verdict against `bound` (None: no verdict)."""
    measured = numerator_value / denominator_value
    return Ratio(compared=compared, numerator=numerator, denominator=denominator, numerator_value=numerator_value,
                 denominator_value=denominator_value, measured=measured, relation=relation, bound=bound,
                 met=None if bound is None else meets(measured, relation, bound))


def ratios(rows: Sequence[Row], variant: Variant) -> list[TargetRow]:
    """The variant's `ratios` from compare's rows (time and peak as measured there), at each operation and L
    where both sides ran; rows come grouped by operation and L, as compare() makes them."""
    found = []
    for (operation, L), group in itertools.groupby(rows, key=lambda row: (row.operation, row.L)):
        mine = list(group)
        measured = {"time": {row.implementation: row.time_ms for row in mine},
                    "peak": {row.implementation: row.peak_mib for row in mine}}
        problem = Problem(operation, B=mine[0].B, H=mine[0].H, L=L, E=mine[0].E, inputs=(), state={})  # the sizes only
        ran = set(measured["time"])
        found += [target_row(target, problem, variant.name, measured) for target in variant.ratios
                  if operation in target.operations and {target.numerator, *target.denominators} <= ran]
    return found


def _known(value: float | None, name: str) -> float:
    if value is None:
        raise ValueError(f"{name}: this quantity is not measurable here (a peak on torch or JAX on the CPU)")
    return value


def _mib(size: int | None) -> float | None:
    return None if size is None else size / 2**20


def _dims(variant: Variant, **given: int | None) -> dict[str, int]:
    """The variant's B, H, E, with those given (not None) instead."""
    return {**variant.dims, **{name: value for name, value in given.items() if value is not None}}


def _progress(steps: Sequence[tuple[str, T]], enabled: bool) -> Iterator[T]:
    """The steps' values, in order. Where enabled and stderr is a terminal (not a file, a pipe or a test's
    capture), tqdm draws a bar on stderr with the label of the step under way; tqdm is imported only then."""
    if not (enabled and sys.stderr.isatty()):
        yield from (value for _, value in steps)
        return
    from tqdm import tqdm

    with tqdm(steps, file=sys.stderr, unit="step", dynamic_ncols=True) as bar:
        for label, value in bar:
            bar.set_postfix_str(label)
            yield value


# --- the inputs and the candidates ---------------------------------------------------------------------


def make_problem(operation: str, *, B: int, H: int, L: int, E: int, dtype: str, seed: int = 0) -> Problem:
    """Random inputs and parameters (nn.Linear's ranges; LayerNorm gains not 1, biases not 0)."""
    rng, D = np.random.default_rng(seed), H * E
    if operation == "sdpa":
        inputs, state = tuple(rng.standard_normal((B, H, L, E)) for _ in "qkv"), {}
    else:
        inputs = (rng.standard_normal((B, L, D)),)
        state = baselines.random_state(operation, D, 4 * D, rng)
    return Problem(operation,
                   B=B,
                   H=H,
                   L=L,
                   E=E,
                   inputs=tuple(rounded(x, dtype) for x in inputs),
                   state={name: rounded(value, dtype) for name, value in state.items()})


def make_candidates(problem: Problem, backends: dict[str, ModuleType], *, dtype: str, devices: dict[str, str],
                    calls: Callable[..., dict[str, Call]], wanted: set[str] | None = None) -> list[Candidate]:
    """Each backend's candidates by `calls` (a variant's), ready to time on its device; backends whose
    framework has no `dtype` (NumPy: bfloat16) are left out."""
    candidates = []
    for name, module in backends.items():
        framework = framework_of(module)
        if dtype not in framework.dtypes:
            continue
        device = devices[framework.name]
        convert = framework.converter(dtype, device)
        state = {key: convert(value) for key, value in problem.state.items()}
        inputs = tuple(convert(x) for x in problem.inputs)
        for label, (call, params, options) in calls(name, module, problem, state,
                                                    fused=device == "cuda" and dtype == "bfloat16").items():
            if wanted is None or label in wanted:
                run, peak = framework.timed(call, (params, *inputs), device)
                candidates.append(Candidate(label,
                                            operation=problem.operation,
                                            run=run,
                                            peak=peak,
                                            framework=framework.name,
                                            device=device,
                                            options=options))
    return candidates


def our_call(module: ModuleType, problem: Problem, state: dict[str, Any], *,
             need_weights: bool, **options: Any) -> tuple[Callable, Any]:
    """(call, params): call(params, *inputs) runs our operation; params holds the module (None for sdpa), built
    from `state`, the problem's parameters in the module's arrays. options: further keywords of sdpa."""
    if problem.operation == "sdpa":
        return (lambda _, q, k, v: module.scaled_dot_product_attention(q, k, v, need_weights=need_weights,
                                                                       **options)), None
    if problem.operation == "mha":
        mha = module.MultiHeadAttention.from_state_dict(state, num_heads=problem.H).eval()
        return (lambda mha, x: mha(x, x, x, need_weights=need_weights)), mha
    block = module.TransformerBlock.from_state_dict(state, num_heads=problem.H).eval()
    return (lambda block, x: block(x, need_weights=need_weights)), block


def _our_output(module: ModuleType, problem: Problem, options: Options = ()) -> np.ndarray:
    """The operation's output from a NumPy module's explicit path with `options`, as float64: the reference with
    attention_np."""
    call, params = our_call(module, problem, problem.state, need_weights=True, **dict(options))
    return _as_float64(call(params, *problem.inputs), framework_of(module).name)


# --- the frameworks ------------------------------------------------------------------------------------


def installed_backends() -> tuple[dict[str, ModuleType], dict[str, str]]:
    """({name: module} of the built-in backends that import, {name: why not} of the others)."""
    return import_modules(BUILT_IN)


def placement(backends: dict[str, ModuleType], device: str) -> dict[str, str]:
    """{framework: "cpu" or "cuda"}; with device "cuda", the frameworks that see a GPU go there (torch and JAX;
    NumPy stays on the CPU)."""
    frameworks = {framework.name: framework for framework in map(framework_of, backends.values())}
    if device == "cpu":
        return dict.fromkeys(frameworks, "cpu")
    if device != "cuda":
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    devices = {name: "cuda" if framework.sees_gpu() else "cpu" for name, framework in frameworks.items()}
    if "cuda" not in devices.values():
        raise ValueError("--device cuda: neither torch nor JAX sees a CUDA GPU here "
                         f"(installed: {', '.join(backends)}); run with --device cpu")
    return devices


@contextlib.contextmanager
def pinned(backends: dict[str, ModuleType]) -> Iterator[list[str]]:
    """The frameworks' precision settings of the conformance runs (JAX: x64 and "highest" matmuls;
    torch: TF32 off), so float32 means float32 on every device, and their default promotion rules, which
    the plain baselines are written against; yields the settings' descriptions."""
    frameworks = {framework.name: framework for framework in map(framework_of, backends.values())}
    with contextlib.ExitStack() as stack:
        settings = [stack.enter_context(framework.pinned()) for framework in frameworks.values()]
        for framework in frameworks.values():
            stack.enter_context(framework.permissive())
        yield [setting for setting in settings if setting]


def rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    """x rounded to `dtype` and back to float64, so the reference sees exactly the benchmark's inputs."""
    if dtype != "bfloat16":
        return x.astype(dtype).astype(np.float64)
    try:
        import ml_dtypes  # installed with JAX
    except ImportError:
        import torch

        return torch.from_numpy(x).to(torch.bfloat16).to(torch.float64).numpy()
    return x.astype(ml_dtypes.bfloat16).astype(np.float64)


def _as_float64(result: Any, framework: str) -> np.ndarray:
    """The output (first of a tuple) as a float64 NumPy array, whatever the framework, dtype and device."""
    return FRAMEWORKS[framework].to_float64(result[0] if isinstance(result, tuple) else result)


def _row(candidate: Candidate, problem: Problem, variant: str, dtype: str, repeats: int, seconds: float,
         reference: np.ndarray) -> Row:
    B, H, L, E = problem.B, problem.H, problem.L, problem.E
    count = flops(problem.operation, B=B, H=H, L=L, S=L, E=E)
    error = np.max(np.abs(_as_float64(candidate.run(), candidate.framework) - reference)) / np.max(np.abs(reference))
    peak = candidate.peak()
    return Row(candidate.name,
               framework=candidate.framework,
               device=candidate.device,
               operation=problem.operation,
               dtype=dtype,
               B=B,
               H=H,
               E=E,
               L=L,
               S=L,
               D=H * E,
               F=4 * H * E,
               flops=count,
               repeats=repeats,
               time_ms=1e3 * seconds,
               gflops=count / seconds / 1e9,
               peak_mib=_mib(peak),
               rel_error=float(error),
               variant=variant)
