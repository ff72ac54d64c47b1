"""The partial contract (SPEC 11): a module with part of the contract, or one that declares features it lacks,
is checked on the rest, every row it cannot do is SKIP with the reason, and the declaration really keeps the
lacking feature away (without it the same module fails)."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import pytest

import attention_np
from attention_np.common import mods
from attention_np.common.keywords import KEYWORDS
from conformance import Declaration, check
from conformance.contract import features as features_module
from conformance.contract import operations
from conformance.contract.cases import (
    decode_case,
    flex_case,
    linear_case,
    mha_case,
    per_query_head,
    rule_case,
    sdpa_case,
    tiled,
)
from conformance.contract.fixed_cases import rows
from conformance.contract.operations import _is_default, features_used, init_features_used, leave_out
from conformance.run.checks import Runner, expected
from conformance.run.fixed_checks import mask_helpers
from conformance.run.suite import ANY_GROUP, known_measures
from tests._oracle_cache import oracle_answered_once
from tests.implementations import einsum_attention
from tests.implementations.broken import BROKEN
from tests.implementations.broken_linear import LINEAR

pytestmark = pytest.mark.slow  # the suite's sdpa part, on a few modules


@pytest.fixture(scope="module", autouse=True)
def _oracle_once():
    """The walks draw the same cases for every declaration (a declaration changes how a case runs, never which is
    drawn): the oracle answers each once."""
    with oracle_answered_once():
        yield


def _module(name: str, base: types.ModuleType = attention_np, *, lacks: Declaration | None = None,
            functions: tuple[str, ...] = ("scaled_dot_product_attention", "scaled_dot_product_attention_vjp")):
    """A module holding asarray, to_numpy and `functions` of `base`, with the declaration `lacks`."""
    module = types.ModuleType(name)
    for function in ("asarray", "to_numpy", *functions):
        setattr(module, function, getattr(base, function))
    if lacks is not None:
        module.CONFORMANCE = lacks
    return module


def _failures(report) -> str:
    return "\n\n".join(row.failure for row in report.rows if row.failure)


def test_declaration_takes_names_or_reasons_and_refuses_unknown_features():
    assert Declaration(("weights",)) == Declaration({"weights": ""})
    joined = Declaration({"weights": "fused"}) | Declaration(("dropout",))
    assert dict(joined.lacks) == {"dropout": "", "weights": "fused"} and "weights" in joined
    assert joined.reason("mask", "weights") == "lacks weights: fused" and joined.reason("mask") is None
    with pytest.raises(ValueError, match=r"unknown features \['weight'\]; the features are \[.*'weights'"):
        Declaration(("weight",))
    with pytest.raises(TypeError, match=r"CONFORMANCE must be a conformance\.Declaration, got tuple"):
        Runner(_module("bad_declaration", lacks=("weights",)))  # type: ignore[arg-type]


def test_the_renamed_features_are_read_under_their_old_names_with_a_deprecation_warning():
    # named after the options they cover: bias=False, rope_theta, attention="linear", norm="rms"
    with pytest.warns(DeprecationWarning, match=r"\['no_bias', 'rope'\] are now \['bias_false', 'rope_theta'\]"):
        old = Declaration({"rope": "no rotary embeddings", "no_bias": ""})
    assert old == Declaration({"rope_theta": "no rotary embeddings", "bias_false": ""})
    assert "rope" in old and old.reason("rope") == "lacks rope_theta: no rotary embeddings"
    with pytest.warns(DeprecationWarning):
        assert Declaration(("linear_attention", "rms_norm")) == Declaration(("attention_linear", "norm_rms"))
    assert not set(features_module.RENAMED) & set(features_module.FEATURES)


def test_every_feature_says_what_the_contract_asks_and_what_the_suite_does_without_it():
    kinds = {"result", "training", "argument", "option", "rule", "dtype", "errors"}
    for feature in features_module.FEATURES.values():
        assert feature.kind in kinds and feature.asks and feature.without, feature


def test_a_module_with_sdpa_alone_passes_it_and_skips_the_modules():
    report = check(_module("sdpa_only"), max_examples=2)  # which rows run and which SKIP, not their strength
    assert report.passed, _failures(report)
    skipped = {row.operation: row.skipped for row in report.rows if row.check == "-"}
    assert skipped == {"flash": "no flash_attention", "ring": "no ring_attention", "linear": "no linear_attention",
                       "mha": "no MultiHeadAttention", "block": "no TransformerBlock",
                       "decode": "no TransformerBlock.extend", "flex": "no flex_attention",
                       "varlen": "no varlen_attention", "mla": "no MultiHeadLatentAttention"}
    assert {row.operation for row in report.rows if not row.skipped} == {"arrays", "sdpa"}
    helpers = {row.operation: row.skipped for row in report.rows if row.operation in ("masks", "positions")}
    assert helpers == {"masks": "no causal_mask; no window_mask; no padding_mask", "positions": "no apply_rope"}


def test_a_module_with_none_of_the_operations_is_refused():
    with pytest.raises(AttributeError, match="it has no any of scaled_dot_product_attention, flash_attention, "
                                             "ring_attention, linear_attention, MultiHeadAttention"):
        check(_module("arrays_only", functions=()))


def test_lacking_weights_skips_their_rows_and_compares_out_alone():
    report = check(_module("no_weights", lacks=Declaration({"weights": "a fused kernel"})), operations=("sdpa",),
                   max_examples=2)
    assert report.passed, _failures(report)
    reasons = {(row.check, row.dtype): row.skipped for row in report.rows if row.skipped}
    assert reasons[("weights_rows", "float64")] == reasons[("weights", "float32")] == "lacks weights: a fused kernel"
    assert any(row.check == "values" and not row.skipped and row.examples > 0 for row in report.rows)


def test_lacking_arguments_keeps_them_from_the_module():
    # a function that refuses the arguments it lacks: the suite never passes them
    def refusing(q, k, v, mask=None, *, bias=None, is_causal=False, scale=None, **keywords):
        if mask is not None or bias is not None or is_causal or keywords.keys() - {"dropout_p", "need_weights",
                                                                                   "rng"}:
            raise AssertionError(f"passed what it lacks: {mask is not None, bias is not None, is_causal, keywords}")
        return attention_np.scaled_dot_product_attention(q, k, v, scale=scale, **keywords)

    lacking = ("mask", "bias", "is_causal", "q_offset", "window", "key_lengths", "softcap", "enable_gqa", "mods",
               "sinks", "alibi_slopes")
    module = _module("few_arguments", lacks=Declaration(lacking), functions=())
    module.scaled_dot_product_attention = refusing
    report = check(module, operations=("sdpa",))
    assert report.passed, _failures(report)
    assert next(row for row in report.rows if row.check == "sdpa_causal_prefix").skipped == "lacks is_causal"


def test_lacking_masked_rows_leaves_their_rows_out_and_only_then_passes():
    # a softmax without a guard for the rows that see no key: NaN there (0 / 0), right everywhere else
    nan_rows = BROKEN["masked_row_nan"]
    assert not check(nan_rows, operations=("sdpa",), shrink=False).passed
    declared = _module("nan_rows_declared", nan_rows, functions=("scaled_dot_product_attention",),
                       lacks=Declaration({"masked_rows": "NaN where no key is seen"}))
    report = check(declared, operations=("sdpa",))
    assert report.passed, _failures(report)
    edge = next(row for row in report.rows if row.check == "edge_cases")
    assert edge.examples < len(rows("sdpa", "edge"))  # the fully masked edge cases were skipped


def test_lacking_exceptions_accepts_any_exception_but_not_none():
    def foreign_errors(q, k, v, mask=None, **keywords):
        try:
            return attention_np.scaled_dot_product_attention(q, k, v, mask, **keywords)
        except (TypeError, ValueError) as error:
            raise RuntimeError(f"the kernel refused: {error}") from None

    module = _module("foreign_errors", functions=())
    module.scaled_dot_product_attention = foreign_errors
    failing = next(row for row in check(module, operations=("sdpa",), max_examples=1).rows if row.check == "errors")
    assert not failing.passed and "RuntimeError: the kernel refused" in failing.failure
    module.CONFORMANCE = Declaration(("exceptions",))
    errors = next(row for row in check(module, operations=("sdpa",), max_examples=1).rows if row.check == "errors")
    assert errors.passed and errors.examples > 0


def test_a_dtype_declared_lacking_is_skipped():
    report = check(_module("no_half", lacks=Declaration({"float16": "", "bfloat16": ""})), operations=("sdpa",),
                   max_examples=1)
    assert report.passed
    assert all(row.skipped == f"lacks {row.dtype}" for row in report.rows if row.dtype in ("float16", "bfloat16"))


def test_fixed_rows_read_the_features_they_use():
    by_name = {row.name: row for row in rows("sdpa", "error")}
    assert "window" in features_used(by_name["window_negative"].build())
    assert "dropout" in features_used(by_name["dropout_p_one"].build())
    assert "enable_gqa" in features_used(by_name["gqa_heads_not_a_multiple"].build())
    edges = {row.name: features_used(row.build()) for row in rows("sdpa", "edge")}
    assert "masked_rows" in edges["fully_masked_rows"] and "non_finite" in edges["nan_in_key"]
    assert "empty" in edges["no_keys"] and "empty" in edges["no_queries"]
    assert not {"masked_rows", "non_finite", "empty"} & edges["logits_in_the_thousands"]
    assert init_features_used({"d_model": 8, "num_heads": 4, "num_kv_heads": 0}) == {"num_kv_heads"}
    assert init_features_used({"d_model": 8, "num_heads": 4, "norm": "batch", "dropout": 0.0}) == {"norm_rms"}


def test_grouped_heads_left_out_are_the_same_attention():
    # k and v repeated per query head (enable_gqa lacking) give the oracle's own output and weights
    case = sdpa_case((2, 4), 3, 5)
    grouped = case._replace(k=case.k[:, :2], v=case.v[:, :2], enable_gqa=True)
    plain = leave_out(grouped, Declaration(("enable_gqa",)))
    assert not plain.enable_gqa and plain.k.shape == (2, 4, 5, 2)
    np.testing.assert_array_equal(plain.k, per_query_head(grouped)[0])
    for a, b in zip(expected(plain), expected(grouped), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-15, atol=0)


def test_a_module_lacking_an_option_never_gets_a_case_that_uses_it():
    seen = []

    class Recording(attention_np.MultiHeadAttention):
        @classmethod
        def from_state_dict(cls, state, **options):
            module = attention_np.MultiHeadAttention.from_state_dict(state, **options)  # an error row's raises
            seen.append(state["w_k.weight"].shape[0] == state["w_q.weight"].shape[0] and "w_q.bias" in state
                        and "rope_theta" not in options)
            return module

    module = _module("no_module_options", lacks=Declaration(("num_kv_heads", "bias_false", "rope_theta")), functions=())
    module.MultiHeadAttention = Recording
    report = check(module, operations=("mha",), max_examples=3)
    assert report.passed, _failures(report)
    assert seen and all(seen)


def test_a_block_that_decodes_beside_an_attention_without_a_cache_lacks_mha_cache_and_passes():
    # TransformerBlock.extend beside a MultiHeadAttention without extend: the module's classes say it lacks
    # mha_cache; drawn decode cases attend to their own input through the block, the fixed cross-attention case is
    # skipped (each called the missing method before, and failed)
    class Attention(attention_np.MultiHeadAttention):
        extend = init_cache = None  # no cache of its own

    module = _module("no_mha_cache", functions=())
    module.MultiHeadAttention, module.TransformerBlock = Attention, attention_np.TransformerBlock
    assert features_module.declaration_of(module).reason("mha_cache") == "lacks mha_cache: no MultiHeadAttention.extend"
    assert not features_module.declaration_of(attention_np).lacks  # a module with both caches lacks nothing
    report = check(module, operations=("decode",), max_examples=4)
    assert report.passed, _failures(report)
    assert any(row.examples for row in report.rows if row.check == "values" and not row.skipped), report.rows


def test_a_block_that_decodes_without_lengths_and_pages_lacks_cache_lengths_and_paged_cache_and_passes():
    # a TransformerBlock whose extend takes no new_lengths and which has no init_paged_cache (a module from before
    # SPEC 3a's lengths and 3b's pages): its methods say it lacks both; drawn decode cases take every row of each
    # chunk through init_cache's cache, the fixed ragged and paged cases are skipped (each raised before)
    class Block(attention_np.TransformerBlock):
        init_paged_cache = None

        def extend(self, x, cache, mask=None, *, need_weights=True, rng=None):
            return super().extend(x, cache, mask, need_weights=need_weights, rng=rng)

    module = _module("no_cache_lengths", functions=())
    module.MultiHeadAttention, module.TransformerBlock = attention_np.MultiHeadAttention, Block
    assert features_module.declaration_of(module).reason("cache_lengths", "paged_cache") == (
        "lacks cache_lengths: no new_lengths in TransformerBlock.extend; "
        "lacks paged_cache: no TransformerBlock.init_paged_cache")
    report = check(module, operations=("decode",), max_examples=6)
    assert report.passed, _failures(report)
    assert any(row.examples for row in report.rows if row.check == "values" and not row.skipped), report.rows


def test_a_block_whose_cache_does_not_stream_lacks_streaming_cache_and_passes():
    # a TransformerBlock whose init_cache takes no sink_tokens nor window (a module from before SPEC 3c): its methods
    # say it lacks streaming_cache; drawn streaming cases decode through the contiguous cache, which holds their whole
    # sequence, and the fixed streaming cases are skipped (each raised before)
    class Block(attention_np.TransformerBlock):
        def init_cache(self, batch_shape, capacity, *, dtype=None):
            return super().init_cache(batch_shape, capacity, dtype=dtype)

    module = _module("no_streaming_cache", functions=())
    module.MultiHeadAttention, module.TransformerBlock = attention_np.MultiHeadAttention, Block
    assert features_module.declaration_of(module).reason("streaming_cache") == (
        "lacks streaming_cache: no window in TransformerBlock.init_cache")
    report = check(module, operations=("decode",), max_examples=12)
    assert report.passed, _failures(report)
    skipped = [row for row in report.rows if row.check == "values" and row.skipped]
    assert not skipped and any(row.examples for row in report.rows if row.check == "values"), report.rows


def test_a_block_without_linear_heads_lacks_linear_cache_and_passes():
    # a TransformerBlock whose from_state_dict takes no attention (a module whose blocks have softmax heads alone,
    # as tests/implementations/einsum_attention.py's): its methods say it lacks linear_cache; the drawn decode cases
    # with linear heads are passed over (each needs attention="linear", which its block refuses), the rest pass
    class Block(attention_np.TransformerBlock):
        @classmethod
        def from_state_dict(cls, state, *, num_heads, dropout=0.1, norm_first=False, activation=None, eps=1e-5,
                            rope_theta=None):
            return super().from_state_dict(state, num_heads=num_heads, dropout=dropout, norm_first=norm_first,
                                           activation=activation, eps=eps, rope_theta=rope_theta)

    module = _module("no_linear_cache", functions=())
    module.MultiHeadAttention, module.TransformerBlock = attention_np.MultiHeadAttention, Block
    declaration = features_module.declaration_of(module)
    assert declaration.reason("linear_cache") == (
        "lacks linear_cache: no attention in TransformerBlock.from_state_dict")
    case = decode_case((2,), (2, 1), dropout=0.0)._replace(attention="linear")
    assert "linear_cache" in features_used(case) and leave_out(case, declaration) is None
    operation = operations.operation_of(case)
    arrays, options = operations.arrays_and_options(case)
    with pytest.raises(TypeError, match="attention"):  # what the suite would have called, without the feature
        operation.call(module, arrays, None, training=False, need_weights=True, **options)
    report = check(module, operations=("decode",), max_examples=12)
    assert report.passed, _failures(report)
    skipped = [row for row in report.rows if row.check == "values" and row.skipped]
    assert not skipped and any(row.examples for row in report.rows if row.check == "values"), report.rows


def test_a_declaration_changes_how_the_drawn_cases_run_never_which_are_drawn():
    # the queries each sdpa call gets, in order: the same for one seed whatever the module declares lacking (the
    # window lacking only leaves the window out of the cases that have one)
    def queries(lacks: Declaration | None, operation: str = "sdpa") -> list[bytes]:
        seen: list[bytes] = []

        def recording(q, *arguments, **keywords):
            seen.append(np.asarray(q).tobytes())
            return attention_np.scaled_dot_product_attention(q, *arguments, **keywords)

        module = _module("recording", lacks=lacks)
        module.scaled_dot_product_attention = recording
        assert check(module, operations=(operation,), measures=("values",), max_examples=12).passed
        return seen

    plain = queries(None)
    assert len(plain) > 12
    assert queries(Declaration({"dropout": "inference only"})) == plain
    assert queries(Declaration({"window": "no sliding window"})) == plain


def test_a_kernel_of_the_first_contract_untouched_passes_the_rows_it_can_run():
    # its sdpa takes the first contract's keywords alone: the later ones (SPEC 2a, the mods) are read off its
    # signature as lacking, each with the reason, and its sdpa rows pass without a declaration
    def scaled_dot_product_attention(q, k, v, mask=None, *, bias=None, is_causal=False, scale=None, dropout_p=0.0,
                                     need_weights=True, rng=None):
        return attention_np.scaled_dot_product_attention(q, k, v, mask, bias=bias, is_causal=is_causal, scale=scale,
                                                         dropout_p=dropout_p, need_weights=need_weights, rng=rng)

    module = _module("first_contract", functions=())
    module.scaled_dot_product_attention = scaled_dot_product_attention
    lacking = ("q_offset", "window", "key_lengths", "softcap", "enable_gqa", "mods", "score_mod", "sinks",
               "alibi_slopes")
    assert dict(Runner(module).declaration.lacks) == dict.fromkeys(
        sorted(lacking), "not in the signature of scaled_dot_product_attention")
    report = check(module, operations=("sdpa",), max_examples=4)
    assert report.passed, _failures(report)
    # a declaration still wins: its reason replaces the signature's
    module.CONFORMANCE = Declaration({"window": "no sliding window"})
    assert Runner(module).declaration.reason("window") == "lacks window: no sliding window"


def test_a_kernel_taking_keywords_lacks_nothing_it_does_not_declare():
    def scaled_dot_product_attention(q, k, v, mask=None, **keywords):
        return attention_np.scaled_dot_product_attention(q, k, v, mask, **keywords)

    module = _module("keywords", functions=())
    module.scaled_dot_product_attention = scaled_dot_product_attention
    assert Runner(module).declaration == Declaration()


def test_error_rows_configure_dropout_only_where_the_mistake_is_the_dropout():
    # SPEC 11: an inference-only module (dropout lacking) runs every error row whose mistake is not the dropout
    from conformance.contract.operations import OPERATIONS

    for operation in OPERATIONS:
        for row in rows(operation, "error"):
            made = row.build()
            used = init_features_used(made) if row.stage == "init" else features_used(made)
            about_dropout = "dropout" in row.name or any("dropout" in word for word in row.contains)
            assert "dropout" not in used or about_dropout, f"{operation} {row.name} configures dropout"


def test_a_state_in_swiglus_layout_needs_swiglu_whatever_the_activation_asked():
    (row,) = [row for row in rows("block", "error") if row.name == "relu_with_a_swiglu_state"]
    assert "swiglu" in features_used(row.build())


def test_the_mask_helpers_skip_the_keywords_a_module_lacks():
    # helpers of the first contract: causal_mask(L, S), no window_mask; q_offset declared lacking
    module = _module("first_helpers", lacks=Declaration({"q_offset": "no positions", "window": "no windows"}))
    module.causal_mask, module.padding_mask = (lambda L, S: attention_np.causal_mask(L, S)), attention_np.padding_mask
    results = mask_helpers(Runner(module))
    assert not [result for result in results if result.problems], [r for r in results if r.problems]
    skipped = {result.row.name: result.skipped for result in results if result.skipped}
    assert skipped and all(why.startswith(("lacks q_offset", "lacks window", "no window_mask"))
                           for why in skipped.values()), skipped
    assert {result.row.name for result in results if not result.skipped} >= {"causal_mask_3_3", "padding_mask_4_6"}


_REFUSED = {"mods": ("mask_mod", "block_mask")}  # beyond the table's keywords: flash's block mask is a mod too


@pytest.mark.parametrize("feature", sorted({keyword.feature for keyword in KEYWORDS.values()}))
def test_a_module_lacking_a_keyword_is_never_passed_it_by_any_row(feature: str):
    # every function of the module refuses the feature's keywords away from their defaults, and the module declares
    # the feature lacking: each row of sdpa, flash and flex (drawn, pinned, edge cases, errors) passes or is
    # skipped, and a row that passed one would fail (an error row: the wrong exception)
    refused = _REFUSED.get(feature, ()) + tuple(name for name, entry in KEYWORDS.items() if entry.feature == feature)

    def refusing(function):
        def call(*arguments, **keywords):
            if feature == "mask" and len(arguments) > 3 and arguments[3] is not None:
                raise AssertionError(f"passed a mask, which {function.__name__} lacks")
            given = [name for name in refused if name in keywords and not (
                keywords[name] is None or (name in KEYWORDS and _is_default(keywords[name], KEYWORDS[name].default)))]
            if given:
                raise AssertionError(f"passed {given}, which {function.__name__} lacks")
            return function(*arguments, **keywords)
        return call

    functions = ("scaled_dot_product_attention", "scaled_dot_product_attention_vjp", "flash_attention",
                 "flash_attention_vjp", "flex_attention", "flex_attention_vjp", "create_block_mask")
    module = _module(f"lacking_{feature}", lacks=Declaration({feature: "refused"}), functions=functions)
    for name in functions[:-1]:
        setattr(module, name, refusing(getattr(attention_np, name)))
    report = check(module, operations=("sdpa", "flash", "flex"), max_examples=2)
    assert report.passed, _failures(report)


OPTIONS = ("num_kv_heads", "bias_false", "rope_theta", "attention_linear", "norm_rms", "gelu", "swiglu", "mha_sinks",
           "position_alibi")


def _options_used(state: dict, options: dict, prefix: str = "") -> set[str]:
    """The module options (features) that a state dict's layout and from_state_dict's or a constructor's keyword
    arguments ask for. A layout the seed's module cannot take either (w_k's rows no whole number of heads, a partial
    set of biases) is a mistake of the seed's contract, not an option."""
    heads, kv_heads = options.get("num_heads"), options.get("num_kv_heads")
    if state and heads:  # the layout: w_k's rows, in whole heads of w_q's width
        d_k, rows = state[f"{prefix}w_q.weight"].shape[0] // heads, state[f"{prefix}w_k.weight"].shape[0]
        kv_heads = rows // d_k if d_k and rows % d_k == 0 and 0 < rows < heads * d_k else None
    biases = [f"{prefix}{name}.bias" in state for name in ("w_q", "w_k", "w_v", "w_o")]
    used = {"num_kv_heads": kv_heads not in (None, heads),
            "bias_false": options.get("bias") is False or (bool(state) and not any(biases)),
            "rope_theta": options.get("rope_theta") is not None,
            "attention_linear": options.get("attention", "softmax") != "softmax",
            "norm_rms": options.get("norm", "layer") != "layer" or (bool(prefix) and bool(state)
                                                                    and "norm1.bias" not in state),
            "gelu": options.get("activation") == "gelu",
            "swiglu": options.get("activation") == "swiglu" or "ffn.w_gate.weight" in state,
            "mha_sinks": options.get("sinks") is True or f"{prefix}sinks" in state,
            "position_alibi": options.get("position") is not None}
    return {name for name, asked in used.items() if asked}


