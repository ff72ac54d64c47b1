"""The fixed cases of conformance/contract/fixed_cases.py, run on a module without Hypothesis: the edge cases
against the oracle and their requirements, the error inputs against the exceptions the spec requires, and the round trip
of the module's array conversions.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

Each kind gives one row of the suite's report per operation: examples = the cases run, worst = the cases
failing, tolerance 0, and the failure lists each failing case.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from ..contract import oracle
from ..contract.fixed_cases import Fixed, rows
from ..contract.operations import (
    OPERATIONS,
    arrays_and_options,
    features_used,
    init_features_used,
    keywords_used,
    missing,
    operation_of,
    options_used,
    without_dropout,
)
from ..contract.tolerances import TOLERANCES, relative_error
from .checks import LOW_PRECISION_FACTOR, Runner, expected

VALUES = TOLERANCES["float64"]["values"]  # every edge case


class Result(NamedTuple):
    """What one fixed case did: `problems` holds one line per path that went wrong (empty: it passed);
    `skipped` says why the case does not apply to the module (it offers no vjp, say)."""

    row: Fixed
    problems: list[str]
    skipped: str | None = None

    @property
    def passed(self) -> bool:
        return not self.problems

    def describe(self) -> str:
        row = self.row
        required = (f"expected {row.error.__name__} mentioning {', '.join(map(repr, row.contains))}"
                    if row.use == "error" else f"requires {row.requires}")
        made = row.build()  # a case, or a constructor's keyword arguments
        used = keywords_used(made) if hasattr(made, "_asdict") else {}
        options = options_used(made) if hasattr(made, "_asdict") else {}
        note = f" (uses the keywords of SPEC 2a: {', '.join(used)})" if used else ""
        note += f" (uses the module options of SPEC 5: {', '.join(options)})" if options else ""
        return f"{row.operation} {row.name}{note}: {required}; got " + "; ".join(self.problems)


class Summary(NamedTuple):
    """One operation's results of one kind, in the shape of a suite row."""

    examples: int  # the cases run (skipped ones not counted)
    failing: int
    failure: str | None  # each failing case: what was required and what happened


def summarize(results: Sequence[Result]) -> Summary:
    ran = [result for result in results if result.skipped is None]
    failing = [result for result in ran if not result.passed]
    return Summary(examples=len(ran), failing=len(failing),
                   failure="\n".join(f"  {result.describe()}" for result in failing) or None)


# --- edge cases ----------------------------------------------------------------------------------------------

def edge_cases(runner: Runner, operation: str) -> list[Result]:
    """Every edge case of `operation` in float64 on both paths (need_weights True and False; modules in
    eval mode), against the oracle and the case's own requirements."""
    with runner.framework.pinned():
        return [run_edge(runner, row) for row in rows(operation, "edge")]


def run_edge(runner: Runner, row: Fixed) -> Result:
    case = without_dropout(row.build(), runner.declaration)  # eval mode: a configured dropout does nothing
    if why := runner.declaration.reason("float64", *features_used(case)):
        return Result(row, [], skipped=why)
    returned = operation_of(case).second  # the operation's second result: "weights" on two paths (need_weights True
    # and False), else one path
    with np.errstate(invalid="ignore", over="ignore"):  # NaN and inf are the point of some cases
        expected_out, expected_weights = expected(case)
    second = None if expected_weights is None else returned  # "weights", or flash_attention's "lse", which every
    # path returns; None: out alone (linear_attention, and MultiHeadAttention's linear heads, which form no weights)
    has_weights = second == "lse" or "weights" not in runner.declaration
    blind = (np.isneginf(expected_weights) if second == "lse" else _blind_out(case, expected_out) if second is None
             else np.all(expected_weights == 0, axis=-1))
    # (..., rows): the queries that see no key (the oracle's zeros, its lse -inf, or the operation's declaration)
    blind_out = blind if blind.shape == expected_out.shape[:-1] else None  # sdpa: out rows are the queries'
    # (MHA and the block mix the heads, so a blind query's out row is not zero there)
    problems = []
    for need_weights in (True, False):
        path = f"need_weights={need_weights}"
        try:
            with np.errstate(invalid="ignore", over="ignore"):
                out, weights = runner.run(case, "float64", need_weights=need_weights)
        except Exception as error:  # the module raised: a failure of this case
            problems.append(f"{path} raised {type(error).__name__}: {error}")
            continue
        found = [compare("out", out, expected_out, blind_rows=blind_out)]
        if second is None:
            found.append(None if weights is None else "the second result is not None")
        elif second == "lse":
            found.append(compare("lse", weights, expected_weights))
        elif need_weights and has_weights:
            found.append(compare("weights", weights, expected_weights, blind_rows=blind, nan_rows_may_fill=True))
        elif weights is not None and has_weights:
            found.append("weights is not None")
        found += [needed.problem(case, out, weights if has_weights else None) for needed in row.requirements]
        problems += [f"{path}: {problem}" for problem in found if problem]
        if returned != "weights":  # one path: need_weights changes nothing
            break
    return Result(row, problems)


