"""Backward passes, derived by hand: the vector-Jacobian products of attention, multi-head attention and
the transformer block, in NumPy.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

Each `*_vjp` runs the forward pass, keeps what the backward pass needs and returns a pullback: given
d_out, the gradient of a scalar loss with respect to the output, the pullback returns the gradients with
respect to the inputs and the parameters (named as in the state dict). Modules are differentiated
without dropout: in eval mode, or with dropout 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from attention_np.common import validation
from attention_np.common.mods import from_keywords
from attention_np.common.records import Structure

from .functional import _attention, _dtypes, _grouped, _mods, _ungrouped, apply_rope
from .linear import linear_attention_vjp
from .primitives import (
    _activation,
    _check_derivative,
    _erf,
    _Mods,
    _parameter_dtype,
    _score_mod_vjp,
    _sigmoid,
    _sink_gradient,
    _sink_logits,
    _sum_to,
)

Grads = dict[str, np.ndarray]


def scaled_dot_product_attention_vjp(
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
) -> tuple[np.ndarray, np.ndarray, Callable]:
    """dV = P^T dO,  dP = dO V^T,  dS = P * (dP - rowsum(dP * P)),  dQ = dS K * scale,  dK = dS^T Q * scale,
    dbias = dS, for O = P V and P = softmax(S) over the visible keys, S = Q K^T * scale + bias.
    With softcap, S = c tanh(R / c) + bias, R = Q K^T * scale: dR = dS * (1 - tanh^2(R / c)), and dQ, dK
    take dR in place of dS (dbias is still dS). With score_mod, S = score_mod(C) + bias, C = softcap(R) (R
    without softcap): (dC, dtheta) = score_mod.vjp(dS, C, b, h, q_idx, kv_idx), its hand-derived derivative
    (mods.ScoreMod), dC = 0 where P = 0, then softcap's derivative as above; dtheta the gradients of its
    parameters. With sinks, P_ij = exp(S_ij) / (exp(sink) + sum_j' exp(S_ij')): dS keeps its form, and
    d sink = -sum_i p_i rowsum(dP * P)_i, p_i = exp(sink) / (exp(sink) + sum_j exp(S_ij)) = 1 - rowsum(P)_i the
    sink's share of row i, summed over the rows (and the axes the sinks broadcast along).

    The softmax step: P_ij = exp(S_ij) / sum_j' exp(S_ij'), so dP_ij/dS_ij' = P_ij (delta_jj' - P_ij'), and
    dS_ij' = sum_j dP_ij P_ij (delta_jj' - P_ij') = P_ij' (dP_ij' - sum_j dP_ij P_ij). A hidden key has
    P_ij = 0, so dS_ij = 0: no gradient reaches it through that query; a query with no visible key has a
    row of zeros, so its gradient is zero too, never NaN. Each gradient is summed over the axes its input
    was broadcast along, so it has that input's shape. q_offset, window, key_lengths and mask_mod only choose
    the visible keys: they take no gradient. With enable_gqa, k and v are broadcast over each group of query
    heads, so dK and dV are summed over the group: dK_kv = sum over h in group kv of dS_h^T Q_h * scale.

    Args:
        q, k, v, mask, bias, is_causal, scale, q_offset, window, key_lengths, softcap, enable_gqa: as for
            scaled_dot_product_attention (no dropout).
        mask_mod: (b, h, q_idx, kv_idx) -> bool, True where the query sees the key (attention_np.common.mods);
            needs q, k, v of four axes (B, H, L, E); and-ed with mask and the keyword rules.
        score_mod: (score, b, h, q_idx, kv_idx) -> the score the softmax uses, applied after softcap and before
            bias; needs four axes as mask_mod.
        sinks: one logit per head, broadcasting to (..., H), as for scaled_dot_product_attention.
        alibi_slopes: ALiBi's slopes, (H,) or (B, H), as for scaled_dot_product_attention; constants: they take
            no gradient (their bias -slope_h * |p_i - j| joins S as bias does, dS unchanged).

    Returns:
        out (..., L, Ev), weights (..., L, S) and pullback(d_out (..., L, Ev)) -> (dq, dk, dv, dbias),
        dbias None when bias is None; with a score_mod (dq, dk, dv, dbias, d_score_mod), d_score_mod a dict
        {parameter name: gradient} of score_mod.parameters (empty without); with sinks, d_sinks (sinks' shape)
        follows dbias: (dq, dk, dv, dbias, d_sinks) or (dq, dk, dv, dbias, d_sinks, d_score_mod).
    """
    _check_derivative("scaled_dot_product_attention_vjp", score_mod)  # numpy: the backward is derived by hand
    mods = _mods("scaled_dot_product_attention_vjp", q, k, v, mask_mod, score_mod, enable_gqa)  # None: no mods
    options = {"is_causal": is_causal, "scale": scale, "window": window, "softcap": softcap, "mods": mods,
               "sinks": sinks, "alibi_slopes": alibi_slopes}
    if enable_gqa:  # the grouped call's pullback (k, v broadcast over each group), its gradients reshaped back
        return _grouped_vjp(q, k, v, mask, bias=bias, q_offset=q_offset, key_lengths=key_lengths, **options)
    return _vjp(q, k, v, mask, bias=bias, q_offset=q_offset, key_lengths=key_lengths, **options)


def _vjp(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None, *, bias: np.ndarray | None,
         is_causal: bool, scale: float | None, q_offset: int | np.ndarray, window: tuple | None,
         key_lengths: np.ndarray | None, softcap: float | None, mods: _Mods | None, sinks: np.ndarray | None,
         alibi_slopes: np.ndarray | None = None, grouped: bool = False) -> tuple[np.ndarray, np.ndarray, Callable]:
    """scaled_dot_product_attention_vjp once the heads are grouped (`grouped`, enable_gqa) and the mods' index
    arrays laid out as those scores."""
    structure = Structure(is_causal=is_causal, q_offset=q_offset, window=validation.window(window),
                          key_lengths=key_lengths)
    out, weights = _attention(q, k, v, mask, bias, structure, scale=scale, softcap=softcap, mods=mods,
                              sinks=sinks, grouped=grouped, dropout_p=0.0, need_weights=True, rng=None,
                              alibi_slopes=alibi_slopes)
    scale = validation.default_scale(scale, q.shape, k.shape)  # the checks above passed: q has rank 2 or more
    laid = None if sinks is None else _sink_logits(sinks, validation.attention_batch(q.shape, k.shape, v.shape),
                                                   grouped, np.promote_types(q.dtype, np.float32))
    score_mod = None if mods is None else mods.score_mod

    def pullback(d_out: np.ndarray) -> tuple:
        validation.cotangent("d_out", d_out.shape, out.shape, _dtypes(d_out=d_out, out=out))
        # in at least float32, each gradient stored in its input's dtype (SPEC 2: half precision computes in
        # float32); P as the forward stored it
        work = np.promote_types(d_out.dtype, np.float32)
        p, d_o, q_w, k_w, v_w = (x.astype(work, copy=False) for x in (weights, d_out, q, k, v))
        # 1) through the value product O = P V
        dv = np.swapaxes(p, -1, -2) @ d_o  # (..., S, L) x (..., L, Ev) -> (..., S, Ev)
        d_weights = d_o @ np.swapaxes(v_w, -1, -2)  # (..., L, Ev) x (..., Ev, S) -> (..., L, S)
        # 2) through the softmax
        d_scores = p * (d_weights - np.sum(d_weights * p, axis=-1, keepdims=True))  # (..., L, S)
        d_sinks = None  # the sink's: it takes 1 - rowsum(P) of each row, D = rowsum(dP * P) (..., L, 1)
        if sinks is not None:
            D, share = np.sum(d_weights * p, axis=-1, keepdims=True), 1 - np.sum(p, axis=-1, keepdims=True)
            d_sinks = _sink_gradient(D, share, laid, np.shape(sinks)).astype(_parameter_dtype(sinks, work))
        # 3) through the bias, S = score_mod(softcap(R)) + bias: dbias = dS
        dbias = None if bias is None else _sum_to(d_scores, np.shape(bias)).astype(np.asarray(bias).dtype)
        # 4) through the score function and the soft-capping, from R = Q K^T * scale, recomputed as forward
        raw = (q_w * scale) @ np.swapaxes(k_w, -1, -2) if softcap is not None or score_mod is not None else None
        capping = from_keywords(structure, softcap)[1]  # the catalogue's softcap(cap), or None
        d_theta = {}
        if score_mod is not None:  # (dC, dtheta) = score_mod.vjp(dS, C), C = softcap(R); dC = 0 where P = 0
            capped = raw if capping is None else capping(raw, None, None, None, None)  # C, what score_mod received
            d_scores, d_theta = _score_mod_vjp(score_mod, d_scores, capped, p, mods.tile())
            d_theta = {name: np.asarray(d_theta.get(name, np.zeros(np.shape(value)))).astype(
                _parameter_dtype(value, d_out.dtype), copy=False) for name, value in score_mod.parameters.items()}
        if capping is not None:  # softcap(R) = c tanh(R / c): dR = dC * (1 - tanh^2(R / c)), its vjp
            d_scores, _ = capping.vjp(d_scores, raw, None, None, None, None)  # (..., L, S)
        # 5) through the raw scores R = Q K^T * scale
        dq = d_scores @ k_w * scale  # (..., L, S) x (..., S, E) -> (..., L, E)
        dk = np.swapaxes(d_scores, -1, -2) @ q_w * scale  # (..., S, L) x (..., L, E) -> (..., S, E)
        grads = tuple(_sum_to(d, x.shape).astype(x.dtype, copy=False) for d, x in ((dq, q), (dk, k), (dv, v)))
        grads = (*grads, dbias) if sinks is None else (*grads, dbias, d_sinks)
        return grads if score_mod is None else (*grads, d_theta)

    return out, weights, pullback


def _grouped_vjp(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None, *,
                 bias: np.ndarray | None, q_offset: int | np.ndarray, key_lengths: np.ndarray | None,
                 **options: Any) -> tuple[np.ndarray, np.ndarray, Callable]:
    """scaled_dot_product_attention_vjp with enable_gqa: the vjp of the grouped call (functional._grouped),
    with each query head of a group given its own view of k and v, (..., Hkv, G, S, E | Ev), so their
    gradients come back per query head. The G heads of a group share k and v, so the gradients of k and v
    are the sums over the group: dK_kv = sum over h in group kv of dK_h, and dV alike."""
    q_g, k_g, v_g, mask_g, bias_g, q_offset, key_lengths = _grouped(q, k, v, mask, bias, q_offset, key_lengths)
    G = q_g.shape[-3]
    k_h, v_h = (np.broadcast_to(x, (*x.shape[:-3], G, *x.shape[-2:])) for x in (k_g, v_g))  # views: no copy
    out_g, weights_g, pull = _vjp(q_g, k_h, v_h, mask_g, bias=bias_g, q_offset=q_offset, key_lengths=key_lengths,
                                  grouped=True, **options)
    out = _ungrouped(out_g)  # (..., Hkv, G, L, Ev) -> (..., H, L, Ev)

    def pullback(d_out: np.ndarray) -> tuple:
        validation.cotangent("d_out", d_out.shape, out.shape, _dtypes(d_out=d_out, out=out))
        dq, dk, dv, dbias, *d_theta = pull(d_out.reshape(out_g.shape))  # (..., H, L, Ev) -> (..., Hkv, G, L, Ev)
        dk, dv = (np.sum(d, axis=-3) for d in (dk, dv))  # each group's sum: (..., Hkv, G, S, *) -> (..., Hkv, S, *)
        dbias = dbias if dbias is None or np.ndim(bias) <= 2 else _ungrouped(dbias)  # bias (..., H | 1, L, S)
        return _ungrouped(dq), dk, dv, dbias, *d_theta  # (..., Hkv, G, L, *) -> (..., H, L, *)

    return out, _ungrouped(weights_g), pullback


def multi_head_attention_vjp(mha: Any, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None = None, *,
                             is_causal: bool = False, mask_mod: Callable[..., Any] | None = None,
                             score_mod: Callable[..., Any] | None = None) -> tuple[np.ndarray, np.ndarray, Callable]:
    """Backward through MultiHead(Q, K, V) = Concat(head_1, ..., head_H) W_o^T + b_o, step by step in
    reverse: the output projection, the heads' merge (its adjoint is the split), attention per head, the
    input projections. Splitting and merging heads only move entries, so their adjoints are each other.
    With Hkv < H key/value heads, attention runs with enable_gqa, whose backward pass sums the gradients of
    each key/value head over the query heads of its group. With sinks, attention takes mha.sinks, and its
    gradient d_sinks is the parameter's, "sinks"; with position="alibi", mha.alibi_slopes (no gradient). With
    rope_theta, the queries and keys are turned after the split, and their gradients turned back before the
    projections' adjoints. With attention="linear" the heads' step is linear_attention_vjp's pullback instead
    (_linear_heads_vjp). is_causal, mask_mod and score_mod go to attention on the heads (B, H, L, d_k), as in
    MultiHeadAttention.__call__.

    Returns:
        out (..., L, D), weights (..., H, L, S) (None with attention="linear") and
        pullback(d_out (..., L, D)) -> (dq, dk, dv, dparams), dparams {state-dict name: gradient}, and with a
        score_mod its parameters' gradients under "score_mod.<name>".
    """
    validation.no_dropout(type(mha).__name__, mha.dropout if mha.training else 0.0)
    mha._check_inputs(q, k, v, mask, mask_mod, score_mod)
    (q_p, pull_q), (k_p, pull_k), (v_p, pull_v) = (_linear_vjp(w, x) for w, x in
                                                  ((mha.w_q, q), (mha.w_k, k), (mha.w_v, v)))
    H, Hkv = mha.num_heads, mha.num_kv_heads
    q_h, k_h = mha._rotated(mha._split_heads(q_p, H), mha._split_heads(k_p, Hkv), 0)  # RoPE at 0.., 0..
    v_h = mha._split_heads(v_p, Hkv)  # (..., Hkv, S, d_k)
    if mha.attention == "linear":  # no mask (checked above), no weights
        heads, weights, pull_attention = _linear_heads_vjp(mha, q_h, k_h, v_h, is_causal)  # (..., H, L, d_k)
    else:
        heads, weights, pull_attention = scaled_dot_product_attention_vjp(
            q_h, k_h, v_h, mask, is_causal=is_causal, enable_gqa=mha.grouped, mask_mod=mask_mod,
            score_mod=score_mod, sinks=mha.sinks,
            alibi_slopes=mha.alibi_slopes)  # (..., H, L, d_k), k, v (..., Hkv, S, d_k)
    out, pull_o = _linear_vjp(mha.w_o, mha._merge_heads(heads))  # (..., L, D)

    def pullback(d_out: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, Grads]:
        validation.cotangent("d_out", d_out.shape, out.shape, _dtypes(d_out=d_out, out=out))
        d_merged, grads_o = pull_o(d_out)  # (..., L, D)
        dq_h, dk_h, dv_h, _, *d_theta = pull_attention(mha._split_heads(d_merged, H))  # (..., H | Hkv, L | S, d_k)
        d_sinks = {} if mha.sinks is None else {"sinks": d_theta.pop(0)}  # the sinks' gradient follows dbias
        dq_h, dk_h = _rope_vjp(mha, dq_h), _rope_vjp(mha, dk_h)  # RoPE turned back
        (dq, grads_q), (dk, grads_k), (dv, grads_v) = (
            pull(mha._merge_heads(d)) for pull, d in ((pull_q, dq_h), (pull_k, dk_h), (pull_v, dv_h)))
        grads = _prefixed("w_q", grads_q) | _prefixed("w_k", grads_k) | _prefixed("w_v", grads_v)
        grads |= _prefixed("score_mod", d_theta[0]) if d_theta else {}  # the score function's parameters
        return dq, dk, dv, grads | _prefixed("w_o", grads_o) | d_sinks

    return out, weights, pullback


def _linear_heads_vjp(mha: Any, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                      is_causal: bool) -> tuple[np.ndarray, None, Callable]:
    """The vjp of MultiHeadAttention._linear_heads: linear_attention_vjp on the grouped heads, q (..., Hkv, G, L, d_k)
    against k, v (..., Hkv, 1, S, d_k). Key/value head g is broadcast over the G query heads of its group, so
    linear_attention_vjp, which sums each gradient over its input's broadcast axes, returns dK_g = sum over h in
    group g of dK_h, and dV alike. Returns heads (..., H, L, d_k), no weights, and a pullback with
    scaled_dot_product_attention_vjp's results (dq, dk, dv, dbias None)."""
    q_g, k_g, v_g = mha._grouped_heads(q, k, v)
    out_g, pull = linear_attention_vjp(q_g, k_g, v_g, is_causal=is_causal)  # (..., Hkv, G, L, d_k)

    def pullback(d_heads: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, None]:
        dq, dk, dv = pull(d_heads.reshape(out_g.shape))  # (..., H, L, d_k) -> (..., Hkv, G, L, d_k)
        dk, dv = dk[..., 0, :, :], dv[..., 0, :, :]  # (..., Hkv, 1, S, d_k) -> (..., Hkv, S, d_k)
        return _ungrouped(dq), dk, dv, None  # (..., Hkv, G, L, d_k) -> (..., H, L, d_k)

    return _ungrouped(out_g), None, pullback


def _rope_vjp(mha: Any, d: np.ndarray) -> np.ndarray:
    """The gradient through RoPE at positions 0 .. L - 1 of d (..., heads, L, d_k): a rotation is orthogonal,
    so its adjoint turns back by the same angles, apply_rope(d, -positions) (d itself without rope_theta)."""
    if mha.rope_theta is None:
        return d
    return apply_rope(d, -np.arange(d.shape[-2]), theta=mha.rope_theta)


def transformer_block_vjp(block: Any, x: np.ndarray, mask: np.ndarray | None = None, *, is_causal: bool = False,
                          mask_mod: Callable[..., Any] | None = None,
                          score_mod: Callable[..., Any] | None = None) -> tuple[np.ndarray, np.ndarray, Callable]:
    """Backward through the block. Post-LN, y1 = LN_1(x + MHA(x)), y = LN_2(y1 + FFN(y1)):
        dh2 = LN_2'(dy),  dy1 = dh2 + FFN'(dh2),  dh1 = LN_1'(dy1),  dx = dh1 + MHA'_q(dh1) + MHA'_k(dh1) + MHA'_v(dh1).
    Pre-LN, h = x + MHA(LN_1(x)), y = h + FFN(LN_2(h)):
        dh = dy + LN_2'(FFN'(dy)),  dx = dh + LN_1'(MHA'_q(dh) + MHA'_k(dh) + MHA'_v(dh)).
    A residual sum passes its gradient to both terms; self-attention uses x three times, so its three
    input gradients add up. is_causal, mask_mod and score_mod go to the attention, as in TransformerBlock.__call__.

    Returns:
        y (..., L, D), weights (..., H, L, L) and pullback(d_out (..., L, D)) -> (dx, dparams), and with a
        score_mod its parameters' gradients under "score_mod.<name>" (the caller's function, not the block's).
    """
    validation.no_dropout(type(block).__name__, block.dropout if block.training else 0.0)
    block._check_input(x)
    forward = _pre_ln_vjp if block.norm_first else _post_ln_vjp
    y, weights, pullback = forward(block, x, mask, {"is_causal": is_causal, "mask_mod": mask_mod,
                                                    "score_mod": score_mod})

    def checked(d_out: np.ndarray) -> tuple[np.ndarray, Grads]:
        validation.cotangent("d_out", d_out.shape, y.shape, _dtypes(d_out=d_out, out=y))
        dx, grads = pullback(d_out)
        modded = {name.removeprefix("attn."): grads[name] for name in grads if name.startswith("attn.score_mod.")}
        return dx, {name: grads[name] for name in block.state_dict()} | modded  # in state-dict order, then mods

    return y, weights, checked


def _post_ln_vjp(block: Any, x: np.ndarray, mask: np.ndarray | None,
                 mods: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, Callable]:
    a, weights, pull_attn = multi_head_attention_vjp(block.attn, x, x, x, mask, **mods)
    y1, pull_norm1 = _norm_vjp(block.norm1, x + a)
    f, pull_ffn = _ffn_vjp(block.ffn, y1)
    y, pull_norm2 = _norm_vjp(block.norm2, y1 + f)

    def pullback(dy: np.ndarray) -> tuple[np.ndarray, Grads]:
        dh2, grads_norm2 = pull_norm2(dy)
        dy1_ffn, grads_ffn = pull_ffn(dh2)
        dh1, grads_norm1 = pull_norm1(dh2 + dy1_ffn)  # the residual passes dh2 on unchanged
        dq, dk, dv, grads_attn = pull_attn(dh1)
        grads = _prefixed("attn", grads_attn) | _prefixed("norm1", grads_norm1) | _prefixed("norm2", grads_norm2)
        return dh1 + dq + dk + dv, grads | _prefixed("ffn", grads_ffn)

    return y, weights, pullback


def _pre_ln_vjp(block: Any, x: np.ndarray, mask: np.ndarray | None,
                mods: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, Callable]:
    n1, pull_norm1 = _norm_vjp(block.norm1, x)
    a, weights, pull_attn = multi_head_attention_vjp(block.attn, n1, n1, n1, mask, **mods)
    h = x + a
    n2, pull_norm2 = _norm_vjp(block.norm2, h)
    f, pull_ffn = _ffn_vjp(block.ffn, n2)

    def pullback(dy: np.ndarray) -> tuple[np.ndarray, Grads]:
        dn2, grads_ffn = pull_ffn(dy)
        dh_norm2, grads_norm2 = pull_norm2(dn2)
        dh = dy + dh_norm2  # the residual passes dy on unchanged
        dq, dk, dv, grads_attn = pull_attn(dh)
        dx_norm1, grads_norm1 = pull_norm1(dq + dk + dv)
        grads = _prefixed("attn", grads_attn) | _prefixed("norm1", grads_norm1) | _prefixed("norm2", grads_norm2)
        return dh + dx_norm1, grads | _prefixed("ffn", grads_ffn)

    return h + f, weights, pullback


def _linear_vjp(linear: Any, x: np.ndarray) -> tuple[np.ndarray, Callable]:
    """y = x W^T + b:  dx = dy W,  dW = dy^T x,  db = sum of dy, both summed over every position
    (no db for a Linear without bias). In at least float32, each gradient stored in its tensor's dtype (SPEC 2:
    a half-precision sum over the positions loses its terms)."""
    work = np.promote_types(x.dtype, np.float32)

    def pullback(dy: np.ndarray) -> tuple[np.ndarray, Grads]:
        dy, weight = dy.astype(work, copy=False), linear.weight.astype(work, copy=False)
        dy_rows, x_rows = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1]).astype(work, copy=False)
        bias = {} if linear.bias is None else {"bias": np.sum(dy_rows, axis=0).astype(linear.bias.dtype, copy=False)}
        d_weight = (dy_rows.T @ x_rows).astype(linear.weight.dtype, copy=False)  # (out, N) x (N, in) -> (out, in)
        return (dy @ weight).astype(x.dtype, copy=False), {"weight": d_weight} | bias

    return linear(x), pullback


