"""The fixed cases, declared once: pinned examples, edge cases and error inputs of every operation.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

- example: a case random draws rarely hit; the suite runs it first in every value and gradient group of
  its operation, held to the oracle like any drawn case.
- edge: inputs at a border of the spec (no keys, fully masked rows, NaN, inf); run in float64 on both paths,
  modules in eval mode with dropout configured, held to the oracle with the rules for NaN and inf of
  conformance/run/fixed_checks.py, and to the hand-derived `requirements` written beside it.
- error: a mistake a caller makes; the call must raise `error` with every string of `contains` in its
  message, on both paths. stage "call" runs the operation (modules: from_state_dict, then the call, in
  training mode with an rng, so a configured dropout reaches it), "init" the constructor with the row's
  keyword arguments, "pullback" the function the operation's vjp returns, given `d_out`.

Each row's name is unique within its operation. Imports NumPy, array-api-compat and the catalogue of mods
(attention_np.common.mods).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from array_api_compat import array_namespace

from attention_np.common import mods

from .cases import (
    LARGE,
    SMALL,
    DecodeCase,
    Paging,
    Requirement,
    Streaming,
    block_case,
    changed,
    decode_case,
    first_value,
    flex_case,
    linear_case,
    mha_case,
    mla_case,
    normal,
    random_mask,
    rule_case,
    sdpa_case,
    sharded,
    tiled,
    varlen_case,
    w_o_bias,
)

ALL = slice(None)


class Fixed(NamedTuple):
    """One fixed case; see the module docstring for what each use requires."""

    operation: str  # a name of conformance.contract.operations.OPERATIONS
    name: str
    use: str  # "example", "edge" or "error"
    build: Callable[[], Any]  # the case (stage "init": the constructor's keyword arguments)
    requires: str = ""  # the required result, in words
    requirements: tuple[Requirement, ...] = ()  # edge: checked besides the oracle
    error: type[Exception] | None = None  # error: the exception type every backend raises
    contains: tuple[str, ...] = ()  # error: words its message contains
    stage: str = "call"  # error: "call", "init" or "pullback"
    d_out: np.ndarray | None = None  # error at stage "pullback": the cotangent


def example(operation: str, name: str, build: Callable[[], Any], requires: str) -> Fixed:
    return Fixed(operation, name, use="example", build=build, requires=requires)


def edge(operation: str, name: str, build: Callable[[], Any], requires: str, *requirements: Requirement) -> Fixed:
    return Fixed(operation, name, use="edge", build=build, requires=requires, requirements=requirements)


def error(operation: str, name: str, build: Callable[[], Any], raises: type[Exception], *contains: str,
          stage: str = "call", d_out: np.ndarray | None = None) -> Fixed:
    return Fixed(operation, name, use="error", build=build, error=raises, contains=contains, stage=stage, d_out=d_out)


def _small_variance(*shape: int, seed: int) -> np.ndarray:
    """c + SMALL * N(0, 1), c ~ N(0, 1) per row: (..., L, 1) + (..., L, D)."""
    return normal(*shape[:-1], 1, seed=seed) + SMALL * normal(*shape, seed=seed + 1)


def _integers(x: np.ndarray) -> np.ndarray:
    return np.round(3 * x).astype(np.int64)


def _broken_entries(state: dict, prefix: str) -> dict:
    """Without w_k.bias, with an unexpected entry and w_v.weight of the wrong shape: one error names all three."""
    state = {name: value for name, value in state.items() if name != f"{prefix}w_k.bias"}
    width = state[f"{prefix}w_q.weight"].shape[0]
    return state | {f"{prefix}w_x.weight": np.zeros((width, width)),
                    f"{prefix}w_v.weight": np.zeros((width, width - 1))}


def _with_state(make: Callable[[], Any], change: Callable[[dict], dict]) -> Callable[[], Any]:
    """`make`'s case with `change` applied to its state dict."""
    return lambda: (case := make())._replace(state=change(case.state))


def _without(state: dict, *names: str) -> dict:
    return {name: value for name, value in state.items() if name not in names}


def _in(dtype: str, state: dict, name: str) -> dict:
    return state | {name: state[name].astype(dtype)}


# --- sdpa --------------------------------------------------------------------------------------------------

def _sdpa_examples() -> list[Fixed]:
    hide_first = changed(np.tri(3, 3, dtype=bool), (0, 0), False)
    return [
        example("sdpa", "one_query_one_key", lambda: sdpa_case((), 1, 1, Ev=4),
                "L = S = 1: the single weight is 1, out = v"),
        example("sdpa", "whole_batch_masked", lambda: sdpa_case(mask=np.zeros((2, 3, 4), bool)), "zeros"),
        example("sdpa", "bias_hides_every_key", lambda: sdpa_case(bias=np.full((3, 4), -np.inf)), "zeros"),
        example("sdpa", "one_visible_key", lambda: sdpa_case((), 4, 5, mask=np.array([0, 0, 1, 0, 0]), scale=1.0),
                "out = v_2"),
        example("sdpa", "all_visible_integer_mask", lambda: sdpa_case((2, 3), mask=np.ones((2, 3, 3, 4), np.int64)),
                "as no mask"),
        example("sdpa", "causal_more_queries", lambda: sdpa_case(L=5, S=3, is_causal=True),
                "queries 2..4 see every key"),
        example("sdpa", "causal_more_keys", lambda: sdpa_case(L=2, S=5, is_causal=True),
                "keys 2..4 hidden from every query"),
        example("sdpa", "causal_and_mask_hide_a_row", lambda: sdpa_case((), 3, 3, mask=hide_first, is_causal=True),
                "query 0 sees no key"),
        example("sdpa", "one_key_causal", lambda: sdpa_case((), 4, 1, bias=normal(4, 1), is_causal=True, scale=0.37),
                "S = 1, causal: every query sees key 0"),
        example("sdpa", "logits_in_the_hundreds", lambda: sdpa_case(
            L=5, S=5, E=4, Ev=1, q=LARGE * normal(2, 5, 4), k=LARGE * normal(2, 5, 4, seed=1), scale=2.5),
            "the row maximum must be subtracted"),
        example("sdpa", "mask_and_bias_add_the_batch", lambda: sdpa_case(
            (), v=normal(2, 4, 3), mask=random_mask(2, 1, 4), bias=normal(2, 3, 4)),
            "q, k shared; v, mask and bias give the batch axis"),
        example("sdpa", "values_add_the_batch", lambda: sdpa_case((), v=normal(2, 4, 3)),
                "q, k shared, no mask: v alone gives the batch axis, so the weights are (2, L, S), one per element"),
        example("sdpa", "leading_axes_broadcast", lambda: sdpa_case(
            q=normal(2, 1, 3, 2), k=normal(4, 4, 2), v=normal(1, 4, 4, 3), is_causal=True),
            "leading axes (2, 1), (4,), (1, 4) broadcast to (2, 4)"),
        example("sdpa", "rank_one_mask", lambda: sdpa_case((2, 3), E=2, Ev=2, mask=np.array([1, 0, 1, 1], bool)),
                "mask (S,) broadcasts to (B, H, L, S)"),
        example("sdpa", "rank_one_bias", lambda: sdpa_case((2, 3), E=2, Ev=2, bias=changed(normal(4), 2, -np.inf)),
                "bias (S,) broadcasts to (B, H, L, S)"),
        example("sdpa", "long_sequences", lambda: sdpa_case(
            (2,), 65, 129, E=4, mask=random_mask(2, 65, 129), bias=LONG_BIAS * normal(65, 129)),
            "L = 65, S = 129: past every tile of 16, 32, 64 or 128 keys, by one; the row maximum anywhere"),
        example("sdpa", "mask_rows_are_queries_when_L_equals_B", lambda: sdpa_case(
            (2,), 2, 3, mask=np.array([[True, False, True], [False, True, True]])),
            "q (B, L, E) with L = B = 2, mask (L, S): query 0 of each sequence sees keys 0, 2, query 1 keys 1, 2 "
            "(a (B, S) key-padding mask would give sequence 0 keys 0, 2 and sequence 1 keys 1, 2)"),
        example("sdpa", "visible_scores_near_minus_1e5", _far_below_fill(-1e5),
                "every visible score about -1e5, a hidden key in every row: a masked fill above -1e5 wins"),
        *_positions_examples(),
        *_per_head_examples(),
    ]


def _positions_examples() -> list[Fixed]:
    """SPEC 2a: positions, windows, key lengths and soft-capping (rows a module without them fails)."""
    hide_key_1 = changed(normal(3, 4, seed=9), (ALL, 1), -np.inf)  # (L, S)
    return [
        example("sdpa", "causal_bottom_right", lambda: sdpa_case(L=2, S=5, is_causal=True, q_offset=3),
                "q_offset = S - L: query i sees keys 0..i + 3 (a cache of 3 earlier keys)"),
        example("sdpa", "sliding_window_causal", lambda: sdpa_case((), 6, 6, is_causal=True, window=(2, 0)),
                "window (2, 0) with causal: query i sees keys i - 2..i (Mistral)"),
        example("sdpa", "window_past_the_keys", lambda: sdpa_case(L=4, S=3, window=(0, 1), q_offset=-2),
                "window (0, 1), q_offset -2: query 0 sees no key, query 3 keys 1, 2"),
        example("sdpa", "offset_per_sequence", lambda: sdpa_case(is_causal=True, q_offset=np.array([-1, 2])),
                "q_offset [-1, 2]: query 0 of sequence 0 sees no key, sequence 1 sees every key"),
        example("sdpa", "key_lengths_zero_for_one_sequence", lambda: sdpa_case(
            key_lengths=np.array([0, 2]), bias=normal(3, 4, seed=9)),
            "key_lengths [0, 2]: sequence 0 sees no key (zeros), every query of sequence 1 keys 0, 1"),
        example("sdpa", "softcap_saturated_with_neg_inf_bias", lambda: sdpa_case(
            L=3, S=4, q=LARGE * normal(2, 3, 2), k=LARGE * normal(2, 4, 2, seed=1), softcap=1.0, bias=hide_key_1),
            "logits in the hundreds capped at +-1, then the bias: key 1 (-inf) stays hidden"),
        example("sdpa", "grouped_query_heads", lambda: _grouped(4, 2, is_causal=True, mask=random_mask(4, 3, 5)),
                "H = 4 query heads, Hkv = 2: heads 0, 1 read key/value head 0, heads 2, 3 head 1 (h // G, G = 2); "
                "a mask per query head, causal"),
        example("sdpa", "multi_query_offset_per_head", lambda: _grouped(
            3, 1, q_offset=np.array([0, 2, 5]), window=(1, None), bias=normal(3, 1, 5, seed=4)),
            "Hkv = 1 for H = 3 heads, each head its own q_offset [0, 2, 5] and a bias, window (1, None) without "
            "is_causal, where its unbounded right side matters (a None read as 0 hides the later keys): query i "
            "of head h sees keys q_offset[h] + i - 1 to 4; head 2 sees key 4 from query 0, no key from 1 and 2"),
        example("sdpa", "grouped_heads_positions_per_query_head", lambda: _grouped(
            4, 2, batch=(), L=2, S=4, Ev=2, is_causal=True, q_offset=np.array([0, 2, -1, 1]),
            key_lengths=np.array([4, 1, 3, 2])),
            "H = 4 query heads on Hkv = 2, q_offset [0, 2, -1, 1] and key_lengths [4, 1, 3, 2] per query head, "
            "causal: query head h takes entry h (heads 1 and 2, of different groups, swap if (..., H) is split as "
            "(G, Hkv)); head 1 sees key 0 alone, head 2 query 0 no key"),
    ]


def _per_head_examples() -> list[Fixed]:
    """SPEC 2h and 2i: sinks and ALiBi's slopes, one value per head (in tiles of 2 x 3 as flash's rows too)."""
    return [
        example("sdpa", "sinks_per_head_one_hidden", lambda: sdpa_case(
            (2, 3), 4, 7, is_causal=True, q_offset=-1, sinks=np.array([2.0, -np.inf, -1.0])),
            "sinks [2, -inf, -1] on H = 3 heads, causal at q_offset -1: each row's softmax takes exp(sink) in its "
            "denominator (head 1 none); query 0 sees no key: zeros, its lse the sink"),
        example("sdpa", "alibi_per_sequence_keys_both_sides", lambda: sdpa_case(
            (2, 2), 3, 7, q_offset=4, alibi_slopes=np.array([[0.5, 0.0625], [1.0, 0.0]])),
            "ALiBi slopes (B, H) at q_offset 4, not causal: query i at position 4 + i takes slope |4 + i - j| off "
            "key j's score, keys before and after it alike; a slope of 0 is no bias"),
    ]


def _grouped(H: int, Hkv: int, *, batch: tuple[int, ...] = (2,), L: int = 3, S: int = 5, Ev: int = 3,
             **fields: Any) -> Any:
    """enable_gqa: q (..., H, L, 2), k (..., Hkv, S, 2), v (..., Hkv, S, Ev); by default q (2, H, 3, 2)."""
    case = sdpa_case((*batch, H), L, S, Ev=Ev, **fields)
    return case._replace(k=case.k[..., :Hkv, :, :], v=case.v[..., :Hkv, :, :], enable_gqa=True)


LONG_BIAS = 3.0  # spreads the scores of a long row, so its weights are not all about 1 / S


