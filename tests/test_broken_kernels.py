"""The suite's sdpa operation, seen by a kernel author: it accepts a correct (B, L, H, E) NumPy kernel wrapped by
`conformance.adapters` (skipping, with the reason, what the kernel does not do) and rejects each realistic bug of
`implementations/broken_kernels.py` by the check its docstring names, with a failure that names the module and
the check and carries a snippet that reproduces it.
"""

from __future__ import annotations

import contextlib
import sys

import pytest

from conformance import check
from conformance.contract.tolerances import TOLERANCES
from tests._broken import assert_docstrings_name_their_checks
from tests.implementations import broken_kernels
from tests.implementations.broken_kernels import BROKEN, KERNEL, VARIANTS

pytestmark = pytest.mark.slow  # the suite's sdpa operation, on the kernel and every variant

# variant -> the checks (row measures of the sdpa operation) of which at least one must fail
EXPECTED: dict[str, set[str]] = {
    "output_in_bhle_layout": {"call", "values"},  # call where L != H (the output cannot be put back), else values
    "output_reshaped_not_transposed": {"values"},
    "mask_reshaped_not_transposed": {"values"},
    "softmax_over_the_sequence_axis": {"values"},  # no weights returned: weights_rows is skipped
    "scale_from_d_model": {"values"},
    "causal_bottom_right": {"values", "causal_prefix"},  # differs from top-left only when L != S
    "causal_replaces_mask": {"values"},
    "masked_row_nan": {"values", "single_key"},
    "softmax_in_input_precision": {"values"},  # float16 only
}

# the rows the kernel cannot run: the features its signature does not name, and the vjp NumPy has no autodiff for
SKIPPED = {"weights_rows": "lacks weights", "dropout": "lacks dropout", "dropout_independence": "lacks dropout",
           "gradients": "no scaled_dot_product_attention_vjp",
           "gradients_low_precision": "no scaled_dot_product_attention_vjp"}


def test_every_broken_kernel_names_the_check_that_catches_it():
    assert set(EXPECTED) == set(BROKEN) == set(VARIANTS)
    assert len(BROKEN) >= 5
    assert_docstrings_name_their_checks(EXPECTED, VARIANTS)
    assert len({module.__name__ for module in (KERNEL, *BROKEN.values())}) == len(BROKEN) + 1


def test_kernel_declares_what_its_signature_does_not_name():
    assert set(KERNEL.CONFORMANCE.lacks) == {"bias", "q_offset", "window", "key_lengths", "softcap", "enable_gqa",
                                             "mods", "score_mod", "dropout", "weights", "sinks", "alibi_slopes"}


def test_correct_kernel_passes_the_sdpa_rows():
    report = check(KERNEL, operations=("sdpa",))  # the fast profile, as the command line
    failures = "\n\n".join(row.failure for row in report.rows if row.failure)
    assert report.passed, failures
    sdpa = [row for row in report.rows if row.operation == "sdpa"]
    skipped = {row.check: row.skipped for row in sdpa if row.skipped}
    assert set(skipped) == set(SKIPPED)
    for check_name, why in skipped.items():
        assert why.startswith(SKIPPED[check_name]), why
    ran = {(row.check, row.dtype) for row in sdpa if not row.skipped and row.examples > 0}
    assert {("values", dtype) for dtype in ("float16", "float32", "float64")} <= ran
    assert {"fast_path", "permutation", "causal_prefix", "single_key", "errors", "edge_cases"} <= {c for c, _ in ran}


@contextlib.contextmanager
def _importable(module: object):
    """The variant's module object importable by its dotted name, as the failure's snippet imports it."""
    parent, leaf = module.__name__.rsplit(".", 1)
    assert parent == broken_kernels.__name__
    saved = sys.modules.get(module.__name__)
    sys.modules[module.__name__] = module
    setattr(broken_kernels, leaf, module)
    try:
        yield
    finally:
        delattr(broken_kernels, leaf)
        if saved is None:
            del sys.modules[module.__name__]
        else:
            sys.modules[module.__name__] = saved


def _rerun(snippet: str, module: object) -> dict:
    """What the failure's reproduce snippet prints: the check's measures on the failing case."""
    printed: list = []
    with _importable(module):
        exec(snippet, {"print": printed.append})  # the snippet's own code: imports, the case, the check
    (measures,) = printed
    return measures


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # inf - inf is the point of masked_row_nan
@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_kernel_is_rejected_with_a_useful_failure(name: str):
    module = BROKEN[name]
    report = check(module, operations=("sdpa",), shrink=False, measures=sorted(EXPECTED[name]))  # the groups
    # that report the expected checks, in the fast profile
    failed = [row for row in report.rows if not row.passed and row.operation == "sdpa"]
    caught = [row for row in failed if row.check in EXPECTED[name]]
    assert not report.passed, f"{name} passed the suite"
    assert caught, f"{name} failed {sorted({row.check for row in failed})}, none of the expected {EXPECTED[name]}"
    for row in caught:
        _assert_useful(row, module)


def _assert_useful(row: object, module: object) -> None:
    """The row's failure names the module, the operation, the dtype and the check, and its snippet reproduces it."""
    head, _, snippet = row.failure.partition("reproduce:\n")
    assert head.startswith(f"{module.__name__} sdpa "), head
    assert f" {row.dtype}: " in head and "case: " in head
    assert ("raised " if row.check == "call" else f"{row.check} ") in head  # the check that failed, and how
    assert f"import {module.__name__}\n" in snippet
    if row.check == "call":  # the snippet raises what the module raised
        with pytest.raises(Exception) as raised:
            _rerun(snippet, module)
        assert f"raised {type(raised.value).__name__}: {raised.value}" in head
        return
    measure = _rerun(snippet, module)[row.check]  # the snippet shows the same failure
    assert not measure.error <= max(TOLERANCES[row.dtype][row.check], measure.tolerance), measure
