"""Ring attention, in NumPy: the schedule of attention over a sequence sharded across devices, simulated on one.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

Each of P devices holds one shard of the queries and one of the keys and values. The key/value shards travel
around a ring: at step t, device d holds the shard of device (d - t) mod P, attends its queries to it, and
passes it on to device d + 1. After P steps every query has met every key. Each step's result is a partial
attention over some of the keys, and partial results merge exactly through their log-sum-exps (SPEC 2c):

    lse = log(exp(lse_a) + exp(lse_b)),   out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b

Positions are global: the query chunk starting at p meets the key chunk starting at t with q_offset = p - t +
the caller's q_offset, so causality, the window and ALiBi's -slope_h * |p_i - j| (which depends on p_i - j alone)
are the whole sequence's in every chunk pair.

With is_causal, contiguous shards leave device 0 almost idle (its queries see only its own keys) while the
last device sees every key. The zig-zag layout balances them: the sequence is cut into 2P chunks and device d
holds chunks d and 2P - 1 - d, one early and one late, so every device does the same work. The JAX and torch
backends run the same schedule on real devices (jax.shard_map with lax.ppermute; torch.distributed); this one
runs the devices one after another, to show the schedule and to check it.

The backward pass (ring_attention_vjp) runs the ring again, after the forward ring has left every device the
global out O and lse of its own queries (over all S keys). Attention's gradient is a sum over the (query, key)
pairs, and with the global lse each pair's weight is already final, P_ij = exp(S_ij - lse_i): so the
gradients split into one share per (query chunk, key chunk) pair, each computed from that pair's scores and
the global O, lse and dO of its query rows alone (flash_attention's backward pass, SPEC 2c):

    D = rowsum(dO * O),  P = exp(S - lse),  dV += P^T dO,  dP = dO V^T,  dS = P * (dP - D),
    dQ += dS K * scale,  dK += dS^T Q * scale            (softcap: dS * (1 - tanh^2(R / c)) before dQ, dK)

At step t device d holds the key/value shard of device (d - t) mod P as in the forward ring, and with it
that shard's dK, dV accumulators. It adds its queries' share to them, keeps its own share of dQ (dQ never
leaves its device), and passes the shard and its accumulators on to d + 1. After P steps and P hops each
accumulator is back on the device that owns the shard, holding the sum over every device's queries; a device
holds O(L / P + S / P) rows throughout. Here the accumulators of the shard of device j are simply the rows
of j's chunks in dk and dv, wherever the shard is on its way round.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from attention_np.common import validation
from attention_np.common.records import FlashOptions

from .flash import _backward, _problem, flash_attention
from .functional import _dtypes
from .primitives import _parameter_dtype, _sink_gradient, _sink_logits, _sunk_rows


def ring_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    devices: int,
    is_causal: bool = False,
    scale: float | None = None,
    q_offset: int = 0,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    enable_gqa: bool = False,
    sinks: np.ndarray | None = None,
    alibi_slopes: np.ndarray | None = None,
    block_q: int = 128,
    block_k: int = 128,
) -> tuple[np.ndarray, np.ndarray]:
    """Attention(Q, K, V) over P shards of the sequence, each device's queries against the key/value shards
    passed around the ring, the partial results merged by their log-sum-exps.

    Args:
        q, k, v: as for flash_attention, the whole sequence; cut into P shards along axis -2.
        devices: P, the devices of the ring (simulated); L and S must be multiples of P, of 2P with is_causal.
        is_causal, scale, q_offset, window, softcap, enable_gqa: as for flash_attention; q_offset an int.
        sinks: one logit per head, broadcasting to (..., H), as for flash_attention: merged in once, after the
            ring, as one more partial result (out 0, lse the sink), never once per device.
        alibi_slopes: ALiBi's slopes, (H,) or (B, H), as for flash_attention: each chunk pair's tiles add
            -slope_h * |p_i - j| from their global positions (the pair's q_offset); constants, no gradient.
        block_q, block_k: as for flash_attention.

    Returns:
        out (..., L, Ev) and lse (..., L), flash_attention's.
    """
    validation.ring_offset(q_offset)  # one offset for every sequence: the devices' chunks are placed by it
    L, S = q.shape[-2], k.shape[-2]
    chunks = validation.ring_chunks(devices, L, S, is_causal)  # per device: its chunks, (start, stop) pairs
    options = dict(scale=scale, window=window, softcap=softcap, enable_gqa=enable_gqa, alibi_slopes=alibi_slopes,
                   block_q=block_q, block_k=block_k)
    empty_out, empty_lse = flash_attention(q[..., :0, :], k, v, is_causal=is_causal, q_offset=q_offset, **options)
    out = np.zeros((*empty_out.shape[:-2], L, v.shape[-1]), empty_out.dtype)  # what each device's queries have
    lse = np.full((*empty_lse.shape[:-1], L), -np.inf, empty_lse.dtype)  # seen so far (the checks done above)
    for device in range(devices):
        for step in range(devices):  # 1) the key/value shard this device holds at this step
            holder = (device - step) % devices
            for rows in chunks["q"][device]:  # 2) its queries against that shard, chunk by chunk
                for cols in chunks["k"][holder]:
                    part, part_lse = flash_attention(
                        q[..., slice(*rows), :], k[..., slice(*cols), :], v[..., slice(*cols), :],
                        is_causal=is_causal, q_offset=q_offset + rows[0] - cols[0], **options)
                    # (ALiBi's |p_i - j| of the pair's positions is the global one: both shift by the same)
                    # 3) merged into what this device's queries have seen so far
                    merged = _merged((out[..., slice(*rows), :], lse[..., slice(*rows)]), (part, part_lse))
                    out[..., slice(*rows), :], lse[..., slice(*rows)] = merged
    return _sunk_rows(out, lse, sinks)  # the sink joins each row once, after the ring


def ring_attention_vjp(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    devices: int,
    is_causal: bool = False,
    scale: float | None = None,
    q_offset: int = 0,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    enable_gqa: bool = False,
    sinks: np.ndarray | None = None,
    alibi_slopes: np.ndarray | None = None,
    block_q: int = 128,
    block_k: int = 128,
) -> tuple[np.ndarray, np.ndarray, Callable]:
    """ring_attention, and its pullback by the backward ring: at step t device d holds the key/value shard of
    device (d - t) mod P with that shard's dK, dV accumulators; each of its (query chunk, key chunk) pairs adds
    flash_attention's backward share from the global out and lse, P = exp(S - lse), D = rowsum(dO * O),
    dV += P^T dO, dP = dO V^T, dS = P * (dP - D), dQ += dS K * scale, dK += dS^T Q * scale (softcap: dS * (1 -
    tanh^2)); dQ stays on its device, the accumulators go on to d + 1 and are home after P steps.

    Args:
        q, k, v: as for ring_attention.
        devices: as for ring_attention.
        is_causal, scale, q_offset, window, softcap, enable_gqa, sinks, alibi_slopes, block_q, block_k: as for
            ring_attention; the slopes are constants (their bias joins S as bias does, dS unchanged).

    Returns:
        out (..., L, Ev), lse (..., L), ring_attention's, and pullback(d_out (..., L, Ev)) -> (dq, dk, dv),
        flash_attention_vjp's gradients, with sinks (dq, dk, dv, d_sinks); each has its input's shape and dtype.
        With sinks the global lse holds the sink, so the ring's P = exp(S - lse) are the final weights, and
        d sink = -sum_i exp(sink - lse_i) D_i over every row, once.
    """
    out, lse = ring_attention(q, k, v, devices=devices, is_causal=is_causal, scale=scale, q_offset=q_offset,
                              window=window, softcap=softcap, enable_gqa=enable_gqa, sinks=sinks,
                              alibi_slopes=alibi_slopes, block_q=block_q, block_k=block_k)  # global, and the checks
    options = FlashOptions(is_causal=is_causal, scale=scale, q_offset=q_offset, window=window, key_lengths=None,
                           softcap=softcap, enable_gqa=enable_gqa, block_q=block_q, block_k=block_k,
                           alibi_slopes=alibi_slopes)  # the slopes: constants, each pair's tiles rebuild the bias

    def pullback(d_out: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        validation.cotangent("d_out", d_out.shape, out.shape, _dtypes(d_out=d_out, out=out))
        grads = _ring_backward((q, k, v), (out, lse, d_out), devices, options)
        if sinks is None:
            return grads
        laid = _sink_logits(sinks, lse.shape[:-1], False, lse.dtype)  # (..., 1, 1)
        D = np.sum(d_out.astype(lse.dtype) * out.astype(lse.dtype), axis=-1, keepdims=True)  # (..., L, 1)
        share = np.exp(laid - np.where(lse == -np.inf, np.inf, lse)[..., None])  # (..., L, 1); 0 where lse -inf
        return (*grads, _sink_gradient(D, share, laid, np.shape(sinks)).astype(_parameter_dtype(sinks, lse.dtype)))

    return out, lse, pullback


def _ring_backward(inputs: tuple, outputs: tuple, devices: int,
                   options: FlashOptions) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """dq, dk, dv of the whole sequence, summed in lse's dtype (the scores', float32 for half precision) and cast
    to the inputs' at the end. inputs: q, k, v; outputs: the global out and lse and the cotangent d_out."""
    (q, k, v), lse = inputs, outputs[1]
    chunks = validation.ring_chunks(devices, q.shape[-2], k.shape[-2], options.is_causal)
    dq, dk, dv = (np.zeros(x.shape, lse.dtype) for x in (q, k, v))  # (..., L, E), (..., S, E), (..., S, Ev)
    for step in range(devices):
        for device in range(devices):
            # 1) the key/value shard this device holds at this step, with its dK, dV accumulators (simulated: the
            # holder's rows of dk and dv)
            holder = (device - step) % devices
            for rows in chunks["q"][device]:  # 2) each query chunk against each of the shard's key chunks
                for cols in chunks["k"][holder]:
                    pair = options._replace(q_offset=options.q_offset + rows[0] - cols[0])  # global positions
                    share = _pair_gradients(inputs, outputs, slice(*rows), slice(*cols), pair)
                    # 3) dQ stays on the device; dK, dV go into the accumulators, which travel on to device + 1
                    dq[..., slice(*rows), :] += share[0]
                    dk[..., slice(*cols), :] += share[1]
                    dv[..., slice(*cols), :] += share[2]
    return tuple(g.astype(x.dtype, copy=False) for g, x in zip((dq, dk, dv), inputs, strict=True))


