"""The suite's ring operation, seen by the author of a ring: it accepts a correct ring written apart from
attention_np.distributed and rejects each realistic bug of `implementations/broken_ring.py` by the check its
docstring names, with a failure that names the module and carries a snippet.
"""

from __future__ import annotations

import pytest

from conformance import check
from tests._broken import assert_docstrings_name_their_checks, assert_rejected
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
    assert_docstrings_name_their_checks(EXPECTED, VARIANTS)


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
    assert_rejected(name, module, "ring", EXPECTED[name])