def _norm_vjp(norm: Any, x: np.ndarray) -> tuple[np.ndarray, Callable]:
    """The block's norm: RMSNorm (norm="rms", a weight only) or LayerNorm (a weight and a bias)."""
    return _layer_norm_vjp(norm, x) if "bias" in norm._children else _rms_norm_vjp(norm, x)


def _rms_norm_vjp(norm: Any, x: np.ndarray) -> tuple[np.ndarray, Callable]:
    """y = x_hat * weight, x_hat = x r, r = 1 / sqrt(mean(x^2) + eps), over the last axis (D entries):
        d_hat = dy * weight,  dx = (d_hat - x_hat * mean(d_hat * x_hat)) * r,  dweight = sum of dy * x_hat.
    From dr/dx_j = -r^3 x_j / D: dx_j = r d_hat_j - r^3 x_j / D sum_i d_hat_i x_i; no mean term, as no mean
    is removed. Both ways in at least float32, as RMSNorm computes its statistics (SPEC 2); stored in x's dtype."""
    work = np.promote_types(x.dtype, np.float32)
    y = x.astype(work, copy=False)
    inv_rms = 1 / np.sqrt(np.mean(y**2, axis=-1, keepdims=True) + norm.eps)  # (..., D) -> (..., 1)
    x_hat = y * inv_rms  # (..., D)

    def pullback(dy: np.ndarray) -> tuple[np.ndarray, Grads]:
        d_y = dy.astype(work, copy=False)
        d_hat = d_y * norm.weight
        dx = (d_hat - x_hat * np.mean(d_hat * x_hat, axis=-1, keepdims=True)) * inv_rms
        d_weight = np.sum((d_y * x_hat).reshape(-1, x.shape[-1]), axis=0)
        return dx.astype(dy.dtype, copy=False), {"weight": d_weight.astype(norm.weight.dtype, copy=False)}

    return (x_hat * norm.weight).astype(x.dtype, copy=False), pullback


