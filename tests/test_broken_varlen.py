"""The suite's varlen operation, seen by the author of packed attention: it accepts a correct implementation written
apart from attention_np.varlen (a loop over the sequences, each one's sdpa with its own q_offset) and rejects each
realistic bug of `implementations/broken_varlen.py` by the check its docstring names, with a failure that names the
module and carries a snippet.
"""

from __future__ import annotations

import pytest

from conformance import check
from tests._broken import assert_docstrings_name_their_checks, assert_rejected
from tests.implementations.broken_varlen import BROKEN, VARIANTS, VARLEN

# variant -> the checks (row measures of the varlen operation) of which at least one must fail
EXPECTED: dict[str, set[str]] = {
    "last_sequence_dropped": {"values"},
    "causal_top_left": {"values"},
    "keys_one_too_far": {"values"},
}


def test_every_broken_varlen_attention_names_the_check_that_catches_it():
    assert set(EXPECTED) == set(BROKEN) == set(VARIANTS)
    assert_docstrings_name_their_checks(EXPECTED, VARIANTS)


def test_correct_varlen_attention_passes_the_varlen_rows():
    report = check(VARLEN, operations=("varlen",))
    assert report.passed, "\n\n".join(row.failure for row in report.rows if row.failure)
    varlen = {(row.check, row.dtype): row for row in report.rows if row.operation == "varlen"}
    assert {("values", "float32"), ("values", "float64"), ("values", "float16"), ("gradients", "float64"),
            ("masked_rows", "float64"), ("errors", "-"), ("edge_cases", "float64")} <= set(varlen)
    assert all(row.examples > 0 and not row.skipped for row in varlen.values())


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_varlen_attention_is_rejected(name: str):
    module = BROKEN[name]
    assert_rejected(name, module, "varlen", EXPECTED[name])
