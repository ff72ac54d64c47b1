"""Ring attention over torch.distributed: the sequence split across the P ranks of a process group, the key/value
blocks passed around the ring, the partial results merged through the log-sum-exp (SPEC 2c).

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

Callers pass and receive contiguous shards: rank r holds queries r L/P .. (r + 1) L/P - 1, keys and values
r S/P .. (r + 1) S/P - 1. The ring runs in the layout of validation.ring_chunks, shared by the backends: without
is_causal the contiguous shards themselves (one chunk per rank, nothing moves); with is_causal the zig-zag
layout, the sequence cut into 2P chunks and rank d holding chunks d and 2P - 1 - d, one early and one late, so
that every rank does the same causal work (with contiguous shards rank r would compute r + 1 of the P blocks
and the ring would run at the pace of the last rank). At entry point-to-point sends move the caller's natural
chunks 2r, 2r + 1 to their zig-zag ranks; at exit out and lse move back (the backward pass likewise moves
d_out, d_lse in and dq, dk, dv out). Each rank sends and receives L/P rows per array for it.

At step t = 0 .. P - 1 rank r holds the key/value block of rank s = (r - t) mod P and attends each of its query
chunks to each of the block's key chunks with the tiled kernel (flash.py), one call per chunk pair, at
    q_offset = (query chunk start) - (key chunk start) + q_offset     so causal and window follow global positions
skipping the pairs the structure hides wholly (_schedule); each result is merged in place into the query
chunk's running (out, lse), the merge of SPEC 2c's lse rule:
    lse = log(exp(lse_a) + exp(lse_b)),   out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b
(a row that sees nothing in either part stays zeros with lse -inf, never NaN). While it computes, the block
already travels on: it is sent to rank r + 1 and the next one received from rank r - 1 (batch_isend_irecv),
and waited for only after the compute. Each rank sends 2 (S/P) E (k and v, Ev = E) elements per step.

Memory: the ring receives into two buffers it allocates once and alternates (the one received at step t is
sent at step t + 1 while the other, sent at step t and so free, receives), and accumulates out, lse, dq and
the travelling dk, dv in place, so a rank holds O(L/P + S/P): the whole sequence never sits on one rank.

The backward pass runs the ring again: each step recomputes the visiting block's share of the gradients from
the saved global out and lse and d_out (flash._backward: P = exp(S - lse), D = rowsum(dO * O)). dq stays
and accumulates; the dk, dv accumulators travel with their k, v block (in two alternating buffers as well), so
after P steps, one more hop, they are back at the block's owner holding the sum over every rank's queries.
ring_attention_vjp records ring_attention for autograd, as flash_attention_vjp does; its pullback runs that
backward ring, so every rank of the group calls it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from attention_np.common import validation
from attention_np.common.records import FlashOptions

from .flash import _backward, _forward, _heads, _Problem, _problem
from .functional import _dtypes
from .gradients import _grad, _leaf, _recording
from .primitives import _cast, _sunk_rows

KV_TAG, GRAD_TAG, LAYOUT_TAG = 0, 1, 2  # gloo matches messages by (peer, tag): blocks, gradients, layout moves
# (LAYOUT_TAG + slot: with odd P one rank may send both its chunks to the same rank)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    q_offset: int = 0,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    enable_gqa: bool = False,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    block_q: int = 128,
    block_k: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention(Q, K, V) = softmax(softcap(Q K^T * scale)) V over the whole sequence, the sequence split across
    the ranks of `group`; called on every rank with that rank's contiguous shard.

    Args:
        q: this rank's queries (..., L/P, E), global positions r L/P .. (r + 1) L/P - 1.
        k: this rank's keys (..., S/P, E), global positions r S/P .. (r + 1) S/P - 1.
        v: this rank's values (..., S/P, Ev).
        group: the process group of the P ranks (None: the default group).
        is_causal, scale, q_offset, window, softcap, enable_gqa: as for flash_attention, in global positions.
        sinks: one logit per head, broadcasting to (..., H), the same on every rank, as for flash_attention:
            merged in once, after the ring, as one more partial result (out 0, lse the sink), never once per
            rank; autograd gives each rank its own rows' share of its gradient.
        alibi_slopes: ALiBi's slopes, (H,) or (B, H), the same on every rank, as for flash_attention: each chunk
            pair's tiles add -slope_h * |p_i - j| from their global positions (the pair's q_offset); constants,
            no gradient.
        block_q, block_k: the tiles of the kernel on each rank.

    Returns:
        out (..., L/P, Ev) and lse (..., L/P): this rank's rows of flash_attention on the whole sequence.

    Raises:
        ValueError: the ranks' shapes differ (a sequence that does not split into P equal shards), q, k, v
            cannot be shards (rank below 2, k and v of different lengths), or with is_causal L = P L/P or
            S = P S/P is not a multiple of 2P (validation.ring_chunks' message, on every rank); q_offset is not a
            Python int.
    """
    validation.ring_offset(q_offset)  # one offset for every sequence: the ranks' chunks are placed by it
    options = FlashOptions(is_causal=is_causal, scale=scale, q_offset=q_offset, window=window, key_lengths=None,
                           softcap=softcap, enable_gqa=enable_gqa, block_q=block_q, block_k=block_k,
                           alibi_slopes=alibi_slopes)  # the slopes ride to every chunk pair's tiles, constants
    _check_shards(q, k, v, group)
    layout = _layout(dist.get_world_size(group), q.shape[-2], k.shape[-2], bool(is_causal))  # or the ValueError
    return _sunk_rows(*_Ring.apply(q, k, v, options, layout, group), sinks)  # the sink joins each row once, after
    # the ring (torch: autograd takes its gradients to _Ring.backward as d_out and d_lse)


