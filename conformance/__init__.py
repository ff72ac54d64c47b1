"""The conformance suite: checks any implementation of the attention contract against a float64 oracle.

    from conformance import check
    report = check("my_attention")          # or a module object
    report.passed, report.rows

A module with part of the contract declares what it lacks (SPEC.md section 11): `CONFORMANCE =
Declaration(lacks=("weights", "dropout"))`; `conformance.adapters` wraps a kernel of another layout.
Importing this package loads neither JAX nor torch; `check` imports only the module it is given.

The package, by layer, bottom first: each module imports only from its own layer and those before it, and
no two modules import each other (tests/test_imports.py).
    frameworks/registry.py, frameworks/peers.py, cli.py   what differs between NumPy, JAX and torch; the
                                                          command line's parsing helpers
    contract/          the contract's description: operations, cases, fixed cases, oracle, strategies,
                       tolerances, features
    run/               the suite that checks a module, and its report
    frameworks/disagreements.py, frameworks/matrix.py, builtins/, adapters.py, this package
                       the frameworks' built-ins measured against the spec
    bench/             the benchmarks and figures (`python -m conformance compare`, `figure`)
    __main__.py, docs.py, pytest_plugin.py, test_conformance.py   the command line and the entry points
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
