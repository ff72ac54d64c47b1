"""The pieces the attention functions build on, in JAX: which keys a query may see (the masks built from
positions, and `_visible`, which joins them with a mask and a bias), mask_mod and score_mod on the scores (their
index arrays laid out as the scores, and a ScoreMod's parameters apart for the gradients), the softmax over the
visible keys, the sum of a gradient over an input's broadcast axes, the activations of the feed-forward network,
and the rank and dtype helpers that JAX's strict modes ask for.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

This module imports no other module of the backend, so that functional, fast, flash, linear, gradients and
modules can all import it and the imports run one way.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.scipy.special

from attention_np.common import validation
from attention_np.common.mods import Aligned, ScoreMod, from_keywords
from attention_np.common.records import Structure


def causal_mask(L: int, S: int, *, q_offset: int | jax.Array = 0) -> jax.Array:
    """Boolean (..., L, S), (...) the shape of q_offset: True where key j <= p_i = q_offset + i, the keys a
    query may see (top-left aligned for q_offset 0, bottom-right for q_offset S - L): the catalogue's
    causal(q_offset) on the grid."""
    return _on_grid(Structure(is_causal=True, q_offset=_integers(q_offset), window=None, key_lengths=None), L, S)


def window_mask(L: int, S: int, window: tuple[int | None, int | None], *,
                q_offset: int | jax.Array = 0) -> jax.Array:
    """Boolean (..., L, S), (...) the shape of q_offset: True where p_i - left <= j <= p_i + right,
    p_i = q_offset + i; a side that is None is unbounded: the catalogue's sliding_window(left, right, q_offset)
    on the grid."""
    structure = Structure(is_causal=False, q_offset=_integers(q_offset), window=validation.window(window),
                          key_lengths=None)
    return _on_grid(structure, L, S)


def _on_grid(structure: Structure, L: int, S: int) -> jax.Array:
    """The position keywords' mask function evaluated on every (query, key) pair: (..., L, S), (...) the shape
    of q_offset (a window of two unbounded sides hides nothing and reads no q_offset: broadcast)."""
    shape = (*jnp.shape(structure.q_offset), L, S)
    return jnp.broadcast_to(_by_position(structure, len(shape))(None, None, *_positions(L, S, len(shape))), shape)


def alibi_slopes(H: int) -> jax.Array:
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
    return jnp.asarray(slopes, dtype=float)  # jax: float32 unless x64 is enabled


def padding_mask(lengths: jax.Array, S: int) -> jax.Array:
    """Boolean (B, 1, 1, S) from lengths (B,): True for the first lengths[b] keys of sequence b.

    The two singleton axes stand for H and L, so the mask broadcasts over (B, H, L, S) scores.
    """
    lengths = jnp.asarray(lengths)
    return _ranked(jnp.arange(S), lengths.ndim + 3) < lengths[..., None, None, None]  # (B,) -> (B, 1, 1, S)


def _visible(mask: jax.Array | None, bias: jax.Array | None, structure: Structure,
             scores_shape: tuple) -> jax.Array | None:
    """True where a query may see a key: kept by `mask`, not -inf in `bias`, allowed by the structure
    (is_causal, q_offset, window, key_lengths; built from positions). Broadcasts to the scores' shape
    (..., L, S); None when nothing hides a key."""
    L, S = scores_shape[-2:]
    visible = None
    if mask is not None:
        validation.broadcasts_to("mask", jnp.shape(mask), scores_shape, "..., L, S")
        mask = jnp.asarray(mask)
        floating = jnp.issubdtype(mask.dtype, jnp.floating)
        binary = jnp.all((mask == 0.0) | (mask == 1.0)) if floating else None
        # jax: under jit the values cannot be seen, of an argument nor of a mask the jitted function captures
        seen = None if binary is None or isinstance(binary, jax.core.Tracer) else bool(binary)
        validation.binary_mask(floating, seen)
        visible = _ranked(mask.astype(bool), len(scores_shape))  # nonzero: visible (jax: a cast, as strict
        # promotion forbids mask != 0)
    if bias is not None:
        validation.broadcasts_to("bias", jnp.shape(bias), scores_shape, "..., L, S")
        visible = _both(visible, _ranked(jnp.asarray(bias) != -jnp.inf, len(scores_shape)))
    batch, rank = scores_shape[:-2], len(scores_shape)
    key_lengths = None if structure.key_lengths is None else _integers(structure.key_lengths, "key_lengths", batch)
    by_position = _by_position(structure._replace(q_offset=_integers(structure.q_offset, "q_offset", batch),
                                                  window=validation.window(structure.window),
                                                  key_lengths=key_lengths), rank)  # jax: q_offset may be traced
    if by_position is not None:
        visible = _both(visible, by_position(None, None, *_positions(L, S, rank)))  # (..., L, S)
    return visible


def _by_position(structure: Structure, rank: int) -> Callable[..., Any] | None:
    """The mask function of the position keywords (from_keywords), q_offset and key_lengths (...) laid out
    against scores (..., L, S) of `rank` axes: evaluated at _positions it gives (..., L, S); None where no keyword
    hides a key."""
    def aligned(x: jax.Array | None) -> Aligned | None:  # (...) -> (..., 1, 1) at the scores' rank
        return None if x is None else Aligned(_ranked(jnp.asarray(x)[..., None, None], rank))
    return from_keywords(structure._replace(q_offset=aligned(structure.q_offset),
                                            key_lengths=aligned(structure.key_lengths)))[0]


def _positions(L: int, S: int, rank: int, rows: int | jax.Array = 0,
               cols: int | jax.Array = 0) -> tuple[jax.Array, jax.Array]:
    """q_idx (1, ..., L, 1) and kv_idx (1, ..., 1, S) from rows and cols on (a tile's first query and key, which
    may be traced), at `rank` axes. jax: the same rank as the scores', as rank promotion may be refused."""
    return _ranked((rows + jnp.arange(L))[:, None], rank), _ranked(cols + jnp.arange(S), rank)


