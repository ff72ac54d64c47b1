"""attention_torch.flex_attention under torch's autograd: loss.backward() through it equals its vjp; gradcheck in
float64; a learned ALiBi slope and relative-bias table get .grad, equal to a dense torch reference's; a NaN of the
score function's derivative at hidden keys does not reach the gradients; the dtypes in and out.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from attention_np.common import mods
from tests._compare import REORDERED, TOLERANCE, assert_close

torch = pytest.importorskip("torch")
import attention_torch as M  # noqa: E402 (after the skip without torch)

RTOL = REORDERED  # float64: the same math computed another way (1e-12)
B, H, L, S, E, EV = 2, 2, 5, 6, 3, 4
Q_SEGMENTS, KV_SEGMENTS = [0, 0, 0, 1, 1], [0, 0, 0, 1, 1, 1]  # every query sees a key of its own document
BLOCK = (2, 3)  # tiles of every kind for the document mask: empty, partial and full


def _tensors(dtype: torch.dtype = torch.float64, seed: int = 0) -> list[torch.Tensor]:
    """q (B, H, L, E), k (B, H, S, E), v (B, H, S, Ev), each a leaf that requires its gradient."""
    rng = np.random.default_rng(seed)
    return [torch.tensor(rng.standard_normal(shape), dtype=dtype, requires_grad=True)
            for shape in ((B, H, L, E), (B, H, S, E), (B, H, S, EV))]


def _document_mask() -> M.BlockMask:
    block_mask = M.create_block_mask(mods.document(np.array(Q_SEGMENTS), np.array(KV_SEGMENTS)), B, H, L, S,
                                     BLOCK_SIZE=BLOCK)
    assert all(block_mask.counts().values()), "the case has empty, partial and full tiles"
    return block_mask


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score_mod: Any, mask_mod: Any,
           scale: float) -> torch.Tensor:
    """softmax(where(visible, score_mod(q k^T * scale), -inf)) v over the whole (L, S) grid at once, autograd
    through torch's own softmax: the reference the tiled kernel's gradients are held to. Every query sees a key."""
    b, h = torch.arange(B).reshape(B, 1, 1, 1), torch.arange(H).reshape(1, H, 1, 1)
    i, j = torch.arange(L).reshape(1, 1, L, 1), torch.arange(S).reshape(1, 1, 1, S)
    scores = score_mod(q @ k.transpose(-1, -2) * scale, b, h, i, j)  # (B, H, L, S)
    weights = torch.softmax(torch.where(mask_mod(b, h, i, j), scores, -torch.inf), dim=-1)
    return weights @ v  # (B, H, L, S) x (B, H, S, Ev) -> (B, H, L, Ev)


@pytest.mark.parametrize("score_mod", [mods.alibi(torch.tensor([0.5, -0.25], dtype=torch.float64)),
                                       mods.relative_bias(torch.linspace(-1, 1, 2 * 5, dtype=torch.float64)
                                                          .reshape(H, 5)), mods.softcap(1.5), None],
                         ids=["alibi", "relative_bias", "softcap", "none"])
def test_loss_backward_equals_the_vjp(score_mod):
    q, k, v = _tensors()
    names = list(getattr(score_mod, "parameters", {}))
    parameters = {name: score_mod.parameters[name].clone().requires_grad_() for name in names}
    learned = score_mod.replace(**parameters) if parameters else score_mod
    d_out = torch.tensor(np.random.default_rng(3).standard_normal((B, H, L, EV)))
    out = M.flex_attention(q, k, v, score_mod=learned, block_mask=_document_mask(), scale=0.7)
    (out * d_out).sum().backward()
    vjp_out, _, pullback = M.flex_attention_vjp(q.detach(), k.detach(), v.detach(), score_mod=score_mod,
                                                block_mask=_document_mask(), scale=0.7)
    dq, dk, dv, d_parameters = pullback(d_out)
    assert_close(out.detach().numpy(), vjp_out.numpy(), RTOL, "out")
    for what, leaf, grad in (("dq", q, dq), ("dk", k, dk), ("dv", v, dv)):
        assert_close(leaf.grad.numpy(), grad.numpy(), RTOL, what)
    assert set(d_parameters) == set(names)
    for name, leaf in parameters.items():
        assert_close(leaf.grad.numpy(), d_parameters[name].numpy(), RTOL, f"d{name}")


def test_gradcheck_float64_alibi_and_a_document_mask():
    q, k, v = (x.detach()[:1].requires_grad_() for x in _tensors())  # B = 1: small for finite differences
    slopes = torch.tensor([0.5, -0.25], dtype=torch.float64, requires_grad=True)
    block_mask = M.create_block_mask(mods.document(np.array(Q_SEGMENTS), np.array(KV_SEGMENTS)), 1, H, L, S,
                                     BLOCK_SIZE=BLOCK)

    def attention(q, k, v, slopes):  # out and lse, both differentiated
        return M.flex_attention(q, k, v, score_mod=mods.alibi(slopes), block_mask=block_mask, return_lse=True)

    assert torch.autograd.gradcheck(attention, (q, k, v, slopes))


@pytest.mark.parametrize("name", ["alibi", "relative_bias"])
def test_a_learned_parameter_gets_the_dense_gradient(name):
    """A learned ALiBi slope (a torch.nn.Parameter) or relative-bias table gets .grad from loss.backward(),
    equal to the gradient of the dense reference through torch's own softmax."""
    q, k, v = _tensors()
    make, value = {"alibi": (mods.alibi, [0.5, -0.25]), "relative_bias": (mods.relative_bias, [[0.1, -0.2, 0.3],
                                                                                               [0.4, 0.0, -0.5]])}[name]
    ours, dense = (torch.nn.Parameter(torch.tensor(value, dtype=torch.float64)) for _ in range(2))
    mask_mod = mods.and_masks(mods.causal(), mods.document(np.array(Q_SEGMENTS), np.array(KV_SEGMENTS)))
    out = M.flex_attention(q, k, v, score_mod=make(ours), block_mask=M.create_block_mask(mask_mod, B, H, L, S,
                                                                                          BLOCK_SIZE=BLOCK))
    out.square().sum().backward()
    _dense(q, k, v, make(dense), mask_mod, 1 / np.sqrt(E)).square().sum().backward()
    assert ours.grad is not None and torch.any(ours.grad != 0), f"{name}: the parameter's gradient reached it"
    assert_close(ours.grad.numpy(), dense.grad.numpy(), RTOL, f"d{name}")


