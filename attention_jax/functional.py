"""Scaled dot-product attention and rotary embeddings, in JAX; the masks are in primitives.py.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from attention_np.common import validation
from attention_np.common.records import Structure

from .fast import attention
from .primitives import (
    _alibi,
    _at_least_float32,
    _integers,
    _masked_softmax,
    _modded_whole,
    _Mods,
    _mods,
    _ranked,
    _sink_logits,
    _visible,
)

Rng = jax.Array | None


def scaled_dot_product_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None = None,
    *,
    bias: jax.Array | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    q_offset: int | jax.Array = 0,
    window: tuple[int | None, int | None] | None = None,
    key_lengths: jax.Array | None = None,
    softcap: float | None = None,
    enable_gqa: bool = False,
    mask_mod: Callable[..., Any] | None = None,
    score_mod: Callable[..., Any] | None = None,
    sinks: jax.Array | None = None,
    alibi_slopes: jax.Array | None = None,
    dropout_p: float = 0.0,
    need_weights: bool = True,
    rng: Rng = None,
) -> tuple[jax.Array, jax.Array | None]:
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
        rng: dropout randomness: a jax.random key (required while dropout is active).

    Returns:
        out (..., L, Ev) and weights (..., L, S), the softmax probabilities before dropout (or None); with
        sinks, the keys' probabilities, which sum to less than 1. A query with no visible key gets zeros in both.
    """
    mods = _mods("scaled_dot_product_attention", q, k, v, mask_mod, score_mod)  # None without any
    if enable_gqa:  # grouped-query attention is attention with k and v broadcast over each group of query heads
        q, k, v, mask, bias, q_offset, key_lengths = _grouped(q, k, v, mask, bias, q_offset, key_lengths)
    structure = Structure(is_causal=is_causal, q_offset=q_offset, window=validation.window(window),
                          key_lengths=key_lengths)
    out, weights = _attention(q, k, v, mask, bias, structure, mods, scale=scale, softcap=softcap, sinks=sinks,
                              alibi_slopes=alibi_slopes, grouped=enable_gqa, dropout_p=dropout_p,
                              need_weights=need_weights, rng=rng)
    if enable_gqa:  # (..., Hkv, G, L, Ev | S) -> (..., H, L, Ev | S)
        return _ungrouped(out), _ungrouped(weights)
    return out, weights


def _attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, bias: jax.Array | None,
               structure: Structure, mods: _Mods | None, *, scale: float | None, softcap: float | None,
               sinks: jax.Array | None, grouped: bool, dropout_p: float, need_weights: bool,
               rng: Rng, alibi_slopes: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
    """scaled_dot_product_attention on q, k, v as given, or grouped (`grouped`): q (..., Hkv, G, L, E) against k
    and v (..., Hkv, 1, S, E | Ev); out and weights in that layout."""
    batch, scale, empty = _prepare(q, k, v, mask, bias, structure, scale=scale, softcap=softcap,
                                   dropout_p=dropout_p, need_weights=need_weights, rng=rng)
    dtype, work = q.dtype, _at_least_float32(q.dtype)  # float16, bfloat16: sums, softmax in float32
    sinks = _sink_logits(sinks, batch, grouped, work)  # (..., 1, 1) against the scores, or None
    bias = _alibi(alibi_slopes, bias, structure.q_offset, batch, grouped, q.shape[-2], k.shape[-2], work)
    if empty is not None:  # L = 0 or S = 0: nothing to attend
        return empty
    q, k, v = (_ranked(x, len(batch) + 2) for x in (q, k, v))  # jax: one rank for all, no rank promotion
    if not need_weights and dropout_p == 0.0:  # no weights wanted: the fast path, same result (see fast.py)
        return attention(q, k, v, mask, bias=bias, structure=structure, scale=scale, softcap=softcap,
                         batch=batch, mods=mods, sinks=sinks), None
    q, k, v = (x.astype(work) for x in (q, k, v))
    visible = _visible(mask, bias, structure, (*batch, q.shape[-2], k.shape[-2]))  # None: every key

    # 1) scores: every query against every key; (q * scale) k^T = (q k^T) * scale with L*E products, not L*S
    scores = (q * scale) @ jnp.swapaxes(k, -1, -2)  # (..., L, E) x (..., E, S) -> (..., L, S)
    if softcap is not None:  # soft-capping, before the bias and the masks: a hidden key stays hidden
        scores = softcap * jnp.tanh(scores / softcap)
    scores, visible = _modded_whole(mods, scores, visible, batch, q.shape[1:-2])  # score_mod, mask_mod (if any)
    if bias is not None:
        scores = scores + _ranked(jnp.asarray(bias, dtype=scores.dtype), scores.ndim)

    # 2) softmax over the keys each query may see, then the weighted sum of the values; the scores of q and k
    # are shared by the batch axes only v or the masks carry, the weights and their dropout are not
    scores = jnp.broadcast_to(scores, (*batch, *scores.shape[-2:]))  # (..., L, S): each batch element its own
    weights = _masked_softmax(scores, visible, sinks)  # (..., L, S); with sinks, each row's sink joins the sum
    out = _dropout(weights, dropout_p, rng) @ v  # (..., L, S) x (..., S, Ev) -> (..., L, Ev)
    return out.astype(dtype), (weights.astype(dtype) if need_weights else None)


