"""The suite's own helpers: comparisons, tolerances, failure snippets and the framework adapters."""

from __future__ import annotations

import contextlib
import io
import math

import numpy as np
import pytest

import attention_np
from conformance import checks, strategies, suite
from conformance.frameworks import framework_of
from conformance.snippets import reproduce


def test_relative_error_is_max_abs_error_over_max_abs_reference():
    # |[1.0, 2.5] - [1.0, 2.0]| = [0, 0.5]; max |reference| = 2 -> 0.5 / 2 = 0.25
    assert checks.relative_error(np.array([1.0, 2.5]), np.array([1.0, 2.0])) == 0.25


def test_relative_error_counts_matching_nan_and_infinity_as_exact():
    reference = np.array([np.nan, np.inf, 1.0])
    assert checks.relative_error(reference.copy(), reference) == 0.0


@pytest.mark.parametrize(("actual", "expected"), [
    (np.array([np.nan, 1.0]), np.array([0.0, 1.0])),  # NaN where the reference has a number
    (np.array([0.0, 1.0]), np.array([np.nan, 1.0])),  # a number where the reference has NaN
    (np.zeros(3), np.zeros(2)),  # shapes differ
])
def test_relative_error_is_infinite_for_results_wrong_in_kind(actual, expected):
    assert checks.relative_error(actual, expected) == math.inf


def test_compare_names_wrong_shape_dtype_nan_and_missing():
    expected = np.zeros((2, 3))
    assert "shape (3, 2)" in checks.compare("out", np.zeros((3, 2)), expected, "float64").detail
    assert "dtype float32" in checks.compare("out", np.zeros((2, 3), np.float32), expected, "float64").detail
    assert "NaN" in checks.compare("out", np.full((2, 3), np.nan), expected, "float64").detail
    assert checks.compare("weights", None, expected, "float64").error == math.inf


def test_float32_tolerance_grows_with_the_oracles_own_float32_loss():
    # logits in the hundreds: softmax loses about |logit| x 6e-8 in float32, so the case's own
    # tolerance (ten times the oracle's loss) must be positive, and zero in float64
    rng = np.random.default_rng(0)
    case = strategies.SdpaCase(15 * rng.standard_normal((3, 4)), 15 * rng.standard_normal((5, 4)),
                               rng.standard_normal((5, 2)), None, None, False, None)
    runner = checks.Runner(attention_np)
    assert checks.against_oracle(runner, case, "float32")["values"].tolerance > 0
    assert checks.against_oracle(runner, case, "float64")["values"].tolerance == 0


def test_snippet_rebuilds_the_case_and_reruns_the_check():
    case = strategies.EDGE_CASES["sdpa"][0]
    code = reproduce("attention_np", "against_oracle", case, "float64")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(code, {})
    assert printed.getvalue() == f"{checks.against_oracle(checks.Runner(attention_np), case, 'float64')}\n"


def test_framework_is_read_off_the_arrays_a_module_makes():
    assert framework_of(attention_np).name == "numpy"
    torch = pytest.importorskip("torch")
    import attention_torch

    assert framework_of(attention_torch).name == "torch"
    assert isinstance(framework_of(attention_torch).rng(0), torch.Generator)


def test_a_module_that_raises_fails_with_the_exception_named():
    class Raising:
        __name__ = "raising"
        asarray, to_numpy = staticmethod(np.asarray), staticmethod(np.asarray)

        @staticmethod
        def scaled_dot_product_attention(*args, **kwargs):
            raise RuntimeError("not implemented")

    report = suite.check(Raising(), operations=["sdpa"], max_examples=2, shrink=False)
    assert not report.passed
    assert any("raised RuntimeError: not implemented" in (row.failure or "") for row in report.rows)


def test_a_nondeterministic_module_is_reported_not_raised():
    # correct only every other call: a failure that does not repeat on the same case
    calls = [0]

    class Flaky:
        __name__ = "flaky"
        asarray, to_numpy = staticmethod(np.asarray), staticmethod(np.asarray)

        @staticmethod
        def scaled_dot_product_attention(q, k, v, mask=None, **options):
            calls[0] += 1
            out, weights = attention_np.scaled_dot_product_attention(q, k, v, mask, **options)
            return (out + calls[0] % 2, weights)

    report = suite.check(Flaky(), operations=["sdpa"], max_examples=5)
    assert not report.passed
