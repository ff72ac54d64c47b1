"""Kernelised linear attention (Katharopoulos et al., 2020, "Transformers are RNNs"), in PyTorch.

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

The torch specifics: the chunks run in a Python loop, torch spreading each matmul over the cores itself; the
gradients are autograd's through the forward code (attention_np.linear derives them by hand), and
linear_attention_vjp records the call also inside torch.no_grad() and torch.inference_mode().

The update rules of ONNX's LinearAttention (opset 27) change how the state S_i (..., E, Ev) takes key i; they are
recurrences over the positions (causal only) and read S_i with no normaliser, out_i = phi(q_i)^T S_i:
    "linear"       S_i = S_{i-1} + phi(k_i) v_i^T                      (the sums above, with the normaliser)
    "gated"        S_i = exp(g_i) S_{i-1} + phi(k_i) v_i^T
    "delta"        S_i = S_{i-1} + phi(k_i) u_i^T,   u_i = beta_i (v_i - S_{i-1}^T phi(k_i))
    "gated_delta"  S_i = P_i + phi(k_i) u_i^T,       u_i = beta_i (v_i - P_i^T phi(k_i)),  P_i = exp(g_i) S_{i-1}
with g_i the log-space decay (one per head, or one per key dimension: a row scale of S) and beta_i the update
rate. They run position by position (_rule_step), a Python loop over the positions, or chunk by chunk
(_rule_chunk: unrolled inside a chunk, a masked quadratic form with the decays between positions, and for the
delta rules a unit lower triangular system, the UT transform of the WY representation); their gradients are
autograd's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from attention_np.common import validation
from attention_np.common.records import LinearOptions

from .fast import _grouped_matmul
from .functional import _dtypes
from .gradients import _grad, _leaf, _recording
from .primitives import _cast, _integers

# the feature maps of validation.FEATURE_MAPS: phi(x); elu(x) + 1 is x + 1 for x > 0, exp(x) otherwise (exp of
# min(x, 0): the branch not taken never overflows). torch: phi' comes from autograd
FEATURE_MAPS: dict[str, Callable] = {
    "elu": lambda x: torch.where(x > 0, x + 1, torch.exp(torch.clamp(x, max=0))),
    "relu": lambda x: torch.clamp(x, min=0),
    "identity": lambda x: x,
}


def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    feature_map: str = "elu",
    is_causal: bool = False,
    key_lengths: torch.Tensor | None = None,
    eps: float = 1e-6,
    chunk: int | None = None,
    update_rule: str = "linear",
    decay: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
) -> torch.Tensor:
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
    return _cast(num / den, q.dtype)


def linear_attention_vjp(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    feature_map: str = "elu",
    is_causal: bool = False,
    key_lengths: torch.Tensor | None = None,
    eps: float = 1e-6,
    chunk: int | None = None,
    update_rule: str = "linear",
    decay: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Callable]:
    """d_num = d_out / den,  d_den = -sum(d_out * out) / den,  d phi(Q) = d_num A^T + d_den z^T,
    dA = phi(Q)^T d_num,  dz = phi(Q)^T d_den,  d phi(K) = V dA^T + dz,  dV = phi(K) dA,
    dQ = d phi(Q) * phi'(Q),  dK = d phi(K) * phi'(K); causal: dA and dz as suffix sums over the queries; the
    rules with decay or beta: the recurrence in reverse. autograd of linear_attention computes them.

    Args:
        q, k, v, feature_map, is_causal, key_lengths, eps, chunk, update_rule, decay, beta: as for
            linear_attention.

    Returns:
        out (..., L, Ev) and pullback(d_out (..., L, Ev)) -> (dq, dk, dv), then d_decay if decay was given and
        d_beta if beta was given, each gradient summed to its input's shape and in its dtype; hidden keys
        (key_lengths) get zero dk, dv, d_decay and d_beta.
    """
    # torch: autograd records the call (also inside torch.no_grad() and torch.inference_mode(), as
    # gradients.scaled_dot_product_attention_vjp does), and the pullback runs its backward pass
    with _recording():
        q_, k_, v_, decay_, beta_ = (None if x is None else _leaf(x) for x in (q, k, v, decay, beta))
        out = linear_attention(q_, k_, v_, feature_map=feature_map, is_causal=is_causal, key_lengths=key_lengths,
                               eps=eps, chunk=chunk, update_rule=update_rule, decay=decay_, beta=beta_)
    inputs = [x for x in (q_, k_, v_, decay_, beta_) if x is not None]

    def pullback(d_out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        validation.cotangent("d_out", d_out.shape, out.shape, _dtypes(d_out=d_out, out=out))
        return tuple(_grad(out, inputs, d_out))

    return out.detach(), pullback


def linear_attention_state(batch_shape: tuple[int, ...], E: int, Ev: int, *, dtype: torch.dtype | None = None,
                           update_rule: str = "linear") -> tuple[torch.Tensor, torch.Tensor | None]:
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
    dtype = torch.float32 if dtype is None else dtype
    validation.same_floating_dtype({"dtype": (str(dtype), dtype.is_floating_point)})
    # torch: on the default device (torch.set_default_device), as torch.zeros puts them
    S = torch.zeros((*batch, E, Ev), dtype=dtype)
    return S, (torch.zeros((*batch, E), dtype=dtype) if update_rule == "linear" else None)


def linear_attention_step(
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    v_t: torch.Tensor,
    state: tuple[torch.Tensor, torch.Tensor | None],
    *,
    feature_map: str = "elu",
    eps: float = 1e-6,
    update_rule: str = "linear",
    decay: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor | None]]:
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
    work = torch.promote_types(q_t.dtype, torch.float32)
    validation.linear_state_dtype(_dtypes(S=S, **({} if z is None else {"z": z})), S.dtype.itemsize * 8, str(work),
                                  work.itemsize * 8)
    phi = FEATURE_MAPS[feature_map]
    q, k, v, g, b = (None if x is None else _cast(x, S.dtype) for x in (q_t, k_t, v_t, decay, beta))
    phi_q, phi_k = phi(q), phi(k)  # (..., E)
    if update_rule != "linear":  # new arrays too: decay, then the update, then the read, no normaliser
        out, S = _rule_step(S, phi_q, phi_k, v, g, b)
        return _cast(out, q_t.dtype), (S, None)
    # 1) the state takes the current position: new arrays, the caller's state stays as it was
    S = S + phi_k[..., :, None] * v[..., None, :]  # (..., E, 1) x (..., 1, Ev)
    z = z + phi_k  # (..., E)
    # 2) the query reads it
    num = (phi_q[..., None, :] @ S)[..., 0, :]  # (..., 1, E) x (..., E, Ev) -> (..., Ev)
    den = torch.sum(phi_q * z, dim=-1, keepdim=True) + float(eps)  # (..., 1)
    return _cast(num / den, q_t.dtype), (S, z)


def _rule_step(S: torch.Tensor, phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None,
               beta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One position of the rules with decay or beta (g None: no decay; beta None: no delta correction):
    P = exp(g) S,  u = v or beta (v - P^T phi(k)),  S' = P + phi(k) u^T,  out = phi(q)^T S'."""
    if g is not None:
        S = torch.exp(g)[..., :, None] * S  # (..., E or 1, 1) * (..., E, Ev): the decay, before the update
    if beta is not None:  # the delta rule: write the error of what the decayed state recalls for phi(k)
        v = beta * (v - (phi_k[..., None, :] @ S)[..., 0, :])  # (..., 1) * ((..., 1, E) x (..., E, Ev) -> (..., Ev))
    S = S + phi_k[..., :, None] * v[..., None, :]  # (..., E, 1) x (..., 1, Ev)
    return (phi_q[..., None, :] @ S)[..., 0, :], S  # (..., 1, E) x (..., E, Ev) -> (..., Ev)


