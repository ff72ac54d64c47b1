"""Scaled dot-product attention and its masks, in NumPy.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.
"""

from __future__ import annotations

import numpy as np

from attention_np.common import checks

Rng = np.random.Generator | int | None


def scaled_dot_product_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    mask: np.ndarray | None = None,
    *,
    bias: np.ndarray | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    need_weights: bool = True,
    rng: Rng = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Attention(Q, K, V) = softmax(Q K^T * scale + bias) V, the softmax over the visible keys only.

    Args:
        q: queries (..., L, E).
        k: keys (..., S, E).
        v: values (..., S, Ev).
        mask: broadcasts to (..., L, S); an entry equal to 0 / False hides key j from query i.
        bias: added to the scores, broadcasts to (..., L, S); a -inf entry hides that key too.
        is_causal: hide keys j > i (top-left aligned when L != S); applies together with `mask`.
        scale: multiplies Q K^T; defaults to 1 / sqrt(E).
        dropout_p: inverted dropout on the weights before the value product.
        need_weights: return the weights; with False the second result is None.
        rng: dropout randomness: a NumPy Generator or an int seed (None: fresh randomness).

    Returns:
        out (..., L, Ev) and weights (..., L, S), the softmax probabilities before dropout (or None).
        A query with no visible key gets zeros in both.
    """
    batch, scale, empty = _prepare(q, k, v, mask, bias, is_causal=is_causal, scale=scale, dropout_p=dropout_p,
                                   need_weights=need_weights)
    if empty is not None:  # L = 0 or S = 0: nothing to attend
        return empty
    dtype, work = q.dtype, np.promote_types(q.dtype, np.float32)  # float16, bfloat16: sums, softmax in float32
    if not need_weights and dropout_p == 0.0:  # no weights wanted: the fast path, same result (see fast.py)
        from .fast import attention

        return attention(q, k, v, mask, bias=bias, is_causal=is_causal, scale=scale, batch=batch), None
    q, k, v = (x.astype(work, copy=False) for x in (q, k, v))
    visible = _visible(mask, bias, is_causal, (*batch, q.shape[-2], k.shape[-2]))  # None: every key

    # 1) scores: every query against every key; (q * scale) k^T = (q k^T) * scale with L*E products, not L*S
    scores = (q * scale) @ np.swapaxes(k, -1, -2)  # (..., L, E) x (..., E, S) -> (..., L, S)
    if bias is not None:
        scores = scores + np.asarray(bias, dtype=scores.dtype)

    # 2) softmax over the keys each query may see, then the weighted sum of the values
    weights = _masked_softmax(scores, visible)  # (..., L, S)
    out = _dropout(weights, dropout_p, rng) @ v  # (..., L, S) x (..., S, Ev) -> (..., L, Ev)
    return out.astype(dtype, copy=False), (weights.astype(dtype, copy=False) if need_weights else None)


def causal_mask(L: int, S: int) -> np.ndarray:
    """Boolean (L, S): True where key j <= query i (top-left aligned), i.e. the keys a query may see."""
    return np.tril(np.ones((L, S), dtype=bool))


def padding_mask(lengths: np.ndarray, S: int) -> np.ndarray:
    """Boolean (B, 1, 1, S) from lengths (B,): True for the first lengths[b] keys of sequence b.

    The two singleton axes stand for H and L, so the mask broadcasts over (B, H, L, S) scores.
    """
    lengths = np.asarray(lengths)
    return np.arange(S) < lengths[..., None, None, None]  # (B,) -> (B, 1, 1, S)


def _prepare(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None, bias: np.ndarray | None, *,
             is_causal: bool, scale: float | None, dropout_p: float,
             need_weights: bool) -> tuple[tuple, float, tuple | None]:
    """The checks before the math. Returns the leading axes (...) q, k and v broadcast to; the scale
    (1 / sqrt(E) by default); and, when there is nothing to attend (L = 0 or S = 0), the result itself
    (else None)."""
    batch = checks.attention_batch(q.shape, k.shape, v.shape)
    checks.same_floating_dtype(_dtypes(q=q, k=k, v=v))
    checks.probability("dropout_p", dropout_p)
    scale = checks.default_scale(scale, q.shape, k.shape)
    L, S = q.shape[-2], k.shape[-2]
    if L > 0 and S > 0:
        return batch, scale, None
    # no queries, or no keys to see: every output is zeros
    _visible(mask, bias, is_causal, (*batch, L, S))  # the masks' shapes are still checked
    weights = np.zeros((*batch, L, S), q.dtype)
    return batch, scale, (np.zeros((*batch, L, v.shape[-1]), q.dtype), weights if need_weights else None)


def _dtypes(**arrays: np.ndarray) -> dict[str, tuple[str, bool]]:
    """{argument name: (dtype name, is floating)}, for the dtype checks shared by the backends."""
    return {name: (str(x.dtype), np.issubdtype(x.dtype, np.floating)) for name, x in arrays.items()}


def _visible(mask: np.ndarray | None, bias: np.ndarray | None, is_causal: bool,
             scores_shape: tuple) -> np.ndarray | None:
    """True where a query may see a key: kept by `mask`, not -inf in `bias`, allowed by causality.
    Broadcasts to the scores' shape (..., L, S); None when nothing hides a key."""
    L, S = scores_shape[-2:]
    visible = None
    if mask is not None:
        checks.broadcasts_to("mask", np.shape(mask), scores_shape, "..., L, S")
        mask = np.asarray(mask)
        checks.binary_mask(np.issubdtype(mask.dtype, np.floating), bool(np.all((mask == 0) | (mask == 1))))
        visible = mask != 0
    if bias is not None:
        checks.broadcasts_to("bias", np.shape(bias), scores_shape, "..., L, S")
        visible = _both(visible, np.asarray(bias) != -np.inf)
    if is_causal:
        visible = _both(visible, causal_mask(L, S))
    return visible


