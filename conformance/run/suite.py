"""The suite: every check, on cases drawn by Hypothesis, against one module; a report of rows.

Each group pairs a strategy with a check; a check returns named measures, and each measure becomes a
row of the report (module x operation x measure x dtype: examples, worst measure, tolerance, result).
A failure is shrunk to a small case and reported with a snippet that reproduces it.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import contextlib
import gc
import importlib
import math
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any, NamedTuple

from hypothesis import HealthCheck, Phase, Verbosity, example, given, seed, settings
from hypothesis import strategies as st
from hypothesis.errors import Flaky

from ..contract import fixed_cases, strategies
from ..contract.operations import CONTRACT, OPERATIONS, keywords_used, leave_out, missing, options_used
from ..contract.tolerances import TOLERANCES, shown
from ..frameworks.registry import Framework, import_modules, quick_compiles
from . import checks, fixed_checks, gradient_checks
from .checks import ResultError, Runner
from .profiles import PROFILES
from .snippets import describe, reproduce

BOTH, FLOAT16, FLOAT32, FLOAT64 = ("float32", "float64"), ("float16",), ("float32",), ("float64",)
HALF = ("float16", "bfloat16")  # computed in float32, stored in half precision (SPEC 2)
LOW = ("float32", *HALF)  # the low-precision gradient rows: float32, float16, bfloat16
Progress = Callable[[str], None]  # told "module operation check dtype" once per case run


class Group(NamedTuple):
    """One check on one operation: the cases it draws, the dtypes, and its examples in the fast profile."""

    operation: str  # a name of OPERATIONS
    check: Callable[[Runner, Any, str], dict[str, checks.Measure]]
    dtypes: tuple[str, ...]  # each run where the module's framework has it (NumPy has no bfloat16)
    examples: int
    draw: dict[str, Any] | None = None  # options of the operation's strategy (is_causal=True, say)
    pinned: bool = False  # also run the fixed cases' examples of the operation first, in float64 (where the module
    # runs the group in it; else in its first dtype): an example's error is plainest there, and JAX compiles each
    # example anew in every dtype
    gradient: bool = False  # needs the operation's vjp: a module without one is reported as skipped
    needs: tuple[str, ...] = ()  # features (conformance.contract.features) the check cannot do without: a module that
    # declares one of them lacking is reported as skipped
    fast_dtypes: tuple[str, ...] | None = None  # the dtypes a run in the fast profile (or with max_examples) takes:
    # None, all of `dtypes`; fewer where JAX's compiles in every dtype would take more of the main job's CPU than its
    # budget leaves (the thorough profile runs them all)

    def strategy(self) -> st.SearchStrategy:
        return getattr(strategies, OPERATIONS[self.operation].strategy)(**(self.draw or {}))

    def dtypes_in(self, profile: str, max_examples: int | None) -> tuple[str, ...]:
        """The dtypes a run in `profile` takes: `fast_dtypes` in the fast profile and with max_examples (where
        given), else every one."""
        thorough = profile != "fast" and max_examples is None
        return self.dtypes if thorough or self.fast_dtypes is None else self.fast_dtypes


# sdpa and flash: a case with mods is a new program for JAX to compile, so the value groups draw them in about
# one case of 16 to 40 (`mods_rate`), the others none ("modded": False); the pinned examples (every catalogue
# entry) run in each pinned group, the gradient groups' too
NO_MODS = {"modded": False}
GROUPS = (
    Group("sdpa", checks.against_oracle, dtypes=BOTH, examples=40, pinned=True, draw={"mods_rate": 40}),
    Group("sdpa", checks.against_oracle, dtypes=HALF, examples=10,
          draw={"magnitude": "normal", "key_offset": True} | NO_MODS),
    Group("sdpa", checks.sdpa_permutation, dtypes=FLOAT64, examples=10, draw={"is_causal": False, "positioned": False}),
    Group("sdpa", checks.sdpa_causal_prefix, dtypes=FLOAT64, examples=10,
          draw={"is_causal": True, "positioned": False}, needs=("is_causal",)),
    Group("sdpa", checks.sdpa_single_key, dtypes=FLOAT64, examples=10, draw={"single_key": True}),
    Group("sdpa", checks.dropout, dtypes=FLOAT32, examples=5, draw={"long": False} | NO_MODS, needs=("dropout",)),
    Group("sdpa", checks.dropout_independence, dtypes=FLOAT32, examples=3, draw={"long": False} | NO_MODS,
          needs=("dropout",)),
    Group("sdpa", gradient_checks.gradients, dtypes=FLOAT64, examples=8, pinned=True, gradient=True, draw=NO_MODS),
    Group("sdpa", gradient_checks.gradients_low_precision, dtypes=LOW, examples=2, gradient=True,
          draw={"magnitude": "normal", "positioned": False} | NO_MODS),
    Group("flash", checks.tiled_against_oracle, dtypes=BOTH, examples=16, pinned=True, draw={"mods_rate": 16}),
    Group("flash", checks.tiled_against_oracle, dtypes=HALF, examples=4,
          draw={"magnitude": "normal", "key_offset": True} | NO_MODS),
    Group("flash", gradient_checks.gradients, dtypes=FLOAT64, examples=6, pinned=True, gradient=True, draw=NO_MODS),
    Group("flash", gradient_checks.gradients_low_precision, dtypes=LOW, examples=2, gradient=True,
          draw={"magnitude": "normal"} | NO_MODS),
    Group("ring", checks.tiled_against_oracle, dtypes=BOTH, examples=8, pinned=True),
    Group("ring", checks.tiled_against_oracle, dtypes=HALF, examples=2, draw={"magnitude": "normal"}),
    Group("ring", gradient_checks.gradients, dtypes=FLOAT64, examples=4, pinned=True, gradient=True),
    Group("linear", checks.out_against_oracle, dtypes=BOTH, examples=8, pinned=True),
    # one case of two (the least among them) of L = S = 512 or 513 and q, k LARGE: past float16's range (SPEC 2e)
    Group("linear", checks.out_against_oracle, dtypes=HALF, examples=2,
          draw={"magnitude": "normal", "overflowing": True}),
    Group("linear", gradient_checks.gradients, dtypes=FLOAT64, examples=4, pinned=True, gradient=True),
    Group("linear", gradient_checks.gradients_low_precision, dtypes=LOW, examples=2, gradient=True,
          draw={"magnitude": "normal"}),
    Group("linear", checks.linear_steps, dtypes=BOTH, examples=4,
          draw={"is_causal": True, "with_lengths": False, "long": False}),
    Group("mha", checks.against_oracle, dtypes=BOTH, examples=20, pinned=True),
    Group("mha", checks.against_oracle, dtypes=HALF, examples=4),
    Group("mha", checks.mha_permutation, dtypes=FLOAT64, examples=8,
          draw={"cross": True, "rope": False}),  # RoPE: positions matter
    Group("mha", checks.dropout, dtypes=FLOAT32, examples=4, draw={"long": False, "linear": False}, needs=("dropout",)),
    Group("mha", checks.dropout_independence, dtypes=FLOAT32, examples=3, draw={"long": False, "linear": False},
          needs=("dropout",)),
    Group("mha", gradient_checks.gradients, dtypes=FLOAT64, examples=5, pinned=True, gradient=True),
    Group("block", checks.against_oracle, dtypes=BOTH, examples=20, pinned=True),
    Group("block", checks.against_oracle, dtypes=HALF, examples=4),
    Group("block", checks.block_permutation, dtypes=FLOAT64, examples=6, draw={"rope": False}),
    Group("block", checks.block_causal_prefix, dtypes=FLOAT64, examples=6, draw={"causal_mask": True}, needs=("mask",)),
    Group("block", checks.dropout, dtypes=FLOAT32, examples=4, draw={"long": False}, needs=("dropout",)),
    Group("block", checks.dropout_independence, dtypes=FLOAT32, examples=3, draw={"long": False}, needs=("dropout",)),
    Group("block", gradient_checks.gradients, dtypes=FLOAT64, examples=3, pinned=True, gradient=True),
    # the modules' low-precision gradients: JAX compiles each module's vjp per shape and dtype (two cases in three
    # dtypes took 6-7 s more of the main job's CPU), so the fast profile takes float16, the lowest that every
    # framework has, and the thorough profile all three
    Group("mha", gradient_checks.gradients_low_precision, dtypes=LOW, examples=2, gradient=True,
          fast_dtypes=FLOAT16),
    Group("block", gradient_checks.gradients_low_precision, dtypes=LOW, examples=2, gradient=True,
          fast_dtypes=FLOAT16),
    Group("decode", checks.against_oracle, dtypes=BOTH, examples=3, pinned=True),
    # flex: each case's mods are a new program for JAX to compile, so the pinned examples (every catalogue entry)
    # run in float64 alone, where an error is plainest; the drawn cases cover float32
    Group("flex", checks.tiled_against_oracle, dtypes=FLOAT64, examples=3, pinned=True),
    Group("flex", checks.tiled_against_oracle, dtypes=FLOAT32, examples=3),
    # two at least: Hypothesis's first draw is the least case, one query on one key, which any dtype gets exactly
    Group("flex", checks.tiled_against_oracle, dtypes=HALF, examples=2, draw={"magnitude": "normal"}),
    Group("flex", gradient_checks.gradients, dtypes=FLOAT64, examples=2, pinned=True, draw={"scored": True},
          gradient=True),
    # varlen: each case is a new program for JAX (its shapes and static options; with a block_size its boundaries
    # too), so few cases, and in the fast profile float16 alone below float32 (the thorough profile runs them all)
    Group("varlen", checks.out_against_oracle, dtypes=BOTH, examples=2, pinned=True),
    Group("varlen", checks.out_against_oracle, dtypes=HALF, examples=2, draw={"magnitude": "normal"},
          fast_dtypes=FLOAT16),
    Group("varlen", gradient_checks.gradients, dtypes=FLOAT64, examples=2, pinned=True, gradient=True),
    Group("varlen", gradient_checks.gradients_low_precision, dtypes=LOW, examples=2, gradient=True,
          draw={"magnitude": "normal"}, fast_dtypes=FLOAT16),
)


# The measures (the report's check column) each check reports, so that a run can ask for some of them; "call"
# (the module raised) and "deterministic" come from any group
MEASURES: dict[Callable, tuple[str, ...]] = {
    checks.against_oracle: ("values", "fast_path", "weights_rows"),
    checks.tiled_against_oracle: ("values", "lse"),
    checks.out_against_oracle: ("values",), checks.linear_steps: ("steps", "state_kept"),
    checks.sdpa_permutation: ("permutation",), checks.mha_permutation: ("permutation",),
    checks.block_permutation: ("permutation",),
    checks.sdpa_causal_prefix: ("causal_prefix",), checks.block_causal_prefix: ("causal_prefix",),
    checks.sdpa_single_key: ("single_key",),
    checks.dropout: ("weights", "reproducible", "varies", "mean"),
    checks.dropout_independence: ("independent", "rng_forms"),
    gradient_checks.gradients: ("gradients", "masked_rows", "no_autograd"),
    gradient_checks.gradients_low_precision: ("gradient_values", "deterministic"),
}
ANY_GROUP = ("call", "deterministic")


class FixedRun(NamedTuple):
    """Fixed cases, run without Hypothesis (conformance/run/fixed_checks.py): one row per operation, examples =
    the cases run, worst = the cases failing, tolerance 0."""

    check: str  # the row's name
    dtype: str  # "-" when the cases mix dtypes
    run: Callable[[Runner, str], Sequence[fixed_checks.Result]]  # (runner, operation) -> results
    use: str | None = None  # the rows of conformance/contract/fixed_cases.py it runs (their use); None: its own cases


FIXED_RUNS = (
    FixedRun("errors", dtype="-", run=fixed_checks.errors, use="error"),
    FixedRun("edge_cases", dtype="float64", run=fixed_checks.edge_cases, use="edge"),
)
# what every module offers besides its operations, one row each under a name of its own
CONTRACT_RUNS = {
    "arrays": FixedRun("round_trip", dtype="-", run=lambda runner, operation: fixed_checks.round_trip(runner)),
    "masks": FixedRun("helpers", dtype="-", run=lambda runner, operation: fixed_checks.mask_helpers(runner)),
    "positions": FixedRun("rope", dtype="-", run=lambda runner, operation: fixed_checks.rope(runner)),
}


class Row(NamedTuple):
    module: str
    operation: str
    check: str  # the measure's name
    dtype: str
    examples: int  # the cases run, those Hypothesis tried while shrinking a failure included
    worst: float  # the measure of the worst case: the one furthest over its tolerance, else nearest to it
    # (the largest measure / tolerance)
    tolerance: float  # the tolerance that case was held to: TOLERANCES', or the case's own where looser; a row
    # that ran passes exactly when worst <= tolerance
    passed: bool
    failure: str | None = None  # the shrunk failing case, what went wrong, and a snippet to reproduce it
    skipped: str | None = None  # why the check could not run on this module (it counts as passed)


def _skipped(module: str, operation: str, check: str, dtype: str, why: str) -> Row:
    """The row of a check that could not run on the module: no cases, and it counts as passed."""
    return Row(module, operation=operation, check=check, dtype=dtype, examples=0, worst=0.0, tolerance=0.0,
               passed=True, skipped=why)


class Report(NamedTuple):
    rows: list[Row]
    seed: int
    profile: str
    settings: list[str]  # the precision settings pinned for the run

    @property
    def passed(self) -> bool:
        return all(row.passed for row in self.rows)

    def to_json(self) -> dict[str, Any]:
        return {"seed": self.seed, "profile": self.profile, "settings": self.settings, "passed": self.passed,
                "rows": [row._asdict() | {"worst": _finite(row.worst)} for row in self.rows]}


class CheckFailure(AssertionError):
    """A case on which a measure exceeds its tolerance, or the module raised."""

    def __init__(self, message: str, measures: Sequence[str]) -> None:
        super().__init__(message)
        self.measures = list(measures)


def check(module: ModuleType | str, *, profile: str = "fast", max_examples: int | None = None, seed: int = 0,
          shrink: bool = True, operations: Sequence[str] = tuple(OPERATIONS), contract: bool = True,
          measures: Sequence[str] | None = None, progress: Progress | None = None,
          devices: int | None = None) -> Report:
    """Run every check on `module` (a module object or an importable name) and return the report.

    profile: "fast" (the default: a few examples per check) or "thorough" (ten times as many);
    max_examples: instead, this many examples for every check; seed: Hypothesis's seed, so a run is
    reproducible; shrink: reduce a failing case to a small one before reporting it; operations: the
    operations to check; contract: also check the contract's own tables (arrays, masks, positions), which
    belong to no operation; measures: only the groups and tables that report these (the report's check
    column: "values", "gradients", "edge_cases", ...; None: all); progress: called once per case run with what
    runs ("module operation check dtype"); devices: the devices ring attention may use where the framework
    cannot count them itself (torch: this process and devices - 1 peer processes, started for the ring
    operation; JAX uses the devices it sees, NumPy simulates them), its rows SKIP with fewer than its cases
    need. The rows of separate calls, each with its part of the operations, in order, are those of one call.
    """
    module = importlib.import_module(module) if isinstance(module, str) else module
    gaps = contract_gaps(module)
    if gaps:
        raise AttributeError(f"{module.__name__} does not implement the attention contract (SPEC.md section 1): "
                             f"it has no {', '.join(gaps)}")
    if max_examples is not None and max_examples < 1:
        raise ValueError(f"max_examples must be at least 1, got {max_examples}")
    wanted = _wanted(measures)
    runner, tell = Runner(module), progress or (lambda what: None)
    name = module.__name__
    with runner.framework.pinned() as pinned, quick_compiles(), _reproducible_draws():
        rows = [_fixed_row(runner, fixed, operation, tell) for operation, fixed in CONTRACT_RUNS.items()
                if contract and wanted((fixed.check,), False)]  # pinned: x64
        for operation in (operation for operation in OPERATIONS if operation in operations):
            if why := _absent(runner, operation):  # a partial module (SPEC 11)
                rows.append(_skipped(name, operation, "-", "-", why))
                continue
            with _devices(runner, OPERATIONS[operation].devices, devices) as too_few:
                if too_few:
                    rows.append(_skipped(name, operation, "-", "-", too_few))
                    continue
                for group in groups_of(operation, profile, max_examples, wanted):
                    examples = group.examples * PROFILES[profile] if max_examples is None else max_examples
                    unable = {dtype: _cannot_run(runner, group, dtype)
                              for dtype in _dtypes(group, runner.framework, profile, max_examples)}
                    runs = [dtype for dtype, why in unable.items() if not why]
                    pinned_in = "float64" if "float64" in runs else runs[0] if runs else None  # Group.pinned
                    for dtype, why in unable.items():
                        rows += ([_skipped(name, operation, group.check.__name__, dtype, why)]
                                 if why else
                                 _run_group(runner, group, dtype, examples=examples, seed_=seed, shrink=shrink,
                                            tell=tell, pinned=group.pinned and dtype == pinned_in))
                rows += [_fixed_row(runner, fixed, operation, tell) for fixed in FIXED_RUNS
                         if wanted((fixed.check,), False)]
    return Report(rows, seed=seed, profile=profile, settings=[pinned] if pinned else [])


@contextlib.contextmanager
def _devices(runner: Runner, needed: int, requested: int | None) -> Iterator[str | None]:
    """For an operation whose cases use up to `needed` devices (ring attention): the framework's devices held
    while it is checked (torch: the peer processes), and None; or why it cannot be checked here."""
    if needed == 1:
        yield None
        return
    with runner.framework.ring_devices(requested) as available:
        yield (None if available >= needed else
               f"needs {needed} devices; {runner.framework.name} has {available} here (--devices {needed} "
               f"simulates them: JAX's CPU devices, torch's peer processes)")


def _absent(runner: Runner, operation: str) -> str | None:
    """Why the module cannot run `operation` at all: it has no function for it, or it declares lacking the feature
    every case of the operation needs (Operation.needs); None when it can."""
    entry = OPERATIONS[operation]
    if absent := missing(runner.module, (entry.function,)):
        return f"no {absent[0]}"
    return None if entry.needs is None else runner.declaration.reason(entry.needs)


def known_measures() -> list[str]:
    """Every check (measure) a report can have a row for."""
    return sorted({*ANY_GROUP, *(m for reported in MEASURES.values() for m in reported),
                   *(fixed.check for fixed in (*FIXED_RUNS, *CONTRACT_RUNS.values()))})


def groups_of(operation: str, profile: str, max_examples: int | None,
              wanted: Callable[[tuple[str, ...], bool], bool] = lambda reported, group: True) -> list[Group]:
    """The groups of `operation` that a run in `profile` (or with max_examples, as the fast profile) runs: those
    `wanted` asks for that have a dtype there (Group.dtypes_in)."""
    return [group for group in GROUPS if group.operation == operation and wanted(MEASURES[group.check], True)
            and group.dtypes_in(profile, max_examples)]


def _wanted(measures: Sequence[str] | None) -> Callable[[tuple[str, ...], bool], bool]:
    """(reported, is a group) -> whether that group or table runs: every one without `measures`, else those
    that report one of them (every group for "call" and "deterministic"); unknown names are a ValueError."""
    if measures is None:
        return lambda reported, group: True
    if unknown := sorted(set(measures) - set(known_measures())):
        raise ValueError(f"unknown checks {unknown}; the checks are {known_measures()}")
    chosen = set(measures)
    return lambda reported, group: bool(chosen & set(reported)) or (group and bool(chosen & set(ANY_GROUP)))


def _cannot_run(runner: Runner, group: Group, dtype: str) -> str | None:
    """Why `group` cannot run on the runner's module in `dtype` (a missing vjp, a feature or the dtype it declares
    lacking, bfloat16 without ml_dtypes), or None."""
    lacking = missing(runner.module, (OPERATIONS[group.operation].vjp,)) if group.gradient else []
    return f"no {lacking[0]}" if lacking else runner.declaration.reason(dtype, *group.needs) or _unnamed(dtype)


class Timing(NamedTuple):
    """The seconds a check took: by the wall clock, and of CPU (user + system time of its process, all threads,
    and of the processes it started and waited for: torch's ring peers)."""

    wall: float
    cpu: float


def cpu_seconds() -> float:
    """User + system seconds of this process and of its waited-for children, so far."""
    if sys.platform == "win32":  # no resource module; children are not counted
        return time.process_time()
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def timed_check(name: str, **options: Any) -> tuple[Report, Timing]:
    """`check(name, **options)` and the time it took: what `python -m conformance --jobs N` runs in each
    process of its own (a module object cannot cross a process boundary; its name can)."""
    start, cpu = time.perf_counter(), cpu_seconds()
    report = check(name, **options)
    return report, Timing(time.perf_counter() - start, cpu_seconds() - cpu)


class Checked(NamedTuple):
    """What `reports_in_parts` found: each checked module's (report, timing), and why each other module could not
    be checked, both in the order of the names."""

    reports: dict[str, tuple[Report, Timing]]
    skipped: dict[str, str]


def unfit(name: str) -> str | None:
    """Why the module `name` cannot be checked: it does not import (a missing framework skips its module only), or
    it lacks what the suite needs (`contract_gaps`); None where it can be checked."""
    modules, skipped = import_modules([name])
    if skipped:
        return skipped[name]
    gaps = contract_gaps(modules[name])
    return f"does not implement the attention contract: it has no {', '.join(gaps)}" if gaps else None


def _part(name: str, **options: Any) -> tuple[Report, Timing] | str:
    """A part of `reports_in_parts`, in a worker: the module imported there (the parent never imports it), what the
    worker holds so far frozen (`_frozen`), then `timed_check`; or why the module cannot be checked."""
    if why := unfit(name):
        return why
    _frozen()
    return timed_check(name, **options)


def _frozen() -> None:
    """Every object the worker holds, after a collection, moved out of the garbage collector's sight (gc.freeze):
    the frameworks' modules and the suite's tables live as long as the worker, and JAX's tracing makes enough
    short-lived objects that the collector's full passes, each walking every object of JAX, torch and Hypothesis,
    took a tenth of JAX's CPU in a process checking its sdpa and mha alone (26.8-30.6 s, 23.9-26.7 s frozen; the
    whole main job, whose workers hold less, 1.5-2 s less of about 100). A worker's later collections still free
    what its cases leave behind."""
    gc.collect()
    gc.freeze()


def reports_in_parts(names: Sequence[str], *, operations: Sequence[str] = tuple(OPERATIONS), jobs: int,
                     done: Callable[[str], None] | None = None, **options: Any) -> Checked:
    """Each module's (report, timing), up to `jobs` parts checked at once in processes of their own (spawned,
    so no framework state is shared with this one, which imports none of the modules). A part is one module's
    one operation (the first also checks the contract's tables): JAX compiles every case, so its parts take
    several workers while NumPy and torch fill the gaps. The parts of a module, joined in order, are its report;
    its timing, the sum of its parts'. A module that does not import, or lacks the contract, is in `skipped`
    with the reason. done(name) is told when a checked module's last part is done; options go to `check`."""
    context = multiprocessing.get_context("spawn")
    parts = [(name, operation, index == 0) for index, operation in enumerate(operations) for name in names]
    with concurrent.futures.ProcessPoolExecutor(max(1, min(jobs, len(parts))), mp_context=context,
                                                initializer=_start_worker) as pool:
        futures = {pool.submit(_part, name, operations=(operation,), contract=contract, **options): name
                   for name, operation, contract in parts}
        left = collections.Counter(name for name, _, _ in parts)
        for future in concurrent.futures.as_completed(futures):
            left[futures[future]] -= 1
            if not left[futures[future]] and done is not None and not isinstance(future.result(), str):
                done(futures[future])
        results = [(name, future.result()) for future, name in futures.items()]
    skipped = {name: result for name, result in results if isinstance(result, str)}
    return Checked(reports={name: _joined([result for part, result in results if part == name])
                            for name in names if name not in skipped}, skipped=skipped)


def _start_worker() -> None:
    """The initializer of each worker of `reports_in_parts`: torch on one thread, and no teardown at exit."""
    _one_thread_each()
    atexit.register(_exit_at_once)  # registered before any framework is imported, so it runs after theirs


def _exit_at_once() -> None:
    """A worker's last act, when the pool shuts down: its reports are sent, and the atexit handlers of its
    frameworks and of multiprocessing have run (registered later, they run earlier). os._exit skips the
    interpreter's teardown, which frees every module and object one by one: a process's exit after JAX's sdpa
    part measured 1.5-2.0 s of CPU with it, 0.45-0.7 s without (JAX's own handler, which frees its compiled
    programs, still runs)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _one_thread_each() -> None:
    """A worker of `reports_in_parts` has a core's share of the machine and its cases are tiny: torch's OpenMP
    threads there only spin and wait on each other, so torch computes on the worker's own thread. Measured on 2
    busy cores: torch's block part 9-11 s of CPU with its default threads, 2.0-2.5 s with one (its sdpa part
    4.3-4.6 s, 2.5-3.4 s). JAX's threads (async dispatch, XLA's Eigen pool) were measured and left as they are:
    no difference beyond the noise. A value the user set in the environment is kept."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torch: read when torch loads, which it has not yet here