class _Mods(NamedTuple):
    """A call's mask_mod and score_mod, and what their index arrays run over: b over 0..B-1 (the scores' batch
    size), h over q's heads 0..H-1; hashable (the functions by identity), so that flash's static tiling holds
    it."""

    mask_mod: Callable[..., Any] | None
    score_mod: Callable[..., Any] | None
    B: int
    H: int


def _mods(function: str, q: jax.Array, k: jax.Array, v: jax.Array, mask_mod: Callable[..., Any] | None,
          score_mod: Callable[..., Any] | None) -> _Mods | None:
    """The checked mods (q, k and v of four axes, validation.mods_inputs); None without any, so that the paths
    without mods build nothing more than before."""
    if mask_mod is None and score_mod is None:
        return None
    B, H = validation.mods_inputs(function, q.shape, k.shape, v.shape)
    return _Mods(mask_mod=mask_mod, score_mod=score_mod, B=B, H=H)


def _mod_indices(mods: _Mods, heads: tuple, rows: jax.Array, cols: jax.Array,
                 transposed: bool = False) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """b, h, q_idx, kv_idx at the rank of the scores (B, *heads, rows, cols) as the code lays them out: heads
    (H,), or (Hkv, G) grouped (query head h = h_kv * G + g); rows and cols the queries' and keys' indices
    (L,) and (S,), or a tile's; `transposed`: the scores are (B, *heads, cols, rows)."""
    n = len(heads) + 3
    b = jnp.arange(mods.B).reshape(mods.B, *(1,) * (n - 1))  # (B, 1, .., 1)
    h = jnp.arange(mods.H).reshape(1, *heads, 1, 1)  # (1, *heads, 1, 1)
    q_idx, kv_idx = _ranked(rows[:, None], n), _ranked(cols, n)  # (1, .., L, 1), (1, .., 1, S)
    if transposed:
        q_idx, kv_idx = _ranked(rows, n), _ranked(cols[:, None], n)  # (1, .., 1, L), (1, .., S, 1)
    return b, h, q_idx, kv_idx


