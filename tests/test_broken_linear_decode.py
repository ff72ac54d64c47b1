"""The suite's decode operation, seen by the author of a linear attention decoder (SPEC 3a's LinearCache): it
accepts attention_np's decoding through the recurrent state, and rejects each realistic bug of
`implementations/broken_linear_decode.py` by the check its docstring names, with a failure that names the module and
carries a snippet. Each bug is right on a sequence decoded in one chunk: the decode operation's linear cases, in
chunks of varied sizes, are what catch it.
"""

from __future__ import annotations

import numpy as np
import pytest

from conformance import check
from conformance.contract import operations
from conformance.contract.cases import decode_case
from tests._broken import assert_docstrings_name_their_checks, assert_rejected
from tests._compare import REORDERED, assert_close, relative_error
from tests.implementations.broken_linear_decode import BROKEN, LINEAR, VARIANTS

# variant -> the checks (row measures of the decode operation) of which at least one must fail
EXPECTED: dict[str, set[str]] = {
    "state_forgotten": {"values"},
    "normaliser_not_carried": {"values"},
}


def test_every_broken_linear_decoder_names_the_check_that_catches_it():
    assert set(EXPECTED) == set(BROKEN) == set(VARIANTS)
    assert_docstrings_name_their_checks(EXPECTED, VARIANTS)


def test_correct_linear_decoder_passes_the_decode_rows():
    report = check(LINEAR, operations=("decode",))
    assert report.passed, "\n\n".join(row.failure for row in report.rows if row.failure)
    decode = {(row.check, row.dtype): row for row in report.rows if row.operation == "decode"}
    assert {("values", "float32"), ("values", "float64"), ("errors", "-"), ("edge_cases", "float64")} <= set(decode)
    assert all(row.examples > 0 and not row.skipped for row in decode.values())


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_linear_decoder_is_rejected(name: str):
    module = BROKEN[name]
    assert_rejected(name, module, "decode", EXPECTED[name])


@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("name", sorted(BROKEN))
def test_each_bug_is_right_in_one_chunk_and_wrong_in_several(name: str, cross: bool):
    # one chunk reads the zeros of init_cache's state, which the bugs forget harmlessly; a prefill and steps read
    # the state of the chunks before, which they do not carry
    case = decode_case((2,), (6,), capacity=6, D=4, H=2, num_kv_heads=1, dropout=0.0, rope_theta=10.0,
                       attention="linear")
    case = case._replace(x_kv=case.x[..., ::-1, :].copy() if cross else None)
    operation = operations.operation_of(case)
    expected, _ = operation.oracle(case, "float64", True)
    for chunks in ((6,), (3, 1, 2)):
        arrays, options = operations.arrays_and_options(case._replace(chunks=chunks))
        (out, weights), (broken, _) = (
            operation.pair(operation.call(module, arrays, None, training=False, need_weights=True, **options))
            for module in (LINEAR, BROKEN[name]))
        assert weights is None  # linear heads form none
        assert_close(out, expected, REORDERED, "out")
        if chunks == (6,):
            assert_close(broken, expected, REORDERED, "out")
        else:
            assert relative_error(broken, expected) > 1e-3
            assert np.allclose(broken[..., :3, :], expected[..., :3, :])  # the first chunk right
