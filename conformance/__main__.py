"""The command line.

    python -m conformance [options]                      every installed built-in backend, side by side
    python -m conformance check MODULE [MODULE ...] [options]   any implementation of the contract
    python -m conformance compare [--variant V] [--targets] ...  time the backends against the built-ins
    python -m conformance figure scaling [--output PATH.png]      a figure for students (needs matplotlib)

Options: --profile fast|thorough, --max-examples N, --seed S, --json PATH, --jobs N. The exit code is 0
only when every check passes on every module.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

from . import PROFILES
from .bench import report as compare  # the compare command: its options, run and output
from .frameworks import BUILT_IN, import_modules


def build_parser() -> argparse.ArgumentParser:
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument("--profile", choices=PROFILES, default="fast",
                         help="fast (default): a few examples per check; thorough: ten times as many")
    options.add_argument("--max-examples", type=compare.positive_int, default=None, metavar="N",
                         help="N examples for every check, instead of the profile's numbers")
    options.add_argument("--seed", type=int, default=0, help="Hypothesis seed (default 0); a run is reproducible")
    options.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON")
    options.add_argument("--jobs", type=compare.positive_int, default=None, metavar="N",
                         help="check up to N parts (a module's operation) at once, each in a process of its own "
                              "(default: one per CPU core); the report is the same")
    parser = argparse.ArgumentParser(
        prog="python -m conformance", parents=[options],
        description="Check implementations of the attention contract against a float64 oracle. Without a "
                    "command: every installed built-in backend, side by side.")
    commands = parser.add_subparsers(dest="command")
    check = commands.add_parser("check", parents=[options], help="check the named modules")
    check.add_argument("modules", nargs="+", metavar="MODULE", help="an importable module implementing the contract")
    figure = commands.add_parser("figure", help="draw a figure for students with attention_np and matplotlib")
    figure.add_argument("name", choices=["scaling"], help="scaling: why the scores are divided by sqrt(d_k)")
    figure.add_argument("--output", default="docs/scaling.png", metavar="PATH", help="the PNG to write")
    timing = commands.add_parser("compare", help="time the backends against the frameworks' built-ins",
                                 description=compare.__doc__.split("\n\n")[0], epilog=compare.FOOTNOTE,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    compare.add_arguments(timing)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "compare":
        return compare.main(args)
    if args.command == "figure":
        from attention_np.figures import FIGURES  # matplotlib is imported only when a figure is drawn

        print(f"wrote {FIGURES[args.name](args.output)}")
        return 0
    return _check(args)


def _check(args: argparse.Namespace) -> int:
    """`check MODULE ...`, or without a command every built-in backend side by side."""
    from . import suite  # Hypothesis is imported only when a check runs

    names = args.modules if args.command == "check" else BUILT_IN
    modules, skipped = import_modules(names)
    gaps = {name: suite.contract_gaps(module) for name, module in modules.items()}
    for name in (name for name, missing in gaps.items() if missing):
        del modules[name]
        skipped[name] = f"does not implement the attention contract: it has no {', '.join(gaps[name])}"
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    # in the JSON a module that could not be checked has "passed" false under check, null (not run) otherwise
    entries = {name: {"passed": False if args.command == "check" else None, "skipped": why}
               for name, why in skipped.items()}
    if not modules:
        _write_json(args.json, entries)
        print("no module to check")
        return 1
    print(f"profile {args.profile}, seed {args.seed}" + (f", {args.max_examples} examples per check"
                                                         if args.max_examples else ""))
    jobs = args.jobs or os.cpu_count() or 1
    reports = (_reports_at_once(list(modules), args, jobs) if jobs > 1 else
               [_report(module, args) for module in modules.values()])
    for name, (report, seconds) in zip(modules, reports, strict=True):
        print(f"{name}: {seconds:.1f} s" + "".join(f"; {s}" for s in report.settings))
    reports = [report for report, _ in reports]
    print()
    print(suite.format_side_by_side(reports) if args.command != "check" else
          "\n".join(suite.format_rows(report) for report in reports))
    _write_json(args.json, entries | {report.rows[0].module: report.to_json() for report in reports if report.rows})
    failures = [report for report in reports if not report.passed]
    for report in failures:
        print()
        print(suite.format_failures(report))
    if skipped and args.command == "check":
        failures.append(None)
    print(f"\n{'all pass' if not failures else f'{len(failures)} of {len(names)} modules failed'}"
          f"; replay with --seed {args.seed}")
    return 0 if not failures else 1


def _report(module: ModuleType, args: argparse.Namespace) -> tuple[Any, float]:
    """One module's report and the seconds it took, with a progress bar on stderr."""
    from . import suite

    start = time.perf_counter()
    with _progress(suite.planned(module, profile=args.profile, max_examples=args.max_examples)) as tell:
        report = suite.check(module, profile=args.profile, max_examples=args.max_examples, seed=args.seed,
                             progress=tell)
    return report, time.perf_counter() - start


def _reports_at_once(names: list[str], args: argparse.Namespace, jobs: int) -> list[tuple[Any, float]]:
    """The modules' reports, up to `jobs` parts checked at once in processes of their own (spawned, so no
    framework state is shared with this one). A part is one module's one operation (the first also checks the
    contract's tables): JAX compiles every case, so its parts take several workers while NumPy and torch
    fill the gaps. The parts of a module, joined in order, are its report. No per-case progress: stderr says
    when each module is done. Each module's seconds are the sum of its parts'."""
    from . import suite
    from .operations import OPERATIONS

    context = multiprocessing.get_context("spawn")
    options = {"profile": args.profile, "max_examples": args.max_examples, "seed": args.seed}
    parts = [(name, operation, index == 0) for index, operation in enumerate(OPERATIONS) for name in names]
    with concurrent.futures.ProcessPoolExecutor(min(jobs, len(parts)), mp_context=context) as pool:
        futures = {pool.submit(suite.timed_check, name, operations=(operation,), contract=contract, **options):
                   name for name, operation, contract in parts}
        left = collections.Counter(name for name, _, _ in parts)
        for future in concurrent.futures.as_completed(futures):
            left[futures[future]] -= 1
            if not left[futures[future]]:
                print(f"checked {futures[future]}", file=sys.stderr, flush=True)
        results = [(name, future.result()) for future, name in futures.items()]
    return [_joined([result for part, result in results if part == name]) for name in names]


def _joined(parts: list[tuple[Any, float]]) -> tuple[Any, float]:
    """One report of a module's parts, in order, and the seconds they took together."""
    first = parts[0][0]
    rows = [row for report, _ in parts for row in report.rows]
    return first._replace(rows=rows), sum(seconds for _, seconds in parts)


@contextlib.contextmanager
def _progress(total: int) -> Iterator[Callable[[str], None]]:
    """A progress bar on stderr, when it is a terminal: what runs and how many cases are done."""
    from tqdm import tqdm

    with tqdm(total=total, unit="case", file=sys.stderr, disable=None, leave=False, dynamic_ncols=True) as bar:
        def tell(what: str) -> None:
            bar.set_description(what, refresh=False)
            bar.update()
        yield tell


def _write_json(path: str | None, entries: dict) -> None:
    if path:
        with open(path, "w") as file:
            json.dump(entries, file, indent=1)


if __name__ == "__main__":
    sys.exit(main())
