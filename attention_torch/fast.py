"""The fast path of scaled dot-product attention in PyTorch: the same result as the explicit path, without
the weights, through torch's fused F.scaled_dot_product_attention.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

torch's kernel takes one attn_mask: a boolean of the visible keys, or, with a bias, the bias with -inf
where a key is hidden; without mask and bias its own is_causal (top-left aligned, as ours) keeps the
fused kernels available. A fully masked row is set to zeros explicitly, so the rule holds on every
kernel and device. scaled_dot_product_attention sends inputs with a NaN or inf in q or k to the explicit
path instead (see there). The dtype stays the inputs' dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .functional import _visible


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, *,
              bias: torch.Tensor | None, is_causal: bool, scale: float, batch: tuple) -> torch.Tensor:
    """softmax(Q K^T * scale + bias) V over the visible keys, as scaled_dot_product_attention's out."""
    q, k, v = (x.expand(*batch, *x.shape[-2:]) for x in (q, k, v))  # torch: its kernel does not broadcast q, k, v
    if mask is None and bias is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)
    visible = _visible(mask, bias, is_causal, (*batch, q.shape[-2], k.shape[-2]), q.device)  # (..., L, S)
    if bias is not None:
        bias = torch.as_tensor(bias, dtype=q.dtype, device=q.device)
    attn_mask = visible if bias is None else torch.where(visible, bias, -math.inf)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)  # (..., L, Ev)
    return torch.where(visible.any(dim=-1, keepdim=True), out, 0)  # a fully masked row: zeros

