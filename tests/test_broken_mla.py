"""The suite's mla operation, seen by the author of a DeepSeek port: it accepts attention_np's multi-head latent
attention, and rejects each realistic bug of `implementations/broken_mla.py` by the check its docstring names, with
a failure that names the module and carries a snippet. The bugs of the absorbed form and of the cache show only in
decoding: the mla cases that decode through the latent cache, in either form, are what catch them.
"""

from __future__ import annotations

import pytest

from conformance import check
from tests._broken import assert_docstrings_name_their_checks, assert_rejected
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
    assert_docstrings_name_their_checks(EXPECTED, VARIANTS)


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
    assert_rejected(name, module, "mla", EXPECTED[name])