@pytest.mark.parametrize("feature", OPTIONS)
def test_a_module_lacking_an_option_is_never_built_with_it_by_any_row(feature: str):
    # the module's classes refuse the option, whether a state dict's layout or a keyword asks for it, and the module
    # declares it lacking: each row of mha, block and decode (drawn, pinned, edge cases, errors) passes or is skipped
    def refuse(state: dict, options: dict, prefix: str = "") -> None:
        if feature in _options_used(state, options, prefix):
            raise AssertionError(f"built with {feature}, which the module lacks")

    def refusing(base: type, prefix: str) -> type:
        """`base`, refusing the option in its constructor and in from_state_dict (the attention's entries under
        `prefix` in a block's state)."""
        class Refusing(base):
            def __init__(self, *arguments, **options):
                refuse({}, options)
                super().__init__(*arguments, **options)

            @classmethod
            def from_state_dict(cls, state, **options):
                refuse(state, options, prefix)
                return base.from_state_dict(state, **options)

        return Refusing

    module = _module(f"lacking_{feature}", lacks=Declaration({feature: "refused"}), functions=())
    module.MultiHeadAttention = refusing(attention_np.MultiHeadAttention, "")
    module.TransformerBlock = refusing(attention_np.TransformerBlock, "attn.")
    report = check(module, operations=("mha", "block", "decode"), max_examples=2)
    assert report.passed, _failures(report)


