"""The suite's gradient checks reject realistic bugs in a hand-derived backward pass."""

from __future__ import annotations

import pytest

import attention_np
from conformance import check
from tests.implementations.broken_gradients import BROKEN_GRADIENTS

pytestmark = pytest.mark.slow  # the whole gradient suite on every mutant

# mutant -> the operations whose backward pass the bug reaches
REACHES = {
    "softmax_jvp_without_rowsum": ["sdpa"],
    "dk_not_scaled": ["sdpa"],
    "dbias_not_reduced": ["sdpa"],
    "gqa_group_gradient_averaged": ["sdpa"],
    "layer_norm_without_variance_term": ["block"],
    "linear_weight_gradient_transposed": ["mha"],
    "gelu_derivative_cdf_only": ["block"],
    "self_attention_gradients_not_summed": ["block"],
    "pre_ln_residual_dropped": ["block"],
    "silu_derivative_sigmoid_only": ["block"],
    "rms_norm_without_mean_square_term": ["block"],
    "rope_gradient_turned_forward": ["mha"],
}


def test_every_mutant_says_what_it_reaches():
    assert set(REACHES) == set(BROKEN_GRADIENTS) and len(REACHES) >= 5


def test_the_unmutated_backward_passes():
    report = check(attention_np, operations=["sdpa", "mha", "block"])
    assert report.passed and any(row.check == "gradients" for row in report.rows)


@pytest.mark.parametrize("name", sorted(BROKEN_GRADIENTS))
def test_broken_backward_pass_is_rejected_by_the_gradient_check(name: str):
    report = check(BROKEN_GRADIENTS[name], operations=REACHES[name], shrink=False)
    failed = {row.check for row in report.rows if not row.passed}
    assert failed == {"gradients"}, f"{name}: failed {sorted(failed)}; the forward checks must pass"