def _blind_out(case: Any, expected_out: np.ndarray) -> np.ndarray:
    """The out rows (..., L) of the queries that see no key, for an operation without a second result; none for a
    module (its state's w_o mixes the heads and adds its bias: a blind query's out row is not zero there)."""
    rows, shape = operation_of(case).blind(case), expected_out.shape[:-1]  # (..., L)
    return np.zeros(shape, bool) if rows is None or "state" in case._fields else np.broadcast_to(rows[0], shape)


def compare(name: str, actual: np.ndarray | None, expected: np.ndarray, *, blind_rows: np.ndarray | None = None,
            nan_rows_may_fill: bool = False) -> str | None:
    """What is wrong with `actual` against the oracle's `expected` (float64), or None:
    the shape and dtype; NaN or inf exactly where the oracle has NaN or inf (either kind counts, as the
    oracle may give NaN where inf - inf arises); the finite entries within VALUES (relative, as the suite's
    `values`); rows in `blind_rows` (queries that see no key) exactly 0. With nan_rows_may_fill (weights):
    in a row holding NaN or inf, a hidden key's 0 may be NaN too, as exp(-inf - NaN) is NaN."""
    if actual is None:
        return f"{name} is None"
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return f"{name} is {actual.shape} {actual.dtype}, expected {expected.shape} {expected.dtype}"
    poisoned = ~np.isfinite(expected)
    free = np.zeros_like(poisoned)
    if nan_rows_may_fill:
        free = np.any(poisoned, axis=-1, keepdims=True) & (expected == 0)  # (..., rows, 1) & (..., rows, S)
    if np.any(np.isfinite(actual[poisoned])):
        return f"{name} is finite at {_where(poisoned & np.isfinite(actual))}, where NaN or inf is required"
    stray = ~np.isfinite(actual) & ~poisoned & ~free
    if np.any(stray):
        return f"{name} is NaN or inf at {_where(stray)}, where the oracle is finite"
    if blind_rows is not None and np.any(actual[blind_rows] != 0):
        return f"{name} is not exactly 0 in rows that see no key: {_where(blind_rows[..., None] & (actual != 0))}"
    settled = poisoned | free
    error = relative_error(np.where(settled, 0.0, actual), np.where(settled, 0.0, expected))
    return None if error <= VALUES else f"{name}: relative error {error:.2e} > {VALUES:.0e}"


def _where(entries: np.ndarray, limit: int = 3) -> str:
    """The first few indices where `entries` is True, as text."""
    found = [tuple(int(i) for i in index) for index in np.argwhere(entries)[:limit]]
    more = int(np.sum(entries)) - len(found)
    return ", ".join(map(str, found)) + (f" and {more} more" if more > 0 else "")


# --- error inputs --------------------------------------------------------------------------------------------