def test_a_check_asks_for_some_checks_only():
    report = check(attention_np, operations=("sdpa",), measures=("edge_cases", "values"), max_examples=1)
    assert {row.check for row in report.rows} == {"values", "fast_path", "weights_rows", "edge_cases"}
    assert {row.operation for row in report.rows} == {"sdpa"}  # no contract table was asked for
    with pytest.raises(ValueError, match=r"unknown checks \['value'\]; the checks are \[.*'values'"):
        check(attention_np, measures=("value",))


def test_an_sdpa_without_mods_declares_them_and_passes_the_rest():
    # a third party's sdpa whose flex_attention takes no mods (it refuses a score function and a block mask): it
    # declares mods lacking, the flex operation is SKIP with the reason, and its sdpa passes
    def without_mods(q, k, v, score_mod=None, block_mask=None, **keywords):
        if score_mod is not None or block_mask is not None:
            raise AssertionError("passed the mods it lacks")
        return einsum_attention.flex_attention(q, k, v, **keywords)

    functions = ("scaled_dot_product_attention", "create_block_mask")
    lacking = _module("sdpa_without_mods", einsum_attention, functions=functions,
                      lacks=Declaration({"mods": "no programmable attention"}))
    lacking.flex_attention = without_mods
    report = check(lacking, operations=("sdpa", "flex"), max_examples=2)
    assert report.passed, _failures(report)
    skipped = {row.operation: row.skipped for row in report.rows if row.check == "-"}
    assert skipped == {"flex": "lacks mods: no programmable attention"}
    assert any(row.operation == "sdpa" and row.check == "values" and not row.skipped for row in report.rows)
    undeclared = _module("sdpa_without_mods_undeclared", einsum_attention, functions=functions)
    undeclared.flex_attention = without_mods
    assert not check(undeclared, operations=("flex",), max_examples=2, shrink=False).passed