def ring_attention_vjp(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    q_offset: int = 0,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    enable_gqa: bool = False,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    block_q: int = 128,
    block_k: int = 128,
) -> tuple[torch.Tensor, torch.Tensor, Callable]:
    """ring_attention, and its pullback by the backward ring: at step t device d holds the key/value shard of
    device (d - t) mod P with that shard's dK, dV accumulators; each of its (query chunk, key chunk) pairs adds
    flash_attention's backward share from the global out and lse, P = exp(S - lse), D = rowsum(dO * O),
    dV += P^T dO, dP = dO V^T, dS = P * (dP - D), dQ += dS K * scale, dK += dS^T Q * scale (softcap: dS * (1 -
    tanh^2)); dQ stays on its device, the accumulators go on to d + 1 and are home after P steps.

    Args:
        q, k, v: as for ring_attention, this rank's contiguous shards.
        group: as for ring_attention.
        is_causal, scale, q_offset, window, softcap, enable_gqa, sinks, alibi_slopes, block_q, block_k: as for
            ring_attention; the slopes are constants (their bias joins S as bias does, dS unchanged).

    Returns:
        out (..., L/P, Ev), lse (..., L/P), ring_attention's, and pullback(d_out (..., L/P, Ev)) -> (dq, dk, dv),
        the gradients of this rank's shards (flash_attention_vjp's rows); each has its input's shape and dtype.
        With sinks (dq, dk, dv, d_sinks), d_sinks the whole sequence's, its ranks' shares summed (all_reduce).
        Every rank of the group calls the pullback: the backward ring passes blocks between them.
    """
    # torch: autograd records the call (also inside torch.no_grad() and torch.inference_mode(), as
    # flash_attention_vjp does), and the pullback runs _Ring.backward, the backward ring
    with _recording():
        inputs = [_leaf(x) for x in (q, k, v)]
        sunk = [] if sinks is None else [_leaf(torch.as_tensor(sinks, device=q.device))]  # torch: a leaf too
        out, lse = ring_attention(*inputs, group=group, is_causal=is_causal, scale=scale, q_offset=q_offset,
                                  window=window, softcap=softcap, enable_gqa=enable_gqa,
                                  sinks=sunk[0] if sunk else None, alibi_slopes=alibi_slopes, block_q=block_q,
                                  block_k=block_k)

    def pullback(d_out: torch.Tensor) -> tuple:
        validation.cotangent("d_out", d_out.shape, out.shape, _dtypes(d_out=d_out, out=out))
        dq, dk, dv, *d_sinks = _grad(out, [*inputs, *sunk], d_out)
        for share in d_sinks:  # this rank's rows' share; every rank holds the same sinks: the sum over the ranks
            dist.all_reduce(share, group=group)
        return dq, dk, dv, *d_sinks

    return out.detach(), lse.detach(), pullback


