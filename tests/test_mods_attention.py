"""mask_mod= and score_mod= on scaled_dot_product_attention (both paths), flash_attention (with mask_mod, and with
block_mask= over odd tiles), their vjps and the modules, on every backend, against torch's own FlexAttention
(eager, CPU, float64; tests/test_flex.py's references and cases): values within 1e-12, gradients too, the score
functions' parameters included; then the keyword rules and the mods together, and the errors.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest

from attention_np.common import mods
from tests._compare import REORDERED, assert_close
from tests.test_flex import CASES, EV, HKV, B, H, L, S, _gradients_of, _inputs, _random, _reference_of

pytest.importorskip("torch.nn.attention.flex_attention")

RTOL = REORDERED
GRADIENT_CASES = ("none", "causal", "document", "alibi", "softcap", "relative_bias", "and", "nested", "empty_or")
JAX_FLASH_CASES = ("causal", "document", "alibi", "and", "nested", "empty_or")  # JAX compiles each: a few


def _attend(M: ModuleType, path: str, q, k, v, mask_mod, score_mod, **options) -> np.ndarray:
    """out of sdpa's explicit path ("weights"), its fast path ("fast"), flash with mask_mod ("flash") or flash
    with a block mask of odd tiles (4, 7) ("block_mask"), on NumPy inputs."""
    arrays = [M.asarray(x) for x in (q, k, v)]
    if path == "weights":
        out, weights = M.scaled_dot_product_attention(*arrays, mask_mod=mask_mod, score_mod=score_mod, scale=0.7,
                                                      **options)
        assert weights is not None
    elif path == "fast":
        out, _ = M.scaled_dot_product_attention(*arrays, mask_mod=mask_mod, score_mod=score_mod, scale=0.7,
                                                need_weights=False, **options)
    elif path == "flash":
        out, _ = M.flash_attention(*arrays, mask_mod=mask_mod, score_mod=score_mod, scale=0.7, block_q=2,
                                   block_k=3, **options)
    else:
        block_mask = None if mask_mod is None else M.create_block_mask(mask_mod, B, H, L, S, BLOCK_SIZE=(4, 7))
        out, _ = M.flash_attention(*arrays, block_mask=block_mask, score_mod=score_mod, scale=0.7,
                                   **({} if block_mask is not None else {"block_q": 4, "block_k": 7}), **options)
    return M.to_numpy(out)


def _few_in_jax(M: ModuleType, path: str, name: str) -> None:
    """JAX compiles flash's tiled program for each mod (a second or so each): the flash paths run a few cases."""
    if M.__name__ == "attention_jax" and path in ("flash", "block_mask") and name not in JAX_FLASH_CASES:
        pytest.skip("JAX: flash on a few cases")


@pytest.mark.parametrize("path", ["weights", "fast", "flash", "block_mask"])
@pytest.mark.parametrize("name", list(CASES))
def test_equals_torch_flex_attention(backend, path, name):
    _few_in_jax(backend, path, name)
    mask_mod, score_mod = CASES[name]
    expected = _reference_of(name).out
    assert_close(_attend(backend, path, *_inputs(), mask_mod, score_mod), expected, RTOL, f"{name} {path}")


@pytest.mark.parametrize("path", ["weights", "fast", "flash", "block_mask"])
@pytest.mark.parametrize("name", ["causal", "document", "alibi", "nested"])
def test_grouped_query_heads_equal_torch(backend, path, name):
    mask_mod, score_mod = CASES[name]
    expected = _reference_of(name, enable_gqa=True).out
    out = _attend(backend, path, *_inputs(kv_heads=HKV), mask_mod, score_mod, enable_gqa=True)
    assert_close(out, expected, RTOL, f"{name} {path}")


def test_the_weights_are_the_softmax_of_the_modded_scores(backend):
    """The explicit path's weights with mods: the rows of P, each summing to 1 over its visible keys, equal to
    the weights of the same attention given the mask and the bias the mods make as arrays."""
    mask_mod, score_mod = CASES["or"]
    q, k, v = _inputs()
    b, h, i, j = np.arange(B)[:, None, None, None], np.arange(H)[:, None, None], np.arange(L)[:, None], np.arange(S)
    mask = np.broadcast_to(mask_mod(b, h, i, j), (B, H, L, S))
    bias = np.broadcast_to(score_mod(np.zeros((B, H, L, S)), b, h, i, j), (B, H, L, S))  # ALiBi: score + bias
    arrays = [backend.asarray(x) for x in (q, k, v)]
    _, weights = backend.scaled_dot_product_attention(*arrays, mask_mod=mask_mod, score_mod=score_mod, scale=0.7)
    _, expected = backend.scaled_dot_product_attention(*arrays, backend.asarray(mask), bias=backend.asarray(bias),
                                                       scale=0.7)
    assert_close(backend.to_numpy(weights), backend.to_numpy(expected), RTOL, "weights")


