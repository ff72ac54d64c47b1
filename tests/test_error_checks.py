"""The suite's error checks: every backend raises the spec's exception for each mistake, and the checks
reject a module that raises the wrong type, says too little, or silently accepts a bad mask."""

from __future__ import annotations

import types
from collections.abc import Callable
from types import ModuleType

import numpy as np
import pytest

import attention_np
from conformance import check, docs
from conformance.contract import fixed_cases
from conformance.contract.operations import OPERATIONS, missing
from conformance.frameworks.registry import FRAMEWORKS
from conformance.run import fixed_checks, suite
from conformance.run.checks import Runner
from tests.conftest import skip_without_devices
from tests.implementations import einsum_attention

FEW = 2  # Hypothesis examples per group where a test needs only the table rows
ERRORS = [row for row in fixed_cases.ROWS if row.use == "error"]
_RUNNERS: dict[str, Runner] = {}


@pytest.mark.parametrize("row", ERRORS, ids=lambda row: f"{row.operation}-{row.name}")
def test_each_mistake_raises_the_spec_exception(backend: ModuleType, row: fixed_cases.Fixed):
    runner = _RUNNERS.setdefault(backend.__name__, Runner(backend))
    skip_without_devices(runner, row.operation)
    with runner.framework.pinned():
        result = fixed_checks.run_error(runner, row)
    assert result.skipped is None, result.skipped  # every built-in backend offers vjp
    assert result.passed, result.describe()


def test_the_third_party_implementation_raises_the_same_exceptions():
    runner = Runner(einsum_attention)
    offered = [name for name, operation in OPERATIONS.items() if not missing(einsum_attention, (operation.function,))]
    assert "sdpa" in offered and "flash" not in offered  # no tiled kernel: the suite skips that operation
    results = [result for operation in offered for result in fixed_checks.errors(runner, operation)]
    assert all(result.passed for result in results), "\n".join(r.describe() for r in results if not r.passed)
    skipped = {result.row.name for result in results if result.skipped}
    assert skipped == {"d_out_shape", "d_out_dtype",  # it offers no vjp: those cases do not apply
                       # nor a length per sequence, a paged cache nor a streaming cache (features cache_lengths,
                       # paged_cache and streaming_cache)
                       "new_lengths_negative", "new_lengths_past_the_chunk", "block_table_outside_the_pool",
                       "paged_sequence_past_its_pages", "streaming_past_capacity", "streaming_sink_tokens_negative",
                       "streaming_window_not_positive", "streaming_chunk_past_the_window", "streaming_with_a_mask",
                       # nor sinks nor ALiBi (its signature lacks them: features sinks and alibi_slopes)
                       "sinks_of_other_heads", "alibi_slopes_of_other_heads", "alibi_slopes_scalar",
                       "alibi_slopes_adds_an_axis",
                       # nor MultiHeadAttention's sinks=True nor position (features mha_sinks and position_alibi)
                       "sinks_with_linear_attention", "state_sinks_with_linear_attention", "state_sinks_of_other_heads",
                       "position_unknown", "alibi_with_rope_theta", "alibi_with_linear_attention",
                       "state_alibi_with_rope_theta"}


@pytest.mark.slow
def test_suite_reports_one_row_per_operation_for_each_kind_of_fixed_case():
    report = check(attention_np, max_examples=1)
    tables = {(row.operation, row.check): row for row in report.rows if row.check in ("errors", "edge_cases")}
    assert set(tables) == {(op, name) for op in OPERATIONS for name in ("errors", "edge_cases")}
    for (operation, name), row in tables.items():
        uses = {fixed.check: fixed.use for fixed in suite.FIXED_RUNS}  # the rows each table runs, by its record
        assert row.examples == len(fixed_cases.rows(operation, uses[name]))
        assert row.passed and row.worst == 0 and row.tolerance == 0
        assert row.dtype == ("-" if name == "errors" else "float64")
    # the README's table of checks (conformance/docs.py) reads these rows off the registries: NumPy's report has
    # every row that it predicts for NumPy, and no other ("call" and "deterministic" of every group, dtype "all", are
    # rows of failures only; the low-precision gradient groups measure "deterministic" in their dtypes)
    numpy = FRAMEWORKS["numpy"]
    predicted = {(operation, measure, dtype) for measure, operation, dtypes in docs.reported("fast") for dtype in dtypes
                 if dtype in ("-", *numpy.dtypes)
                 and all(needs(numpy) for name, needs in docs.FRAMEWORK_MEASURES.items() if name == measure)}
    assert {(row.operation, row.check, row.dtype) for row in report.rows} == predicted


