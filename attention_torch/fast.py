"""The fast path of scaled dot-product attention in PyTorch: the same result as the explicit path, without
the weights, through torch's fused F.scaled_dot_product_attention.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

torch's kernel takes one attn_mask: a boolean of the visible keys, or, with a bias, the bias with -inf
where a key is hidden; without mask, bias, offset, window and key lengths its own is_causal (top-left
aligned, as ours) keeps the fused kernels available where the scale is above 0 (at 0 or below it returned
NaN rows). q_offset, window and key_lengths become part of the one boolean mask, as does a mask_mod
(scaled_dot_product_attention evaluates it once into the mask), and so does is_causal at a scale of 0 or below; softcap
and a score_mod keep the explicit path (the kernel cannot change the raw scores), as do sinks (it has no sink
logit). A fully masked row is set to
zeros explicitly, so the rule holds on every kernel and device.
scaled_dot_product_attention sends inputs with a NaN or inf in q or k to the explicit path instead (see
there). Where k and v hold one head for several query heads (grouped-query attention's groups,
multi-query attention by broadcasting), the kernel's enable_gqa shares it: k and v are never copied per
query head (the kernel does not broadcast, and expanded inputs of rank 5 were copied, measured).

float16 and bfloat16: on CUDA the kernel takes them as they are (its flash and memory-efficient kernels
accumulate in float32 and need half precision to run at full speed); on the CPU they are computed in
float32, as on the explicit path, which measured faster there (float16 28 ms against 45 ms at B=2, H=8,
L=S=1024, E=64). The output has the inputs' dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from attention_np.common import validation
from attention_np.common.records import Structure

from .primitives import _cast, _visible, causal_mask


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, *,
              bias: torch.Tensor | None, structure: Structure, scale: float, batch: tuple) -> torch.Tensor:
    """softmax(Q K^T * scale + bias) V over the visible keys, as scaled_dot_product_attention's out."""
    dtype, (L, S, Ev) = q.dtype, (q.shape[-2], k.shape[-2], v.shape[-1])
    work = dtype if q.is_cuda else torch.promote_types(dtype, torch.float32)  # see the module docstring
    shared = validation.shared_kv_head(q.shape, k.shape, v.shape)  # one key/value head per group: enable_gqa
    q, k, v = _kernel_heads(*(x.to(work) for x in (q, k, v)), batch=batch, shared=shared)
    offset = structure.q_offset
    causal = _hides_keys(structure.is_causal, offset, S)
    positions = structure.window is not None or structure.key_lengths is not None or (
        causal and not (isinstance(offset, int) and offset == 0 and scale > 0))  # keys hidden by positions: in
    # the one mask; torch: its is_causal gives NaN rows for a scale of 0 or below (it scales the hidden keys' -inf)
    if mask is None and bias is None and not positions:  # torch: its own is_causal is ours without an offset
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=shared)
        return out.reshape(*batch, L, Ev).to(dtype)
    visible = _visible(mask, bias, structure, (*batch, L, S), q.device)  # (..., L, S)
    if bias is not None:
        bias = torch.as_tensor(bias, dtype=q.dtype, device=q.device)
    attn_mask = visible if bias is None else torch.where(visible, bias, -math.inf)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=_kernel_mask(attn_mask, batch, shared, q.ndim),
                                         scale=scale, enable_gqa=shared).reshape(*batch, L, Ev)
    return torch.where(visible.any(dim=-1, keepdim=True), out, 0).to(dtype)  # a fully masked row: zeros