def _vjp(M: ModuleType, path: str, q, k, v, mask_mod, score_mod, **options):
    arrays = [M.asarray(x) for x in (q, k, v)]
    if path == "sdpa":
        return M.scaled_dot_product_attention_vjp(*arrays, mask_mod=mask_mod, score_mod=score_mod, scale=0.7,
                                                  **options)
    block_mask = None if mask_mod is None else M.create_block_mask(mask_mod, B, H, L, S, BLOCK_SIZE=(4, 7))
    return M.flash_attention_vjp(*arrays, block_mask=block_mask, score_mod=score_mod, scale=0.7,
                                 **({} if block_mask is not None else {"block_q": 4, "block_k": 7}), **options)


@pytest.mark.parametrize("path", ["sdpa", "flash"])
@pytest.mark.parametrize("name", GRADIENT_CASES)
def test_gradients_equal_torch(backend, path, name):
    _few_in_jax(backend, "flash" if path == "flash" else path, name)
    mask_mod, score_mod = CASES[name]
    (dq, dk, dv), d_parameters = _gradients_of(name)
    _, _, pullback = _vjp(backend, path, *_inputs(), mask_mod, score_mod)
    grads = pullback(backend.asarray(_random(B, H, L, EV, seed=3)))
    for what, actual, expected in zip(("dq", "dk", "dv"), grads[:3], (dq, dk, dv), strict=True):
        assert_close(backend.to_numpy(actual), expected, RTOL, f"{name} {path} {what}")
    assert grads[3] is None, "dbias: no bias given"
    if score_mod is None:
        assert len(grads) == 4, "no score_mod: (dq, dk, dv, dbias)"
        return
    assert set(grads[4]) == set(d_parameters), f"{name}: the score function's parameters"
    for parameter, expected in d_parameters.items():
        assert_close(backend.to_numpy(grads[4][parameter]), expected, RTOL, f"{name} {path} d{parameter}")


@pytest.mark.parametrize("path", ["sdpa", "flash"])
def test_grouped_query_gradients_equal_torch(backend, path):
    mask_mod, score_mod = CASES["nested"]
    (dq, dk, dv), d_parameters = _gradients_of("nested", enable_gqa=True)
    _, _, pullback = _vjp(backend, path, *_inputs(kv_heads=HKV), mask_mod, score_mod, enable_gqa=True)
    grads = pullback(backend.asarray(_random(B, H, L, EV, seed=3)))
    for what, actual, expected in zip(("dq", "dk", "dv"), grads[:3], (dq, dk, dv), strict=True):
        assert_close(backend.to_numpy(actual), expected, RTOL, f"{path} {what}")
    assert_close(backend.to_numpy(grads[4]["table"]), d_parameters["table"], RTOL, f"{path} dtable")


@pytest.mark.parametrize("path", ["weights", "fast", "flash"])
def test_the_keywords_and_the_mods_together(backend, path):
    """is_causal, window, key_lengths and softcap with a mask_mod and a score_mod: the same attention as the
    catalogue's entries for those keywords composed with the mods (softcap first, then score_mod)."""
    q, k, v = _inputs()
    keywords = {"is_causal": True, "q_offset": 2, "window": (4, None), "key_lengths": np.array([[8], [11]]),
                "softcap": 1.5}
    user_mask, user_score = CASES["document"][0], mods.alibi(np.full(H, 0.3))
    as_mods = mods.and_masks(mods.causal(2), mods.sliding_window(4, None, q_offset=2),
                             mods.key_lengths(np.array([8, 11])), user_mask)
    capped = mods.ScoreMod("softcap then alibi", lambda score, *idx: user_score(mods.softcap(1.5)(score, *idx), *idx),
                           derivative=lambda d_new, score, *idx: (d_new, {}))
    expected = _attend(backend, "weights", q, k, v, as_mods, capped)
    options = {name: backend.asarray(x) if isinstance(x, np.ndarray) else x for name, x in keywords.items()}
    assert_close(_attend(backend, path, q, k, v, user_mask, user_score, **options), expected, RTOL, path)


