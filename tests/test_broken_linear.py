"""The suite's linear operation, seen by the author of a linear attention: it accepts a correct implementation
written apart from attention_np.linear (its forward forms, its recurrent step and a hand-derived backward pass)
and rejects each realistic bug of `implementations/broken_linear.py` by the check its docstring names, with a
failure that names the module and carries a snippet.
"""

from __future__ import annotations

import pytest

from conformance import check
from tests._broken import assert_docstrings_name_their_checks, assert_rejected
from tests.implementations.broken_linear import BROKEN, LINEAR, VARIANTS

# variant -> the checks (row measures of the linear operation) of which at least one must fail
EXPECTED: dict[str, set[str]] = {
    "prefix_includes_the_next_position": {"values"},
    "normaliser_forgotten": {"values", "steps"},
    "chunk_state_includes_the_chunk": {"values"},
    "eps_in_the_numerator": {"values"},
    "sums_in_half_precision": {"values"},  # float16 only: L = S = 512 with q and k LARGE overflows the sums
    "step_reads_before_the_update": {"steps"},
    "step_updates_the_state_in_place": {"state_kept"},
    "backward_without_phi_prime": {"gradients"},
    "backward_ignores_key_lengths": {"gradients", "masked_rows"},
}


def test_every_broken_linear_attention_names_the_check_that_catches_it():
    assert set(EXPECTED) == set(BROKEN) == set(VARIANTS)
    assert len(BROKEN) >= 3
    assert_docstrings_name_their_checks(EXPECTED, VARIANTS)


def test_correct_linear_attention_passes_the_linear_rows():
    report = check(LINEAR, operations=("linear",))
    assert report.passed, "\n\n".join(row.failure for row in report.rows if row.failure)
    linear = {(row.check, row.dtype): row for row in report.rows if row.operation == "linear"}
    assert {("values", "float32"), ("values", "float64"), ("values", "float16"), ("gradients", "float64"),
            ("masked_rows", "float64"), ("steps", "float32"), ("steps", "float64"), ("state_kept", "float32"),
            ("state_kept", "float64"), ("errors", "-"),
            ("edge_cases", "float64")} <= set(linear)
    assert all(row.examples > 0 and not row.skipped for row in linear.values())


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_linear_attention_is_rejected(name: str):
    module = BROKEN[name]
    assert_rejected(name, module, "linear", EXPECTED[name])