def _joined(parts: list[tuple[Report, Timing]]) -> tuple[Report, Timing]:
    """One report of a module's parts, in order, and the time they took together (a worker's start-up, before
    its first part, is in no part's: the run's whole CPU time is larger than its modules' sum)."""
    first = parts[0][0]
    return (first._replace(rows=[row for report, _ in parts for row in report.rows]),
            Timing(sum(timing.wall for _, timing in parts), sum(timing.cpu for _, timing in parts)))


@contextlib.contextmanager
def _reproducible_draws() -> Iterator[None]:
    """Draws that depend on the seed alone. Hypothesis (from 6.131) also draws integer and string constants
    found in the source of whatever local modules the process has imported, so a case would depend on the
    modules imported before it (the checked module, the others of a `--jobs` run, a test file): while the
    suite draws, that collection is empty. Its own constants, Hypothesis's global ones, are kept."""
    try:
        from hypothesis.internal.conjecture import providers  # hypothesis: no public switch for this
    except ImportError:  # a Hypothesis without the collection
        yield
        return
    collect = getattr(providers, "_get_local_constants", None)
    if collect is None or not hasattr(providers, "Constants"):
        yield
        return
    none = providers.Constants()
    providers._get_local_constants = lambda: none
    providers.CONSTANTS_CACHE.cache.clear()  # permitted constants computed with the collection
    try:
        yield
    finally:
        providers._get_local_constants = collect
        providers.CONSTANTS_CACHE.cache.clear()


