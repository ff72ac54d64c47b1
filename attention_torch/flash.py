"""Tiled attention with the online softmax (the FlashAttention-2 algorithm), forward and backward, in PyTorch.

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
never computed: causal attention does about half the work.

A block mask (create_block_mask(mask_mod, B, H, L, S, BLOCK_SIZE), its tiles flash's) says the same of a mask
function, one kind per (query tile, key tile) over the whole batch: an empty tile is never computed, a full one is
computed without calling the mask function, and a partial one evaluates it on the tile's indices (b, h, q_idx,
kv_idx), and-ed with the structure's rules, the mask and the bias. A mask_mod without a block mask is evaluated on
every computed tile. A score_mod runs on every computed tile, after softcap and before the bias.

The tiles run in turn: torch spreads each matmul and exp over the cores itself. flash_attention is a
torch.autograd.Function whose backward is the tiled pass above; it keeps q, k, v, mask, bias, out, lse and the
score function's parameters between the passes, nothing of size L * S. torch: the backward pass differentiates
softcap and score_mod with autograd on each tile, the score function's parameters among the leaves.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from attention_np.common import validation
from attention_np.common.block_mask import EMPTY, PARTIAL, BlockMask
from attention_np.common.mods import within_tile
from attention_np.common.records import FlashOptions, Structure

from .fast import _grouped_matmul
from .functional import _dtypes, _grouped, _prepare
from .gradients import _grad, _leaf, _recording
from .primitives import (
    _alibi_slopes,
    _alibi_tile,
    _by_position,
    _cast,
    _Indices,
    _indices,
    _integers,
    _mask_mod_visible,
    _named_parameters,
    _parameters,
    _positions,
    _replaced,
    _score_mod_scores,
    _sink_logits,
)

TILE_SCORES = 1 << 20  # scores in a tile over the batch (4 MiB of float32) where block_q, block_k are None: each
# tile costs about fifteen torch calls, each a fixed overhead and a fork and join of torch's threads


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    q_offset: int | torch.Tensor = 0,
    window: tuple[int | None, int | None] | None = None,
    key_lengths: torch.Tensor | None = None,
    softcap: float | None = None,
    enable_gqa: bool = False,
    mask_mod: Callable[..., Any] | None = None,
    score_mod: Callable[..., Any] | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    block_mask: BlockMask | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention(Q, K, V) = softmax(softcap(Q K^T * scale) + bias) V, tile by tile with the online softmax;
    lse = log sum_j exp(scores_ij) over the visible keys j. With sinks, the running maximum starts at the sink and
    the running denominator at exp(sink - sink) = 1: lse = log(exp(sink) + sum_j exp(scores_ij)).

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
    options = FlashOptions(is_causal=is_causal, scale=scale, q_offset=q_offset, window=window,
                           key_lengths=key_lengths, softcap=softcap, enable_gqa=enable_gqa, block_q=block_q,
                           block_k=block_k, alibi_slopes=alibi_slopes)  # the slopes: constants, no gradient
    mods = None if mask_mod is None and score_mod is None and block_mask is None else _Mods(
        mask_mod=mask_mod, score_mod=score_mod, block_mask=block_mask, names=tuple(_named_parameters(score_mod)))
    # torch: under autograd, the gradients of q, k, v, bias, the sinks and the score function's parameters come
    # from _Flash.backward, the tiled pass
    return _Flash.apply(q, k, v, mask, None if bias is None else torch.as_tensor(bias),
                        None if sinks is None else torch.as_tensor(sinks, device=q.device), options, mods,
                        *_parameters(score_mod, q))


def flash_attention_vjp(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    q_offset: int | torch.Tensor = 0,
    window: tuple[int | None, int | None] | None = None,
    key_lengths: torch.Tensor | None = None,
    softcap: float | None = None,
    enable_gqa: bool = False,
    mask_mod: Callable[..., Any] | None = None,
    score_mod: Callable[..., Any] | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    block_mask: BlockMask | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, Callable]:
    """P = exp(S - lse) recomputed tile by tile,  D = rowsum(dO * O),  dV += P^T dO,  dP = dO V^T,
    dS = P * (dP - D),  dQ += dS K * scale,  dK += dS^T Q * scale,  dbias = dS (with softcap, dQ and dK take
    dR = dS * (1 - tanh^2(R / c)) in place of dS, as in scaled_dot_product_attention_vjp; with score_mod, dR
    is the vjp of softcap and score_mod at dS, torch's autograd's on each tile, with the score function's
    parameters' gradients summed over the tiles). With sinks, lse holds the sink, so P is the keys' share of a
    denominator with the sink in it, and d sink = -sum_i exp(sink - lse_i) D_i.

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
    # torch: autograd records the call (also inside torch.no_grad() and torch.inference_mode(), as
    # gradients.scaled_dot_product_attention_vjp does), and the pullback runs _Flash.backward
    names = list(_named_parameters(score_mod))
    with _recording():
        inputs = [_leaf(x) for x in (q, k, v, bias) if x is not None]
        sunk = [] if sinks is None else [_leaf(torch.as_tensor(sinks, device=q.device))]  # torch: a leaf too
        parameters = [_leaf(x) for x in _parameters(score_mod, q)]  # torch: leaves that ScoreMod.replace holds
        if isinstance(mask, torch.Tensor) and mask.is_inference():  # torch: autograd cannot save an inference
            mask = mask.clone()  # tensor (made in torch.inference_mode()) for the backward pass; a copy it can
        out, lse = flash_attention(*inputs[:3], mask, bias=None if bias is None else inputs[3], is_causal=is_causal,
                                   scale=scale, q_offset=q_offset, window=window, key_lengths=key_lengths,
                                   softcap=softcap, enable_gqa=enable_gqa, mask_mod=mask_mod,
                                   score_mod=_replaced(score_mod, names, parameters), sinks=sunk[0] if sunk else None,
                                   alibi_slopes=alibi_slopes, block_mask=block_mask, block_q=block_q, block_k=block_k)

    def pullback(d_out: torch.Tensor) -> tuple:
        validation.cotangent("d_out", d_out.shape, out.shape, _dtypes(d_out=d_out, out=out))
        grads = _grad(out, [*inputs, *sunk, *parameters], d_out)
        (dq, dk, dv, *dbias), d_sinks = grads[:len(inputs)], grads[len(inputs):len(inputs) + len(sunk)]
        d_parameters = grads[len(inputs) + len(sunk):]
        found = (dq, dk, dv, dbias[0] if dbias else None, *d_sinks)
        return found if score_mod is None else (*found, dict(zip(names, d_parameters, strict=True)))

    return out.detach(), lse.detach(), pullback


class _Flash(torch.autograd.Function):
    """torch: the forward and backward passes as one autograd operation, so that autograd keeps what the
    tiled backward reads (q, k, v, mask, bias, sinks, out, lse and the score function's parameters) and never the
    tiles' weights."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None, bias: torch.Tensor | None, sinks: torch.Tensor | None,
                options: FlashOptions, mods: _Mods | None,
                *parameters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse, p = _forward(q, k, v, mask, bias, options._replace(sinks=sinks), mods, parameters)
        ctx.options, ctx.mods = options, mods
        # out in the working dtype (float32 for half precision), for D = rowsum(dO * O)
        ctx.save_for_backward(q, k, v, mask, bias, sinks, p.out, lse, *parameters)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: torch.autograd.function.FunctionCtx, d_out: torch.Tensor, d_lse: torch.Tensor) -> tuple:
        q, k, v, mask, bias, sinks, out, lse, *parameters = ctx.saved_tensors
        # the same checked inputs again, from the saved tensors
        p = _problem(q, k, v, mask, bias, ctx.options._replace(sinks=sinks), ctx.mods, parameters)
        p = p._replace(out=out, lse=lse.reshape(*p.batch, p.L))  # grouped like the problem (..., L, *)
        dq, dk, dv, dbias, d_sinks, d_parameters = _backward(p, d_out, d_lse, (q, k, v, bias),
                                                             need_bias=ctx.needs_input_grad[4],
                                                             need_parameters=any(ctx.needs_input_grad[8:]))
        d_sinks = None if d_sinks is None else d_sinks.to(sinks.dtype)
        return dq, dk, dv, None, dbias, d_sinks, None, None, *d_parameters


class _Mods(NamedTuple):
    """flash_attention's mask_mod, score_mod and block_mask as they reach the autograd operation."""

    mask_mod: Callable[..., Any] | None
    score_mod: Callable[..., Any] | None
    block_mask: BlockMask | None
    names: tuple[str, ...]  # the score function's parameters, in the order their tensors follow the options


class _TileMods(NamedTuple):
    """The mods as the tiles read them: the mask function (the block mask's, or mask_mod evaluated on every
    tile), the score function holding the autograd operation's parameters, the tile kinds and the indices."""

    mask_mod: Callable[..., Any] | None
    score_mod: Callable[..., Any] | None
    kinds: np.ndarray | None  # (rows, columns) EMPTY, PARTIAL or FULL over the batch (BlockMask.batch_kinds)
    idx: _Indices  # b, h, q_idx, kv_idx over the scores (B, H, L, S)
    need_parameters: bool = False  # the backward pass wants the parameters' gradients


class _Problem(NamedTuple):
    """One call's checked inputs in the working dtype (grouped with enable_gqa: q (..., Hkv, G, L, E), k and v
    (..., Hkv, 1, S, *)), its structure and its tiles: what both passes read."""

    q: torch.Tensor  # (..., L, E)
    k: torch.Tensor  # (..., S, E)
    v: torch.Tensor  # (..., S, Ev)
    mask: torch.Tensor | None  # a broadcast view (..., L, S), never copied
    bias: torch.Tensor | None  # a broadcast view (..., L, S) in the working dtype
    bias_shape: tuple | None  # the caller's bias shape, which dbias is summed to tile by tile
    batch: tuple  # the scores' leading axes (...)
    L: int
    S: int
    scale: float
    softcap: float | None
    work: torch.dtype  # the working dtype: at least float32
    empty: bool  # L = 0 or S = 0: nothing to attend
    structure: Structure  # q_offset and key_lengths as integer arrays of the batch
    shapes: dict  # the caller's shapes of q, k, v and bias, for the gradients
    block_q: int
    block_k: int
    grouped: bool  # enable_gqa: the heads split into (Hkv, G)
    offsets: tuple[int, int]  # q_offset's least and greatest value, which choose the tiles
    lengths: tuple[int, int] | None  # key_lengths' least and greatest value (None: no key_lengths)
    mods: _TileMods | None = None  # None: no mask_mod, score_mod or block_mask
    out: torch.Tensor | None = None  # (..., L, Ev) and (..., L) in the working dtype, once the forward pass has run
    lse: torch.Tensor | None = None
    sinks: torch.Tensor | None = None  # the sink logits laid out against the scores (..., 1, 1) (None: no sinks)
    slopes: torch.Tensor | None = None  # ALiBi's slopes laid out against the scores (..., 1, 1) (None: no ALiBi)


def _problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
             bias: torch.Tensor | None, options: FlashOptions, mods: _Mods | None = None,
             parameters: tuple | list = ()) -> _Problem:
    """The checks of scaled_dot_product_attention, then the inputs as the tiles read them: mask and bias
    broadcast views of (..., L, S), never copied; q_offset and key_lengths reduced to the Python ints that
    choose the tiles (validation.key_tiles); the mods with their tiles (a block mask's are its own)."""
    tile_mods = None if mods is None else _tile_mods(q, k, v, options, mods, parameters)
    if tile_mods is not None and mods.block_mask is not None:
        options = options._replace(block_q=mods.block_mask.block_size[0], block_k=mods.block_mask.block_size[1])
    validation.tiles(options.block_q, options.block_k)
    shapes = {"q": q.shape, "k": k.shape, "v": v.shape, "bias": None if bias is None else bias.shape,
              "sinks": None if options.sinks is None else options.sinks.shape}
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
    work = torch.promote_types(q.dtype, torch.float32)  # float16, bfloat16: in float32
    sinks = _sink_logits(options.sinks, batch, options.enable_gqa, work, q.device)  # (..., 1, 1), or None
    slopes = _alibi_slopes(options.alibi_slopes, batch, options.enable_gqa, work, q.device)  # (..., 1, 1), or None
    q_offset = _integers(q_offset, "q_offset", batch).to(q.device)
    key_lengths = None if key_lengths is None else _integers(key_lengths, "key_lengths", batch).to(q.device)
    return _Problem(
        q=_cast(q, work), k=_cast(k, work), v=_cast(v, work),
        mask=None if mask is None else mask.expand(shape),
        bias=None if bias is None else _cast(bias, work).expand(shape),
        bias_shape=None if bias is None else bias.shape,  # torch: dbias is summed to it tile by tile
        batch=batch, L=L, S=S, scale=scale, softcap=options.softcap, work=work, empty=empty is not None,
        structure=structure._replace(q_offset=q_offset, key_lengths=key_lengths), shapes=shapes,
        block_q=block_q, block_k=block_k, grouped=options.enable_gqa,
        offsets=(int(q_offset.min()), int(q_offset.max())) if q_offset.numel() else (0, 0),
        lengths=None if key_lengths is None or key_lengths.numel() == 0 else
        (int(key_lengths.min()), int(key_lengths.max())), mods=tile_mods, sinks=sinks, slopes=slopes)