def _pair_gradients(inputs: tuple, outputs: tuple, rows: slice, cols: slice,
                    options: FlashOptions) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One (query chunk, key chunk) pair's share of dq (..., L, E), dk (..., S, E) and dv (..., S, Ev), L and S
    the chunks' lengths, in the working dtype: flash_attention's backward pass of the two chunks (flash._backward)
    with the global out and lse of the chunk's query rows, so that P = exp(S - lse) are the weights over all
    keys. With enable_gqa dk and dv come back summed over each key/value head's group of query heads."""
    (q, k, v), (out, lse, d_out) = inputs, outputs
    p = _problem(q[..., rows, :], k[..., cols, :], v[..., cols, :], None, None, options)
    L = rows.stop - rows.start  # the chunk's
    # grouped as the problem groups the heads with enable_gqa (H -> Hkv, G), as flash._forward keeps them
    p = p._replace(out=out[..., rows, :].astype(p.work, copy=False).reshape(*p.batch, L, out.shape[-1]),
                   lse=lse[..., rows].astype(p.work, copy=False).reshape(*p.batch, L))  # (..., L, Ev), (..., L)
    dq, dk, dv, _ = _backward(p, d_out[..., rows, :], (p.q, p.k, p.v, None, None))  # p's dtypes: the working one
    return dq, dk, dv


def _merged(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Two partial attentions of the same queries over disjoint keys, as one: lse = logaddexp(lse_a, lse_b),
    out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b; a query that sees no key in either stays zeros
    and -inf (never exp(-inf - -inf) = NaN)."""
    (out_a, lse_a), (out_b, lse_b) = a, b
    lse = np.logaddexp(lse_a, lse_b)  # (..., L)
    seen = lse != -np.inf
    safe = np.where(seen, lse, 0.0)
    weight_a = np.where(seen, np.exp(lse_a - safe), 0.0)[..., None]  # (..., L, 1)
    weight_b = np.where(seen, np.exp(lse_b - safe), 0.0)[..., None]
    return (weight_a * out_a + weight_b * out_b).astype(out_a.dtype), lse