def errors(runner: Runner, operation: str) -> list[Result]:
    """Make every bad call of `operation`'s error rows (JAX with 64-bit types enabled) and report what each
    raised. Calls of the operation itself run on both paths, need_weights True and False; a case passes when
    both raise the expected type and message."""
    with runner.framework.pinned():
        return [run_error(runner, row) for row in rows(operation, "error")]


def run_error(runner: Runner, row: Fixed) -> Result:
    """One error row on the runner's module (run it where JAX has 64-bit types enabled, as `errors` does)."""
    operation = OPERATIONS[row.operation]
    if row.stage == "pullback" and (lacking := missing(runner.module, (operation.vjp,))):
        return Result(row, [], skipped=f"no {lacking[0]}")
    made = row.build()  # the case, or the constructor's keyword arguments
    needs = init_features_used(made) if row.stage == "init" else features_used(made) | _dtypes_needed(row, made)
    if why := runner.declaration.reason(*needs):
        return Result(row, [], skipped=why)
    if row.stage != "init" and "float64" in runner.declaration:  # SPEC 11: the row's mistake, in float32
        made, row = _in_float32(made), row._replace(d_out=None if row.d_out is None else _in_float32(row.d_out))
    exact = "exceptions" not in runner.declaration  # else any exception will do (SPEC 11)
    for need_weights in (True, False) if row.stage == "call" else (True,):
        raised = _attempt(runner, row, made, need_weights)
        type_ok = isinstance(raised, row.error) or (not exact and raised is not None)
        message_ok = raised is not None and (not exact or all(text in str(raised) for text in row.contains))
        if not (type_ok and message_ok):
            got = "no exception" if raised is None else f"{type(raised).__name__}: {raised}"
            return Result(row, [got + ("" if need_weights else " (need_weights=False)")])
    return Result(row, [])


LOW_DTYPES = ("float16", "bfloat16", "float64")  # the dtypes a module may lack (conformance.contract.features)


def _dtypes_needed(row: Fixed, case: Any) -> set[str]:
    """The dtypes an error row cannot do without: those its message must name, and float16 and bfloat16 where its
    arrays hold them (a module without float64 gets float64 arrays in float32: `_in_float32`)."""
    named = {dtype for dtype in LOW_DTYPES if any(dtype in word for word in row.contains)}
    fields = case._asdict()
    arrays = [*fields.values(), *(fields.get("state") or {}).values(), row.d_out]
    held = {x.dtype.name for x in arrays if isinstance(x, np.ndarray)} | {fields.get("cache_dtype")}
    return named | (held & {"float16", "bfloat16"})


def _in_float32(made: Any) -> Any:
    """An error row's case (or cotangent) with its float64 arrays, a state's too, in float32."""
    if isinstance(made, np.ndarray):
        return made.astype(np.float32) if made.dtype == np.float64 else made
    if isinstance(made, dict):
        return {name: _in_float32(x) for name, x in made.items()}
    return made._replace(**{name: _in_float32(x) for name, x in made._asdict().items()
                            if isinstance(x, np.ndarray | dict)})


def _attempt(runner: Runner, row: Fixed, made: Any, need_weights: bool) -> Exception | None:
    """The exception the bad call raises, or None when it returns."""
    try:
        _bad_call(runner, row, made, need_weights)
    except Exception as error:  # any exception is reported; its type is then compared
        return error
    return None


def _bad_call(runner: Runner, row: Fixed, case: Any, need_weights: bool) -> Any:
    """`row`'s call, eager (a pullback's staged), with the arrays in the dtypes the row gives them (copies,
    through asarray)."""
    if row.stage == "init":
        return getattr(runner.module, OPERATIONS[row.operation].function)(**case)
    operation = operation_of(case)
    arrays, options = arrays_and_options(case)
    if row.stage == "pullback":  # staged (JAX: traced): the forward pass and the vjp are traced, not run, before
        # the cotangent's check raises, which looks at shapes and dtypes alone
        return runner.call(operation.pullback, arrays | {"d_out": row.d_out}, None, None, **options)
    return runner.call(operation.call, arrays, None, 0, eager=True, training=True, need_weights=need_weights,
                       **options)


