"""The fast path of scaled dot-product attention in PyTorch: the same result as the explicit path, without
the weights, through torch's fused F.scaled_dot_product_attention.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

torch's kernel takes one attn_mask: a boolean of the visible keys, or, with a bias, the bias with -inf
where a key is hidden; without mask and bias its own is_causal (top-left aligned, as ours) keeps the
fused kernels available. A fully masked row is set to zeros explicitly, so the rule holds on every
kernel and device; a NaN or inf in q or k takes the explicit formulation, where it propagates as the spec
says (checking costs one pass over q and k, and on a GPU a wait for the device). The dtype stays the
inputs' dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .functional import _masked_softmax, _visible


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, *,
              bias: torch.Tensor | None, is_causal: bool, scale: float, batch: tuple) -> torch.Tensor:
    """softmax(Q K^T * scale + bias) V over the visible keys, as scaled_dot_product_attention's out."""
    if not (torch.isfinite(q).all() and torch.isfinite(k).all()):  # see _with_nonfinite
        return _with_nonfinite(q, k, v, mask, bias=bias, is_causal=is_causal, scale=scale, batch=batch)
    q, k, v = (x.expand(*batch, *x.shape[-2:]) for x in (q, k, v))  # torch: its kernel does not broadcast q, k, v
    if mask is None and bias is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)
    visible = _visible(mask, bias, is_causal, (*batch, q.shape[-2], k.shape[-2]), q.device)  # (..., L, S)
    if bias is not None:
        bias = torch.as_tensor(bias, dtype=q.dtype, device=q.device)
    attn_mask = visible if bias is None else torch.where(visible, bias, -math.inf)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)  # (..., L, Ev)
    return torch.where(visible.any(dim=-1, keepdim=True), out, 0)  # a fully masked row: zeros


def _with_nonfinite(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, *,
                    bias: torch.Tensor | None, is_causal: bool, scale: float, batch: tuple) -> torch.Tensor:
    """The explicit formulation, for a NaN or inf in q or k: torch's fused CPU kernel returns finite rows for a
    NaN query, and its -inf masking lets a hidden NaN key reach the rows that do not see it."""
    visible = _visible(mask, bias, is_causal, (*batch, q.shape[-2], k.shape[-2]), q.device)  # None: every key
    scores = (q * scale) @ k.transpose(-1, -2)  # (..., L, E) x (..., E, S) -> (..., L, S)
    if bias is not None:
        scores = scores + torch.as_tensor(bias, dtype=scores.dtype, device=scores.device)
    return _masked_softmax(scores, visible) @ v  # (..., L, S) x (..., S, Ev) -> (..., L, Ev)
