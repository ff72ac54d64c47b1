"""Attention with mods (mask_mod= and score_mod= on scaled_dot_product_attention and flash_attention, flash's
block_mask=) with ONE realistic bug each: variants of the third-party dense sdpa with mods
(tests/implementations/einsum_attention.py), which the suite's sdpa and flash operations must reject.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

The third-party module has no flash_attention, so `ModsFlash` adds one: sdpa's scores and visible keys (the mods
evaluated on the whole (B, H, L, S) grid), out and each row's log-sum-exp, and with a block mask the keys its
mask function shows; the tiles only checked, never cut. `TiledFlash` reads a block mask tile by tile instead, as a
tiled kernel does (broken_flex.TiledMask: an empty tile hides its keys, a full one shows them without calling the
mask function, a partial one calls it on the tile's index arrays). Both are correct and the suite passes them. Two
bugs live in that reading, two in the mask function's and score function's evaluation, two in the order and the
sign of the score function's terms; the flex variants of broken_flex.py carry the same bugs into flex_attention, so
those that live in a shared piece (the mask's evaluation, the tiles' reading, ALiBi) are mixed in from there. Each
variant's docstring says the bug and the check that rejects it (the measure names of `conformance.check` rows). No
variant raises on ordinary inputs: the bug is a wrong answer.

`MODS` and `TILED` are the correct implementations as modules the suite can check; `BROKEN` maps a name to each
variant's.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import numpy as np

from attention_np.common import validation
from attention_np.common.block_mask import BlockMask

from .broken_flex import AlibiSignFlipped, FirstRowBlockMask, IndicesSwapped, PartialTileTakenAsFull, TiledMask
from .einsum_attention import Implementation, _Mods, as_module


class ModsFlash(Implementation):
    """flash_attention: out and lse of sdpa's scores and visible keys, the mods on the whole grid; with a block mask
    the keys its mask function shows (`flex_visible`, which TiledFlash reads by tiles)."""

    def flash_attention(self, q: Any, k: Any, v: Any, mask: Any = None, *, bias: Any = None, is_causal: bool = False,
                        scale: float | None = None, q_offset: Any = 0, window: Any = None, key_lengths: Any = None,
                        softcap: float | None = None, enable_gqa: bool = False, mask_mod: Callable | None = None,
                        score_mod: Callable | None = None, block_mask: BlockMask | None = None,
                        block_q: int | None = None, block_k: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """out = softmax(score_mod(cap(Q K^T * scale)) + bias) V over the visible keys, lse = log sum exp of those
        scores (-inf, and zeros in out, where a query sees none): (..., L, Ev) and (..., L)."""
        q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
        validation.tiles(block_q, block_k)
        mods = None
        if block_mask is not None:
            mods = self.block_mods(q, k, v, mask_mod, block_mask, block_q, block_k)
        elif mask_mod is not None or score_mod is not None:
            mods = self.mods("flash_attention", q, k, v, mask_mod)
        scores, visible, v, dtype = self.prepared(q, k, v, mask, bias, is_causal, scale, q_offset, window,
                                                  key_lengths, softcap, enable_gqa, score_mod, mods)
        weights = self.softmax(scores, visible)  # (..., L, S)
        out = np.einsum("...ls,...sv->...lv", weights, v)  # (..., L, S) x (..., S, Ev) -> (..., L, Ev)
        return out.astype(dtype), self.lse(scores, visible)

    def block_mods(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask_mod: Callable | None,
                   block_mask: BlockMask, block_q: int | None, block_k: int | None) -> _Mods:
        """The grid of the scores (B, H, L, S) and the keys the block mask shows (validation.flash_block_mask:
        made for these scores, without mask_mod, its tiles flash's)."""
        B, H = validation.mods_inputs("flash_attention", q.shape, k.shape, v.shape)
        shape = (B, H, q.shape[-2], k.shape[-2])
        validation.flash_block_mask(block_mask, mask_mod, block_q, block_k, shape)
        grid = self.index_grid(*shape)
        return _Mods(grid=grid, shape=shape, shown=self.flex_visible(block_mask, grid, shape))

    def lse(self, scores: np.ndarray, visible: np.ndarray) -> np.ndarray:
        """m + log sum_j exp(s_j - m) over the visible keys, m their maximum; -inf where a query sees none."""
        seen = np.any(visible, axis=-1)  # (..., L)
        kept = np.where(visible, scores, -np.inf)
        top = np.where(seen, np.max(kept, axis=-1, initial=-np.inf), 0)  # (..., L)
        total = np.sum(np.exp(kept - top[..., None]), axis=-1)  # (..., L)
        return np.where(seen, top + np.log(np.where(seen, total, 1)), -np.inf)


class TiledFlash(TiledMask, ModsFlash):
    """flash_attention reading its block mask tile by tile (TiledMask.flex_visible)."""


# --- the mask ----------------------------------------------------------------------------------------------------


class IndicesSwappedMods(IndicesSwapped, ModsFlash):
    """The mask function called as mask_mod(b, h, kv_idx, q_idx) on sdpa and flash: the query's and the key's index
    swapped (a causal mask becomes anti-causal). Caught by: values."""


class PartialTileTakenAsFullMods(PartialTileTakenAsFull, TiledFlash):
    """A tiled flash_attention that skips the mask function on a block mask's partial tiles, as if they were full:
    every key of a tile that some key of is visible is seen. Caught by: values."""


class FirstRowBlockMaskMods(FirstRowBlockMask, TiledFlash):
    """create_block_mask classifies each tile by its first query row alone, and the tiled flash_attention trusts the
    kinds: a causal tile's later rows lose their keys, a window's later rows see keys left of it. Caught by:
    values."""


# --- the score function -------------------------------------------------------------------------------------------


class ScoreModAfterTheMask(ModsFlash):
    """The keys the mask function hides set to -inf first, then the score function applied, and the keys kept where
    the result is not -inf: a softcap turns -inf into -cap, so the hidden keys come back. Caught by: values."""

    def modded_scores(self, q: np.ndarray, k: np.ndarray, scale: float, bias: np.ndarray | None,
                      softcap: float | None, score_mod: Callable | None, mods: _Mods) -> tuple[np.ndarray, np.ndarray]:
        raw = np.einsum("...le,...se->...ls", q, k) * scale  # (B, H, L, S)
        capped = np.broadcast_to(self.cap(raw, softcap), mods.shape)
        masked = self.modded(score_mod, np.where(mods.shown, capped, -np.inf), mods.grid)  # the bug: mod after mask
        return self.add_bias(masked, bias), masked != -np.inf


class ScoreModOnUnscaledScores(ModsFlash):
    """The score function applied to Q K^T before the scale, the scale then multiplying its result (ALiBi's bias
    and a softcap's cap scaled too). Caught by: values."""

    def modded_scores(self, q: np.ndarray, k: np.ndarray, scale: float, bias: np.ndarray | None,
                      softcap: float | None, score_mod: Callable | None, mods: _Mods) -> tuple[np.ndarray, np.ndarray]:
        unscaled = np.broadcast_to(self.cap(np.einsum("...le,...se->...ls", q, k), softcap), mods.shape)
        modded = self.modded(score_mod, unscaled, mods.grid) * unscaled.dtype.type(scale)  # the bug: then the scale
        return self.add_bias(modded, bias), mods.shown & (modded != -np.inf)


class AlibiSignFlippedMods(AlibiSignFlipped, ModsFlash):
    """ALiBi's bias on sdpa and flash with the distance's sign flipped, slopes[h] * (i - j) for slopes[h] * (j - i).
    Caught by: values."""


VARIANTS: dict[str, type[Implementation]] = {
    "indices_swapped": IndicesSwappedMods,
    "partial_tile_taken_as_full": PartialTileTakenAsFullMods,
    "score_mod_after_the_mask": ScoreModAfterTheMask,
    "score_mod_on_unscaled_scores": ScoreModOnUnscaledScores,
    "first_row_block_mask": FirstRowBlockMaskMods,
    "alibi_sign_flipped": AlibiSignFlippedMods,
}


def _module(impl: ModsFlash, name: str) -> types.ModuleType:
    """The third-party module's contract, and flash_attention."""
    module = as_module(impl, name)
    module.flash_attention = impl.flash_attention
    module.__all__ = [*module.__all__, "flash_attention"]
    return module


MODS = _module(ModsFlash(), f"{__name__}.dense")
TILED = _module(TiledFlash(), f"{__name__}.tiled")
BROKEN: dict[str, types.ModuleType] = {name: _module(cls(), f"{__name__}.{name}") for name, cls in VARIANTS.items()}