def test_modules_without_the_later_linear_arguments_lack_them():
    # broken_linear's LINEAR was written before the update rules: its linear_attention takes no update_rule, so the
    # suite reads the lack off the signature and passes over every case under another rule (test_broken_linear:
    # its linear rows pass); a module lacking is_causal cannot run them either (every rule but "linear" is causal)
    declaration = features_module.declaration_of(LINEAR)
    assert declaration.reason("update_rules") == "lacks update_rules: no update_rule in linear_attention"
    assert "update_rules" not in features_module.declaration_of(attention_np)
    case = rule_case("gated_delta")
    assert features_used(case) >= {"update_rules", "is_causal"} and "update_rules" not in features_used(linear_case())
    assert leave_out(case, declaration) is None and leave_out(case, Declaration(("is_causal",))) is None
    assert leave_out(linear_case(), declaration) is not None
    # einsum_attention's MultiHeadAttention takes no is_causal: it lacks mha_is_causal, and causal heads pass it by
    causal_heads = mha_case(L=5, S=5, attention="linear", dropout=0.0, is_causal=True)
    lacking = features_module.declaration_of(einsum_attention)
    assert lacking.reason("mha_is_causal") == "lacks mha_is_causal: no is_causal in MultiHeadAttention.__call__ or vjp"
    assert "mha_is_causal" in features_used(causal_heads) and leave_out(causal_heads, lacking) is None
    assert "mha_is_causal" not in features_module.declaration_of(attention_np)


