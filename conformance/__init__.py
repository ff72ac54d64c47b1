"""The conformance suite: checks any implementation of the attention contract against a float64 oracle.

    from conformance import check
    report = check("my_attention")          # or a module object
    report.passed, report.rows

A module with part of the contract declares what it lacks (SPEC.md section 12): `CONFORMANCE =
Declaration(lacks=("weights", "dropout"))`; `conformance.adapters` wraps a kernel of another layout.
Importing this package loads neither JAX nor torch; `check` imports only the module it is given.

The package, by layer (each imports only from those above it):
    conformance/frameworks/registry.py, peers.py   what differs between NumPy, JAX and torch
    conformance/contract/                          the contract's description: operations, cases, fixed cases,
                                                   oracle, strategies, tolerances, features
    conformance/run/                               the suite that checks a module, and its report
    conformance/frameworks/disagreements.py, matrix.py, conformance/builtins/, conformance/adapters.py
                                                   the frameworks' built-ins measured against the spec
    conformance/bench/                             the benchmarks and figures (`python -m conformance compare`)
    conformance/cli.py, conformance/__main__.py    the command line
"""

from __future__ import annotations

from typing import Any

from .contract.features import Declaration
from .run.profiles import PROFILES


def check(module: Any, **options: Any) -> Any:
    """Run the whole suite on `module`; see conformance.run.suite.check for the options."""
    from .run.suite import check as run  # hypothesis is imported only when a check runs

    return run(module, **options)


__all__ = ["PROFILES", "Declaration", "check"]
