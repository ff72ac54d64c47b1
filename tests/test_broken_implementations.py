"""The conformance suite accepts a correct third-party implementation and rejects realistic broken ones.

`tests/implementations/einsum_attention.py` implements the contract independently of our backends and of
the oracle; `tests/implementations/broken.py` holds variants of it with one bug each. EXPECTED documents
which check of the suite guards against which bug: each variant must fail at least one of its checks, in the
operation (or contract table) where the bug lives, checked alone as `python -m conformance` checks it.
"""

from __future__ import annotations

import pytest

from conformance import check
from conformance.run.suite import CONTRACT_RUNS
from tests._oracle_cache import oracle_answered_once
from tests.implementations import einsum_attention
from tests.implementations.broken import BROKEN

pytestmark = pytest.mark.slow  # the suite, one operation of it, on every variant


@pytest.fixture(scope="module", autouse=True)
def _oracle_once():
    """The variants of one operation draw the same cases (the suite's seed does not depend on the module): the
    oracle answers each once."""
    with oracle_answered_once():
        yield

# variant -> (the operation or contract table that shows the bug, the checks (row measures) of which at least one
# must fail there)
EXPECTED: dict[str, tuple[str, set[str]]] = {
    "transposed_projection": ("block", {"values"}),
    "heads_interleaved": ("mha", {"values"}),
    "mha_scaled_by_d_model": ("mha", {"values"}),
    "weights_averaged_over_heads": ("mha", {"values", "weights_rows"}),
    "scale_one_over_e": ("sdpa", {"values"}),
    "custom_scale_ignored": ("sdpa", {"values"}),
    "zero_scale_taken_for_default": ("sdpa", {"values"}),
    "bias_ignored": ("sdpa", {"values", "single_key"}),
    "bias_scaled": ("sdpa", {"values"}),
    "float64_output": ("sdpa", {"values"}),  # a float32 input gives a float64 output: wrong dtype
    "inverted_mask": ("sdpa", {"values", "single_key"}),
    "mask_transposed": ("sdpa", {"values", "causal_prefix", "permutation"}),
    "is_causal_ignored": ("sdpa", {"values", "causal_prefix"}),
    "causal_bottom_right": ("sdpa", {"values", "causal_prefix"}),  # differs from top-left only when L != S
    "causal_strict": ("sdpa", {"values", "single_key"}),
    "neg_inf_bias_not_hidden": ("sdpa", {"values"}),  # NaN in a row whose keys are all -inf through the bias
    "neg_inf_score_hidden": ("sdpa", {"edge_cases"}),  # zeros in a row whose scores are all -inf through infinite q
    "window_off_by_one": ("sdpa", {"values"}),  # a bounded left side sees one key fewer
    "window_unbounded_right_read_as_zero": ("sdpa", {"values"}),  # (left, None) without causal hides later keys
    "softcap_after_bias": ("sdpa", {"values", "edge_cases"}),  # tanh(-inf) = -1: a -inf bias no longer hides
    "q_offset_ignored_on_the_fast_path": ("sdpa", {"fast_path"}),  # need_weights=False reads query i's position as i
    "key_lengths_on_queries": ("sdpa", {"values"}),  # the lengths hide queries instead of keys
    "groups_interleaved": ("sdpa", {"values"}),  # query head h reads key/value head h % Hkv, not h // G
    "head_positions_split_as_groups_first": ("sdpa", {"values"}),  # per-head positions read as (G, Hkv)
    "rope_interleaved_for_half": ("positions", {"rope"}),  # the pairs (2j, 2j + 1) where (j, j + E/2) are asked for
    "rope_angles_in_half_precision": ("positions", {"rope"}),  # float16 angles at positions near 4096
    "cache_length_not_advanced": ("decode", {"values"}),  # each chunk overwrites the last
    "cache_unchecked": ("decode", {"errors"}),  # a cache of another batch shape or dtype written into as it comes
    "cache_width_unchecked": ("decode", {"errors"}),  # an input of another width reaches the cache's write
    "extend_mask_ignored": ("decode", {"values"}),  # extend's mask dropped: causal alone
    "extend_mask_cropped": ("decode", {"errors"}),  # a mask of another width than the capacity read as it comes
    "cross_attention_keys_from_the_queries": ("decode", {"values"}),  # MHA.extend caches x_q's keys, not x_kv's
    "rope_positions_from_the_chunk": ("decode", {"values"}),  # RoPE at 0.. in every chunk
    "rope_keys_not_turned": ("mha", {"values"}),  # the scores depend on the query's position, not the distance
    "linear_features_without_one": ("mha", {"values"}),  # linear heads with phi = elu: weights of either sign
    "softmax_wrong_axis": ("sdpa", {"values", "weights_rows"}),
    "softmax_without_max_subtraction": ("sdpa", {"values"}),  # logits in the hundreds overflow exp
    "row_maximum_before_bias": ("sdpa", {"values"}),  # biases in the thousands overflow exp
    "masked_row_uniform": ("sdpa", {"values", "single_key"}),
    "masked_row_nan": ("sdpa", {"values", "single_key"}),
    "hidden_filled_with_minus_1e4": ("sdpa", {"values"}),  # visible scores tens of thousands below zero
    "hidden_filled_with_minus_1e9": ("sdpa", {"edge_cases"}),  # visible scores about -1.1e12, float64 only
    "online_softmax_without_rescale": ("sdpa", {"values", "weights_rows"}),  # S past one tile of 16 keys
    "mask_after_softmax": ("sdpa", {"values", "weights_rows"}),
    "softmax_in_half_precision": ("sdpa", {"values"}),  # float16 logits in the hundreds, rounded before the softmax
    "weights_after_dropout": ("sdpa", {"weights"}),  # the dropout check compares training-mode weights with eval
    "dropout_in_eval": ("mha", {"values"}),  # modules are checked in eval mode with dropout configured
    "dropout_without_rescale": ("sdpa", {"mean"}),
    "rng_ignored_fixed_seed": ("sdpa", {"varies"}),
    "rng_ignored_fresh": ("sdpa", {"reproducible"}),
    "int_seed_taken_for_none": ("sdpa", {"rng_forms"}),  # only an int seed shows it
    "dropout_shared_by_heads": ("mha", {"independent"}),  # passes the mean: each head alone is right
    "seed_restarted_at_every_site": ("block", {"independent"}),  # only an int seed shows it
    "attention_and_activation_one_stream": ("block", {"independent"}),  # the weights' and activation's first decisions
    "attention_and_residual_one_stream": ("block", {"independent"}),  # the weights' and attention branch's
    "layernorm_unbiased": ("block", {"values"}),
    "layernorm_eps_outside_sqrt": ("block", {"values"}),
    "gelu_tanh": ("block", {"values"}),
    "pre_ln_ignored": ("block", {"values"}),
    "ffn_residual_missing": ("block", {"values"}),
    "norms_swapped": ("block", {"values"}),
    "rms_norm_centred": ("block", {"values"}),
    "swiglu_gate_and_up_swapped": ("block", {"values"}),
    "kv_heads_interleaved": ("mha", {"values"}),  # query head h reads key/value head h % Hkv, not h // (H / Hkv)
    "asarray_widens_float16": ("arrays", {"round_trip"}),
    "mask_rows_read_as_batch_when_l_equals_b": ("sdpa", {"values"}),  # a 2-D mask read as (B, S) when L == B
    "rank_one_mask_dropped_on_the_fast_path": ("sdpa", {"fast_path"}),
    "queries_scaled_in_place": ("sdpa", {"call"}),
    "padding_mask_off_by_one": ("masks", {"helpers"}),
    "dropout_skipped_without_weights": ("sdpa", {"varies", "mean"}),
    "flex_lse_without_the_maximum": ("flex", {"lse"}),  # out is right: only the lse shows it
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
    where, expected = EXPECTED[name]
    operations = () if where in CONTRACT_RUNS else (where,)  # the contract's tables run in every check
    # the fast profile, as the command line, on the groups and tables that report the expected checks
    report = check(BROKEN[name], operations=operations, shrink=False, measures=sorted(expected))
    failed = {row.check for row in report.rows if not row.passed and row.operation == where}
    assert not report.passed, f"{name} passed the suite"
    assert failed & expected, f"{name} failed {sorted(failed)} in {where}, none of the expected {sorted(expected)}"
