"""Scaled dot-product attention and rotary embeddings, in PyTorch; the masks are in primitives.py.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from attention_np.common import validation
from attention_np.common.records import Structure

from .fast import _grouped_matmul, attention, grouped_attention
from .primitives import (
    _alibi,
    _both,
    _cast,
    _indices,
    _integers,
    _mask_mod_visible,
    _masked_softmax,
    _score_mod_scores,
    _sink_logits,
    _visible,
)

Rng = torch.Generator | None


def scaled_dot_product_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    q_offset: int | torch.Tensor = 0,
    window: tuple[int | None, int | None] | None = None,
    key_lengths: torch.Tensor | None = None,
    softcap: float | None = None,
    enable_gqa: bool = False,
    mask_mod: Callable[..., Any] | None = None,
    score_mod: Callable[..., Any] | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    need_weights: bool = True,
    rng: Rng = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention(Q, K, V) = softmax(softcap(Q K^T * scale) + bias) V, the softmax over the visible keys only,
    softcap(x) = softcap * tanh(x / softcap) (x itself when softcap is None).

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
        rng: dropout randomness: a torch.Generator (None: the global RNG).

    Returns:
        out (..., L, Ev) and weights (..., L, S), the softmax probabilities before dropout (or None); with
        sinks, the keys' probabilities, which sum to less than 1. A query with no visible key gets zeros in both.
    """
    modded = None  # scores -> score_mod's scores, with the index arrays it receives
    if mask_mod is not None or score_mod is not None:
        mask, modded = _mods(q, k, v, mask, mask_mod, score_mod)
    if enable_gqa and modded is None and sinks is None and alibi_slopes is None and _kernel_groups(
            q, k, v, mask, bias, q_offset, window, key_lengths, softcap, dropout_p, need_weights):  # torch: the
        # kernel's own enable_gqa, without the reshapes. A NaN or inf in q or k takes the general route's explicit
        # path (see the fast path in _attention): the call with the weights, which never goes to the kernel
        return _finite_or(q, k, lambda: grouped_attention(q, k, v, is_causal=is_causal, q_offset=q_offset, scale=scale),
                          lambda: scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale,
                                                               q_offset=q_offset, enable_gqa=True)[0]), None
    if enable_gqa:  # grouped-query attention is attention with k and v broadcast over each group of query heads
        q, k, v, mask, bias, q_offset, key_lengths = _grouped(q, k, v, mask, bias, q_offset, key_lengths)
    structure = Structure(is_causal=is_causal, q_offset=q_offset, window=validation.window(window),
                          key_lengths=key_lengths)
    out, weights = _attention(q, k, v, mask, bias, structure, scale=scale, softcap=softcap, modded=modded,
                              sinks=sinks, alibi_slopes=alibi_slopes, grouped=enable_gqa, dropout_p=dropout_p,
                              need_weights=need_weights, rng=rng)
    if enable_gqa:
        return _ungrouped(out), _ungrouped(weights)  # (..., Hkv, G, L, Ev | S) -> (..., H, L, Ev | S)
    return out, weights


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               bias: torch.Tensor | None, structure: Structure, *, scale: float | None, softcap: float | None,
               modded: Callable[[torch.Tensor], torch.Tensor] | None, dropout_p: float, need_weights: bool,
               rng: Rng, sinks: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None,
               grouped: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """scaled_dot_product_attention once the mods are evaluated (the mask_mod's keys in mask; `modded` the
    score_mod) and the heads grouped (`grouped`): the fast path or the explicit path."""
    batch, scale, empty = _prepare(q, k, v, mask, bias, structure, scale=scale, softcap=softcap,
                                   dropout_p=dropout_p, need_weights=need_weights)
    dtype, work = q.dtype, torch.promote_types(q.dtype, torch.float32)  # float16, bfloat16: sums, softmax in float32
    sinks = _sink_logits(sinks, batch, grouped, work, q.device)  # (..., 1, 1) against the scores, or None
    bias = _alibi(alibi_slopes, bias, structure.q_offset, batch, grouped, q.shape[-2], k.shape[-2], work, q.device)
    if empty is not None:  # L = 0 or S = 0: nothing to attend
        return empty
    # torch: the fused kernel returns finite rows for a NaN query, and its -inf masking lets a hidden NaN key
    # reach rows that do not see it, so a NaN or inf in q or k keeps the explicit path (their sum is then
    # not finite: one read of q and k). The kernel has no soft-capping of the raw scores and no score function
    # either, so softcap and score_mod too keep the explicit path, and so do sinks (it has no sink logit)
    fused = not need_weights and dropout_p == 0.0 and softcap is None and modded is None and sinks is None
    # torch: compiled, a mask takes the explicit path, whose check that it holds 0 and 1 reads its values outside
    # the graph; torch.cond's branches cannot (_finite_or)
    if fused and (mask is None or not torch.compiler.is_compiling()):
        # the explicit path is the call with the weights, which never goes to the kernel
        return _finite_or(q, k, lambda: attention(q, k, v, mask, bias=bias, structure=structure, scale=scale,
                                                  batch=batch),
                          lambda: _attention(q, k, v, mask, bias, structure, scale=scale, softcap=None, modded=None,
                                             dropout_p=0.0, need_weights=True, rng=None)[0]), None
    q, k, v = (x.to(work) for x in (q, k, v))
    visible = _visible(mask, bias, structure, (*batch, q.shape[-2], k.shape[-2]), q.device)  # None: every key

    # 1) scores: every query against every key; (q * scale) k^T = (q k^T) * scale with L*E products, not L*S
    scores = _grouped_matmul(q * scale, k.transpose(-1, -2))  # (..., L, E) x (..., E, S) -> (..., L, S)
    if softcap is not None:  # soft-capping, before the bias and the masks: a hidden key stays hidden
        scores = softcap * torch.tanh(scores / softcap)
    if modded is not None:  # the score function, after softcap and before the bias; a -inf score hides the key
        received = scores.expand(*batch, *scores.shape[-2:])  # (..., L, S)
        scores = modded(received)
        visible = _both(visible, scores != -math.inf)  # a row of -inf scores: zeros, never NaN
        if received.requires_grad:  # torch: autograd's 0 at a hidden key times a NaN or inf derivative of the
            hidden = visible.logical_not()  # score function there is NaN; the gradient there is 0
            received.register_hook(lambda d_received: d_received.masked_fill(hidden, 0))
    if bias is not None:
        scores = scores + torch.as_tensor(bias, dtype=scores.dtype, device=scores.device)

    # 2) softmax over the keys each query may see, then the weighted sum of the values; the scores of q and k
    # are shared by the batch axes only v or the masks carry, the weights and their dropout are not
    scores = scores.expand(*batch, *scores.shape[-2:])  # (..., L, S): each batch element its own
    weights = _masked_softmax(scores, visible, sinks)  # (..., L, S); with sinks, each row's sink joins the sum
    out = _grouped_matmul(_dropout(weights, dropout_p, rng), v)  # (..., L, S) x (..., S, Ev) -> (..., L, Ev)
    return out.to(dtype), (weights.to(dtype) if need_weights else None)


