"""Kernelised linear attention (Katharopoulos et al., 2020, "Transformers are RNNs"), in NumPy.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

Softmax attention weighs key j for query i by exp(q_i . k_j); linear attention by a kernel phi(q_i) . phi(k_j)
with a feature map phi, and no scale, mask or softmax. The sums over the keys then leave the queries:
    out_i = phi(q_i)^T (sum_j phi(k_j) v_j^T) / (phi(q_i)^T sum_j phi(k_j) + eps)
          = phi(q_i)^T A / (phi(q_i) . z + eps),     A = phi(K)^T V (..., E, Ev),  z = phi(K)^T 1 (..., E)
so attention costs O(n E Ev) and nothing of size L * S exists. Causal attention (j <= i) makes A and z prefix
sums A_i, z_i over the keys: all of them at once (the parallel form, (..., L, E, Ev)), chunk by chunk (the
quadratic masked form inside a chunk, the state (A, z) of the earlier chunks carried across), or one position at
a time (the recurrent form, linear_attention_step): the same numbers three ways.

The backward pass is derived by hand (linear_attention_vjp). With num_i = phi(q_i)^T A, den_i = phi(q_i) . z + eps
and out_i = num_i / den_i:
    d_num = d_out / den,  d_den = -sum(d_out * out) / den                         (..., L, Ev), (..., L, 1)
    d phi(q_i) = A d_num_i + d_den_i z,   dA = phi(Q)^T d_num,   dz = phi(Q)^T d_den
    d phi(k_j) = dA v_j + dz,   dv_j = dA^T phi(k_j)
then through phi: dq = d phi(q) * phi'(q), dk = d phi(k) * phi'(k). In the causal form A_i and z_i are prefix
sums, so the gradient reaching key j's term is the sum of dA_i and dz_i over the queries i >= j: suffix sums
(reverse cumulative sums), computed chunk by chunk in reverse with the chunked form.

The update rules of ONNX's LinearAttention (opset 27) change how the state S_i (..., E, Ev) takes key i; they are
recurrences over the positions (causal only) and read S_i with no normaliser, out_i = phi(q_i)^T S_i:
    "linear"       S_i = S_{i-1} + phi(k_i) v_i^T                      (the sums above, with the normaliser)
    "gated"        S_i = exp(g_i) S_{i-1} + phi(k_i) v_i^T
    "delta"        S_i = S_{i-1} + phi(k_i) u_i^T,   u_i = beta_i (v_i - S_{i-1}^T phi(k_i))
    "gated_delta"  S_i = P_i + phi(k_i) u_i^T,       u_i = beta_i (v_i - P_i^T phi(k_i)),  P_i = exp(g_i) S_{i-1}
with g_i the log-space decay (one per head, or one per key dimension: a row scale of S) and beta_i the update
rate. They run position by position (_rule_step), or chunk by chunk (_rule_chunk: unrolled inside a chunk, a masked
quadratic form with the decays between positions, and for the delta rules a unit lower triangular system, the UT
transform of the WY representation; the state carried across); the backward pass of both runs the recurrence in
reverse, the states S_{i-1} recomputed by the forward loop (_recurrence_backward).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from attention_np.common import validation
from attention_np.common.records import LinearOptions

from .functional import _dtypes
from .primitives import _integers, _sum_to

# the feature maps of validation.FEATURE_MAPS: (phi(x), phi'(x)); elu(x) + 1 is x + 1 for x > 0, exp(x) otherwise
# (exp of min(x, 0): the branch not taken never overflows)
FEATURE_MAPS: dict[str, tuple[Callable, Callable]] = {
    "elu": (lambda x: np.where(x > 0, x + 1, np.exp(np.minimum(x, 0))),
            lambda x: np.where(x > 0, 1, np.exp(np.minimum(x, 0)))),
    "relu": (lambda x: np.maximum(x, 0), lambda x: (x > 0).astype(x.dtype)),
    "identity": (lambda x: x, lambda x: np.ones_like(x)),
}


def linear_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    feature_map: str = "elu",
    is_causal: bool = False,
    key_lengths: np.ndarray | None = None,
    eps: float = 1e-6,
    chunk: int | None = None,
    update_rule: str = "linear",
    decay: np.ndarray | None = None,
    beta: np.ndarray | None = None,
) -> np.ndarray:
    """out_i = phi(q_i)^T (sum_j phi(k_j) v_j^T) / (phi(q_i)^T sum_j phi(k_j) + eps), the sums over the keys
    query i sees (all, or j <= i with is_causal).

    Args:
        q: queries (..., L, E).
        k: keys (..., S, E).
        v: values (..., S, Ev).
        feature_map: phi: "elu" (elu(x) + 1), "relu" (max(x, 0)) or "identity" (x).
        is_causal: query i sees keys j <= i; needs L == S.
        key_lengths: integer array broadcasting to (...): keys j >= key_lengths contribute nothing.
        eps: a positive number added to the normaliser; a query that sees no key gets 0 / eps = 0.
        chunk: None, or a positive int: causal attention chunk by chunk (quadratic inside a chunk, the state
            carried across), in O(L / chunk E Ev + chunk^2) memory; None: the prefix sums (..., L, E, Ev).
            Non-causal attention ignores it. The rules with decay or beta: None, one position at a time; an int,
            chunk by chunk (quadratic inside a chunk, the delta rules' triangular solve).
        update_rule: how the state S_i takes key i (ONNX LinearAttention's): "linear" (the sums above), or, causal
            only and read with no normaliser (out_i = phi(q_i)^T S_i, eps unused), "gated"
            (S_i = exp(g_i) S_{i-1} + phi(k_i) v_i^T), "delta" (S_i = S_{i-1} + phi(k_i) u_i^T with
            u_i = beta_i (v_i - S_{i-1}^T phi(k_i))) or "gated_delta" (both, u_i read off the decayed state).
        decay: g, the log-space decay of "gated" and "gated_delta": (..., S, 1), one per head, or (..., S, E), one
            per key dimension; None for the other rules.
        beta: the update rate of "delta" and "gated_delta": (..., S, 1); None for the other rules.

    Returns:
        out (..., L, Ev) in q's dtype, computed in at least float32.
    """
    p = _problem(q, k, v, LinearOptions(feature_map=feature_map, is_causal=is_causal, key_lengths=key_lengths,
                                        eps=eps, chunk=chunk, update_rule=update_rule, decay=decay, beta=beta))
    num, den = _form(p)[0](p)
    return (num / den).astype(q.dtype, copy=False)


def linear_attention_vjp(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    feature_map: str = "elu",
    is_causal: bool = False,
    key_lengths: np.ndarray | None = None,
    eps: float = 1e-6,
    chunk: int | None = None,
    update_rule: str = "linear",
    decay: np.ndarray | None = None,
    beta: np.ndarray | None = None,
) -> tuple[np.ndarray, Callable]:
    """d_num = d_out / den,  d_den = -sum(d_out * out) / den,  d phi(Q) = d_num A^T + d_den z^T,
    dA = phi(Q)^T d_num,  dz = phi(Q)^T d_den,  d phi(K) = V dA^T + dz,  dV = phi(K) dA,
    dQ = d phi(Q) * phi'(Q),  dK = d phi(K) * phi'(K); causal: dA and dz as suffix sums over the queries; the
    rules with decay or beta: the recurrence in reverse.

    Args:
        q, k, v, feature_map, is_causal, key_lengths, eps, chunk, update_rule, decay, beta: as for
            linear_attention.

    Returns:
        out (..., L, Ev) and pullback(d_out (..., L, Ev)) -> (dq, dk, dv), then d_decay if decay was given and
        d_beta if beta was given, each gradient summed to its input's shape and in its dtype; hidden keys
        (key_lengths) get zero dk, dv, d_decay and d_beta.
    """
    p = _problem(q, k, v, LinearOptions(feature_map=feature_map, is_causal=is_causal, key_lengths=key_lengths,
                                        eps=eps, chunk=chunk, update_rule=update_rule, decay=decay, beta=beta))
    forward, backward = _form(p)
    num, den = forward(p)
    out = (num / den).astype(q.dtype, copy=False)

    def pullback(d_out: np.ndarray) -> tuple[np.ndarray, ...]:
        validation.cotangent("d_out", d_out.shape, out.shape, _dtypes(d_out=d_out, out=out))
        # 1) through out = num / den
        d_num = d_out.astype(p.work, copy=False) / den  # (..., L, Ev)
        d_den = -np.sum(d_num * (num / den), axis=-1, keepdims=True)  # -sum(d_out * out) / den: (..., L, 1)
        # 2) through the sums (or the recurrence) of the form, to phi(Q), phi(K), V and the gates given
        d_phi_q, d_phi_k, dv, *d_gates = backward(p, d_num, d_den)
        # 3) through phi, and the hidden keys' masks
        d_phi = FEATURE_MAPS[p.feature_map][1]
        dq = d_phi_q * d_phi(p.q)  # (..., L, E)
        dk = d_phi_k * d_phi(p.k)  # (..., S, E)
        grads = [dq, dk, dv, *d_gates]
        if p.keep is not None:
            grads[1:] = [np.where(p.keep, d, 0) for d in grads[1:]]
        inputs = [x for x in (q, k, v, decay, beta) if x is not None]
        return tuple(_sum_to(d, x.shape).astype(x.dtype, copy=False) for d, x in zip(grads, inputs, strict=True))

    return out, pullback


def linear_attention_state(batch_shape: tuple[int, ...], E: int, Ev: int, *, dtype: np.dtype | None = None,
                           update_rule: str = "linear") -> tuple[np.ndarray, np.ndarray | None]:
    """(S, z) = (0, 0): the recurrent form's state before the first position, S = sum_j phi(k_j) v_j^T and
    z = sum_j phi(k_j) over the positions seen; (S, None) = (0, None) for the rules with decay or beta, which
    have no normaliser.

    Args:
        batch_shape: the inputs' leading axes (...), a tuple of non-negative ints.
        E: the query/key width.
        Ev: the value width.
        dtype: the state's floating dtype, the dtype the steps compute in; None: float32.
        update_rule: the rule the steps will run, as for linear_attention.

    Returns:
        S (..., E, Ev) and z (..., E), zeros; z None for the rules other than "linear".
    """
    batch = validation.linear_state_size(batch_shape, E, Ev)
    validation.update_rule(update_rule)
    dtype = np.dtype(np.float32 if dtype is None else dtype)
    validation.same_floating_dtype({"dtype": (str(dtype), np.issubdtype(dtype, np.floating))})
    S = np.zeros((*batch, E, Ev), dtype)
    return S, (np.zeros((*batch, E), dtype) if update_rule == "linear" else None)


def linear_attention_step(
    q_t: np.ndarray,
    k_t: np.ndarray,
    v_t: np.ndarray,
    state: tuple[np.ndarray, np.ndarray | None],
    *,
    feature_map: str = "elu",
    eps: float = 1e-6,
    update_rule: str = "linear",
    decay: np.ndarray | None = None,
    beta: np.ndarray | None = None,
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray | None]]:
    """S' = S + phi(k_t) v_t^T,  z' = z + phi(k_t),  out_t = phi(q_t)^T S' / (phi(q_t) . z' + eps): one position of
    causal linear attention, the current key included (j <= i); the rules with decay or beta:
    S' = exp(g_t) S + phi(k_t) u_t^T,  out_t = phi(q_t)^T S'.

    Args:
        q_t: the query (..., E).
        k_t: the key (..., E).
        v_t: the value (..., Ev).
        state: (S (..., E, Ev), z (..., E)) from linear_attention_state or the previous step; never changed.
            (S, None) for the rules other than "linear".
        feature_map: as for linear_attention.
        eps: as for linear_attention.
        update_rule: as for linear_attention.
        decay: g_t (..., 1) or (..., E) of "gated" and "gated_delta"; None for the other rules.
        beta: beta_t (..., 1) of "delta" and "gated_delta"; None for the other rules.

    Returns:
        out_t (..., Ev) in q_t's dtype and the new state (S', z') in the state's dtype, which the step computes in
        (at least the inputs' working dtype: float32 for float16 and bfloat16 inputs).
    """
    validation.linear_state_pair(state)
    S, z = state
    validation.update_rule(update_rule)
    validation.linear_state_rule(update_rule, z is not None)
    gates = {name: x for name, x in (("decay", decay), ("beta", beta)) if x is not None}
    validation.same_floating_dtype(_dtypes(q_t=q_t, k_t=k_t, v_t=v_t, **gates))
    validation.linear_step(q_t.shape, k_t.shape, v_t.shape, S.shape, S.shape[:-1] if z is None else z.shape)
    validation.linear_gates(update_rule, *(None if x is None else x.shape for x in (decay, beta)), S.shape[:-2],
                            None, S.shape[-2])
    validation.linear_options(feature_map, eps)
    work = np.promote_types(q_t.dtype, np.float32)
    validation.linear_state_dtype(_dtypes(S=S, **({} if z is None else {"z": z})), S.dtype.itemsize * 8, str(work),
                                  work.itemsize * 8)
    phi = FEATURE_MAPS[feature_map][0]
    q, k, v, g, b = (None if x is None else x.astype(S.dtype, copy=False) for x in (q_t, k_t, v_t, decay, beta))
    phi_q, phi_k = phi(q), phi(k)  # (..., E)
    if update_rule != "linear":  # new arrays too: decay, then the update, then the read, no normaliser
        out, S = _rule_step(S, phi_q, phi_k, v, g, b)
        return out.astype(q_t.dtype, copy=False), (S, None)
    # 1) the state takes the current position: new arrays, the caller's state stays as it was
    S = S + phi_k[..., :, None] * v[..., None, :]  # (..., E, 1) x (..., 1, Ev)
    z = z + phi_k  # (..., E)
    # 2) the query reads it
    num = (phi_q[..., None, :] @ S)[..., 0, :]  # (..., 1, E) x (..., E, Ev) -> (..., Ev)
    den = np.sum(phi_q * z, axis=-1, keepdims=True) + float(eps)  # (..., 1)
    return (num / den).astype(q_t.dtype, copy=False), (S, z)


def _rule_step(S: np.ndarray, phi_q: np.ndarray, phi_k: np.ndarray, v: np.ndarray, g: np.ndarray | None,
               beta: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """One position of the rules with decay or beta (g None: no decay; beta None: no delta correction):
    P = exp(g) S,  u = v or beta (v - P^T phi(k)),  S' = P + phi(k) u^T,  out = phi(q)^T S'."""
    if g is not None:
        S = np.exp(g)[..., :, None] * S  # (..., E or 1, 1) * (..., E, Ev): the decay, before the update
    if beta is not None:  # the delta rule: write the error of what the decayed state recalls for phi(k)
        v = beta * (v - (phi_k[..., None, :] @ S)[..., 0, :])  # (..., 1) * ((..., 1, E) x (..., E, Ev) -> (..., Ev))
    S = S + phi_k[..., :, None] * v[..., None, :]  # (..., E, 1) x (..., 1, Ev)
    return (phi_q[..., None, :] @ S)[..., 0, :], S  # (..., 1, E) x (..., E, Ev) -> (..., Ev)


class _Problem(NamedTuple):
    """One call's checked inputs in the working dtype: q, k (for phi'), phi(Q), phi(K) and V with the hidden keys'
    rows zeroed, the gates of the update rule (None where it takes none; the hidden keys' zeroed, so that they
    leave the state as it was), `keep` (..., S, 1) where keys are visible (None: all), and the options."""

    feature_map: str  # the name of phi
    is_causal: bool
    chunk: int | None
    eps: float  # a Python float: no promotion
    update_rule: str
    q: np.ndarray  # (..., L, E)
    k: np.ndarray  # (..., S, E)
    phi_q: np.ndarray  # (..., L, E)
    phi_k: np.ndarray  # (..., S, E), hidden keys' rows zeroed
    v: np.ndarray  # (..., S, Ev), hidden keys' rows zeroed
    decay: np.ndarray | None  # g (..., S, 1) or (..., S, E), hidden keys' rows zeroed (exp(0) = 1)
    beta: np.ndarray | None  # (..., S, 1)
    keep: np.ndarray | None  # (..., S, 1): True where a key is visible (None: all)
    batch: tuple  # the leading axes (...)
    L: int
    work: np.dtype  # the working dtype: at least float32


def _problem(q: np.ndarray, k: np.ndarray, v: np.ndarray, options: LinearOptions) -> _Problem:
    """The checks of scaled_dot_product_attention that apply (shapes, dtypes, key_lengths), linear attention's
    own (feature_map, eps, chunk, L == S when causal, the update rule and its gates), then phi(Q) and phi(K) in
    the working dtype."""
    batch = validation.attention_batch(q.shape, k.shape, v.shape)
    gates = {name: x for name, x in (("decay", options.decay), ("beta", options.beta)) if x is not None}
    validation.same_floating_dtype(_dtypes(q=q, k=k, v=v, **gates))
    validation.linear_options(options.feature_map, options.eps, options.chunk)
    L, S = q.shape[-2], k.shape[-2]
    validation.linear_gates(options.update_rule, *(None if x is None else x.shape for x in (options.decay,
                                                                                            options.beta)),
                            batch, S, k.shape[-1])
    validation.linear_rule_causal(options.update_rule, options.is_causal)
    if options.is_causal:
        validation.linear_causal(L, S)
    work = np.promote_types(q.dtype, np.float32)  # float16, bfloat16: in float32
    q, k, v = (x.astype(work, copy=False) for x in (q, k, v))
    decay, beta = (None if x is None else x.astype(work, copy=False) for x in (options.decay, options.beta))
    phi = FEATURE_MAPS[options.feature_map][0]
    phi_k, keep = phi(k), None
    if options.key_lengths is not None:  # hidden keys add nothing to either sum: their rows zeroed
        key_lengths = _integers(options.key_lengths, "key_lengths", batch)
        keep = np.arange(S)[:, None] < key_lengths[..., None, None]  # (S, 1) against (..., 1, 1) -> (..., S, 1)
        phi_k, v = np.where(keep, phi_k, 0), np.where(keep, v, 0)  # (..., S, E), (..., S, Ev)
        decay = None if decay is None else np.where(keep, decay, 0)  # no decay at a hidden key: S stays
    return _Problem(feature_map=options.feature_map, is_causal=options.is_causal, chunk=options.chunk,
                    eps=float(options.eps), update_rule=options.update_rule, q=q, k=k, phi_q=phi(q), phi_k=phi_k,
                    v=v, decay=decay, beta=beta, keep=keep, batch=batch, L=L, work=work)


def _form(p: _Problem) -> tuple[Callable, Callable]:
    """The (forward, backward) pair of the call's form: global sums, prefix sums, chunks, or the recurrence."""
    if p.update_rule != "linear":  # the chunks' backward pass is the recurrence's: the same function
        return (_recurrence if p.chunk is None else _rule_chunks), _recurrence_backward
    if not p.is_causal:
        return _global, _global_backward
    return (_prefix, _prefix_backward) if p.chunk is None else (_chunked, _chunked_backward)


def _global(p: _Problem) -> tuple[np.ndarray, np.ndarray]:
    """Non-causal: num = phi(Q) A, den = phi(Q) z + eps, with A = phi(K)^T V and z = phi(K)^T 1."""
    A = np.swapaxes(p.phi_k, -1, -2) @ p.v  # (..., E, S) x (..., S, Ev) -> (..., E, Ev)
    z = np.sum(p.phi_k, axis=-2)  # (..., S, E) -> (..., E)
    num = p.phi_q @ A  # (..., L, E) x (..., E, Ev) -> (..., L, Ev)
    den = p.phi_q @ z[..., None] + p.eps  # (..., L, E) x (..., E, 1) -> (..., L, 1)
    return np.broadcast_to(num, (*p.batch, *num.shape[-2:])), np.broadcast_to(den, (*p.batch, *den.shape[-2:]))


def _global_backward(p: _Problem, d_num: np.ndarray,
                     d_den: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    A = np.swapaxes(p.phi_k, -1, -2) @ p.v  # (..., E, Ev), again
    z = np.sum(p.phi_k, axis=-2)[..., None, :]  # (..., 1, E)
    d_phi_q = d_num @ np.swapaxes(A, -1, -2) + d_den * z  # (..., L, Ev) x (..., Ev, E) + (..., L, 1) x (..., 1, E)
    dA = np.swapaxes(p.phi_q, -1, -2) @ d_num  # (..., E, L) x (..., L, Ev) -> (..., E, Ev)
    dz = np.swapaxes(d_den, -1, -2) @ p.phi_q  # (..., 1, L) x (..., L, E) -> (..., 1, E)
    d_phi_k = p.v @ np.swapaxes(dA, -1, -2) + dz  # (..., S, Ev) x (..., Ev, E) + (..., 1, E) -> (..., S, E)
    dv = p.phi_k @ dA  # (..., S, E) x (..., E, Ev) -> (..., S, Ev)
    return d_phi_q, d_phi_k, dv


def _prefix(p: _Problem) -> tuple[np.ndarray, np.ndarray]:
    """Causal, all positions at once: A_i = sum_{j <= i} phi(k_j) v_j^T and z_i = sum_{j <= i} phi(k_j) as
    cumulative sums over the keys, num_i = phi(q_i)^T A_i, den_i = phi(q_i) . z_i + eps."""
    A, z = _prefix_sums(p)  # (..., L, E, Ev), (..., L, E)
    num = (p.phi_q[..., None, :] @ A)[..., 0, :]  # (..., L, 1, E) x (..., L, E, Ev) -> (..., L, Ev)
    den = np.sum(p.phi_q * z, axis=-1, keepdims=True) + p.eps  # (..., L, 1)
    return np.broadcast_to(num, (*p.batch, *num.shape[-2:])), np.broadcast_to(den, (*p.batch, *den.shape[-2:]))


def _prefix_sums(p: _Problem) -> tuple[np.ndarray, np.ndarray]:
    kv = p.phi_k[..., :, None] * p.v[..., None, :]  # (..., S, E, 1) x (..., S, 1, Ev) -> (..., S, E, Ev)
    return np.cumsum(kv, axis=-3), np.cumsum(p.phi_k, axis=-2)  # A (..., L, E, Ev), z (..., L, E); L = S


def _prefix_backward(p: _Problem, d_num: np.ndarray,
                     d_den: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The global backward pass per position: query i reads A_i and z_i, so d phi(q_i) = A_i d_num_i + d_den_i z_i,
    and key j's term phi(k_j) v_j^T reaches every A_i with i >= j: its gradient G_j = sum_{i >= j} phi(q_i)
    d_num_i^T, and z's g_j = sum_{i >= j} d_den_i phi(q_i), suffix sums."""
    A, z = _prefix_sums(p)
    d_phi_q = (A @ d_num[..., None])[..., 0] + d_den * z  # (..., L, E, Ev) x (..., L, Ev, 1) -> (..., L, E)
    G = _suffix_sum(p.phi_q[..., :, None] * d_num[..., None, :], axis=-3)  # (..., L, E, 1) x (..., L, 1, Ev)
    g = _suffix_sum(d_den * p.phi_q, axis=-2)  # (..., L, E)
    d_phi_k = (G @ p.v[..., None])[..., 0] + g  # (..., S, E, Ev) x (..., S, Ev, 1) -> (..., S, E)
    dv = (p.phi_k[..., None, :] @ G)[..., 0, :]  # (..., S, 1, E) x (..., S, E, Ev) -> (..., S, Ev)
    return d_phi_q, d_phi_k, dv


def _suffix_sum(x: np.ndarray, axis: int) -> np.ndarray:
    """sum_{i >= j} x_i along `axis`: the reversed cumulative sum."""
    return np.flip(np.cumsum(np.flip(x, axis), axis), axis)


def _chunks(p: _Problem) -> list[slice]:
    """The positions of each chunk; the last may be shorter."""
    return [slice(start, min(start + p.chunk, p.L)) for start in range(0, p.L, p.chunk)]


def _chunk_states(p: _Problem, chunks: list[slice]) -> list[tuple[np.ndarray, np.ndarray]]:
    """The state at each chunk's start, the sums over the earlier chunks: A_{<c} (..., E, Ev), z_{<c} (..., E);
    L / chunk of them, the form's memory."""
    E, Ev = p.phi_k.shape[-1], p.v.shape[-1]
    A, z = np.zeros((*p.batch, E, Ev), p.work), np.zeros((*p.batch, E), p.work)
    states = []
    for rows in chunks:
        states.append((A, z))
        A = A + np.swapaxes(p.phi_k[..., rows, :], -1, -2) @ p.v[..., rows, :]  # (..., E, C) x (..., C, Ev)
        z = z + np.sum(p.phi_k[..., rows, :], axis=-2)  # (..., E)
    return states


def _chunked(p: _Problem) -> tuple[np.ndarray, np.ndarray]:
    """Causal, chunk by chunk: inside chunk c the quadratic form with the causal mask, kernel = phi(Q_c) phi(K_c)^T
    (j <= i), and across chunks the state of the earlier ones: num_c = kernel V_c + phi(Q_c) A_{<c},
    den_c = rowsum(kernel) + phi(Q_c) z_{<c} + eps."""
    chunks = _chunks(p)
    num = np.zeros((*p.batch, p.L, p.v.shape[-1]), p.work)  # (..., L, Ev)
    den = np.zeros((*p.batch, p.L, 1), p.work)  # (..., L, 1)
    for rows, (A, z) in zip(chunks, _chunk_states(p, chunks), strict=True):
        q, k, v = p.phi_q[..., rows, :], p.phi_k[..., rows, :], p.v[..., rows, :]
        kernel = np.tril(q @ np.swapaxes(k, -1, -2))  # (..., C, E) x (..., E, C) -> (..., C, C); keys j <= i
        num[..., rows, :] = kernel @ v + q @ A  # (..., C, C) x (..., C, Ev) + (..., C, E) x (..., E, Ev)
        den[..., rows, :] = np.sum(kernel, axis=-1, keepdims=True) + q @ z[..., None] + p.eps  # (..., C, 1)
    return num, den


def _chunked_backward(p: _Problem, d_num: np.ndarray,
                      d_den: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The chunks in reverse. Inside chunk c, through kernel = tril(phi(Q_c) phi(K_c)^T):
    d_kernel = tril(d_num V_c^T + d_den 1^T), d phi(Q_c) = d_kernel phi(K_c), d phi(K_c) = d_kernel^T phi(Q_c),
    dV_c = kernel^T d_num. Through the state of the earlier chunks: d phi(Q_c) += d_num A_{<c}^T + d_den z_{<c}^T.
    Through the state it hands to the later chunks: their queries' suffix sums G = sum phi(q_i) d_num_i^T and
    g = sum d_den_i phi(q_i) (over i in the later chunks), carried backwards: d phi(K_c) += V_c G^T + g^T,
    dV_c += phi(K_c) G."""
    chunks = _chunks(p)
    E, Ev = p.phi_k.shape[-1], p.v.shape[-1]
    d_phi_q = np.zeros((*p.batch, p.L, E), p.work)  # (..., L, E)
    d_phi_k = np.zeros((*p.batch, p.L, E), p.work)  # (..., S, E); S = L
    dv = np.zeros((*p.batch, p.L, Ev), p.work)  # (..., S, Ev)
    G, g = np.zeros((*p.batch, E, Ev), p.work), np.zeros((*p.batch, 1, E), p.work)  # the later chunks' sums
    for rows, (A, z) in reversed(list(zip(chunks, _chunk_states(p, chunks), strict=True))):
        q, k, v = p.phi_q[..., rows, :], p.phi_k[..., rows, :], p.v[..., rows, :]
        d_n, d_d = d_num[..., rows, :], d_den[..., rows, :]  # (..., C, Ev), (..., C, 1)
        kernel = np.tril(q @ np.swapaxes(k, -1, -2))  # (..., C, C)
        d_kernel = np.tril(d_n @ np.swapaxes(v, -1, -2) + d_d)  # (..., C, Ev) x (..., Ev, C) + (..., C, 1)
        d_phi_q[..., rows, :] = d_kernel @ k + d_n @ np.swapaxes(A, -1, -2) + d_d * z[..., None, :]  # (..., C, E)
        d_phi_k[..., rows, :] = np.swapaxes(d_kernel, -1, -2) @ q + v @ np.swapaxes(G, -1, -2) + g  # (..., C, E)
        dv[..., rows, :] = np.swapaxes(kernel, -1, -2) @ d_n + k @ G  # (..., C, C) x (..., C, Ev) + (..., C, E) x G
        G = G + np.swapaxes(q, -1, -2) @ d_n  # (..., E, C) x (..., C, Ev) -> (..., E, Ev)
        g = g + np.swapaxes(d_d, -1, -2) @ q  # (..., 1, C) x (..., C, E) -> (..., 1, E)
    return d_phi_q, d_phi_k, dv


def _position(p: _Problem, t: int) -> tuple:
    """Position t's phi(q_t), phi(k_t) (..., E), v_t (..., Ev), g_t (..., 1 or E) and beta_t (..., 1), or None."""
    return (p.phi_q[..., t, :], p.phi_k[..., t, :], p.v[..., t, :],
            *(None if x is None else x[..., t, :] for x in (p.decay, p.beta)))


def _states(p: _Problem) -> list[np.ndarray]:
    """The states S_{t-1} (..., E, Ev) each position of the recurrence starts from, L of them: the backward
    pass's memory."""
    S, before = np.zeros((*p.batch, p.phi_k.shape[-1], p.v.shape[-1]), p.work), []
    for t in range(p.L):
        before.append(S)
        S = _rule_step(S, *_position(p, t))[1]
    return before


def _recurrence(p: _Problem) -> tuple[np.ndarray, np.ndarray]:
    """Causal, the rules with decay or beta: the recurrence position by position from S = 0, one state at a time;
    no normaliser, den = 1."""
    S = np.zeros((*p.batch, p.phi_k.shape[-1], p.v.shape[-1]), p.work)  # (..., E, Ev)
    num = np.zeros((*p.batch, p.L, p.v.shape[-1]), p.work)  # (..., L, Ev)
    for t in range(p.L):
        num[..., t, :], S = _rule_step(S, *_position(p, t))
    return num, np.ones((*p.batch, p.L, 1), p.work)


def _recurrence_backward(p: _Problem, d_num: np.ndarray, d_den: np.ndarray) -> tuple[np.ndarray, ...]:
    """The recurrence in reverse (den = 1 is constant: d_den is unused), the states S_{t-1} recomputed by the
    forward loop. From the last position, dS the gradient reaching S_t from the outputs at t and after:
        dS += phi(q_t) d_out_t^T,   d phi(q_t) = S_t d_out_t
        S_t = P + phi(k_t) u_t^T:   d phi(k_t) = dS u_t,   du = dS^T phi(k_t),   dP = dS
        delta, u_t = beta_t (v_t - r), r = P^T phi(k_t):   dv_t = beta_t du,   d beta_t = du . (v_t - r),
            dP -= beta_t phi(k_t) du^T,   d phi(k_t) -= beta_t P du;   otherwise dv_t = du
        gated, P = exp(g_t) S_{t-1}:   d g_t = rowsum(dP * P),   dS_{t-1} = exp(g_t) dP;   otherwise dS_{t-1} = dP
    Returns d phi(Q), d phi(K), dV, then d_decay and d_beta where the rule takes them."""
    before = _states(p)
    E, Ev = p.phi_k.shape[-1], p.v.shape[-1]
    d_phi_q, d_phi_k = np.zeros((*p.batch, p.L, E), p.work), np.zeros((*p.batch, p.L, E), p.work)
    dv = np.zeros((*p.batch, p.L, Ev), p.work)
    d_g = None if p.decay is None else np.zeros((*p.batch, p.L, E), p.work)  # per key dimension; summed below
    d_beta = None if p.beta is None else np.zeros((*p.batch, p.L, 1), p.work)
    dS = np.zeros((*p.batch, E, Ev), p.work)
    for t in reversed(range(p.L)):
        phi_q, phi_k, v, g, beta = _position(p, t)
        d_out = d_num[..., t, :]  # (..., Ev)
        # the forward step again: P, u and S_t from S_{t-1}
        P = before[t] if g is None else np.exp(g)[..., :, None] * before[t]  # (..., E, Ev)
        r = (phi_k[..., None, :] @ P)[..., 0, :]  # P^T phi(k): (..., 1, E) x (..., E, Ev) -> (..., Ev)
        u = v if beta is None else beta * (v - r)  # (..., Ev)
        S = P + phi_k[..., :, None] * u[..., None, :]  # (..., E, Ev)
        # 1) the read out_t = S_t^T phi(q_t)
        dS = dS + phi_q[..., :, None] * d_out[..., None, :]  # (..., E, 1) x (..., 1, Ev)
        d_phi_q[..., t, :] = (S @ d_out[..., None])[..., 0]  # (..., E, Ev) x (..., Ev, 1) -> (..., E)
        # 2) the update S_t = P + phi(k_t) u_t^T
        d_k = (dS @ u[..., None])[..., 0]  # (..., E, Ev) x (..., Ev, 1) -> (..., E)
        du = (phi_k[..., None, :] @ dS)[..., 0, :]  # (..., 1, E) x (..., E, Ev) -> (..., Ev)
        dP = dS
        if beta is None:
            dv[..., t, :] = du
        else:  # 3) the delta rule's error term u_t = beta_t (v_t - P^T phi(k_t))
            dv[..., t, :] = beta * du
            d_beta[..., t, :] = np.sum(du * (v - r), axis=-1, keepdims=True)  # (..., 1)
            dP = dP - beta[..., None] * phi_k[..., :, None] * du[..., None, :]  # (..., E, 1) x (..., 1, Ev)
            d_k = d_k - beta * (P @ du[..., None])[..., 0]  # (..., E, Ev) x (..., Ev, 1) -> (..., E)
        d_phi_k[..., t, :] = d_k
        # 4) the decay P = exp(g_t) S_{t-1}
        if g is None:
            dS = dP
        else:
            d_g[..., t, :] = np.sum(dP * P, axis=-1)  # d exp(g) S / dg = P, row by row: (..., E)
            dS = np.exp(g)[..., :, None] * dP  # (..., E or 1, 1) * (..., E, Ev)
    return d_phi_q, d_phi_k, dv, *(d for d in (d_g, d_beta) if d is not None)


def _rule_chunks(p: _Problem) -> tuple[np.ndarray, np.ndarray]:
    """Causal, the rules with decay or beta, chunk by chunk (_rule_chunk), the state carried across; no
    normaliser, den = 1."""
    S = np.zeros((*p.batch, p.phi_k.shape[-1], p.v.shape[-1]), p.work)  # (..., E, Ev)
    num = np.zeros((*p.batch, p.L, p.v.shape[-1]), p.work)  # (..., L, Ev)
    for rows in _chunks(p):
        phi_k = p.phi_k[..., rows, :]
        # b_i: the log decay from the chunk's start to position i, inclusive (0 without decay)
        b = np.zeros((*phi_k.shape[:-1], 1), p.work) if p.decay is None else np.cumsum(p.decay[..., rows, :], -2)
        num[..., rows, :], S = _rule_chunk(S, p.phi_q[..., rows, :], phi_k, p.v[..., rows, :], b,
                                           None if p.beta is None else p.beta[..., rows, :])
    return num, np.ones((*p.batch, p.L, 1), p.work)


def _rule_chunk(S: np.ndarray, phi_q: np.ndarray, phi_k: np.ndarray, v: np.ndarray, b: np.ndarray,
                beta: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """One chunk of C positions from the state S_0 = S, b (..., C, 1 or E) the cumulative log decay. Unrolled,
        S_i = exp(b_i) S_0 + sum_{j <= i} exp(b_i - b_j) phi(k_j) u_j^T          (exp(...) scaling rows)
    so the chunk's outputs are a read of S_0 and one masked quadratic form:
        out = (phi(Q) exp(b)) S_0 + W U,   W_ij = sum_e phi(q_i)_e phi(k_j)_e exp(b_i - b_j)_e   (j <= i)
    The gated rule's U = V. The delta rules' u_i = beta_i (v_i - P_i^T phi(k_i)) read the u_j before them
    through P_i: with M_ij = sum_e phi(k_i)_e phi(k_j)_e exp(b_i - b_j)_e (j < i) they solve the unit lower
    triangular system (the UT transform of the WY representation)
        (I + diag(beta) M) U = diag(beta) (V - (phi(K) exp(b)) S_0)
    Returns the outputs (..., C, Ev) and S_C = exp(b_C) S_0 + (phi(K) exp(b_C - b))^T U."""
    C = phi_k.shape[-2]
    gap = b[..., :, None, :] - b[..., None, :, :]  # b_i - b_j: (..., C, C, 1 or E)
    below = np.tril(np.ones((C, C), bool))[..., None]  # j <= i: (C, C, 1)
    decays = np.exp(np.where(below, gap, -np.inf))  # exp(b_i - b_j) where j <= i, else 0 (never overflows)
    W = np.sum(phi_q[..., :, None, :] * phi_k[..., None, :, :] * decays, axis=-1)  # (..., C, 1, E) x (..., 1, C, E)
    U = v  # (..., C, Ev)
    if beta is not None:
        M = np.tril(np.sum(phi_k[..., :, None, :] * phi_k[..., None, :, :] * decays, axis=-1), -1)  # (..., C, C)
        rhs = beta * (v - (phi_k * np.exp(b)) @ S)  # (..., C, 1) * ((..., C, E) x (..., E, Ev)) -> (..., C, Ev)
        system = np.broadcast_to(np.eye(C) + beta * M, (*rhs.shape[:-1], C))  # (..., C, C)
        U = np.linalg.solve(system, rhs)  # (..., C, C) \ (..., C, Ev)
    out = (phi_q * np.exp(b)) @ S + W @ U  # (..., C, E) x (..., E, Ev) + (..., C, C) x (..., C, Ev)
    last = b[..., -1:, :]  # b_C: (..., 1, 1 or E)
    S = np.exp(np.swapaxes(last, -1, -2)) * S + np.swapaxes(phi_k * np.exp(last - b), -1, -2) @ U  # (..., E, Ev)
    return out, S
