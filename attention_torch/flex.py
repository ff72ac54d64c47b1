"""Programmable attention (torch's FlexAttention interface) in PyTorch: a score function and a block mask,
tile by tile with the online softmax, forward and backward.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

The score functions and mask functions, and the catalogue of them, are in attention_np/common/mods.py; the
block mask, which tiles a mask function leaves empty, partial or full, in attention_np/common/block_mask.py.

The kernel is flash.py's, over the block mask's tiles. One query tile against one key tile, for the whole batch
and every head at once:
    S = (Q K^T) * scale,  R = score_mod(S, b, h, i, j),  R = -inf where the mask function hides the key
(the mask function evaluated on a partial tile only; a full tile shows every key; an empty tile is skipped),
then the online softmax over the tiles of the row, as in flash.py:
    m_t = max(m_{t-1}, rowmax(R_t)),  l_t = exp(m_{t-1} - m_t) l_{t-1} + rowsum(exp(R_t - m_t)),
    O_t = exp(m_{t-1} - m_t) O_{t-1} + exp(R_t - m_t) V_t,  out = O_T / l_T,  lse = m_T + log(l_T).
The backward pass recomputes each tile, P = exp(R - lse), and, with D = rowsum(dO * O),
    dV += P^T dO,  dP = dO V^T,  dR = P * (dP - D),  (dS, dtheta) = torch.autograd.grad(R, (S, theta), dR),
    dQ += dS K * scale,  dK += dS^T Q * scale,
so any score function written with torch's operations is differentiated, and a ScoreMod's parameters theta
(ALiBi's slopes, a relative-bias table) are inputs of the autograd operation: a tensor among them that requires
a gradient gets one from loss.backward(). A tensor a plain function closes over is a constant here.

From HAND_OFF query-key-width products on, a call that wants neither lse nor a gradient, in float32, runs torch's
own FlexAttention compiled by inductor instead (`_hands_off`), over torch's BlockMask of the same tiles, as sdpa's
fast path hands plain attention to F.scaled_dot_product_attention: the kernels agree within float32's rounding,
and the compilation (seconds for each mask function, score function and shape) pays off at those sizes only.

Grouped-query heads as reshapes: q (B, H, L, E) -> (B, Hkv, G, L, E), G = H // Hkv, so that a tile of G heads'
queries is one matrix (B, Hkv, G * block_q, E) against its key/value head's (B, Hkv, block_k, E) tile; the
scores (B, Hkv, G * block_q, block_k) are (B, H, block_q, block_k) for the mods (query head h = hkv * G + g),
and dK, dV sum over the group in the same matrix products.
"""

from __future__ import annotations

import functools
import math
import warnings
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from attention_np.common import block_mask as blocks
from attention_np.common import validation
from attention_np.common.block_mask import EMPTY, FULL, PARTIAL, BlockMask

from .arrays import to_numpy
from .functional import _dtypes
from .gradients import _grad, _leaf, _recording
from .primitives import _alibi_slopes, _alibi_tile, _cast, _named_parameters, _parameters, _sunk_rows

DEFAULT_TILES = (128, 128)  # (block_q, block_k) without a block mask, every tile full
HAND_OFF = 1 << 31  # query-key-width products B H L S E from which flex_attention without a gradient runs torch's
# own FlexAttention, compiled (B=1, H=8, L=S=4096, E=64 is 2^33; every size the tests draw is far below)


def flex_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    score_mod: Callable[..., Any] | None = None,
    block_mask: BlockMask | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
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
    options = _Options(score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                       names=tuple(_named_parameters(score_mod)), alibi_slopes=alibi_slopes)
    parameters = _parameters(score_mod, q)
    if not return_lse and sinks is None and alibi_slopes is None and _hands_off(q, k, v, options, parameters):
        # torch: its own compiled FlexAttention, as sdpa's fast path hands attention to torch's kernel (sinks and
        # ALiBi's slopes stay on this module's tiles)
        return _torch_flex(q, k, v, options)
    # torch: under autograd, the gradients of q, k, v and the parameters come from _Flex.backward, the tiled pass
    out, lse = _sunk_rows(*_Flex.apply(q, k, v, options, *parameters), sinks)  # the sink joins each row once
    return (out, lse) if return_lse else out