def _mods(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          mask_mod: Callable[..., Any] | None,
          score_mod: Callable[..., Any] | None) -> tuple[torch.Tensor | None, Callable | None]:
    """The mods on q (B, H, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev): mask and-ed with mask_mod's keys
    (B | 1, H | 1, L, S) (so that the fast path hands them to torch's kernel as one boolean mask), and
    scores -> score_mod(scores, b, h, q_idx, kv_idx) (None without a score_mod)."""
    B, H = validation.mods_inputs("scaled_dot_product_attention", q.shape, k.shape, v.shape)
    idx = _indices(B, H, q.shape[-2], k.shape[-2], q.device)
    if mask_mod is not None:
        visible = _mask_mod_visible(mask_mod, idx)  # (B | 1, H | 1, L, S)
        if mask is not None:  # its checks first, as _visible's: the two become one boolean mask
            validation.broadcasts_to("mask", mask.shape, (B, H, q.shape[-2], k.shape[-2]), "B, H, L, S")
            mask = torch.as_tensor(mask, device=q.device)
            validation.binary_mask(mask.is_floating_point(), bool(((mask == 0) | (mask == 1)).all()))
            visible = visible & (mask != 0)  # (B | 1, H | 1, L, S)
        mask = visible
    return mask, None if score_mod is None else functools.partial(_score_mod_scores, score_mod, idx=idx)


