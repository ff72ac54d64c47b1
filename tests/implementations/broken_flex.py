"""Programmable attention with ONE realistic bug each: variants of the third-party dense flex_attention
(tests/implementations/einsum_attention.py), which the suite's flex operation must reject.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

The third-party flex evaluates the mask and score functions once on the whole (B, H, L, S) grid. Two bugs live
in how a tiled kernel reads a block mask, so `TiledMask` first reads the visible keys tile by tile from the block
mask's kinds over the batch (BlockMask.batch_kinds: an empty tile hides its keys, a full one shows them without
calling the mask function, a partial one calls it on the tile's index arrays), as the tiled kernels do; it is
correct, and the suite passes it. Each variant's docstring says the bug and which check of the suite's flex
operation rejects it (the measure names of `conformance.check` rows). No variant raises on ordinary inputs: the
bug is a wrong answer.

`FLEX` and `TILED` are the correct implementations as modules the suite can check; `BROKEN` maps a name to each
variant's.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import numpy as np

from attention_np.common.block_mask import FULL, PARTIAL, BlockMask
from attention_np.common.mods import ScoreMod

from .einsum_attention import Implementation, as_module

Grid = tuple[np.ndarray, ...]  # b (B, 1, 1, 1), h (1, H, 1, 1), q_idx (1, 1, L, 1), kv_idx (1, 1, 1, S)


class TiledMask(Implementation):
    """The visible keys read tile by tile off the block mask, as a tiled kernel reads them: the tile's kind over
    the batch, the mask function called on a partial tile's index arrays alone."""

    def flex_visible(self, block_mask: BlockMask | None, grid: Grid, shape: tuple[int, ...]) -> np.ndarray:
        if block_mask is None:
            return np.ones(shape, bool)
        (block_q, block_k), kinds = block_mask.block_size, block_mask.batch_kinds()  # (rows, columns)
        b, h, i, j = grid
        b, h = (x if n > 1 else np.zeros_like(x) for x, n in ((b, block_mask.shape[0]), (h, block_mask.shape[1])))
        visible = np.zeros(shape, bool)
        for row, column in np.ndindex(*kinds.shape):
            rows, columns = slice(row * block_q, (row + 1) * block_q), slice(column * block_k, (column + 1) * block_k)
            tile = (b, h, i[:, :, rows], j[:, :, :, columns])  # the tile's index arrays
            if kinds[row, column] == FULL:
                visible[:, :, rows, columns] = True
            elif kinds[row, column] == PARTIAL:
                visible[:, :, rows, columns] = self.partial_tile(block_mask.mask_mod, tile)
        return visible

    def partial_tile(self, mask_mod: Callable, tile: Grid) -> np.ndarray:
        """The mask function on a partial tile's entries, (B, H, block_q, block_k)."""
        return self.grid_mask(mask_mod, tile)


# --- the mask -------------------------------------------------------------------------------------------------


class IndicesSwapped(Implementation):
    """The mask function called as mask_mod(b, h, kv_idx, q_idx): the query's and the key's index swapped (a
    causal mask becomes anti-causal; the block mask is built the same wrong way). Caught by: values."""

    def grid_mask(self, mask_mod: Callable, grid: Grid) -> np.ndarray:
        return super().grid_mask(lambda b, h, q_idx, kv_idx: mask_mod(b, h, kv_idx, q_idx), grid)  # the bug


class PartialTileTakenAsFull(TiledMask):
    """A tiled kernel that skips the mask function on partial tiles, as if they were full: every key of a tile
    that some key of is visible is seen. Caught by: values."""

    def partial_tile(self, mask_mod: Callable, tile: Grid) -> np.ndarray:
        b, h, i, j = tile
        return np.ones((b.shape[0], h.shape[1], i.shape[2], j.shape[3]), bool)  # the bug: no mask evaluated


