"""The suite as pytest tests, for users' own CI: `pytest --pyargs conformance --conformance-module NAME`."""

from __future__ import annotations

import pytest

from conformance import suite
from conformance.operations import OPERATIONS


@pytest.mark.parametrize("operation", list(OPERATIONS))
def test_operation_conforms(conformance_module: str | None, operation: str, request: pytest.FixtureRequest) -> None:
    if conformance_module is None:
        pytest.skip("name the implementation to check with --conformance-module NAME")
    report = suite.check(conformance_module, operations=[operation],
                         profile=request.config.getoption("conformance_profile"),
                         seed=request.config.getoption("conformance_seed"))
    assert report.passed, "\n" + suite.format_rows(report) + "\n\n" + suite.format_failures(report)