class _Problem(NamedTuple):
    """One call's checked inputs in the working dtype: phi(Q), phi(K) and V with the hidden keys' rows zeroed,
    the gates of the update rule (None where it takes none; the hidden keys' zeroed, so that they leave the state
    as it was), and the options."""

    is_causal: bool
    chunk: int | None
    eps: float  # a Python float: no promotion
    update_rule: str
    phi_q: torch.Tensor  # (..., L, E)
    phi_k: torch.Tensor  # (..., S, E), hidden keys' rows zeroed
    v: torch.Tensor  # (..., S, Ev), hidden keys' rows zeroed
    decay: torch.Tensor | None  # g (..., S, 1) or (..., S, E), hidden keys' rows zeroed (exp(0) = 1)
    beta: torch.Tensor | None  # (..., S, 1)
    batch: tuple  # the leading axes (...)
    L: int
    work: torch.dtype  # the working dtype: at least float32


def _problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: LinearOptions) -> _Problem:
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
    work = torch.promote_types(q.dtype, torch.float32)  # float16, bfloat16: in float32
    q, k, v = (_cast(x, work) for x in (q, k, v))
    decay, beta = (None if x is None else _cast(x, work) for x in (options.decay, options.beta))
    phi = FEATURE_MAPS[options.feature_map]
    phi_k = phi(k)
    if options.key_lengths is not None:  # hidden keys add nothing to either sum: their rows zeroed
        key_lengths = _integers(options.key_lengths, "key_lengths", batch).to(q.device)
        keep = torch.arange(S, device=q.device)[:, None] < key_lengths[..., None, None]  # (..., S, 1)
        phi_k, v = torch.where(keep, phi_k, 0), torch.where(keep, v, 0)  # (..., S, E), (..., S, Ev)
        decay = None if decay is None else torch.where(keep, decay, 0)  # no decay at a hidden key: S stays
    return _Problem(is_causal=options.is_causal, chunk=options.chunk, eps=float(options.eps),
                    update_rule=options.update_rule, phi_q=phi(q), phi_k=phi_k, v=v, decay=decay, beta=beta,
                    batch=tuple(batch), L=L, work=work)