def test_a_nan_derivative_at_hidden_keys_does_not_reach_the_gradients():
    """score * sqrt(i - j + 1) is NaN, and so is its derivative, at the future keys j > i + 1, which the causal
    mask hides: dR is 0 there, and dS must be 0 too, not 0 * NaN."""
    q, k, v = _tensors()

    def damped(score, b, h, q_idx, kv_idx):
        return score * torch.sqrt((q_idx - kv_idx + 1).to(score.dtype))  # NaN where kv_idx > q_idx + 1

    def safe(score, b, h, q_idx, kv_idx):  # the same on the visible keys, finite everywhere
        return score * torch.sqrt((q_idx - kv_idx + 1).clamp(min=1).to(score.dtype))

    out = M.flex_attention(q, k, v, score_mod=damped, block_mask=M.create_block_mask(mods.causal(), B, H, L, S,
                                                                                      BLOCK_SIZE=BLOCK))
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected = torch.autograd.grad(_dense(q, k, v, safe, mods.causal(), 1 / np.sqrt(E)).square().sum(), (q, k, v))
    for what, actual, reference in zip(("dq", "dk", "dv"), grads, expected, strict=True):
        assert_close(actual.numpy(), reference.numpy(), RTOL, what)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_out_in_q_dtype_and_lse_in_at_least_float32(dtype):
    q, k, v = _tensors(dtype)
    out, lse = M.flex_attention(q, k, v, score_mod=mods.alibi([0.5, 0.25]), block_mask=_document_mask(),
                                return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.promote_types(dtype, torch.float32)
    out.float().sum().backward()
    assert q.grad.dtype == k.grad.dtype == v.grad.dtype == dtype
    reference = M.flex_attention(*(x.detach().double() for x in (q, k, v)), score_mod=mods.alibi([0.5, 0.25]),
                                 block_mask=_document_mask())
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    np.testing.assert_allclose(out.detach().double().numpy(), reference.numpy(), rtol=tolerance, atol=tolerance)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_cuda_device_equals_the_cpu():
    """The index arrays the mods receive, the parameters and the gradients live on q's device."""
    q, k, v = _tensors()
    slopes = torch.tensor([0.5, -0.25], dtype=torch.float64, requires_grad=True)
    out = M.flex_attention(q, k, v, score_mod=mods.alibi(slopes), block_mask=_document_mask())
    on_device = [x.detach().cuda().requires_grad_() for x in (q, k, v, slopes)]
    out_device = M.flex_attention(*on_device[:3], score_mod=mods.alibi(on_device[3]), block_mask=_document_mask())
    out.sum().backward()
    out_device.sum().backward()
    assert_close(out_device.detach().cpu().numpy(), out.detach().numpy(), RTOL, "out")
    for what, cpu, device in zip(("dq", "dk", "dv", "dslopes"), (q, k, v, slopes), on_device, strict=True):
        assert device.grad.device == device.device
        assert_close(device.grad.cpu().numpy(), cpu.grad.numpy(), RTOL, what)


class _Recorder:
    """A mask function that records the (query tile, key tile) pairs of the tiles it is evaluated on."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.tiles = inner, set()

    def __call__(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        self.tiles |= {(int(i) // BLOCK[0], int(j) // BLOCK[1]) for i in q_idx.ravel() for j in kv_idx.ravel()}
        return self.inner(b, h, q_idx, kv_idx)


def _kinds(block_mask: M.BlockMask, kind: int) -> set[tuple[int, int]]:
    return {(int(i), int(j)) for i, j in zip(*np.nonzero(block_mask.batch_kinds() == kind), strict=True)}


def test_flash_with_a_block_mask_skips_empty_tiles_and_calls_the_mask_function_on_partial_ones_only():
    """flash_attention(block_mask=): the mask function runs on the partial tiles and on them only, the score
    function on the partial and full ones (every tile computed), never on an empty one; forward and backward."""
    from attention_np.common.block_mask import EMPTY, FULL, PARTIAL

    q, k, v = _tensors()
    mask_mod = _Recorder(mods.document(np.array(Q_SEGMENTS), np.array(KV_SEGMENTS)))
    block_mask = M.create_block_mask(mask_mod, B, H, L, S, BLOCK_SIZE=BLOCK)
    scored: set[tuple[int, int]] = set()

    def score_mod(score, b, h, q_idx, kv_idx):
        scored.update((int(i) // BLOCK[0], int(j) // BLOCK[1]) for i in q_idx.ravel() for j in kv_idx.ravel())
        return score * 0.5

    mask_mod.tiles.clear()
    out, _ = M.flash_attention(q, k, v, block_mask=block_mask, score_mod=score_mod)
    out.sum().backward()
    partial, full = _kinds(block_mask, PARTIAL), _kinds(block_mask, FULL)
    assert partial and full and _kinds(block_mask, EMPTY), "the case has tiles of every kind"
    assert mask_mod.tiles == partial, "the mask function runs on the partial tiles, and on them only"
    assert scored == partial | full, "the score function runs on every tile computed, no empty one"


@pytest.mark.parametrize("path", ["sdpa", "fast", "flash"])
def test_a_learned_slope_gets_the_dense_gradient_through_sdpa_and_flash(path):
    """loss.backward() through sdpa (both paths) and flash reaches a ScoreMod's nn.Parameter, as through flex."""
    q, k, v = _tensors()
    ours, dense = (torch.nn.Parameter(torch.tensor([0.5, -0.25], dtype=torch.float64)) for _ in range(2))
    mask_mod = mods.and_masks(mods.causal(), mods.document(np.array(Q_SEGMENTS), np.array(KV_SEGMENTS)))
    if path == "flash":
        out, _ = M.flash_attention(q, k, v, mask_mod=mask_mod, score_mod=mods.alibi(ours), block_q=2, block_k=3)
    else:
        out, _ = M.scaled_dot_product_attention(q, k, v, mask_mod=mask_mod, score_mod=mods.alibi(ours),
                                                need_weights=path == "sdpa")
    out.square().sum().backward()
    _dense(q, k, v, mods.alibi(dense), mask_mod, 1 / np.sqrt(E)).square().sum().backward()
    assert ours.grad is not None and torch.any(ours.grad != 0)
    assert_close(ours.grad.numpy(), dense.grad.numpy(), RTOL, f"{path} dslopes")


def _mha(num_kv_heads: int = H) -> M.MultiHeadAttention:
    torch.manual_seed(0)
    return M.MultiHeadAttention(d_model=4, num_heads=H, dropout=0.0, num_kv_heads=num_kv_heads,
                                dtype=torch.float64).eval()


def test_the_module_vjps_give_the_score_functions_parameters_gradients():
    """mha.vjp and block.vjp with score_mod=alibi: the slopes' gradient under "score_mod.slopes", equal to
    loss.backward() through the module's call with the slopes an nn.Parameter."""
    x = torch.tensor(np.random.default_rng(5).standard_normal((B, L, 4)))
    d_out = torch.tensor(np.random.default_rng(6).standard_normal((B, L, 4)))
    mask_mod = mods.document(np.array(Q_SEGMENTS))
    mha = _mha(num_kv_heads=1)
    block = M.TransformerBlock(d_model=4, num_heads=H, d_ff=8, dropout=0.0, dtype=torch.float64).eval()
    for module, call in ((mha, lambda **mods_: mha(x, x, x, **mods_)), (block, lambda **mods_: block(x, **mods_))):
        slopes = torch.nn.Parameter(torch.tensor([0.5, -0.25], dtype=torch.float64))
        out, _ = call(mask_mod=mask_mod, score_mod=mods.alibi(slopes))
        (out * d_out).sum().backward()
        vjp = mha.vjp(x, x, x, mask_mod=mask_mod, score_mod=mods.alibi([0.5, -0.25])) if module is mha else \
            block.vjp(x, mask_mod=mask_mod, score_mod=mods.alibi([0.5, -0.25]))
        assert_close(vjp[0].numpy(), out.detach().numpy(), RTOL, f"{type(module).__name__} out")
        grads = vjp[2](d_out)[-1]
        assert_close(grads["score_mod.slopes"].numpy(), slopes.grad.numpy(), RTOL, type(module).__name__)


def test_extend_passes_the_mods_over_the_cache():
    """mha.extend on an empty cache with a mask_mod and a score_mod: the module's call with the causal mask and
    the same mods (the new queries are q_idx 0 .. L - 1, the keys kv_idx over the filled cache); a second step
    sees the first step's keys through a mask function of the keys only."""
    mha, x = _mha(), torch.tensor(np.random.default_rng(7).standard_normal((B, L + 1, 4)))
    document, alibi = mods.document(np.array(Q_SEGMENTS)), mods.alibi([0.5, -0.25])
    out, _, cache = mha.extend(x[:, :L], x[:, :L], mha.init_cache((B,), L + 1), mask_mod=document, score_mod=alibi)
    expected, _ = mha(*(x[:, :L],) * 3, mask_mod=mods.and_masks(mods.causal(), document), score_mod=alibi)
    assert_close(out.detach().numpy(), expected.detach().numpy(), RTOL, "first step")
    step, _, _ = mha.extend(x[:, L:], x[:, L:], cache, mask_mod=lambda b, h, q_idx, kv_idx: kv_idx != 1)
    causal_but_key_1 = torch.tril(torch.ones(L + 1, L + 1, dtype=torch.bool)) & (torch.arange(L + 1) != 1)
    whole, _ = mha(x, x, x, causal_but_key_1)
    assert_close(step.detach().numpy(), whole[:, L:].detach().numpy(), RTOL, "second step")


def test_linear_attention_refuses_the_mods():
    mha = M.MultiHeadAttention(d_model=4, num_heads=H, dropout=0.0, attention="linear")
    x = torch.zeros(B, L, 4)
    for name, mod in (("mask_mod", mods.causal()), ("score_mod", mods.alibi([0.5, 0.25]))):
        with pytest.raises(ValueError, match=name):
            mha(x, x, x, **{name: mod})


@pytest.mark.parametrize("path", ["sdpa", "fast", "flash"])
def test_a_nan_derivative_at_hidden_keys_does_not_reach_the_gradients_of_sdpa_and_flash(path):
    """As for flex_attention: score * sqrt(i - j + 1), NaN with its derivative at the keys j > i + 1 the causal
    mask_mod hides, leaves dq, dk and dv those of the same scores made finite there."""
    q, k, v = _tensors()

    def damped(score, b, h, q_idx, kv_idx):
        return score * torch.sqrt((q_idx - kv_idx + 1).to(score.dtype))  # NaN where kv_idx > q_idx + 1

    def safe(score, b, h, q_idx, kv_idx):
        return score * torch.sqrt((q_idx - kv_idx + 1).clamp(min=1).to(score.dtype))

    if path == "flash":
        out, _ = M.flash_attention(q, k, v, mask_mod=mods.causal(), score_mod=damped, block_q=2, block_k=3)
    else:
        out, _ = M.scaled_dot_product_attention(q, k, v, mask_mod=mods.causal(), score_mod=damped,
                                                need_weights=path == "sdpa")
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected = torch.autograd.grad(_dense(q, k, v, safe, mods.causal(), 1 / np.sqrt(E)).square().sum(), (q, k, v))
    for what, actual, reference in zip(("dq", "dk", "dv"), grads, expected, strict=True):
        assert_close(actual.numpy(), reference.numpy(), RTOL, f"{path} {what}")


# --- the hand-off to torch's own compiled FlexAttention ------------------------------------------------------

@pytest.mark.slow  # torch.compile: seconds per mask function, so one case: a document mask and a score function
def test_at_the_hand_off_size_torchs_compiled_flex_attention_runs_and_equals_the_tiled_kernel(monkeypatch):
    """From HAND_OFF on, flex_attention without a gradient or lse runs torch's own FlexAttention, compiled, over
    the block mask's tiles (a spy counts the calls: without the hand-off it stays 0); its out equals the tiled
    kernel's, which keeps a call with lse or a gradient to take (and below HAND_OFF every call)."""
    from attention_torch import flex

    calls = []
    compiled = flex._torch_flex_attention()

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs["block_mask"])
        return compiled(*args, **kwargs)

    rng = np.random.default_rng(0)
    q, k, v = (M.asarray(rng.standard_normal((1, 2, 64, 16)).astype(np.float32)) for _ in range(3))
    block_mask = M.create_block_mask(mods.document(np.repeat(np.arange(4), 16)), None, None, 64, 64, BLOCK_SIZE=16)
    score_mod = mods.softcap(5.0)
    tiled = M.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)
    monkeypatch.setattr(flex, "HAND_OFF", 0)
    monkeypatch.setattr(flex, "_torch_flex_attention", lambda: spy)
    handed = M.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)
    assert len(calls) == 1 and calls[0].BLOCK_SIZE == (16, 16)
    assert_close(M.to_numpy(handed), M.to_numpy(tiled), TOLERANCE[np.dtype(np.float32)])  # float32 alone
    with torch.inference_mode():  # as compare times torch (dynamo's guards on the mask's NumPy ids failed there)
        assert_close(M.to_numpy(M.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)),
                     M.to_numpy(tiled), TOLERANCE[np.dtype(np.float32)])
    M.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, return_lse=True)  # no lse on the CPU
    q.requires_grad_(True)
    M.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask).sum().backward()
    assert len(calls) == 2 and q.grad is not None  # lse or a gradient to take: the tiled kernel
