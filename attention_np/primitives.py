"""The pieces the attention functions build on, in NumPy: which keys a query may see (the masks built from
positions, and `_visible`, which joins them with a mask and a bias), the mask and score functions on the scores
(`_Mods`, their index arrays laid out as the scores, and `_modded`) with the score function's derivative for the
hand-derived backward passes, the softmax over the visible keys, the sum of a gradient over an input's broadcast
axes, and the activations of the feed-forward network.

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

from attention_np.common import validation
from attention_np.common.mods import Aligned, from_keywords
from attention_np.common.records import Structure


def causal_mask(L: int, S: int, *, q_offset: int | np.ndarray = 0) -> np.ndarray:
    """Boolean (..., L, S), (...) the shape of q_offset: True where key j <= p_i = q_offset + i, the keys a
    query may see (top-left aligned for q_offset 0, bottom-right for q_offset S - L): the catalogue's
    causal(q_offset) on the grid."""
    return _on_grid(Structure(is_causal=True, q_offset=_integers(q_offset), window=None, key_lengths=None), L, S)


def window_mask(L: int, S: int, window: tuple[int | None, int | None], *,
                q_offset: int | np.ndarray = 0) -> np.ndarray:
    """Boolean (..., L, S), (...) the shape of q_offset: True where p_i - left <= j <= p_i + right,
    p_i = q_offset + i; a side that is None is unbounded: the catalogue's sliding_window(left, right, q_offset)
    on the grid."""
    structure = Structure(is_causal=False, q_offset=_integers(q_offset), window=validation.window(window),
                          key_lengths=None)
    return _on_grid(structure, L, S)


def _on_grid(structure: Structure, L: int, S: int) -> np.ndarray:
    """The position keywords' mask function evaluated on every (query, key) pair: (..., L, S), (...) the shape
    of q_offset (a window of two unbounded sides hides nothing and reads no q_offset: broadcast)."""
    visible = _by_position(structure)(None, None, np.arange(L)[:, None], np.arange(S))
    shape = (*np.shape(structure.q_offset), L, S)
    return visible if visible.shape == shape else np.broadcast_to(visible, shape).copy()


def alibi_slopes(H: int) -> np.ndarray:
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
    return np.array(slopes)


def padding_mask(lengths: np.ndarray, S: int) -> np.ndarray:
    """Boolean (B, 1, 1, S) from lengths (B,): True for the first lengths[b] keys of sequence b.

    The two singleton axes stand for H and L, so the mask broadcasts over (B, H, L, S) scores.
    """
    lengths = np.asarray(lengths)
    return np.arange(S) < lengths[..., None, None, None]  # (B,) -> (B, 1, 1, S)


def _visible(mask: np.ndarray | None, bias: np.ndarray | None, structure: Structure,
             scores_shape: tuple) -> np.ndarray | None:
    """True where a query may see a key: kept by `mask`, not -inf in `bias`, allowed by the structure
    (is_causal, q_offset, window, key_lengths; built from positions). Broadcasts to the scores' shape
    (..., L, S); None when nothing hides a key."""
    L, S = scores_shape[-2:]
    visible = None
    if mask is not None:
        validation.broadcasts_to("mask", np.shape(mask), scores_shape, "..., L, S")
        mask = np.asarray(mask)
        validation.binary_mask(np.issubdtype(mask.dtype, np.floating), bool(np.all((mask == 0) | (mask == 1))))
        visible = mask != 0
    if bias is not None:
        validation.broadcasts_to("bias", np.shape(bias), scores_shape, "..., L, S")
        visible = _both(visible, np.asarray(bias) != -np.inf)
    batch = scores_shape[:-2]
    key_lengths = None if structure.key_lengths is None else _integers(structure.key_lengths, "key_lengths", batch)
    by_position = _by_position(structure._replace(q_offset=_integers(structure.q_offset, "q_offset", batch),
                                                  window=validation.window(structure.window),
                                                  key_lengths=key_lengths))
    if by_position is not None:
        visible = _both(visible, by_position(None, None, np.arange(L)[:, None], np.arange(S)))  # (..., L, S)
    return visible


def _by_position(structure: Structure) -> Callable[..., Any] | None:
    """The mask function of the position keywords (from_keywords), q_offset and key_lengths (...) laid out
    against scores (..., L, S): evaluated at q_idx (..., L, 1) and kv_idx (..., S) it gives (..., L, S); None
    where no keyword hides a key."""
    def aligned(x: np.ndarray | None) -> Aligned | None:
        return None if x is None else Aligned(np.asarray(x)[..., None, None])  # (...) -> (..., 1, 1)
    return from_keywords(structure._replace(q_offset=aligned(structure.q_offset),
                                            key_lengths=aligned(structure.key_lengths)))[0]


class _Mods(NamedTuple):
    """A call's mask_mod and score_mod with the index arrays they receive, laid out as the scores are: b
    (B, 1, 1, 1), h (1, H, 1, 1), q_idx (1, 1, L, 1), kv_idx (1, 1, 1, S) against scores (B, H, L, S); against
    enable_gqa's grouped scores (B, Hkv, G, L, S) every array has rank five and h is the query head
    h_kv * G + g, (1, Hkv, G, 1, 1), so that b stays on the batch axis when they broadcast."""

    mask_mod: Callable[..., Any] | None
    score_mod: Callable[..., Any] | None
    b: np.ndarray
    h: np.ndarray
    q_idx: np.ndarray
    kv_idx: np.ndarray

    @classmethod
    def of(cls, mask_mod: Callable[..., Any] | None, score_mod: Callable[..., Any] | None, B: int, heads: tuple,
           L: int, S: int) -> _Mods:
        """The mods over scores (B, *heads, L, S): heads (H,), or (Hkv, G) grouped."""
        ones = (1,) * (len(heads) + 3)  # the scores' rank
        return cls(mask_mod=mask_mod, score_mod=score_mod, b=np.arange(B).reshape(B, *ones[1:]),
                   h=np.arange(math.prod(heads)).reshape(1, *heads, 1, 1),
                   q_idx=np.arange(L).reshape(*ones[:-2], L, 1), kv_idx=np.arange(S).reshape(*ones[:-1], S))

    def tile(self, rows: slice = slice(None), cols: slice = slice(None)) -> tuple:
        """(b, h, q_idx, kv_idx) of the scores' queries `rows` and keys `cols` (all of them by default)."""
        return self.b, self.h, self.q_idx[..., rows, :], self.kv_idx[..., cols]


