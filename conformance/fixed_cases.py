"""What the two tables of fixed cases share: the error inputs (error_checks.py) and the edge cases
(edge_checks.py) cover the same operations with modules of the same sizes, and each table's results for
one operation become one row of the suite's report.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

OPERATIONS = ("sdpa", "mha", "block")
D, H, F = 4, 2, 8  # the modules' sizes in both tables: d_model, num_heads, d_ff


class Result(Protocol):
    """One case's result in either table (ErrorResult, EdgeResult); a result with `skipped` set to a
    reason did not run."""

    @property
    def passed(self) -> bool: ...

    def describe(self) -> str: ...


class Summary(NamedTuple):
    """One operation's results of one table, in the shape of a suite row."""

    examples: int  # the cases run (skipped ones not counted)
    failing: int
    failure: str | None  # each failing case: what was expected and what happened


def summarize(results: Sequence[Result]) -> Summary:
    """The results of one table for one operation as a Summary; skipped results do not count."""
    run = [result for result in results if getattr(result, "skipped", None) is None]
    failing = [result for result in run if not result.passed]
    failure = "\n".join(f"  {result.describe()}" for result in failing) or None
    return Summary(len(run), len(failing), failure)
