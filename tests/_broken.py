"""What every tests/test_broken_*.py asks of a planted bug, in one place: its class's docstring names the checks that
catch it, and the suite rejects it by one of them with a failure a user can act on (the module, the operation and
the dtype named, the case shown, a snippet that imports the module)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import ModuleType
from typing import Any

from conformance import check


def assert_docstrings_name_their_checks(checks: Mapping[str, Iterable[str]], variants: Mapping[str, type]) -> None:
    """Each variant's docstring names, after "Caught by:", every check of checks[variant]."""
    for name, cls in variants.items():
        caught_by = cls.__doc__.split("Caught by:")[1]
        assert all(check_name in caught_by for check_name in checks[name]), name


def assert_rejected(name: str, module: ModuleType, operation: str, checks: Iterable[str], **options: Any) -> None:
    """The suite, run on `operation` without shrinking, fails `module` (variant `name`) by one of `checks`, and
    that row's failure names the module, the operation and the dtype, shows the case and carries a snippet that
    imports the module. options: more keywords of conformance.check (contract=False)."""
    checks = set(checks)
    report = check(module, operations=(operation,), shrink=False, measures=sorted(checks), **options)
    caught = [row for row in report.rows if not row.passed and row.check in checks]
    assert caught, f"{name} failed {sorted({row.check for row in report.rows if not row.passed})}"
    head, _, snippet = caught[0].failure.partition("reproduce:\n")
    assert head.startswith(f"{module.__name__} {operation} ") and f" {caught[0].dtype}: " in head, head
    assert "case: " in head and f"import {module.__name__}\n" in snippet