def _tile_mods(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: FlashOptions, mods: _Mods,
               parameters: tuple | list) -> _TileMods:
    """The mods' checks (four axes; a block mask that fits the scores, its tiles flash's), then the mods as the
    tiles read them."""
    B, H = validation.mods_inputs("flash_attention", q.shape, k.shape, v.shape)
    L, S = q.shape[-2], k.shape[-2]
    mask_mod, kinds = mods.mask_mod, None
    if mods.block_mask is not None:
        validation.flash_block_mask(mods.block_mask, mods.mask_mod, options.block_q, options.block_k, (B, H, L, S))
        mask_mod, kinds = mods.block_mask.mask_mod, mods.block_mask.batch_kinds()
    return _TileMods(mask_mod=mask_mod, score_mod=_replaced(mods.score_mod, list(mods.names), list(parameters)),
                     kinds=kinds, idx=_indices(B, H, L, S, q.device))


def _check_masks(mask: torch.Tensor | None, bias: torch.Tensor | None, shape: tuple) -> None:
    """mask and bias broadcast to the scores' shape (..., L, S); a floating mask holds 0 and 1 only."""
    for name, x in (("mask", mask), ("bias", bias)):
        if x is not None:
            validation.broadcasts_to(name, x.shape, shape, "..., L, S")
    if mask is not None and mask.is_floating_point():
        validation.binary_mask(True, bool(((mask == 0) | (mask == 1)).all()))


