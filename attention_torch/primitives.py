"""The pieces the attention functions build on, in PyTorch: which keys a query may see (the masks built from
positions, and `_visible`, which joins them with a mask and a bias), the softmax over the visible keys, the
cast that skips a dispatch, and a score function's parameters as tensors (flex, flash and the vjps read them).
torch: autograd sums gradients over broadcast axes, and the activations are torch's own modules, so neither is
here.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

This module imports no other module of the backend, so that functional, fast, flash, linear, gradients and
modules can all import it and the imports run one way.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from attention_np.common import mods, validation
from attention_np.common.mods import Aligned, from_keywords
from attention_np.common.records import Structure


def causal_mask(L: int, S: int, *, q_offset: int | torch.Tensor = 0) -> torch.Tensor:
    """Boolean (..., L, S), (...) the shape of q_offset: True where key j <= p_i = q_offset + i, the keys a
    query may see (top-left aligned for q_offset 0, bottom-right for q_offset S - L): the catalogue's
    causal(q_offset) on the grid."""
    return _on_grid(Structure(is_causal=True, q_offset=_integers(q_offset), window=None, key_lengths=None), L, S)


def window_mask(L: int, S: int, window: tuple[int | None, int | None], *,
                q_offset: int | torch.Tensor = 0) -> torch.Tensor:
    """Boolean (..., L, S), (...) the shape of q_offset: True where p_i - left <= j <= p_i + right,
    p_i = q_offset + i; a side that is None is unbounded: the catalogue's sliding_window(left, right, q_offset)
    on the grid."""
    structure = Structure(is_causal=False, q_offset=_integers(q_offset), window=validation.window(window),
                          key_lengths=None)
    return _on_grid(structure, L, S)


def _on_grid(structure: Structure, L: int, S: int) -> torch.Tensor:
    """The position keywords' mask function evaluated on every (query, key) pair: (..., L, S), (...) the shape
    of q_offset (a window of two unbounded sides hides nothing and reads no q_offset: expanded)."""
    visible = _by_position(structure)(None, None, *_positions(L, S, structure.q_offset.device))
    return visible.expand(*structure.q_offset.shape, L, S).clone() if visible.ndim < 2 + structure.q_offset.ndim \
        else visible


def alibi_slopes(H: int) -> torch.Tensor:
    """ALiBi's slopes, one per head: the geometric sequence of the ALiBi paper (Press et al.) and BLOOM. For H a
    power of two, slope_h = 2^(-8 h / H), h = 1 .. H; otherwise, n the greatest power of two below H, the n
    slopes 2^(-8 h / n), then the odd terms 2^(-8 h / (2 n)), h = 1, 3, 5, .., of the sequence for 2 n, H - n of
    them (transformers' build_alibi_tensor).

    Args:
        H: the number of heads, a positive integer.

    Returns:
        slopes (H,), computed in Python floats, in the backend's default floating dtype (NumPy: float64).
    """
    H = validation.alibi_heads(H)
    n = 1 << (H.bit_length() - 1)  # the greatest power of two <= H
    slopes = [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]  # 2^(-8/n), its square, ..
    slopes += [2.0 ** (-8.0 * h / (2 * n)) for h in range(1, 2 * (H - n), 2)]  # the odd terms for 2n
    return torch.tensor(slopes)  # torch: the default dtype


def padding_mask(lengths: torch.Tensor, S: int) -> torch.Tensor:
    """Boolean (B, 1, 1, S) from lengths (B,): True for the first lengths[b] keys of sequence b.

    The two singleton axes stand for H and L, so the mask broadcasts over (B, H, L, S) scores.
    """
    lengths = torch.as_tensor(lengths)
    return torch.arange(S, device=lengths.device) < lengths[..., None, None, None]  # (B,) -> (B, 1, 1, S)


def _visible(mask: torch.Tensor | None, bias: torch.Tensor | None, structure: Structure, scores_shape: tuple,
             device: torch.device) -> torch.Tensor | None:
    """True where a query may see a key: kept by `mask`, not -inf in `bias`, allowed by the structure
    (is_causal, q_offset, window, key_lengths; built from positions). Broadcasts to the scores' shape
    (..., L, S); None when nothing hides a key."""
    L, S = scores_shape[-2:]
    visible = None
    if mask is not None:
        validation.broadcasts_to("mask", mask.shape, scores_shape, "..., L, S")
        mask = torch.as_tensor(mask, device=device)
        validation.binary_mask(mask.is_floating_point(), bool(((mask == 0) | (mask == 1)).all()))
        visible = mask != 0
    if bias is not None:
        validation.broadcasts_to("bias", bias.shape, scores_shape, "..., L, S")
        visible = _both(visible, torch.as_tensor(bias, device=device) != -math.inf)
    batch = scores_shape[:-2]
    key_lengths = None if structure.key_lengths is None else \
        _integers(structure.key_lengths, "key_lengths", batch).to(device)
    by_position = _by_position(structure._replace(q_offset=_integers(structure.q_offset, "q_offset", batch).to(device),
                                                  window=validation.window(structure.window),
                                                  key_lengths=key_lengths))
    if by_position is not None:
        visible = _both(visible, by_position(None, None, *_positions(L, S, device)))  # (..., L, S)
    return visible


def _by_position(structure: Structure) -> Callable[..., Any] | None:
    """The mask function of the position keywords (mods.from_keywords), q_offset and key_lengths (...) laid out
    against scores (..., L, S): evaluated at _positions it gives (..., L, S); None where no keyword hides a key."""
    def aligned(x: torch.Tensor | None) -> Aligned | None:
        return None if x is None else Aligned(x[..., None, None])  # (...) -> (..., 1, 1)
    return from_keywords(structure._replace(q_offset=aligned(structure.q_offset),
                                            key_lengths=aligned(structure.key_lengths)))[0]


def _positions(L: int, S: int, device: torch.device, rows: int = 0,
               cols: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """q_idx (L, 1) and kv_idx (S,), from rows and cols on (a tile's first query and key), on `device`."""
    return torch.arange(rows, rows + L, device=device)[:, None], torch.arange(cols, cols + S, device=device)


def _integers(x: int | torch.Tensor, name: str = "q_offset", batch: tuple | None = None) -> torch.Tensor:
    """q_offset or key_lengths as an int64 tensor, checked: integer, and (given the scores' leading axes
    `batch`) broadcasting to them."""
    if type(x) is int or isinstance(x, torch.SymInt):  # torch: scalar_tensor keeps an int symbolic under
        x = torch.scalar_tensor(x, dtype=torch.int64)  # torch.compile (a cache's length: one graph for every
    x = torch.as_tensor(x)  # decode step), where as_tensor specialises the graph to its value
    integer = not (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool)  # torch: no issubdtype
    validation.positions(name, x.shape, str(x.dtype), integer, x.shape if batch is None else batch)
    return x.to(torch.int64)


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype`. torch: x.to(dtype) costs a dispatch even when x has that dtype, and a decode step makes
    a dozen such calls."""
    return x if x.dtype == dtype else x.to(dtype)


def _both(visible: torch.Tensor | None, rule: torch.Tensor) -> torch.Tensor:
    return rule if visible is None else visible & rule


def _masked_softmax(scores: torch.Tensor, visible: torch.Tensor | None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax over the visible entries of each row (last axis); a row with none visible is all zeros.

    weights_ij = exp(s_ij - m_i) / sum_j' exp(s_ij' - m_i) over visible j, with m_i the row maximum.
    Subtracting m_i changes nothing mathematically and keeps exp from overflowing. With sinks (..., 1, 1)
    (_sink_logits), each row's sink logit joins the denominator and carries no value:
    weights_ij = exp(s_ij - m_i) / (exp(sink - m_i) + sum_j' exp(s_ij' - m_i)), m_i = max(sink, max_j s_ij);
    the weights then sum to less than 1, and a row with none visible is still all zeros (0 / exp(0)).
    """
    if sinks is not None:
        return _sunk_softmax(scores, visible, sinks)
    if visible is None:  # every key visible: the plain softmax
        exp = torch.exp(scores - scores.amax(dim=-1, keepdim=True).detach())  # (..., L, S)
        return exp / exp.sum(dim=-1, keepdim=True)
    scores = torch.where(visible, scores, -math.inf)  # hidden entries become exp(-inf) = 0 below
    row_max = scores.amax(dim=-1, keepdim=True).detach()  # (..., L, 1); torch: the shift needs no gradient
    row_max = torch.where(row_max == -math.inf, 0, row_max)  # fully masked row: any finite shift will do
    exp = torch.exp(scores - row_max)  # (..., L, S)
    total = exp.sum(dim=-1, keepdim=True)  # (..., L, 1)
    return exp / torch.where(total == 0, 1, total)  # fully masked row: 0 / 1 = 0, never 0 / 0


def _sunk_softmax(scores: torch.Tensor, visible: torch.Tensor | None, sinks: torch.Tensor) -> torch.Tensor:
    """_masked_softmax with each row's sink logit in its denominator (and in the shift m_i)."""
    if visible is not None:
        scores = torch.where(visible, scores, -math.inf)  # hidden entries become exp(-inf) = 0 below
    row_max = torch.maximum(scores.amax(dim=-1, keepdim=True), sinks).detach()  # (..., L, 1); torch: the shift
    # needs no gradient
    row_max = torch.where(row_max == -math.inf, 0, row_max)  # no key seen and a sink of -inf: any finite shift
    exp = torch.exp(scores - row_max)  # (..., L, S)
    total = exp.sum(dim=-1, keepdim=True) + torch.exp(sinks - row_max)  # (..., L, 1): the sink's share too
    return exp / torch.where(total == 0, 1, total)  # a sink of -inf and no key seen: 0 / 1 = 0, never 0 / 0


def _sunk_rows(out: torch.Tensor, lse: torch.Tensor,
               sinks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """out (..., L, Ev) and lse (..., L) of a softmax over the keys, with each row's sink joined once, as one more
    partial result of out 0 and lse the sink: lse' = logaddexp(lse, sink), out' = exp(lse - lse') out (a row that
    sees no key keeps zeros); both unchanged without sinks. sinks broadcast to (..., H), lse's leading axes.
    torch: out of place, so that autograd takes its gradients on to out's and lse's."""
    if sinks is None:
        return out, lse
    sink = _sink_logits(sinks, lse.shape[:-1], False, lse.dtype, lse.device)[..., 0]
    none = (lse == -math.inf) & (sink == -math.inf)  # no key and a sink of -inf: lse' -inf, and no NaN in its gradient
    merged = torch.where(none, -math.inf, torch.logaddexp(torch.where(none, 0, lse), torch.where(none, 0, sink)))
    shift = torch.where(merged == -math.inf, 0, merged)  # there exp(-inf - 0) = 0, never NaN
    return (torch.exp(lse - shift)[..., None] * out.to(lse.dtype)).to(out.dtype), merged


def _sink_logits(sinks: torch.Tensor | None, batch: tuple, grouped: bool, work: torch.dtype,
                 device: torch.device) -> torch.Tensor | None:
    """sinks broadcasting to the scores' leading axes (..., H), checked, in the working dtype and laid out
    against the scores (..., L, S): (..., 1, 1), grouped (..., Hkv, G, 1, 1) with enable_gqa; None without."""
    if sinks is None:
        return None
    sinks = torch.as_tensor(sinks, device=device)
    return sinks.to(work).reshape(validation.sinks(sinks.shape, batch, grouped))


def _alibi(slopes: torch.Tensor | None, bias: torch.Tensor | None, q_offset: int | torch.Tensor, batch: tuple,
           grouped: bool, L: int, S: int, work: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """bias plus ALiBi's -slope_h * |p_i - j| (_alibi_tile over every query and key) as one additive bias
    (..., L, S) in the working dtype; bias unchanged without slopes. slopes (H,) or (B, H), checked against the
    scores' leading axes `batch` ((..., Hkv, G) where `grouped`, enable_gqa)."""
    if slopes is None:
        return bias
    q_offset = _integers(q_offset, "q_offset", batch).to(device)
    alibi = _alibi_tile(_alibi_slopes(slopes, batch, grouped, work, device), q_offset, slice(0, L), slice(0, S))
    return alibi if bias is None else torch.as_tensor(bias, dtype=work, device=device) + alibi  # -inf still hides


def _alibi_slopes(slopes: torch.Tensor | None, batch: tuple, grouped: bool, work: torch.dtype,
                  device: torch.device) -> torch.Tensor | None:
    """ALiBi's slopes (H,) or (B, H), checked against the scores' leading axes `batch`, in the working dtype and
    laid out against the scores (..., L, S): (..., 1, 1), grouped (..., Hkv, G, 1, 1) with enable_gqa; None
    without. Constants: detached, they take no gradient."""
    if slopes is None:
        return None
    slopes = torch.as_tensor(slopes, device=device).detach()
    return slopes.to(work).reshape(validation.alibi_slopes(slopes.shape, batch, grouped))


def _alibi_tile(slopes: torch.Tensor, q_offset: torch.Tensor, rows: slice, cols: slice) -> torch.Tensor:
    """ALiBi's bias on the queries `rows` and keys `cols`, from their positions: -slope_h * |p_i - j|,
    p_i = q_offset + i; slopes laid out (..., 1, 1) (_alibi_slopes), q_offset integers (...). Returns
    (..., rows, cols), never more than the tile."""
    q_idx, kv_idx = _positions(rows.stop - rows.start, cols.stop - cols.start, slopes.device, rows.start, cols.start)
    positions = q_offset[..., None, None] + q_idx  # (..., rows, 1)
    return -slopes * (positions - kv_idx).abs().to(slopes.dtype)  # (..., 1, 1) x (..., rows, cols)


def _parameters(score_mod: Callable[..., Any] | None, q: torch.Tensor) -> list[torch.Tensor]:
    """A ScoreMod's parameters as tensors on q's device, to be inputs of the autograd operation: a tensor as it
    is (so that its gradient reaches it), anything else as a new tensor, floating (an integer slope becomes the
    scores' working dtype, so that it has a gradient too)."""
    tensors = []
    for value in _named_parameters(score_mod).values():
        x = value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
        if not x.is_floating_point():
            x = x.to(torch.promote_types(q.dtype, torch.float32))
        tensors.append(x.to(q.device))  # torch: differentiable, so a tensor elsewhere still gets its gradient
    return tensors


def _named_parameters(score_mod: Callable[..., Any] | None) -> dict[str, Any]:
    """A ScoreMod's parameters by name; none for a plain function."""
    return dict(score_mod.parameters) if isinstance(score_mod, mods.ScoreMod) else {}


def _replaced(score_mod: Callable[..., Any] | None, names: list[str],
              parameters: list[torch.Tensor]) -> Callable[..., Any] | None:
    """score_mod holding `parameters` (its own, as autograd's leaves) in place of its parameters; itself
    without any (None, a plain function, a ScoreMod without parameters)."""
    return score_mod.replace(**dict(zip(names, parameters, strict=True))) if parameters else score_mod


class _Indices(NamedTuple):
    """The index arrays a mask or score function receives over scores (B, H, L, S), int64 on q's device; a tile
    takes its rows of q_idx and its columns of kv_idx. torch: the mods see the scores as (B, H, L, S) also where
    grouped-query heads lay them out (B, Hkv, G, L, S) (a view of the same tensor), as flex_attention's do."""

    b: torch.Tensor  # (B, 1, 1, 1)
    h: torch.Tensor  # (1, H, 1, 1): the query heads
    q_idx: torch.Tensor  # (1, 1, L, 1), not shifted by q_offset
    kv_idx: torch.Tensor  # (1, 1, 1, S)


def _indices(B: int, H: int, L: int, S: int, device: torch.device) -> _Indices:
    return _Indices(b=torch.arange(B, device=device).reshape(B, 1, 1, 1),
                    h=torch.arange(H, device=device).reshape(1, H, 1, 1),
                    q_idx=torch.arange(L, device=device).reshape(1, 1, L, 1),
                    kv_idx=torch.arange(S, device=device).reshape(1, 1, 1, S))


def _mask_mod_visible(mask_mod: Callable[..., Any], idx: _Indices, rows: slice = slice(None),
                      cols: slice = slice(None)) -> torch.Tensor:
    """mask_mod(b, h, q_idx, kv_idx) over the queries `rows` and keys `cols`, checked: booleans broadcasting to
    (B, H, block_q, block_k)."""
    q_idx, kv_idx = idx.q_idx[..., rows, :], idx.kv_idx[..., cols]
    visible = mask_mod(idx.b, idx.h, q_idx, kv_idx)
    target = (idx.b.shape[0], idx.h.shape[1], q_idx.shape[-2], kv_idx.shape[-1])
    validation.mask_mod_result("mask_mod", visible.shape, str(visible.dtype), target)
    return visible


def _score_mod_scores(score_mod: Callable[..., Any], scores: torch.Tensor, idx: _Indices, rows: slice = slice(None),
                      cols: slice = slice(None)) -> torch.Tensor:
    """score_mod(scores, b, h, q_idx, kv_idx) over the queries `rows` and keys `cols`, checked, in the scores'
    dtype and layout: (B, H, block_q, block_k), or grouped (B, Hkv, G, block_q, block_k), which the mods see as
    (B, H, block_q, block_k)."""
    layout = scores.shape
    scores = scores.flatten(1, 2) if scores.ndim == 5 else scores  # (B, Hkv, G, bq, bk) -> (B, H, bq, bk): a view
    new = score_mod(scores, idx.b, idx.h, idx.q_idx[..., rows, :], idx.kv_idx[..., cols])
    validation.score_mod_result(new.shape, scores.shape)
    return _cast(new, scores.dtype).expand(scores.shape).reshape(layout)


def _gated(name: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The gated activation of the feed-forward network, (..., L, F) -> (..., L, F):
    swiglu:     silu(gate) * up
    swiglu_oss: (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g),  g = min(gate, limit)
    gpt-oss's clamped form (GptOssExperts), alpha = 1.702 and limit = 7.0 (validation.SWIGLU_OSS_*)."""
    if name == "swiglu":
        return torch.nn.functional.silu(gate) * up
    alpha, limit = validation.SWIGLU_OSS_ALPHA, validation.SWIGLU_OSS_LIMIT
    gate = torch.clamp(gate, max=limit)  # clamped above only
    return (torch.clamp(up, -limit, limit) + 1) * gate * torch.sigmoid(alpha * gate)
