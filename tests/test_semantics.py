"""The spec, line by line, on every backend in float64: masks, causality, bias, scale, broadcasting,
errors, dtypes, LayerNorm, GELU and the two block layouts. Known values are derived by hand."""

from __future__ import annotations

import math
from types import ModuleType

import numpy as np
import pytest

from tests._compare import REORDERED, assert_close


def _arrays(M: ModuleType, *arrays: object, dtype: type = np.float64) -> list:
    return [None if a is None else M.asarray(np.asarray(a, dtype)) for a in arrays]


def _sdpa(M: ModuleType, q, k, v, mask=None, bias=None, **options) -> tuple[np.ndarray, np.ndarray | None]:
    """M's attention on float64 NumPy inputs (mask keeps its own dtype); outputs as NumPy arrays."""
    q, k, v, bias = _arrays(M, q, k, v, bias)
    mask = None if mask is None else M.asarray(np.asarray(mask))
    out, weights = M.scaled_dot_product_attention(q, k, v, mask, bias=bias, **options)
    return M.to_numpy(out), None if weights is None else M.to_numpy(weights)


def _random(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape)


def _block_state(D: int, **entries: object) -> dict[str, np.ndarray]:
    """A float64 block state with d_model D and d_ff = D: every entry zero unless given in `entries`
    (names with "." written as "__"), LayerNorm weights one."""
    state = {f"attn.w_{p}.{part}": np.zeros((D, D) if part == "weight" else D)
             for p in "qkvo" for part in ("weight", "bias")}
    state |= {f"norm{i}.weight": np.ones(D) for i in (1, 2)} | {f"norm{i}.bias": np.zeros(D) for i in (1, 2)}
    state |= {"ffn.0.weight": np.zeros((D, D)), "ffn.0.bias": np.zeros(D),
              "ffn.3.weight": np.zeros((D, D)), "ffn.3.bias": np.zeros(D)}
    state |= {name.replace("__", "."): np.asarray(value, np.float64) for name, value in entries.items()}
    return state


# --- masks ----------------------------------------------------------------------------------------

def test_mask_zero_hides_the_key(backend):
    # one query, two keys, mask [True, False]: the softmax runs over key 0 alone, so its weight is 1
    # and the output is exactly v_0, whatever the scores
    q, k, v = [[1.0, 0.0]], [[1.0, 0.0], [0.0, 1.0]], [[10.0, 20.0], [30.0, 40.0]]
    out, weights = _sdpa(backend, q, k, v, mask=[[True, False]])
    np.testing.assert_array_equal(weights, [[1.0, 0.0]])
    np.testing.assert_array_equal(out, [[10.0, 20.0]])


def test_integer_mask_equals_boolean_mask(backend):
    q, k, v = _random(3, 4, seed=0), _random(5, 4, seed=1), _random(5, 2, seed=2)
    mask = np.random.default_rng(3).random((3, 5)) < 0.6
    mask[:, 0] = True  # every query sees at least one key
    as_bool = _sdpa(backend, q, k, v, mask=mask)
    as_int = _sdpa(backend, q, k, v, mask=mask.astype(np.int64))
    for a, b in zip(as_bool, as_int, strict=True):
        np.testing.assert_array_equal(a, b)


def test_fully_masked_row_gives_zeros_and_leaves_other_rows_alone(backend):
    q, k, v = 30 * _random(3, 4, seed=0), _random(5, 4, seed=1), _random(5, 2, seed=2)  # large logits
    mask = np.array([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0], [1, 0, 1, 1, 1]], bool)
    out, weights = _sdpa(backend, q, k, v, mask=mask)
    assert not np.isnan(out).any() and not np.isnan(weights).any()
    np.testing.assert_array_equal(out[1], 0.0)
    np.testing.assert_array_equal(weights[1], 0.0)
    # rows are independent: rows 0 and 2 are those of the same call with row 1 fully visible
    visible = mask.copy()
    visible[1] = True
    out_visible, weights_visible = _sdpa(backend, q, k, v, mask=visible)
    np.testing.assert_array_equal(out[[0, 2]], out_visible[[0, 2]])
    np.testing.assert_array_equal(weights[[0, 2]], weights_visible[[0, 2]])


def test_causal_mask_and_padding_mask_helpers(backend):
    # causal: query i sees keys j <= i; padding: sequence b sees its first lengths[b] keys
    np.testing.assert_array_equal(backend.to_numpy(backend.causal_mask(2, 3)), [[1, 0, 0], [1, 1, 0]])
    padding = backend.to_numpy(backend.padding_mask(backend.asarray(np.array([1, 3])), 4))
    assert padding.shape == (2, 1, 1, 4) and padding.dtype == bool
    np.testing.assert_array_equal(padding[:, 0, 0], [[1, 0, 0, 0], [1, 1, 1, 0]])


