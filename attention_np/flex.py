"""Programmable attention (torch's FlexAttention interface) in NumPy: a score function and a block mask,
tile by tile with the online softmax, forward and backward.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

The score functions and mask functions, and the catalogue of them, are in attention_np/common/mods.py; the
block mask, which tiles a mask function leaves empty, partial or full, in attention_np/common/block_mask.py.

The forward pass: flash.py's online softmax, over R = score_mod(S) in place of the scores. For one tile of
queries (rows) against one tile of keys (cols),
    S = (Q K^T) * scale                                   the scores, (B, H, block_q, block_k)
    R = score_mod(S, b, h, q_idx, kv_idx)                 the new scores, elementwise
    R = R - slope_h * |q_idx - kv_idx|                    with alibi_slopes (from the tile's positions)
    R = where(mask_mod(b, h, q_idx, kv_idx), R, -inf)     on a partial tile only
and the running maximum m, denominator l and output O of flash.py move from tile to tile of the row:
    m_t = max(m_{t-1}, rowmax(R_t)),  l_t = exp(m_{t-1} - m_t) l_{t-1} + rowsum(exp(R_t - m_t)),
    O_t = exp(m_{t-1} - m_t) O_{t-1} + exp(R_t - m_t) V_t,     out = O_T / l_T,  lse = m_T + log(l_T).
The mask is applied after the score function, so that a hidden key stays hidden whatever score_mod makes of
its score. The tiles are the block mask's; a tile is computed for the whole batch and every head at once, so
its kind is BlockMask.batch_kinds()'s: an empty tile (empty in every (b, h)) is skipped, a full one is
computed without calling mask_mod, and a partial one calls it on the tile's index arrays. The forward pass
takes a row's consecutive tiles that are not empty side by side, a run of up to RUN_SCORES scores: one
product Q K^T and one step of the online softmax per run (mods.sliding_window(256, 0) in tiles of 128: one run of
three tiles per row), the mods still called tile by tile on each tile's index arrays.

The backward pass recomputes each tile, P = exp(R - lse), and with D = rowsum(dO * O) (= rowsum(dP * P), as in
flash.py):
    dV += P^T dO,  dP = dO V^T,  dR = P * (dP - D),
    (dS, dtheta) = score_mod.vjp(dR, S, b, h, q_idx, kv_idx)     its hand-derived derivative (mods.ScoreMod)
    dQ += dS K * scale,  dK += dS^T Q * scale,   and dtheta, the parameters' gradients, summed over the tiles.
A hidden key has P = 0, so dR = 0 there; dS is set to 0 there too (with `where`), whatever the score
function's derivative says at a score it never used.

Grouped-query attention (enable_gqa) repeats each key/value head for its H // Hkv query heads (a copy of k
and v, H / Hkv times their size, never of the scores), so that every tile is one (B, H, block_q, block_k)
product; dk and dv are summed over each group's query heads at the end. Without it k and v are read as given.

The rows of query tiles run on a thread pool (flash.py's: NumPy releases the GIL in matmul and exp), the rows
that compute the most tiles first, so that the threads finish together; each row writes its own rows of out
and lse. The mods are called from those threads, so they must not keep state between calls (the catalogue's
do not).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import numpy as np

from attention_np.common import block_mask as blocks
from attention_np.common import validation
from attention_np.common.block_mask import EMPTY, FULL, PARTIAL, BlockMask

from .arrays import to_numpy
from .flash import _in_threads
from .functional import _dtypes
from .primitives import (
    _alibi_slopes,
    _alibi_tile,
    _check_derivative,
    _parameter_dtype,
    _sink_gradient,
    _sink_logits,
    _sunk_rows,
)

NO_MASK_TILE = 128  # block_mask None: tiles of 128 x 128, every one full (torch's default BLOCK_SIZE)
RUN_SCORES = 1 << 20  # scores over the batch (4 MiB of float32) of a run of key tiles computed as one product
NO_OFFSET = np.zeros((), np.int64)  # no offset of the queries in flex: ALiBi's p_i is query i's index


def flex_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    score_mod: Callable[..., Any] | None = None,
    block_mask: BlockMask | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    sinks: np.ndarray | None = None,
    alibi_slopes: np.ndarray | None = None,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
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
        sinks: one logit per head, broadcasting to (B, H), as for flash_attention: each row's sink joins its
            softmax's denominator once, after the tiles (lse includes it; a query that sees no key keeps zeros).
        alibi_slopes: ALiBi's slopes, (H,) or (B, H), one per query head: each tile adds -slope_h * |i - j| (the
            query's position is i, as flex has no offset) to score_mod's result, before the mask, as
            scaled_dot_product_attention adds it after score_mod; built from the tile's positions; constants.

    Returns:
        out (B, H, L, Ev) in q's dtype, computed in at least float32; with return_lse, (out, lse (B, H, L)) in
        the dtype the scores are computed in.
    """
    p = _problem(q, k, v, score_mod, block_mask, scale, enable_gqa, alibi_slopes)
    out, lse = _sunk_rows(*_forward(p), sinks)  # the sink joins each row once, after the tiles
    out = out.astype(q.dtype, copy=False)
    return (out, lse) if return_lse else out


