"""The suite's linear and mha operations, seen by the author of linear attention's update rules (SPEC 2e, ONNX's
LinearAttention): they accept attention_np's rules and reject each realistic bug of
`implementations/broken_linear_rules.py` by the check its docstring names, with a failure that names the module and
carries a snippet. Each bug is right under the rule "linear" and on bidirectional heads: the update rules, decay and
beta drawn in linear cases, and is_causal drawn for the mha operation's linear heads, are what catch it.
"""

from __future__ import annotations

import pytest

from conformance import check
from tests._broken import assert_rejected
from tests.implementations.broken_linear_rules import BROKEN, RULES, VARIANTS

# variant -> the checks (row measures of its operation) of which at least one must fail
EXPECTED: dict[str, set[str]] = {
    "decay_after_the_update": {"steps", "values"},
    "beta_on_the_key": {"steps", "values"},
    "chunks_without_the_ut_transform": {"values"},
    "chunk_state_not_decayed": {"values"},
    "causal_flag_ignored": {"values"},
}


def test_every_broken_update_rule_names_the_check_that_catches_it():
    assert set(EXPECTED) == set(BROKEN) == set(VARIANTS)
    for name, variant in VARIANTS.items():
        caught_by = variant.bug.__doc__.split("Caught by:")[1]
        assert all(check_name in caught_by for check_name in EXPECTED[name]), name


@pytest.mark.slow
def test_the_update_rules_pass_the_linear_rows():
    report = check(RULES, operations=("linear",), measures=("values", "steps", "gradients", "errors"))
    assert report.passed, "\n\n".join(row.failure for row in report.rows if row.failure)
    rows = {(row.check, row.dtype) for row in report.rows if row.operation == "linear" and not row.skipped}
    assert {("values", "float64"), ("steps", "float64"), ("gradients", "float64"), ("errors", "-")} <= rows


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_update_rule_is_rejected(name: str):
    module, operation = BROKEN[name], VARIANTS[name].operation
    assert_rejected(name, module, operation, EXPECTED[name])
