"""The suite's ring operation, seen by the author of a ring: it accepts a correct ring written apart from
attention_np.distributed and rejects each realistic bug of `implementations/broken_ring.py` by the check its
docstring names, with a failure that names the module and carries a snippet.
"""

from __future__ import annotations

import pytest

from conformance import check
from tests.implementations.broken_ring import BROKEN, RING, VARIANTS

# variant -> the checks (row measures of the ring operation) of which at least one must fail
EXPECTED: dict[str, set[str]] = {
    "local_positions": {"values", "lse"},
    "one_step_short": {"values", "lse"},
    "merged_without_rescaling": {"values"},
    "lse_of_the_larger_part": {"lse"},
    "zig_zag_not_undone": {"values"},
    "accumulators_one_hop_short": {"gradients"},
    "weights_from_the_partial_lse": {"gradients"},
}


def test_every_broken_ring_names_the_check_that_catches_it():
    assert set(EXPECTED) == set(BROKEN) == set(VARIANTS)
    for name, cls in VARIANTS.items():
        caught_by = cls.__doc__.split("Caught by:")[1]
        assert all(check_name in caught_by for check_name in EXPECTED[name]), name


def test_correct_ring_passes_the_ring_rows():
    report = check(RING, operations=("ring",))
    assert report.passed, "\n\n".join(row.failure for row in report.rows if row.failure)
    ring = {(row.check, row.dtype): row for row in report.rows if row.operation == "ring"}
    assert {("values", "float64"), ("lse", "float64"), ("values", "float16"), ("gradients", "float64"),
            ("masked_rows", "float64"), ("errors", "-"), ("edge_cases", "float64")} <= set(ring)
    assert all(row.examples > 0 and not row.skipped for row in ring.values())


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_ring_is_rejected(name: str):
    module = BROKEN[name]
    report = check(module, operations=("ring",), shrink=False, measures=sorted(EXPECTED[name]))
    caught = [row for row in report.rows if not row.passed and row.check in EXPECTED[name]]
    assert caught, f"{name} failed {sorted({row.check for row in report.rows if not row.passed})}"
    head, _, snippet = caught[0].failure.partition("reproduce:\n")
    assert head.startswith(f"{module.__name__} ring ") and f" {caught[0].dtype}: " in head, head
    assert "case: " in head and f"import {module.__name__}\n" in snippet
