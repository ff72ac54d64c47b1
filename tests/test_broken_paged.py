"""The suite's decode operation, seen by the author of a paged cache: it accepts attention_np's decoding through pages
with a length per sequence, and rejects each realistic bug of `implementations/broken_paged.py` by the check its
docstring names, with a failure that names the module and carries a snippet. Each bug is right on the contiguous
cache where every sequence takes every row: the ragged chunks and paged caches of the decode cases are what catch it.
"""

from __future__ import annotations

import pytest

from conformance import check
from tests.implementations.broken_paged import BROKEN, PAGED, VARIANTS

# variant -> the checks (row measures of the decode operation) of which at least one must fail
EXPECTED: dict[str, set[str]] = {
    "page_size_off_by_one": {"values"},
    "padding_slot_read": {"values"},
    "rope_from_sequence_zero": {"values"},
}


def test_every_broken_paged_cache_names_the_check_that_catches_it():
    assert set(EXPECTED) == set(BROKEN) == set(VARIANTS)
    for name, cls in VARIANTS.items():
        caught_by = cls.__doc__.split("Caught by:")[1]
        assert all(check_name in caught_by for check_name in EXPECTED[name]), name


def test_correct_paged_cache_passes_the_decode_rows():
    report = check(PAGED, operations=("decode",))
    assert report.passed, "\n\n".join(row.failure for row in report.rows if row.failure)
    decode = {(row.check, row.dtype): row for row in report.rows if row.operation == "decode"}
    assert {("values", "float32"), ("values", "float64"), ("errors", "-"), ("edge_cases", "float64")} <= set(decode)
    assert all(row.examples > 0 and not row.skipped for row in decode.values())


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_paged_cache_is_rejected(name: str):
    module = BROKEN[name]
    report = check(module, operations=("decode",), shrink=False, measures=sorted(EXPECTED[name]))
    caught = [row for row in report.rows if not row.passed and row.check in EXPECTED[name]]
    assert caught, f"{name} failed {sorted({row.check for row in report.rows if not row.passed})}"
    head, _, snippet = caught[0].failure.partition("reproduce:\n")
    assert head.startswith(f"{module.__name__} decode ") and f" {caught[0].dtype}: " in head, head
    assert "case: " in head and f"import {module.__name__}\n" in snippet