def flex_attention_vjp(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    score_mod: Callable[..., Any] | None = None,
    block_mask: BlockMask | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    sinks: np.ndarray | None = None,
    alibi_slopes: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, Callable]:
    """P = exp(R - lse) recomputed tile by tile, R = score_mod(S), S = (Q K^T) * scale;  D = rowsum(dO * O),
    dV += P^T dO,  dP = dO V^T,  dR = P * (dP - D),  (dS, dtheta) = score_mod's vjp at dR,
    dQ += dS K * scale,  dK += dS^T Q * scale; dtheta, the score function's parameters' gradients, summed over
    the tiles.

    NumPy's backward is derived by hand: score_mod must carry its vjp (every ScoreMod of
    attention_np.common.mods does); a plain function has none, and a ValueError says so.

    Args:
        q, k, v, score_mod, block_mask, scale, enable_gqa, sinks, alibi_slopes: as for flex_attention; the
            slopes are constants (their bias joins R after score_mod, dR unchanged).

    Returns:
        out (B, H, L, Ev), lse (B, H, L) and pullback(d_out (B, H, L, Ev)) -> (dq, dk, dv, d_score_mod), each of
        dq, dk, dv with its input's shape and dtype, and d_score_mod a dict {parameter name: gradient} of the
        score function's parameters (ScoreMod.parameters; empty without); with sinks (dq, dk, dv, d_sinks,
        d_score_mod), d_sinks = -sum_i exp(sink - lse_i) rowsum(dO * O)_i in the sinks' shape.
    """
    _check_derivative("flex_attention_vjp", score_mod)
    p = _problem(q, k, v, score_mod, block_mask, scale, enable_gqa, alibi_slopes)
    out, lse = _sunk_rows(*_forward(p), sinks)  # out in the working dtype, which D = rowsum(dO * O) reads; with
    # sinks, lse holds the sink, so P = exp(R - lse) are the final weights
    returned = out.astype(q.dtype, copy=False)

    def pullback(d_out: np.ndarray) -> tuple:
        validation.cotangent("d_out", d_out.shape, returned.shape, _dtypes(d_out=d_out, out=returned))
        dq, dk, dv, d_theta = _backward(p, out, lse, d_out.astype(p.work, copy=False), (q, k, v))
        if sinks is None:
            return dq, dk, dv, d_theta
        laid = _sink_logits(sinks, lse.shape[:-1], False, lse.dtype)  # (B | 1, H | 1, 1, 1)
        D = np.sum(d_out.astype(p.work) * out, axis=-1, keepdims=True)  # rowsum(dO * O), (B, H, L, 1)
        share = np.exp(laid - np.where(lse == -np.inf, np.inf, lse)[..., None])  # (B, H, L, 1); 0 where lse -inf
        d_sinks = _sink_gradient(D, share, laid, np.shape(sinks)).astype(_parameter_dtype(sinks, p.work))
        return dq, dk, dv, d_sinks, d_theta

    return returned, lse, pullback


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
    return blocks.create(mask_mod, B, H, Q_LEN, KV_LEN, BLOCK_SIZE, arange=np.arange, to_numpy=to_numpy)


class _Problem(NamedTuple):
    """One call's checked inputs in the working dtype and its tiles: what both passes read."""

    q: np.ndarray  # (B, H, L, E)
    k: np.ndarray  # (B, H, S, E): with enable_gqa each key/value head repeated for its query heads
    v: np.ndarray  # (B, H, S, Ev)
    score_mod: Callable[..., Any] | None
    mask_mod: Callable[..., Any] | None  # evaluated on the partial tiles only
    kinds: np.ndarray  # (rows, columns) of tiles: EMPTY, PARTIAL or FULL over the whole batch and every head
    block_q: int
    block_k: int
    scale: float
    work: np.dtype  # the working dtype: at least float32
    b: np.ndarray  # (B, 1, 1, 1) and (1, H, 1, 1): the batch and head indices the mods receive
    h: np.ndarray
    slopes: np.ndarray | None  # ALiBi's slopes laid out against the scores (B | 1, H, 1, 1) (None: no ALiBi)


