"""Tiled attention with the online softmax (the FlashAttention-2 algorithm), forward and backward, in NumPy.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

The scores of one tile of queries against one tile of keys, (..., block_q, block_k), are the only
scores that ever exist, so memory grows as L + S, not L * S.

The forward pass: the online softmax. For a query row, after the key tiles 1..t,
    m_t = max(m_{t-1}, rowmax(S_t))                      the running maximum of the visible scores
    l_t = exp(m_{t-1} - m_t) l_{t-1} + rowsum(exp(S_t - m_t))        the running denominator
    O_t = exp(m_{t-1} - m_t) O_{t-1} + exp(S_t - m_t) V_t            the running, unnormalised output
and at the end out = O_T / l_T, lse = m_T + log(l_T). When the maximum grows, everything summed so far
was exponentiated against the old maximum: multiplying by exp(m_{t-1} - m_t) moves it to the new one, so
the result is exactly softmax(S) V, one tile at a time.

The backward pass recomputes each tile's weights from the log-sum-exp, P = exp(S - lse), instead of keeping
them. With D = rowsum(dO * O) (= rowsum(dP * P), since O = P V):
    dV += P^T dO,  dP = dO V^T,  dS = P * (dP - D),  dQ += dS K * scale,  dK += dS^T Q * scale.

Tiles that the structure (is_causal, window, q_offset, key_lengths) hides from every query of a tile are
never computed: causal attention does about half the work. Query tiles (forward) and key tiles (backward)
run on a thread pool, since NumPy releases the GIL in matmul and exp.

A mask function and a score function (mask_mod, score_mod; attention_np.common.mods) see each tile's slice of
the index arrays: score_mod changes the tile's scores after softcap and before the bias, mask_mod is and-ed with
the mask and the keyword rules. A block mask (block_mask, from create_block_mask) brings its tiles, which become
flash's (block_q, block_k = its BLOCK_SIZE), and their kinds over the whole batch (BlockMask.batch_kinds(), as
flex.py reads them): an empty tile is skipped, forward and backward, never computed; a full one is computed
without calling its mask function; a partial one calls it on the tile's indices. The keyword rules still apply
on top, and skip their own tiles as before.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
import threadpoolctl

from attention_np.common import validation
from attention_np.common.block_mask import EMPTY, PARTIAL, BlockMask
from attention_np.common.mods import within_tile
from attention_np.common.records import FlashOptions, Structure

from .functional import _dtypes, _grouped, _prepare
from .primitives import (
    _alibi_slopes,
    _alibi_tile,
    _by_position,
    _check_derivative,
    _integers,
    _modded,
    _Mods,
    _parameter_dtype,
    _score_mod_vjp,
    _sink_gradient,
    _sink_logits,
    _sum_to,
)

PARALLEL_WORK = 1 << 22  # query-key-width products (L * S * E over the batch) above which tiles run in threads
TILE_SCORES = 1 << 20  # scores in a tile over the batch (4 MiB of float32) where block_q, block_k are None: each
# tile costs about fifteen NumPy calls whatever its size; larger tiles ran slower (docs/performance.md)


def flash_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    mask: np.ndarray | None = None,
    *,
    bias: np.ndarray | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    q_offset: int | np.ndarray = 0,
    window: tuple[int | None, int | None] | None = None,
    key_lengths: np.ndarray | None = None,
    softcap: float | None = None,
    enable_gqa: bool = False,
    mask_mod: Callable[..., Any] | None = None,
    score_mod: Callable[..., Any] | None = None,
    sinks: np.ndarray | None = None,
    alibi_slopes: np.ndarray | None = None,
    block_mask: BlockMask | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Attention(Q, K, V) = softmax(score_mod(softcap(Q K^T * scale)) + bias) V, tile by tile with the online
    softmax; lse = log sum_j exp(scores_ij) over the visible keys j. With sinks, the running maximum starts at the
    sink and the running denominator at exp(sink - sink) = 1: lse = log(exp(sink) + sum_j exp(scores_ij)).

    Args:
        q, k, v, mask, bias, is_causal, scale, q_offset, window, key_lengths, softcap, enable_gqa: as for
            scaled_dot_product_attention (no dropout); mask and bias are read one tile at a time.
        mask_mod: (b, h, q_idx, kv_idx) -> bool, True where the query sees the key (attention_np.common.mods);
            needs q, k, v of four axes (B, H, L, E); and-ed with mask and the keyword rules.
        score_mod: (score, b, h, q_idx, kv_idx) -> the score the softmax uses, applied after softcap and before
            bias; needs four axes as mask_mod.
        sinks: one logit per head, broadcasting to (..., H), as for scaled_dot_product_attention.
        alibi_slopes: ALiBi's slopes, (H,) or (B, H), as for scaled_dot_product_attention: each tile adds
            -slope_h * |p_i - j| from its positions (no (L, S) bias is formed); constants, no gradient.
        block_mask: from create_block_mask over (B or 1, H or 1, L, S): its tiles are flash's (block_q
            and block_k None), an empty tile is skipped, a full one computed without its mask function.
        block_q: queries per tile (the last tile may be shorter); None: chosen from the shapes
            (validation.default_tiles within the backend's TILE_SCORES).
        block_k: keys per tile (the last tile may be shorter); None: as for block_q.

    Returns:
        out (..., L, Ev), equal to scaled_dot_product_attention's, and lse (..., L) in the dtype the scores
        are computed in (float32 for float16 and bfloat16 inputs): -inf where a query sees no key (with sinks, the
        sink: its out is still zeros).
    """
    out, lse, _ = _forward(q, k, v, mask, bias, FlashOptions(
        is_causal=is_causal, scale=scale, q_offset=q_offset, window=window, key_lengths=key_lengths,
        softcap=softcap, enable_gqa=enable_gqa, block_q=block_q, block_k=block_k, sinks=sinks,
        alibi_slopes=alibi_slopes),
        _Given(mask_mod=mask_mod, score_mod=score_mod, block_mask=block_mask))
    return out, lse