def test_lacking_score_mod_keeps_score_functions_from_flex_cases():
    case = flex_case(score_mod=np.tanh)  # any score function
    assert features_used(case) == {"mods", "score_mod"} and features_used(flex_case()) == {"mods"}
    assert leave_out(case, Declaration(("score_mod",))).score_mod is None
    assert leave_out(case, Declaration(("mods",))) is None


def test_an_sdpa_without_mask_mod_and_score_mod_declares_mods_and_passes_the_rest():
    # a third party's sdpa that takes no mask_mod or score_mod (an older one): it declares mods lacking and passes
    # sdpa, its fixed cases with mods skipped; undeclared, the pinned examples with mods reach it and it fails
    def without_mods(q, k, v, mask=None, **keywords):
        if "mask_mod" in keywords or "score_mod" in keywords:
            raise TypeError("scaled_dot_product_attention() got an unexpected keyword argument 'mask_mod'")
        return einsum_attention.scaled_dot_product_attention(q, k, v, mask, **keywords)

    lacking = _module("sdpa_without_sdpa_mods", einsum_attention, functions=(),
                      lacks=Declaration({"mods": "no mask or score functions", "sinks": "older than sinks",
                                         "alibi_slopes": "older than ALiBi"}))
    lacking.scaled_dot_product_attention = without_mods
    report = check(lacking, operations=("sdpa",), max_examples=3)
    assert report.passed, _failures(report)
    errors = next(row for row in report.rows if row.operation == "sdpa" and row.check == "errors")
    ran = [row for row in rows("sdpa", "error")
           if row.stage == "call" and not features_used(row.build()) & {"mods", "sinks", "alibi_slopes"}]
    assert errors.examples == len(ran) < len(rows("sdpa", "error"))  # no vjp: pullback rows skipped too
    assert any(row.operation == "sdpa" and row.check == "values" and not row.skipped for row in report.rows)
    undeclared = _module("sdpa_without_sdpa_mods_undeclared", einsum_attention, functions=())
    undeclared.scaled_dot_product_attention = without_mods
    failed = check(undeclared, operations=("sdpa",), max_examples=3, shrink=False, measures=("values",))
    assert not failed.passed