def flex_attention_vjp(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    score_mod: Callable[..., Any] | None = None,
    block_mask: BlockMask | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, Callable]:
    """P = exp(R - lse) recomputed tile by tile, R = score_mod(S), S = (Q K^T) * scale;  D = rowsum(dO * O),
    dV += P^T dO,  dP = dO V^T,  dR = P * (dP - D),  (dS, dtheta) = score_mod's vjp at dR,
    dQ += dS K * scale,  dK += dS^T Q * scale; dtheta, the score function's parameters' gradients, summed over
    the tiles.

    torch's autograd differentiates through score_mod (any function of torch operations); a ScoreMod's
    parameters are differentiated through ScoreMod.replace.

    Args:
        q, k, v, score_mod, block_mask, scale, enable_gqa, sinks, alibi_slopes: as for flex_attention; the
            slopes are constants (their bias joins R after score_mod, dR unchanged).

    Returns:
        out (B, H, L, Ev), lse (B, H, L) and pullback(d_out (B, H, L, Ev)) -> (dq, dk, dv, d_score_mod), each of
        dq, dk, dv with its input's shape and dtype, and d_score_mod a dict {parameter name: gradient} of the
        score function's parameters (ScoreMod.parameters; empty without); with sinks (dq, dk, dv, d_sinks,
        d_score_mod), d_sinks = -sum_i exp(sink - lse_i) rowsum(dO * O)_i in the sinks' shape.
    """
    options = _Options(score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                       names=tuple(_named_parameters(score_mod)), alibi_slopes=alibi_slopes)  # the slopes: constants
    # torch: autograd records the call (also inside torch.no_grad() and torch.inference_mode()), and the
    # pullback runs _Flex.backward
    with _recording():
        inputs = [_leaf(x) for x in (q, k, v, *_parameters(score_mod, q))]
        sunk = [] if sinks is None else [_leaf(torch.as_tensor(sinks, device=q.device))]  # torch: a leaf too
        out, lse = _sunk_rows(*_Flex.apply(*inputs[:3], options, *inputs[3:]), sunk[0] if sunk else None)

    def pullback(d_out: torch.Tensor) -> tuple:
        validation.cotangent("d_out", d_out.shape, out.shape, _dtypes(d_out=d_out, out=out))
        dq, dk, dv, *d_parameters = _grad(out, [*inputs, *sunk], d_out)
        d_sinks = [d_parameters.pop()] if sunk else []  # the last: the sinks'
        return dq, dk, dv, *d_sinks, dict(zip(options.names, d_parameters, strict=True))

    return out.detach(), lse.detach(), pullback


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
    return blocks.create(mask_mod, B, H, Q_LEN, KV_LEN, BLOCK_SIZE, arange=torch.arange, to_numpy=to_numpy)


# --- the hand-off to torch's own FlexAttention ------------------------------------------------------------

def _hands_off(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: _Options, parameters: list) -> bool:
    """Whether flex_attention runs torch's own FlexAttention, compiled: at HAND_OFF query-key-width products and
    above, where its compilation (seconds per mask function and shape, once) pays off; without a gradient to
    take (the tiled backward pass is this module's); in float32 (inductor's CPU kernel takes no float64, and half
    precision stays with this module's float32 arithmetic); with a block mask whose tiles divide
    L and S (torch's own are whole), and a score function without parameters of its own (a ScoreMod's learnable
    slopes or table stay with the tiled kernel). The inputs are checked by the tiled kernel's rules first."""
    B, H = validation.flex_inputs(q.shape, k.shape, v.shape, options.enable_gqa)
    (L, E), S = q.shape[-2:], k.shape[-2]
    if B * H * L * S * E < HAND_OFF or parameters or q.dtype != torch.float32:
        return False
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        return False
    validation.same_floating_dtype(_dtypes(q=q, k=k, v=v))
    block_mask = options.block_mask
    if block_mask is not None:
        validation.block_mask_fits(block_mask, B, H, L, S)
        if L % block_mask.block_size[0] or S % block_mask.block_size[1]:
            return False
    return _torch_flex_attention() is not None


