"""Block masks: which tiles of the scores a mask function leaves empty, partial or full, found one row of tiles
at a time, so that the tiled kernels skip the empty tiles and evaluate the mask function on the partial ones
only. Written once for the three backends: each passes its own `arange` and `to_numpy`, so that a mask function
written with its framework's functions runs on its arrays.

The picture of causal() over L = S = 12, tiles of 4 (str(block_mask) draws one per batch element and head):

    ░..      █ full: every query of the tile sees every key of it (the mask function is not evaluated)
    █░.      ░ partial: some do (the kernels evaluate the mask function on its entries)
    ██░      . empty: none do (the kernels never compute the tile)

Imports NumPy alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import validation

EMPTY, PARTIAL, FULL = 0, 1, 2  # the kinds of a tile, as stored in BlockMask.tiles
CLASSIFY_ENTRIES = 1 << 20  # mask entries evaluated at once while classifying (a few MiB of booleans)
_GLYPHS = {EMPTY: ".", PARTIAL: "░", FULL: "█"}


@dataclass(frozen=True, eq=False)  # eq=False: hashed by identity, so a block mask can be a static argument
class BlockMask:
    """A mask function with its tiles classified (torch's BlockMask, in one array of kinds).

    Shapes: the scores are (B, H, L, S) = `shape`, B or H 1 where the mask broadcasts over them; the tiles
    are (block_q, block_k) = `block_size` entries, the last ones along each axis shorter where the size does not
    divide L or S.
    """

    mask_mod: Callable[..., Any]  # (b, h, q_idx, kv_idx) -> True where the query sees the key
    shape: tuple[int, int, int, int]  # (B, H, L, S)
    block_size: tuple[int, int]  # (block_q, block_k)
    tiles: np.ndarray  # (B, H, ceil(L / block_q), ceil(S / block_k)) uint8: EMPTY, PARTIAL or FULL

    def counts(self) -> dict[str, int]:
        """How many tiles are empty (skipped), partial (masked entry by entry) and full (computed unmasked)."""
        return {name: int(np.sum(self.tiles == kind)) for name, kind in
                (("empty", EMPTY), ("partial", PARTIAL), ("full", FULL))}

    def sparsity(self) -> float:
        """The percentage of tiles that are skipped (empty), as torch's BlockMask.sparsity()."""
        return 100.0 * float(np.mean(self.tiles == EMPTY)) if self.tiles.size else 0.0

    def batch_kinds(self) -> np.ndarray:
        """The tiles' kinds over the whole batch and every head, (rows, columns): FULL where the tile is full in
        every (b, h), EMPTY where it is empty in every one, else PARTIAL; what a kernel that computes a tile for
        the whole batch at once reads (it evaluates the mask function where the kinds differ, too)."""
        every_full = np.all(self.tiles == FULL, axis=(0, 1))
        every_empty = np.all(self.tiles == EMPTY, axis=(0, 1))
        return np.where(every_full, FULL, np.where(every_empty, EMPTY, PARTIAL)).astype(np.uint8)

    def __str__(self) -> str:
        """The tiles drawn per batch element and head: █ full, ░ partial, . empty."""
        blocks = []
        for b, h in np.ndindex(*self.tiles.shape[:2]):
            rows = ["".join(_GLYPHS[int(kind)] for kind in row) for row in self.tiles[b, h]]
            blocks.append("\n".join([f"b={b}, h={h}:", *rows]))
        return "\n".join(blocks)

    def __repr__(self) -> str:
        return (f"BlockMask({self.mask_mod!r}, shape={self.shape}, block_size={self.block_size}, "
                f"counts={self.counts()})")


def create(mask_mod: Callable[..., Any], B: int | None, H: int | None, Q_LEN: int, KV_LEN: int,
           BLOCK_SIZE: int | tuple[int, int], *, arange: Callable[[int], Any],
           to_numpy: Callable[[Any], np.ndarray]) -> BlockMask:
    """The block mask of `mask_mod` over (B, H, Q_LEN, KV_LEN) scores (B or H None: 1, broadcast), tiles of
    BLOCK_SIZE (an int, or (block_q, block_k)). The mask function is evaluated on one row of query tiles at a
    time, CLASSIFY_ENTRIES entries at most at once, never on the whole (L, S) grid; `arange(n)` makes the
    backend's index arrays and `to_numpy` reads its results."""
    B, H, (block_q, block_k) = validation.block_mask_args(mask_mod, B, H, Q_LEN, KV_LEN, BLOCK_SIZE)
    rows, columns = -(-Q_LEN // block_q), -(-KV_LEN // block_k)
    tiles = np.empty((B, H, rows, columns), dtype=np.uint8)
    b, h = (_along(arange(n), axis, n) for axis, n in ((0, B), (1, H)))  # (B, 1, 1, 1), (1, H, 1, 1)
    step = max(1, CLASSIFY_ENTRIES // (B * H * block_q * block_k))  # key tiles per evaluation
    queries, keys = arange(Q_LEN), arange(KV_LEN)  # sliced below, tile row by tile row
    for row in range(rows):
        start, stop = row * block_q, min(row * block_q + block_q, Q_LEN)
        q_idx = _along(queries[start:stop], 2, stop - start)  # (1, 1, block_q, 1)
        for first in range(0, columns, step):
            begin, end = first * block_k, min((first + step) * block_k, KV_LEN)
            kv_idx = _along(keys[begin:end], 3, end - begin)  # (1, 1, 1, keys)
            visible = mask_mod(b, h, q_idx, kv_idx)
            shape = (B, H, stop - start, end - begin)
            validation.mask_mod_result("mask_mod", np.shape(visible), str(visible.dtype), shape)
            tiles[:, :, row, first:first + step] = _kinds(np.broadcast_to(to_numpy(visible), shape), block_k)
    return BlockMask(mask_mod=mask_mod, shape=(B, H, Q_LEN, KV_LEN), block_size=(block_q, block_k), tiles=tiles)


def _along(x: Any, axis: int, n: int) -> Any:
    """An index array (n,) laid along `axis` of four: (n, 1, 1, 1), (1, n, 1, 1), ..."""
    shape = [1, 1, 1, 1]
    shape[axis] = n
    return x.reshape(tuple(shape))


def _kinds(visible: np.ndarray, block_k: int) -> np.ndarray:
    """(B, H, rows, keys) booleans -> (B, H, ceil(keys / block_k)) kinds: EMPTY where no entry of a tile is
    True, FULL where every one is, else PARTIAL."""
    B, H, rows, keys = visible.shape
    pad = -keys % block_k  # the last tile's missing keys: False for "any", True for "all"
    def tiled(fill: bool) -> np.ndarray:
        padded = np.pad(visible, ((0, 0), (0, 0), (0, 0), (0, pad)), constant_values=fill)
        return padded.reshape(B, H, rows, -1, block_k)
    some = np.any(tiled(False), axis=(2, 4))  # (B, H, tiles)
    every = np.all(tiled(True), axis=(2, 4))
    return np.where(every, FULL, np.where(some, PARTIAL, EMPTY)).astype(np.uint8)