def test_lacking_mods_keeps_mask_and_score_functions_from_sdpa_and_flash_cases():
    case = sdpa_case((2, 2), mask_mod=mods.causal(), score_mod=mods.softcap(1.0))
    assert features_used(case) >= {"mods", "score_mod"} and "mods" not in features_used(sdpa_case((2, 2)))
    assert leave_out(case, Declaration(("score_mod",))) == case._replace(score_mod=None)
    assert leave_out(case, Declaration(("mods",))) == case._replace(mask_mod=None, score_mod=None)
    flash = tiled(case, 2, 2)._replace(block_size=(2, 2))
    assert leave_out(flash, Declaration(("mods",))) == flash._replace(mask_mod=None, score_mod=None, block_size=None)


# --- the walk over the other features: arguments of the modules' calls, dropout, weights, rules, dtypes, errors ---
# attention_np with every function and class of the contract going through one `Around` per feature: it refuses what
# the feature offers (raises where a call passes it) or breaks the feature's rule; declared lacking, every row it
# reaches passes or is skipped

# The arguments a function or method takes by position, by name: a refusal reads them there
_POSITIONAL = {"asarray": ("x",), "apply_rope": ("x", "positions"), "linear_attention": ("q", "k", "v"),
               "linear_attention_vjp": ("q", "k", "v"), "flex_attention": ("q", "k", "v"),
               "flex_attention_vjp": ("q", "k", "v"), "MultiHeadAttention": ("d_model", "num_heads", "dropout"),
               "TransformerBlock": ("d_model", "num_heads", "d_ff", "dropout"),
               "MultiHeadAttention.from_state_dict": ("state",), "TransformerBlock.from_state_dict": ("state",),
               "TransformerBlock.__call__": ("x", "mask"), "TransformerBlock.vjp": ("x", "mask"),
               "TransformerBlock.extend": ("x", "cache", "mask"),
               "TransformerBlock.init_cache": ("batch_shape", "capacity"),
               "MultiHeadAttention.extend": ("q", "k", "cache", "mask"),  # x_q, x_kv: the queries', the keys' inputs
               "MultiHeadAttention.init_cache": ("batch_shape", "capacity")}
_WALKED = ("asarray", "apply_rope", "scaled_dot_product_attention", "scaled_dot_product_attention_vjp",
           "flash_attention", "flash_attention_vjp", "flex_attention", "flex_attention_vjp", "linear_attention",
           "linear_attention_vjp")
Around = Callable[[str, Callable, dict, tuple, dict], Any]  # (where, function, named arguments, arguments, keywords)
# -> what the module without the feature returns (or raises) where the function would return function(*arguments,
# **keywords)


def _named(where: str, arguments: tuple, keywords: dict) -> dict:
    """The call's arguments by name (a function's q, k, v, mask; a method's own)."""
    return dict(zip(_POSITIONAL.get(where, ("q", "k", "v", "mask")), arguments, strict=False)) | keywords


def _around(where: str, function: Callable, around: Around) -> Callable:
    def call(*arguments, **keywords):
        return around(where, function, _named(where, arguments, keywords), arguments, keywords)
    return call