def _grouped_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b, (..., G, L, N) x (..., 1, N, M) -> (..., G, L, M). Where b holds one head that G heads of a
    share (GQA's groups (..., Hkv, G), multi-query attention), the G heads become one matrix of G * L rows.
    torch: matmul broadcasts b over the G heads by copying it, once per head, whenever b has more than one
    such head (Hkv > 1); autograd's product for b's gradient then needs no copy either."""
    if not validation.shared_kv_head(a.shape, b.shape, b.shape):
        return a @ b
    (G, L, N), M = a.shape[-3:], b.shape[-1]
    b = b.reshape(*b.shape[:-3], N, M) if b.ndim >= 3 else b  # (..., 1, N, M) -> (..., N, M)
    out = a.reshape(*a.shape[:-3], G * L, N) @ b  # (..., G * L, N) x (..., N, M) -> (..., G * L, M)
    return out.reshape(*out.shape[:-2], G, L, M)


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool, q_offset: int,
                      scale: float | None) -> torch.Tensor:
    """Grouped-query attention with nothing to split per query head (functional._kernel_groups): q (..., H, L, E)
    and k, v (..., Hkv, S, E | Ev) straight to the kernel's enable_gqa; causal from q_offset as in `attention`
    (a query 0 at S - 1 or later hides no key, q_offset 0 is the kernel's own is_causal, any other a mask)."""
    dtype, (L, S) = q.dtype, (q.shape[-2], k.shape[-2])
    work = dtype if q.is_cuda else torch.promote_types(dtype, torch.float32)  # see the module docstring
    q, k, v = (_cast(x, work) for x in (q, k, v))
    # scale None is the kernel's default, ours: 1 / sqrt(E), E > 0 here
    causal = _hides_keys(is_causal, q_offset, S)
    if causal and (q_offset != 0 or (scale is not None and scale <= 0)):  # ours is p_i = q_offset + i: a boolean
        # mask of the visible keys (torch: its is_causal gives NaN rows for a scale of 0 or below, as in `attention`)
        visible = causal_mask(L, S, q_offset=q_offset).to(q.device)  # (L, S)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=True)
        return torch.where(visible.any(dim=-1, keepdim=True), out, 0).to(dtype)  # a fully masked row: zeros
    if L == 1 and not causal and not q.is_cuda:  # a decode step: each key/value head's G query heads as G rows of
        # one head (torch: its CPU kernel runs a head of one row at a few times the cost of G rows together)
        (H, _, E), Hkv = q.shape[-3:], k.shape[-3]
        rows = q.reshape(*q.shape[:-3], Hkv, H // Hkv, E)  # (..., H, 1, E) -> (..., Hkv, G, E)
        out = F.scaled_dot_product_attention(rows, k, v, scale=scale)  # (..., Hkv, G, Ev)
        return _cast(out.reshape(*out.shape[:-3], H, 1, out.shape[-1]), dtype)  # (..., H, 1, Ev)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
    return _cast(out, dtype)


def _hides_keys(is_causal: bool, q_offset: int | torch.Tensor, S: int) -> bool:
    """Whether the causal rule may hide a key: not when query 0 stands at position S - 1 or later (a decode
    step, one query after the cache), which every key precedes; a kernel call then takes no mask."""
    return is_causal and not (isinstance(q_offset, int) and q_offset >= S - 1)


def _kernel_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, batch: tuple,
                  shared: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v expanded to the leading axes (...), as the kernel does not broadcast. When k and v hold one head
    that the G query heads of axis -3 share (`shared`: GQA's groups (..., Hkv, G), multi-query attention), the
    kernel takes the last two leading axes as Hkv * G query heads against Hkv key/value heads, with its
    enable_gqa: k and v are never copied per query head."""
    if not shared:
        return tuple(x.expand(*batch, *x.shape[-2:]) for x in (q, k, v))
    lead = batch[:-1] or (1,)  # (..., Hkv)
    q = q.expand(*batch, *q.shape[-2:]).reshape(*lead[:-1], lead[-1] * batch[-1], *q.shape[-2:])  # (..., H, L, E)
    k, v = (x.expand(*lead, 1, *x.shape[-2:]).reshape(*lead, *x.shape[-2:]) for x in (k, v))  # (..., Hkv, S, E)
    return q, k, v


def _kernel_mask(attn_mask: torch.Tensor, batch: tuple, shared: bool, ndim: int) -> torch.Tensor:
    """The mask (broadcasting to (..., L, S)) in the kernel's layout (`_kernel_heads`), at its rank `ndim`:
    torch's kernel raised IndexError for an (S,) mask with inputs of rank 4."""
    if shared and len(batch) >= 2:  # (..., Hkv | 1, G | 1, L, S) -> (..., H | 1, L, S), a copy only per head
        attn_mask = attn_mask[(None,) * (len(batch) + 2 - attn_mask.ndim)]
        if attn_mask.shape[-4:-2] != (1, 1):
            attn_mask = attn_mask.expand(*attn_mask.shape[:-4], *batch[-2:], *attn_mask.shape[-2:])
        attn_mask = attn_mask.flatten(-4, -3)
    return attn_mask[(None,) * (ndim - attn_mask.ndim)]