def _layer_norm_vjp(norm: Any, x: np.ndarray) -> tuple[np.ndarray, Callable]:
    """y = x_hat * weight + bias, x_hat = (x - mean) / sigma, sigma = sqrt(var + eps), over the last axis:
        d_hat = dy * weight,  dx = (d_hat - mean(d_hat) - x_hat * mean(d_hat * x_hat)) / sigma,
        dweight = sum of dy * x_hat,  dbias = sum of dy.
    The two means are what the mean and the variance take from each entry of the row. Both ways in at least
    float32, as LayerNorm computes its statistics (SPEC 2); stored in x's dtype."""
    work = np.promote_types(x.dtype, np.float32)
    y = x.astype(work, copy=False)
    mean = np.mean(y, axis=-1, keepdims=True)  # (..., D) -> (..., 1)
    inv_sigma = 1 / np.sqrt(np.mean((y - mean) ** 2, axis=-1, keepdims=True) + norm.eps)  # (..., 1)
    x_hat = (y - mean) * inv_sigma  # (..., D)

    def pullback(dy: np.ndarray) -> tuple[np.ndarray, Grads]:
        d_y = dy.astype(work, copy=False)
        d_hat = d_y * norm.weight
        dx = (d_hat - np.mean(d_hat, axis=-1, keepdims=True)
              - x_hat * np.mean(d_hat * x_hat, axis=-1, keepdims=True)) * inv_sigma
        rows = (-1, x.shape[-1])
        d_weight, d_bias = np.sum((d_y * x_hat).reshape(rows), axis=0), np.sum(d_y.reshape(rows), axis=0)
        return dx.astype(dy.dtype, copy=False), {"weight": d_weight.astype(norm.weight.dtype, copy=False),
                                                 "bias": d_bias.astype(norm.bias.dtype, copy=False)}

    return (x_hat * norm.weight + norm.bias).astype(x.dtype, copy=False), pullback


