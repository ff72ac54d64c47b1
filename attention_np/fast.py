"""The fast path of scaled dot-product attention in NumPy: the same result as the explicit path, without
the weights, computed to save passes over the (..., L, S) scores.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

What makes it faster than the explicit path: the scale is folded into q, (..., L, E) instead of
(..., L, S); the scores are shifted, exponentiated and masked in place; and the softmax is normalised after
the value product, dividing (..., L, Ev) instead of (..., L, S). Where k and v hold one head for several
query heads (grouped-query attention's groups, multi-query attention), each group is one matmul of G * L
rows, and k and v are never copied per head. float16 is computed in float32, as on the explicit path;
float32 stays float32.
"""

from __future__ import annotations

import numpy as np

from attention_np.common import validation
from attention_np.common.records import Structure

from .primitives import _modded, _Mods, _visible


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None, *,
              bias: np.ndarray | None, structure: Structure, scale: float, softcap: float | None,
              batch: tuple, mods: _Mods | None = None, sinks: np.ndarray | None = None) -> np.ndarray:
    """softmax(score_mod(softcap(Q K^T * scale)) + bias) V over the visible keys, as scaled_dot_product_attention's
    out; `mods` (None: none) with their index arrays laid out as the scores (functional._mods); `sinks` (None:
    none) laid out against the scores (..., 1, 1), each row's sink logit in its denominator."""
    dtype, work = q.dtype, np.promote_types(q.dtype, np.float32)  # float16: sums, softmax in float32
    q, k, v = (x.astype(work, copy=False) for x in (q, k, v))
    visible = _visible(mask, bias, structure, (*batch, q.shape[-2], k.shape[-2]))  # None: every key
    scores = _grouped_matmul(q * scale, np.swapaxes(k, -1, -2))  # (..., L, E) x (..., E, S) -> (..., L, S)
    if softcap is not None:  # softcap * tanh(raw / softcap), in place, before the bias and the masks
        np.divide(scores, softcap, out=scores)
        np.tanh(scores, out=scores)
        np.multiply(scores, softcap, out=scores)
    if mods is not None:  # score_mod after softcap, before the bias; mask_mod and -inf scores hide keys
        scores, visible = _modded(mods, scores, visible, mods.tile(), mods.mask_mod, (*batch, *scores.shape[-2:]))
    scores = _broadcast(scores, bias, visible, sinks)  # mask, bias and sinks may carry axes only v has
    if bias is not None:
        scores += np.asarray(bias, dtype=scores.dtype)
    if visible is not None:
        np.copyto(scores, -np.inf, where=~visible)  # hidden: exp(-inf) = 0
    row_max = np.max(scores, axis=-1, keepdims=True, initial=-np.inf)  # (..., L, 1)
    if sinks is not None:  # the shift is the greater of the row's maximum and its sink
        row_max = np.maximum(row_max, sinks)
    if visible is not None or sinks is not None:
        row_max[row_max == -np.inf] = 0  # a fully masked row (and no finite sink): any finite shift will do
    np.subtract(scores, row_max, out=scores)
    np.exp(scores, out=scores)  # (..., L, S), unnormalised weights
    total = np.sum(scores, axis=-1, keepdims=True)  # (..., L, 1)
    if sinks is not None:  # the sink's share of the denominator; it carries no value
        total += np.exp(sinks - row_max)
    out = _grouped_matmul(scores, v)  # (..., L, S) x (..., S, Ev) -> (..., L, Ev)
    out /= total if visible is None and sinks is None else np.where(total == 0, 1, total)  # after the product
    return out.astype(dtype, copy=False)


def _grouped_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b, (..., G, L, N) x (..., 1, N, M) -> (..., G, L, M). Where b holds one head that G heads of a
    share (GQA's groups, multi-query attention), the G heads become one matrix of G * L rows, so each group
    takes one matmul, not one per head, and b is never copied per head."""
    if not validation.shared_kv_head(a.shape, b.shape, b.shape):
        return a @ b
    (G, L, N), M = a.shape[-3:], b.shape[-1]
    b = b.reshape(*b.shape[:-3], N, M) if b.ndim >= 3 else b  # (..., 1, N, M) -> (..., N, M)
    out = a.reshape(*a.shape[:-3], G * L, N) @ b  # (..., G * L, N) x (..., N, M) -> (..., G * L, M)
    return out.reshape(*out.shape[:-2], G, L, M)


def _broadcast(scores: np.ndarray, *others: np.ndarray | None) -> np.ndarray:
    """`scores` with the leading axes of `others` too, as an array that can be written in place."""
    full = np.broadcast_shapes(scores.shape, *(np.shape(x) for x in others if x is not None))
    return scores if scores.shape == full else np.broadcast_to(scores, full).copy()
