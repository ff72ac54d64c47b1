"""Ring attention, in NumPy: the schedule of attention over a sequence sharded across devices, simulated on one.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

Each of P devices holds one shard of the queries and one of the keys and values. The key/value shards travel
around a ring: at step t, device d holds the shard of device (d - t) mod P, attends its queries to it, and
passes it on to device d + 1. After P steps every query has met every key. Each step's result is a partial
attention over some of the keys, and partial results merge exactly through their log-sum-exps (SPEC 2c):

    lse = log(exp(lse_a) + exp(lse_b)),   out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b

With is_causal, contiguous shards leave device 0 almost idle (its queries see only its own keys) while the
last device sees every key. The zig-zag layout balances them: the sequence is cut into 2P chunks and device d
holds chunks d and 2P - 1 - d, one early and one late, so every device does the same work. The JAX and torch
backends run the same schedule on real devices (jax.shard_map with lax.ppermute; torch.distributed); this one
runs the devices one after another, to show the schedule and to check it.
"""

from __future__ import annotations

import numpy as np

from attention_np.common import checks

from .flash import flash_attention


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
    block_q: int = 128,
    block_k: int = 128,
) -> tuple[np.ndarray, np.ndarray]:
    """Attention(Q, K, V) over P shards of the sequence, each device's queries against the key/value shards
    passed around the ring, the partial results merged by their log-sum-exps.

    Args:
        q, k, v: as for flash_attention, the whole sequence; cut into P shards along axis -2.
        devices: P, the devices of the ring (simulated); L and S must be multiples of P, of 2P with is_causal.
        is_causal, scale, q_offset, window, softcap, enable_gqa, block_q, block_k: as for flash_attention;
            q_offset an int.

    Returns:
        out (..., L, Ev) and lse (..., L), flash_attention's.
    """
    L, S = q.shape[-2], k.shape[-2]
    chunks = checks.ring_chunks(devices, L, S, is_causal)  # per device: its chunks, (start, stop) pairs
    options = dict(scale=scale, window=window, softcap=softcap, enable_gqa=enable_gqa, block_q=block_q,
                   block_k=block_k)
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
                    # 3) merged into what this device's queries have seen so far
                    merged = _merged((out[..., slice(*rows), :], lse[..., slice(*rows)]), (part, part_lse))
                    out[..., slice(*rows), :], lse[..., slice(*rows)] = merged
    return out, lse


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
