"""The suite's linear operation, seen by the author of a linear attention: it accepts a correct implementation
written apart from attention_np.linear (its forward forms, its recurrent step and a hand-derived backward pass)
and rejects each realistic bug of `implementations/broken_linear.py` by the check its docstring names, with a
failure that names the module and carries a snippet.
"""

from __future__ import annotations

import pytest

from conformance import check
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
    for name, cls in VARIANTS.items():
        caught_by = cls.__doc__.split("Caught by:")[1]
        assert all(check_name in caught_by for check_name in EXPECTED[name]), name


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
    report = check(module, operations=("linear",), shrink=False, measures=sorted(EXPECTED[name]))
    caught = [row for row in report.rows if not row.passed and row.check in EXPECTED[name]]
    assert caught, f"{name} failed {sorted({row.check for row in report.rows if not row.passed})}"
    head, _, snippet = caught[0].failure.partition("reproduce:\n")
    assert head.startswith(f"{module.__name__} linear ") and f" {caught[0].dtype}: " in head, head
    assert "case: " in head and f"import {module.__name__}\n" in snippet