def test_mods_need_four_axes(backend):
    q = backend.asarray(_random(H, L, E := 4))
    k, v = backend.asarray(_random(H, S, E)), backend.asarray(_random(H, S, EV))
    for function in (backend.scaled_dot_product_attention, backend.flash_attention):
        with pytest.raises(ValueError, match=r"four axes.*\(B, H, L, E\).*got q \(4, 9, 4\)"):
            function(q, k, v, mask_mod=mods.causal())


def test_flash_takes_a_block_mask_or_a_mask_mod_and_the_block_masks_tiles(backend):
    q, k, v = (backend.asarray(x) for x in _inputs())
    block_mask = backend.create_block_mask(mods.causal(), B, H, L, S, BLOCK_SIZE=(4, 7))
    with pytest.raises(ValueError, match="mask_mod or block_mask, not both"):
        backend.flash_attention(q, k, v, mask_mod=mods.causal(), block_mask=block_mask)
    with pytest.raises(ValueError, match=r"BLOCK_SIZE \(4, 7\).*block_q=2, block_k=3"):
        backend.flash_attention(q, k, v, block_mask=block_mask, block_q=2, block_k=3)
    other = backend.create_block_mask(mods.causal(), B, H, L + 1, S, BLOCK_SIZE=4)
    with pytest.raises(ValueError, match="do not fit these scores"):
        backend.flash_attention(q, k, v, block_mask=other)


def _module_reference(state: dict, x: np.ndarray, mask: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """MultiHeadAttention's output by hand in float64 NumPy: the projections, softmax(Q K^T / sqrt(d_k) + bias)
    over the keys `mask` shows, the output projection."""
    def project(name: str) -> np.ndarray:
        y = x @ state[f"{name}.weight"].T + state[f"{name}.bias"]
        return y.reshape(*x.shape[:-1], H, -1).swapaxes(-2, -3)  # (B, L, D) -> (B, H, L, d_k)

    q, k, v = project("w_q"), project("w_k"), project("w_v")
    scores = np.where(mask, q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1]) + bias, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    heads = weights / weights.sum(axis=-1, keepdims=True) @ v  # (B, H, L, d_k)
    merged = heads.swapaxes(-2, -3).reshape(*x.shape)
    return merged @ state["w_o.weight"].T + state["w_o.bias"]


def test_multi_head_attention_takes_mods(backend):
    """mha(x, x, x, mask_mod=document, score_mod=alibi): a packed batch and ALiBi through the module, against
    the module computed by hand."""
    D, segments = 8, np.array([[0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 1, 1, 1, 1, 1, 1, 2, 3]])
    state = {f"{name}.{kind}": _random(*((D, D) if kind == "weight" else (D,)), seed=20 + n)
             for n, (name, kind) in enumerate((name, kind) for name in ("w_q", "w_k", "w_v", "w_o")
                                              for kind in ("weight", "bias"))}
    x = _random(B, L, D, seed=30)
    mask_mod = mods.and_masks(mods.causal(), mods.document(segments))
    score_mod = mods.alibi(2.0 ** -np.arange(1, H + 1))
    i, j = np.arange(L)[:, None], np.arange(L)
    mask = (j <= i) & (segments[:, None, :, None] == segments[:, None, None, :])  # (B, 1, L, L)
    bias = score_mod.parameters["slopes"][:, None, None] * (j - i)  # (H, L, L)
    mha = backend.MultiHeadAttention.from_state_dict({n: backend.asarray(s) for n, s in state.items()},
                                                     num_heads=H).eval()
    out, _ = mha(*(backend.asarray(x),) * 3, mask_mod=mask_mod, score_mod=score_mod)
    assert_close(backend.to_numpy(out), _module_reference(state, x, mask, bias), RTOL, "mha")


def test_a_block_takes_a_mask_mod(backend):
    """block(x, mask_mod=causal) is block(x, mask=the causal mask as an array)."""
    D = 8
    block = backend.TransformerBlock(d_model=D, num_heads=2, d_ff=16, dropout=0.0)
    x = backend.asarray(_random(B, L, D, seed=40).astype(np.float32))
    with_mod, _ = block(x, mask_mod=mods.causal())
    with_mask, _ = block(x, backend.asarray(np.tril(np.ones((L, L), dtype=bool))))
    np.testing.assert_allclose(backend.to_numpy(with_mod), backend.to_numpy(with_mask), rtol=1e-6, atol=1e-6)