def _both(visible: np.ndarray | None, rule: np.ndarray) -> np.ndarray:
    return rule if visible is None else visible & rule


def _masked_softmax(scores: np.ndarray, visible: np.ndarray | None) -> np.ndarray:
    """softmax over the visible entries of each row (last axis); a row with none visible is all zeros.

    weights_ij = exp(s_ij - m_i) / sum_j' exp(s_ij' - m_i) over visible j, with m_i the row maximum.
    Subtracting m_i changes nothing mathematically and keeps exp from overflowing.
    """
    if visible is None:  # every key visible: the plain softmax
        exp = np.exp(scores - np.max(scores, axis=-1, keepdims=True, initial=-np.inf))  # (..., L, S)
        return exp / np.sum(exp, axis=-1, keepdims=True)
    scores = np.where(visible, scores, -np.inf)  # hidden entries become exp(-inf) = 0 below
    row_max = np.max(scores, axis=-1, keepdims=True, initial=-np.inf)  # (..., L, 1)
    row_max = np.where(row_max == -np.inf, 0, row_max)  # fully masked row: any finite shift will do
    exp = np.exp(scores - row_max)  # (..., L, S)
    total = np.sum(exp, axis=-1, keepdims=True)  # (..., L, 1)
    return exp / np.where(total == 0, 1, total)  # fully masked row: 0 / 1 = 0, never 0 / 0


def _dropout(x: np.ndarray, p: float, rng: Rng) -> np.ndarray:
    """Inverted dropout: zero each entry with probability p and scale the others by 1 / (1 - p)."""
    if p == 0.0:
        return x
    keep = np.random.default_rng(rng).random(x.shape) >= p  # a Generator passes through unchanged
    return x * keep / (1 - p)


def _rngs(rng: Rng, n: int) -> list[np.random.Generator]:
    """n sources of randomness from one rng: NumPy draws them in turn from one Generator
    (None: a fresh one)."""
    return [np.random.default_rng(rng)] * n
