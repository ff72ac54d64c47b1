"""The float64 oracle: attention computed one query row (and one head) at a time.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

Written apart from every backend, in another formulation: where a backend computes all scores at once
and masks them with one boolean, the oracle walks the queries, lists the keys each one may see and takes
a softmax over those alone. A bug in a backend then cannot pass by agreeing with itself. Everything is
converted to float64 first; speed is not a goal. Which keys a query sees by position (is_causal, q_offset,
window, key_lengths) and the soft-capping are the rules of the catalogue (attention_np.common.mods'
`from_keywords`), evaluated one row at a time: the one home of those rules, which the backends evaluate too,
and which tests/test_mods.py holds to hand-written grids and to torch's own flex_attention.

`dtype=np.float32` runs the same formula in float32 throughout: its distance from the float64 result
measures how much any correct float32 computation of a case may lose (ill-conditioned cases lose more),
which the suite uses to scale its float32 tolerance. `dtype` float16 or bfloat16 (ml_dtypes) follows
SPEC.md section 2 instead: the arithmetic runs in float32, and a tensor is rounded to `dtype` wherever a
module built of layers of that dtype stores one: the inputs and parameters; sdpa's out and weights; each
projection of multi-head attention, each head's output and the mixed output; in the block each Linear, the
activation, each residual sum and each LayerNorm. That is the loss of a conformant half-precision module,
never that of a softmax computed in half precision. A Linear rounds x W^T + b once (`fused_bias`, as
torch's addmm), or with `fused_bias=False` the product and then the sum (NumPy's and XLA's half-precision
matmul and add); conformant modules do either, and which loses more depends on the case. In float32 and
float64 every operation rounds, so both are the same.
"""

from __future__ import annotations

import cmath
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from attention_np.common.mods import from_keywords
from attention_np.common.records import Structure

Mods = tuple[Callable[..., ArrayLike] | None, Callable[..., ArrayLike] | None]  # (mask_mod, score_mod)
ACTIVATIONS = ("relu", "gelu", "swiglu")
NORMS = ("layer", "rms")


def sdpa(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    mask: ArrayLike | None = None,
    *,
    bias: ArrayLike | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    q_offset: int | ArrayLike = 0,
    window: tuple[int | None, int | None] | None = None,
    key_lengths: ArrayLike | None = None,
    softcap: float | None = None,
    enable_gqa: bool = False,
    mask_mod: Callable[..., ArrayLike] | None = None,
    score_mod: Callable[..., ArrayLike] | None = None,
    sinks: ArrayLike | None = None,
    alibi_slopes: ArrayLike | None = None,
    dtype: DTypeLike = np.float64,
) -> tuple[np.ndarray, np.ndarray]:
    """Attention(Q, K, V) = softmax(score_mod(softcap tanh(Q K^T * scale / softcap)) + bias) V, the softmax over
    the visible keys only (SPEC.md sections 2 and 2a; the mods as flex_attention's).

    Args:
        q: queries (..., L, E); k: keys (..., S, E); v: values (..., S, Ev). Leading axes broadcast.
        mask: broadcasts to (..., L, S); an entry equal to 0 / False hides key j from query i.
        bias: added to the scores, broadcasts to (..., L, S); a -inf entry hides that key too.
        is_causal: query i, at position p_i = q_offset + i, sees keys j <= p_i, together with `mask`.
        scale: multiplies Q K^T; defaults to 1 / sqrt(E).
        q_offset: an int, or integers broadcasting to the leading axes (...): the position of query 0.
        window: (left, right), None for an unbounded side: query i sees keys p_i - left <= j <= p_i + right.
        key_lengths: integers broadcasting to (...): a sequence sees its keys j < key_lengths.
        softcap: the raw scores become softcap * tanh(raw / softcap), before the bias; None: unchanged.
        enable_gqa: q has H heads (axis -3), k and v Hkv; query head h reads key/value head h // (H / Hkv).
        mask_mod: (b, h, q_idx, kv_idx) -> False where it hides the key, and-ed with the rest; needs q, k, v of
            four axes (B, H, L, E); h runs over q's heads, q_idx over 0..L-1 (not shifted by q_offset).
        score_mod: (score, b, h, q_idx, kv_idx) -> the score, after the softcap and before the bias; a -inf
            result hides the key. Both are called one query at a time, as flex_attention calls them.
        sinks: one logit per head, broadcasting to (..., H) (q's heads with enable_gqa): each row's softmax takes
            it as one more logit, of a key whose value is zero; its probability is not returned.
        alibi_slopes: ALiBi's slopes, (H,) or (B, H), one per query head: the logit of key j for the query at
            position p_i = q_offset + i gets -slope * |p_i - j|, after score_mod, as the bias.

    Returns:
        out (..., L, Ev) and weights (..., L, S), in `dtype`. A query with no visible key gets zeros in both.
    """
    out, weights, _ = _rows(q, k, v, mask, bias, is_causal, scale, q_offset, window, key_lengths, softcap,
                            enable_gqa, (mask_mod, score_mod), dtype, sinks, alibi_slopes)
    return out, weights


def log_sum_exp(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    mask: ArrayLike | None = None,
    *,
    bias: ArrayLike | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    q_offset: int | ArrayLike = 0,
    window: tuple[int | None, int | None] | None = None,
    key_lengths: ArrayLike | None = None,
    softcap: float | None = None,
    enable_gqa: bool = False,
    mask_mod: Callable[..., ArrayLike] | None = None,
    score_mod: Callable[..., ArrayLike] | None = None,
    sinks: ArrayLike | None = None,
    alibi_slopes: ArrayLike | None = None,
    dtype: DTypeLike = np.float64,
) -> tuple[np.ndarray, np.ndarray]:
    """sdpa's out, and lse_i = log sum_j exp(logits_ij) over the keys query i sees (flash_attention's second
    result): m_i + log sum_j exp(logits_ij - m_i), m_i their maximum; -inf where it sees none.

    Args:
        as for sdpa.

    Returns:
        out (..., L, Ev) in `dtype` and lse (..., L) in the dtype the scores are computed in (float32 for
        float16 and bfloat16). With sinks the sink is one of the logits: lse_i = log(exp(sink) + sum_j
        exp(logits_ij)), the sink itself where the query sees no key.
    """
    out, _, lse = _rows(q, k, v, mask, bias, is_causal, scale, q_offset, window, key_lengths, softcap,
                        enable_gqa, (mask_mod, score_mod), dtype, sinks, alibi_slopes)
    return out, lse.astype(_work(dtype))