def planned(module: ModuleType, operations: Sequence[str] = tuple(OPERATIONS), *, profile: str = "fast",
            max_examples: int | None = None) -> int:
    """How many cases `check` runs on `module` when every check passes (shrinking a failure runs more)."""
    runner = Runner(module)
    framework = runner.framework
    operations = [operation for operation in operations if not _absent(runner, operation)]
    total = len(framework.dtypes) + sum(len(helpers) for helpers in (
        fixed_checks.CAUSAL_SIZES, fixed_checks.CAUSAL_OFFSETS, fixed_checks.WINDOWS, fixed_checks.PADDING_LENGTHS,
        fixed_checks.rope_runs(framework.dtypes)))
    for group in (group for group in GROUPS if group.operation in operations):
        examples = group.examples * PROFILES[profile] if max_examples is None else max_examples
        examples += len(fixed_cases.rows(group.operation, "example")) if group.pinned else 0
        total += examples * len(_dtypes(group, framework, profile, max_examples))
    return total + sum(len(fixed_cases.rows(operation, use)) for operation in operations for use in ("edge", "error"))


def contract_gaps(module: ModuleType) -> list[str]:
    """The names of the contract that the suite needs and `module` lacks: asarray, to_numpy and at least one
    operation (a partial module's other operations are reported as skipped, SPEC 11)."""
    functions = tuple(operation.function for operation in OPERATIONS.values() if "." not in operation.function)
    return missing(module, CONTRACT) + ([f"any of {', '.join(functions)}"]
                                        if len(missing(module, functions)) == len(functions) else [])


