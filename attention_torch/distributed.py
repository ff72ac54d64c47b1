"""Ring attention over torch.distributed: the sequence split across the P ranks of a process group, the key/value
blocks passed around the ring, the partial results merged through the log-sum-exp (SPEC 2c).

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

Rank r of P holds the contiguous shard r of the sequence: queries r L/P .. (r + 1) L/P - 1, keys and values
r S/P .. (r + 1) S/P - 1. At step t = 0 .. P - 1 it holds the key/value block of rank s = (r - t) mod P,
attends its own queries to it with the tiled kernel (flash.py) at the relative position
    q_offset_t = r L/P - s S/P + q_offset               so causal and window follow the global positions
and merges the result into its running (out, lse), the merge of SPEC 2c's lse rule:
    lse = log(exp(lse_a) + exp(lse_b)),   out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b
(a row that sees nothing in either part stays zeros with lse -inf, never NaN). While it computes, the block
already travels on: it is sent to rank r + 1 and the next one received from rank r - 1 (batch_isend_irecv),
and waited for only after the compute. Each rank sends 2 (S/P) E (k and v, Ev = E) elements per step and
holds O(L/P + S/P) memory: the whole sequence never sits on one rank.

The backward pass runs the ring again: each step recomputes the visiting block's share of the gradients from
the saved global out and lse and d_out (flash._backward: P = exp(S - lse), D = rowsum(dO * O)). dq stays
and accumulates; the dk, dv accumulators travel with their k, v block, so after P steps, one more hop, they
are back at the block's owner holding the sum over every rank's queries.

Load balance under is_causal: with contiguous shards rank r's queries see the blocks of ranks 0 .. r only
(the later ones are skipped), so rank 0 computes one block, rank P - 1 all P of them, about (2r + 1) / P of
the work of the busiest half-problem, and the ring runs at the pace of the last rank. The zig-zag layout (rank
r holds chunks r and 2P - 1 - r of 2P chunks, which evens the work out) is not implemented here.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from attention_np.common import checks

from .flash import _backward, _cast, _forward, _heads, _problem

KV_TAG, GRAD_TAG = 0, 1  # gloo matches messages by (peer, tag): the blocks and the gradients apart


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    q_offset: int | torch.Tensor = 0,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    enable_gqa: bool = False,
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
        block_q, block_k: the tiles of the kernel on each rank.

    Returns:
        out (..., L/P, Ev) and lse (..., L/P): this rank's rows of flash_attention on the whole sequence.

    Raises:
        ValueError: the ranks' shapes differ (a sequence that does not split into P equal shards), or q, k, v
            cannot be shards (rank below 2, k and v of different lengths).
    """
    options = dict(is_causal=is_causal, scale=scale, q_offset=q_offset, window=window, key_lengths=None,
                   softcap=softcap, enable_gqa=enable_gqa, block_q=block_q, block_k=block_k)
    _check_shards(q, k, v, group)
    return _Ring.apply(q, k, v, options, group)


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
        raise ValueError(f"ring_attention needs shards of the same shapes on all P={P} ranks (the sequence "
                         f"split into P equal, contiguous parts); got {listed}")
    if q.dim() < 2 or k.dim() < 2 or v.dim() < 2 or k.shape[-2] != v.shape[-2]:
        raise ValueError(f"ring_attention needs shards q (..., L/P, E), k (..., S/P, E), v (..., S/P, Ev) on each "
                         f"of the P={P} ranks; got q {shapes[0]}, k {shapes[1]}, v {shapes[2]}")


class _Ring(torch.autograd.Function):
    """torch: the ring forward and the ring backward as one autograd operation; it keeps this rank's q, k, v and
    its global out and lse (grouped with enable_gqa, in the working dtype), nothing of size L * S."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                options: dict, group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse, p = _ring_forward(q, k, v, options, group)
        ctx.options, ctx.group = options, group
        ctx.save_for_backward(q, k, v, out, lse)
        return _cast(_heads(p, out), q.dtype), _heads(p, lse)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: torch.autograd.function.FunctionCtx, d_out: torch.Tensor, d_lse: torch.Tensor) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(q, k, v, out, lse, d_out, d_lse, ctx.options, ctx.group)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: dict,
                  group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """This rank's out (..., L/P, Ev) and lse (..., L/P), grouped and in the working dtype, merged over the P
    blocks; and the problem of the first step (its grouping)."""
    P, r = dist.get_world_size(group), dist.get_rank(group)
    out = lse = first = None
    block = (k, v)
    for t in range(P):
        # 1) start passing the block on; the next one arrives while this one is computed
        exchange = _start_exchange(block, group, KV_TAG) if t < P - 1 else None
        # 2) this rank's queries against the visiting block, at their relative position
        step = dict(options, q_offset=_relative_offset(options, r, (r - t) % P, q.shape[-2], k.shape[-2]))
        if t == 0 or _visible(step, q.shape[-2], k.shape[-2]):
            _, _, p = _forward(q, *block, None, None, step)
            first = first if first is not None else p
            out, lse = (p.out, p.lse) if out is None else _merge(out, lse, p.out, p.lse)
        # 3) the next block, received
        block = _finish(exchange) if exchange is not None else block
    return out, lse, first


def _relative_offset(options: dict, r: int, s: int, L_shard: int, S_shard: int) -> int | torch.Tensor:
    """The position of rank r's first query relative to rank s's first key, plus the caller's q_offset."""
    return options["q_offset"] + (r * L_shard - s * S_shard)


