"""The fast path of scaled dot-product attention in PyTorch: the same result as the explicit path, without
the weights, through torch's fused F.scaled_dot_product_attention.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

torch's kernel takes one attn_mask: a boolean of the visible keys, or, with a bias, the bias with -inf
where a key is hidden; without mask, bias, offset, window and key lengths its own is_causal (top-left
aligned, as ours) keeps the fused kernels available. q_offset, window and key_lengths become part of the
one boolean mask; softcap keeps the explicit path (the kernel cannot cap the raw scores). A fully masked
row is set to zeros explicitly, so the rule holds on every kernel and device.
scaled_dot_product_attention sends inputs with a NaN or inf in q or k to the explicit path instead (see
there).

float16 and bfloat16: on CUDA the kernel takes them as they are (its flash and memory-efficient kernels
accumulate in float32 and need half precision to run at full speed); on the CPU they are computed in
float32, as on the explicit path, which measured faster there (float16 28 ms against 45 ms at B=2, H=8,
L=S=1024, E=64). The output has the inputs' dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .functional import _visible


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, *,
              bias: torch.Tensor | None, structure: dict, scale: float, batch: tuple) -> torch.Tensor:
    """softmax(Q K^T * scale + bias) V over the visible keys, as scaled_dot_product_attention's out."""
    dtype = q.dtype
    work = dtype if q.is_cuda else torch.promote_types(dtype, torch.float32)  # see the module docstring
    q, k, v = (x.to(work).expand(*batch, *x.shape[-2:]) for x in (q, k, v))  # torch: the kernel does not broadcast
    offset = not (isinstance(structure["q_offset"], int) and structure["q_offset"] == 0)
    positions = structure["window"] is not None or structure["key_lengths"] is not None or (
        structure["is_causal"] and offset)  # keys hidden by positions: ours, in the one boolean mask
    if mask is None and bias is None and not positions:  # torch: its own is_causal is ours without an offset
        return F.scaled_dot_product_attention(q, k, v, is_causal=structure["is_causal"], scale=scale).to(dtype)
    visible = _visible(mask, bias, structure, (*batch, q.shape[-2], k.shape[-2]), q.device)  # (..., L, S)
    if bias is not None:
        bias = torch.as_tensor(bias, dtype=q.dtype, device=q.device)
    attn_mask = visible if bias is None else torch.where(visible, bias, -math.inf)
    attn_mask = attn_mask[(None,) * (q.ndim - attn_mask.ndim)]  # torch: at q's rank, as the kernel raised
    # IndexError for an (S,) mask with inputs of rank 4
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)  # (..., L, Ev)
    return torch.where(visible.any(dim=-1, keepdim=True), out, 0).to(dtype)  # a fully masked row: zeros