def _ffn_vjp(ffn: Any, x: np.ndarray) -> tuple[np.ndarray, Callable]:
    """The block's feed-forward network: SwiGLU (activation="swiglu"), gpt-oss's clamped SwiGLU ("swiglu_oss")
    or relu / gelu."""
    gated = {"swiglu": _swiglu_vjp, "swiglu_oss": _swiglu_oss_vjp}
    return gated.get(ffn.activation, _feed_forward_vjp)(ffn, x)


def _swiglu_vjp(ffn: Any, x: np.ndarray) -> tuple[np.ndarray, Callable]:
    """FFN(x) = W_down (silu(g) * u), g = W_gate x + b_gate, u = W_up x + b_up:
        dh = dy W_down,  dg = dh * u * silu'(g),  du = dh * silu(g),  dx = dg W_gate + du W_up,
    silu'(g) = sigmoid(g) (1 + g (1 - sigmoid(g))), from d/dg [g sigmoid(g)] and sigmoid' = sigmoid (1 - sigmoid).
    x feeds both W_gate and W_up, so its two gradients add up."""
    g, pull_gate = _linear_vjp(ffn.w_gate, x)  # (..., L, D) -> (..., L, F)
    u, pull_up = _linear_vjp(ffn.w_up, x)  # (..., L, D) -> (..., L, F)
    sigmoid = _sigmoid(g)
    y, pull_down = _linear_vjp(ffn.w_down, g * sigmoid * u)  # (..., L, F) -> (..., L, D)

    def pullback(dy: np.ndarray) -> tuple[np.ndarray, Grads]:
        dh, grads_down = pull_down(dy)  # (..., L, F)
        dx_gate, grads_gate = pull_gate(dh * u * sigmoid * (1 + g * (1 - sigmoid)))  # (..., L, D)
        dx_up, grads_up = pull_up(dh * g * sigmoid)  # (..., L, D)
        grads = _prefixed("w_gate", grads_gate) | _prefixed("w_up", grads_up)
        return dx_gate + dx_up, grads | _prefixed("w_down", grads_down)

    return y, pullback