def _query_tiles(p: _Problem) -> list[slice]:
    return [slice(start, min(start + p.block_q, p.L)) for start in range(0, p.L, p.block_q)]


def _key_tiles(p: _Problem, rows: slice) -> list[slice]:
    """The key tiles that some query of `rows` may see (validation.key_tiles); the others are skipped."""
    tiles = validation.key_tiles(rows.start, rows.stop, p.S, p.block_k, is_causal=p.structure.is_causal,
                             window=p.structure.window, q_offset=p.offsets,
                             key_lengths=None if p.lengths is None else p.lengths[1])
    if p.mods is not None and p.mods.kinds is not None:  # the block mask's empty tiles: never computed
        tiles = [t for t in tiles if p.mods.kinds[rows.start // p.block_q, t] != EMPTY]
    return [slice(t * p.block_k, min((t + 1) * p.block_k, p.S)) for t in tiles]


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
             bias: torch.Tensor | None, options: FlashOptions, mods: _Mods | None = None,
             parameters: tuple = ()) -> tuple[torch.Tensor, torch.Tensor, _Problem]:
    """out and lse in the caller's shapes (heads ungrouped), and the problem, which keeps them grouped for the
    backward pass."""
    p = _problem(q, k, v, mask, bias, options, mods, parameters)
    p = p._replace(out=torch.zeros((*p.batch, p.L, p.v.shape[-1]), dtype=p.work, device=q.device),  # (..., L, Ev)
                   lse=torch.full((*p.batch, p.L), -math.inf, dtype=p.work, device=q.device))  # (..., L)
    if p.sinks is not None:  # each query's sink: lse = log(exp(sink) + 0) where no key is seen (S = 0)
        p.lse[...] = p.sinks[..., 0]
    for rows in ([] if p.empty else _query_tiles(p)):
        p.out[..., rows, :], p.lse[..., rows] = _query_tile(p, rows)
    return _cast(_heads(p, p.out), q.dtype), _heads(p, p.lse), p


def _heads(p: _Problem, x: torch.Tensor) -> torch.Tensor:
    """(..., Hkv, G, L, *) -> (..., H, L, *) with enable_gqa (x itself otherwise)."""
    if not p.grouped:
        return x
    trailing = x.shape[len(p.batch):]  # (L, Ev) or (L,)
    return x.reshape(*p.batch[:-2], p.batch[-2] * p.batch[-1], *trailing)


def _query_tile(p: _Problem, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """out (..., block_q, Ev) and lse (..., block_q) of the queries `rows`: the online softmax over the key
    tiles the structure leaves visible to them."""
    q = p.q[..., rows, :] * p.scale  # the scale folded into q: (..., block_q, E)
    m = torch.full((*p.batch, rows.stop - rows.start, 1), -math.inf, dtype=p.work, device=q.device)  # (..., bq, 1)
    l = torch.zeros_like(m)  # running denominator  # noqa: E741 (the paper's name)
    if p.sinks is not None:  # the sink first: m_0 = sink, l_0 = exp(sink - m_0) = 1 (0 for a sink of -inf)
        m[...] = p.sinks
        l[m != -math.inf] = 1
    acc = torch.zeros((*p.batch, rows.stop - rows.start, p.v.shape[-1]), dtype=p.work, device=q.device)  # (.., bq, Ev)
    for cols in _key_tiles(p, rows):
        scores, visible, _ = _scores(p, q, rows, cols)  # (..., block_q, block_k), -inf where hidden
        # 1) the new running maximum; where nothing is seen yet (the maximum -inf) the shift is 0
        m_new = torch.maximum(m, scores.amax(dim=-1, keepdim=True))
        hides = visible is not None or (p.mods is not None and p.mods.score_mod is not None)  # -inf scores
        shift = m_new if not hides else m_new.masked_fill(m_new == -math.inf, 0)
        # 2) what was summed against the old maximum, moved to the new one: exp(m - m_new)
        rescale = torch.exp(m - shift)  # (..., block_q, 1); 0 on the first tile a row sees
        weights = scores.sub_(shift).exp_()  # unnormalised, in place; hidden: exp(-inf) = 0
        l = l.mul_(rescale).add_(weights.sum(dim=-1, keepdim=True))  # noqa: E741
        acc = acc.mul_(rescale).add_(_grouped_matmul(weights, p.v[..., cols, :]))  # (..., bq, bk) x (..., bk, Ev)
        m = m_new
    # 3) normalise once, at the end; a query with no visible key has l = 0: zeros, and lse -inf (with a sink,
    # l = 1 and acc = 0: zeros, and lse = sink)
    seen = l != 0
    out = acc / torch.where(seen, l, 1)  # (..., block_q, Ev)
    lse = torch.where(seen, m + torch.log(l), -math.inf)  # (..., block_q, 1)
    return out, lse[..., 0]


def _scores(p: _Problem, q: torch.Tensor, rows: slice, cols: slice, *,
            backward: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, _Back | None]:
    """The tile's scores score_mod(softcap(q k^T)) + bias, q already scaled, (..., block_q, block_k), -inf where
    hidden; where they are visible (None: everywhere); and, for the backward pass, the way back from the
    gradient at score_mod's scores to the raw scores' (None: nothing between them)."""
    raw = _grouped_matmul(q, p.k[..., cols, :].transpose(-1, -2))  # (..., block_q, E) x (..., E, block_k)
    tile = (*p.batch, *raw.shape[-2:])
    scores = raw if raw.shape == tile else raw.expand(tile).contiguous()  # own axes, writable
    score_mod, back = None if p.mods is None else p.mods.score_mod, None
    if score_mod is not None and backward:  # torch: softcap and score_mod recorded, autograd's vjp the way back
        scores, back = _recorded(p, scores, rows, cols)
    else:
        if p.softcap is not None:  # softcap * tanh(raw / softcap), before the score function, the bias, the masks
            tanh = scores.div_(p.softcap).tanh_()
            scores = tanh * p.softcap
            back = _Back(tanh=tanh)
        if score_mod is not None:  # writable: the steps below work in place
            scores = _score_mod_scores(score_mod, scores, p.mods.idx, rows, cols).contiguous()
    if p.bias is not None:
        scores += p.bias[..., rows, cols]
    if p.slopes is not None:  # ALiBi, as a bias built from the tile's positions
        scores += _alibi_tile(p.slopes, p.structure.q_offset, rows, cols)
    visible = _tile_visible(p, rows, cols)
    if visible is not None:
        scores.masked_fill_(visible.logical_not(), -math.inf)
    return scores, visible, back


class _Back(NamedTuple):
    """The way back from the gradient dS at the scores score_mod returns to dR at the raw scores R = Q K^T *
    scale: with softcap alone, dR = dS * (1 - tanh^2(R / c)); with score_mod, autograd's vjp of the recorded
    steps, which also gives the score function's parameters' gradients."""

    tanh: torch.Tensor | None = None  # tanh(R / c) of the tile, with softcap alone
    raw: torch.Tensor | None = None  # R, a leaf of the recorded steps
    scores: torch.Tensor | None = None  # score_mod(softcap(R)), recorded
    parameters: tuple[torch.Tensor, ...] = ()  # the score function's parameters, leaves of the recorded steps

    def __call__(self, d_scores: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if self.tanh is not None:
            return d_scores * self.tanh.square_().neg_().add_(1), []  # dS * (1 - tanh^2)
        targets = [self.raw, *self.parameters]
        grads = (torch.autograd.grad(self.scores, targets, d_scores, allow_unused=True)
                 if self.scores.requires_grad else [None] * len(targets))  # a score function of neither
        d_raw, *d_parameters = (torch.zeros_like(x) if g is None else g for x, g in zip(targets, grads, strict=True))
        return d_raw, d_parameters


def _recorded(p: _Problem, raw: torch.Tensor, rows: slice, cols: slice) -> tuple[torch.Tensor, _Back]:
    """score_mod(softcap(raw)) of a tile (softcap where given), recorded by autograd on new leaves (the raw
    scores, the parameters, which need a gradient where the backward pass wants theirs), and a copy of it that
    the backward pass may change in place."""
    score_mod, wanted = p.mods.score_mod, p.mods.need_parameters
    names = list(_named_parameters(score_mod))
    parameters = tuple(x.detach().requires_grad_(wanted) for x in _named_parameters(score_mod).values())
    raw = raw.detach().requires_grad_()
    with torch.enable_grad():  # torch: the backward pass runs without
        capped = raw if p.softcap is None else p.softcap * torch.tanh(raw / p.softcap)
        scores = _score_mod_scores(_replaced(score_mod, names, list(parameters)), capped, p.mods.idx, rows, cols)
    return scores.detach().clone(), _Back(raw=raw, scores=scores, parameters=parameters if wanted else ())


def _tile_visible(p: _Problem, rows: slice, cols: slice) -> torch.Tensor | None:
    """Where the tile's queries see its keys, broadcasting to (..., block_q, block_k): the mask and bias
    tiles, the mask function (on every tile, or a block mask's partial ones), and the structure's rules from
    the positions p_i = q_offset + i and j; None where nothing in the tile hides a key (no tensor is built
    then)."""
    visible = None
    if p.mask is not None:
        visible = p.mask[..., rows, cols] != 0
    if p.bias is not None:
        visible = _and(visible, p.bias[..., rows, cols] != -math.inf)
    mods = p.mods
    if mods is not None and mods.mask_mod is not None and (
            mods.kinds is None or mods.kinds[rows.start // p.block_q, cols.start // p.block_k] == PARTIAL):
        visible = _and(visible, _heads_laid_out(p, _mask_mod_visible(mods.mask_mod, mods.idx, rows, cols)))
    least, greatest = p.offsets
    first, last = least + rows.start, greatest + rows.stop - 1  # the tile's least and greatest position
    by_position = _by_position(within_tile(p.structure, first, last, cols, None if p.lengths is None else
                                           p.lengths[0]))  # the rules that hide some key of this tile alone
    if by_position is None:  # torch: no positions built
        return visible
    indices = _positions(rows.stop - rows.start, cols.stop - cols.start, p.q.device, rows.start, cols.start)
    return _and(visible, by_position(None, None, *indices))  # the catalogue's rules (..., block_q, block_k)


def _and(visible: torch.Tensor | None, rule: torch.Tensor) -> torch.Tensor:
    return rule if visible is None else visible & rule


def _heads_laid_out(p: _Problem, x: torch.Tensor) -> torch.Tensor:
    """A mask function's tile (B | 1, H | 1, block_q, block_k) in the scores' layout: grouped with enable_gqa,
    (B | 1, Hkv | 1, G | 1, block_q, block_k), query head h = hkv * G + g; x itself otherwise."""
    if not p.grouped:
        return x
    return x[:, :, None] if x.shape[1] == 1 else x.unflatten(1, p.batch[-2:])


def _backward(p: _Problem, d_out: torch.Tensor, d_lse: torch.Tensor, inputs: tuple, need_bias: bool,
              need_parameters: bool) -> tuple:
    """The pullback: the key tiles in turn, each one's dK, dV (and dbias) tiles its own, dQ summed over them.
    torch: lse is an output of the autograd operation too; since d lse_i / d S_ij = P_ij, its cotangent adds
    P * d_lse to dS, which is D - d_lse in place of D. Each gradient is summed to its input's (grouped) shape
    tile by tile, so nothing of the broadcast shape (..., L, S) or (..., S, E) is allocated. The score function's
    parameters' gradients (where wanted) are summed over the tiles. Returns (dq, dk, dv, dbias, d_sinks,
    d_parameters), d_sinks -sum_i exp(sink - lse_i) D_i in the sinks' shape (None without sinks)."""
    q_in, k_in, v_in, bias_in = inputs
    score_mod = None if p.mods is None else p.mods.score_mod
    d_parameters = [torch.zeros_like(x) for x in _named_parameters(score_mod).values()]
    if d_parameters:
        p = p._replace(mods=p.mods._replace(need_parameters=need_parameters))
    work, device = p.work, p.q.device
    d_out = _cast(d_out, work).reshape(p.out.shape)  # grouped like out (..., L, Ev)
    dq = torch.zeros(_ranked(p.q.shape, p.batch), dtype=work, device=device)  # q's (..., L, E)
    dk = torch.zeros(_ranked(p.k.shape, p.batch), dtype=work, device=device)  # k's (..., S, E)
    dv = torch.zeros(_ranked(p.v.shape, p.batch), dtype=work, device=device)  # v's (..., S, Ev)
    dbias = None if p.bias is None or not need_bias else torch.zeros(
        _ranked(p.bias_shape, p.batch), dtype=work, device=device)  # the bias's (grouped) shape
    D = (d_out * p.out).sum(dim=-1, keepdim=True) - _cast(d_lse, work).reshape(p.lse.shape)[..., None]  # (..., L, 1)
    lse = p.lse.masked_fill(p.lse == -math.inf, math.inf)[..., None]  # a query that sees nothing: P = exp(-inf) = 0
    pairs: dict[tuple[int, int], list[slice]] = {}  # key tile -> the query tiles that may see it
    for rows in ([] if p.empty else _query_tiles(p)):
        for cols in _key_tiles(p, rows):
            pairs.setdefault((cols.start, cols.stop), []).append(rows)
    for (start, stop), query_tiles in pairs.items():
        for total, d in zip(d_parameters, _key_tile(p, slice(start, stop), query_tiles, d_out, D, lse, dq, dk, dv,
                                                    dbias), strict=False):  # none: no gradient wanted
            total += d
    dq.mul_(p.scale)  # dQ = sum over the key tiles of dS K, times the scale once
    grads = [d.reshape(p.shapes[name]).to(x.dtype) for d, name, x in zip((dq, dk, dv), "qkv", (q_in, k_in, v_in),
                                                                          strict=True)]
    if dbias is not None:
        dbias = dbias.reshape(p.shapes["bias"]).to(bias_in.dtype)
    d_sinks = None  # d sink = -sum_i p_i D_i, p_i = exp(sink - lse_i) the sink's share of row i
    if p.sinks is not None:
        d_sinks = (-(torch.exp(p.sinks - lse) * D)).sum_to_size(p.sinks.shape).reshape(p.shapes["sinks"])
    return (*grads, dbias, d_sinks, d_parameters)


def _ranked(shape: tuple, batch: tuple) -> tuple:
    """torch: `shape` with ones in front, to the rank of (..., *, *), so that a tile of it broadcasts."""
    return (1,) * (len(batch) + 2 - len(shape)) + tuple(shape)


def _key_tile(p: _Problem, cols: slice, query_tiles: list[slice], d_out: torch.Tensor, D: torch.Tensor,
              lse: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
              dbias: torch.Tensor | None) -> list[torch.Tensor]:
    """One key tile's dK and dV, and its share of dQ (unscaled), from every query tile that may see it; returns
    its share of the score function's parameters' gradients (none where not wanted)."""
    d_parameters: list[torch.Tensor] = []
    k, v = p.k[..., cols, :], p.v[..., cols, :]  # (..., block_k, E), (..., block_k, Ev)
    dk_tile = torch.zeros((*p.batch, cols.stop - cols.start, k.shape[-1]), dtype=p.work, device=k.device)
    dv_tile = torch.zeros((*p.batch, cols.stop - cols.start, v.shape[-1]), dtype=p.work, device=k.device)
    for rows in query_tiles:
        q = p.q[..., rows, :] * p.scale  # (..., block_q, E)
        scores, _, back = _scores(p, q, rows, cols, backward=True)
        hidden = None if back is None or back.tanh is not None else scores == -math.inf  # with score_mod
        # 1) the weights again, from the log-sum-exp: P = exp(S - lse), 0 where hidden
        weights = scores.sub_(lse[..., rows, :]).exp_()  # (..., block_q, block_k), in place
        d_o = d_out[..., rows, :]  # (..., block_q, Ev)
        # 2) through the value product and the softmax
        dv_tile += weights.transpose(-1, -2) @ d_o  # (..., bk, bq) x (..., bq, Ev) -> (..., bk, Ev)
        d_weights = _grouped_matmul(d_o, v.transpose(-1, -2))  # (..., bq, Ev) x (..., Ev, bk) -> (..., bq, bk)
        d_scores = d_weights.sub_(D[..., rows, :]).mul_(weights)  # dS = P * (dP - D), in place
        if dbias is not None:
            _add_tile(dbias, rows, cols, d_scores)
        # 3) through the score function and the soft-capping, then the raw scores R = (Q * scale) K^T
        if back is not None:
            d_scores, d_theta = back(d_scores)
            d_parameters = d_theta if not d_parameters else [a + b for a, b in zip(d_parameters, d_theta, strict=True)]
        if hidden is not None:  # dS is 0 there; a NaN or inf of the score function's derivative must not leak
            d_scores = d_scores.masked_fill_(hidden, 0)
        _add_tile(dq, rows, slice(None), _grouped_matmul(d_scores, k))  # (..., bq, bk) x (..., bk, E) -> (..., bq, E)
        dk_tile += d_scores.transpose(-1, -2) @ q  # q holds the scale: (..., bk, bq) x (..., bq, E)
    _add_tile(dk, cols, slice(None), dk_tile)
    _add_tile(dv, cols, slice(None), dv_tile)
    return d_parameters


def _add_tile(total: torch.Tensor, rows: slice, cols: slice, tile: torch.Tensor) -> None:
    """total[..., rows, cols] += tile summed over the axes `total` broadcasts along (an axis of size 1 in
    `total`, also among the last two, takes the tile's sum). torch: sum_to_size is NumPy's _sum_to."""
    rows = rows if total.shape[-2] != 1 else slice(None)
    cols = cols if total.shape[-1] != 1 else slice(None)
    part = total[..., rows, cols]
    part += tile.sum_to_size(part.shape)