def apply_rope(x: torch.Tensor, positions: int | torch.Tensor, *, theta: float = 10000.0,
               interleaved: bool = False) -> torch.Tensor:
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
    positions = torch.as_tensor(positions, device=x.device)
    integer = not (positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool)
    validation.rope(x.shape, positions.shape, str(positions.dtype), integer, theta)
    work = torch.promote_types(x.dtype, torch.float32)  # float16, bfloat16: in float32
    cos, sin = _rope_table(positions, x.shape[-1], theta, work, interleaved)
    return _turned(x, cos, sin, interleaved)


def _rope_table(positions: torch.Tensor, E: int, theta: float, work: torch.dtype,
                interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (..., L, E) of each entry's angle p * theta^(-2j / E), j the index of its pair, for positions
    (..., L), in dtype `work`, laid out as the pairs are (`interleaved`); sin is negated on each pair's first
    entry, so that turning is x cos + partner(x) sin (_turned)."""
    exponents = torch.arange(0, E, 2, dtype=work, device=positions.device) / E  # 2j / E
    inv_freq = torch.reciprocal(torch.pow(theta, exponents))  # (E/2,): 1 / theta^(2j / E), as 1.0 / theta ** ...
    # torch: the same numbers as the operators, without their Python float dispatch (twice as fast)
    angles = positions[..., None].to(work) * inv_freq  # (..., L, 1) x (E/2,) -> (..., L, E/2)
    cos, sin = torch.cos(angles), torch.sin(angles)
    return _paired(cos, cos, interleaved), _paired(-sin, sin, interleaved)  # (..., L, E) each


def _paired(first: torch.Tensor, second: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """(..., E/2) each -> (..., E): `first` on each pair's first entry, `second` on its second, in the pairs'
    layout: (x_2j, x_2j+1) interleaved, else (x_j, x_{j + E/2})."""
    return torch.stack((first, second), dim=-1).flatten(-2) if interleaved else torch.cat((first, second), dim=-1)


def _turned(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x (..., L, E) with each pair (x1, x2) turned, (x1 cos - x2 sin, x2 cos + x1 sin) = x cos + partner(x) sin,
    partner(x) holding x2 where x holds x1 and x1 where x2, the tables cos and sin (..., L, E) from _rope_table;
    computed in their dtype and returned in x's."""
    dtype, E = x.dtype, x.shape[-1]
    x = _cast(x, cos.dtype)
    # the partner: each pair's two entries swapped, (x_2j+1, x_2j) interleaved, else the halves (x2, x1)
    partner = x.unflatten(-1, (E // 2, 2)).flip(-1).flatten(-2) if interleaved else x.roll(E // 2, dims=-1)
    return _cast(x * cos + partner * sin, dtype)  # (..., L, E)


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, bias: torch.Tensor | None,
             structure: Structure, *, scale: float | None, softcap: float | None, dropout_p: float,
             need_weights: bool) -> tuple[tuple, float, tuple | None]:
    """The checks before the math. Returns the leading axes (...) q, k and v broadcast to; the scale
    (1 / sqrt(E) by default); and, when there is nothing to attend (L = 0 or S = 0), the result itself
    (else None)."""
    batch = validation.attention_batch(q.shape, k.shape, v.shape)
    validation.same_floating_dtype(_dtypes(q=q, k=k, v=v))
    validation.probability("dropout_p", dropout_p)
    validation.softcap(softcap)
    if type(structure.q_offset) is not int:  # a Python int is an integer of every batch's shape
        _integers(structure.q_offset, "q_offset", batch)  # torch: the plain fused path never builds a mask from it
    scale = validation.default_scale(scale, q.shape, k.shape)
    L, S = q.shape[-2], k.shape[-2]
    if L > 0 and S > 0:
        return batch, scale, None
    # no queries, or no keys to see: every output is zeros
    _visible(mask, bias, structure, (*batch, L, S), q.device)  # the masks' shapes are still checked
    # torch: made from q, k and v, not new zeros, so that autograd reaches them (with zero gradients)
    weights = (q @ k.transpose(-1, -2)).expand(*batch, L, S).contiguous()  # (..., L, S), empty
    return batch, scale, (weights @ v, weights if need_weights else None)  # out (..., L, Ev): zeros, or empty


def _kernel_groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   bias: torch.Tensor | None, q_offset: int | torch.Tensor, window: tuple | None,
                   key_lengths: torch.Tensor | None, softcap: float | None, dropout_p: float,
                   need_weights: bool) -> bool:
    """Whether grouped-query attention can go straight to torch's kernel with its enable_gqa: the fast path
    (no weights, no dropout, no softcap) with nothing to split per query head (no mask, bias, window, key
    lengths or offset array), q, k, v of equal leading axes, one floating dtype and H query heads a multiple
    of Hkv (else the general route raises the errors) and no empty axis; the caller sends a NaN or inf in q
    or k elsewhere (_finite_or). A decode step with a key/value cache is such a call."""
    if (need_weights or dropout_p != 0.0 or softcap is not None or mask is not None or bias is not None
            or window is not None or key_lengths is not None or type(q_offset) is not int):
        return False
    if not (q.ndim == k.ndim == v.ndim >= 3 and q.shape[:-3] == k.shape[:-3] == v.shape[:-3]):
        return False
    (H, L, E), (Hkv, S, E_k), (Hkv_v, S_v, _) = q.shape[-3:], k.shape[-3:], v.shape[-3:]
    if not (Hkv == Hkv_v > 0 and H % Hkv == 0 and E == E_k > 0 and S_v == S and L > 0 and S > 0):
        return False
    return q.dtype == k.dtype == v.dtype and q.dtype.is_floating_point  # else the general route raises the error


def _finite_or(q: torch.Tensor, k: torch.Tensor, fused: Callable[[], torch.Tensor],
               explicit: Callable[[], torch.Tensor]) -> torch.Tensor:
    """fused() when q and k hold no NaN or inf, which the fused kernel mishandles (see
    scaled_dot_product_attention), else explicit(), which keeps the rule of SPEC 10: one read of q and k, as
    their sum in at least float32 is then finite. torch: under torch.compile the choice is torch.cond's, in the
    graph, which runs one branch: a Python branch on the value would break the graph. Both branches must then
    trace whole (no value read in either: no mask, whose 0-or-1 check reads it)."""
    work = torch.promote_types(q.dtype, torch.float32)
    total = q.detach().sum(dtype=work) + k.detach().sum(dtype=work)  # outside autograd
    if torch.compiler.is_compiling():
        return torch.cond(torch.isfinite(total), fused, explicit)
    return fused() if math.isfinite(total) else explicit()  # math.isfinite: one dispatch, torch.isfinite and bool 4


def _grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, bias: torch.Tensor | None,
             q_offset: int | torch.Tensor, key_lengths: torch.Tensor | None) -> tuple:
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
            validation.broadcasts_to(name, x.shape, scores_shape, "..., H, L, S")
    for name, x in (("q_offset", q_offset), ("key_lengths", key_lengths)):
        if x is not None and type(x) is not int:  # a Python int fits every batch
            _integers(x, name, batch)

    def split(x: torch.Tensor | None, trailing: int) -> torch.Tensor | None:
        if x is None or not isinstance(x, torch.Tensor) or x.ndim <= trailing:  # no head axis: it broadcasts
            return x  # over the groups as it is (torch: q_offset may be a Python int, which has no ndim)
        return x.reshape(validation.grouped_shape(x.shape, H, Hkv, trailing))

    return q, k, v, split(mask, 2), split(bias, 2), split(q_offset, 0), split(key_lengths, 0)


def _ungrouped(x: torch.Tensor | None) -> torch.Tensor | None:
    """(..., Hkv, G, L, *) -> (..., H, L, *): the groups' heads in order again, H = Hkv * G."""
    return None if x is None else x.reshape(*x.shape[:-4], x.shape[-4] * x.shape[-3], *x.shape[-2:])


def _dtypes(**arrays: torch.Tensor) -> dict[str, tuple[str, bool]]:
    """{argument name: (dtype name, is floating)}, for the dtype checks shared by the backends."""
    return {name: (str(x.dtype), x.is_floating_point()) for name, x in arrays.items()}


def _dropout(x: torch.Tensor, p: float, rng: Rng) -> torch.Tensor:
    """Inverted dropout: zero each entry with probability p and scale the others by 1 / (1 - p)."""
    if p == 0.0:
        return x
    keep = torch.rand(x.shape, generator=rng, dtype=x.dtype, device=x.device) >= p
    return x * keep / (1 - p)


def _rngs(rng: Rng, n: int) -> list[Rng]:
    """n sources of dropout randomness from one rng: torch draws them in turn from one Generator."""
    return [rng] * n
