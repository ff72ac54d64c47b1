"""The suite's mla operation, seen by the author of a DeepSeek port: it accepts attention_np's multi-head latent
attention, and rejects each realistic bug of `implementations/broken_mla.py` by the check its docstring names, with
a failure that names the module and carries a snippet. The bugs of the absorbed form and of the cache show only in
decoding: the mla cases that decode through the latent cache, in either form, are what catch them.
"""

from __future__ import annotations

import pytest

from conformance import check
from tests.implementations.broken_mla import BROKEN, MLA, VARIANTS

# variant -> the checks (row measures of the mla operation) of which at least one must fail
EXPECTED: dict[str, set[str]] = {
    "rope_on_the_latent": {"values"},
    "absorbed_scale_of_the_latent_width": {"values"},
    "cache_without_the_norm": {"values"},
    "uv_on_the_wrong_side": {"values"},
    "rope_key_not_shared": {"values"},
}


def test_every_broken_mla_names_the_check_that_catches_it():
    assert set(EXPECTED) == set(BROKEN) == set(VARIANTS)
    for name, cls in VARIANTS.items():
        caught_by = cls.__doc__.split("Caught by:")[1]
        assert all(check_name in caught_by for check_name in EXPECTED[name]), name


def test_correct_mla_passes_the_mla_rows():
    report = check(MLA, operations=("mla",))
    assert report.passed, "\n\n".join(row.failure for row in report.rows if row.failure)
    rows = {(row.check, row.dtype): row for row in report.rows if row.operation == "mla"}
    assert {("values", "float32"), ("values", "float64"), ("gradients", "float64"), ("errors", "-"),
            ("edge_cases", "float64")} <= set(rows)
    assert all(row.examples > 0 and not row.skipped for row in rows.values())


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_mla_is_rejected(name: str):
    module = BROKEN[name]
    report = check(module, operations=("mla",), shrink=False, measures=sorted(EXPECTED[name]))
    caught = [row for row in report.rows if not row.passed and row.check in EXPECTED[name]]
    assert caught, f"{name} failed {sorted({row.check for row in report.rows if not row.passed})}"
    head, _, snippet = caught[0].failure.partition("reproduce:\n")
    assert head.startswith(f"{module.__name__} mla ") and f" {caught[0].dtype}: " in head, head
    assert "case: " in head and f"import {module.__name__}\n" in snippet