def _swiglu_oss_vjp(ffn: Any, x: np.ndarray) -> tuple[np.ndarray, Callable]:
    """FFN(x) = W_down ((c + 1) * m * sigmoid(alpha m)), m = min(g, limit), c = clip(u, -limit, limit), g and u as
    for SwiGLU:  dg = dh (c + 1) s (1 + alpha m (1 - s)) where g <= limit (else 0, the clamp's derivative),
    du = dh m s where -limit <= u <= limit, s = sigmoid(alpha m); then back through W_gate and W_up, as SwiGLU's."""
    alpha, limit = validation.SWIGLU_OSS_ALPHA, validation.SWIGLU_OSS_LIMIT
    g, pull_gate = _linear_vjp(ffn.w_gate, x)  # (..., L, D) -> (..., L, F)
    u, pull_up = _linear_vjp(ffn.w_up, x)  # (..., L, D) -> (..., L, F)
    m, c = np.minimum(g, limit), np.clip(u, -limit, limit)
    sigmoid = _sigmoid(alpha * m)
    y, pull_down = _linear_vjp(ffn.w_down, (c + 1) * m * sigmoid)  # (..., L, F) -> (..., L, D)

    def pullback(dy: np.ndarray) -> tuple[np.ndarray, Grads]:
        dh, grads_down = pull_down(dy)  # (..., L, F)
        d_gate = np.where(g <= limit, dh * (c + 1) * sigmoid * (1 + alpha * m * (1 - sigmoid)), 0)
        dx_gate, grads_gate = pull_gate(d_gate)  # (..., L, D)
        dx_up, grads_up = pull_up(np.where(np.abs(u) <= limit, dh * m * sigmoid, 0))  # (..., L, D)
        grads = _prefixed("w_gate", grads_gate) | _prefixed("w_up", grads_up)
        return dx_gate + dx_up, grads | _prefixed("w_down", grads_down)

    return y, pullback


