"""torch's F.scaled_dot_product_attention as the contract's scaled_dot_product_attention, through the adapters.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

The kernel takes (B, H, L, E) and one attn_mask, a boolean that keeps (or a float added to the scores), and
refuses attn_mask together with is_causal, so the causal rule joins the boolean mask when both are given (its
is_causal is top-left aligned, as ours). It draws dropout from torch's global RNG: adapters.torch_rng seeds
that from the call's generator. It returns no weights.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from conformance import adapters
from conformance.contract.features import Declaration

TITLE = "F.scaled_dot_product_attention"  # the column of `python -m conformance frameworks`


def kernel(q: Any, k: Any, v: Any, *, mask: Any = None, is_causal: bool = False, scale: float | None = None,
           enable_gqa: bool = False, dropout_p: float = 0.0, rng: Any = None) -> Any:
    """F.scaled_dot_product_attention on (B, H, L, E), a boolean mask (B, H, L, S) that keeps."""
    if mask is not None and is_causal:  # torch: attn_mask or is_causal, not both
        mask, is_causal = mask & torch.ones(mask.shape[-2:], dtype=torch.bool, device=mask.device).tril(), False
    with adapters.torch_rng(rng):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                              scale=scale, enable_gqa=enable_gqa)


asarray, to_numpy = adapters.arrays("torch")
scaled_dot_product_attention = adapters.sdpa(kernel, layout="BHLE", mask="keep")
scaled_dot_product_attention_vjp = adapters.vjp(scaled_dot_product_attention)
CONFORMANCE = scaled_dot_product_attention.declaration | Declaration({
    "non_finite": "a NaN in a key the causal rule hides reaches the rows that hide it (its mask is added)"})
