"""Ring attention: the sequence sharded over one axis of a JAX device mesh, keys and values passed around the ring.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

Each of the P devices on mesh axis `axis` holds one shard of the queries and one of the keys and values. The
key/value shards travel around the ring (lax.ppermute, device d sends to d + 1), so after step s device i holds
the shard of device j = (i - s) mod P; at every step it attends its queries to the visiting keys with
flash_attention and merges the partial result into its running one by the log-sum-exp (SPEC 2c):
    lse = logaddexp(lse_a, lse_b),   out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b
where both parts see no key (lse_a = lse_b = -inf) the row stays zeros with lse -inf, never NaN.

Positions are global: a shard is a list of chunks, each with the global position of its first row, and the
query chunk starting at p attends the key chunk starting at t with q_offset = p - t + the caller's q_offset,
so that is_causal and window compare global positions (query p + i, key t + j); flash_attention's own tile
skipping then drops the chunk pairs the structure hides.

Layouts (validation.ring_chunks, shared by the backends): without is_causal each device holds one contiguous
shard, rows d n .. (d + 1) n - 1 (n = L / P; keys likewise), and nothing is permuted. With is_causal, the
zig-zag layout balances the work: the sequence is cut into 2P chunks of c = L / (2P) rows, and device i holds
chunks i and 2P - 1 - i (rows from i c and from (2P - 1 - i) c), one early and one late chunk, so every device
does the same causal work at every step. The caller passes and receives arrays in natural order: inside
shard_map, where device d holds the natural chunks 2d and 2d + 1, two ppermutes (one per chunk slot) move the
chunks to their zig-zag devices at entry, and the inverse ppermutes move out and lse back at exit. This is the
resharding written out, rather than left to XLA (under jit a gather on the sharded axis): each device sends and
receives L / P rows per array, and its memory stays L / P.

The gradient is the ring's own backward pass (jax.custom_vjp around the steps, inside shard_map), which keeps
only the local q, k, v shards, out and lse, so a device holds O(S / P) keys in the gradient too. It runs the
ring again: at step s device d holds the shard of j = (d - s) mod P together with that shard's dK, dV
accumulators, recomputes its queries against it with flash_attention's tiled backward pass (FA2, from the
global out and lse: P = exp(S - lse), D = rowsum(dO * O) - d_lse), keeps its dQ share and sends the shard and
the accumulators on to d + 1; after P steps the accumulators are home, each device holding the gradients of its
own k, v shards. The zig-zag ppermutes at entry and exit lie outside the custom_vjp and are differentiated by
JAX (the transpose of a ppermute is the inverse ppermute); the gradients come back sharded like the inputs.
ring_attention_vjp is jax.vjp of ring_attention: its pullback runs that backward ring.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from attention_np.common import validation
from attention_np.common.records import FlashOptions

from .flash import _backward_tiles, _pad, _problem, _tiled_inputs, _tiling, flash_attention
from .functional import _dtypes, _grouped
from .primitives import _alibi_slopes, _integers, _ranked, _sunk_rows


class _Layout(NamedTuple):
    """How the sequence lies on the P devices of the ring: `chunks` chunks per device (1 contiguous, 2 zig-zag)
    and the global start of each, (P, chunks) tables of the queries and of the keys, indexed by device (jax:
    nested tuples, made arrays where they are read, so that no array of one trace is kept for another)."""

    chunks: int
    q_starts: tuple
    k_starts: tuple


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mesh: Mesh,
    axis: str,
    is_causal: bool = False,
    scale: float | None = None,
    q_offset: int = 0,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    enable_gqa: bool = False,
    sinks: jax.Array | None = None,
    alibi_slopes: jax.Array | None = None,
    block_q: int = 128,
    block_k: int = 128,
) -> tuple[jax.Array, jax.Array]:
    """Attention(Q, K, V) = softmax(softcap(Q K^T * scale)) V with the sequence axis sharded over mesh axis
    `axis`: the key/value shards go around the ring, each step merged in by the log-sum-exp.

    Args:
        q, k, v: as for flash_attention, global arrays whose axis -2 is (or will be) sharded over `axis`.
        mesh: the jax.sharding.Mesh; the leading axes (...) may be sharded over its other axes.
        axis: the name of the mesh axis the sequence is sharded over; L and S must be multiples of its size P,
            of 2P with is_causal (the zig-zag layout).
        is_causal, scale, q_offset, window, softcap, enable_gqa: as for flash_attention, on global positions;
            q_offset a Python int.
        sinks: one logit per head, broadcasting to (..., H), as for flash_attention: merged in once, after the
            ring, as one more partial result (out 0, lse the sink), never once per device.
        alibi_slopes: ALiBi's slopes, (H,) or (B, H), as for flash_attention: each chunk pair's tiles add
            -slope_h * |p_i - j| from their global positions (the pair's q_offset); constants, no gradient.
        block_q, block_k: as for flash_attention.

    Returns:
        out (..., L, Ev) and lse (..., L), sharded like q: flash_attention's on one device.
    """
    if axis not in mesh.axis_names:
        raise ValueError(f"ring_attention: axis {axis!r} is not an axis of the mesh {mesh.axis_names}")
    validation.ring_offset(q_offset)  # one offset for every sequence: the devices' chunks are placed by it
    try:  # the layout every backend shares: the chunks of each device, or the error naming L or S and P
        chunks = validation.ring_chunks(mesh.shape[axis], q.shape[-2], k.shape[-2], bool(is_causal))
    except ValueError as error:
        raise ValueError(f"{error}, on mesh axis {axis!r}") from None
    starts = tuple(tuple(tuple(start for start, _ in device) for device in chunks[x]) for x in ("q", "k"))
    window = None if window is None else tuple(window)
    options = FlashOptions(is_causal=bool(is_causal), scale=scale, q_offset=int(q_offset), window=window,
                           key_lengths=None, softcap=softcap, enable_gqa=enable_gqa, block_q=block_q, block_k=block_k)
    slopes = None if alibi_slopes is None else jnp.asarray(alibi_slopes)  # the same on every device
    out, lse = _mapped(mesh, axis, (q.ndim, k.ndim, v.ndim), starts, options)(q, k, v, slopes)
    return _sunk_rows(out, lse, sinks)  # the sink joins each row once, after the ring (jax: elementwise on the
    # global arrays, differentiated by JAX, the ring's own backward taking d_lse)


def ring_attention_vjp(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mesh: Mesh,
    axis: str,
    is_causal: bool = False,
    scale: float | None = None,
    q_offset: int = 0,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    enable_gqa: bool = False,
    sinks: jax.Array | None = None,
    alibi_slopes: jax.Array | None = None,
    block_q: int = 128,
    block_k: int = 128,
) -> tuple[jax.Array, jax.Array, Callable]:
    """ring_attention, and its pullback by the backward ring: at step t device d holds the key/value shard of
    device (d - t) mod P with that shard's dK, dV accumulators; each of its (query chunk, key chunk) pairs adds
    flash_attention's backward share from the global out and lse, P = exp(S - lse), D = rowsum(dO * O),
    dV += P^T dO, dP = dO V^T, dS = P * (dP - D), dQ += dS K * scale, dK += dS^T Q * scale (softcap: dS * (1 -
    tanh^2)); dQ stays on its device, the accumulators go on to d + 1 and are home after P steps.

    Args:
        q, k, v: as for ring_attention.
        mesh, axis: as for ring_attention.
        is_causal, scale, q_offset, window, softcap, enable_gqa, sinks, alibi_slopes, block_q, block_k: as for
            ring_attention; the slopes are constants (their bias joins S as bias does, dS unchanged).

    Returns:
        out (..., L, Ev), lse (..., L), ring_attention's, and pullback(d_out (..., L, Ev)) -> (dq, dk, dv),
        flash_attention_vjp's gradients, with sinks (dq, dk, dv, d_sinks); each has its input's shape and dtype.
    """
    options = dict(mesh=mesh, axis=axis, is_causal=is_causal, scale=scale, q_offset=q_offset, window=window,
                   softcap=softcap, enable_gqa=enable_gqa, block_q=block_q, block_k=block_k)
    sinks = None if sinks is None else jnp.asarray(sinks)  # jax: differentiated as an argument
    (out, lse), pull = jax.vjp(lambda q, k, v, sinks: ring_attention(q, k, v, sinks=sinks,
                                                                     alibi_slopes=alibi_slopes, **options),
                               q, k, v, sinks)  # jax: the slopes closed over, constants
    # jax: autodiff of the forward, whose ring is a custom_vjp carrying the backward ring (_ring_backward)

    def pullback(d_out: jax.Array) -> tuple:
        validation.cotangent("d_out", d_out.shape, out.shape, _dtypes(d_out=d_out, out=out))
        *grads, d_sinks = pull((d_out, jnp.zeros_like(lse)))  # jax: lse is an output too; its cotangent is 0
        return tuple(grads) if sinks is None else (*grads, d_sinks)

    return out, lse, pullback


@functools.lru_cache(maxsize=64)
def _mapped(mesh: Mesh, axis: str, ndims: tuple[int, int, int], starts: tuple,
            options: FlashOptions) -> Callable:
    """The jitted shard_map of one configuration (jax: built once, so that eager calls do not retrace).
    starts: per device, the global starts of its query chunks and of its key chunks (validation.ring_chunks)."""
    ring = mesh.shape[axis]
    q_starts, k_starts = starts
    layout = _Layout(chunks=len(q_starts[0]), q_starts=q_starts, k_starts=k_starts)
    config = dict(axis=axis, ring=ring, layout=layout, options=options)  # _ring's and _ring_backward's keywords

    @jax.custom_vjp
    def attend(q: jax.Array, k: jax.Array, v: jax.Array, slopes: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        return _ring(q, k, v, slopes, lax.axis_index(axis), **config)  # this device's place on the ring

    def attend_forward(q: jax.Array, k: jax.Array, v: jax.Array, slopes: jax.Array | None) -> tuple:
        out, lse = attend(q, k, v, slopes)
        return (out, lse), (q, k, v, slopes, out, lse)  # kept for the backward ring: the local shards, O(S / P)

    def attend_backward(kept: tuple, cotangents: tuple) -> tuple:
        grads = _ring_backward(*kept, *cotangents, lax.axis_index(axis), **config)
        return (*grads, None)  # ALiBi's slopes: constants, no gradient

    attend.defvjp(attend_forward, attend_backward)

    def shard(q: jax.Array, k: jax.Array, v: jax.Array, slopes: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        q, k, v = (_to_layout(x, axis, ring, layout) for x in (q, k, v))  # differentiated by JAX, as ppermutes
        out, lse = attend(q, k, v, slopes)
        return _from_layout(out, axis, ring, layout), _from_layout(lse[..., None], axis, ring, layout)[..., 0]

    def spec(ndim: int) -> P:  # the sequence axis (-2) over `axis`, the others left to the compiler
        return P(*[None] * (ndim - 2), axis, None)

    lse_spec = P(*[None] * (ndims[0] - 2), axis)  # (..., L)
    mapped = jax.shard_map(shard, mesh=mesh, in_specs=(*(spec(n) for n in ndims), P()),  # the slopes: on every device
                           out_specs=(spec(ndims[0]), lse_spec), axis_names=frozenset({axis}),
                           check_vma=False)
    # jax: manual over `axis` only; the other mesh axes stay automatic, so batch or heads sharded over them
    # stay sharded. check_vma=False: flash_attention's loops start their carries from fresh (unvarying) zeros;
    # every value here varies over the ring, and no collective reduces over it, so there is nothing to check
    return jax.jit(mapped)


def _ring(q: jax.Array, k: jax.Array, v: jax.Array, slopes: jax.Array | None, d: jax.Array, *, axis: str,
          ring: int, layout: _Layout, options: FlashOptions) -> tuple[jax.Array, jax.Array]:
    """Device d's out (..., Lc, Ev) and lse (..., Lc) over all P key/value shards: its own first, then the
    P - 1 visitors; each shard is sent on to the next device while it is attended (P - 1 hops). slopes: ALiBi's
    (H,) or (B, H), or None, passed to every chunk pair's flash_attention."""
    lq, lk = q.shape[-2] // layout.chunks, k.shape[-2] // layout.chunks  # rows per chunk
    q_starts, k_starts = jnp.asarray(layout.q_starts)[d], jnp.asarray(layout.k_starts)  # (chunks,), (P, chunks)
    rotate = [(i, (i + 1) % ring) for i in range(ring)]  # device i sends to i + 1

    def attend(k: jax.Array, v: jax.Array, j: jax.Array) -> list[tuple[jax.Array, jax.Array]]:
        """Each query chunk of d against the key chunks of device j: (out, lse) per query chunk, merged."""
        parts = []
        for a in range(layout.chunks):
            q_a = q[..., a * lq:(a + 1) * lq, :]  # (..., Lc, E)
            merged = None
            for b in range(layout.chunks):
                offset = q_starts[a] - k_starts[j, b] + options.q_offset  # global positions
                part = flash_attention(q_a, k[..., b * lk:(b + 1) * lk, :], v[..., b * lk:(b + 1) * lk, :],
                                       **options._replace(q_offset=offset, alibi_slopes=slopes)._asdict())
                merged = part if merged is None else _merge(merged, part)
            parts.append(merged)
        return parts

    def step(carry: tuple, s: jax.Array) -> tuple:
        k, v, parts = carry
        k_next, v_next = lax.ppermute(k, axis, rotate), lax.ppermute(v, axis, rotate)  # on its way meanwhile
        parts = [_merge(a, b) for a, b in zip(parts, attend(k, v, (d - s) % ring), strict=True)]
        return (k_next, v_next, parts), None

    # nothing seen yet: zeros and lse -inf, in the dtype flash_attention's lse has (float32 for half precision)
    parts = [(jnp.zeros(out.shape, lse.dtype), jnp.full(lse.shape, -jnp.inf, lse.dtype))
             for out, lse in jax.eval_shape(attend, k, v, d)]
    # steps 0 .. P - 2 attend the shard at hand while sending it on; the last one, P - 1 hops in all
    (k, v, parts), _ = lax.scan(step, (k, v, parts), jnp.arange(ring - 1, dtype=d.dtype))
    parts = [_merge(a, b) for a, b in zip(parts, attend(k, v, (d - (ring - 1)) % ring), strict=True)]
    out = jnp.concatenate([out.astype(q.dtype) for out, _ in parts], axis=-2)  # (..., Lc, Ev), as q's dtype
    return out, jnp.concatenate([lse for _, lse in parts], axis=-1)


def _ring_backward(q: jax.Array, k: jax.Array, v: jax.Array, slopes: jax.Array | None, out: jax.Array,
                   lse: jax.Array, d_out: jax.Array, d_lse: jax.Array, d: jax.Array, *, axis: str, ring: int,
                   layout: _Layout, options: FlashOptions) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Device d's dq (..., Lc, E) and the dk, dv of its own key/value shard: the ring again, in the forward's
    order. At step s device d holds the shard of j = (d - s) mod P and that shard's dK, dV accumulators; it
    adds what its queries contribute (the tiled backward pass against the global out and lse), keeps its dQ
    share and sends the shard (P - 1 hops) and its accumulators (P hops, the last one home) to d + 1."""
    lq, lk = q.shape[-2] // layout.chunks, k.shape[-2] // layout.chunks  # rows per chunk
    q_starts, k_starts = jnp.asarray(layout.q_starts)[d], jnp.asarray(layout.k_starts)
    rotate = [(i, (i + 1) % ring) for i in range(ring)]  # device i sends to i + 1
    work = lse.dtype  # the gradients are summed in the scores' dtype, cast to the inputs' at the end

    def rows(x: jax.Array, a: int, n: int, trailing: int = 1) -> jax.Array:  # chunk a, n rows, of (..., n_all, *)
        return lax.slice_in_dim(x, a * n, (a + 1) * n, axis=x.ndim - 1 - trailing)

    def gradients(k: jax.Array, v: jax.Array, j: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """dq, dk, dv of every query chunk of d against every key chunk of device j."""
        dq, dk, dv = [0.0] * layout.chunks, [0.0] * layout.chunks, [0.0] * layout.chunks
        for a in range(layout.chunks):
            for b in range(layout.chunks):
                offset = q_starts[a] - k_starts[j, b] + options.q_offset  # global positions
                g = _chunk_backward(rows(q, a, lq), rows(k, b, lk), rows(v, b, lk), rows(out, a, lq),
                                    rows(lse, a, lq, 0), rows(d_out, a, lq), rows(d_lse, a, lq, 0), offset,
                                    options._replace(alibi_slopes=slopes))
                dq[a], dk[b], dv[b] = dq[a] + g[0], dk[b] + g[1], dv[b] + g[2]
        return tuple(jnp.concatenate(x, axis=-2) for x in (dq, dk, dv))

    def visit(k: jax.Array, v: jax.Array, dk: jax.Array, dv: jax.Array, dq: jax.Array, s: jax.Array) -> tuple:
        dq_s, dk_s, dv_s = gradients(k, v, (d - s) % ring)
        dk, dv = (lax.ppermute(x, axis, rotate) for x in (dk + dk_s, dv + dv_s))  # on with the shard
        return dk, dv, dq + dq_s

    def step(carry: tuple, s: jax.Array) -> tuple:
        k, v, dk, dv, dq = carry
        k_next, v_next = lax.ppermute(k, axis, rotate), lax.ppermute(v, axis, rotate)  # on its way meanwhile
        return (k_next, v_next, *visit(k, v, dk, dv, dq, s)), None

    zeros = [jnp.zeros(x.shape, work) for x in (k, v, q)]  # dk, dv, dq
    (k, v, dk, dv, dq), _ = lax.scan(step, (k, v, *zeros), jnp.arange(ring - 1, dtype=d.dtype))
    dk, dv, dq = visit(k, v, dk, dv, dq, jnp.asarray(ring - 1, d.dtype))  # the last step: dK, dV go home
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _chunk_backward(q: jax.Array, k: jax.Array, v: jax.Array, out: jax.Array, lse: jax.Array, d_out: jax.Array,
                    d_lse: jax.Array, q_offset: jax.Array,
                    options: FlashOptions) -> tuple[jax.Array, jax.Array, jax.Array]:
    """flash_attention's tiled backward pass (FA2) of the queries q against the keys k, v only, from the out,
    lse and cotangents of the queries over all keys: P = exp(S - lse) are then the global weights, and with
    D = rowsum(dO * O) - d_lse the chunk's dq, dk, dv are its terms of the global gradients, in lse's dtype.
    flash._forward's preparation (grouping, tiling, padding) without mask, bias and key_lengths; ALiBi's slopes
    (options.alibi_slopes) laid out as flash._forward lays them."""
    shapes = (q.shape, k.shape, v.shape)
    if options.enable_gqa:  # (..., H, L, *) -> (..., Hkv, G, L, *), as flash._forward does
        H, Hkv = validation.grouped_heads(q.shape, k.shape, v.shape)
        q, k, v, _, _, q_offset, _ = _grouped(q, k, v, None, None, q_offset, None)
        out, d_out = (x.reshape(validation.grouped_shape(x.shape, H, Hkv, 2)) for x in (out, d_out))
        lse, d_lse = (x.reshape(validation.grouped_shape(x.shape, H, Hkv, 1)) for x in (lse, d_lse))
    batch, L, S = validation.attention_batch(q.shape, k.shape, v.shape), q.shape[-2], k.shape[-2]
    tiling = _tiling(batch, L, S, validation.default_scale(options.scale, q.shape, k.shape), options)
    arrays = _tiled_inputs(tiling, lse.dtype, q, k, v, None, None, _integers(q_offset, "q_offset", batch), None)
    n, Lp = len(batch) + 2, arrays[0].shape[-2]
    out, d_out = (_pad(_ranked(x, n).astype(lse.dtype), Lp) for x in (out, d_out))  # (..., Lp, Ev)
    lse, d_lse = (_pad(_ranked(x, n - 1), Lp, axis=-1) for x in (lse, d_lse))  # (..., Lp); padding: not seen
    slopes = _alibi_slopes(options.alibi_slopes, batch, options.enable_gqa, lse.dtype)  # (..., 1, 1), or None
    grads = _backward_tiles(_problem(tiling, *arrays, slopes=slopes), out, lse, d_out, d_lse)[:3]
    return tuple(g[..., :size, :].reshape(shape) for g, size, shape in zip(grads, (L, S, S), shapes, strict=True))


def _merge(a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Two partial results over disjoint keys as one: lse = logaddexp(lse_a, lse_b), out = exp(lse_a - lse)
    out_a + exp(lse_b - lse) out_b, in lse's dtype (float32 for half-precision inputs)."""
    (out_a, lse_a), (out_b, lse_b) = a, b
    lse = jnp.logaddexp(lse_a, lse_b)  # (..., Lc); -inf where neither part sees a key
    seen = lse != -jnp.inf
    shift = jnp.where(seen, lse, 0.0)  # a row that sees nothing: exp(-inf - 0) = 0 for both, no -inf - -inf
    w_a, w_b = (jnp.exp(x - shift)[..., None] for x in (lse_a, lse_b))  # (..., Lc, 1)
    out = w_a * out_a.astype(lse.dtype) + w_b * out_b.astype(lse.dtype)  # (..., Lc, Ev)
    return out, lse


def _to_layout(x: jax.Array, axis: str, ring: int, layout: _Layout) -> jax.Array:
    """Device d's natural rows (chunks 2d, 2d + 1) as its zig-zag rows (chunks d, 2P - 1 - d); the contiguous
    layout is the natural one. Natural chunk m goes to device m (m < P) or 2P - 1 - m (m >= P): for each slot
    t (m = 2d + t) that is a permutation of the devices, so one ppermute per slot."""
    if layout.chunks == 1:
        return x
    c = x.shape[-2] // 2
    received = [lax.ppermute(x[..., t * c:(t + 1) * c, :], axis, _slot_permutation(t, ring)) for t in (0, 1)]
    # device i receives an even chunk from slot 0 and an odd one from slot 1; chunk i is the even one iff i is even
    even = lax.axis_index(axis) % 2 == 0
    first, second = (jnp.where(even, *pair) for pair in (received, received[::-1]))
    return jnp.concatenate([first, second], axis=-2)


def _from_layout(x: jax.Array, axis: str, ring: int, layout: _Layout) -> jax.Array:
    """_to_layout turned around: the zig-zag chunks d, 2P - 1 - d back to the natural chunks 2d, 2d + 1."""
    if layout.chunks == 1:
        return x
    c = x.shape[-2] // 2
    even = lax.axis_index(axis) % 2 == 0
    first, second = x[..., :c, :], x[..., c:, :]
    sent = [jnp.where(even, first, second), jnp.where(even, second, first)]  # the even chunk, then the odd one
    inverse = [[(dst, src) for src, dst in _slot_permutation(t, ring)] for t in (0, 1)]
    return jnp.concatenate([lax.ppermute(sent[t], axis, inverse[t]) for t in (0, 1)], axis=-2)


def _slot_permutation(t: int, ring: int) -> list[tuple[int, int]]:
    """(source, destination) for the natural chunk m = 2d + t of every device d: to device m or 2P - 1 - m."""
    return [(d, 2 * d + t if 2 * d + t < ring else 2 * ring - 1 - (2 * d + t)) for d in range(ring)]