def _form(p: _Problem) -> Callable:
    """The call's form: global sums, prefix sums, chunks, or the recurrence."""
    if p.update_rule != "linear":
        return _recurrence if p.chunk is None or p.L == 0 else _rule_chunks
    if not p.is_causal:
        return _global
    # torch: with L = 0 no chunk is written, and autograd needs an output that depends on the inputs: the
    # prefix form's, empty too
    return _prefix if p.chunk is None or p.L == 0 else _chunked


def _global(p: _Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-causal: num = phi(Q) A, den = phi(Q) z + eps, with A = phi(K)^T V and z = phi(K)^T 1."""
    A = p.phi_k.transpose(-1, -2) @ p.v  # (..., E, S) x (..., S, Ev) -> (..., E, Ev)
    z = torch.sum(p.phi_k, dim=-2)  # (..., S, E) -> (..., E)
    num = _grouped_matmul(p.phi_q, A)  # (..., L, E) x (..., E, Ev) -> (..., L, Ev)
    den = _grouped_matmul(p.phi_q, z[..., None]) + p.eps  # (..., L, E) x (..., E, 1) -> (..., L, 1)
    return num.expand(*p.batch, *num.shape[-2:]), den.expand(*p.batch, *den.shape[-2:])


def _prefix(p: _Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal, all positions at once: A_i = sum_{j <= i} phi(k_j) v_j^T and z_i = sum_{j <= i} phi(k_j) as
    cumulative sums over the keys, num_i = phi(q_i)^T A_i, den_i = phi(q_i) . z_i + eps."""
    kv = p.phi_k[..., :, None] * p.v[..., None, :]  # (..., S, E, 1) x (..., S, 1, Ev) -> (..., S, E, Ev)
    A, z = torch.cumsum(kv, dim=-3), torch.cumsum(p.phi_k, dim=-2)  # (..., L, E, Ev), (..., L, E); L = S
    num = (p.phi_q[..., None, :] @ A)[..., 0, :]  # (..., L, 1, E) x (..., L, E, Ev) -> (..., L, Ev)
    den = torch.sum(p.phi_q * z, dim=-1, keepdim=True) + p.eps  # (..., L, 1)
    return num.expand(*p.batch, *num.shape[-2:]), den.expand(*p.batch, *den.shape[-2:])


def _chunks(p: _Problem) -> list[slice]:
    """The positions of each chunk; the last may be shorter."""
    return [slice(start, min(start + p.chunk, p.L)) for start in range(0, p.L, p.chunk)]


def _chunked(p: _Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal, chunk by chunk: inside chunk c the quadratic form with the causal mask, kernel = phi(Q_c) phi(K_c)^T
    (j <= i), and across chunks the state of the earlier ones: num_c = kernel V_c + phi(Q_c) A_{<c},
    den_c = rowsum(kernel) + phi(Q_c) z_{<c} + eps."""
    E, Ev, device = p.phi_k.shape[-1], p.v.shape[-1], p.phi_q.device
    num = torch.zeros((*p.batch, p.L, Ev), dtype=p.work, device=device)  # (..., L, Ev)
    den = torch.zeros((*p.batch, p.L, 1), dtype=p.work, device=device)  # (..., L, 1)
    A = torch.zeros((*p.batch, E, Ev), dtype=p.work, device=device)  # the state of the earlier chunks
    z = torch.zeros((*p.batch, E), dtype=p.work, device=device)
    for rows in _chunks(p):
        q, k, v = p.phi_q[..., rows, :], p.phi_k[..., rows, :], p.v[..., rows, :]
        kernel = torch.tril(q @ k.transpose(-1, -2))  # (..., C, E) x (..., E, C) -> (..., C, C); keys j <= i
        num[..., rows, :] = kernel @ v + q @ A  # (..., C, C) x (..., C, Ev) + (..., C, E) x (..., E, Ev)
        den[..., rows, :] = torch.sum(kernel, dim=-1, keepdim=True) + q @ z[..., None] + p.eps  # (..., C, 1)
        A = A + k.transpose(-1, -2) @ v  # (..., E, C) x (..., C, Ev)
        z = z + torch.sum(k, dim=-2)  # (..., E)
    return num, den


def _position(p: _Problem, t: int) -> tuple:
    """Position t's phi(q_t), phi(k_t) (..., E), v_t (..., Ev), g_t (..., 1 or E) and beta_t (..., 1), or None."""
    return (p.phi_q[..., t, :], p.phi_k[..., t, :], p.v[..., t, :],
            *(None if x is None else x[..., t, :] for x in (p.decay, p.beta)))


def _recurrence(p: _Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal, the rules with decay or beta: the recurrence position by position; no normaliser, den = 1.
    torch: a Python loop, the outputs stacked."""
    E, Ev, device = p.phi_k.shape[-1], p.v.shape[-1], p.phi_q.device
    S = torch.zeros((*p.batch, E, Ev), dtype=p.work, device=device)
    den = torch.ones((*p.batch, p.L, 1), dtype=p.work, device=device)
    if p.L == 0:  # torch: autograd needs an output that depends on the inputs: phi(Q) times the zero state
        return p.phi_q @ S, den  # (..., 0, E) x (..., E, Ev) -> (..., 0, Ev)
    num = []
    for t in range(p.L):
        out, S = _rule_step(S, *_position(p, t))
        num.append(out)
    return torch.stack(num, dim=-2), den  # L of (..., Ev) -> (..., L, Ev)


def _rule_chunks(p: _Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal, the rules with decay or beta, chunk by chunk (_rule_chunk), the state carried across; no
    normaliser, den = 1."""
    E, Ev, device = p.phi_k.shape[-1], p.v.shape[-1], p.phi_q.device
    S = torch.zeros((*p.batch, E, Ev), dtype=p.work, device=device)  # (..., E, Ev)
    num = []
    for rows in _chunks(p):
        phi_k = p.phi_k[..., rows, :]
        # b_i: the log decay from the chunk's start to position i, inclusive (0 without decay)
        b = (torch.zeros((*phi_k.shape[:-1], 1), dtype=p.work, device=device) if p.decay is None
             else torch.cumsum(p.decay[..., rows, :], dim=-2))
        out, S = _rule_chunk(S, p.phi_q[..., rows, :], phi_k, p.v[..., rows, :], b,
                             None if p.beta is None else p.beta[..., rows, :])
        num.append(out)
    return torch.cat(num, dim=-2), torch.ones((*p.batch, p.L, 1), dtype=p.work, device=device)  # (..., L, Ev)


def _rule_chunk(S: torch.Tensor, phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, b: torch.Tensor,
                beta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
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
    below = torch.tril(torch.ones((C, C), dtype=torch.bool, device=S.device))[..., None]  # j <= i: (C, C, 1)
    decays = torch.exp(torch.where(below, gap, -torch.inf))  # exp(b_i - b_j) where j <= i, else 0 (never overflows)
    W = torch.sum(phi_q[..., :, None, :] * phi_k[..., None, :, :] * decays, dim=-1)  # (..., C, 1, E) x (..., 1, C, E)
    U = v  # (..., C, Ev)
    if beta is not None:
        M = torch.tril(torch.sum(phi_k[..., :, None, :] * phi_k[..., None, :, :] * decays, dim=-1), -1)  # (..., C, C)
        rhs = beta * (v - (phi_k * torch.exp(b)) @ S)  # (..., C, 1) * ((..., C, E) x (..., E, Ev)) -> (..., C, Ev)
        system = (torch.eye(C, dtype=M.dtype, device=M.device) + beta * M).expand(*rhs.shape[:-1], C)
        U = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # (..., C, Ev)
    out = (phi_q * torch.exp(b)) @ S + W @ U  # (..., C, E) x (..., E, Ev) + (..., C, C) x (..., C, Ev)
    last = b[..., -1:, :]  # b_C: (..., 1, 1 or E)
    S = torch.exp(last.transpose(-1, -2)) * S + (phi_k * torch.exp(last - b)).transpose(-1, -2) @ U  # (..., E, Ev)
    return out, S