def _torch_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: _Options) -> torch.Tensor:
    """out from torch's own flex_attention, compiled (inductor), with the block mask's tiles as torch's BlockMask:
    the same tiles, the same mask function on the partial ones, no tile classified again. Without lse: inductor's
    CPU kernel returns none (return_lse=True stays with the tiled kernel)."""
    block_mask = None if options.block_mask is None else _torch_block_mask(options.block_mask, q.device)
    # torch: outside inference mode, where dynamo's guards on a NumPy array a mod closes over (a document's
    # segment ids) fail on the frame that made them; and without dynamo's notes on the lru_caches of
    # array-api-compat, which the catalogue's mods call
    with torch.inference_mode(False), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*functools.lru_cache", category=UserWarning)
        return _torch_flex_attention()(q, k, v, score_mod=options.score_mod, block_mask=block_mask,
                                       scale=options.scale, enable_gqa=options.enable_gqa)


@functools.cache
def _torch_flex_attention() -> Callable[..., Any] | None:
    """torch.compile(torch.nn.attention.flex_attention.flex_attention), once (None where this torch has none).
    Each mask function, score function and shape is one more compilation of it."""
    try:
        from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention
    except ImportError:
        return None
    return torch.compile(torch_flex_attention, dynamic=False)


def _torch_block_mask(block_mask: BlockMask, device: torch.device) -> Any:
    """torch's BlockMask of the same tiles: per (b, h, query tile), the partial key tiles (kv_indices, the mask
    function evaluated on them) and the full ones (full_kv_indices, computed without it), empty ones in
    neither. Made once per block mask and device."""
    made = _TORCH_BLOCK_MASKS.setdefault(block_mask, {})
    if str(device) not in made:
        from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask

        def listed(kind: int) -> tuple[torch.Tensor, torch.Tensor]:
            chosen = block_mask.tiles == kind  # (B, H, rows, columns)
            order = np.argsort(~chosen, axis=-1, kind="stable")  # the chosen columns first, in order
            as_tensor = functools.partial(torch.as_tensor, dtype=torch.int32, device=device)
            return as_tensor(chosen.sum(axis=-1)), as_tensor(order)

        made[str(device)] = TorchBlockMask.from_kv_blocks(
            *listed(PARTIAL), *listed(FULL), BLOCK_SIZE=block_mask.block_size, mask_mod=block_mask.mask_mod,
            seq_lengths=block_mask.shape[2:])
    return made[str(device)]


# torch's BlockMask of each of ours, by device, while ours lives
_TORCH_BLOCK_MASKS: weakref.WeakKeyDictionary[BlockMask, dict[str, Any]] = weakref.WeakKeyDictionary()


class _Options(NamedTuple):
    """flex_attention's arguments other than the tensors, as they reach the autograd operation."""

    score_mod: Callable[..., Any] | None
    block_mask: BlockMask | None
    scale: float | None
    enable_gqa: bool
    names: tuple[str, ...]  # the score function's parameters, in the order their tensors follow q, k, v
    alibi_slopes: torch.Tensor | None = None  # ALiBi's slopes, (H,) or (B, H): constants, detached (no gradient)