def _rows(q: ArrayLike, k: ArrayLike, v: ArrayLike, mask: ArrayLike | None, bias: ArrayLike | None,
          is_causal: bool, scale: float | None, q_offset: int | ArrayLike,
          window: tuple[int | None, int | None] | None, key_lengths: ArrayLike | None, softcap: float | None,
          enable_gqa: bool, mods: Mods, dtype: DTypeLike,
          sinks: ArrayLike | None = None,
          alibi_slopes: ArrayLike | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """sdpa's out and weights in `dtype`, and each row's log-sum-exp in the scores' dtype: one query row
    at a time (with mods, the row of query i of head h in sequence b of the scores (B, H, L, S)). A sink is
    one more logit of the row, of a key whose value is zero and whose weight is not returned. ALiBi's slope
    takes its distance penalty off each logit of the row."""
    q, k, v, mask, bias = _laid_out(q, k, v, mask, bias, enable_gqa, dtype)
    batch, (L, E), (S, Ev) = q.shape[:-2], q.shape[-2:], v.shape[-2:]
    sinks = None if sinks is None else np.broadcast_to(_cast(sinks, dtype), batch)  # one logit per sequence
    slopes = None if alibi_slopes is None else np.broadcast_to(_cast(alibi_slopes, dtype), batch)  # one a head
    scale = 1.0 / math.sqrt(E) if scale is None else float(scale)
    offsets = np.broadcast_to(np.asarray(q_offset), batch)  # one position of query 0 per sequence
    lengths = np.broadcast_to(np.asarray(S if key_lengths is None else key_lengths), batch)

    out, weights = np.zeros((*batch, L, Ev), _work(dtype)), np.zeros((*batch, L, S), _work(dtype))
    lse = np.full((*batch, L), -np.inf, _work(dtype))  # a query that sees no key: log 0
    for b in np.ndindex(*batch):  # the keywords' functions of this sequence (its q_offset and key_lengths)
        by_position, capping = from_keywords(Structure(
            is_causal=is_causal, q_offset=int(offsets[b]), window=window,
            key_lengths=None if key_lengths is None else int(lengths[b])), softcap)
        for i in range(L):
            keys = _visible_keys(i, mask[(*b, i)], bias[(*b, i)], by_position)
            keys, logits = _logits(q[(*b, i)], k[b], keys, bias[(*b, i)], scale, capping, mods, (*b, i))
            if slopes is not None:  # ALiBi: the key's distance from the query's position, times the head's slope
                logits = logits - slopes[b] * np.abs(int(offsets[b]) + i - keys)
            if sinks is not None:  # the sink: a last logit, of a key of zero value whose weight is dropped
                logits = np.append(logits, sinks[b])
            out[(*b, i)], weights[(*b, i)] = _attend(v[b], keys, logits, S)
            if len(keys) or (sinks is not None and sinks[b] != -np.inf):  # no key and no finite sink: log 0
                lse[(*b, i)] = np.max(logits) + np.log(np.sum(np.exp(logits - np.max(logits))))
    return out.astype(dtype), weights.astype(dtype), lse  # half precision: computed in float32, stored in dtype


def _laid_out(q: ArrayLike, k: ArrayLike, v: ArrayLike, mask: ArrayLike | None, bias: ArrayLike | None,
              enable_gqa: bool, dtype: DTypeLike) -> tuple[np.ndarray, ...]:
    """sdpa's arguments laid out for a walk over the query rows: q (*batch, L, E), k (*batch, S, E), v (*batch, S,
    Ev) in the arithmetic's dtype (_cast), each query head with its own copy of the key/value head it reads
    (enable_gqa), broadcast to one batch shape; the mask as booleans and the bias in the scores' dtype (SPEC 2),
    (*batch, L, S) each."""
    q, k, v = _cast(q, dtype), _cast(k, dtype), _cast(v, dtype)
    if enable_gqa:  # each query head gets its own copy of the key/value head it reads
        group = q.shape[-3] // k.shape[-3]
        k, v = (np.stack([x[..., h // group, :, :] for h in range(q.shape[-3])], axis=-3) for x in (k, v))
    (L, E), (S, Ev) = q.shape[-2:], v.shape[-2:]
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    q = np.broadcast_to(q, (*batch, L, E))
    k = np.broadcast_to(k, (*batch, S, E))
    v = np.broadcast_to(v, (*batch, S, Ev))
    mask = np.ones((L, S), bool) if mask is None else np.asarray(mask) != 0
    mask = np.broadcast_to(mask, (*batch, L, S))
    bias = np.zeros((L, S)) if bias is None else bias
    bias = np.broadcast_to(np.asarray(bias, _work(dtype)), (*batch, L, S))
    return q, k, v, mask, bias


def flex_attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    mask_mod: Callable[..., ArrayLike] | None = None,
    score_mod: Callable[..., ArrayLike] | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    dtype: DTypeLike = np.float64,
    sinks: ArrayLike | None = None,
    alibi_slopes: ArrayLike | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """out_bhi = sum_j softmax_j(r_bhij) v_j and lse_bhi = log sum_j exp(r_bhij), r_bhij = score_mod(s_bhij, b, h,
    i, j), s_bhij = q_bhi . k_j * scale, over the keys j that mask_mod(b, h, i, j) shows and whose r is not -inf
    (programmable attention: a mask function and a score function; None: every key, the score itself).

    One query at a time (`_modded_row`): the mods are called with NumPy index arrays for that one query, b, h and
    q_idx (1, 1, 1, 1) and kv_idx (1, 1, 1, S), and its row of scores (1, 1, 1, S); never on tiles or the whole
    grid.

    Args:
        q: queries (B, H, L, E); k: keys (B, Hkv, S, E); v: values (B, Hkv, S, Ev).
        mask_mod, score_mod: the mods (attention_np.common.mods' or any functions of NumPy arrays).
        scale: multiplies q . k before score_mod; defaults to 1 / sqrt(E).
        enable_gqa: Hkv divides H: query head h reads key/value head h // (H / Hkv); the mods see h.
        sinks: one logit per head, broadcasting to (B, H) (SPEC 2h): one more logit of each row, of a key of zero
            value, in the softmax's denominator and in lse.
        alibi_slopes: ALiBi's slopes, (H,) or (B, H) (SPEC 2i): the logit of key j for query i gets
            -slope * |i - j| (flex has no q_offset: query i is at position i), after score_mod.

    Returns:
        out (B, H, L, Ev) in `dtype` (float16 and bfloat16: computed in float32, stored in dtype) and lse (B, H, L)
        in the dtype the scores are computed in; a query that sees no key gets zeros and lse -inf (the sink with
        one).
    """
    q, k, v = _cast(q, dtype), _cast(k, dtype), _cast(v, dtype)
    (B, H, L, E), (S, Ev) = q.shape, v.shape[-2:]
    group = H // k.shape[1] if enable_gqa else 1  # query head h reads key/value head h // group
    scale = 1.0 / math.sqrt(E) if scale is None else float(scale)
    work = _work(dtype)
    sinks = None if sinks is None else np.broadcast_to(_cast(sinks, dtype), (B, H))  # one logit per head
    slopes = None if alibi_slopes is None else np.broadcast_to(_cast(alibi_slopes, dtype), (B, H))  # one a head
    out, lse = np.zeros((B, H, L, Ev), work), np.full((B, H, L), -np.inf, work)  # no key seen: zeros, log 0
    for b, h, i in np.ndindex(B, H, L):
        k_h, v_h = k[b, h // group], v[b, h // group]  # (S, E), (S, Ev)
        scores = k_h @ q[b, h, i] * work.type(scale)  # (S, E) x (E,) -> (S,)
        keys, scores = _modded_row(np.arange(S), scores, (mask_mod, score_mod), (b, h, i))
        if slopes is not None:  # ALiBi after score_mod: the key's distance from query i, times the head's slope
            scores = scores - slopes[b, h] * np.abs(i - keys)
        sink = () if sinks is None or sinks[b, h] == -np.inf else (sinks[b, h],)  # a -inf sink is no sink
        if not len(keys) and not sink:  # the spec's rule: zeros and lse -inf, never 0 / 0
            continue
        logits = np.append(scores, sink).astype(work) if sink else scores  # the sink: a last logit, of value 0
        top = np.max(logits)
        exp = np.exp(logits - top)  # (visible [+ 1],)
        out[b, h, i] = exp[:len(keys)] @ v_h[keys] / np.sum(exp)  # (visible,) x (visible, Ev) -> (Ev,)
        lse[b, h, i] = top + np.log(np.sum(exp))
    return out.astype(dtype), lse  # half precision: computed in float32, stored in dtype


FEATURE_MAPS = ("elu", "relu", "identity")  # linear attention's phi (SPEC 2e)


def linear_attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    feature_map: str = "elu",
    is_causal: bool = False,
    key_lengths: ArrayLike | None = None,
    eps: float = 1e-6,
    update_rule: str = "linear",
    decay: ArrayLike | None = None,
    beta: ArrayLike | None = None,
    dtype: DTypeLike = np.float64,
) -> np.ndarray:
    """out_i = sum_j (phi(q_i) . phi(k_j)) v_j / (sum_j phi(q_i) . phi(k_j) + eps), the double sum over the keys
    j that query i sees (SPEC 2e), one query at a time, each key's weight w_ij = phi(q_i) . phi(k_j) written out
    (a row of the L x S kernel, which linear attention never forms): never the factored sums A = phi(K)^T V and
    z = phi(K)^T 1 that linear attention is built on, nor their prefix sums or chunks, so a bug there cannot pass
    by agreeing with itself.

    Args:
        q: queries (..., L, E); k: keys (..., S, E); v: values (..., S, Ev). Leading axes broadcast.
        feature_map: phi, entry by entry: "elu" (x + 1 for x > 0, else e^x), "relu" (max(x, 0)), "identity" (x).
        is_causal: query i sees keys j <= i (L == S).
        key_lengths: integers broadcasting to (...): a sequence sees its keys j < key_lengths.
        eps: added to each normaliser; a query that sees no key gets 0 / eps = 0.
        update_rule: "linear" (the double sum above), or a rule of ONNX's LinearAttention, causal only, run by
            `linear_recurrence`: "gated", "delta" or "gated_delta".
        decay: g, the gated rules' log-space decay, (..., S, 1) or (..., S, E); beta: the delta rules' rate (..., S, 1).

    Returns:
        out (..., L, Ev) in `dtype` (float16 and bfloat16: computed in float32, stored in dtype).
    """
    if update_rule != "linear":
        if not is_causal:
            raise ValueError(f"update_rule={update_rule!r} is causal only")
        return linear_recurrence(q, k, v, feature_map=feature_map, key_lengths=key_lengths,
                                 update_rule=update_rule, decay=decay, beta=beta, dtype=dtype)
    q, k, v = _cast(q, dtype), _cast(k, dtype), _cast(v, dtype)
    (L, E), (S, Ev) = q.shape[-2:], v.shape[-2:]
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    q = np.broadcast_to(q, (*batch, L, E))
    k = np.broadcast_to(k, (*batch, S, E))
    v = np.broadcast_to(v, (*batch, S, Ev))
    lengths = np.broadcast_to(np.asarray(S if key_lengths is None else key_lengths), batch)
    phi = _FEATURES[feature_map]
    out = np.zeros((*batch, L, Ev), _work(dtype))
    for b in np.ndindex(*batch):
        phi_k = phi(k[b])  # (S, E): each key's features
        for i in range(L):
            keys = np.array([j for j in range(S) if j < int(lengths[b]) and not (is_causal and j > i)], dtype=int)
            weights = phi_k[keys] @ phi(q[(*b, i)])  # phi(k_j) . phi(q_i): (visible, E) x (E,) -> (visible,)
            num = weights @ v[b][keys]  # sum_j w_ij v_j: (visible,) x (visible, Ev) -> (Ev,); 0 for no key
            out[(*b, i)] = num / (np.sum(weights) + out.dtype.type(eps))  # sum_j w_ij + eps
    return out.astype(dtype)  # half precision: computed in float32, stored in dtype


UPDATE_RULES = ("linear", "gated", "delta", "gated_delta")  # linear attention's rules (SPEC 2e, ONNX's)
GATED, DELTA = ("gated", "gated_delta"), ("delta", "gated_delta")  # the rules that take decay; beta


def linear_recurrence(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    feature_map: str = "elu",
    key_lengths: ArrayLike | None = None,
    update_rule: str = "gated",
    decay: ArrayLike | None = None,
    beta: ArrayLike | None = None,
    dtype: DTypeLike = np.float64,
) -> np.ndarray:
    """The update rules of ONNX's LinearAttention (opset 27) as its spec writes them, one position t at a time from
    the state S = 0 (E, Ev), one sequence at a time, in plain loops (SPEC 2e):
        S <- exp(g_t) S                          (row e by exp(g_t[e]); "gated", "gated_delta")
        u  = v_t                                 ("gated")
           = beta_t (v_t - S^T phi(k_t))         ("delta", "gated_delta": the error of what S recalls for k_t)
        S <- S + phi(k_t) u^T
        out_t = phi(q_t)^T S                     (no normaliser, no scale)
    A key t >= key_lengths leaves S as it was (no decay, no update); its query reads S. Never the chunked form,
    its cumulative decays or its triangular system, so a bug there cannot pass by agreeing with itself.

    Args:
        q: queries (..., L, E); k: keys (..., L, E); v: values (..., L, Ev). Leading axes broadcast.
        feature_map: phi, as for linear_attention.
        key_lengths: integers broadcasting to (...).
        update_rule: "gated", "delta" or "gated_delta".
        decay: g (..., L, 1) or (..., L, E), log space, for the gated rules; beta (..., L, 1) for the delta rules.

    Returns:
        out (..., L, Ev) in `dtype` (float16 and bfloat16: computed in float32, stored in dtype).
    """
    if update_rule not in UPDATE_RULES[1:]:
        raise ValueError(f"update_rule={update_rule!r} is none of {UPDATE_RULES[1:]}")
    q, k, v, g, rate, lengths = _recurrence_inputs(q, k, v, decay, beta, key_lengths, update_rule, dtype)
    (L, E), Ev, batch = q.shape[-2:], v.shape[-1], lengths.shape
    phi = _FEATURES[feature_map]
    out = np.zeros((*batch, L, Ev), _work(dtype))
    for b in np.ndindex(*batch):
        state = np.zeros((E, Ev), _work(dtype))  # S_{-1} = 0
        for t in range(L):
            if t < int(lengths[b]):  # a hidden key leaves the state as it was
                if g is not None:  # 1) the decay, before the update: row e of S by exp(g_t[e])
                    state = np.exp(g[b][t])[:, None] * state  # (1 or E, 1) * (E, Ev)
                phi_k = phi(k[b][t])  # (E,)
                u = v[b][t]  # (Ev,)
                if rate is not None:  # 2) the delta rule: beta_t times the error of what S recalls for phi(k_t)
                    u = rate[b][t][0] * (v[b][t] - phi_k @ state)  # (E,) x (E, Ev) -> (Ev,)
                state = state + np.outer(phi_k, u)  # 3) the update: (E,) x (Ev,) -> (E, Ev)
            out[(*b, t)] = phi(q[b][t]) @ state  # 4) the read: (E,) x (E, Ev) -> (Ev,)
    return out.astype(dtype)  # half precision: computed in float32, stored in dtype


def _recurrence_inputs(q: ArrayLike, k: ArrayLike, v: ArrayLike, decay: ArrayLike | None, beta: ArrayLike | None,
                       key_lengths: ArrayLike | None, update_rule: str, dtype: DTypeLike) -> tuple:
    """linear_recurrence's inputs (and its vjp's) in `dtype` at their common leading axes (...): q, k, v (..., L, *),
    g (..., L, 1 or E) for the gated rules and beta (..., L, 1) for the delta rules (None for the others), and the
    key lengths (...)."""
    q, k, v = _cast(q, dtype), _cast(k, dtype), _cast(v, dtype)
    L = q.shape[-2]
    gates = [np.asarray(x) for x in (decay, beta) if x is not None]
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], *(x.shape[:-2] for x in gates))
    q, k, v = (np.broadcast_to(x, (*batch, *x.shape[-2:])) for x in (q, k, v))
    g = None if update_rule not in GATED else np.broadcast_to(_cast(decay, dtype), (*batch, L, np.shape(decay)[-1]))
    rate = None if update_rule not in DELTA else np.broadcast_to(_cast(beta, dtype), (*batch, L, 1))
    lengths = np.broadcast_to(np.asarray(L if key_lengths is None else key_lengths), batch)
    return q, k, v, g, rate, lengths


def varlen_attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    cu_seqlens_q: ArrayLike,
    cu_seqlens_k: ArrayLike,
    *,
    is_causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    dtype: DTypeLike = np.float64,
) -> np.ndarray:
    """Packed sequences (SPEC 2g): each sequence n on its own, out[n] = sdpa(q_n, k_n, v_n, q_offset = S_n - L_n)
    (bottom-right: its last query sits at its last key), by the oracle's own sdpa; a query past the last boundary
    belongs to no sequence and gets zeros. Never the catalogue's mods.varlen, which the backends use as their mask.

    Args:
        q: packed queries (Tq, H, E); k: packed keys (Tk, Hkv, E); v: packed values (Tk, Hkv, Ev).
        cu_seqlens_q, cu_seqlens_k: integers (N + 1,): sequence n's queries cu_seqlens_q[n] <= i <
            cu_seqlens_q[n + 1], its keys cu_seqlens_k[n] <= j < cu_seqlens_k[n + 1].
        is_causal, window, softcap, scale, enable_gqa: as for sdpa, inside each sequence.

    Returns:
        out (Tq, H, Ev) in `dtype`.
    """
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    out = np.zeros((*q.shape[:-1], v.shape[-1]), _work(dtype))  # (Tq, H, Ev)
    for rows, keys in _sequences(cu_seqlens_q, cu_seqlens_k):
        q_n, k_n, v_n = (np.swapaxes(x, 0, 1) for x in (q[rows], k[keys], v[keys]))  # (H, L_n, E), (Hkv, S_n, *)
        out_n, _ = sdpa(q_n, k_n, v_n, is_causal=is_causal, scale=scale, q_offset=k_n.shape[-2] - q_n.shape[-2],
                        window=window, softcap=softcap, enable_gqa=enable_gqa, dtype=dtype)  # (H, L_n, Ev)
        out[rows] = np.swapaxes(out_n, 0, 1)  # (L_n, H, Ev)
    return out.astype(dtype)


def _sequences(cu_seqlens_q: ArrayLike, cu_seqlens_k: ArrayLike) -> list[tuple[slice, slice]]:
    """(its queries, its keys) of each packed sequence n: slices of the packed axes."""
    cu_q, cu_k = (np.asarray(bounds).tolist() for bounds in (cu_seqlens_q, cu_seqlens_k))
    return [(slice(cu_q[n], cu_q[n + 1]), slice(cu_k[n], cu_k[n + 1])) for n in range(len(cu_q) - 1)]


def _elu_plus_one(x: np.ndarray) -> np.ndarray:
    """elu(x) + 1, entry by entry: x + 1 for x > 0, e^x otherwise (never 1 + (e^x - 1), which loses e^x)."""
    values = (t + 1.0 if t > 0 else math.exp(t) for t in x.ravel().tolist())
    return np.fromiter(values, x.dtype, count=x.size).reshape(x.shape)


_FEATURES: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "elu": _elu_plus_one,
    "relu": lambda x: np.where(x < 0, np.zeros((), x.dtype), x),  # NaN stays NaN, as max(NaN, 0) is
    "identity": lambda x: x,
}


def multi_head_attention(
    state: Mapping[str, ArrayLike],
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    mask: ArrayLike | None = None,
    *,
    num_heads: int,
    num_kv_heads: int | None = None,
    rope_theta: float | None = None,
    attention: str = "softmax",
    is_causal: bool = False,
    position: str | None = None,
    dtype: DTypeLike = np.float64,
    fused_bias: bool = True,
) -> tuple[np.ndarray, np.ndarray | None]:
    """MultiHead(Q, K, V) = Concat(head_1, ..., head_H) W_o^T + b_o,
    head_h = Attention(Q W_q,h^T + b_q,h, K W_k,g^T + b_k,g, V W_v,g^T + b_v,g), g = h // (H / Hkv),
    computed one head at a time; Attention is `sdpa` at scale 1 / sqrt(d_k), or `linear_attention`.

    Args:
        state: w_q, w_o .weight (D, D), w_k, w_v .weight (Hkv * d_k, D), nn.Linear layout; each .bias (out,)
            where the state has it (none: y = x W^T); sinks (H,) where it has them (SPEC 2h): head h's softmax
            takes sinks[h] as one more logit, of no value.
        q: queries (..., L, D); k: keys (..., S, D); v: values (..., S, D).
        mask: broadcasts to (..., H, L, S); an entry equal to 0 / False hides that key.
        num_heads: H; query head h works on the contiguous slice h*d_k:(h+1)*d_k of D, d_k = D / H.
        num_kv_heads: Hkv (None: H); key/value head g on the slice g*d_k:(g+1)*d_k of the Hkv * d_k columns,
            read by the query heads h with h // (H / Hkv) = g.
        rope_theta: None, or each head's queries turned by `rope` at positions 0 .. L - 1 and its keys at
            0 .. S - 1, half layout, base rope_theta.
        attention: each head's, a name of HEAD_ATTENTIONS: "softmax", or "linear" (linear_attention with its
            defaults, phi = elu + 1, eps 1e-6; it takes no mask and forms no weights).
        is_causal: each head's query i sees keys j <= i (and-ed with the mask); linear heads need L == S.
        position: "alibi": head h's logit of key j for query i gets -alibi_slopes(H)[h] * |i - j| (SPEC 2i;
            softmax heads); None: none (rope_theta decides RoPE).
        dtype: see the module docstring; fused_bias: each Linear rounds once (else twice) in half precision.

    Returns:
        out (..., L, D) and weights (..., H, L, S), in `dtype`; the weights None with attention "linear".
    """
    state = {name: _cast(value, dtype) for name, value in state.items()}
    d_model = state["w_q.weight"].shape[1]
    if d_model % num_heads:
        raise ValueError(f"d_model={d_model} must be divisible by num_heads={num_heads}")
    d_k, group = d_model // num_heads, num_heads // (num_heads if num_kv_heads is None else num_kv_heads)
    if attention == "linear" and mask is not None:
        raise ValueError("linear attention takes no mask")
    head = HEAD_ATTENTIONS[attention]

    # 1) project
    q = _linear(state, "w_q", _cast(q, dtype), dtype, fused_bias)  # (..., L, D) -> (..., L, D)
    k = _linear(state, "w_k", _cast(k, dtype), dtype, fused_bias)  # (..., S, D) -> (..., S, Hkv * d_k)
    v = _linear(state, "w_v", _cast(v, dtype), dtype, fused_bias)  # (..., S, D) -> (..., S, Hkv * d_k)
    if mask is not None:
        batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        mask = np.broadcast_to(np.asarray(mask), (*batch, num_heads, q.shape[-2], k.shape[-2]))

    # 2) attend, one head at a time
    heads, weights = [], []
    for h in range(num_heads):
        cols, kv_cols = slice(h * d_k, (h + 1) * d_k), slice(h // group * d_k, (h // group + 1) * d_k)
        head_mask = None if mask is None else mask[..., h, :, :]  # (..., H, L, S) -> (..., L, S)
        q_h, k_g = q[..., cols], k[..., kv_cols]  # (..., L, d_k), (..., S, d_k)
        if rope_theta is not None:
            q_h = rope(q_h, np.arange(q_h.shape[-2]), theta=rope_theta, dtype=dtype)
            k_g = rope(k_g, np.arange(k_g.shape[-2]), theta=rope_theta, dtype=dtype)
        out_h, weights_h = head(q_h, k_g, v[..., kv_cols], head_mask, dtype, is_causal,
                                **head_keywords(state, h, num_heads, position))  # (..., L, d_k), (..., L, S) or None
        heads.append(out_h)
        weights.append(weights_h)

    # 3) concatenate the heads and mix them
    mixed = _cast(np.concatenate(heads, axis=-1), dtype)  # H x (..., L, d_k) -> (..., L, D)
    out = _linear(state, "w_o", mixed, dtype, fused_bias)  # (..., L, D) -> (..., L, D)
    formed = None if weights[0] is None else np.stack(weights, axis=-3)  # H x (..., L, S) -> (..., H, L, S)
    return out.astype(dtype), formed


def head_keywords(state: Mapping[str, np.ndarray], h: int, num_heads: int, position: str | None) -> dict[str, Any]:
    """Head h's sdpa keywords of one value per head: its sink logit where the state holds sinks (H,), its ALiBi
    slope with position "alibi"; none otherwise (so linear heads, which take neither, get none)."""
    keywords = {} if "sinks" not in state else {"sinks": state["sinks"][h]}
    return keywords | ({} if position != "alibi" else {"alibi_slopes": alibi_slopes(num_heads)[h]})


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi's slopes (H,) as the paper and BLOOM take them: for n = H a power of two the geometric sequence
    2^(-8/n), 2^(-16/n), .., 2^(-8); otherwise those of n, the greatest power of two below H, followed by every
    other slope of 2n's sequence, 2^(-8/2n), 2^(-24/2n), .., until there are H."""
    n = 1 << (num_heads.bit_length() - 1)  # the greatest power of two <= H
    ratio = 2.0 ** (-8.0 / n)
    slopes = [ratio ** (h + 1) for h in range(n)]
    extra = 2.0 ** (-4.0 / n)  # 2n's ratio, 2^(-8 / 2n); its odd powers
    slopes += [extra ** (2 * h + 1) for h in range(num_heads - n)]
    return np.array(slopes, np.float64)


def _softmax_head(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None, dtype: DTypeLike,
                  is_causal: bool = False, **per_head: Any) -> tuple[np.ndarray, np.ndarray]:
    """One head of softmax attention: sdpa at scale 1 / sqrt(d_k), with the head's sink and ALiBi slope where
    given (`per_head`: sinks, alibi_slopes); out (..., L, d_k), weights (..., L, S)."""
    return sdpa(q, k, v, mask, is_causal=is_causal, scale=1.0 / math.sqrt(q.shape[-1]), dtype=dtype, **per_head)


def _linear_head(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: None, dtype: DTypeLike,
                 is_causal: bool = False) -> tuple[np.ndarray, None]:
    """One head of linear attention with its defaults (no mask): out (..., L, d_k), and no weights."""
    return linear_attention(q, k, v, is_causal=is_causal, dtype=dtype), None


# MultiHeadAttention's attention in each head (SPEC 3): (q_h, k_g, v_g, mask_h, dtype, is_causal) -> (out_h,
# weights_h or None)
HEAD_ATTENTIONS: dict[str, Callable[..., tuple[np.ndarray, np.ndarray | None]]] = {
    "softmax": _softmax_head, "linear": _linear_head}


def transformer_block(
    state: Mapping[str, ArrayLike],
    x: ArrayLike,
    mask: ArrayLike | None = None,
    *,
    num_heads: int,
    norm_first: bool = False,
    activation: str = "relu",
    eps: float = 1e-5,
    norm: str = "layer",
    num_kv_heads: int | None = None,
    rope_theta: float | None = None,
    attention: str = "softmax",
    is_causal: bool = False,
    dtype: DTypeLike = np.float64,
    fused_bias: bool = True,
) -> tuple[np.ndarray, np.ndarray | None]:
    """post-LN: x = LN_1(x + MHA(x, x, x)),  x = LN_2(x + FFN(x));
    pre-LN:  x = x + MHA(LN_1(x)),         x = x + FFN(LN_2(x));   FFN(x) = W_3 act(W_0 x + b_0) + b_3,
    or with activation "swiglu" FFN(x) = W_down (silu(W_gate x + b_gate) * (W_up x + b_up)) + b_down.

    Args:
        state: attn.<multi-head names>, norm1/norm2 .weight (D,) and, with norm "layer", .bias (D,);
            ffn.0.weight (F, D), ffn.3.weight (D, F), or with "swiglu" ffn.w_gate.weight, ffn.w_up.weight
            (F, D) and ffn.w_down.weight (D, F); each Linear's .bias (out,) where the state has it.
        x: inputs (..., L, D).
        mask: broadcasts to (..., H, L, L); an entry equal to 0 / False hides that key.
        num_heads: H. norm_first: pre-LN instead of post-LN. activation: "relu", "gelu" (exact erf form) or
            "swiglu" (silu(x) = x / (1 + exp(-x))).
        eps: added to the variance (LayerNorm) or the mean square (RMSNorm) inside the square root.
        norm: "layer", (x - mean) / sqrt(var + eps) * weight + bias, or "rms", x / sqrt(mean(x^2) + eps) * weight.
        num_kv_heads: attention's key/value heads Hkv (None: H); rope_theta: attention's RoPE (None: none).
        attention, is_causal: attention's heads and causality, as for multi_head_attention ("linear": no mask).
        dtype: see the module docstring; fused_bias: each Linear rounds once (else twice) in half precision.

    Returns:
        x (..., L, D) and the attention weights (..., H, L, L), in `dtype`; None with attention "linear".
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}; got {activation!r}")
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}; got {norm!r}")
    normalize = _layer_norm if norm == "layer" else _rms_norm
    state = {name: _cast(value, dtype) for name, value in state.items()}
    attn = {name.removeprefix("attn."): value for name, value in state.items() if name.startswith("attn.")}
    x = _cast(x, dtype)

    def attend(y: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        h, weights = multi_head_attention(attn, y, y, y, mask, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                          rope_theta=rope_theta, attention=attention, is_causal=is_causal,
                                          dtype=dtype, fused_bias=fused_bias)  # (..., L, D)
        return _cast(h, dtype), weights

    def feed_forward(y: np.ndarray) -> np.ndarray:
        if activation == "swiglu":  # silu(gate) * up, each entry on its own
            gate, up = (_linear(state, f"ffn.{name}", y, dtype, fused_bias) for name in ("w_gate", "w_up"))
            h = _cast(_activation("silu", gate, dtype) * up, dtype)  # (..., L, D) -> (..., L, F)
            return _linear(state, "ffn.w_down", h, dtype, fused_bias)  # (..., L, F) -> (..., L, D)
        h = _activation(activation, _linear(state, "ffn.0", y, dtype, fused_bias), dtype)  # (..., L, D) -> (..., L, F)
        return _linear(state, "ffn.3", h, dtype, fused_bias)  # (..., L, F) -> (..., L, D)

    # each residual sum is stored in dtype, as a module adding two tensors of that dtype stores it
    if norm_first:  # pre-LN
        h, weights = attend(normalize(state, "norm1", x, eps, dtype))
        x = _cast(x + h, dtype)
        x = _cast(x + feed_forward(normalize(state, "norm2", x, eps, dtype)), dtype)
    else:  # post-LN
        h, weights = attend(x)
        x = normalize(state, "norm1", _cast(x + h, dtype), eps, dtype)
        x = normalize(state, "norm2", _cast(x + feed_forward(x), dtype), eps, dtype)
    return x.astype(dtype), weights


LATENT_EPS = 1e-6  # MLA's two RMSNorms: DeepseekV3RMSNorm's default eps, which q_a_layernorm and kv_a_layernorm keep


def multi_head_latent_attention(
    state: Mapping[str, ArrayLike],
    x: ArrayLike,
    mask: ArrayLike | None = None,
    *,
    num_heads: int,
    rope_theta: float = 10000.0,
    dtype: DTypeLike = np.float64,
) -> tuple[np.ndarray, np.ndarray]:
    """MLA(h) = Concat(o_1, ..., o_H) W_O^T,  o_h = softmax([q_C,h, q_R,h] [k_C,h, k_R]^T / sqrt(En + Er)) v_C,h,
    DeepSeek-V2's multi-head latent attention (arXiv:2405.04434, section 2.1; SPEC 3d), the paper's steps in order,
    computed one head at a time, each head's attention `sdpa` (one query row at a time):

        c_Q = RMSNorm(h W_DQ^T),  [q_C, q_R]_h = (c_Q W_UQ^T)_h     (h W_Q^T without a query latent)
        [c_KV, k_R] = h W_DKV^T,  c_KV = RMSNorm(c_KV)
        q_R, k_R turned by RoPE at their positions (interleaved pairs); k_R one key part for every head
        [k_C, v_C]_h = (c_KV W_UKV^T)_h

    Args:
        state: DeepSeek-V3's names, nn.Linear layout, no biases: q_a_proj.weight (Dq, D), q_a_layernorm.weight
            (Dq,), q_b_proj.weight (H E, Dq), or q_proj.weight (H E, D); kv_a_proj_with_mqa.weight (Dc + Er, D),
            kv_a_layernorm.weight (Dc,), kv_b_proj.weight (H (En + Ev), Dc), o_proj.weight (D, H Ev).
        x: inputs (..., L, D); row i at position i.
        mask: broadcasts to (..., H, L, L); an entry equal to 0 / False hides that key.
        num_heads: H; head h's query is the slice h E:(h + 1) E of the queries' H E columns (E = En + Er), its key
            and value the slice h (En + Ev):(h + 1) (En + Ev) of kv_b_proj's, the key part first.
        rope_theta: RoPE's base.
        dtype: see the module docstring (the float32 run measures what a correct float32 module may lose).

    Returns:
        out (..., L, D) and weights (..., H, L, L), in `dtype`.
    """
    state = {name: _cast(value, dtype) for name, value in state.items()}
    x = _cast(x, dtype)
    H, Dc = num_heads, state["kv_a_layernorm.weight"].shape[0]
    Er = state["kv_a_proj_with_mqa.weight"].shape[0] - Dc  # the shared key part's width
    Ev = state["o_proj.weight"].shape[1] // H
    En = state["kv_b_proj.weight"].shape[0] // H - Ev
    positions = np.arange(x.shape[-2])  # (L,): row i at position i

    def turned(y: np.ndarray) -> np.ndarray:  # (..., L, Er): RoPE, DeepSeek's pairs (y_2j, y_2j+1)
        return rope(y, positions, theta=rope_theta, interleaved=True, dtype=dtype)

    # 1) the queries: c_Q = RMSNorm(h W_DQ^T), q = c_Q W_UQ^T; or q = h W_Q^T
    if "q_proj.weight" in state:
        q = _linear(state, "q_proj", x, dtype, True)  # (..., L, D) -> (..., L, H E)
    else:
        c_q = _rms_norm(state, "q_a_layernorm", _linear(state, "q_a_proj", x, dtype, True), LATENT_EPS, dtype)
        q = _linear(state, "q_b_proj", c_q, dtype, True)  # (..., L, Dq) -> (..., L, H E)

    # 2) the latents: [c_KV, k_R] = h W_DKV^T; c_KV through its RMSNorm, k_R turned
    kv = _linear(state, "kv_a_proj_with_mqa", x, dtype, True)  # (..., L, D) -> (..., L, Dc + Er)
    c_kv = _rms_norm(state, "kv_a_layernorm", kv[..., :Dc], LATENT_EPS, dtype)  # (..., S, Dc), S = L
    k_rope = turned(kv[..., Dc:])  # (..., S, Er)

    # 3) up-project the latent: [k_C, v_C] = c_KV W_UKV^T
    up = _linear(state, "kv_b_proj", c_kv, dtype, True)  # (..., S, Dc) -> (..., S, H (En + Ev))
    if mask is not None:
        mask = np.broadcast_to(np.asarray(mask), (*x.shape[:-2], H, x.shape[-2], x.shape[-2]))  # (..., H, L, L)

    # 4) attend, one head at a time: query [q_C,h, RoPE(q_R,h)], key [k_C,h, k_R], value v_C,h
    heads, weights = [], []
    for h in range(H):
        q_h = q[..., h * (En + Er):(h + 1) * (En + Er)]  # (..., L, En + Er)
        kv_h = up[..., h * (En + Ev):(h + 1) * (En + Ev)]  # (..., S, En + Ev)
        q_h = np.concatenate([q_h[..., :En], turned(q_h[..., En:])], axis=-1)  # (..., L, E)
        k_h = np.concatenate([kv_h[..., :En], k_rope], axis=-1)  # (..., S, E): k_R the same in every head
        out_h, weights_h = sdpa(q_h, k_h, kv_h[..., En:], None if mask is None else mask[..., h, :, :],
                                scale=1.0 / math.sqrt(En + Er), dtype=dtype)  # (..., L, Ev), (..., L, S)
        heads.append(out_h)
        weights.append(weights_h)

    # 5) concatenate the heads and mix them
    mixed = _cast(np.concatenate(heads, axis=-1), dtype)  # H x (..., L, Ev) -> (..., L, H Ev)
    out = _linear(state, "o_proj", mixed, dtype, True)  # (..., L, H Ev) -> (..., L, D)
    return out.astype(dtype), np.stack(weights, axis=-3)  # H x (..., L, S) -> (..., H, L, S)


def causal_mask(L: int, S: int, *, q_offset: int | ArrayLike = 0) -> np.ndarray:
    """bool (..., L, S), row by row: query i sees key j when j <= q_offset + i (the catalogue's
    causal(q_offset)); (...) is q_offset's shape."""
    return _position_mask(L, S, q_offset, Structure(is_causal=True, q_offset=0, window=None, key_lengths=None))


def window_mask(L: int, S: int, window: tuple[int | None, int | None], *,
                q_offset: int | ArrayLike = 0) -> np.ndarray:
    """bool (..., L, S), row by row: query i sees key j when p_i - left <= j <= p_i + right, p_i = q_offset + i
    (None: that side unbounded; the catalogue's sliding_window(left, right, q_offset)); (...) is q_offset's
    shape."""
    return _position_mask(L, S, q_offset, Structure(is_causal=False, q_offset=0, window=window, key_lengths=None))


def _position_mask(L: int, S: int, q_offset: int | ArrayLike, structure: Structure) -> np.ndarray:
    """bool (..., L, S): the keys that the position keywords of `structure` show query i, for each offset of
    q_offset (...)."""
    offsets = np.asarray(q_offset)
    rows = [[_by_position(from_keywords(structure._replace(q_offset=int(offset)))[0], i, S) for i in range(L)]
            for offset in offsets.ravel()]
    return np.array(rows, dtype=bool).reshape(*offsets.shape, L, S)


def _by_position(by_position: Callable[..., ArrayLike] | None, i: int, S: int) -> np.ndarray:
    """bool (S,): the keys j that query i sees by the position keywords, `by_position` their mask function of one
    sequence (from_keywords: the catalogue's causal, sliding_window and key_lengths, composed; None: every key)."""
    if by_position is None:
        return np.ones(S, bool)
    return np.broadcast_to(by_position(None, None, np.asarray(i), np.arange(S)), S)


def rope(x: ArrayLike, positions: int | ArrayLike, *, theta: float = 10000.0, interleaved: bool = False,
         dtype: DTypeLike = np.float64) -> np.ndarray:
    """Rotary position embeddings, row by row: the row at position p is E/2 complex numbers
    z_j = x_a + i x_b, each multiplied by exp(i p theta^(-2j / E)); (a, b) = (j, j + E/2) in the half
    layout, (2j, 2j + 1) interleaved. x (..., L, E); positions integers broadcasting to (..., L). The angle
    p theta^(-2j / E) is rounded as SPEC 2b computes it, in the working dtype (`_work`: float32 for float16 and
    bfloat16), so that a position in the thousands loses there what a conformant module loses."""
    x = _cast(x, dtype)
    positions = np.broadcast_to(np.asarray(positions), x.shape[:-1])
    E = x.shape[-1]
    pairs = [(2 * j, 2 * j + 1) if interleaved else (j, j + E // 2) for j in range(E // 2)]
    work = x.dtype.type  # the working dtype's scalar
    out = np.empty_like(x)
    for row in np.ndindex(*x.shape[:-1]):
        for j, (a, b) in enumerate(pairs):
            angle = work(int(positions[row])) * work(theta ** (-2 * j / E))  # rounded in the working dtype
            z = complex(x[(*row, a)], x[(*row, b)]) * cmath.exp(1j * float(angle))
            out[(*row, a)], out[(*row, b)] = z.real, z.imag
    return out.astype(dtype)


def padding_mask(lengths: ArrayLike, S: int) -> np.ndarray:
    """bool (B, 1, 1, S), sequence by sequence: sequence b sees its first lengths[b] keys."""
    rows = [[j < int(n) for j in range(S)] for n in np.asarray(lengths).ravel()]
    return np.array(rows, dtype=bool).reshape(-1, 1, 1, S)


def _visible_keys(i: int, mask_row: np.ndarray, bias_row: np.ndarray,
                  by_position: Callable[..., ArrayLike] | None) -> np.ndarray:
    """The keys j query i may see, as indices: kept by the mask, not -inf in the bias, and shown by the position
    keywords' mask function of its sequence (`_by_position`)."""
    j = np.arange(len(mask_row))
    return j[mask_row & (bias_row != -np.inf) & _by_position(by_position, i, len(mask_row))]


def _attend(v: np.ndarray, keys: np.ndarray, logits: np.ndarray, S: int) -> tuple[np.ndarray, np.ndarray]:
    """One query row: out_i = sum_j w_j v_j, w = softmax(logits) over the visible keys j alone; a sink's logit,
    where there is one, follows the keys' (len(logits) = len(keys) + 1), joins the softmax and is dropped."""
    out_i, weights_i = np.zeros(v.shape[-1], v.dtype), np.zeros(S, v.dtype)  # (Ev,), (S,)
    if not len(keys):  # the spec's rule: a query with no visible key gets zeros, never 0 / 0 = NaN
        return out_i, weights_i
    exp = np.exp(logits - np.max(logits))  # subtracting the max changes nothing but keeps exp finite
    weights_i[keys] = (exp / np.sum(exp))[:len(keys)]
    return weights_i[keys] @ v[keys], weights_i  # (visible,) x (visible, Ev) -> (Ev,)


def _logits(q_i: np.ndarray, k: np.ndarray, keys: np.ndarray, bias_row: np.ndarray, scale: float,
            capping: Callable[..., ArrayLike] | None, mods: Mods,
            index: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """The keys the mods leave visible of `keys` and their logits score_mod(cap(q_i . k_j * scale)) + bias_ij,
    (visible,) each, cap the softcap keyword's score function (from_keywords; None: none); index is the query's
    (..., i), (b, h, i) where there are mods."""
    raw = k[keys] @ q_i * scale  # (visible, E) x (E,) -> (visible,)
    if capping is not None:  # capped before the bias (Gemma 2), so the bias still decides what is hidden
        raw = np.asarray(capping(raw, None, None, None, None)).astype(raw.dtype)
    if mods != (None, None):  # after the cap, before the bias (SPEC 2a)
        keys, raw = _modded_row(keys, raw, mods, index)
    return keys, raw + bias_row[keys]


def _modded_row(keys: np.ndarray, scores: np.ndarray, mods: Mods,
                index: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """One query's row through the mods: score_mod(scores, b, h, q_idx, kv_idx) and mask_mod(b, h, q_idx, kv_idx)
    called with NumPy index arrays, b, h and q_idx (1, 1, 1, 1) of the query (b, h, i) and kv_idx (1, 1, 1, n)
    of its keys (n,); returns the keys mask_mod shows whose modded score is not -inf, and those scores."""
    mask_mod, score_mod = mods
    n, work = len(keys), scores.dtype
    if not n:
        return keys, scores
    b, h, q_idx = (np.full((1, 1, 1, 1), int(x)) for x in index[-3:])
    kv_idx = keys.reshape(1, 1, 1, n)
    if score_mod is not None:
        scores = np.asarray(score_mod(scores.reshape(1, 1, 1, n), b, h, q_idx, kv_idx), work)
        scores = np.broadcast_to(scores, (1, 1, 1, n)).reshape(n)
    seen = np.ones(n, bool) if mask_mod is None else \
        np.broadcast_to(np.asarray(mask_mod(b, h, q_idx, kv_idx)) != 0, (1, 1, 1, n)).reshape(n)
    seen = seen & (scores != -np.inf)  # a score of -inf hides its key as the mask does
    return keys[seen], scores[seen]


def _linear(state: Mapping[str, np.ndarray], name: str, x: np.ndarray, dtype: DTypeLike,
            fused_bias: bool) -> np.ndarray:
    """y = x W^T + b, W (out, in): y_o = sum_i x_i W_oi + b_o; stored in dtype, the product also before the
    bias is added unless fused_bias. A Linear without bias (no name.bias in the state) is the product alone."""
    product = np.einsum("...i,oi->...o", x, state[f"{name}.weight"])  # (..., in) -> (..., out)
    if f"{name}.bias" not in state:
        return _cast(product, dtype)
    return _cast((product if fused_bias else _cast(product, dtype)) + state[f"{name}.bias"], dtype)


def _layer_norm(state: Mapping[str, np.ndarray], name: str, x: np.ndarray, eps: float,
                dtype: DTypeLike) -> np.ndarray:
    """(x - mean) / sqrt(var + eps) * weight + bias over the last axis, var the biased variance; stored in
    dtype."""
    d_model = x.shape[-1]
    mean = np.sum(x, axis=-1, keepdims=True) / d_model  # (..., D) -> (..., 1)
    var = np.sum((x - mean) ** 2, axis=-1, keepdims=True) / d_model  # biased: divide by D, not D - 1
    return _cast((x - mean) / np.sqrt(var + eps) * state[f"{name}.weight"] + state[f"{name}.bias"], dtype)


def _rms_norm(state: Mapping[str, np.ndarray], name: str, x: np.ndarray, eps: float,
              dtype: DTypeLike) -> np.ndarray:
    """x / sqrt(sum(x^2) / D + eps) * weight over the last axis, no mean removed and no bias; stored in dtype."""
    d_model = x.shape[-1]
    mean_square = np.sum(x * x, axis=-1, keepdims=True) / d_model  # (..., D) -> (..., 1)
    return _cast(x / np.sqrt(mean_square + eps) * state[f"{name}.weight"], dtype)


def _activation(name: str, x: np.ndarray, dtype: DTypeLike) -> np.ndarray:
    """relu(x) = max(x, 0); gelu(x) = x * Phi(x) = x * (1 + erf(x / sqrt(2))) / 2 and silu(x) = x / (1 + e^-x),
    one entry at a time; stored in dtype."""
    if name == "relu":
        return _cast(np.maximum(x, 0.0), dtype)
    if name == "silu":  # x / (1 + e^-x) overflows for x below about -709: its limit there is -0 (x e^x)
        silu = (t / (1 + math.exp(-t)) if t > -700 else t * math.exp(t) for t in x.ravel().tolist())
        return _cast(np.fromiter(silu, x.dtype, count=x.size).reshape(x.shape), dtype)
    gelu = (t * (1 + math.erf(t / math.sqrt(2))) / 2 for t in x.ravel().tolist())
    return _cast(np.fromiter(gelu, x.dtype, count=x.size).reshape(x.shape), dtype)


def _work(dtype: DTypeLike) -> np.dtype:
    """The dtype the arithmetic runs in: float32 for float16 and bfloat16 (SPEC.md section 2), else dtype."""
    return np.dtype(np.float32) if np.dtype(dtype).itemsize < 4 else np.dtype(dtype)


def _cast(x: ArrayLike, dtype: DTypeLike) -> np.ndarray:
    """x as a tensor of dtype holds it: rounded to dtype, in the dtype the arithmetic runs in (_work)."""
    return np.asarray(x, dtype=dtype).astype(_work(dtype))
