"""The suite's flash operation, seen by the author of a tiled kernel: it accepts a correct online-softmax kernel
(skipping, with the reason, what the kernel does not do) and rejects each realistic bug of
`implementations/broken_tiled.py` by the check its docstring names, with a failure that names the module and
carries a snippet.
"""

from __future__ import annotations

import pytest

from conformance import check
from tests._broken import assert_docstrings_name_their_checks, assert_rejected
from tests.implementations.broken_tiled import BROKEN, KERNEL, VARIANTS

# variant -> the checks (row measures of the flash operation) of which at least one must fail
EXPECTED: dict[str, set[str]] = {
    "not_rescaled": {"values", "lse"},
    "last_partial_tile_dropped": {"values", "lse"},
    "partly_hidden_tile_skipped": {"values"},
    "lse_without_the_maximum": {"lse"},
    "backward_unnormalised_weights": {"gradients"},
    "row_term_from_the_tile": {"gradients"},
}


def test_every_broken_tiled_kernel_names_the_check_that_catches_it():
    assert set(EXPECTED) == set(BROKEN) == set(VARIANTS)
    assert len(BROKEN) >= 5
    assert_docstrings_name_their_checks(EXPECTED, VARIANTS)


def test_correct_tiled_kernel_passes_the_flash_rows():
    report = check(KERNEL, operations=("flash",))
    assert report.passed, "\n\n".join(row.failure for row in report.rows if row.failure)
    flash = {(row.check, row.dtype): row for row in report.rows if row.operation == "flash"}
    assert {("values", "float64"), ("lse", "float64"), ("values", "float16"), ("gradients", "float64"),
            ("masked_rows", "float64"), ("errors", "-"), ("edge_cases", "float64")} <= set(flash)
    assert all(row.examples > 0 and not row.skipped for row in flash.values())


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_tiled_kernel_is_rejected(name: str):
    module = BROKEN[name]
    assert_rejected(name, module, "flash", EXPECTED[name])
