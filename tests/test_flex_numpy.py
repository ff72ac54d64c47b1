"""NumPy's flex_attention without torch: a case derived by hand, a dense float64 softmax written in the test over
the whole (B, H, L, S) grid, the hand-derived backward pass against central differences (the score functions'
parameters included), grouped-query heads against k and v repeated per head, the index arrays the mods receive,
a derivative's NaN at hidden keys kept out of the gradients, dtypes, empty inputs and the errors with their
messages. Then the mods on the older functions, where NumPy's own work shows: flash_attention with a block mask
(the tiles it computes, the mask function's calls), the hand-made vjps of sdpa, flash and the modules against
central differences (the score function's parameters included), the cached path's indices, and the errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

import attention_np as M
from attention_np.common import mods
from attention_np.common.block_mask import EMPTY, FULL, PARTIAL, BlockMask
from tests._compare import REORDERED, assert_close

RTOL = REORDERED  # float64: the same math computed another way
FD_STEP, FD_RTOL = 1e-6, 1e-6  # central differences: truncation O(h^2) ~ 1e-12, rounding ~ 1e-16 / h ~ 1e-10
B, H, L, S, E, EV = 2, 3, 7, 8, 4, 3
SEGMENTS = np.array([0, 0, 0, 1, 1, 2, 2, 2])  # (S,): three documents; the queries are the first L positions
CASES = {  # (mask_mod, score_mod)
    "none": (None, None),
    "causal_softcap": (mods.causal(), mods.softcap(1.2)),
    "document_alibi": (mods.document(SEGMENTS[:L], SEGMENTS), mods.alibi(np.array([0.5, 0.25, 1.0]))),
    "window_relative_bias": (mods.and_masks(mods.sliding_window(2, 1), mods.key_lengths(np.array([6, 8]))),
                             mods.relative_bias(np.random.default_rng(5).standard_normal((H, 5)))),
}


def _random(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape)


def _inputs(kv_heads: int = H) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _random(B, H, L, E), _random(B, kv_heads, S, E, seed=1), _random(B, kv_heads, S, EV, seed=2)


def _block_mask(mask_mod, tiles, batch=B, heads=H):
    return None if mask_mod is None else M.create_block_mask(mask_mod, batch, heads, L, S, BLOCK_SIZE=tiles)


def _dense(q, k, v, mask_mod, score_mod, scale):
    """The definition on the whole grid at once: R = score_mod(Q K^T * scale), the keys mask_mod hides at -inf,
    softmax over the keys (a query that sees none: zeros, lse -inf)."""
    b, h = np.arange(B).reshape(B, 1, 1, 1), np.arange(H).reshape(1, H, 1, 1)
    i, j = np.arange(L).reshape(1, 1, L, 1), np.arange(S).reshape(1, 1, 1, S)
    scores = np.einsum("bhie,bhje->bhij", q, k) * scale
    new = np.broadcast_to(scores if score_mod is None else score_mod(scores, b, h, i, j), scores.shape)
    visible = np.ones(scores.shape, bool) if mask_mod is None else np.broadcast_to(mask_mod(b, h, i, j), scores.shape)
    new = np.where(visible, new, -np.inf)
    top = np.max(new, axis=-1, keepdims=True)
    top = np.where(top == -np.inf, 0, top)
    weights = np.exp(new - top)
    total = np.sum(weights, axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = np.where(total[..., 0] == 0, -np.inf, top[..., 0] + np.log(total[..., 0]))
    return np.einsum("bhij,bhjd->bhid", weights / np.where(total == 0, 1, total), v), lse


def test_two_keys_by_hand():
    # q = 1, keys 0 and 1, scale 1: scores [0, 1]; ALiBi with slope 1 adds j - i = [0, 1]: R = [0, 2];
    # weights [1, e^2] / (1 + e^2); values [1, 0]: out = 1 / (1 + e^2), lse = log(1 + e^2)
    q, k, v = np.ones((1, 1, 1, 1)), np.array([0.0, 1.0]).reshape(1, 1, 2, 1), np.array([1.0, 0.0]).reshape(1, 1, 2, 1)
    out, lse = M.flex_attention(q, k, v, score_mod=mods.alibi(np.array([1.0])), scale=1.0, return_lse=True)
    assert_close(out, np.full((1, 1, 1, 1), 1 / (1 + math.e**2)), RTOL, "out")
    assert_close(lse, np.full((1, 1, 1), math.log(1 + math.e**2)), RTOL, "lse")


@pytest.mark.parametrize("tiles", [(1, 1), (2, 3), (4, 8), (128, 128)])
@pytest.mark.parametrize("name", CASES)
def test_equals_the_dense_softmax(name, tiles):
    mask_mod, score_mod = CASES[name]
    q, k, v = _inputs()
    expected_out, expected_lse = _dense(q, k, v, mask_mod, score_mod, 0.6)
    out, lse = M.flex_attention(q, k, v, score_mod=score_mod, block_mask=_block_mask(mask_mod, tiles), scale=0.6,
                                return_lse=True)
    assert_close(out, expected_out, RTOL, f"{name} out")
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(expected_lse))
    finite = np.isfinite(expected_lse)
    assert_close(lse[finite], expected_lse[finite], RTOL, f"{name} lse")


@pytest.mark.parametrize("name", CASES)
def test_the_rows_of_tiles_on_threads_equal_the_dense_softmax(name, monkeypatch):
    # the thread pool at any size (it starts above flash.PARALLEL_WORK otherwise): each row of query tiles writes
    # its own rows of out and lse, in whatever order the threads take them
    monkeypatch.setattr(M.flash, "PARALLEL_WORK", 0)  # flex.py runs its rows on flash.py's pool
    mask_mod, score_mod = CASES[name]
    q, k, v = _inputs()
    expected_out, expected_lse = _dense(q, k, v, mask_mod, score_mod, 0.6)
    out, lse = M.flex_attention(q, k, v, score_mod=score_mod, block_mask=_block_mask(mask_mod, (2, 3)), scale=0.6,
                                return_lse=True)
    assert_close(out, expected_out, RTOL, f"{name} out")
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(expected_lse))
    finite = np.isfinite(expected_lse)
    assert_close(lse[finite], expected_lse[finite], RTOL, f"{name} lse")


@pytest.mark.parametrize("tiles_per_run", [1, 2])
@pytest.mark.parametrize("name", ["causal_softcap", "document_alibi"])
def test_runs_of_key_tiles_cut_at_their_size_equal_the_dense_softmax(name, tiles_per_run, monkeypatch):
    # consecutive key tiles of a row are computed side by side, up to RUN_SCORES scores: here runs of one and
    # two tiles of 2 x 3 (B H 2 3 scores each) where the test's other sizes take a whole row at once
    monkeypatch.setattr(M.flex, "RUN_SCORES", tiles_per_run * B * H * 2 * 3)
    mask_mod, score_mod = CASES[name]
    q, k, v = _inputs()
    expected_out, expected_lse = _dense(q, k, v, mask_mod, score_mod, 0.6)
    out, lse = M.flex_attention(q, k, v, score_mod=score_mod, block_mask=_block_mask(mask_mod, (2, 3)), scale=0.6,
                                return_lse=True)
    assert_close(out, expected_out, RTOL, f"{name} out")
    finite = np.isfinite(expected_lse)
    assert_close(lse[finite], expected_lse[finite], RTOL, f"{name} lse")


def test_a_broadcast_block_mask_and_the_default_scale():
    q, k, v = _inputs()
    block_mask = M.create_block_mask(mods.causal(), None, None, L, S, BLOCK_SIZE=(3, 2))  # (1, 1, L, S)
    expected, _ = _dense(q, k, v, mods.causal(), None, 1 / math.sqrt(E))
    assert_close(M.flex_attention(q, k, v, block_mask=block_mask), expected, RTOL, "out")


def _directional_errors(loss, point, grads):
    """For each input, along a random direction u: <grad, u> against (loss(x + h u) - loss(x - h u)) / 2h,
    relative to |<grad, u>|."""
    rng, errors = np.random.default_rng(7), {}
    for name, x in point.items():
        u = rng.standard_normal(np.shape(x))
        numeric = (loss(name, x + FD_STEP * u) - loss(name, x - FD_STEP * u)) / (2 * FD_STEP)
        analytic = float(np.sum(grads[name] * u))
        errors[name] = abs(numeric - analytic) / abs(analytic)
    return errors


@pytest.mark.parametrize("name", ["causal_softcap", "document_alibi", "window_relative_bias"])
def test_backward_matches_central_differences(name):
    mask_mod, score_mod = CASES[name]
    q, k, v = _inputs()
    d_out, block_mask = _random(B, H, L, EV, seed=3), _block_mask(mask_mod, (2, 3))
    point = {"q": q, "k": k, "v": v, **score_mod.parameters}

    def loss(which: str, value: np.ndarray) -> float:
        args = point | {which: value}
        mod = score_mod.replace(**{p: args[p] for p in score_mod.parameters})
        return float(np.sum(M.flex_attention(args["q"], args["k"], args["v"], score_mod=mod, block_mask=block_mask,
                                             scale=0.6) * d_out))

    _, _, pullback = M.flex_attention_vjp(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=0.6)
    dq, dk, dv, d_parameters = pullback(d_out)
    assert set(d_parameters) == set(score_mod.parameters)
    for which, error in _directional_errors(loss, point, {"q": dq, "k": dk, "v": dv, **d_parameters}).items():
        assert error <= FD_RTOL, f"{name}: d{which} off by {error:.3g}"


def test_grouped_heads_equal_k_and_v_repeated_with_their_gradients_summed():
    mask_mod, score_mod = CASES["window_relative_bias"]
    q, k, v = _random(B, 4, L, E), _random(B, 2, S, E, seed=1), _random(B, 2, S, EV, seed=2)
    d_out = _random(B, 4, L, EV, seed=3)
    score_mod = mods.relative_bias(_random(4, 5, seed=4))
    block_mask = M.create_block_mask(mask_mod, B, 4, L, S, BLOCK_SIZE=(2, 3))
    k_rep, v_rep = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)  # query head h reads key/value head h // 2
    out, lse, grouped = M.flex_attention_vjp(q, k, v, score_mod, block_mask, 0.6, enable_gqa=True)
    out_rep, lse_rep, repeated = M.flex_attention_vjp(q, k_rep, v_rep, score_mod, block_mask, 0.6)
    assert_close(out, out_rep, RTOL, "out")
    assert_close(lse, lse_rep, RTOL, "lse")
    (dq, dk, dv, d_table), (dq_rep, dk_rep, dv_rep, d_table_rep) = grouped(d_out), repeated(d_out)
    assert dk.shape == k.shape and dv.shape == v.shape
    assert_close(dq, dq_rep, RTOL, "dq")
    assert_close(dk, dk_rep.reshape(B, 2, 2, S, E).sum(axis=2), RTOL, "dk")
    assert_close(dv, dv_rep.reshape(B, 2, 2, S, EV).sum(axis=2), RTOL, "dv")
    assert_close(d_table["table"], d_table_rep["table"], RTOL, "dtable")


def test_the_mods_receive_index_arrays_of_the_tile():
    shapes = set()

    def record(b, h, q_idx, kv_idx):
        shapes.add((b.shape, h.shape, q_idx.shape, kv_idx.shape))
        return kv_idx <= q_idx

    block_mask = M.create_block_mask(mods.causal(), B, H, L, S, BLOCK_SIZE=(4, 8))
    block_mask = BlockMask(mask_mod=record, shape=block_mask.shape, block_size=(4, 8), tiles=block_mask.tiles)
    M.flex_attention(*_inputs(), score_mod=lambda score, *indices: record(*indices) * score, block_mask=block_mask)
    # tiles (4, 8) over L = 7, S = 8: a full tile of 4 queries and a partial one of 3 (the last, shorter)
    assert shapes == {((B, 1, 1, 1), (1, H, 1, 1), (1, 1, rows, 1), (1, 1, 1, S)) for rows in (4, 3)}


def test_a_nan_derivative_at_hidden_keys_stays_out_of_the_gradients():
    # the identity, whose derivative is NaN at the keys the causal mask hides: those entries are never used
    nan_beyond = mods.ScoreMod("nan beyond the diagonal", lambda score, b, h, q_idx, kv_idx: score,
                               derivative=lambda d_new, score, b, h, q_idx, kv_idx:
                               (np.where(kv_idx > q_idx, np.nan, d_new), {}))
    q, k, v = _inputs()
    d_out = _random(B, H, L, EV, seed=3)
    block_mask = M.create_block_mask(mods.causal(), B, H, L, S, BLOCK_SIZE=(2, 3))
    _, _, pullback = M.flex_attention_vjp(q, k, v, nan_beyond, block_mask, 0.6)
    _, _, plain = M.flex_attention_vjp(q, k, v, None, block_mask, 0.6)
    for what, got, expected in zip("qkv", pullback(d_out)[:3], plain(d_out)[:3], strict=True):
        assert_close(got, expected, RTOL, f"d{what}")


def test_a_query_whose_scores_are_all_minus_inf_gets_zeros_and_no_gradient():
    hide_query_0 = mods.ScoreMod("hide query 0", lambda score, b, h, q_idx, kv_idx:
                                 np.where(q_idx == 0, -np.inf, score), derivative=lambda d_new, *rest: (d_new, {}))
    q, k, v = _inputs()
    out, lse, pullback = M.flex_attention_vjp(q, k, v, hide_query_0, None, 0.6)
    assert np.all(out[:, :, 0] == 0) and np.all(lse[:, :, 0] == -np.inf) and np.all(np.isfinite(lse[:, :, 1:]))
    dq, dk, dv, _ = pullback(_random(B, H, L, EV, seed=3))
    assert np.all(dq[:, :, 0] == 0) and all(np.all(np.isfinite(d)) for d in (dq, dk, dv))


@pytest.mark.parametrize("dtype, work", [(np.float32, np.float32), (np.float16, np.float32), (np.float64, np.float64)])
def test_dtypes(dtype, work):
    q, k, v = (x.astype(dtype) for x in _inputs())
    score_mod = mods.alibi(np.array([0.5, 0.25, 1.0]))  # float64 slopes: the gradient keeps their dtype
    out, lse, pullback = M.flex_attention_vjp(q, k, v, score_mod, _block_mask(mods.causal(), (2, 3)))
    assert out.dtype == dtype and lse.dtype == work
    dq, dk, dv, d_parameters = pullback(np.ones(out.shape, dtype))
    assert (dq.dtype, dk.dtype, dv.dtype, d_parameters["slopes"].dtype) == (dtype, dtype, dtype, np.float64)


@pytest.mark.parametrize("lengths", [(0, S), (L, 0), (0, 0)])
def test_no_queries_or_no_keys(lengths):
    n_q, n_k = lengths
    q, k, v = _random(B, H, n_q, E), _random(B, H, n_k, E, seed=1), _random(B, H, n_k, EV, seed=2)
    block_mask = M.create_block_mask(mods.causal(), B, H, n_q, n_k, BLOCK_SIZE=(2, 3))
    out, lse, pullback = M.flex_attention_vjp(q, k, v, mods.softcap(2.0), block_mask)
    assert out.shape == (B, H, n_q, EV) and np.all(out == 0)
    assert lse.shape == (B, H, n_q) and np.all(lse == -np.inf)
    dq, dk, dv, _ = pullback(np.ones(out.shape))
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert not (np.any(dq) or np.any(dk) or np.any(dv))


def test_inputs_need_four_axes():
    q, k, v = _inputs()
    with pytest.raises(ValueError, match=r"q must have shape \(B, H, L, E\); got \(3, 7, 4\)"):
        M.flex_attention(q[0], k[0], v[0])


def test_a_block_mask_of_other_scores_is_refused():
    block_mask = M.create_block_mask(mods.causal(), B, H, L, S + 1)
    with pytest.raises(ValueError, match=r"made for scores \(2, 3, 7, 9\).*do not fit these scores \(2, 3, 7, 8\)"):
        M.flex_attention(*_inputs(), block_mask=block_mask)


def test_a_mask_function_returning_floats_is_refused():
    tiles = np.full((B, H, 1, 1), PARTIAL, np.uint8)
    block_mask = BlockMask(mask_mod=lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) * 1.0, shape=(B, H, L, S),
                           block_size=(128, 128), tiles=tiles)
    with pytest.raises(TypeError, match=r"mask_mod must return booleans.*float64"):
        M.flex_attention(*_inputs(), block_mask=block_mask)


def test_a_score_function_changing_the_shape_is_refused():
    with pytest.raises(ValueError, match=r"score_mod returned shape \(2, 3, 7\) for scores of shape \(2, 3, 7, 8\)"):
        M.flex_attention(*_inputs(), score_mod=lambda score, b, h, q_idx, kv_idx: score.sum(axis=-1))


def test_a_score_function_without_a_derivative_is_refused_by_the_vjp():
    def doubled(score, b, h, q_idx, kv_idx):
        return score * 2

    q, k, v = _inputs()
    M.flex_attention(q, k, v, score_mod=doubled)  # the forward pass needs no derivative
    with pytest.raises(ValueError, match=r"score_mod doubled has no derivative.*vjp"):
        M.flex_attention_vjp(q, k, v, score_mod=doubled)


def test_the_pullback_checks_d_out():
    q, k, v = _inputs()
    _, _, pullback = M.flex_attention_vjp(q, k, v)
    with pytest.raises(ValueError, match="d_out must have the output's shape"):
        pullback(np.ones((B, H, L, EV + 1)))


# --- the mods on flash_attention and the modules (NumPy's own: what its tiles compute and its hand-made vjps) ----

def _touched(calls: list, tiles: tuple[int, int]) -> set[tuple[int, int]]:
    """The (query tile, key tile) pairs that the recorded calls' (q_idx, kv_idx) fall in."""
    return {(int(i), int(j)) for q_idx, kv_idx in calls for i in np.ravel(q_idx) // tiles[0]
            for j in np.ravel(kv_idx) // tiles[1]}


def test_flash_with_a_block_mask_skips_empty_tiles_and_masks_partial_ones_only():
    # forward and backward: the mask function runs on the partial tiles and on them only, the score function and
    # its derivative on every tile computed, never on an empty one
    tiles, mask_calls, score_calls = (2, 3), [], []
    mask_mod = mods.and_masks(mods.causal(), mods.key_lengths(np.array([8, 5])))
    made = M.create_block_mask(mask_mod, B, H, L, S, BLOCK_SIZE=tiles)

    def recorded_mask(b, h, q_idx, kv_idx):
        mask_calls.append((q_idx, kv_idx))
        return mask_mod(b, h, q_idx, kv_idx)

    def recorded_score(score, b, h, q_idx, kv_idx):
        score_calls.append((q_idx, kv_idx))
        return score * 0.5

    def recorded_derivative(d_new, score, b, h, q_idx, kv_idx):
        score_calls.append((q_idx, kv_idx))
        return d_new * 0.5, {}

    block_mask = BlockMask(mask_mod=recorded_mask, shape=made.shape, block_size=tiles, tiles=made.tiles)
    score_mod = mods.ScoreMod("halved", recorded_score, derivative=recorded_derivative)
    _, _, pullback = M.flash_attention_vjp(*_inputs(), block_mask=block_mask, score_mod=score_mod)
    pullback(_random(B, H, L, EV, seed=3))
    kinds = made.batch_kinds()
    partial, empty, full = ({(int(i), int(j)) for i, j in zip(*np.nonzero(kinds == kind), strict=True)}
                            for kind in (PARTIAL, EMPTY, FULL))
    assert partial and empty and full, "the case has tiles of every kind"
    assert _touched(mask_calls, tiles) == partial, "the mask function on the partial tiles, and on them only"
    assert _touched(score_calls, tiles) == partial | full, "the score function on every tile computed, no empty one"


def test_flash_with_a_block_mask_equals_the_dense_softmax():
    mask_mod, score_mod = CASES["window_relative_bias"]
    q, k, v = _inputs()
    expected, _ = _dense(q, k, v, mask_mod, score_mod, 0.6)
    out, _ = M.flash_attention(q, k, v, block_mask=_block_mask(mask_mod, (2, 3)), score_mod=score_mod, scale=0.6)
    assert_close(out, expected, RTOL, "out")


@pytest.mark.parametrize("function", ["scaled_dot_product_attention_vjp", "flash_attention_vjp"])
def test_the_vjps_match_central_differences_with_a_score_mod(function):
    mask_mod, score_mod = CASES["document_alibi"]
    q, k, v = _inputs()
    d_out = _random(B, H, L, EV, seed=3)
    point = {"q": q, "k": k, "v": v, **score_mod.parameters}
    vjp = getattr(M, function)

    def loss(which: str, value: np.ndarray) -> float:
        args = point | {which: value}
        mod = score_mod.replace(**{p: args[p] for p in score_mod.parameters})
        out, _, _ = vjp(args["q"], args["k"], args["v"], mask_mod=mask_mod, score_mod=mod, scale=0.6)
        return float(np.sum(out * d_out))

    _, _, pullback = vjp(q, k, v, mask_mod=mask_mod, score_mod=score_mod, scale=0.6)
    dq, dk, dv, dbias, d_parameters = pullback(d_out)
    assert dbias is None and set(d_parameters) == {"slopes"}
    for which, error in _directional_errors(loss, point, {"q": dq, "k": dk, "v": dv, **d_parameters}).items():
        assert error <= FD_RTOL, f"{function}: d{which} off by {error:.3g}"


@pytest.mark.parametrize("kind", ["mha", "post_ln", "pre_ln"])
def test_module_vjps_give_the_score_function_parameters_gradients(kind):
    D, slopes, mask_mod = 8, np.array([0.5, 0.25]), mods.causal()
    if kind == "mha":
        module = M.MultiHeadAttention(D, 2, 0.0, rng=0, dtype=np.float64)
    else:
        module = M.TransformerBlock(D, 2, 16, 0.0, norm_first=kind == "pre_ln", rng=0, dtype=np.float64)
    x, d_out = _random(B, L, D, seed=4), _random(B, L, D, seed=5)
    inputs = (x, x, x) if kind == "mha" else (x,)
    _, _, pullback = module.vjp(*inputs, mask_mod=mask_mod, score_mod=mods.alibi(slopes))
    grads = pullback(d_out)[-1]
    assert set(grads) == set(module.state_dict()) | {"score_mod.slopes"}

    def loss(which: str, value: np.ndarray) -> float:
        out, _ = module(*inputs, mask_mod=mask_mod, score_mod=mods.alibi(value))
        return float(np.sum(out * d_out))

    error = _directional_errors(loss, {"slopes": slopes}, {"slopes": grads["score_mod.slopes"]})["slopes"]
    assert error <= FD_RTOL, f"{kind}: dslopes off by {error:.3g}"


def test_extend_gives_the_mods_the_new_queries_and_the_cache_keys():
    # two steps over an empty cache, a mask function on the keys alone (key 1 hidden): kv_idx runs over the
    # cache, so the steps' rows equal the whole call's, causal and the same mask function
    D, hide_key_1 = 8, mods.MaskMod("key 1 hidden", lambda b, h, q_idx, kv_idx: kv_idx != 1)
    mha = M.MultiHeadAttention(D, 2, 0.0, rng=0, dtype=np.float64)
    x = _random(B, L, D, seed=6)
    cache = mha.init_cache((B,), L + 2)
    first, _, cache = mha.extend(x[:, :4], x[:, :4], cache, mask_mod=hide_key_1)
    second, _, cache = mha.extend(x[:, 4:], x[:, 4:], cache, mask_mod=hide_key_1)
    whole, _ = mha(x, x, x, mask_mod=mods.and_masks(mods.causal(), hide_key_1))
    assert_close(np.concatenate([first, second], axis=1), whole, RTOL, "out")


def test_linear_attention_modules_refuse_the_mods():
    mha = M.MultiHeadAttention(8, 2, 0.0, attention="linear", rng=0)
    x = _random(B, L, 8).astype(np.float32)
    for name, mod in (("mask_mod", mods.causal()), ("score_mod", mods.softcap(1.0))):
        with pytest.raises(ValueError, match=f"{name} must be None with attention='linear'"):
            mha(x, x, x, **{name: mod})


def test_module_inputs_without_a_batch_axis_fail_the_four_axes_check():
    mha = M.MultiHeadAttention(8, 2, 0.0, rng=0)
    x = _random(L, 8).astype(np.float32)  # heads (H, L, d_k): three axes
    with pytest.raises(ValueError, match=r"four axes.*got q \(2, 7, 4\)"):
        mha(x, x, x, mask_mod=mods.causal())