def apply_rope(x: jax.Array, positions: int | jax.Array, *, theta: float = 10000.0,
               interleaved: bool = False) -> jax.Array:
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
    positions = jnp.asarray(positions)
    validation.rope(x.shape, positions.shape, str(positions.dtype), jnp.issubdtype(positions.dtype, jnp.integer), theta)
    work = _at_least_float32(x.dtype)  # float16, bfloat16: in float32
    cos, sin = _rope_table(_ranked(positions, x.ndim - 1), x.shape[-1], theta, work, interleaved)
    return _turned(x, cos, sin, interleaved)


def _rope_table(positions: jax.Array, E: int, theta: float, work: Any,
                interleaved: bool) -> tuple[jax.Array, jax.Array]:
    """cos and sin (..., L, E) of each entry's angle p * theta^(-2j / E), j the index of its pair, for positions
    (..., L), in dtype `work`, laid out as the pairs are (`interleaved`); sin is negated on each pair's first
    entry, so that turning is x cos + partner(x) sin (_turned)."""
    inv_freq = 1.0 / theta ** (jnp.arange(0, E, 2, dtype=work) / E)  # (E/2,): theta^(-2j / E)
    # jax: both at the positions' rank plus one, as rank promotion may be refused
    angles = positions[..., None].astype(work) * _ranked(inv_freq, positions.ndim + 1)  # (..., L, E/2)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    return _paired(cos, cos, interleaved), _paired(-sin, sin, interleaved)  # (..., L, E) each


def _paired(first: jax.Array, second: jax.Array, interleaved: bool) -> jax.Array:
    """(..., E/2) each -> (..., E): `first` on each pair's first entry, `second` on its second, in the pairs'
    layout: (x_2j, x_2j+1) interleaved, else (x_j, x_{j + E/2})."""
    if interleaved:
        return jnp.stack((first, second), axis=-1).reshape(*first.shape[:-1], -1)
    return jnp.concatenate((first, second), axis=-1)