def _feed_forward_vjp(ffn: Any, x: np.ndarray) -> tuple[np.ndarray, Callable]:
    """FFN(x) = W_3 act(W_0 x + b_0) + b_3:  dh = (dy W_3) * act'(W_0 x + b_0), then back through W_0.
    relu'(h) = 1 where h > 0, else 0; gelu'(h) = Phi(h) + h phi(h), phi the standard normal density."""
    h, pull_in = _linear_vjp(ffn.linear1, x)  # (..., L, D) -> (..., L, F)
    y, pull_out = _linear_vjp(ffn.linear2, _activation(ffn.activation, h))  # (..., L, F) -> (..., L, D)

    def pullback(dy: np.ndarray) -> tuple[np.ndarray, Grads]:
        d_act, grads_out = pull_out(dy)  # (..., L, F)
        dx, grads_in = pull_in(d_act * _activation_derivative(ffn.activation, h))  # (..., L, D)
        return dx, _prefixed("0", grads_in) | _prefixed("3", grads_out)

    return y, pullback


def _activation_derivative(name: str, h: np.ndarray) -> np.ndarray:
    if name == "relu":
        return (h > 0).astype(h.dtype)
    cdf = (1 + _erf(h / math.sqrt(2))) / 2  # Phi(h)
    return cdf + h * np.exp(-(h**2) / 2) / math.sqrt(2 * math.pi)  # Phi(h) + h phi(h)


def _prefixed(prefix: str, grads: Grads) -> Grads:
    return {f"{prefix}.{name}": value for name, value in grads.items()}