def _modded(mods: _Mods, scores: np.ndarray, visible: np.ndarray | None, indices: tuple,
            mask_mod: Callable[..., Any] | None, shape: tuple) -> tuple[np.ndarray, np.ndarray | None]:
    """The mods on scores broadcasting to `shape` (..., L, S), the full scores' (a tile's, with its `indices`):
    the new scores score_mod(scores, b, h, q_idx, kv_idx), a new writable array (..., L, S) in the scores' dtype
    (`scores` itself without a score function), and `visible` and-ed with where the new score is not -inf (a -inf
    score hides its key, as in flex_attention) and with `mask_mod` (None: not evaluated, as on a block mask's full
    tile)."""
    if mods.score_mod is not None:
        new = np.asarray(mods.score_mod(np.broadcast_to(scores, shape), *indices))  # a read-only view: no copy
        validation.score_mod_result(new.shape, shape)
        if new.shape != shape or new.dtype != scores.dtype or not new.flags.writeable:
            new = np.array(np.broadcast_to(new, shape), dtype=scores.dtype)  # (..., L, S), its own
        scores, visible = new, _both(visible, new != -np.inf)
    if mask_mod is not None:
        shown = np.asarray(mask_mod(*indices))
        validation.mask_mod_result("mask_mod", shown.shape, str(shown.dtype), shape)
        visible = _both(visible, shown)
    return scores, visible


