"""Known values of the float64 oracle, each derived by hand, and its agreement with torch's SDPA."""

from __future__ import annotations

import math

import numpy as np
import pytest

from attention_np.common import mods
from conformance.contract import oracle


def _mha_state(d_model: int, *, w_q: float = 1.0, b_o: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Identity projections (W_q = w_q * I), zero biases except b_o."""
    eye, zeros = np.eye(d_model), np.zeros(d_model)
    state = {f"{proj}.weight": eye for proj in ("w_k", "w_v", "w_o")} | {"w_q.weight": w_q * eye}
    state |= {f"{proj}.bias": zeros for proj in ("w_q", "w_k", "w_v")}
    return state | {"w_o.bias": zeros if b_o is None else b_o}


def _block_state(d_model: int, d_ff: int, entries: dict[str, object]) -> dict[str, np.ndarray]:
    """Every parameter zero except the LayerNorm gains (one), then the given entries."""
    state = {f"attn.{name}": np.zeros_like(value) for name, value in _mha_state(d_model).items()}
    state |= {"norm1.weight": np.ones(d_model), "norm1.bias": np.zeros(d_model),
              "norm2.weight": np.ones(d_model), "norm2.bias": np.zeros(d_model),
              "ffn.0.weight": np.zeros((d_ff, d_model)), "ffn.0.bias": np.zeros(d_ff),
              "ffn.3.weight": np.zeros((d_model, d_ff)), "ffn.3.bias": np.zeros(d_model)}
    return state | {name: np.asarray(value, float) for name, value in entries.items()}


def test_two_keys_weights_are_one_and_e_over_one_plus_e() -> None:
    # E = 1, so scale = 1 / sqrt(1) = 1; q = 1, keys 0 and 1 -> logits [0, 1]
    # softmax([0, 1]) = [e^0, e^1] / (e^0 + e^1) = [1, e] / (1 + e); v = I so out = weights
    out, weights = oracle.sdpa(np.array([[1.0]]), np.array([[0.0], [1.0]]), np.eye(2))
    np.testing.assert_allclose(weights, [[1 / (1 + math.e), math.e / (1 + math.e)]], rtol=1e-15)
    np.testing.assert_allclose(out, weights, rtol=1e-15)


def test_scale_multiplies_scores() -> None:
    # q = 2, keys 0 and 1, scale 0.5 -> logits [0, 2 * 1 * 0.5] = [0, 1] -> weights [1, e] / (1 + e)
    _, weights = oracle.sdpa(np.array([[2.0]]), np.array([[0.0], [1.0]]), np.eye(2), scale=0.5)
    np.testing.assert_allclose(weights, [[1 / (1 + math.e), math.e / (1 + math.e)]], rtol=1e-15)


def test_fully_masked_row_gives_zeros() -> None:
    # query 0 sees key 0 only -> weights [1, 0], out = v_0; query 1 sees nothing -> zeros, not 0 / 0 = NaN
    v = np.array([[1.0, 2.0], [3.0, 4.0]])
    mask = np.array([[True, False], [False, False]])
    out, weights = oracle.sdpa(np.ones((2, 2)), np.ones((2, 2)), v, mask)
    np.testing.assert_array_equal(weights, [[1.0, 0.0], [0.0, 0.0]])
    np.testing.assert_array_equal(out, [[1.0, 2.0], [0.0, 0.0]])


def test_single_visible_key_returns_its_value() -> None:
    # only key 2 is visible: softmax over one logit is [1], so out = v_2 whatever the scores
    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(1, 3)), rng.normal(size=(4, 3)), rng.normal(size=(4, 5))
    out, weights = oracle.sdpa(q, k, v, np.array([0, 0, 1, 0]))  # a 0/1 integer mask, broadcast over L
    np.testing.assert_array_equal(weights, [[0.0, 0.0, 1.0, 0.0]])
    np.testing.assert_array_equal(out, v[2:3])


def test_causal_is_top_left_aligned_when_L_differs_from_S() -> None:
    # q = 0 makes every logit 0, so each query spreads its weight evenly over the keys j <= i it sees.
    # L = 2 < S = 4: query 0 sees key 0, query 1 sees keys 0, 1 (bottom-right alignment would show 3 and 4)
    _, weights = oracle.sdpa(np.zeros((2, 1)), np.ones((4, 1)), np.ones((4, 1)), is_causal=True)
    np.testing.assert_array_equal(weights, [[1, 0, 0, 0], [0.5, 0.5, 0, 0]])
    # L = 3 > S = 2: query 0 sees key 0; queries 1 and 2 see keys 0 and 1
    _, weights = oracle.sdpa(np.zeros((3, 1)), np.ones((2, 1)), np.ones((2, 1)), is_causal=True)
    np.testing.assert_array_equal(weights, [[1, 0], [0.5, 0.5], [0.5, 0.5]])


def test_causal_combines_with_mask() -> None:
    # causal lets query 1 see keys 0, 1; the mask hides key 0 from every query -> query 0 sees nothing
    _, weights = oracle.sdpa(np.zeros((2, 1)), np.ones((2, 1)), np.ones((2, 1)), np.array([False, True]),
                             is_causal=True)
    np.testing.assert_array_equal(weights, [[0, 0], [0, 1]])


def test_minus_inf_bias_hides_key_and_finite_bias_adds() -> None:
    # q = 0: logits are the bias. [0, -inf, 0] -> key 1 hidden, the others share: [0.5, 0, 0.5]
    # [0, log 2, -inf] -> softmax over [0, log 2] = [1, 2] / 3
    bias = np.array([[0.0, -np.inf, 0.0], [0.0, math.log(2), -np.inf], [-np.inf, -np.inf, -np.inf]])
    out, weights = oracle.sdpa(np.zeros((3, 1)), np.ones((3, 1)), np.eye(3), bias=bias)
    np.testing.assert_allclose(weights, [[0.5, 0, 0.5], [1 / 3, 2 / 3, 0], [0, 0, 0]], rtol=1e-15)
    np.testing.assert_allclose(out, weights, rtol=1e-15)  # v = I; the all -inf row is zeros, not NaN


def test_leading_axes_mask_and_bias_broadcast() -> None:
    # q (2, 1, L, E) with k, v (1, 3, S, ...) -> (2, 3) batch; each batch entry is the unbatched result
    rng = np.random.default_rng(1)
    q, k, v = rng.normal(size=(2, 1, 4, 3)), rng.normal(size=(1, 3, 5, 3)), rng.normal(size=(1, 3, 5, 2))
    mask, bias = rng.random((3, 4, 5)) > 0.3, rng.normal(size=(5,))
    out, weights = oracle.sdpa(q, k, v, mask, bias=bias)
    assert out.shape == (2, 3, 4, 2) and weights.shape == (2, 3, 4, 5)
    for b in range(2):
        for h in range(3):
            out_bh, weights_bh = oracle.sdpa(q[b, 0], k[0, h], v[0, h], mask[h], bias=bias)
            np.testing.assert_array_equal(out[b, h], out_bh)
            np.testing.assert_array_equal(weights[b, h], weights_bh)


def test_mha_heads_are_contiguous_slices_with_identity_weights() -> None:
    # D = 4, H = 2, d_k = 2: head 0 sees columns 0:2, head 1 columns 2:4. W_q = sqrt(2) I cancels the
    # scale 1 / sqrt(d_k), so logits are x_i . x_j within the head; W_k = W_v = W_o = I, b_o = [1, 2, 3, 4].
    # x_0 = [1, 0, 0, 0], x_1 = [0, 0, 1, 0]
    # head 0: slices [1, 0], [0, 0]. query 0 logits [1, 0] -> [e, 1] / (1 + e), out e / (1 + e) [1, 0]
    #         query 1 logits [0, 0] -> [1/2, 1/2], out [1/2, 0]
    # head 1: slices [0, 0], [1, 0]. query 0 logits [0, 0] -> [1/2, 1/2], out [1/2, 0]
    #         query 1 logits [0, 1] -> [1, e] / (1 + e), out e / (1 + e) [1, 0]
    # (interleaved heads, columns 0, 2 and 1, 3, would give other numbers)
    x = np.array([[[1.0, 0, 0, 0], [0, 0, 1.0, 0]]])  # (B, L, D) = (1, 2, 4)
    b_o = np.array([1.0, 2, 3, 4])
    out, weights = oracle.multi_head_attention(_mha_state(4, w_q=math.sqrt(2), b_o=b_o), x, x, x, num_heads=2)
    p = math.e / (1 + math.e)
    np.testing.assert_allclose(out, np.array([[[p, 0, 0.5, 0], [0.5, 0, p, 0]]]) + b_o, rtol=1e-14)
    np.testing.assert_allclose(weights, [[[[p, 1 - p], [0.5, 0.5]], [[0.5, 0.5], [1 - p, p]]]], rtol=1e-14)


def test_half_precision_is_computed_in_float32_and_stored_in_half() -> None:
    # SPEC 2: float16 inputs give the float32 result on the same numbers, rounded once to float16
    q, k, v = (np.random.default_rng(seed).normal(size=(2, 3, 4)).astype(np.float16) for seed in range(3))
    k = k + np.float16(300)  # every score of a query shares a term near 300: float16 scores would lose the rest
    out, weights = oracle.sdpa(q, k, v, dtype=np.float16)
    out32, weights32 = oracle.sdpa(q, k, v, dtype=np.float32)
    assert out.dtype == weights.dtype == np.float16
    np.testing.assert_array_equal(out, out32.astype(np.float16))
    np.testing.assert_array_equal(weights, weights32.astype(np.float16))


def test_half_precision_linear_rounds_its_bias_in_once_or_after_the_product() -> None:
    # L = S = 1, D = 2, H = 1: the one weight is 1, so out = W_o v + b_o with v = [1, 2^-11] (W_v = I).
    # W_o's first row [1, 1] gives the product 1 + 2^-11, between the float16 neighbours 1 and 1 + 2^-10;
    # b_o = 2^-11. Fused: 1 + 2^-11 + 2^-11 = 1 + 2^-10 is rounded once, exactly. Apart: the product rounds
    # to 1 (a tie, to the even neighbour), then 1 + 2^-11 rounds to 1 again. float32 holds every sum.
    state = _mha_state(2, b_o=np.array([2.0**-11, 0])) | {"w_o.weight": np.array([[1.0, 1], [0, 1]])}
    v = np.array([[1.0, 2.0**-11]])  # (S, D)
    for dtype, fused_bias, expected in ((np.float16, True, 1 + 2.0**-10), (np.float16, False, 1.0),
                                        (np.float32, False, 1 + 2.0**-10)):
        out, _ = oracle.multi_head_attention(state, v, v, v, num_heads=1, dtype=dtype, fused_bias=fused_bias)
        assert out[0, 0] == expected, (dtype, fused_bias)


def test_mha_mask_broadcasts_over_heads() -> None:
    # a (B, 1, 1, S) padding mask hiding key 1: every head of every query puts all its weight on key 0
    x = np.random.default_rng(2).normal(size=(1, 3, 4))
    _, weights = oracle.multi_head_attention(_mha_state(4), x, x[:, :2], x[:, :2], np.array([True, False])
                                             .reshape(1, 1, 1, 2), num_heads=2)
    np.testing.assert_array_equal(weights, np.broadcast_to([1.0, 0.0], (1, 2, 3, 2)))


def test_layer_norm_of_known_vector_post_ln() -> None:
    # zero attention and FFN weights and biases: both branches give 0, so post-LN is x -> LN2(LN1(x)).
    # x = [1, 2, 3, 4]: mean 2.5, biased variance (2.25 + 0.25 + 0.25 + 2.25) / 4 = 1.25 (unbiased: 5/3),
    # eps = 0 -> LN1(x) = [-1.5, -0.5, 0.5, 1.5] / sqrt(1.25), which already has mean 0 and variance 1,
    # so LN2 only applies its gain and bias: 2 * LN1(x) + 1
    state = _block_state(4, 8, {"norm2.weight": np.full(4, 2.0), "norm2.bias": np.ones(4)})
    x, _ = oracle.transformer_block(state, np.array([[1.0, 2, 3, 4]]), num_heads=2, eps=0.0)
    np.testing.assert_allclose(x, [2 * np.array([-1.5, -0.5, 0.5, 1.5]) / math.sqrt(1.25) + 1], rtol=1e-14)


def test_layer_norm_eps_inside_square_root() -> None:
    # a constant vector has variance 0: (x - mean) / sqrt(0 + eps) = 0, so LN1(x) = bias; with eps
    # outside the root, or without it, this would be 0 / 0
    state = _block_state(2, 2, {"norm1.bias": [0.5, -0.5]})
    x, _ = oracle.transformer_block(state, np.array([[3.0, 3.0]]), num_heads=1, norm_first=False)
    # LN2 of [0.5, -0.5]: mean 0, variance 0.25 -> [0.5, -0.5] / sqrt(0.25 + 1e-5)
    np.testing.assert_allclose(x, [[0.5, -0.5] / np.sqrt(0.25 + 1e-5)], rtol=1e-14)


@pytest.mark.parametrize(("activation", "expected"), [("gelu", 0.8413447460685429), ("relu", 1.0)])
def test_pre_ln_ffn_activation(activation: str, expected: float) -> None:
    # D = 1: LN of a single entry is (x - x) / sqrt(0 + eps) * 1 + bias = bias. With attention weights zero
    # the attention branch is b_o = 0, so pre-LN gives x + FFN(norm2.bias); FFN(t) = 1 * act(1 * t + 0) + 0.
    # norm2.bias = 1: gelu(1) = 1 * Phi(1) = (1 + erf(1 / sqrt 2)) / 2 = 0.8413447460685429 (the tanh
    # approximation would give 0.8411919906); relu(1) = 1
    state = _block_state(1, 1, {"norm2.bias": [1.0], "ffn.0.weight": [[1.0]], "ffn.3.weight": [[1.0]]})
    x, _ = oracle.transformer_block(state, np.array([[5.0]]), num_heads=1, norm_first=True,
                                    activation=activation)
    np.testing.assert_allclose(x, [[5.0 + expected]], rtol=1e-15)


@pytest.mark.parametrize(("L", "S"), [(5, 7), (7, 5), (6, 6)])
def test_agrees_with_torch_sdpa_in_float64(L: int, S: int) -> None:
    torch = pytest.importorskip("torch")
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rng = np.random.default_rng(L * 10 + S)
    q, k, v = rng.normal(size=(2, 3, L, 8)), rng.normal(size=(2, 3, S, 8)), rng.normal(size=(2, 3, S, 6))
    mask = rng.random((2, 3, L, S)) > 0.4
    mask[..., 0] = True  # torch gives NaN or zeros for a fully masked row depending on version: avoid it
    bias = rng.normal(size=(L, S))
    bias[rng.random((L, S)) < 0.2] = -np.inf
    bias[:, 1] = 0.0  # key 1 stays visible through the bias
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))

    def check(expected: torch.Tensor, **kwargs: object) -> None:
        out, _ = oracle.sdpa(q, k, v, **kwargs)
        np.testing.assert_allclose(out, expected.numpy(), rtol=1e-12, atol=1e-12)

    check(sdpa(tq, tk, tv, attn_mask=torch.from_numpy(mask)), mask=mask)
    check(sdpa(tq, tk, tv, is_causal=True), is_causal=True)  # torch's causal mask is top-left aligned too
    check(sdpa(tq, tk, tv, attn_mask=torch.from_numpy(bias), scale=0.3), bias=bias, scale=0.3)


def test_the_oracles_mask_helpers_by_hand():
    # causal: query i sees keys 0..i; padding: sequence b sees its first lengths[b] keys, as (B, 1, 1, S)
    np.testing.assert_array_equal(oracle.causal_mask(2, 3), [[True, False, False], [True, True, False]])
    assert oracle.causal_mask(0, 3).shape == (0, 3) and oracle.causal_mask(3, 0).shape == (3, 0)
    np.testing.assert_array_equal(oracle.padding_mask([2, 0], 3), [[[[True, True, False]]], [[[False, False, False]]]])


# --- SPEC 2a: positions, windows, key lengths and soft-capping ------------------------------------------

def test_q_offset_s_minus_l_is_the_bottom_right_causal_rule() -> None:
    # L = 2, S = 4, q_offset = 2: query 0 at position 2 sees keys 0..2, query 1 at position 3 sees 0..3
    weights = oracle.sdpa(np.zeros((2, 1)), np.zeros((4, 1)), np.eye(4), is_causal=True, q_offset=2)[1]
    np.testing.assert_array_equal(weights, [[1 / 3, 1 / 3, 1 / 3, 0], [1 / 4] * 4])


def test_negative_offset_with_a_zero_right_side_hides_whole_rows() -> None:
    # window (None, 0), q_offset -1: query 0 at position -1 sees no key (zeros), query 1 key 0 alone
    out, weights = oracle.sdpa(np.zeros((2, 1)), np.zeros((3, 1)), np.eye(3), window=(None, 0), q_offset=-1)
    np.testing.assert_array_equal(weights, [[0, 0, 0], [1, 0, 0]])
    np.testing.assert_array_equal(out, weights)


def test_key_lengths_per_sequence() -> None:
    # equal scores: sequence 0 (length 1) puts weight 1 on key 0, sequence 1 (length 0) sees nothing
    weights = oracle.sdpa(np.zeros((2, 1, 1)), np.zeros((2, 3, 1)), np.zeros((2, 3, 1)),
                          key_lengths=np.array([1, 0]))[1]
    np.testing.assert_array_equal(weights, [[[1, 0, 0]], [[0, 0, 0]]])


def test_softcap_caps_before_the_bias() -> None:
    # raw logits [0, 100], softcap 1: capped [0, tanh(100)] = [0, 1] (to 1e-86), then bias [0, -inf]
    # hides key 1: weights [1, 0]; without the bias softmax([0, 1]) = [1, e] / (1 + e)
    q, k = np.array([[1.0]]), np.array([[0.0], [100.0]])
    capped = oracle.sdpa(q, k, np.eye(2), softcap=1.0)[1]
    np.testing.assert_allclose(capped, [[1 / (1 + math.e), math.e / (1 + math.e)]], rtol=1e-15)
    hidden = oracle.sdpa(q, k, np.eye(2), bias=np.array([0.0, -np.inf]), softcap=1.0)[1]
    np.testing.assert_array_equal(hidden, [[1, 0]])


def test_window_mask_and_causal_mask_with_offsets() -> None:
    # window (1, 0) at positions [2, 3]: keys 1..2 and 2..3; causal at the same positions: keys 0..2, 0..3
    np.testing.assert_array_equal(oracle.window_mask(2, 4, (1, 0), q_offset=2), [[0, 1, 1, 0], [0, 0, 1, 1]])
    np.testing.assert_array_equal(oracle.causal_mask(2, 4, q_offset=2), [[1, 1, 1, 0], [1, 1, 1, 1]])
    assert oracle.causal_mask(2, 4, q_offset=np.array([0, 2, 1])).shape == (3, 2, 4)


def test_mods_on_sdpa_by_hand_after_the_softcap_before_the_bias() -> None:
    # one query head of one sequence, q = 0: every raw score 0. ALiBi with slope 1 adds j - i: query 1 of scores
    # [-1, 0, 1] (keys 0..2); causal(q_offset=0) hides key 2 from query 1: weights of [-1, 0] = [1, e] / (1 + e);
    # the bias comes after the score function: a cap of 1 keeps the scores 0, then a bias of -5 on key 1 gives
    # [0, -5] (capping after the bias would give [0, tanh(-5)])

    q, k, v = np.zeros((1, 1, 2, 1)), np.zeros((1, 1, 3, 1)), np.eye(3)[None, None]  # (B, H, L, E), (B, H, S, *)
    alibi, causal = mods.alibi(np.array([1.0])), mods.causal()
    weights = oracle.sdpa(q, k, v, mask_mod=causal, score_mod=alibi)[1]
    np.testing.assert_allclose(weights[0, 0, 1], [1 / (1 + math.e), math.e / (1 + math.e), 0], rtol=1e-15)
    np.testing.assert_array_equal(weights[0, 0, 0], [1, 0, 0])  # query 0 sees key 0 alone
    biased = oracle.sdpa(q, k, v, bias=np.array([0.0, -5.0, 0.0]), mask_mod=causal, score_mod=mods.softcap(1.0))[1]
    np.testing.assert_allclose(biased[0, 0, 1], [1 / (1 + math.exp(-5)), math.exp(-5) / (1 + math.exp(-5)), 0],
                               rtol=1e-15)
    # softcap 1 first, then the score function: q . k_1 = 100 capped to tanh(100) = 1 (to 1e-86), then j - i = 0
    # added: query 1's scores [0 - 1, 1 + 0] = [-1, 1]
    q_big = np.ones((1, 1, 2, 1))
    capped = oracle.sdpa(q_big, np.array([[[[0.0], [100.0], [0.0]]]]), v, scale=1.0, softcap=1.0,
                         mask_mod=causal, score_mod=alibi)[1]
    np.testing.assert_allclose(capped[0, 0, 1], [1 / (1 + math.e**2), math.e**2 / (1 + math.e**2), 0], rtol=1e-15)


def test_mods_see_query_heads_and_unshifted_query_indices_and_a_minus_inf_score_hides() -> None:
    # grouped heads: 2 query heads on 1 key/value head; a score function of -inf for head 1's keys j > i hides them
    # (as a mask would), and q_offset shifts is_causal's positions but never q_idx: causal() with q_offset 1
    # and is_causal both on query 0 -> mods.causal hides key 1 (j > i = 0), is_causal keeps it (j <= 1)
    def hide_later_keys_in_head_1(score: np.ndarray, b: np.ndarray, h: np.ndarray, q_idx: np.ndarray,
                                  kv_idx: np.ndarray) -> np.ndarray:
        return np.where((h == 1) & (kv_idx > q_idx), -np.inf, score)

    q, k, v = np.zeros((1, 2, 2, 1)), np.zeros((1, 1, 2, 1)), np.eye(2)[None, None]
    weights = oracle.sdpa(q, k, v, enable_gqa=True, score_mod=hide_later_keys_in_head_1)[1]
    np.testing.assert_array_equal(weights[0, 0], [[0.5, 0.5], [0.5, 0.5]])
    np.testing.assert_array_equal(weights[0, 1], [[1, 0], [0.5, 0.5]])
    shifted = oracle.sdpa(q[:, :1], k, v, is_causal=True, q_offset=1, mask_mod=mods.causal())[1]
    np.testing.assert_array_equal(shifted[0, 0], [[1, 0], [0.5, 0.5]])


def test_latent_attention_of_one_position_is_its_value_up_projected_and_mixed() -> None:
    # L = 1: each head's one weight is 1 and RoPE at position 0 turns nothing, so o_h = v_C,h, the head's rows of
    # c_KV W_UKV^T past its En key rows, with c_KV = RMSNorm(h W_DKV^T[:Dc]) = u / sqrt(mean(u^2) + 1e-6) * g;
    # out = [o_1, o_2] W_O^T. H = 2, D = 3, Dc = 2, En = 1, Er = 2, Ev = 2, q_proj.
    rng = np.random.default_rng(0)
    state = {"q_proj.weight": rng.standard_normal((6, 3)), "kv_a_proj_with_mqa.weight": rng.standard_normal((4, 3)),
             "kv_a_layernorm.weight": np.array([0.5, 2.0]), "kv_b_proj.weight": rng.standard_normal((6, 2)),
             "o_proj.weight": rng.standard_normal((3, 4))}
    x = rng.standard_normal((1, 3))
    u = state["kv_a_proj_with_mqa.weight"][:2] @ x[0]  # (Dc,)
    c_kv = u / math.sqrt((u[0] ** 2 + u[1] ** 2) / 2 + 1e-6) * np.array([0.5, 2.0])
    w = state["kv_b_proj.weight"]  # rows: head 0 [k (1), v (2)], head 1 [k (1), v (2)]
    heads = np.concatenate([w[1:3] @ c_kv, w[4:6] @ c_kv])  # (H Ev,)
    out, weights = oracle.multi_head_latent_attention(state, x, num_heads=2)
    assert np.allclose(out, (state["o_proj.weight"] @ heads)[None], rtol=1e-13, atol=0)
    assert np.array_equal(weights, np.ones((2, 1, 1)))