def _walking_class(base: type, around: Around) -> type:
    """`base` with its constructor, from_state_dict, calls, vjp and cache methods going through `around`."""
    name = base.__name__

    class Walking(base):
        def __init__(self, *arguments, **keywords):
            around(name, lambda *a, **k: super(Walking, self).__init__(*a, **k), _named(name, arguments, keywords),
                   arguments, keywords)

        @classmethod
        def from_state_dict(cls, *arguments, **keywords):
            where = f"{name}.from_state_dict"
            return around(where, super().from_state_dict, _named(where, arguments, keywords), arguments, keywords)

    for method in ("__call__", "vjp", "extend", "init_cache"):
        if hasattr(base, method):
            setattr(Walking, method, lambda self, *arguments, _method=method, **keywords: around(
                f"{name}.{_method}", getattr(super(Walking, self), _method),
                _named(f"{name}.{_method}", arguments, keywords), arguments, keywords))
    Walking.__name__ = Walking.__qualname__ = name
    return Walking


def _walking(name: str, lacks: Declaration | None, around: Around) -> types.ModuleType:
    """attention_np with every function and class of the contract going through `around`, declaring `lacks`."""
    module = _module(name, lacks=lacks, functions=("create_block_mask", "causal_mask", "window_mask", "padding_mask"))
    for function in _WALKED:
        setattr(module, function, _around(function, getattr(attention_np, function), around))
    module.MultiHeadAttention = _walking_class(attention_np.MultiHeadAttention, around)
    module.TransformerBlock = _walking_class(attention_np.TransformerBlock, around)
    return module


def _refusing(refused: Callable[[str, dict], str | None], error: type = AssertionError) -> Around:
    """A module that raises `error` where `refused(where, named arguments)` names what the call passed."""
    def around(where, function, named, arguments, keywords):
        if what := refused(where, named):
            raise error(f"{where} passed {what}, which the module lacks")
        return function(*arguments, **keywords)
    return around


def _arrays(named: dict) -> list[np.ndarray]:
    """The call's arrays: its arguments and a state dict's entries."""
    values = [value for name, value in named.items() if name != "state"] + list(named.get("state", {}).values())
    return [value for value in values if isinstance(value, np.ndarray)]


def _mask_of(named: dict) -> np.ndarray | None:
    return None if named.get("mask") is None else np.asarray(named["mask"])


def _module_call(where: str) -> bool:
    return where.startswith(("MultiHeadAttention.", "TransformerBlock.")) and not where.endswith(
        ("from_state_dict", "init_cache"))


def _a_mask(where: str, named: dict) -> str | None:
    return "a mask" if _module_call(where) and _mask_of(named) is not None else None


def _a_mask_per_head(where: str, named: dict) -> str | None:
    mask = _mask_of(named)
    differs = mask is not None and mask.ndim >= 3 and bool(np.any(mask != mask[..., :1, :, :]))
    return "a mask that differs between the heads" if _module_call(where) and differs else None


def _a_dropout(where: str, named: dict) -> str | None:
    p = named.get("dropout_p", named.get("dropout", 0.0))
    return f"dropout {p}" if isinstance(p, int | float) and p > 0 else None


def _in_dtype(dtype: str) -> Callable[[str, dict], str | None]:
    """Arrays in `dtype`, or a cache or module asked for in it (dtype=)."""
    def refused(where: str, named: dict) -> str | None:
        held = any(x.dtype.name == dtype for x in _arrays(named))
        asked = named.get("dtype") is not None and np.dtype(named["dtype"]).name == dtype
        return f"arrays in {dtype}" if held or asked else None
    return refused


def _computes(where: str) -> bool:
    """Whether `where` is an operation's call (a function's, a module's __call__, vjp or extend)."""
    return where in _WALKED[2:] or _module_call(where)


def _with_result(where: str, change: Callable[[Any, Any], tuple[Any, Any]]) -> Callable[[Any], Any]:
    """An operation's result with (out, second) changed, where it has a second result (weights or lse)."""
    def changed(result: Any) -> Any:
        if not _computes(where):
            return result
        if isinstance(result, tuple) and len(result) >= 2 and not callable(result[1]):
            return (*change(result[0], result[1]), *result[2:])
        if isinstance(result, tuple):  # (out, pullback)
            return (change(result[0], None)[0], *result[1:])
        return change(result, None)[0]
    return changed


def _no_weights(where, function, named, arguments, keywords):
    """None for the weights: need_weights is ignored (lse is not the weights)."""
    result = function(*arguments, **keywords)
    lse = where.startswith(("flash", "flex", "linear"))
    return result if lse else _with_result(where, lambda out, weights: (out, None))(result)


def _nan_where_no_key_is_seen(where, function, named, arguments, keywords):
    """NaN in the out rows (and weights rows) of a query that sees no key (in some head), as a softmax without a
    guard gives them (0 / 0); flash and flex: where the lse is -inf; linear attention: where key_lengths is 0 or S
    is 0 (0 / 0 without its eps)."""
    asked = keywords.get("need_weights", True)
    result = function(*arguments, **keywords | ({"need_weights": True} if "need_weights" in keywords else {}))

    def change(out, second):
        if where.startswith("linear") and isinstance(out, np.ndarray):
            lengths = np.asarray(named["k"].shape[-2] if named.get("key_lengths") is None else named["key_lengths"])
            rows = np.broadcast_to((lengths == 0)[..., None] | (named["k"].shape[-2] == 0), out.shape[:-1])  # (..., L)
            return np.where(rows[..., None], out.dtype.type(np.nan), out), second
        if second is None or not isinstance(out, np.ndarray):
            return out, second
        lse = where.startswith(("flash", "flex"))
        blind = np.isneginf(second) if lse else np.all(second == 0, axis=-1)  # (..., [H,] L)
        rows = np.any(blind, axis=-2) if where.startswith(("Multi", "Transformer")) else blind  # (..., L)
        nan = out.dtype.type(np.nan)
        out = np.where(rows[..., None], nan, out)
        second = second if lse else np.where(blind[..., None], nan, second)
        return out, second if asked else None
    return _with_result(where, change)(result)