def _far_below_fill(offset: float) -> Callable[[], Any]:
    """scale 0, so the scores are the bias exactly: offset + k / 8 (representable in float32 near -1e5 and
    in float64 near -2^40), and key 1 hidden in every row; the weights are those of the k / 8 alone."""
    def build() -> Any:
        steps = np.round(8 * normal(2, 3, 4, seed=8)) / 8  # (B, L, S), multiples of 1 / 8
        return sdpa_case(bias=offset + steps, mask=changed(np.ones((3, 4), bool), (ALL, 1), False), scale=0.0)
    return build


def _far_below_fill_mha() -> Any:
    """MHA whose every visible score is -2^40 + a multiple of 1 / 8, exactly: D = 2 in H = 2 heads of d_k = 1
    (scale 1), w_q = 0 with bias 1 (every query 1), w_k the identity without bias (the scores are the keys'
    inputs), key 1 hidden; the weights are those of the multiples of 1 / 8 alone, and a masked fill constant
    (-1e9, say) that outweighs them puts every query on the hidden key."""
    case = mha_case((2,), 3, 4, D=2, H=2)
    steps = np.round(8 * normal(2, 4, 2, seed=8)) / 8  # (B, S, D), multiples of 1 / 8
    identity, zeros = np.eye(2), np.zeros(2)
    state = {"w_q.weight": np.zeros((2, 2)), "w_q.bias": np.ones(2), "w_k.weight": identity, "w_k.bias": zeros,
             "w_v.weight": identity, "w_v.bias": zeros, "w_o.weight": identity, "w_o.bias": zeros}
    return case._replace(state=state, k=-(2.0**40) + steps, mask=np.array([True, False, True, True]))


def _sdpa_edges() -> list[Fixed]:
    base = sdpa_case()  # q (B, L, E), k (B, S, E), v (B, S, Ev): B = 2, L = 3, S = 4, E = 2, Ev = 3
    heads = sdpa_case((2, 2), Ev=2)  # (B, H, L, E) with Ev = E, as heads are: torch's fused kernels
    bias = normal(2, 3, 4, seed=5)  # (B, L, S)
    return [
        edge("sdpa", "fully_masked_rows", lambda: base._replace(
            mask=changed(changed(random_mask(2, 3, 4), (0, 0), False), (1, 2), False)),
            "rows (0, 0) and (1, 2) see no key: out and weights rows exactly 0; the others as the oracle",
            *(Requirement(name, "zero", index=row) for name in ("out", "weights") for row in ((0, 0), (1, 2))),
            Requirement("weights", "sums_to_one", index=(0, slice(1, 3)))),
        edge("sdpa", "fully_masked_head", lambda: heads._replace(mask=np.array([True, False])[:, None, None]),
             "q (B, H, L, E), mask (H, 1, 1) hides head 1: out[:, 1] and weights[:, 1] exactly 0",
             Requirement("out", "zero", index=(ALL, 1)), Requirement("weights", "zero", index=(ALL, 1))),
        edge("sdpa", "fully_masked_batch_element", lambda: base._replace(
            mask=changed(random_mask(2, 3, 4), 1, False)),
            "batch element 1 sees no key: out[1] and weights[1] exactly 0; element 0 as the oracle",
            Requirement("out", "zero", index=(1,)), Requirement("weights", "zero", index=(1,))),
        edge("sdpa", "no_keys", lambda: sdpa_case(S=0, mask=np.ones((1, 0), bool)),
             "S = 0: out zeros (B, L, Ev), weights (B, L, 0)",
             Requirement("out", "zero"), Requirement("out", "shape", value=(2, 3, 3)),
             Requirement("weights", "shape", value=(2, 3, 0))),
        edge("sdpa", "no_queries", lambda: sdpa_case(L=0, is_causal=True), "L = 0: out (B, 0, Ev), weights (B, 0, S)",
             Requirement("out", "shape", value=(2, 0, 3)), Requirement("weights", "shape", value=(2, 0, 4))),
        edge("sdpa", "single_key", lambda: sdpa_case(S=1, bias=np.full((3, 1), 0.7)),
             "S = 1: weights 1, out = v[..., 0, :] on every row",
             Requirement("out", "equals", value=first_value), Requirement("weights", "one")),
        edge("sdpa", "logits_in_the_thousands", _large_sdpa,
             "logits +-5000 (+ O(1)): finite, as the oracle (no overflow, no 0 / 0)",
             Requirement("out", "finite"), Requirement("weights", "sums_to_one")),
        edge("sdpa", "nan_in_query", lambda: heads._replace(q=changed(heads.q, (0, 1, 1), np.nan)),
             "q (B, H, L, E), q[0, 1, 1] NaN: out and weights row (0, 1, 1) NaN; every other row as the oracle",
             Requirement("out", "only_nan", index=(0, 1, 1)), Requirement("weights", "only_nan", index=(0, 1, 1))),
        # causal: query i sees keys 0..i, so key 2 reaches query 2 alone (whose hidden key 3 may read NaN)
        edge("sdpa", "nan_in_key", lambda: base._replace(k=changed(base.k, (0, 2), np.nan), is_causal=True),
             "k[0, 2] NaN, causal: rows (0, 2) NaN; rows (0, 0), (0, 1), which do not see key 2, and batch "
             "element 1 as the oracle",
             Requirement("out", "only_nan", index=(0, 2)), Requirement("weights", "nan", index=(0, 2, slice(0, 3))),
             Requirement("weights", "finite", index=(0, slice(0, 2))), Requirement("weights", "finite", index=(1,))),
        edge("sdpa", "nan_in_value", lambda: base._replace(v=changed(base.v, (0, 1, 2), np.nan)),
             "v[0, 1, 2] NaN, every key visible: out[0, :, 2] NaN; every other entry and the weights as the oracle",
             Requirement("out", "only_nan", index=(0, ALL, 2)), Requirement("weights", "finite")),
        # bias[0, 2, 0] is NaN too, but the mask hides key 0 from query (0, 2): that row stays finite
        edge("sdpa", "nan_in_bias", lambda: base._replace(
            bias=changed(changed(bias, (0, 1, 3), np.nan), (0, 2, 0), np.nan),
            mask=changed(np.ones((2, 3, 4), bool), (0, 2, 0), False)),
            "bias[0, 1, 3] NaN (visible): row (0, 1) NaN; bias[0, 2, 0] NaN but hidden by the mask: row (0, 2) "
            "finite; every other row as the oracle",
            Requirement("out", "only_nan", index=(0, 1)), Requirement("weights", "only_nan", index=(0, 1))),
        # q[0, 0] = +inf against k[:, 0] = -1: every score of row 0 is -inf, from the inputs, not the bias
        edge("sdpa", "neg_inf_scores_from_the_inputs", lambda: sdpa_case(
            (), 2, 3, q=changed(normal(2, 2), (0, 0), np.inf), k=changed(normal(3, 2, seed=1), (ALL, 0), -1.0)),
            "q[0, 0] = +inf, k[:, 0] = -1: every score of row 0 is -inf, which hides nothing (only a -inf bias "
            "hides a key): out and weights row 0 NaN, never the zeros of a fully masked row; row 1 as the oracle",
            Requirement("out", "only_nan", index=0), Requirement("weights", "only_nan", index=0)),
        edge("sdpa", "visible_scores_below_minus_1e9", _far_below_fill(-2.0**40),
             "every visible score about -1.1e12, key 1 hidden in every row: the weights of the visible keys as "
             "the oracle, never a masked fill constant (-1e9, The Annotated Transformer's) that outweighs them",
             Requirement("weights", "zero", index=(ALL, ALL, 1)), Requirement("weights", "sums_to_one")),
        # +inf - max = inf - inf = NaN: never the finite one-hot limit
        edge("sdpa", "key_lengths_zero", lambda: base._replace(key_lengths=np.array([3, 0]), is_causal=True),
             "key_lengths [3, 0]: batch element 1 sees no key, out[1] and weights[1] exactly 0; key 3 of element "
             "0 hidden (SPEC 2a)", Requirement("out", "zero", index=(1,)), Requirement("weights", "zero", index=(1,)),
             Requirement("weights", "zero", index=(0, ALL, 3))),
        edge("sdpa", "softcap_keeps_neg_inf_bias_hidden", lambda: base._replace(
            bias=changed(np.zeros((3, 4)), (ALL, 2), -np.inf), softcap=0.5),
            "softcap 0.5, bias -inf on key 2: weights[..., 2] exactly 0 (capped before the bias, SPEC 2a)",
            Requirement("weights", "zero", index=(ALL, ALL, 2)), Requirement("weights", "sums_to_one")),
        edge("sdpa", "grouped_heads_one_fully_masked", lambda: _grouped(
            4, 2, mask=changed(np.ones((4, 1, 5), bool), (1,), False)),
            "enable_gqa, H = 4, Hkv = 2, query head 1 sees no key: out[:, 1] and weights[:, 1] exactly 0; the "
            "other head of its group, 0, as the oracle", Requirement("out", "zero", index=(ALL, 1)),
            Requirement("weights", "zero", index=(ALL, 1)), Requirement("weights", "sums_to_one", index=(ALL, 0))),
        edge("sdpa", "inf_score", lambda: heads._replace(bias=changed(np.zeros((3, 4)), (1, 0), np.inf)),
             "q (B, H, L, E), bias (L, S), bias[1, 0] = +inf (visible): out rows (:, :, 1) NaN or inf, never "
             "finite; weights rows (:, :, 1) hold NaN or inf; every other row as the oracle",
             Requirement("out", "only_nan_or_inf", index=(ALL, ALL, 1))),
    ]


def _large_sdpa() -> Any:
    """logits q_i . k_j = +-5000 + O(1): rows 0, 1 near +5000 (exp overflows without the row maximum),
    rows 2, 3 near -5000 (exp underflows to 0 / 0)."""
    a = np.sqrt(5000.0)
    sign = np.array([1.0, 1.0, -1.0, -1.0])[:, None]  # (L, 1)
    q = np.concatenate([np.broadcast_to(a * sign, (2, 4, 1)), normal(2, 4, 2, seed=4)], axis=-1)  # (B, L, E)
    k = np.concatenate([np.full((2, 5, 1), a), normal(2, 5, 2, seed=4)], axis=-1)  # (B, S, E)
    return sdpa_case(q=q, k=k, v=normal(2, 5, 3, seed=4), scale=1.0)


FLOAT_MASK = np.array([[1.0, 0.5, 0.0, 1.0, 1.0]])  # (1, S): 0.5 is neither "hide" nor "keep"


def _sdpa(**fields: Any) -> Callable[[], Any]:
    """Good q (2, 3, 4), k (2, 5, 4), v (2, 5, 3), changed by `fields`: the mistake."""
    return lambda: sdpa_case((2,), 3, 5, E=4, Ev=3, **fields)


def _unbatched_sdpa(**fields: Any) -> Callable[[], Any]:
    """q (3, 4), k (5, 4), v (5, 3), changed by `fields`."""
    return lambda: sdpa_case((), 3, 5, E=4, Ev=3, **fields)


