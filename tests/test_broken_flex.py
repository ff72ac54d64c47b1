"""The suite's flex operation, seen by the author of a programmable attention: it accepts the third-party dense
flex_attention and a tiled reading of its block masks, and rejects each realistic bug of
`implementations/broken_flex.py` by the check its docstring names, with a failure that names the module and
carries a snippet.
"""

from __future__ import annotations

import pytest

from conformance import check
from tests._broken import assert_docstrings_name_their_checks, assert_rejected
from tests.implementations.broken_flex import BROKEN, FLEX, TILED, VARIANTS

# variant -> the checks (row measures of the flex operation) of which at least one must fail
EXPECTED: dict[str, tuple[str, set[str]]] = {
    "indices_swapped": ("flex", {"values"}),
    "partial_tile_taken_as_full": ("flex", {"values"}),
    "first_row_block_mask": ("flex", {"values"}),
    "score_mod_after_the_mask": ("flex", {"values"}),
    "score_mod_on_unscaled_scores": ("flex", {"values"}),
    "alibi_sign_flipped": ("flex", {"values"}),
    "score_mod_parameters_forgotten": ("flex", {"gradients"}),
}


def test_every_broken_flex_attention_names_the_check_that_catches_it():
    assert set(EXPECTED) == set(BROKEN) == set(VARIANTS)
    assert_docstrings_name_their_checks({name: checks for name, (_, checks) in EXPECTED.items()}, VARIANTS)


@pytest.mark.parametrize("module", [FLEX, TILED], ids=["dense", "tiled"])
def test_correct_flex_attention_passes_the_flex_rows(module):
    report = check(module, operations=("flex",))
    assert report.passed, "\n\n".join(row.failure for row in report.rows if row.failure)
    flex = {(row.check, row.dtype): row for row in report.rows if row.operation == "flex"}
    assert {("values", "float32"), ("values", "float64"), ("lse", "float64"), ("values", "float16"),
            ("gradients", "float64"), ("masked_rows", "float64"), ("errors", "-"),
            ("edge_cases", "float64")} <= set(flex)
    assert all(row.examples > 0 and not row.skipped for row in flex.values())


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_flex_attention_is_rejected(name: str):
    module, (operation, checks) = BROKEN[name], EXPECTED[name]
    assert_rejected(name, module, operation, checks, contract=False)
