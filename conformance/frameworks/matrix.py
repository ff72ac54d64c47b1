"""`python -m conformance frameworks`: the frameworks' built-ins (conformance/builtins) measured against the spec,
one column each: the rules on which they disagree in meaning (conformance/frameworks/disagreements.py), and the
suite's verdict on the rest of their contract, as a matrix of cells in a few words, every one produced by a run.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from . import disagreements
from .registry import import_modules

SUITE = "the suite"  # the last row: the suite's verdict on what the module declares it has


class Column(NamedTuple):
    name: str  # the module's importable name
    title: str  # its TITLE
    cells: dict[str, disagreements.Cell]  # rule -> cell, the suite's row included
    seconds: float
    report: Any  # the suite's Report


class Matrix(NamedTuple):
    columns: list[Column]
    skipped: dict[str, str]  # module -> why it could not be measured (its framework is not installed)
    versions: dict[str, str]  # framework -> its installed version: the cells are those versions'


FRAMEWORKS = ("torch", "jax", "flax", "keras")  # whose versions the matrix records


def versions() -> dict[str, str]:
    """The installed versions of FRAMEWORKS (a missing one left out)."""
    import importlib.metadata

    found = {}
    for name in FRAMEWORKS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def measure_one(name: str) -> tuple[str, dict[str, disagreements.Cell], float]:
    """A module's TITLE and rule cells, and the seconds they took: one process's work."""
    start = time.perf_counter()
    module = __import__(name, fromlist=["_"])
    return getattr(module, "TITLE", name), disagreements.measure(module), time.perf_counter() - start


def run(names: Sequence[str], *, jobs: int = 1, suite_too: bool = True, done: Callable[[str], None] | None = None,
        **options: Any) -> Matrix:
    """Every module's rules and (suite_too) its suite report (options: `check`'s), up to `jobs` processes at once
    (spawned: no framework state shared): the rules one process per module, the suite in parts
    (suite.reports_in_parts); with jobs=1 all of it in this process, one module after the other."""
    from ..run import suite

    modules, skipped = import_modules(names)
    names = list(modules)
    if jobs == 1:  # one after the other, in this process
        return Matrix(columns=[column(name, suite_too=suite_too, **options) for name in names], skipped=skipped,
                      versions=versions())
    with concurrent.futures.ProcessPoolExecutor(min(jobs, len(names) or 1),
                                                mp_context=multiprocessing.get_context("spawn")) as pool:
        measured = list(pool.map(measure_one, names))
    reports = list(suite.reports_in_parts(names, jobs=jobs, done=done, **options).reports.values()) \
        if suite_too and names else [(None, suite.Timing(0.0, 0.0))] * len(names)  # each imported here, so none skipped
    return Matrix(columns=[_column(name, *parts) for name, *parts in zip(names, measured, reports, strict=True)],
                  skipped=skipped, versions=versions())


def column(name: str, *, suite_too: bool = True, **options: Any) -> Column:
    """One module's column, measured in this process: its rules and (suite_too) its suite report."""
    from ..run import suite

    timed = suite.timed_check(name, **options) if suite_too else (None, suite.Timing(0.0, 0.0))
    return _column(name, measure_one(name), timed)


def _column(name: str, measured: tuple[str, dict[str, disagreements.Cell], float], timed: tuple[Any, Any]) -> Column:
    """The column of measure_one's (title, cells, seconds) and the suite's (report, Timing), or (None, zero)."""
    (title, cells, seconds), (report, timing) = measured, timed
    return Column(name, title=title, cells=cells if report is None else cells | {SUITE: suite_cell(report)},
                  seconds=seconds + timing.wall, report=report)


def suite_cell(report: Any) -> disagreements.Cell:
    """The suite's verdict in a few words: the rows that ran and passed, those the declaration skips, or the
    failing ones."""
    ran = [row for row in report.rows if not row.skipped]
    failing = [row for row in ran if not row.passed]
    if failing:
        named = sorted({f"{row.check} ({row.operation})" for row in failing})
        more = f" and {len(named) - 3} more" if len(named) > 3 else ""
        return disagreements.Cell(False, f"fails {', '.join(named[:3])}{more}")
    skipped = len(report.rows) - len(ran)
    return disagreements.Cell(True, f"{len(ran)} rows pass, {skipped} skip")


def rows(matrix: Matrix) -> list[tuple[str, str]]:
    """(rule, what the spec says) for each row of the matrix."""
    found = [(rule.name, rule.spec) for rule in disagreements.RULES]
    if any(SUITE in column.cells for column in matrix.columns):  # a run with the suite (not --rules-only)
        found.append((SUITE, "what it declares it has"))
    return found


def format_text(matrix: Matrix, *, markdown: bool = False) -> str:
    """The matrix as a table: rows the rules, columns the built-ins; markdown for a README."""
    header = ["rule", "spec", *(column.title for column in matrix.columns)]
    table = [[rule, spec, *(column.cells.get(rule, disagreements.Cell(None, "-")).text for column in matrix.columns)]
             for rule, spec in rows(matrix)]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(lines + ["| " + " | ".join(line) + " |" for line in table])
    widths = [max(len(line[i]) for line in [header, *table]) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
                     for line in [header, *table])


def to_json(matrix: Matrix) -> dict[str, Any]:
    return {"versions": matrix.versions, "rules": [{"rule": rule, "spec": spec} for rule, spec in rows(matrix)],
            "columns": [{"module": column.name, "title": column.title, "seconds": round(column.seconds, 1),
                         "cells": {rule: cell._asdict() for rule, cell in column.cells.items()},
                         "suite": None if column.report is None else column.report.to_json()}
                        for column in matrix.columns],
            "skipped": matrix.skipped}


def from_json(found: dict[str, Any]) -> Matrix:
    """The matrix `to_json` wrote (the suite's reports as their JSON), to print again."""
    columns = [Column(column["module"], title=column["title"],
                      cells={rule: disagreements.Cell(**cell) for rule, cell in column["cells"].items()},
                      seconds=column["seconds"], report=column["suite"]) for column in found["columns"]]
    return Matrix(columns=columns, skipped=found["skipped"], versions=found["versions"])