def test_names_are_unique_within_each_operation():
    names = [(row.operation, row.name) for row in fixed_cases.ROWS]
    assert len(names) == len(set(names))


# --- modules the error checks must reject ---------------------------------------------------------------

def _sdpa_module(name: str, sdpa: Callable) -> ModuleType:
    """attention_np with scaled_dot_product_attention replaced by `sdpa` (the rest unchanged)."""
    module = types.ModuleType(name)
    for attribute in attention_np.__all__:
        setattr(module, attribute, getattr(attention_np, attribute))
    module.scaled_dot_product_attention = sdpa
    return module


def _value_errors_as_runtime_errors(q, k, v, mask=None, **options):
    try:
        return attention_np.scaled_dot_product_attention(q, k, v, mask, **options)
    except ValueError as error:
        raise RuntimeError(str(error)) from None


def _terse_messages(q, k, v, mask=None, **options):
    try:
        return attention_np.scaled_dot_product_attention(q, k, v, mask, **options)
    except ValueError:
        raise ValueError("invalid arguments") from None


def _fits(mask: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> bool:
    """Whether the mask broadcasts to (..., L, S) without adding axes (True where q, k, v are broken)."""
    try:
        scores = (*np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]), q.shape[-2], k.shape[-2])
    except (ValueError, IndexError):
        return True  # the real call reports q, k, v
    try:
        return np.broadcast_shapes(np.shape(mask), scores) == scores
    except ValueError:
        return False


def _drop_bad_masks(q, k, v, mask=None, **options):
    """A mask that does not fit is silently ignored: every key stays visible."""
    return attention_np.scaled_dot_product_attention(q, k, v, mask if _fits(mask, q, k, v) else None, **options)


def _drop_bad_masks_on_the_fast_path(q, k, v, mask=None, *, need_weights=True, **options):
    keep = need_weights or _fits(mask, q, k, v)
    return attention_np.scaled_dot_product_attention(q, k, v, mask if keep else None, need_weights=need_weights,
                                                     **options)


def _failing(module: ModuleType) -> dict[str, fixed_checks.Result]:
    return {result.row.name: result for result in fixed_checks.errors(Runner(module), "sdpa") if not result.passed}


@pytest.mark.slow
def test_wrong_exception_type_fails_the_errors_row():
    module = _sdpa_module("runtime_errors", _value_errors_as_runtime_errors)
    report = check(module, operations=["sdpa"], max_examples=FEW)
    failed = [row for row in report.rows if not row.passed]
    assert [row.check for row in failed] == ["errors"]  # every other check passes: only the type is wrong
    value_errors = {row.name for row in fixed_cases.rows("sdpa", "error")
                    if row.stage == "call" and row.error is ValueError}
    assert failed[0].worst == len(value_errors)
    lines = {line.split()[1].rstrip(":"): line for line in failed[0].failure.splitlines()[1:]}  # "  sdpa NAME: ..."
    for name in value_errors:
        assert "expected ValueError" in lines[name], lines.get(name)
    assert "got RuntimeError: q and k must have the same width E" in failed[0].failure


def test_terse_message_fails_though_the_type_is_right():
    failing = _failing(_sdpa_module("terse", _terse_messages))
    # the right type, but a message that names neither the argument nor the shapes
    assert failing and all(result.problems == ["ValueError: invalid arguments"] for result in failing.values())
    assert "mask_adds_a_batch_axis" in failing


@pytest.mark.slow
def test_silently_accepting_a_bad_mask_fails_the_errors_row():
    module = _sdpa_module("lenient_mask", _drop_bad_masks)
    report = check(module, operations=["sdpa"], max_examples=FEW)
    failed = [row for row in report.rows if not row.passed]
    assert [row.check for row in failed] == ["errors"]
    assert failed[0].worst == 2
    assert "sdpa mask_does_not_broadcast: expected ValueError mentioning 'mask'" in failed[0].failure
    assert "sdpa mask_adds_a_batch_axis: expected ValueError" in failed[0].failure
    assert "got no exception" in failed[0].failure


def test_a_check_skipped_on_the_fast_path_alone_is_caught():
    failing = _failing(_sdpa_module("lenient_fast_path", _drop_bad_masks_on_the_fast_path))
    assert set(failing) == {"mask_does_not_broadcast", "mask_adds_a_batch_axis"}
    assert all(result.problems == ["no exception (need_weights=False)"] for result in failing.values())
