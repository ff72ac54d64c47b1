"""attention_torch.flex_attention under torch's autograd: loss.backward() through it equals its vjp; gradcheck in
float64; a learned ALiBi slope and relative-bias table get .grad, equal to a dense torch reference's; a NaN of the
score function's derivative at hidden keys does not reach the gradients; the dtypes in and out.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from attention_np.common import mods
from tests._compare import REORDERED, assert_close

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
