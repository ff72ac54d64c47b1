"""A serving author's view: decoding through a paged key/value cache with a length per sequence (SPEC 3a, 3b), as
attention_np's MultiHeadAttention and TransformerBlock do it, and variants of it with ONE realistic bug each, which
the suite's decode operation must reject.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.
Paged cache: P pages in the pool, page the positions a page holds, M blocks a sequence may hold (max_pages).

Each variant subclasses attention_np's MultiHeadAttention and overrides the one step it gets wrong (how a block's
keys are found in the pool, which of a page's values are zeroed, where RoPE turns a sequence's rows); its block is
attention_np's TransformerBlock holding that attention. Everything else, the argument checks of
attention_np.common.validation included, is attention_np's, so bad calls raise what the spec requires. Each
variant's docstring says the bug and which check of the suite's decode operation rejects it (the measure names of
`conformance.check` rows). No variant raises on ordinary inputs: the bug is a wrong answer, and each one is right on
a contiguous cache where every sequence takes every row (the only cache the decode operation drew before it drew
ragged chunks and pages).

`PAGED` is attention_np's correct paged cache as a module the suite can check; `BROKEN` maps a name to each
variant's.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

import numpy as np

from attention_np import asarray, modules, to_numpy
from attention_np.common import pages


class PageSizeOffByOne(modules.MultiHeadAttention):
    """The keys of position p read from page block_table[b, p // (page + 1)], slot p % page: the block table indexed
    with a page one position larger than the pool's (the writes are right). A sequence within its first page is
    read right; past it, its later keys come from the wrong page (another sequence's, or an unused one of NaN).
    Caught by: values."""

    def _page_scores(self, q: np.ndarray, cache: modules.PagedKVCache, tile: int, positions: np.ndarray,
                     end: np.ndarray, mask: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        M, page = cache.block_table.shape[1], cache.k.shape[-2]
        n = pages.tile_blocks(page)
        at = tile * n * page + np.arange(n * page)  # (T,): the positions the tile holds
        index = np.where(at // page < M, cache.block_table[:, np.minimum(at // (page + 1), M - 1)],
                         pages.NO_PAGE)  # (B, T): the bug, page + 1
        slot = (np.maximum(index, 0), slice(None), at % page)  # (B, T, Hkv, d_k) each
        k, v = (np.moveaxis(pool[slot], 1, 2) for pool in (cache.k, cache.v))  # (B, Hkv, T, d_k)
        held = (at < end[:, None]) & (index >= 0)  # (B, T)
        seen = held[:, None, None, :] & (at <= positions[:, None, :, None])  # (B, 1, L, T)
        if mask is not None:
            seen = seen & ((mask[..., np.minimum(at, M * page - 1)] if np.shape(mask)[-1] > 1 else mask) != 0)
        G, scale = self.num_heads // self.num_kv_heads, 1.0 / np.sqrt(q.shape[-1])
        scores = (q * scale) @ np.swapaxes(np.repeat(k, G, axis=1), -1, -2)  # (B, H, L, T)
        return np.where(seen, scores, -np.inf), np.where(held[:, None, :, None], v, 0)


class PaddingSlotRead(modules.MultiHeadAttention):
    """The values of a block zeroed only where the sequence holds no page, not in the slots of its own pages past its
    length: those slots weigh 0 (causality hides them), but 0 times the NaN an unused slot holds is NaN, and the
    output row turns NaN. Right while the unused slots hold finite values. Caught by: values."""

    def _page_scores(self, q: np.ndarray, cache: modules.PagedKVCache, tile: int, positions: np.ndarray,
                     end: np.ndarray, mask: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        scores, _ = super()._page_scores(q, cache, tile, positions, end, mask)
        (B, M), page = cache.block_table.shape, cache.k.shape[-2]
        blocks = tile * pages.tile_blocks(page) + np.arange(pages.tile_blocks(page))  # (n,)
        index = np.where(blocks < M, cache.block_table[:, np.minimum(blocks, M - 1)], pages.NO_PAGE)  # (B, n)
        v = np.moveaxis(cache.v[np.maximum(index, 0)], 1, 2).reshape(B, -1, blocks.size * page, cache.v.shape[-1])
        held = np.repeat(index >= 0, page, axis=1)  # (B, T): the bug, slots past the length kept
        return scores, np.where(held[:, None, :, None], v, 0)


class RopeFromSequenceZero(modules.MultiHeadAttention):
    """RoPE turns every sequence's new rows at sequence 0's positions (its length + i), where each sequence's rows
    stand at its own length + i: right while the sequences are equally long, wrong for ragged chunks with
    rope_theta. Caught by: values."""

    def _rotated(self, q: np.ndarray, k: np.ndarray, start: int | np.ndarray,
                 tables: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
        if np.ndim(start):  # (..., 1, L): each sequence's positions; the bug: sequence 0's for all
            start = np.broadcast_to(np.reshape(start, (-1, *np.shape(start)[-2:]))[0], np.shape(start))
        return super()._rotated(q, k, start, tables)


def _block_of(attention: type[modules.MultiHeadAttention]) -> type[modules.TransformerBlock]:
    """attention_np's TransformerBlock whose attention is an `attention`."""

    class Block(modules.TransformerBlock):
        @classmethod
        def from_state_dict(cls, state: Mapping[str, Any], **options: Any) -> modules.TransformerBlock:
            block = super().from_state_dict(state, **options)
            fields = {name: getattr(block.attn, name) for name in block.attn._children + block.attn._settings}
            return block._replace(attn=attention._build(**fields))

    return Block


def as_module(attention: type[modules.MultiHeadAttention], name: str) -> types.ModuleType:
    """A module object with the contract's names for decoding: MultiHeadAttention, TransformerBlock (whose attention
    is an `attention`), and attention_np's array conversions."""
    module = types.ModuleType(name, f"decoding through {attention.__name__}.")
    module.asarray, module.to_numpy = asarray, to_numpy
    module.MultiHeadAttention, module.TransformerBlock = attention, _block_of(attention)
    return module


VARIANTS: dict[str, type[modules.MultiHeadAttention]] = {
    "page_size_off_by_one": PageSizeOffByOne,
    "padding_slot_read": PaddingSlotRead,
    "rope_from_sequence_zero": RopeFromSequenceZero,
}
PAGED = as_module(modules.MultiHeadAttention, __name__)
BROKEN = {name: as_module(cls, f"{__name__}.{name}") for name, cls in VARIANTS.items()}
