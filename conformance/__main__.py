"""The command line.

    python -m conformance [options]                      every installed built-in backend, side by side
    python -m conformance check MODULE [MODULE ...] [options]   any implementation of the contract, or a part
    python -m conformance frameworks [--only NAME,...] [--markdown]  the frameworks' built-ins against the spec
    python -m conformance compare [--variant V] [--targets] ...  time the backends against the built-ins
    python -m conformance figure scaling [--output PATH.png]      a figure for students (needs matplotlib)
    python -m conformance docs --write|--check [--jobs N]         the docs' generated tables, measured afresh

Options: --profile fast|thorough, --max-examples N, --seed S, --json PATH, --jobs N, --devices P (ring attention on
P simulated devices); without a command and with check: --operations OP,...; check: --checks CHECK,...
The exit code is 0 only when every check passes on every module (frameworks: when every built-in measured;
docs --check: when every generated table equals what the docs show).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

from .bench import report as compare  # the compare command: its options, run and output
from .builtins import BUILT_INS as BUILT_INS_OF_THE_FRAMEWORKS
from .cli import names_of, positive_int
from .contract.cases import RING_DEVICES
from .contract.operations import OPERATIONS
from .frameworks.registry import BUILT_IN, simulate_jax_devices
from .run.profiles import PROFILES


def build_parser() -> argparse.ArgumentParser:
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument("--profile", choices=PROFILES, default="fast",
                         help="fast (default): a few examples per check; thorough: ten times as many")
    options.add_argument("--max-examples", type=positive_int, default=None, metavar="N",
                         help="N examples for every check, instead of the profile's numbers")
    options.add_argument("--seed", type=int, default=0, help="Hypothesis seed (default 0); a run is reproducible")
    options.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON")
    options.add_argument("--jobs", type=positive_int, default=None, metavar="N",
                         help="check up to N parts (a module's operation) at once, each in a process of its own "
                              "(default: one per CPU core); the report is the same")
    options.add_argument("--devices", type=positive_int, default=None, metavar="P",
                         help="P devices for ring attention, simulated on the CPU: JAX's (XLA_FLAGS, set before "
                              "JAX starts) and torch's (P - 1 peer processes in a gloo group); the ring's cases "
                              f"need {max(RING_DEVICES)} (default: those the framework has; NumPy simulates any "
                              "number)")
    parser = argparse.ArgumentParser(
        prog="python -m conformance", parents=[options],
        description="Check implementations of the attention contract against a float64 oracle. Without a "
                    "command: every installed built-in backend, side by side.")
    commands = parser.add_subparsers(dest="command")
    check = commands.add_parser("check", parents=[options], help="check the named modules")
    check.add_argument("modules", nargs="+", metavar="MODULE", help="an importable module implementing the contract")
    for checking in (parser, check):  # the side-by-side run and check
        checking.add_argument("--operations", type=names_of("operations", lambda: tuple(OPERATIONS)),
                              default=tuple(OPERATIONS), metavar="OP,...",
                              help=f"only these of {','.join(OPERATIONS)} (default: all; a module's missing ones "
                                   "are SKIP)")
    check.add_argument("--checks", type=names_of("checks", _known_measures), default=None, metavar="CHECK,...",
                       help="only the groups and tables that report these checks (the report's check column: "
                            "values, gradients, edge_cases, ...; default: all)")
    builtins = commands.add_parser(
        "frameworks", parents=[options], help="the frameworks' built-ins measured against the spec, side by side",
        description="Run the rules on which the frameworks' built-ins disagree, and the suite, on each built-in "
                    "whose framework is installed (conformance/builtins; Flax and Keras: pip install "
                    "'attention-reference[frameworks]'), and print the matrix: rows the rules, columns the "
                    "built-ins, each cell 'holds' or the measured deviation.")
    builtins.add_argument("--only", type=names_of("built-ins", lambda: BUILT_INS_OF_THE_FRAMEWORKS), default=None,
                          metavar="NAME,...",
                          help=f"only these of {','.join(BUILT_INS_OF_THE_FRAMEWORKS)}")
    builtins.add_argument("--markdown", action="store_true", help="print the matrix as a markdown table")
    builtins.add_argument("--rules-only", action="store_true", help="the rules alone, without the suite's row")
    generated = commands.add_parser(
        "docs", help="measure the docs' generated tables afresh and rewrite or compare them",
        description="Measure every block README.md, SPEC.md and docs/ show between generated markers (the frameworks "
                    "matrix and docs/frameworks.json, the kernel example's counts, the tables of the registries) and "
                    "rewrite them (--write) or say which differ (--check, exit code 1).")
    mode = generated.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite every document's blocks and docs/frameworks.json")
    mode.add_argument("--check", action="store_true", help="only compare; exit code 1 where a block differs")
    generated.add_argument("--jobs", type=positive_int, default=None, metavar="N",
                           help="measure up to N parts at once (default: one per CPU core)")
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
    if args.command == "frameworks":
        return _frameworks(args)
    if args.command == "docs":
        return _docs(args)
    if args.command == "figure":
        from conformance.bench.figures import FIGURES  # matplotlib is imported only when a figure is drawn

        print(f"wrote {FIGURES[args.name](args.output)}")
        return 0
    return _check(args)


def _check(args: argparse.Namespace) -> int:
    """`check MODULE ...`, or without a command every built-in backend side by side."""
    from .run import suite  # Hypothesis is imported only when a check runs

    names = args.modules if args.command == "check" else BUILT_IN
    if args.devices:  # before JAX starts, in the processes of --jobs and here
        simulate_jax_devices(args.devices)
    print(f"profile {args.profile}, seed {args.seed}" + (f", {args.max_examples} examples per check"
                                                         if args.max_examples else ""))
    jobs, operations = args.jobs or os.cpu_count() or 1, args.operations
    # with several jobs only the workers import the modules: this process needs no framework
    checked = (suite.reports_in_parts(names, operations=operations, jobs=jobs, done=_done, **_options(args))
               if jobs > 1 else _reports(names, args, operations))
    for name, why in checked.skipped.items():
        print(f"skipped {name}: {why}")
    # in the JSON a module that could not be checked has "passed" false under check, null (not run) otherwise
    entries = {name: {"passed": False if args.command == "check" else None, "skipped": why}
               for name, why in checked.skipped.items()}
    if not checked.reports:
        _write_json(args.json, entries)
        print("no module to check")
        return 1
    for name, (report, timing) in checked.reports.items():  # wall: its parts' seconds, summed
        print(f"{name}: {timing.wall:.1f} s, CPU {timing.cpu:.1f} s" + "".join(f"; {s}" for s in report.settings))
    reports = [report for report, _ in checked.reports.values()]
    print()
    print(suite.format_side_by_side(reports) if args.command != "check" else
          "\n".join(suite.format_rows(report) for report in reports))
    _write_json(args.json, entries | {report.rows[0].module: report.to_json() for report in reports if report.rows})
    failures = [report for report in reports if not report.passed]
    for report in failures:
        print()
        print(suite.format_failures(report))
    if checked.skipped and args.command == "check":
        failures.append(None)
    print(f"\n{'all pass' if not failures else f'{len(failures)} of {len(names)} modules failed'}"
          f"; replay with --seed {args.seed}")
    return 0 if not failures else 1


def _frameworks(args: argparse.Namespace) -> int:
    """`frameworks`: the matrix of the built-ins, measured; 1 where a built-in could not be measured."""
    from .frameworks import matrix as matrices

    names = [f"conformance.builtins.{name}" for name in args.only or BUILT_INS_OF_THE_FRAMEWORKS]
    print(f"profile {args.profile}, seed {args.seed}" + (f", {args.max_examples} examples per check"
                                                         if args.max_examples else ""))
    found = matrices.run(names, jobs=args.jobs or os.cpu_count() or 1, suite_too=not args.rules_only,
                         done=_done, **_options(args))
    for name, why in found.skipped.items():
        print(f"skipped {name}: {why}")
    print(", ".join(f"{name} {version}" for name, version in found.versions.items()))
    for column in found.columns:
        print(f"{column.title} ({column.name}): {column.seconds:.1f} s")
    print()
    print(matrices.format_text(found, markdown=args.markdown))
    _write_json(args.json, matrices.to_json(found))
    return 0


def _docs(args: argparse.Namespace) -> int:
    """`docs`: every generated block measured; 1 where --check finds one that differs."""
    from . import docs

    changed = docs.run(write=args.write, jobs=args.jobs or os.cpu_count() or 1, done=_done)
    for name in changed:
        print(f"{'rewrote' if args.write else 'differs'}: {name}")
    print("the generated tables are " + ("up to date" if not changed else "rewritten" if args.write else
                                        "stale; rewrite them with python -m conformance docs --write"))
    return 1 if changed and args.check else 0


def _reports(names: Sequence[str], args: argparse.Namespace, operations: Sequence[str]) -> Any:
    """suite.Checked for the modules checked one after the other in this process."""
    from .run import suite

    skipped = {name: why for name in names if (why := suite.unfit(name))}
    return suite.Checked(reports={name: _report(importlib.import_module(name), args, operations)
                                  for name in names if name not in skipped}, skipped=skipped)


def _report(module: ModuleType, args: argparse.Namespace, operations: Sequence[str]) -> tuple[Any, Any]:
    """One module's report and the time it took (suite.Timing), with a progress bar on stderr."""
    from .run import suite

    start, cpu = time.perf_counter(), suite.cpu_seconds()
    with _progress(suite.planned(module, operations, profile=args.profile, max_examples=args.max_examples)) as tell:
        report = suite.check(module, operations=operations, progress=tell, **_options(args))
    return report, suite.Timing(time.perf_counter() - start, suite.cpu_seconds() - cpu)


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """The suite's options from the command line."""
    return {"profile": args.profile, "max_examples": args.max_examples, "seed": args.seed,
            "measures": getattr(args, "checks", None), "devices": args.devices}


def _known_measures() -> tuple[str, ...]:
    from .run.suite import known_measures  # Hypothesis is imported only where a check runs

    return tuple(known_measures())


def _done(name: str) -> None:
    print(f"checked {name}", file=sys.stderr, flush=True)


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