def _nan_everywhere_from_any_nan(where, function, named, arguments, keywords):
    """NaN in every output where any input holds NaN or inf (a bias's -inf aside)."""
    result = function(*arguments, **keywords)
    inputs = [np.asarray(named[name]) for name in ("q", "k", "v", "x") if named.get(name) is not None]
    bias = named.get("bias")
    poisoned = any(np.issubdtype(x.dtype, np.floating) and not np.all(np.isfinite(x)) for x in inputs) or (
        isinstance(bias, np.ndarray) and bool(np.any(np.isnan(bias) | (bias == np.inf))))
    if not poisoned:
        return result

    def nan(x):
        return x if not isinstance(x, np.ndarray) else np.full_like(x, np.nan)
    return _with_result(where, lambda out, second: (nan(out), nan(second)))(result)


def _an_attention_cache(where: str, named: dict) -> str | None:
    return "its own cache" if where in ("MultiHeadAttention.extend", "MultiHeadAttention.init_cache") else None


def _raising_on_empty(where: str, named: dict) -> str | None:
    empty = [name for name in ("q", "k", "v", "x") if isinstance(named.get(name), np.ndarray)
             and named[name].ndim >= 2 and named[name].shape[-2] == 0]
    return f"an empty {empty[0]}" if empty and where != "asarray" else None


def _foreign_errors(where, function, named, arguments, keywords):
    """RuntimeError in place of SPEC 7's TypeError and ValueError (a pullback's too)."""
    try:
        result = function(*arguments, **keywords)
    except (TypeError, ValueError) as error:
        raise RuntimeError(f"{where} refused: {error}") from None
    if isinstance(result, tuple) and result and callable(result[-1]) and where.endswith("vjp"):
        return (*result[:-1], _around(f"{where} pullback", result[-1], _foreign_errors))
    return result


class Walk(NamedTuple):
    """A module without one feature: how it behaves, the operations it reaches, and the checks it concerns."""

    around: Around
    operations: tuple[str, ...]
    measures: tuple[str, ...] | None = None  # None: every check
    undeclared: tuple[str, ...] = ()  # where it breaks the spec (a rule, SPEC 7): the checks it fails undeclared


# Every check but the gradient groups (a vjp's gradients against finite differences, about 70% of a walk's time), for
# the features that no gradient row can reach: weights (a vjp's are not read), float16 (the gradient groups run in
# float64), NaN, inf and empty axes (the gradients' pinned examples are finite and not empty: finite differences need
# them so); SPEC 7's exception types reach the error rows alone
NO_GRADIENTS = tuple(sorted(set(known_measures()) - {"gradients", "masked_rows", "no_autograd", *ANY_GROUP}))
MODULES, OPERATIONS = ("mha", "block", "decode"), ("sdpa", "flash", "flex", "linear", "mha", "block", "decode")
WALKS = {
    "mask": Walk(_refusing(_a_mask), MODULES),
    "mask_per_head": Walk(_refusing(_a_mask_per_head), MODULES),
    "dropout": Walk(_refusing(_a_dropout), ("sdpa", "mha", "block", "decode")),
    "mha_cache": Walk(_refusing(_an_attention_cache), ("decode",), undeclared=("values",)),
    "weights": Walk(_no_weights, ("sdpa", "mha", "block", "decode"), NO_GRADIENTS),
    "masked_rows": Walk(_nan_where_no_key_is_seen, ("sdpa", "flash", "flex", "linear", "mha", "block"),
                        undeclared=("edge_cases",)),
    "non_finite": Walk(_nan_everywhere_from_any_nan, OPERATIONS, NO_GRADIENTS, undeclared=("edge_cases",)),
    "empty": Walk(_refusing(_raising_on_empty, ValueError), OPERATIONS, NO_GRADIENTS, undeclared=("edge_cases",)),
    "float16": Walk(_refusing(_in_dtype("float16"), TypeError), OPERATIONS, NO_GRADIENTS),  # bfloat16 alike: the
    # suite reads the two by one rule, and NumPy's arrays have no bfloat16 (attention_np has no rows in it)
    "float64": Walk(_refusing(_in_dtype("float64"), TypeError), OPERATIONS),
    "exceptions": Walk(_foreign_errors, OPERATIONS, ("errors",), undeclared=("errors",)),
}


@pytest.mark.parametrize("feature", sorted(WALKS))
def test_a_module_lacking_a_feature_is_never_held_to_it_by_any_row(feature: str):
    # the module refuses the feature (a call that needs it raises) or breaks its rule (masked_rows: NaN where a query
    # sees no key, as a softmax without a guard gives; non_finite: NaN everywhere from one NaN input; empty: ValueError
    # on an empty axis; exceptions: RuntimeError for SPEC 7's errors), and declares it lacking: each row of the
    # operations and checks it concerns (drawn, pinned, edge cases, errors, the helpers) passes or is skipped. One
    # that breaks the spec fails without the declaration: the declaration is what keeps its rows away
    walk = WALKS[feature]
    module = _walking(f"lacking_{feature}", Declaration({feature: "refused"}), walk.around)
    report = check(module, operations=walk.operations, measures=walk.measures, max_examples=1)
    assert report.passed, _failures(report)
    if walk.undeclared:
        undeclared = _walking(f"without_{feature}", None, walk.around)
        assert not check(undeclared, operations=walk.operations, measures=walk.undeclared, shrink=False,
                         contract=False).passed