class _Flex(torch.autograd.Function):
    """torch: the forward and backward passes as one autograd operation, so that autograd keeps what the tiled
    backward reads (q, k, v, out, lse and the parameters) and never the tiles' weights."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                options: _Options, *parameters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = _problem(q, k, v, options, parameters)
        out, lse = _forward(p)  # (B, H, L, Ev), (B, H, L) in the working dtype
        ctx.options = options
        ctx.save_for_backward(q, k, v, out, lse, *parameters)
        return _cast(out, q.dtype), lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: torch.autograd.function.FunctionCtx, d_out: torch.Tensor, d_lse: torch.Tensor) -> tuple:
        q, k, v, out, lse, *parameters = ctx.saved_tensors
        p = _problem(q, k, v, ctx.options, parameters)
        dq, dk, dv, d_parameters = _backward(p, out, lse, d_out, d_lse, need_parameters=any(ctx.needs_input_grad[4:]))
        grads = [d.to(x.dtype) for d, x in zip((dq, dk, dv), (q, k, v), strict=True)]
        return (*grads, None, *d_parameters)


class _Problem(NamedTuple):
    """One call's checked inputs as both passes read them, in the working dtype (at least float32)."""

    q: torch.Tensor  # (B, Hkv, G, L, E), unscaled: _query_rows scales a tile (a scaled copy would be as large as out)
    k: torch.Tensor  # (B, Hkv, S, E)
    v: torch.Tensor  # (B, Hkv, S, Ev)
    score_mod: Callable[..., Any] | None  # with its parameters the tensors given to the autograd operation
    mask_mod: Callable[..., Any] | None  # the block mask's; None without one
    kinds: np.ndarray  # (rows, columns) EMPTY, PARTIAL or FULL over the whole batch (BlockMask.batch_kinds)
    block_q: int
    block_k: int
    scale: float
    work: torch.dtype
    b: torch.Tensor  # (B, 1, 1, 1) int64 on q's device: the index arrays the mods receive
    h: torch.Tensor  # (1, H, 1, 1)
    q_idx: torch.Tensor  # (L,), sliced per tile and laid along (1, 1, block_q, 1)
    kv_idx: torch.Tensor  # (S,), sliced per tile and laid along (1, 1, 1, block_k)
    slopes: torch.Tensor | None  # ALiBi's slopes laid out against the scores (B | 1, H, 1, 1) (None: no ALiBi)


