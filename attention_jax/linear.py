"""Kernelised linear attention (Katharopoulos et al., 2020, "Transformers are RNNs"), in JAX.

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

The JAX specifics: the chunks are one lax.scan over L padded up to whole chunks (a padded key adds nothing, a
padded query is dropped), so the traced program does not grow with L / chunk; its body is a jax.checkpoint, so
that the backward pass keeps the carried states only and recomputes each chunk. The gradients are jax.vjp of
the forward code (attention_np.linear derives them by hand); the state is a tuple, a pytree.

The update rules of ONNX's LinearAttention (opset 27) change how the state S_i (..., E, Ev) takes key i; they are
recurrences over the positions (causal only) and read S_i with no normaliser, out_i = phi(q_i)^T S_i:
    "linear"       S_i = S_{i-1} + phi(k_i) v_i^T                      (the sums above, with the normaliser)
    "gated"        S_i = exp(g_i) S_{i-1} + phi(k_i) v_i^T
    "delta"        S_i = S_{i-1} + phi(k_i) u_i^T,   u_i = beta_i (v_i - S_{i-1}^T phi(k_i))
    "gated_delta"  S_i = P_i + phi(k_i) u_i^T,       u_i = beta_i (v_i - P_i^T phi(k_i)),  P_i = exp(g_i) S_{i-1}
with g_i the log-space decay (one per head, or one per key dimension: a row scale of S) and beta_i the update
rate. They run position by position (_rule_step), one lax.scan over the positions, the state its carry, or chunk
by chunk (_rule_chunk: unrolled inside a chunk, a masked quadratic form with the decays between positions, and for
the delta rules a unit lower triangular system, the UT transform of the WY representation, solved through its
inverse by doubling blocks, _unit_lower_inverse, where XLA's own triangular solve is slow on the CPU), one lax.scan
over the chunks; their gradients are jax.vjp's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from attention_np.common import validation
from attention_np.common.records import LinearOptions

from .functional import _dtypes
from .primitives import _at_least_float32, _integers, _ranked

# the feature maps of validation.FEATURE_MAPS: phi(x); elu(x) + 1 is x + 1 for x > 0, exp(x) otherwise (exp of
# min(x, 0): the branch not taken never overflows). jax: phi' comes from autodiff
FEATURE_MAPS: dict[str, Callable] = {
    "elu": lambda x: jnp.where(x > 0, x + 1, jnp.exp(jnp.minimum(x, 0))),
    "relu": lambda x: jnp.maximum(x, 0),
    "identity": lambda x: x,
}


def linear_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    feature_map: str = "elu",
    is_causal: bool = False,
    key_lengths: jax.Array | None = None,
    eps: float = 1e-6,
    chunk: int | None = None,
    update_rule: str = "linear",
    decay: jax.Array | None = None,
    beta: jax.Array | None = None,
) -> jax.Array:
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
    num, den = _form(p)(p)
    return (num / den).astype(q.dtype)


def linear_attention_vjp(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    feature_map: str = "elu",
    is_causal: bool = False,
    key_lengths: jax.Array | None = None,
    eps: float = 1e-6,
    chunk: int | None = None,
    update_rule: str = "linear",
    decay: jax.Array | None = None,
    beta: jax.Array | None = None,
) -> tuple[jax.Array, Callable]:
    """d_num = d_out / den,  d_den = -sum(d_out * out) / den,  d phi(Q) = d_num A^T + d_den z^T,
    dA = phi(Q)^T d_num,  dz = phi(Q)^T d_den,  d phi(K) = V dA^T + dz,  dV = phi(K) dA,
    dQ = d phi(Q) * phi'(Q),  dK = d phi(K) * phi'(K); causal: dA and dz as suffix sums over the queries; the
    rules with decay or beta: the recurrence in reverse. jax.vjp of linear_attention computes them (usable inside
    jax.jit).

    Args:
        q, k, v, feature_map, is_causal, key_lengths, eps, chunk, update_rule, decay, beta: as for
            linear_attention.

    Returns:
        out (..., L, Ev) and pullback(d_out (..., L, Ev)) -> (dq, dk, dv), then d_decay if decay was given and
        d_beta if beta was given, each gradient summed to its input's shape and in its dtype; hidden keys
        (key_lengths) get zero dk, dv, d_decay and d_beta.
    """
    gates = [x for x in (decay, beta) if x is not None]

    def attention(q: jax.Array, k: jax.Array, v: jax.Array, *given: jax.Array) -> jax.Array:
        rest = iter(given)  # the gates given, in order
        decay_, beta_ = (None if x is None else next(rest) for x in (decay, beta))
        return linear_attention(q, k, v, feature_map=feature_map, is_causal=is_causal, key_lengths=key_lengths,
                                eps=eps, chunk=chunk, update_rule=update_rule, decay=decay_, beta=beta_)

    out, pull = jax.vjp(attention, q, k, v, *gates)  # jax: autodiff of the forward

    def pullback(d_out: jax.Array) -> tuple[jax.Array, ...]:
        validation.cotangent("d_out", d_out.shape, out.shape, _dtypes(d_out=d_out, out=out))
        return pull(d_out)

    return out, pullback


def linear_attention_state(batch_shape: tuple[int, ...], E: int, Ev: int, *, dtype: Any | None = None,
                           update_rule: str = "linear") -> tuple[jax.Array, jax.Array | None]:
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
    dtype = jnp.dtype(jnp.float32 if dtype is None else dtype)
    validation.same_floating_dtype({"dtype": (str(dtype), jnp.issubdtype(dtype, jnp.floating))})
    S = jnp.zeros((*batch, E, Ev), dtype)
    return S, (jnp.zeros((*batch, E), dtype) if update_rule == "linear" else None)


def linear_attention_step(
    q_t: jax.Array,
    k_t: jax.Array,
    v_t: jax.Array,
    state: tuple[jax.Array, jax.Array | None],
    *,
    feature_map: str = "elu",
    eps: float = 1e-6,
    update_rule: str = "linear",
    decay: jax.Array | None = None,
    beta: jax.Array | None = None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array | None]]:
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
    work = _at_least_float32(q_t.dtype)
    validation.linear_state_dtype(_dtypes(S=S, **({} if z is None else {"z": z})), S.dtype.itemsize * 8, str(work),
                                  work.itemsize * 8)
    phi = FEATURE_MAPS[feature_map]
    # jax: the inputs at the state's rank less one, as rank promotion may be refused
    q, k, v, g, b = (None if x is None else _ranked(x.astype(S.dtype), S.ndim - 1) for x in (q_t, k_t, v_t, decay,
                                                                                          beta))
    phi_q, phi_k = phi(q), phi(k)  # (..., E)
    if update_rule != "linear":  # new arrays too: decay, then the update, then the read, no normaliser
        out, S = _rule_step(S, phi_q, phi_k, v, g, b)
        return out.astype(q_t.dtype), (S, None)
    # 1) the state takes the current position: new arrays, the caller's state stays as it was
    S = S + phi_k[..., :, None] * v[..., None, :]  # (..., E, 1) x (..., 1, Ev)
    z = z + phi_k  # (..., E)
    # 2) the query reads it
    num = (phi_q[..., None, :] @ S)[..., 0, :]  # (..., 1, E) x (..., E, Ev) -> (..., Ev)
    den = jnp.sum(phi_q * z, axis=-1, keepdims=True) + float(eps)  # (..., 1)
    return (num / den).astype(q_t.dtype), (S, z)


def _rule_step(S: jax.Array, phi_q: jax.Array, phi_k: jax.Array, v: jax.Array, g: jax.Array | None,
               beta: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """One position of the rules with decay or beta (g None: no decay; beta None: no delta correction):
    P = exp(g) S,  u = v or beta (v - P^T phi(k)),  S' = P + phi(k) u^T,  out = phi(q)^T S'."""
    if g is not None:
        S = jnp.exp(g)[..., :, None] * S  # (..., E or 1, 1) * (..., E, Ev): the decay, before the update
    if beta is not None:  # the delta rule: write the error of what the decayed state recalls for phi(k)
        v = beta * (v - (phi_k[..., None, :] @ S)[..., 0, :])  # (..., 1) * ((..., 1, E) x (..., E, Ev) -> (..., Ev))
    S = S + phi_k[..., :, None] * v[..., None, :]  # (..., E, 1) x (..., 1, Ev)
    return (phi_q[..., None, :] @ S)[..., 0, :], S  # (..., 1, E) x (..., E, Ev) -> (..., Ev)


class _Problem(NamedTuple):
    """One call's checked inputs in the working dtype, all at the scores' rank less one: phi(Q), phi(K) and V with
    the hidden keys' rows zeroed, the gates of the update rule (None where it takes none; the hidden keys'
    zeroed, so that they leave the state as it was), and the options."""

    is_causal: bool
    chunk: int | None
    eps: float  # a Python float: no promotion
    update_rule: str
    phi_q: jax.Array  # (..., L, E)
    phi_k: jax.Array  # (..., S, E), hidden keys' rows zeroed
    v: jax.Array  # (..., S, Ev), hidden keys' rows zeroed
    decay: jax.Array | None  # g (..., S, 1) or (..., S, E), hidden keys' rows zeroed (exp(0) = 1)
    beta: jax.Array | None  # (..., S, 1)
    batch: tuple  # the leading axes (...)
    L: int
    work: Any  # the working dtype: at least float32


def _problem(q: jax.Array, k: jax.Array, v: jax.Array, options: LinearOptions) -> _Problem:
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
    work = _at_least_float32(q.dtype)  # float16, bfloat16: in float32
    n = len(batch) + 2  # jax: every array at one rank, as rank promotion may be refused
    q, k, v = (_ranked(x.astype(work), n) for x in (q, k, v))
    decay, beta = (None if x is None else _ranked(x.astype(work), n) for x in (options.decay, options.beta))
    phi = FEATURE_MAPS[options.feature_map]
    phi_k = phi(k)
    if options.key_lengths is not None:  # hidden keys add nothing to either sum: their rows zeroed
        key_lengths = _ranked(_integers(options.key_lengths, "key_lengths", batch), len(batch))
        keep = _ranked(jnp.arange(S)[:, None], n) < key_lengths[..., None, None]  # (..., S, 1)
        phi_k, v = jnp.where(keep, phi_k, 0), jnp.where(keep, v, 0)  # (..., S, E), (..., S, Ev)
        decay = None if decay is None else jnp.where(keep, decay, 0)  # no decay at a hidden key: S stays
    return _Problem(is_causal=options.is_causal, chunk=options.chunk, eps=float(options.eps),
                    update_rule=options.update_rule, phi_q=phi(q), phi_k=phi_k, v=v, decay=decay, beta=beta,
                    batch=batch, L=L, work=work)


def _form(p: _Problem) -> Callable:
    """The call's form: global sums, prefix sums, chunks, or the recurrence."""
    if p.update_rule != "linear":
        return _recurrence if p.chunk is None else _rule_chunks
    if not p.is_causal:
        return _global
    return _prefix if p.chunk is None else _chunked