def _problem(q: np.ndarray, k: np.ndarray, v: np.ndarray, score_mod: Callable[..., Any] | None,
             block_mask: BlockMask | None, scale: float | None, enable_gqa: bool,
             alibi_slopes: np.ndarray | None = None) -> _Problem:
    """The checks, then the inputs as the tiles read them: k and v with one head per query head, the tiles'
    kinds (every one FULL, 128 x 128, without a block mask) and ALiBi's slopes laid out against the scores."""
    B, H = validation.flex_inputs(q.shape, k.shape, v.shape, enable_gqa)
    validation.same_floating_dtype(_dtypes(q=q, k=k, v=v))
    scale = validation.default_scale(scale, q.shape, k.shape)
    L, S = q.shape[2], k.shape[2]
    if block_mask is None:
        mask_mod, (block_q, block_k) = None, (NO_MASK_TILE, NO_MASK_TILE)
        kinds = np.full((-(-L // block_q), -(-S // block_k)), FULL, np.uint8)
    else:
        validation.block_mask_fits(block_mask, B, H, L, S)
        mask_mod, (block_q, block_k), kinds = block_mask.mask_mod, block_mask.block_size, block_mask.batch_kinds()
    work = np.promote_types(q.dtype, np.float32)  # float16, bfloat16: in float32
    groups = H // k.shape[1]  # query heads per key/value head: 1 without enable_gqa
    if groups > 1:  # (B, Hkv, S, *) -> (B, H, S, *): head h reads h // groups
        k, v = (np.repeat(x, groups, axis=1) for x in (k, v))
    return _Problem(
        q=q.astype(work, copy=False), k=k.astype(work, copy=False), v=v.astype(work, copy=False),
        score_mod=score_mod, mask_mod=mask_mod, kinds=kinds, block_q=block_q, block_k=block_k, scale=scale,
        work=work, b=np.arange(B).reshape(B, 1, 1, 1), h=np.arange(H).reshape(1, H, 1, 1),
        slopes=_alibi_slopes(alibi_slopes, (B, H), False, work))  # the query heads: k, v repeated above


def _span(index: int, size: int, n: int) -> slice:
    """The index-th tile of `size` positions along an axis of n (the last tile may be shorter)."""
    return slice(index * size, min((index + 1) * size, n))


class _Tile(NamedTuple):
    """One run of tiles of a row: their scores side by side, and what the backward pass needs of them."""

    scores: np.ndarray  # S = (Q K^T) * scale, (B, H, block_q, keys); the run's own array, writable
    new: np.ndarray  # R = score_mod(S), -inf where hidden, (B, H, block_q, keys); without a score function
    # `scores` itself (so that scores holds -inf where hidden then)
    indices: tuple  # (b, h, q_idx, kv_idx) over the run's keys; a tile's mods got kv_idx's part of it
    rows: slice
    cols: slice  # the run's keys


def _tile(p: _Problem, rows: slice, q_idx: np.ndarray, run: range) -> _Tile:
    """The key tiles `run` (consecutive, none empty) of the queries `rows` (their indices q_idx (1, 1, block_q, 1),
    made once per row of tiles), side by side: S in one product, then for each tile R = score_mod(S) (plus ALiBi's
    -slope_h * |i - j|) and, on a partial tile, the mask function's hidden keys set to -inf (a full one never
    calls it)."""
    cols = slice(run.start * p.block_k, min(run.stop * p.block_k, p.k.shape[2]))
    kv_idx = np.arange(cols.start, cols.stop).reshape(1, 1, 1, -1)  # (1, 1, 1, keys)
    # 1) the scores: (B, H, block_q, E) x (B, H, E, keys) -> (B, H, block_q, keys)
    scores = p.q[:, :, rows] @ np.swapaxes(p.k[:, :, cols], -1, -2)
    scores *= p.scale
    new = scores if p.score_mod is None else np.empty_like(scores)
    for col in run:  # each tile's mods on its own index arrays
        part = _span(col - run.start, p.block_k, cols.stop - cols.start)  # the tile's keys within the run
        indices = (p.b, p.h, q_idx, kv_idx[..., part])
        # 2) the score function, elementwise; it may broadcast, never change the tile's shape
        if p.score_mod is not None:
            tile_new = p.score_mod(scores[..., part], *indices)
            validation.score_mod_result(np.shape(tile_new), scores[..., part].shape)
            new[..., part] = tile_new
        # 3) ALiBi, where sdpa adds it: after the score function, before the mask; query i at position i
        if p.slopes is not None:
            keys = slice(cols.start + part.start, cols.start + part.stop)
            new[..., part] += _alibi_tile(p.slopes, NO_OFFSET, rows, keys)  # (B | 1, H, block_q, block_k)
        # 4) the mask, after the score function: a hidden key stays hidden
        if p.kinds[rows.start // p.block_q, col] == PARTIAL:
            visible = np.asarray(p.mask_mod(*indices))
            validation.mask_mod_result("mask_mod", visible.shape, str(visible.dtype), scores[..., part].shape)
            np.copyto(new[..., part], -np.inf, where=~visible)
    return _Tile(scores=scores, new=new, indices=(p.b, p.h, q_idx, kv_idx), rows=rows, cols=cols)


def _runs(p: _Problem, row: int) -> list[range]:
    """The row's key tiles that are not empty, in runs of consecutive ones, each run at most RUN_SCORES scores
    over the batch (and at least one tile)."""
    B, H = p.q.shape[:2]
    longest = max(1, RUN_SCORES // (B * H * p.block_q * p.block_k))  # tiles per run
    runs: list[range] = []
    for col in np.flatnonzero(p.kinds[row] != EMPTY):  # an empty tile is never computed
        if runs and runs[-1].stop == col and len(runs[-1]) < longest:
            runs[-1] = range(runs[-1].start, col + 1)
        else:
            runs.append(range(col, col + 1))
    return runs


def _forward(p: _Problem) -> tuple[np.ndarray, np.ndarray]:
    """out (B, H, L, Ev) and lse (B, H, L), in the working dtype: the rows of query tiles, each on its own."""
    B, H, L, _ = p.q.shape
    out = np.zeros((B, H, L, p.v.shape[-1]), p.work)  # (B, H, L, Ev)
    lse = np.full((B, H, L), -np.inf, p.work)  # (B, H, L)

    def query_tile(row: int) -> None:
        rows = _span(row, p.block_q, L)
        out[:, :, rows], lse[:, :, rows] = _query_tile(p, row)

    computed = np.count_nonzero(p.kinds != EMPTY, axis=1)  # tiles per row
    _run(p, query_tile, (int(row) for row in np.argsort(-computed, kind="stable")))  # the busiest rows first
    return out, lse


def _query_tile(p: _Problem, row: int) -> tuple[np.ndarray, np.ndarray]:
    """out (B, H, block_q, Ev) and lse (B, H, block_q) of the queries of tile `row`: the online softmax over the
    runs of key tiles of the row that are not empty, one step per run."""
    B, H, L, _ = p.q.shape
    rows = _span(row, p.block_q, L)
    n = rows.stop - rows.start  # the tile's queries (the last tile may be short)
    q_idx = np.arange(rows.start, rows.stop).reshape(1, 1, -1, 1)  # (1, 1, block_q, 1), for every tile of the row
    m = np.full((B, H, n, 1), -np.inf, p.work)  # running maximum (B, H, block_q, 1)
    l = np.zeros_like(m)  # running denominator  # noqa: E741 (the paper's name)
    acc = np.zeros((B, H, n, p.v.shape[-1]), p.work)  # running output (B, H, block_q, Ev)
    for run in _runs(p, row):
        tile = _tile(p, rows, q_idx, run)  # R (B, H, block_q, keys), -inf where hidden
        # 1) the new running maximum; where nothing is seen yet (the maximum -inf) the shift is 0, so that
        #    exp(-inf - shift) is 0, not exp(-inf + inf) = NaN
        m_new = np.maximum(m, np.max(tile.new, axis=-1, keepdims=True))
        shift = np.where(m_new == -np.inf, 0, m_new)
        # 2) what was summed against the old maximum, moved to the new one: exp(m - m_new)
        rescale = np.exp(m - shift)  # (B, H, block_q, 1); 0 on the first run a row sees
        # unnormalised; hidden: exp(-inf) = 0; written over the scores, which the forward pass no longer reads
        weights = np.exp(np.subtract(tile.new, shift, out=tile.scores), out=tile.scores)
        l = l * rescale + np.sum(weights, axis=-1, keepdims=True)  # noqa: E741
        acc *= rescale
        acc += weights @ p.v[:, :, tile.cols]  # (B, H, bq, keys) x (B, H, keys, Ev) -> (B, H, bq, Ev)
        m = m_new
    # 3) normalise once, at the end; a query with no visible key has l = 0: zeros, and lse -inf
    seen = l != 0
    out = acc / np.where(seen, l, 1)  # (B, H, block_q, Ev)
    with np.errstate(divide="ignore"):
        lse = np.where(seen, m + np.log(l), -np.inf)  # (B, H, block_q, 1)
    return out, lse[..., 0]


def _run(p: _Problem, task: Callable[[int], None], items: Iterable[int]) -> None:
    """task(item) for every item, on flash.py's thread pool where the problem's query-key-width products pay for
    it (each thread one BLAS thread), else in turn."""
    B, H, L, E = p.q.shape
    _in_threads(B * H * L * p.k.shape[2] * E, task, items)


def _backward(p: _Problem, out: np.ndarray, lse: np.ndarray, d_out: np.ndarray,
              inputs: tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """The pullback, tile by tile over the tiles the forward pass computed: dq, dk, dv in their inputs' shapes
    and dtypes (dk, dv summed over each group's query heads), and the score function's parameters' gradients."""
    q_in, k_in, v_in = inputs
    B, H = p.q.shape[:2]
    dq, dk, dv = np.zeros_like(p.q), np.zeros_like(p.k), np.zeros_like(p.v)  # (B, H, L | S, E | Ev)
    parameters = getattr(p.score_mod, "parameters", {})
    d_parameters = {name: np.zeros(np.shape(value), p.work) for name, value in parameters.items()}
    D = np.sum(d_out * out, axis=-1, keepdims=True)  # rowsum(dO * O) = rowsum(dP * P), (B, H, L, 1)
    lse = np.where(lse == -np.inf, np.inf, lse)[..., None]  # a query that sees nothing: P = exp(-inf - inf) = 0
    for row, col in zip(*np.nonzero(p.kinds != EMPTY), strict=True):
        rows = _span(int(row), p.block_q, p.q.shape[2])
        tile = _tile(p, rows, np.arange(rows.start, rows.stop).reshape(1, 1, -1, 1), range(col, col + 1))
        rows, cols = tile.rows, tile.cols
        # 1) the weights again, from the log-sum-exp: P = exp(R - lse), 0 where hidden
        weights = np.exp(tile.new - lse[:, :, rows])  # (B, H, bq, bk)
        d_o = d_out[:, :, rows]  # (B, H, bq, Ev)
        # 2) through the value product and the softmax
        dv[:, :, cols] += np.swapaxes(weights, -1, -2) @ d_o  # (B, H, bk, bq) x (B, H, bq, Ev) -> (B, H, bk, Ev)
        d_weights = d_o @ np.swapaxes(p.v[:, :, cols], -1, -2)  # (B, H, bq, Ev) x (B, H, Ev, bk) -> (B, H, bq, bk)
        d_new = weights * (d_weights - D[:, :, rows])  # dR = P * (dP - D), 0 where hidden
        # 3) through the score function: its hand-derived vjp; 0 where hidden, whatever it says there
        d_scores, d_theta = _score_mod_vjp(p, d_new, tile)
        d_scores = np.where(tile.new == -np.inf, 0, d_scores)
        for name, gradient in d_theta.items():
            d_parameters[name] += gradient
        # 4) through S = (Q K^T) * scale
        dq[:, :, rows] += d_scores @ p.k[:, :, cols] * p.scale  # (B, H, bq, bk) x (B, H, bk, E) -> (B, H, bq, E)
        dk[:, :, cols] += np.swapaxes(d_scores, -1, -2) @ p.q[:, :, rows] * p.scale  # -> (B, H, bk, E)
    Hkv = k_in.shape[1]
    dk, dv = (d.reshape(B, Hkv, H // Hkv, *d.shape[2:]).sum(axis=2) for d in (dk, dv))  # the groups' sum
    return (dq.astype(q_in.dtype, copy=False), dk.astype(k_in.dtype, copy=False), dv.astype(v_in.dtype, copy=False),
            {name: d.astype(_parameter_dtype(parameters[name], p.work), copy=False)
             for name, d in d_parameters.items()})


def _score_mod_vjp(p: _Problem, d_new: np.ndarray, tile: _Tile) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(dS, dtheta) from dR: score_mod's vjp (the identity's, dS = dR, without a score function)."""
    if p.score_mod is None:
        return d_new, {}
    d_scores, d_theta = p.score_mod.vjp(d_new, tile.scores, *tile.indices)
    return np.broadcast_to(d_scores, d_new.shape), d_theta