def _modded(mods: _Mods | None, scores: jax.Array, visible: jax.Array | None,
            indices: tuple) -> tuple[jax.Array, jax.Array | None]:
    """The scores after score_mod, and `visible` and-ed with mask_mod and with where the modded score is not
    -inf (a -inf score hides its key, as in flex_attention); scores (B, *heads, L, S) in full, as the indices
    are laid out (_mod_indices)."""
    if mods is None:
        return scores, visible
    if mods.score_mod is not None:
        scores = _score_modded(mods, scores, indices)
        visible = _both(visible, scores != -jnp.inf)
    if mods.mask_mod is not None:
        visible = _both(visible, _mask_modded(mods, indices, scores.shape))
    return scores, visible


def _score_modded(mods: _Mods, scores: jax.Array, indices: tuple,
                  parameters: dict[str, jax.Array] | None = None) -> jax.Array:
    """score_mod(scores, b, h, q_idx, kv_idx), checked, in the scores' shape and dtype; `parameters`: given
    where mods.score_mod is a rule that takes them as keywords (_score_rule)."""
    modded = mods.score_mod(scores, *indices, **(parameters or {}))
    validation.score_mod_result(jnp.shape(modded), scores.shape)
    return jnp.broadcast_to(modded, scores.shape).astype(scores.dtype)


def _mask_modded(mods: _Mods, indices: tuple, shape: tuple) -> jax.Array:
    """mask_mod(b, h, q_idx, kv_idx), checked (booleans broadcasting to the scores' shape), at their rank."""
    shown = jnp.asarray(mods.mask_mod(*indices))
    validation.mask_mod_result("mask_mod", shown.shape, str(shown.dtype), shape)
    return _ranked(shown, len(shape))


def _modded_whole(mods: _Mods | None, scores: jax.Array, visible: jax.Array | None, batch: tuple,
                  heads: tuple) -> tuple[jax.Array, jax.Array | None]:
    """_modded on all the scores (..., L, S) at once, as scaled_dot_product_attention lays them out: broadcast
    to (*batch, L, S) first (b runs over the whole batch), q_idx 0..L-1 and kv_idx 0..S-1 (not shifted by
    q_offset: a mod takes its own); heads as for _mod_indices. Without mods, the scores and visible as given."""
    if mods is None:
        return scores, visible
    scores = jnp.broadcast_to(scores, (*batch, *scores.shape[-2:]))  # (B, *heads, L, S)
    L, S = scores.shape[-2:]
    return _modded(mods, scores, visible, _mod_indices(mods, heads, jnp.arange(L), jnp.arange(S)))


def _score_rule(score_mod: Callable[..., Any] | None) -> tuple[Callable[..., Any] | None, dict[str, jax.Array]]:
    """score_mod as (rule, parameters), rule(score, b, h, q_idx, kv_idx, **parameters): a ScoreMod's rule and
    its parameters as JAX arrays, the arguments a gradient reaches; a plain function (or None) and no
    parameters otherwise."""
    if isinstance(score_mod, ScoreMod):  # jax: its parameters apart, as arguments, so that gradients reach them
        return score_mod.rule, {name: jnp.asarray(x) for name, x in score_mod.parameters.items()}
    return score_mod, {}


def _with_parameters(score_mod: Callable[..., Any] | None,
                     parameters: dict[str, jax.Array]) -> Callable[..., Any] | None:
    """score_mod with these values of its parameters (ScoreMod.replace); a plain function (or None) as it is."""
    return score_mod.replace(**parameters) if isinstance(score_mod, ScoreMod) else score_mod


def _integers(x: int | jax.Array, name: str = "q_offset", batch: tuple | None = None) -> jax.Array:
    """q_offset or key_lengths as an array of JAX's default int, checked: integer, and (given the scores'
    leading axes `batch`) broadcasting to them."""
    x = jnp.asarray(x)
    validation.positions(name, x.shape, str(x.dtype), jnp.issubdtype(x.dtype, jnp.integer),
                     x.shape if batch is None else batch)
    return x.astype(int)  # jax: one int dtype for the positions, as strict promotion forbids mixing them


def _at_least_float32(dtype: Any) -> Any:
    """float32 for float16 and bfloat16, the dtype itself otherwise. jax: jnp.promote_types obeys strict
    promotion, which refuses to promote float64 with float32."""
    return dtype if jnp.finfo(dtype).bits >= 32 else jnp.dtype(jnp.float32)