# --- the module's array conversions --------------------------------------------------------------------------

def round_trip(runner: Runner) -> list[Result]:
    """asarray then to_numpy gives back the same array, bit for bit, for every dtype of the framework."""
    return [_round_trip(runner, dtype) for dtype in runner.framework.dtypes]


ROUND_TRIP = Fixed("arrays", "round_trip", use="round_trip", build=lambda: None,
                   requires="to_numpy(asarray(x)) has x's dtype, shape and bits, for every dtype of the framework")


def _round_trip(runner: Runner, dtype: str) -> Result:
    row = ROUND_TRIP._replace(name=f"round_trip_{dtype}")
    if why := runner.declaration.reason(dtype):  # a dtype the module lacks (SPEC 11)
        return Result(row, [], skipped=why)
    try:
        x = np.random.default_rng(0).standard_normal((2, 3)).astype(numpy_dtype(dtype))
    except ImportError as error:  # bfloat16 needs ml_dtypes, which the framework may not have
        return Result(row, [], skipped=str(error))
    try:
        back = runner.module.to_numpy(runner.module.asarray(x))
    except Exception as error:
        return Result(row, [f"raised {type(error).__name__}: {error}"])
    if not isinstance(back, np.ndarray) or back.dtype != x.dtype or back.shape != x.shape:
        got = f"{type(back).__name__} {getattr(back, 'dtype', '')} {getattr(back, 'shape', '')}"
        return Result(row, [f"{got}, expected ndarray {x.dtype} {x.shape}"])
    same = back.tobytes() == x.tobytes()
    return Result(row, [] if same else ["other values"])


def numpy_dtype(name: str) -> Any:
    """The NumPy dtype of a name of Framework.dtypes; ImportError for bfloat16 without ml_dtypes."""
    if name == "bfloat16":  # NumPy has none of its own; ml_dtypes (which JAX uses) provides it
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


# --- the module's mask helpers -------------------------------------------------------------------------------

MASK_HELPERS = Fixed("masks", "helpers", use="helpers", build=lambda: None,
                     requires="causal_mask(L, S, q_offset=...), window_mask(L, S, window, q_offset=...) and "
                              "padding_mask(lengths, S) as the oracle builds them: bool, (..., L, S) and (B, 1, 1, S)")
CAUSAL_SIZES = ((1, 1), (3, 3), (2, 5), (5, 2), (0, 3), (3, 0))  # (L, S)
PADDING_LENGTHS = (([0, 1, 3], 3), ([5, 2], 5), ([4], 6))  # (lengths, S)
# SPEC 2a: (L, S, q_offset) for causal_mask; (L, S, window, q_offset) for window_mask
CAUSAL_OFFSETS = ((2, 5, 3), (3, 3, -1), (3, 4, [0, -2, 4]))
WINDOWS = ((4, 4, (1, 0), 0), (3, 5, (0, 0), 2), (3, 4, (None, 1), -3), (2, 6, (2, None), [[0], [3]]))


