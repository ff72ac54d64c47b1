"""The suite's flash operation, seen by the author of a tiled kernel: it accepts a correct online-softmax kernel
(skipping, with the reason, what the kernel does not do) and rejects each realistic bug of
`implementations/broken_tiled.py` by the check its docstring names, with a failure that names the module and
carries a snippet.
"""

from __future__ import annotations

import pytest

from conformance import check
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
    for name, cls in VARIANTS.items():
        caught_by = cls.__doc__.split("Caught by:")[1]
        assert all(check_name in caught_by for check_name in EXPECTED[name]), name


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
    report = check(module, operations=("flash",), shrink=False, measures=sorted(EXPECTED[name]))
    caught = [row for row in report.rows if not row.passed and row.check in EXPECTED[name]]
    assert caught, f"{name} failed {sorted({row.check for row in report.rows if not row.passed})}"
    head, _, snippet = caught[0].failure.partition("reproduce:\n")
    assert head.startswith(f"{module.__name__} flash ") and f" {caught[0].dtype}: " in head, head
    assert "case: " in head and f"import {module.__name__}\n" in snippet
