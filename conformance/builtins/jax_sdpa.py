"""JAX's jax.nn.dot_product_attention as the contract's scaled_dot_product_attention, through the adapters.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

The kernel takes (B, T, N, H) in its own letters, our (B, L, H, E); k and v with fewer heads than q are its
grouped-query attention (query head h reads key/value head h // G, as our enable_gqa). It takes a boolean mask
that keeps, an additive bias, scale, is_causal (top-left aligned, as ours) and local_window_size (left, right),
which hides what our window hides where q_offset is 0 (key j visible iff i - left <= j <= i + right, AND the
causal rule): an unbounded side (None) becomes max(L, S), which hides nothing. Its key_value_seq_lengths hold
one length per batch element, ours one per (batch, head): they join the boolean mask instead. It needs v as
wide as k: where Ev differs from E, q, k and v are padded with zero columns to the wider (a zero column changes
no score; the default scale 1 / sqrt(E) is then given explicitly) and out's extra columns dropped. It has no
q_offset, softcap, dropout, and returns no weights.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from conformance import adapters
from conformance.contract.features import Declaration

TITLE = "jax.nn.dot_product_attention"  # the column of `python -m conformance frameworks`


def kernel(q: Any, k: Any, v: Any, *, mask: Any = None, bias: Any = None, is_causal: bool = False,
           scale: float | None = None, window: tuple | None = None, key_lengths: Any = None,
           enable_gqa: bool = False) -> Any:
    """jax.nn.dot_product_attention on q (B, L, H, E), k and v (B, S, Hkv, *), a boolean mask (B, H, L, S) that
    keeps; enable_gqa needs nothing more (Hkv < H is grouped-query attention)."""
    (B, L, H, _), S = q.shape, k.shape[1]
    if key_lengths is not None:  # jax.nn: one length per batch element; ours one per (batch, head), or an int
        lengths = jnp.broadcast_to(jnp.asarray(key_lengths), (B, H)).reshape(B, H, 1, 1)
        keep = jnp.arange(S, dtype=lengths.dtype).reshape(1, 1, 1, S) < lengths  # (B, H, 1, S)
        mask = keep if mask is None else mask & keep  # (B, H, L, S)
    if window is not None:  # jax.nn: ints only; None (unbounded) hides nothing
        window = tuple(max(L, S) if side is None else side for side in window)
    E, Ev = q.shape[-1], v.shape[-1]
    if Ev != E:  # jax.nn: v as wide as k; zero columns change no score
        scale = 1 / math.sqrt(E) if scale is None else scale
        width = max(E, Ev)
        q, k, v = (jnp.pad(x, ((0, 0),) * 3 + ((0, width - x.shape[-1]),)) for x in (q, k, v))  # (..., width)
    out = jax.nn.dot_product_attention(q, k, v, bias, mask, scale=scale, is_causal=is_causal,
                                       local_window_size=window)  # (B, L, H, max(E, Ev))
    return out[..., :Ev]


asarray, to_numpy = adapters.arrays("jax")
scaled_dot_product_attention = adapters.sdpa(kernel, layout="BLHE", mask="keep")
scaled_dot_product_attention_vjp = adapters.vjp(scaled_dot_product_attention)
_HALF_ON_CPU = {  # jax: under jit, XLA:CPU compiles neither dot algorithm that jax.nn asks for in half precision
    "float16": "under jax.jit on the CPU XLA refuses the F16_F16_F32 dot that jax.nn asks for (ValueError)",
    "bfloat16": "under jax.jit on the CPU XLA refuses the BF16_BF16_F32 dot that jax.nn asks for on degenerate "
                "shapes (q, k, v (1, 1, 1, 2), say: INVALID_ARGUMENT)"}
CONFORMANCE = scaled_dot_product_attention.declaration | Declaration({
    "weights": "it returns the output alone",
    "float64": "the softmax runs in float32 (jax.nn casts the logits): float64 results carry float32 rounding, "
               "relative errors of 1e-8 to 6e-8, 1e-4 with logits of +-5000",
    "masked_rows": "a query that sees no key gets the mean of all values (hidden logits are filled with "
                   "-0.7 * float32 max); one whose every key has bias -inf gets NaN",
    "non_finite": "a row whose visible scores are all -inf (from infinite inputs) gets the mean of its hidden keys' "
                  "values, not NaN (their logits are filled with a finite number)",
    **(_HALF_ON_CPU if jax.default_backend() == "cpu" else {})})