def _sdpa_errors() -> list[Fixed]:
    good = _sdpa()()
    return [
        error("sdpa", "q_k_widths_differ", _sdpa(k=normal(2, 5, 3)), ValueError, "q", "k", "(2, 3, 4)", "(2, 5, 3)"),
        error("sdpa", "k_v_lengths_differ", _sdpa(v=normal(2, 4, 3)), ValueError, "k", "v", "(2, 5, 4)", "(2, 4, 3)"),
        error("sdpa", "rank_below_2", _unbatched_sdpa(q=normal(4)), ValueError, "q", "(4,)"),
        error("sdpa", "leading_axes_do_not_broadcast", lambda: sdpa_case((3,), 3, 5, E=4, Ev=3, q=normal(2, 3, 4)),
              ValueError, "broadcast", "(2, 3, 4)", "(3, 5, 4)"),
        error("sdpa", "mask_does_not_broadcast", _sdpa(mask=np.ones((4, 5), bool)), ValueError,
              "mask", "(4, 5)", "(2, 3, 5)"),
        error("sdpa", "mask_adds_a_batch_axis", _unbatched_sdpa(mask=np.ones((2, 3, 5), bool)), ValueError,
              "mask", "(2, 3, 5)", "(3, 5)"),
        error("sdpa", "bias_does_not_broadcast", _sdpa(bias=np.zeros((3, 4))), ValueError, "bias", "(3, 4)",
              "(2, 3, 5)"),
        error("sdpa", "bias_adds_a_batch_axis", _unbatched_sdpa(bias=np.zeros((2, 3, 5))), ValueError,
              "bias", "(2, 3, 5)", "(3, 5)"),
        error("sdpa", "float_mask_not_0_or_1", _sdpa(mask=FLOAT_MASK), ValueError, "mask", "bias"),
        error("sdpa", "integer_inputs", _sdpa(**{name: _integers(getattr(good, name)) for name in "qkv"}),
              TypeError, "q", "floating"),
        error("sdpa", "dtypes_differ", _sdpa(k=good.k.astype(np.float32)), TypeError, "float32", "float64"),
        error("sdpa", "zero_width_default_scale", lambda: sdpa_case((2,), 3, 5, E=0, Ev=3), ValueError,
              "E", "(2, 3, 0)", "(2, 5, 0)"),
        error("sdpa", "dropout_p_one", _sdpa(dropout=1.0), ValueError, "dropout_p"),
        error("sdpa", "dropout_p_negative", _sdpa(dropout=-0.1), ValueError, "dropout_p"),
        # SPEC 2a: a module without these keywords fails these rows (its TypeError names no dtype)
        error("sdpa", "window_negative", _sdpa(window=(-1, 0)), ValueError, "window"),
        error("sdpa", "softcap_zero", _sdpa(softcap=0.0), ValueError, "softcap"),
        error("sdpa", "softcap_negative", _sdpa(softcap=-1.0), ValueError, "softcap"),
        error("sdpa", "q_offset_float", _sdpa(q_offset=1.5), TypeError, "q_offset", "float"),
        error("sdpa", "q_offset_float_array", _sdpa(q_offset=np.array([1.0, 2.0])), TypeError, "q_offset", "float64"),
        error("sdpa", "key_lengths_float", _sdpa(key_lengths=np.array([2.0, 3.0])), TypeError, "key_lengths",
              "float64"),
        error("sdpa", "q_offset_does_not_broadcast", _sdpa(q_offset=np.array([1, 2, 3])), ValueError, "q_offset",
              "(3,)", "(2,)"),
        error("sdpa", "key_lengths_do_not_broadcast", _sdpa(key_lengths=np.array([[1, 2, 3]])), ValueError,
              "key_lengths", "(1, 3)", "(2,)"),
        error("sdpa", "gqa_heads_not_a_multiple", lambda: _grouped(3, 2), ValueError, "(2, 3, 3, 2)", "(2, 2, 5, 2)"),
        error("sdpa", "gqa_q_rank_below_3", _unbatched_sdpa(enable_gqa=True), ValueError, "enable_gqa", "q",
              "(3, 4)"),
        error("sdpa", "gqa_mask_per_key_value_head", lambda: _grouped(4, 2, mask=np.ones((2, 3, 5), bool)),
              ValueError, "mask", "(2, 3, 5)", "(2, 4, 3, 5)"),
        error("sdpa", "sinks_of_other_heads", _sdpa(sinks=np.zeros(3)), ValueError, "sinks", "(3,)", "(2,)"),
        error("sdpa", "alibi_slopes_of_other_heads", _sdpa(alibi_slopes=np.ones(3)), ValueError, "alibi_slopes",
              "(3,)", "(2,)"),
        error("sdpa", "alibi_slopes_scalar", _sdpa(alibi_slopes=np.ones(())), ValueError, "alibi_slopes", "()",
              "(2,)"),
        error("sdpa", "alibi_slopes_adds_an_axis", _sdpa(alibi_slopes=np.ones((1, 2))), ValueError, "alibi_slopes",
              "(1, 2)", "(2,)"),
        error("sdpa", "d_out_shape", _sdpa(), ValueError, "d_out", "(2, 3, 4)", "(2, 3, 3)", stage="pullback",
              d_out=np.zeros((2, 3, 4))),
        error("sdpa", "d_out_dtype", _sdpa(), TypeError, "d_out", "float32", "float64", stage="pullback",
              d_out=np.zeros((2, 3, 3), np.float32)),
    ]


# --- multi-head attention ----------------------------------------------------------------------------------

def _self_attention(case: Any) -> Any:
    return case._replace(k=case.q, v=case.q)


def _mha_examples() -> list[Fixed]:
    head_off = changed(np.ones((2, 2, 3, 3), bool), (ALL, 1), False)
    padding = np.arange(5) < np.reshape([5, 0], (2, 1, 1, 1))  # (B, 1, 1, S)
    return [
        example("mha", "one_head_fully_masked", lambda: _self_attention(mha_case(S=3, dropout=0.0, mask=head_off)),
                "head 1 sees no key: its output is zeros"),
        example("mha", "one_position_four_heads", lambda: _self_attention(mha_case((), 1, 1, D=8, H=4)),
                "L = S = 1, four heads, dropout configured"),
        example("mha", "cross_attention_one_sequence_padded", lambda: mha_case(dropout=0.0, mask=padding),
                "sequence 1 all padding"),
        example("mha", "long_cross_attention", lambda: mha_case(
            (), 65, 129, D=8, H=2, dropout=0.0, mask=random_mask(2, 65, 129)),
            "L = 65, S = 129, a mask per head: past every tile of keys, by one"),
        example("mha", "every_key_hidden_integer_mask", lambda: _self_attention(mha_case(
            D=2, H=1, S=3, dropout=0.5, mask=np.zeros((1, 1), np.int32))), "out = w_o.bias"),
        example("mha", "one_kv_head", lambda: mha_case(D=8, H=4, num_kv_heads=1, mask=random_mask(2, 4, 3, 5)),
                "multi-query: w_k, w_v (2, 8), every query head reads the one key/value head, a mask per head"),
        example("mha", "grouped_without_bias", lambda: mha_case(D=8, H=4, num_kv_heads=2, bias=False, dropout=0.0),
                "Hkv = 2 of H = 4, no biases: query heads 0, 1 read key/value head 0, heads 2, 3 head 1"),
        example("mha", "rope_cross_attention", lambda: mha_case(D=8, H=2, num_kv_heads=1, rope_theta=10.0,
                                                                mask=random_mask(2, 2, 3, 5)),
                "RoPE (d_k = 4, two pairs, theta 10): queries turned at positions 0..2, keys at 0..4"),
        example("mha", "linear_grouped_rope_cross_attention", lambda: mha_case(
            D=16, H=4, num_kv_heads=2, rope_theta=10.0, attention="linear", dropout=0.0),
            "linear heads (phi = elu + 1, eps 1e-6), Hkv = 2 of H = 4, RoPE (d_k = 4, theta 10), L = 3, S = 5: "
            "no weights (None)"),
        example("mha", "causal_linear_heads", lambda: mha_case(
            L=5, S=5, D=8, H=4, num_kv_heads=2, attention="linear", dropout=0.0, is_causal=True),
            "linear heads with is_causal, Hkv = 2 of H = 4, L = S = 5: each head's query i reads the prefix sums "
            "over keys 0..i, never the whole sequence"),
        example("mha", "sinks_and_alibi_three_heads", lambda: _with_sinks(mha_case(
            L=4, S=6, D=6, H=3, dropout=0.0, position="alibi", mask=random_mask(2, 3, 4, 6)), [1.5, -2.0, 0.5]),
            "sinks=True (the state's sinks (3,), one per head, each its own) and ALiBi with H = 3, not a power of "
            "two: slopes 2^-4, 2^-8, then 2^-2 of six heads' sequence; cross-attention, L = 4, S = 6, a mask per head"),
    ]


def _with_sinks(case: Any, sinks: list[float]) -> Any:
    """`case` with MultiHeadAttention's sinks (H,) in its state (sinks=True)."""
    return case._replace(state=case.state | {"sinks": np.array(sinks)})


def _mha_edges() -> list[Fixed]:
    base = mha_case()  # D = 4, H = 2, q (2, 3, 4), k and v (2, 5, 4)
    return [
        edge("mha", "fully_masked_rows", lambda: mha_case(
            mask=changed(changed(random_mask(2, 1, 3, 5), (0, 0, 1), False), (1, 0, 0), False)),
            "queries (0, 1) and (1, 0) see no key in any head: their weights rows exactly 0, out rows w_o.bias",
            Requirement("out", "equals", index=(0, 1), value=w_o_bias),
            Requirement("out", "equals", index=(1, 0), value=w_o_bias),
            Requirement("weights", "zero", index=(0, ALL, 1)), Requirement("weights", "zero", index=(1, ALL, 0))),
        edge("mha", "fully_masked_head", lambda: mha_case(mask=np.array([True, False])[:, None, None]),
             "mask (H, 1, 1) hides head 1: weights[:, 1] exactly 0, out as the oracle",
             Requirement("weights", "zero", index=(ALL, 1)), Requirement("weights", "sums_to_one", index=(ALL, 0))),
        edge("mha", "fully_masked_batch_element", lambda: mha_case(
            mask=np.arange(5) < np.reshape([3, 0], (2, 1, 1, 1))),
             "padding lengths [3, 0]: weights[1] exactly 0, out[1] = w_o.bias on every row",
             Requirement("out", "equals", index=(1,), value=w_o_bias), Requirement("weights", "zero", index=(1,))),
        edge("mha", "no_keys", lambda: mha_case(S=0), "S = 0: weights (B, H, L, 0), out = w_o.bias on every row",
             Requirement("out", "equals", value=w_o_bias), Requirement("weights", "shape", value=(2, 2, 3, 0))),
        edge("mha", "linear_no_keys", lambda: mha_case(S=0, attention="linear", dropout=0.0),
             "S = 0, linear heads: each head 0 / (0 + eps) = 0, out = w_o.bias on every row, weights None",
             Requirement("out", "equals", value=w_o_bias)),
        edge("mha", "no_queries", lambda: mha_case(L=0), "L = 0: out (B, 0, D), weights (B, H, 0, S)",
             Requirement("out", "shape", value=(2, 0, 4)), Requirement("weights", "shape", value=(2, 2, 0, 5))),
        edge("mha", "single_key", lambda: mha_case(S=1),
             "S = 1: weights 1, out the projected value mixed by w_o, as the oracle", Requirement("weights", "one")),
        edge("mha", "logits_in_the_thousands", _large_mha, "self-attention logits up to +-5000: finite, as the oracle",
             Requirement("out", "finite"), Requirement("weights", "sums_to_one")),
        edge("mha", "nan_in_query", lambda: base._replace(q=changed(base.q, (0, 1), np.nan)),
             "q[0, 1] NaN: out row (0, 1) and its weights rows NaN; every other row as the oracle",
             Requirement("out", "only_nan", index=(0, 1)), Requirement("weights", "only_nan", index=(0, ALL, 1))),
        # causal mask (3, 5): key 1 reaches queries 1 and 2 of sequence 0
        edge("mha", "nan_in_key", lambda: base._replace(k=changed(base.k, (0, 1), np.nan),
                                                       mask=np.tri(3, 5, dtype=bool)),
             "k[0, 1] NaN, causal mask: rows (0, 1), (0, 2) NaN; row (0, 0), which does not see key 1, and batch "
             "element 1 as the oracle", Requirement("out", "only_nan", index=(0, slice(1, 3)))),
        edge("mha", "inf_in_query", lambda: base._replace(q=changed(base.q, (1, 2), np.inf)),
             "q[1, 2] = +inf: out row (1, 2) NaN or inf, never finite; every other row as the oracle",
             Requirement("out", "only_nan_or_inf", index=(1, 2))),
        edge("mha", "visible_scores_below_minus_1e9", _far_below_fill_mha,
             "every visible score about -1.1e12, key 1 hidden: the weights of the visible keys as the oracle, never "
             "a masked fill constant (-1e9) that outweighs them", Requirement("weights", "zero",
                                                                              index=(ALL, ALL, ALL, 1))),
    ]


