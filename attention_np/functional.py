"""Scaled dot-product attention and rotary embeddings, in NumPy; the masks are in primitives.py.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from attention_np.common import validation
from attention_np.common.mods import from_keywords
from attention_np.common.records import Structure

from .fast import attention
from .primitives import _alibi, _integers, _masked_softmax, _modded, _Mods, _sink_logits, _visible

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
    q_offset: int | np.ndarray = 0,
    window: tuple[int | None, int | None] | None = None,
    key_lengths: np.ndarray | None = None,
    softcap: float | None = None,
    enable_gqa: bool = False,
    mask_mod: Callable[..., Any] | None = None,
    score_mod: Callable[..., Any] | None = None,
    sinks: np.ndarray | None = None,
    alibi_slopes: np.ndarray | None = None,
    dropout_p: float = 0.0,
    need_weights: bool = True,
    rng: Rng = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Attention(Q, K, V) = softmax(score_mod(softcap(Q K^T * scale)) + bias) V, the softmax over the visible
    keys only, softcap(x) = softcap * tanh(x / softcap) (x itself when softcap is None), score_mod the identity
    when None.

    Args:
        q: queries (..., L, E).
        k: keys (..., S, E).
        v: values (..., S, Ev).
        mask: broadcasts to (..., L, S); an entry equal to 0 / False hides key j from query i.
        bias: added to the scores, broadcasts to (..., L, S); a -inf entry hides that key too.
        is_causal: hide keys j > p_i, p_i = q_offset + i (top-left aligned when q_offset is 0).
        scale: multiplies Q K^T; defaults to 1 / sqrt(E).
        q_offset: the position of query 0, an int or an integer array broadcasting to (...); keys are at 0..S-1.
        window: (left, right), ints or None: hide keys outside p_i - left <= j <= p_i + right.
        key_lengths: integer array broadcasting to (...): hide keys j >= key_lengths.
        softcap: a positive number: raw scores become softcap * tanh(raw / softcap) before bias and masks.
        enable_gqa: grouped-query attention: q has H heads (axis -3), k and v Hkv, H a multiple of Hkv; query
            head h uses key/value head h // (H // Hkv). mask, bias, q_offset, key_lengths follow q's heads.
        mask_mod: (b, h, q_idx, kv_idx) -> bool, True where the query sees the key (attention_np.common.mods);
            needs q, k, v of four axes (B, H, L, E); and-ed with mask and the keyword rules.
        score_mod: (score, b, h, q_idx, kv_idx) -> the score the softmax uses, applied after softcap and before
            bias; needs four axes as mask_mod.
        sinks: one logit per head, broadcasting to (..., H) (per query head with enable_gqa): it joins each
            softmax's denominator and carries no value, weights_ij = exp(s_ij) / (exp(sinks) + sum_j exp(s_ij)).
        alibi_slopes: ALiBi's slopes, (H,) or (B, H), one per query head (also with enable_gqa): each score gets
            the bias -slope_h * |p_i - j|, p_i = q_offset + i, after softcap, as bias (see alibi_slopes).
        dropout_p: inverted dropout on the weights before the value product.
        need_weights: return the weights; with False the second result is None.
        rng: dropout randomness: a NumPy Generator or an int seed (None: fresh randomness).

    Returns:
        out (..., L, Ev) and weights (..., L, S), the softmax probabilities before dropout (or None); with
        sinks, the keys' probabilities, which sum to less than 1. A query with no visible key gets zeros in both.
    """
    mods = _mods("scaled_dot_product_attention", q, k, v, mask_mod, score_mod, enable_gqa)  # None: no mods
    if enable_gqa:  # grouped-query attention is attention with k and v broadcast over each group of query heads
        q, k, v, mask, bias, q_offset, key_lengths = _grouped(q, k, v, mask, bias, q_offset, key_lengths)
    structure = Structure(is_causal=is_causal, q_offset=q_offset, window=validation.window(window),
                          key_lengths=key_lengths)
    out, weights = _attention(q, k, v, mask, bias, structure, scale=scale, softcap=softcap, mods=mods,
                              sinks=sinks, alibi_slopes=alibi_slopes, grouped=enable_gqa, dropout_p=dropout_p,
                              need_weights=need_weights, rng=rng)
    if enable_gqa:
        return _ungrouped(out), _ungrouped(weights)  # (..., Hkv, G, L, Ev | S) -> (..., H, L, Ev | S)
    return out, weights


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None, bias: np.ndarray | None,
               structure: Structure, *, scale: float | None, softcap: float | None, mods: _Mods | None,
               sinks: np.ndarray | None, grouped: bool, dropout_p: float, need_weights: bool,
               rng: Rng, alibi_slopes: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """scaled_dot_product_attention once the heads are grouped (`grouped`, enable_gqa: q (..., Hkv, G, L, E), k
    and v (..., Hkv, 1, S, *)) and the mods' index arrays laid out as those scores."""
    batch, scale, empty = _prepare(q, k, v, mask, bias, structure, scale=scale, softcap=softcap,
                                   dropout_p=dropout_p, need_weights=need_weights)
    dtype, work = q.dtype, np.promote_types(q.dtype, np.float32)  # float16, bfloat16: sums, softmax in float32
    sinks = _sink_logits(sinks, batch, grouped, work)  # (..., 1, 1) against the scores, or None
    bias = _alibi(alibi_slopes, bias, structure.q_offset, batch, grouped, q.shape[-2], k.shape[-2], work)
    if empty is not None:  # L = 0 or S = 0: nothing to attend
        return empty
    if not need_weights and dropout_p == 0.0:  # no weights wanted: the fast path, same result (see fast.py)
        return attention(q, k, v, mask, bias=bias, structure=structure, scale=scale, softcap=softcap,
                         batch=batch, mods=mods, sinks=sinks), None
    q, k, v = (x.astype(work, copy=False) for x in (q, k, v))
    visible = _visible(mask, bias, structure, (*batch, q.shape[-2], k.shape[-2]))  # None: every key

    # 1) scores: every query against every key; (q * scale) k^T = (q k^T) * scale with L*E products, not L*S
    scores = (q * scale) @ np.swapaxes(k, -1, -2)  # (..., L, E) x (..., E, S) -> (..., L, S)
    capping = from_keywords(structure, softcap)[1]  # the catalogue's softcap(cap), or None
    if capping is not None:  # soft-capping, before the bias and the masks: a hidden key stays hidden
        scores = capping(scores, None, None, None, None)
    if mods is not None:  # score_mod after softcap, before the bias; mask_mod and -inf scores hide keys
        scores, visible = _modded(mods, scores, visible, mods.tile(), mods.mask_mod, (*batch, *scores.shape[-2:]))
    if bias is not None:
        scores = scores + np.asarray(bias, dtype=scores.dtype)

    # 2) softmax over the keys each query may see, then the weighted sum of the values; the scores of q and k
    # are shared by the batch axes only v or the masks carry, the weights and their dropout are not
    scores = np.broadcast_to(scores, (*batch, *scores.shape[-2:]))  # (..., L, S): each batch element its own
    weights = _masked_softmax(scores, visible, sinks)  # (..., L, S); with sinks, each row's sink joins the sum
    out = _dropout(weights, dropout_p, rng) @ v  # (..., L, S) x (..., S, Ev) -> (..., L, Ev)
    return out.astype(dtype, copy=False), (weights.astype(dtype, copy=False) if need_weights else None)