# --- causality and bias ---------------------------------------------------------------------------

@pytest.mark.parametrize(("L", "S", "expected"), [
    (2, 3, [[1, 0, 0], [0.5, 0.5, 0]]),  # L < S: row 0 sees key 0, row 1 keys 0 and 1, key 2 nobody
    (3, 2, [[1, 0], [0.5, 0.5], [0.5, 0.5]]),  # L > S: rows 1 and 2 see both keys
    (3, 3, [[1, 0, 0], [0.5, 0.5, 0], [1 / 3, 1 / 3, 1 / 3]]),
])
def test_is_causal_hides_later_keys_top_left_aligned(backend, L: int, S: int, expected: list):
    # zero queries make every score 0, so each row is uniform over the keys it may see (j <= i)
    v = np.arange(2 * S, dtype=np.float64).reshape(S, 2)
    out, weights = _sdpa(backend, np.zeros((L, 4)), _random(S, 4), v, is_causal=True)
    assert_close(weights, np.array(expected), 1e-15, "weights")
    assert_close(out, np.array(expected) @ v, 1e-15, "out")


def test_is_causal_combines_with_the_mask(backend):
    # zero queries: uniform over the visible keys. Row 0: causal {0} and mask {0, 1, 2} leave key 0;
    # row 1: causal {0, 1} and mask {1, 2} leave key 1
    mask = np.array([[1, 1, 1], [0, 1, 1]], bool)
    _, weights = _sdpa(backend, np.zeros((2, 4)), _random(3, 4), _random(3, 2), mask=mask, is_causal=True)
    np.testing.assert_array_equal(weights, [[1, 0, 0], [0, 1, 0]])


def test_bias_is_added_and_minus_inf_hides_the_key(backend):
    # zero queries: scores = bias = [log 3, 0, -inf] -> weights exp(scores) / sum = [3, 1, 0] / 4
    bias = np.array([[math.log(3), 0.0, -np.inf]])
    _, weights = _sdpa(backend, np.zeros((1, 4)), _random(3, 4), _random(3, 2), bias=bias)
    assert_close(weights, np.array([[0.75, 0.25, 0.0]]), 1e-15, "weights")
    assert weights[0, 2] == 0.0


def test_nan_in_a_visible_score_propagates(backend):
    q = _random(3, 4)
    q[1, 0] = np.nan  # row 1's scores are all NaN; rows 0 and 2 are untouched
    out, weights = _sdpa(backend, q, _random(5, 4, seed=1), _random(5, 2, seed=2))
    assert np.isnan(out[1]).all() and np.isnan(weights[1]).all()
    assert not np.isnan(out[[0, 2]]).any()


# --- scale and weights ----------------------------------------------------------------------------

def test_default_scale_is_one_over_sqrt_E(backend):
    # E = 4: q.k = [0, 2], scale 1/sqrt(4) = 0.5 -> scores [0, 1] -> weights [1, e] / (1 + e);
    # v = identity, so out = weights
    q, k, v = [[1.0, 0, 0, 0]], [[0.0, 0, 0, 0], [2.0, 0, 0, 0]], np.eye(2)
    out, weights = _sdpa(backend, q, k, v)
    expected = np.array([[1, math.e]]) / (1 + math.e)
    assert_close(weights, expected, 1e-15, "weights")
    assert_close(out, expected, 1e-15, "out")


def test_custom_scale_multiplies_the_scores(backend):
    # q.k = [0, 2], scale 0.25 -> scores [0, 0.5] -> weights [1, e^0.5] / (1 + e^0.5)
    q, k, v = [[1.0, 0, 0, 0]], [[0.0, 0, 0, 0], [2.0, 0, 0, 0]], np.eye(2)
    _, weights = _sdpa(backend, q, k, v, scale=0.25)
    assert_close(weights, np.array([[1, math.sqrt(math.e)]]) / (1 + math.sqrt(math.e)), 1e-15, "weights")