def _turned(x: jax.Array, cos: jax.Array, sin: jax.Array, interleaved: bool) -> jax.Array:
    """x (..., L, E) with each pair (x1, x2) turned, (x1 cos - x2 sin, x2 cos + x1 sin) = x cos + partner(x) sin,
    partner(x) holding x2 where x holds x1 and x1 where x2, the tables cos and sin (..., L, E) from _rope_table;
    computed in their dtype and returned in x's."""
    dtype, E = x.dtype, x.shape[-1]
    cos, sin, x = _ranked(cos, x.ndim), _ranked(sin, x.ndim), x.astype(cos.dtype)  # jax: at x's rank, as above
    # the partner: each pair's two entries swapped, (x_2j+1, x_2j) interleaved, else the halves (x2, x1)
    if interleaved:
        partner = x.reshape(*x.shape[:-1], E // 2, 2)[..., ::-1].reshape(x.shape)
    else:
        partner = jnp.roll(x, E // 2, axis=-1)
    return (x * cos + partner * sin).astype(dtype)  # (..., L, E)


def _prepare(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, bias: jax.Array | None,
             structure: Structure, *, scale: float | None, softcap: float | None, dropout_p: float,
             need_weights: bool, rng: Rng) -> tuple[tuple, float, tuple | None]:
    """The checks before the math. Returns the leading axes (...) q, k and v broadcast to; the scale
    (1 / sqrt(E) by default); and, when there is nothing to attend (L = 0 or S = 0), the result itself
    (else None)."""
    batch = validation.attention_batch(q.shape, k.shape, v.shape)
    validation.same_floating_dtype(_dtypes(q=q, k=k, v=v))
    validation.probability("dropout_p", dropout_p)
    validation.dropout_rng(dropout_p, rng, "scaled_dot_product_attention")  # jax: no global RNG to fall back on
    validation.softcap(softcap)
    scale = validation.default_scale(scale, q.shape, k.shape)
    L, S = q.shape[-2], k.shape[-2]
    if L > 0 and S > 0:
        return batch, scale, None
    # no queries, or no keys to see: every output is zeros
    _visible(mask, bias, structure, (*batch, L, S))  # the masks' shapes are still checked
    weights = jnp.zeros((*batch, L, S), q.dtype)
    return batch, scale, (jnp.zeros((*batch, L, v.shape[-1]), q.dtype), weights if need_weights else None)


def _grouped(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, bias: jax.Array | None,
             q_offset: int | jax.Array, key_lengths: jax.Array | None) -> tuple:
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
            validation.broadcasts_to(name, jnp.shape(x), scores_shape, "..., H, L, S")
    for name, x in (("q_offset", q_offset), ("key_lengths", key_lengths)):
        if x is not None:
            _integers(x, name, batch)

    def split(x: jax.Array | None, trailing: int) -> jax.Array | None:
        if x is None or jnp.ndim(x) <= trailing:  # no head axis: it broadcasts over the groups as it is
            return x
        return jnp.reshape(x, validation.grouped_shape(jnp.shape(x), H, Hkv, trailing))

    return q, k, v, split(mask, 2), split(bias, 2), split(q_offset, 0), split(key_lengths, 0)


def _ungrouped(x: jax.Array | None) -> jax.Array | None:
    """(..., Hkv, G, L, *) -> (..., H, L, *): the groups' heads in order again, H = Hkv * G."""
    return None if x is None else x.reshape(*x.shape[:-4], x.shape[-4] * x.shape[-3], *x.shape[-2:])


def _dtypes(**arrays: jax.Array) -> dict[str, tuple[str, bool]]:
    """{argument name: (dtype name, is floating)}, for the dtype checks shared by the backends."""
    return {name: (str(x.dtype), jnp.issubdtype(x.dtype, jnp.floating)) for name, x in arrays.items()}


def _dropout(x: jax.Array, p: float, rng: Rng) -> jax.Array:
    """Inverted dropout: zero each entry with probability p and scale the others by 1 / (1 - p)."""
    if p == 0.0:
        return x
    keep = jax.random.bernoulli(rng, 1 - p, x.shape)
    return x * keep.astype(x.dtype) / (1 - p)  # jax: explicit cast, as strict promotion forbids bool * float


def _rngs(rng: Rng, n: int) -> list[Rng]:
    """n sources of randomness from one rng: JAX splits the key into n independent keys
    (None stays None: JAX has no global randomness to fall back on)."""
    return [None] * n if rng is None else list(jax.random.split(rng, n))