def _global(p: _Problem) -> tuple[jax.Array, jax.Array]:
    """Non-causal: num = phi(Q) A, den = phi(Q) z + eps, with A = phi(K)^T V and z = phi(K)^T 1."""
    A = jnp.swapaxes(p.phi_k, -1, -2) @ p.v  # (..., E, S) x (..., S, Ev) -> (..., E, Ev)
    z = jnp.sum(p.phi_k, axis=-2)  # (..., S, E) -> (..., E)
    num = p.phi_q @ A  # (..., L, E) x (..., E, Ev) -> (..., L, Ev)
    den = p.phi_q @ z[..., None] + p.eps  # (..., L, E) x (..., E, 1) -> (..., L, 1)
    return jnp.broadcast_to(num, (*p.batch, *num.shape[-2:])), jnp.broadcast_to(den, (*p.batch, *den.shape[-2:]))


def _prefix(p: _Problem) -> tuple[jax.Array, jax.Array]:
    """Causal, all positions at once: A_i = sum_{j <= i} phi(k_j) v_j^T and z_i = sum_{j <= i} phi(k_j) as
    cumulative sums over the keys, num_i = phi(q_i)^T A_i, den_i = phi(q_i) . z_i + eps."""
    kv = p.phi_k[..., :, None] * p.v[..., None, :]  # (..., S, E, 1) x (..., S, 1, Ev) -> (..., S, E, Ev)
    A, z = jnp.cumsum(kv, axis=-3), jnp.cumsum(p.phi_k, axis=-2)  # (..., L, E, Ev), (..., L, E); L = S
    num = (p.phi_q[..., None, :] @ A)[..., 0, :]  # (..., L, 1, E) x (..., L, E, Ev) -> (..., L, Ev)
    den = jnp.sum(p.phi_q * z, axis=-1, keepdims=True) + p.eps  # (..., L, 1)
    return jnp.broadcast_to(num, (*p.batch, *num.shape[-2:])), jnp.broadcast_to(den, (*p.batch, *den.shape[-2:]))