@pytest.mark.parametrize("call", ["explicit", "fast", "vjp"])
def test_default_scale_with_E_zero_raises_naming_E_and_the_shapes(backend, call: str):
    # 1 / sqrt(E) has no value for E = 0: the shared checks raise one ValueError in every backend
    q, k, v = _arrays(backend, np.zeros((2, 3, 0)), np.zeros((2, 4, 0)), np.zeros((2, 4, 2)))
    with pytest.raises(ValueError) as error:
        if call == "vjp":
            backend.scaled_dot_product_attention_vjp(q, k, v)
        else:
            backend.scaled_dot_product_attention(q, k, v, need_weights=call == "explicit")
    assert str(error.value) == ("the default scale 1 / sqrt(E) needs E > 0; q (2, 3, 0) and k (2, 4, 0) have "
                                "width E = 0: pass scale= explicitly")


@pytest.mark.parametrize("need_weights", [True, False], ids=["explicit", "fast"])
def test_explicit_scale_with_E_zero_gives_scores_of_zero(backend, need_weights: bool):
    # E = 0: each q.k is an empty sum, 0, so every score is 0 and the weights are uniform over the visible keys;
    # key 0 hidden from query 1: weights [[1/3, 1/3, 1/3], [0, 1/2, 1/2]], out = weights v
    v, mask = np.arange(6.0).reshape(3, 2), np.array([[True, True, True], [False, True, True]])
    expected = np.array([[1 / 3, 1 / 3, 1 / 3], [0, 1 / 2, 1 / 2]])
    out, weights = _sdpa(backend, np.zeros((2, 0)), np.zeros((3, 0)), v, mask=mask, scale=1.0,
                         need_weights=need_weights)
    assert_close(out, expected @ v, 1e-15, "out")
    if need_weights:
        assert_close(weights, expected, 1e-15, "weights")


def test_explicit_scale_with_E_zero_has_gradients(backend):
    # scores 0 whatever q and k are: dq (2, 0) and dk (3, 0) are empty; dv = weights^T d_out, weights 1/3 each
    q, k, v = _arrays(backend, np.zeros((2, 0)), np.zeros((3, 0)), np.ones((3, 2)))
    _, _, pullback = backend.scaled_dot_product_attention_vjp(q, k, v, scale=1.0)
    dq, dk, dv, _ = (None if g is None else backend.to_numpy(g) for g in pullback(backend.asarray(np.ones((2, 2)))))
    assert dq.shape == (2, 0) and dk.shape == (3, 0)
    assert_close(dv, np.full((3, 2), 2 / 3), 1e-15, "dv")


def test_weights_rows_sum_to_one_where_any_key_is_visible(backend):
    mask = np.random.default_rng(3).random((2, 3, 4, 5)) < 0.5
    mask[0, 1, 2] = False  # at least one fully masked row
    _, weights = _sdpa(backend, _random(2, 3, 4, 6), _random(2, 3, 5, 6, seed=1), _random(2, 3, 5, 2, seed=2),
                       mask=mask)
    expected = np.where(mask.any(axis=-1), 1.0, 0.0)
    np.testing.assert_allclose(weights.sum(axis=-1), expected, rtol=0, atol=1e-12)


def test_need_weights_false_returns_none(backend):
    x = backend.asarray(_random(1, 3, 4))
    assert backend.scaled_dot_product_attention(x, x, x, need_weights=False)[1] is None
    mha = backend.MultiHeadAttention.from_state_dict(
        {name.removeprefix("attn."): value for name, value in _block_state(4).items()
         if name.startswith("attn.")}, num_heads=2).eval()
    assert mha(x, x, x, need_weights=False)[1] is None
    block = backend.TransformerBlock.from_state_dict(_block_state(4), num_heads=2).eval()
    assert block(x, need_weights=False)[1] is None


# --- shapes, errors and dtypes --------------------------------------------------------------------

def test_leading_axes_broadcast(backend):
    L, S, E, Ev = 3, 4, 5, 2
    q, k, v = _random(2, 1, L, E), _random(1, 3, S, E, seed=1), _random(1, 3, S, Ev, seed=2)
    out, weights = _sdpa(backend, q, k, v)
    assert out.shape == (2, 3, L, Ev) and weights.shape == (2, 3, L, S)
    for b in range(2):
        for h in range(3):
            out_bh, weights_bh = _sdpa(backend, q[b, 0], k[0, h], v[0, h])
            assert_close(out[b, h], out_bh, REORDERED, f"out[{b}, {h}]")
            assert_close(weights[b, h], weights_bh, REORDERED, f"weights[{b}, {h}]")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_output_dtype_is_the_input_dtype(backend, dtype: type):
    q, k, v = _arrays(backend, _random(3, 4), _random(5, 4), _random(5, 2), dtype=dtype)
    bias = backend.asarray(np.zeros((3, 5)))  # float64 bias is cast to the dtype of q
    out, weights = backend.scaled_dot_product_attention(q, k, v, bias=bias)
    assert backend.to_numpy(out).dtype == backend.to_numpy(weights).dtype == dtype