def _ranked(x: jax.Array, ndim: int) -> jax.Array:
    """x with leading axes of size 1 up to `ndim` axes. jax: broadcasting then needs no rank promotion, so
    the backend works with jax_numpy_rank_promotion="raise"."""
    return jnp.reshape(x, (1,) * (ndim - x.ndim) + x.shape)


def _both(visible: jax.Array | None, rule: jax.Array) -> jax.Array:
    return rule if visible is None else visible & rule


def _masked_softmax(scores: jax.Array, visible: jax.Array | None, sinks: jax.Array | None = None) -> jax.Array:
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
        row_max = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True, initial=-jnp.inf))
        exp = jnp.exp(scores - row_max)  # (..., L, S)
        return exp / jnp.sum(exp, axis=-1, keepdims=True)
    scores = jnp.where(visible, scores, -jnp.inf)  # hidden entries become exp(-inf) = 0 below
    row_max = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True, initial=-jnp.inf))  # (..., L, 1)
    # jax: stop_gradient, as the shift cancels in the softmax and needs no gradient
    row_max = jnp.where(row_max == -jnp.inf, 0.0, row_max)  # fully masked row: any finite shift will do
    exp = jnp.exp(scores - row_max)  # (..., L, S)
    total = jnp.sum(exp, axis=-1, keepdims=True)  # (..., L, 1)
    return exp / jnp.where(total == 0.0, 1.0, total)  # fully masked row: 0 / 1 = 0, never 0 / 0


def _sunk_softmax(scores: jax.Array, visible: jax.Array | None, sinks: jax.Array) -> jax.Array:
    """_masked_softmax with each row's sink logit in its denominator (and in the shift m_i)."""
    if visible is not None:
        scores = jnp.where(visible, scores, -jnp.inf)  # hidden entries become exp(-inf) = 0 below
    sinks = _ranked(sinks, scores.ndim)  # jax: no rank promotion
    row_max = jnp.maximum(jnp.max(scores, axis=-1, keepdims=True, initial=-jnp.inf), sinks)  # (..., L, 1)
    row_max = jax.lax.stop_gradient(jnp.where(row_max == -jnp.inf, 0.0, row_max))  # jax: the shift cancels;
    # no key seen and a sink of -inf: any finite shift
    exp = jnp.exp(scores - row_max)  # (..., L, S)
    total = jnp.sum(exp, axis=-1, keepdims=True) + jnp.exp(sinks - row_max)  # (..., L, 1): the sink's share too
    return exp / jnp.where(total == 0.0, 1.0, total)  # a sink of -inf and no key seen: 0 / 1 = 0, never 0 / 0


def _alibi(slopes: jax.Array | None, bias: jax.Array | None, q_offset: int | jax.Array, batch: tuple,
           grouped: bool, L: int, S: int, work: Any) -> jax.Array | None:
    """bias plus ALiBi's -slope_h * |p_i - j| (_alibi_tile over every query and key) as one additive bias
    (..., L, S) in the working dtype; bias unchanged without slopes. slopes (H,) or (B, H), checked against the
    scores' leading axes `batch` ((..., Hkv, G) where `grouped`, enable_gqa)."""
    if slopes is None:
        return bias
    q_offset = _integers(q_offset, "q_offset", batch)
    alibi = _alibi_tile(_alibi_slopes(slopes, batch, grouped, work), q_offset, 0, 0, L, S)
    return alibi if bias is None else _ranked(jnp.asarray(bias, dtype=work), alibi.ndim) + alibi  # -inf hides


def _alibi_slopes(slopes: jax.Array | None, batch: tuple, grouped: bool, work: Any) -> jax.Array | None:
    """ALiBi's slopes (H,) or (B, H), checked against the scores' leading axes `batch`, in the working dtype and
    laid out against the scores (..., L, S): (..., 1, 1), grouped (..., Hkv, G, 1, 1) with enable_gqa; None
    without. jax: at the scores' rank, as rank promotion may be refused."""
    if slopes is None:
        return None
    slopes = jnp.asarray(slopes)
    laid = slopes.astype(work).reshape(validation.alibi_slopes(slopes.shape, batch, grouped))
    return _ranked(laid, len(batch) + 2)


