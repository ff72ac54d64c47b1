"""The suite as pytest tests, for users' own CI: `pytest --pyargs conformance --conformance-module NAME`."""

from __future__ import annotations

import importlib

import pytest

from conformance.contract.operations import OPERATIONS, missing
from conformance.run import suite


@pytest.mark.parametrize("operation", list(OPERATIONS))
def test_operation_conforms(conformance_module: str | None, operation: str, request: pytest.FixtureRequest) -> None:
    if conformance_module is None:
        pytest.skip("name the implementation to check with --conformance-module NAME")
    module = importlib.import_module(conformance_module)
    if absent := missing(module, (OPERATIONS[operation].function,)):  # a partial module (SPEC 11)
        pytest.skip(f"{conformance_module} has no {absent[0]}")
    report = suite.check(module, operations=[operation],
                         profile=request.config.getoption("conformance_profile"),
                         max_examples=request.config.getoption("conformance_max_examples"),
                         seed=request.config.getoption("conformance_seed"),
                         devices=request.config.getoption("conformance_devices"))
    if too_few := [row.skipped for row in report.rows if row.operation == operation and row.check == "-"]:
        pytest.skip(too_few[0])  # ring attention with fewer devices than its cases need
    assert report.passed, "\n" + suite.format_rows(report) + "\n\n" + suite.format_failures(report)
