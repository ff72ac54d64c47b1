"""The suite's sdpa, flash and ring operations, seen by the author of a kernel with learned sinks and ALiBi: they accept
attention_np's, and reject each realistic bug of `implementations/broken_sinks.py` by the check its docstring names,
with a failure that names the module and carries a snippet. Each bug is right on every call without sinks or
alibi_slopes: the suite's drawn and pinned cases with them (SPEC 2h, 2i) are what catch it.
"""

from __future__ import annotations

import pytest

from conformance import check
from tests._broken import assert_rejected
from tests.implementations.broken_sinks import BROKEN, OPERATIONS, SINKS, VARIANTS

# variant -> the checks (row measures of its operation) of which at least one must fail
EXPECTED: dict[str, set[str]] = {
    "sink_carries_first_value": {"values"},
    "sink_per_tile": {"values"},
    "sink_per_device": {"values"},
    "alibi_signed_distance": {"values"},
    "alibi_ignores_q_offset": {"values"},
}


def test_every_broken_sink_names_the_check_that_catches_it():
    assert set(EXPECTED) == set(BROKEN) == set(VARIANTS) == set(OPERATIONS)
    for name, variant in VARIANTS.items():
        caught_by = type(variant).__doc__.split("Caught by:")[1]
        assert all(check_name in caught_by for check_name in EXPECTED[name]), name


def test_correct_sinks_and_alibi_pass_their_operations():
    report = check(SINKS, operations=sorted(set(OPERATIONS.values())), measures=["values"])
    assert report.passed, "\n\n".join(row.failure for row in report.rows if row.failure)
    values = {(row.operation, row.dtype) for row in report.rows if row.check == "values" and row.examples > 0}
    assert {("sdpa", "float64"), ("flash", "float64"), ("ring", "float64")} <= values


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_sink_or_alibi_is_rejected(name: str):
    module, operation = BROKEN[name], OPERATIONS[name]
    assert_rejected(name, module, operation, EXPECTED[name])