def mask_helpers(runner: Runner) -> list[Result]:
    """The public mask helpers against the oracle's own construction, on a few sizes, the empty ones too, and
    with the offsets and windows of SPEC 2a (an array offset as the module's array). Each call is staged as the
    operations are (JAX: traced, the sizes and an int offset static). A call that passes a keyword the module
    lacks (q_offset, window: SPEC 11) is skipped."""
    module = runner.module
    calls = [(f"causal_mask_{L}_{S}", "causal_mask", lambda L=L, S=S: module.causal_mask(L, S), (),
              oracle.causal_mask(L, S), ()) for L, S in CAUSAL_SIZES]
    calls += [(f"causal_mask_{L}_{S}_q_offset_{_text(offset)}", "causal_mask",
               lambda *offset, L=L, S=S, given=offset: module.causal_mask(L, S, q_offset=_given(given, offset)),
               _arrays(module, offset), oracle.causal_mask(L, S, q_offset=np.array(offset)), ("q_offset",))
              for L, S, offset in CAUSAL_OFFSETS]
    calls += [(f"window_mask_{L}_{S}_{_text(window)}_q_offset_{_text(offset)}", "window_mask",
               lambda *offset, L=L, S=S, window=window, given=offset: module.window_mask(
                   L, S, window, **({} if given == 0 else {"q_offset": _given(given, offset)})),
               _arrays(module, offset), oracle.window_mask(L, S, window, q_offset=np.array(offset)),
               ("window",) if offset == 0 else ("window", "q_offset"))
              for L, S, window, offset in WINDOWS]
    calls += [(f"padding_mask_{'_'.join(map(str, lengths))}_{S}", "padding_mask",
               lambda lengths, S=S: module.padding_mask(lengths, S), (module.asarray(np.array(lengths)),),
               oracle.padding_mask(lengths, S), ()) for lengths, S in PADDING_LENGTHS]
    return [_helper(MASK_HELPERS._replace(name=name), runner, function, call, arrays, want, needs)
            for name, function, call, arrays, want, needs in calls]


def _arrays(module: Any, offset: int | list) -> tuple[Any, ...]:
    """A staged helper's array arguments: none for an int offset (static), else the module's integer array."""
    return () if isinstance(offset, int) else (module.asarray(np.array(offset)),)


def _given(offset: int | list, arrays: tuple[Any, ...]) -> Any:
    """The offset inside the staged call: the int itself, or the array it was given."""
    return offset if isinstance(offset, int) else arrays[0]


def _text(value: Any) -> str:
    """An offset or a window for a case's name: 3, 0_-2_4, 1_None."""
    return str(value) if isinstance(value, int) else "_".join(map(str, np.ravel(np.array(value, dtype=object))))


def _helper(row: Fixed, runner: Runner, function: str, call: Any, arrays: tuple[Any, ...],
            want: np.ndarray, needs: tuple[str, ...]) -> Result:
    if missing(runner.module, (function,)):
        return Result(row, [], skipped=f"no {function}")
    if why := runner.declaration.reason(*needs):
        return Result(row, [], skipped=why)
    try:
        got = runner.module.to_numpy(runner.framework.stage(call)(*arrays))
    except Exception as error:
        return Result(row, [f"raised {type(error).__name__}: {error}"])
    if got.dtype != np.bool_ or got.shape != want.shape:
        return Result(row, [f"{got.dtype} {got.shape}, expected bool {want.shape}"])
    differs = np.argwhere(got != want)[:3].tolist()
    return Result(row, [] if not differs else [f"differs from the oracle at {differs}"])


# --- the module's rotary position embeddings --------------------------------------------------------------

ROPE = Fixed("positions", "rope", use="helpers", build=lambda: None,
             requires="apply_rope(x, positions, theta=..., interleaved=...) as the oracle turns each pair: "
                      "(..., L, E), x's dtype, to float64 rounding (in float16 and bfloat16 within ten times what "
                      "the oracle loses computing in float32)")
FLOAT64, HALF = ("float64",), ("float64", "float16", "bfloat16")  # a case's dtypes, each the framework has
FAR = [[[0, 1, 2, 3, 4]], [[4093, 4094, 4095, 4096, 4097]]]  # (2, 1, L): float16 spaces integers 4 apart there


class RopeCase(NamedTuple):
    """One case of the rope row: positions broadcast to x's (..., L); far positions and a small theta turn the pairs
    many times round; E = 2 is one pair. In half precision the positions in the thousands: an angle computed in
    float16 is off by radians there, in float32 by p * 6e-8 (SPEC 2b)."""

    shape: tuple[int, ...]  # x's (..., L, E)
    positions: int | list
    theta: float
    interleaved: bool
    dtypes: tuple[str, ...] = FLOAT64