def _dtypes(group: Group, framework: Framework, profile: str, max_examples: int | None) -> tuple[str, ...]:
    """The group's dtypes in a run in `profile` (Group.dtypes_in) that the framework's arrays have."""
    return tuple(dtype for dtype in group.dtypes_in(profile, max_examples) if dtype in framework.dtypes)


def _unnamed(dtype: str) -> str | None:
    """Why NumPy cannot hold `dtype` here (bfloat16 without ml_dtypes), or None."""
    try:
        fixed_checks.numpy_dtype(dtype)  # bfloat16: importing ml_dtypes gives NumPy the name
    except ImportError as error:
        return f"no {error.name or error}"
    return None


def _fixed_row(runner: Runner, fixed: FixedRun, operation: str, tell: Progress) -> Row:
    """The table's cases for `operation` as one row; the failure lists each failing case."""
    name = runner.module.__name__
    results = fixed.run(runner, operation)
    for _ in results:
        tell(f"{name} {operation} {fixed.check}")
    summary = fixed_checks.summarize(results)
    failure = (None if summary.failure is None else
               f"{name} {operation} {fixed.check} {fixed.dtype}: {summary.failing} of {summary.examples} cases "
               f"fail\n{summary.failure}")
    reasons = list(dict.fromkeys(result.skipped for result in results if result.skipped))  # none ran: SKIP
    return Row(name,
               operation=operation,
               check=fixed.check,
               dtype=fixed.dtype,
               examples=summary.examples,
               worst=float(summary.failing),
               tolerance=0.0,
               passed=summary.failing == 0,
               failure=failure,
               skipped="; ".join(reasons) if results and not summary.examples else None)