class FirstRowBlockMask(TiledMask):
    """create_block_mask classifies each tile by its first query row alone, and the tiled kernel trusts the
    kinds: a tile whose first query sees every key is FULL (a sliding window's later rows then see keys left of
    the window), one whose first query sees none is EMPTY (a causal tile's later rows lose their keys).
    Caught by: values."""

    def tile_kinds(self, visible: np.ndarray, block_q: int, block_k: int) -> np.ndarray:
        first_rows = visible[:, :, ::block_q]  # (B, H, rows, S): the bug, each tile's first query row alone
        return super().tile_kinds(np.repeat(first_rows, block_q, axis=2)[:, :, :visible.shape[2]], block_q, block_k)


# --- the score function ---------------------------------------------------------------------------------------


class ScoreModAfterTheMask(Implementation):
    """The hidden scores set to -inf first, then the score function applied to all of them, and the keys kept
    where the result is not -inf: a softcap turns -inf into -cap, so the hidden keys come back (ALiBi and the
    relative bias keep -inf). Caught by: values."""

    def hidden_scores(self, scores: np.ndarray, visible: np.ndarray, raw: np.ndarray, score_mod: Callable | None,
                      grid: Grid) -> tuple[np.ndarray, np.ndarray]:
        masked = self.modded(score_mod, np.where(visible, raw, -np.inf), grid)  # the bug: the mod after the mask
        return masked, masked != -np.inf


class ScoreModOnUnscaledScores(Implementation):
    """The score function applied to Q K^T before the scale, the scale then multiplying its result (ALiBi's bias
    and a softcap's cap scaled too). Caught by: values."""

    def flex_scores(self, q: np.ndarray, k_h: np.ndarray, scale: float, score_mod: Callable | None,
                    grid: Grid) -> tuple[np.ndarray, np.ndarray]:
        unscaled = np.einsum("bhle,bhse->bhls", q, k_h)  # (B, H, L, S)
        scaled = self.modded(score_mod, unscaled, grid) * q.dtype.type(scale)  # the bug: the mod, then the scale
        return unscaled * q.dtype.type(scale), scaled


class AlibiSignFlipped(Implementation):
    """ALiBi's bias with the distance's sign flipped, slopes[h] * (i - j) for slopes[h] * (j - i): the module
    rewrites an alibi ScoreMod it is handed, so later keys weigh less instead of earlier ones. Caught by: values."""

    def modded(self, score_mod: Callable | None, raw: np.ndarray, grid: Grid) -> np.ndarray:
        if isinstance(score_mod, ScoreMod) and repr(score_mod).startswith("alibi("):
            _, h, i, j = grid
            slopes = np.asarray(score_mod.parameters["slopes"]).astype(raw.dtype)  # (H,)
            return raw + slopes[h] * (i - j)  # the bug: q_idx - kv_idx
        return super().modded(score_mod, raw, grid)


# --- the backward pass ----------------------------------------------------------------------------------------


class ScoreModParametersForgotten(Implementation):
    """The pullback returns the gradients of q, k and v but an empty d_score_mod: learned ALiBi slopes or a
    relative-bias table never get a gradient. Caught by: gradients."""

    def score_vjp(self, score_mod: Callable | None, dR: np.ndarray, forward: tuple) -> tuple:
        d_scores, _ = super().score_vjp(score_mod, dR, forward)
        return d_scores, {}  # the bug: the parameters' gradients dropped


VARIANTS: dict[str, type[Implementation]] = {
    "indices_swapped": IndicesSwapped,
    "partial_tile_taken_as_full": PartialTileTakenAsFull,
    "first_row_block_mask": FirstRowBlockMask,
    "score_mod_after_the_mask": ScoreModAfterTheMask,
    "score_mod_on_unscaled_scores": ScoreModOnUnscaledScores,
    "alibi_sign_flipped": AlibiSignFlipped,
    "score_mod_parameters_forgotten": ScoreModParametersForgotten,
}
FLEX = as_module(Implementation(), f"{__name__}.dense")
TILED = as_module(TiledMask(), f"{__name__}.tiled")
BROKEN: dict[str, types.ModuleType] = {name: as_module(cls(), f"{__name__}.{name}") for name, cls in VARIANTS.items()}