ROPE_CASES = (RopeCase((4, 6), positions=[0, 1, 2, 3], theta=10000.0, interleaved=False),
              RopeCase((4, 6), positions=[0, 1, 2, 3], theta=10000.0, interleaved=True),
              RopeCase((2, 3, 5, 8), positions=FAR, theta=10000.0, interleaved=False, dtypes=HALF),
              RopeCase((2, 3, 5, 8), positions=FAR, theta=500.0, interleaved=True, dtypes=HALF),
              RopeCase((3, 2), positions=7, theta=1.5, interleaved=False),
              RopeCase((2, 4, 4), positions=[-2, 0, 3, 9], theta=10.0, interleaved=True))
ROPE_TOLERANCE = 1e-12  # float64: the relative error of a few rounded products


def rope_runs(dtypes: Sequence[str]) -> list[tuple[RopeCase, str]]:
    """The rope row's (case, dtype) pairs for a framework whose arrays have `dtypes`."""
    return [(case, dtype) for case in ROPE_CASES for dtype in case.dtypes if dtype in dtypes]


def rope(runner: Runner) -> list[Result]:
    """The public apply_rope against the oracle's complex rotation, both layouts, in float64, and in float16 and
    bfloat16 where the framework has them (positions as the module's integer array, or an int). Below float64 x
    is rounded to the dtype first and the module may lose LOW_PRECISION_FACTOR times what the oracle loses
    computing the case in float32 and rounding the result (`rope_tolerance`)."""
    module = runner.module
    results = []
    for case, dtype in rope_runs(runner.framework.dtypes):
        shape, positions, theta, interleaved = case.shape, case.positions, case.theta, case.interleaved
        name = (f"rope_{'x'.join(map(str, shape))}_theta_{theta:g}_{'interleaved' if interleaved else 'half'}"
                + ("" if dtype == "float64" else f"_{dtype}"))
        row = ROPE._replace(name=name)
        if missing(module, ("apply_rope",)):
            results.append(Result(row, [], skipped="no apply_rope"))
            continue
        if why := runner.declaration.reason(dtype):  # a dtype the module lacks (SPEC 11)
            results.append(Result(row, [], skipped=why))
            continue
        try:
            stored = numpy_dtype(dtype)
        except ImportError as error:  # bfloat16 without ml_dtypes
            results.append(Result(row, [], skipped=f"no {error.name or error}"))
            continue
        x = np.random.default_rng(len(shape)).standard_normal(shape).astype(stored)  # (..., L, E) in dtype
        want = oracle.rope(x, np.array(positions), theta=theta, interleaved=interleaved)  # float64
        try:
            turn = runner.framework.stage(  # staged as the operations are (JAX: traced, an int position static)
                lambda x, *given, positions=positions, theta=theta, interleaved=interleaved: module.apply_rope(
                    x, _given(positions, given), theta=theta, interleaved=interleaved))
            got = module.to_numpy(turn(module.asarray(x), *_arrays(module, positions)))
        except Exception as error:
            results.append(Result(row, [f"raised {type(error).__name__}: {error}"]))
            continue
        if got.dtype != x.dtype or got.shape != want.shape:
            results.append(Result(row, [f"{got.dtype} {got.shape}, expected {dtype} {want.shape}"]))
            continue
        error = relative_error(got.astype(np.float64), want)
        tolerance = rope_tolerance(x, case, dtype, want)
        results.append(Result(row, [] if error <= tolerance else
                              [f"relative error {error:.2e} from the oracle, over {tolerance:.2e}"]))
    return results


def rope_tolerance(x: np.ndarray, case: RopeCase, dtype: str, want: np.ndarray) -> float:
    """ROPE_TOLERANCE in float64; below it TOLERANCES' `values`, or LOW_PRECISION_FACTOR times what the oracle loses
    computing in float32 (the angles rounded there) and storing in `dtype`, where that is more (SPEC 9)."""
    if dtype == "float64":
        return ROPE_TOLERANCE
    computed = oracle.rope(x, np.array(case.positions), theta=case.theta, interleaved=case.interleaved,
                           dtype=numpy_dtype(dtype))
    return max(TOLERANCES[dtype]["values"], LOW_PRECISION_FACTOR * relative_error(computed.astype(np.float64), want))
