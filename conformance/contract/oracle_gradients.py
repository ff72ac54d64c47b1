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
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from attention_np.common.mods import from_keywords
from attention_np.common.records import Structure

from .oracle import _FEATURES, _cast, _visible_keys, _work

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
    dtype: DTypeLike = np.float64,
) -> Gradients:
    """The gradients of sum(d_out * out), out = oracle.sdpa(q, k, v, mask, ...), one query row i at a time over
    the keys j it sees (P the row's softmax, R_j = q_i . k_j * scale, C_j = softcap tanh(R_j / softcap)):
        dv_j += P_j dO_i,   dP_j = dO_i . v_j,   dS_j = P_j (dP_j - sum_j' P_j' dP_j'),   dbias_ij = dS_j,
        dR_j = dS_j (1 - tanh^2(R_j / softcap)) (dS_j without softcap),
        dq_i = scale sum_j dR_j k_j,   dk_j += scale dR_j q_i.
    A query that sees no key adds nothing; a key no query sees gets zero. The gradient of a broadcast input is
    summed over its broadcast axes; with enable_gqa a key/value head's over the query heads of its group.

    Args:
        q, k, v, mask and the keywords: as for oracle.sdpa; mask_mod and score_mod are not supported (raise).
        d_out: the cotangent (..., L, Ev), out's shape.

    Returns:
        {"q", "k", "v", and "bias" where bias is given}: each of its input's shape, in `dtype`.
    """
    if mask_mod is not None or score_mod is not None:
        raise NotImplementedError("sdpa_vjp: the oracle's gradients take no mask_mod or score_mod (the gradient "
                                  "checks of the mods compare central differences instead)")
    shapes = {"q": np.shape(q), "k": np.shape(k), "v": np.shape(v)} | ({} if bias is None else {"bias": np.shape(bias)})
    q, k, v = _cast(q, dtype), _cast(k, dtype), _cast(v, dtype)
    group = q.shape[-3] // k.shape[-3] if enable_gqa else 1
    if enable_gqa:  # each query head reads its own copy of the key/value head h // group
        k, v = (np.repeat(x, group, axis=-3) for x in (k, v))
    (L, E), (S, Ev) = q.shape[-2:], v.shape[-2:]
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    expanded = {"q": q.shape, "k": k.shape, "v": v.shape}  # the shapes before broadcasting (k, v per query head)
    q, k, v = (np.broadcast_to(x, (*batch, *x.shape[-2:])) for x in (q, k, v))
    d_out = _cast(np.broadcast_to(d_out, (*batch, L, Ev)), dtype)
    mask = np.broadcast_to(np.ones((L, S), bool) if mask is None else np.asarray(mask) != 0, (*batch, L, S))
    bias_ = np.broadcast_to(np.asarray(0.0 if bias is None else bias, _work(dtype)), (*batch, L, S))
    scale = 1.0 / math.sqrt(E) if scale is None else float(scale)
    offsets = np.broadcast_to(np.asarray(q_offset), batch)
    lengths = np.broadcast_to(np.asarray(S if key_lengths is None else key_lengths), batch)

    work = _work(dtype)
    dq, dk, dv = np.zeros((*batch, L, E), work), np.zeros((*batch, S, E), work), np.zeros((*batch, S, Ev), work)
    dbias = np.zeros((*batch, L, S), work)
    for b in np.ndindex(*batch):
        by_position, _ = from_keywords(Structure(
            is_causal=is_causal, q_offset=int(offsets[b]), window=window,
            key_lengths=None if key_lengths is None else int(lengths[b])))
        for i in range(L):
            keys = _visible_keys(i, mask[(*b, i)], bias_[(*b, i)], by_position)
            if not len(keys):  # no key seen: out is zeros whatever q, k and v are, so no gradient
                continue
            row = _row_vjp(q[(*b, i)], k[b][keys], v[b][keys], d_out[(*b, i)], bias_[(*b, i)][keys], scale,
                           softcap, dtype)
            dq[(*b, i)] = row.dq
            dk[b][keys] += row.dk
            dv[b][keys] += row.dv
            dbias[(*b, i)][keys] = row.ds
    grads = {"q": _summed_to(dq, expanded["q"]), "k": _summed_to(dk, expanded["k"]),
             "v": _summed_to(dv, expanded["v"])}
    if enable_gqa:  # the query heads of a group read one key/value head: its gradient is their sum
        grads["k"], grads["v"] = (_grouped_sum(grads[name], group) for name in ("k", "v"))
    if bias is not None:
        grads["bias"] = _summed_to(dbias, shapes["bias"])
    return {name: grad.reshape(shapes[name]).astype(dtype) for name, grad in grads.items()}


class _RowGradients(NamedTuple):
    """One query row's gradients over its n visible keys."""

    dq: np.ndarray  # (E,)
    dk: np.ndarray  # (n, E)
    dv: np.ndarray  # (n, Ev)
    ds: np.ndarray  # (n,): dS, the bias's gradient


def _row_vjp(q_i: np.ndarray, k: np.ndarray, v: np.ndarray, d_out_i: np.ndarray, bias_row: np.ndarray,
             scale: float, softcap: float | None, dtype: DTypeLike) -> _RowGradients:
    """One query row of sdpa_vjp over its n visible keys: k (n, E), v (n, Ev), bias_row (n,); each tensor a
    module stores (P, dP, dS, the gradients) rounded to dtype."""
    work = q_i.dtype.type
    raw = k @ q_i * work(scale)  # R_j = q_i . k_j * scale: (n, E) x (E,) -> (n,)
    capped = raw if softcap is None else work(softcap) * np.tanh(raw / work(softcap))  # C_j
    logits = capped + bias_row
    exp = np.exp(logits - np.max(logits))
    p = _cast(exp / np.sum(exp), dtype)  # P_j, stored as the forward stores the weights
    dv = _cast(np.outer(p, d_out_i), dtype)  # P_j dO_i: (n,) x (Ev,) -> (n, Ev)
    dp = _cast(v @ d_out_i, dtype)  # dO_i . v_j: (n, Ev) x (Ev,) -> (n,)
    ds = _cast(p * (dp - np.sum(p * dp)), dtype)  # the softmax's vjp
    dr = ds if softcap is None else _cast(ds * (1 - np.tanh(raw / work(softcap)) ** 2), dtype)  # tanh's derivative
    dq = dr @ k * work(scale)  # scale sum_j dR_j k_j: (n,) x (n, E) -> (E,)
    dk = np.outer(dr, q_i) * work(scale)  # scale dR_j q_i: (n,) x (E,) -> (n, E)
    return _RowGradients(dq, dk, dv, ds)


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

    Returns:
        {"q", "k", "v"}: each of its input's shape, in `dtype`.
    """
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
