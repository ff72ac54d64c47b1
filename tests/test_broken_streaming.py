"""The suite's decode operation, seen by the author of a streaming cache (SPEC 3c): it accepts attention_np's
decoding through the sinks and a ring of the last window positions, and rejects each realistic bug of
`implementations/broken_streaming.py` by the check its docstring names, with a failure that names the module and
carries a snippet. Each bug is right until the ring turns: the streaming cases of the decode operation, which decode
past s + w positions, are what catch it.
"""

from __future__ import annotations

import pytest

from conformance import check
from conformance.contract import fixed_cases, operations
from conformance.contract.cases import Streaming, decode_case
from tests._broken import assert_docstrings_name_their_checks, assert_rejected
from tests._compare import REORDERED, assert_close, relative_error
from tests.implementations.broken_streaming import BROKEN, STREAMING, VARIANTS
from tests.test_streaming_cache import SINK, THETA, WINDOW, B, D, H, N, _reference

# variant -> the checks (row measures of the decode operation) of which at least one must fail
EXPECTED: dict[str, set[str]] = {
    "sinks_evicted": {"values"},
    "slot_order": {"fast_path"},  # its output, need_weights=False: RoPE at the places in the cache shows the order
}


def test_every_broken_streaming_cache_names_the_check_that_catches_it():
    assert set(EXPECTED) == set(BROKEN) == set(VARIANTS)
    assert_docstrings_name_their_checks(EXPECTED, VARIANTS)


def test_correct_streaming_cache_passes_the_decode_rows():
    report = check(STREAMING, operations=("decode",))
    assert report.passed, "\n\n".join(row.failure for row in report.rows if row.failure)
    decode = {(row.check, row.dtype): row for row in report.rows if row.operation == "decode"}
    assert {("values", "float32"), ("values", "float64"), ("errors", "-"), ("edge_cases", "float64")} <= set(decode)
    assert all(row.examples > 0 and not row.skipped for row in decode.values())


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_streaming_cache_is_rejected(name: str):
    module = BROKEN[name]
    assert_rejected(name, module, "decode", EXPECTED[name])


@pytest.mark.parametrize("rope_positions", ["original", "cache"])
def test_slot_order_changes_the_output_only_with_rope_at_the_places(rope_positions: str):
    # reading the ring in slot order permutes each query's keys; softmax attention sums over them, so with every key
    # turned at its own position (or no RoPE) the output is the same function, and only the weights' columns move;
    # with RoPE at the columns of the cache a key's turn follows its column, and the output changes
    case = next(row.build() for row in fixed_cases.rows("decode", "example")
                if row.name == "streaming_rope_at_places_in_the_cache")
    case = case._replace(streaming=case.streaming._replace(rope_positions=rope_positions))
    operation = operations.operation_of(case)
    arrays, options = operations.arrays_and_options(case)
    (out, weights), (out_slots, weights_slots) = (
        operation.pair(operation.call(module, arrays, None, training=False, need_weights=True, **options))
        for module in (STREAMING, BROKEN["slot_order"]))
    assert relative_error(weights_slots, weights) > 0.1  # the columns out of order either way
    if rope_positions == "original":
        assert_close(out_slots, out, REORDERED, "out")  # float64: the same sum in another order
    else:
        assert relative_error(out_slots, out) > 1e-2


@pytest.mark.parametrize("rope_positions", ["original", "cache", None])
def test_the_decode_oracle_of_a_streaming_case_equals_the_reference(rope_positions: str | None):
    # the suite's oracle (one pass with the streaming mask, its weights read into the cache's order; with RoPE at the
    # places, each query alone over the keys it sees) against test_streaming_cache's reference, written apart (one
    # query and one head at a time, the keys listed as each query sees them): MultiHeadAttention decoding x itself,
    # N = 10 (s + w) positions, the ring turned nine times
    case = decode_case((B,), (1,) * N, capacity=SINK + WINDOW, D=D, H=H, num_kv_heads=1, dropout=0.0,
                       rope_theta=None if rope_positions is None else THETA,
                       streaming=Streaming(SINK, WINDOW, rope_positions or "original"))
    case = case._replace(x_kv=case.x)  # MultiHeadAttention.extend(x, x, cache): the block's attention alone
    out, weights = operations.operation_of(case).oracle(case, "float64", True)
    state = {name.removeprefix("attn."): value for name, value in case.state.items() if name.startswith("attn.")}
    expected, expected_weights = _reference(state, case.x, kv_heads=1, rope=rope_positions)
    assert_close(out, expected, REORDERED, "out")
    assert_close(weights, expected_weights, REORDERED, "weights")  # (B, H, N, s + w), the cache's order
