"""The suite's sdpa and flash operations with mods, seen by the author of an attention with mask and score
functions: they accept the third-party dense sdpa with mods, its flash_attention and a tiled reading of a block mask,
and reject each realistic bug of `implementations/broken_mods.py` by the check its docstring names, with a failure
that names the module and carries a snippet.
"""

from __future__ import annotations

import pytest

from conformance import check
from tests._broken import assert_docstrings_name_their_checks, assert_rejected
from tests.implementations.broken_mods import BROKEN, MODS, TILED, VARIANTS

# variant -> the operation and the checks (row measures) of which at least one must fail
EXPECTED: dict[str, tuple[str, set[str]]] = {
    "indices_swapped": ("sdpa", {"values"}),
    "partial_tile_taken_as_full": ("flash", {"values"}),
    "score_mod_after_the_mask": ("sdpa", {"values"}),
    "score_mod_on_unscaled_scores": ("sdpa", {"values"}),
    "first_row_block_mask": ("flash", {"values"}),
    "alibi_sign_flipped": ("sdpa", {"values"}),
}


def test_every_broken_mods_attention_names_the_check_that_catches_it():
    assert set(EXPECTED) == set(BROKEN) == set(VARIANTS)
    assert_docstrings_name_their_checks({name: checks for name, (_, checks) in EXPECTED.items()}, VARIANTS)


@pytest.mark.slow
@pytest.mark.parametrize("module", [MODS, TILED], ids=["dense", "tiled"])
def test_correct_mods_pass_the_sdpa_and_flash_rows(module):
    report = check(module, operations=("sdpa", "flash"))
    assert report.passed, "\n\n".join(row.failure for row in report.rows if row.failure)
    ran = {(row.operation, row.check, row.dtype) for row in report.rows if row.examples > 0 and not row.skipped}
    assert {("sdpa", "values", "float64"), ("sdpa", "errors", "-"), ("flash", "values", "float64"),
            ("flash", "lse", "float32"), ("flash", "errors", "-"), ("flash", "edge_cases", "float64")} <= ran


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_mods_attention_is_rejected(name: str):
    module, (operation, checks) = BROKEN[name], EXPECTED[name]
    assert_rejected(name, module, operation, checks, contract=False)
