"""The oracle's own vector-Jacobian products: the gradients of the oracle's attention, one query row (and one
head) at a time, as the oracle's forward computes it (conformance/contract/oracle.py).

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

Written apart from every backend's backward pass (attention_np/gradients.py computes whole score matrices;
this walks the queries and lists the keys each one sees), so that a backward pass cannot pass by agreeing
with itself. tests/test_oracle_gradients.py holds these to central differences of the oracle's forward.

`dtype` as for the oracle's forward: float64 exact; float32 all in float32; float16 and bfloat16 the
arithmetic in float32 with each stored tensor rounded to `dtype`: the forward's stored tensors as the
oracle's forward stores them (the inputs, the weights P, out), then the backward's dP, dS, and each gradient.
That is what a plain low-precision computation loses, to which the suite holds a module's gradients
(conformance/run/gradient_checks.py gradients_low_precision, SPEC.md section 9).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import NamedTuple

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from attention_np.common.mods import from_keywords
from attention_np.common.records import Structure

from .oracle import (
    _FEATURES,
    DELTA,
    GATED,
    HEAD_ATTENTIONS,
    _activation,
    _cast,
    _laid_out,
    _layer_norm,
    _linear,
    _recurrence_inputs,
    _rms_norm,
    _sequences,
    _visible_keys,
    _work,
    head_keywords,
    multi_head_attention,
    rope,
)

Gradients = dict[str, np.ndarray]


def sdpa_vjp(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    d_out: ArrayLike,
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
    from_lse: bool = False,
) -> Gradients:
    """The gradients of sum(d_out * out), out = oracle.sdpa(q, k, v, mask, ...), one query row i at a time over
    the keys j it sees (P the row's softmax, R_j = q_i . k_j * scale, C_j = softcap tanh(R_j / softcap)):
        dv_j += P_j dO_i,   dP_j = dO_i . v_j,   dS_j = P_j (dP_j - sum_j' P_j' dP_j'),   dbias_ij = dS_j,
        dR_j = dS_j (1 - tanh^2(R_j / softcap)) (dS_j without softcap),
        dq_i = scale sum_j dR_j k_j,   dk_j += scale dR_j q_i.
    A query that sees no key adds nothing; a key no query sees gets zero. The gradient of a broadcast input is
    summed over its broadcast axes; with enable_gqa a key/value head's over the query heads of its group. With
    sinks, P is the row's softmax over its logits and the sink, the sink's share P_sink dropped, and
    d sink += -P_sink sum_j P_j dP_j for each row. ALiBi's slopes take slope_h |p_i - j| off each logit, as a bias
    does, and get no gradient (SPEC 2i).

    Args:
        q, k, v, mask and the keywords: as for oracle.sdpa; mask_mod and score_mod are not supported (raise).
        d_out: the cotangent (..., L, Ev), out's shape.
        from_lse: P recomputed from the row's log-sum-exp, P_j = exp(logit_j - lse_i), as a tiled kernel that
            keeps only out and lse computes it (flash_attention, SPEC 2c), and the softmax's row term as
            D_i = dO_i . O_i from the stored output (FlashAttention-2's backward); the same numbers in float64, and
            in float32 P loses what exp loses on a logit of large size, D the rounding of O.

    Returns:
        {"q", "k", "v", and "bias" where bias is given, and "sinks" where sinks are}: each of its input's shape,
        in `dtype`.
    """
    if mask_mod is not None or score_mod is not None:
        raise NotImplementedError("sdpa_vjp: the oracle's gradients take no mask_mod or score_mod (the gradient "
                                  "checks of the mods compare central differences instead)")
    shapes = {"q": np.shape(q), "k": np.shape(k), "v": np.shape(v)} | ({} if bias is None else {"bias": np.shape(bias)})
    group = shapes["q"][-3] // shapes["k"][-3] if enable_gqa else 1
    q, k, v, mask, bias_ = _laid_out(q, k, v, mask, bias, enable_gqa, dtype)  # k, v per query head, (*batch, ...)
    batch, (L, E), (S, Ev) = q.shape[:-2], q.shape[-2:], v.shape[-2:]
    d_out = _cast(np.broadcast_to(d_out, (*batch, L, Ev)), dtype)
    scale = 1.0 / math.sqrt(E) if scale is None else float(scale)
    offsets = np.broadcast_to(np.asarray(q_offset), batch)
    lengths = np.broadcast_to(np.asarray(S if key_lengths is None else key_lengths), batch)

    work = _work(dtype)
    dq, dk, dv = np.zeros((*batch, L, E), work), np.zeros((*batch, S, E), work), np.zeros((*batch, S, Ev), work)
    dbias = np.zeros((*batch, L, S), work)
    sink_of = None if sinks is None else np.broadcast_to(_cast(sinks, dtype), batch)  # one logit per sequence
    slopes = None if alibi_slopes is None else np.broadcast_to(_cast(alibi_slopes, dtype), batch)  # one a head
    d_sinks = np.zeros(batch, work)
    for b in np.ndindex(*batch):
        by_position, _ = from_keywords(Structure(
            is_causal=is_causal, q_offset=int(offsets[b]), window=window,
            key_lengths=None if key_lengths is None else int(lengths[b])))
        for i in range(L):
            keys = _visible_keys(i, mask[(*b, i)], bias_[(*b, i)], by_position)
            if not len(keys):  # no key seen: out is zeros whatever q, k and v are, so no gradient
                continue
            bias_row = bias_[(*b, i)][keys]
            if slopes is not None:  # ALiBi: the key's distance from the query's position, times the head's slope
                bias_row = bias_row - slopes[b] * np.abs(int(offsets[b]) + i - keys)
            row = _row_vjp(q[(*b, i)], k[b][keys], v[b][keys], d_out[(*b, i)], bias_row, scale,
                           softcap, dtype, from_lse, None if sink_of is None else sink_of[b])
            d_sinks[b] += row.d_sink
            dq[(*b, i)] = row.dq
            dk[b][keys] += row.dk
            dv[b][keys] += row.dv
            dbias[(*b, i)][keys] = row.ds
    grads = {"q": dq, "k": dk, "v": dv} | ({} if bias is None else {"bias": dbias})  # (*batch, ...) each
    grads |= {} if sinks is None else {"sinks": d_sinks}
    shapes |= {} if sinks is None else {"sinks": np.shape(sinks)}
    if enable_gqa:  # the query heads of a group read one key/value head: its gradient is their sum
        grads["k"], grads["v"] = (_grouped_sum(grads[name], group) for name in ("k", "v"))
    return {name: _summed_to(grad, shapes[name]).reshape(shapes[name]).astype(dtype) for name, grad in grads.items()}


class _RowGradients(NamedTuple):
    """One query row's gradients over its n visible keys."""

    dq: np.ndarray  # (E,)
    dk: np.ndarray  # (n, E)
    dv: np.ndarray  # (n, Ev)
    ds: np.ndarray  # (n,): dS, the bias's gradient
    d_sink: float = 0.0  # the sink's, -P_sink sum_j P_j dP_j (0 without a sink)


def _row_vjp(q_i: np.ndarray, k: np.ndarray, v: np.ndarray, d_out_i: np.ndarray, bias_row: np.ndarray,
             scale: float, softcap: float | None, dtype: DTypeLike, from_lse: bool,
             sink: float | None = None) -> _RowGradients:
    """One query row of sdpa_vjp over its n visible keys: k (n, E), v (n, Ev), bias_row (n,); each tensor a
    module stores (P, dP, dS, the gradients) rounded to dtype. A sink is one more logit, after the keys'."""
    work = q_i.dtype.type
    raw = k @ q_i * work(scale)  # R_j = q_i . k_j * scale: (n, E) x (E,) -> (n,)
    capped = raw if softcap is None else work(softcap) * np.tanh(raw / work(softcap))  # C_j
    logits = capped + bias_row
    if sink is not None:  # the sink's logit joins the softmax; its share is split off below
        logits = np.append(logits, sink)
    exp = np.exp(logits - np.max(logits))
    if from_lse:  # lse_i = m_i + log sum_j exp(logit_j - m_i), kept; P_j = exp(logit_j - lse_i)
        p = _cast(np.exp(logits - (np.max(logits) + np.log(np.sum(exp)))), dtype)
    else:
        p = _cast(exp / np.sum(exp), dtype)  # P_j, stored as the forward stores the weights
    p, p_sink = (p, None) if sink is None else (p[:-1], p[-1])  # the keys' P_j (n,), and the sink's
    dv = _cast(np.outer(p, d_out_i), dtype)  # P_j dO_i: (n,) x (Ev,) -> (n, Ev)
    dp = _cast(v @ d_out_i, dtype)  # dO_i . v_j: (n, Ev) x (Ev,) -> (n,)
    # the softmax's vjp, dS_j = P_j (dP_j - sum_j' P_j' dP_j'); a tiled kernel takes the sum as D_i = dO_i . O_i from
    # the output it stored (FlashAttention-2), the same number in float64
    row_term = np.sum(d_out_i * _cast(p @ v, dtype)) if from_lse else np.sum(p * dp)
    ds = _cast(p * (dp - row_term), dtype)
    dr = ds if softcap is None else _cast(ds * (1 - np.tanh(raw / work(softcap)) ** 2), dtype)  # tanh's derivative
    dq = dr @ k * work(scale)  # scale sum_j dR_j k_j: (n,) x (n, E) -> (E,)
    dk = np.outer(dr, q_i) * work(scale)  # scale dR_j q_i: (n,) x (E,) -> (n, E)
    d_sink = 0.0 if p_sink is None else -p_sink * row_term  # d P_j / d sink = -P_j P_sink
    return _RowGradients(dq=dq, dk=dk, dv=dv, ds=ds, d_sink=d_sink)


def linear_attention_vjp(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    d_out: ArrayLike,
    *,
    feature_map: str = "elu",
    is_causal: bool = False,
    key_lengths: ArrayLike | None = None,
    eps: float = 1e-6,
    update_rule: str = "linear",
    decay: ArrayLike | None = None,
    beta: ArrayLike | None = None,
    dtype: DTypeLike = np.float64,
) -> Gradients:
    """The gradients of sum(d_out * out), out = oracle.linear_attention(q, k, v, ...), one query i at a time
    over the keys j it sees (w_j = phi(q_i) . phi(k_j), den_i = sum_j w_j + eps, out_i = num_i / den_i,
    num_i = sum_j w_j v_j), through the quotient as autodiff of the forward goes:
        d_num = dO_i / den_i,   d_den = -d_num . out_i,   dv_j += w_j d_num,   dw_j = d_num . v_j + d_den,
        dphi(q_i) = sum_j dw_j phi(k_j),   dphi(k_j) += dw_j phi(q_i),   dq = dphi(q) phi'(q), dk likewise,
    phi' entry by entry: elu + 1: 1 for x > 0, e^x otherwise; relu: 1 for x > 0, else 0; identity: 1.
    (dw_j = d_num . (v_j - out_i) is the same number; computed so in float32 it loses less where v_j and out_i
    nearly cancel, so the plain computation the suite scales its tolerance by is the form autodiff takes.)

    An update rule other than "linear" goes to `linear_recurrence_vjp`.

    Returns:
        {"q", "k", "v"}: each of its input's shape, in `dtype`; and "decay", "beta" where the rule takes them.
    """
    if update_rule != "linear":
        return linear_recurrence_vjp(q, k, v, d_out, feature_map=feature_map, key_lengths=key_lengths,
                                     update_rule=update_rule, decay=decay, beta=beta, dtype=dtype)
    shapes = {"q": np.shape(q), "k": np.shape(k), "v": np.shape(v)}
    q, k, v = _cast(q, dtype), _cast(k, dtype), _cast(v, dtype)
    (L, E), (S, Ev) = q.shape[-2:], v.shape[-2:]
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    q, k, v = (np.broadcast_to(x, (*batch, *x.shape[-2:])) for x in (q, k, v))
    d_out = _cast(np.broadcast_to(d_out, (*batch, L, Ev)), dtype)
    lengths = np.broadcast_to(np.asarray(S if key_lengths is None else key_lengths), batch)
    phi, derivative = _FEATURES[feature_map], _FEATURE_DERIVATIVES[feature_map]
    work = _work(dtype)
    dq, dk, dv = np.zeros((*batch, L, E), work), np.zeros((*batch, S, E), work), np.zeros((*batch, S, Ev), work)
    for b in np.ndindex(*batch):
        phi_k = phi(k[b])  # (S, E)
        d_phi_k = np.zeros((S, E), work)
        for i in range(L):
            keys = np.array([j for j in range(S) if j < int(lengths[b]) and not (is_causal and j > i)], dtype=int)
            phi_q = phi(q[(*b, i)])  # (E,)
            w = phi_k[keys] @ phi_q  # (visible, E) x (E,) -> (visible,)
            den = np.sum(w) + work.type(eps)
            out_i = w @ v[b][keys] / den  # (visible,) x (visible, Ev) -> (Ev,)
            d_num = d_out[(*b, i)] / den  # (Ev,)
            dv[b][keys] += np.outer(w, d_num)  # (visible,) x (Ev,) -> (visible, Ev)
            dw = v[b][keys] @ d_num - d_num @ out_i  # (visible, Ev) x (Ev,) -> (visible,), minus d_den
            dq[(*b, i)] = dw @ phi_k[keys] * derivative(q[(*b, i)])  # (visible,) x (visible, E) -> (E,)
            d_phi_k[keys] += np.outer(dw, phi_q)  # (visible,) x (E,) -> (visible, E)
        dk[b] = d_phi_k * derivative(k[b])
    grads = {"q": dq, "k": dk, "v": dv}
    return {name: _summed_to(grad, shapes[name]).reshape(shapes[name]).astype(dtype) for name, grad in grads.items()}


def linear_recurrence_vjp(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    d_out: ArrayLike,
    *,
    feature_map: str = "elu",
    key_lengths: ArrayLike | None = None,
    update_rule: str = "gated",
    decay: ArrayLike | None = None,
    beta: ArrayLike | None = None,
    dtype: DTypeLike = np.float64,
) -> Gradients:
    """The gradients of sum(d_out * out), out = oracle.linear_recurrence(q, k, v, ...), one sequence at a time: its
    forward steps again, keeping each position's decayed state P_t = exp(g_t) S_{t-1} (or S_{t-1}), u_t and S_t,
    then the positions in reverse with dS the gradient reaching S_t from the reads at t and after:
        out_t = S_t^T phi(q_t):      dS += phi(q_t) d_out_t^T,   d phi(q_t) = S_t d_out_t
        S_t = P_t + phi(k_t) u_t^T:  d phi(k_t) = dS u_t,   du = dS^T phi(k_t),   dP = dS
        u_t = v_t:                   dv_t = du
        u_t = beta_t (v_t - P_t^T phi(k_t)):  dv_t = beta_t du,  d beta_t = du . (v_t - P_t^T phi(k_t)),
                                     dP -= phi(k_t) (beta_t du)^T,   d phi(k_t) -= P_t (beta_t du)
        P_t = exp(g_t) S_{t-1}:      d g_t[e] = sum over row e of dP * P_t,   dS = exp(g_t) dP  (else dS = dP)
    A hidden key (t >= key_lengths) passes dS on unchanged and gets zero gradients; phi' as for
    `linear_attention_vjp`.

    Returns:
        {"q", "k", "v", and "decay" and "beta" where the rule takes them}: each of its input's shape, in `dtype`
        (a decay of one per head, (..., L, 1), its row sums over E).
    """
    shapes = {name: np.shape(x) for name, x in (("q", q), ("k", k), ("v", v), ("decay", decay), ("beta", beta))
              if x is not None}
    gated, delta = update_rule in GATED, update_rule in DELTA
    q, k, v, g, rate, lengths = _recurrence_inputs(q, k, v, decay, beta, key_lengths, update_rule, dtype)
    (L, E), Ev, batch = q.shape[-2:], v.shape[-1], lengths.shape
    d_out = _cast(np.broadcast_to(d_out, (*batch, L, Ev)), dtype)
    phi, derivative = _FEATURES[feature_map], _FEATURE_DERIVATIVES[feature_map]
    work = _work(dtype)
    grads = {"q": np.zeros((*batch, L, E), work), "k": np.zeros((*batch, L, E), work),
             "v": np.zeros((*batch, L, Ev), work), "decay": np.zeros((*batch, L, E), work),
             "beta": np.zeros((*batch, L, 1), work)}
    for b in np.ndindex(*batch):
        seen = [t < int(lengths[b]) for t in range(L)]
        # 1) forward: each position's P_t, u_t and S_t (S_t = S_{t-1} at a hidden key)
        steps, state = [], np.zeros((E, Ev), work)
        for t in range(L):
            P = state if not (gated and seen[t]) else np.exp(g[b][t])[:, None] * state  # (E, Ev)
            u = v[b][t] if not delta else rate[b][t][0] * (v[b][t] - phi(k[b][t]) @ P)  # (Ev,)
            state = P + np.outer(phi(k[b][t]), u) if seen[t] else state  # (E, Ev)
            steps.append((P, u, state))
        # 2) backward, from the last position
        dS = np.zeros((E, Ev), work)
        for t in reversed(range(L)):
            P, u, S_t = steps[t]
            phi_q, phi_k = phi(q[b][t]), phi(k[b][t])  # (E,)
            dS = dS + np.outer(phi_q, d_out[b][t])  # (E,) x (Ev,) -> (E, Ev)
            grads["q"][b][t] = S_t @ d_out[b][t] * derivative(q[b][t])  # (E, Ev) x (Ev,) -> (E,)
            if not seen[t]:
                continue
            d_phi_k = dS @ u  # (E, Ev) x (Ev,) -> (E,)
            du = phi_k @ dS  # (E,) x (E, Ev) -> (Ev,)
            dP = dS
            grads["v"][b][t] = du
            if delta:
                grads["v"][b][t] = rate[b][t][0] * du
                grads["beta"][b][t] = du @ (v[b][t] - phi_k @ P)  # (Ev,) . (Ev,)
                dP = dP - np.outer(phi_k, rate[b][t][0] * du)  # (E,) x (Ev,)
                d_phi_k = d_phi_k - P @ (rate[b][t][0] * du)  # (E, Ev) x (Ev,) -> (E,)
            grads["k"][b][t] = d_phi_k * derivative(k[b][t])
            if gated:
                grads["decay"][b][t] = np.sum(dP * P, axis=1)  # d/dg_e of exp(g_e) S row e: (E,)
                dP = np.exp(g[b][t])[:, None] * dP  # (1 or E, 1) * (E, Ev)
            dS = dP
    return {name: _summed_to(grads[name], shape).reshape(shape).astype(dtype) for name, shape in shapes.items()}


def varlen_attention_vjp(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    d_out: ArrayLike,
    cu_seqlens_q: ArrayLike,
    cu_seqlens_k: ArrayLike,
    *,
    is_causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    dtype: DTypeLike = np.float64,
) -> Gradients:
    """The gradients of sum(d_out * out), out = oracle.varlen_attention(...): each sequence's sdpa_vjp with
    q_offset = S_n - L_n, laid back into the packed axes; a query past the last boundary, and a key past it, gets
    zero.

    Returns:
        {"q", "k", "v"}: each of its input's shape (Tq, H, E), (Tk, Hkv, E), (Tk, Hkv, Ev), in `dtype`.
    """
    q, k, v, d_out = (np.asarray(x) for x in (q, k, v, d_out))
    grads = {name: np.zeros(x.shape, _work(dtype)) for name, x in (("q", q), ("k", k), ("v", v))}
    for rows, keys in _sequences(cu_seqlens_q, cu_seqlens_k):
        q_n, k_n, v_n, d_out_n = (np.swapaxes(x, 0, 1) for x in (q[rows], k[keys], v[keys], d_out[rows]))
        grads_n = sdpa_vjp(q_n, k_n, v_n, d_out_n, is_causal=is_causal, scale=scale,
                           q_offset=k_n.shape[-2] - q_n.shape[-2], window=window, softcap=softcap,
                           enable_gqa=enable_gqa, dtype=dtype)  # (H, L_n, E), (Hkv, S_n, E), (Hkv, S_n, Ev)
        for name, place in (("q", rows), ("k", keys), ("v", keys)):
            grads[name][place] = np.swapaxes(grads_n[name], 0, 1)  # (L_n or S_n, heads, width)
    return {name: grad.astype(dtype) for name, grad in grads.items()}


def _elu_plus_one_derivative(x: np.ndarray) -> np.ndarray:
    """d/dx (elu(x) + 1): 1 for x > 0, e^x otherwise, entry by entry."""
    values = (1.0 if t > 0 else math.exp(t) for t in x.ravel().tolist())
    return np.fromiter(values, x.dtype, count=x.size).reshape(x.shape)


_FEATURE_DERIVATIVES: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "elu": _elu_plus_one_derivative,
    "relu": lambda x: (x > 0).astype(x.dtype),
    "identity": np.ones_like,
}


def _summed_to(grad: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """grad (the broadcast shape) summed over the axes along which an input of `shape` was broadcast."""
    extra = grad.ndim - len(shape)
    grad = np.sum(grad, axis=tuple(range(extra))) if extra > 0 else grad
    axes = tuple(axis for axis, n in enumerate(shape) if n == 1 and grad.shape[axis] != 1)
    return np.sum(grad, axis=axes, keepdims=True) if axes else grad


def _grouped_sum(grad: np.ndarray, group: int) -> np.ndarray:
    """(..., H, S, *) -> (..., Hkv, S, *): the sum over each group of `group` query heads, H = Hkv * group."""
    H = grad.shape[-3]
    return np.sum(grad.reshape(*grad.shape[:-3], H // group, group, *grad.shape[-2:]), axis=-3)


# --- the modules: the chain rule through the oracle's pieces ---------------------------------------------------

def multi_head_attention_vjp(
    state: Mapping[str, ArrayLike],
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    d_out: ArrayLike,
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
) -> Gradients:
    """The gradients of sum(d_out * out), out = oracle.multi_head_attention(state, q, k, v, mask, ...), head by
    head, backwards through its steps:
        3) out = mixed W_o^T + b_o:  d_mixed = d_out W_o,  dW_o = d_out^T mixed,  db_o = sum d_out;
        2) each head h (key/value head g = h // (H / Hkv)): d_out_h = d_mixed's columns of h, through `sdpa_vjp`
           at scale 1 / sqrt(d_k) (or `linear_attention_vjp`); with RoPE the rotation's adjoint, a turn by
           -positions: dq_h = rope(dq'_h, -positions); dk_g and dv_g summed over the query heads of g; with
           sinks (H,) in the state, d sinks[h] is head h's sdpa_vjp d sink; ALiBi's slopes (position "alibi") are
           constants of each head's logits, as in sdpa_vjp;
        1) each projection y = x W^T + b: dx = dy W, dW = dy^T x, db = sum dy.

    fused_bias: each Linear of the forward rounds x W^T + b once (else the product, then the sum), as the oracle's.

    Returns:
        {"q", "k", "v", and every state-dict name}: each of its input's shape, in `dtype`.
    """
    state = {name: _cast(value, dtype) for name, value in state.items()}
    shapes = {"q": np.shape(q), "k": np.shape(k), "v": np.shape(v)}
    inputs = {"q": _cast(q, dtype), "k": _cast(k, dtype), "v": _cast(v, dtype)}
    projected = {name: _linear(state, f"w_{name}", x, dtype, fused_bias)
                 for name, x in inputs.items()}  # (..., L | S, *)
    d_k = state["w_q.weight"].shape[0] // num_heads
    group = num_heads // (num_heads if num_kv_heads is None else num_kv_heads)
    if mask is not None:
        batch = np.broadcast_shapes(*(x.shape[:-2] for x in projected.values()))
        mask = np.broadcast_to(np.asarray(mask), (*batch, num_heads, projected["q"].shape[-2],
                                                  projected["k"].shape[-2]))

    # 3) through the output projection, from the heads' concatenation (the forward's, as stored)
    per_head = [head_keywords(state, h, num_heads, position) for h in range(num_heads)]  # sinks, slopes
    heads = [_head_out(projected, h, d_k, group, mask, rope_theta, attention, dtype, is_causal, per_head[h])
             for h in range(num_heads)]
    mixed = _cast(np.concatenate(heads, axis=-1), dtype)  # H x (..., L, d_k) -> (..., L, D)
    d_mixed, grads = _linear_vjp(state, "w_o", mixed, _cast(d_out, dtype), dtype)  # (..., L, D)

    # 2) through each head's attention (and RoPE), into the projections' gradients
    d_projected = {name: np.zeros(x.shape, _work(dtype)) for name, x in projected.items()}
    d_sinks = np.zeros(num_heads, _work(dtype))
    for h in range(num_heads):
        cols, kv_cols = slice(h * d_k, (h + 1) * d_k), slice(h // group * d_k, (h // group + 1) * d_k)
        d_head = _head_vjp(projected, h, d_k, group, mask, rope_theta, attention, d_mixed[..., cols], dtype,
                           is_causal, per_head[h])
        d_sinks[h] = d_head.get("sinks", 0.0)
        d_projected["q"][..., cols] += d_head["q"]
        d_projected["k"][..., kv_cols] += d_head["k"]  # a key/value head: the sum over its group's query heads
        d_projected["v"][..., kv_cols] += d_head["v"]

    # 1) through the input projections
    for name, x in inputs.items():
        dx, d_params = _linear_vjp(state, f"w_{name}", x, _cast(d_projected[name], dtype), dtype)
        grads |= d_params | {name: _summed_to(dx, shapes[name]).reshape(shapes[name])}
    grads |= {"sinks": d_sinks} if "sinks" in state else {}
    return {name: grad.astype(dtype) for name, grad in grads.items()}


def _head_inputs(projected: Mapping[str, np.ndarray], h: int, d_k: int, group: int,
                 rope_theta: float | None, dtype: DTypeLike) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Head h's q_h (..., L, d_k) and its key/value head's k_g, v_g (..., S, d_k), RoPE turned as the forward."""
    cols, kv_cols = slice(h * d_k, (h + 1) * d_k), slice(h // group * d_k, (h // group + 1) * d_k)
    q_h, k_g, v_g = projected["q"][..., cols], projected["k"][..., kv_cols], projected["v"][..., kv_cols]
    if rope_theta is not None:
        q_h = rope(q_h, np.arange(q_h.shape[-2]), theta=rope_theta, dtype=dtype)
        k_g = rope(k_g, np.arange(k_g.shape[-2]), theta=rope_theta, dtype=dtype)
    return q_h, k_g, v_g


def _head_out(projected: Mapping[str, np.ndarray], h: int, d_k: int, group: int, mask: np.ndarray | None,
              rope_theta: float | None, attention: str, dtype: DTypeLike, is_causal: bool = False,
              per_head: Mapping[str, np.ndarray] = MappingProxyType({})) -> np.ndarray:
    """Head h's out (..., L, d_k), as the oracle's forward computes and stores it (per_head: its sink and ALiBi
    slope, oracle.head_keywords)."""
    q_h, k_g, v_g = _head_inputs(projected, h, d_k, group, rope_theta, dtype)
    head_mask = None if mask is None else mask[..., h, :, :]  # (..., H, L, S) -> (..., L, S)
    return HEAD_ATTENTIONS[attention](q_h, k_g, v_g, head_mask, dtype, is_causal, **per_head)[0]


def _head_vjp(projected: Mapping[str, np.ndarray], h: int, d_k: int, group: int, mask: np.ndarray | None,
              rope_theta: float | None, attention: str, d_out_h: np.ndarray, dtype: DTypeLike,
              is_causal: bool = False, per_head: Mapping[str, np.ndarray] = MappingProxyType({})) -> Gradients:
    """Head h's gradients with respect to its slices of the projections: {"q" (..., L, d_k), "k", "v" (..., S,
    d_k)}, RoPE's turn undone (its adjoint, the turn by -positions); and "sinks" (), its sink's, where per_head
    (oracle.head_keywords) gives it one."""
    q_h, k_g, v_g = _head_inputs(projected, h, d_k, group, rope_theta, dtype)
    if attention == "linear":
        grads = linear_attention_vjp(q_h, k_g, v_g, d_out_h, is_causal=is_causal, dtype=dtype)
    else:
        head_mask = None if mask is None else mask[..., h, :, :]
        grads = sdpa_vjp(q_h, k_g, v_g, d_out_h, head_mask, is_causal=is_causal, scale=1.0 / math.sqrt(d_k),
                         dtype=dtype, **per_head)
    grads = {name: _cast(grad, dtype) for name, grad in grads.items()}
    if rope_theta is not None:  # a rotation's adjoint turns back
        for name in ("q", "k"):
            grads[name] = rope(grads[name], -np.arange(grads[name].shape[-2]), theta=rope_theta, dtype=dtype)
    return grads


def transformer_block_vjp(
    state: Mapping[str, ArrayLike],
    x: ArrayLike,
    d_out: ArrayLike,
    mask: ArrayLike | None = None,
    *,
    num_heads: int,
    norm_first: bool = False,
    activation: str = "relu",
    eps: float = 1e-5,
    norm: str = "layer",
    num_kv_heads: int | None = None,
    rope_theta: float | None = None,
    dtype: DTypeLike = np.float64,
    fused_bias: bool = True,
) -> Gradients:
    """The gradients of sum(d_out * out), out = oracle.transformer_block(state, x, mask, ...), backwards through
    its steps (each residual passes its gradient on unchanged, and adds its branch's):
        post-LN: d_r2 = LN_2'(d_out), d_y1 = d_r2 + FFN'(d_r2), d_r1 = LN_1'(d_y1), dx = d_r1 + MHA'(d_r1);
        pre-LN:  d_x1 = d_out + LN_2'(FFN'(d_out)), dx = d_x1 + LN_1'(MHA'(d_x1));
    MHA' the sum of `multi_head_attention_vjp`'s dq, dk and dv (self-attention); LayerNorm's
    dx = (d_hat - mean(d_hat) - x_hat mean(d_hat x_hat)) / sigma and RMSNorm's dx = (d_hat - x_hat
    mean(d_hat x_hat)) / rms, d_hat = dy * weight; FFN' through each Linear and the activation's derivative
    (relu: x > 0; gelu: Phi(x) + x phi(x); SwiGLU: dg = dh u silu'(g), du = dh silu(g),
    silu'(g) = sigmoid(g) (1 + g (1 - sigmoid(g)))).

    fused_bias: as for multi_head_attention_vjp.

    Returns:
        {"x", and every state-dict name}: each of its input's shape, in `dtype`.
    """
    normalize = {"layer": _layer_norm, "rms": _rms_norm}[norm]
    state = {name: _cast(value, dtype) for name, value in state.items()}
    attn = {name.removeprefix("attn."): value for name, value in state.items() if name.startswith("attn.")}
    shape, x, d_out = np.shape(x), _cast(x, dtype), _cast(d_out, dtype)
    options = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "rope_theta": rope_theta, "dtype": dtype,
               "fused_bias": fused_bias}
    grads: Gradients = {}

    def attend(y: np.ndarray, dy: np.ndarray) -> np.ndarray:  # self-attention's gradient: dq + dk + dv
        found = multi_head_attention_vjp(attn, y, y, y, dy, mask, **options)
        grads.update({f"attn.{name}": grad for name, grad in found.items() if name not in ("q", "k", "v")})
        return _cast(sum(found[name].astype(_work(dtype)) for name in ("q", "k", "v")), dtype)

    def norm_vjp(name: str, y: np.ndarray, dy: np.ndarray) -> np.ndarray:
        dx, d_params = _norm_vjp(state, name, y, dy, eps, dtype)
        grads.update(d_params)
        return dx

    def feed_forward(y: np.ndarray, dy: np.ndarray) -> np.ndarray:
        dx, d_params = _feed_forward_vjp(state, activation, y, dy, dtype, fused_bias)
        grads.update(d_params)
        return dx

    if norm_first:  # pre-LN: x1 = x + MHA(LN_1(x)), out = x1 + FFN(LN_2(x1))
        n1 = normalize(state, "norm1", x, eps, dtype)
        h = _cast(multi_head_attention(attn, n1, n1, n1, mask, **options)[0], dtype)
        x1 = _cast(x + h, dtype)
        n2 = normalize(state, "norm2", x1, eps, dtype)
        d_x1 = _cast(d_out + norm_vjp("norm2", x1, feed_forward(n2, d_out)), dtype)
        dx = _cast(d_x1 + norm_vjp("norm1", x, attend(n1, d_x1)), dtype)
    else:  # post-LN: r1 = x + MHA(x), y1 = LN_1(r1), r2 = y1 + FFN(y1), out = LN_2(r2)
        h = _cast(multi_head_attention(attn, x, x, x, mask, **options)[0], dtype)
        r1 = _cast(x + h, dtype)
        y1 = normalize(state, "norm1", r1, eps, dtype)
        f = _feed_forward(state, activation, y1, dtype, fused_bias)
        r2 = _cast(y1 + f, dtype)
        d_r2 = norm_vjp("norm2", r2, d_out)
        d_y1 = _cast(d_r2 + feed_forward(y1, d_r2), dtype)
        d_r1 = norm_vjp("norm1", r1, d_y1)
        dx = _cast(d_r1 + attend(x, d_r1), dtype)
    grads["x"] = _summed_to(dx, shape).reshape(shape)
    return {name: grads[name].astype(dtype) for name in ("x", *state)}


def _linear_vjp(state: Mapping[str, np.ndarray], name: str, x: np.ndarray, dy: np.ndarray,
                dtype: DTypeLike) -> tuple[np.ndarray, Gradients]:
    """y = x W^T + b: dx = dy W (..., in), dW = sum over the leading axes of dy^T x (out, in), db = sum dy (out,);
    each stored in dtype."""
    weight = state[f"{name}.weight"]
    dx = _cast(np.einsum("...o,oi->...i", dy, weight), dtype)  # (..., out) x (out, in) -> (..., in)
    rows = np.broadcast_to(x, (*dy.shape[:-1], x.shape[-1])).reshape(-1, x.shape[-1])  # (n, in)
    d_weight = dy.reshape(-1, dy.shape[-1]).T @ rows  # (out, n) x (n, in) -> (out, in)
    grads = {f"{name}.weight": _cast(d_weight, dtype)}
    if f"{name}.bias" in state:
        grads[f"{name}.bias"] = _cast(np.sum(dy.reshape(-1, dy.shape[-1]), axis=0), dtype)  # (out,)
    return dx, grads


def _norm_vjp(state: Mapping[str, np.ndarray], name: str, x: np.ndarray, dy: np.ndarray, eps: float,
              dtype: DTypeLike) -> tuple[np.ndarray, Gradients]:
    """LayerNorm (with name.bias) or RMSNorm (without) over the last axis: x_hat = (x - mean) / sigma or
    x / rms, y = x_hat * weight (+ bias); d_hat = dy * weight, dweight = sum dy x_hat, dbias = sum dy, and
    dx = (d_hat - mean(d_hat) - x_hat mean(d_hat x_hat)) / sigma, or (d_hat - x_hat mean(d_hat x_hat)) / rms."""
    d_model, layer = x.shape[-1], f"{name}.bias" in state
    centred = x - np.sum(x, axis=-1, keepdims=True) / d_model if layer else x  # (..., D)
    scale = np.sqrt(np.sum(centred * centred, axis=-1, keepdims=True) / d_model + eps)  # sigma or rms: (..., 1)
    x_hat = centred / scale
    d_hat = dy * state[f"{name}.weight"]
    d_centred = d_hat - x_hat * np.sum(d_hat * x_hat, axis=-1, keepdims=True) / d_model
    if layer:
        d_centred = d_centred - np.sum(d_hat, axis=-1, keepdims=True) / d_model
    grads = {f"{name}.weight": _cast(np.sum((dy * x_hat).reshape(-1, d_model), axis=0), dtype)}
    if layer:
        grads[f"{name}.bias"] = _cast(np.sum(dy.reshape(-1, d_model), axis=0), dtype)
    return _cast(d_centred / scale, dtype), grads


def _feed_forward(state: Mapping[str, np.ndarray], activation: str, y: np.ndarray, dtype: DTypeLike,
                  fused: bool) -> np.ndarray:
    """The block's FFN(y), as the oracle's forward computes and stores it."""
    if activation == "swiglu":
        gate, up = (_linear(state, f"ffn.{name}", y, dtype, fused) for name in ("w_gate", "w_up"))
        return _linear(state, "ffn.w_down", _cast(_activation("silu", gate, dtype) * up, dtype), dtype, fused)
    return _linear(state, "ffn.3", _activation(activation, _linear(state, "ffn.0", y, dtype, fused), dtype), dtype,
                   fused)


def _feed_forward_vjp(state: Mapping[str, np.ndarray], activation: str, y: np.ndarray, dy: np.ndarray,
                      dtype: DTypeLike, fused: bool) -> tuple[np.ndarray, Gradients]:
    """FFN's gradient with respect to y (..., D), and its parameters'."""
    if activation == "swiglu":
        gate, up = (_linear(state, f"ffn.{name}", y, dtype, fused) for name in ("w_gate", "w_up"))
        silu = _activation("silu", gate, dtype)
        dh, grads = _linear_vjp(state, "ffn.w_down", _cast(silu * up, dtype), dy, dtype)  # (..., F)
        sigmoid = 1 / (1 + np.exp(-gate))
        d_gate = _cast(dh * up * sigmoid * (1 + gate * (1 - sigmoid)), dtype)  # silu'(g)
        d_up = _cast(dh * silu, dtype)
        dx_gate, grads_gate = _linear_vjp(state, "ffn.w_gate", y, d_gate, dtype)
        dx_up, grads_up = _linear_vjp(state, "ffn.w_up", y, d_up, dtype)
        return _cast(dx_gate + dx_up, dtype), grads | grads_gate | grads_up
    a = _linear(state, "ffn.0", y, dtype, fused)  # (..., F)
    dh, grads = _linear_vjp(state, "ffn.3", _activation(activation, a, dtype), dy, dtype)
    dx, grads_0 = _linear_vjp(state, "ffn.0", y, _cast(dh * _ACTIVATION_DERIVATIVES[activation](a), dtype), dtype)
    return dx, grads | grads_0


def _gelu_derivative(x: np.ndarray) -> np.ndarray:
    """d/dx x Phi(x) = Phi(x) + x phi(x), entry by entry."""
    values = ((1 + math.erf(t / math.sqrt(2))) / 2 + t * math.exp(-t * t / 2) / math.sqrt(2 * math.pi)
              for t in x.ravel().tolist())
    return np.fromiter(values, x.dtype, count=x.size).reshape(x.shape)


_ACTIVATION_DERIVATIVES: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "relu": lambda x: (x > 0).astype(x.dtype),
    "gelu": _gelu_derivative,
}
