"""The conformance suite accepts a correct third-party implementation and rejects realistic broken ones.

`tests/implementations/einsum_attention.py` implements the contract independently of our backends and of
the oracle; `tests/implementations/broken.py` holds variants of it with one bug each. EXPECTED documents
which check of the suite guards against which bug: each variant must fail at least one of its checks.
"""

from __future__ import annotations

import pytest

from conformance import check
from tests.implementations import einsum_attention
from tests.implementations.broken import BROKEN

pytestmark = pytest.mark.slow  # the whole suite on every variant

# variant -> the checks (row measures) of which at least one must fail
EXPECTED: dict[str, set[str]] = {
    "transposed_projection": {"values"},
    "heads_interleaved": {"values"},
    "mha_scaled_by_d_model": {"values"},
    "weights_averaged_over_heads": {"values", "weights_rows"},
    "scale_one_over_e": {"values"},
    "custom_scale_ignored": {"values"},
    "zero_scale_taken_for_default": {"values"},
    "bias_ignored": {"values", "single_key"},
    "bias_scaled": {"values"},
    "float64_output": {"values"},  # a float32 input gives a float64 output: wrong dtype
    "inverted_mask": {"values", "single_key"},
    "mask_transposed": {"values", "causal_prefix", "permutation"},
    "is_causal_ignored": {"values", "causal_prefix"},
    "causal_bottom_right": {"values", "causal_prefix"},  # differs from top-left only when L != S
    "causal_strict": {"values", "single_key"},
    "neg_inf_bias_not_hidden": {"values"},  # NaN in a row whose keys are all -inf through the bias
    "neg_inf_score_hidden": {"edge_cases"},  # zeros in a row whose scores are all -inf through infinite q
    "window_off_by_one": {"values"},  # a bounded left side sees one key fewer
    "softcap_after_bias": {"values", "edge_cases"},  # tanh(-inf) = -1: a -inf bias no longer hides
    "q_offset_ignored_on_the_fast_path": {"fast_path"},  # need_weights=False reads query i's position as i
    "key_lengths_on_queries": {"values"},  # the lengths hide queries instead of keys
    "groups_interleaved": {"values"},  # query head h reads key/value head h % Hkv, not h // G
    "rope_interleaved_for_half": {"rope"},  # the pairs (2j, 2j + 1) where (j, j + E/2) are asked for
    "cache_length_not_advanced": {"values"},  # each chunk overwrites the last
    "softmax_wrong_axis": {"values", "weights_rows"},
    "softmax_without_max_subtraction": {"values"},  # logits in the hundreds overflow exp
    "row_maximum_before_bias": {"values"},  # biases in the thousands overflow exp
    "masked_row_uniform": {"values", "single_key"},
    "masked_row_nan": {"values", "single_key"},
    "hidden_filled_with_minus_1e4": {"values"},  # visible scores tens of thousands below zero
    "hidden_filled_with_minus_1e9": {"edge_cases"},  # visible scores about -1.1e12, float64 only
    "online_softmax_without_rescale": {"values", "weights_rows"},  # S past one tile of 16 keys
    "mask_after_softmax": {"values", "weights_rows"},
    "softmax_in_half_precision": {"values"},  # float16 logits in the hundreds, rounded before the softmax
    "weights_after_dropout": {"weights"},  # the dropout check compares training-mode weights with eval
    "dropout_in_eval": {"values"},  # modules are checked in eval mode with dropout configured
    "dropout_without_rescale": {"mean"},
    "rng_ignored_fixed_seed": {"varies"},
    "rng_ignored_fresh": {"reproducible"},
    "int_seed_taken_for_none": {"rng_forms"},  # only an int seed shows it
    "dropout_shared_by_heads": {"independent"},  # passes the mean: each head alone is right
    "seed_restarted_at_every_site": {"independent"},  # only an int seed shows it
    "layernorm_unbiased": {"values"},
    "layernorm_eps_outside_sqrt": {"values"},
    "gelu_tanh": {"values"},
    "pre_ln_ignored": {"values"},
    "ffn_residual_missing": {"values"},
    "norms_swapped": {"values"},
    "rms_norm_centred": {"values"},
    "swiglu_gate_and_up_swapped": {"values"},
    "kv_heads_interleaved": {"values"},  # query head h reads key/value head h % Hkv, not h // (H / Hkv)
    "asarray_widens_float16": {"round_trip"},
    "rank_one_mask_dropped_on_the_fast_path": {"fast_path"},
    "queries_scaled_in_place": {"call"},
    "padding_mask_off_by_one": {"helpers"},
    "dropout_skipped_without_weights": {"varies", "mean"},
}


def test_every_broken_variant_names_the_check_that_catches_it():
    assert set(EXPECTED) == set(BROKEN)
    assert len(BROKEN) >= 24


def test_correct_third_party_implementation_passes():
    report = check(einsum_attention)
    failures = "\n\n".join(row.failure for row in report.rows if row.failure)
    assert report.passed, failures


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # overflow and inf - inf are the point of some bugs
@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_implementation_is_rejected(name: str):
    report = check(BROKEN[name], shrink=False)  # the fast profile, as `python -m conformance` runs it
    failed = {row.check for row in report.rows if not row.passed}
    assert not report.passed, f"{name} passed the suite"
    expected = EXPECTED[name]
    assert failed & expected, f"{name} failed {sorted(failed)}, none of the expected {sorted(expected)}"
