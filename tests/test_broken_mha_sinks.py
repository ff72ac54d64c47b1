"""The suite's mha operation, seen by the author of a MultiHeadAttention with learned sinks and ALiBi (SPEC 2h, 2i and
section 3): it accepts attention_np's module, and rejects each realistic bug of `implementations/broken_mha_sinks.py`
by the check its docstring names, with a failure that names the module and carries a snippet. Each bug is right
without sinks or ALiBi: the mha cases that draw sinks=True and position="alibi" (and the pinned example of both on
three heads) are what catch it.
"""

from __future__ import annotations

import pytest

from conformance import check
from tests._broken import assert_docstrings_name_their_checks, assert_rejected
from tests.implementations.broken_mha_sinks import BROKEN, MHA_SINKS, VARIANTS

# variant -> the checks (row measures of the mha operation) of which at least one must fail
EXPECTED: dict[str, set[str]] = {
    "sinks_reversed": {"values"},
    "alibi_next_power_of_two": {"values"},
}


def test_every_broken_mha_names_the_check_that_catches_it():
    assert set(EXPECTED) == set(BROKEN) == set(VARIANTS)
    assert_docstrings_name_their_checks(EXPECTED, VARIANTS)


def test_correct_sinks_and_alibi_pass_the_mha_rows():
    report = check(MHA_SINKS, operations=("mha",), measures=["values"])
    assert report.passed, "\n\n".join(row.failure for row in report.rows if row.failure)
    values = {row.dtype for row in report.rows if row.check == "values" and row.examples > 0}
    assert {"float32", "float64"} <= values


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_mha_sinks_or_alibi_is_rejected(name: str):
    module = BROKEN[name]
    assert_rejected(name, module, "mha", EXPECTED[name])
