"""The bookkeeping of a paged key/value cache (vLLM's PagedAttention), shared by the three backends: which page of
the pool holds which block of positions of which sequence. Plain NumPy on the host: a block table is small, and
the pages a step needs are chosen before the step runs (a compiled step reads the table as data).

Shape legend: B sequences (the batch), P pages in the pool, page the positions a page holds, M blocks a
sequence may hold (max_pages); its capacity is M * page positions.

Sequence b's position p lives in page block_table[b, p // page], slot p % page; an entry -1 holds no page. A page
belongs to at most one sequence; the pages no entry names are free. `reserve` gives each sequence the pages its
next positions need, from the free ones in increasing order; `release` frees every page of some sequences.
"""

from __future__ import annotations

import numpy as np

NO_PAGE = -1  # a block-table entry that holds no page
TILE = 64  # attention reads the pages of every sequence this many positions at a time (a tile; one page at least)


def tile_blocks(page: int) -> int:
    """The blocks of a tile: the pages that TILE positions fill, one at least."""
    return max(1, TILE // page)


def tiles(positions: int, page: int) -> int:
    """The tiles that hold a sequence's first `positions` positions."""
    return -(-positions // (tile_blocks(page) * page))  # ceil


def reserve(block_table: np.ndarray, lengths: np.ndarray, new: np.ndarray, num_pages: int,
            page: int) -> np.ndarray:
    """The block table (B, M) with pages for lengths + new positions of each sequence: the missing blocks take
    free pages (the lowest first); a copy, the given table unchanged. ValueError where a sequence would pass its
    M blocks, or the pool has too few free pages."""
    table = np.array(block_table, copy=True)
    needed = -(-(np.asarray(lengths) + np.asarray(new)) // page)  # ceil: the blocks each sequence needs, (B,)
    if (needed > table.shape[1]).any():
        b = int(np.argmax(needed))
        raise ValueError(f"sequence {b} needs {int(needed[b])} pages of {page} positions, more than the block "
                         f"table's max_pages = {table.shape[1]}")
    used = np.zeros(num_pages, bool)
    used[table[table != NO_PAGE]] = True
    free = iter(np.flatnonzero(~used).tolist())
    for b, blocks in enumerate(needed.tolist()):
        for block in range(blocks):
            if table[b, block] == NO_PAGE:
                page_index = next(free, None)
                if page_index is None:
                    raise ValueError(f"the pool's {num_pages} pages are all in use: sequence {b} needs {blocks} "
                                     "pages; release finished sequences or make a larger pool")
                table[b, block] = page_index
    return table


def release(block_table: np.ndarray, sequences: np.ndarray) -> np.ndarray:
    """The block table (B, M) with every page of `sequences` (indices into B, or a boolean (B,)) freed."""
    table = np.array(block_table, copy=True)
    table[np.asarray(sequences)] = NO_PAGE
    return table