def _check_shards(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Every rank holds shards of the same shapes, so the global sequence is P times each. The shapes are
    gathered from all ranks (one small collective), so every rank raises the same error, none waits forever."""
    if not dist.is_initialized():
        raise ValueError("ring_attention needs an initialised torch.distributed process group")
    P = dist.get_world_size(group)
    shapes = (tuple(q.shape), tuple(k.shape), tuple(v.shape))
    gathered: list = [None] * P
    dist.all_gather_object(gathered, shapes, group=group)
    if any(shape != shapes for shape in gathered):
        listed = "; ".join(f"rank {r}: q {s[0]}, k {s[1]}, v {s[2]}" for r, s in enumerate(gathered))
        whole = ""  # the lengths the ranks' shards add up to, which P does not split evenly
        if all(len(s[0]) >= 2 and len(s[1]) >= 2 for s in gathered):
            whole = (f": L = {sum(s[0][-2] for s in gathered)}, S = {sum(s[1][-2] for s in gathered)} over the "
                     f"ranks")
        raise ValueError(f"ring_attention needs shards of the same shapes on all P = {P} ranks (the sequence "
                         f"split into P equal, contiguous parts){whole}; got {listed}")
    if q.dim() < 2 or k.dim() < 2 or v.dim() < 2 or k.shape[-2] != v.shape[-2]:
        raise ValueError(f"ring_attention needs shards q (..., L/P, E), k (..., S/P, E), v (..., S/P, Ev) on each "
                         f"of the P = {P} ranks; got q {shapes[0]}, k {shapes[1]}, v {shapes[2]}")


class _Layout(NamedTuple):
    """The chunks of the sequence on the P ranks: per rank the global chunk numbers of the caller's contiguous
    shard (`natural`: 2r, 2r + 1 with is_causal, r without) and of the ring's layout (`ring`: r, 2P - 1 - r with
    is_causal, validation.ring_chunks), and the rows of one query chunk and of one key chunk."""

    natural: tuple[tuple[int, ...], ...]
    ring: tuple[tuple[int, ...], ...]
    rows_q: int
    rows_k: int


def _layout(P: int, L_shard: int, S_shard: int, is_causal: bool) -> _Layout:
    """The layout of shards of L_shard queries and S_shard keys on P ranks; validation.ring_chunks' ValueError
    unless L = P L_shard and S = P S_shard split into its chunks (2P of them with is_causal)."""
    chunks = validation.ring_chunks(P, P * L_shard, P * S_shard, is_causal)  # per rank: (start, stop) pairs
    n = len(chunks["q"][0])  # chunks per rank: 1, or 2 in the zig-zag layout
    rows_q, rows_k = L_shard // n, S_shard // n
    ring = tuple(tuple(start // rows_q for start, _ in rank) for rank in chunks["q"])
    natural = tuple(tuple(r * n + i for i in range(n)) for r in range(P))
    return _Layout(natural=natural, ring=ring, rows_q=rows_q, rows_k=rows_k)


def _schedule(layout: _Layout, r: int, options: FlashOptions) -> list[list[tuple[int, int, FlashOptions]]]:
    """Per step t = 0 .. P - 1, the chunk pairs (a, b) rank r computes (its query chunk a against key chunk b of
    the block of rank (r - t) mod P) and their options, at global positions; the pairs hidden wholly skipped."""
    P, steps = len(layout.ring), []
    for t in range(P):
        s, pairs = (r - t) % P, []
        for a, m in enumerate(layout.ring[r]):
            for b, j in enumerate(layout.ring[s]):
                offset = options.q_offset + m * layout.rows_q - j * layout.rows_k  # query start - key start
                step = options._replace(q_offset=offset)
                if _visible(step, layout.rows_q, layout.rows_k):
                    pairs.append((a, b, step))
        steps.append(pairs)
    return steps


class _Ring(torch.autograd.Function):
    """torch: the ring forward and the ring backward as one autograd operation; it keeps this rank's q, k, v
    chunks in the ring's layout and its global out and lse (grouped with enable_gqa, in the working dtype),
    nothing of size L * S."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                options: FlashOptions, layout: _Layout,
                group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
        qs, ks, vs = (_to_ring(x, layout, group) for x in (q, k, v))  # lists of chunks (..., rows, *)
        outs, lses, p = _ring_forward(qs, ks, vs, layout, options, group)
        ctx.options, ctx.layout, ctx.group, ctx.chunks = options, layout, group, len(qs)
        ctx.save_for_backward(*qs, *ks, *vs, *outs, *lses)
        out = _to_natural([_cast(_heads(p, x), q.dtype) for x in outs], layout, group)  # (..., L/P, Ev)
        lse = _to_natural([_heads(p, x)[..., None] for x in lses], layout, group)[..., 0]  # (..., L/P)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: torch.autograd.function.FunctionCtx, d_out: torch.Tensor, d_lse: torch.Tensor) -> tuple:
        n, saved = ctx.chunks, ctx.saved_tensors
        qs, ks, vs, outs, lses = (list(saved[i * n:(i + 1) * n]) for i in range(5))
        d_outs = _to_ring(d_out, ctx.layout, ctx.group)
        d_lses = [x[..., 0] for x in _to_ring(d_lse[..., None], ctx.layout, ctx.group)]
        grads = _ring_backward(qs, ks, vs, outs, lses, d_outs, d_lses, ctx.layout, ctx.options, ctx.group)
        dq, dk, dv = (_to_natural(g, ctx.layout, ctx.group).to(x.dtype) for g, x in zip(grads, (qs[0], ks[0], vs[0]),
                                                                                          strict=True))
        return dq, dk, dv, None, None, None


