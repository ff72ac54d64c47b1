"""Programmable attention (torch's FlexAttention interface) in JAX: a score function and a block mask,
tile by tile with the online softmax, forward and backward.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

The score functions and mask functions, and the catalogue of them, are in attention_np/common/mods.py; the
block mask, which tiles a mask function leaves empty, partial or full, in attention_np/common/block_mask.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attention_np.common import block_mask as blocks
from attention_np.common.block_mask import BlockMask


def flex_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    score_mod: Callable[..., Any] | None = None,
    block_mask: BlockMask | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention(Q, K, V)_bhi = sum_j softmax_j(score_mod(s_bhij, b, h, i, j)) v_bhj, s = (Q K^T) * scale, the
    softmax over the keys j that block_mask's mask_mod shows query i (every key without a block mask);
    lse_bhi = log sum_j exp(score_mod(s_bhij, b, h, i, j)) over the same keys.

    Tile by tile over the block mask's tiles: an empty tile is never computed, a full one is computed without
    evaluating the mask function, a partial one evaluates it on its entries. A key the score function gives
    -inf is hidden as a masked one is; a query with no visible key gets zeros and lse -inf.

    Args:
        q: queries (B, H, L, E).
        k: keys (B, Hkv, S, E); Hkv = H unless enable_gqa.
        v: values (B, Hkv, S, Ev).
        score_mod: (score, b, h, q_idx, kv_idx) -> the new score, elementwise over a tile of scores
            (B, H, block_q, block_k) with integer index arrays broadcasting to it; None: the score itself.
        block_mask: from create_block_mask over (B or 1, H or 1, L, S); None: every key visible, tiles of 128.
        scale: multiplies Q K^T before score_mod; defaults to 1 / sqrt(E).
        enable_gqa: grouped-query attention: query head h uses key/value head h // (H // Hkv); score_mod
            and the mask function see the query head h.
        return_lse: also return lse.

    Returns:
        out (B, H, L, Ev) in q's dtype, computed in at least float32; with return_lse, (out, lse (B, H, L)) in
        the dtype the scores are computed in.
    """
    raise NotImplementedError


def flex_attention_vjp(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    score_mod: Callable[..., Any] | None = None,
    block_mask: BlockMask | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> tuple[jax.Array, jax.Array, Callable]:
    """P = exp(R - lse) recomputed tile by tile, R = score_mod(S), S = (Q K^T) * scale;  D = rowsum(dO * O),
    dV += P^T dO,  dP = dO V^T,  dR = P * (dP - D),  (dS, dtheta) = score_mod's vjp at dR,
    dQ += dS K * scale,  dK += dS^T Q * scale; dtheta, the score function's parameters' gradients, summed over
    the tiles.

    JAX differentiates through score_mod (any function of jax.numpy operations); a ScoreMod's parameters are
    differentiated through ScoreMod.replace.

    Args:
        q, k, v, score_mod, block_mask, scale, enable_gqa: as for flex_attention.

    Returns:
        out (B, H, L, Ev), lse (B, H, L) and pullback(d_out (B, H, L, Ev)) -> (dq, dk, dv, d_score_mod), each of
        dq, dk, dv with its input's shape and dtype, and d_score_mod a dict {parameter name: gradient} of the
        score function's parameters (ScoreMod.parameters; empty without).
    """
    raise NotImplementedError


def create_block_mask(
    mask_mod: Callable[..., Any],
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int,
    BLOCK_SIZE: int | tuple[int, int] = 128,
) -> BlockMask:
    """The tiles of mask_mod(b, h, q_idx, kv_idx) over scores (B, H, Q_LEN, KV_LEN), each (query tile, key tile)
    pair empty, partial or full; mask_mod is evaluated one row of tiles at a time, never on the whole grid.

    Args:
        mask_mod: (b, h, q_idx, kv_idx) -> True where query q_idx sees key kv_idx, elementwise over integer
            index arrays that broadcast to (B, H, block_q, block_k).
        B: the batch size, or None: the mask is the same for every batch element (b is 0).
        H: the number of (query) heads, or None: the same for every head (h is 0).
        Q_LEN: L, the number of queries.
        KV_LEN: S, the number of keys.
        BLOCK_SIZE: the tiles' size, an int or (block_q, block_k).

    Returns:
        A BlockMask: shape (B or 1, H or 1, L, S), block_size, tiles (B, H, ceil(L / block_q),
        ceil(S / block_k)) of kinds; counts() and sparsity() say how much is skipped.
    """
    return blocks.create(mask_mod, B, H, Q_LEN, KV_LEN, BLOCK_SIZE, arange=jnp.arange, to_numpy=np.asarray)