def _run_group(runner: Runner, group: Group, dtype: str, *, examples: int, seed_: int, shrink: bool,
               tell: Progress, pinned: bool = False) -> list[Row]:
    """Hypothesis drives the group's check over `examples` cases (plus the fixed cases' examples, if pinned); each
    measure becomes a row."""
    tolerance, count = TOLERANCES[dtype], [0]
    held: dict[str, tuple[float, float]] = {}  # measure -> (measure, tolerance) of its worst case (`_excess`)
    first: dict[str, str] = {}  # each measure's first failure: a row fails on any case over its tolerance
    skips: dict[str, str] = {}  # measure -> why the module's declaration rules it out (SPEC 11)
    name = runner.module.__name__

    def body(case: Any) -> None:
        if case is None:  # the drawn case needs a module option the module lacks (SPEC 11): not run
            return
        count[0] += 1
        tell(f"{name} {group.operation} {group.check.__name__} {dtype}")
        try:
            measures = group.check(runner, case, dtype)
        except Exception as error:  # the module raised, or returned what the contract does not allow
            what = str(error) if isinstance(error, ResultError) else f"raised {type(error).__name__}: {error}"
            message = _failure(name, group, dtype, case, what)
            first.setdefault("call", message)
            raise CheckFailure(message, ["call"]) from error
        passes = {m: value.skipped for m, value in measures.items() if value.skipped}  # the declaration's
        skips.update(passes)
        measures = {m: value for m, value in measures.items() if m not in passes}
        allowed = {m: max(tolerance[m], value.tolerance) for m, value in measures.items()}
        for measure, value in measures.items():
            seen = (value.error, allowed[measure])
            if measure not in held or _excess(*seen) > _excess(*held[measure]):
                held[measure] = seen
        bad = {m: value for m, value in measures.items() if not value.error <= allowed[m]}
        if bad:
            what = "; ".join(f"{m} {' > '.join(shown(v.error, allowed[m], 3))}: {v.detail}" for m, v in bad.items())
            message = _failure(name, group, dtype, case, what)
            for measure in bad:
                first.setdefault(measure, message)
            raise CheckFailure(message, list(bad))

    declaration = runner.declaration  # a partial module runs the cases it can (SPEC 11); every module is drawn the
    # same cases for a seed: a filter here would draw others in their place, so a case it cannot run is passed over
    drawn = group.strategy().map(lambda case: leave_out(case, declaration))
    test = given(case=drawn)(body)
    fixed = (leave_out(row.build(), declaration) for row in fixed_cases.rows(group.operation, "example")) \
        if pinned else ()
    for case in (case for case in fixed if case is not None):
        test = example(case=case)(test)
    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if shrink else [])
    test = settings(max_examples=examples, deadline=None, database=None, derandomize=False, phases=phases,
                    verbosity=Verbosity.quiet, report_multiple_bugs=False,
                    suppress_health_check=list(HealthCheck))(seed(seed_)(test))
    shrunk: dict[str, str] = {}  # measure -> the failure Hypothesis reports: the shrunk case
    try:
        test()
    except CheckFailure as error:
        shrunk = dict.fromkeys(error.measures, str(error))
    except Flaky:  # a failure that did not repeat on the same case: the module is not deterministic
        shrunk = {"deterministic": f"{name} {group.operation} {group.check.__name__} {dtype}: a failing case "
                                   "passed when run again, so the module gives different results for the same "
                                   "inputs; the first failure:\n" + next(iter(first.values()), "")}
    failures = first | shrunk  # a case over a tolerance fails its row, also one left behind while shrinking
    if not count[0] and not failures:  # every case drawn needed a module option the module lacks
        why = "every case drawn needs a module option it lacks"
        return [_skipped(name, group.operation, group.check.__name__, dtype, why)]
    names = list(held) or ([] if skips and not failures else ["call"])
    names += [m for m in failures if m not in names]
    rows = []
    for m in names:
        worst, held_to = held.get(m, (math.inf, tolerance.get(m, 0.0)))  # (measure, tolerance); no case held: inf
        rows.append(Row(name, operation=group.operation, check=m, dtype=dtype, examples=count[0], worst=worst,
                        tolerance=held_to, passed=m not in failures and m in held, failure=failures.get(m)))
    return rows + [_skipped(name, group.operation, m, dtype, why) for m, why in skips.items() if m not in names]


