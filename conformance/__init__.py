"""The conformance suite: checks any implementation of the attention contract against a float64 oracle.

    from conformance import check
    report = check("my_attention")          # or a module object
    report.passed, report.rows

A module with part of the contract declares what it lacks (SPEC.md section 11): `CONFORMANCE =
Declaration(lacks=("weights", "dropout"))`; `conformance.adapters` wraps a kernel of another layout.
Importing this package loads neither JAX nor torch; `check` imports only the module it is given.
"""

from __future__ import annotations

from typing import Any

from .features import Declaration

PROFILES = {"fast": 1, "thorough": 10}  # each check's examples in the fast profile, times this


def check(module: Any, **options: Any) -> Any:
    """Run the whole suite on `module`; see conformance.suite.check for the options."""
    from .suite import check as run  # hypothesis is imported only when a check runs

    return run(module, **options)


__all__ = ["PROFILES", "Declaration", "check"]