def _alibi_tile(slopes: jax.Array, q_offset: jax.Array, rows: int | jax.Array, cols: int | jax.Array, L: int,
                S: int) -> jax.Array:
    """ALiBi's bias on the L queries from `rows` on and the S keys from `cols` on, from their positions:
    -slope_h * |p_i - j|, p_i = q_offset + i; slopes laid out (..., 1, 1) (_alibi_slopes), q_offset integers
    (...). Returns (..., L, S), never more than the tile."""
    rank = slopes.ndim
    q_idx, kv_idx = _positions(L, S, rank, rows, cols)  # (1, ..., L, 1), (1, ..., 1, S)
    positions = _ranked(q_offset[..., None, None], rank) + q_idx  # (..., L, 1)
    return -slopes * jnp.abs(positions - kv_idx).astype(slopes.dtype)  # (..., 1, 1) x (..., L, S)


def _sunk_rows(out: jax.Array, lse: jax.Array, sinks: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """out (..., L, Ev) and lse (..., L) of a softmax over the keys, with each row's sink joined once, as one more
    partial result of out 0 and lse the sink: lse' = logaddexp(lse, sink), out' = exp(lse - lse') out (a row that
    sees no key keeps zeros); both unchanged without sinks. sinks broadcast to (..., H), lse's leading axes."""
    if sinks is None:
        return out, lse
    sink = _ranked(_sink_logits(sinks, lse.shape[:-1], False, lse.dtype)[..., 0], lse.ndim)  # jax: no rank promotion
    none = (lse == -jnp.inf) & (sink == -jnp.inf)  # no key and a sink of -inf: lse' -inf, and no NaN in its gradient
    merged = jnp.where(none, -jnp.inf, jnp.logaddexp(jnp.where(none, 0.0, lse), jnp.where(none, 0.0, sink)))  # (..., L)
    shift = jnp.where(merged == -jnp.inf, 0.0, merged)  # there exp(-inf - 0) = 0, never NaN
    return (jnp.exp(lse - shift)[..., None] * out.astype(lse.dtype)).astype(out.dtype), merged


def _sink_logits(sinks: jax.Array | None, batch: tuple, grouped: bool, work: Any) -> jax.Array | None:
    """sinks broadcasting to the scores' leading axes (..., H), checked, in the working dtype and laid out
    against the scores (..., L, S): (..., 1, 1), grouped (..., Hkv, G, 1, 1) with enable_gqa; None without."""
    if sinks is None:
        return None
    sinks = jnp.asarray(sinks)
    return sinks.astype(work).reshape(validation.sinks(sinks.shape, batch, grouped))


def _sum_to(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Sum x over the axes along which an array of `shape` (at x's rank) was broadcast to x's shape."""
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


def _activation(name: str, x: jax.Array) -> jax.Array:
    """relu(x) = max(x, 0); gelu(x) = x * Phi(x) = x / 2 * (1 + erf(x / sqrt(2))), the exact form."""
    if name == "relu":
        return jnp.maximum(x, 0.0)
    return x / 2 * (1 + jax.scipy.special.erf(x / math.sqrt(2)))


def _silu(x: jax.Array) -> jax.Array:
    """silu(x) = x * sigmoid(x)."""
    return x * jax.nn.sigmoid(x)


def _gated(name: str, gate: jax.Array, up: jax.Array) -> jax.Array:
    """The gated activation of the feed-forward network, (..., L, F) -> (..., L, F):
    swiglu:     silu(gate) * up
    swiglu_oss: (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g),  g = min(gate, limit)
    gpt-oss's clamped form (GptOssExperts), alpha = 1.702 and limit = 7.0 (validation.SWIGLU_OSS_*)."""
    if name == "swiglu":
        return _silu(gate) * up
    alpha, limit = validation.SWIGLU_OSS_ALPHA, validation.SWIGLU_OSS_LIMIT
    gate = jnp.minimum(gate, limit)  # clamped above only
    return (jnp.clip(up, -limit, limit) + 1) * gate * jax.nn.sigmoid(alpha * gate)