def _ring_forward(q: list[torch.Tensor], k: list[torch.Tensor], v: list[torch.Tensor], layout: _Layout,
                  options: FlashOptions, group: dist.ProcessGroup | None) -> tuple[list, list, _Problem]:
    """This rank's out (..., L/P, Ev) and lse (..., L/P) per query chunk, grouped and in the working dtype, merged
    over the P blocks; and the problem of one chunk pair (its grouping)."""
    P, r = dist.get_world_size(group), dist.get_rank(group)
    p = _problem(q[0], k[0], v[0], None, None, options)  # the grouping and the working dtype, nothing computed
    out = [torch.zeros((*p.batch, layout.rows_q, p.v.shape[-1]), dtype=p.work, device=q[0].device) for _ in q]
    lse = [torch.full((*p.batch, layout.rows_q), -math.inf, dtype=p.work, device=q[0].device) for _ in q]
    n, block, spares = len(k), (*k, *v), [None, None]
    for t, pairs in enumerate(_schedule(layout, r, options)):
        # 1) start passing the block on; the next one arrives meanwhile, into the spare buffer free at step t
        exchange = _start_exchange(block, spares, t % 2, group, KV_TAG) if t < P - 1 else None
        # 2) this rank's query chunks against the visiting block's key chunks, at their relative positions
        for a, b, step in pairs:
            _, _, part = _forward(q[a], block[b], block[n + b], None, None, step)
            _merge_into(out[a], lse[a], part.out, part.lse)
        # 3) the next block, received
        block = _finish(exchange) if exchange is not None else block
    return out, lse, p