# --- multi-head attention -------------------------------------------------------------------------

def test_mha_heads_are_contiguous_slices_scaled_by_one_over_sqrt_d_k(backend):
    # identity projections, zero biases: head h attends with x[..., 2h:2h+2] as q, k and v and the
    # default scale 1/sqrt(d_k) = 1/sqrt(2); concatenating the heads and W_o = I gives the output
    D, H = 4, 2
    state = {f"w_{p}.weight": np.eye(D) for p in "qkvo"} | {f"w_{p}.bias": np.zeros(D) for p in "qkvo"}
    mha = backend.MultiHeadAttention.from_state_dict(state, num_heads=H).eval()
    x = _random(2, 3, D)
    out, weights = mha(*_arrays(backend, x, x, x))
    heads = [_sdpa(backend, x[..., 2 * h:2 * h + 2], x[..., 2 * h:2 * h + 2], x[..., 2 * h:2 * h + 2])
             for h in range(H)]
    assert_close(backend.to_numpy(out), np.concatenate([o for o, _ in heads], axis=-1), REORDERED, "out")
    assert_close(backend.to_numpy(weights), np.stack([w for _, w in heads], axis=-3), REORDERED, "weights")


# --- the block: LayerNorm, GELU, post-LN and pre-LN -----------------------------------------------

def test_post_ln_block_with_zero_branches_is_layer_norm_with_biased_variance_and_eps_in_the_sqrt(backend):
    # zero attention and FFN weights make both branches 0, so post-LN gives LN_2(LN_1(x)). With D = 2:
    # x = [1, 3]: mean 2, biased variance ((1-2)^2 + (3-2)^2) / 2 = 1 (unbiased would be 2);
    # eps = 3, norm1.weight = 2: LN_1(x) = [-1, 1] / sqrt(1 + 3) * 2 = [-1, 1]
    # LN_2([-1, 1]) = [-1, 1] / sqrt(1 + 3) = [-0.5, 0.5], plus norm2.bias [10, 20] -> [9.5, 20.5]
    # (unbiased variance would give [9.583, 20.417]; eps outside the sqrt [9.857, 20.143])
    state = _block_state(2, norm1__weight=[2.0, 2.0], norm2__bias=[10.0, 20.0])
    block = backend.TransformerBlock.from_state_dict(state, num_heads=1, eps=3.0).eval()
    out, _ = block(backend.asarray(np.array([[1.0, 3.0]])))
    assert_close(backend.to_numpy(out), np.array([[9.5, 20.5]]), 1e-15, "post-LN")


def test_pre_ln_block_with_zero_branches_is_the_identity(backend):
    # pre-LN: x + MHA(LN_1(x)) + FFN(LN_2(...)) with both branches 0 returns x unchanged, where the
    # post-LN block (test above) returns [9.5, 20.5]
    state = _block_state(2, norm1__weight=[2.0, 2.0], norm2__bias=[10.0, 20.0])
    block = backend.TransformerBlock.from_state_dict(state, num_heads=1, eps=3.0, norm_first=True).eval()
    out, _ = block(backend.asarray(np.array([[1.0, 3.0]])))
    np.testing.assert_array_equal(backend.to_numpy(out), [[1.0, 3.0]])


@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_activation_is_relu_or_exact_erf_gelu(backend, activation: str):
    # pre-LN block with zero attention, norm2.weight 0 and norm2.bias c: LN_2(x) = c for every x, and
    # with ffn.0 = ffn.3 = identity (zero biases) the block returns x + act(c). With x = 0:
    # gelu(c) = c / 2 * (1 + erf(c / sqrt(2))) from math.erf; the tanh approximation is off by 1.5e-4
    c = [-1.0, 0.5]
    state = _block_state(2, norm2__weight=[0.0, 0.0], norm2__bias=c,
                   ffn__0__weight=np.eye(2), ffn__3__weight=np.eye(2))
    block = backend.TransformerBlock.from_state_dict(state, num_heads=1, norm_first=True,
                                                     activation=activation).eval()
    out, _ = block(backend.asarray(np.zeros((1, 2))))
    if activation == "gelu":
        expected = [x / 2 * (1 + math.erf(x / math.sqrt(2))) for x in c]
    else:
        expected = [max(x, 0.0) for x in c]
    assert_close(backend.to_numpy(out), np.array([expected]), 1e-14, activation)