def flash_attention_vjp(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    mask: np.ndarray | None = None,
    *,
    bias: np.ndarray | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    q_offset: int | np.ndarray = 0,
    window: tuple[int | None, int | None] | None = None,
    key_lengths: np.ndarray | None = None,
    softcap: float | None = None,
    enable_gqa: bool = False,
    mask_mod: Callable[..., Any] | None = None,
    score_mod: Callable[..., Any] | None = None,
    sinks: np.ndarray | None = None,
    alibi_slopes: np.ndarray | None = None,
    block_mask: BlockMask | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[np.ndarray, np.ndarray, Callable]:
    """P = exp(S - lse) recomputed tile by tile,  D = rowsum(dO * O),  dV += P^T dO,  dP = dO V^T,
    dS = P * (dP - D),  dQ += dS K * scale,  dK += dS^T Q * scale,  dbias = dS (with softcap, dQ and dK take
    dR = dS * (1 - tanh^2(R / c)) in place of dS, as in scaled_dot_product_attention_vjp; with score_mod, its
    vjp comes first, (dC, dtheta) = score_mod.vjp(dS, C), C the scores it received, dC = 0 where P = 0, and
    dtheta, its parameters' gradients, is summed over the tiles). With sinks, lse holds the sink, so P is the
    keys' share of a denominator with the sink in it, and d sink = -sum_i exp(sink - lse_i) D_i.

    D replaces scaled_dot_product_attention_vjp's rowsum(dP * P), which needs a whole row of P: since
    O = P V, rowsum(dP * P) = sum_j (dO . v_j) P_ij = dO . O, one number per query from (..., L, Ev) arrays.
    Nothing of size L * S is kept between the passes: the forward keeps out and lse only.

    Args:
        q, k, v, mask, bias, is_causal, scale, q_offset, window, key_lengths, softcap, enable_gqa: as for
            flash_attention.
        mask_mod: (b, h, q_idx, kv_idx) -> bool, True where the query sees the key (attention_np.common.mods);
            needs q, k, v of four axes (B, H, L, E); and-ed with mask and the keyword rules.
        score_mod: (score, b, h, q_idx, kv_idx) -> the score the softmax uses, applied after softcap and before
            bias; needs four axes as mask_mod.
        sinks: one logit per head, broadcasting to (..., H), as for scaled_dot_product_attention.
        alibi_slopes: ALiBi's slopes, (H,) or (B, H), as for scaled_dot_product_attention: each tile adds
            -slope_h * |p_i - j| from its positions (no (L, S) bias is formed); constants, no gradient.
        block_mask: from create_block_mask over (B or 1, H or 1, L, S): its tiles are flash's (block_q
            and block_k None), an empty tile is skipped, a full one computed without its mask function.
        block_q, block_k: as for flash_attention.

    Returns:
        out (..., L, Ev), lse (..., L) and pullback(d_out (..., L, Ev)) -> (dq, dk, dv, dbias), dbias None when
        bias is None; with a score_mod (dq, dk, dv, dbias, d_score_mod), d_score_mod a dict {parameter name:
        gradient} of score_mod.parameters (empty without); with sinks, d_sinks (sinks' shape) follows dbias:
        (dq, dk, dv, dbias, d_sinks) or (dq, dk, dv, dbias, d_sinks, d_score_mod); each gradient has its input's
        shape and dtype.
    """
    _check_derivative("flash_attention_vjp", score_mod)  # numpy: the backward is derived by hand
    out, lse, problem = _forward(q, k, v, mask, bias, FlashOptions(
        is_causal=is_causal, scale=scale, q_offset=q_offset, window=window, key_lengths=key_lengths,
        softcap=softcap, enable_gqa=enable_gqa, block_q=block_q, block_k=block_k, sinks=sinks,
        alibi_slopes=alibi_slopes),
        _Given(mask_mod=mask_mod, score_mod=score_mod, block_mask=block_mask))

    def pullback(d_out: np.ndarray) -> tuple:
        validation.cotangent("d_out", d_out.shape, out.shape, _dtypes(d_out=d_out, out=out))
        return _backward(problem, d_out, (q, k, v, bias, sinks))  # score_mod's parameters' gradients too

    return out, lse, pullback


class _Given(NamedTuple):
    """The mods a caller gave flash_attention, as its public functions hand them to the problem."""

    mask_mod: Callable[..., Any] | None = None
    score_mod: Callable[..., Any] | None = None
    block_mask: BlockMask | None = None  # replaces block_q, block_k and mask_mod by its own


_NO_MODS = _Given()  # ring attention's problems: no mods


class _Problem(NamedTuple):
    """One call's checked inputs in the working dtype (grouped with enable_gqa: q (..., Hkv, G, L, E), k and v
    (..., Hkv, 1, S, *)), its structure and its tiles: what both passes read."""

    q: np.ndarray  # (..., L, E)
    k: np.ndarray  # (..., S, E)
    v: np.ndarray  # (..., S, Ev)
    mask: np.ndarray | None  # a broadcast view (..., L, S), never copied
    bias: np.ndarray | None  # a broadcast view (..., L, S) in the working dtype
    bias_shape: tuple | None  # the caller's bias shape, which dbias is summed to tile by tile
    batch: tuple  # the scores' leading axes (...)
    L: int
    S: int
    scale: float
    softcap: float | None
    work: np.dtype  # the working dtype: at least float32
    empty: bool  # L = 0 or S = 0: nothing to attend
    structure: Structure  # q_offset and key_lengths as integer arrays of the batch
    shapes: dict  # the caller's shapes of q, k, v and bias, for the gradients
    block_q: int
    block_k: int
    grouped: bool  # enable_gqa: the heads split into (Hkv, G)
    offsets: tuple[int, int]  # q_offset's least and greatest value, which choose the tiles
    lengths: tuple[int, int] | None  # key_lengths' least and greatest value (None: no key_lengths)
    out: np.ndarray | None = None  # (..., L, Ev) and (..., L) in the working dtype, once the forward pass has run
    lse: np.ndarray | None = None
    mods: _Mods | None = None  # mask_mod (the block mask's with one) and score_mod, indices laid out as the scores
    kinds: np.ndarray | None = None  # a block mask's tiles (rows, columns): EMPTY, PARTIAL or FULL over the batch
    sinks: np.ndarray | None = None  # the sink logits laid out against the scores (..., 1, 1) (None: no sinks)
    slopes: np.ndarray | None = None  # ALiBi's slopes laid out against the scores (..., 1, 1) (None: no ALiBi)


def _problem(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None, bias: np.ndarray | None,
             options: FlashOptions, given: _Given = _NO_MODS) -> _Problem:
    """The checks of scaled_dot_product_attention, then the inputs as the tiles read them: mask and bias
    broadcast views of (..., L, S), never copied; q_offset and key_lengths reduced to the Python ints that
    choose the tiles (validation.key_tiles); the mods `given` with their index arrays, and a block mask's tiles in
    place of block_q and block_k."""
    (mask_mod, score_mod, block_mask), B, kinds = given, None, None
    if mask_mod is not None or score_mod is not None or block_mask is not None:
        B, H = validation.mods_inputs("flash_attention", q.shape, k.shape, v.shape)
        if block_mask is not None:  # its tiles are flash's; its mask function is evaluated on the partial ones
            tiles = validation.flash_block_mask(block_mask, mask_mod, options.block_q, options.block_k,
                                                (B, H, q.shape[-2], k.shape[-2]))
            options = options._replace(block_q=tiles[0], block_k=tiles[1])
            mask_mod, kinds = block_mask.mask_mod, block_mask.batch_kinds()
    validation.tiles(options.block_q, options.block_k)
    shapes = {"q": q.shape, "k": k.shape, "v": v.shape, "bias": None if bias is None else np.shape(bias),
              "sinks": None if options.sinks is None else np.shape(options.sinks)}
    q_offset, key_lengths = options.q_offset, options.key_lengths
    if options.enable_gqa:  # grouped-query attention as broadcasting: reshapes only (functional._grouped)
        q, k, v, mask, bias, q_offset, key_lengths = _grouped(q, k, v, mask, bias, q_offset, key_lengths)
    structure = Structure(is_causal=options.is_causal, q_offset=q_offset,
                          window=validation.window(options.window), key_lengths=key_lengths)
    batch, scale, empty = _prepare(q, k, v, None, None, structure, scale=options.scale,
                                   softcap=options.softcap, dropout_p=0.0, need_weights=False)
    L, S = q.shape[-2], k.shape[-2]
    shape = (*batch, L, S)  # the scores', never allocated
    _check_masks(mask, bias, shape)
    block_q, block_k = validation.default_tiles(options.block_q, options.block_k, batch, L, S, TILE_SCORES)
    work = np.promote_types(q.dtype, np.float32)  # float16, bfloat16: in float32
    sinks = _sink_logits(options.sinks, batch, options.enable_gqa, work)  # (..., 1, 1), or None
    slopes = _alibi_slopes(options.alibi_slopes, batch, options.enable_gqa, work)  # (..., 1, 1), or None
    q_offset = _integers(q_offset, "q_offset", batch)
    key_lengths = None if key_lengths is None else _integers(key_lengths, "key_lengths", batch)
    return _Problem(
        q=q.astype(work, copy=False), k=k.astype(work, copy=False), v=v.astype(work, copy=False),
        mask=None if mask is None else np.broadcast_to(mask, shape),
        bias=None if bias is None else np.broadcast_to(np.asarray(bias, dtype=work), shape),
        bias_shape=None if bias is None else _ranked(np.shape(bias), batch),  # dbias is summed to it tile by tile
        batch=batch, L=L, S=S, scale=scale, softcap=options.softcap, work=work, empty=empty is not None,
        structure=structure._replace(q_offset=q_offset, key_lengths=key_lengths), shapes=shapes,
        block_q=block_q, block_k=block_k, grouped=options.enable_gqa,
        offsets=(int(q_offset.min()), int(q_offset.max())) if q_offset.size else (0, 0),
        lengths=None if key_lengths is None or key_lengths.size == 0 else
        (int(key_lengths.min()), int(key_lengths.max())),
        mods=None if B is None else _Mods.of(mask_mod, score_mod, B, q.shape[1:-2], L, S),  # heads (H,) | (Hkv, G)
        kinds=kinds, sinks=sinks, slopes=slopes)


def _check_masks(mask: np.ndarray | None, bias: np.ndarray | None, shape: tuple) -> None:
    """mask and bias broadcast to the scores' shape (..., L, S); a floating mask holds 0 and 1 only."""
    for name, x in (("mask", mask), ("bias", bias)):
        if x is not None:
            validation.broadcasts_to(name, np.shape(x), shape, "..., L, S")
    if mask is not None and np.issubdtype(np.asarray(mask).dtype, np.floating):
        validation.binary_mask(True, bool(np.all((mask == 0) | (mask == 1))))


def _query_tiles(p: _Problem) -> list[slice]:
    return [slice(start, min(start + p.block_q, p.L)) for start in range(0, p.L, p.block_q)]


def _key_tiles(p: _Problem, rows: slice) -> list[slice]:
    """The key tiles that some query of `rows` may see (validation.key_tiles); the others are skipped."""
    tiles = validation.key_tiles(rows.start, rows.stop, p.S, p.block_k, is_causal=p.structure.is_causal,
                             window=p.structure.window, q_offset=p.offsets,
                             key_lengths=None if p.lengths is None else p.lengths[1])
    if p.kinds is not None:  # a block mask's empty tiles are never computed
        tiles = [t for t in tiles if p.kinds[rows.start // p.block_q, t] != EMPTY]
    return [slice(t * p.block_k, min((t + 1) * p.block_k, p.S)) for t in tiles]


def _trimmed(p: _Problem, rows: slice, tiles: list[slice]) -> list[slice]:
    """The key tiles cut to the keys some query of `rows` may see: causal attention, the window's right edge and
    key_lengths hide the end of the last tile, the window's left edge the start of the first, so the forward pass
    computes no column that every query of the tile hides (causal, L = S = 4096 in 256 x 512 tiles: 6.2 % more
    scores than the triangle, not 12.5 %). The backward pass keeps whole tiles: each worker owns its key tiles."""
    structure, (least, greatest) = p.structure, p.offsets
    left, right = structure.window or (None, None)
    first, last = least + rows.start, greatest + rows.stop - 1  # the tile's least and greatest position
    lo, hi = 0, p.S if p.lengths is None else p.lengths[1]
    if structure.is_causal:
        hi = min(hi, last + 1)
    if right is not None:
        hi = min(hi, last + right + 1)
    if left is not None:
        lo = max(lo, first - left)
    cut = [slice(max(cols.start, lo), min(cols.stop, hi)) for cols in tiles]
    return [cols for cols in cut if cols.start < cols.stop]


def _forward(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None, bias: np.ndarray | None,
             options: FlashOptions, given: _Given) -> tuple[np.ndarray, np.ndarray, _Problem]:
    """out and lse in the caller's shapes (heads ungrouped), and the problem, which keeps them grouped for the
    backward pass."""
    p = _problem(q, k, v, mask, bias, options, given)
    p = p._replace(out=np.zeros((*p.batch, p.L, p.v.shape[-1]), p.work),  # (..., L, Ev)
                   lse=np.full((*p.batch, p.L), -np.inf, p.work))  # (..., L); with sinks, each query's sink:
    if p.sinks is not None:  # lse = log(exp(sink) + 0) where no key is seen (S = 0)
        p.lse[...] = p.sinks[..., 0]

    def query_tile(rows: slice) -> None:
        p.out[..., rows, :], p.lse[..., rows] = _query_tile(p, rows)

    if not p.empty:  # the tiles that see the most keys first, so that the pool's threads finish together
        _run(p, query_tile, sorted(_query_tiles(p), key=lambda rows: -len(_key_tiles(p, rows))))
    return _heads(p, p.out, q.shape[:-2]).astype(q.dtype, copy=False), _heads(p, p.lse, q.shape[:-2]), p


def _heads(p: _Problem, x: np.ndarray, heads: tuple) -> np.ndarray:
    """(..., Hkv, G, L, *) -> (..., H, L, *) with enable_gqa (x itself otherwise), `heads` q's leading axes."""
    if not p.grouped:
        return x
    trailing = x.shape[len(p.batch):]  # (L, Ev) or (L,)
    return x.reshape(*p.batch[:-2], p.batch[-2] * p.batch[-1], *trailing)


def _query_tile(p: _Problem, rows: slice) -> tuple[np.ndarray, np.ndarray]:
    """out (..., block_q, Ev) and lse (..., block_q) of the queries `rows`: the online softmax over the key
    tiles the structure leaves visible to them."""
    q = p.q[..., rows, :] * p.scale  # the scale folded into q: (..., block_q, E)
    m = np.full((*p.batch, rows.stop - rows.start, 1), -np.inf, p.work)  # running maximum (..., block_q, 1)
    l = np.zeros_like(m)  # running denominator  # noqa: E741 (the paper's name)
    if p.sinks is not None:  # the sink first: m_0 = sink, l_0 = exp(sink - m_0) = 1 (0 for a sink of -inf)
        m[...] = p.sinks
        l[m != -np.inf] = 1
    acc = np.zeros((*p.batch, rows.stop - rows.start, p.v.shape[-1]), p.work)  # running output (..., block_q, Ev)
    for cols in _trimmed(p, rows, _key_tiles(p, rows)):
        scores, visible, _, _ = _scores(p, q, rows, cols)  # (..., block_q, block_k), -inf where hidden
        # 1) the new running maximum; where nothing is seen yet (the maximum -inf) the shift is 0
        m_new = np.maximum(m, np.max(scores, axis=-1, keepdims=True))
        shift = m_new if visible is None else np.where(m_new == -np.inf, 0, m_new)
        # 2) what was summed against the old maximum, moved to the new one: exp(m - m_new)
        rescale = np.exp(m - shift)  # (..., block_q, 1); 0 on the first tile a row sees
        weights = np.exp(np.subtract(scores, shift, out=scores), out=scores)  # unnormalised; hidden: exp(-inf) = 0
        l = l * rescale + np.sum(weights, axis=-1, keepdims=True)  # noqa: E741
        acc = acc * rescale + weights @ p.v[..., cols, :]  # (..., block_q, block_k) x (..., block_k, Ev)
        m = m_new
    # 3) normalise once, at the end; a query with no visible key has l = 0: zeros, and lse -inf (with a sink,
    # l = 1 and acc = 0: zeros, and lse = sink)
    seen = l != 0
    out = acc / np.where(seen, l, 1)  # (..., block_q, Ev)
    with np.errstate(divide="ignore"):
        lse = np.where(seen, m + np.log(l), -np.inf)  # (..., block_q, 1)
    return out, lse[..., 0]


def _scores(p: _Problem, q: np.ndarray, rows: slice,
            cols: slice) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """The tile's scores score_mod(softcap(q k^T)) + bias, q already scaled, (..., block_q, block_k), -inf where
    hidden; where they are visible (None: everywhere); with softcap, tanh(raw / softcap); and with score_mod, the
    scores it received (the last two for the backward)."""
    scores = q @ np.swapaxes(p.k[..., cols, :], -1, -2)  # (..., block_q, E) x (..., E, block_k)
    if scores.shape[:-2] != p.batch:  # q and k share a batch axis that only v or a mask carries
        scores = np.array(np.broadcast_to(scores, (*p.batch, *scores.shape[-2:])))  # its own copy, writable
    tanh = None
    if p.softcap is not None:  # softcap * tanh(raw / softcap), before the bias and the masks
        tanh = np.tanh(scores / p.softcap)
        scores = np.multiply(tanh, p.softcap, out=scores)
    visible, received = _tile_visible(p, rows, cols), None
    if p.mods is not None:  # score_mod after softcap, before the bias (a new array); mask_mod and -inf hide keys
        received = scores if p.mods.score_mod is not None else None
        scores, visible = _modded(p.mods, scores, visible, p.mods.tile(rows, cols), _tile_mask_mod(p, rows, cols),
                                  scores.shape)
    if p.bias is not None:
        scores += p.bias[..., rows, cols]
    if p.slopes is not None:  # ALiBi, as a bias built from the tile's positions
        scores += _alibi_tile(p.slopes, p.structure.q_offset, rows, cols)
    if visible is not None:
        np.copyto(scores, -np.inf, where=~visible)
    return scores, visible, tanh, received


def _tile_mask_mod(p: _Problem, rows: slice, cols: slice) -> Callable[..., Any] | None:
    """The mask function the tile evaluates: mask_mod on every tile computed; with a block mask, its mask
    function on a partial tile, none on a full one (an empty one is never computed)."""
    if p.kinds is None or p.kinds[rows.start // p.block_q, cols.start // p.block_k] == PARTIAL:
        return p.mods.mask_mod
    return None


def _tile_visible(p: _Problem, rows: slice, cols: slice) -> np.ndarray | None:
    """Where the tile's queries see its keys, broadcasting to (..., block_q, block_k): the mask and bias
    tiles, and the structure's rules from the positions p_i = q_offset + i and j; None where nothing in the
    tile hides a key (no array is built then)."""
    visible = None
    if p.mask is not None:
        visible = p.mask[..., rows, cols] != 0
    if p.bias is not None:
        visible = _and(visible, p.bias[..., rows, cols] != -np.inf)
    least, greatest = p.offsets
    first, last = least + rows.start, greatest + rows.stop - 1  # the tile's least and greatest position
    by_position = _by_position(within_tile(p.structure, first, last, cols, None if p.lengths is None else
                                           p.lengths[0]))  # the rules that hide some key of this tile alone
    if by_position is not None:  # the catalogue's rules at the tile's indices (..., block_q, block_k)
        visible = _and(visible, by_position(None, None, np.arange(rows.start, rows.stop)[:, None],
                                            np.arange(cols.start, cols.stop)))
    return visible


def _and(visible: np.ndarray | None, rule: np.ndarray) -> np.ndarray:
    return rule if visible is None else visible & rule


def _run(p: _Problem, task: Callable[[Any], None], items: Iterable[Any]) -> None:
    """_in_threads, for a problem of p's size: its query-key-width products."""
    _in_threads(int(np.prod(p.batch)) * p.L * p.S * p.q.shape[-1], task, items)


def _in_threads(work: int, task: Callable[[Any], None], items: Iterable[Any]) -> None:
    """task(item) for every item: on a thread pool of one thread per core where the problem's `work` (its
    query-key-width products) is large enough to pay for it (NumPy releases the GIL in matmul and exp), else in
    turn. The pool's threads each take one BLAS thread: a tile's matmul is too small to share, and BLAS threads of
    their own on every worker would outnumber the cores (measured 2-3 times slower on 2 cores). flex.py's tiles
    run on it too."""
    items = list(items)
    workers = min(os.cpu_count() or 1, len(items))
    if workers <= 1 or work < PARALLEL_WORK:
        for item in items:
            task(item)
        return
    with _blas().limit(limits=1, user_api="blas"), ThreadPoolExecutor(workers) as pool:
        for _ in pool.map(task, items):  # re-raises a task's exception
            pass


@functools.cache
def _blas() -> threadpoolctl.ThreadpoolController:
    """The process's BLAS and OpenMP libraries, found once (a search of the loaded libraries takes milliseconds);
    limit() changes their thread count for a `with` block and restores it after."""
    return threadpoolctl.ThreadpoolController()


def _backward(p: _Problem, d_out: np.ndarray, inputs: tuple) -> tuple:
    """The pullback: the key tiles shared out among the workers, each one's dK and dV tiles its own, and each
    worker its own dQ, summed at the end. dbias has the bias's (grouped) shape, each tile's dS summed down to
    it as it is made, so a broadcast bias costs no (..., L, S) buffer; the workers share it where their key
    tiles write apart, and each has its own where the bias broadcasts along S (all write its one column).
    Returns (dq, dk, dv, dbias), with sinks d_sinks after dbias, and with a score_mod its parameters' gradients
    {name: gradient} too, each worker's own summed at the end."""
    q_in, k_in, v_in, bias_in, sinks_in = inputs
    d_out = d_out.astype(p.work, copy=False).reshape(p.out.shape)  # grouped like out (..., L, Ev)
    dq = np.zeros((*p.batch, p.L, p.q.shape[-1]), p.work)  # (..., L, E)
    dk = np.zeros((*p.batch, p.S, p.k.shape[-1]), p.work)  # (..., S, E)
    dv = np.zeros((*p.batch, p.S, p.v.shape[-1]), p.work)  # (..., S, Ev)
    dbias = None if p.bias is None else np.zeros(p.bias_shape, p.work)  # the bias's (grouped) shape
    D = np.sum(d_out * p.out, axis=-1, keepdims=True)  # rowsum(dO * O) = rowsum(dP * P), (..., L, 1)
    lse = np.where(p.lse == -np.inf, np.inf, p.lse)[..., None]  # a query that sees nothing: P = exp(-inf) = 0
    pairs: dict[tuple[int, int], list[slice]] = {}  # key tile -> the query tiles that may see it
    for rows in ([] if p.empty else _query_tiles(p)):
        for cols in _key_tiles(p, rows):
            pairs.setdefault((cols.start, cols.stop), []).append(rows)
    key_tiles = list(pairs.items())
    workers = max(1, min(os.cpu_count() or 1, len(key_tiles)))
    dqs = [dq] + [np.zeros_like(dq) for _ in range(workers - 1)]
    shared = dbias is None or dbias.shape[-1] != 1
    dbiases = [dbias] + [dbias if shared else np.zeros_like(dbias) for _ in range(workers - 1)]
    parameters = {} if p.mods is None or p.mods.score_mod is None else p.mods.score_mod.parameters
    d_thetas = [{name: np.zeros(np.shape(value), p.work) for name, value in parameters.items()}
                for _ in range(workers)]  # each worker's sums of the score function's parameters' gradients

    def worker(w: int) -> None:
        for (start, stop), query_tiles in key_tiles[w::workers]:  # every workers-th key tile: balanced
            _key_tile(p, slice(start, stop), query_tiles, d_out, D, lse, dqs[w], dk, dv, dbiases[w], d_thetas[w])

    _run(p, worker, range(workers))
    dq = sum(dqs[1:], dqs[0])
    dbias = dbias if shared else sum(dbiases[1:], dbias)
    grouped = (p.q.shape, p.k.shape, p.v.shape)
    grads = [_sum_to(d, shape).reshape(p.shapes[name]).astype(x.dtype, copy=False)
             for d, shape, name, x in zip((dq, dk, dv), grouped, "qkv", (q_in, k_in, v_in), strict=True)]
    if dbias is not None:
        dbias = dbias.reshape(p.shapes["bias"]).astype(np.asarray(bias_in).dtype, copy=False)
    tail = (dbias,)  # with sinks, d sink = -sum_i p_i D_i, p_i = exp(sink - lse_i) the sink's share of row i
    if p.sinks is not None:
        d_sinks = _sink_gradient(D, np.exp(p.sinks - lse), p.sinks, p.shapes["sinks"])
        tail = (dbias, d_sinks.astype(_parameter_dtype(sinks_in, p.work), copy=False))
    if p.mods is None or p.mods.score_mod is None:
        return (*grads, *tail)
    d_theta = {name: sum((d[name] for d in d_thetas[1:]), d_thetas[0][name]).astype(
        _parameter_dtype(value, p.work), copy=False) for name, value in parameters.items()}
    return (*grads, *tail, d_theta)


def _key_tile(p: _Problem, cols: slice, query_tiles: list[slice], d_out: np.ndarray, D: np.ndarray,
              lse: np.ndarray, dq: np.ndarray, dk: np.ndarray, dv: np.ndarray, dbias: np.ndarray | None,
              d_theta: dict[str, np.ndarray]) -> None:
    """One key tile's dK and dV, and its share of dQ and of the score function's parameters' gradients, from
    every query tile that may see it."""
    k, v = p.k[..., cols, :], p.v[..., cols, :]  # (..., block_k, E), (..., block_k, Ev)
    for rows in query_tiles:
        q = p.q[..., rows, :] * p.scale  # (..., block_q, E)
        scores, _, tanh, received = _scores(p, q, rows, cols)
        # 1) the weights again, from the log-sum-exp: P = exp(S - lse), 0 where hidden
        weights = np.exp(np.subtract(scores, lse[..., rows, :], out=scores), out=scores)  # (..., bq, bk)
        d_o = d_out[..., rows, :]  # (..., block_q, Ev)
        # 2) through the value product and the softmax
        dv[..., cols, :] += np.swapaxes(weights, -1, -2) @ d_o  # (..., bk, bq) x (..., bq, Ev) -> (..., bk, Ev)
        d_weights = d_o @ np.swapaxes(v, -1, -2)  # (..., bq, Ev) x (..., Ev, bk) -> (..., bq, bk)
        d_scores = weights * (d_weights - D[..., rows, :])  # dS = P * (dP - D)
        if dbias is not None:
            _add_tile(dbias, rows, cols, d_scores)
        # 3) through the score function, (dC, dtheta) = score_mod.vjp(dS, C), then the soft-capping, then the raw
        # scores R = (Q * scale) K^T
        if received is not None:
            d_scores, d_tile = _score_mod_vjp(p.mods.score_mod, d_scores, received, weights, p.mods.tile(rows, cols))
            for name, gradient in d_tile.items():
                d_theta[name] += gradient
        if tanh is not None:
            d_scores = d_scores * (1 - tanh**2)
        dq[..., rows, :] += d_scores @ k * p.scale  # (..., bq, bk) x (..., bk, E) -> (..., bq, E)
        dk[..., cols, :] += np.swapaxes(d_scores, -1, -2) @ q  # q holds the scale: (..., bk, bq) x (..., bq, E)


def _ranked(shape: tuple, batch: tuple) -> tuple:
    """`shape` with ones in front, to the rank of (..., *, *), so that a tile of it broadcasts."""
    return (1,) * (len(batch) + 2 - len(shape)) + tuple(shape)


def _add_tile(total: np.ndarray, rows: slice, cols: slice, tile: np.ndarray) -> None:
    """total[..., rows, cols] += tile summed over the axes `total` broadcasts along (an axis of size 1 in
    `total`, also among the last two, takes the tile's sum)."""
    rows = rows if total.shape[-2] != 1 else slice(None)
    cols = cols if total.shape[-1] != 1 else slice(None)
    part = total[..., rows, cols]
    part += _sum_to(tile, part.shape)