def _chunked(p: _Problem) -> tuple[jax.Array, jax.Array]:
    """Causal, chunk by chunk: inside chunk c the quadratic form with the causal mask, kernel = phi(Q_c) phi(K_c)^T
    (j <= i), and across chunks the state of the earlier ones: num_c = kernel V_c + phi(Q_c) A_{<c},
    den_c = rowsum(kernel) + phi(Q_c) z_{<c} + eps. jax: one lax.scan over the chunks, the state its carry."""
    E, Ev, C = p.phi_k.shape[-1], p.v.shape[-1], p.chunk
    count = -(-p.L // C)  # chunks; L padded up to count * C

    def chunks(x: jax.Array) -> jax.Array:  # (..., L, *) -> (count, ..., C, *), padded with zeros
        x = jnp.broadcast_to(x, (*p.batch, *x.shape[-2:]))
        x = jnp.pad(x, [(0, 0)] * len(p.batch) + [(0, count * C - p.L), (0, 0)])
        return jnp.moveaxis(x.reshape(*p.batch, count, C, x.shape[-1]), -3, 0)

    @jax.checkpoint  # jax: the backward pass keeps the carried states, and recomputes each chunk's kernel
    def step(state: tuple, chunk: tuple) -> tuple[tuple, tuple]:
        (A, z), (q, k, v) = state, chunk
        kernel = jnp.tril(q @ jnp.swapaxes(k, -1, -2))  # (..., C, E) x (..., E, C) -> (..., C, C); keys j <= i
        num = kernel @ v + q @ A  # (..., C, C) x (..., C, Ev) + (..., C, E) x (..., E, Ev)
        den = jnp.sum(kernel, axis=-1, keepdims=True) + q @ z[..., None] + p.eps  # (..., C, 1)
        A = A + jnp.swapaxes(k, -1, -2) @ v  # (..., E, C) x (..., C, Ev)
        z = z + jnp.sum(k, axis=-2)  # (..., E)
        return (A, z), (num, den)

    start = (jnp.zeros((*p.batch, E, Ev), p.work), jnp.zeros((*p.batch, E), p.work))
    _, (num, den) = lax.scan(step, start, (chunks(p.phi_q), chunks(p.phi_k), chunks(p.v)))

    def positions(x: jax.Array) -> jax.Array:  # (count, ..., C, *) -> (..., L, *), the padding dropped
        return jnp.moveaxis(x, 0, -3).reshape(*p.batch, count * C, x.shape[-1])[..., :p.L, :]

    return positions(num), positions(den)


def _recurrence(p: _Problem) -> tuple[jax.Array, jax.Array]:
    """Causal, the rules with decay or beta: the recurrence position by position; no normaliser, den = 1.
    jax: one lax.scan over the positions, the state its carry."""
    E, Ev = p.phi_k.shape[-1], p.v.shape[-1]

    def positions(x: jax.Array | None) -> jax.Array | None:  # (..., L, *) -> (L, ..., *)
        return None if x is None else jnp.moveaxis(jnp.broadcast_to(x, (*p.batch, *x.shape[-2:])), -2, 0)

    def step(S: jax.Array, position: tuple) -> tuple[jax.Array, jax.Array]:
        out, S = _rule_step(S, *position)
        return S, out

    start = jnp.zeros((*p.batch, E, Ev), p.work)
    _, num = lax.scan(step, start, tuple(positions(x) for x in (p.phi_q, p.phi_k, p.v, p.decay, p.beta)))
    return jnp.moveaxis(num, 0, -2), jnp.ones((*p.batch, p.L, 1), p.work)  # (L, ..., Ev) -> (..., L, Ev)


def _rule_chunks(p: _Problem) -> tuple[jax.Array, jax.Array]:
    """Causal, the rules with decay or beta, chunk by chunk (_rule_chunk), the state carried across; no
    normaliser, den = 1. jax: one lax.scan over L padded up to whole chunks (a padded position has k, v, g and
    beta 0: it leaves the state as it was; its query is dropped), the state its carry."""
    E, Ev, C = p.phi_k.shape[-1], p.v.shape[-1], p.chunk
    count = -(-p.L // C)  # chunks; L padded up to count * C

    def chunks(x: jax.Array | None) -> jax.Array | None:  # (..., L, *) -> (count, ..., C, *), padded with zeros
        if x is None:
            return None
        x = jnp.broadcast_to(x, (*p.batch, *x.shape[-2:]))
        x = jnp.pad(x, [(0, 0)] * len(p.batch) + [(0, count * C - p.L), (0, 0)])
        return jnp.moveaxis(x.reshape(*p.batch, count, C, x.shape[-1]), -3, 0)

    @jax.checkpoint  # jax: the backward pass keeps the carried states, and recomputes each chunk
    def step(S: jax.Array, chunk: tuple) -> tuple[jax.Array, jax.Array]:
        phi_q, phi_k, v, g, beta = chunk
        # b_i: the log decay from the chunk's start to position i, inclusive (0 without decay)
        b = jnp.zeros((*phi_k.shape[:-1], 1), p.work) if g is None else jnp.cumsum(g, axis=-2)
        out, S = _rule_chunk(S, phi_q, phi_k, v, b, beta)
        return S, out

    start = jnp.zeros((*p.batch, E, Ev), p.work)
    _, num = lax.scan(step, start, tuple(chunks(x) for x in (p.phi_q, p.phi_k, p.v, p.decay, p.beta)))
    num = jnp.moveaxis(num, 0, -3).reshape(*p.batch, count * C, Ev)[..., :p.L, :]  # the padding dropped
    return num, jnp.ones((*p.batch, p.L, 1), p.work)


def _decayed_products(x: jax.Array, y: jax.Array, decays: jax.Array) -> jax.Array:
    """sum_e x_ie y_je decays_ije: x (..., C, E), y (..., C, E), decays (..., C, C, 1 or E) -> (..., C, C). jax: a
    decay per head is a matmul and a scaling, a decay per key dimension one batched contraction over e; as a sum
    of the (..., C, C, E) product, XLA fused that product into each of its readers (the delta rules' triangular
    inverse reads M in blocks): the chunked delta rule ran 30 to 200 times slower at 4096 positions."""
    if decays.shape[-1] == 1:
        return (x @ jnp.swapaxes(y, -1, -2)) * decays[..., 0]  # (..., C, E) x (..., E, C)
    return jnp.einsum("...je,...ije,...ie->...ij", y, decays, x)  # (..., C, E), (..., C, C, E), (..., C, E)


def _unit_lower_inverse(T: jax.Array) -> jax.Array:
    """T^-1 for T (..., C, C) unit lower triangular, by diagonal blocks that double in size, from blocks of one
    (whose inverse is 1) to the whole: [[A, 0], [B, D]]^-1 = [[A^-1, 0], [-D^-1 B A^-1, D^-1]]; C is padded up to
    a power of two with the identity. jax: XLA's triangular solve on the CPU took 25 ms a chunk of 64 (the
    chunked delta rule ran slower than its loop over positions); these are log2(C) steps of batched matmuls."""
    C = T.shape[-1]
    n = 1 << (C - 1).bit_length()  # C rounded up to a power of two
    padding = _ranked(jnp.where(jnp.arange(n) >= C, jnp.eye(n, dtype=T.dtype), 0), T.ndim)  # 1 on the new diagonal
    T = jnp.pad(T, [(0, 0)] * (T.ndim - 2) + [(0, n - C), (0, n - C)]) + padding  # (..., n, n)
    inverse = jnp.ones((*T.shape[:-2], n, 1, 1), T.dtype)  # the n diagonal blocks of one: (..., n, 1, 1)
    size = 1
    while size < n:  # the blocks of 2 size from pairs of blocks of size: (..., n / size, size, size) -> half as many
        blocks = T.reshape(*T.shape[:-2], n // (2 * size), 2 * size, n // (2 * size), 2 * size)
        B = jnp.moveaxis(jnp.diagonal(blocks, axis1=-4, axis2=-2), -1, -3)[..., size:, :size]  # (..., m, s, s)
        A_inv, D_inv = inverse[..., 0::2, :, :], inverse[..., 1::2, :, :]  # (..., m, s, s) each
        below = -D_inv @ B @ A_inv
        inverse = jnp.concatenate([jnp.concatenate([A_inv, jnp.zeros_like(A_inv)], axis=-1),
                                   jnp.concatenate([below, D_inv], axis=-1)], axis=-2)  # (..., m, 2 s, 2 s)
        size *= 2
    return inverse[..., 0, :C, :C]


def _rule_chunk(S: jax.Array, phi_q: jax.Array, phi_k: jax.Array, v: jax.Array, b: jax.Array,
                beta: jax.Array | None) -> tuple[jax.Array, jax.Array]:
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
    below = _ranked(jnp.tril(jnp.ones((C, C), bool))[..., None], gap.ndim)  # j <= i; jax: at gap's rank
    decays = jnp.exp(jnp.where(below, gap, -jnp.inf))  # exp(b_i - b_j) where j <= i, else 0 (never overflows)
    W = _decayed_products(phi_q, phi_k, decays)  # (..., C, C)
    U = v  # (..., C, Ev)
    if beta is not None:
        M = jnp.tril(_decayed_products(phi_k, phi_k, decays), -1)  # (..., C, C)
        rhs = beta * (v - (phi_k * jnp.exp(b)) @ S)  # (..., C, 1) * ((..., C, E) x (..., E, Ev)) -> (..., C, Ev)
        eye = _ranked(jnp.eye(C, dtype=M.dtype), M.ndim)  # jax: at M's rank
        system = jnp.broadcast_to(eye + beta * M, (*rhs.shape[:-1], C))  # (..., C, C)
        U = _unit_lower_inverse(system) @ rhs  # (..., C, C) x (..., C, Ev)
    out = (phi_q * jnp.exp(b)) @ S + W @ U  # (..., C, E) x (..., E, Ev) + (..., C, C) x (..., C, Ev)
    last = b[..., -1:, :]  # b_C: (..., 1, 1 or E)
    S = jnp.exp(jnp.swapaxes(last, -1, -2)) * S + jnp.swapaxes(phi_k * jnp.exp(last - b), -1, -2) @ U  # (..., E, Ev)
    return out, S
