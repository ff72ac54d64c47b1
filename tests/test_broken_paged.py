"""The suite's decode operation, seen by the author of a paged cache: it accepts attention_np's decoding through pages
with a length per sequence, and rejects each realistic bug of `implementations/broken_paged.py` by the check its
docstring names, with a failure that names the module and carries a snippet. Each bug is right on the contiguous
cache where every sequence takes every row: the ragged chunks and paged caches of the decode cases are what catch it.
"""

from __future__ import annotations

import pytest

from conformance import check
from tests._broken import assert_docstrings_name_their_checks, assert_rejected
from tests.implementations.broken_paged import BROKEN, PAGED, VARIANTS

# variant -> the checks (row measures of the decode operation) of which at least one must fail
EXPECTED: dict[str, set[str]] = {
    "page_size_off_by_one": {"values"},
    "padding_slot_read": {"values"},
    "rope_from_sequence_zero": {"values"},
}


def test_every_broken_paged_cache_names_the_check_that_catches_it():
    assert set(EXPECTED) == set(BROKEN) == set(VARIANTS)
    assert_docstrings_name_their_checks(EXPECTED, VARIANTS)


def test_correct_paged_cache_passes_the_decode_rows():
    report = check(PAGED, operations=("decode",))
    assert report.passed, "\n\n".join(row.failure for row in report.rows if row.failure)
    decode = {(row.check, row.dtype): row for row in report.rows if row.operation == "decode"}
    assert {("values", "float32"), ("values", "float64"), ("errors", "-"), ("edge_cases", "float64")} <= set(decode)
    assert all(row.examples > 0 and not row.skipped for row in decode.values())


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_paged_cache_is_rejected(name: str):
    module = BROKEN[name]
    assert_rejected(name, module, "decode", EXPECTED[name])
