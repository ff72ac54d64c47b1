"""The suite's gradient checks reject realistic bugs in a hand-derived backward pass."""

from __future__ import annotations

import pytest

import attention_np
from conformance import check
from tests.implementations.broken_gradients import BROKEN_GRADIENTS, FLEX_MUTATIONS

pytestmark = pytest.mark.slow  # the suite's gradient check on every mutant

# mutant -> the operations whose backward pass the bug reaches
REACHES = {
    "softmax_jvp_without_rowsum": ["sdpa"],
    "dk_not_scaled": ["sdpa"],
    "dbias_not_reduced": ["sdpa"],
    "gqa_group_gradient_averaged": ["sdpa"],
    "softcap_derivative_forgotten": ["sdpa"],
    "layer_norm_without_variance_term": ["block"],
    "linear_weight_gradient_transposed": ["mha"],
    "gelu_derivative_cdf_only": ["block"],
    "self_attention_gradients_not_summed": ["block"],
    "pre_ln_residual_dropped": ["block"],
    "weights_kept_in_bfloat16_for_the_backward": ["sdpa"],
    "value_gradient_order_changes_between_calls": ["sdpa"],
    "silu_derivative_sigmoid_only": ["block"],
    "rms_norm_without_mean_square_term": ["block"],
    "rope_gradient_turned_forward": ["mha"],
    "flex_softmax_jvp_without_rowsum": ["flex"],
    "flex_score_mod_derivative_skipped": ["flex"],
    "flex_dk_not_scaled": ["flex"],
    "flex_parameter_gradient_not_summed": ["flex"],
}


def test_every_mutant_says_what_it_reaches():
    assert set(REACHES) == set(BROKEN_GRADIENTS) and len(REACHES) >= 5


GRADIENT_CHECK = ("gradients", "masked_rows", "no_autograd")  # the rows of the suite's gradient group
LOW_PRECISION_CHECK = ("gradient_values", "deterministic")  # the rows of its low-precision gradient group
# mutant -> the row that rejects it, where not `gradients`: a bug that float64 cannot show
REJECTED_BY = {"weights_kept_in_bfloat16_for_the_backward": "gradient_values",
               "value_gradient_order_changes_between_calls": "deterministic"}


def test_the_unmutated_backward_passes():
    report = check(attention_np, operations=["sdpa", "mha", "block", "flex"],
                   measures=GRADIENT_CHECK + LOW_PRECISION_CHECK)
    assert report.passed and {row.operation for row in report.rows if row.check == "gradients"} == {
        "sdpa", "mha", "block", "flex"}


@pytest.mark.parametrize("name", sorted(BROKEN_GRADIENTS))
def test_broken_backward_pass_is_rejected_by_the_gradient_check(name: str):
    mutant = BROKEN_GRADIENTS[name]
    # the forward passes are attention_np's own: only the vjps are mutated
    assert mutant.scaled_dot_product_attention is attention_np.scaled_dot_product_attention
    assert mutant.flex_attention is attention_np.flex_attention
    if name in FLEX_MUTATIONS:  # flex_attention_vjp alone is mutated: the classes are attention_np's
        assert mutant.MultiHeadAttention is attention_np.MultiHeadAttention
    else:
        assert all(set(vars(getattr(mutant, cls))) <= {"vjp", "__module__", "__qualname__", "__doc__"}
                   for cls in ("MultiHeadAttention", "TransformerBlock"))
    measures = GRADIENT_CHECK + (LOW_PRECISION_CHECK if name in REJECTED_BY else ())  # and its float64 rows pass
    report = check(mutant, operations=REACHES[name], shrink=False, measures=measures)
    failed = {row.check for row in report.rows if not row.passed}
    rejecting = REJECTED_BY.get(name, "gradients")
    assert failed == {rejecting}, f"{name}: failed {sorted(failed)}; only {rejecting} may fail"