def _excess(error: float, tolerance: float) -> tuple[bool, float]:
    """How far a case lies from its tolerance, to find a row's worst case: cases over it (NaN too) before cases
    within it, each ordered by error / tolerance (0 / 0 = 0, x / 0 = inf)."""
    over = not error <= tolerance
    if tolerance == 0 or math.isnan(error):
        return over, math.inf if over else 0.0
    return over, error / tolerance


def _failure(module: str, group: Group, dtype: str, case: Any, what: str) -> str:
    check_name = group.check.__name__
    return (f"{module} {group.operation} {check_name} {dtype}: {what}\n"
            f"case: {describe(case)}\n{_keywords_note(case)}"
            f"reproduce:\n{reproduce(module, check_name, case, dtype)}")


def _keywords_note(case: Any) -> str:
    """A line naming the keywords of SPEC 2a the case passes, which a module from before them refuses."""
    used, options = keywords_used(case), options_used(case)
    note = f"uses the keywords of SPEC 2a: {', '.join(used)}\n" if used else ""
    return note + (f"uses the module options of SPEC 5: {_listed(options)}\n" if options else "")


def _listed(options: dict) -> str:
    return ", ".join(f"{name}={value!r}" for name, value in options.items())


def _finite(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)


# --- tables --------------------------------------------------------------------------------------------