def _problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: _Options,
             parameters: tuple | list) -> _Problem:
    """The checks (shapes, dtypes, the block mask's fit), then the inputs as the tiles read them."""
    B, H = validation.flex_inputs(q.shape, k.shape, v.shape, options.enable_gqa)
    validation.same_floating_dtype(_dtypes(q=q, k=k, v=v))
    scale = validation.default_scale(options.scale, q.shape, k.shape)
    (L, E), (Hkv, S) = q.shape[-2:], k.shape[1:3]
    block_mask, score_mod = options.block_mask, options.score_mod
    if block_mask is None:  # every key visible: tiles of 128, all full, no mask function
        block_q, block_k = DEFAULT_TILES
        kinds = np.full((-(-L // block_q), -(-S // block_k)), FULL, dtype=np.uint8)
    else:
        validation.block_mask_fits(block_mask, B, H, L, S)
        (block_q, block_k), kinds = block_mask.block_size, block_mask.batch_kinds()
    if parameters:  # the same score function, its parameters the operation's tensors
        score_mod = score_mod.replace(**dict(zip(options.names, parameters, strict=True)))
    work, device = torch.promote_types(q.dtype, torch.float32), q.device  # float16, bfloat16: in float32
    G = H // max(Hkv, 1)
    return _Problem(
        q=_cast(q, work).reshape(B, Hkv, G, L, E), k=_cast(k, work), v=_cast(v, work),
        score_mod=score_mod, mask_mod=None if block_mask is None else block_mask.mask_mod, kinds=kinds,
        block_q=block_q, block_k=block_k, scale=scale, work=work,
        b=torch.arange(B, device=device).reshape(B, 1, 1, 1), h=torch.arange(H, device=device).reshape(1, H, 1, 1),
        q_idx=torch.arange(L, device=device), kv_idx=torch.arange(S, device=device),
        slopes=_alibi_slopes(options.alibi_slopes, (B, H), False, work, device))  # the tiles' heads: (B, H)


class _Tile(NamedTuple):
    """One (query tile, key tile) pair that the block mask leaves to compute."""

    rows: slice  # its queries
    cols: slice  # its keys
    partial: bool  # the mask function hides some of its entries in some (b, h) (else it hides none)


def _tiles(p: _Problem) -> list[tuple[slice, list[_Tile]]]:
    """Each query tile's rows with the key tiles it computes: the empty ones left out, the partial ones marked."""
    L, S = p.q_idx.shape[0], p.kv_idx.shape[0]
    found = []
    for row, kinds in enumerate(p.kinds):
        rows = slice(row * p.block_q, min(row * p.block_q + p.block_q, L))
        found.append((rows, [_Tile(rows=rows, cols=slice(col * p.block_k, min(col * p.block_k + p.block_k, S)),
                                   partial=kind == PARTIAL) for col, kind in enumerate(kinds) if kind != EMPTY]))
    return found


def _forward(p: _Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """out (B, H, L, Ev) and lse (B, H, L) in the working dtype, one query tile at a time."""
    B, Hkv, G, L, _ = p.q.shape
    out = torch.zeros((B, Hkv * G, L, p.v.shape[-1]), dtype=p.work, device=p.q.device)  # (B, H, L, Ev)
    lse = torch.full((B, Hkv * G, L), -math.inf, dtype=p.work, device=p.q.device)  # (B, H, L)
    for rows, tiles in _tiles(p):
        out[:, :, rows], lse[:, :, rows] = _query_tile(p, rows, tiles)
    return out, lse


def _query_tile(p: _Problem, rows: slice, tiles: list[_Tile]) -> tuple[torch.Tensor, torch.Tensor]:
    """out (B, H, block_q, Ev) and lse (B, H, block_q) of the queries `rows`: the online softmax over the key
    tiles the block mask leaves them."""
    B, Hkv, G, _, _ = p.q.shape
    q = _query_rows(p, rows)  # (B, Hkv, G * block_q, E)
    n = rows.stop - rows.start
    m = torch.full((B, Hkv * G, n, 1), -math.inf, dtype=p.work, device=q.device)  # running maximum (B, H, bq, 1)
    l = torch.zeros_like(m)  # running denominator  # noqa: E741 (the paper's name)
    acc = torch.zeros((B, Hkv, G * n, p.v.shape[-1]), dtype=p.work, device=q.device)  # (B, Hkv, G * bq, Ev)
    for tile in tiles:
        scores = _mods(p, _raw_scores(p, q, tile), p.score_mod, tile)  # R (B, H, bq, bk), -inf where hidden
        # 1) the new running maximum; where nothing is seen yet (the maximum -inf) the shift is 0
        m_new = torch.maximum(m, scores.amax(dim=-1, keepdim=True))
        shift = m_new.masked_fill(m_new == -math.inf, 0)
        # 2) what was summed against the old maximum, moved to the new one: exp(m - m_new)
        rescale = torch.exp(m - shift)  # (B, H, bq, 1); 0 on the first tile a row sees
        weights = (scores - shift).exp_()  # unnormalised; hidden: exp(-inf) = 0
        l.mul_(rescale).add_(weights.sum(dim=-1, keepdim=True))
        v = p.v[:, :, tile.cols]  # (B, Hkv, bk, Ev)
        acc.mul_(_grouped(rescale, Hkv)).add_(_grouped(weights, Hkv) @ v)  # (.., G * bq, bk) x (.., bk, Ev)
        m = m_new
    # 3) normalise once, at the end; a query with no visible key has l = 0: zeros, and lse -inf
    seen = l != 0
    out = acc.reshape(B, Hkv * G, n, -1) / torch.where(seen, l, 1)  # (B, H, bq, Ev)
    lse = torch.where(seen, m + torch.log(l), -math.inf)  # (B, H, bq, 1)
    return out, lse[..., 0]


def _query_rows(p: _Problem, rows: slice) -> torch.Tensor:
    """The queries `rows` of every group as one matrix, times the scale: (B, Hkv, G, block_q, E) ->
    (B, Hkv, G * block_q, E)."""
    B, Hkv, G, _, E = p.q.shape
    return (p.q[:, :, :, rows] * p.scale).reshape(B, Hkv, G * (rows.stop - rows.start), E)


def _grouped(x: torch.Tensor, Hkv: int) -> torch.Tensor:
    """(B, H, block_q, *) -> (B, Hkv, G * block_q, *): query head h = hkv * G + g, in the group of its key/value
    head. Free on a contiguous tile."""
    return x.reshape(x.shape[0], Hkv, -1, x.shape[-1])


def _raw_scores(p: _Problem, q: torch.Tensor, tile: _Tile) -> torch.Tensor:
    """S = (Q K^T) * scale of a tile, q its queries already scaled: (B, H, block_q, block_k)."""
    B, Hkv, G, _, _ = p.q.shape
    raw = q @ p.k[:, :, tile.cols].transpose(-1, -2)  # (B, Hkv, G * bq, E) x (B, Hkv, E, bk) -> (B, Hkv, G * bq, bk)
    return raw.reshape(B, Hkv * G, tile.rows.stop - tile.rows.start, tile.cols.stop - tile.cols.start)


def _mods(p: _Problem, scores: torch.Tensor, score_mod: Callable[..., Any] | None, tile: _Tile) -> torch.Tensor:
    """R = score_mod(S, b, h, i, j) over a tile (B, H, block_q, block_k), plus ALiBi's -slope_h * |i - j| (after
    the score function, where sdpa adds it; query i at position i), -inf where the mask function hides the key:
    evaluated on a partial tile only (a full tile shows every key)."""
    q_idx, kv_idx = p.q_idx[tile.rows].reshape(1, 1, -1, 1), p.kv_idx[tile.cols].reshape(1, 1, 1, -1)
    if score_mod is not None:
        new = score_mod(scores, p.b, p.h, q_idx, kv_idx)
        validation.score_mod_result(new.shape, scores.shape)
        scores = _cast(new, p.work).expand(scores.shape)
    if p.slopes is not None:  # a constant: its derivative leaves dR as it is
        scores = scores + _alibi_tile(p.slopes, p.q_idx.new_zeros(()), tile.rows, tile.cols)  # flex: p_i = i
    if tile.partial:
        visible = p.mask_mod(p.b, p.h, q_idx, kv_idx)
        validation.mask_mod_result("mask_mod", visible.shape, str(visible.dtype), scores.shape)
        scores = torch.where(visible, scores, -math.inf)
    return scores


def _backward(p: _Problem, out: torch.Tensor, lse: torch.Tensor, d_out: torch.Tensor, d_lse: torch.Tensor,
              need_parameters: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The pullback, tile by tile over the computed tiles: dq, dk, dv in the working dtype and the parameters'
    gradients. torch: lse is an output of the autograd operation too; since d lse_i / d R_ij = P_ij, its
    cotangent adds P * d_lse to dR, which is D - d_lse in place of D."""
    B, Hkv, G, L, E = p.q.shape
    d_out = _cast(d_out, p.work)  # (B, H, L, Ev)
    D = (d_out * out).sum(dim=-1, keepdim=True) - _cast(d_lse, p.work)[..., None]  # (B, H, L, 1)
    lse = lse.masked_fill(lse == -math.inf, math.inf)[..., None]  # a query that sees nothing: P = exp(-inf) = 0
    dq = torch.zeros((B, Hkv * G, L, E), dtype=p.work, device=out.device)  # (B, H, L, E), without the scale
    dk, dv = torch.zeros_like(p.k), torch.zeros_like(p.v)  # (B, Hkv, S, E), (B, Hkv, S, Ev)
    d_parameters = [torch.zeros_like(x) for x in _named_parameters(p.score_mod).values()]
    for rows, tiles in _tiles(p):
        q = _query_rows(p, rows)  # (B, Hkv, G * bq, E), scaled
        d_o = _grouped(d_out[:, :, rows], Hkv)  # (B, Hkv, G * bq, Ev)
        for tile in tiles:
            cols = tile.cols
            d_scores, d_v, d_theta = _tile_gradients(p, tile, q, d_o, D[:, :, rows], lse[:, :, rows],
                                                     need_parameters)
            dS = _grouped(d_scores, Hkv)  # (B, Hkv, G * bq, bk)
            dv[:, :, cols] += d_v
            dq[:, :, rows] += (dS @ p.k[:, :, cols]).reshape(B, Hkv * G, -1, E)  # (.., G * bq, bk) x (.., bk, E)
            dk[:, :, cols] += dS.transpose(-1, -2) @ q  # q holds the scale: (.., bk, G * bq) x (.., G * bq, E)
            for total, d in zip(d_parameters, d_theta, strict=False):  # d_theta empty: no gradient wanted
                total += d
    return dq * p.scale, dk, dv, d_parameters


def _tile_gradients(p: _Problem, tile: _Tile, q: torch.Tensor, d_o: torch.Tensor, D: torch.Tensor,
                    lse: torch.Tensor, need_parameters: bool) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """One tile's dS (B, H, block_q, block_k), its dV (B, Hkv, block_k, Ev) and its share of each parameter's
    gradient, from the tile recomputed: q the tile's scaled queries (B, Hkv, G * bq, E), d_o, D and lse the
    rows' (B, Hkv, G * bq, Ev), (B, H, bq, 1), (B, H, bq, 1)."""
    Hkv = p.k.shape[1]
    raw = _raw_scores(p, q, tile)  # S (B, H, bq, bk)
    # torch: S and the parameters as new leaves, and the score function recorded on them (backward runs without)
    parameters = {name: x.detach().requires_grad_(need_parameters)
                  for name, x in _named_parameters(p.score_mod).items()}
    with torch.enable_grad():
        score_mod = p.score_mod.replace(**parameters) if parameters else p.score_mod
        scores = _mods(p, raw.requires_grad_(score_mod is not None), score_mod, tile)
    # 1) the weights again, from the log-sum-exp: P = exp(R - lse), 0 where hidden
    weights = torch.exp(scores.detach() - lse)  # (B, H, bq, bk)
    # 2) through the value product and the softmax
    d_v = _grouped(weights, Hkv).transpose(-1, -2) @ d_o  # (B, Hkv, bk, G * bq) x (B, Hkv, G * bq, Ev)
    d_weights = (d_o @ p.v[:, :, tile.cols].transpose(-1, -2)).reshape(weights.shape)  # dP = dO V^T (B, H, bq, bk)
    d_new = weights * (d_weights - D)  # dR = P * (dP - D)
    # 3) through the score function: (dS, dtheta) = torch.autograd.grad(R, (S, theta), dR)
    d_scores, d_theta = d_new, []
    if score_mod is not None:
        targets = [raw, *(parameters.values() if need_parameters else ())]
        grads = (torch.autograd.grad(scores, targets, d_new, allow_unused=True) if scores.requires_grad
                 else [None] * len(targets))  # a score function that ignores the scores and its parameters
        d_scores, *d_theta = (torch.zeros_like(x) if g is None else g for x, g in zip(targets, grads, strict=True))
    hidden = scores.detach() == -math.inf  # dR is 0 there; a NaN or inf of the derivative must not leak
    d_scores = torch.where(hidden, 0, d_scores)
    return d_scores, d_v, d_theta