def _score_mod_vjp(score_mod: Any, d_new: np.ndarray, scores: np.ndarray, weights: np.ndarray,
                   indices: tuple) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(dC, dtheta) from dS, the gradient at the new scores (..., L, S) (a tile's, with its `indices`), through
    score_mod's hand-derived vjp at the scores C it received: dC is 0 where P = 0 (a hidden key), whatever the
    derivative says at a score the softmax never used; dtheta its parameters' gradients, summed over the scores."""
    d_scores, d_theta = score_mod.vjp(d_new, np.broadcast_to(scores, d_new.shape), *indices)
    return np.where(weights == 0, 0, np.broadcast_to(d_scores, d_new.shape)), d_theta


def _check_derivative(function: str, score_mod: Callable[..., Any] | None) -> None:
    """NumPy's backward passes need score_mod's derivative: a ScoreMod of the catalogue carries it (vjp)."""
    if score_mod is not None and not callable(getattr(score_mod, "vjp", None)):
        name = getattr(score_mod, "__name__", type(score_mod).__name__)
        raise ValueError(
            f"score_mod {name} has no derivative: NumPy's {function} derives the backward pass by hand and "
            "needs score_mod.vjp(d_new, score, b, h, q_idx, kv_idx) -> (d_score, {parameter name: gradient}); "
            "make it a mods.ScoreMod with its derivative (as every score function of the catalogue is), or "
            "differentiate it with the JAX or torch backend")


def _parameter_dtype(parameter: Any, work: np.dtype) -> np.dtype:
    """A score function's parameter's gradient's dtype: the parameter's own where it is floating, else the
    working dtype."""
    dtype = np.asarray(parameter).dtype
    return dtype if np.issubdtype(dtype, np.floating) else work


def _integers(x: int | np.ndarray, name: str = "q_offset", batch: tuple | None = None) -> np.ndarray:
    """q_offset or key_lengths as an int64 array, checked: integer, and (given the scores' leading axes
    `batch`) broadcasting to them."""
    x = np.asarray(x)
    validation.positions(name, x.shape, str(x.dtype), np.issubdtype(x.dtype, np.integer),
                     x.shape if batch is None else batch)
    return x.astype(np.int64, copy=False)


def _both(visible: np.ndarray | None, rule: np.ndarray) -> np.ndarray:
    return rule if visible is None else visible & rule


def _masked_softmax(scores: np.ndarray, visible: np.ndarray | None, sinks: np.ndarray | None = None) -> np.ndarray:
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
        exp = np.exp(scores - np.max(scores, axis=-1, keepdims=True, initial=-np.inf))  # (..., L, S)
        return exp / np.sum(exp, axis=-1, keepdims=True)
    scores = np.where(visible, scores, -np.inf)  # hidden entries become exp(-inf) = 0 below
    row_max = np.max(scores, axis=-1, keepdims=True, initial=-np.inf)  # (..., L, 1)
    row_max = np.where(row_max == -np.inf, 0, row_max)  # fully masked row: any finite shift will do
    exp = np.exp(scores - row_max)  # (..., L, S)
    total = np.sum(exp, axis=-1, keepdims=True)  # (..., L, 1)
    return exp / np.where(total == 0, 1, total)  # fully masked row: 0 / 1 = 0, never 0 / 0


def _sunk_softmax(scores: np.ndarray, visible: np.ndarray | None, sinks: np.ndarray) -> np.ndarray:
    """_masked_softmax with each row's sink logit in its denominator (and in the shift m_i)."""
    if visible is not None:
        scores = np.where(visible, scores, -np.inf)  # hidden entries become exp(-inf) = 0 below
    row_max = np.maximum(np.max(scores, axis=-1, keepdims=True, initial=-np.inf), sinks)  # (..., L, 1)
    row_max = np.where(row_max == -np.inf, 0, row_max)  # no key seen and a sink of -inf: any finite shift
    exp = np.exp(scores - row_max)  # (..., L, S)
    total = np.sum(exp, axis=-1, keepdims=True) + np.exp(sinks - row_max)  # (..., L, 1): the sink's share too
    return exp / np.where(total == 0, 1, total)  # a sink of -inf and no key seen: 0 / 1 = 0, never 0 / 0


def _sink_logits(sinks: np.ndarray | None, batch: tuple, grouped: bool, work: np.dtype) -> np.ndarray | None:
    """sinks broadcasting to the scores' leading axes (..., H), checked, in the working dtype and laid out
    against the scores (..., L, S): (..., 1, 1), grouped (..., Hkv, G, 1, 1) with enable_gqa; None without."""
    if sinks is None:
        return None
    sinks = np.asarray(sinks)
    return sinks.astype(work, copy=False).reshape(validation.sinks(sinks.shape, batch, grouped))


def _alibi(slopes: np.ndarray | None, bias: np.ndarray | None, q_offset: int | np.ndarray, batch: tuple,
           grouped: bool, L: int, S: int, work: np.dtype) -> np.ndarray | None:
    """bias plus ALiBi's -slope_h * |p_i - j| (_alibi_tile over every query and key) as one additive bias
    (..., L, S) in the working dtype; bias unchanged without slopes. slopes (H,) or (B, H), checked against the
    scores' leading axes `batch` ((..., Hkv, G) where `grouped`, enable_gqa)."""
    if slopes is None:
        return bias
    q_offset = _integers(q_offset, "q_offset", batch)
    alibi = _alibi_tile(_alibi_slopes(slopes, batch, grouped, work), q_offset, slice(0, L), slice(0, S))
    return alibi if bias is None else np.asarray(bias, dtype=work) + alibi  # a -inf bias still hides


def _alibi_slopes(slopes: np.ndarray | None, batch: tuple, grouped: bool, work: np.dtype) -> np.ndarray | None:
    """ALiBi's slopes (H,) or (B, H), checked against the scores' leading axes `batch`, in the working dtype and
    laid out against the scores (..., L, S): (..., 1, 1), grouped (..., Hkv, G, 1, 1) with enable_gqa; None
    without."""
    if slopes is None:
        return None
    slopes = np.asarray(slopes)
    return slopes.astype(work, copy=False).reshape(validation.alibi_slopes(slopes.shape, batch, grouped))


def _alibi_tile(slopes: np.ndarray, q_offset: np.ndarray, rows: slice, cols: slice) -> np.ndarray:
    """ALiBi's bias on the queries `rows` and keys `cols`, from their positions: -slope_h * |p_i - j|,
    p_i = q_offset + i; slopes laid out (..., 1, 1) (_alibi_slopes), q_offset integers (...). Returns
    (..., rows, cols), never more than the tile."""
    positions = q_offset[..., None, None] + np.arange(rows.start, rows.stop)[:, None]  # (..., rows, 1)
    distance = np.abs(positions - np.arange(cols.start, cols.stop))  # (..., rows, cols)
    return -slopes * distance.astype(slopes.dtype)  # (..., 1, 1) x (..., rows, cols)


def _sunk_rows(out: np.ndarray, lse: np.ndarray, sinks: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """out (..., L, Ev) and lse (..., L) of a softmax over the keys, with each row's sink joined once, as one more
    partial result of out 0 and lse the sink: lse' = logaddexp(lse, sink), out' = exp(lse - lse') out (a row that
    sees no key keeps zeros); both unchanged without sinks. sinks broadcast to (..., H), lse's leading axes."""
    if sinks is None:
        return out, lse
    sink = _sink_logits(sinks, lse.shape[:-1], False, lse.dtype)[..., 0]
    none = (lse == -np.inf) & (sink == -np.inf)  # no key and a sink of -inf: lse' -inf, and no NaN in its gradient
    merged = np.where(none, -np.inf, np.logaddexp(np.where(none, 0, lse), np.where(none, 0, sink)))  # (..., L)
    shift = np.where(merged == -np.inf, 0, merged)  # there exp(-inf - 0) = 0, never NaN
    return (np.exp(lse - shift)[..., None] * out).astype(out.dtype, copy=False), merged


def _sink_gradient(D: np.ndarray, sink_share: np.ndarray, laid: np.ndarray, shape: tuple) -> np.ndarray:
    """d sink = -sum over the rows of p_sink_i * D_i, D_i = rowsum(dP * P) = dO_i . O_i, p_sink_i the sink's
    share of row i's denominator, exp(sink) / (exp(sink) + sum_j exp(s_ij)): the sink reaches the loss only
    through the denominator, dP_ij / d sink = -P_ij p_sink_i. D and sink_share (..., L, 1); the sum over the
    rows and over the axes the sinks `laid` (_sink_logits) were broadcast along, in the sinks' own `shape`."""
    d_sinks = -np.sum(sink_share * D, axis=(-2, -1))  # (..., L, 1) -> (...)
    return _sum_to(d_sinks, laid.shape[:-2]).reshape(shape)


def _sum_to(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum x over the axes along which an array of `shape` was broadcast to x's shape."""
    x = np.sum(x, axis=tuple(range(x.ndim - len(shape)))) if x.ndim > len(shape) else x
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    return np.sum(x, axis=axes, keepdims=True) if axes else x


def _activation(name: str, x: np.ndarray) -> np.ndarray:
    """relu(x) = max(x, 0); gelu(x) = x * Phi(x) = x / 2 * (1 + erf(x / sqrt(2))), the exact form."""
    if name == "relu":
        return np.maximum(x, 0)
    return x / 2 * (1 + _erf(x / math.sqrt(2)))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    """sigmoid(x) = 1 / (1 + exp(-x)), as exp(-log(1 + exp(-x))): no overflow for very negative x."""
    return np.exp(-np.logaddexp(0, -x))


def _silu(x: np.ndarray) -> np.ndarray:
    """silu(x) = x * sigmoid(x)."""
    return x * _sigmoid(x)


def _gated(name: str, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """The gated activation of the feed-forward network, (..., L, F) -> (..., L, F):
    swiglu:     silu(gate) * up
    swiglu_oss: (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g),  g = min(gate, limit)
    gpt-oss's clamped form (GptOssExperts), alpha = 1.702 and limit = 7.0 (validation.SWIGLU_OSS_*)."""
    if name == "swiglu":
        return _silu(gate) * up
    alpha, limit = validation.SWIGLU_OSS_ALPHA, validation.SWIGLU_OSS_LIMIT
    gate = np.minimum(gate, limit)  # clamped above only
    return (np.clip(up, -limit, limit) + 1) * gate * _sigmoid(alpha * gate)


def _erf(x: np.ndarray) -> np.ndarray:
    """erf, elementwise: NumPy has none, so math.erf is vectorised (exact to the last bit)."""
    return np.vectorize(math.erf, otypes=[x.dtype])(x)