def _visible(step: FlashOptions, L_shard: int, S_shard: int) -> bool:
    """Whether the structure (is_causal, window) leaves any key of the block visible to some query."""
    q_offset = step.q_offset
    offsets = (int(q_offset.min()), int(q_offset.max())) if isinstance(q_offset, torch.Tensor) else (q_offset,) * 2
    tiles = validation.key_tiles(0, L_shard, S_shard, max(S_shard, 1), is_causal=step.is_causal,
                             window=validation.window(step.window), q_offset=offsets, key_lengths=None)
    return len(tiles) > 0


def _merge_into(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """(out, lse) <- lse = log(exp(lse_a) + exp(lse_b)), out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b,
    in place. A row that sees no key in either part has lse -inf: its weights exp(-inf - -inf) would be NaN,
    so they are 0 there (where the row stays zeros and lse -inf)."""
    merged = torch.logaddexp(lse, lse_b)  # (..., L); -inf where both are
    shift = torch.where(merged != -math.inf, merged, 0)  # a row that sees nothing: exp(-inf - 0) = 0 for both
    out.mul_(torch.exp(lse - shift)[..., None]).addcmul_(torch.exp(lse_b - shift)[..., None], out_b)  # (..., L, Ev)
    lse.copy_(merged)


def _ring_backward(q: list, k: list, v: list, out: list, lse: list, d_out: list, d_lse: list, layout: _Layout,
                   options: FlashOptions, group: dist.ProcessGroup | None) -> tuple[list, list, list]:
    """dq, dk, dv of this rank's chunks, in the working dtype. At step t the block of rank s = r - t visits with
    its dk, dv accumulators: they take this rank's share and travel on after the compute; the block's own
    exchange overlaps the compute, the accumulators' the next step's compute. After P steps and one more hop
    each rank holds its own block's accumulators."""
    P, r = dist.get_world_size(group), dist.get_rank(group)
    n, work = len(k), out[0].dtype
    dq = [torch.zeros(x.shape, dtype=work, device=x.device) for x in q]
    sums = [torch.zeros(x.shape, dtype=work, device=x.device) for x in (*k, *v)]  # the visiting block's dk, dv
    shares = sums if P == 1 else [torch.zeros_like(x) for x in sums]  # this rank's share of them, reused
    block, spares, grad_spares, grads_exchange = (*k, *v), [None, None], [None, None], None
    for t, pairs in enumerate(_schedule(layout, r, options)):
        # 1) start passing the block on
        exchange = _start_exchange(block, spares, t % 2, group, KV_TAG) if t < P - 1 else None
        # 2) the block's share of the gradients, from the global out and lse, summed in place
        for x in shares if P > 1 else []:
            x.zero_()
        for a, b, step in pairs:
            parts = _block_gradients(q[a], block[b], block[n + b], out[a], lse[a], d_out[a], d_lse[a], step)
            for total, part in zip((dq[a], shares[b], shares[n + b]), parts, strict=True):
                total.add_(part)
        # 3) the accumulators of this block, from the previous rank (started after its compute), plus the share
        sums = _finish(grads_exchange) if grads_exchange is not None else sums
        for total, share in zip(sums, shares, strict=True) if P > 1 else []:
            total.add_(share)
        # 4) they travel on; the next ones are received into the buffers sent at the previous step
        grads_exchange = _start_exchange(sums, grad_spares, t % 2, group, GRAD_TAG) if P > 1 else None
        grad_spares[(t + 1) % 2] = list(sums)  # free once this exchange is waited for: receive at step t + 1
        block = _finish(exchange) if exchange is not None else block
    sums = _finish(grads_exchange) if grads_exchange is not None else sums  # home, after the last hop
    return dq, list(sums[:n]), list(sums[n:])


def _block_gradients(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                     d_out: torch.Tensor, d_lse: torch.Tensor,
                     step: FlashOptions) -> tuple[torch.Tensor, ...]:
    """The tiled backward pass of one chunk pair (flash._backward) against the global out and lse; the gradients
    in q's, k's and v's shapes and the working dtype."""
    p = _problem(q, k, v, None, None, step)
    p = p._replace(out=out, lse=lse)  # grouped like the problem (..., rows, *)
    dq, dk, dv, *_ = _backward(p, d_out, d_lse, (p.q, p.k, p.v, None), need_bias=False,
                                 need_parameters=False)  # in the working dtype
    return dq, dk, dv


def _start_exchange(tensors: tuple[torch.Tensor, ...], spares: list, slot: int, group: dist.ProcessGroup | None,
                    tag: int) -> tuple:
    """Send `tensors` to rank r + 1 and receive as many of the same shapes from rank r - 1 into spares[slot]
    (allocated on first use, then reused), without waiting: the requests, the tensors sent (kept alive until
    they are waited for) and the buffers that receive."""
    P, r = dist.get_world_size(group), dist.get_rank(group)
    sent = [x.contiguous() for x in tensors]
    if spares[slot] is None:
        spares[slot] = [torch.empty_like(x) for x in sent]
    received = spares[slot]
    ops = [dist.P2POp(dist.isend, x, group=group, group_peer=(r + 1) % P, tag=tag) for x in sent]
    ops += [dist.P2POp(dist.irecv, x, group=group, group_peer=(r - 1) % P, tag=tag) for x in received]
    return dist.batch_isend_irecv(ops), sent, received


def _finish(exchange: tuple) -> tuple[torch.Tensor, ...]:
    """Wait for the exchange's sends and receives; what arrived."""
    requests, _, received = exchange
    for request in requests:
        request.wait()
    return tuple(received)


def _to_ring(x: torch.Tensor, layout: _Layout, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """This rank's contiguous shard (..., n rows, *) as the chunks the ring's layout gives it (..., rows, *)."""
    n = len(layout.ring[0])
    chunks = [c.contiguous() for c in x.split(x.shape[-2] // n, dim=-2)] if n > 1 else [x]
    return _move(chunks, layout.natural, layout.ring, group)


def _to_natural(chunks: list[torch.Tensor], layout: _Layout, group: dist.ProcessGroup | None) -> torch.Tensor:
    """_to_ring turned around: the ring's chunks back as this rank's contiguous shard (..., n rows, *)."""
    moved = _move(chunks, layout.ring, layout.natural, group)
    return moved[0] if len(moved) == 1 else torch.cat(moved, dim=-2)


def _move(chunks: list[torch.Tensor], source: tuple, target: tuple, group: dist.ProcessGroup | None) -> list:
    """Chunks held as `source` says (per rank, its chunk numbers) to where `target` says: each one sent to the
    rank and slot that hold it in target (kept where that is this rank), the others received; waited for."""
    if source == target:
        return chunks
    r = dist.get_rank(group)
    held = {m: (rank, slot) for rank, ids in enumerate(target) for slot, m in enumerate(ids)}
    came = {m: rank for rank, ids in enumerate(source) for m in ids}
    moved: list = [None] * len(target[r])
    ops = []
    for x, m in zip(chunks, source[r], strict=True):
        rank, slot = held[m]
        if rank == r:
            moved[slot] = x
        else:
            ops.append(dist.P2POp(dist.isend, x, group=group, group_peer=rank, tag=LAYOUT_TAG + slot))
    for slot, m in enumerate(target[r]):
        if moved[slot] is None:
            moved[slot] = torch.empty_like(chunks[0])
            ops.append(dist.P2POp(dist.irecv, moved[slot], group=group, group_peer=came[m], tag=LAYOUT_TAG + slot))
    for request in dist.batch_isend_irecv(ops) if ops else []:
        request.wait()
    return moved