def format_rows(report: Report) -> str:
    """One line per row: module x operation x check x dtype, with examples, the worst case's measure and the
    tolerance it was held to, and the result (PASS exactly where worst <= tolerance, as printed)."""
    width = max(18, *(len(row.module) + 2 for row in report.rows))
    check = max(14, *(len(row.check) + 1 for row in report.rows))  # a skipped group is named by its check
    lines = [f"{'module':<{width}}{'operation':<10}{'check':<{check}}{'dtype':<9}{'examples':>9}  "
             f"{'worst':<10}{'tolerance':<11}result"]
    for row in report.rows:
        worst, tolerance = shown(row.worst, row.tolerance, 3)
        lines.append(f"{row.module:<{width}}{row.operation:<10}{row.check:<{check}}{row.dtype:<9}{row.examples:>9}  "
                     f"{worst:<9} {tolerance:<10} {_result(row)}")
    return "\n".join(lines)


def format_side_by_side(reports: Sequence[Report]) -> str:
    """Rows operation x check x dtype, one column per module: the worst case's measure, <= or > the tolerance it
    was held to (a case may have its own, looser than TOLERANCES': SPEC 9), and PASS / FAIL."""
    modules = [report.rows[0].module for report in reports if report.rows]
    keys = list(dict.fromkeys((r.operation, r.check, r.dtype) for report in reports for r in report.rows))
    order = {operation: i for i, operation in enumerate(dict.fromkeys(key[0] for key in keys))}
    keys.sort(key=lambda key: order[key[0]])  # stable: a row only one module has stays with its operation
    cells = {(r.module, r.operation, r.check, r.dtype): r for report in reports for r in report.rows}
    table = [["operation", "check", "dtype", *modules]]
    table += [[operation, check_name, dtype, *(_cell(cells.get((module, operation, check_name, dtype)))
                                               for module in modules)] for operation, check_name, dtype in keys]
    widths = [max(len(line[i]) for line in table) + 2 for i in range(len(table[0]))]
    lines = ["".join(f"{cell:<{width}}" for cell, width in zip(line, widths, strict=True)).rstrip() for line in table]
    skips = dict.fromkeys(f"{r.module} {r.operation}{'' if r.check == '-' else ' ' + r.check}: {r.skipped}"
                          for report in reports for r in report.rows if r.skipped)
    return "\n".join(lines + ([""] + [f"SKIP {why}" for why in skips] if skips else []))


def _cell(row: Row | None) -> str:
    """A module's cell of the side-by-side table: "2.0e-03 <= 2.1e-02 PASS", "SKIP", or "-" (no such row)."""
    if row is None or row.skipped:
        return "-" if row is None else "SKIP"
    worst, tolerance = shown(row.worst, row.tolerance)
    return f"{worst} {'<=' if row.worst <= row.tolerance else '>'} {tolerance} {_result(row)}"


def _result(row: Row) -> str:
    return f"SKIP ({row.skipped})" if row.skipped else "PASS" if row.passed else "FAIL"


def format_failures(report: Report) -> str:
    failures = dict.fromkeys(row.failure for row in report.rows if row.failure)
    return "\n\n".join(f"FAIL {failure}" for failure in failures)