def _large_inputs(state: dict, x: np.ndarray, heads: int, prefix: str = "") -> np.ndarray:
    """x scaled so that the largest attention logit |q_h . k_h| / sqrt(d_k) of self-attention is 5000."""
    d_model = x.shape[-1]

    def project(name: str) -> np.ndarray:
        y = x @ state[f"{prefix}{name}.weight"].T  # (..., L, D)
        return y.reshape(*y.shape[:-1], heads, d_model // heads)  # (..., L, H, d_k)
    logits = np.einsum("...ihd,...jhd->...hij", project("w_q"), project("w_k")) / np.sqrt(d_model // heads)
    return x * np.sqrt(5000.0 / np.max(np.abs(logits)))  # biases are O(1): logits scale as the square


def _large_mha() -> Any:
    case = mha_case(L=4, S=4)
    x = _large_inputs(case.state, case.q, case.num_heads)
    return case._replace(q=x, k=x, v=x)


def _mha(**fields: Any) -> Callable[[], Any]:
    """A MultiHeadAttention state (D = 4, H = 2, float64, dropout 0), q (2, 3, 4), k and v (2, 5, 4),
    changed by `fields`."""
    return lambda: mha_case(**({"dropout": 0.0, "seed": 0} | fields))


def _mha_errors() -> list[Fixed]:
    return [
        error("mha", "input_width_not_d_model", _mha(k=normal(2, 5, 3)), ValueError, "k", "(2, 5, 3)", "4"),
        error("mha", "input_rank_below_2", _mha(q=normal(4)), ValueError, "q", "(4,)"),
        error("mha", "k_v_lengths_differ", _mha(v=normal(2, 4, 4)), ValueError, "k", "v", "same length"),
        error("mha", "leading_axes_do_not_broadcast", _mha(k=normal(3, 5, 4), v=normal(3, 5, 4)), ValueError,
              "broadcast"),
        error("mha", "mask_does_not_broadcast", _mha(mask=np.ones((3, 4), bool)), ValueError,
              "mask", "(3, 4)", "(2, 2, 3, 5)"),
        error("mha", "mask_adds_a_batch_axis", lambda: mha_case((), dropout=0.0, mask=np.ones((2, 1, 3, 5), bool)),
              ValueError, "mask", "(2, 1, 3, 5)", "(2, 3, 5)"),
        error("mha", "float_mask_not_0_or_1", _mha(mask=FLOAT_MASK), ValueError, "mask", "bias"),
        error("mha", "integer_input", _mha(q=_integers(normal(2, 3, 4))), TypeError, "q", "floating"),
        error("mha", "input_dtype_not_parameters", _mha(v=normal(2, 5, 4).astype(np.float32)), TypeError,
              "float32", "float64"),
        error("mha", "d_model_not_divisible", lambda: {"d_model": 6, "num_heads": 4}, ValueError, "d_model",
              "num_heads", stage="init"),
        error("mha", "d_model_zero", lambda: {"d_model": 0, "num_heads": 1}, ValueError, "d_model", stage="init"),
        error("mha", "num_heads_zero", lambda: {"d_model": 4, "num_heads": 0}, ValueError, "num_heads", stage="init"),
        error("mha", "dropout_one", lambda: {"d_model": 4, "num_heads": 2, "dropout": 1.0}, ValueError, "dropout",
              stage="init"),
        error("mha", "state_not_divisible", _mha(num_heads=3), ValueError, "d_model", "num_heads"),
        error("mha", "state_dropout_negative", _mha(dropout=-0.5), ValueError, "dropout"),
        error("mha", "state_entries", _with_state(_mha(), lambda state: _broken_entries(state, "")), ValueError,
              "w_k.bias", "w_x.weight", "w_v.weight"),
        error("mha", "num_kv_heads_not_dividing", lambda: {"d_model": 8, "num_heads": 4, "num_kv_heads": 3},
              ValueError, "num_kv_heads", "num_heads", stage="init"),
        error("mha", "num_kv_heads_zero", lambda: {"d_model": 8, "num_heads": 4, "num_kv_heads": 0},
              ValueError, "num_kv_heads", stage="init"),
        error("mha", "rope_theta_negative", lambda: {"d_model": 8, "num_heads": 2, "rope_theta": -1.0},
              ValueError, "rope_theta", "-1.0", stage="init"),
        error("mha", "rope_with_odd_head_width", lambda: {"d_model": 6, "num_heads": 2, "rope_theta": 10000.0},
              ValueError, "rope_theta", "6", "2", stage="init"),
        error("mha", "state_rope_with_odd_head_width", _mha(num_heads=4, rope_theta=10.0), ValueError,
              "rope_theta", "4"),
        error("mha", "linear_attention_with_a_mask", _mha(attention="linear", mask=np.ones((2, 2, 3, 5), bool)),
              ValueError, "mask", "linear"),
        error("mha", "linear_attention_with_dropout", lambda: {"d_model": 4, "num_heads": 2, "dropout": 0.1,
                                                               "attention": "linear"},
              ValueError, "dropout", "linear", stage="init"),
        error("mha", "state_linear_attention_with_dropout", _mha(attention="linear", dropout=0.1), ValueError,
              "dropout", "linear"),
        error("mha", "attention_unknown", lambda: {"d_model": 4, "num_heads": 2, "attention": "cosine"},
              ValueError, "attention", "cosine", stage="init"),
        error("mha", "sinks_with_linear_attention", lambda: {"d_model": 4, "num_heads": 2, "dropout": 0.0,
                                                             "attention": "linear", "sinks": True},
              ValueError, "sinks", "linear", stage="init"),
        error("mha", "state_sinks_with_linear_attention", _with_state(_mha(attention="linear"), lambda state: state | {
            "sinks": np.zeros(2)}), ValueError, "sinks", "linear"),
        error("mha", "state_sinks_of_other_heads", _with_state(_mha(), lambda state: state | {"sinks": np.zeros(3)}),
              ValueError, "sinks", "(3,)", "(2,)"),
        error("mha", "position_unknown", lambda: {"d_model": 4, "num_heads": 2, "position": "learned"},
              ValueError, "position", "learned", stage="init"),
        error("mha", "alibi_with_rope_theta", lambda: {"d_model": 8, "num_heads": 2, "rope_theta": 10.0,
                                                       "position": "alibi"},
              ValueError, "position", "alibi", "rope_theta", stage="init"),
        error("mha", "alibi_with_linear_attention", lambda: {"d_model": 4, "num_heads": 2, "dropout": 0.0,
                                                             "attention": "linear", "position": "alibi"},
              ValueError, "position", "alibi", "linear", stage="init"),
        error("mha", "state_alibi_with_rope_theta", _mha(rope_theta=10.0, position="alibi"), ValueError,
              "position", "alibi", "rope_theta"),
        error("mha", "state_partial_bias", _with_state(_mha(), lambda state: _without(state, "w_q.bias", "w_o.bias")),
              ValueError, "w_q.bias", "w_o.bias"),
        error("mha", "state_kv_rows_not_heads", _with_state(_mha(), lambda state: state | {
            "w_k.weight": np.zeros((3, 4)), "w_k.bias": np.zeros(3)}), ValueError, "w_k.weight", "(3, 4)"),
        error("mha", "state_dtypes_differ", _with_state(_mha(), lambda state: _in("float32", state, "w_o.bias")),
              TypeError, "float32", "float64"),
        error("mha", "d_out_shape", _mha(), ValueError, "d_out", "(2, 3, 5)", "(2, 3, 4)", stage="pullback",
              d_out=np.zeros((2, 3, 5))),
        error("mha", "d_out_dtype", _mha(), TypeError, "d_out", "float32", "float64", stage="pullback",
              d_out=np.zeros((2, 3, 4), np.float32)),
    ]


# --- the transformer block ---------------------------------------------------------------------------------

def _block_examples() -> list[Fixed]:
    row_off = changed(np.tri(4, 4, dtype=bool), 2, False)
    return [
        example("block", "llama_style", lambda: block_case(
            D=16, H=4, F=8, dropout=0.0, norm_first=True, norm="rms", activation="swiglu", bias=False, num_kv_heads=2,
            rope_theta=10000.0, mask=np.tri(4, 4, dtype=bool)),
            "pre-norm, RMSNorm, SwiGLU, no Linear biases, Hkv = 2 of H = 4, RoPE (d_k = 4, theta 10000), causal"),
        example("block", "post_rms_swiglu_with_bias", lambda: block_case(
            L=3, norm="rms", activation="swiglu", num_kv_heads=1, x=_small_variance(2, 3, 4, seed=8)),
            "post-norm RMSNorm, SwiGLU with biases, one key/value head, mean square ~1 (rows near a constant)"),
        example("block", "post_ln_row_fully_masked", lambda: block_case(
            dropout=0.0, activation="relu", mask=row_off), "query 2 fully masked: attention adds w_o.bias only"),
        example("block", "pre_ln_variance_below_eps", lambda: block_case(
            L=3, dropout=0.0, norm_first=True, eps=1e-3, x=_small_variance(2, 3, 4, seed=6)),
            "variance ~1e-6 far below eps 1e-3"),
        example("block", "post_ln_variance_near_eps", lambda: block_case(
            L=3, H=4, F=4, dropout=0.0, eps=1e-6, x=_small_variance(2, 3, 4, seed=7)),
            "variance ~1e-6 close to eps 1e-6"),
        example("block", "one_position", lambda: block_case((), 1, D=8, H=4, norm_first=True, activation="relu"),
                "L = 1: attention returns its projected value"),
        example("block", "every_row_fully_masked", lambda: block_case(
            L=3, D=2, H=1, F=4, dropout=0.5, activation="relu", mask=np.zeros((2, 1, 3, 3), bool)),
            "every row of every sequence fully masked"),
    ]


def _block_edges() -> list[Fixed]:
    base = block_case()  # D = 4, H = 2, x (2, 4, 4)
    return [
        edge("block", "fully_masked_rows", lambda: block_case(
            mask=changed(np.tri(4, 4, dtype=bool)[None, None].repeat(2, 0), (0, 0, 2), False)),
            "causal, and query (0, 2) sees no key: its weights rows exactly 0; out as the oracle",
            Requirement("out", "finite"), Requirement("weights", "zero", index=(0, ALL, 2))),
        edge("block", "fully_masked_head", lambda: block_case(mask=np.array([False, True])[:, None, None],
                                                              norm_first=True, activation="relu"),
             "pre-LN, mask (H, 1, 1) hides head 0: weights[:, 0] exactly 0; out as the oracle",
             Requirement("out", "finite"), Requirement("weights", "zero", index=(ALL, 0))),
        edge("block", "fully_masked_batch_element", lambda: block_case(
            mask=np.arange(4) < np.reshape([4, 0], (2, 1, 1, 1))),
            "padding lengths [4, 0]: weights[1] exactly 0; out as the oracle",
            Requirement("out", "finite"), Requirement("weights", "zero", index=(1,))),
        edge("block", "empty_sequence", lambda: block_case(L=0), "L = S = 0: out (B, 0, D), weights (B, H, 0, 0)",
             Requirement("out", "shape", value=(2, 0, 4)), Requirement("weights", "shape", value=(2, 2, 0, 0))),
        edge("block", "single_position", lambda: block_case(L=1, norm_first=True),
             "L = 1: weights 1; out as the oracle",
             Requirement("out", "finite"), Requirement("weights", "one")),
        edge("block", "logits_in_the_thousands", _large_block,
             "post-LN, attention logits up to +-5000: finite, as the oracle",
             Requirement("out", "finite"), Requirement("weights", "sums_to_one")),
        # self-attention without a mask: every query of sequence 0 sees key 1; LayerNorm spreads NaN along D
        edge("block", "nan_in_input", lambda: base._replace(x=changed(base.x, (0, 1), np.nan)),
             "x[0, 1] NaN: every row of batch element 0 NaN (each query sees key 1); element 1 as the oracle",
             Requirement("out", "only_nan", index=(0,)), Requirement("weights", "only_nan", index=(0,))),
        edge("block", "inf_in_input", lambda: base._replace(x=changed(base.x, (1, 0), np.inf)),
             "x[1, 0] = +inf: every row of batch element 1 NaN or inf, never finite; element 0 as the oracle",
             Requirement("out", "only_nan_or_inf", index=(1,))),
    ]


def _large_block() -> Any:
    case = block_case()
    return case._replace(x=_large_inputs(case.state, case.x, case.num_heads, "attn."))  # post-LN: attention sees x


def _block(**fields: Any) -> Callable[[], Any]:
    """A TransformerBlock state (D = 4, F = 8, H = 2, float64, ReLU, dropout 0), x (2, 3, 4), changed by
    `fields`."""
    return lambda: block_case(**({"L": 3, "seed": 0, "dropout": 0.0, "activation": "relu"} | fields))


def _block_errors() -> list[Fixed]:
    init = {"d_model": 4, "num_heads": 2, "d_ff": 8}
    return [
        error("block", "input_width_not_d_model", _block(x=normal(2, 3, 5)), ValueError, "x", "(2, 3, 5)", "4"),
        error("block", "input_rank_below_2", _block(x=normal(4)), ValueError, "x", "(4,)"),
        error("block", "mask_does_not_broadcast", _block(mask=np.ones((3, 4), bool)), ValueError,
              "mask", "(3, 4)", "(2, 2, 3, 3)"),
        error("block", "mask_adds_a_batch_axis", _block(x=normal(3, 4), mask=np.ones((2, 1, 3, 3), bool)),
              ValueError, "mask", "(2, 1, 3, 3)", "(2, 3, 3)"),
        error("block", "float_mask_not_0_or_1", _block(mask=np.array([[1.0, 0.5, 1.0]])), ValueError, "mask", "bias"),
        error("block", "integer_input", _block(x=_integers(normal(2, 3, 4))), TypeError, "x", "floating"),
        error("block", "input_dtype_not_parameters", _block(x=normal(2, 3, 4).astype(np.float32)), TypeError,
              "float32", "float64"),
        error("block", "d_model_not_divisible", lambda: init | {"d_model": 6, "num_heads": 4}, ValueError,
              "d_model", "num_heads", stage="init"),
        error("block", "d_ff_zero", lambda: init | {"d_ff": 0}, ValueError, "d_ff", stage="init"),
        error("block", "unknown_activation", lambda: init | {"activation": "tanh"}, ValueError, "activation", "tanh",
              stage="init"),
        error("block", "dropout_one", lambda: init | {"dropout": 1.0}, ValueError, "dropout", stage="init"),
        error("block", "state_unknown_activation", _block(activation="swish"), ValueError, "activation", "swish"),
        error("block", "unknown_norm", lambda: init | {"norm": "batch"}, ValueError, "norm", "batch", stage="init"),
        error("block", "num_kv_heads_not_dividing", lambda: init | {"num_kv_heads": 3}, ValueError, "num_kv_heads",
              "num_heads", stage="init"),
        error("block", "rope_theta_infinite", lambda: init | {"rope_theta": float("inf")}, ValueError, "rope_theta",
              stage="init"),
        error("block", "relu_with_a_swiglu_state", lambda: _block(activation="swiglu")()._replace(activation="relu"),
              ValueError, "activation", "'relu'", "ffn.w_gate"),
        error("block", "swiglu_with_an_ffn_0_state", lambda: _block()()._replace(activation="swiglu"),
              ValueError, "activation", "'swiglu'", "ffn.0"),
        error("block", "state_partial_bias", _with_state(_block(), lambda state: _without(state, "ffn.0.bias",
                                                                                          "attn.w_v.bias")),
              ValueError, "ffn.0.bias", "attn.w_v.bias"),
        error("block", "state_dropout_negative", _block(dropout=-0.5), ValueError, "dropout"),
        error("block", "state_entries", _with_state(_block(), lambda state: _broken_entries(state, "attn.")),
              ValueError, "attn.w_k.bias", "attn.w_x.weight", "attn.w_v.weight"),
        error("block", "state_dtypes_differ",
              _with_state(_block(), lambda state: _in("float32", state, "norm2.weight")), TypeError,
              "float32", "float64"),
        error("block", "d_out_shape", _block(), ValueError, "d_out", "(2, 3, 5)", "(2, 3, 4)", stage="pullback",
              d_out=np.zeros((2, 3, 5))),
        error("block", "d_out_dtype", _block(), TypeError, "d_out", "float32", "float64", stage="pullback",
              d_out=np.zeros((2, 3, 4), np.float32)),
    ]


def _decode_mask() -> np.ndarray:
    """(2, 2, 5, 8): about a third of the keys hidden, the rows of the two heads different; each query keeps a
    key up to its own position (key 0, or itself)."""
    mask = np.random.default_rng(4).random((2, 2, 5, 8)) >= 0.35  # (B, H, L, capacity)
    blind = ~np.any(mask & np.tri(5, 8, dtype=bool), axis=-1)  # (B, H, L): no key up to the query's position
    mask[..., np.arange(5), np.arange(5)] |= blind  # those see themselves
    return mask


def _paged(batch: int, chunks: tuple[int, ...], new_lengths: tuple[tuple[int, ...], ...], page: int, max_pages: int,
           num_pages: int, *, order: tuple[int, ...] | None = None, **fields: Any) -> Callable[[], DecodeCase]:
    """decode_case's block on `batch` sequences through a paged cache of these sizes, the pool's pages given in a
    shuffled order (or `order`), each chunk taking new_lengths."""
    shuffled = tuple(int(p) for p in np.random.default_rng(5).permutation(num_pages))
    paging = Paging(page_size=page, num_pages=num_pages, max_pages=max_pages, order=order or shuffled)
    return lambda: decode_case((batch,), chunks, page * max_pages, new_lengths=new_lengths, paging=paging, **fields)


def _decode_rows() -> list[Fixed]:
    """SPEC 3a: a block fed chunk by chunk through its key/value cache."""
    return [
        example("decode", "prefill_then_steps_with_room", lambda: decode_case((2,), (3, 1, 1), capacity=8),
                "a prefill of 3 positions, two decode steps, three positions of the cache left unfilled (weight 0)"),
        example("decode", "one_position_at_a_time_pre_ln", lambda: decode_case((), (1, 1, 1, 1), norm_first=True),
                "pre-LN, four steps of one position, the cache exactly full at the end"),
        example("decode", "llama_style_prefill_then_steps", lambda: decode_case(
            (2,), (3, 1, 2), capacity=7, D=16, H=4, norm_first=True, norm="rms", activation="swiglu", bias=False,
            num_kv_heads=2, rope_theta=10.0),
            "pre-norm RMSNorm SwiGLU block, Hkv = 2 of 4, RoPE (theta 10) at the positions in the whole sequence"),
        example("decode", "mask_rows_per_chunk", lambda: decode_case((2,), (3, 1, 1), capacity=8, mask=_decode_mask()),
                "a mask (2, 2, 5, 8) of the whole sequence, its rows differing by head: each extend gets its chunk's "
                "rows, hiding keys on top of causality, as one pass with causal_mask(5, 5) & the mask"),
        example("decode", "cross_attention_prefill_then_steps", lambda: decode_case(
            (2,), (3, 1, 1), capacity=8, x_kv=normal(2, 5, 4, seed=3), mask=np.arange(8) != 1),
            "MultiHeadAttention.extend(x_q, x_kv, cache) of the block's attention, x_kv another input: the keys "
            "and values of x_kv, the queries of x_q; a mask (8,) hiding key 1 from every query"),
        example("decode", "ragged_chunks", lambda: decode_case(
            (2,), (3, 1, 1), capacity=5, new_lengths=((3, 1), (1, 0), (0, 1)), x_kv=normal(2, 5, 4, seed=3)),
            "two sequences of 4 and 2 positions in one contiguous cache: each chunk a length per sequence, its other "
            "rows padding (zeros); cross-attention's x_kv cut alike"),
        example("decode", "paged_pages_shuffled_and_reused", _paged(
            3, (3, 1), ((3, 1, 2), (1, 0, 1)), page=2, max_pages=2, num_pages=7, D=16, H=4,
            norm_first=True, norm="rms", activation="swiglu", bias=False, num_kv_heads=2, rope_theta=10.0),
            "a Llama block on 3 sequences of 4, 1 and 3 positions through pages of 2 given in a shuffled order, NaN "
            "in every unused slot; sequence 1 released after its prefill and its page reused by sequence 2: each "
            "sequence's outputs those of its own rows alone"),
        example("decode", "streaming_sinks_and_a_turning_ring", lambda: decode_case(
            (2,), (3, 1, 2, 1, 1), capacity=5, D=16, H=4, norm_first=True, norm="rms", activation="swiglu", bias=False,
            num_kv_heads=2, rope_theta=10.0, streaming=Streaming(sink_tokens=2, window=3)),
            "a Llama block decoding 8 positions through a streaming cache of 2 sinks and a window of 3 in its 5 slots "
            "(capacity 5), chunks of up to 3: one pass with the mask j < 2 or p - 3 < j <= p, RoPE at the original "
            "positions, the weights in the cache's order (the sinks, then the window oldest first)"),
        example("decode", "streaming_rope_at_places_in_the_cache", lambda: decode_case(
            (2,), (2, 1, 3, 1), capacity=6, D=8, rope_theta=10.0, x_kv=normal(2, 7, 8, seed=3),
            streaming=Streaming(sink_tokens=1, window=3, rope_positions="cache")),
            "MultiHeadAttention.extend of cross-attention through a streaming cache of 1 sink and a window of 3, "
            "rope_positions='cache': each key turned at its column in the cache's order, each query at its own"),
        edge("decode", "unfilled_positions_weigh_zero", lambda: decode_case((2,), (2, 1), capacity=7),
             "3 positions in a cache of 7: the weights of positions 3..6 are exactly 0 in every row",
             Requirement(
                 "weights",
                 "zero",
                 index=(ALL, ALL, ALL, slice(3, None))), Requirement("weights", "sums_to_one")),
        error("decode", "cache_full", lambda: decode_case((2,), (3, 2), capacity=4, dropout=0.0), ValueError,
              "capacity", "4", "3", "2"),
        error("decode", "capacity_negative", lambda: decode_case((2,), (1,), capacity=-1, dropout=0.0), ValueError,
              "capacity", "-1"),
        error("decode", "cache_for_another_batch", lambda: decode_case((2,), (2,), dropout=0.0, cache_batch=(3,)),
              ValueError, "x", "(2, 2, 4)", "(3,)"),
        error("decode", "mask_not_capacity_wide",
              lambda: decode_case((2,), (2,), capacity=8, dropout=0.0, mask=np.ones((2, 7), bool)), ValueError,
              "mask", "(2, 7)", "capacity"),
        error("decode", "input_of_another_width", lambda: decode_case((2,), (2,), dropout=0.0, x=normal(2, 2, 5)),
              ValueError, "x", "(2, 2, 5)", "4"),
        error("decode", "block_table_outside_the_pool", _paged(2, (2,), ((2, 1),), page=2, max_pages=1, num_pages=3,
                                                             order=(0, 9, 1, 2), dropout=0.0),
              ValueError, "block_table", "9", "num_pages = 3"),
        error("decode", "paged_sequence_past_its_pages", _paged(2, (3,), ((3, 1),), page=2, max_pages=1, num_pages=3,
                                                              dropout=0.0),
              ValueError, "capacity", "2", "3"),
        error("decode", "new_lengths_past_the_chunk", _paged(2, (2,), ((3, 1),), page=2, max_pages=2, num_pages=5,
                                                           dropout=0.0),
              ValueError, "new_lengths", "3"),
        error("decode", "new_lengths_negative", lambda: decode_case((2,), (2,), new_lengths=((-1, 2),), dropout=0.0),
              ValueError, "new_lengths", "-1"),
        error("decode", "streaming_past_capacity", lambda: decode_case(
            (2,), (1,), capacity=4, dropout=0.0, streaming=Streaming(sink_tokens=2, window=3)),
              ValueError, "sink_tokens", "window", "capacity=4"),
        error("decode", "streaming_sink_tokens_negative", lambda: decode_case(
            (2,), (1,), capacity=4, dropout=0.0, streaming=Streaming(sink_tokens=-1, window=2)),
              ValueError, "sink_tokens", "-1"),
        error("decode", "streaming_window_not_positive", lambda: decode_case(
            (2,), (1,), capacity=4, dropout=0.0, streaming=Streaming(sink_tokens=1, window=0)),
              ValueError, "window", "0"),
        error("decode", "streaming_chunk_past_the_window", lambda: decode_case(
            (2,), (3,), capacity=4, dropout=0.0, streaming=Streaming(sink_tokens=1, window=2)),
              ValueError, "window=2", "L=3"),
        error("decode", "streaming_with_a_mask", lambda: decode_case(
            (2,), (2,), capacity=4, dropout=0.0, streaming=Streaming(sink_tokens=1, window=2),
            mask=np.ones(4, bool)),
              ValueError, "mask", "streaming"),
        error("decode", "cache_of_another_dtype", lambda: decode_case((2,), (2,), dropout=0.0, cache_dtype="float32"),
              TypeError, "cache", "float32", "float64"),
    ]


# --- tiled attention (flash_attention) ---------------------------------------------------------------------

TILES = (2, 3)  # block_q, block_k of the rows taken over from sdpa: every tile boundary of their short sequences


def _as_tiled(row: Fixed, block_q: int = TILES[0], block_k: int = TILES[1]) -> Fixed:
    """An sdpa row as a flash_attention row: the same case in tiles, its requirements on out (the second result
    is the log-sum-exp; the oracle's -inf marks the queries that see no key), or those of FLASH_REQUIREMENTS where
    the sdpa row's requirements are on the weights alone."""
    requirements = (tuple(needed for needed in row.requirements if needed.name == "out")
                    or FLASH_REQUIREMENTS.get(row.name, ()))
    return row._replace(operation="flash", build=lambda: tiled(row.build(), block_q, block_k),
                        requirements=requirements)


# the flash requirements of edge cases whose sdpa requirements are on the weights alone: every query sees finite scores
# (about -1.1e12; capped at +-0.5 besides a -inf bias), so its lse is finite, whatever the masks hide
FLASH_REQUIREMENTS = {name: (Requirement("out", "finite"), Requirement("lse", "finite"))
               for name in ("visible_scores_below_minus_1e9", "softcap_keeps_neg_inf_bias_hidden")}


def _flash_rows() -> list[Fixed]:
    """SPEC 2c: sdpa's examples of SPEC 2a, its edge cases and errors (dropout's aside) in tiles of 2 queries and
    3 keys, and the rows of the tiles themselves."""
    # sdpa's examples of SPEC 2a (positions, windows, key lengths, softcap, grouped heads: where tiles are cut or
    # skipped), its edge cases and its errors; its other examples, shapes and masks the drawn flash cases cover
    # too, are left to sdpa (each pinned example is a JAX compile in every value and gradient group)
    sdpa = [*_positions_examples(), *_per_head_examples(), *_sdpa_edges(), *_sdpa_errors()]
    causal = changed(np.ones((9, 11), bool), (ALL, 4), False)  # key 4 hidden from every query
    return [
        *(_as_tiled(row) for row in sdpa if "dropout" not in row.name),
        example("flash", "tiles_of_one", lambda: tiled(sdpa_case((2,), 4, 5, is_causal=True), 1, 1),
                "one query against one key per tile: the online softmax rescaled at every key"),
        example("flash", "one_tile_larger_than_the_sequence", lambda: tiled(sdpa_case((2,), 3, 4), 128, 128),
                "the default tiles on L = 3, S = 4: one partial tile each way"),
        example("flash", "last_tiles_partial", lambda: tiled(sdpa_case((2,), 7, 11, bias=normal(7, 11)), 4, 4),
                "L = 7, S = 11 in tiles of 4: the last query tile holds 3 rows, the last key tile 3 keys"),
        example("flash", "causal_skips_tiles", lambda: tiled(sdpa_case((), 9, 11, is_causal=True, q_offset=2,
                                                                       mask=causal), 2, 3),
                "causal with q_offset 2 in tiles of 2 x 3: the tiles above the diagonal are skipped, those it "
                "crosses computed in part"),
        example("flash", "window_skips_tiles_both_sides", lambda: tiled(sdpa_case(
            (2,), 12, 12, window=(2, 1), q_offset=np.array([0, 3])), 3, 2),
            "window (2, 1), offsets [0, 3]: the tiles outside every sequence's band skipped, the band's edges "
            "partly hidden"),
        example("flash", "key_lengths_end_mid_tile", lambda: tiled(sdpa_case(
            (2,), 5, 10, key_lengths=np.array([7, 0])), 2, 4),
            "key_lengths [7, 0] in key tiles of 4: the second tile half hidden, the third skipped; sequence 1 "
            "sees no key"),
        example("flash", "running_maximum_grows_late", lambda: tiled(sdpa_case(
            (), 2, 9, q=np.ones((2, 1)), k=np.arange(9.0)[:, None], scale=2.5), 2, 2),
            "scores 0, 2.5, .., 20 in key order: each tile raises the running maximum, so every earlier sum is "
            "rescaled (by exp(-5) per tile)"),
        edge("flash", "lse_of_fully_masked_rows", lambda: tiled(sdpa_case(
            mask=changed(changed(random_mask(2, 3, 4), (0, 0), False), (1, 2), False)), 2, 3),
            "rows (0, 0) and (1, 2) see no key: out rows exactly 0 and lse -inf; the others as the oracle",
            *(Requirement(name, kind, index=row) for name, kind in (("out", "zero"), ("lse", "minus_inf"))
              for row in ((0, 0), (1, 2)))),
        edge("flash", "lse_of_one_key", lambda: tiled(sdpa_case(S=1, bias=np.full((3, 1), 0.7), scale=0.0), 2, 3),
             "S = 1, scale 0, bias 0.7: the one score is 0.7, so lse = log(exp(0.7)) = 0.7 on every row",
             Requirement("out", "equals", value=first_value), Requirement("lse", "equals", value=lambda case: 0.7)),
        error("flash", "block_q_zero", lambda: tiled(sdpa_case(), 0, 3), ValueError, "block_q", "0"),
        error("flash", "block_k_negative", lambda: tiled(sdpa_case(), 2, -1), ValueError, "block_k", "-1"),
        error("flash", "block_q_float", lambda: tiled(sdpa_case(), 2.0, 3), ValueError, "block_q", "2.0"),
    ]


# --- ring attention (ring_attention) -----------------------------------------------------------------------

def _ring(P: int, L: int, S: int, *, tiles: tuple[int, int] = (3, 2), **fields: Any) -> Callable[[], Any]:
    """sdpa_case's q (2, L, 2), k (2, S, 2), v (2, S, 3), changed by `fields`, as ring attention over P devices
    in tiles of 3 queries and 2 keys within each step."""
    return lambda: sharded(tiled(sdpa_case((2,), L, S, **fields), *tiles), P)


def _large_ring() -> Any:
    """logits +-5000 (+ O(1)) across two devices: queries 0, 1 near +5000, queries 2, 3 near -5000; each device's
    partial lse lies near +-5000, so merging them by exp(lse) instead of exp(lse_a - lse) overflows or gives 0 / 0."""
    a = np.sqrt(5000.0)
    sign = np.array([1.0, 1.0, -1.0, -1.0])[:, None]  # (L, 1)
    q = np.concatenate([np.broadcast_to(a * sign, (2, 4, 1)), normal(2, 4, 2, seed=4)], axis=-1)  # (B, L, E)
    k = np.concatenate([np.full((2, 4, 1), a), normal(2, 4, 2, seed=5)], axis=-1)  # (B, S, E)
    return sharded(tiled(sdpa_case(q=q, k=k, v=normal(2, 4, 3, seed=4), scale=1.0), 3, 2), 2)


def _ring_rows() -> list[Fixed]:
    """SPEC 2d: the layouts and positions across the devices, the merges' edge cases, and the errors of the
    sizes the devices do not divide (the rest as flash_attention's)."""
    nan_key = _ring(2, 8, 8, is_causal=True)
    return [
        example("ring", "one_device", _ring(1, 3, 5), "P = 1: flash_attention itself"),
        example("ring", "zig_zag_causal_on_four_devices", _ring(4, 16, 16, is_causal=True),
                "is_causal on 4 devices: 8 chunks of 2 rows, device d holding chunks d and 7 - d (the zig-zag "
                "layout), moved there and back; as one device's causal attention"),
        example("ring", "causal_cross_attention_placed_by_q_offset", _ring(2, 4, 8, is_causal=True, q_offset=4),
                "4 queries after 4 keys (q_offset = S - L): each device's chunks at their global positions"),
        example("ring", "window_crosses_the_shards", _ring(4, 8, 8, window=(1, 1)),
                "window (1, 1) on shards of 2 rows: every query's window reaches its neighbour devices' keys, the "
                "far shards are skipped"),
        example("ring", "sinks_on_four_devices", _ring(4, 8, 8, is_causal=True, q_offset=-2,
                                                       sinks=np.array([1.5, -0.5])),
                "sinks [1.5, -0.5] (H = 2) on 4 devices, causal at q_offset -2: the sink joins each row once, "
                "after the ring, never once per device; queries 0, 1 see no key: zeros, lse the sink"),
        example("ring", "three_devices_cross_attention", _ring(3, 6, 12, is_causal=True, q_offset=6, tiles=(2, 5)),
                "P = 3, causal with L = 6, S = 12 at q_offset 6: 6 chunks of 1 query and of 2 keys, tiles of 5 "
                "keys larger than a chunk"),
        example("ring", "grouped_heads_one_key_value_head", lambda: sharded(tiled(
            (case := sdpa_case((2, 4), 4, 4))._replace(k=case.k[:, :1], v=case.v[:, :1], enable_gqa=True), 3, 2), 2),
                "enable_gqa, H = 4 query heads on Hkv = 1 (multi-query): the one key/value head travels the ring"),
        edge("ring", "queries_before_every_key", _ring(2, 8, 8, is_causal=True, q_offset=-3),
             "causal at q_offset -3: queries 0..2 (positions -3..-1) see no key on any device: out rows exactly 0 "
             "and lse -inf, merged so (never exp(-inf - -inf) = NaN); the others as the oracle",
             Requirement("out", "zero", index=(ALL, slice(0, 3))),
             Requirement("lse", "minus_inf", index=(ALL, slice(0, 3))),
             Requirement("lse", "finite", index=(ALL, slice(3, 8)))),
        edge("ring", "logits_in_the_thousands", _large_ring,
             "logits +-5000 on two devices: the partial results merge by exp(lse_a - lse), finite, as the oracle",
             Requirement("out", "finite"), Requirement("lse", "finite")),
        # causal: query i sees keys 0..i, so the NaN of key 5 reaches queries 5..7 alone, though the chunk that
        # holds it is computed for query 4 as well
        edge("ring", "nan_in_key_hidden_from_earlier_queries", lambda: (case := nan_key())._replace(
            k=changed(case.k, (0, 5), np.nan)),
            "k[0, 5] NaN, causal on 2 devices: rows (0, 5..7) NaN; rows (0, 0..4), which do not see key 5, and "
            "batch element 1 as the oracle",
            Requirement("out", "only_nan", index=(0, slice(5, 8))),
            Requirement("lse", "only_nan", index=(0, slice(5, 8)))),
        error("ring", "L_not_a_multiple_of_the_devices", _ring(4, 6, 8), ValueError, "ring_attention", "L = 6",
              "P = 4"),
        error("ring", "S_not_a_multiple_of_the_devices", _ring(3, 6, 7), ValueError, "ring_attention", "S = 7",
              "P = 3"),
        error("ring", "causal_L_not_a_multiple_of_2P", _ring(4, 12, 16, is_causal=True), ValueError, "L = 12",
              "8", "zig-zag"),
        error("ring", "q_offset_array", _ring(2, 4, 4, q_offset=np.array([1, 2])), ValueError, "q_offset"),
        error("ring", "block_q_zero", _ring(2, 4, 4, tiles=(0, 2)), ValueError, "block_q", "0"),
        error("ring", "window_negative", _ring(2, 4, 4, window=(-1, 0)), ValueError, "window"),
        error("ring", "softcap_zero", _ring(2, 4, 4, softcap=0.0), ValueError, "softcap"),
        error("ring", "sinks_of_other_heads", _ring(2, 4, 4, sinks=np.zeros(3)), ValueError, "sinks", "(3,)", "(2,)"),
        error("ring", "integer_inputs", lambda: (case := _ring(2, 4, 4)())._replace(
            **{name: _integers(getattr(case, name)) for name in "qkv"}), TypeError, "q", "floating"),
        error("ring", "d_out_shape", _ring(2, 4, 4), ValueError, "d_out", stage="pullback", d_out=np.zeros((2, 4, 4))),
    ]


# --- linear attention (linear_attention) ---------------------------------------------------------------------

def _linear(batch: tuple[int, ...] = (2,), L: int = 3, S: int = 4, **fields: Any) -> Callable[[], Any]:
    """linear_case's q (..., L, 2), k (..., S, 2), v (..., S, 3), changed by `fields`."""
    return lambda: linear_case(batch, L, S, **fields)


def _positive(make: Callable[[], Any]) -> Callable[[], Any]:
    """`make`'s case with |q| and |k|: identity features that are positive, so no normaliser cancels."""
    return lambda: (case := make())._replace(q=np.abs(case.q), k=np.abs(case.k))


def _linear_rows() -> list[Fixed]:
    """SPEC 2e: the feature maps, the causal forms (prefix sums; chunks of one, of a size that divides L or not,
    larger than L), key lengths, broadcast leading axes; the exact rules of the normaliser; and the errors of
    its keywords."""
    nan_key = _linear((2,), 6, 6, is_causal=True, chunk=3)
    return [
        example("linear", "causal_prefix_sums", _linear((2,), 5, 5, is_causal=True),
                "elu + 1, causal, chunk None: the prefix sums over the keys, query i reading keys 0..i"),
        example("linear", "relu_causal_chunks_of_one", _linear((2,), 5, 5, feature_map="relu", is_causal=True,
                                                                chunk=1),
                "relu, causal in chunks of one position: every chunk's masked kernel is 1 x 1, the rest the state"),
        example("linear", "identity_chunk_larger_than_the_sequence", _positive(_linear(
            (2,), 4, 4, feature_map="identity", is_causal=True, chunk=7)),
            "identity on positive q, k, causal, chunk 7 > L = 4: one partial chunk, the masked quadratic form alone"),
        example("linear", "last_chunk_partial_with_key_lengths", _linear((2,), 7, 7, is_causal=True, chunk=3,
                                                                          key_lengths=np.array([5, 2])),
                "elu + 1, causal, L = 7 in chunks of 3 (the last of 1), key_lengths [5, 2]: hidden keys inside and "
                "across chunks; queries past the length see keys 0..length - 1"),
        example("linear", "key_lengths_zero_for_one_sequence", _linear(key_lengths=np.array([0, 2]), chunk=2),
                "not causal (chunk 2 validated and ignored), key_lengths [0, 2]: sequence 0 sees no key (out 0), "
                "sequence 1 keys 0, 1"),
        example("linear", "leading_axes_broadcast_chunks_dividing_L", lambda: linear_case(
            q=normal(2, 1, 4, 2), k=normal(4, 4, 2), v=normal(1, 4, 4, 3), feature_map="relu", is_causal=True,
            chunk=2),
            "q (2, 1, 4, 2), k (4, 4, 2), v (1, 4, 4, 3) broadcast to (2, 4); causal in two whole chunks of 2; "
            "the gradients summed back over the broadcast axes"),
        edge("linear", "queries_that_see_no_key_get_zeros", _linear((2,), 4, 4, is_causal=True, chunk=3,
                                                                    key_lengths=np.array([0, 2])),
             "key_lengths [0, 2], causal: sequence 0 sees no key, so each out row is 0 / (0 + eps) = 0 exactly, "
             "never 0 / 0; sequence 1 as the oracle", Requirement(
                 "out",
                 "zero",
                 index=0), Requirement("out", "finite")),
        edge("linear", "relu_query_without_a_positive_entry", lambda: linear_case(
            q=changed(normal(2, 3, 2), (ALL, 1), -1.0), feature_map="relu", is_causal=True, L=3, S=3),
            "relu, query 1 = (-1, -1): phi(q_1) = 0, so every weight of row 1 is 0 and out_1 = 0 / (0 + eps) = 0 "
            "exactly, though it sees keys 0, 1", Requirement("out", "zero", index=(ALL, 1))),
        edge("linear", "one_key_of_weight_one_and_eps_one", lambda: linear_case(
            q=np.ones((2, 3, 1)), k=np.ones((2, 1, 1)), v=normal(2, 1, 3), feature_map="identity", eps=1.0),
            "identity, q = k = 1, S = 1, eps 1: the one weight is 1, so out_i = 1 v_0 / (1 + 1) = v_0 / 2 exactly",
            Requirement("out", "equals", value=lambda case: case.v / 2)),
        edge("linear", "elu_plus_one_at_zero_is_one", lambda: linear_case(
            q=np.zeros((2, 3, 2)), k=np.zeros((2, 2, 2)), v=normal(2, 2, 3), eps=4.0),
            "elu + 1, q = k = 0, E = 2, S = 2, eps 4: phi(0) = (1, 1), every weight 2, so out_i = 2 (v_0 + v_1) / "
            "(2 + 2 + 4) = (v_0 + v_1) / 4 exactly",
            Requirement("out", "equals", value=lambda case: (case.v[:, :1] + case.v[:, 1:]) / 4)),
        edge("linear", "no_queries", _linear((2,), 0, 4), "L = 0: out (2, 0, 3)",
             Requirement("out", "shape", value=(2, 0, 3))),
        edge("linear", "no_queries_causal_chunked", _linear((2,), 0, 0, is_causal=True, chunk=2),
             "L = S = 0, causal in chunks of 2: no chunk at all, out (2, 0, 3)",
             Requirement("out", "shape", value=(2, 0, 3))),
        edge("linear", "no_keys", _linear((2,), 3, 0), "S = 0: every query sees no key, out zeros (2, 3, 3)",
             Requirement("out", "zero"), Requirement("out", "shape", value=(2, 3, 3))),
        edge("linear", "nan_in_a_key_past_key_lengths", lambda: linear_case(
            k=changed(normal(2, 4, 2), (0, 3), np.nan), key_lengths=np.array([3, 4])),
            "k[0, 3] NaN, key_lengths [3, 4]: sequence 0 never sees key 3 (its rows are zeroed, not multiplied by "
            "0), so out is finite everywhere; sequence 1 as the oracle", Requirement("out", "finite")),
        # causal: query i sees keys 0..i, so the NaN of key 4 reaches queries 4, 5 alone, though the chunk of 3
        # that holds it (positions 3..5) computes query 3's row as well
        edge("linear", "nan_in_key_hidden_from_earlier_queries", lambda: (case := nan_key())._replace(
            k=changed(case.k, (0, 4), np.nan)),
            "k[0, 4] NaN, causal in chunks of 3: rows (0, 4..5) NaN; rows (0, 0..3), which do not see key 4, and "
            "sequence 1 as the oracle", Requirement("out", "only_nan", index=(0, slice(4, 6)))),
        error("linear", "feature_map_unknown", _linear(feature_map="softmax"), ValueError, "feature_map", "softmax"),
        error("linear", "chunk_zero", _linear((2,), 4, 4, is_causal=True, chunk=0), ValueError, "chunk", "0"),
        error("linear", "chunk_negative", _linear((2,), 4, 4, is_causal=True, chunk=-1), ValueError, "chunk", "-1"),
        error("linear", "chunk_float", _linear((2,), 4, 4, is_causal=True, chunk=2.0), ValueError, "chunk", "2.0"),
        error("linear", "eps_zero", _linear(eps=0.0), ValueError, "eps", "0.0"),
        error("linear", "eps_negative", _linear(eps=-1e-6), ValueError, "eps", "-1e-06"),
        error("linear", "causal_L_differs_from_S", _linear((2,), 3, 4, is_causal=True), ValueError, "L = 3", "S = 4"),
        error("linear", "key_lengths_float", _linear(key_lengths=np.array([1.0, 2.0])), TypeError, "key_lengths",
              "float64"),
        error("linear", "key_lengths_do_not_broadcast", _linear(key_lengths=np.array([1, 2, 3])), ValueError,
              "key_lengths", "(3,)"),
        error("linear", "integer_inputs", lambda: (case := linear_case())._replace(
            **{name: _integers(getattr(case, name)) for name in "qkv"}), TypeError, "q", "floating"),
        error("linear", "d_out_shape", _linear(), ValueError, "d_out", stage="pullback", d_out=np.zeros((2, 3, 4))),
        *_rule_rows(),
    ]


def _rule(update_rule: str, **fields: Any) -> Callable[[], Any]:
    """rule_case's causal q, unit k (2, 5, 2), v (2, 5, 3) under `update_rule`, changed by `fields`."""
    return lambda: rule_case(update_rule, **fields)


def _rule_rows() -> list[Fixed]:
    """SPEC 2e's update rules (ONNX's LinearAttention): each rule in the form a bug of its own would hide in (the
    recurrence, the chunks with the decays between positions and the delta rules' triangular system), and the
    errors of update_rule, decay and beta."""
    return [
        example("linear", "gated_per_key_dimension_chunks_of_two", _rule("gated", decay_width=2, chunk=2),
                "gated, decay (2, 5, 2) per key dimension, L = 5 in chunks of 2: the state decayed row by row across "
                "each chunk boundary, the decays between positions inside a chunk"),
        example("linear", "delta_chunks_of_three", _rule("delta", L=7, chunk=3),
                "delta on unit keys, L = 7 in chunks of 3 (the last of 1): the pseudo-values of each chunk from "
                "its unit lower triangular system (the UT transform), each key's error read off the keys before it"),
        example("linear", "gated_delta_recurrent_with_key_lengths", _rule("gated_delta", chunk=None,
                                                                          key_lengths=np.array([5, 3])),
                "gated_delta, decay per head, chunk None (the recurrence), key_lengths [5, 3]: decay before the "
                "update, beta on the error v - P^T phi(k); sequence 1's queries 3, 4 read the state of key 2"),
        error("linear", "update_rule_unknown", _rule("softmax"), ValueError, "update_rule", "softmax"),
        error("linear", "gated_without_decay", _rule("gated", decay=None), ValueError, "decay", "gated"),
        error("linear", "delta_without_beta", _rule("delta", beta=None), ValueError, "beta", "delta"),
        error("linear", "gated_delta_without_beta", _rule("gated_delta", beta=None), ValueError, "beta",
              "gated_delta"),
        error("linear", "delta_given_a_decay", _rule("delta", decay=np.full((2, 5, 1), -0.1)), ValueError, "decay",
              "delta"),
        error("linear", "decay_neither_one_nor_E_wide", _rule("gated", decay=np.full((2, 5, 3), -0.1)), ValueError,
              "decay", "(2, 5, 3)"),
        error("linear", "decay_of_another_length", _rule("gated", decay=np.full((2, 4, 1), -0.1)), ValueError,
              "decay", "(2, 4, 1)"),
        error("linear", "beta_E_wide", _rule("delta", beta=np.full((2, 5, 2), 0.5)), ValueError, "beta",
              "(2, 5, 2)"),
        error("linear", "decay_integer", _rule("gated", decay=np.zeros((2, 5, 1), np.int64)), TypeError, "decay"),
        error("linear", "gated_not_causal", _rule("gated", is_causal=False), ValueError, "update_rule",
              "is_causal"),
        error("linear", "delta_not_causal", _rule("delta", is_causal=False), ValueError, "update_rule",
              "is_causal"),
    ]


# --- packed sequences (varlen_attention) ---------------------------------------------------------------------

def _varlen(lengths_q: tuple[int, ...] = (2, 0, 3), lengths_k: tuple[int, ...] = (3, 2, 3),
            **fields: Any) -> Callable[[], Any]:
    """varlen_case's packed q (Tq, 2, 2), k (Tk, 2, 2), v (Tk, 2, 3) of sequences of these lengths, changed by
    `fields`."""
    return lambda: varlen_case(lengths_q, lengths_k, **fields)


def _varlen_rows() -> list[Fixed]:
    """SPEC 2g: bottom-right alignment with fewer queries than keys, tiles across sequences, positions past the last
    boundary, empty sequences; the errors of its shapes and boundaries (SPEC 7)."""
    return [
        example("varlen", "causal_fewer_queries_than_keys", _varlen((1, 2, 3), (4, 2, 5), is_causal=True),
                "is_causal, sequences of (L, S) = (1, 4), (2, 2), (3, 5): bottom-right, query i of sequence n sees "
                "its keys up to i + S_n - L_n (the first sequence's one query every key)"),
        example("varlen", "grouped_window_tiles_across_sequences", _varlen(
            (3, 4, 2), (3, 5, 2), Hkv=1, window=(1, None), softcap=5.0, block_size=2, past=(1, 2)),
            "Hkv = 1 of H = 2, window (1, None), softcap 5, tiles of 2 that lie across two sequences, one query and "
            "two keys past the last boundary"),
        edge("varlen", "no_sequences", _varlen((), (), past=(3, 2)),
             "N = 0: every query is past the last boundary, out zeros (3, 2, 3)",
             Requirement("out", "zero"), Requirement("out", "shape", value=(3, 2, 3))),
        edge("varlen", "every_sequence_empty", _varlen((0, 0), (0, 0), past=(2, 2)),
             "two empty sequences, two queries and keys past them: out zeros (2, 2, 3)", Requirement("out", "zero")),
        edge("varlen", "keys_without_queries_and_queries_without_keys", _varlen((0, 3, 2), (3, 0, 2), is_causal=True,
                                                                                past=(2, 1)),
             "is_causal; sequence 0 has keys but no queries, sequence 1 queries but no keys (out rows 0..2 zeros), "
             "sequence 2 as the oracle, two queries and a key past the last boundary (out rows 5, 6 zeros)",
             Requirement("out", "zero", index=slice(0, 3)), Requirement("out", "zero", index=slice(5, 7)),
             Requirement("out", "finite")),
        error("varlen", "q_two_axes", lambda: (case := varlen_case())._replace(q=case.q[:, 0]), ValueError,
              "varlen_attention", "(Tq, H, E)"),
        error("varlen", "heads_differ", _varlen(Hkv=1, enable_gqa=False), ValueError, "varlen_attention",
              "enable_gqa"),
        error("varlen", "widths_differ", lambda: (case := varlen_case())._replace(k=case.k[..., :1]), ValueError,
              "varlen_attention", "(5, 2, 2)", "(8, 2, 1)"),
        error("varlen", "bounds_of_different_lengths", lambda: varlen_case()._replace(
            cu_seqlens_k=np.array([0, 3, 5], np.int32)), ValueError, "cu_seqlens_q", "cu_seqlens_k"),
        error("varlen", "bounds_not_integer", lambda: (case := varlen_case())._replace(
            cu_seqlens_q=case.cu_seqlens_q.astype(np.float64)), TypeError, "cu_seqlens_q", "float64"),
        error("varlen", "bounds_not_starting_at_0", lambda: varlen_case()._replace(
            cu_seqlens_q=np.array([1, 2, 2, 5], np.int32)), ValueError, "cu_seqlens_q", "start at 0"),
        error("varlen", "bounds_decreasing", lambda: varlen_case()._replace(
            cu_seqlens_k=np.array([0, 3, 2, 8], np.int32)), ValueError, "cu_seqlens_k", "decrease"),
        error("varlen", "bounds_past_the_end", lambda: varlen_case()._replace(
            cu_seqlens_q=np.array([0, 2, 2, 6], np.int32)), ValueError, "cu_seqlens_q", "Tq = 5"),
        error("varlen", "sequence_longer_than_max_seqlen", _varlen(max_seqlen_k=2), ValueError, "max_seqlen_k",
              "sequence 0"),
        error("varlen", "max_seqlen_negative", _varlen(max_seqlen_q=-1), ValueError, "max_seqlen_q", "-1"),
        error("varlen", "block_size_zero", _varlen(block_size=0), ValueError, "block_size", "0"),
        error("varlen", "d_out_shape", _varlen(), ValueError, "d_out", stage="pullback", d_out=np.zeros((5, 2, 2))),
    ]


# --- programmable attention (flex_attention) -----------------------------------------------------------------

def _flex(**fields: Any) -> Callable[[], Any]:
    """flex_case's q (B, H, L, 2), k (B, Hkv, S, 2), v (B, Hkv, S, 3), changed by `fields`."""
    return lambda: flex_case(**fields)


def _float_mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    """A mask function that returns 1.0 and 0.0 where booleans are required (written with the namespace's where:
    JAX's strict promotion refuses booleans times a float)."""
    return array_namespace(kv_idx).where(kv_idx <= q_idx, 1.0, 0.0)


def _new_axis(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    """A score function that adds an axis to the scores (B, H, block_q, block_k, 1)."""
    return score[..., None]


def _flex_rows() -> list[Fixed]:
    """Every entry of the catalogue once (a mask function and a score function together where both fit), tiles
    full and partial, queries that a tile leaves without a key, and the four mistakes of a call."""
    slopes, table = np.array([0.5, 0.25, 0.125, 0.0625]), normal(2, 5, seed=7)  # ALiBi (H,), R = 2: (H, 2R + 1)
    blind = _flex(L=6, S=4, mask_mod=mods.causal(-3), block_size=(3, 2))  # queries 0..2 see no key
    return [
        example("flex", "causal_alibi_grouped_heads", _flex(H=4, Hkv=2, L=5, S=5, mask_mod=mods.causal(),
                                                            score_mod=mods.alibi(slopes), block_size=(2, 2)),
                "causal with ALiBi slopes 1/2..1/16 on 4 query heads of 2 key/value heads, tiles 2 x 2"),
        example("flex", "sliding_window_softcap", _flex(L=6, S=7, mask_mod=mods.sliding_window(2, 1, q_offset=1),
                                                        score_mod=mods.softcap(1.0), block_size=(3, 2)),
                "keys p - 2 .. p + 1 of position p = i + 1, scores capped at 1 (saturated)"),
        example("flex", "key_lengths_per_head_relative_bias", _flex(
            mask_mod=mods.key_lengths(np.array([[5, 2], [3, 0]])), score_mod=mods.relative_bias(table)),
                "key lengths per sequence and head (head 1 of sequence 1 sees no key: zeros, lse -inf), a learned "
                "bias per head and distance clipped at 2"),
        example("flex", "document_packed_sequences", _flex(L=6, S=6, block_size=(4, 4), mask_mod=mods.document(
            np.array([0, 0, 1, 1, 1, 2]))), "three packed documents, tiles across their borders"),
        example("flex", "prefix_lm_per_sequence", _flex(L=5, S=5, mask_mod=mods.prefix_lm(np.array([2, 0]))),
                "a bidirectional prefix of 2 keys in sequence 0, causal alone in sequence 1"),
        example("flex", "chunked_tiles_across_chunks", _flex(L=7, S=7, mask_mod=mods.chunked(3), block_size=(2, 2)),
                "causal within chunks of 3, tiles of 2 that straddle them"),
        example("flex", "dilated_window", _flex(L=6, S=6, mask_mod=mods.dilated(2, 2), block_size=(3, 3)),
                "the query itself and the key 2 before it"),
        example("flex", "noop_mask_every_tile_full", _flex(mask_mod=mods.noop_mask),
                "every key visible: every tile full, the mask function never needed, as without a block mask"),
        example("flex", "full_and_partial_tiles", _flex(L=8, S=8, block_size=(2, 2), mask_mod=mods.and_masks(
            mods.causal(), mods.key_lengths(np.array([8, 5])))),
                "causal and key lengths 8, 5: full tiles below the diagonal, partial ones on it and at the lengths, "
                "empty ones above"),
        example("flex", "or_masks_prefix_or_window", _flex(L=6, S=6, block_size=(4, 3), mask_mod=mods.or_masks(
            mods.prefix_lm(2), mods.sliding_window(1, 0))), "the prefix of 2 keys, or the key before and the own"),
        example("flex", "sinks_per_sequence_causal_tiles", _flex(
            L=6, S=6, block_size=(2, 2), mask_mod=mods.causal(-1), sinks=np.array([[1.0, -np.inf], [3.0, -2.0]])),
            "sinks (B, H) in tiles of 2 x 2, causal from q_offset -1: the sink joins each row once, after the tiles "
            "(head (0, 1) none); query 0 sees no key: zeros, lse the sink"),
        edge("flex", "queries_a_tile_leaves_without_a_key", blind,
             "causal from q_offset -3 in tiles of 3 x 2: the first tile row is empty, queries 0..2 get zeros and lse "
             "-inf, query 3 sees key 0 alone",
             Requirement("out", "zero", index=(ALL, ALL, slice(0, 3))),
             Requirement("lse", "minus_inf", index=(ALL, ALL, slice(0, 3))),
             Requirement("lse", "finite", index=(ALL, ALL, slice(3, 6)))),
        error("flex", "q_three_axes", lambda: (case := flex_case())._replace(q=case.q[0], k=case.k[0], v=case.v[0]),
              ValueError, "q", "(B, H, L, E)"),
        error("flex", "block_mask_for_other_scores", _flex(mask_mod=mods.causal(), mask_for=(2, 2, 4, 6)),
              ValueError, "block_mask", "(2, 2, 4, 6)"),
        error("flex", "mask_mod_returns_floats", _flex(mask_mod=_float_mask), TypeError, "mask_mod", "booleans"),
        error("flex", "score_mod_changes_the_shape", _flex(score_mod=_new_axis), ValueError, "score_mod", "shape"),
        error("flex", "sinks_of_other_heads", _flex(sinks=np.zeros(3)), ValueError, "sinks", "(3,)", "(2, 2)"),
        error("flex", "d_out_shape", _flex(mask_mod=mods.causal()), ValueError, "d_out", stage="pullback",
              d_out=np.zeros((2, 2, 4, 4))),
    ]


def _mods_case(B: int = 2, H: int = 2, L: int = 5, S: int = 6, *, Hkv: int | None = None, seed: int = 0,
               **fields: Any) -> Callable[[], Any]:
    """sdpa_case's q (B, H, L, 2), k (B, Hkv, S, 2), v (B, Hkv, S, 3) (Hkv None: H; else grouped heads), changed
    by `fields`: the four axes the mods need."""
    Hkv = H if Hkv is None else Hkv
    kv = {"k": normal(B, Hkv, S, 2, seed=seed + 1), "v": normal(B, Hkv, S, 3, seed=seed + 2)} if Hkv != H else {}
    return lambda: sdpa_case((B, H), L, S, seed=seed, **kv, enable_gqa=Hkv != H, **fields)


def _mods_rows() -> list[Fixed]:
    """The mods on sdpa and flash: every entry of the catalogue once on sdpa, in three compositions (each with the
    keywords and arrays it is and-ed or ordered with; few, as each is a program for JAX to compile in every pinned
    group); on flash a tile row of blind queries, a block mask of full, partial and empty tiles; the errors of a
    call with mods."""
    slopes, table = np.array([0.5, 0.25, 0.125, 0.0625]), normal(2, 5, seed=7)  # ALiBi (H,), R = 2: (H, 2R + 1)
    full_and_partial = _mods_case(L=8, S=8, mask_mod=mods.and_masks(mods.causal(), mods.key_lengths(np.array([8, 5]))))
    return [
        example("sdpa", "mods_causal_alibi_bias_grouped_heads", _mods_case(
            H=4, Hkv=2, L=5, S=5, mask_mod=mods.causal(), score_mod=mods.alibi(slopes), bias=normal(5, 5, seed=5)),
                "causal with ALiBi slopes 1/2..1/16 on 4 query heads of 2 key/value heads, then a bias: the score "
                "function sees the query heads 0..3 and comes before the bias"),
        example("sdpa", "mods_window_chunks_key_lengths_softcap_causal_offset", _mods_case(
            L=6, S=7, mask_mod=mods.and_masks(mods.sliding_window(2, 1, q_offset=1), mods.chunked(3),
                                              mods.key_lengths(np.array([[6, 2], [4, 0]]))),
            score_mod=mods.softcap(1.0), softcap=5.0, is_causal=True, q_offset=1),
                "keys p - 2 .. p + 1 of p = i + 1 within chunks of 3 and key lengths per sequence and head (head 1 of "
                "sequence 1 sees no key: zeros); is_causal from q_offset 1, which the mods' q_idx = i does not "
                "shift; the softcap keyword (5) before the score function's cap of 1"),
        example("sdpa", "mods_documents_or_prefix_or_dilated_relative_bias_mask", _mods_case(
            L=6, S=6, mask_mod=mods.or_masks(mods.document(np.array([0, 0, 1, 1, 1, 2])),
                                             mods.prefix_lm(np.array([2, 0])),
                                             mods.and_masks(mods.dilated(2, 2), mods.noop_mask)),
            score_mod=mods.relative_bias(table), mask=random_mask(2, 1, 6, 6)),
                "three packed documents, or a prefix of 2 keys (sequence 0), or a dilated window; a learned bias "
                "per head and distance; and-ed with a random mask"),
        error("sdpa", "mods_q_three_axes", lambda: sdpa_case((2,), mask_mod=mods.causal()), ValueError, "four axes"),
        edge("flash", "mods_queries_a_tile_leaves_without_a_key", lambda: tiled(
            _mods_case(L=6, S=4, mask_mod=mods.causal(-3))(), 3, 2),
             "causal from q_offset -3 in tiles of 3 x 2: the first tile row sees no key, queries 0..2 get zeros and "
             "lse -inf, query 3 sees key 0 alone",
             Requirement("out", "zero", index=(ALL, ALL, slice(0, 3))),
             Requirement("lse", "minus_inf", index=(ALL, ALL, slice(0, 3))),
             Requirement("lse", "finite", index=(ALL, ALL, slice(3, 6)))),
        example("flash", "mods_block_mask_full_and_partial_tiles", lambda: tiled(full_and_partial(), 2, 2)._replace(
            block_size=(2, 2), score_mod=mods.alibi(slopes[:2])),
                "a block mask of causal and key lengths 8, 5 in tiles of 2: full tiles below the diagonal, partial "
                "ones on it and at the lengths, empty ones above; ALiBi slopes 1/2, 1/4"),
        example("flash", "mods_block_mask_causal_off_the_tiles", lambda: tiled(
            _mods_case(L=5, S=5, mask_mod=mods.causal(-1))(), 2, 2)._replace(block_size=(2, 2)),
            "a block mask of causal from q_offset -1 in tiles of 2: each diagonal tile's first query sees none of "
            "its keys and its second query one, so the tile is partial, never empty"),
        error("flash", "mods_q_three_axes", lambda: tiled(sdpa_case((2,), mask_mod=mods.causal()), 2, 3),
              ValueError, "four axes"),
        error("flash", "mods_mask_mod_and_block_mask", lambda: tiled(full_and_partial(), 2, 2)._replace(
            block_size=(2, 2), with_mask_mod=True), ValueError, "not both"),
        error("flash", "mods_block_mask_other_tiles", lambda: tiled(full_and_partial(), 4, 2)._replace(
            block_size=(2, 2)), ValueError, "BLOCK_SIZE"),
    ]


# --- multi-head latent attention (MultiHeadLatentAttention) ---------------------------------------------------

def _mla(**fields: Any) -> Callable[[], Any]:
    """A MultiHeadLatentAttention state (mla_case: D = 4, H = 2, Dq = 3, Dc = 3, En = 2, Er = 2, Ev = 3, float64), x
    (2, 4, 4), changed by `fields`."""
    return lambda: mla_case(**fields)


MLA_SIZES = {"d_model": 4, "num_heads": 2, "q_lora_rank": None, "kv_lora_rank": 3, "qk_nope_head_dim": 2,
             "qk_rope_head_dim": 2, "v_head_dim": 3}  # the constructor's arguments of the error rows at "init"


def _mla_rows() -> list[Fixed]:
    hide_row = changed(np.tri(4, 4, dtype=bool), (2, ALL), False)  # (4, 4): causal, query 2 sees no key
    return [
        example("mla", "two_heads_causal_query_latent", _mla(rope_theta=10.0, mask=np.tri(4, 4, dtype=bool)),
                "H = 2, Dq = 3, Ev = 3 against E = 4, causal, theta 10: the heads share k_R"),
        example("mla", "query_projection_mask_per_head", _mla(
            L=5, q_lora_rank=None, qk_rope_head_dim=4, v_head_dim=1, mask=random_mask(2, 2, 5, 5)),
            "q_proj (no query latent), Er = 4 (two pairs), Ev = 1, a mask per head"),
        example("mla", "decode_expanded", _mla(L=5, rope_theta=10.0, chunks=(2, 1, 2), capacity=6),
                "a prefill of 2, a step, a chunk of 2, the cached latents up-projected: the full causal pass"),
        example("mla", "decode_absorbed", _mla(L=5, rope_theta=10.0, chunks=(3, 1, 1), capacity=5, absorbed=True,
                                               mask=random_mask(2, 2, 5, 5)),
                "W_UK in the queries, W_UV on the output, scale 1 / sqrt(En + Er), a mask per head: the full pass"),
        edge("mla", "fully_masked_row", _mla(mask=hide_row),
             "query 2 sees no key in any head: its weights rows and its out row exactly 0 (no biases)",
             Requirement("out", "zero", index=(ALL, 2)), Requirement("weights", "zero", index=(ALL, ALL, 2))),
        edge("mla", "decode_fully_masked_row", _mla(chunks=(2, 2), capacity=4, absorbed=True, mask=hide_row),
             "absorbed decoding, query 2 sees no key: its weights rows and out row exactly 0",
             Requirement("out", "zero", index=(ALL, 2)), Requirement("weights", "zero", index=(ALL, ALL, 2))),
        edge("mla", "one_token", _mla(L=1), "L = 1: the one weight is 1 (RoPE at position 0 turns nothing), out as the "
             "oracle", Requirement("weights", "one")),
        error("mla", "qk_rope_head_dim_odd", lambda: MLA_SIZES | {"qk_rope_head_dim": 3}, ValueError,
              "qk_rope_head_dim", "3", stage="init"),
        error("mla", "kv_lora_rank_zero", lambda: MLA_SIZES | {"kv_lora_rank": 0}, ValueError, "kv_lora_rank",
              stage="init"),
        error("mla", "q_lora_rank_zero", lambda: MLA_SIZES | {"q_lora_rank": 0}, ValueError, "q_lora_rank",
              stage="init"),
        error("mla", "rope_theta_negative", lambda: MLA_SIZES | {"rope_theta": -1.0}, ValueError, "rope_theta",
              "-1.0", stage="init"),
        error("mla", "input_width_not_d_model", _mla(x=normal(2, 4, 5)), ValueError, "x", "(2, 4, 5)", "4"),
        error("mla", "mask_does_not_broadcast", _mla(mask=np.ones((3, 4), bool)), ValueError, "mask", "(3, 4)",
              "(2, 2, 4, 4)"),
        error("mla", "input_dtype_not_parameters", _mla(x=normal(2, 4, 4).astype(np.float32)), TypeError,
              "float32", "float64"),
        error("mla", "state_without_kv_a_layernorm", _with_state(_mla(), lambda state: _without(
            state, "kv_a_layernorm.weight")), ValueError, "kv_a_layernorm.weight"),
        error("mla", "cache_full", _mla(chunks=(4,), capacity=3), ValueError, "capacity is 3", "4 more"),
        error("mla", "d_out_shape", _mla(), ValueError, "d_out", "(2, 4, 5)", "(2, 4, 4)", stage="pullback",
              d_out=np.zeros((2, 4, 5))),
    ]


ROWS: list[Fixed] = (_sdpa_examples() + _sdpa_edges() + _sdpa_errors() + _flash_rows() + _ring_rows()
                      + _linear_rows() + _mha_examples() + _mha_edges() + _mha_errors() + _block_examples()
                      + _block_edges() + _block_errors() + _decode_rows() + _flex_rows() + _mods_rows()
                      + _varlen_rows() + _mla_rows())


def rows(operation: str, use: str) -> list[Fixed]:
    """The fixed cases of one operation and use, in order."""
    return [row for row in ROWS if row.operation == operation and row.use == use]


def named(operation: str, name: str) -> Fixed:
    """The row `name` of `operation`."""
    (row,) = (row for row in ROWS if row.operation == operation and row.name == name)
    return row