def _visible(step: dict, L_shard: int, S_shard: int) -> bool:
    """Whether the structure (is_causal, window) leaves any key of the block visible to some query."""
    q_offset = step["q_offset"]
    offsets = (int(q_offset.min()), int(q_offset.max())) if isinstance(q_offset, torch.Tensor) else (q_offset,) * 2
    tiles = checks.key_tiles(0, L_shard, S_shard, max(S_shard, 1), is_causal=step["is_causal"],
                             window=checks.window(step["window"]), q_offset=offsets, key_lengths=None)
    return len(tiles) > 0


def _merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
           lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """lse = log(exp(lse_a) + exp(lse_b)), out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b. A row that
    sees no key in either part has lse -inf: its weights exp(-inf - -inf) would be NaN, so they are 0 there
    (where the row is zeros and lse stays -inf)."""
    lse = torch.logaddexp(lse_a, lse_b)  # (..., L); -inf where both are
    seen = lse != -math.inf
    shift = torch.where(seen, lse, 0)  # a row that sees nothing: exp(-inf - 0) = 0 for both parts
    weight_a = torch.exp(lse_a - shift)[..., None]  # (..., L, 1)
    weight_b = torch.exp(lse_b - shift)[..., None]
    return weight_a * out_a + weight_b * out_b, lse  # (..., L, Ev), (..., L)


def _ring_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   d_out: torch.Tensor, d_lse: torch.Tensor, options: dict,
                   group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of this rank's shards, in the working dtype. At step t the block of rank s = r - t visits with
    its dk, dv accumulators: they take this rank's share and travel on after the compute; the block's own
    exchange overlaps the compute, the accumulators' the next step's compute. After P steps and one more hop
    each rank holds its own block's accumulators."""
    P, r = dist.get_world_size(group), dist.get_rank(group)
    dq = sums = grads_exchange = None
    block = (k, v)
    for t in range(P):
        # 1) start passing the block on
        exchange = _start_exchange(block, group, KV_TAG) if t < P - 1 else None
        # 2) the block's share of the gradients, from the global out and lse
        step = dict(options, q_offset=_relative_offset(options, r, (r - t) % P, q.shape[-2], k.shape[-2]))
        shares = _block_gradients(q, *block, out, lse, d_out, d_lse, step)
        dq = shares[0] if dq is None else dq.add_(shares[0])  # fresh tensors: summed in place
        # 3) the accumulators of this block, from the previous rank (started after its compute), plus the share
        arrived = _finish(grads_exchange) if grads_exchange is not None else None
        sums = shares[1:] if arrived is None else (arrived[0].add_(shares[1]), arrived[1].add_(shares[2]))
        grads_exchange = _start_exchange(sums, group, GRAD_TAG) if P > 1 else None
        block = _finish(exchange) if exchange is not None else block
    dk, dv = _finish(grads_exchange) if grads_exchange is not None else sums  # home, after the last hop
    return dq, dk, dv


def _block_gradients(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                     d_out: torch.Tensor, d_lse: torch.Tensor, step: dict) -> tuple[torch.Tensor, ...]:
    """The tiled backward pass of one visiting block (flash._backward) against the global out and lse; the
    gradients in q's, k's and v's shapes and the working dtype. A block hidden from every query gives zeros."""
    p = _problem(q, k, v, None, None, step)
    if not _visible(step, q.shape[-2], k.shape[-2]):
        return tuple(torch.zeros(x.shape, dtype=p.work, device=x.device) for x in (q, k, v))
    p["out"], p["lse"] = out, lse  # grouped like the problem (..., L/P, *)
    dq, dk, dv, _ = _backward(p, d_out, d_lse, (p.q, p.k, p.v, None), need_bias=False)  # in the working dtype
    return dq, dk, dv


def _start_exchange(tensors: tuple[torch.Tensor, ...], group: dist.ProcessGroup | None, tag: int) -> tuple:
    """Send `tensors` to rank r + 1 and receive as many of the same shapes from rank r - 1, without waiting:
    the requests, the tensors sent (kept alive until they are waited for) and the buffers that receive."""
    P, r = dist.get_world_size(group), dist.get_rank(group)
    sent = [x.contiguous() for x in tensors]
    received = [torch.empty_like(x) for x in sent]
    ops = [dist.P2POp(dist.isend, x, group=group, group_peer=(r + 1) % P, tag=tag) for x in sent]
    ops += [dist.P2POp(dist.irecv, x, group=group, group_peer=(r - 1) % P, tag=tag) for x in received]
    return dist.batch_isend_irecv(ops), sent, received


def _finish(exchange: tuple) -> tuple[torch.Tensor, ...]:
    """Wait for the exchange's sends and receives; what arrived."""
    requests, _, received = exchange
    for request in requests:
        request.wait()
    return tuple(received)