def _mods(function: str, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask_mod: Callable[..., Any] | None,
          score_mod: Callable[..., Any] | None, enable_gqa: bool) -> _Mods | None:
    """None without mods; else, after the check that q, k and v have four axes, the mods with their index arrays
    laid out as the scores: (B, H, L, S), or with enable_gqa (B, Hkv, G, L, S), h the query head either way."""
    if mask_mod is None and score_mod is None:
        return None
    B, H = validation.mods_inputs(function, q.shape, k.shape, v.shape)
    heads = (H,)
    if enable_gqa:  # the grouped scores' heads: (Hkv, G)
        H, Hkv = validation.grouped_heads(q.shape, k.shape, v.shape)
        heads = (Hkv, H // Hkv)
    return _Mods.of(mask_mod, score_mod, B, heads, q.shape[-2], k.shape[-2])


def apply_rope(x: np.ndarray, positions: int | np.ndarray, *, theta: float = 10000.0,
               interleaved: bool = False) -> np.ndarray:
    """RoPE(x) at position p: each pair (x1, x2) of x turned by the angle p * theta^(-2j / E), j its index,
    (x1, x2) -> (x1 cos - x2 sin, x1 sin + x2 cos); the pairs are (x_j, x_{j + E/2}) (half rotation: Llama,
    Hugging Face's rotate_half, ONNX RotaryEmbedding with interleaved=0) or (x_2j, x_2j+1) (interleaved).

    Args:
        x: (..., L, E), E even: each row a query or key of one head.
        positions: integers broadcasting to (..., L): each row's absolute position (an int: every row's).
        theta: the base of the angles' geometric progression.
        interleaved: the pairs' layout, as above.

    Returns:
        (..., L, E) in x's dtype, computed in at least float32. Rotations keep lengths, and the dot product
        of two rotated rows depends on their positions only through their difference.
    """
    positions = np.asarray(positions)
    validation.rope(x.shape, positions.shape, str(positions.dtype), np.issubdtype(positions.dtype, np.integer), theta)
    work = np.promote_types(x.dtype, np.float32)  # float16, bfloat16: in float32
    cos, sin = _rope_table(positions, x.shape[-1], theta, work, interleaved)
    return _turned(x, cos, sin, interleaved)


def _rope_table(positions: np.ndarray, E: int, theta: float, work: np.dtype,
                interleaved: bool) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin (..., L, E) of each entry's angle p * theta^(-2j / E), j the index of its pair, for positions
    (..., L), in dtype `work`, laid out as the pairs are (`interleaved`); sin is negated on each pair's first
    entry, so that turning is x cos + partner(x) sin (_turned)."""
    inv_freq = 1.0 / theta ** (np.arange(0, E, 2, dtype=work) / E)  # (E/2,): theta^(-2j / E)
    angles = positions[..., None].astype(work) * inv_freq  # (..., L, 1) x (E/2,) -> (..., L, E/2)
    cos, sin = np.cos(angles), np.sin(angles)
    return _paired(cos, cos, interleaved), _paired(-sin, sin, interleaved)  # (..., L, E) each


def _paired(first: np.ndarray, second: np.ndarray, interleaved: bool) -> np.ndarray:
    """(..., E/2) each -> (..., E): `first` on each pair's first entry, `second` on its second, in the pairs'
    layout: (x_2j, x_2j+1) interleaved, else (x_j, x_{j + E/2})."""
    if interleaved:
        return np.stack((first, second), axis=-1).reshape(*first.shape[:-1], -1)
    return np.concatenate((first, second), axis=-1)


def _turned(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool) -> np.ndarray:
    """x (..., L, E) with each pair (x1, x2) turned, (x1 cos - x2 sin, x2 cos + x1 sin) = x cos + partner(x) sin,
    partner(x) holding x2 where x holds x1 and x1 where x2, the tables cos and sin (..., L, E) from _rope_table;
    computed in their dtype and returned in x's."""
    dtype, E = x.dtype, x.shape[-1]
    x = x.astype(cos.dtype, copy=False)
    # the partner: each pair's two entries swapped, (x_2j+1, x_2j) interleaved, else the halves (x2, x1)
    if interleaved:
        partner = x.reshape(*x.shape[:-1], E // 2, 2)[..., ::-1].reshape(x.shape)
    else:
        partner = np.roll(x, E // 2, axis=-1)
    return (x * cos + partner * sin).astype(dtype, copy=False)  # (..., L, E)


def _prepare(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None, bias: np.ndarray | None,
             structure: Structure, *, scale: float | None, softcap: float | None, dropout_p: float,
             need_weights: bool) -> tuple[tuple, float, tuple | None]:
    """The checks before the math. Returns the leading axes (...) q, k and v broadcast to; the scale
    (1 / sqrt(E) by default); and, when there is nothing to attend (L = 0 or S = 0), the result itself
    (else None)."""
    batch = validation.attention_batch(q.shape, k.shape, v.shape)
    validation.same_floating_dtype(_dtypes(q=q, k=k, v=v))
    validation.probability("dropout_p", dropout_p)
    validation.softcap(softcap)
    scale = validation.default_scale(scale, q.shape, k.shape)
    L, S = q.shape[-2], k.shape[-2]
    if L > 0 and S > 0:
        return batch, scale, None
    # no queries, or no keys to see: every output is zeros
    _visible(mask, bias, structure, (*batch, L, S))  # the masks' shapes are still checked
    weights = np.zeros((*batch, L, S), q.dtype)
    return batch, scale, (np.zeros((*batch, L, v.shape[-1]), q.dtype), weights if need_weights else None)


def _grouped(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None, bias: np.ndarray | None,
             q_offset: int | np.ndarray, key_lengths: np.ndarray | None) -> tuple:
    """Grouped-query attention as broadcasting: q (..., H, L, E) -> (..., Hkv, G, L, E) and k, v
    (..., Hkv, S, E | Ev) -> (..., Hkv, 1, S, E | Ev), G = H // Hkv, so query head h = (h // G, h % G) meets
    key/value head h // G. mask and bias (..., H, L, S) and q_offset, key_lengths (..., H) split their head
    axis alike, after their shapes are checked against q's H heads. Reshapes only: nothing is copied."""
    H, Hkv = validation.grouped_heads(q.shape, k.shape, v.shape)
    q, k, v = (x.reshape(validation.grouped_shape(x.shape, H, Hkv, 2)) for x in (q, k, v))
    batch = (*validation.attention_batch(q.shape, k.shape, v.shape)[:-2], H)  # the scores' leading axes (..., H)
    scores_shape = (*batch, q.shape[-2], k.shape[-2])  # (..., H, L, S)
    for name, x in (("mask", mask), ("bias", bias)):
        if x is not None:
            validation.broadcasts_to(name, np.shape(x), scores_shape, "..., H, L, S")
    for name, x in (("q_offset", q_offset), ("key_lengths", key_lengths)):
        if x is not None:
            _integers(x, name, batch)

    def split(x: np.ndarray | None, trailing: int) -> np.ndarray | None:
        if x is None or np.ndim(x) <= trailing:  # no head axis: it broadcasts over the groups as it is
            return x
        return np.reshape(x, validation.grouped_shape(np.shape(x), H, Hkv, trailing))

    return q, k, v, split(mask, 2), split(bias, 2), split(q_offset, 0), split(key_lengths, 0)


def _ungrouped(x: np.ndarray | None) -> np.ndarray | None:
    """(..., Hkv, G, L, *) -> (..., H, L, *): the groups' heads in order again, H = Hkv * G."""
    return None if x is None else x.reshape(*x.shape[:-4], x.shape[-4] * x.shape[-3], *x.shape[-2:])


def _dtypes(**arrays: np.ndarray) -> dict[str, tuple[str, bool]]:
    """{argument name: (dtype name, is floating)}, for the dtype checks shared by the backends."""
    return {name: (str(x.dtype), np.issubdtype(x.dtype, np.floating)) for name, x in arrays.items()}


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
